"""Token embeddings from corpus co-occurrence statistics, to start pretraining from (`trainer.embedding_init`).

Masked-LM pretraining on little compute spends its first thousands of updates predicting tokens by their
frequency; while it ignores the context, the input embeddings get almost no gradient and stay random. A
classic count-based word-vector method gives them meaning in about a minute on two cores instead:

1. the pretraining text is tokenized (at most `max_tokens` tokens, read in corpus order);
2. token pairs within `window` positions of each other in one line are counted, weighted 1/distance;
3. the counts become positive pointwise mutual information, with the context distribution smoothed by
   `alpha` = 0.75 (Levy, Goldberg and Dagan 2015: "Improving distributional similarity with lessons learned
   from word embeddings");
4. a randomized truncated SVD (Halko, Martinsson and Tropp 2011) of the sparse PPMI matrix gives
   `U * sqrt(S)` as the embedding table. Tokens never seen (special tokens, unused pieces) keep a random
   normal row of the model's `initializer_range`.

The result is deterministic for a seed. What it buys is measured in benchmarks/README.md.
"""

from __future__ import annotations

import itertools
import time
from typing import Iterable, Iterator

import numpy as np

from kbert.utils import progress_bar

DEFAULT_MAX_TOKENS = 20_000_000


def token_lines(source, tokenizer, max_tokens: int = DEFAULT_MAX_TOKENS, progress: bool = True,
                chunk: int = 4096) -> Iterator[np.ndarray]:
    """Token ids (without special tokens) of each sentence of a raw-text `source`, until `max_tokens`."""
    from kbert.data.corpus import Corpus

    sentences = (source if isinstance(source, Corpus) else Corpus(source)).texts()  # normalized
    seen = 0
    bar = progress_bar(total=max_tokens, desc="co-occurrence: tokenizing", unit="tok", enabled=progress)
    try:
        while seen < max_tokens:
            batch = list(itertools.islice(sentences, chunk))
            if not batch:  # the text ran out before the cap: end the bar at 100%, not at a sliver of the cap
                bar.total = seen
                bar.refresh()
                return
            for ids in tokenizer.ids_batch(batch, normalized=True):
                ids = np.asarray(ids[:max_tokens - seen], dtype=np.int64)
                seen += ids.size
                bar.update(ids.size)
                yield ids
                if seen >= max_tokens:
                    return
    finally:
        bar.close()


def ppmi_matrix(lines: Iterable[np.ndarray], vocab_size: int, window: int = 5, alpha: float = 0.75):
    """(rows, cols, values) of the positive PMI matrix of tokens within `window` of each other in a line."""
    arrays = [a for a in lines if a.size]
    if not arrays:
        raise ValueError("embedding_init='cooccurrence' found no tokens in `data.source`")
    tokens = np.concatenate(arrays)
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(f"token ids outside [0, {vocab_size}): the tokenizer does not match the model")
    line = np.repeat(np.arange(len(arrays)), [a.size for a in arrays])
    keys, weights = [], []
    for d in range(1, window + 1):
        same = line[:-d] == line[d:]
        left, right = tokens[:-d][same], tokens[d:][same]
        for k in (left * vocab_size + right, right * vocab_size + left):  # both directions: symmetric counts
            u, counts = np.unique(k, return_counts=True)
            keys.append(u)
            weights.append(counts / d)
    keys = np.concatenate(keys)
    weights = np.concatenate(weights)
    keys, inverse = np.unique(keys, return_inverse=True)
    counts = np.bincount(inverse, weights=weights)
    rows, cols = keys // vocab_size, keys % vocab_size
    row_sums = np.bincount(rows, weights=counts, minlength=vocab_size)
    smoothed = np.bincount(cols, weights=counts, minlength=vocab_size) ** alpha
    total = counts.sum()
    context = smoothed / smoothed.sum() * total
    pmi = np.log(counts) + np.log(total) - np.log(row_sums[rows]) - np.log(context[cols])
    keep = pmi > 0
    return rows[keep], cols[keep], pmi[keep].astype(np.float32), row_sums


def randomized_svd(rows, cols, values, shape, rank: int, oversample: int = 10, iterations: int = 4, seed: int = 0):
    """U[:, :rank], S[:rank] of a sparse matrix given as coordinates. scipy.sparse does the sparse products
    and numpy the QR and SVD: no TensorFlow, so a JAX-only host starts from these embeddings too (and it is
    faster than TensorFlow's sparse matmul was here: benchmarks/README.md)."""
    import scipy.sparse

    matrix = scipy.sparse.csr_matrix((values, (rows, cols)), shape=shape, dtype=np.float32)
    transposed = matrix.T.tocsr()
    k = min(rank + oversample, min(shape))
    q = np.random.default_rng(seed).standard_normal((shape[1], k)).astype(np.float32)
    y = matrix @ q  # [n, k]
    for _ in range(iterations):  # power iterations with re-orthonormalization
        y, _ = np.linalg.qr(y)
        y, _ = np.linalg.qr(transposed @ y)
        y = matrix @ y
    q, _ = np.linalg.qr(y)
    b = (transposed @ q).T  # q^T M: [k, n]
    u_small, s, _ = np.linalg.svd(b.astype(np.float64), full_matrices=False)
    u = q.astype(np.float64) @ u_small
    return u[:, :rank], s[:rank]


def cooccurrence_embeddings(source, tokenizer, vocab_size: int, dim: int, window: int = 5,
                            max_tokens: int = DEFAULT_MAX_TOKENS, initializer_range: float = 0.02, seed: int = 0,
                            progress: bool = True) -> np.ndarray:
    """A `[vocab_size, dim]` float32 embedding table from `source`'s co-occurrence statistics (module docstring)."""
    start = time.time()
    lines = token_lines(source, tokenizer, max_tokens=max_tokens, progress=progress)
    rows, cols, values, row_sums = ppmi_matrix(lines, vocab_size, window=window)
    rank = min(dim, vocab_size - 1)
    u, s = randomized_svd(rows, cols, values, (vocab_size, vocab_size), rank, seed=seed)
    table = np.random.default_rng(seed).normal(0.0, initializer_range, (vocab_size, dim)).astype(np.float32)
    seen = row_sums > 0
    table[seen, :rank] = (u * np.sqrt(s))[seen]
    if progress:
        print(f"co-occurrence embeddings: {int(seen.sum()):,} of {vocab_size:,} tokens seen, {values.size:,} positive "
              f"PMI pairs, {time.time() - start:.0f} s", flush=True)
    return table


def initialize_token_embeddings(backbone, source, tokenizer, seed: int = 0, progress: bool = True,
                                max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
    """Assigns `cooccurrence_embeddings` of `source` to `backbone`'s token embedding table."""
    variable = backbone.token_embedding.embeddings
    vocab_size, dim = (int(n) for n in variable.shape)
    table = cooccurrence_embeddings(source, tokenizer, vocab_size, dim, seed=seed, progress=progress,
                                    max_tokens=max_tokens,
                                    initializer_range=backbone.config.initializer_range)
    variable.assign(table.astype(variable.dtype))
