"""What a sentence-transformers directory says about its model: where the transformer's weights are, its pooling,
the layers it averages and its length, for `Embedder.load` and fine-tuning (Korean sentence models on the Hub
are published this way). Without it a model trained with [CLS] pooling would be read with kbert's default mean
pooling and give other vectors, silently. A Dense module after the pooling (LaBSE's tanh layer, a whitening
or dimension-reducing projection) is read as its weights, for `Embedder` and an embedding teacher to apply;
fine-tuning refuses it, as it trains the backbone's own pooled vectors. Modules kbert does not compute
(weighted-mean or last-token pooling, learned layer weights, a Dense layer with another activation ...) are
refused by name. A StaticEmbedding module (Model2Vec's and sentence-transformers' static models: a table of
token vectors, averaged) is read by `read_static`. Both layouts are read: the boolean
`pooling_mode_*` keys and `sentence_bert_config.json` length of sentence-transformers < 6, and the
`pooling_mode` key and tokenizer `model_max_length` of 6. (Writing one: `kbert.embed.st_format`.)
"""

from __future__ import annotations

import json
import os
from typing import Optional

_POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                  "pooling_mode_max_tokens": "max"}
# Dense activations kbert computes (sentence-transformers writes the torch class's full name)
DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh"}


def read_sentence_transformers(directory: str, projections: bool = False):
    """For a sentence-transformers dir (`modules.json`): {"model_dir", "pooling", "layers", "max_length",
    "prompts", "default_prompt_name", "dense"} that make `Embedder` give `SentenceTransformer(directory).encode`'s
    vectors; None for any other dir. "dense": the Dense modules after the pooling, in order, each
    {"weight": [in, out] float32, "bias": [out], "activation": "identity" or "tanh"} (`apply_dense`); with
    `projections` False (fine-tuning, task distillation) a Dense module raises ValueError. A module or mode kbert
    does not compute raises ValueError naming it."""
    import numpy as np

    path = os.path.join(directory, "modules.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        modules = json.load(f)
    found = {"model_dir": directory, "pooling": "mean", "layers": -1, "max_length": None, "dense": [],
             **_prompts(directory)}
    for module in modules:
        kind = module.get("type", "").rsplit(".", 1)[-1]
        folder = os.path.join(directory, module.get("path", ""))
        if kind == "Transformer":
            found["model_dir"] = folder
            found["max_length"] = configured_max_length(directory, folder)
        elif kind == "Pooling":
            with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
            if config.get("pooling_mode"):  # sentence-transformers >= 6 (and `pooling_mode` of older ones)
                mode = config["pooling_mode"]
                modes = [mode] if isinstance(mode, str) else list(mode)
            else:  # the boolean keys of sentence-transformers < 6
                modes = [key[len("pooling_mode_"):] for key, value in config.items()
                         if key.startswith("pooling_mode_") and value]
            modes = [_POOLING_MODES.get(f"pooling_mode_{m}", m) for m in modes]
            if len(modes) != 1 or modes[0] not in ("cls", "mean", "max"):
                raise ValueError(f"{directory}: its Pooling module uses {modes}; kbert pools with exactly one of cls, "
                                 f"mean or max")
            found["pooling"] = modes[0]
            if config.get("include_prompt") is False and found["prompts"]:
                raise ValueError(f"{directory}: its Pooling module leaves the prompt's tokens out of the pooling "
                                 f"(include_prompt false); kbert pools every token, as sentence-transformers does "
                                 f"by default")
        elif kind == "WeightedLayerPooling":
            with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
            counts = np.asarray(module_weights(folder)["layer_weights"], np.float64)
            if np.any(counts < 0) or np.any(np.abs(counts - np.round(counts)) > 1e-6) or counts.sum() == 0:
                raise ValueError(f"{directory}: WeightedLayerPooling with learned weights {counts.tolist()}; kbert "
                                 f"averages layers with equal (whole-number) weights only")
            start = int(config.get("layer_start", 0))
            found["layers"] = [start + i for i, c in enumerate(np.round(counts).astype(int)) for _ in range(c)]
        elif kind == "Dense":
            if not projections:
                raise ValueError(f"{directory}: its Dense module projects the pooled vectors; kbert.Embedder and an "
                                 f"embedding-mode teacher or guide apply it, but fine-tuning and task distillation "
                                 f"train or read the backbone's own pooled vectors: start from a sentence-transformers "
                                 f"dir without a Dense module")
            found["dense"].append(read_dense(directory, folder))
        elif kind == "StaticEmbedding":  # Model2Vec and sentence-transformers' static models (StaticEmbedder)
            if not projections:
                raise ValueError(f"{directory}: a static model (StaticEmbedding: a table of token vectors) has no "
                                 f"transformer to fine-tune or to teach with; kbert.Embedder.load encodes with it")
            found["static"] = folder
        elif kind == "Normalize":
            continue  # Embedder.encode returns unit vectors by default
        elif kind in SPARSE_MODULES or kind == "Router" and read_sparse_encoder(directory) is not None:
            raise ValueError(f"{directory} is a sentence-transformers SparseEncoder (SPLADE): its vectors are a weight "
                             f"per vocabulary token; load it with kbert.SparseEncoder.load")
        else:
            raise ValueError(f"{directory}: its module {module.get('type')!r} has no kbert equivalent; kbert reads "
                             f"sentence-transformers dirs of Transformer, WeightedLayerPooling, Pooling, Dense, "
                             f"StaticEmbedding and Normalize")
    return found


SPARSE_MODULES = ("MLMTransformer", "SpladePooling")  # a SPLADE SparseEncoder's two modules


def read_sparse_encoder(directory: str):
    """For a sentence-transformers SparseEncoder dir of SPLADE (a masked-LM transformer + SpladePooling): {"model_dir",
    "pooling", "activation", "max_length", "prompts", "query_weights", "query_max_length"} that make
    `kbert.SparseEncoder` give its vectors; None for a dir without `modules.json` or without a SpladePooling module.
    An inference-free SPLADE dir (a Router: SparseStaticEmbedding for queries, SPLADE for documents) gives its
    query side's per-token weights `[vocab]` as "query_weights" (None otherwise). Other sparse modules (CSR / top-k
    sparsity, another Router) raise ValueError naming them."""
    path = os.path.join(directory, "modules.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        modules = json.load(f)
    kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    found = {"model_dir": directory, "pooling": "max", "activation": "relu", "max_length": None,
             "prompts": _prompts(directory)["prompts"], "query_weights": None, "query_max_length": None}
    if kinds == ["Router"]:
        return _read_inference_free(directory, found)
    if "SpladePooling" not in kinds:
        return None
    for module, kind in zip(modules, kinds):
        _read_sparse_module(directory, os.path.join(directory, module.get("path", "")), kind, module.get("type"),
                            found)
    return found


def is_sparse_dir(model) -> bool:
    """Whether `model` (a path) is a sentence-transformers SparseEncoder dir of SPLADE, which `kbert.SparseEncoder`
    reads and `Embedder.load` refuses (a masked-LM dir is read as SPLADE only when asked). Needs no Keras, as the
    static models' paths that call it."""
    from kbert.models.locate import model_dir_of

    return isinstance(model, str) and os.path.isdir(model) and read_sparse_encoder(model_dir_of(model)) is not None


def _read_sparse_module(directory: str, folder: str, kind: str, full_type, found: dict) -> None:
    if kind in ("MLMTransformer", "Transformer"):  # sentence-transformers 5; 6 (transformer_task "fill-mask")
        found["model_dir"] = folder
        found["max_length"] = configured_max_length(directory, folder)
    elif kind == "SpladePooling":
        config = module_config(folder)
        found["pooling"] = config.get("pooling_strategy", "max")
        found["activation"] = config.get("activation_function", "relu")
    else:
        raise ValueError(f"{directory}: its module {full_type!r} has no kbert equivalent; kbert.SparseEncoder reads "
                         f"SPLADE dirs of MLMTransformer and SpladePooling (an inference-free Router: "
                         f"SparseStaticEmbedding for queries)")


def _read_inference_free(directory: str, found: dict):
    """An inference-free SPLADE dir (sentence-transformers' `Router.for_query_document`): documents through a
    masked-LM transformer and SpladePooling, queries through SparseStaticEmbedding (a weight per vocabulary token,
    given to each token the query holds: no model runs for a query). None for a Router of something else."""
    import numpy as np

    with open(os.path.join(directory, "router_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    types = config.get("types", {})
    structure = config.get("structure", {})
    query, document = structure.get("query") or [], structure.get("document") or []
    kinds = {name: types.get(name, "").rsplit(".", 1)[-1] for name in query + document}
    if "SpladePooling" not in [kinds[n] for n in document]:
        return None
    if [kinds[n] for n in query] != ["SparseStaticEmbedding"]:
        raise ValueError(f"{directory}: a Router whose query route is {[kinds[n] for n in query]}; kbert reads "
                         f"inference-free SPLADE (SparseStaticEmbedding for queries, SPLADE for documents)")
    for name in document:
        _read_sparse_module(directory, os.path.join(directory, name), kinds[name], types.get(name), found)
    folder = os.path.join(directory, query[0])
    found["query_weights"] = np.asarray(module_weights(folder)["weight"], np.float32)  # [vocab]
    found["query_max_length"] = configured_max_length(folder, folder)
    return found


# config_sentence_transformers.json of a SPLADE model
SPARSE_ENCODER_CONFIG = {"model_type": "SparseEncoder", "similarity_fn_name": "dot",
                         "prompts": {"query": "", "document": ""}, "default_prompt_name": None}


def write_sparse_encoder(directory: str, pooling: str = "max", activation: str = "relu",
                         max_length: Optional[int] = None) -> None:
    """Adds sentence-transformers' SparseEncoder files (modules.json: MLMTransformer at the root, then
    SpladePooling) to a transformers *ForMaskedLM dir, so sentence-transformers (5 and 6) and
    `kbert.SparseEncoder` read it as one SPLADE model. (Dense sentence-transformers dirs: kbert.embed.st_format.)"""
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.sparse_encoder.models.MLMTransformer"},
               {"idx": 1, "name": "1", "path": "1_SpladePooling",
                "type": "sentence_transformers.sparse_encoder.models.SpladePooling"}]
    files = {"modules.json": modules, "1_SpladePooling/config.json": _splade_pooling_config(pooling, activation),
             "config_sentence_transformers.json": SPARSE_ENCODER_CONFIG}
    if max_length:
        files["sentence_bert_config.json"] = _length_config(max_length)
    _write_json_files(directory, files)


def _splade_pooling_config(pooling: str, activation: str) -> dict:
    return {"pooling_strategy": pooling, "activation_function": activation}


def _length_config(max_length: int) -> dict:
    return {"max_seq_length": int(max_length), "do_lower_case": False}


def _write_json_files(directory: str, files: dict) -> None:
    """Writes each {relative path: content} as indented JSON under `directory`, making its folders."""
    for name, content in files.items():
        path = os.path.join(directory, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)
            f.write("\n")


INFERENCE_FREE_QUERY = "query_0_SparseStaticEmbedding"  # sentence-transformers' Router folder names
INFERENCE_FREE_DOCUMENT = "document_0_MLMTransformer"
INFERENCE_FREE_POOLING = "document_1_SpladePooling"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def document_folder(directory: str) -> str:
    """Where an inference-free SPLADE dir keeps its document model (a transformers *ForMaskedLM dir)."""
    return os.path.join(directory, INFERENCE_FREE_DOCUMENT)


def write_inference_free_encoder(directory: str, query_weights, pooling: str = "max", activation: str = "relu",
                                 max_length: Optional[int] = None) -> None:
    """Makes `directory`, whose `document_folder` holds the document model in transformers' format, an
    inference-free SPLADE dir as sentence-transformers' `Router.for_query_document` saves one: queries through
    SparseStaticEmbedding (`query_weights` `[vocab]`, with a copy of the document model's tokenizer, as its
    module holds one), documents through the masked-LM transformer and SpladePooling."""
    import shutil

    import numpy as np
    from kbert.utils import save_safetensors

    query = os.path.join(directory, INFERENCE_FREE_QUERY)
    os.makedirs(query, exist_ok=True)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(document_folder(directory), name)):
            shutil.copyfile(os.path.join(document_folder(directory), name), os.path.join(query, name))
    save_safetensors({"weight": np.ascontiguousarray(query_weights, np.float32)},
                     os.path.join(query, "model.safetensors"))
    types = {INFERENCE_FREE_QUERY: "sentence_transformers.sparse_encoder.models.SparseStaticEmbedding",
             INFERENCE_FREE_DOCUMENT: "sentence_transformers.sparse_encoder.models.MLMTransformer",
             INFERENCE_FREE_POOLING: "sentence_transformers.sparse_encoder.models.SpladePooling"}
    files = {"modules.json": [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Router"}],
             "router_config.json": {"types": types,
                                    "structure": {"query": [INFERENCE_FREE_QUERY],
                                                  "document": [INFERENCE_FREE_DOCUMENT, INFERENCE_FREE_POOLING]},
                                    "parameters": {"default_route": "document", "allow_empty_key": True,
                                                   "route_mappings": {}}},
             f"{INFERENCE_FREE_QUERY}/config.json": {"frozen": False},
             f"{INFERENCE_FREE_POOLING}/config.json": _splade_pooling_config(pooling, activation),
             "config_sentence_transformers.json": SPARSE_ENCODER_CONFIG}
    if max_length:
        files[f"{INFERENCE_FREE_DOCUMENT}/sentence_bert_config.json"] = _length_config(max_length)
    _write_json_files(directory, files)


def module_config(folder: str) -> dict:
    """A sentence-transformers module's `config.json` ({} when it has none)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def module_weights(folder: str) -> dict:
    """A sentence-transformers module's tensors: its model.safetensors, else its pytorch_model.bin (read
    without torch)."""
    path = os.path.join(folder, "model.safetensors")
    if os.path.isfile(path):
        from safetensors.numpy import load_file

        return load_file(path)
    from kbert.models.torch_files import load_torch_state

    return load_torch_state(os.path.join(folder, "pytorch_model.bin"))


def read_static(folder: str) -> dict:
    """A static model's tables (a StaticEmbedding module's folder, or a Model2Vec dir): {"vectors": [rows, dim]
    float32, "weights": [vocab] or None, "mapping": [vocab] token id -> row or None, "max_length"}.
    Model2Vec names the table "embeddings" and keeps its settings in config.json; sentence-transformers names it
    "embedding.weight"."""
    import numpy as np

    tensors = module_weights(folder)
    table = tensors.get("embeddings", tensors.get("embedding.weight"))
    if table is None:
        raise ValueError(f"{folder}: a static model's weights hold no 'embeddings' or 'embedding.weight' table "
                         f"(found {sorted(tensors)})")
    config = module_config(folder)
    weights, mapping = tensors.get("weights"), tensors.get("mapping")
    return {"vectors": np.asarray(table, np.float32),
            "weights": None if weights is None else np.asarray(weights, np.float32),
            "mapping": None if mapping is None else np.asarray(mapping, np.int64),
            "max_length": config.get("max_length", config.get("seq_length", 512))}


def dense_width(dense: list, width: int) -> int:
    """The width of vectors of `width` after the Dense layers `dense` (their last one's output)."""
    return int(dense[-1]["weight"].shape[1]) if dense else int(width)


def apply_dense(vectors, dense: list):
    """Pooled vectors `[n, h]` through Dense layers as `read_dense` gives them, in order; float32."""
    import numpy as np

    vectors = np.asarray(vectors, np.float32)
    for layer in dense:
        vectors = vectors @ layer["weight"] + layer["bias"]
        if layer["activation"] == "tanh":
            vectors = np.tanh(vectors)
    return np.asarray(vectors, np.float32)


def read_dense(directory: str, folder: str) -> dict:
    """One Dense module: {"weight": [in, out] float32, "bias": [out] float32, "activation": name}."""
    import numpy as np

    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")  # the class's default
    if activation not in DENSE_ACTIVATIONS:
        raise ValueError(f"{directory}: its Dense module's activation {activation!r} has no kbert equivalent; kbert "
                         f"applies {sorted(DENSE_ACTIVATIONS)}")
    if config.get("use_residual") or config.get("module_input_name", "sentence_embedding") != "sentence_embedding":
        raise ValueError(f"{directory}: its Dense module (residual, or on another input than the sentence vector) "
                         f"has no kbert equivalent; kbert applies a plain Dense layer to the pooled vector")
    state = module_weights(folder)
    weight = np.asarray(state["linear.weight"], np.float32).T  # torch's Linear keeps [out, in]
    if weight.shape != (config["in_features"], config["out_features"]):
        raise ValueError(f"{directory}: its Dense weights are {list(weight.shape[::-1])}, its config says "
                         f"{config['out_features']} x {config['in_features']}")
    bias = state.get("linear.bias") if config.get("bias", True) else None
    bias = np.zeros(weight.shape[1], np.float32) if bias is None else np.asarray(bias, np.float32)
    return {"weight": weight, "bias": bias, "activation": DENSE_ACTIVATIONS[activation]}


def _prompts(directory: str) -> dict:
    """The prompts of `config_sentence_transformers.json` (E5-style "query: " / "passage: " texts put before
    each input) and the one used by default: {"prompts": {...}, "default_prompt_name": name or None}."""
    path = os.path.join(directory, "config_sentence_transformers.json")
    config = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    # "" is kept: sentence-transformers 6 saves {"query": "", "document": ""} for a model without prompts, and a
    # "document": "" then wins over a "passage" prompt in its encode_document, as here
    prompts = {k: v for k, v in (config.get("prompts") or {}).items() if isinstance(v, str)}
    default = config.get("default_prompt_name")
    return {"prompts": prompts, "default_prompt_name": default if default in prompts else None}


def configured_max_length(directory: str, folder: str):
    """sentence_bert_config.json's max_seq_length (sentence-transformers < 6), else the tokenizer's
    model_max_length (where 6 keeps it); None when neither says."""
    for name, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
        for base in (directory, folder):
            path = os.path.join(base, name)
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    value = json.load(f).get(key)
                if isinstance(value, int) and 0 < value < 1_000_000:  # transformers' "no limit" is a huge number
                    return value
    return None


def check_prompts(prompts, default_prompt_name):
    """`(prompts, default_prompt_name)` validated: a dict of name -> prompt text, and None or one of its names."""
    if prompts is not None and not isinstance(prompts, dict):
        raise ValueError(f"`prompts` maps names to prompt texts, e.g. {{'query': 'query: '}}. Received: {prompts!r}")
    prompts = dict(prompts or {})
    bad = {k: v for k, v in prompts.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise ValueError(f"`prompts` maps names to prompt texts (strings). Received: {bad!r}")
    if default_prompt_name is not None and default_prompt_name not in prompts:
        raise ValueError(f"default_prompt_name {default_prompt_name!r} is not one of the prompts {sorted(prompts)}")
    return prompts, default_prompt_name
