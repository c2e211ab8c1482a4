"""WordPiece ids in pure Python, identical to tensorflow-text's `FastBertTokenizer` (as `Tokenizer` builds it).

The pretraining pipeline tokenizes in spawned worker processes. Going through tensorflow-text there means
importing TensorFlow in every worker (~4 s each before the first block) for a call that is a dictionary
walk; this module gives the same ids without TensorFlow. Offsets (`Tokenizer.encode`) and the in-graph path
still use tensorflow-text.

What `FastBertTokenizer(no_pretokenization=False, lower_case_nfd_strip_accents=False)` does, and this
module repeats:
1. Split on "whitespace", which for it means Unicode categories Cc, Cf, Zs, Zl, Zp (control and format
   characters separate words rather than being dropped), as ICU inside tensorflow-text classifies code
   points (the constant tables below).
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
from typing import Dict, List, Sequence, Tuple

# The character classes as tensorflow-text 2.21 (its ICU) has them, as code point ranges in hex: words
# separate at "whitespace" (Unicode categories Cc, Cf, Zs, Zl, Zp), and every "punctuation" character (BERT's
# rule: ASCII symbols and categories P*) and CJK ideograph (BERT's `_is_chinese_char` blocks) is a word of its
# own. A constant table starts a process ~0.3 s sooner than scanning `unicodedata` (every spawned pipeline
# worker pays that) and does not change with Python's Unicode version. `derive_tables()` rebuilds it; the
# tests compare both with tensorflow-text on every code point.
WHITESPACE = (
    "0-20 7F-A0 AD 600-605 61C 6DD 70F 890-891 8E2 1680 180E 2000-200F 2028-202F 205F-2064 2066-206F 3000 "
    "FEFF FFF9-FFFB 110BD 110CD 13430-1343F 1BCA0-1BCA3 1D173-1D17A E0001 E0020-E007F "
)
PUNCTUATION = (
    "21-2F 3A-40 5B-60 7B-7E A1 A7 AB B6-B7 BB BF 37E 387 55A-55F 589-58A 5BE 5C0 5C3 5C6 5F3-5F4 609-60A "
    "60C-60D 61B 61D-61F 66A-66D 6D4 700-70D 7F7-7F9 830-83E 85E 964-965 970 9FD A76 AF0 C77 C84 DF4 E4F "
    "E5A-E5B F04-F12 F14 F3A-F3D F85 FD0-FD4 FD9-FDA 104A-104F 10FB 1360-1368 1400 166E 169B-169C 16EB-16ED "
    "1735-1736 17D4-17D6 17D8-17DA 1800-180A 1944-1945 1A1E-1A1F 1AA0-1AA6 1AA8-1AAD 1B4E-1B4F 1B5A-1B60 "
    "1B7D-1B7F 1BFC-1BFF 1C3B-1C3F 1C7E-1C7F 1CC0-1CC7 1CD3 2010-2027 2030-2043 2045-2051 2053-205E 207D-207E "
    "208D-208E 2308-230B 2329-232A 2768-2775 27C5-27C6 27E6-27EF 2983-2998 29D8-29DB 29FC-29FD 2CF9-2CFC "
    "2CFE-2CFF 2D70 2E00-2E2E 2E30-2E4F 2E52-2E5D 3001-3003 3008-3011 3014-301F 3030 303D 30A0 30FB 3400-4DBF "
    "4E00-9FFF A4FE-A4FF A60D-A60F A673 A67E A6F2-A6F7 A874-A877 A8CE-A8CF A8F8-A8FA A8FC A92E-A92F A95F "
    "A9C1-A9CD A9DE-A9DF AA5C-AA5F AADE-AADF AAF0-AAF1 ABEB F900-FAFF FD3E-FD3F FE10-FE19 FE30-FE52 FE54-FE61 "
    "FE63 FE68 FE6A-FE6B FF01-FF03 FF05-FF0A FF0C-FF0F FF1A-FF1B FF1F-FF20 FF3B-FF3D FF3F FF5B FF5D FF5F-FF65 "
    "10100-10102 1039F 103D0 1056F 10857 1091F 1093F 10A50-10A58 10A7F 10AF0-10AF6 10B39-10B3F 10B99-10B9C "
    "10D6E 10EAD 10F55-10F59 10F86-10F89 11047-1104D 110BB-110BC 110BE-110C1 11140-11143 11174-11175 "
    "111C5-111C8 111CD 111DB 111DD-111DF 11238-1123D 112A9 113D4-113D5 113D7-113D8 1144B-1144F 1145A-1145B "
    "1145D 114C6 115C1-115D7 11641-11643 11660-1166C 116B9 1173C-1173E 1183B 11944-11946 119E2 11A3F-11A46 "
    "11A9A-11A9C 11A9E-11AA2 11B00-11B09 11BE1 11C41-11C45 11C70-11C71 11EF7-11EF8 11F43-11F4F 11FFF "
    "12470-12474 12FF1-12FF2 16A6E-16A6F 16AF5 16B37-16B3B 16B44 16D6D-16D6F 16E97-16E9A 16FE2 1BC9F "
    "1DA87-1DA8B 1E5FF 1E95E-1E95F 20000-2A6DF 2A700-2CEAF 2F800-2FA1F "
)
_CACHE_LIMIT = 500_000  # distinct words remembered per process (a few hundred MB at most)
# Hangul syllables and compatibility jamo, ASCII letters and digits: all word characters, so a chunk made only
# of them is one word (checked without the large character classes of the full word pattern)
_PLAIN_WORD = re.compile("[\uac00-\ud7a3\u3131-\u3163A-Za-z0-9]+")
_PATTERN = None


def parse_ranges(table: str):
    return [tuple(int(x, 16) for x in (item.split("-") * 2)[:2]) for item in table.split()]


def derive_tables():
    """(whitespace ranges, punctuation ranges) from Python's `unicodedata` (Python 3.11: Unicode 14) plus the
    code points ICU assigns and that database does not. Used to regenerate the tables above."""
    import unicodedata

    extra_whitespace = ((0x13439, 0x1343F),)  # Egyptian hieroglyph format controls (Unicode 15)
    extra_punctuation = ((0x1B4E, 0x1B4F), (0x1B7F, 0x1B7F), (0x10D6E, 0x10D6E), (0x113D4, 0x113D5),
                         (0x113D7, 0x113D8), (0x11B00, 0x11B09), (0x11BE1, 0x11BE1), (0x11F43, 0x11F4F),
                         (0x16D6D, 0x16D6F), (0x1E5FF, 0x1E5FF))  # Unicode 15 and 16 punctuation
    cjk = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
           (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))
    category, classes = unicodedata.category, bytearray(0x110000)
    # planes 4-13 are unassigned and 15-16 private use (word characters)
    for cp in itertools.chain(range(0x40000), range(0xE0000, 0xF0000)):
        c = category(chr(cp))
        if c[0] == "P":
            classes[cp] = 2
        elif c in ("Cc", "Cf", "Zs", "Zl", "Zp"):
            classes[cp] = 1
    for ranges, value in ((extra_whitespace, 1), (extra_punctuation, 2), (cjk, 2),
                          (((33, 47), (58, 64), (91, 96), (123, 126)), 2), (((0xD800, 0xDFFF),), 0)):
        for a, b in ranges:
            classes[a:b + 1] = bytes([value]) * (b + 1 - a)
    return tuple([(m.start(), m.end() - 1) for m in re.finditer(re.escape(bytes([value])) + b"+", bytes(classes))]
                 for value in (1, 2))


def _regex_class(ranges) -> str:
    return "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges)


def word_pattern() -> "re.Pattern":
    """Compiled regex whose `findall` gives the words of step 1-2 (built once per process)."""
    global _PATTERN
    if _PATTERN is None:
        space, punct = _regex_class(parse_ranges(WHITESPACE)), _regex_class(parse_ranges(PUNCTUATION))
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
        self._chunks = _Chunks(self)
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
        # Cc/Zs/Zl/Zp), so a chunk's ids are its words' ids; a chunk seen before costs one lookup, and the
        # loop over chunks runs in C (`map` over the cache's `__getitem__`; `_Chunks.__missing__` computes new
        # ones).
        get, chain = self._chunks.__getitem__, itertools.chain.from_iterable
        return [list(chain(map(get, text.split()))) for text in texts]

    def _chunk(self, chunk: str) -> Tuple[int, ...]:
        cache = self._chunks
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        if _PLAIN_WORD.fullmatch(chunk):  # the common case: one word, no split needed
            ids = self._word(chunk)
        else:
            ids = []
            for word in word_pattern().findall(chunk):
                word_ids = cache.get(word)
                if word_ids is None:
                    word_ids = cache[word] = tuple(self._word(word))
                ids += word_ids
        # tuples of ints: Python's cycle collector stops tracking them, so a cache of ~10^5 entries does not
        # make every full collection walk it (with lists, collections took up to half of this module's time)
        ids = cache[chunk] = tuple(ids)
        return ids


class _Chunks(dict):
    """chunk (or word) -> ids; a missing chunk is computed by its `WordPieceIds`."""

    def __init__(self, owner: WordPieceIds):
        super().__init__()
        self._owner = owner

    def __missing__(self, chunk: str) -> Tuple[int, ...]:
        return self._owner._chunk(chunk)
