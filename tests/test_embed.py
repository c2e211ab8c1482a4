"""kbert.Embedder: pooling, order, batching, edge cases, word vectors, similarity and search."""

import json
import os
import re
import warnings

import keras
import numpy as np
import pytest

import kbert
from kbert.data.corpus import corpus

from helpers import NO_BACKEND_PRELUDE, needs_shared, run_on_jax, tiny_embedding_model, xlmr_dir

TEXTS = ["대한민국은 민주공화국이다.", "모든 국민은 법 앞에 평등하다.", "", "   ",
         "국회는 법률을 제정한다. 대통령은 국가를 대표한다. " * 3, "학교에서 공부했다"]


@pytest.fixture(scope="module")
def emb(tmp_path_factory):
    return kbert.Embedder.load(tiny_embedding_model(str(tmp_path_factory.mktemp("model"))))


def test_encode_order_pooling_and_normalization(emb):
    batched = emb.encode(TEXTS, batch_size=2)
    assert batched.shape == (len(TEXTS), 32) and batched.dtype == np.float32
    singles = np.stack([emb.encode(t) for t in TEXTS])  # one at a time: no padding at all
    np.testing.assert_allclose(batched, singles, atol=1e-5)  # length buckets + input order
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)
    assert np.isfinite(batched).all()  # empty and blank texts get a defined vector
    assert not np.allclose(batched[0], batched[1])  # different Korean texts, different vectors
    for pooling in ("cls", "max", "first_last_avg"):
        v = emb.encode(TEXTS, pooling=pooling, normalize=False)
        assert v.shape == (len(TEXTS), 32) and np.isfinite(v).all()
    layered = emb.encode(TEXTS[:2], layers=[1, 2], normalize=False)
    assert layered.shape == (2, 32)
    assert emb.encode([]).shape == (0, 32)
    with pytest.raises(ValueError, match="`pooling` must be one of"):
        emb.encode("x", pooling="avg")
    with pytest.raises(ValueError, match="`layers` entries"):
        emb.encode("x", layers=[7])


def test_pack_rows_fits_every_text_once_within_the_width():
    from kbert.data.features import pack_rows

    lengths = [int(n) for n in np.random.default_rng(0).integers(3, 58, 40)]
    rows = pack_rows(lengths, 57)
    assert sorted(i for row in rows for i in row) == list(range(40))
    assert all(sum(lengths[i] for i in row) <= 57 for row in rows)
    assert len(rows) < 35  # short texts share rows
    assert pack_rows([], 8) == [] and pack_rows([8], 8) == [[0]]
    with pytest.raises(ValueError, match="does not fit"):
        pack_rows([9], 8)


@pytest.mark.parametrize("architecture", ["bert", "albert-pre-ln"])
def test_packed_rows_give_each_text_the_states_it_has_alone(architecture):
    kind, norm_first = architecture.split("-")[0], architecture.endswith("pre-ln")
    cfg = kbert.ModelConfig.preset("bert-tiny", vocab_size=50, hidden_size=32, num_heads=2, intermediate_size=64,
                                   max_position=16, architecture=kind, norm_first=norm_first)
    backbone = kbert.build_backbone(cfg, output_hidden_states=True)
    texts = [[2, 7, 8, 9, 3], [2, 11, 3], [2, 12, 13, 14, 15, 16, 3]]
    ids = np.zeros((2, 8), np.int32)  # row 0: texts 0 and 1, row 1: text 2 then one padding
    segments = np.zeros((2, 8), np.int32)
    ids[0, :5], ids[0, 5:8], ids[1, :7] = texts[0], texts[1], texts[2]
    segments[0, :5], segments[0, 5:8], segments[1, :7] = 1, 2, 1
    packed = [np.asarray(h) for h in backbone.packed_hidden_states(ids, segments)]
    places = [(0, 0), (0, 5), (1, 0)]
    for text, (row, at) in zip(texts, places):
        x = np.array([text], np.int32)
        alone = backbone({"token_ids": x, "segment_ids": np.zeros_like(x), "padding_mask": np.ones_like(x)})
        for layer, h in enumerate(alone["hidden_states"]):
            np.testing.assert_allclose(packed[layer][row, at:at + len(text)], np.asarray(h)[0], atol=2e-5)


def test_mixed_lengths_run_packed_and_give_the_unpacked_vectors(emb, monkeypatch):
    import kbert.embed.embedder as embedder

    texts = ["가", "나다", TEXTS[4], TEXTS[0], "라", TEXTS[1], "마바사"] * 3
    calls = []
    run_packed = emb._run_packed
    monkeypatch.setattr(emb, "_run_packed", lambda ids, *a: calls.append(ids.shape) or run_packed(ids, *a))
    for pooling in ("mean", "cls", "first_last_avg"):
        packed = emb.encode(texts, pooling=pooling)
        assert calls and calls[-1][0] < len(texts)  # fewer rows than texts
        monkeypatch.setattr(embedder, "PACK_WHEN", -1.0)  # never pack
        n = len(calls)
        padded = emb.encode(texts, pooling=pooling)
        assert len(calls) == n
        monkeypatch.setattr(embedder, "PACK_WHEN", 0.8)
        np.testing.assert_allclose(packed, padded, atol=1e-5)
    n = len(calls)
    emb.encode(texts, pooling="max")  # no weighted-sum form: runs padded
    assert len(calls) == n


def test_xla_vectors_equal_the_graph_for_every_pooling_and_shapes_stay_bucketed(emb, monkeypatch):
    from kbert.data.features import ROW_BUCKETS, WIDTH_BUCKETS, bucket
    from kbert.embed.embedder import Embedder

    assert [bucket(n, (16, 32)) for n in (1, 16, 17, 32, 40)] == [16, 16, 32, 32, 40]
    xla = Embedder(emb.backbone, emb.tokenizer, jit_compile=True)
    texts = ["가", "나다", TEXTS[4], TEXTS[0], "", "라", TEXTS[1], "마바사"] * 3
    for pooling in ("mean", "cls", "max", "first_last_avg"):
        np.testing.assert_allclose(xla.encode(texts, pooling=pooling), emb.encode(texts, pooling=pooling),
                                   atol=1e-5)
    np.testing.assert_allclose(xla.encode(TEXTS[0], layers=[1, 2]), emb.encode(TEXTS[0], layers=[1, 2]), atol=1e-5)
    shapes = {key[1:] for key in xla._compiled}
    assert shapes and all(r in ROW_BUCKETS and w in WIDTH_BUCKETS for r, w in shapes)
    assert all(r < len(texts) for r, _ in shapes)  # packed: fewer rows than texts
    n = len(xla._compiled)
    xla.encode(list(reversed(texts)))  # the same traffic again: no new compilation
    assert len(xla._compiled) == n
    for mode in (False, True):  # a call may ask for more than the Embedder's default length
        short = Embedder(emb.backbone, emb.tokenizer, max_length=16, jit_compile=mode)
        np.testing.assert_allclose(short.encode(TEXTS, max_length=64), emb.encode(TEXTS, max_length=64), atol=1e-5)
    with pytest.raises(ValueError, match="`jit_compile` must be one of"):
        Embedder(emb.backbone, emb.tokenizer, jit_compile="yes")


def test_background_compilation_serves_from_the_graph_until_a_shape_is_compiled(emb, monkeypatch):
    from kbert.embed.embedder import Embedder

    background = Embedder(emb.backbone, emb.tokenizer, jit_compile="background")
    xla_runs = []
    run_xla = background._run_xla
    monkeypatch.setattr(background, "_run_xla", lambda key, *a: xla_runs.append(key) or run_xla(key, *a))
    texts = TEXTS[:2] + ["가나다라"]
    first = background.encode(texts)  # not compiled yet: the graph answers, a thread compiles
    assert not xla_runs
    background.wait_compiled()
    assert background.compiling == 0 and len(background._compiled) == 1
    again = background.encode(texts)
    assert len(xla_runs) == 1
    np.testing.assert_allclose(again, first, atol=1e-5)


@pytest.mark.parametrize("task", ["classification", "tagging"])
def test_task_model_predicts_the_same_through_xla(emb, task):
    from kbert.data.features import build_network
    from kbert.embed.task_model import TaskModel
    from kbert.models.tasks import TaskNetwork

    network = TaskNetwork(emb.backbone, task, 2, 0.0, (0.0, 1.0), "pooler", -1)
    build_network(network, emb.tokenizer)
    meta = {"task": task, "labels": ["O", "J"], "max_length": 64, "pooling": "pooler", "layers": -1}
    texts = TEXTS + ["가", "학교에서 친구를 만났다"] * 4
    graph = TaskModel(network, emb.tokenizer, meta).predict(texts, batch_size=5)
    xla = TaskModel(network, emb.tokenizer, meta, jit_compile=True)
    got = xla.predict(texts, batch_size=5)  # batches of 5 and a last of 4: rows padded to 6 and 4
    if task == "tagging":
        assert got == graph
    else:
        np.testing.assert_allclose(got, graph, atol=1e-5)
        assert got.shape == (len(texts), 2)


def test_mean_pooling_matches_a_direct_computation(emb):
    enc = emb.tokenizer.encode(TEXTS[1])
    hidden = emb._run(np.array([enc.ids], np.int32), np.ones((1, len(enc.ids)), np.int32))[-1]
    np.testing.assert_allclose(emb.encode(TEXTS[1], normalize=False), hidden[0].mean(axis=0), atol=1e-5)


def test_every_pooling_matches_a_hand_computation_with_padding_excluded(emb):
    texts = ["모든 국민은 법 앞에 평등하다.", "짧다"]  # different lengths: the short one is padded in the batch
    for i, text in enumerate(texts):
        ids = emb.tokenizer.encode(text).ids
        hidden = emb._run(np.array([ids], np.int32), np.ones((1, len(ids)), np.int32))  # unpadded, by hand
        last, first = hidden[-1][0], hidden[1][0]
        expected = {"mean": last.mean(0), "cls": last[0], "max": last.max(0),
                    "first_last_avg": ((first + last) / 2).mean(0)}
        layered = ((hidden[1][0] + hidden[2][0]) / 2).mean(0)
        for pooling, want in expected.items():
            got = emb.encode(texts, pooling=pooling, normalize=False, batch_size=2)[i]
            np.testing.assert_allclose(got, want, atol=1e-5, err_msg=pooling)
        np.testing.assert_allclose(emb.encode(texts, layers=[1, 2], normalize=False)[i], layered, atol=1e-5)


def test_truncation_warns_with_a_count(emb):
    long = "헌법 " * 200
    with pytest.warns(UserWarning, match="1 of 2 texts are longer than 64 tokens"):
        v = emb.encode([long, "짧다"])
    assert v.shape == (2, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        emb.encode(["짧다"])


def test_word_vectors(emb):
    words = emb.encode_words("학교에서 공부했다", unit="eojeol")
    assert [(w, s, e) for w, s, e, _ in words] == [("학교에서", 0, 4), ("공부했다", 5, 9)]
    assert all(v.shape == (32,) for *_, v in words)
    morph = emb.encode_words("학교에서 공부했다", unit="morpheme", morphemes="mecab")
    assert [w for w, *_ in morph][:2] == ["학교", "에서"]
    sub = emb.encode_words(["학교에서 공부했다", "법"], unit="subword", pooling="first")
    assert len(sub) == 2 and len(sub[0]) >= 2
    with pytest.raises(ValueError, match="`unit` must be one of"):
        emb.encode_words("x", unit="word")


def test_similarity_and_search(emb):
    vectors = emb.encode(TEXTS)
    sim = emb.similarity(vectors, vectors)
    assert sim.shape == (len(TEXTS), len(TEXTS))
    np.testing.assert_allclose(np.diag(sim), 1.0, atol=1e-5)
    with pytest.raises(TypeError, match="takes vectors, not texts"):
        emb.similarity(TEXTS[:2], vectors)
    with pytest.raises(ValueError, match="Vector sizes differ: 4 and"):
        emb.similarity(np.ones(4), vectors)
    hits = emb.search(TEXTS[:2], TEXTS, top_k=3)
    assert [h[0][0] for h in hits] == [0, 1]  # each text finds itself first
    assert all(h[0][1] >= h[1][1] >= h[2][1] for h in hits)
    assert emb.search(TEXTS[0], vectors, top_k=1)[0][0] == 0
    with pytest.raises(ValueError, match="top_k"):
        emb.search("x", TEXTS, top_k=0)
    # FAISS's exact inner-product index gives the same hits as the matrix search.
    rng = np.random.default_rng(0)
    corpus_vectors, queries = rng.normal(size=(500, 32)), rng.normal(size=(7, 32))
    exact = emb.search(queries, corpus_vectors, top_k=5)
    fast = emb.search(queries, corpus_vectors, top_k=5, index="faiss")
    assert [[j for j, _ in h] for h in fast] == [[j for j, _ in h] for h in exact]
    np.testing.assert_allclose([[v for _, v in h] for h in fast], [[v for _, v in h] for h in exact], atol=1e-5)


def test_hybrid_search_mixes_character_ngram_tfidf_into_the_cosine(emb):
    """`search(..., lexical=w)`: each score is (1 - w) x the vectors' cosine + w x the cosine of character
    1-3-gram TF-IDF vectors fitted on the corpus, checked against scikit-learn's vectorizer directly."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    from kbert.embed.lexical import lexical_scores

    corpus = ["대한민국은 민주공화국이다.", "모든 국민은 법 앞에 평등하다.", "국회는 법률을 제정한다.", "학교에서 공부했다"]
    queries = ["민주공화국 대한민국", "국민은 평등하다"]
    tfidf = TfidfVectorizer(analyzer="char_wb", ngram_range=(1, 3), sublinear_tf=True).fit(corpus)
    lexical = (tfidf.transform(queries) @ tfidf.transform(corpus).T).toarray()
    np.testing.assert_allclose(lexical_scores(queries, corpus), lexical, atol=1e-6)
    dense = emb.similarity(emb.encode(queries), emb.encode(corpus))
    for w in (0.0, 0.4, 1.0):
        hits = emb.search(queries, corpus, top_k=4, lexical=w)
        expected = (1 - w) * dense + w * lexical
        for i, row in enumerate(hits):
            assert [j for j, _ in row] == list(np.argsort(-expected[i], kind="stable"))
            np.testing.assert_allclose([v for _, v in row], np.sort(expected[i])[::-1], atol=1e-5)
    assert emb.search(queries[0], corpus, top_k=1, lexical=1.0)[0][0] == 0  # shares the most n-grams
    assert emb.search(queries, corpus, top_k=2, lexical=0.0) == emb.search(queries, corpus, top_k=2)
    # the corpus encoded once beforehand gives the same hits
    assert (emb.search(queries, corpus, top_k=4, lexical=0.4, corpus_vectors=emb.encode(corpus))
            == emb.search(queries, corpus, top_k=4, lexical=0.4))
    with pytest.raises(ValueError, match="3 rows for 4 corpus texts"):
        emb.search(queries, corpus, lexical=0.4, corpus_vectors=emb.encode(corpus[:3]))
    with pytest.raises(ValueError, match="goes with `lexical`"):
        emb.search(queries, corpus, corpus_vectors=emb.encode(corpus))
    # a corpus with nothing to count scores 0 lexically instead of failing
    np.testing.assert_array_equal(lexical_scores(["법"], ["", "  "]), np.zeros((1, 2), np.float32))
    with pytest.raises(ValueError, match="not vectors"):
        emb.search(queries, emb.encode(corpus), lexical=0.5)
    with pytest.raises(ValueError, match="index='exact'"):
        emb.search(queries, corpus, lexical=0.5, index="faiss")
    for bad in (1.5, -0.1, "0.5", True):
        with pytest.raises(ValueError, match="`lexical` must be a number in \\[0, 1\\]"):
            emb.search(queries, corpus, lexical=bad)


def test_embed_command(emb, tmp_path, capsys):
    import json

    from kbert.cli import main

    model_dir = str(tmp_path / "m")
    kbert.save_model(emb.backbone, model_dir, tokenizer=emb.tokenizer)
    src = tmp_path / "in.txt"
    src.write_text("대한민국은 민주공화국이다.\n학교에서 공부했다\n", encoding="utf-8")
    assert main(["embed", "--model", model_dir, "--input", str(src)]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["text"] for r in rows] == ["대한민국은 민주공화국이다.", "학교에서 공부했다"]
    np.testing.assert_allclose(rows[1]["vector"], emb.encode("학교에서 공부했다"), atol=1e-5)
    assert main(["embed", "--model", model_dir, "--input", str(src), "--format", "npy",
                 "--out", str(tmp_path / "v.npy")]) == 0
    assert np.load(str(tmp_path / "v.npy")).shape == (2, 32)
    # a progress bar of lines on stderr; the file is written whole (no .tmp left), named as np.save names it
    assert "embedding: 2 lines" in capsys.readouterr().err and not os.path.exists(tmp_path / "v.npy.tmp")
    assert main(["embed", "--model", model_dir, "--input", str(src), "--format", "npy",
                 "--out", str(tmp_path / "w")]) == 0
    assert np.load(str(tmp_path / "w.npy")).shape == (2, 32) and "to " + str(tmp_path / "w.npy") in \
        capsys.readouterr().err
    assert main(["embed", "--model", model_dir, "--input", str(src), "--words"]) == 0
    words = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [w["word"] for w in words[-1]["words"]] == ["학교에서", "공부했다"]
    assert main(["embed", "--model", model_dir, "--input", str(src), "--prompt", "질문: "]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    np.testing.assert_allclose(rows[1]["vector"], emb.encode("학교에서 공부했다", prompt="질문: "), atol=1e-5)
    assert main(["embed", "--model", model_dir, "--input", str(src), "--prompt-name", "query"]) == 1
    assert "'query' is not one of this model's prompts" in capsys.readouterr().err
    assert main(["embed", "--model", model_dir, "--input", str(src), "--truncate-dim", "8"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    np.testing.assert_allclose(rows[1]["vector"], emb.encode("학교에서 공부했다", truncate_dim=8), atol=1e-5)
    # Windows line ends are not part of the text; a CP949 line is named, with the fix
    (tmp_path / "crlf.txt").write_bytes("학교에서 공부했다\r\n".encode("utf-8-sig"))
    assert main(["embed", "--model", model_dir, "--input", str(tmp_path / "crlf.txt")]) == 0
    assert [json.loads(x)["text"] for x in capsys.readouterr().out.splitlines()] == ["학교에서 공부했다"]
    (tmp_path / "cp949.txt").write_bytes("좋다\n".encode() + "학교에서 공부했다\n".encode("cp949"))
    assert main(["embed", "--model", model_dir, "--input", str(tmp_path / "cp949.txt")]) == 1
    assert "cp949.txt: line 2 is not UTF-8 text; it reads as Korean in CP949" in capsys.readouterr().err


@pytest.mark.slow
def test_quickstart_runs_end_to_end(tmp_path, capsys):
    from kbert.cli import main

    out = str(tmp_path / "qs")
    assert main(["quickstart", "--out", out, "--steps", "6"]) == 0
    text = capsys.readouterr().out
    assert "[4/4] embeddings" in text and "done in" in text
    assert text.count("words nearest '") == 3  # the word-vector example: 3 frequent words and their neighbours
    emb = kbert.Embedder.load(f"{out}/model")  # what `kbert embed` and users load
    assert emb.encode("대한민국은 민주공화국이다.").shape == (128,)
    assert main(["quickstart", "--out", out, "--steps", "6"]) == 0  # a rerun finds the finished run
    rerun = capsys.readouterr()
    assert "already holds a finished run" in rerun.out
    # its bar shows the 6 steps done before, with no rate (it read 6 steps in 0 s: millions of steps/s)
    done = [frame for frame in re.split(r"[\r\n]", rerun.err) if "6/6 [" in frame]
    assert done and all("?step/s" in frame for frame in done), rerun.err


@pytest.mark.slow
@needs_shared
def test_quickstart_on_a_text_per_line_reads_lines_and_joins_the_short_ones(tmp_path, capsys):
    """`kbert quickstart --corpus reviews.txt --format lines`: each review a document (before, the command had no
    way to say so and read 1,000-line documents), and documents this short joined into full sequences."""
    import re

    from kbert.cli import main
    from kbert.data.recipes import movie_review_sentiment

    from helpers import SHARED

    rows = movie_review_sentiment(os.path.join(SHARED, "movie-reviews"), split="train", limit=2000)
    reviews = str(tmp_path / "reviews.txt")
    with open(reviews, "w", encoding="utf-8") as f:
        f.write("\n".join(r["text"] for r in rows) + "\n")
    assert main(["quickstart", "--corpus", reviews, "--format", "lines", "--out", str(tmp_path / "qs"),
                 "--steps", "6", "--vocab-size", "2000"]) == 0
    out, err = capsys.readouterr()
    documents = int(re.search(r"\[1/4\] corpus .*?: ([\d,]+) documents", out).group(1).replace(",", ""))
    assert documents == len({r["text"].strip() for r in rows if r["text"].strip()})  # a review a document
    assert "are joined until each fills a sequence" in out and "read as lines" in out + err
    assert "lines without a blank line" not in out + err and "done in" in out


def test_wordpiece_tokenizer_exports_to_transformers(tmp_path):
    import transformers

    from helpers import KOREAN_SENTENCES

    tok = kbert.Tokenizer.train(corpus(["kolaw", "kobill"]), vocab_size=2000, algorithm="wordpiece", progress=False)
    tok.export_transformers(str(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in KOREAN_SENTENCES + ["  여러   공백\t탭 ", "헌법 제1조 ①항"]:
        assert hf(text)["input_ids"] == tok.encode(text).ids, text
    morphemes = kbert.Tokenizer.train(corpus(["kolaw"]), vocab_size=800, algorithm="wordpiece", morphemes="mecab",
                                      progress=False)
    with pytest.raises(ValueError, match="mecab-morpheme tokenizer"):
        morphemes.export_transformers(str(tmp_path / "m"))


def _review_texts(n):
    import csv
    import gzip

    from helpers import SHARED

    path = os.path.join(SHARED, "movie-reviews", "reviews.tsv.gz")
    if not os.path.isfile(path):
        return []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        return [row["text"] for _, row in zip(range(n), reader)]


@pytest.mark.parametrize("lowercase", [False, True])
def test_unigram_tokenizer_exports_to_transformers_with_the_same_ids(tmp_path, lowercase):
    """kbert's default vocabulary (SentencePiece unigram) goes out as a tokenizer.json that AutoTokenizer reads:
    the same ids on Korean sentences, odd whitespace and control characters, emoji (byte fallback), a user
    symbol, literal `▁`, pairs with segment ids; decoding gives the normalized text; a word's first piece is
    offset on the word, not the space before it (as XLM-RoBERTa's tokenizer.json, for pipelines' spans); the
    tokenizer.json alone loads back into kbert with the original's ids, and so does the layout kbert wrote
    before (`▁` put in by the normalizer). The only differences allowed with transformers are
    segmentations of equal score (`...` + `..` vs `..` + `...`), which `tokenizers` orders as sentencepiece
    < 0.2.2 did: at most 0.2% of 3,000 movie reviews."""
    import transformers

    from helpers import KOREAN_SENTENCES

    tok = kbert.Tokenizer.train(corpus(["kolaw", "kobill"]), vocab_size=2000, progress=False, lowercase=lowercase,
                                user_defined_symbols=["<url>"])
    tok.export_transformers(str(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    texts = KOREAN_SENTENCES + ["  여러   공백\t탭 \u200b", "헌법 제1조 ①항 😀 Hello WORLD", "", "   ",
                                "<url>로 가기: 주소<url>다음", "\u3000전각\u00a0공백 끝\u3000", "▁", "a ▁b ▁", "x ▁▁y▁ z▁▁"]
    for text in texts:
        assert hf(text)["input_ids"] == tok.encode(text).ids, (text, hf.tokenize(text), tok.encode(text).tokens)
    for text in KOREAN_SENTENCES:
        enc, ours = hf(text, return_offsets_mapping=True), tok.encode(text)
        pieces = [(t, o, tuple(r)) for t, o, r in zip(ours.tokens, ours.offsets, enc["offset_mapping"])
                  if t != "\u2581" and not t.startswith("<0x")]  # a lone `▁`: kbert empty, transformers the next char
        assert [o for _, o, _ in pieces] == [r for _, _, r in pieces], text
        assert all(ours.normalized[s:e] == t.lstrip("\u2581") for t, (s, e), _ in pieces[1:-1]), text
    pair = hf("대한민국은 민주공화국이다.", "모든 권력은 국민으로부터 나온다.")
    expect = tok.encode("대한민국은 민주공화국이다.", "모든 권력은 국민으로부터 나온다.")
    assert pair["input_ids"] == expect.ids and sum(pair["token_type_ids"]) == len(expect.ids) - expect.ids.index(3) - 1
    for text in texts[:4]:
        assert hf.decode(hf(text)["input_ids"], skip_special_tokens=True) == tok.decode(tok.encode(text).ids)
    reviews = _review_texts(3000)
    if reviews:
        same = sum(hf(t)["input_ids"] == tok.encode(t).ids for t in reviews)
        assert same >= 0.998 * len(reviews), f"{len(reviews) - same} of {len(reviews)} reviews differ"
    # ... and the tokenizer.json alone reads back into kbert as the tokenizer it came from (byte fallback,
    # lowercasing and kbert's normalization included), in Python and in the graph
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "tokenizer.json").write_bytes((tmp_path / "tokenizer.json").read_bytes())
    back = kbert.Tokenizer.load(str(alone))
    assert back.lowercase == lowercase
    for text in texts + reviews[:500]:
        assert back.encode(text).ids == tok.encode(text).ids, text
    import tensorflow as tf

    graph = back.tf_tokenize(tf.constant(texts)).to_list()
    assert graph == [tok.encode(t).ids for t in texts]
    # a tokenizer.json in kbert's earlier layout: the `▁` prepended and for spaces by the normalizer
    import tokenizers
    from tokenizers import normalizers, pre_tokenizers

    from kbert.text.normalize import tokenizers_normalizer

    legacy = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    legacy.normalizer = normalizers.Sequence([tokenizers_normalizer(lowercase=lowercase),
                                              normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    legacy.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    legacy.save(str(alone / "tokenizer.json"))
    old = kbert.Tokenizer.load(str(alone))
    assert old.lowercase == lowercase
    assert [old.encode(t).ids for t in texts] == [tok.encode(t).ids for t in texts]
    bpe = kbert.Tokenizer.train(corpus(["kolaw"]), vocab_size=800, algorithm="bpe", progress=False)
    with pytest.raises(ValueError, match="only unigram"):
        bpe.export_transformers(str(tmp_path / "bpe"))
    repeat = kbert.Tokenizer.train(corpus(["kolaw"]), vocab_size=800, repeat=2, progress=False)
    with pytest.raises(ValueError, match="repeat=2"):
        repeat.export_transformers(str(tmp_path / "repeat"))


def test_encode_under_mixed_precision(emb, tmp_path):
    model_dir = str(tmp_path / "m")
    kbert.save_model(emb.backbone, model_dir, tokenizer=emb.tokenizer)
    full = emb.encode(TEXTS)
    for policy in ("mixed_bfloat16", "mixed_float16"):
        half = kbert.Embedder.load(model_dir, dtype=policy)
        v = half.encode(TEXTS)
        assert v.dtype == np.float32 and np.isfinite(v).all()
        assert np.min(np.sum(v * full, axis=1)) > 0.99, policy  # same directions as float32


def test_lengths_beyond_the_positions_are_refused_everywhere(tmp_path):
    """One rule for every entry: a max_length beyond the model's positions is an error with the limit (the
    Embedder and export clamped it silently while pretraining refused it)."""
    import warnings

    from kbert.embed.export import export

    tok = kbert.Tokenizer.train(corpus("kolaw"), vocab_size=1000, progress=False)
    cfg = kbert.ModelConfig.preset("bert-tiny", vocab_size=tok.vocab_size, max_position=32)
    kbert.save_model(kbert.build_backbone(cfg), str(tmp_path / "m"), tokenizer=tok)
    with pytest.raises(ValueError, match="max_length`=4096 is beyond the model's 32 position embeddings"):
        kbert.Embedder.load(str(tmp_path / "m"), max_length=4096)
    emb = kbert.Embedder.load(str(tmp_path / "m"))
    with pytest.raises(ValueError, match="beyond the model's 32"):
        emb.encode(["법 앞에 평등하다"], max_length=100)
    with pytest.raises(ValueError, match="beyond the model's 32"):
        export(str(tmp_path / "m"), str(tmp_path / "serve"), max_length=100000)
    with pytest.raises(ValueError, match="beyond the model's 32"):
        kbert.finetune(str(tmp_path / "m"), "classification", [{"text": "좋다", "label": "1"},
                                                                {"text": "싫다", "label": "0"}],
                       out_dir=str(tmp_path / "ft"), max_length=4096, progress=False)
    # a masked-LM head's readers clamped it to the positions (a shorter window than asked, unsaid)
    pretrainer = kbert.Pretrainer(kbert.build_backbone(cfg), pair_objective=None)
    with pytest.raises(ValueError, match="max_length`=64 is beyond the model's 32"):
        kbert.MaskedLM(pretrainer, tok, max_length=64)
    with pytest.raises(ValueError, match="max_length`=64 is beyond the model's 32"):
        kbert.SparseEncoder(pretrainer, tok, max_length=64)
    assert kbert.MaskedLM(pretrainer, tok).max_length == kbert.SparseEncoder(pretrainer, tok).max_length == 32
    with pytest.raises(ValueError, match="max_length` must be an integer >= 3. Received: max_length=2"):
        kbert.MaskedLM(pretrainer, tok, max_length=2)
    with pytest.raises(ValueError, match="query_max_length` must be a positive integer"):
        kbert.SparseEncoder(pretrainer, tok, query_max_length=0)
    # 0 was read as "no max_length given" (the default) by the loaders and the export
    with pytest.raises(ValueError, match="max_length` must be an integer >= 2. Received: max_length=0"):
        kbert.Embedder.load(str(tmp_path / "m"), max_length=0)
    with pytest.raises(ValueError, match="max_length` must be an integer >= 2. Received: max_length=0"):
        export(str(tmp_path / "m"), str(tmp_path / "serve"), max_length=0)
    long = " ".join(["대한민국은 민주공화국이다."] * 20)
    with warnings.catch_warnings(record=True) as caught:  # at the model's limit the hint says so
        warnings.simplefilter("always")
        emb.encode([long])
    assert any("32 is the model's limit" in str(w.message) for w in caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        emb.encode([long], max_length=16)
    assert any("pass max_length= up to 32" in str(w.message) for w in caught)


HUB_SCRIPT = r"""
import json, sys
import kbert
emb = kbert.Embedder.load("kbert-test/tiny-bert")
model = kbert.load_model("kbert-test/tiny-bert")
try:
    kbert.load_model("kbert-test/not-cached")
except FileNotFoundError as e:
    missing = str(e)
print(json.dumps({"shape": list(emb.encode(["대한민국은 민주공화국이다."]).shape), "layers": model.config.num_layers,
                  "missing": missing}))
"""


def test_hub_names_load_through_huggingface_hub_and_its_cache(tmp_path):
    """`Embedder.load("org/name")` / `load_model(NAME)` resolve Hugging Face Hub names with huggingface_hub's
    own snapshot_download. Nothing can be downloaded here: the test lays out a hub cache holding a tiny model
    and runs offline (HF_HUB_OFFLINE=1), which is also how users run against their cache."""
    import json
    import subprocess
    import sys

    from helpers import tiny_hf_pretraining_model

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--kbert-test--tiny-bert"
    snapshot = repo / "snapshots" / commit
    tiny_hf_pretraining_model("bert").save_pretrained(snapshot)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list("대한민국은주공화이다.") + [f"##{c}" for c in "한국다"]
    vocab += [f"[unused{i}]" for i in range(99 - len(vocab))]
    (snapshot / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, "-c", HUB_SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["shape"] == [1, 32] and out["layers"] == 3
    assert "kbert-test/not-cached" in out["missing"] and "HF_HUB_OFFLINE" in out["missing"]


def test_hub_fetches_torch_weights_only_for_a_repo_without_safetensors(tmp_path, monkeypatch):
    """A repo holding model.safetensors and pytorch_model.bin gets the safetensors only (each form can be
    hundreds of MB); a repo with only the .bin (KcBERT-era uploads) gets it, shards included."""
    import huggingface_hub

    from kbert.models.locate import resolve_hub_name

    calls = []
    layouts = {"org/both": ["config.json", "model.safetensors", "pytorch_model.bin"],
               "org/bin-only": ["config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]}

    def snapshot_download(name, allow_patterns):
        import fnmatch

        calls.append((name, list(allow_patterns)))
        folder = tmp_path / name.replace("/", "--") / str(len(calls))
        folder.mkdir(parents=True)
        for file in layouts[name]:
            if any(fnmatch.fnmatch(file, p) for p in allow_patterns):
                (folder / file).write_text("x")
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    both = resolve_hub_name("org/both")
    assert sorted(os.listdir(both)) == ["config.json", "model.safetensors"] and len(calls) == 1
    only = resolve_hub_name("org/bin-only")
    assert len(calls) == 3 and sorted(os.listdir(only)) == ["config.json", "pytorch_model-00001-of-00002.bin",
                                                            "pytorch_model-00002-of-00002.bin"]


def test_candidate_pairs_pair_each_sentence_with_its_nearest_and_leave_out_excluded_pairs():
    """Augmented SBERT's sampling (`kbert.candidate_pairs`): nearest TF-IDF neighbours, never a sentence with
    itself, an excluded (labelled) pair in either order, or one pair twice; random draws are seeded."""
    a, a2, b, b2 = "서울 날씨가 맑다", "서울 날씨가 맑습니다", "축구 경기가 열렸다", "축구 경기가 열립니다"
    gold = [(a, b), (b2, a2)]
    pairs = kbert.candidate_pairs([a, b, a2, b2, a], neighbours=1, randoms=0, exclude=gold, progress=False)
    keys = [frozenset(p) for p in pairs]
    assert set(keys) == {frozenset((a, a2)), frozenset((b, b2))}  # each sentence's nearest, found from both ends
    assert len(keys) == len(set(keys)) and all(isinstance(p, tuple) and len(p) == 2 for p in pairs)
    assert pairs[0] == tuple(sorted((a, a2)))  # sentences in sorted order, each with its nearest first
    with_random = kbert.candidate_pairs([a, a2, b, b2], neighbours=1, randoms=3, exclude=gold, seed=2,
                                        progress=False)
    keys = [frozenset(p) for p in with_random]
    assert len(keys) == len(set(keys)) and all(len(k) == 2 for k in keys)
    assert not {frozenset(g) for g in gold} & set(keys)
    assert with_random == kbert.candidate_pairs([a, a2, b, b2], neighbours=1, randoms=3, exclude=gold, seed=2,
                                                progress=False)
    # more neighbours than other sentences: every other one; punctuation only (no n-gram): random draws still pair
    assert len(kbert.candidate_pairs([a, a2, b], neighbours=9, randoms=0, progress=False)) == 3
    assert len(kbert.candidate_pairs(["?", "!"], neighbours=1, randoms=1, progress=False)) == 1
    for bad, match in [(dict(sentences=[a, a, " "]), "1 distinct non-empty"), (dict(sentences=a), "not one string"),
                       (dict(sentences=[a, b], neighbours=-1), "`neighbours`"),
                       (dict(sentences=[a, b], randoms=1.5), "`randoms`")]:
        with pytest.raises(ValueError, match=match):
            kbert.candidate_pairs(progress=False, **bad)


class _AngleEmbedder:
    """A stand-in model: each text a unit vector in 2-D at its angle x `turn` (what label_pairs calls of it)."""

    angle = {"a": 0.0, "b": 0.5, "c": 1.0, "d": 2.0, "e": 3.0}

    def __init__(self, turn):
        self.turn, self.calls = turn, 0

    def encode(self, texts, batch_size=64, progress=True):
        self.calls += 1
        return np.array([[np.cos(self.turn * self.angle[t]), np.sin(self.turn * self.angle[t])] for t in texts])

    def cos(self, s, t):
        return float(np.sum(self.encode([s]) * self.encode([t])))


def test_label_pairs_put_the_teachers_mean_cosine_on_the_gold_labels_scale(tmp_path):
    """`kbert.label_pairs`: the score is the mean of the teachers' cosines, mapped by the least-squares line from
    cosine to label on the gold pairs and clipped to the labels' range; without gold the cosine itself."""
    one, two = _AngleEmbedder(1.0), _AngleEmbedder(0.5)
    gold = [{"sentence1": s, "sentence2": t, "score": str(2.0 + 3.0 * one.cos(s, t))} for s, t in
            (("a", "b"), ("a", "c"), ("b", "d"), ("a", "d"))]
    report = {}
    silver = kbert.label_pairs(one, [("b", "c"), ("a", "e")], gold=gold, progress=False, report=report)
    assert [(r["sentence1"], r["sentence2"]) for r in silver] == [("b", "c"), ("a", "e")]
    high = max(float(g["score"]) for g in gold)
    assert silver[0]["score"] == pytest.approx(min(2.0 + 3.0 * one.cos("b", "c"), high), abs=1e-3)
    low = min(float(g["score"]) for g in gold)  # cos(0, 3) = -0.99: 2 - 2.97, under every gold label: clipped
    assert silver[1]["score"] == pytest.approx(low, abs=1e-4) and report["clipped"] >= 1
    assert report["slope"] == pytest.approx(3.0) and report["intercept"] == pytest.approx(2.0)
    # an ensemble: the mean cosine (no gold: the cosine itself), rows in, named columns out, each text once
    mean = (one.cos("b", "d") + two.cos("b", "d")) / 2
    calls = two.calls
    rows = kbert.label_pairs([one, two], [{"x": "b", "y": "d"}], text_column="x", pair_column="y",
                             label_column="sim", progress=False)
    assert two.calls == calls + 1  # one encode call per teacher model for all the pairs' texts
    assert rows == [{"x": "b", "y": "d", "sim": pytest.approx(round(mean, 4))}]
    path = tmp_path / "pairs.tsv"
    path.write_text("sentence1\tsentence2\nb\td\n", encoding="utf-8")
    assert kbert.label_pairs([one, two], str(path), progress=False)[0]["score"] == pytest.approx(round(mean, 4))
    for bad, match in [(dict(teacher=[], pairs=[("a", "b")]), "empty list"),
                       (dict(teacher=one, pairs=[]), "no pair"), (dict(teacher=one, pairs=[("a",)]), "two texts"),
                       (dict(teacher=one, pairs=[("a", "b")], gold=gold[:1]), "at least 2 pairs"),
                       (dict(teacher=one, pairs=[("a", "b")], gold=[dict(gold[0], score="high"), gold[1]]),
                        "not a number"),
                       # a NaN label fitted a NaN line: every silver score came back NaN
                       (dict(teacher=one, pairs=[("a", "b")], gold=[dict(gold[0], score="nan"), gold[1]]),
                        "gold row 1: label 'nan' is not a finite number"),
                       (dict(teacher=one, pairs=[("a", "b")], batch_size=0), "`batch_size`")]:
        with pytest.raises(ValueError, match=match):
            kbert.label_pairs(progress=False, **bad)


def test_weak_pairs_match_numbered_issues_to_holdings_and_statute_titles_to_their_purpose(tmp_path):
    """benchmarks/quality.py's weakly supervised pairs: a decision's issue [n] pairs with its holding [n], a
    decision whose counts differ gives none, a statute's title pairs with its purpose article, and a repeated
    sentence is kept once (in a batch it would be a false negative)."""
    import gzip
    import importlib.util
    import json

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "quality.py")
    spec = importlib.util.spec_from_file_location("quality_benchmark", path)
    quality = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quality)
    issue1, issue2 = "혼수 구입비용의 손해배상청구를 배척한 사례", "주택구입 명목의 금원은 반환되어야 한다고 한 사례"
    held1, held2 = "가재도구는 원고의 소유에 속하므로 손해가 없다.", "주택구입 명목으로 교부한 금원은 전액 반환되어야 한다."
    decisions = [
        f"# 손해배상\n\n## 판시사항\n\n[1] {issue1}\n[2] {issue2}\n\n## 판결요지\n\n[1] {held1}\n  [2] {held2}\n\n"
        "## 판례내용\n\n본문",
        "# 다른 사건\n\n## 판시사항\n\n[1] 하나뿐인 판시사항입니다\n\n## 판결요지\n\n[1] 첫째 요지입니다.\n[2] 둘째 요지입니다.\n",
        f"# 같은 요지\n\n## 판시사항\n\n다른 말로 쓴 판시사항입니다\n\n## 판결요지\n\n{held1}\n"]
    statute = "# 어떤 법률\n\n##### 제1조 (목적)\n\n이 법은 **국민의 안전**을 목적으로 한다. <개정 2023.8.8>\n\n##### 제2조 (정의)\n\n정의"
    for folder, docs in (("korean-precedents", [{"title": "t", "text": t} for t in decisions]),
                         ("korean-statutes", [{"title": "어떤 법률", "text": statute}])):
        os.makedirs(tmp_path / folder)
        with gzip.open(tmp_path / folder / "documents.jsonl.gz", "wt", encoding="utf-8") as f:
            f.write("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
    rows = quality.weak_pairs(str(tmp_path), seed=0)
    assert sorted((r["anchor"], r["positive"]) for r in rows) == sorted(
        [(issue1, held1), (issue2, held2), ("어떤 법률", "이 법은 국민의 안전을 목적으로 한다.")])
    assert quality.weak_pairs(str(tmp_path), seed=0) == rows  # seeded order


def test_quality_ensemble_averages_cosines_and_plans_its_members():
    """benchmarks/quality.py's `--pretrain-seeds`: the ensemble's dot is the mean of its models' cosines (unit
    vectors again; its silver scores are `kbert.label_pairs`', tested above), a model mixed with TF-IDF takes
    the weight that ranks the selection pairs best, each pretraining gets its own seed, dir and 1/n of the
    steps, and `--zero-step-members` add members with no masked-LM step."""
    import argparse
    import importlib.util

    import numpy as np

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "quality.py")
    spec = importlib.util.spec_from_file_location("quality_benchmark", path)
    quality = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quality)
    angle = {"a": 0.0, "b": 0.5, "c": 1.0, "d": 2.0, "e": 3.0}  # sentence -> angle of its unit vector

    def model(turn):  # a "model": unit vectors in 2-D, its angles scaled by `turn`
        return lambda texts: np.array([[np.cos(turn * angle[t]), np.sin(turn * angle[t])] for t in texts])

    one, two = model(1.0), model(0.5)
    both = quality.ensemble_encoder([one, two])
    x, y = both(["a", "b", "d"]), both(["c", "e", "a"])
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, rtol=1e-6)
    mean_cos = (np.sum(one(["a", "b", "d"]) * one(["c", "e", "a"]), 1) + np.sum(two(["a", "b", "d"]) * two(["c", "e", "a"]), 1)) / 2
    np.testing.assert_allclose(np.sum(x * y, axis=1), mean_cos, rtol=1e-6)

    # dense + lexical as one vector: its dot is (1 - w) x one's cosine + w x two's; the weight is the one whose
    # mix ranks the scored pairs best (here the pairs were scored by the mix at 0.3 itself)
    other = {"a": 2.0, "b": 0.0, "c": 3.0, "d": 0.5, "e": 1.0}  # a "lexical" model that ranks differently
    two = lambda texts: np.array([[np.cos(other[t]), np.sin(other[t])] for t in texts])  # noqa: E731
    mixed = quality.lexical_encoder(one, two, 0.3)
    x, y = mixed(["a", "b", "d"]), mixed(["c", "e", "a"])
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.sum(x * y, axis=1), 0.7 * np.sum(one(["a", "b", "d"]) * one(["c", "e", "a"]), 1)
                               + 0.3 * np.sum(two(["a", "b", "d"]) * two(["c", "e", "a"]), 1), rtol=1e-6)
    pairs = [(s, t) for s in angle for t in angle if s < t]
    scored = [{"sentence1": s, "sentence2": t, "score": str(float(np.sum(mixed([s]) * mixed([t]))))} for s, t in pairs]
    weight, by = quality.pick_lexical_weight(one, two, scored, weights=(0.0, 0.3, 1.0))
    assert weight == 0.3 and by[0.3] == pytest.approx(1.0) and by[0.0] < 1.0 and by[1.0] < 1.0

    args = argparse.Namespace(pretrain_seeds=2, out="/tmp/q", seed=3, shared="/data", sts_seeds=1, steps=5574,
                              minutes=55.0, precision="float32", objective="mlm", embedding_init="cooccurrence",
                              morphemes="none", vocab_size=32000, simcse_lines=50000, simcse_lr=1e-4,
                              learning_rate=None, small=False, embedding_text="pretraining")
    cmd = quality.member_command(args, 1)
    assert cmd[cmd.index("--steps") + 1] == "2787" and cmd[cmd.index("--seed") + 1] == "4"
    assert cmd[cmd.index("--vocab-size") + 1] == "32000"  # every member trains its vocabulary at the size given
    assert cmd[cmd.index("--out") + 1] == quality.member_dir(args, 1) == os.path.join("/tmp/q", "pretrain-seed4")
    assert cmd[cmd.index("--rows") + 1] == quality.ENSEMBLE_ROW and "--minutes" not in cmd
    first = quality.member_command(args, 0)  # the reference rows run on the first pretraining only
    assert first[first.index("--rows") + 1].split(",") == [*quality.REFERENCE_ROWS, quality.ENSEMBLE_ROW]
    args.steps = 0  # members without a masked-LM step pass that on, not one step or a time budget
    cmd = quality.member_command(args, 1)
    assert cmd[cmd.index("--steps") + 1] == "0" and "--minutes" not in cmd
    assert cmd[cmd.index("--embedding-text") + 1] == "pretraining"
    args.pretrain_seeds, args.embedding_text = 3, "other,both"  # member k counts on the k-th text, cycled
    assert [quality.member_command(args, k)[quality.member_command(args, k).index("--embedding-text") + 1]
            for k in range(3)] == ["other", "both", "other"]
    # `--zero-step-members 2` beside 3 pretrained: members 3 and 4 take seeds 3 and 4 again (their own dirs), no
    # masked-LM step whatever the budget, and the texts from the start of the list
    args.steps, args.zero_step_members = 9000, 2
    assert quality.members(args) == 5 and quality.ensemble_tag(args) == "ensemble3-zero2"
    cmds = [quality.member_command(args, k) for k in range(5)]
    assert [c[c.index("--steps") + 1] for c in cmds] == ["3000", "3000", "3000", "0", "0"]
    assert [c[c.index("--seed") + 1] for c in cmds] == ["3", "4", "5", "3", "4"]
    assert [c[c.index("--out") + 1] for c in cmds] == [os.path.join("/tmp/q", d) for d in (
        "pretrain-seed3", "pretrain-seed4", "pretrain-seed5", "zero-step-seed3", "zero-step-seed4")]
    assert [c[c.index("--embedding-text") + 1] for c in cmds] == ["other", "both", "other", "other", "both"]
    assert [c[c.index("--rows") + 1] for c in cmds[1:]] == [quality.ENSEMBLE_ROW] * 4
    args.zero_step_members = 0  # without them the stage names stay those of the cached runs
    assert quality.ensemble_tag(args) == "ensemble3"


def test_quality_other_text_leaves_out_selection_questions_and_both_keeps_it_first(tmp_path):
    """benchmarks/quality.py's `--embedding-text`: the other text holds the comments, the utterances without their
    class, the boddari paragraphs and the question-pair training questions, never a selection question (recipes
    are chosen on those); "both" lists the other text before the pretraining text, so a token cap keeps all of it."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "quality.py")
    spec = importlib.util.spec_from_file_location("quality_benchmark", path)
    quality = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quality)
    files = {"korean-hate-speech/unlabeled_comments_5.txt": "댓글 하나입니다\n\n댓글 둘입니다\n",
             "3i4k/fci.txt": "0\t고급 빌딩 공사\n3\t내일 비가 올까요\n",
             "boddari/wikinews.txt": "위키뉴스 문단입니다\n", "boddari/unesco_report.txt": "유네스코 보고서 문단\n",
             "boddari/book_review01.txt": "서평 문단입니다\n"}
    questions = [(f"질문 {i}번은 무엇인가요", f"질문 {i}번이 뭐예요") for i in range(40)]
    files["question-pair/train.txt"] = "question1\tquestion2\tis_duplicate\n" + "".join(
        f"{a}\t{b}\t0\n" for a, b in questions)
    for name, text in files.items():
        os.makedirs(tmp_path / os.path.dirname(name), exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    pretraining = tmp_path / "pretraining.txt"
    pretraining.write_text("사전학습 문장입니다\n", encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    assert quality.embedding_text(str(tmp_path), str(out), str(pretraining), "pretraining") == str(pretraining)
    other = quality.embedding_text(str(tmp_path), str(out), str(pretraining), "other")
    lines = [x for x in open(other, encoding="utf-8").read().split("\n") if x]
    select = kbert.selection_split([{"question1": a, "question2": b} for a, b in questions], "question1")[1]
    assert select and not {r["question1"] for r in select} & set(lines)  # the selection part stays out
    fit = len(questions) - len(select)
    assert len(lines) == 2 + 2 + 3 + 2 * fit and "내일 비가 올까요" in lines and "3" not in lines
    both = quality.embedding_text(str(tmp_path), str(out), str(pretraining), "both")
    assert both == [other, str(pretraining)]  # no concatenated copy: the corpus reads the two files in order
    from kbert.data.corpus import Corpus

    texts = list(Corpus(both).texts())
    assert texts[0] == "댓글 하나입니다" and texts[-1] == "사전학습 문장입니다" and len(texts) == len(lines) + 1


@pytest.mark.parametrize("pooling,layers", [("mean", "all"), ("cls", -1), ("max", [1, -1]), ("first_last_avg", -1)])
def test_sentence_transformers_dir_gives_the_same_vectors_and_reads_back(emb, tmp_path, pooling, layers):
    """`kbert.export_sentence_transformers`: SentenceTransformer(dir).encode equals Embedder.encode for every
    kbert pooling (layer averages as WeightedLayerPooling), long texts truncated alike; Embedder.load(dir)
    reads the pooling back from the modules instead of defaulting to mean."""
    from sentence_transformers import SentenceTransformer

    num_hidden = emb.backbone.config.num_layers + 1
    embedder = kbert.Embedder(emb.backbone, emb.tokenizer, pooling=pooling,
                              layers=list(range(num_hidden)) if layers == "all" else layers)
    out = str(tmp_path / "st")
    kbert.export_sentence_transformers(embedder, out)
    texts = [t for t in TEXTS if t.strip()] + ["대한민국 헌법 " * 40]  # the last one longer than max_length
    st = SentenceTransformer(out, device="cpu")
    np.testing.assert_allclose(st.encode(texts), embedder.encode(texts), atol=2e-5)
    back = kbert.Embedder.load(out)
    np.testing.assert_allclose(back.encode(texts), embedder.encode(texts), atol=1e-6)
    assert back.pooling == ("mean" if pooling == "first_last_avg" else pooling)


def test_sentence_transformers_dirs_kbert_cannot_match_are_refused_by_name(emb, tmp_path):
    """A Dense layer with an activation kbert does not apply, or learned layer weights, would give other vectors
    than the dir's own model: refused,
    not read with a default pooling. `kbert convert --to sentence-transformers` writes the dir from the CLI."""
    import json
    import subprocess
    import sys

    from safetensors.numpy import save_file

    model_dir = str(tmp_path / "kb")
    kbert.save_model(emb.backbone, model_dir, tokenizer=emb.tokenizer)
    out = str(tmp_path / "st")
    proc = subprocess.run([sys.executable, "-m", "kbert.cli", "convert", "--model", model_dir, "--out", out, "--to",
                           "sentence-transformers"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "mean pooling" in proc.stdout, proc.stderr[-2000:]
    modules = json.load(open(os.path.join(out, "modules.json"), encoding="utf-8"))
    dense = modules[:2] + [{"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]
    os.makedirs(os.path.join(out, "2_Dense"))
    json.dump({"in_features": 32, "out_features": 8, "bias": True,
               "activation_function": "torch.nn.modules.activation.ReLU"},
              open(os.path.join(out, "2_Dense", "config.json"), "w", encoding="utf-8"))
    json.dump(dense, open(os.path.join(out, "modules.json"), "w", encoding="utf-8"))
    with pytest.raises(ValueError, match="Dense module's activation .*ReLU.* no kbert equivalent"):
        kbert.Embedder.load(out)
    learned = modules[:1] + [{"idx": 1, "name": "1", "path": "w", "type": "sentence_transformers.models.WeightedLayerPooling"}]
    os.makedirs(os.path.join(out, "w"))
    json.dump({"embedding_dimension": 32, "layer_start": 0, "num_hidden_layers": 2},
              open(os.path.join(out, "w", "config.json"), "w", encoding="utf-8"))
    save_file({"layer_weights": np.array([0.2, 0.5, 1.3], np.float32)}, os.path.join(out, "w", "model.safetensors"))
    json.dump(learned, open(os.path.join(out, "modules.json"), "w", encoding="utf-8"))
    with pytest.raises(ValueError, match="learned weights"):
        kbert.Embedder.load(out)


def test_a_sentence_transformers_dir_written_by_sentence_transformers_on_roberta_loads_with_its_pooling(tmp_path):
    """The layout of the Korean sentence models on the Hub (a KLUE-RoBERTa encoder with a WordPiece vocab.txt,
    [CLS] or mean Pooling, Normalize), written by sentence-transformers itself: Embedder.load gives its
    vectors, the pooling read from its modules."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    from helpers import KOREAN_SENTENCES

    tok = kbert.Tokenizer.train(corpus(["kolaw", "kobill"]), vocab_size=600, algorithm="wordpiece", progress=False)
    hf_dir = str(tmp_path / "roberta")
    tok.export_transformers(hf_dir)
    config = transformers.RobertaConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=66,
                                        pad_token_id=tok.pad_id, type_vocab_size=1)
    torch.manual_seed(0)
    transformers.RobertaModel(config).save_pretrained(hf_dir)
    for mode in ("cls", "mean"):
        st = SentenceTransformer(modules=[Transformer(hf_dir, max_seq_length=48), Pooling(32, pooling_mode=mode),
                                          Normalize()], device="cpu")
        out = str(tmp_path / f"st-{mode}")
        st.save(out)
        emb = kbert.Embedder.load(out)
        assert emb.pooling == mode and emb.max_length == 48
        texts = KOREAN_SENTENCES[:4] + ["대한민국 헌법 " * 30]
        np.testing.assert_allclose(emb.encode(texts), st.encode(texts), atol=2e-5)


def test_a_sentence_transformers_dir_with_a_dense_layer_gives_its_vectors_everywhere(tmp_path):
    """LaBSE's layout ([CLS] pooling, a tanh Dense layer, Normalize) and a dimension-reducing identity Dense,
    written by sentence-transformers: `Embedder.load` applies the layers (its vectors equal the dir's own),
    `export_sentence_transformers` writes them back, the SavedModel export carries them (its self-check
    compares it with `encode`), and fine-tuning refuses the dir by name."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    from helpers import KOREAN_SENTENCES

    tok = kbert.Tokenizer.train(corpus(["kolaw", "kobill"]), vocab_size=600, algorithm="wordpiece", progress=False)
    hf_dir = str(tmp_path / "bert")
    tok.export_transformers(hf_dir)
    config = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(hf_dir)
    texts = KOREAN_SENTENCES[:4] + ["대한민국 헌법 " * 30]
    for name, pooling, layers in [("labse", "cls", [Dense(32, 32)]),  # tanh: the Dense default
                                  ("reduce", "mean", [Dense(32, 24, activation_function=torch.nn.Identity()),
                                                      Dense(24, 12)])]:
        st = SentenceTransformer(modules=[Transformer(hf_dir, max_seq_length=48), Pooling(32, pooling_mode=pooling),
                                          *layers, Normalize()], device="cpu")
        out = str(tmp_path / name)
        st.save(out)
        emb = kbert.Embedder.load(out)
        assert emb.dimension == layers[-1].out_features and len(emb.dense) == len(layers)
        np.testing.assert_allclose(emb.encode(texts), st.encode(texts), atol=2e-5)
        assert emb.encode(texts, truncate_dim=8).shape == (len(texts), 8)
        with pytest.raises(ValueError, match=f"integer in \\[1, {emb.dimension}\\]"):
            emb.encode(texts, truncate_dim=emb.dimension + 1)
        again = str(tmp_path / f"{name}-again")
        kbert.export_sentence_transformers(emb, again)
        np.testing.assert_allclose(SentenceTransformer(again, device="cpu").encode(texts), st.encode(texts), atol=2e-5)
        assert "Dense 32 -> " in open(os.path.join(again, "README.md"), encoding="utf-8").read()
    kbert.export(out, str(tmp_path / "serving"))  # raises unless the SavedModel equals encode to 1e-5
    with pytest.raises(ValueError, match="Dense module projects"):
        kbert.finetune(out, "sentence-embedding", [{"a": "가", "b": "나"}] * 4, text_column="a", pair_column="b",
                       label_column=None, out_dir=str(tmp_path / "ft"), progress=False)


def test_whitening_fitted_on_texts_centres_and_decorrelates_and_travels_with_the_model(emb, tmp_path):
    """`Embedder.fit_whitening`: on the texts it was fitted on, the vectors (before normalization) have mean 0
    and identity covariance, `dim` keeps the axes of most variance, and the projection goes out as a
    sentence-transformers Dense layer that gives the same vectors there and back."""
    from sentence_transformers import SentenceTransformer

    lines = [line.strip() for line in corpus(["kolaw", "kobill"]).texts() if len(line.strip()) > 5][:300]
    white = kbert.Embedder(emb.backbone, emb.tokenizer)
    assert white.fit_whitening(lines) is white
    # a random model's layer norm leaves every vector's entries summing to 0: 31 axes vary, and only they are kept
    assert white.dimension == 31
    raw = white.encode(lines, normalize=False).astype(np.float64)
    np.testing.assert_allclose(raw.mean(axis=0), 0, atol=1e-3)
    np.testing.assert_allclose(np.cov(raw, rowvar=False), np.eye(31), atol=2e-3)
    small = kbert.Embedder(emb.backbone, emb.tokenizer).fit_whitening(lines, dim=8)
    assert small.encode(lines[:3]).shape == (3, 8)
    np.testing.assert_allclose(small.encode(lines[:5], normalize=False), raw[:5, :8], atol=1e-3)  # its first axes
    out = str(tmp_path / "whitened")
    kbert.export_sentence_transformers(small, out)
    np.testing.assert_allclose(SentenceTransformer(out, device="cpu").encode(lines[:20]), small.encode(lines[:20]),
                               atol=2e-5)
    np.testing.assert_allclose(kbert.Embedder.load(out).encode(lines[:20]), small.encode(lines[:20]), atol=1e-6)
    with pytest.raises(ValueError, match="`dim` must be an integer in \\[1, 31\\].*vary along"):
        kbert.Embedder(emb.backbone, emb.tokenizer).fit_whitening(lines, dim=32)
    with pytest.raises(ValueError, match="at least 2 texts"):
        kbert.Embedder(emb.backbone, emb.tokenizer).fit_whitening(lines[:1])
    with pytest.raises(ValueError, match="\\[1, 9\\].*more texts than dimensions"):  # 10 texts: 9 axes at most
        kbert.Embedder(emb.backbone, emb.tokenizer).fit_whitening(lines[:10], dim=16)


@pytest.mark.parametrize("lowercase", [False, True])
def test_a_hugging_face_wordpiece_tokenizer_json_alone_loads(tmp_path, lowercase):
    """transformers >= 5 saves BERT-style tokenizers as tokenizer.json only (no vocab.txt): kbert reads its
    WordPiece vocabulary and lowercasing and gives the same ids; a tokenizer.json of another model is named."""
    import json

    import transformers

    from helpers import KOREAN_SENTENCES

    tok = kbert.Tokenizer.train(corpus(["kolaw", "kobill"]), vocab_size=800, algorithm="wordpiece", progress=False)
    tok.save(str(tmp_path / "kb"))
    fast = transformers.BertTokenizerFast(os.path.join(str(tmp_path / "kb"), "vocab.txt"), do_lower_case=lowercase,
                                          strip_accents=False)
    out = str(tmp_path / "hf")
    fast.save_pretrained(out)
    for name in os.listdir(out):
        if name != "tokenizer.json":
            os.remove(os.path.join(out, name))
    loaded = kbert.Tokenizer.load(out)
    assert loaded.kind == "wordpiece" and loaded.lowercase == lowercase and loaded.vocab == tok.vocab
    for text in KOREAN_SENTENCES[:4] + ["Hello WORLD 헌법 제1조"]:
        assert loaded.encode(text).ids == fast(text)["input_ids"], text
    spec = json.load(open(os.path.join(out, "tokenizer.json"), encoding="utf-8"))
    spec["model"] = {"type": "BPE", "vocab": {}, "merges": []}
    json.dump(spec, open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8"))
    with pytest.raises(ValueError, match="'BPE' tokenizer"):
        kbert.Tokenizer.load(out)


def test_fine_tuning_a_sentence_transformers_dir_keeps_its_pooling(emb, tmp_path):
    """`kbert.finetune(st_dir, "sentence-embedding", ...)` goes on with the dir's own pooling (here [CLS] over
    the last layer) instead of switching to kbert's default mean pooling, and its result encodes that way."""
    cls_embedder = kbert.Embedder(emb.backbone, emb.tokenizer, pooling="cls")
    st_dir = kbert.export_sentence_transformers(cls_embedder, str(tmp_path / "st"))
    rows = [{"sentence1": a, "sentence2": b, "score": s} for a, b, s in (
        ("대한민국은 민주공화국이다.", "대한민국은 공화국이다.", 4.5), ("국민은 법 앞에 평등하다.", "날씨가 맑다.", 0.5),
        ("헌법을 개정한다.", "헌법 개정", 4.0), ("대통령은 국가의 원수이다.", "법률을 공포한다.", 1.0))]
    out = str(tmp_path / "tuned")
    kbert.finetune(st_dir, "sentence-embedding", rows * 4, rows, out_dir=out, text_column="sentence1",
                   pair_column="sentence2", label_column="score", max_steps=2, batch_size=4, progress=False)
    tuned = kbert.Embedder.load(out)
    assert tuned.pooling == "cls" and tuned.layers in (-1, [-1])


class _TableEmbedder(kbert.Embedder):
    """Fixed vectors per text (no model), so the mining logic is checked against cosines set by hand."""

    def __init__(self, table):
        self.table = table
        self.prompts, self.default_prompt_name = {}, None

    def encode(self, texts, progress=True, **options):
        return np.array([self.table[t] for t in texts], np.float32)


def _mining_table():
    """Anchor 'a' = e0; each other text c * e0 + sqrt(1 - c^2) * e_k (its own axis k), so cos(a, text) = c."""
    cosines = {"p": 0.9, "p2": 0.85, "n1": 0.95, "n2": 0.87, "n3": 0.8, "n4": 0.5, "n5": 0.1}
    width = len(cosines) + 3
    table = {"a": np.eye(width)[0], "b": np.eye(width)[1]}
    for k, (text, c) in enumerate(cosines.items()):
        table[text] = c * np.eye(width)[0] + np.sqrt(1 - c * c) * np.eye(width)[k + 3]
    table["q"] = 0.6 * np.eye(width)[1] + 0.8 * np.eye(width)[2]  # b's positive; cos(a, q) = 0
    return table


def test_mined_negatives_skip_the_anchors_own_texts_and_keep_to_margins_ranks_and_sampling():
    from kbert.embed.mining import mine_hard_negatives

    emb = _TableEmbedder(_mining_table())
    pairs = [{"anchor": "a", "positive": "p", "id": 1}, {"anchor": "a", "positive": "p2", "id": 2},
             {"anchor": "b", "positive": "q", "id": 3}]
    corpus = ["a", "p", "p2", "q", "n1", "n2", "n3", "n4", "n5", "n3"]  # a repeat counts once

    def mine(**kw):
        report = {}
        rows = mine_hard_negatives(emb, pairs, corpus, progress=False, report=report, **kw)
        return [(r["id"], r["negative"]) for r in rows], report

    # default relative margin 0.05: n1 (above the positive) and n2 (0.87 > 0.95 x 0.9) are probable positives;
    # p2 is another positive of anchor a, so never its negative, and a text is never its own negative
    rows, report = mine()
    assert rows[:2] == [(1, "n3"), (2, "n3")]  # 0.8 <= 0.855 and <= 0.8075
    assert rows[2][0] == 3 and rows[2][1] not in ("b", "q")  # every other text is at cos 0 from b
    assert report["pairs"] == 3 and report["with_negatives"] == 3 and report["candidates"] == 9
    assert report["positive_score"] == pytest.approx((0.9 + 0.85 + 0.6) / 3, abs=1e-6)
    rows = mine_hard_negatives(emb, pairs, corpus, progress=False)
    assert rows[0] == {"anchor": "a", "positive": "p", "id": 1, "negative": "n3"}  # the pair's columns kept
    assert mine(num_negatives=2)[0][:4] == [(1, "n3"), (1, "n4"), (2, "n3"), (2, "n4")]
    assert mine(relative_margin=None)[0][0] == (1, "n1")  # no filter: the nearest that is not a's own
    assert mine(relative_margin=None, margin=0.2)[0][:2] == [(1, "n4"), (2, "n4")]  # at most 0.7 / 0.65
    assert mine(relative_margin=None, max_score=0.6)[0][0] == (1, "n4")
    assert mine(relative_margin=None, range_min=3)[0][0] == (1, "n4")  # skips n1, n2, n3 (a's own not ranked)
    rows, report = mine(range_max=2)  # n1 and n2 only, both filtered: no negative for anchor a
    assert [i for i, _ in rows] == [3] and report["with_negatives"] == 1 and report["short"] == 2
    drawn = mine(sampling="random", num_negatives=2, seed=5)[0]
    assert drawn == mine(sampling="random", num_negatives=2, seed=5)[0]  # seeded
    assert {n for i, n in drawn if i == 1} <= {"n3", "n4", "n5", "q"} and len(drawn[:2]) == 2
    assert drawn[0] != drawn[1]
    draws = {tuple(mine(sampling="random", seed=s)[0][:1]) for s in range(12)}
    assert len(draws) > 1  # not always the top one
    # default corpus: the pairs' distinct positives
    assert mine_hard_negatives(emb, pairs, progress=False)[0]["negative"] == "q"  # p, p2 are a's own
    for bad, match in [(dict(num_negatives=0), "`num_negatives`"), (dict(range_min=2, range_max=2), "`range_max`"),
                       (dict(relative_margin=1.0), "`relative_margin`"), (dict(sampling="hard"), "`sampling`"),
                       (dict(lexical=2), "`lexical`"), (dict(margin=-1), "`margin`"), (dict(chunk=0), "`chunk`"),
                       # NaN compared as no bound (every candidate kept); True read as a margin of 1
                       (dict(max_score=float("nan")), "`max_score`"), (dict(margin=True), "`margin`")]:
        with pytest.raises(ValueError, match=match):
            mine_hard_negatives(emb, pairs, corpus, progress=False, **bad)
    with pytest.raises(ValueError, match="already have a column 'id'"):
        mine_hard_negatives(emb, pairs, corpus, negative_column="id", progress=False)
    with pytest.raises(ValueError, match="no column 'positive'"):
        mine_hard_negatives(emb, [{"anchor": "a", "pos": "p"}], corpus, progress=False)
    with pytest.raises(ValueError, match="lexical=1"):
        mine_hard_negatives(None, pairs, corpus, progress=False)
    # chunks of one anchor give the same rows as one chunk
    assert mine_hard_negatives(emb, pairs, corpus, chunk=1, progress=False) == \
        mine_hard_negatives(emb, pairs, corpus, progress=False)


def test_lexical_mining_needs_no_model_and_finds_the_negative_that_shares_words(emb, tmp_path, capsys):
    from kbert.cli import main
    from kbert.data.rows import read_rows
    from kbert.embed.mining import mine_hard_negatives

    pairs = [{"anchor": "서울 날씨 어때", "positive": "오늘 서울은 맑을까"},
             {"anchor": "고양이 사료 추천해줘", "positive": "고양이한테 뭐 먹이지"}]
    corpus = ["부산 날씨 어때", "강아지 사료 추천해줘", "주식 시장 전망", "오늘 서울은 맑을까"]
    rows = mine_hard_negatives(None, pairs, corpus, lexical=1.0, relative_margin=None, progress=False)
    assert [r["negative"] for r in rows] == ["부산 날씨 어때", "강아지 사료 추천해줘"]
    # hybrid: the model's cosine and TF-IDF mixed, as Embedder.search(..., lexical=w) scores
    hybrid = mine_hard_negatives(emb, pairs, corpus, lexical=0.5, relative_margin=None, num_negatives=3,
                                 progress=False)
    hits = emb.search([p["anchor"] for p in pairs], corpus, top_k=4, lexical=0.5)
    for k, pair in enumerate(pairs):
        expected = [corpus[j] for j, _ in hits[k] if corpus[j] != pair["positive"]][:3]
        assert [r["negative"] for r in hybrid if r["anchor"] == pair["anchor"]] == expected
    # the command writes rows that kbert finetune reads back (TSV here)
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs), encoding="utf-8")
    (tmp_path / "corpus.txt").write_text("\n".join(corpus) + "\n", encoding="utf-8")
    out = tmp_path / "mined.tsv"
    assert main(["mine-negatives", "--pairs", str(src), "--corpus", str(tmp_path / "corpus.txt"), "--lexical", "1",
                 "--relative-margin", "-1", "--out", str(out)]) == 0
    assert "2 (anchor, positive, negative) rows written" in capsys.readouterr().out
    assert [r["negative"] for r in read_rows(str(out), ["anchor", "positive", "negative"])] == \
        ["부산 날씨 어때", "강아지 사료 추천해줘"]
    assert main(["mine-negatives", "--pairs", str(src), "--out", str(out)]) == 1  # no model, not lexical
    assert "lexical=1" in capsys.readouterr().err
    from kbert.data.rows import write_rows

    with pytest.raises(ValueError, match="row 1, column 'anchor' holds a tab"):
        write_rows([{"anchor": "a\tb"}], str(tmp_path / "bad.tsv"))
    assert not (tmp_path / "bad.tsv").exists() and not (tmp_path / "bad.tsv.tmp").exists()
    write_rows([{"anchor": "a\tb"}], str(tmp_path / "ok.jsonl"))
    assert read_rows(str(tmp_path / "ok.jsonl"), ["anchor"]) == [{"anchor": "a\tb"}]


def test_mining_candidates_equal_a_full_sort_for_every_setting():
    """`ranked_candidates` sorts only the prefix of ranks a pair can take; its picks score as a full stable sort's do
    (ties included: scores rounded to two decimals), for ranks, margins and both samplings."""
    from kbert.embed.mining import ranked_candidates, score_bound

    rng = np.random.default_rng(3)
    for trial in range(300):
        n = int(rng.integers(1, 60))
        s = np.round(rng.uniform(-1, 1, n), 2)
        s[rng.random(n) < 0.2] = -np.inf  # the anchor's own texts
        pos = float(rng.uniform(-0.5, 1))
        range_min = int(rng.integers(0, 5))
        range_max = None if rng.random() < 0.5 else range_min + int(rng.integers(1, 40))
        margin = None if rng.random() < 0.5 else float(rng.uniform(0, 0.3))
        relative = None if rng.random() < 0.3 else 0.05
        bound = score_bound(pos, margin, relative, None)
        ranked = np.argsort(-s, kind="stable")
        ranked = ranked[np.isfinite(s[ranked])]
        ranked = ranked[:len(ranked) if range_max is None else range_max][range_min:]
        expected = ranked[s[ranked] <= bound]
        for wanted in (1, 3):
            got = ranked_candidates(s, bound, range_min, range_max, wanted)
            np.testing.assert_array_equal(s[got], s[expected[:wanted]], err_msg=f"trial {trial}")
        got = ranked_candidates(s, bound, range_min, range_max, None)  # random sampling draws from all of them
        np.testing.assert_array_equal(np.sort(s[got]), np.sort(s[expected]), err_msg=f"trial {trial}")


ODD_TEXTS = ["ＡＢＣ　①②… 한국어ﾊﾝｸﾞﾙ  여러   칸", "😀 이모지와 漢字", " 앞뒤 공백 ", "", "Hello, WORLD 123"]


def test_an_xlm_roberta_tokenizer_gives_the_checkpoints_ids_from_its_model_or_its_tokenizer_json(tmp_path):
    """XLM-RoBERTa's SentencePiece model numbered as fairseq's dictionary (<s> 0, <pad> 1, </s> 2, <unk> 3, the
    pieces one place later, <mask> last): kbert's ids equal transformers' on Korean and odd text, from the
    `.model` and from a tokenizer.json alone, in Python and in the graph."""
    import shutil

    import tensorflow as tf
    import transformers

    from helpers import KOREAN_SENTENCES

    out = xlmr_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(out)
    json_only = str(tmp_path / "json-only")
    hf.save_pretrained(json_only)
    for name in os.listdir(json_only):
        if name != "tokenizer.json":
            os.remove(os.path.join(json_only, name))
    lines = [line.strip() for doc in corpus(["kobill"]) for line in doc if line.strip()][:300]
    texts = KOREAN_SENTENCES + lines + ODD_TEXTS
    for where in (out, json_only):
        tok = kbert.Tokenizer.load(where)
        assert tok.vocab_size == len(hf) == 802
        assert tok.special_ids == {"pad": 1, "unk": 3, "cls": 0, "sep": 2, "mask": 801}
        for text in texts:
            assert tok.encode(text).ids == hf(text)["input_ids"], (where, text)
        assert tok.tf_tokenize(tf.constant(texts)).to_list() == [hf(t)["input_ids"] for t in texts]
        assert tok.tf_tokenize(tf.constant(texts), portable=True).to_list() == [hf(t)["input_ids"] for t in texts]
    # out again as XLM-RoBERTa's files (a model fine-tuned from one exports so): transformers reads them as it
    # read the originals, and so does kbert
    exported = tok.export_transformers(str(tmp_path / "exported"))
    again = transformers.AutoTokenizer.from_pretrained(exported)
    assert [again(t)["input_ids"] for t in texts] == [hf(t)["input_ids"] for t in texts]
    assert [kbert.Tokenizer.load(exported).encode(t).ids for t in texts] == [hf(t)["input_ids"] for t in texts]
    # the same model without the fairseq marker is SentencePiece's own numbering (an ALBERT-style dir)
    plain = str(tmp_path / "plain")
    os.makedirs(plain)
    shutil.copy(os.path.join(out, "sentencepiece.bpe.model"), plain)
    own = kbert.Tokenizer.load(plain, special_tokens={"pad": "<unk>", "mask": "<unk>"})  # it has neither
    assert own.encode("대한민국").ids[0] == 1  # <s> is SentencePiece's id 1


def test_hugging_face_sentencepiece_files_kbert_cannot_reproduce_are_refused_by_name(tmp_path):
    import transformers

    from kbert.text.hf_sentencepiece import fairseq_layout, unigram_from_json

    out = xlmr_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(out)
    hf.save_pretrained(str(tmp_path / "saved"))
    path = os.path.join(str(tmp_path / "saved"), "tokenizer.json")
    spec = json.load(open(path, encoding="utf-8"))
    for change, message in ((lambda s: s["model"].update(byte_fallback=True), "byte fallback"),
                            (lambda s: s.update(normalizer={"type": "Lowercase"}), "'Lowercase'"),
                            (lambda s: s.update(pre_tokenizer={"type": "ByteLevel"}), "pre-tokenizer")):
        broken = json.loads(json.dumps(spec))
        change(broken)
        json.dump(broken, open(path, "w", encoding="utf-8"))
        with pytest.raises(ValueError, match=message):
            unigram_from_json(path)
    tok = kbert.Tokenizer.train(corpus(["kolaw"]), vocab_size=800, progress=False)  # [PAD] [UNK] ... first
    with pytest.raises(ValueError, match="does not start <unk> <s> </s>"):
        fairseq_layout(open(os.path.join(tok.save(str(tmp_path / "kb")), "spm.model"), "rb").read())


def test_an_xlm_roberta_sentence_model_loads_with_its_vectors(tmp_path):
    """An XLM-RoBERTa sentence-transformers dir (the layout of BGE-M3 / KURE / multilingual E5): kbert's vectors
    equal SentenceTransformer's, long texts truncated alike, and the encoder equals transformers'."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    from helpers import KOREAN_SENTENCES

    out = xlmr_dir(tmp_path)
    prompts = {"query": "query: ", "passage": "passage: "}  # E5's
    st = SentenceTransformer(modules=[Transformer(out, max_seq_length=48), Pooling(32, pooling_mode="mean"),
                                      Normalize()], device="cpu", prompts=prompts)
    st_dir = str(tmp_path / "st")
    st.save(st_dir)
    emb = kbert.Embedder.load(st_dir)
    assert emb.pooling == "mean" and emb.max_length == 48
    assert emb.prompts == st.prompts and emb.default_prompt_name is None  # sentence-transformers 6 adds "document"
    texts = KOREAN_SENTENCES[:4] + ["대한민국 헌법 " * 30] + ODD_TEXTS[:2]
    np.testing.assert_allclose(emb.encode(texts), st.encode(texts), atol=2e-5)
    # prompts as sentence-transformers applies them: before the text, counted in its length, pooled with it
    np.testing.assert_allclose(emb.encode_query(texts), st.encode_query(texts), atol=2e-5)
    np.testing.assert_allclose(emb.encode_document(texts), st.encode_document(texts), atol=2e-5)
    np.testing.assert_allclose(emb.encode(texts, prompt="질문: "), st.encode(texts, prompt="질문: "), atol=2e-5)
    assert not np.allclose(emb.encode_query(texts), emb.encode(texts), atol=1e-3)
    st.default_prompt_name = "query"
    st.save(st_dir)
    emb = kbert.Embedder.load(st_dir)
    assert emb.default_prompt_name == "query"
    np.testing.assert_allclose(emb.encode(texts), st.encode(texts), atol=2e-5)
    ref = transformers.XLMRobertaModel.from_pretrained(out).eval()
    hf = transformers.AutoTokenizer.from_pretrained(out)
    batch = hf(KOREAN_SENTENCES[:3], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = ref(**batch).last_hidden_state.numpy()
    # a SavedModel (its tokenizer in the graph) gives the same vectors: the default (query) prompt, or another
    import tensorflow as tf

    for name, st_vectors in ((None, st.encode(texts)), ("passage", st.encode_document(texts, prompt_name="passage"))):
        saved = kbert.export(st_dir, str(tmp_path / f"saved-{name}"), prompt_name=name)
        served = tf.saved_model.load(saved).signatures["serving_default"](texts=tf.constant(texts))["embeddings"]
        np.testing.assert_allclose(served.numpy(), st_vectors, atol=2e-5)
    # fine-tuned by kbert, it goes out as a sentence-transformers dir with XLM-RoBERTa's tokenizer files
    rows = [{"sentence1": a, "sentence2": b, "score": v} for a, b, v in (
        ("대한민국은 민주공화국이다.", "대한민국은 공화국이다.", 4.5), ("국민은 법 앞에 평등하다.", "날씨가 맑다.", 0.5))]
    tuned = str(tmp_path / "tuned")
    kbert.finetune(st_dir, "sentence-embedding", rows * 4, rows, out_dir=tuned, text_column="sentence1",
                   pair_column="sentence2", label_column="score", max_steps=2, batch_size=4, progress=False)
    exported = kbert.export_sentence_transformers(tuned, str(tmp_path / "tuned-st"))
    np.testing.assert_allclose(SentenceTransformer(exported, device="cpu").encode(texts),
                               kbert.Embedder.load(tuned).encode(texts), atol=2e-5)
    model = kbert.load_model(out)
    got = model({"token_ids": batch["input_ids"].numpy(), "segment_ids": np.zeros_like(batch["input_ids"].numpy()),
                 "padding_mask": batch["attention_mask"].numpy().astype(bool)})["sequence_output"]
    mask = batch["attention_mask"].numpy().astype(bool)
    np.testing.assert_allclose(np.asarray(got)[mask], expected[mask], atol=2e-5)


def test_truncated_vectors_are_the_first_dimensions_renormalized(emb):
    """`truncate_dim` (sentence-transformers' name; OpenAI's `dimensions` over HTTP): a Matryoshka model's short
    vectors, cut before normalization; searches take it too; widths outside 1..hidden are refused."""
    full = emb.encode(TEXTS, normalize=False)
    short = emb.encode(TEXTS, truncate_dim=8)
    assert short.shape == (len(TEXTS), 8)
    np.testing.assert_allclose(short, full[:, :8] / np.linalg.norm(full[:, :8], axis=1, keepdims=True), atol=1e-6)
    np.testing.assert_allclose(emb.encode(TEXTS, truncate_dim=8, normalize=False), full[:, :8], atol=1e-6)
    hits = emb.search(TEXTS[:2], TEXTS, top_k=3, truncate_dim=8)
    assert [j for j, _ in hits[0]] == list(np.argsort(-(short[:1] @ short.T)[0], kind="stable")[:3])
    for bad in (0, 33, 2.5, True):
        with pytest.raises(ValueError, match="`truncate_dim` must be an integer in \\[1, 32\\]"):
            emb.encode(TEXTS, truncate_dim=bad)


def test_prompts_go_to_search_mining_export_and_are_checked_by_name(emb, tmp_path):
    """An Embedder with E5-style prompts: `search` and `mine_hard_negatives` encode queries with the query
    prompt and the texts searched with the document one; an exported sentence-transformers dir keeps them;
    unknown names and conflicting arguments are refused by name."""
    from sentence_transformers import SentenceTransformer

    e = kbert.Embedder(emb.backbone, emb.tokenizer, prompts={"query": "질문: ", "passage": "문서: "})
    queries = ["대한민국의 주권은 누구에게 있는가", "국회의원의 임기"]
    corpus = ["대한민국의 주권은 국민에게 있고, 모든 권력은 국민으로부터 나온다.", "국회의원의 임기는 4년으로 한다.",
              "대통령의 임기는 5년으로 하며, 중임할 수 없다.", "모든 국민은 법 앞에 평등하다."]
    scores = e.encode_query(queries) @ e.encode_document(corpus).T
    assert not np.allclose(scores, e.encode(queries) @ e.encode(corpus).T, atol=1e-4)
    hits = e.search(queries, corpus, top_k=4)
    for row, found in zip(scores, hits):
        assert [j for j, _ in found] == list(np.argsort(-row, kind="stable"))
        np.testing.assert_allclose([v for _, v in found], np.sort(row)[::-1], atol=1e-5)
    hybrid = e.search(queries, corpus, top_k=4, lexical=0.5)
    from kbert.embed.lexical import lexical_scores
    expected = 0.5 * scores + 0.5 * lexical_scores(queries, corpus)
    np.testing.assert_allclose([[v for _, v in row] for row in hybrid], -np.sort(-expected, axis=1), atol=1e-5)
    # mining: the anchor as a query, the candidates as documents
    pairs = [{"anchor": q, "positive": corpus[i]} for q, i in zip(queries, (0, 1))]
    mined = kbert.mine_hard_negatives(e, pairs, corpus, relative_margin=None, progress=False)
    for pair, row in zip(mined, scores):
        allowed = [j for j in np.argsort(-row, kind="stable") if corpus[j] not in (pair["positive"],)]
        assert pair["negative"] == corpus[allowed[0]]
    out = kbert.export_sentence_transformers(e, str(tmp_path / "st"))
    st = SentenceTransformer(out, device="cpu")
    assert {k: st.prompts[k] for k in ("query", "passage")} == e.prompts
    np.testing.assert_allclose(st.encode_query(queries), e.encode_query(queries), atol=2e-5)
    np.testing.assert_allclose(st.encode_document(corpus), e.encode_document(corpus), atol=2e-5)
    np.testing.assert_allclose(kbert.Embedder.load(out).encode_document(corpus), e.encode_document(corpus), atol=1e-6)
    with pytest.raises(ValueError, match="'document' is not one of this model's prompts"):
        e.encode(queries, prompt_name="document")
    with pytest.raises(ValueError, match="not both"):
        e.encode(queries, prompt_name="query", prompt="q: ")
    with pytest.raises(ValueError, match="default_prompt_name 'q'"):
        kbert.Embedder(emb.backbone, emb.tokenizer, prompts={"query": "질문: "}, default_prompt_name="q")
    np.testing.assert_allclose(emb.encode_query(queries), emb.encode(queries), atol=1e-6)  # no prompts: plain


def _unit_rows(n, dim, seed=0):
    x = np.random.default_rng(seed).normal(size=(n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("dim", [32, 77])  # 77: the last byte of the packed bits is partly padding
def test_quantized_vectors_are_sentence_transformers_bytes(dim):
    from sentence_transformers.util.quantization import quantize_embeddings as st_quantize

    x, sample = _unit_rows(300, dim), _unit_rows(200, dim, seed=1)
    ranges = kbert.quantization_ranges(sample)
    np.testing.assert_array_equal(ranges, np.stack([sample.min(0), sample.max(0)]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for precision in ("float32", "int8", "uint8", "binary", "ubinary"):
            for options in ({"calibration_embeddings": sample}, {"ranges": ranges}, {}):
                ours = kbert.quantize_embeddings(x, precision, **options)
                theirs = st_quantize(x, precision, **options)
                assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (precision, options)
                np.testing.assert_array_equal(ours, theirs)
    assert kbert.quantize_embeddings(x, "ubinary").shape == (300, (dim + 7) // 8)
    assert kbert.quantize_embeddings(x[0], "binary").shape == ((dim + 7) // 8,)  # one vector stays 1-D
    # what the codes stand for: int8 within one bucket of the value (inside the ranges), bits the signs
    from kbert.embed.quantize import dequantize_embeddings

    back = dequantize_embeddings(kbert.quantize_embeddings(sample, "int8", ranges=ranges), "int8", ranges)
    step = (ranges[1] - ranges[0]) / 255
    assert np.all(back <= sample + 1e-6) and np.all(sample - back <= step + 1e-6)
    bits = dequantize_embeddings(kbert.quantize_embeddings(x, "binary"), "binary", dim=dim)
    np.testing.assert_array_equal(bits, (x > 0).astype(np.float32))
    with pytest.raises(ValueError, match="float vectors"):
        kbert.quantize_embeddings(kbert.quantize_embeddings(x, "int8"), "int8")
    with pytest.raises(ValueError, match="two calibration vectors"):
        kbert.quantize_embeddings(x[0], "int8")
    with pytest.raises(ValueError, match=r"shape \(2, %d\)" % dim):
        kbert.quantize_embeddings(x, "uint8", ranges=ranges[:, :5])
    with pytest.raises(ValueError, match="precision"):
        kbert.quantize_embeddings(x, "int4")


def test_quantized_search_finds_what_sentence_transformers_and_a_full_sort_find(monkeypatch):
    from sentence_transformers.util.quantization import semantic_search_faiss

    from kbert.embed import quantize

    corpus, rng = _unit_rows(700, 64), np.random.default_rng(2)
    queries = corpus[:9] + 0.3 * rng.normal(size=(9, 64)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    bits = kbert.quantize_embeddings(corpus, "ubinary")
    hits = kbert.quantized_search(queries, bits, top_k=5, rescore_multiplier=4)
    theirs, _ = semantic_search_faiss(queries, corpus_embeddings=bits, corpus_precision="ubinary", top_k=5,
                                      rescore_multiplier=4, exact=True)
    assert [[j for j, _ in h] for h in hits] == [[r["corpus_id"] for r in t] for t in theirs]
    np.testing.assert_allclose([[s for _, s in h] for h in hits], [[r["score"] for r in t] for t in theirs],
                               rtol=1e-5)
    # FAISS's binary index, the signed codes and small search blocks all give the same hits
    assert kbert.quantized_search(queries, bits, top_k=5, index="faiss") == hits
    assert kbert.quantized_search(queries, kbert.quantize_embeddings(corpus, "binary"), top_k=5) == hits
    monkeypatch.setattr(quantize, "SEARCH_CHUNK", 64)
    monkeypatch.setattr(quantize, "QUERY_CHUNK", 4)
    assert kbert.quantized_search(queries, bits, top_k=5) == hits
    monkeypatch.delattr(np, "bitwise_count", raising=False)  # numpy 1: bits counted a byte at a time
    assert kbert.quantized_search(queries, bits, top_k=5) == hits
    monkeypatch.undo()
    # ties (each vector three times) come back lower row first, across search blocks too, as a stable sort
    tripled = np.repeat(corpus[:40], 3, axis=0)
    scores = queries @ tripled.T
    for h, row in zip(kbert.quantized_search(queries, tripled, top_k=7), scores):
        assert [j for j, _ in h] == list(np.argsort(-row, kind="stable")[:7])
    # no rescoring: the share of bits that agree, by a hand count
    plain = kbert.quantized_search(queries, bits, top_k=3, rescore_multiplier=0)
    agree = ((queries > 0)[:, None, :] == (corpus > 0)[None, :, :]).mean(axis=-1)
    for h, row in zip(plain, agree):
        assert [j for j, _ in h] == list(np.argsort(-row, kind="stable")[:3])
        np.testing.assert_allclose([s for _, s in h], np.sort(row)[::-1][:3], rtol=1e-6)
    # int8: the query against each code's bucket value, as a full sort of those scores
    ranges = kbert.quantization_ranges(corpus)
    codes = kbert.quantize_embeddings(corpus, "int8", ranges=ranges)
    values = (codes.astype(np.float64) + 128) * ((ranges[1] - ranges[0]) / 255) + ranges[0]
    scores = queries @ values.T
    for h, row in zip(kbert.quantized_search(queries, codes, top_k=4, ranges=ranges), scores):
        assert [j for j, _ in h] == list(np.argsort(-row, kind="stable")[:4])
        np.testing.assert_allclose([s for _, s in h], np.sort(row)[::-1][:4], rtol=1e-5)
    assert kbert.quantized_search(queries, codes, top_k=4, ranges=ranges)[0][0][0] == 0  # finds its source
    with pytest.raises(ValueError, match="ranges"):
        kbert.quantized_search(queries, codes, top_k=4)
    with pytest.raises(ValueError, match="is not uint8"):
        kbert.quantized_search(queries, codes, top_k=4, precision="uint8", ranges=ranges)
    with pytest.raises(ValueError, match="columns"):
        kbert.quantized_search(queries, codes[:, :10], top_k=4)
    # float vectors of another width, a top_k below 1: errors that say so; no corpus: no hits for each query
    with pytest.raises(ValueError, match="queries are 64-wide vectors and the corpus' 32-wide"):
        kbert.quantized_search(queries, corpus[:, :32], top_k=4)
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="`top_k` must be a positive integer"):
            kbert.quantized_search(queries, codes, top_k=bad, ranges=ranges)
    assert kbert.quantized_search(queries, bits[:0], top_k=4) == [[] for _ in queries]


def _same_hits(a, b, atol=1e-5):
    """The same corpus rows in the same order, and scores equal to float32 rounding (texts encoded in other
    batches differ in the last bits)."""
    assert [[j for j, _ in h] for h in a] == [[j for j, _ in h] for h in b]
    np.testing.assert_allclose([[s for _, s in h] for h in a], [[s for _, s in h] for h in b], atol=atol)


def test_encode_and_search_take_quantized_vectors(emb, tmp_path, capsys):
    from kbert.cli import main

    texts = [t for t in TEXTS if t.strip()]
    vectors = emb.encode(texts)
    ranges = kbert.quantization_ranges(vectors)
    for precision in ("int8", "uint8", "binary", "ubinary"):
        codes = emb.encode(texts, precision=precision, ranges=ranges)
        np.testing.assert_array_equal(codes, kbert.quantize_embeddings(vectors, precision, ranges=ranges))
        options = {"ranges": ranges} if precision in ("int8", "uint8") else {}
        from_codes = emb.search(texts[:2], codes, top_k=3, **options)
        _same_hits(from_codes, kbert.quantized_search(emb.encode(texts[:2]), codes, top_k=3, **options))
        # texts quantized on the way in: the same hits as their float vectors quantized on the way in (int8
        # over the corpus' own ranges; near-ties of this random model flip with a bucket, so not from_codes)
        _same_hits(emb.search(texts[:2], texts, top_k=3, corpus_precision=precision),
                   emb.search(texts[:2], vectors, top_k=3, corpus_precision=precision))
        assert [h[0][0] for h in from_codes] == [0, 1]  # each text still finds itself first
    with pytest.raises(ValueError, match="lexical"):
        emb.search(texts[:2], texts, corpus_precision="binary", lexical=0.5)
    with pytest.raises(ValueError, match="precision"):
        emb.encode(texts, precision="fp8")
    # the command: bits per line, or int8 with the ranges of every vector written beside them
    model_dir = str(tmp_path / "m")
    kbert.save_model(emb.backbone, model_dir, tokenizer=emb.tokenizer)
    src = tmp_path / "in.txt"
    src.write_text("\n".join(texts) + "\n", encoding="utf-8")
    assert main(["embed", "--model", model_dir, "--input", str(src), "--precision", "ubinary"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["vector"] for r in rows] == kbert.quantize_embeddings(vectors, "ubinary").tolist()
    out = str(tmp_path / "v.npy")
    assert main(["embed", "--model", model_dir, "--input", str(src), "--precision", "int8", "--format", "npy",
                 "--out", out, "--chunk", "2"]) == 0  # chunks of 2 lines, one set of ranges for all
    np.testing.assert_allclose(np.load(str(tmp_path / "v.ranges.npy")), ranges, atol=1e-6)
    codes = kbert.quantize_embeddings(vectors, "int8", ranges=ranges).astype(np.int16)
    assert np.load(out).dtype == np.int8 and np.abs(np.load(out) - codes).max() <= 1  # float rounding at edges
    assert main(["embed", "--model", model_dir, "--input", str(src), "--precision", "int8", "--ranges",
                 str(tmp_path / "v.ranges.npy")]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert np.abs(np.array([r["vector"] for r in rows]) - np.load(out)).max() <= 1  # float rounding at edges
    assert main(["embed", "--model", model_dir, "--input", str(src), "--precision", "int8"]) == 1
    assert "needs the same --ranges" in capsys.readouterr().err


def _clustered_vectors(seed=0, groups=20, width=32):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(groups, width))
    v = np.concatenate([c + 0.35 * rng.normal(size=(rng.integers(1, 40), width)) for c in centres])
    return v[rng.permutation(len(v))].astype(np.float32)


def test_paraphrase_mining_and_community_detection_equal_sentence_transformers_on_the_same_vectors():
    import torch
    from sentence_transformers.util import community_detection, paraphrase_mining_embeddings

    v = _clustered_vectors()  # 435 vectors around 20 centres
    for top_k, max_pairs in [(5, 100), (100, 500_000), (3, 50)]:
        ours = kbert.paraphrase_mining(None, v, top_k=top_k, max_pairs=max_pairs, progress=False)
        theirs = paraphrase_mining_embeddings(torch.tensor(v), top_k=top_k, max_pairs=max_pairs)
        assert len(ours) == len(theirs) == min(max_pairs, len(theirs))
        # the same pairs with the same scores (float32 products in another order: 1e-6); best first
        scored = {(i, j): score for score, i, j in theirs}
        assert {(i, j) for _, i, j in ours} == set(scored)
        assert all(abs(score - scored[i, j]) < 1e-6 and i < j for score, i, j in ours)
        assert all(a[0] >= b[0] for a, b in zip(ours, ours[1:]))
        # chunks of any size give the same answer: the same pairs with the same scores, best first; the
        # products' last bit may differ with the chunk's shape (and the CPU's kernels), so two pairs scored
        # alike to 1e-6 may come in either order, and only those
        chunked = kbert.paraphrase_mining(None, v, top_k=top_k, max_pairs=max_pairs, chunk=37, progress=False)
        assert len(chunked) == len(ours) and {p[1:] for p in chunked} == {p[1:] for p in ours}
        assert all(a[0] >= b[0] for a, b in zip(chunked, chunked[1:]))
        assert all(a[1:] == b[1:] or abs(a[0] - b[0]) <= 1e-6 for a, b in zip(chunked, ours))
        assert np.allclose([p[0] for p in chunked], [p[0] for p in ours], atol=1e-6)
    every = kbert.paraphrase_mining(None, v, top_k=100, progress=False)
    above = kbert.paraphrase_mining(None, v, top_k=100, threshold=0.8, progress=False)
    assert above == [p for p in every if p[0] >= 0.8] and 0 < len(above) < len(every)
    def centres_and_members(groups):  # members scored alike to the last bit may come in either order
        return [(int(g[0]), {int(i) for i in g}) for g in groups]

    for threshold, min_size in [(0.75, 10), (0.8, 2), (0.6, 5)]:
        ours = kbert.community_detection(None, v, threshold=threshold, min_size=min_size, progress=False)
        theirs = community_detection(torch.tensor(v), threshold=threshold, min_community_size=min_size)
        assert centres_and_members(ours) == centres_and_members(theirs)
        scores = v[ours[0][0]] @ v[ours[0]].T / np.linalg.norm(v[ours[0]], axis=1) / np.linalg.norm(v[ours[0][0]])
        assert np.all(np.diff(scores[1:]) <= 1e-6) and np.all(scores >= threshold - 1e-6)  # best first
        assert centres_and_members(kbert.community_detection(None, v, threshold=threshold, min_size=min_size,
                                                             chunk=29, progress=False)) == centres_and_members(ours)
    groups = kbert.community_detection(None, v, threshold=0.6, min_size=5, progress=False)
    members = [i for g in groups for i in g]
    assert len(members) == len(set(members))  # no item in two groups
    assert kbert.community_detection(None, v[:3], min_size=4, progress=False) == []
    assert kbert.paraphrase_mining(None, v[:1], progress=False) == []


def test_paraphrase_mining_and_groups_of_texts_by_a_model_or_by_characters(emb, tmp_path, capsys):
    from kbert.cli import main

    texts = ["배송이 너무 느려요", "택배가 안 와요", "배송이 너무 느려요!!", "화면이 밝고 선명해요", "배송이 너무 느려요"]
    pairs = kbert.paraphrase_mining(emb, texts, progress=False)
    assert pairs[0][1:] == (0, 4) and pairs[0][0] == pytest.approx(1.0, abs=1e-5)  # the exact repeat first
    assert len(pairs) == 10  # every pair of 5 once
    vectors = emb.encode(texts)
    assert [p[1:] for p in kbert.paraphrase_mining(None, vectors, progress=False)] == [p[1:] for p in pairs]
    # characters alone need no model; the hybrid score is the search's
    lexical = kbert.paraphrase_mining(None, texts, lexical=1.0, progress=False)
    assert [p[1:] for p in lexical[:3]] == [(0, 4), (0, 2), (2, 4)]
    hybrid = {(i, j): s for s, i, j in kbert.paraphrase_mining(emb, texts, lexical=0.4, progress=False)}
    hits = emb.search(texts, texts, top_k=5, lexical=0.4)
    assert hybrid[1, 3] == pytest.approx(dict(hits[1])[3], abs=1e-5)
    groups = kbert.community_detection(None, texts, threshold=0.5, min_size=2, lexical=1.0, progress=False)
    assert groups == [[0, 4, 2]] or groups == [[0, 2, 4]]
    for bad, match in [(dict(top_k=0), "`top_k`"), (dict(max_pairs=0), "`max_pairs`"), (dict(lexical=2), "`lexical`"),
                       (dict(threshold="high"), "`threshold`"), (dict(chunk=0), "`chunk`"),
                       (dict(threshold=float("nan")), "`threshold`")]:  # NaN: no pair, and no word why
        with pytest.raises(ValueError, match=match):
            kbert.paraphrase_mining(emb, texts, progress=False, **bad)
    with pytest.raises(ValueError, match="`threshold` must be a number"):
        kbert.community_detection(emb, texts, threshold=float("nan"), progress=False)
    with pytest.raises(ValueError, match="lexical=1"):
        kbert.paraphrase_mining(None, texts, progress=False)
    with pytest.raises(ValueError, match="not vectors"):
        kbert.community_detection(None, vectors, lexical=0.5, progress=False)
    with pytest.raises(ValueError, match="`min_size`"):
        kbert.community_detection(emb, texts, min_size=0, progress=False)

    # the commands: lines of a file (blank ones skipped, named by their line number), JSON lines out
    src = tmp_path / "reviews.txt"
    src.write_text("\n".join(texts[:2]) + "\n\n" + "\n".join(texts[2:]) + "\n", encoding="utf-8")
    out = tmp_path / "groups.jsonl"
    assert main(["cluster", "--input", str(src), "--lexical", "1", "--threshold", "0.5", "--min-size", "2",
                 "--out", str(out)]) == 0
    assert "1 groups holding 3 of 5 lines" in capsys.readouterr().err
    (group,) = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert group["size"] == 3 and sorted(group["lines"]) == [1, 4, 6] and group["texts"][0] == texts[0]
    model_dir = str(tmp_path / "model")
    kbert.save_model(emb.backbone, model_dir, tokenizer=emb.tokenizer)
    assert main(["paraphrases", "--model", model_dir, "--input", str(src), "--top-k", "2"]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert {rows[0]["line1"], rows[0]["line2"]} == {1, 6} and rows[0]["text1"] == rows[0]["text2"]
    assert [r["score"] for r in rows] == sorted((r["score"] for r in rows), reverse=True)
    assert "pairs of 5 lines" in captured.err
    assert main(["cluster", "--input", str(src)]) == 1  # no model, not lexical
    assert "lexical=1" in capsys.readouterr().err


def test_distill_static_equals_model2vec_recipe_on_the_same_model(emb, tmp_path):
    """`kbert.distill_static` builds Model2Vec's table: each token's `[CLS] t [SEP]` vector through the model (here
    against the model2vec package's own `create_embeddings` on the transformers export of the same weights, CPU
    torch), then its PCA and Zipf/SIF weights."""
    import transformers
    from model2vec.distill.inference import apply_pca, compute_weights, create_embeddings

    hf = str(tmp_path / "hf")
    kbert.export_transformers(emb.backbone, hf)
    tok = emb.tokenizer
    ids = [[tok.cls_id, i, tok.sep_id] for i in range(tok.vocab_size)]
    reference = create_embeddings(transformers.AutoModel.from_pretrained(hf), ids, device="cpu",
                                  pad_token_id=tok.pad_id, pooling="mean").astype(np.float64)
    np.testing.assert_allclose(emb.token_vectors(), reference, atol=1e-5)
    for dim, sif in ((16, 1e-4), (64, 1e-3), (None, None)):  # cut, rotated only (64 > 32 wide), as it is
        static = kbert.distill_static(emb, dim=dim, sif_coefficient=sif)
        expected = apply_pca(reference, dim) * compute_weights(len(reference), sif)[:, None]
        assert isinstance(static, kbert.StaticEmbedder) and static.dimension == expected.shape[1]
        np.testing.assert_allclose(static.vectors, expected, atol=1e-5)
    with pytest.raises(ValueError, match="`dim` must be a positive integer"):
        kbert.distill_static(emb, dim=0)
    with pytest.raises(ValueError, match="`sif_coefficient` must be in \\(0, 1\\)"):
        kbert.distill_static(emb, sif_coefficient=1.5)
    with pytest.raises(ValueError, match="already a static model"):
        kbert.distill_static(static)


@pytest.mark.parametrize("algorithm", ["unigram", "wordpiece"])
def test_static_model_encodes_as_model2vec_and_sentence_transformers_do(algorithm, tmp_path):
    """A distilled static model written by `export_sentence_transformers` loads in model2vec and in
    sentence-transformers (and back in kbert as a StaticEmbedder) with the same vectors on Korean text: its
    tokenizer.json gives kbert's ids; unknown tokens are left out, an empty text is the zero vector, and
    `max_length` keeps a text's first tokens."""
    from model2vec import StaticModel
    from sentence_transformers import SentenceTransformer

    tok = kbert.Tokenizer.train(corpus(["kolaw"]), vocab_size=800, algorithm=algorithm, progress=False)
    cfg = kbert.ModelConfig.preset("bert-tiny", vocab_size=tok.vocab_size, hidden_size=32, num_heads=2,
                                   intermediate_size=64, max_position=64)
    keras.utils.set_random_seed(0)
    static = kbert.distill_static(kbert.Embedder(kbert.BertBackbone(cfg, output_hidden_states=True), tok), dim=24)
    lines = [line.strip() for line in corpus(["kobill"]).texts() if line.strip()][:300]
    assert [tok.fast_tokenizer().encode(t, add_special_tokens=False).ids for t in lines] == tok.ids_batch(lines)
    texts = lines + ["", "   ", "🙂", "ㅋㅋㅋ 정말 좋아요!!"]
    ours = static.encode(texts)
    assert ours.shape == (len(texts), 24) and np.isfinite(ours).all()
    assert np.allclose(ours[-4], 0) and np.allclose(ours[-3], 0)  # no token: the zero vector
    ids = tok.ids_batch(texts[:5])
    rows = [[i for i in x if i != tok.unk_id] for x in ids]
    by_hand = np.stack([static.vectors[r].mean(axis=0) for r in rows])
    np.testing.assert_allclose(ours[:5], by_hand / np.linalg.norm(by_hand, axis=1, keepdims=True), atol=1e-6)
    out = str(tmp_path / "static")
    kbert.export_sentence_transformers(static, out)
    back = kbert.Embedder.load(out)
    assert isinstance(back, kbert.StaticEmbedder)
    np.testing.assert_allclose(back.encode(texts), ours, atol=1e-6)
    np.testing.assert_allclose(StaticModel.from_pretrained(out).encode(texts), ours, atol=1e-5)
    # sentence-transformers averages the unknown token's row too (model2vec and kbert leave it out)
    known = [i for i, x in enumerate(tok.ids_batch(texts)) if tok.unk_id not in x and x]
    assert len(known) > 100
    np.testing.assert_allclose(SentenceTransformer(out, device="cpu").encode([texts[i] for i in known]), ours[known],
                               atol=1e-5)
    half = str(tmp_path / "half")
    kbert.export_sentence_transformers(static, half, dtype="float16")
    np.testing.assert_allclose(kbert.Embedder.load(half).encode(texts[:50]), ours[:50], atol=5e-3)
    long = " ".join(lines)
    with pytest.warns(UserWarning, match="1 of 1 texts are longer than 5 tokens"):
        first = static.encode(long, max_length=5)
    head = static.vectors[[i for i in tok.ids_batch([long])[0][:5] if i != tok.unk_id]].mean(axis=0)
    np.testing.assert_allclose(first, head / np.linalg.norm(head), atol=1e-6)
    # long_texts="mean": windows weighted by their tokens average to every token's mean (a table has no context)
    every = static.encode(long, max_length=10 ** 6)
    np.testing.assert_allclose(static.encode(long, max_length=5, long_texts="mean"), every, atol=1e-6)


def test_static_model_searches_whitens_serves_and_refuses_what_it_cannot_do(emb, tmp_path):
    """The rest of Embedder's surface on a static model: search, prompts, Matryoshka-style truncation and
    whitening (folded into the table when written); pooling choices, word vectors, fine-tuning and a SavedModel
    are refused by name. (Serving: test_serve.)"""
    static = kbert.distill_static(emb, dim=16)
    corpus_texts = TEXTS[:2] + ["국회의원은 법률안을 제출할 수 있다."]
    hits, = static.search(["민주공화국"], corpus_texts, top_k=2)
    assert len(hits) == 2 and hits[0][0] == 0 and hits[0][1] >= hits[1][1]  # the text holding the word, first
    assert static.encode(TEXTS, truncate_dim=8).shape == (len(TEXTS), 8)
    np.testing.assert_allclose(static.encode("법률", prompt="질문: "), static.encode("질문: 법률"), atol=1e-6)
    lines = [line.strip() for line in corpus(["kolaw", "kobill"]).texts() if len(line.strip()) > 5][:300]
    white = kbert.distill_static(emb, dim=16).fit_whitening(lines, dim=8)
    raw = white.encode(lines, normalize=False).astype(np.float64)
    np.testing.assert_allclose(np.cov(raw, rowvar=False), np.eye(8), atol=2e-3)
    out = str(tmp_path / "white")
    kbert.export_sentence_transformers(white, out)
    np.testing.assert_allclose(kbert.Embedder.load(out).encode(lines[:20]), white.encode(lines[:20]), atol=1e-5)
    with pytest.raises(ValueError, match="pooling 'mean' only"):
        static.encode("x", pooling="cls")
    with pytest.raises(ValueError, match="no word vectors in context"):
        static.encode_words("학교에서 공부했다")
    with pytest.raises(ValueError, match="has no transformer to fine-tune"):
        kbert.finetune(out, "sentence-embedding", [{"text": "법률"}] * 4, objective="simcse", out_dir=str(tmp_path / "f"))
    with pytest.raises(ValueError, match="no network to export as a SavedModel"):
        kbert.export(out, str(tmp_path / "saved"))


def test_distill_static_command(emb, tmp_path, capsys):
    from kbert.cli import main

    model_dir = str(tmp_path / "m")
    kbert.save_model(emb.backbone, model_dir, tokenizer=emb.tokenizer)
    out = str(tmp_path / "static")
    assert main(["distill-static", "--model", model_dir, "--out", out, "--dim", "12", "--dtype", "float16"]) == 0
    assert "written to" in capsys.readouterr().out
    np.testing.assert_allclose(kbert.Embedder.load(out).encode(TEXTS[:2]),
                               kbert.distill_static(model_dir, dim=12).encode(TEXTS[:2]), atol=5e-3)


def test_static_models_load_encode_search_and_serve_with_no_keras_backend_installed(emb, tmp_path):
    """What a static model is for: a host with numpy and kbert's base packages, no TensorFlow, JAX or torch (so
    Keras cannot import), as Model2Vec runs. `Embedder.load`, encode, search, `kbert embed`, `kbert evaluate`
    and `kbert serve`'s engine work there and give the vectors they give with a backend. Before, every one of
    them failed at `import keras` (the loaders that find a model dir imported the backbone)."""
    static_dir = str(tmp_path / "static")
    kbert.export_sentence_transformers(kbert.distill_static(emb, dim=16), static_dir)
    lines, pairs = str(tmp_path / "texts.txt"), str(tmp_path / "pairs.tsv")
    with open(lines, "w", encoding="utf-8") as f:
        f.write(TEXTS[0] + "\n")
    with open(pairs, "w", encoding="utf-8") as f:
        f.write("sentence1\tsentence2\tscore\n" + "".join(f"{a}\t{b}\t{s}\n" for a, b, s in (
            (TEXTS[0], TEXTS[1], 1.0), (TEXTS[0], TEXTS[0], 5.0), (TEXTS[1], TEXTS[2], 2.0))))
    script = NO_BACKEND_PRELUDE + (
        f"static = kbert.Embedder.load({static_dir!r})\n"
        f"vectors = static.encode({TEXTS!r}).tolist()\n"
        f"hits = static.search([{TEXTS[1]!r}], {TEXTS!r}, top_k=1)[0]\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        f"    status = [main(['embed', '--model', {static_dir!r}, '--input', {lines!r}]),\n"
        f"              main(['evaluate', '--model', {static_dir!r}, '--data', {pairs!r}])]\n"
        "printed = out.getvalue().splitlines()\n"
        f"engine = Engine({static_dir!r})\n"
        "engine.warm_up()\n"
        "print(json.dumps({'type': type(static).__name__, 'vectors': vectors, 'hit': hits[0][0], 'status': status,\n"
        "                  'cli': json.loads(printed[0])['vector'], 'evaluated': 'spearman' in out.getvalue(),\n"
        "                  'routes': engine.routes(), 'keras': 'keras' in sys.modules}))\n")
    out, _ = run_on_jax(script)
    assert out["type"] == "StaticEmbedder" and out["keras"] is False and out["status"] == [0, 0]
    want = kbert.Embedder.load(static_dir).encode(TEXTS)
    np.testing.assert_allclose(out["vectors"], want, atol=1e-6)
    np.testing.assert_allclose(out["cli"], want[0], atol=1e-5)
    assert out["hit"] == 1 and out["evaluated"] and "/v1/embeddings" in out["routes"]


def test_long_texts_mean_averages_window_vectors_as_transformers_computes_them(emb, tmp_path):
    """`encode(long_texts="mean")`: a text over max_length is read in consecutive windows ([CLS] + the prompt's
    tokens + the next stretch + [SEP]) whose mean-pooled vectors are averaged, weighted by the text tokens each
    holds; checked window by window with transformers' BertModel on the exported weights (CPU torch)."""
    import torch
    import transformers

    hf = str(tmp_path / "hf")
    kbert.export_transformers(emb.backbone, hf)
    model = transformers.BertModel.from_pretrained(hf, add_pooling_layer=False).eval()
    tok = emb.tokenizer
    long_text = " ".join(line.strip() for line in corpus(["kolaw"]).texts() if line.strip())[:600]
    texts = ["짧은 문장", long_text, "국회는 법률을 제정한다."]
    ids = tok.ids_batch([long_text])[0]
    limit = 32
    assert len(ids) > 3 * (limit - 2)  # several windows, the last one short

    def reference(ids, head=()):
        room = limit - 2 - len(head)
        vectors, weights = [], []
        for start in range(0, len(ids), room):
            piece = [tok.cls_id, *head, *ids[start:start + room], tok.sep_id]
            with torch.no_grad():
                hidden = model(input_ids=torch.tensor([piece])).last_hidden_state[0].numpy()
            vectors.append(hidden.mean(axis=0))
            weights.append(len(ids[start:start + room]))
        v = np.average(vectors, axis=0, weights=weights)
        return v / np.linalg.norm(v)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is cut, so no truncation warning
        got = emb.encode(texts, max_length=limit, long_texts="mean", batch_size=4)
    np.testing.assert_allclose(got[1], reference(ids), atol=1e-5)
    with pytest.warns(UserWarning, match="1 of 3 texts are longer than 32 tokens"):
        short = emb.encode(texts, max_length=limit)  # texts that fit: the same vectors either way
    np.testing.assert_allclose(got[[0, 2]], short[[0, 2]], atol=1e-6)
    assert not np.allclose(got[1], short[1], atol=1e-3)  # truncation read only the first window
    # a prompt starts every window
    prompt_ids = tok.ids_batch(["질문: "])[0]
    with_prompt = emb.encode(long_text, max_length=limit, long_texts="mean", prompt="질문: ")
    full = tok.ids_batch(["질문: " + long_text])[0]
    assert full[:len(prompt_ids)] == prompt_ids
    np.testing.assert_allclose(with_prompt, reference(full[len(prompt_ids):], prompt_ids), atol=1e-5)
    with pytest.raises(ValueError, match="`long_texts` must be one of"):
        emb.encode("x", long_texts="split")
    with pytest.raises(ValueError, match="no room for text"):
        emb.encode(long_text, max_length=4, long_texts="mean", prompt="아주 긴 질문 앞머리: ")
