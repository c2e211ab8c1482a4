"""SPLADE sparse vectors: `kbert.SparseEncoder` beside sentence-transformers' `SparseEncoder` on the same weights,
in one run: speed (texts a second, both batching 16 texts), the largest difference between their vectors, and
how many vectors have the same 10 heaviest tokens. kbert runs the model as a TensorFlow graph, through XLA, and
as its `kbert.export_onnx` graph on ONNX Runtime (float32 and int8).

The model is exported with `kbert.export_transformers` and wrapped the way sentence-transformers 6 builds a SPLADE
model (`Transformer(transformer_task="fill-mask")` + `SpladePooling("max")`), then saved; kbert loads that saved
dir. Texts: KorSTS dev sentences.

    python benchmarks/sparse.py [--model /path/to/kbert-pretrain/model] [--sentences 1000]

Without `--model` a random bert-mini with a vocabulary learned on the statutes is used (speed and agreement only).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from embed import timed  # noqa: E402  (benchmarks/embed.py: the best of n wall times)
from fill_mask import korsts_sentences  # noqa: E402  (benchmarks/fill_mask.py)
from random_model import random_model  # noqa: E402

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model dir with its masked-LM head (default: a random bert-mini)")
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--shared", default=SHARED)
    args = p.parse_args(argv)

    import torch
    from sentence_transformers import SparseEncoder as STSparseEncoder
    try:  # sentence-transformers >= 6.3's module paths; 6.0-6.2 have the older ones only
        from sentence_transformers.sentence_transformer.modules import Transformer
        from sentence_transformers.sparse_encoder.modules import SpladePooling
    except ImportError:
        from sentence_transformers.models import Transformer
        from sentence_transformers.sparse_encoder.models import SpladePooling

    import kbert

    torch.set_num_threads(os.cpu_count() or 1)
    texts = korsts_sentences(os.path.join(args.shared, "korsts", "sts-dev.tsv"), args.sentences)
    from scratch import scratch_dir  # benchmarks/scratch.py: removed at exit
    tmp = scratch_dir()
    model_dir = args.model or random_model(os.path.join(tmp, "model"), heads=True)
    lm = kbert.MaskedLM.load(model_dir)
    hf_dir = kbert.export_transformers(lm.model, os.path.join(tmp, "hf"), tokenizer=lm.tokenizer)
    st = STSparseEncoder(modules=[Transformer(hf_dir, transformer_task="fill-mask"), SpladePooling("max")],
                         device="cpu")
    st_dir = os.path.join(tmp, "st")
    st.save(st_dir)
    print(f"{len(texts)} KorSTS dev sentences; model {model_dir} (vocabulary {lm.tokenizer.vocab_size:,}); "
          f"torch {torch.__version__} on {torch.get_num_threads()} threads")

    def best_after_warm_up(fn):
        fn()  # compilation, first-call allocations
        t, out = timed(fn, 2)
        return out, t

    ref, t_ref = best_after_warm_up(lambda: st.encode(texts, batch_size=16).to_dense().numpy())
    rows = [("sentence-transformers SparseEncoder (torch)", ref, t_ref)]
    for name, jit in (("kbert.SparseEncoder (TensorFlow graph)", False), ("kbert.SparseEncoder (XLA)", True)):
        enc = kbert.SparseEncoder.load(st_dir, jit_compile=jit)
        got, t = best_after_warm_up(lambda: enc.encode(texts, batch_size=16).toarray())
        rows.append((name, got, t))
    for name, quantize in (("kbert.SparseEncoder (ONNX Runtime)", None), ("... ONNX Runtime, int8", "int8")):
        graph = kbert.export_onnx(st_dir, os.path.join(tmp, f"onnx-{quantize}"), quantize=quantize)
        enc = kbert.SparseEncoder.load(graph)  # an OnnxSparseEncoder
        got, t = best_after_warm_up(lambda: enc.encode(texts, batch_size=16).toarray())
        rows.append((name, got, t))
    width = max(len(r[0]) for r in rows)
    top = np.argsort(-ref, axis=1, kind="stable")[:, :10]
    print(f"{'':{width}}  texts/s   vs ST   max |diff|   same top-10   active dims")
    for name, vectors, t in rows:
        same = np.mean([set(a) == set(b) for a, b in zip(np.argsort(-vectors, axis=1, kind="stable")[:, :10], top)])
        print(f"{name:{width}}  {len(texts) / t:7.1f}  {t_ref / t:5.2f}x  {np.abs(vectors - ref).max():10.2e}   "
              f"{same:10.1%}   {np.mean((vectors > 0).sum(axis=1)):10.1f}")


if __name__ == "__main__":
    main()
