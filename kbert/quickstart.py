"""`kbert quickstart`: the whole chain on an embedded Korean corpus, offline, in a few minutes on a laptop CPU.

corpus (konlpy's constitution + bills, or --corpus PATH) -> SentencePiece vocabulary -> pretraining a tiny
BERT (masked LM + next-sentence prediction, token embeddings started from the corpus's co-occurrence
statistics) -> a model dir -> sentence nearest neighbours, word vectors and the words nearest a few frequent
words through `kbert.Embedder`. Every step is the public API a user would call.

With the co-occurrence start, 300 steps on the default corpus reach MLM accuracy 0.108 (random embeddings:
0.057), and the words nearest '정하는' are '법률이', '바에', '의하여' (random: '만6세', '없다', ...).
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


# Documents shorter than this on average are joined into full sequences: about the 64 tokens of a quickstart
# sequence, at a little over two characters a token on Korean text.
SHORT_DOCUMENT_CHARS = 150


def run(corpus_sources=("kolaw", "kobill"), out: str = "kbert-quickstart", steps: int = 300,
        vocab_size: int = 8000, seed: int = 0, progress: bool = True, format: Optional[str] = None) -> dict:
    """The four steps on `corpus_sources` read in `format` (kbert.data.corpus.FORMATS; None: from each file's
    name; "lines" for a file with a text per line, such as reviews or comments)."""
    from kbert.data.corpus import Corpus
    from kbert.embed.embedder import Embedder
    from kbert.train.loop import pretrain

    t0 = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    corpus = Corpus(list(corpus_sources), format=format)
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
    per_document = sum(len(s) for d in documents for s in d) / len(documents)
    join = per_document < SHORT_DOCUMENT_CHARS  # reviews, comments: half of each sequence would be padding
    if join:
        print(f"      the documents are short ({per_document:.0f} characters on average): consecutive ones are "
              f"joined until each fills a sequence (data.join_documents)")
    config = {"model": {"preset": "bert-tiny", "max_position": 128},
              "data": {"source": list(corpus_sources), "format": format, "tokenizer": tok_dir, "objective": "mlm+nsp",
                       "max_length": 64, "workers": 0, "shuffle_buffer": 1000, "join_documents": join},
              "optimizer": {"learning_rate": 2e-3, "warmup_steps": max(1, steps // 10)},
              # token embeddings start from the corpus's co-occurrence statistics (PPMI + SVD, seconds here):
              # with a few hundred steps, that is most of what the word and sentence vectors know
              "trainer": {"steps": steps, "batch_size": 32, "log_every": 10, "checkpoint_every": max(steps // 2, 1),
                          "embedding_init": "cooccurrence"},
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
    demo = next((t for t in pool if _plain_words(t)), pool[0])
    words = emb.encode_words(demo, unit="eojeol")
    print(f"  word vectors of {demo[:40]!r}: " + ", ".join(f"{w}[{s}:{e}]" for w, s, e, _ in words[:6]))
    for word, neighbours in word_neighbours(emb, pool):
        print(f"  words nearest {word!r}: " + ", ".join(f"{w} {score:.2f}" for w, score in neighbours))
    print(f"done in {time.perf_counter() - t0:.0f}s. Next: `kbert embed --model {summary['model_dir']} < texts.txt`, "
          f"or kbert.Embedder.load({summary['model_dir']!r})")
    return summary


def _plain_words(text: str) -> bool:
    """A sentence that shows word vectors well: 4-8 words, each starting with a Hangul syllable and of 2+
    characters (bills' lines such as '발 의 자 : 한선교' are spaced letters and names)."""
    words = text.split()
    return 4 <= len(words) <= 8 and all(len(w) >= 2 and "\uac00" <= w[0] <= "\ud7a3" for w in words)


def word_neighbours(emb, sentences, queries: int = 3, top_k: int = 5, min_count: int = 3):
    """Eojeol vectors averaged over their occurrences in `sentences` (contextual vectors from
    `Embedder.encode_words`); for the `queries` most frequent words of 3+ characters, the `top_k` nearest
    other words by cosine."""
    import numpy as np

    sums, counts = {}, {}
    for sentence in emb.encode_words(sentences, unit="eojeol"):
        for word, _, _, vector in sentence:
            word = word.strip(".,;:!?()[]「」\"'")
            if len(word) < 2:
                continue
            sums[word] = sums.get(word, 0) + vector
            counts[word] = counts.get(word, 0) + 1
    vocab = [w for w in sums if counts[w] >= min_count]
    if len(vocab) <= top_k:
        return []
    matrix = np.stack([sums[w] / counts[w] for w in vocab])
    matrix /= np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)
    frequent = sorted((w for w in vocab if len(w) >= 3), key=lambda w: (-counts[w], w))[:queries]
    out = []
    for word in frequent:
        scores = matrix @ matrix[vocab.index(word)]
        order = [i for i in np.argsort(-scores, kind="stable") if vocab[i] != word][:top_k]
        out.append((word, [(vocab[i], float(scores[i])) for i in order]))
    return out


def main_args(args) -> Optional[dict]:
    return run(args.corpus or ("kolaw", "kobill"), args.out, args.steps, args.vocab_size, args.seed,
               format=args.format)
