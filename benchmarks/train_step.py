"""Masked-LM training-step throughput: kbert vs keras-hub's BertMaskedLM, same config, same run.

Config (issue 2): L=4, H=256, A=4, I=1024, seq 128, batch 32, vocab 32000, 20 masked positions, AdamW
(kbert's, as `kbert pretrain` builds it; keras-hub's model gets Keras' own), dropout 0.1, float32. Both models
train through Keras' compiled train step on the same synthetic batch; the figure is tokens/s (batch * seq /
step time), the median of `--repeats` timed blocks, with the models alternating so machine noise hits both
alike. It also prints the machine's measured fp32 matmul peak and each model's model-FLOPs utilization (MFU).

    pip install keras-hub   # only for this benchmark
    python benchmarks/train_step.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def synthetic_batch(batch, seq, vocab, predictions, seed=0):
    rng = np.random.default_rng(seed)
    features = {
        "token_ids": rng.integers(5, vocab, (batch, seq)).astype("int32"),
        "segment_ids": np.concatenate([np.zeros((batch, seq // 2)), np.ones((batch, seq - seq // 2))], 1).astype("int32"),
        "padding_mask": np.ones((batch, seq), "int32"),
        "mask_positions": np.sort(np.stack([rng.choice(np.arange(1, seq), predictions, replace=False)
                                            for _ in range(batch)]), 1).astype("int32"),
    }
    mask_ids = rng.integers(5, vocab, (batch, predictions)).astype("int32")
    return features, mask_ids


def matmul_peak(n=1024, repeats=20, dtype="float32"):
    """Measured matmul FLOP/s of this machine through TensorFlow (same threads as training), in `dtype`."""
    import tensorflow as tf

    a = tf.cast(tf.random.normal((n, n)), dtype)
    b = tf.cast(tf.random.normal((n, n)), dtype)
    f = tf.function(lambda a, b: tf.matmul(a, b))
    f(a, b).numpy()
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, b).numpy()
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t))
    return best


def train_flops_per_step(cfg, batch, seq, predictions, last_layer_rows=None):
    """kbert.train.flops' count for the dict config here: 6 * (matmul params per token) * tokens + attention
    matmuls + the MLM head at masked positions; `last_layer_rows`: the positions the last block computes."""
    import kbert
    from kbert.train.flops import train_flops_per_step as count

    config = kbert.ModelConfig(architecture="bert", vocab_size=cfg["vocab"], hidden_size=cfg["hidden"],
                               num_layers=cfg["layers"], num_heads=cfg["heads"], intermediate_size=cfg["intermediate"])
    return count(config, batch, seq, predictions, last_layer_rows)


def build_kbert(cfg, jit_compile, optimizer="kbert"):
    import keras

    import kbert
    from kbert.train.optimizers import AdamW

    config = kbert.ModelConfig(architecture="bert", vocab_size=cfg["vocab"], hidden_size=cfg["hidden"],
                               num_layers=cfg["layers"], num_heads=cfg["heads"],
                               intermediate_size=cfg["intermediate"], max_position=512)
    model = kbert.Pretrainer(kbert.BertBackbone(config), pair_objective=None)
    # `kbert pretrain`'s AdamW (TensorFlow's fused kernel) or Keras' own, the one keras-hub's model gets
    model.compile(optimizer=AdamW(1e-4) if optimizer == "kbert" else keras.optimizers.AdamW(1e-4),
                  jit_compile=jit_compile)

    def step(features, mask_ids, weights):
        return model.train_on_batch(features, {"mask_ids": mask_ids, "mask_weights": weights})

    return model, step


def build_keras_hub(cfg, jit_compile):
    import keras
    import keras_hub

    backbone = keras_hub.models.BertBackbone(vocabulary_size=cfg["vocab"], num_layers=cfg["layers"],
                                             num_heads=cfg["heads"], hidden_dim=cfg["hidden"],
                                             intermediate_dim=cfg["intermediate"], max_sequence_length=512)
    model = keras_hub.models.BertMaskedLM(backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.AdamW(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()], jit_compile=jit_compile)

    def step(features, mask_ids, weights):
        return model.train_on_batch(features, mask_ids, sample_weight=weights)

    return model, step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--predictions", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=5, help="timed blocks per model")
    parser.add_argument("--jit", choices=("auto", "on", "off"), default="auto",
                        help="XLA for both models: keras' default (auto), forced on, or off")
    parser.add_argument("--optimizer", choices=("kbert", "keras"), default="kbert",
                        help="kbert's AdamW: the one `kbert pretrain` trains with (default), or Keras' own, which "
                             "keras-hub's model always gets (the models alone)")
    args = parser.parse_args(argv)
    jit = {"auto": "auto", "on": True, "off": False}[args.jit]
    cfg = dict(layers=4, hidden=256, heads=4, intermediate=1024, vocab=32000)

    import tensorflow as tf

    features, mask_ids = synthetic_batch(args.batch, args.seq, cfg["vocab"], args.predictions)
    weights = np.ones(mask_ids.shape, "float32")
    models = {}
    try:
        models["keras-hub"] = build_keras_hub(cfg, jit)
    except ImportError:
        print("keras-hub is not installed (pip install keras-hub); timing kbert alone")
    models["kbert"] = build_kbert(cfg, jit, args.optimizer)
    for name, (_, step) in models.items():  # compile + warm up
        for _ in range(3):
            step(features, mask_ids, weights)

    times = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, (_, step) in models.items():
            t = time.perf_counter()
            for _ in range(args.steps):
                step(features, mask_ids, weights)
            times[name].append((time.perf_counter() - t) / args.steps)

    peak = matmul_peak()
    # each model's own computation: kbert's Pretrainer runs its last block at [CLS] + the masked positions only
    from kbert.train.flops import pretrainer_last_layer_rows

    flops = {name: train_flops_per_step(cfg, args.batch, args.seq, args.predictions,
                                        pretrainer_last_layer_rows(args.predictions) if name == "kbert" else None)
             for name in models}
    tokens = args.batch * args.seq
    print(f"config: L={cfg['layers']} H={cfg['hidden']} A={cfg['heads']} I={cfg['intermediate']} "
          f"vocab={cfg['vocab']} seq={args.seq} batch={args.batch} predictions={args.predictions} "
          f"jit={args.jit} kbert's optimizer={args.optimizer}; tf {tf.__version__}, {os.cpu_count()} cpus")
    print(f"measured fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s")
    rates = {}
    for name, ts in times.items():
        step_time = statistics.median(ts)
        rates[name] = tokens / step_time
        print(f"{name:10s} {rates[name]:9.0f} tokens/s  step {step_time * 1e3:7.1f} ms  "
              f"MFU {flops[name] / step_time / peak * 100:5.1f}%  params {models[name][0].count_params():,}")
    if "keras-hub" in rates:
        print(f"ratio kbert / keras-hub: {rates['kbert'] / rates['keras-hub']:.2f}x (goal >= 1.25x)")


if __name__ == "__main__":
    main()
