"""The words of each sentence of a CoNLL-U treebank (UD Korean GSD and KAIST in ../shared/data), for the
benchmarks that build Korean test items from its gold morphemes."""

from __future__ import annotations

from typing import List, Tuple


def conllu_sentences(path: str) -> List[List[Tuple[str, str, str, bool]]]:
    """Per sentence, its words as (form, lemma, XPOS, no space after it); multiword-token and empty-node lines
    are skipped. Korean UD writes a word's morphemes in LEMMA and XPOS joined by "+" (스타벅스+가, NNG+JKS)."""
    sentences, words = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                if words:
                    sentences.append(words)
                words = []
            elif not line.startswith("#"):
                cols = line.split("\t")
                if cols[0].isdigit():
                    words.append((cols[1], cols[2], cols[4], "SpaceAfter=No" in cols[9]))
    if words:
        sentences.append(words)
    return sentences
