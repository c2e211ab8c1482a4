"""AdamW and LAMB with BERT's schedule: linear warm-up, then linear / polynomial decay; no weight decay on
LayerNorm parameters and biases; global-norm clipping; gradient accumulation over micro-batches.

AdamW is Keras' update (decoupled decay, `w -= lr * wd * w`, on the weights before the step, as torch's AdamW and
BERT's optimizer; Adam's bias correction as torch's, which BERT's optimizer leaves out). Its epsilon is TF's:
added to the square root of the uncorrected second moment, which is `epsilon / sqrt(1 - beta_2 ** t)` added to
the bias-corrected one's where torch and optax add `epsilon`; at BERT's 1e-6 the two differ in the first steps
only (tests/test_train.py checks the update against optax's transforms, with an epsilon large enough to tell
the conventions apart). On TensorFlow it runs as one fused kernel a variable (`AdamW` below). LAMB is Keras'
`Lamb` with the update ALBERT's recipe trains with (`Lamb` below): Keras' own decays weights outside the
layer-wise trust ratio and applies the ratio to LayerNorm parameters and biases too.
"""

from __future__ import annotations

import keras

OPTIMIZERS = ("adamw", "lamb")
DECAYS = ("linear", "polynomial", "constant")
# Variables whose name contains one of these get no weight decay (LayerNorm gammas/betas, all biases).
NO_DECAY = ("bias", "beta", "gamma", "layer_norm", "layernorm")


@keras.saving.register_keras_serializable("kbert")
class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
    """`peak * (step + 1) / warmup` for `step < warmup` (steps count from 0, so no update is spent at rate 0,
    where BERT's and transformers' warm-up start), then polynomial decay (power 1: linear) from the peak at
    `warmup` to `end` at `total_steps`. Steps are optimizer updates: Keras calls a schedule with its raw
    micro-step counter, which with gradient accumulation advances once per micro-batch, so that counter is
    divided by `accumulation`."""

    def __init__(self, peak, total_steps, warmup_steps=0, end=0.0, power=1.0, accumulation=1):
        self.peak, self.total_steps, self.warmup_steps = float(peak), int(total_steps), int(warmup_steps)
        self.end, self.power, self.accumulation = float(end), float(power), int(accumulation)

    def __call__(self, step):
        ops = keras.ops
        step = ops.floor(ops.cast(step, "float32") / float(self.accumulation))
        warm = self.peak * (step + 1.0) / max(self.warmup_steps, 1)
        span = max(self.total_steps - self.warmup_steps, 1)
        frac = ops.clip((step - self.warmup_steps) / span, 0.0, 1.0)
        decayed = (self.peak - self.end) * (1.0 - frac) ** self.power + self.end
        return ops.where(step < self.warmup_steps, warm, decayed)

    def host_value(self, step) -> float:
        """The same rate as a Python float, computed on the host: the loop logs it while the accelerator is
        busy, and a device op would wait for the step in flight (leaving the device idle until the next)."""
        step = float(int(step) // self.accumulation)
        if step < self.warmup_steps:
            return self.peak * (step + 1.0) / max(self.warmup_steps, 1)
        span = max(self.total_steps - self.warmup_steps, 1)
        frac = min(max((step - self.warmup_steps) / span, 0.0), 1.0)
        return (self.peak - self.end) * (1.0 - frac) ** self.power + self.end

    def get_config(self):
        return {"peak": self.peak, "total_steps": self.total_steps, "warmup_steps": self.warmup_steps,
                "end": self.end, "power": self.power, "accumulation": self.accumulation}


# the dtypes TensorFlow's fused Adam kernel is registered for on CPU, GPU and (through XLA) TPU
_FUSED_DTYPES = ("float16", "bfloat16", "float32", "float64")


@keras.saving.register_keras_serializable("kbert")
class AdamW(keras.optimizers.Adam):
    """Keras' AdamW (its `Adam` with decoupled decay), with the same update and slot variables, that on
    TensorFlow applies it with TensorFlow's fused Adam kernel (`ResourceApplyAdam`: one pass over a variable and
    its two moments) instead of Keras' dozen element-wise ops, each a full pass over memory when TensorFlow runs
    the step as a graph (XLA off, as Keras runs it on a CPU): over BERT's 110M parameters those passes are a
    sizeable part of a CPU step. The kernel computes Keras' form exactly (TF's epsilon convention is Keras');
    JAX and torch run Keras' own update (XLA fuses it on JAX). The decoupled decay, `w -= lr * wd * w` before
    the step as in Keras, is applied here too, as one multiply by the scalar `lr * wd` (Keras' own multiplies
    the weights by each in turn).
    """

    def __init__(self, learning_rate=0.001, weight_decay=0.004, name="adamw", **kwargs):
        # Keras' AdamW's first two positions. Decayed in `update_step` (on the update steps only, as Keras' own
        # decay): Keras' base class gets None
        super().__init__(learning_rate=learning_rate, weight_decay=None, name=name, **kwargs)
        self.decay_rate = float(weight_decay or 0.0)

    def update_step(self, gradient, variable, learning_rate):
        ops = keras.ops
        if self.decay_rate and self._use_weight_decay(variable):
            scale = ops.multiply(ops.cast(learning_rate, variable.dtype), ops.cast(self.decay_rate, variable.dtype))
            self.assign_sub(variable, ops.multiply(variable, scale))
        fused = keras.backend.standardize_dtype(variable.dtype) in _FUSED_DTYPES and not self.amsgrad
        if keras.backend.backend() != "tensorflow" or not fused:
            return super().update_step(gradient, variable, learning_rate)
        import tensorflow as tf

        dtype = variable.dtype
        t = tf.cast(self.iterations + 1, dtype)
        beta_1, beta_2 = tf.cast(self.beta_1, dtype), tf.cast(self.beta_2, dtype)
        m = self._momentums[self._get_variable_index(variable)]
        v = self._velocities[self._get_variable_index(variable)]
        # `variable` is the tf.Variable (a replica's under tf.distribute); the slots' `.handle` is that replica's too
        tf.raw_ops.ResourceApplyAdam(
            var=_handle(variable), m=_handle(m), v=_handle(v), beta1_power=tf.pow(beta_1, t),
            beta2_power=tf.pow(beta_2, t), lr=tf.cast(learning_rate, dtype), beta1=beta_1, beta2=beta_2,
            epsilon=tf.cast(self.epsilon, dtype), grad=tf.cast(tf.convert_to_tensor(gradient), dtype))

    def get_config(self):
        return dict(super().get_config(), weight_decay=self.decay_rate)


def _handle(variable):
    """The resource handle of a Keras variable or of the tf.Variable Keras' TensorFlow optimizer passes."""
    return (variable.value if isinstance(variable, keras.Variable) else variable).handle


@keras.saving.register_keras_serializable("kbert")
class Lamb(keras.optimizers.Lamb):
    """LAMB as the paper and ALBERT's recipe define it (google-research/albert's `lamb_optimizer.py`, and
    TF-Addons' `LAMB`): with Adam's step `s = m_hat / (sqrt(v_hat) + eps)`,

        u = s + wd * w;  w -= lr * (||w|| / ||u||) * u     (the ratio is 1 where either norm is 0)

    for the variables that take weight decay, and `w -= lr * s` for those excluded from it
    (`exclude_from_weight_decay`: LayerNorm parameters and biases), which ALBERT also excludes from the ratio.

    Keras' `Lamb` differs in two ways that change training: it decays every variable before the step, as
    AdamW does (`w -= lr * wd * w`), so the decay escapes the trust ratio (far below 1 for BERT's weights)
    and is that much stronger than the recipe's; and it scales the steps of biases and LayerNorm
    parameters by their own ratio, so a bias that has just left zero hardly moves. Adam's bias correction is
    kept (Keras', TF-Addons', NVIDIA's and optax's LAMB have it; ALBERT's has not, which matters in the first
    steps of a run without warm-up only). Subclassing Keras' class keeps its slot variables (checkpoints
    written with either resume with the other), clipping, gradient accumulation and loss scaling.
    """

    def __init__(self, learning_rate=0.001, weight_decay=None, **kwargs):
        # Keras' base class would decay outside the ratio whenever `weight_decay` is set: it gets None
        super().__init__(learning_rate=learning_rate, weight_decay=None, **kwargs)
        self.decay_rate = float(weight_decay or 0.0)

    def update_step(self, gradient, variable, learning_rate):
        ops = keras.ops
        dtype = variable.dtype
        lr = ops.cast(learning_rate, dtype)
        gradient = ops.cast(gradient, dtype)
        t = ops.cast(self.iterations + 1, dtype)  # optimizer updates (Keras divides out accumulation)
        # the slots and the exclusion test as Keras' own update steps read them
        m = self._momentums[self._get_variable_index(variable)]
        v = self._velocities[self._get_variable_index(variable)]
        self.assign_add(m, ops.multiply(ops.subtract(gradient, m), 1.0 - self.beta_1))
        self.assign_add(v, ops.multiply(ops.subtract(ops.square(gradient), v), 1.0 - self.beta_2))
        m_hat = ops.divide(m, 1.0 - ops.power(ops.cast(self.beta_1, dtype), t))
        v_hat = ops.divide(v, 1.0 - ops.power(ops.cast(self.beta_2, dtype), t))
        step = ops.divide(m_hat, ops.add(ops.sqrt(v_hat), self.epsilon))
        if not self._use_weight_decay(variable):  # by name, decided once at tracing: no decay, no ratio
            self.assign_sub(variable, ops.multiply(lr, step))
            return
        if self.decay_rate:
            step = ops.add(step, ops.multiply(ops.cast(self.decay_rate, dtype), variable))
        w_norm = ops.sqrt(ops.sum(ops.square(variable)))
        s_norm = ops.sqrt(ops.sum(ops.square(step)))
        ratio = ops.where(ops.logical_and(w_norm > 0, s_norm > 0), w_norm / ops.maximum(s_norm, 1e-30), 1.0)
        self.assign_sub(variable, ops.multiply(ops.multiply(lr, ratio), step))

    def get_config(self):
        return dict(super().get_config(), weight_decay=self.decay_rate)


def check_optimizer(config) -> None:
    """Refuses an `OptimizerConfig` that would train wrongly without an error: a negative learning rate (the
    loss climbs), negative decay, betas outside [0, 1), and the like. (A rate of 0 is allowed: it keeps the
    initial weights, which tests and ablations use.)"""
    if config.name not in OPTIMIZERS:
        raise ValueError(f"`optimizer.name` must be one of {OPTIMIZERS}. Received: {config.name!r}")
    if config.decay not in DECAYS:
        raise ValueError(f"`optimizer.decay` must be one of {DECAYS}. Received: {config.decay!r}")

    def number(key, ok, rule):
        value = getattr(config, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
            raise ValueError(f"`optimizer.{key}` must be {rule}. Received: {value!r}")

    number("learning_rate", lambda v: v >= 0, "0 or more")
    number("end_learning_rate", lambda v: 0 <= v <= config.learning_rate, "in [0, learning_rate]")
    number("weight_decay", lambda v: v >= 0, "0 or more")
    number("beta_1", lambda v: 0 <= v < 1, "in [0, 1)")
    number("beta_2", lambda v: 0 <= v < 1, "in [0, 1)")
    number("epsilon", lambda v: v > 0, "a positive number")
    number("power", lambda v: v > 0, "a positive number")
    if config.clip_norm is not None:
        number("clip_norm", lambda v: v > 0, "None (no clipping) or a positive number")
    if isinstance(config.warmup_steps, bool) or not isinstance(config.warmup_steps, int) or config.warmup_steps < 0:
        raise ValueError(f"`optimizer.warmup_steps` must be an integer, 0 or more. Received: {config.warmup_steps!r}")


def make_optimizer(config, total_steps: int, accumulation: int = 1, precision: str = "float32"):
    """A Keras optimizer from an `OptimizerConfig`."""
    check_optimizer(config)
    if not isinstance(accumulation, int) or accumulation < 1:
        raise ValueError(f"`trainer.accumulation` must be a positive integer. Received: {accumulation!r}")
    power = 1.0 if config.decay == "linear" else config.power
    end = config.learning_rate if config.decay == "constant" else config.end_learning_rate
    schedule = WarmupDecay(config.learning_rate, total_steps, config.warmup_steps, end, power, accumulation)
    kwargs = dict(learning_rate=schedule, weight_decay=config.weight_decay, beta_1=config.beta_1,
                  beta_2=config.beta_2, epsilon=config.epsilon, global_clipnorm=config.clip_norm,
                  gradient_accumulation_steps=accumulation if accumulation > 1 else None)
    optimizer = AdamW(**kwargs) if config.name == "adamw" else Lamb(**kwargs)
    optimizer.exclude_from_weight_decay(var_names=list(NO_DECAY))
    if precision == "mixed_float16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


def sync_iterations(optimizer, steps: int, accumulation: int) -> None:
    """Sets Keras' raw micro-step counter to `steps` optimizer updates of `accumulation` micro-batches, so a
    checkpoint written with one accumulation resumes with another (Adam's bias correction and the schedule
    read that counter)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    inner._iterations.assign(steps * accumulation)
