"""Whitening (`Embedder.fit_whitening`) on a model's untuned and fine-tuned vectors, beside the vectors as they
are and TF-IDF, on issue 43's sets, in one run:

    python benchmarks/whitening.py --shared ../shared/data --model /work/qw/pretrained --model /work/qw/emb-bi-encoder-seed0

Each `--model` dir is scored as `Embedder.load` reads it (mean pooling of the last layer, or a bi-encoder's own
pooling), with `first_last_avg` pooling beside it (BERT-whitening's paper whitens that one), and each of the two
whitened with every axis kept, 128 and 64. The whitening is fitted on the training side's sentences only (KorSTS
train less its selection part, the question-pair training questions less theirs: `benchmarks/quality.py`'s
`embedding_sets`). The selection split (KorSTS selection Spearman) picks each model's best setting; KorSTS dev
and question-pair dev (recall@1 of a paraphrase among the split's second questions) are reported, never chosen on.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

DIMS = (None, 128, 64)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shared", default="../shared/data")
    parser.add_argument("--model", action="append", required=True, help="a model dir (repeat for several)")
    parser.add_argument("--max-length", type=int, default=64)
    args = parser.parse_args(argv)

    import quality

    import kbert

    sets = quality.embedding_sets(args.shared, os.devnull, 0, 0, False)
    fit = sorted({r[c] for r in sets["sts_fit"] for c in ("sentence1", "sentence2")}
                 | {q for r in sets["qp_fit"] for q in (r["question1"], r["question2"])})
    print(f"whitening fitted on {len(fit)} training-side sentences")
    rows = [("TF-IDF char 1-3 cosine", quality.score_embeddings(quality.tfidf_encoder(sets), sets))]
    for model in args.model:
        name = os.path.basename(os.path.normpath(model))
        settings = []
        for pooling in (None, "first_last_avg"):
            for dim in (0,) + DIMS:  # 0: not whitened
                emb = kbert.Embedder.load(model, max_length=args.max_length)
                if dim != 0:
                    emb.fit_whitening(fit, dim=dim, pooling=pooling, progress=False)
                label = f"{name}, {pooling or emb.pooling} pooling, " + (
                    "as it is" if dim == 0 else f"whitened to {dim or emb.dimension}")

                def encode(texts, emb=emb, pooling=pooling):
                    return emb.encode(texts, pooling=pooling, progress=False)

                settings.append((label, quality.score_embeddings(encode, sets)))
                print(f"  {label}: {settings[-1][1]}", flush=True)
        best = max(settings, key=lambda s: s[1]["sts_select"])
        rows += settings
        rows.append((f"{name}: the selection split's pick ({best[0].split(', ', 1)[1]})", best[1]))
    quality.print_scores(rows)


if __name__ == "__main__":
    main()
