"""Searching SPLADE vectors: `kbert.SparseIndex.search` beside sentence-transformers' `util.semantic_search` on
sparse tensors (what `SparseEncoder` users call without a search engine) and a dense NumPy product, on the same
vectors, in one run: queries a second, and how often the 10 hits agree.

The documents are movie reviews (../shared/data/movie-reviews), the queries KorSTS dev sentences, both encoded once
with `kbert.SparseEncoder` (documents keep `--doc-dims` weights, queries `--query-dims`: what a SPLADE model with
its FLOPS penalty keeps). Timing is the search alone, every method given the same vectors; kbert's includes
reading each hit's record (id, text, metadata) from the index on disk.

    python benchmarks/sparse_index.py [--model SPLADE_DIR] [--documents 20000] [--queries 1000]

Without `--model` a random bert-mini (2,000 pieces) gives the vectors: their sparsity is set by the two
`--*-dims` options, so the search speed reads the same as a trained model's would at that sparsity, only the hits
mean nothing.
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from embed import timed  # noqa: E402  (benchmarks/embed.py: the best of n wall times)
from fill_mask import korsts_sentences  # noqa: E402  (benchmarks/fill_mask.py)
from random_model import random_model  # noqa: E402

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data")


def reviews(path: str, n: int):
    """The first `n` distinct non-blank review texts."""
    out, seen = [], set()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        next(f)
        for line in f:
            text = line.rstrip("\n").split("\t")[-1].strip()
            if text and text not in seen:
                seen.add(text)
                out.append(text)
                if len(out) == n:
                    break
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a SPLADE or masked-LM model dir (default: a random bert-mini)")
    p.add_argument("--documents", type=int, default=20_000)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--doc-dims", type=int, default=128, help="weights kept a document (max_active_dims)")
    p.add_argument("--query-dims", type=int, default=32, help="weights kept a query")
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--shared", default=SHARED)
    args = p.parse_args(argv)

    import torch
    from sentence_transformers.util import dot_score, semantic_search

    import kbert

    torch.set_num_threads(os.cpu_count() or 1)
    from scratch import scratch_dir  # benchmarks/scratch.py: removed at exit
    tmp = scratch_dir()
    model_dir = args.model or random_model(os.path.join(tmp, "model"), heads=True)
    docs = reviews(os.path.join(args.shared, "movie-reviews", "reviews.tsv.gz"), args.documents)
    queries = korsts_sentences(os.path.join(args.shared, "korsts", "sts-dev.tsv"), args.queries)
    enc = kbert.SparseEncoder.load(model_dir)
    index = kbert.SparseIndex.build(enc, docs, os.path.join(tmp, "index"), max_active_dims=args.doc_dims,
                                    batch_size=16)
    q = enc.encode_query(queries, max_active_dims=args.query_dims, progress=True)
    d = index.matrix
    print(f"{d.shape[0]:,} documents ({d.getnnz() / d.shape[0]:.0f} weights each), {q.shape[0]:,} queries "
          f"({q.getnnz() / q.shape[0]:.0f} each), vocabulary {d.shape[1]:,}; model {model_dir}; torch "
          f"{torch.__version__} on {torch.get_num_threads()} threads; top {args.top_k}")

    def coo(m):
        m = m.tocoo()
        return torch.sparse_coo_tensor(np.vstack([m.row, m.col]), m.data, m.shape).coalesce()

    q_t, d_t = coo(q), coo(d)
    k = args.top_k

    def st():
        return [[h["corpus_id"] for h in row] for row in semantic_search(q_t, d_t, top_k=k, score_function=dot_score)]

    def kb():
        return [[h.id for h in row] for row in index.search(q, top_k=k)]

    dense_q, dense_d = q.toarray(), d.toarray()

    def dense():
        scores = dense_q @ dense_d.T  # [queries, documents]
        best = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(scores, best, axis=1), axis=1, kind="stable")
        return np.take_along_axis(best, order, axis=1).tolist()

    # the document vectors' memory: COO keeps two int64 indices a weight, CSR one int32 index, dense every zero
    memory = {"coo": d.getnnz() * (2 * 8 + 4), "dense": dense_d.nbytes,
              "csr": d.data.nbytes + d.indices.nbytes + d.indptr.nbytes}
    rows = []
    for name, fn, kind in (("sentence-transformers util.semantic_search (sparse COO)", st, "coo"),
                           ("NumPy dense product + argpartition", dense, "dense"),
                           ("kbert.SparseIndex.search (CSR)", kb, "csr")):
        fn()  # first-call allocations
        t, hits = timed(fn, 3)
        rows.append((name, t, hits, memory[kind]))
    t_ref, ref = rows[0][1], rows[0][2]
    width = max(len(r[0]) for r in rows)
    print(f"{'':{width}}  queries/s   vs ST   same top-{k} set   document vectors")
    for name, t, hits, size in rows:
        same = np.mean([set(a) == set(b) for a, b in zip(hits, ref)])
        print(f"{name:{width}}  {len(queries) / t:9.1f}  {t_ref / t:5.2f}x  {same:12.1%}   {size / 2**20:10.1f} MiB")


if __name__ == "__main__":
    main()
