"""`kbert.SparseEncoder`: SPLADE sparse vectors, one weight per vocabulary token, from any model with a masked-LM
head (Formal et al. 2021, "SPLADE v2"): sentence-transformers' `SparseEncoder` on the same dirs.

    enc = kbert.SparseEncoder.load("my-pretraining-run")  # a kbert pretrain output, a Hugging Face *ForMaskedLM dir,
    enc = kbert.SparseEncoder.load("splade-ko")           # or a sentence-transformers SparseEncoder dir (SPLADE)
    docs = enc.encode_document(passages)                  # scipy.sparse.csr_matrix [n, vocab], float32
    enc.decode(docs[0], top_k=8)                          # [("▁국회", 2.31), ("법률", 1.97), ...]
    enc.search(["국회의 권한"], docs, top_k=5)              # [[(index, score), ...]]: dot products, best first

Why: on Korean text, lexical match is a strong signal (character n-gram TF-IDF beats small dense models on
this project's STS and question-pair sets, benchmarks/README.md), and a sparse vector keeps it while the
masked-LM head adds the related words a text does not spell out (`국회` -> `의회`, `법률`); the weights are
readable (`decode`) and serve from an inverted index. A text's vector is, for each vocabulary token, the max
(or the sum) over the text's tokens of log(1 + relu(masked-LM logit)), padding left out: SpladePooling's
formula, tested against sentence-transformers on the same weights.

Inference-free SPLADE (OpenSearch's doc-only sparse models; sentence-transformers' `Router.for_query_document`
of SparseStaticEmbedding and SPLADE) is read too: documents go through the model, and a query's vector is a
fixed weight for each token it holds, so queries cost a tokenization (`encode_query`).

Vectors are scipy CSR matrices (scipy is a base dependency), the form scikit-learn, Pyserini-style inverted
indexes and `sentence_transformers` (`.to_sparse_csr`) exchange; the search is scipy's sparse product.
"""

from __future__ import annotations

import os
import warnings
from typing import List, Optional, Sequence, Union

import numpy as np

from kbert.compiled import backend, compiled, signature
from kbert.data.features import bucketed, features, str_list
from kbert.embed.embedder import best_hits, length_sorted
from kbert.embed.onnx_runtime import (GRAPH_FILE, QUERY_WEIGHTS_FILE, SPARSE_OUTPUT, TOKENIZER_DIR, feeds,
                                      is_sparse_export, read_info)
from kbert.embed.onnx_runtime import session as onnx_session
from kbert.models.pooling import SPLADE_ACTIVATIONS, SPLADE_POOLINGS
from kbert.utils import positive_int, progress_bar, write_atomic

SEARCH_CHUNK = 256  # queries scored at once: a [256, corpus] dense block of scores


class SparseEncoder:
    """A masked-LM model read as a SPLADE encoder.

    Args:
        model: a `kbert.Pretrainer` whose masked-LM head is trained (`kbert.load_model(dir, require_heads=True)`).
        tokenizer: its `kbert.Tokenizer`.
        max_length: tokens per text, [CLS] and [SEP] included (default and limit: the model's positions); longer
            texts are truncated, with one warning that counts them.
        pooling: "max" (SPLADE v2 and later) or "sum" (the first SPLADE).
        activation: "relu" (every SPLADE model) or "log1p_relu" (a second log, as OpenSearch's sparse models).
        prompts: texts put before each input by name ({"query": "query: "}), as sentence-transformers' prompts.
        jit_compile: run through XLA (rows and widths padded to a few bucketed shapes); always so on JAX.
        query_weights: inference-free SPLADE (OpenSearch's doc-only sparse models; sentence-transformers' Router of
            SparseStaticEmbedding and SPLADE): one weight per vocabulary token `[vocab]`, and a query's vector is
            the weight of each token it holds ([CLS] and [SEP] left out), so no model runs for a query
            (`encode_query`); documents (`encode`, `encode_document`) go through the model.
        query_max_length: the tokens of a query read with `query_weights` (default: `max_length`).
    """

    def __init__(self, model, tokenizer, max_length: Optional[int] = None, pooling: str = "max",
                 activation: str = "relu", prompts: Optional[dict] = None, jit_compile: bool = False,
                 query_weights=None, query_max_length: Optional[int] = None, config=None):
        if pooling not in SPLADE_POOLINGS:
            raise ValueError(f"`pooling` must be one of {SPLADE_POOLINGS}. Received: {pooling!r}")
        if activation not in SPLADE_ACTIVATIONS:
            raise ValueError(f"`activation` must be one of {SPLADE_ACTIVATIONS}. Received: {activation!r}")
        self.config = config if config is not None else model.config  # config: without a model (an ONNX graph)
        self.model, self.tokenizer = model, tokenizer
        # refused past the positions, as Embedder does: a clamp would read fewer tokens than asked, unsaid
        self.max_length = (self.config.max_position if max_length is None  # [CLS], a token, [SEP] at least
                           else self.config.check_length(max_length, minimum=3))
        self.pooling, self.activation = pooling, activation
        self.prompts = dict(prompts or {})
        # JAX compiles every (bucketed) shape; an ONNX graph (no model) needs no Keras backend at all
        self.jit_compile = model is not None and (bool(jit_compile) or backend() == "jax")
        self._fn = None
        self.query_weights = None if query_weights is None else np.asarray(query_weights, np.float32)
        if self.query_weights is not None and self.query_weights.shape != (self.vocab_size,):
            raise ValueError(f"`query_weights` must hold one weight per vocabulary token ({self.vocab_size}). "
                             f"Received shape {self.query_weights.shape}")
        self.query_max_length = (self.max_length if query_max_length is None
                                 else positive_int(query_max_length, "query_max_length"))

    @property
    def vocab_size(self) -> int:
        """The vectors' width: the model's vocabulary (a checkpoint may pad it past the tokenizer's)."""
        return self.config.vocab_size

    def token(self, i: int) -> str:
        """Vocabulary entry `i` as text; an id past the tokenizer's vocabulary (padded rows) as `<i>`."""
        vocab = self.tokenizer.vocab
        return vocab[i] if i < len(vocab) else f"<{i}>"

    @classmethod
    def load(cls, model_dir: str, max_length: Optional[int] = None, dtype: Optional[str] = None,
             jit_compile: bool = False) -> "SparseEncoder":
        """A sentence-transformers SparseEncoder dir (MLMTransformer + SpladePooling: its pooling, activation,
        length and prompts are read), or any dir `kbert.MaskedLM.load` reads (a `kbert pretrain` output, a
        Hugging Face *ForMaskedLM / *ForPreTraining dir, a Hub name), read with max pooling and relu. A dir
        without a masked-LM head is a ValueError that says so. A `kbert.export_onnx` dir of a SPLADE model
        gives an `OnnxSparseEncoder` (no Keras backend needed)."""
        if is_sparse_export(model_dir):
            return OnnxSparseEncoder.load(model_dir, max_length=max_length)
        from kbert.models.convert import check_vocabulary, load_model  # Keras: only where a model is loaded
        from kbert.models.locate import model_dir_of, resolve_hub_name
        from kbert.models.st_dir import read_sparse_encoder
        from kbert.text.tokenizer import Tokenizer

        model_dir = model_dir_of(resolve_hub_name(model_dir))
        found = read_sparse_encoder(model_dir) or {"model_dir": model_dir, "pooling": "max", "activation": "relu",
                                                   "max_length": None, "prompts": {}}
        weights_dir = found["model_dir"]
        model = load_model(weights_dir, require_heads=True, dtype=dtype)
        tokenizer = Tokenizer.from_model_dir(weights_dir)
        check_vocabulary(model.config, tokenizer.vocab_size)
        if max_length is None and found["max_length"]:
            max_length = min(found["max_length"], model.config.max_position)
        return cls(model, tokenizer, max_length=max_length, pooling=found["pooling"],
                   activation=found["activation"], prompts=found["prompts"], jit_compile=jit_compile,
                   query_weights=found.get("query_weights"), query_max_length=found.get("query_max_length"))

    # ------------------------------------------------------------------ encoding
    def encode(self, texts: Union[str, Sequence[str]], batch_size: int = 16, max_active_dims: Optional[int] = None,
               prompt_name: Optional[str] = None, prompt: Optional[str] = None, progress: bool = False):
        """Sparse vectors `[n, vocab]` (scipy.sparse.csr_matrix, float32; `[1, vocab]` for one text).

        Args:
            batch_size: texts per forward pass. The head's logits are `[batch, tokens, vocab]` float32 before
                pooling (16 x 128 x 32,000: 262 MB), so the default is smaller than `Embedder.encode`'s.
            max_active_dims: keep each vector's this many largest weights (sentence-transformers'
                `max_active_dims`): a smaller index and faster search for a little recall.
            prompt_name / prompt: a prompt of the model's (`prompts`) or a text to put before each input.
        """
        from scipy.sparse import csr_matrix, vstack

        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"`batch_size` must be an int >= 1. Received: batch_size={batch_size!r}")
        _check_dims(max_active_dims)
        items = str_list(texts)
        prefix = self._prompt(prompt_name, prompt)
        if prefix:
            items = [prefix + t for t in items]
        room = self.max_length - 2
        id_lists = self.tokenizer.ids_batch(items)
        truncated = sum(len(ids) > room for ids in id_lists)
        if truncated:
            warnings.warn(f"{truncated} of {len(items)} texts are longer than {self.max_length} tokens and were "
                          f"truncated", stacklevel=2)
        rows = [[self.tokenizer.cls_id] + ids[:room] + [self.tokenizer.sep_id] for ids in id_lists]
        parts, order = [], []
        bar = progress_bar(total=len(rows), desc="sparse encode", unit="text", enabled=progress)
        for index in length_sorted(rows, batch_size):
            weights = self._pooled([rows[i] for i in index])  # [b, vocab]
            if max_active_dims is not None and max_active_dims < weights.shape[1]:
                cut = np.argpartition(-weights, max_active_dims - 1, axis=1)[:, max_active_dims:]
                np.put_along_axis(weights, cut, 0.0, axis=1)
            parts.append(csr_matrix(weights))
            order.append(index)
            bar.update(len(index))
        bar.close()
        if not parts:
            return csr_matrix((0, self.vocab_size), dtype=np.float32)
        stacked = vstack(parts, format="csr")
        inverse = np.empty(len(rows), np.int64)
        inverse[np.concatenate(order)] = np.arange(len(rows))
        return stacked[inverse].astype(np.float32)

    def encode_query(self, texts, **options):
        """`encode` with the model's "query" prompt, when it has one (sentence-transformers' encode_query); for an
        inference-free model, the query weights of each query's tokens (no model runs)."""
        options = self._side("query", options)
        if self.query_weights is None:
            return self.encode(texts, **options)
        return self._static_query(texts, **options)

    def _static_query(self, texts, batch_size: int = 16, max_active_dims: Optional[int] = None,
                      prompt_name: Optional[str] = None, prompt: Optional[str] = None, progress: bool = False):
        """`[n, vocab]` CSR: row i holds `query_weights` at each distinct token of text i (sentence-transformers'
        SparseStaticEmbedding: the tokenizer without [CLS] / [SEP], truncated to `query_max_length`)."""
        from scipy.sparse import csr_matrix

        del batch_size, progress  # no batches: a lookup per token
        _check_dims(max_active_dims)
        items = str_list(texts)
        prefix = self._prompt(prompt_name, prompt)
        rows, cols, values = [], [], []
        for i, ids in enumerate(self.tokenizer.ids_batch([prefix + t for t in items])):
            present = np.unique(np.asarray(ids[:self.query_max_length], np.int64))
            weights = self.query_weights[present]
            if max_active_dims is not None and max_active_dims < len(present):
                keep = np.sort(np.argsort(-weights, kind="stable")[:max_active_dims])
                present, weights = present[keep], weights[keep]
            rows.append(np.full(len(present), i)), cols.append(present), values.append(weights)
        if not items:
            return csr_matrix((0, self.vocab_size), dtype=np.float32)
        matrix = csr_matrix((np.concatenate(values), (np.concatenate(rows), np.concatenate(cols))),
                            shape=(len(items), self.vocab_size), dtype=np.float32)
        matrix.eliminate_zeros()
        return matrix

    def encode_document(self, texts, **options):
        """`encode` with the model's "document" prompt, when it has one."""
        return self.encode(texts, **self._side("document", options))

    def _side(self, name: str, options: dict) -> dict:
        if "prompt" not in options and "prompt_name" not in options and self.prompts.get(name):
            options = dict(options, prompt_name=name)
        return options

    def _prompt(self, prompt_name, prompt) -> str:
        if prompt is not None and prompt_name is not None:
            raise ValueError("pass `prompt` or `prompt_name`, not both")
        if prompt_name is not None:
            if prompt_name not in self.prompts:
                raise ValueError(f"prompt_name {prompt_name!r} is not one of the model's prompts "
                                 f"{sorted(self.prompts)}")
            return self.prompts[prompt_name]
        return prompt or ""

    def _forward(self, x):  # a method, not a lambda: AutoGraph reads its source
        from kbert.models.tasks import splade_vectors  # Keras: imported where a model runs, not by an ONNX host

        return splade_vectors(self.model.backbone, self.model.mlm_head, x, self.pooling, self.activation, False)

    def _pooled(self, rows: List[List[int]]) -> np.ndarray:
        """`[len(rows), vocab]` float32 SPLADE weights of rows of ids ([CLS] ... [SEP])."""
        if self._fn is None:
            self._fn = compiled(self._forward, self.model.variables,
                                signature({"token_ids": 2, "segment_ids": 2, "padding_mask": 2}),
                                jit_compile=self.jit_compile)
        pad_id = self.tokenizer.pad_id
        ids = np.full((len(rows), max(len(r) for r in rows)), pad_id, np.int32)
        for k, r in enumerate(rows):
            ids[k, :len(r)] = r
        if self.jit_compile:
            ids = bucketed(ids, pad_id, self.max_length, rows=True)
        return np.array(self._fn(features(ids, np.zeros_like(ids), pad_id)), np.float32)[:len(rows)]

    # ------------------------------------------------------------------ reading and scoring
    def weights(self, vectors, top_k: Optional[int] = None) -> List[tuple]:
        """Each row's `(token ids, weights)`, two numpy arrays heaviest first (ties in id order), one pair per
        row of a matrix (or of a 1-D vector); `top_k`: the first k only. What `decode`, the server's sparse route
        and `kbert embed --sparse` print."""
        from scipy.sparse import csr_matrix, issparse

        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"`top_k` must be an int >= 1 or None. Received: {top_k!r}")
        matrix = csr_matrix(vectors if issparse(vectors) else np.atleast_2d(np.asarray(vectors, np.float32)))
        self._check_width(matrix)
        matrix.sort_indices()
        out = []
        for i in range(matrix.shape[0]):
            lo, hi = matrix.indptr[i], matrix.indptr[i + 1]
            ids, values = matrix.indices[lo:hi], matrix.data[lo:hi]
            order = np.argsort(-values, kind="stable")[:top_k]
            out.append((ids[order], values[order]))
        return out

    def decode(self, vectors, top_k: Optional[int] = None):
        """Each vector's tokens and weights, heaviest first: `[(token, weight), ...]` for one vector (a 1-D
        array or a one-row matrix), a list of those for several. `top_k`: the first k only."""
        from scipy.sparse import issparse

        single = not issparse(vectors) and np.ndim(vectors) == 1 or issparse(vectors) and vectors.shape[0] == 1
        out = [[(self.token(int(j)), float(w)) for j, w in zip(ids, values)]
               for ids, values in self.weights(vectors, top_k)]
        return out[0] if single else out

    @staticmethod
    def similarity(a, b) -> np.ndarray:
        """Dot products `[len(a), len(b)]` of two sets of sparse vectors (CSR matrices or dense arrays): the
        score SPLADE is trained with (sentence-transformers' "dot")."""
        from scipy.sparse import csr_matrix, issparse

        a = csr_matrix(a if issparse(a) else np.atleast_2d(np.asarray(a, np.float32)))
        b = csr_matrix(b if issparse(b) else np.atleast_2d(np.asarray(b, np.float32)))
        if a.shape[1] != b.shape[1]:
            raise ValueError(f"Vector sizes differ: {a.shape[1]} and {b.shape[1]}")
        return np.asarray((a @ b.T).todense(), np.float32)

    def search(self, queries, corpus, top_k: int = 10, **encode_options):
        """For each query, `[(corpus index, score), ...]` best first (dot products; ties in corpus order).
        `queries` and `corpus` are texts (encoded with `encode_query` / `encode_document`) or sparse vectors."""
        from scipy.sparse import issparse

        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"`top_k` must be an int >= 1. Received: {top_k!r}")
        q = queries if issparse(queries) else self.encode_query(queries, **encode_options)
        d = corpus if issparse(corpus) else self.encode_document(corpus, **encode_options)
        out = []
        for start in range(0, q.shape[0], SEARCH_CHUNK):
            out += best_hits(self.similarity(q[start:start + SEARCH_CHUNK], d), top_k)
        return out

    @staticmethod
    def sparsity(vectors) -> dict:
        """{"active_dims": mean non-zero weights per vector, "sparsity_ratio": the share of zeros}: what an
        index of them costs (sentence-transformers' `sparsity`)."""
        from scipy.sparse import csr_matrix

        matrix = csr_matrix(vectors)
        n, width = matrix.shape
        active = matrix.getnnz() / max(n, 1)
        return {"active_dims": float(active), "sparsity_ratio": float(1.0 - active / width) if width else 1.0}

    def _check_width(self, matrix) -> None:
        if matrix.shape[1] != self.vocab_size:
            raise ValueError(f"these vectors have {matrix.shape[1]} dimensions; this model's vocabulary has "
                             f"{self.vocab_size}")


class OnnxSparseEncoder(SparseEncoder):
    """`SparseEncoder` on a `kbert.export_onnx` dir of a SPLADE model, run by ONNX Runtime (no TensorFlow, JAX or
    Keras backend needed): `encode`, `encode_query` (an inference-free model's weight table travels with the
    export), `encode_document`, `decode`, `search`, `kbert.SparseIndex` and `kbert serve` work as on the model,
    with its vectors (to 1e-5 for a float32 export). `SparseEncoder.load` returns one for such a dir."""

    def __init__(self, graph, tokenizer, info: dict, max_length: Optional[int] = None, query_weights=None):
        """graph: an onnxruntime.InferenceSession on the export's model.onnx; info: its kbert_onnx.json."""
        from kbert.models.config import ModelConfig

        if info.get("signature") != "sparse":
            raise ValueError(f"this ONNX export is a {info.get('signature')!r} graph; OnnxSparseEncoder runs the "
                             f"'sparse' exports of SPLADE models (kbert.OnnxEmbedder runs 'embed' ones)")
        super().__init__(None, tokenizer, max_length=info["max_length"] if max_length is None else max_length,
                         pooling=info["pooling"], activation=info["activation"], prompts=info.get("prompts"),
                         query_weights=query_weights, query_max_length=info.get("query_max_length"),
                         config=ModelConfig.from_dict(info["config"]))
        self.session, self.info = graph, info

    @classmethod
    def load(cls, model_dir: str, max_length: Optional[int] = None, threads: Optional[int] = None,
             **ignored) -> "OnnxSparseEncoder":
        """An OnnxSparseEncoder for an export dir. threads: ONNX Runtime's intra-op threads (default: one per
        core). `SparseEncoder.load`'s dtype and jit_compile do not apply and are ignored."""
        from kbert.text.tokenizer import Tokenizer

        info = read_info(model_dir)
        weights = os.path.join(model_dir, QUERY_WEIGHTS_FILE)
        return cls(onnx_session(os.path.join(model_dir, GRAPH_FILE), threads),
                   Tokenizer.load(os.path.join(model_dir, TOKENIZER_DIR)), info, max_length,
                   np.load(weights) if os.path.isfile(weights) else None)

    def _pooled(self, rows: List[List[int]]) -> np.ndarray:
        ids = np.full((len(rows), max(len(r) for r in rows)), self.tokenizer.pad_id, np.int64)
        mask = np.zeros_like(ids)
        for k, r in enumerate(rows):
            ids[k, :len(r)], mask[k, :len(r)] = r, 1
        return np.asarray(self.session.run([SPARSE_OUTPUT], feeds(ids, mask))[0], np.float32)


def is_sparse_model(path) -> bool:
    """Whether `path` is a SPLADE model dir `SparseEncoder.load` reads and `Embedder.load` does not: a
    sentence-transformers SparseEncoder dir, or a `kbert.export_onnx` of one. (A masked-LM dir is read as
    SPLADE only when asked.)"""
    from kbert.models.st_dir import is_sparse_dir

    return is_sparse_dir(path) or is_sparse_export(path)


def _check_dims(max_active_dims) -> None:
    if max_active_dims is not None and (not isinstance(max_active_dims, int) or max_active_dims < 1):
        raise ValueError(f"`max_active_dims` must be an int >= 1 or None. Received: {max_active_dims!r}")


def save_vectors(path: str, parts, vocab_size: int) -> str:
    """Writes CSR matrices, stacked in order, as one scipy .npz (`scipy.sparse.load_npz` reads it), whole or not
    at all (a stopped write leaves no truncated file); returns the path (.npz added when missing)."""
    from scipy.sparse import csr_matrix, save_npz, vstack

    path = path if path.endswith(".npz") else path + ".npz"
    matrix = vstack(parts, format="csr") if parts else csr_matrix((0, vocab_size), dtype=np.float32)

    def write(tmp):
        with open(tmp, "wb") as f:  # a file object: save_npz would add ".npz" to a path ending in ".tmp"
            save_npz(f, matrix)

    return write_atomic(path, write)
