"""Numerical parity of kbert BERT/ALBERT with the `transformers` reference (CPU torch), both directions."""

import numpy as np
import pytest

import kbert
from helpers import all_positions, hf_outputs, max_abs_diff_valid, random_batch, tiny_hf_pretraining_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4

CASES = [
    ("bert", {}),
    ("albert", {}),
    ("albert", {"num_hidden_groups": 3}),  # every layer its own group
]


def _kbert_outputs(model, batch):
    features = dict(batch, mask_positions=all_positions(batch))
    backbone_out = model.backbone({k: batch[k] for k in batch})
    heads_out = model(features)
    return ([np.asarray(h) for h in backbone_out["hidden_states"]], np.asarray(heads_out["mlm_logits"]),
            np.asarray(heads_out["pair_logits"]))


def _assert_same(ours, ref, batch):
    hidden, mlm, pair = ours
    ref_hidden, ref_mlm, ref_pair = ref
    assert len(hidden) == len(ref_hidden)
    for i, (a, b) in enumerate(zip(hidden, ref_hidden)):
        assert a.shape == b.shape, f"hidden state {i}: {a.shape} vs {b.shape}"
        assert max_abs_diff_valid(a, b, batch["padding_mask"]) <= TOL, f"hidden state {i} differs"
    assert max_abs_diff_valid(mlm, ref_mlm, batch["padding_mask"]) <= TOL
    assert np.max(np.abs(pair - ref_pair)) <= TOL


@pytest.mark.parametrize("architecture,overrides", CASES)
def test_load_hf_matches_transformers(tmp_path, architecture, overrides):
    ref_model = tiny_hf_pretraining_model(architecture, **overrides)
    ref_model.save_pretrained(tmp_path / "hf")
    batch = random_batch()
    model = kbert.load_model(str(tmp_path / "hf"), with_heads=True, output_hidden_states=True)
    _assert_same(_kbert_outputs(model, batch), hf_outputs(ref_model, batch), batch)


@pytest.mark.parametrize("architecture,overrides", CASES)
def test_export_transformers_round_trip(tmp_path, architecture, overrides):
    ref_model = tiny_hf_pretraining_model(architecture, **overrides)
    ref_model.save_pretrained(tmp_path / "hf")
    model = kbert.load_model(str(tmp_path / "hf"), with_heads=True)
    kbert.export_transformers(model, str(tmp_path / "out"))

    batch = random_batch(seed=1)
    cls = type(ref_model)
    reloaded = cls.from_pretrained(str(tmp_path / "out")).eval()
    ref = hf_outputs(ref_model, batch)
    again = hf_outputs(reloaded, batch)
    for a, b in zip(ref[0] + [ref[1], ref[2]], again[0] + [again[1], again[2]]):
        assert np.max(np.abs(a - b)) <= 1e-6
    # The encoder alone through AutoModel, as users load it.
    auto = transformers.AutoModel.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        h = auto(input_ids=torch.tensor(batch["token_ids"], dtype=torch.long),
                 token_type_ids=torch.tensor(batch["segment_ids"], dtype=torch.long),
                 attention_mask=torch.tensor(batch["padding_mask"], dtype=torch.long)).last_hidden_state.numpy()
    assert max_abs_diff_valid(h, ref[0][-1], batch["padding_mask"]) <= TOL


def test_export_backbone_only_loads_in_automodel(tmp_path):
    ref_model = tiny_hf_pretraining_model("bert")
    ref_model.save_pretrained(tmp_path / "hf")
    backbone = kbert.load_model(str(tmp_path / "hf"))
    # no tokenizer given: said, since transformers 5 would read the dir with an empty vocabulary
    with pytest.warns(UserWarning, match="has no tokenizer"):
        kbert.export_transformers(backbone, str(tmp_path / "enc"))
    auto = transformers.AutoModel.from_pretrained(str(tmp_path / "enc")).eval()
    batch = random_batch(seed=2)
    with torch.no_grad():
        h = auto(input_ids=torch.tensor(batch["token_ids"], dtype=torch.long),
                 token_type_ids=torch.tensor(batch["segment_ids"], dtype=torch.long),
                 attention_mask=torch.tensor(batch["padding_mask"], dtype=torch.long)).last_hidden_state.numpy()
    ours = np.asarray(backbone(batch)["sequence_output"])
    assert max_abs_diff_valid(h, ours, batch["padding_mask"]) <= TOL


@pytest.mark.parametrize("architecture,legacy", [("bert", False), ("bert", True), ("albert", False)])
def test_pytorch_model_bin_is_read(tmp_path, architecture, legacy):
    """`pytorch_model.bin` (the only weights file of many 2020-21 Korean checkpoints) is read without torch,
    in torch.save's zip format and in the legacy format of torch < 1.6."""
    ref_model = tiny_hf_pretraining_model(architecture)
    ref_model.config.save_pretrained(tmp_path / "hf")
    torch.save(ref_model.state_dict(), tmp_path / "hf" / "pytorch_model.bin", _use_new_zipfile_serialization=not legacy)
    batch = random_batch()
    model = kbert.load_model(str(tmp_path / "hf"), with_heads=True, output_hidden_states=True)
    _assert_same(_kbert_outputs(model, batch), hf_outputs(ref_model, batch), batch)


def test_pytorch_model_bin_loads_where_torch_is_not_installed_and_runs_no_code(tmp_path):
    """The same dir in a process where torch cannot be imported gives the same vectors; a .bin whose pickle
    names anything but tensors and storages (here os.system) is refused before it runs."""
    import os
    import subprocess
    import sys

    ref_model = tiny_hf_pretraining_model("bert")
    ref_model.config.save_pretrained(tmp_path / "hf")
    torch.save(ref_model.state_dict(), tmp_path / "hf" / "pytorch_model.bin")
    batch = random_batch()
    np.savez(tmp_path / "batch.npz", **batch)
    script = ("import builtins, json, sys\n"
              "real = builtins.__import__\n"
              "def guard(name, *a, **k):\n"
              "    if name.split('.')[0] == 'torch':\n"
              "        raise ImportError('No module named torch')\n"
              "    return real(name, *a, **k)\n"
              "builtins.__import__ = guard\n"
              "import numpy as np, kbert\n"
              f"model = kbert.load_model({str(tmp_path / 'hf')!r})\n"
              f"batch = dict(np.load({str(tmp_path / 'batch.npz')!r}))\n"
              "out = model(batch)['sequence_output']\n"
              "print(json.dumps({'out': np.asarray(out).tolist(), 'torch': 'torch' in sys.modules}))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result["torch"]
    ours = np.asarray(kbert.load_model(str(tmp_path / "hf"))(batch)["sequence_output"])
    np.testing.assert_allclose(np.asarray(result["out"]), ours, atol=1e-6)

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo ran",))

    evil = tmp_path / "evil"
    evil.mkdir()
    ref_model.config.save_pretrained(evil)
    torch.save({"bert.embeddings.word_embeddings.weight": Payload()}, evil / "pytorch_model.bin")
    with pytest.raises(ValueError, match="system is not part of a tensor state dict"):
        kbert.load_model(str(evil))


def _write_tf1_checkpoint(ref_model, architecture, directory):
    """Writes the reference weights under Google's TF1 variable names (the layout of KcBERT / KoELECTRA /
    google-research/albert releases) with tf.compat.v1, independently of kbert's reader."""
    import json

    import tensorflow as tf

    state = {k: v.numpy() for k, v in ref_model.state_dict().items()}
    names = {}
    for k, v in state.items():
        if k.endswith("decoder.weight") or k.endswith("decoder.bias") or "position_ids" in k:
            continue
        n = k
        if architecture == "bert":
            n = n.replace("bert.", "bert/").replace("cls.predictions.bias", "cls/predictions/output_bias")
            n = n.replace("cls.seq_relationship.weight", "cls/seq_relationship/output_weights")
            n = n.replace("cls.seq_relationship.bias", "cls/seq_relationship/output_bias")
            n = n.replace("encoder.layer.", "encoder/layer_")
        else:
            n = n.replace("albert.", "bert/").replace("predictions.bias", "cls/predictions/output_bias")
            n = n.replace("sop_classifier.classifier.weight", "cls/seq_relationship/output_weights")
            n = n.replace("sop_classifier.classifier.bias", "cls/seq_relationship/output_bias")
            n = n.replace("predictions.dense", "cls/predictions/transform/dense")
            n = n.replace("predictions.LayerNorm", "cls/predictions/transform/LayerNorm")
            n = n.replace("bert/pooler.", "bert/pooler/dense.")
            for g in range(8):
                p = f"encoder.albert_layer_groups.{g}.albert_layers.0."
                t = f"encoder/transformer/group_{g}/inner_group_0/"
                n = n.replace(p + "attention.query", t + "attention_1/self/query")
                n = n.replace(p + "attention.key", t + "attention_1/self/key")
                n = n.replace(p + "attention.value", t + "attention_1/self/value")
                n = n.replace(p + "attention.dense", t + "attention_1/output/dense")
                n = n.replace(p + "attention.LayerNorm", t + "LayerNorm")
                n = n.replace(p + "ffn_output", t + "ffn_1/intermediate/output/dense")
                n = n.replace(p + "ffn", t + "ffn_1/intermediate/dense")
                n = n.replace(p + "full_layer_layer_norm", t + "LayerNorm_1")
        n = n.replace(".", "/")
        is_ln = "LayerNorm" in n or "layer_norm" in n
        is_embedding = "embeddings" in n and not is_ln
        if n.endswith("/weight"):
            if is_ln:
                n = n[:-len("weight")] + "gamma"
            elif is_embedding or n.endswith("output_weights"):
                n = n[:-len("/weight")]
            else:
                n = n[:-len("weight")] + "kernel"
                v = v.T
        elif n.endswith("/bias") and is_ln:
            n = n[:-len("bias")] + "beta"
        names[n] = v
    graph = tf.Graph()
    with graph.as_default():
        variables = [tf.compat.v1.Variable(v, name=n) for n, v in names.items()]
        variables.append(tf.compat.v1.Variable(0, name="global_step", dtype=tf.int64))
        saver = tf.compat.v1.train.Saver(variables)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saver.save(sess, str(directory / "model.ckpt"))
    cfg = ref_model.config.to_dict()
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
            "type_vocab_size", "initializer_range", "embedding_size", "num_hidden_groups", "inner_group_num")
    name = "bert_config.json" if architecture == "bert" else "albert_config.json"
    with open(directory / name, "w") as f:
        json.dump({k: cfg[k] for k in keep if k in cfg}, f)


@pytest.mark.parametrize("architecture", ["bert", "albert"])
def test_load_google_tf1_checkpoint(tmp_path, architecture):
    ref_model = tiny_hf_pretraining_model(architecture, layer_norm_eps=1e-12)
    _write_tf1_checkpoint(ref_model, architecture, tmp_path)
    batch = random_batch()
    model = kbert.load_model(str(tmp_path), with_heads=True, output_hidden_states=True)
    _assert_same(_kbert_outputs(model, batch), hf_outputs(ref_model, batch), batch)


def test_norm_first_matches_transformers_prelayernorm():
    """Pre-LayerNorm blocks (`norm_first=True`) against transformers' RobertaPreLayerNormModel.

    RoBERTa numbers positions from padding_idx + 1 = 2, so kbert's position table is its rows 2 onwards;
    the pre-attention norm is kbert's `attention_norm`, the pre-feed-forward norm `output_norm`.
    """
    from kbert.models.convert import hf_to_kbert
    from kbert.models.io import assign_weights

    torch.manual_seed(0)
    hf_config = transformers.RobertaPreLayerNormConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=66, type_vocab_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        pad_token_id=1, layer_norm_eps=1e-12)
    ref = transformers.RobertaPreLayerNormModel(hf_config).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    sd = {k: v.numpy() for k, v in ref.state_dict().items()}
    renamed = {}
    for name, value in sd.items():
        name = (name.replace(".attention.LayerNorm.", ".attention.output.LayerNorm.")
                .replace(".intermediate.LayerNorm.", ".output.LayerNorm."))
        if name == "embeddings.position_embeddings.weight":
            value = value[2:]
        renamed[name] = value
    config = kbert.ModelConfig(vocab_size=99, hidden_size=32, num_layers=3, num_heads=4, intermediate_size=37,
                               max_position=64, dropout=0.0, attention_dropout=0.0, norm_first=True)
    model = kbert.BertBackbone(config, output_hidden_states=True)
    mapped = hf_to_kbert(renamed, config)
    mapped["final_norm/gamma"], mapped["final_norm/beta"] = sd["LayerNorm.weight"], sd["LayerNorm.bias"]
    assign_weights(model, mapped, "RobertaPreLayerNormModel")
    assert model.count_params() == config.num_parameters()

    batch = random_batch()  # token ids >= 2, so RoBERTa's positions run 2, 3, ... over every token
    with torch.no_grad():
        out = ref(input_ids=torch.tensor(batch["token_ids"], dtype=torch.long),
                  token_type_ids=torch.tensor(batch["segment_ids"], dtype=torch.long),
                  attention_mask=torch.tensor(batch["padding_mask"], dtype=torch.long), output_hidden_states=True)
    ours = model(batch)
    valid = batch["padding_mask"]
    assert max_abs_diff_valid(ours["sequence_output"], out.last_hidden_state.numpy(), valid) <= TOL
    assert np.max(np.abs(np.asarray(ours["pooled_output"]) - out.pooler_output.numpy())) <= TOL
    for i in range(config.num_layers):  # unnormalized residual streams, as transformers returns them
        assert max_abs_diff_valid(ours["hidden_states"][i], out.hidden_states[i].numpy(), valid) <= TOL
    np.testing.assert_allclose(ours["hidden_states"][-1], ours["sequence_output"])
    with pytest.raises(ValueError, match="pre-LayerNorm"):
        kbert.export_transformers(model, "unused")


# ------------------------------------------------------------------------------------ ELECTRA (KoELECTRA)
def _tiny_electra(cls_name, seed=0, **overrides):
    """A random transformers ELECTRA model (noised like `tiny_hf_pretraining_model`) in eval mode."""
    common = dict(vocab_size=99, embedding_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                  intermediate_size=37, max_position_embeddings=64, type_vocab_size=2, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    common.update(overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(transformers.ElectraConfig(**common)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _electra_hidden_states(model, batch):
    base = model.electra if hasattr(model, "electra") else model
    with torch.no_grad():
        out = base(input_ids=torch.tensor(batch["token_ids"], dtype=torch.long),
                   token_type_ids=torch.tensor(batch["segment_ids"], dtype=torch.long),
                   attention_mask=torch.tensor(batch["padding_mask"], dtype=torch.long), output_hidden_states=True)
    return [h.numpy() for h in out.hidden_states]


def _assert_same_hidden(backbone, ref_hidden, batch):
    ours = backbone({k: batch[k] for k in batch})["hidden_states"]
    assert len(ours) == len(ref_hidden)
    for i, (a, b) in enumerate(zip(ours, ref_hidden)):
        assert max_abs_diff_valid(np.asarray(a), b, batch["padding_mask"]) <= TOL, f"hidden state {i} differs"


@pytest.mark.parametrize("cls_name", ["RobertaModel", "RobertaForMaskedLM"])
def test_load_hf_roberta_matches_transformers(tmp_path, cls_name):
    """RoBERTa (KLUE-RoBERTa and the Korean sentence models built on it): BERT with positions counted from
    pad_token_id + 1, one segment type and an `lm_head`. Every hidden state and the masked-LM logits match
    transformers on real tokens of a padded batch, whatever segment ids kbert is given (a pair's second
    segment reads the one type), and the model goes back out as a BERT dir that AutoModel reads alike."""
    config = transformers.RobertaConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, max_position_embeddings=66, pad_token_id=1,
                                        type_vocab_size=1, layer_norm_eps=1e-5)
    torch.manual_seed(0)
    ref = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ref.save_pretrained(tmp_path / "hf")
    batch = random_batch()  # segment ids 1 on each row's second half: kbert reads them as type 0
    ids = torch.tensor(np.where(batch["padding_mask"] > 0, batch["token_ids"], 1), dtype=torch.long)
    with torch.no_grad():
        out = ref(input_ids=ids, attention_mask=torch.tensor(batch["padding_mask"], dtype=torch.long),
                  output_hidden_states=True)
    heads = cls_name == "RobertaForMaskedLM"
    model = kbert.load_model(str(tmp_path / "hf"), with_heads=heads, output_hidden_states=True)
    backbone = model.backbone if heads else model
    assert backbone.config.max_position == 64 and backbone.config.type_vocab_size == 1
    _assert_same_hidden(backbone, [h.numpy() for h in out.hidden_states], batch)
    if heads:
        logits = np.asarray(model(dict(batch, mask_positions=all_positions(batch)))["mlm_logits"])
        assert max_abs_diff_valid(logits, out.logits.numpy(), batch["padding_mask"]) <= TOL
    kbert.export_transformers(backbone, str(tmp_path / "bert"))
    again = transformers.AutoModel.from_pretrained(str(tmp_path / "bert")).eval()
    with torch.no_grad():
        h = again(input_ids=torch.tensor(batch["token_ids"], dtype=torch.long),
                  attention_mask=torch.tensor(batch["padding_mask"], dtype=torch.long)).last_hidden_state.numpy()
    assert max_abs_diff_valid(h, out.hidden_states[-1].numpy(), batch["padding_mask"]) <= TOL


@pytest.mark.parametrize("cls_name,overrides", [("ElectraModel", {}),  # embedding 16 -> hidden 32 projection
                                                ("ElectraForPreTraining", {"embedding_size": 32})])
def test_load_hf_electra_discriminator_matches_transformers(tmp_path, cls_name, overrides):
    ref = _tiny_electra(cls_name, **overrides)
    ref.save_pretrained(tmp_path / "hf")
    backbone = kbert.load_model(str(tmp_path / "hf"), output_hidden_states=True)
    expect_e = overrides.get("embedding_size", 16)
    assert backbone.config.architecture == "bert" and backbone.config.embedding_dim == expect_e
    batch = random_batch()
    _assert_same_hidden(backbone, _electra_hidden_states(ref, batch), batch)
    # the pooler ELECTRA lacks is fresh; fine-tuning and the Embedder (mean pooling) work on top
    model = kbert.load_model(str(tmp_path / "hf"), with_heads=True)
    assert np.asarray(model.backbone(batch)["pooled_output"]).shape == (4, 32)
    if expect_e != 32:
        with pytest.raises(ValueError, match="embedding_size=16 != hidden_size=32"):
            kbert.export_transformers(backbone, str(tmp_path / "out"))


def test_load_google_tf1_electra_checkpoint(tmp_path):
    """google-research/electra variable names (`electra/...`, generator and RTD head left out), as KoELECTRA's
    TF1 checkpoints ship them, written independently of kbert's reader."""
    import json

    import tensorflow as tf

    ref = _tiny_electra("ElectraForPreTraining")
    names = {}
    for k, v in ref.state_dict().items():
        v = v.numpy()
        if "position_ids" in k:
            continue
        n = k.replace("encoder.layer.", "encoder/layer_").replace(".", "/")
        if "LayerNorm" in n:
            n = n.replace("/weight", "/gamma").replace("/bias", "/beta")
        elif n.endswith("/weight") and "embeddings/" in n and "embeddings_project" not in n:
            n = n[:-len("/weight")]
        elif n.endswith("/weight"):
            n, v = n[:-len("weight")] + "kernel", v.T
        names[n] = v
    names["generator/encoder/layer_0/attention/self/query/kernel"] = np.zeros((8, 8), "float32")
    names["generator_predictions/output_bias"] = np.zeros((99,), "float32")
    assert "electra/embeddings_project/kernel" in names and "discriminator_predictions/dense/kernel" in names
    graph = tf.Graph()
    with graph.as_default():
        variables = [tf.compat.v1.Variable(v, name=n) for n, v in names.items()]
        saver = tf.compat.v1.train.Saver(variables)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saver.save(sess, str(tmp_path / "model.ckpt"))
    cfg = ref.config.to_dict()
    with open(tmp_path / "config.json", "w") as f:  # no model_type: the variable names say ELECTRA
        json.dump({k: cfg[k] for k in ("vocab_size", "embedding_size", "hidden_size", "num_hidden_layers",
                                       "num_attention_heads", "intermediate_size", "hidden_act",
                                       "max_position_embeddings", "type_vocab_size")}, f)
    backbone = kbert.load_model(str(tmp_path), output_hidden_states=True)
    batch = random_batch()
    _assert_same_hidden(backbone, _electra_hidden_states(ref, batch), batch)


def test_an_albert_as_wide_as_its_embeddings_goes_to_transformers_and_back(tmp_path):
    """kbert's ALBERT has no embedding projection when embedding_size == hidden_size; transformers' always has
    one. Export writes the identity there, import reads an identity one and refuses a learned one."""
    ref_model = tiny_hf_pretraining_model("albert", embedding_size=32)  # hidden_size 32 too
    mapping = ref_model.albert.encoder.embedding_hidden_mapping_in
    with torch.no_grad():
        mapping.weight.copy_(torch.eye(32))
        mapping.bias.zero_()
    ref_model.save_pretrained(tmp_path / "hf")
    batch = random_batch()
    model = kbert.load_model(str(tmp_path / "hf"), with_heads=True, output_hidden_states=True)
    assert model.backbone.config.embedding_size == model.backbone.config.hidden_size == 32
    _assert_same(_kbert_outputs(model, batch), hf_outputs(ref_model, batch), batch)
    kbert.export_transformers(model, str(tmp_path / "out"))
    again = transformers.AlbertForPreTraining.from_pretrained(str(tmp_path / "out")).eval()
    _assert_same(_kbert_outputs(model, batch), hf_outputs(again, batch), batch)

    learned = tiny_hf_pretraining_model("albert", embedding_size=32)  # a random mapping: not the identity
    learned.save_pretrained(tmp_path / "learned")
    with pytest.raises(ValueError, match="embedding_hidden_mapping_in"):
        kbert.load_model(str(tmp_path / "learned"))


def _pretraining_batch(batch, predictions=3, seed=0):
    """Masked positions, their labels and weights inside each row's tokens (a row with fewer tokens pads its
    predictions with weight 0 at position 0), and pair labels: the labels of kbert's records."""
    rng = np.random.default_rng(seed)
    b = batch["token_ids"].shape[0]
    positions, ids, weights = (np.zeros((b, predictions), "int32") for _ in range(3))
    for i, n in enumerate(batch["padding_mask"].sum(axis=1)):
        k = min(predictions, n - 1)
        positions[i, :k] = np.sort(rng.choice(np.arange(1, n), k, replace=False))
        ids[i, :k], weights[i, :k] = rng.integers(5, 99, k), 1
    return positions, ids, weights, rng.integers(0, 2, b).astype("int32")


@pytest.mark.parametrize("architecture", ["bert", "albert"])
@pytest.mark.parametrize("last_layer", ["predicted", "full"])
def test_pretraining_loss_and_gradients_match_transformers(tmp_path, architecture, last_layer):
    """The step `benchmarks/gpu.py` times beside transformers' `*ForPreTraining` computes the same thing: on the
    same weights and batch, kbert's pretraining loss (masked LM at the weighted positions + NSP/SOP) and its
    gradient for every weight equal transformers' loss (labels -100 off the masked positions) and gradients,
    with the last block at [CLS] and the masked positions only (kbert's default) and at every position."""
    import tensorflow as tf

    from kbert.models.convert import kbert_to_hf
    from kbert.models.io import variables_by_path
    from kbert.models.layers import implementation

    ref_model = tiny_hf_pretraining_model(architecture)
    ref_model.save_pretrained(tmp_path / "hf")
    model = kbert.load_model(str(tmp_path / "hf"), with_heads=True)
    batch = random_batch(lengths=(9, 5, 12, 1, 7))
    positions, ids, weights, pair = _pretraining_batch(batch)

    labels = np.full(batch["token_ids"].shape, -100, "int64")
    for i in range(len(labels)):
        labels[i, positions[i][weights[i] == 1]] = ids[i][weights[i] == 1]
    pair_arg = "next_sentence_label" if architecture == "bert" else "sentence_order_label"
    out = ref_model(input_ids=torch.tensor(batch["token_ids"], dtype=torch.long),
                    token_type_ids=torch.tensor(batch["segment_ids"], dtype=torch.long),
                    attention_mask=torch.tensor(batch["padding_mask"], dtype=torch.long),
                    labels=torch.tensor(labels), **{pair_arg: torch.tensor(pair, dtype=torch.long)})
    out.loss.backward()
    ref_grads = {name: p.grad.numpy() for name, p in ref_model.named_parameters() if p.grad is not None}

    variables = variables_by_path(model)
    features = dict(batch, mask_positions=positions)
    with implementation(last_layer=last_layer), tf.GradientTape() as tape:
        losses = model.compute_losses(features, {"mask_ids": ids, "mask_weights": weights, "pair_labels": pair})
    grads = tape.gradient(losses["loss"], list(variables.values()))
    ref_loss = out.loss.item()
    assert abs(float(losses["loss"]) - ref_loss) <= 1e-5 * abs(ref_loss)

    # (an embedding table's gradient comes as IndexedSlices: the rows the batch touched)
    ours = kbert_to_hf({path: tf.convert_to_tensor(g).numpy() for path, g in zip(variables, grads)}, model.config,
                       pair_objective=model.pair_objective, heads=True)
    prefix = architecture + "."
    ours = {(k if k in ref_grads else prefix + k): v for k, v in ours.items()}
    compared = [name for name in ref_grads if name in ours]
    # every weight transformers trains has its gradient here (an ALBERT without a learned projection aside)
    assert set(ref_grads) - set(compared) == set()
    for name in compared:
        scale = max(float(np.max(np.abs(ref_grads[name]))), 1e-3)
        assert np.max(np.abs(ours[name] - ref_grads[name])) <= 1e-4 * scale, name
