"""What the pretraining loop needs from a Keras backend, behind one small interface.

`kbert.train.loop.pretrain` reads top to bottom on either backend; the pieces that differ live here:

    backend = make_backend(config.runtime)      # from keras.backend.backend(): "tensorflow" or "jax"
    backend.replicas, backend.kind, backend.device_name
    backend.device_memory()                     # bytes one accelerator offers (batch_size: auto), or None
    backend.compiles_step(precision)            # whether XLA compiles the step (the planner's coefficients)
    with backend.scope(): ...                   # build the model and optimizer (replicated as the backend does)
    batches = backend.batches(data_args, micro_batch, start_step, accumulation, records_cache)  # placed input
    step = backend.compile_step(model, optimizer, variables, accumulation)
    metrics = step(batches)                     # one optimizer update, dispatched (JAX: not yet finished)
    backend.read_metrics(metrics)               # its floats (loss, mlm_accuracy, ...): waits for the step
    backend.sync_to_model()                     # the trained values back into the Keras variables
    backend.to_numpy(variable), backend.assign(variable, array), backend.is_out_of_memory(error)

TensorFlow: `tf.distribute` strategies, `tf.data`, a `tf.function` step (XLA where it pays). JAX:
`keras.distribution.DataParallel` over the devices the strategy names, the numpy records reader
(`kbert.data.record_reader`), and one `jax.jit` step over the model's and optimizer's state.
Checkpoints are backend-neutral (`kbert.train.run_checkpoint`), so either backend resumes the other's run.
"""

from __future__ import annotations


def make_backend(runtime):
    """The backend Keras runs on, set up for `runtime` (a `RuntimeConfig`)."""
    import keras

    name = keras.backend.backend()
    if name == "tensorflow":
        from kbert.train.backend.tensorflow import TensorFlowBackend

        return TensorFlowBackend(runtime)
    if name == "jax":
        from kbert.train.backend.jax import JaxBackend

        return JaxBackend(runtime)
    raise ValueError(f"kbert pretrains on Keras' TensorFlow or JAX backend; KERAS_BACKEND is {name!r}")
