"""A model's forward pass and training update compiled the way the Keras backend compiles, numpy in and out.

    fn = compiled(lambda x: network(x, training=False), network.variables,
                  signature({"token_ids": 2, "segment_ids": 2, "padding_mask": 2}))
    fn({"token_ids": ids, ...})                       # numpy arrays in, numpy arrays out (any pytree)
    step = training_step(loss_of, network, variables, optimizer)
    loss = step(batch, static=(n, key))               # one optimizer update; the variables hold the result
    step = cached_training_step(embed_of, loss_on, network, variables, optimizer, mini_batch_size=32)
    loss = step(feats, y, static=(n, key))            # the same update, a chunk of rows at a time (GradCache)
    step.lower(...).compile().memory_analysis()       # JAX: the update's memory, nothing run

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


STRATEGIES = ("auto", "cpu", "mirrored", "tpu")  # `kbert pretrain --strategy`'s names for one host


def strategy_devices(strategy: str, name: str = "strategy") -> list:
    """The JAX devices a `--strategy` name stands for (kbert/train/backend/jax.py's table); `name` is the setting
    named in errors. "multiworker" must have called `keras.distribution.initialize()` first."""
    import jax

    if strategy == "cpu":
        return jax.devices("cpu")[:1]
    if strategy == "mirrored":
        devices = [d for d in jax.local_devices() if d.platform == "gpu"]
        if not devices:
            raise ValueError(f"{name}: mirrored needs GPUs, and JAX sees none "
                             f"({jax.local_devices()[0].platform} only); use auto or cpu")
        return devices
    if strategy == "tpu":
        devices = [d for d in jax.devices() if d.platform == "tpu"]
        if not devices:
            raise ValueError(f"{name}: tpu needs TPU devices, and JAX sees none; on a Cloud TPU VM install jax[tpu]")
        return devices
    return jax.devices()  # auto, multiworker: every device of every host (one host: the local ones)


def data_parallel(strategy: str):
    """`keras.distribution.DataParallel` over the devices `strategy` names (`kbert pretrain --strategy`'s names:
    auto, cpu, mirrored, tpu) when they are several or chosen (Keras' JAX backend), else None. Keras' own
    distribution API, as `kbert pretrain` on JAX uses it: variables created in its scope are replicated
    (restored and saved weights too), and `place` lays each batch out over the same mesh; XLA then partitions
    the one compiled program (fine-tuning: data-parallel steps with the gradients all-reduced)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"`strategy` must be one of {STRATEGIES}. Received: strategy={strategy!r}")
    if backend() != "jax":
        if strategy != "auto":
            raise ValueError(f"strategy={strategy!r}: chosen or several devices are for Keras' JAX backend "
                             "(KERAS_BACKEND=jax); on TensorFlow kbert fine-tunes and encodes on one device "
                             "(strategy='auto')")
        return None
    import jax
    import keras

    here = jax.process_index()  # this host's devices: fine-tuning and encoding run on one host
    devices = [d for d in strategy_devices(strategy) if d.process_index == here]
    if strategy == "cpu" or len(devices) > 1:
        return keras.distribution.DataParallel(devices=devices)
    return None


def place(distribution, tree, split: bool = True):
    """Arrays of a batch -> JAX arrays split along their rows over `distribution`'s devices; an array whose rows
    do not divide among them (an epoch's last batch), or any with `split=False`, goes to every device whole."""
    import jax
    import keras

    mesh = distribution.device_mesh

    def put(x):
        x = x if hasattr(x, "sharding") else np.asarray(x)  # a JAX array moves between devices, not via the host
        if split and x.ndim and x.shape[0] % mesh.devices.size == 0:
            layout = distribution.get_data_layout(x.shape)
        else:
            layout = keras.distribution.TensorLayout([None] * x.ndim, mesh)
        return jax.device_put(x, layout.backend_layout)

    return jax.tree_util.tree_map(put, tree)


def replicate(distribution, variables) -> None:
    """Puts each variable's value on every device of `distribution` (weights built outside its scope), leaving
    those already there as they are."""
    whole = None
    for v in variables:
        value = v.value
        if whole is None:
            whole = place(distribution, value, split=False).sharding
        if not value.sharding.is_equivalent_to(whole, value.ndim):
            v.assign(place(distribution, value, split=False))


def compiled(fn: Callable, variables: Sequence, signature: Optional[list] = None, jit_compile: bool = False,
             distribution=None):
    """`fn(*args)` -> its outputs as numpy, compiled for the backend. `variables`: every variable `fn` reads
    (JAX passes their current values in each call, so later assignments are seen). `signature`: TensorFlow
    input specs (`tf.TensorSpec` or nests of them) for one trace of every shape; ignored on JAX.
    `distribution` (JAX, `data_parallel`): the args are split along their rows over its devices (`place`);
    the variables must be on those devices already."""
    if backend() == "jax":
        import jax
        import keras

        variables = list(variables)

        def pure(values, *args):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return fn(*args)

        jitted = jax.jit(pure)
        if distribution is not None:
            return lambda *args: to_numpy(jitted([v.value for v in variables], *place(distribution, args)))
        return lambda *args: to_numpy(jitted([v.value for v in variables], *args))
    import tensorflow as tf

    _quiet_retracing_warning(fn)
    if signature is not None:
        function = tf.function(fn, input_signature=signature, jit_compile=jit_compile)
    else:
        function = tf.function(fn, reduce_retracing=True, jit_compile=jit_compile)
    return lambda *args: to_numpy(function(*args))


JIT_MODES = (False, True, "background")  # the `jit_compile` values of inference classes


class BackgroundCompiles:
    """The batch shapes an XLA function has compiled, and a thread that compiles new ones for servers
    (`jit_compile="background"` of `Embedder` and `TaskModel`): a batch whose shape is not compiled yet runs
    on the graph, which takes any shape, while the thread compiles that shape at the lowest CPU priority, so
    no request waits about a second for XLA. Keys are the callers' (the function's variant, then the shape).

        compiles = BackgroundCompiles()
        if compiles.ready(key, lambda: xla_fn(np.zeros(shape, np.int32)), background=True):
            out = xla_fn(ids)          # compiled (or, with background=False, compiled here now)
            compiles.add(key)
        else:
            out = graph_fn(ids)        # meanwhile
    """

    def __init__(self):
        self._done = set()
        self._jobs = None  # the thread's queue, made at the first background request
        self._pending = set()

    def __contains__(self, key) -> bool:
        return key in self._done

    def __iter__(self):
        return iter(set(self._done))

    def __len__(self) -> int:
        return len(self._done)

    def add(self, key) -> None:
        """Records `key` as compiled (a caller that ran its XLA function in the foreground)."""
        self._done.add(key)

    def ready(self, key, compile_key: Callable[[], object], background: bool) -> bool:
        """Whether a batch of `key` runs through XLA now: always when not `background` (the caller compiles
        it the first time); else once the thread has run `compile_key()` for it (asked for here)."""
        if not background or key in self._done:
            return True
        if self._jobs is None:
            import queue
            import threading

            self._jobs = queue.Queue()
            threading.Thread(target=self._work, daemon=True, name="kbert-xla-compile").start()
        if key not in self._pending:
            self._pending.add(key)
            self._jobs.put((key, compile_key))
        return False

    def _work(self) -> None:
        import os
        import threading
        import warnings

        try:  # the lowest CPU priority for this thread (a Linux task): serving requests comes first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while True:
            key, compile_key = self._jobs.get()
            try:
                compile_key()
                self._done.add(key)
            except Exception as e:  # noqa: BLE001 - that shape stays on the graph; say so once
                warnings.warn(f"XLA could not compile batch shape {key} ({type(e).__name__}: {e}); batches of "
                              f"that shape keep running on the graph")
            finally:
                self._pending.discard(key)
                self._jobs.task_done()

    @property
    def pending(self) -> int:
        """Shapes waiting for or in compilation."""
        return len(self._pending)

    def wait(self) -> None:
        """Blocks until the compilations asked for so far are done."""
        if self._jobs is not None:
            self._jobs.join()


class CompilesInBackground:
    """What a server reads of an inference class that compiles batch shapes with XLA (`Embedder`, `TaskModel`):
    the class keeps its shapes in `_compiled`, a `BackgroundCompiles`."""

    @property
    def compiling(self) -> int:
        """Batch shapes waiting for or in background compilation (jit_compile="background")."""
        return self._compiled.pending

    @property
    def compiled_shapes(self) -> int:
        """Batch shapes XLA has compiled so far."""
        return len(self._compiled)

    def wait_compiled(self) -> None:
        """Blocks until the background compilations asked for so far are done (jit_compile="background")."""
        self._compiled.wait()


class _RetracingNotice:
    """Drops TensorFlow's "N out of the last M calls to <function training_step...update> triggered tf.function
    retracing" warning for kbert's own update and fine-tuning inference functions: each traces once per batch
    shape of a small fixed set (bucketed widths, one per dataset and loss in multi-dataset training), and a
    second `kbert.finetune` call in one process (a notebook) makes new ones of the same code, so the
    frequent-retracing alarm, which counts traces of every function sharing one code object, is a false one.
    So for `TaskModel`'s forward passes: each model traces them once for the graph and once for XLA, and a
    server or script holds several models; and for every function `compiled` is given (an `Embedder`'s,
    `MaskedLM`'s, a teacher's): a notebook that loads a sixth model got the alarm from its first `encode`."""

    OWN = {"training_step.<locals>", "finetune_inference", "TaskNetwork.packed_logits", "TaskModel._forward"}

    def filter(self, record) -> bool:
        message = record.getMessage()
        return not ("triggered tf.function retracing" in message and any(name in message for name in self.OWN))


def _quiet_retracing_warning(fn: Optional[Callable] = None) -> None:
    """Installs the filter once; `fn`'s qualified name (how TensorFlow's warning names it) joins its list."""
    import logging

    logger = logging.getLogger("tensorflow")
    if not any(isinstance(f, _RetracingNotice) for f in logger.filters):
        logger.addFilter(_RetracingNotice())
    name = getattr(fn, "__qualname__", None)
    if name and name != "<lambda>":  # a module-level lambda's name would match any other's
        _RetracingNotice.OWN.add(name)


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

        def state():
            return [v.value for v in trained], [v.value for v in others], [v.value for v in opt_vars]

        def step(*args, static=()):
            tv, nv, ov, loss = jitted(*state(), args, tuple(static))
            for group, values in ((trained, tv), (others, nv), (opt_vars, ov)):
                for v, value in zip(group, values):
                    v.assign(value)
            return float(loss)

        # the update lowered for these inputs (`.compile().memory_analysis()`: its memory), run nothing
        step.lower = lambda *args, static=(): jitted.lower(*state(), args, tuple(static))
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
                grads = _dense_gradients(tape.gradient(loss, trained))
                optimizer.apply_gradients(zip(grads, trained))
                return loss

            functions[static] = update
        return float(functions[static](*args))

    return step


def _dense_gradients(grads):
    """TensorFlow gradients with each IndexedSlices made one dense tensor (see `training_step`)."""
    import tensorflow as tf

    return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]


def _rows(tree) -> int:
    import keras

    return int(np.shape(keras.tree.flatten(tree)[0])[0])


def _part(tree, lo: int, hi: int):
    import keras

    return keras.tree.map_structure(lambda x: x[lo:hi], tree)


def cached_training_step(embed_of: Callable, loss_on: Callable, model, variables: Sequence, optimizer,
                         mini_batch_size: int):
    """As `training_step`, for a loss of a batch's embeddings, in the memory of `mini_batch_size` rows:
    `step(feats, y, static=())` -> the loss of `loss_on(embed_of(feats), y, *static)` after one update.

    Gradient caching (GradCache, Gao et al. 2021; sentence-transformers' CachedMultipleNegativesRankingLoss):
    a contrastive loss scores every text of the batch against every other, so its batch cannot be split into
    accumulated steps without changing the loss, and the batch size is what makes in-batch negatives work.
    Instead: (1) `embed_of` runs over the rows `mini_batch_size` at a time without keeping activations, giving
    the embeddings `[rows, h]`; (2) the loss and its gradient with respect to those embeddings (small); (3) each
    chunk runs again, now with a backward pass that takes its slice of (2) as the output gradient, and the
    weight gradients add up. Peak activation memory is one chunk's instead of the batch's, for about a third
    more compute (the second forward). Dropout draws the same masks in (1) and (3): the random state each
    chunk started from is put back before its second pass. The gradient equals the whole batch's own
    (tests/test_tasks_jax.py). `feats` is a pytree of arrays whose first axis is the rows; `loss_on` must
    read no variable."""
    trained = list(variables)
    if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) or mini_batch_size < 1:
        raise ValueError(f"`mini_batch_size` must be a positive integer. Received: {mini_batch_size!r}")

    def bounds_of(feats):
        rows = _rows(feats)
        return tuple((lo, min(lo + mini_batch_size, rows)) for lo in range(0, rows, mini_batch_size))

    if backend() == "jax":
        import jax
        import keras

        ids = {id(v) for v in trained}
        others = [v for v in model.variables if id(v) not in ids]
        seeds = [v for v in others if "float" not in str(v.dtype)]  # the random state a forward pass advances
        frozen = [v for v in others if "float" in str(v.dtype)]
        opt_vars = list(optimizer.variables)

        def embed_chunk(tv, sv, fv, part):
            mapping = list(zip(trained, tv)) + list(zip(seeds, sv)) + list(zip(frozen, fv))
            with keras.StatelessScope(state_mapping=mapping) as scope:
                e = embed_of(part)
            return e, [scope.get_current_value(v) for v in seeds]

        def update(tv, sv, fv, ov, feats, y, rows, static):
            # the rows as [chunks, m, ...], the last chunk filled with copies of the last row (their vectors
            # never reach the loss, so their gradient is zero); lax.scan runs the chunks one after another,
            # so one chunk's activations are live at a time
            m = mini_batch_size
            count = -(-rows // m)

            def chunked(x):
                x = jax.numpy.concatenate([x, jax.numpy.repeat(x[-1:], count * m - rows, axis=0)], axis=0)
                return x.reshape((count, m) + x.shape[1:])
            parts = jax.tree_util.tree_map(chunked, feats)

            def first(state, part):  # (1) a chunk's vectors, and the random state it started from
                e, after = embed_chunk(tv, state, fv, part)
                return after, (e, state)
            end, (vectors, starts) = jax.lax.scan(first, sv, parts)
            vectors = vectors.reshape((count * m,) + vectors.shape[2:])[:rows]
            loss, g = jax.value_and_grad(lambda e: loss_on(e, y, *static))(vectors)  # (2) dL/d vectors
            g = jax.numpy.concatenate([g, jax.numpy.zeros((count * m - rows,) + g.shape[1:], g.dtype)], axis=0)
            g = g.reshape((count, m) + g.shape[1:])

            def second(grads, chunk):  # (3) the chunk again from its random state, backward from its dL/de
                part, start, cotangent = chunk
                _, vjp = jax.vjp(lambda t: embed_chunk(t, start, fv, part)[0], tv)
                return jax.tree_util.tree_map(jax.numpy.add, grads, vjp(cotangent)[0]), None
            grads, _ = jax.lax.scan(second, jax.tree_util.tree_map(jax.numpy.zeros_like, tv), (parts, starts, g))
            tv, ov = optimizer.stateless_apply(ov, grads, tv)
            return tv, end, ov, loss

        jitted = jax.jit(update, static_argnums=(6, 7), donate_argnums=(0, 1, 3))

        def state():
            return ([v.value for v in trained], [v.value for v in seeds], [v.value for v in frozen],
                    [v.value for v in opt_vars])

        def step(feats, y, static=()):
            tv, sv, ov, loss = jitted(*state(), feats, y, _rows(feats), tuple(static))
            for group, values in ((trained, tv), (seeds, sv), (opt_vars, ov)):
                for v, value in zip(group, values):
                    v.assign(value)
            return float(loss)

        step.lower = lambda feats, y, static=(): jitted.lower(*state(), feats, y, _rows(feats), tuple(static))
        return step
    import tensorflow as tf

    _quiet_retracing_warning()
    ids = {id(v) for v in trained}
    # the random state (dropout's seed generators): integer variables the forward pass advances
    seeds = [v for v in model.variables if id(v) not in ids and not ("float" in str(v.dtype))]
    functions = {}

    def step(feats, y, static=()):
        key = (tuple(static), bounds_of(feats))
        if key not in functions:
            static_args, bounds = key

            @tf.function(reduce_retracing=True)
            def update(feats, y):
                starts, chunks = [], []
                for lo, hi in bounds:  # (1) the embeddings; no tape, so no activations kept
                    starts.append([tf.identity(v.value) for v in seeds])
                    with tf.control_dependencies(chunks[-1:]):  # one chunk after another
                        part = _part(feats, lo, hi)
                        part = tf.nest.map_structure(tf.identity, part)
                    chunks.append(tf.stop_gradient(embed_of(part)))
                ends = [tf.identity(v.value) for v in seeds]
                embeddings = tf.concat(chunks, axis=0)
                with tf.GradientTape() as tape:
                    tape.watch(embeddings)
                    loss = loss_on(embeddings, y, *static_args)
                g = tape.gradient(loss, embeddings)
                grads = None
                for (lo, hi), start in zip(bounds, starts):  # (3) each chunk again from its random state
                    for v, value in zip(seeds, start):
                        v.assign(value)
                    with tf.control_dependencies([x for x in grads or [] if x is not None]):
                        part = tf.nest.map_structure(tf.identity, _part(feats, lo, hi))  # after the last chunk
                    with tf.GradientTape() as tape:
                        e = embed_of(part)
                    chunk_grads = _dense_gradients(tape.gradient(e, trained, output_gradients=g[lo:hi]))
                    grads = chunk_grads if grads is None else [
                        b if a is None else a if b is None else a + b for a, b in zip(grads, chunk_grads)]
                for v, value in zip(seeds, ends):
                    v.assign(value)
                optimizer.apply_gradients(zip(grads, trained))
                return loss

            functions[key] = update
        return float(functions[key](feats, y))

    return step
