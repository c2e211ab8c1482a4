"""Static embedding models (`kbert.distill_static`) against Model2Vec and sentence-transformers, and against the
model they come from, in one run:

    python benchmarks/static.py --shared ../shared/data                         # speed, a random bert-base
    python benchmarks/static.py --shared ../shared/data --model /work/qs/emb-bi-encoder-seed0   # + quality

Speed (any model; without `--model` a random BERT-Base with a 16K unigram vocabulary trained on the KorSTS
sentences):
- distillation: `kbert.distill_static` (the model on kbert's backend) against Model2Vec's own steps on the same
  weights (`create_embeddings` on the transformers export with CPU torch, then its `apply_pca` and SIF weights);
- encoding the distinct KorSTS and question-pair sentences: kbert's StaticEmbedder, `model2vec.StaticModel` and
  `SentenceTransformer` on the same dir, and the transformer itself on a sample (its rate scaled up).

Quality (with `--model`, a trained model): issue 43's sets (`benchmarks/quality.py`'s `embedding_sets`) for TF-IDF,
the model, and its static distillation at several widths; the selection split picks the width, KorSTS dev and
question-pair dev are reported only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

WIDTHS = (256, 128, 64)  # below the model's width (its own width is always tried: rotated by PCA, not cut)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shared", default="../shared/data")
    parser.add_argument("--model", help="a trained model dir (default: a random bert-base, speed only)")
    parser.add_argument("--dim", type=int, default=256, help="the static width timed (default 256)")
    parser.add_argument("--sample", type=int, default=2000, help="sentences the transformer encodes for its rate")
    parser.add_argument("--max-length", type=int, default=64)
    args = parser.parse_args(argv)

    import numpy as np
    import quality
    import transformers
    from model2vec import StaticModel
    from model2vec.distill.inference import apply_pca, compute_weights, create_embeddings
    from sentence_transformers import SentenceTransformer

    import kbert

    sets = quality.embedding_sets(args.shared, os.devnull, 0, 0, False)
    sentences = sorted({r[c] for key in ("sts_fit", "sts_select", "sts_dev") for r in sets[key]
                        for c in ("sentence1", "sentence2")}
                       | {r[c] for key in ("qp_fit", "qp_select") for r in sets[key]
                          for c in ("question1", "question2")})
    from scratch import scratch_dir  # benchmarks/scratch.py: removed at exit
    work = scratch_dir(prefix="kbert-static-")
    if args.model:
        emb = kbert.Embedder.load(args.model, max_length=args.max_length)
        name = os.path.basename(os.path.normpath(args.model))
    else:
        tok = kbert.Tokenizer.train(sentences, vocab_size=16000, progress=False)
        cfg = kbert.ModelConfig.preset("bert-base", vocab_size=tok.vocab_size)
        emb = kbert.Embedder(kbert.BertBackbone(cfg, output_hidden_states=True), tok, max_length=args.max_length)
        name = "random bert-base"
    cfg = emb.backbone.config
    print(f"model: {name} ({cfg.num_layers} layers x {cfg.hidden_size}, vocabulary {emb.tokenizer.vocab_size}); "
          f"{len(sentences)} distinct sentences; {os.cpu_count()} CPUs")

    # --- distillation: kbert's against Model2Vec's steps on the same weights
    static, t_kbert = timed(lambda: kbert.distill_static(emb, dim=args.dim, progress=False))
    hf = os.path.join(work, "hf")
    kbert.export_transformers(emb.backbone, hf)
    tok = emb.tokenizer
    ids = [[tok.cls_id, i, tok.sep_id] for i in range(tok.vocab_size)]

    def model2vec_distill():
        model = transformers.AutoModel.from_pretrained(hf)
        table = create_embeddings(model, ids, device="cpu", pad_token_id=tok.pad_id, pooling="mean")
        return apply_pca(table.astype(np.float64), args.dim) * compute_weights(len(table), 1e-4)[:, None]

    reference, t_ref = timed(model2vec_distill)
    same = (emb.pooling, emb.layers) == ("mean", -1)  # Model2Vec pools the last layer's mean
    check = (f"largest difference of the tables {np.abs(reference - static.vectors).max():.2e}" if same else
             f"the tables differ by design: this model pools {emb.pooling} over layers {emb.layers}, kbert distils "
             f"with its own pooling, Model2Vec with the last layer's mean")
    print(f"\ndistillation to {args.dim} dims: kbert {t_kbert:.1f} s, Model2Vec's steps (torch) {t_ref:.1f} s: "
          f"{t_ref / t_kbert:.2f}x; {check}")

    # --- encoding: the same static dir through kbert, model2vec and sentence-transformers, and the model itself
    out = kbert.export_sentence_transformers(static, os.path.join(work, "static"))
    m2v, st = StaticModel.from_pretrained(out), SentenceTransformer(out, device="cpu")
    runs = [("kbert StaticEmbedder", lambda: static.encode(sentences, progress=False)),
            ("model2vec StaticModel", lambda: m2v.encode(sentences)),
            ("sentence-transformers StaticEmbedding", lambda: st.encode(sentences, batch_size=1024))]
    rates = {}
    for label, fn in runs:
        fn()  # warm: tokenizer caches, first allocations
        best = min(timed(fn)[1] for _ in range(3))
        rates[label] = len(sentences) / best
    sample = sentences[:args.sample]
    emb.encode(sample[:64], progress=False)
    rates[f"the model itself ({name}, {len(sample)} sentences)"] = len(sample) / timed(
        lambda: emb.encode(sample, progress=False))[1]
    print("\n| encoder | sentences/s | vs model2vec |\n|---|---:|---:|")
    for label, rate in rates.items():
        print(f"| {label} | {rate:,.0f} | {rate / rates['model2vec StaticModel']:.2f}x |")

    if not args.model:
        return
    # --- quality on issue 43's sets: the selection split picks the width; dev is reported only
    rows = [("TF-IDF char 1-3 cosine", quality.score_embeddings(quality.tfidf_encoder(sets), sets)),
            (f"{name} (the transformer)", quality.score_embeddings(lambda t: emb.encode(t, progress=False), sets))]
    statics = []
    for width in [cfg.hidden_size] + [w for w in WIDTHS if w < cfg.hidden_size]:
        model = kbert.distill_static(emb, dim=width, progress=False)
        statics.append((f"static, {width} dims",
                        quality.score_embeddings(lambda t, m=model: m.encode(t, progress=False), sets)))
    rows += statics
    best = max(statics, key=lambda s: s[1]["sts_select"])
    rows.append((f"static: the selection split's pick ({best[0].split(', ')[1]})", best[1]))
    quality.print_scores(rows)


if __name__ == "__main__":
    main()
