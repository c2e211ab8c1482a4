"""`kbert plan --probe`: the largest batch that really trains on the accelerator at hand.

Real training steps (forward, backward, optimizer update) on synthetic batches, batch sizes doubled from the
planner's estimate until one runs out of memory, then a binary search between the last that fit and the
first that did not; out-of-memory errors are caught (TensorFlow's ResourceExhaustedError, XLA's
RESOURCE_EXHAUSTED on JAX) and the device's peak memory is read after each step that fit. Written in
Keras only (`train_on_batch`), so it runs on the TensorFlow backend (`tf.config.experimental.get_memory_info`)
and on the JAX backend (`device.memory_stats()`), where TensorFlow is not installed.
"""

from __future__ import annotations

import gc
import sys
from typing import Dict, List, Optional

import numpy as np


def is_out_of_memory(error: BaseException) -> bool:
    text = f"{type(error).__name__} {error}"
    return ("ResourceExhausted" in text or "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
            or isinstance(error, MemoryError))


def _backend():
    import keras

    return keras.backend.backend()


def accelerator() -> Optional[str]:
    """"gpu"/"tpu" when the Keras backend has one, else None."""
    if _backend() == "jax":
        import jax

        platform = jax.devices()[0].platform
        return platform if platform in ("gpu", "tpu") else None
    import tensorflow as tf

    if tf.config.list_logical_devices("TPU"):
        return "tpu"
    return "gpu" if tf.config.list_logical_devices("GPU") else None


def _reset_peak():
    if _backend() == "tensorflow":
        import tensorflow as tf

        if tf.config.list_logical_devices("GPU"):
            tf.config.experimental.reset_memory_stats("GPU:0")


def peak_memory() -> Optional[int]:
    """Peak bytes in use on the first accelerator since the last reset (JAX: since the process started),
    or None where the device does not report it (CPU)."""
    if _backend() == "jax":
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        return stats.get("peak_bytes_in_use")
    import tensorflow as tf

    if not tf.config.list_logical_devices("GPU"):
        return None
    return int(tf.config.experimental.get_memory_info("GPU:0")["peak"])


def compiled_step_bytes(trainer, features, labels) -> Optional[int]:
    """JAX: the bytes XLA allocates for one training step at these shapes (arguments + outputs + temporaries,
    less the donated state that outputs reuse), from the compiled program's memory analysis. JAX's
    allocator peak cannot be reset within a process (after one out-of-memory trial it stays near the
    limit), so this is the per-batch figure there. None where the backend does not report it."""
    if _backend() != "jax":
        return None
    import jax

    state = trainer._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                   optimizer_variables=True, metrics_variables=True)
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), (state, (features, labels)))
    m = jax.jit(trainer.train_step, donate_argnums=0).lower(*shapes).compile().memory_analysis()
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def _no_silent_recomputation():
    """JAX: XLA's rematerialization pass makes a step that does not fit recompute activations instead of
    failing, so every batch would "fit" (only slower); the probe turns it off to find the batch that fits
    as written."""
    if _backend() == "jax":
        import jax

        try:
            jax.config.update("jax_compiler_enable_remat_pass", False)
        except (AttributeError, KeyError):  # an older JAX without the option
            pass


def synthetic_batch(config, batch: int, seq_len: int, predictions: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    features = {
        "token_ids": rng.integers(5, config.vocab_size, (batch, seq_len)).astype("int32"),
        "segment_ids": (np.arange(seq_len)[None, :] >= seq_len // 2).repeat(batch, 0).astype("int32"),
        "padding_mask": np.ones((batch, seq_len), "int32"),
        "mask_positions": np.sort(rng.choice(seq_len, (batch, predictions)), axis=1).astype("int32"),
    }
    labels = {"mask_ids": rng.integers(5, config.vocab_size, (batch, predictions)).astype("int32"),
              "mask_weights": np.ones((batch, predictions), "float32"),
              "pair_labels": rng.integers(0, 2, (batch,)).astype("int32")}
    return features, labels


def build_trainer(config, optimizer: str = "adamw", precision: str = "float32"):
    """A compiled `Pretrainer` (NSP/SOP head included) whose `train_on_batch` is one real training step."""
    import keras

    from kbert.models.backbone import Pretrainer, build_backbone

    keras.mixed_precision.set_dtype_policy(precision)
    try:
        model = Pretrainer(build_backbone(config))
        opt = {"adamw": keras.optimizers.AdamW, "adam": keras.optimizers.Adam, "lamb": keras.optimizers.Lamb,
               "sgd": keras.optimizers.SGD}[optimizer](learning_rate=1e-5)
        if precision == "mixed_float16":
            opt = keras.optimizers.LossScaleOptimizer(opt)
        model.compile(optimizer=opt, jit_compile=_backend() != "tensorflow" or accelerator() is not None)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    return model


def probe_batch_size(config, seq_len: int, optimizer: str = "adamw", precision: str = "float32",
                     start: Optional[int] = None, max_batch: int = 4096, steps: int = 2,
                     predictions: Optional[int] = None, model=None, verbose: bool = False) -> Dict:
    """Largest batch (at most `max_batch`) for which `steps` training steps run without running out of
    memory, with the measured peak at that batch. Returns a dict with `max_batch`, `peak_bytes` and the
    `tried` list of (batch, fitted, peak_bytes)."""
    from kbert.data.masking import default_max_predictions
    from kbert.train.loop import _simulated_memory_limit

    predictions = predictions or default_max_predictions(seq_len, 0.15)
    _no_silent_recomputation()
    model = model or build_trainer(config, optimizer, precision)
    tried: List = []
    peaks = {}

    def fits(batch: int) -> bool:
        features, labels = synthetic_batch(config, batch, seq_len, predictions)
        try:
            _simulated_memory_limit(batch)
            _reset_peak()
            for _ in range(steps):
                model.train_on_batch(features, labels)
        except Exception as e:  # noqa: BLE001 - only out-of-memory is an answer; anything else re-raises
            if not is_out_of_memory(e):
                raise
            tried.append((batch, False, None))
            if verbose:
                print(f"  seq {seq_len}: batch {batch} runs out of memory", file=sys.stderr, flush=True)
            gc.collect()
            return False
        peaks[batch] = compiled_step_bytes(model, features, labels) if _backend() == "jax" else peak_memory()
        tried.append((batch, True, peaks[batch]))
        if verbose:
            peak = f", peak {peaks[batch] / 1e9:.2f} GB" if peaks[batch] else ""
            print(f"  seq {seq_len}: batch {batch} fits{peak}", file=sys.stderr, flush=True)
        return True

    lo, hi = 0, None  # lo fits (0: nothing yet), hi does not (None: nothing failed yet)
    batch = max(1, min(start or 8, max_batch))
    if fits(batch):
        lo = batch
        while lo < max_batch and hi is None:  # double until something fails
            batch = min(2 * lo, max_batch)
            if fits(batch):
                lo = batch
            else:
                hi = batch
    else:
        hi = batch
        while hi > 1 and lo == 0:  # halve until something fits
            if fits(hi // 2):
                lo = hi // 2
            else:
                hi //= 2
    while hi is not None and hi - lo > 1 and lo > 0:  # binary search between them
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return {"seq_len": seq_len, "max_batch": lo, "peak_bytes": peaks.get(lo), "tried": tried,
            "limited_by": "max_batch" if lo >= max_batch else "memory"}


def device_memory() -> Optional[int]:
    """Total memory of the first accelerator where the backend reports it (JAX: bytes_limit)."""
    if _backend() == "jax":
        import jax

        return (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    return None


def probe_table(model: str, seq_lens, optimizer: str = "adamw", precision: str = "float32",
                memory=None, max_batch: int = 4096, verbose: bool = False) -> List[Dict]:
    """For each sequence length: the planner's max batch for the device memory, the probed max batch,
    and planned vs measured peak memory at the probed batch."""
    import os

    from kbert.models.config import ModelConfig
    from kbert.train.memory import estimate_memory, max_batch_size, parse_memory

    if accelerator() is None and not os.environ.get("KBERT_SIMULATE_OOM_ABOVE"):
        raise ValueError("--probe measures an accelerator and found none (on CPU memory is not the limit); run "
                         "it on a GPU or TPU, or read the planner's table")
    config = ModelConfig.preset(model) if isinstance(model, str) else model
    total = parse_memory(memory) if memory else device_memory()
    trainer = build_trainer(config, optimizer, precision)
    rows = []
    for seq in seq_lens:
        planned = max_batch_size(config, total, seq, optimizer=optimizer, precision=precision) if total else None
        found = probe_batch_size(config, seq, optimizer, precision, start=planned or 8, max_batch=max_batch,
                                 model=trainer, verbose=verbose)
        estimate = estimate_memory(config, found["max_batch"], seq, optimizer=optimizer,
                                   precision=precision)["total"] if found["max_batch"] else None
        measured = found["peak_bytes"]
        rows.append({"seq_len": seq, "planned_batch": planned, "probed_batch": found["max_batch"],
                     "planned_bytes": estimate, "measured_bytes": measured, "limited_by": found["limited_by"],
                     "error": (estimate - measured) / measured if estimate and measured else None,
                     "tried": found["tried"]})
    return rows
