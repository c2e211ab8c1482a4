"""Korean text: normalization, morpheme analyzers, subword tokenizers (tensorflow-text lives here)."""

from kbert.text.morphemes import Morpheme, morphemes
from kbert.text.normalize import normalize, tf_normalize
from kbert.text.tokenizer import Encoding, Tokenizer

__all__ = ["Encoding", "Morpheme", "Tokenizer", "morphemes", "normalize", "tf_normalize"]
