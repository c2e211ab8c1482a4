"""Paraphrase mining and community detection: kbert's and sentence-transformers' on the same vectors, in one run.

    python benchmarks/paraphrase_mining.py --n 30000 --dim 256

The vectors: `--n` unit vectors of width `--dim` in groups around random centres (group sizes 1 to 60, spread
0.35 per dimension around the centre: each group a cloud of near-duplicates, most cosines across groups near 0),
as a collection of re-posted reviews gives. Neither function's time depends on where the vectors came from,
so no model runs. Both libraries get the same float32 array (sentence-transformers as a CPU torch tensor) and
their default settings (top 100 partners, 500,000 pairs; threshold 0.75 and groups of 10 or more, and a
second run with groups of 2 or more at 0.8). Each result is checked against the other: the same pairs with
scores within 1e-6, and the same groups in the same order, each with the same centre and members. Times are the best of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))


def clustered(n: int, dim: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    parts, total = [], 0
    while total < n:
        size = int(rng.integers(1, 61))
        parts.append(rng.normal(size=dim) + 0.35 * rng.normal(size=(size, dim)))
        total += size
    v = np.concatenate(parts)[:n]
    v = v[rng.permutation(n)]
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=30000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    from sentence_transformers.util import community_detection as st_groups
    from sentence_transformers.util import paraphrase_mining_embeddings as st_pairs

    import kbert
    from quantize import best_of

    v = clustered(args.n, args.dim, args.seed)
    tv = torch.tensor(v)
    print(f"{args.n} vectors of width {args.dim}; torch threads {torch.get_num_threads()}")
    print(f"{'function':<44} {'kbert s':>8} {'ST s':>8} {'ST / kbert':>10}  check")

    ours_s, ours = best_of(args.repeats, lambda: kbert.paraphrase_mining(None, v, progress=False))
    theirs_s, theirs = best_of(args.repeats, lambda: st_pairs(tv))
    scored = {(i, j): s for s, i, j in theirs}
    same = ({(i, j) for _, i, j in ours} == set(scored)
            and all(abs(s - scored[i, j]) < 1e-6 for s, i, j in ours))
    print(f"{'paraphrase_mining (top 100, 500,000 pairs)':<44} {ours_s:>8.2f} {theirs_s:>8.2f} "
          f"{theirs_s / ours_s:>10.2f}  {len(ours)} pairs, {'same' if same else 'DIFFERENT'}")

    for threshold, size in [(0.75, 10), (0.8, 2)]:
        ours_s, ours = best_of(args.repeats, lambda: kbert.community_detection(
            None, v, threshold=threshold, min_size=size, progress=False))
        theirs_s, theirs = best_of(args.repeats, lambda: st_groups(tv, threshold=threshold,
                                                                   min_community_size=size))
        # the same centres in the same order, each with the same members (members whose scores differ in
        # the last bit may come in the other order)
        same = [(g[0], set(g)) for g in ours] == [(int(g[0]), {int(i) for i in g}) for g in theirs]
        name = f"community_detection ({threshold}, min size {size})"
        print(f"{name:<44} {ours_s:>8.2f} {theirs_s:>8.2f} {theirs_s / ours_s:>10.2f}  "
              f"{len(ours)} groups of {sum(map(len, ours))}, {'same' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
