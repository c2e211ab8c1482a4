"""Model inputs from tokenized text, shared by fine-tuning (`kbert.train.finetune`) and prediction
(`kbert.embed.task_model.TaskModel`), so training and serving build the same feature dicts.

Shapes: b = batch, s = padded length (a multiple of 8, so few distinct shapes reach the compiler).
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from kbert.utils import unit_rows


def text_list(texts) -> list:
    """`texts` as a list of str/bytes (one string becomes a list of one), or a TypeError naming what was
    passed."""
    if isinstance(texts, (str, bytes)):
        return [texts]
    if texts is None or isinstance(texts, (int, float, dict)) or not hasattr(texts, "__iter__"):
        raise TypeError(f"Expected a string or a list of strings. Received: {type(texts).__name__}")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, (str, bytes)):
            raise TypeError(f"Expected a string or a list of strings; item {i} is {type(t).__name__}")
    return texts


def str_list(texts) -> List[str]:
    """`text_list` with bytes decoded as UTF-8: the texts as `str`."""
    return [t.decode("utf-8") if isinstance(t, bytes) else t for t in text_list(texts)]


def pad(lists, pad_id: int, width: Optional[int] = None) -> np.ndarray:
    """Lists of ids -> int32 `[b, s]`, padded with `pad_id` to `width` (default: the longest) rounded up to
    a multiple of 8."""
    width = width or max(len(x) for x in lists)
    width = -(-width // 8) * 8
    out = np.full((len(lists), width), pad_id, np.int32)
    for i, x in enumerate(lists):
        out[i, :len(x)] = x
    return out


# XLA-compiled inference shapes [rows, width]: a batch's rows and width round up to these (beyond them:
# exact), so the compilations stay few; steps of about 1.5x keep the padding they add near a fifth at most
WIDTH_BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def bucket(n: int, buckets) -> int:
    """The smallest bucket holding `n` (beyond the last: `n` itself)."""
    for b in buckets:
        if n <= b:
            return b
    return n


def bucketed(x: np.ndarray, value, limit: int, rows: bool = False) -> np.ndarray:
    """`x` `[b, s, ...]` padded with `value` along s to the smallest width bucket (at most `limit`, the
    model's positions, unless s is already past it) and, with `rows`, along b to the row bucket: the few
    shapes a backend that compiles every shape (JAX) then sees. Masked columns change no real output; extra
    rows do in a loss, so training batches pad the width only."""
    x = np.asarray(x)
    width = max(min(bucket(x.shape[1], WIDTH_BUCKETS), limit), x.shape[1])
    pads = [(0, bucket(len(x), ROW_BUCKETS) - len(x) if rows else 0), (0, width - x.shape[1])]
    return np.pad(x, pads + [(0, 0)] * (x.ndim - 2), constant_values=value)


def bucketed_features(feats: dict, y, pad_id: int, limit: int, label_pad=None):
    """A training batch (`features(...)` plus any other inputs, labels) at its width bucket (`bucketed`): ids
    with `pad_id`, segments and mask with 0; labels per token `[b, s]` (tagging) with `label_pad`, other
    labels and inputs (masked positions, ...) as they are."""
    out = dict(feats)
    for key in ("token_ids", "segment_ids", "padding_mask"):
        out[key] = bucketed(feats[key], pad_id if key == "token_ids" else 0, limit)
    if label_pad is not None:
        y = bucketed(y, label_pad, limit)
    return out, y


PACK_WHEN = 0.8  # a batch runs as packed rows when that needs at most this share of its rows
PACK_WIDTH = 64  # XLA: a batch holding this many tokens packs into rows of at least this width
# XLA: the texts a packed row holds, rounded up (a classifier reads each text's [CLS] from its slot): a few
# coarse steps, since every slot count is another compiled shape and an empty slot costs only one position
# of the last block and the head
SLOT_BUCKETS = (2, 4, 8, 16, 32, 64, 128, 256, 512)


def packed_width(lengths, limit: int) -> int:
    """The row width XLA packs texts of `lengths` into: the longest one's width bucket, and at least
    PACK_WIDTH when the batch holds that many tokens (a batch of short texts then has one width whatever its
    longest text, so the compiled shapes stay few); at most `limit` (the model's positions) unless a text is
    longer."""
    longest = max(lengths)
    return max(min(bucket(max(longest, min(sum(lengths), PACK_WIDTH)), WIDTH_BUCKETS), limit), longest)


def pack_rows(lengths, width: int) -> List[List[int]]:
    """Packs texts of `lengths` (each <= `width`) into rows of `width` tokens, several short texts per row:
    best fit, longest first (each row starts with the longest text left, then takes the longest that
    still fits, until none does). Returns the rows as lists of indices into `lengths`. O(n log n) plus
    list moves in C.

    Why: a server's batch of mixed lengths padded to its longest is mostly padding when most requests are
    short; packed rows hold little of it (`Backbone.packed_hidden_states` keeps the texts apart)."""
    import bisect

    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    sizes = [lengths[i] for i in order]
    if sizes and sizes[-1] > width:
        raise ValueError(f"a text of {sizes[-1]} tokens does not fit a row of {width}")
    rows = []
    while order:
        row, room = [order.pop()], width - sizes.pop()
        while order:
            j = bisect.bisect_right(sizes, room) - 1
            if j < 0:
                break
            row.append(order.pop(j))
            room -= sizes.pop(j)
        rows.append(row)
    return rows


def segment_ids(ids, sep_id: int) -> List[int]:
    """0 up to and including the first [SEP], 1 after it (the second text of a pair)."""
    first = ids.index(sep_id) if sep_id in ids else len(ids) - 1
    return [0] * (first + 1) + [1] * (len(ids) - first - 1)


def features(ids: np.ndarray, segments: np.ndarray, pad_id: int) -> dict:
    """`[b, s]` ids and segment ids -> the backbone's inputs (`token_ids`, `segment_ids`, `padding_mask`) as
    int32 arrays (what either backend's compiled functions take); position 0 is never masked, so an empty text
    still attends to its [CLS]."""
    ids = np.asarray(ids, np.int32)
    return {"token_ids": ids, "segment_ids": np.asarray(segments, np.int32),
            "padding_mask": ((ids != pad_id) | (np.arange(ids.shape[1]) == 0)).astype(np.int32)}


def word_spans(text: str):
    """(start, end) of each whitespace-separated word of `text`."""
    spans, start = [], None
    for j, ch in enumerate(text + " "):
        if ch == " ":
            if start is not None:
                spans.append((start, j))
                start = None
        elif start is None:
            start = j
    return spans


def first_pieces(enc) -> List[Optional[int]]:
    """For each whitespace word of `enc.normalized`, the index of its first token (None when truncation cut
    the word off)."""
    out = []
    for s, e in word_spans(enc.normalized):
        out.append(next((t for t, (a, b) in enumerate(enc.offsets) if b > a and a < e and b > s and t > 0), None))
    return out


def vectors_in_batches(call, id_lists, pad_id: int, batch_size: int) -> np.ndarray:
    """`call(ids, segments)` over `id_lists` in batches of `batch_size`, concatenated (`[n, h]`)."""
    vectors = []
    for start in range(0, len(id_lists), batch_size):
        ids = pad(id_lists[start:start + batch_size], pad_id)
        vectors.append(call(ids, np.zeros_like(ids)))
    return np.concatenate(vectors) if vectors else np.zeros((0, 0), np.float32)


def unit_vectors_in_batches(call, id_lists, pad_id: int, batch_size: int) -> np.ndarray:
    """`vectors_in_batches` with rows scaled to unit length."""
    return unit_rows(vectors_in_batches(call, id_lists, pad_id, batch_size))


def build_network(network, tokenizer) -> None:
    """Builds a task network's weights (`kbert.models.tasks.TaskNetwork`) with one two-token input."""
    ids = np.array([[tokenizer.cls_id, tokenizer.sep_id]], np.int32)
    network(features(ids, np.zeros_like(ids), tokenizer.pad_id))
