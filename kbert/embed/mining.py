"""Hard-negative mining: for each (anchor, positive) pair, the corpus texts a model ranks nearest the anchor
that are not its positive, as (anchor, positive, negative) rows for `kbert.finetune(..., negative_column=...)`.

Why: in-batch negatives are mostly easy (a random question is rarely close to another), so a contrastive
bi-encoder learns little from most of them; retrieval models since DPR and ANCE train on negatives retrieved
by a model (BM25 or the model itself), and the sentence-transformers user expects the step as
`sentence_transformers.util.mine_hard_negatives`. The settings follow that function (ranks `range_min` ..
`range_max`, margins, `max_score`, "top" or "random" sampling) so a recipe carries over. The default
`relative_margin=0.05` is NV-Retriever's "TopK-PercPos" filter (Moreira et al., 2024): a candidate scored
within 5% of the anchor's own positive is likely an unlabelled positive (a false negative that would teach the
model to push a paraphrase away), and dropping such candidates was the best of the filters they compared.

The scores are `Embedder`'s cosines, or with `lexical=w` the same hybrid score as `Embedder.search`
(character n-gram TF-IDF fitted on the corpus): a lexical miner finds the negatives that share words with
the anchor, which a small model misses. Scoring runs in chunks of anchors, so memory is `[chunk, corpus]`.

The same scoring mines a collection against itself, with sentence-transformers' two functions for it (same names,
settings and results, so a recipe carries over; tests compare them on the same vectors):

    kbert.paraphrase_mining(model, texts)      # [(score, i, j), ...]: the best-scored pairs of distinct texts
    kbert.community_detection(model, texts)    # [[centre, member, ...], ...]: groups around a central text

For Korean user text (reviews, comments, questions) that is near-duplicate removal and topic grouping; with
`lexical` the score is the hybrid one, which catches the re-posts that share most of their characters.
"""

from __future__ import annotations

import numbers
from typing import List, Optional, Sequence, Tuple

import numpy as np

from kbert.data.features import text_list
from kbert.data.rows import read_rows, text_cell
from kbert.utils import progress_bar, unit_rows

SAMPLINGS = ("top", "random")
_MAX_SCORES = 1 << 26  # scores held at once, [chunk, corpus] float32: 256 MB


def _real(value) -> bool:
    """A number (numpy's too), not a bool: True would read as a margin of 1."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _number(value) -> bool:
    """A real number that is not NaN: a NaN bound compares False with every score (or min() skips it), so a
    threshold of NaN kept nothing and a max_score of NaN kept everything, both without a word."""
    return _real(value) and not np.isnan(value)


def _check_settings(num_negatives, range_min, range_max, margin, relative_margin, max_score, sampling, lexical):
    if isinstance(num_negatives, bool) or not isinstance(num_negatives, int) or num_negatives < 1:
        raise ValueError(f"`num_negatives` must be a positive integer. Received: num_negatives={num_negatives!r}")
    if isinstance(range_min, bool) or not isinstance(range_min, int) or range_min < 0:
        raise ValueError(f"`range_min` must be an integer >= 0. Received: range_min={range_min!r}")
    if range_max is not None and (isinstance(range_max, bool) or not isinstance(range_max, int)
                                  or range_max <= range_min):
        raise ValueError(f"`range_max` must be None or an integer above range_min={range_min}. "
                         f"Received: range_max={range_max!r}")
    if margin is not None and not (_real(margin) and margin >= 0):
        raise ValueError(f"`margin` must be None or a number >= 0. Received: margin={margin!r}")
    if relative_margin is not None and not (_real(relative_margin) and 0 <= relative_margin < 1):
        raise ValueError(f"`relative_margin` must be None or a number in [0, 1). Received: "
                         f"relative_margin={relative_margin!r}")
    # a NaN max_score compared as no bound at all (min(bound, nan) is bound): the filter asked for was off
    if max_score is not None and not _number(max_score):
        raise ValueError(f"`max_score` must be None or a number. Received: max_score={max_score!r}")
    if sampling not in SAMPLINGS:
        raise ValueError(f"`sampling` must be one of {SAMPLINGS}. Received: sampling={sampling!r}")
    if isinstance(lexical, bool) or not isinstance(lexical, (int, float)) or not 0 <= lexical <= 1:
        raise ValueError(f"`lexical` must be a number in [0, 1]. Received: lexical={lexical!r}")


def mine_hard_negatives(model, pairs, corpus: Optional[Sequence[str]] = None, anchor_column: str = "anchor",
                        positive_column: str = "positive", negative_column: str = "negative",
                        num_negatives: int = 1, range_min: int = 0, range_max: Optional[int] = None,
                        margin: Optional[float] = None, relative_margin: Optional[float] = 0.05,
                        max_score: Optional[float] = None, sampling: str = "top", lexical: float = 0.0,
                        seed: int = 0, chunk: int = 1024, progress: bool = True,
                        report: Optional[dict] = None) -> List[dict]:
    """Rows `{**pair, negative_column: text}`, one per negative found (so a pair with `num_negatives` of them
    appears that many times, sentence-transformers' "triplet" form), in the order of `pairs`.

    Args:
        model: an `Embedder`, or a model dir / Hub name for `Embedder.load` (its own pooling); None with
            `lexical=1`.
        pairs: rows with `anchor_column` and `positive_column`: a TSV / CSV / JSONL path or a list of dicts.
            Other columns are kept in the output.
        corpus: the candidate texts (duplicates count once). Default: the distinct positives of `pairs`.
        num_negatives: negatives per pair.
        range_min, range_max: among the candidates ranked by score for an anchor (its own texts left out:
            itself and every positive any pair gives it), skip the `range_min` best and look no further than
            rank `range_max` (None: the whole corpus). Skipping the very top is the other guard against
            unlabelled positives.
        margin, relative_margin: keep a candidate only if its score is at most the pair's positive score
            minus `margin`, and at most `(1 - relative_margin)` x the positive score (default 0.05: within 5%
            of the positive is treated as a probable positive). None turns either off.
        max_score: keep only candidates scored at most this.
        sampling: "top": the best-scored candidates that pass; "random": drawn uniformly (with `seed`) from
            those that pass within the rank range.
        lexical: 0 (default) ranks by the model's cosine; w in (0, 1] by `(1 - w)` x cosine + `w` x the
            cosine of character 1-3-gram TF-IDF fitted on the corpus (as `Embedder.search`; 1 is TF-IDF alone,
            a BM25-like miner that needs no model).
        chunk: anchors scored at a time (memory `[chunk, len(corpus)]` floats; fewer when that would pass
            64M scores, 256 MB).
        report: a dict that receives counts: pairs, with_negatives, short (pairs with fewer than asked),
            candidates, and the mean positive and negative scores.

    An anchor with no candidate left gets no row; `report` and the progress line say how many.
    """
    from kbert.embed.embedder import Embedder

    _check_settings(num_negatives, range_min, range_max, margin, relative_margin, max_score, sampling, lexical)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"`chunk` must be a positive integer. Received: chunk={chunk!r}")
    rows = read_rows(pairs, [anchor_column, positive_column])
    anchors = [text_cell(r, anchor_column, f"pair {i}") for i, r in enumerate(rows)]
    positives = [text_cell(r, positive_column, f"pair {i}") for i, r in enumerate(rows)]
    if negative_column in rows[0]:
        raise ValueError(f"the pairs already have a column {negative_column!r}: name the output column "
                         f"another way with `negative_column`")
    if corpus is None:
        corpus = positives
    if isinstance(corpus, str):
        raise ValueError("`corpus` must be a list of texts, not one string")
    corpus = list(dict.fromkeys(str(t) for t in corpus))
    if not corpus:
        raise ValueError("`corpus` holds no text")

    # each anchor's own texts: itself and every positive any pair gives it (a paraphrase of the anchor listed
    # in another pair must not come back as its negative)
    own = {}
    for a, p in zip(anchors, positives):
        own.setdefault(a.strip(), {a.strip()}).add(p.strip())
    where = {}
    for j, t in enumerate(corpus):
        where.setdefault(t.strip(), []).append(j)

    if model is None and lexical < 1:
        raise ValueError("`model` is None: give a model dir (or an Embedder), or rank by character n-grams "
                         "alone with lexical=1")
    embedder = model if isinstance(model, Embedder) or lexical >= 1 else Embedder.load(model)
    scores_of = _scorer(embedder, anchors, positives, corpus, lexical, progress)
    rng = np.random.default_rng(seed)
    out, found, short, neg_scores, pos_scores = [], 0, 0, [], []
    bar = progress_bar(total=len(rows), desc="mining negatives", unit="pair", enabled=progress)
    chunk = max(1, min(chunk, _MAX_SCORES // len(corpus)))  # a large corpus: fewer anchors at a time
    for start in range(0, len(rows), chunk):
        idx = np.arange(start, min(start + chunk, len(rows)))
        scores, positive = scores_of(idx)  # [c, n], [c]
        for row_i, s, pos in zip(idx, scores, positive):
            s = s.copy()
            for text in own[anchors[row_i].strip()]:
                s[where.get(text, [])] = -np.inf
            bound = score_bound(pos, margin, relative_margin, max_score)
            ranked = ranked_candidates(s, bound, range_min, range_max, num_negatives if sampling == "top" else None)
            if sampling == "random" and len(ranked) > num_negatives:
                ranked = rng.choice(ranked, num_negatives, replace=False)
            chosen = ranked[:num_negatives]
            found += bool(len(chosen))
            short += len(chosen) < num_negatives
            pos_scores.append(float(pos))
            for j in chosen:
                out.append({**rows[row_i], negative_column: corpus[j]})
                neg_scores.append(float(s[j]))
        bar.update(len(idx))
    bar.close()
    summary = {"pairs": len(rows), "with_negatives": found, "short": short, "rows": len(out),
               "candidates": len(corpus),
               "positive_score": float(np.mean(pos_scores)) if pos_scores else float("nan"),
               "negative_score": float(np.mean(neg_scores)) if neg_scores else float("nan")}
    if report is not None:
        report.update(summary)
    if progress:
        import sys

        print(f"mined {len(out)} negatives for {found} of {len(rows)} pairs from {len(corpus)} candidates "
              f"({short} pairs with fewer than {num_negatives}); mean score: positives "
              f"{summary['positive_score']:.3f}, negatives {summary['negative_score']:.3f}", file=sys.stderr)
    return out


def score_bound(pos: float, margin, relative_margin, max_score) -> float:
    """The highest score a candidate may have for a pair whose positive scores `pos`."""
    bound = np.inf
    if margin is not None:
        bound = min(bound, pos - margin)
    if relative_margin is not None:
        bound = min(bound, pos * (1.0 - relative_margin))
    if max_score is not None:
        bound = min(bound, max_score)
    return bound


def _best_first(s: np.ndarray, k: int) -> np.ndarray:
    """Indices of the `k` highest of `s`, highest first (equal scores by index)."""
    top = np.argpartition(-s, k - 1)[:k] if k < len(s) else np.arange(len(s))
    return top[np.lexsort((top, -s[top]))]


def ranked_candidates(s: np.ndarray, bound: float, range_min: int, range_max, wanted):
    """The indices of one anchor's row of scores `s` (-inf: its own texts) at ranks range_min .. range_max
    (ranked best first among the finite scores) that score at most `bound`, best first; with `wanted` only
    the first that many; with neither `wanted` nor `range_max`, all of them in index order. Every filter is
    an upper bound on the score, so the candidates it drops are the best-ranked ones: the first `wanted`
    survivors lie within the first max(range_min, number above the bound) + wanted ranks, and only those
    are sorted (a full sort of a large corpus per anchor is the cost this avoids)."""
    finite = int(np.isfinite(s).sum())
    if wanted is None and range_max is None:  # every survivor, in no order (random sampling): no sort at all
        keep = np.isfinite(s) & (s <= bound)
        if range_min:
            keep[_best_first(s, min(range_min, finite))] = False
        return np.flatnonzero(keep)
    limit = finite if range_max is None else min(range_max, finite)
    if wanted is not None:
        limit = min(limit, max(range_min, int(np.sum(np.isfinite(s) & (s > bound)))) + wanted)
    if limit <= range_min:
        return np.zeros(0, np.int64)
    ranked = _best_first(s, limit)[range_min:]
    return ranked[s[ranked] <= bound]


def _scorer(embedder, anchors, positives, corpus, lexical, progress):
    """A function of anchor indices -> (scores `[c, len(corpus)]`, positive scores `[c]`) by cosine, or the
    hybrid score with `lexical`; each distinct text is encoded once (anchors once more when the model has a query
    prompt: they are encoded as queries, the rest as documents)."""
    docs = list(dict.fromkeys(positives + corpus))
    if lexical >= 1:  # TF-IDF alone: no model, the dense part is 0
        a_vectors, d_vectors = np.zeros((len(anchors), 1), np.float32), np.zeros((len(docs), 1), np.float32)
    elif embedder.role_prompt("query") == embedder.role_prompt("document"):  # one encoding a text
        texts = list(dict.fromkeys(docs + anchors))
        at = {t: i for i, t in enumerate(texts)}
        vectors = unit_rows(embedder.encode_document(texts, progress=progress))
        a_vectors, d_vectors = vectors[[at[t] for t in anchors]], vectors[:len(docs)]
    else:  # anchors with the model's query prompt, positives and candidates with its document prompt (E5)
        d_vectors = unit_rows(embedder.encode_document(docs, progress=progress))
        distinct = list(dict.fromkeys(anchors))
        at = {t: i for i, t in enumerate(distinct)}
        a_vectors = unit_rows(embedder.encode_query(distinct, progress=progress))[[at[t] for t in anchors]]
    at = {t: i for i, t in enumerate(docs)}
    p_vectors, c_vectors = d_vectors[[at[t] for t in positives]], d_vectors[[at[t] for t in corpus]]
    vectorizer = None
    if lexical:
        from kbert.embed.lexical import char_tfidf

        vectorizer = char_tfidf(corpus)
        c_lexical = vectorizer.transform(corpus) if vectorizer is not None else None

    def scores_of(idx):
        a, p = a_vectors[idx], p_vectors[idx]
        dense, positive = a @ c_vectors.T, np.sum(a * p, axis=1)
        if not lexical:
            return dense, positive
        if vectorizer is None:  # no n-gram in the corpus: the lexical part is 0 everywhere
            sparse, sparse_positive = np.zeros_like(dense), np.zeros_like(positive)
        else:
            qa = vectorizer.transform([anchors[i] for i in idx])
            qp = vectorizer.transform([positives[i] for i in idx])
            sparse = np.asarray((qa @ c_lexical.T).todense(), np.float32)
            sparse_positive = np.asarray(qa.multiply(qp).sum(axis=1), np.float32).ravel()
        return (1 - lexical) * dense + lexical * sparse, (1 - lexical) * positive + lexical * sparse_positive
    return scores_of


def _check_count(value, name):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")


def _self_scorer(model, texts, lexical, progress, encode_options):
    """(a function of row indices -> their scores against every item `[c, n]`, n) for a collection scored
    against itself: cosines of `model`'s vectors of `texts` (or of `texts` given as vectors), or the hybrid
    score with `lexical`."""
    if isinstance(lexical, bool) or not isinstance(lexical, (int, float)) or not 0 <= lexical <= 1:
        raise ValueError(f"`lexical` must be a number in [0, 1]. Received: lexical={lexical!r}")
    if isinstance(texts, np.ndarray):
        if lexical:
            raise ValueError("`lexical` scores character n-grams: pass the texts, not vectors")
        vectors = unit_rows(np.atleast_2d(texts))
    else:
        texts = text_list(texts)
        if lexical >= 1 or not texts:  # TF-IDF alone (no model: the dense part is 0), or nothing to encode
            vectors = np.zeros((len(texts), 1), np.float32)
        elif model is None:
            raise ValueError("`model` is None: give a model dir (or an Embedder), pass vectors instead of texts, "
                             "or score by character n-grams alone with lexical=1")
        else:
            from kbert.embed.embedder import Embedder  # here: vectors given need no model (nor TensorFlow)

            embedder = model if isinstance(model, Embedder) else Embedder.load(model)
            vectors = unit_rows(embedder.encode(texts, progress=progress, **encode_options))
    n = len(texts)
    sparse = None
    if lexical and n:
        from kbert.embed.lexical import char_tfidf

        vectorizer = char_tfidf(texts)
        sparse = vectorizer.transform(texts) if vectorizer is not None else None

    def scores_of(idx):
        scores = vectors[idx] @ vectors.T
        if not lexical:
            return scores
        if sparse is None:  # no n-gram in the texts: the lexical part is 0 everywhere
            return (1 - lexical) * scores
        return (1 - lexical) * scores + lexical * np.asarray((sparse[idx] @ sparse.T).todense(), np.float32)

    return scores_of, n


def _row_top_k(scores: np.ndarray, k: int):
    """(rows, columns, values) of the `k` highest entries of each row of `scores` `[c, n]` (k <= n), in no order
    within a row (among equal values at the k-th place, any).

    A row-wise `np.argpartition` over the whole `[c, n]` block costs several times the matrix product that
    made it. Instead: cut each row into k blocks; the least of the k block maxima is at most the row's k-th
    highest value (each block holds one value at least that high), so only the entries at or above it can
    be among the k best, and those few per row are partitioned."""
    c, n = scores.shape
    width = -(-n // k)
    padded = np.full((c, k * width), -np.inf, np.float32)
    padded[:, :n] = scores
    bound = padded.reshape(c, k, width).max(axis=2).min(axis=1)  # [c]: <= each row's k-th highest
    rows, cols = np.nonzero(scores >= bound[:, None])  # row by row, so each row's candidates are contiguous
    rank = np.arange(len(rows)) - np.searchsorted(rows, np.arange(c))[rows]  # place within its row
    values = np.full((c, int(rank.max()) + 1), -np.inf, np.float32)  # [c, most candidates of a row]
    columns = np.zeros(values.shape, np.int64)
    values[rows, rank], columns[rows, rank] = scores[rows, cols], cols
    best = np.argpartition(-values, k - 1, axis=1)[:, :k] if values.shape[1] > k else np.arange(k)[None].repeat(c, 0)
    return (np.repeat(np.arange(c), k), np.take_along_axis(columns, best, 1).ravel(),
            np.take_along_axis(values, best, 1).ravel())


def _best_pairs(scores: np.ndarray, keys: np.ndarray, most: int):
    """Each pair key once (with its higher score: the two directions of a pair may differ in the last bit),
    then the `most` best-scored, in no order."""
    order = np.lexsort((-scores, keys))
    keys, scores = keys[order], scores[order]
    first = np.append(True, keys[1:] != keys[:-1])
    keys, scores = keys[first], scores[first]
    if len(keys) > most:
        best = np.argpartition(-scores, most - 1)[:most]
        keys, scores = keys[best], scores[best]
    return scores, keys


def paraphrase_mining(model, texts, top_k: int = 100, max_pairs: int = 500_000, threshold: Optional[float] = None,
                      lexical: float = 0.0, chunk: int = 1024, progress: bool = True,
                      **encode_options) -> List[Tuple[float, int, int]]:
    """The most similar pairs of distinct items of one collection, best first: `[(score, i, j), ...]` with
    `i < j` indices into `texts` (sentence-transformers' `paraphrase_mining`).

    Each item is compared with every other, and its `top_k` best partners are candidates; of those the
    `max_pairs` best-scored pairs are kept (each pair once). Near-duplicates of a large collection: raise
    `top_k` for items with many copies, set `threshold` for every pair above a score.

    Args:
        model: an `Embedder`, a model dir or Hub name; None when `texts` are vectors or with `lexical=1`.
        texts: the texts, or their vectors (`[n, dim]`, e.g. from `Embedder.encode`).
        top_k: partners kept per item.
        max_pairs: the most pairs returned.
        threshold: keep only pairs scored at least this (None: no bound).
        lexical: 0 (default): the vectors' cosine; w in (0, 1]: `(1 - w)` x cosine + `w` x the cosine of
            character 1-3-gram TF-IDF fitted on the texts, as `Embedder.search` (1: TF-IDF alone, no model).
        chunk: items scored at a time (memory `[chunk, n]` floats; fewer when that would pass 64M scores).
        encode options (`batch_size`, `prompt_name`, `pooling`, `truncate_dim`, ...): as `Embedder.encode`.
    """
    _check_count(top_k, "top_k")
    _check_count(max_pairs, "max_pairs")
    _check_count(chunk, "chunk")
    if threshold is not None and not _number(threshold):
        raise ValueError(f"`threshold` must be None or a number. Received: threshold={threshold!r}")
    scores_of, n = _self_scorer(model, texts, lexical, progress, encode_options)
    if n < 2:
        return []
    k = min(top_k, n - 1)
    chunk = max(1, min(chunk, _MAX_SCORES // n))
    scores_kept, keys_kept, pending = [np.zeros(0, np.float32)], [np.zeros(0, np.int64)], 0
    floor = -np.inf  # once max_pairs pairs are kept, the least of them: a pair below it cannot enter
    bar = progress_bar(total=n, desc="mining paraphrases", unit="text", enabled=progress)
    for start in range(0, n, chunk):
        idx = np.arange(start, min(start + chunk, n))
        scores = np.asarray(scores_of(idx), np.float32)
        scores[np.arange(len(idx)), idx] = -np.inf  # an item is not its own partner
        first, second, values = _row_top_k(scores, k)
        first = idx[first]
        keep = (values >= floor) & (np.isfinite(values) if threshold is None else values >= threshold)
        # a pair as one key (the lower index first), so both directions of it meet
        keys_kept.append(np.minimum(first, second)[keep].astype(np.int64) * n + np.maximum(first, second)[keep])
        scores_kept.append(values[keep])
        pending += int(keep.sum())
        if pending > max(max_pairs, 1 << 20):
            kept_scores, kept_keys = _best_pairs(np.concatenate(scores_kept), np.concatenate(keys_kept), max_pairs)
            scores_kept, keys_kept, pending = [kept_scores], [kept_keys], 0
            floor = kept_scores.min() if len(kept_scores) == max_pairs else -np.inf
        bar.update(len(idx))
    bar.close()
    kept_scores, kept_keys = _best_pairs(np.concatenate(scores_kept), np.concatenate(keys_kept), max_pairs)
    order = np.lexsort((kept_keys, -kept_scores))  # best first, ties by (i, j)
    return [(float(kept_scores[o]), int(kept_keys[o] // n), int(kept_keys[o] % n)) for o in order]


def community_detection(model, texts, threshold: float = 0.75, min_size: int = 10, lexical: float = 0.0,
                        chunk: int = 1024, progress: bool = True, **encode_options) -> List[List[int]]:
    """Groups of items around a central one (sentence-transformers' `community_detection`, the "fast
    clustering" of its examples): `[[centre, member, ...], ...]`, indices into `texts`, largest group first,
    each group's members after its centre by decreasing score.

    An item is a candidate centre when at least `min_size` items (itself included) score at least
    `threshold` with it; its group is those items. Candidates are taken largest group first, each keeping the
    members no earlier group took, and a group left with fewer than `min_size` is dropped, so the groups do not
    overlap and items in none are left out. Unlike k-means the number of groups is not given: the threshold
    decides (0.75 is the sentence-transformers default for its models; a small model's cosines run higher,
    so pick it on a labelled sample: `kbert.evaluate_pair_classification`'s accuracy threshold is one).

    Args:
        model, texts, lexical, chunk, encode options: as `paraphrase_mining`.
        threshold: the least score of a member with its centre.
        min_size: the fewest items a group may have (2: every pair of near-duplicates).
    """
    _check_count(min_size, "min_size")
    _check_count(chunk, "chunk")
    if not _number(threshold):
        raise ValueError(f"`threshold` must be a number. Received: threshold={threshold!r}")
    scores_of, n = _self_scorer(model, texts, lexical, progress, encode_options)
    if n < min_size:
        return []
    chunk = max(1, min(chunk, _MAX_SCORES // n))
    candidates = []
    bar = progress_bar(total=n, desc="finding groups", unit="text", enabled=progress)
    for start in range(0, n, chunk):
        idx = np.arange(start, min(start + chunk, n))
        scores = np.asarray(scores_of(idx), np.float32)
        # a centre needs min_size items (itself included) at or above the threshold
        for r in np.flatnonzero(np.count_nonzero(scores >= threshold, axis=1) >= min_size):
            row = scores[r]
            members = np.flatnonzero(row >= threshold)
            candidates.append((int(idx[r]), members[np.argsort(-row[members], kind="stable")]))
        bar.update(len(idx))
    bar.close()
    candidates.sort(key=lambda c: len(c[1]), reverse=True)  # stable: equal sizes keep index order
    taken = np.zeros(n, bool)
    groups = []
    for centre, members in candidates:
        if taken[centre]:
            continue
        free = members[~taken[members]]
        if len(free) >= min_size:
            group = [centre] + [int(m) for m in free if m != centre]
            groups.append(group)
            taken[group] = True
    return sorted(groups, key=len, reverse=True)
