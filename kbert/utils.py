"""Small shared helpers: compressed text files, progress bars, pausing the cycle collector, atomic writes, output
dir locks, rank correlations."""

from __future__ import annotations

import bz2
import contextlib
import gc
import gzip
import io
import os
import signal
import sys
import threading


def open_binary(path: str):
    """Opens a file for reading bytes, transparently decompressing .gz / .bz2."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"File not found: {path!r}")
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".bz2"):
        return bz2.open(path, "rb")
    return open(path, "rb")


def undecodable_hint(raw: bytes) -> str:
    """What a line that is not UTF-8 probably is, and what to do: Korean legacy text (CP949 / EUC-KR, what
    Korean Excel and Windows tools write) or binary data."""
    controls = sum(1 for b in raw if b < 9 or 13 < b < 32)
    try:
        text = raw.decode("cp949")
    except UnicodeDecodeError:
        text = None
    if text is None or b"\x00" in raw or controls > max(2, len(raw) // 10):
        return "it is not text in any Korean encoding kbert knows (binary data?): give a UTF-8 text file"
    if any("\uac00" <= c <= "\ud7a3" for c in text):
        return "it reads as Korean in CP949/EUC-KR: convert the file first, e.g. `iconv -f cp949 -t utf-8 IN > OUT`"
    return "convert the file to UTF-8 first (e.g. `iconv -f ENCODING -t utf-8 IN > OUT`)"


def uncompressed_name(path: str) -> str:
    """The file's name in lower case without a .gz / .bz2 suffix (what its format is read from)."""
    name = path.lower()
    for suffix in (".gz", ".bz2"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


def read_utf8_text(path: str) -> str:
    """A whole file's text (.gz / .bz2 too), strictly UTF-8; a byte-order mark, as Excel's "CSV UTF-8" writes,
    is dropped. For files a user prepared (labelled rows, candidate texts), where a CP949 file (what Korean
    Excel saves by default) read with replacement characters would be used as U+FFFD silently: a line that is
    not UTF-8 is an error naming the line and the fix. (Corpora are read with `open_text`, which keeps going.)"""
    with open_binary(path) as f:
        raw = f.read()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        start = raw.rfind(b"\n", 0, e.start) + 1
        end = raw.find(b"\n", e.start)
        raise ValueError(f"{path}: line {line} is not UTF-8 text; "
                         f"{undecodable_hint(raw[start:end if end >= 0 else len(raw)])}") from None


def open_text(path: str):
    """Opens a text file for reading, transparently decompressing .gz / .bz2. Invalid UTF-8 bytes become
    U+FFFD instead of stopping the read (web corpora have them)."""
    return io.TextIOWrapper(open_binary(path), encoding="utf-8", errors="replace", newline=None)


@contextlib.contextmanager
def no_gc():
    """Pauses Python's cycle collector while building many small acyclic objects (tuples of strings and
    ints): every collection walks all live containers, so building n of them pays for O(n) walks over a
    growing heap."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _NoBar:
    total = None

    def update(self, n=1):
        pass

    def set_postfix(self, *a, **k):
        pass

    def refresh(self):
        pass

    def close(self):
        pass


def progress_bar(total=None, desc="", unit="it", enabled=True, initial=0):
    """A tqdm bar on stderr, or a no-op when disabled (or when tqdm is missing). `initial`: the work a resumed
    job had done before (shown as done, but not counted in the rate, which an update() would make absurd).
    `unit`: singular for a bar with a total ("text": 2/5 [..., 3.1text/s], and 2.3s/text when slow); plural
    after a space for a count without one (" lines": "2 lines"), which tqdm prints right after the number."""
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, mininterval=0.5,
                initial=initial)


class StopSignals:
    """While open, SIGINT / SIGTERM end a training loop's current step instead of the process: `received`
    names the signal, and the loop saves and returns; the previous handlers come back on exit. Outside the
    main thread (where Python delivers no signals) it installs nothing and `received` stays None."""

    def __enter__(self):
        self.received = None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self.previous[s] = signal.signal(s, self._on_signal)
        return self

    def _on_signal(self, signum, frame):
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        return False


def write_atomic(path: str, write) -> str:
    """`write(tmp_path)`, then the file renamed over `path`: a reader, or a job resumed after a crash, never
    sees half a file. When `write` fails (a full disk, Ctrl-C) its partial file is removed rather than left to
    fill the disk (a BERT-Base checkpoint's is over a gigabyte). Returns `path`."""
    tmp = path + ".tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return path


class Deferred:
    """A tensor `save_safetensors` reads only when it writes it: `fetch()` returns the array (of `shape` and
    `dtype`), so a checkpoint copies one variable at a time off the device instead of all of them at once."""

    __slots__ = ("shape", "dtype", "fetch")

    def __init__(self, shape, dtype, fetch):
        import importlib

        import numpy as np

        if str(dtype) == "bfloat16":  # numpy knows the name once ml_dtypes (Keras' bfloat16) is imported
            importlib.import_module("ml_dtypes")
        self.shape, self.dtype, self.fetch = tuple(int(n) for n in shape), np.dtype(str(dtype)), fetch


_SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                       "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32",
                       "uint16": "U16", "uint8": "U8", "bool": "BOOL"}


def save_safetensors(tensors: dict, path: str, metadata: dict = None) -> str:
    """Writes `tensors` (name -> numpy array or `Deferred`) as a safetensors file through `write_atomic`.

    Written here, one tensor at a time, rather than by safetensors' `save_file`, which takes every array at
    once: a training checkpoint's weights and optimizer slots copied off the device together held the whole
    state a second time in host memory, at the moment a run must not fail (benchmarks/README.md). The format
    is safetensors' own (an 8-byte little-endian header size, a JSON header of dtypes, shapes and contiguous
    byte ranges, padded to 8 bytes with spaces, then the raw little-endian data), and every reader here and in
    transformers is safetensors' (`safe_open`), which checks it. Disk errors come back as OSError naming the
    file; the file gets the umask's mode."""
    import json
    import struct

    import numpy as np

    specs, offset = {}, 0
    for name, value in tensors.items():
        shape, dtype = value.shape, value.dtype
        kind = _SAFETENSORS_DTYPES.get(np.dtype(dtype).name)
        if kind is None:
            raise TypeError(f"safetensors has no dtype for {name!r}: {np.dtype(dtype).name}")
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        specs[name] = {"dtype": kind, "shape": [int(n) for n in shape], "data_offsets": [offset, offset + size]}
        offset += size
    header = {**({"__metadata__": {str(k): str(v) for k, v in metadata.items()}} if metadata else {}), **specs}
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    head += b" " * (-len(head) % 8)

    def write(tmp):
        try:
            with open(tmp, "wb") as f:
                f.write(struct.pack("<Q", len(head)) + head)
                for name, value in tensors.items():
                    array = value.fetch() if isinstance(value, Deferred) else value
                    array = np.asarray(array, dtype=np.dtype(value.dtype).newbyteorder("<"))
                    if not array.flags.c_contiguous:  # (np.ascontiguousarray would make a scalar [1])
                        array = np.array(array, order="C")
                    if list(array.shape) != specs[name]["shape"]:
                        raise ValueError(f"{name!r} is {list(array.shape)}, not the {specs[name]['shape']} its "
                                         f"header says")
                    f.write(array.reshape(-1).view(np.uint8).data)  # bytes of bfloat16 and bool alike
                    del array
        except OSError as e:
            raise OSError(f"could not write {path}: {e}") from e

    return write_atomic(path, write)


class DirectoryInUse(OSError):
    """Another process is writing to the output dir a job was given (see `writing_to`)."""


LOCK_FILE = ".kbert-writer.lock"
OWNER_FILE = ".kbert-writer.json"  # who holds the lock: a lock file's own bytes are truncated by a contender's open
_held: dict = {}  # realpath -> [release, depth]: a job that runs another on its own dir (distill -> finetune) holds one
_held_guard = threading.Lock()


@contextlib.contextmanager
def writing_to(directory: str, job: str):
    """Holds an exclusive lock on `directory` (created if missing) while `job` ("kbert pretrain", ...) writes
    there. A second kbert job given the same dir fails at once with `DirectoryInUse` naming the first, instead
    of both resuming from one checkpoint and overwriting, or deleting, each other's files. Nested holds in one
    process (distillation runs a fine-tune on its own dir) share the lock.

    The lock is filelock's (py-filelock, installed with huggingface_hub): one API over flock on POSIX and
    LockFileEx on Windows, with a fallback where a filesystem has no flock. The operating system drops the lock
    when its process dies, so a killed job leaves nothing that blocks its resumption. The lock and owner files
    are removed on release, and a dir this call created is removed again when nothing was written to it."""
    import json
    import socket
    import time

    import filelock

    check_local_path(directory, "output dir")
    created = not os.path.isdir(directory)
    os.makedirs(directory, exist_ok=True)
    key = os.path.realpath(directory)
    with _held_guard:
        entry = _held.get(key)
        if entry is not None:
            entry[1] += 1
    if entry is None:
        lock = filelock.FileLock(os.path.join(directory, LOCK_FILE), timeout=0)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise DirectoryInUse(f"{directory!r} is in use: {_lock_owner(directory)} is writing to it; wait for it "
                                 f"to end (or stop it), or choose another output dir") from None
        except NotImplementedError:  # older filelock on a filesystem without flock: the job runs, unguarded
            lock = None
        owner = dict(job=job, pid=os.getpid(), host=socket.gethostname(),
                     started=time.strftime("%Y-%m-%d %H:%M:%S"))
        with contextlib.suppress(OSError):
            with open(os.path.join(directory, OWNER_FILE), "w", encoding="utf-8") as f:
                json.dump(owner, f)
        entry = [lock.release if lock is not None else (lambda: None), 1]
        with _held_guard:
            _held[key] = entry
    try:
        yield directory
    finally:
        with _held_guard:
            entry[1] -= 1
            last = entry[1] == 0
            if last:
                del _held[key]
        if last:
            for name in (OWNER_FILE, LOCK_FILE):  # while still held: a contender meets the lock, not a gap
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(directory, name))
            entry[0]()
            if created:
                with contextlib.suppress(OSError):
                    os.rmdir(directory)  # only when empty: a job that failed before writing leaves no dir behind


def check_local_path(path: str, what: str) -> str:
    """`path`, unless it is a URL (gs://, s3://, hdfs://, ...), which kbert's file operations would read as a
    relative local path: an output dir "gs://bucket/run" became the local dir ./gs:/bucket/run, its checkpoints
    lost with the machine. A ValueError names the way that works: mounting the bucket as a local path."""
    import re

    if not os.fspath(path):  # os.makedirs("") said only "No such file or directory: ''"
        raise ValueError(f"{what} is an empty path")
    found = re.match(r"([A-Za-z][A-Za-z0-9+.-]+)://", os.fspath(path))  # two letters at least: not C:/
    if found:
        raise ValueError(f"{what} {path!r} is a URL; kbert reads and writes local paths: mount the bucket as a "
                         f"local dir (Cloud Storage FUSE on a Cloud TPU VM: `gcsfuse --implicit-dirs BUCKET "
                         f"/mnt/BUCKET`; s3fs, blobfuse2 elsewhere) and give the path under it")
    return path


def _lock_owner(directory: str) -> str:
    """Who holds `directory`'s lock, as its owner file says ("kbert pretrain (pid 4242 on host, since ...)")."""
    import json

    try:
        with open(os.path.join(directory, OWNER_FILE), encoding="utf-8") as f:
            o = json.load(f)
        return f"{o['job']} (pid {o['pid']} on {o['host']}, since {o['started']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def renamed_keyword(old: str, old_value, new: str, new_value, default):
    """The value of a keyword argument renamed from `old` to `new` (kept for one release): `old_value` with a
    DeprecationWarning when the old name was passed (None: it was not), else `new_value`; both is an error."""
    if old_value is None:
        return new_value
    import warnings

    if new_value != default:
        raise TypeError(f"`{old}` is the old name of `{new}`: pass only `{new}`")
    warnings.warn(f"`{old}` is deprecated and will be removed in the next release: use `{new}`",
                  DeprecationWarning, stacklevel=3)
    return old_value


def in_background(items, depth: int = 2):
    """Iterates `items` in a daemon thread, up to `depth` ahead of the consumer; an error raised there is
    raised here, at the item where it happened. (Input pipelines: the next batch is prepared while the
    current step runs.)"""
    import queue
    import threading

    done = object()
    buffer: "queue.Queue" = queue.Queue(maxsize=max(1, depth))

    def produce():
        try:
            for item in items:
                buffer.put(item)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            buffer.put(e)
        buffer.put(done)

    threading.Thread(target=produce, daemon=True, name="kbert-background").start()
    while True:
        item = buffer.get()
        if item is done:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


# Correlations of scores and pair classification figures (fine-tuning's dev metrics in kbert.train.metrics,
# sentence-vector figures in kbert.embed.evaluation): written out, as scikit-learn and scipy are not
# dependencies of kbert.
def softmax(x, axis: int = -1):
    """exp(x) normalized along `axis`, in x's dtype, shifted by its maximum so nothing overflows."""
    import numpy as np

    z = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return z / np.sum(z, axis=axis, keepdims=True)


def unit_rows(x):
    """x as C-contiguous float32 with each vector (the last axis) scaled to unit length, so dot products are
    cosines; a zero vector stays zero. C order because FAISS reads the buffer as it lies."""
    import numpy as np

    x = np.asarray(x, np.float32)
    return np.ascontiguousarray(x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12))


def rank(x):
    """Ranks from 1 (a float array) with ties sharing their average rank (as scipy.stats.rankdata)."""
    import numpy as np  # here: this module is imported by the command line's start-up, which numpy would slow

    _, inverse, counts = np.unique(np.asarray(x), return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return (ends - (counts - 1) / 2.0)[inverse]


def positive_int(value, name: str) -> int:
    """`value` as an int when it is a whole number >= 1 (numpy's integers too), else a ValueError naming
    `name`: a size, count or batch that 0 or a negative would turn into a hang, an empty result or a numpy
    error that says nothing of the argument."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return int(value)


def check_seed(value, name: str = "seed") -> int:
    """`value` when it is a seed numpy takes (an integer in [0, 2**32)), else a ValueError naming `name`: numpy's
    own "Seed must be between 0 and 2**32 - 1" names no setting, and comes only once a model is loaded."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < 2 ** 32:
        raise ValueError(f"`{name}` must be an integer in [0, 2**32). Received: {name}={value!r}")
    return int(value)


def pearson(a, b) -> float:
    """Pearson's r; 0.0 when either side is constant or has fewer than 2 values; NaN when either holds a NaN or
    an infinity (a diverged model's scores: no correlation is defined, and none is made up)."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("nan")
    if len(a) < 2 or a.std() == 0 or b.std() == 0:
        return 0.0
    return float(np.corrcoef(a, b)[0, 1])


def spearman(a, b) -> float:
    """Spearman's rho: Pearson's r of the ranks; NaN when either side holds a NaN or an infinity (their ranks
    would be finite, and the figure wrong)."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("nan")
    return pearson(rank(a), rank(b))


def accuracy(y, p) -> float:
    import numpy as np

    return float(np.mean(np.asarray(y) == np.asarray(p))) if len(y) else 0.0


def macro_f1(y, p, num_classes: int) -> float:
    """The mean F1 over the classes (indices below `num_classes`) that occur in `y` or `p`."""
    import numpy as np

    y, p = np.asarray(y), np.asarray(p)
    scores = []
    for c in range(num_classes):
        tp = np.sum((p == c) & (y == c))
        denom = np.sum(p == c) + np.sum(y == c)
        if denom:
            scores.append(2 * tp / denom)
    return float(np.mean(scores)) if scores else 0.0


def per_label_figures(gold, predicted, labels) -> dict:
    """{label: {"precision", "recall", "f1", "support"}} of `[n, k]` 0/1 decisions (a class index per row turns
    into its one-hot row first), as scikit-learn's classification_report gives them (0 where undefined)."""
    import numpy as np

    y, p = np.asarray(gold), np.asarray(predicted)
    if y.ndim == 1:
        y, p = (np.eye(len(labels), dtype=bool)[np.asarray(v, np.int64)] for v in (y, p))
    y, p = y.astype(bool), p.astype(bool)
    tp, found, wanted = (y & p).sum(axis=0), p.sum(axis=0), y.sum(axis=0)
    out = {}
    for j, label in enumerate(labels):
        precision = tp[j] / found[j] if found[j] else 0.0
        recall = tp[j] / wanted[j] if wanted[j] else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        out[str(label)] = {"precision": float(precision), "recall": float(recall), "f1": float(f1),
                           "support": int(wanted[j])}
    return out


def multi_label_figures(gold, predicted) -> dict:
    """Figures of multi-label decisions, `gold` and `predicted` `[n, k]` 0/1 (a row may hold any number of labels):
    micro-F1 (over every (row, label) decision), macro-F1 (the mean over the labels present in either) and
    subset accuracy (rows whose labels are all right), as scikit-learn's f1_score and accuracy_score give them."""
    import numpy as np

    y, p = np.asarray(gold).astype(bool), np.asarray(predicted).astype(bool)
    tp, fp, fn = (y & p).sum(axis=0), (~y & p).sum(axis=0), (y & ~p).sum(axis=0)
    micro = 2 * tp.sum() / max(2 * tp.sum() + fp.sum() + fn.sum(), 1)
    present = (tp + fp + fn) > 0
    macro = float(np.mean(2 * tp[present] / (2 * tp[present] + fp[present] + fn[present]))) if present.any() else 0.0
    return {"micro_f1": float(micro), "macro_f1": macro, "subset_accuracy": float(np.mean((y == p).all(axis=1)))}


def entity_scores(gold, predicted) -> dict:
    """Entity-level precision, recall and F1 of `predicted` against `gold`, each a sequence (one item a text) of
    sets of entities (any hashable: (start, end, type) spans): an entity counts when it is in both, span and type
    exact (CoNLL's and seqeval's scoring)."""
    hits = found = wanted = 0
    for g, p in zip(gold, predicted):
        hits += len(set(g) & set(p))
        found += len(set(p))
        wanted += len(set(g))
    precision = hits / found if found else 0.0
    recall = hits / wanted if wanted else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"entity_precision": precision, "entity_recall": recall, "entity_f1": f1}


def pair_classification_figures(scores, labels) -> dict:
    """Accuracy, F1, precision, recall, AP and MCC of classifying pairs by `scores` (higher: label 1; `labels`
    1 / 0, both present), at the thresholds sentence-transformers' BinaryClassificationEvaluator picks: each
    candidate threshold is the midpoint between two neighbouring distinct scores (a pair is 1 when its score
    is at least it); before any pair, one just above the highest score (every pair 0). AP is scikit-learn's
    average precision (each cut's precision weighted by the recall it adds)."""
    import numpy as np

    scores, labels = np.asarray(scores, np.float32), np.asarray(labels, np.int64)
    order = np.argsort(-scores, kind="stable")
    ranked, gold = scores[order], labels[order]
    n, positives = len(gold), int(gold.sum())
    # the candidate cuts: after the last pair of each group of equal scores
    ends = np.nonzero(np.append(ranked[1:] != ranked[:-1], True))[0]
    taken = ends + 1
    true_pos = np.cumsum(gold)[ends]
    true_neg = (n - positives) - (taken - true_pos)
    below = np.append(ranked[ends[:-1] + 1], ranked[-1])  # the next group's score (the last: its own)
    midpoint = ((ranked[ends] + below) / np.float32(2)).astype(np.float32)
    # a rounded midpoint must not reach the next group's score
    midpoint = np.where(midpoint == below, ranked[ends], midpoint)  # (the last cut: its own score either way)

    accuracy = (true_pos + true_neg) / n
    best_accuracy, accuracy_threshold = (n - positives) / n, float(np.nextafter(ranked[0], np.float32(np.inf)))
    if accuracy.max() > best_accuracy:  # the first of the best, as a strict `>` scan finds it
        i = int(np.argmax(accuracy))
        best_accuracy, accuracy_threshold = float(accuracy[i]), float(midpoint[i])

    precision = true_pos / taken
    recall = true_pos / positives
    with np.errstate(invalid="ignore", divide="ignore"):
        f1 = np.where(true_pos > 0, 2 * precision * recall / (precision + recall), 0.0)
    i = int(np.argmax(f1))
    f1_threshold = float(midpoint[i])

    # average precision: each cut's precision weighted by the recall it adds (scikit-learn's definition)
    ap = float(np.sum(np.diff(np.concatenate([[0.0], recall])) * precision))

    predicted = scores >= np.float32(f1_threshold)
    tp = float(np.sum(predicted & (labels == 1)))
    fp = float(np.sum(predicted & (labels == 0)))
    fn = float(np.sum(~predicted & (labels == 1)))
    tn = float(n - tp - fp - fn)
    denominator = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    mcc = float((tp * tn - fp * fn) / denominator) if denominator > 0 else 0.0
    return {"accuracy": float(best_accuracy), "accuracy_threshold": accuracy_threshold, "f1": float(f1[i]),
            "f1_threshold": f1_threshold, "precision": float(precision[i]), "recall": float(recall[i]),
            "ap": ap, "mcc": mcc}
