"""The kbert model directory: `kbert_config.json` + `kbert_weights.safetensors` (+ `tokenizer/`).

Weights are stored by Keras variable path (`layer_0/qkv/kernel`), so a file written by one backend
loads on another, and a missing or misshapen weight is reported by name.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, Optional

import keras
import numpy as np

from kbert.models.backbone import Backbone, Pretrainer, build_backbone
from kbert.models.config import ModelConfig
from kbert.models.layers import frozen_kernel
from kbert.models.locate import CONFIG_FILE
from kbert.utils import check_local_path, save_safetensors

WEIGHTS_FILE = "kbert_weights.safetensors"
TOKENIZER_DIR = "tokenizer"
FORMAT_VERSION = 1


def variables_by_path(model: keras.Model) -> Dict[str, "keras.Variable"]:
    """Unique variables of a model keyed by path (ALBERT's shared block appears once)."""
    out = {}
    for v in model.weights:
        out.setdefault(v.path, v)
    return out


def lora_merged(backbone) -> dict:
    """For a backbone fine-tuned with LoRA (`kbert.train.lora`): {each adapted kernel's path: the kernel with its
    low-rank update added}, and each factor's path mapped to None, so that a saved model is a plain one."""
    out = {}
    for block in backbone.blocks:
        for dense in (block.qkv, block.attention_output, block.intermediate, block.output_dense):
            if getattr(dense, "lora_enabled", False):
                kernel = frozen_kernel(dense)
                # Dense.kernel adds (alpha / r) A B (float32 factors); stored in the kernel's own dtype
                out[kernel.path] = keras.ops.convert_to_numpy(keras.ops.cast(dense.kernel, kernel.dtype))
                out[dense.lora_kernel_a.path] = out[dense.lora_kernel_b.path] = None
    return out


def plain_tensors(model, backbone) -> Dict[str, np.ndarray]:
    """{variable path: numpy array} of `model` (whose encoder is `backbone`) as a plain model: a LoRA run's
    kernels with their low-rank updates merged, its factors left out (`lora_merged`)."""
    merged = lora_merged(backbone)
    return {path: np.ascontiguousarray(merged[path] if path in merged else keras.ops.convert_to_numpy(v))
            for path, v in variables_by_path(model).items() if merged.get(path, True) is not None}


def save_model(model, directory: str, tokenizer=None) -> str:
    """Writes a backbone or a `Pretrainer` (with its heads) to `directory`; returns the directory.

    Example:
        >>> kbert.save_model(backbone, "my-model")
        >>> same = kbert.load_model("my-model")
    """
    if isinstance(model, Pretrainer):
        backbone, pair_objective, has_heads = model.backbone, model.pair_objective, True
        if not any("mlm_head/" in path for path in variables_by_path(model)):
            build_pretrainer(model)  # heads not called yet: create them, else the dir would claim heads it lacks
    elif isinstance(model, Backbone):
        backbone, pair_objective, has_heads = model, None, False
    else:
        raise TypeError(f"save_model expects a kbert backbone or Pretrainer. Received: {type(model).__name__}")
    os.makedirs(check_local_path(directory, "model dir"), exist_ok=True)
    tensors = plain_tensors(model, backbone)
    meta = {"format_version": FORMAT_VERSION, "model": backbone.config.to_dict(),
            "heads": {"pretraining": has_heads, "pair_objective": pair_objective}}
    save_safetensors(tensors, os.path.join(directory, WEIGHTS_FILE), metadata={"format": "kbert"})
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")
    if tokenizer is not None:
        tokenizer.save(os.path.join(directory, TOKENIZER_DIR))
    return directory


def read_kbert_dir(directory: str):
    """(metadata dict, {path: array}) of a kbert model dir, with clear errors for missing parts."""
    config_path = os.path.join(directory, CONFIG_FILE)
    weights_path = os.path.join(directory, WEIGHTS_FILE)
    with open(config_path, encoding="utf-8") as f:
        try:
            meta = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    if not os.path.isfile(weights_path):
        raise FileNotFoundError(f"Model directory {directory!r} has {CONFIG_FILE} but no weight file "
                                f"{WEIGHTS_FILE}")
    return meta, read_safetensors(weights_path)


def read_safetensors(path: str) -> Dict[str, np.ndarray]:
    """All tensors of a safetensors file; a truncated or foreign file gives a ValueError naming it."""
    from safetensors.numpy import load_file

    try:
        return load_file(path)
    except Exception as e:  # safetensors raises its own error types for bad headers and truncation
        raise ValueError(f"{path} is not a readable safetensors file ({e}); it may be truncated or corrupt") from None


def assign_weights(model: keras.Model, tensors: Dict[str, np.ndarray], source: str,
                   ignore_prefixes: Iterable[str] = (), allow_missing: Iterable[str] = ()) -> None:
    """Copies `tensors` into `model` by variable path; errors list every missing/unexpected/misshapen one."""
    targets = variables_by_path(model)
    ignore_prefixes, allow_missing = tuple(ignore_prefixes), tuple(allow_missing)
    unexpected = sorted(k for k in tensors if k not in targets and not k.startswith(ignore_prefixes or ("\0",)))
    missing = sorted(k for k in targets if k not in tensors and not k.startswith(allow_missing or ("\0",)))
    problems = []
    for path, var in targets.items():
        if path in tensors and tuple(tensors[path].shape) != tuple(var.shape):
            problems.append(f"{path}: checkpoint has shape {tuple(tensors[path].shape)}, "
                            f"model expects {tuple(var.shape)}")
    if problems:
        hint = ""
        if any("token_embedding" in p for p in problems):
            hint = (" (vocab_size mismatch: the config's vocab_size does not match the checkpoint's "
                    "token embedding rows)")
        raise ValueError(f"Weights in {source} do not fit the model{hint}:\n  " + "\n  ".join(problems))
    if missing or unexpected:
        raise ValueError(f"Weights in {source} do not match the model. Missing: {missing or 'none'}. "
                         f"Unexpected: {unexpected or 'none'}")
    for path, var in targets.items():
        if path in tensors:
            var.assign(tensors[path].astype(var.dtype))


def load_kbert_dir(directory: str, with_heads: bool = False, output_hidden_states: bool = False,
                   dtype: Optional[str] = None, require_heads: bool = False):
    """Loads a kbert model dir as a backbone, or as a `Pretrainer` with `with_heads=True` (`require_heads`: a
    dir without its masked-LM head is a ValueError instead of getting fresh heads)."""
    meta, tensors = read_kbert_dir(directory)
    if "model" not in meta:
        raise ValueError(f"{os.path.join(directory, CONFIG_FILE)} has no 'model' section")
    config = ModelConfig.from_dict(meta["model"])
    backbone = build_backbone(config, output_hidden_states=output_hidden_states, dtype=dtype)
    heads = meta.get("heads", {})
    source = os.path.join(directory, WEIGHTS_FILE)
    if not with_heads:
        assign_weights(backbone, tensors, source, ignore_prefixes=("pretrainer/",))
        return backbone
    if require_heads:
        check_masked_lm_head(tensors, directory)
    pair = heads.get("pair_objective") if heads.get("pretraining") else "default"
    model = Pretrainer(backbone, pair_objective=pair)
    build_pretrainer(model)
    # A backbone-only dir gets freshly initialized heads (continued pretraining from an encoder).
    assign_weights(model, tensors, source,
                   allow_missing=() if heads.get("pretraining") else ("pretrainer/",))
    return model


def check_masked_lm_head(tensors: Dict[str, np.ndarray], source: str) -> None:
    """A ValueError naming `source` unless `tensors` (by kbert path) hold a masked-LM head: predicting masked
    tokens with a freshly initialized head would give confident nonsense."""
    if not any(path.startswith("pretrainer/mlm_head/") for path in tensors):
        raise ValueError(f"{source} holds no masked-LM head, only an encoder (a sentence-transformers or "
                         "fine-tuned model, ELECTRA's discriminator, or a backbone saved alone), so it cannot "
                         "predict masked tokens. Use a checkpoint saved with its pretraining head: `kbert "
                         "pretrain`'s model, or a Hugging Face BertForPreTraining / BertForMaskedLM dir.")


def build_pretrainer(model: Pretrainer) -> Pretrainer:
    """Creates the Pretrainer's variables by calling it once on a dummy batch."""
    ids = np.zeros((1, 2), "int32")
    model({"token_ids": ids, "segment_ids": ids, "padding_mask": np.ones((1, 2), "int32"),
           "mask_positions": np.zeros((1, 1), "int32")})
    return model


def with_dropout(backbone: Backbone, rate: float, dtype=None) -> Backbone:
    """The same backbone (weights copied) with every dropout rate inside it set to `rate`; the backbone
    itself when its rates are already `rate`."""
    import dataclasses

    config = backbone.config
    if config.dropout == rate and config.attention_dropout == rate:
        return backbone
    fresh = build_backbone(dataclasses.replace(config, dropout=rate, attention_dropout=rate),
                           output_hidden_states=backbone.output_hidden_states, dtype=dtype)
    assign_weights(fresh, {p: keras.ops.convert_to_numpy(v) for p, v in variables_by_path(backbone).items()},
                   "the loaded backbone")
    return fresh
