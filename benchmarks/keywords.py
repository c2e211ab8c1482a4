"""Korean keyphrases: `kbert.keywords` beside KeyBERT (with sentence-transformers running the same weights) in one
run, on Wikinews paragraphs.

Three KeyBERT setups, each timed end to end (morpheme analysis, encoding, scoring):
- `same candidates`: KeyBERT given kbert's noun-run candidates (a `CountVectorizer` whose analyzer returns them):
  the same method, so the keywords should agree; the speed ratio is the comparison.
- `noun tokenizer`: the Korean recipe found in tutorials, `CountVectorizer(tokenizer=<the analyzer's nouns>,
  ngram_range=(1, 2))`: its two-noun phrases join nouns that are not adjacent in the text (기술이 빠르게 발전
  gives "기술 발전"); the script counts keywords that do not occur in their document.
- `default`: KeyBERT's own `CountVectorizer` words, which in Korean keep their particles (기술이, 기술을); the
  script counts keywords that hold a morpheme other than a noun.

    python benchmarks/keywords.py --news ../shared/data/boddari/wikinews.txt --docs 300 [--model DIR]

Without `--model` a bert-mini with random weights and a vocabulary learned on the statutes is used (speed and
agreement only; a trained bi-encoder gives keywords worth reading).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from random_model import random_model  # noqa: E402  (benchmarks/random_model.py)


def paragraphs(path: str, n: int, min_chars: int = 150):
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = " ".join(line.split())
            if len(line) >= min_chars:
                out.append(line)
                if len(out) == n:
                    break
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--news", default=os.path.join("..", "shared", "data", "boddari", "wikinews.txt"))
    parser.add_argument("--docs", type=int, default=300)
    parser.add_argument("--model", help="a kbert or sentence-transformers model dir (default: random bert-mini)")
    parser.add_argument("--analyzer", default="mecab")
    parser.add_argument("--top-n", type=int, default=5)
    parser.add_argument("--show", type=int, default=3, help="documents whose keywords are printed")
    args = parser.parse_args()

    from keybert import KeyBERT
    from sentence_transformers import SentenceTransformer
    from sklearn.feature_extraction.text import CountVectorizer

    import kbert
    from kbert.embed.keywords import NOUN_TAGS

    docs = paragraphs(args.news, args.docs)
    from scratch import scratch_dir  # benchmarks/scratch.py: removed at exit
    tmp = scratch_dir()
    model_dir = args.model or random_model(os.path.join(tmp, "model"))
    emb = kbert.Embedder.load(model_dir)
    st_dir = os.path.join(tmp, "st")
    kbert.export_sentence_transformers(emb, st_dir)
    theirs = KeyBERT(model=SentenceTransformer(st_dir, device="cpu"))
    analyzer = kbert.morphemes(args.analyzer)
    print(f"{len(docs)} paragraphs, {sum(map(len, docs)) / len(docs):.0f} characters on average; analyzer "
          f"{args.analyzer}; top {args.top_n}; model {args.model or 'random bert-mini'}")

    kbert.keywords(emb, docs[:8], top_n=args.top_n, analyzer=analyzer)  # warm-up: compile, load the dictionary
    start = time.perf_counter()
    ours = kbert.keywords(emb, docs, top_n=args.top_n, analyzer=analyzer)
    ours_s = time.perf_counter() - start

    def run_keybert(vectorizer):
        start = time.perf_counter()
        found = theirs.extract_keywords(docs, vectorizer=vectorizer, top_n=args.top_n)
        return time.perf_counter() - start, found

    def runs(doc):
        return kbert.keyphrase_candidates(doc, analyzer)

    def nouns(doc):
        return [m.surface for m in analyzer(doc) if all(t in NOUN_TAGS for t in m.tag.split("+"))]

    same_s, same = run_keybert(CountVectorizer(analyzer=runs))
    noun_s, noun = run_keybert(CountVectorizer(tokenizer=nouns, ngram_range=(1, 2), lowercase=False,
                                               token_pattern=None))
    default_s, default = run_keybert(None)

    def agree(a, b):
        return sum({p for p, _ in x} == {p for p, _ in y} for x, y in zip(a, b))

    def absent(found):  # keywords that are not a stretch of their document
        return sum(p not in " ".join(d.split()) for d, kws in zip(docs, found) for p, _ in kws)

    def not_nouns(found):  # keywords holding a particle, an ending or another non-noun morpheme
        return sum(any(not all(t in NOUN_TAGS for t in m.tag.split("+")) for m in analyzer(p))
                   for kws in found for p, _ in kws)

    total = sum(len(k) for k in ours)
    print(f"\n| side | docs/s | vs KeyBERT (same candidates) | same top-{args.top_n} set as kbert | "
          f"keywords not in their document | keywords with a non-noun morpheme |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, seconds, found in [("kbert.keywords", ours_s, ours),
                                 ("KeyBERT, kbert's candidates", same_s, same),
                                 ("KeyBERT, noun tokenizer, ngram (1, 2)", noun_s, noun),
                                 ("KeyBERT, default CountVectorizer", default_s, default)]:
        n = sum(len(k) for k in found)
        print(f"| {name} | {len(docs) / seconds:.1f} | {same_s / seconds:.2f}x | {agree(found, ours)} of "
              f"{len(docs)} | {absent(found)} of {n} | {not_nouns(found)} of {n} |")
    print(f"\n(kbert: {total} keywords)")
    for doc, a, c, d in list(zip(docs, ours, noun, default))[:args.show]:
        print(f"\n{doc[:120]}...\n  kbert:          {[p for p, _ in a]}\n  noun tokenizer: {[p for p, _ in c]}"
              f"\n  default:        {[p for p, _ in d]}")


if __name__ == "__main__":
    main()
