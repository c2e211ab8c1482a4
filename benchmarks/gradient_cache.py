"""Gradient caching (`kbert.finetune(..., mini_batch_size=m)`) beside the ordinary whole-batch update in one run:
step time and, on Keras' JAX backend, the compiled update's temporary memory (XLA's memory analysis), for an
in-batch-negatives bi-encoder step of `--batch` (anchor, positive) pairs, i.e. 2 x batch texts.

    KERAS_BACKEND=jax python benchmarks/gradient_cache.py --model bert-mini --batch 128 --seq 64 --chunks 32,64
    python benchmarks/gradient_cache.py --model bert-mini --batch 128 --seq 64 --chunks 32,64      # TensorFlow

Random token ids, dropout on (the model's 0.1, as SimCSE and in-batch training run). Each setting runs
`--steps` timed updates after one untimed (compilation); settings alternate over `--rounds` rounds. On
TensorFlow (no compiled program to analyse) each setting also runs alone in a fresh process for its peak
resident memory above what the process held before its first step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(_HERE))


def main(argv=None):
    import keras
    import numpy as np

    import kbert
    from kbert.compiled import backend, cached_training_step, training_step
    from kbert.data.features import features
    from kbert.train.finetune import FinetuneConfig
    from kbert.train.finetune_tasks import task_for

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bert-mini")
    parser.add_argument("--batch", type=int, default=128, help="(anchor, positive) pairs per step")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--chunks", default="32,64", help="mini_batch_size values (texts per pass)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rss-of", help=argparse.SUPPRESS)  # internal: one setting alone, print its peak RSS
    args = parser.parse_args(argv)

    task = task_for(FinetuneConfig(model="-", task="sentence-embedding", pair_column="p", label_column=None))
    cfg = kbert.ModelConfig.preset(args.model, vocab_size=8000, max_position=max(args.seq, 64))
    net = task.network(kbert.BertBackbone(cfg, output_hidden_states=True), 0.0, "mean", -1)
    ids = np.random.default_rng(0).integers(5, 8000, (2 * args.batch, args.seq)).astype("int32")
    feats = features(ids, np.zeros_like(ids), 0)
    net({k: v[:2] for k, v in feats.items()})
    variables = [v for v in net.trainable_variables if not v.path.startswith("pooler/")]
    optimizer = keras.optimizers.AdamW(1e-5)
    optimizer.build(variables)
    steps = {"whole batch": training_step(lambda f, y, n, key: task.loss(net, f, y, n, key), net, variables,
                                          optimizer)}
    for m in (int(x) for x in args.chunks.split(",")):
        steps[f"mini_batch_size={m}"] = cached_training_step(lambda f: task.embed(net, f), task.embedding_loss, net,
                                                             variables, optimizer, m)
    if args.rss_of is not None:
        import resource

        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for _ in range(2):
            steps[args.rss_of](feats, None, static=(args.batch, 0))
        print("RSS", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)  # Linux: KiB
        return
    memory = {}
    if backend() == "jax":
        for name, step in steps.items():
            memory[name] = step.lower(feats, None, static=(args.batch, 0)).compile().memory_analysis().temp_size_in_bytes
    else:
        import subprocess

        for name in steps:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:]), "--rss-of", name],
                                 capture_output=True, text=True, check=True).stdout
            memory[name] = int([line for line in out.splitlines() if line.startswith("RSS ")][-1].split()[1])
    times = {name: [] for name in steps}
    for name, step in steps.items():
        step(feats, None, static=(args.batch, 0))  # compile
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step(feats, None, static=(args.batch, 0))
            times[name].append(1000 * (time.perf_counter() - start) / args.steps)
    base = float(np.median(times["whole batch"]))
    print(f"\n{args.model}, {args.batch} pairs ({2 * args.batch} texts) x {args.seq} tokens, Keras on {backend()}")
    kind = "compiled temporary memory" if backend() == "jax" else "peak resident memory of its steps"
    print(f"| update | ms per step (rounds) | time vs whole batch | {kind} |")
    print("|---|---:|---:|---:|")
    for name in steps:
        mem = f"{memory[name] / 1e6:,.0f} MB" if name in memory else "-"
        med = float(np.median(times[name]))
        print(f"| {name} | {', '.join(f'{t:.0f}' for t in times[name])} | {med / base:.2f}x | {mem} |")


if __name__ == "__main__":
    main()
