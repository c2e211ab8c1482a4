"""Dynamic masked-LM masking in the TensorFlow graph: token, whole-word and n-gram masking.

Masks are drawn per batch with stateless random ops seeded by `(seed, batch index)`: the same seed gives
the same masks run after run (and after a resume), while every epoch sees new masks because the batch
index keeps growing across epochs. This replaces `create_pretraining_data.py`'s static masks stored
`dupe_factor` times.

Rules (as in BERT / ALBERT):
- candidates are real tokens that are not special tokens ([CLS], [SEP], [PAD], ...): those are never masked;
- masking units are tokens, or with `whole_word=True` whole words: a word is a token that starts a word
  (SentencePiece `▁x`, WordPiece not `##x`; for morpheme-aware tokenizers each morpheme) plus the
  continuation pieces after it; with `ngram=n > 1` runs of 1..n consecutive units, length k drawn with
  probability proportional to 1/k (ALBERT's n-gram masking);
- `round(mask_rate * candidates)` tokens per sequence (at least 1, at most `max_predictions`) are chosen
  by picking units in random order; a unit is taken whole or not at all;
- a chosen token becomes [MASK] 80% of the time, a random regular token 10%, and stays 10%.
"""

from __future__ import annotations

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


def make_spec(tokenizer, mask_rate: float = 0.15, max_predictions: int = 20, whole_word: bool = True,
              ngram: int = 1) -> MaskSpec:
    if not 0.0 < mask_rate < 1.0:
        raise ValueError(f"`mask_rate` must be in (0, 1). Received: mask_rate={mask_rate!r}")
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


def mask_tokens(token_ids, padding_mask, seed, spec: MaskSpec):
    """Masks a batch in the graph.

    Args:
        token_ids: int32 [batch, seq].
        padding_mask: bool or int [batch, seq] (1 for real tokens).
        seed: int [2] stateless seed (e.g. `(seed, batch_index)`).
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
    seeds = tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), 5)
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
        logits = tf.math.log(1.0 / tf.range(1, spec.ngram + 1, dtype=tf.float32))
        lengths = tf.random.stateless_categorical(tf.tile(logits[None], [batch, 1]), length, seeds[0],
                                                  dtype=tf.int32) + 1
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
    score = tf.random.stateless_uniform([batch, length], seeds[1])
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

    r = tf.random.stateless_uniform([batch, length], seeds[2])
    regular = np.array([i for i in range(vocab) if not special_table[i]], np.int32)
    random_tokens = tf.gather(tf.constant(regular), tf.random.stateless_uniform(
        [batch, length], seeds[3], minval=0, maxval=len(regular), dtype=tf.int32))
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
