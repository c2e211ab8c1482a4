"""Cross-encoders: Hugging Face `*ForSequenceClassification` dirs (rerankers, NLI classifiers) as
`kbert.TaskModel`, scored and ranked as sentence-transformers' `CrossEncoder` scores and ranks them."""

import numpy as np
import pytest

import kbert

from helpers import KOREAN_SENTENCES, xlmr_dir

QUERY = "대한민국의 주권은 누구에게 있는가"
DOCUMENTS = ["대한민국의 주권은 국민에게 있고, 모든 권력은 국민으로부터 나온다.", "국회는 법률을 제정한다.",
             "이 영화 정말 재밌다 ㅋㅋㅋㅋ", "", "ＡＢＣ　①②… 한국어ﾊﾝｸﾞﾙ  여러   칸",
             "대한민국 헌법 " * 40]  # the last pair is cut to the model's 64 tokens, the longer text first


def _noisy(model):
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_an_xlm_roberta_reranker_scores_and_ranks_as_sentence_transformers_cross_encoder(tmp_path):
    """A one-logit XLMRobertaForSequenceClassification (BGE-reranker-v2-m3's layout): pairs encoded as
    `<s> a </s></s> b </s>` with transformers' ids and truncation, sigmoid scores equal to CrossEncoder.predict,
    raw logits to transformers', `rank` in CrossEncoder.rank's order and form."""
    import torch
    import transformers
    from sentence_transformers import CrossEncoder

    out = xlmr_dir(tmp_path, model_class="XLMRobertaForSequenceClassification", num_labels=1)
    hf = _noisy(transformers.AutoModelForSequenceClassification.from_pretrained(out).eval())
    hf.save_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = kbert.TaskModel.load(out)
    assert model.task == "regression" and model.activation == "sigmoid" and model.max_length == 64
    queries = [QUERY] * len(DOCUMENTS) + KOREAN_SENTENCES[:3]
    docs = DOCUMENTS + KOREAN_SENTENCES[3:6]
    expected_ids = tok(queries, docs, truncation=True, max_length=64)["input_ids"]  # batched, as CrossEncoder
    for q, d, ids in zip(queries, docs, expected_ids):  # (a lone call drops an empty second text; a batch not)
        assert model.tokenizer.encode(q, pair=d, max_length=64).ids == ids, d
    batch = tok(queries, docs, truncation=True, max_length=64, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = hf(**batch).logits[:, 0].numpy()
    np.testing.assert_allclose(model.predict(queries, pairs=docs, activation="identity"), logits, atol=2e-5)
    ce = CrossEncoder(out, device="cpu")
    expected = ce.predict(list(zip(queries, docs)))
    np.testing.assert_allclose(model.predict(queries, pairs=docs), expected, atol=2e-5)
    assert not np.allclose(expected, expected[0])  # the pairs are told apart
    ranked = model.rank(QUERY, DOCUMENTS, return_documents=True)
    reference = ce.rank(QUERY, DOCUMENTS, return_documents=True)
    assert [r["corpus_id"] for r in ranked] == [r["corpus_id"] for r in reference]
    assert [r["text"] for r in ranked] == [r["text"] for r in reference]
    np.testing.assert_allclose([r["score"] for r in ranked], [r["score"] for r in reference], atol=2e-5)
    top = model.rank(QUERY, DOCUMENTS, top_k=2)
    assert top == [{"corpus_id": r["corpus_id"], "score": r["score"]} for r in ranked[:2]]
    assert model.rank(QUERY, []) == []
    with pytest.raises(ValueError, match="top_k"):
        model.rank(QUERY, DOCUMENTS, top_k=0)
    with pytest.raises(ValueError, match="activation"):
        model.predict(QUERY, pairs=DOCUMENTS[0], activation="softmax")


def test_a_bert_pair_classifier_loads_with_its_labels_and_a_classifier_cannot_rank(tmp_path):
    """A 3-label BertForSequenceClassification (a KLUE-NLI-style model): probabilities equal the softmax of
    transformers' logits, labels from id2label; rank refuses a model without one score; ELECTRA's head (GELU
    where BERT's pooler has tanh) is refused by name."""
    import torch
    import transformers

    from helpers import tiny_hf_config

    vocab = list(dict.fromkeys(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list("대한민국은주공화이다.회법률") + [
        f"##{c}" for c in "한국다은률회"]))
    vocab += [f"[unused{i}]" for i in range(99 - len(vocab))]
    out = tmp_path / "nli"
    config = tiny_hf_config("bert", num_labels=3, id2label={0: "entailment", 1: "neutral", 2: "contradiction"},
                            label2id={"entailment": 0, "neutral": 1, "contradiction": 2})
    torch.manual_seed(0)
    hf = _noisy(transformers.BertForSequenceClassification(config).eval())
    hf.save_pretrained(out)
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    model = kbert.TaskModel.load(str(out))
    assert model.task == "classification" and model.labels == ["entailment", "neutral", "contradiction"]
    premises, hypotheses = ["대한민국은 민주공화국이다.", "국회는 법률", ""], ["대한민국은 공화국", "국회", "법률"]
    tok = transformers.BertTokenizerFast(str(out / "vocab.txt"), do_lower_case=False, strip_accents=False)
    batch = tok(premises, hypotheses, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = torch.softmax(hf(**batch).logits, -1).numpy()
    np.testing.assert_allclose(model.predict(premises, pairs=hypotheses), expected, atol=2e-5)
    with pytest.raises(ValueError, match="one score per pair"):
        model.rank("대한민국", ["국회"])
    electra = tmp_path / "electra"
    transformers.ElectraForSequenceClassification(transformers.ElectraConfig(
        vocab_size=99, embedding_size=16, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=37, max_position_embeddings=64)).save_pretrained(electra)
    (electra / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="ELECTRA"):
        kbert.TaskModel.load(str(electra))
    with pytest.raises(FileNotFoundError, match="ForSequenceClassification"):
        kbert.TaskModel.load(xlmr_dir(tmp_path))  # an encoder without a head


def test_a_reranker_exports_as_a_saved_model_of_text_pairs_with_its_sigmoid(tmp_path):
    """`kbert.export` of a Hugging Face cross-encoder: a (texts, text_pairs) signature whose scores equal
    `TaskModel.predict` (the sigmoid inside the graph, XLM-RoBERTa's double separator too)."""
    import tensorflow as tf

    out = xlmr_dir(tmp_path, model_class="XLMRobertaForSequenceClassification", num_labels=1)
    path = kbert.export(out, str(tmp_path / "served"))
    fn = tf.saved_model.load(path).signatures["serving_default"]
    assert set(fn.structured_input_signature[1]) == {"texts", "text_pairs"}
    queries, docs = [QUERY] * len(DOCUMENTS), DOCUMENTS
    got = fn(texts=tf.constant(queries), text_pairs=tf.constant(docs))["predictions"].numpy()
    expected = kbert.TaskModel.load(out).predict(queries, pairs=docs)
    assert ((expected > 0) & (expected < 1)).all()
    np.testing.assert_allclose(got, expected, atol=1e-5)


def _task_model(tmp_path, task, labels, target=(0.0, 1.0)):
    """A kbert pair model on a small BERT with a WordPiece vocabulary (an untrained, noisy head)."""
    from kbert.data.corpus import corpus
    from kbert.data.features import build_network
    from kbert.models.tasks import TaskNetwork

    tok = kbert.Tokenizer.train(corpus(["kolaw", "kobill"]), vocab_size=700, algorithm="wordpiece", progress=False)
    cfg = kbert.ModelConfig.preset("bert-tiny", vocab_size=tok.vocab_size, hidden_size=32, num_heads=2,
                                   intermediate_size=64, num_layers=2, max_position=64)
    path = kbert.save_model(kbert.BertBackbone(cfg), str(tmp_path / "base"), tokenizer=tok)
    emb = kbert.Embedder.load(path)
    network = TaskNetwork(emb.backbone, task, len(labels) if labels else 1, 0.0, target, "pooler", -1)
    build_network(network, emb.tokenizer)
    rng = np.random.default_rng(0)
    for v in network.head.weights:
        v.assign(rng.normal(0, 0.5, v.shape).astype("float32"))
    meta = {"task": task, "labels": labels, "max_length": 40, "pooling": "pooler", "layers": -1,
            "pair_column": "b", "target": list(target)}
    return kbert.TaskModel(network, emb.tokenizer, meta)


@pytest.mark.parametrize("task", ["regression", "pair-classification"])
def test_a_kbert_cross_encoder_exports_for_sentence_transformers_cross_encoder(tmp_path, task):
    """`kbert.export_transformers(task_model, dir)`: BertForSequenceClassification whose CrossEncoder scores equal
    TaskModel.predict (a regression's target scaling folded in, its identity output kept; a classifier's
    probabilities with apply_softmax), truncated at the model's tuned length; kbert reads the dir back."""
    from sentence_transformers import CrossEncoder

    labels = None if task == "regression" else ["다름", "같음"]
    model = _task_model(tmp_path, task, labels, target=(2.6, 1.4) if task == "regression" else (0.0, 1.0))
    out = kbert.export_transformers(model, str(tmp_path / "ce"))
    queries = [QUERY] * len(DOCUMENTS) + KOREAN_SENTENCES[:2]
    docs = DOCUMENTS + KOREAN_SENTENCES[2:4]
    expected = model.predict(queries, pairs=docs)
    ce = CrossEncoder(out, device="cpu")
    got = ce.predict(list(zip(queries, docs)), apply_softmax=task != "regression")
    np.testing.assert_allclose(got, expected, atol=2e-5)
    # a two-label pair classifier ranks by its second label's probability ("같음"), a regression by its value
    ranked = model.rank(QUERY, DOCUMENTS)
    own = expected[:len(DOCUMENTS)] if task == "regression" else expected[:len(DOCUMENTS), 1]
    assert [r["corpus_id"] for r in ranked] == list(np.argsort(-own, kind="stable"))
    np.testing.assert_allclose([r["score"] for r in ranked], np.sort(own)[::-1], atol=1e-6)
    if task == "regression":
        assert expected.min() > 1  # on the label scale around the target mean 2.6, not squashed into (0, 1)
    again = kbert.TaskModel.load(out)
    assert again.labels == labels or (task == "regression" and again.task == "regression")
    np.testing.assert_allclose(again.predict(queries, pairs=docs), expected, atol=2e-5)


def test_a_reranker_read_from_hugging_face_writes_back_with_the_same_scores(tmp_path):
    """An XLM-RoBERTa reranker loaded, then written by kbert (BERT's layout with XLM-RoBERTa's tokenizer files):
    CrossEncoder on the copy gives the original's sigmoid scores."""
    from sentence_transformers import CrossEncoder

    out = xlmr_dir(tmp_path, model_class="XLMRobertaForSequenceClassification", num_labels=1)
    model = kbert.TaskModel.load(out)
    copy = kbert.export_transformers(model, str(tmp_path / "copy"))
    pairs = list(zip([QUERY] * len(DOCUMENTS), DOCUMENTS))
    np.testing.assert_allclose(CrossEncoder(copy, device="cpu").predict(pairs),
                               CrossEncoder(out, device="cpu").predict(pairs), atol=2e-5)


def test_search_with_a_reranker_rescores_the_first_stages_candidates(tmp_path):
    """`Embedder.search(..., reranker=model, candidates=k)`: each query's first k hits by the vectors, in the
    cross-encoder's order with its scores; only those k are re-scored; vectors instead of texts are refused."""
    emb = kbert.Embedder.load(xlmr_dir(tmp_path / "bi"))
    reranker = kbert.TaskModel.load(xlmr_dir(tmp_path / "ce", model_class="XLMRobertaForSequenceClassification",
                                             num_labels=1))
    queries = [QUERY, KOREAN_SENTENCES[0]]
    corpus = DOCUMENTS[:4] + KOREAN_SENTENCES[1:6]
    got = emb.search(queries, corpus, top_k=3, reranker=reranker, candidates=5)
    first = emb.search(queries, corpus, top_k=5)
    for query, hits, row in zip(queries, first, got):
        ids = [j for j, _ in hits]
        expected = reranker.rank(query, [corpus[j] for j in ids], top_k=3)
        assert row == [(ids[r["corpus_id"]], pytest.approx(r["score"], abs=1e-6)) for r in expected]
        assert {j for j, _ in row} <= set(ids)
    # more hits than candidates: the reranked first ones, then the search's own order and scores
    wide = emb.search(QUERY, corpus, top_k=6, reranker=reranker, candidates=3)
    plain = emb.search(QUERY, corpus, top_k=6)
    assert wide[3:] == plain[3:] and {j for j, _ in wide[:3]} == {j for j, _ in plain[:3]}
    assert [j for j, _ in wide[:3]] == [j for j, _ in emb.search(QUERY, corpus, top_k=3, reranker=reranker,
                                                                 candidates=3)]
    with pytest.raises(ValueError, match="texts"):
        emb.search(emb.encode(queries), corpus, reranker=reranker)
    with pytest.raises(ValueError, match="candidates"):
        emb.search(queries, corpus, reranker=reranker, candidates=0)


def test_a_reranker_ranks_alike_on_keras_jax_backend(tmp_path):
    """The same Hugging Face reranker on Keras' JAX backend (TensorFlow unimportable, a GPU host's install):
    `rank` gives this process's TensorFlow order and scores."""
    import json

    from helpers import BLOCK_TENSORFLOW, run_on_jax

    out = xlmr_dir(tmp_path, model_class="XLMRobertaForSequenceClassification", num_labels=1)
    expected = kbert.TaskModel.load(out).rank(QUERY, DOCUMENTS)
    script = BLOCK_TENSORFLOW + (
        "import json, kbert\n"
        f"ranked = kbert.TaskModel.load({out!r}).rank({QUERY!r}, {json.dumps(DOCUMENTS, ensure_ascii=False)})\n"
        "print(json.dumps(ranked))\n")
    got, _ = run_on_jax(script)
    assert [r["corpus_id"] for r in got] == [r["corpus_id"] for r in expected]
    np.testing.assert_allclose([r["score"] for r in got], [r["score"] for r in expected], atol=2e-5)


@pytest.mark.parametrize("kind", ["xlm-roberta", "bert", "xla"])
def test_pairs_of_mixed_lengths_run_packed_with_the_padded_scores(tmp_path, kind, monkeypatch):
    """A batch of pairs of mixed lengths runs as packed rows, several pairs to a row (each its own positions,
    attention and, for BERT, segment types), with the scores it gets padded; through XLA too, in bucketed
    shapes (padding rows and slots)."""
    import kbert.embed.task_model as task_model

    if kind == "bert":
        model = _task_model(tmp_path, "pair-classification", ["0", "1"])
    else:
        model = kbert.TaskModel.load(xlmr_dir(tmp_path, model_class="XLMRobertaForSequenceClassification",
                                              num_labels=1), jit_compile=kind == "xla")
    queries = [QUERY, "헌법", "국회", "대한민국"] * 4
    docs = DOCUMENTS[:4] + KOREAN_SENTENCES[:6] + ["법", "가", "국민의 권리와 의무", "", "재판", "선거"]
    packed = model.predict(queries, pairs=docs)
    assert ("packed", kind == "xla") in model._fns  # it ran packed
    monkeypatch.setattr(task_model, "PACK_WHEN", -1.0)  # never pack
    model.jit_compile = False
    np.testing.assert_allclose(model.predict(queries, pairs=docs), packed, atol=2e-5)


def test_a_cross_encoder_compiling_in_the_background_answers_from_the_graph_meanwhile(tmp_path, monkeypatch):
    """`TaskModel(jit_compile="background")` (what `kbert serve` runs its classifiers and rerankers with): a batch
    whose bucketed shape XLA has not compiled runs on the graph while a thread compiles it; the same batch then
    runs through XLA, with the same scores."""
    import threading

    path = xlmr_dir(tmp_path, model_class="XLMRobertaForSequenceClassification", num_labels=1)
    model, graph = kbert.TaskModel.load(path, jit_compile="background"), kbert.TaskModel.load(path)
    calls = []  # (function, through XLA, from the caller's thread)
    function = model._function
    monkeypatch.setattr(model, "_function", lambda kind, xla: calls.append(
        (kind, xla, threading.current_thread() is threading.main_thread())) or function(kind, xla))
    queries, docs = [QUERY, "헌법", "국회"] * 3, DOCUMENTS[:3] + KOREAN_SENTENCES[:6]
    first = model.predict(queries, pairs=docs)  # not compiled yet: the graph answers, a thread compiles
    model.wait_compiled()
    assert ("packed", False, True) in calls and ("packed", True, True) not in calls
    assert ("packed", True, False) in calls
    assert model.compiling == 0 and model.compiled_shapes == 1
    again = model.predict(queries, pairs=docs)
    assert calls[-1] == ("packed", True, True) and model.compiled_shapes == 1
    expected = graph.predict(queries, pairs=docs)
    np.testing.assert_allclose(first, expected, atol=2e-5)
    np.testing.assert_allclose(again, expected, atol=2e-5)
    single = model.predict([QUERY])  # a new shape: compiled in the background as well
    model.wait_compiled()
    assert calls.count(("packed", True, False)) == 2 and model.compiled_shapes == 2
    np.testing.assert_allclose(model.predict([QUERY]), single, atol=2e-5)
    np.testing.assert_allclose(single, graph.predict([QUERY]), atol=2e-5)
    with pytest.raises(ValueError, match="`jit_compile` must be one of"):
        kbert.TaskModel.load(path, jit_compile="yes")


def test_evaluate_retrieval_with_a_reranker_reorders_only_the_candidates(tmp_path):
    """`kbert.evaluate_retrieval(..., reranker=, candidates=k)`: the first k hits are re-scored, so recall at k
    and beyond is the vectors' own, while the figures inside the first k follow the reranker's order."""
    emb = kbert.Embedder.load(xlmr_dir(tmp_path / "bi"))
    reranker = kbert.TaskModel.load(xlmr_dir(tmp_path / "ce", model_class="XLMRobertaForSequenceClassification",
                                             num_labels=1))
    corpus = DOCUMENTS[:4] + KOREAN_SENTENCES
    queries = [QUERY, KOREAN_SENTENCES[0][:6], KOREAN_SENTENCES[3][:8]]
    relevant = [{0}, {4}, {7}]
    plain = kbert.evaluate_retrieval(emb, queries, corpus, relevant, precision_recall_at_k=[1, 3, 5])
    reranked = kbert.evaluate_retrieval(emb, queries, corpus, relevant, precision_recall_at_k=[1, 3, 5],
                                        reranker=reranker, candidates=3)
    assert reranked["recall@3"] == plain["recall@3"] and reranked["recall@5"] == plain["recall@5"]
    first = [h[0][0] for h in emb.search(queries, corpus, top_k=1, reranker=reranker, candidates=3)]
    assert reranked["accuracy@1"] == pytest.approx(np.mean([j in r for j, r in zip(first, relevant)]))

