"""What LoRA saves in memory: the fine-tuning step of a classifier compiled by XLA (Keras' JAX backend) with and
without LoRA, read from the compiled program's memory analysis (`kbert.train.probe`'s measure: arguments +
outputs + temporaries - the donated buffers the outputs reuse), nothing run. On this machine XLA compiles for
the CPU; a GPU's plan differs in its temporaries (cuDNN, fusion), not in the arguments, which are the weights
and AdamW's two moments of every trained weight.

    KERAS_BACKEND=jax python benchmarks/lora_memory.py [--presets bert-base,bert-large] [--batch 32] [--seq 128]
    KERAS_BACKEND=jax python benchmarks/lora_memory.py --presets bert-large --vocab-size 250002 --batch 8

The same step as `kbert.finetune` (`kbert.compiled.training_step`, AdamW, only the trained variables in the
optimizer): the classification head on the pooler, cross-entropy, dropout 0.1, float32 weights (or
`--precision`). `benchmarks/gpu.py lora` (a stage of `gpu.py all`) takes the same plans on a GPU and times the steps.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def build_step(preset: str, batch: int, seq: int, rank, vocab_size: int = 32000, dtype=None):
    """(the compiled-on-call training step, its arguments, weights in the model, weights trained) of a
    classifier on `preset`, with LoRA of `rank` (None: full fine-tuning)."""
    import keras

    import kbert
    from kbert.compiled import training_step
    from kbert.data.features import features
    from kbert.models.tasks import TaskNetwork
    from kbert.train.lora import enable_lora, lora_trainable

    keras.utils.set_random_seed(0)
    config = kbert.ModelConfig.preset(preset, vocab_size=vocab_size, max_position=514)
    backbone = kbert.BertBackbone(config, output_hidden_states=True, dtype=dtype)
    network = TaskNetwork(backbone, "classification", 2)
    ids = np.full((batch, seq), 5, np.int32)
    inputs = features(ids, np.zeros_like(ids), 0)
    network(inputs)
    variables = list(network.trainable_variables)
    if rank:
        enable_lora(backbone, rank)
        variables = lora_trainable(list(network.trainable_variables), backbone)
    optimizer = keras.optimizers.AdamW(learning_rate=1e-4, weight_decay=0.01, global_clipnorm=1.0)
    optimizer.build(variables)

    def loss(feats, y):
        logits = keras.ops.cast(network(feats, training=True), "float32")
        return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))

    step = training_step(loss, network, variables, optimizer)
    weights = sum(int(np.prod(v.shape)) for v in network.weights if "seed" not in v.path)
    trained = sum(int(np.prod(v.shape)) for v in variables)
    return step, (inputs, np.zeros((batch,), np.int32)), weights, trained


def step_bytes(preset: str, batch: int, seq: int, rank, vocab_size: int = 32000, dtype=None) -> dict:
    """Sizes in bytes of one compiled fine-tuning step (nothing run), and the weights trained."""
    step, args, weights, trained = build_step(preset, batch, seq, rank, vocab_size, dtype)
    analysis = step.lower(*args).compile().memory_analysis()
    size = lambda name: int(getattr(analysis, name, 0) or 0)  # noqa: E731
    total = (size("argument_size_in_bytes") + size("output_size_in_bytes") + size("temp_size_in_bytes")
             - size("alias_size_in_bytes"))
    return {"arguments": size("argument_size_in_bytes"), "temporaries": size("temp_size_in_bytes"),
            "total": total, "weights": weights, "trained": trained}


def step_seconds(preset: str, batch: int, seq: int, rank, vocab_size: int = 32000, dtype=None,
                 steps: int = 10) -> float:
    """Seconds a step, the mean of `steps` after two warm-up steps (the compile)."""
    import time

    step, args, _, _ = build_step(preset, batch, seq, rank, vocab_size, dtype)
    for _ in range(2):
        step(*args)
    start = time.perf_counter()
    for _ in range(steps):
        step(*args)  # returns the loss as a float: each step waits for the device
    return (time.perf_counter() - start) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="bert-base,bert-large")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--precision", default=None, help="a Keras dtype policy, e.g. mixed_bfloat16 (default float32)")
    parser.add_argument("--vocab-size", type=int, default=32000,
                        help="32000 (KLUE-BERT's size); 250002 gives XLM-RoBERTa-large's 560M weights (BGE-M3, KURE)")
    args = parser.parse_args()
    import keras

    if keras.backend.backend() != "jax":
        raise SystemExit("run with KERAS_BACKEND=jax: the memory analysis is XLA's compiled program")
    gb = 1024 ** 3
    print("| model | fine-tuning | weights trained | arguments (weights, AdamW state, batch) | temporaries | "
          "total | vs full |\n|---|---|---:|---:|---:|---:|---:|")
    for preset in args.presets.split(","):
        full = step_bytes(preset, args.batch, args.seq, None, args.vocab_size, args.precision)
        lora = step_bytes(preset, args.batch, args.seq, args.rank, args.vocab_size, args.precision)
        for name, r in (("full", full), (f"LoRA r={args.rank}", lora)):
            print(f"| {preset} ({r['weights'] / 1e6:.0f}M), batch {args.batch} x {args.seq} | {name} | "
                  f"{r['trained'] / 1e6:.2f}M | {r['arguments'] / gb:.2f} GB | {r['temporaries'] / gb:.2f} GB | "
                  f"{r['total'] / gb:.2f} GB | {r['total'] / full['total']:.2f}x |")


if __name__ == "__main__":
    main()
