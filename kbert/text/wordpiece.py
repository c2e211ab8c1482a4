"""WordPiece ids in pure Python, identical to tensorflow-text's `FastBertTokenizer` (as `Tokenizer` builds it).

The pretraining pipeline tokenizes in spawned worker processes. Going through tensorflow-text there means
importing TensorFlow in every worker (~4 s each before the first block) for a call that is a dictionary
walk; this module gives the same ids without TensorFlow. Offsets (`Tokenizer.encode`) and the in-graph path
still use tensorflow-text.

What `FastBertTokenizer(no_pretokenization=False, lower_case_nfd_strip_accents=False)` does, and this
module repeats:
1. Split on "whitespace", which for it means Unicode categories Cc, Cf, Zs, Zl, Zp (control and format
   characters separate words rather than being dropped). Python's Unicode database is older than the
   ICU inside tensorflow-text, so code points it leaves unassigned but ICU knows are listed in `_EXTRA_*`.
2. Every punctuation character (BERT's rule: ASCII symbols plus Unicode category P*) and every CJK
   ideograph is a word of its own.
3. Each word becomes the greedy longest-match-first sequence of vocabulary pieces (`##` marks pieces that
   continue a word); a word that cannot be covered, or is longer than `max_bytes_per_word` UTF-8 bytes,
   is one [UNK].

`tests/test_text.py` checks every code point and real text against tensorflow-text.
"""

from __future__ import annotations

import itertools
import re
import unicodedata
from typing import Dict, List, Sequence

_WHITESPACE_CATEGORIES = ("Cc", "Cf", "Zs", "Zl", "Zp")
# Unassigned in Python 3.11's Unicode 14 database; ICU (tensorflow-text 2.21) has them as format
# characters (Egyptian hieroglyph controls, Unicode 15) or as punctuation (Unicode 15 and 16).
_EXTRA_WHITESPACE = ((0x13439, 0x1343F),)
_EXTRA_PUNCTUATION = ((0x1B4E, 0x1B4F), (0x1B7F, 0x1B7F), (0x10D6E, 0x10D6E), (0x113D4, 0x113D5),
                      (0x113D7, 0x113D8), (0x11B00, 0x11B09), (0x11BE1, 0x11BE1), (0x11F43, 0x11F4F),
                      (0x16D6D, 0x16D6F), (0x1E5FF, 0x1E5FF))
# CJK ideograph blocks, as BERT's `_is_chinese_char`
_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
        (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))
_PATTERN = None
_CACHE_LIMIT = 500_000  # distinct words remembered per process (a few hundred MB at most)


def _char_classes() -> bytes:
    """One byte per code point: 0 word character, 1 whitespace (separates words), 2 punctuation or CJK
    (a word of its own)."""
    category, classes = unicodedata.category, bytearray(0x110000)
    # planes 4-13 are unassigned and 15-16 private use (word characters): scanning them costs 0.3 s
    for cp in itertools.chain(range(0x40000), range(0xE0000, 0xF0000)):
        c = category(chr(cp))
        if c[0] == "P":
            classes[cp] = 2
        elif c in _WHITESPACE_CATEGORIES:
            classes[cp] = 1
    for ranges, value in ((_EXTRA_WHITESPACE, 1), (_EXTRA_PUNCTUATION, 2), (_CJK, 2),
                          (((33, 47), (58, 64), (91, 96), (123, 126)), 2), (((0xD800, 0xDFFF),), 0)):
        for a, b in ranges:
            classes[a:b + 1] = bytes([value]) * (b + 1 - a)
    return bytes(classes)


def _ranges(classes: bytes, value: int):
    return [(m.start(), m.end() - 1) for m in re.finditer(re.escape(bytes([value])) + b"+", classes)]


def _regex_class(ranges) -> str:
    return "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges)


def word_pattern() -> "re.Pattern":
    """Compiled regex whose `findall` gives the words of step 1-2 (built once per process, ~0.5 s)."""
    global _PATTERN
    if _PATTERN is None:
        classes = _char_classes()
        punct, space = _regex_class(_ranges(classes, 2)), _regex_class(_ranges(classes, 1))
        _PATTERN = re.compile(f"[{punct}]|[^{space}{punct}]+")
    return _PATTERN


class WordPieceIds:
    """Text -> WordPiece ids (no special tokens), with a per-process cache of words already seen.

    Args:
        vocab: the vocabulary, id order (`##` continuation pieces).
        unk_id: id of the unknown token.
        max_bytes_per_word: longer words (in UTF-8 bytes) are one [UNK], as in tensorflow-text.

    Example:
        >>> WordPieceIds(["[PAD]", "[UNK]", "학교", "##에서", "."], 1).ids("학교에서.")
        [2, 3, 4]
    """

    def __init__(self, vocab: Sequence[str], unk_id: int, max_bytes_per_word: int = 400):
        self._unk = [unk_id]
        self._max_bytes = max_bytes_per_word
        self._cache: Dict[str, List[int]] = {}
        # word-initial pieces and `##` continuation pieces (without `##`): each table maps every prefix of a
        # piece to the piece's id, or to -1 when the prefix is not a piece itself; a match is extended only
        # while it is still the prefix of some piece (one lookup per character)
        self._first: Dict[str, int] = {}
        self._cont: Dict[str, int] = {}
        for i, token in enumerate(vocab):
            table, piece = (self._cont, token[2:]) if token.startswith("##") else (self._first, token)
            for k in range(1, len(piece)):
                table.setdefault(piece[:k], -1)
            if piece and table.get(piece, -1) < 0:  # the first id of a duplicated piece wins
                table[piece] = i

    def _word(self, word: str) -> List[int]:
        """Greedy longest-match-first pieces of one word ([UNK] when some part cannot be matched)."""
        if len(word) * 4 > self._max_bytes and len(word.encode("utf-8")) > self._max_bytes:
            return self._unk
        table, ids, start, n = self._first, [], 0, len(word)
        while start < n:
            best, best_end, end = -1, start, start + 1
            while end <= n:
                i = table.get(word[start:end])
                if i is None:
                    break
                if i >= 0:
                    best, best_end = i, end
                end += 1
            if best < 0:
                return self._unk
            ids.append(best)
            start, table = best_end, self._cont
        return ids

    def ids(self, text: str) -> List[int]:
        return self.ids_batch([text])[0]

    def ids_batch(self, texts: Sequence[str]) -> List[List[int]]:
        # Cache by whitespace-separated chunk (an eojeol with its punctuation): `str.split` runs in C and
        # splits only where tensorflow-text splits too (Python's whitespace is a subset of categories
        # Cc/Zs/Zl/Zp), so a chunk's ids are its words' ids; a chunk seen before costs one lookup.
        cache, out = self._cache, []
        for text in texts:
            row = []
            for chunk in text.split():
                ids = cache.get(chunk)
                if ids is None:
                    ids = self._chunk(chunk)
                row += ids
            out.append(row)
        return out

    def _chunk(self, chunk: str) -> List[int]:
        cache = self._cache
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        ids = []
        for word in word_pattern().findall(chunk):
            word_ids = cache.get(word)
            if word_ids is None:
                word_ids = cache[word] = self._word(word)
            ids += word_ids
        cache[chunk] = ids
        return ids
