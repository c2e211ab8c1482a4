"""kbert: Korean BERT/ALBERT pretraining and embedding SDK (TensorFlow 2 + Keras 3).

The public names are imported lazily, so `import kbert` and the `kbert` command start fast and
TensorFlow is loaded only when a model, tokenizer or dataset is first used.
"""

import importlib
import os

# TensorFlow's C++ start-up chatter (CUDA probing on CPU machines) is noise for kbert users.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _default_backend() -> None:
    """An install without TensorFlow (`pip install "kbert[jax]"`) runs Keras on JAX unless told otherwise;
    Keras' own default is TensorFlow, which would fail to import there."""
    import importlib.util

    if os.environ.get("KERAS_BACKEND") or importlib.util.find_spec("tensorflow") is not None:  # set and not empty
        return
    if importlib.util.find_spec("jax") is not None:
        os.environ["KERAS_BACKEND"] = "jax"


_default_backend()

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
