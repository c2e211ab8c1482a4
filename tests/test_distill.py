"""Knowledge distillation (`kbert.distill`, `kbert distill`): the loss pieces against hand computations, each
mode learning on real Korean text from a small fine-tuned teacher, exact resume, and bad input refused by
name. Teachers and students are tiny random-initialized models, so the tests check that a student learns its
teacher, not a score."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import kbert
from kbert.data.recipes import movie_review_sentiment
from kbert.train.distill import embedding_distill_loss, soft_label_loss, soft_target_loss, soft_target_task
from helpers import SHARED, needs_shared

pytestmark = needs_shared
REVIEWS = os.path.join(SHARED, "movie-reviews")
KORSTS = os.path.join(SHARED, "korsts")


def small_config(tok, layers=2, hidden=64):
    return kbert.ModelConfig.preset("bert-tiny", vocab_size=tok.vocab_size, num_layers=layers, hidden_size=hidden,
                                    num_heads=2, intermediate_size=2 * hidden, max_position=128)


@pytest.fixture(scope="module")
def tok():
    texts = [r["text"] for r in movie_review_sentiment(REVIEWS, "train", limit=8000, seed=1)]
    with open(os.path.join(KORSTS, "sts-train.tsv"), encoding="utf-8") as f:
        texts += [c for line in f for c in line.rstrip("\n").split("\t")[5:7]]
    return kbert.Tokenizer.train(texts, vocab_size=2000, progress=False)


@pytest.fixture(scope="module")
def teacher(tok, tmp_path_factory):
    """A 2-layer sentiment classifier fine-tuned on 4,000 reviews (the teacher of task mode)."""
    base = str(tmp_path_factory.mktemp("base"))
    keras.utils.set_random_seed(3)  # the teacher is the same on every run: the students' thresholds are about them
    kbert.save_model(kbert.BertBackbone(small_config(tok)), base, tokenizer=tok)
    out = str(tmp_path_factory.mktemp("teacher"))
    train = movie_review_sentiment(REVIEWS, "train", limit=4000)
    dev = movie_review_sentiment(REVIEWS, "dev", limit=400, seed=11)
    summary = kbert.finetune(base, "classification", train, dev, out_dir=out, epochs=3, learning_rate=1e-3,
                             max_length=48, progress=False)
    assert summary["best"] > 0.65, summary["history"]  # a teacher worth learning from
    return base, out


@pytest.fixture(scope="module")
def sts_teacher(teacher, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sts-teacher"))
    kbert.finetune(teacher[0], "sentence-embedding", os.path.join(KORSTS, "sts-train.tsv"), out_dir=out,
                   text_column="sentence1", pair_column="sentence2", label_column="score", epochs=1,
                   learning_rate=1e-3, max_length=48, progress=False)
    return out


def test_soft_target_loss_is_the_tempered_kl_times_t_squared():
    s = np.array([[1.0, -0.5, 0.2], [0.0, 2.0, -1.0]], np.float32)
    t = np.array([[2.0, 0.0, -1.0], [0.3, 0.3, 0.9]], np.float32)

    def log_softmax(x):
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))

    for temperature in (1.0, 2.0, 4.0):
        p = np.exp(log_softmax(t / temperature))
        want = (p * (log_softmax(t / temperature) - log_softmax(s / temperature))).sum(axis=1) * temperature ** 2
        got = np.asarray(soft_target_loss(s, t, temperature))
        np.testing.assert_allclose(got, want, rtol=1e-5)
    assert np.allclose(np.asarray(soft_target_loss(t, t, 3.0)), 0.0, atol=1e-6)  # the teacher itself: no loss


def test_embedding_loss_matches_the_cosine_matrices_and_the_vectors():
    rng = np.random.default_rng(0)
    student = rng.normal(size=(5, 8)).astype(np.float32) * 3  # not unit: the loss normalizes it
    teacher = rng.normal(size=(5, 8)).astype(np.float32)
    teacher /= np.linalg.norm(teacher, axis=1, keepdims=True)
    s = student / np.linalg.norm(student, axis=1, keepdims=True)
    relation = np.mean((s @ s.T - teacher @ teacher.T) ** 2)
    vectors = np.mean(np.sum((s - teacher) ** 2, axis=1))
    np.testing.assert_allclose(float(embedding_distill_loss(student, teacher)), relation + vectors, rtol=1e-5)
    # a narrower student: only the cosine matrices can be compared
    narrow = student[:, :4]
    n = narrow / np.linalg.norm(narrow, axis=1, keepdims=True)
    np.testing.assert_allclose(float(embedding_distill_loss(narrow, teacher)),
                               np.mean((n @ n.T - teacher @ teacher.T) ** 2), rtol=1e-5)


def test_task_loss_mixes_gold_labels_only_where_rows_have_them(teacher):
    """The task-mode loss of a batch by hand: rows with a gold label get (1 - alpha) soft + alpha CE, rows
    without one (label -1) the soft part alone."""
    from kbert.train.distill import Teacher
    from kbert.train.finetune import FinetuneConfig

    t = Teacher(teacher[1], "task")
    task = soft_target_task(FinetuneConfig(model=teacher[1], task="classification", train=[]), t, 2.0, 0.3)
    logits = np.array([[0.5, -0.5], [1.0, 2.0], [-1.0, 0.0]], np.float32)
    y = np.array([[1, 0.2, 0.1], [-1, 3.0, -1.0], [0, 0.0, 0.0]], np.float32)  # gold, then teacher logits
    got = float(task.loss(lambda feats, training: logits, None, y, 3))
    soft = np.asarray(soft_target_loss(logits, y[:, 1:], 2.0))
    ce = -np.log(np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True))[[0, 1, 2], [1, 0, 0]]
    want = np.mean([0.7 * soft[0] + 0.3 * ce[0], soft[1], 0.7 * soft[2] + 0.3 * ce[2]])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert task.labels == ["0", "1"]


def _multi_label_dir(base, out):
    """A multi-label task dir on `base`: an untrained head of three sigmoid labels."""
    from kbert.data.features import build_network
    from kbert.embed.task_model import TaskModel
    from kbert.models.tasks import TaskNetwork

    emb = kbert.Embedder.load(base)
    network = TaskNetwork(emb.backbone, "classification", 3, 0.0, (0.0, 1.0), "pooler", -1)
    build_network(network, emb.tokenizer)
    meta = {"task": "classification", "labels": ["a", "b", "c"], "max_length": 48, "text_column": "text",
            "pair_column": None, "label_column": "label", "pooling": "pooler", "layers": -1, "multi_label": True}
    return TaskModel(network, emb.tokenizer, meta).save(out)


def test_a_multi_label_teachers_loss_is_per_label_by_hand(teacher, tmp_path):
    """Task mode from a multi-label teacher: each label's soft target is the teacher's sigmoid at temperature T
    (binary cross-entropy less its floor, times T^2: 0 where the student agrees), mixed with the gold labels'
    binary cross-entropy at alpha where a row has them (NaN: none given)."""
    from kbert.train.distill import Teacher
    from kbert.train.finetune import FinetuneConfig

    def bce(p, z):  # per element, of logits z against probabilities p
        return np.logaddexp(0, z) - p * z

    sigmoid = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    s = np.array([[0.5, -0.5, 2.0], [1.0, 2.0, -1.0]], np.float32)
    t = np.array([[1.0, 0.0, -1.0], [3.0, -2.0, 0.5]], np.float32)
    for temperature in (1.0, 2.0):
        p = sigmoid(t / temperature)
        want = (bce(p, s / temperature) - bce(p, t / temperature)).mean(axis=1) * temperature ** 2
        np.testing.assert_allclose(np.asarray(soft_label_loss(s, t, temperature)), want, rtol=1e-5, atol=1e-6)
    assert np.allclose(np.asarray(soft_label_loss(t, t, 2.0)), 0.0, atol=1e-6)
    t_dir = _multi_label_dir(teacher[0], str(tmp_path / "multi"))
    task = soft_target_task(FinetuneConfig(model=t_dir, task="classification", train=[]), Teacher(t_dir, "task"),
                            2.0, 0.3)
    assert task.multi_label and task.extra_meta["multi_label"] and task.labels == ["a", "b", "c"]
    gold = task.targets(["a,c", "", ["b"]], None, "train")
    assert np.array_equal(gold[[0, 2]], [[1, 0, 1], [0, 1, 0]]) and np.isnan(gold[1]).all()
    y = np.concatenate([gold[:2], t], axis=1)
    got = float(task.loss(lambda feats, training: s, None, y, 2))
    soft = np.asarray(soft_label_loss(s, t, 2.0))
    want = np.mean([0.7 * soft[0] + 0.3 * bce(gold[0], s[0]).mean(), soft[1]])
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_teacher_scoring_shows_a_bar_on_large_sets_only(teacher, capfd, monkeypatch):
    """Scoring a large transfer set (outputs in task mode, vectors in embedding mode) runs under a progress
    bar that counts texts; small sets (dev) and progress=False stay silent; the outputs are unchanged."""
    from kbert.train.distill import Teacher

    texts = [f"영화 {i}번째 리뷰 재밌어요" for i in range(40)]
    monkeypatch.setattr(Teacher, "BAR_FROM", 30)
    t = Teacher(teacher[1], "task", progress=True)
    enc = t.tokenizer.encode_batch(texts, max_length=16)
    ids, segs = [e.ids for e in enc], [[0] * len(e.ids) for e in enc]
    loud = t.outputs(ids, segs, batch_size=8)
    err = capfd.readouterr().err
    assert "teacher outputs" in err and "40/40" in err
    t.outputs(ids[:20], segs[:20])
    assert "teacher outputs" not in capfd.readouterr().err
    quiet = Teacher(teacher[1], "task").outputs(ids, segs, batch_size=8)
    assert "teacher outputs" not in capfd.readouterr().err
    np.testing.assert_allclose(loud, quiet, rtol=1e-5, atol=1e-6)
    Teacher(teacher[1], "embedding", progress=True).vectors(texts, 16)
    assert "teacher vectors" in capfd.readouterr().err
    Teacher(teacher[1], "embedding", progress=True, role="guide").vectors(texts, 16)  # fine-tuning's guide=
    assert "guide vectors" in capfd.readouterr().err


@pytest.mark.slow
def test_task_mode_student_learns_its_teacher(tok, teacher, tmp_path):
    """A 1-layer student on reviews the teacher labels (unlabeled text plus a few labeled rows): its
    distillation loss falls and it agrees with the teacher on at least 90% of dev; the output is a task dir."""
    unlabeled = [r["text"] for r in movie_review_sentiment(REVIEWS, "train", limit=6000, seed=5)[3000:]]
    train = movie_review_sentiment(REVIEWS, "train", limit=500, seed=6)
    dev = movie_review_sentiment(REVIEWS, "dev", limit=400)
    out = str(tmp_path / "student")
    summary = kbert.distill(teacher[1], small_config(tok, layers=1), data=unlabeled, train=train, dev=dev,
                            out_dir=out, epochs=2, learning_rate=1e-3, max_length=48, eval_every=40,
                            progress=False)
    assert summary["mode"] == "task" and summary["task"] == "classification"
    history = summary["history"]
    assert history[-1]["train_loss"] < 0.7 * history[0]["train_loss"], history
    # the student starts from the teacher's last layer with a fresh head, so its agreement before training
    # depends on the head's draw (the teacher and the student's seed are fixed, so the draw is too); after
    # training it must be high, and not lower than where it started by more than a few of the 400 dev rows
    # (thread-order noise of the CPU kernels moves a high start by a row or two; a student that unlearned its
    # teacher would lose many)
    agreement = history[-1]["dev_teacher_agreement"]
    assert agreement >= 0.9, (summary["baseline"], history)
    assert agreement >= summary["baseline"]["teacher_agreement"] - 0.015, (summary["baseline"], history)
    model = kbert.TaskModel.load(out)
    assert model.predict(["정말 재밌어요", "최악의 영화"]).shape == (2, 2)
    with open(os.path.join(out, "kbert_task.json"), encoding="utf-8") as f:
        meta = json.load(f)
    assert meta["distill_mode"] == "task" and meta["distilled_from"] == os.path.abspath(teacher[1])
    assert kbert.load_model(out).config.num_layers == 1
    with open(os.path.join(out, "README.md"), encoding="utf-8") as f:  # the card names the teacher and the loss
        card = f.read()
    assert f"distilled from `{os.path.basename(teacher[1])}`" in card and "- loss: distillation from `" in card


@pytest.mark.slow
def test_a_multi_label_teachers_student_learns_each_label(teacher, tok, tmp_path):
    """A multi-label teacher (which of two words a KorSTS sentence holds) teaches a 1-layer student on text it
    never labelled: the student is a multi-label classifier too (a sigmoid a label) and makes the teacher's
    (row, label) decisions on dev."""
    with open(os.path.join(KORSTS, "sts-train.tsv"), encoding="utf-8") as f:
        texts = [line.rstrip("\n").split("\t")[5] for line in f][1:3001]
    words = ("남자", "여자")
    rows = [{"text": t, "tags": [w for w in words if w in t]} for t in texts]
    t_dir = str(tmp_path / "teacher")
    summary = kbert.finetune(teacher[0], "classification", rows[:1300], rows[1300:1600], label_column="tags",
                             multi_label=True, out_dir=t_dir, epochs=4, learning_rate=1e-3, max_length=48,
                             pooling="mean", progress=False)
    assert summary["best"] > 0.85, summary["history"]
    out = str(tmp_path / "student")
    summary = kbert.distill(t_dir, small_config(tok, layers=1), data=texts[1600:], dev=rows[1300:1600],
                            label_column="tags", out_dir=out, epochs=3, learning_rate=1e-3, max_length=48,
                            progress=False)
    assert summary["mode"] == "task" and summary["metric"] == "micro_f1"
    history = summary["history"]
    assert history[-1]["dev_teacher_agreement"] >= 0.9, (summary["baseline"], history)
    student = kbert.TaskModel.load(out)
    assert student.multi_label and student.labels == sorted(words)
    assert not np.allclose(student.predict(texts[:4]).sum(axis=1), 1.0)


@pytest.mark.slow
def test_embedding_mode_student_learns_the_teachers_geometry(tok, sts_teacher, tmp_path):
    """A narrower student (hidden 32 against 64) with its own vocabulary learns the teacher's cosines on
    KorSTS sentences: agreement with the teacher on dev pairs rises; Embedder.load reads the output."""
    with open(os.path.join(KORSTS, "sts-train.tsv"), encoding="utf-8") as f:
        texts = [c for line in list(f)[1:] for c in line.rstrip("\n").split("\t")[5:7]]
    own = kbert.Tokenizer.train(texts, vocab_size=2500, progress=False)
    student = str(tmp_path / "own-vocab")
    kbert.save_model(kbert.BertBackbone(small_config(own, layers=1, hidden=32)), student, tokenizer=own)
    out = str(tmp_path / "student")
    summary = kbert.distill(sts_teacher, student, data=texts[:6000], dev=os.path.join(KORSTS, "sts-dev.tsv"),
                            out_dir=out, text_column="sentence1", pair_column="sentence2", label_column="score",
                            epochs=2, learning_rate=1e-3, max_length=48, progress=False)
    assert summary["mode"] == "embedding"
    history = summary["history"]
    assert history[-1]["train_loss"] < 0.8 * history[0]["train_loss"], history
    assert history[-1]["dev_teacher_agreement"] > summary["baseline"]["teacher_agreement"] + 0.1, (summary["baseline"], history)
    vectors = kbert.Embedder.load(out).encode(["오늘 날씨가 좋다", "날씨가 맑다"])
    assert vectors.shape == (2, 32)
    # its sentence-transformers export names the teacher it was distilled from (it said "fine-tuned from" the
    # dir the student started from)
    card = os.path.join(kbert.export_sentence_transformers(out, str(tmp_path / "st")), "README.md")
    with open(card, encoding="utf-8") as f:
        assert f"distilled from `{os.path.basename(sts_teacher)}`" in f.read()


@pytest.fixture(scope="module")
def pretrained(tok, tmp_path_factory):
    """A 2-layer BERT pretrained for 250 masked-LM steps on reviews: a teacher with a masked-LM head."""
    root = tmp_path_factory.mktemp("pretrained")
    text = root / "reviews.txt"
    text.write_text("\n\n".join(r["text"] for r in movie_review_sentiment(REVIEWS, "train", limit=8000, seed=12)),
                    encoding="utf-8")
    tok_dir = tok.save(str(root / "tok"))
    cfg = small_config(tok)
    summary = kbert.pretrain({
        "model": {"preset": "bert-tiny", "num_layers": 2, "hidden_size": 64, "num_heads": 2,
                  "intermediate_size": 128, "max_position": 128, "dropout": 0.0, "attention_dropout": 0.0},
        "data": {"source": str(text), "tokenizer": tok_dir, "max_length": 32, "workers": 0},
        "optimizer": {"learning_rate": 2e-3, "warmup_steps": 20},
        "trainer": {"steps": 250, "batch_size": 32, "log_every": 50, "checkpoint_every": 1000},
        "runtime": {"strategy": "cpu", "seed": 3}, "output_dir": str(root / "run")}, progress=False)
    assert kbert.load_model(summary["model_dir"]).config.hidden_size == cfg.hidden_size
    return summary["model_dir"]


@pytest.mark.slow
def test_general_mode_student_learns_the_teachers_masked_lm(tok, pretrained, tmp_path):
    """A narrower 1-layer student (hidden 32, so only the masked-LM and relation losses apply) on unlabeled
    reviews: its loss falls and its top masked-LM prediction agrees with the teacher's more often; the output
    is a model dir with its masked-LM head that the Embedder and the Pretrainer loader read."""
    texts = [r["text"] for r in movie_review_sentiment(REVIEWS, "train", limit=6000, seed=13)]
    out = str(tmp_path / "general")
    summary = kbert.distill(pretrained, small_config(tok, layers=1, hidden=32), data=texts[:4000],
                            dev=texts[5000:5400], out_dir=out, epochs=2, learning_rate=2e-3, max_length=32,
                            eval_every=50, progress=False)
    assert summary["mode"] == "general" and summary["metric"] == "teacher_kl"
    history = summary["history"]
    assert history[-1]["train_loss"] < 0.8 * history[0]["train_loss"], history
    assert summary["best"] < 0.5 * summary["baseline"]["teacher_kl"], (summary["baseline"], history)
    assert summary["best"] == min(h["dev_teacher_kl"] for h in history)  # lower is better here
    assert history[-1]["dev_mlm_agreement"] >= summary["baseline"]["mlm_agreement"], (summary["baseline"], history)
    assert not os.path.exists(os.path.join(out, "kbert_task.json"))  # a pretrained-style model dir
    assert isinstance(kbert.load_model(out, with_heads=True), kbert.Pretrainer)
    assert kbert.Embedder.load(out).encode("좋은 영화").shape == (32,)
    # the same-width path: a 1-layer student of width 64 starts from the teacher's last layer
    same = kbert.distill(pretrained, small_config(tok, layers=1), data=texts[:320], dev=texts[5000:5200],
                         out_dir=str(tmp_path / "same"), epochs=1, max_length=32, progress=False)
    assert same["baseline"]["teacher_kl"] < summary["baseline"]["teacher_kl"]


def test_bad_input_fails_fast_with_the_reason(tok, teacher, tmp_path):
    base, tuned = teacher
    with pytest.raises(ValueError, match="no kbert_task.json"):
        kbert.distill(base, "bert-tiny", data=["좋다"], mode="task", out_dir=str(tmp_path / "a"), progress=False)
    with pytest.raises(ValueError, match="no masked-LM head"):  # auto: a plain dir means general mode
        kbert.distill(base, "bert-tiny", data=["좋다"], out_dir=str(tmp_path / "b"), progress=False)
    with pytest.raises(ValueError, match="`mode` must be one of"):
        kbert.distill(tuned, "bert-tiny", data=["좋다"], mode="tiny", out_dir=str(tmp_path / "b"), progress=False)
    other = kbert.Tokenizer.train([r["text"] for r in movie_review_sentiment(REVIEWS, "train", limit=1000, seed=9)],
                                  vocab_size=1600, progress=False)
    student = str(tmp_path / "other-vocab")
    kbert.save_model(kbert.BertBackbone(small_config(other, layers=1)), student, tokenizer=other)
    with pytest.raises(ValueError, match="vocabularies differ"):
        kbert.distill(tuned, student, data=["좋다"], out_dir=str(tmp_path / "c"), progress=False)
    with pytest.raises(ValueError, match="`alpha` must be in"):
        kbert.distill(tuned, "bert-tiny", data=["좋다"], alpha=1.5, out_dir=str(tmp_path / "d"), progress=False)
    with pytest.raises(ValueError, match="`student` must be"):
        kbert.distill(tuned, "bert-enormous", data=["좋다"], out_dir=str(tmp_path / "e"), progress=False)
    with pytest.raises(FileNotFoundError, match="`teacher` must be a model dir"):
        kbert.distill(str(tmp_path / "nowhere"), "bert-tiny", data=["좋다"], progress=False)


def test_a_preset_student_starts_from_the_teachers_layers(tok, teacher, tmp_path):
    """Same width: the student's embeddings and layers are copies of the teacher's (its last layer kept);
    another width: the token embeddings are the teacher's projected on their principal directions."""
    from kbert.train.distill import Teacher, prepare_student

    t = Teacher(teacher[1], "task")
    path = prepare_student(small_config(tok, layers=1), t, str(tmp_path / "same"), 0, False)
    mine, theirs = kbert.load_model(path), kbert.load_model(teacher[1])
    pairs = {"embeddings/token_embedding/embeddings": "embeddings/token_embedding/embeddings",
             "layer_0/qkv/kernel": "layer_1/qkv/kernel", "pooler/dense/kernel": "pooler/dense/kernel"}
    weights = {w.path: np.asarray(w) for w in mine.weights}
    source = {w.path: np.asarray(w) for w in theirs.weights}
    for a, b in pairs.items():
        np.testing.assert_array_equal(weights[a], source[b])
    narrow = kbert.load_model(prepare_student(small_config(tok, layers=1, hidden=32), t, str(tmp_path / "narrow"), 0,
                                              False))
    e = source["embeddings/token_embedding/embeddings"]
    got = {w.path: np.asarray(w) for w in narrow.weights}["embeddings/token_embedding/embeddings"]
    centred = e - e.mean(axis=0)
    top = np.linalg.svd(centred, full_matrices=False)[2][:32]
    np.testing.assert_allclose(np.abs(got), np.abs(centred @ top.T), atol=1e-4)


@pytest.mark.slow
def test_interrupted_distillation_resumes_to_the_same_result(tok, teacher, tmp_path):
    unlabeled = [r["text"] for r in movie_review_sentiment(REVIEWS, "train", limit=4000, seed=7)[3000:3600]]
    dev = movie_review_sentiment(REVIEWS, "dev", limit=150)
    args = dict(data=unlabeled, dev=dev, epochs=2, learning_rate=1e-3, max_length=40, eval_every=10,
                checkpoint_every=7, progress=False)
    student = small_config(tok, layers=1)
    full = kbert.distill(teacher[1], student, out_dir=str(tmp_path / "full"), **args)
    per_epoch = -(-len(unlabeled) // 32)
    cut = next(s for s in range(per_epoch + 1, 2 * per_epoch) if s % 10 and s % 7)
    out = str(tmp_path / "part")
    part = kbert.distill(teacher[1], student, out_dir=out, stop_after=cut, **args)
    assert (part["steps"], part["stopped_by"]) == (cut, "stop_after")
    assert part["student_init"] == os.path.join(out, "student-init") and os.path.isdir(part["student_init"])
    rest = kbert.distill(teacher[1], student, out_dir=out, **args)
    assert (rest["steps"], rest["checkpoint"]) == (2 * per_epoch, None)
    # finished: the preset student's starting copy (as large as the model) leaves the model dir
    assert rest["student_init"] is None and not os.path.exists(os.path.join(out, "student-init"))
    for key in ("train_loss", "dev_accuracy", "dev_teacher_agreement"):
        np.testing.assert_allclose([h[key] for h in rest["history"]], [h[key] for h in full["history"]],
                                   rtol=1e-4, atol=1e-4)
    texts = [r["text"] for r in dev[:16]]
    np.testing.assert_allclose(kbert.TaskModel.load(out).predict(texts),
                               kbert.TaskModel.load(str(tmp_path / "full")).predict(texts), atol=1e-4)


@pytest.mark.slow
def test_cli_distills_with_a_config_file_and_overrides(teacher, tmp_path):
    corpus = tmp_path / "reviews.txt"
    corpus.write_text("\n".join(r["text"] for r in movie_review_sentiment(REVIEWS, "train", limit=400, seed=8)),
                      encoding="utf-8")
    config = tmp_path / "distill.yaml"
    config.write_text(f"teacher: {teacher[1]}\nstudent: bert-tiny\nmax_length: 32\nepochs: 1\n", encoding="utf-8")
    out = str(tmp_path / "cli-student")
    proc = subprocess.run([sys.executable, "-m", "kbert.cli", "distill", "--config", str(config), "--corpus",
                           str(corpus), "--out", out, "--set", "max_steps=4", "--set", "temperature=3"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "distill (task): 4 steps" in proc.stdout
    assert kbert.TaskModel.load(out).predict("재밌다").shape == (2,)
    proc = subprocess.run([sys.executable, "-m", "kbert.cli", "distill", "--config", str(config), "--corpus",
                           str(corpus), "--set", "tempreature=3"], capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "unknown distillation setting 'tempreature'" in proc.stderr


def test_a_sentence_transformers_teacher_gives_its_own_vectors(teacher, tmp_path):
    """A sentence-transformers dir as the teacher of embedding distillation (BGE-M3 and KURE pool [CLS]): its
    vectors are the dir's own (its pooling), the ones `Embedder.load` gives, not mean pooling."""
    from kbert.train.distill import Teacher

    loaded = kbert.Embedder.load(teacher[0])
    st_dir = kbert.export_sentence_transformers(kbert.Embedder(loaded.backbone, loaded.tokenizer, pooling="cls"),
                                                str(tmp_path / "st"))
    texts = ["대한민국은 민주공화국이다.", "모든 국민은 법 앞에 평등하다.", "짧은 글"]
    vectors = Teacher(st_dir, "embedding").vectors(texts, 32)
    np.testing.assert_allclose(vectors, kbert.Embedder.load(st_dir).encode(texts), atol=1e-5)
    assert not np.allclose(vectors, loaded.encode(texts, pooling="mean"), atol=1e-3)
    # with a Dense layer (LaBSE's tanh projection, here to 16 dimensions) the teacher's vectors are projected too
    rng = np.random.default_rng(0)
    hidden = loaded.backbone.config.hidden_size
    dense = [{"weight": rng.normal(size=(hidden, 16)).astype(np.float32) / np.sqrt(hidden),
              "bias": rng.normal(size=16).astype(np.float32) * 0.1, "activation": "tanh"}]
    projected = kbert.export_sentence_transformers(
        kbert.Embedder(loaded.backbone, loaded.tokenizer, pooling="cls", dense=dense), str(tmp_path / "st-dense"))
    teacher_dense = Teacher(projected, "embedding")
    assert teacher_dense.hidden_size == 16
    np.testing.assert_allclose(teacher_dense.vectors(texts, 32), kbert.Embedder.load(projected).encode(texts),
                               atol=1e-5)
