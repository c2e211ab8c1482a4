"""How many sequences fit in device memory: one memory model of the architecture, a few global coefficients.

    memory(batch, seq) = WORKSPACE
                       + params x (weights 4 + slots x 4 [+ 2 for the 16-bit copy] [+ gradients 4
                                   + slots x EXTRA_BYTES_PER_SLOT, where they are live at the peak]
                                   [+ 4 for gradient accumulators])
                       + batch x seq x layers_computed x ACT_TOKEN_BYTES_PER_HIDDEN x
                             (hidden + intermediate x INTERMEDIATE_FACTOR) x act_bytes
                       + batch x heads x seq x seq' x layers_computed x ATTN_BYTES_PER_SCORE x act_bytes
                       + batch x predictions x vocab x (logits + softmax + gradient, fp32)

    (seq' = seq; on a TPU seq rounded up to whole 128-lane tiles, and below length 128 a few of the
    width-hidden tensors padded alike: the `xla-tpu` set below)

- parameters: counted from the ModelConfig (ALBERT shares one group's weights across layers, so its
  parameter memory is small while its activations still grow with the number of layers computed);
- optimizer slots: Adam / AdamW / LAMB keep 2 per parameter, SGD none; mixed precision keeps fp32 weights
  (the policy's variables) and computes activations in 16 bits (`act_bytes`: 4 in float32, a little over 4
  in XLA's program; under mixed precision a little over 2, since softmax inputs, LayerNorm statistics and
  the loss stay in float32);
- activations kept for the backward pass per token and layer: `ACT_TOKEN_BYTES_PER_HIDDEN` tensors of width
  hidden (QKV, attention output, residual adds, LayerNorms, backward temporaries; more with dropout, for
  its masks) and `INTERMEDIATE_FACTOR` of width intermediate (dense output, GELU output);
- attention scores and softmax per head: `ATTN_BYTES_PER_SCORE` seq x seq tensors per layer (more with
  attention dropout, for its mask);
- the masked-LM head: logits, softmax and their gradient at the masked positions only;
- every layer counted at every position, the last one included, although kbert's `Pretrainer` computes its
  last block at [CLS] and the masked positions only (`kbert.models.layers.IMPLEMENTATIONS["last_layer"]`):
  the estimate keeps that block's activations (a few percent of a BERT-Base step's bytes) as margin on the
  side of fitting, since the coefficients were chosen on steps that computed it in full;
- likewise under mixed precision the coefficients were chosen on steps whose LayerNorms kept a float32 copy
  of their input for the backward pass; kbert's `LayerNorm` keeps the 16-bit input instead, so the estimate
  errs further on the side of fitting until the device runs measure the current program (how far, as XLA's
  GPU compiler sees it with no GPU: `benchmarks/gpu.py aot-memory` and benchmarks/README.md);
- activation recomputation keeps only each layer's input (1 tensor of size hidden per token) plus one
  layer's full activations; gradient accumulation divides the batch that must fit by the number of
  micro-batches and adds one fp32 accumulator per parameter.

The coefficients depend on how the train step is executed, so there are four global sets, `COMPILERS`:

- `"xla"` (kbert's default on a GPU, and what `kbert plan --probe` runs there): XLA fuses the elementwise
  work and frees each activation as soon as its gradient is formed, so far fewer tensors are kept and the
  gradients are never all live at the activation peak. Chosen (round values, never under) on the byte count
  of XLA's compiled BERT-Base training step on an H200 and an H100, plus a 64 MB workspace (the allocator's
  peak after real steps is that count plus 10-45 MB); benchmarks/README.md has the points, the devices and
  how far each estimate is from them. `kbert plan --exact` reads that byte
  count for the model and device at hand;
- `"xla-tpu"` (a Cloud TPU: `trainer.batch_size: auto`, `--exact`'s start and `kbert plan --compiler xla-tpu`):
  the `xla` set's tensors with a TPU's bytes per element and its tiling. A TPU keeps fewer bytes per
  activation element than a GPU, and in float32 few more than in bfloat16 (its matmuls run at default
  precision on bfloat16 copies of their inputs, likely what the backward pass keeps), beside a larger
  fixed part (a 256 MB workspace: what a small batch keeps beyond the weights and slots). It stores an array's
  minor dimension in 128-lane tiles: the attention scores' rows take a whole number of lanes, and below
  length 128 the per-head [b, seq, heads, 64] arrays fill half a lane whichever of their two minor
  dimensions is laid out last, so a token costs more at length 64 than at 128 (`lane_width`,
  `padded_head_tensors`). Chosen the same way (round values, never under) on XLA's memory analysis of the
  step compiled by libtpu for a TPU v5e chip, with no TPU here (`benchmarks/gpu.py aot-memory --targets
  tpu-v5e`, as MaxText's `train_compile.py` checks TPU memory before a TPU is rented), BERT-Base at lengths
  64 to 512 and BERT-Large, both precisions, and on a v6e chip's larger batches (benchmarks/README.md has
  the points). No TPU has run them, so the set keeps a few percent more than those programs; `kbert plan
  --exact` on a TPU host reads its own;
- `"xla-cpu"` (the same step compiled by XLA for a CPU: `trainer.batch_size: auto` on a CPU, `kbert plan --exact`
  and `--probe` there, `kbert plan --compiler xla-cpu`): XLA's CPU programs keep about twice the activation
  bytes of a GPU's, and under mixed precision as many as in float32 (the CPU computes bfloat16 ops in float32
  and keeps those copies), so the `"xla"` set would plan a batch that does not fit. Chosen the same way (round
  values, never under) on XLA's memory analysis of kbert's JAX step on a CPU, bert-tiny to bert-large and
  ALBERT, sequences of 64 to 512, both precisions (tests/test_train.py has the points). TensorFlow's XLA step
  on a CPU keeps much more than that program (its whole process, at BERT-Base, 25-50% over this set's
  estimate): `trainer.batch_size: auto` plans it with the "none" set (`plan_compiler`);
- `"none"` (op-by-op graph execution, TensorFlow without XLA): the sanity anchor is the 12 GB table in
  google-research/bert's README (TF 1.11, fp32, Adam); one set of round values comes close to every row
  (the tests bound the error). On a CPU it is within a few percent of TensorFlow 2's whole training process
  (bfloat16 without XLA) and over it with XLA (benchmarks/README.md).

On a CPU, `trainer.batch_size: auto` plans the whole process, not the step alone: the host's memory is the
device's, and the process's own bytes (`CPU_PROCESS_BYTES`) come off it first.

Never fitted per row. `kbert plan --probe` confirms the answer with real steps on the device at hand.
"""

from __future__ import annotations

import dataclasses
import numbers
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from kbert.data.masking import default_max_predictions
from kbert.utils import positive_int


@dataclass(frozen=True)
class MemoryCoefficients:
    act_token_bytes_per_hidden: float  # ACT_TOKEN_BYTES_PER_HIDDEN: width-`hidden` tensors kept per token per layer
    dropout_masks_per_hidden: float  # more width-`hidden` tensors kept when `dropout` > 0 (the masks)
    intermediate_factor: float  # INTERMEDIATE_FACTOR: width-`intermediate` tensors kept per token per layer
    attn_bytes_per_score: float  # ATTN_BYTES_PER_SCORE: seq x seq tensors per head per layer
    attn_dropout_masks: float  # more seq x seq tensors per head per layer when `attention_dropout` > 0
    workspace_bytes: float  # WORKSPACE_BYTES: framework workspaces, allocator fragmentation
    extra_bytes_per_slot: float  # EXTRA_BYTES_PER_SLOT: optimizer temporaries per slot
    gradients_live_at_peak: bool  # all gradients held at once beside the activations
    mixed_act_bytes: float  # bytes per activation element under mixed precision
    float32_act_bytes: float  # bytes per activation element in float32
    mlm_logit_copies: float  # copies of the [masked positions x vocab] logits (logits, softmax, gradient)
    mlm_logits_float32: bool  # the logits' copies are float32 even under mixed precision
    # a TPU's tiling: the minor dimension of an array is padded to `lane_width` (0: none). It pads the scores'
    # last dimension (seq) and, where both its last two dimensions are shorter than a lane (seq and head size
    # below 128), `padded_head_tensors` of the width-`hidden` tensors kept per token and layer, [b, seq, heads,
    # head size] arrays that no layout can give a full lane
    lane_width: int = 0
    padded_head_tensors: float = 0


COMPILERS = {
    "xla": MemoryCoefficients(act_token_bytes_per_hidden=6.5, dropout_masks_per_hidden=1, intermediate_factor=2,
                              attn_bytes_per_score=1.5, attn_dropout_masks=0.75, workspace_bytes=64e6,
                              extra_bytes_per_slot=0, gradients_live_at_peak=False, mixed_act_bytes=2.25,
                              float32_act_bytes=4.25, mlm_logit_copies=2, mlm_logits_float32=False),
    # activations as float32 in both precisions: see the module docstring
    "xla-cpu": MemoryCoefficients(act_token_bytes_per_hidden=6.5, dropout_masks_per_hidden=1, intermediate_factor=5,
                                  attn_bytes_per_score=1.5, attn_dropout_masks=0.5, workspace_bytes=16e6,
                                  extra_bytes_per_slot=0, gradients_live_at_peak=False, mixed_act_bytes=4,
                                  float32_act_bytes=4, mlm_logit_copies=2, mlm_logits_float32=False),
    "none": MemoryCoefficients(act_token_bytes_per_hidden=28, dropout_masks_per_hidden=0, intermediate_factor=3,
                               attn_bytes_per_score=4, attn_dropout_masks=0, workspace_bytes=0.5e9,
                               extra_bytes_per_slot=4, gradients_live_at_peak=True, mixed_act_bytes=2,
                               float32_act_bytes=4, mlm_logit_copies=3, mlm_logits_float32=True),
}
# the xla set's tensors with a TPU's bytes per activation element and its 128-lane tiling: see the module docstring
COMPILERS["xla-tpu"] = dataclasses.replace(COMPILERS["xla"], workspace_bytes=256e6, mixed_act_bytes=1.8,
                                           float32_act_bytes=2.15, lane_width=128, padded_head_tensors=4)
OPTIMIZER_SLOTS = {"adam": 2, "adamw": 2, "lamb": 2, "adafactor": 1, "sgd": 0, "momentum": 1}
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")


def parse_memory(text) -> float:
    """'12GB', '12 GiB', '16000MB', '12000000000B' or a number (int or float) of bytes -> bytes. A string
    without a unit is refused: '12' is far more likely 12 GB meant than 12 bytes (which plans a batch of 0)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?i?b?)\s*", str(text).lower())
    if not m:
        raise ValueError(f"`memory` must look like '12GB' or '16GiB'. Received: {text!r}")
    if not m.group(2):
        raise ValueError(f"`memory` needs a unit: '{m.group(1)}GB', '{m.group(1)}GiB' (or bytes: "
                         f"'{m.group(1)}B'). Received: {text!r}")
    unit = m.group(2).rstrip("b")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30,
             "ti": 2 ** 40}[unit]
    return float(m.group(1)) * scale


def _lanes(n: int, lane: int) -> int:
    """`n` rounded up to a whole number of `lane`-wide tiles (`n` itself where `lane` is 0)."""
    return -(-n // lane) * lane if lane else n


def estimate_memory(config, batch: int, seq_len: int, optimizer: str = "adamw", precision: str = "float32",
                    max_predictions: Optional[int] = None, accumulation: int = 1,
                    recompute: bool = False, compiler: str = "xla") -> Dict[str, float]:
    """Bytes needed to train `config` (a ModelConfig) on `batch` x `seq_len`, by component. `compiler`:
    "xla" (the train step compiled with XLA for a GPU, kbert's default), "xla-tpu" (for a TPU), "xla-cpu"
    (for a CPU) or "none" (op-by-op)."""
    if optimizer not in OPTIMIZER_SLOTS:
        raise ValueError(f"`optimizer` must be one of {tuple(OPTIMIZER_SLOTS)}. Received: {optimizer!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"`precision` must be one of {PRECISIONS}. Received: {precision!r}")
    if compiler not in COMPILERS:
        raise ValueError(f"`compiler` must be one of {tuple(COMPILERS)}. Received: {compiler!r}")
    c = COMPILERS[compiler]
    params = config.num_parameters()
    slots = OPTIMIZER_SLOTS[optimizer]
    mixed = precision != "float32"
    act = c.mixed_act_bytes if mixed else c.float32_act_bytes
    per_param = 4 + 4 * slots + (2 if mixed else 0)  # fp32 weights, slots, the 16-bit copy under mixed precision
    if c.gradients_live_at_peak:
        per_param += 4 + c.extra_bytes_per_slot * slots
    if accumulation > 1:
        per_param += 4  # the fp32 gradient accumulators
    state = params * per_param
    micro = max(1, -(-batch // accumulation))
    h, i, heads, layers = config.hidden_size, config.intermediate_size, config.num_heads, config.num_layers
    hidden_tensors = c.act_token_bytes_per_hidden + (c.dropout_masks_per_hidden if config.dropout > 0 else 0)
    score_tensors = c.attn_bytes_per_score + (c.attn_dropout_masks if config.attention_dropout > 0 else 0)
    score_width = _lanes(seq_len, c.lane_width)  # a score row's stored length
    # each [b, seq, heads, head size] tensor is stored with whichever of its two minor dimensions pads least
    head_size = h // heads
    hidden_tensors += c.padded_head_tensors * (
        min(score_width / seq_len, _lanes(head_size, c.lane_width) / head_size) - 1)
    per_layer_tokens = micro * seq_len * (hidden_tensors * h + c.intermediate_factor * i) * act
    per_layer_attn = micro * heads * seq_len * score_width * score_tensors * act
    if recompute:
        activations = layers * micro * seq_len * h * act + per_layer_tokens + per_layer_attn
    else:
        activations = layers * (per_layer_tokens + per_layer_attn)
    predictions = max_predictions or default_max_predictions(seq_len)
    embeddings = micro * seq_len * (config.embedding_size or h) * act * 4
    mlm = micro * predictions * config.vocab_size * c.mlm_logit_copies * (4 if c.mlm_logits_float32 else act)
    total = c.workspace_bytes + state + activations + embeddings + mlm
    return {"total": total, "workspace": c.workspace_bytes, "weights_grads_slots": state,
            "activations": activations, "embeddings": embeddings, "mlm_head": mlm, "micro_batch": micro}


def config_of(model: str):
    """The ModelConfig of a preset name, or of a model dir or Hugging Face Hub name from its configuration file
    (`kbert.models.convert.model_config`, which imports Keras; a preset needs no Keras)."""
    from kbert.models.config import PRESETS, ModelConfig

    if model in PRESETS:
        return ModelConfig.preset(model)
    from kbert.models.convert import model_config

    return model_config(model)


def check_seq_len(config, seq) -> None:
    """Refuses a sequence length the model cannot train at: under 2 tokens ([CLS] and [SEP]), or beyond its
    position embeddings (on JAX a lookup past the table's end gives NaN, not an error, so `--exact` would
    measure a program that cannot train)."""
    if isinstance(seq, bool) or not isinstance(seq, numbers.Integral) or seq < 2:
        raise ValueError(f"seq_len must be an integer of at least 2 tokens. Received: {seq!r}")
    if seq > config.max_position:
        raise ValueError(f"seq_len {seq} is beyond the model's position embeddings ({config.max_position})")


def max_batch_size(config, memory, seq_len: int, **kwargs) -> int:
    """The largest batch whose estimate fits in `memory` (bytes or '12GB'); 0 when none does."""
    budget = parse_memory(memory)
    lo, hi = 0, 1
    while estimate_memory(config, hi, seq_len, **kwargs)["total"] <= budget:
        lo, hi = hi, hi * 2
        if hi > 1 << 20:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if estimate_memory(config, mid, seq_len, **kwargs)["total"] <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def plan_batch_size(config, memory, seq_lens: Sequence[int] = (128,), target_batch: Optional[int] = None,
                    replicas: int = 1, optimizer: str = "adamw", precision: str = "float32", margin: float = 0.0,
                    recompute: bool = False, compiler: str = "xla") -> List[Dict]:
    """`kbert.plan_batch_size(...)`: for each sequence length, the max micro-batch per replica of `config` (a
    ModelConfig, a preset name, a model dir or a Hugging Face Hub name) that fits
    `memory` (less a safety `margin` fraction) and, for a `target_batch` (global), the micro-batch x
    accumulation steps x replicas that reaches it. `compiler`: "xla" (kbert's default: a GPU), "xla-tpu"
    (XLA on a TPU), "xla-cpu" (XLA on a CPU) or "none" (op-by-op execution; the coefficients anchored on
    google-research/bert's 12 GB table)."""
    if isinstance(config, str):
        config = config_of(config)
    # 0 was read as "no target" and a margin of 1 or more as a budget of nothing: both errors, as a user meant else
    target_batch = None if target_batch is None else positive_int(target_batch, "target_batch")
    replicas = positive_int(replicas, "replicas")
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not 0.0 <= margin < 1.0:
        raise ValueError(f"`margin` must be a fraction in [0, 1). Received: margin={margin!r}")
    budget = parse_memory(memory) * (1.0 - margin)
    rows = []
    for seq in seq_lens:
        check_seq_len(config, seq)
        kw = dict(optimizer=optimizer, precision=precision, recompute=recompute, compiler=compiler)
        best = max_batch_size(config, budget, seq, **kw)
        row = {"seq_len": seq, "max_batch": best,
               "memory_at_max": estimate_memory(config, max(best, 1), seq, **kw)["total"]}
        if target_batch is not None:
            if target_batch % replicas:
                raise ValueError(f"target batch {target_batch} is not divisible by {replicas} replicas")
            per_replica = target_batch // replicas
            if best == 0:
                row.update(micro_batch=0, accumulation=None, replicas=replicas)
            else:
                accumulation = -(-per_replica // best)
                # equal micro-batches, and room for the gradient accumulators once there is accumulation
                while per_replica % accumulation or (accumulation > 1 and estimate_memory(
                        config, per_replica, seq, accumulation=accumulation, **kw)["total"] > budget):
                    accumulation += 1
                row.update(micro_batch=per_replica // accumulation, accumulation=accumulation, replicas=replicas)
        rows.append(row)
    return rows


def compiler_for(device: Optional[str]) -> str:
    """The coefficient set of an XLA-compiled step on `device` ("cpu", "gpu", "tpu"; None: no accelerator)."""
    return {None: "xla-cpu", "cpu": "xla-cpu", "tpu": "xla-tpu"}.get(device, "xla")


# What a training process on a CPU holds beside its step, by Keras backend: on a CPU the device's memory is the
# host's, so the process's own bytes (the framework and kbert imported, about 0.8 GB, then its runtime and input
# pipeline) come out of the same memory. Measured as the peak RSS of `kbert.pretrain` on this project's CPU
# (benchmarks/README.md, "The planner on a CPU is the process's memory"): JAX keeps about 1 GB beyond its compiled
# step's bytes, whatever the model; TensorFlow's rest is within the "none" set it is planned with.
CPU_PROCESS_BYTES = {"jax": 2.0e9, "tensorflow": 1.0e9}


def plan_compiler(device: Optional[str], backend: str = "jax", compiled: bool = True) -> str:
    """The coefficient set `trainer.batch_size: auto` plans a step with: `compiler_for(device)` where XLA compiles
    the step (`compiled`: the backend's `compiles_step`), else "none" (op-by-op). TensorFlow's XLA step on a CPU
    is planned as "none" too: it keeps much more than the JAX program the "xla-cpu" set was fitted on (the whole
    process 25-50% over that set's estimate at BERT-Base, within the "none" set's; benchmarks/README.md)."""
    if not compiled or (backend == "tensorflow" and device in (None, "cpu")):
        return "none"
    return compiler_for(device)


def plan_for_config(config, model_config, precision: str, replicas: int, device: str,
                    device_memory: Optional[int] = None, backend: str = "jax", compiled: bool = True) -> Dict:
    """`trainer.batch_size: auto`: the largest per-replica batch (at most 256) that the planner fits in
    the device's memory less a 10% margin (`trainer.memory` when set, else `device_memory`, the bytes the
    backend reports for one accelerator, else 8 GB on CPU / 16 GB elsewhere), times the replicas; no
    accumulation. On a CPU the process's own bytes (`CPU_PROCESS_BYTES` of `backend`) come off the memory
    first. `compiled`: whether XLA compiles the step (`plan_compiler`). Backend-neutral: a JAX host without
    TensorFlow plans too."""
    memory = config.trainer.memory
    if memory is None and device != "cpu" and device_memory:
        memory = int(device_memory)
    if memory is None:
        memory = "8GB" if device == "cpu" else "16GB"
    if config.runtime.jit is False:  # TensorFlow without XLA (the JAX backend refuses the setting)
        compiled = False
    compiler = plan_compiler(device, backend, compiled)
    budget = parse_memory(memory) * 0.9 - (CPU_PROCESS_BYTES.get(backend, 2.0e9) if device == "cpu" else 0)
    best = max_batch_size(model_config, max(budget, 0), config.data.max_length,
                          optimizer=config.optimizer.name, precision=precision, compiler=compiler)
    if best == 0:
        process = (f" (on a CPU the training process itself takes about "
                   f"{CPU_PROCESS_BYTES.get(backend, 2.0e9) / 1e9:.0f} GB of it)" if device == "cpu" else "")
        raise ValueError(f"The model does not fit in {memory}{process} at max_length={config.data.max_length} even "
                         f"with batch 1; use a smaller model, shorter sequences, mixed precision or more memory "
                         f"(trainer.memory)")
    per_replica = min(best, 256)
    return {"global_batch": per_replica * replicas, "accumulation": 1, "micro_batch": per_replica,
            "memory": memory}


REFERENCE_12GB = {  # google-research/bert README, TF 1.11, Titan X 12 GB, fp32, Adam
    "bert-base": {64: 64, 128: 32, 256: 16, 320: 14, 384: 12, 512: 6},
    "bert-large": {64: 12, 128: 6, 256: 2, 320: 1, 384: 0, 512: 0},
}
