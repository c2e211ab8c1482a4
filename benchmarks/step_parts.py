"""Two parts of a training step on their own, each code path beside the one it replaced, in one run:

- `layer_norm`: kbert's 16-bit LayerNorm (forward and backward, after a residual add, as in a block) with its
  statistics from one pass over the row (`layer_norm=saved_input`, the default) and from Keras' two-pass
  `ops.moments` (`two_pass_stats`): on Keras' JAX backend under `jax.jit`, and on TensorFlow with and without
  `jit_compile` (kbert's bf16 path there runs without XLA);
- `dropout`: kbert's `Dropout` on JAX with the one-round counter hash (`dropout_masks=auto`, the default), the
  two-round one (`hash2`), and no dropout, over a bf16 tensor, with a residual add as its neighbour.
- `mlm_head`: the masked-LM head's tied logits and weighted cross-entropy, forward and backward, float32
  (bert-mini's pretraining shape on a CPU: 32 x 11 predictions, width 256, 16,000 pieces): kbert's
  (`x @ table^T`, then `pretraining_losses`, which takes Keras' sparse cross-entropy) beside two forms
  tried against it: the loss as logsumexp minus the label's logit, and the logits computed vocabulary-major
  (`table @ x^T`, transposed), on JAX and on TensorFlow with `jit_compile`. It is where the profile of JAX's
  step on a CPU puts a quarter of the time (benchmarks/README.md, "Pretraining end to end").

On a CPU these say what the changes cost or save where they also run; on a GPU the step's own figures come
from `gpu.py` (the `ablations` stage times both switches in the whole step).

    python benchmarks/step_parts.py                 # both parts, JAX and TensorFlow
    python benchmarks/step_parts.py --only dropout  # JAX only
    python benchmarks/step_parts.py --only mlm_head
"""

import argparse
import json
import os
import subprocess
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))

# Each backend runs in its own process (Keras fixes its backend at import). Times: ms per call, the median of
# `rounds` rounds of `calls` calls, the variants alternating within each round; `_TIMES` ends the scripts
# whose `steps` map a name to a call that blocks until its result is ready.
_TIMES = r"""
times = {k: [] for k in steps}
for _ in range(rounds):
    for k, call in steps.items():
        t = time.perf_counter()
        for _ in range(calls):
            call()
        times[k].append((time.perf_counter() - t) / calls * 1e3)
print(json.dumps({k: sorted(v)[len(v) // 2] for k, v in times.items()}))
"""

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

_MLM_HEAD = r"""
import json, sys, time
import numpy as np, keras
from keras import ops
from kbert.models.backbone import pretraining_losses
(b, p, e, v), rounds, calls = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
backend = keras.backend.backend()
rng = np.random.default_rng(0)
x = rng.normal(0, 1, (b, p, e)).astype("float32")
table = rng.normal(0, 0.02, (v, e)).astype("float32")
ids = rng.integers(0, v, (b, p)).astype("int32")
weights = (rng.random((b, p)) < 0.9).astype("float32")

def kbert_form(x, t, ids, w):  # MaskedLMHead's matmul, then the pretraining loss
    logits = ops.matmul(x, ops.transpose(t))
    return pretraining_losses({"mlm_logits": logits}, {"mask_ids": ids, "mask_weights": w})["mlm_loss"]

def label_logit(x, t, ids, w):
    logits = ops.matmul(x, ops.transpose(t))
    ce = ops.logsumexp(logits, axis=-1) - ops.take_along_axis(logits, ids[..., None], axis=-1)[..., 0]
    return ops.sum(ce * w) / ops.maximum(ops.sum(w), 1.0)

def vocab_major(x, t, ids, w):
    logits = ops.transpose(ops.einsum("ve,bpe->vbp", t, x), (1, 2, 0))
    return pretraining_losses({"mlm_logits": logits}, {"mask_ids": ids, "mask_weights": w})["mlm_loss"]

forms = {"kbert: x @ table^T, Keras' cross-entropy": kbert_form,
         "cross-entropy as logsumexp - label logit": label_logit, "logits vocabulary-major": vocab_major}
steps, values = {}, {}
if backend == "jax":
    import jax
else:
    import tensorflow as tf
    args = [tf.constant(a) for a in (x, table, ids, weights)]
for name, form in forms.items():
    if backend == "jax":
        f = jax.jit(jax.value_and_grad(form, argnums=(0, 1)))
        call = lambda f=f: jax.block_until_ready(f(x, table, ids, weights))
        values[name] = [np.asarray(a) for a in jax.tree_util.tree_leaves(call())]
    else:
        @tf.function(jit_compile=True)
        def f(a, t, i, w, form=form):
            with tf.GradientTape() as tape:
                tape.watch([a, t])
                loss = form(a, t, i, w)
            return [loss] + tape.gradient(loss, [a, t])
        call = lambda f=f: [a.numpy() for a in f(*args)]
        values[name] = call()
    steps[f"{backend}{' jit' if backend != 'jax' else ''}: {name}"] = call
first = next(iter(values.values()))
for name, got in values.items():  # the same loss and gradients, or the timing compares different things
    for a, r in zip(got, first):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-6, err_msg=name)
"""


def _run(script: str, backend: str, *args) -> dict:
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=os.path.dirname(_HERE), TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("layer_norm", "dropout", "mlm_head"))
    parser.add_argument("--shape", default="[32, 128, 768]", help="the tensor's shape, JSON")
    parser.add_argument("--head-shape", default="[32, 11, 256, 16000]",
                        help="mlm_head: batch, predictions per row, width, vocabulary (JSON)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args(argv)
    rows = {}
    if args.only in (None, "layer_norm"):
        for backend in ("jax", "tensorflow"):
            rows.update(_run(_LAYER_NORM + _TIMES, backend, args.shape, args.rounds, args.calls))
    if args.only in (None, "dropout"):
        rows.update({f"jax dropout 0.1: {k}": v for k, v in
                     _run(_DROPOUT, "jax", args.shape, args.rounds, args.calls).items()})
    if args.only in (None, "mlm_head"):
        for backend in ("jax", "tensorflow"):
            rows.update({f"{k} (float32 {args.head_shape})": v for k, v in
                         _run(_MLM_HEAD + _TIMES, backend, args.head_shape, args.rounds, args.calls).items()})
    print(f"ms per call, median of {args.rounds} rounds of {args.calls} calls; layer_norm and dropout: bf16 "
          f"{args.shape}")
    print("| part: code path | ms |\n|---|---:|")
    for k, v in rows.items():
        print(f"| {k} | {v:.2f} |")


if __name__ == "__main__":
    main()
