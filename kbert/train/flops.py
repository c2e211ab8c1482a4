"""Model FLOPs of a pretraining step and MFU (model FLOPs utilization), as the progress bar shows them.

MFU = the model's matmul FLOPs per second / the device's peak, the PaLM paper's convention: 6 x matmul
parameters per token (forward 2, backward 4), the attention score and value matmuls, and the MLM head at the
masked positions only (what kbert computes; likewise the last block at [CLS] and the masked positions, where
kbert's `Pretrainer` computes it only there); no recomputation counted. The peaks are the vendors' dense
bf16 figures per chip; a device not listed shows no MFU rather than a guess. `benchmarks/gpu.py` measures the
matmul peak of the device at hand for its own figures.
"""

from __future__ import annotations

from typing import Optional

# dense bf16 FLOP/s per device, matched against the device kind's lower-cased name (longest match first)
PEAK_BF16 = {
    "b200": 2250e12, "gb200": 2500e12, "h200": 989e12, "h100": 989e12, "h100 pcie": 756e12, "h100 nvl": 835e12,
    "gh200": 989e12, "a100": 312e12, "a800": 312e12, "l40s": 362e12,
    "l4": 121e12, "a10g": 125e12, "a10": 125e12, "rtx 4090": 165e12, "rtx 3090": 71e12, "v100": 125e12,
    "t4": 65e12, "tpu v6": 918e12, "tpu v5p": 459e12, "tpu v5 lite": 197e12, "tpu v5e": 197e12,
    "tpu v4": 275e12, "tpu v3": 123e12, "tpu v2": 45e12,
}


def train_flops_per_step(config, batch: int, seq: int, predictions: int,
                         last_layer_rows: Optional[int] = None) -> float:
    """Model FLOPs of one training step of `batch` sequences of `seq` tokens with `predictions` masked
    positions each: 3 x 2 x (matmul parameters per token + attention + MLM head at the masked positions).
    `last_layer_rows`: the positions the last block computes (kbert's `Pretrainer`: [CLS] and the masked
    positions, 1 + predictions; its q/k/v projection still runs at every token); default: every position."""
    h, i, layers, v = config.hidden_size, config.intermediate_size, config.num_layers, config.vocab_size
    layer = 4 * h * h + 2 * h * i + 2 * 2 * seq * h  # per token: q/k/v, attention output, feed-forward, scores
    rows = seq if last_layer_rows is None else min(int(last_layer_rows), seq)
    last = 3 * h * h + (h * h + 2 * h * i + 2 * 2 * seq * h) * rows / seq
    head = (h * h + h * v) * predictions / seq
    return 3 * 2 * ((layers - 1) * layer + last + head) * batch * seq


def pretrainer_last_layer_rows(predictions: int) -> Optional[int]:
    """`last_layer_rows` of kbert's `Pretrainer` under the code path chosen now (`IMPLEMENTATIONS`)."""
    from kbert.models.layers import last_layer_at_predictions

    return 1 + predictions if last_layer_at_predictions() else None


def peak_flops(device_name: str) -> Optional[float]:
    """The dense bf16 peak of one device named like `NVIDIA H100 80GB HBM3` or `TPU v4`; None if unknown."""
    name = (device_name or "").lower()
    for key in sorted(PEAK_BF16, key=len, reverse=True):
        if key in name:
            return PEAK_BF16[key]
    return None


def mfu(flops_per_step: float, steps_per_second: float, devices: int, device_name: str) -> Optional[float]:
    peak = peak_flops(device_name)
    if not peak or devices < 1:
        return None
    return flops_per_step * steps_per_second / (peak * devices)
