"""A benchmark's scratch dir (models, indexes, records, checkpoints written to be timed), removed when the
script exits, a failed or interrupted run included. Some of them are hundreds of MB (a pretraining run's
checkpoints), and a benchmark is run many times: left behind, they filled the temp dir."""

from __future__ import annotations

import atexit
import shutil
import tempfile


def scratch_dir(prefix: str = "kbert-bench-", dir: "str | None" = None) -> str:
    """`tempfile.mkdtemp(prefix=..., dir=...)` that `atexit` removes: at a normal exit, an uncaught error and
    Ctrl-C (not a SIGKILL). Forked workers (multiprocessing) leave through `os._exit`, so only the script that
    made it removes it."""
    path = tempfile.mkdtemp(prefix=prefix, dir=dir)
    atexit.register(shutil.rmtree, path, True)
    return path
