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
        out = self.backbone(features, training=training)
        if self.task == "sentence-embedding":
            return pool(out["hidden_states"], features["padding_mask"], self.pooling, self.pooled_layers)
        if self.task in TOKEN_TASKS:
            x = out["sequence_output"]  # [b, s, h]
        elif self.pooling == "pooler":
            x = out["pooled_output"]  # [b, h]
        else:
            x = pool(out["hidden_states"], features["padding_mask"], self.pooling, self.pooled_layers)  # [b, h]
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
        x = self.backbone.packed_hidden_states(token_ids, segments, type_ids)[-1]  # [b, s, h]
        first = ops.einsum("bts,bsh->bth", ops.cast(starts, x.dtype), x)  # [b, t, h]
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
    positions only: a SPLADE vector reads each token's predicted vocabulary."""

    def __init__(self, backbone, head_weights: Sequence = (), pooling: str = "max", activation: str = "relu",
                 **kwargs):
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

    def call(self, features, training=None):
        return splade_vectors(self.backbone, self.mlm_head, features, self.pooling, self.activation, training)


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
        from safetensors.numpy import save_file

        tensors = {v.path: np.ascontiguousarray(keras.ops.convert_to_numpy(v)) for v in network.head.weights}
        tmp = os.path.join(model_dir, HEAD_FILE + ".tmp")
        save_file(tensors, tmp, metadata={"format": "kbert"})
        os.replace(tmp, os.path.join(model_dir, HEAD_FILE))
    with open(os.path.join(model_dir, TASK_FILE), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, ensure_ascii=False)
        f.write("\n")


def load_task_head(network: TaskNetwork, model_dir: str) -> None:
    """Reads the head's weights of a task dir into a built `network` (nothing to read without a head)."""
    from kbert.models.io import assign_weights, read_safetensors

    if network.head is not None:
        path = os.path.join(model_dir, HEAD_FILE)
        assign_weights(network.head, read_safetensors(path), path)
