"""`kbert.distill`: a small student learns from a loaded teacher, so a Korean model serves fast on CPUs.

Modes (`mode="auto"` picks from the teacher dir's `kbert_task.json`):

    task        the teacher is a fine-tuned classification / pair-classification / regression dir. The student
                learns its soft targets on the task's training text plus unlabeled in-domain text
                (Hinton et al.: KL divergence between the temperature-softened distributions, times T^2),
                mixed with the gold labels where a row has one (`alpha`); a multi-label teacher's student is
                multi-label too, each label's soft target the teacher's tempered sigmoid (binary cross-
                entropy). Teacher and student must share the vocabulary (the student reads the same token ids).
    embedding   the teacher is a sentence-embedding dir (or any model dir: mean pooling). The student's
                pooled unit vectors regress onto the teacher's (MSE, as in Reimers & Gurevych's
                multilingual distillation) when their widths match, and always match the batch's cosine
                matrix (so a narrower student, or one with its own vocabulary, still learns the geometry).

    general     the teacher is any pretrained model dir with its masked-LM head (a `kbert pretrain` output, or
                a Hugging Face BERT checkpoint): task-agnostic distillation on unlabeled text. Both see the
                same masked batch; the student learns the teacher's masked-LM distribution at the masked
                positions (soft targets at temperature T, times T^2), its last hidden states (DistilBERT's
                cosine loss, when the widths match) and its last layer's token-to-token relations
                (MiniLM-style: the KL divergence of the softmax of scaled dot products of the last layer's
                token vectors, which needs no common width). The output is a model dir with its masked-LM
                head (`kbert finetune` it next, or distil it again).

In task and embedding modes the teacher's outputs are computed once, before training, on the teacher's own tokenization; the teacher
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
import shutil
from typing import Optional

import numpy as np

from kbert.data import rows as cells
from kbert.data.features import bucketed_features, features, pad, unit_vectors_in_batches
from kbert.data.rows import read_rows, text_rows
from kbert.compiled import backend, compiled
from kbert.models.card import shown_name
from kbert.models.locate import read_task_meta
from kbert.train.finetune_tasks import (ClassificationTask, Examples, FinetuneTask, PairClassificationTask,
                                        RegressionTask, SentenceEmbeddingTask)
from kbert.train.metrics import spearman
from kbert.train.teacher import Teacher
from kbert.utils import writing_to

MODES = ("auto", "task", "embedding", "general")
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


def soft_label_loss(student_logits, teacher_logits, temperature: float):
    """A multi-label teacher's soft targets: per row the mean over labels of the binary cross-entropy of
    sigmoid(s / T) against sigmoid(t / T), less its value at s = t (so 0 when they agree, as the KL above),
    times T^2 (`[b]`)."""
    import keras

    t = keras.ops.cast(teacher_logits, "float32") / temperature
    s = keras.ops.cast(student_logits, "float32") / temperature
    p = keras.ops.sigmoid(t)
    own = keras.ops.binary_crossentropy(p, t, from_logits=True)  # the teacher's own entropy: the floor
    return keras.ops.mean(keras.ops.binary_crossentropy(p, s, from_logits=True) - own, axis=-1) * temperature ** 2


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
        if task is None:
            return "general"
        raise ValueError(f"mode='auto' cannot tell what to distil from {teacher_dir!r} (its task: {task!r}): pass "
                         f"mode='embedding' (its pooled vectors) or mode='general' (its masked-LM head)")
    if mode == "task":
        if meta is None:
            raise ValueError(f"mode='task' needs a fine-tuned teacher with a task head, and {teacher_dir!r} has no "
                             f"kbert_task.json: fine-tune it first (kbert finetune), or use mode='embedding' or 'general'")
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
        for weight, v in mine.items():
            source = weight
            for mine_prefix, their_prefix in rename.items():
                if weight.startswith(mine_prefix):
                    source = their_prefix + weight[len(mine_prefix):]
            if source in theirs and tuple(theirs[source].shape) == tuple(v.shape):
                v.assign(keras.ops.convert_to_numpy(theirs[source]))
        how = f"the teacher's embeddings and layers {[int(i) for i in picked]}"
    else:
        # the token embeddings' leading principal directions, kept at their own scale
        tokens = "embeddings/token_embedding/embeddings"
        if tokens in theirs and tokens in mine:
            e = keras.ops.convert_to_numpy(theirs[tokens]).astype(np.float64)
            width = mine[tokens].shape[-1]
            if width <= e.shape[1]:
                centred = e - e.mean(axis=0)
                _, _, vt = np.linalg.svd(centred, full_matrices=False)
                mine[tokens].assign((centred @ vt[:width].T).astype(np.float32))
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
    class index, or -1 / NaN where a row has none, then the teacher's k outputs; a multi-label teacher's rows
    `[n, 2k]`: the gold multi-hot row, NaN where a row has none, then the k logits); dev rows keep their gold
    labels, and the dev scores add the student's agreement with the teacher."""

    @property
    def multi_label(self) -> bool:  # the student predicts as its teacher: a sigmoid a label, or one softmax
        return bool(self.teacher.meta.get("multi_label"))

    def setup(self, teacher: Teacher, temperature: float, alpha: float):
        self.teacher, self.temperature, self.alpha = teacher, float(temperature), float(alpha)
        self.labels = teacher.meta.get("labels")
        if self.name == "regression":
            self.target = tuple(teacher.meta.get("target") or (0.0, 1.0))
        self.dev_teacher = None

    @property
    def extra_meta(self) -> dict:  # what the student's kbert_task.json adds
        return {"distilled_from": os.path.abspath(self.teacher.dir), "distill_mode": "task",
                **({"multi_label": True} if self.multi_label else {})}

    @property
    def loss_description(self) -> str:  # the model card's loss line
        soft = ("squared error to the teacher's output" if self.name == "regression"
                else f"the teacher's soft targets at temperature {self.temperature:g}"
                + (" (a sigmoid a label)" if self.multi_label else ""))
        gold = f", mixed with the gold labels at alpha {self.alpha:g}" if self.alpha else ""
        return f"distillation from {shown_name(self.teacher.dir)}: {soft}{gold}"

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
        missing = [v is None or (not isinstance(v, (list, tuple)) and str(v).strip() == "") for v in raw]
        known = [v for v, m in zip(raw, missing) if not m]
        if self.multi_label:  # a row without labels (a cell left empty) learns from the teacher alone
            gold = np.full((len(raw), len(self.labels)), np.nan, np.float32)
            if known:
                gold[~np.array(missing)] = super().targets(known, None, split)
            return gold
        gold = np.full(len(raw), np.nan if self.name == "regression" else -1, np.float32)
        if known:
            gold[~np.array(missing)] = super().targets(known, None, split)
        return gold

    def encode(self, rows, tokenizer, max_length, split):
        ex = super().encode(rows, tokenizer, max_length, split)
        out = self.teacher.outputs(ex.token_ids, ex.segment_ids)
        if split == "train":
            gold = ex.labels if ex.labels.ndim == 2 else ex.labels[:, None]
            ex.labels = np.concatenate([gold.astype(np.float32), out], axis=1)
        else:
            self.dev_teacher = out
        return ex

    def fit(self, train):
        pass  # a regression student keeps the teacher's (mean, std): its outputs are in the same units

    def loss(self, network, feats, y, n, key: int = 0):
        import keras

        out = keras.ops.cast(network(feats, training=True), "float32")  # [b, k]
        if self.multi_label:  # y [b, 2k]: gold multi-hot (NaN: none given), the teacher's logits
            k = out.shape[-1]
            gold, teacher = y[:, :k], y[:, k:]
            soft = soft_label_loss(out, teacher, self.temperature)
            has = keras.ops.logical_not(keras.ops.isnan(gold[:, 0]))
            hard = keras.ops.mean(keras.ops.binary_crossentropy(keras.ops.where(keras.ops.isnan(gold), 0.0, gold),
                                                                out, from_logits=True), axis=-1)
            a = keras.ops.where(has, self.alpha, 0.0)
            return keras.ops.mean((1.0 - a) * soft + a * hard)
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
            elif self.multi_label:  # the share of (row, label) decisions the two make alike
                scores["teacher_agreement"] = float(np.mean((mine > 0) == (self.dev_teacher > 0)))
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

    @property
    def loss_description(self) -> str:
        return (f"distillation from {shown_name(self.teacher.dir)}: the batch's cosine matrix onto the teacher's "
                f"(and the unit vectors onto its, when the widths agree)")

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
        ids = pad([examples.token_ids[i] for i in index], pad_id)
        return features(ids, np.zeros_like(ids), pad_id), np.asarray(examples.labels[index])

    def embedding_loss(self, v, y, n, key: int = 0):  # `loss` is the parent's: this of `embed`'s vectors
        return embedding_distill_loss(v, y)

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


def masked_lm_distill_loss(student_logits, teacher_logits, weights, temperature: float):
    """Soft-target KL (times T^2) at the masked positions: logits `[b, m, V]`, `weights` `[b, m]` (1 at a
    masked position, 0 at padding of the position list); the mean over masked positions."""
    import keras

    b, m = keras.ops.shape(weights)[0], keras.ops.shape(weights)[1]
    kl = soft_target_loss(keras.ops.reshape(student_logits, (b * m, -1)),
                          keras.ops.reshape(teacher_logits, (b * m, -1)), temperature)
    w = keras.ops.reshape(keras.ops.cast(weights, "float32"), (-1,))
    return keras.ops.sum(kl * w) / keras.ops.maximum(keras.ops.sum(w), 1.0)


def hidden_cosine_loss(student, teacher, mask):
    """DistilBERT's hidden-state loss: mean over real tokens of 1 - cos(student, teacher), `[b, s, h]` each
    (same width), `mask` `[b, s]`."""
    import keras

    s = keras.ops.cast(student, "float32")
    t = keras.ops.cast(teacher, "float32")
    cos = keras.ops.sum(s * t, axis=-1) / keras.ops.maximum(
        keras.ops.norm(s, axis=-1) * keras.ops.norm(t, axis=-1), 1e-12)
    w = keras.ops.cast(mask, "float32")
    return keras.ops.sum((1.0 - cos) * w) / keras.ops.maximum(keras.ops.sum(w), 1.0)


def relation_loss(student, teacher, mask):
    """MiniLM-style relation distillation on the last layer: for each real token, the KL divergence between
    the teacher's and the student's softmax over the sequence's real tokens of h_i . h_j / sqrt(width)
    (`[b, s, h_s]` and `[b, s, h_t]`: no common width needed); the mean over real tokens."""
    import keras

    w = keras.ops.cast(mask, "float32")  # [b, s]
    pad = (1.0 - w)[:, None, :] * -1e9

    def log_relations(h):
        h = keras.ops.cast(h, "float32")
        scores = keras.ops.matmul(h, keras.ops.transpose(h, (0, 2, 1))) / float(np.sqrt(h.shape[-1]))
        return keras.ops.log_softmax(scores + pad, axis=-1)  # [b, s, s]

    log_t, log_s = log_relations(teacher), log_relations(student)
    kl = keras.ops.sum(keras.ops.exp(log_t) * (log_t - log_s), axis=-1)  # [b, s]
    return keras.ops.sum(kl * w) / keras.ops.maximum(keras.ops.sum(w), 1.0)


def mask_batch(ids: np.ndarray, tokenizer, rng: np.random.Generator, rate: float = 0.15):
    """BERT's masking of a `[b, s]` id batch: `rate` of the real, non-special tokens (at least one per row
    that has one) are picked; 80% become [MASK], 10% a random token, 10% stay. Returns the masked ids, the
    picked positions `[b, m]` (padded with 0) and their weights `[b, m]`."""
    special = np.isin(ids, list(tokenizer.special_ids.values()))
    masked = ids.copy()
    picked = []
    for i in range(ids.shape[0]):
        candidates = np.flatnonzero(~special[i])
        k = min(len(candidates), max(1, int(round(rate * len(candidates))))) if len(candidates) else 0
        rows = np.sort(rng.choice(candidates, size=k, replace=False)) if k else np.zeros(0, np.int64)
        draw = rng.random(len(rows))
        masked[i, rows[draw < 0.8]] = tokenizer.mask_id
        swap = rows[(draw >= 0.8) & (draw < 0.9)]
        masked[i, swap] = rng.integers(len(tokenizer.special_ids), tokenizer.vocab_size, size=len(swap))
        picked.append(rows)
    m = -(-max(1, max(len(r) for r in picked)) // 8) * 8  # a multiple of 8, as `pad` widths: few compiled shapes
    positions = np.zeros((ids.shape[0], m), np.int32)
    weights = np.zeros((ids.shape[0], m), np.float32)
    for i, rows in enumerate(picked):
        positions[i, :len(rows)], weights[i, :len(rows)] = rows, 1.0
    return masked, positions, weights


def sequence_and_mlm(pretrainer, feats, training):
    """(last hidden states `[b, s, h]`, masked-LM logits `[b, m, V]`) of a `kbert.Pretrainer`."""
    from kbert.models.backbone import INPUT_NAMES

    out = pretrainer.backbone({k: feats[k] for k in INPUT_NAMES}, training=training)
    return out["sequence_output"], pretrainer.mlm_head(out["sequence_output"], feats["mask_positions"])


class GeneralDistillTask(FinetuneTask):
    """General mode: unlabeled texts, masked per batch (the masks are a function of the seed and the batch's
    examples, so a resumed run masks as the uninterrupted one); the teacher runs in each step. Dev text is
    masked once with a fixed seed and scored by `teacher_kl` (the mean KL divergence of the student's
    masked-LM distribution from the teacher's, T = 1: lower is better, and it picks the best model) and
    `mlm_agreement` (how often the student's top prediction is the teacher's)."""
    name = "general-distillation"
    metric = "teacher_kl"
    higher_is_better = False
    trains_pooler = False

    def setup(self, teacher: Teacher, temperature: float, seed: int, tokenizer):
        self.teacher, self.temperature, self.seed, self.tokenizer = teacher, float(temperature), seed, tokenizer
        self.student = self._predict = None

    @property
    def loss_description(self) -> str:
        return (f"distillation from {shown_name(self.teacher.dir)}: KL of the masked-LM distributions at "
                f"temperature {self.temperature:g}, last-layer attention relations (MiniLM), and hidden-state "
                f"cosine when the widths agree (DistilBERT)")

    def check(self):
        pass

    @property
    def columns(self):
        return [self.config.text_column]

    def encode(self, rows, tokenizer, max_length, split):
        c = self.config
        texts = [cells.text_cell(r, c.text_column, f"{split} row {i + 1}") for i, r in enumerate(rows)]
        ids = [e.ids for e in tokenizer.encode_batch(texts, max_length=max_length)]
        return Examples(ids, None, None)

    def network(self, backbone, dropout, pooling, layers):
        import keras

        from kbert.models.io import build_pretrainer, variables_by_path

        student = build_pretrainer(masked_lm_student_class()(backbone, pair_objective=None))
        self.same_width = backbone.config.hidden_size == self.teacher.config.hidden_size
        if self.same_width:  # the teacher's masked-LM transform, when it fits (the output bias always does)
            theirs = {p.split("mlm_head/", 1)[-1]: v for p, v in variables_by_path(self.teacher.network).items()
                      if "mlm_head/" in p}
            for path, v in variables_by_path(student).items():
                key = path.split("mlm_head/", 1)[-1]
                if "mlm_head/" in path and key in theirs and tuple(theirs[key].shape) == tuple(v.shape):
                    v.assign(keras.ops.convert_to_numpy(theirs[key]))
        self.student = student
        return student

    def training_batch(self, examples, batch, pad_id):
        rng = np.random.default_rng([self.seed, len(batch), *[int(i) for i in batch]])
        return self.masked(examples, batch, pad_id, rng)

    def masked(self, examples, index, pad_id, rng):
        ids = pad([examples.token_ids[i] for i in index], pad_id)
        masked, positions, weights = mask_batch(ids, self.tokenizer, rng)
        feats = features(masked, np.zeros_like(masked), pad_id)
        feats["mask_positions"] = positions
        return feats, weights, len(index), 0

    def other_variables(self):
        return list(self.teacher.network.variables)  # the teacher runs inside each training step

    def loss(self, network, feats, y, n, key: int = 0):
        import keras

        seq_s, mlm_s = sequence_and_mlm(network, feats, training=True)
        seq_t, mlm_t = sequence_and_mlm(self.teacher.network, feats, training=False)
        seq_t, mlm_t = keras.ops.stop_gradient(seq_t), keras.ops.stop_gradient(mlm_t)
        mask = feats["padding_mask"]
        loss = masked_lm_distill_loss(mlm_s, mlm_t, y, self.temperature) + relation_loss(seq_s, seq_t, mask)
        if self.same_width:
            loss = loss + hidden_cosine_loss(seq_s, seq_t, mask)
        return loss

    def evaluate(self, infer, examples, batch_size, pad_id):
        if self._predict is None:
            self._predict = compiled(lambda f: (sequence_and_mlm(self.student, f, False)[1],
                                                sequence_and_mlm(self.teacher.network, f, False)[1]),
                                     self.student.variables + self.teacher.network.variables)
        rng = np.random.default_rng(self.seed + 1)
        agree = kl = total = 0.0
        for start in range(0, len(examples), batch_size):
            index = np.arange(start, min(start + batch_size, len(examples)))
            feats, weights, _, _ = self.masked(examples, index, pad_id, rng)
            if backend() == "jax":  # a few bucketed widths, not one compile per batch width
                feats, _ = bucketed_features(feats, None, pad_id, self.student.backbone.config.max_position)
            student, teacher = (np.asarray(x, np.float32) for x in self._predict(feats))
            w = np.asarray(weights)
            same = np.argmax(student, -1) == np.argmax(teacher, -1)
            v = student.shape[-1]
            div = np.asarray(soft_target_loss(student.reshape(-1, v), teacher.reshape(-1, v), 1.0)).reshape(w.shape)
            agree += float(np.sum(same * w))
            kl += float(np.sum(div * w))
            total += float(np.sum(w))
        return {"teacher_kl": kl / max(total, 1.0), "mlm_agreement": agree / max(total, 1.0)}

    def save(self, network, out_dir, tokenizer, meta):
        from kbert.models.io import save_model

        save_model(network, out_dir, tokenizer=tokenizer)  # the backbone with its masked-LM head


def masked_lm_student_class():
    from kbert.models.backbone import INPUT_NAMES, Pretrainer

    class Student(Pretrainer):
        """A `kbert.Pretrainer` (masked-LM head only) that also takes inputs without `mask_positions` (the
        fine-tuning loop builds networks with a plain two-token batch)."""

        def call(self, features, training=None):
            if "mask_positions" in features:
                return super().call(features, training=training)
            return self.backbone({k: features[k] for k in INPUT_NAMES}, training=training)["sequence_output"]

    return Student


# ------------------------------------------------------------------------------------------ front end
def distill(teacher: str, student, data=None, out_dir: str = "distilled", mode: str = "auto", train=None,
            dev=None, text_column: Optional[str] = None, pair_column: Optional[str] = None,
            label_column: Optional[str] = None, temperature: float = 2.0, alpha: float = 0.5,
            epochs: float = 3, batch_size: int = 32, learning_rate: float = 1e-4, warmup: float = 0.1,
            max_length: Optional[int] = None, max_steps: Optional[int] = None, eval_every: Optional[int] = None,
            patience: Optional[int] = None, seed: int = 0, progress: bool = True, dtype: Optional[str] = None,
            resume: bool = True, checkpoint_every: Optional[int] = 1000, stop_after: Optional[int] = None) -> dict:
    """Distils `teacher` (a model dir) into `student` (a preset name, a `kbert.ModelConfig` or a model dir);
    returns the fine-tuning
    summary (`kbert.finetune`'s) with `mode` and `student_init` added (the dir the student started from: the
    `student` dir, or OUT/student-init for a preset until the run finishes, then None, the copy removed). See the
    module docstring for the modes.

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
    if isinstance(teacher, (str, os.PathLike)):  # a Hub name: its snapshot; a `kbert pretrain` run dir: its model
        from kbert.models.locate import model_dir_of, resolve_hub_name

        teacher = model_dir_of(resolve_hub_name(os.fspath(teacher)))
    meta = read_task_meta(teacher) or {}
    if mode == "task":
        text_column = text_column or meta.get("text_column") or "text"
        pair_column = pair_column if pair_column is not None else meta.get("pair_column")
        label_column = label_column or meta.get("label_column") or "label"
    else:
        text_column = text_column or "text"
    with writing_to(out_dir, "kbert distill"):  # held through the fine-tune, which runs on the same dir
        t = Teacher(teacher, mode, dtype=dtype, progress=progress)
        student_dir = prepare_student(student, t, out_dir, seed, progress)
        if mode == "general":
            same_vocabulary(t, student_dir, mode)
            rows = text_rows(data, text_column) + (text_rows(train, text_column) if train is not None else [])
            dev = text_rows(dev, text_column) if dev is not None else None
        elif mode == "task":
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
        length = min(128, t.config.max_position) if max_length is None else max_length
        config = FinetuneConfig(
            model=student_dir, task={"task": meta.get("task"), "embedding": "sentence-embedding"}.get(mode, mode),
            train=rows, dev=dev,
            out_dir=out_dir, text_column=text_column, pair_column=pair_column,
            label_column=label_column if (mode == "task" or (mode == "embedding" and dev is not None)) else None,
            epochs=epochs,
            batch_size=batch_size, learning_rate=learning_rate, warmup=warmup, max_length=length, dropout=0.1,
            patience=patience, eval_every=eval_every, max_steps=max_steps, seed=seed, progress=progress, dtype=dtype,
            pooling=(meta.get("pooling") if mode == "task" else getattr(t, "pooling", "mean")),
            layers=(meta.get("layers", -1) if mode == "task" else getattr(t, "layers", -1)),
            resume=resume, checkpoint_every=checkpoint_every, stop_after=stop_after)
        if mode == "embedding" and isinstance(config.layers, list):
            config.layers = -1  # layer indices of the teacher need not exist in the student: its last layer
        if mode == "task":
            task = soft_target_task(config, t, temperature, alpha)
        elif mode == "embedding":
            task = EmbeddingDistillTask(config)
            task.setup(t, length)
        else:
            from kbert.text.tokenizer import Tokenizer

            task = GeneralDistillTask(config)
            task.setup(t, temperature, seed, Tokenizer.from_model_dir(student_dir))
        # task and embedding modes scored every text before training: the teacher can go
        summary = run(config, task=task, before_training=None if mode == "general" else t.release)
        if summary["checkpoint"] is None and student_dir == os.path.join(out_dir, STUDENT_INIT_DIR):
            # finished: only a resumed run starts from it, and a model dir is what gets uploaded (the copy of a
            # preset student is as large as the model itself)
            shutil.rmtree(student_dir, ignore_errors=True)
            student_dir = None
        summary.update(mode=mode, student_init=student_dir)
        return summary
