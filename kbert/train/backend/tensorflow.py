"""The pretraining loop's TensorFlow side: a `tf.distribute` strategy, `tf.data` input and a `tf.function` step.

XLA compiles one replica's step where it pays: on one device (GPU, CPU in float32); TPUs compile anyway;
several replicas stay uncompiled around their all-reduce. On CPU, XLA runs bfloat16 matmuls no faster than
float32 while TensorFlow's own (oneDNN) kernels use the CPU's bf16 instructions, so bf16 on CPU runs without
XLA (benchmarks/README.md has the figures).
"""

from __future__ import annotations

import time

import numpy as np


class TensorFlowBackend:
    name = "tensorflow"

    def __init__(self, runtime):
        import tensorflow as tf

        from kbert.train.strategy import device_kind, make_strategy

        self.runtime = runtime
        self.strategy = make_strategy(runtime.strategy, runtime.tpu)
        self.replicas = self.strategy.num_replicas_in_sync
        self.kind = device_kind(self.strategy)
        self.device_name = self.kind
        if self.kind == "gpu":
            details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
            self.device_name = details.get("device_name", "gpu")
        resolver = getattr(self.strategy, "cluster_resolver", None)
        self.writer = resolver is None or resolver.task_type in (None, "chief") or (
            resolver.task_type == "worker" and resolver.task_id == 0)
        self.jit = None

    def device_memory(self):
        """Bytes of memory TensorFlow gives the first GPU; None elsewhere (a TPU's is not reported here)."""
        if self.kind != "gpu":
            return None
        import tensorflow as tf

        memory = tf.config.experimental.get_memory_info("GPU:0").get("limit") or None
        if memory is None:
            details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
            memory = details.get("memory_limit")
        return memory

    def compiles_step(self, precision: str) -> bool:
        """Whether XLA compiles the replica step: always on a TPU; elsewhere by `runtime.jit` (auto: on one
        device, not for bfloat16 on a CPU; see the module docstring). The memory planner follows it: an
        uncompiled step keeps far more."""
        rt = self.runtime
        return self.kind == "tpu" or rt.jit is True or (rt.jit == "auto" and self.replicas == 1
                                                         and not (self.kind == "cpu" and precision != "float32"))

    def precision(self, requested: str) -> str:
        from kbert.train.strategy import resolve_precision

        return resolve_precision(requested, self.strategy)

    def scope(self):
        return self.strategy.scope()

    # ------------------------------------------------------------------ input
    def batches(self, data_args: dict, micro_batch: int, start_step: int, accumulation: int,
                records_cache: str = None, progress: bool = True):
        """An iterator of per-replica micro-batches from `pretraining_dataset(**data_args)`, positioned at
        optimizer step `start_step`. (`records_cache`, `progress`: for a backend without tf.data; tf.data
        reads raw text itself.)"""
        from kbert.data.pretraining import pretraining_dataset

        def dataset_fn(ctx):
            # each input pipeline's batches per optimizer step: its replicas x the micro-steps
            per_step = accumulation * ctx.num_replicas_in_sync // ctx.num_input_pipelines
            return pretraining_dataset(**data_args, batch_size=micro_batch, start_batch=start_step * per_step,
                                       input_context=ctx)

        return iter(self.strategy.distribute_datasets_from_function(dataset_fn))

    # ------------------------------------------------------------------ the step
    def compile_step(self, model, optimizer, variables, accumulation: int, precision: str):
        """`step(batches)` -> {metric: float}: one optimizer update from `accumulation` micro-batches."""
        import tensorflow as tf

        replicas, strategy = self.replicas, self.strategy

        def replica_step(features, labels):
            with tf.GradientTape() as tape:
                outputs = model(features, training=True)
                losses = model.compute_losses(features, labels, outputs, training=True)
                loss = losses["loss"] / replicas
                scaled = optimizer.scale_loss(loss) if hasattr(optimizer, "scale_loss") else loss
            # an embedding looked up by `take` (the segment embedding; the token embedding where no tied head
            # adds a dense part) gets IndexedSlices, one slice per token; the optimizer's global-norm clipping
            # would take the norm of those slices instead of their sum per row (the gradient): dense, it
            # clips by the true norm, as on JAX
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                     for g in tape.gradient(scaled, variables)]
            pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
            optimizer.apply([g for g, _ in pairs], [v for _, v in pairs])
            return {k: v / replicas for k, v in losses.items()}

        jit = self.compiles_step(precision)
        self.jit = jit
        if jit and self.kind != "tpu":  # XLA compiles the replica step; reading the iterator stays outside
            replica_step = tf.function(replica_step, jit_compile=True, reduce_retracing=True)

        @tf.function(reduce_retracing=True)
        def train_step(iterator):
            total = None
            for _ in range(accumulation):  # unrolled: each micro-step feeds the optimizer's accumulator
                features, labels = next(iterator)
                per_replica = strategy.run(replica_step, args=(features, labels))
                result = {k: strategy.reduce("SUM", v, axis=None) for k, v in per_replica.items()}
                total = result if total is None else {k: total[k] + v for k, v in result.items()}
            return {k: v / accumulation for k, v in total.items()}

        def step(iterator):
            try:
                return {k: float(v) for k, v in train_step(iterator).items()}
            except tf.errors.ResourceExhaustedError:
                raise
            except tf.errors.OpError:
                _let_the_pipeline_settle()
                raise

        return step

    @staticmethod
    def read_metrics(metrics) -> dict:
        """A step's metrics as floats (the TensorFlow step returns floats already)."""
        return {k: float(v) for k, v in metrics.items()}

    def sync_to_model(self) -> None:
        """Variables are updated in place: nothing to copy."""

    # ------------------------------------------------------------------ state
    @staticmethod
    def to_numpy(variable) -> np.ndarray:
        return np.asarray(variable.numpy())

    @staticmethod
    def assign(variable, value) -> None:
        variable.assign(value)

    @staticmethod
    def is_out_of_memory(error: BaseException) -> bool:
        import tensorflow as tf

        return isinstance(error, tf.errors.ResourceExhaustedError)

    # ------------------------------------------------------------------ logs
    def scalar_writer(self, logdir: str):
        import tensorflow as tf

        writer = tf.summary.create_file_writer(logdir)

        def write(step: int, scalars: dict):
            with writer.as_default(step=step):
                for k, v in scalars.items():
                    tf.summary.scalar(k, v)

        write.flush = writer.flush
        return write


def _let_the_pipeline_settle(seconds: float = 1.0) -> None:
    """After an error from the input pipeline (e.g. a dead worker process), waits a moment before the error
    propagates. tf.data's threads go on calling the pipeline's Python generator (which needs the GIL) until
    their buffers hold the error; the iterator's destructor waits for those threads while its caller holds
    the GIL, so tearing it down mid-call would deadlock the process instead of reporting the error."""
    time.sleep(seconds)  # releases the GIL
