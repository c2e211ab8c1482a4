"""kbert.SearchIndex: a FAISS index on disk, checked against Embedder.search (exact), resumable builds, adding,
ids and metadata, the model check, approximate kinds' recall, and the `kbert index` commands."""

import json
import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest

import kbert
from kbert.data.corpus import corpus
from kbert.data.sentences import split_sentences_rules
from kbert.embed.index import Hit, default_nlist

from helpers import tiny_embedding_model

LAW = list(dict.fromkeys(line for doc in corpus("kolaw") for line in doc if line.strip()))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_embedding_model(str(tmp_path_factory.mktemp("model")))


@pytest.fixture(scope="module")
def emb(model_dir):
    return kbert.Embedder.load(model_dir)


def quiet_build(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the constitution's long lines: the truncation warning
        return kbert.SearchIndex.build(*args, progress=False, **kwargs)


def hit_pairs(hits):
    return [[(h.id, h.score) for h in row] for row in hits]


def assert_same_hits(a, b):
    """The same ids in the same order, scores equal to float32 rounding (batches of other texts pad and sort
    differently)."""
    assert [[h.id for h in row] for row in a] == [[h.id for h in row] for row in b]
    np.testing.assert_allclose([[h.score for h in row] for row in a], [[h.score for h in row] for row in b], atol=1e-5)


def test_flat_index_gives_embedder_search_hits_and_survives_a_reload(model_dir, emb, tmp_path):
    index = quiet_build(model_dir, LAW, str(tmp_path / "ix"), chunk_size=100)
    assert len(index) == len(LAW) and index.info["kind"] == "flat" and index.info["model"] == os.path.abspath(model_dir)
    queries = ["국회의원의 임기", "대통령은 국가의 원수이다.", LAW[7], "법관의 자격"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = emb.search(queries, LAW, top_k=5)
        found = index.search(queries, top_k=5)
    for want, got in zip(exact, found):
        assert [j for j, _ in want] == [h.id for h in got]
        np.testing.assert_allclose([s for _, s in want], [h.score for h in got], atol=1e-5)
        assert [h.text for h in got] == [LAW[j] for j, _ in want] and all(h.metadata is None for h in got)
    assert found[2][0].id == 7 and found[2][0].score == pytest.approx(1.0, abs=1e-5)  # a text finds itself
    single = index.search(queries[0], top_k=3)  # one query: one list
    assert [h.id for h in single] == [h.id for h in found[0][:3]]
    vectors = emb.encode(queries[:2])
    assert [[h.id for h in row] for row in index.search(vectors, top_k=5)] == [[h.id for h in r] for r in found[:2]]
    assert [h.id for h in index.search(vectors[0], top_k=5)] == [h.id for h in found[0]]
    assert len(index.search(queries[0], top_k=10_000)) == len(LAW)  # top_k past the collection: all of it
    reloaded = kbert.SearchIndex.load(str(tmp_path / "ix"))  # the model comes back from the recorded dir
    assert hit_pairs(reloaded.search(queries, top_k=5)) == hit_pairs(found)
    assert reloaded.get(3) == kbert.SearchIndex.load(str(tmp_path / "ix")).get(3)
    assert reloaded.get(3).text == LAW[3] and reloaded.get(3).score is None
    assert not os.path.exists(tmp_path / "ix" / "chunks")  # a finished build leaves no chunks behind
    with pytest.raises(IndexError, match="outside this index"):
        reloaded.get(len(LAW))


def test_ids_metadata_and_adding_texts_match_one_build_of_everything(model_dir, tmp_path):
    texts = LAW[:120]
    ids = [f"조-{i:03d}" for i in range(len(texts))]
    meta = [{"line": i, "법": "헌법"} for i in range(len(texts))]
    first = quiet_build(model_dir, texts[:80], str(tmp_path / "a"), ids=ids[:80], metadata=meta[:80],
                        kind="flat", chunk_size=30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first.add(texts[80:], ids=ids[80:], metadata=meta[80:])
    first.save()
    whole = quiet_build(model_dir, texts, str(tmp_path / "b"), ids=ids, metadata=meta)
    queries = ["국민의 권리와 의무", "헌법 개정", texts[100]]
    grown = kbert.SearchIndex.load(str(tmp_path / "a"))
    assert len(grown) == 120
    got = grown.search(queries, top_k=6)
    assert_same_hits(got, whole.search(queries, top_k=6))
    top = got[2][0]
    assert top.id == "조-100" and top.text == texts[100] and top.metadata == {"line": 100, "법": "헌법"}
    # ids: unique, and given for every text of an index built with them
    with pytest.raises(ValueError, match="already taken"):
        grown.add(["새 조문"], ids=["조-005"])
    with pytest.raises(ValueError, match="pass ids="):
        grown.add(["새 조문"])
    with pytest.raises(ValueError, match="given twice"):
        quiet_build(model_dir, ["가", "나"], str(tmp_path / "c"), ids=["x", "x"])
    positional = quiet_build(model_dir, texts[:10], str(tmp_path / "d"))
    with pytest.raises(ValueError, match="without ids"):
        positional.add(["새 조문"], ids=["x"])
    positional.add(["새 조문 하나", "새 조문 둘"])
    assert [positional.get(i).id for i in (10, 11)] == [10, 11]  # positions go on


def test_an_interrupted_build_resumes_where_it_stopped_and_refuses_other_texts(model_dir, emb, tmp_path, capsys):
    out = str(tmp_path / "ix")
    texts = LAW[:250]
    calls = []
    original = kbert.Embedder.encode

    def stop_on_third(self, chunk, *args, **kwargs):
        if not isinstance(chunk, str):  # a chunk of texts (a str is the probe sentence)
            calls.append(len(chunk))
            if len(calls) == 3:
                raise KeyboardInterrupt
        return original(self, chunk, *args, **kwargs)

    kbert.Embedder.encode = stop_on_third
    try:
        with pytest.raises(KeyboardInterrupt):
            quiet_build(emb, texts, out, chunk_size=60)
    finally:
        kbert.Embedder.encode = original
    assert calls == [60, 60, 60] and not os.path.exists(os.path.join(out, "kbert_index.json"))
    with pytest.raises(FileNotFoundError, match="unfinished build: run it again to resume"):
        kbert.SearchIndex.load(out)
    changed = list(texts)
    changed[70] = "바뀐 문장"
    with pytest.raises(ValueError, match="differ from those of the unfinished build .* chunk 1"):
        quiet_build(emb, changed, out, chunk_size=60)
    with pytest.raises(ValueError, match="other settings \\(chunk_size"):
        quiet_build(emb, texts, out, chunk_size=50)
    keras.utils.set_random_seed(1)
    retrained = kbert.Embedder(kbert.BertBackbone(emb.config, output_hidden_states=True), emb.tokenizer)
    with pytest.raises(ValueError, match="another model encoded"):
        quiet_build(retrained, texts, out, chunk_size=60)
    capsys.readouterr()
    calls.clear()

    def count(self, chunk, *args, **kwargs):
        if not isinstance(chunk, str):
            calls.append(len(chunk))
        return original(self, chunk, *args, **kwargs)

    kbert.Embedder.encode = count
    try:
        resumed = quiet_build(emb, iter(texts), out, chunk_size=60)  # any iterable: a generator here
    finally:
        kbert.Embedder.encode = original
    err = capsys.readouterr().err
    assert "resuming the build" in err and "2 chunks (120 texts) already encoded" in err
    assert calls == [60, 60, 10]  # only the chunks left
    fresh = quiet_build(emb, texts, str(tmp_path / "fresh"), chunk_size=250)
    queries = [texts[5], texts[130], "대통령의 임기"]
    assert_same_hits(resumed.search(queries, top_k=8), fresh.search(queries, top_k=8))
    assert [resumed.get(i).text for i in range(250)] == texts
    with pytest.raises(FileExistsError, match="already holds an index"):
        quiet_build(emb, texts, out)
    assert len(quiet_build(emb, texts[:5], out, overwrite=True)) == 5


def test_hybrid_search_is_embedder_search_with_lexical_over_the_candidates(model_dir, emb, tmp_path):
    """lexical=True keeps the texts' character n-gram TF-IDF; search(lexical=w) mixes it in as
    Embedder.search(lexical=w) does: the same hits when the candidates cover the collection, and the same
    first hits from the union of each part's first candidates."""
    index = quiet_build(model_dir, LAW, str(tmp_path / "ix"), lexical=True)
    queries = ["국회의원의 임기는 4년", "대통령의 권한", "헌법재판소 재판관", LAW[20]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for weight in (0.6, 1.0):
            want = emb.search(queries, LAW, top_k=8, lexical=weight)
            assert_same_hits(index.search(queries, top_k=8, lexical=weight, candidates=len(LAW)),
                             [[Hit(j, v, LAW[j], None) for j, v in row] for row in want])
            got = index.search(queries, top_k=5, lexical=weight, candidates=50)  # the union of each part's 50
            assert [[h.id for h in row] for row in got] == [[j for j, _ in row[:5]] for row in want]
    reloaded = kbert.SearchIndex.load(str(tmp_path / "ix"))
    assert_same_hits(reloaded.search(queries, top_k=5, lexical=0.6), index.search(queries, top_k=5, lexical=0.6))
    # added texts get n-gram rows too (weighed by the collection's IDF), kept by save
    reloaded.add(["국회는 탄핵소추를 의결할 수 있다는 조항을 새로 추가하였다"])
    reloaded.save()
    again = kbert.SearchIndex.load(str(tmp_path / "ix"))
    assert again.search("탄핵소추를 의결할 수 있다는 조항", top_k=1, lexical=1.0)[0].id == len(LAW)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vectors = emb.encode_document(LAW)
    made = kbert.SearchIndex.from_vectors(vectors, LAW, lexical=True, model=model_dir)  # vectors already at hand
    made.save(str(tmp_path / "made"))
    assert_same_hits(kbert.SearchIndex.load(str(tmp_path / "made")).search(queries, top_k=5, lexical=0.6),
                     index.search(queries, top_k=5, lexical=0.6))
    approximate = quiet_build(model_dir, LAW, str(tmp_path / "hnsw"), kind="hnsw", lexical=True)
    assert [h.id for h in approximate.search(LAW[20], top_k=3, lexical=0.6)][0] == 20
    plain = quiet_build(model_dir, LAW[:20], str(tmp_path / "plain"))
    with pytest.raises(ValueError, match="build it with lexical=True"):
        plain.search("국회", lexical=0.5)
    with pytest.raises(ValueError, match="`lexical` must be a number in \\[0, 1\\]"):
        index.search("국회", lexical=1.5)
    with pytest.raises(ValueError, match="pass texts, not vectors"):
        index.search(np.ones(32, np.float32), lexical=0.5)


def test_approximate_kinds_find_the_exact_neighbours(tmp_path):
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(60, 48))
    vectors = (centres[rng.integers(0, 60, 6000)] + 0.6 * rng.normal(size=(6000, 48))).astype(np.float32)
    queries = (centres[rng.integers(0, 60, 200)] + 0.6 * rng.normal(size=(200, 48))).astype(np.float32)
    exact = kbert.SearchIndex.from_vectors(vectors)
    truth = [{h.id for h in row} for row in exact.search(queries, top_k=10)]
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    assert truth == [set(np.argsort(-row)[:10].tolist()) for row in q @ unit.T]  # flat is exact

    def recall(index, **kw):
        return np.mean([len(t & {h.id for h in row}) / 10 for t, row in zip(truth, index.search(queries, 10, **kw))])

    hnsw = kbert.SearchIndex.from_vectors(vectors, kind="hnsw")
    assert recall(hnsw) >= 0.95
    assert recall(hnsw, ef_search=10) <= recall(hnsw, ef_search=200)  # the beam trades speed for recall
    ivf = kbert.SearchIndex.from_vectors(vectors, kind="ivf")
    assert ivf.info["nlist"] == default_nlist(6000) and recall(ivf) >= 0.9
    assert recall(ivf, nprobe=ivf.info["nlist"]) == 1.0  # every bucket searched: exact
    for kind in ("flat", "hnsw"):
        small = kbert.SearchIndex.from_vectors(vectors, kind=kind, precision="int8")
        assert recall(small) >= 0.85
    half = kbert.SearchIndex.from_vectors(vectors, precision="float16")
    assert recall(half) >= 0.99
    # saved and loaded: the same hits, the files a quarter the size with int8
    ivf.save(str(tmp_path / "ivf"))
    assert hit_pairs(kbert.SearchIndex.load(str(tmp_path / "ivf")).search(queries[:20], 5)) == \
        hit_pairs(ivf.search(queries[:20], 5))
    exact.save(str(tmp_path / "flat"))
    kbert.SearchIndex.from_vectors(vectors, precision="int8").save(str(tmp_path / "int8"))
    size = [os.path.getsize(tmp_path / d / "index.faiss") for d in ("flat", "int8")]
    assert size[1] < 0.3 * size[0]
    with pytest.raises(ValueError, match="pass model= to SearchIndex.load"):
        kbert.SearchIndex.load(str(tmp_path / "flat")).search("텍스트 질의")
    with pytest.raises(ValueError, match="48-wide"):
        exact.search(np.ones(16, np.float32))


def test_the_index_refuses_a_model_that_encodes_otherwise(model_dir, emb, tmp_path):
    quiet_build(model_dir, LAW[:40], str(tmp_path / "ix"))
    keras.utils.set_random_seed(1)
    other = kbert.Embedder(kbert.BertBackbone(emb.config, output_hidden_states=True), emb.tokenizer)
    with pytest.raises(ValueError, match="does not encode as the one that built this index"):
        kbert.SearchIndex.load(str(tmp_path / "ix"), model=other)
    assert len(kbert.SearchIndex.load(str(tmp_path / "ix"), model=emb)) == 40  # the same weights: accepted
    # an Embedder in memory is not recorded: loading needs it (or one that encodes the same)
    quiet_build(other, LAW[:40], str(tmp_path / "mem"))
    with pytest.raises(ValueError, match="pass model= to SearchIndex.load"):
        kbert.SearchIndex.load(str(tmp_path / "mem")).search("국회")
    assert kbert.SearchIndex.load(str(tmp_path / "mem"), model=other).search(LAW[3], top_k=1)[0].id == 3


def test_prompts_and_matryoshka_width_are_used_for_queries_and_documents(emb, tmp_path):
    prompted = kbert.Embedder(emb.backbone, emb.tokenizer, prompts={"query": "질문: ", "passage": "문서: "})
    texts = LAW[:50]
    index = quiet_build(prompted, texts, str(tmp_path / "ix"), truncate_dim=16)
    assert index.info["document_prompt"] == "문서: " and index.info["query_prompt"] == "질문: "
    assert index.info["dimension"] == 16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = prompted.search(["국회의 권한"], prompted.encode_document(texts, truncate_dim=16), top_k=5,
                               truncate_dim=16)[0]
        got = index.search("국회의 권한", top_k=5)
    assert [h.id for h in got] == [j for j, _ in want]  # query: "질문: ..." at 16 dims, documents "문서: ..."
    np.testing.assert_allclose(index.encode_queries(["국회의 권한"])[0],
                               prompted.encode_query("국회의 권한", truncate_dim=16), atol=1e-6)


def test_a_reranker_reorders_the_first_candidates(model_dir, tmp_path):
    index = quiet_build(model_dir, LAW[:60], str(tmp_path / "ix"))

    class ByLength:  # a stand-in cross-encoder: longer documents score higher
        def rank(self, query, documents):
            order = sorted(range(len(documents)), key=lambda i: -len(documents[i]))
            return [{"corpus_id": i, "score": float(len(documents[i]))} for i in order]

    plain = index.search("국회", top_k=10)
    reranked = index.search("국회", top_k=10, reranker=ByLength(), candidates=5)
    head = sorted(plain[:5], key=lambda h: -len(h.text))
    assert [h.id for h in reranked[:5]] == [h.id for h in head]
    assert [h.score for h in reranked[:5]] == [float(len(h.text)) for h in head]
    assert reranked[5:] == plain[5:]  # past the candidates: the index's own order and scores
    with pytest.raises(ValueError, match="read the query texts"):
        index.search(np.ones(32, np.float32), reranker=ByLength())


def test_bad_arguments_are_named(model_dir, tmp_path):
    with pytest.raises(ValueError, match="`kind` must be one of"):
        quiet_build(model_dir, ["가"], str(tmp_path / "a"), kind="annoy")
    with pytest.raises(ValueError, match="`precision` must be one of"):
        quiet_build(model_dir, ["가"], str(tmp_path / "a"), precision="binary")
    with pytest.raises(ValueError, match="no texts to index"):
        quiet_build(model_dir, [], str(tmp_path / "b"))
    with pytest.raises(TypeError, match="not one string"):
        quiet_build(model_dir, "한 문장", str(tmp_path / "c"))
    with pytest.raises(TypeError, match="text 1 is a int"):
        quiet_build(model_dir, ["가", 3], str(tmp_path / "d"))
    with pytest.raises(ValueError, match="fewer entries than there are texts"):
        quiet_build(model_dir, ["가", "나"], str(tmp_path / "e"), ids=["x"])
    with pytest.raises(ValueError, match="`chunk_size` must be a positive integer"):
        quiet_build(model_dir, ["가"], str(tmp_path / "f"), chunk_size=0)
    with pytest.raises(ValueError, match="`nlist` 8 is more than the 3 texts"):
        quiet_build(model_dir, ["가", "나", "다"], str(tmp_path / "g"), kind="ivf", nlist=8)
    index = quiet_build(model_dir, ["가", "나"], str(tmp_path / "h"))
    with pytest.raises(ValueError, match="`top_k` must be a positive integer"):
        index.search("가", top_k=0)
    with pytest.raises(FileNotFoundError, match="holds no kbert index"):
        kbert.SearchIndex.load(str(tmp_path / "nothing"))


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "kbert.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_index_commands_build_add_search_and_info(model_dir, tmp_path):
    rows = tmp_path / "laws.tsv"
    rows.write_text("id\ttext\tsource\n" + "".join(f"a{i}\t{t}\t헌법\n" for i, t in enumerate(LAW[:40])),
                    encoding="utf-8")
    more = tmp_path / "more.tsv"
    more.write_text("id\ttext\tsource\nb0\t국회는 법률을 만든다.\t새 법\n", encoding="utf-8")
    out = str(tmp_path / "ix")
    built = run_cli("index", "build", "--model", model_dir, "--input", str(rows), "--out", out, "--id-column", "id",
                    "--kind", "hnsw", "--chunk-size", "16", "--lexical")
    assert built.returncode == 0, built.stderr[-2000:]
    assert "SearchIndex(40 texts, hnsw float32" in built.stderr
    added = run_cli("index", "add", "--index", out, "--input", str(more), "--id-column", "id")
    assert added.returncode == 0 and "added 1 texts" in added.stderr, added.stderr[-2000:]
    queries = tmp_path / "q.txt"
    queries.write_text("국회는 법률을 만든다.\n\n" + LAW[3] + "\n", encoding="utf-8")
    found = run_cli("index", "search", "--index", out, "--input", str(queries), "--top-k", "3")
    assert found.returncode == 0, found.stderr[-2000:]
    lines = [json.loads(line) for line in found.stdout.splitlines()]
    assert [line["query"] for line in lines] == ["국회는 법률을 만든다.", LAW[3]]  # blank lines skipped
    assert lines[0]["hits"][0] == {"id": "b0", "score": pytest.approx(1.0, abs=1e-5), "text": "국회는 법률을 만든다.",
                                   "metadata": {"source": "새 법"}}
    assert lines[1]["hits"][0]["id"] == "a3" and len(lines[1]["hits"]) == 3
    hybrid = run_cli("index", "search", "--index", out, "--input", str(queries), "--lexical", "1")
    assert [json.loads(line)["hits"][0]["id"] for line in hybrid.stdout.splitlines()] == ["b0", "a3"], hybrid.stderr
    only = run_cli("index", "search", "--index", out, "--input", str(queries), "--where", "source=새 법")
    assert [[h["id"] for h in json.loads(line)["hits"]] for line in only.stdout.splitlines()] == [["b0"], ["b0"]]
    deleted = run_cli("index", "delete", "--index", out, "--ids", "a3", "b0")
    assert deleted.returncode == 0 and "deleted 2 texts" in deleted.stderr, deleted.stderr[-2000:]
    after = run_cli("index", "search", "--index", out, "--input", str(queries))
    assert all(h["id"] not in ("a3", "b0") for line in after.stdout.splitlines() for h in json.loads(line)["hits"])
    info = run_cli("index", "info", "--index", out)
    assert info.returncode == 0 and json.loads(info.stdout)["count"] == 41 and json.loads(info.stdout)["deleted"] == 2
    again = run_cli("index", "build", "--model", model_dir, "--input", str(rows), "--out", out)
    assert again.returncode == 1 and "already holds an index; pass overwrite=True (--overwrite)" in again.stderr


def test_where_filters_by_metadata_and_deleted_texts_leave_every_search(model_dir, emb, tmp_path):
    texts = LAW[:200]
    meta = [{"part": i % 4, "kind": "조문" if i % 2 else "제목"} for i in range(len(texts))]
    queries = ["국회의원의 임기", "대통령의 권한", texts[9]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vectors = emb.encode_document(texts)
    for kind in ("flat", "hnsw", "ivf"):
        index = quiet_build(model_dir, texts, str(tmp_path / kind), metadata=meta, kind=kind, lexical=True)
        keep = [i for i in range(len(texts)) if meta[i]["part"] in (1, 2) and meta[i]["kind"] == "조문"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = emb.search(queries, vectors[keep], top_k=5)
        got = index.search(queries, top_k=5, where={"part": [1, 2], "kind": "조문"})
        assert [[h.id for h in row] for row in got] == [[keep[j] for j, _ in row] for row in want], kind
        same = index.search(queries, top_k=5, where=lambda r: r["metadata"]["part"] in (1, 2) and
                            r["metadata"]["kind"] == "조문")
        assert [[h.id for h in row] for row in same] == [[h.id for h in row] for row in got]
        hybrid = index.search(queries, top_k=5, lexical=0.6, where={"part": 3})
        assert all(h.metadata["part"] == 3 for row in hybrid for h in row) and all(len(r) == 5 for r in hybrid)
        assert index.search(queries[0], top_k=5, where={"part": 7}) == []  # nothing matches: no hits
        # comparisons (Chroma's and MongoDB's operators): the same texts as the lists above
        compared = index.search(queries, top_k=5, where={"part": {"$gte": 1, "$lt": 3}, "kind": {"$ne": "제목"}})
        assert [[h.id for h in row] for row in compared] == [[h.id for h in row] for row in got], kind
        assert index.search(queries, top_k=5, where={"part": {"$in": [1, 2]}, "kind": {"$nin": ["제목"]}}) == got
        assert index.search(queries[0], top_k=5, where={"part": {"$gt": "1"}}) == []  # a string orders no int
        # deleting: the texts leave every search, the count drops, and save/load keeps it
        first = index.search(texts[9], top_k=3)
        assert first[0].id == 9
        assert index.delete([9, 10]) == 2 and len(index) == 198
        assert 9 not in [h.id for h in index.search(texts[9], top_k=10)]
        assert 9 not in [h.id for h in index.search(texts[9], top_k=10, lexical=0.6)]
        with pytest.raises(KeyError, match="already deleted"):
            index.delete(9)
        with pytest.raises(KeyError, match="numbers its texts 0..199"):
            index.delete(500)
        index.save()
        reloaded = kbert.SearchIndex.load(str(tmp_path / kind))
        assert len(reloaded) == 198 and reloaded.deleted == {9, 10}
        assert 9 not in [h.id for h in reloaded.search(texts[9], top_k=10)]
    named = quiet_build(model_dir, texts[:30], str(tmp_path / "named"), ids=[f"t{i}" for i in range(30)])
    named.delete("t3")
    with pytest.raises(ValueError, match="already taken"):
        named.add(["다른 조문"], ids=["t4"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        named.add(["대한민국의 영토는 한반도와 그 부속도서로 한다. 새로 고친 조문"], ids=["t3"])  # an update
    assert [h.id for h in named.search("대한민국의 영토는 한반도와 그 부속도서로 한다. 새로 고친 조문", top_k=1)] == ["t3"]
    assert len(named) == 30
    with pytest.raises(KeyError, match="'t99' is not in this index"):
        named.delete("t99")
    with pytest.raises(TypeError, match="`where` must be a dict"):
        named.search("국회", where="part=1")
    for bad in ({"$ge": 1}, {}, {"$in": 1}):  # a typo matched nothing, silently: now an error naming it
        with pytest.raises(ValueError, match=r"`where\['part'\]"):
            named.search("국회", where={"part": bad})


DECISIONS = [" ".join(LAW[i:i + 12]) for i in range(0, 240, 12)]  # 20 "documents" of 12 constitution lines


def test_passages_fit_the_budget_cover_the_text_and_end_at_sentences(emb):
    text = DECISIONS[0] + " 이 문장은 끝이 없이 " + "아주 긴 문장의 일부가 되는 말들이 계속 이어지고 " * 12 + "끝난다."
    for max_tokens, overlap in ((32, 0), (64, 1), (48, 2)):
        spans = kbert.split_passages(text, emb, max_tokens=max_tokens, overlap=overlap)
        assert spans == sorted(spans) and spans[0][0] == 0 and spans[-1][1] == len(text.rstrip())
        lengths = [len(ids) + 2 for ids in emb.tokenizer.ids_batch([text[s:e] for s, e in spans])]
        assert max(lengths) <= max_tokens  # each passage is encoded whole, [CLS] and [SEP] counted
        covered = np.zeros(len(text), bool)
        for s, e in spans:
            covered[s:e] = True
        assert all(covered[i] or text[i].isspace() for i in range(len(text)))  # nothing left out
        # passages start and end at sentence ends, or between words inside the one sentence over the budget
        sentence_starts = {text.find(sentence) for sentence in split_sentences_rules(text)}
        assert all(s in sentence_starts or text[s - 1] == " " for s, _ in spans)
        assert all(e == len(text) or text[e] == " " for _, e in spans)
    short = " ".join(f"제{i}조 모든 국민은 법 앞에 평등하다." for i in range(40))  # sentences that fit
    for overlap in (1, 2):
        spans = kbert.split_passages(short, emb, max_tokens=96, overlap=overlap)
        sentences = [(short.find(t), short.find(t) + len(t)) for t in split_sentences_rules(short)]
        for (s1, e1), (s2, e2) in zip(spans, spans[1:]):  # the next passage repeats the last `overlap` sentences
            held = [k for k, (a, b) in enumerate(sentences) if s1 <= a and b <= e1]
            assert len(held) > overlap and s2 == sentences[held[-overlap]][0] and e2 > e1
    cut = kbert.split_passages(text, emb, max_tokens=32, overlap=0)
    inner = [text[s:e] for s, e in cut if "아주 긴 문장" in text[s:e]]
    assert len(inner) >= 3  # the over-long sentence in pieces (cut between words: the checks above)
    assert kbert.split_passages("   ", emb) == []
    with pytest.raises(ValueError, match="`overlap` must be an integer >= 0"):
        kbert.split_passages(text, emb, overlap=-1)
    with pytest.raises(ValueError, match="leaves no room for text"):
        kbert.split_passages(text, emb, max_tokens=2)


def test_an_index_of_passages_ranks_documents_by_their_best_passage(model_dir, emb, tmp_path):
    parts = kbert.split_documents(DECISIONS, emb, max_tokens=48, overlap=1, ids=[f"판례{i}" for i in range(20)],
                                  metadata=[{"court": "대법원" if i % 2 else "고등법원"} for i in range(20)])
    assert len(parts.texts) > 40 and parts.ids[0] == "판례0#0"
    first = parts.metadata[0]
    assert first["document"] == "판례0" and first["court"] == "고등법원" and \
        DECISIONS[0][first["start"]:first["end"]] == parts.texts[0]
    index = quiet_build(model_dir, parts.texts, str(tmp_path / "ix"), ids=parts.ids, metadata=parts.metadata)
    queries = ["국회의원의 임기", "대통령 선거", LAW[30]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        every = emb.search(queries, parts.texts, top_k=len(parts.texts))
    for query_hits, row in zip(index.search(queries, top_k=5, group_by="document"), every):
        best = []
        for j, score in row:  # the best passage of each document, in order
            if parts.metadata[j]["document"] not in [parts.metadata[b]["document"] for b, _ in best]:
                best.append((j, score))
        # the same documents in the same order, each by its best passage's score (two passages of a document
        # may tie: the overlap repeats sentences)
        assert [h.metadata["document"] for h in query_hits] == [parts.metadata[j]["document"] for j, _ in best[:5]]
        np.testing.assert_allclose([h.score for h in query_hits], [v for _, v in best[:5]], atol=1e-5)
    assert index.search(LAW[30], top_k=1, group_by="document")[0].metadata["document"] == "판례2"
    assert len(index.search(queries[0], top_k=50, group_by="document")) == 20  # deeper until every document
    graph = quiet_build(model_dir, parts.texts, str(tmp_path / "hnsw"), ids=parts.ids, metadata=parts.metadata,
                        kind="hnsw")
    assert len({h.metadata["document"] for h in graph.search(queries[1], top_k=8, group_by="document")}) == 8
    # a document's passages leave together
    removed = index.delete(where={"document": "판례2"})
    assert removed == sum(m["document"] == "판례2" for m in parts.metadata)
    assert all(h.metadata["document"] != "판례2" for h in index.search(LAW[30], top_k=10))
    with pytest.raises(ValueError, match="pass `ids` or `where`"):
        index.delete()


@pytest.mark.slow
def test_index_commands_split_documents_into_passages(model_dir, tmp_path):
    docs = tmp_path / "docs.txt"
    docs.write_text("\n".join(DECISIONS[:6]) + "\n", encoding="utf-8")
    out = str(tmp_path / "ix")
    built = run_cli("index", "build", "--model", model_dir, "--input", str(docs), "--out", out, "--passages", "48")
    assert built.returncode == 0, built.stderr[-2000:]
    assert "6 documents in" in built.stderr and "passages of up to 48 tokens" in built.stderr
    more = tmp_path / "more.txt"
    more.write_text(DECISIONS[6] + "\n", encoding="utf-8")
    added = run_cli("index", "add", "--index", out, "--input", str(more), "--passages", "48")
    assert added.returncode == 0, added.stderr[-2000:]
    queries = tmp_path / "q.txt"
    queries.write_text(DECISIONS[6][:40] + "\n", encoding="utf-8")
    found = run_cli("index", "search", "--index", out, "--input", str(queries), "--top-k", "7",
                    "--group-by", "document")
    hits = json.loads(found.stdout)["hits"]
    assert sorted(h["metadata"]["document"] for h in hits) == list(range(7))  # one passage per document
    assert hits[0]["metadata"]["document"] == 6 and hits[0]["id"].startswith("6#")  # numbered on from the build
    deleted = run_cli("index", "delete", "--index", out, "--where", "document=6")
    assert deleted.returncode == 0 and "deleted" in deleted.stderr, deleted.stderr[-2000:]
    after = run_cli("index", "search", "--index", out, "--input", str(queries), "--group-by", "document")
    assert 6 not in [h["metadata"]["document"] for h in json.loads(after.stdout)["hits"]]
