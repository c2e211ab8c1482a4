"""Two parts of a training step on their own, each code path beside the one it replaced, in one run:

- `layer_norm`: kbert's 16-bit LayerNorm (forward and backward, after a residual add, as in a block) with its
  statistics from one pass over the row (`layer_norm=saved_input`, the default) and from Keras' two-pass
  `ops.moments` (`two_pass_stats`): on Keras' JAX backend under `jax.jit`, and on TensorFlow with and without
  `jit_compile` (kbert's bf16 path there runs without XLA);
- `dropout`: kbert's `Dropout` on JAX with the one-round counter hash (`dropout_masks=auto`, the default), the
  two-round one (`hash2`), and no dropout, over a bf16 tensor, with a residual add as its neighbour.

On a CPU these say what the changes cost or save where they also run; on a GPU the step's own figures come
from `gpu.py` (the `ablations` stage times both switches in the whole step).

    python benchmarks/step_parts.py                 # both parts, JAX and TensorFlow
    python benchmarks/step_parts.py --only dropout  # JAX only
"""

import argparse
import json
import os
import subprocess
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))

# Each backend runs in its own process (Keras fixes its backend at import). Times: ms per call, the median of
# `rounds` rounds of `calls` calls, the variants alternating within each round.
_LAYER_NORM = r"""
import json, sys, time
import numpy as np, keras
from kbert.models import layers
shape, rounds, calls = tuple(json.loads(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3])
backend = keras.backend.backend()
rng = np.random.default_rng(0)
x, r = (rng.normal(0.2, 1.5, shape).astype("float32") for _ in range(2))
norm = layers.LayerNorm(epsilon=1e-12, dtype="mixed_bfloat16")
norm.build(shape)
steps = {}
for jit in ((True,) if backend == "jax" else (False, True)):
    for choice in ("saved_input", "two_pass_stats"):
        if backend == "jax":
            import jax, jax.numpy as jnp
            xb, rb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(r, jnp.bfloat16)
            weights = [v.value for v in norm.trainable_variables]
            f = jax.jit(jax.grad(lambda a, b, w: jnp.sum(norm.stateless_call(w, [], a + b)[0].astype(jnp.float32)),
                                 argnums=(0, 2)))
            call = lambda f=f: jax.block_until_ready(f(xb, rb, weights))
        else:
            import tensorflow as tf
            xb, rb = tf.constant(x, tf.bfloat16), tf.constant(r, tf.bfloat16)

            @tf.function(jit_compile=jit)
            def f(a, b):
                with tf.GradientTape() as tape:
                    tape.watch(a)
                    y = tf.reduce_sum(tf.cast(norm(a + b), tf.float32))
                return tape.gradient(y, [a] + norm.trainable_variables)
            call = lambda f=f: [t.numpy() for t in f(xb, rb)]
        with layers.implementation(layer_norm=choice):
            call()  # traces and compiles with this choice
        steps[f"{backend}{' jit' if jit and backend != 'jax' else ''}: {choice}"] = call
times = {k: [] for k in steps}
for _ in range(rounds):
    for k, call in steps.items():
        t = time.perf_counter()
        for _ in range(calls):
            call()
        times[k].append((time.perf_counter() - t) / calls * 1e3)
print(json.dumps({k: sorted(v)[len(v) // 2] for k, v in times.items()}))
"""

_DROPOUT = r"""
import json, sys, time
import numpy as np, jax, jax.numpy as jnp
from kbert.models import layers
shape, rounds, calls = tuple(json.loads(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3])
x = jnp.ones(shape, jnp.bfloat16)
steps = {}
for choice in ("auto", "hash2", None):
    layer = layers.Dropout(0.1 if choice else 0.0, seed=0)
    with layers.implementation(**({"dropout_masks": choice} if choice else {})):
        def f(state, x, layer=layer):  # plus a neighbour to fuse into, as in a block (the residual add)
            y, state = layer.stateless_call([], state, x, training=True)
            return y + x, state
        f = jax.jit(f)
        state = [v.value for v in layer.non_trainable_variables]
        jax.block_until_ready(f(state, x))
    steps[choice or "no dropout"] = (f, state)
times = {k: [] for k in steps}
for _ in range(rounds):
    for k, (f, state) in steps.items():
        t = time.perf_counter()
        for _ in range(calls):
            y, state = f(state, x)
        jax.block_until_ready(y)
        times[k].append((time.perf_counter() - t) / calls * 1e3)
print(json.dumps({k: sorted(v)[len(v) // 2] for k, v in times.items()}))
"""


def _run(script: str, backend: str, *args) -> dict:
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=os.path.dirname(_HERE), TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("layer_norm", "dropout"))
    parser.add_argument("--shape", default="[32, 128, 768]", help="the tensor's shape, JSON")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args(argv)
    rows = {}
    if args.only in (None, "layer_norm"):
        for backend in ("jax", "tensorflow"):
            rows.update(_run(_LAYER_NORM, backend, args.shape, args.rounds, args.calls))
    if args.only in (None, "dropout"):
        rows.update({f"jax dropout 0.1: {k}": v for k, v in
                     _run(_DROPOUT, "jax", args.shape, args.rounds, args.calls).items()})
    print(f"shape {args.shape}, bf16; ms per call, median of {args.rounds} rounds of {args.calls} calls")
    print("| part: code path | ms |\n|---|---:|")
    for k, v in rows.items():
        print(f"| {k} | {v:.2f} |")


if __name__ == "__main__":
    main()
