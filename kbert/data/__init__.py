"""Corpora and the pretraining input pipeline: `kbert.data.pretraining_dataset(...)`, `kbert.data.prepare(...)`."""

from kbert.data.corpus import Corpus, CorpusReport, corpus  # noqa: F401
from kbert.data.pretraining import pretraining_dataset  # noqa: F401
from kbert.data.records import prepare  # noqa: F401
