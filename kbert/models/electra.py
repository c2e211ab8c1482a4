"""ELECTRA pretraining: replaced-token detection (Clark et al., 2020, "ELECTRA: Pre-training Text Encoders as
Discriminators Rather Than Generators").

A small generator (a BERT 1/4 the discriminator's width) fills the masked positions with tokens sampled from
its masked-LM distribution; the discriminator (the backbone that is kept) labels every token as original or
replaced. The discriminator learns from all tokens, not from the 15% that are masked, which is why ELECTRA
reaches a given fine-tuning accuracy with several times less pretraining compute than masked-LM alone.
Sampling is not differentiable: the generator learns from its masked-LM loss only.

Differences from the paper: the generator has its own embeddings (the paper shares the token and position
embeddings between the two; here any backbone, BERT or ALBERT, can be the discriminator).
"""

from __future__ import annotations

from typing import Dict, Optional

import keras
from keras import ops

from kbert.models.backbone import INPUT_NAMES, Backbone, build_backbone, pretraining_losses
from kbert.models.config import ModelConfig
from kbert.models.layers import MaskedLMHead, activation, initializer, last_layer_at_predictions


def generator_config(config: ModelConfig, size: float = 0.25) -> ModelConfig:
    """The generator for discriminator `config`: same depth, vocabulary and positions, `size` x its width
    (hidden, heads and intermediate), as ELECTRA's small and base models."""
    if not 0.0 < size <= 1.0:
        raise ValueError(f"`generator_size` must be in (0, 1]. Received: generator_size={size!r}")
    heads = max(1, int(round(config.num_heads * size)))
    hidden = max(heads, int(round(config.hidden_size * size / heads)) * heads)
    return ModelConfig(architecture="bert", vocab_size=config.vocab_size, hidden_size=hidden,
                       num_layers=config.num_layers, num_heads=heads,
                       intermediate_size=max(1, int(round(config.intermediate_size * size))),
                       max_position=config.max_position, type_vocab_size=config.type_vocab_size,
                       hidden_act=config.hidden_act, dropout=config.dropout,
                       attention_dropout=config.attention_dropout, layer_norm_epsilon=config.layer_norm_epsilon,
                       initializer_range=config.initializer_range, pad_token_id=config.pad_token_id)


class ReplacedTokenHead(keras.layers.Layer):
    """Per-token original/replaced logit: dense + activation + dense to 1 (ELECTRA's discriminator head)."""

    def __init__(self, config: ModelConfig, **kwargs):
        super().__init__(**kwargs)
        self.hidden_size = config.hidden_size
        self.dense = keras.layers.Dense(config.hidden_size, kernel_initializer=initializer(config),
                                        dtype=self.dtype_policy, name="dense")
        self.act = activation(config.hidden_act)
        self.out = keras.layers.Dense(1, kernel_initializer=initializer(config), dtype=self.dtype_policy,
                                      name="out")

    def build(self, x_shape):
        self.dense.build((None, None, self.hidden_size))
        self.out.build((None, None, self.hidden_size))

    def call(self, x):
        return ops.cast(ops.squeeze(self.out(self.act(self.dense(x))), -1), "float32")  # [b, s]


@keras.saving.register_keras_serializable(package="kbert")
class ElectraPretrainer(keras.Model):
    """ELECTRA replaced-token-detection pretraining around a kbert backbone (the discriminator).

    Takes the same features and labels as `Pretrainer` with an MLM-only pipeline (`objective="mlm"`): the
    masked `token_ids`, `segment_ids`, `padding_mask`, `mask_positions` [b, p]; labels `mask_ids` and
    `mask_weights` [b, p]. Calling it runs the generator (`mlm_logits` [b, p, v]);
    `compute_losses(features, labels, training=...)` also samples the replacements and runs the
    discriminator. `loss = mlm_loss + rtd_weight * rtd_loss`; the metrics add `rtd_accuracy` and
    `replaced_fraction`. Keep `pretrainer.backbone`: it is what fine-tuning and embeddings use.

    Args:
        backbone: the discriminator, a `BertBackbone` or `AlbertBackbone`.
        generator_size: generator width relative to the discriminator (ELECTRA: 1/4 to 1/2 works best).
        rtd_weight: weight of the replaced-token loss (ELECTRA: 50).
        seed: seed of the sampling noise.

    Example:
        >>> backbone = kbert.BertBackbone(kbert.ModelConfig.preset("bert-mini", vocab_size=16000))
        >>> pretrainer = kbert.ElectraPretrainer(backbone)
        >>> losses = pretrainer.compute_losses(features, labels, training=True)
    """

    def __init__(self, backbone: Backbone, generator_size: float = 0.25, rtd_weight: float = 50.0,
                 seed: Optional[int] = None, **kwargs):
        super().__init__(name=kwargs.pop("name", "electra_pretrainer"), **kwargs)
        if not isinstance(backbone, Backbone):
            raise TypeError(f"`backbone` must be a kbert backbone. Received: {type(backbone).__name__}")
        if not rtd_weight > 0:
            raise ValueError(f"`rtd_weight` must be positive. Received: rtd_weight={rtd_weight!r}")
        self.backbone = backbone
        self.config = backbone.config
        self.generator_size, self.rtd_weight, self.seed = float(generator_size), float(rtd_weight), seed
        policy = backbone.dtype_policy
        with keras.name_scope("generator"):  # variable paths (and optimizer slot names) unlike the discriminator's
            self.generator = build_backbone(generator_config(self.config, generator_size), dtype=policy,
                                            name="generator")
        self.mlm_head = MaskedLMHead(self.generator.config, self.generator.token_embedding, dtype=policy,
                                     name="mlm_head")
        self.rtd_head = ReplacedTokenHead(self.config, dtype=policy, name="rtd_head")
        self.seed_generator = keras.random.SeedGenerator(seed, name="sampling_seed")
        self.build()

    def build(self, features_shape=None):
        # every variable exists right away: the discriminator head is used by compute_losses only, and
        # trainers build their optimizer from `trainable_variables` after one call
        self.mlm_head.build((None, None, self.generator.config.hidden_size), (None, None))
        self.rtd_head.build((None, None, self.config.hidden_size))
        self.built = True

    def call(self, features, training=None):
        inputs = {k: features[k] for k in INPUT_NAMES}
        if last_layer_at_predictions():  # as `Pretrainer`: the generator's last block at the masked positions only
            x = self.generator.sequence_output_at(inputs, ops.cast(features["mask_positions"], "int32"),
                                                  training=training)  # [b, p, h]
            return {"mlm_logits": self.mlm_head(x, None)}
        out = self.generator(inputs, training=training)
        return {"mlm_logits": self.mlm_head(out["sequence_output"], features["mask_positions"])}

    def compute_losses(self, features, labels, outputs=None, training=None) -> Dict[str, "keras.KerasTensor"]:
        """Generator masked-LM loss + weighted replaced-token loss, and accuracies (float32 scalars)."""
        if outputs is None:
            outputs = self(features, training=training)
        result = pretraining_losses(outputs, labels)
        corrupted, replaced = self.corrupt(features, labels, outputs["mlm_logits"])
        out = self.backbone({"token_ids": corrupted,
                             "segment_ids": ops.cast(ops.convert_to_tensor(features["segment_ids"]), "int32"),
                             "padding_mask": ops.cast(ops.convert_to_tensor(features["padding_mask"]), "int32")},
                            training=training)
        rtd_logits = self.rtd_head(out["sequence_output"])  # [b, s]
        real = ops.cast(features["padding_mask"], "float32")
        denom = ops.maximum(ops.sum(real), 1.0)
        per_token = ops.binary_crossentropy(replaced, rtd_logits, from_logits=True)
        rtd_loss = ops.sum(per_token * real) / denom
        correct = ops.cast(ops.equal(ops.cast(rtd_logits > 0, "float32"), replaced), "float32")
        result.update(rtd_loss=rtd_loss, rtd_accuracy=ops.sum(correct * real) / denom,
                      replaced_fraction=ops.sum(replaced * real) / denom,
                      loss=result["mlm_loss"] + self.rtd_weight * rtd_loss)
        return result

    def corrupt(self, features, labels, mlm_logits):
        """The discriminator's input and targets: `token_ids` [b, s] with a sample from the generator at every
        real masked position, and `replaced` [b, s] (1.0 where the token differs from the original; a
        sample that equals the original counts as original, as in ELECTRA)."""
        logits = ops.stop_gradient(ops.cast(mlm_logits, "float32"))  # [b, p, v]
        # Gumbel-max: a sample from softmax(logits) at every masked position
        u = keras.random.uniform(ops.shape(logits), minval=1e-9, maxval=1.0, seed=self.seed_generator)
        sampled = ops.cast(ops.argmax(logits - ops.log(-ops.log(u)), axis=-1), "int32")  # [b, p]
        ids = ops.cast(ops.convert_to_tensor(features["token_ids"]), "int32")  # [b, s], masked
        weights = ops.cast(labels["mask_weights"], "float32")  # [b, p]; 0 = padding prediction slot
        slots = ops.one_hot(ops.cast(features["mask_positions"], "int32"), ops.shape(ids)[1]) * weights[..., None]
        at_mask = ops.sum(slots, axis=1) > 0  # [b, s]

        def scatter(values):  # [b, p] -> [b, s] at the masked positions (ids < 2^24 are exact in float32)
            return ops.cast(ops.sum(slots * ops.cast(values, "float32")[..., None], axis=1), "int32")

        corrupted = ops.where(at_mask, scatter(sampled), ids)
        original = ops.where(at_mask, scatter(labels["mask_ids"]), ids)
        return corrupted, ops.cast(ops.not_equal(corrupted, original), "float32")

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return self.compute_losses(x, y, y_pred, training=training)["loss"]

    def get_config(self):
        return {"backbone": keras.saving.serialize_keras_object(self.backbone),
                "generator_size": self.generator_size, "rtd_weight": self.rtd_weight, "seed": self.seed,
                "name": self.name}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)
