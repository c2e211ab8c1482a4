"""One Korean text normalizer, in Python and as a TensorFlow graph twin that gives the same strings.

Never NFD: NFD (and BERT's `strip_accents`) decomposes Hangul syllables into jamo, so a vocabulary of
syllables sees only [UNK]. kbert composes (NFC), removes control and zero-width characters, collapses
whitespace, and optionally shortens character runs of noisy web text (`ㅋㅋㅋㅋㅋ` -> `ㅋㅋ`).
Old Hangul (conjoining jamo sequences) and compatibility jamo (`ㄱ`, `ㅋ`) survive.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Optional

FORMS = ("NFC", "NFKC")

# Control characters (C0/C1 except tab/newline/CR, which are whitespace), zero-width space, direction
# marks, BOM and soft hyphen. ZWJ (U+200D) stays: it joins emoji sequences.
_CONTROL = "\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u00ad\u200b\u200e\u200f\u2060\ufeff"
_SPACE = "\t\n\r\x0b\x0c \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
CONTROL_RE = re.compile(f"[{_CONTROL}]")
SPACE_RE = re.compile(f"[{_SPACE}]+")
# The same classes in RE2 syntax for tf.strings.regex_replace (Oniguruma reads them too: `tokenizers`).
_RE2_CONTROL = r"[\x{0}-\x{8}\x{b}\x{c}\x{e}-\x{1f}\x{7f}-\x{9f}\x{ad}\x{200b}\x{200e}\x{200f}\x{2060}\x{feff}]"
_RE2_SPACE = r"[\t\n\r\x{b}\x{c} \x{a0}\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}\x{205f}\x{3000}]+"
# NFKC maps compatibility jamo (U+3131-U+318E) to conjoining jamo, which would merge `ㅎㅏ` into `하`
# and turn `ㅋㅋ` into leading consonants; kbert keeps them as written.
_COMPAT_JAMO = re.compile("([\u3131-\u318e]+)")
# UTF-16 surrogates as code points of a str: a pair split into two (text read as UTF-16 units) or one alone (a
# JavaScript string sliced mid-pair, JSON's "\ud800"); such a str is not Unicode text and cannot be UTF-8
_SURROGATES = re.compile("[\ud800-\udfff]")
# Characters the NFC normalizer leaves alone: stable under NFC, not marks, controls, spaces or format
# characters, and never the second half of a canonical composition (so no neighbour composes with them).
# Derived from `unicodedata` over the scripts Korean text mixes in (Latin, Cyrillic, symbols, CJK, kana,
# Hangul syllables and compatibility jamo, full/half-width forms, emoji); tests re-derive each property.
# A string of these separated by single spaces, with no space at either end, is already normalized,
# so the graph normalizer skips it (most everyday text).
RE2_STABLE = (r"\x{21}-\x{7e}\x{a1}-\x{ac}\x{ae}-\x{2ff}\x{400}-\x{482}\x{48a}-\x{4ff}\x{2010}-\x{2027}"
               r"\x{2030}-\x{205e}\x{2070}-\x{20cf}\x{20f1}-\x{2125}\x{2127}-\x{2129}\x{212c}-\x{2328}"
               r"\x{232b}-\x{2adb}\x{2add}-\x{2bff}\x{3001}-\x{3029}\x{3030}-\x{3098}\x{309b}-\x{318e}"
               r"\x{4e00}-\x{9fff}\x{ac00}-\x{d7a3}\x{ff01}-\x{ffef}\x{1f300}-\x{1faff}")
_RE2_ALREADY_NORMAL = f"(?:[{RE2_STABLE}]+(?: [{RE2_STABLE}]+)*)?"
# Of the other strings, nearly all differ only by extra ASCII spaces: for those, collapsing and trimming
# spaces is the whole chain.
_RE2_STABLE_AND_SPACES = f"[{RE2_STABLE} ]*"


def _check(form: str, repeat: Optional[int]):
    if form not in FORMS:
        raise ValueError(f"`form` must be one of {FORMS}. Received: form={form!r}")
    if repeat is not None and (not isinstance(repeat, int) or repeat < 1):
        raise ValueError(f"`repeat` must be None or a positive integer. Received: repeat={repeat!r}")


def normalize(text, form: str = "NFC", repeat: Optional[int] = None, lowercase: bool = False) -> str:
    """Normalizes Korean text the way every kbert tokenizer sees it.

    Args:
        text: a `str` (or UTF-8 `bytes`; invalid bytes become U+FFFD, as do lone UTF-16 surrogates of a `str`,
            and a surrogate pair split in two becomes its character).
        form: `"NFC"` (default) or `"NFKC"` (also folds full-width Latin and digits; compatibility jamo
            are kept as they are).
        repeat: if set, runs of one character longer than `repeat` are cut to `repeat` characters
            (`repeat=2`: `ㅋㅋㅋㅋㅋ` -> `ㅋㅋ`, `!!!!` -> `!!`).
        lowercase: lowercase Latin letters (Hangul has no case; no accent stripping ever).

    Example:
        >>> normalize("  학교에서\\u200b   ㅋㅋㅋㅋㅋ ", repeat=2)
        '학교에서 ㅋㅋ'
    """
    _check(form, repeat)
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise TypeError(f"normalize expects str or bytes. Received: {type(text).__name__}")
    if _SURROGATES.search(text):  # pairs joined into their character, lone ones U+FFFD (as invalid bytes)
        text = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    if form == "NFKC":
        text = "".join(part if _COMPAT_JAMO.fullmatch(part) else unicodedata.normalize("NFKC", part)
                       for part in _COMPAT_JAMO.split(text))
    else:
        text = unicodedata.normalize("NFC", text)
    text = CONTROL_RE.sub("", text)
    text = SPACE_RE.sub(" ", text).strip(" ")
    if lowercase:
        text = text.lower()
    if repeat is not None:
        text = re.sub(r"(.)\1{%d,}" % repeat, lambda m: m.group(1) * repeat, text)
    return text


def without_surrogates(text: str) -> str:
    """`text` with each UTF-16 surrogate code point replaced by U+FFFD, one for one: the same length, so offsets
    into it are offsets into `text` (for analyzers that get `text` as it is, and fail on such code points)."""
    return _SURROGATES.sub("\ufffd", text)


def tokenizers_normalizer(form: str = "NFC", repeat: Optional[int] = None, lowercase: bool = False):
    """The same normalization as a Hugging Face `tokenizers` normalizer, for a `tokenizer.json` that
    `transformers.AutoTokenizer` loads: NFC, the control characters removed, whitespace runs made one space,
    stripped, then lowercased if asked. `form="NFKC"` (compatibility jamo kept) and `repeat` have no
    `tokenizers` equivalent and raise ValueError."""
    _check(form, repeat)
    if form != "NFC" or repeat is not None:
        raise ValueError(f"form={form!r}, repeat={repeat!r}: only NFC without `repeat` has an exact Hugging Face "
                         f"`tokenizers` normalizer")
    from tokenizers import Regex, normalizers

    steps = [normalizers.NFC(), normalizers.Replace(Regex(_RE2_CONTROL), ""),
             normalizers.Replace(Regex(_RE2_SPACE), " "), normalizers.Strip()]
    if lowercase:
        steps.append(normalizers.Lowercase())
    return normalizers.Sequence(steps)


def tf_normalize(texts, form: str = "NFC", repeat: Optional[int] = None, lowercase: bool = False):
    """The same normalization as a graph op on a string tensor of any shape (usable in `tf.data`).

    `form="NFKC"` is Python-only (the graph has no way to keep compatibility jamo out of NFKC).
    """
    _check(form, repeat)
    if form != "NFC":
        raise ValueError("The in-graph normalizer supports form='NFC' only; NFKC runs in Python "
                         "(kbert.normalize) because it must keep compatibility jamo unchanged")
    import tensorflow as tf

    texts = tf.convert_to_tensor(texts, tf.string)
    shape = tf.shape(texts)
    flat = tf.reshape(texts, [-1])
    # Only strings that could change go through the full chain (most text is already normal, and the
    # chain's transcode and regex passes cost more than the tokenizer itself). Invalid UTF-8 never
    # matches, so it always takes the full chain.
    todo = tf.where(tf.logical_not(tf.strings.regex_full_match(flat, _RE2_ALREADY_NORMAL)))
    flat = tf.tensor_scatter_nd_update(flat, todo, _tf_normalize_rest(tf.gather_nd(flat, todo)))
    texts = tf.reshape(flat, shape)
    if lowercase:
        texts = tf.strings.lower(texts, encoding="utf-8")
    if repeat is not None:
        texts = _tf_cut_repeats(texts, repeat)
    return texts


def _tf_normalize_rest(texts):
    """The strings that are not already normal: extra spaces only -> collapse and trim; others -> the
    full chain (the rare rest)."""
    import tensorflow as tf

    spaces = tf.strings.strip(tf.strings.regex_replace(texts, "  +", " "))
    hard = tf.where(tf.logical_not(tf.strings.regex_full_match(texts, _RE2_STABLE_AND_SPACES)))
    return tf.tensor_scatter_nd_update(spaces, hard, _tf_normalize_nfc(tf.gather_nd(texts, hard)))


def _tf_normalize_nfc(texts):
    """The full chain on a 1-D string tensor: transcode, NFC, controls out, spaces collapsed and trimmed."""
    import tensorflow as tf
    import tensorflow_text as tf_text

    # Invalid UTF-8 becomes U+FFFD, as Python's errors="replace" does.
    texts = tf.strings.unicode_transcode(texts, "UTF-8", "UTF-8", errors="replace", replacement_char=0xFFFD)
    texts = tf_text.normalize_utf8(texts, "NFC")
    texts = tf.strings.regex_replace(texts, _RE2_CONTROL, "")
    texts = tf.strings.regex_replace(texts, _RE2_SPACE, " ")
    return tf.strings.strip(texts)  # only " " can be left at the ends: the other spaces became " "


def _tf_cut_repeats(texts, repeat: int):
    """Drops a character when it equals each of the `repeat` characters before it (RE2 has no
    backreferences, so this compares code points shifted by 1..repeat)."""
    import tensorflow as tf

    shape = tf.shape(texts)
    flat = tf.reshape(texts, [-1])
    cps = tf.strings.unicode_decode(flat, "UTF-8")  # ragged [n, chars]
    dense = cps.to_tensor(default_value=-1)
    drop = tf.ones_like(dense, dtype=tf.bool)
    for k in range(1, repeat + 1):
        shifted = tf.pad(dense[:, :-k], [[0, 0], [k, 0]], constant_values=-2)
        drop = tf.logical_and(drop, tf.equal(dense, shifted))
    keep = tf.RaggedTensor.from_tensor(tf.logical_not(drop), lengths=cps.row_lengths())
    kept = tf.ragged.boolean_mask(cps, keep)
    return tf.reshape(tf.strings.unicode_encode(kept, "UTF-8"), shape)
