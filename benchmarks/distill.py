"""Distillation on this project's data (issue 41): a bert-mini teacher fine-tuned by kbert and its distilled
bert-tiny student, side by side in one run, beside the same student fine-tuned on the labels alone.

The teacher's backbone is the bert-mini that `benchmarks/quality.py` pretrains (pass its `--out` as
`--quality`; its pretraining text feeds the general distillation). Stages, each cached as OUT/<stage>.json
(rerun the command to continue an interrupted run):

1. teachers: sentiment (NSMC-style reviews, `--train` labelled rows, `--sentiment-epochs` epochs, 64
   tokens) and the KorSTS bi-encoder (cosine regression, all layers, 4 epochs), each keeping its best
   evaluation on a selection split cut from its own training data;
2. general distillation: bert-tiny (2 layers, 128 hidden) learns the pretrained bert-mini's masked-LM
   distribution and last-layer relations on `--general-lines` lines of the pretraining text; and, for the
   no-teacher references, the same bert-tiny pretrained by the teacher's own recipe (its config, text,
   tokenizer and step count; once per --quality dir, shared by the seeds);
3. sentiment student: task distillation of the sentiment teacher into that bert-tiny, on the labelled rows
   plus as many unlabelled reviews of the training movies (soft targets T=2, gold labels alpha=0.5), and with
   `--unlabelled N`, N more reviews of the training movies of any rating (the transfer set a user has: raw
   in-domain text, several times the labels);
   references: the same bert-tiny fine-tuned on the labelled rows alone (same epochs, same selection), from
   the plainly pretrained bert-tiny (no teacher at all) and from the general distillation (no task teacher);
4. KorSTS student: embedding distillation of the bi-encoder into that bert-tiny on KorSTS train sentences
   and review/statute lines, alone and then tuned on the KorSTS labels; references: the same bert-tiny
   fine-tuned as a bi-encoder on KorSTS train, from either starting point;
5. reported once: sentiment dev accuracy (movies never trained on) and KorSTS dev Spearman, and the
   throughput of `TaskModel.predict` / `Embedder.encode` on 4,000 dev reviews (batch 64; teacher and student
   timed alternately, best of 5 each), on the graph and with `jit_compile=True` (XLA; its shapes compiled in
   an untimed first pass).

    python benchmarks/distill.py --quality ~/.cache/kbert/quality --out ~/.cache/kbert/distill
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

# the same cache, selection rule and readers as the quality benchmark
from quality import dev_movie, read_sts, restore_dropout, stage  # noqa: E402


def timed(fn, repeats=3):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def more_reviews(path, exclude, n, seed):
    """`n` reviews (at most 140 characters, any rating) of the training movies, none of `exclude`, shuffled."""
    import csv
    import gzip

    texts = set()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
            text = (row.get("text") or "").strip()
            if 5 <= len(text) <= 140 and not dev_movie(row.get("movie_id")) and text not in exclude:
                texts.add(text)
    texts = sorted(texts)
    random.Random(seed).shuffle(texts)
    if len(texts) < n:
        sys.exit(f"--unlabelled {n}: only {len(texts):,} reviews of the training movies are left")
    return texts[:n]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quality", required=True, help="the --out dir of benchmarks/quality.py (its pretraining)")
    parser.add_argument("--shared", default=os.path.join("..", "shared", "data"))
    parser.add_argument("--out", default=os.path.join(os.path.expanduser("~"), ".cache", "kbert", "distill"))
    parser.add_argument("--train", type=int, default=60000, help="labelled sentiment rows (and as many unlabelled)")
    parser.add_argument("--general-lines", type=int, default=60000)
    parser.add_argument("--unlabelled", type=int, default=0,
                        help="more unlabelled reviews of the training movies (any rating) for task distillation")
    parser.add_argument("--student", default="bert-tiny")
    parser.add_argument("--sentiment-epochs", type=int, default=1,
                        help="epochs of the sentiment teacher and of the students tuned on the labels alone (each "
                             "keeps its best evaluation on the selection split, four per epoch)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    pre_json = os.path.join(args.quality, "pretraining.json")
    if not os.path.isfile(pre_json):
        parser.error(f"{pre_json} not found: run benchmarks/quality.py --out {args.quality} first (its pretraining)")
    with open(pre_json, encoding="utf-8") as f:
        teacher_base = json.load(f)["model_dir"]
    os.makedirs(args.out, exist_ok=True)

    import numpy as np

    import kbert
    from kbert.data.recipes import movie_review_sentiment

    reviews = os.path.join(args.shared, "movie-reviews", "reviews.tsv.gz")
    rows = movie_review_sentiment(reviews, "train", limit=2 * args.train + 4000, seed=args.seed)
    pool, select = kbert.selection_split(rows, "text")
    select = select[:2000]
    labelled, unlabelled = pool[:args.train], [r["text"] for r in pool[args.train:2 * args.train]]
    if args.unlabelled:
        unlabelled += more_reviews(reviews, {r["text"] for r in rows}, args.unlabelled, args.seed)
    dev = movie_review_sentiment(reviews, "dev", limit=10000, seed=args.seed)
    korsts = os.path.join(args.shared, "korsts")
    sts_all = read_sts(os.path.join(korsts, "sts-train.tsv"))
    sts_fit, sts_select = kbert.selection_split(sts_all, "sentence1")
    sts_dev = read_sts(os.path.join(korsts, "sts-dev.tsv"))
    path = lambda name: os.path.join(args.out, name)  # noqa: E731
    sentiment = dict(epochs=args.sentiment_epochs, batch_size=32, max_length=64, patience=None, seed=args.seed,
                     progress=True, eval_every=max(1, args.train // 32 // 4))
    sts = dict(text_column="sentence1", pair_column="sentence2", label_column="score", batch_size=32,
               max_length=64, patience=None, seed=args.seed, progress=True)

    def best_of(summary):  # with the stop fields: stage() refuses to cache a run a signal stopped
        return {k: summary[k] for k in ("best", "best_step", "steps", "checkpoint", "stopped_by")}

    # 1. teachers
    stage(args.out, "teacher-sentiment", lambda: best_of(kbert.finetune(
        teacher_base, "classification", labelled, select, out_dir=path("teacher-sentiment"), learning_rate=2e-4,
        **sentiment)))
    stage(args.out, "teacher-sts", lambda: best_of(kbert.finetune(
        teacher_base, "sentence-embedding", sts_fit, sts_select, out_dir=path("teacher-sts"), layers="all",
        epochs=4, learning_rate=2e-4, **sts)))

    # 2. general distillation of the pretrained teacher into the student
    with open(os.path.join(args.quality, "pretraining.txt"), encoding="utf-8") as f:
        lines = [x.strip() for x in f if 10 <= len(x.strip()) <= 300]
    random.Random(args.seed).shuffle(lines)
    general_dir = path("student-general")
    stage(args.out, "student-general", lambda: best_of(kbert.distill(
        teacher_base, args.student, data=lines[:args.general_lines], dev=lines[-2000:], out_dir=general_dir,
        epochs=1, batch_size=32, learning_rate=5e-4, max_length=64, seed=args.seed, progress=True)))

    # 2b. the same student with no teacher at all (TinyBERT's "BERT-tiny" row): pretrained by the teacher's own
    # recipe (its config: text, tokenizer, masked LM, batch 32 x 64 tokens, as many steps), then tuned on the
    # labels. Seed-independent like the teacher's pretraining, so it lives in the --quality dir.
    plain_dir = os.path.join(args.quality, f"pretraining-{args.student}")

    def pretrain_plain():
        with open(os.path.join(os.path.dirname(teacher_base), "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        config["model"]["preset"] = args.student
        config["output_dir"] = plain_dir
        start = time.time()
        summary = kbert.pretrain(config, progress=True)
        if not summary["finished"]:  # SIGINT/SIGTERM: the checkpoint is saved; a rerun resumes from it
            sys.exit(f"pretraining of {args.student} stopped at step {summary.get('step')}; rerun to resume")
        restore_dropout(summary["model_dir"])
        return {"steps": config["trainer"]["steps"], "model_dir": summary["model_dir"],
                "minutes": round((time.time() - start) / 60, 1), "final_mlm_accuracy": summary["mlm_accuracy"]}

    plain_base = stage(args.quality, f"pretraining-{args.student}", pretrain_plain)["model_dir"]

    # 3. sentiment: distilled vs the same student on the labels alone
    stage(args.out, "student-sentiment-distilled", lambda: best_of(kbert.distill(
        path("teacher-sentiment"), general_dir, data=unlabelled, train=labelled, dev=select,
        out_dir=path("student-sentiment-distilled"), temperature=2.0, alpha=0.5, learning_rate=5e-4,
        epochs=1, batch_size=32, max_length=64, seed=args.seed, progress=True,
        eval_every=max(1, 2 * args.train // 32 // 4))))
    stage(args.out, "student-sentiment-direct", lambda: best_of(kbert.finetune(
        general_dir, "classification", labelled, select, out_dir=path("student-sentiment-direct"),
        learning_rate=5e-4, **sentiment)))

    stage(args.out, "student-sentiment-plain", lambda: best_of(kbert.finetune(
        plain_base, "classification", labelled, select, out_dir=path("student-sentiment-plain"),
        learning_rate=5e-4, **sentiment)))

    # 4. KorSTS: embedding distillation vs the same student's own bi-encoder
    texts = sorted({r[c] for r in sts_fit for c in ("sentence1", "sentence2")}) + lines[:20000]
    stage(args.out, "student-sts-distilled", lambda: best_of(kbert.distill(
        path("teacher-sts"), general_dir, data=texts, dev=sts_select, out_dir=path("student-sts-distilled"),
        mode="embedding", text_column="sentence1", pair_column="sentence2", label_column="score", epochs=2,
        batch_size=64, learning_rate=5e-4, max_length=64, seed=args.seed, progress=True)))
    stage(args.out, "student-sts-direct", lambda: best_of(kbert.finetune(
        general_dir, "sentence-embedding", sts_fit, sts_select, out_dir=path("student-sts-direct"), layers="all",
        epochs=4, learning_rate=5e-4, **sts)))

    stage(args.out, "student-sts-plain", lambda: best_of(kbert.finetune(
        plain_base, "sentence-embedding", sts_fit, sts_select, out_dir=path("student-sts-plain"), layers="all",
        epochs=4, learning_rate=5e-4, **sts)))

    # the distilled bi-encoder then tuned on the KorSTS labels (TinyBERT's task stage after distillation):
    # the fair match for the labels-alone student, which sees the same labels
    stage(args.out, "student-sts-distilled-tuned", lambda: best_of(kbert.finetune(
        path("student-sts-distilled"), "sentence-embedding", sts_fit, sts_select,
        out_dir=path("student-sts-distilled-tuned"), layers="all", epochs=4, learning_rate=5e-4, **sts)))

    # 5. reported sets and throughput
    from kbert.train.metrics import spearman

    def accuracy(name):
        model = kbert.TaskModel.load(path(name))
        pred = np.argmax(model.predict([r["text"] for r in dev]), axis=1)
        return float(np.mean([model.labels[p] == r["label"] for p, r in zip(pred, dev)]))

    def sts_score(name):
        emb = kbert.Embedder.load(path(name))
        a = emb.encode([r["sentence1"] for r in sts_dev], progress=False)
        b = emb.encode([r["sentence2"] for r in sts_dev], progress=False)
        return spearman(np.sum(a * b, axis=1), [float(r["score"]) for r in sts_dev])

    def speeds(teacher, student, kind, rounds=5):
        """Texts/s of the teacher and the student, timed alternately (teacher, student, teacher, ...) and the
        best of `rounds` each: on a shared machine whose speed drifts, both sides of the ratio see the same
        drift. kind: predict or encode, on the graph or with "-xla" (every shape compiled while warming)."""
        texts = [r["text"] for r in dev[:4000]]
        xla = kind.endswith("-xla")
        runs = []
        for name in (teacher, student):
            if kind.startswith("predict"):
                model = kbert.TaskModel.load(path(name), jit_compile=xla)
                model.predict(texts if xla else texts[:256])
                runs.append(lambda model=model: model.predict(texts, batch_size=64))
            else:
                emb = kbert.Embedder.load(path(name), jit_compile=xla)
                emb.encode(texts if xla else texts[:256], progress=False)
                runs.append(lambda emb=emb: emb.encode(texts, batch_size=64, progress=False))
        best = [float("inf"), float("inf")]
        for _ in range(rounds):
            for i, run in enumerate(runs):
                best[i] = min(best[i], timed(run, repeats=1))
        return {teacher: len(texts) / best[0], student: len(texts) / best[1]}

    report = stage(args.out, "report", lambda: {
        "sentiment": {n: accuracy(n) for n in ("teacher-sentiment", "student-sentiment-distilled",
                                                "student-sentiment-direct")},
        "sts": {n: sts_score(n) for n in ("teacher-sts", "student-sts-distilled", "student-sts-direct")}})
    tuned_sts = stage(args.out, "report-sts-tuned", lambda: {"spearman": sts_score("student-sts-distilled-tuned")})
    plain = stage(args.out, "report-plain", lambda: {"sentiment": accuracy("student-sentiment-plain"),
                                                     "sts": sts_score("student-sts-plain")})
    # XLA removes most of the per-call overhead of the graph executor, which weighs more on the small student
    pairs = {"predict": ("teacher-sentiment", "student-sentiment-distilled"), "encode": ("teacher-sts",
                                                                                     "student-sts-distilled")}
    speed = stage(args.out, "report-speed", lambda: {
        kind: speeds(*pairs[kind.split("-")[0]], kind) for kind in ("predict", "encode", "predict-xla", "encode-xla")})
    s, k = report["sentiment"], report["sts"]
    t_params = kbert.load_model(path("teacher-sentiment")).count_params()
    s_params = kbert.load_model(path("student-sentiment-distilled")).count_params()
    print(f"\n| measure | teacher (bert-mini, {t_params / 1e6:.1f}M) | distilled {args.student} ({s_params / 1e6:.1f}M) "
          f"| {args.student} on the labels, no teacher (pretrained by the teacher's recipe) "
          f"| {args.student} on the labels, from the general distillation | student / teacher | goal |")
    print("|---|---:|---:|---:|---:|---:|---|")
    goal = ">= 0.97, and above the labels-alone student"
    print(f"| sentiment dev accuracy | {s['teacher-sentiment']:.4f} | {s['student-sentiment-distilled']:.4f} | "
          f"{plain['sentiment']:.4f} | {s['student-sentiment-direct']:.4f} | "
          f"{s['student-sentiment-distilled'] / s['teacher-sentiment']:.3f} | {goal} |")
    print(f"| KorSTS dev Spearman | {k['teacher-sts']:.4f} | {k['student-sts-distilled']:.4f} | {plain['sts']:.4f} | "
          f"{k['student-sts-direct']:.4f} | {k['student-sts-distilled'] / k['teacher-sts']:.3f} | {goal} |")
    print(f"| KorSTS dev Spearman, distilled then tuned on the KorSTS labels | | {tuned_sts['spearman']:.4f} | "
          f"{plain['sts']:.4f} | {k['student-sts-direct']:.4f} | {tuned_sts['spearman'] / k['teacher-sts']:.3f} | "
          f"{goal} |")
    for kind, what in (("predict", "TaskModel.predict"), ("encode", "Embedder.encode"),
                       ("predict-xla", "TaskModel.predict with jit_compile=True (XLA)"),
                       ("encode-xla", "Embedder.encode with jit_compile=True (XLA)")):
        t, st = (speed[kind][n] for n in pairs[kind.split("-")[0]])
        print(f"| {what}, reviews/s | {t:,.0f} | {st:,.0f} | | | {st / t:.1f}x | >= 4x |")
    print(f"(sentiment: {len(labelled):,} labelled + {len(unlabelled):,} unlabelled training reviews, "
          f"{len(select):,} selection rows from training movies, {len(dev):,} dev reviews of other movies; "
          f"KorSTS: {len(sts_fit):,} train pairs, {len(sts_select):,} selection pairs, {len(sts_dev):,} dev pairs)")


if __name__ == "__main__":
    main()
