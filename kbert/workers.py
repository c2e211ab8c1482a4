"""Worker processes that fail loudly instead of hanging.

`multiprocessing.Pool` replaces a worker that dies and keeps waiting for its result. The commonest way to
kill them is a script without `if __name__ == "__main__":`: processes started with "spawn" (kbert's
pretraining pipeline, konlpy's JVM taggers) re-run the script, which starts processes again, and Python
stops that worker during its start-up. The pool then restarts it forever and the caller hangs. A
`ProcessPoolExecutor` notices the dead process; `result` turns that into an error that says what to do.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import weakref
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

_STATE = {"in_worker": False}


class WorkerError(RuntimeError):
    """A worker process died (it did not raise: an exception in a task comes back as itself)."""


_FIX = ("put the script's code under `if __name__ == \"__main__\":` (worker processes are started with "
        "multiprocessing's \"spawn\", which re-runs the script in each of them), or pass workers=0 to do the work "
        "in this process")
_HINT = ("a kbert worker process died{where}. When this runs from a script, " + _FIX + ". Otherwise the worker "
         "was killed from outside (e.g. out of memory); its error, if any, is printed above.")


def in_worker() -> bool:
    """True inside a process started by `start` (such a process does not start pools of its own)."""
    return _STATE["in_worker"]


def _exit_with_parent():
    """Ends this worker when the process that started it dies. A parent killed by SIGKILL, the OOM killer
    or an unhandled SIGTERM runs no clean-up, and its idle workers would otherwise wait for tasks forever
    (each holding its memory): the task queue's pipe never reports end-of-file, because every worker
    holds a copy of its write end. multiprocessing's parent sentinel does report it."""
    import multiprocessing as mp
    import threading
    from multiprocessing.connection import wait

    parent = mp.parent_process()
    if parent is None or parent.sentinel is None:
        return

    def watch():
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="kbert-exit-with-parent", daemon=True).start()


def _init(initializer, initargs_file):
    _STATE["in_worker"] = True  # a module global: no setenv in a process that may have been forked
    _exit_with_parent()
    if initializer is not None:
        with open(initargs_file, "rb") as f:
            initializer(*pickle.load(f))


def _initargs_file(initargs) -> str:
    """`initargs` pickled into a file of their own, whose path is all a spawned process is sent.

    "spawn" writes each process's start-up data into a pipe, and the parent holds the pipe's read end too until
    that write is done. A child that dies before reading it all (an unguarded script re-run in the child stops
    it there) then leaves the parent blocked in the write for ever once the data passes the pipe's 64 KB: a
    tokenizer of a real vocabulary is several times that. A path is a few bytes, so the parent always gets
    to see the child die, and `result` reports it."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix="kbert-worker-init-", suffix=".pkl")
    with os.fdopen(fd, "wb") as f:
        pickle.dump(tuple(initargs), f, protocol=pickle.HIGHEST_PROTOCOL)
    return path


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def refuse_in_spawn_bootstrap(what: str = "kbert") -> None:
    """Raises at once when this process is a spawned worker still re-running its parent's unguarded script.

    Checked before `what` builds anything: such a run would start workers of its own and could wait on them
    forever, which leaves its parent waiting on it. Failing here ends the worker during its start-up, which
    its parent reports as a `WorkerError` with the fix (see `result`)."""
    import multiprocessing as mp

    if getattr(mp.current_process(), "_inheriting", False):
        raise RuntimeError(f"{what} was called in a worker process that is re-running this script as it starts: "
                           + _FIX + ".")


def _ready():
    return os.getpid()


def _main_not_rerun() -> None:
    """A script read from standard input (`python - < script.py`, a heredoc) has `__file__ == "<stdin>"`, which
    "spawn" would try to re-run in each worker (FileNotFoundError: the worker dies). kbert's workers run only
    kbert's own functions and need nothing of `__main__`, so such a `__main__` loses the name of a file that
    does not exist, and its workers start as those of `python -c` do. (The executor may spawn a process at
    any later submit, so this cannot be undone once the workers are up.)"""
    import sys

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or os.path.exists(path) or getattr(getattr(main, "__spec__", None), "name", None):
        return
    del main.__file__


def submit(ex: ProcessPoolExecutor, fn, *args, where: str = ""):
    """`ex.submit(fn, *args)`, with a pool broken by a dead worker reported as in `result`."""
    with _reported(where):
        return ex.submit(fn, *args)


def start(workers: int, initializer=None, initargs=(), context: str = "spawn") -> ProcessPoolExecutor:
    """`workers` processes, started now (spawning and importing take seconds: start them early).

    Each process runs `initializer(*initargs)` once. Use `result(future)` to read what they return.
    """
    import multiprocessing as mp
    import threading

    refuse_in_spawn_bootstrap("kbert.workers.start")
    if context == "spawn":
        _main_not_rerun()
    initargs_file = _initargs_file(initargs) if initializer is not None else None
    ex = ProcessPoolExecutor(workers, mp_context=mp.get_context(context), initializer=_init,
                             initargs=(initializer, initargs_file))
    if initargs_file is not None:  # removed at `stop`, or with the executor
        ex._kbert_initargs = weakref.finalize(ex, _remove, initargs_file)

    def spawn():  # an executor spawns a process per submitted task until it has `workers`
        try:
            for _ in range(workers):
                ex.submit(_ready)
        except RuntimeError:  # shut down or broken meanwhile: the caller's own submit or result reports it
            pass

    # Spawning blocks: the parent writes each process's pickled start-up data (the initializer's arguments,
    # e.g. a tokenizer: ~1 MB) into a pipe that the child reads only once its interpreter is up (~0.35 s per
    # worker). A thread does that, so the caller goes on meanwhile; `stop` waits for it.
    ex._kbert_spawner = threading.Thread(target=spawn, name="kbert-spawn-workers", daemon=True)
    ex._kbert_spawner.start()
    return ex


@contextlib.contextmanager
def _reported(where: str):
    """A dead worker (the executor's BrokenProcessPool) becomes a `WorkerError` that says what to do."""
    try:
        yield
    except BrokenProcessPool as e:
        raise WorkerError(_HINT.format(where=f" {where}" if where else "")) from e


def result(future, where: str = ""):
    """`future.result()`, with a dead worker process reported as a `WorkerError`."""
    with _reported(where):
        return future.result()


def map_list(ex: ProcessPoolExecutor, fn, items, chunksize: int = 1, where: str = "") -> list:
    """`list(ex.map(fn, items, chunksize=chunksize))`, with a dead worker reported as in `result`."""
    with _reported(where):
        return list(ex.map(fn, items, chunksize=chunksize))


def stop(ex: ProcessPoolExecutor) -> None:
    """Stops the workers now: queued tasks are dropped and running ones killed."""
    spawner = getattr(ex, "_kbert_spawner", None)
    if spawner is not None:  # every process is known before they are stopped
        spawner.join()
    # taken before `shutdown`, which drops the executor's reference to them (`_processes = None`): read after
    # it, none were stopped, running tasks went on, and workers still starting read the removed start-up file
    processes = list((getattr(ex, "_processes", None) or {}).values())  # no public way before Python 3.14
    ex.shutdown(wait=False, cancel_futures=True)
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=5)
    initargs = getattr(ex, "_kbert_initargs", None)
    if initargs is not None:  # no process starts after shutdown, and those started are stopped
        initargs()
