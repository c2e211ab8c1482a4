"""`kbert.evaluate_retrieval` / `kbert.evaluate_sts`: every figure equals sentence-transformers' evaluators on the
same model (an E5-style XLM-RoBERTa dir with query / passage prompts)."""

import numpy as np
import pytest

import kbert
from kbert.data.corpus import corpus as read_corpus

from helpers import xlmr_dir


@pytest.fixture(scope="module")
def st_dir(tmp_path_factory):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    root = tmp_path_factory.mktemp("evaluation")
    st = SentenceTransformer(modules=[Transformer(xlmr_dir(root), max_seq_length=48), Pooling(32, pooling_mode="mean"),
                                      Normalize()], device="cpu", prompts={"query": "query: ", "passage": "passage: "})
    out = str(root / "st")
    st.save(out)
    return out


def _search_set():
    lines = [line.strip() for line in read_corpus(["kolaw"]).texts() if len(line.strip()) > 20][:60]
    corpus = {f"d{i}": line for i, line in enumerate(lines)}
    queries = {f"q{i}": lines[i * 4][:14] for i in range(14)}  # the start of a document as its query
    relevant = {f"q{i}": {f"d{i * 4}"} | ({f"d{i * 4 + 1}", f"d{i * 4 + 2}"} if i % 3 == 0 else set())
                for i in range(13)}  # q13 has none: left out, as sentence-transformers leaves it
    return queries, corpus, relevant


def test_retrieval_metrics_equal_sentence_transformers_information_retrieval_evaluator(st_dir):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    queries, corpus, relevant = _search_set()
    ours = kbert.evaluate_retrieval(st_dir, queries, corpus, relevant, precision_recall_at_k=[1, 3, 5, 10, 20],
                                    ndcg_at_k=[5, 10], map_at_k=[10, 100])
    theirs = InformationRetrievalEvaluator(queries, corpus, relevant, precision_recall_at_k=[1, 3, 5, 10, 20],
                                           ndcg_at_k=[5, 10], map_at_k=[10, 100], write_csv=False)(
        SentenceTransformer(st_dir, device="cpu"))
    assert ours["queries"] == 13
    names = {k[len("cosine_"):] for k in theirs if k.startswith("cosine_")}
    assert names == set(ours) - {"queries"}
    for name in names:
        assert ours[name] == pytest.approx(theirs["cosine_" + name], abs=1e-6), name
    assert 0 < ours["ndcg@10"] < 1 and ours["recall@20"] > ours["recall@1"]
    # lists instead of dicts; the prompts matter (without them, other figures)
    ids = list(corpus)
    listed = kbert.evaluate_retrieval(st_dir, [queries[f"q{i}"] for i in range(13)], list(corpus.values()),
                                      [{ids.index(d) for d in relevant[f"q{i}"]} for i in range(13)])
    assert listed["ndcg@10"] == pytest.approx(ours["ndcg@10"], abs=1e-9)
    with pytest.raises(ValueError, match="not in the corpus"):
        kbert.evaluate_retrieval(st_dir, queries, corpus, {"q0": {"d999"}})
    with pytest.raises(ValueError, match="no query"):
        kbert.evaluate_retrieval(st_dir, queries, corpus, {})
    with pytest.raises(ValueError, match="positive integers"):
        kbert.evaluate_retrieval(st_dir, queries, corpus, relevant, ndcg_at_k=[0])


def test_sts_figures_equal_sentence_transformers_embedding_similarity_evaluator(st_dir):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    lines = [line.strip() for line in read_corpus(["kolaw"]).texts() if len(line.strip()) > 10][:40]
    s1, s2 = lines[:20], lines[20:40]
    scores = [float(i % 6) for i in range(20)]
    ours = kbert.evaluate_sts(st_dir, s1, s2, scores)
    theirs = EmbeddingSimilarityEvaluator(s1, s2, scores, write_csv=False)(SentenceTransformer(st_dir, device="cpu"))
    # float32 vectors on both sides, the cosines summed in another order: agreement to 1e-5
    assert ours["spearman"] == pytest.approx(theirs["spearman_cosine"], abs=1e-5)
    assert ours["pearson"] == pytest.approx(theirs["pearson_cosine"], abs=1e-5)
    with pytest.raises(ValueError, match="differ in length"):
        kbert.evaluate_sts(st_dir, s1, s2[:3], scores)
