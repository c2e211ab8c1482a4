"""Model config, backbones, heads, serialization, mixed precision and bad input."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import kbert
from helpers import random_batch, run_on_jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny(architecture="bert", **kw):
    name = "bert-tiny" if architecture == "bert" else "albert-base"
    base = dict(vocab_size=99, max_position=64)
    if architecture == "albert":
        base.update(num_layers=2, hidden_size=32, num_heads=4, intermediate_size=37, embedding_size=16)
    base.update(kw)
    return kbert.ModelConfig.preset(name, **base)


# ----------------------------------------------------------------------------------------- config
def test_presets_have_documented_sizes():
    expect = {"bert-tiny": (2, 128), "bert-mini": (4, 256), "bert-small": (4, 512), "bert-medium": (8, 512),
              "bert-base": (12, 768), "bert-large": (24, 1024)}
    for name, (layers, hidden) in expect.items():
        cfg = kbert.ModelConfig.preset(name)
        assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (layers, hidden, 4 * hidden)
    assert kbert.ModelConfig.preset("bert-base").num_heads == 12
    assert kbert.ModelConfig.preset("bert-large").num_heads == 16
    for name in ("albert-base", "albert-large", "albert-xlarge"):
        cfg = kbert.ModelConfig.preset(name)
        assert cfg.architecture == "albert" and cfg.embedding_size == 128 and cfg.num_groups == 1


def test_config_json_round_trip(tmp_path):
    cfg = kbert.ModelConfig.preset("albert-large", vocab_size=12345)
    path = tmp_path / "c.json"
    cfg.to_json(str(path))
    assert kbert.ModelConfig.from_json(str(path)) == cfg
    assert kbert.ModelConfig.from_json(cfg.to_json()) == cfg


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(ValueError, match="Unknown model preset 'bert-huge'.*bert-base.*albert-xlarge"):
        kbert.ModelConfig.preset("bert-huge")


@pytest.mark.parametrize("kw,match", [
    (dict(hidden_size=100, num_heads=3), "divisible by `num_heads`"),
    (dict(vocab_size=0), "`vocab_size` must be a positive integer"),
    (dict(hidden_act="swish"), "`hidden_act` must be one of"),
    (dict(dropout=1.5), "`dropout` must be in"),
    (dict(architecture="gpt"), "`architecture` must be one of"),
    (dict(dropout=float("nan")), "`dropout` must be in"),
    (dict(initializer_range=float("nan")), "`initializer_range` must be a positive finite number"),
    (dict(layer_norm_epsilon=0.0), "`layer_norm_epsilon` must be a positive finite number"),
    (dict(layer_norm_epsilon=float("inf")), "`layer_norm_epsilon` must be a positive finite number"),
])
def test_bad_config_values_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        kbert.ModelConfig(**kw)


def test_unknown_config_field_is_named():
    with pytest.raises(ValueError, match=r"Unknown ModelConfig field\(s\): \['hiden_size'\]"):
        kbert.ModelConfig.from_dict({"hiden_size": 3})


@pytest.mark.parametrize("architecture", ["bert", "albert"])
def test_parameter_count_formula_matches_model(architecture):
    cfg = tiny(architecture)
    model = kbert.build_backbone(cfg)
    assert model.count_params() == cfg.num_parameters()


# --------------------------------------------------------------------------------------- backbones
@pytest.mark.parametrize("architecture", ["bert", "albert"])
def test_backbone_outputs_and_padding_invariance(architecture):
    cfg = tiny(architecture, dropout=0.0, attention_dropout=0.0)
    model = kbert.build_backbone(cfg, output_hidden_states=True)
    batch = random_batch(lengths=(5, 9), seq_len=9)
    out = model(batch)
    assert tuple(out["sequence_output"].shape) == (2, 9, cfg.hidden_size)
    assert tuple(out["pooled_output"].shape) == (2, cfg.hidden_size)
    assert len(out["hidden_states"]) == cfg.num_layers + 1
    # The short row must not see its padding: the same row without padding gives the same vectors.
    short = {k: v[:1, :5] for k, v in batch.items()}
    alone = model(short)["sequence_output"]
    np.testing.assert_allclose(np.asarray(out["sequence_output"])[0, :5], np.asarray(alone)[0], atol=1e-5)


def test_albert_shares_parameters_across_layers():
    cfg = tiny("albert", num_layers=6)
    model = kbert.build_backbone(cfg)
    assert len({id(b) for b in model.blocks}) == 1
    bigger = kbert.build_backbone(tiny("albert", num_layers=12))
    assert bigger.count_params() == model.count_params()
    grouped = kbert.build_backbone(tiny("albert", num_layers=6, num_groups=3))
    assert len({id(b) for b in grouped.blocks}) == 3


def test_backbone_rejects_wrong_architecture():
    with pytest.raises(ValueError, match="architecture='albert'"):
        kbert.BertBackbone(tiny("albert"))


def test_pretrainer_losses_and_accuracy():
    cfg = tiny("bert")
    model = kbert.Pretrainer(kbert.build_backbone(cfg))
    batch = random_batch()
    features = dict(batch, mask_positions=np.array([[1, 2], [1, 3], [2, 0], [0, 0]], "int32"))
    labels = {"mask_ids": np.array([[7, 8], [9, 10], [11, 0], [0, 0]], "int32"),
              "mask_weights": np.array([[1, 1], [1, 1], [1, 0], [0, 0]], "float32"),
              "pair_labels": np.array([0, 1, 0, 1], "int32")}
    out = model(features)
    assert tuple(out["mlm_logits"].shape) == (4, 2, 99) and tuple(out["pair_logits"].shape) == (4, 2)
    losses = model.compute_losses(features, labels)
    logits = np.asarray(out["mlm_logits"], "float64")
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    w = labels["mask_weights"]
    nll = -np.take_along_axis(logp, labels["mask_ids"][..., None], -1)[..., 0]
    np.testing.assert_allclose(float(losses["mlm_loss"]), (nll * w).sum() / w.sum(), rtol=1e-5)
    acc = ((logits.argmax(-1) == labels["mask_ids"]) * w).sum() / w.sum()
    np.testing.assert_allclose(float(losses["mlm_accuracy"]), acc, rtol=1e-6)
    assert float(losses["loss"]) == pytest.approx(float(losses["mlm_loss"]) + float(losses["pair_loss"]), rel=1e-6)


@pytest.mark.parametrize("architecture,norm_first", [("bert", False), ("bert", True), ("albert", False)])
def test_pretrainer_last_block_at_the_predicted_positions_equals_the_full_block(architecture, norm_first):
    """The Pretrainer runs its last block at [CLS] and the masked positions only (keys and values from every
    token): the logits are the full model's, and its rows are the full sequence output's rows there."""
    from kbert.models import layers

    assert layers.last_layer_at_predictions()  # kbert's default
    model = kbert.Pretrainer(kbert.build_backbone(tiny(architecture, norm_first=norm_first)))
    batch = random_batch()
    positions = np.array([[1, 2, 5], [3, 0, 0], [7, 7, 1], [0, 0, 0]], "int32")  # repeats and padding rows too
    features = dict(batch, mask_positions=positions)
    sparse = model(features, training=False)
    with layers.implementation(last_layer="full"):
        full = model(features, training=False)
    assert tuple(sparse["mlm_logits"].shape) == (4, 3, 99)
    for key in ("mlm_logits", "pair_logits"):
        np.testing.assert_allclose(np.asarray(sparse[key]), np.asarray(full[key]), atol=2e-5)
    rows = np.concatenate([np.zeros((4, 1), "int32"), positions], axis=1)
    at = np.asarray(model.backbone.sequence_output_at(batch, rows))
    seq = np.asarray(model.backbone(batch)["sequence_output"])
    np.testing.assert_allclose(at, np.take_along_axis(seq, rows[..., None], axis=1), atol=2e-5)


@pytest.mark.parametrize("lora", [False, True])
def test_qkv_from_kernel_slices_equals_the_split_projection(lora):
    """`qkv=sliced` (three matmuls with the fused kernel's column thirds, the query's only at the predicted rows)
    gives the fused projection's logits and every weight's gradient, LoRA factors included."""
    import tensorflow as tf

    from kbert.models import layers
    from kbert.train.lora import enable_lora

    model = kbert.Pretrainer(kbert.build_backbone(tiny("bert", dropout=0.0, attention_dropout=0.0)))
    batch = random_batch()
    features = dict(batch, mask_positions=np.array([[1, 2, 5], [3, 0, 0], [7, 7, 1], [0, 0, 0]], "int32"))
    model(features, training=False)
    if lora:
        rng = np.random.default_rng(0)
        for dense in enable_lora(model.backbone, 4):
            dense.lora_kernel_b.assign(rng.normal(0, 0.05, dense.lora_kernel_b.shape).astype("float32"))
    out = {}
    for choice in ("fused", "sliced"):
        with layers.implementation(qkv=choice), tf.GradientTape() as tape:
            logits = model(features, training=True)["mlm_logits"]
            loss = tf.reduce_sum(logits * np.linspace(-1, 1, logits.shape[-1], dtype="float32"))
        grads = tape.gradient(loss, model.trainable_variables)
        out[choice] = [np.asarray(logits)] + [None if g is None else np.asarray(tf.convert_to_tensor(g))
                                              for g in grads]  # None: the pooler's (NSP is not in this loss)
    names = [v.path for v in model.trainable_variables]
    assert any("qkv" in n for n in names) and len(out["fused"]) == len(names) + 1
    assert [g is None for g in out["fused"]] == [g is None for g in out["sliced"]]
    qkv_grads = sum(g is not None and "qkv" in n for n, g in zip(names, out["sliced"][1:]))
    assert qkv_grads == (6 if lora else 4)  # per block: the bias, and the kernel or LoRA's A and B
    for name, a, b in zip(["logits"] + names, out["fused"], out["sliced"]):
        if a is not None:
            np.testing.assert_allclose(b, a, atol=2e-5, rtol=1e-4, err_msg=name)


QKV_SLICED_JAX = r"""
import json, jax, numpy as np
import kbert
from kbert.models import layers
from kbert.train.probe import build_trainer, synthetic_batch
cfg = kbert.ModelConfig.preset("bert-tiny", vocab_size=300, dropout=0.0, attention_dropout=0.0)
trainer = build_trainer(cfg, "adamw", "float32")
x, y = synthetic_batch(cfg, 4, 32, 5)
trainer.train_on_batch(x, y)  # builds the optimizer and metrics
tv = [v.value for v in trainer.trainable_variables]
ntv = [v.value for v in trainer.non_trainable_variables]
mv = [v.value for v in trainer.metrics_variables]
ov = [v.value for v in trainer.optimizer.variables]
out = {}
for choice in ("fused", "sliced"):
    with layers.implementation(qkv=choice):
        loss, grads = jax.value_and_grad(lambda t: trainer.compute_loss_and_updates(
            t, ntv, mv, x, y, None, training=True, optimizer_variables=ov)[0])(tv)
    out[choice] = [float(loss)] + [np.asarray(g).ravel().tolist() for g in grads]
rel = [float(np.abs(np.subtract(a, b)).max() / (np.abs(a).max() + 1e-30))
       for a, b in zip(out["fused"][1:], out["sliced"][1:])]
print(json.dumps(dict(losses=[out["fused"][0], out["sliced"][0]], max_rel=max(rel), grads=len(rel))))
"""


def test_qkv_from_kernel_slices_equals_the_split_projection_on_jax():
    """The same on Keras' JAX backend (where the GPU runs it): the training loss and every weight's gradient."""
    pytest.importorskip("jax")
    out, _ = run_on_jax(QKV_SLICED_JAX)
    assert out["losses"][0] == pytest.approx(out["losses"][1], rel=1e-6) and out["grads"] > 20, out
    assert out["max_rel"] < 1e-4, out


LAYER_NORM_CHECK = r"""
import json, sys
import keras, numpy as np
from keras import ops
from kbert.models import layers

rng = np.random.default_rng(0)
x = rng.normal(0.3, 2.0, (3, 5, 16)).astype("float32")
gamma, beta = rng.normal(1, 0.2, 16).astype("float32"), rng.normal(0, 0.2, 16).astype("float32")
w = rng.normal(size=(3, 5, 16)).astype("float32")  # the upstream gradient


def grads(fn, *args):
    if keras.backend.backend() == "jax":
        import jax
        return jax.grad(lambda *a: (ops.cast(fn(*a), "float32") * w).sum(), argnums=tuple(range(len(args))))(*args)
    import tensorflow as tf
    args = [tf.constant(a) for a in args]
    with tf.GradientTape() as tape:
        tape.watch(args)
        loss = tf.reduce_sum(tf.cast(fn(*args), "float32") * w)
    return tape.gradient(loss, args)


out = {}
# float32 in, so the hand-written backward is checked against autodiff of Keras' form to float32 precision
mine = grads(layers._layer_norm_16(1e-12), x, gamma, beta)
keras_ = grads(lambda *a: ops.layer_normalization(*a, epsilon=1e-12), x, gamma, beta)
out["float32"] = [float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())
                  for a, b in zip(mine, keras_)]
# the layer under mixed_bfloat16 against Keras' LayerNormalization with the same weights
norms = {}
for name, cls in (("kbert", layers.LayerNorm), ("keras", keras.layers.LayerNormalization)):
    norm = cls(epsilon=1e-12, dtype="mixed_bfloat16", name="norm")
    norm.build((None, 5, 16))
    norm.set_weights([gamma, beta])
    norms[name] = norm
out["names"] = [[v.path for v in n.weights] for n in norms.values()]
xb = ops.cast(x, "bfloat16")
y = {k: np.asarray(ops.cast(n(xb), "float32")) for k, n in norms.items()}
with layers.implementation(layer_norm="two_pass_stats"):  # Keras' `ops.moments`: Keras' result to the bit
    out["two_pass_equal"] = bool((np.asarray(ops.cast(norms["kbert"](xb), "float32")) == y["keras"]).all())
# one pass (the default): within bfloat16's rounding of Keras' result (a statistic a float32 ulp apart can move
# an output across a rounding boundary)
diff = np.abs(y["kbert"] - y["keras"])
out["one_pass_ulps"] = float((diff / np.maximum(np.abs(y["keras"]), 1e-30)).max() * 2 ** 8)
out["one_pass_differ"] = float((diff > 0).mean())
# against float64 statistics: rows with a mean 30 times their spread, and a constant row (variance 0)
shifted = np.concatenate([rng.normal(30.0, 1.0, (4, 64)), np.full((1, 64), 7.0)]).astype("float32")
sb = np.asarray(ops.cast(ops.cast(shifted, "bfloat16"), "float32"), "float64")  # the input as rounded
ref = (sb - sb.mean(-1, keepdims=True)) / np.sqrt(sb.var(-1, keepdims=True) + 1e-12)
one = layers.LayerNorm(epsilon=1e-12, dtype="mixed_bfloat16")
one.build((None, 64))
got = np.asarray(ops.cast(one(ops.cast(shifted, "bfloat16")), "float32"))
out["shifted_error"] = float(np.abs(got[:4] - ref[:4]).max())
out["constant_row"] = got[4].tolist()
out["dtype"] = keras.backend.standardize_dtype(norms["kbert"](xb).dtype)
g = {k: grads(lambda t, n=n: n(t), xb) for k, n in norms.items()}
out["bf16_dx"] = float(np.abs(np.asarray(g["kbert"][0], "float32") - np.asarray(g["keras"][0], "float32")).max()
                       / np.abs(np.asarray(g["keras"][0], "float32")).max())
print(json.dumps(out))
"""


def _check_layer_norm(out):
    assert max(out["float32"]) < 1e-6, out  # dx, dgamma, dbeta
    assert out["names"][0] == out["names"][1], out  # the same variables: checkpoints load either way
    assert out["two_pass_equal"] and out["dtype"] == "bfloat16", out
    assert out["one_pass_ulps"] <= 1.01 and out["one_pass_differ"] < 0.05, out  # a rounding step, rarely
    assert out["shifted_error"] < 0.04, out  # bfloat16's rounding of values up to about 3
    assert out["constant_row"] == [0.0] * 64, out  # beta (0): no NaN from a negative rounded variance
    assert out["bf16_dx"] < 2e-2, out  # both round a float32 gradient to bfloat16


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_layer_norm_backward_keeps_the_16bit_input_and_equals_keras(backend):
    """kbert's LayerNorm: Keras' forward (to the bit with Keras' two-pass statistics; with the one-pass ones of
    the default, within bfloat16's rounding, and exact on rows far from zero mean and on constant rows), and a
    hand-written backward pass (so that it keeps the 16-bit input rather than a float32 copy) equal to autodiff
    of Keras' form."""
    if backend == "jax":
        pytest.importorskip("jax")
        out, _ = run_on_jax(LAYER_NORM_CHECK)
    else:
        proc = subprocess.run([sys.executable, "-c", LAYER_NORM_CHECK], capture_output=True, text=True,
                              env=dict(os.environ, KERAS_BACKEND="tensorflow"), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    _check_layer_norm(out)


LAYER_NORM_BYTES = r"""
import json, sys
sys.modules["tensorflow"] = None
import kbert
from kbert.models import layers
from kbert.train.probe import CompiledStep, build_trainer
cfg = kbert.ModelConfig.preset("bert-tiny", vocab_size=200, hidden_size=64, num_heads=2, intermediate_size=128,
                               max_position=64)
out = {}
for choice in ("saved_input", "keras"):
    layers.set_implementation(layer_norm=choice)
    out[choice] = CompiledStep(build_trainer(cfg, "adamw", "mixed_bfloat16"), cfg, 64).bytes(16)
print(json.dumps(out))
"""


def test_layer_norm_keeps_less_in_the_compiled_training_step():
    """What the hand-written backward is for: XLA's program for a bf16 training step needs about one float32
    [b, s, h] tensor less per LayerNorm live at the peak (bert-tiny: the embeddings' and two a block, the last
    block's at the predicted rows only)."""
    pytest.importorskip("jax")
    out, _ = run_on_jax(LAYER_NORM_BYTES)
    tensor = 16 * 64 * 64 * 4
    assert out["keras"] - out["saved_input"] >= 2.5 * tensor, out


def test_mlm_head_is_tied_to_token_embedding():
    model = kbert.Pretrainer(kbert.build_backbone(tiny("bert")))
    from kbert.models.io import build_pretrainer

    build_pretrainer(model)
    paths = [v.path for v in model.trainable_weights]
    assert len(paths) == len(set(paths))
    assert not any("mlm_head" in p and "embeddings" in p for p in paths)
    assert model.mlm_head.token_embedding is model.backbone.token_embedding


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_dropout_rate_independence_and_expectation(policy):
    """kbert's Dropout (two elements per random draw) drops at the configured rate, independently in the
    two halves that share a draw, keeps expectations, draws a fresh mask each call, and is the identity
    when not training."""
    from kbert.models.layers import Dropout

    layer = Dropout(0.1, seed=7, dtype=policy)
    x = np.ones((64, 128, 256), "float32")
    y = np.asarray(layer(x, training=True), "float32")
    dropped = y == 0
    assert abs(dropped.mean() - 0.1) < 0.002
    assert abs(y.mean() - 1.0) < 0.005 and np.allclose(y[~dropped], 1 / (1 - 3277 / 32768), rtol=1e-2)
    flat = dropped.reshape(-1)
    both = (flat[:flat.size // 2] & flat[flat.size // 2:]).mean()  # the two halves of one 30-bit draw
    assert abs(both - 0.01) < 0.001
    assert (np.asarray(layer(x, training=True), "float32") != y).mean() > 0.15  # a new mask each call
    assert np.array_equal(np.asarray(layer(x, training=False), "float32"), x)
    odd = np.asarray(Dropout(0.5, seed=1)(np.ones((255, 7), "float32"), training=True))
    assert 0.4 < (odd == 0).mean() < 0.6  # an odd number of elements: the last draw's high half unused
    # The same mask whether a traced function knows the shape or not: a fine-tuning run retraced with relaxed
    # shapes ([None, None, h]) and its resumed run's exact-shaped first trace must drop the same elements.
    import tensorflow as tf

    masks = []
    for signature in (None, [tf.TensorSpec([None, None, None])]):
        keras.utils.set_random_seed(0)
        layer = Dropout(0.1, seed=7)
        masks.append(np.asarray(tf.function(lambda v: layer(v, training=True), input_signature=signature)(
            np.ones((4, 10, 7), "float32"))) == 0)
    assert np.array_equal(*masks) and masks[0].any()
    assert np.array_equal(np.asarray(Dropout(0.0)(x, training=True)), x)
    with pytest.raises(ValueError, match="rate"):
        Dropout(1.0)


JAX_DROPOUT = r"""
import json, numpy as np, jax, keras
from kbert.models.layers import Dropout, set_implementation
assert keras.backend.backend() == "jax"
out = {}
for masks_impl in ("auto", "hash2"):
    set_implementation(dropout_masks=masks_impl)
    res = out[masks_impl] = {}
    for policy in ("float32", "mixed_bfloat16"):
        layer = Dropout(0.1, seed=7, dtype=policy)
        x = np.ones((64, 128, 256), "float32")
        y, y2 = (np.asarray(layer(x, training=True), "float32") for _ in range(2))
        d, d2 = y == 0, y2 == 0
        other = np.asarray(Dropout(0.1, seed=8, dtype=policy)(x, training=True), "float32") == 0
        flat = d.reshape(-1)
        res[policy] = dict(rate=float(d.mean()), mean=float(y.mean()), kept=float(y[~d].min()),
                           both_calls=float((d & d2).mean()), neighbours=float((d[..., 1:] & d[..., :-1]).mean()),
                           rows=float((d[1:] & d[:-1]).mean()), next_seed=float((d & other).mean()),
                           # counters 2^16 and 2^20 apart (a multiplier's low bits do not mix upward alone)
                           lag16=float((flat[65536:] & flat[:-65536]).mean()),
                           lag20=float((flat[1 << 20:] & flat[:-(1 << 20)]).mean()),
                           eval_identity=bool(np.array_equal(np.asarray(layer(x, training=False), "float32"), x)))
    # under jit, the seed generator's state threads through stateless calls: a fresh mask per step
    layer = Dropout(0.25, seed=3)
    step = jax.jit(lambda state, x: layer.stateless_call([], state, x, training=True))
    state = [v.value for v in layer.non_trainable_variables]
    masks = []
    for _ in range(3):
        y, state = step(state, np.ones((512, 512), "float32"))
        masks.append(np.asarray(y) == 0)
    res["jit"] = dict(rates=[float(m.mean()) for m in masks], overlap=float((masks[0] & masks[1]).mean()),
                      overlap2=float((masks[1] & masks[2]).mean()))
print(json.dumps(out))
"""


def test_dropout_on_jax_draws_masks_from_a_counter_hash():
    """On JAX the masks come from a counter hash fused into the neighbouring kernels: the same statistics
    (rate, expectation, independence between neighbours, rows, counters far apart, calls and layers) as a
    random-number generator, for the one-round hash (the default) and the two-round one it replaced."""
    pytest.importorskip("jax")
    out, _ = run_on_jax(JAX_DROPOUT)
    for impl, res in out.items():
        for policy in ("float32", "mixed_bfloat16"):
            r = res[policy]
            assert abs(r["rate"] - 0.1) < 0.002 and abs(r["mean"] - 1.0) < 0.005, (impl, r)
            assert r["kept"] == pytest.approx(1 / 0.9, rel=1e-2) and r["eval_identity"]
            for pair in ("both_calls", "neighbours", "rows", "next_seed", "lag16", "lag20"):
                assert abs(r[pair] - 0.01) < 0.001, (impl, policy, pair, r)  # independent: P(both) = 0.1^2
        assert all(abs(rate - 0.25) < 0.005 for rate in res["jit"]["rates"]), impl
        assert abs(res["jit"]["overlap"] - 0.0625) < 0.004 and abs(res["jit"]["overlap2"] - 0.0625) < 0.004, impl


def test_exact_gelu_matches_keras_and_keeps_16_bit_dtypes():
    """kbert's GELU (erf form, float32 inside for 16-bit inputs: TensorFlow's bfloat16 erfc is a slow
    scalar loop) is Keras' exact GELU: to 2e-6 in float32, to bfloat16's rounding in bfloat16, with the
    same gradient, and returns the input's dtype."""
    from kbert.models.layers import gelu

    x = np.concatenate([np.linspace(-12, 12, 4001), np.random.default_rng(0).normal(0, 4, 4000)]).astype("float32")
    want = np.asarray(keras.ops.gelu(x, approximate=False))
    assert np.abs(np.asarray(gelu(x)) - want).max() < 2e-6
    for dtype in ("bfloat16", "float16"):
        y = gelu(keras.ops.cast(x, dtype))
        assert keras.backend.standardize_dtype(y.dtype) == dtype
        xr = np.asarray(keras.ops.cast(keras.ops.cast(x, dtype), "float32"))  # the input as rounded
        ref = np.asarray(keras.ops.gelu(xr, approximate=False))
        assert np.allclose(np.asarray(keras.ops.cast(y, "float32")), ref, rtol=1e-2, atol=1e-3)
    import tensorflow as tf

    v = tf.constant(x)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(v)
        mine, theirs = gelu(v), keras.ops.gelu(v, approximate=False)
    assert np.abs(tape.gradient(mine, v).numpy() - tape.gradient(theirs, v).numpy()).max() < 1e-5


@pytest.mark.slow
def test_pretrainer_fit_lowers_loss():
    cfg = tiny("bert", dropout=0.0, attention_dropout=0.0)
    model = kbert.Pretrainer(kbert.build_backbone(cfg), pair_objective=None)
    batch = random_batch(lengths=(12,) * 8, seq_len=12)
    features = dict(batch, mask_positions=np.tile(np.arange(1, 4, dtype="int32"), (8, 1)))
    labels = {"mask_ids": batch["token_ids"][:, 1:4], "mask_weights": np.ones((8, 3), "float32")}
    model.compile(optimizer=keras.optimizers.Adam(3e-3))
    before = float(model.compute_losses(features, labels)["loss"])
    model.fit(features, labels, epochs=30, batch_size=8, verbose=0)
    assert float(model.compute_losses(features, labels)["loss"]) < 0.5 * before


# --------------------------------------------------------------------------------- mixed precision
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("architecture", ["bert", "albert"])
def test_mixed_precision_dtypes(policy, architecture):
    keras.config.set_dtype_policy(policy)
    model = kbert.Pretrainer(kbert.build_backbone(tiny(architecture)))
    batch = random_batch()
    features = dict(batch, mask_positions=np.zeros((4, 2), "int32"))
    out = model(features)
    compute = policy.split("_")[1]
    assert model.backbone(batch)["sequence_output"].dtype == compute
    assert all(v.dtype == "float32" for v in model.weights)
    assert out["mlm_logits"].dtype == "float32" and out["pair_logits"].dtype == "float32"
    losses = model.compute_losses(features, {"mask_ids": np.ones((4, 2), "int32"),
                                             "pair_labels": np.zeros((4,), "int32")})
    assert all(v.dtype == "float32" and np.isfinite(float(v)) for v in losses.values())


def test_dtype_argument_overrides_global_policy():
    model = kbert.build_backbone(tiny("bert"), dtype="mixed_bfloat16")
    assert model(random_batch())["sequence_output"].dtype == "bfloat16"


# ----------------------------------------------------------------------------------- save and load
@pytest.mark.parametrize("architecture", ["bert", "albert"])
def test_save_load_round_trip(tmp_path, architecture):
    cfg = tiny(architecture)
    model = kbert.Pretrainer(kbert.build_backbone(cfg))
    batch = random_batch()
    features = dict(batch, mask_positions=np.ones((4, 3), "int32"))
    out = model(features)
    kbert.save_model(model, str(tmp_path / "m"))
    assert sorted(os.listdir(tmp_path / "m")) == ["kbert_config.json", "kbert_weights.safetensors"]
    umask = os.umask(0)
    os.umask(umask)
    # as the config beside it: safetensors 0.8 alone wrote 0600, weights another account could not read
    assert os.stat(tmp_path / "m" / "kbert_weights.safetensors").st_mode & 0o777 == 0o666 & ~umask

    again = kbert.load_model(str(tmp_path / "m"), with_heads=True)
    out2 = again(features)
    for k in out:
        assert np.max(np.abs(np.asarray(out[k]) - np.asarray(out2[k]))) <= 1e-6
    backbone = kbert.load_model(str(tmp_path / "m"))
    assert type(backbone) is type(model.backbone) and backbone.config == cfg
    np.testing.assert_allclose(np.asarray(backbone(batch)["sequence_output"]),
                               np.asarray(model.backbone(batch)["sequence_output"]), atol=1e-6)


def test_a_pretrainer_saved_before_its_first_call_saves_its_heads(tmp_path):
    """`kbert.save_model(kbert.Pretrainer(backbone), dir)` straight away: the heads exist only after a call, and
    the dir would say it has heads it lacks (loading it with heads failed); save_model builds them first."""
    model = kbert.Pretrainer(kbert.build_backbone(tiny("bert")))
    kbert.save_model(model, str(tmp_path / "m"))
    again = kbert.load_model(str(tmp_path / "m"), with_heads=True)
    features = dict(random_batch(), mask_positions=np.ones((4, 3), "int32"))
    for k, v in model(features).items():
        np.testing.assert_allclose(np.asarray(again(features)[k]), np.asarray(v), atol=1e-6)


def test_backbone_dir_loads_with_fresh_heads(tmp_path):
    backbone = kbert.build_backbone(tiny("bert"))
    kbert.save_model(backbone, str(tmp_path / "b"))
    model = kbert.load_model(str(tmp_path / "b"), with_heads=True)
    assert isinstance(model, kbert.Pretrainer)
    batch = random_batch()
    np.testing.assert_allclose(np.asarray(model.backbone(batch)["sequence_output"]),
                               np.asarray(backbone(batch)["sequence_output"]), atol=1e-6)


def test_keras_serialization_round_trip(tmp_path):
    model = kbert.build_backbone(tiny("albert"))
    path = str(tmp_path / "m.keras")
    model.save(path)
    again = keras.saving.load_model(path)
    batch = random_batch()
    np.testing.assert_allclose(np.asarray(again(batch)["sequence_output"]),
                               np.asarray(model(batch)["sequence_output"]), atol=1e-6)


def test_load_missing_dir_and_missing_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="Model directory not found"):
        kbert.load_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="is not a model directory"):
        kbert.load_model(str(tmp_path / "empty"))
    kbert.save_model(kbert.build_backbone(tiny("bert")), str(tmp_path / "m"))
    os.remove(tmp_path / "m" / "kbert_weights.safetensors")
    with pytest.raises(FileNotFoundError, match="no weight file kbert_weights.safetensors"):
        kbert.load_model(str(tmp_path / "m"))


def _saved_with_edited_config(tmp_path, **fields):
    """Saves a tiny BERT to tmp_path/m, then rewrites fields of its config (the weights stay)."""
    kbert.save_model(kbert.build_backbone(tiny("bert")), str(tmp_path / "m"))
    meta_path = tmp_path / "m" / "kbert_config.json"
    meta = json.loads(meta_path.read_text())
    meta["model"].update(fields)
    meta_path.write_text(json.dumps(meta))


def test_vocab_size_mismatch_on_load_is_named(tmp_path):
    _saved_with_edited_config(tmp_path, vocab_size=120)
    with pytest.raises(ValueError, match=r"(?s)vocab_size mismatch.*token_embedding.*\(99, 128\).*\(120, 128\)"):
        kbert.load_model(str(tmp_path / "m"))


def test_mismatched_shapes_are_named(tmp_path):
    _saved_with_edited_config(tmp_path, intermediate_size=256)
    with pytest.raises(ValueError, match=r"layer_0/intermediate/kernel: checkpoint has shape \(128, 512\)"):
        kbert.load_model(str(tmp_path / "m"))


def test_missing_and_unexpected_weights_are_named(tmp_path):
    _saved_with_edited_config(tmp_path, num_layers=3)
    with pytest.raises(ValueError, match=r"Missing: \['layer_2/"):
        kbert.load_model(str(tmp_path / "m"))


def test_hf_dir_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 10}))
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['hidden_size'"):
        kbert.load_model(str(tmp_path))
    cfg = dict(model_type="bert", vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="no weight file"):
        kbert.load_model(str(tmp_path))


def test_unsupported_hf_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        kbert.load_model(str(tmp_path))


# ---------------------------------------------------------------------------- backend independence
def test_models_package_uses_keras_ops_only():
    """The model code imports no backend (TensorFlow, JAX, torch) at any level, so it runs on each of
    Keras' backends; only `convert.py` reads foreign checkpoint files (TF1, torch) and imports their
    library for that, inside the reading function."""
    import ast

    models_dir = os.path.join(ROOT, "kbert", "models")
    backends = {"tensorflow", "tf_keras", "jax", "jaxlib", "torch", "flax"}
    for name in sorted(os.listdir(models_dir)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(models_dir, name), encoding="utf-8").read())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            used = {n.split(".")[0] for n in names} & backends
            if name == "convert.py" and used:
                assert used <= {"tensorflow", "torch"} and node.col_offset > 0, f"kbert/models/{name}: {used}"
            else:
                assert not used, f"kbert/models/{name}:{node.lineno} imports {used}"


JAX_SCRIPT = r"""
import json, sys, numpy as np
import keras
assert keras.backend.backend() == "jax", keras.backend.backend()
import kbert
from kbert.models.io import load_kbert_dir
model = load_kbert_dir(sys.argv[1], with_heads=True)
batch = {k: np.asarray(v, "int32") for k, v in json.load(open(sys.argv[2])).items()}
out = model(batch)
np.savez(sys.argv[3], mlm=np.asarray(out["mlm_logits"]), pair=np.asarray(out["pair_logits"]),
         seq=np.asarray(model.backbone({k: batch[k] for k in ("token_ids", "segment_ids", "padding_mask")})["sequence_output"]))
# Training with attention dropout 0 takes the fused `ops.dot_product_attention` path: the same outputs and
# gradients as the explicit einsum-softmax-einsum form.
import dataclasses, jax
from kbert.models import layers
keras.utils.set_random_seed(0)  # the same random weights every run
plain = kbert.build_backbone(dataclasses.replace(model.config, dropout=0.0, attention_dropout=0.0))
inputs = {k: batch[k] for k in ("token_ids", "segment_ids", "padding_mask")}
keep = batch["padding_mask"].astype(bool)
def run(fused):
    layers.set_implementation(attention="auto" if fused else "explicit")
    def loss(tv):
        out, _ = plain.stateless_call(tv, [v.value for v in plain.non_trainable_variables], inputs,
                                      training=True)
        return (out["sequence_output"] ** 2 * keep[..., None]).sum(), out["sequence_output"]
    # jitted as a training step is (and one compilation is quicker on CPU than op-by-op dispatch)
    (value, seq), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))([v.value for v in plain.trainable_variables])
    return np.asarray(seq)[keep], [np.asarray(g) for g in grads]
(fused_seq, fused_grads), (plain_seq, plain_grads) = run(True), run(False)
np.testing.assert_allclose(fused_seq, plain_seq, atol=1e-5)
for a, b in zip(fused_grads, plain_grads):  # float32 summation-order noise scales with the gradient's size
    np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(np.abs(b).max())), rtol=1e-4)
# The Pretrainer's last block at [CLS] and the masked positions only (kbert's default): the same logits and
# gradients as the full last block, through the fused attention with 1 + p queries against s keys.
pretrainer = kbert.Pretrainer(plain)
features = dict(inputs, mask_positions=batch["mask_positions"])
pretrainer(features)
def heads(last_layer):
    layers.set_implementation(last_layer=last_layer)
    def loss(tv):
        out, _ = pretrainer.stateless_call(tv, [v.value for v in pretrainer.non_trainable_variables], features,
                                           training=True)
        return (out["mlm_logits"] ** 2).sum() + (out["pair_logits"] ** 2).sum(), out["mlm_logits"]
    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
        [v.value for v in pretrainer.trainable_variables])
    return np.asarray(logits), [np.asarray(g) for g in grads]
(sparse_logits, sparse_grads), (full_logits, full_grads) = heads("predicted"), heads("full")
layers.set_implementation()
np.testing.assert_allclose(sparse_logits, full_logits, atol=1e-4)
for a, b in zip(sparse_grads, full_grads):
    np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(np.abs(b).max())), rtol=1e-4)
# An attention kernel that applies attention dropout itself (benchmarks/gpu.py's cuDNN one) runs in training with
# attention dropout too, told the rate, and outside training told 0; a kernel without dropout is left out then.
seen = []
def kernel(q, k, v, padding_mask, scale, dropout=0.0):
    seen.append(dropout)
    return jax.nn.dot_product_attention(q, k, v, mask=padding_mask.astype(bool)[:, None, None, :], scale=scale)
kernel.with_dropout = True
dropping = kbert.build_backbone(dataclasses.replace(model.config, dropout=0.0, attention_dropout=0.1))
layers.set_implementation(attention_kernel=kernel)
dropping(inputs, training=True)
dropping(inputs, training=False)
n = model.config.num_layers
assert seen == [0.1] * n + [0.0] * n, seen
layers.set_implementation(attention_kernel=lambda q, k, v, padding_mask, scale: seen.append("plain") or kernel(
    q, k, v, padding_mask, scale))
seen.clear()
dropping(inputs, training=True)
assert seen == [], seen
dropping(inputs, training=False)
assert seen == ["plain", 0.0] * n, seen
layers.set_implementation()
# Inference on one CPU device runs attention a few batch rows at a time, in a loop (5 rows: a padded last
# step): the same outputs as the whole batch at once. (Each check traces a new function: jax caches traces.)
five = {k: np.concatenate([v, v[:1]]) for k, v in inputs.items()}
def encode(x):
    return plain.stateless_call([v.value for v in plain.trainable_variables],
                                [v.value for v in plain.non_trainable_variables], x)[0]["sequence_output"]
assert "scan" not in str(jax.make_jaxpr(encode)(five))  # a tiny batch's scores: the whole batch at once
layers.ATTENTION_STEPS_FROM_BYTES, before = 0, layers.ATTENTION_STEPS_FROM_BYTES  # as long texts' scores
assert layers.ATTENTION_ROWS_PER_STEP < 5 and "scan" in str(jax.make_jaxpr(lambda x: encode(x))(five))
stepped = np.asarray(encode(five))
layers.ATTENTION_STEPS_FROM_BYTES = before
with layers.implementation(attention="explicit"):
    assert "scan" not in str(jax.make_jaxpr(lambda x: encode(x))(five))
    whole = np.asarray(encode(five))
keep5 = five["padding_mask"].astype(bool)
np.testing.assert_allclose(stepped[keep5], whole[keep5], atol=1e-5)
# A training step runs on JAX too.
keras.config.set_dtype_policy("mixed_bfloat16")
bf = kbert.Pretrainer(kbert.build_backbone(model.config))
assert bf(batch)["mlm_logits"].dtype == "float32"
"""


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["bert", "albert"])
def test_same_outputs_on_jax_backend(tmp_path, architecture):
    pytest.importorskip("jax")
    model = kbert.Pretrainer(kbert.build_backbone(tiny(architecture)))
    batch = random_batch()
    features = dict(batch, mask_positions=np.array([[1, 2]] * 4, "int32"))
    out = model(features)
    kbert.save_model(model, str(tmp_path / "m"))
    (tmp_path / "batch.json").write_text(json.dumps({k: v.tolist() for k, v in features.items()}))
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", JAX_SCRIPT, str(tmp_path / "m"), str(tmp_path / "batch.json"),
                           str(tmp_path / "out.npz")], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jax_out = np.load(tmp_path / "out.npz")
    np.testing.assert_allclose(jax_out["mlm"], np.asarray(out["mlm_logits"]), atol=1e-4)
    np.testing.assert_allclose(jax_out["pair"], np.asarray(out["pair_logits"]), atol=1e-4)
    seq = np.asarray(model.backbone(batch)["sequence_output"])
    keep = batch["padding_mask"].astype(bool)
    np.testing.assert_allclose(jax_out["seq"][keep], seq[keep], atol=1e-4)


def test_corrupt_weight_file_is_named(tmp_path):
    kbert.save_model(kbert.build_backbone(tiny("bert")), str(tmp_path / "m"))
    weights = tmp_path / "m" / "kbert_weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="kbert_weights.safetensors is not a readable safetensors file"):
        kbert.load_model(str(tmp_path / "m"))


# ------------------------------------------------------------------------------------ ELECTRA
def _electra_case():
    cfg = kbert.ModelConfig.preset("bert-tiny", vocab_size=99, max_position=64)
    model = kbert.ElectraPretrainer(kbert.BertBackbone(cfg), generator_size=0.25, seed=0)
    batch = random_batch()  # lengths 9, 5, 12, 1
    features = dict(batch, mask_positions=np.array([[1, 3, 0], [2, 4, 0], [5, 6, 7], [0, 0, 0]], "int32"))
    labels = {"mask_ids": np.array([[11, 12, 0], [13, 14, 0], [15, 16, 17], [0, 0, 0]], "int32"),
              "mask_weights": np.array([[1, 1, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]], "float32")}
    return model, features, labels


def test_electra_generator_last_block_at_the_masked_positions_equals_the_full_block():
    from kbert.models import layers

    model, features, _ = _electra_case()
    sparse = np.asarray(model(features, training=False)["mlm_logits"])
    with layers.implementation(last_layer="full"):
        full = np.asarray(model(features, training=False)["mlm_logits"])
    assert sparse.shape == (4, 3, 99)
    np.testing.assert_allclose(sparse, full, atol=2e-5)


def test_electra_generator_is_a_quarter_of_the_discriminator():
    from kbert.models.electra import generator_config

    g = generator_config(kbert.ModelConfig.preset("bert-base", vocab_size=32000))
    assert (g.hidden_size, g.num_heads, g.intermediate_size, g.num_layers) == (192, 3, 768, 12)
    model, _, _ = _electra_case()
    assert model.generator.config.hidden_size == 32 and model.backbone.config.hidden_size == 128
    paths = [v.path for v in model.trainable_variables]
    assert len(paths) == len(set(paths))  # optimizer slots are keyed by path
    with pytest.raises(ValueError, match="generator_size"):
        kbert.ElectraPretrainer(model.backbone, generator_size=0.0)


def test_electra_corruption_replaces_only_real_masked_positions():
    model, features, labels = _electra_case()
    # a generator sure of token 40 everywhere, except that slot (2, 1) is sure of the original token 16
    logits = np.full((4, 3, 99), -1e4, "float32")
    logits[..., 40] = 1e4
    logits[2, 1, 40], logits[2, 1, 16] = -1e4, 1e4
    corrupted, replaced = (np.asarray(x) for x in model.corrupt(features, labels, logits))
    expect = features["token_ids"].copy()
    for b, row in enumerate(features["mask_positions"]):
        for slot, pos in enumerate(row):
            if labels["mask_weights"][b, slot]:
                expect[b, pos] = 16 if (b, slot) == (2, 1) else 40
    np.testing.assert_array_equal(corrupted, expect)  # padding slots (weight 0, position 0) leave [CLS] alone
    want = np.zeros_like(replaced)
    for b, pos in [(0, 1), (0, 3), (1, 2), (1, 4), (2, 5), (2, 7)]:  # (2, 6) got its original token back
        want[b, pos] = 1.0
    np.testing.assert_array_equal(replaced, want)


def test_electra_losses_and_gradients():
    import tensorflow as tf

    model, features, labels = _electra_case()
    with tf.GradientTape() as tape:
        losses = model.compute_losses(features, labels, training=True)
    for k in ("mlm_loss", "rtd_loss", "rtd_accuracy", "replaced_fraction", "mlm_accuracy"):
        assert np.isfinite(float(losses[k])), k
    np.testing.assert_allclose(float(losses["loss"]), float(losses["mlm_loss"]) + 50 * float(losses["rtd_loss"]),
                               rtol=1e-5)
    grads = dict(zip([v.path for v in model.trainable_variables],
                     tape.gradient(losses["loss"], model.trainable_variables)))
    # both networks learn; the discriminator's pooler is unused by the objective
    assert grads["generator/layer_0/qkv/kernel"] is not None and grads["layer_0/qkv/kernel"] is not None
    assert all(g is not None for p, g in grads.items() if "pooler" not in p), \
        [p for p, g in grads.items() if g is None]
