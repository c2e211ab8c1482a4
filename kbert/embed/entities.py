"""Entity spans from a tagger's per-token label scores: transformers' token-classification pipeline's
aggregation strategies ("none", "simple", "first", "average", "max"), over tokens located in the text the user
gave.

Why spans by token, not by word: Korean writes particles onto the word they mark (삼성전자가, 서울에서), so an
entity often ends inside a whitespace word. A tagger trained on every token (KLUE-NER's character tags, most
published Korean NER models) marks 삼성전자 and not 가; "simple" keeps that. A tagger trained on each word's
first piece (`kbert finetune --task tagging`, word-level tags) is read with "first": each word takes its first
piece's label.

Each entity's `word` is the text as written between its `start` and `end` (the pipeline's is its tokens joined
back, which for WordPiece puts spaces around punctuation). Everything else follows the pipeline: `score` is the
mean of the grouped tokens' (or words') scores, "B-" starts an entity and "I-" (or no prefix) continues one of
the same type, and entities labelled with `ignore_labels` ("O") are left out.
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np

AGGREGATIONS = ("none", "simple", "first", "average", "max")


def check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"`aggregation` must be one of {AGGREGATIONS}. Received: aggregation={aggregation!r}")


def aggregate(tokens: List[dict], labels: Sequence[str], text: str, aggregation: str,
              ignore_labels: Sequence[str] = ("O",)) -> List[dict]:
    """Entities of one text. `tokens`: its non-special tokens in order, each `{"index": position in the row,
    "scores": label probabilities [labels], "start", "end": span in `text`, "subword": whether it continues the
    previous token's word}`."""
    check_aggregation(aggregation)
    if aggregation in ("none", "simple"):
        units = []
        for t in tokens:
            k = int(np.argmax(t["scores"]))
            units.append({"entity": labels[k], "score": float(t["scores"][k]), "index": t["index"],
                          "word": text[t["start"]:t["end"]], "start": t["start"], "end": t["end"]})
        if aggregation == "none":
            return [u for u in units if u["entity"] not in ignore_labels]
    else:
        units = [_word(group, labels, text, aggregation) for group in _words(tokens)]
    return [e for e in _group(units, text) if e["entity_group"] not in ignore_labels]


def _words(tokens: List[dict]) -> List[List[dict]]:
    groups = []
    for t in tokens:
        if groups and t["subword"]:
            groups[-1].append(t)
        else:
            groups.append([t])
    return groups


def _word(group: List[dict], labels, text: str, aggregation: str) -> dict:
    """One word's label from its tokens: the first token's, the most confident token's, or the mean scores'."""
    if aggregation == "first":
        scores = group[0]["scores"]
    elif aggregation == "max":
        scores = max(group, key=lambda t: float(np.max(t["scores"])))["scores"]
    else:
        scores = np.nanmean(np.stack([t["scores"] for t in group]), axis=0)
    k = int(np.argmax(scores))
    start, end = group[0]["start"], group[-1]["end"]
    return {"entity": labels[k], "score": float(scores[k]), "word": text[start:end], "start": start, "end": end}


def _tag(label: str):
    """("B" or "I", the entity type) of a label; a label without a B-/I- prefix continues its type."""
    if label.startswith(("B-", "I-")):
        return label[0], label[2:]
    return "I", label


def _group(units: List[dict], text: str) -> List[dict]:
    """Adjacent tokens or words of one type as one entity; "B-" always starts a new one."""
    runs = []
    for u in units:
        bi, tag = _tag(u["entity"])
        if runs and bi != "B" and tag == _tag(runs[-1][-1]["entity"])[1]:
            runs[-1].append(u)
        else:
            runs.append([u])
    out = []
    for run in runs:
        start, end = run[0]["start"], run[-1]["end"]
        out.append({"entity_group": run[0]["entity"].split("-", 1)[-1],
                    "score": float(np.nanmean([u["score"] for u in run])), "word": text[start:end],
                    "start": start, "end": end})
    return out
