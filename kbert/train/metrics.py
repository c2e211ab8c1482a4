"""Evaluation metrics of fine-tuning, in numpy: correlations for scores and similarities, accuracy and macro-F1.

Small enough to write out (scipy and scikit-learn are not dependencies of kbert); `rank` matches
`scipy.stats.rankdata`'s average ranks, which the tests check on ties.
"""

from __future__ import annotations

import numpy as np


def rank(x) -> np.ndarray:
    """Ranks from 1 with ties sharing their average rank (as scipy.stats.rankdata)."""
    _, inverse, counts = np.unique(np.asarray(x), return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return (ends - (counts - 1) / 2.0)[inverse]


def pearson(a, b) -> float:
    """Pearson's r; 0.0 when either side is constant or has fewer than 2 values."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if len(a) < 2 or a.std() == 0 or b.std() == 0:
        return 0.0
    return float(np.corrcoef(a, b)[0, 1])


def spearman(a, b) -> float:
    """Spearman's rho: Pearson's r of the ranks."""
    return pearson(rank(np.asarray(a, np.float64)), rank(np.asarray(b, np.float64)))


def accuracy(y, p) -> float:
    return float(np.mean(np.asarray(y) == np.asarray(p))) if len(y) else 0.0


def macro_f1(y, p, num_classes: int) -> float:
    """The mean F1 over the classes that occur in `y` or `p`."""
    y, p = np.asarray(y), np.asarray(p)
    scores = []
    for c in range(num_classes):
        tp = np.sum((p == c) & (y == c))
        denom = np.sum(p == c) + np.sum(y == c)
        if denom:
            scores.append(2 * tp / denom)
    return float(np.mean(scores)) if scores else 0.0
