"""LAMB as ALBERT trains with it (kbert's `Lamb`) beside Keras' own `Lamb`: the same ALBERT pretraining run with
each, and what each leaves on held-out text.

The two differ in the update only (kbert/train/optimizers.py): ALBERT's recipe adds the weight decay to Adam's
step before the layer-wise trust ratio `||w|| / ||step||` and leaves LayerNorm parameters and biases out of
both; Keras' decays every weight outside the ratio and scales the biases' and norms' steps by their own
ratio (a bias that has just left zero then takes steps about `lr` times its Adam step). Everything else is
the same: model, data order, masks, seed, schedule (ALBERT's published learning rate 0.00176 and weight decay
0.01, with 10% warm-up; nothing here was tuned). `adamw` (BERT's optimizer, at the same schedule) can run
beside them as a reference point.

A small ALBERT (4 layers, hidden 256, embeddings 128) learns a unigram vocabulary of the first `--docs`
Korean statutes and pretrains on them (masked LM + sentence order); the report is the mean loss of the last
50 steps, each model's pseudo-perplexity (`kbert.MaskedLM.pseudo_perplexity`) on sentences of statutes after
those (never trained on), and how far the biases moved from zero.

    python benchmarks/lamb.py --shared ../shared/data
    python benchmarks/lamb.py --shared ../shared/data --steps 400 --optimizers lamb,keras-lamb,adamw
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kbert  # noqa: E402
from kbert.train import optimizers  # noqa: E402

MODEL = {"preset": "albert-base", "hidden_size": 256, "num_layers": 4, "num_heads": 4, "intermediate_size": 1024,
         "embedding_size": 128, "dropout": 0.0, "attention_dropout": 0.0}


def statutes_split(shared: str, docs: int, held_out: int, train_path: str):
    """The first `docs` statutes as kbert's plain-text corpus (a sentence per line, a blank line between
    documents); `held_out` sentences (20-150 characters, one in five) of the statutes after them."""
    source = os.path.join(shared, "korean-statutes", "documents.jsonl.gz")
    documents = iter(kbert.corpus(source, text_field="text"))
    chars = 0
    with open(train_path, "w", encoding="utf-8") as f:
        for _ in range(docs):
            doc = next(documents)
            f.write("\n".join(doc) + "\n\n")
            chars += sum(len(s) for s in doc)
    lines = []
    for doc in documents:
        lines += [s for s in doc[::5] if 20 <= len(s) <= 150]
        if len(lines) >= held_out:
            break
    return chars, lines[:held_out]


def run(name: str, args, text: str, tok_dir: str, held_out, out: str) -> dict:
    name_to_optimizer = {"lamb": "lamb", "keras-lamb": "lamb", "adamw": "adamw"}
    config = {"model": dict(MODEL),
              "data": {"source": text, "tokenizer": tok_dir, "objective": "mlm+sop", "max_length": args.seq,
                       "workers": 1},
              "optimizer": {"name": name_to_optimizer[name], "learning_rate": args.lr,
                            "weight_decay": args.weight_decay, "warmup_steps": args.steps // 10},
              "trainer": {"steps": args.steps, "batch_size": args.batch, "log_every": 10,
                          "checkpoint_every": 100_000},
              "runtime": {"strategy": "cpu", "seed": args.seed}, "output_dir": os.path.join(out, name)}
    mine = optimizers.Lamb
    if name == "keras-lamb":  # the class make_optimizer builds for `lamb`, for this run only
        optimizers.Lamb = keras.optimizers.Lamb
    start = time.time()
    try:
        summary = kbert.pretrain(config, progress=True)
    finally:
        optimizers.Lamb = mine
    minutes = (time.time() - start) / 60
    lm = kbert.MaskedLM.load(summary["model_dir"])
    pppl = lm.pseudo_perplexity(held_out)
    model = kbert.load_model(summary["model_dir"])
    biases = [np.asarray(w) for w in model.weights if w.path.endswith("bias")]
    return {"optimizer": name, "loss_last_50": float(np.mean(summary["history"][-50:])),
            "loss_first_10": float(np.mean(summary["history"][:10])), "held_out_pppl": pppl,
            "bias_rms": float(np.sqrt(np.mean(np.concatenate([b.ravel() for b in biases]) ** 2))),
            "minutes": minutes}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))
    parser.add_argument("--optimizers", default="lamb,keras-lamb")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.00176)  # ALBERT's (LAMB, batch 4096)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--docs", type=int, default=600)
    parser.add_argument("--held-out", type=int, default=400)
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="a dir for the runs (default: a temporary one)")
    args = parser.parse_args(argv)
    names = args.optimizers.split(",")
    unknown = set(names) - {"lamb", "keras-lamb", "adamw"}
    if unknown:
        parser.error(f"--optimizers: unknown {sorted(unknown)}; choose from lamb, keras-lamb, adamw")

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or tmp
        os.makedirs(out, exist_ok=True)
        text = os.path.join(out, "statutes.txt")
        chars, held_out = statutes_split(args.shared, args.docs, args.held_out, text)
        tok_dir = os.path.join(out, "tok")
        kbert.Tokenizer.train(text, vocab_size=args.vocab_size, progress=False, seed=args.seed).save(tok_dir)
        print(f"{args.docs} statutes ({chars / 1e6:.1f}M characters) for pretraining, {len(held_out)} held-out "
              f"sentences; {args.steps} steps of {args.batch} x {args.seq}, lr {args.lr}, weight decay "
              f"{args.weight_decay}", flush=True)
        rows = [run(name, args, text, tok_dir, held_out, out) for name in names]

    print("\n| optimizer | loss, first 10 steps | loss, last 50 steps | held-out pseudo-perplexity | bias RMS "
          "| minutes |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['optimizer']} | {r['loss_first_10']:.3f} | {r['loss_last_50']:.3f} | {r['held_out_pppl']:.1f} "
              f"| {r['bias_rms']:.4f} | {r['minutes']:.1f} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
