"""How good a sentence model's vectors are, by the numbers sentence-transformers' evaluators print, so a figure
measured with kbert reads the same as one on a model card or a Korean retrieval leaderboard (Ko-StrategyQA,
AutoRAG, MTEB's Korean tasks report nDCG@10):

    evaluate_retrieval(model, queries, corpus, relevant_docs)   # InformationRetrievalEvaluator's metrics
    evaluate_sts(model, sentences1, sentences2, scores)         # EmbeddingSimilarityEvaluator's cosine figures
    evaluate_pair_classification(model, sentences1, sentences2, labels)  # BinaryClassificationEvaluator's

Retrieval runs `Embedder.search` (so the model's query / document prompts, hybrid `lexical` search and a
cross-encoder `reranker` are measured as they are used) and scores the ranked hits with the formulas of
sentence-transformers' InformationRetrievalEvaluator: binary relevance; accuracy@k (a relevant document in the
first k), precision@k, recall@k, MRR@k, nDCG@k (ideal DCG over min(relevant, k) documents) and MAP@k (divided by
min(k, relevant)); queries without a relevant document are left out, as there.

Pair classification (paraphrase or not, duplicate question or not: the Korean question-pair set, PAWS-X) reads a
similarity as a yes/no score with the thresholds sentence-transformers' BinaryClassificationEvaluator picks:
the best accuracy, the best F1 (with its precision and recall), average precision over every threshold and
Matthews' correlation at the F1 threshold. Written here in NumPy rather than through scikit-learn's metrics, so
evaluating needs no optional dependency. Tests compare every figure with sentence-transformers' on the same model.

A `kbert.SparseEncoder` (SPLADE; a sentence-transformers SparseEncoder dir is recognised by its files) is measured
by the same three functions, as sentence-transformers' Sparse*Evaluator measure it: retrieval ranks by the
vectors' dot products and adds what an inverted index of them costs (`query_active_dims`, `corpus_active_dims`,
their sparsity ratios and `avg_flops`, the expected number of weight products per query-document pair); STS adds
the dot-product correlations; pair classification scores by dot product unless `similarity` says otherwise.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Sequence

import numpy as np

from kbert.data.features import text_list
from kbert.utils import pair_classification_figures, pearson, spearman, unit_rows


def _embedder(model):
    """`model` as an `Embedder` or, for a SPLADE model (a `SparseEncoder`, a sentence-transformers SparseEncoder
    dir or its ONNX export), a `SparseEncoder`."""
    from kbert.embed.embedder import Embedder
    from kbert.embed.sparse import SparseEncoder, is_sparse_model

    if isinstance(model, (Embedder, SparseEncoder)):
        return model
    if is_sparse_model(model):
        return SparseEncoder.load(model)
    return Embedder.load(model)


def _is_sparse(model) -> bool:
    from kbert.embed.sparse import SparseEncoder  # imports no Keras: a static model evaluates on a host without it

    return isinstance(model, SparseEncoder)


def _pair_sparsity(encoder, a, b) -> dict:
    """`encoder.sparsity` over both sides' CSR vectors: sentence-transformers' sparse evaluators count the active
    dimensions of every vector of the pairs together."""
    from scipy.sparse import vstack  # scipy.sparse only where a SPLADE model is measured

    return encoder.sparsity(vstack([a, b]))


def _ks(values, name) -> list:
    values = [values] if isinstance(values, int) else list(values or [])
    if any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in values):
        raise ValueError(f"`{name}` must hold positive integers. Received: {name}={values!r}")
    return sorted(set(values))


def _as_ids(items, name):
    """(ids, texts) of a {id: text} dict or a list of texts (ids: their positions)."""
    if isinstance(items, dict):
        ids = list(items)
        return ids, text_list([items[i] for i in ids])
    texts = text_list(items)
    return list(range(len(texts))), texts


def evaluate_retrieval(model, queries, corpus, relevant_docs, accuracy_at_k: Iterable[int] = (1, 3, 5, 10),
                       precision_recall_at_k: Iterable[int] = (1, 3, 5, 10), mrr_at_k: Iterable[int] = (10,),
                       ndcg_at_k: Iterable[int] = (10,), map_at_k: Iterable[int] = (100,), lexical: float = 0.0,
                       reranker=None, candidates: int = 100, **encode_options) -> Dict[str, float]:
    """Retrieval metrics of `model` (an `Embedder`, a model dir or a Hub name) on a labelled search set.

    Args:
        queries: {query id: text} (sentence-transformers' form) or a list of texts (ids: their positions).
        corpus: {document id: text} or a list of texts.
        relevant_docs: {query id: the ids of its relevant documents} (or for list queries, a list of them); a
            lone id stands for one document.
        accuracy_at_k ... map_at_k: the cut-offs of each metric (sentence-transformers' defaults).
        lexical, reranker, candidates, encode options (`batch_size`, `prompt_name`, ...): as `Embedder.search`
            (a reranker re-scores each query's first `candidates` hits; deeper ranks keep the search's order, so
            recall@k for k >= candidates is the first stage's).

    Returns:
        {"accuracy@1": ..., "precision@1": ..., "recall@1": ..., "mrr@10": ..., "ndcg@10": ..., "map@100": ...,
        "queries": number evaluated}, each metric the mean over the queries that have a relevant document.

    Example:
        >>> kbert.evaluate_retrieval("my-e5", {"q1": "헌법 개정 절차"}, {"d1": "...", "d2": "..."}, {"q1": {"d1"}})
    """
    ks = {name: _ks(values, name) for name, values in (
        ("accuracy_at_k", accuracy_at_k), ("precision_recall_at_k", precision_recall_at_k),
        ("mrr_at_k", mrr_at_k), ("ndcg_at_k", ndcg_at_k), ("map_at_k", map_at_k))}
    query_ids, query_texts = _as_ids(queries, "queries")
    corpus_ids, corpus_texts = _as_ids(corpus, "corpus")
    if isinstance(relevant_docs, dict):
        relevant = {q: _id_set(relevant_docs.get(q)) for q in query_ids}
    else:
        relevant_docs = list(relevant_docs)
        if len(relevant_docs) != len(query_ids):
            raise ValueError(f"`relevant_docs` has {len(relevant_docs)} entries for {len(query_ids)} queries")
        relevant = {q: _id_set(r) for q, r in zip(query_ids, relevant_docs)}
    known = set(corpus_ids)
    unknown = sorted({str(d) for q in query_ids for d in relevant[q] if d not in known})
    if unknown:
        raise ValueError(f"`relevant_docs` names documents that are not in the corpus: {unknown[:5]}")
    kept = [i for i, q in enumerate(query_ids) if relevant[q]]
    if not kept:
        raise ValueError("no query has a relevant document in `relevant_docs`: nothing to evaluate")
    if not corpus_texts:
        raise ValueError("the corpus is empty")
    depth = max(k for values in ks.values() for k in values)
    emb = _embedder(model)
    queries_kept = [query_texts[i] for i in kept]
    if _is_sparse(emb):
        if lexical or reranker is not None:
            raise ValueError("a SparseEncoder ranks by its own dot products: `lexical` and `reranker` go with a "
                             "dense Embedder")
        q = emb.encode_query(queries_kept, **encode_options)
        d = emb.encode_document(corpus_texts, **encode_options)
        out = _retrieval_figures(emb.search(q, d, top_k=depth), [query_ids[i] for i in kept], corpus_ids,
                                 relevant, ks, depth)
        out.update(sparse_costs(q, d))
        return out
    hits = emb.search(queries_kept, corpus_texts, top_k=depth, lexical=lexical, reranker=reranker,
                      candidates=candidates, **encode_options)
    return _retrieval_figures(hits, [query_ids[i] for i in kept], corpus_ids, relevant, ks, depth)


def _id_set(value) -> set:
    """A query's relevant documents as a set of ids: None is none, and a lone id (a string, or a list corpus'
    position, 0 included) is that one document, not its characters or nothing."""
    if value is None:
        return set()
    if isinstance(value, (str, bytes, int, np.integer)):
        return {value}
    return set(value)


def _retrieval_figures(hits, query_ids, corpus_ids, relevant, ks, depth) -> Dict[str, float]:
    """InformationRetrievalEvaluator's figures of ranked `hits` (per query, `(corpus position, score)` best
    first) for queries that each have a relevant document."""
    totals = {f"{name}@{k}": 0.0 for name, key in (("accuracy", "accuracy_at_k"), ("precision", "precision_recall_at_k"),
                                                   ("recall", "precision_recall_at_k"), ("mrr", "mrr_at_k"),
                                                   ("ndcg", "ndcg_at_k"), ("map", "map_at_k")) for k in ks[key]}
    for query, row in zip(query_ids, hits):
        wanted = relevant[query]
        found = np.array([corpus_ids[j] in wanted for j, _ in row], np.float64)  # [depth]: 1 where relevant
        first = int(np.argmax(found)) if found.any() else None
        for k in ks["accuracy_at_k"]:
            totals[f"accuracy@{k}"] += float(found[:k].any())
        for k in ks["precision_recall_at_k"]:
            totals[f"precision@{k}"] += found[:k].sum() / k
            totals[f"recall@{k}"] += found[:k].sum() / len(wanted)
        for k in ks["mrr_at_k"]:
            totals[f"mrr@{k}"] += 1.0 / (first + 1) if first is not None and first < k else 0.0
        discount = 1.0 / np.log2(np.arange(depth) + 2)  # position i counts 1 / log2(i + 2)
        for k in ks["ndcg_at_k"]:
            ideal = discount[:min(len(wanted), k)].sum()
            totals[f"ndcg@{k}"] += float((found[:k] * discount[:len(found[:k])]).sum() / ideal)
        for k in ks["map_at_k"]:
            top = found[:k]
            precision_at_hits = np.cumsum(top) / np.arange(1, len(top) + 1)
            totals[f"map@{k}"] += float((precision_at_hits * top).sum() / min(k, len(wanted)))
    out = {name: float(value / len(query_ids)) for name, value in totals.items()}
    out["queries"] = len(query_ids)
    return out


def sparse_costs(queries, corpus) -> Dict[str, float]:
    """What searching `corpus` (CSR `[documents, vocab]`) with `queries` costs an inverted index: each side's mean
    active dimensions and share of zeros, and `avg_flops`, the dot product of the two sides' per-dimension
    shares of non-zero vectors (Paria et al. 2020; sentence-transformers' SparseInformationRetrievalEvaluator)."""
    from kbert.embed.sparse import SparseEncoder

    out = {}
    shares = []
    for side, matrix in (("query", queries), ("corpus", corpus)):
        for key, value in SparseEncoder.sparsity(matrix).items():
            out[f"{side}_{key}"] = value
        counts = np.bincount(matrix.indices[matrix.data != 0], minlength=matrix.shape[1])  # [vocab]
        shares.append(counts / max(matrix.shape[0], 1))
    out["avg_flops"] = float(np.dot(shares[0], shares[1]))
    return out


def evaluate_sts(model, sentences1: Sequence[str], sentences2: Sequence[str], scores: Sequence[float],
                 batch_size: int = 64, **encode_options) -> Dict[str, float]:
    """Pearson and Spearman correlation of the cosine of each pair's vectors with its gold `scores` (KorSTS'
    0-5), as sentence-transformers' EmbeddingSimilarityEvaluator reports them ("pearson_cosine",
    "spearman_cosine"; here "pearson", "spearman"). Encode options (`prompt_name`, `pooling`, ...) as
    `Embedder.encode`. A SparseEncoder's figures add those of the dot product ("pearson_dot", "spearman_dot": the
    score SPLADE is trained on) and its vectors' "active_dims" and "sparsity_ratio"."""
    sentences1, sentences2 = text_list(sentences1), text_list(sentences2)
    gold = np.asarray(list(scores), np.float64)
    if not (len(sentences1) == len(sentences2) == len(gold)):
        raise ValueError(f"`sentences1`, `sentences2` and `scores` differ in length: {len(sentences1)}, "
                         f"{len(sentences2)}, {len(gold)}")
    if len(gold) < 2:
        raise ValueError("a correlation needs at least 2 scored pairs")
    bad = np.flatnonzero(~np.isfinite(gold))
    if len(bad):
        raise ValueError(f"`scores` must be finite numbers; {len(bad)} are not, the first at position {bad[0]} "
                         f"({gold[bad[0]]}): drop those pairs or fill in their scores")
    emb = _embedder(model)
    if _is_sparse(emb):
        a = emb.encode(sentences1, batch_size=batch_size, **encode_options)
        b = emb.encode(sentences2, batch_size=batch_size, **encode_options)
        cosine, dot = sparse_pair_scores(a, b, "cosine"), sparse_pair_scores(a, b, "dot")
        return {"pearson": float(pearson(cosine, gold)), "spearman": float(spearman(cosine, gold)),
                "pearson_dot": float(pearson(dot, gold)), "spearman_dot": float(spearman(dot, gold)),
                **_pair_sparsity(emb, a, b), "pairs": len(gold)}
    options = dict(batch_size=batch_size, normalize=True, **encode_options)
    a = emb.encode(sentences1, **options)
    b = emb.encode(sentences2, **options)
    cosine = np.sum(np.asarray(a, np.float64) * np.asarray(b, np.float64), axis=1)
    return {"pearson": float(pearson(cosine, gold)), "spearman": float(spearman(cosine, gold)), "pairs": len(gold)}


PAIR_SIMILARITIES = ("cosine", "dot", "euclidean", "manhattan")


def evaluate_pair_classification(model, sentences1: Sequence[str], sentences2: Sequence[str], labels,
                                 similarity: Optional[str] = None, batch_size: int = 64,
                                 **encode_options) -> Dict[str, float]:
    """How well a similarity of each pair's vectors tells the pairs labelled 1 (paraphrases, duplicates) from
    those labelled 0, by sentence-transformers' BinaryClassificationEvaluator's figures.

    Args:
        sentences1, sentences2: the pairs' texts.
        labels: 1 / 0 (or True / False) per pair, both present.
        similarity: "cosine" (a dense model's default), "dot" (a SparseEncoder's default: SPLADE's score), or
            the distances "euclidean" and "manhattan" (a smaller distance is the more similar pair; their
            thresholds are distances). The last three read the vectors as `encode` returns them: unit length
            unless `normalize=False` is among the encode options (a SparseEncoder's are never normalized).
        batch_size, encode options (`prompt_name`, `pooling`, `truncate_dim`, `normalize`, ...): as
            `Embedder.encode`.

    Returns: {"accuracy", "accuracy_threshold", "f1", "f1_threshold", "precision", "recall", "ap", "mcc",
        "pairs"}: the best accuracy over every threshold and that threshold (a pair is predicted 1 when its
        similarity is at least it, or its distance at most it); the best F1, its threshold and the precision and
        recall there; the average precision of ranking the pairs by similarity; Matthews' correlation of the
        predictions at the F1 threshold. A SparseEncoder's add its vectors' "active_dims" and "sparsity_ratio".
    """
    if similarity is not None and similarity not in PAIR_SIMILARITIES:
        raise ValueError(f"`similarity` must be one of {PAIR_SIMILARITIES}. Received: similarity={similarity!r}")
    sentences1, sentences2 = text_list(sentences1), text_list(sentences2)
    gold = _binary_labels(labels)
    if not (len(sentences1) == len(sentences2) == len(gold)):
        raise ValueError(f"`sentences1`, `sentences2` and `labels` differ in length: {len(sentences1)}, "
                         f"{len(sentences2)}, {len(gold)}")
    emb = _embedder(model)
    options = dict(batch_size=batch_size, **encode_options)
    costs = {}
    if _is_sparse(emb):
        similarity = similarity or "dot"
        a, b = emb.encode(sentences1, **options), emb.encode(sentences2, **options)
        scores, costs = sparse_pair_scores(a, b, similarity), _pair_sparsity(emb, a, b)
    else:
        similarity = similarity or "cosine"
        a = np.asarray(emb.encode(sentences1, **options), np.float32)
        b = np.asarray(emb.encode(sentences2, **options), np.float32)
        scores = pair_scores(a, b, similarity)
    # a distance ranks the other way: classify its negation, then give the thresholds back as distances
    sign = 1.0 if similarity in ("cosine", "dot") else -1.0
    out = pair_classification_figures(sign * scores, gold)
    out["accuracy_threshold"] *= sign
    out["f1_threshold"] *= sign
    out.update(costs, pairs=len(gold))
    return out


def pair_scores(a: np.ndarray, b: np.ndarray, similarity: str) -> np.ndarray:
    """Row-wise `similarity` of two `[pairs, dim]` float32 arrays (a distance for euclidean / manhattan)."""
    if similarity == "cosine":
        return np.sum(unit_rows(a) * unit_rows(b), axis=1)
    if similarity == "dot":
        return np.sum(a * b, axis=1)
    if similarity == "euclidean":
        return np.sqrt(np.sum((a - b) ** 2, axis=1))
    return np.sum(np.abs(a - b), axis=1)


def sparse_pair_scores(a, b, similarity: str) -> np.ndarray:
    """`pair_scores` of two `[pairs, vocab]` CSR matrices, row by row, without densifying them (float64)."""
    dot = np.asarray(a.multiply(b).sum(axis=1), np.float64).ravel()
    if similarity == "dot":
        return dot
    if similarity == "cosine":
        norms = np.sqrt(np.asarray(a.multiply(a).sum(axis=1), np.float64).ravel()
                        * np.asarray(b.multiply(b).sum(axis=1), np.float64).ravel())
        return np.divide(dot, norms, out=np.zeros_like(dot), where=norms > 0)  # an empty vector scores 0
    diff = (a - b).tocsr()
    if similarity == "euclidean":
        return np.sqrt(np.asarray(diff.multiply(diff).sum(axis=1), np.float64).ravel())
    return np.asarray(abs(diff).sum(axis=1), np.float64).ravel()


def _binary_labels(labels) -> np.ndarray:
    values = np.asarray(list(labels))
    if values.dtype == bool:
        values = values.astype(np.int64)
    if values.size == 0 or not np.all(np.isin(values, (0, 1))):
        bad = sorted({repr(v) for v in values.tolist() if v not in (0, 1)})[:5]
        raise ValueError("`labels` must be 1 or 0 for each pair (True / False allowed)"
                         + (f". Received: {', '.join(bad)}" if bad else ": none given"))
    values = values.astype(np.int64)
    if values.min() == values.max():
        raise ValueError(f"`labels` are all {int(values[0])}: pair classification needs pairs of both kinds")
    return values
