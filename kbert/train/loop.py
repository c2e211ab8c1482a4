"""`kbert.pretrain(config)`: the pretraining loop, top to bottom.

1. strategy and precision (`strategy.py`); 2. tokenizer, model, optimizer, built under the strategy;
3. restore the latest checkpoint (step, weights, optimizer slots) if there is one; 4. the input pipeline,
skipped forward to the restored step (masks depend only on the seed and the batch index, so a resumed run
sees exactly the batches it would have seen); 5. the loop: one compiled step per optimizer update
(`accumulation` micro-batches), a progress bar with loss, MLM accuracy, tokens/s and ETA, TensorBoard
scalars, a checkpoint every `checkpoint_every` steps; SIGTERM / SIGINT (a preempted TPU VM, Ctrl-C) save a
checkpoint and stop cleanly; a NaN/Inf loss stops with the last good checkpoint untouched; 6. the final
model directory (`kbert.load_model` / `kbert.Embedder.load` read it) with the tokenizer.
"""

from __future__ import annotations

import collections
import math
import os
import sys
import time
import warnings
from typing import Dict, Optional, Union

from kbert.train.config import PretrainConfig


class TrainingDiverged(RuntimeError):
    """The loss became NaN or Inf."""


OBJECTIVES = ("mlm", "mlm+nsp", "mlm+sop", "electra")
EMBEDDING_INITS = ("random", "cooccurrence")


def _objective_head(objective: str) -> Optional[str]:
    return {"mlm": None, "mlm+nsp": "nsp", "mlm+sop": "sop", "electra": None}[objective]


def _data_objective(objective: str) -> str:
    """ELECTRA trains on masked-LM examples (the generator fills the masks)."""
    return "mlm" if objective == "electra" else objective


def _model_config(config: PretrainConfig, tokenizer):
    from kbert.models.config import ModelConfig

    model = config.model
    if isinstance(model, str):
        cfg = ModelConfig.preset(model, vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_id)
    elif isinstance(model, dict):
        values = dict(model)
        preset = values.pop("preset", None)
        values.setdefault("vocab_size", tokenizer.vocab_size)
        values.setdefault("pad_token_id", tokenizer.pad_id)
        cfg = ModelConfig.preset(preset, **values) if preset else ModelConfig.from_dict(values)
    else:
        raise ValueError(f"`model` must be a preset name or a mapping of ModelConfig fields. Received: {model!r}")
    if cfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"`model.vocab_size` ({cfg.vocab_size}) is smaller than the tokenizer's vocabulary "
                         f"({tokenizer.vocab_size})")
    if config.data.max_length > cfg.max_position:
        raise ValueError(f"`data.max_length` ({config.data.max_length}) is beyond the model's position "
                         f"embeddings (`model.max_position` = {cfg.max_position})")
    return cfg.validate()


def _validate(config: PretrainConfig):
    t, d = config.trainer, config.data
    if d.source is None:
        raise ValueError("`data.source` is missing: a corpus (paths or names), a records dir, or 'dummy'")
    if d.tokenizer is None:
        raise ValueError("`data.tokenizer` is missing: a tokenizer dir (`kbert tokenizer train`), vocab.txt or .model")
    if d.objective not in OBJECTIVES:
        raise ValueError(f"`data.objective` must be one of {OBJECTIVES}. Received: {d.objective!r}")
    e = config.electra
    if not 0.0 < e.generator_size <= 1.0 or not e.rtd_weight > 0:
        raise ValueError(f"`electra.generator_size` must be in (0, 1] and `electra.rtd_weight` positive. "
                         f"Received: generator_size={e.generator_size!r}, rtd_weight={e.rtd_weight!r}")
    if t.embedding_init not in EMBEDDING_INITS:
        raise ValueError(f"`trainer.embedding_init` must be one of {EMBEDDING_INITS}. Received: {t.embedding_init!r}")
    from kbert.data.records import records_dir

    if t.embedding_init == "cooccurrence" and (d.source == "dummy" or records_dir(d.source)):
        raise ValueError("`trainer.embedding_init: cooccurrence` counts tokens in raw text, but `data.source` is "
                         f"{d.source!r}: point `data.source` at the raw corpus, or use embedding_init: random")
    if not isinstance(t.steps, int) or t.steps < 1:
        raise ValueError(f"`trainer.steps` must be a positive integer. Received: {t.steps!r}")
    if os.path.exists(config.output_dir) and not os.path.isdir(config.output_dir):
        raise ValueError(f"`output_dir` {config.output_dir!r} is a file; name a directory (new or a run to resume)")
    for key in ("log_every", "checkpoint_every", "keep_checkpoints", "accumulation"):
        value = getattr(t, key)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"`trainer.{key}` must be a positive integer. Received: {value!r}")


def _restore_newest_intact(checkpoint, paths, ckpt_dir: str) -> str:
    """Restores the newest checkpoint of `paths` that reads back whole: a truncated or missing file (a disk
    that filled up, a copy cut short) falls back to the one before it, with a warning naming the bad one."""
    import tensorflow as tf

    bad = []
    for path in reversed(list(paths)):
        try:
            checkpoint.restore(path).assert_existing_objects_matched()
        except (tf.errors.OpError, ValueError, AssertionError, IndexError, OSError) as e:  # IndexError: cut short
            bad.append(f"{path} ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            continue
        if bad:
            warnings.warn(f"resuming from {path}: newer checkpoint(s) could not be read: {'; '.join(bad)}")
        return f"step {int(checkpoint.step.numpy())} ({path})"
    raise ValueError(f"no checkpoint in {ckpt_dir!r} can be read: {'; '.join(bad)}. Restore the files from a copy, "
                     f"or delete {ckpt_dir} to start over")


# Settings a resumed run may change: how long and how often, where and how it runs, and the micro-batching
# (checkpoints hold no gradient accumulators, so any accumulation restores). Everything else (the model,
# the data, the optimizer, the global batch, the seed) decides what the checkpoint's numbers mean.
RESUMABLE_CHANGES = ("trainer.steps", "trainer.log_every", "trainer.checkpoint_every", "trainer.keep_checkpoints",
                     "trainer.accumulation", "trainer.memory", "trainer.oom_fallback", "data.workers",
                     "runtime.strategy", "runtime.tpu", "runtime.jit", "output_dir")


def _flat(values, prefix=""):
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and not (prefix == "" and key == "model"):
            out.update(_flat(value, f"{prefix}{key}."))
        else:  # a one-item list is the item (`--corpus DIR` gives a list)
            out[prefix + key] = value[0] if isinstance(value, list) and len(value) == 1 else value
    return out


def check_resumable(saved_path: str, config: PretrainConfig) -> None:
    """Refuses to resume the run saved at `saved_path` (its config.json) with settings that change what its
    checkpoints mean, naming each difference; the changes in RESUMABLE_CHANGES are allowed."""
    import json

    with open(saved_path, encoding="utf-8") as f:
        saved = json.load(f)
    saved = _flat(json.loads(json.dumps(PretrainConfig.from_dict(saved).to_dict())))  # old key names read as new
    current = _flat(json.loads(json.dumps(config.to_dict())))
    differences = [f"{key}: {saved.get(key)!r} -> {current.get(key)!r}" for key in sorted(set(saved) | set(current))
                   if key not in RESUMABLE_CHANGES and saved.get(key) != current.get(key)]
    if differences:
        out = os.path.dirname(saved_path)
        raise ValueError(f"{out!r} holds checkpoints of a run with other settings ({'; '.join(differences)}). "
                         f"Resume with the saved settings ({saved_path}), choose another output dir, or pass "
                         f"delete {os.path.join(out, 'checkpoints')} to start over. Allowed "
                         f"on resume: {', '.join(RESUMABLE_CHANGES)}")


_RECENT_STEPS = 100  # the summary and the progress bar average the metrics of this many last steps


def _mean_metrics(recent) -> Dict[str, float]:
    """Mean of each metric over a sequence of per-step metric dicts ({} when empty)."""
    if not recent:
        return {}
    return {k: sum(m[k] for m in recent) / len(recent) for k in recent[-1]}


def pretrain(config: Union[PretrainConfig, dict, str], overrides=None, resume: bool = True, progress: bool = True,
             stop_after: Optional[int] = None):
    """Pretrains a BERT/ALBERT and returns a summary dict (steps, final loss, model dir, ...).

    The summary's `loss` and `mlm_accuracy` (and the progress bar's) are means over the last
    `mean_of_steps` (up to 100) steps of this call: one batch's MLM accuracy swings by several points.
    `history` holds every step's loss. `tokens_per_second` is this call's rate from its start (compilation
    included); `steady_tokens_per_second` leaves out its first step (tracing, XLA compilation, the pipeline's
    start-up) and the final saves: the rate to plan further steps with.

    Args:
        config: a `PretrainConfig`, a dict, or a YAML/JSON path (with `overrides`, "key.sub=value" strings).
        resume: continue from the latest checkpoint in `output_dir/checkpoints` (the default; False starts over
            and fails if checkpoints exist).
        stop_after: stop (with a checkpoint) after this many steps in this call, as a preemption would.
    """
    import keras
    import tensorflow as tf

    from kbert.data.masking import default_max_predictions
    from kbert.data.pretraining import pretraining_dataset
    from kbert.models.backbone import Pretrainer, build_backbone
    from kbert.models.electra import ElectraPretrainer
    from kbert.models.io import save_model
    from kbert.text.tokenizer import Tokenizer
    from kbert.train import faults
    from kbert.train.optimizers import make_optimizer, sync_iterations
    from kbert.train.strategy import device_kind, make_strategy, resolve_precision
    from kbert.utils import StopSignals, progress_bar
    from kbert.workers import refuse_in_spawn_bootstrap

    refuse_in_spawn_bootstrap("kbert.pretrain")
    if isinstance(config, str) or config is None:
        config = PretrainConfig.load(config, overrides)
    elif isinstance(config, dict):
        config = PretrainConfig.from_dict(config)
    _validate(config)
    t, d, rt = config.trainer, config.data, config.runtime

    # 1. where and in which precision
    strategy = make_strategy(rt.strategy, rt.tpu)
    replicas = strategy.num_replicas_in_sync
    precision = resolve_precision(rt.precision, strategy)
    tokenizer = Tokenizer.load(d.tokenizer)
    model_config = _model_config(config, tokenizer)
    plan = None
    if t.batch_size == "auto":
        from kbert.train.memory import plan_for_config

        plan = plan_for_config(config, model_config, precision, replicas, device_kind(strategy))
        t.batch_size, t.accumulation = plan["global_batch"], plan["accumulation"]
    if not isinstance(t.batch_size, int) or t.batch_size < 1:
        raise ValueError(f"`trainer.batch_size` must be a positive integer or 'auto'. Received: {t.batch_size!r}")
    if t.batch_size % (replicas * t.accumulation):
        raise ValueError(f"`trainer.batch_size` ({t.batch_size}) must be divisible by replicas x accumulation "
                         f"({replicas} x {t.accumulation})")
    micro_batch = t.batch_size // t.accumulation  # global batch of one micro-step
    if progress:  # one screen of what is about to run, before minutes of building and compiling
        print(f"pretrain: {model_config.architecture} L={model_config.num_layers} H={model_config.hidden_size} "
              f"A={model_config.num_heads} ({model_config.num_parameters() / 1e6:.1f}M parameters, vocab "
              f"{model_config.vocab_size}), {d.objective}, {t.steps} steps\n"
              f"  data: {d.source!r}, {d.max_length} tokens per sequence\n"
              f"  batch: {t.batch_size} sequences per step" + (" (planned by batch_size: auto)" if plan else "")
              + f" = {replicas} replica(s) x {t.accumulation} micro-step(s) x {micro_batch // replicas}; "
              f"precision {precision} on {device_kind(strategy)}\n  output: {config.output_dir}",
              file=sys.stderr, flush=True)

    out = config.output_dir
    ckpt_dir = os.path.join(out, "checkpoints")
    os.makedirs(out, exist_ok=True)
    if not resume and tf.train.latest_checkpoint(ckpt_dir):
        raise ValueError(f"{ckpt_dir!r} already has checkpoints; resume, or choose another output_dir")
    if tf.train.latest_checkpoint(ckpt_dir) and os.path.isfile(os.path.join(out, "config.json")):
        check_resumable(os.path.join(out, "config.json"), config)  # before the saved config is replaced
    config.save(os.path.join(out, "config.json"))

    # 2. model and optimizer under the strategy
    keras.utils.set_random_seed(rt.seed)
    keras.mixed_precision.set_dtype_policy(precision)
    try:
        with strategy.scope():
            backbone = build_backbone(model_config)
            if d.objective == "electra":
                model = ElectraPretrainer(backbone, generator_size=config.electra.generator_size,
                                          rtd_weight=config.electra.rtd_weight, seed=rt.seed)
            else:
                model = Pretrainer(backbone, pair_objective=_objective_head(d.objective))
            optimizer = make_optimizer(config.optimizer, t.steps, t.accumulation, precision)
            model(_dummy_features(d.max_length, d.max_predictions or default_max_predictions(d.max_length,
                                                                                              d.mask_rate)))
            optimizer.build(model.trainable_variables)
            step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
    finally:
        keras.mixed_precision.set_dtype_policy("float32")

    # 3. resume
    # Optimizer state by variable path, not by position: a run that changes gradient accumulation (the OOM
    # fallback) adds accumulator variables, and positional matching would pair the wrong tensors.
    # Gradient accumulators are left out: checkpoints are written between optimizer steps, where they are zero,
    # so a checkpoint restores into a run with any accumulation.
    kept = [v for v in optimizer.variables if "gradient_accumulator" not in v.path]
    slots = {_slot_key(v.path): v.value for v in kept}
    if len(slots) != len(kept):
        raise AssertionError("optimizer variables do not have unique names; please report this")
    # ELECTRA's sampling noise state: a Keras SeedGenerator is not tracked with the model's weights
    extra = {"sampling_seed": model.seed_generator.state.value} if d.objective == "electra" else {}
    checkpoint = tf.train.Checkpoint(model=model, optimizer=slots, step=step, **extra)
    manager = tf.train.CheckpointManager(checkpoint, ckpt_dir, max_to_keep=t.keep_checkpoints)
    if manager.latest_checkpoint:
        restored = _restore_newest_intact(checkpoint, manager.checkpoints, ckpt_dir)
        print(f"resuming from {restored}", file=sys.stderr, flush=True)
    elif t.embedding_init == "cooccurrence":  # a fresh run (deterministic, so a restart from step 0 repeats it)
        from kbert.train.embedding_init import initialize_token_embeddings

        initialize_token_embeddings(backbone, d.source, tokenizer, seed=rt.seed, progress=progress)
    start = int(step.numpy())
    sync_iterations(optimizer, start, t.accumulation)

    # 4. data, skipped forward to the restored step
    def dataset_fn(ctx):
        return pretraining_dataset(d.source, tokenizer, objective=_data_objective(d.objective),
                                   max_length=d.max_length,
                                   batch_size=micro_batch, mask_rate=d.mask_rate, max_predictions=d.max_predictions,
                                   whole_word=d.whole_word, ngram=d.ngram, short_seq_prob=d.short_seq_prob,
                                   seed=rt.seed, shuffle_buffer=d.shuffle_buffer, start_batch=start * t.accumulation,
                                   input_context=ctx, workers=d.workers)

    dataset = strategy.distribute_datasets_from_function(dataset_fn)
    iterator = iter(dataset)

    # 5. the loop
    def replica_step(features, labels):
        with tf.GradientTape() as tape:
            outputs = model(features, training=True)
            losses = model.compute_losses(features, labels, outputs, training=True)
            loss = losses["loss"] / replicas
            scaled = optimizer.scale_loss(loss) if hasattr(optimizer, "scale_loss") else loss
        grads = tape.gradient(scaled, model.trainable_variables)
        # the pooler gets no gradient without a pair objective: leave it out instead of warning every step
        pairs = [(g, v) for g, v in zip(grads, model.trainable_variables) if g is not None]
        optimizer.apply([g for g, _ in pairs], [v for _, v in pairs])
        return {k: v / replicas for k, v in losses.items()}

    kind = device_kind(strategy)
    # "auto" compiles one replica's step with XLA and leaves several uncompiled (their all-reduce), where an
    # explicit True asks for it. On CPU, XLA runs bfloat16 matmuls no faster than float32 while TensorFlow's
    # own (oneDNN) kernels use the CPU's bf16 instructions, so bf16 on CPU runs without XLA (the figures are
    # in benchmarks/README.md)
    jit = rt.jit is True or (rt.jit == "auto" and replicas == 1 and not (kind == "cpu" and precision != "float32"))
    if jit and kind != "tpu":  # XLA compiles the replica step; reading the iterator stays outside (no XLA kernel)
        replica_step = tf.function(replica_step, jit_compile=True, reduce_retracing=True)

    @tf.function(reduce_retracing=True)
    def train_step(iterator):
        total = None
        for _ in range(t.accumulation):  # unrolled: each micro-step feeds the optimizer's accumulator
            features, labels = next(iterator)
            per_replica = strategy.run(replica_step, args=(features, labels))
            result = {k: strategy.reduce("SUM", v, axis=None) for k, v in per_replica.items()}
            total = result if total is None else {k: total[k] + v for k, v in result.items()}
        step.assign_add(1)
        return {k: v / t.accumulation for k, v in total.items()}

    writer = tf.summary.create_file_writer(os.path.join(out, "logs"))
    tokens_per_step = t.batch_size * d.max_length
    bar = progress_bar(total=t.steps, desc="pretrain", unit="step", enabled=progress)
    bar.update(start)
    history, recent = [], collections.deque(maxlen=_RECENT_STEPS)
    t0, s0 = time.perf_counter(), start
    t1 = s1 = None  # after this call's first step (tracing, XLA compilation): the steady rate starts there
    end = t.steps if stop_after is None else min(t.steps, start + stop_after)
    oom = None
    with StopSignals() as signals:  # Ctrl-C / SIGTERM: finish the step, save, return
        try:
            while int(step.numpy()) < end:
                try:
                    faults.check_memory(micro_batch // replicas)
                    metrics = {k: float(v) for k, v in train_step(iterator).items()}
                except tf.errors.ResourceExhaustedError as e:
                    oom = e
                    break
                except tf.errors.OpError:
                    _let_the_pipeline_settle()
                    raise
                current = int(step.numpy())
                if t1 is None:
                    t1, s1 = time.perf_counter(), current
                if not math.isfinite(metrics["loss"]):
                    good = manager.latest_checkpoint or "none yet"
                    raise TrainingDiverged(f"Loss became {metrics['loss']} at step {current}; stopped without "
                                           f"saving. The last good checkpoint is intact: {good}. Lower "
                                           f"optimizer.learning_rate, raise warmup_steps or use float32/bfloat16")
                history.append(metrics["loss"])
                recent.append(metrics)
                if current % t.log_every == 0 or current == end:
                    elapsed = max(time.perf_counter() - t0, 1e-9)
                    tps = (current - s0) * tokens_per_step / elapsed
                    smooth = _mean_metrics(recent)
                    shown = dict(loss=f"{smooth['loss']:.3f}", mlm_acc=f"{smooth.get('mlm_accuracy', 0):.3f}")
                    if "rtd_accuracy" in smooth:  # ELECTRA: the discriminator's accuracy over all tokens
                        shown["rtd_acc"] = f"{smooth['rtd_accuracy']:.3f}"
                    bar.set_postfix(**shown, tok_s=f"{tps:,.0f}")
                    with writer.as_default(step=current):
                        for k, v in metrics.items():
                            tf.summary.scalar(k, v)
                        tf.summary.scalar("tokens_per_second", tps)
                        # the schedule counts micro-steps
                        lr = _learning_rate(optimizer, (current - 1) * t.accumulation)
                        tf.summary.scalar("learning_rate", float(lr))
                bar.update(1)
                if current % t.checkpoint_every == 0:
                    manager.save(checkpoint_number=current)
                if signals.received:
                    break
        finally:
            t_end = time.perf_counter()
            bar.close()
    if oom is not None:
        return _retry_smaller(config, oom, micro_batch // replicas, manager.latest_checkpoint, progress, end)
    current = int(step.numpy())
    if not manager.latest_checkpoint or not manager.latest_checkpoint.endswith(f"-{current}"):
        manager.save(checkpoint_number=current)  # at exit: a signal, stop_after, or the last step
    writer.flush()
    smooth = _mean_metrics(recent)
    summary = {"step": current, "finished": current >= t.steps, "stopped_by": signals.received,
               "loss": smooth.get("loss"), "mlm_accuracy": smooth.get("mlm_accuracy"), "mean_of_steps": len(recent),
               **({"rtd_accuracy": smooth["rtd_accuracy"]} if "rtd_accuracy" in smooth else {}),
               "metrics": smooth,
               "history": history,
               "checkpoint": manager.latest_checkpoint, "replicas": replicas, "precision": precision, "jit": jit,
               "global_batch": t.batch_size, "accumulation": t.accumulation}
    if current >= t.steps:  # 6. the final model dir
        kept = model.backbone if d.objective == "electra" else model  # ELECTRA keeps the discriminator
        summary["model_dir"] = save_model(kept, os.path.join(out, "model"), tokenizer=tokenizer)
    elapsed = time.perf_counter() - t0
    summary["tokens_per_second"] = (current - s0) * tokens_per_step / elapsed if current > s0 else 0.0
    # without the first step of this call (tracing, compilation, the pipeline's start): what more steps cost
    summary["steady_tokens_per_second"] = ((current - s1) * tokens_per_step / max(t_end - t1, 1e-9)
                                           if s1 is not None and current > s1 else summary["tokens_per_second"])
    return summary


def _slot_key(path: str) -> str:
    """`adam_w_2/layer_0_qkv_kernel_momentum` -> `layer_0_qkv_kernel_momentum`: the optimizer's own name
    changes with every optimizer a process creates, so it is not part of the key."""
    return path.split("/", 1)[-1].replace("/", ".")


def _retry_smaller(config, error, per_replica_batch, checkpoint, progress, end):
    """Out of memory in a step: halve the micro-batch and double accumulation (same global batch, so the
    same optimization), then resume from the last checkpoint (or the start, which is reproducible)."""
    import gc
    import sys

    import keras

    t = config.trainer
    if not t.oom_fallback or per_replica_batch < 2:
        raise MemoryError(
            f"Out of memory with a per-replica micro-batch of {per_replica_batch} "
            f"({'oom_fallback is off' if not t.oom_fallback else 'cannot halve further'}): use a smaller model, "
            f"shorter data.max_length, precision=mixed_bfloat16 or activation recomputation. "
            f"Device said: {str(error).splitlines()[0][:200]}") from None
    t.accumulation *= 2
    sys.stderr.write(f"kbert pretrain: out of memory at per-replica micro-batch {per_replica_batch}; retrying with "
                     f"{per_replica_batch // 2} x {t.accumulation} accumulation steps (global batch {t.batch_size} "
                     f"unchanged) from {checkpoint or 'the start'}\n")
    keras.backend.clear_session()
    gc.collect()
    restart = int(checkpoint.rsplit("-", 1)[1]) if checkpoint else 0
    summary = pretrain(config, resume=True, progress=progress, stop_after=end - restart)
    summary["oom_retries"] = summary.get("oom_retries", 0) + 1
    return summary


def _let_the_pipeline_settle(seconds: float = 1.0) -> None:
    """After an error from the input pipeline (e.g. a dead worker process), waits a moment before the error
    propagates. tf.data's threads go on calling the pipeline's Python generator (which needs the GIL) until
    their buffers hold the error; the iterator's destructor waits for those threads while its caller holds
    the GIL, so tearing it down mid-call would deadlock the process instead of reporting the error."""
    time.sleep(seconds)  # releases the GIL


def _learning_rate(optimizer, iteration):
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    lr = inner._learning_rate
    return lr(iteration) if callable(lr) else lr


def _dummy_features(seq, predictions):
    """One all-padding example: builds the model's variables before a checkpoint is restored."""
    import numpy as np

    return {"token_ids": np.zeros((1, seq), "int32"), "segment_ids": np.zeros((1, seq), "int32"),
            "padding_mask": np.ones((1, seq), "int32"), "mask_positions": np.zeros((1, predictions), "int32")}
