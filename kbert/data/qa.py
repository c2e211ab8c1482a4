"""Extractive question answering (SQuAD, KorQuAD, KLUE-MRC): rows, windows over long contexts, answer spans.

What `kbert.finetune(..., "question-answering")` trains on and `kbert.TaskModel.answer` decodes with, in one
place so training, evaluation and inference cut contexts and read spans alike:

- `squad_rows`: SQuAD-format JSON (`{"data": [{"paragraphs": [{"context", "qas": [...]}]}]}`, what KorQuAD
  1.0 and 2.0 ship) as flat rows `{"id", "question", "context", "answers": {"text": [...], "answer_start":
  [...]}}`, the layout of Hugging Face `datasets`' squad sets, which rows may also come in directly.
- `aligned_normalize`: the tokenizer's normalized context with a map back to the original characters, so an
  answer is a slice of the context the user gave (offsets included), not of its normalized copy.
- `windows`: `[CLS] question [SEP] context-window [SEP]` inputs, the context cut into overlapping windows
  (`doc_stride` tokens shared by neighbours, as transformers' `stride`), each token's span in the context.
- `best_spans`: transformers' question-answering decoding (softmax of start and end logits over the
  window's context tokens and [CLS], the product for each span up to `max_answer_length` tokens, the null
  answer from [CLS]); tested against transformers' own `select_starts_ends`.
- `exact_match` / `f1`: KorQuAD 1.0's official evaluation (character-level F1, spaces and punctuation
  ignored), which for Korean reads better than SQuAD's word-level F1 (one eojeol with a particle attached
  would otherwise count as a different word).

Shapes: s = window length (tokens), n = windows.
"""

from __future__ import annotations

import dataclasses
import json
import re
import string
from collections import Counter
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from kbert.data.features import segment_ids
from kbert.utils import softmax


def is_squad(obj) -> bool:
    """Whether a parsed JSON object is SQuAD's layout (articles with paragraphs with questions)."""
    return isinstance(obj, dict) and isinstance(obj.get("data"), list)


def squad_rows(obj) -> List[dict]:
    """Flat rows of a parsed SQuAD-format JSON object (SQuAD 1.1 / 2.0, KorQuAD 1.0 / 2.0): one row per
    question, `answers` as `{"text": [...], "answer_start": [...]}` (empty lists for an unanswerable one)."""
    rows = []
    for a, article in enumerate(obj["data"]):
        for p, paragraph in enumerate(article.get("paragraphs") or []):
            context = paragraph.get("context")
            if not isinstance(context, str):
                raise ValueError(f"SQuAD data: article {a + 1}, paragraph {p + 1} has no `context` text")
            for q in paragraph.get("qas") or []:
                answers = [] if q.get("is_impossible") else (q.get("answers") or [])
                rows.append({"id": str(q.get("id", len(rows))), "title": article.get("title", ""),
                             "question": q.get("question", ""), "context": context,
                             "answers": {"text": [x["text"] for x in answers],
                                         "answer_start": [int(x["answer_start"]) for x in answers]}})
    return rows


def answer_list(value, context: str, where: str) -> List[Tuple[str, int]]:
    """The gold answers of a row as (text, start in `context`): from `{"text": [...], "answer_start": [...]}`
    (datasets' layout), a list of `{"text", "answer_start"}` (SQuAD's), or a plain answer text (its first
    occurrence in the context). An empty list means unanswerable. A start that does not point at its text is
    an error naming the row."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.lstrip().startswith(("{", "[")) else value
        except json.JSONDecodeError:
            pass
    if isinstance(value, str):
        start = context.find(value)
        if start < 0:
            raise ValueError(f"{where}: the answer {value!r} does not occur in the context")
        return [(value, start)]
    if isinstance(value, dict):
        texts, starts = value.get("text") or [], value.get("answer_start") or []
        if len(texts) != len(starts):
            raise ValueError(f"{where}: {len(texts)} answer texts but {len(starts)} answer_start values")
        value = [{"text": t, "answer_start": s} for t, s in zip(texts, starts)]
    out = []
    for x in value:
        if not isinstance(x, dict) or "text" not in x or "answer_start" not in x:
            raise ValueError(f"{where}: an answer must have `text` and `answer_start`. Received: {x!r}")
        text, start = str(x["text"]), int(x["answer_start"])
        if context[start:start + len(text)] != text:
            raise ValueError(f"{where}: answer_start {start} does not point at the answer {text!r} in the context "
                             f"(found {context[start:start + len(text)]!r})")
        out.append((text, start))
    return out


def aligned_normalize(text: str, normalize: Callable[[str], str]):
    """(normalized, starts, ends): `normalize(text)` and for each of its characters the span of `text` it came
    from (`text[starts[i]:ends[i]]`), so a span of the normalized text maps back to the original as
    `text[starts[a]:ends[b - 1]]`.

    kbert's normalizer (NFC or NFKC, control characters removed, whitespace runs made one space, optional
    lowercasing and run shortening) never joins two whitespace-separated words, so each word is aligned on its
    own, by the lengths its prefixes normalize to; a word the normalizer leaves as it is maps one to one. The
    spans can be longer than a character (a syllable composed from jamo, a run cut short, a removed zero-width
    character after it), never out of order."""
    words = [(m.start(), m.group()) for m in re.finditer(r"\S+", text)]
    out, starts, ends = [], [], []
    for at, word in words:
        norm = normalize(word)
        if not norm:
            continue
        if out:
            out.append(" ")
            starts.append(at)
            ends.append(at)
        if norm == word:
            out.append(word)
            starts.extend(range(at, at + len(word)))
            ends.extend(range(at + 1, at + len(word) + 1))
            continue
        prefix = [len(normalize(word[:k])) for k in range(len(word) + 1)]
        # character i starts where a prefix first normalizes past i characters, and runs to where the next
        # one starts (a composed syllable spans its jamo; a shortened run, the characters cut from it)
        firsts = [next((k for k in range(len(word)) if prefix[k + 1] > i), len(word) - 1) for i in range(len(norm))]
        starts.extend(at + k for k in firsts)
        ends.extend(at + max(k, first + 1) for first, k in zip(firsts, firsts[1:] + [len(word)]))
        out.append(norm)
    joined = "".join(out)
    if joined != normalize(text) or len(starts) != len(joined):  # a normalizer outside kbert's rules
        whole = normalize(text)
        n = len(whole)
        return whole, list(range(n)), [min(i + 1, len(text)) for i in range(n)]
    return joined, starts, ends


def normalized_span(starts: List[int], ends: List[int], a: int, b: int) -> Optional[Tuple[int, int]]:
    """The normalized-text span of the original characters [a, b) (`aligned_normalize`'s `starts` / `ends`), or
    None when normalization removed them."""
    first = next((i for i, e in enumerate(ends) if e > a), None)
    last = next((i for i in range(len(starts) - 1, -1, -1) if starts[i] < b), None)
    if first is None or last is None or last < first:
        return None
    return first, last + 1


@dataclasses.dataclass
class Window:
    """One model input of a (question, context) pair: token ids, segment ids, and for each token its
    (start, end) in the normalized context, or None for [CLS], the question and separators."""
    ids: List[int]
    segments: List[int]
    spans: List[Optional[Tuple[int, int]]]


def windows(tokenizer, question: str, context_encoding, max_length: int, doc_stride: int = 128,
            max_query_length: int = 64) -> List[Window]:
    """The inputs of one question over a context already encoded without special tokens
    (`tokenizer.encode(context, add_special_tokens=False)`): `[CLS] question [SEP] window [SEP]` (XLM-RoBERTa:
    two separators in the middle), the question cut to `max_query_length` tokens, the context cut into windows
    of the tokens left, neighbours sharing `doc_stride` tokens (at most half a window)."""
    q = tokenizer.encode(question, add_special_tokens=False).ids[:max_query_length]
    head = [tokenizer.cls_id] + q + [tokenizer.sep_id] * tokenizer.pair_separators
    room = max_length - len(head) - 1
    if room < 1:
        raise ValueError(f"max_length {max_length} leaves no room for the context after a question of {len(q)} "
                         f"tokens; raise max_length or lower max_query_length")
    ids, offsets = context_encoding.ids, context_encoding.offsets
    step = max(1, room - min(doc_stride, room // 2))
    out, start = [], 0
    while True:
        part = slice(start, start + room)
        window_ids = head + list(ids[part]) + [tokenizer.sep_id]
        spans = [None] * len(head) + [tuple(o) for o in offsets[part]] + [None]
        out.append(Window(window_ids, segment_ids(window_ids, tokenizer.sep_id), spans))
        if start + room >= len(ids):
            return out
        start += step


def token_targets(window: Window, answer: Optional[Tuple[int, int]]) -> Tuple[int, int]:
    """(start token, end token) of an answer's normalized character span in a window, or (0, 0) ([CLS]) when
    the window does not hold all of it or there is no answer (SQuAD 2.0's unanswerable)."""
    if answer is None:
        return 0, 0
    a, b = answer
    context = [(t, s) for t, s in enumerate(window.spans) if s is not None and s[1] > s[0]]
    first = next((t for t, (s, e) in context if e > a), None)
    last = next((t for t, (s, e) in reversed(context) if s < b), None)
    if first is None or last is None or last < first or window.spans[first][0] > a or window.spans[last][1] < b:
        return 0, 0
    return first, last


def best_spans(start_logits: np.ndarray, end_logits: np.ndarray, window: Window, top_k: int = 1,
               max_answer_length: int = 30):
    """(spans, null): the window's `top_k` answer spans as (score, first token, last token), best first, and
    the null answer's score. Scores are transformers' question-answering probabilities: a softmax of the start
    and of the end logits over the context tokens and [CLS], a span's score the product of its start's and its
    end's, for spans of at most `max_answer_length` tokens; the null answer is [CLS] as start and end."""
    # every context token, even one with no characters of its own (a lone `▁`), as transformers keeps them
    keep = np.array([t == 0 or s is not None for t, s in enumerate(window.spans)])
    n = len(window.spans)
    start = softmax(np.where(keep, np.asarray(start_logits[:n], np.float64), -10000.0))
    end = softmax(np.where(keep, np.asarray(end_logits[:n], np.float64), -10000.0))
    null = float(start[0] * end[0])
    start[0] = end[0] = 0.0
    scores = np.tril(np.triu(np.outer(start, end)), max_answer_length - 1)
    valid = keep.copy()
    valid[0] = False
    scores = np.where(valid[:, None] & valid[None, :], scores, -1.0)
    flat = scores.ravel()
    k = min(top_k, int((flat > 0).sum()))
    if k == 0:
        return [], null
    order = np.argpartition(-flat, k - 1)[:k]
    order = order[np.argsort(-flat[order], kind="stable")]
    return [(float(flat[i]), int(i // n), int(i % n)) for i in order], null


def answers(windows_logits: Sequence[Tuple[np.ndarray, np.ndarray, Window]], context: str, starts: List[int],
            ends: List[int], top_k: int = 1, max_answer_length: int = 30,
            handle_impossible: bool = False) -> List[dict]:
    """The `top_k` answers of one question over all its windows, best first, each `{"score", "start", "end",
    "answer"}` with `start` / `end` into the original `context` through `aligned_normalize`'s `starts` / `ends`
    (as transformers' question-answering pipeline returns them, less any whitespace at the ends: a span may
    start or end with a token that is only a space). With `handle_impossible`, the null answer (`{"answer": "",
    "start": 0, "end": 0}`) competes with its lowest score over the windows."""
    found, null = {}, None
    for start_logits, end_logits, window in windows_logits:
        spans, window_null = best_spans(start_logits, end_logits, window, top_k, max_answer_length)
        null = window_null if null is None else min(null, window_null)
        for score, a, b in spans:
            s, e = window.spans[a][0], window.spans[b][1]
            if s >= e:
                continue
            char = strip_span(context, starts[s], ends[e - 1])
            if char is not None and (char not in found or found[char] < score):  # windows overlap: seen twice
                found[char] = score
    out = [{"score": score, "start": a, "end": b, "answer": context[a:b]} for (a, b), score in found.items()]
    if handle_impossible and null is not None:
        out.append({"score": null, "start": 0, "end": 0, "answer": ""})
    out.sort(key=lambda x: -x["score"])
    return out[:top_k]


def strip_span(text: str, a: int, b: int):
    """(a, b) without whitespace at either end (a lone `▁` token at a span's edge covers a space), or None when
    nothing is left."""
    while a < b and text[a].isspace():
        a += 1
    while b > a and text[b - 1].isspace():
        b -= 1
    return (a, b) if a < b else None


# ---------------------------------------------------------------------------------------------- evaluation
_PUNCTUATION = set(string.punctuation) | set("‘’´`_·「」『』《》〈〉【】…“”")


def normalize_answer(text: str) -> str:
    """KorQuAD 1.0's answer normalization: lowercase, punctuation removed, whitespace runs made one space."""
    text = "".join(ch for ch in str(text).lower() if ch not in _PUNCTUATION)
    return " ".join(text.split())


def exact_match(prediction: str, truths: Sequence[str]) -> float:
    """1.0 when the prediction equals one of the gold answers after `normalize_answer`, else 0.0 (an
    unanswerable question, no truths, matches only the empty prediction)."""
    if not truths:
        return float(prediction == "")
    return float(any(normalize_answer(prediction) == normalize_answer(t) for t in truths))


def f1(prediction: str, truths: Sequence[str]) -> float:
    """KorQuAD 1.0's F1: the best over the gold answers of the character-level F1 of the normalized texts with
    spaces removed."""
    if not truths:
        return float(prediction == "")

    def one(p: str, t: str) -> float:
        pc, tc = Counter(normalize_answer(p).replace(" ", "")), Counter(normalize_answer(t).replace(" ", ""))
        same = sum((pc & tc).values())
        if same == 0:
            return 0.0
        precision, recall = same / sum(pc.values()), same / sum(tc.values())
        return 2 * precision * recall / (precision + recall)

    return max(one(prediction, t) for t in truths)


def qa_scores(predictions: Dict[str, str], truths: Dict[str, List[str]]) -> Dict[str, float]:
    """`{"exact_match", "f1"}` in percent over the questions of `truths` (KorQuAD's `evaluate-v1.0.py`
    figures); a question without a prediction counts as the empty answer."""
    ids = list(truths)
    if not ids:
        raise ValueError("no questions to score")
    em = sum(exact_match(predictions.get(i, ""), truths[i]) for i in ids)
    f = sum(f1(predictions.get(i, ""), truths[i]) for i in ids)
    return {"exact_match": 100.0 * em / len(ids), "f1": 100.0 * f / len(ids)}
