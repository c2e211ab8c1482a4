"""The pretraining loop's JAX side: `keras.distribution.DataParallel`, numpy input and one `jax.jit` step.

Devices by `runtime.strategy` (the TensorFlow names, mapped):
    auto         every local device (a GPU box's GPUs, a TPU VM's cores; several hosts when JAX runs
                 multi-host); one device needs no distribution at all
    cpu          the first CPU device
    mirrored     the local GPUs (an error without one)
    tpu          the TPU devices (an error without one)
    multiworker  `keras.distribution.initialize()` (which calls `jax.distributed.initialize`: the coordinator
                 from the cluster environment, e.g. a TPU pod slice or $KERAS_DISTRIBUTION_* variables), then
                 every device of every host
`runtime.tpu` (a TPU name for TensorFlow's cluster resolver) and `runtime.jit: false` have no JAX
equivalent and are refused by name.

Input: records dirs through `kbert.data.record_reader` (numpy only: no TensorFlow needed, batches equal to
the `tf.data` path's); each host reads its own share of the shards (`num_pipelines` = hosts) and its slice
of the global batch becomes one global array (`jax.make_array_from_process_local_data`). Raw text goes
through the `tf.data` pipeline where TensorFlow is installed; where it is not (a GPU host or TPU VM with JAX
only), a one-host run first writes the text as records to OUT/records (`kbert data prepare`'s code, which
needs no TensorFlow) and reads those, so `kbert pretrain --corpus text.txt` and `kbert quickstart` work there
too; the batches then follow the records' order, not the tf.data pipeline's. "dummy" needs TensorFlow.

The step: the model's and optimizer's variables as one state pytree; `accumulation` micro-batches per
update, each through `jax.value_and_grad` of the model's losses inside a `keras.StatelessScope` and
`optimizer.stateless_apply` (Keras' own accumulation, as on TensorFlow); the state is donated, so the
update happens in place. Under `DataParallel` the variables are replicated and the batch sharded, and XLA
adds the gradient all-reduce. `sync_to_model()` copies the state back into the Keras variables (before a
checkpoint and at the end). TensorBoard scalars go through `tensorboard`'s own event writer (no TensorFlow).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np


def use_compilation_cache(setting) -> "str | None":
    """Turns on JAX's persistent compilation cache (`runtime.compilation_cache`) and returns its dir, or None.

    A resumed run (or the same run again) then reads its compiled step from disk instead of compiling it:
    a large model's step is slow to compile on a GPU and slower on a TPU pod, and that is paid again on
    every restart after a preemption. JAX's own cache is used (not a kbert format): it keys each program
    by its HLO, the compile options, the device kind and the jax/jaxlib versions, so a changed model or
    upgrade compiles afresh. "auto": the dir JAX was given (JAX_COMPILATION_CACHE_DIR, or
    `jax.config`), else ~/.cache/kbert/jax ($XDG_CACHE_HOME respected); "none" (or empty): off for this
    process, even a dir JAX was given; else a dir.
    JAX caches only programs that took at least `jax_persistent_cache_min_compile_time_secs` (1 s) to
    compile, which keeps Keras' many small eager programs out of it."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    def restart():  # JAX decides once per process whether a cache is in use, at its first compilation
        compilation_cache.reset_cache()  # (Keras' eager initializers may already have run): decide again

    if setting is None or str(setting).strip().lower() in ("", "none", "off", "false"):
        if jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir:
            jax.config.update("jax_enable_compilation_cache", False)  # a dir JAX was given stays unused
            restart()
        return None
    if not jax.config.jax_enable_compilation_cache:  # turned off by an earlier run in this process
        jax.config.update("jax_enable_compilation_cache", True)
        restart()
    current = jax.config.jax_compilation_cache_dir
    if str(setting) == "auto":
        if current:
            return current
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = os.path.join(base, "kbert", "jax")
    else:
        path = os.path.abspath(os.path.expanduser(str(setting)))
    if path == current:
        return path
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{path!r} is not writable")
    except OSError as e:
        if str(setting) == "auto":  # a read-only home (a container, a shared account): run without it
            import warnings

            warnings.warn(f"runtime.compilation_cache: auto could not use {path!r} ({e}); compiled steps are "
                          f"not kept (name a writable dir to keep them, or none to silence this)", stacklevel=2)
            return None
        raise ValueError(f"runtime.compilation_cache: cannot use {path!r} ({e}); name a writable dir, or set "
                         f"it to none") from e
    compilation_cache.set_cache_dir(path)
    restart()
    return path


def _tensorflow_installed() -> bool:
    try:  # imported, not looked up: the tf.data path imports it next anyway
        import tensorflow  # noqa: F401
    except ImportError:
        return False
    return True


class JaxBackend:
    name = "jax"

    def __init__(self, runtime):
        import jax
        import keras

        from kbert.compiled import strategy_devices
        from kbert.train.strategy import STRATEGIES

        self.runtime = runtime
        if runtime.strategy not in STRATEGIES:
            raise ValueError(f"`runtime.strategy` must be one of {STRATEGIES}. Received: {runtime.strategy!r}")
        if runtime.tpu:
            raise ValueError(f"`runtime.tpu` ({runtime.tpu!r}) names a TPU for TensorFlow's cluster resolver and has no "
                             f"JAX equivalent: on a Cloud TPU VM, JAX finds the VM's chips itself; leave runtime.tpu "
                             f"empty (use runtime.strategy: tpu to require them)")
        if runtime.jit is False:
            raise ValueError("`runtime.jit: false` has no JAX equivalent (JAX always compiles the step); leave it at auto")
        if runtime.strategy == "multiworker":
            keras.distribution.initialize()
        devices = strategy_devices(runtime.strategy, "runtime.strategy")  # shared with fine-tuning
        self.devices = devices
        self.replicas = len(devices)
        self.kind = devices[0].platform if devices[0].platform in ("gpu", "tpu") else "cpu"
        self.device_name = getattr(devices[0], "device_kind", self.kind)
        self.process_index, self.process_count = jax.process_index(), jax.process_count()
        self.writer = self.process_index == 0
        self.distribution = None
        if self.replicas > 1 or self.process_count > 1:
            self.distribution = keras.distribution.DataParallel(devices=devices)
        self.jit = True
        self._state = None
        self.compilation_cache = use_compilation_cache(getattr(runtime, "compilation_cache", "auto"))

    def device_memory(self):
        """Bytes JAX's allocator may use on the first accelerator (`bytes_limit`: the device's memory times
        XLA_PYTHON_CLIENT_MEM_FRACTION); None on a CPU, or where the platform does not say."""
        if self.kind == "cpu":
            return None
        return (self.devices[0].memory_stats() or {}).get("bytes_limit")

    @staticmethod
    def compiles_step(precision: str) -> bool:
        """JAX always compiles the step."""
        return True

    def precision(self, requested: str) -> str:
        from kbert.train.strategy import choose_precision

        major = 0
        if self.kind == "gpu":
            try:
                major = int(str(getattr(self.devices[0], "compute_capability", "0")).split(".")[0])
            except ValueError:
                major = 0
        precision = choose_precision(requested, self.kind, major)
        if precision == "mixed_float16" and self.kind == "cpu":
            raise ValueError("runtime.precision: mixed_float16 on Keras' JAX backend needs a GPU (XLA on CPU has "
                             "no float16 matmul that accumulates in float32); on CPU use mixed_bfloat16 or float32")
        return precision

    def scope(self):
        return self.distribution.scope() if self.distribution is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ input
    def batches(self, data_args: dict, micro_batch: int, start_step: int, accumulation: int,
                records_cache: str = None, progress: bool = True):
        """An iterator of global micro-batches (features, labels) as JAX arrays laid out for the step.
        Raw text without TensorFlow is first written as records to `records_cache` (see the module)."""
        from kbert.data import records

        if micro_batch % self.process_count:
            raise ValueError(f"the micro-batch ({micro_batch}) must divide among {self.process_count} hosts")
        local = micro_batch // self.process_count
        start = start_step * accumulation
        source = data_args["source"]
        if not records.records_dir(source) and not _tensorflow_installed():
            source = self._records_of_raw_text(data_args, records_cache, start_step, progress)
        directory = records.records_dir(source)
        if directory:
            from kbert.data.record_reader import RecordBatches

            records.check_joined(records.read_manifest(directory), data_args.get("join_documents", False), directory)
            reader = RecordBatches(directory, data_args["tokenizer"], batch_size=local,
                                   mask_rate=data_args["mask_rate"], max_predictions=data_args["max_predictions"],
                                   whole_word=data_args["whole_word"], ngram=data_args["ngram"],
                                   seed=data_args["seed"], shuffle_buffer=data_args["shuffle_buffer"],
                                   start_batch=start, num_pipelines=self.process_count,
                                   pipeline_id=self.process_index)
            objective = data_args["objective"]
            if objective not in (reader.objective, "mlm+nsp"):
                raise ValueError(f"`objective`={objective!r} differs from the records' objective "
                                 f"{reader.objective!r}; prepare new records or leave `objective` at its default")
            if data_args["max_length"] not in (reader.max_length, 128):
                raise ValueError(f"`max_length`={data_args['max_length']!r} differs from the records' max_length "
                                 f"{reader.max_length!r}; prepare new records or leave `max_length` at its default")
            host = iter(reader)
        else:
            import tensorflow as tf

            from kbert.data.pretraining import pretraining_dataset

            context = None
            if self.process_count > 1:
                context = tf.distribute.InputContext(self.process_count, self.process_index, self.process_count)
            host = pretraining_dataset(**data_args, batch_size=micro_batch if context else local,
                                       start_batch=start, input_context=context).as_numpy_iterator()
        from kbert.utils import in_background

        return in_background((self._place(batch) for batch in host), depth=2)

    def _records_of_raw_text(self, data_args: dict, records_cache: str, start_step: int, progress: bool) -> str:
        """Raw text on a host without TensorFlow: `kbert data prepare` into `records_cache` (the run's
        OUT/records), which the numpy reader then streams. Kept there, so a resumed run tokenizes nothing
        again (prepare skips finished shards); a fresh run whose text or settings changed rewrites it."""
        import sys

        from kbert.data import records

        source = data_args["source"]
        if isinstance(source, str) and source == "dummy":
            raise ValueError("data.source 'dummy' (random ids) is made by the tf.data pipeline, and TensorFlow is not "
                             "installed; pretrain from text or a records dir, or install tensorflow")
        if self.process_count > 1 or records_cache is None:
            raise ValueError(f"data.source {source!r} is raw text and TensorFlow is not installed: on several hosts "
                             f"each needs its share of prepared records; run `kbert data prepare` once and "
                             f"pretrain from the records dir")
        if progress:
            print(f"TensorFlow is not installed: tokenizing the raw text into records first ({records_cache}; "
                  f"kept, so a resumed run reuses them)", file=sys.stderr, flush=True)
        args = dict(objective=data_args["objective"], max_length=data_args["max_length"],
                    short_seq_prob=data_args["short_seq_prob"], seed=data_args["seed"],
                    join_documents=data_args.get("join_documents", False),
                    workers=data_args["workers"], progress=progress)
        try:
            manifest = records.prepare(source, data_args["tokenizer"], records_cache, **args)
        except ValueError:
            if start_step:  # a resumed run must read the records it started on
                raise
            manifest = records.prepare(source, data_args["tokenizer"], records_cache, overwrite=True, **args)
        if progress:
            print(f"records: {manifest['examples']:,} examples in {len(manifest['shards'])} shards "
                  f"({manifest['resumed_shards']} kept from an earlier run)", file=sys.stderr, flush=True)
        return records_cache

    def _place(self, batch):
        """A host's (features, labels) of numpy arrays -> global JAX arrays sharded along the batch."""
        import jax

        if self.distribution is None:
            return jax.tree_util.tree_map(jax.device_put, batch)

        def place(x):
            layout = self.distribution.get_data_layout((x.shape[0] * self.process_count,) + x.shape[1:])
            return jax.make_array_from_process_local_data(layout.backend_layout, np.asarray(x))

        return jax.tree_util.tree_map(place, batch)

    # ------------------------------------------------------------------ the step
    def compile_step(self, model, optimizer, variables, accumulation: int, precision: str):
        """`step(batches)` -> {metric: array on the device}: one optimizer update from `accumulation`
        micro-batches, dispatched without waiting for it (`read_metrics` waits)."""
        import jax
        import keras

        trained = list(variables)
        trained_ids = {id(v) for v in trained}
        frozen = [v for v in model.trainable_variables if id(v) not in trained_ids]
        fixed = list(model.non_trainable_variables)
        opt_vars = list(optimizer.variables)
        self._variables = (trained, frozen, fixed, opt_vars)
        self._state = tuple([v.value for v in group] for group in self._variables)

        def losses_of(tv, fv, nv, ov, features, labels):
            mapping = (list(zip(trained, tv)) + list(zip(frozen, fv)) + list(zip(fixed, nv))
                       + list(zip(opt_vars, ov)))
            with keras.StatelessScope(state_mapping=mapping) as scope:
                outputs = model(features, training=True)
                losses = model.compute_losses(features, labels, outputs, training=True)
                loss = losses["loss"]
                scaled = optimizer.scale_loss(loss) if hasattr(optimizer, "scale_loss") else loss
            return scaled, (losses, [scope.get_current_value(v) for v in fixed])

        grad_fn = jax.value_and_grad(losses_of, has_aux=True)

        def update(state, micro_batches):
            tv, fv, nv, ov = state
            total = None
            for features, labels in micro_batches:  # unrolled: each micro-step feeds the optimizer's accumulator
                (_, (losses, nv)), grads = grad_fn(tv, fv, nv, ov, features, labels)
                tv, ov = optimizer.stateless_apply(ov, grads, tv)
                total = losses if total is None else {k: total[k] + v for k, v in losses.items()}
            return (tv, fv, nv, ov), {k: v / accumulation for k, v in total.items()}

        jitted = jax.jit(update, donate_argnums=(0,))

        def step(iterator):
            micro = tuple(next(iterator) for _ in range(accumulation))
            self._state, metrics = jitted(self._state, micro)
            return metrics  # on the device, still being computed: `read_metrics` waits for them

        return step

    @staticmethod
    def read_metrics(metrics) -> dict:
        """A step's metrics as floats; waits for the step. The loop reads step N while step N+1 runs, so that
        the device never idles on the host (the host's gaps: reading the metrics, the reader threads' turn
        at the GIL, dispatching the next step)."""
        import jax

        return {k: float(v) for k, v in jax.device_get(metrics).items()}

    def sync_to_model(self) -> None:
        """The trained state back into the Keras variables."""
        if self._state is None:
            return
        for group, values in zip(self._variables, self._state):
            for v, value in zip(group, values):
                v.assign(value)

    # ------------------------------------------------------------------ state
    @staticmethod
    def to_numpy(variable) -> np.ndarray:
        value = variable.value
        if hasattr(value, "is_fully_addressable") and not value.is_fully_addressable:
            value = value.addressable_data(0)  # replicated: this host's copy
        return np.asarray(value)

    @staticmethod
    def assign(variable, value) -> None:
        variable.assign(value)

    @staticmethod
    def is_out_of_memory(error: BaseException) -> bool:
        return isinstance(error, (RuntimeError, MemoryError)) and "RESOURCE_EXHAUSTED" in str(error)

    # ------------------------------------------------------------------ logs
    def scalar_writer(self, logdir: str):
        """TensorBoard scalars through `tensorboard`'s event writer (kbert.train.metrics.scalar_writer)."""
        from kbert.train.metrics import scalar_writer

        return scalar_writer(logdir, enabled=self.writer)
