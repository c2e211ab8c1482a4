"""`kbert.Embedder`: Korean sentence and word vectors from any model `kbert.load_model` reads.

    emb = kbert.Embedder.load("my-model")                 # a kbert model dir (with its tokenizer), or a
    vectors = emb.encode(["문장 하나", "문장 둘"])            # Hugging Face dir holding vocab.txt / spm model
    emb.similarity(vectors, vectors); emb.search(["질문"], corpus_texts, top_k=5)
    emb.encode_words("학교에서 공부했다", unit="eojeol")  # [(word, start, end, vector), ...]

Texts are tokenized once, sorted by length and run in batches padded only to the longest text of each batch
(the graph is traced once for any shape, so exact widths cost no recompilation); a batch of mixed lengths
(concurrent requests to `kbert serve`) runs as packed rows instead, several texts per row, each attending only
to itself (`Backbone.packed_hidden_states`); results come back in input order. Texts longer
than `max_length` are truncated with one warning that counts them. An empty or blank text encodes as
`[CLS] [SEP]`, a defined vector.

On Keras' JAX backend every batch runs as `jit_compile=True` below (JAX compiles each shape; there is no
graph to run an uncompiled shape on), and word vectors run at bucketed shapes too.

`jit_compile=True` runs sentence vectors through XLA instead: the graph executor dispatches each of a few
hundred small ops one by one, which on a CPU costs milliseconds per call and leaves elementwise work (GELU,
layer norm, softmax, bias) unfused; XLA compiles the whole encoder into fused kernels. XLA compiles once per
input shape (about a second each for a small model), so every batch is packed into rows of a bucketed shape
(`WIDTH_BUCKETS` x `ROW_BUCKETS`): a handful of compilations serve any traffic. `jit_compile="background"`
(what `kbert serve` uses) runs a batch whose shape is not compiled yet on the graph and compiles that shape
in a background thread, so no request waits for a compilation.
"""

from __future__ import annotations

import itertools
import json
import os
import warnings
from typing import List, Optional, Sequence, Union

import numpy as np

from kbert.data.features import PACK_WHEN, ROW_BUCKETS, bucket, bucketed, pack_rows, packed_width, text_list
from kbert.compiled import JIT_MODES, BackgroundCompiles, CompilesInBackground, backend
from kbert.compiled import compiled, data_parallel, replicate, signature
from kbert.embed.onnx_runtime import DENSE_FILE, GRAPH_FILE, TOKENIZER_DIR, feeds, is_onnx_dir, read_dense, read_info
from kbert.embed.onnx_runtime import session as onnx_session
from kbert.models.st_dir import check_prompts
from kbert.utils import progress_bar, unit_rows
from kbert.models.pooling import (PACKED_POOLINGS, POOLINGS, check_pooling, layer_average, pool,  # noqa: F401
                                  pool_packed)

ENCODE_CHUNK = 8192  # texts tokenized at a time by `encode`
# What `encode` does with a text longer than max_length: cut it there (sentence-transformers' behaviour, with a
# warning), or average the vectors of its consecutive windows.
LONG_TEXTS = ("truncate", "mean")
UNITS = ("eojeol", "morpheme", "subword")
WORD_POOLINGS = ("mean", "first")


class Embedder(CompilesInBackground):
    """Sentence and word embeddings from a BERT/ALBERT backbone and its tokenizer."""

    def __init__(self, backbone, tokenizer, max_length: Optional[int] = None, pooling: str = "mean",
                 layers: Union[int, List[int]] = -1, jit_compile: Union[bool, str] = False,
                 prompts: Optional[dict] = None, default_prompt_name: Optional[str] = None,
                 strategy: str = "auto", dense: Optional[list] = None):
        """jit_compile: False (one traced graph for every shape), True (sentence vectors through XLA, a
        bucketed shape compiled the first time it is met), or "background" (as True, but a batch whose shape
        is not compiled yet runs on the graph while a background thread compiles it: for servers).

        prompts: named texts put before every text encoded with that name, as sentence-transformers' prompts
            (E5-style models: {"query": "query: ", "document": "passage: "}; `Embedder.load` reads a
            sentence-transformers dir's own). `encode_query` / `encode_document` and `search` use them.
        default_prompt_name: the prompt `encode` uses when it is given none (one of `prompts`).
        strategy: the devices, by `kbert pretrain --strategy`'s names: "auto" (every local device), "cpu",
            "mirrored" (the GPUs), "tpu". On Keras' JAX backend several devices each hold the weights and take
            a share of every batch's rows (a batch too small to share runs whole on each); the vectors are
            the one device's. On TensorFlow: one device, "auto" only.
        dense: projections of the pooled vector, applied in order before `normalize` (a sentence-transformers
            dir's Dense modules, as `Embedder.load` reads them; `fit_whitening` adds one): each {"weight": [in,
            out], "bias": [out], "activation": "identity" or "tanh"}. Word vectors are not projected."""
        if not getattr(backbone, "output_hidden_states", False):
            raise ValueError("Embedder needs a backbone built with output_hidden_states=True; use Embedder.load(dir)")
        if not (isinstance(jit_compile, bool) or jit_compile == "background"):
            raise ValueError(f"`jit_compile` must be one of {JIT_MODES}. Received: jit_compile={jit_compile!r}")
        check_pooling(pooling, layers, backbone.config.num_layers + 1)
        self.backbone, self.tokenizer = backbone, tokenizer
        self.config = backbone.config  # what the model's shape and limits are read from (no backbone: an ONNX one)
        # the sentence pooling `encode` uses by default: a bi-encoder dir's own (`kbert.finetune(pooling=...)`)
        self.pooling, self.layers = pooling, layers
        self.max_length = backbone.config.check_length(
            backbone.config.max_position if max_length is None else max_length)
        self.prompts, self.default_prompt_name = check_prompts(prompts, default_prompt_name)
        self.dense = check_dense(dense or [], backbone.config.hidden_size)
        # JAX compiles every shape (it has no graph to run one on meanwhile), so every batch takes the bucketed
        # path that jit_compile=True takes on TensorFlow, compiled in the foreground the first time it is met
        self._bucketed = backend() == "jax"
        self.distribution = data_parallel(strategy)  # the devices (Keras DataParallel), None for one
        if self.distribution is not None:  # the weights onto every device of the mesh
            replicate(self.distribution, backbone.variables)
        self.jit_compile = True if self._bucketed else jit_compile
        self._fns = {}
        self._compiled = BackgroundCompiles()  # (layers, rows, width) shapes XLA has compiled

    @classmethod
    def load(cls, model_dir: str, max_length: Optional[int] = None, dtype: Optional[str] = None,
             jit_compile: Union[bool, str] = False, strategy: str = "auto") -> "Embedder":
        """An Embedder for a model dir (kbert, Hugging Face with its vocab, or a `kbert pretrain` run dir: its
        `model/`), or a Hugging Face Hub name ("klue/bert-base", fetched and cached by `huggingface_hub`;
        HF_HUB_OFFLINE=1 reads the cache only). A Model2Vec dir, or a sentence-transformers dir whose first
        module is a StaticEmbedding, gives a `StaticEmbedder` (`dtype`, `jit_compile` and `strategy` do not apply);
        a dir `EnsembleEmbedder.save` wrote, that `EnsembleEmbedder`.

        Example:
            >>> emb = kbert.Embedder.load("klue/bert-base")
            >>> emb.encode(["대한민국은 민주공화국이다."]).shape
        """
        if is_ensemble_dir(model_dir):  # `EnsembleEmbedder.save`'s: its members, each loaded as below
            return EnsembleEmbedder.load(model_dir, max_length=max_length, dtype=dtype, jit_compile=jit_compile,
                                         strategy=strategy)
        if is_onnx_dir(model_dir):  # `kbert.export_onnx`'s output: the graph on ONNX Runtime, no Keras backend
            return OnnxEmbedder.load(model_dir, max_length=max_length)
        from kbert.models.locate import model_dir_of, read_task_meta, resolve_hub_name

        model_dir = model_dir_of(resolve_hub_name(model_dir))  # a hub name: its snapshot; a run dir: its model
        static = load_static(model_dir, max_length)  # numpy alone: Keras is imported only past this
        if static is not None:
            return static
        from kbert.models.convert import check_vocabulary, load_model
        from kbert.models.st_dir import read_sentence_transformers
        from kbert.text.tokenizer import Tokenizer

        task = read_task_meta(model_dir)
        # a sentence-transformers dir: its own pooling, layers and length (and its transformer's folder)
        st = None if task else read_sentence_transformers(model_dir, projections=True)
        weights_dir = st["model_dir"] if st else model_dir
        backbone = load_model(weights_dir, output_hidden_states=True, dtype=dtype)
        if max_length is None and task:  # a fine-tuned dir: the length it was tuned at
            max_length = task.get("max_length")
        if max_length is None and st and st["max_length"]:
            max_length = min(int(st["max_length"]), backbone.config.max_position)
        tokenizer = Tokenizer.from_model_dir(weights_dir)  # sentence-transformers keep it beside the weights
        check_vocabulary(backbone.config, tokenizer.vocab_size)
        pooling, layers = "mean", -1
        if task and task.get("task") == "sentence-embedding":
            pooling, layers = task.get("pooling") or "mean", task.get("layers", -1)
            layers = -1 if layers is None else layers
        elif st:
            pooling, layers = st["pooling"], st["layers"]
        own = st or (task if task and task.get("task") == "sentence-embedding" else None) or {}
        return cls(backbone, tokenizer, max_length, pooling, layers, jit_compile=jit_compile,
                   prompts=own.get("prompts"), default_prompt_name=own.get("default_prompt_name"), strategy=strategy,
                   dense=(st or {}).get("dense"))

    @property
    def dimension(self) -> int:
        """The width of `encode`'s vectors: the last projection's, else the model's hidden size."""
        from kbert.models.st_dir import dense_width

        return dense_width(self.dense, self.config.hidden_size)

    def project(self, vectors: np.ndarray) -> np.ndarray:
        """Pooled vectors `[n, hidden]` through the projections (`dense`), float32."""
        from kbert.models.st_dir import apply_dense

        return apply_dense(vectors, self.dense)

    def fit_whitening(self, texts: Sequence[str], dim: Optional[int] = None, **encode_options) -> "Embedder":
        """Adds a whitening projection fitted on `texts` (BERT-whitening, Su et al. 2021): vectors are centred on
        the texts' mean and rotated onto the principal axes of their covariance, each scaled to unit variance,
        keeping the `dim` axes of most variance (default: every axis the texts' vectors vary along). Returns self.

        Why: the vectors of a pretrained model that was never trained for similarity (KLUE-BERT, KcBERT, a
        `kbert pretrain` model) crowd into a narrow cone where every pair's cosine is high; whitening spreads
        them out with no labels, only a sample of the text they will embed (a few thousand texts), and a `dim`
        below the width also makes them smaller. A model already fine-tuned for similarity gains little or loses
        (benchmarks/README.md), so check it on a labelled sample (`kbert.evaluate_sts`). `encode`, `search`
        and `kbert.export_sentence_transformers` (a Dense module) then apply it.

        encode options: as `encode` (pooling, prompt, ...); the vectors are taken before normalization.
        """
        vectors = np.asarray(self.encode(text_list(texts), normalize=False, **encode_options), np.float64)
        if len(vectors) < 2:
            raise ValueError("whitening needs at least 2 texts to estimate a covariance")
        mean = vectors.mean(axis=0)
        u, s, _ = np.linalg.svd(np.cov(vectors - mean, rowvar=False))
        # the axes the texts vary along: a layer norm's output, for one, lies in a hyperplane (no variance
        # across it), and scaling such an axis to unit variance would only magnify rounding noise
        varying = int(np.sum(s > s[0] * 1e-9)) if s[0] > 0 else 0
        dim = varying if dim is None else dim
        if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= varying:
            raise ValueError(f"`dim` must be an integer in [1, {varying}], the number of axes these texts' "
                             f"vectors vary along (at most one fewer than the texts: fit on more texts than "
                             f"dimensions). Received: dim={dim!r}")
        weight = u[:, :dim] / np.sqrt(s[:dim])  # [width, dim]: rotate, then unit variance per axis
        self.dense.append({"weight": weight.astype(np.float32), "bias": (-mean @ weight).astype(np.float32),
                           "activation": "identity"})
        return self

    def token_vectors(self, ids: Optional[Sequence[int]] = None, batch_size: int = 1024,
                      progress: Optional[bool] = None) -> np.ndarray:
        """Each token's vector out of context, `[len(ids), dimension]` float32 (default: every token of the
        vocabulary, in id order): `[CLS] token [SEP]` through the model, pooled as `encode` pools (the model's
        own pooling and layers) and projected, not normalized. What `kbert.distill_static` builds its table from
        (Model2Vec's "output embeddings")."""
        vocab = self.tokenizer.vocab_size
        ids = np.arange(vocab) if ids is None else np.asarray(ids, np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"token ids must be in [0, {vocab}) for this vocabulary")
        pooling, layers = self.resolve_pooling()
        id_lists = [[self.tokenizer.cls_id, int(i), self.tokenizer.sep_id] for i in ids]
        out = np.zeros((len(ids), self.config.hidden_size), np.float32)
        show = progress if progress is not None else len(ids) >= 5000
        bar = progress_bar(total=len(ids), desc="token vectors", unit="token", enabled=show)
        for index, vectors in self._pooled_batches(id_lists, batch_size, bar, pooling, layers):
            out[index] = vectors
        bar.close()
        return self.project(out) if self.dense else out

    # ----------------------------------------------------------------- running the model
    def _run(self, ids: np.ndarray, mask: np.ndarray, pooling: Optional[str] = None, layers=-1):
        """All hidden states (a list of float32 arrays), or with `pooling` the pooled vectors `[b, h]`
        computed in the same graph (only the vectors leave the device)."""
        key = (pooling, layers if isinstance(layers, int) else tuple(layers))
        if key not in self._fns:
            def run(x):
                out = self.backbone(x, training=False)
                if pooling is None:
                    return out["hidden_states"]
                return pool(out["hidden_states"], x["padding_mask"], pooling, layers)

            self._fns[key] = compiled(run, self.backbone.variables, signature({"token_ids": 2, "segment_ids": 2,
                                                                                "padding_mask": 2}),
                                      distribution=self.distribution)
        rows, width = ids.shape
        if self._bucketed:  # JAX compiles each shape: round it up; the extra rows and columns are padding
            limit = self.config.max_position
            ids, mask = bucketed(ids, self.tokenizer.pad_id, limit, rows=True), bucketed(mask, 0, limit, rows=True)
        out = self._fns[key]({"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask})
        if pooling is not None:
            return np.asarray(out[:rows], dtype=np.float32)
        return [np.asarray(h[:rows, :width], dtype=np.float32) for h in out]

    def _run_packed(self, ids: np.ndarray, segments: np.ndarray, weights: np.ndarray, pooling: str, layers):
        """Pooled vectors `[r, t, h]` of packed rows: ids and segments `[r, s]`, pooling weights `[r, t, s]`
        (`kbert.models.pooling.pool_packed`). Not reached on JAX (every batch takes the bucketed XLA path)."""
        key = ("packed", pooling, layers if isinstance(layers, int) else tuple(layers))
        if key not in self._fns:
            def run(ids, segments, weights):
                return pool_packed(self.backbone.packed_hidden_states(ids, segments), weights, pooling, layers)

            self._fns[key] = compiled(run, self.backbone.variables, signature(2, 2, (3, "float32")))
        return np.asarray(self._fns[key](ids, segments, weights), dtype=np.float32)

    def _pooled_batches(self, id_lists, batch_size: int, bar, pooling: str, layers):
        """Yields (indices, pooled vectors) over length-sorted batches of at most `batch_size` texts. With
        `jit_compile`, a batch runs through XLA as packed rows of a bucketed shape. Otherwise a batch of
        mixed lengths (a server's concurrent requests) runs as packed rows, several texts per row, when that
        saves a fifth of the rows or more, and a batch of similar lengths (offline encoding) as it is."""
        for index in length_sorted(id_lists, batch_size):
            lengths = [len(id_lists[i]) for i in index]
            texts = [id_lists[i] for i in index]
            if self.jit_compile:
                width = packed_width(lengths, self.config.max_position)
                rows = pack_rows(lengths, width)
                key = (self._layer_key(pooling, layers), bucket(len(rows), ROW_BUCKETS), width)
                if self._compiled_now(key):
                    yield index, self._run_xla(key, texts, lengths, rows, pooling)
                    if bar is not None:
                        bar.update(len(index))
                    continue
            width = max(lengths)
            rows = pack_rows(lengths, width) if pooling in PACKED_POOLINGS and len(index) > 1 else None
            if rows is None or len(rows) > PACK_WHEN * len(index):
                ids, mask = self._padded(texts)
                yield index, self._run(ids, mask, pooling, layers)
            else:
                ids, segments, spans = self._fill_rows(texts, lengths, rows, (len(rows), width))
                weights = np.zeros((len(rows), max(len(row) for row in rows), width), np.float32)
                where = np.zeros((len(index), 2), np.int64)  # (row, slot) of each text
                for j, r, t, at in spans:
                    n = lengths[j]
                    if pooling == "cls":
                        weights[r, t, at] = 1.0
                    else:
                        weights[r, t, at:at + n] = 1.0 / n
                    where[j] = (r, t)
                vectors = self._run_packed(ids, segments, weights, pooling, layers)
                yield index, vectors[where[:, 0], where[:, 1]]
            if bar is not None:
                bar.update(len(index))

    def _fill_rows(self, texts, lengths, rows, shape):
        """Packed rows of `shape` [r, s]: ids, segments (1, 1, 2, ... numbering each row's texts; 0 =
        padding) and each text's place `(text, row, slot, start)`."""
        ids = np.full(shape, self.tokenizer.pad_id, np.int32)
        segments = np.zeros(shape, np.int32)
        spans = []
        for r, row in enumerate(rows):
            at = 0
            for t, j in enumerate(row):
                n = lengths[j]
                ids[r, at:at + n] = texts[j]
                segments[r, at:at + n] = t + 1
                spans.append((j, r, t, at))
                at += n
        return ids, segments, spans

    # ----------------------------------------------------------------- XLA (jit_compile)
    @staticmethod
    def _layer_key(pooling: str, layers):
        """What the compiled function depends on: which layers it averages (pooling itself runs outside)."""
        return ("first_last_avg" if pooling == "first_last_avg" else "mean",
                layers if isinstance(layers, (int, str)) else tuple(layers))

    def _xla_fn(self, layer_key):
        """The XLA-compiled encoder of packed rows: ids and segments [r, s] -> the float32 average of the
        layers a pooling reads [r, s, h]; each text is pooled from its own span outside, so the number of
        texts per row is not part of the compiled shape."""
        key = ("xla",) + layer_key
        if key not in self._fns:
            which, layers = layer_key
            layers = list(layers) if isinstance(layers, tuple) else layers

            def run(ids, segments):
                return layer_average(self.backbone.packed_hidden_states(ids, segments), which, layers)

            # TensorFlow: one trace, XLA compiles each concrete shape; JAX: one compile per shape
            self._fns[key] = compiled(run, self.backbone.variables, signature(2, 2), jit_compile=True,
                                      distribution=self.distribution)
        return self._fns[key]

    def _run_xla(self, key, texts, lengths, rows, pooling):
        layer_key, shape = key[0], key[1:]
        ids, segments, spans = self._fill_rows(texts, lengths, rows, shape)
        x = np.asarray(self._xla_fn(layer_key)(ids, segments), np.float32)
        self._compiled.add(key)
        out = np.empty((len(texts), x.shape[-1]), np.float32)
        for j, r, _, at in spans:
            piece = x[r, at:at + lengths[j]]
            out[j] = piece[0] if pooling == "cls" else piece.max(axis=0) if pooling == "max" else piece.mean(axis=0)
        return out

    def _compiled_now(self, key) -> bool:
        """Whether a batch of `key`'s shape runs through XLA now: always with jit_compile=True (compiling
        it here the first time); with "background", once a background thread has compiled it (asked here)."""
        layer_key, shape = key[0], key[1:]
        return self._compiled.ready(
            key, lambda: self._xla_fn(layer_key)(np.zeros(shape, np.int32), np.zeros(shape, np.int32)),
            background=self.jit_compile == "background")

    def _padded(self, id_lists):
        """`[b, s]` ids and padding mask, padded to the longest (exact: the traced graph takes any shape; the
        callers have truncated to the call's max_length, which may exceed the Embedder's default)."""
        width = max(len(ids) for ids in id_lists)
        ids = np.full((len(id_lists), width), self.tokenizer.pad_id, np.int32)
        mask = np.zeros((len(id_lists), width), np.int32)
        for row, x in enumerate(id_lists):
            ids[row, :len(x)] = x
            mask[row, :len(x)] = 1
        return ids, mask

    def _hidden_batches(self, id_lists, batch_size: int):
        """Yields (indices, every layer's hidden states) over length-sorted, padded batches of `id_lists`."""
        for index in length_sorted(id_lists, batch_size):
            ids, mask = self._padded([id_lists[i] for i in index])
            yield index, self._run(ids, mask)

    def _max_length(self, max_length):
        if max_length is None:
            return self.max_length
        return self.config.check_length(max_length)

    def _warn_truncated(self, truncated, total, max_length, stacklevel=3):
        if truncated:
            limit = self.config.max_position
            hint = (f"pass max_length= up to {limit} to keep more" if max_length < limit else
                    f"{limit} is the model's limit: split long texts to keep the rest")
            warnings.warn(f"{truncated} of {total} texts are longer than {max_length} tokens and were "
                          f"truncated ({hint})", stacklevel=stacklevel)

    def _encode_texts(self, texts, max_length):
        """Full encodings (tokens and offsets) for word vectors; truncated with one counting warning."""
        max_length = self._max_length(max_length)
        encodings = self.tokenizer.encode_batch(texts)
        truncated = sum(len(e.ids) > max_length for e in encodings)
        if truncated:
            self._warn_truncated(truncated, len(encodings), max_length)
            encodings = self.tokenizer.encode_batch(texts, max_length=max_length)
        return encodings

    @staticmethod
    def _layers(hidden, layers):
        """Average of the chosen layers' outputs (-1: the last; indices count the embedding output as 0)."""
        chosen = check_pooling("mean", layers, len(hidden))
        return np.mean([hidden[l] for l in chosen], axis=0)

    def resolve_pooling(self, pooling: Optional[str] = None, layers=None):
        """`(pooling, layers)` with None replaced by the model's defaults, validated."""
        if pooling is None:
            pooling = self.pooling
            layers = self.layers if layers is None else layers
        elif layers is None:
            layers = self.layers if pooling == self.pooling else -1
        check_pooling(pooling, layers, self.config.num_layers + 1)
        return pooling, layers

    # ----------------------------------------------------------------- public API
    def encode(self, texts: Union[str, Sequence[str]], pooling: Optional[str] = None,
               layers: Union[int, List[int], None] = None,
               normalize: bool = True, batch_size: int = 64, max_length: Optional[int] = None,
               progress: Optional[bool] = None, prompt_name: Optional[str] = None,
               prompt: Optional[str] = None, truncate_dim: Optional[int] = None, precision: str = "float32",
               ranges=None, calibration_embeddings=None, long_texts: str = "truncate") -> np.ndarray:
        """Sentence vectors `[n, dimension]` (a single string gives `[dimension]`; `dimension` is the hidden size, or
        the last projection's width: `dense`), float32, in input order.

        pooling: "mean" (over real tokens, [CLS]/[SEP] included, as sentence-transformers), "cls" (the [CLS]
            vector; poor for similarity before fine-tuning), "max", or "first_last_avg" (mean pooling of the
            first and last layers averaged, a strong untuned baseline).
        layers: -1, or a list of layers to average before pooling (0 = embedding output).
            Both default to the model's own: a bi-encoder fine-tuned by `kbert.finetune` pools as it was
            trained (`self.pooling`, `self.layers`); any other model, mean pooling of the last layer.
        normalize: unit length, so dot products are cosine similarities.
        prompt_name: one of `self.prompts`, put before every text (default: `self.default_prompt_name`, else
            none); prompt: the text to put there instead. The prompt's tokens count toward `max_length` and
            are pooled with the text's, as in sentence-transformers.
        truncate_dim: keep the first this many dimensions (before `normalize`): the short vectors of a model
            trained with Matryoshka widths (`kbert.finetune(matryoshka_dims=[64, 128])`), as
            sentence-transformers' `truncate_dim` and OpenAI's `dimensions`.
        precision: "float32", or quantized as sentence-transformers' `encode(precision=...)` writes it
            (`kbert.quantize_embeddings`, after `normalize`): "int8" / "uint8" (each dimension's [min, max] in
            256 buckets: `ranges` [2, dim], or `calibration_embeddings` to take them from; default: from these
            vectors, so keep `kbert.quantization_ranges` of a corpus sample for later texts and queries),
            "binary" / "ubinary" (sign bits, 8 to a byte). `search` takes such a corpus as it is.
        long_texts: what a text longer than `max_length` tokens gets: "truncate" (default; its first tokens,
            with one warning counting such texts, as sentence-transformers), or "mean": the text is cut into
            consecutive windows that fill `max_length` ([CLS], the prompt's tokens, the next stretch of the
            text, [SEP]; no overlap, so each token is read once) and its vector is the average of theirs, each
            weighted by the text tokens it holds. For statutes, decisions and articles where the first few
            hundred tokens are not the whole document. Texts that fit are encoded as with "truncate".
        """
        from kbert.embed.quantize import check_precision

        check_precision(precision)
        pooling, layers = self.resolve_pooling(pooling, layers)
        prefix = self.prompt_text(prompt_name, prompt)
        width = self.check_truncate_dim(truncate_dim)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"`batch_size` must be a positive integer. Received: batch_size={batch_size!r}")
        if long_texts not in LONG_TEXTS:
            raise ValueError(f"`long_texts` must be one of {LONG_TEXTS}. Received: long_texts={long_texts!r}")
        single = isinstance(texts, (str, bytes))
        texts = text_list(texts)
        prompt_tokens = len(self.tokenizer.ids_batch([prefix])[0]) if prefix and long_texts != "truncate" else 0
        if prefix:
            texts = [prefix + t for t in texts]
        show = progress if progress is not None else len(texts) >= 10 * batch_size
        bar = progress_bar(total=len(texts), desc="encode", unit="text", enabled=show)
        out = self._pooled_texts(texts, pooling, layers, batch_size, self._max_length(max_length), bar,
                                 long_texts, prompt_tokens)
        bar.close()
        if self.dense:
            out = self.project(out)
        if width < out.shape[1]:
            out = np.ascontiguousarray(out[:, :width])  # its own buffer, not a view of the full vectors
        if normalize:
            out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        if precision != "float32":
            from kbert.embed.quantize import quantize_embeddings

            out = quantize_embeddings(out, precision, ranges, calibration_embeddings)
        return out[0] if single else out

    def _pooled_texts(self, texts, pooling, layers, batch_size, max_length, bar, long_texts="truncate",
                      prompt_tokens: int = 0) -> np.ndarray:
        """Pooled vectors `[n, hidden]` of `texts` (prompts already in, `prompt_tokens` tokens of each), before
        projections and normalization. A text over `max_length` tokens is cut there, or with
        `long_texts="mean"` encoded in consecutive windows that fill `max_length` (each starting with the
        prompt's tokens), whose pooled vectors are averaged, weighted by the text tokens each holds."""
        out = np.zeros((len(texts), self.config.hidden_size), np.float32)
        truncated, room = 0, max_length - 2  # [CLS] and [SEP] take two
        cls, sep = self.tokenizer.cls_id, self.tokenizer.sep_id
        # Chunks bound the memory of token lists for very large inputs; each chunk is length-sorted.
        for first in range(0, len(texts), ENCODE_CHUNK):
            chunk = self.tokenizer.ids_batch(texts[first:first + ENCODE_CHUNK])
            id_lists, owner, weight = [], [], []
            for j, ids in enumerate(chunk):
                if len(ids) <= room or long_texts == "truncate":
                    truncated += len(ids) > room
                    id_lists.append([cls] + ids[:room] + [sep])
                    owner.append(j)
                    weight.append(1.0)
                    continue
                head, rest = ids[:prompt_tokens], ids[prompt_tokens:]
                step = room - len(head)
                if step < 1:
                    raise ValueError(f"the prompt takes {len(head)} of the {room} tokens a window holds: no room "
                                     f"for text; raise max_length or shorten the prompt")
                for start in range(0, len(rest), step):
                    piece = rest[start:start + step]
                    id_lists.append([cls] + head + piece + [sep])
                    owner.append(j)
                    weight.append(float(len(piece)))
            if len(id_lists) == len(chunk):
                for index, vectors in self._pooled_batches(id_lists, batch_size, bar, pooling, layers):
                    out[first + index] = vectors
                continue
            pooled = np.zeros((len(id_lists), out.shape[1]), np.float32)  # one row a window
            for index, vectors in self._pooled_batches(id_lists, batch_size, None, pooling, layers):
                pooled[index] = vectors
            owner, weight = np.asarray(owner), np.asarray(weight, np.float32)
            sums = np.zeros((len(chunk), out.shape[1]), np.float32)
            np.add.at(sums, owner, pooled * weight[:, None])
            out[first:first + len(chunk)] = sums / np.bincount(owner, weight, minlength=len(chunk))[:, None]
            if bar is not None:
                bar.update(len(chunk))
        self._warn_truncated(truncated, len(texts), max_length, stacklevel=4)  # the caller of `encode`
        return out

    def check_truncate_dim(self, truncate_dim: Optional[int]) -> int:
        """The width `encode` returns for `truncate_dim` (None: the model's); anything but 1..width raises."""
        hidden = self.dimension
        if truncate_dim is None:
            return hidden
        if isinstance(truncate_dim, bool) or not isinstance(truncate_dim, (int, np.integer)) or \
                not 1 <= truncate_dim <= hidden:
            raise ValueError(f"`truncate_dim` must be an integer in [1, {hidden}] (the model's width). "
                             f"Received: truncate_dim={truncate_dim!r}")
        return int(truncate_dim)

    def prompt_text(self, prompt_name: Optional[str] = None, prompt: Optional[str] = None) -> str:
        """The text `encode` puts before each text for these arguments ("" for none)."""
        if prompt is not None:
            if prompt_name is not None:
                raise ValueError(f"Pass `prompt_name` or `prompt`, not both. Received: prompt_name={prompt_name!r}, "
                                 f"prompt={prompt!r}")
            if not isinstance(prompt, str):
                raise ValueError(f"`prompt` must be a string. Received: prompt={prompt!r}")
            return prompt
        name = prompt_name if prompt_name is not None else self.default_prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            known = sorted(self.prompts) or "none: pass prompts= to Embedder or use a model dir that has them"
            raise ValueError(f"prompt_name {name!r} is not one of this model's prompts ({known})")
        return self.prompts[name]

    def role_prompt_name(self, role: str) -> Optional[str]:
        """The prompt sentence-transformers' `encode_query` ("query") or `encode_document` ("document": the
        first of document, passage, corpus) picks for this model, or None when it has none."""
        if role not in ("query", "document"):
            raise ValueError(f"`role` must be 'query' or 'document'. Received: role={role!r}")
        names = ("query",) if role == "query" else ("document", "passage", "corpus")
        return next((n for n in names if n in self.prompts), None)

    def role_prompt(self, role: str) -> str:
        """The text `encode_query` ("query") or `encode_document` ("document") puts before each text."""
        name = self.role_prompt_name(role)
        return "" if name is None else self.prompts[name]

    def encode_query(self, texts: Union[str, Sequence[str]], **options) -> np.ndarray:
        """`encode` with the model's query prompt (sentence-transformers' `encode_query`): for the search side
        of retrieval models trained with prompts (E5: "query: "); `encode` itself for a model without one."""
        return self._encode_as("query", texts, options)

    def encode_document(self, texts: Union[str, Sequence[str]], **options) -> np.ndarray:
        """`encode` with the model's document prompt ("document", "passage" or "corpus"; sentence-transformers'
        `encode_document`): for the texts searched."""
        return self._encode_as("document", texts, options)

    def _encode_as(self, role, texts, options):
        if options.get("prompt_name") is None and options.get("prompt") is None:
            name = self.role_prompt_name(role)
            if name is not None:
                options = dict(options, prompt_name=name)
        return self.encode(texts, **options)

    def encode_words(self, texts: Union[str, Sequence[str]], unit: str = "eojeol", pooling: str = "mean",
                     layers: Union[int, List[int]] = -1, morphemes="mecab", batch_size: int = 64,
                     max_length: Optional[int] = None):
        """For each text, a list of `(word, start, end, vector)`: subword vectors aggregated to whitespace
        words (`unit="eojeol"`), to morphemes of a kbert morpheme backend (`unit="morpheme"`), or left as
        subwords. Offsets index the normalized text (`kbert.normalize`). `morphemes`: the analyzer's name
        (`kbert.morphemes`) or the analyzer itself."""
        if unit not in UNITS:
            raise ValueError(f"`unit` must be one of {UNITS}. Received: unit={unit!r}")
        if pooling not in WORD_POOLINGS:
            raise ValueError(f"`pooling` must be one of {WORD_POOLINGS}. Received: pooling={pooling!r}")
        single = isinstance(texts, (str, bytes))
        texts = text_list(texts)
        encodings = self._encode_texts(texts, max_length)
        analyzer = None
        if unit == "morpheme" and isinstance(morphemes, str):
            from kbert.text.morphemes import morphemes as get_analyzer

            analyzer = get_analyzer(morphemes)
        elif unit == "morpheme":  # an analyzer already loaded (a server's, reused for every request)
            analyzer = morphemes
        results = [None] * len(texts)
        for index, hidden in self._hidden_batches([e.ids for e in encodings], batch_size):
            x = self._layers(hidden, layers)
            for row, i in enumerate(index):
                enc = encodings[i]
                spans = self._spans(enc, unit, analyzer)
                words = []
                for word, start, end in spans:
                    pieces = [t for t, (s, e) in enumerate(enc.offsets)
                              if e > s and s < end and e > start and 0 < t < len(enc.ids) - 1]
                    if not pieces:
                        continue
                    vec = x[row, pieces[0]] if pooling == "first" else x[row, pieces].mean(axis=0)
                    words.append((word, start, end, vec.astype(np.float32)))
                results[i] = words
        return results[0] if single else results

    @staticmethod
    def _spans(enc, unit, analyzer):
        text = enc.normalized
        if unit == "subword":
            return [(text[s:e], s, e) for (s, e) in enc.offsets if e > s]
        if unit == "morpheme":
            return [(text[m.start:m.end], m.start, m.end) for m in analyzer(text)]
        spans, start = [], None
        for j, ch in enumerate(text + " "):
            if ch == " ":
                if start is not None:
                    spans.append((text[start:j], start, j))
                    start = None
            elif start is None:
                start = j
        return spans

    @staticmethod
    def similarity(a, b) -> np.ndarray:
        """Cosine similarity matrix `[len(a), len(b)]` of two arrays of vectors (1-D inputs allowed)."""
        if any(isinstance(x, (str, bytes)) or (isinstance(x, (list, tuple)) and x and isinstance(x[0], (str, bytes)))
               for x in (a, b)):
            raise TypeError("similarity takes vectors, not texts: similarity(m.encode(texts_a), m.encode(texts_b))")
        a, b = np.atleast_2d(np.asarray(a, np.float32)), np.atleast_2d(np.asarray(b, np.float32))
        if a.shape[1] != b.shape[1]:
            raise ValueError(f"Vector sizes differ: {a.shape[1]} and {b.shape[1]}")
        return unit_rows(a) @ unit_rows(b).T

    def search(self, queries, corpus, top_k: int = 5, index: str = "exact", lexical: float = 0.0,
               corpus_vectors: Optional[np.ndarray] = None, reranker=None, candidates: int = 100,
               corpus_precision: Optional[str] = None, ranges=None, rescore_multiplier: int = 4,
               **encode_options):
        """Cosine search: for each query, `[(corpus index, score), ...]` best first. `queries` and `corpus`
        are texts or precomputed vectors. `index="faiss"` uses FAISS's exact inner-product index (the same
        hits, faster on large corpora; needs `pip install faiss-cpu`). Texts are encoded as `encode_query`
        (queries) and `encode_document` (corpus) do, so a model with prompts gets each side's own; a
        `prompt_name` / `prompt` in `encode_options` goes to both sides instead.

        lexical: hybrid search (texts on both sides, exact index): the score is `(1 - lexical)` x the
            vectors' cosine + `lexical` x the cosine of character 1-3-gram TF-IDF vectors fitted on the
            corpus (`kbert.embed.lexical`; needs scikit-learn). About 0.6, the weight a selection split of
            this project's Korean question pairs picked, beat either alone on their dev split
            (benchmarks/README.md); 0 (the default) is the vectors alone, 1 TF-IDF alone.
        corpus_vectors: with `lexical`, the corpus texts' vectors encoded once beforehand (`[len(corpus),
            hidden]`), so repeated searches over a large corpus do not encode it again.
        reranker: a cross-encoder (`kbert.TaskModel`: a Hugging Face reranker, a `kbert.finetune` pair model)
            that re-scores each query's first `candidates` hits (retrieve and rerank, sentence-transformers'
            recipe): those hits come back in its order with its scores (`TaskModel.rank`), and any hits past
            them (`top_k` > `candidates`) follow in the search's own order with its scores. Texts on both sides.
        candidates: how many of each query's first hits the reranker re-scores.
        corpus_precision: search a quantized corpus (`kbert.quantized_search`): a corpus passed as int8/uint8
            vectors (`encode(..., precision=...)`, `kbert.quantize_embeddings`) is searched as it is (its
            precision read from its dtype and width unless named here); corpus texts or float vectors are
            quantized to this precision first ("int8"/"uint8" over `ranges`, default: the corpus' own). Queries
            stay float. int8/uint8 score the query against the buckets' values and need the corpus' `ranges`;
            binary/ubinary find `top_k x rescore_multiplier` candidates by Hamming distance (FAISS's binary
            index with `index="faiss"`) and rescore them with the float query against their bits.
        """
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"`top_k` must be a positive integer. Received: top_k={top_k!r}")
        if index not in ("exact", "faiss"):
            raise ValueError(f"`index` must be 'exact' or 'faiss'. Received: index={index!r}")
        if isinstance(lexical, bool) or not isinstance(lexical, (int, float)) or not 0 <= lexical <= 1:
            raise ValueError(f"`lexical` must be a number in [0, 1]. Received: lexical={lexical!r}")
        single = isinstance(queries, str)
        quantized = isinstance(corpus, np.ndarray) and corpus.dtype.kind in "iu"
        if reranker is not None:
            if quantized:
                raise ValueError("`reranker` reads the corpus texts: pass them as `corpus`, with "
                                 "`corpus_precision` to retrieve the candidates from quantized vectors")
            return self._reranked_search(queries, corpus, top_k, reranker, candidates, single,
                                         dict(index=index, lexical=lexical, corpus_vectors=corpus_vectors,
                                              corpus_precision=corpus_precision, ranges=ranges,
                                              rescore_multiplier=rescore_multiplier, **encode_options))
        if quantized or corpus_precision not in (None, "float32"):
            if lexical:
                raise ValueError("`lexical` mixes float cosines with TF-IDF; it does not search quantized "
                                 "vectors (leave `corpus_precision` unset)")
            return self._quantized_search(queries, corpus, quantized, top_k, index, corpus_precision, ranges,
                                          rescore_multiplier, encode_options, single)
        if lexical:
            return self._hybrid_search(queries, corpus, top_k, index, float(lexical), corpus_vectors,
                                       encode_options, single)
        if corpus_vectors is not None:
            raise ValueError("`corpus_vectors` goes with `lexical` (the texts for TF-IDF, the vectors for the "
                             "cosine); without it pass the vectors as `corpus`")
        q = unit_rows(self._as_vectors(queries, encode_options, "query"))
        c = unit_rows(self._as_vectors(corpus, encode_options, "document"))
        k = min(top_k, c.shape[0])
        if index == "faiss":
            try:
                import faiss
            except ImportError:
                raise ImportError("index='faiss' needs FAISS: pip install faiss-cpu") from None
            flat = faiss.IndexFlatIP(c.shape[1])
            flat.add(np.ascontiguousarray(c, np.float32))
            scores, best = flat.search(np.ascontiguousarray(q, np.float32), k)
            hits = [[(int(j), float(v)) for j, v in zip(row, vals)] for row, vals in zip(best, scores)]
        else:
            hits = best_hits(q @ c.T, k)
        return hits[0] if single else hits

    def _quantized_search(self, queries, corpus, quantized, top_k, index, precision, ranges, rescore_multiplier,
                          encode_options, single):
        from kbert.embed.quantize import check_precision, quantization_ranges, quantize_embeddings, quantized_search

        if precision is not None:
            check_precision(precision)
        q = unit_rows(self._as_vectors(queries, encode_options, "query"))
        if not quantized:  # texts or float vectors
            vectors = unit_rows(self._as_vectors(corpus, encode_options, "document"))
            if precision in ("int8", "uint8") and ranges is None:
                ranges = quantization_ranges(vectors)  # the corpus' own, for its codes and their scoring
            corpus = quantize_embeddings(vectors, precision, ranges)
        hits = quantized_search(q, corpus, top_k, precision, ranges, rescore_multiplier, index)
        return hits[0] if single else hits

    def _hybrid_search(self, queries, corpus, top_k, index, lexical, corpus_vectors, encode_options, single):
        from kbert.embed.lexical import lexical_scores

        if index != "exact":
            raise ValueError(f"`lexical` scores every query against every text: use index='exact'. "
                             f"Received: index={index!r}")
        if isinstance(queries, np.ndarray) or isinstance(corpus, np.ndarray):
            raise ValueError("`lexical` needs the texts of the queries and the corpus, not vectors")
        queries, corpus = text_list(queries), text_list(corpus)
        if corpus_vectors is not None and np.atleast_2d(corpus_vectors).shape[0] != len(corpus):
            raise ValueError(f"`corpus_vectors` has {np.atleast_2d(corpus_vectors).shape[0]} rows for "
                             f"{len(corpus)} corpus texts")
        scores = lexical * lexical_scores(queries, corpus)
        if lexical < 1:
            vectors = corpus_vectors if corpus_vectors is not None else corpus
            scores += (1 - lexical) * (unit_rows(self._as_vectors(queries, encode_options, "query"))
                                       @ unit_rows(self._as_vectors(vectors, encode_options, "document")).T)
        hits = best_hits(scores, min(top_k, len(corpus)))
        return hits[0] if single else hits

    def _reranked_search(self, queries, corpus, top_k, reranker, candidates, single, options):
        if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1:
            raise ValueError(f"`candidates` must be a positive integer. Received: candidates={candidates!r}")
        if isinstance(queries, np.ndarray) or isinstance(corpus, np.ndarray):
            raise ValueError("`reranker` reads the texts of the queries and the corpus, not vectors (pass the "
                             "corpus' vectors as `corpus_vectors` with `lexical`)")
        reranker.check_rankable()
        queries, corpus = text_list(queries), text_list(corpus)
        first = self.search(queries, corpus, top_k=max(top_k, candidates), **options)
        out = []
        for query, hits in zip(queries, first):
            head, tail = hits[:candidates], hits[candidates:]
            ranked = reranker.rank(query, [corpus[j] for j, _ in head])
            out.append(([(head[r["corpus_id"]][0], r["score"]) for r in ranked] + tail)[:top_k])
        return out[0] if single else out

    def _as_vectors(self, items, options, role):
        if isinstance(items, np.ndarray):
            return np.atleast_2d(items)
        return np.atleast_2d(self._encode_as(role, items, options))


class StaticEmbedder(Embedder):
    """Sentence vectors without a transformer: the mean of per-token vectors read from a table, as Model2Vec
    (Tulkens and van Dongen, 2024) and sentence-transformers' StaticEmbedding compute them. A table distilled from
    a model (`kbert.distill_static`) encodes hundreds of times faster than the model on a CPU, for a loss of
    quality; `Embedder.load` returns one for a Model2Vec dir or a sentence-transformers dir with a
    StaticEmbedding module, and `kbert.export_sentence_transformers` writes one as both.

    encode, search, similarity, whitening and serving work as for `Embedder`; the texts' tokens are looked up
    without [CLS] / [SEP] and without the unknown token (as Model2Vec; sentence-transformers' StaticEmbedding
    averages the unknown token's row too, so texts with unknown characters differ there), the first `max_length`
    of them kept, and a text with none left gets the zero vector. There are no layers or poolings to choose, and no
    word vectors.
    """

    def __init__(self, vectors, tokenizer, max_length: Optional[int] = 512, weights=None, mapping=None,
                 prompts: Optional[dict] = None, default_prompt_name: Optional[str] = None,
                 dense: Optional[list] = None):
        """vectors: `[rows, dim]`, one row per token id (or per `mapping[id]`); weights: None, or `[vocab]`
        factors each token's row is scaled by before averaging (Model2Vec's quantized vocabularies);
        max_length: the tokens of a text kept (None: all)."""
        vectors = np.asarray(vectors, np.float32)
        vocab = tokenizer.vocab_size
        if vectors.ndim != 2 or vectors.shape[1] < 1:
            raise ValueError(f"`vectors` must be a [rows, dim] table. Received shape {list(vectors.shape)}")
        self.mapping = None if mapping is None else np.asarray(mapping, np.int64)
        if self.mapping is None and len(vectors) != vocab:
            raise ValueError(f"the table has {len(vectors)} rows for a vocabulary of {vocab} tokens; they must match")
        if self.mapping is not None and (self.mapping.shape != (vocab,) or self.mapping.min(initial=0) < 0 or
                                         self.mapping.max(initial=0) >= len(vectors)):
            raise ValueError(f"`mapping` must give each of the {vocab} token ids a row of the {len(vectors)}-row table")
        self.weights = None if weights is None else np.asarray(weights, np.float32)
        if self.weights is not None and self.weights.shape != (vocab,):
            raise ValueError(f"`weights` must hold one factor per token ({vocab}). Received shape "
                             f"{list(self.weights.shape)}")
        self.vectors, self.tokenizer, self.backbone, self.config = vectors, tokenizer, None, None
        self.max_length = None if max_length is None else self._max_length(max_length)  # None: every token
        self.pooling, self.layers = "mean", -1
        self.prompts, self.default_prompt_name = check_prompts(prompts, default_prompt_name)
        self.dense = check_dense(dense or [], vectors.shape[1])
        self.distribution, self.jit_compile, self._bucketed = None, False, False
        self._fns, self._compiled = {}, BackgroundCompiles()

    @property
    def dimension(self) -> int:
        from kbert.models.st_dir import dense_width

        return dense_width(self.dense, self.vectors.shape[1])

    def resolve_pooling(self, pooling: Optional[str] = None, layers=None):
        if pooling not in (None, "mean") or layers not in (None, -1):
            raise ValueError(f"a static model averages its token vectors: pooling 'mean' only, no layers. "
                             f"Received: pooling={pooling!r}, layers={layers!r}")
        return "mean", -1

    def _max_length(self, max_length):
        if max_length is None:
            return self.max_length
        if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) or max_length < 1:
            raise ValueError(f"`max_length` must be a positive number of tokens. Received: max_length={max_length!r}")
        return int(max_length)

    def _pooled_texts(self, texts, pooling, layers, batch_size, max_length, bar, long_texts="truncate",
                      prompt_tokens: int = 0) -> np.ndarray:
        """Mean token vectors of `texts`; `max_length` cuts them unless `long_texts="mean"` (the average of
        windows weighted by their tokens is the mean over every token: a table has no context)."""
        from scipy.sparse import csr_matrix

        if long_texts == "mean":
            max_length = None

        out = np.zeros((len(texts), self.vectors.shape[1]), np.float32)
        truncated, unk = 0, self.tokenizer.unk_id
        for first in range(0, len(texts), ENCODE_CHUNK):
            chunk = self.tokenizer.ids_batch(texts[first:first + ENCODE_CHUNK])
            if max_length is not None:
                truncated += sum(len(ids) > max_length for ids in chunk)
                chunk = [ids[:max_length] for ids in chunk]
            counts = np.array([len(ids) for ids in chunk], np.int64)
            flat = np.fromiter(itertools.chain.from_iterable(chunk), np.int64, int(counts.sum()))
            text_of = np.repeat(np.arange(len(chunk)), counts)
            keep = flat != unk
            flat, text_of = flat[keep], text_of[keep]
            # the means as one sparse product: [texts, rows] of 1/n (times a token's weight) @ the table, which
            # reads each row once per text instead of gathering a [tokens, dim] copy and reducing it
            share = (1.0 / np.maximum(np.bincount(text_of, minlength=len(chunk)), 1))[text_of]
            if self.weights is not None:
                share = share * self.weights[flat]
            rows = flat if self.mapping is None else self.mapping[flat]
            means = csr_matrix((share.astype(np.float32), (text_of, rows)), shape=(len(chunk), len(self.vectors)))
            out[first:first + len(chunk)] = means @ self.vectors
            bar.update(len(chunk))
        self._warn_truncated(truncated, len(texts), max_length, stacklevel=4)  # the caller of `encode`
        return out

    def _warn_truncated(self, truncated, total, max_length, stacklevel=3):
        if truncated:  # a table has no position limit, only the length asked for
            warnings.warn(f"{truncated} of {total} texts are longer than {max_length} tokens and were truncated "
                          f"(pass max_length= to keep more)", stacklevel=stacklevel)

    def encode_words(self, *args, **kwargs):
        raise ValueError("a static model has no context, so no word vectors in context: use a transformer model "
                         "(Embedder.load) for encode_words")


class OnnxEmbedder(Embedder):
    """`Embedder` on a `kbert.export_onnx` dir, run by ONNX Runtime instead of TensorFlow or JAX (neither needs
    to be installed): `encode` (prompts, truncate_dim, precision, long_texts), `search`, `similarity`,
    `fit_whitening`, `token_vectors` and `kbert serve` work as on the model it was exported from, and give its
    vectors (to 1e-5 for a float32 export); the pooling is the one exported. No word vectors: the graph returns
    pooled vectors only. `Embedder.load` returns one for such a dir.

    Batches are sorted by length and padded to their longest text, as `Embedder` on TensorFlow (ONNX Runtime
    takes any shape and compiles nothing)."""

    def __init__(self, graph, tokenizer, info: dict, max_length: Optional[int] = None, dense: Optional[list] = None):
        """graph: an onnxruntime.InferenceSession on the export's model.onnx; info: its kbert_onnx.json."""
        from kbert.models.config import ModelConfig

        if info.get("signature") != "embed":
            raise ValueError(f"this ONNX export is a {info.get('signature')!r} graph ({info.get('task')} model); "
                             f"OnnxEmbedder runs 'embed' exports: load a classifier's with kbert.OnnxTaskModel, a "
                             f"SPLADE model's ('sparse') with kbert.SparseEncoder")
        self.session, self.tokenizer, self.info = graph, tokenizer, info
        self.backbone, self.config = None, ModelConfig.from_dict(info["config"])
        self.pooling, self.layers = info["pooling"], info["layers"]
        self.max_length = self.config.check_length(info["max_length"] if max_length is None else max_length)
        self.prompts, self.default_prompt_name = check_prompts(info.get("prompts"), info.get("default_prompt_name"))
        self.dense = check_dense(dense or [], self.config.hidden_size)
        self.distribution, self.jit_compile, self._bucketed = None, False, False
        self._fns, self._compiled = {}, BackgroundCompiles()

    @classmethod
    def load(cls, model_dir: str, max_length: Optional[int] = None, threads: Optional[int] = None,
             **ignored) -> "OnnxEmbedder":
        """An OnnxEmbedder for an export dir. threads: ONNX Runtime's intra-op threads (default: one per core).
        `Embedder.load`'s dtype, jit_compile and strategy do not apply and are ignored."""
        import os

        from kbert.text.tokenizer import Tokenizer

        info = read_info(model_dir)
        tokenizer = Tokenizer.load(os.path.join(model_dir, TOKENIZER_DIR))
        graph = onnx_session(os.path.join(model_dir, GRAPH_FILE), threads)
        return cls(graph, tokenizer, info, max_length, read_dense(os.path.join(model_dir, DENSE_FILE)))

    def resolve_pooling(self, pooling: Optional[str] = None, layers=None):
        if pooling not in (None, self.pooling) or layers not in (None, self.layers):
            raise ValueError(f"this ONNX graph pools with pooling={self.pooling!r}, layers={self.layers!r}, fixed at "
                             f"export. Received: pooling={pooling!r}, layers={layers!r}; export again with the "
                             f"pooling you want (kbert.export_onnx(pooling=..., layers=...))")
        return self.pooling, self.layers

    def padded(self, id_lists: Sequence[Sequence[int]]):
        """`[b, s]` int32 ids and attention mask of token id lists, padded to the longest."""
        return self._padded(id_lists)

    def _pooled_batches(self, id_lists, batch_size: int, bar, pooling: str, layers):
        for index in length_sorted(id_lists, batch_size):
            ids, mask = self._padded([id_lists[i] for i in index])
            yield index, self._run(ids, mask, pooling, layers)
            if bar is not None:
                bar.update(len(index))

    def _run(self, ids, mask, pooling=None, layers=-1):
        if pooling is None:  # hidden states (word vectors) are not among the graph's outputs
            self.encode_words()
        return np.asarray(self.session.run(["pooled"], feeds(ids, mask))[0], np.float32)

    def encode_words(self, *args, **kwargs):
        raise ValueError("an ONNX export returns pooled vectors only, not hidden states: word vectors "
                         "(encode_words) need the model dir (kbert.Embedder.load)")


def load_static(model_dir: str, max_length: Optional[int] = None) -> Optional[StaticEmbedder]:
    """The `StaticEmbedder` of a static model, or None for any other model. A static model is a Model2Vec dir or
    a sentence-transformers dir whose first module is a StaticEmbedding; `model_dir` may be a Hub name. Nothing
    here imports Keras, so a static model loads, encodes and serves on a host with neither TensorFlow nor JAX,
    as Model2Vec's numpy-only inference does."""
    from kbert.models.locate import model_dir_of, read_task_meta, resolve_hub_name
    from kbert.models.st_dir import read_sentence_transformers, read_static
    from kbert.text.tokenizer import Tokenizer

    model_dir = model_dir_of(resolve_hub_name(model_dir))
    if read_task_meta(model_dir):  # a fine-tuned dir: a transformer
        return None
    st = read_sentence_transformers(model_dir, projections=True)
    if not (st and st.get("static")):
        return None
    table = read_static(st["static"])
    return StaticEmbedder(table["vectors"], Tokenizer.from_model_dir(st["static"]),
                          table["max_length"] if max_length is None else max_length, table["weights"], table["mapping"],
                          prompts=st["prompts"], default_prompt_name=st["default_prompt_name"], dense=st["dense"])


def check_dense(dense: list, width: int) -> list:
    """`dense` (projection layers, see `Embedder`) validated against the model's `width`: each layer's input is
    the previous one's output."""
    out = []
    for i, layer in enumerate(dense):
        weight = np.asarray(layer["weight"], np.float32)
        bias = np.asarray(layer.get("bias", np.zeros(weight.shape[-1])), np.float32)
        if weight.ndim != 2 or weight.shape[0] != width or bias.shape != (weight.shape[1],):
            raise ValueError(f"projection {i} maps {list(weight.shape)} with a bias of {list(bias.shape)}; its input "
                             f"must be the {width} dimensions before it")
        if layer.get("activation", "identity") not in ("identity", "tanh"):
            raise ValueError(f"projection {i}: activation must be 'identity' or 'tanh'. Received: "
                             f"{layer.get('activation')!r}")
        out.append({"weight": weight, "bias": bias, "activation": layer.get("activation", "identity")})
        width = weight.shape[1]
    return out


def length_sorted(id_lists, batch_size: int):
    """Index arrays of at most `batch_size` texts each, shortest first (stable), so batches need little padding."""
    order = np.argsort([len(ids) for ids in id_lists], kind="stable")
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


def best_hits(scores: np.ndarray, k: int):
    """Each row's `k` best `(column, score)` pairs of a `[queries, corpus]` score matrix, best first (ties in
    corpus order)."""
    best = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return [[(int(j), float(scores[i, j])) for j in row] for i, row in enumerate(best)]


ENSEMBLE_FILE = "ensemble.json"
# options a member's `encode` takes that mean the same for every member (the rest are the ensemble's own or refused)
MEMBER_OPTIONS = ("batch_size", "max_length", "progress", "prompt_name", "prompt", "long_texts")


def is_ensemble_dir(path: str) -> bool:
    """Whether `path` is a dir `EnsembleEmbedder.save` wrote."""
    return os.path.isfile(os.path.join(str(path), ENSEMBLE_FILE))


class EnsembleEmbedder(Embedder):
    """Several sentence-embedding models used as one.

        ens = kbert.EnsembleEmbedder(member_dirs)     # model dirs, or Embedders already loaded
        ens.save("my-ensemble")                       # ensemble.json naming the members' dirs (no weights copied)
        ens = kbert.Embedder.load("my-ensemble")      # any loader of a model dir gives the ensemble back
        ens.encode(texts); ens.similarity(a, b); ens.search(queries, corpus, top_k=5)

    Models trained apart rank sentence pairs differently, and the mean of their cosines ranks pairs better than any
    one of them (`benchmarks/quality.py --pretrain-seeds` measures it: its ensemble row is this class). The vector of
    a text is each member's unit vector scaled by sqrt(its weight), concatenated: the dot product of two such vectors
    is the weighted mean of the members' cosines, and with weights summing to 1 the vectors are unit length again
    (but where a member gives the zero vector, as a static model does for a text with no token it knows: that part
    stays zero, and cosines of the shorter vector, as `similarity` and `search` take them, weigh the other members
    alone), so `similarity`, `search` (exact, FAISS, hybrid with `lexical`, quantized, reranked) and any vector
    store work on them unchanged, at the members' summed width. Each member encodes with its own pooling, length
    and prompts.

    A member's own options (`pooling`, `layers`, `truncate_dim`, word vectors, whitening) do not carry over to the
    concatenation and are refused. `kbert serve --model DIR` serves a saved ensemble's vectors (each batch through
    every member in turn). One model to export, or to serve at one model's cost, is a student distilled from the
    ensemble (`kbert.label_pairs` scores pairs with the mean cosine: tutorial 04).
    """

    def __init__(self, members: Sequence[Embedder], weights: Optional[Sequence[float]] = None,
                 member_dirs: Optional[Sequence[str]] = None):
        """members: two or more Embedders (any kind `Embedder.load` gives, not ensembles themselves), or the
            model dirs (or Hub names) to load them from with `Embedder.load`'s defaults.
        weights: one positive number per member, scaled to sum to 1 (default: equal).
        member_dirs: where each member was loaded from, for `save` (members given as dirs name their own)."""
        members = list(members)
        if member_dirs is None and members and all(isinstance(m, (str, os.PathLike)) for m in members):
            member_dirs = [os.fspath(m) for m in members]
        members = [Embedder.load(os.fspath(m)) if isinstance(m, (str, os.PathLike)) else m for m in members]
        if len(members) < 2:
            raise ValueError(f"an ensemble needs two or more members. Received {len(members)}")
        for i, m in enumerate(members):
            if isinstance(m, EnsembleEmbedder) or not isinstance(m, Embedder):
                raise ValueError(f"member {i} must be a kbert.Embedder (not an ensemble). Received "
                                 f"{type(m).__name__}")
        if weights is None:
            weights = [1.0] * len(members)
        weights = [float(w) for w in weights]
        if len(weights) != len(members) or not all(np.isfinite(w) and w > 0 for w in weights):
            raise ValueError(f"`weights` must be {len(members)} positive numbers, one per member. "
                             f"Received: weights={weights!r}")
        if member_dirs is not None and len(member_dirs) != len(members):
            raise ValueError(f"`member_dirs` names {len(member_dirs)} dirs for {len(members)} members")
        self.members = members
        self.weights = [w / sum(weights) for w in weights]
        self.member_dirs = None if member_dirs is None else [str(d) for d in member_dirs]
        # what `Embedder`'s shared methods read: the first member's tokenizer and limits stand for the ensemble's
        # (only `encode`'s callers that count tokens read them); prompts are each member's own
        first = members[0]
        self.tokenizer, self.config, self.backbone = first.tokenizer, first.config, None
        self.max_length = first.max_length
        self.pooling, self.layers, self.dense = None, None, []  # each member's own
        self.prompts, self.default_prompt_name = {}, None

    @classmethod
    def load(cls, model_dir: str, max_length: Optional[int] = None, dtype: Optional[str] = None,
             jit_compile: Union[bool, str] = False, strategy: str = "auto") -> "EnsembleEmbedder":
        """The ensemble `save` wrote to `model_dir`: each member by `Embedder.load` (a relative dir is read
        from `model_dir`), the options passed on to every member."""
        path = os.path.join(model_dir, ENSEMBLE_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                spec = json.load(f)
            dirs, weights = list(spec["members"]), spec.get("weights")
        except FileNotFoundError:
            raise FileNotFoundError(f"{model_dir} holds no {ENSEMBLE_FILE}: not a dir EnsembleEmbedder.save wrote")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not an ensemble spec ({{'members': [dir, ...], 'weights': [...]}}): "
                             f"{e}") from None
        found = [d if os.path.isabs(d) else os.path.join(model_dir, d) for d in dirs]
        missing = [d for d in found if not os.path.exists(d)]
        if missing:
            raise FileNotFoundError(f"{path} names members that are not there: {missing}")
        members = [Embedder.load(d, max_length=max_length, dtype=dtype, jit_compile=jit_compile, strategy=strategy)
                   for d in found]
        return cls(members, weights, member_dirs=found)

    def save(self, model_dir: str) -> str:
        """Writes `model_dir/ensemble.json`: the members' dirs (relative to `model_dir`, so a tree that holds
        both moves as one) and their weights. The members' weights stay where they are. Returns the file."""
        if self.member_dirs is None:
            raise ValueError("`save` names the members' dirs, and these members were given as Embedders: build "
                             "the ensemble from their dirs (EnsembleEmbedder([dir, ...])) or pass member_dirs=[...]")
        os.makedirs(model_dir, exist_ok=True)
        dirs = [os.path.relpath(os.path.abspath(d), os.path.abspath(model_dir)) for d in self.member_dirs]
        path = os.path.join(model_dir, ENSEMBLE_FILE)
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"members": dirs, "weights": self.weights}, f, indent=1)
        return path

    @property
    def dimension(self) -> int:
        """The members' widths summed."""
        return sum(m.dimension for m in self.members)

    @property
    def compiling(self) -> int:
        return sum(m.compiling for m in self.members)

    @property
    def compiled_shapes(self) -> int:
        return sum(m.compiled_shapes for m in self.members)

    def wait_compiled(self) -> None:
        for m in self.members:
            m.wait_compiled()

    @property
    def jit_compile(self):
        return self.members[0].jit_compile

    @jit_compile.setter
    def jit_compile(self, mode):
        for m in self.members:
            m.jit_compile = mode

    def encode(self, texts: Union[str, Sequence[str]], normalize: bool = True, precision: str = "float32",
               ranges=None, calibration_embeddings=None, pooling=None, layers=None, truncate_dim=None,
               **options) -> np.ndarray:
        """Vectors `[n, dimension]` (a single string: `[dimension]`), float32 unless `precision` quantizes
        them (as `Embedder.encode`). `batch_size`, `max_length`, `progress`, `prompt_name`, `prompt` and
        `long_texts` go to every member. The vectors are unit length whatever `normalize` says (the members'
        unit vectors are what the ensemble means)."""
        self._refuse(pooling=pooling, layers=layers, truncate_dim=truncate_dim)
        return self._joined(lambda m: m.encode(texts, **self._member_options(options)), precision, ranges,
                            calibration_embeddings)

    def _encode_as(self, role, texts, options):
        # each member with its own query / document prompt
        options = dict(options)
        quantize = {k: options.pop(k, None) for k in ("ranges", "calibration_embeddings")}
        precision = options.pop("precision", "float32")
        options.pop("normalize", None)
        self._refuse(pooling=options.pop("pooling", None), layers=options.pop("layers", None),
                     truncate_dim=options.pop("truncate_dim", None))
        return self._joined(lambda m: m._encode_as(role, texts, self._member_options(options)), precision,
                            quantize["ranges"], quantize["calibration_embeddings"])

    def _joined(self, encode, precision, ranges, calibration_embeddings) -> np.ndarray:
        from kbert.embed.quantize import check_precision, quantize_embeddings
        from kbert.utils import unit_rows

        check_precision(precision)
        parts = [np.sqrt(w) * unit_rows(encode(m)) for m, w in zip(self.members, self.weights)]
        out = np.concatenate(parts, axis=-1).astype(np.float32)
        if precision != "float32":
            single = out.ndim == 1
            out = quantize_embeddings(np.atleast_2d(out), precision, ranges, calibration_embeddings)
            return out[0] if single else out
        return out

    @staticmethod
    def _member_options(options: dict) -> dict:
        unknown = sorted(set(options) - set(MEMBER_OPTIONS))
        if unknown:
            raise TypeError(f"EnsembleEmbedder.encode got unexpected options {unknown}; it takes "
                            f"{list(MEMBER_OPTIONS)} for its members, and precision, ranges, calibration_embeddings")
        return dict(options, normalize=True)

    @staticmethod
    def _refuse(**given):
        named = {k: v for k, v in given.items() if v is not None}
        if named:
            raise ValueError(f"an ensemble's vectors are its members' own, concatenated: {sorted(named)} do not "
                             f"apply to them (set them on the members before building the ensemble). Received: "
                             f"{named}")

    def check_truncate_dim(self, truncate_dim: Optional[int]) -> int:
        self._refuse(truncate_dim=truncate_dim)
        return self.dimension

    def resolve_pooling(self, pooling: Optional[str] = None, layers=None):
        """(None, None): each member pools as its own; naming a pooling or layers raises."""
        self._refuse(pooling=pooling, layers=layers)
        return None, None

    def prompt_text(self, prompt_name: Optional[str] = None, prompt: Optional[str] = None) -> str:
        """The first member's text for these arguments; every member is checked (an unknown name raises)."""
        return [m.prompt_text(prompt_name, prompt) for m in self.members][0]

    def role_prompt_name(self, role: str) -> Optional[str]:
        return self.members[0].role_prompt_name(role)

    def _unsupported(self, what: str):
        raise ValueError(f"{what} works on one model; an EnsembleEmbedder has several: call it on a member "
                         f"(`.members[i]`)")

    def encode_words(self, *args, **kwargs):
        self._unsupported("encode_words")

    def token_vectors(self, *args, **kwargs):
        self._unsupported("token_vectors")

    def fit_whitening(self, *args, **kwargs):
        self._unsupported("fit_whitening")

    def __repr__(self) -> str:
        return (f"EnsembleEmbedder({len(self.members)} members, dimension {self.dimension}, "
                f"weights {[round(w, 4) for w in self.weights]})")
