"""A kbert unigram vocabulary exported to transformers (`Tokenizer.export_transformers` -> tokenizer.json), beside
kbert's own encoder in one run: how many texts get the same ids, which differ, and lines/s of each.

    python benchmarks/tokenizer_export.py --tokenizer /path/to/tokenizer --shared ../shared/data --reviews 100000

`--tokenizer`: a kbert unigram tokenizer dir (quality.py writes one to OUT/tokenizer); without it a 16K
vocabulary is trained here on the first `--train` reviews. Texts: the first `--reviews` movie reviews, then
KorSTS dev's sentences.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(_HERE))


def reviews(shared: str, n: int) -> list:
    with gzip.open(os.path.join(shared, "movie-reviews", "reviews.tsv.gz"), "rt", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        return [row["text"] for _, row in zip(range(n), reader)]


def korsts(shared: str) -> list:
    with open(os.path.join(shared, "korsts", "sts-dev.tsv"), encoding="utf-8") as f:
        return [s for line in f.read().splitlines()[1:] for s in line.split("\t")[5:7]]


def main(argv=None):
    import kbert
    from tokenizers import Tokenizer as FastTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer")
    parser.add_argument("--shared", default=os.path.join(_HERE, "..", "..", "shared", "data"))
    parser.add_argument("--reviews", type=int, default=100_000)
    parser.add_argument("--train", type=int, default=200_000)
    parser.add_argument("--show", type=int, default=5)
    args = parser.parse_args(argv)
    if args.tokenizer:
        tok = kbert.Tokenizer.load(args.tokenizer)
    else:
        tok = kbert.Tokenizer.train(reviews(args.shared, args.train), vocab_size=16000, progress=False)
    from scratch import scratch_dir  # benchmarks/scratch.py: removed at exit
    out = scratch_dir()
    tok.export_transformers(out)
    fast = FastTokenizer.from_file(os.path.join(out, "tokenizer.json"))
    texts = reviews(args.shared, args.reviews) + korsts(args.shared)
    t = time.perf_counter()
    ours = [e.ids for e in tok.encode_batch(texts)]
    t_ours = time.perf_counter() - t
    t = time.perf_counter()
    theirs = [e.ids for e in fast.encode_batch(texts)]
    t_theirs = time.perf_counter() - t
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    print(f"{len(texts):,} texts ({args.reviews:,} reviews + KorSTS dev), vocabulary of {tok.vocab_size:,}")
    print("| encoder | lines/s | same ids as kbert |\n|---|---:|---:|")
    print(f"| kbert `encode_batch` (sentencepiece) | {len(texts) / t_ours:,.0f} | - |")
    print(f"| transformers tokenizer.json (`tokenizers` `encode_batch`) | {len(texts) / t_theirs:,.0f} | "
          f"{1 - len(differ) / len(texts):.4%} ({len(differ)} differ) |")
    for i in differ[:args.show]:
        print(f"  {texts[i][:60]!r}\n    kbert  {tok.encode(texts[i]).tokens[1:-1][:16]}\n"
              f"    hf     {fast.encode(texts[i]).tokens[1:-1][:16]}")


if __name__ == "__main__":
    main()
