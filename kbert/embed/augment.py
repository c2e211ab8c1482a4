"""Augmented SBERT: unlabelled sentence pairs scored by a teacher, so a bi-encoder trains on far more scored
pairs than the labelled set holds.

    pairs = kbert.candidate_pairs(sentences)                      # each sentence with its nearest and a random one
    silver = kbert.label_pairs(["member-1", "member-2"], pairs, gold="sts-train.tsv")
    kbert.finetune("student-start", "sentence-embedding", gold_rows + silver, dev, label_column="score", ...)

Why: a labelled STS set is small (KorSTS train: 5,749 pairs), and a teacher that ranks pairs better than one
bi-encoder (several bi-encoders' mean cosine, or a cross-encoder) can pass what it knows to a single model by
scoring pairs nobody labelled; Thakur et al. (2021) call it Augmented SBERT, and sentence-transformers ships
it as a training recipe. Its sampling matters: random pairs are almost all unrelated, so most candidates are a
sentence's nearest neighbours by a lexical score (the paper's BM25 sampling), with a few random ones to keep
the low end of the scale. Here the lexical score is the cosine of character 1-3-gram TF-IDF vectors
(`kbert.embed.lexical`, scikit-learn's vectorizer), the one `Embedder.search(lexical=)` uses: it needs no
morpheme analyser and finds the near-duplicates an agglutinative language spells many ways.

The teacher here is one or more sentence-embedding models (an ensemble scores a pair by the mean of their
cosines: `benchmarks/quality.py --pretrain-seeds` trains such an ensemble and its student). Its cosines are
put on the labels' scale by the least-squares line from cosine to label on labelled pairs (`gold`), clipped to
the labels' range, because `kbert.finetune` regresses a pair's cosine onto label / max label, and a teacher's
raw cosines sit on no scale in particular.
"""

from __future__ import annotations

import random
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

from kbert.data.rows import number, read_rows, text_cell
from kbert.utils import progress_bar

_CHUNK = 1024  # sentences whose TF-IDF cosines to the pool are held at once: [1024, pool] floats


def _count(value, name, least):
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"`{name}` must be an integer >= {least}. Received: {name}={value!r}")


def candidate_pairs(sentences: Sequence[str], neighbours: int = 3, randoms: int = 1,
                    exclude: Iterable[Tuple[str, str]] = (), seed: int = 0,
                    progress: bool = True) -> List[Tuple[str, str]]:
    """Unlabelled pairs for a teacher to score: each distinct sentence (in sorted order) with its `neighbours`
    nearest others by character 1-3-gram TF-IDF cosine (fitted on the sentences) and `randoms` others drawn at
    random (`seed`). Unordered and deduplicated: a pair never comes back in the other order, a sentence is never
    paired with itself, and the pairs in `exclude` (the labelled ones, in either order) are left out.

    Returns a list of `(sentence, other)` tuples, a sentence's neighbours before its random draws."""
    from kbert.embed.lexical import char_tfidf

    _count(neighbours, "neighbours", 0)
    _count(randoms, "randoms", 0)
    if isinstance(sentences, str):
        raise ValueError("`sentences` must be a list of texts, not one string")
    pool = sorted({str(s) for s in sentences if str(s).strip()})
    if len(pool) < 2:
        raise ValueError(f"`sentences` holds {len(pool)} distinct non-empty text(s): pairs need at least 2")
    neighbours = min(neighbours, len(pool) - 1)  # argpartition's kth must index the row
    skip = {frozenset(p) for p in exclude}
    rng, seen, pairs = random.Random(seed), set(), []

    def add(i, j):
        key = frozenset((pool[i], pool[j]))
        if i != j and key not in seen and key not in skip:
            seen.add(key)
            pairs.append((pool[i], pool[j]))

    vectorizer = char_tfidf(pool)
    vectors = vectorizer.transform(pool) if vectorizer is not None else None
    bar = progress_bar(total=len(pool), desc="candidate pairs", unit="sentence", enabled=progress)
    for start in range(0, len(pool), _CHUNK):
        stop = min(start + _CHUNK, len(pool))
        if neighbours and vectors is not None:
            cos = (vectors[start:stop] @ vectors.T).toarray()  # [chunk, pool]
        else:  # no n-gram anywhere (punctuation only): no nearest to find, random draws still work
            cos = np.zeros((stop - start, len(pool)))
        for k, row in enumerate(cos):
            i = start + k
            if neighbours:
                row[i] = -1.0  # never the sentence itself
                for j in np.argpartition(-row, neighbours)[:neighbours]:
                    add(i, int(j))
            for _ in range(randoms):
                add(i, rng.randrange(len(pool)))
        bar.update(stop - start)
    bar.close()
    return pairs


def _pair_texts(pairs, text_column, pair_column):
    """`pairs` as two lists of texts: (a, b) tuples, or rows (dicts or a file) with the two columns."""
    if isinstance(pairs, str) or (isinstance(pairs, (list, tuple)) and pairs and isinstance(pairs[0], dict)):
        rows = read_rows(pairs, [text_column, pair_column])
        return ([text_cell(r, text_column, f"pair {i}") for i, r in enumerate(rows)],
                [text_cell(r, pair_column, f"pair {i}") for i, r in enumerate(rows)])
    firsts, seconds = [], []
    for i, p in enumerate(pairs):
        if isinstance(p, str) or len(p) != 2:
            raise ValueError(f"pair {i}: expected two texts (a tuple), got {p!r}")
        firsts.append(str(p[0]))
        seconds.append(str(p[1]))
    return firsts, seconds


def label_pairs(teacher, pairs, gold=None, text_column: str = "sentence1", pair_column: str = "sentence2",
                label_column: str = "score", batch_size: int = 64, progress: bool = True,
                report: Optional[dict] = None) -> List[dict]:
    """Rows `{text_column: a, pair_column: b, label_column: score}` for `kbert.finetune`, one per pair in order.

    Args:
        teacher: an `Embedder` (or `StaticEmbedder`, `OnnxEmbedder`) or a model dir / Hub name for
            `Embedder.load`, or a list of them: an ensemble, which scores a pair by the mean of its models'
            cosines.
        pairs: `(a, b)` tuples (as `candidate_pairs` gives), or rows with `text_column` and `pair_column`
            (a list of dicts, or a TSV / CSV / JSONL path).
        gold: labelled pairs with `text_column`, `pair_column` and `label_column` (rows or a path). The
            teacher's cosine is mapped to the labels' scale by the least-squares line from cosine to label on
            them, and clipped to the labels' range (rounded to 4 digits). None: the score is the cosine itself.
        report: a dict that receives `slope`, `intercept` (None without gold), `clipped` (scores clipped to the
            range) and `mean` (the mean score).
    """
    from kbert.embed.embedder import Embedder

    teachers = list(teacher) if isinstance(teacher, (list, tuple)) else [teacher]
    if not teachers:
        raise ValueError("`teacher` is an empty list: give a model dir or an Embedder, or several")
    _count(batch_size, "batch_size", 1)
    firsts, seconds = _pair_texts(pairs, text_column, pair_column)
    if not firsts:
        raise ValueError("`pairs` holds no pair")
    gold_a, gold_b, labels = [], [], []
    if gold is not None:
        for i, r in enumerate(read_rows(gold, [text_column, pair_column, label_column])):
            gold_a.append(text_cell(r, text_column, f"gold pair {i}"))
            gold_b.append(text_cell(r, pair_column, f"gold pair {i}"))
            labels.append(number(r[label_column], "gold", i))  # a NaN label made every score NaN
        if len(labels) < 2 or max(labels) == min(labels):
            raise ValueError("`gold` needs at least 2 pairs with different labels to fit the cosine-to-label line")

    models = [Embedder.load(t) if isinstance(t, str) else t for t in teachers]  # anything with Embedder's encode
    # every distinct text of the pairs and the gold pairs (the candidates usually come from the gold sentences)
    # encoded once per model; a pair's score is the mean over the models of its cosine
    lefts, rights = firsts + gold_a, seconds + gold_b
    texts = list(dict.fromkeys(lefts + rights))
    where = {t: i for i, t in enumerate(texts)}
    ia, ib = np.array([where[t] for t in lefts]), np.array([where[t] for t in rights])
    total = np.zeros(len(lefts))
    for m in models:
        v = np.asarray(m.encode(texts, batch_size=batch_size, progress=progress), np.float64)
        total += np.sum(v[ia] * v[ib], axis=1)
    cos = total / len(models)
    scores, known = cos[:len(firsts)], cos[len(firsts):]

    slope, intercept, clipped = None, None, 0
    if labels:
        slope, intercept = (float(x) for x in np.polyfit(known, labels, 1))
        raw = slope * scores + intercept
        scores = np.clip(raw, min(labels), max(labels))
        clipped = int(np.sum(raw != scores))
    if report is not None:
        report.update(slope=slope, intercept=intercept, clipped=clipped, mean=float(np.mean(scores)))
    return [{text_column: a, pair_column: b, label_column: round(float(s), 4)}
            for a, b, s in zip(firsts, seconds, scores)]
