"""`kbert.hybrid_search`: one ranking from a dense `kbert.SearchIndex` and a SPLADE `kbert.SparseIndex` built
from the same texts.

    dense = kbert.SearchIndex.build("my-sts-model", texts, "law-dense")
    sparse = kbert.SparseIndex.build("my-splade", texts, "law-sparse")
    kbert.hybrid_search(dense, sparse, "전세 계약을 갱신하려면", top_k=5)        # [Hit(id, score, text, metadata)]

Why: dense vectors find paraphrases that share no word with the query, sparse vectors reward the exact terms
(statute names, numbers, rare nouns) a dense model blurs, and their errors differ, so a sum of the two ranks
better than either (benchmarks/README.md, "SPLADE sparse vectors": on this project's question pairs the sum
beat both). This is the hybrid that OpenSearch, Elasticsearch, Qdrant and Weaviate offer over a dense and a
sparse field; here over two kbert indexes on disk, with no server.

How, per query: each index proposes its first `candidates` texts (with the same `where` filter and `group_by`);
every text of the union is scored by both indexes exactly (`similarities`: the cosine, and the dot product,
0 for a text sharing no token with the query), so a text one side did not propose still gets that side's
score; then the two scores are fused:
    fusion="zscore" (default): each side's scores are standardized over the union (mean 0, standard deviation 1;
        a side whose scores are all equal adds 0) and added as `(1 - weight) x dense + weight x sparse`. The two
        scales differ (a cosine in [-1, 1], a SPLADE dot product in the tens), so a raw sum would be the sparse
        side alone; standardizing is what the benchmark above measured (with `candidates` at least the
        collection, the union is every text and the figure is that benchmark's).
    fusion="rrf": reciprocal rank fusion (Cormack et al. 2009; Elasticsearch's and Qdrant's `rrf`): each side
        adds `2 x its weight / (rank_constant + rank)` for a text in its list (1-based rank), nothing for one it
        did not propose. At weight 0.5 that is the usual unweighted sum. It reads ranks only, so it needs no
        score scale at all.
A cross-encoder `reranker` then re-scores the fused first `candidates`, as in `SearchIndex.search`.

The two indexes must hold the same texts under the same ids (build both from the same rows, ids and metadata);
a text one holds and the other does not, or holds with another text, is an error rather than a silent mix.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from kbert.data.features import text_list
from kbert.embed.index import Hit, SearchIndex, best_of_groups, positive_int, rerank_hits
from kbert.embed.sparse_index import SparseIndex, load_index

FUSIONS = ("zscore", "rrf")
RANK_CONSTANT = 60  # RRF's k: Cormack et al.'s value, the default of Elasticsearch and Qdrant


def hybrid_search(dense, sparse, queries, top_k: int = 10, weight: float = 0.5, fusion: str = "zscore",
                  candidates: int = 100, where=None, group_by: Optional[str] = None, reranker=None,
                  rank_constant: int = RANK_CONSTANT, batch_size: int = 16, ef_search: Optional[int] = None,
                  nprobe: Optional[int] = None, query_vectors=None):
    """The `top_k` texts of the fused dense + sparse ranking for each query, best first, as
    `Hit(id, score, text, metadata)` (the score is the fused one, or the reranker's). One query (a string) gives
    one list, several give a list per query.

    dense: a `kbert.SearchIndex` (or its dir); sparse: a `kbert.SparseIndex` (or its dir) of the same texts.
    weight: the sparse side's share, in [0, 1] (0.5: both alike).
    fusion: "zscore" (standardized scores added) or "rrf" (reciprocal ranks added); module docstring.
    candidates: how many texts each side proposes (and the reranker re-scores). More finds more of what only
        the fused score ranks high, at the cost of scoring more texts.
    where, group_by: as `SearchIndex.search`, applied by both sides (`group_by` again to the fused hits).
    reranker: a cross-encoder (`kbert.TaskModel`) that re-scores each query's first `candidates` fused hits.
    rank_constant: RRF's k (default 60).
    ef_search, nprobe: the dense side's search settings (an HNSW or IVF index), as `SearchIndex.search`.
    query_vectors: the queries already encoded, as `(dense, sparse)`: each index's `encode_queries` of the texts
        (`kbert serve` encodes them in its batches); by default both indexes encode them here.
    """
    dense, sparse = _index(dense, "dense", SearchIndex), _index(sparse, "sparse", SparseIndex)
    if len(dense) != len(sparse):
        raise ValueError(f"the two indexes hold different collections: {len(dense)} texts in the dense one, "
                         f"{len(sparse)} in the sparse one; build both from the same texts and ids")
    if fusion not in FUSIONS:
        raise ValueError(f"`fusion` must be one of {FUSIONS}. Received: fusion={fusion!r}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight <= 1:
        raise ValueError(f"`weight` must be a number in [0, 1]. Received: weight={weight!r}")
    top_k, candidates = positive_int(top_k, "top_k"), positive_int(candidates, "candidates")
    rank_constant = positive_int(rank_constant, "rank_constant")
    single = isinstance(queries, str)
    texts = text_list(queries)
    if query_vectors is None:
        query_vectors = dense.encode_queries(texts, batch_size), sparse.encode_queries(texts, batch_size)
    dense_vectors, sparse_vectors = np.atleast_2d(np.asarray(query_vectors[0])), query_vectors[1]
    if dense_vectors.shape[0] != len(texts) or sparse_vectors.shape[0] != len(texts):
        raise ValueError(f"`query_vectors` must hold one dense and one sparse vector per query ({len(texts)}); "
                         f"received {dense_vectors.shape[0]} and {sparse_vectors.shape[0]}")
    depth = max(top_k, candidates)
    options = dict(top_k=depth, where=where, group_by=group_by)
    dense_hits = dense.search(texts, query_vectors=dense_vectors, ef_search=ef_search, nprobe=nprobe, **options)
    sparse_hits = sparse.search(texts, query_vectors=sparse_vectors, **options)
    out = []
    for q, text in enumerate(texts):
        if fusion == "zscore":
            hits = _zscore(dense, sparse, dense_vectors[q], sparse_vectors[q], dense_hits[q], sparse_hits[q],
                           float(weight))
        else:
            hits = _rrf(dense, sparse, dense_hits[q], sparse_hits[q], float(weight), rank_constant)
        if group_by is not None:
            hits = best_of_groups(hits, group_by)
        hits = hits[:depth]
        if reranker is not None:
            hits = rerank_hits(text, hits, reranker, candidates)
        out.append(hits[:top_k])
    return out[0] if single else out


def _index(index, side: str, kind):
    if isinstance(index, str):
        index = load_index(index)
    if not isinstance(index, kind):
        raise TypeError(f"the {side} side must be a kbert.{kind.__name__} (or its dir); received a "
                        f"{type(index).__name__}")
    return index


def _union(dense, sparse, dense_hits: List[Hit], sparse_hits: List[Hit]) -> List[Hit]:
    """The hits of both lists once each (the dense list's order, then the sparse list's new ones), after checking
    that each text one side proposed is the same text in the other."""
    dense_ids, sparse_ids = {h.id: h.text for h in dense_hits}, {h.id: h.text for h in sparse_hits}
    for hit in sparse_hits:
        if dense_ids.get(hit.id, hit.text) != hit.text:
            raise ValueError(f"the two indexes hold different texts under id {hit.id!r}; build both from the same "
                             f"texts and ids")
    _check_held(sparse, "sparse", [h for h in dense_hits if h.id not in sparse_ids])
    _check_held(dense, "dense", [h for h in sparse_hits if h.id not in dense_ids])
    return dense_hits + [h for h in sparse_hits if h.id not in dense_ids]


def _check_held(index, side: str, hits: List[Hit]) -> None:
    try:
        positions = index.positions_of([h.id for h in hits])
    except KeyError as e:
        raise ValueError(f"the two indexes hold different collections: {e.args[0]} of the {side} one; build both "
                         f"from the same texts and ids") from None
    for hit, position in zip(hits, positions):
        if index.get(int(position)).text != hit.text:
            raise ValueError(f"the two indexes hold different texts under id {hit.id!r}; build both from the same "
                             f"texts and ids")


def _standardized(scores: np.ndarray) -> np.ndarray:
    spread = scores.std()
    return (scores - scores.mean()) / spread if spread > 0 else np.zeros_like(scores)


def _zscore(dense, sparse, dense_vector, sparse_vector, dense_hits, sparse_hits, weight) -> List[Hit]:
    union = _union(dense, sparse, dense_hits, sparse_hits)
    if not union:
        return []
    ids = [h.id for h in union]
    cosine = dense.similarities(dense_vector, ids).astype(np.float64)
    dot = sparse.similarities(sparse_vector, ids).astype(np.float64)
    fused = (1 - weight) * _standardized(cosine) + weight * _standardized(dot)
    order = np.argsort(-fused, kind="stable")  # ties keep the union's order
    return [union[i]._replace(score=float(fused[i])) for i in order]


def _rrf(dense, sparse, dense_hits, sparse_hits, weight, rank_constant) -> List[Hit]:
    union = _union(dense, sparse, dense_hits, sparse_hits)
    fused = dict.fromkeys((h.id for h in union), 0.0)
    for share, hits in ((1 - weight, dense_hits), (weight, sparse_hits)):
        for rank, hit in enumerate(hits, 1):
            fused[hit.id] += 2 * share / (rank_constant + rank)
    order = sorted(range(len(union)), key=lambda i: -fused[union[i].id])  # stable: ties keep the union's order
    return [union[i]._replace(score=fused[union[i].id]) for i in order]
