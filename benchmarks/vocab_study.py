"""Plain vs morpheme-aware Korean vocabularies, side by side on the movie-review corpus.

Trains one vocabulary per variant on the same reviews and measures it on held-out reviews:

- tokens per sentence and per whitespace word (eojeol): shorter sequences fit more text in 128 tokens;
- [UNK] rate, and the share of UTF-8 byte pieces (SentencePiece's byte fallback: characters the
  vocabulary does not cover become 1-4 byte tokens instead of [UNK]);
- word coverage: the share of held-out eojeols that are a single token, and of held-out eojeols whose
  pieces are all whole morphemes or words (no byte pieces);
- vocabulary use: the share of the vocabulary that occurs at least once in the held-out encoding
  (entries that never occur are wasted embedding rows);
- training time and encode speed (morpheme-aware variants run MeCab in Python first).

    python benchmarks/vocab_study.py --reviews ../shared/data/movie-reviews/reviews.tsv.gz

The held-out reviews are the last `--heldout` lines of the file (the file is ordered by movie, so they
come from movies the vocabularies never saw).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(_HERE))

from tokenization import read_reviews  # noqa: E402

VARIANTS = {  # name -> (algorithm, morphemes)
    "unigram": ("unigram", None),
    "bpe": ("bpe", None),
    "mecab+unigram": ("unigram", "mecab"),
    "mecab+bpe": ("bpe", "mecab"),
}


def byte_piece(piece: str) -> bool:
    return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


def measure(tok, texts):
    """Statistics of `tok` on `texts` (see the module docstring)."""
    t = time.perf_counter()
    encodings = tok.encode_batch(texts, add_special_tokens=False)
    seconds = time.perf_counter() - t
    n_tokens = n_unk = n_bytes = n_words = single = clean = 0
    used = set()
    for enc in encodings:
        ids, pieces, offsets = enc.ids, enc.tokens, enc.offsets
        n_tokens += len(ids)
        n_unk += sum(i == tok.unk_id for i in ids)
        n_bytes += sum(byte_piece(p) for p in pieces)
        used.update(ids)
        # Group pieces by the whitespace word their offsets fall into.
        text = enc.normalized
        word_of = [0] * (len(text) + 1)
        w = 0
        for i, ch in enumerate(text):
            if ch == " ":
                w += 1
            word_of[i] = w
        words = {}
        for i, p, (s, e) in zip(ids, pieces, offsets):
            if e > s:
                words.setdefault(word_of[s], []).append((i, p))
        n_words += len(words)
        single += sum(len(v) == 1 for v in words.values())
        clean += sum(all(i != tok.unk_id and not byte_piece(p) for i, p in v) for v in words.values())
    return {"tokens_per_sentence": n_tokens / len(texts), "tokens_per_word": n_tokens / max(n_words, 1),
            "unk_rate": n_unk / max(n_tokens, 1), "byte_piece_rate": n_bytes / max(n_tokens, 1),
            "single_token_words": single / max(n_words, 1), "words_without_bytes": clean / max(n_words, 1),
            "vocab_used": len(used) / tok.vocab_size, "encode_lines_per_s": len(texts) / seconds}


def main(argv=None):
    default = os.path.join(_HERE, "..", "..", "shared", "data", "movie-reviews", "reviews.tsv.gz")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reviews", default=default)
    parser.add_argument("--lines", type=int, default=None, help="training reviews (default: all but held-out)")
    parser.add_argument("--heldout", type=int, default=20000)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default=None, help="keep the vocabularies in this folder")
    args = parser.parse_args(argv)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")

    import kbert

    texts = read_reviews(args.reviews)
    heldout = texts[-args.heldout:]
    train = texts[:-args.heldout][:args.lines]
    print(f"{len(train):,} training reviews, {len(heldout):,} held-out reviews; vocab {args.vocab_size:,}; "
          f"{os.cpu_count()} cpus", flush=True)
    rows = []
    for name in names:
        algorithm, morphemes = VARIANTS[name]
        t = time.perf_counter()
        tok = kbert.Tokenizer.train(train, vocab_size=args.vocab_size, algorithm=algorithm, morphemes=morphemes,
                                    progress=False)
        train_s = time.perf_counter() - t
        if args.out:
            tok.save(os.path.join(args.out, name))
        stats = measure(tok, heldout)
        stats["train_s"] = train_s
        rows.append((name, stats))
        print(f"{name}: {stats}", flush=True)
        if name == "mecab+unigram":
            sample = heldout[1]
            print(f"  e.g. {sample!r}\n  -> {tok.tokenize(sample)}")
        elif name == "unigram":
            print(f"  e.g. {heldout[1]!r}\n  -> {tok.tokenize(heldout[1])}")

    print(f"\n| vocabulary ({args.vocab_size:,}) | tokens / sentence | tokens / eojeol | [UNK] | byte pieces | one-token eojeols "
          "| eojeols without byte pieces | vocabulary used | training s | encode lines/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, s in rows:
        print(f"| {name} | {s['tokens_per_sentence']:.2f} | {s['tokens_per_word']:.2f} | {s['unk_rate']:.4%} "
              f"| {s['byte_piece_rate']:.3%} | {s['single_token_words']:.1%} | {s['words_without_bytes']:.2%} "
              f"| {s['vocab_used']:.1%} | {s['train_s']:.0f} | {s['encode_lines_per_s']:,.0f} |")


if __name__ == "__main__":
    main()
