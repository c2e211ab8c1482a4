"""`kbert.export`: a TensorFlow SavedModel that takes raw UTF-8 strings and returns vectors or class
probabilities, with normalization, tokenization, truncation and padding inside the graph.

    kbert.export("my-model", "serving/my-model")                       # serving/my-model/1/ (TF Serving)
    m = tf.saved_model.load("serving/my-model/1")                      # needs only tensorflow + tensorflow_text
    m.signatures["serving_default"](texts=tf.constant(["문장 하나"]))["embeddings"]

Signatures
    embed     `texts` [n] string -> `embeddings` [n, hidden] float32 (pooled as `Embedder.encode`)
    classify  `texts` [n] (and `text_pairs` [n] for a pair task) -> `probabilities` [n, labels] for
              classification, `predictions` [n] for regression (a `kbert finetune` model dir)

The export checks itself: the reloaded SavedModel must equal the Python `Embedder.encode` /
`TaskModel.predict` on sample Korean texts to 1e-5, or it raises.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import List, Optional, Union

import numpy as np

SIGNATURES = ("embed", "classify")
CLASSIFY_TASKS = ("classification", "pair-classification", "regression")  # task dirs `classify` serves
CHECK_TEXTS = ["대한민국은 민주공화국이다.", "학교에서 공부했다", "", "이 영화 정말 재밌다 ㅋㅋㅋㅋ " * 40,
               "옛한글 ᄒᆞᆫ글과 호환 자모 ㄱㄴㄷ 😀", "BERT와 ALBERT는 Transformer 인코더를 사용합니다."]


def _check_tokenizer(tokenizer):
    if tokenizer.morphemes:
        raise ValueError(f"This model's tokenizer pre-splits text with the {tokenizer.morphemes!r} morpheme "
                         "analyzer, which runs in Python and cannot live in a SavedModel; export a model with a "
                         "plain subword tokenizer, or serve it with kbert.Embedder / kbert.TaskModel")
    if tokenizer.form != "NFC":
        raise ValueError(f"The tokenizer normalizes with form={tokenizer.form!r}, which runs in Python only; "
                         "only NFC tokenizers can be exported")


def _graph_inputs(tokenizer, texts, pairs, max_length: int):
    """token_ids, segment_ids, padding_mask for a batch of strings, truncated as `Tokenizer.encode_batch`
    truncates (the longer segment first) and padded to the longest row."""
    import tensorflow as tf

    a = tokenizer.tf_tokenize(texts, add_special_tokens=False, portable=True)
    n = tf.shape(texts)[0]
    cls = tf.RaggedTensor.from_tensor(tf.fill([n, 1], tf.constant(tokenizer.cls_id, tf.int32)))
    sep = tf.RaggedTensor.from_tensor(tf.fill([n, 1], tf.constant(tokenizer.sep_id, tf.int32)))
    if pairs is None:
        a = a[:, :max_length - 2]
        ids = tf.concat([cls, a, sep], axis=1)
        segments = tf.zeros_like(ids)
    else:
        b = tokenizer.tf_tokenize(pairs, add_special_tokens=False, portable=True)
        middle = tokenizer.pair_separators  # XLM-RoBERTa: <s> a </s></s> b </s>
        budget = max_length - 2 - middle
        la, lb = a.row_lengths(), b.row_lengths()
        half_floor, half_ceil = budget // 2, budget - budget // 2
        fits = la + lb <= budget
        keep_a = tf.where(fits, la, tf.where(la <= half_floor, la, tf.where(lb <= half_floor, budget - lb,
                                                                              tf.cast(half_floor, la.dtype))))
        keep_b = tf.where(fits, lb, tf.where(la <= half_floor, budget - la, tf.where(lb <= half_floor, lb,
                                                                               tf.cast(half_ceil, lb.dtype))))
        a = tf.ragged.boolean_mask(a, tf.ragged.range(la) < tf.expand_dims(keep_a, 1))
        b = tf.ragged.boolean_mask(b, tf.ragged.range(lb) < tf.expand_dims(keep_b, 1))
        first = tf.concat([cls, a, sep], axis=1)
        second = tf.concat([sep] * (middle - 1) + [b, sep], axis=1)
        ids = tf.concat([first, second], axis=1)
        segments = tf.concat([tf.zeros_like(first), tf.ones_like(second)], axis=1)
    mask = tf.ones_like(ids)
    return {"token_ids": ids.to_tensor(tokenizer.pad_id), "segment_ids": segments.to_tensor(0),
            "padding_mask": mask.to_tensor(0)}


def _module(backbone, tokenizer, signature, max_length, pooling, layers, normalize, head=None, task=None, prefix="",
            dense=()):
    import tensorflow as tf

    from kbert.models.pooling import pool

    class Serving(tf.Module):
        def __init__(self):
            super().__init__(name="kbert_serving")
            self.backbone = backbone
            self.head = head
            self.tokenizer_model = tokenizer._graph_tokenizer()  # tracked: its assets travel with the model

        def _features(self, texts, pairs=None):
            return _graph_inputs(tokenizer, texts, pairs, max_length)

    module = Serving()
    spec = tf.TensorSpec([None], tf.string, name="texts")
    if signature == "embed":
        @tf.function(input_signature=[spec])
        def serve(texts):
            if prefix:  # the prompt, before the text as `Embedder.encode` puts it (then normalized with it)
                texts = tf.strings.join([tf.constant(prefix), texts])
            x = module._features(texts)
            out = module.backbone(x, training=False)
            vectors = pool(out["hidden_states"], x["padding_mask"], pooling, layers, normalize and not dense)
            for layer in dense:  # the Embedder's projections (a sentence-transformers Dense, a whitening)
                vectors = tf.matmul(vectors, tf.constant(layer["weight"])) + tf.constant(layer["bias"])
                vectors = tf.tanh(vectors) if layer["activation"] == "tanh" else vectors
            if dense and normalize:
                vectors = vectors / tf.maximum(tf.norm(vectors, axis=-1, keepdims=True), 1e-12)
            return {"embeddings": vectors}
    elif task == "pair-classification" or (task == "regression" and head["pairs"]):
        @tf.function(input_signature=[spec, tf.TensorSpec([None], tf.string, name="text_pairs")])
        def serve(texts, text_pairs):
            return _head_outputs(module, module._features(texts, text_pairs), task)
    else:
        @tf.function(input_signature=[spec])
        def serve(texts):
            return _head_outputs(module, module._features(texts), task)
    module.serve = serve
    return module


def _head_outputs(module, x, task):
    import tensorflow as tf

    logits = tf.cast(module.head["network"](x, training=False), tf.float32)
    if task == "regression":  # a cross-encoder's own output function, as TaskModel.predict applies it
        value = logits[:, 0]
        activation = module.head["activation"]
        return {"predictions": tf.sigmoid(value) if activation == "sigmoid" else
                tf.tanh(value) if activation == "tanh" else value}
    if module.head.get("multi_label"):  # each label's own probability, as TaskModel.predict gives it
        return {"probabilities": tf.sigmoid(logits)}
    return {"probabilities": tf.nn.softmax(logits, axis=-1)}


def export(model_dir: str, out_dir: str, signature: Optional[str] = None, pooling: Optional[str] = None,
           layers: Union[int, List[int], None] = None, normalize: bool = True, max_length: Optional[int] = None,
           version: int = 1, overwrite: bool = False, check: bool = True, prompt_name: Optional[str] = None,
           prompt: Optional[str] = None) -> str:
    """Writes `out_dir/<version>/` (TensorFlow Serving's layout) and returns that path.

    Args:
        model_dir: a model dir `kbert.Embedder.load` reads (for `classify`: a `kbert finetune` output, or a
            Hugging Face *ForSequenceClassification dir: a cross-encoder exports with a (texts, text_pairs)
            signature and its own output function).
        signature: "embed" (vectors) or "classify" (class probabilities / regression values); default:
            "classify" for a classification, pair-classification or regression dir of `kbert finetune`,
            "embed" for every other model.
        pooling, layers, normalize: as `Embedder.encode` (pooling and layers default to the model's
            fine-tuned pooling, else mean pooling of the last layer).
        max_length: longest input in tokens (default: the model's maximum); longer inputs are truncated.
        prompt_name, prompt: for "embed", a prompt put before every text inside the graph, as
            `Embedder.encode(prompt_name=..., prompt=...)` (default: the model's default prompt, if any), so an
            E5-style model exports once as its query encoder (`prompt_name="query"`) and once for documents.
        version: the numbered subdirectory TF Serving loads.
        overwrite: replace an existing `out_dir/<version>`.
        check: reload the export and compare it with the Python API on sample texts (1e-5).
    """
    import keras

    from kbert.utils import check_local_path

    check_local_path(out_dir, "export dir")
    if keras.backend.backend() != "tensorflow":  # the model is traced into a TensorFlow graph
        raise ValueError(f"a SavedModel is TensorFlow's format and the model is traced into its graph, so export "
                         f"runs on Keras' TensorFlow backend (KERAS_BACKEND is {keras.backend.backend()!r}): run "
                         f"`KERAS_BACKEND=tensorflow kbert export ...`; the model dir is the same on both backends")
    import tensorflow as tf

    from kbert.embed.embedder import Embedder
    from kbert.embed.task_model import task_meta

    meta = task_meta(model_dir)  # a `kbert finetune` dir's, or a Hugging Face classifier's (cross-encoders)
    if signature is None and meta is not None and meta.get("task") == "question-answering":
        raise ValueError(f"{model_dir}: a question-answering model's span decoding (windows over long contexts, the "
                         f"best span) runs in Python, so it has no SavedModel signature: answer with "
                         f"`kbert.TaskModel.answer` or `kbert serve`, or write it for transformers with "
                         f"`kbert convert --to transformers` (signature='embed' exports its backbone's vectors)")
    if signature is None:
        signature = "classify" if meta is not None and meta.get("task") in CLASSIFY_TASKS else "embed"
    if signature not in SIGNATURES:
        raise ValueError(f"`signature` must be one of {SIGNATURES}. Received: signature={signature!r}")
    if not isinstance(version, int) or version < 1:
        raise ValueError(f"`version` must be a positive integer. Received: version={version!r}")
    target = os.path.join(out_dir, str(version))
    if os.path.exists(target):
        if not overwrite:
            raise FileExistsError(f"{target} exists; pass overwrite=True (--overwrite) or another version")
        shutil.rmtree(target)
    if signature == "embed":
        emb = Embedder.load(model_dir, max_length=max_length)
        if emb.backbone is None:  # a StaticEmbedder
            raise ValueError(f"{model_dir}: a static model (a table of token vectors) has no network to export as a "
                             f"SavedModel; serve it with `kbert serve`, or load the dir with model2vec or "
                             f"sentence-transformers")
        tokenizer, backbone = emb.tokenizer, emb.backbone
        pooling, layers = emb.resolve_pooling(pooling, layers)
        _check_tokenizer(tokenizer)
        prefix = emb.prompt_text(prompt_name, prompt)
        module = _module(backbone, tokenizer, signature, emb.max_length, pooling, layers, normalize, prefix=prefix,
                         dense=emb.dense)
        limit = emb.max_length
    else:
        from kbert.embed.task_model import TaskModel

        if prompt_name is not None or prompt is not None:
            raise ValueError("`prompt_name` / `prompt` go with signature='embed' (sentence vectors)")
        prefix = ""
        if meta is None or meta.get("task") not in CLASSIFY_TASKS:
            raise ValueError(f"signature='classify' needs a classification, pair-classification or regression "
                             f"model from `kbert finetune`; {model_dir!r} is "
                             f"{'a ' + meta['task'] + ' model' if meta else 'not a fine-tuned model'}")
        model = TaskModel.load(model_dir)
        tokenizer = model.tokenizer
        _check_tokenizer(tokenizer)
        limit = model.network.backbone.config.check_length(model.max_length if max_length is None else max_length)
        head = {"network": model.network, "pairs": bool(meta.get("pair_column") or meta.get("pairs")),
                "activation": model.activation, "multi_label": model.multi_label}
        module = _module(model.network.backbone, tokenizer, signature, limit, None, -1, False, head, meta["task"])
    os.makedirs(out_dir, exist_ok=True)
    tmp = target + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tf.saved_model.save(module, tmp, signatures={"serving_default": module.serve})
    os.makedirs(os.path.join(tmp, "assets.extra"), exist_ok=True)  # TF Serving's place for extra files
    with open(os.path.join(tmp, "assets.extra", "kbert.json"), "w", encoding="utf-8") as f:
        json.dump({"signature": signature, "pooling": pooling, "layers": layers, "max_length": limit, "normalize": normalize,
                   "task": (meta or {}).get("task"), "labels": (meta or {}).get("labels"), "prompt": prefix}, f,
                  ensure_ascii=False)
    os.replace(tmp, target)
    if check:
        _self_check(target, model_dir, signature, pooling, layers, normalize, limit, meta, prefix)
    return target


def _self_check(path, model_dir, signature, pooling, layers, normalize, max_length, meta, prefix=""):
    import tensorflow as tf

    loaded = tf.saved_model.load(path)
    fn = loaded.signatures["serving_default"]
    texts = CHECK_TEXTS
    if signature == "embed":
        from kbert.embed.embedder import Embedder

        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the long sample text is truncated on purpose
            expected = Embedder.load(model_dir, max_length=max_length).encode(
                texts, pooling=pooling, layers=layers, normalize=normalize, prompt=prefix)
        got = fn(texts=tf.constant(texts))["embeddings"].numpy()
    else:
        from kbert.embed.task_model import TaskModel

        model = TaskModel.load(model_dir)
        model.max_length = max_length
        pairs = list(reversed(texts)) if "text_pairs" in fn.structured_input_signature[1] else None
        expected = model.predict(texts, pairs=pairs)
        inputs = {"texts": tf.constant(texts)}
        if pairs is not None:
            inputs["text_pairs"] = tf.constant(pairs)
        out = fn(**inputs)
        got = (out["predictions"] if "predictions" in out else out["probabilities"]).numpy()
    err = float(np.max(np.abs(got - expected))) if got.size else 0.0
    if not np.isfinite(got).all() or err > 1e-5:
        raise RuntimeError(f"The exported SavedModel at {path} differs from the Python API by {err:.2e} "
                           f"(tolerance 1e-5); please report this with the model's tokenizer")
