"""Korean corpora as documents of sentences: readers, sentence splitting, cleaning and named recipes.

`kbert.corpus(source)` accepts a file, a directory, a glob pattern, a named recipe (`kolaw`, `kobill`,
`movie-reviews`, `korsts`, `kornli`, `wikipedia-ko`) or a list of them, and yields documents (lists of
sentences). Formats are detected from the file name (compression suffixes `.gz` / `.bz2` first):

- plain text (`.txt`, anything unknown): one sentence or paragraph per line, a blank line between documents;
- JSONL (`.jsonl`, `.json` with one object per line): the `text_field` of each object is a document;
- TSV (`.tsv`): the `column` (name or 0-based index) of each row; rows that share `group_by` and are
  adjacent form one document;
- a Wikipedia XML dump (`*.xml`, `*-pages-articles*.xml.bz2`): each article in the main namespace is a
  document, markup stripped, redirects skipped.

Cleaning happens in two stages so that the expensive part runs on all cores in the pretraining pipeline:
`raw_documents()` (reading, binary-junk detection, exact-duplicate removal by hash) and `clean(raw)`
(normalization, sentence splitting, length filters). Iterating a `Corpus` does both; `corpus.report`
counts what was read and what was dropped, and why.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
from typing import Callable, Iterator, List, Optional, Sequence, Union

from kbert.text.normalize import normalize as _normalize
from kbert.utils import open_text

SPLITTERS = ("rules", "kiwi", "lines")
DEDUPE = ("document", "sentence", None)


# --------------------------------------------------------------------------- sentence splitting
# A sentence ends at ! ? or a run of them, at an ellipsis after a sentence-final ending, or at a period
# that follows Hangul, a closing bracket, or a Latin word of 2+ letters (not "U.S." or "2015. 3. 1.");
# closing quotes and brackets right after the punctuation stay with the sentence.
_CLOSERS = "\"'”’」』》〉)\\]"
_END_RE = re.compile(r"([.!?…]+)([" + _CLOSERS + r"]*)(?=\s|$)")
_FINAL_ENDINGS = set("다요죠네까군함음임냐")


def split_sentences_rules(text: str) -> List[str]:
    """A fast rule-based Korean sentence splitter (no dependencies).

    Example:
        >>> split_sentences_rules('정말 좋아요. "그래서 또 봤다." 다음에도 볼 거예요... 강추!')
        ['정말 좋아요.', '"그래서 또 봤다."', '다음에도 볼 거예요...', '강추!']
    """
    out, start = [], 0
    for m in _END_RE.finditer(text):
        punct = m.group(1)
        prev = text[m.start() - 1] if m.start() > 0 else ""
        if set(punct) <= {"."}:
            if len(punct) >= 2:  # ellipsis written with periods
                if prev not in _FINAL_ENDINGS:
                    continue
            elif not _period_ends(text, m.start()):
                continue
        elif punct == "…" and prev not in _FINAL_ENDINGS:
            continue
        sentence = text[start:m.end()].strip()
        if sentence:
            out.append(sentence)
        start = m.end()
    rest = text[start:].strip()
    if rest:
        out.append(rest)
    return out


def _period_ends(text: str, i: int) -> bool:
    j = i
    while j > 0 and not text[j - 1].isspace():
        j -= 1
    word = text[j:i]
    if not word:
        return False
    last = word[-1]
    if "\uac00" <= last <= "\ud7a3" or last in _CLOSERS or last in "%":
        return True
    if last.isdigit():  # "2015. 3. 1." and list numbers
        return False
    letters = re.sub(r"[^A-Za-z]", "", word)
    return len(letters) >= 2 and "." not in word  # "U.S." and single initials do not end a sentence


_KIWI = None


def split_sentences_kiwi(text: str) -> List[str]:
    """Sentence splitting with kiwipiepy's `split_into_sents` (pip install kiwipiepy)."""
    global _KIWI
    if _KIWI is None:
        try:
            from kiwipiepy import Kiwi
        except ImportError as e:
            raise ImportError("splitter='kiwi' needs kiwipiepy: pip install kiwipiepy") from e
        _KIWI = Kiwi()
    return [s.text.strip() for s in _KIWI.split_into_sents(text) if s.text.strip()]


def _get_splitter(splitter) -> Callable[[str], List[str]]:
    if callable(splitter):
        return splitter
    if splitter == "rules":
        return split_sentences_rules
    if splitter == "kiwi":
        return split_sentences_kiwi
    if splitter in ("lines", None):
        return lambda text: [text]
    raise ValueError(f"`splitter` must be one of {SPLITTERS} or a callable. Received: splitter={splitter!r}")


# --------------------------------------------------------------------------- Wikipedia markup
_WIKI_DROP = [
    re.compile(r"<!--.*?-->", re.S),
    re.compile(r"<ref[^>/]*/>", re.S),
    re.compile(r"<ref[^>]*>.*?</ref>", re.S),
    re.compile(r"<(math|gallery|timeline|score|syntaxhighlight|source)[^>]*>.*?</\1>", re.S | re.I),
    re.compile(r"\{\|.*?\|\}", re.S),  # tables
]
_WIKI_FILE_LINK = re.compile(r"\[\[(?:File|Image|파일|그림|분류|Category):[^\[\]]*(?:\[\[[^\[\]]*\]\][^\[\]]*)*\]\]",
                             re.I)
_WIKI_LINK = re.compile(r"\[\[(?:[^\[\]|]*\|)?([^\[\]]*)\]\]")
_WIKI_EXT_LINK = re.compile(r"\[(?:https?:)?//[^\s\]]+\s?([^\]]*)\]")
_WIKI_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_WIKI_TAG = re.compile(r"</?[A-Za-z][^>]*>")
_WIKI_HEADING = re.compile(r"^=+\s*(.*?)\s*=+\s*$", re.M)
_WIKI_QUOTES = re.compile(r"'{2,}")


def strip_wiki_markup(text: str) -> List[str]:
    """MediaWiki source -> paragraphs of plain text (templates, tables, references, files, categories,
    headings and list markers removed; link labels kept)."""
    for pattern in _WIKI_DROP:
        text = pattern.sub(" ", text)
    for _ in range(5):  # nested templates, innermost first
        text, n = _WIKI_TEMPLATE.subn(" ", text)
        if not n:
            break
    text = _WIKI_FILE_LINK.sub(" ", text)
    text = _WIKI_LINK.sub(r"\1", text)
    text = _WIKI_EXT_LINK.sub(r"\1", text)
    text = _WIKI_TAG.sub(" ", text)
    text = _WIKI_HEADING.sub("", text)
    text = _WIKI_QUOTES.sub("", text)
    text = text.replace("&nbsp;", " ").replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">")
    paragraphs = []
    for line in text.split("\n"):
        line = line.strip()
        if not line or line[0] in "*#:;|!{}" or line.startswith("__"):
            continue
        paragraphs.append(line)
    return paragraphs


def _iter_wiki_dump(path: str) -> Iterator[List[str]]:
    import xml.etree.ElementTree as ET

    from kbert.utils import open_binary

    with open_binary(path) as f:
        ns = text = None
        redirect = False
        for _, elem in ET.iterparse(f, events=("end",)):
            tag = elem.tag.rsplit("}", 1)[-1]
            if tag == "ns":
                ns = elem.text
            elif tag == "redirect":
                redirect = True
            elif tag == "text":
                text = elem.text or ""
            elif tag == "page":
                if ns in (None, "0") and not redirect and text and not text.lstrip().lower().startswith(
                        ("#redirect", "#넘겨주기")):
                    yield strip_wiki_markup(text)
                ns = text = None
                redirect = False
                elem.clear()


# --------------------------------------------------------------------------- report
@dataclasses.dataclass
class CorpusReport:
    """What a corpus pass read and what it dropped (filled in while iterating)."""

    files: int = 0
    documents: int = 0
    sentences: int = 0
    characters: int = 0
    duplicates_dropped: int = 0
    empty_dropped: int = 0
    binary_dropped: int = 0
    short_dropped: int = 0
    long_dropped: int = 0
    files_skipped: List[str] = dataclasses.field(default_factory=list)

    def add(self, other: "CorpusReport"):
        for f in dataclasses.fields(self):
            if f.name == "files_skipped":
                self.files_skipped.extend(other.files_skipped)
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def __str__(self):
        skipped = f", {len(self.files_skipped)} files skipped ({', '.join(self.files_skipped[:3])})" \
            if self.files_skipped else ""
        return (f"{self.documents:,} documents, {self.sentences:,} sentences, {self.characters:,} characters "
                f"from {self.files:,} files; dropped {self.duplicates_dropped:,} duplicates, "
                f"{self.empty_dropped:,} empty, {self.binary_dropped:,} binary, {self.short_dropped:,} too short, "
                f"{self.long_dropped:,} too long{skipped}")

    def to_dict(self):
        return dataclasses.asdict(self)


_BINARY_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffd]")  # C0 controls but tab/newlines, U+FFFD


def _looks_binary(text: str) -> bool:
    if "\x00" in text:
        return True
    if _BINARY_CHARS.search(text) is None:  # almost every line: no per-character Python loop
        return False
    return len(_BINARY_CHARS.findall(text)) > max(2, len(text) // 10)


# --------------------------------------------------------------------------- recipes
def _konlpy_files(name: str) -> List[str]:
    try:
        import konlpy
    except ImportError as e:
        raise ImportError(f"The {name!r} corpus ships with konlpy: pip install konlpy") from e
    folder = os.path.join(os.path.dirname(konlpy.__file__), "data", "corpus", name)
    files = sorted(glob.glob(os.path.join(folder, "*.txt")))
    if not files:
        raise FileNotFoundError(f"konlpy's {name!r} corpus is missing from {folder}")
    return files


def data_home() -> str:
    """Where `kbert corpus download` puts data: $KBERT_DATA, else ~/.cache/kbert/corpora."""
    return os.environ.get("KBERT_DATA") or os.path.join(os.path.expanduser("~"), ".cache", "kbert", "corpora")


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    files: Callable[[Optional[str]], List[str]]  # path override -> files
    options: dict
    urls: Sequence[str] = ()

    def readme(self) -> str:
        return f"corpora/{self.name}/README.md"


def _find(name: str, filenames: Sequence[str], path: Optional[str]) -> List[str]:
    """The recipe's files under `path` (a file or dir), else under data_home()/name."""
    candidates = [path] if path else [os.path.join(data_home(), name)]
    for base in candidates:
        if base and os.path.isfile(base):
            return [base]
        if base and os.path.isdir(base):
            found = [os.path.join(base, f) for f in filenames if os.path.exists(os.path.join(base, f))]
            if found:
                return found
    recipe = RECIPES.get(name)
    fetch = (f"run `kbert corpus download {name}`" if recipe is not None and recipe.urls else
             f"put the files at {os.path.join(data_home(), name)} ($KBERT_DATA/{name}): it has no download URL")
    raise FileNotFoundError(
        f"Corpus {name!r} not found at {candidates[0]!r}: pass path=... (a file or the folder holding "
        f"{', '.join(filenames)}), or {fetch}; see corpora/{name}/README.md")


RECIPES = {
    "kolaw": Recipe("kolaw", "Korean constitution (konlpy, offline)", lambda p: _konlpy_files("kolaw"),
                    {"format": "text", "file_is_document": True}),
    "kobill": Recipe("kobill", "Korean National Assembly bills (konlpy, offline)",
                     lambda p: _konlpy_files("kobill"), {"format": "text", "file_is_document": True}),
    "movie-reviews": Recipe(
        "movie-reviews", "Naver movie reviews, one document per movie",
        lambda p: _find("movie-reviews", ["reviews.tsv.gz", "reviews.tsv"], p),
        {"format": "tsv", "column": "text", "group_by": "movie_id"}),
    "korsts": Recipe(
        "korsts", "KorSTS sentence pairs (each sentence a one-sentence document)",
        lambda p: _find("korsts", ["sts-train.tsv", "sts-dev.tsv"], p),
        {"format": "tsv", "column": ["sentence1", "sentence2"], "dedupe": "sentence"},
        urls=tuple(f"https://raw.githubusercontent.com/kakaobrain/KorNLUDatasets/master/KorSTS/{f}"
                   for f in ("sts-train.tsv", "sts-dev.tsv", "sts-test.tsv"))),
    "kornli": Recipe(
        "kornli", "KorNLI premises and hypotheses (each sentence a one-sentence document)",
        lambda p: _find("kornli", ["multinli.train.ko.tsv", "snli_1.0_train.ko.tsv", "xnli.dev.ko.tsv"], p),
        {"format": "tsv", "column": ["sentence1", "sentence2"], "dedupe": "sentence"},
        urls=tuple(f"https://raw.githubusercontent.com/kakaobrain/KorNLUDatasets/master/KorNLI/{f}"
                   for f in ("multinli.train.ko.tsv", "snli_1.0_train.ko.tsv", "xnli.dev.ko.tsv",
                             "xnli.test.ko.tsv"))),
    "wikipedia-ko": Recipe(
        "wikipedia-ko", "Korean Wikipedia articles from a pages-articles dump",
        lambda p: _find("wikipedia-ko", ["kowiki-latest-pages-articles.xml.bz2"], p),
        {"format": "wiki"},
        urls=("https://dumps.wikimedia.org/kowiki/latest/kowiki-latest-pages-articles.xml.bz2",)),
}


def download(name: str, directory: Optional[str] = None, progress: bool = True) -> List[str]:
    """Downloads a recipe's files (only ever called explicitly: `kbert corpus download NAME`)."""
    import shutil
    import urllib.request

    recipe = _recipe(name)
    if not recipe.urls:
        raise ValueError(f"Corpus {name!r} has no download URL ({recipe.description}): pass its files with "
                         f"path=... (--path), or put them at {os.path.join(data_home(), name)}; see {recipe.readme()}")
    directory = directory or os.path.join(data_home(), name)
    os.makedirs(directory, exist_ok=True)
    paths = []
    for url in recipe.urls:
        target = os.path.join(directory, url.rsplit("/", 1)[-1])
        if os.path.exists(target):
            paths.append(target)
            continue
        partial = target + ".part"
        from kbert.utils import progress_bar

        with urllib.request.urlopen(url) as response, open(partial, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0) or None
            bar = progress_bar(total, desc=os.path.basename(target), unit="B", enabled=progress)
            while True:
                chunk = response.read(1 << 20)
                if not chunk:
                    break
                out.write(chunk)
                bar.update(len(chunk))
            bar.close()
        os.replace(partial, target)
        if target.endswith(".zip"):
            shutil.unpack_archive(target, directory)
        paths.append(target)
    return paths


def _recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"Unknown corpus {name!r}; named corpora are {sorted(RECIPES)} (or pass a path)")
    return RECIPES[name]


# --------------------------------------------------------------------------- the corpus
def _detect_format(path: str) -> str:
    name = path.lower()
    for suffix in (".gz", ".bz2"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    if name.endswith(".xml"):
        return "wiki"
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".tsv"):
        return "tsv"
    return "text"


FORMATS = ("text", "jsonl", "tsv", "wiki")


class Corpus:
    """Documents (lists of sentences) from files, folders, globs or named recipes.

    Args:
        sources: a path, glob, directory, recipe name, or a list of them.
        format: one of `FORMATS`, or None to detect it from each file name.
        text_field: JSONL field holding the text (default "text").
        column: TSV column name(s) or 0-based index; several columns give several documents per row
            unless `group_by` joins them.
        group_by: TSV column whose value, when equal on adjacent rows, puts the rows in one document.
        splitter: "rules" (default, fast), "kiwi", "lines" (each line is one sentence) or a callable.
        normalize: normalize sentences with `kbert.normalize` (True, or a dict of its options).
        min_chars / max_chars: drop sentences shorter / longer than this (after normalization).
        dedupe: "document" (default), "sentence" or None: exact duplicates dropped by hash.
        path: for a recipe, where its files are (overrides the default location).
        file_is_document: plain text only: each file is one document (blank lines do not split it).

    Example:
        >>> corpus = kbert.corpus(["kolaw", "kobill"])
        >>> for document in corpus: ...
        >>> print(corpus.report)
    """

    def __init__(self, sources, format: Optional[str] = None, text_field: str = "text",
                 column: Union[str, int, Sequence, None] = None, group_by: Optional[str] = None,
                 splitter="rules", normalize: Union[bool, dict] = True, min_chars: int = 1,
                 max_chars: Optional[int] = None, dedupe: Optional[str] = "document", path: Optional[str] = None,
                 file_is_document: bool = False):
        if format is not None and format not in FORMATS:
            raise ValueError(f"`format` must be one of {FORMATS} or None. Received: format={format!r}")
        if dedupe not in DEDUPE:
            raise ValueError(f"`dedupe` must be one of {DEDUPE}. Received: dedupe={dedupe!r}")
        if isinstance(sources, (str, os.PathLike)):
            sources = [sources]
        if not sources:
            raise ValueError("`sources` is empty: pass a path, a glob, a directory or a corpus name")
        self.sources = [os.fspath(s) for s in sources]
        self.format, self.text_field, self.column, self.group_by = format, text_field, column, group_by
        self.splitter = splitter
        self._split = _get_splitter(splitter)
        self.normalize_options = normalize if isinstance(normalize, dict) else ({} if normalize else None)
        self.min_chars, self.max_chars, self.dedupe, self.path = min_chars, max_chars, dedupe, path
        self.file_is_document = file_is_document
        self.report = CorpusReport()
        self._plan = [self._resolve(s) for s in self.sources]  # fail fast on bad names and paths

    def __repr__(self):
        return f"Corpus({self.sources!r})"

    def _resolve(self, source: str):
        if source in RECIPES and not os.path.exists(source):
            recipe = RECIPES[source]
            options = dict(recipe.options)
            return recipe.files(self.path), options
        if os.path.isdir(source):
            files = sorted(p for p in glob.glob(os.path.join(source, "**", "*"), recursive=True)
                           if os.path.isfile(p) and not os.path.basename(p).startswith("."))
        elif any(ch in source for ch in "*?["):
            files = sorted(glob.glob(source, recursive=True))
        else:
            files = [source]
        if not files:
            raise FileNotFoundError(f"No files match {source!r}")
        for f in files:
            if not os.path.isfile(f):
                hint = f" (named corpora: {sorted(RECIPES)})" if os.sep not in source else ""
                raise FileNotFoundError(f"Corpus file not found: {f!r}{hint}")
        return files, {}

    # ------------------------------------------------------------- stage 1: read
    def _read_file(self, path: str, options: dict, report: CorpusReport) -> Iterator[List[str]]:
        fmt = options.get("format") or self.format or _detect_format(path)
        try:
            if fmt == "wiki":
                yield from _iter_wiki_dump(path)
            elif fmt == "jsonl":
                yield from self._read_jsonl(path, options.get("text_field", self.text_field), report)
            elif fmt == "tsv":
                yield from self._read_tsv(path, options.get("column", self.column),
                                          options.get("group_by", self.group_by))
            else:
                yield from self._read_text(path, options.get("file_is_document", self.file_is_document))
        except (OSError, EOFError, UnicodeError) as e:  # truncated gzip, unreadable file
            report.files_skipped.append(f"{path}: {e}")

    @staticmethod
    def _read_text(path: str, file_is_document: bool) -> Iterator[List[str]]:
        with open_text(path) as f:
            doc = []
            for line in f:
                line = line.strip()
                if line:
                    doc.append(line)
                elif doc and not file_is_document:
                    yield doc
                    doc = []
            if doc:
                yield doc

    @staticmethod
    def _read_jsonl(path: str, field: str, report: CorpusReport) -> Iterator[List[str]]:
        with open_text(path) as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    report.binary_dropped += 1
                    continue
                text = obj.get(field) if isinstance(obj, dict) else None
                if text is None:
                    raise ValueError(f"{path}:{n}: no field {field!r} (fields: {sorted(obj)[:10] if isinstance(obj, dict) else type(obj).__name__}); "
                                     f"pass text_field=...")
                yield [p for p in str(text).split("\n") if p.strip()]

    @staticmethod
    def _read_tsv(path: str, column, group_by) -> Iterator[List[str]]:
        columns = list(column) if isinstance(column, (list, tuple)) else [0 if column is None else column]
        with open_text(path) as f:
            header = None
            if any(isinstance(c, str) for c in columns) or group_by is not None:
                header = f.readline().rstrip("\n").split("\t")
                for c in columns + ([group_by] if group_by else []):
                    if isinstance(c, str) and c not in header:
                        raise ValueError(f"{path}: no column {c!r}; the header has {header}")
            index = [header.index(c) if isinstance(c, str) else int(c) for c in columns]
            key_index = header.index(group_by) if group_by else None
            doc, key = [], None
            for line in f:
                row = line.rstrip("\n").split("\t")
                texts = [row[i] for i in index if i < len(row) and row[i].strip()]
                if key_index is None:
                    for t in texts:
                        yield [t]
                    continue
                k = row[key_index] if key_index < len(row) else None
                if k != key and doc:
                    yield doc
                    doc = []
                key = k
                doc.extend(texts)
            if doc:
                yield doc

    def raw_documents(self, report: Optional[CorpusReport] = None) -> Iterator[List[str]]:
        """Stage 1: documents as lists of raw lines, binary junk and exact duplicates removed."""
        report = self.report if report is None else report
        seen = set()
        for files, options in self._plan:
            dedupe = options.get("dedupe", self.dedupe)
            for path in files:
                report.files += 1
                before = report.documents + report.empty_dropped + report.duplicates_dropped
                for doc in self._read_file(path, options, report):
                    lines = []
                    for line in doc:
                        if _looks_binary(line):
                            report.binary_dropped += 1
                        else:
                            lines.append(line)
                    if not lines:
                        report.empty_dropped += 1
                        continue
                    if dedupe == "sentence":
                        kept = []
                        for line in lines:
                            h = hashlib.blake2b(line.strip().encode("utf-8", "replace"), digest_size=8).digest()
                            if h in seen:
                                report.duplicates_dropped += 1
                            else:
                                seen.add(h)
                                kept.append(line)
                        lines = kept
                        if not lines:
                            continue
                    if dedupe == "document":
                        h = hashlib.blake2b("\n".join(lines).encode("utf-8", "replace"), digest_size=8).digest()
                        if h in seen:
                            report.duplicates_dropped += 1
                            continue
                        seen.add(h)
                    report.documents += 1  # provisional: clean() may still empty it
                    yield lines
                if report.documents + report.empty_dropped + report.duplicates_dropped == before:
                    report.files_skipped.append(f"{path}: no text")

    # ------------------------------------------------------------- stage 2: clean
    def clean(self, lines: List[str], report: Optional[CorpusReport] = None) -> List[str]:
        """Stage 2 (picklable, runs in pipeline workers): normalize, split into sentences, filter lengths."""
        report = self.report if report is None else report
        out = []
        for line in lines:
            if self.normalize_options is not None:
                line = _normalize(line, **self.normalize_options)
            for sentence in self._split(line):
                sentence = sentence.strip()
                if len(sentence) < self.min_chars:
                    report.short_dropped += 1
                elif self.max_chars is not None and len(sentence) > self.max_chars:
                    report.long_dropped += 1
                else:
                    out.append(sentence)
        report.sentences += len(out)
        report.characters += sum(len(s) for s in out)
        if not out:
            report.documents -= 1
            report.empty_dropped += 1
        return out

    def __iter__(self) -> Iterator[List[str]]:
        self.report = CorpusReport()
        for lines in self.raw_documents():
            doc = self.clean(lines)
            if doc:
                yield doc

    def texts(self) -> Iterator[str]:
        """Every sentence, one after another (what `Tokenizer.train` takes)."""
        for doc in self:
            yield from doc

    def __getstate__(self):  # the splitter may be a lambda: rebuild it in worker processes
        state = dict(self.__dict__)
        state["_split"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._split = _get_splitter(self.splitter)


def corpus(sources, **options) -> Corpus:
    """`kbert.corpus(...)`: see `Corpus`."""
    if isinstance(sources, Corpus):
        return sources
    return Corpus(sources, **options)



def movie_review_sentiment(path: Optional[str] = None, split: str = "train", limit: Optional[int] = None,
                           dev_fraction: float = 0.1, seed: int = 0) -> List[dict]:
    """A balanced binary sentiment set built from the movie-review recipe the way NSMC was: non-empty
    reviews of at most 140 characters, ratings 1-4 labelled "0" (negative), 9-10 labelled "1" (positive).

    Movies (not reviews) are split between `split="train"` and `"dev"` by a hash of the movie id, so no
    movie's reviews leak across; the majority class is down-sampled to the minority's size, and rows come
    shuffled with `seed`. Returns dicts with `text` and `label` (what `kbert.finetune` reads).
    """
    import csv
    import random

    if split not in ("train", "dev"):
        raise ValueError(f"`split` must be 'train' or 'dev'. Received: split={split!r}")
    files = _find("movie-reviews", ["reviews.tsv.gz", "reviews.tsv"], path)
    by_label = {"0": [], "1": []}
    for file in files:
        with open_text(file) as f:
            for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
                text = (row.get("text") or "").strip()
                try:
                    rating = int(row.get("rating") or 0)
                except ValueError:
                    continue
                if not text or len(text) > 140 or 5 <= rating <= 8 or rating < 1:
                    continue
                digest = hashlib.md5(str(row.get("movie_id")).encode()).digest()[0] / 256.0
                if (digest < dev_fraction) != (split == "dev"):
                    continue
                by_label["1" if rating >= 9 else "0"].append(text)
    rng = random.Random(seed)
    size = min(len(v) for v in by_label.values())
    if limit is not None:
        size = min(size, limit // 2)
    rows = [{"text": t, "label": label} for label, texts in by_label.items() for t in rng.sample(texts, size)]
    rng.shuffle(rows)
    return rows
