"""Synthetic pretraining batches: random token ids of full length, two segments, sorted masked positions.

What builds a model's variables before a checkpoint is restored, what the memory probe and the GPU benchmark
step on (the step's cost without any input pipeline), in the feature layout of `pretraining_dataset`.
Shapes: b = batch, s = sequence length, p = masked positions.
"""

from __future__ import annotations

import numpy as np


def synthetic_batch(config, batch: int, seq_len: int, predictions: int, seed: int = 0):
    """(features, labels) of `batch` random sequences for a model of `config` (its `vocab_size`): ids [b, s]
    from 5 up (no special tokens), every position real, the second half segment 1, `predictions` sorted
    masked positions [b, p] with weight 1, random NSP/SOP labels."""
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
