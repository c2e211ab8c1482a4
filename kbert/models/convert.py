"""Checkpoints in and out: kbert model dirs, Hugging Face BERT/ALBERT/(XLM-)RoBERTa/ELECTRA dirs, Google TF1 checkpoints.

An ELECTRA discriminator (KoELECTRA) is a BERT encoder whose embeddings may be narrower than the hidden
size (`embeddings_project`, kbert's `embeddings/projection`) and that has no pooler: it loads as a kbert
BERT backbone with `embedding_size` set and a freshly initialized pooler (fine-tuning trains it, as
ELECTRA's own classification head is trained; `pooled_output` means nothing before that). RoBERTa
(KLUE-RoBERTa) is BERT with positions counted from pad_token_id + 1, one segment type and an `lm_head`: it
loads as a BERT backbone with the position rows before the first real position dropped. XLM-RoBERTa, the
base of today's multilingual and Korean sentence models (BGE-M3, KURE, multilingual E5), is RoBERTa with a
250,002-row vocabulary and loads the same way; its tokenizer's fairseq numbering is
`kbert.text.hf_sentencepiece`'s.

Foreign weight names are translated here and nowhere else. Every format is first read into a dict of
Hugging Face style names (`encoder.layer.0.attention.self.query.weight`, torch [out, in] layout), then
mapped onto kbert variable paths, so the TF1 reader only has to rename.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Dict, Optional, Tuple

import numpy as np

from kbert.models.backbone import Backbone, Pretrainer, build_backbone
from kbert.models.config import ModelConfig
from kbert.models.io import (assign_weights, build_pretrainer, check_masked_lm_head, load_kbert_dir, plain_tensors,
                             read_safetensors)
from kbert.models.locate import CONFIG_FILE, CONFIG_FILES, is_kbert_dir, model_dir_of, resolve_hub_name

_HF_ACT = {"gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
           "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "tanh": "tanh"}
# XLM-RoBERTa (and the sentence models on it: BGE-M3, KURE, multilingual E5) is RoBERTa's architecture with a
# larger vocabulary; its SentencePiece ids are renumbered by kbert.text.hf_sentencepiece
_ROBERTA_TYPES = ("roberta", "xlm-roberta")
_KBERT_ACT = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "tanh": "tanh"}


# --------------------------------------------------------------------------------------- configs
def config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """ModelConfig from a Hugging Face or Google (bert_config.json / albert_config.json) config dict."""
    model_type = hf.get("model_type")
    if model_type is None:  # Google's JSON has no model_type; ALBERT's has embedding_size.
        model_type = "albert" if "embedding_size" in hf else "bert"
    if model_type not in ("bert", "albert", "electra") + _ROBERTA_TYPES:
        raise ValueError(f"{source}: model_type {model_type!r} is not supported; kbert loads 'bert', 'albert', "
                         "'roberta', 'xlm-roberta' and 'electra' (the discriminator)")
    act = hf.get("hidden_act", "gelu")
    if act not in _HF_ACT:
        raise ValueError(f"{source}: hidden_act {act!r} is not supported. Supported: {sorted(_HF_ACT)}")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{source}: position_embedding_type {hf['position_embedding_type']!r} is not "
                         "supported; kbert implements 'absolute'")
    if model_type == "albert" and hf.get("inner_group_num", 1) != 1:
        raise ValueError(f"{source}: inner_group_num={hf['inner_group_num']} is not supported (only 1)")
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    missing = [k for k in required if k not in hf]
    if missing:
        raise ValueError(f"{source}: config is missing required key(s) {missing}")
    fields = dict(
        architecture="albert" if model_type == "albert" else "bert",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"],
        max_position=hf.get("max_position_embeddings", 512),
        type_vocab_size=hf.get("type_vocab_size", 2),
        hidden_act=_HF_ACT[act],
        dropout=hf.get("hidden_dropout_prob", 0.1),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        layer_norm_epsilon=hf.get("layer_norm_eps", 1e-12),
        initializer_range=hf.get("initializer_range", 0.02),
        pad_token_id=hf.get("pad_token_id") or 0,
    )
    if model_type in _ROBERTA_TYPES:  # positions count from pad_token_id + 1: kbert keeps the rows real tokens use
        fields["max_position"] = hf.get("max_position_embeddings", 514) - (hf.get("pad_token_id", 1) + 1)
        fields["type_vocab_size"] = hf.get("type_vocab_size", 1)
    if model_type == "albert":
        fields["embedding_size"] = hf.get("embedding_size", 128)
        fields["num_groups"] = hf.get("num_hidden_groups", 1)
    if model_type == "electra" and hf.get("embedding_size", hf["hidden_size"]) != hf["hidden_size"]:
        fields["embedding_size"] = hf["embedding_size"]
    return ModelConfig(**fields)


def model_config(name: str) -> ModelConfig:
    """The ModelConfig of a preset name, a model dir (kbert's, a `kbert pretrain` run dir, Hugging Face's,
    Google's TF1) or a Hugging Face Hub name, read from its configuration file alone: no weights are read, and a
    hub name fetches the repo's JSON files only. What the memory planner needs to size, say, continued
    pretraining of "klue/bert-base" (`kbert plan --model klue/bert-base`)."""
    from kbert.models.config import PRESETS

    if name in PRESETS:
        return ModelConfig.preset(name)
    directory = model_dir_of(resolve_hub_name(str(name), patterns=CONFIG_FILES))
    if not os.path.isdir(directory):
        raise ValueError(f"model {name!r} is neither a preset ({', '.join(PRESETS)}) nor a model directory or "
                         f"Hugging Face Hub name")
    if is_kbert_dir(directory):
        meta = _read_json(os.path.join(directory, CONFIG_FILE))
        if "model" not in meta:
            raise ValueError(f"{os.path.join(directory, CONFIG_FILE)} has no 'model' section")
        return ModelConfig.from_dict(meta["model"])
    for file in ("config.json", "bert_config.json", "albert_config.json"):
        path = os.path.join(directory, file)
        if os.path.isfile(path):
            hf = _read_json(path)
            if file == "albert_config.json":
                hf.setdefault("model_type", "albert")
            return config_from_hf(hf, source=path)
    raise FileNotFoundError(f"{directory!r} holds no model configuration: expected {CONFIG_FILE} (kbert), "
                            "config.json (Hugging Face) or bert_config.json / albert_config.json (TF1)")


def check_exportable(config: ModelConfig) -> None:
    if config.architecture == "bert" and config.embedding_dim != config.hidden_size:
        raise ValueError(f"This BERT model has embedding_size={config.embedding_dim} != hidden_size="
                         f"{config.hidden_size} (an ELECTRA-style projection); transformers' BERT has no such "
                         "projection, so it cannot be written in its format. Save it with `kbert.save_model`.")
    if config.norm_first:
        raise ValueError("This model has pre-LayerNorm blocks (`norm_first=True`); transformers' BERT and "
                         "ALBERT are post-LayerNorm, so it cannot be written in their format. Save it with "
                         "`kbert.save_model` instead.")


def config_to_hf(config: ModelConfig, with_heads: bool, masked_lm: bool = False) -> dict:
    """transformers' config.json of `config`: a *ForPreTraining model `with_heads`, *ForMaskedLM with `masked_lm`,
    else the encoder (*Model)."""
    check_exportable(config)
    arch = config.architecture
    name = "Bert" if arch == "bert" else "Albert"
    out = {
        "model_type": arch,
        "architectures": [name + ("ForMaskedLM" if masked_lm else "ForPreTraining" if with_heads else "Model")],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "intermediate_size": config.intermediate_size,
        "hidden_act": _KBERT_ACT[config.hidden_act],
        "hidden_dropout_prob": config.dropout,
        "attention_probs_dropout_prob": config.attention_dropout,
        "max_position_embeddings": config.max_position,
        "type_vocab_size": config.type_vocab_size,
        "initializer_range": config.initializer_range,
        "layer_norm_eps": config.layer_norm_epsilon,
        "pad_token_id": config.pad_token_id,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
    }
    if arch == "albert":
        out.update(embedding_size=config.embedding_dim, num_hidden_groups=config.num_groups, inner_group_num=1)
    return out


# ----------------------------------------------------------------------- name mapping (HF <-> kbert)
def _hf_layout(config: ModelConfig):
    """(prefix, list of (hf_block_prefix, kbert_block_name), hf block sub-names)."""
    if config.architecture == "bert":
        blocks = [(f"encoder.layer.{i}.", f"layer_{i}") for i in range(config.num_layers)]
        sub = {"q": "attention.self.query", "k": "attention.self.key", "v": "attention.self.value",
               "attention_output": "attention.output.dense", "attention_norm": "attention.output.LayerNorm",
               "intermediate": "intermediate.dense", "output": "output.dense", "output_norm": "output.LayerNorm"}
        return blocks, sub
    blocks = [(f"encoder.albert_layer_groups.{g}.albert_layers.0.", f"group_{g}") for g in range(config.num_groups)]
    sub = {"q": "attention.query", "k": "attention.key", "v": "attention.value",
           "attention_output": "attention.dense", "attention_norm": "attention.LayerNorm",
           "intermediate": "ffn", "output": "ffn_output", "output_norm": "full_layer_layer_norm"}
    return blocks, sub


def _pairs(config: ModelConfig):
    """(hf_name, kbert_path, kind) for every weight except fused q/k/v; kind: linear | ln_w | plain."""
    out = [("embeddings.word_embeddings.weight", "embeddings/token_embedding/embeddings", "plain"),
           ("embeddings.position_embeddings.weight", "embeddings/position_embedding/embeddings", "plain"),
           ("embeddings.token_type_embeddings.weight", "embeddings/segment_embedding/embeddings", "plain"),
           ("embeddings.LayerNorm.weight", "embeddings/norm/gamma", "plain"),
           ("embeddings.LayerNorm.bias", "embeddings/norm/beta", "plain")]

    def dense(hf, kb):
        out.extend([(hf + ".weight", kb + "/kernel", "linear"), (hf + ".bias", kb + "/bias", "plain")])

    def norm(hf, kb):
        out.extend([(hf + ".weight", kb + "/gamma", "plain"), (hf + ".bias", kb + "/beta", "plain")])

    if config.architecture == "albert":
        dense("encoder.embedding_hidden_mapping_in", "embeddings/projection")
        dense("pooler", "pooler/dense")
    else:
        if config.embedding_dim != config.hidden_size:
            dense("embeddings_project", "embeddings/projection")  # ELECTRA
        dense("pooler.dense", "pooler/dense")
    blocks, sub = _hf_layout(config)
    for hf_prefix, name in blocks:
        for key in ("attention_output", "intermediate", "output"):
            dense(hf_prefix + sub[key], f"{name}/{key}")
        for key in ("attention_norm", "output_norm"):
            norm(hf_prefix + sub[key], f"{name}/{key}")
    return out


# Hugging Face names of the pretraining heads: (MLM prefix, transform dense, transform norm, pair classifier).
_HEAD_NAMES = {"bert": ("cls.predictions.", "transform.dense", "transform.LayerNorm", "cls.seq_relationship"),
               "albert": ("predictions.", "dense", "LayerNorm", "sop_classifier.classifier")}


def _head_pairs(config: ModelConfig, pair_objective: Optional[str]):
    head, dense, norm, pair = _HEAD_NAMES[config.architecture]
    out = [(head + dense + ".weight", "pretrainer/mlm_head/transform/kernel", "linear"),
           (head + dense + ".bias", "pretrainer/mlm_head/transform/bias", "plain"),
           (head + norm + ".weight", "pretrainer/mlm_head/norm/gamma", "plain"),
           (head + norm + ".bias", "pretrainer/mlm_head/norm/beta", "plain"),
           (head + "bias", "pretrainer/mlm_head/bias", "plain")]
    if pair_objective:
        out += [(pair + ".weight", f"pretrainer/{pair_objective}_head/dense/kernel", "linear"),
                (pair + ".bias", f"pretrainer/{pair_objective}_head/dense/bias", "plain")]
    return out


def hf_to_kbert(hf: Dict[str, np.ndarray], config: ModelConfig, pair_objective=None, heads=False):
    """Hugging Face tensors (torch layout, base-model prefix stripped) -> {kbert path: array}."""
    out = {}
    pairs = _pairs(config) + (_head_pairs(config, pair_objective) if heads else [])
    for hf_name, path, kind in pairs:
        if hf_name in hf:
            out[path] = hf[hf_name].T if kind == "linear" else hf[hf_name]
    if _albert_without_projection(config) and "embeddings/projection/kernel" in out:
        kernel, bias = out.pop("embeddings/projection/kernel"), out.pop("embeddings/projection/bias", 0.0)
        if not (np.allclose(kernel, np.eye(len(kernel)), atol=1e-6) and np.allclose(bias, 0.0, atol=1e-6)):
            raise ValueError(f"this ALBERT maps its {config.embedding_dim}-wide embeddings to the {config.hidden_size}-"
                             f"wide encoder through a learned layer (embedding_hidden_mapping_in); kbert's ALBERT has "
                             f"that layer only when embedding_size != hidden_size, so it cannot load these weights")
    blocks, sub = _hf_layout(config)
    for hf_prefix, name in blocks:
        names = [hf_prefix + sub[k] for k in ("q", "k", "v")]
        if all(n + ".weight" in hf for n in names):
            out[f"{name}/qkv/kernel"] = np.concatenate([hf[n + ".weight"].T for n in names], axis=1)
        if all(n + ".bias" in hf for n in names):
            out[f"{name}/qkv/bias"] = np.concatenate([hf[n + ".bias"] for n in names])
    return out


def _albert_without_projection(config: ModelConfig) -> bool:
    """transformers' ALBERT always maps its embeddings to the hidden size (embedding_hidden_mapping_in); kbert's
    has no such layer when the two sizes are equal: it is the identity there."""
    return config.architecture == "albert" and config.embedding_dim == config.hidden_size


def kbert_to_hf(tensors: Dict[str, np.ndarray], config: ModelConfig, pair_objective=None, heads=False):
    out = {}
    for hf_name, path, kind in _pairs(config) + (_head_pairs(config, pair_objective) if heads else []):
        if path.startswith("embeddings/projection/") and _albert_without_projection(config):
            h = config.hidden_size
            out[hf_name] = np.eye(h, dtype=np.float32) if path.endswith("kernel") else np.zeros(h, np.float32)
            continue
        out[hf_name] = tensors[path].T if kind == "linear" else tensors[path]
    blocks, sub = _hf_layout(config)
    h = config.hidden_size
    for hf_prefix, name in blocks:
        kernel, bias = tensors[f"{name}/qkv/kernel"], tensors[f"{name}/qkv/bias"]
        for j, k in enumerate(("q", "k", "v")):
            out[hf_prefix + sub[k] + ".weight"] = kernel[:, j * h:(j + 1) * h].T
            out[hf_prefix + sub[k] + ".bias"] = bias[j * h:(j + 1) * h]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


# RoBERTa's masked-LM head under BERT's names (its decoder is tied to the token embedding, as kbert's is)
_ROBERTA_HEAD = {"lm_head.dense.": "cls.predictions.transform.dense.",
                 "lm_head.layer_norm.": "cls.predictions.transform.LayerNorm.", "lm_head.bias": "cls.predictions.bias"}


# ELECTRA's generator (KoELECTRA's *-generator checkpoints, ElectraForMaskedLM) is a masked LM with BERT's head:
# dense to the embedding width, GELU, LayerNorm, then the tied token table and a bias
_ELECTRA_GENERATOR_HEAD = {"generator_predictions.dense.": "cls.predictions.transform.dense.",
                           "generator_predictions.LayerNorm.": "cls.predictions.transform.LayerNorm.",
                           "generator_lm_head.bias": "cls.predictions.bias"}


def _electra_generator_head(tensors: Dict[str, np.ndarray], source: str) -> Dict[str, np.ndarray]:
    """An ELECTRA generator's head under BERT's names; its decoder must be the token table (tied, as transformers
    and google-research/electra train it), which kbert's head reads."""
    decoder = tensors.get("generator_lm_head.weight")
    table = tensors.get("embeddings.word_embeddings.weight")
    if decoder is not None and table is not None and (decoder.shape != table.shape or not np.allclose(decoder, table)):
        raise ValueError(f"{source}: the generator's output layer is not tied to its token embeddings, and kbert's "
                         "masked-LM head reads the token table; this checkpoint cannot load with its head")
    out = {}
    for name, value in tensors.items():
        if name == "generator_lm_head.weight":
            continue
        for old, new in _ELECTRA_GENERATOR_HEAD.items():
            if name.startswith(old):
                name = new + name[len(old):]
        out[name] = value
    return out


def _roberta_as_bert(tensors: Dict[str, np.ndarray], pad_token_id: int) -> Dict[str, np.ndarray]:
    """RoBERTa is BERT with positions counted from pad_token_id + 1 (token i of a row has position i + 2 for
    KLUE-RoBERTa's pad id 1) and its masked-LM head named `lm_head`: the position table loses the rows
    before the first real position, so kbert's positions 0..s-1 read the rows RoBERTa reads; padded positions
    differ, but no real token attends to them."""
    out = {}
    for name, value in tensors.items():
        if name == "embeddings.position_embeddings.weight":
            value = value[pad_token_id + 1:]
        elif name.startswith("lm_head.decoder"):
            continue
        for old, new in _ROBERTA_HEAD.items():
            if name.startswith(old):
                name = new + name[len(old):]
        out[name] = value
    return out


def _normalize_hf_names(tensors: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Strips the base-model prefix and maps legacy LayerNorm gamma/beta names."""
    out = {}
    for name, value in tensors.items():
        for prefix in ("bert.", "albert.", "electra.", "roberta."):
            if name.startswith(prefix):
                name = name[len(prefix):]
        name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", name)
        name = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name)
        out[name] = value
    return out


# ------------------------------------------------------------------------------------ readers
def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None


def _read_hf_dir(directory: str) -> Tuple[ModelConfig, Dict[str, np.ndarray], bool]:
    """(config, tensors, whether its pooler may be missing: an ELECTRA discriminator, a RoBERTa MLM checkpoint,
    a masked-LM, question-answering or token-classification model)."""
    hf_config = _read_json(os.path.join(directory, "config.json"))
    config = config_from_hf(hf_config, source=directory)
    st = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    bins = sorted(glob.glob(os.path.join(directory, "pytorch_model*.bin")))
    tensors = {}
    if st:
        for path in st:
            tensors.update(read_safetensors(path))
    elif bins:  # read without torch (kbert.models.torch_files): many Korean checkpoints ship only this file
        from kbert.models.torch_files import load_torch_state

        for path in bins:
            tensors.update({k: v.astype(np.float32) for k, v in load_torch_state(path).items()})
    else:
        raise FileNotFoundError(f"{directory} has config.json but no weight file "
                                "(model.safetensors or pytorch_model.bin)")
    tensors = _normalize_hf_names(tensors)
    if hf_config.get("model_type") in _ROBERTA_TYPES:
        tensors = _roberta_as_bert(tensors, hf_config.get("pad_token_id", 1))
    if hf_config.get("model_type") == "electra" and any(n.startswith("generator_") for n in tensors):
        tensors = _electra_generator_head(tensors, directory)
    # transformers builds its masked-LM, question-answering and token-classification models without the pooler
    poolerless = any(a.endswith(("ForMaskedLM", "ForQuestionAnswering", "ForTokenClassification"))
                     for a in hf_config.get("architectures") or [])
    return config, tensors, poolerless or hf_config.get("model_type") in ("electra",) + _ROBERTA_TYPES


# sentence-transformers' CrossEncoder names its activation in config_sentence_transformers.json (v5+), config.json
# (`sentence_transformers.activation_fn`, v4; `sbert_ce_default_activation_function` before); the ones kbert
# applies, by name
_CE_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity", "Tanh": "tanh"}


def _tensors_named(directory: str, wanted) -> Dict[str, np.ndarray]:
    """The tensors of a Hugging Face dir whose (prefix-stripped) names `wanted(name)` accepts, without reading
    the others: a 2.2 GB reranker's head is a few MB."""
    st = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    out = {}
    if st:
        from safetensors import safe_open

        for path in st:
            with safe_open(path, framework="numpy") as f:
                for key in f.keys():
                    name = next(iter(_normalize_hf_names({key: None})))
                    if wanted(name):
                        out[name] = f.get_tensor(key).astype(np.float32)
        return out
    from kbert.models.torch_files import load_torch_state

    for path in sorted(glob.glob(os.path.join(directory, "pytorch_model*.bin"))):
        out.update({k: v.astype(np.float32) for k, v in _normalize_hf_names(load_torch_state(path)).items()
                    if wanted(k)})
    return out


def _architectures(directory: str, suffix: str):
    """(config.json, its architectures ending in `suffix`) of a Hugging Face dir; ({}, []) without one."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return {}, []
    hf = _read_json(path)
    return hf, [a for a in hf.get("architectures") or [] if a.endswith(suffix)]


def read_classifier(directory: str) -> Optional[dict]:
    """A Hugging Face `*ForSequenceClassification` dir's head, in kbert's terms: a cross-encoder (reranker such
    as BGE-reranker-v2-m3, a KLUE NLI model) as a `TaskNetwork` with "pooler" pooling. None for any other dir.

    BERT and ALBERT classify `dropout(pooler(h))`, the pooler being the backbone's own; (XLM-)RoBERTa classify
    `out_proj(dropout(tanh(dense(dropout(h[<s>])))))`, the same function at inference, so `classifier.dense`
    becomes the backbone's pooler and `out_proj` the task head. ELECTRA's head uses GELU where the pooler has
    tanh and is refused.

    Returns {"meta": kbert_task.json-like dict, "pooler": {kbert path: array} (empty when the backbone's own
    pooler is the classifier's), "head": {"kernel": [h, labels], "bias": [labels]}}. One logit is a
    "regression" whose `activation` is what sentence-transformers' CrossEncoder and transformers' text-
    classification pipeline apply (sigmoid unless the config names another); more are a "classification"
    over `id2label` (probabilities, as kbert's own classifiers give).
    """
    hf, architectures = _architectures(directory, "ForSequenceClassification")
    if not architectures:
        return None
    model_type = hf.get("model_type")
    if model_type not in ("bert", "albert") + _ROBERTA_TYPES:
        raise ValueError(f"{directory}: {architectures[0]} is not supported as a cross-encoder; kbert reads the "
                         "classification heads of BERT, ALBERT, RoBERTa and XLM-RoBERTa (ELECTRA's head runs GELU "
                         "where BERT's pooler runs tanh)")
    roberta = model_type in _ROBERTA_TYPES
    tensors = _tensors_named(directory, lambda n: n.startswith("classifier."))
    names = (("classifier.out_proj.weight", "classifier.out_proj.bias") if roberta
             else ("classifier.weight", "classifier.bias"))
    if roberta:
        names += ("classifier.dense.weight", "classifier.dense.bias")
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"{directory}: config.json names {architectures[0]} but the weights have no {missing}")
    kernel, bias = tensors[names[0]].T, tensors[names[1]]
    pooler = ({"pooler/dense/kernel": tensors["classifier.dense.weight"].T,
               "pooler/dense/bias": tensors["classifier.dense.bias"]} if roberta else {})
    num = int(kernel.shape[1])
    st_path = os.path.join(directory, "config_sentence_transformers.json")  # sentence-transformers >= 5 keep it here
    st = _read_json(st_path) if os.path.isfile(st_path) else {}
    named = (st.get("activation_fn") or (hf.get("sentence_transformers") or {}).get("activation_fn")
             or hf.get("sbert_ce_default_activation_function"))
    activation = "sigmoid"
    if named and num == 1:
        activation = _CE_ACTIVATIONS.get(str(named).rsplit(".", 1)[-1])
        if activation is None:
            raise ValueError(f"{directory}: the activation {named!r} in config.json is not one kbert applies "
                             f"({sorted(_CE_ACTIVATIONS)})")
    id2label = hf.get("id2label") or {}
    labels = [str(id2label.get(str(i), id2label.get(i, i))) for i in range(num)]
    meta = {"task": "regression" if num == 1 else "classification", "labels": None if num == 1 else labels,
            "pooling": "pooler", "target": [0.0, 1.0], "source": architectures[0]}
    if num > 1 and hf.get("problem_type") == "multi_label_classification":  # a sigmoid a label (KOTE, UnSmile)
        meta["multi_label"] = True
    if num == 1:  # a cross-encoder: it scores (query, document) pairs
        meta.update(activation=activation, pairs=True)
    from kbert.models.st_dir import configured_max_length

    length = configured_max_length(directory, directory)  # where transformers' tokenizer truncates
    if length:
        meta["max_length"] = length
    return {"meta": meta, "pooler": pooler, "head": {"kernel": kernel, "bias": bias}}


def _token_head(directory: str, suffix: str, layer: str, what: str):
    """(config.json, architecture, weight [out, h], bias [out]) of a Hugging Face dir whose architecture ends in
    `suffix` and whose head is the linear `layer` on every token, or None for any other dir; errors name `what`
    the head is."""
    hf, architectures = _architectures(directory, suffix)
    if not architectures:
        return None
    if hf.get("model_type") not in ("bert", "albert", "electra") + _ROBERTA_TYPES:
        raise ValueError(f"{directory}: {architectures[0]} is not supported; kbert reads the {what} heads of BERT, "
                         "ALBERT, ELECTRA, RoBERTa and XLM-RoBERTa")
    tensors = _tensors_named(directory, lambda n: n.startswith(layer + "."))
    missing = [n for n in (layer + ".weight", layer + ".bias") if n not in tensors]
    if missing or tensors[layer + ".weight"].ndim != 2:
        raise ValueError(f"{directory}: config.json names {architectures[0]} but the weights have no linear {layer} "
                         f"layer ({missing or tensors[layer + '.weight'].shape})")
    return hf, architectures[0], tensors[layer + ".weight"], tensors[layer + ".bias"]


def _token_task(directory: str, meta: dict, weight: np.ndarray, bias: np.ndarray) -> dict:
    """`read_classifier`'s answer for a head on every token: no pooler, the model's length where its tokenizer
    truncates."""
    from kbert.models.st_dir import configured_max_length

    length = configured_max_length(directory, directory)
    if length:
        meta["max_length"] = length
    return {"meta": meta, "pooler": {}, "head": {"kernel": weight.T, "bias": bias}}


def read_qa_head(directory: str) -> Optional[dict]:
    """A Hugging Face `*ForQuestionAnswering` dir's head (BERT, ALBERT, ELECTRA, RoBERTa, XLM-RoBERTa: KorQuAD
    and KLUE-MRC models) in `read_classifier`'s terms: `qa_outputs`, a linear layer on every token of the last
    layer giving each token an answer-start and an answer-end logit. None for any other dir."""
    found = _token_head(directory, "ForQuestionAnswering", "qa_outputs", "question-answering")
    if found is None:
        return None
    hf, architecture, weight, bias = found
    if weight.shape[0] != 2:
        raise ValueError(f"{directory}: config.json names {architecture} but its qa_outputs layer has "
                         f"{weight.shape[0]} outputs, not two (an answer's start and end)")
    meta = {"task": "question-answering", "labels": None, "pooling": None, "layers": None, "source": architecture}
    return _token_task(directory, meta, weight, bias)


def read_token_classifier(directory: str) -> Optional[dict]:
    """A Hugging Face `*ForTokenClassification` dir's head (BERT, ALBERT, ELECTRA, RoBERTa, XLM-RoBERTa: Korean
    named-entity and part-of-speech taggers) in `read_classifier`'s terms: `classifier`, a linear layer on every
    token of the last layer giving each token a logit per label (`id2label`), as a "tagging" task. None for any
    other dir."""
    found = _token_head(directory, "ForTokenClassification", "classifier", "token-classification")
    if found is None:
        return None
    hf, architecture, weight, bias = found
    id2label = hf.get("id2label") or {}
    labels = [str(id2label.get(str(i), id2label.get(i, i))) for i in range(int(weight.shape[0]))]
    # trained on every token (transformers' token-classification recipe), so entities group token by token
    meta = {"task": "tagging", "labels": labels, "pooling": None, "layers": None, "source": architecture,
            "aggregation": "simple"}
    return _token_task(directory, meta, weight, bias)


_TF1_BERT_RULES = [
    (r"^(bert|electra)/", ""),
    (r"^embeddings/word_embeddings$", "embeddings.word_embeddings.weight"),
    (r"^embeddings/position_embeddings$", "embeddings.position_embeddings.weight"),
    (r"^embeddings/token_type_embeddings$", "embeddings.token_type_embeddings.weight"),
    (r"^cls/predictions/output_bias$", "cls.predictions.bias"),
    (r"^cls/seq_relationship/output_weights$", "cls.seq_relationship.weight"),  # already [out, in]
    (r"^cls/seq_relationship/output_bias$", "cls.seq_relationship.bias"),
    # ALBERT (google-research/albert) names, shared group 0 only.
    (r"^encoder/transformer/group_(\d+)/inner_group_0/attention_1/self/", r"encoder.albert_layer_groups.\1.albert_layers.0.attention."),
    (r"^encoder/transformer/group_(\d+)/inner_group_0/attention_1/output/dense/", r"encoder.albert_layer_groups.\1.albert_layers.0.attention.dense."),
    (r"^encoder/transformer/group_(\d+)/inner_group_0/LayerNorm/", r"encoder.albert_layer_groups.\1.albert_layers.0.attention.LayerNorm."),
    (r"^encoder/transformer/group_(\d+)/inner_group_0/ffn_1/intermediate/dense/", r"encoder.albert_layer_groups.\1.albert_layers.0.ffn."),
    (r"^encoder/transformer/group_(\d+)/inner_group_0/ffn_1/intermediate/output/dense/", r"encoder.albert_layer_groups.\1.albert_layers.0.ffn_output."),
    (r"^encoder/transformer/group_(\d+)/inner_group_0/LayerNorm_1/", r"encoder.albert_layer_groups.\1.albert_layers.0.full_layer_layer_norm."),
    (r"^pooler/dense/(kernel|bias)$", r"pooler.dense.\1"),
]


def _tf1_name(name: str, architecture: str) -> Optional[str]:
    """Google TF1 variable name -> Hugging Face style name (None for optimizer slots and counters)."""
    if name.endswith(("adam_m", "adam_v")) or "global_step" in name or name.startswith("cls/predictions/output_weights"):
        return None
    if name.startswith(("generator", "discriminator_predictions")):  # ELECTRA's generator and RTD head
        return None
    for pattern, repl in _TF1_BERT_RULES:
        name = re.sub(pattern, repl, name)
    if architecture == "albert":
        name = re.sub(r"^pooler\.dense\.", "pooler.", name)
        name = re.sub(r"^cls/predictions/", "predictions/", name)
        name = name.replace("cls.predictions.bias", "predictions.bias")
        name = re.sub(r"^cls\.seq_relationship\.", "sop_classifier.classifier.", name)
        name = re.sub(r"^predictions/transform/dense/", "predictions.dense.", name)
        name = re.sub(r"^predictions/transform/LayerNorm/", "predictions.LayerNorm.", name)
        name = re.sub(r"^encoder/embedding_hidden_mapping_in/", "encoder.embedding_hidden_mapping_in.", name)
    name = name.replace("/", ".")
    name = re.sub(r"\.kernel$", ".weight", name)
    name = re.sub(r"\.gamma$", ".weight", name)
    name = re.sub(r"\.beta$", ".bias", name)
    name = re.sub(r"^encoder\.layer_(\d+)\.", r"encoder.layer.\1.", name)
    return name


def _read_tf1_dir(directory: str) -> Tuple[ModelConfig, Dict[str, np.ndarray], bool]:
    """(config, tensors, whether it is an ELECTRA discriminator: variables under `electra/`)."""
    config_path = next((os.path.join(directory, n) for n in ("bert_config.json", "albert_config.json", "config.json")
                        if os.path.isfile(os.path.join(directory, n))), None)
    if config_path is None:
        raise FileNotFoundError(f"{directory} has a TF1 checkpoint but no bert_config.json / albert_config.json")
    hf_config = _read_json(config_path)
    index = sorted(glob.glob(os.path.join(directory, "*.index")))
    if not index:
        raise FileNotFoundError(f"{directory} has {os.path.basename(config_path)} but no model.ckpt*.index")
    import tensorflow as tf  # only TF1 checkpoints need TensorFlow

    reader = tf.train.load_checkpoint(index[-1][: -len(".index")])
    names = list(reader.get_variable_to_shape_map())
    electra = any(n.startswith("electra/") for n in names)
    if electra:
        hf_config["model_type"] = "electra"  # google-research/electra names; its config may lack model_type
    elif "albert" in os.path.basename(config_path):
        hf_config.setdefault("model_type", "albert")
    config = config_from_hf(hf_config, source=config_path)
    architecture = config.architecture
    tensors = {}
    for name in names:
        hf_name = _tf1_name(name, architecture)
        if hf_name is None:
            continue
        value = reader.get_tensor(name).astype(np.float32)
        # TF1 dense kernels are [in, out]; the HF layout is [out, in].
        tensors[hf_name] = value.T if name.endswith("/kernel") else value
    return config, tensors, electra


def detect_format(directory: str) -> str:
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"Model directory not found: {directory!r}")
    if is_kbert_dir(directory):
        return "kbert"
    if glob.glob(os.path.join(directory, "*.index")) and glob.glob(os.path.join(directory, "*_config.json")):
        return "tf1"
    if os.path.isfile(os.path.join(directory, "config.json")):
        return "tf1" if glob.glob(os.path.join(directory, "*.index")) else "hf"
    raise FileNotFoundError(
        f"{directory!r} is not a model directory: expected kbert_config.json (kbert), config.json + "
        "model.safetensors (Hugging Face), or bert_config.json/albert_config.json + model.ckpt* (TF1)")


def check_vocabulary(config, vocab_size: int) -> None:
    """A tokenizer of `vocab_size` ids fits a model of `config` (a ModelConfig): every id has an embedding."""
    if vocab_size > config.vocab_size:
        raise ValueError(f"The tokenizer has {vocab_size} tokens but the model only {config.vocab_size} embeddings")


# ------------------------------------------------------------------------------------ public API
def load_model(directory: str, with_heads: bool = False, output_hidden_states: bool = False,
               dtype: Optional[str] = None, require_heads: bool = False):
    """Loads a kbert model dir, a Hugging Face BERT/ALBERT/(XLM-)RoBERTa/ELECTRA dir or a Google TF1 checkpoint dir.

    RoBERTa (KLUE-RoBERTa) loads as a BERT backbone: the same network once its position table starts at the
    first position real tokens use (`_roberta_as_bert`); one segment type, and a masked-LM checkpoint's
    missing pooler starts fresh.

    ELECTRA (KoELECTRA) loads its discriminator as a BERT backbone; its pooler, which ELECTRA does not
    have, is freshly initialized (see the module docstring), and `with_heads` gives fresh MLM/NSP heads. A
    generator (ElectraForMaskedLM, KoELECTRA's `*-generator`) loads the same way, with its masked-LM head.

    Args:
        directory: the model directory (or a `kbert pretrain` output dir: its `model/`), or a Hugging Face
            Hub name such as "klue/bert-base" (downloaded and cached by `huggingface_hub`).
        with_heads: return a `kbert.Pretrainer` (masked-LM + NSP/SOP heads) instead of the backbone.
            Heads missing from the checkpoint are initialized fresh, unless `require_heads`: then a checkpoint
            without a masked-LM head is a ValueError (predicting masked tokens needs the trained head).
        output_hidden_states: the backbone also returns every layer's output.
        dtype: dtype policy name, e.g. `"mixed_bfloat16"`; default: the global policy.

    Example:
        >>> backbone = kbert.load_model("klue/bert-base")       # a Hugging Face Hub name (cached)
        >>> backbone = kbert.load_model("my-kbert-model")       # written by kbert.save_model / pretrain
    """
    directory = model_dir_of(resolve_hub_name(directory))  # a hub name: its snapshot; a run dir: its model
    fmt = detect_format(directory)
    if fmt == "kbert":
        return load_kbert_dir(directory, with_heads=with_heads or require_heads,
                              output_hidden_states=output_hidden_states, dtype=dtype, require_heads=require_heads)
    config, tensors, electra = _read_hf_dir(directory) if fmt == "hf" else _read_tf1_dir(directory)
    no_pooler = ("pooler/",) if electra else ()  # ELECTRA has none, a RoBERTa MLM checkpoint none: a fresh one
    backbone = build_backbone(config, output_hidden_states=output_hidden_states, dtype=dtype)
    if not (with_heads or require_heads):
        assign_weights(backbone, hf_to_kbert(tensors, config), directory, allow_missing=no_pooler)
        return backbone
    pair = "sop" if config.architecture == "albert" else "nsp"
    mapped = hf_to_kbert(tensors, config, pair_objective=pair, heads=True)
    if require_heads:
        check_masked_lm_head(mapped, directory)
    model = build_pretrainer(Pretrainer(backbone, pair_objective=pair))
    assign_weights(model, mapped, directory, allow_missing=("pretrainer/",) + no_pooler)
    return model


def export_transformers(model, directory: str, tokenizer=None) -> str:
    """Writes `model` (a backbone, a `Pretrainer`, or a `kbert.TaskModel` classifier / cross-encoder) as a
    Hugging Face dir (`config.json` + `model.safetensors`) that `transformers.AutoModel.from_pretrained(directory)`
    loads.

    A question-answering `TaskModel` is written as `BertForQuestionAnswering` / `AlbertForQuestionAnswering`, a
    tagging one as `BertForTokenClassification` / `AlbertForTokenClassification` (its tags as `id2label`, so
    transformers' token-classification pipeline gives `TaskModel.entities`' spans).
    A `Pretrainer` is written as `BertForPreTraining` / `AlbertForPreTraining` with its heads. A `TaskModel`
    whose head reads the pooler (classification, pair-classification, regression: a cross-encoder) is written
    as `BertForSequenceClassification` / `AlbertForSequenceClassification`, a regression's target scaling
    folded into the classifier, with a `config_sentence_transformers.json` naming its output function, so
    sentence-transformers' `CrossEncoder(directory).predict(pairs)` gives `TaskModel.predict`'s scores. A
    `tokenizer` (`kbert.Tokenizer`; a TaskModel's own by default) is written beside it where transformers can
    read it exactly (`Tokenizer.export_transformers`: WordPiece, unigram SentencePiece); otherwise a warning
    says why not.
    """
    if getattr(model, "network", None) is not None and hasattr(model, "meta"):  # a TaskModel
        return _export_classifier(model, directory, tokenizer if tokenizer is not None else model.tokenizer)
    if isinstance(model, Pretrainer):
        config, pair, heads = model.config, model.pair_objective, True
    elif isinstance(model, Backbone):
        config, pair, heads = model.config, None, False
    else:
        raise TypeError(f"export_transformers expects a kbert backbone or Pretrainer. Received: {type(model).__name__}")
    check_exportable(config)  # before any tensor is converted
    # transformers' pretraining classes hold the masked-LM head with the matching pair head (NSP for BERT, SOP for
    # ALBERT); without it, the masked-LM class holds the head alone
    masked_lm = heads and pair != ("nsp" if config.architecture == "bert" else "sop")
    if masked_lm and pair is not None:
        import warnings

        warnings.warn(f"transformers' {config.architecture} pretraining class has no {pair} head: the model is "
                      "written as a masked-LM model without it", stacklevel=2)
    if masked_lm:
        pair = None
    from kbert.utils import save_safetensors

    tensors = plain_tensors(model, model.backbone if isinstance(model, Pretrainer) else model)  # LoRA merged
    hf = kbert_to_hf(tensors, config, pair_objective=pair, heads=heads)
    if masked_lm:  # transformers' masked-LM models are built without the pooler
        hf = {k: v for k, v in hf.items() if not k.startswith("pooler.")}
    if heads:
        prefix = "bert." if config.architecture == "bert" else "albert."
        head_names = {n for n, _, _ in _head_pairs(config, pair)}
        hf = {(k if k in head_names else prefix + k): v for k, v in hf.items()}
    os.makedirs(directory, exist_ok=True)
    save_safetensors(hf, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config_to_hf(config, with_heads=heads, masked_lm=masked_lm), f, indent=2)
    if tokenizer is not None:
        try:
            tokenizer.export_transformers(directory)
        except ValueError as e:
            import warnings

            warnings.warn(f"The tokenizer was not written in transformers' format: {e}", stacklevel=2)
    elif not any(os.path.exists(os.path.join(directory, f)) for f in _HF_TOKENIZER_FILES):
        import warnings

        warnings.warn(f"{directory} has no tokenizer: transformers 5 reads such a dir with an empty vocabulary "
                      f"(every token [UNK]), so pass tokenizer=kbert.Tokenizer.from_model_dir(<the model dir>)",
                      stacklevel=2)
    return directory


# any of these in a transformers dir: its tokenizer is there
_HF_TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "sentencepiece.bpe.model",
                       "spiece.model", "tokenizer.model")


# torch's names of the output functions `TaskModel` applies, as sentence-transformers' CrossEncoder stores them
_TORCH_ACTIVATIONS = {"identity": "torch.nn.modules.linear.Identity", "sigmoid": "torch.nn.modules.activation.Sigmoid",
                      "tanh": "torch.nn.modules.activation.Tanh"}


def _export_classifier(task_model, directory: str, tokenizer) -> str:
    """`export_transformers` of a `TaskModel`: the backbone under `bert.` / `albert.`, its pooler, and the head
    as `classifier` (transformers' sequence-classification layout, which reads the pooled [CLS]); a
    question-answering head as `qa_outputs` (on every token; transformers' model has no pooler)."""
    import keras

    network, meta = task_model.network, task_model.meta
    qa = network.task == "question-answering"
    token_head = network.task in ("question-answering", "tagging")  # a head on every token: no pooler
    if network.task not in ("classification", "pair-classification", "regression", "question-answering", "tagging"):
        raise ValueError(f"A {network.task} model has no transformers sequence-classification, question-answering or "
                         "token-classification equivalent; export its backbone (`export_transformers(model.network."
                         "backbone, ...)`)")
    if not token_head and network.pooling != "pooler":
        raise ValueError(f"This model's head reads {network.pooling!r} pooling; transformers' sequence "
                         "classifiers read BERT's pooler over [CLS] (fine-tune with pooling='pooler' to export)")
    backbone = network.backbone
    config = backbone.config
    tensors = plain_tensors(backbone, backbone)  # a LoRA run's updates merged
    prefix = "bert." if config.architecture == "bert" else "albert."
    hf = {prefix + k: v for k, v in kbert_to_hf(tensors, config).items()}
    kernel = np.asarray(keras.ops.convert_to_numpy(network.head.kernel), np.float32)  # [h, labels]
    bias = np.asarray(keras.ops.convert_to_numpy(network.head.bias), np.float32)
    if network.task == "regression":  # TaskNetwork returns head * std + mean: folded into the weights
        mean, std = network.target
        kernel, bias = kernel * std, bias * std + mean
    hf_config = config_to_hf(config, with_heads=False)
    if qa:  # transformers' qa_outputs: [2, h], start then end
        hf = {k: v for k, v in hf.items() if not k.startswith(prefix + "pooler.")}
        hf["qa_outputs.weight"], hf["qa_outputs.bias"] = np.ascontiguousarray(kernel.T), bias
        hf_config["architectures"] = ["BertForQuestionAnswering" if config.architecture == "bert"
                                      else "AlbertForQuestionAnswering"]
        return _write_hf_task(task_model, directory, tokenizer, hf, hf_config, {})
    if network.task == "tagging":  # transformers' token classifier: `classifier` on every token, labels as id2label
        hf = {k: v for k, v in hf.items() if not k.startswith(prefix + "pooler.")}
        hf["classifier.weight"], hf["classifier.bias"] = np.ascontiguousarray(kernel.T), bias
        labels = list(meta.get("labels") or [])
        hf_config.update(architectures=["BertForTokenClassification" if config.architecture == "bert"
                                        else "AlbertForTokenClassification"], classifier_dropout=None,
                         id2label={str(i): str(label) for i, label in enumerate(labels)},
                         label2id={str(label): i for i, label in enumerate(labels)})
        return _write_hf_task(task_model, directory, tokenizer, hf, hf_config, {})
    hf["classifier.weight"], hf["classifier.bias"] = np.ascontiguousarray(kernel.T), bias
    labels = list(meta.get("labels") or []) if network.task != "regression" else ["score"]
    hf_config["architectures"] = ["BertForSequenceClassification" if config.architecture == "bert"
                                  else "AlbertForSequenceClassification"]
    hf_config.update(id2label={str(i): str(label) for i, label in enumerate(labels)},
                     label2id={str(label): i for i, label in enumerate(labels)}, classifier_dropout=None)
    if network.task == "regression":
        hf_config["problem_type"] = "regression"
    elif meta.get("multi_label"):  # transformers' pipeline then gives each label its own sigmoid, as kbert does
        hf_config["problem_type"] = "multi_label_classification"
    # kbert's classifiers give probabilities (CrossEncoder: predict(..., apply_softmax=True)); a regression its
    # own output function, which CrossEncoder reads from either place (sentence-transformers >= 5, and 4)
    activation = _TORCH_ACTIVATIONS[getattr(task_model, "activation", "identity")] if network.task == "regression" \
        else _TORCH_ACTIVATIONS["sigmoid" if meta.get("multi_label") else "identity"]  # multi-label: per label
    hf_config["sentence_transformers"] = {"activation_fn": activation}
    st_config = {"model_type": "CrossEncoder", "activation_fn": activation, "prompts": {}, "default_prompt_name": None}
    return _write_hf_task(task_model, directory, tokenizer, hf, hf_config,
                          {"config_sentence_transformers.json": st_config})


def _write_hf_task(task_model, directory: str, tokenizer, hf: dict, hf_config: dict, extra: dict) -> str:
    """Writes a task model's transformers dir: the tokenizer (truncating where the model was tuned), the
    weights, config.json and the `extra` JSON files {name: object}."""
    from kbert.utils import save_safetensors

    config = task_model.network.backbone.config
    os.makedirs(directory, exist_ok=True)
    if tokenizer is not None:
        try:
            tokenizer.export_transformers(directory)
            _set_json(os.path.join(directory, "tokenizer_config.json"),  # truncate where the model was tuned
                      model_max_length=int(getattr(task_model, "max_length", None) or config.max_position))
        except ValueError as e:
            import warnings

            warnings.warn(f"The tokenizer was not written in transformers' format: {e}", stacklevel=4)
    save_safetensors({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in hf.items()},
                     os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    for name, obj in {"config.json": hf_config, **extra}.items():
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
    return directory


def _set_json(path: str, **values) -> None:
    if os.path.isfile(path):
        obj = {**_read_json(path), **values}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
