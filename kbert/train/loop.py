"""`kbert.pretrain(config)`: the pretraining loop, top to bottom.

1. the backend (`kbert.train.backend`: TensorFlow's strategies or JAX's `keras.distribution`) and precision;
2. tokenizer, model, optimizer, laid out by the backend; 3. restore the latest checkpoint (step, weights,
optimizer slots; backend-neutral, `run_checkpoint.py`) if there is one; 4. the input pipeline,
skipped forward to the restored step (masks depend only on the seed and the batch index, so a resumed run
sees exactly the batches it would have seen); 5. the loop: one compiled step per optimizer update
(`accumulation` micro-batches), a progress bar with loss, MLM accuracy, tokens/s, MFU and ETA, TensorBoard
scalars, a checkpoint every `checkpoint_every` steps; SIGTERM / SIGINT (a preempted TPU VM, Ctrl-C) save a
checkpoint and stop cleanly; a NaN/Inf loss stops with the last good checkpoint untouched; 6. the final
model directory (`kbert.load_model` / `kbert.Embedder.load` read it) with the tokenizer.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import sys
import time
from typing import Dict, Optional, Union

from kbert.train.cards import write_pretrain_card
from kbert.train.config import DataConfig, PretrainConfig


class TrainingDiverged(RuntimeError):
    """The loss became NaN or Inf."""


OBJECTIVES = ("mlm", "mlm+nsp", "mlm+sop", "electra")
EMBEDDING_INITS = ("random", "cooccurrence")


def _objective_head(objective: str) -> Optional[str]:
    return {"mlm": None, "mlm+nsp": "nsp", "mlm+sop": "sop", "electra": None}[objective]


def _data_objective(objective: str) -> str:
    """ELECTRA trains on masked-LM examples (the generator fills the masks)."""
    return "mlm" if objective == "electra" else objective


def source_model(config: PretrainConfig):
    """Continued pretraining: where `model` names a model instead of an architecture (a kbert model dir, a
    `kbert pretrain` run dir, a Hugging Face BERT/ALBERT/ELECTRA dir or a cached hub name such as
    "klue/bert-base"; or a mapping with `from:` and field overrides such as `dropout`), returns (its
    directory, the model loaded with its pretraining heads, fresh ones where it has none); else None.
    A name that is neither a preset nor a directory is refused with the presets listed."""
    from kbert.models.config import PRESETS

    model = config.model
    name = model.get("from") if isinstance(model, dict) else model if isinstance(model, str) else None
    if name is None or (isinstance(model, str) and model in PRESETS):
        return None
    from kbert.models.convert import load_model
    from kbert.models.locate import model_dir_of, resolve_hub_name

    directory = model_dir_of(resolve_hub_name(str(name)))
    if not os.path.isdir(directory):
        raise ValueError(f"`model` {name!r} is neither a preset ({', '.join(PRESETS)}) nor a model directory "
                         f"to continue pretraining from")
    return directory, load_model(directory, with_heads=True)


def _tokenizer_of(directory: str) -> str:
    """The tokenizer path of a model dir (`tokenizer/` in kbert dirs; the dir itself for a Hugging Face
    vocab.txt or a SentencePiece .model), checked readable."""
    from kbert.text.tokenizer import Tokenizer

    try:
        Tokenizer.from_model_dir(directory)
    except FileNotFoundError as e:
        raise ValueError(f"`data.tokenizer` is missing and the model to continue from has none kbert can read "
                         f"({e}); name its tokenizer with data.tokenizer / --tokenizer") from None
    from kbert.text.tokenizer import MODEL_TOKENIZER_DIR

    inner = os.path.join(directory, MODEL_TOKENIZER_DIR)  # where from_model_dir looked first
    return inner if os.path.isdir(inner) else directory


def _same_vocabulary(tokenizer, directory: str) -> None:
    """A run that continues from a model must feed it the ids it was trained on: where the model dir holds a
    tokenizer, the run's must have the same vocabulary (the same token at every id)."""
    from kbert.text.tokenizer import Tokenizer

    try:
        own = Tokenizer.from_model_dir(directory)
    except FileNotFoundError:
        return  # nothing to compare with (a checkpoint without its vocabulary): the user's tokenizer stands
    if list(own.vocab) != list(tokenizer.vocab):
        differ = next((i for i, (a, b) in enumerate(zip(own.vocab, tokenizer.vocab)) if a != b),
                      min(len(own.vocab), len(tokenizer.vocab)))
        raise ValueError(f"`data.tokenizer` has another vocabulary than the model it continues from ({directory}: "
                         f"{own.vocab_size} tokens, the run's {tokenizer.vocab_size}; first difference at id "
                         f"{differ}): the model's embeddings would read other tokens. Leave data.tokenizer out to "
                         f"use the model's own")


def continue_from(model, source, assign) -> str:
    """Copies the weights of `source` (a loaded `Pretrainer`) into the run's freshly built `model` by
    variable path: the whole backbone (required), and each head the two share (the masked-LM head; the
    NSP/SOP head when both have the same one). ELECTRA's generator and replaced-token head, which a
    BERT source does not have, stay freshly initialized. Returns what was loaded, in words."""
    import keras
    from keras.backend import standardize_dtype

    from kbert.models.io import variables_by_path

    have = {path: keras.ops.convert_to_numpy(v) for path, v in variables_by_path(source).items()}
    targets = variables_by_path(model)
    backbone = set(variables_by_path(model.backbone))
    missing = sorted(p for p in backbone if p not in have)
    if missing:
        raise ValueError(f"the model to continue from lacks backbone weights the run needs: {missing[:5]}")
    misshapen = [f"{p}: {have[p].shape} vs {tuple(v.shape)}" for p, v in targets.items()
                 if p in have and tuple(have[p].shape) != tuple(v.shape)]
    if misshapen:
        raise ValueError("the model to continue from does not fit the run's model (an architecture field was "
                         "overridden?):\n  " + "\n  ".join(misshapen[:10]))
    copied = [p for p in targets if p in have]
    for path in copied:
        assign(targets[path], have[path].astype(standardize_dtype(targets[path].dtype)))

    def group(path):  # "pretrainer/mlm_head/..." -> mlm_head; "generator/embeddings/..." -> generator
        parts = path.split("/")
        return parts[1] if parts[0].endswith("pretrainer") and len(parts) > 2 else parts[0]

    heads = sorted({group(p) for p in copied if p not in backbone})
    fresh = sorted({group(p) for p in targets if p not in have})
    return ("backbone" + "".join(f", {h}" for h in heads) + " loaded"
            + (f"; fresh: {', '.join(fresh)}" if fresh else ""))


def _model_config(config: PretrainConfig, tokenizer, source=None):
    from kbert.models.config import ModelConfig

    model = config.model
    if source is not None:  # the architecture is the source model's; a mapping may change its dropouts
        overrides = {k: v for k, v in model.items() if k != "from"} if isinstance(model, dict) else {}
        cfg = dataclasses.replace(source[1].backbone.config, **overrides)
    elif isinstance(model, str):
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


def text_source(d):
    """`data.source` as the input pipeline reads it: a Corpus in `data.format` when one is set (raw text only)."""
    if d.format is None:
        return d.source
    from kbert.data.corpus import Corpus

    return Corpus(d.source, format=d.format)


def _validate(config: PretrainConfig):
    from kbert.data.examples import check_short_seq_prob
    from kbert.data.masking import check_mask_rate
    from kbert.utils import check_seed

    t, d = config.trainer, config.data
    if d.source is None:
        raise ValueError("`data.source` is missing: a corpus (paths or names), a records dir, or 'dummy'")
    if d.tokenizer is None:
        raise ValueError("`data.tokenizer` is missing: a tokenizer dir (`kbert tokenizer train`), vocab.txt or .model")
    if d.objective is not None and d.objective not in OBJECTIVES:
        raise ValueError(f"`data.objective` must be one of {OBJECTIVES}. Received: {d.objective!r}")
    check_mask_rate(d.mask_rate, "data.mask_rate")
    # these failed later as "'float' object cannot be interpreted as an integer" or numpy's "Seed must be
    # between 0 and 2**32 - 1", naming no key
    for key, value, least in (("data.max_length", d.max_length, 2), ("data.max_predictions", d.max_predictions, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise ValueError(f"`{key}` must be an integer >= {least}. Received: {value!r}")
    check_seed(config.runtime.seed, "runtime.seed")
    check_short_seq_prob(d.short_seq_prob, "data.short_seq_prob")
    # 0 turns shuffling off; a negative one failed deep in tf.data's ShuffleDataset
    if isinstance(d.shuffle_buffer, bool) or not isinstance(d.shuffle_buffer, int) or d.shuffle_buffer < 0:
        raise ValueError(f"`data.shuffle_buffer` must be an integer, 0 (no shuffling) or more. "
                         f"Received: {d.shuffle_buffer!r}")
    e = config.electra
    if not 0.0 < e.generator_size <= 1.0 or not e.rtd_weight > 0:
        raise ValueError(f"`electra.generator_size` must be in (0, 1] and `electra.rtd_weight` positive. "
                         f"Received: generator_size={e.generator_size!r}, rtd_weight={e.rtd_weight!r}")
    if t.embedding_init not in EMBEDDING_INITS:
        raise ValueError(f"`trainer.embedding_init` must be one of {EMBEDDING_INITS}. Received: {t.embedding_init!r}")
    from kbert.data.corpus import FORMATS
    from kbert.data.records import records_dir

    if d.format is not None and d.format not in FORMATS:
        raise ValueError(f"`data.format` must be one of {FORMATS} or null. Received: {d.format!r}")
    if d.format is not None and (d.source == "dummy" or records_dir(d.source)):
        raise ValueError(f"`data.format` is how raw text is read, and data.source {d.source!r} is not raw text; "
                         f"leave data.format out (records keep the format they were prepared with)")

    if t.embedding_init_text is not None:
        if t.embedding_init != "cooccurrence":
            raise ValueError("`trainer.embedding_init_text` is the text `trainer.embedding_init: cooccurrence` counts "
                             f"on, but embedding_init is {t.embedding_init!r}: set it to cooccurrence or leave the "
                             "text out")
        if t.embedding_init_text == "dummy" or records_dir(t.embedding_init_text):
            raise ValueError("`trainer.embedding_init_text` must be raw text (paths or corpus names). Received: "
                             f"{t.embedding_init_text!r}")
    elif t.embedding_init == "cooccurrence" and (d.source == "dummy" or records_dir(d.source)):
        raise ValueError("`trainer.embedding_init: cooccurrence` counts tokens in raw text, but `data.source` is "
                         f"{d.source!r}: point `trainer.embedding_init_text` (or `data.source`) at the raw corpus, "
                         "or use embedding_init: random")
    if not isinstance(t.steps, int) or t.steps < 1:
        raise ValueError(f"`trainer.steps` must be a positive integer. Received: {t.steps!r}")
    from kbert.train.optimizers import check_optimizer

    check_optimizer(config.optimizer)
    if not isinstance(config.output_dir, (str, os.PathLike)) or not os.fspath(config.output_dir):
        raise ValueError(f"`output_dir` must name a directory (new, or a run to resume). Received: "
                         f"{config.output_dir!r}")  # `--out ""` reached os.path.exists(None)
    if os.path.exists(config.output_dir) and not os.path.isdir(config.output_dir):
        raise ValueError(f"`output_dir` {config.output_dir!r} is a file; name a directory (new or a run to resume)")
    for key in ("log_every", "checkpoint_every", "keep_checkpoints", "accumulation"):
        value = getattr(t, key)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"`trainer.{key}` must be a positive integer. Received: {value!r}")


# Settings a resumed run may change: how long and how often, where and how it runs, and the micro-batching
# (checkpoints hold no gradient accumulators, so any accumulation restores). Everything else (the model,
# the data, the optimizer, the global batch, the seed) decides what the checkpoint's numbers mean.
RESUMABLE_CHANGES = ("trainer.steps", "trainer.log_every", "trainer.checkpoint_every", "trainer.keep_checkpoints",
                     "trainer.accumulation", "trainer.memory", "trainer.oom_fallback", "data.workers",
                     "runtime.strategy", "runtime.tpu", "runtime.jit", "runtime.compilation_cache", "output_dir")


def _flat(values, prefix=""):
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and not (prefix == "" and key == "model"):
            out.update(_flat(value, f"{prefix}{key}."))
        else:  # a one-item list is the item (`--corpus DIR` gives a list)
            out[prefix + key] = value[0] if isinstance(value, list) and len(value) == 1 else value
    return out


def _architecture_defaults(d, architecture: str, warn: bool = True) -> None:
    """`data.objective` and `data.ngram` left unset are the architecture's published ones: next-sentence
    prediction and single masked words for BERT; sentence-order prediction (Lan et al. found NSP too easy to teach
    ALBERT coherence) and n-gram masks of up to 3 words for ALBERT, as google-research/albert prepares its data.
    ALBERT on records prepared for NSP (`kbert data prepare`'s default) trains as asked, with a word on what to
    prepare."""
    if d.ngram is None:
        d.ngram = 3 if architecture == "albert" else 1
    if d.objective is None:
        d.objective = "mlm+sop" if architecture == "albert" else "mlm+nsp"
    elif warn and architecture == "albert" and d.objective == "mlm+nsp":
        import warnings

        from kbert.data.records import records_dir

        warnings.warn("ALBERT pretrains with sentence-order prediction (mlm+sop) as published; this run uses "
                      "next-sentence prediction" + (" because its records were prepared for it: prepare them with "
                                                    "`kbert data prepare --objective mlm+sop`"
                                                    if records_dir(d.source) else ""), stacklevel=3)


def _interrupted_batch(out: str) -> Optional[int]:
    """The global batch of the run `out` holds checkpoints of (its saved config.json), or None. `batch_size: auto`
    resumes with it: the plan may differ from the one the run started with (another kbert, backend, device or
    `trainer.memory`), and a different global batch would refuse the resume."""
    import json

    from kbert.train.run_checkpoint import RunCheckpoints

    saved = os.path.join(out, "config.json")
    if not (os.path.isfile(saved) and RunCheckpoints(os.path.join(out, "checkpoints")).latest):
        return None
    try:
        with open(saved, encoding="utf-8") as f:
            batch = json.load(f).get("trainer", {}).get("batch_size")
    except (OSError, ValueError, AttributeError):
        return None  # check_resumable names what is wrong with it
    return batch if isinstance(batch, int) and not isinstance(batch, bool) and batch > 0 else None


def _micro_steps(batch: int, fits: int, replicas: int) -> int:
    """The fewest micro-steps per update that split `batch` evenly over `replicas` into micro-batches of at most
    `fits` sequences (1 where `batch` fits; where no split is even, 1, and the divisibility check says why)."""
    for steps in range(max(1, -(-batch // max(fits, 1))), batch // max(replicas, 1) + 1):
        if batch % (replicas * steps) == 0:
            return steps
    return 1


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
    steps = saved.get("trainer.steps"), current.get("trainer.steps")
    if not differences and steps[0] != steps[1] and steps[0] is not None:
        # the schedule is a function of the step and the total: a longer run re-opens a decayed rate
        print(f"trainer.steps {steps[0]} -> {steps[1]}: the learning-rate schedule (warm-up, "
              f"{current.get('optimizer.decay')} decay) now spans {steps[1]} steps", file=sys.stderr, flush=True)
    if differences:
        out = os.path.dirname(saved_path)
        raise ValueError(f"{out!r} holds checkpoints of a run with other settings ({'; '.join(differences)}). "
                         f"Resume with the saved settings ({saved_path}), choose another output dir, or "
                         f"delete {os.path.join(out, 'checkpoints')} to start over. Allowed "
                         f"on resume: {', '.join(RESUMABLE_CHANGES)}")


_RECENT_STEPS = 100  # the summary and the progress bar average the metrics of this many last steps


def _mean_metrics(recent) -> Dict[str, float]:
    """Mean of each metric over a sequence of per-step metric dicts ({} when empty)."""
    if not recent:
        return {}
    return {k: sum(m[k] for m in recent) / len(recent) for k in recent[-1]}


def trained_variables(model):
    """The variables an optimizer step updates: every trainable variable except BERT's pooler when no pair
    objective reads it (it would get no gradient; on JAX a zero one that weight decay would still move)."""
    poolers = [model.backbone.pooler] + ([model.generator.pooler] if hasattr(model, "generator") else [])
    if getattr(model, "pair_head", None) is not None:
        poolers = poolers[1:]
    skip = {id(v) for p in poolers for v in p.trainable_variables}
    return [v for v in model.trainable_variables if id(v) not in skip]


def build_model_and_optimizer(config: PretrainConfig, model_config, precision: str, backend):
    """(pretraining model, optimizer, the variables it updates), built under the backend's layout with the
    run's seed and dtype policy; `benchmarks/gpu.py pretrain` times the same step on synthetic batches."""
    import keras

    from kbert.data.masking import default_max_predictions
    from kbert.data.synthetic import synthetic_batch
    from kbert.models.backbone import Pretrainer, build_backbone
    from kbert.models.electra import ElectraPretrainer
    from kbert.train.optimizers import make_optimizer

    t, d, rt = config.trainer, config.data, config.runtime
    _architecture_defaults(d, model_config.architecture, warn=False)  # unset for a caller other than `pretrain`
    keras.utils.set_random_seed(rt.seed)
    keras.mixed_precision.set_dtype_policy(precision)
    try:
        with backend.scope():
            backbone = build_backbone(model_config)
            if d.objective == "electra":
                model = ElectraPretrainer(backbone, generator_size=config.electra.generator_size,
                                          rtd_weight=config.electra.rtd_weight, seed=rt.seed)
            else:
                model = Pretrainer(backbone, pair_objective=_objective_head(d.objective))
            optimizer = make_optimizer(config.optimizer, t.steps, t.accumulation, precision)
            # one synthetic example builds every variable before a checkpoint is restored
            model(synthetic_batch(model_config, 1, d.max_length,
                                  d.max_predictions or default_max_predictions(d.max_length, d.mask_rate))[0])
            variables = trained_variables(model)
            optimizer.build(variables)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    return model, optimizer, variables


def pretrain(config: Union[PretrainConfig, dict, str], overrides=None, resume: bool = True, progress: bool = True,
             stop_after: Optional[int] = None):
    """Pretrains a BERT/ALBERT and returns a summary dict (steps, final loss, model dir, ...).

    Runs on the Keras backend of the process (`KERAS_BACKEND=tensorflow` or `jax`; see
    `kbert.train.backend`); a run checkpointed on one resumes on the other.

    The summary's `loss` and `mlm_accuracy` (and the progress bar's) are means over the last
    `mean_of_steps` (up to 100) steps of this call: one batch's MLM accuracy swings by several points.
    `history` holds every step's loss. `tokens_per_second` is this call's rate from its start (compilation
    included); `steady_tokens_per_second` leaves out its first step (tracing, XLA compilation, the pipeline's
    start-up) and the checkpoint saves: the rate of the steps themselves, to plan further steps with. `mfu`
    is the steady rate's model FLOPs utilization where the device's peak is known (`kbert.train.flops`);
    `host_waited_fraction` the share of that steady time the host spent waiting for the device's results
    (JAX: near 1 when the accelerator is the bottleneck, low when the input or the loop keeps it waiting;
    None on TensorFlow, whose step returns when it is done).

    Args:
        config: a `PretrainConfig`, a dict, or a YAML/JSON path (with `overrides`, "key.sub=value" strings).
        resume: continue from the latest checkpoint in `output_dir/checkpoints` (the default; False starts over
            and fails if checkpoints exist).
        stop_after: stop (with a checkpoint) after this many steps in this call, as a preemption would.
    """
    with contextlib.ExitStack() as held:  # the output dir's lock, taken once the config names the dir
        return _pretrain(config, overrides, resume, progress, stop_after, held)


def _pretrain(config, overrides, resume: bool, progress: bool, stop_after: Optional[int], held):
    from kbert.data.masking import default_max_predictions
    from kbert.models.io import save_model
    from kbert.text.tokenizer import Tokenizer
    from kbert.train import faults
    from kbert.train.backend import make_backend
    from kbert.train.flops import mfu as model_flops_utilization
    from kbert.train.flops import pretrainer_last_layer_rows, train_flops_per_step
    from kbert.train.optimizers import sync_iterations
    from kbert.train.run_checkpoint import RunCheckpoints
    from kbert.utils import StopSignals, progress_bar
    from kbert.workers import refuse_in_spawn_bootstrap

    refuse_in_spawn_bootstrap("kbert.pretrain")
    if isinstance(config, str) or config is None:
        config = PretrainConfig.load(config, overrides)
    elif isinstance(config, dict):
        config = PretrainConfig.from_dict(config)
    source = source_model(config)
    own_vocabulary = source is not None and config.data.tokenizer is None
    if source is not None:
        if own_vocabulary:
            config.data.tokenizer = _tokenizer_of(source[0])
        if config.trainer.embedding_init != "random":
            raise ValueError(f"`trainer.embedding_init: {config.trainer.embedding_init}` would overwrite the token "
                             f"embeddings of the model the run continues from ({source[0]}); leave it at random")
    _validate(config)
    t, d, rt = config.trainer, config.data, config.runtime
    from kbert.data.records import read_manifest, records_dir

    if records_dir(d.source):  # what the records were prepared with stands where the config keeps the default
        manifest = read_manifest(records_dir(d.source))
        if d.max_length == DataConfig.max_length:
            d.max_length = manifest["max_length"]
        if d.objective is None:  # unset: the records' pairs decide the head (SOP records built an NSP head once)
            d.objective = manifest["objective"]

    # 1. where and in which precision
    backend = make_backend(rt)
    replicas = backend.replicas
    precision = backend.precision(rt.precision)
    tokenizer = Tokenizer.load(d.tokenizer)
    if source is not None and not own_vocabulary:  # a tokenizer the user named: the model's ids must mean the same
        _same_vocabulary(tokenizer, source[0])
    model_config = _model_config(config, tokenizer, source)
    _architecture_defaults(d, model_config.architecture)
    plan = None
    if t.batch_size == "auto":
        from kbert.train.memory import plan_for_config

        plan = plan_for_config(config, model_config, precision, replicas, backend.kind,
                               backend.device_memory() if t.memory is None else None, backend=backend.name,
                               compiled=backend.compiles_step(precision))
        t.batch_size, t.accumulation = plan["global_batch"], plan["accumulation"]
        kept = _interrupted_batch(config.output_dir) if resume else None
        if kept and kept != t.batch_size:  # the checkpoints' global batch stands; micro-steps make it fit here
            plan["interrupted"] = kept
            t.batch_size, t.accumulation = kept, _micro_steps(kept, plan["global_batch"], replicas)
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
              f"  data: {d.source!r}{f' read as {d.format}' if d.format else ''}, {d.max_length} tokens per sequence\n"
              f"  batch: {t.batch_size} sequences per step"
              + ("" if not plan else f" (the interrupted run's; batch_size: auto plans {plan['global_batch']} here)"
                 if plan.get("interrupted") else " (planned by batch_size: auto)")
              + f" = {replicas} replica(s) x {t.accumulation} micro-step(s) x {micro_batch // replicas}; "
              f"precision {precision} on {backend.kind} ({backend.name})\n  output: {config.output_dir}"
              + (f"\n  compiled steps kept in {backend.compilation_cache} (runtime.compilation_cache)"
                 if getattr(backend, "compilation_cache", None) else ""), file=sys.stderr, flush=True)

    out = config.output_dir
    checkpoints = RunCheckpoints(os.path.join(out, "checkpoints"), keep=t.keep_checkpoints,
                                 to_numpy=backend.to_numpy, writer=backend.writer)
    checkpoints.check_format()
    if backend.writer:  # one writer per dir: a second run on it would resume from, and overwrite, this one's files
        from kbert.utils import writing_to

        held.enter_context(writing_to(out, "kbert pretrain"))
    os.makedirs(out, exist_ok=True)
    if not resume and checkpoints.latest:
        raise ValueError(f"{checkpoints.directory!r} already has checkpoints; resume, or choose another output_dir")
    if checkpoints.latest and os.path.isfile(os.path.join(out, "config.json")):
        check_resumable(os.path.join(out, "config.json"), config)  # before the saved config is replaced
    if backend.writer:
        config.save(os.path.join(out, "config.json"))

    # 2. model and optimizer, laid out by the backend
    model, optimizer, variables = build_model_and_optimizer(config, model_config, precision, backend)
    backbone = model.backbone

    # 3. resume: weights, optimizer slots, step (the data position follows from the step)
    restored = checkpoints.restore(model, optimizer, backend.assign)
    if restored is not None:
        print(f"resuming from step {restored[0]} ({restored[2]})", file=sys.stderr, flush=True)
    elif source is not None:  # a fresh run of continued pretraining: the source's weights, not random ones
        loaded = continue_from(model, source[1], backend.assign)
        print(f"continuing from {source[0]}: {loaded}", file=sys.stderr, flush=True)
    elif t.embedding_init == "cooccurrence":  # a fresh run (deterministic, so a restart from step 0 repeats it)
        from kbert.train.embedding_init import initialize_token_embeddings

        text = text_source(d) if t.embedding_init_text is None else t.embedding_init_text
        initialize_token_embeddings(backbone, text, tokenizer, seed=rt.seed, progress=progress)
    start = restored[0] if restored is not None else 0
    sync_iterations(optimizer, start, t.accumulation)

    # 4. data, skipped forward to the restored step
    data_args = dict(source=text_source(d), tokenizer=tokenizer, objective=_data_objective(d.objective),
                     max_length=d.max_length, mask_rate=d.mask_rate, max_predictions=d.max_predictions,
                     whole_word=d.whole_word, ngram=d.ngram, short_seq_prob=d.short_seq_prob, seed=rt.seed,
                     shuffle_buffer=d.shuffle_buffer, workers=d.workers, join_documents=d.join_documents)
    iterator = backend.batches(data_args, micro_batch, start, t.accumulation,
                               records_cache=os.path.join(out, "records"), progress=progress)

    # 5. the loop
    train_step = backend.compile_step(model, optimizer, variables, t.accumulation, precision)
    write_scalars = backend.scalar_writer(os.path.join(out, "logs"))
    tokens_per_step = t.batch_size * d.max_length
    predictions = d.max_predictions or default_max_predictions(d.max_length, d.mask_rate)
    # kbert's Pretrainer runs its last block at [CLS] and the masked positions only: count what it computes
    rows = pretrainer_last_layer_rows(predictions) if d.objective != "electra" else None
    flops_per_step = train_flops_per_step(model_config, t.batch_size, d.max_length, predictions, rows)
    bar = progress_bar(total=t.steps, desc="pretrain", unit="step", enabled=progress, initial=start)
    history, recent = [], collections.deque(maxlen=_RECENT_STEPS)
    t0, s0 = time.perf_counter(), start
    t1 = s1 = None  # after this call's first step (tracing, XLA compilation): the steady rate starts there
    saving_s = 0.0  # seconds spent in checkpoint saves since t1 (a BERT-Base checkpoint is ~1.3 GB)
    waiting_s = 0.0  # seconds the host spent waiting for the device's metrics since t1
    end = t.steps if stop_after is None else min(t.steps, start + stop_after)
    current, saved_at, oom = start, (restored[2] if restored else None), None

    def save(step):
        nonlocal saving_s
        began = time.perf_counter()
        backend.sync_to_model()
        path = checkpoints.save(step, model, optimizer)
        if t1 is not None:
            saving_s += time.perf_counter() - began
        return path

    def settle(step, metrics):
        """Reads step `step`'s metrics (waiting for it): the NaN guard, history, progress bar, scalars."""
        nonlocal waiting_s
        began = time.perf_counter()
        metrics = backend.read_metrics(metrics)
        if t1 is not None:
            waiting_s += time.perf_counter() - began
        if not math.isfinite(metrics["loss"]):
            raise TrainingDiverged(f"Loss became {metrics['loss']} at step {step}; stopped without "
                                   f"saving. The last good checkpoint is intact: {saved_at or 'none yet'}. "
                                   f"Lower optimizer.learning_rate, raise warmup_steps or use "
                                   f"float32/bfloat16")
        history.append(metrics["loss"])
        recent.append(metrics)
        if step % t.log_every == 0 or step == end:
            elapsed = max(time.perf_counter() - t0, 1e-9)
            tps = (step - s0) * tokens_per_step / elapsed
            smooth = _mean_metrics(recent)
            shown = dict(loss=f"{smooth['loss']:.3f}", mlm_acc=f"{smooth.get('mlm_accuracy', 0):.3f}")
            if "rtd_accuracy" in smooth:  # ELECTRA: the discriminator's accuracy over all tokens
                shown["rtd_acc"] = f"{smooth['rtd_accuracy']:.3f}"
            steady = ((step - s1) / max(time.perf_counter() - t1 - saving_s, 1e-9)
                      if s1 is not None and step > s1 else None)
            used = (model_flops_utilization(flops_per_step, steady, replicas, backend.device_name)
                    if steady else None)
            if used is not None:
                shown["mfu"] = f"{100 * used:.1f}%"
            bar.set_postfix(**shown, tok_s=f"{tps:,.0f}")
            lr = float(_learning_rate(optimizer, (step - 1) * t.accumulation))  # the schedule counts micro-steps
            write_scalars(step, {**metrics, "tokens_per_second": tps, "learning_rate": lr,
                                 **({"mfu": used} if used is not None else {})})

    # The host reads step N's metrics while step N+1 runs (JAX dispatches without waiting), so the device
    # does not idle through the host's gaps; the first step, a step about to be checkpointed, the last step
    # and a step a signal stops at are read at once, so nothing is saved before its loss is checked.
    pending = None  # (step, metrics) dispatched and not yet read
    with StopSignals() as signals:  # Ctrl-C / SIGTERM: finish the step, save, return
        try:
            while current < end:
                try:
                    faults.check_memory(micro_batch // replicas)
                    dispatched = train_step(iterator)
                    if pending is not None:
                        settle(*pending)  # the host waits here, for the step before, while this one runs
                    stop = signals.received  # a signal stops the run after the step in flight
                    pending = (current + 1, dispatched)
                    if t1 is None or (current + 1) % t.checkpoint_every == 0 or current + 1 == end or stop:
                        settle(*pending)
                        pending = None
                except Exception as e:  # noqa: BLE001 - out of memory is handled below, the rest re-raised
                    if backend.is_out_of_memory(e):
                        oom = e
                        break
                    raise
                current += 1
                if t1 is None:
                    t1, s1 = time.perf_counter(), current
                bar.update(1)
                if current % t.checkpoint_every == 0:
                    saved_at = save(current)
                if stop:
                    break
        finally:
            t_end = time.perf_counter()
            bar.close()
    if oom is not None:
        return _retry_smaller(config, oom, micro_batch // replicas, checkpoints.latest, progress, end)
    if saved_at is None or not saved_at.endswith(f"ckpt-{current}.safetensors"):
        saved_at = save(current)  # at exit: a signal, stop_after, or the last step
    backend.sync_to_model()
    write_scalars.flush()
    smooth = _mean_metrics(recent)
    summary = {"step": current, "finished": current >= t.steps, "stopped_by": signals.received,
               "loss": smooth.get("loss"), "mlm_accuracy": smooth.get("mlm_accuracy"), "mean_of_steps": len(recent),
               **({"rtd_accuracy": smooth["rtd_accuracy"]} if "rtd_accuracy" in smooth else {}),
               "metrics": smooth,
               "history": history,
               "checkpoint": saved_at, "replicas": replicas, "precision": precision, "jit": backend.jit,
               "backend": backend.name, "device": backend.device_name,
               "global_batch": t.batch_size, "accumulation": t.accumulation}
    if current >= t.steps and backend.writer:  # 6. the final model dir
        kept = model.backbone if d.objective == "electra" else model  # ELECTRA keeps the discriminator
        summary["model_dir"] = save_model(kept, os.path.join(out, "model"), tokenizer=tokenizer)
        start = config.model.get("from") if isinstance(config.model, dict) else config.model
        write_pretrain_card(config, model_config, summary, summary["model_dir"],
                            continued_from=str(start) if source is not None else None)
    elapsed = time.perf_counter() - t0
    summary["tokens_per_second"] = (current - s0) * tokens_per_step / elapsed if current > s0 else 0.0
    # without the first step of this call (tracing, compilation, the pipeline's start) and the saves
    steady_s = max(t_end - t1 - saving_s, 1e-9) if s1 is not None and current > s1 else None
    steady_steps = (current - s1) / steady_s if steady_s else None
    summary["steady_tokens_per_second"] = (steady_steps * tokens_per_step if steady_steps
                                           else summary["tokens_per_second"])
    summary["mfu"] = (model_flops_utilization(flops_per_step, steady_steps, replicas, backend.device_name)
                      if steady_steps else None)
    # near 1: the host spent the steady steps waiting for the device (the device is the bottleneck); well
    # below: the host (the input, the loop) kept the device waiting
    summary["host_waited_fraction"] = (waiting_s / steady_s if steady_s and backend.name == "jax"
                                       else None)  # TensorFlow's step returns only when it is done
    return summary


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
    restart = int(os.path.basename(checkpoint).split("-", 1)[1].split(".")[0]) if checkpoint else 0
    summary = pretrain(config, resume=True, progress=progress, stop_after=end - restart)
    summary["oom_retries"] = summary.get("oom_retries", 0) + 1
    return summary


def _learning_rate(optimizer, iteration):
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    lr = inner._learning_rate
    if hasattr(lr, "host_value"):
        return lr.host_value(iteration)  # no device op: it would wait for the step in flight
    return lr(iteration) if callable(lr) else lr
