"""A model's forward pass and training update compiled the way the Keras backend compiles, numpy in and out.

    fn = compiled(lambda x: network(x, training=False), network.variables,
                  signature({"token_ids": 2, "segment_ids": 2, "padding_mask": 2}))
    fn({"token_ids": ids, ...})                       # numpy arrays in, numpy arrays out (any pytree)
    step = training_step(loss_of, network, variables, optimizer)
    loss = step(batch, static=(n, key))               # one optimizer update; the variables hold the result

TensorFlow: a `tf.function` (with `signature`, one trace for every shape; `jit_compile=True` hands each shape
to XLA), as the Embedder, TaskModel and fine-tuning always ran. JAX: `jax.jit` of the function made pure with
`keras.StatelessScope` (the pattern Keras' own JAX trainer and kbert's pretraining step use), so the
variables' values are arguments of the compiled program, not constants folded into it (a BERT-Base baked in
as constants is a slow compile and a second copy of the weights). JAX compiles once per input shape, so
callers round shapes up to a few buckets (`kbert.data.features.bucket`) before calling.

It sits below every folder, beside utils.py (no kbert imports): `embed/` (inference) and `train/` (a
fine-tuning update) share it and may not import each other, and `models/` stays free of backend imports.
The JAX path never imports TensorFlow (a GPU or TPU host without it runs every function here).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np


def backend() -> str:
    import keras

    return keras.backend.backend()


def to_numpy(tree):
    """Every array of a pytree (a tensor, a list or a dict of them) as numpy."""
    import keras

    return keras.tree.map_structure(lambda x: np.asarray(x), tree)


def signature(*ranks):
    """TensorFlow input specs for `compiled`, one per argument: a rank (int32, every dimension unknown), a
    (rank, dtype) pair, or a dict of them; None on JAX (no TensorFlow there, and it compiles per shape).

        signature({"token_ids": 2, "segment_ids": 2, "padding_mask": 2})   # one features dict [b, s]
        signature(2, 2, (3, "float32"))                                     # ids, segments, weights
    """
    if backend() == "jax":
        return None
    import tensorflow as tf

    def spec(r):
        if isinstance(r, dict):
            return {k: spec(v) for k, v in r.items()}
        rank, dtype = r if isinstance(r, tuple) else (r, "int32")
        return tf.TensorSpec([None] * rank, dtype)

    return [spec(r) for r in ranks]


def compiled(fn: Callable, variables: Sequence, signature: Optional[list] = None, jit_compile: bool = False):
    """`fn(*args)` -> its outputs as numpy, compiled for the backend. `variables`: every variable `fn` reads
    (JAX passes their current values in each call, so later assignments are seen). `signature`: TensorFlow
    input specs (`tf.TensorSpec` or nests of them) for one trace of every shape; ignored on JAX."""
    if backend() == "jax":
        import jax
        import keras

        variables = list(variables)

        def pure(values, *args):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return fn(*args)

        jitted = jax.jit(pure)
        return lambda *args: to_numpy(jitted([v.value for v in variables], *args))
    import tensorflow as tf

    if signature is not None:
        function = tf.function(fn, input_signature=signature, jit_compile=jit_compile)
    else:
        function = tf.function(fn, reduce_retracing=True, jit_compile=jit_compile)
    return lambda *args: to_numpy(function(*args))


class _RetracingNotice:
    """Drops TensorFlow's "N out of the last M calls to <function training_step...update> triggered tf.function
    retracing" warning for kbert's own update functions: each traces once per batch shape of a small fixed
    set (bucketed widths, one per dataset and loss in multi-dataset training), so the frequent-retracing
    alarm, which counts traces of every function sharing one code object, is a false one here."""

    def filter(self, record) -> bool:
        message = record.getMessage()
        return not ("triggered tf.function retracing" in message and "training_step.<locals>" in message)


def _quiet_retracing_warning() -> None:
    import logging

    logger = logging.getLogger("tensorflow")
    if not any(isinstance(f, _RetracingNotice) for f in logger.filters):
        logger.addFilter(_RetracingNotice())


def training_step(loss_of: Callable, model, variables: Sequence, optimizer, read: Sequence = ()):
    """`step(*args, static=())` -> the loss (a float) of `loss_of(*args, *static)` after one update of
    `variables` by `optimizer` (built on them). `static`: Python values the loss branches on (a batch split
    point, a loss key); on JAX each distinct value compiles once, on TensorFlow they are traced as
    constants the same way. The model's other variables (frozen weights, dropout seed states) and those in
    `read` (a distillation teacher's) are read and, where the call advanced them, kept."""
    trained = list(variables)
    if backend() == "jax":
        import jax
        import keras

        ids = {id(v) for v in trained}
        others = []
        for v in list(model.variables) + list(read):
            if id(v) not in ids:
                ids.add(id(v))
                others.append(v)
        opt_vars = list(optimizer.variables)

        def loss_and_others(tv, nv, args, static):
            with keras.StatelessScope(state_mapping=list(zip(trained, tv)) + list(zip(others, nv))) as scope:
                loss = loss_of(*args, *static)
            return loss, [scope.get_current_value(v) for v in others]

        grad_fn = jax.value_and_grad(loss_and_others, has_aux=True)

        def update(tv, nv, ov, args, static):
            (loss, nv), grads = grad_fn(tv, nv, args, static)
            tv, ov = optimizer.stateless_apply(ov, grads, tv)
            return tv, nv, ov, loss

        jitted = jax.jit(update, static_argnums=(4,), donate_argnums=(0, 1, 2))

        def step(*args, static=()):
            state = ([v.value for v in trained], [v.value for v in others], [v.value for v in opt_vars])
            tv, nv, ov, loss = jitted(*state, args, tuple(static))
            for group, values in ((trained, tv), (others, nv), (opt_vars, ov)):
                for v, value in zip(group, values):
                    v.assign(value)
            return float(loss)

        return step
    import tensorflow as tf

    _quiet_retracing_warning()
    functions = {}

    def step(*args, static=()):
        static = tuple(static)
        if static not in functions:
            @tf.function(reduce_retracing=True)
            def update(*args):
                with tf.GradientTape() as tape:
                    loss = loss_of(*args, *static)
                # an embedding's gradient comes as IndexedSlices with one slice per token of the batch, and the
                # optimizer's global-norm clipping would take the norm of those slices, not of their sum per
                # row (the gradient); as one dense tensor it clips by the true norm, as JAX does
                grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                         for g in tape.gradient(loss, trained)]
                optimizer.apply_gradients(zip(grads, trained))
                return loss

            functions[static] = update
        return float(functions[static](*args))

    return step
