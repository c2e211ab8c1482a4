"""AdamW and LAMB with BERT's schedule: linear warm-up, then linear / polynomial decay; no weight decay on
LayerNorm parameters and biases; global-norm clipping; gradient accumulation over micro-batches."""

from __future__ import annotations

import keras

OPTIMIZERS = ("adamw", "lamb")
DECAYS = ("linear", "polynomial", "constant")
# Variables whose path contains one of these get no weight decay (LayerNorm gammas/betas, all biases).
NO_DECAY = ("bias", "beta", "gamma", "layer_norm", "layernorm")


@keras.saving.register_keras_serializable("kbert")
class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
    """`peak * step / warmup` for `step < warmup`, then polynomial decay (power 1: linear) to `end` at
    `total_steps`. Steps are optimizer updates: Keras calls a schedule with its raw micro-step counter, which
    with gradient accumulation advances once per micro-batch, so that counter is divided by `accumulation`."""

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
    optimizer = keras.optimizers.AdamW(**kwargs) if config.name == "adamw" else keras.optimizers.Lamb(**kwargs)
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
