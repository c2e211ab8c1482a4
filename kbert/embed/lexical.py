"""Lexical scores for hybrid search: cosine of character 1-3-gram TF-IDF vectors, mixed into
`Embedder.search(..., lexical=w)` as `(1 - w) * dense cosine + w * lexical cosine`.

Why: a small Korean encoder loses to character n-grams on text unlike what it was tuned on (KorSTS dev's
forum sentences, rare topical words; benchmarks/README.md, "Sentence vectors on data never tuned on"), and
the two err differently, so the mix beats either alone; hybrid lexical + dense scoring is the retrieval
field's standard answer (BM25 + dense, BGE-M3's dense + sparse). Character n-grams within words suit an
agglutinative language without a morpheme analyser: 학교에서 and 학교는 share 학, 교, 학교.

scikit-learn's `TfidfVectorizer` does the counting (sparse, vectorised, the field's reference
implementation) rather than hand-written code; it is an optional dependency, asked for by name when missing.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def _vectorizer(**fitted):
    try:
        from sklearn.feature_extraction.text import TfidfVectorizer
    except ImportError:
        raise ImportError("lexical scores need scikit-learn: pip install scikit-learn "
                          "(kbert's [search] extra)") from None
    return TfidfVectorizer(analyzer="char_wb", ngram_range=(1, 3), sublinear_tf=True, **fitted)


def char_tfidf(texts: Sequence[str]):
    """A TF-IDF vectorizer of character 1-3-grams within words (sublinear counts, unit rows) fitted on
    `texts` (the IDF says which n-grams are rare in the collection searched), or None when no text has any."""
    texts = list(texts)
    if not any(t.strip() for t in texts):  # nothing but whitespace: no n-gram to count (sklearn refuses)
        return None
    return _vectorizer().fit(texts)


def restored_char_tfidf(vocabulary: dict, idf: np.ndarray):
    """`char_tfidf`'s vectorizer rebuilt from its fitted n-gram columns and IDF (as a saved search index keeps
    them: data, not a pickle)."""
    vectorizer = _vectorizer(vocabulary=vocabulary)
    vectorizer.idf_ = np.asarray(idf, np.float64)
    return vectorizer


def lexical_scores(queries: Sequence[str], corpus: Sequence[str]) -> np.ndarray:
    """Cosine similarities `[len(queries), len(corpus)]` of character n-gram TF-IDF vectors fitted on the
    corpus (float32; 0 where either side has no n-gram the corpus holds)."""
    vectorizer = char_tfidf(corpus)
    if vectorizer is None:
        return np.zeros((len(queries), len(corpus)), np.float32)
    q, c = vectorizer.transform(list(queries)), vectorizer.transform(list(corpus))
    return np.asarray((q @ c.T).todense(), np.float32)
