"""Long documents: `Embedder.encode(long_texts="mean")` (the mean of consecutive windows' vectors) and passages
(`kbert.split_documents`: whole sentences packed to `max_length`, one sentence of overlap; a decision scores as
its best passage, what `SearchIndex.search(..., group_by="document")` ranks by) beside truncation (the first
`max_length` tokens, what sentence-transformers does), as retrieval on Korean court decisions.

Each decision's issue summary (판시사항) is a query; the documents are the decisions' reasoning (the 판례내용
section, from 【이    유】 on: the court's argument, thousands of characters, with the summary and the
holding left out). A query should find its own decision's reasoning among all of them. No setting is tuned
here: each row is one fixed way of reading the documents with the same model. The queries are read whole
(`long_texts="mean"` at the model's max_length) in every row.

    python benchmarks/long_texts.py --precedents ../shared/data/korean-precedents/documents.jsonl.gz \
        --decisions 500 --model DIR [--lengths 64,256,512]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

SECTION = re.compile(r"^## (.+)$", re.M)


def decisions(path: str, n: int, min_chars: int = 1500):
    """(issue summary, reasoning) of the first `n` decisions that have both, the reasoning at least
    `min_chars` characters."""
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            heads = list(SECTION.finditer(text))
            sections = {h.group(1).strip(): text[h.end():(heads[i + 1].start() if i + 1 < len(heads) else None)]
                        for i, h in enumerate(heads)}
            issue, body = sections.get("판시사항", ""), sections.get("판례내용", "")
            start = body.find("【이    유】")
            if not issue.strip() or start < 0:
                continue
            reasoning = " ".join(body[start + len("【이    유】"):].split())
            if len(reasoning) >= min_chars:
                out.append((" ".join(issue.split()), reasoning))
                if len(out) == n:
                    break
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precedents", default=os.path.join("..", "shared", "data", "korean-precedents",
                                                             "documents.jsonl.gz"))
    parser.add_argument("--decisions", type=int, default=500)
    parser.add_argument("--model", required=True, help="a sentence-embedding model dir (kbert or Hugging Face)")
    parser.add_argument("--lengths", default="64,256,512", help="max_length settings to read the documents with")
    args = parser.parse_args()

    import warnings

    import kbert

    pairs = decisions(args.precedents, args.decisions)
    queries, docs = [q for q, _ in pairs], [d for _, d in pairs]
    emb = kbert.Embedder.load(args.model)
    lengths = [int(n) for n in args.lengths.split(",")]
    tokens = [len(ids) for ids in emb.tokenizer.ids_batch(docs)]
    print(f"{len(pairs)} decisions; reasoning {np.mean([len(d) for d in docs]):.0f} characters, "
          f"{np.mean(tokens):.0f} tokens on average (median {np.median(tokens):.0f}); model {args.model} "
          f"(max_length {emb.max_length})")
    # the queries read whole, in windows of the model's own max_length, the same for every row below
    q = emb.encode(queries, long_texts="mean", progress=False)
    print("\n| documents read as | max_length | recall@1 | recall@10 | MRR@10 | seconds |")
    print("|---|---:|---:|---:|---:|---:|")
    for length in lengths:
        for mode in ("truncate", "mean", "passages"):
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # truncation's own count
                if mode == "passages":  # each decision as passages, scored by its best one
                    parts = kbert.split_documents(docs, emb, max_tokens=length, overlap=1)
                    p = emb.encode(parts.texts, max_length=length, progress=False)
                    owner = np.array([m["document"] for m in parts.metadata])
                else:
                    d = emb.encode(docs, max_length=length, long_texts=mode, progress=False)
            seconds = time.perf_counter() - start
            if mode == "passages":  # what SearchIndex.search(..., group_by="document") ranks by (tested equal)
                scores = np.full((len(q), len(docs)), -np.inf, np.float32)
                for j in range(len(docs)):
                    scores[:, j] = (q @ p[owner == j].T).max(axis=1)
            else:
                scores = q @ d.T
            rank = (scores > scores[np.arange(len(q)), np.arange(len(q))][:, None]).sum(axis=1)  # 0 = first
            r1, r10 = np.mean(rank == 0), np.mean(rank < 10)
            mrr = np.mean(np.where(rank < 10, 1.0 / (rank + 1), 0.0))
            name = {"truncate": "first tokens (truncate)", "mean": "mean of windows",
                    "passages": "passages of whole sentences, the best one"}[mode]
            print(f"| {name} | {length} | {r1:.3f} | {r10:.3f} | {mrr:.3f} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
