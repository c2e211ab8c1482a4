"""Segment pairs for BERT's next-sentence prediction (NSP) and ALBERT's sentence-order prediction (SOP).

The algorithm is google-research/bert's `create_instances_from_document`, done once per example (no
`dupe_factor`: masks are drawn later, in the graph, fresh every epoch):

- sentences of a document are gathered into a chunk until it reaches the target length (`max_length`
  minus the special tokens; with probability `short_seq_prob` a shorter random target, so the model also
  sees short inputs);
- the chunk is cut at a random sentence boundary into A and B;
  NSP: with probability 1/2 (always when the chunk is one sentence) B is replaced by text from another
  document of the same block (label 1 = random), and the unused sentences go back to the document;
  SOP: A and B are swapped with probability 1/2 (label 1 = swapped); a one-sentence chunk is cut inside
  the sentence;
  MLM only: the whole chunk is one segment (label 0);
- the longer segment is truncated first, from its front or back at random.

Sentences longer than the target are cut into pieces first, so a single very long line becomes several
segments instead of being thrown away.

`join_documents=True` first joins consecutive documents shorter than a full segment, in corpus order, until
the joined text fills one (a document that fills one alone stays as it is). It is for corpora of short
texts (reviews, comments, questions: one short document per line), where each example would otherwise be
one or two texts and mostly padding, and NSP would find no next sentence inside a one-sentence document (every
label "random"). The price is RoBERTa's FULL-SENTENCES one: context, and NSP's "next" pairs, may cross
from one text to the next. Output is a block of dense int32 arrays (one row per example):
`token_ids` ([CLS] A [SEP] B [SEP], padded with the pad id), `lengths`, `num_a` (tokens up to and
including the first [SEP]) and `pair_labels`.
"""

from __future__ import annotations

import numbers
import random
from typing import Dict, List, Sequence

import numpy as np

OBJECTIVES = ("mlm", "mlm+nsp", "mlm+sop")


def check_objective(objective: str) -> str:
    if objective not in OBJECTIVES:
        raise ValueError(f"`objective` must be one of {OBJECTIVES}. Received: objective={objective!r}")
    return objective


def check_max_length(max_length, objective: str) -> int:
    """`max_length` as an int when it leaves room for 2 tokens besides [CLS] and [SEP] (and the pair's second
    [SEP]), else a ValueError naming it."""
    least = 4 if objective == "mlm" else 5
    if isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral) or max_length < least:
        raise ValueError(f"`max_length` must be at least {least} for objective={objective!r}. "
                         f"Received: max_length={max_length!r}")
    return int(max_length)


def _split_long(doc: List[List[int]], limit: int) -> List[List[int]]:
    out = []
    for sentence in doc:
        if len(sentence) <= limit:
            out.append(sentence)
        else:
            out.extend(sentence[i:i + limit] for i in range(0, len(sentence), limit))
    return out


def _truncate_pair(a: List[int], b: List[int], max_tokens: int, rng: random.Random):
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def join_short_documents(docs: List[List[List[int]]], max_tokens: int) -> List[List[List[int]]]:
    """Consecutive documents (lists of sentences of ids) joined until each joined one holds `max_tokens`
    tokens; a document that holds them alone is kept apart (see the module docstring)."""
    out, joined, count = [], [], 0
    for doc in docs:
        size = sum(len(s) for s in doc)
        if size >= max_tokens:
            if joined:
                out.append(joined)
                joined, count = [], 0
            out.append(doc)
            continue
        joined, count = joined + doc, count + size
        if count >= max_tokens:
            out.append(joined)
            joined, count = [], 0
    if joined:
        out.append(joined)
    return out


def build_examples(documents: Sequence[List[List[int]]], objective: str, max_length: int, cls_id: int,
                   sep_id: int, pad_id: int, short_seq_prob: float = 0.1, seed: int = 0,
                   join_documents: bool = False) -> Dict[str, np.ndarray]:
    """Token-id documents (lists of sentences of ids) -> a block of examples (see the module docstring)."""
    check_objective(objective)
    pair = objective != "mlm"
    max_tokens = check_max_length(max_length, objective) - (3 if pair else 2)
    rng = random.Random(seed)
    docs = [d for d in (_split_long([s for s in doc if s], max(1, (max_tokens + 1) // 2 if pair else max_tokens))
                        for doc in documents) if d]
    if join_documents:
        docs = join_short_documents(docs, max_tokens)
    rows, labels, num_a = [], [], []
    for d, doc in enumerate(docs):
        target = max_tokens
        if rng.random() < short_seq_prob:
            target = rng.randint(2, max_tokens)
        chunk, length, i = [], 0, 0
        while i < len(doc):
            chunk.append(doc[i])
            length += len(doc[i])
            if i == len(doc) - 1 or length >= target:
                a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
                tokens_a = [t for s in chunk[:a_end] for t in s]
                tokens_b = [t for s in chunk[a_end:] for t in s]
                label = 0
                if not pair:
                    tokens_a, tokens_b = tokens_a + tokens_b, []
                elif objective == "mlm+nsp":
                    if (len(chunk) == 1 or rng.random() < 0.5) and len(docs) > 1:
                        label = 1
                        other = d
                        for _ in range(10):
                            other = rng.randrange(len(docs))
                            if other != d:
                                break
                        if other == d:
                            other = (d + 1) % len(docs)
                        random_doc = docs[other]
                        start = rng.randrange(len(random_doc))
                        tokens_b = []
                        for s in random_doc[start:]:
                            tokens_b.extend(s)
                            if len(tokens_b) >= target - len(tokens_a):
                                break
                        i -= len(chunk) - a_end  # the unused sentences go back to the document
                else:  # sop
                    if not tokens_b and len(tokens_a) >= 2:
                        cut = rng.randint(1, len(tokens_a) - 1)
                        tokens_a, tokens_b = tokens_a[:cut], tokens_a[cut:]
                    if rng.random() < 0.5:
                        tokens_a, tokens_b, label = tokens_b, tokens_a, 1
                _truncate_pair(tokens_a, tokens_b, max_tokens, rng)
                if tokens_a and (tokens_b or not pair):
                    ids = [cls_id] + tokens_a + [sep_id] + (tokens_b + [sep_id] if pair else [])
                    rows.append(ids)
                    num_a.append(len(tokens_a) + 2)
                    labels.append(label)
                chunk, length = [], 0
            i += 1
    n = len(rows)
    token_ids = np.full((n, max_length), pad_id, dtype=np.int32)
    lengths = np.zeros(n, dtype=np.int32)
    for r, ids in enumerate(rows):
        token_ids[r, :len(ids)] = ids
        lengths[r] = len(ids)
    return {"token_ids": token_ids, "lengths": lengths, "num_a": np.asarray(num_a, dtype=np.int32),
            "pair_labels": np.asarray(labels, dtype=np.int32)}


def concat_blocks(blocks: List[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    return {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}
