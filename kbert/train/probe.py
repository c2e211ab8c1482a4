"""`kbert plan --exact` and `kbert plan --probe`: the largest batch that trains on the device at hand.

- `--exact` (Keras' JAX backend): XLA compiles the training step (forward, backward, optimizer update, the
  model state donated as in `fit`) at candidate batch sizes and reports the bytes the compiled program needs
  (`memory_analysis()`: arguments + outputs + temporaries - donated buffers the outputs reuse). Nothing is
  executed, so it works on CPU too (on the CPU's compiled program, against a `memory` you name). The search
  starts at the analytic planner's batch and steps by the secant through the measured points (memory is
  close to linear in the batch), so it needs 3-5 compilations per sequence length. On an accelerator two
  compile at once (`compile_workers`): each round compiles the predicted batch and the one just above it,
  so a right prediction is landed and confirmed in the same round (XLA's compilation runs outside Python's
  GIL, in threads; a GPU host's cores are idle while one program compiles).
  There, for models of 6 layers or more, the first prediction comes from 1- and 2-layer copies of the
  model (`shallow_prediction`): a step's bytes are affine in the layers and the batch, and small programs
  compile in a fraction of a full one's time, so the first full round usually lands and confirms.
- `--probe`: starts at the `--exact` answer (the analytic one on TensorFlow) and confirms it with one real
  step at that batch and one just above, searching further only when one of those surprises; each step
  reuses the executable `--exact` compiled for its batch. Out-of-memory errors are caught (TensorFlow's
  ResourceExhaustedError, XLA's RESOURCE_EXHAUSTED on JAX), and the model state is restored from a host copy
  when a failed step had already consumed it.

The model and its optimizer slots are built without values (`build_trainer(..., abstract=True)`): compiling
needs only their shapes and dtypes, and Keras' eager initializers are most of a BERT's start-up (one small
XLA program per initializer and shape, dozens with the optimizer slots, each compiled for the device on a
GPU). A real step (`--probe`) runs from zeros: a step's memory does not depend on the values in it.
The synthetic batches are arguments of the compiled step, never constants inside it, and XLA's
rematerialization pass is off (otherwise a step that does not fit silently recomputes activations instead
of failing, and every batch "fits").
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from typing import Dict, List, Optional

from kbert.data.synthetic import synthetic_batch  # noqa: F401 (kbert.train.probe.synthetic_batch)

import numpy as np


def is_out_of_memory(error: BaseException) -> bool:
    text = f"{type(error).__name__} {error}"
    return ("ResourceExhausted" in text or "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
            or isinstance(error, MemoryError))


def _backend():
    import keras

    return keras.backend.backend()


def accelerator() -> Optional[str]:
    """"gpu"/"tpu" when the Keras backend has one, else None."""
    if _backend() == "jax":
        import jax

        platform = jax.devices()[0].platform
        return platform if platform in ("gpu", "tpu") else None
    import tensorflow as tf

    if tf.config.list_logical_devices("TPU"):
        return "tpu"
    return "gpu" if tf.config.list_logical_devices("GPU") else None


def _reset_peak():
    if _backend() == "tensorflow":
        import tensorflow as tf

        if tf.config.list_logical_devices("GPU"):
            tf.config.experimental.reset_memory_stats("GPU:0")


def peak_memory() -> Optional[int]:
    """Peak bytes in use on the first accelerator since the last reset (JAX: since the process started),
    or None where the device does not report it (CPU)."""
    if _backend() == "jax":
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        return stats.get("peak_bytes_in_use")
    import tensorflow as tf

    if not tf.config.list_logical_devices("GPU"):
        return None
    return int(tf.config.experimental.get_memory_info("GPU:0")["peak"])


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _state_of(trainer):
    return trainer._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                  optimizer_variables=True, metrics_variables=True)


def _state_variables(trainer):
    """The variables of `_state_of(trainer)`, in its order: (trainable, non-trainable, optimizer, metrics)."""
    return (trainer.trainable_variables, trainer.non_trainable_variables, trainer.optimizer.variables,
            trainer.metrics_variables)


def _state_spec(trainer):
    """`_state_of(trainer)`'s shapes and dtypes (JAX `ShapeDtypeStruct`s), read from the variables, which
    need not hold values (`build_trainer(..., abstract=True)`)."""
    import jax

    return tuple([jax.ShapeDtypeStruct(tuple(v.shape), jax.numpy.dtype(v.dtype)) for v in group]
                 for group in _state_variables(trainer))


def _zero_state(trainer):
    """`_state_of(trainer)` on the host: each variable's value where it has one (the optimizer's step count
    and learning rate, made outside the abstract build), zeros where it was built without one, except
    scalars, which get their initial value (a loss-scale optimizer's scale of 0 would make every step's
    gradients 0/0; a scalar initializer is one tiny program)."""
    import jax

    def value(v):
        if getattr(v, "_value", None) is None:
            if not tuple(v.shape) and callable(getattr(v, "_initializer", None)):
                with on_host():
                    return np.asarray(jax.device_get(v._initializer((), v.dtype)))
            return np.zeros(tuple(v.shape), jax.numpy.dtype(v.dtype))
        return np.asarray(jax.device_get(v.value))

    return tuple([value(v) for v in group] for group in _state_variables(trainer))


def program_bytes(compiled) -> Optional[int]:
    """The bytes of a compiled step by XLA's memory analysis; None where it reports none (a training step
    always has arguments, so an analysis of all zeros is a missing one, not a free program)."""
    m = compiled.memory_analysis()
    if m is None or m.argument_size_in_bytes <= 0:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def compiled_step_bytes(trainer, features, labels) -> Optional[int]:
    """JAX: the bytes XLA allocates for one training step at these shapes (arguments + outputs + temporaries,
    less the donated state that outputs reuse), from the compiled program's memory analysis. JAX's
    allocator peak cannot be reset within a process (after one out-of-memory trial it stays near the
    limit), so this is the per-batch figure there. None where the backend does not report it."""
    if _backend() != "jax":
        return None
    import jax

    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype),
                                    (_state_of(trainer), (features, labels)))
    return program_bytes(jax.jit(trainer.train_step, donate_argnums=0).lower(*shapes).compile())


class CompiledStep:
    """One model's training step compiled by XLA (Keras' JAX backend) at the batch sizes asked for.

    Each batch size is compiled once; its memory analysis (`bytes`) and its real execution (`run`) share
    that executable. The batch is an argument of the program (shapes only at compile time), and the model
    state is threaded through the runs (donated, as `fit` does), restored from a host copy if a step that
    ran out of memory had consumed it.

    Args:
        trainer: a compiled `Pretrainer` (`build_trainer`).
        config: its `ModelConfig`.
        seq_len: tokens per sequence.
        predictions: masked positions per sequence (default: 15% of `seq_len`, as pretraining).
    """

    def __init__(self, trainer, config, seq_len: int, predictions: Optional[int] = None, host_state=None):
        import jax

        from kbert.data.masking import default_max_predictions

        if _backend() != "jax":
            raise ValueError("compiling the training step for its memory analysis needs Keras' JAX backend; "
                             "run with KERAS_BACKEND=jax (pip install -e \".[jax]\" or `pip install jax`)")
        self.trainer, self.config, self.seq_len = trainer, config, seq_len
        self.predictions = predictions or default_max_predictions(seq_len, 0.15)
        one = synthetic_batch(config, 1, seq_len, self.predictions)
        if not trainer.built or trainer.optimizer is None or not trainer.optimizer.built:
            with on_host():  # optimizer slots and metrics, made where the host copy is wanted
                trainer._symbolic_build(data_batch=one)
        if host_state is None and not getattr(trainer, "_kbert_abstract", False):
            # The runs use their own copy of the state (donated step after step); the trainer's device copy
            # is released so that the device holds the state once, as in training.
            state = _state_of(trainer)
            host_state = jax.device_get(state)
            for x in jax.tree_util.tree_leaves(state):
                x.delete()
        self._host_state = host_state
        self.state = None
        self._state_spec = _state_spec(trainer)
        self._one = one
        self._jit = jax.jit(trainer.train_step, donate_argnums=0)
        self._compiled: Dict[int, object] = {}

    @property
    def host_state(self):
        """The state the runs start from, on the host: the trainer's values, or zeros where it was built
        without any (`build_trainer(..., abstract=True)`; made at the first real step, since compiling
        needs only the shapes)."""
        if self._host_state is None:
            self._host_state = _zero_state(self.trainer)
        return self._host_state

    def release(self):
        """Frees the device copy of the state (the host copy stays for the next `run`)."""
        import jax

        if self.state is not None:
            for x in jax.tree_util.tree_leaves(self.state):
                if not x.is_deleted():
                    x.delete()
        self.state = None

    def _data_spec(self, batch: int):
        import jax

        return jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct((batch,) + tuple(np.shape(x))[1:], x.dtype), self._one)

    def compiled(self, batch: int):
        if batch not in self._compiled:
            self.compile_all([batch])
        return self._compiled[batch]

    def compile_all(self, batches, workers: int = 1) -> None:
        """Compiles the batch sizes not compiled yet, up to `workers` at a time. Tracing and lowering (Python,
        Keras state) run here one after another; XLA's compilation releases the GIL, so `workers` > 1 runs
        that part in threads, each starting as soon as its program is lowered. On a GPU a compilation is
        mostly serial host work (HLO passes, autotuning) on a host with many idle cores; on a CPU XLA already
        spreads one compilation over the cores."""
        todo = [b for b in dict.fromkeys(batches) if b not in self._compiled]
        if not todo:
            return
        _no_silent_recomputation()
        self._compiled.update(compile_concurrently(((b, self.lower(b)) for b in todo), workers))

    def lower(self, batch: int, platform: Optional[str] = None, device=None):
        """The step traced and lowered at `batch` (JAX `Lowered`; shapes only, nothing on the device), for
        `platform` ("cuda", "tpu", ...) instead of this host's devices when given (nothing runs there either),
        or placed on `device`: a JAX device, which may be one of a topology description's
        (`jax.experimental.topologies`), so that `.compile()` runs that device's compiler with no such device
        here (XLA's deviceless compilation)."""
        if device is not None:
            import jax

            placed = jax.sharding.SingleDeviceSharding(device)
            state, data = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=placed),
                                                 (self._state_spec, self._data_spec(batch)))
            return self._jit.trace(state, data).lower()
        if platform is None:
            return self._jit.lower(self._state_spec, self._data_spec(batch))
        return self._jit.trace(self._state_spec, self._data_spec(batch)).lower(lowering_platforms=(platform,))

    @property
    def compiled_batches(self) -> List[int]:
        """The batch sizes compiled so far (each kept for reuse)."""
        return sorted(self._compiled)

    def bytes(self, batch: int) -> Optional[int]:
        """Bytes the step at `batch` needs on this device, by XLA's memory analysis (nothing runs)."""
        return program_bytes(self.compiled(batch))

    def bytes_for(self, batch: int, device) -> Optional[int]:
        """`bytes` by another device's compiler: the step compiled for `device` (`lower(..., device=)`, e.g. a
        GPU of a topology description on a host without one) and its memory analysis read. Not kept: nothing
        here could run it."""
        _no_silent_recomputation()
        return program_bytes(self.lower(batch, device=device).compile())

    def run(self, batch: int, steps: int = 1) -> Dict[str, float]:
        """`steps` real training steps at `batch`; an out-of-memory error propagates."""
        import jax

        if self.state is None or any(x.is_deleted() for x in jax.tree_util.tree_leaves(self.state)):
            self.state = jax.device_put(self.host_state)  # first run, or a failed step consumed it
        compiled = self.compiled(batch)
        features, labels = synthetic_batch(self.config, batch, self.seq_len, self.predictions)
        data = None
        try:
            data = jax.device_put((features, labels))
            for _ in range(steps):
                logs, self.state = compiled(self.state, data)
            jax.block_until_ready(logs)
        finally:
            del data
        return {k: float(v) for k, v in logs.items()}


def compile_concurrently(lowered, workers: int = 1) -> Dict:
    """`{key: lowered.compile()}` for JAX `Lowered` programs (a dict, or (key, lowered) pairs, which may be a
    generator that lowers as it goes), up to `workers` at a time in threads (XLA's compilation releases the
    GIL). From pairs, each program starts compiling as soon as it is lowered, while the next one is traced
    and lowered here (Python work that grows with the model). A compilation that runs out of device memory
    while others run beside it (autotuning's scratch buffers on a capped device) is retried alone; any other
    error propagates."""
    pairs = lowered.items() if isinstance(lowered, dict) else lowered
    if workers <= 1:
        return {k: low.compile() for k, low in pairs}
    from concurrent.futures import ThreadPoolExecutor

    programs, futures = {}, {}
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kbert-compile") as pool:
        for k, low in pairs:
            programs[k] = low
            futures[k] = pool.submit(low.compile)
    done = {}
    for k, future in futures.items():
        error = future.exception()
        if error is None:
            done[k] = future.result()
        elif is_out_of_memory(error):
            done[k] = programs[k].compile()
        else:
            raise error
    return done


def _no_silent_recomputation():
    """JAX: XLA's rematerialization pass makes a step that does not fit recompute activations instead of
    failing, so every batch would "fit" (only slower); the probe turns it off to find the batch that fits
    as written."""
    if _backend() == "jax":
        import jax

        try:
            jax.config.update("jax_compiler_enable_remat_pass", False)
        except (AttributeError, KeyError):  # an older JAX without the option
            pass


def host_device():
    """JAX: the host's CPU device when the default device is an accelerator, else None (nothing to move)."""
    if _backend() != "jax":
        return None
    import jax

    if jax.devices()[0].platform == "cpu":
        return None
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS without cpu
        return None


def on_host():
    """A context in which new JAX arrays are made on the host (`host_device`), where there is one.

    `CompiledStep` wants the model's initial state on the host (it keeps a host copy and puts it on the
    device for each run), so the model is built there: Keras initializes each variable eagerly, one small
    XLA program per initializer and shape (dozens for a BERT with its optimizer slots), and on a GPU
    each of those compiles for the device and the result then travels back to the host for nothing."""
    device = host_device()
    if device is None:
        return contextlib.nullcontext()
    import jax

    return jax.default_device(device)


def build_trainer(config, optimizer: str = "adamw", precision: str = "float32", host: bool = False,
                  abstract: bool = False):
    """A compiled `Pretrainer` (NSP/SOP head included) whose `train_on_batch` is one real training step.
    `host=True` (JAX): its variables are made on the host (`on_host`), for a `CompiledStep`, which runs its
    own copy of the state on the device; train it there, not with `train_on_batch`.

    `abstract=True` (JAX; implies `host`): the model, its optimizer slots and metrics are built with shapes
    and dtypes only, no initializer run (Keras' deferred variables), which is all `CompiledStep` needs to
    compile; its real steps start from zeros. Only for `CompiledStep`: the variables hold no values."""
    import keras

    from kbert.data.masking import default_max_predictions
    from kbert.models.backbone import Pretrainer, build_backbone

    abstract = abstract and _backend() == "jax"
    keras.mixed_precision.set_dtype_policy(precision)
    try:
        with on_host() if host or abstract else contextlib.nullcontext():
            # the optimizer's own scalars (step count, learning rate) take values: Keras makes them from
            # constants, which a stateless scope refuses; they are a few bytes
            opt = {"adamw": keras.optimizers.AdamW, "adam": keras.optimizers.Adam, "lamb": keras.optimizers.Lamb,
                   "sgd": keras.optimizers.SGD}[optimizer](learning_rate=1e-5)
            if precision == "mixed_float16":
                opt = keras.optimizers.LossScaleOptimizer(opt)
            with _deferred_variables() if abstract else contextlib.nullcontext():
                model = Pretrainer(build_backbone(config))
                model.compile(optimizer=opt, jit_compile=_backend() != "tensorflow" or accelerator() is not None)
                if abstract:
                    model._symbolic_build(
                        data_batch=synthetic_batch(config, 1, 8, default_max_predictions(8, 0.15)))
                    model._kbert_abstract = True
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    return model


@contextlib.contextmanager
def _deferred_variables():
    """Keras variables made inside get a shape, a dtype and an initializer but no value (a stateless scope
    that does not initialize them on exit). They are also taken off Keras' list of variables waiting for a
    value: every stateless scope that closes with its default settings initializes that list, and one
    closes inside each traced training step, where an initializer would run on tracers."""
    import keras
    from keras.src.backend.common import global_state

    def waiting():
        return list(global_state.get_global_attribute("uninitialized_variables") or [])

    before = waiting()
    with keras.StatelessScope(initialize_variables=False):
        yield
    kept = {id(v) for v in before}
    global_state.set_global_attribute("uninitialized_variables", [v for v in waiting() if id(v) in kept])


def compile_workers() -> int:
    """Compilations `--exact` runs at once: 2 on an accelerator (the prediction and the batch just above it
    compile together, so a search lands in one or two compile rounds instead of three or more in a row),
    1 on CPU (XLA already uses every core for one). `KBERT_COMPILE_WORKERS` overrides it."""
    env = os.environ.get("KBERT_COMPILE_WORKERS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise ValueError(f"KBERT_COMPILE_WORKERS={env!r}: expected a whole number of compilations at once")
    return 2 if accelerator() is not None else 1


def shallow_prediction(config, seq_len: int, budget: float, batch: int, optimizer: str = "adamw",
                       precision: str = "float32", predictions: Optional[int] = None, workers: int = 1,
                       verbose: bool = False) -> Optional[Dict]:
    """The full model's compiled bytes, predicted from copies of it with 1 and 2 layers, and the batch at
    which they reach `budget`. None where the model is too shallow or its layers are not alike.

    A compiled step's bytes are affine in the number of layers (each block keeps the same activations,
    weights, gradients and slots; the embeddings, heads, the last block at the predicted rows and the
    input are the rest) and in the batch, so four small compilations, 1 and 2 layers at `batch` and at
    about half of it, give the whole plane: bytes(L, b) = s1(b) + (L - 1) x (s2(b) - s1(b)), with s1, s2
    affine in b. When the prediction lies more than a factor of 2 outside those batches (a start far off;
    at a few sequences the bytes are not yet affine in the batch) the copies compile again around it, at
    most three rounds. On a GPU a compilation's time grows with the program (HLO passes, code generation), so
    these are a fraction of one full compilation each, and compile `2 x workers` at a time; the prediction
    then only has to be confirmed, which `exact_batch_size` does with full compilations. Returns
    `predicted_batch`, `bytes_per_batch`, `predicted` {batch: bytes} at the two batches, `tried`
    [(layers, batch, bytes)] and `seconds`."""
    import dataclasses

    layers = config.num_layers
    if layers < 3 or (config.architecture == "albert" and config.num_groups != 1):
        return None  # nothing to save below 3 layers; ALBERT groups change what a layer adds
    began = time.perf_counter()
    steps = {}
    for n in (1, 2):
        shallow = dataclasses.replace(config, num_layers=n)
        steps[n] = CompiledStep(build_trainer(shallow, optimizer, precision, abstract=True), shallow, seq_len,
                                predictions)
    _no_silent_recomputation()
    sizes: Dict = {}
    batch, found = max(2, int(batch)), None
    for _ in range(3):  # a start far from the answer: again around the prediction (small batches are not affine)
        batches = (batch, max(1, batch // 2))
        todo = (((n, b), steps[n].lower(b)) for n in steps for b in batches if (n, b) not in sizes)
        for key, c in compile_concurrently(todo, 2 * workers if workers > 1 else 1).items():
            sizes[key] = program_bytes(c)
        if any(v is None for v in sizes.values()):
            break
        full = {b: sizes[1, b] + (layers - 1) * (sizes[2, b] - sizes[1, b]) for b in batches}
        slope = (full[batches[0]] - full[batches[1]]) / (batches[0] - batches[1])
        if slope <= 0:
            break
        predicted = max(0, int(batches[0] + (budget - full[batches[0]]) // slope))
        found = {"predicted_batch": predicted, "bytes_per_batch": slope, "predicted": full}
        if verbose:
            print(f"  seq {seq_len}: 1- and 2-layer copies at batch {batches[0]} and {batches[1]} predict "
                  f"{_size(full[batches[0]])} at {batches[0]}, so batch {predicted} at the budget",
                  file=sys.stderr, flush=True)
        if batches[1] / 2 <= predicted <= 2 * batches[0] or predicted < 2:
            break
        batch = predicted
    for st in steps.values():
        st.release()
    if found is None:
        return None
    return dict(found, tried=[(n, b, sizes[n, b]) for (n, b) in sizes], seconds=time.perf_counter() - began)


def exact_batch_size(config, seq_len: int, memory=None, optimizer: str = "adamw", precision: str = "float32",
                     start: Optional[int] = None, max_batch: int = 4096, step: Optional[CompiledStep] = None,
                     verbose: bool = False, workers: Optional[int] = None, shallow: Optional[bool] = None) -> Dict:
    """The largest batch (at most `max_batch`) whose compiled training step needs at most `memory` bytes
    (default: the device's limit), by XLA's memory analysis; nothing is executed. Keras' JAX backend only.

    The search keeps the largest batch known to fit (`lo`) and the smallest known not to (`hi`) and tries
    the secant prediction through the measured points nearest the budget (bisection when it stalls),
    starting from `start` (default: the analytic planner's batch). With `workers` >= 2 (default
    `compile_workers()`: 2 on an accelerator) each round compiles the prediction and the batch just above it
    together: when the prediction is right, that one round both lands and confirms it.

    `shallow` (default: on an accelerator, for models of 6 layers or more) starts the search from
    `shallow_prediction` instead of the planner: four compilations of 1- and 2-layer copies pin the
    full program's bytes to the batch, so the first full round usually lands the answer and confirms it,
    where the planner's start (deliberately a few percent on the fitting side) takes a second round. On
    CPU it is off: one compilation of the full model is already quick there.

    Returns a dict with `max_batch`, `bytes` at it, `budget`, `limited_by`, `tried` [(batch, bytes)] in
    compile order, `rounds` (rounds of full compilations: the wall time is about rounds x one compilation)
    and `shallow` (`shallow_prediction`'s answer, or None).

    Example:
        >>> exact_batch_size(ModelConfig.preset("bert-base"), 128, "12GB", precision="mixed_bfloat16")
    """
    from kbert.train.memory import check_seq_len, compiler_for, estimate_memory, max_batch_size, parse_memory

    check_seq_len(config, seq_len)
    compiler = compiler_for(accelerator())  # the analytic start for the program this host compiles
    budget = parse_memory(memory) if memory else device_memory()
    if not budget:
        raise ValueError("`memory` is required where the device does not report its memory (CPU): name the "
                         "device you are planning for, e.g. --memory 12GB")
    workers = compile_workers() if workers is None else max(1, int(workers))
    step = step or CompiledStep(build_trainer(config, optimizer, precision, abstract=True), config, seq_len)
    if start is None:
        start = max_batch_size(config, budget, seq_len, optimizer=optimizer, precision=precision, compiler=compiler)
    if shallow is None:
        shallow = accelerator() is not None and config.num_layers >= 6
    early = shallow_prediction(config, seq_len, budget, start or 1, optimizer, precision, step.predictions,
                               workers, verbose) if shallow else None
    if early is not None:
        start = early["predicted_batch"]
    sizes: Dict[int, int] = {}
    lo, hi = 0, max_batch + 1  # lo fits (0: none known), hi does not (max_batch + 1: the cap)
    rounds = 0

    def measure(batches) -> None:
        nonlocal lo, hi, rounds
        batches = [b for b in dict.fromkeys(batches) if b not in sizes]
        if not batches:
            return
        rounds += 1
        step.compile_all(batches, workers)
        for b in batches:
            sizes[b] = step.bytes(b)
            if sizes[b] is None:
                raise RuntimeError(f"XLA reports no memory analysis for the compiled step on "
                                   f"{accelerator() or 'cpu'}, so --exact cannot size it; use --probe (real "
                                   f"steps) or the planner's estimate")
            fit = sizes[b] <= budget
            if verbose:
                print(f"  seq {seq_len}: batch {b} compiles to {_size(sizes[b])} "
                      f"({'fits' if fit else 'does not fit'})", file=sys.stderr, flush=True)
            if fit:
                lo = max(lo, b)
            else:
                hi = min(hi, b)

    def predict() -> int:
        """The batch the measured points say is the last that fits."""
        near = sorted(sizes, key=lambda k: abs(sizes[k] - budget))
        a = near[0]
        apart = [k for k in near[1:] if abs(k - a) >= 2]  # a neighbour's difference is too short a base
        if apart:
            b = apart[0]
            slope = (sizes[b] - sizes[a]) / (b - a)
            return int(a + (budget - sizes[a]) // slope) if slope > 0 else (lo + hi) // 2
        if early is not None:  # one point: the shallow copies' bytes per sequence
            return int(a + (budget - sizes[a]) // early["bytes_per_batch"])
        # one point: the bytes above the model state (analytic) grow in proportion to the batch
        state = estimate_memory(config, 1, seq_len, optimizer=optimizer, precision=precision)["weights_grads_slots"]
        above = sizes[a] - state
        return int(a * (budget - state) / above) if above > 0 and budget > state else a // 2

    batch, stalled = max(1, min(start or 1, max_batch)), 0
    for _ in range(64):  # the secant converges in a few rounds; bisection bounds the rest (log2 of max_batch)
        # the prediction, and with a second worker its confirmation just above (the cap excluded)
        measure([batch] + ([batch + 1] if workers >= 2 and batch + 1 < hi else []))
        if hi - lo <= 1:
            break
        guess = predict()
        clamped = min(max(guess, lo + 1), hi - 1)  # a prediction on a known point: its neighbour inside
        stalled = stalled + 1 if clamped != guess else 0
        if stalled >= 3:  # three neighbour steps in a row: memory is not near-linear here; bisect
            clamped, stalled = (lo + hi) // 2, 0
        batch = clamped
    return {"seq_len": seq_len, "max_batch": lo, "bytes": sizes.get(lo), "budget": budget,
            "limited_by": "max_batch" if lo >= max_batch else "memory",
            "tried": [(b, sizes[b]) for b in sizes], "rounds": rounds, "shallow": early}


def probe_batch_size(config, seq_len: int, optimizer: str = "adamw", precision: str = "float32",
                     start: Optional[int] = None, max_batch: int = 4096, steps: int = 1,
                     predictions: Optional[int] = None, model=None, verbose: bool = False,
                     step: Optional[CompiledStep] = None) -> Dict:
    """Largest batch (at most `max_batch`) for which `steps` real training steps run without running out of
    memory. Starts at `start` (best: the `exact_batch_size` answer) and tries `start + 1`; when both answer
    as expected that is the whole probe, otherwise it doubles up or halves down from there and bisects.
    Returns a dict with `max_batch`, `peak_bytes` (JAX: the compiled program's bytes; TensorFlow: the
    allocator's peak) and the `tried` list of (batch, fitted, peak_bytes)."""
    from kbert.data.masking import default_max_predictions
    from kbert.train import faults

    predictions = predictions or default_max_predictions(seq_len, 0.15)
    _no_silent_recomputation()
    if _backend() == "jax" and step is None:
        step = CompiledStep(model or build_trainer(config, optimizer, precision, abstract=True), config, seq_len,
                            predictions)
    model = model or (step.trainer if step is not None else build_trainer(config, optimizer, precision))
    tried: List = []
    peaks = {}

    def fits(batch: int) -> bool:
        try:
            faults.check_memory(batch)
            if step is not None:
                step.run(batch, steps)
            else:
                features, labels = synthetic_batch(config, batch, seq_len, predictions)
                _reset_peak()
                for _ in range(steps):
                    model.train_on_batch(features, labels)
        except Exception as e:  # noqa: BLE001 - only out-of-memory is an answer; anything else re-raises
            if not is_out_of_memory(e):
                raise
            tried.append((batch, False, None))
            if verbose:
                print(f"  seq {seq_len}: batch {batch} runs out of memory", file=sys.stderr, flush=True)
            gc.collect()
            return False
        peaks[batch] = step.bytes(batch) if step is not None else peak_memory()
        tried.append((batch, True, peaks[batch]))
        if verbose:
            peak = f", {_size(peaks[batch])}" if peaks[batch] else ""
            print(f"  seq {seq_len}: batch {batch} fits{peak}", file=sys.stderr, flush=True)
        return True

    lo, hi = 0, None  # lo fits (0: nothing yet), hi does not (None: nothing failed yet)
    batch = max(1, min(start or 8, max_batch))
    if fits(batch):
        lo = batch
        if lo < max_batch:  # one just above: the answer is confirmed when it does not fit
            if fits(lo + 1):
                lo += 1
            else:
                hi = lo + 1
        while lo < max_batch and hi is None:  # the start was low: double until something fails
            batch = min(2 * lo, max_batch)
            if fits(batch):
                lo = batch
            else:
                hi = batch
    else:
        hi = batch
        while hi > 1 and lo == 0:  # halve until something fits
            if fits(hi // 2):
                lo = hi // 2
            else:
                hi //= 2
    while hi is not None and hi - lo > 1 and lo > 0:  # binary search between them
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return {"seq_len": seq_len, "max_batch": lo, "peak_bytes": peaks.get(lo), "tried": tried,
            "limited_by": "max_batch" if lo >= max_batch else "memory"}


def device_memory() -> Optional[int]:
    """Total memory of the first accelerator where the backend reports it (JAX: bytes_limit)."""
    if _backend() == "jax":
        import jax

        return (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    return None


def probe_table(model: str, seq_lens, optimizer: str = "adamw", precision: str = "float32",
                memory=None, max_batch: int = 4096, verbose: bool = False, exact: bool = True,
                probe: bool = True, workers: Optional[int] = None, shallow: Optional[bool] = None) -> List[Dict]:
    """For each sequence length: the analytic planner's max batch, the `--exact` one (JAX) and the probed
    one (real steps, `probe=True`), with planned vs compiled vs measured bytes; `seconds` per length, and on the
    first row `startup_seconds`: the model and optimizer built and the state copied to the host, once a table).
    `shallow`: `exact_batch_size`'s start from 1- and 2-layer copies (None: its default); the row's
    `exact_shallow` has that prediction and its seconds."""

    from kbert.train.memory import (check_seq_len, compiler_for, config_of, estimate_memory, max_batch_size,
                                    parse_memory)

    from kbert.train import faults

    if probe and accelerator() is None and faults.memory_hook() is None:
        raise ValueError("--probe measures an accelerator and found none (on CPU memory is not the limit); run "
                         "it on a GPU or TPU, or read the planner's table (--exact with --memory compiles the "
                         "step for a device you name)")
    exact = exact and _backend() == "jax"
    config = config_of(model) if isinstance(model, str) else model  # a preset, model dir or hub name
    for seq in seq_lens:
        check_seq_len(config, seq)
    total = parse_memory(memory) if memory else device_memory()
    compiler = compiler_for(accelerator())  # the analytic plan for the program this host compiles and runs
    began = time.perf_counter()
    trainer = build_trainer(config, optimizer, precision, abstract=True)  # with values on TensorFlow
    rows, host_state = [], None
    for seq in seq_lens:
        started = time.perf_counter()
        planned = max_batch_size(config, total, seq, optimizer=optimizer, precision=precision,
                                 compiler=compiler) if total else None
        row = {"seq_len": seq, "planned_batch": planned}
        step = CompiledStep(trainer, config, seq, host_state=host_state) if _backend() == "jax" else None
        if not rows:  # once per table: the model and optimizer built, the state copied to the host
            row["startup_seconds"] = time.perf_counter() - began
        host_state = step._host_state if step is not None else None  # None for an abstract build: nothing to copy
        start = planned or 8
        if exact:
            found = exact_batch_size(config, seq, total, optimizer, precision, start=start, max_batch=max_batch,
                                     step=step, verbose=verbose, workers=workers, shallow=shallow)
            early = found["shallow"]
            row.update(exact_batch=found["max_batch"], exact_bytes=found["bytes"], exact_tried=found["tried"],
                       exact_rounds=found["rounds"], exact_shallow=early and {
                           "predicted_batch": early["predicted_batch"], "seconds": early["seconds"]})
            start = found["max_batch"] or 1
        if probe:
            found = probe_batch_size(config, seq, optimizer, precision, start=start, max_batch=max_batch,
                                     model=trainer, verbose=verbose, step=step)
            row.update(probed_batch=found["max_batch"], measured_bytes=found["peak_bytes"],
                       limited_by=found["limited_by"], tried=found["tried"])
        if step is not None:
            step.release()
        reference = row.get("probed_batch", row.get("exact_batch"))
        estimate = estimate_memory(config, reference, seq, optimizer=optimizer, precision=precision,
                                   compiler=compiler)["total"] if reference else None
        measured = row.get("measured_bytes", row.get("exact_bytes"))
        row.update(planned_bytes=estimate, seconds=time.perf_counter() - started,
                   error=(estimate - measured) / measured if estimate and measured else None)
        rows.append(row)
    return rows
