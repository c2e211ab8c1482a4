"""Sentence splitting for Korean text: fast rules (the default), kiwipiepy's splitter, or one sentence per line.

BERT's next-sentence and ALBERT's sentence-order objectives pair sentences, so a corpus is read as documents of
sentences; `kbert.data.corpus.Corpus(splitter=...)` picks one of `SPLITTERS` or takes any callable.
"""

from __future__ import annotations

import re
from typing import Callable, List

SPLITTERS = ("rules", "kiwi", "lines")


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


def get_splitter(splitter) -> Callable[[str], List[str]]:
    if callable(splitter):
        return splitter
    if splitter == "rules":
        return split_sentences_rules
    if splitter == "kiwi":
        return split_sentences_kiwi
    if splitter in ("lines", None):
        return lambda text: [text]
    raise ValueError(f"`splitter` must be one of {SPLITTERS} or a callable. Received: splitter={splitter!r}")
