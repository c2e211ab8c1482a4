"""Masked-token prediction and pseudo-log-likelihood: `kbert.MaskedLM` beside transformers on the same weights, in
one run, and what the pseudo-log-likelihood knows of Korean particles.

1. fill-mask: KorSTS dev sentences with one word replaced by the mask token; kbert's `fill_mask` and transformers'
   fill-mask pipeline (the model exported with `kbert.export_transformers`, both batching 32 texts): speed, and
   how many top-5 lists are the same tokens in the same order.
2. pseudo-log-likelihood: the same sentences whole; kbert's `pseudo_log_likelihood` and a transformers loop that
   scores every token masked in turn, batching the masked copies as mlm-scoring does: speed and the largest
   difference.
3. particle minimal pairs: UD Korean GSD dev sentences, each with one case or topic particle swapped for its
   other form (이/가, 을/를, 은/는, 과/와: the form is chosen by whether the syllable before it ends in a
   consonant, so the swap is always ungrammatical; particles come from the treebank's gold tags); the share of
   pairs whose original scores higher, for the model and for the same architecture with random weights.

    python benchmarks/fill_mask.py --model /path/to/kbert-pretrain/model [--sentences 500] [--pairs 500]

Without `--model` a random bert-mini with a vocabulary learned on the statutes is used (speed and agreement only).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from random_model import random_model  # noqa: E402  (benchmarks/random_model.py)
from treebank import conllu_sentences  # noqa: E402

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data")
SWAPS = {"이": "가", "가": "이", "을": "를", "를": "을", "은": "는", "는": "은", "과": "와", "와": "과"}
PARTICLE_TAGS = ("JKS", "JKO", "JX", "JC", "JKB")


def korsts_sentences(path: str, n: int):
    out = []
    with open(path, encoding="utf-8") as f:
        next(f)
        for line in f:
            for s in line.rstrip("\n").split("\t")[5:7]:
                s = " ".join(s.split())
                if len(s.split()) >= 4 and s not in out:
                    out.append(s)
        return out[:n]


def particle_pairs(path: str, n: int, seed: int = 0):
    """(original, particle swapped) sentence pairs from a CoNLL-U file: one eligible word a sentence, at random."""
    rng = np.random.default_rng(seed)
    pairs = []
    for words in conllu_sentences(path):
        spots = [i for i, (form, lemma, tag, _) in enumerate(words) if tag.split("+")[-1] in PARTICLE_TAGS
                 and lemma.split("+")[-1] in SWAPS and form.endswith(lemma.split("+")[-1]) and len(form) > 1]
        if not spots:
            continue
        k = spots[rng.integers(len(spots))]
        form = words[k][0]
        swapped = form[:-1] + SWAPS[form[-1]]
        text = "".join(f + ("" if no_space else " ") for f, _, _, no_space in words).strip()
        wrong = "".join((swapped if i == k else f) + ("" if no_space else " ")
                        for i, (f, _, _, no_space) in enumerate(words)).strip()
        pairs.append((text, wrong))
    return pairs[:n]


def hf_pseudo_log_likelihood(model, tok, texts, batch_size: int):
    """mlm-scoring's method with transformers: every token of every text masked in turn, the masked copies run
    in batches, log-softmax at the masked position."""
    import torch

    rows, owner, where, truth = [], [], [], []
    for i, t in enumerate(texts):
        ids = tok(t, truncation=True, max_length=512)["input_ids"]
        for j in range(1, len(ids) - 1):
            masked = list(ids)
            masked[j] = tok.mask_token_id
            rows.append(masked)
            owner.append(i)
            where.append(j)
            truth.append(ids[j])
    out = np.zeros(len(texts))
    order = np.argsort([len(r) for r in rows], kind="stable")
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            index = order[start:start + batch_size]
            width = max(len(rows[i]) for i in index)
            ids = torch.full((len(index), width), tok.pad_token_id)
            mask = torch.zeros((len(index), width), dtype=torch.long)
            for k, i in enumerate(index):
                ids[k, :len(rows[i])] = torch.tensor(rows[i])
                mask[k, :len(rows[i])] = 1
            logits = model(input_ids=ids, attention_mask=mask).logits  # [b, s, v]
            rows_at = logits[torch.arange(len(index)), torch.tensor([where[i] for i in index])]
            scores = torch.log_softmax(rows_at.double(), -1)[torch.arange(len(index)),
                                                             torch.tensor([truth[i] for i in index])]
            for i, s in zip(index, scores.tolist()):
                out[owner[i]] += s
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a model dir with its masked-LM head (default: random bert-mini)")
    parser.add_argument("--korsts", default=os.path.join(SHARED, "korsts", "sts-dev.tsv"))
    parser.add_argument("--treebank", default=os.path.join(SHARED, "ud-korean-gsd", "ko_gsd-ud-dev.conllu"))
    parser.add_argument("--sentences", type=int, default=500)
    parser.add_argument("--pairs", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    import transformers

    import kbert

    transformers.logging.set_verbosity_error()
    from scratch import scratch_dir  # benchmarks/scratch.py: removed at exit
    tmp = scratch_dir()
    model_dir = args.model or random_model(os.path.join(tmp, "model"), heads=True)
    lm = kbert.MaskedLM.load(model_dir)
    hf_dir = kbert.export_transformers(lm.model, os.path.join(tmp, "hf"), tokenizer=lm.tokenizer)
    hf = transformers.AutoModelForMaskedLM.from_pretrained(hf_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    pipe = transformers.pipeline("fill-mask", model=hf, tokenizer=tok)
    config = lm.model.config
    print(f"model {args.model or 'random bert-mini'}: {config.num_layers} layers, {config.hidden_size} wide, "
          f"{config.vocab_size:,} pieces ({lm.tokenizer.kind}); torch {torch.__version__} with "
          f"{torch.get_num_threads()} threads")

    rng = np.random.default_rng(args.seed)
    sentences = korsts_sentences(args.korsts, args.sentences)
    masked = []
    for s in sentences:
        words = s.split()
        k = int(rng.integers(1, len(words)))
        masked.append(" ".join(lm.mask_token if i == k else w for i, w in enumerate(words)))

    lm.fill_mask(masked[:8], batch_size=args.batch_size)  # warm-up: first calls build the functions
    pipe(masked[:8], top_k=5, batch_size=args.batch_size)
    start = time.perf_counter()
    ours = lm.fill_mask(masked, top_k=5, batch_size=args.batch_size)
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    theirs = pipe(masked, top_k=5, batch_size=args.batch_size)
    theirs_s = time.perf_counter() - start
    same = sum([p["token"] for p in a] == [p["token"] for p in b] for a, b in zip(ours, theirs))
    diff = max(abs(p["score"] - q["score"]) for a, b in zip(ours, theirs) for p, q in zip(a, b))

    plain = sentences
    lm.pseudo_log_likelihood(plain[:4])
    start = time.perf_counter()
    pll = lm.pseudo_log_likelihood(plain, batch_size=64)
    pll_s = time.perf_counter() - start
    start = time.perf_counter()
    ref = hf_pseudo_log_likelihood(hf, tok, plain, 64)
    ref_s = time.perf_counter() - start
    tokens = sum(len(ids) for ids in lm.tokenizer.ids_batch(plain))

    print("\n| measure | kbert | transformers | kbert / transformers speed | agreement |")
    print("|---|---:|---:|---:|---|")
    print(f"| fill-mask, {len(masked)} sentences, top 5 | {len(masked) / ours_s:.1f} texts/s | "
          f"{len(masked) / theirs_s:.1f} texts/s | {theirs_s / ours_s:.2f}x | same top-5 tokens in order on "
          f"{same} of {len(masked)}; largest score difference {diff:.1e} |")
    print(f"| pseudo-log-likelihood, {len(plain)} sentences ({tokens:,} masked copies) | {tokens / pll_s:.0f} "
          f"tokens/s | {tokens / ref_s:.0f} tokens/s | {ref_s / pll_s:.2f}x | largest difference "
          f"{np.max(np.abs(pll - ref)):.1e} (sums of {tokens / len(plain):.1f} tokens on average) |")
    print(f"\npseudo-perplexity of the {len(plain)} KorSTS dev sentences: "
          f"{np.exp(-pll.sum() / tokens):.2f}")

    pairs = particle_pairs(args.treebank, args.pairs, args.seed)
    rows = [("this model", lm), ("the same architecture, random weights",
                                 kbert.MaskedLM(kbert.Pretrainer(kbert.build_backbone(config)), lm.tokenizer))]
    print(f"\n{len(pairs)} particle minimal pairs from {os.path.basename(args.treebank)} (e.g. "
          f"{pairs[0][0][:40]!r} / {pairs[0][1][:40]!r})")
    # a sum over more tokens is lower whatever the model knows, and the wrong form often splits into more pieces:
    # pairs whose two sides have as many tokens are the fair test (a random model is at 0.5 there)
    lengths = [(len(a), len(b)) for a, b in zip(lm.tokenizer.ids_batch([a for a, _ in pairs]),
                                                lm.tokenizer.ids_batch([b for _, b in pairs]))]
    even = np.array([a == b for a, b in lengths])
    print(f"| model | original scores higher, all {len(pairs)} pairs | of the {int(even.sum())} pairs with as many "
          f"tokens on each side | pseudo-perplexity of the originals |")
    print("|---|---:|---:|---:|")
    for name, model in rows:
        good = model.pseudo_log_likelihood([a for a, _ in pairs], batch_size=64)
        bad = model.pseudo_log_likelihood([b for _, b in pairs], batch_size=64)
        print(f"| {name} | {np.mean(good > bad):.3f} | {np.mean((good > bad)[even]):.3f} | "
              f"{model.pseudo_perplexity([a for a, _ in pairs]):.1f} |")


if __name__ == "__main__":
    main()
