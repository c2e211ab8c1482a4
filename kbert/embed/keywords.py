"""Keywords and keyphrases of Korean documents by KeyBERT's method: the document's noun phrases whose sentence
vectors are nearest the document's own.

    kbert.keywords(model, doc)                         # [("자연어 처리", score), ("언어 모델", score), ...]
    kbert.keywords(model, docs, top_n=10, diversity=0.5)   # one list per document; MMR for variety
    kbert.keyphrase_candidates(doc, analyzer="kiwi")   # the candidates alone

Why: KeyBERT (Grootendorst, 2020) is what practitioners reach for to tag documents with an embedding model, and
Korean users pair it with a morpheme analyzer, because its default candidates (scikit-learn's
`CountVectorizer` words) carry their particles in Korean: 기술이, 기술을 and 기술의 are three words, and
none of them is the keyword 기술. kbert's candidates are runs of adjacent noun morphemes from any of
`kbert.morphemes`' analyzers (mecab by default, kiwi, okt, ...), n of them at a time, spelled as the document
spells them (자연어 처리, 인공지능): a run stops at any other morpheme, so 학교에서 공부 gives 학교 and 공부,
while 학교 공부 also gives the phrase. The scoring and its options are KeyBERT's own (`extract_keywords`):
cosine of each candidate's vector with the document's; `diversity` for maximal marginal relevance (KeyBERT's
`use_mmr`), `nr_candidates` for max sum distance (`use_maxsum`), `seed_keywords` to steer toward a theme.
The tests run KeyBERT itself on the same candidates and vectors and get the same keywords and scores.

Each distinct candidate is encoded once over all documents, in the Embedder's length-sorted batches; the
analyzer runs in worker processes for many documents (`Analyzer.batch`).
"""

from __future__ import annotations

import itertools
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from kbert.data.features import str_list
from kbert.utils import unit_rows

# Noun tags of the analyzers kbert wraps: Sejong tags (mecab, kiwi, komoran, kkma: common and proper nouns,
# Latin-alphabet words, Chinese characters; kkma writes the last two OL and OH), okt's Noun and Alpha, and
# hannanum's N. Bound nouns (NNB: 것, 수), numerals and pronouns are left out.
NOUN_TAGS = frozenset({"NNG", "NNP", "SL", "SH", "OL", "OH", "Noun", "Alpha", "N"})


def _ngram_range(ngram_range) -> Tuple[int, int]:
    if (not isinstance(ngram_range, (tuple, list)) or len(ngram_range) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in ngram_range)
            or not 1 <= ngram_range[0] <= ngram_range[1]):
        raise ValueError("`ngram_range` must be (min, max) with 1 <= min <= max nouns a phrase. "
                         f"Received: ngram_range={ngram_range!r}")
    return tuple(ngram_range)


def _analyzer(analyzer):
    from kbert.text.morphemes import morphemes

    return morphemes(analyzer) if isinstance(analyzer, str) else analyzer


def _phrases(text: str, morphs, ngram_range, tags, stop_words) -> List[str]:
    """Candidates of one text from its morphemes (see `keyphrase_candidates`)."""
    lo, hi = ngram_range
    runs, run = [], []
    for m in list(morphs) + [None]:  # None closes the last run
        noun = (m is not None and all(t in tags for t in m.tag.split("+"))
                and " ".join(m.surface.split()) not in stop_words)
        if noun:
            run.append(m)
        elif run:
            runs.append(run)
            run = []
    seen, out = set(), []
    for run in runs:
        for n in range(lo, min(hi, len(run)) + 1):
            for i in range(len(run) - n + 1):
                phrase = " ".join(text[run[i].start:run[i + n - 1].end].split())
                if phrase and phrase not in seen:
                    seen.add(phrase)
                    out.append(phrase)
    return out


def keyphrase_candidates(texts: Union[str, Sequence[str]], analyzer="mecab", ngram_range=(1, 2),
                         tags=NOUN_TAGS, stop_words: Optional[Sequence[str]] = None):
    """The candidate keyphrases of a text (a list of them for a list of texts), each once: every run of
    `ngram_range` adjacent noun morphemes, written as in the text (whitespace inside a phrase becomes one
    space); run by run in the text's order, the shorter phrases of a run first.

    analyzer: a `kbert.morphemes` name ("mecab", "kiwi", "okt", "komoran", "hannanum", "kkma"), or any callable
        text -> `kbert.text.morphemes.Morpheme` list.
        The default (1, 2) n-grams rebuild the compound nouns an analyzer splits (kiwi: 인공 + 지능).
    tags: the morpheme tags that count as nouns (a compound tag such as NNG+JKS counts only when all of its
        parts do).
    stop_words: nouns never in a phrase (a phrase does not run across them either).
    """
    single = isinstance(texts, str)
    items = str_list([texts] if single else texts)
    span = _ngram_range(ngram_range)
    stops = frozenset(" ".join(w.split()) for w in (stop_words or ()))
    analyze = _analyzer(analyzer)
    batch = getattr(analyze, "batch", None)  # kbert's analyzers use worker processes for many texts
    analyzed = batch(items) if batch is not None and len(items) > 1 else [analyze(t) for t in items]
    out = [_phrases(t, m, span, frozenset(tags), stops) for t, m in zip(items, analyzed)]
    return out[0] if single else out


def _mmr(doc_sim: np.ndarray, cand_sim: np.ndarray, top_n: int, diversity: float) -> List[int]:
    """KeyBERT's `mmr`: the candidate nearest the document, then each next one maximizing
    (1 - diversity) x its similarity to the document - diversity x its largest similarity to those chosen."""
    chosen = [int(np.argmax(doc_sim))]
    left = [i for i in range(len(doc_sim)) if i != chosen[0]]
    for _ in range(min(top_n - 1, len(doc_sim) - 1)):
        redundancy = cand_sim[np.ix_(left, chosen)].max(axis=1)
        best = left[int(np.argmax((1 - diversity) * doc_sim[left] - diversity * redundancy))]
        chosen.append(best)
        left.remove(best)
    return chosen


def _max_sum(doc_sim: np.ndarray, cand_sim: np.ndarray, top_n: int, nr_candidates: int) -> List[int]:
    """KeyBERT's `max_sum_distance`: of the `nr_candidates` candidates nearest the document, the `top_n` whose
    pairwise similarities sum least (the first such combination, in KeyBERT's order)."""
    if top_n > len(doc_sim):
        return []
    pool = list(np.argsort(doc_sim, kind="stable")[-nr_candidates:])
    sims = cand_sim[np.ix_(pool, pool)]
    best, least = None, np.inf
    for combination in itertools.combinations(range(len(pool)), top_n):
        block = sims[np.ix_(combination, combination)]
        total = block.sum() - np.trace(block)
        if total < least:
            best, least = combination, total
    return [int(pool[i]) for i in best]


def check_options(top_n=5, diversity=None, nr_candidates=None, ngram_range=(1, 2)) -> None:
    """ValueError naming the first bad setting of `keywords` (the server checks a request before it queues)."""
    _ngram_range(ngram_range)
    _check(top_n, diversity, nr_candidates)


def _check(top_n, diversity, nr_candidates):
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
        raise ValueError(f"`top_n` must be a positive int. Received: top_n={top_n!r}")
    if diversity is not None and nr_candidates is not None:
        raise ValueError("choose one of `diversity` (maximal marginal relevance) and `nr_candidates` (max sum "
                         "distance)")
    if diversity is not None and (isinstance(diversity, bool) or not isinstance(diversity, (int, float))
                                  or not 0 <= diversity <= 1):
        raise ValueError(f"`diversity` must be a number in [0, 1]. Received: diversity={diversity!r}")
    if nr_candidates is not None:
        if isinstance(nr_candidates, bool) or not isinstance(nr_candidates, int) or nr_candidates < top_n:
            raise ValueError(f"`nr_candidates` must be an int of at least top_n ({top_n}). Received: "
                             f"nr_candidates={nr_candidates!r}")
        if nr_candidates > 30:  # every top_n-combination of them is scored
            raise ValueError(f"`nr_candidates` above 30 means millions of combinations; use `diversity` "
                             f"(maximal marginal relevance) instead. Received: nr_candidates={nr_candidates}")


def keywords(model, docs: Union[str, Sequence[str]], top_n: int = 5, ngram_range=(1, 2), analyzer="mecab",
             candidates: Optional[Sequence[str]] = None, stop_words: Optional[Sequence[str]] = None,
             diversity: Optional[float] = None, nr_candidates: Optional[int] = None,
             seed_keywords: Optional[Sequence] = None, tags=NOUN_TAGS, progress: bool = False,
             **encode_options):
    """The `top_n` keyphrases of each document, best first: `[(phrase, score), ...]` for one document, a list
    of such lists for a list (an empty document, or one without candidates, gets `[]`). `score` is the cosine
    of the phrase's vector with the document's (KeyBERT's `extract_keywords`, unrounded).

    Args:
        model: an `Embedder`, or a model dir or Hub name to load one from.
        docs: a document or a list of them. A document longer than the model's `max_length` is encoded from
            its first tokens (with the Embedder's warning), as KeyBERT does; `long_texts="mean"` reads all of
            it (`Embedder.encode`).
        ngram_range, analyzer, tags, stop_words: the candidates (`keyphrase_candidates`).
        candidates: phrases to choose from instead; each document keeps those that occur in it.
        diversity: maximal marginal relevance with this weight on variety (0: by score alone; KeyBERT's
            `use_mmr=True, diversity=...`; 0.5 to 0.7 is a common choice).
        nr_candidates: max sum distance over this many nearest candidates (KeyBERT's `use_maxsum=True`).
        seed_keywords: a list of words steering every document (or one list per document): the document's
            vector becomes (3 x itself + the mean of the seed words' vectors) / 4, as KeyBERT's guided mode.
        encode options (`batch_size`, `prompt_name`, `pooling`, `max_length`, ...): as `Embedder.encode`.
    """
    from kbert.embed.embedder import Embedder

    _check(top_n, diversity, nr_candidates)
    single = isinstance(docs, str)
    items = str_list([docs] if single else docs)
    if candidates is not None:
        pool = [" ".join(c.split()) for c in str_list(candidates)]
        per_doc = [[c for c in dict.fromkeys(pool) if c and c in " ".join(d.split())] for d in items]
    else:
        per_doc = keyphrase_candidates(items, analyzer, ngram_range, tags, stop_words)
    seeds = None
    if seed_keywords is not None:
        nested = not isinstance(seed_keywords, str) and all(not isinstance(s, str) for s in seed_keywords)
        seeds = [str_list(s) for s in seed_keywords] if nested else [str_list(seed_keywords)] * len(items)
        if len(seeds) != len(items) or not all(seeds):
            raise ValueError("`seed_keywords` must be a non-empty list of words, or one such list per document "
                             f"({len(items)} documents, {len(seeds)} lists)")
    embedder = model if isinstance(model, Embedder) else Embedder.load(model)
    phrases = list(dict.fromkeys(p for found in per_doc for p in found))
    options = dict(encode_options, progress=progress)
    doc_vectors = embedder.encode(items, **options) if items else None
    index = {p: i for i, p in enumerate(phrases)}
    phrase_vectors = unit_rows(embedder.encode(phrases, **options)) if phrases else None
    if seeds is not None:
        words = list(dict.fromkeys(w for s in seeds for w in s))
        word_vectors = embedder.encode(words, **options)
        at = {w: i for i, w in enumerate(words)}
        doc_vectors = np.stack([(3 * doc_vectors[i] + word_vectors[[at[w] for w in s]].mean(axis=0)) / 4
                                for i, s in enumerate(seeds)])
    out = []
    for i, found in enumerate(per_doc):
        if not found or not items[i].strip():
            out.append([])
            continue
        vectors = phrase_vectors[[index[p] for p in found]]  # [c, dim], unit
        doc_sim = vectors @ unit_rows(doc_vectors[i])  # [c]
        if diversity is not None:
            chosen = _mmr(doc_sim, vectors @ vectors.T, top_n, float(diversity))
        elif nr_candidates is not None:
            chosen = _max_sum(doc_sim, vectors @ vectors.T, top_n, nr_candidates)
        else:
            chosen = list(np.argsort(-doc_sim, kind="stable")[:top_n])
        ranked = sorted(((found[j], float(doc_sim[j])) for j in chosen), key=lambda kv: -kv[1])
        out.append(ranked)
    return out[0] if single else out
