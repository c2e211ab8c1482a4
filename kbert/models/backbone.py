"""BERT and ALBERT backbones as Keras functional models, and the pretraining model on top of them."""

from __future__ import annotations

from typing import Dict, Optional, Union

import keras
from keras import ops

from kbert.models.config import ModelConfig
from kbert.models.layers import (Embeddings, LayerNorm, MaskedLMHead, PairHead, Pooler, TransformerBlock,
                                 last_layer_at_predictions, packed_inputs)

INPUT_NAMES = ("token_ids", "segment_ids", "padding_mask")


def _as_config(config: Union[ModelConfig, dict], architecture: str) -> ModelConfig:
    if isinstance(config, dict):
        config = ModelConfig.from_dict(config)
    if not isinstance(config, ModelConfig):
        raise TypeError(f"`config` must be a kbert.ModelConfig or a dict. Received: {type(config).__name__}")
    if config.architecture != architecture:
        raise ValueError(f"{architecture.upper()} backbone needs a config with architecture={architecture!r}. "
                         f"Received: architecture={config.architecture!r}")
    return config


class Backbone(keras.Model):
    """Common functional body of `BertBackbone` and `AlbertBackbone`.

    Inputs: a dict of `token_ids` [b, s] int, `segment_ids` [b, s] int, `padding_mask` [b, s] (1 = token,
    0 = padding). Outputs: a dict of `sequence_output` [b, s, h], `pooled_output` [b, h] and, with
    `output_hidden_states=True`, `hidden_states`: a list of L+1 tensors [b, s, h] (the encoder input,
    then every layer's output), as the embedding API needs for layer pooling. With
    `config.norm_first` the last of them is the final LayerNorm's output, equal to `sequence_output`.
    """

    architecture = None

    def __init__(self, config: Union[ModelConfig, dict], output_hidden_states: bool = False,
                 dtype=None, **kwargs):
        config = _as_config(config, self.architecture)
        policy = keras.dtype_policies.get(dtype) if dtype is not None else keras.config.dtype_policy()
        inputs = {
            "token_ids": keras.Input(shape=(None,), dtype="int32", name="token_ids"),
            "segment_ids": keras.Input(shape=(None,), dtype="int32", name="segment_ids"),
            "padding_mask": keras.Input(shape=(None,), dtype="int32", name="padding_mask"),
        }
        embeddings = Embeddings(config, dtype=policy, name="embeddings")
        blocks = self._make_blocks(config, policy)
        pooler = Pooler(config, dtype=policy, name="pooler")
        final_norm = (LayerNorm(epsilon=config.layer_norm_epsilon, dtype=policy, name="final_norm")
                      if config.norm_first else None)

        hidden = _encode(embeddings, blocks, final_norm, inputs["token_ids"], inputs["segment_ids"],
                         inputs["padding_mask"])
        x = hidden[-1]
        outputs = {"sequence_output": x, "pooled_output": pooler(x)}
        if output_hidden_states:
            outputs["hidden_states"] = hidden
        name = kwargs.pop("name", f"{self.architecture}_backbone")
        super().__init__(inputs=inputs, outputs=outputs, name=name, **kwargs)

        self.config = config
        self.output_hidden_states = output_hidden_states
        self.embeddings = embeddings
        self.blocks = blocks
        self.pooler = pooler
        self.final_norm = final_norm

    def _make_blocks(self, config, policy):
        raise NotImplementedError

    def packed_hidden_states(self, token_ids, segments, type_ids=None, rows=None):
        """Every layer's output `[b, s, h]` for packed rows: several texts per row, `segments` [b, s]
        numbering each token's text within its row (1, 1, 2, 2, 2, ..., 0 = padding; see
        `kbert.models.layers.packed_inputs`). Each text's states equal those it gets alone (its own
        positions from 0, attention within the text); inference only (no dropout). `type_ids` [b, s]: each
        token's segment type (a pair's second text: 1), default 0. `rows` [b, r] int: the last layer at
        those positions only ([b, r, h]), as `sequence_output_at`."""
        positions, attend = packed_inputs(segments)
        return _encode(self.embeddings, self.blocks, self.final_norm, token_ids,
                       ops.zeros_like(token_ids) if type_ids is None else type_ids, attend, positions, rows=rows)

    def sequence_output_at(self, inputs, rows, training=None):
        """`sequence_output` at `rows` [b, r] int only: [b, r, h], equal to gathering those rows from the full
        output, with the last block computed at those rows alone (what a pretraining head reads)."""
        return _encode(self.embeddings, self.blocks, self.final_norm, inputs["token_ids"], inputs["segment_ids"],
                       inputs["padding_mask"], training=training, rows=rows)[-1]

    @property
    def token_embedding(self) -> keras.layers.Embedding:
        return self.embeddings.token_embedding

    def get_config(self):
        return {"config": self.config.to_dict(), "output_hidden_states": self.output_hidden_states,
                "name": self.name, "trainable": self.trainable}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


@keras.saving.register_keras_serializable(package="kbert")
class BertBackbone(Backbone):
    """BERT encoder (Devlin et al., 2019): one parameter set per layer.

    Args:
        config: a `kbert.ModelConfig` with `architecture="bert"` (or its dict).
        output_hidden_states: also return every layer's output as `hidden_states`.
        dtype: a dtype policy name (`"float32"`, `"mixed_float16"`, `"mixed_bfloat16"`); default is
            the global Keras policy.

    Example:
        >>> import numpy as np, kbert
        >>> model = kbert.BertBackbone(kbert.ModelConfig.preset("bert-tiny", vocab_size=100))
        >>> out = model({"token_ids": np.array([[2, 7, 3]]), "segment_ids": np.zeros((1, 3), "int32"),
        ...              "padding_mask": np.ones((1, 3), "int32")})
        >>> tuple(out["sequence_output"].shape)
        (1, 3, 128)
    """

    architecture = "bert"

    def _make_blocks(self, config, policy):
        return [TransformerBlock(config, dtype=policy, name=f"layer_{i}") for i in range(config.num_layers)]


@keras.saving.register_keras_serializable(package="kbert")
class AlbertBackbone(Backbone):
    """ALBERT encoder (Lan et al., 2020): factorized embedding (e -> h) and cross-layer sharing.

    `config.num_groups` parameter sets are shared by the layers, `num_layers / num_groups` consecutive
    layers per set (1 group = every layer shares one block, the ALBERT default).

    Args and example as `BertBackbone`, with `architecture="albert"`.
    """

    architecture = "albert"

    def _make_blocks(self, config, policy):
        groups = [TransformerBlock(config, dtype=policy, name=f"group_{g}") for g in range(config.num_groups)]
        per_group = config.num_layers // config.num_groups
        return [groups[i // per_group] for i in range(config.num_layers)]


def _encode(embeddings, blocks, final_norm, token_ids, segment_ids, mask, positions=None, training=None,
            rows=None):
    """Embeddings, then the blocks: the hidden states (embedding output first; a pre-LN model's last one
    normalized). `mask`: [b, s] padding mask or [b, s, s] attention mask (packed rows). `rows` [b, r]: the
    last block computes only those positions, so the last hidden state is [b, r, h]."""
    _, x = embeddings(token_ids, segment_ids, positions=positions, training=training)
    hidden = [x]
    for i, block in enumerate(blocks):
        x = block(x, mask, training=training, rows=rows if i == len(blocks) - 1 else None)
        hidden.append(x)
    if final_norm is not None:  # pre-LN: the last output is normalized, and so is its hidden state
        hidden[-1] = final_norm(x)
    return hidden


def backbone_class(architecture: str):
    return {"bert": BertBackbone, "albert": AlbertBackbone}[architecture]


def build_backbone(config: ModelConfig, **kwargs) -> Backbone:
    """The backbone class named by `config.architecture`."""
    return backbone_class(config.architecture)(config, **kwargs)


PAIR_OBJECTIVES = (None, "nsp", "sop")


@keras.saving.register_keras_serializable(package="kbert")
class Pretrainer(keras.Model):
    """Masked-LM (+ next-sentence or sentence-order prediction) pretraining model.

    Call it on features (the backbone inputs plus `mask_positions` [b, p]) to get float32 logits
    `mlm_logits` [b, p, v] and, with a pair objective, `pair_logits` [b, 2]. `compute_losses(features,
    labels)` returns the losses and accuracies; labels are `mask_ids` [b, p], `mask_weights` [b, p]
    (1 for real predictions, 0 for padding) and, with a pair objective, `pair_labels` [b] (NSP: 1 = the
    second segment is random; SOP: 1 = the segments are swapped). `fit()` works on this model directly.

    Args:
        backbone: a `BertBackbone` or `AlbertBackbone`.
        pair_objective: `None` (MLM only), `"nsp"` or `"sop"`; default: NSP for BERT, SOP for ALBERT.

    Example:
        >>> import kbert
        >>> backbone = kbert.BertBackbone(kbert.ModelConfig.preset("bert-tiny", vocab_size=100))
        >>> pretrainer = kbert.Pretrainer(backbone)
    """

    def __init__(self, backbone: Backbone, pair_objective: Optional[str] = "default", **kwargs):
        super().__init__(name=kwargs.pop("name", "pretrainer"), **kwargs)
        if pair_objective == "default":
            pair_objective = "sop" if backbone.config.architecture == "albert" else "nsp"
        if pair_objective not in PAIR_OBJECTIVES:
            raise ValueError(f"`pair_objective` must be one of {PAIR_OBJECTIVES}. "
                             f"Received: pair_objective={pair_objective!r}")
        self.backbone = backbone
        self.config = backbone.config
        self.pair_objective = pair_objective
        policy = backbone.dtype_policy
        self.mlm_head = MaskedLMHead(self.config, backbone.token_embedding, dtype=policy, name="mlm_head")
        self.pair_head = (PairHead(self.config, dtype=policy, name=f"{pair_objective}_head")
                          if pair_objective else None)

    def call(self, features, training=None):
        inputs = {k: features[k] for k in INPUT_NAMES}
        if last_layer_at_predictions():
            # the heads read [CLS] (pair head) and the masked positions (MLM head) alone, so the last block
            # runs at those 1 + p rows only (the logits equal the full model's; `IMPLEMENTATIONS` has both)
            positions = ops.cast(features["mask_positions"], "int32")  # [b, p]
            rows = ops.concatenate([ops.zeros_like(positions[:, :1]), positions], axis=1)  # [b, 1 + p]
            x = self.backbone.sequence_output_at(inputs, rows, training=training)  # [b, 1 + p, h]
            result = {"mlm_logits": self.mlm_head(x[:, 1:], None)}
            pooled = self.backbone.pooler(x) if self.pair_head is not None else None  # the pooler reads row 0
        else:
            out = self.backbone(inputs, training=training)
            result = {"mlm_logits": self.mlm_head(out["sequence_output"], features["mask_positions"])}
            pooled = out["pooled_output"]
        if self.pair_head is not None:
            result["pair_logits"] = self.pair_head(pooled)
        return result

    def compute_losses(self, features, labels, outputs=None, training=None) -> Dict[str, "keras.KerasTensor"]:
        """Losses (`loss` is the sum that is optimized) and accuracies, all float32 scalars."""
        if outputs is None:
            outputs = self(features, training=training)
        return pretraining_losses(outputs, labels)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return pretraining_losses(y_pred, y)["loss"]

    def get_config(self):
        return {"backbone": keras.saving.serialize_keras_object(self.backbone),
                "pair_objective": self.pair_objective, "name": self.name}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)


def pretraining_losses(outputs, labels):
    """Weighted masked-LM cross-entropy (+ pair cross-entropy) and accuracies from float32 logits."""
    logits = ops.cast(outputs["mlm_logits"], "float32")
    ids = ops.cast(labels["mask_ids"], "int32")
    weights = ops.cast(labels.get("mask_weights", ops.ones_like(ids)), "float32")
    per_token = keras.losses.sparse_categorical_crossentropy(ids, logits, from_logits=True)  # [b, p]
    denom = ops.maximum(ops.sum(weights), 1.0)
    mlm_loss = ops.sum(per_token * weights) / denom
    correct = ops.cast(ops.equal(ops.cast(ops.argmax(logits, axis=-1), "int32"), ids), "float32")
    result = {"mlm_loss": mlm_loss, "mlm_accuracy": ops.sum(correct * weights) / denom}
    loss = mlm_loss
    if "pair_logits" in outputs and "pair_labels" in labels:
        pair_logits = ops.cast(outputs["pair_logits"], "float32")
        pair_labels = ops.cast(labels["pair_labels"], "int32")
        pair_loss = ops.mean(keras.losses.sparse_categorical_crossentropy(pair_labels, pair_logits,
                                                                          from_logits=True))
        result["pair_loss"] = pair_loss
        result["pair_accuracy"] = ops.mean(ops.cast(
            ops.equal(ops.cast(ops.argmax(pair_logits, axis=-1), "int32"), pair_labels), "float32"))
        loss = loss + pair_loss
    result["loss"] = loss
    return result
