"""Dynamic masked-LM masking in the TensorFlow graph: token, whole-word and n-gram masking.

Masks are a pure function of `(seed, example index in the stream, position)`, computed with a counter-based
integer hash in the graph: the same seed gives the same masks run after run, after a resume, and whatever the
batch size or the number of replicas the stream is split over, while every epoch sees new masks because the
example index keeps growing across epochs. This replaces `create_pretraining_data.py`'s static masks stored
`dupe_factor` times.

Rules (as in BERT / ALBERT):
- candidates are real tokens that are not special tokens ([CLS], [SEP], [PAD], ...): those are never masked;
- masking units are tokens, or with `whole_word=True` whole words: a word is a token that starts a word
  (SentencePiece `▁x`, WordPiece not `##x`; so an eojeol, also for morpheme-aware SentencePiece
  vocabularies, whose continuing morphemes carry no `▁`) plus the continuation pieces after it; with `ngram=n > 1` runs of 1..n consecutive units, length k drawn with
  probability proportional to 1/k (ALBERT's n-gram masking);
- `round(mask_rate * candidates)` tokens per sequence (at least 1, at most `max_predictions`) are chosen
  by picking units in random order; a unit is taken whole or not at all;
- a chosen token becomes [MASK] 80% of the time, a random regular token 10%, and stays 10%.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np


class MaskSpec(NamedTuple):
    mask_rate: float
    max_predictions: int
    whole_word: bool
    ngram: int
    mask_id: int
    special_ids: tuple
    word_start: np.ndarray  # bool [vocab]
    vocab_size: int


def check_mask_rate(mask_rate, name: str = "mask_rate") -> float:
    """`mask_rate` if it is a fraction in (0, 1) (NaN is not), else a ValueError naming `name`."""
    if isinstance(mask_rate, bool) or not isinstance(mask_rate, numbers.Real) or not 0.0 < mask_rate < 1.0:
        raise ValueError(f"`{name}` must be in (0, 1). Received: {name}={mask_rate!r}")
    return float(mask_rate)


def default_max_predictions(max_length: int, mask_rate: float = 0.15) -> int:
    """round(max_length * mask_rate) + 1 (20 for 128, as in the BERT recipe)."""
    return int(round(max_length * check_mask_rate(mask_rate))) + 1


def regular_token_ids(vocab_size: int, special_ids) -> np.ndarray:
    """int32 ids of every token that is not special (what random replacements are drawn from)."""
    special = set(special_ids)
    return np.array([i for i in range(vocab_size) if i not in special], np.int32)


def make_spec(tokenizer, mask_rate: float = 0.15, max_predictions: int = 20, whole_word: bool = True,
              ngram: int = 1) -> MaskSpec:
    mask_rate = check_mask_rate(mask_rate)
    if not isinstance(max_predictions, int) or max_predictions < 1:
        raise ValueError(f"`max_predictions` must be a positive integer. Received: max_predictions={max_predictions!r}")
    if ngram not in (1, 2, 3):
        raise ValueError(f"`ngram` must be 1, 2 or 3. Received: ngram={ngram!r}")
    return MaskSpec(mask_rate, max_predictions, bool(whole_word), ngram, tokenizer.mask_id,
                    tuple(sorted(set(tokenizer.special_ids.values()))), tokenizer.word_start_table(),
                    tokenizer.vocab_size)


def _batch_gather(params, indices):
    import tensorflow as tf

    return tf.gather(params, indices, batch_dims=1)


def mix32(x):
    """murmur3-style finalizer on uint32 (wrapping arithmetic)."""
    import tensorflow as tf

    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(16, tf.uint32)))
    x = x * tf.constant(0x7FEB352D, tf.uint32)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(15, tf.uint32)))
    x = x * tf.constant(0x846CA68B, tf.uint32)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(16, tf.uint32)))


def example_keys(seed: int, index):
    """uint32 [b] keys from a python seed and int64 example indices [b]."""
    import tensorflow as tf

    index = tf.cast(index, tf.int64)
    lo = tf.cast(tf.bitwise.bitwise_and(index, 0xFFFFFFFF), tf.uint32)
    hi = tf.cast(tf.bitwise.right_shift(index, 32), tf.uint32)
    s = tf.constant(int(seed) & 0xFFFFFFFF, tf.uint32)
    return mix32(tf.bitwise.bitwise_xor(lo, mix32(hi + mix32(s + tf.constant(0x9E3779B9, tf.uint32)))))


def order(seed: int, salt: int, block, n):
    """int32 [n]: a permutation of range(n) for (seed, salt, block) (`block` a scalar int64 tensor),
    `argsort(hash(...))`, stable; `kbert.data.record_reader.order` is the same in numpy."""
    import tensorflow as tf

    block = tf.cast(tf.bitwise.bitwise_and(tf.cast(block, tf.int64) + (salt * 0x632BE5AB), 0xFFFFFFFF), tf.uint32)
    key = mix32(tf.bitwise.bitwise_xor(tf.constant(int(seed) & 0xFFFFFFFF, tf.uint32), mix32(block)))
    values = mix32(tf.bitwise.bitwise_xor(key, tf.cast(tf.range(n), tf.uint32) * tf.constant(0x9E3779B9, tf.uint32)))
    return tf.argsort(tf.cast(values, tf.int64), stable=True)


def _uniform(keys, salt: int, length):
    """float32 [b, length] in [0, 1): a hash of (key, salt, position)."""
    import tensorflow as tf

    row = mix32(keys + tf.constant((salt * 0x632BE5AB) & 0xFFFFFFFF, tf.uint32))
    pos = tf.cast(tf.range(length), tf.uint32) * tf.constant(0x9E3779B9, tf.uint32)
    x = mix32(tf.bitwise.bitwise_xor(row[:, None], pos[None, :]))
    return tf.cast(tf.bitwise.right_shift(x, tf.constant(8, tf.uint32)), tf.float32) * (1.0 / (1 << 24))


def mask_tokens(token_ids, padding_mask, keys, spec: MaskSpec):
    """Masks a batch in the graph.

    Args:
        token_ids: int32 [batch, seq].
        padding_mask: bool or int [batch, seq] (1 for real tokens).
        keys: uint32 [batch] per-example keys (`example_keys(seed, example_index)`).
        spec: from `make_spec`.

    Returns:
        (masked_token_ids [batch, seq], mask_positions [batch, p], mask_ids [batch, p],
        mask_weights float32 [batch, p]) with p = max_predictions; unused slots have position 0, id 0,
        weight 0; positions are in increasing order.
    """
    import tensorflow as tf

    token_ids = tf.convert_to_tensor(token_ids, tf.int32)
    shape = tf.shape(token_ids)
    batch, length = shape[0], shape[1]
    real = tf.cast(padding_mask, tf.bool)
    vocab = spec.vocab_size
    special_table = np.zeros(vocab, bool)
    special_table[list(spec.special_ids)] = True
    candidate = real & ~tf.gather(tf.constant(special_table), token_ids)
    prev_candidate = tf.pad(candidate[:, :-1], [[0, 0], [1, 0]])
    if spec.whole_word:
        starts = tf.gather(tf.constant(spec.word_start), token_ids)
        unit_start = candidate & (starts | ~prev_candidate)
    else:
        unit_start = candidate
    if spec.ngram > 1:  # group consecutive units into n-grams of length k ~ 1/k
        word_index = tf.cumsum(tf.cast(unit_start, tf.int32), axis=1) - 1
        weights = 1.0 / np.arange(1, spec.ngram + 1)
        edges = np.cumsum(weights / weights.sum())[:-1].astype(np.float32)  # P(k) proportional to 1/k
        u = _uniform(keys, 1, length)
        lengths = 1 + tf.reduce_sum(tf.cast(u[:, :, None] >= tf.constant(edges)[None, None, :], tf.int32), axis=-1)
        group_starts = tf.cumsum(lengths, axis=1, exclusive=True)  # [batch, seq] word indices
        is_group_start = tf.reduce_any(tf.equal(word_index[:, :, None], group_starts[:, None, :]), axis=-1)
        # a group also starts after any non-candidate token (units never span [SEP])
        unit_start = unit_start & (is_group_start | ~prev_candidate)
    # unit id per token: 1..num_units for candidates, 0 for everything else
    unit_id = tf.where(candidate, tf.cumsum(tf.cast(unit_start, tf.int32), axis=1), 0)
    slots = length + 1
    flat = unit_id + tf.range(batch)[:, None] * slots
    unit_len = tf.reshape(tf.math.unsorted_segment_sum(tf.cast(candidate, tf.int32), flat, batch * slots),
                          [batch, slots])
    score = _uniform(keys, 2, length)
    unit_score = tf.reshape(tf.math.unsorted_segment_sum(tf.where(unit_start, score, 0.0), flat, batch * slots),
                            [batch, slots])
    unit_len = tf.concat([tf.zeros([batch, 1], tf.int32), unit_len[:, 1:]], axis=1)  # slot 0: no unit
    unit_score = tf.where(unit_len > 0, unit_score, 2.0)
    num_candidates = tf.reduce_sum(tf.cast(candidate, tf.float32), axis=1)
    target = tf.clip_by_value(tf.round(num_candidates * spec.mask_rate), 1.0, float(spec.max_predictions))
    order = tf.argsort(unit_score, axis=1)
    sorted_len = tf.cast(_batch_gather(unit_len, order), tf.float32)
    cum = tf.cumsum(sorted_len, axis=1)
    # take a unit while the running total at its middle is below the target (unbiased for whole words),
    # never exceeding max_predictions
    take_sorted = (sorted_len > 0) & (cum - sorted_len / 2 < target[:, None]) & (cum <= spec.max_predictions)
    take_unit = _batch_gather(take_sorted, tf.argsort(order, axis=1))
    selected = _batch_gather(take_unit, unit_id) & candidate

    r = _uniform(keys, 3, length)
    regular = regular_token_ids(vocab, spec.special_ids)
    pick = tf.cast(_uniform(keys, 4, length) * len(regular), tf.int32)
    random_tokens = tf.gather(tf.constant(regular), tf.minimum(pick, len(regular) - 1))
    masked = tf.where(selected & (r < 0.8), spec.mask_id, token_ids)
    masked = tf.where(selected & (r >= 0.8) & (r < 0.9), random_tokens, masked)

    k = spec.max_predictions
    positions = tf.range(length)[None, :]
    key = tf.where(selected, length - positions, -1 - positions)
    if_short = tf.maximum(k - length, 0)  # max_predictions larger than the sequence: pad the slots
    key = tf.pad(key, [[0, 0], [0, if_short]], constant_values=-(10 ** 6))
    _, idx = tf.math.top_k(key, k=k, sorted=True)
    valid = tf.pad(selected, [[0, 0], [0, if_short]])
    weights = _batch_gather(valid, idx)
    idx = tf.minimum(idx, length - 1)
    mask_positions = tf.where(weights, idx, 0)
    mask_ids = tf.where(weights, _batch_gather(token_ids, idx), 0)
    return masked, mask_positions, mask_ids, tf.cast(weights, tf.float32)
