"""`kbert.distill_static`: a static sentence-embedding model distilled from any model kbert loads.

    static = kbert.distill_static("my-bi-encoder", dim=256)      # a StaticEmbedder: a [vocab, 256] table
    static.encode(["문장 하나", "문장 둘"])                          # the mean of each text's token rows
    kbert.export_sentence_transformers(static, "my-static")     # Model2Vec + sentence-transformers layout

The recipe is Model2Vec's (Tulkens and van Dongen, 2024), what sentence-transformers' `StaticEmbedding.
from_distillation` calls: every vocabulary token runs through the model alone (`[CLS] token [SEP]`, pooled as
the model pools: `Embedder.token_vectors`), the table is rotated onto its principal axes and cut to `dim`
(PCA), and each row is scaled by its SIF weight `a / (a + p)`, with `p` the token's probability under Zipf's
law by id rank (vocabularies list frequent pieces first: SentencePiece's by score, WordPiece's by count), so
frequent pieces count less in the mean. Encoding is then a lookup and a mean: no transformer runs, so a CPU
encodes a few hundred times faster than with the model, for a loss of quality that `kbert.evaluate_sts` on the
user's own labelled pairs measures (benchmarks/static.py).

Why not the `model2vec` package itself: it runs the model through torch and transformers, which kbert does not
install, and re-tokenizes the vocabulary with its own tokenizer surgery; here kbert's own Embedder runs the model
(TensorFlow or JAX, any model `kbert.load_model` reads), and the table keeps the model's token ids, so kbert's
exact Korean tokenization (morpheme-aware vocabularies included) encodes with it. The result is written in
Model2Vec's layout, which `model2vec.StaticModel` and sentence-transformers both load (tests compare their
vectors, and the table with the `model2vec` package's own distillation of the same model).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from kbert.embed.embedder import Embedder, StaticEmbedder


def distill_static(model, dim: Optional[int] = 256, sif_coefficient: Optional[float] = 1e-4,
                   batch_size: int = 1024, max_length: Optional[int] = 512,
                   progress: Optional[bool] = None) -> StaticEmbedder:
    """A `StaticEmbedder` distilled from `model` (a model dir, a Hub name, or a `kbert.Embedder`).

    dim: the table's width after PCA (None: no PCA; at least the model's width: rotated, not cut).
    sif_coefficient: `a` of the SIF weights `a / (a + p)` (None: no weighting), as Model2Vec's default 1e-4.
    batch_size: tokens run through the model at a time. max_length: the tokens of a text the static model keeps
    (None: all; Model2Vec's default 512). The model's prompts carry over; a bi-encoder's own pooling is used.
    """
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1):
        raise ValueError(f"`dim` must be a positive integer or None (no PCA). Received: dim={dim!r}")
    if sif_coefficient is not None and not (isinstance(sif_coefficient, (int, float)) and 0 < sif_coefficient < 1):
        raise ValueError(f"`sif_coefficient` must be in (0, 1), or None for no weighting. "
                         f"Received: sif_coefficient={sif_coefficient!r}")
    embedder = model if isinstance(model, Embedder) else Embedder.load(model)
    if isinstance(embedder, StaticEmbedder):
        raise ValueError("`model` is already a static model; distil from the transformer it came from")
    table = embedder.token_vectors(batch_size=batch_size, progress=progress).astype(np.float64)
    if dim is not None:
        table = principal_components(table, int(dim))
    table *= sif_weights(len(table), sif_coefficient)[:, None]
    return StaticEmbedder(table.astype(np.float32), embedder.tokenizer, max_length=max_length,
                          prompts=embedder.prompts, default_prompt_name=embedder.default_prompt_name)


def principal_components(table: np.ndarray, dim: int) -> np.ndarray:
    """`table` `[rows, width]` centred and projected onto its `min(dim, width)` axes of most variance, each
    axis's sign chosen so the row farthest along it is positive (Model2Vec's convention, so results compare);
    a table with no more rows than `dim` is returned as it is (too few rows to estimate the axes)."""
    rows, width = table.shape
    if dim >= rows:
        return table
    centred = table - table.mean(axis=0)
    _, vectors = np.linalg.eigh(centred.T @ centred / max(rows - 1, 1))
    axes = vectors[:, ::-1][:, :min(dim, width)]  # [width, dim], largest variance first
    scores = centred @ axes
    far = np.argmax(np.abs(scores), axis=0)
    return scores * np.sign(scores[far, np.arange(scores.shape[1])])


def sif_weights(n: int, coefficient: Optional[float]) -> np.ndarray:
    """`[n]` SIF weights `a / (a + p)` of ids 0..n-1 under Zipf's law (`p` proportional to 1 / (rank + 2), as
    Model2Vec estimates it); ones for `coefficient` None."""
    if coefficient is None:
        return np.ones(n)
    inverse_rank = 1.0 / np.arange(2, n + 2)
    return coefficient / (coefficient + inverse_rank / inverse_rank.sum())
