"""Fault injection for tests: out-of-memory errors without an accelerator.

The training loop and the batch probe call `check_memory(per_replica_batch)` before each step. It does
nothing unless a test installed a hook: `simulate_out_of_memory_above(n)` makes every step whose
per-replica micro-batch exceeds `n` raise the error a real device raises (TensorFlow's
ResourceExhaustedError; XLA's RESOURCE_EXHAUSTED on JAX), and `set_memory_hook(fn)` installs any function of
the batch (e.g. one that fails only from the fourth step on). `set_memory_hook(None)` removes it.

    >>> from kbert.train import faults
    >>> faults.simulate_out_of_memory_above(8)     # this "device" holds 8 sequences
    >>> faults.set_memory_hook(None)
"""

from __future__ import annotations

from typing import Callable, Optional

_HOOK: dict = {"fn": None}


def set_memory_hook(fn: Optional[Callable[[int], None]]) -> None:
    """Installs `fn(per_replica_batch)`, called before every training step (None removes it)."""
    _HOOK["fn"] = fn


def memory_hook() -> Optional[Callable[[int], None]]:
    """The installed hook, or None."""
    return _HOOK["fn"]


def out_of_memory_error(message: str) -> Exception:
    """The error the current backend raises when device memory runs out."""
    import keras

    if keras.backend.backend() != "tensorflow":  # what XLA raises on JAX
        return RuntimeError(f"RESOURCE_EXHAUSTED: {message}")
    import tensorflow as tf

    return tf.errors.ResourceExhaustedError(None, None, message)


def simulate_out_of_memory_above(limit: Optional[int]) -> None:
    """A device that holds `limit` sequences per replica: larger steps raise out-of-memory (None: off)."""
    if limit is None:
        set_memory_hook(None)
        return

    def hook(per_replica_batch: int) -> None:
        if per_replica_batch > limit:
            raise out_of_memory_error(f"simulated OOM: per-replica batch {per_replica_batch} > {limit}")

    set_memory_hook(hook)


def check_memory(per_replica_batch: int) -> None:
    """Called before each step: the installed hook's verdict (nothing without one)."""
    fn = _HOOK["fn"]
    if fn is not None:
        fn(per_replica_batch)
