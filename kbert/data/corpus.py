"""Korean corpora as documents of sentences: `Corpus` reads files and named recipes, cleans, splits and dedupes.

`kbert.corpus(source)` accepts a file, a directory, a glob pattern, a named recipe (`kolaw`, `kobill`,
`movie-reviews`, `korsts`, `kornli`, `wikipedia-ko`) or a list of them, and yields documents (lists of
sentences). Formats are detected from the file name (compression suffixes `.gz` / `.bz2` first):

- plain text (`.txt`, anything unknown): one sentence or paragraph per line, a blank line between documents
  (google-research/bert's format); a file that starts with `MAX_DOCUMENT_LINES` lines and no blank line is cut
  into documents of that many lines, with a warning, so that it is neither one document in memory nor one
  worker's shard;
- lines (`format="lines"`, never detected): plain text with each line a document of its own (reviews,
  comments, questions; what KcBERT-style comment dumps look like);
- JSONL (`.jsonl`, `.json` with one object per line): the `text_field` of each object is a document;
- TSV (`.tsv`) and CSV (`.csv`, quoted cells as spreadsheets write them): the `column` (name or 0-based
  index; default the header's `text` column) of each row; rows that share `group_by` and are adjacent form one
  document;
- a Wikipedia XML dump (`*.xml`, `*-pages-articles*.xml.bz2`): each article in the main namespace is a
  document, markup stripped, redirects skipped.

Cleaning happens in two stages so that the expensive part runs on all cores in the pretraining pipeline:
`raw_documents()` (reading, binary-junk detection, exact-duplicate removal by hash) and `clean(raw)`
(normalization, sentence splitting, length filters). Iterating a `Corpus` does both; `corpus.report`
counts what was read and what was dropped, and why.

Sentence splitters live in `sentences.py`, Wikipedia markup in `wiki.py`, named corpora in `recipes.py`
(re-exported here).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import warnings
from typing import Iterator, List, Optional, Sequence, Union

import numpy as np

from kbert.data.recipes import RECIPES, download, movie_review_sentiment, recipe_named  # noqa: F401 (re-exported)
from kbert.data.sentences import SPLITTERS, get_splitter, split_sentences_kiwi, split_sentences_rules  # noqa: F401
from kbert.data.wiki import strip_wiki_markup, wiki_dump_articles  # noqa: F401
from kbert.text.normalize import normalize as _normalize
from kbert.utils import check_local_path, open_text, uncompressed_name

DEDUPE = ("document", "sentence", None)


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
    malformed_dropped: int = 0  # JSON-lines lines that are not JSON (a cut-off last line, a stray log line)
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
                f"{self.long_dropped:,} too long"
                + (f", {self.malformed_dropped:,} not JSON" if self.malformed_dropped else "") + skipped)

    def to_dict(self):
        return dataclasses.asdict(self)


_BINARY_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffd]")  # C0 controls but tab/newlines, U+FFFD


def _looks_binary(text: str) -> bool:
    if "\x00" in text:
        return True
    if _BINARY_CHARS.search(text) is None:  # almost every line: no per-character Python loop
        return False
    return len(_BINARY_CHARS.findall(text)) > max(2, len(text) // 10)


# --------------------------------------------------------------------------- the corpus
def file_format(path: str) -> str:
    """The corpus format a file's name implies (`FORMATS`; .gz / .bz2 looked through): "wiki" for .xml,
    "jsonl", "tsv", "csv", else "text"."""
    name = uncompressed_name(path)
    if name.endswith(".xml"):
        return "wiki"
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".tsv"):
        return "tsv"
    if name.endswith(".csv"):
        return "csv"
    return "text"


FORMATS = ("text", "lines", "jsonl", "tsv", "csv", "wiki")

# Why a cap: a plain-text file without blank lines (a text per line, as comment and review dumps come) is one
# document by the format's rule. Whole, it sits in one list in memory and goes to one worker as one block. Cut
# at this many lines, it spreads over blocks and workers; pairs are drawn between neighbouring sentences, so a
# cut every 1,000 lines moves only the pairs that would have crossed it. Only files whose first 1,000 lines
# hold no blank line are cut: a long document in a file that separates its documents stays whole.
MAX_DOCUMENT_LINES = 1000


def _table_rows(f, csv_file: bool) -> Iterator[List[str]]:
    """The cells of each row of an open TSV (split at tabs) or CSV (Python's csv reader) file, without the byte
    order mark Excel's "CSV UTF-8" puts before the first header cell (which then matched no column name)."""
    import csv

    rows = csv.reader(f) if csv_file else (line.rstrip("\r\n").split("\t") for line in f)
    for i, row in enumerate(rows):
        if i == 0 and row:
            row[0] = row[0].lstrip("\ufeff")
        yield row


def _default_column(path: str, csv_file: bool = False):
    """The column a TSV or CSV is read from when none is named: its `text` column when its first line is a
    header that has one; column 0 of every line for a file of one column. A file of several columns and no
    `text` header is an error naming its first line: reading column 0 there took ids or labels (and the header)
    as text."""
    with open_text(path) as f:
        first = next(_table_rows(f, csv_file), [""])
    if len(first) == 1:
        return 0
    if "text" in first:
        return "text"
    raise ValueError(f"{path}: a {'CSV' if csv_file else 'TSV'} of {len(first)} columns needs the column(s) to read "
                     f"(column=, --column NAME); its first line is {first[:10]}")


class Corpus:
    """Documents (lists of sentences) from files, folders, globs or named recipes.

    Args:
        sources: a path, glob, directory, recipe name, or a list of them.
        format: one of `FORMATS`, or None to detect it from each file name ("lines", a document per line of
            plain text, is never detected: name it).
        text_field: JSONL field holding the text (default "text").
        column: TSV / CSV column name(s) or 0-based index; several columns give several documents per row
            unless `group_by` joins them. None: the header's `text` column, or every line of a one-column
            file; a file of several columns without a `text` header is an error that names them.
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
        self._split = get_splitter(splitter)
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
                check_local_path(f, "corpus file")
                hint = f" (named corpora: {sorted(RECIPES)})" if os.sep not in source else ""
                raise FileNotFoundError(f"Corpus file not found: {f!r}{hint}")
        return files, {}

    # ------------------------------------------------------------- stage 1: read
    def _read_file(self, path: str, options: dict, report: CorpusReport) -> Iterator[List[str]]:
        fmt = options.get("format") or self.format or file_format(path)
        try:
            if fmt == "wiki":
                yield from wiki_dump_articles(path)
            elif fmt == "jsonl":
                yield from self._read_jsonl(path, options.get("text_field", self.text_field), report)
            elif fmt == "lines":
                yield from self._read_lines(path)
            elif fmt in ("tsv", "csv"):
                yield from self._read_tsv(path, options.get("column", self.column),
                                          options.get("group_by", self.group_by), csv_file=fmt == "csv")
            else:
                yield from self._read_text(path, options.get("file_is_document", self.file_is_document))
        except (OSError, EOFError, UnicodeError) as e:  # truncated gzip, unreadable file
            report.files_skipped.append(f"{path}: {e}")

    @staticmethod
    def _read_text(path: str, file_is_document: bool) -> Iterator[List[str]]:
        with open_text(path) as f:
            doc, blank_seen, cut = [], file_is_document, False
            for line in f:
                line = line.strip()
                if line:
                    doc.append(line)
                    if not blank_seen and len(doc) >= MAX_DOCUMENT_LINES:  # a run-on file: no document ends
                        if not cut:
                            warnings.warn(
                                f"{path}: {MAX_DOCUMENT_LINES:,} lines without a blank line. Plain text takes a blank "
                                f"line between documents, so these are read as documents of {MAX_DOCUMENT_LINES:,} "
                                f"lines. If each line is a text of its own (reviews, comments), read it as "
                                f"format='lines' (--format lines for kbert data prepare, pretrain and quickstart; "
                                f"data.format: lines in a pretraining config; kbert.corpus(path, format='lines'))",
                                stacklevel=2)
                        cut = True
                        yield doc
                        doc = []
                elif not file_is_document:
                    blank_seen = True
                    if doc:
                        yield doc
                        doc = []
            if doc:
                yield doc

    @staticmethod
    def _read_lines(path: str) -> Iterator[List[str]]:
        with open_text(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    yield [line]

    @staticmethod
    def _read_jsonl(path: str, field: str, report: CorpusReport) -> Iterator[List[str]]:
        """JSON lines (an object a line, its `field` a document), or a .json file holding one array of such objects
        (or of strings), as datasets are often exported; that file is read whole. A line that is not JSON is
        counted and left out; when most are, the file is not JSON lines, and that is an error naming the first."""
        with open_text(path) as f:
            head = f.read(1 << 12).lstrip()
        if uncompressed_name(path).endswith(".json") and head.startswith("["):
            with open_text(path) as f:
                try:
                    items = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} is not valid JSON: {e}") from None
            for n, obj in enumerate(items, 1):
                text = obj if isinstance(obj, str) else Corpus._json_text(obj, field, f"{path}: item {n}")
                yield [p for p in str(text).split("\n") if p.strip()]
            return
        bad = total = 0
        first = None
        with open_text(path) as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                total += 1
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    bad, first = bad + 1, first or n
                    report.malformed_dropped += 1
                    continue
                yield [p for p in str(Corpus._json_text(obj, field, f"{path}:{n}")).split("\n") if p.strip()]
        if bad * 2 > total:
            raise ValueError(f"{path}: {bad:,} of {total:,} lines are not JSON (first: line {first}); a JSON-lines "
                             f"corpus holds one object a line (a .json file may hold one array of them)")

    @staticmethod
    def _json_text(obj, field: str, where: str):
        text = obj.get(field) if isinstance(obj, dict) else None
        if text is None:
            fields = sorted(obj)[:10] if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(f"{where}: no field {field!r} (fields: {fields}); pass text_field=...")
        return text

    @staticmethod
    def _read_tsv(path: str, column, group_by, csv_file: bool = False) -> Iterator[List[str]]:
        """Rows of a TSV (a tab between cells, no quoting) or, with `csv_file`, a CSV (quoted cells may hold
        commas and line breaks, as spreadsheets write them)."""
        if column is None:
            column = _default_column(path, csv_file)
        columns = list(column) if isinstance(column, (list, tuple)) else [column]
        with open_text(path) as f:
            rows = _table_rows(f, csv_file)
            header = None
            if any(isinstance(c, str) for c in columns) or group_by is not None:
                header = next(rows, [])
                for c in columns + ([group_by] if group_by else []):
                    if isinstance(c, str) and c not in header:
                        raise ValueError(f"{path}: no column {c!r}; the header has {header}")
            index = [header.index(c) if isinstance(c, str) else int(c) for c in columns]
            key_index = header.index(group_by) if group_by else None
            doc, key = [], None
            for row in rows:
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
        self._split = get_splitter(self.splitter)


def document_shape(sentences: Sequence[int], characters: Sequence[int]) -> str:
    """How long the documents are, in a line: what decides NSP/SOP pairs (one-sentence documents have no next
    sentence) and padding (short documents fill little of a sequence: `kbert data prepare --join-documents`)."""
    n, c = np.asarray(sentences), np.asarray(characters)
    return (f"per document: sentences median {np.median(n):,.0f}, 90th percentile {np.percentile(n, 90):,.0f}; "
            f"characters median {np.median(c):,.0f}, 90th percentile {np.percentile(c, 90):,.0f}; "
            f"{np.mean(n == 1):.0%} of documents are one sentence")


def corpus(sources, **options) -> Corpus:
    """`kbert.corpus(...)`: see `Corpus`."""
    if isinstance(sources, Corpus):
        return sources
    return Corpus(sources, **options)
