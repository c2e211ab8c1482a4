"""Quantized sentence vectors: int8 / uint8 (4x smaller than float32) and binary (32x), and search over them.

The formats are sentence-transformers' `quantize_embeddings`, to the byte, so vectors quantized by either
library search alike in the other and in the vector databases that take those formats (Qdrant, Vespa,
usearch, FAISS's binary indexes); the tests check kbert's output against sentence-transformers' own.

- int8 / uint8: each dimension's [min, max] (`ranges`, [2, dim]: from calibration vectors, by default the
  vectors being quantized) cut into 256 buckets; a vector keeps its bucket numbers (int8: minus 128).
  Calibrate on a sample of the corpus and keep the ranges: queries and later documents need the same ones.
- binary / ubinary: one bit per dimension (x > 0), 8 to a byte, most significant bit first (`np.packbits`);
  binary is the same bytes minus 128 as int8.

`quantized_search` scores float queries against a quantized corpus. int8/uint8: the query against each
vector's bucket values (the lower edges, as sentence-transformers; the centres would add the same amount to
every score of a query, so the ranking is the same). Binary: a first pass by Hamming distance between the
query's bits and the corpus' bits (FAISS's binary flat index with `index="faiss"`, else numpy), then the
best `top_k x rescore_multiplier` of each query rescored with the float query against their bits (the
rescoring of sentence-transformers' `semantic_search_faiss`; benchmarks/README.md measures what each
precision keeps of the float vectors' retrieval on Korean question pairs).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from kbert.utils import positive_int

PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")
# corpus rows scored at a time: bounds the dequantized block (int8) and the XOR block (binary)
SEARCH_CHUNK = 8192
QUERY_CHUNK = 256  # queries at a time in numpy's Hamming pass: [256, 8192, words] XOR blocks
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], np.int32)


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"`precision` must be one of {PRECISIONS}. Received: precision={precision!r}")
    return precision


def quantization_ranges(calibration_embeddings) -> np.ndarray:
    """[2, dim]: each dimension's min and max over the calibration vectors ([n, dim], n >= 2)."""
    x = np.asarray(calibration_embeddings, np.float32)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"int8/uint8 ranges need at least two calibration vectors ([n, dim], n >= 2). "
                         f"Received shape {x.shape}: pass `ranges` or `calibration_embeddings` from a "
                         f"representative sample (a few thousand vectors of the corpus)")
    return np.stack([x.min(axis=0), x.max(axis=0)])


def _checked_ranges(ranges, dim: int) -> np.ndarray:
    ranges = np.asarray(ranges, np.float32)
    if ranges.shape != (2, dim):
        raise ValueError(f"`ranges` must have shape (2, {dim}) (each dimension's min and max). "
                         f"Received shape {ranges.shape}")
    return ranges


def _steps(ranges: np.ndarray) -> np.ndarray:
    steps = (ranges[1] - ranges[0]) / 255
    return np.where(steps == 0, 1, steps)  # a constant dimension: every vector in bucket 0


def quantize_embeddings(embeddings, precision: str, ranges=None, calibration_embeddings=None) -> np.ndarray:
    """`embeddings` ([n, dim] or [dim], float) in `precision` (one of `PRECISIONS`), as sentence-transformers'
    `quantize_embeddings` writes them: int8/uint8 [n, dim] bucket numbers over `ranges` ([2, dim] min and max;
    default: from `calibration_embeddings`, else from `embeddings` themselves, which needs two vectors or
    more), binary (int8) / ubinary (uint8) [n, ceil(dim / 8)] packed sign bits.

    Example:
        >>> ranges = kbert.quantization_ranges(emb.encode(sample))       # keep these for queries and new texts
        >>> codes = kbert.quantize_embeddings(emb.encode(corpus), "int8", ranges=ranges)
    """
    check_precision(precision)
    x = np.asarray(embeddings)
    if x.dtype.kind in "iub":
        raise ValueError(f"`embeddings` must be float vectors to quantize. Received dtype {x.dtype} (already "
                         f"quantized?)")
    if x.ndim not in (1, 2):
        raise ValueError(f"`embeddings` must be [n, dim] or [dim]. Received shape {x.shape}")
    single = x.ndim == 1
    x = np.atleast_2d(x).astype(np.float32, copy=False)
    if precision == "float32":
        out = x.astype(np.float32)
    elif precision in ("int8", "uint8"):
        if ranges is None:
            ranges = quantization_ranges(x if calibration_embeddings is None else calibration_embeddings)
        ranges = _checked_ranges(ranges, x.shape[1])
        buckets = np.clip(np.floor((x - ranges[0]) / _steps(ranges)), 0, 255)
        out = buckets.astype(np.uint8) if precision == "uint8" else (buckets - 128).astype(np.int8)
    else:
        packed = np.packbits(x > 0, axis=-1)  # [n, ceil(dim / 8)]
        out = packed if precision == "ubinary" else (packed.astype(np.int16) - 128).astype(np.int8)
    return out[0] if single else out


def _unsigned_bits(codes: np.ndarray) -> np.ndarray:
    """binary (int8) or ubinary (uint8) codes as the packed uint8 bytes."""
    return (codes.astype(np.int16) + 128).astype(np.uint8) if codes.dtype == np.int8 else codes.astype(np.uint8)


def dequantize_embeddings(codes, precision: str, ranges=None, dim: Optional[int] = None) -> np.ndarray:
    """float32 vectors standing for quantized ones: int8/uint8 each bucket's lower edge over `ranges` (the
    ones they were quantized with); binary/ubinary the bits as 0/1, the first `dim` of them (default: every
    bit, a multiple of 8)."""
    check_precision(precision)
    codes = np.atleast_2d(np.asarray(codes))
    if precision == "float32":
        return codes.astype(np.float32)
    if precision in ("int8", "uint8"):
        if ranges is None:
            raise ValueError(f"{precision} vectors need the `ranges` they were quantized with to be scored")
        ranges = _checked_ranges(ranges, codes.shape[1])
        buckets = codes.astype(np.float32) + (128 if precision == "int8" else 0)
        return buckets * _steps(ranges) + ranges[0]
    bits = np.unpackbits(_unsigned_bits(codes), axis=-1)
    return bits[:, :dim].astype(np.float32) if dim else bits.astype(np.float32)


def infer_precision(codes: np.ndarray, dim: int) -> str:
    """The precision of a quantized corpus from its dtype and width against the float vectors' `dim`:
    int8/uint8 keep `dim` columns, binary/ubinary ceil(dim / 8)."""
    width = codes.shape[-1]
    if codes.dtype.kind == "f":
        return "float32"
    if codes.dtype not in (np.int8, np.uint8):
        raise ValueError(f"a quantized corpus is int8 or uint8. Received dtype {codes.dtype}")
    signed = codes.dtype == np.int8
    if width == dim:
        return "int8" if signed else "uint8"
    if width == (dim + 7) // 8:
        return "binary" if signed else "ubinary"
    raise ValueError(f"a quantized corpus of {dim}-wide vectors has {dim} columns (int8/uint8) or "
                     f"{(dim + 7) // 8} (binary/ubinary). Received {width}")


def _merge_best(best: Optional[Tuple[np.ndarray, np.ndarray]], scores: np.ndarray, offset: int, k: int):
    """The running `k` best (scores, columns) per row after a block of `scores` whose columns start at
    `offset`; ties keep the lower column. A partial sort picks each row's `k` first; a row whose `k`-th score
    ties one left out (the partial sort orders ties arbitrarily) is sorted in full."""
    columns = np.broadcast_to(np.arange(offset, offset + scores.shape[1]), scores.shape)
    rows = np.arange(scores.shape[0])[:, None]
    if scores.shape[1] > k:
        part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        cut = scores[rows, part].min(axis=1)
        tied = np.flatnonzero((scores >= cut[:, None]).sum(axis=1) > k)
        picked_scores, picked_columns = scores[rows, part], columns[rows, part]
        for i in tied:
            full = np.lexsort((columns[i], -scores[i]))[:k]
            picked_scores[i], picked_columns[i] = scores[i, full], columns[i, full]
        scores, columns = picked_scores, picked_columns
    if best is not None:
        scores = np.concatenate([best[0], scores], axis=1)
        columns = np.concatenate([best[1], columns], axis=1)
    order = np.lexsort((columns, -scores), axis=-1)[:, :k]
    return scores[rows, order], columns[rows, order]


def _hamming_candidates(query_bits: np.ndarray, corpus_bits: np.ndarray, k: int, index: str):
    """Each query's `k` nearest corpus rows by Hamming distance: [nq, k] columns, best first (ties by
    column)."""
    if index == "faiss":
        try:
            import faiss
        except ImportError:
            raise ImportError("index='faiss' needs FAISS: pip install faiss-cpu") from None
        flat = faiss.IndexBinaryFlat(corpus_bits.shape[1] * 8)
        flat.add(np.ascontiguousarray(corpus_bits))
        _, columns = flat.search(np.ascontiguousarray(query_bits), k)
        return columns
    words_q, words_c = _words(query_bits), _words(corpus_bits)
    out = []
    for first in range(0, words_q.shape[0], QUERY_CHUNK):
        queries, best = words_q[first:first + QUERY_CHUNK], None
        for start in range(0, words_c.shape[0], SEARCH_CHUNK):
            block = words_c[start:start + SEARCH_CHUNK]
            distance = _popcount(queries[:, None, :] ^ block[None, :, :]).sum(axis=-1)  # [queries, block]
            # one key per row: the distance, then the column (Hamming distances tie often); exact in float64
            key = distance.astype(np.float64) * words_c.shape[0] + np.arange(start, start + block.shape[0])
            best = _merge_best(best, -key, start, k)
        out.append(best[1])
    return np.concatenate(out)


def _words(bits: np.ndarray) -> np.ndarray:
    """Packed bits as 64-bit words (zero bytes appended to a multiple of 8) where numpy counts bits in words
    (`np.bitwise_count`, numpy 2), else the bytes as they are."""
    if not hasattr(np, "bitwise_count"):
        return bits
    pad = (-bits.shape[1]) % 8
    return np.ascontiguousarray(np.pad(bits, ((0, 0), (0, pad))) if pad else bits).view(np.uint64)


def _popcount(x: np.ndarray) -> np.ndarray:
    return np.bitwise_count(x) if hasattr(np, "bitwise_count") else _POPCOUNT[x]


def quantized_search(queries, corpus, top_k: int = 5, precision: Optional[str] = None, ranges=None,
                     rescore_multiplier: int = 4, index: str = "exact") -> List[List[Tuple[int, float]]]:
    """For each float query ([nq, dim], unit vectors for cosines), the `top_k` best `(corpus row, score)` of
    a quantized corpus, best first. `precision`: the corpus' (default: from its dtype and width,
    `infer_precision`). int8/uint8 need the `ranges` the corpus was quantized with; scores are the query's dot
    product with the dequantized vectors. binary/ubinary: Hamming distance picks `top_k x rescore_multiplier`
    candidates, which are rescored as the float query's dot product with their 0/1 bits
    (`rescore_multiplier=0`: no rescoring; the score is then the share of bits that agree)."""
    top_k = positive_int(top_k, "top_k")
    q = np.atleast_2d(np.asarray(queries, np.float32))
    corpus = np.asarray(corpus)
    if corpus.ndim == 2 and corpus.shape[0] == 0:  # nothing to find: no hits, as a search over no texts
        return [[] for _ in range(q.shape[0] if q.size else 0)]
    corpus = np.atleast_2d(corpus)
    looks = infer_precision(corpus, q.shape[1])
    precision = check_precision(precision or looks)
    if looks != precision:
        raise ValueError(f"corpus of dtype {corpus.dtype} and width {corpus.shape[1]} is not {precision} for "
                         f"{q.shape[1]}-wide queries (it looks like {looks})")
    if looks == "float32" and corpus.shape[1] != q.shape[1]:
        raise ValueError(f"the queries are {q.shape[1]}-wide vectors and the corpus' {corpus.shape[1]}-wide: "
                         f"encode both with the same model (and `truncate_dim`)")
    if isinstance(rescore_multiplier, bool) or not isinstance(rescore_multiplier, int) or rescore_multiplier < 0:
        raise ValueError(f"`rescore_multiplier` must be a whole number >= 0. Received: {rescore_multiplier!r}")
    if index not in ("exact", "faiss"):
        raise ValueError(f"`index` must be 'exact' or 'faiss'. Received: index={index!r}")
    k = min(top_k, corpus.shape[0])
    if precision in ("float32", "int8", "uint8"):
        if index == "faiss" and precision != "float32":
            raise ValueError("int8/uint8 corpora are scored exactly (numpy); index='faiss' is for float32 and "
                             "binary ones")
        best = None
        for start in range(0, corpus.shape[0], SEARCH_CHUNK):
            block = dequantize_embeddings(corpus[start:start + SEARCH_CHUNK], precision, ranges)
            best = _merge_best(best, q @ block.T, start, k)
        scores, columns = best
    else:
        bits = _unsigned_bits(corpus)
        first = min(corpus.shape[0], k * max(1, rescore_multiplier))
        q_bits = quantize_embeddings(q, "ubinary")
        columns = _hamming_candidates(q_bits, bits, first, index)
        if rescore_multiplier:
            unpacked = np.unpackbits(bits[columns], axis=-1)[..., :q.shape[1]].astype(np.float32)  # [nq, m, dim]
            scores = np.einsum("qd,qmd->qm", q, unpacked)
        else:
            differ = _POPCOUNT[q_bits[:, None, :] ^ bits[columns]].sum(axis=-1)
            scores = 1 - differ.astype(np.float32) / q.shape[1]
        order = np.lexsort((columns, -scores), axis=-1)[:, :k]
        rows = np.arange(q.shape[0])[:, None]
        scores, columns = scores[rows, order], columns[rows, order]
    return [[(int(j), float(s)) for j, s in zip(cols, vals)] for cols, vals in zip(columns, scores)]
