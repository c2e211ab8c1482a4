"""GPU figures for pretraining on Keras' JAX backend (no TensorFlow needed): bf16 vs fp32 tokens/s, MFU against
the measured matmul peak, and the memory planner's estimate vs the measured peak.

The backbones are kbert's own (`keras.ops` only), trained with the masked-LM + NSP objective on synthetic
batches that stay on the device, so the figure is the model's step and not an input pipeline:

- `peak`: the bf16 and fp32 matmul peaks of this device (8192^3 products through `jax.numpy`; fp32 uses the
  backend's default precision, TF32 on NVIDIA GPUs since Ampere);
- `throughput`: Keras' own JAX `train_step` (forward, backward, AdamW update) under `jax.jit` with the state
  donated, timed over `--steps` steps after two warm-up steps; tokens/s and MFU = model FLOPs per second /
  measured bf16 peak (the convention of the PaLM paper: the model's matmul FLOPs, no recomputation counted);
- `memory`: `Pretrainer.train_on_batch` (what `kbert plan --probe` runs) in a fresh process per point, the
  peak bytes the device allocator saw, beside `kbert.train.memory.estimate_memory` for the same point;
- `all`: each of the above in its own process (peak memory is per process on JAX) and one table at the end,
  also written to `--out/gpu.json`.

    KERAS_BACKEND=jax python benchmarks/gpu.py all --out /tmp/gpu
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))


def train_flops_per_step(config, batch, seq, predictions):
    """6 x (matmul parameters per token) x tokens + the attention matmuls + the MLM head at masked positions
    (the same count as benchmarks/train_step.py)."""
    h, i, layers, v = config.hidden_size, config.intermediate_size, config.num_layers, config.vocab_size
    per_token = layers * (4 * h * h + 2 * h * i)
    attention = layers * 2 * 2 * seq * h
    head = (h * h + h * v) * predictions / seq
    return 3 * 2 * (per_token + attention + head) * batch * seq


def matmul_peak(dtype: str, n: int = 8192, repeats: int = 10) -> float:
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    a = jax.random.normal(key, (n, n), dtype=dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype=dtype)
    f = jax.jit(lambda a, b: a @ b)
    for _ in range(3):
        f(a, b).block_until_ready()
    t = time.perf_counter()
    for _ in range(repeats):
        out = f(a, b)
    out.block_until_ready()
    return 2 * n ** 3 * repeats / (time.perf_counter() - t)


def _config(model: str, vocab: int, overrides=()):
    """A preset with `--set field=value` overrides (e.g. attention_dropout=0.0)."""
    from kbert.models.config import ModelConfig

    fields = {}
    for item in overrides or ():
        key, value = item.split("=", 1)
        fields[key] = json.loads(value) if value[:1] in "0123456789-[{tfn" else value
    return ModelConfig.preset(model, vocab_size=vocab, **fields)


def throughput(model: str, seq: int, batch: int, precision: str, steps: int, vocab: int, overrides=()) -> dict:
    import jax
    import keras

    from kbert.data.masking import default_max_predictions
    from kbert.train.probe import build_trainer, synthetic_batch

    config = _config(model, vocab, overrides)
    predictions = default_max_predictions(seq)
    trainer = build_trainer(config, "adamw", precision)
    features, labels = synthetic_batch(config, batch, seq, predictions)
    trainer.train_on_batch(features, labels)  # builds the optimizer and metrics
    state = trainer._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                   optimizer_variables=True, metrics_variables=True)
    step = jax.jit(trainer.train_step, donate_argnums=0)
    data = jax.device_put((features, labels))
    t_compile = time.perf_counter()
    for _ in range(2):
        logs, state = step(state, data)
    jax.block_until_ready(logs)
    compile_s = time.perf_counter() - t_compile
    t = time.perf_counter()
    for _ in range(steps):
        logs, state = step(state, data)
    jax.block_until_ready((logs, state))
    elapsed = time.perf_counter() - t
    flops = train_flops_per_step(config, batch, seq, predictions)
    return {"model": model, "seq": seq, "batch": batch, "precision": precision, "steps": steps,
            "step_ms": elapsed / steps * 1e3, "tokens_per_s": batch * seq * steps / elapsed,
            "model_flops_per_s": flops * steps / elapsed, "compile_and_warmup_s": compile_s,
            "loss": float(logs["loss"]), "keras": keras.__version__, "jax": jax.__version__,
            "device": str(jax.devices()[0].device_kind), "overrides": list(overrides or ())}


def memory(model: str, seq: int, batch: int, precision: str, vocab: int) -> dict:
    import jax

    from kbert.data.masking import default_max_predictions
    from kbert.train.memory import estimate_memory
    from kbert.train.probe import build_trainer, peak_memory, synthetic_batch

    config = _config(model, vocab)
    trainer = build_trainer(config, "adamw", precision)
    features, labels = synthetic_batch(config, batch, seq, default_max_predictions(seq))
    for _ in range(3):
        logs = trainer.train_on_batch(features, labels, return_dict=True)
    estimate = estimate_memory(config, batch, seq, optimizer="adamw", precision=precision)
    measured = peak_memory()
    return {"model": model, "seq": seq, "batch": batch, "precision": precision, "measured_bytes": measured,
            "planned_bytes": estimate["total"],
            "error": (estimate["total"] - measured) / measured if measured else None,
            "components": {k: v for k, v in estimate.items() if k != "total"}, "loss": float(logs["loss"]),
            "device": str(jax.devices()[0].device_kind)}


def probe(model: str, seqs, precision: str, vocab: int) -> list:
    from kbert.train.probe import probe_table

    rows = probe_table(_config(model, vocab), seqs, optimizer="adamw", precision=precision)
    return rows


def _child(args, extra) -> dict:
    """Runs one measurement in a fresh process (JAX's peak memory counter is per process)."""
    cmd = [sys.executable, os.path.abspath(__file__), *extra, "--vocab", str(args.vocab), "--json"]
    print("$", " ".join(cmd[2:]), flush=True)
    env = dict(os.environ)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{") or line.startswith("[")]
    if done.returncode or not lines:
        print(done.stdout[-2000:], done.stderr[-3000:], flush=True)
        return {"error": f"exit {done.returncode}", "cmd": extra}
    result = json.loads(lines[-1])
    print("  ", json.dumps(result)[:400], flush=True)
    return result


def run_all(args) -> dict:
    out = {"peak": _child(args, ["peak", "--peak-n", str(args.peak_n)])}
    out["throughput"] = [_child(args, ["throughput", "--model", args.model, "--seq", str(seq), "--batch",
                                       str(batch), "--precision", p, "--steps", str(args.steps)])
                         for p in ("float32", "mixed_bfloat16")
                         for seq, batch in ((128, args.batch), (512, max(1, args.batch // 4)))]
    out["memory"] = [_child(args, ["memory", "--model", args.model, "--seq", str(seq), "--batch", str(batch),
                                   "--precision", p])
                     for p in ("float32", "mixed_bfloat16")
                     for seq, batch in ((128, 32), (128, 256), (512, 8), (512, 64))]
    if args.probe:
        out["probe"] = _child(args, ["probe", "--model", args.model, "--seqs", args.probe, "--precision", "float32"])
    peak_bf16 = out["peak"].get("bfloat16")
    print(f"\ndevice: {out['throughput'][0].get('device')}; measured matmul peak: bf16 "
          f"{(peak_bf16 or 0) / 1e12:.0f} TFLOP/s, fp32 (default precision) "
          f"{out['peak'].get('float32', 0) / 1e12:.0f} TFLOP/s")
    print("\n| model | seq | batch | precision | step ms | tokens/s | MFU (of bf16 peak) | of fp32 peak |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for r in out["throughput"]:
        if "tokens_per_s" in r:
            print(f"| {r['model']} | {r['seq']} | {r['batch']} | {r['precision']} | {r['step_ms']:.1f} | "
                  f"{r['tokens_per_s']:,.0f} | {r['model_flops_per_s'] / peak_bf16 * 100:.1f}% | "
                  f"{r['model_flops_per_s'] / out['peak']['float32'] * 100:.1f}% |")
    print("\n| model | seq | batch | precision | planned GB | measured peak GB | planned vs measured |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for r in out["memory"]:
        if r.get("measured_bytes"):
            print(f"| {r['model']} | {r['seq']} | {r['batch']} | {r['precision']} | {r['planned_bytes'] / 1e9:.2f} | "
                  f"{r['measured_bytes'] / 1e9:.2f} | {r['error'] * 100:+.1f}% |")
    if isinstance(out.get("probe"), list):
        print("\n| seq | planned max batch | probed max batch | planned GB at probed | measured GB |")
        print("|---:|---:|---:|---:|---:|")
        for r in out["probe"]:
            print(f"| {r['seq_len']} | {r['planned_batch']} | {r['probed_batch']} | "
                  f"{(r['planned_bytes'] or 0) / 1e9:.2f} | {(r['measured_bytes'] or 0) / 1e9:.2f} |")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("all", "peak", "throughput", "memory", "probe"))
    parser.add_argument("--model", default="bert-base")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--seqs", default="128,512")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--precision", default="mixed_bfloat16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--set", action="append", default=[], help="ModelConfig override, e.g. attention_dropout=0")
    parser.add_argument("--probe", default="", help="all: also probe these sequence lengths, e.g. 512")
    parser.add_argument("--peak-n", type=int, default=8192, help="matrix size of the peak measurement")
    parser.add_argument("--child-timeout", type=int, default=300)
    parser.add_argument("--out", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.what == "all":
        result = run_all(args)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "gpu.json"), "w") as f:
                json.dump(result, f, indent=1, default=str)
        return
    if args.what == "peak":
        result = {"bfloat16": matmul_peak("bfloat16", args.peak_n), "float32": matmul_peak("float32", args.peak_n)}
    elif args.what == "throughput":
        result = throughput(args.model, args.seq, args.batch, args.precision, args.steps, args.vocab, args.set)
    elif args.what == "memory":
        result = memory(args.model, args.seq, args.batch, args.precision, args.vocab)
    else:
        result = probe(args.model, [int(s) for s in args.seqs.split(",")], args.precision, args.vocab)
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
