"""How many sequences fit in device memory: one memory model of the architecture, a few global coefficients.

    memory(batch, seq) = WORKSPACE
                       + params x (weights + gradients + slots x (4 + EXTRA_BYTES_PER_SLOT) [+ 16-bit copy])
                       + batch x seq x layers_computed x ACT_TOKEN_BYTES_PER_HIDDEN x
                             (hidden + intermediate x INTERMEDIATE_FACTOR) x act_bytes
                       + batch x heads x seq^2 x layers_computed x ATTN_BYTES_PER_SCORE x act_bytes
                       + batch x predictions x vocab x (logits + softmax + gradient, fp32)

- parameters: counted from the ModelConfig (ALBERT shares one group's weights across layers, so its
  parameter memory is small while its activations still grow with the number of layers computed);
- optimizer slots: Adam / AdamW / LAMB keep 2 per parameter, SGD none; mixed precision keeps fp32 weights
  (the policy's variables) and computes activations in 16 bits;
- activations kept for the backward pass per token and layer: QKV, attention output, two residual adds,
  two LayerNorms, dropout masks and the backward pass's temporaries (`ACT_TOKEN_BYTES_PER_HIDDEN` tensors of
  size hidden) and the feed-forward intermediate with its GELU input/output (`INTERMEDIATE_FACTOR` tensors of
  size intermediate);
- attention scores, softmax and dropout mask per head: `ATTN_BYTES_PER_SCORE` seq x seq tensors per layer;
- activation recomputation keeps only each layer's input (1 tensor of size hidden per token) plus one
  layer's full activations;
- gradient accumulation divides the batch that must fit by the number of micro-batches.

The coefficients are global and documented here, never fitted per row: one set of four values (chosen on a
small grid of round numbers) puts every row of the reference table within 27%. The sanity anchor is the 12 GB table
in google-research/bert's README (TF 1.11, fp32, Adam; tests check it within 35%); `kbert plan --probe`
measures the real peak on the device at hand.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence

from kbert.data.masking import default_max_predictions

ACT_TOKEN_BYTES_PER_HIDDEN = 28  # tensors of width `hidden` kept per token per layer (forward + backward temporaries)
INTERMEDIATE_FACTOR = 3  # tensors of width `intermediate` kept per token per layer (dense out, GELU in/out)
ATTN_BYTES_PER_SCORE = 4  # seq x seq tensors per head per layer (scores, softmax, dropout mask, its gradient)
WORKSPACE_BYTES = 0.5e9  # framework, cuDNN/cuBLAS workspaces, allocator fragmentation
EXTRA_BYTES_PER_SLOT = 4  # optimizer temporaries: the update materializes each slot's new value once
OPTIMIZER_SLOTS = {"adam": 2, "adamw": 2, "lamb": 2, "adafactor": 1, "sgd": 0, "momentum": 1}
PRECISION_ACT_BYTES = {"float32": 4, "mixed_float16": 2, "mixed_bfloat16": 2}


def parse_memory(text) -> float:
    """'12GB', '12 GiB', '16000MB' or a number of bytes -> bytes."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?i?b?)\s*", str(text).lower())
    if not m:
        raise ValueError(f"`memory` must look like '12GB' or '16GiB'. Received: {text!r}")
    unit = m.group(2).rstrip("b")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30,
             "ti": 2 ** 40}[unit]
    return float(m.group(1)) * scale


def estimate_memory(config, batch: int, seq_len: int, optimizer: str = "adamw", precision: str = "float32",
                    max_predictions: Optional[int] = None, accumulation: int = 1,
                    recompute: bool = False) -> Dict[str, float]:
    """Bytes needed to train `config` (a ModelConfig) on `batch` x `seq_len`, by component."""
    if optimizer not in OPTIMIZER_SLOTS:
        raise ValueError(f"`optimizer` must be one of {tuple(OPTIMIZER_SLOTS)}. Received: {optimizer!r}")
    if precision not in PRECISION_ACT_BYTES:
        raise ValueError(f"`precision` must be one of {tuple(PRECISION_ACT_BYTES)}. Received: {precision!r}")
    params = config.num_parameters()
    slots = OPTIMIZER_SLOTS[optimizer]
    act = PRECISION_ACT_BYTES[precision]
    # fp32 weights + fp32 gradients + slots (+ a 16-bit copy of the weights for the compute under mixed precision)
    state = params * (4 + 4 + 4 * slots + (2 if act == 2 else 0) + EXTRA_BYTES_PER_SLOT * slots)
    micro = max(1, -(-batch // accumulation))
    h, i, heads, layers = config.hidden_size, config.intermediate_size, config.num_heads, config.num_layers
    per_layer_tokens = micro * seq_len * (ACT_TOKEN_BYTES_PER_HIDDEN * h + INTERMEDIATE_FACTOR * i) * act
    per_layer_attn = micro * heads * seq_len * seq_len * ATTN_BYTES_PER_SCORE * act
    if recompute:
        activations = layers * micro * seq_len * h * act + per_layer_tokens + per_layer_attn
    else:
        activations = layers * (per_layer_tokens + per_layer_attn)
    predictions = max_predictions or default_max_predictions(seq_len)
    embeddings = micro * seq_len * (config.embedding_size or h) * act * 4
    mlm = micro * predictions * config.vocab_size * 4 * 3
    total = WORKSPACE_BYTES + state + activations + embeddings + mlm
    return {"total": total, "workspace": WORKSPACE_BYTES, "weights_grads_slots": state, "activations": activations,
            "embeddings": embeddings, "mlm_head": mlm, "micro_batch": micro}


def max_batch_size(config, memory, seq_len: int, **kwargs) -> int:
    """The largest batch whose estimate fits in `memory` (bytes or '12GB'); 0 when none does."""
    budget = parse_memory(memory)
    lo, hi = 0, 1
    while estimate_memory(config, hi, seq_len, **kwargs)["total"] <= budget:
        lo, hi = hi, hi * 2
        if hi > 1 << 20:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if estimate_memory(config, mid, seq_len, **kwargs)["total"] <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def plan_batch_size(config, memory, seq_lens: Sequence[int] = (128,), target_batch: Optional[int] = None,
                    replicas: int = 1, optimizer: str = "adamw", precision: str = "float32", margin: float = 0.0,
                    recompute: bool = False) -> List[Dict]:
    """`kbert.plan_batch_size(...)`: for each sequence length, the max micro-batch per replica that fits
    `memory` (less a safety `margin` fraction) and, for a `target_batch` (global), the micro-batch x
    accumulation steps x replicas that reaches it."""
    from kbert.models.config import ModelConfig

    if isinstance(config, str):
        config = ModelConfig.preset(config)
    budget = parse_memory(memory) * (1.0 - margin)
    rows = []
    for seq in seq_lens:
        if seq > config.max_position:
            raise ValueError(f"seq_len {seq} is beyond the model's position embeddings ({config.max_position})")
        best = max_batch_size(config, budget, seq, optimizer=optimizer, precision=precision, recompute=recompute)
        row = {"seq_len": seq, "max_batch": best,
               "memory_at_max": estimate_memory(config, max(best, 1), seq, optimizer=optimizer,
                                                precision=precision, recompute=recompute)["total"]}
        if target_batch:
            if target_batch % replicas:
                raise ValueError(f"target batch {target_batch} is not divisible by {replicas} replicas")
            per_replica = target_batch // replicas
            if best == 0:
                row.update(micro_batch=0, accumulation=None, replicas=replicas)
            else:
                accumulation = -(-per_replica // best)
                while per_replica % accumulation:  # equal micro-batches
                    accumulation += 1
                row.update(micro_batch=per_replica // accumulation, accumulation=accumulation, replicas=replicas)
        rows.append(row)
    return rows


def plan_for_config(config, model_config, precision: str, replicas: int, device: str) -> Dict:
    """`trainer.batch_size: auto`: the largest per-replica batch (at most 256) that the planner fits in
    the device's memory less a 10% margin (`trainer.memory` when set, else the GPU's reported limit, else
    8 GB on CPU / 16 GB elsewhere), times the replicas; no accumulation."""
    import tensorflow as tf

    memory = config.trainer.memory
    if memory is None and device == "gpu":
        memory = tf.config.experimental.get_memory_info("GPU:0").get("limit") or None
        if memory is None:
            details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
            memory = details.get("memory_limit")
    if memory is None:
        memory = "8GB" if device == "cpu" else "16GB"
    best = max_batch_size(model_config, parse_memory(memory) * 0.9, config.data.max_seq_len,
                          optimizer=config.optimizer.name, precision=precision)
    if best == 0:
        raise ValueError(f"The model does not fit in {memory} at max_seq_len={config.data.max_seq_len} even with "
                         f"batch 1; use a smaller model, shorter sequences or mixed precision")
    per_replica = min(best, 256)
    return {"global_batch": per_replica * replicas, "accumulation": 1, "micro_batch": per_replica,
            "memory": memory}


REFERENCE_12GB = {  # google-research/bert README, TF 1.11, Titan X 12 GB, fp32, Adam
    "bert-base": {64: 64, 128: 32, 256: 16, 320: 14, 384: 12, 512: 6},
    "bert-large": {64: 12, 128: 6, 256: 2, 320: 1, 384: 0, 512: 0},
}
