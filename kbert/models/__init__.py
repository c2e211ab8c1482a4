"""BERT and ALBERT in backend-agnostic Keras 3 (`keras.ops` only; no TensorFlow imports here).

The names below load on first use, so that `kbert.models.config` and the other Keras-free modules (what the
ONNX runners read) import on a host where Keras has no backend installed."""

import importlib

_EXPORTS = {"AlbertBackbone": "kbert.models.backbone", "BertBackbone": "kbert.models.backbone",
            "Pretrainer": "kbert.models.backbone", "build_backbone": "kbert.models.backbone",
            "ElectraPretrainer": "kbert.models.electra", "ModelConfig": "kbert.models.config"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kbert.models' has no attribute {name!r}")
