"""Labelled rows for fine-tuning: TSV / CSV / JSONL files (UTF-8, gzip allowed; a .json file may be one
array), CoNLL-U treebanks (`.conllu`, Universal Dependencies' format: a row per sentence) or lists of dicts, and
their cells.

Every reader names the file, row and column of a bad value, so a mislabelled row is found without a debugger.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from kbert.utils import read_utf8_text, uncompressed_name, write_atomic


def read_rows(source, columns: Sequence[str], names: Optional[Sequence[str]] = None) -> List[dict]:
    """Rows of a TSV/CSV/JSONL file (or a list of dicts), checked to have every column in `columns` (None
    entries are skipped). A TSV has a header row and no quoting, unless `names` gives its columns' names in
    order: then its first line is a row too (a header-less file, as 3i4k's `label<TAB>text` and
    google-research/bert's processors read); a .json file is JSON lines, one array of
    objects, or a SQuAD-format document (KorQuAD's; one row per question, `kbert.data.qa.squad_rows`); a .conllu
    file is a row per sentence (`conllu_rows`: `text` and its words' `upos`, `xpos`, ... tags); a file in
    KLUE-NER's layout (`## id<TAB>sentence` lines, then a character and its tag a line) is a row per sentence
    with its entity spans (`char_tag_rows`)."""
    if names is not None:
        names = [str(n) for n in ([names] if isinstance(names, str) else names)]
        if not names or len(set(names)) < len(names):
            raise ValueError(f"column names must be distinct and at least one. Received: {names}")
    headed_table = False  # a TSV/CSV read with its first line as the header
    if isinstance(source, (list, tuple)):
        if names is not None:
            raise ValueError("column names are for a TSV/CSV file without a header line; these rows are a list")
        rows = list(source)
        name = "the given rows"
    else:
        if not os.path.isfile(source):
            raise FileNotFoundError(f"Data file not found: {source!r}")
        base = uncompressed_name(source)  # lower case, without .gz / .bz2: the format's suffix
        name = source
        if base.endswith((".xlsx", ".xls")):
            raise ValueError(f"{source} is an Excel workbook; save it as CSV UTF-8 (Excel: Save As > CSV UTF-8) "
                             f"and pass the .csv")
        text = read_utf8_text(source)
        if names is not None and base.endswith((".json", ".jsonl", ".conllu")):
            raise ValueError(f"column names are for a TSV/CSV file without a header line; {source} names its own")
        if base.endswith(".json") and text.lstrip().startswith("["):  # one JSON array of rows
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{source} is not valid JSON: {e}") from None
        elif base.endswith(".json") and text.lstrip().startswith("{") and (squad := _squad(text)) is not None:
            rows = squad  # SQuAD / KorQuAD layout: one row per question
        elif base.endswith((".jsonl", ".json")):
            rows = []
            for n, line in enumerate(text.split("\n"), 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{source}:{n} is not valid JSON: {e}") from None
        elif base.endswith(".conllu"):
            rows = conllu_rows(text, source)
        elif names is None and text.lstrip("\ufeff").startswith("## ") and "\t" in text.partition("\n")[0]:
            rows = char_tag_rows(text, source)  # KLUE-NER's layout
        else:
            rows = table_rows(text, source, csv_file=base.endswith(".csv"), names=names)
            headed_table = names is None
    if not rows:
        raise ValueError(f"no examples in {name}")
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None:
        raise ValueError(f"{name}: row {bad + 1} is {type(rows[bad]).__name__}, not a mapping of column to value")
    missing = [c for c in columns if c is not None and c not in rows[0]]
    if missing:
        hint = ("; if its first line is a row, not a header, give the columns' names in order (`columns=[...]`, "
                "`--columns label,text`)") if headed_table else ""
        raise ValueError(f"{name} has no column {missing[0]!r}; its columns are {sorted(rows[0])}{hint}")
    return rows


# CoNLL-U's ten fields; a row keeps these of each word, space-separated, beside the sentence's text
CONLLU_FIELDS = ("id", "form", "lemma", "upos", "xpos", "feats", "head", "deprel", "deps", "misc")
CONLLU_COLUMNS = ("upos", "xpos", "lemma", "deprel", "head")


def text_lines(text: str) -> List[str]:
    """The lines of a file's text, split at line feeds only (CRLF ends too). Not `str.splitlines`: that also
    splits at U+2028, U+0085 and the other Unicode line breaks, which scraped Korean web text holds inside a
    sentence (and JSON may hold raw inside a string), so one row became two, its cells shifted."""
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


def table_rows(text: str, source: str, csv_file: bool, names: Optional[Sequence[str]] = None) -> List[dict]:
    """The rows of a CSV (quoted cells may hold commas and line breaks, kept as written) or a TSV (a header row,
    no quoting), as dicts by the header's names (or by `names`, in order, when the file has no header
    line). A row with more cells than the header is an error naming its
    line: a tab inside a TSV's text shifted its cells, and the row would have trained with a piece of its text as
    its label (extra cells that are all empty are dropped). A row with fewer cells gets None for the missing ones
    (an empty cell, named where it is used)."""
    if csv_file:
        reader = csv.reader(io.StringIO(text, newline=""))
        numbered = ((reader.line_num, cells) for cells in reader)
    else:  # a TSV cell is whatever lies between tabs (a lone CR or a quote mark is text)
        numbered = ((n, line.split("\t")) for n, line in enumerate(text_lines(text), 1))
    header, rows = (list(names) if names is not None else None), []
    for n, cells in numbered:
        if not cells or (len(cells) == 1 and not cells[0].strip()):
            continue
        if header is None:
            header = cells
            continue
        if len(cells) > len(header) and not any(c.strip() for c in cells[len(header):]):
            cells = cells[:len(header)]  # trailing empty cells (a spreadsheet's stray commas) hold nothing
        if len(cells) > len(header):
            raise ValueError(f"{source}:{n} has {len(cells)} {'comma' if csv_file else 'tab'}-separated "
                             f"cells where the {'header has' if names is None else 'column names have'} {len(header)} "
                             f"({', '.join(header)}): "
                             + ("quote a cell that holds a comma" if csv_file else
                                "a tab inside a text? write the file as .jsonl or .csv"))
        rows.append(dict(zip(header, cells + [None] * (len(header) - len(cells)))))
    return rows


def conllu_rows(text: str, source: str = "the CoNLL-U text") -> List[dict]:
    """A row per sentence of a CoNLL-U treebank (Universal Dependencies): `text`, its words joined by single
    spaces, so that kbert's tagging task (a tag per whitespace word) tags exactly the treebank's words (in the
    Korean treebanks a word is an eojeol, and punctuation is a word of its own); `sentence`, the `# text =` line as
    written; `sent_id`; and per word, space-separated, `upos`, `xpos`, `lemma`, `deprel` and `head`.
    Multiword-token ranges (`1-2`) and empty nodes (`1.1`) are left out, as UD's word-level tags are.

    Example:
        >>> kbert.finetune("klue/bert-base", "tagging", "ko_gsd-ud-train.conllu", "ko_gsd-ud-dev.conllu",
        ...                label_column="upos")"""
    rows, words, comments = [], [], {}

    def end_sentence():
        if words:
            row = {"text": " ".join(w["form"] for w in words), "sentence": comments.get("text", ""),
                   "sent_id": comments.get("sent_id", str(len(rows) + 1))}
            row.update({c: " ".join(w[c] for w in words) for c in CONLLU_COLUMNS})
            rows.append(row)
        words.clear()
        comments.clear()

    for n, line in enumerate(text.split("\n"), 1):
        line = line.rstrip("\r")
        if not line.strip():
            end_sentence()
        elif line.startswith("#"):
            key, sep, value = line[1:].partition("=")
            if sep:
                comments[key.strip()] = value.strip()
        else:
            fields = line.split("\t")
            if len(fields) != len(CONLLU_FIELDS):
                raise ValueError(f"{source}:{n} has {len(fields)} tab-separated fields; a CoNLL-U word line has 10 "
                                 f"({', '.join(CONLLU_FIELDS)})")
            word = dict(zip(CONLLU_FIELDS, fields))
            if not word["id"].isdigit():  # `1-2` multiword token, `1.1` empty node
                continue
            if not word["form"] or any(ch.isspace() for ch in word["form"]):
                raise ValueError(f"{source}:{n}: the word {word['form']!r} is empty or holds a space, so the "
                                 f"sentence's words cannot be told apart by whitespace")
            words.append({k: (v.replace(" ", "_") or "_") for k, v in word.items()})
    end_sentence()
    return rows


def char_tag_rows(text: str, source: str = "the tagged text") -> List[dict]:
    """A row per sentence of KLUE-NER's TSV (`klue-ner-v1.1_train.tsv`, as the KLUE repo ships it): a sentence is
    a `## id<TAB>sentence with <entity:TYPE> marks` line, then a line per character, `character<TAB>tag` (BIO
    tags: B-PS, I-PS, ..., O; a space is a character too), and a blank line. The row holds `text` (the characters
    joined), `label`, its entities as `[start, end, type]` character spans read from the tags (what span-labelled
    tagging trains on, so an entity may end before the particle written onto it), and `id`. An I- tag that
    does not continue an entity of its type starts one, as CoNLL's scorer reads it."""
    rows, chars, tags, ident = [], [], [], None

    def end_sentence():
        if ident is not None or chars:
            spans = []
            for k, tag in enumerate(tags):
                kind = tag[2:] if tag[:2] in ("B-", "I-") else None
                if kind is None:
                    continue
                if tag.startswith("I-") and spans and spans[-1][2] == kind and spans[-1][1] == k:
                    spans[-1][1] = k + 1
                else:
                    spans.append([k, k + 1, kind])
            rows.append({"text": "".join(chars), "label": spans, "id": ident or str(len(rows) + 1)})
        chars.clear()
        tags.clear()

    for n, line in enumerate(text.lstrip("\ufeff").split("\n"), 1):
        line = line.rstrip("\r")
        if line.startswith("## "):
            end_sentence()
            ident = line[3:].partition("\t")[0].strip()
        elif not line.strip() and "\t" not in line:
            end_sentence()
            ident = None
        else:
            char, sep, tag = line.rpartition("\t")
            if not sep or len(char) != 1:
                raise ValueError(f"{source}:{n}: expected a character, a tab and its tag (KLUE-NER's layout); "
                                 f"got {line[:40]!r}")
            tag = tag.strip()
            if tag != "O" and not (tag[:2] in ("B-", "I-") and len(tag) > 2):
                raise ValueError(f"{source}:{n}: tag {tag!r} is not O, B-TYPE or I-TYPE")
            chars.append(char)
            tags.append(tag)
    end_sentence()
    return rows


def text_rows(data, column: str, names: Optional[Sequence[str]] = None) -> List[dict]:
    """Unlabelled texts as rows `{column: text}`: a list of strings, a list of dicts, a TSV/CSV/JSONL file
    with `column` (`read_rows`), or a plain-text file (.txt, .txt.gz): a line per text, blank lines skipped.
    A .txt whose first line is a tab-separated header naming `column` is read as the TSV it is, so a
    labelled .txt file (question-pair's) gives its column, never whole tab-joined lines; a .txt whose every line
    has the same number of tabs (a TSV without its header) is an error asking for its columns. With `names` (a
    header-less file's column names, in order) a file is read as that TSV/CSV."""
    if data is None:
        return []
    if names is not None and not isinstance(data, (list, tuple)):
        return read_rows(data, [column], names=names)
    if isinstance(data, (list, tuple)):
        if all(isinstance(x, str) for x in data):
            return [{column: x} for x in data if x.strip()]
        return read_rows(list(data), [column])
    if isinstance(data, str) and os.path.isfile(data) and data.endswith((".txt", ".txt.gz")):
        lines = [line.strip() for line in text_lines(read_utf8_text(data)) if line.strip()]
        if lines and column in lines[0].lstrip("\ufeff").split("\t"):
            return read_rows(data, [column])
        tabs = {line.count("\t") for line in lines}
        if len(tabs) == 1 and 0 not in tabs:  # every line the same number of cells: a TSV without its header
            raise ValueError(f"{data}'s lines are {tabs.pop() + 1} tab-separated cells each, a TSV without a header "
                             f"line naming {column!r}: add one, or give the columns' names in order (`columns=[...]`, "
                             f"`--columns label,text`)")
        return [{column: line} for line in lines]
    return read_rows(data, [column])


def _squad(text: str):
    """The rows of a SQuAD-format JSON document (`kbert.data.qa.squad_rows`), or None for other JSON."""
    from kbert.data.qa import is_squad, squad_rows

    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    return squad_rows(obj) if is_squad(obj) else None


def write_rows(rows: Sequence[dict], path: str) -> None:
    """Writes `rows` as the file `read_rows` reads back: JSONL for .jsonl / .json, CSV for .csv, else TSV
    (header row, no quoting: a cell holding a tab or a line break is refused by row and column; write
    JSONL for such text). The columns are the first row's; the file is written whole, then renamed into place."""
    if not rows:
        raise ValueError(f"no rows to write to {path!r}")
    columns = list(rows[0])

    def write(tmp):
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            if path.endswith((".jsonl", ".json")):
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
            elif path.endswith(".csv"):
                writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
                writer.writeheader()
                writer.writerows(rows)
            else:
                f.write("\t".join(columns) + "\n")
                for i, row in enumerate(rows):
                    cells = ["" if row.get(c) is None else str(row.get(c)) for c in columns]
                    for c, cell in zip(columns, cells):
                        if "\t" in cell or "\n" in cell or "\r" in cell:  # the partial file goes (write_atomic)
                            raise ValueError(f"row {i + 1}, column {c!r} holds a tab or a line break, which a "
                                             f"TSV cannot: write {path!r} as .jsonl or .csv instead")
                    f.write("\t".join(cells) + "\n")

    write_atomic(path, write)


def selection_split(rows: Sequence[dict], key, fraction: float = 0.1) -> Tuple[List[dict], List[dict]]:
    """`(fit, select)`: the rows split by a hash of `row[key]` (a column name, or a function of the row), with
    about `fraction` of them in `select`, the part of the *training* data to choose a recipe on (epochs, learning
    rate, which stage helps), so that the dev or test set stays a figure never tuned on.

    The split is fixed (MD5 of "selection:" + the key, not a random draw): the same on every run, machine and
    seed, and rows sharing a key (KorSTS pairs with one first sentence, a question with two paraphrases) fall on
    one side. It is the split behind benchmarks/quality.py's selection figures."""
    import hashlib

    if not 0 < fraction < 1:
        raise ValueError(f"`fraction` must be in (0, 1). Received: {fraction!r}")
    value = key if callable(key) else (lambda row: row[key])
    fit, select = [], []
    for i, row in enumerate(rows):
        try:
            text = str(value(row))
        except (KeyError, TypeError):
            raise ValueError(f"row {i + 1} has no {key!r} to split on") from None
        digest = hashlib.md5(("selection:" + text).encode("utf-8")).digest()[0]
        (select if digest / 256.0 < fraction else fit).append(row)
    return fit, select


def text_cell(row: dict, column: str, where: str) -> str:
    value = row.get(column)
    if value is None:
        raise ValueError(f"{where}: column {column!r} is empty")
    return str(value)


def class_label(value, split: str, i: int) -> str:
    """A class label as its text with surrounding whitespace removed (" 1" and "1" are one class); an empty
    label is an error naming its row."""
    label = "" if value is None else str(value).strip()
    if not label:
        raise ValueError(f"{split} row {i + 1}: the label is empty; give every row a class, or drop the row")
    return label


def label_list(value, split: str, i: int) -> List[str]:
    """A multi-label row's labels: a list, a JSON list in a cell ('["분노", "슬픔"]'), or a comma-separated
    cell ("분노,슬픔"); an empty cell or list is a row with none of the labels. A missing cell is an error."""
    if value is None:
        raise ValueError(f"{split} row {i + 1}: the labels are missing; an empty cell or [] is a row with none")
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                raise ValueError(f"{split} row {i + 1}: labels {value!r} are not a JSON list") from None
        else:
            value = text.split(",")
    if not isinstance(value, (list, tuple)):
        value = [value]
    return sorted({str(x).strip() for x in value if str(x).strip()})


def label_targets(values: Sequence, labels: Sequence[str], split: str, multi_label: bool = False) -> np.ndarray:
    """Gold labels as a model's targets: `[n]` int32 indices into `labels`, or for a multi-label task `[n, k]`
    float32 rows of 1 at each of the row's labels. A label outside `labels` (those the model was trained on) is
    an error naming its row."""
    index = {label: k for k, label in enumerate(labels)}
    out = np.zeros((len(values), len(labels)) if multi_label else len(values), np.float32 if multi_label else np.int32)
    for i, v in enumerate(values):
        row = label_list(v, split, i) if multi_label else [class_label(v, split, i)]
        unknown = [x for x in row if x not in index]
        if unknown:
            raise ValueError(f"{split} row {i + 1} has labels not seen in training: {unknown[:5]} "
                             f"(training labels: {list(labels)})")
        if multi_label:
            out[i, [index[x] for x in row]] = 1.0
        else:
            out[i] = index[row[0]]
    return out


def number(value, split: str, i: int) -> float:
    """A regression label (an STS score): a finite number. "nan" and "inf" parse as floats, and would train
    into a NaN loss or score a dev set wrongly, so they are errors naming the row."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{split} row {i + 1}: label {value!r} is not a number") from None
    if not math.isfinite(out):
        raise ValueError(f"{split} row {i + 1}: label {value!r} is not a finite number")
    return out


def entity_spans(value, split: str, i: int) -> Optional[List[Tuple[int, int, str]]]:
    """A tagging row's entities as character spans of its text, sorted, or None when the cell holds one tag per
    word instead. Spans are `[start, end, label]` lists or `{"start", "end", "label"}` dicts (Doccano's and Label
    Studio's exports; spaCy's `entities` too), `text[start:end]` being the entity; a JSON string of such a list
    (a TSV or CSV cell) reads the same; an empty list is a row without entities."""
    if isinstance(value, str) and value.strip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None  # a tag that happens to start with "[": word tags
    if not isinstance(value, list) or any(isinstance(v, str) for v in value):
        return None
    out = []
    for item in value:
        if isinstance(item, dict):
            item = [item.get("start"), item.get("end"), item.get("label", item.get("entity"))]
        if not isinstance(item, (list, tuple)) or len(item) != 3 or not all(isinstance(x, int) for x in item[:2]) \
                or not isinstance(item[2], str) or not 0 <= item[0] < item[1]:
            raise ValueError(f"{split} row {i + 1}: entity {item!r} is not [start, end, label] with 0 <= start < end "
                             "(character offsets into the text) and a label string")
        out.append((item[0], item[1], item[2]))
    out.sort()
    for a, b in zip(out, out[1:]):
        if b[0] < a[1]:
            raise ValueError(f"{split} row {i + 1}: entities {list(a)} and {list(b)} overlap; a tagger gives each "
                             "character one entity")
    return out


def tags(value, split: str, i: int) -> List[str]:
    """One tag per whitespace-separated word: a list, or a space-separated string."""
    out = value if isinstance(value, list) else str(value).split()
    if not out:
        raise ValueError(f"{split} row {i + 1}: no tags")
    return [str(t) for t in out]
