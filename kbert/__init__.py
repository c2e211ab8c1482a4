"""kbert: Korean BERT/ALBERT pretraining and embedding SDK (TensorFlow 2 + Keras 3).

The public names are imported lazily, so `import kbert` and the `kbert` command start fast and
TensorFlow is loaded only when a model, tokenizer or dataset is first used.
"""

import importlib
import importlib.util
import os
import sys

# TensorFlow's C++ start-up chatter (CUDA probing on CPU machines) is noise for kbert users.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _default_backend() -> None:
    """An install without TensorFlow (`pip install "kbert[jax]"`) runs Keras on JAX unless told otherwise;
    Keras' own default is TensorFlow, which would fail to import there."""
    if os.environ.get("KERAS_BACKEND") or importlib.util.find_spec("tensorflow") is not None:  # set and not empty
        return
    if importlib.util.find_spec("jax") is not None:
        os.environ["KERAS_BACKEND"] = "jax"


class _TritonBeforeTensorFlow:
    """Imports Triton just before TensorFlow (an import-system finder that steps aside at once), so a later
    `import triton` cannot crash the interpreter.

    TensorFlow 2.20 and 2.21 wheels ship `tensorflow/python/pywrap_dlopen_global_flags.py`, so TensorFlow loads
    its core library RTLD_GLOBAL: its statically linked LLVM goes into the process-wide symbol table, and Triton
    3.7 (installed with every CUDA build of torch, imported by transformers, sentence-transformers and
    `torch.compile`), loaded after it, binds its own LLVM calls to that copy and dies with a segmentation fault
    (tensorflow/tensorflow#124205). Loading TensorFlow RTLD_LOCAL instead, as TensorFlow's fix does, breaks
    tensorflow-text's ops in these wheels (FastBertNormalizer aborts on "key not found: get_offsets"), so the
    order is what changes: loaded first, Triton binds to its own LLVM (Python loads extensions RTLD_NOW), and
    TensorFlow's global copy comes after. Installed only on Linux, where Triton is installed, TensorFlow is not
    imported yet and its wheel loads RTLD_GLOBAL; nothing is imported unless TensorFlow is.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "tensorflow":
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            try:
                importlib.import_module("triton")
            except Exception:  # a broken Triton install is the user's torch's business, not TensorFlow's
                pass
        return None  # the usual finders import TensorFlow

    @staticmethod
    def install() -> None:
        if not sys.platform.startswith("linux") or "tensorflow" in sys.modules or "triton" in sys.modules:
            return
        try:
            tensorflow, triton = importlib.util.find_spec("tensorflow"), importlib.util.find_spec("triton")
        except (ImportError, ValueError):
            return
        if tensorflow is None or triton is None or not tensorflow.submodule_search_locations:
            return
        root = list(tensorflow.submodule_search_locations)[0]
        if os.path.exists(os.path.join(root, "python", "pywrap_dlopen_global_flags.py")):
            sys.meta_path.insert(0, _TritonBeforeTensorFlow())


_default_backend()
_TritonBeforeTensorFlow.install()

__version__ = "0.1.0"

_EXPORTS = {
    "ModelConfig": "kbert.models.config",
    "BertBackbone": "kbert.models.backbone",
    "AlbertBackbone": "kbert.models.backbone",
    "Pretrainer": "kbert.models.backbone",
    "ElectraPretrainer": "kbert.models.electra",
    "build_backbone": "kbert.models.backbone",
    "save_model": "kbert.models.io",
    "load_model": "kbert.models.convert",
    "export_transformers": "kbert.models.convert",
    "Tokenizer": "kbert.text.tokenizer",
    "normalize": "kbert.text.normalize",
    "morphemes": "kbert.text.morphemes",
    "corpus": "kbert.data.corpus",
    "Corpus": "kbert.data.corpus",
    "pretraining_dataset": "kbert.data.pretraining",
    "nli_triplets": "kbert.data.recipes",
    "selection_split": "kbert.data.rows",
    "pretrain": "kbert.train.loop",
    "read_scalars": "kbert.train.metrics",
    "PretrainConfig": "kbert.train.config",
    "plan_batch_size": "kbert.train.memory",
    "Embedder": "kbert.embed.embedder",
    "StaticEmbedder": "kbert.embed.embedder",
    "EnsembleEmbedder": "kbert.embed.embedder",
    "distill_static": "kbert.embed.static",
    "export_sentence_transformers": "kbert.embed.st_format",
    "mine_hard_negatives": "kbert.embed.mining",
    "candidate_pairs": "kbert.embed.augment",
    "label_pairs": "kbert.embed.augment",
    "paraphrase_mining": "kbert.embed.mining",
    "community_detection": "kbert.embed.mining",
    "keywords": "kbert.embed.keywords",
    "keyphrase_candidates": "kbert.embed.keywords",
    "quantize_embeddings": "kbert.embed.quantize",
    "quantization_ranges": "kbert.embed.quantize",
    "quantized_search": "kbert.embed.quantize",
    "SearchIndex": "kbert.embed.index",
    "SparseIndex": "kbert.embed.sparse_index",
    "hybrid_search": "kbert.embed.hybrid",
    "split_passages": "kbert.embed.passages",
    "split_documents": "kbert.embed.passages",
    "evaluate_retrieval": "kbert.embed.evaluation",
    "evaluate_sts": "kbert.embed.evaluation",
    "evaluate_pair_classification": "kbert.embed.evaluation",
    "finetune": "kbert.train.finetune",
    "distill": "kbert.train.distill",
    "TaskModel": "kbert.embed.task_model",
    "predict_rows": "kbert.embed.prediction",
    "MaskedLM": "kbert.embed.masked_lm",
    "SparseEncoder": "kbert.embed.sparse",
    "OnnxSparseEncoder": "kbert.embed.sparse",
    "export": "kbert.embed.export",
    "export_onnx": "kbert.embed.onnx",
    "OnnxEmbedder": "kbert.embed.embedder",
    "OnnxTaskModel": "kbert.embed.onnx_task",
    "serve": "kbert.server",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    if name == "data":  # the subpackage: kbert.data.pretraining_dataset(...)
        return importlib.import_module("kbert.data")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kbert' has no attribute {name!r}")


def __dir__():
    return __all__
