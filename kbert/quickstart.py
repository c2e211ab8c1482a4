"""`kbert quickstart`: the whole chain on an embedded Korean corpus, offline, in a few minutes on a laptop CPU.

corpus (konlpy's constitution + bills, or --corpus PATH) -> SentencePiece vocabulary -> pretraining a tiny
BERT (masked LM + next-sentence prediction) -> a model dir -> sentence nearest neighbours and word vectors
through `kbert.Embedder`. Every step is the public API a user would call.
"""

from __future__ import annotations

import os
import random
import re
import time
from typing import Optional


def _train_tokenizer(corpus, vocab_size: int):
    from kbert.text.tokenizer import Tokenizer

    try:
        return Tokenizer.train(corpus, vocab_size=vocab_size, progress=False)
    except ValueError as e:  # a small corpus supports fewer pieces: use the largest it allows
        m = re.search(r"at most (\d+)", str(e))
        if not m:
            raise
        return Tokenizer.train(corpus, vocab_size=int(m.group(1)), progress=False)


def run(corpus_sources=("kolaw", "kobill"), out: str = "kbert-quickstart", steps: int = 300,
        vocab_size: int = 8000, seed: int = 0, progress: bool = True) -> dict:
    from kbert.data.corpus import Corpus
    from kbert.embed.embedder import Embedder
    from kbert.train.loop import pretrain

    t0 = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    corpus = Corpus(list(corpus_sources))
    documents = list(corpus)
    print(f"[1/4] corpus {', '.join(corpus.sources)}: {corpus.report}")
    if not documents:
        raise ValueError(f"The corpus has no text: {corpus.report}")

    tok = _train_tokenizer(corpus, vocab_size)
    tok_dir = tok.save(os.path.join(out, "tokenizer"))
    sample = documents[0][min(3, len(documents[0]) - 1)]
    print(f"[2/4] {tok.kind} vocabulary of {tok.vocab_size:,} pieces -> {tok_dir}")
    print(f"      {sample[:40]!r} -> {tok.tokenize(sample[:40])}")

    print(f"[3/4] pretraining a tiny BERT (2 layers, 128 wide) for {steps} steps on this CPU")
    config = {"model": {"preset": "bert-tiny", "max_position": 128},
              "data": {"source": list(corpus_sources), "tokenizer": tok_dir, "objective": "mlm+nsp",
                       "max_seq_len": 64, "workers": 0, "shuffle_buffer": 1000},
              "optimizer": {"learning_rate": 2e-3, "warmup_steps": max(1, steps // 10)},
              "trainer": {"steps": steps, "batch_size": 32, "log_every": 10, "checkpoint_every": max(steps // 2, 1)},
              "runtime": {"strategy": "cpu", "seed": seed}, "output_dir": out}
    summary = pretrain(config, progress=progress)  # rerunning resumes (or finds the run already finished)
    if summary["history"]:
        print(f"      loss {summary['history'][0]:.2f} -> {summary['loss']:.2f}, MLM accuracy "
              f"{summary['mlm_accuracy']:.3f}, {summary['tokens_per_second']:,.0f} tokens/s; "
              f"model -> {summary['model_dir']}")
    else:
        print(f"      {out} already holds a finished run (delete it to start over); model -> {summary['model_dir']}")

    print("[4/4] embeddings with kbert.Embedder")
    emb = Embedder.load(summary["model_dir"])
    sentences = sorted({s for d in documents for s in d if 10 <= len(s) <= 120})
    rng = random.Random(seed)
    pool = rng.sample(sentences, min(len(sentences), 800))
    vectors = emb.encode(pool, pooling="mean", progress=False)
    for i in rng.sample(range(len(pool)), min(3, len(pool))):
        print(f"  {pool[i][:60]}")
        for j, score in emb.search(vectors[i], vectors, top_k=4)[0][1:]:
            print(f"     {score:.3f}  {pool[j][:60]}")
    words = emb.encode_words(pool[0], unit="eojeol")
    print(f"  word vectors of {pool[0][:40]!r}: " + ", ".join(f"{w}[{s}:{e}]" for w, s, e, _ in words[:6]))
    print(f"done in {time.perf_counter() - t0:.0f}s. Next: `kbert embed --model {summary['model_dir']} < texts.txt`, "
          f"or kbert.Embedder.load({summary['model_dir']!r})")
    return summary


def main_args(args) -> Optional[dict]:
    return run(args.corpus or ("kolaw", "kobill"), args.out, args.steps, args.vocab_size, args.seed)
