"""Korean entity spans: span-labelled tagging beside word-tag tagging on the same backbone, and `TaskModel.entities`
beside transformers' token-classification pipeline on the same weights, in one run.

The task: proper nouns of UD Korean GSD (the treebank's gold morphemes: a word's leading NNP morphemes, e.g.
중국 in 중국으로, 히틀러 in 히틀러의), an entity that usually ends inside its word, before a particle.
- spans: `kbert.finetune(..., "tagging")` on `[start, end, "NNP"]` character spans: every token trains on its BIO
  tag, entities are read back token by token (aggregation "simple").
- word tags: the same rows as one tag per whitespace word (B-NNP for a word that starts with a proper noun):
  kbert's word-level tagging, read word by word (aggregation "first"); its entities include the particle.
Train on GSD test (a fixed tenth of it held out as the dev split that picks the checkpoint), report exact-span
F1 on GSD dev once; nothing is tuned on it. Then the span model, exported with `kbert.export_transformers`, runs
in transformers' pipeline on the same sentences: speed ratio and whether every entity agrees.

    python benchmarks/entities.py --model /path/to/kbert-pretrain/model [--epochs 10] [--learning-rate 1e-3]

Without `--model` a random bert-mini is used (agreement and speed only; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from random_model import random_model  # noqa: E402  (benchmarks/random_model.py)
from treebank import conllu_sentences  # noqa: E402

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data")


def treebank_rows(path: str):
    """(text, proper-noun spans, one tag per whitespace word) per sentence of a CoNLL-U file."""
    out = []
    for words in conllu_sentences(path):
        text, spans, tags = "", [], []
        for form, lemma, xpos, no_space in words:
            stem = ""
            for part, kind in zip(lemma.split("+"), xpos.split("+")):
                if kind != "NNP":
                    break
                stem += part
            start = len(text)
            if stem and form.startswith(stem):
                spans.append([start, start + len(stem), "NNP"])
            text += form + ("" if no_space else " ")
        text = text.rstrip()
        # word tags: whitespace words of the text, B-NNP where one starts with a proper noun
        at = 0
        starts = {s for s, _, _ in spans}
        for word in text.split(" "):
            tags.append("B-NNP" if at in starts else "O")
            at += len(word) + 1
        out.append((text, spans, tags))
    return out


def span_f1(gold, found) -> float:
    hits = sum(len({(s, e) for s, e, _ in g} & {(x["start"], x["end"]) for x in f}) for g, f in zip(gold, found))
    n = sum(map(len, gold)) + sum(map(len, found))
    return 2 * hits / n if n else 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a pretrained kbert model dir (default: random bert-mini)")
    parser.add_argument("--train", default=os.path.join(SHARED, "ud-korean-gsd", "ko_gsd-ud-test.conllu"))
    parser.add_argument("--report", default=os.path.join(SHARED, "ud-korean-gsd", "ko_gsd-ud-dev.conllu"))
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    import transformers

    import kbert

    transformers.logging.set_verbosity_error()
    from scratch import scratch_dir  # benchmarks/scratch.py: removed at exit
    tmp = scratch_dir()
    model_dir = args.model or random_model(os.path.join(tmp, "model"))
    rows = treebank_rows(args.train)
    report = treebank_rows(args.report)
    cut = len(rows) // 10
    train, dev = rows[cut:], rows[:cut]
    print(f"train {len(train)} sentences ({sum(len(s) for _, s, _ in train)} proper nouns), dev {len(dev)} "
          f"(picks the checkpoint), report {len(report)} ({sum(len(s) for _, s, _ in report)} proper nouns); "
          f"model {args.model or 'random bert-mini'}")
    inside = sum(e < len(t) and t[e] != " " for t, s, _ in report for _, e, _ in s)
    print(f"{inside} of the reported proper nouns end inside their word (a particle or suffix follows)")

    settings = dict(epochs=args.epochs, learning_rate=args.learning_rate, max_length=256, progress=False,
                    batch_size=args.batch_size)
    results = {}
    for name, label in (("spans", 1), ("word tags", 2)):
        out = os.path.join(tmp, name.replace(" ", "-"))
        start = time.perf_counter()
        summary = kbert.finetune(model_dir, "tagging", [{"text": r[0], "label": r[label]} for r in train],
                                 [{"text": r[0], "label": r[label]} for r in dev], out_dir=out, **settings)
        tagger = kbert.TaskModel.load(out)
        found = tagger.entities([r[0] for r in report])
        results[name] = (tagger, found)
        words = [[[a, a + len(w), "NNP"] for a, w in _words(t) if a in {s for s, _, _ in spans}]
                 for t, spans, _ in report]
        print(f"{name}: dev {summary['metric']} {summary['best']:.3f}; report: exact-span F1 "
              f"{span_f1([r[1] for r in report], found):.3f}, whole-word F1 {span_f1(words, found):.3f} "
              f"({time.perf_counter() - start:.0f} s)")

    tagger, ours = results["spans"]
    hf_dir = kbert.export_transformers(tagger, os.path.join(tmp, "hf"))
    pipe = transformers.pipeline("token-classification", model=hf_dir, aggregation_strategy="simple")
    texts = [r[0] for r in report]
    tagger.entities(texts[:8])
    pipe(texts[:8], batch_size=args.batch_size)
    start = time.perf_counter()
    ours = tagger.entities(texts, batch_size=args.batch_size)
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    theirs = pipe(texts, batch_size=args.batch_size)
    theirs_s = time.perf_counter() - start
    def spans(found, text, trim=False):  # trim: drop the whitespace a span starts with
        out = []
        for e in found:
            start = e["start"] + (len(text[e["start"]:e["end"]]) - len(text[e["start"]:e["end"]].lstrip()) if trim
                                  else 0)
            out.append((start, e["end"], e["entity_group"]))
        return out

    same = sum(spans(a, t) == spans(b, t) for t, a, b in zip(texts, ours, theirs))
    trimmed = sum(spans(a, t) == spans(b, t, trim=True) for t, a, b in zip(texts, ours, theirs))
    with_entities = sum(bool(a) for a in ours)
    diff = max((abs(e["score"] - float(f["score"])) for a, b in zip(ours, theirs) for e, f in zip(a, b)), default=0)
    print("\n| side | sentences/s | vs transformers | same entities |\n|---|---:|---:|---|")
    print(f"| kbert TaskModel.entities | {len(texts) / ours_s:.1f} | {theirs_s / ours_s:.2f}x | {same} of "
          f"{len(texts)} sentences ({with_entities} with entities); {trimmed} once the pipeline's spans lose the "
          f"space they start with; largest score difference {diff:.1e} |")
    print(f"| transformers pipeline, aggregation simple | {len(texts) / theirs_s:.1f} | 1.00x | |")
    for text, a, b in list(zip(texts, results["spans"][1], results["word tags"][1]))[:3]:
        print(f"\n{text}\n  spans:     {[e['word'] for e in a]}\n  word tags: {[e['word'] for e in b]}")


def _words(text: str):
    at = 0
    for word in text.split(" "):
        yield at, word
        at += len(word) + 1


if __name__ == "__main__":
    main()
