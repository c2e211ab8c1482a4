"""GPU figures for pretraining on Keras' JAX backend (no TensorFlow needed), with Hugging Face in the same run:
tokens/s and MFU against the matmul peak measured in that run, the memory planner against XLA's compiled
program and the allocator's peak, `kbert plan --exact` / `--probe`, and the 12 GB table on a capped GPU.

The backbones are kbert's own (`keras.ops` only), trained with the masked-LM + NSP objective on synthetic
batches that stay on the device, so the figure is the model's step and not an input pipeline:

- `peak`: the bf16 and fp32 matmul peaks of this device (8192^3 products through `jax.numpy`; fp32 uses the
  backend's default precision, TF32 on NVIDIA GPUs since Ampere);
- `throughput`: Keras' own JAX `train_step` (forward, backward, AdamW update) under `jax.jit` with the state
  donated, timed over `--steps` steps after two warm-up steps; tokens/s and MFU = model FLOPs per second /
  measured bf16 peak (the convention of the PaLM paper: the model's matmul FLOPs, no recomputation counted).
  `--variants` runs several `ModelConfig` overrides in one process (`default`, `attention_dropout=0.0`, ...)
  and says whether XLA's program holds cuDNN's fused attention; `attention_kernel=cudnn_dropout` runs BERT's
  attention dropout inside cuDNN's kernel, after `dropout-check` (below) says whether that is dropout;
- `preflight` (any host, no GPU): the training step of each `--variants` set lowered for CUDA, and the cuDNN
  attention calls in it (`cuda_attention_calls`), to see which variants reach cuDNN before device time;
- `dropout-check`: cuDNN's attention dropout against its definition on one layer's shape: kept entries are the
  softmax / (1 - rate), about `rate` of them dropped, the backward pass uses the forward's mask, and the mask
  changes between steps and between layers;
- `hf`: the peer, transformers' `BertForPreTraining` (SDPA attention, bf16 autocast, fused AdamW, labels at
  the same number of masked positions) eager and under `torch.compile`, same shape, same FLOP count;
- `profile`: the same step under `jax.profiler.trace`: the device's kernel time per kind (matmul, fused
  attention, elementwise and reduction fusions, copies) and the top kernels, per step, beside its wall time;
- `memory`: `Pretrainer.train_on_batch` (what `fit` runs) in a fresh process per point: the allocator's peak,
  XLA's memory analysis of the same compiled step and `kbert.train.memory.estimate_memory`;
- `aot-memory` (any host, no GPU or TPU; JAX's CUDA plugin or libtpu installed): the `memory` points compiled
  by XLA for devices described to it (`--targets`: an H100 and an H200 by default; an A100, an L4, the 12 GB
  RTX 3060 and TPU v5e and v6e chips too; deviceless compilation), XLA's memory analysis beside the
  planner, and the refit line: how a change to kbert's program moves a device's bytes before device time, and
  the planner on devices no session has had (in `all`, the `aot` stage compiles two memory points for the
  device's own description, beside its bytes);
- `aot-traffic` (the same, no GPU): the step of each `--variants` set compiled for the first `--targets` GPU,
  and what its kernels read and write (`hlo_traffic`): matmul, attention-kernel and memory-bound bytes, and
  the memory-bound bytes per model op, to find the memory-bound passes and see a change move them;
- `capped`: run under `XLA_PYTHON_CLIENT_MEM_FRACTION` = `--cap` / device memory: `kbert plan --exact` and
  `--probe` per sequence length beside the analytic `kbert plan --memory` answer;
- `pretrain`: `kbert.pretrain` itself on records (the numpy reader, no TensorFlow), `--steps-pretrain` steps
  with a resume in the middle: the loss falls, the resumed step's loss equals the uninterrupted one's, and
  the steady tokens/s is set beside the same compiled step fed one device-resident synthetic batch (the
  reader must keep up: at least 95%). The records come from `records`, run where ../shared/data is (no
  TensorFlow needed): `python benchmarks/gpu.py records --shared ../shared/data --out .gpu` (a WordPiece vocabulary, so the
  device needs no sentencepiece either; about 12 MB of mlm+nsp records of movie reviews at length 128);
- `xla` (a stage of `all`, after the profile): the `throughput` step again in one process per set of XLA
  flags (`--xla-variants`; flags are read once per process, so each set needs its own), with the same model
  `--variants` as the throughput stage, each beside its no-flags row:
  which of XLA's GPU fusion options (cuBLASLt epilogues, Triton or cuDNN GEMM fusions) shorten the
  memory-bound passes the profile shows, before any of them is made kbert's default;
- `lora` (a stage of `all`, last): fine-tuning a classifier with and without LoRA (`kbert.finetune(...,
  lora_rank=8)`'s step, `benchmarks/lora_memory.py`): XLA's plan of the step for a model of XLM-RoBERTa-large's
  size (560M weights: BGE-M3, KURE) at batch 8 and for `--model` at batch 32, and the step time of each at
  batch 32 (`--lora-points` names other points);
- `all`: each of the above in its own process (JAX's peak memory is per process), most important first,
  skipping what would not finish by `--budget` seconds (and the stages named in `--skip`), then one set of
  tables; also `--out/gpu.json`. After the capped table, `--ablations` (override sets, e.g. the code-path
  switches `dropout_masks=hash2;qkv=sliced`) are timed each beside the default step in one process: the
  before/after figures of changes made without a GPU, kept as far as the budget reaches.

    python benchmarks/gpu.py records --shared ../shared/data --out .gpu        # here, beside the shared data
    KERAS_BACKEND=jax python benchmarks/gpu.py all --records .gpu --out /tmp/gpu

A device lease runs `bash benchmarks/device.sh run` (`all` with the next run's arguments, after the set-up the
device image needs); `bash benchmarks/device.sh wheels`, then `call`, prepare it here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

_STARTED = time.perf_counter()  # the process's start, for the capped stage's start-up seconds
os.environ.setdefault("KERAS_BACKEND", "jax")
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))

from kbert.train.flops import pretrainer_last_layer_rows, train_flops_per_step  # noqa: E402 (this checkout's kbert)


def _error_text(e: BaseException) -> str:
    """One line naming an exception: Keras wraps a layer's error as "Exception encountered when calling
    X.call()." with the cause further down ("... Error encountered:\n\ncuDNN is not detected."), so the
    cause's first line is what a report row shows."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for i, line in enumerate(lines[:-1]):
        if line.endswith("Error encountered:"):
            return f"{type(e).__name__}: {lines[i + 1][:300]}"
    return f"{type(e).__name__}: {(lines[0] if lines else '')[:300]}"


def matmul_peak(dtype: str, n: int = 8192, repeats: int = 10) -> float:
    import jax

    key = jax.random.PRNGKey(0)
    a = jax.random.normal(key, (n, n), dtype=dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype=dtype)
    f = jax.jit(lambda a, b: a @ b)
    for _ in range(3):
        f(a, b).block_until_ready()
    t = time.perf_counter()
    for _ in range(repeats):
        out = f(a, b)
    out.block_until_ready()
    return 2 * n ** 3 * repeats / (time.perf_counter() - t)


# kbert code paths for before/after figures: `--variants` items of the form NAME=CHOICE from
# kbert.models.layers.IMPLEMENTATIONS (e.g. dropout_masks=generator, attention=explicit,
# attention_mask=broadcast), or attention_mask=lengths: the padding mask handed to cuDNN's fused kernel as
# per-row key lengths (its padding-mask type; right-padded batches only); anything else is a ModelConfig
# override.
def _as_lengths(q, k, padding_mask):
    """cuDNN's form of a right-padded batch: (query lengths [b], key lengths [b]). The Pretrainer's last block
    has 1 + p queries (at [CLS] and the masked positions, every one of them real; kbert.models.layers makes
    the count even, as cuDNN's training kernel wants)."""
    import jax.numpy as jnp

    if len(padding_mask.shape) != 2:
        raise ValueError("cuDNN's lengths form takes a [b, s] padding mask, not packed rows")
    keys = padding_mask.astype("int32").sum(1)  # [b]
    return (keys if q.shape[1] == k.shape[1] else jnp.full_like(keys, q.shape[1])), keys


def _lengths_kernel(q, k, v, padding_mask, scale):
    import jax

    queries, keys = _as_lengths(q, k, padding_mask)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="cudnn", query_seq_lengths=queries,
                                        key_value_seq_lengths=keys)


# attention_kernel=cudnn_dropout: cuDNN's fused attention with the attention dropout inside the kernel, so BERT's
# default (attention dropout 0.1) runs fused in training too. jax.nn.dot_product_attention takes no dropout rate;
# JAX's cuDNN binding underneath it does, and XLA's cuDNN runtime advances the kernel's random offset on every
# execution (one counter per call site, forward and backward in step). Every call site starts that counter at 0,
# so each gets its own seed here, or all the layers of a step would drop the same entries. `dropout_check`
# below verifies on the device that this is dropout before a step time of it means anything. Two things to settle
# before it could be kbert's default: the counters restart with the process (a resumed run replays the first
# steps' masks on new batches), and with data parallelism every device draws the same masks for its own rows.
_SEEDS = iter(range(1, 1 << 30))


def _cudnn_dropout_kernel(q, k, v, padding_mask, scale, dropout=0.0):
    """q, k, v [b, s, n, d] ([b, r, n, d] queries at the last block's rows), padding_mask [b, s] right-padded
    -> [b, s, n, d]: the padding as per-row key lengths (cuDNN's padding-mask type), dropout in the kernel."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    queries, keys = _as_lengths(q, k, padding_mask)
    return dot_product_attention(q, k, v, q_seqlen=queries, kv_seqlen=keys, scale=scale, mask_type=MaskType.PADDING,
                                 seed=next(_SEEDS), dropout_rate=float(dropout))


_cudnn_dropout_kernel.with_dropout = True  # kbert.models.layers calls it in training with attention dropout too
KERNELS = {"attention_mask=lengths": _lengths_kernel, "attention_kernel=cudnn_dropout": _cudnn_dropout_kernel}


def _implementation_choices(overrides) -> dict:
    from kbert.models.layers import IMPLEMENTATIONS

    names = set(IMPLEMENTATIONS) | {"attention_mask", "attention_kernel"}
    return dict(item.split("=", 1) for item in overrides or () if item.split("=", 1)[0] in names)


def _switch_implementation(overrides):
    """Chooses the kbert code paths named in `overrides` (the rest at kbert's defaults)."""
    from kbert.models.layers import set_implementation

    choices = _implementation_choices(overrides)
    kernels = [KERNELS[f"{name}={value}"] for name, value in choices.items() if f"{name}={value}" in KERNELS]
    if len(kernels) > 1:
        raise ValueError(f"one attention kernel at a time: {sorted(choices)}")
    choices = {name: value for name, value in choices.items() if f"{name}={value}" not in KERNELS}
    if "attention_kernel" in choices:
        raise ValueError(f"attention_kernel={choices['attention_kernel']}: choose from {sorted(KERNELS)}")
    set_implementation(attention_kernel=kernels[0] if kernels else None, **choices)


def cuda_attention_calls(model: str = "bert-base", seq: int = 128, batch: int = 8, vocab: int = 32000,
                         overrides=("attention_kernel=cudnn_dropout",), precision: str = "mixed_bfloat16") -> dict:
    """The training step lowered for CUDA on any host (no GPU, nothing compiled or run): the cuDNN attention
    calls in XLA's input program, in order, each as (kind, seed, dropout rate, mask type), and the number of
    softmaxes left outside them (`jnp.exp` over the keys: attention not fused). A pre-flight check of a
    variant before device time: with `attention_kernel=cudnn_dropout` every layer's forward call has its
    backward call, with the same seed and BERT's rate, each layer its own seed. JAX checks cuDNN's version and
    the GPU's compute capability when it traces the call; where there is no GPU they are told a cuDNN 9.10 on
    a Hopper GPU for the trace alone, so Keras' own choice (`ops.dot_product_attention`) is cuDNN too."""
    import contextlib
    import logging

    import jax
    import jax._src.cudnn.fused_attention_stablehlo as cudnn_attention

    from kbert.train.probe import CompiledStep, build_trainer

    class Fallbacks(logging.Handler):  # Keras logs (through absl) each time JAX refuses cuDNN and XLA runs instead
        def emit(self, record):
            if "Failed to apply" in record.getMessage():
                fallbacks.append(record.getMessage() + (f" {record.exc_info[1]}" if record.exc_info else ""))

    fallbacks = []
    config = _config(model, vocab, overrides)
    _switch_implementation(overrides)
    with contextlib.ExitStack() as stack:
        handler = Fallbacks()
        logging.getLogger("absl").addHandler(handler)
        stack.callback(logging.getLogger("absl").removeHandler, handler)
        if jax.devices()[0].platform != "gpu":
            for name, value in (("check_cudnn_version", 91000), ("check_compute_capability", True)):
                stack.callback(setattr, cudnn_attention, name, getattr(cudnn_attention, name))
                setattr(cudnn_attention, name, lambda *a, value=value, **k: value)
        step = CompiledStep(build_trainer(config, "adamw", precision, abstract=True), config, seq)
        text = step.lower(batch, platform="cuda").as_text()
    calls = []
    for target, config_text in re.findall(r'custom_call @(__cudnn\$fmha\w*)\(.*?backend_config = "(.*?)"', text):
        config_text = re.sub(r"\\([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), config_text)  # MLIR's \22
        fields = json.loads(config_text)["cudnn_fmha_backend_config"]
        calls.append({"kind": target.removeprefix("__cudnn$"), "seed": int(fields.get("seed", 0)),
                      "dropout_rate": float(fields.get("dropout_rate", 0.0)), "mask_type": fields.get("mask_type")})
    return {"model": model, "overrides": list(overrides), "layers": config.num_layers, "calls": calls,
            "softmax_outside": text.count("stablehlo.exponential"), "fallbacks": fallbacks}


def _cudnn_dropout_check_kernel(q, k, v, mask, scale, dropout, step):
    """`dropout_check`'s form of the kernel: cuDNN keeps its random state itself, so `step` is unused."""
    del step
    return _cudnn_dropout_kernel(q, k, v, mask, scale, dropout)


def dropout_check(batch: int = 4, seq: int = 64, heads: int = 12, rate: float = 0.1, kernel=None) -> dict:
    """Whether an attention kernel's own dropout is dropout (default: cuDNN's, `attention_kernel=cudnn_dropout`).

    One program calls `kernel(q, k, v, mask, scale, dropout, step)` at two call sites on one BERT layer's shape
    with head size = `seq` and V the identity ([b, s, n, d], v[:, j, :, j] = 1), so each output is the dropped
    and rescaled probability matrix A [b, s, n, s] itself, and takes both sites' backward passes. Then:
    - A's kept entries equal softmax(q k^T scale) / (1 - rate) (`kept_max_rel_error`), and the share dropped is
      near `rate` (`dropped_share`);
    - the backward pass used the forward's mask: dV = A^T dO with A from the same execution (`backward_rel_error`;
      `backward_rel_error_without_dropout` is what a backward pass with no mask at all would score);
    - a second execution draws another mask (`differs_between_steps`: the share of entries kept in one and
      dropped in the other, 2 rate (1 - rate) for independent masks), and so does the second call site.
    `step` (0, then 1) is for kernels without random state of their own (the CPU tests' stand-ins)."""
    import jax
    import jax.numpy as jnp

    kernel = kernel or _cudnn_dropout_check_kernel
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.normal(size=(batch, seq, heads, seq)), "bfloat16") for _ in range(2))
    v = jnp.broadcast_to(jnp.eye(seq, dtype="bfloat16")[None, :, None, :], (batch, seq, heads, seq))
    g = jnp.asarray(rng.normal(size=(batch, seq, heads, seq)), "bfloat16")  # dO
    mask = jnp.ones((batch, seq), "int32")
    scale = seq ** -0.5

    def program(q, k, v, g, step):  # both sites differentiated, as every layer of a training step is
        outs = [jax.vjp(lambda v: kernel(q, k, v, mask, scale, rate, step), v) for _ in range(2)]
        return [out for out, _ in outs], [pullback(g)[0] for _, pullback in outs]

    compiled = jax.jit(program).lower(q, k, v, g, 0).compile()
    (a, a_second), dvs = jax.tree.map(lambda t: np.asarray(t, "float32"), compiled(q, k, v, g, 0))  # A[b, i, n, j]
    a_next = np.asarray(compiled(q, k, v, g, 1)[0][0], "float32")
    probs = np.asarray(jax.nn.softmax(jnp.einsum("bind,bjnd->binj", q.astype("float32"), k.astype("float32"))
                                      * scale, axis=-1))
    expected = probs / (1 - rate)
    clear = expected > 2e-3  # entries big enough to tell kept (~expected) from dropped (0) in bf16

    def dropped(x):
        return np.abs(x) < 0.5 * expected

    def status_differs(x, y):
        return float((dropped(x) != dropped(y))[clear].mean())

    def backward_error(a, dv, against=None):  # dV [b, j, n, d] = sum_i A[b, n, i, j] dO[b, i, n, d]
        want = np.einsum("binj,bind->bjnd", a, np.asarray(g, "float32"))
        return float(np.linalg.norm(dv - (want if against is None else np.einsum(
            "binj,bind->bjnd", against, np.asarray(g, "float32")))) / np.linalg.norm(want))

    both = np.stack([a, a_second])
    result = {"form": "cudnn dropout" if kernel is _cudnn_dropout_check_kernel else getattr(kernel, "__name__", ""),
              "shape": [batch, seq, heads, seq], "rate": rate,
              "fused": "__cudnn$fmha" in compiled.as_text(),
              "kept_max_rel_error": float(np.abs(both / expected - 1)[clear & ~dropped(both)].max()),
              "dropped_share": float(dropped(both)[np.broadcast_to(clear, both.shape)].mean()),
              "backward_rel_error": max(backward_error(a, dvs[0]), backward_error(a_second, dvs[1])),
              "backward_rel_error_without_dropout": backward_error(a, dvs[0], against=probs),
              "differs_between_steps": status_differs(a, a_next),
              "differs_between_call_sites": status_differs(a, a_second)}
    independent = 2 * rate * (1 - rate)
    result["ok"] = bool(result["kept_max_rel_error"] < 0.05 and abs(result["dropped_share"] - rate) < 0.3 * rate
                        and result["backward_rel_error"] < 0.05
                        and result["differs_between_steps"] > 0.5 * independent
                        and result["differs_between_call_sites"] > 0.5 * independent)
    return result


def _config(model: str, vocab: int, overrides=()):
    """A preset with `--set field=value` overrides (e.g. attention_dropout=0.0); implementation switches
    (kbert.models.layers.IMPLEMENTATIONS) are not ModelConfig fields and are skipped here."""
    from kbert.models.config import ModelConfig

    fields = {}
    for item in [o for o in overrides or () if o.split("=", 1)[0] not in _implementation_choices(overrides)]:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r}: expected field=value, e.g. attention_dropout=0.0")
        try:
            fields[key] = json.loads(value) if value[:1] in "0123456789-[{tfn" else value
        except json.JSONDecodeError:
            raise ValueError(f"override {item!r}: {value!r} is not a number, list or true/false/null") from None
    return ModelConfig.preset(model, vocab_size=vocab, **fields)


def _uses_fused_attention(compiled) -> bool:
    """Whether XLA's program for this step calls cuDNN's fused attention (or a Pallas/Mosaic kernel on TPU)."""
    text = compiled.as_text()
    return "__cudnn$fmha" in text or "tpu_custom_call" in text


def _device_step(model: str, seq: int, batch: int, precision: str, vocab: int, overrides=()):
    """Keras' JAX `train_step` of a kbert backbone compiled with the state donated, its state and one
    synthetic batch on the device: (compiled step, state, data, config, masked positions per sequence)."""
    import jax

    from kbert.data.masking import default_max_predictions
    from kbert.train.probe import build_trainer, synthetic_batch

    config = _config(model, vocab, overrides)
    _switch_implementation(overrides)
    predictions = default_max_predictions(seq)
    trainer = build_trainer(config, "adamw", precision)
    features, labels = synthetic_batch(config, batch, seq, predictions)
    trainer.train_on_batch(features, labels)  # builds the optimizer and metrics
    state = trainer._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                   optimizer_variables=True, metrics_variables=True)
    data = jax.device_put((features, labels))
    step = jax.jit(trainer.train_step, donate_argnums=0).lower(state, data).compile()
    return step, state, data, config, predictions


def throughput(model: str, seq: int, batch: int, precision: str, steps: int, vocab: int, overrides=()) -> dict:
    import jax
    import keras

    from kbert.train.probe import program_bytes

    step, state, data, config, predictions = _device_step(model, seq, batch, precision, vocab, overrides)
    fused = _uses_fused_attention(step)
    # the step's memory: XLA's analysis of this executable (per variant; the allocator's peak covers the whole
    # process), which the allocator's peak matches within a constant tens of MB (the memory stage's table)
    step_bytes = program_bytes(step)
    t_compile = time.perf_counter()
    for _ in range(2):
        logs, state = step(state, data)
    jax.block_until_ready(logs)
    compile_s = time.perf_counter() - t_compile
    t = time.perf_counter()
    for _ in range(steps):
        logs, state = step(state, data)
    jax.block_until_ready((logs, state))
    elapsed = time.perf_counter() - t
    flops = train_flops_per_step(config, batch, seq, predictions, pretrainer_last_layer_rows(predictions))
    del state, data
    return {"impl": "kbert", "model": model, "seq": seq, "batch": batch, "precision": precision, "steps": steps,
            "step_ms": elapsed / steps * 1e3, "tokens_per_s": batch * seq * steps / elapsed,
            "model_flops_per_s": flops * steps / elapsed, "compile_and_warmup_s": compile_s,
            "fused_attention": fused, "step_bytes": step_bytes, "loss": float(logs["loss"]), "keras": keras.__version__,
            "jax": jax.__version__, "device": str(jax.devices()[0].device_kind), "overrides": list(overrides or ()),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


# Kernel names -> what they do, first match wins: cuDNN's fused attention, matmuls (cuBLAS/cuBLASLt's nvjet
# and xmma kernels, CUTLASS, XLA's Triton GEMM fusions), copies, reductions (LayerNorm, softmax, loss), and
# XLA's elementwise loop fusions (bias, GELU, dropout, the AdamW update).
KERNEL_KINDS = (("attention (fused)", ("fmha", "flash", "cudnn")),
                 # XLA:CPU's XNNPACK fusions: mostly matmuls with what XLA fused around them, some reductions
                 ("XNNPACK fusion (CPU)", ("ynn_fusion", "xnn_fusion")),
                 ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "dot", "matmul", "wgmma")),
                 ("copy / transpose", ("memcpy", "memset", "copy", "transpose")),
                 ("reduction fusion", ("reduce", "reduction")),
                 ("elementwise fusion", ("fusion", "loop_", "elementwise")))


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def device_time_by_kernel(trace_dir: str) -> dict:
    """Sums the device's kernel time per kernel name in the perfetto trace `jax.profiler.trace` wrote to
    `trace_dir`. On a GPU: the events of the device's stream lines (the "XLA Ops"/"XLA Modules"/"Steps"
    lines restate the same time by HLO op, so they are left out); on CPU, where nothing runs on a device,
    the events of XLA's executor threads. Returns {"source", "total_us", "kernels": {name: us}}."""
    import collections
    import glob
    import gzip

    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(paths[-1], "rt", encoding="utf-8") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    devices = {pid for pid, name in names.items() if "/device:" in name}
    derived = ("xla ops", "xla modules", "steps", "launch stats", "source")

    def counted(e):
        line = threads.get((e["pid"], e.get("tid")), "").lower()
        if devices:
            return e["pid"] in devices and not any(d in line for d in derived)
        return line.startswith("tf_xla") and not e["name"].startswith(("end:", "ThunkExecutor"))

    kernels = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and counted(e):
            kernels[e["name"]] += float(e.get("dur", 0))
    return {"source": "device streams" if devices else "host XLA threads (no device in the trace)",
            "total_us": sum(kernels.values()), "kernels": dict(kernels)}


def profile(model: str, seq: int, batch: int, precision: str, steps: int, vocab: int, overrides=(),
            top: int = 15) -> dict:
    """Where a training step's device time goes: `steps` steps under `jax.profiler.trace`, kernel time per
    kind (`KERNEL_KINDS`) and the `top` kernels, per step, beside the step's wall time."""
    import shutil
    import tempfile

    import jax

    step, state, data, config, predictions = _device_step(model, seq, batch, precision, vocab, overrides)
    for _ in range(2):
        logs, state = step(state, data)
    jax.block_until_ready(logs)
    trace_dir = tempfile.mkdtemp(prefix="kbert-profile-")
    try:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            t = time.perf_counter()
            for _ in range(steps):
                logs, state = step(state, data)
            jax.block_until_ready((logs, state))
            elapsed = time.perf_counter() - t
        found = device_time_by_kernel(trace_dir)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    del state, data
    total = found["total_us"] or 1.0
    kinds = {}
    for name, us in found["kernels"].items():
        kind = kernel_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + us
    ranked = sorted(found["kernels"].items(), key=lambda kv: -kv[1])[:top]
    return {"impl": "kbert", "model": model, "seq": seq, "batch": batch, "precision": precision, "steps": steps,
            "overrides": list(overrides or ()), "device": str(jax.devices()[0].device_kind), "source": found["source"],
            "step_ms": elapsed / steps * 1e3, "kernel_ms_per_step": total / steps / 1e3,
            "kinds": {k: {"ms_per_step": us / steps / 1e3, "share": us / total}
                      for k, us in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top": [{"kernel": name[:120], "kind": kernel_kind(name), "ms_per_step": us / steps / 1e3,
                     "share": us / total} for name, us in ranked]}


def attention(batch: int, seq: int, heads: int = 12, head_size: int = 64, repeats: int = 20) -> list:
    """Which forms of masked attention reach cuDNN's fused kernel on this device, and forward + backward time
    of each at one BERT layer's shape ([batch, seq, heads, head_size], bf16, a padding mask)."""
    import jax
    import jax.numpy as jnp
    import keras

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(batch, seq, heads, head_size)), "bfloat16") for _ in range(3))
    lengths = jnp.asarray(rng.integers(seq // 2, seq + 1, batch), "int32")
    mask = jnp.arange(seq)[None, :] < lengths[:, None]  # [b, s] right padding
    scale = head_size ** -0.5
    forms = {
        "keras mask [b,1,1,s]": lambda q, k, v: keras.ops.dot_product_attention(
            q, k, v, mask=mask[:, None, None, :], scale=scale),
        "keras mask [b,1,s,s]": lambda q, k, v: keras.ops.dot_product_attention(
            q, k, v, mask=jnp.broadcast_to(mask[:, None, None, :], (batch, 1, seq, seq)), scale=scale),
        "keras mask [b,1,1,s] flash=True": lambda q, k, v: keras.ops.dot_product_attention(
            q, k, v, mask=mask[:, None, None, :], scale=scale, flash_attention=True),
        "jax cudnn mask [b,1,1,s]": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, mask=mask[:, None, None, :], scale=scale, implementation="cudnn"),
        "jax cudnn mask [b,1,s,s]": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, mask=jnp.broadcast_to(mask[:, None, None, :], (batch, 1, seq, seq)), scale=scale,
            implementation="cudnn"),
        "jax cudnn lengths": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=scale, query_seq_lengths=lengths, key_value_seq_lengths=lengths, implementation="cudnn"),
        "jax xla mask": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, mask=mask[:, None, None, :], scale=scale, implementation="xla"),
    }
    rows = []
    reference = None
    for name, fn in forms.items():
        def loss(q, k, v):
            out = fn(q, k, v)
            return (out.astype("float32") * mask[:, :, None, None]).sum(), out

        row = {"form": name}
        try:
            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)).lower(q, k, v).compile()
            row["fused"] = "__cudnn$fmha" in step.as_text()
            (value, out), grads = step(q, k, v)
            jax.block_until_ready(grads)
            t = time.perf_counter()
            for _ in range(repeats):
                (value, out), grads = step(q, k, v)
            jax.block_until_ready(grads)
            row["ms"] = (time.perf_counter() - t) / repeats * 1e3
            keep = np.asarray(mask)
            got = np.asarray(out.astype("float32"))[keep]
            reference = got if reference is None else reference
            row["max_abs_diff_vs_first"] = float(np.abs(got - reference).max())
        except Exception as e:  # noqa: BLE001 - a diagnosis: report and go on
            row["error"] = _error_text(e)
        rows.append(row)
    try:
        from keras.src.backend.jax.nn import _can_use_flash_attention

        _can_use_flash_attention(q, k, v, None, raise_error=True)
        rows.append({"form": "keras _can_use_flash_attention", "fused": True})
    except Exception as e:  # noqa: BLE001
        rows.append({"form": "keras _can_use_flash_attention", "error": _error_text(e)})
    return rows


def hf(model: str, seq: int, batch: int, steps: int, vocab: int, overrides=(), modes=("eager", "compile")) -> list:
    """transformers' BertForPreTraining on torch: SDPA attention, bf16 autocast, fused AdamW; MLM labels at
    the same number of masked positions as kbert (HF's head still projects every position)."""
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # should anything start JAX here, it takes no memory
    import torch
    import transformers

    from kbert.data.masking import default_max_predictions

    config = _config(model, vocab, overrides)
    predictions = default_max_predictions(seq)
    hf_config = transformers.BertConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_position, hidden_dropout_prob=config.dropout,
        attention_probs_dropout_prob=config.attention_dropout, attn_implementation="sdpa")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (batch, seq), generator=g).to(device)
    segments = (torch.arange(seq)[None, :] >= seq // 2).long().repeat(batch, 1).to(device)
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    labels = torch.full((batch, seq), -100, dtype=torch.long)
    for row in range(batch):
        labels[row, torch.randperm(seq, generator=g)[:predictions]] = torch.randint(5, vocab, (predictions,),
                                                                                  generator=g)
    labels = labels.to(device)
    nsp = torch.randint(0, 2, (batch,), generator=g).to(device)
    results = []
    for mode in modes:
        torch.manual_seed(0)
        net = transformers.BertForPreTraining(hf_config).to(device).train()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-5, fused=device == "cuda")
        forward = torch.compile(net) if mode == "compile" else net
        if device == "cuda":  # this mode's peak alone: model, AdamW state, the batch, activations, workspaces
            torch.cuda.reset_peak_memory_stats()

        def step(forward=forward, opt=opt):  # bound now: both are released after this mode
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = forward(input_ids=ids, token_type_ids=segments, attention_mask=mask, labels=labels,
                               next_sentence_label=nsp).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        t_compile = time.perf_counter()
        for _ in range(3):
            loss = step()
        if device == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - t_compile
        t = time.perf_counter()
        for _ in range(steps):
            loss = step()
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        step_bytes = torch.cuda.max_memory_allocated() if device == "cuda" else None
        flops = train_flops_per_step(config, batch, seq, predictions)
        results.append({"impl": f"hf-{mode}", "model": model, "seq": seq, "batch": batch,
                        "precision": "bf16 autocast", "steps": steps, "step_ms": elapsed / steps * 1e3,
                        "tokens_per_s": batch * seq * steps / elapsed, "model_flops_per_s": flops * steps / elapsed,
                        "compile_and_warmup_s": compile_s, "step_bytes": step_bytes,
                        "loss": float(loss), "torch": torch.__version__,
                        "transformers": transformers.__version__, "overrides": list(overrides or ())})
        del net, opt, forward
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def memory(model: str, seq: int, batch: int, precision: str, vocab: int) -> dict:
    """One point: the training step compiled once (`kbert.train.probe.CompiledStep`, as `--exact` does), XLA's
    memory analysis of it, three real steps of that same executable, then the allocator's peak."""
    import jax

    from kbert.train.probe import CompiledStep, build_trainer, peak_memory

    config = _config(model, vocab)
    step = CompiledStep(build_trainer(config, "adamw", precision, abstract=True), config, seq)
    row = planned_row(model, config, seq, batch, precision, step.bytes(batch))
    logs = step.run(batch, steps=3)
    measured = peak_memory()
    return dict(row, measured_bytes=measured, loss=float(logs["loss"]), device=str(jax.devices()[0].device_kind),
                error=(row["planned_bytes"] - measured) / measured if measured else None)


def planned_row(model: str, config, seq: int, batch: int, precision: str, compiled, compiler: str = "xla") -> dict:
    """A memory point's row: XLA's compiled bytes beside `estimate_memory` (AdamW; `compiler`: its coefficient
    set) and its parts."""
    from kbert.train.memory import estimate_memory

    estimate = estimate_memory(config, batch, seq, optimizer="adamw", precision=precision, compiler=compiler)
    return {"model": model, "seq": seq, "batch": batch, "precision": precision, "compiled_bytes": compiled,
            "compiler": compiler,
            "planned_bytes": estimate["total"],
            "error_vs_compiled": (estimate["total"] - compiled) / compiled if compiled else None,
            "components": {k: v for k, v in estimate.items() if k != "total"}}


def capped(model: str, seqs, precision: str, vocab: int, cap: str, shallow=None) -> list:
    """Under a memory cap (the child is started with XLA_PYTHON_CLIENT_MEM_FRACTION set): the analytic plan
    for `cap`, `--exact` and `--probe` per sequence length (`shallow`: `--exact`'s start from 1- and 2-layer
    copies of the model; None: kbert's default, on for deep models on an accelerator)."""
    from kbert.train.memory import plan_batch_size
    from kbert.train.probe import device_memory, probe_table

    config = _config(model, vocab)
    on_device = bool(device_memory())  # CPU (a dry run): the cap stands in, and `--exact` runs without `--probe`
    rows = probe_table(config, seqs, optimizer="adamw", precision=precision, verbose=True,
                       memory=None if on_device else cap, probe=on_device, shallow=shallow)
    plan = {r["seq_len"]: r["max_batch"] for r in plan_batch_size(config, cap, seqs, optimizer="adamw",
                                                                  precision=precision)}
    for r in rows:
        r.update(model=model, precision=precision, cap=cap, device_limit=device_memory(), vocab=vocab,
                 plan_for_cap=plan[r["seq_len"]])
    # where a probe's seconds go: imports and the JAX backend, then the model built (probe_table's
    # startup_seconds), then the search and the real steps (`seconds`)
    rows[0]["process_seconds"] = time.perf_counter() - _STARTED
    return rows


# Devices for `aot-memory` and `aot-traffic`, none of which needs to be here (XLA's deviceless compilation).
# GPUs: the fields of XLA's GpuTargetConfig its GPU compiler reads when there is no device to ask (spec-sheet
# values; SMs, shared memory and threads per SM by compute capability). The description is part of what is
# measured: XLA's fusion cost model reads the memory bandwidth (the H100's description given the H200's 4.8 TB/s
# compiles the step to the H200's bytes), and the compute capability and shared memory choose its kernels (an
# Ampere or Ada GPU's step keeps more bytes than a Hopper's), where the device's memory size and name change
# nothing. The 12 GB class is an RTX 3060's (Ampere, compute capability 8.6, as the RTX 3080 Ti's and A10's;
# the RTX 4070's Ada 8.9 is the L4's).
_HOPPER = dict(capability=(9, 0), sms=132, l2=52428800, smem_core=233472, smem_optin=232448, threads_core=2048,
               fpus=128, clock=1.98)
_SM86 = dict(smem_core=102400, smem_optin=101376, threads_core=1536, fpus=128)
GPU_TARGETS = {
    "h100": dict(_HOPPER, description="NVIDIA H100 80GB HBM3", memory=84929347584, bandwidth=3352320000000),
    "h200": dict(_HOPPER, description="NVIDIA H200", memory=150754820096, bandwidth=4800000000000),
    "a100": dict(description="NVIDIA A100-SXM4-80GB", memory=85899345920, bandwidth=2039000000000,
                 capability=(8, 0), sms=108, l2=41943040, smem_core=167936, smem_optin=166912, threads_core=2048,
                 fpus=64, clock=1.41),
    "l4": dict(_SM86, description="NVIDIA L4", memory=24152899584, bandwidth=300000000000, capability=(8, 9),
               sms=58, l2=50331648, clock=2.04),
    "rtx3060": dict(_SM86, description="NVIDIA GeForce RTX 3060", memory=12884901888, bandwidth=360000000000,
                    capability=(8, 6), sms=28, l2=3145728, clock=1.78),
}
# Cloud TPUs: a chip of a TPU slice's topology (`jax.experimental.topologies`, from libtpu: pip install
# 'jax[tpu]', no TPU needed), compiled for as MaxText's `train_compile.py` does to find out-of-memory steps
# before a TPU is rented. One JAX device per chip on these; a v4 description gives one per core here.
TPU_TARGETS = {"tpu-v5e": "v5e:2x2", "tpu-v6e": "v6e:2x2"}
TARGETS = (*GPU_TARGETS, *TPU_TARGETS)


def gpu_target_config(name: str) -> str:
    """XLA's GpuTargetConfig (text proto) of a `GPU_TARGETS` GPU (cuDNN 9.10, CUDA 12.8)."""
    if name not in GPU_TARGETS:
        raise ValueError(f"GPU {name!r}: known targets are {', '.join(GPU_TARGETS)}")
    t = GPU_TARGETS[name]
    info = {"threads_per_block_limit": 1024, "threads_per_warp": 32, "shared_memory_per_block": 49152,
            "shared_memory_per_core": t["smem_core"], "threads_per_core_limit": t["threads_core"],
            "core_count": t["sms"], "fpus_per_core": t["fpus"], "block_dim_limit_x": 2147483647,
            "block_dim_limit_y": 65535, "block_dim_limit_z": 65535, "memory_bandwidth": t["bandwidth"],
            "l2_cache_size": t["l2"], "clock_rate_ghz": t["clock"], "device_memory_size": t["memory"],
            "shared_memory_per_block_optin": t["smem_optin"], "registers_per_core_limit": 65536,
            "registers_per_block_limit": 65536}
    major, minor = t["capability"]
    lines = ["gpu_device_info {"] + [f"  {k}: {v}" for k, v in info.items()]
    lines += [f"  cuda_compute_capability {{ major: {major} minor: {minor} }}", "}", 'platform_name: "CUDA"',
              "dnn_version_info { major: 9 minor: 10 }", "runtime_version { major: 12 minor: 8 }",
              f'device_description_str: "{t["description"]}"']
    return "\n".join(lines) + "\n"


def target_device(name: str):
    """A JAX device standing for a `GPU_TARGETS` GPU or a `TPU_TARGETS` TPU chip, with no such device here: XLA's
    compiler for it compiles from its description (deviceless compilation) and nothing can run there. A GPU
    needs JAX's CUDA plugin, which loads without a GPU once its driver check is skipped (`aot-memory` sets
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK); a TPU needs libtpu."""
    from jax.experimental import topologies

    if name in TPU_TARGETS:
        try:
            return topologies.get_topology_desc(topology_name=TPU_TARGETS[name], platform="tpu").devices[0]
        except RuntimeError as e:  # JAX's words: "JAX TPU support not installed; cannot generate TPU topology"
            raise RuntimeError(f"compiling for a TPU that is not here needs libtpu (pip install 'jax[tpu]'; no "
                               f"TPU needed): {e}") from None
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(name),
                                                topology="1x1x1")
    except NotImplementedError as e:  # JAX's words: "topology not implemented for cuda"
        raise RuntimeError(f"compiling for a GPU that is not here needs JAX's CUDA plugin (pip install "
                           f"'jax[cuda12]'; no GPU or driver needed), with JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 "
                           f"set before JAX starts: {e}") from None
    return topology.devices[0]


def aot_memory(model: str, points, targets, vocab: int) -> list:
    """On any host (no GPU or TPU needed): the training step compiled by XLA for each of `targets` (`TARGETS`
    names; `CompiledStep.bytes_for` a `target_device`) at each (precision, seq, batch) point, XLA's memory
    analysis of it beside `estimate_memory` with the coefficient set kbert uses there (`compiler_for`). There
    is no autotuning without the device, so these are not the device's own bytes (on an H100 and an H200, 0.97
    to 1.00 of them at the points measured on both); what they answer is how a change to kbert's program moves
    a device's bytes (the same description before and after), and how far the planner is from devices no
    session has had. A point whose step does not fit the device (a TPU's compiler says so) keeps its row with
    the error."""
    from kbert.train.memory import compiler_for
    from kbert.train.probe import CompiledStep, build_trainer, is_out_of_memory

    config, steps, rows = _config(model, vocab), {}, []
    for name in targets:
        device = target_device(name)
        compiler = compiler_for("tpu" if name in TPU_TARGETS else "gpu")
        for precision, seq, batch in points:
            if (precision, seq) not in steps:
                steps[precision, seq] = CompiledStep(build_trainer(config, "adamw", precision, abstract=True),
                                                     config, seq)
            try:
                compiled, error = steps[precision, seq].bytes_for(batch, device), None
            except Exception as e:  # noqa: BLE001 - only a step too large for the device keeps its row
                if not is_out_of_memory(e):
                    raise
                compiled, error = None, f"does not fit the device's memory: {str(e).splitlines()[0][:200]}"
            row = dict(planned_row(model, config, seq, batch, precision, compiled, compiler), target=name)
            rows.append(dict(row, error=error) if error else row)
    return rows


AOT_CHECK_POINTS = "mixed_bfloat16:128:256,float32:128:256"


def target_of(memory_rows):
    """The `GPU_TARGETS` name of the device the memory rows ran on (its JAX device kind), or None."""
    kinds = {r.get("device") for r in memory_rows or [] if isinstance(r, dict)}
    return next((name for name, t in GPU_TARGETS.items() if t["description"] in kinds), None)


def report_aot_check(memory_rows, aot_rows) -> None:
    """Each deviceless point beside the device's own compiled bytes at the same point (the `aot` stage of `all`)."""
    device = {(r["precision"], r["seq"], r["batch"]): r for r in memory_rows if r.get("compiled_bytes")}
    pairs = [(a, device.get((a["precision"], a["seq"], a["batch"]))) for a in _rows(aot_rows)
             if a.get("compiled_bytes")]
    pairs = [(a, d) for a, d in pairs if d]
    if pairs:
        print(f"\nXLA's GPU compiler for the '{pairs[0][0]['target']}' description with no GPU (`aot-memory`, which "
              f"projects program changes between device runs) vs this device's compiled step:")
        print("| precision | seq | batch | deviceless GB | device GB | deviceless / device |")
        print("|---|---:|---:|---:|---:|---:|")
        for a, d in pairs:
            print(f"| {a['precision']} | {a['seq']} | {a['batch']} | {_gb(a['compiled_bytes'])} | "
                  f"{_gb(d['compiled_bytes'])} | {a['compiled_bytes'] / d['compiled_bytes']:.3f} |")


def report_aot(rows) -> None:
    print(f"{'device (not here)':<17} {'precision':<15} {'seq':>4} {'batch':>5} {'planner GB':>10} "
          f"{'compiled GB':>11} {'planner vs compiled':>19}")
    for r in rows:
        if r.get("compiled_bytes") is None:
            print(f"{r['target']:<17} {r['precision']:<15} {r['seq']:>4} {r['batch']:>5} "
                  f"{_gb(r['planned_bytes']):>10} {r.get('error') or 'no memory analysis'}")
            continue
        print(f"{r['target']:<17} {r['precision']:<15} {r['seq']:>4} {r['batch']:>5} {_gb(r['planned_bytes']):>10} "
              f"{_gb(r['compiled_bytes']):>11} {r['error_vs_compiled']:>+19.1%}")
    for precision, (now, want) in suggest_act_bytes(rows).items():
        print(f"suggest_act_bytes {precision}: {now} now; {want} puts the planner at or above every point")


_HLO_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
                   "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_HLO_SHAPE = re.compile(r"\b(pred|[su](?:8|16|32|64)|bf16|f(?:16|32|64))\[([0-9,]*)\]")
_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*?)\)(.*)$")
_HLO_NOT_KERNELS = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id"}


def _hlo_bytes(types: str) -> int:
    """Bytes of the arrays an HLO type names: `bf16[256,128,768]{2,1,0}`, or a tuple of them."""
    return sum(_HLO_ITEM_BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
               for t, dims in _HLO_SHAPE.findall(types))


def _hlo_kind(op: str, rest: str, with_dots) -> str:
    """matmul, attention kernel or memory-bound; `with_dots`: the names of the computations holding a dot."""
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        target = target.group(1).lower() if target else ""
        if "fmha" in target or "attention" in target:
            return "attention kernel"
        return "matmul" if "gemm" in target or "matmul" in target else "memory-bound"
    if op in ("dot", "convolution"):
        return "matmul"
    backend = re.search(r'"kind":"([^"]+)"', rest) if op == "fusion" else None
    if backend and "gemm" in backend.group(1):  # XLA's Triton GEMM fusions (with their fused producers)
        return "matmul"
    called = re.search(r"calls=%([\w.\-]+)", rest) if op == "fusion" else None
    if called and called.group(1) in with_dots:  # a dot fused with its neighbours (XLA on a CPU)
        return "matmul"
    return "memory-bound"


def hlo_traffic(text: str, top: int = 12) -> dict:
    """What each kernel of XLA's optimized program (`compiled.as_text()`: the entry computation's fusions,
    custom calls and copies) reads and writes, from the shapes of its operands and results: bytes and kernel
    counts per kind (matmul, attention kernel, memory-bound), and the memory-bound bytes per model op (the
    op_name XLA keeps, with layer numbers folded: `jvp(layer_N)/dropout/...` is every block's). An upper bound
    on memory traffic (no cache reuse counted) that needs no device: it shows where a GPU program's
    memory-bound passes are and how a change to the model moves them, not their time."""
    body = re.search(r"^ENTRY .*?\{\n(.*?)^\}", text, re.S | re.M)
    if body is None:
        raise ValueError("no ENTRY computation in this HLO text (expected XLA's optimized module, as_text())")
    with_dots = {m.group(1) for m in re.finditer(r"^%?([\w.\-]+) \(.*?^\}", text, re.S | re.M)
                 if re.search(r" (dot|convolution)\(", m.group(0))}
    shapes, kinds, groups = {}, {}, {}
    for line in body.group(1).splitlines():
        m = _HLO_INSTRUCTION.match(line)
        if not m:
            continue
        name, types, op, operands, rest = m.groups()
        shapes[name] = _hlo_bytes(types)
        if op in _HLO_NOT_KERNELS:
            continue
        moved = shapes[name] + sum(shapes.get(o, 0) for o in re.findall(r"%([\w.\-]+)", operands))
        kind = _hlo_kind(op, rest, with_dots)
        count, total = kinds.get(kind, (0, 0))
        kinds[kind] = (count + 1, total + moved)
        if kind == "memory-bound":
            where = re.search(r'op_name="([^"]+)"', line)
            key = re.sub(r"^jit\([^)]*\)/", "", where.group(1)) if where else "(no op_name)"
            key = re.sub(r"layer_\d+", "layer_N", key)
            key = re.sub(r"(?<=[a-z])_\d+(?=/|$)", "", key)  # Keras' uniquifying suffixes: dropout_22, adam_w_1
            count, total = groups.get(key, (0, 0))
            groups[key] = (count + 1, total + moved)
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])
    return {"kernels": {k: c for k, (c, _) in kinds.items()}, "bytes": {k: b for k, (_, b) in kinds.items()},
            "memory_bound_by_op": [{"op": k, "kernels": c, "bytes": b} for k, (c, b) in ranked[:top]]}


def aot_traffic(model: str, seq: int, batch: int, precision: str, vocab: int, variants, target: str) -> list:
    """On any host (JAX's CUDA plugin, no GPU): the training step of each `variants` override set compiled by
    XLA's GPU compiler for the `target` description, and `hlo_traffic` of each program. Without the device
    there is no autotuning (every matmul is a Triton GEMM fusion here, where the device picks some cuBLAS
    calls), so the split of bytes between matmul kernels and their neighbours differs a little from the
    device's; the memory-bound passes and their sizes are the same program's."""
    from kbert.train.probe import CompiledStep, build_trainer

    device, rows = target_device(target), []
    for overrides in variants:
        config = _config(model, vocab, overrides)
        _switch_implementation(overrides)
        step = CompiledStep(build_trainer(config, "adamw", precision, abstract=True), config, seq)
        compiled = step.lower(batch, device=device).compile()
        rows.append(dict(hlo_traffic(compiled.as_text()), model=model, seq=seq, batch=batch, precision=precision,
                         target=target, overrides=list(overrides)))
    _switch_implementation(())
    return rows


def report_traffic(rows) -> None:
    """The `aot-traffic` rows: one line per variant (GB moved per kind; the memory-bound GB at the description's
    bandwidth as a floor in ms), then the largest memory-bound ops of each."""
    bandwidth = GPU_TARGETS.get(rows[0]["target"], {}).get("bandwidth") if rows and "target" in rows[0] else None
    print("| variant | matmul GB | attention kernel GB | memory-bound GB (kernels) | memory-bound ms at full "
          "bandwidth |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        gb, n = r["bytes"], r["kernels"]
        floor = f"{gb.get('memory-bound', 0) / bandwidth * 1e3:.2f}" if bandwidth else "n/a"
        print(f"| {','.join(r['overrides']) or 'default'} | {gb.get('matmul', 0) / 1e9:.2f} | "
              f"{gb.get('attention kernel', 0) / 1e9:.2f} | {gb.get('memory-bound', 0) / 1e9:.2f} "
              f"({n.get('memory-bound', 0)}) | {floor} |")
    for r in rows:
        print(f"\nlargest memory-bound ops, {','.join(r['overrides']) or 'default'} (GB, kernels):")
        for g in r["memory_bound_by_op"]:
            print(f"  {g['bytes'] / 1e9:7.2f} {g['kernels']:5d}  {g['op']}")


def probe(model: str, seqs, precision: str, vocab: int) -> list:
    from kbert.train.probe import probe_table

    return probe_table(_config(model, vocab), seqs, optimizer="adamw", precision=precision, verbose=True)


def _device_bytes() -> int:
    """Total memory of GPU 0 from nvidia-smi (the parent must not start JAX: it would take the memory)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.split()[0]) * 2 ** 20
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0


class _Clock:
    def __init__(self, budget: float):
        self.end = time.perf_counter() + budget

    def left(self) -> float:
        return self.end - time.perf_counter()


def make_records(shared: str, out: str, rows: int = 150_000, vocab: int = 32000) -> dict:
    """Here, beside ../shared/data: a WordPiece vocabulary and mlm+nsp records (length 128) of the first `rows` movie
    reviews, under `out/tok` and `out/records`."""
    import csv
    import gzip

    import kbert
    from kbert.data import records

    source = os.path.join(shared, "movie-reviews", "reviews.tsv.gz")
    os.makedirs(out, exist_ok=True)
    subset = os.path.join(out, "reviews-subset.tsv")
    with gzip.open(source, "rt", encoding="utf-8") as f, open(subset, "w", encoding="utf-8") as w:
        reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        w.write("movie_id\ttext\n")
        for i, row in enumerate(reader):
            if i >= rows:
                break
            w.write(f"{row['movie_id']}\t{(row.get('text') or '').strip()}\n")
    corpus = kbert.corpus([subset], format="tsv", column="text", group_by="movie_id")
    tok = kbert.Tokenizer.train(corpus, vocab_size=vocab, algorithm="wordpiece", progress=False)
    tok.save(os.path.join(out, "tok"))
    manifest = records.prepare(corpus, tok, os.path.join(out, "records"), max_length=128, docs_per_shard=256,
                               progress=False)
    os.remove(subset)
    size = sum(os.path.getsize(os.path.join(out, "records", f)) for f in os.listdir(os.path.join(out, "records")))
    return {"examples": manifest["examples"], "megabytes": round(size / 1e6, 1), "vocab": tok.vocab_size}


def pretrain_check(records: str, tokenizer: str, model: str, batch: int, steps: int, precision: str,
                   out: str, synthetic_steps: int = 60) -> dict:
    """`kbert.pretrain` on records with a resume in the middle, and the same step on a synthetic batch."""
    import itertools

    import jax

    from kbert.data.masking import default_max_predictions
    from kbert.text.tokenizer import Tokenizer
    from kbert.train.backend import make_backend
    from kbert.train.backend.jax import use_compilation_cache
    from kbert.train.config import PretrainConfig
    from kbert.train.loop import _model_config, build_model_and_optimizer, pretrain
    from kbert.train.run_checkpoint import RunCheckpoints

    # The resumed run compiles the same step again (and the synthetic timing a third time): JAX's persistent
    # compilation cache turns those full XLA compilations into reads (kbert.pretrain's `auto` keeps this dir;
    # set here, and made to take effect after the stages before this one compiled, in `all`)
    if not jax.config.jax_compilation_cache_dir:
        use_compilation_cache(os.path.join(out, "jax-cache"))
    half = steps // 2
    cfg = {"model": model, "data": {"source": records, "tokenizer": tokenizer},
           "optimizer": {"learning_rate": 1e-4, "warmup_steps": 20},
           "trainer": {"steps": steps, "batch_size": batch, "checkpoint_every": half, "log_every": 10},
           "runtime": {"precision": precision, "seed": 0}, "output_dir": os.path.join(out, "pretrain-run")}
    t = time.perf_counter()
    first = pretrain(cfg, progress=False, stop_after=half + 1)  # a checkpoint at `half`, then one step more
    ckpt = RunCheckpoints(os.path.join(cfg["output_dir"], "checkpoints"))
    os.remove(ckpt.path(half + 1))  # resume from `half`: its next step must repeat the step just taken
    second = pretrain(cfg, progress=False)
    wall = time.perf_counter() - t
    history = first["history"][:half] + second["history"]
    # the same compiled step fed one device-resident batch: what the step costs without any input
    config = PretrainConfig.from_dict(cfg)
    backend = make_backend(config.runtime)
    policy = backend.precision(precision)
    config.data.max_length = 128
    model_config = _model_config(config, Tokenizer.load(tokenizer))
    net, optimizer, variables = build_model_and_optimizer(config, model_config, policy, backend)
    flops = train_flops_per_step(model_config, batch, 128, default_max_predictions(128),
                                 pretrainer_last_layer_rows(default_max_predictions(128)))
    data = dict(source=records, tokenizer=Tokenizer.load(tokenizer), objective="mlm+nsp", max_length=128,
                mask_rate=0.15, max_predictions=None, whole_word=True, ngram=1, short_seq_prob=0.1, seed=0,
                shuffle_buffer=10_000, workers=0)
    fed = backend.batches(data, batch, 0, 1)  # the reader, as the run reads it
    one = next(fed)
    step = backend.compile_step(net, optimizer, variables, 1, policy)

    def rate(batches) -> float:
        """tokens/s of `synthetic_steps` steps after three warm-up steps (waited for: the step is dispatched
        asynchronously, and a timer started over queued steps would count their time too)."""
        for _ in range(3):
            metrics = step(batches)
        jax.block_until_ready(metrics)
        s = time.perf_counter()
        for _ in range(synthetic_steps):
            metrics = step(batches)
        jax.block_until_ready(metrics)
        return synthetic_steps * batch * 128 / (time.perf_counter() - s)

    synthetic = rate(itertools.repeat(one))  # the step alone, on one batch already on the device
    reader_fed = rate(fed)  # the same step fed by the reader, without the loop's bookkeeping
    return {"impl": "kbert-pretrain", "model": model, "batch": batch, "seq": 128, "steps": steps,
            "precision": second["precision"], "device": second["device"], "backend": second["backend"],
            "loss_first10": sum(history[:10]) / 10, "loss_last10": sum(history[-10:]) / 10,
            "resumed_step_loss": second["history"][0], "uninterrupted_step_loss": first["history"][half],
            "resume_abs_diff": abs(second["history"][0] - first["history"][half]),
            "records_tokens_per_s": second["steady_tokens_per_second"], "synthetic_tokens_per_s": synthetic,
            "records_vs_synthetic": second["steady_tokens_per_second"] / synthetic,
            "reader_fed_tokens_per_s": reader_fed, "reader_fed_vs_synthetic": reader_fed / synthetic,
            "mfu": second["mfu"], "host_waited_fraction": second.get("host_waited_fraction"),
            "model_flops_per_step": flops, "wall_s": wall}


def _child(args, extra, clock: _Clock, needs: float = 60, env=None):
    """Runs one measurement in a fresh process (JAX's peak memory counter is per process); skipped when fewer
    than `needs` seconds of the budget are left, and stopped at the budget."""
    if clock.left() < needs:
        print(f"# skipped (budget): {' '.join(extra)}", flush=True)
        return {"error": "skipped: time budget", "cmd": extra}
    cmd = [sys.executable, os.path.abspath(__file__), *extra, "--vocab", str(args.vocab), "--json"]
    print("$", " ".join(cmd[2:]), flush=True)
    t = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **(env or {})),
                              timeout=max(10, min(args.child_timeout, clock.left())))
    except subprocess.TimeoutExpired as e:
        print(f"   timed out after {time.perf_counter() - t:.0f} s", (e.stderr or b"")[-1500:], flush=True)
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        partial = [line for line in out.splitlines() if line.startswith("[")]
        if partial:  # a stage that prints its rows as it goes (throughput's variants): keep the ones it finished
            return json.loads(partial[-1]) + [{"error": "timeout: the budget ended here", "cmd": extra}]
        return {"error": "timeout", "cmd": extra}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{") or line.startswith("[")]
    if done.returncode or not lines:
        print(done.stdout[-2000:], done.stderr[-3000:], flush=True)
        return {"error": f"exit {done.returncode}", "cmd": extra}
    result = json.loads(lines[-1])
    print(f"   ({time.perf_counter() - t:.0f} s)", json.dumps(result)[:600], flush=True)
    return result


def _save(args, out):
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu.json"), "w") as f:
            json.dump(out, f, indent=1, default=str)


def _children(args, extras, clock: _Clock, needs: float, env=None) -> list:
    """Several measurements at once, each in its own process (for memory points, whose allocator peaks are
    per process and whose time is nearly all XLA compilation on the host's cores); the GPU must hold them
    together, so each child allocates on demand instead of taking its fraction up front."""
    from concurrent.futures import ThreadPoolExecutor

    env = dict(env or {}, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    with ThreadPoolExecutor(len(extras)) as pool:
        return list(pool.map(lambda extra: _child(args, extra, clock, needs, env), extras))


# Memory points (precision, seq, batch), most telling first.
MEMORY_POINTS = (("mixed_bfloat16", 128, 256), ("float32", 128, 256), ("mixed_bfloat16", 512, 64),
                 ("mixed_bfloat16", 128, 32))


def memory_rounds(model: str, vocab: int, device_bytes: int, points=MEMORY_POINTS, share: float = 0.8,
                  per_process: int = 2 << 30) -> list:
    """The memory points in rounds of processes run at once (each point's time is nearly all XLA compilation
    on the host's many cores): a round takes points in order while their planned peaks, plus `per_process`
    for each one's CUDA context and workspaces, stay within `share` of the device's memory. An H200 (141 GB)
    holds all four BERT-Base points (about 74 GB planned) in one round, an 80 GB H100 two rounds of two; with
    the device's memory unknown, two at a time."""
    from kbert.train.memory import estimate_memory

    if not device_bytes:
        return [list(points[i:i + 2]) for i in range(0, len(points), 2)]
    config = _config(model, vocab)
    rounds, used = [], None
    for precision, seq, batch in points:
        need = estimate_memory(config, batch, seq, optimizer="adamw", precision=precision)["total"] + per_process
        if used is None or used + need > share * device_bytes:
            rounds.append([])
            used = 0
        rounds[-1].append((precision, seq, batch))
        used += need
    return rounds


# XLA's GPU options that may fuse the step's memory-bound passes (the elementwise and reduction kernels of the
# profile) into or around the matmuls. Each set is one process's XLA_FLAGS. The default: the one set not yet
# measured (cuDNN GEMM fusions), then cuDNN's LayerNorm with cuBLASLt's bias/GELU epilogues together (each alone
# moved nothing on an H200; benchmarks/README.md lists what was tried). Checked against jaxlib's flag list on CPU
# (an unknown flag aborts the process at start).
XLA_VARIANTS = ("--xla_gpu_cudnn_gemm_fusion_level=2;"
                "--xla_gpu_enable_cudnn_layer_norm=true --xla_gpu_enable_cublaslt=true")


def xla_variants(spec: str) -> list:
    """`--xla-variants`: ';'-separated sets of XLA flags (space-separated within a set); '' or 'none': no sets."""
    sets = [v.strip() for v in (spec or "").split(";") if v.strip()]
    if sets == ["none"]:
        return []
    for flags in sets:
        bad = [f for f in flags.split() if not f.startswith("--xla_")]
        if bad:
            raise ValueError(f"--xla-variants: {bad[0]!r} is not an XLA flag (expected --xla_name=value)")
    return sets


def run_all(args) -> dict:
    """The stages, most important first; a stage that would not finish inside `--budget` is skipped, so a
    short device lease still returns the figures that matter most. Each capped sequence length is its own
    process, so that a budget cut loses one row, not the table."""

    clock = _Clock(args.budget)
    m, b, steps = args.model, str(args.batch), str(args.steps)
    skip = set(args.skip_stages)
    out = {"peak": _child(args, ["peak", "--peak-n", str(args.peak_n)], clock, 20)}
    if args.records:
        from scratch import scratch_dir  # benchmarks/scratch.py: removed at exit
        run_dir = scratch_dir(prefix="kbert-gpu-pretrain-")  # checkpoints of ~1.3 GB stay off --out
        out["pretrain"] = _child(args, ["pretrain", "--model", m, "--batch", b, "--records", args.records,
                                        "--steps-pretrain", str(args.steps_pretrain), "--out", run_dir], clock, 150)
        _save(args, out)
    step_args = ["--model", m, "--seq", "128", "--batch", b, "--steps", steps, "--variants", args.variants]
    out["throughput"] = None if "throughput" in skip else _child(
        args, ["throughput", *step_args, "--precision", "mixed_bfloat16"], clock, 90)
    out["hf"] = None if "hf" in skip else _child(args, ["hf", *step_args, "--hf-modes", args.hf_modes], clock, 120)
    _save(args, out)
    out["memory"] = []
    total = _device_bytes()
    for points in () if "memory" in skip else memory_rounds(m, args.vocab, total):
        out["memory"] += _children(args, [["memory", "--model", m, "--seq", str(seq), "--batch", str(batch),
                                           "--precision", p] for p, seq, batch in points], clock, 60)
        _save(args, out)
    from kbert.train.memory import parse_memory

    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{min(0.95, parse_memory(args.cap) / total):.4f}"} if total else {}
    out["capped"] = []
    for precision in () if "capped" in skip else args.cap_precisions.split(","):
        for seq in args.cap_seqs.split(","):
            out["capped"].append(_child(args, ["capped", "--model", m, "--seqs", seq, "--precision", precision,
                                               "--cap", args.cap, "--shallow", args.shallow], clock, 100, env))
            _save(args, out)
    # before/after figures of kbert's own code paths (the speed goal's open questions), each beside the default
    # step timed again in the same process; the rows finished when the budget ends are kept
    out["ablations"] = None if not args.ablations or "ablations" in skip else _child(
        args, ["throughput", "--model", m, "--seq", "128", "--batch", b, "--precision", "mixed_bfloat16", "--steps",
               steps, "--variants", "default;" + args.ablations], clock, 60)
    _save(args, out)
    # the memory stage's two largest points compiled again for this GPU's description with no GPU (`aot-memory`,
    # a CPU process): how far the deviceless bytes, which project program changes between device runs, are from
    # this device's own
    target = target_of(out["memory"])
    out["aot"] = None if "aot" in skip or target is None else _child(
        args, ["aot-memory", "--model", m, "--targets", target, "--points", AOT_CHECK_POINTS], clock, 90)
    _save(args, out)
    # last: a diagnosis for the speed work, not a figure an issue asks for
    out["profile"] = None if "profile" in skip else _child(
        args, ["profile", "--model", m, "--seq", "128", "--batch", b, "--precision", "mixed_bfloat16", "--steps", "5"],
        clock, 45)
    _save(args, out)
    out["xla"] = []
    for flags in args.xla_sets:
        env = {"XLA_FLAGS": " ".join(filter(None, (os.environ.get("XLA_FLAGS", ""), flags)))}
        # the same model variants as the throughput stage, so each flag set is compared with its own default
        rows = _child(args, ["throughput", "--model", m, "--seq", "128", "--batch", b, "--precision",
                             "mixed_bfloat16", "--steps", steps, "--variants", args.variants], clock, 60, env)
        out["xla"] += rows if isinstance(rows, list) else [dict(rows, xla_flags=flags)]
        _save(args, out)
    out["lora"] = None if "lora" in skip else _child(
        args, ["lora", "--model", m, "--lora-points", args.lora_points, "--precision", "mixed_bfloat16"], clock, 120)
    _save(args, out)
    report(out)
    return out


def lora(points: str, seq: int, precision: str) -> list:
    """LoRA against full fine-tuning (`benchmarks/lora_memory.py`'s step): XLA's plan at each `preset:vocab:batch`
    point, and the last point's step time, each with and without rank-8 factors."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from lora_memory import step_bytes, step_seconds

    parsed = [(p, int(v), int(b)) for p, v, b in (point.split(":") for point in points.split(","))]
    rows = []
    for preset, vocab, batch in parsed:
        for rank in (None, 8):
            row = {"preset": preset, "vocab": vocab, "batch": batch, "seq": seq, "precision": precision,
                   "lora_rank": rank, "device": str(__import__("jax").devices()[0].device_kind)}
            try:
                row.update(step_bytes(preset, batch, seq, rank, vocab, precision))
                if (preset, vocab, batch) == parsed[-1]:
                    row["step_s"] = step_seconds(preset, batch, seq, rank, vocab, precision)
            except Exception as e:  # noqa: BLE001 - one point's failure (out of memory) is its row
                row["error"] = _error_text(e)
            rows.append(row)
    return rows


def _rows(value):
    if isinstance(value, list):
        return [r for r in value if isinstance(r, dict)]
    return [value] if isinstance(value, dict) and "error" not in value else []


def _model_key(row: dict) -> tuple:
    """A row's model overrides without kbert's code-path switches: the HF row a kbert row is compared with
    (HF has no such switches, so `hf` runs each model once)."""
    overrides = row.get("overrides") or []
    return tuple(o for o in overrides if o.split("=", 1)[0] not in _implementation_choices(overrides))


def _gb(n) -> str:
    return f"{n / 1e9:.2f}" if n else "n/a"


def _mfu(row: dict, peak_bf16) -> str:
    return f"{row['model_flops_per_s'] / peak_bf16 * 100:.1f}%" if peak_bf16 else "n/a"


def report_lora(rows) -> None:
    """The `lora` stage's table: each point's plan with and without LoRA, and the timed point's step."""
    rows = [r for r in rows or [] if isinstance(r, dict)]
    if not rows:
        return
    gb = 1024 ** 3
    print(f"\nLoRA r=8 against full fine-tuning ({rows[0]['device']}, {rows[0]['precision']}, seq {rows[0]['seq']}; "
          f"XLA's plan of the step, benchmarks/lora_memory.py):")
    print("| model (weights) | batch | fine-tuning | weights trained | XLA plan: arguments | temporaries | total | "
          "vs full | step s |\n|---|---:|---|---:|---:|---:|---:|---:|---:|")
    full = {}
    for r in rows:
        key = (r["preset"], r["vocab"], r["batch"])
        name = "full" if r["lora_rank"] is None else f"LoRA r={r['lora_rank']}"
        if "error" in r:
            print(f"| {r['preset']} (vocab {r['vocab']}) | {r['batch']} | {name} | {r['error'][:80]} | | | | | |")
            continue
        full.setdefault(key, r if r["lora_rank"] is None else None)
        base = full.get(key)
        ratio = f"{r['total'] / base['total']:.2f}x" if base else "n/a"
        step = f"{r['step_s']:.4f}" if r.get("step_s") else ""
        print(f"| {r['preset']} ({r['weights'] / 1e6:.0f}M) | {r['batch']} | {name} | {r['trained'] / 1e6:.2f}M | "
              f"{r['arguments'] / gb:.2f} GB | {r['temporaries'] / gb:.2f} GB | {r['total'] / gb:.2f} GB | {ratio} | "
              f"{step} |")


def report_ablations(rows, compiled: dict, peak_bf16) -> None:
    """The `ablations` stage: each code-path switch beside the default step of the same process."""
    rows = _rows(rows)
    base = next((r for r in rows if not r.get("overrides") and "tokens_per_s" in r), None)
    if not rows:
        return
    print("\nkbert's code paths, each beside the default step timed in the same process (`--ablations`):")
    print("| overrides | step ms | tokens/s | MFU (of bf16 peak) | vs the default | vs HF compiled |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        key = " ".join(r.get("overrides") or []) or "default"
        if "tokens_per_s" not in r:
            print(f"| {key} | | | | | did not run: {r.get('error', '?')} |")
            continue
        vs = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}" if base else "n/a"
        hf_ratio = f"{r['tokens_per_s'] / compiled[_model_key(r)]:.2f}x" if _model_key(r) in compiled else "n/a"
        print(f"| {key} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {_mfu(r, peak_bf16)} | {vs} | {hf_ratio} |")


def report(out: dict):
    run = out.get("pretrain")
    peak = out.get("peak") or {}
    peak_bf16, peak_fp32 = peak.get("bfloat16"), peak.get("float32")
    if isinstance(run, dict) and "records_tokens_per_s" in run:
        # against the bf16 peak measured in this run, as the throughput table (`mfu` from kbert.pretrain itself
        # is against the device's data-sheet peak)
        per_s = run["records_tokens_per_s"] / (run["batch"] * run["seq"]) * run.get("model_flops_per_step", 0)
        mfu = f"{100 * per_s / peak_bf16:.1f}%" if peak_bf16 and per_s else "n/a"
        if run.get("mfu"):
            mfu += f" ({100 * run['mfu']:.1f}% of the data sheet's)"
        print(f"\nkbert.pretrain on records ({run['device']}, {run['model']}, seq {run['seq']}, batch {run['batch']}, "
              f"{run['precision']}, {run['steps']} steps resumed at {run['steps'] // 2}):")
        fed = run.get("reader_fed_tokens_per_s")
        print("| kbert.pretrain on records, tokens/s | the step on one repeated batch | ratio | the step fed by the "
              "reader, no loop | ratio | MFU | loss first 10 -> last 10 | resumed step loss vs uninterrupted "
              "| wall s |")
        print("|---:|---:|---:|---:|---:|---:|---|---|---:|")
        print(f"| {run['records_tokens_per_s']:,.0f} | {run['synthetic_tokens_per_s']:,.0f} | "
              f"{run['records_vs_synthetic']:.3f} | {f'{fed:,.0f}' if fed else 'n/a'} | "
              f"{run.get('reader_fed_vs_synthetic', 0):.3f} | {mfu} | {run['loss_first10']:.3f} -> "
              f"{run['loss_last10']:.3f} | {run['resumed_step_loss']:.5f} vs {run['uninterrupted_step_loss']:.5f} | "
              f"{run['wall_s']:.0f} |")
        if run.get("host_waited_fraction") is not None:
            print(f"(the run's host waited for the device {100 * run['host_waited_fraction']:.0f}% of its steady time: "
                  f"near 100% means the device was the bottleneck, not the reader or the loop)")
    runs = _rows(out.get("throughput")) + _rows(out.get("hf"))
    device = next((r.get("device") for r in runs if r.get("device")), "?")
    if peak_bf16:
        print(f"\ndevice: {device}; measured matmul peak: bf16 {peak_bf16 / 1e12:.3g} TFLOP/s, fp32 (default "
              f"precision) {(peak_fp32 or 0) / 1e12:.3g} TFLOP/s")  # 3 digits: a CPU's peak is a fraction of one
    compiled = {_model_key(r): r["tokens_per_s"] for r in runs if r.get("impl") == "hf-compile"}
    # memory at the same shape: what a user choosing between the two can fit (kbert: XLA's program, which the
    # allocator's peak matches within tens of MB; HF: torch's allocator peak; none on a CPU's torch)
    print("\n| implementation | overrides | seq | batch | step ms | tokens/s | MFU (of bf16 peak) | vs HF compiled |"
          " memory GB | fused attention |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in runs:
        if "tokens_per_s" not in r:
            if r.get("error"):  # a variant that did not run keeps its row, with the reason
                print(f"| {r.get('impl', '?')} | {' '.join(r.get('overrides') or []) or 'BERT defaults'} | | | | | | "
                      f"| | did not run: {r['error']} |")
            continue
        key = tuple(r.get("overrides") or [])
        mfu = _mfu(r, peak_bf16)
        ratio = f"{r['tokens_per_s'] / compiled[_model_key(r)]:.2f}x" if _model_key(r) in compiled else "n/a"
        print(f"| {r['impl']} | {' '.join(key) or 'BERT defaults'} | {r['seq']} | {r['batch']} | {r['step_ms']:.1f} | "
              f"{r['tokens_per_s']:,.0f} | {mfu} | {ratio} | {_gb(r.get('step_bytes'))} | "
              f"{r.get('fused_attention', '')} |")
    check = next((r["dropout_check"] for r in _rows(out.get("throughput")) if "dropout_check" in r),
                 out.get("dropout_check"))
    if isinstance(check, dict):
        print("\nattention dropout inside cuDNN's kernel (`dropout-check`" + (
            f"): not run: {check['error']}" if "error" in check else
            f", q, k, v {check['shape']}, rate {check['rate']}): " + (
                "it is dropout" if check["ok"] else "**it is not dropout: ignore the attention_kernel=cudnn_dropout "
                                                    "row**")))
        if "error" not in check:
            print("| fused | kept entries vs softmax / (1 - rate), max rel. error | share dropped | backward vs "
                  "A^T dO, rel. error (without the mask) | masks differ: between steps | between call sites |")
            print("|---|---:|---:|---:|---:|---:|")
            print(f"| {check['fused']} | {check['kept_max_rel_error']:.4f} | {check['dropped_share']:.4f} | "
                  f"{check['backward_rel_error']:.4f} ({check['backward_rel_error_without_dropout']:.4f}) | "
                  f"{check['differs_between_steps']:.4f} | {check['differs_between_call_sites']:.4f} |")
    prof = out.get("profile")
    if isinstance(prof, dict) and "kinds" in prof:
        print(f"\nwhere the step's device time goes ({prof['device']}, {prof['model']}, seq {prof['seq']}, batch "
              f"{prof['batch']}, {prof['precision']}, {' '.join(prof['overrides']) or 'BERT defaults'}; "
              f"{prof['source']}): kernels {prof['kernel_ms_per_step']:.1f} ms of a {prof['step_ms']:.1f} ms step")
        print("| kind | ms per step | share |\n|---|---:|---:|")
        for kind, v in prof["kinds"].items():
            print(f"| {kind} | {v['ms_per_step']:.2f} | {100 * v['share']:.1f}% |")
        print("| kernel | kind | ms per step | share |\n|---|---|---:|---:|")
        for v in prof["top"]:
            print(f"| `{v['kernel']}` | {v['kind']} | {v['ms_per_step']:.2f} | {100 * v['share']:.1f}% |")
    report_ablations(out.get("ablations"), compiled, peak_bf16)
    xla_rows = [r for r in _rows(out.get("xla")) if "tokens_per_s" in r]
    if xla_rows:
        # each flag set against the same model variant with no flags (the throughput stage of this run)
        base = {tuple(r.get("overrides") or []): r for r in _rows(out.get("throughput")) if "tokens_per_s" in r}
        print("\n| XLA flags | overrides | step ms | tokens/s | MFU (of bf16 peak) | vs no flags | vs HF compiled |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for r in list(base.values()) + xla_rows:
            key = tuple(r.get("overrides") or [])
            ratio = f"{r['tokens_per_s'] / base[key]['tokens_per_s']:.3f}" if key in base else "n/a"
            hf_ratio = f"{r['tokens_per_s'] / compiled[_model_key(r)]:.2f}x" if _model_key(r) in compiled else "n/a"
            print(f"| {r.get('xla_flags') or 'none'} | {' '.join(key) or 'BERT defaults'} | {r['step_ms']:.1f} | "
                  f"{r['tokens_per_s']:,.0f} | {_mfu(r, peak_bf16)} | {ratio} | {hf_ratio} |")
    # a host whose allocator reports no peak (a CPU dry run) still has XLA's compiled bytes to set the plan beside
    memory_rows = [r for r in out.get("memory", []) if r.get("measured_bytes") or r.get("compiled_bytes")]
    if memory_rows:
        print("\n| model | seq | batch | precision | planned GB | XLA compiled GB | allocator peak GB | planned vs "
              "compiled | planned vs peak |")
        print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
        for r in memory_rows:
            c, peak_bytes = r.get("compiled_bytes"), r.get("measured_bytes")
            peak_gb, vs_peak = ("n/a", "n/a") if not peak_bytes else (
                f"{peak_bytes / 1e9:.2f}", f"{r['error'] * 100:+.1f}%")
            print(f"| {r['model']} | {r['seq']} | {r['batch']} | {r['precision']} | {r['planned_bytes'] / 1e9:.2f} | "
                  f"{(c or 0) / 1e9:.2f} | {peak_gb} | {(r['error_vs_compiled'] or 0) * 100:+.1f}% | {vs_peak} |")
    suggested = suggest_act_bytes(memory_rows)
    for precision, (now, needed) in suggested.items():
        print(f"bytes per activation element ({precision}) that put the planner at or just above every "
              f"compiled point here: {needed:.2f} (the `xla` set has {now:.2f})")
    report_aot_check(memory_rows, out.get("aot"))
    capped_rows = [r for rows in out.get("capped", []) for r in _rows(rows) if "seq_len" in r]
    if capped_rows:
        # the refit the memory points suggest, checked on the capped probes (other shapes, the same run)
        print("\n| model | precision | cap | seq | `plan --memory` batch | `--exact` batch | probed batch | plan / probed |"
              " refit plan / probed | exact GB | compiled (rounds) | tries (batch, fits) |"
              " seconds: search (process; start-up) |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|")
        for r in capped_rows:
            probed = r.get("probed_batch")
            ratio = f"{r['plan_for_cap'] / probed:.2f}" if probed else "n/a"
            refit = "n/a"
            if r["precision"] in suggested and suggested[r["precision"]][0] != suggested[r["precision"]][1]:
                batch = refit_plan(r, suggested[r["precision"]][1])
                refit = f"{batch} ({batch / probed:.2f})" if probed else str(batch)
            tries = " ".join(f"{b}{'+' if ok else '-'}" for b, ok, _ in r.get("tried", []))
            compiled = " ".join(str(b) for b, _ in r.get("exact_tried", [])) + f" ({r.get('exact_rounds', '-')})"
            early = r.get("exact_shallow")
            if early:  # the start the 1- and 2-layer copies predicted, and what their compilations took
                compiled = f"1-2 layers: {early['predicted_batch']} in {early['seconds']:.0f} s; {compiled}"
            print(f"| {r['model']} | {r['precision']} | {r['cap']} | {r['seq_len']} | {r['plan_for_cap']} | "
                  f"{r.get('exact_batch')} | {probed} | {ratio} | {refit} | {(r.get('exact_bytes') or 0) / 1e9:.2f} | "
                  f"{compiled} | {tries} | {r.get('seconds', 0):.0f}{_process_seconds(r)} |")
    report_lora(out.get("lora"))


def _act_field(precision: str) -> str:
    """The `MemoryCoefficients` field of bytes per activation element for `precision`."""
    return "float32_act_bytes" if precision == "float32" else "mixed_act_bytes"


def suggest_act_bytes(memory_rows) -> dict:
    """{precision: (the `xla` set's bytes per activation element (a row's own `compiler` set where it names
    one, keyed "precision (set)"), the value that would put the planner at or just above every compiled point
    of `memory_rows`)}, rounded up to 0.05. The planner is the state and workspace (fixed) plus activation
    terms proportional to that coefficient (the masked-LM logits too), so each point asks for coefficient x
    (compiled - fixed) / (planned - fixed); the largest over the points keeps the plan on the side of fitting
    everywhere. For a refit after the program changes (a device run's `memory` stage), not a per-row fit."""
    import math

    from kbert.train.memory import COMPILERS

    needed = {}
    for r in memory_rows:
        compiled, parts = r.get("compiled_bytes"), r.get("components") or {}
        if not compiled or "weights_grads_slots" not in parts:
            continue
        fixed = parts["weights_grads_slots"] + parts["workspace"]
        compiler = r.get("compiler", "xla")
        now = getattr(COMPILERS[compiler], _act_field(r["precision"]))
        want = now * (compiled - fixed) / (r["planned_bytes"] - fixed)
        key = r["precision"] if compiler == "xla" else f"{r['precision']} ({compiler} set)"
        needed[key] = (now, max(want, needed.get(key, (now, 0.0))[1]))
    return {p: (now, math.ceil(want * 20 - 1e-9) / 20) for p, (now, want) in needed.items()}


def refit_plan(row, act_bytes: float) -> int:
    """`kbert plan --memory <cap>`'s batch for a capped row with the `xla` set's bytes per activation element
    (of the row's precision) replaced by `act_bytes`."""
    import dataclasses

    from kbert.train import memory

    refit = {_act_field(row["precision"]): act_bytes}
    memory.COMPILERS["xla-refit"] = dataclasses.replace(memory.COMPILERS["xla"], **refit)
    try:
        (plan,) = memory.plan_batch_size(_config(row["model"], row.get("vocab", 32000)), row["cap"],
                                         [row["seq_len"]], optimizer="adamw", precision=row["precision"],
                                         compiler="xla-refit")
    finally:
        del memory.COMPILERS["xla-refit"]
    return plan["max_batch"]


def _process_seconds(row) -> str:
    """' (104; 23 model)': the capped process's whole time, and its model's build, where recorded."""
    if "process_seconds" not in row:
        return ""
    return f" ({row['process_seconds']:.0f}; {row.get('startup_seconds', 0):.0f} model)"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("all", "peak", "throughput", "hf", "profile", "memory", "probe", "capped",
                                         "attention", "dropout-check", "preflight", "pretrain", "records",
                                         "lora", "aot-memory", "aot-traffic"))
    parser.add_argument("--records", help="pretrain/all: the dir `records` wrote (records/ and tok/ inside)")
    parser.add_argument("--steps-pretrain", type=int, default=300, help="pretrain: steps, resumed at half")
    parser.add_argument("--shared", default="../shared/data", help="records: the shared Korean data")
    parser.add_argument("--rows", type=int, default=150_000, help="records: movie reviews read")
    parser.add_argument("--model", default="bert-base")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--seqs", default="128,512")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--precision", default="mixed_bfloat16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--set", action="append", default=[],
                        help="ModelConfig override, e.g. attention_dropout=0 (repeat it, or join with ',')")
    parser.add_argument("--hf-modes", default="eager,compile", help="hf: modes of the first variant (later "
                        "variants: compile only)")
    parser.add_argument("--variants", default="default;dropout_masks=generator;attention_dropout=0.0;"
                                              "attention_dropout=0.0,attention=explicit",
                        help="throughput/hf/all: ';'-separated override sets ('default' = none; ',' joins "
                             "several overrides in one set; NAME=CHOICE items of kbert.models.layers.IMPLEMENTATIONS switch kbert code paths)")
    parser.add_argument("--xla-variants", default=XLA_VARIANTS,
                        help="all: ';'-separated sets of XLA flags, each timed in its own throughput process "
                             "after the profile ('none': skip); write it --xla-variants=--xla_..., as the value "
                             "starts with '--'")
    parser.add_argument("--targets", default="h100,h200",
                        help="aot-memory: devices to compile for, none of which needs to be here: "
                        + ", ".join(TARGETS) + " (GPUs with JAX's CUDA plugin, TPUs with libtpu; aot-traffic: "
                        "the first)")
    parser.add_argument("--points", default=",".join(":".join(map(str, p)) for p in MEMORY_POINTS),
                        help="aot-memory: precision:seq:batch points, ','-separated")
    parser.add_argument("--cap", default="12GB", help="capped/all: the memory the GPU is capped at")
    parser.add_argument("--cap-seqs", default="128,512", help="all: sequence lengths of the capped table")
    parser.add_argument("--cap-precisions", default="mixed_bfloat16", help="all: precisions of the capped table")
    parser.add_argument("--shallow", choices=("auto", "on", "off"), default="auto",
                        help="capped/all: start `--exact` from 1- and 2-layer copies of the model (auto: kbert's "
                             "default, on for 6+ layers on an accelerator); off measures the search without them")
    parser.add_argument("--peak-n", type=int, default=8192, help="matrix size of the peak measurement")
    parser.add_argument("--skip", default="", help="all: stages to leave out, ','-separated (throughput, hf, "
                        "memory, capped, aot, ablations, profile, lora), for a device run aimed at one question")
    parser.add_argument("--ablations", default="",
                        help="all: ';'-separated override sets timed after the capped table, each beside the default "
                             "step in the same process (before/after figures of kbert's code paths, e.g. "
                             "dropout_masks=hash2), so that they never cost the stages before")
    parser.add_argument("--lora-points", default="bert-large:250002:8,MODEL:VOCAB:32",
                        help="lora: preset:vocab:batch points of the memory plans (MODEL, VOCAB: --model, --vocab); "
                             "the last is also timed")
    parser.add_argument("--budget", type=float, default=480, help="all: seconds; later stages are skipped past it")
    parser.add_argument("--child-timeout", type=int, default=300)
    parser.add_argument("--out", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    variants = [[] if v.strip() in ("", "default") else v.split(",") for v in args.variants.split(";")]
    args.set = [item for joined in args.set for item in joined.split(",") if item]
    if args.what == "all":
        args.xla_sets = xla_variants(args.xla_variants)  # a malformed set fails here, before any device time
        args.skip_stages = [s for s in args.skip.split(",") if s]
        unknown = set(args.skip_stages) - {"throughput", "hf", "memory", "capped", "aot", "ablations", "profile",
                                            "lora"}
        if unknown:
            parser.error(f"--skip: unknown stage(s) {sorted(unknown)}; stages: throughput, hf, memory, capped, "
                         f"aot, ablations, profile, lora")
        run_all(args)
        return
    if args.what == "peak":
        result = {"bfloat16": matmul_peak("bfloat16", args.peak_n), "float32": matmul_peak("float32", args.peak_n)}
    elif args.what == "throughput":
        sets = [args.set] if args.set else variants
        result = []
        for overrides in sets:
            if "attention_kernel=cudnn_dropout" in overrides:  # its step time means something only if this holds
                try:
                    result.append({"dropout_check": dropout_check()})
                except Exception as e:  # noqa: BLE001 - no cuDNN here: the check's row says why
                    result.append({"dropout_check": {"form": "cudnn dropout", "error": _error_text(e)}})
            try:
                result.append(throughput(args.model, args.seq, args.batch, args.precision, args.steps, args.vocab,
                                         overrides))
            except Exception as e:  # noqa: BLE001 - one variant's failure is its row, the others still run
                result.append({"impl": "kbert", "overrides": overrides,
                               "error": _error_text(e)})
            if args.json:  # the rows so far: a parent that stops this process at its budget keeps them
                print(json.dumps(result, default=str), flush=True)
    elif args.what == "hf":
        sets = [args.set] if args.set else variants
        sets = [[o for o in v if o.split("=", 1)[0] not in _implementation_choices(v)] for v in sets]
        sets = [v for i, v in enumerate(sets) if v not in sets[:i]]  # kbert's own switches mean nothing here
        result = [r for i, overrides in enumerate(sets)
                  for r in hf(args.model, args.seq, args.batch, args.steps, args.vocab, overrides,
                              modes=args.hf_modes.split(",") if i == 0 else ["compile"])]
    elif args.what == "profile":
        result = profile(args.model, args.seq, args.batch, args.precision, args.steps, args.vocab,
                         args.set or variants[0])
    elif args.what == "attention":
        result = attention(args.batch, args.seq)
    elif args.what == "preflight":  # any host, no GPU needed: which variants reach cuDNN's attention
        result = []
        for overrides in variants:
            try:
                found = cuda_attention_calls(args.model, args.seq, args.batch, args.vocab, overrides, args.precision)
            except Exception as e:  # noqa: BLE001 - a variant that does not trace is its row
                found = {"overrides": overrides, "error": _error_text(e)}
            result.append(found)
            if not args.json:
                kinds = sorted({c["kind"] for c in found.get("calls", [])})
                print(f"{' '.join(overrides) or 'BERT defaults'}: " + (found["error"] if "error" in found else
                      f"{len(found['calls'])} cuDNN attention calls {kinds} for {found['layers']} layers, "
                      f"seeds {sorted({c['seed'] for c in found['calls']})}"
                      + (f"; Keras fell back to XLA {len(found['fallbacks'])} times: {found['fallbacks'][0]}"
                         if found.get("fallbacks") else "")))
    elif args.what == "dropout-check":
        try:
            result = dropout_check()
        except Exception as e:  # noqa: BLE001 - no cuDNN here (a CPU, an older JAX): the row says why
            result = {"form": "cudnn dropout", "error": _error_text(e)}
    elif args.what == "records":
        result = make_records(args.shared, args.out or ".gpu", args.rows, args.vocab)
    elif args.what == "pretrain":
        result = pretrain_check(os.path.join(args.records, "records"), os.path.join(args.records, "tok"), args.model,
                                args.batch, args.steps_pretrain, args.precision, args.out or "/tmp")
    elif args.what == "memory":
        result = memory(args.model, args.seq, args.batch, args.precision, args.vocab)
    elif args.what in ("aot-memory", "aot-traffic"):
        import jax

        # before JAX starts its backends: the CUDA plugin loads without a driver, and this host's own devices are
        # its CPU (a GPU here is not what is compiled for)
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
        jax.config.update("jax_platforms", "cpu")
        targets = [t for t in args.targets.split(",") if t]
        if args.what == "aot-traffic":
            result = aot_traffic(args.model, args.seq, args.batch, args.precision, args.vocab, variants, targets[0])
            if not args.json:
                report_traffic(result)
                return
        else:
            points = [(p, int(q), int(b)) for p, q, b in (x.split(":") for x in args.points.split(",") if x)]
            result = aot_memory(args.model, points, targets, args.vocab)
            if not args.json:
                report_aot(result)
                return
    elif args.what == "lora":
        result = lora(args.lora_points.replace("MODEL", args.model).replace("VOCAB", str(args.vocab)), args.seq,
                      args.precision)
    elif args.what == "capped":
        result = capped(args.model, [int(s) for s in args.seqs.split(",")], args.precision, args.vocab, args.cap,
                        {"auto": None, "on": True, "off": False}[args.shallow])
    else:
        result = probe(args.model, [int(s) for s in args.seqs.split(",")], args.precision, args.vocab)
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
