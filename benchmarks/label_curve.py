"""Where a small pretraining budget pays off: sentiment accuracy with few labelled reviews.

Takes a finished `benchmarks/quality.py` output directory (its tokenizer, pretrained model and the same
model from random initialization) and fine-tunes both on the first N reviews of the same NSMC-style
training split, for several N, with the same settings as quality.py (batch 32, lr 2e-4, max length 64,
dropout 0.1) but several epochs (few examples). Accuracy is on the same dev split. Each result is cached
in `RUN/label-curve-<name>-<N>.json`, so an interrupted run continues.

    python benchmarks/label_curve.py --run ~/.cache/kbert/quality --shared ../shared/data --sizes 2000,10000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_arguments(description):
    """The arguments both this script and linear_probe.py take: a quality.py run and the sentiment split."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--run", required=True, help="a benchmarks/quality.py --out directory")
    parser.add_argument("--shared", default=os.path.join("..", "shared", "data"))
    parser.add_argument("--sizes", default="2000,10000", help="labelled training reviews, comma-separated")
    parser.add_argument("--dev-examples", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def load_run(args):
    """(pretraining summary, {"pretrained": dir, "random-init": dir}, sorted sizes, train rows, dev rows)."""
    from kbert.data.recipes import movie_review_sentiment

    with open(os.path.join(args.run, "pretraining.json"), encoding="utf-8") as f:
        pre = json.load(f)
    models = {"pretrained": pre["model_dir"], "random-init": os.path.join(args.run, "random-init")}
    for name, path in models.items():
        if not os.path.isdir(path):
            sys.exit(f"{path} is missing: run benchmarks/quality.py --out {args.run} first")
    reviews = os.path.join(args.shared, "movie-reviews", "reviews.tsv.gz")
    sizes = sorted(int(s) for s in args.sizes.split(","))
    train_all = movie_review_sentiment(reviews, "train", limit=sizes[-1], seed=args.seed)
    dev = movie_review_sentiment(reviews, "dev", limit=args.dev_examples, seed=args.seed)
    return pre, models, sizes, train_all, dev


def main():
    parser = run_arguments(__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=float, default=3.0)
    args = parser.parse_args()

    import kbert

    pre, models, sizes, train_all, dev = load_run(args)
    print(f"objective {pre.get('objective', 'mlm')}, {pre['steps']} pretraining steps; dev {len(dev):,} reviews")

    rows = []
    for n in sizes:
        train = train_all[:n]
        for name, path in models.items():
            cache = os.path.join(args.run, f"label-curve-{name}-{n}.json")
            if os.path.isfile(cache):
                with open(cache, encoding="utf-8") as f:
                    result = json.load(f)
            else:
                t = time.time()
                steps_per_epoch = -(-len(train) // 32)
                summary = kbert.finetune(path, "classification", train, dev,
                                         out_dir=os.path.join(args.run, f"label-curve-{name}-{n}"),
                                         epochs=args.epochs, batch_size=32, learning_rate=2e-4, max_length=64,
                                         patience=None, eval_every=max(1, steps_per_epoch // 2), seed=args.seed,
                                         progress=False)
                result = {"best": summary["best"], "history": summary["history"], "seconds": round(time.time() - t)}
                with open(cache, "w", encoding="utf-8") as f:
                    json.dump(result, f)
            print(f"{n:>7,} labelled, {name:11s}: dev accuracy {result['best']:.4f} ({result['seconds']} s)", flush=True)
            rows.append((n, name, result["best"]))

    print("\n| labelled reviews | pretrained | random init | gain |")
    print("|---:|---:|---:|---:|")
    for n in sizes:
        acc = {name: a for m, name, a in rows if m == n}
        print(f"| {n:,} | {acc['pretrained']:.4f} | {acc['random-init']:.4f} | "
              f"{(acc['pretrained'] - acc['random-init']) * 100:+.1f} points |")


if __name__ == "__main__":
    main()
