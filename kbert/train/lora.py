"""LoRA (Hu et al., 2021) for fine-tuning: the encoder's weights stay frozen and each adapted projection learns a
rank-r update `W + (alpha / r) A B` instead, A `[in, r]`, B `[r, out]` (B starts at zero, so training starts from
the pretrained model exactly). Only A, B and the task head (with the pooler, where the head reads it) train,
which takes AdamW's state and the weight gradients down to a few percent of the model's: what matters for a
large checkpoint (BGE-M3 and KURE at 560M weights, BERT-Large) at a small batch on a small GPU.

The factors are Keras' own (`keras.layers.Dense.enable_lora`: created, tracked and saved in the layer), so every
kbert path (TensorFlow and JAX, XLA, data parallel, checkpoints and resume) carries them with nothing added.
The block computes x W + (alpha / r) (x A) B (`kbert.models.layers`), as PEFT does, rather than Keras' W + A B
on every call, which would keep an [in, out] merged kernel and its gradient per layer. `kbert.save_model` writes
the merged kernel, so a LoRA run's output is a plain model dir: `TaskModel.load`, `export_transformers` and
serving read it as any other.

targets: "all" adapts every linear projection of every block (query/key/value, attention output, the
feed-forward's two), which Dettmers et al. (QLoRA, 2023) found needed to match full fine-tuning; "attention"
only the first two.
"""

from __future__ import annotations

import math
from typing import List, Optional

TARGETS = {"attention": ("qkv", "attention_output"),
           "all": ("qkv", "attention_output", "intermediate", "output_dense")}
FACTORS = ("lora_kernel_a", "lora_kernel_b")


def check_lora(rank, alpha, targets) -> None:
    """Refuses bad LoRA settings by name."""
    if rank is None:
        return
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"`lora_rank` must be None (full fine-tuning) or a positive integer. Received: {rank!r}")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                              or not 0 < alpha < math.inf):
        raise ValueError(f"`lora_alpha` must be None (= lora_rank) or a positive number. Received: {alpha!r}")
    if targets not in TARGETS:
        raise ValueError(f"`lora_targets` must be one of {sorted(TARGETS)}. Received: {targets!r}")


def enable_lora(backbone, rank: int, alpha: Optional[float] = None, targets: str = "all") -> List:
    """Adds rank-`rank` factors to the `targets` projections of every block of a built backbone (ALBERT's shared
    block once); returns the adapted Dense layers. The kernels become non-trainable."""
    check_lora(rank, alpha, targets)
    adapted, seen = [], set()
    for block in backbone.blocks:
        if id(block) in seen:
            continue
        seen.add(id(block))
        for name in TARGETS[targets]:
            dense = getattr(block, name)
            limit = min(dense.kernel.shape)
            if rank > limit:
                raise ValueError(f"lora_rank={rank} is above the rank of the {name} projection "
                                 f"{tuple(dense.kernel.shape)}; at most {limit}")
            dense.enable_lora(rank, lora_alpha=float(alpha if alpha is not None else rank))
            adapted.append(dense)
    return adapted


def is_factor(variable) -> bool:
    return variable.path.rsplit("/", 1)[-1] in FACTORS


def lora_trainable(variables, backbone) -> list:
    """Of the variables a run would train, those LoRA trains: the factors and everything outside the
    backbone (the task head), plus the pooler where the run trains it; the backbone's own weights (embeddings,
    kernels, biases, LayerNorms) stay as they were."""
    frozen = {id(v) for v in backbone.weights if not is_factor(v) and not v.path.startswith("pooler/")}
    return [v for v in variables if id(v) not in frozen]
