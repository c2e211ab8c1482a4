"""Model configuration: one dataclass whose fields are the backbone's constructor arguments."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Optional

ARCHITECTURES = ("bert", "albert")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "tanh")


@dataclasses.dataclass
class ModelConfig:
    """Architecture of a BERT or ALBERT encoder.

    Args:
        architecture: `"bert"` or `"albert"`.
        vocab_size: number of token ids.
        hidden_size: width of the transformer (H).
        num_layers: number of transformer blocks (L).
        num_heads: attention heads (A); `hidden_size` must divide evenly.
        intermediate_size: width of the feed-forward layer (I), usually 4H.
        embedding_size: token embedding width; `None` means `hidden_size`. ALBERT factorizes the
            embedding (E=128) and projects it to H.
        num_groups: ALBERT cross-layer sharing: the layers share `num_groups` parameter sets (1 = all
            layers share one block). Ignored for BERT.
        max_position: longest sequence the position embedding covers.
        type_vocab_size: number of segment ids.
        hidden_act: `"gelu"` (exact, BERT), `"gelu_tanh"` (approximate, ALBERT), `"relu"` or `"tanh"`.
        dropout: dropout on embeddings, attention output and feed-forward output.
        attention_dropout: dropout on attention probabilities. `0.0` (what MosaicBERT and ModernBERT
            pretrain with, and the ALBERT presets' default) lets Keras' JAX backend run each block's
            attention as one fused kernel (cuDNN flash attention on Ampere+ GPUs, splash attention on TPUs)
            in training too: `ModelConfig.preset("bert-base", attention_dropout=0.0)`, or
            `--set model.attention_dropout=0` on `kbert pretrain`. benchmarks/README.md has the speed-up.
        layer_norm_epsilon: epsilon of every LayerNorm.
        initializer_range: stddev of the truncated-normal initializer.
        pad_token_id: id of `[PAD]`.
        norm_first: pre-LayerNorm blocks (Xiong et al., 2020): LayerNorm before attention and before the
            feed-forward layer, residuals left unnormalized, one final LayerNorm after the last block.
            Deep stacks of them tolerate larger learning rates and shorter warm-ups than post-LN. `False`
            (BERT's post-LayerNorm) is what existing checkpoints use and what `export_transformers` writes.

    Example:
        >>> cfg = ModelConfig.preset("bert-mini", vocab_size=8000)
        >>> cfg.num_layers, cfg.hidden_size
        (4, 256)
    """

    architecture: str = "bert"
    vocab_size: int = 32000
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    embedding_size: Optional[int] = None
    num_groups: int = 1
    max_position: int = 512
    type_vocab_size: int = 2
    hidden_act: str = "gelu"
    dropout: float = 0.1
    attention_dropout: float = 0.1
    layer_norm_epsilon: float = 1e-12
    initializer_range: float = 0.02
    pad_token_id: int = 0
    norm_first: bool = False

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> "ModelConfig":
        def need(cond, msg):
            if not cond:
                raise ValueError(msg)

        need(self.architecture in ARCHITECTURES,
             f"`architecture` must be one of {ARCHITECTURES}. Received: architecture={self.architecture!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                     "max_position", "type_vocab_size", "num_groups"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                 f"`{name}` must be a positive integer. Received: {name}={value!r}")
        need(self.hidden_size % self.num_heads == 0,
             f"`hidden_size` must be divisible by `num_heads`. Received: hidden_size={self.hidden_size}, "
             f"num_heads={self.num_heads}")
        need(self.hidden_act in ACTIVATIONS,
             f"`hidden_act` must be one of {ACTIVATIONS}. Received: hidden_act={self.hidden_act!r}")
        if self.embedding_size is not None:
            need(isinstance(self.embedding_size, int) and self.embedding_size > 0,
                 f"`embedding_size` must be a positive integer or None. Received: "
                 f"embedding_size={self.embedding_size!r}")
        if self.architecture == "albert":
            need(self.num_layers % self.num_groups == 0,
                 f"`num_layers` must be divisible by `num_groups`. Received: num_layers={self.num_layers}, "
                 f"num_groups={self.num_groups}")
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            need(0.0 <= value < 1.0, f"`{name}` must be in [0, 1). Received: {name}={value!r}")
        for name in ("initializer_range", "layer_norm_epsilon"):  # NaN here makes every output NaN, silently
            value = getattr(self, name)
            need(isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 < value < float("inf"),
                 f"`{name}` must be a positive finite number. Received: {name}={value!r}")
        need(isinstance(self.norm_first, bool),
             f"`norm_first` must be True or False. Received: norm_first={self.norm_first!r}")
        need(0 <= self.pad_token_id < self.vocab_size,
             f"`pad_token_id` must be a valid token id (< vocab_size={self.vocab_size}). "
             f"Received: pad_token_id={self.pad_token_id}")
        return self

    # ------------------------------------------------------------- properties
    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def embedding_dim(self) -> int:
        return self.embedding_size or self.hidden_size

    def num_parameters(self) -> int:
        """Exact trainable parameter count of the backbone (embeddings, encoder, pooler)."""
        h, i, e = self.hidden_size, self.intermediate_size, self.embedding_dim
        emb = (self.vocab_size + self.max_position + self.type_vocab_size) * e + 2 * e
        if e != h:
            emb += e * h + h
        block = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 4 * h
        blocks = self.num_groups if self.architecture == "albert" else self.num_layers
        final_norm = 2 * h if self.norm_first else 0
        return emb + blocks * block + final_norm + (h * h + h)

    def check_length(self, max_length, name: str = "max_length", minimum: int = 2) -> int:
        """`max_length` (tokens per sequence) if the position embeddings cover it; otherwise a ValueError with
        the limit. One rule for pretraining, fine-tuning, embedding and export: refuse, never clamp. `minimum`:
        the fewest tokens a row may hold ([CLS] and [SEP]; 3 where a row needs a token besides them)."""
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < minimum:
            raise ValueError(f"`{name}` must be an integer >= {minimum}. Received: {name}={max_length!r}")
        if max_length > self.max_position:
            raise ValueError(f"`{name}`={max_length} is beyond the model's {self.max_position} position embeddings "
                             f"(`max_position`); use {name} <= {self.max_position}")
        return max_length

    # ------------------------------------------------------------- (de)serialize
    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "ModelConfig":
        if not isinstance(data, dict):
            raise TypeError(f"ModelConfig.from_dict expects a dict. Received: {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown ModelConfig field(s): {unknown}. Valid fields: {sorted(known)}")
        return cls(**data)

    def to_json(self, path: Optional[str] = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_json(cls, path_or_text: str) -> "ModelConfig":
        if os.path.exists(path_or_text):
            with open(path_or_text, encoding="utf-8") as f:
                path_or_text = f.read()
        try:
            data = json.loads(path_or_text)
        except json.JSONDecodeError as e:
            raise ValueError(f"ModelConfig JSON is not valid: {e}") from None
        return cls.from_dict(data)

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        """A named preset (see `ModelConfig.presets()`), with fields overridden by keyword."""
        if name not in PRESETS:
            raise ValueError(f"Unknown model preset {name!r}. Valid presets: {', '.join(PRESETS)}")
        fields = dict(PRESETS[name])
        fields.update(overrides)
        return cls.from_dict(fields)

    @staticmethod
    def presets():
        return tuple(PRESETS)


def _bert(layers, hidden, heads):
    return dict(architecture="bert", num_layers=layers, hidden_size=hidden, num_heads=heads,
                intermediate_size=4 * hidden, hidden_act="gelu")


def _albert(layers, hidden, heads):
    return dict(architecture="albert", num_layers=layers, hidden_size=hidden, num_heads=heads,
                intermediate_size=4 * hidden, embedding_size=128, num_groups=1, hidden_act="gelu_tanh",
                dropout=0.0, attention_dropout=0.0)


# The Turc et al. (2019) compact BERTs use H/64 heads; the paper sizes are used as is.
PRESETS: Dict[str, Dict[str, Any]] = {
    "bert-tiny": _bert(2, 128, 2),
    "bert-mini": _bert(4, 256, 4),
    "bert-small": _bert(4, 512, 8),
    "bert-medium": _bert(8, 512, 8),
    "bert-base": _bert(12, 768, 12),
    "bert-large": _bert(24, 1024, 16),
    "albert-base": _albert(12, 768, 12),
    "albert-large": _albert(24, 1024, 16),
    "albert-xlarge": _albert(24, 2048, 16),
}
