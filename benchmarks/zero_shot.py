"""Zero-shot classification: `TaskModel.zero_shot` beside transformers' zero-shot-classification pipeline on
the same NLI weights, and what an NLI model trained on this project's data gets on two Korean label sets it never
saw, in one run.

1. NLI: `kbert.finetune(..., "pair-classification")` on KorNLI's XNLI dev pairs (the only KorNLI split here): a
   fixed 10% of its premises (by hash) is the split that picks the checkpoint, the rest trains.
2. Zero-shot, reported once, nothing tuned on either (labels and templates fixed before the run):
   - sentiment of movie reviews (`kbert.data.recipes.movie_review_sentiment`, dev movies, balanced): labels
     긍정 / 부정 in the default template ("이 예시는 {}입니다.");
   - the statement / question / command utterances of 3i4k's test split: labels 진술 / 질문 / 명령.
   Each beside the majority class.
3. The NLI model exported with `kbert.export_transformers` in transformers' pipeline on the reviews: speed ratio,
   the same top label, largest score difference.

    python benchmarks/zero_shot.py --model /path/to/kbert-pretrain/model [--epochs 3] [--learning-rate 1e-4]

Without `--model` a random bert-mini is used (agreement and speed only; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from random_model import random_model  # noqa: E402  (benchmarks/random_model.py)

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data")
INTENTS = {"1": "진술", "2": "질문", "3": "명령"}  # 3i4k's statement, question, command


def nli_rows(path):
    """(train, selection) rows of KorNLI: {"text", "pair", "label"}; a premise's pairs stay on one side."""
    train, selection = [], []
    with open(path, encoding="utf-8") as f:
        for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
            item = {"text": row["sentence1"], "pair": row["sentence2"], "label": row["gold_label"]}
            side = hashlib.md5(row["sentence1"].encode()).digest()[0] < 26  # about 10%
            (selection if side else train).append(item)
    return train, selection


def intent_rows(path, per_class):
    """The first `per_class` utterances of each of 3i4k's statement, question and command classes."""
    out, counts = [], dict.fromkeys(INTENTS, 0)
    with open(path, encoding="utf-8") as f:
        for line in f:
            label, _, text = line.rstrip("\n").partition("\t")
            if label in INTENTS and counts[label] < per_class and text.strip():
                counts[label] += 1
                out.append((text.strip(), INTENTS[label]))
    return out


def accuracy(model, rows, labels, batch_size):
    found = model.zero_shot([t for t, _ in rows], labels, batch_size=batch_size)
    hits = sum(f["labels"][0] == gold for f, (_, gold) in zip(found, rows))
    majority = max(sum(g == label for _, g in rows) for label in labels) / len(rows)
    return hits / len(rows), majority


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a pretrained kbert model dir (default: random bert-mini)")
    parser.add_argument("--shared", default=SHARED, help="the shared data dir")
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--reviews", type=int, default=1000, help="reviews scored (balanced)")
    parser.add_argument("--intents", type=int, default=300, help="3i4k utterances a class")
    args = parser.parse_args()

    import transformers

    import kbert
    from kbert.data.recipes import movie_review_sentiment
    from kbert.embed.zero_shot import DEFAULT_TEMPLATE

    transformers.logging.set_verbosity_error()
    from scratch import scratch_dir  # benchmarks/scratch.py: removed at exit
    tmp = scratch_dir()
    model_dir = args.model or random_model(os.path.join(tmp, "model"))
    train, selection = nli_rows(os.path.join(args.shared, "kornli", "xnli.dev.ko.tsv"))
    print(f"NLI: train {len(train)} pairs, selection {len(selection)} (picks the checkpoint); model "
          f"{args.model or 'random bert-mini'}")
    start = time.perf_counter()
    out = os.path.join(tmp, "nli")
    summary = kbert.finetune(model_dir, "pair-classification", train, selection, out_dir=out, pair_column="pair",
                             epochs=args.epochs, learning_rate=args.learning_rate, batch_size=args.batch_size,
                             max_length=128, progress=False)
    nli = kbert.TaskModel.load(out)
    print(f"NLI selection {summary['metric']} {summary['best']:.3f} (3 classes; {time.perf_counter() - start:.0f} s)")

    reviews = [(r["text"], "긍정" if r["label"] == "1" else "부정") for r in
               movie_review_sentiment(os.path.join(args.shared, "movie-reviews", "reviews.tsv.gz"), split="dev",
                                      limit=args.reviews)]
    intents = intent_rows(os.path.join(args.shared, "3i4k", "fci_test.txt"), args.intents)
    print("\n| zero-shot set | texts | labels | kbert zero_shot accuracy | majority class |\n|---|---:|---|---:|---:|")
    for name, rows, labels in (("movie-review sentiment (dev movies)", reviews, ["긍정", "부정"]),
                               ("3i4k statement / question / command (test)", intents, list(INTENTS.values()))):
        acc, majority = accuracy(nli, rows, labels, args.batch_size)
        print(f"| {name} | {len(rows)} | {' / '.join(labels)} | {acc:.3f} | {majority:.3f} |")

    hf_dir = kbert.export_transformers(nli, os.path.join(tmp, "hf"))
    pipe = transformers.pipeline("zero-shot-classification", model=hf_dir)
    texts, labels = [t for t, _ in reviews], ["긍정", "부정"]
    template = DEFAULT_TEMPLATE  # the pipeline's own default is English ("This example is {}.")
    nli.zero_shot(texts[:8], labels)
    pipe(texts[:8], candidate_labels=labels, hypothesis_template=template, batch_size=args.batch_size)
    start = time.perf_counter()
    ours = nli.zero_shot(texts, labels, batch_size=args.batch_size)
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    theirs = pipe(texts, candidate_labels=labels, hypothesis_template=template, batch_size=args.batch_size)
    theirs_s = time.perf_counter() - start
    same = sum(a["labels"] == b["labels"] for a, b in zip(ours, theirs))
    diff = max(abs(x - y) for a, b in zip(ours, theirs)
               for x, y in zip(a["scores"], [b["scores"][b["labels"].index(label)] for label in a["labels"]]))
    print("\n| side (reviews, 2 labels) | texts/s | vs transformers | same ranking |\n|---|---:|---:|---|")
    print(f"| kbert TaskModel.zero_shot | {len(texts) / ours_s:.1f} | {theirs_s / ours_s:.2f}x | {same} of "
          f"{len(texts)}; largest score difference {diff:.1e} |")
    print(f"| transformers zero-shot-classification pipeline | {len(texts) / theirs_s:.1f} | 1.00x | |")


if __name__ == "__main__":
    main()
