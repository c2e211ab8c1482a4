"""Sentence-embedding throughput (sentences/s, mean pooling, unit vectors, batch 64) on movie reviews:
kbert's `Embedder.encode` beside sentence-transformers on the same architecture and weights, and the
exported string-in SavedModel and the ONNX export on ONNX Runtime (float32 and int8 weights), in one run.

The model is bert-mini sized (4 layers, 256 hidden, 4 heads) with a WordPiece vocabulary learned on the
reviews; its weights go to sentence-transformers through `kbert.export_transformers` (tokenizer included),
so both sides tokenize identically and the vectors agree (the script prints the largest difference).
Throughput does not depend on the weights' values, so the model is randomly initialized.

    python benchmarks/embed.py --reviews ../shared/data/movie-reviews/reviews.tsv.gz --texts 10000
    KERAS_BACKEND=jax python benchmarks/embed.py ...     # Embedder on Keras' JAX backend (no SavedModel rows:
                                                          # the exports are traced through TensorFlow)
    python benchmarks/embed.py --architecture xlm-roberta --texts 3000   # multilingual-E5-small's shape

`--architecture xlm-roberta` measures the retrieval models most used for Korean (BGE-M3, KURE, multilingual
E5 are XLM-RoBERTa encoders) at multilingual-e5-small's shape (12 layers, 384 hidden, 12 heads): a transformers
XLMRobertaModel with random weights and a unigram SentencePiece model learned on the reviews, numbered as
XLM-RoBERTa's (the vocabulary is 8,002 rows instead of 250,002, which only changes the embedding table's size),
saved as a Hugging Face dir that both sides load: kbert through its XLM-RoBERTa reader, sentence-transformers
through transformers, each with its own tokenizer.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import os
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read_reviews(path, n, skip=0):
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for i, row in enumerate(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)):
            if i >= skip and row["text"].strip():
                out.append(row["text"])
                if len(out) == n:
                    break
    return out


def xlm_roberta_dir(texts, out, model_class="XLMRobertaModel", **overrides):
    """A Hugging Face XLM-RoBERTa dir of multilingual-e5-small's shape (random weights) whose
    `sentencepiece.bpe.model` is a unigram model learned on `texts` (SentencePiece's numbering <unk> <s> </s>,
    which transformers and kbert renumber as fairseq's dictionary). `model_class` / config `overrides`: e.g.
    a reranker's XLMRobertaForSequenceClassification with num_labels=1."""
    import io
    import json

    import sentencepiece as spm
    import torch
    import transformers

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=buf, vocab_size=8000,
                                   model_type="unigram", normalization_rule_name="nmt_nfkc", unk_id=0, bos_id=1,
                                   eos_id=2, pad_id=-1, minloglevel=2)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "sentencepiece.bpe.model"), "wb") as f:
        f.write(buf.getvalue())
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "XLMRobertaTokenizer", "model_max_length": 512}, f)
    config = transformers.XLMRobertaConfig(vocab_size=8002, hidden_size=384, num_hidden_layers=12,
                                           num_attention_heads=12, intermediate_size=1536,
                                           max_position_embeddings=514, pad_token_id=1, type_vocab_size=1,
                                           **overrides)
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).save_pretrained(out)


def timed(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reviews", default=os.path.join("..", "shared", "data", "movie-reviews", "reviews.tsv.gz"))
    parser.add_argument("--texts", type=int, default=10000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="best of N timed passes per side")
    parser.add_argument("--architecture", choices=("bert", "xlm-roberta"), default="bert",
                        help="bert: bert-mini with a WordPiece vocabulary (default); xlm-roberta: multilingual-e5-"
                             "small's shape with an XLM-RoBERTa SentencePiece vocabulary")
    args = parser.parse_args()

    import keras
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    import kbert

    from scratch import scratch_dir  # benchmarks/scratch.py: removed at exit
    work = scratch_dir(prefix="kbert-embed-bench-")
    texts = read_reviews(args.reviews, args.texts)
    print(f"{len(texts)} reviews, mean {np.mean([len(t) for t in texts]):.0f} chars; batch {args.batch_size}; "
          f"CPU threads: torch {torch.get_num_threads()}, os {os.cpu_count()}")
    kbert_dir, hf_dir = os.path.join(work, "kbert"), os.path.join(work, "hf")
    if args.architecture == "xlm-roberta":
        xlm_roberta_dir(read_reviews(args.reviews, 50000, skip=args.texts), hf_dir)
        kbert_dir = hf_dir  # kbert reads the Hugging Face dir as it is
        cfg = kbert.load_model(hf_dir).config
    else:
        tok = kbert.Tokenizer.train(read_reviews(args.reviews, 50000, skip=args.texts), vocab_size=8000,
                                    algorithm="wordpiece", progress=False)
        cfg = kbert.ModelConfig.preset("bert-mini", vocab_size=tok.vocab_size)
        backbone = kbert.BertBackbone(cfg)
        kbert.save_model(backbone, kbert_dir, tokenizer=tok)
        kbert.export_transformers(backbone, hf_dir, tokenizer=tok)
    print(f"{args.architecture}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocabulary {cfg.vocab_size}")

    emb = kbert.Embedder.load(kbert_dir)
    st = SentenceTransformer(modules=[Transformer(hf_dir, max_seq_length=cfg.max_position),
                                      Pooling(cfg.hidden_size, pooling_mode="mean")], device="cpu")
    on_tf = keras.backend.backend() == "tensorflow"
    if on_tf:
        import tensorflow as tf

        serve = tf.saved_model.load(kbert.export(kbert_dir, os.path.join(work, "serving"))).signatures["serving_default"]
        onnx = {kind: kbert.Embedder.load(kbert.export_onnx(kbert_dir, os.path.join(work, f"onnx-{kind}"),
                                                             quantize=None if kind == "float32" else kind))
                for kind in ("float32", "int8")}

    def run_kbert():
        return emb.encode(texts, batch_size=args.batch_size, progress=False)

    def run_st():
        return st.encode(texts, batch_size=args.batch_size, normalize_embeddings=True, convert_to_numpy=True)

    def run_savedmodel(order=None):
        order = np.arange(len(texts)) if order is None else order
        out = np.zeros((len(texts), cfg.hidden_size), np.float32)
        for i in range(0, len(texts), args.batch_size):
            index = order[i:i + args.batch_size]
            out[index] = serve(texts=tf.constant([texts[j] for j in index]))["embeddings"].numpy()
        return out

    by_length = np.argsort([len(t) for t in texts], kind="stable")  # what a batching client can do

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_kbert(), run_st()  # warm-up: graph tracing (JAX: compiling each bucketed shape), thread pools
        sides = [(f"kbert Embedder.encode ({keras.backend.backend()})", run_kbert), ("sentence-transformers", run_st)]
        if on_tf:
            serve(texts=tf.constant(texts[:args.batch_size]))
            sides += [("kbert SavedModel, batches in input order", run_savedmodel),
                      ("kbert SavedModel, batches sorted by text length", lambda: run_savedmodel(by_length))]
            for kind, model in onnx.items():  # OnnxEmbedder.encode: ONNX Runtime, kbert's Python tokenizer
                model.encode(texts[:args.batch_size])
                sides.append((f"kbert ONNX export on ONNX Runtime, {kind}",
                              lambda model=model: model.encode(texts, batch_size=args.batch_size, progress=False)))
        rows = []
        for name, fn in sides:
            seconds, vectors = timed(fn, args.repeats)
            rows.append((name, len(texts) / seconds, vectors))
    ref = rows[1][1]
    print("\n| side | sentences/s | vs sentence-transformers | max |diff| vs kbert |")
    print("|---|---:|---:|---:|")
    for name, speed, vectors in rows:
        diff = float(np.max(np.abs(vectors - rows[0][2])))
        print(f"| {name} | {speed:,.0f} | {speed / ref:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
