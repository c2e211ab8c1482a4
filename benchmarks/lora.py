"""LoRA fine-tuning: kbert's (`kbert.finetune(..., lora_rank=8)`) beside full fine-tuning and beside PEFT's LoRA on
transformers (torch, CPU), same model, data and settings, in one run.

Task: NSMC-style movie-review sentiment (`kbert.data.recipes.movie_review_sentiment`): `--train` reviews of the
training movies, the last tenth of them held out to pick each run's best epoch; accuracy reported once on
`--report` reviews of the dev movies. The settings were fixed before the run (not tuned on the report set):
2 epochs, batch 32, 64 tokens, AdamW (weight decay 0.01, clipping at norm 1, 10% warm-up then linear decay);
full fine-tuning at lr 1e-4, LoRA at lr 1e-3 with rank 8, alpha 16, on every linear projection of each block,
the pooler and classifier trained in full (PEFT: `modules_to_save`).

    python benchmarks/lora.py --model /path/to/kbert-pretrain/model [--train 4000] [--report 2000]

Without `--model` a random bert-mini is used (the arms' speed only; its accuracies mean nothing).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from random_model import random_model  # noqa: E402  (benchmarks/random_model.py)

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data")
EPOCHS, BATCH, LENGTH, RANK, ALPHA = 2, 32, 64, 8, 16
LR = {"full": 1e-4, "lora": 1e-3}


def peft_run(hf_dir, tokenizer_dir, train, select, report, seed=0):
    """PEFT's LoRA on BertForSequenceClassification: (report accuracy at the best selection epoch, trained
    weights, all weights, seconds of the training loop with its evaluations, steps)."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir, num_labels=2)
    total = sum(p.numel() for p in model.parameters())
    config = peft.LoraConfig(task_type="SEQ_CLS", r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                             target_modules=["query", "key", "value", "attention.output.dense",
                                             "intermediate.dense", "output.dense"],
                             modules_to_save=["classifier", "pooler"])
    model = peft.get_peft_model(model, config)
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for n, p in model.named_parameters() if p.requires_grad and "bias" not in n and "LayerNorm" not in n]
    rest = [p for p in trained if all(p is not q for q in decay)]
    steps = EPOCHS * math.ceil(len(train) / BATCH)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                                  lr=LR["lora"], eps=1e-6)
    schedule = transformers.get_linear_schedule_with_warmup(optimizer, int(0.1 * steps), steps)

    def batches(rows, shuffle, rng=None):
        order = rng.permutation(len(rows)) if shuffle else np.arange(len(rows))
        for i in range(0, len(rows), BATCH):
            part = [rows[j] for j in order[i:i + BATCH]]
            enc = tok([r["text"] for r in part], truncation=True, max_length=LENGTH, padding=True,
                      return_tensors="pt")
            yield enc, torch.tensor([int(r["label"]) for r in part])

    def accuracy(rows):
        model.eval()
        hits = 0
        with torch.no_grad():
            for enc, y in batches(rows, False):
                hits += int((model(**enc).logits.argmax(-1) == y).sum())
        model.train()
        return hits / len(rows)

    rng = np.random.default_rng(seed)
    best, best_report, done = -1.0, None, 0
    model.train()
    start = time.perf_counter()
    for _ in range(EPOCHS):
        for enc, y in batches(train, True, rng):
            loss = torch.nn.functional.cross_entropy(model(**enc).logits, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            done += 1
        score = accuracy(select)
        if score > best:  # (the report set is scored here only to keep the best epoch's figure, off the clock)
            paused = time.perf_counter()
            best, best_report = score, accuracy(report)
            start += time.perf_counter() - paused
    return best_report, sum(p.numel() for p in trained), total, time.perf_counter() - start, done


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a pretrained kbert model dir (default: random bert-mini)")
    parser.add_argument("--shared", default=SHARED)
    parser.add_argument("--train", type=int, default=4000, help="training-movie reviews (a tenth held out)")
    parser.add_argument("--report", type=int, default=2000, help="dev-movie reviews, reported once")
    args = parser.parse_args()

    import transformers

    import kbert
    from kbert.data.recipes import movie_review_sentiment

    transformers.logging.set_verbosity_error()
    from scratch import scratch_dir  # benchmarks/scratch.py: removed at exit
    tmp = scratch_dir()
    model_dir = args.model or random_model(os.path.join(tmp, "model"))
    reviews = os.path.join(args.shared, "movie-reviews", "reviews.tsv.gz")
    rows = movie_review_sentiment(reviews, "train", limit=args.train)
    cut = len(rows) // 10
    train, select = rows[cut:], rows[:cut]
    report = movie_review_sentiment(reviews, "dev", limit=args.report)
    print(f"train {len(train)} reviews, selection {len(select)} (picks the epoch), report {len(report)}; model "
          f"{args.model or 'random bert-mini'}")

    results = {}
    for arm in ("full", "lora"):
        out = os.path.join(tmp, arm)
        lora = dict(lora_rank=RANK, lora_alpha=ALPHA) if arm == "lora" else {}
        start = time.perf_counter()
        summary = kbert.finetune(model_dir, "classification", train, select, out_dir=out, epochs=EPOCHS,
                                 batch_size=BATCH, max_length=LENGTH, learning_rate=LR[arm], patience=None,
                                 progress=False, **lora)
        seconds = time.perf_counter() - start
        model = kbert.TaskModel.load(out)
        probs = model.predict([r["text"] for r in report])
        acc = float(np.mean([model.labels[i] == r["label"] for i, r in zip(np.argmax(probs, axis=1), report)]))
        results[arm] = (acc, summary, seconds)
        print(f"kbert {arm}: selection accuracy {summary['best']:.4f} at step {summary['best_step']}, report "
              f"{acc:.4f} ({seconds:.0f} s, {summary['steps']} steps)")

    # with the tokenizer: transformers 5 reads a dir without one as an empty vocabulary (every token [UNK])
    hf_dir = kbert.export_transformers(kbert.load_model(model_dir), os.path.join(tmp, "hf"),
                                       tokenizer=kbert.Tokenizer.from_model_dir(model_dir))
    peft_acc, peft_trained, peft_total, peft_seconds, peft_steps = peft_run(hf_dir, hf_dir, train, select, report)
    peft_step = peft_seconds / peft_steps
    print(f"PEFT LoRA: report {peft_acc:.4f}, {peft_trained:,} of {peft_total:,} weights train, "
          f"{peft_seconds:.0f} s, {peft_steps} steps")

    config = kbert.load_model(model_dir).config
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_layers
    factors = layers * RANK * ((h + 3 * h) + (h + h) + (h + i) + (i + h))
    head = h * h + h + 2 * h + 2  # pooler and classifier
    print("\n| arm | report accuracy | weights trained | seconds a step (training loop with its selection "
          "evaluations / steps) |")
    print("|---|---:|---:|---:|")
    for arm, name in (("full", "kbert full fine-tuning"), ("lora", f"kbert LoRA r={RANK}")):
        acc, summary, _ = results[arm]
        trained = "all" if arm == "full" else f"{factors + head:,}"
        print(f"| {name} | {acc:.4f} | {trained} | {summary['seconds'] / summary['steps']:.3f} |")
    print(f"| PEFT LoRA r={RANK} (transformers, torch) | {peft_acc:.4f} | {peft_trained:,} | {peft_step:.3f} |")
    lora = results["lora"][1]
    print(f"\nkbert LoRA is {peft_step / (lora['seconds'] / lora['steps']):.2f}x PEFT's speed a step")


if __name__ == "__main__":
    main()
