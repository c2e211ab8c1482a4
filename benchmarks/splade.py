"""SPLADE sparse vectors beside dense ones for Korean question retrieval, from one pretraining, in one run.

Rows (each fine-tuning on the same (question, paraphrase) training pairs, in-batch negatives, the same epochs,
batch and seeds; its best epoch kept by recall@1 on the selection split):

- TF-IDF character 1-3-grams (fitted on the training side), the lexical baseline;
- the pretrained model's masked-LM head read as SPLADE, untrained for retrieval (`kbert.SparseEncoder`);
- a dense bi-encoder (`task="sentence-embedding"`, mean pooling, cosine / temperature 0.05);
- SPLADE (`task="sparse-embedding"`: dot products, FLOPS penalties 5e-5 / 3e-5 times a scale the selection
  split picks);
- inference-free SPLADE (`inference_free=True`: the questions read a trained per-token table that starts at the
  documents' IDF, the paraphrases run the model; no FLOPS penalty on the queries, as sentence-transformers'
  recipe; the document penalty times a scale the selection split picks);
- the dense and SPLADE models' scores added after each is standardized per query (a hybrid of the two), over
  every candidate; then the same two models through `kbert.hybrid_search` over a `kbert.SearchIndex` and a
  `kbert.SparseIndex` of the candidates, as a user searches (each side proposes its first 100, the union is
  standardized; and reciprocal rank fusion).

Sets as `benchmarks/quality.py --only embeddings` cuts them: question-pair train paraphrases less a fixed 10%
selection part (`kbert.selection_split`), which picks each row's epoch and the learning rates; question-pair
validation is reported only (recall@1 of each question's paraphrase among every distinct second question of
the split). Recall@1 and the mean non-zero weights of a SPLADE vector are printed per row, the mean over seeds.

    python benchmarks/quality.py --shared ../shared/data --out OUT --steps 2500 --only embeddings --rows bi-encoder
    python benchmarks/splade.py --quality OUT [--seeds 3] [--epochs 4]

`--quality OUT`: a quality.py output dir (its pretraining/model, with the masked-LM head, and its text).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

from quality import embedding_sets, paraphrases, retrieval_recall, tfidf_encoder  # noqa: E402

LEARNING_RATES = (1e-4, 3e-4)  # each trained row tries both; the selection split picks one
# SPLADE's FLOPS penalties as multiples of sentence-transformers' SpladeLoss weights (5e-5 anchors, 3e-5
# documents), tried at the chosen learning rate: a weak masked-LM head starts with thousands of active tokens
PENALTY_SCALES = (1, 10, 100, 1000)
DENSE = {"pooling": "mean", "backbone_dropout": 0.0}  # the dense bi-encoder's settings (quality.py's bi-encoder's)


def standardized(scores: np.ndarray) -> np.ndarray:
    """Each query's row of scores as z-scores: dense cosines and SPLADE dot products on one scale."""
    return (scores - scores.mean(axis=1, keepdims=True)) / (scores.std(axis=1, keepdims=True) + 1e-9)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quality", required=True, help="a benchmarks/quality.py output dir (its pretraining)")
    p.add_argument("--shared", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))
    p.add_argument("--out", help="where the fine-tuned models and results go (default: QUALITY/splade)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=float, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args(argv)

    import kbert

    model_dir = os.path.join(args.quality, "pretraining", "model")
    out = args.out or os.path.join(args.quality, "splade")
    os.makedirs(out, exist_ok=True)
    sets = embedding_sets(args.shared, os.path.join(args.quality, "pretraining.txt"), 0, 0, False)
    train = [{"anchor": q, "positive": a} for q, a in paraphrases(sets["qp_fit"])]
    select_pairs = [{"anchor": q, "positive": a} for q, a in paraphrases(sets["qp_select"])]
    print(f"{len(train):,} training pairs, {len(select_pairs):,} selection pairs; model {model_dir}")

    def splade_encode(directory):
        enc = kbert.SparseEncoder.load(directory, max_length=64)
        active = []

        def encode(texts):
            v = enc.encode(texts)
            active.append(v.getnnz() / max(v.shape[0], 1))
            return v.toarray()
        return encode, active

    def dense_encode(directory):
        emb = kbert.Embedder.load(directory, max_length=64)
        return lambda texts: emb.encode(texts, progress=False)

    def free_first(directory):
        """Inference-free retrieval: the queries' table lookups against the documents' SPLADE vectors."""
        enc = kbert.SparseEncoder.load(directory, max_length=64)
        active = []

        def first(queries, candidates):
            documents = enc.encode_document(candidates)
            active.append(documents.getnnz() / max(documents.shape[0], 1))
            return np.asarray((enc.encode_query(queries) @ documents.T).argmax(axis=1)).reshape(-1)
        return first, active

    def figures(encode, active=None, first=None):
        return {"select": retrieval_recall(encode, sets["qp_select"], first),
                "dev": retrieval_recall(encode, sets["qp_dev"], first),
                **({"active_dims": float(np.mean(active))} if active else {})}

    def cached(name, fn):
        path = os.path.join(out, name + ".json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        start = time.time()
        result = dict(fn(), minutes=round((time.time() - start) / 60, 1))
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f)
        print(f"[{name}] {result}", flush=True)
        return result

    results = {"TF-IDF char 1-3": [cached("tfidf", lambda: figures(tfidf_encoder(sets)))],
               "masked-LM head as SPLADE, no fine-tuning": [
                   cached("zero-shot", lambda: figures(*splade_encode(model_dir)))]}
    chosen = {}  # kind -> the name of the settings the selection split picked on seed 0
    for kind, task in (("dense", "sentence-embedding"), ("splade", "sparse-embedding"),
                       ("inference-free", "sparse-embedding")):
        for seed in range(args.seeds):
            def tuned(lr, scale=1, kind=kind, task=task, seed=seed):
                name = f"{kind}-lr{lr:g}" + (f"-reg{scale:g}" if scale != 1 else "")
                directory = os.path.join(out, f"{name}-seed{seed}")
                options = dict(DENSE) if kind == "dense" else {
                    "query_regularizer_weight": 5e-5 * scale, "document_regularizer_weight": 3e-5 * scale}
                if kind == "inference-free":
                    options.update(inference_free=True, query_regularizer_weight=0.0)

                def run():
                    summary = kbert.finetune(model_dir, task, train, select_pairs, out_dir=directory,
                                             text_column="anchor", pair_column="positive", label_column=None,
                                             epochs=args.epochs, batch_size=args.batch_size, learning_rate=lr,
                                             max_length=64, patience=None, seed=seed, progress=False, **options)
                    if kind == "inference-free":
                        first, active = free_first(directory)
                        return {"best_step": summary["best_step"], **figures(None, active, first)}
                    made = splade_encode(directory) if kind == "splade" else (dense_encode(directory),)
                    return {"best_step": summary["best_step"], **figures(*made)}
                return dict(cached(f"{name}-seed{seed}", run), name=name, lr=lr, scale=scale)
            if seed == 0:  # settings picked by selection recall on seed 0 serve every seed
                best = max((tuned(lr) for lr in LEARNING_RATES), key=lambda r: r["select"])
                if kind != "dense":  # then the FLOPS penalty at that learning rate
                    best = max([best] + [tuned(best["lr"], k) for k in PENALTY_SCALES[1:]], key=lambda r: r["select"])
                chosen[kind] = best
                print(f"{kind}: {best['name']} chosen on the selection split", flush=True)
            best = chosen[kind]
            label = f"{kind} ({task}, lr {best['lr']:g}" + (f", FLOPS x{best['scale']:g}" if kind != "dense" else "")
            results.setdefault(label + ")", []).append(tuned(best["lr"], best["scale"]))

    def hybrid(seed):
        dense = dense_encode(os.path.join(out, f"{chosen['dense']['name']}-seed{seed}"))
        sparse, _ = splade_encode(os.path.join(out, f"{chosen['splade']['name']}-seed{seed}"))

        def first(queries, candidates):
            return np.argmax(standardized(dense(queries) @ dense(candidates).T)
                             + standardized(sparse(queries) @ sparse(candidates).T), axis=1)
        return {"select": retrieval_recall(None, sets["qp_select"], first),
                "dev": retrieval_recall(None, sets["qp_dev"], first)}
    results["dense + SPLADE, standardized scores added"] = [cached(f"hybrid-seed{k}", lambda k=k: hybrid(k))
                                                           for k in range(args.seeds)]

    def indexed(seed, fusion):
        """kbert.hybrid_search over a SearchIndex and a SparseIndex of each split's candidates (built afresh,
        in a temporary dir): each side proposes its first 100, the union is fused."""
        dirs = [os.path.join(out, f"{chosen[kind]['name']}-seed{seed}") for kind in ("dense", "splade")]

        def first(queries, candidates):
            tmp = tempfile.mkdtemp(dir=out)
            try:
                dense = kbert.SearchIndex.build(dirs[0], candidates, os.path.join(tmp, "dense"), progress=False)
                sparse = kbert.SparseIndex.build(dirs[1], candidates, os.path.join(tmp, "sparse"), progress=False)
                hits = kbert.hybrid_search(dense, sparse, queries, top_k=1, fusion=fusion, candidates=100)
            finally:
                shutil.rmtree(tmp)
            return np.array([found[0].id if found else -1 for found in hits])
        return {"select": retrieval_recall(None, sets["qp_select"], first),
                "dev": retrieval_recall(None, sets["qp_dev"], first)}
    for fusion, label in (("zscore", "standardized over the union"), ("rrf", "reciprocal ranks")):
        results[f"the same through kbert.hybrid_search (two indexes, 100 candidates a side, {label})"] = [
            cached(f"hybrid-index-{fusion}-seed{k}", lambda k=k, fusion=fusion: indexed(k, fusion))
            for k in range(args.seeds)]

    print(f"\n| question-pair retrieval (mean of {args.seeds} fine-tuning seeds) | selection recall@1 | "
          f"**dev recall@1** (reported only) | SPLADE active dims |\n|---|---:|---:|---:|")
    for label, runs in results.items():
        sel, dev = np.mean([r["select"] for r in runs]), np.mean([r["dev"] for r in runs])
        active = [r["active_dims"] for r in runs if "active_dims" in r]
        per_seed = " (" + ", ".join(f"{r['dev']:.3f}" for r in runs) + ")" if len(runs) > 1 else ""
        shown = f"{np.mean(active):.0f}" if active else ""
        print(f"| {label} | {sel:.4f} | {dev:.4f}{per_seed} | {shown} |")


if __name__ == "__main__":
    main()
