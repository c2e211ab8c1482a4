"""Fine-tuned task networks and the task-dir format.

A task dir is a kbert model dir (backbone weights, config, tokenizer) plus `kbert_task.json` (the task, its
labels, max_length, pooling, regression target scale, ...) and `kbert_task.safetensors` (the head's
weights). `kbert.finetune` writes it; `kbert.TaskModel`, `kbert.Embedder` and `kbert export` read it.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence, Union

import keras
from keras import ops
import numpy as np

from kbert.models.backbone import INPUT_NAMES
from kbert.models.locate import TASK_FILE
from kbert.models.pooling import pool

TASKS = ("classification", "pair-classification", "regression", "tagging", "sentence-embedding", "question-answering")
TOKEN_TASKS = ("tagging", "question-answering")  # heads on every token of the last layer
HEAD_FILE = "kbert_task.safetensors"


def default_pooling(task: str) -> Optional[str]:
    """What a task pools when `pooling` is not given (and what task dirs written before the option mean)."""
    return None if task in TOKEN_TASKS else "mean" if task == "sentence-embedding" else "pooler"


@keras.saving.register_keras_serializable(package="kbert")
class TaskNetwork(keras.Model):
    """Backbone + task head.

    - classification / pair-classification: logits `[b, num_labels]` from the pooled representation;
    - regression: `head * std + mean` of the training targets (`target=(mean, std)`), so the head learns a
      standardized value whatever the label scale (a 1-10 rating needs no large bias to be learned);
    - tagging: logits `[b, s, num_labels]` from every token of the last layer;
    - question-answering: `[b, s, 2]`, each token's answer-start and answer-end logit (transformers'
      `qa_outputs`);
    - sentence-embedding: the pooled vector `[b, h]` itself (no head).

    `pooling` is what the head (or a bi-encoder's output) reads: "pooler" (BERT's tanh layer over [CLS]) or
    one of `kbert.models.pooling.POOLINGS` over `layers`.

    Args:
        backbone: a kbert backbone built with `output_hidden_states=True` where `pooling` needs them.
        task: one of `TASKS`.
        num_labels: classes (1 for regression, 0 for sentence-embedding, 2 for question-answering).
        dropout: dropout on the head's input.
        target: (mean, std) of regression targets.
        pooling, layers: see above; default `default_pooling(task)` and the last layer.
    """

    def __init__(self, backbone, task: str, num_labels: int, dropout: float = 0.1, target=(0.0, 1.0),
                 pooling: Optional[str] = None, layers: Union[int, Sequence[int]] = -1, **kwargs):
        super().__init__(name=kwargs.pop("name", "task"), **kwargs)
        if task not in TASKS:
            raise ValueError(f"`task` must be one of {TASKS}. Received: task={task!r}")
        self.backbone, self.task, self.num_labels = backbone, task, int(num_labels)
        self.dropout_rate, self.target = float(dropout), (float(target[0]), float(target[1]) or 1.0)
        self.pooling, self.pooled_layers = pooling or default_pooling(task), layers
        self.dropout = keras.layers.Dropout(self.dropout_rate)
        self.head = None
        if task != "sentence-embedding":
            self.head = keras.layers.Dense(
                self.num_labels, name="task_head", dtype="float32",
                kernel_initializer=keras.initializers.TruncatedNormal(stddev=backbone.config.initializer_range))

    def call(self, features, training=False):
        features = {k: features[k] for k in INPUT_NAMES}  # the order the functional backbone declares
        if self.task not in TOKEN_TASKS and self.pooling == "pooler" and self.head is not None:
            # the pooler reads [CLS] alone, so the last block runs at that row only (its keys and values still
            # come from every token): the block's queries, attention output and feed-forward shrink from
            # [b, s, h] to [b, 1, h], the same logits for most of one block's compute less
            rows = ops.zeros((ops.shape(features["token_ids"])[0], 1), "int32")  # [b, 1]
            x = self.backbone.sequence_output_at(features, rows, training=training)  # [b, 1, h]
            return self._logits(self.backbone.pooler(x), training)
        out = self.backbone(features, training=training)
        if self.task == "sentence-embedding":
            return pool(out["hidden_states"], features["padding_mask"], self.pooling, self.pooled_layers)
        if self.task in TOKEN_TASKS:
            x = out["sequence_output"]  # [b, s, h]
        else:
            x = pool(out["hidden_states"], features["padding_mask"], self.pooling, self.pooled_layers)  # [b, h]
        return self._logits(x, training)

    def _logits(self, x, training):
        """The head over pooled `x` [b, h] (or [b, s, h] for token tasks)."""
        logits = self.head(self.dropout(keras.ops.cast(x, "float32"), training=training))
        mean, std = self.target
        return logits * std + mean if self.task == "regression" else logits

    def packed_logits(self, token_ids, segments, type_ids, starts):
        """`call`'s outputs for packed rows (inference): `[b, t, labels]` for text t of row b, where `token_ids`,
        `segments` (1, 1, 2, ... numbering each row's texts; 0 = padding) and `type_ids` are `[b, s]` and
        `starts` `[b, t, s]` is 1 at each text's first token ([CLS]), which the pooler reads. The same logits as
        each text (a pair) run alone; a batch of mixed lengths then needs far fewer padded positions. Heads on
        the pooler only."""
        if self.pooling != "pooler" or self.head is None:
            raise ValueError("packed_logits reads BERT's pooler: a classification / regression head with "
                             f"pooling='pooler' (this one: task {self.task!r}, pooling {self.pooling!r})")
        rows = ops.argmax(starts, axis=-1)  # [b, t]: each text's [CLS] (an empty slot: 0, its logits unread)
        # as in `call`, the last block runs at those rows alone
        first = self.backbone.packed_hidden_states(token_ids, segments, type_ids, rows=rows)[-1]  # [b, t, h]
        logits = self.head(ops.cast(self.backbone.pooler.dense(first), "float32"))  # [b, t, labels]
        mean, std = self.target
        return logits * std + mean if self.task == "regression" else logits

    def get_config(self):
        return {"backbone": keras.saving.serialize_keras_object(self.backbone), "task": self.task,
                "num_labels": self.num_labels, "dropout": self.dropout_rate, "target": list(self.target),
                "pooling": self.pooling, "name": self.name,
                "layers": self.pooled_layers if isinstance(self.pooled_layers, int) else list(self.pooled_layers)}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)


class SpladeNetwork(keras.Model):
    """Backbone + its masked-LM head read as SPLADE (`kbert.models.pooling.splade_pool`): `[b, vocab]` float32
    sparse vectors of a batch of texts, what `kbert.SparseEncoder` computes. The head is built here and
    `head_weights` (the starting model's head, in `MaskedLMHead.weights` order) are copied into it.

    The head runs at every token ([b, s, vocab] logits), unlike pretraining's, which runs at the masked
    positions only: a SPLADE vector reads each token's predicted vocabulary.

    Inference-free SPLADE (`query_weights`, `[vocab]`): queries do not run the model; `query_vectors` gives each
    query token its entry of a trained table (sentence-transformers' SparseStaticEmbedding). The table trains
    `query_scale` times faster than the other weights: its variable `raw` holds the table / `query_scale`, and
    reads back as `query_scale x raw` with the gradient of `raw` unscaled (`query_weights`). Adam's step on
    `raw` is about the learning rate whatever the gradient's size, so the table moves `query_scale` times as
    far per step (sentence-transformers trains it at its own learning rate, 1e-3 beside the model's 2e-5),
    while gradient clipping and the optimizer see its plain gradient."""

    def __init__(self, backbone, head_weights: Sequence = (), pooling: str = "max", activation: str = "relu",
                 query_weights=None, query_scale: float = 1.0, **kwargs):
        from kbert.models.layers import MaskedLMHead

        super().__init__(name=kwargs.pop("name", "splade"), **kwargs)
        self.backbone, self.config = backbone, backbone.config
        self.pooling, self.activation = pooling, activation
        self.mlm_head = MaskedLMHead(self.config, backbone.token_embedding, dtype=backbone.dtype_policy,
                                     name="mlm_head")
        self.mlm_head.build((None, None, self.config.hidden_size))
        if head_weights:
            if len(head_weights) != len(self.mlm_head.weights):
                raise ValueError(f"a masked-LM head has {len(self.mlm_head.weights)} weights; {len(head_weights)} "
                                 f"were given")
            for variable, value in zip(self.mlm_head.weights, head_weights):
                variable.assign(value)
        self.query_scale = float(query_scale)
        self.query_table = None  # the inference-free query side's `[vocab]` table / query_scale
        if query_weights is not None:
            init = np.asarray(query_weights, np.float32) / self.query_scale
            if init.shape != (self.config.vocab_size,):
                raise ValueError(f"`query_weights` must hold one weight per vocabulary token "
                                 f"({self.config.vocab_size}). Received shape {init.shape}")
            self.query_table = self.add_weight(shape=init.shape, initializer=keras.initializers.Constant(init),
                                               dtype="float32", name="query_weights")

    def call(self, features, training=None):
        return splade_vectors(self.backbone, self.mlm_head, features, self.pooling, self.activation, training)

    def query_weights(self):
        """The inference-free query table `[vocab]` as it is read (the variable times `query_scale`)."""
        raw = ops.convert_to_tensor(self.query_table)
        # exactly query_scale x raw (the second term is 0), with d/d raw = 1; `raw + stop_gradient((scale - 1)
        # raw)` would cancel to 0 in float32 when the scale is far below 1
        return self.query_scale * ops.stop_gradient(raw) + (raw - ops.stop_gradient(raw))

    def query_vectors(self, token_ids, keep):
        """Inference-free queries' `[b, vocab]` float32 vectors: the table's weight at each distinct token of a
        row where `keep` `[b, s]` is true (padding and [CLS] / [SEP] left out by the caller), 0 elsewhere, as
        sentence-transformers' SparseStaticEmbedding gives a query (a token twice counts once)."""
        return static_query_vectors(self.query_weights(), token_ids, keep)


def static_query_vectors(table, token_ids, keep):
    """`[b, vocab]`: `table[t]` at each distinct token t of row i of `token_ids` `[b, s]` where `keep` is true.
    A token repeated in a row is kept at its first position only (a `[b, s, s]` comparison), so the scatter's
    sum over a row's positions writes each token's weight once."""
    ids = ops.cast(token_ids, "int32")
    b, s = ops.shape(ids)[0], ops.shape(ids)[1]
    earlier = ops.tril(ops.ones((s, s), "int32"), k=-1) > 0  # [s, s]: position j before position i
    repeated = ops.any(ops.logical_and(ops.equal(ids[:, :, None], ids[:, None, :]), earlier[None]), axis=-1)
    first = ops.logical_and(ops.cast(keep, "bool"), ops.logical_not(repeated))  # [b, s]
    values = ops.take(table, ids) * ops.cast(first, "float32")  # [b, s]
    rows = ops.broadcast_to(ops.arange(b, dtype="int32")[:, None], (b, s))
    indices = ops.reshape(ops.stack([rows, ids], axis=-1), (-1, 2))
    return ops.scatter(indices, ops.reshape(values, (-1,)), (b, ops.shape(table)[0]))


def splade_vectors(backbone, mlm_head, features, pooling: str = "max", activation: str = "relu", training=None,
                   log1p: bool = True):
    """`[b, vocab]` float32 SPLADE vectors of a batch: the masked-LM head at every token of the last layer
    (`[b, s, vocab]` logits, no mask-position gather), pooled over the real tokens. What `SpladeNetwork` trains
    and `kbert.SparseEncoder` encodes with, so both read a text the same way (log1p: as `splade_pool`'s)."""
    from kbert.models.pooling import splade_pool

    out = backbone({k: features[k] for k in INPUT_NAMES}, training=training)
    logits = mlm_head(out["sequence_output"], None)  # [b, s, vocab]
    return splade_pool(logits, features["padding_mask"], pooling, activation, log1p)


def save_task_head(network: TaskNetwork, meta: dict, model_dir: str) -> None:
    """Writes the head's weights (`HEAD_FILE`, when the task has a head) and `meta` (`TASK_FILE`) into
    `model_dir`, beside the backbone that `kbert.save_model` wrote there."""
    if network.head is not None:
        from kbert.utils import save_safetensors

        tensors = {v.path: np.ascontiguousarray(keras.ops.convert_to_numpy(v)) for v in network.head.weights}
        save_safetensors(tensors, os.path.join(model_dir, HEAD_FILE), metadata={"format": "kbert"})
    with open(os.path.join(model_dir, TASK_FILE), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, ensure_ascii=False)
        f.write("\n")


def load_task_head(network: TaskNetwork, model_dir: str) -> None:
    """Reads the head's weights of a task dir into a built `network` (nothing to read without a head)."""
    from kbert.models.io import assign_weights, read_safetensors

    if network.head is not None:
        path = os.path.join(model_dir, HEAD_FILE)
        assign_weights(network.head, read_safetensors(path), path)
