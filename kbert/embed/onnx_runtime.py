"""The layout of a `kbert.export_onnx` dir and the ONNX Runtime session that runs it: what `OnnxEmbedder`
(kbert/embed/embedder.py) and the exporter (kbert/embed/onnx.py) share.

ONNX Runtime runs the graph: one small wheel with no framework under it, the runtime sentence-transformers'
`backend="onnx"` and Hugging Face Optimum use for transformer encoders on CPUs, with CUDA and other providers
picked up when installed.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np

META_FILE = "kbert_onnx.json"
GRAPH_FILE = "model.onnx"
DENSE_FILE = "dense.npz"
TOKENIZER_DIR = "tokenizer"  # kbert's own tokenizer (its config file is also named tokenizer.json)
INPUTS = ("input_ids", "attention_mask", "token_type_ids")  # transformers' names, int64 [batch, sequence]
FORMAT_VERSION = 1
SPARSE_SIGNATURE = "sparse"  # a SPLADE model's graph: one output, SPARSE_OUTPUT
SPARSE_OUTPUT = "sparse_embedding"  # float32 [batch, vocab]: the SPLADE weights, zeros included
QUERY_WEIGHTS_FILE = "query_weights.npy"  # an inference-free SPLADE model's query weights [vocab]


def onnxruntime():
    """The onnxruntime module, or an error saying how to install it."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise ImportError("ONNX exports run on ONNX Runtime: pip install onnxruntime (or kbert[onnx])") from None
    return ort


def is_onnx_dir(path: str) -> bool:
    """True for a dir `kbert.export_onnx` wrote."""
    return os.path.isfile(os.path.join(path, META_FILE)) and os.path.isfile(os.path.join(path, GRAPH_FILE))


def is_sparse_export(path) -> bool:
    """True for a dir `kbert.export_onnx` wrote from a SPLADE model (`kbert.SparseEncoder` reads it)."""
    return isinstance(path, str) and is_onnx_dir(path) and read_info(path).get("signature") == SPARSE_SIGNATURE


def read_info(path: str) -> dict:
    """The export's kbert_onnx.json, checked to be a format this kbert reads."""
    if not is_onnx_dir(path):
        raise FileNotFoundError(f"{path!r} is not a kbert ONNX export (no {GRAPH_FILE} with {META_FILE}); write one "
                                f"with kbert.export_onnx / `kbert export --format onnx`")
    with open(os.path.join(path, META_FILE), encoding="utf-8") as f:
        info = json.load(f)
    if info.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: ONNX export format {info.get('format_version')!r} is not one this kbert reads "
                         f"({FORMAT_VERSION})")
    return info


def session(path: str, threads: Optional[int] = None):
    """An InferenceSession on `path` with every graph optimization, on the providers installed (CUDA first
    when onnxruntime-gpu is); threads: intra-op threads (default: ONNX Runtime's, one per core)."""
    ort = onnxruntime()
    options = ort.SessionOptions()
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"`threads` must be a positive integer. Received: threads={threads!r}")
        options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(path, options, providers=ort.get_available_providers())


def feeds(ids, mask, segments=None) -> dict:
    """The graph's inputs for `[b, s]` ids and mask (segments: zeros unless given)."""
    ids = np.asarray(ids, np.int64)
    return {"input_ids": ids, "attention_mask": np.asarray(mask, np.int64),
            "token_type_ids": np.zeros_like(ids) if segments is None else np.asarray(segments, np.int64)}


def write_dense(path: str, dense: list) -> None:
    """An Embedder's projections (see `kbert.Embedder`'s `dense`) as one .npz."""
    arrays = {}
    for i, layer in enumerate(dense):
        arrays[f"weight_{i}"], arrays[f"bias_{i}"] = layer["weight"], layer["bias"]
        arrays[f"activation_{i}"] = np.asarray(layer["activation"])
    np.savez(path, **arrays)


def read_dense(path: str) -> list:
    """`write_dense`'s projections, [] when the file is absent."""
    if not os.path.isfile(path):
        return []
    with np.load(path) as z:
        return [{"weight": z[f"weight_{i}"], "bias": z[f"bias_{i}"], "activation": str(z[f"activation_{i}"])}
                for i in range(len(z.files) // 3)]
