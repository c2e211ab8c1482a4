"""Semantic search over a large collection: kbert.SearchIndex's kinds beside sentence-transformers' exact search.

    python benchmarks/index.py --n 200000 --dim 256 --queries 1000

The collection: `--n` unit vectors of width `--dim` in groups around random centres (group sizes 1 to 60, spread
`--spread` per dimension around the centre; at the default 1.0 a group is a loose cloud whose members are as far
from each other as from the next group's, so a query's ten nearest are not simply its own group), and
`--queries` new points drawn around the same centres. No model runs: search time does not depend on where the
vectors came from (the recall of an approximate index does a little; tests/test_index.py checks it on other
vectors too).

Each row searches the same float32 arrays for each query's 10 nearest by cosine:
- sentence-transformers' `util.semantic_search` (exact, CPU torch: its default for a corpus of vectors), the
  reference every ratio is against;
- `kbert.SearchIndex.from_vectors` of each kind and precision (FAISS underneath), built once.
Columns: build seconds; all queries in one call (best of `--repeats`); one query at a time (the median over
`--single` queries, what a server answering one user sees); recall@10 against the exact neighbours; the index's
size on disk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))


def clustered(n: int, queries: int, dim: int, spread: float, seed: int):
    """(collection [n, dim], queries [queries, dim]) unit vectors around shared random centres."""
    rng = np.random.default_rng(seed)
    centres, sizes, total = [], [], 0
    while total < n:
        sizes.append(min(int(rng.integers(1, 61)), n - total))
        centres.append(rng.normal(size=dim))
        total += sizes[-1]
    centres = np.array(centres)
    owner = np.repeat(np.arange(len(sizes)), sizes)
    v = centres[owner] + spread * rng.normal(size=(n, dim))
    q = centres[rng.choice(owner, queries)] + spread * rng.normal(size=(queries, dim))
    unit = lambda x: (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)  # noqa: E731
    return unit(v[rng.permutation(n)]), unit(q)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--single", type=int, default=200, help="queries timed one at a time")
    parser.add_argument("--spread", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default="flat/float32,flat/int8,hnsw/float32,hnsw/int8,ivf/float32")
    args = parser.parse_args(argv)

    import faiss
    import torch
    from sentence_transformers.util import semantic_search

    import kbert
    from quantize import best_of

    v, q = clustered(args.n, args.queries, args.dim, args.spread, args.seed)
    tv, tq = torch.tensor(v), torch.tensor(q)
    k = 10
    print(f"{args.n} vectors of width {args.dim}, {args.queries} queries, spread {args.spread}; torch threads "
          f"{torch.get_num_threads()}, FAISS threads {faiss.omp_get_max_threads()}")

    batch_s, theirs = best_of(args.repeats, lambda: semantic_search(tq, tv, top_k=k))
    truth = [{h["corpus_id"] for h in row} for row in theirs]
    single = [timed(lambda i=i: semantic_search(tq[i:i + 1], tv, top_k=k))[0] for i in range(args.single)]
    ref_single = statistics.median(single)
    rows = [("sentence-transformers semantic_search (exact)", None, batch_s, ref_single, 1.0, args.n * args.dim * 4)]

    for spec in args.kinds.split(","):
        kind, precision = spec.split("/")
        build_s, index = timed(lambda: kbert.SearchIndex.from_vectors(v, kind=kind, precision=precision))
        batch, hits = best_of(args.repeats, lambda: index.search(q, top_k=k))
        recall = float(np.mean([len(t & {h.id for h in row}) / k for t, row in zip(truth, hits)]))
        one = statistics.median(timed(lambda i=i: index.search(q[i], top_k=k))[0] for i in range(args.single))
        with tempfile.TemporaryDirectory() as d:
            index.save(d)
            size = os.path.getsize(os.path.join(d, "index.faiss"))
        rows.append((f"kbert.SearchIndex {kind} {precision} ({index.info['factory']})", build_s, batch, one, recall,
                     size))

    print(f"\n| search | build s | {args.queries} queries, one call, s | x ST | one query, ms | x ST | "
          f"recall@10 | index MB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, build_s, batch, one, recall, size in rows:
        print(f"| {name} | {'' if build_s is None else f'{build_s:.1f}'} | {batch:.3f} | {batch_s / batch:.2f} | "
              f"{one * 1000:.2f} | {ref_single / one:.1f} | {recall:.4f} | {size / 2**20:.0f} |")


if __name__ == "__main__":
    main()
