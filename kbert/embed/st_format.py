"""sentence-transformers directories: a kbert sentence-embedding model written as one, and one read back.

`SentenceTransformer(directory)` is what much of the field serves and searches with (LangChain, LlamaIndex,
vector databases, MTEB), so a bi-encoder trained with kbert (`kbert.finetune(..., "sentence-embedding")`, the
SimCSE and multi-dataset recipes) goes out in its layout instead of kbert's own: the backbone and tokenizer as
a transformers dir (`kbert.export_transformers`, `Tokenizer.export_transformers`), then the module list
sentence-transformers reads (`modules.json`: Transformer, Pooling, Normalize), the pooling config
(`1_Pooling/config.json`) and the length (`sentence_bert_config.json`). The files are written here rather
than through sentence-transformers' own `save`, which would need torch and sentence-transformers installed
to export; loading the result needs them, as it always does. Tests load it with sentence-transformers and
compare its vectors with `Embedder.encode`.

Every kbert pooling maps onto sentence-transformers' own modules: averaging several layers (the quality recipe's
bi-encoders average all of them; `first_last_avg` the first and the last) is its WeightedLayerPooling with
weight 1 on each layer read and 0 on the others (the config asks transformers for every hidden state), then
Pooling (mean, cls or max) and Normalize. The Embedder's projections (a Dense module it was loaded with, a
whitening from `Embedder.fit_whitening`) go out as Dense modules between Pooling and Normalize.

A model card (README.md, `kbert.models.card`) goes with it, carrying the training section of the source dir's.

The other way is `kbert.models.st_dir.read_sentence_transformers`, which `Embedder.load` and fine-tuning use.
"""

from __future__ import annotations

import json
import os


def export_sentence_transformers(model, directory: str, max_length=None, dtype: str = "float32") -> str:
    """Writes `model` (a model dir, a Hub name, or a `kbert.Embedder`) as a sentence-transformers dir whose
    `SentenceTransformer(directory).encode(texts)` gives `Embedder.encode(texts)` (unit vectors, cosine
    similarity), with the model's own pooling, layers and prompts. A tokenizer transformers cannot read exactly (a
    morpheme-aware one, ...) raises ValueError naming the reason, before anything is written.

    A `kbert.StaticEmbedder` (`kbert.distill_static`) is written in Model2Vec's layout, which is also a
    sentence-transformers dir (StaticEmbedding, Normalize): `model2vec.StaticModel.from_pretrained(directory)`
    and `SentenceTransformer(directory)` both load it. dtype: its table's ("float32", or "float16": half the
    size). Its projections (a whitening) are folded into the table, which is exact for identity layers."""
    import numpy as np
    from kbert.utils import save_safetensors

    from kbert.embed.embedder import Embedder, EnsembleEmbedder, StaticEmbedder
    from kbert.models.convert import export_transformers
    from kbert.models.io import TOKENIZER_DIR
    from kbert.models.st_dir import DENSE_ACTIVATIONS

    embedder = model if isinstance(model, Embedder) else Embedder.load(model, max_length=max_length)
    if isinstance(embedder, StaticEmbedder):
        return _export_static(embedder, directory, dtype)
    if isinstance(embedder, EnsembleEmbedder):
        raise ValueError(f"an EnsembleEmbedder ({len(embedder.members)} models) has no one sentence-transformers "
                         f"form: export one of its members, or a student distilled from it")
    config = embedder.backbone.config
    num_hidden = config.num_layers + 1  # the embedding output, then each layer
    weights = np.zeros(num_hidden, np.float32)  # how often each hidden state enters kbert's layer average
    if embedder.pooling == "first_last_avg":
        for index in ([1, num_hidden - 1] if num_hidden > 1 else [0]):
            weights[index] += 1
        pooling = "mean"
    else:
        chosen = range(num_hidden) if embedder.layers == "all" else (
            [embedder.layers] if isinstance(embedder.layers, int) else embedder.layers)
        for index in chosen:
            weights[index % num_hidden] += 1
        pooling = embedder.pooling
    last_only = weights[-1] == weights.sum()
    embedder.tokenizer.export_transformers(directory)  # first: its ValueError before the weights are written
    export_transformers(embedder.backbone, directory)
    embedder.tokenizer.save(os.path.join(directory, TOKENIZER_DIR))  # kbert reads the dir back as well
    modules = [{"path": "", "type": "sentence_transformers.models.Transformer"}]
    if not last_only:
        modules.append({"path": "1_WeightedLayerPooling", "type": "sentence_transformers.models.WeightedLayerPooling"})
        folder = os.path.join(directory, "1_WeightedLayerPooling")
        os.makedirs(folder, exist_ok=True)
        _write(os.path.join(folder, "config.json"), {"embedding_dimension": config.hidden_size, "layer_start": 0,
                                                     "num_hidden_layers": config.num_layers})
        save_safetensors({"layer_weights": weights}, os.path.join(folder, "model.safetensors"))
        hf_config_path = os.path.join(directory, "config.json")  # transformers then returns every hidden state
        with open(hf_config_path, encoding="utf-8") as f:
            hf_config = json.load(f)
        _write(hf_config_path, {**hf_config, "output_hidden_states": True})
    n = len(modules)
    modules.append({"path": f"{n}_Pooling", "type": "sentence_transformers.models.Pooling"})
    os.makedirs(os.path.join(directory, f"{n}_Pooling"), exist_ok=True)
    # `pooling_mode` as one string: sentence-transformers 3-5 read it beside `word_embedding_dimension`, and 6
    # (which renamed the dimension `embedding_dimension`) still reads the old name
    _write(os.path.join(directory, f"{n}_Pooling", "config.json"), {
        "word_embedding_dimension": config.hidden_size, "pooling_mode": pooling, "include_prompt": True})
    for layer in embedder.dense:  # sentence-transformers' Dense: torch's Linear ([out, in]), then the activation
        n = len(modules)
        folder = os.path.join(directory, f"{n}_Dense")
        os.makedirs(folder, exist_ok=True)
        modules.append({"path": f"{n}_Dense", "type": "sentence_transformers.models.Dense"})
        activation = {v: k for k, v in DENSE_ACTIVATIONS.items()}[layer["activation"]]
        _write(os.path.join(folder, "config.json"), {
            "in_features": int(layer["weight"].shape[0]), "out_features": int(layer["weight"].shape[1]),
            "bias": True, "activation_function": activation})
        save_safetensors({"linear.weight": np.ascontiguousarray(layer["weight"].T), "linear.bias": layer["bias"]},
                         os.path.join(folder, "model.safetensors"))
    n = len(modules)
    modules.append({"path": f"{n}_Normalize", "type": "sentence_transformers.models.Normalize"})
    os.makedirs(os.path.join(directory, f"{n}_Normalize"), exist_ok=True)
    _write(os.path.join(directory, "modules.json"),
           [{"idx": i, "name": str(i), **m} for i, m in enumerate(modules)])
    _write(os.path.join(directory, "sentence_bert_config.json"),
           {"max_seq_length": int(embedder.max_length), "do_lower_case": False})
    prompts = _prompts(embedder)
    _write(os.path.join(directory, "config_sentence_transformers.json"),
           {"similarity_fn_name": "cosine", "prompts": prompts, "default_prompt_name": embedder.default_prompt_name})
    _card(embedder, directory, model if isinstance(model, (str, os.PathLike)) else None, pooling, weights, prompts)
    return directory


def _export_static(embedder, directory: str, dtype: str) -> str:
    """Model2Vec's files: the table (`embeddings`, and `weights` / `mapping` when it has them), the vocabulary
    as a Hugging Face tokenizer.json, config.json, and the sentence-transformers modules; kbert's own tokenizer
    goes in `tokenizer/`, so kbert reads back its exact ids (a morpheme-aware vocabulary too)."""
    import numpy as np
    from kbert.utils import save_safetensors

    from kbert.models.io import TOKENIZER_DIR

    if dtype not in ("float32", "float16"):
        raise ValueError(f"`dtype` must be 'float32' or 'float16'. Received: dtype={dtype!r}")
    table = embedder.vectors.astype(np.float64)
    for layer in embedder.dense:  # the mean of rows x W + b is the mean of rows, x W + b: exact for identity layers
        if layer["activation"] != "identity" or embedder.weights is not None:
            raise ValueError("a static model's projection folds into its table only when it is linear (identity "
                             "activation) and the rows are not weighted; this one cannot be written")
        table = table @ layer["weight"] + layer["bias"]
    fast = embedder.tokenizer.fast_tokenizer()  # first: its ValueError before anything is written
    os.makedirs(directory, exist_ok=True)
    tensors = {"embeddings": np.ascontiguousarray(table.astype(dtype))}
    if embedder.weights is not None:
        tensors["weights"] = embedder.weights
    if embedder.mapping is not None:
        tensors["mapping"] = embedder.mapping
    save_safetensors(tensors, os.path.join(directory, "model.safetensors"))
    fast.no_truncation()
    fast.save(os.path.join(directory, "tokenizer.json"))
    embedder.tokenizer.save(os.path.join(directory, TOKENIZER_DIR))
    _write(os.path.join(directory, "config.json"), {
        "model_type": "model2vec", "architectures": ["StaticModel"], "hidden_dim": int(table.shape[1]),
        "normalize": True, "max_length": embedder.max_length, "embedding_dtype": dtype})
    os.makedirs(os.path.join(directory, "1_Normalize"), exist_ok=True)
    _write(os.path.join(directory, "modules.json"), [
        {"idx": 0, "name": "0", "path": ".", "type": "sentence_transformers.models.StaticEmbedding"},
        {"idx": 1, "name": "1", "path": "1_Normalize", "type": "sentence_transformers.models.Normalize"}])
    prompts = _prompts(embedder)
    _write(os.path.join(directory, "config_sentence_transformers.json"),
           {"similarity_fn_name": "cosine", "prompts": prompts, "default_prompt_name": embedder.default_prompt_name})
    return directory


def _card(embedder, directory: str, source, pooling: str, weights, prompts: dict) -> None:
    """The sentence-transformers form of the model card, with the training section of the source dir's card."""
    from kbert.models.card import model_card, training_section, write_model_card
    from kbert.models.locate import read_task_meta

    name = os.path.basename(os.path.abspath(directory))
    layers = [i for i, w in enumerate(weights) if w]
    details = [("vector width", embedder.dimension),
               ("max length", f"{int(embedder.max_length)} tokens"),
               ("pooling", pooling if layers == [len(weights) - 1] else f"{pooling} over the mean of hidden states "
                                                                          f"{layers} (0: the embeddings)"),
               ("projection", " then ".join(f"Dense {layer['weight'].shape[0]} -> {layer['weight'].shape[1]}"
                                            f"{', tanh' if layer['activation'] == 'tanh' else ''}"
                                            for layer in embedder.dense) or None),
               ("similarity", "cosine (the vectors are unit length)"),
               ("prompts", ", ".join(f"{k}: `{v}`" for k, v in prompts.items() if v) or None)]
    usage = (f'from sentence_transformers import SentenceTransformer\n\nmodel = SentenceTransformer("{name}")\n'
             f'vectors = model.encode(["한국어 문장을 벡터로 바꿉니다.", "문장 임베딩 모델입니다."])\n'
             f'print(model.similarity(vectors, vectors))\n\n'
             f'# or with kbert: kbert.Embedder.load("{name}").encode([...])')
    source_dir = os.fspath(source) if source is not None and os.path.isdir(os.fspath(source)) else None
    training = training_section(source_dir) if source_dir else None
    meta = (read_task_meta(source_dir) or {}) if source_dir else {}
    teacher = meta.get("distilled_from")  # a distilled student comes from its teacher, not from its start copy
    base = teacher or meta.get("base_model") if source_dir else source  # a Hub name: its own
    text = model_card(name, embedder.backbone.config, "sentence-embedding", library="sentence-transformers",
                      base_model=base, details=details, usage=usage,
                      origin="distilled from" if teacher else "fine-tuned from",
                      training=training, tags=["sentence-transformers", "feature-extraction", "sentence-similarity"])
    write_model_card(directory, text)


def _prompts(embedder) -> dict:
    """The embedder's prompts, with its document prompt also under "document" (and its query one under "query"):
    sentence-transformers 6 fills both names with "" when a saved dir lacks them, and its encode_document then
    reads "document" before "passage", so without the alias an E5-style "passage" prompt would go unused."""
    prompts = dict(embedder.prompts)
    for role in ("query", "document"):
        if prompts and role not in prompts:
            prompts[role] = embedder.role_prompt(role)
    return prompts


def _write(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
