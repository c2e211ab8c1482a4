"""`kbert.finetune`: task heads on a pretrained backbone, trained with AdamW + warm-up and early stopping.

Tasks
    classification        one text -> one of N labels (head on the pooled [CLS] output)
    pair-classification   two texts (`[CLS] a [SEP] b [SEP]`) -> one of N labels (NLI, paraphrase)
    regression            one text or a pair -> a number (MSE)
    tagging               whitespace words -> one tag each (head on each word's first subword)
    sentence-embedding    a bi-encoder: both texts through the same backbone with mean pooling; pairs with
                          a score (KorSTS: cosine regression onto score / max score, or CoSENT's ranking
                          loss with similarity_loss="cosent") or, without a score
                          column, (anchor, positive) pairs with in-batch negatives (NLI entailment pairs)

The best checkpoint on the dev set is written to `out_dir` as a kbert model dir (backbone weights +
tokenizer, so `kbert.Embedder.load` and `kbert export` read it) plus `kbert_task.json` and
`kbert_task.safetensors` (the head). `kbert.TaskModel.load(out_dir).predict(texts)` runs it.

Data: a TSV (header row, no quoting), CSV, or JSONL file (gzip allowed), or a list of dicts.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Union

import numpy as np

from kbert.data.features import build_network, first_pieces, pad, segment_ids, unit_vectors_in_batches
from kbert.data.features import features as model_inputs
from kbert.models.tasks import TASKS, TaskNetwork, default_pooling, save_task_head

SIMILARITY_LOSSES = ("cosent", "cosine")
IGNORE = -1  # tag label of tokens that are not the first piece of a word


# ------------------------------------------------------------------------------------------ data
def read_rows(source, columns: Sequence[str]) -> List[dict]:
    """Rows of a TSV/CSV/JSONL file (or a list of dicts), checked to have every column in `columns`."""
    if isinstance(source, (list, tuple)):
        rows = list(source)
        name = "the given rows"
    else:
        from kbert.utils import open_text

        if not os.path.isfile(source):
            raise FileNotFoundError(f"Data file not found: {source!r}")
        base = source[:-3] if source.endswith(".gz") else source
        name = source
        with open_text(source) as f:
            if base.endswith((".jsonl", ".json")):
                rows = []
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except json.JSONDecodeError as e:
                            raise ValueError(f"{source}:{n} is not valid JSON: {e}") from None
            else:
                text = f.read().lstrip("\ufeff")
                if base.endswith(".csv"):
                    rows = list(csv.DictReader(text.splitlines()))
                else:
                    rows = list(csv.DictReader(text.splitlines(), delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows:
        raise ValueError(f"{name} holds no examples")
    missing = [c for c in columns if c is not None and c not in rows[0]]
    if missing:
        raise ValueError(f"{name} has no column {missing[0]!r}; its columns are {sorted(rows[0])}")
    return rows


def _text(row, column, where):
    value = row.get(column)
    if value is None:
        raise ValueError(f"{where}: column {column!r} is empty")
    return str(value)


class _Examples:
    """Tokenized examples of one split: ids, segment ids and labels (per-token labels for tagging)."""

    def __init__(self, ids, segments, labels, pair_ids=None):
        self.ids, self.segments, self.labels, self.pair_ids = ids, segments, labels, pair_ids

    def __len__(self):
        return len(self.ids)


def _encode_split(rows, spec, tokenizer, labels, max_length, name):
    task = spec["task"]
    texts = [_text(r, spec["text_column"], f"{name} row {i + 1}") for i, r in enumerate(rows)]
    pairs = None
    if spec.get("pair_column"):
        pairs = [_text(r, spec["pair_column"], f"{name} row {i + 1}") for i, r in enumerate(rows)]
    raw = [r.get(spec["label_column"]) for r in rows] if spec.get("label_column") else None
    if task == "sentence-embedding":
        a = [e.ids for e in tokenizer.encode_batch(texts, max_length=max_length)]
        b = [e.ids for e in tokenizer.encode_batch(pairs, max_length=max_length)]
        scores = None if raw is None else np.array([_number(v, name, i) for i, v in enumerate(raw)], np.float32)
        return _Examples(a, None, scores, pair_ids=b)
    encodings = tokenizer.encode_batch(texts, pairs=pairs, max_length=max_length)
    ids = [e.ids for e in encodings]
    segments = [segment_ids(e.ids, tokenizer.sep_id) for e in encodings]
    if task == "regression":
        y = np.array([_number(v, name, i) for i, v in enumerate(raw)], np.float32)
    elif task == "tagging":
        y = [_word_labels(e, _tags(v, name, i), labels, name, i) for i, (e, v) in enumerate(zip(encodings, raw))]
    else:
        index = {label: k for k, label in enumerate(labels)}
        raw = [_class_label(v, name, i) for i, v in enumerate(raw)]
        unknown = sorted(set(raw) - set(index))
        if unknown:
            raise ValueError(f"{name} has labels not seen in training: {unknown[:5]} (training labels: {labels})")
        y = np.array([index[v] for v in raw], np.int32)
    return _Examples(ids, segments, y)


def _class_label(value, name, i) -> str:
    """A class label as its text with surrounding whitespace removed (" 1" and "1" are one class); an empty
    label is an error naming its row."""
    label = "" if value is None else str(value).strip()
    if not label:
        raise ValueError(f"{name} row {i + 1}: the label is empty; give every row a class, or drop the row")
    return label


def _number(value, name, i):
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} row {i + 1}: label {value!r} is not a number") from None


def _tags(value, name, i) -> List[str]:
    tags = value if isinstance(value, list) else str(value).split()
    if not tags:
        raise ValueError(f"{name} row {i + 1}: no tags")
    return [str(t) for t in tags]


def _word_labels(enc, tags, labels, name, i) -> List[int]:
    """Per-token tag ids: each whitespace word's tag on its first subword, IGNORE elsewhere."""
    firsts = first_pieces(enc)
    if len(firsts) != len(tags):
        raise ValueError(f"{name} row {i + 1}: {len(firsts)} words but {len(tags)} tags (tags are one per "
                         f"whitespace-separated word)")
    index = {label: k for k, label in enumerate(labels)}
    out = [IGNORE] * len(enc.ids)
    for t, tag in zip(firsts, tags):
        if tag not in index:
            raise ValueError(f"{name} row {i + 1}: tag {tag!r} not seen in training")
        if t is not None:  # None: the word was cut off by max_length
            out[t] = index[tag]
    return out


# ------------------------------------------------------------------------------------------ model
def _with_dropout(backbone, rate, dtype=None):
    """The same backbone (weights copied) with every dropout rate inside it set to `rate`."""
    import dataclasses

    import keras

    from kbert.models.backbone import build_backbone
    from kbert.models.io import assign_weights, variables_by_path

    config = backbone.config
    if config.dropout == rate and config.attention_dropout == rate:
        return backbone
    fresh = build_backbone(dataclasses.replace(config, dropout=rate, attention_dropout=rate),
                           output_hidden_states=backbone.output_hidden_states, dtype=dtype)
    assign_weights(fresh, {p: keras.ops.convert_to_numpy(v) for p, v in variables_by_path(backbone).items()},
                   "the loaded backbone")
    return fresh


# ------------------------------------------------------------------------------------------ metrics
def _rank(x):
    """Ranks with ties sharing their average rank (as scipy.stats.rankdata)."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return (ends - (counts - 1) / 2.0)[inverse]


def pearson(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if len(a) < 2 or a.std() == 0 or b.std() == 0:
        return 0.0
    return float(np.corrcoef(a, b)[0, 1])


def spearman(a, b) -> float:
    return pearson(_rank(np.asarray(a, np.float64)), _rank(np.asarray(b, np.float64)))


def _macro_f1(y, p, k):
    scores = []
    for c in range(k):
        tp = np.sum((p == c) & (y == c))
        denom = np.sum(p == c) + np.sum(y == c)
        if denom:
            scores.append(2 * tp / denom)
    return float(np.mean(scores)) if scores else 0.0


# ------------------------------------------------------------------------------------------ training
def _check_head_pooling(task, pooling, layers, num_hidden):
    """Validated `(pooling, layers)` for a task; `layers="all"` becomes the list of every hidden state."""
    from kbert.models.pooling import POOLINGS, check_pooling

    if pooling == "pooler":
        if task == "sentence-embedding":
            raise ValueError(f"`pooling` for task='sentence-embedding' must be one of {POOLINGS} (the pooler "
                             f"is a classification head's input). Received: pooling='pooler'")
        if layers != -1:
            raise ValueError(f"pooling='pooler' reads the last layer's [CLS]; `layers` must be -1 with it. "
                             f"Received: layers={layers!r}")
        return pooling, -1
    if pooling not in POOLINGS:
        choices = POOLINGS if task == "sentence-embedding" else ("pooler",) + POOLINGS
        raise ValueError(f"`pooling` must be one of {choices}. Received: pooling={pooling!r}")
    if isinstance(layers, str) and layers == "all":
        layers = list(range(num_hidden))
    layers = layers if isinstance(layers, int) else list(layers)
    check_pooling(pooling, layers, num_hidden)
    return pooling, layers


def finetune(model: str, task: str, train, dev=None, out_dir: str = "finetuned", text_column: str = "text",
             pair_column: Optional[str] = None, label_column: Optional[str] = "label",
             labels: Optional[Sequence[str]] = None, epochs: float = 3, batch_size: int = 32,
             learning_rate: float = 5e-5, warmup: float = 0.1, weight_decay: float = 0.01,
             max_length: Optional[int] = None, dropout: float = 0.1, patience: Optional[int] = 2,
             eval_every: Optional[int] = None, max_steps: Optional[int] = None, seed: int = 0,
             progress: bool = True, dtype: Optional[str] = None, group_by_length: bool = True,
             similarity_loss: str = "cosine", pooling: Optional[str] = None,
             layers: Union[int, Sequence[int], str] = -1, backbone_dropout: Optional[float] = None,
             resume: bool = True, checkpoint_every: Optional[int] = 1000, stop_after: Optional[int] = None) -> dict:
    """Fine-tunes the model dir `model` on `train`; returns a summary with the dev history.

    Args:
        model: a model dir (`kbert.load_model` formats) with its tokenizer.
        task: one of `TASKS` (see the module docstring).
        train, dev: TSV / CSV / JSONL paths or lists of dicts. Without `dev`, the last model is saved.
        text_column, pair_column, label_column: column names (`pair_column` for pair tasks and bi-encoders;
            `label_column=None` for a bi-encoder trained on (anchor, positive) pairs).
        labels: class names in order (default: the sorted labels of `train`).
        epochs, batch_size, learning_rate, warmup (fraction of steps), weight_decay, max_length (tokens per
            input; default 128, or the model's limit when lower; beyond the model's positions is an error).
        dropout: dropout on the head's input (classification, pair-classification, regression, tagging).
        backbone_dropout: dropout inside the backbone (embeddings, attention probabilities, attention and
            feed-forward outputs) while fine-tuning. None: 0.0 for a sentence-embedding task with scores
            (a regression of cosines onto scores, which dropout's noise only blurs: on bert-mini, KorSTS,
            three seeds each, 0.746 mean Spearman without vs 0.742 with BERT's 0.1), the model's own rates
            otherwise (in-batch-negative bi-encoders and the heads keep dropout as a regularizer). The model
            dir written keeps the rate it was tuned with.
        patience: stop after this many evaluations without a better dev score (None: never).
        eval_every: evaluate every N steps (default: once per epoch).
        max_steps: cap on optimizer steps.
        dtype: dtype policy for the backbone (e.g. "mixed_bfloat16").
        group_by_length: build each batch from examples of similar length (sorted within shuffled windows of
            64 batches; the batch order is shuffled), so batches carry little padding: on short texts such as
            reviews a step costs about half. False: plain shuffled batches.
        similarity_loss: for a sentence-embedding task with scores: "cosine" (default: regression of the
            cosine onto score / max score, Sentence-BERT's CosineSimilarityLoss) or "cosent" (CoSENT: a
            ranking loss over the pairs of each batch, every pair scored higher should have the higher cosine;
            on bert-mini and KorSTS it scored 0.725 vs cosine's 0.729, benchmarks/README.md).
        pooling, layers: how token vectors become the one vector a sentence-embedding task outputs or a
            classification / pair-classification / regression head reads: one of "mean", "cls", "max",
            "first_last_avg" over `layers` as in `Embedder.encode` (`layers="all"` averages every layer, the
            embedding output included, before pooling), or for the heads "pooler" (BERT's tanh layer over
            the last layer's [CLS], with `layers=-1`). Defaults: "mean" for sentence-embedding, "pooler"
            for the heads; tagging reads every token and takes neither. Saved with the model, so
            `Embedder.load(out_dir).encode`, `TaskModel.predict` and `kbert export` pool the same way. On
            bert-mini, KorSTS: all layers 0.741 vs the last layer's 0.735; sentiment: see benchmarks/README.md.
        resume: continue an interrupted run from `out_dir/checkpoints` (the default). A run stopped by SIGINT or
            SIGTERM (or by a crash after a checkpoint) saves its whole state there: weights, optimizer, dropout
            seeds, batch order, dev history and the best score so far, so the same call picks up at that step
            and ends as an uninterrupted run would. The checkpoint must come from the same settings and data
            (else a ValueError names what differs); `resume=False` deletes it and starts over. Removed when
            the run ends.
        checkpoint_every: steps between checkpoints (besides one after each dev evaluation and one at a
            stop); None: only those.
        stop_after: stop (with a checkpoint) after this many steps in this call, as a preemption would.

    Example:
        >>> kbert.finetune("my-model", "classification", "train.tsv", "dev.tsv", out_dir="sentiment",
        ...                text_column="document", label_column="label")
    """
    import keras
    import tensorflow as tf

    from kbert.models.convert import check_vocabulary, load_model, model_dir_of, resolve_hub_name
    from kbert.models.io import save_model
    from kbert.text.tokenizer import Tokenizer
    from kbert.utils import StopSignals, progress_bar

    if task not in TASKS:
        raise ValueError(f"`task` must be one of {TASKS}. Received: task={task!r}")
    if similarity_loss not in SIMILARITY_LOSSES:
        raise ValueError(f"`similarity_loss` must be one of {SIMILARITY_LOSSES}. Received: {similarity_loss!r}")
    if task == "pair-classification" and not pair_column:
        raise ValueError("task='pair-classification' needs `pair_column` (the second text)")
    if task == "sentence-embedding" and not pair_column:
        raise ValueError("task='sentence-embedding' needs `pair_column` (the second sentence of each pair)")
    if task == "tagging" and (pooling is not None or layers != -1):
        raise ValueError(f"`pooling` and `layers` do not apply to task='tagging' (its head reads every token of the "
                         f"last layer). Received: pooling={pooling!r}, layers={layers!r}")
    if task != "sentence-embedding" and not label_column:
        raise ValueError(f"task={task!r} needs `label_column`")
    for name, value in (("epochs", epochs), ("batch_size", batch_size), ("learning_rate", learning_rate),
                        ("max_length", 128 if max_length is None else max_length)):
        if not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"`{name}` must be a positive number. Received: {name}={value!r}")
    if backbone_dropout is not None and (isinstance(backbone_dropout, bool) or
                                         not isinstance(backbone_dropout, (int, float)) or
                                         not 0.0 <= backbone_dropout < 1.0):
        raise ValueError(f"`backbone_dropout` must be None or a rate in [0, 1). Received: {backbone_dropout!r}")
    for name, value in (("checkpoint_every", checkpoint_every), ("stop_after", stop_after)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"`{name}` must be None or a positive integer. Received: {name}={value!r}")
    if backbone_dropout is None and task == "sentence-embedding" and label_column:
        backbone_dropout = 0.0
    keras.utils.set_random_seed(seed)
    model_dir = model_dir_of(resolve_hub_name(os.fspath(model)))  # a hub name: its snapshot; a run dir: its model
    backbone = load_model(model_dir, output_hidden_states=True, dtype=dtype)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    check_vocabulary(backbone.config, tokenizer.vocab_size)
    # 128 tokens by default, or the model's limit when it has fewer positions; beyond them is an error
    max_length = (min(128, backbone.config.max_position) if max_length is None
                  else backbone.config.check_length(max_length))
    if backbone_dropout is not None:
        backbone = _with_dropout(backbone, float(backbone_dropout), dtype)
    if task != "tagging":
        pooling, layers = _check_head_pooling(task, pooling or default_pooling(task), layers,
                                              backbone.config.num_layers + 1)
    columns = [text_column, pair_column, label_column]
    train_rows = read_rows(train, columns)
    dev_rows = read_rows(dev, columns) if dev is not None else None
    if task in ("classification", "pair-classification"):
        import collections

        counts = collections.Counter(_class_label(r[label_column], "train", i) for i, r in enumerate(train_rows))
        labels = [str(x).strip() for x in (labels or sorted(counts))]
        if len(labels) < 2:
            raise ValueError(f"Classification needs at least 2 labels; the training data has {labels}")
        if progress:  # the label set before training: an unexpected class shows here, not in the scores
            print(f"{len(labels)} labels: " + ", ".join(f"{k!r} ({counts[k]} rows)" for k in labels),
                  file=sys.stderr, flush=True)
    elif task == "tagging":
        labels = labels or sorted({t for i, r in enumerate(train_rows) for t in _tags(r[label_column], "train", i)})
        labels = [str(x) for x in labels]
    else:
        labels = None
    spec = dict(task=task, text_column=text_column, pair_column=pair_column, label_column=label_column)
    train_ex = _encode_split(train_rows, spec, tokenizer, labels, max_length, "train")
    dev_ex = _encode_split(dev_rows, spec, tokenizer, labels, max_length, "dev") if dev_rows else None
    score_max = 1.0
    if task == "sentence-embedding" and train_ex.labels is not None:
        score_max = float(np.max(np.abs(train_ex.labels))) or 1.0

    num_labels = 1 if task == "regression" else (len(labels) if labels else 0)
    target = (0.0, 1.0)
    if task == "regression":
        target = (float(np.mean(train_ex.labels)), float(np.std(train_ex.labels)) or 1.0)
    network = TaskNetwork(backbone, task, num_labels, dropout, target, pooling, layers)
    build_network(network, tokenizer)
    steps_per_epoch = math.ceil(len(train_ex) / batch_size)
    total = max(1, int(math.ceil(steps_per_epoch * epochs)))
    if max_steps:
        total = min(total, int(max_steps))
    eval_every = int(eval_every or steps_per_epoch)
    from kbert.train.optimizers import NO_DECAY, WarmupDecay

    optimizer = keras.optimizers.AdamW(
        learning_rate=WarmupDecay(learning_rate, total, int(warmup * total)), weight_decay=weight_decay,
        epsilon=1e-6, global_clipnorm=1.0)
    optimizer.exclude_from_weight_decay(var_names=list(NO_DECAY))
    optimizer.build(network.trainable_variables)

    def loss_fn(outputs, y):
        if task in ("classification", "pair-classification"):
            return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y, outputs, from_logits=True))
        if task == "regression":
            return keras.ops.mean(keras.ops.square((outputs[:, 0] - y) / target[1]))
        if task == "tagging":
            valid = keras.ops.cast(y >= 0, "float32")
            ce = keras.losses.sparse_categorical_crossentropy(keras.ops.maximum(y, 0), outputs, from_logits=True)
            return keras.ops.sum(ce * valid) / keras.ops.maximum(keras.ops.sum(valid), 1.0)
        raise AssertionError(task)

    def bi_encoder_loss(features, n, y):
        v = network(features, training=True)
        v = v / keras.ops.maximum(keras.ops.norm(v, axis=-1, keepdims=True), 1e-12)
        a, b = v[:n], v[n:]
        if y is None:  # in-batch negatives: a[i] should pick b[i] among all b
            scores = keras.ops.matmul(a, keras.ops.transpose(b)) * 20.0
            target = keras.ops.arange(n)
            return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(target, scores, from_logits=True))
        cos = keras.ops.sum(a * b, axis=-1)
        if similarity_loss == "cosine":
            return keras.ops.mean(keras.ops.square(cos - y / score_max))
        return cosent_loss(cos, y)

    # The pooler feeds only the [CLS] heads: bi-encoders and taggers leave it untouched.
    variables = [v for v in network.trainable_variables
                 if task in ("classification", "pair-classification", "regression") or not v.path.startswith("pooler/")]

    @tf.function(reduce_retracing=True)
    def train_step(features, y, n):
        with tf.GradientTape() as tape:
            if task == "sentence-embedding":
                loss = bi_encoder_loss(features, n, y)
            else:
                loss = loss_fn(network(features, training=True), y)
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    @tf.function(reduce_retracing=True)
    def infer(features):
        return network(features, training=False)

    def call_infer(ids, segments):
        return np.asarray(infer(model_inputs(ids, segments, tokenizer.pad_id)), np.float32)

    def evaluate(ex) -> Dict[str, float]:
        if task == "sentence-embedding":
            a = unit_vectors_in_batches(call_infer, ex.ids, tokenizer.pad_id, batch_size)
            b = unit_vectors_in_batches(call_infer, ex.pair_ids, tokenizer.pad_id, batch_size)
            if ex.labels is not None:
                cos = np.sum(a * b, axis=1)
                return {"spearman": spearman(cos, ex.labels), "pearson": pearson(cos, ex.labels)}
            return {"recall@1": float(np.mean(np.argmax(a @ b.T, axis=1) == np.arange(len(a))))}
        outputs = [None] * len(ex)
        by_length = np.argsort([len(x) for x in ex.ids], kind="stable")  # little padding per batch
        for start in range(0, len(ex), batch_size):
            index = by_length[start:start + batch_size]
            ids = pad([ex.ids[i] for i in index], tokenizer.pad_id)
            segs = pad([ex.segments[i] for i in index], 0, ids.shape[1])
            for i, out in zip(index, call_infer(ids, segs)):
                outputs[i] = out
        if task == "regression":
            pred = np.array([o[0] for o in outputs])
            return {"spearman": spearman(pred, ex.labels), "pearson": pearson(pred, ex.labels),
                    "mse": float(np.mean((pred - ex.labels) ** 2))}
        if task == "tagging":
            y = np.concatenate([np.array(l) for l in ex.labels])
            p = np.concatenate([np.argmax(o[:len(l)], axis=-1) for o, l in zip(outputs, ex.labels)])
            keep = y >= 0
            return {"accuracy": float(np.mean(p[keep] == y[keep])), "macro_f1": _macro_f1(y[keep], p[keep], len(labels))}
        pred = np.argmax(np.stack(outputs), axis=1)
        return {"accuracy": float(np.mean(pred == ex.labels)), "macro_f1": _macro_f1(ex.labels, pred, len(labels))}

    key = {"classification": "accuracy", "pair-classification": "accuracy", "tagging": "accuracy",
           "regression": "spearman"}.get(task)
    if task == "sentence-embedding":
        key = "spearman" if (dev_ex is not None and dev_ex.labels is not None) else "recall@1"
    meta = {"task": task, "labels": labels, "max_length": max_length, "text_column": text_column,
            "pair_column": pair_column, "label_column": label_column, "pooling": pooling, "layers": None if task == "tagging" else layers,
            "base_model": os.path.abspath(model) if isinstance(model, str) else None,
            "target": list(target) if task == "regression" else None}
    # what a resumed run must share with the interrupted one
    settings = dict(model=meta["base_model"] or repr(model), data=_data_fingerprint(train_ex, dev_ex), task=task,
                    text_column=text_column, pair_column=pair_column, label_column=label_column, labels=labels,
                    epochs=epochs, batch_size=batch_size, learning_rate=learning_rate, warmup=warmup,
                    weight_decay=weight_decay, max_length=max_length, dropout=dropout, patience=patience,
                    eval_every=eval_every, total_steps=total, seed=seed, dtype=dtype, group_by_length=group_by_length,
                    similarity_loss=similarity_loss, pooling=pooling, layers=layers,
                    backbone_dropout=backbone_dropout)
    saver = _Checkpoints(os.path.join(out_dir, CHECKPOINT_DIR), network, optimizer, settings, resume)
    saved = saver.restore()
    rng = np.random.default_rng(seed)
    if saved is None:
        history, best, best_step, bad, losses, step = [], None, 0, 0, [], 0
        baseline = evaluate(dev_ex) if dev_ex is not None else None
        if baseline is not None and progress:
            print("before training: dev " + " ".join(f"{k} {v:.4f}" for k, v in baseline.items()), flush=True)
    else:
        history, best, best_step, bad, losses, step, baseline = (
            saved[k] for k in ("history", "best", "best_step", "bad", "losses", "step", "baseline"))
        for _ in range(step // steps_per_epoch):  # the batch order of the finished epochs, drawn again
            _batches(rng, train_ex, batch_size, group_by_length)
        if progress:
            print(f"resumed at step {step} of {total} from {saver.path}", flush=True)
    keep = max(eval_every, 50)
    skip = step % steps_per_epoch  # batches of the current epoch that were trained before the restart
    end = total if stop_after is None else min(total, step + stop_after)
    bar = progress_bar(total=total, desc=f"finetune {task}", unit=" steps", enabled=progress)
    bar.update(step)
    stopped, start_time, saved_at = "steps", time.time(), step
    with StopSignals() as signals:
        while step < end and stopped == "steps":
            for index in _batches(rng, train_ex, batch_size, group_by_length)[skip:]:
                if task == "sentence-embedding":
                    both = [train_ex.ids[i] for i in index] + [train_ex.pair_ids[i] for i in index]
                    ids = pad(both, tokenizer.pad_id)
                    features = model_inputs(ids, np.zeros_like(ids), tokenizer.pad_id)
                    y = None if train_ex.labels is None else tf.constant(train_ex.labels[index])
                else:
                    ids = pad([train_ex.ids[i] for i in index], tokenizer.pad_id)
                    features = model_inputs(ids, pad([train_ex.segments[i] for i in index], 0, ids.shape[1]),
                                         tokenizer.pad_id)
                    if task == "tagging":
                        y = tf.constant(pad([train_ex.labels[i] for i in index], IGNORE, ids.shape[1]))
                    else:
                        y = tf.constant(train_ex.labels[index])
                loss = float(train_step(features, y, tf.constant(len(index))))
                if not math.isfinite(loss):
                    raise FloatingPointError(f"Fine-tuning diverged at step {step + 1} (loss {loss}); lower "
                                             f"`learning_rate` (now {learning_rate})"
                                             + (f"; the checkpoint of step {saved_at} is kept" if saved_at else ""))
                losses.append(loss)
                if len(losses) > 2 * keep:  # the train loss is a mean over the last evaluation's window
                    del losses[:-keep]
                step += 1
                bar.update(1)
                bar.set_postfix(loss=f"{np.mean(losses[-50:]):.4f}")
                evaluated = step % eval_every == 0 or step == total
                if evaluated:
                    entry = {"step": step, "epoch": round(step / steps_per_epoch, 3),
                             "train_loss": float(np.mean(losses[-eval_every:]))}
                    improved = True
                    if dev_ex is not None:
                        metrics = evaluate(dev_ex)
                        entry.update({f"dev_{k}": v for k, v in metrics.items()})
                        improved = best is None or metrics[key] > best
                    history.append(entry)
                    if improved:
                        best, best_step, bad = (entry.get(f"dev_{key}"), step, 0)
                        save_model(network.backbone, out_dir, tokenizer=tokenizer)
                        save_task_head(network, meta, out_dir)
                    else:
                        bad += 1
                    if progress:
                        shown = " ".join(f"{k} {v:.4f}" for k, v in entry.items() if k not in ("step", "epoch"))
                        bar.write(f"epoch {entry['epoch']:g} step {step}: {shown}"
                                  + (" (best, saved)" if improved else ""))
                    if patience is not None and dev_ex is not None and bad >= patience:
                        stopped = "early_stopping"
                        break
                if step >= total:
                    break
                if signals.received or step >= end:
                    stopped = signals.received or "stop_after"
                if stopped != "steps" or evaluated or (checkpoint_every and step % checkpoint_every == 0):
                    saver.save(step, dict(history=history, best=best, best_step=best_step, bad=bad, losses=losses[-keep:],
                                          baseline=baseline))
                    saved_at = step
                if stopped != "steps":
                    break
            skip = 0
    bar.close()
    if stopped in ("steps", "early_stopping"):
        saver.remove()  # finished: the best model is in out_dir
    elif progress:
        print(f"fine-tuning stopped at step {step} ({stopped}); the same call resumes from {saver.path}", flush=True)
    return {"task": task, "model_dir": out_dir, "steps": step, "stopped_by": stopped, "history": history,
            "baseline": baseline, "best_step": best_step, "metric": key if dev_ex is not None else None,
            "best": best, "labels": labels, "seconds": time.time() - start_time,
            "checkpoint": None if stopped in ("steps", "early_stopping") else saver.path}


CHECKPOINT_DIR = "checkpoints"


def _data_fingerprint(train_ex, dev_ex) -> str:
    """A digest of the encoded training and dev examples: a resumed run must see the same data."""
    import hashlib

    h = hashlib.sha1()
    for ex in (train_ex, dev_ex):
        if ex is None:
            h.update(b"none")
            continue
        for lists in (ex.ids, ex.pair_ids or []):
            h.update(np.asarray([len(x) for x in lists], np.int64).tobytes())
            h.update(np.concatenate([np.asarray(x, np.int64) for x in lists] or [np.zeros(0, np.int64)]).tobytes())
        if ex.labels is not None:
            labels = ex.labels if isinstance(ex.labels, np.ndarray) else np.concatenate(
                [np.asarray(x, np.float64) for x in ex.labels] or [np.zeros(0)])
            h.update(np.asarray(labels, np.float64).tobytes())
    return h.hexdigest()


class _Checkpoints:
    """The whole state of a fine-tuning run in one TensorFlow checkpoint: every network variable (dropout
    seeds included), the optimizer's variables, and a JSON string with the loop's bookkeeping and the
    settings it was made with, so a restart with other settings is refused instead of silently mixed."""

    def __init__(self, directory, network, optimizer, settings, resume):
        import shutil

        import tensorflow as tf

        self.directory, self.settings = directory, json.loads(json.dumps(settings, default=str))
        if not resume and os.path.isdir(directory):
            shutil.rmtree(directory)
        self.state = tf.Variable("", dtype=tf.string, trainable=False)
        self.checkpoint = tf.train.Checkpoint(
            network={str(i): v.value for i, v in enumerate(network.variables)},
            optimizer={str(i): v.value for i, v in enumerate(optimizer.variables)}, state=self.state)
        self.manager = tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep=1)

    @property
    def path(self) -> Optional[str]:
        return self.manager.latest_checkpoint

    def restore(self) -> Optional[dict]:
        import tensorflow as tf

        path = self.manager.latest_checkpoint
        if not path:
            return None
        saved = json.loads(tf.train.load_checkpoint(path).get_tensor("state/.ATTRIBUTES/VARIABLE_VALUE"))
        differ = sorted(k for k in set(saved["settings"]) | set(self.settings)
                        if saved["settings"].get(k) != self.settings.get(k))
        if differ:
            shown = ", ".join(f"{k}: {saved['settings'].get(k)!r} -> {self.settings.get(k)!r}" for k in differ)
            raise ValueError(f"{self.directory!r} holds an interrupted fine-tuning run (step {saved['step']}) with "
                             f"other settings ({shown}); rerun with its settings to resume it, pass resume=False "
                             f"(CLI: --no-resume) to start over, or choose another out_dir")
        self.checkpoint.restore(path).assert_consumed()
        return saved

    def save(self, step: int, bookkeeping: dict) -> None:
        self.state.assign(json.dumps({"settings": self.settings, "step": step, **bookkeeping}))
        self.manager.save(checkpoint_number=step)

    def remove(self) -> None:
        import shutil

        if os.path.isdir(self.directory):
            shutil.rmtree(self.directory)


def cosent_loss(cos, scores, scale: float = 20.0):
    """CoSENT: log(1 + sum over the pairs (i, j) of the batch with scores[i] > scores[j] of
    exp(scale * (cos[j] - cos[i]))): zero-cost when every higher-scored pair has the higher cosine."""
    import keras

    scores = keras.ops.cast(scores, cos.dtype)
    ranked = keras.ops.cast(scores[:, None] > scores[None, :], cos.dtype)
    logits = scale * (cos[None, :] - cos[:, None]) - (1.0 - ranked) * 1e4
    logits = keras.ops.concatenate([keras.ops.zeros((1,), cos.dtype), keras.ops.reshape(logits, (-1,))], 0)
    return keras.ops.logsumexp(logits)


def _batches(rng, ex, batch_size, group_by_length, window=64):
    """One epoch of index batches: shuffled; with `group_by_length`, each window of `window` batches is sorted
    by length before it is cut into batches, and the batches are shuffled again."""
    order = rng.permutation(len(ex))
    if not group_by_length:
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    lengths = np.array([len(x) for x in ex.ids])
    if ex.pair_ids is not None:
        lengths = np.maximum(lengths, [len(x) for x in ex.pair_ids])
    batches = []
    for w in range(0, len(order), batch_size * window):
        chunk = order[w:w + batch_size * window]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches.extend(chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size))
    return [batches[i] for i in rng.permutation(len(batches))]
