"""Tokens placed in the text as the user gave it, and entity spans as per-token BIO labels.

Named-entity data marks entities by character offsets (KLUE-NER's character tags, Doccano and Label Studio
exports, spaCy's `entities`), and Korean entities end inside words: in 삼성전자가 the entity is 삼성전자, the
particle 가 is not. Span-labelled tagging (`kbert finetune --task tagging` with spans in the label column)
therefore labels every token, not each word's first piece: a token overlapping an entity takes "B-" + its type
if it is the entity's first such token, else "I-"; every other token "O". `TaskModel.entities` reads the
predictions back over the same token spans (`token_spans`), so training and prediction place tokens alike.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from kbert.data.qa import aligned_normalize


def token_spans(tokenizer, text: str, encoding) -> List[Optional[Tuple[int, int]]]:
    """For each token of `encoding` (`tokenizer.encode(text)`) its (start, end) in `text`, or None for [CLS],
    [SEP] and the like ([UNK] is a token of the text). A SentencePiece "▁" piece alone (before punctuation
    or a character the vocabulary lacks) takes the character after it, as transformers' offsets place it."""
    normalized, starts, ends = aligned_normalize(text, tokenizer.normalize)
    if normalized != encoding.normalized:  # a normalizer beyond kbert's rules: spans of its own text
        starts, ends = list(range(len(encoding.normalized))), list(range(1, len(encoding.normalized) + 1))
    skip = set(tokenizer.special_ids.values()) - {tokenizer.unk_id}
    out = []
    for i, (a, b) in zip(encoding.ids, encoding.offsets):
        if i in skip or (b <= a and a >= len(starts)):
            out.append(None)
            continue
        b = max(b, a + 1)
        out.append((starts[a], ends[b - 1]))
    return out


def bio_labels(spans: Sequence[Optional[Tuple[int, int]]],
               entities: Sequence[Tuple[int, int, str]]) -> List[Optional[str]]:
    """Per token "B-type" / "I-type" / "O" from its span (`token_spans`) and the sorted, non-overlapping
    `entities` (start, end, type); None where the span is None."""
    out, seen = [], set()
    for span in spans:
        if span is None:
            out.append(None)
            continue
        hit = next((k for k, (s, e, _) in enumerate(entities) if span[0] < e and s < span[1]), None)
        if hit is None:
            out.append("O")
        else:
            out.append(("I-" if hit in seen else "B-") + entities[hit][2])
            seen.add(hit)
    return out
