"""kbert.SparseIndex: SPLADE vectors on disk. The same hits as SparseEncoder.search (less the texts sharing no token),
resumed builds, add / delete / where / group_by, the probe check, the CLI, and a dense index refusing it by name."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from helpers import hf_masked_lm_dir

TEXTS = ["서울은 한국의 수도이다.", "나는 오늘 학교에 간다.", "이 영화 정말 재밌다", "국회는 법률을 만든다.",
         "서울의 국회는 오늘 법률을 만든다", "영화관은 학교 옆에 있다", "한국의 법률은 국회가 만든다",
         "오늘 서울은 맑다"]
QUERIES = ["한국의 수도", "법률을 만든다", "영화 재밌다", "오늘 학교"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path, _, _ = hf_masked_lm_dir(tmp_path_factory.mktemp("splade"), TEXTS)
    return path


def _expected(enc, queries, corpus, top_k, max_active_dims=None):
    """SparseEncoder.search's hits, less those scoring 0 (no token shared): what an inverted index returns."""
    docs = enc.encode_document(corpus, max_active_dims=max_active_dims)
    return [[(j, s) for j, s in row if s > 0] for row in enc.search(queries, docs, top_k=top_k)]


def test_build_search_and_load(model_dir, tmp_path):
    import kbert

    out = str(tmp_path / "index")
    index = kbert.SparseIndex.build(model_dir, TEXTS, out, chunk_size=3, max_active_dims=12, progress=False,
                                    metadata=[{"doc": i // 2} for i in range(len(TEXTS))])
    assert len(index) == len(TEXTS) and index.matrix.shape == (len(TEXTS), index.info["dimension"])
    assert max(index.matrix.getnnz(axis=1)) <= 12
    assert not os.path.exists(os.path.join(out, "chunks"))
    enc = kbert.SparseEncoder.load(model_dir)
    want = _expected(enc, QUERIES, TEXTS, 5, max_active_dims=12)
    got = index.search(QUERIES, top_k=5)
    for hits, expected in zip(got, want):
        assert [h.id for h in hits] == [j for j, _ in expected]
        np.testing.assert_allclose([h.score for h in hits], [s for _, s in expected], rtol=1e-5)
        assert all(h.text == TEXTS[h.id] for h in hits)
    one = index.search(QUERIES[0], top_k=2)  # one query: one list
    assert [h.id for h in one] == [h.id for h in got[0][:2]]

    again = kbert.SparseIndex.load(out)  # the model comes back from the recorded dir
    assert [h.id for h in again.search(QUERIES[1], top_k=5)] == [h.id for h in got[1]]
    from kbert.embed.sparse_index import load_index

    assert type(load_index(out)).__name__ == "SparseIndex"
    with pytest.raises(ValueError, match="is a sparse index of SPLADE vectors: load it with kbert.SparseIndex"):
        kbert.SearchIndex.load(out)

    # where and group_by, as a dense index's
    hits = again.search(QUERIES[1], top_k=5, where={"doc": [1, 2]})
    assert hits and all(h.metadata["doc"] in (1, 2) for h in hits)
    grouped = again.search(QUERIES[1], top_k=3, group_by="doc")
    assert len({h.metadata["doc"] for h in grouped}) == len(grouped)
    assert grouped[0].id == got[1][0].id

    # add, delete, save, load
    again.add(["국회의 법률 학교"], metadata=[{"doc": 9}])
    assert again.delete([3]) == 1
    again.save()
    third = kbert.SparseIndex.load(out)
    assert len(third) == len(TEXTS) and 3 in third.deleted
    ids = [h.id for h in third.search(QUERIES[1], top_k=10)]
    assert 3 not in ids and len(TEXTS) in ids
    with pytest.raises(ValueError, match="settings of a dense index"):
        third.search(QUERIES[0], lexical=0.5)


def test_reranker_and_vectors(model_dir, tmp_path):
    import kbert

    index = kbert.SparseIndex.build(model_dir, TEXTS, str(tmp_path / "i"), progress=False)

    class Reversed:  # a stand-in cross-encoder: ranks the candidates by text length, longest first
        def rank(self, query, texts):
            order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
            return [{"corpus_id": i, "score": float(len(texts[i]))} for i in order]

    first = index.search(QUERIES[0], top_k=8)
    reranked = index.search(QUERIES[0], top_k=3, reranker=Reversed(), candidates=4)
    assert [h.id for h in reranked] == sorted([h.id for h in first[:4]], key=lambda i: -len(TEXTS[i]))[:3]
    vectors = index.encode_queries(QUERIES[:2])
    by_vector = index.search(vectors, top_k=3)
    assert [[h.id for h in row] for row in by_vector] == [[h.id for h in row] for row in
                                                            index.search(QUERIES[:2], top_k=3)]


def test_resume_and_refusals(model_dir, tmp_path, capsys):
    import kbert
    from kbert.embed import index as index_module

    out = str(tmp_path / "index")
    calls = []
    original = index_module.write_json

    def stop_after_two_chunks(path, value):  # the third chunk's progress write fails: a stopped build
        if path.endswith("progress.json") and len(value["done"]) == 3:
            calls.append(path)
            raise KeyboardInterrupt
        original(path, value)

    index_module.write_json = stop_after_two_chunks
    try:
        with pytest.raises(KeyboardInterrupt):
            kbert.SparseIndex.build(model_dir, TEXTS, out, chunk_size=2, progress=False)
    finally:
        index_module.write_json = original
    assert calls and not index_module.manifest_exists(out)
    with pytest.raises(FileNotFoundError, match="an unfinished build: run it again to resume"):
        kbert.SparseIndex.load(out)
    with pytest.raises(ValueError, match="other settings"):
        kbert.SparseIndex.build(model_dir, TEXTS, out, chunk_size=3, progress=False)
    capsys.readouterr()
    index = kbert.SparseIndex.build(model_dir, TEXTS, out, chunk_size=2, progress=False)
    err = capsys.readouterr().err
    assert "resuming the build" in err and "2 chunks (4 texts)" in err
    fresh = kbert.SparseIndex.build(model_dir, TEXTS, str(tmp_path / "fresh"), chunk_size=2, progress=False)
    assert (index.matrix != fresh.matrix).nnz == 0
    with pytest.raises(FileExistsError, match="already holds an index"):
        kbert.SparseIndex.build(model_dir, TEXTS, out, progress=False)

    # another model (other weights, same vocabulary) is refused by its probe vector
    import transformers

    other = str(tmp_path / "other")
    hf = transformers.BertForPreTraining.from_pretrained(model_dir)
    with __import__("torch").no_grad():
        for p in hf.parameters():
            p.add_(0.5 * __import__("torch").randn_like(p))
    hf.save_pretrained(other)
    import shutil

    shutil.copy(os.path.join(model_dir, "vocab.txt"), other)
    with pytest.raises(ValueError, match="does not encode as the one that built this index"):
        kbert.SparseIndex.load(out, model=other)
    with pytest.raises(ValueError, match="is a dense index"):
        dense = str(tmp_path / "dense")
        os.makedirs(dense)
        with open(os.path.join(dense, "kbert_index.json"), "w") as f:
            json.dump({"format": 1, "kind": "flat"}, f)
        kbert.SparseIndex.load(dense)


def test_cli_sparse_index(model_dir, tmp_path, capsys):
    from kbert.cli import main

    lines = tmp_path / "docs.txt"
    lines.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    out = str(tmp_path / "index")
    assert main(["index", "build", "--model", model_dir, "--input", str(lines), "--out", out, "--sparse",
                 "--max-active-dims", "10"]) == 0
    assert "SparseIndex(8 texts" in capsys.readouterr().err
    queries = tmp_path / "q.txt"
    queries.write_text("\n".join(QUERIES[:2]) + "\n", encoding="utf-8")
    assert main(["index", "search", "--index", out, "--input", str(queries), "--top-k", "3"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    import kbert

    want = kbert.SparseIndex.load(out).search(QUERIES[:2], top_k=3)
    assert [[h["id"] for h in r["hits"]] for r in rows] == [[h.id for h in hits] for hits in want]
    assert main(["index", "delete", "--index", out, "--ids", "0"]) == 0
    assert main(["index", "info", "--index", out]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["type"] == "sparse" and info["deleted"] == 1 and info["max_active_dims"] == 10
    assert main(["index", "build", "--model", model_dir, "--input", str(lines), "--out", str(tmp_path / "x"),
                 "--sparse", "--kind", "hnsw"]) == 1
    assert "--kind hnsw goes with a dense index" in capsys.readouterr().err


def test_hybrid_search_fuses_a_dense_and_a_sparse_index(model_dir, tmp_path):
    """kbert.hybrid_search against the fusion computed by hand from Embedder and SparseEncoder vectors: z-scores
    over every text (candidates >= the collection), reciprocal ranks of each side's list, filters, refusals."""
    import kbert

    meta = [{"doc": i // 2} for i in range(len(TEXTS))]
    dense = kbert.SearchIndex.build(model_dir, TEXTS, str(tmp_path / "dense"), metadata=meta, progress=False)
    sparse = kbert.SparseIndex.build(model_dir, TEXTS, str(tmp_path / "sparse"), metadata=meta, progress=False)
    emb, enc = kbert.Embedder.load(model_dir), kbert.SparseEncoder.load(model_dir)
    cosine = emb.encode(QUERIES, normalize=True) @ emb.encode(TEXTS, normalize=True).T
    dot = (enc.encode_query(QUERIES) @ enc.encode_document(TEXTS).T).toarray()
    z = lambda m: (m - m.mean(axis=1, keepdims=True)) / m.std(axis=1, keepdims=True)
    n = len(TEXTS)
    for weight in (0.3, 0.5, 1.0):
        fused = (1 - weight) * z(cosine) + weight * z(dot)
        got = kbert.hybrid_search(dense, sparse, QUERIES, top_k=n, weight=weight, candidates=n)
        for q, hits in enumerate(got):
            assert sorted(h.id for h in hits) == list(range(n))  # every text: the dense side proposes them all
            assert all(h.text == TEXTS[h.id] and h.metadata == meta[h.id] for h in hits)
            np.testing.assert_allclose([h.score for h in hits], fused[q][[h.id for h in hits]], atol=1e-4)
            assert all(a.score >= b.score for a, b in zip(hits, hits[1:]))
    # weight 0: the dense ranking alone
    assert ([[h.id for h in hits] for hits in kbert.hybrid_search(dense, sparse, QUERIES, weight=0.0, top_k=4)]
            == [[h.id for h in hits] for hits in dense.search(QUERIES, top_k=4)])

    # reciprocal rank fusion over each side's first 3 (dirs work as well as loaded indexes)
    got = kbert.hybrid_search(str(tmp_path / "dense"), str(tmp_path / "sparse"), QUERIES, fusion="rrf",
                              candidates=3, top_k=3)
    for q, hits in enumerate(got):
        want = {}
        for side in (dense.search(QUERIES[q], top_k=3), sparse.search(QUERIES[q], top_k=3)):
            for rank, h in enumerate(side, 1):
                want[h.id] = want.get(h.id, 0.0) + 1 / (60 + rank)
        assert len(hits) == 3 and all(abs(h.score - want[h.id]) < 1e-9 for h in hits)
        np.testing.assert_allclose([h.score for h in hits], sorted(want.values(), reverse=True)[:3], rtol=1e-9)

    from kbert.cli import main

    queries = tmp_path / "q.txt"
    queries.write_text("\n".join(QUERIES) + "\n", encoding="utf-8")
    out = tmp_path / "hits.jsonl"
    assert main(["index", "search", "--index", str(tmp_path / "dense"), "--hybrid", str(tmp_path / "sparse"),
                 "--fusion", "rrf", "--candidates", "3", "--top-k", "3", "--input", str(queries),
                 "--out", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert [[h["id"] for h in r["hits"]] for r in rows] == [[h.id for h in hits] for hits in got]
    assert main(["index", "search", "--index", str(tmp_path / "dense"), "--hybrid", str(tmp_path / "sparse"),
                 "--lexical", "0.5", "--input", str(queries)]) == 1

    hits = kbert.hybrid_search(dense, sparse, QUERIES[1], where={"doc": [1, 2]}, top_k=5)
    assert hits and all(h.metadata["doc"] in (1, 2) for h in hits)
    grouped = kbert.hybrid_search(dense, sparse, QUERIES[1], group_by="doc", top_k=3)
    assert len(grouped) == 3 and len({h.metadata["doc"] for h in grouped}) == 3

    with pytest.raises(TypeError, match="the dense side must be a kbert.SearchIndex"):
        kbert.hybrid_search(sparse, dense, QUERIES)
    with pytest.raises(ValueError, match="`fusion` must be one of"):
        kbert.hybrid_search(dense, sparse, QUERIES, fusion="sum")
    with pytest.raises(ValueError, match="`weight` must be a number in"):
        kbert.hybrid_search(dense, sparse, QUERIES, weight=2)
    fewer = kbert.SparseIndex.build(model_dir, TEXTS[:-1], str(tmp_path / "fewer"), progress=False)
    with pytest.raises(ValueError, match="different collections"):
        kbert.hybrid_search(dense, fewer, QUERIES)
    shuffled = kbert.SparseIndex.build(model_dir, TEXTS[::-1], str(tmp_path / "shuffled"), progress=False)
    with pytest.raises(ValueError, match="different texts under id"):
        kbert.hybrid_search(dense, shuffled, QUERIES, candidates=2)
