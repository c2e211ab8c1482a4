"""Fine-tuning (all tasks), the string-in SavedModel export, and bad input to the embedding API.

The learning tests use real Korean data from ../shared/data (NSMC-style movie-review sentiment, KorSTS,
question pairs) and a small randomly initialized model, so they check that training learns, not a score.
"""

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest

import kbert
from kbert.data.recipes import movie_review_sentiment
from kbert.train.finetune_tasks import Examples, cosent_loss, epoch_batches, online_contrastive_loss
from kbert.train.metrics import pearson, rank, spearman
from helpers import SHARED, HeldDir, needs_shared

pytestmark = needs_shared
REVIEWS = os.path.join(SHARED, "movie-reviews")
KORSTS = os.path.join(SHARED, "korsts")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tokenizer learned on reviews and KorSTS, and a random 2-layer BERT (hidden 64) as a model dir."""
    texts = [r["text"] for r in movie_review_sentiment(REVIEWS, "train", limit=20000, seed=1)]
    with open(os.path.join(KORSTS, "sts-train.tsv"), encoding="utf-8") as f:
        texts += [c for line in f for c in line.rstrip("\n").split("\t")[5:7]]
    tok = kbert.Tokenizer.train(texts, vocab_size=3000, progress=False)
    cfg = kbert.ModelConfig.preset("bert-tiny", vocab_size=tok.vocab_size, hidden_size=64, num_heads=2,
                                   intermediate_size=128, max_position=128)
    path = str(tmp_path_factory.mktemp("base"))
    kbert.save_model(kbert.BertBackbone(cfg), path, tokenizer=tok)
    return path


@pytest.fixture(scope="module")
def sentiment(base, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sentiment"))
    train = movie_review_sentiment(REVIEWS, "train", limit=4000)
    dev = movie_review_sentiment(REVIEWS, "dev", limit=1000)
    summary = kbert.finetune(base, "classification", train, dev, out_dir=out, epochs=3, learning_rate=1e-3,
                             max_length=64, progress=False)
    return out, summary, dev


@pytest.fixture(scope="module")
def sts(base, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sts"))
    summary = kbert.finetune(base, "sentence-embedding", os.path.join(KORSTS, "sts-train.tsv"),
                             os.path.join(KORSTS, "sts-dev.tsv"), out_dir=out, text_column="sentence1",
                             pair_column="sentence2", label_column="score", epochs=2, learning_rate=5e-4,
                             max_length=64, progress=False)
    return out, summary


@pytest.mark.slow
def test_sentiment_finetuning_beats_the_majority_class(sentiment):
    out, summary, dev = sentiment
    assert summary["baseline"]["accuracy"] == pytest.approx(0.5, abs=0.02)  # balanced dev: majority = 50%
    assert summary["best"] >= 0.68, summary["history"]
    assert summary["metric"] == "accuracy" and summary["labels"] == ["0", "1"]
    assert len(summary["history"]) == 3 and all("dev_macro_f1" in h for h in summary["history"])
    # The saved dir is the best checkpoint: reloading reproduces the best dev accuracy.
    model = kbert.TaskModel.load(out)
    probs = model.predict([r["text"] for r in dev])
    assert probs.shape == (len(dev), 2) and np.allclose(probs.sum(axis=1), 1, atol=1e-5)
    accuracy = np.mean(np.argmax(probs, axis=1) == np.array([int(r["label"]) for r in dev]))
    assert accuracy == pytest.approx(summary["best"], abs=1e-6)
    assert model.predict("정말 재밌고 감동적인 영화").shape == (2,)
    assert kbert.Embedder.load(out).encode("영화").shape == (64,)  # also an ordinary model dir
    for bad in (0, -4, 2.0):  # an error naming the argument (0 made `range` raise one that did not)
        with pytest.raises(ValueError, match="`batch_size` must be a positive integer"):
            model.predict(["영화"], batch_size=bad)
        with pytest.raises(ValueError, match="`batch_size` must be a positive integer"):
            model.zero_shot("영화", ["좋음", "나쁨"], batch_size=bad)


@pytest.mark.slow
def test_sts_bi_encoder_raises_dev_spearman(sts):
    out, summary = sts
    assert summary["metric"] == "spearman"
    assert summary["best"] > summary["baseline"]["spearman"] + 0.05, (summary["baseline"], summary["history"])
    emb = kbert.Embedder.load(out)
    with open(os.path.join(KORSTS, "sts-dev.tsv"), encoding="utf-8") as f:
        rows = [line.rstrip("\n").split("\t") for line in f][1:]
    a = emb.encode([r[5] for r in rows])
    b = emb.encode([r[6] for r in rows])
    # Embedder.encode (mean pooling) gives the vectors the bi-encoder was selected with.
    assert spearman(np.sum(a * b, axis=1), [float(r[4]) for r in rows]) == pytest.approx(summary["best"], abs=1e-4)


@pytest.mark.slow
def test_cosent_loss_against_a_double_loop_and_in_training(base, tmp_path):
    rng = np.random.default_rng(0)
    cos, scores = rng.uniform(-1, 1, 12), rng.integers(0, 6, 12).astype(float)  # integer scores: ties
    expected = np.log1p(sum(np.exp(20 * (cos[j] - cos[i])) for i in range(12) for j in range(12)
                            if scores[i] > scores[j]))
    got = float(cosent_loss(np.float32(cos), scores))
    assert got == pytest.approx(expected, rel=1e-5)
    ordered = np.empty(12, np.float32)  # cosines in the scores' order cost little, the reverse order a lot
    ordered[np.argsort(scores, kind="stable")] = np.linspace(-1, 1, 12)
    assert float(cosent_loss(ordered, scores)) < 0.5 < got < float(cosent_loss(-ordered, scores))
    # Trained with it, the bi-encoder learns KorSTS as cosine regression does.
    summary = kbert.finetune(base, "sentence-embedding", os.path.join(KORSTS, "sts-train.tsv"),
                             os.path.join(KORSTS, "sts-dev.tsv"), out_dir=str(tmp_path / "cosent"),
                             text_column="sentence1", pair_column="sentence2", label_column="score", epochs=1,
                             learning_rate=5e-4, max_length=64, progress=False, similarity_loss="cosent")
    assert summary["best"] > summary["baseline"]["spearman"] + 0.05, (summary["baseline"], summary["history"])
    with pytest.raises(ValueError, match="`similarity_loss` must be one of"):
        kbert.finetune(base, "sentence-embedding", [], similarity_loss="mse", progress=False)


def test_online_contrastive_loss_equals_sentence_transformers_and_trains_on_paraphrase_labels(base, tmp_path):
    import torch
    from sentence_transformers.sentence_transformer.losses import OnlineContrastiveLoss

    rng = np.random.default_rng(0)
    reference = OnlineContrastiveLoss(torch.nn.Identity())  # the model is not called: vectors are given
    for labels in ([1, 0, 1, 1, 0, 0, 1, 0, 1, 0, 0, 1], [1] * 12, [0] * 12, [1] + [0] * 11):
        a, b = rng.normal(size=(12, 16)).astype(np.float32), rng.normal(size=(12, 16)).astype(np.float32)
        b[:4] = a[:4] + 0.3 * b[:4]  # some close pairs, so the hard sets are neither empty nor everything
        expected = float(reference.compute_loss_from_embeddings([torch.tensor(a), torch.tensor(b)],
                                                                torch.tensor(labels)))
        cos = np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        assert float(online_contrastive_loss(cos.astype(np.float32), np.array(labels))) == \
            pytest.approx(expected, rel=1e-5, abs=1e-6), labels

    # question pairs labelled paraphrase (1) or not (0): the dev set is scored by average precision
    def rows(name):
        with open(os.path.join(SHARED, "question-pair", name), encoding="utf-8-sig") as f:
            header, *lines = [line.rstrip("\n").split("\t") for line in f]
        # this copy's `is_duplicate` is 0 for a paraphrase
        return [{"q1": r[0], "q2": r[1], "paraphrase": 1 - int(r[2])} for r in lines]

    summary = kbert.finetune(base, "sentence-embedding", rows("train.txt"), rows("validation.txt"),
                             out_dir=str(tmp_path / "contrastive"), text_column="q1", pair_column="q2",
                             label_column="paraphrase", epochs=1, learning_rate=5e-4, max_length=48, progress=False,
                             similarity_loss="contrastive")
    assert summary["metric"] == "ap" and {"ap", "f1", "accuracy", "spearman"} <= set(summary["baseline"])
    assert summary["best"] > summary["baseline"]["ap"] + 0.02, (summary["baseline"], summary["history"])
    card = open(tmp_path / "contrastive" / "README.md", encoding="utf-8").read()
    assert "OnlineContrastiveLoss" in card
    with pytest.raises(ValueError, match="labelled 1 .*or 0.*holds \\[2.0"):
        kbert.finetune(base, "sentence-embedding", [{"a": "가", "b": "나", "y": 2}, {"a": "다", "b": "라", "y": 0}],
                       text_column="a", pair_column="b", label_column="y", similarity_loss="contrastive",
                       out_dir=str(tmp_path / "bad"), progress=False)


@pytest.mark.slow
def test_bi_encoder_pooling_over_layers_is_saved_and_reused(base, tmp_path):
    """`pooling`/`layers` train the bi-encoder on averaged layers; the dir remembers them, so `Embedder.encode`
    and `kbert export` give the vectors the model was selected with."""
    out = str(tmp_path / "layers")
    summary = kbert.finetune(base, "sentence-embedding", os.path.join(KORSTS, "sts-train.tsv"),
                             os.path.join(KORSTS, "sts-dev.tsv"), out_dir=out, text_column="sentence1",
                             pair_column="sentence2", label_column="score", epochs=1, max_steps=40,
                             learning_rate=5e-4, max_length=64, progress=False, layers=(0, 1, 2))
    emb = kbert.Embedder.load(out)
    assert (emb.pooling, emb.layers) == ("mean", [0, 1, 2])
    with open(os.path.join(KORSTS, "sts-dev.tsv"), encoding="utf-8") as f:
        rows = [line.rstrip("\n").split("\t") for line in f][1:]
    a, b = emb.encode([r[5] for r in rows]), emb.encode([r[6] for r in rows])
    assert spearman(np.sum(a * b, axis=1), [float(r[4]) for r in rows]) == pytest.approx(summary["best"], abs=1e-4)
    texts = ["영화가 정말 재밌다", "법률 조항을 개정한다"]
    assert np.allclose(emb.encode(texts), emb.encode(texts, pooling="mean", layers=[0, 1, 2]))
    assert not np.allclose(emb.encode(texts), emb.encode(texts, layers=-1), atol=1e-3)  # not the last layer alone
    assert kbert.Embedder.load(base).layers == -1  # a plain model dir: mean pooling of the last layer
    path = kbert.export(out, str(tmp_path / "export"))  # checks the SavedModel against encode() itself
    with open(os.path.join(path, "assets.extra", "kbert.json"), encoding="utf-8") as f:
        assert json.load(f)["layers"] == [0, 1, 2]
    with pytest.raises(ValueError, match="do not apply to task='tagging'"):
        kbert.finetune(base, "tagging", [], layers=[0, 1], progress=False)
    with pytest.raises(ValueError, match="the pooler is a classification head's input"):
        kbert.finetune(base, "sentence-embedding", os.path.join(KORSTS, "sts-dev.tsv"), text_column="sentence1",
                       pair_column="sentence2", label_column="score", pooling="pooler", progress=False)
    with pytest.raises(ValueError, match="`layers` entries must be in"):
        kbert.finetune(base, "sentence-embedding", os.path.join(KORSTS, "sts-dev.tsv"), text_column="sentence1",
                       pair_column="sentence2", label_column="score", layers=[5], progress=False)


@pytest.mark.slow
def test_classification_head_on_mean_pooled_layers(base, tmp_path):
    """`pooling`/`layers` also choose what a classification head reads (instead of BERT's pooler); the dir
    remembers it, so `TaskModel.predict` and the exported classify signature reproduce the selected model,
    and the unused pooler is left as it was."""
    out = str(tmp_path / "mean-head")
    train = movie_review_sentiment(REVIEWS, "train", limit=3000)
    dev = movie_review_sentiment(REVIEWS, "dev", limit=500)
    summary = kbert.finetune(base, "classification", train, dev, out_dir=out, epochs=1, learning_rate=1e-3,
                             max_length=64, progress=False, pooling="mean", layers="all")
    assert summary["best"] >= 0.6, summary["history"]
    with open(os.path.join(out, "kbert_task.json"), encoding="utf-8") as f:
        meta = json.load(f)
    assert (meta["pooling"], meta["layers"]) == ("mean", [0, 1, 2])
    model = kbert.TaskModel.load(out)
    probs = model.predict([r["text"] for r in dev])
    accuracy = np.mean(np.argmax(probs, axis=1) == np.array([int(r["label"]) for r in dev]))
    assert accuracy == pytest.approx(summary["best"], abs=1e-6)
    before, after = kbert.load_model(base), kbert.load_model(out)
    pooler = [i for i, v in enumerate(before.weights) if "pooler" in v.path]
    assert pooler and all(np.array_equal(before.weights[i].numpy(), after.weights[i].numpy()) for i in pooler)
    assert not np.array_equal(before.weights[0].numpy(), after.weights[0].numpy())  # the rest was trained
    kbert.export(out, str(tmp_path / "serving"), signature="classify")  # checks it against predict() at 1e-5
    with pytest.raises(ValueError, match="`layers` must be -1 with it"):
        kbert.finetune(base, "classification", train, pooling="pooler", layers="all", progress=False)
    with pytest.raises(ValueError, match=r"`pooling` must be one of \('pooler', 'mean'"):
        kbert.finetune(base, "classification", train, pooling="sum", progress=False)


def test_fine_tuning_reads_a_headerless_file_by_the_columns_given(base, tmp_path, capsys):
    """`columns` (`--columns label,text`) names a header-less TSV's cells for train and dev, as 3i4k ships."""
    from kbert.cli import main

    rows = movie_review_sentiment(REVIEWS, "train", limit=64)
    for name in ("train.txt", "dev.txt"):
        (tmp_path / name).write_text("".join(f"{r['label']}\t{r['text']}\n" for r in rows), encoding="utf-8")
    summary = kbert.finetune(base, "classification", str(tmp_path / "train.txt"), str(tmp_path / "dev.txt"),
                             columns=["label", "text"], out_dir=str(tmp_path / "out"), max_steps=1, progress=False)
    assert summary["labels"] == ["0", "1"] and summary["baseline"]["accuracy"] > 0
    args = ["finetune", "--model", base, "--task", "classification", "--train", str(tmp_path / "train.txt"),
            "--out", str(tmp_path / "cli")]
    assert main(args + ["--columns", "label, text", "--print-config"]) == 0
    assert "columns:\n- label\n- text\n" in capsys.readouterr().out
    assert main(args + ["--max-steps", "1"]) == 1
    assert "if its first line is a row, not a header" in capsys.readouterr().err


def test_the_dev_metric_that_picks_the_best_checkpoint_can_be_chosen(base, tmp_path):
    """`metric` picks the best checkpoint by any dev figure the evaluation reports (macro-F1 for classes of very
    different sizes; mse, better lower, for a regression); a figure the task does not report is refused by name."""
    rows = movie_review_sentiment(REVIEWS, "train", limit=96)
    run = dict(max_steps=4, eval_every=1, patience=None, learning_rate=1e-3, progress=False)
    summary = kbert.finetune(base, "classification", rows[:64], rows[64:], metric="macro_f1",
                             out_dir=str(tmp_path / "f1"), **run)
    figures = [h["dev_macro_f1"] for h in summary["history"]]
    assert summary["metric"] == "macro_f1" and summary["best"] == max(figures)
    assert summary["best_step"] == summary["history"][figures.index(max(figures))]["step"]
    sts = os.path.join(KORSTS, "sts-dev.tsv")
    pairs = dict(text_column="sentence1", pair_column="sentence2", label_column="score")
    summary = kbert.finetune(base, "regression", sts, sts, metric="mse", max_length=32, batch_size=64,
                             out_dir=str(tmp_path / "mse"), **pairs, **run)
    assert summary["best"] == min(h["dev_mse"] for h in summary["history"])
    with pytest.raises(ValueError, match=r"`metric` must be a dev figure of classification: one of \['accuracy', "
                                         r"'macro_f1'\]. Received: 'f1'"):
        kbert.finetune(base, "classification", rows[:64], rows[64:], metric="f1", out_dir=str(tmp_path / "x"), **run)
    with pytest.raises(ValueError, match="picks the best checkpoint by a dev figure; give `dev`"):
        kbert.finetune(base, "classification", rows, metric="macro_f1", out_dir=str(tmp_path / "y"), **run)


def test_predict_gives_each_rows_prediction_and_the_test_figures_fine_tuning_reports(base, tmp_path, capsys,
                                                                                        monkeypatch):
    """`kbert predict` (`kbert.embed.prediction.predict_rows`): TaskModel's probabilities and values a row, in the
    columns the model was tuned on, and against the file's labels the very figures fine-tuning printed for the
    same rows as its dev set (run_classifier.py's --do_predict, with the evaluation)."""
    from kbert.cli import main
    from kbert.embed.prediction import predict_rows

    rows = movie_review_sentiment(REVIEWS, "train", limit=96)
    train = [{"review": r["text"], "y": r["label"]} for r in rows[:64]]
    test = [{"review": r["text"], "y": r["label"]} for r in rows[64:]]
    summary = kbert.finetune(base, "classification", train, test, text_column="review", label_column="y",
                             out_dir=str(tmp_path / "cls"), max_steps=2, learning_rate=1e-3, progress=False)
    model = kbert.TaskModel.load(str(tmp_path / "cls"))
    out, figures = predict_rows(model, test)
    probs = model.predict([r["review"] for r in test])
    assert [o["label"] for o in out] == [model.labels[i] for i in np.argmax(probs, axis=1)]
    assert [o["row"] for o in out] == list(range(1, 33))
    np.testing.assert_allclose([o["scores"]["1"] for o in out], probs[:, 1], atol=1e-6)
    best = next(h for h in summary["history"] if h["step"] == summary["best_step"])
    assert figures["label_column"] == "y" and figures["rows"] == 32
    assert figures["accuracy"] == pytest.approx(best["dev_accuracy"]) and \
        figures["macro_f1"] == pytest.approx(best["dev_macro_f1"])
    from sklearn.metrics import precision_recall_fscore_support

    gold = [r["y"] for r in test]  # each class's figures, as scikit-learn's classification_report
    p, r, f1, n = precision_recall_fscore_support(gold, [o["label"] for o in out], labels=["0", "1"], zero_division=0)
    assert figures["per_label"] == {k: pytest.approx({"precision": p[j], "recall": r[j], "f1": f1[j], "support": n[j]})
                                    for j, k in enumerate(["0", "1"])}
    assert predict_rows(model, [{"review": r["review"]} for r in test])[1] is None  # no labels: predictions only
    from kbert.embed import prediction

    monkeypatch.setattr(prediction, "CHUNK", 5)  # a large file runs a chunk at a time (the bar's steps): the same
    chunked, again = predict_rows(model, test, progress=True)
    assert again == figures and [o["label"] for o in chunked] == [o["label"] for o in out]
    np.testing.assert_allclose([o["score"] for o in chunked], [o["score"] for o in out], atol=1e-5)
    assert "predict classification" in capsys.readouterr().err
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"data row 2 has labels not seen in training: \['3'\] "
                                         r"\(training labels: \['0', '1'\]\)"):
        predict_rows(model, [test[0], {"review": "좋다", "y": "3"}])
    with pytest.raises(ValueError, match="row 1 has no 'gold' to score"):
        predict_rows(model, [{"review": "좋다", "gold": ""}], label_column="gold")
    # a regression on pairs, its figures against the scores; and the command line on a header-less file
    sts = os.path.join(KORSTS, "sts-dev.tsv")
    pairs = dict(text_column="sentence1", pair_column="sentence2", label_column="score")
    summary = kbert.finetune(base, "regression", sts, sts, out_dir=str(tmp_path / "reg"), max_steps=1,
                             max_length=32, batch_size=64, progress=False, **pairs)
    _, figures = predict_rows(kbert.TaskModel.load(str(tmp_path / "reg")), sts)
    # (predict packs rows of mixed lengths, fine-tuning's evaluation pads them: float rounding apart, the same values;
    # after one step they lie close together, so a rank correlation moves in its fourth digit)
    assert figures["spearman"] == pytest.approx(summary["best"], abs=1e-3)
    assert figures["mse"] == pytest.approx(summary["history"][-1]["dev_mse"], rel=1e-4)
    (tmp_path / "test.txt").write_text("".join(f"{r['y']}\t{r['review']}\n" for r in test), encoding="utf-8")
    assert main(["predict", "--model", str(tmp_path / "cls"), "--input", str(tmp_path / "test.txt"),
                 "--columns", "y,review", "--out", str(tmp_path / "pred.jsonl")]) == 0
    with open(tmp_path / "pred.jsonl", encoding="utf-8") as f:
        assert [json.loads(line)["label"] for line in f] == [o["label"] for o in out]
    err = capsys.readouterr().err
    assert "32 rows predicted by the classification model" in err and "against its 'y' column" in err
    assert f"  1: precision {p[1]:.4f} recall {r[1]:.4f} f1 {f1[1]:.4f} support {n[1]}" in err
    assert main(["predict", "--model", str(tmp_path / "cls"), "--input", str(tmp_path / "test.txt")]) == 1
    assert "lines are 2 tab-separated cells each, a TSV without a header line" in capsys.readouterr().err


def test_multi_label_classification_trains_predicts_exports_and_reads_back(base, tmp_path):
    """`multi_label=True`: rows with any number of labels (a list, a JSON list or a comma-separated cell; none at
    all too) train a sigmoid a label with binary cross-entropy; dev is scored by micro-F1; `TaskModel.predict`,
    `kbert predict`, the SavedModel and ONNX exports give each label's own probability; the transformers export
    is a multi_label_classification model with the same probabilities, and reads back as one."""
    import torch
    import transformers

    from kbert.embed.prediction import predict_rows
    from kbert.utils import multi_label_figures

    with open(os.path.join(KORSTS, "sts-train.tsv"), encoding="utf-8") as f:
        texts = [line.rstrip("\n").split("\t")[5] for line in f][1:1601]
    words = ("남자", "여자")  # which of them a sentence holds: 0, 1 or 2 labels a row
    rows = [{"text": t, "tags": [w for w in words if w in t]} for t in texts]
    rows[1]["tags"] = ",".join(rows[1]["tags"])  # a TSV cell's form
    rows[2]["tags"] = json.dumps(rows[2]["tags"], ensure_ascii=False)
    out = str(tmp_path / "ml")
    summary = kbert.finetune(base, "classification", rows[:1300], rows[1300:], label_column="tags", multi_label=True,
                             out_dir=out, epochs=4, learning_rate=1e-3, max_length=48, pooling="mean", progress=False)
    assert summary["metric"] == "micro_f1" and summary["labels"] == sorted(words)
    # (on BERT's pooler this random 2-layer model sits on the labels' prior for several epochs first)
    assert summary["best"] > 0.85, summary["history"]
    dev = rows[1300:]
    model = kbert.TaskModel.load(out)
    assert model.multi_label
    probs = model.predict([r["text"] for r in dev])
    assert probs.shape == (300, 2) and not np.allclose(probs.sum(axis=1), 1.0)  # a sigmoid each, not a softmax
    gold = np.array([[w in r["tags"] for w in sorted(words)] for r in dev])
    best = next(h for h in summary["history"] if h["step"] == summary["best_step"])
    assert multi_label_figures(gold, probs > 0.5)["micro_f1"] == pytest.approx(best["dev_micro_f1"], abs=1e-6)
    found, figures = predict_rows(model, dev)
    assert found[0]["labels"] == [w for w, p in zip(sorted(words), probs[0]) if p > 0.5]
    assert figures["micro_f1"] == pytest.approx(best["dev_micro_f1"], abs=1e-6)
    from sklearn.metrics import precision_recall_fscore_support

    p, r, f, n = precision_recall_fscore_support(gold, probs > 0.5, zero_division=0)  # multi-label: per label
    assert figures["per_label"] == {k: pytest.approx({"precision": p[j], "recall": r[j], "f1": f[j], "support": n[j]})
                                    for j, k in enumerate(sorted(words))}
    as_tsv = tmp_path / "dev.tsv"  # a TSV's empty cell: a row with none of the labels, still scored
    as_tsv.write_text("text\ttags\n" + "".join(f"{r['text']}\t{','.join(r['tags'])}\n" for r in dev), encoding="utf-8")
    assert predict_rows(model, str(as_tsv))[1] == figures
    kbert.export(out, str(tmp_path / "serving"), signature="classify")  # checks it against predict() at 1e-5
    onnx_dir = kbert.export_onnx(out, str(tmp_path / "onnx"))  # checks it against predict() too
    np.testing.assert_allclose(kbert.OnnxTaskModel.load(onnx_dir).predict([r["text"] for r in dev[:8]]), probs[:8],
                               atol=1e-4)
    hf_dir = str(tmp_path / "hf")  # transformers' classifiers read BERT's pooler: a head on it, two steps
    kbert.finetune(base, "classification", rows[:64], label_column="tags", multi_label=True, out_dir=out + "-pooler",
                   max_steps=2, max_length=48, progress=False)
    model = kbert.TaskModel.load(out + "-pooler")
    probs = model.predict([r["text"] for r in dev[:8]])
    kbert.export_transformers(model, hf_dir)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir).eval()
    assert hf.config.problem_type == "multi_label_classification"
    batch = transformers.AutoTokenizer.from_pretrained(hf_dir)([r["text"] for r in dev[:8]], padding=True,
                                                               return_tensors="pt")
    with torch.no_grad():
        np.testing.assert_allclose(torch.sigmoid(hf(**batch).logits).numpy(), probs[:8], atol=1e-4)
    again = kbert.TaskModel.load(hf_dir)
    assert again.multi_label and again.labels == sorted(words)
    np.testing.assert_allclose(again.predict([r["text"] for r in dev[:8]]), probs[:8], atol=1e-5)
    bad = dict(out_dir=str(tmp_path / "bad"), max_steps=1, progress=False)
    with pytest.raises(ValueError, match=r"train row 1: the label is a list .*pass multi_label=True"):
        kbert.finetune(base, "classification", [{"text": "a", "label": ["x"]}, {"text": "b", "label": ["y"]}], **bad)
    with pytest.raises(ValueError, match="`multi_label` .* goes with task='classification'"):
        kbert.finetune(base, "regression", rows, label_column="tags", multi_label=True, **bad)
    with pytest.raises(ValueError, match="dev row 1 has labels not seen in training: \\['개'\\]"):
        kbert.finetune(base, "classification", rows[:50], [{"text": "개", "tags": "개"}], label_column="tags",
                       multi_label=True, **bad)


def test_class_weights_weigh_the_loss_as_scikit_learn_and_torch_define_them(base, tmp_path, capsys):
    """`class_weights="balanced"`: scikit-learn's compute_class_weight for classes, n_neg / n_pos per label for a
    multi-label task; the batch loss is torch's weighted cross-entropy (and BCEWithLogitsLoss's pos_weight)."""
    import torch
    from sklearn.utils.class_weight import compute_class_weight

    from kbert.cli import main
    from kbert.train.finetune import FinetuneConfig
    from kbert.train.finetune_tasks import task_for

    rows = [{"text": f"문장 {i}", "label": label} for i, label in enumerate(["a"] * 7 + ["b"] * 2 + ["c"])]
    task = task_for(FinetuneConfig(model=base, task="classification", train=rows, class_weights="balanced"))
    task.labels = task.label_set(rows, False)
    np.testing.assert_allclose(task.weights, compute_class_weight("balanced", classes=np.array(["a", "b", "c"]),
                                                                  y=np.array([r["label"] for r in rows])), rtol=1e-6)
    logits = np.array([[0.5, -1.0, 2.0], [1.0, 0.0, -1.0], [0.2, 0.3, 0.1]], np.float32)
    y = np.array([2, 0, 1])
    got = float(task.loss(lambda feats, training: logits, None, y, 3))
    want = torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(y), weight=torch.tensor(task.weights))
    assert got == pytest.approx(float(want), rel=1e-5)
    multi = [{"text": "x", "label": ["a", "b"]}, {"text": "y", "label": ["a"]}, {"text": "z", "label": []},
             {"text": "w", "label": ["a"]}]
    task = task_for(FinetuneConfig(model=base, task="classification", train=multi, multi_label=True,
                                   class_weights="balanced"))
    task.labels = task.label_set(multi, False)
    np.testing.assert_allclose(task.weights, [1 / 3, 3.0])  # a: 3 of 4 rows, b: 1 of 4
    y = np.array([[1, 1], [1, 0], [0, 0]], np.float32)
    got = float(task.loss(lambda feats, training: logits[:, :2], None, y, 3))
    want = torch.nn.functional.binary_cross_entropy_with_logits(torch.tensor(logits[:, :2]), torch.tensor(y),
                                                                pos_weight=torch.tensor(task.weights))
    assert got == pytest.approx(float(want), rel=1e-5)
    task = task_for(FinetuneConfig(model=base, task="classification", train=rows, class_weights={"c": 4}))
    task.labels = task.label_set(rows, False)
    assert task.weights.tolist() == [1.0, 1.0, 4.0]
    for bad, match in (({"d": 2}, "names labels the training data lacks"), ({"c": 0}, "must be a positive number")):
        with pytest.raises(ValueError, match=match):
            task_for(FinetuneConfig(model=base, task="classification", train=rows, class_weights=bad)).label_set(
                rows, False)
    with pytest.raises(ValueError, match="`class_weights` goes with task='classification'"):
        kbert.finetune(base, "regression", rows, class_weights="balanced", progress=False)
    reviews = movie_review_sentiment(REVIEWS, "train", limit=64)
    uneven = [r for r in reviews if r["label"] == "1"] + [r for r in reviews if r["label"] == "0"][:8]
    path = tmp_path / "uneven.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in uneven), encoding="utf-8")
    assert main(["finetune", "--model", base, "--task", "classification", "--train", str(path), "--out",
                 str(tmp_path / "out"), "--class-weights", "balanced", "--max-steps", "1"]) == 0
    n1 = len(uneven) - 8
    assert f"class weights: '0' {len(uneven) / 16:.3g}, '1' {len(uneven) / (2 * n1):.3g}" in capsys.readouterr().err


def test_spearman_and_pearson_against_hand_values():
    assert list(rank(np.array([10.0, 20.0, 20.0, 5.0]))) == [2.0, 3.5, 3.5, 1.0]  # ties share the mean rank
    assert spearman([1, 2, 3, 4], [10, 20, 30, 1000]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert pearson([1, 2, 3], [2, 4, 7]) == pytest.approx(np.corrcoef([1, 2, 3], [2, 4, 7])[0, 1])
    assert pearson([1, 1, 1], [1, 2, 3]) == 0.0


def test_length_grouped_batches_cover_every_example_once_with_little_padding():
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 120, size=5000)
    ex = Examples([[7] * n for n in lengths], None, np.zeros(5000))
    pair = Examples([[7] * 3 for _ in lengths], None, None, pair_token_ids=[[7] * n for n in lengths[::-1]])
    for group in (True, False):
        epochs = [epoch_batches(np.random.default_rng(s), ex, 32, group) for s in (1, 2)]
        for batches in epochs:
            flat = np.concatenate(batches)
            assert sorted(flat) == list(range(5000)) and max(len(b) for b in batches) == 32
        assert not all(np.array_equal(a, b) for a, b in zip(*epochs))  # reshuffled each epoch
        padding = np.mean([lengths[b].max() - lengths[b].mean() for b in epochs[0]])
        if group:
            assert padding < 3, padding  # the same lengths within a batch, give or take a few
            order = [lengths[b].max() for b in epochs[0]]
            assert order != sorted(order)  # but the batches themselves are not in length order
        else:
            assert padding > 30, padding
    # pairs (bi-encoders) are grouped by the longer side
    batches = epoch_batches(np.random.default_rng(0), pair, 32, True)
    longer = np.maximum(3, lengths[::-1])
    assert np.mean([longer[b].max() - longer[b].mean() for b in batches]) < 3


@pytest.mark.slow
def test_regression_pair_classification_and_tagging(base, tmp_path):
    import csv
    import gzip

    # Regression: a review's rating (1-10) from its text.
    with gzip.open(os.path.join(REVIEWS, "reviews.tsv.gz"), "rt", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        reviews = [r for _, r in zip(range(6000), reader) if r["text"].strip()]
    summary = kbert.finetune(base, "regression", reviews[:5000], reviews[5000:], out_dir=str(tmp_path / "rating"),
                             label_column="rating", epochs=2, learning_rate=1e-3, max_length=64, progress=False)
    assert summary["metric"] == "spearman"
    assert summary["best"] > summary["baseline"]["spearman"] + 0.1, (summary["baseline"], summary["history"])
    values = kbert.TaskModel.load(str(tmp_path / "rating")).predict(["최고의 영화", "최악"])
    assert values.shape == (2,) and values[0] > values[1]

    # Pair classification (question pairs) runs end to end and exports with a two-input signature whose
    # in-graph truncation (longer segment first) matches the Python tokenizer: export() checks it at 1e-5.
    qp = os.path.join(SHARED, "question-pair")
    kbert.finetune(base, "pair-classification", os.path.join(qp, "train.txt"), os.path.join(qp, "validation.txt"),
                   out_dir=str(tmp_path / "qp"), text_column="question1", pair_column="question2",
                   label_column="is_duplicate", max_steps=20, progress=False)
    path = kbert.export(str(tmp_path / "qp"), str(tmp_path / "qp-serving"), signature="classify", max_length=16)
    import tensorflow as tf

    fn = tf.saved_model.load(path).signatures["serving_default"]
    assert sorted(fn.structured_input_signature[1]) == ["text_pairs", "texts"]

    with open(os.path.join(KORSTS, "sts-train.tsv"), encoding="utf-8") as f:
        header, *rows = [line.rstrip("\n").split("\t") for line in f]
    data = [dict(zip(header, r)) for r in rows[:1500]]
    # Tagging: a word is "J" when it ends in a common particle; learnable from subword context.
    sents = [r["sentence1"] for r in data]
    tag_rows = [{"text": s, "label": " ".join("J" if w[-1] in "은는이가을를에" else "O" for w in s.split())}
                for s in sents]
    summary = kbert.finetune(base, "tagging", tag_rows[:1200], tag_rows[1200:], out_dir=str(tmp_path / "tag"),
                             epochs=2, learning_rate=2e-3, max_length=64, progress=False)
    majority = np.mean([t == "O" for r in tag_rows[1200:] for t in r["label"].split()])
    assert summary["best"] > majority + 0.05, (majority, summary["history"])
    tagged = kbert.TaskModel.load(str(tmp_path / "tag")).predict("학교에서 친구를 만났다")
    assert [w for w, _ in tagged] == ["학교에서", "친구를", "만났다"] and all(t in ("J", "O") for _, t in tagged)


def test_tagging_trains_on_a_ud_treebank_as_it_is(base, tmp_path):
    """`kbert finetune ... --task tagging --train ko_gsd-ud-*.conllu --label-column upos`: the treebank's words
    get their UPOS tags, above the majority tag on sentences it did not train on."""
    gsd = os.path.join(SHARED, "ud-korean-gsd")
    summary = kbert.finetune(base, "tagging", os.path.join(gsd, "ko_gsd-ud-dev.conllu"),
                             os.path.join(gsd, "ko_gsd-ud-test.conllu"), out_dir=str(tmp_path / "pos"),
                             label_column="upos", epochs=2, learning_rate=2e-3, max_length=64, progress=False)
    from kbert.data.rows import read_rows

    test_tags = [t for r in read_rows(os.path.join(gsd, "ko_gsd-ud-test.conllu"), ["upos"]) for t in r["upos"].split()]
    majority = max(test_tags.count(t) for t in set(test_tags)) / len(test_tags)
    assert summary["best"] > majority + 0.1, (majority, summary["history"])
    tagged = kbert.TaskModel.load(str(tmp_path / "pos")).predict("학교에서 공부했다 .")
    assert [w for w, _ in tagged] == ["학교에서", "공부했다", "."] and tagged[-1][1] == "PUNCT"
    # `kbert predict` on the test treebank: each word's tag, and the dev figure fine-tuning printed for it
    from kbert.embed.prediction import predict_rows

    test = os.path.join(gsd, "ko_gsd-ud-test.conllu")
    out, figures = predict_rows(kbert.TaskModel.load(str(tmp_path / "pos")), test)
    assert figures["label_column"] == "upos" and figures["accuracy"] == pytest.approx(summary["best"], abs=0.005)
    assert out[0]["tags"][0][0] == read_rows(test, ["text"])[0]["text"].split()[0]


def test_tagging_with_entity_spans_learns_where_an_entity_ends_inside_a_word(base, tmp_path):
    """Entities given as character spans: a word's stem before its object or topic particle (책을 -> 책), which no
    word-level tag can mark; every token trains on its BIO tag, dev is scored by entity F1, and the saved model's
    `entities` reads spans back token by token."""
    with open(os.path.join(KORSTS, "sts-train.tsv"), encoding="utf-8") as f:
        header, *rows = [line.rstrip("\n").split("\t") for line in f]
    rows_out = []
    for r in rows[:1500]:
        text = dict(zip(header, r))["sentence1"]
        spans, at = [], 0
        for word in text.split(" "):
            if len(word) > 1 and word[-1] in "을를은는":
                spans.append([at, at + len(word) - 1, "N"])
            at += len(word) + 1
        rows_out.append({"text": text, "label": spans})
    # written in KLUE-NER's layout (`## id<TAB>marked sentence`, a character and its BIO tag a line), which
    # `kbert finetune` reads as it ships
    paths = {}
    for split, part in (("train", rows_out[:1200]), ("dev", rows_out[1200:])):
        lines = []
        for i, r in enumerate(part):
            tags = ["O"] * len(r["text"])
            marked = r["text"]
            for a, b, kind in reversed(r["label"]):
                tags[a:b] = [f"B-{kind}"] + [f"I-{kind}"] * (b - a - 1)
                marked = f"{marked[:a]}<{marked[a:b]}:{kind}>{marked[b:]}"
            lines += [f"## klue-ner-v1_{split}_{i:05d}\t{marked}"] + [f"{c}\t{t}" for c, t in zip(r["text"], tags)] + [""]
        paths[split] = str(tmp_path / f"klue-ner-{split}.tsv")
        with open(paths[split], "w", encoding="utf-8") as f:
            f.write("\n".join(lines))
    from kbert.data.rows import read_rows

    assert [(r["text"], r["label"]) for r in read_rows(paths["train"], ["text", "label"])] == [
        (r["text"], r["label"]) for r in rows_out[:1200]]
    out = str(tmp_path / "spans")
    summary = kbert.finetune(base, "tagging", paths["train"], paths["dev"], out_dir=out, epochs=3,
                             learning_rate=2e-3, max_length=64, progress=False)
    assert summary["metric"] == "entity_f1"
    assert summary["best"] > summary["baseline"]["entity_f1"] + 0.3, (summary["baseline"], summary["history"])
    model = kbert.TaskModel.load(out)
    assert model.labels == ["O", "B-N", "I-N"] and model.meta["aggregation"] == "simple"
    # the spans `entities` reads back score as the dev figure did (the same tokens, tags and grouping) against
    # the gold entities as whole tokens (a piece joining a stem and its particle is all inside or all outside)
    from kbert.data.entities import bio_labels, token_spans
    from kbert.train.metrics import entity_runs

    dev = rows_out[1200:]
    found = model.entities([r["text"] for r in dev])
    assert all(r["text"][e["start"]:e["end"]] == e["word"] for r, f in zip(dev, found) for e in f)
    hits = n_gold = 0
    for r, f in zip(dev, found):
        spans = token_spans(model.tokenizer, r["text"], model.tokenizer.encode(r["text"], max_length=64))
        kept = [x for x in spans if x is not None]
        tags = [t for t in bio_labels(spans, r["label"]) if t]
        gold = {(kept[a][0], kept[b - 1][1]) for a, b, _ in entity_runs(tags)}
        hits += len(gold & {(e["start"], e["end"]) for e in f})
        n_gold += len(gold)
    # at least the dev figure: a lone "▁" piece reads as the character after it, so a run that differs from
    # the gold run by that piece alone is the same span of the text
    assert 2 * hits / (sum(map(len, found)) + n_gold) >= summary["best"] - 0.01
    # `kbert predict` on the KLUE-NER file: the entities `entities` gives, scored as KLUE scores them (exact
    # character spans: "책" of "책을", where fine-tuning's figure above counted whole tokens)
    from kbert.embed.prediction import predict_rows
    from kbert.utils import entity_scores

    out, figures = predict_rows(model, paths["dev"])
    assert [[(e["start"], e["end"]) for e in o["entities"]] for o in out] == [[(e["start"], e["end"]) for e in f]
                                                                           for f in found]
    char_level = entity_scores([{tuple(x) for x in r["label"]} for r in dev],
                               [{(e["start"], e["end"], e["entity_group"]) for e in f} for f in found])
    assert figures == pytest.approx({"label_column": "label", "rows": 300, **char_level})
    assert 0 < figures["entity_f1"] <= 1
    with pytest.raises(ValueError, match="mix entity spans and word tags"):
        kbert.finetune(base, "tagging", [rows_out[0], {"text": "두 단어", "label": "O O"}], progress=False)


@pytest.mark.slow
def test_backbone_dropout_rebuilds_the_same_weights_without_noise(base, tmp_path):
    """`backbone_dropout` copies the weights into a backbone with the new rates: with 0.0 a training-mode call
    equals the original's inference call; the written dir keeps the rate; bad rates are refused."""
    from kbert.models.io import with_dropout

    original = kbert.load_model(base, output_hidden_states=True)
    assert original.config.dropout > 0
    quiet = with_dropout(original, 0.0)
    ids = np.array([[2, 10, 11, 12, 3]], "int32")
    feats = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": np.ones_like(ids)}
    reference = np.asarray(original(feats, training=False)["sequence_output"])
    assert np.allclose(np.asarray(quiet(feats, training=True)["sequence_output"]), reference, atol=1e-5)
    assert not np.allclose(np.asarray(original(feats, training=True)["sequence_output"]), reference, atol=1e-3)
    assert with_dropout(quiet, 0.0) is quiet
    out = str(tmp_path / "quiet")
    kbert.finetune(base, "sentence-embedding", os.path.join(KORSTS, "sts-dev.tsv"), out_dir=out,
                   text_column="sentence1", pair_column="sentence2", label_column="score", epochs=1, max_steps=3,
                   max_length=32, progress=False)  # a bi-encoder regressed onto scores: 0.0 by default
    config = kbert.load_model(out).config
    assert (config.dropout, config.attention_dropout) == (0.0, 0.0)
    kbert.finetune(base, "classification", [{"text": "좋다", "label": "1"}, {"text": "싫다", "label": "0"}],
                   out_dir=out + "-head", max_steps=1, progress=False)  # heads keep the model's own rate
    assert kbert.load_model(out + "-head").config.dropout == original.config.dropout
    kbert.finetune(base, "sentence-embedding", os.path.join(KORSTS, "sts-dev.tsv"), out_dir=out + "-kept",
                   text_column="sentence1", pair_column="sentence2", label_column="score", max_steps=1,
                   max_length=32, progress=False, backbone_dropout=0.2)
    assert kbert.load_model(out + "-kept").config.attention_dropout == 0.2
    for bad in (1.0, -0.1, "0.1", True):
        with pytest.raises(ValueError, match="`backbone_dropout` must be None or a rate"):
            kbert.finetune(base, "classification", [{"text": "좋다", "label": "1"}], backbone_dropout=bad,
                           progress=False)


@pytest.mark.slow
def test_interrupted_finetuning_resumes_to_the_same_result(base, tmp_path):
    """A run stopped mid-epoch and between evaluations (with dropout on, so the seeds matter) continues from
    its checkpoint and ends exactly as the uninterrupted run: same dev history, same best, same model."""
    train = movie_review_sentiment(REVIEWS, "train", limit=600, seed=2)
    dev = movie_review_sentiment(REVIEWS, "dev", limit=200)
    args = dict(epochs=2, learning_rate=1e-3, max_length=48, eval_every=10, checkpoint_every=7, patience=None,
                progress=False)
    full = kbert.finetune(base, "classification", train, dev, out_dir=str(tmp_path / "full"), **args)
    per_epoch = -(-len(train) // 32)
    assert full["steps"] == 2 * per_epoch and full["checkpoint"] is None
    # in the second epoch, neither at an evaluation nor at a periodic checkpoint
    cut = next(s for s in range(per_epoch + 1, 2 * per_epoch) if s % 10 and s % 7)
    out = str(tmp_path / "part")
    part = kbert.finetune(base, "classification", train, dev, out_dir=out, stop_after=cut, **args)
    assert (part["steps"], part["stopped_by"]) == (cut, "stop_after")
    assert part["checkpoint"].endswith(f"ckpt-{cut}.safetensors")
    assert len(part["history"]) == cut // 10 and os.path.isdir(os.path.join(out, "checkpoints"))
    assert not os.path.exists(os.path.join(out, "README.md"))  # a stopped run has no card yet
    rest = kbert.finetune(base, "classification", train, dev, out_dir=out, **args)
    assert (rest["steps"], rest["stopped_by"], rest["checkpoint"]) == (2 * per_epoch, "steps", None)
    assert not os.path.exists(os.path.join(out, "checkpoints"))  # finished: only the model dir is left
    with open(os.path.join(out, "README.md"), encoding="utf-8") as f:  # and its card, of the whole run
        assert f"{2 * per_epoch} steps. Dev accuracy" in f.read()
    assert [h["step"] for h in rest["history"]] == [h["step"] for h in full["history"]]
    for key in ("train_loss", "dev_accuracy"):
        np.testing.assert_allclose([h[key] for h in rest["history"]], [h[key] for h in full["history"]],
                                   rtol=1e-4, atol=1e-4)
    assert (rest["best_step"], rest["baseline"]) == (full["best_step"], full["baseline"])
    texts = [r["text"] for r in dev[:16]]
    np.testing.assert_allclose(kbert.TaskModel.load(out).predict(texts),
                               kbert.TaskModel.load(str(tmp_path / "full")).predict(texts),
                               atol=1e-4)


@pytest.mark.slow
def test_finetuning_checkpoint_refuses_other_settings_and_sigterm_stops_with_one(base, tmp_path):
    train = movie_review_sentiment(REVIEWS, "train", limit=300, seed=3)
    out = str(tmp_path / "run")
    first = kbert.finetune(base, "classification", train, out_dir=out, max_length=32, stop_after=3, progress=False)
    assert first["stopped_by"] == "stop_after"
    with pytest.raises(ValueError, match=r"interrupted fine-tuning run \(step 3\).*learning_rate: 5e-05 -> 0.001"):
        kbert.finetune(base, "classification", train, out_dir=out, max_length=32, learning_rate=1e-3,
                       progress=False)
    with pytest.raises(ValueError, match="interrupted fine-tuning run .*data"):
        kbert.finetune(base, "classification", train[:-1], out_dir=out, max_length=32, progress=False)
    over = kbert.finetune(base, "classification", train, out_dir=out, max_length=32, learning_rate=1e-3,
                          resume=False, stop_after=1, progress=False)
    assert over["steps"] == 1  # started over
    with pytest.raises(ValueError, match="`stop_after` must be None or a positive integer"):
        kbert.finetune(base, "classification", train, out_dir=out, stop_after=0, progress=False)

    done = threading.Event()

    def preempt():  # once finetune has installed its handler, let it step, then SIGTERM
        while signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and not done.wait(0.05):
            pass
        if not done.wait(2.0):
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=preempt, daemon=True).start()
    out = str(tmp_path / "preempted")
    try:
        stopped = kbert.finetune(base, "classification", train, out_dir=out, epochs=200, max_length=32,
                                 progress=False)
    finally:
        done.set()
    assert stopped["stopped_by"] == "SIGTERM" and 0 < stopped["steps"] < 200 * 10
    assert stopped["checkpoint"].endswith(f"ckpt-{stopped['steps']}.safetensors")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handed back
    again = kbert.finetune(base, "classification", train, out_dir=out, epochs=200, max_length=32, stop_after=1,
                           progress=False)
    assert again["steps"] == stopped["steps"] + 1


def test_finetune_bad_input(base, tmp_path):
    train = tmp_path / "train.tsv"
    train.write_text("text\tlabel\n좋다\t1\n싫다\t0\n", encoding="utf-8")
    dev = tmp_path / "dev.tsv"
    dev.write_text("text\tlabel\n좋다\t2\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no column 'sentence'"):
        kbert.finetune(base, "classification", str(train), text_column="sentence", progress=False)
    with pytest.raises(ValueError, match=r"labels not seen in training: \['2'\]"):
        kbert.finetune(base, "classification", str(train), str(dev), out_dir=str(tmp_path / "m"), progress=False)
    with pytest.raises(ValueError, match="`task` must be one of"):
        kbert.finetune(base, "ner", str(train), progress=False)
    with pytest.raises(ValueError, match="needs `pair_column`"):
        kbert.finetune(base, "pair-classification", str(train), progress=False)
    with pytest.raises(ValueError, match="2 words but 1 tags"):
        kbert.finetune(base, "tagging", [{"text": "두 단어", "label": "O"}], progress=False)
    with pytest.raises(ValueError, match="is not a number"):
        kbert.finetune(base, "regression", [{"text": "a", "label": "x"}], progress=False)
    with pytest.raises(ValueError, match="row 2: label 'nan' is not a finite number"):
        kbert.finetune(base, "regression", [{"text": "a", "label": "1.5"}, {"text": "b", "label": "nan"}],
                       progress=False)
    with pytest.raises(FileNotFoundError, match="Data file not found"):
        kbert.finetune(base, "classification", str(tmp_path / "missing.tsv"), progress=False)
    with pytest.raises(FileNotFoundError, match="not a fine-tuned model dir"):
        kbert.TaskModel.load(base)
    # settings that would train wrongly or not at all, without an error, are refused before anything loads
    for kw, match in ((dict(warmup=2), r"`warmup` must be a fraction of the steps, in \[0, 1\]"),
                      (dict(weight_decay=-0.01), "`weight_decay` must be 0 or more"),
                      (dict(dropout=1.0), r"`dropout` must be a rate in \[0, 1\)"),
                      (dict(patience=0), "`patience` must be None or a positive integer"),
                      (dict(eval_every=0), "`eval_every` must be None or a positive integer"),
                      (dict(max_steps=-3), "`max_steps` must be None or a positive integer"),
                      # NaN passed `value <= 0` and trained until the loss was NaN
                      (dict(learning_rate=float("nan")), "`learning_rate` must be a positive number"),
                      (dict(epochs=float("inf")), "`epochs` must be a positive number"),
                      (dict(lora_rank=4, lora_alpha=float("nan")), "`lora_alpha` must be None"),
                      (dict(query_learning_rate=float("nan")), "`query_learning_rate` must be a number > 0"),
                      # a batch of 2.5 rows failed in the input pipeline; numpy refused -1 after loading
                      (dict(batch_size=2.5), "`batch_size` must be a positive integer"),
                      (dict(seed=-1), r"`seed` must be an integer in \[0, 2\*\*32\)")):
        with pytest.raises(ValueError, match=match):
            kbert.finetune("no-such-model", "classification", str(train), progress=False, **kw)
    # a second run on a dir another process is writing to: refused before it reads or writes there (resuming
    # from, and overwriting, the other's checkpoints was the alternative)
    from kbert.utils import DirectoryInUse

    holder = HeldDir(str(tmp_path / "busy"), "kbert finetune")
    try:
        with pytest.raises(DirectoryInUse, match=rf"is in use: kbert finetune \(pid {holder.proc.pid} "):
            kbert.finetune(base, "classification", str(train), out_dir=str(tmp_path / "busy"), progress=False)
    finally:
        holder.kill()


@pytest.mark.slow
def test_exported_savedmodel_equals_encode_in_a_fresh_process(sentiment, sts, tmp_path):
    texts = ["대한민국은 민주공화국이다.", "", "배우들 연기가 정말 좋았다 " * 30, "ㅋㅋㅋㅋ 최악", b"\xff\xfe bad utf-8"]
    embed_dir = kbert.export(sts[0], str(tmp_path / "embed"))
    classify_dir = kbert.export(sentiment[0], str(tmp_path / "classify"), signature="classify")
    assert embed_dir.endswith(os.path.join("embed", "1")) and os.path.isfile(os.path.join(embed_dir, "saved_model.pb"))
    inputs = tmp_path / "texts.bin"  # raw bytes, one text per record (length-prefixed)
    inputs.write_bytes(b"".join(len(t).to_bytes(4, "little") + t for t in
                                (t if isinstance(t, bytes) else t.encode("utf-8") for t in texts)))
    script = (
        "import sys, numpy as np, tensorflow as tf, tensorflow_text\n"
        "data, texts = open(sys.argv[1], 'rb').read(), []\n"
        "while data:\n"
        "    n = int.from_bytes(data[:4], 'little'); texts.append(data[4:4 + n]); data = data[4 + n:]\n"
        "e = tf.saved_model.load(sys.argv[2]).signatures['serving_default'](texts=tf.constant(texts))\n"
        "c = tf.saved_model.load(sys.argv[3]).signatures['serving_default'](texts=tf.constant(texts))\n"
        "np.save(sys.argv[4], e['embeddings'].numpy()); np.save(sys.argv[5], c['probabilities'].numpy())\n"
        "assert not any(m.startswith('kbert') for m in sys.modules), 'kbert was imported'\n")
    out_e, out_c = str(tmp_path / "e.npy"), str(tmp_path / "c.npy")
    subprocess.run([sys.executable, "-c", script, str(inputs), embed_dir, classify_dir, out_e, out_c], check=True,
                   env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, cwd=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected_e = kbert.Embedder.load(sts[0]).encode(texts)
    expected_c = kbert.TaskModel.load(sentiment[0]).predict(texts)
    np.testing.assert_allclose(np.load(out_e), expected_e, atol=1e-5)
    np.testing.assert_allclose(np.load(out_c), expected_c, atol=1e-5)
    with pytest.raises(FileExistsError, match="overwrite"):
        kbert.export(sts[0], str(tmp_path / "embed"))
    with pytest.raises(ValueError, match="signature='classify' needs"):
        kbert.export(sts[0], str(tmp_path / "x"), signature="classify")


@pytest.mark.slow
def test_encode_bad_input_and_scale(sentiment):
    emb = kbert.Embedder.load(sentiment[0])
    with pytest.raises(TypeError, match="Received: NoneType"):
        emb.encode(None)
    with pytest.raises(TypeError, match="item 1 is int"):
        emb.encode(["좋다", 3])
    bad = emb.encode(b"\xff\xfe\xfd")  # invalid UTF-8: replacement characters, a defined vector
    assert bad.shape == (64,) and np.isfinite(bad).all()
    with pytest.warns(UserWarning, match="1 of 1 texts are longer than 64 tokens"):
        huge = emb.encode("가나다라 " * 200_000)  # a 1 MB string: truncated with a warning
    assert np.isfinite(huge).all()
    texts = [f"{i}번째 리뷰 정말 재밌다" for i in range(100_000)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    vectors = emb.encode(texts, batch_size=256, progress=False)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert vectors.shape == (100_000, 64) and np.isfinite(vectors).all()
    np.testing.assert_allclose(vectors[[0, 99_999]], emb.encode([texts[0], texts[-1]]), atol=1e-5)
    assert grown_mb < 600, f"encoding 100K texts grew the process by {grown_mb:.0f} MB"


@pytest.mark.slow
def test_finetune_and_export_cli(base, tmp_path, capsys):
    from kbert.cli import main

    rows = movie_review_sentiment(REVIEWS, "train", limit=200)
    train = tmp_path / "train.tsv"
    train.write_text("document\tlabel\n" + "".join(f"{r['text']}\t{r['label']}\n" for r in rows), encoding="utf-8")
    out = str(tmp_path / "model")
    assert main(["finetune", "--model", base, "--task", "classification", "--train", str(train), "--dev", str(train),
                 "--out", out, "--text-column", "document", "--max-steps", "4", "--eval-every", "2"]) == 0
    printed = capsys.readouterr().out
    assert "best dev accuracy" in printed and out in printed
    history = json.load(open(os.path.join(out, "finetune_history.json"), encoding="utf-8"))
    assert [h["step"] for h in history["history"]] == [2, 4]
    assert main(["export", "--model", out, "--out", str(tmp_path / "serving")]) == 0  # a classifier: classify
    assert "SavedModel (classify)" in capsys.readouterr().out
    assert os.path.isfile(os.path.join(tmp_path, "serving", "1", "saved_model.pb"))
    assert main(["export", "--model", out, "--out", str(tmp_path / "serving"), "--signature", "classify"]) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert main(["finetune", "--model", base, "--task", "classification", "--train", str(train),
                 "--out", out, "--text-column", "document", "--label-column", "stars"]) == 1
    assert "no column 'stars'" in capsys.readouterr().err
    assert main(["finetune", "--model", base, "--task", "classification", "--train", str(train), "--out",
                 str(tmp_path / "mean-head"), "--text-column", "document", "--max-steps", "2", "--pooling", "mean",
                 "--layers", "0,2"]) == 0
    meta = json.load(open(os.path.join(tmp_path, "mean-head", "kbert_task.json"), encoding="utf-8"))
    assert (meta["pooling"], meta["layers"]) == ("mean", [0, 2])
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("a\tb\tscore\n" + "".join(f"{r['text']}\t{r['text'][:20]}\t{i % 6}\n" for i, r in enumerate(rows)),
                     encoding="utf-8")
    bi = str(tmp_path / "bi-encoder")
    assert main(["finetune", "--model", base, "--task", "sentence-embedding", "--train", str(pairs), "--out", bi,
                 "--text-column", "a", "--pair-column", "b", "--label-column", "score", "--max-steps", "2",
                 "--layers", "all", "--backbone-dropout", "0.05"]) == 0
    assert kbert.Embedder.load(bi).layers == [0, 1, 2]
    assert kbert.load_model(bi).config.attention_dropout == 0.05
    assert main(["finetune", "--model", base, "--task", "sentence-embedding", "--train", str(pairs), "--out", bi,
                 "--text-column", "a", "--pair-column", "b", "--layers", "last"]) == 1
    assert "--layers: expected all, -1 or comma-separated integers" in capsys.readouterr().err


def test_class_labels_are_stripped_and_empty_labels_refused(base, tmp_path, capsys):
    """" 1" and "" used to become classes of their own (a 4-class model from a binary TSV)."""
    rows = [{"text": t, "label": l} for t, l in [("재밌어요", "1"), ("최악이다", "0"), ("좋아요", " 1"),
                                                  ("별로", "0 "), ("감동", "1"), ("지루", "0")]]
    summary = kbert.finetune(base, "classification", rows, out_dir=str(tmp_path / "a"), epochs=1, max_length=16)
    assert summary["labels"] == ["0", "1"]
    assert "2 labels: '0' (3 rows), '1' (3 rows)" in capsys.readouterr().err
    rows.append({"text": "빈 라벨", "label": "  "})
    with pytest.raises(ValueError, match="train row 7: the label is empty"):
        kbert.finetune(base, "classification", rows, out_dir=str(tmp_path / "b"), epochs=1, max_length=16,
                       progress=False)


@pytest.mark.slow
def test_finetune_config_file_overrides_and_a_registered_task(base, tmp_path, capsys):
    """`kbert finetune --config` reads the settings from YAML, flags override the file and `--set` the flags;
    unknown keys and missing required ones are refused by name; a task added with `register_task` is driven
    by the same loop."""
    import yaml

    from kbert.cli import main
    from kbert.train.finetune import FinetuneConfig
    from kbert.train.finetune_tasks import TASKS, ClassificationTask, register_task

    rows = movie_review_sentiment(REVIEWS, "train", limit=64)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    config = tmp_path / "ft.yaml"
    config.write_text(yaml.safe_dump({"model": base, "task": "classification", "train": str(train),
                                      "out_dir": str(tmp_path / "from-file"), "max_steps": 50, "epochs": "2",
                                      "learning_rate": "1e-3", "progress": False}), encoding="utf-8")
    loaded = FinetuneConfig.load(str(config), ["max_steps=3", "pooling=mean"])
    assert (loaded.max_steps, loaded.epochs, loaded.learning_rate, loaded.pooling) == (3, 2.0, 1e-3, "mean")
    with pytest.raises(ValueError, match=r"Unknown config key `max_step` \(did you mean `max_steps`\?\)"):
        FinetuneConfig.load(str(config), ["max_step=3"])
    with pytest.raises(ValueError, match=r"Unknown config key `out` \(did you mean `out_dir`\?\)"):
        FinetuneConfig.load(str(config), ["out=elsewhere"])
    with pytest.raises(ValueError, match="`train` is required"):
        kbert.train.finetune.run(FinetuneConfig(model=base, task="classification"))
    assert main(["finetune", "--config", str(config), "--max-steps", "4", "--set", "eval_every=2"]) == 0
    history = json.load(open(tmp_path / "from-file" / "finetune_history.json", encoding="utf-8"))
    assert history["steps"] == 4 and [h["step"] for h in history["history"]] == [2, 4]
    assert main(["finetune", "--config", str(config), "--set", "epochs=-1"]) == 1
    assert "`epochs` must be a positive number" in capsys.readouterr().err

    @register_task
    class Flipped(ClassificationTask):  # the same head, trained to predict the other class
        name = "flipped-classification"

        def targets(self, raw, encodings, split):
            return 1 - super().targets(raw, encodings, split)
    try:
        # a custom task: the loop runs it; the network is the classification head
        Flipped.name = "classification"
        TASKS["classification"], original = Flipped, TASKS["classification"]
        summary = kbert.finetune(base, "classification", rows, rows, out_dir=str(tmp_path / "flipped"), max_steps=2,
                                 progress=False)
        assert summary["steps"] == 2 and summary["metric"] == "accuracy"
    finally:
        TASKS["classification"] = original
        TASKS.pop("flipped-classification", None)
    with pytest.raises(TypeError, match="FinetuneTask subclass"):
        register_task(object)


def test_in_batch_loss_with_temperature_and_hard_negatives_against_a_hand_computation():
    """The multiple-negatives loss (SimCSE's): row i of anchors @ candidates.T / temperature, cross-entropy
    with target i; hard negatives are extra columns of every row's denominator."""
    from kbert.train.finetune_tasks import in_batch_loss

    rng = np.random.default_rng(0)
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    a, b, neg = (unit(rng.normal(size=(4, 8))).astype("float32") for _ in range(3))
    for candidates, tau in ((b, 0.05), (np.concatenate([b, neg]), 0.05), (b, 1.0)):
        logits = a @ candidates.T / tau
        hand = np.mean([np.log(np.exp(row).sum()) - row[i] for i, row in enumerate(logits.astype("float64"))])
        assert float(in_batch_loss(a, candidates, tau)) == pytest.approx(hand, rel=1e-4)
    # a hard negative close to its anchor raises the loss
    assert float(in_batch_loss(a, np.concatenate([b, a]), 0.05)) > float(in_batch_loss(a, b, 0.05))


def test_in_batch_loss_leaves_a_repeated_text_out_of_the_rows_it_is_no_negative_of():
    """With the texts' identities, row i's denominator leaves out a candidate that is row i's positive again,
    its anchor again, or the positive of another row with the same anchor text (false negatives), and keeps
    everything else, its own positive and hard negative included; a hand computation over the kept columns.
    The identities come from the encoded texts, and a batch carries them in the loss's order."""
    from kbert.train.finetune import FinetuneConfig
    from kbert.train.finetune_tasks import Examples, in_batch_loss, task_for, text_identities

    rng = np.random.default_rng(1)
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    a, b, neg = (unit(rng.normal(size=(4, 8))).astype("float32") for _ in range(3))
    # rows (anchor, positive, negative): 0 (A, P, N0); 1 (B, P, N1): row 0's positive; 2 (A, Q, N2): row 0's
    # anchor; 3 (C, R, A): its hard negative is the text A
    a[2], b[1], neg[3] = a[0], b[0], a[0]
    ids = np.array([0, 1, 0, 2] + [3, 3, 4, 5] + [6, 7, 8, 0], "int32")
    candidates = np.concatenate([b, neg])
    logits = (a @ candidates.T / 0.05).astype("float64")
    dropped = {0: {1, 2, 7}, 1: {0}, 2: {0, 7}, 3: set()}
    hand = np.mean([np.log(sum(np.exp(row[j]) for j in range(8) if j not in dropped[i])) - row[i]
                    for i, row in enumerate(logits)])
    assert float(in_batch_loss(a, candidates, 0.05, text_ids=ids)) == pytest.approx(hand, rel=1e-4)
    assert float(in_batch_loss(a, candidates, 0.05)) > hand  # unmasked, the repeats count as negatives
    # SimCSE: the anchors are their own positives; a line twice in the batch is no negative of itself
    lines = unit(rng.normal(size=(3, 8))).astype("float32")
    lines[2] = lines[0]
    second = unit(lines + 0.5 * rng.normal(size=(3, 8))).astype("float32")  # the second dropout pass
    twice = np.array([0, 1, 0, 0, 1, 0], "int32")
    logits = (lines @ second.T / 0.05).astype("float64")
    keep = {0: [0, 1], 1: [0, 1, 2], 2: [1, 2]}
    hand = np.mean([np.log(np.exp(row[keep[i]]).sum()) - row[i] for i, row in enumerate(logits)])
    assert float(in_batch_loss(lines, second, 0.05, text_ids=twice)) == pytest.approx(hand, rel=1e-4)

    # identities: equal exactly where the encoded texts are (one numbering across the columns)
    assert text_identities([[[5, 6], [7], [5, 6]], [[7], [7], [5]]]).tolist() == [[0, 1], [1, 1], [0, 2]]
    task = task_for(FinetuneConfig(model="m", task="sentence-embedding", text_column="q", pair_column="p",
                                   label_column=None, negative_column="n"))
    ex = Examples([[1, 2], [3], [1, 2]], None, None, pair_token_ids=[[4], [4], [5]],
                  negative_token_ids=[[6], [7], [1, 2]], text_ids=text_identities([[[1, 2], [3], [1, 2]],
                                                                                   [[4], [4], [5]],
                                                                                   [[6], [7], [1, 2]]]))
    feats, y, n, _ = task.training_batch(ex, np.array([2, 0, 1]), 0)
    assert n == 3 and feats["token_ids"].shape[0] == 9
    assert y.tolist() == [0, 0, 3, 5, 1, 1, 0, 2, 4]  # anchors, positives, negatives of rows 2, 0, 1
    # with a guide model's vectors of the distinct texts, the batch carries them in the same order
    ex.guide = np.arange(6 * 2, dtype="float32").reshape(6, 2)
    _, y, _, _ = task.training_batch(ex, np.array([2, 0, 1]), 0)
    assert y["text_ids"].tolist() == [0, 0, 3, 5, 1, 1, 0, 2, 4]
    np.testing.assert_array_equal(y["guide"], ex.guide[[0, 0, 3, 5, 1, 1, 0, 2, 4]])


def test_a_guide_model_leaves_what_it_ranks_above_the_positive_out_of_the_negatives():
    """GISTEmbed: candidate j of row i leaves row i's denominator when the guide's cosine (anchor i, j)
    exceeds its cosine (anchor i, positive i) less the margin; the row's own positive always stays; a
    hand computation over the kept columns, for margins 0 and 0.2."""
    from kbert.train.finetune_tasks import in_batch_loss

    rng = np.random.default_rng(2)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    a, b, neg = (unit(rng.normal(size=(4, 8))).astype("float32") for _ in range(3))
    candidates = np.concatenate([b, neg])
    g = unit(rng.normal(size=(12, 5))).astype("float32")  # the guide's vectors: anchors, positives, negatives
    g_sim = g[:4] @ g[4:].T
    g_pos = np.sum(g[:4] * g[4:8], axis=1)
    logits = (a @ candidates.T / 0.05).astype("float64")
    for margin in (0.0, 0.2):
        keep = [[j for j in range(8) if j == i or not g_sim[i, j] > g_pos[i] - margin] for i in range(4)]
        hand = np.mean([np.log(np.exp(row[keep[i]]).sum()) - row[i] for i, row in enumerate(logits)])
        got = float(in_batch_loss(a, candidates, 0.05, guide=g, guide_margin=margin))
        assert got == pytest.approx(hand, rel=1e-4)
    assert sum(len(k) for k in keep) < 4 * 8  # the guide did leave some out
    # a guide that agrees with the positive above everything leaves every negative in
    same = np.concatenate([a, a, -a])
    assert float(in_batch_loss(a, candidates, 0.05, guide=same)) == pytest.approx(
        float(in_batch_loss(a, candidates, 0.05)), rel=1e-5)


def test_the_symmetric_in_batch_loss_is_the_mean_of_both_directions_with_the_same_masking():
    """symmetric=True: the loss is the mean of the usual direction (anchor i picks positive i among the
    positives and hard negatives) and the reverse (positive i picks anchor i among the anchors only); the
    reverse leaves out an anchor of the same text as anchor i, or whose positive is positive i's text; a
    hand computation of both. A scored set refuses it; in `datasets`, the run's flag reaches only the
    in-batch sets."""
    from kbert.train.finetune import FinetuneConfig
    from kbert.train.finetune_tasks import Examples, task_for, text_identities

    rng = np.random.default_rng(3)
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    a, p, neg = (unit(rng.normal(size=(4, 8))).astype("float32") for _ in range(3))
    # rows (anchor, positive, negative): 0 (A, P, N0); 1 (B, P, N1); 2 (A, Q, N2); 3 (C, R, N3)
    a[2], p[1] = a[0], p[0]
    ex = Examples([[1], [2], [1], [3]], None, None, pair_token_ids=[[4], [4], [5], [6]],
                  negative_token_ids=[[7], [8], [9], [10]],
                  text_ids=text_identities([[[1], [2], [1], [3]], [[4], [4], [5], [6]], [[7], [8], [9], [10]]]))

    def task(symmetric):
        return task_for(FinetuneConfig(model="m", task="sentence-embedding", text_column="q", pair_column="p",
                                       label_column=None, negative_column="n", symmetric=symmetric))
    _, y, n, _ = task(True).training_batch(ex, np.arange(4), 0)
    v = np.concatenate([a, p, neg])

    def hand(logits, dropped):
        return np.mean([np.log(sum(np.exp(row[j]) for j in range(len(row)) if j not in dropped[i])) - row[i]
                        for i, row in enumerate(logits.astype("float64"))])
    forward = hand(a @ np.concatenate([p, neg]).T / 0.05, {0: {1, 2}, 1: {0}, 2: {0}, 3: set()})
    backward = hand(p @ a.T / 0.05, {0: {1, 2}, 1: {0}, 2: {0}, 3: set()})
    assert float(task(False).embedding_loss(v, y, n)) == pytest.approx(forward, rel=1e-4)
    assert float(task(True).embedding_loss(v, y, n)) == pytest.approx((forward + backward) / 2, rel=1e-4)
    assert abs(forward - backward) > 1e-3  # the two directions are different numbers

    with pytest.raises(ValueError, match="`symmetric` is a form of the in-batch loss"):
        task_for(FinetuneConfig(model="m", task="sentence-embedding", text_column="a", pair_column="b",
                                label_column="score", symmetric=True)).check()
    with pytest.raises(ValueError, match="`symmetric` must be True or False"):
        task_for(FinetuneConfig(model="m", task="sentence-embedding", text_column="a", pair_column="b",
                                label_column=None, symmetric="yes")).check()
    with pytest.raises(ValueError, match="goes with task='sentence-embedding'"):
        FinetuneConfig(model="m", task="classification", train="t.tsv", symmetric=True).validate()
    mixed = task_for(FinetuneConfig(model="m", task="sentence-embedding", symmetric=True, datasets=[
        {"data": [], "text_column": "a", "pair_column": "b", "label_column": "score"},
        {"data": [], "text_column": "q", "pair_column": "p"}]))
    mixed.check()
    assert [part.config.symmetric for part, _ in mixed.parts] == [False, True]
    with pytest.raises(ValueError, match=r"`datasets\[0\]`: `symmetric` is a form"):
        task_for(FinetuneConfig(model="m", task="sentence-embedding", datasets=[
            {"data": [], "text_column": "a", "pair_column": "b", "label_column": "score", "symmetric": True}])).check()


def test_finetune_with_a_guide_model_filters_in_batch_negatives(base, tmp_path, capsys):
    """`guide=`: the guide's vectors of every distinct training text are computed before training; a margin
    under which it leaves nothing out trains exactly as without it, a wide one leaves most negatives out
    (a lower loss); bad uses are refused by name. symmetric=True trains too (its loss is checked by hand
    above), and --symmetric on scored pairs is refused."""
    texts = [r["text"] for r in movie_review_sentiment(REVIEWS, "train", limit=96)]
    pairs = [{"a": t, "p": t[: max(1, len(t) // 2)]} for t in texts]
    run = dict(text_column="a", pair_column="p", label_column=None, max_steps=2, batch_size=16, max_length=32,
               eval_every=1, progress=False)

    def losses(name, **kw):
        summary = kbert.finetune(base, "sentence-embedding", pairs, out_dir=str(tmp_path / name), **run, **kw)
        return [h["train_loss"] for h in summary["history"]]
    plain = losses("plain")
    both = losses("symmetric", symmetric=True)  # both directions: trains, and is another loss
    assert all(np.isfinite(both)) and both[0] != pytest.approx(plain[0], rel=1e-4)
    # a margin under which nothing is closer leaves nothing out; a wide one nearly everything
    from kbert.train.finetune import guide_left_out
    from kbert.train.finetune_tasks import Examples

    ex = Examples([[1]] * 4, None, None, text_ids=np.array([[0, 1], [2, 3], [4, 5], [6, 7]]),
                  guide=np.eye(8, dtype="float32")[[0, 0, 2, 2, 4, 4, 6, 6]])  # each anchor = its positive
    assert guide_left_out(ex, 4, 0.0) == 0.0 and guide_left_out(ex, 4, 1.5) == 1.0
    assert losses("none-left-out", guide=base, guide_margin=-1.99) == pytest.approx(plain, rel=1e-5)
    wide = losses("wide", guide=base, guide_margin=1.5)
    assert wide[0] < plain[0]
    # gradient caching carries the guide's vectors to the loss as the whole batch does (no dropout: equal)
    whole = losses("whole", guide=base, guide_margin=0.1, backbone_dropout=0.0)
    assert losses("cached", guide=base, guide_margin=0.1, backbone_dropout=0.0, mini_batch_size=8) == \
        pytest.approx(whole, rel=1e-4)
    bad = dict(out_dir=str(tmp_path / "bad"), progress=False, max_steps=1)
    with pytest.raises(ValueError, match="no training set here has them"):
        kbert.finetune(base, "sentence-embedding", os.path.join(KORSTS, "sts-dev.tsv"), text_column="sentence1",
                       pair_column="sentence2", label_column="score", guide=base, **bad)
    with pytest.raises(ValueError, match="`guide` must be a model dir .* is neither"):
        kbert.finetune(base, "sentence-embedding", pairs, text_column="a", pair_column="p", label_column=None,
                       guide=str(tmp_path / "nowhere"), **bad)
    with pytest.raises(ValueError, match="goes with task='sentence-embedding'"):
        kbert.finetune(base, "classification", pairs, text_column="a", label_column="p", guide=base, **bad)
    with pytest.raises(ValueError, match=r"`guide_margin` must be a number in \(-2, 2\)"):
        kbert.finetune(base, "sentence-embedding", pairs, text_column="a", pair_column="p", label_column=None,
                       guide=base, guide_margin=3, **bad)
    from kbert.cli import main

    assert main(["finetune", "--model", base, "--task", "sentence-embedding", "--train",
                 os.path.join(KORSTS, "sts-dev.tsv"), "--out", str(tmp_path / "cli"), "--text-column", "sentence1",
                 "--pair-column", "sentence2", "--label-column", "score", "--symmetric", "--max-steps", "1"]) == 1
    assert "`symmetric` is a form of the in-batch loss" in capsys.readouterr().err


def test_a_finished_run_writes_a_model_card_and_the_sentence_transformers_export_carries_it(base, tmp_path):
    """README.md, as transformers' Trainer and sentence-transformers write one: the Hub's YAML block, the model,
    how to load it, and the training section rendered from the run (data, each dataset's loss, settings, the dev
    figures as the summary has them). A README.md the user wrote is never replaced; the sentence-transformers
    export carries the training section under its own YAML block."""
    import re

    from kbert.models.card import training_section

    texts = [r["text"] for r in movie_review_sentiment(REVIEWS, "train", limit=64)]
    pairs = [{"a": t, "p": t[: max(1, len(t) // 2)]} for t in texts]
    with open(os.path.join(KORSTS, "sts-dev.tsv"), encoding="utf-8") as f:
        head, *lines = [line.rstrip("\n").split("\t") for line in f][:41]
    dev = [dict(zip(head, cells)) for cells in lines]
    out = str(tmp_path / "emb")
    summary = kbert.finetune(base, "sentence-embedding", None, dev, out_dir=out, text_column="sentence1",
                             pair_column="sentence2", label_column="score", max_steps=3, eval_every=1,
                             batch_size=16, max_length=32, progress=False, datasets=[
                                 {"data": pairs, "text_column": "a", "pair_column": "p", "label_column": None,
                                  "symmetric": True},
                                 {"data": os.path.join(KORSTS, "sts-dev.tsv"), "text_column": "sentence1",
                                  "pair_column": "sentence2", "label_column": "score"}])
    with open(os.path.join(out, "README.md"), encoding="utf-8") as f:
        card = f.read()
    front = card.split("---\n")[1]
    assert "library_name: kbert" in front and "pipeline_tag: sentence-similarity" in front and "- ko" in front
    assert "kbert.Embedder.load(" in card and "| architecture | BERT, 2 layers, 64 wide, 2 heads |" in card
    assert "| 1 | rows given in Python | 64 | 1 | in-batch negatives (MultipleNegativesRankingLoss, temperature " \
           "0.05), both directions (symmetric) |" in card
    assert "| 2 | `sts-dev.tsv` | 1,500 | 1 | cosine regression onto score" in card
    assert f"**{summary['best']:.4f}** at step {summary['best_step']}" in card
    assert f"{summary['baseline']['spearman']:.4f} before training" in card
    assert "fine-tuned from `" + os.path.basename(base) + "`" in card and str(tmp_path) not in card
    # a pretraining run's model dir is OUT/model: the card names the run, not "model"
    from kbert.models.card import shown_name

    assert shown_name(str(tmp_path / "run-ko" / "model")) == "`run-ko/model`" and shown_name("klue/bert-base") == \
        "`klue/bert-base`" and shown_name(str(tmp_path / "run-ko")) == "`run-ko`"
    rows = re.findall(r"^\| (\d+) \| [\d.]+ \| [\d.]+ \|", card, flags=re.M)
    assert [int(r) for r in rows] == [h["step"] for h in summary["history"]] == [1, 2, 3]
    # the sentence-transformers export: its own YAML block, the same training section
    st = kbert.export_sentence_transformers(out, str(tmp_path / "emb-st"))
    with open(os.path.join(st, "README.md"), encoding="utf-8") as f:
        st_card = f.read()
    assert "library_name: sentence-transformers" in st_card and "SentenceTransformer(" in st_card
    assert training_section(st) == training_section(out) is not None
    # a README.md the user wrote stays
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "README.md").write_text("# my model\n", encoding="utf-8")
    kbert.finetune(base, "classification", [{"text": t, "label": i % 2} for i, t in enumerate(texts)],
                   out_dir=str(mine), max_steps=1, max_length=32, progress=False)
    assert (mine / "README.md").read_text(encoding="utf-8") == "# my model\n"
    assert os.path.isfile(mine / "kbert_task.json")


@pytest.mark.slow
def test_simcse_hard_negatives_and_matryoshka_train_a_bi_encoder(base, tmp_path):
    """objective='simcse' trains on single texts (two dropout passes of a text differ, and are its positive),
    evaluated on scored dev pairs; hard negatives and Matryoshka widths run; bad settings are refused."""
    from kbert.data.features import features
    from kbert.models.io import with_dropout

    texts = [r["text"] for r in movie_review_sentiment(REVIEWS, "train", limit=200)]
    sts = os.path.join(KORSTS, "sts-dev.tsv")
    rows = [{"sentence1": t} for t in texts]
    summary = kbert.finetune(base, "sentence-embedding", rows, sts, out_dir=str(tmp_path / "simcse"), objective="simcse",
                             text_column="sentence1", pair_column="sentence2", label_column="score", max_steps=4,
                             eval_every=2, batch_size=16, max_length=32, matryoshka_dims=[16, 32], progress=False)
    assert summary["steps"] == 4 and summary["metric"] == "spearman"
    assert all(np.isfinite(h["train_loss"]) for h in summary["history"])
    assert kbert.load_model(str(tmp_path / "simcse")).config.dropout > 0  # SimCSE keeps the model's dropout
    # the two copies of a text in a SimCSE batch get different dropout masks, so different vectors
    emb = kbert.Embedder.load(str(tmp_path / "simcse"))
    ids = np.array([emb.tokenizer.encode(texts[0]).ids] * 2, "int32")
    out = emb.backbone(features(ids, np.zeros_like(ids), emb.tokenizer.pad_id), training=True)["sequence_output"]
    assert not np.allclose(np.asarray(out[0]), np.asarray(out[1]), atol=1e-4)
    quiet = with_dropout(emb.backbone, 0.0)
    out = quiet(features(ids, np.zeros_like(ids), emb.tokenizer.pad_id), training=True)["sequence_output"]
    assert np.allclose(np.asarray(out[0]), np.asarray(out[1]), atol=1e-5)
    # (anchor, positive, hard negative) rows
    triplets = [{"a": t, "p": t[: max(1, len(t) // 2)], "n": texts[(i + 7) % len(texts)]} for i, t in enumerate(texts)]
    summary = kbert.finetune(base, "sentence-embedding", triplets, out_dir=str(tmp_path / "hard"), text_column="a",
                             pair_column="p", label_column=None, negative_column="n", max_steps=3, batch_size=16,
                             max_length=32, progress=False)
    assert summary["steps"] == 3
    # both in one run (SimCSE on the raw texts, in-batch + hard negatives on the triplets), dev on KorSTS
    multi = dict(text_column="sentence1", pair_column="sentence2", label_column="score",
                 datasets=[{"data": rows, "text_column": "sentence1", "objective": "simcse", "name": "raw"},
                           {"data": triplets, "text_column": "a", "pair_column": "p", "negative_column": "n",
                            "weight": 2}],
                 epochs=1, batch_size=32, max_length=32, progress=False)
    summary = kbert.finetune(base, "sentence-embedding", None, sts, out_dir=str(tmp_path / "multi"), **multi)
    assert summary["steps"] == 7 + 2 * 7 and summary["metric"] == "spearman"  # 200 rows: 7 batches, twice
    # each dataset's own mean train loss beside the mixed one (7 SimCSE batches and 14 triplet batches)
    entry, = summary["history"]
    assert entry["train_loss"] == pytest.approx((7 * entry["train_loss_raw"] + 14 * entry["train_loss_2"]) / 21)
    with open(os.path.join(str(tmp_path / "multi"), "README.md"), encoding="utf-8") as f:
        card = f.read()
    assert "| step | epoch | train_loss | train_loss_raw | train_loss_2 |" in card and "| raw | " in card
    # TensorBoard curves in OUT/logs: the loss every 10 steps (each dataset's too), the dev metrics per evaluation
    curves = kbert.read_scalars(str(tmp_path / "multi" / "logs"))
    assert sorted(curves["train/loss"]) == [10, 20] and set(curves["train/loss_raw"]) | set(curves["train/loss_2"])
    assert curves["dev/spearman"] == {21: pytest.approx(entry["dev_spearman"])}
    # stopped after 10 of the 21 steps and resumed: the same figures, the first 10 steps' losses each in its own
    kbert.finetune(base, "sentence-embedding", None, sts, out_dir=str(tmp_path / "multi-part"), stop_after=10, **multi)
    rest, = kbert.finetune(base, "sentence-embedding", None, sts, out_dir=str(tmp_path / "multi-part"),
                           **multi)["history"]
    assert sorted(rest) == sorted(entry)
    np.testing.assert_allclose([rest[k] for k in sorted(entry)], [entry[k] for k in sorted(entry)], rtol=1e-4)
    resumed = kbert.read_scalars(str(tmp_path / "multi-part" / "logs"))
    assert sorted(resumed) == sorted(curves)
    for tag, points in curves.items():
        assert sorted(resumed[tag]) == sorted(points), tag
        np.testing.assert_allclose([resumed[tag][s] for s in points], list(points.values()), rtol=1e-4)
    bad = dict(out_dir=str(tmp_path / "bad"), progress=False, max_steps=1)
    with pytest.raises(ValueError, match="no dropout"):
        kbert.finetune(base, "sentence-embedding", rows, objective="simcse", text_column="sentence1",
                       backbone_dropout=0.0, **bad)
    with pytest.raises(ValueError, match="`negative_column` .* unscored"):
        kbert.finetune(base, "sentence-embedding", triplets, text_column="a", pair_column="p", label_column="score",
                       negative_column="n", **bad)
    with pytest.raises(ValueError, match="`objective` for task='sentence-embedding' must be one of"):
        kbert.finetune(base, "sentence-embedding", rows, objective="infonce", **bad)
    with pytest.raises(ValueError, match="`matryoshka_dims` must be positive integers"):
        kbert.finetune(base, "sentence-embedding", triplets, text_column="a", pair_column="p", label_column=None,
                       matryoshka_dims=[0], **bad)
    with pytest.raises(ValueError, match=r"`matryoshka_dims` \[16, 4096\] go beyond .* 64 dimensions"):
        kbert.finetune(base, "sentence-embedding", triplets, text_column="a", pair_column="p", label_column=None,
                       matryoshka_dims=[4096, 16], **bad)
    # in-batch negatives from a batch of one: the loss would be 0 and nothing would learn, silently
    with pytest.raises(ValueError, match=r"in-batch negatives \(SimCSE\) need `batch_size` >= 2"):
        kbert.finetune(base, "sentence-embedding", rows, objective="simcse", text_column="sentence1",
                       batch_size=1, **bad)
    with pytest.raises(ValueError, match=r"need at least 2 training rows.* has 1"):
        kbert.finetune(base, "sentence-embedding", triplets[:1], text_column="a", pair_column="p",
                       label_column=None, **bad)
    with pytest.raises(ValueError, match=r"`datasets\[1\]`: in-batch negatives .* has 1"):
        kbert.finetune(base, "sentence-embedding", None, datasets=[
            {"data": rows, "text_column": "sentence1", "objective": "simcse"},
            {"data": triplets[:1], "text_column": "a", "pair_column": "p"}], **bad)
    with pytest.raises(ValueError, match=r"at least 2 different texts to tell apart; every training row's "
                                         r"positive is the same text"):
        kbert.finetune(base, "sentence-embedding", [{"a": t, "p": "같은 문장"} for t in texts[:8]],
                       text_column="a", pair_column="p", label_column=None, **bad)
    with pytest.raises(ValueError, match="`datasets` is empty"):
        kbert.finetune(base, "sentence-embedding", None, datasets=[], **bad)
    # a hard negative is a candidate of its own: one row, or a batch of one, still learns
    kbert.finetune(base, "sentence-embedding", triplets[:1], text_column="a", pair_column="p", label_column=None,
                   negative_column="n", batch_size=1, **bad)


def test_multi_dataset_batches_keep_to_one_dataset_in_the_stated_proportion():
    """Every batch of a multi-dataset epoch comes from one dataset; proportional mixing gives each dataset its
    size times its weight in batches, shuffled together; round-robin alternates while they last; bad specs
    are refused by name."""
    from kbert.train.finetune import FinetuneConfig
    from kbert.train.finetune_tasks import Examples, MultiExamples, task_for

    def config(mix, weights=(1, 1)):
        return FinetuneConfig(model="m", task="sentence-embedding", mix=mix, datasets=[
            {"data": "a.tsv", "text_column": "t", "objective": "simcse", "weight": weights[0]},
            {"data": "b.tsv", "text_column": "q", "pair_column": "p", "negative_column": "n", "weight": weights[1]}])
    parts = MultiExamples([Examples([[7] * 5] * 100, None, None),
                           Examples([[7] * 4] * 30, None, None, pair_token_ids=[[7] * 3] * 30,
                                    negative_token_ids=[[7] * 6] * 30)])
    task = task_for(config("proportional", (1, 2)))
    task.check()
    batches = task.epoch_batches(np.random.default_rng(0), parts, 10, True)
    assert len(batches) == task.batches_per_epoch(parts, 10) == 10 + 2 * 3
    assert sum(k == 0 for k, _ in batches) == 10 and sum(k == 1 for k, _ in batches) == 6
    assert [k for k, _ in batches] != sorted(k for k, _ in batches)  # shuffled together
    assert all(index.max() < len(parts.parts[k]) for k, index in batches)  # indices of their own dataset
    feats, y, n, key = task.training_batch(parts, batches[0], 0)
    assert key == batches[0][0] and n == len(batches[0][1]) and y is None
    assert feats["token_ids"].shape[0] == (2 if key == 0 else 3) * n  # SimCSE: twice; triplets: three texts
    robin = task_for(config("round_robin")).epoch_batches(np.random.default_rng(0), parts, 10, False)
    assert [k for k, _ in robin][:6] == [0, 1, 0, 1, 0, 1] and [k for k, _ in robin][6:] == [0] * 7
    with pytest.raises(ValueError, match="`mix` must be one of"):
        task_for(config("random")).check()
    # each dataset's mean train loss over a window of steps, by its loss key (a name each, default its number)
    from kbert.train.finetune import losses_by_key

    assert task.loss_names == ["train_loss_1", "train_loss_2"] and task_for(FinetuneConfig(
        model="m", task="sentence-embedding", train="a.tsv", objective="simcse")).loss_names == []
    assert losses_by_key(task.loss_names, [1.0, 3.0, 2.0, 6.0], [0, 1, 0, 1]) == {"train_loss_1": 1.5,
                                                                                  "train_loss_2": 4.5}
    assert losses_by_key(task.loss_names, [1.0], [1]) == {"train_loss_2": 1.0}  # none of dataset 1 in the window
    same = FinetuneConfig(model="m", task="sentence-embedding", datasets=[
        {"data": "a", "text_column": "t", "objective": "simcse", "name": "x"},
        {"data": "b", "text_column": "t", "objective": "simcse", "name": "x"}])
    with pytest.raises(ValueError, match="`datasets` names must differ"):
        task_for(same)
    bad = FinetuneConfig(model="m", task="sentence-embedding", datasets=[{"data": "a", "text": "t"}])
    with pytest.raises(ValueError, match=r"`datasets\[0\]` has unknown key 'text'"):
        task_for(bad)
    bad = FinetuneConfig(model="m", task="sentence-embedding", datasets=[{"data": "a", "text_column": "t"}])
    with pytest.raises(ValueError, match=r"`datasets\[0\]`: task='sentence-embedding' needs `pair_column`"):
        task_for(bad).check()


def test_negatives_mined_by_the_model_train_a_bi_encoder(base, tmp_path):
    """Question-pair paraphrases get negatives mined by the model from every question of the split; the rows
    feed kbert.finetune's hard-negative column as they are."""
    import csv

    with open(os.path.join(SHARED, "question-pair", "train.txt"), encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[:300]
    pairs = [{"anchor": r["question1"], "positive": r["question2"]} for r in rows
             if r["is_duplicate"].strip() == "0" and r["question1"] != r["question2"]]
    corpus = sorted({r[c] for r in rows for c in ("question1", "question2")})
    report = {}
    mined = kbert.mine_hard_negatives(base, pairs, corpus, num_negatives=2, progress=False, report=report)
    # a random model: a few pairs have no candidate scored under 95% of their own positive
    assert report["candidates"] == len(corpus) and report["with_negatives"] >= 0.9 * len(pairs)
    with_one = report["short"] - (len(pairs) - report["with_negatives"])  # short: fewer than 2, none included
    assert len(mined) == report["rows"] == 2 * report["with_negatives"] - with_one
    own = {}
    for p in pairs:
        own.setdefault(p["anchor"], set()).update({p["anchor"], p["positive"]})
    assert all(r["negative"] not in own[r["anchor"]] for r in mined)
    emb = kbert.Embedder.load(base)
    a, p, n = (emb.encode([r[c] for r in mined[:40]], progress=False) for c in ("anchor", "positive", "negative"))
    assert np.all(np.sum(a * n, axis=1) <= 0.95 * np.sum(a * p, axis=1) + 1e-4)  # the default relative margin
    summary = kbert.finetune(base, "sentence-embedding", mined, out_dir=str(tmp_path / "mined"), text_column="anchor",
                             pair_column="positive", label_column=None, negative_column="negative", max_steps=3,
                             batch_size=16, max_length=32, progress=False)
    assert summary["steps"] == 3 and all(np.isfinite(h["train_loss"]) for h in summary["history"])


def test_candidate_pairs_scored_by_a_teacher_dir_train_a_student(base, tmp_path):
    """Augmented SBERT from model dirs: KorSTS sentences paired by `kbert.candidate_pairs`, scored by
    `kbert.label_pairs` with a dir (and a two-dir ensemble of it, which scores the same) on the gold labels'
    scale, the gold line checked by hand; the rows train a bi-encoder as they are."""
    import csv

    with open(os.path.join(KORSTS, "sts-train.tsv"), encoding="utf-8") as f:
        gold = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[:60]
    pairs = kbert.candidate_pairs([r[c] for r in gold for c in ("sentence1", "sentence2")], seed=0, progress=False,
                                  exclude=[(r["sentence1"], r["sentence2"]) for r in gold])
    assert len(pairs) > len(gold)
    report = {}
    silver = kbert.label_pairs(base, pairs, gold=gold, progress=False, report=report)
    emb = kbert.Embedder.load(base)

    def cos(a, b):
        return np.sum(emb.encode(a, progress=False) * emb.encode(b, progress=False), axis=1)

    labels = [float(r["score"]) for r in gold]
    slope, intercept = np.polyfit(cos([r["sentence1"] for r in gold], [r["sentence2"] for r in gold]), labels, 1)
    want = np.clip(slope * cos([a for a, _ in pairs], [b for _, b in pairs]) + intercept, min(labels), max(labels))
    np.testing.assert_allclose([r["score"] for r in silver], want, atol=2e-3)
    assert report["slope"] == pytest.approx(slope, rel=1e-3)
    twice = kbert.label_pairs([base, base], pairs[:20], gold=gold, progress=False)
    np.testing.assert_allclose([r["score"] for r in twice], [r["score"] for r in silver[:20]], atol=2e-3)
    summary = kbert.finetune(base, "sentence-embedding", gold + silver, out_dir=str(tmp_path / "student"),
                             text_column="sentence1", pair_column="sentence2", label_column="score", max_steps=3,
                             batch_size=16, max_length=32, progress=False)
    assert summary["steps"] == 3 and all(np.isfinite(h["train_loss"]) for h in summary["history"])


def test_training_prompts_equal_the_texts_written_with_them_and_the_model_keeps_its_prompts(base, tmp_path):
    """`prompts` (sentence-transformers' training prompts) trains exactly as the same rows with the prompt
    written before each text; `model_prompts` (or a sentence-transformers start's own) stay with the output for
    inference; per-dataset prompts and bad names."""
    texts = [r["text"] for r in movie_review_sentiment(REVIEWS, "train", limit=64)]
    pairs = [{"a": t, "p": t[: max(1, len(t) // 2)], "n": texts[(i + 5) % len(texts)]} for i, t in enumerate(texts)]
    written = [{"a": "질문: " + r["a"], "p": "문서: " + r["p"], "n": "문서: " + r["n"]} for r in pairs]
    common = dict(text_column="a", pair_column="p", label_column=None, negative_column="n", max_steps=2,
                  batch_size=16, max_length=32, progress=False, seed=3, learning_rate=2e-3, warmup=0.0)
    kbert.finetune(base, "sentence-embedding", pairs, out_dir=str(tmp_path / "prompted"),
                   prompts={"a": "질문: ", "p": "문서: ", "n": "문서: "},
                   model_prompts={"query": "질문: ", "document": "문서: "}, **common)
    kbert.finetune(base, "sentence-embedding", written, out_dir=str(tmp_path / "written"), **common)
    prompted, plain = kbert.Embedder.load(str(tmp_path / "prompted")), kbert.Embedder.load(str(tmp_path / "written"))
    np.testing.assert_allclose(prompted.encode(texts[:8]), plain.encode(texts[:8]), atol=1e-5)
    kbert.finetune(base, "sentence-embedding", pairs, out_dir=str(tmp_path / "none"), **common)
    unprompted = kbert.Embedder.load(str(tmp_path / "none"))  # the control: without the prompts, other weights
    assert not np.allclose(unprompted.encode(texts[:8]), plain.encode(texts[:8]), atol=1e-3)
    assert prompted.prompts == {"query": "질문: ", "document": "문서: "} and plain.prompts == {}
    np.testing.assert_allclose(prompted.encode_query(texts[:4]), plain.encode(["질문: " + t for t in texts[:4]]),
                               atol=1e-5)
    # a sentence-transformers start keeps its prompts through fine-tuning (as sentence-transformers saves them)
    st_dir = kbert.export_sentence_transformers(prompted, str(tmp_path / "st"))
    kbert.finetune(st_dir, "sentence-embedding", pairs, out_dir=str(tmp_path / "again"), **common)
    assert kbert.Embedder.load(str(tmp_path / "again")).prompts["query"] == "질문: "
    # one string for every text column, per dataset, and as the run's {column: prompt} for several datasets
    kbert.finetune(base, "sentence-embedding", None, out_dir=str(tmp_path / "multi"),
                   datasets=[{"data": pairs, "text_column": "a", "pair_column": "p", "prompts": "질문: "},
                             {"data": written, "text_column": "a", "pair_column": "p"}],
                   prompts={"p": "문서: "}, max_steps=2, batch_size=16, max_length=32, progress=False)
    bad = dict(out_dir=str(tmp_path / "bad"), max_steps=1, progress=False)
    with pytest.raises(ValueError, match="names column 'q', which is not a text column"):
        kbert.finetune(base, "sentence-embedding", pairs, text_column="a", pair_column="p", label_column=None,
                       prompts={"q": "질문: "}, **bad)
    with pytest.raises(ValueError, match="no dataset has as a text column"):
        kbert.finetune(base, "sentence-embedding", None, datasets=[{"data": pairs, "text_column": "a",
                                                                    "pair_column": "p"}], prompts={"q": "x"}, **bad)
    with pytest.raises(ValueError, match="go with task='sentence-embedding'"):
        kbert.finetune(base, "classification", movie_review_sentiment(REVIEWS, "train", limit=8), prompts="x: ",
                       **bad)


def _marker_questions(n, seed):
    """Reading comprehension on KorSTS sentences: each context is three sentences with "정답은 X 입니다." put
    after one of them (X a word of another), and the answer is X: found by reading, at any place in a context
    longer than one window."""
    import random

    with open(os.path.join(KORSTS, "sts-train.tsv"), encoding="utf-8") as f:
        sents = list(dict.fromkeys(line.rstrip("\n").split("\t")[5] for line in list(f)[1:]))
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        parts = rng.sample(sents, 3)
        word = rng.choice(rng.choice(parts).split())
        parts.insert(rng.randrange(4), f"정답은 {word} 입니다.")
        context = " ".join(parts)
        start = context.index(f"정답은 {word} 입니다.") + len("정답은 ")
        rows.append({"id": f"{seed}-{i}", "question": "정답은 무엇입니까?", "context": context,
                     "answers": {"text": [word], "answer_start": [start]}})
    return rows


@pytest.mark.slow
def test_question_answering_learns_to_find_answers_over_windows(base, tmp_path, capsys):
    """A reader trained from a SQuAD-format file (KorQuAD's layout) on contexts longer than max_length (several
    windows each, the answer in any of them) learns to find the answer: dev exact match far above the untrained
    model's; `answer` returns spans of the original context; the card names the pipeline; the command line
    trains one too; an answer_start that misses its text is refused by row."""
    from kbert.cli import main

    train, dev = _marker_questions(2500, 0), _marker_questions(300, 1)
    path = tmp_path / "train.json"
    articles = [{"title": r["id"], "paragraphs": [{"context": r["context"], "qas": [
        {"id": r["id"], "question": r["question"],
         "answers": [{"text": r["answers"]["text"][0], "answer_start": r["answers"]["answer_start"][0]}]}]}]}
        for r in train]
    path.write_text(json.dumps({"version": "1", "data": articles}, ensure_ascii=False), encoding="utf-8")
    out = str(tmp_path / "reader")
    summary = kbert.finetune(base, "question-answering", str(path), dev, out_dir=out, epochs=2, learning_rate=2e-3,
                             max_length=48, doc_stride=16, progress=False)
    assert summary["metric"] == "f1"
    best = max(summary["history"], key=lambda h: h["dev_f1"])
    assert summary["baseline"]["exact_match"] < 10, summary["baseline"]  # untrained: long random spans
    assert best["dev_exact_match"] > 40 and best["dev_f1"] > summary["baseline"]["f1"] + 30, summary["history"]
    model = kbert.TaskModel.load(out)
    assert model.max_length == 48 and model.meta["doc_stride"] == 16
    found = model.answer([r["question"] for r in dev[:50]], [r["context"] for r in dev[:50]])
    assert all(r["context"][f["start"]:f["end"]] == f["answer"] for r, f in zip(dev, found))
    assert np.mean([f["answer"] == r["answers"]["text"][0] for r, f in zip(dev, found)]) > 0.3
    card = open(os.path.join(out, "README.md"), encoding="utf-8").read()
    assert "pipeline_tag: question-answering" in card and "model.answer(" in card
    with pytest.raises(ValueError, match="no SavedModel signature"):
        kbert.export(out, str(tmp_path / "serving"))
    assert main(["finetune", "--model", base, "--task", "question-answering", "--train", str(path), "--out",
                 str(tmp_path / "cli"), "--max-steps", "3", "--max-length", "40", "--doc-stride", "8"]) == 0
    assert json.load(open(os.path.join(tmp_path, "cli", "kbert_task.json"), encoding="utf-8"))["doc_stride"] == 8
    with pytest.raises(ValueError, match="does not point at the answer"):
        kbert.finetune(base, "question-answering", [dict(train[0], answers={"text": ["없는"], "answer_start": [0]})],
                       out_dir=str(tmp_path / "bad"), progress=False)
