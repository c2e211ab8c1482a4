"""What the ONNX export keeps of a trained model's figures: `Embedder` (TensorFlow) beside `kbert.export_onnx`'s
float32 and int8 graphs on ONNX Runtime, in one run.

    python benchmarks/onnx_quality.py --shared ../shared/data
    python benchmarks/onnx_quality.py --shared ../shared/data --model DIR   # your own bi-encoder dir

Without --model the script trains one: a 16,000-piece unigram vocabulary on movie reviews and KorSTS train, a
random bert-mini (4 layers, 256 wide), `kbert.finetune(task="sentence-embedding")` on KorSTS train for
--epochs with no dev set (nothing is selected on a reported set). Reported, never tuned on: KorSTS dev
Spearman, and question-pair dev retrieval as `benchmarks/quality.py` scores it (each non-identical
paraphrase's first question against every distinct second question of the split: recall@1, recall@10,
MRR@10). Beside them: each side's largest difference and lowest cosine against the Embedder's vectors,
the graph file's size and sentences/s on the dev sentences (batch 64, best of 2).
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


def train_model(shared: str, work: str, epochs: float) -> str:
    import csv
    import gzip

    import kbert
    from quality import read_sts

    sts_train = read_sts(os.path.join(shared, "korsts", "sts-train.tsv"))
    with gzip.open(os.path.join(shared, "movie-reviews", "reviews.tsv.gz"), "rt", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        texts = [r["text"] for _, r in zip(range(40000), reader) if r["text"].strip()]
    texts += [r[c] for r in sts_train for c in ("sentence1", "sentence2")]
    tok = kbert.Tokenizer.train(texts, vocab_size=16000, progress=False)
    cfg = kbert.ModelConfig.preset("bert-mini", vocab_size=tok.vocab_size, max_position=128)
    base = kbert.save_model(kbert.BertBackbone(cfg), os.path.join(work, "base"), tokenizer=tok)
    out = os.path.join(work, "sts")
    kbert.finetune(base, "sentence-embedding", sts_train, out_dir=out, text_column="sentence1",
                   pair_column="sentence2", label_column="score", epochs=epochs, learning_rate=5e-4,
                   max_length=64, progress=True)
    return out


def figures(emb, shared: str) -> dict:
    from kbert.train.metrics import spearman
    from quality import read_sts
    from quantize import question_pair_retrieval, rank_metrics

    queries, candidates, gold = question_pair_retrieval(shared)
    c_vectors = emb.encode(candidates, progress=False)
    retrieval = rank_metrics(queries, candidates, gold,
                             lambda q: emb.search(emb.encode(q, progress=False), c_vectors, top_k=10))
    sts_dev = read_sts(os.path.join(shared, "korsts", "sts-dev.tsv"))
    a = emb.encode([r["sentence1"] for r in sts_dev], progress=False)
    b = emb.encode([r["sentence2"] for r in sts_dev], progress=False)
    return {"sts": spearman(np.sum(a * b, axis=1), [float(r["score"]) for r in sts_dev]), **retrieval,
            "vectors": np.concatenate([a, b, c_vectors])}


def throughput(emb, texts, repeats=2) -> float:
    emb.encode(texts[:64], progress=False)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        emb.encode(texts, batch_size=64, progress=False)
        best = min(best, time.perf_counter() - start)
    return len(texts) / best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shared", default=os.path.join("..", "shared", "data"))
    parser.add_argument("--model", help="a bi-encoder dir (default: train one, see above)")
    parser.add_argument("--epochs", type=float, default=2)
    args = parser.parse_args()
    warnings.simplefilter("ignore")

    import kbert
    from quality import read_sts

    from scratch import scratch_dir  # benchmarks/scratch.py: removed at exit
    work = scratch_dir(prefix="kbert-onnx-")
    model_dir = args.model or train_model(args.shared, work, args.epochs)
    sides = [("kbert Embedder.encode (TensorFlow)", kbert.Embedder.load(model_dir), None)]
    for quantize in (None, "int8"):
        out = kbert.export_onnx(model_dir, os.path.join(work, f"onnx-{quantize or 'float32'}"), quantize=quantize)
        sides.append((f"ONNX Runtime, {quantize or 'float32'}", kbert.OnnxEmbedder.load(out),
                      os.path.getsize(os.path.join(out, "model.onnx"))))
    sts_dev = read_sts(os.path.join(args.shared, "korsts", "sts-dev.tsv"))
    texts = [r[c] for r in sts_dev for c in ("sentence1", "sentence2")]
    print(f"model: {model_dir}\n")
    print("| side | KorSTS dev Spearman | QP recall@1 | QP recall@10 | QP MRR@10 | max \\|diff\\| | lowest cosine "
          "| graph MB | sentences/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    reference = None
    for name, emb, size in sides:
        f = figures(emb, args.shared)
        reference = f["vectors"] if reference is None else reference
        diff = float(np.abs(f["vectors"] - reference).max())
        cosine = float(np.min(np.sum(f["vectors"] * reference, axis=1)))
        mb = "-" if size is None else f"{size / 2**20:.1f}"
        print(f"| {name} | {f['sts']:.4f} | {f['recall@1']:.4f} | {f['recall@10']:.4f} | {f['mrr@10']:.4f} | "
              f"{diff:.1e} | {cosine:.5f} | {mb} | {throughput(emb, texts):,.0f} |", flush=True)


if __name__ == "__main__":
    main()
