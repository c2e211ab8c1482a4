"""Reranking throughput (query-document pairs/s) on movie reviews: kbert's `TaskModel.rank` beside
sentence-transformers' `CrossEncoder.rank` on the same Hugging Face cross-encoder dir, in one run.

The cross-encoder is an XLMRobertaForSequenceClassification with one logit, the layout of the rerankers used
for Korean (BGE-reranker-v2-m3 and its Korean fine-tunes), at multilingual-e5-small's shape (12 layers, 384
hidden; BGE-reranker-v2-m3 itself is 24 x 1024, too slow for a CPU benchmark), random weights and a unigram
SentencePiece vocabulary learned on the reviews (`embed.py`'s `xlm_roberta_dir`). Both sides read the same dir,
each with its own tokenizer; the script prints the largest score difference and whether the orders agree.
Each query is a review, its candidates `--candidates` other reviews (what a first-stage search hands a
reranker); both sides rank query by query, and then score every pair in one call.

    python benchmarks/rerank.py --reviews ../shared/data/movie-reviews/reviews.tsv.gz --queries 100 --candidates 30
    KERAS_BACKEND=jax python benchmarks/rerank.py ...
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from embed import read_reviews, timed, xlm_roberta_dir  # noqa: E402  (the same model builder and timing)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reviews", default=os.path.join("..", "shared", "data", "movie-reviews", "reviews.tsv.gz"))
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--candidates", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="best of N timed passes per side")
    args = parser.parse_args()

    import keras
    import numpy as np
    import torch
    from sentence_transformers import CrossEncoder

    import kbert

    texts = read_reviews(args.reviews, args.queries * (args.candidates + 1))
    queries = texts[:args.queries]
    candidates = [texts[args.queries + i * args.candidates:args.queries + (i + 1) * args.candidates]
                  for i in range(args.queries)]
    pairs = [(q, d) for q, docs in zip(queries, candidates) for d in docs]
    from scratch import scratch_dir  # benchmarks/scratch.py: removed at exit
    hf_dir = os.path.join(scratch_dir(prefix="kbert-rerank-bench-"), "reranker")
    xlm_roberta_dir(read_reviews(args.reviews, 50000, skip=len(texts)), hf_dir,
                    model_class="XLMRobertaForSequenceClassification", num_labels=1)
    model = kbert.TaskModel.load(hf_dir)
    ce = CrossEncoder(hf_dir, device="cpu")
    print(f"{len(queries)} queries x {args.candidates} candidates = {len(pairs)} pairs, mean "
          f"{np.mean([len(q) + len(d) for q, d in pairs]):.0f} chars a pair; batch {args.batch_size}; CPU threads: "
          f"torch {torch.get_num_threads()}, os {os.cpu_count()}; kbert on {keras.backend.backend()}")

    def kbert_rank():
        return [model.rank(q, docs, batch_size=args.batch_size) for q, docs in zip(queries, candidates)]

    def st_rank():
        return [ce.rank(q, docs, batch_size=args.batch_size) for q, docs in zip(queries, candidates)]

    def kbert_all():
        return model.predict([q for q, _ in pairs], pairs=[d for _, d in pairs], batch_size=args.batch_size)

    def st_all():
        return ce.predict(pairs, batch_size=args.batch_size)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fn in (kbert_rank, st_rank, kbert_all, st_all):
            fn()  # warm-up: tracing / compiling each bucketed shape, thread pools
        results = {name: timed(fn, args.repeats) for name, fn in
                   (("kbert rank", kbert_rank), ("st rank", st_rank), ("kbert all", kbert_all), ("st all", st_all))}
    same_order = sum([r["corpus_id"] for r in a] == [r["corpus_id"] for r in b]
                     for a, b in zip(results["kbert rank"][1], results["st rank"][1]))
    diff = float(np.max(np.abs(results["kbert all"][1] - results["st all"][1])))
    print(f"\nscores: max |kbert - sentence-transformers| {diff:.1e}; the same order for {same_order} of "
          f"{len(queries)} queries")
    print("\n| side | pairs/s | vs sentence-transformers |")
    print("|---|---:|---:|")
    for kind, label in (("rank", "query by query (`rank`)"), ("all", "every pair in one call (`predict`)")):
        ref = len(pairs) / results[f"st {kind}"][0]
        for side, name in (("kbert", "kbert TaskModel"), ("st", "sentence-transformers CrossEncoder")):
            speed = len(pairs) / results[f"{side} {kind}"][0]
            print(f"| {name}, {label} | {speed:,.0f} | {speed / ref:.2f}x |")


if __name__ == "__main__":
    main()
