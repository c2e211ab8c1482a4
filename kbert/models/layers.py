"""Building blocks of BERT and ALBERT, in `keras.ops` only (runs on the TensorFlow, JAX and torch backends).

Shapes in comments: b = batch, s = sequence, h = hidden, e = embedding width, n = heads, d = head size,
p = masked positions per sequence, v = vocabulary.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import keras
from keras import ops

from kbert.models.config import ModelConfig

# Large negative number added to attention scores of padding keys. Scores are biased in float32, where
# this is finite; exp() of it underflows to exactly 0 as with -inf, without NaN on fully padded rows.
_MASK_BIAS = -1e9


# Code paths benchmarks and parity tests compare against (`with implementation(attention="explicit"): ...`).
# The defaults are kbert's choices; the others exist so a before/after figure or a parity check can run
# both in one process.
IMPLEMENTATIONS = {
    # auto: a keyed counter hash on JAX (one hash round per element); hash2: the two-round form it replaced
    # (for before/after figures); generator: the backend's RNG
    "dropout_masks": ("auto", "hash2", "generator"),
    # auto: fused where it applies, and on one CPU device outside training a few batch rows at a time;
    # explicit: einsum-softmax-einsum over the whole batch; fused: `ops.dot_product_attention` wherever it applies
    "attention": ("auto", "explicit", "fused"),
    # how the fused kernel gets the padding mask: [b, 1, s, s] (cuDNN takes it) or [b, 1, 1, s] (cuDNN
    # refuses it, XLA's attention runs)
    "attention_mask": ("square", "broadcast"),
    # pretraining: the last block computed only at [CLS] and the masked positions (all the heads read), or at
    # every position
    "last_layer": ("predicted", "full"),
    # LayerNorm on 16-bit inputs: a backward pass that keeps the 16-bit input and each row's mean and
    # 1/std (`LayerNorm`), with both statistics from one pass over the row (saved_input) or from Keras'
    # two-pass `ops.moments` (two_pass_stats); or Keras' own, whose autodiff keeps a float32 [b, s, h] tensor
    # per norm
    "layer_norm": ("saved_input", "two_pass_stats", "keras"),
    # query, key and value from the fused [h, 3h] kernel: one matmul whose [b, s, 3h] output is split (fused),
    # or three matmuls with the kernel's column thirds (sliced): no [b, s, 3h] tensor to copy apart forward
    # and to concatenate back in the backward pass, and at `rows` the query projection runs there only
    "qkv": ("fused", "sliced"),
}
_CHOSEN = {name: choices[0] for name, choices in IMPLEMENTATIONS.items()}
_CHOSEN["attention_kernel"] = None


def set_implementation(attention_kernel=None, **choices) -> dict:
    """Chooses code paths (see `IMPLEMENTATIONS`) for models traced from now on; returns the previous
    choices. Unnamed ones go back to the defaults. `attention_kernel(q, k, v, padding_mask, scale)`, when
    given, replaces the fused attention call (a benchmark trying a backend's own kernel). A kernel whose
    attribute `with_dropout` is true applies attention dropout itself: it then runs in training with
    attention dropout too, called with `dropout=` the rate (0.0 outside training)."""
    for name, value in choices.items():
        if value not in IMPLEMENTATIONS.get(name, ()):
            raise ValueError(f"implementation {name}={value!r}: choose from {IMPLEMENTATIONS}")
    before = dict(_CHOSEN)
    _CHOSEN.update({name: options[0] for name, options in IMPLEMENTATIONS.items()}, **choices)
    _CHOSEN["attention_kernel"] = attention_kernel
    return before


@contextlib.contextmanager
def implementation(**choices):
    """`set_implementation` for the block only."""
    before = set_implementation(**choices)
    try:
        yield
    finally:
        _CHOSEN.update(before)


def initializer(config: ModelConfig):
    return keras.initializers.TruncatedNormal(stddev=config.initializer_range)


_SQRT_HALF = 0.7071067811865476


def gelu(x):
    """Exact GELU, `0.5 x (1 + erf(x / sqrt(2)))`, computed in float32 for 16-bit inputs.

    `ops.gelu(approximate=False)` on TensorFlow evaluates `erfc` on bfloat16 one element at a time through
    the C library, whose cost grows with |x|, so a step slows down as training spreads the pre-activations;
    this form uses the vectorized float32 `erf` (benchmarks/gelu.py compares them). Within 2e-6 of
    `ops.gelu` in float32.
    """
    dtype = keras.backend.standardize_dtype(x.dtype)
    if dtype in ("bfloat16", "float16"):
        return ops.cast(gelu(ops.cast(x, "float32")), dtype)
    return 0.5 * x * (1.0 + ops.erf(x * _SQRT_HALF))


_LAYER_NORMS = {}


def _layer_norm_16(epsilon: float):
    """Layer normalization over the last axis of a 16-bit `x` with float32 statistics (as Keras'), by
    `ops.custom_gradient`: `(x, gamma, beta) -> y` in x's dtype, whose backward pass recomputes the normalized
    input from x itself and keeps only x and the per-row mean and 1/std ([..., 1], float32) from the forward
    pass. Autodiff through Keras' form keeps a float32 copy the size of x ([b, s, h]) per norm instead,
    written in the forward pass and read in the backward one: 4 more bytes per element where x has 2, on
    every LayerNorm of the model (two a block)."""
    one_pass = _CHOSEN["layer_norm"] == "saved_input"
    if (epsilon, one_pass) not in _LAYER_NORMS:
        @ops.custom_gradient
        def norm(x, gamma, beta):
            xf = ops.cast(x, "float32")
            if one_pass:
                # mean and mean square as sibling reductions, which XLA computes in the kernel that wrote x
                # (the residual add), where Keras' `ops.moments` reads x twice more for its two-pass variance.
                # The float32 difference loses bits as mean^2 / variance grows: it reaches bfloat16's own
                # precision only for a row whose spread is under 1/256 of its mean; `maximum` keeps a
                # constant row's rounding from going negative.
                mean = ops.mean(xf, axis=-1, keepdims=True)  # [..., 1]
                variance = ops.maximum(ops.mean(ops.square(xf), axis=-1, keepdims=True) - ops.square(mean), 0.0)
            else:
                mean, variance = ops.moments(xf, axes=[-1], keepdims=True)  # [..., 1] each
            rstd = ops.rsqrt(variance + epsilon)
            inv = rstd * gamma  # Keras' arithmetic (with two-pass statistics, Keras' result to the bit)
            y = ops.cast(xf * inv + (beta - mean * inv), x.dtype)

            def grad(*args, upstream=None):
                if upstream is None:
                    (upstream,) = args
                dy = ops.cast(upstream, "float32")
                xhat = (ops.cast(x, "float32") - mean) * rstd  # recomputed: [..., h]
                rows = tuple(range(len(x.shape) - 1))
                g = dy * gamma
                # d/dx of (x - mean) / std: the mean and the variance's dependence on x, per row
                dx = rstd * (g - ops.mean(g, axis=-1, keepdims=True)
                             - xhat * ops.mean(g * xhat, axis=-1, keepdims=True))
                return ops.cast(dx, x.dtype), ops.sum(dy * xhat, axis=rows), ops.sum(dy, axis=rows)

            return y, grad

        _LAYER_NORMS[epsilon, one_pass] = norm
    return _LAYER_NORMS[epsilon, one_pass]


class LayerNorm(keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization` (same weights and names, results within 16-bit rounding) whose
    backward pass under a 16-bit policy keeps the 16-bit input instead of a float32 copy (`_layer_norm_16`):
    less activation memory and two fewer float32 passes over [b, s, h] per norm, and whose statistics come
    from one pass over the row. Other dtypes and options: Keras' own."""

    def call(self, inputs):
        if (_CHOSEN["layer_norm"] == "keras" or self.rms_scaling or not (self.center and self.scale)
                or keras.backend.standardize_dtype(inputs.dtype) not in ("bfloat16", "float16")
                or self.axis not in (-1, len(inputs.shape) - 1, [-1], [len(inputs.shape) - 1])):
            return super().call(inputs)
        gamma, beta = (ops.cast(ops.convert_to_tensor(w), "float32") for w in (self.gamma, self.beta))
        return _layer_norm_16(self.epsilon)(inputs, gamma, beta)


def activation(name: str):
    if name == "gelu":
        return gelu
    if name == "gelu_tanh":
        return lambda x: ops.gelu(x, approximate=True)
    if name == "relu":
        return ops.relu
    if name == "tanh":
        return ops.tanh
    raise ValueError(f"Unknown activation {name!r}")


def _uint32(value):
    return ops.convert_to_tensor(value, dtype="uint32")


def _mix32(x):
    """A bijective 32-bit integer hash with low bias (C. Wellons' "lowbias32"): two multiply-xorshift rounds."""
    x = ops.bitwise_xor(x, ops.right_shift(x, _uint32(16)))
    x = x * _uint32(0x7FEB352D)
    x = ops.bitwise_xor(x, ops.right_shift(x, _uint32(15)))
    x = x * _uint32(0x846CA68B)
    return ops.bitwise_xor(x, ops.right_shift(x, _uint32(16)))


def last_layer_at_predictions() -> bool:
    """Whether `Pretrainer` runs its last block only at [CLS] and the masked positions (`IMPLEMENTATIONS`)."""
    return _CHOSEN["last_layer"] == "predicted"


def _counter_hash_applies() -> bool:
    """Dropout masks from a counter hash (JAX) instead of the backend's random-number generator (elsewhere)."""
    return keras.backend.backend() == "jax" and _CHOSEN["dropout_masks"] != "generator"


class Dropout(keras.layers.Layer):
    """Inverted dropout with masks that cost little to draw.

    - On Keras' JAX backend the mask is a keyed counter hash: element i of a call keeps its value when
      `hash((i * m) ^ k0) >= rate * 2^32`, with k0 and the odd multiplier m hashed from the layer's seed
      generator (a fresh pair per call, so a fresh mask per step): `(i * m) ^ k0` is a bijection of the
      counters of the call's own, and one round of a low-bias 32-bit mixer hashes it. It is about eleven
      integer operations per element that XLA fuses into the neighbouring kernels, where JAX's threefry
      generator is a separate, ALU-heavy pass over the tensor (the approach of fused dropout kernels such as
      Apex's and FlashAttention's Philox, with a cheaper hash). A dropout over a 16-bit tensor moves five bytes
      an element, so its integer operations weigh about as much as its memory traffic on a GPU (an H100 does
      about 17 T 32-bit integer operations a second beside 3.4 TB/s), and more on a CPU: the form before,
      `hash(hash(i + k0) ^ k1)` (`dropout_masks="hash2"`, kept for before/after figures), took nineteen. The
      masks pass the same independence tests (tests/test_models.py). The rate is exact to 2^-32.
    - Elsewhere one 30-bit random integer gives two independent 15-bit uniforms (its low and high halves),
      so two elements share one draw of the backend's generator (half the draws of `keras.layers.Dropout`);
      an element is dropped with probability round(rate * 2^15) / 2^15 (0.1 -> 0.100006). The draws cover
      the flattened tensor, so a step's mask does not depend on how much of the shape a trace knows (a
      resumed run's first trace is exact-shaped where the uninterrupted run's was relaxed).

    Kept elements are scaled by the exact inverse of the keep probability, so expectations are unchanged.
    Why the draws matter: random-number generation is a visible share of a BERT training step
    (benchmarks/README.md).
    """

    _BITS = 15

    def __init__(self, rate: float, seed=None, **kwargs):
        super().__init__(**kwargs)
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"`rate` must be in [0, 1). Received: rate={rate!r}")
        self.rate, self.seed = float(rate), seed
        if self.rate > 0:  # as keras.layers.Dropout: creating one draws from the global seed
            self.seed_generator = keras.random.SeedGenerator(seed)
        self.built = True

    def call(self, x, training=None):
        if not training or self.rate == 0.0:
            return x
        shape = tuple(ops.shape(x))
        if _counter_hash_applies() and all(isinstance(d, int) for d in shape):  # JAX: shapes are static
            threshold = min(int(round(self.rate * 2.0 ** 32)), 2 ** 32 - 1)
            seed = ops.cast(self.seed_generator.next(), "uint32")  # [2]
            k0 = _mix32(seed[0] ^ _uint32(0x9E3779B9))
            k1 = _mix32(seed[1] + k0)
            counters = ops.reshape(ops.arange(math.prod(shape), dtype="uint32"), shape)  # fused by XLA
            if _CHOSEN["dropout_masks"] == "hash2":
                bits = _mix32(ops.bitwise_xor(_mix32(counters + k0), k1))
            else:  # the call's own bijection of the counters (odd multiplier, xor), then one mixing round
                bits = _mix32(ops.bitwise_xor(counters * ops.bitwise_or(k1, _uint32(1)), k0))
            keep = ops.greater_equal(bits, _uint32(threshold))
            scale = ops.cast(2.0 ** 32 / (2.0 ** 32 - threshold), x.dtype)
            return ops.where(keep, x * scale, ops.zeros_like(x))
        # Over the flattened tensor, so the mask is the same whether the trace knows the shape or not (a
        # TensorFlow function retraced with relaxed shapes sees [None, None, ...]): element i takes the low
        # half of draw i, element half + i the high half.
        size = ops.size(x)
        half = (size + 1) // 2
        threshold = int(round(self.rate * (1 << self._BITS)))
        bits = keras.random.randint((half,), 0, 1 << (2 * self._BITS), dtype="int32", seed=self.seed_generator)
        low = ops.bitwise_and(bits, (1 << self._BITS) - 1)
        high = ops.right_shift(bits, self._BITS)
        uniforms = ops.concatenate([low, high], axis=0)[:size]
        keep = ops.reshape(ops.greater_equal(uniforms, threshold), ops.shape(x))
        scale = ops.cast((1 << self._BITS) / ((1 << self._BITS) - threshold), x.dtype)
        return ops.where(keep, x * scale, ops.zeros_like(x))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "rate": self.rate, "seed": self.seed}


def attention_bias(padding_mask):
    """[b, s] mask of 1 (token) / 0 (padding) -> additive float32 attention bias [b, 1, 1, s]; or a
    [b, s, s] mask of 1 where query q may attend to key k (packed rows, `packed_inputs`) -> [b, 1, s, s].

    Computed inside each block from the integer mask: Keras autocasts float layer inputs to the compute
    dtype, and a float16 bias would turn the padding bias into -inf.
    """
    mask = ops.cast(padding_mask, "float32")
    if len(mask.shape) == 3:
        return ((1.0 - mask) * _MASK_BIAS)[:, None, :, :]
    return ((1.0 - mask) * _MASK_BIAS)[:, None, None, :]


def packed_inputs(segments):
    """Several texts in one row (inference without padding waste): `segments` [b, s] int numbers each
    token by its text within the row (1, 1, 1, 2, 2, 3, ..., 0 for padding; texts contiguous, numbered in
    order) -> (positions [b, s] int32 restarting at 0 for each text, attention mask [b, s, s] int32).

    A token attends only to the tokens of its own text, so each text's hidden states are those it has
    alone in a row (padding queries attend to every real token, as with a [b, s] padding mask).
    """
    segments = ops.cast(segments, "int32")
    same = ops.equal(segments[:, :, None], segments[:, None, :])  # [b, q, k]
    start = ops.argmax(ops.cast(same, "int32"), axis=-1)  # [b, q]: the first token of q's text
    positions = ops.arange(ops.shape(segments)[1], dtype="int32")[None, :] - ops.cast(start, "int32")
    real_key = ops.greater(segments, 0)[:, None, :]
    pad_query = ops.equal(segments, 0)[:, :, None]
    attend = ops.logical_and(real_key, ops.logical_or(same, pad_query))
    return positions, ops.cast(attend, "int32")


def _fused_attention_applies(attention_dropout: float, training) -> bool:
    """Whether a block's attention runs as one fused `ops.dot_product_attention` call.

    On Keras' JAX backend that call is cuDNN's flash attention on Ampere+ GPUs (bf16/fp16) and Pallas'
    splash attention on TPUs, falling back to XLA's einsum-softmax-einsum (float32 softmax, as below)
    elsewhere. Neither takes a dropout rate for the attention probabilities, so it applies only when
    attention dropout is 0 (as MosaicBERT and ModernBERT pretrain: `ModelConfig(attention_dropout=0.0)`)
    or outside training, unless the chosen `attention_kernel` applies dropout itself (cuDNN's kernel does,
    through JAX's private binding; benchmarks/gpu.py's `attention_kernel=cudnn_dropout` measures it before
    it can be a default). On TensorFlow Keras' version is the same einsums with extra masking passes, so the
    explicit form stays there.
    """
    if keras.backend.backend() != "jax" or _CHOSEN["attention"] == "explicit":
        return False
    return attention_dropout == 0.0 or not training or _kernel_with_dropout() is not None


# Batch rows per loop step of CPU inference's attention (`_attention_in_steps`): the fastest, or within a few
# percent of it, at every shape benchmarks/attention.py times (bert-mini and bert-small, seq 128 to 512).
ATTENTION_ROWS_PER_STEP = 2
# Below this many bytes of float32 scores for the whole batch (about an L2 cache: [32, 4, 64, 64] is 2 MiB)
# the loop's per-step cost outweighs what it saves, and the batch runs at once.
ATTENTION_STEPS_FROM_BYTES = 2 ** 21


def _attention_in_steps_applies(training) -> bool:
    """Whether a block's attention runs `_attention_in_steps`: on Keras' JAX backend with one CPU device, outside
    training, with no chosen kernel. XLA's CPU attention (fused call or einsums) writes the whole batch's
    float32 scores ([b, n, q, k]: 75 MB at [32, 4, 384, 384]) to memory and reads them back for each of the
    softmax's passes and the second matmul; a couple of rows' scores stay in the cores' caches. Training keeps
    the one-batch form: its backward pass saves every step's probabilities anyway, and there the loop gains
    little. Several devices (a data-parallel mesh of host CPUs) keep it too: the loop would walk the sharded
    batch axis."""
    if keras.backend.backend() != "jax" or training or _CHOSEN["attention"] != "auto":
        return False
    if _CHOSEN["attention_kernel"] is not None:
        return False
    devices = keras.distribution.list_devices()
    return len(devices) == 1 and devices[0].startswith("cpu")


def _softmax_attention(q, k, v, bias, scale, dropout=None):
    """q [b, r, n, d], k, v [b, s, n, d], additive float32 bias [b, 1, 1 or r, s] -> [b, r, n, d]: the explicit
    einsum-softmax-einsum, the softmax in float32 so fp16/bf16 scores do not overflow. `dropout`: a layer
    applied to the probabilities (training)."""
    scores = ops.einsum("bqnd,bknd->bnqk", q * ops.cast(scale, q.dtype), k)  # [b, n, r, s]
    probs = ops.cast(ops.softmax(ops.cast(scores, "float32") + bias, axis=-1), q.dtype)
    if dropout is not None:
        probs = dropout(probs)
    return ops.einsum("bnqk,bknd->bqnd", probs, v)  # [b, r, n, d]


def _attention_rows(q, k, v, bias, scale):
    """A loop step of `_attention_in_steps`: q [c, r, n, d], k, v [c, s, n, d], bias [c, 1, 1 or r, s] ->
    [c, r, n, d]. Heads-major inside the step, and the softmax's division comes after the second matmul, on
    [c, n, r, d] rather than the [c, n, r, s] probabilities (flash attention's order; the same result within
    float32 rounding): both measured faster on a CPU than `_softmax_attention`'s form."""
    qt, kt, vt = (ops.transpose(t, (0, 2, 1, 3)) for t in (q, k, v))  # [c, n, r or s, d]
    scores = ops.cast(ops.einsum("bnqd,bnkd->bnqk", qt * ops.cast(scale, q.dtype), kt), "float32") + bias
    weights = ops.exp(scores - ops.max(scores, axis=-1, keepdims=True))  # [c, n, r, s], float32
    context = ops.einsum("bnqk,bnkd->bnqd", ops.cast(weights, q.dtype), vt)  # [c, n, r, d]
    context = ops.cast(context, "float32") / ops.sum(weights, axis=-1, keepdims=True)
    return ops.transpose(ops.cast(context, q.dtype), (0, 2, 1, 3))  # [c, r, n, d]


def _attention_in_steps(q, k, v, padding_mask, scale):
    """Inference attention `ATTENTION_ROWS_PER_STEP` batch rows at a time, in an `ops.scan` (see
    `_attention_in_steps_applies` for why). q [b, r, n, d], k, v [b, s, n, d], padding_mask [b, s] (or [b, r, s]
    for packed rows) -> [b, r, n, d]. A batch that does not divide is padded with rows of zeros, whose
    outputs are dropped (rows do not interact). A batch whose scores fit `ATTENTION_STEPS_FROM_BYTES` runs
    at once."""
    bias = attention_bias(padding_mask)  # [b, 1, 1, s] or [b, 1, r, s]
    b, c = q.shape[0], ATTENTION_ROWS_PER_STEP
    if not isinstance(b, int) or b <= c:  # a symbolic batch (Keras building the model), or too few rows
        return _attention_rows(q, k, v, bias, scale)
    if b * q.shape[2] * q.shape[1] * k.shape[1] * 4 < ATTENTION_STEPS_FROM_BYTES:  # short texts: at once
        return _softmax_attention(q, k, v, bias, scale)
    steps = -(-b // c)

    def in_steps(t):  # [b, ...] -> [steps, c, ...]
        t = ops.pad(t, [(0, steps * c - b)] + [(0, 0)] * (len(t.shape) - 1))
        return ops.reshape(t, (steps, c) + tuple(t.shape[1:]))

    def step(carry, xs):
        return carry, _attention_rows(*xs, scale)

    _, out = ops.scan(step, 0, tuple(in_steps(t) for t in (q, k, v, bias)))  # [steps, c, r, n, d]
    return ops.reshape(out, (steps * c,) + tuple(out.shape[2:]))[:b]


def _kernel_with_dropout():
    """The chosen attention kernel when it applies attention dropout itself (`set_implementation`)."""
    kernel = _CHOSEN["attention_kernel"]
    return kernel if getattr(kernel, "with_dropout", False) else None


def _fused_attention(q, k, v, padding_mask, scale, dropout=0.0):
    """q, k, v [b, s, n, d], padding_mask [b, s] -> [b, s, n, d] through `ops.dot_product_attention`.

    The mask goes in as [b, 1, s, s]: cuDNN's fused kernel takes a mask only as a bias of the full
    [query, key] shape and refuses [b, 1, 1, s] (Keras then falls back to XLA's unfused attention).
    `dropout` (the attention dropout rate, 0.0 outside training) reaches only a kernel that applies it.

    Queries at rows ([b, r, n, d], the Pretrainer's last block: 1 + p of them, 21 at seq 128) go in as an
    even count: JAX refuses cuDNN's training kernel for an odd query count with a mask, and Keras then logs
    the refusal as an error and runs XLA's attention. The extra query is zeros, masked as the last one, and its
    output is dropped (queries do not interact, and the dropped output sends no gradient back to the keys and
    values, so the others' outputs and every gradient are unchanged).
    """
    rows = ops.shape(q)[1]
    if rows % 2 and rows != ops.shape(k)[1]:
        q = ops.pad(q, ((0, 0), (0, 1), (0, 0), (0, 0)))  # [b, r + 1, n, d]
        if len(padding_mask.shape) == 3:  # packed rows: each query's own [s] mask row; the extra one copies
            padding_mask = ops.concatenate([padding_mask, padding_mask[:, -1:]], axis=1)  # [b, r + 1, s]
        return _fused_attention(q, k, v, padding_mask, scale, dropout)[:, :rows]
    kernel = _CHOSEN["attention_kernel"]
    if kernel is not None:
        return kernel(q, k, v, padding_mask, scale, dropout=dropout) if _kernel_with_dropout() else kernel(
            q, k, v, padding_mask, scale)
    if len(padding_mask.shape) == 3:  # packed rows: [b, s, s] already ([b, r, s] for queries at rows)
        return ops.dot_product_attention(q, k, v, mask=ops.cast(padding_mask, "bool")[:, None], scale=scale)
    keep = ops.cast(padding_mask, "bool")[:, None, None, :]  # [b, 1, 1, s]
    if _CHOSEN["attention_mask"] == "square":
        b, queries, keys = ops.shape(q)[0], ops.shape(q)[1], ops.shape(k)[1]
        keep = ops.broadcast_to(keep, (b, 1, queries, keys))  # [b, 1, s, s] ([b, 1, r, s] at rows)
    return ops.dot_product_attention(q, k, v, mask=keep, scale=scale)


class Embeddings(keras.layers.Layer):
    """Token + position + segment embeddings, LayerNorm, dropout, and (ALBERT) projection e -> h.

    The token table is exposed as `token_embedding` so the masked-LM head can tie its output weights.
    """

    def __init__(self, config: ModelConfig, **kwargs):
        super().__init__(**kwargs)
        self.config = config
        init = initializer(config)
        e = config.embedding_dim
        self.token_embedding = keras.layers.Embedding(
            config.vocab_size, e, embeddings_initializer=init, dtype=self.dtype_policy, name="token_embedding")
        self.position_embedding = keras.layers.Embedding(
            config.max_position, e, embeddings_initializer=init, dtype=self.dtype_policy, name="position_embedding")
        self.segment_embedding = keras.layers.Embedding(
            config.type_vocab_size, e, embeddings_initializer=init, dtype=self.dtype_policy, name="segment_embedding")
        self.norm = LayerNorm(epsilon=config.layer_norm_epsilon, dtype=self.dtype_policy, name="norm")
        self.dropout = Dropout(config.dropout, dtype=self.dtype_policy)
        self.projection = None
        if e != config.hidden_size:
            self.projection = keras.layers.Dense(
                config.hidden_size, kernel_initializer=init, dtype=self.dtype_policy, name="projection")

    def build(self, token_ids_shape, segment_ids_shape=None):
        self.token_embedding.build(token_ids_shape)
        self.position_embedding.build((None,))
        self.segment_embedding.build(token_ids_shape)
        self.norm.build(tuple(token_ids_shape) + (self.config.embedding_dim,))
        if self.projection is not None:
            self.projection.build(tuple(token_ids_shape) + (self.config.embedding_dim,))

    def call(self, token_ids, segment_ids, positions=None, training=None):
        """Returns (embedding output [b, s, e] before projection, encoder input [b, s, h]). `positions`
        [b, s] or [1, s]: default 0..s-1 (packed rows pass their own, `packed_inputs`)."""
        if positions is None:
            # Position ids 0..s-1 as one row [1, s] that broadcasts over the batch, built from the input itself so
            # that symbolic lengths work on every backend. A [b, s] row per sequence made XLA constant-fold a
            # cumsum of b x s ones at every compilation (its "constant folding is taking > 1s" alarm at b=256)
            # and gather [b, s, h] rows where [1, s, h] are needed.
            positions = ops.cumsum(ops.ones_like(token_ids[:1], dtype="int32"), axis=1) - 1  # [1, s]
        if self.config.type_vocab_size == 1:  # one segment type (RoBERTa): a pair's second segment reads it too
            segment_ids = ops.zeros_like(segment_ids)
        x = (self.token_embedding(token_ids) + self.segment_embedding(segment_ids)
             + self.position_embedding(positions))
        x = self.dropout(self.norm(x), training=training)
        projected = self.projection(x) if self.projection is not None else x
        return x, projected


def _project_parts(dense, xs):
    """`ops.split(_project(dense, x), len(xs), axis=-1)` as one matmul per column slice of the kernel (and
    bias, and LoRA's B), the i-th slice applied to `xs[i]` (the same x, or the query's rows only). XLA's GPU
    program of the split form copies each third out of the [b, s, 3h] output, and its gradient concatenates
    the thirds' gradients back (two memory-bound passes over [b, s, 3h] per block); here only the small
    [h, 3h] kernel gradient is assembled from thirds, for three narrower matmuls and a sum of the input's
    three gradients."""
    width = dense.units // len(xs)
    return [_project(dense, x, slice(i * width, (i + 1) * width)) for i, x in enumerate(xs)]


def frozen_kernel(dense):
    """The kernel variable W of a Dense given LoRA factors (its `kernel` property is W + (alpha / r) A B)."""
    return next(v for v in dense.weights if v.path.endswith("/kernel"))


def _project(dense, x, cols: Optional[slice] = None):
    """`dense(x)`, or its output columns `cols` only (a slice of the kernel, bias and LoRA's B); for a
    projection given LoRA factors by `Dense.enable_lora` (`kbert.train.lora`), x W + b + (alpha / r) (x A) B.
    Keras' own Dense adds A B to W on every call, which keeps an [in, out] merged copy and takes its full-size
    gradient per layer; through x A the update never forms, and the backward pass skips the frozen W's gradient
    (for bert-large's 24 blocks about a third of the step's matmuls)."""
    lora = getattr(dense, "lora_enabled", False)
    if not lora and cols is None:
        return dense(x)
    cols = slice(None) if cols is None else cols
    y = ops.matmul(x, ops.cast(frozen_kernel(dense) if lora else dense.kernel, x.dtype)[:, cols])
    if dense.use_bias:
        y = y + ops.cast(dense.bias, x.dtype)[cols]
    if lora:
        low = ops.matmul(ops.matmul(x, ops.cast(dense.lora_kernel_a, x.dtype)),
                         ops.cast(dense.lora_kernel_b, x.dtype)[:, cols])
        y = y + low * ops.cast(dense.lora_alpha / dense.lora_rank, x.dtype)
    return y


class TransformerBlock(keras.layers.Layer):
    """Transformer encoder block: post-LayerNorm as in BERT, or pre-LayerNorm with `config.norm_first`.

    Query, key and value are one fused [h, 3h] projection: one large matmul runs faster than three
    small ones on every backend, and it converts losslessly from separate q/k/v weights.
    """

    def __init__(self, config: ModelConfig, **kwargs):
        super().__init__(**kwargs)
        self.config = config
        init = initializer(config)
        h, p = config.hidden_size, self.dtype_policy
        eps = config.layer_norm_epsilon
        self.qkv = keras.layers.Dense(3 * h, kernel_initializer=init, dtype=p, name="qkv")
        self.attention_output = keras.layers.Dense(h, kernel_initializer=init, dtype=p, name="attention_output")
        self.attention_norm = LayerNorm(epsilon=eps, dtype=p, name="attention_norm")
        self.intermediate = keras.layers.Dense(
            config.intermediate_size, kernel_initializer=init, dtype=p, name="intermediate")
        self.output_dense = keras.layers.Dense(h, kernel_initializer=init, dtype=p, name="output")
        self.output_norm = LayerNorm(epsilon=eps, dtype=p, name="output_norm")
        self.attention_dropout = Dropout(config.attention_dropout, dtype=p)
        self.hidden_dropout = Dropout(config.dropout, dtype=p)
        self.act = activation(config.hidden_act)
        self.scale = 1.0 / math.sqrt(config.head_size)

    def build(self, x_shape, padding_mask_shape=None):
        h, i = self.config.hidden_size, self.config.intermediate_size
        lead = tuple(x_shape[:-1])
        self.qkv.build(lead + (h,))
        self.attention_output.build(lead + (h,))
        self.attention_norm.build(lead + (h,))
        self.intermediate.build(lead + (h,))
        self.output_dense.build(lead + (i,))
        self.output_norm.build(lead + (h,))

    def call(self, x, padding_mask, training=None, rows=None):
        """x [b, s, h] -> [b, s, h]; with `rows` [b, r] int, the output at those positions only, [b, r, h]
        (keys and values still come from every token, so each row equals the full output's row there):
        a pretraining step reads the last layer at [CLS] and the masked positions alone, so for BERT-Base at
        seq 128 with 20 predictions the last block's attention output and feed-forward run on 21 rows, not 128."""
        at = (lambda t: t) if rows is None else (lambda t: gather_positions(t, rows))
        if self.config.norm_first:  # x + attn(LN(x)), then x + ffn(LN(x))
            x = at(x) + self._attention(self.attention_norm(x), padding_mask, training, rows)
            return x + self._feed_forward(self.output_norm(x), training)
        x = self.attention_norm(at(x) + self._attention(x, padding_mask, training, rows))
        return self.output_norm(x + self._feed_forward(x, training))

    def _attention(self, x, padding_mask, training, rows=None):
        cfg = self.config
        b, s = ops.shape(x)[0], ops.shape(x)[1]
        n, d = cfg.num_heads, cfg.head_size
        sliced = _CHOSEN["qkv"] == "sliced" and self.qkv.quantization_mode is None
        if sliced:
            q, k, v = _project_parts(self.qkv, [x if rows is None else gather_positions(x, rows), x, x])
            if rows is not None and len(padding_mask.shape) == 3:  # packed rows: each query's own [s] mask row
                padding_mask = gather_positions(padding_mask, rows)  # [b, r, s]
        else:
            # split (not slicing): its gradient is a concat, where a strided slice's gradient pads and adds.
            q, k, v = ops.split(_project(self.qkv, x), 3, axis=-1)  # [b, s, h] each
        if rows is not None and not sliced:
            # queries at `rows` only (the projection stays one fused [h, 3h] matmul over every token: the q
            # third of it at the other rows is the price of keeping one kernel)
            q = gather_positions(q, rows)  # [b, r, h]
            if len(padding_mask.shape) == 3:  # packed rows: each query's own [s] mask row
                padding_mask = gather_positions(padding_mask, rows)  # [b, r, s]
        q = ops.reshape(q, (b, ops.shape(q)[1], n, d))  # [b, s, n, d] ([b, r, n, d] at rows)
        k, v = (ops.reshape(t, (b, s, n, d)) for t in (k, v))  # [b, s, n, d]
        if _attention_in_steps_applies(training):
            context = _attention_in_steps(q, k, v, padding_mask, self.scale)  # [b, s, n, d]
        elif _fused_attention_applies(self.attention_dropout.rate, training):
            rate = self.attention_dropout.rate if training else 0.0
            context = _fused_attention(q, k, v, padding_mask, self.scale, rate)  # [b, s, n, d]
        else:
            context = _softmax_attention(q, k, v, attention_bias(padding_mask), self.scale,
                                         lambda p: self.attention_dropout(p, training=training))  # [b, s, n, d]
        context = ops.reshape(context, (b, ops.shape(q)[1], n * d))  # [b, s, h] ([b, r, h] at rows)
        return self.hidden_dropout(_project(self.attention_output, context), training=training)

    def _feed_forward(self, x, training):
        hidden = self.act(_project(self.intermediate, x))
        return self.hidden_dropout(_project(self.output_dense, hidden), training=training)


class Pooler(keras.layers.Layer):
    """tanh(W [CLS] + b): BERT's pooled output."""

    def __init__(self, config: ModelConfig, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(config.hidden_size, activation="tanh",
                                        kernel_initializer=initializer(config), dtype=self.dtype_policy,
                                        name="dense")
        self.hidden_size = config.hidden_size

    def build(self, x_shape):
        self.dense.build((x_shape[0], self.hidden_size))

    def call(self, x):
        return self.dense(x[:, 0, :])


def gather_positions(x, positions):
    """x [b, s, ...] (e.g. [b, s, h]), positions [b, p] int -> [b, p, ...].

    Float tensors of rank 3 are gathered as a product with one-hot rows, [b, p, s] x [b, s, h]: its
    gradient is another small batched matmul, where a gather's is a scatter-add, which XLA on CPU runs as
    a slow serial loop (the matmul costs 2 b p s h FLOPs, under 0.01% of a BERT-Base step). Other tensors
    take `take_along_axis`.
    """
    index = ops.cast(positions, "int32")
    if len(x.shape) == 3 and "float" in keras.backend.standardize_dtype(x.dtype):
        one_hot = ops.one_hot(index, ops.shape(x)[1], dtype=x.dtype)  # [b, p, s]
        return ops.einsum("bps,bsh->bph", one_hot, x)
    for _ in range(len(x.shape) - 2):
        index = index[..., None]  # [b, p, 1, ...]: broadcast over the trailing axes
    return ops.take_along_axis(x, index, axis=1)


class MaskedLMHead(keras.layers.Layer):
    """Masked-LM head: transform, LayerNorm, then logits against the tied token embedding table.

    Only the `p` masked positions are transformed and projected to the vocabulary, so the cost of the
    [*, v] matmul is p/s of a full-sequence head. Logits are float32 under any dtype policy.
    """

    def __init__(self, config: ModelConfig, token_embedding: keras.layers.Embedding, **kwargs):
        super().__init__(**kwargs)
        self.config = config
        self.token_embedding = token_embedding
        self.transform = keras.layers.Dense(config.embedding_dim, kernel_initializer=initializer(config),
                                            dtype=self.dtype_policy, name="transform")
        self.norm = LayerNorm(epsilon=config.layer_norm_epsilon, dtype=self.dtype_policy, name="norm")
        self.act = activation(config.hidden_act)

    def build(self, sequence_output_shape, mask_positions_shape=None):
        self.transform.build((None, None, self.config.hidden_size))
        self.norm.build((None, None, self.config.embedding_dim))
        self.bias = self.add_weight(name="bias", shape=(self.config.vocab_size,), initializer="zeros")

    def call(self, sequence_output, mask_positions):
        """sequence_output [b, s, h] and mask_positions [b, p] -> float32 logits [b, p, v]; mask_positions
        None: `sequence_output` holds the masked positions' states already ([b, p, h])."""
        x = sequence_output if mask_positions is None else gather_positions(sequence_output, mask_positions)
        x = self.norm(self.act(self.transform(x)))  # [b, p, e]
        table = ops.cast(self.token_embedding.embeddings, x.dtype)  # [v, e]
        logits = ops.matmul(x, ops.transpose(table))  # [b, p, v]
        return ops.cast(logits, "float32") + ops.cast(self.bias, "float32")


class PairHead(keras.layers.Layer):
    """Two-way classifier on the pooled output: next-sentence (BERT) or sentence-order (ALBERT)."""

    def __init__(self, config: ModelConfig, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2, kernel_initializer=initializer(config), dtype=self.dtype_policy,
                                        name="dense")
        self.hidden_size = config.hidden_size

    def build(self, x_shape):
        self.dense.build((None, self.hidden_size))

    def call(self, pooled):
        return ops.cast(self.dense(pooled), "float32")
