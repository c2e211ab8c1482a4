"""End-to-end pretraining throughput through `kbert.pretrain` (input pipeline, masking, train step, logging,
checkpointing): tokens/s and model-FLOPs utilization (MFU) against this machine's measured matmul peak.

Runs `kbert.pretrain` on the synthetic `dummy` source (so the figure is the trainer's, not the corpus
reader's) for each model, after a warm-up run that compiles the step, and prints tokens/s and MFU beside the
bare-matmul peak measured in the same run. `--precisions float32,mixed_bfloat16` runs each model in both
and prints bf16's tokens/s as a ratio of float32's (on a CPU with native bf16 instructions; XLA on for
float32, off for bf16: `runtime.jit: auto`). On a GPU machine the same models run on Keras' JAX backend with
`benchmarks/train_step.py`-style synthetic batches (see benchmarks/README.md for the device figures).
`--backends tensorflow,jax` runs the same configs under each Keras backend (a child process each: the
backend is fixed at import) and prints them side by side, each as a ratio of the first backend's figure.

    python benchmarks/pretrain.py --models bert-tiny,bert-mini --seq 128 --batch 32 --steps 40
    python benchmarks/pretrain.py --models bert-mini --seq 64 --precisions float32,mixed_bfloat16
    python benchmarks/pretrain.py --models bert-mini --seq 64 --vocab-size 16000 --backends tensorflow,jax
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

from train_step import matmul_peak  # noqa: E402

from kbert.train.flops import pretrainer_last_layer_rows, train_flops_per_step  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert-tiny,bert-mini")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--precisions", default="float32",
                        help="comma-separated runtime.precision values, each model in each (float32 first: the reference)")
    parser.add_argument("--backends", default=None,
                        help="comma-separated Keras backends to compare (a child process each); default: the current one")
    parser.add_argument("--jit", default="auto", choices=("auto", "true", "false"),
                        help="runtime.jit (XLA for the step; auto: on for float32 on one CPU, off for bf16 there)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON lines (what a child reports)")
    args = parser.parse_args(argv)
    if args.backends:
        return compare_backends(args, argv if argv is not None else sys.argv[1:])

    import kbert
    from kbert.data.masking import default_max_predictions
    from kbert.models.config import ModelConfig

    from scratch import scratch_dir  # benchmarks/scratch.py: removed at exit
    tmp = scratch_dir(prefix="kbert-pretrain-bench-")
    # a small tokenizer for the dummy source; the model's embedding table has the full --vocab-size
    tok = kbert.Tokenizer.train(kbert.corpus(["kolaw", "kobill"]), vocab_size=2000, progress=False)
    tok.save(os.path.join(tmp, "tok"))
    precisions = args.precisions.split(",")
    peaks = {p: matmul_peak(dtype=p.replace("mixed_", "")) for p in precisions}
    if not args.json:
        print(f"{os.cpu_count()} cpus; measured matmul peak "
              + ", ".join(f"{p}: {v / 1e9:.1f} GFLOP/s" for p, v in peaks.items()))
        print("| model | params | precision | XLA | tokens/s | vs first precision | MFU (of its matmul peak) |")
        print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        cfg = ModelConfig.preset(name, vocab_size=args.vocab_size)
        predictions = default_max_predictions(args.seq)
        # what kbert.pretrain computes (its last block at [CLS] and the masked positions), as its own MFU
        flops = train_flops_per_step(cfg, args.batch, args.seq, predictions, pretrainer_last_layer_rows(predictions))
        first = None
        for precision in precisions:
            config = {"model": {"preset": name, "vocab_size": args.vocab_size},
                      "data": {"source": "dummy", "tokenizer": os.path.join(tmp, "tok"),
                               "max_length": args.seq, "max_predictions": predictions},
                      "optimizer": {"learning_rate": 1e-4, "warmup_steps": 10},
                      "trainer": {"steps": args.steps, "batch_size": args.batch, "log_every": 10,
                                  "checkpoint_every": 10 ** 9},
                      "runtime": {"strategy": "auto", "precision": precision,
                                  "jit": {"auto": "auto", "true": True, "false": False}[args.jit]}}
            out = os.path.join(tmp, f"{name}-{precision}")
            kbert.pretrain(dict(config, output_dir=out), progress=False, stop_after=5)  # compile + warm-up
            t0 = time.perf_counter()
            summary = kbert.pretrain(dict(config, output_dir=out), progress=False)
            elapsed = time.perf_counter() - t0
            tps = summary["tokens_per_second"]
            first = first or tps
            steps_per_s = tps / (args.batch * args.seq)
            if args.json:
                print(json.dumps({"model": name, "precision": summary["precision"], "jit": summary["jit"],
                                  "tokens_per_second": tps,
                                  "steady_tokens_per_second": summary.get("steady_tokens_per_second"),
                                  "mfu": flops * steps_per_s / peaks[precision], "seconds": elapsed}), flush=True)
                continue
            print(f"| {name} | {cfg.num_parameters() / 1e6:.1f}M | {summary['precision']} | {summary['jit']} | "
                  f"{tps:,.0f} | {tps / first:.2f}x | {flops * steps_per_s / peaks[precision] * 100:.1f}% |"
                  f"  ({args.steps - 5} steps in {elapsed:.1f}s incl. start-up and the final save)")

def compare_backends(args, argv):
    """One child per backend (`KERAS_BACKEND` set before anything imports Keras), the same flags and
    `--json`; prints one table with each row's steady tokens/s (the first step, tracing and compilation,
    left out) as a ratio of the first backend's figure for that model and precision."""
    backends = args.backends.split(",")
    flags, skip = [], False
    for a in argv:  # the child gets every flag but --backends
        if skip:
            skip = False
        elif a == "--backends":
            skip = True
        elif not a.startswith("--backends="):
            flags.append(a)
    rows = []
    for backend in backends:
        env = dict(os.environ, KERAS_BACKEND=backend)
        done = subprocess.run([sys.executable, os.path.abspath(__file__), *flags, "--json"], env=env,
                              capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"the {backend} run failed:\n{done.stderr[-3000:]}")
        rows += [dict(json.loads(line), backend=backend) for line in done.stdout.splitlines() if line.startswith("{")]
    print(f"{os.cpu_count()} cpus; steady tokens/s leaves out the first step (tracing, compilation)")
    print("| model | backend | precision | XLA | tokens/s (steady) | vs " + backends[0] + " | MFU (of its matmul peak) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        base = next(b for b in rows if (b["model"], b["precision"]) == (r["model"], r["precision"]))
        print(f"| {r['model']} | {r['backend']} | {r['precision']} | {r['jit']} | {r['steady_tokens_per_second']:,.0f} | "
              f"{r['steady_tokens_per_second'] / base['steady_tokens_per_second']:.2f}x | "
              f"{r['mfu'] * r['steady_tokens_per_second'] / r['tokens_per_second'] * 100:.1f}% |")


if __name__ == "__main__":
    main()
