"""Fine-tuning tasks: what each kind of task brings to the one fine-tuning loop (`kbert.train.finetune`).

A task builds its network (a head on the backbone), turns rows into encoded `Examples`, cuts batches of them
into the network's features and targets, gives the training loss (in `keras.ops`), and scores a dev split. This is Model Garden's `Task` idea: the loop
knows none of it, and a new task is one class added to `TASKS`.

    classification        one text -> one of N labels (head on the pooled [CLS] output); with `multi_label`, any
                          number of them (a sigmoid a label, binary cross-entropy: transformers'
                          multi_label_classification)
    pair-classification   two texts (`[CLS] a [SEP] b [SEP]`) -> one of N labels (NLI, paraphrase)
    regression            one text or a pair -> a number (MSE on standardized targets)
    tagging               whitespace words -> one tag each (head on each word's first subword)
    question-answering    (question, context) -> the answer's span in the context (start / end logits per
                          token; long contexts in overlapping windows)
    sentence-embedding    a bi-encoder: both texts through the same backbone, pooled; pairs with a score
                          (cosine regression onto score / max score, or CoSENT's ranking loss) or, without
                          a score column, (anchor, positive) pairs with in-batch negatives
    sparse-embedding      SPLADE: the masked-LM head's weight per vocabulary token, max-pooled, on (anchor,
                          positive) pairs with in-batch negatives on dot products and a FLOPS sparsity penalty;
                          inference-free: the anchors read a trained per-token table instead of the model

Shapes: b = batch, s = padded length, k = labels, h = hidden size.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable, Dict, List, Optional

import numpy as np

from kbert.data import rows as cells
from kbert.data.rows import read_rows, text_rows
from kbert.data.features import features, first_pieces, pad, segment_ids, unit_vectors_in_batches, vectors_in_batches
from kbert.train.metrics import entity_figures, pair_classification_figures, pearson, spearman
from kbert.utils import macro_f1, multi_label_figures

SIMILARITY_LOSSES = ("cosent", "cosine", "contrastive")
CONTRASTIVE_MARGIN = 0.5  # sentence-transformers' OnlineContrastiveLoss default: a non-pair's cosine distance
IGNORE = -1  # tag label of tokens that are not the first piece of a word


@dataclasses.dataclass
class Examples:
    """One encoded split: token ids (and segment ids) per example, labels (an array, or per-token lists for
    tagging, or None for unscored pairs), and for bi-encoders the second text's token ids and hard
    negatives' token ids; for in-batch training sets `text_ids` `[n, k]`, one integer per text of each row
    (anchor, positive, hard negative; SimCSE: the text alone), equal where the encoded texts are equal,
    `texts` the distinct texts in the order of those integers, and with a guide model its unit vectors of
    them, `guide` `[distinct texts, h_g]`."""
    token_ids: List[List[int]]
    segment_ids: Optional[List[List[int]]]
    labels: object
    pair_token_ids: Optional[List[List[int]]] = None
    negative_token_ids: Optional[List[List[int]]] = None
    text_ids: Optional[np.ndarray] = None
    texts: Optional[List[str]] = None
    guide: Optional[np.ndarray] = None

    def __len__(self):
        return len(self.token_ids)

    def lengths(self) -> np.ndarray:
        """Tokens per example (the longer text for a pair of a bi-encoder)."""
        lengths = np.array([len(x) for x in self.token_ids])
        for other in (self.pair_token_ids, self.negative_token_ids):
            if other is not None:
                lengths = np.maximum(lengths, [len(x) for x in other])
        return lengths


def epoch_batches(rng: np.random.Generator, examples: Examples, batch_size: int, group_by_length: bool,
                  window: int = 64) -> List[np.ndarray]:
    """One epoch of index batches: shuffled; with `group_by_length`, each window of `window` batches is sorted
    by length before it is cut into batches, and the batches are shuffled again (little padding per batch)."""
    order = rng.permutation(len(examples))
    if not group_by_length:
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    lengths = examples.lengths()
    batches = []
    for w in range(0, len(order), batch_size * window):
        chunk = order[w:w + batch_size * window]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches.extend(chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size))
    return [batches[i] for i in rng.permutation(len(batches))]


def cosent_loss(cos, scores, scale: float = 20.0):
    """CoSENT: log(1 + sum over the pairs (i, j) of the batch with scores[i] > scores[j] of
    exp(scale * (cos[j] - cos[i]))): zero-cost when every higher-scored pair has the higher cosine."""
    import keras

    scores = keras.ops.cast(scores, cos.dtype)
    ranked = keras.ops.cast(scores[:, None] > scores[None, :], cos.dtype)
    logits = scale * (cos[None, :] - cos[:, None]) - (1.0 - ranked) * 1e4
    logits = keras.ops.concatenate([keras.ops.zeros((1,), cos.dtype), keras.ops.reshape(logits, (-1,))], 0)
    return keras.ops.logsumexp(logits)


def online_contrastive_loss(cos, labels, margin: float = CONTRASTIVE_MARGIN):
    """sentence-transformers' OnlineContrastiveLoss on the pairs' cosine distance d = 1 - cos, labels 1 (a pair)
    / 0 (not): the sum of d^2 over the hard pairs (those farther apart than the closest non-pair of the batch)
    and of max(0, margin - d)^2 over the hard non-pairs (those closer than the farthest pair). With no non-pair
    in the batch the pairs above their mean distance count, with no pair the non-pairs below theirs. Written
    with masks, not boolean indexing, so the batch keeps its static shape on every backend."""
    import keras

    d = 1.0 - cos
    labels = keras.ops.cast(labels, d.dtype)
    pos, neg = keras.ops.cast(labels == 1, d.dtype), keras.ops.cast(labels == 0, d.dtype)
    n_pos, n_neg = keras.ops.sum(pos), keras.ops.sum(neg)
    farthest_pair = keras.ops.max(keras.ops.where(pos > 0, d, -1e4))
    closest_non_pair = keras.ops.min(keras.ops.where(neg > 0, d, 1e4))
    non_pair_cut = keras.ops.where(n_pos > 0, farthest_pair, keras.ops.sum(neg * d) / keras.ops.maximum(n_neg, 1.0))
    pair_cut = keras.ops.where(n_neg > 0, closest_non_pair, keras.ops.sum(pos * d) / keras.ops.maximum(n_pos, 1.0))
    hard_pairs = pos * keras.ops.cast(d > pair_cut, d.dtype)
    hard_non_pairs = neg * keras.ops.cast(d < non_pair_cut, d.dtype)
    return (keras.ops.sum(hard_pairs * keras.ops.square(d))
            + keras.ops.sum(hard_non_pairs * keras.ops.square(keras.ops.relu(margin - d))))


def binary(labels) -> bool:
    """Whether `labels` are 1 / 0 with both present (pairs and non-pairs: dev figures of pair classification)."""
    if labels is None or len(labels) < 2:
        return False
    values = np.unique(np.asarray(labels))
    return len(values) == 2 and set(values.tolist()) == {0.0, 1.0}


class FinetuneTask:
    """The base: single texts or `[CLS] a [SEP] b [SEP]` pairs through the backbone, one output per example.

    Subclasses set `name` and `metric` and override `label_set`, `targets`, `loss` and `scores`."""
    name = ""
    metric = "accuracy"  # the dev score that picks the best checkpoint
    higher_is_better = True
    trains_pooler = True  # whether BERT's [CLS] pooler feeds this task's head
    label_pad = None  # labels per token ([b, s], padded with this where a batch is widened), or None: per row
    needs_pair = False
    # the history's name of each loss key's own mean train loss, where a task has several losses (one per
    # dataset of a multi-dataset run: their mean alone mixes losses of different scales); [] for one loss
    loss_names: List[str] = []

    def __init__(self, config):
        self.config = config
        self.labels: Optional[List[str]] = None
        self.target = (0.0, 1.0)  # (mean, std) a regression head is trained on
        self.weights: Optional[np.ndarray] = None  # per-class loss weights (`class_weights`); None: all 1

    # ------------------------------------------------------------------ checks and labels
    def check(self) -> None:
        """Refuses settings this task cannot use (called before anything is loaded)."""
        c = self.config
        if self.needs_pair and not c.pair_column:
            raise ValueError(f"task={self.name!r} needs `pair_column` (the second text)")
        if not c.label_column:
            raise ValueError(f"task={self.name!r} needs `label_column`")
        if self.token_head and (c.pooling is not None or c.layers != -1):
            raise ValueError(f"`pooling` and `layers` do not apply to task={self.name!r} (its head reads every token "
                             f"of the last layer). Received: pooling={c.pooling!r}, layers={c.layers!r}")

    @property
    def token_head(self) -> bool:
        """Whether the head reads every token (no pooling or layers to choose): `kbert.models.tasks.TOKEN_TASKS`."""
        from kbert.models.tasks import TOKEN_TASKS

        return self.name in TOKEN_TASKS

    sparse = False  # SPLADE: the model is loaded with its masked-LM head (`load_backbone`)

    def load_backbone(self, weights_dir: str, dtype):
        """The starting model's backbone, with every layer's hidden states (poolings may read any)."""
        from kbert.models.convert import load_model

        return load_model(weights_dir, output_hidden_states=True, dtype=dtype)

    def check_model(self, backbone) -> None:
        """Refuses settings the loaded backbone cannot serve (called once it is loaded, before any data)."""

    def label_set(self, rows: List[dict], progress: bool) -> Optional[List[str]]:
        return None

    @property
    def columns(self):
        """The columns the train and dev files must have."""
        c = self.config
        return [c.text_column, c.pair_column, c.label_column]

    @property
    def num_outputs(self) -> int:
        return len(self.labels) if self.labels else 0

    def network(self, backbone, dropout: float, pooling, layers):
        """The network this task trains: by default kbert's `TaskNetwork` head for the task's name (what
        `TaskModel.load` and `kbert export` read back); a registered task may return its own Keras model."""
        from kbert.models.tasks import TaskNetwork

        return TaskNetwork(backbone, self.name, self.num_outputs, dropout, self.target, pooling, layers)

    def save(self, network, out_dir: str, tokenizer, meta: dict) -> None:
        """Writes the best network: the backbone as a kbert model dir, and the head with `meta`."""
        from kbert.models.io import save_model
        from kbert.models.tasks import save_task_head

        save_model(network.backbone, out_dir, tokenizer=tokenizer)
        save_task_head(network, meta, out_dir)

    # ------------------------------------------------------------------ examples
    def read_train(self) -> list:
        """The training rows (the file or list `config.train`), checked to have the task's columns."""
        return read_rows(self.config.train, self.train_columns, names=getattr(self.config, "columns", None))

    @property
    def train_columns(self):
        return self.columns

    def encode(self, rows: List[dict], tokenizer, max_length: int, split: str) -> Examples:
        c = self.config
        texts = [cells.text_cell(r, c.text_column, f"{split} row {i + 1}") for i, r in enumerate(rows)]
        pairs = None
        if c.pair_column:
            pairs = [cells.text_cell(r, c.pair_column, f"{split} row {i + 1}") for i, r in enumerate(rows)]
        encodings = tokenizer.encode_batch(texts, pairs=pairs, max_length=max_length)
        raw = [r.get(c.label_column) for r in rows]
        return Examples([e.ids for e in encodings], [segment_ids(e.ids, tokenizer.sep_id) for e in encodings],
                        self.targets(raw, encodings, split))

    def targets(self, raw: list, encodings, split: str):
        raise NotImplementedError

    def fit(self, train: Examples) -> None:
        """Statistics of the training targets the loss uses (a regression's mean and std)."""

    # ------------------------------------------------------------------ batches
    def batches_per_epoch(self, examples, batch_size: int) -> int:
        return math.ceil(len(examples) / batch_size)

    def epoch_batches(self, rng, examples, batch_size: int, group_by_length: bool) -> list:
        """One epoch of batch descriptors (index arrays here), in training order."""
        return epoch_batches(rng, examples, batch_size, group_by_length)

    def training_batch(self, examples, batch, pad_id: int):
        """(features, y, examples in the batch, loss key) for one descriptor of `epoch_batches`; the key (a
        Python int) picks the loss where a task has several (one compiled step per key)."""
        feats, y = self.batch(examples, batch, pad_id)
        return feats, y, len(batch), 0

    def batch(self, examples: Examples, index: np.ndarray, pad_id: int):
        """(features, y) of the examples at `index`: `[b, s]` ids and segments, `[b]` labels."""
        ids = pad([examples.token_ids[i] for i in index], pad_id)
        segs = pad([examples.segment_ids[i] for i in index], 0, ids.shape[1])
        return features(ids, segs, pad_id), self.batch_labels(examples, index, ids.shape[1])

    def batch_labels(self, examples: Examples, index: np.ndarray, width: int):
        return np.asarray(examples.labels[index])

    def loss(self, network, feats, y, n, key: int = 0):
        """The training loss of one batch (the network called with training=True); `key`: see
        `training_batch`."""
        raise NotImplementedError

    def other_variables(self) -> list:
        """Variables outside the network that `loss` reads (a distillation teacher's), never trained."""
        return []

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, infer: Callable, examples: Examples, batch_size: int, pad_id: int) -> Dict[str, float]:
        """Dev scores; `infer(ids, segments)` -> the network's `[b, ...]` outputs as numpy."""
        outputs = [None] * len(examples)
        by_length = np.argsort([len(x) for x in examples.token_ids], kind="stable")  # little padding per batch
        for start in range(0, len(examples), batch_size):
            index = by_length[start:start + batch_size]
            ids = pad([examples.token_ids[i] for i in index], pad_id)
            segs = pad([examples.segment_ids[i] for i in index], 0, ids.shape[1])
            for i, out in zip(index, infer(ids, segs)):
                outputs[i] = out
        return self.scores(outputs, examples)

    def scores(self, outputs: list, examples: Examples) -> Dict[str, float]:
        raise NotImplementedError

    def dev_metric(self, dev: Optional[Examples]) -> str:
        return self.metric


def class_weight_vector(spec, labels: List[str], counts, rows: int, multi_label: bool) -> Optional[np.ndarray]:
    """`[k]` float32 loss weights of `labels` from `class_weights`, or None (all 1). "balanced": scikit-learn's
    n / (k * n_c) for classes; for a multi-label task each label's positives n_neg / n_pos (torch's pos_weight).
    A mapping gives weights by label (others 1); a label the training data lacks is an error."""
    if spec is None:
        return None
    if spec == "balanced":
        if multi_label:
            return np.array([(rows - counts[k]) / max(counts[k], 1) for k in labels], np.float32)
        total = sum(counts[k] for k in labels)
        return np.array([total / (len(labels) * max(counts[k], 1)) for k in labels], np.float32)
    if not isinstance(spec, dict):
        raise ValueError(f"`class_weights` must be 'balanced' or a mapping of label to weight. Received: {spec!r}")
    unknown = sorted(str(k) for k in spec if str(k).strip() not in labels)
    if unknown:
        raise ValueError(f"`class_weights` names labels the training data lacks: {unknown[:5]} (labels: {labels})")
    given = {str(k).strip(): v for k, v in spec.items()}
    out = []
    for k in labels:
        w = given.get(k, 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0:
            raise ValueError(f"`class_weights[{k!r}]` must be a positive number. Received: {w!r}")
        out.append(float(w))
    return np.array(out, np.float32)


class ClassificationTask(FinetuneTask):
    name = "classification"

    @property
    def multi_label(self) -> bool:
        return bool(getattr(self.config, "multi_label", False))

    @property
    def metric(self) -> str:  # multi-label: F1 over every (row, label) decision, as GoEmotions' and KOTE's tables
        return "micro_f1" if self.multi_label else "accuracy"

    @property
    def extra_meta(self) -> dict:
        return {"multi_label": True} if self.multi_label else {}

    def label_set(self, rows, progress):
        import sys

        c = self.config
        if self.multi_label:
            counts = collections.Counter(x for i, r in enumerate(rows)
                                         for x in cells.label_list(r[c.label_column], "train", i))
        else:
            list_cell = next((i for i, r in enumerate(rows) if isinstance(r[c.label_column], (list, tuple))), None)
            if list_cell is not None:
                raise ValueError(f"train row {list_cell + 1}: the label is a list "
                                 f"{rows[list_cell][c.label_column]!r}; for rows with any number of labels pass "
                                 f"multi_label=True (--multi-label)")
            counts = collections.Counter(cells.class_label(r[c.label_column], "train", i) for i, r in enumerate(rows))
        labels = [str(x).strip() for x in (c.labels or sorted(counts))]
        if len(labels) < 2 and not (self.multi_label and labels):
            raise ValueError(f"Classification needs at least 2 labels; the training data has {labels}")
        self.weights = class_weight_vector(getattr(c, "class_weights", None), labels, counts, len(rows),
                                           self.multi_label)
        if progress:  # the label set before training: an unexpected class shows here, not in the scores
            print(f"{len(labels)} labels: " + ", ".join(f"{k!r} ({counts[k]} rows)" for k in labels),
                  file=sys.stderr, flush=True)
            if self.weights is not None:
                print(("positive weights: " if self.multi_label else "class weights: ")
                      + ", ".join(f"{k!r} {w:.3g}" for k, w in zip(labels, self.weights)), file=sys.stderr, flush=True)
        return labels

    def targets(self, raw, encodings, split):  # [n] class indices, or [n, k] multi-hot rows
        return cells.label_targets(raw, self.labels, split, self.multi_label)

    def loss(self, network, feats, y, n, key: int = 0):
        import keras

        logits = network(feats, training=True)  # [b, k]
        weights = self.weights
        if self.multi_label:  # a sigmoid a label: the mean binary cross-entropy over the [b, k] decisions
            z, y = keras.ops.cast(logits, "float32"), keras.ops.cast(y, "float32")
            if weights is None:
                return keras.ops.mean(keras.ops.binary_crossentropy(y, z, from_logits=True))
            # each label's positives weighted (torch's BCEWithLogitsLoss pos_weight): -(w y log s + (1-y) log(1-s))
            w = keras.ops.convert_to_tensor(weights, "float32")
            return keras.ops.mean((1.0 - y) * z + (1.0 + (w - 1.0) * y) * keras.ops.softplus(-z))
        ce = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)  # [b]
        if weights is None:
            return keras.ops.mean(ce)
        # the weighted mean over the batch, as torch's CrossEntropyLoss(weight=...) reduces it
        w = keras.ops.take(keras.ops.convert_to_tensor(weights, "float32"), keras.ops.cast(y, "int32"))
        return keras.ops.sum(w * keras.ops.cast(ce, "float32")) / keras.ops.sum(w)

    def scores(self, outputs, examples):
        if self.multi_label:
            return multi_label_figures(examples.labels, np.stack(outputs) > 0)  # sigmoid > 0.5
        pred = np.argmax(np.stack(outputs), axis=1)
        return {"accuracy": float(np.mean(pred == examples.labels)),
                "macro_f1": macro_f1(examples.labels, pred, len(self.labels))}


class PairClassificationTask(ClassificationTask):
    name = "pair-classification"
    needs_pair = True


class RegressionTask(FinetuneTask):
    name = "regression"
    metric = "spearman"

    @property
    def num_outputs(self) -> int:
        return 1

    def targets(self, raw, encodings, split):
        return np.array([cells.number(v, split, i) for i, v in enumerate(raw)], np.float32)

    def fit(self, train):
        self.target = (float(np.mean(train.labels)), float(np.std(train.labels)) or 1.0)

    def loss(self, network, feats, y, n, key: int = 0):
        import keras

        out = network(feats, training=True)  # [b, 1], in the units of the labels
        return keras.ops.mean(keras.ops.square((out[:, 0] - y) / self.target[1]))

    def scores(self, outputs, examples):
        pred = np.array([o[0] for o in outputs])
        return {"spearman": spearman(pred, examples.labels), "pearson": pearson(pred, examples.labels),
                "mse": float(np.mean((pred - examples.labels) ** 2))}


class TaggingTask(FinetuneTask):
    """One tag per whitespace word (the label cell a list or a space-separated string; trained on each word's
    first piece), or entity spans: the label cell a list of `[start, end, label]` character spans of the text
    (`kbert.data.rows.entity_spans`), every token trained on its BIO tag (`kbert.data.entities`), so an entity
    may end inside a word, before its particle; dev figures then add entity-level precision, recall and F1, and
    the best checkpoint is the one with the best entity F1."""
    name = "tagging"
    trains_pooler = False
    label_pad = IGNORE

    def __init__(self, config):
        super().__init__(config)
        self.spans = False  # set by `label_set`: the rows label entity spans

    @property
    def metric(self) -> str:
        return "entity_f1" if self.spans else "accuracy"

    @property
    def extra_meta(self) -> dict:
        return {"aggregation": "simple"} if self.spans else {}

    def label_set(self, rows, progress):
        c = self.config
        kinds = [cells.entity_spans(r[c.label_column], "train", i) for i, r in enumerate(rows)]
        spans = [k is not None for k in kinds]
        if any(spans) and not all(spans):
            i = spans.index(not spans[0])
            raise ValueError(f"train row {i + 1}: the rows mix entity spans and word tags; label every row one way")
        self.spans = bool(spans) and all(spans)
        if self.spans:
            types = sorted({kind for k in kinds for _, _, kind in k})
            if not types and not c.labels:
                raise ValueError("tagging with entity spans: the training rows mark no entity")
            return [str(x) for x in c.labels] if c.labels else ["O"] + [f"{p}-{t}" for t in types for p in "BI"]
        labels = c.labels or sorted({t for i, r in enumerate(rows) for t in cells.tags(r[c.label_column], "train", i)})
        return [str(x) for x in labels]

    def encode(self, rows, tokenizer, max_length, split):
        if not self.spans:
            return super().encode(rows, tokenizer, max_length, split)
        from kbert.data.entities import bio_labels, token_spans

        c = self.config
        if c.pair_column:
            raise ValueError("tagging with entity spans reads one text a row; `pair_column` does not apply")
        texts = [cells.text_cell(r, c.text_column, f"{split} row {i + 1}") for i, r in enumerate(rows)]
        encodings = tokenizer.encode_batch(texts, max_length=max_length)
        index = {label: k for k, label in enumerate(self.labels)}
        labels = []
        for i, (r, text, enc) in enumerate(zip(rows, texts, encodings)):
            entities = cells.entity_spans(r.get(c.label_column), split, i)
            if entities is None:
                raise ValueError(f"{split} row {i + 1}: word tags where the training rows have entity spans")
            for s, e, kind in entities:
                if e > len(text):
                    raise ValueError(f"{split} row {i + 1}: entity [{s}, {e}, {kind!r}] runs past its text of "
                                     f"{len(text)} characters")
                if f"B-{kind}" not in index:
                    raise ValueError(f"{split} row {i + 1}: entity type {kind!r} not seen in training (labels: "
                                     f"{self.labels})")
            tags = bio_labels(token_spans(tokenizer, text, enc), entities)
            labels.append([IGNORE if t is None else index[t] for t in tags])
        return Examples([e.ids for e in encodings], [segment_ids(e.ids, tokenizer.sep_id) for e in encodings], labels)

    def targets(self, raw, encodings, split):
        return [self._word_labels(e, cells.tags(v, split, i), split, i)
                for i, (e, v) in enumerate(zip(encodings, raw))]

    def _word_labels(self, enc, tags, split, i) -> List[int]:
        """Per-token tag ids: each whitespace word's tag on its first subword, IGNORE elsewhere."""
        firsts = first_pieces(enc)
        if len(firsts) != len(tags):
            raise ValueError(f"{split} row {i + 1}: {len(firsts)} words but {len(tags)} tags (tags are one per "
                             f"whitespace-separated word)")
        index = {label: k for k, label in enumerate(self.labels)}
        out = [IGNORE] * len(enc.ids)
        for t, tag in zip(firsts, tags):
            if tag not in index:
                raise ValueError(f"{split} row {i + 1}: tag {tag!r} not seen in training")
            if t is not None:  # None: the word was cut off by max_length
                out[t] = index[tag]
        return out

    def batch_labels(self, examples, index, width):
        return pad([examples.labels[i] for i in index], IGNORE, width)  # [b, s]

    def loss(self, network, feats, y, n, key: int = 0):
        import keras

        logits = network(feats, training=True)  # [b, s, k]
        valid = keras.ops.cast(y >= 0, "float32")
        ce = keras.losses.sparse_categorical_crossentropy(keras.ops.maximum(y, 0), logits, from_logits=True)
        return keras.ops.sum(ce * valid) / keras.ops.maximum(keras.ops.sum(valid), 1.0)

    def scores(self, outputs, examples):
        y = np.concatenate([np.array(l) for l in examples.labels])
        p = np.concatenate([np.argmax(o[:len(l)], axis=-1) for o, l in zip(outputs, examples.labels)])
        keep = y >= 0
        out = {"accuracy": float(np.mean(p[keep] == y[keep])), "macro_f1": macro_f1(y[keep], p[keep], len(self.labels))}
        if self.spans:  # whole entities, over each row's tokens (the lone special tokens left out)
            gold, predicted = [], []
            for o, l in zip(outputs, examples.labels):
                l = np.array(l)
                kept = l >= 0
                gold.append([self.labels[k] for k in l[kept]])
                predicted.append([self.labels[k] for k in np.argmax(o[:len(l)], axis=-1)[kept]])
            out.update(entity_figures(gold, predicted))
        return out


@dataclasses.dataclass
class QAExamples(Examples):
    """Question-answering examples: one row per window of a (question, context) pair (`token_ids`,
    `segment_ids`, `labels` `[n, 2]`: its answer's start and end token, 0 for [CLS]); `windows` (their token
    spans, `kbert.data.qa.Window`) and `example_of` (the question each belongs to) for decoding, and per
    question `questions`: (id, context, its character map `starts` / `ends`, gold answer texts)."""
    windows: Optional[list] = None
    example_of: Optional[np.ndarray] = None
    questions: Optional[list] = None


class QuestionAnsweringTask(FinetuneTask):
    """Extractive question answering (SQuAD, KorQuAD, KLUE-MRC): the answer is a span of the context. The head
    gives each token a start and an end logit; the loss is the mean of the cross-entropies of the gold start
    and end over the input's tokens (BERT's SQuAD recipe). A context longer than `max_length` is cut into
    windows sharing `doc_stride` tokens; a window without the whole answer, or an unanswerable question, points
    at [CLS]. Dev: KorQuAD's exact match and character F1 of the best span over each question's windows.

    Columns: `text_column` the question, `pair_column` the context, `label_column` the answers (defaults
    "question", "context", "answers": SQuAD's, as `datasets` and `kbert.data.qa.squad_rows` give them)."""
    name = "question-answering"
    metric = "f1"
    trains_pooler = False

    def __init__(self, config):
        super().__init__(config)
        c = config  # SQuAD's column names unless others were given
        if c.text_column == "text":
            c.text_column = "question"
        if c.pair_column is None:
            c.pair_column = "context"
        if c.label_column == "label":
            c.label_column = "answers"
        self.impossible = False  # whether training holds unanswerable questions (SQuAD 2.0, KorQuAD 2.0 style)

    @property
    def num_outputs(self) -> int:
        return 2

    @property
    def extra_meta(self) -> dict:
        c = self.config
        return {"doc_stride": c.doc_stride, "max_query_length": c.max_query_length,
                "max_answer_length": c.max_answer_length, "impossible": self.impossible}

    def encode(self, rows, tokenizer, max_length, split):
        from kbert.data import qa

        c = self.config
        questions = [cells.text_cell(r, c.text_column, f"{split} row {i + 1}") for i, r in enumerate(rows)]
        contexts = [cells.text_cell(r, c.pair_column, f"{split} row {i + 1}") for i, r in enumerate(rows)]
        encodings = tokenizer.encode_batch(contexts, add_special_tokens=False)
        ids, segs, labels, windows, example_of, meta = [], [], [], [], [], []
        skipped = 0
        for i, (row, question, context, enc) in enumerate(zip(rows, questions, contexts, encodings)):
            where = f"{split} row {i + 1}"
            gold = qa.answer_list(row.get(c.label_column), context, where)
            normalized, starts, ends = qa.aligned_normalize(context, tokenizer.normalize)
            if normalized != enc.normalized:
                raise ValueError(f"{where}: the context's alignment does not match the tokenizer's normalization")
            span = None
            if gold:  # the first answer is the training target (SQuAD's train sets have one)
                text, at = gold[0]
                span = qa.normalized_span(starts, ends, at, at + len(text))
                if span is None:
                    skipped += 1
            self.impossible = self.impossible or (split == "train" and not gold)
            for w in qa.windows(tokenizer, question, enc, max_length, c.doc_stride, c.max_query_length):
                ids.append(w.ids)
                segs.append(w.segments)
                labels.append(qa.token_targets(w, span))
                windows.append(w)
                example_of.append(i)
            meta.append((str(row.get("id", i)), context, starts, ends, [t for t, _ in gold]))
        if skipped and c.progress:
            import sys

            print(f"{split}: {skipped} answers fall in text the tokenizer's normalization removes; those questions "
                  f"train on [CLS] (no answer)", file=sys.stderr, flush=True)
        return QAExamples(ids, segs, np.asarray(labels, np.int32).reshape(-1, 2), windows=windows,
                          example_of=np.asarray(example_of, np.int64), questions=meta)

    def loss(self, network, feats, y, n, key: int = 0):
        import keras

        logits = network(feats, training=True)  # [b, s, 2]
        # padding cannot be an answer: its logits leave the softmax
        logits = logits - (1.0 - keras.ops.cast(feats["padding_mask"], logits.dtype))[:, :, None] * 1e4
        ce = [keras.losses.sparse_categorical_crossentropy(y[:, k], logits[:, :, k], from_logits=True)
              for k in (0, 1)]
        return keras.ops.mean((ce[0] + ce[1]) / 2.0)

    def scores(self, outputs, examples):
        from kbert.data import qa

        c = self.config
        by_question = collections.defaultdict(list)
        for out, w, i in zip(outputs, examples.windows, examples.example_of):
            by_question[int(i)].append((out[:, 0], out[:, 1], w))
        predictions, truths = {}, {}
        for i, (qid, context, starts, ends, gold) in enumerate(examples.questions):
            best = qa.answers(by_question[i], context, starts, ends, 1, c.max_answer_length,
                              handle_impossible=self.impossible)
            predictions[i], truths[i] = (best[0]["answer"] if best else ""), gold
        return qa.qa_scores(predictions, truths)


class SentenceEmbeddingTask(FinetuneTask):
    """A bi-encoder: every text through the same backbone, pooled. Objectives (`config.objective`):

    - None (pairs): scored pairs regress their cosine onto the score (`similarity_loss="cosine"`) or rank by
      it (CoSENT); unscored (anchor, positive) pairs learn with in-batch negatives, plus a hard negative per
      row from `negative_column` when given (it joins the candidates every anchor is scored against);
    - "simcse": unsupervised SimCSE on `text_column` alone: each text twice through the network (two dropout
      masks) is its own positive, the batch's other texts the negatives. `train` may be plain text too (a
      .txt file of a text per line, or a list of strings); `pair_column` / `label_column`, when given,
      describe the dev set (scored pairs) it is evaluated on.

    In-batch losses divide cosines by `config.temperature` (0.05, i.e. a scale of 20). With
    `config.matryoshka_dims` (e.g. [64, 128]) the loss is averaged over the vector cut to each of those
    widths (renormalized) and the full width, so truncated vectors still rank well."""
    name = "sentence-embedding"
    metric = "spearman"
    trains_pooler = False
    OBJECTIVES = (None, "simcse")

    def check(self):
        c = self.config
        if c.objective not in self.OBJECTIVES:
            raise ValueError(f"`objective` for task='sentence-embedding' must be one of {self.OBJECTIVES}. "
                             f"Received: objective={c.objective!r}")
        if c.objective is None and not c.pair_column:
            raise ValueError("task='sentence-embedding' needs `pair_column` (the second sentence of each pair), "
                             "or objective='simcse' to train on single texts")
        if c.negative_column and (c.objective == "simcse" or c.label_column):
            raise ValueError("`negative_column` (hard negatives) goes with unscored (anchor, positive) pairs: "
                             "label_column=None and no objective")
        if not (isinstance(c.temperature, (int, float)) and c.temperature > 0):
            raise ValueError(f"`temperature` must be a positive number. Received: temperature={c.temperature!r}")
        symmetric = getattr(c, "symmetric", False)
        if not isinstance(symmetric, bool):
            raise ValueError(f"`symmetric` must be True or False. Received: symmetric={symmetric!r}")
        if symmetric and c.objective != "simcse" and c.label_column:
            raise ValueError("`symmetric` is a form of the in-batch loss, and scored pairs (`label_column`) train "
                             "by cosine / CoSENT: leave it out, or train (anchor, positive) pairs or SimCSE")
        dims = c.matryoshka_dims or []
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims):
            raise ValueError(f"`matryoshka_dims` must be positive integers. Received: {c.matryoshka_dims!r}")
        if self.in_batch_only and c.batch_size < 2:  # a batch of one has no negative: its loss is 0, nothing learns
            raise ValueError(f"in-batch negatives ({self.objective_name}) need `batch_size` >= 2, the other rows of "
                             f"a batch being each row's negatives. Received: batch_size={c.batch_size!r}")
        prompts = getattr(c, "prompts", None)
        if not (prompts is None or isinstance(prompts, str) or (isinstance(prompts, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()))):
            raise ValueError(f"`prompts` must be a string (every text column) or {{column: string}}. "
                             f"Received: prompts={prompts!r}")
        unknown = sorted(set(prompts) - {c.text_column, c.pair_column, c.negative_column} - {None}) \
            if isinstance(prompts, dict) else []
        if unknown:
            raise ValueError(f"`prompts` names column {unknown[0]!r}, which is not a text column of this data "
                             f"({[x for x in (c.text_column, c.pair_column, c.negative_column) if x]})")

    @property
    def in_batch_only(self) -> bool:
        """Whether every negative comes from the batch's other rows (SimCSE, or pairs without hard negatives)."""
        c = self.config
        return c.objective == "simcse" or not (c.label_column or c.negative_column)

    @property
    def objective_name(self) -> str:
        return "SimCSE" if self.config.objective == "simcse" else "(anchor, positive) pairs"

    def check_model(self, backbone):
        width, dims = backbone.config.hidden_size, self.config.matryoshka_dims or []
        if any(d > width for d in dims):
            raise ValueError(f"`matryoshka_dims` {sorted(dims)} go beyond the model's vectors, which have "
                             f"{width} dimensions")

    @property
    def columns(self):
        c = self.config
        return [c.text_column, c.pair_column, c.label_column, c.negative_column]

    @property
    def train_columns(self):
        return [self.config.text_column] if self.config.objective == "simcse" else self.columns

    def read_train(self) -> list:
        """SimCSE reads texts as `kbert.distill` does: a .txt of lines or a list of strings too."""
        if self.config.objective == "simcse":
            return text_rows(self.config.train, self.config.text_column, getattr(self.config, "columns", None))
        return super().read_train()

    def encode(self, rows, tokenizer, max_length, split):
        c = self.config

        prompts = getattr(c, "prompts", None)

        raw = {}

        def ids(column):
            texts = [cells.text_cell(r, column, f"{split} row {i + 1}") for i, r in enumerate(rows)]
            prompt = prompts if isinstance(prompts, str) else (prompts or {}).get(column, "")
            if prompt:  # sentence-transformers' training prompts: before the text, inside its max_length
                texts = [prompt + t for t in texts]
            raw[column] = texts
            return [e.ids for e in tokenizer.encode_batch(texts, max_length=max_length)]

        def in_batch(columns, encoded):  # text_ids, and the distinct texts in their order
            text_ids = text_identities(encoded)
            texts = [None] * (int(text_ids.max()) + 1 if text_ids.size else 0)
            for k, column in enumerate(columns):
                for i, t in zip(text_ids[:, k], raw[column]):
                    texts[i] = t if texts[i] is None else texts[i]
            return dict(text_ids=text_ids, texts=texts)

        a = ids(c.text_column)
        if c.objective == "simcse" and split == "train":
            return Examples(a, None, None, **in_batch([c.text_column], [a]))
        scores = None
        if c.label_column:
            scores = np.array([cells.number(r.get(c.label_column), split, i) for i, r in enumerate(rows)], np.float32)
        negatives = ids(c.negative_column) if c.negative_column and split == "train" else None
        b = ids(c.pair_column)
        extra = {}
        if split == "train" and scores is None:
            columns = [c.text_column, c.pair_column] + ([c.negative_column] if negatives is not None else [])
            extra = in_batch(columns, [a, b] + ([negatives] if negatives is not None else []))
        return Examples(a, None, scores, pair_token_ids=b, negative_token_ids=negatives, **extra)

    def fit(self, train):
        if self.in_batch_only and len(train) < 2:
            raise ValueError(f"in-batch negatives ({self.objective_name}) need at least 2 training rows, each "
                             f"the others' negative; the training data has {len(train)}")
        if self.in_batch_only and train.text_ids is not None and len(np.unique(train.text_ids[:, -1])) < 2:
            # one candidate text throughout: it is every row's positive, so no row ever has a negative
            raise ValueError(f"in-batch negatives ({self.objective_name}) need at least 2 different texts to "
                             f"tell apart; every training row's " + ("text" if self.config.objective == "simcse"
                                                                     else "positive") + " is the same text")
        self.score_max = 1.0
        if train.labels is not None:
            self.score_max = float(np.max(np.abs(train.labels))) or 1.0
        odd = sorted(set(np.unique(train.labels).tolist()) - {0.0, 1.0})[:3] if train.labels is not None else []
        if self.config.similarity_loss == "contrastive" and self.config.objective != "simcse" and odd:
            raise ValueError(f"similarity_loss='contrastive' trains on pairs labelled 1 (similar) or 0 (not); "
                             f"column {self.config.label_column!r} holds {odd}. Scores train with 'cosine' or "
                             f"'cosent'")

    def batch(self, examples, index, pad_id):
        """The texts of the batch in one `[k b, s]` batch: anchors, then positives (SimCSE: the anchors
        again), then hard negatives; y: `[b]` scores, or for in-batch negatives the `[k b]` identities of
        those texts in the same order (`in_batch_loss`'s `text_ids`; None without them), with a guide model
        {"text_ids": those, "guide": its `[k b, h_g]` unit vectors of the same texts}."""
        rows = [examples.token_ids[i] for i in index]
        rows += [(examples.pair_token_ids or examples.token_ids)[i] for i in index]
        if examples.negative_token_ids is not None:
            rows += [examples.negative_token_ids[i] for i in index]
        ids = pad(rows, pad_id)
        if examples.labels is not None:
            y = np.asarray(examples.labels[index])
        elif examples.text_ids is not None:
            y = batch_text_ids(examples.text_ids[np.asarray(index)])
            if examples.guide is not None:
                y = {"text_ids": y, "guide": examples.guide[y]}
        else:
            y = None
        return features(ids, np.zeros_like(ids), pad_id), y

    def loss(self, network, feats, y, n, key: int = 0):
        return self.embedding_loss(self.embed(network, feats), y, n, key)

    @staticmethod
    def embed(network, feats):
        """The batch's vectors `[k b, h]` (k = 2, or 3 with hard negatives), the part of the loss that reads
        the weights: `finetune(mini_batch_size=...)` runs it a chunk of rows at a time (gradient caching)."""
        return network(feats, training=True)

    def embedding_loss(self, v, y, n, key: int = 0):
        """The loss of the batch's vectors `v` (`embed`); reads no variable."""
        import keras

        dims = sorted(set(self.config.matryoshka_dims or [])) + [None]
        return keras.ops.mean(keras.ops.stack([self._loss_at(v if d is None else v[:, :d], y, n) for d in dims]))

    def _loss_at(self, v, y, n):
        import keras

        v = v / keras.ops.maximum(keras.ops.norm(v, axis=-1, keepdims=True), 1e-12)
        a, others = v[:n], v[n:]  # others: positives [b, h] then hard negatives [b, h]
        if self.config.objective == "simcse" or not self.config.label_column:
            # in-batch negatives (SimCSE too): a[i] should pick others[i] among all of them; y: the texts'
            # identities (or None), so a repeat of row i's texts elsewhere in the batch is no negative of it,
            # and with a guide model its vectors of them
            guide = y.get("guide") if isinstance(y, dict) else None
            ids = y["text_ids"] if isinstance(y, dict) else y
            margin = getattr(self.config, "guide_margin", 0.0)
            forward = in_batch_loss(a, others, self.config.temperature, ids, guide, margin)
            if not getattr(self.config, "symmetric", False):
                return forward
            # the reverse: positive i picks anchor i among the b anchors; the same call with the roles swapped
            # masks exactly the reverse's non-negatives (an anchor of the same text as anchor i, or whose
            # positive is positive i's text; the guide's, scored from the positive's side)
            def swap(t):
                return None if t is None else keras.ops.concatenate([t[n:2 * n], t[:n]], axis=0)

            backward = in_batch_loss(others[:n], a, self.config.temperature, swap(ids), swap(guide), margin)
            return (forward + backward) / 2
        cos = keras.ops.sum(a * others, axis=-1)
        if self.config.similarity_loss == "cosine":
            return keras.ops.mean(keras.ops.square(cos - y / self.score_max))
        if self.config.similarity_loss == "contrastive":
            return online_contrastive_loss(cos, y)
        return cosent_loss(cos, y)

    def evaluate(self, infer, examples, batch_size, pad_id):
        a = unit_vectors_in_batches(infer, examples.token_ids, pad_id, batch_size)
        b = unit_vectors_in_batches(infer, examples.pair_token_ids, pad_id, batch_size)
        if examples.labels is not None:
            cos = np.sum(a * b, axis=1)
            out = {"spearman": spearman(cos, examples.labels), "pearson": pearson(cos, examples.labels)}
            if binary(examples.labels):  # pairs and non-pairs: BinaryClassificationEvaluator's figures too
                figures = pair_classification_figures(cos, examples.labels)
                out.update({name: figures[name] for name in ("ap", "f1", "accuracy", "f1_threshold")})
            return out
        return {"recall@1": float(np.mean(np.argmax(a @ b.T, axis=1) == np.arange(len(a))))}

    def dev_metric(self, dev):
        if dev is None or dev.labels is None:
            return "recall@1"
        # 1 / 0 labels: the average precision of ranking the pairs by cosine (sentence-transformers'
        # BinaryClassificationEvaluator's primary figure); a correlation with two values says less
        return "ap" if binary(dev.labels) else "spearman"


def text_identities(columns: List[List[List[int]]]) -> np.ndarray:
    """`[n, k]` int32: one integer per encoded text of `k` columns of `n` rows, equal exactly where the token
    ids are (the same text, as the network sees it: after prompts and truncation)."""
    index: Dict[tuple, int] = {}
    return np.array([[index.setdefault(tuple(x), len(index)) for x in row] for row in zip(*columns)],
                    np.int32).reshape(len(columns[0]), len(columns))


def batch_text_ids(rows: np.ndarray) -> np.ndarray:
    """`[b, k]` rows of `Examples.text_ids` -> the `[k b]` identities in a batch's order: anchors, then
    positives (a one-column SimCSE row is its own positive), then hard negatives when there are any."""
    k = rows.shape[1]
    return np.concatenate([rows[:, 0], rows[:, min(1, k - 1)]] + ([rows[:, 2]] if k > 2 else []))


def in_batch_loss(anchors, candidates, temperature: float = 0.05, text_ids=None, guide=None,
                  guide_margin: float = 0.0):
    """Multiple-negatives ranking loss (SimCSE's, Sentence-BERT's MultipleNegativesRankingLoss): unit anchors
    [b, h] against unit candidates [c, h] (the b positives first, then any hard negatives): cross-entropy
    of row i of `anchors @ candidates.T / temperature` [b, c] with target i.

    `text_ids` [b + c] (optional): the identities of the anchors' then the candidates' texts (`Examples.
    text_ids`). A candidate j != i is then left out of row i's denominator when it is not a negative of
    anchor i: the same text as row i's positive or as the anchor itself, or the positive of another row with
    the same anchor text. Why: a text repeated in a batch (a question with two paraphrases, a passage that
    answers two questions, a line twice in SimCSE's text) would otherwise be pushed away from itself, a
    false negative. sentence-transformers avoids it with a batch sampler that skips rows
    (`batch_sampler="no_duplicates"`); with the identities known before encoding, the loss can mask exactly
    and every row still trains.

    `guide` [b + c, h_g] (optional): a guide model's unit vectors of the same texts in the same order
    (GISTEmbed, Solatorio 2024; sentence-transformers' GISTEmbedLoss). A candidate j != i that the guide
    scores closer to anchor i than i's own positive, less `guide_margin`, is left out of row i's denominator
    too: a paraphrase of the anchor that is another row's positive is a likely false negative the
    identities cannot see."""
    import keras

    logits = keras.ops.matmul(anchors, keras.ops.transpose(candidates)) / temperature
    b = keras.ops.shape(anchors)[0]
    drop = None  # [b, c]: candidates that are no negative of the row
    if text_ids is not None:
        anchor_ids, candidate_ids = text_ids[:b], text_ids[b:]
        drop = keras.ops.logical_or(candidate_ids[None, :] == candidate_ids[:b][:, None],
                                    candidate_ids[None, :] == anchor_ids[:, None])
        same_anchor = anchor_ids[None, :] == anchor_ids[:, None]  # [b, b]: over the positives' columns only
        drop = keras.ops.logical_or(drop, keras.ops.concatenate(
            [same_anchor, keras.ops.zeros_like(drop[:, b:])], axis=1))
    if guide is not None:
        guide = keras.ops.cast(guide, "float32")
        g_anchor, g_candidates = guide[:b], guide[b:]
        g_sim = keras.ops.matmul(g_anchor, keras.ops.transpose(g_candidates))  # [b, c]
        g_positive = keras.ops.sum(g_anchor * g_candidates[:b], axis=-1)  # [b]: each anchor's own positive
        closer = g_sim > g_positive[:, None] - guide_margin
        drop = closer if drop is None else keras.ops.logical_or(drop, closer)
    if drop is not None:
        own = keras.ops.arange(keras.ops.shape(candidates)[0])[None, :] == keras.ops.arange(b)[:, None]
        drop = keras.ops.logical_and(drop, keras.ops.logical_not(own))
        logits = logits - keras.ops.cast(drop, logits.dtype) * 1e4  # exp(-1e4) is 0 in every float dtype
    target = keras.ops.arange(b)
    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(target, logits, from_logits=True))


@dataclasses.dataclass
class MultiExamples:
    """The encoded training sets of a multi-dataset run, one `Examples` per dataset."""
    parts: List[Examples]

    def __len__(self):
        return sum(len(p) for p in self.parts)


DATASET_KEYS = ("data", "columns", "text_column", "pair_column", "label_column", "negative_column", "objective",
                "similarity_loss", "weight", "prompts", "symmetric", "name")
MIXES = ("proportional", "round_robin")


class MultiDatasetEmbeddingTask(SentenceEmbeddingTask):
    """Sentence embeddings from several datasets in one run (`config.datasets`), each with its own loss: the
    sentence-embedding objectives above (SimCSE on raw text, in-batch negatives with hard negatives for NLI
    or paraphrase pairs, cosine/CoSENT for scored pairs). Every batch comes from one dataset, so no
    dataset's loss sees another's rows; `config.mix` orders them: "proportional" (each dataset's batches
    shuffled in among the others', so a dataset trains in proportion to its size times its `weight`, a
    repeat count) or "round_robin" (one batch of each in turn while they last). The dev set is
    `config.dev` read with the top-level columns (scored pairs: Spearman; pairs: recall@1)."""

    def __init__(self, config):
        super().__init__(config)
        self.parts = []
        for i, spec in enumerate(config.datasets):
            if not isinstance(spec, dict) or "data" not in spec:
                raise ValueError(f"`datasets[{i}]` must be a mapping with `data` (a file or rows). Received: {spec!r}")
            unknown = sorted(set(spec) - set(DATASET_KEYS))
            if unknown:
                raise ValueError(f"`datasets[{i}]` has unknown key {unknown[0]!r}; keys are {DATASET_KEYS}")
            fields = {k: v for k, v in spec.items() if k not in ("data", "weight", "name")}
            fields.setdefault("label_column", None)
            if "symmetric" not in spec and fields["label_column"] and fields.get("objective", config.objective) != "simcse":
                fields["symmetric"] = False  # the run's `symmetric` is for its in-batch sets, not the scored ones
            shared = getattr(config, "prompts", None)
            if "prompts" not in spec and isinstance(shared, dict):  # the run's {column: prompt}: this data's columns
                own = {fields.get(k, getattr(config, k)) for k in ("text_column", "pair_column", "negative_column")}
                fields["prompts"] = {k: v for k, v in shared.items() if k in own}
            sub = dataclasses.replace(config, train=spec["data"], datasets=None, **fields)
            self.parts.append((SentenceEmbeddingTask(sub), float(spec.get("weight", 1))))
        names = [str(spec.get("name", i + 1)) for i, spec in enumerate(config.datasets)]
        if len(set(names)) < len(names):
            raise ValueError(f"`datasets` names must differ (each names its train loss). Received: {names}")
        self.loss_names = [f"train_loss_{name}" for name in names]

    def check(self):
        if self.config.task != "sentence-embedding":
            raise ValueError(f"`datasets` trains sentence embeddings: task must be 'sentence-embedding'. "
                             f"Received: task={self.config.task!r}")
        if self.config.mix not in MIXES:
            raise ValueError(f"`mix` must be one of {MIXES}. Received: mix={self.config.mix!r}")
        shared = getattr(self.config, "prompts", None)
        if isinstance(shared, dict):
            used = {self.config.text_column, self.config.pair_column}.union(*(
                p.config.prompts or {} for p, _ in self.parts if isinstance(p.config.prompts, dict)))
            unknown = sorted(set(shared) - used)
            if unknown:
                raise ValueError(f"`prompts` names column {unknown[0]!r}, which no dataset has as a text column")
        for i, (part, weight) in enumerate(self.parts):
            try:
                part.check()
            except ValueError as e:
                raise ValueError(f"`datasets[{i}]`: {e}") from None
            if not weight > 0:
                raise ValueError(f"`datasets[{i}].weight` must be positive. Received: {weight!r}")

    @property
    def columns(self):  # the dev set's
        c = self.config
        return [c.text_column, c.pair_column, c.label_column]

    def read_train(self):
        return [part.read_train() for part, _ in self.parts]

    def encode(self, rows, tokenizer, max_length, split):
        if split == "train":
            return MultiExamples([part.encode(r, tokenizer, max_length, split)
                                  for (part, _), r in zip(self.parts, rows)])
        dev = dataclasses.replace(self.config, objective=None, negative_column=None, datasets=None)
        return SentenceEmbeddingTask(dev).encode(rows, tokenizer, max_length, split)

    def check_model(self, backbone):
        for i, (part, _) in enumerate(self.parts):
            try:
                part.check_model(backbone)
            except ValueError as e:
                raise ValueError(f"`datasets[{i}]`: {e}") from None

    def fit(self, train):
        for i, ((part, _), examples) in enumerate(zip(self.parts, train.parts)):
            try:
                part.fit(examples)
            except ValueError as e:
                raise ValueError(f"`datasets[{i}]`: {e}") from None

    def _repeats(self, k: int) -> int:
        return max(1, int(round(self.parts[k][1])))

    def batches_per_epoch(self, examples, batch_size):
        return sum(self._repeats(k) * math.ceil(len(p) / batch_size) for k, p in enumerate(examples.parts))

    def epoch_batches(self, rng, examples, batch_size, group_by_length):
        per = [[(k, b) for _ in range(self._repeats(k)) for b in epoch_batches(rng, p, batch_size, group_by_length)]
               for k, p in enumerate(examples.parts)]
        if self.config.mix == "round_robin":
            out = []
            for i in range(max(len(b) for b in per)):
                out.extend(b[i] for b in per if i < len(b))
            return out
        flat = [b for batches in per for b in batches]
        return [flat[i] for i in rng.permutation(len(flat))]

    def training_batch(self, examples, batch, pad_id):
        k, index = batch
        feats, y = self.parts[k][0].batch(examples.parts[k], index, pad_id)
        return feats, y, len(index), k

    def embedding_loss(self, v, y, n, key: int = 0):
        return self.parts[key][0].embedding_loss(v, y, n)


class SparseEmbeddingTask(SentenceEmbeddingTask):
    """SPLADE (Formal et al. 2021): a model's masked-LM head read as a weight per vocabulary token
    (`kbert.models.tasks.SpladeNetwork`), trained on (anchor, positive) pairs with in-batch negatives and hard
    negatives from `negative_column` (sentence-transformers' SparseMultipleNegativesRankingLoss: dot products,
    no temperature), plus the FLOPS penalty that makes the vectors sparse: for the anchors' `[b, v]` vectors
    the sum over the vocabulary of the squared mean weight, times `query_regularizer_weight`, and the same of
    the positives' and hard negatives' times `document_regularizer_weight` (SpladeLoss). The model must hold a
    trained masked-LM head (a `kbert pretrain` output, a *ForMaskedLM dir, a SPLADE dir). The output dir is a
    sentence-transformers SparseEncoder dir in transformers' format, which `kbert.SparseEncoder` reads too.

    `config.inference_free`: the anchors (queries) do not run the model; each reads the network's query table at
    its distinct tokens (`SpladeNetwork.query_vectors`), which trains beside the model, from the documents'
    BM25 IDF (`idf`) or the starting model's table. The output is then sentence-transformers' inference-free
    Router dir (`kbert.models.st_dir.write_inference_free_encoder`)."""
    name = "sparse-embedding"
    metric = "recall@1"
    sparse = True
    start_query_weights = None  # an inference-free starting model's query table (finetune's `_load` sets it)
    query_init = None  # inference-free: the query table training starts from (`fit`)
    network_built = None  # the network `network` built: `evaluate` reads its query table

    @property
    def token_head(self) -> bool:  # the head reads every token's logits: no pooling or layers to choose
        return True

    def check(self):
        c = self.config
        if c.objective is not None or c.label_column or not c.pair_column:
            raise ValueError("task='sparse-embedding' trains (anchor, positive) pairs with in-batch negatives: give "
                             "`pair_column`, `label_column=None` (--no-label) and no `objective`")
        if c.matryoshka_dims:
            raise ValueError("`matryoshka_dims` cut dense vectors; a sparse vector has a weight per vocabulary token")
        if c.pooling is not None or c.layers != -1:
            raise ValueError(f"`pooling` and `layers` do not apply to task='sparse-embedding' (SPLADE pools every "
                             f"token's masked-LM logits). Received: pooling={c.pooling!r}, layers={c.layers!r}")
        for name in ("query_regularizer_weight", "document_regularizer_weight"):
            value = getattr(c, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"`{name}` must be a number >= 0. Received: {value!r}")
        if getattr(c, "inference_free", False) and (c.mini_batch_size or c.lora_rank):
            raise ValueError("inference-free SPLADE trains the query table beside the model: `mini_batch_size` "
                             "(gradient caching) and `lora_rank` do not apply to it")
        super().check()

    @property
    def inference_free(self) -> bool:
        return bool(getattr(self.config, "inference_free", False))

    def encode(self, rows, tokenizer, max_length, split):
        self.skip_ids = (tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id)  # not query tokens (inference-free)
        return super().encode(rows, tokenizer, max_length, split)

    def fit(self, train):
        super().fit(train)
        if self.inference_free:
            self.query_init = (self.start_query_weights if self.start_query_weights is not None
                               else self.idf(train, self.vocab_size))

    def idf(self, train, vocab_size: int) -> np.ndarray:
        """`[vocab]` BM25 IDF of each token over the training documents (positives and hard negatives, each
        distinct text once): log(1 + (N - df + 0.5) / (df + 0.5)), 0 for [PAD], [CLS] and [SEP]. Rare tokens
        weigh most, as in BM25, which is where an inference-free query table starts (OpenSearch's doc-only
        models read such a table, sentence-transformers' SparseStaticEmbedding.from_json loads one)."""
        documents = list(train.pair_token_ids or [])
        if train.negative_token_ids is not None:
            documents += train.negative_token_ids
        documents = list({tuple(ids) for ids in documents})
        df = np.zeros(vocab_size, np.float64)
        for ids in documents:
            df[np.unique(np.asarray(ids, np.int64))] += 1
        n = len(documents)
        out = np.log1p((n - df + 0.5) / (df + 0.5)).astype(np.float32)
        out[list(self.skip_ids)] = 0.0
        return out

    def load_backbone(self, weights_dir: str, dtype):
        import keras

        from kbert.models.convert import check_exportable, load_model

        full = load_model(weights_dir, with_heads=True, require_heads=True, dtype=dtype)
        check_exportable(full.config)  # the output is written in transformers' format
        self.head_weights = [keras.ops.convert_to_numpy(w) for w in full.mlm_head.weights]
        self.vocab_size = full.config.vocab_size
        return full.backbone

    def check_model(self, backbone):
        pass  # no Matryoshka widths to check against

    def network(self, backbone, dropout, pooling, layers):
        from kbert.models.tasks import SpladeNetwork

        c = self.config
        scale = c.query_learning_rate / c.learning_rate if self.inference_free else 1.0
        self.network_built = SpladeNetwork(backbone, self.head_weights, query_weights=self.query_init,
                                           query_scale=scale)
        return self.network_built

    def loss(self, network, feats, y, n, key: int = 0):
        if not self.inference_free:
            return super().loss(network, feats, y, n, key)
        import keras

        # the anchors (queries) read the table; the positives and hard negatives run through the model
        documents = network({k: v[n:] for k, v in feats.items()}, training=True)
        ids = feats["token_ids"][:n]
        return self.embedding_loss(keras.ops.concatenate([network.query_vectors(ids, self.query_mask(ids)),
                                                          documents], axis=0), y, n, key)

    def query_mask(self, ids):
        """`[b, s]` bool: the positions of `ids` that are query tokens (not [PAD], [CLS] or [SEP])."""
        import keras

        keep = keras.ops.ones_like(ids, dtype="bool")
        for i in self.skip_ids:
            keep = keras.ops.logical_and(keep, keras.ops.not_equal(ids, i))
        return keep

    def save(self, network, out_dir, tokenizer, meta):
        """A SparseEncoder dir: the backbone and head as transformers' *ForMaskedLM, with sentence-transformers'
        modules.json and SpladePooling config."""
        from kbert.models.backbone import Pretrainer
        from kbert.models.convert import export_transformers
        from kbert.models.io import build_pretrainer
        from kbert.models.st_dir import write_sparse_encoder

        model = build_pretrainer(Pretrainer(network.backbone, pair_objective=None))
        for variable, value in zip(model.mlm_head.weights, network.mlm_head.weights):
            variable.assign(value)
        if not self.inference_free:
            export_transformers(model, out_dir, tokenizer=tokenizer)
            write_sparse_encoder(out_dir, network.pooling, network.activation, meta.get("max_length"))
            return
        import keras

        from kbert.models.st_dir import document_folder, write_inference_free_encoder

        export_transformers(model, document_folder(out_dir), tokenizer=tokenizer)
        write_inference_free_encoder(out_dir, keras.ops.convert_to_numpy(network.query_weights()),
                                     network.pooling, network.activation, meta.get("max_length"))

    def _loss_at(self, v, y, n):
        import keras

        a, others = v[:n], v[n:]  # anchors [b, v]; positives [b, v] then hard negatives [b, v]
        ids = y["text_ids"] if isinstance(y, dict) else y
        guide = y.get("guide") if isinstance(y, dict) else None
        ranking = in_batch_loss(a, others, 1.0, ids, guide, getattr(self.config, "guide_margin", 0.0))

        def flops(x):  # sum over the vocabulary of the batch's mean weight, squared (Paria et al. 2020)
            return keras.ops.sum(keras.ops.square(keras.ops.mean(x, axis=0)))

        return (ranking + self.config.query_regularizer_weight * flops(a)
                + self.config.document_regularizer_weight * flops(others))

    def evaluate(self, infer, examples, batch_size, pad_id):
        if self.inference_free:  # the queries read the table as it is now
            import keras

            network = self.network_built

            def infer_queries(ids, segments):
                del segments
                return keras.ops.convert_to_numpy(network.query_vectors(ids, self.query_mask(ids)))

            a = vectors_in_batches(infer_queries, examples.token_ids, pad_id, batch_size)
        else:
            a = vectors_in_batches(infer, examples.token_ids, pad_id, batch_size)
        b = vectors_in_batches(infer, examples.pair_token_ids, pad_id, batch_size)
        scores = a @ b.T  # dot products, as SPLADE ranks
        return {"recall@1": float(np.mean(np.argmax(scores, axis=1) == np.arange(len(a)))),
                "active_dims": float(np.mean(np.count_nonzero(np.concatenate([a, b]), axis=1)))}

    def dev_metric(self, dev):
        return "recall@1"


TASKS: Dict[str, type] = {t.name: t for t in (ClassificationTask, PairClassificationTask, RegressionTask,
                                               TaggingTask, SentenceEmbeddingTask, QuestionAnsweringTask,
                                               SparseEmbeddingTask)}


def register_task(task: type) -> type:
    """Adds a `FinetuneTask` subclass to `TASKS` under its `name` (usable as a class decorator). Its network
    must be one `kbert.models.tasks.TaskNetwork` builds, or the task must build its own."""
    if not (isinstance(task, type) and issubclass(task, FinetuneTask)) or not task.name:
        raise TypeError(f"register_task expects a FinetuneTask subclass with a `name`. Received: {task!r}")
    TASKS[task.name] = task
    return task


def task_for(config) -> FinetuneTask:
    if getattr(config, "datasets", None):
        return MultiDatasetEmbeddingTask(config)
    if config.task not in TASKS:
        raise ValueError(f"`task` must be one of {tuple(TASKS)}. Received: task={config.task!r}")
    return TASKS[config.task](config)
