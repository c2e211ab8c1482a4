"""`kbert.export_onnx` and `kbert.OnnxEmbedder`: a model as an ONNX graph, run by ONNX Runtime.

    kbert.export_onnx("my-model", "onnx/my-model")              # model.onnx + tokenizer files + kbert_onnx.json
    emb = kbert.OnnxEmbedder.load("onnx/my-model")              # needs onnxruntime, not TensorFlow or JAX
    emb.encode(["문장 하나", "문장 둘"])                           # the vectors Embedder.encode gives (1e-5)

Why ONNX beside the SavedModel of `kbert.export`: a SavedModel needs TensorFlow (and tensorflow-text) wherever it
runs, about 2.5 GB; ONNX Runtime is one ~20 MB wheel with no framework under it, runs the same graph from C#,
Java, JavaScript and C++, and is what sentence-transformers (`backend="onnx"`) and Hugging Face Optimum serve
transformer encoders with. The graph is written by Keras' own exporter (`keras.Model.export(format="onnx")`,
tf2onnx under it), which traces the very `keras.ops` model code `Embedder` runs, so no second implementation of
the network exists to drift from it; ONNX Runtime's `quantize_dynamic` gives the int8 variant.

Tokenization stays outside the graph (ONNX has no subword tokenizer op): `OnnxEmbedder` tokenizes with kbert's
tokenizer (saved in `tokenizer/`), and for other languages the dir holds the same vocabulary in transformers'
format (`tokenizer.json` / `vocab.txt`), whose output feeds the graph as it is:

    tok = transformers.AutoTokenizer.from_pretrained("onnx/my-model")
    session = onnxruntime.InferenceSession("onnx/my-model/model.onnx")
    session.run(["embeddings"], dict(tok(texts, padding=True, truncation=True, return_tensors="np")))

Graph inputs (int64, `[batch, sequence]`): `input_ids`, `attention_mask`, `token_type_ids` (transformers'
names). Outputs: for "embed", `embeddings` `[batch, dimension]` (pooled, projected, unit length when exported
with normalize=True) and `pooled` `[batch, hidden]` (before projections and normalization: what `OnnxEmbedder`
reads, so its `encode` options apply as `Embedder.encode`'s); for "classify", `probabilities` `[batch, labels]`
(or `predictions` `[batch]` for regression), as `TaskModel.predict`; for "sparse" (SPLADE),
`sparse_embedding` `[batch, vocab]`, every vocabulary weight, zeros included (ONNX Runtime has no sparse
output): `OnnxSparseEncoder` keeps the non-zero ones as CSR rows, as `SparseEncoder.encode` does.

The export checks itself: the graph and `OnnxEmbedder` (or the classifier graph) must equal the Python API on
sample Korean texts to 1e-5 (float32; vectors through projections to 1e-5 times the projections' gain), or it
raises; an int8 graph must keep every sample vector's cosine with
the float one at 0.99 or more (probabilities within 0.05).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import warnings
from typing import List, Optional, Union

import numpy as np

from kbert.embed.embedder import Embedder, OnnxEmbedder, is_ensemble_dir
from kbert.embed.export import CHECK_TEXTS, CLASSIFY_TASKS, SIGNATURES
from kbert.embed.onnx_runtime import (DENSE_FILE, FORMAT_VERSION, GRAPH_FILE, INPUTS, META_FILE, QUERY_WEIGHTS_FILE,
                                      SPARSE_OUTPUT, SPARSE_SIGNATURE, TOKENIZER_DIR, feeds, is_onnx_dir, onnxruntime,
                                      write_dense)

ONNX_SIGNATURES = SIGNATURES + (SPARSE_SIGNATURE,)  # "sparse": a SPLADE model's weights over the vocabulary
QUANTIZE = (None, "int8")
OPSET = 17  # LayerNormalization is a native op from 17 (ONNX Runtime >= 1.14)


def _features(inputs) -> dict:
    """kbert's model inputs (int32) from the graph's transformers-named int64 inputs."""
    from keras import ops

    return {"token_ids": ops.cast(inputs["input_ids"], "int32"),
            "segment_ids": ops.cast(inputs["token_type_ids"], "int32"),
            "padding_mask": ops.cast(inputs["attention_mask"], "int32")}


def _sparse_graph(encoder):
    """A keras.Model over the transformers-named inputs giving a SparseEncoder's SPLADE weights `[b, vocab]`:
    the same `splade_vectors` the encoder and the sparse-embedding trainer run."""
    import keras

    from kbert.models.tasks import splade_vectors

    class Graph(keras.Model):
        def __init__(self):
            super().__init__(name="kbert_onnx_sparse")
            self.backbone, self.mlm_head = encoder.model.backbone, encoder.model.mlm_head

        def call(self, inputs):
            # ONNX has no Log1p op (tf2onnx would emit one that no runtime runs)
            return {SPARSE_OUTPUT: splade_vectors(self.backbone, self.mlm_head, _features(inputs), encoder.pooling,
                                                  encoder.activation, False, log1p=False)}

    return Graph()


def _graph_model(backbone, pooling=None, layers=-1, dense=(), normalize=True, network=None, task=None,
                 activation="identity", multi_label=False):
    """A keras.Model over the dict of transformers-named int64 inputs: the traced function of the export."""
    import keras
    from keras import ops

    from kbert.models.pooling import pool

    class Graph(keras.Model):
        def __init__(self):
            super().__init__(name="kbert_onnx")
            self.backbone, self.network = backbone, network

        def call(self, inputs):
            x = _features(inputs)
            if self.network is not None:
                logits = ops.cast(self.network(x, training=False), "float32")
                if task != "regression":  # a multi-label classifier: each label's own sigmoid
                    return {"probabilities": ops.sigmoid(logits) if multi_label else ops.softmax(logits, axis=-1)}
                value = logits[:, 0]
                value = ops.sigmoid(value) if activation == "sigmoid" else ops.tanh(value) \
                    if activation == "tanh" else value
                return {"predictions": value}
            out = self.backbone(x, training=False)
            pooled = pool(out["hidden_states"], x["padding_mask"], pooling, layers)
            vectors = pooled
            for layer in dense:  # the Embedder's projections (a sentence-transformers Dense, a whitening)
                vectors = ops.matmul(vectors, ops.convert_to_tensor(layer["weight"])) + \
                    ops.convert_to_tensor(layer["bias"])
                vectors = ops.tanh(vectors) if layer["activation"] == "tanh" else vectors
            if normalize:
                vectors = vectors / ops.maximum(ops.norm(vectors, axis=-1, keepdims=True), 1e-12)
            return {"pooled": pooled, "embeddings": vectors}

    return Graph()


def _name_dims(path: str) -> None:
    """tf2onnx names dynamic dims `unk__N`; give them the names transformers' exports use."""
    import onnx

    proto = onnx.load(path)
    for value in list(proto.graph.input) + list(proto.graph.output):
        dims = value.type.tensor_type.shape.dim
        for d, name in zip(dims, ("batch", "sequence")):
            if d.dim_param:
                d.dim_param = name
    onnx.checker.check_model(proto)
    onnx.save(proto, path)


def _write_graph(model, path: str) -> None:
    import keras

    model({name: np.ones((1, 2), np.int64) for name in INPUTS})  # built (Keras exports built models only)
    spec = {name: keras.InputSpec(shape=(None, None), dtype="int64", name=name) for name in INPUTS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tf2onnx's deprecation notices
        model.export(path, format="onnx", input_signature=[spec], verbose=False, opset_version=OPSET)
    _name_dims(path)


def _quantize(path: str) -> None:
    """Weights of the matrix products as int8 with activations quantized on the fly (ONNX Runtime's dynamic
    quantization, the recipe of its transformer examples and of sentence-transformers' `export_dynamic_quantized
    _onnx_model`): smaller files and faster CPU matrix products for a small loss of precision."""
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    tmp, ready = path + ".int8", path + ".pre"
    # shapes inferred and the graph folded first, as the quantizer asks
    quant_pre_process(path, ready, skip_symbolic_shape=True)
    root = logging.getLogger()
    level, root.level = root.level, logging.ERROR  # its notice that pre-processing is advised, done just above
    try:
        quantize_dynamic(ready, tmp, weight_type=QuantType.QInt8)
    finally:
        root.setLevel(level)
    os.remove(ready)
    os.replace(tmp, path)


def export_onnx(model_dir, out_dir: str, signature: Optional[str] = None,
                pooling: Optional[str] = None,
                layers: Union[int, List[int], None] = None, normalize: bool = True,
                max_length: Optional[int] = None, quantize: Optional[str] = None, overwrite: bool = False,
                check: bool = True) -> str:
    """Writes `out_dir/` (model.onnx, the tokenizer, kbert_onnx.json) and returns it.

    Args:
        model_dir: a dir `kbert.Embedder.load` reads (for "classify": a `kbert finetune` classification,
            pair-classification or regression dir, or a Hugging Face classifier / cross-encoder), or a
            `kbert.Embedder` as it is in memory (with a whitening fitted, prompts or pooling set on it).
        signature: "embed" (vectors), "classify", or "sparse" (a SPLADE model: a `kbert.SparseEncoder`, a
            sentence-transformers SparseEncoder dir, or a masked-LM dir read as SPLADE; its graph outputs
            `sparse_embedding` `[batch, vocab]` and `kbert.SparseEncoder.load` runs it as `OnnxSparseEncoder`,
            an inference-free model's query table beside it). Default: "sparse" for a SparseEncoder or its dir,
            as `kbert.export` otherwise: "classify" for a fine-tuned classifier or regressor, "embed" for the rest.
        pooling, layers, normalize: the graph's pooling and whether its `embeddings` are unit length (default:
            the model's own pooling, as `Embedder.encode`). Prompts are not in the graph: they are text, put
            before the text before tokenization (`OnnxEmbedder` keeps the model's prompts).
        max_length: the longest input `OnnxEmbedder` feeds, in tokens (default: the model's, as `Embedder`);
            the graph itself takes any length up to the model's position limit.
        quantize: None (float32), or "int8" (dynamic quantization of the weights: about 4x smaller, and faster
            on CPUs with int8 instructions; check the quality on your data: benchmarks/README.md measures it).
        overwrite: replace an existing `out_dir`.
        check: compare the graph with the Python API on sample texts.
    """
    import keras

    from kbert.utils import check_local_path

    check_local_path(out_dir, "export dir")
    if keras.backend.backend() != "tensorflow":
        raise ValueError(f"the ONNX graph is traced through TensorFlow (Keras' exporter uses tf2onnx), so "
                         f"export_onnx runs on Keras' TensorFlow backend (KERAS_BACKEND is "
                         f"{keras.backend.backend()!r}): run `KERAS_BACKEND=tensorflow kbert export --format onnx "
                         f"...`; the model dir is the same on both backends")
    if quantize not in QUANTIZE:
        raise ValueError(f"`quantize` must be one of {QUANTIZE}. Received: quantize={quantize!r}")
    try:
        import tf2onnx  # noqa: F401
        import onnx  # noqa: F401
    except ImportError:
        raise ImportError("ONNX export needs tf2onnx and onnx: pip install tf2onnx onnx onnxruntime "
                          "(or kbert[onnx])") from None
    onnxruntime()
    from kbert.embed.sparse import OnnxSparseEncoder, SparseEncoder, is_sparse_model
    from kbert.embed.task_model import TaskModel, task_meta

    given = model_dir if isinstance(model_dir, (Embedder, SparseEncoder)) else None
    no_network = ("export_onnx takes an Embedder with its network; {} (a static model has no network, an ensemble "
                  "several: export one of its members or a student distilled from it{})")
    if given is None and is_ensemble_dir(model_dir):  # refused from its spec: no member is loaded to say no
        raise ValueError(no_network.format(f"{model_dir} is an EnsembleEmbedder", ""))
    if isinstance(given, Embedder) and (given.backbone is None or isinstance(given, OnnxEmbedder)):
        raise ValueError(no_network.format(f"this is a {type(given).__name__}",
                                           "; an OnnxEmbedder is an export already"))
    if isinstance(given, OnnxSparseEncoder):
        raise ValueError("export_onnx takes a SparseEncoder with its model; an OnnxSparseEncoder is an export "
                         "already")
    meta = None if given is not None else task_meta(model_dir)
    task = (meta or {}).get("task")
    if signature is None:
        sparse = isinstance(given, SparseEncoder) or (given is None and is_sparse_model(model_dir))
        signature = SPARSE_SIGNATURE if sparse else "classify" if task in CLASSIFY_TASKS else "embed"
    if signature not in ONNX_SIGNATURES:
        raise ValueError(f"`signature` must be one of {ONNX_SIGNATURES}. Received: signature={signature!r}")
    if given is not None and isinstance(given, SparseEncoder) != (signature == SPARSE_SIGNATURE):
        wanted = SPARSE_SIGNATURE if isinstance(given, SparseEncoder) else "embed"
        raise ValueError(f"a {type(given).__name__} exports with signature={wanted!r}; received "
                         f"signature={signature!r}")
    if signature == "classify" and task not in CLASSIFY_TASKS:
        raise ValueError(f"signature='classify' needs a classification, pair-classification or regression model "
                         f"from `kbert finetune`; {'this Embedder' if given is not None else repr(model_dir)} is "
                         f"{'a ' + task + ' model' if task else 'not a fine-tuned model'}")
    if os.path.exists(out_dir):
        if not overwrite:
            raise FileExistsError(f"{out_dir} exists; pass overwrite=True (--overwrite) or another dir")
        if not is_onnx_dir(out_dir) and os.listdir(out_dir):
            raise FileExistsError(f"{out_dir} holds something other than a kbert ONNX export; not replacing it")
    info = {"signature": signature, "format_version": FORMAT_VERSION, "quantize": quantize, "inputs": list(INPUTS)}
    query_weights = None
    if signature == SPARSE_SIGNATURE:
        if pooling is not None or layers is not None:
            raise ValueError("pooling and layers are a dense model's: a SPLADE graph pools the masked-LM head's "
                             "weights as its model says (max or sum over the tokens)")
        source = given if given is not None else SparseEncoder.load(model_dir, max_length=max_length)
        if given is not None and max_length is not None:
            source = copy.copy(given)  # the caller's encoder keeps its own length
            source.max_length = source.config.check_length(max_length)
        tokenizer, config, query_weights = source.tokenizer, source.config, source.query_weights
        graph = _sparse_graph(source)
        info.update(pooling=source.pooling, activation=source.activation, max_length=source.max_length,
                    prompts=source.prompts, vocab_size=source.vocab_size, outputs=[SPARSE_OUTPUT],
                    query_max_length=None if query_weights is None else source.query_max_length)
        dense = []
    elif signature == "embed":
        emb = given if given is not None else Embedder.load(model_dir, max_length=max_length)
        if given is not None and max_length is not None:
            emb = copy.copy(given)  # the caller's Embedder keeps its own length
            emb.max_length = emb.config.check_length(max_length)
        if emb.backbone is None:
            raise ValueError(f"{model_dir}: a static model (a table of token vectors) has no network to export; "
                             f"serve it with `kbert serve` or kbert.Embedder")
        tokenizer, config, source = emb.tokenizer, emb.config, emb
        pooling, layers = emb.resolve_pooling(pooling, layers)
        graph = _graph_model(emb.backbone, pooling, layers, emb.dense, normalize)
        info.update(pooling=pooling, layers=layers, normalize=bool(normalize), max_length=emb.max_length,
                    prompts=emb.prompts, default_prompt_name=emb.default_prompt_name, dense=bool(emb.dense),
                    outputs=["embeddings", "pooled"], dimension=emb.dimension)
        dense = emb.dense
    else:
        model = source = TaskModel.load(model_dir)
        tokenizer, config = model.tokenizer, model.network.backbone.config
        limit = config.check_length(model.max_length if max_length is None else max_length)
        graph = _graph_model(model.network.backbone, network=model.network, task=task, activation=model.activation,
                             multi_label=model.multi_label)
        info.update(task=task, labels=model.labels, max_length=limit, activation=model.activation,
                    multi_label=model.multi_label,
                    pairs=bool(meta.get("pair_column") or meta.get("pairs")),
                    outputs=["predictions" if task == "regression" else "probabilities"])
        dense = []
    info["config"] = config.to_dict()
    tmp = out_dir.rstrip("/\\") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        _write_graph(graph, os.path.join(tmp, GRAPH_FILE))
        if quantize:
            _quantize(os.path.join(tmp, GRAPH_FILE))
        tokenizer.save(os.path.join(tmp, TOKENIZER_DIR))
        try:  # transformers' tokenizer files beside the graph, for use without kbert
            tokenizer.export_transformers(tmp)
            info["transformers_tokenizer"] = True
        except ValueError as e:  # a morpheme-aware vocabulary: only kbert's tokenizer reads it
            info["transformers_tokenizer"] = False
            info["transformers_tokenizer_note"] = str(e)
        if dense:
            write_dense(os.path.join(tmp, DENSE_FILE), dense)
        if query_weights is not None:  # an inference-free model's queries: a table lookup, no graph
            np.save(os.path.join(tmp, QUERY_WEIGHTS_FILE), query_weights)
        with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as f:
            json.dump(info, f, ensure_ascii=False, indent=2)
        if check:
            _self_check(tmp, source, info)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def _self_check(path, source, info):
    """Raises unless the export at `path` gives the Python API's outputs on CHECK_TEXTS: (got, expected,
    tolerance) triples, each within its tolerance (float32), or within cosine 0.99 / 0.05 (int8). source: the
    exported Embedder ("embed") or TaskModel ("classify"), copied before its settings change."""
    int8 = info["quantize"] == "int8"
    tolerance = 0.05 if int8 else 1e-5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the long sample text is truncated on purpose
        if info["signature"] == "embed":
            emb = copy.copy(source)  # its projections are dropped below for the pooled check
            onnx = OnnxEmbedder.load(path)
            options = dict(pooling=info["pooling"], layers=info["layers"], normalize=info["normalize"])
            options["max_length"] = info["max_length"]
            expected = emb.encode(CHECK_TEXTS, **options)
            # the graph's own final output, on the same ids
            ids = [[onnx.tokenizer.cls_id] + x[:onnx.max_length - 2] + [onnx.tokenizer.sep_id]
                   for x in onnx.tokenizer.ids_batch(CHECK_TEXTS)]
            padded, mask = onnx.padded(ids)
            direct = onnx.session.run(["embeddings"], feeds(padded, mask))[0]
            # A projection multiplies rounding differences by up to its spectral norm (a whitening's scales the
            # least-varying axes up by 1/sqrt of their variance): the pooled vectors are held to 1e-5, the
            # projected ones to 1e-5 times the projections' gain.
            gain = float(np.prod([np.linalg.norm(layer["weight"], 2) for layer in emb.dense])) if emb.dense else 1.0
            projected = tolerance * max(gain, 1.0)
            checks = [(onnx.encode(CHECK_TEXTS, normalize=info["normalize"]), expected, projected),
                      (direct, expected, projected)]
            if emb.dense:
                emb.dense, onnx.dense = [], []
                options["normalize"] = False
                checks.append((onnx.encode(CHECK_TEXTS, normalize=False), emb.encode(CHECK_TEXTS, **options),
                               tolerance))
        elif info["signature"] == SPARSE_SIGNATURE:
            from kbert.embed.sparse import OnnxSparseEncoder

            onnx = OnnxSparseEncoder.load(path)
            expected = source.encode(CHECK_TEXTS).toarray()  # the exporter gave `source` the export's length
            # weights reach the tens: the float32 graph is held to 1e-5 of the largest
            checks = [(onnx.encode(CHECK_TEXTS).toarray(), expected, tolerance * max(1.0, float(expected.max())))]
        else:
            from kbert.embed.onnx_task import OnnxTaskModel

            model = copy.copy(source)
            model.max_length = info["max_length"]
            pairs = list(reversed(CHECK_TEXTS)) if info["pairs"] else None
            expected = model.predict(CHECK_TEXTS, pairs=pairs)
            checks = [(OnnxTaskModel.load(path).predict(CHECK_TEXTS, pairs=pairs), expected, tolerance)]
    for got, expected, tol in checks:
        got = np.asarray(got, np.float32)
        if not np.isfinite(got).all():
            raise RuntimeError(f"the ONNX graph at {path} gives non-finite values on sample texts")
        if int8 and info["signature"] in ("embed", SPARSE_SIGNATURE):
            # a SPLADE row may be all zeros (no token above 0) on both sides: no direction to compare
            cos = np.diag(Embedder.similarity(got, expected))[np.abs(expected).max(axis=1) > 0]
            if cos.min() < 0.99:
                raise RuntimeError(f"the int8 graph's vectors drift from the float model's (lowest cosine "
                                   f"{cos.min():.4f} on sample texts, below 0.99): export without quantize")
            continue
        err = float(np.max(np.abs(got - expected))) if got.size else 0.0
        if err > tol:
            raise RuntimeError(f"the ONNX graph at {path} differs from the Python API by {err:.2e} (tolerance "
                               f"{tol:.1e}); please report this with the model's config")

