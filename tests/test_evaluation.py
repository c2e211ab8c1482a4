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
    # a lone id is one document: a string is not its characters, position 0 is not "none"
    single = {f"q{i}": f"d{i * 4}" for i in range(13)}
    as_sets = kbert.evaluate_retrieval(st_dir, queries, corpus, {q: {d} for q, d in single.items()})
    assert kbert.evaluate_retrieval(st_dir, queries, corpus, single) == as_sets
    positions = [ids.index(single[f"q{i}"]) for i in range(13)]
    assert positions[0] == 0
    assert kbert.evaluate_retrieval(st_dir, [queries[f"q{i}"] for i in range(13)], list(corpus.values()),
                                    positions) == as_sets
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
    # a missing score (a NaN from a table's empty cell) would rank last and make up a figure: refused by position
    with pytest.raises(ValueError, match="2 are not, the first at position 3"):
        kbert.evaluate_sts(st_dir, s1, s2, scores[:3] + [float("nan"), float("inf")] + scores[5:])


def test_correlations_equal_scipy_and_are_nan_on_non_finite_scores():
    from scipy import stats

    from kbert.utils import pearson, spearman

    rng = np.random.default_rng(0)
    a, b = rng.normal(size=50), rng.normal(size=50)
    b[::5] = a[::5]  # some correlation, and ties in the ranks below
    tied = np.round(b, 1)
    assert pearson(a, b) == pytest.approx(stats.pearsonr(a, b)[0], abs=1e-12)
    assert spearman(a, tied) == pytest.approx(stats.spearmanr(a, tied)[0], abs=1e-12)
    # undefined: a NaN or an infinity on either side gives NaN, never a figure from where the ranks put them
    for bad in (np.nan, np.inf):
        broken = a.copy()
        broken[7] = bad
        assert np.isnan(pearson(broken, b)) and np.isnan(spearman(b, broken))
    # a constant side has no correlation: 0.0, so a model selection by the best figure still compares
    assert pearson(np.ones(5), np.arange(5)) == 0.0 and spearman(np.arange(5), np.ones(5)) == 0.0


def test_pair_classification_figures_equal_sentence_transformers_binary_classification_evaluator(st_dir):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import BinaryClassificationEvaluator

    lines = [line.strip() for line in read_corpus(["kolaw"]).texts() if len(line.strip()) > 10][:60]
    # a third of the pairs a text with its own start (similar), the rest two unrelated lines
    s1 = lines[:30]
    s2 = [line[:len(line) // 2] if i % 3 == 0 else lines[30 + i] for i, line in enumerate(s1)]
    labels = [1 if i % 3 == 0 else 0 for i in range(30)]
    labels[1] = 1  # one positive the vectors should miss
    model = SentenceTransformer(st_dir, device="cpu")
    theirs = BinaryClassificationEvaluator(s1, s2, labels, write_csv=False,
                                           similarity_fn_names=["cosine", "dot", "euclidean", "manhattan"])
    theirs = theirs.compute_metrics(model)
    for similarity in ("cosine", "dot", "euclidean", "manhattan"):
        ours = kbert.evaluate_pair_classification(st_dir, s1, s2, labels, similarity=similarity)
        assert ours["pairs"] == 30
        assert set(ours) - {"pairs"} == set(theirs[similarity]), similarity
        for name, value in theirs[similarity].items():
            # float32 vectors on both sides: thresholds agree to 1e-5, the counted figures exactly
            assert ours[name] == pytest.approx(float(value), abs=1e-5), (similarity, name)
    cosine = kbert.evaluate_pair_classification(st_dir, s1, s2, labels)
    assert 0 < cosine["ap"] <= 1 and 0 < cosine["f1"] <= 1 and -1 <= cosine["f1_threshold"] <= 1

    # bools as labels; a mislabelled or one-sided set is refused by name
    flags = [bool(v) for v in labels]
    assert kbert.evaluate_pair_classification(st_dir, s1, s2, flags)["ap"] == pytest.approx(cosine["ap"])
    with pytest.raises(ValueError, match="1 or 0.*2"):
        kbert.evaluate_pair_classification(st_dir, s1, s2, [2] + labels[1:])
    with pytest.raises(ValueError, match="both kinds"):
        kbert.evaluate_pair_classification(st_dir, s1, s2, [0] * 30)
    with pytest.raises(ValueError, match="differ in length"):
        kbert.evaluate_pair_classification(st_dir, s1, s2[:4], labels)
    with pytest.raises(ValueError, match="similarity"):
        kbert.evaluate_pair_classification(st_dir, s1, s2, labels, similarity="jaccard")


def test_pair_classification_ties_and_average_precision_against_scikit_learn():
    """The thresholds on tied scores, and AP / MCC on random scores, against scikit-learn's definitions."""
    from sklearn.metrics import average_precision_score, matthews_corrcoef

    from kbert.utils import pair_classification_figures

    rng = np.random.default_rng(0)
    for trial in range(20):
        scores = np.round(rng.normal(size=50), 1 if trial % 2 else 4).astype(np.float32)  # ties on odd trials
        labels = (rng.random(50) < 0.4).astype(np.int64)
        labels[:2] = [0, 1]
        out = pair_classification_figures(scores, labels)
        assert out["ap"] == pytest.approx(average_precision_score(labels, scores), abs=1e-9)
        predicted = scores >= np.float32(out["f1_threshold"])
        assert out["mcc"] == pytest.approx(matthews_corrcoef(labels, predicted), abs=1e-9)
        # the accuracy threshold reproduces the accuracy; no other cut does better
        assert np.mean((scores >= np.float32(out["accuracy_threshold"])) == labels) == pytest.approx(out["accuracy"])
        cuts = np.concatenate([np.unique(scores), [np.inf]])
        assert max(np.mean((scores >= c) == labels) for c in cuts) == pytest.approx(out["accuracy"])


def test_the_evaluate_command_prints_the_figures_of_each_task(st_dir, tmp_path, capsys):
    """`kbert evaluate`: the same figures as the Python functions, from a labelled file."""
    import json

    from kbert.cli import main

    lines = [line.strip() for line in read_corpus(["kolaw"]).texts() if len(line.strip()) > 10][:40]
    s1, s2 = lines[:20], [line[:len(line) // 2] if i % 2 else lines[20 + i] for i, line in enumerate(lines[:20])]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"a": a, "b": b, "score": i % 6, "same": "예" if i % 2 else "아니오"},
                                       ensure_ascii=False) + "\n" for i, (a, b) in enumerate(zip(s1, s2))),
                    encoding="utf-8")
    common = ["evaluate", "--model", st_dir, "--data", str(path), "--text-column", "a", "--pair-column", "b"]

    def run(*extra):
        assert main(common + list(extra)) == 0
        return json.loads(capsys.readouterr().out)

    sts = run("--label-column", "score")
    assert sts["task"] == "sts" and sts["rows"] == 20
    assert sts["spearman"] == pytest.approx(kbert.evaluate_sts(st_dir, s1, s2, [i % 6 for i in range(20)])["spearman"])
    pairs = run("--task", "pair-classification", "--label-column", "same", "--positive-label", "예")
    assert pairs["ap"] == pytest.approx(kbert.evaluate_pair_classification(
        st_dir, s1, s2, [i % 2 for i in range(20)])["ap"])
    found = run("--task", "retrieval")
    assert found["corpus"] == 20 and found["queries"] == 20
    assert found["ndcg@10"] == pytest.approx(kbert.evaluate_retrieval(
        st_dir, s1, s2, [{i} for i in range(20)])["ndcg@10"])
    assert main(common + ["--lexical", "0.5"]) == 1  # lexical goes with retrieval only
    assert "--task retrieval" in capsys.readouterr().err
