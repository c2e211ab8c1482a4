"""Pretraining on short documents (a movie review per document): google-research/bert's pairing beside
kbert's `data.join_documents`, in one run.

google-research/bert builds each example from one document (`create_instances_from_document`), and kbert
does the same by default; on a corpus of short texts that gives examples of one or two texts, mostly padding,
and NSP pairs that are all "random" (a one-sentence document has no next sentence). `join_documents=True`
joins consecutive short documents until each fills a sequence. This script prints, for the same reviews:

1. what the examples hold: the share of text tokens and of NSP "next" pairs, at two sequence lengths;
2. what the compute buys: the same bert-mini pretrained the same number of steps on each form (same
   tokenizer, seed, batch and schedule), then its pseudo-perplexity (`kbert.MaskedLM`, each token masked in
   turn) on reviews of movies held out of the training text (lower is better), and the sentiment accuracy
   of each model fine-tuned on `--sentiment` training reviews for one epoch (`--seeds` fine-tuning seeds),
   on reviews of the held-out movies (`movie_review_sentiment`'s dev split).

Each pretraining's figures are kept in OUT/{plain,joined}/result.json, so a rerun reads them instead of
training again.

    python benchmarks/short_documents.py --reviews ../shared/data/movie-reviews/reviews.tsv.gz --out /tmp/short

The figures and the command are recorded in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import itertools
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def held_out(movie_id: str) -> bool:
    """The dev tenth of the movies (quality.py's and `movie_review_sentiment`'s rule): never trained on."""
    return hashlib.md5(str(movie_id).encode()).digest()[0] / 256.0 < 0.1


def write_reviews(path_gz: str, out: str, limit: int, held: int):
    """The training reviews as kbert's plain-text corpus (a blank line between documents: one review
    each), and `held` reviews of held-out movies."""
    train, test = os.path.join(out, "reviews.txt"), []
    n = 0
    with gzip.open(path_gz, "rt", encoding="utf-8") as src, open(train, "w", encoding="utf-8") as dst:
        for row in csv.DictReader(src, delimiter="\t", quoting=csv.QUOTE_NONE):
            text = " ".join((row.get("text") or "").split())
            if len(text) < 2:
                continue
            if held_out(row["movie_id"]):
                if len(test) < held:
                    test.append(text)
            elif n < limit:
                dst.write(text + "\n\n")
                n += 1
            if n >= limit and len(test) >= held:
                break
    return train, test, n


def example_stats(source, tokenizer, max_length: int, join: bool, batches: int = 20) -> dict:
    import warnings

    import kbert

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the padding warning is what row 1 measures
        ds = kbert.pretraining_dataset(source, tokenizer, max_length=max_length, batch_size=256, workers=0,
                                       repeat=False, shuffle_buffer=0, join_documents=join)
    text = total = nexts = pairs = 0
    for features, labels in itertools.islice(iter(ds), batches):
        mask = features["padding_mask"].numpy()
        text, total = text + int(mask.sum()), total + mask.size
        nexts, pairs = nexts + int((labels["pair_labels"].numpy() == 0).sum()), pairs + len(mask)
    return {"text_share": text / total, "next_share": nexts / pairs}


def pretrain(source, tokenizer_dir: str, out: str, join: bool, steps: int, batch: int, max_length: int,
             embedding_init: str, model="bert-mini") -> dict:
    import kbert

    config = {"model": model,
              "data": {"source": source, "tokenizer": tokenizer_dir, "max_length": max_length, "workers": 0,
                       "join_documents": join},
              "optimizer": {"learning_rate": 1e-3, "warmup_steps": max(1, steps // 10)},
              "trainer": {"steps": steps, "batch_size": batch, "checkpoint_every": steps, "log_every": 50,
                          "embedding_init": embedding_init},
              "runtime": {"seed": 0}, "output_dir": out}
    started = time.perf_counter()
    summary = kbert.pretrain(config, progress=False)
    return {"seconds": time.perf_counter() - started, "tokens_per_s": summary["tokens_per_second"],
            "mlm_accuracy": summary["mlm_accuracy"], "model_dir": os.path.join(out, "model")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reviews", default="../shared/data/movie-reviews/reviews.tsv.gz")
    p.add_argument("--out", required=True)
    p.add_argument("--limit", type=int, default=200_000, help="training reviews")
    p.add_argument("--held", type=int, default=300, help="held-out reviews for pseudo-perplexity")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--model", default="bert-mini", help="a preset, or a JSON ModelConfig mapping (the CI smoke test)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--embedding-init", default="cooccurrence",
                   help="trainer.embedding_init of both runs (cooccurrence: past the unigram plateau sooner, so a "
                        "short run's held-out figure tells the two apart)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--sentiment", type=int, default=20_000,
                   help="training reviews for the sentiment check (0: none)")
    p.add_argument("--seeds", type=int, default=3, help="fine-tuning seeds of the sentiment check")
    p.add_argument("--json", action="store_true", help="print the results as one JSON line last")
    args = p.parse_args(argv)

    import kbert

    os.makedirs(args.out, exist_ok=True)
    source, test, n = write_reviews(args.reviews, args.out, args.limit, args.held)
    tok_dir = os.path.join(args.out, "tokenizer")
    if not os.path.isdir(tok_dir):
        kbert.Tokenizer.train(kbert.Corpus(source), vocab_size=args.vocab, progress=False).save(tok_dir)
    tokenizer = kbert.Tokenizer.load(tok_dir)
    print(f"{n:,} training reviews (one per document), {len(test)} held-out reviews, {args.vocab:,} pieces")

    stats = {(m, j): example_stats(source, tokenizer, m, j) for m in (args.max_length, 2 * args.max_length)
             for j in (False, True)}
    print("\n| examples | seq | text tokens | NSP pairs that are real next text |\n|---|---:|---:|---:|")
    for (m, j), s in stats.items():
        print(f"| {'joined (kbert join_documents)' if j else 'one document each (google-research/bert)'} | {m} | "
              f"{100 * s['text_share']:.1f}% | {100 * s['next_share']:.1f}% |")

    runs = {}
    for j in (False, True):
        run_dir = os.path.join(args.out, "joined" if j else "plain")
        kept = os.path.join(run_dir, "result.json")
        if os.path.isfile(kept):
            with open(kept, encoding="utf-8") as f:
                runs[j] = json.load(f)
            continue
        runs[j] = pretrain(source, tok_dir, run_dir, j, args.steps, args.batch, args.max_length,
                           args.embedding_init, json.loads(args.model) if args.model.startswith("{") else args.model)
        runs[j]["pseudo_perplexity"] = float(kbert.MaskedLM.load(run_dir).pseudo_perplexity(test))
        with open(kept, "w", encoding="utf-8") as f:
            json.dump(runs[j], f)
    if args.sentiment:
        from kbert.data.recipes import movie_review_sentiment

        reviews_dir = os.path.dirname(os.path.abspath(args.reviews))
        train = movie_review_sentiment(reviews_dir, "train", limit=args.sentiment)
        dev = movie_review_sentiment(reviews_dir, "dev", limit=3000)
        for j, r in runs.items():
            r["sentiment"] = [kbert.finetune(r["model_dir"], "classification", train, dev, epochs=1, batch_size=64,
                                             max_length=args.max_length, learning_rate=1e-4, seed=seed,
                                             out_dir=os.path.join(args.out, f"sentiment-{'joined' if j else 'plain'}-{seed}"),
                                             progress=False)["best"] for seed in range(args.seeds)]
    name = args.model if not args.model.startswith("{") else "the model"
    print(f"\n| {name}, {args.steps} steps x {args.batch} x {args.max_length} tokens | tokens/s | text tokens/s "
          f"| masked-LM accuracy (last steps) | held-out pseudo-perplexity | sentiment accuracy, mean (per seed) |"
          f"\n|---|---:|---:|---:|---:|---:|")
    for j, r in runs.items():
        share = stats[(args.max_length, j)]["text_share"]
        accuracy = r.get("sentiment") or []
        cell = (f"{sum(accuracy) / len(accuracy):.4f} ({', '.join(f'{a:.4f}' for a in accuracy)})" if accuracy
                else "n/a")
        print(f"| {'joined' if j else 'one document each'} | {r['tokens_per_s']:,.0f} | "
              f"{r['tokens_per_s'] * share:,.0f} | {r['mlm_accuracy']:.3f} | {r['pseudo_perplexity']:.1f} | {cell} |")
    ratio = runs[False]["pseudo_perplexity"] / runs[True]["pseudo_perplexity"]
    print(f"\npseudo-perplexity, one document each / joined: {ratio:.2f}x")
    if args.json:
        print(json.dumps({"stats": {f"{m}-{'joined' if j else 'plain'}": s for (m, j), s in stats.items()},
                          "runs": {("joined" if j else "plain"): r for j, r in runs.items()}, "ratio": ratio}))


if __name__ == "__main__":
    main()
