"""`kbert.distill`: a small student learns from a loaded teacher, so a Korean model serves fast on CPUs.

Modes (`mode="auto"` picks from the teacher dir's `kbert_task.json`):

    task        the teacher is a fine-tuned classification / pair-classification / regression dir. The student
                learns its soft targets on the task's training text plus unlabeled in-domain text
                (Hinton et al.: KL divergence between the temperature-softened distributions, times T^2),
                mixed with the gold labels where a row has one (`alpha`). Teacher and student must share
                the vocabulary (the student reads the same token ids).
    embedding   the teacher is a sentence-embedding dir (or any model dir: mean pooling). The student's
                pooled unit vectors regress onto the teacher's (MSE, as in Reimers & Gurevych's
                multilingual distillation) when their widths match, and always match the batch's cosine
                matrix (so a narrower student, or one with its own vocabulary, still learns the geometry).

The teacher's outputs are computed once, before training, on the teacher's own tokenization; the teacher
then leaves memory, so training holds the student alone (the batch planner's case) and an interrupted run
resumes from the fine-tuning checkpoints exactly. Training itself is `kbert.train.finetune.run` (one loop:
progress bar, dev scores with the student's agreement with the teacher, early stopping, resume), with a task
class that carries the teacher's targets; the output is a task dir that `kbert.TaskModel.load`,
`kbert.Embedder.load`, `kbert serve` and `kbert export` take as they are.

The student: a model dir, or a preset name (`bert-tiny`, `bert-mini`, ...) built with the teacher's
vocabulary and initialized from the teacher where shapes allow: embeddings and every k-th layer when the
hidden sizes match (DistilBERT's initialization), else the teacher's token embeddings projected on their
leading principal directions (the lexical geometry, at the student's width).

Shapes: n = examples, b = batch, k = labels, h_s / h_t = student / teacher hidden sizes.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, List, Optional, Sequence

import numpy as np

from kbert.data import rows as cells
from kbert.data.features import build_network, features, pad, unit_vectors_in_batches
from kbert.data.rows import read_rows
from kbert.models.tasks import read_task_meta
from kbert.train.finetune_tasks import (ClassificationTask, Examples, PairClassificationTask, RegressionTask,
                                        SentenceEmbeddingTask)
from kbert.train.metrics import spearman

MODES = ("auto", "task", "embedding")
TASK_MODE_TASKS = ("classification", "pair-classification", "regression")
STUDENT_INIT_DIR = "student-init"


# ------------------------------------------------------------------------------------------ losses
def soft_target_loss(student_logits, teacher_logits, temperature: float):
    """Per-row KL(softmax(t / T) || softmax(s / T)) * T^2 (`[b]`): the T^2 keeps the gradient scale of the
    soft part independent of T (Hinton et al., 2015)."""
    import keras

    t = keras.ops.cast(teacher_logits, "float32") / temperature
    s = keras.ops.cast(student_logits, "float32") / temperature
    p = keras.ops.softmax(t, axis=-1)
    kl = keras.ops.sum(p * (keras.ops.log_softmax(t, axis=-1) - keras.ops.log_softmax(s, axis=-1)), axis=-1)
    return kl * temperature ** 2


def embedding_distill_loss(student, teacher):
    """Student pooled vectors `[b, h_s]` against the teacher's unit vectors `[b, h_t]`: the mean squared
    difference of the two batch cosine matrices `[b, b]`, plus, when h_s == h_t, the mean over rows of the
    squared distance between the unit vectors (2 - 2 cos)."""
    import keras

    s = keras.ops.cast(student, "float32")
    s = s / keras.ops.maximum(keras.ops.norm(s, axis=-1, keepdims=True), 1e-12)
    t = keras.ops.cast(teacher, "float32")
    sim_s = keras.ops.matmul(s, keras.ops.transpose(s))
    sim_t = keras.ops.matmul(t, keras.ops.transpose(t))
    loss = keras.ops.mean(keras.ops.square(sim_s - sim_t))
    if student.shape[-1] == teacher.shape[-1]:
        loss = loss + keras.ops.mean(keras.ops.sum(keras.ops.square(s - t), axis=-1))
    return loss


# ------------------------------------------------------------------------------------------ teachers
class Teacher:
    """A teacher dir loaded once to score texts; `release()` drops its weights before the student trains."""

    def __init__(self, model_dir: str, mode: str, dtype: Optional[str] = None):
        from kbert.models.convert import load_model
        from kbert.models.tasks import TaskNetwork, load_task_head
        from kbert.text.tokenizer import Tokenizer

        self.dir, self.meta = model_dir, read_task_meta(model_dir) or {}
        self.tokenizer = Tokenizer.from_model_dir(model_dir)
        backbone = load_model(model_dir, output_hidden_states=True, dtype=dtype)
        self.hidden_size = backbone.config.hidden_size
        self.config = backbone.config
        if mode == "task":
            task = self.meta.get("task")
            labels = self.meta.get("labels") or []
            num = 1 if task == "regression" else len(labels)
            layers = self.meta.get("layers")
            self.network = TaskNetwork(backbone, task, num, 0.0, self.meta.get("target") or (0.0, 1.0),
                                       self.meta.get("pooling"), -1 if layers is None else layers)
            build_network(self.network, self.tokenizer)
            load_task_head(self.network, model_dir)
        else:
            pooling, layers = "mean", -1
            if self.meta.get("task") == "sentence-embedding":
                pooling, layers = self.meta.get("pooling") or "mean", self.meta.get("layers", -1)
            self.pooling, self.layers = pooling, layers
            self.network = TaskNetwork(backbone, "sentence-embedding", 0, 0.0, (0.0, 1.0), pooling, layers)
            build_network(self.network, self.tokenizer)
        self._fn = None

    def call(self, ids, segments):
        import tensorflow as tf

        if self._fn is None:
            self._fn = tf.function(lambda x: self.network(x, training=False), reduce_retracing=True)
        return np.asarray(self._fn(features(ids, segments, self.tokenizer.pad_id)), np.float32)

    def outputs(self, token_ids: List[List[int]], segment_ids: List[List[int]], batch_size: int = 64):
        """The task head's outputs `[n, k]` (logits, or `[n, 1]` values) for encoded examples, in order."""
        out = [None] * len(token_ids)
        order = np.argsort([len(x) for x in token_ids], kind="stable")  # little padding per batch
        for start in range(0, len(order), batch_size):
            index = order[start:start + batch_size]
            ids = pad([token_ids[i] for i in index], self.tokenizer.pad_id)
            segs = pad([segment_ids[i] for i in index], 0, ids.shape[1])
            for i, row in zip(index, self.call(ids, segs)):
                out[i] = row
        return np.stack(out).astype(np.float32) if out else np.zeros((0, 1), np.float32)

    def vectors(self, texts: Sequence[str], max_length: int, batch_size: int = 64) -> np.ndarray:
        """Unit sentence vectors `[n, h_t]` of raw texts, tokenized by the teacher's own tokenizer."""
        ids = [e.ids for e in self.tokenizer.encode_batch(list(texts), max_length=max_length)]
        order = np.argsort([len(x) for x in ids], kind="stable")
        out = np.zeros((len(ids), self.hidden_size), np.float32)
        for start in range(0, len(order), 4096):
            index = order[start:start + 4096]
            out[index] = unit_vectors_in_batches(self.call, [ids[i] for i in index], self.tokenizer.pad_id,
                                                 batch_size)
        return out

    def release(self):
        self.network = self._fn = None
        import gc

        gc.collect()


def teacher_mode(teacher_dir: str, mode: str) -> str:
    """The mode `auto` means for this teacher, or the given mode checked against the teacher dir."""
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}. Received: mode={mode!r}")
    meta = read_task_meta(teacher_dir)
    task = meta.get("task") if meta else None
    if mode == "auto":
        if task in TASK_MODE_TASKS:
            return "task"
        if task == "sentence-embedding":
            return "embedding"
        raise ValueError(f"mode='auto' cannot tell what to distil from {teacher_dir!r} (its task: {task!r}): pass "
                         f"mode='task' (a fine-tuned classification/regression dir) or mode='embedding'")
    if mode == "task":
        if meta is None:
            raise ValueError(f"mode='task' needs a fine-tuned teacher with a task head, and {teacher_dir!r} has no "
                             f"kbert_task.json: fine-tune it first (kbert finetune), or use mode='embedding'")
        if task not in TASK_MODE_TASKS:
            raise ValueError(f"mode='task' distils the heads of {TASK_MODE_TASKS}; the teacher {teacher_dir!r} is a "
                             f"{task!r} model" + (" (use mode='embedding')" if task == "sentence-embedding" else ""))
    return mode


# ------------------------------------------------------------------------------------------ students
def prepare_student(student, teacher: Teacher, out_dir: str, seed: int, progress: bool) -> str:
    """The student's model dir: `student` itself when it is a dir, else the preset built with the teacher's
    vocabulary and initialized from the teacher (module docstring), written once to OUT/student-init."""
    import keras

    from kbert.models.backbone import build_backbone
    from kbert.models.config import ModelConfig
    from kbert.models.io import save_model, variables_by_path

    if isinstance(student, str) and os.path.isdir(student):
        return student
    t = teacher.config
    shape = dict(vocab_size=t.vocab_size, max_position=t.max_position, type_vocab_size=t.type_vocab_size)
    if isinstance(student, ModelConfig):
        config = dataclasses.replace(student, **shape)
        name = f"a {config.architecture} of {config.num_layers} layers"
    elif isinstance(student, str) and student in ModelConfig.presets():
        config, name = ModelConfig.preset(student, **shape), student
    else:
        raise ValueError(f"`student` must be a model dir, a preset ({', '.join(ModelConfig.presets())}) or a "
                         f"kbert.ModelConfig. Received: {student!r}")
    path = os.path.join(out_dir, STUDENT_INIT_DIR)
    if os.path.isfile(os.path.join(path, "kbert_config.json")):
        return path  # a resumed run starts from the same student
    keras.utils.set_random_seed(seed)
    backbone = build_backbone(config)
    mine, theirs = variables_by_path(backbone), variables_by_path(teacher.network.backbone)
    how = "random"
    if config.architecture == t.architecture == "bert" and config.hidden_size == t.hidden_size:
        # DistilBERT: the embeddings, the pooler and every k-th layer of the teacher (its last layer kept)
        picked = np.linspace(0, t.num_layers - 1, config.num_layers).round().astype(int) if config.num_layers > 1 \
            else np.array([t.num_layers - 1])
        rename = {f"layer_{i}/": f"layer_{j}/" for i, j in enumerate(picked)}
        for name, v in mine.items():
            source = name
            for mine_prefix, their_prefix in rename.items():
                if name.startswith(mine_prefix):
                    source = their_prefix + name[len(mine_prefix):]
            if source in theirs and tuple(theirs[source].shape) == tuple(v.shape):
                v.assign(keras.ops.convert_to_numpy(theirs[source]))
        how = f"the teacher's embeddings and layers {list(picked)}"
    else:
        # the token embeddings' leading principal directions, kept at their own scale
        name = "embeddings/token_embedding/embeddings"
        if name in theirs and name in mine:
            e = keras.ops.convert_to_numpy(theirs[name]).astype(np.float64)
            width = mine[name].shape[-1]
            if width <= e.shape[1]:
                centred = e - e.mean(axis=0)
                _, _, vt = np.linalg.svd(centred, full_matrices=False)
                mine[name].assign((centred @ vt[:width].T).astype(np.float32))
                how = f"the teacher's token embeddings on their {width} leading principal directions"
    if progress:
        print(f"student: {name} ({config.num_layers} layers, hidden {config.hidden_size}) initialized from {how}",
              flush=True)
    return save_model(backbone, path, tokenizer=teacher.tokenizer)


def same_vocabulary(teacher: Teacher, student_dir: str, mode: str) -> None:
    from kbert.text.tokenizer import Tokenizer

    mine = Tokenizer.from_model_dir(student_dir)
    if mine.fingerprint() != teacher.tokenizer.fingerprint():
        raise ValueError(f"mode={mode!r} trains the student on the teacher's token ids, and their vocabularies "
                         f"differ (teacher {teacher.dir!r}: {teacher.tokenizer.vocab_size} tokens, student "
                         f"{student_dir!r}: {mine.vocab_size}): use a student built from a preset (it takes the "
                         f"teacher's vocabulary) or mode='embedding', which needs no token alignment")


# ------------------------------------------------------------------------------------------ tasks
class SoftTargets:
    """Task mode, mixed into the teacher's task class: training rows carry `[n, 1 + k]` labels (the gold
    class index, or -1 / NaN where a row has none, then the teacher's k outputs); dev rows keep their gold
    labels, and the dev scores add the student's agreement with the teacher."""

    def setup(self, teacher: Teacher, temperature: float, alpha: float):
        self.teacher, self.temperature, self.alpha = teacher, float(temperature), float(alpha)
        self.labels = teacher.meta.get("labels")
        if self.name == "regression":
            self.target = tuple(teacher.meta.get("target") or (0.0, 1.0))
        self.dev_teacher = None
        self.extra_meta = {"distilled_from": os.path.abspath(teacher.dir), "distill_mode": "task"}

    def check(self):
        if self.config.pair_column is None and self.name == "pair-classification":
            raise ValueError("the teacher is a pair-classification model: `pair_column` is needed")

    def label_set(self, rows, progress):
        return self.labels

    @property
    def train_columns(self):
        return [self.config.text_column, self.config.pair_column]

    def targets(self, raw, encodings, split):
        if split != "train":
            return super().targets(raw, encodings, split)
        missing = [v is None or str(v).strip() == "" for v in raw]
        known = [v for v, m in zip(raw, missing) if not m]
        gold = np.full(len(raw), np.nan if self.name == "regression" else -1, np.float32)
        if known:
            gold[~np.array(missing)] = super().targets(known, None, split)
        return gold

    def encode(self, rows, tokenizer, max_length, split):
        ex = super().encode(rows, tokenizer, max_length, split)
        out = self.teacher.outputs(ex.token_ids, ex.segment_ids)
        if split == "train":
            ex.labels = np.concatenate([ex.labels[:, None].astype(np.float32), out], axis=1)
        else:
            self.dev_teacher = out
        return ex

    def fit(self, train):
        pass  # a regression student keeps the teacher's (mean, std): its outputs are in the same units

    def loss(self, network, feats, y, n, key: int = 0):
        import keras

        out = keras.ops.cast(network(feats, training=True), "float32")  # [b, k]
        gold, teacher = y[:, 0], y[:, 1:]
        if self.name == "regression":
            std = self.target[1]
            soft = keras.ops.square((out[:, 0] - teacher[:, 0]) / std)
            has = keras.ops.logical_not(keras.ops.isnan(gold))
            hard = keras.ops.square((out[:, 0] - keras.ops.where(has, gold, 0.0)) / std)
        else:
            soft = soft_target_loss(out, teacher, self.temperature)
            has = gold >= 0
            index = keras.ops.cast(keras.ops.maximum(gold, 0.0), "int32")
            hard = keras.losses.sparse_categorical_crossentropy(index, out, from_logits=True)
        a = keras.ops.where(has, self.alpha, 0.0)
        return keras.ops.mean((1.0 - a) * soft + a * hard)

    def scores(self, outputs, examples):
        scores = super().scores(outputs, examples)
        if self.dev_teacher is not None and len(self.dev_teacher) == len(outputs):
            mine = np.stack(outputs)
            if self.name == "regression":
                scores["teacher_agreement"] = spearman(mine[:, 0], self.dev_teacher[:, 0])
            else:
                scores["teacher_agreement"] = float(np.mean(np.argmax(mine, 1) == np.argmax(self.dev_teacher, 1)))
        return scores


def soft_target_task(config, teacher: Teacher, temperature: float, alpha: float):
    base = {"classification": ClassificationTask, "pair-classification": PairClassificationTask,
            "regression": RegressionTask}[teacher.meta["task"]]
    task = type(f"Distilled{base.__name__}", (SoftTargets, base), {})(config)
    task.setup(teacher, temperature, alpha)
    return task


class EmbeddingDistillTask(SentenceEmbeddingTask):
    """Embedding mode: training rows are single texts whose labels are the teacher's unit vectors `[n, h_t]`;
    the dev set, when given, is scored pairs (Spearman) and adds the Spearman correlation of the student's
    cosines with the teacher's (`teacher_agreement`)."""

    def setup(self, teacher: Teacher, max_length: int):
        self.teacher, self.teacher_length = teacher, max_length
        self.dev_teacher = None
        self.extra_meta = {"distilled_from": os.path.abspath(teacher.dir), "distill_mode": "embedding"}

    def check(self):
        pass

    @property
    def train_columns(self):
        return [self.config.text_column]

    def encode(self, rows, tokenizer, max_length, split):
        c = self.config
        texts = [cells.text_cell(r, c.text_column, f"{split} row {i + 1}") for i, r in enumerate(rows)]
        if split == "train":
            ids = [e.ids for e in tokenizer.encode_batch(texts, max_length=max_length)]
            return Examples(ids, None, self.teacher.vectors(texts, self.teacher_length))
        ex = dataclasses.replace(self.config, objective=None, negative_column=None, datasets=None)
        ex = SentenceEmbeddingTask(ex).encode(rows, tokenizer, max_length, split)
        pairs = [cells.text_cell(r, c.pair_column, f"{split} row {i + 1}") for i, r in enumerate(rows)]
        a, b = self.teacher.vectors(texts, self.teacher_length), self.teacher.vectors(pairs, self.teacher_length)
        self.dev_teacher = np.sum(a * b, axis=1)
        return ex

    def fit(self, train):
        self.score_max = 1.0

    def batch(self, examples, index, pad_id):
        import tensorflow as tf

        ids = pad([examples.token_ids[i] for i in index], pad_id)
        return features(ids, np.zeros_like(ids), pad_id), tf.constant(examples.labels[index])

    def loss(self, network, feats, y, n, key: int = 0):
        return embedding_distill_loss(network(feats, training=True), y)

    def evaluate(self, infer, examples, batch_size, pad_id):
        a = unit_vectors_in_batches(infer, examples.token_ids, pad_id, batch_size)
        b = unit_vectors_in_batches(infer, examples.pair_token_ids, pad_id, batch_size)
        cos = np.sum(a * b, axis=1)
        scores = {}
        if examples.labels is not None:
            scores["spearman"] = spearman(cos, examples.labels)
        if self.dev_teacher is not None:
            scores["teacher_agreement"] = spearman(cos, self.dev_teacher)
        return scores

    def dev_metric(self, dev):
        return "spearman" if (dev is not None and dev.labels is not None) else "teacher_agreement"


# ------------------------------------------------------------------------------------------ front end
def text_rows(data, column: str) -> List[dict]:
    """Unlabeled text as rows: a list of strings, a list of dicts, or a file (TSV/CSV/JSONL with `column`,
    or plain text: a line per text, blank lines skipped)."""
    if data is None:
        return []
    if isinstance(data, (list, tuple)):
        if all(isinstance(x, str) for x in data):
            return [{column: x} for x in data if x.strip()]
        return read_rows(list(data), [column])
    if isinstance(data, str) and os.path.isfile(data) and data.endswith((".txt", ".txt.gz")):
        import gzip

        opener = gzip.open if data.endswith(".gz") else open
        with opener(data, "rt", encoding="utf-8") as f:
            return [{column: line.strip()} for line in f if line.strip()]
    return read_rows(data, [column])


def distill(teacher: str, student, data=None, out_dir: str = "distilled", mode: str = "auto", train=None,
            dev=None, text_column: Optional[str] = None, pair_column: Optional[str] = None,
            label_column: Optional[str] = None, temperature: float = 2.0, alpha: float = 0.5,
            epochs: float = 3, batch_size: int = 32, learning_rate: float = 1e-4, warmup: float = 0.1,
            max_length: Optional[int] = None, max_steps: Optional[int] = None, eval_every: Optional[int] = None,
            patience: Optional[int] = None, seed: int = 0, progress: bool = True, dtype: Optional[str] = None,
            resume: bool = True, checkpoint_every: Optional[int] = 1000, stop_after: Optional[int] = None) -> dict:
    """Distils `teacher` (a model dir) into `student` (a preset name, a `kbert.ModelConfig` or a model dir);
    returns the fine-tuning
    summary (`kbert.finetune`'s) with `mode` and `student_init` added. See the module docstring for the modes.

    Args:
        data: unlabeled in-domain text (a list of strings, a text file with a line per text, or rows with
            `text_column`): scored by the teacher and trained on.
        train: task mode: the task's labeled training rows (their gold labels mix in with weight `alpha`);
            embedding mode: more rows whose `text_column` (and `pair_column`) texts are trained on.
        dev: rows to score the student on (task mode: the teacher's task; embedding mode: scored pairs with
            `text_column`, `pair_column`, `label_column`), picked best on its dev score.
        text_column, pair_column, label_column: default to the teacher's own (task mode) or "text" / None.
        temperature: soft-target temperature T (task mode; the loss is scaled by T^2).
        alpha: weight of the gold-label loss on rows that have a label (0: soft targets only).
        The rest as in `kbert.finetune`.

    Example:
        >>> kbert.distill("sentiment-teacher", "bert-tiny", data="reviews.txt", train="train.tsv",
        ...               dev="dev.tsv", out_dir="sentiment-tiny")
        >>> kbert.TaskModel.load("sentiment-tiny").predict(["재밌어요"])
    """
    from kbert.train.finetune import FinetuneConfig, run

    if not isinstance(teacher, str) or not os.path.isdir(teacher):
        raise FileNotFoundError(f"`teacher` must be a model dir. Received: {teacher!r}")
    mode = teacher_mode(teacher, mode)
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"`temperature` must be a positive number. Received: temperature={temperature!r}")
    if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"`alpha` must be in [0, 1]. Received: alpha={alpha!r}")
    if data is None and train is None:
        raise ValueError("distillation needs text: `data` (unlabeled text) and/or `train` (the task's rows)")
    meta = read_task_meta(teacher) or {}
    if mode == "task":
        text_column = text_column or meta.get("text_column") or "text"
        pair_column = pair_column if pair_column is not None else meta.get("pair_column")
        label_column = label_column or meta.get("label_column") or "label"
    else:
        text_column = text_column or "text"
    os.makedirs(out_dir, exist_ok=True)
    t = Teacher(teacher, mode, dtype=dtype)
    student_dir = prepare_student(student, t, out_dir, seed, progress)
    if mode == "task":
        same_vocabulary(t, student_dir, mode)
        if pair_column and data is not None:
            raise ValueError("unlabeled `data` is single texts; the teacher reads text pairs "
                             f"({text_column!r}, {pair_column!r}): give pairs as `train` rows without labels")
        rows = read_rows(train, [text_column, pair_column]) if train is not None else []
        rows = rows + text_rows(data, text_column)
    else:
        rows = text_rows(data, text_column)
        if train is not None:
            for r in read_rows(train, [text_column] + ([pair_column] if pair_column else [])):
                rows.append({text_column: r[text_column]})
                if pair_column:
                    rows.append({text_column: r[pair_column]})
    if not rows:
        raise ValueError("distillation found no text in `data` / `train`")
    length = max_length or min(128, t.config.max_position)
    config = FinetuneConfig(
        model=student_dir, task=meta["task"] if mode == "task" else "sentence-embedding", train=rows, dev=dev,
        out_dir=out_dir, text_column=text_column, pair_column=pair_column,
        label_column=label_column if (mode == "task" or dev is not None) else None, epochs=epochs,
        batch_size=batch_size, learning_rate=learning_rate, warmup=warmup, max_length=length, dropout=0.1,
        patience=patience, eval_every=eval_every, max_steps=max_steps, seed=seed, progress=progress, dtype=dtype,
        pooling=(meta.get("pooling") if mode == "task" else getattr(t, "pooling", "mean")),
        layers=(meta.get("layers", -1) if mode == "task" else getattr(t, "layers", -1)),
        resume=resume, checkpoint_every=checkpoint_every, stop_after=stop_after)
    if mode == "embedding" and isinstance(config.layers, list):
        config.layers = -1  # layer indices of the teacher need not exist in the student: its last layer
    if mode == "task":
        task = soft_target_task(config, t, temperature, alpha)
    else:
        task = EmbeddingDistillTask(config)
        task.setup(t, length)
    summary = run(config, task=task, before_training=t.release)
    summary.update(mode=mode, student_init=student_dir)
    return summary
