"""kbert.SparseEncoder: SPLADE vectors against sentence-transformers' SparseEncoder on the same weights (max and sum
pooling, both activations), a kbert pretraining dir, decode, search, max_active_dims, errors and the JAX path."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from helpers import hf_masked_lm_dir, inference_free_splade_dir, needs_shared, run_on_jax

TEXTS = ["서울은 한국의 수도이다.", "나는 오늘 학교에 간다.", "이 영화 정말 재밌다", "국회는 법률을 만든다.",
         "서울의 국회는 오늘 법률을 만든다 재밌다 정말 학교"]


def _st_dir(tmp_path, pooling="max", activation="relu", module="Transformer"):
    """A sentence-transformers SparseEncoder on a tiny BERT, saved; and it. `module`: sentence-transformers 6's
    Transformer(transformer_task="fill-mask") or version 5's MLMTransformer (6 still reads and writes it)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.models import Transformer
    from sentence_transformers.sparse_encoder.models import MLMTransformer, SpladePooling

    path, _, tok = hf_masked_lm_dir(tmp_path, TEXTS)
    tok.save_pretrained(path)
    first = Transformer(path, transformer_task="fill-mask") if module == "Transformer" else MLMTransformer(path)
    st = SparseEncoder(modules=[first, SpladePooling(pooling, activation_function=activation)])
    out = str(tmp_path / f"st-{pooling}-{activation}")
    st.save(out)
    return out, st


@pytest.mark.parametrize("pooling,activation,module", [("max", "relu", "Transformer"), ("sum", "relu", "Transformer"),
                                                       ("max", "log1p_relu", "MLMTransformer")])
def test_vectors_match_sentence_transformers(tmp_path, pooling, activation, module):
    import kbert

    path, st = _st_dir(tmp_path, pooling, activation, module)
    ref = st.encode(TEXTS).to_dense().numpy()
    enc = kbert.SparseEncoder.load(path)
    assert (enc.pooling, enc.activation) == (pooling, activation)  # read from 1_SpladePooling/config.json
    got = enc.encode(TEXTS, batch_size=2)  # several length-sorted batches, back in the input order
    assert got.shape == (len(TEXTS), enc.vocab_size) and got.dtype == np.float32
    np.testing.assert_allclose(got.toarray(), ref, rtol=1e-5, atol=1e-5)
    assert (got.toarray() >= 0).all()
    np.testing.assert_allclose(enc.similarity(got, got), st.similarity(ref, ref).numpy(), rtol=1e-4)
    # decode: the same tokens and weights, heaviest first
    ours = enc.decode(got[0], top_k=5)
    theirs = st.decode(st.encode(TEXTS[0]), top_k=5)
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    np.testing.assert_allclose([w for _, w in ours], [w for _, w in theirs], rtol=1e-5)


def test_a_pretraining_dir_search_and_options(tmp_path):
    import kbert

    path, hf, tok = hf_masked_lm_dir(tmp_path, TEXTS)
    enc = kbert.SparseEncoder.load(path)  # a masked-LM dir: SPLADE's max pooling and relu
    assert (enc.pooling, enc.activation) == ("max", "relu")
    vectors = enc.encode(TEXTS)
    # by hand from transformers' masked-LM logits: max over a text's tokens of log(1 + relu(logit))
    import torch

    batch = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = hf(**batch).logits
    hand = torch.log1p(torch.relu(logits * batch["attention_mask"][..., None])).max(dim=1).values.numpy()
    np.testing.assert_allclose(vectors.toarray(), hand, rtol=1e-5, atol=1e-5)

    # the kbert model dir written with its heads reads the same
    kbert.save_model(kbert.load_model(path, with_heads=True), str(tmp_path / "kbert"), tokenizer=enc.tokenizer)
    again = kbert.SparseEncoder.load(str(tmp_path / "kbert")).encode(TEXTS)
    np.testing.assert_allclose(again.toarray(), vectors.toarray(), rtol=1e-5, atol=1e-6)

    # search: dot products, best first, the same as sorting similarity's rows
    hits = enc.search(TEXTS[:2], TEXTS, top_k=3)
    scores = enc.similarity(vectors[:2], vectors)
    for row, got in zip(scores, hits):
        assert [j for j, _ in got] == list(np.argsort(-row, kind="stable")[:3])
        np.testing.assert_allclose([s for _, s in got], np.sort(row)[::-1][:3], rtol=1e-5)
    again = enc.search(vectors[:2], vectors, top_k=3)  # vectors in, the same hits
    assert [[j for j, _ in h] for h in again] == [[j for j, _ in h] for h in hits]
    np.testing.assert_allclose([[x for _, x in h] for h in again], [[x for _, x in h] for h in hits], rtol=1e-5)

    # max_active_dims keeps each row's k heaviest weights; sparsity counts them
    cut = enc.encode(TEXTS, max_active_dims=4)
    assert (cut.getnnz(axis=1) == 4).all()
    dense, kept = vectors.toarray(), cut.toarray()
    for i in range(len(TEXTS)):
        assert np.allclose(np.sort(dense[i])[-4:], np.sort(kept[i][kept[i] > 0]))
    assert enc.sparsity(cut) == {"active_dims": 4.0, "sparsity_ratio": pytest.approx(1 - 4 / enc.vocab_size)}
    # a prompt is text before each input; a long text is truncated with a counting warning
    prompted = enc.encode(TEXTS[0], prompt="국회 ")
    np.testing.assert_allclose(prompted.toarray(), enc.encode("국회 " + TEXTS[0]).toarray(), rtol=1e-6)
    with pytest.warns(UserWarning, match="1 of 2 texts are longer than 8 tokens"):
        short = kbert.SparseEncoder.load(path, max_length=8).encode(["서울은", TEXTS[-1]])
    assert short.shape == (2, enc.vocab_size)
    assert enc.encode([]).shape == (0, enc.vocab_size)


def test_errors(tmp_path):
    import kbert

    path, st = _st_dir(tmp_path)
    enc = kbert.SparseEncoder.load(path)
    with pytest.raises(ValueError, match="SparseEncoder \\(SPLADE\\).*kbert.SparseEncoder.load"):
        kbert.Embedder.load(path)  # a sparse dir read as dense vectors would be silently wrong
    with pytest.raises(ValueError, match="max_active_dims"):
        enc.encode(TEXTS, max_active_dims=0)
    with pytest.raises(ValueError, match="not one of the model's prompts"):
        enc.encode(TEXTS, prompt_name="title")
    with pytest.raises(ValueError, match="vocabulary has"):
        enc.decode(np.ones(3, np.float32))
    with pytest.raises(ValueError, match="`pooling` must be one of"):
        kbert.SparseEncoder(enc.model, enc.tokenizer, pooling="mean")
    # a SparseEncoder of modules kbert does not compute is refused by name
    modules = json.loads((tmp_path / "st-max-relu" / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_CSR",
                    "type": "sentence_transformers.sparse_encoder.models.CSRSparsity"})
    (tmp_path / "st-max-relu" / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="CSRSparsity"):
        kbert.SparseEncoder.load(path)
    # an encoder without its masked-LM head has no token logits
    kbert.save_model(kbert.load_model(str(tmp_path / "bert")), str(tmp_path / "encoder"), tokenizer=enc.tokenizer)
    with pytest.raises(ValueError, match="holds no masked-LM head"):
        kbert.SparseEncoder.load(str(tmp_path / "encoder"))


def test_xla_and_jax_give_the_same_vectors(tmp_path):
    import kbert

    path, _, _ = hf_masked_lm_dir(tmp_path, TEXTS)
    eager = kbert.SparseEncoder.load(path).encode(TEXTS).toarray()
    xla = kbert.SparseEncoder.load(path, jit_compile=True).encode(TEXTS).toarray()  # bucketed rows and widths
    np.testing.assert_allclose(xla, eager, rtol=1e-4, atol=1e-5)
    script = (f"import json, kbert\nv = kbert.SparseEncoder.load({path!r}).encode({TEXTS!r}, batch_size=3)\n"
              f"print(json.dumps(v.toarray().tolist()))")
    on_jax, _ = run_on_jax(script)
    np.testing.assert_allclose(np.asarray(on_jax), eager, rtol=1e-4, atol=1e-5)


def test_cli_embed_sparse(tmp_path, capsys):
    import scipy.sparse

    import kbert
    from kbert.cli import main

    path, _, _ = hf_masked_lm_dir(tmp_path, TEXTS)
    lines = tmp_path / "in.txt"
    lines.write_text("\n".join(TEXTS[:3]) + "\n", encoding="utf-8")
    assert main(["embed", "--model", path, "--sparse", "--input", str(lines), "--max-active-dims", "5",
                 "--chunk", "2"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    enc = kbert.SparseEncoder.load(path)
    expected = enc.decode(enc.encode(TEXTS[:3], max_active_dims=5))
    assert [r["text"] for r in rows] == TEXTS[:3]
    for row, want in zip(rows, expected):  # heaviest first, 5 tokens each (a chunk of 2, then one line)
        assert list(row["weights"]) == [t for t, _ in want]
        np.testing.assert_allclose(list(row["weights"].values()), [w for _, w in want], atol=2e-6)
    assert main(["embed", "--model", path, "--sparse", "--input", str(lines), "--format", "npz",
                 "--out", str(tmp_path / "v")]) == 0
    saved = scipy.sparse.load_npz(str(tmp_path / "v.npz"))
    np.testing.assert_allclose(saved.toarray(), enc.encode(TEXTS[:3]).toarray(), rtol=1e-5, atol=1e-6)
    capsys.readouterr()
    assert main(["embed", "--model", path, "--sparse", "--words", "--input", str(lines)]) == 1
    assert "--words go with dense vectors, not --sparse" in capsys.readouterr().err
    assert main(["embed", "--model", path, "--format", "npz", "--out", str(tmp_path / "w"), "--input", str(lines)]) == 1
    assert "go with --sparse" in capsys.readouterr().err


QUERIES = {"q0": "한국의 수도", "q1": "법률을 만든다", "q2": "영화 재밌다", "q3": "오늘 학교에 간다", "q4": "정말 서울"}
RELEVANT = {"q0": {"d0"}, "q1": {"d3", "d4"}, "q2": {"d2"}, "q3": {"d1", "d4"}, "q4": {"d4"}}
STS_A = ["서울은 한국의 수도", "오늘 학교에 간다", "이 영화 정말", "국회는 법률을", "서울의 국회"]
STS_B = ["한국의 수도는 서울", "나는 학교에", "영화 재밌다", "법률을 만든다", "정말 학교"]


def test_evaluation_matches_sentence_transformers_sparse_evaluators(tmp_path):
    """evaluate_retrieval / evaluate_sts / evaluate_pair_classification on a SPLADE dir: the figures of
    sentence-transformers' SparseInformationRetrievalEvaluator, SparseEmbeddingSimilarityEvaluator and
    SparseBinaryClassificationEvaluator on the same model, sparsity and FLOPS included."""
    from sentence_transformers.sparse_encoder.evaluation import (SparseBinaryClassificationEvaluator,
                                                                 SparseEmbeddingSimilarityEvaluator,
                                                                 SparseInformationRetrievalEvaluator)

    import kbert

    path, st = _st_dir(tmp_path)
    corpus = {f"d{i}": t for i, t in enumerate(TEXTS)}
    for max_active_dims in (None, 8):
        ref = SparseInformationRetrievalEvaluator(QUERIES, corpus, RELEVANT, name="ir",
                                                  max_active_dims=max_active_dims)(st)
        got = kbert.evaluate_retrieval(path, QUERIES, corpus, RELEVANT, batch_size=2, max_active_dims=max_active_dims)
        assert got["queries"] == len(QUERIES)
        assert 0.0 < got["mrr@10"] < 1.0  # not a trivial ranking
        for key in ("accuracy@1", "recall@3", "precision@3", "mrr@10", "ndcg@10", "map@100"):
            assert got[key] == pytest.approx(ref[f"ir_dot_{key}"], abs=1e-6), key
        for key in ("query_active_dims", "corpus_active_dims", "query_sparsity_ratio", "corpus_sparsity_ratio",
                    "avg_flops"):
            assert got[key] == pytest.approx(ref[f"ir_{key}"], rel=1e-5), key
        if max_active_dims:
            assert got["query_active_dims"] <= max_active_dims and got["corpus_active_dims"] <= max_active_dims

    scores = [4.5, 1.0, 2.5, 3.0, 0.5]
    ref = SparseEmbeddingSimilarityEvaluator(STS_A, STS_B, scores, similarity_fn_names=["cosine", "dot"])(st)
    enc = kbert.SparseEncoder.load(path)
    got = kbert.evaluate_sts(enc, STS_A, STS_B, scores)
    for ours, theirs in (("pearson", "pearson_cosine"), ("spearman", "spearman_cosine"), ("pearson_dot", "pearson_dot"),
                         ("spearman_dot", "spearman_dot"), ("active_dims", "active_dims"),
                         ("sparsity_ratio", "sparsity_ratio")):
        assert got[ours] == pytest.approx(ref[theirs], abs=1e-5), ours

    labels = [1, 0, 1, 1, 0]
    for similarity in ("dot", "cosine", "euclidean", "manhattan"):
        ref = SparseBinaryClassificationEvaluator(STS_A, STS_B, labels, similarity_fn_names=[similarity])(st)
        got = kbert.evaluate_pair_classification(enc, STS_A, STS_B, labels,
                                                 similarity=None if similarity == "dot" else similarity)
        for key in ("accuracy", "accuracy_threshold", "f1", "f1_threshold", "precision", "recall", "ap", "mcc"):
            assert got[key] == pytest.approx(ref[f"{similarity}_{key}"], rel=1e-4, abs=1e-5), (similarity, key)
    assert got["active_dims"] == pytest.approx(ref["active_dims"], rel=1e-5)

    with pytest.raises(ValueError, match="`lexical` and `reranker` go with a dense Embedder"):
        kbert.evaluate_retrieval(enc, QUERIES, corpus, RELEVANT, lexical=0.3)


def test_cli_evaluate_sparse(tmp_path, capsys):
    from kbert.cli import main

    path, _, _ = hf_masked_lm_dir(tmp_path, TEXTS)
    data = tmp_path / "pairs.tsv"
    data.write_text("sentence1\tsentence2\tscore\n" + "".join(f"{a}\t{b}\t{s}\n" for a, b, s in
                                                             zip(STS_A, STS_B, [4.5, 1.0, 2.5, 3.0, 0.5])),
                    encoding="utf-8")
    import kbert

    enc = kbert.SparseEncoder.load(path)
    for task in ("sts", "retrieval"):
        assert main(["evaluate", "--model", path, "--sparse", "--data", str(data), "--task", task,
                     "--max-active-dims", "6"]) == 0
        figures = json.loads(capsys.readouterr().out)
        if task == "sts":
            want = kbert.evaluate_sts(enc, STS_A, STS_B, [4.5, 1.0, 2.5, 3.0, 0.5], max_active_dims=6)
            assert figures["spearman_dot"] == pytest.approx(want["spearman_dot"])
            assert figures["active_dims"] <= 6
        else:
            assert figures["corpus"] == len(STS_B) and figures["corpus_active_dims"] <= 6
            assert 0.0 < figures["avg_flops"] <= 6
    # a masked-LM dir is dense unless asked; --max-active-dims names what it goes with
    assert main(["evaluate", "--model", path, "--data", str(data), "--max-active-dims", "6"]) == 1
    assert "--max-active-dims goes with a SPLADE model" in capsys.readouterr().err


def test_inference_free_splade_matches_sentence_transformers(tmp_path):
    """Queries by the static weights of their tokens (no model), documents through SPLADE: sentence-transformers'
    vectors on both sides, its retrieval figures, and a SparseIndex over it; a dense Embedder refuses it by name."""
    from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator

    import kbert

    path, st = inference_free_splade_dir(tmp_path, TEXTS)
    enc = kbert.SparseEncoder.load(path)
    assert enc.query_weights is not None and enc.query_weights.shape == (enc.vocab_size,)
    queries = list(QUERIES.values())
    for options in ({}, {"max_active_dims": 3}):
        np.testing.assert_allclose(enc.encode_query(queries, **options).toarray(),
                                   st.encode_query(queries, **options).to_dense().numpy(), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(enc.encode_document(TEXTS, **options).toarray(),
                                   st.encode_document(TEXTS, **options).to_dense().numpy(), rtol=1e-5, atol=1e-5)
    static = enc.encode_query(queries[:1])  # the query's own tokens only, weighed by the table
    ids = set(enc.tokenizer.ids_batch(queries[:1])[0])
    assert set(static.indices) == {j for j in ids if enc.query_weights[j] != 0}
    corpus = {f"d{i}": t for i, t in enumerate(TEXTS)}
    ref = SparseInformationRetrievalEvaluator(QUERIES, corpus, RELEVANT, name="ir")(st)
    got = kbert.evaluate_retrieval(path, QUERIES, corpus, RELEVANT)
    for key in ("accuracy@1", "mrr@10", "ndcg@10", "query_active_dims", "corpus_active_dims", "avg_flops"):
        assert got[key] == pytest.approx(ref[f"ir_dot_{key}" if "@" in key else f"ir_{key}"], rel=1e-5), key
    index = kbert.SparseIndex.build(path, TEXTS, str(tmp_path / "index"), progress=False)
    hits = index.search(queries, top_k=3)
    scores = enc.similarity(enc.encode_query(queries), enc.encode_document(TEXTS))
    for row, found in zip(scores, hits):
        assert [h.id for h in found] == [j for j in np.argsort(-row, kind="stable")[:3] if row[j] > 0]
    with pytest.raises(ValueError, match="load it with kbert.SparseEncoder.load"):
        kbert.Embedder.load(path)
    from kbert.cli import main  # kbert embed --sparse --query: the queries' table lookups

    lines = tmp_path / "q.txt"
    lines.write_text("\n".join(queries) + "\n", encoding="utf-8")
    assert main(["embed", "--model", path, "--sparse", "--query", "--input", str(lines), "--format", "npz",
                 "--out", str(tmp_path / "q")]) == 0
    import scipy.sparse

    np.testing.assert_allclose(scipy.sparse.load_npz(str(tmp_path / "q.npz")).toarray(),
                               enc.encode_query(queries).toarray())
    rows = [{"a": TEXTS[i], "b": TEXTS[i + 1]} for i in range(4)]
    with pytest.raises(ValueError, match="is an inference-free SPLADE model .* start from its document model"):
        kbert.finetune(path, "sparse-embedding", rows, text_column="a", pair_column="b", label_column=None,
                       out_dir=str(tmp_path / "out"), progress=False)

    # inference_free=True trains it on from its own table (a learning rate too small to move it here): the dir
    # written is an inference-free model again, read alike by sentence-transformers and kbert
    from sentence_transformers import SparseEncoder

    out = str(tmp_path / "again")
    kbert.finetune(path, "sparse-embedding", rows, text_column="a", pair_column="b", label_column=None,
                   out_dir=out, inference_free=True, query_learning_rate=1e-12, epochs=1, batch_size=2,
                   progress=False)
    again = kbert.SparseEncoder.load(out)
    np.testing.assert_allclose(again.query_weights, enc.query_weights, rtol=1e-4, atol=1e-6)
    theirs = SparseEncoder(out, device="cpu")
    np.testing.assert_allclose(again.encode_query(queries).toarray(),
                               theirs.encode_query(queries).to_dense().numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(again.encode_document(TEXTS).toarray(),
                               theirs.encode_document(TEXTS).to_dense().numpy(), rtol=1e-4, atol=1e-5)


def test_inference_free_training_starts_from_the_documents_idf(tmp_path):
    """From a masked-LM dir, `kbert finetune --inference-free` starts the query table at the BM25 IDF of each token
    over the distinct training documents ([CLS], [SEP] and [PAD] at 0): with a query learning rate too small to
    move it, the table written is that IDF, computed here with transformers' tokenizer."""
    import kbert

    path, _, tok = hf_masked_lm_dir(tmp_path, TEXTS)
    rows = [{"a": TEXTS[i], "b": TEXTS[(i + 1) % len(TEXTS)]} for i in range(len(TEXTS))]
    rows.append({"a": TEXTS[0], "b": TEXTS[1]})  # a document twice counts once
    out, data = str(tmp_path / "free"), tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    from kbert.cli import main

    assert main(["finetune", "--model", path, "--task", "sparse-embedding", "--train", str(data), "--out", out,
                 "--text-column", "a", "--pair-column", "b", "--no-label", "--inference-free",
                 "--query-learning-rate", "1e-12", "--epochs", "1", "--batch-size", "3"]) == 0
    table = kbert.SparseEncoder.load(out).query_weights
    documents = sorted({r["b"] for r in rows})
    df = np.zeros(len(table))
    for text in documents:
        df[sorted(set(tok(text)["input_ids"]))] += 1
    want = np.log1p((len(documents) - df + 0.5) / (df + 0.5))
    want[[tok.pad_token_id, tok.cls_token_id, tok.sep_token_id]] = 0.0
    np.testing.assert_allclose(table, want, rtol=1e-4)
    assert table[tok.convert_tokens_to_ids("서")] < table[tok.convert_tokens_to_ids("##화")]  # 4 of 5 against 1


def _question_pairs(split: str, n: int):
    """(question1, question2) paraphrase rows of the shared question-pair set (the re-split marks them 0)."""
    import csv

    from helpers import SHARED

    with open(os.path.join(SHARED, "question-pair", f"{split}.txt"), encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f, delimiter="\t")
                if r["is_duplicate"] == "0" and r["question1"].strip() != r["question2"].strip()]
    return [{"question1": r["question1"].strip(), "question2": r["question2"].strip()} for r in rows[:n]]


@needs_shared
def test_sparse_fine_tuning_learns_and_writes_a_sparse_encoder_dir(tmp_path):
    """SPLADE fine-tuning of a tiny random BERT on Korean paraphrase pairs: dev recall@1 (each question's
    paraphrase found by dot product among 200) rises from chance; the dir written is the best model, read
    alike by sentence-transformers and kbert.SparseEncoder."""
    from sentence_transformers import SparseEncoder

    import kbert

    train, dev = _question_pairs("train", 600), _question_pairs("validation", 200)
    path, _, _ = hf_masked_lm_dir(tmp_path, [r[k] for r in train + dev for k in ("question1", "question2")])
    out = str(tmp_path / "splade")
    summary = kbert.finetune(path, "sparse-embedding", train, dev, out_dir=out, text_column="question1",
                             pair_column="question2", label_column=None, epochs=4, batch_size=16,
                             learning_rate=1e-3, max_length=48, progress=False)
    assert summary["baseline"]["recall@1"] < 0.03 and summary["best"] > 0.15, summary["history"]
    assert summary["metric"] == "recall@1"
    assert all(h["dev_active_dims"] < kbert.SparseEncoder.load(out).vocab_size for h in summary["history"])

    enc = kbert.SparseEncoder.load(out)
    questions, answers = [r["question1"] for r in dev], [r["question2"] for r in dev]
    ours = enc.encode(questions + answers)
    theirs = SparseEncoder(out, device="cpu").encode(questions + answers).to_dense().numpy()
    np.testing.assert_allclose(ours.toarray(), theirs, rtol=1e-4, atol=1e-5)
    hits = enc.search(ours[:len(dev)], ours[len(dev):], top_k=1)
    assert np.mean([h[0][0] == i for i, h in enumerate(hits)]) == pytest.approx(summary["best"], abs=1e-9)
    with pytest.raises(ValueError, match="kbert.SparseEncoder.load"):
        kbert.Embedder.load(out)
    card = open(os.path.join(out, "README.md"), encoding="utf-8").read()
    assert "kbert.SparseEncoder.load" in card and "FLOPS penalties 5e-05 (anchors) and 3e-05" in card


@needs_shared
def test_inference_free_fine_tuning_learns_its_query_table(tmp_path):
    """Inference-free SPLADE on Korean paraphrase pairs: the questions read a trained table, the paraphrases run
    the model; dev recall@1 rises, the table moves off its IDF start, and the dir written ranks as the summary
    says through kbert.SparseEncoder, which gives sentence-transformers' vectors on both sides."""
    from sentence_transformers import SparseEncoder

    import kbert

    train, dev = _question_pairs("train", 600), _question_pairs("validation", 200)
    path, _, _ = hf_masked_lm_dir(tmp_path, [r[k] for r in train + dev for k in ("question1", "question2")])
    out = str(tmp_path / "free")
    summary = kbert.finetune(path, "sparse-embedding", train, dev, out_dir=out, text_column="question1",
                             pair_column="question2", label_column=None, epochs=4, batch_size=16,
                             learning_rate=3e-3, max_length=48, inference_free=True, query_regularizer_weight=0,
                             progress=False)
    assert summary["baseline"]["recall@1"] < 0.03 and summary["best"] > 0.2, summary["history"]
    enc = kbert.SparseEncoder.load(out)
    questions, answers = [r["question1"] for r in dev], [r["question2"] for r in dev]
    q, d = enc.encode_query(questions), enc.encode_document(answers)
    hits = enc.search(q, d, top_k=1)
    assert np.mean([h[0][0] == i for i, h in enumerate(hits)]) == pytest.approx(summary["best"], abs=1e-9)
    theirs = SparseEncoder(out, device="cpu")
    np.testing.assert_allclose(q.toarray(), theirs.encode_query(questions).to_dense().numpy(), rtol=1e-6)
    np.testing.assert_allclose(d.toarray(), theirs.encode_document(answers).to_dense().numpy(), rtol=1e-4, atol=1e-5)
    start = kbert.finetune(path, "sparse-embedding", train[:32], out_dir=str(tmp_path / "start"),
                           text_column="question1", pair_column="question2", label_column=None, max_steps=1,
                           batch_size=16, inference_free=True, query_learning_rate=1e-12, progress=False)
    assert start["steps"] == 1
    moved = enc.query_weights - kbert.SparseEncoder.load(str(tmp_path / "start")).query_weights
    assert np.abs(moved).max() > 0.05  # the table trained (its IDF start here: 600 documents, not 32)


def test_sparse_loss_against_a_hand_computation():
    """In-batch cross-entropy of raw dot products (no temperature), plus each side's FLOPS penalty."""
    import keras

    from kbert.train.finetune import FinetuneConfig
    from kbert.train.finetune_tasks import SparseEmbeddingTask

    rng = np.random.default_rng(0)
    a, p, neg = (np.maximum(rng.normal(size=(3, 7)), 0).astype(np.float32) for _ in range(3))
    config = FinetuneConfig(model="m", task="sparse-embedding", train=[], pair_column="p", label_column=None,
                            negative_column="n", query_regularizer_weight=0.3, document_regularizer_weight=0.2)
    task = SparseEmbeddingTask(config)
    got = float(keras.ops.convert_to_numpy(task.embedding_loss(np.concatenate([a, p, neg]), None, 3)))
    scores = a @ np.concatenate([p, neg]).T  # [3, 6]: each anchor against the positives and hard negatives
    ce = np.mean([np.log(np.exp(row).sum()) - row[i] for i, row in enumerate(scores)])
    docs = np.concatenate([p, neg])
    want = ce + 0.3 * np.sum(a.mean(axis=0) ** 2) + 0.2 * np.sum(docs.mean(axis=0) ** 2)
    assert got == pytest.approx(want, rel=1e-5)


def test_sparse_fine_tuning_refuses_what_it_cannot_train(tmp_path):
    import kbert

    path, _, _ = hf_masked_lm_dir(tmp_path, TEXTS)
    rows = [{"a": TEXTS[i], "b": TEXTS[i + 1], "label": 1.0} for i in range(4)]
    common = dict(text_column="a", pair_column="b", out_dir=str(tmp_path / "out"), progress=False)
    with pytest.raises(ValueError, match=r"`label_column=None` \(--no-label\)"):
        kbert.finetune(path, "sparse-embedding", rows, **common)  # scored pairs: label_column "label"
    with pytest.raises(ValueError, match="`matryoshka_dims` cut dense vectors"):
        kbert.finetune(path, "sparse-embedding", rows, label_column=None, matryoshka_dims=[8], **common)
    with pytest.raises(ValueError, match="`pooling` and `layers` do not apply"):
        kbert.finetune(path, "sparse-embedding", rows, label_column=None, pooling="mean", **common)
    with pytest.raises(ValueError, match="query_regularizer_weight"):
        kbert.finetune(path, "sparse-embedding", rows, label_column=None, query_regularizer_weight=-1, **common)
    with pytest.raises(ValueError, match=r"`mini_batch_size` \(gradient caching\) and `lora_rank` do not apply"):
        kbert.finetune(path, "sparse-embedding", rows, label_column=None, inference_free=True, mini_batch_size=2,
                       **common)
    with pytest.raises(ValueError, match=r"`inference_free` \(True or False\) goes with task='sparse-embedding'"):
        kbert.finetune(path, "sentence-embedding", rows, inference_free=True, **common)
    with pytest.raises(ValueError, match="`query_learning_rate` must be a number > 0"):
        kbert.finetune(path, "sparse-embedding", rows, label_column=None, inference_free=True,
                       query_learning_rate=0, **common)
    kbert.save_model(kbert.load_model(path), str(tmp_path / "encoder"), tokenizer=kbert.Tokenizer.from_model_dir(path))
    with pytest.raises(ValueError, match="holds no masked-LM head"):
        kbert.finetune(str(tmp_path / "encoder"), "sparse-embedding", rows, label_column=None, **common)


def test_sparse_fine_tuning_on_jax(tmp_path):
    """The same task on Keras' JAX backend, SPLADE on both sides and inference-free: it trains, and writes a dir
    kbert reads back on TensorFlow (an inference-free one's query table moved off its start)."""
    import kbert

    path, _, _ = hf_masked_lm_dir(tmp_path, TEXTS)
    rows = [{"a": TEXTS[i], "b": TEXTS[(i + 1) % len(TEXTS)]} for i in range(len(TEXTS))]
    out, free = str(tmp_path / "jax-splade"), str(tmp_path / "jax-free")
    common = (f"{rows!r}, {rows!r}, text_column='a', pair_column='b', label_column=None, epochs=2, batch_size=4, "
              f"learning_rate=1e-3, progress=False")
    script = (f"import json, kbert\ns = kbert.finetune({path!r}, 'sparse-embedding', {common}, out_dir={out!r})\n"
              f"f = kbert.finetune({path!r}, 'sparse-embedding', {common}, out_dir={free!r}, inference_free=True)\n"
              f"v = kbert.SparseEncoder.load({out!r}).encode({TEXTS!r})\n"
              f"q = kbert.SparseEncoder.load({free!r}).encode_query({TEXTS!r})\n"
              f"print(json.dumps({{'history': s['history'], 'free': f['history'], 'vectors': v.toarray().tolist(), "
              f"'queries': q.toarray().tolist()}}))")
    on_jax, _ = run_on_jax(script)
    for history in (on_jax["history"], on_jax["free"]):
        assert [h["step"] for h in history] == [2, 4]
        assert all(np.isfinite(h["train_loss"]) for h in history)
    here = kbert.SparseEncoder.load(out).encode(TEXTS).toarray()
    np.testing.assert_allclose(here, np.asarray(on_jax["vectors"]), rtol=1e-4, atol=1e-5)
    table = kbert.SparseEncoder.load(free)
    np.testing.assert_allclose(table.encode_query(TEXTS).toarray(), np.asarray(on_jax["queries"]), rtol=1e-6)
    start = kbert.finetune(path, "sparse-embedding", rows, text_column="a", pair_column="b", label_column=None,
                           out_dir=str(tmp_path / "start"), max_steps=1, inference_free=True,
                           query_learning_rate=1e-12, progress=False)
    assert start["steps"] == 1
    assert np.abs(table.query_weights - kbert.SparseEncoder.load(str(tmp_path / "start")).query_weights).max() > 1e-3


def test_a_vocabulary_padded_past_the_tokenizer(tmp_path):
    """Checkpoints often pad the embedding table past the tokenizer (to a multiple of 8): the vectors are as wide
    as the model's vocabulary, and decode names an id past the tokenizer's as <id>."""
    import kbert
    from helpers import tiny_hf_pretraining_model

    path, _, _ = hf_masked_lm_dir(tmp_path, TEXTS)
    words = (tmp_path / "bert" / "vocab.txt").read_text(encoding="utf-8").split()
    tiny_hf_pretraining_model("bert", vocab_size=len(words) + 3).save_pretrained(path)  # three rows no token has
    enc = kbert.SparseEncoder.load(path)
    vectors = enc.encode(TEXTS[:2])
    assert enc.vocab_size == vectors.shape[1] == len(words) + 3
    assert enc.token(len(words) + 1) == f"<{len(words) + 1}>" and enc.token(2) == "[CLS]"
    assert len(enc.decode(vectors[0])) == vectors[0].getnnz()
