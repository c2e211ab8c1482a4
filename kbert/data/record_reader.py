"""Pretraining batches from `kbert data prepare` records with numpy only: no TensorFlow in the process.

This is the input of the JAX path (GPUs and TPU VMs, `pip install -e ".[jax]"`), and it gives batches
**bit-identical** to `kbert.data.pretraining_dataset` on the same records, seed and batch size, because both
define every random choice by the same integer hashes instead of by a framework's random-number generator:

1. each pipeline (host) reads `files[pipeline_id::num_pipelines]`; every epoch visits them in the order
   `argsort(hash(seed, epoch, file))`;
2. records are interleaved as `tf.data.Dataset.interleave(cycle_length=min(files, 8), block_length=16)`
   interleaves them (`interleave` below follows its rule for exhausted files);
3. examples are shuffled in consecutive blocks of `shuffle_buffer`, block j by `argsort(hash(seed, j, i))`;
4. batches of `batch_size`; example k of the stream is masked by `mask_tokens` with the key
   `example_keys(stream_seed, k)`, which is `kbert.data.masking`'s hash, ported here operation by operation
   (uint32 wrapping arithmetic, float32 scores, stable sorts where TensorFlow's `top_k` keeps the lower index).

The TFRecord framing and the three-field `tf.train.Example` protos are read by hand (the write side,
`kbert.data.records.serialize_example`, writes them by hand too). Batches are prepared in background threads
(numpy releases the GIL in its kernels) and queued, so the accelerator does not wait; `tests/test_data.py`
checks equality with the TensorFlow pipeline batch by batch.

Why not Grain: its shuffles and interleaves are its own (so equality with the TensorFlow path would be lost),
and the work here is one hash and a handful of numpy ops per batch; a plain thread pool serves.
"""

from __future__ import annotations

import struct
from typing import Dict, Iterator, Optional, Sequence, Tuple

import numpy as np

from kbert.data import records as _records
from kbert.data.masking import MaskSpec, default_max_predictions, regular_token_ids

CYCLE, BLOCK = 8, 16  # interleave: files read at once, records taken from each in turn
_GOLDEN = 0x9E3779B9


# ------------------------------------------------------------------------------------------ hashing
def mix32(x: np.ndarray) -> np.ndarray:
    """murmur3's finalizer on uint32 (wrapping), as `kbert.data.masking.mix32`."""
    x = np.asarray(x, np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        return x ^ (x >> np.uint32(16))


def example_keys(seed: int, index) -> np.ndarray:
    """uint32 [b] keys of int64 example indices [b], as `kbert.data.masking.example_keys`."""
    index = np.asarray(index, np.int64)
    lo = (index & 0xFFFFFFFF).astype(np.uint32)
    hi = (index >> 32).astype(np.uint32)
    with np.errstate(over="ignore"):
        s = np.uint32(int(seed) & 0xFFFFFFFF)
        return mix32(lo ^ mix32(hi + mix32(np.uint32(s + np.uint32(_GOLDEN)))))


def _uniform(keys: np.ndarray, salt: int, length: int) -> np.ndarray:
    """float32 [b, length] in [0, 1) from (key, salt, position), as `kbert.data.masking._uniform`."""
    with np.errstate(over="ignore"):
        row = mix32(keys + np.uint32((salt * 0x632BE5AB) & 0xFFFFFFFF))
        pos = np.arange(length, dtype=np.uint32) * np.uint32(_GOLDEN)
    x = mix32(row[:, None] ^ pos[None, :])
    return (x >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / (1 << 24))


def order(seed: int, salt: int, block: int, n: int) -> np.ndarray:
    """A permutation of range(n) for (seed, salt, block): `argsort(hash(...))`, stable; the TensorFlow
    pipeline computes the same with `kbert.data.masking.order`."""
    with np.errstate(over="ignore"):
        key = mix32(np.uint32(int(seed) & 0xFFFFFFFF) ^ mix32(np.uint32((salt * 0x632BE5AB + block) & 0xFFFFFFFF)))
        values = mix32(key ^ (np.arange(n, dtype=np.uint32) * np.uint32(_GOLDEN)))
    return np.argsort(values, kind="stable")


# ------------------------------------------------------------------------------------------ masking
def mask_tokens(token_ids: np.ndarray, padding_mask: np.ndarray, keys: np.ndarray, spec: MaskSpec):
    """`kbert.data.masking.mask_tokens` in numpy: the same outputs, bit for bit (see that function)."""
    token_ids = np.asarray(token_ids, np.int32)
    batch, length = token_ids.shape
    real = np.asarray(padding_mask).astype(bool)
    special = np.zeros(spec.vocab_size, bool)
    special[list(spec.special_ids)] = True
    candidate = real & ~special[token_ids]
    prev_candidate = np.pad(candidate[:, :-1], [[0, 0], [1, 0]])
    if spec.whole_word:
        unit_start = candidate & (np.asarray(spec.word_start)[token_ids] | ~prev_candidate)
    else:
        unit_start = candidate
    if spec.ngram > 1:
        word_index = np.cumsum(unit_start.astype(np.int32), axis=1) - 1
        weights = 1.0 / np.arange(1, spec.ngram + 1)
        edges = np.cumsum(weights / weights.sum())[:-1].astype(np.float32)
        u = _uniform(keys, 1, length)
        lengths = 1 + np.sum((u[:, :, None] >= edges[None, None, :]).astype(np.int32), axis=-1)
        group_starts = np.cumsum(lengths, axis=1) - lengths  # exclusive
        is_group_start = np.any(word_index[:, :, None] == group_starts[:, None, :], axis=-1)
        unit_start = unit_start & (is_group_start | ~prev_candidate)
    unit_id = np.where(candidate, np.cumsum(unit_start.astype(np.int32), axis=1), 0).astype(np.int32)
    slots = length + 1
    rows = np.repeat(np.arange(batch), length)
    unit_len = np.zeros((batch, slots), np.int32)
    np.add.at(unit_len, (rows, unit_id.ravel()), candidate.ravel().astype(np.int32))
    score = _uniform(keys, 2, length)
    unit_score = np.zeros((batch, slots), np.float32)
    # one start per unit, so the segment sum is that start's score (exact in float32)
    np.add.at(unit_score, (rows, unit_id.ravel()), np.where(unit_start, score, np.float32(0.0)).ravel())
    unit_len[:, 0] = 0
    unit_score = np.where(unit_len > 0, unit_score, np.float32(2.0))
    num_candidates = np.sum(candidate.astype(np.float32), axis=1, dtype=np.float32)
    target = np.clip(np.round(num_candidates * np.float32(spec.mask_rate)), 1.0, float(spec.max_predictions))
    target = target.astype(np.float32)
    sort = np.argsort(unit_score, axis=1, kind="stable")
    sorted_len = np.take_along_axis(unit_len, sort, axis=1).astype(np.float32)
    cum = np.cumsum(sorted_len, axis=1, dtype=np.float32)
    take_sorted = (sorted_len > 0) & (cum - sorted_len / 2 < target[:, None]) & (cum <= spec.max_predictions)
    take_unit = np.take_along_axis(take_sorted, np.argsort(sort, axis=1, kind="stable"), axis=1)
    selected = np.take_along_axis(take_unit, unit_id, axis=1) & candidate

    r = _uniform(keys, 3, length)
    regular = regular_token_ids(spec.vocab_size, spec.special_ids)
    pick = (_uniform(keys, 4, length) * np.float32(len(regular))).astype(np.int32)
    random_tokens = regular[np.minimum(pick, len(regular) - 1)]
    masked = np.where(selected & (r < np.float32(0.8)), spec.mask_id, token_ids)
    masked = np.where(selected & (r >= np.float32(0.8)) & (r < np.float32(0.9)), random_tokens, masked)

    k = spec.max_predictions
    positions = np.arange(length)[None, :]
    key = np.where(selected, length - positions, -1 - positions)
    short = max(k - length, 0)
    key = np.pad(key, [[0, 0], [0, short]], constant_values=-(10 ** 6))
    idx = np.argsort(-key, axis=1, kind="stable")[:, :k]  # top_k: largest first, lower index on ties
    valid = np.pad(selected, [[0, 0], [0, short]])
    weights = np.take_along_axis(valid, idx, axis=1)
    idx = np.minimum(idx, length - 1)
    mask_positions = np.where(weights, idx, 0).astype(np.int32)
    mask_ids = np.where(weights, np.take_along_axis(token_ids, idx, axis=1), 0).astype(np.int32)
    return masked.astype(np.int32), mask_positions, mask_ids, weights.astype(np.float32)


# ------------------------------------------------------------------------------------------ records
def read_records(path: str) -> Iterator[bytes]:
    """The records of a TFRecord file: [uint64 length][uint32 crc][data][uint32 crc] each. The manifest
    already checked the file's size; a cut record is an error naming the file."""
    with open(path, "rb") as f:
        data = f.read()
    at, end = 0, len(data)
    while at < end:
        if at + 12 > end:
            raise ValueError(f"{path}: truncated record header at byte {at}; rerun `kbert data prepare`")
        (n,) = struct.unpack_from("<Q", data, at)
        if at + 12 + n + 4 > end:
            raise ValueError(f"{path}: truncated record at byte {at}; rerun `kbert data prepare`")
        yield data[at + 12:at + 12 + n]
        at += 16 + n


def _varint(buf: bytes, at: int) -> Tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[at]
        at += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, at
        shift += 7


def _fields(buf: bytes):
    """(field number, wire type, value) of a protobuf message: varints as ints, length-delimited as bytes."""
    at, end = 0, len(buf)
    while at < end:
        tag, at = _varint(buf, at)
        wire = tag & 7
        if wire == 0:
            value, at = _varint(buf, at)
        elif wire == 2:
            n, at = _varint(buf, at)
            value, at = buf[at:at + n], at + n
        elif wire == 1:
            value, at = buf[at:at + 8], at + 8
        elif wire == 5:
            value, at = buf[at:at + 4], at + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield tag >> 3, wire, value


def parse_example(record: bytes) -> Tuple[bytes, int, int]:
    """(token id bytes, num_a, pair_label) of one `tf.train.Example` written by `kbert data prepare`."""
    out = {}
    for number, _, features in _fields(record):  # Example.features = 1
        if number != 1:
            continue
        for fnum, _, entry in _fields(features):  # Features.feature = 1 (map entries)
            if fnum != 1:
                continue
            key = value = None
            for enum, _, v in _fields(entry):
                key, value = (v, value) if enum == 1 else (key, v)
            for kind, _, payload in _fields(value or b""):  # Feature: bytes_list = 1, int64_list = 3
                inner = list(_fields(payload))
                if kind == 1:
                    out[key] = b"".join(v for n, _, v in inner if n == 1)
                elif kind == 3:
                    ints = []
                    for n, wire, v in inner:
                        if n == 1 and wire == 2:  # packed
                            at = 0
                            while at < len(v):
                                x, at = _varint(v, at)
                                ints.append(x)
                        elif n == 1:
                            ints.append(v)
                    out[key] = ints[0] if ints else 0
    try:
        return out[b"token_ids"], int(out[b"num_a"]), int(out[b"pair_label"])
    except KeyError as e:
        raise ValueError(f"a record without the feature {e.args[0].decode()!r}: not written by `kbert data "
                         f"prepare`") from None


def interleave(files: Iterator[str], read, cycle: int, block: int) -> Iterator:
    """`tf.data.Dataset.interleave(read, cycle_length=cycle, block_length=block)`'s order: `block` items from
    each of `cycle` open files in turn; a file that runs out is replaced by the next one, which waits for
    its slot's next turn."""
    files = iter(files)

    def opened():
        path = next(files, None)
        return None if path is None else iter(read(path))

    slots = [opened() for _ in range(cycle)]
    i = 0
    while any(s is not None for s in slots):
        it = slots[i]
        if it is not None:
            for _ in range(block):
                item = next(it, None)
                if item is None:
                    slots[i] = opened()
                    break
                yield item
        i = (i + 1) % cycle


def epoch_files(files: Sequence[str], seed: int, shuffle: bool, repeat: bool) -> Iterator[str]:
    """Files in the order each epoch reads them (forever with `repeat`)."""
    epoch = 0
    while True:
        index = order(seed, 5, epoch, len(files)) if shuffle else range(len(files))
        yield from (files[i] for i in index)
        epoch += 1
        if not repeat:
            return


def examples(files: Sequence[str], max_length: int, seed: int, stream_seed: int, shuffle_buffer: int, repeat: bool):
    """(token_ids int32 [max_length] zero-padded, length, num_a, pair_label) per example, in stream order:
    files ordered by `seed`, examples shuffled by `stream_seed` (the pipeline's own)."""
    def read(path):
        for record in read_records(path):
            raw, num_a, label = parse_example(record)
            ids = np.zeros(max_length, np.int32)
            values = np.frombuffer(raw, "<i4")
            ids[:len(values)] = values[:max_length]
            yield ids, len(values), num_a, label

    stream = interleave(epoch_files(files, seed, bool(shuffle_buffer), repeat), read, min(len(files), CYCLE), BLOCK)
    if not shuffle_buffer:
        yield from stream
        return
    block = 0
    while True:
        chunk = [x for _, x in zip(range(shuffle_buffer), stream)]
        if not chunk:
            return
        for i in order(stream_seed, 6, block, len(chunk)):
            yield chunk[i]
        block += 1


# ------------------------------------------------------------------------------------------ batches
class RecordBatches:
    """Masked pretraining batches `(features, labels)` of numpy arrays from a records dir, equal to
    `pretraining_dataset(records_dir, tokenizer, ...)`'s; iterate it (batches are prepared by `threads`
    background threads, `prefetch` ahead)."""

    def __init__(self, source: str, tokenizer, batch_size: int = 32, mask_rate: float = 0.15,
                 max_predictions: Optional[int] = None, whole_word: bool = True, ngram: int = 1, seed: int = 0,
                 shuffle_buffer: int = 10_000, repeat: bool = True, start_batch: int = 0,
                 num_pipelines: int = 1, pipeline_id: int = 0, drop_remainder: bool = True,
                 threads: int = 2, prefetch: int = 8):
        from kbert.data.examples import block_seed
        from kbert.data.masking import make_spec

        directory = _records.records_dir(source)
        if directory is None:
            raise ValueError(f"{source!r} is not a records directory (no {_records.MANIFEST}): this reader takes "
                             f"what `kbert data prepare` writes (no TensorFlow needed); `kbert.pretrain` given raw "
                             f"text on JAX without TensorFlow prepares them itself")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"`batch_size` must be a positive integer. Received: batch_size={batch_size!r}")
        manifest, files = _records.shard_files(directory)
        if manifest["tokenizer"] != tokenizer.fingerprint():
            raise ValueError(f"{directory!r} was prepared with another tokenizer (fingerprint {manifest['tokenizer']}, "
                             f"this one is {tokenizer.fingerprint()}); pass the tokenizer used by `kbert data prepare`")
        files = files[pipeline_id::num_pipelines]
        if not files:
            raise ValueError(f"{directory!r} has {len(files)} shards for {num_pipelines} input pipelines; prepare "
                             f"with smaller --docs-per-shard so every host gets a shard")
        self.objective, self.max_length = manifest["objective"], manifest["max_length"]
        if max_predictions is None:
            max_predictions = default_max_predictions(self.max_length, mask_rate)
        if max_predictions > self.max_length:
            raise ValueError(f"`max_predictions` ({max_predictions}) cannot exceed `max_length` ({self.max_length})")
        self.spec = make_spec(tokenizer, mask_rate, max_predictions, whole_word, ngram)
        self.files, self.batch_size, self.seed = files, batch_size, seed
        self.stream_seed = block_seed(seed, 0, pipeline_id)
        self.shuffle_buffer, self.repeat, self.start_batch = shuffle_buffer, repeat, start_batch
        self.drop_remainder, self.threads, self.prefetch = drop_remainder, max(1, threads), max(1, prefetch)
        self.pad_id = tokenizer.pad_id

    def _raw_batches(self):
        """(batch index, example indices, stacked raw fields) in order, from `start_batch` on."""
        stream = examples(self.files, self.max_length, self.seed, self.stream_seed, self.shuffle_buffer, self.repeat)
        b, n = 0, self.batch_size
        while True:
            chunk = [x for _, x in zip(range(n), stream)]
            if not chunk or (len(chunk) < n and self.drop_remainder):
                return
            if b >= self.start_batch:  # skipped batches are read (their order matters) but never masked
                yield b, np.arange(b * n, b * n + len(chunk), dtype=np.int64), chunk
            b += 1

    def finish(self, index: np.ndarray, chunk) -> Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray]]:
        ids = np.stack([c[0] for c in chunk])
        lengths = np.array([c[1] for c in chunk], np.int32)
        num_a = np.array([c[2] for c in chunk], np.int32)
        pair_labels = np.array([c[3] for c in chunk], np.int32)
        positions = np.arange(self.max_length)[None, :]
        real = positions < lengths[:, None]
        ids = np.where(real, ids, self.pad_id).astype(np.int32)
        segment_ids = ((positions >= num_a[:, None]) & real).astype(np.int32)
        masked, mask_positions, mask_ids, mask_weights = mask_tokens(
            ids, real, example_keys(self.stream_seed, index), self.spec)
        features = {"token_ids": masked, "segment_ids": segment_ids, "padding_mask": real.astype(np.int32),
                    "mask_positions": mask_positions}
        labels = {"mask_ids": mask_ids, "mask_weights": mask_weights}
        if self.objective != "mlm":
            labels["pair_labels"] = pair_labels
        return features, labels

    def __iter__(self):
        from concurrent.futures import ThreadPoolExecutor

        from kbert.utils import in_background

        with ThreadPoolExecutor(self.threads, thread_name_prefix="kbert-batches") as pool:
            # batches are read in order in one thread and masked by the pool, `prefetch` ahead
            futures = (pool.submit(self.finish, index, chunk) for _, index, chunk in self._raw_batches())
            for future in in_background(futures, self.prefetch):
                yield future.result()
