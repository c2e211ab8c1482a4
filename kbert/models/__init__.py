"""BERT and ALBERT in backend-agnostic Keras 3 (`keras.ops` only; no TensorFlow imports here)."""

from kbert.models.backbone import AlbertBackbone, BertBackbone, Pretrainer, build_backbone
from kbert.models.config import ModelConfig
from kbert.models.electra import ElectraPretrainer

__all__ = ["AlbertBackbone", "BertBackbone", "ElectraPretrainer", "ModelConfig", "Pretrainer", "build_backbone"]
