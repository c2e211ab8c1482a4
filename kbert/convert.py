"""The old home of `kbert.models.convert` (checkpoint conversion), kept so `from kbert.convert import ...` still
works; new code imports `kbert.models.convert`."""

from kbert.models.convert import *  # noqa: F401,F403
