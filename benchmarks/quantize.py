"""Quantized sentence vectors: what int8 and binary keep of a model's retrieval and STS figures, and the
binary search beside sentence-transformers' on the same codes, in one run.

    python benchmarks/quantize.py --model /work/qe/pretrain-seed0/emb-weak-pairs-sts-seed0 --shared ../shared/data

Quality, on sets no choice here was made on: question-pair dev retrieval as `benchmarks/quality.py` scores it
(each non-identical paraphrase's first question against every distinct second question of the split:
recall@1, recall@10, MRR@10) and KorSTS dev Spearman. The corpus side is quantized; queries stay float, as
in `Embedder.search`. int8 ranges come from the training-side questions and KorSTS train sentences (never a
dev text). Binary is scored with rescoring (the float query against the candidates' bits, x1 and x4 the
candidates) and without (the share of bits that agree). For STS each pair's second sentence is the quantized
side: int8 by its bucket values' cosine, binary by the float first sentence against its bits (rescoring's
score) and by bits against bits.

Speed: `kbert.quantized_search` and sentence-transformers' `semantic_search_faiss` (exact) on the same ubinary
codes of `--corpus` synthetic unit vectors of the model's width (a search's time does not depend on the
values), 1,000 queries, top 10, rescoring x4; both through FAISS's binary flat index, and kbert's numpy
path too. The scores are checked equal rank by rank (rows with equal bits tie, and the two libraries order
ties differently). Then float32 exact search for scale.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))


def rank_metrics(queries, candidates, gold, search) -> dict:
    """recall@1, recall@10 and MRR@10 of `search(queries) -> [[(candidate index, score), ...]]`."""
    hits = search(queries)
    ranks = []
    for row, answer in zip(hits, gold):
        found = [j for j, _ in row]
        ranks.append(found.index(answer) + 1 if answer in found else None)
    return {"recall@1": float(np.mean([r == 1 for r in ranks])),
            "recall@10": float(np.mean([r is not None and r <= 10 for r in ranks])),
            "mrr@10": float(np.mean([1 / r if r is not None and r <= 10 else 0 for r in ranks]))}


def question_pair_retrieval(shared: str):
    """(queries, candidates, gold candidate index per query) of question-pair dev: each non-identical
    paraphrase's first question against every distinct second question of the split."""
    from quality import paraphrases, read_tsv

    dev = read_tsv(os.path.join(shared, "question-pair", "validation.txt"))
    candidates = sorted({r["question2"] for r in dev})
    where = {c: i for i, c in enumerate(candidates)}
    pairs = paraphrases(dev)
    return [q for q, _ in pairs], candidates, [where[p] for _, p in pairs]


def quality(model_dir: str, shared: str) -> list:
    import kbert
    from kbert.embed.quantize import dequantize_embeddings
    from kbert.train.metrics import spearman
    from quality import read_sts, read_tsv

    emb = kbert.Embedder.load(model_dir)
    queries, candidates, gold = question_pair_retrieval(shared)
    q_vectors = emb.encode(queries, progress=False)
    c_vectors = emb.encode(candidates, progress=False)
    train_qp = kbert.selection_split(read_tsv(os.path.join(shared, "question-pair", "train.txt")), "question1")[0]
    sts_train = read_sts(os.path.join(shared, "korsts", "sts-train.tsv"))
    calibration = sorted({r[c] for r in train_qp for c in ("question1", "question2")}
                         | {r[c] for r in sts_train for c in ("sentence1", "sentence2")})
    ranges = kbert.quantization_ranges(emb.encode(calibration, progress=False))
    sts_dev = read_sts(os.path.join(shared, "korsts", "sts-dev.tsv"))
    a = emb.encode([r["sentence1"] for r in sts_dev], progress=False)
    b = emb.encode([r["sentence2"] for r in sts_dev], progress=False)
    gold_sts = [float(r["score"]) for r in sts_dev]
    dim = a.shape[1]

    def unit(x):
        return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)

    rows = []

    def row(name, width_bytes, search, sts):
        rows.append(dict(precision=name, bytes=width_bytes, **rank_metrics(queries, candidates, gold, search),
                         sts=spearman(sts, gold_sts)))

    row("float32", 4 * dim, lambda q: emb.search(q_vectors, c_vectors, top_k=10), np.sum(a * b, axis=1))
    for precision in ("int8", "uint8"):
        codes = kbert.quantize_embeddings(c_vectors, precision, ranges=ranges)
        values = dequantize_embeddings(kbert.quantize_embeddings(b, precision, ranges=ranges), precision, ranges)
        row(precision, dim, lambda q: emb.search(q_vectors, codes, top_k=10, ranges=ranges),
            np.sum(a * unit(values), axis=1))
    bits = kbert.quantize_embeddings(c_vectors, "ubinary")
    b_bits = dequantize_embeddings(kbert.quantize_embeddings(b, "ubinary"), "ubinary", dim=dim)
    a_bits = dequantize_embeddings(kbert.quantize_embeddings(a, "ubinary"), "ubinary", dim=dim)
    for multiplier in (4, 1):
        row(f"ubinary, rescored x{multiplier}", (dim + 7) // 8,
            lambda q, m=multiplier: emb.search(q_vectors, bits, top_k=10, rescore_multiplier=m),
            np.sum(a * b_bits, axis=1))
    row("ubinary, Hamming only", (dim + 7) // 8,
        lambda q: emb.search(q_vectors, bits, top_k=10, rescore_multiplier=0), np.mean(a_bits == b_bits, axis=1))
    return rows


def best_of(n, fn):
    times, out = [], None
    for _ in range(n):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def speed(dim: int, corpus_size: int, n_queries: int = 1000, repeats: int = 3) -> list:
    import kbert
    from sentence_transformers.util.quantization import semantic_search_faiss

    rng = np.random.default_rng(0)
    corpus = rng.normal(size=(corpus_size, dim)).astype(np.float32)
    corpus /= np.linalg.norm(corpus, axis=1, keepdims=True)
    queries = corpus[rng.choice(corpus_size, n_queries, replace=False)] + 0.5 * rng.normal(size=(n_queries, dim)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    bits = kbert.quantize_embeddings(corpus, "ubinary")
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t_st, (st_hits, _) = best_of(repeats, lambda: semantic_search_faiss(
            queries, corpus_embeddings=bits, corpus_precision="ubinary", top_k=10, rescore_multiplier=4, exact=True))
    st_scores = np.array([[r["score"] for r in h] for h in st_hits])

    def same(hits):
        """The same scores, rank by rank (rows of equal bits tie, and the two order ties differently)."""
        return bool(np.allclose([[v for _, v in h] for h in hits], st_scores[:len(hits)], atol=1e-5))

    t_faiss, hits = best_of(repeats, lambda: kbert.quantized_search(queries, bits, 10, rescore_multiplier=4,
                                                                    index="faiss"))
    rows.append(dict(what="ubinary, rescored x4, FAISS binary flat", kbert=t_faiss, st=t_st, same=same(hits)))
    t_numpy, hits = best_of(1, lambda: kbert.quantized_search(queries[:100], bits, 10, rescore_multiplier=4))
    rows.append(dict(what="ubinary, rescored x4, numpy (100 queries)", kbert=t_numpy, st=None, same=same(hits)))
    t_float, _ = best_of(repeats, lambda: kbert.quantized_search(queries, corpus, 10))  # float32, for scale
    rows.append(dict(what="float32, exact (numpy)", kbert=t_float, st=None, same=None))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a sentence-embedding model dir")
    parser.add_argument("--shared", default="../shared/data")
    parser.add_argument("--corpus", type=int, default=1_000_000, help="synthetic corpus rows for the speed rows")
    args = parser.parse_args(argv)
    rows = quality(args.model, args.shared)
    print(f"\n{args.model}: question-pair dev retrieval (the corpus side quantized) and KorSTS dev\n")
    print("| corpus vectors | bytes a vector | recall@1 | recall@10 | MRR@10 | KorSTS dev Spearman |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['precision']} | {r['bytes']} | {r['recall@1']:.4f} | {r['recall@10']:.4f} | {r['mrr@10']:.4f} | "
              f"{r['sts']:.4f} |")
    dim = rows[0]["bytes"] // 4
    print(f"\nsearch time, {args.corpus:,} x {dim} unit vectors, 1,000 queries, top 10 (best of 3; seconds)\n")
    print("| search | kbert | sentence-transformers | kbert / ST | same scores as ST |")
    print("|---|---:|---:|---:|---|")
    for r in speed(dim, args.corpus):
        ratio = f"{r['kbert'] / r['st']:.2f}" if r["st"] else ""
        st = f"{r['st']:.3f}" if r["st"] else ""
        print(f"| {r['what']} | {r['kbert']:.3f} | {st} | {ratio} | {'' if r['same'] is None else r['same']} |")


if __name__ == "__main__":
    main()
