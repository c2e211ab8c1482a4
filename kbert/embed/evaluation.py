"""How good a sentence model's vectors are, by the numbers sentence-transformers' evaluators print, so a figure
measured with kbert reads the same as one on a model card or a Korean retrieval leaderboard (Ko-StrategyQA,
AutoRAG, MTEB's Korean tasks report nDCG@10):

    evaluate_retrieval(model, queries, corpus, relevant_docs)   # InformationRetrievalEvaluator's metrics
    evaluate_sts(model, sentences1, sentences2, scores)         # EmbeddingSimilarityEvaluator's cosine figures

Retrieval runs `Embedder.search` (so the model's query / document prompts, hybrid `lexical` search and a
cross-encoder `reranker` are measured as they are used) and scores the ranked hits with the formulas of
sentence-transformers' InformationRetrievalEvaluator: binary relevance; accuracy@k (a relevant document in the
first k), precision@k, recall@k, MRR@k, nDCG@k (ideal DCG over min(relevant, k) documents) and MAP@k (divided by
min(k, relevant)); queries without a relevant document are left out, as there. Tests compare every figure
with sentence-transformers' on the same model.
"""

from __future__ import annotations

from typing import Dict, Iterable, Sequence

import numpy as np

from kbert.data.features import text_list
from kbert.utils import pearson, spearman


def _embedder(model):
    from kbert.embed.embedder import Embedder

    return model if isinstance(model, Embedder) else Embedder.load(model)


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
        relevant_docs: {query id: the ids of its relevant documents} (or for list queries, a list of them).
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
        relevant = {q: set(relevant_docs.get(q) or ()) for q in query_ids}
    else:
        relevant_docs = list(relevant_docs)
        if len(relevant_docs) != len(query_ids):
            raise ValueError(f"`relevant_docs` has {len(relevant_docs)} entries for {len(query_ids)} queries")
        relevant = {q: set(r or ()) for q, r in zip(query_ids, relevant_docs)}
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
    hits = _embedder(model).search([query_texts[i] for i in kept], corpus_texts, top_k=depth, lexical=lexical,
                                   reranker=reranker, candidates=candidates, **encode_options)
    totals = {f"{name}@{k}": 0.0 for name, key in (("accuracy", "accuracy_at_k"), ("precision", "precision_recall_at_k"),
                                                   ("recall", "precision_recall_at_k"), ("mrr", "mrr_at_k"),
                                                   ("ndcg", "ndcg_at_k"), ("map", "map_at_k")) for k in ks[key]}
    for i, row in zip(kept, hits):
        wanted = relevant[query_ids[i]]
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
    out = {name: float(value / len(kept)) for name, value in totals.items()}
    out["queries"] = len(kept)
    return out


def evaluate_sts(model, sentences1: Sequence[str], sentences2: Sequence[str], scores: Sequence[float],
                 batch_size: int = 64, **encode_options) -> Dict[str, float]:
    """Pearson and Spearman correlation of the cosine of each pair's vectors with its gold `scores` (KorSTS'
    0-5), as sentence-transformers' EmbeddingSimilarityEvaluator reports them ("pearson_cosine",
    "spearman_cosine"; here "pearson", "spearman"). Encode options (`prompt_name`, `pooling`, ...) as
    `Embedder.encode`."""
    sentences1, sentences2 = text_list(sentences1), text_list(sentences2)
    gold = np.asarray(list(scores), np.float64)
    if not (len(sentences1) == len(sentences2) == len(gold)):
        raise ValueError(f"`sentences1`, `sentences2` and `scores` differ in length: {len(sentences1)}, "
                         f"{len(sentences2)}, {len(gold)}")
    if len(gold) < 2:
        raise ValueError("a correlation needs at least 2 scored pairs")
    emb = _embedder(model)
    options = dict(batch_size=batch_size, normalize=True, **encode_options)
    a = emb.encode(sentences1, **options)
    b = emb.encode(sentences2, **options)
    cosine = np.sum(np.asarray(a, np.float64) * np.asarray(b, np.float64), axis=1)
    return {"pearson": float(pearson(cosine, gold)), "spearman": float(spearman(cosine, gold)), "pairs": len(gold)}
