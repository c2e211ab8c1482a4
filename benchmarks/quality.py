"""The end-to-end proof: pretraining with kbert pays off on real Korean data, on a 2-core CPU.

1. vocabulary: a SentencePiece unigram vocabulary on the pretraining text (`--morphemes mecab`: on MeCab-ko
   morphemes, so no piece crosses a morpheme boundary);
2. pretraining: a bert-mini sized BERT (4 layers, 256 hidden) on the movie reviews (movies of the sentiment
   dev split left out) plus the Korean statutes, for a wall-clock budget (`--minutes`, default 55). The recipe
   spends a small budget on as many updates as it can: masked-LM only (no NSP), 64-token sequences (reviews
   are short), batches of 32, no dropout while pretraining (dropout 0.1 is restored in the saved model for
   fine-tuning), bfloat16 mixed precision on a CPU with native bf16 instructions (else float32 under XLA;
   `--precision`), and token embeddings started from the text's co-occurrence statistics
   (`trainer.embedding_init: cooccurrence`, inside the budget; `--embedding-init random` for BERT's start);
3. sentiment: NSMC-style train/dev sets from the reviews (ratings 1-4 vs 9-10, balanced, <= 140 chars,
   split by movie); the pretrained model and the same model from random initialization fine-tuned with the
   same settings (2 epochs, up to 128 tokens: `--epochs`, `--max-length`; the random-init reference runs
   last, after stage 4), and a TF-IDF character 1-3-gram + logistic-regression baseline;
4. sentence embeddings: the STS bi-encoder fine-tuned from the pretrained model on KorSTS train (mean pooling
   over all layers, no dropout in the backbone: `--sts-layers`, `--sts-dropout`), Spearman on
   KorSTS dev averaged over three fine-tuning seeds (`--sts-seeds`), beside TF-IDF character n-gram cosine.
   `--only embeddings` runs issue 43's table instead (`--rows`: the bi-encoder, SimCSE, the contrastive
   multi-dataset recipes; chosen on a selection split cut from train, reported on KorSTS dev and question-pair
   dev), then `Embedder.search(..., lexical=w)` (hybrid search) with the chosen recipe's models.
   `--pretrain-seeds n` (with `--only embeddings`) spends the same pretraining budget as n runs of 1/n each
   (their own cached runs in OUT/pretrain-seedK), the chosen recipe on each, then their models as one
   ensemble and one student model taught by it (Augmented SBERT's candidate pairs scored by the ensemble),
   each also mixed with the TF-IDF baseline (the weight picked on the selection split). The first pretraining
   also runs today's bi-encoder, SimCSE only and SimCSE + multi-dataset, so the one command prints them beside
   the student. `--zero-step-members m` adds m members that spend none of the budget (random layers and
   co-occurrence token embeddings, no masked-LM step; they fail on other pairs than the pretrained ones) to
   that ensemble and to the student's teacher.

Every stage writes its result under `--out` and is skipped when rerun (pretraining resumes from its last
checkpoint), so an interrupted run continues where it stopped. Seeded, but not bit-reproducible across
machines (bf16 CPU kernels and thread counts differ; benchmarks/README.md, stop 61: about a point). A rerun
with another `--epochs` or `--max-length` on the same `--out` reuses stages 1, 2 and 4 and fine-tunes the
sentiment models again (stages `sentiment-*-Nep-lenL`).

    python benchmarks/quality.py --shared ../shared/data --out ~/.cache/kbert/quality
    python benchmarks/quality.py --small      # minutes: checks the chain, not the figures
"""

from __future__ import annotations

import argparse
import csv
import functools
import gzip
import hashlib
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def stage(out, name, fn):
    """Runs `fn` once: its JSON result is stored as OUT/NAME.json and reused on reruns."""
    path = os.path.join(out, f"{name}.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
        print(f"[{name}] cached: {json.dumps({k: v for k, v in result.items() if k != 'history'})}", flush=True)
        return result
    start = time.time()
    print(f"[{name}] ...", flush=True)
    result = fn()
    if result.get("checkpoint") or result.get("stopped_by") in ("SIGINT", "SIGTERM"):
        # a fine-tuning stopped by a signal kept its checkpoint: not a result to cache; a rerun resumes it
        sys.exit(f"[{name}] stopped ({result.get('stopped_by')}); rerun the same command to resume it")
    result.pop("checkpoint", None)
    result["seconds"] = round(time.time() - start, 1)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2, ensure_ascii=False)
    print(f"[{name}] {json.dumps({k: v for k, v in result.items() if k != 'history'})}", flush=True)
    return result


def dev_movie(movie_id, fraction=0.1):  # the same split rule as kbert.data.recipes.movie_review_sentiment
    return hashlib.md5(str(movie_id).encode()).digest()[0] / 256.0 < fraction


def write_pretraining_text(reviews_gz, statutes_gz, path, max_chars):
    """kbert's plain-text corpus format (a sentence per line, a blank line between documents): reviews of the
    training movies only (one document per movie) interleaved with statutes, about 2:1 in characters, so
    any prefix of the file (what a time budget reaches) has both kinds of Korean."""
    import kbert

    train_movies = path + ".reviews.tsv"
    with gzip.open(reviews_gz, "rt", encoding="utf-8") as src, open(train_movies, "w", encoding="utf-8") as dst:
        dst.write("movie_id\ttext\n")
        for row in csv.DictReader(src, delimiter="\t", quoting=csv.QUOTE_NONE):
            text = (row.get("text") or "").replace("\t", " ").strip()
            if text and not dev_movie(row["movie_id"]):
                dst.write(f"{row['movie_id']}\t{text}\n")
    reviews = iter(kbert.corpus(train_movies, group_by="movie_id", column="text"))
    statutes = iter(kbert.corpus(statutes_gz, text_field="text"))
    chars = {"reviews": 0, "statutes": 0}
    docs = {"reviews": 0, "statutes": 0}
    with open(path, "w", encoding="utf-8") as f:
        while sum(chars.values()) < max_chars:
            name = "reviews" if chars["reviews"] <= 2 * chars["statutes"] else "statutes"
            doc = next(reviews if name == "reviews" else statutes, None)
            if doc is None:
                break
            f.write("\n".join(doc) + "\n\n")
            chars[name] += sum(len(x) for x in doc)
            docs[name] += 1
    os.remove(train_movies)
    return {f"{k}_chars": v for k, v in chars.items()} | {f"{k}_documents": v for k, v in docs.items()}


def write_other_text(shared, path):
    """Unlabelled Korean text of other kinds than the pretraining text's reviews and statutes, for
    `--embedding-text other|both`: the news comments of korean-hate-speech's unlabelled set, the 3i4k utterances,
    the boddari paragraphs (Wikinews, UNESCO reports, book reviews) and the question-pair training questions less
    the selection part's (never a KorSTS, selection or dev sentence). Informal questions and comments are the
    kind of text KorSTS dev's forum pairs are, which reviews and statutes lack (benchmarks/README.md, stop 103).
    A blank line every 64 lines keeps documents short (co-occurrences are counted within a line anyway)."""
    import kbert

    lines = []
    with open(os.path.join(shared, "korean-hate-speech", "unlabeled_comments_5.txt"), encoding="utf-8") as f:
        lines += [x.strip() for x in f]
    with open(os.path.join(shared, "3i4k", "fci.txt"), encoding="utf-8") as f:  # "class<TAB>utterance"
        lines += [x.rstrip("\n").split("\t", 1)[-1].strip() for x in f]
    for name in ("wikinews.txt", "unesco_report.txt", "book_review01.txt"):
        with open(os.path.join(shared, "boddari", name), encoding="utf-8") as f:
            lines += [x.strip() for x in f]
    qp_fit, _ = kbert.selection_split(read_tsv(os.path.join(shared, "question-pair", "train.txt")), "question1")
    lines += sorted({r[c].strip() for r in qp_fit for c in ("question1", "question2")})
    lines = [x for x in lines if x]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(0, len(lines), 64):
            f.write("\n".join(lines[i:i + 64]) + "\n\n")
    return {"other_lines": len(lines), "other_chars": sum(len(x) for x in lines)}


EMBEDDING_TEXTS = ("pretraining", "other", "both")


def embedding_text(shared, out, pretraining_text, which):
    """The text `--embedding-text` counts co-occurrences on: the pretraining text, the other text, or both as a
    list of the two files (a kbert Corpus reads a list in order; the other text first, so the 20M-token cap of
    kbert.train.embedding_init keeps all of it, and no concatenated copy is written)."""
    if which == "pretraining":
        return pretraining_text
    other = os.path.join(out, "other.txt")
    stage(out, "other-text", lambda: write_other_text(shared, other))
    return other if which == "other" else [other, pretraining_text]


def restore_dropout(model_dir, rate=0.1):
    """Pretraining ran without dropout (a short run does not overfit, and every update counts); fine-tuning on
    a labelled set does need it, so the saved model gets BERT's usual 0.1 back. Dropout has no weights."""
    path = os.path.join(model_dir, "kbert_config.json")
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    saved["model"].update(dropout=rate, attention_dropout=rate)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(saved, f, indent=2, sort_keys=True)


def untrained_model(config, pre_seed, minutes_from, text=None):
    """`--steps 0`: the model dir kbert.pretrain would start from (the preset's randomly initialized layers, the
    token embeddings of `trainer.embedding_init`, counted on `text` or else the pretraining text), written
    without a masked-LM step: the reference that says what the pretraining's steps add (benchmarks/README.md)."""
    import keras

    import kbert
    from kbert.train.embedding_init import initialize_token_embeddings

    keras.utils.set_random_seed(pre_seed)
    tok = kbert.Tokenizer.load(config["data"]["tokenizer"])
    model = {k: v for k, v in config["model"].items() if k != "preset"}
    backbone = kbert.build_backbone(kbert.ModelConfig.preset(config["model"]["preset"], vocab_size=tok.vocab_size,
                                                             pad_token_id=tok.pad_id, **model))
    if config["trainer"]["embedding_init"] == "cooccurrence":
        initialize_token_embeddings(backbone, text or config["data"]["source"], tok, seed=pre_seed)
    model_dir = os.path.join(config["output_dir"], "model")
    kbert.save_model(backbone, model_dir, tokenizer=tok)
    restore_dropout(model_dir)
    return {"steps": 0, "model_dir": model_dir, "minutes": round((time.time() - minutes_from) / 60, 1),
            "final_mlm_accuracy": None, "objective": None, "embedding_init": config["trainer"]["embedding_init"]}


def tfidf_sentiment(train, dev):
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    vec = TfidfVectorizer(analyzer="char_wb", ngram_range=(1, 3), min_df=2, sublinear_tf=True)
    x = vec.fit_transform([r["text"] for r in train])
    clf = LogisticRegression(max_iter=2000, C=4.0).fit(x, [r["label"] for r in train])
    pred = clf.predict(vec.transform([r["text"] for r in dev]))
    return float((pred == [r["label"] for r in dev]).mean())


def read_sts(path):
    with open(path, encoding="utf-8") as f:
        header, *rows = [line.rstrip("\n").split("\t") for line in f]
    return [dict(zip(header, r)) for r in rows if len(r) == len(header)]


def tfidf_sts(train, dev):
    import numpy as np

    from kbert.embed.lexical import char_tfidf  # the lexical baseline: character 1-3-grams in words, sublinear TF
    from kbert.train.metrics import spearman

    vec = char_tfidf([r[c] for r in train for c in ("sentence1", "sentence2")])
    a, b = vec.transform([r["sentence1"] for r in dev]), vec.transform([r["sentence2"] for r in dev])
    cos = np.asarray(a.multiply(b).sum(axis=1)).ravel()
    return spearman(cos, [float(r["score"]) for r in dev])


# ---------------------------------------------------------------- issue 43: sentence embeddings on unseen data
def read_tsv(path):
    with open(path, encoding="utf-8-sig") as f:
        return [dict(r) for r in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]


def paraphrases(rows):
    """Question-pair rows marked paraphrase (`is_duplicate` 0 in this re-split: 1 marks different questions)
    whose two questions differ as text: an identical pair says nothing about a model (759 of the 4,169 train
    paraphrases, 78 of the 432 dev ones)."""
    return [(r["question1"], r["question2"]) for r in rows
            if r["is_duplicate"].strip() == "0" and r["question1"].strip() != r["question2"].strip()]


def embedding_sets(shared, text, simcse_lines, seed, small):
    """Everything the embedding stages train and score on. Train side: KorSTS train less its selection part,
    question-pair train paraphrases less theirs, KorNLI triplets, SimCSE lines (pretraining text plus the
    training-side sentences). Scored: the selection parts (`kbert.selection_split`: recipes are chosen on this
    part of the *training* data only), KorSTS dev and question-pair dev (reported, never tuned on)."""
    import random

    import kbert

    sts_all = read_sts(os.path.join(shared, "korsts", "sts-train.tsv"))
    qp_all = read_tsv(os.path.join(shared, "question-pair", "train.txt"))
    sets = {
        **dict(zip(("sts_fit", "sts_select"), kbert.selection_split(sts_all, "sentence1"))),
        "sts_dev": read_sts(os.path.join(shared, "korsts", "sts-dev.tsv")),
        **dict(zip(("qp_fit", "qp_select"), kbert.selection_split(qp_all, "question1"))),
        "qp_dev": read_tsv(os.path.join(shared, "question-pair", "validation.txt")),
        # KorNLI XNLI dev: each premise has one hypothesis of each label; the contradiction is the hard negative
        "nli": kbert.nli_triplets(os.path.join(shared, "kornli", "xnli.dev.ko.tsv")),
    }
    if small:
        sets = {k: v[:400] for k, v in sets.items()}
    lines = []
    with open(text, encoding="utf-8") as f:
        lines = [x.strip() for x in f if 10 <= len(x.strip()) <= 300]
    random.Random(seed).shuffle(lines)
    own = {r[c] for r in sets["sts_fit"] for c in ("sentence1", "sentence2")}
    own |= {q for pair in paraphrases(sets["qp_fit"]) for q in pair}
    own |= {r[c] for r in sets["nli"] for c in ("anchor", "positive", "negative")}
    lines = (sorted(own) + lines)[:simcse_lines]
    random.Random(seed + 1).shuffle(lines)
    sets["simcse"] = [{"text": x} for x in lines]
    return sets


def retrieval_recall(encode, rows, first=None):
    """Question-pair retrieval: each paraphrase pair's first question against every distinct second question
    of the split (paraphrase or not); recall@1 = how often its own paraphrase ranks first. By cosine of the
    unit vectors `encode` gives, or by `first(queries, candidates)`: the index of each query's top hit."""
    import numpy as np

    pairs = paraphrases(rows)
    candidates = sorted({r["question2"] for r in rows})
    where = {c: i for i, c in enumerate(candidates)}
    queries = [q for q, _ in pairs]
    top = (first(queries, candidates) if first is not None
           else np.argmax(encode(queries) @ encode(candidates).T, axis=1))
    return float(np.mean([top[i] == where[p] for i, (_, p) in enumerate(pairs)]))


def sts_spearman(encode, rows):
    import numpy as np

    from kbert.train.metrics import spearman

    a, b = encode([r["sentence1"] for r in rows]), encode([r["sentence2"] for r in rows])
    return spearman(np.sum(a * b, axis=1), [float(r["score"]) for r in rows])


def score_embeddings(encode, sets):
    """The four figures of the table for one way of encoding (unit vectors `[n, h]` from a list of texts)."""
    return {"sts_select": sts_spearman(encode, sets["sts_select"]), "qp_select": retrieval_recall(encode, sets["qp_select"]),
            "sts_dev": sts_spearman(encode, sets["sts_dev"]), "qp_dev": retrieval_recall(encode, sets["qp_dev"])}


def print_scores(rows):
    """`(label, score_embeddings(...))` rows as one markdown table: the selection split first, dev reported only."""
    print("\n| vectors | KorSTS selection | question-pair selection recall@1 | KorSTS dev (reported only) | "
          "question-pair dev recall@1 |\n|---|---:|---:|---:|---:|")
    for label, s in rows:
        print(f"| {label} | {s['sts_select']:.4f} | {s['qp_select']:.4f} | {s['sts_dev']:.4f} | {s['qp_dev']:.4f} |")


def tfidf_encoder(sets):
    """TF-IDF character 1-3-grams fitted on the training-side sentences (unit rows, so a dot is a cosine)."""
    from kbert.embed.lexical import char_tfidf

    vec = char_tfidf([r[c] for r in sets["sts_fit"] for c in ("sentence1", "sentence2")]
                     + [q for r in sets["qp_fit"] for q in (r["question1"], r["question2"])])
    return lambda texts: vec.transform(texts).toarray()


def silver_candidates(rows, seed):
    """Augmented SBERT's unlabelled pairs for a teacher to score (`kbert.candidate_pairs`, its defaults: each
    distinct sentence of `rows`, KorSTS pairs, with its 3 nearest others by TF-IDF character 1-3-gram cosine
    and 1 random other), the labelled pairs left out."""
    import kbert

    return kbert.candidate_pairs([r[c] for r in rows for c in ("sentence1", "sentence2")], seed=seed,
                                 exclude=[(r["sentence1"], r["sentence2"]) for r in rows])


def cross_encoder_silver(out, name, model_dir, sets, seed, small):
    """Augmented SBERT (Thakur et al., 2021; sentence-transformers' data-augmentation recipe): a cross-encoder
    (`[CLS] a [SEP] b [SEP]` -> score, both orders of each KorSTS training pair) kept at its best epoch on the
    selection split, then its scores (mean of both orders, clipped to 0..5) on `silver_candidates`. Writes
    OUT/NAME-silver.jsonl; returns the cross-encoder's own figures (selection, and KorSTS dev: reported only)."""
    import numpy as np

    import kbert
    from kbert.train.metrics import spearman

    both = sets["sts_fit"] + [dict(r, sentence1=r["sentence2"], sentence2=r["sentence1"]) for r in sets["sts_fit"]]
    model_out = os.path.join(out, name)
    summary = kbert.finetune(model_dir, "regression", both, sets["sts_select"], out_dir=model_out,
                             text_column="sentence1", pair_column="sentence2", label_column="score",
                             epochs=1 if small else 3, batch_size=32, learning_rate=2e-4, max_length=128,
                             patience=None, seed=seed, progress=True)
    if summary["checkpoint"]:
        return {"checkpoint": summary["checkpoint"], "stopped_by": summary["stopped_by"]}
    model = kbert.TaskModel.load(model_out)

    def score(a, b):
        return (np.asarray(model.predict(a, b, batch_size=128)) + np.asarray(model.predict(b, a, batch_size=128))) / 2

    figures = {}
    for split in ("sts_select", "sts_dev"):
        rows = sets[split]
        figures[split] = spearman(score([r["sentence1"] for r in rows], [r["sentence2"] for r in rows]),
                                  [float(r["score"]) for r in rows])
    pairs = silver_candidates(sets["sts_fit"], seed)[:2000 if small else None]
    values = np.clip(score([a for a, _ in pairs], [b for _, b in pairs]), 0.0, 5.0)
    with open(os.path.join(out, f"{name}-silver.jsonl"), "w", encoding="utf-8") as f:
        for (a, b), v in zip(pairs, values):
            f.write(json.dumps({"sentence1": a, "sentence2": b, "score": round(float(v), 4)}, ensure_ascii=False) + "\n")
    return {"select_history": [h.get("dev_spearman") for h in summary["history"]], "best_step": summary["best_step"],
            "cross_sts_select": figures["sts_select"], "cross_sts_dev": figures["sts_dev"], "silver_pairs": len(pairs),
            "silver_mean": float(np.mean(values))}


def weak_pairs(shared, seed):
    """Weakly supervised (anchor, positive) pairs mined from the structure of text ../shared/data holds (the
    "title/body" pairs of E5 and GTE's contrastive pre-finetuning, Wang et al. 2022, Li et al. 2023): each court
    decision's numbered issue statements (판시사항 [n]) with its holdings (판결요지 [n]), and each statute's
    title with its purpose article (제1조 (목적)). No KorSTS, question-pair or NLI sentence is among them. Each
    anchor and positive is kept once (a repeat in a batch would be a false negative); shuffled by `seed`."""
    import random

    rows = list(_mined_weak_pairs(shared))  # read once per run, however many seeds shuffle it
    random.Random(seed).shuffle(rows)
    return rows


@functools.lru_cache(maxsize=None)
def _mined_weak_pairs(shared):
    """`weak_pairs` in file order (a tuple: cached, so callers shuffle a copy)."""
    import re

    def clean(text):
        return re.sub(r"\s+", " ", re.sub(r"[*#\\]", "", text)).strip()

    def section(text, name):
        found = re.search(rf"## {name}\n(.*?)(?=\n## |\Z)", text, re.S)
        return [y for y in map(clean, re.split(r"\[\d+\]", found.group(1))) if y] if found else []

    pairs = []
    with gzip.open(os.path.join(shared, "korean-precedents", "documents.jsonl.gz"), "rt", encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            issues, holdings = section(text, "판시사항"), section(text, "판결요지")
            if issues and len(issues) == len(holdings):  # numbered alike: [n] answers [n]
                pairs += [(a, b) for a, b in zip(issues, holdings) if len(a) >= 10 and len(b) >= 10]
    with gzip.open(os.path.join(shared, "korean-statutes", "documents.jsonl.gz"), "rt", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)
            found = re.search(r"제1조 \(목적\)\n\n(.*?)(?=\n#|\Z)", doc["text"], re.S)
            body = clean(re.sub(r"<[^>]*>", "", found.group(1))) if found else ""
            if len(body) >= 10:
                pairs.append((clean(doc["title"]), body))
    seen, rows = set(), []
    for a, b in pairs:
        if a not in seen and b not in seen:
            seen |= {a, b}
            rows.append({"anchor": a, "positive": b})
    return tuple(rows)


def mined_question_pairs(out, start, seed, sets, small):
    """The training-side question-pair paraphrases as (anchor, positive, negative) rows, the negative mined by
    the model OUT/START-seedN among every question of the training side (paraphrase rows or not), cached as
    OUT/START-mined-seedN.jsonl."""
    import kbert

    name = f"{start}-mined-seed{seed}"
    path = os.path.join(out, f"{name}.jsonl")

    def run():
        pairs = [{"anchor": a, "positive": p} for a, p in paraphrases(sets["qp_fit"])]
        corpus = sorted({r[c] for r in sets["qp_fit"] for c in ("question1", "question2")})
        report = {}
        rows = kbert.mine_hard_negatives(os.path.join(out, f"{start}-seed{seed}"), pairs, corpus, report=report,
                                         progress=not small)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        os.replace(path + ".tmp", path)
        return report
    if not os.path.isfile(path):  # the rows are the stage's output: mine again when they are gone
        stale = os.path.join(out, f"{name}.json")
        if os.path.isfile(stale):
            os.remove(stale)
    stage(out, name, run)
    return read_jsonl(path)


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


EMBEDDING_ROWS = ("bi-encoder", "simcse", "simcse-multi", "simcse-pairs-sts", "simcse-pairs-silver",
                  "simcse-weak-pairs-sts", "simcse-weak-mined-sts", "simcse-weak-gist-sts", "simcse-weak-sym-sts")
# the Augmented SBERT row is a closed probe (benchmarks/README.md: at this backbone the cross-encoder is far
# below the bi-encoder, so its labels cannot teach it), and so is the mined-negatives row (better retrieval
# after its pairs stage, no better STS after the KorSTS stage); `--rows all` reruns them
DEFAULT_ROWS = EMBEDDING_ROWS[:4] + ("simcse-weak-pairs-sts",)


def tuned_stage(out, sets, name, model, train, record=None, **kw):
    """The cached stage OUT/NAME: `kbert.finetune` of MODEL as a sentence-embedding bi-encoder on TRAIN (KorSTS-
    style rows, or None with `datasets=`), keeping its best epoch on the selection split, then scored on every
    set. `record` adds fields to the stored result; `kw` goes to kbert.finetune."""
    import kbert

    out_dir = os.path.join(out, name)

    def run():
        summary = kbert.finetune(model, "sentence-embedding", train, sets["sts_select"], out_dir=out_dir,
                                 text_column="sentence1", pair_column="sentence2", label_column="score",
                                 layers="all", max_length=64, patience=None, progress=True, **kw)
        if summary["checkpoint"]:  # stopped by a signal: stage() exits without caching it
            return {"checkpoint": summary["checkpoint"], "stopped_by": summary["stopped_by"]}
        embedder = kbert.Embedder.load(out_dir)
        return {"select_history": [h.get("dev_spearman") for h in summary["history"]],
                "best_step": summary["best_step"], **(record or {}),
                **score_embeddings(lambda texts: embedder.encode(texts, progress=False), sets)}
    return dict(stage(out, name, run), model=name)


def embedding_stages(args, out, model_dir, sets):
    """Issue 43's table: TF-IDF, today's bi-encoder, SimCSE only, and SimCSE + multi-dataset, every model
    fine-tuned on `args.sts_seeds` seeds; each fine-tuning keeps its best epoch on the selection split."""
    tuned = functools.partial(tuned_stage, out, sets)
    small = args.small
    tfidf = stage(out, "emb-tfidf", lambda: score_embeddings(tfidf_encoder(sets), sets))
    simcse_data = [{"data": sets["simcse"], "text_column": "text", "objective": "simcse"}]
    multi_data = [
        {"data": sets["nli"], "text_column": "anchor", "pair_column": "positive", "negative_column": "negative"},
        {"data": [{"anchor": q, "positive": p} for q, p in paraphrases(sets["qp_fit"])],
         "text_column": "anchor", "pair_column": "positive"},
        {"data": sets["sts_fit"], "text_column": "sentence1", "pair_column": "sentence2", "label_column": "score"}]

    def pairs_then_sts(start, seed, sts, mined=False, guided=False, symmetric=False):
        """The sequential form (sentence-transformers' Korean multitask recipe) from the model START-seedN:
        the contrastive sets (NLI triplets, question pairs) as START[-mined]-pairs-seedN, then, with `sts`, the
        KorSTS regression alone, as the bi-encoder is trained, as START[-mined]-pairs-sts-seedN (its result
        returned). `mined`: each question pair also gets a hard negative that START-seedN ranks nearest its
        first question among every training-side question (`kbert.mine_hard_negatives`, its defaults).
        `guided`: START-seedN is also the guide that filters the in-batch negatives (`kbert.finetune(guide=)`,
        GISTEmbed, margin 0), as START-gist-pairs-seedN. `symmetric`: the in-batch losses both ways
        (`kbert.finetune(symmetric=True)`), as START-sym-pairs-seedN."""
        start_dir, data, extra = os.path.join(out, f"{start}-seed{seed}"), multi_data[:2], {}
        if mined:
            data = [data[0], dict(data[1], data=mined_question_pairs(out, start, seed, sets, small),
                                  negative_column="negative")]
            start = f"{start}-mined"
        if guided:
            extra = dict(guide=start_dir, guide_margin=0.0)
            start = f"{start}-gist"
        if symmetric:
            extra["symmetric"] = True
            start = f"{start}-sym"
        tuned(f"{start}-pairs-seed{seed}", start_dir, None, datasets=data, mix="proportional",
              epochs=1 if small else 2, batch_size=32, learning_rate=1e-4, seed=seed, **extra)
        if not sts:
            return None
        return tuned(f"{start}-pairs-sts-seed{seed}", os.path.join(out, f"{start}-pairs-seed{seed}"),
                     sets["sts_fit"], backbone_dropout=0.0, epochs=1 if small else 4, batch_size=32,
                     learning_rate=2e-4, seed=seed)

    rows = {"default": DEFAULT_ROWS, "all": EMBEDDING_ROWS}.get(args.rows) or args.rows.split(",")
    runs = {key: [] for key in rows}

    for seed in range(args.seed, args.seed + args.sts_seeds):
        if "bi-encoder" in runs:
            runs["bi-encoder"].append(tuned(
                f"emb-bi-encoder-seed{seed}", model_dir, sets["sts_fit"], backbone_dropout=0.0,
                epochs=1 if small else 4, batch_size=32, learning_rate=2e-4, seed=seed))
        if not set(runs) - {"bi-encoder"}:  # every other row starts from the SimCSE model
            continue
        simcse = tuned(f"emb-simcse-seed{seed}", model_dir, None, datasets=simcse_data, epochs=1, batch_size=64,
                       learning_rate=args.simcse_lr, temperature=0.05, seed=seed)
        if "simcse" in runs:
            runs["simcse"].append(simcse)
        if "simcse-multi" in runs:
            runs["simcse-multi"].append(tuned(
                f"emb-simcse-multi-seed{seed}", os.path.join(out, f"emb-simcse-seed{seed}"), None,
                datasets=multi_data, mix="proportional", backbone_dropout=args.multi_dropout,
                epochs=1 if small else args.multi_epochs, batch_size=32, learning_rate=args.multi_lr, seed=seed))
        if {k for k in runs if k.startswith("simcse-weak-")}:
            # the sequential recipe with a stage of weakly supervised pairs (court decisions, statutes) first
            weak = weak_pairs(args.shared, seed)[:400 if small else None]
            tuned(f"emb-weak-seed{seed}", os.path.join(out, f"emb-simcse-seed{seed}"), None,
                  datasets=[{"data": weak, "text_column": "anchor", "pair_column": "positive"}], epochs=1,
                  batch_size=64, learning_rate=1e-4, seed=seed)
            if "simcse-weak-pairs-sts" in runs:
                runs["simcse-weak-pairs-sts"].append(pairs_then_sts("emb-weak", seed, sts=True))
            if "simcse-weak-mined-sts" in runs:
                runs["simcse-weak-mined-sts"].append(pairs_then_sts("emb-weak", seed, sts=True, mined=True))
            if "simcse-weak-gist-sts" in runs:
                runs["simcse-weak-gist-sts"].append(pairs_then_sts("emb-weak", seed, sts=True, guided=True))
            if "simcse-weak-sym-sts" in runs:
                runs["simcse-weak-sym-sts"].append(pairs_then_sts("emb-weak", seed, sts=True, symmetric=True))
        if not {"simcse-pairs-sts", "simcse-pairs-silver"} & set(runs):
            continue
        sts = pairs_then_sts("emb-simcse", seed, sts="simcse-pairs-sts" in runs)
        if sts is not None:
            runs["simcse-pairs-sts"].append(sts)
        if "simcse-pairs-silver" in runs:
            # the same, its last stage on the KorSTS pairs plus pairs a cross-encoder scored (Augmented SBERT)
            stage(out, f"emb-cross-encoder-seed{seed}",
                  lambda: cross_encoder_silver(out, f"emb-cross-encoder-seed{seed}", model_dir, sets, seed, small))
            silver = read_jsonl(os.path.join(out, f"emb-cross-encoder-seed{seed}-silver.jsonl"))
            runs["simcse-pairs-silver"].append(tuned(
                f"emb-simcse-pairs-silver-seed{seed}", os.path.join(out, f"emb-simcse-pairs-seed{seed}"),
                sets["sts_fit"] + silver, backbone_dropout=0.0, epochs=1 if small else 2, batch_size=32,
                learning_rate=2e-4, seed=seed))
    return tfidf, runs


def ensemble_encoder(encoders, weights=None):
    """Several encode functions as one: each one's unit vectors scaled by sqrt(its weight) (default: 1/n each) and
    concatenated, so the dot of two results is the weighted sum of their cosines (with weights summing to 1, the
    results are unit vectors again). `kbert.EnsembleEmbedder` is this for models; this mixes in TF-IDF too."""
    import numpy as np

    scales = np.sqrt(weights if weights is not None else [1.0 / len(encoders)] * len(encoders))
    return lambda texts: np.concatenate([s * np.asarray(encode(texts)) for s, encode in zip(scales, encoders)],
                                        axis=1)


LEXICAL_WEIGHTS = (0.1, 0.2, 0.3, 0.4, 0.5)


def lexical_encoder(encode, lexical, weight):
    """Dense and lexical vectors as one: `encode`'s unit vectors scaled by sqrt(1 - weight) beside `lexical`'s
    (TF-IDF, unit rows) scaled by sqrt(weight), so the dot of two results is (1 - weight) x the dense cosine +
    weight x the lexical cosine: the score `Embedder.search(..., lexical=weight)` ranks by, as a vector."""
    return ensemble_encoder([encode, lexical], (1.0 - weight, weight))


def pick_lexical_weight(encode, lexical, rows, weights=LEXICAL_WEIGHTS):
    """The weight of `weights` whose mix of dense and lexical cosines ranks `rows` (scored pairs: the
    selection split) best by Spearman. Returns (weight, {weight: Spearman})."""
    import numpy as np

    from kbert.train.metrics import spearman

    gold = [float(r["score"]) for r in rows]
    dense, lex = (np.sum(f([r["sentence1"] for r in rows]) * f([r["sentence2"] for r in rows]), axis=1)
                  for f in (encode, lexical))
    by = {w: spearman((1.0 - w) * dense + w * lex, gold) for w in weights}
    return max(by, key=by.get), by


def lexical_stage(out, name, encode, sets):
    """The cached stage OUT/NAME: `encode` mixed with the TF-IDF baseline's vectors (fitted on the training
    side), the weight picked on the KorSTS selection split, then scored on every set."""
    def run():
        lexical = tfidf_encoder(sets)
        weight, by = pick_lexical_weight(encode, lexical, sets["sts_select"])
        return {"lexical_weight": weight, "select_by_weight": {f"{w:g}": v for w, v in by.items()},
                **score_embeddings(lexical_encoder(encode, lexical, weight), sets)}
    return stage(out, name, run)


ENSEMBLE_ROW = "simcse-weak-pairs-sts"  # the recipe each pretraining of `--pretrain-seeds` runs
# the first pretraining also runs the issue's reference rows, so one command prints the whole table
REFERENCE_ROWS = {"bi-encoder": ("emb-bi-encoder", "today's bi-encoder (KorSTS cosine regression)"),
                  "simcse": ("emb-simcse", "SimCSE only"),
                  "simcse-multi": ("emb-simcse-multi", "SimCSE + multi-dataset in one run")}


def member_command(args, k):
    """The quality.py command of the ensemble's k-th member: its own --out, --seed and a 1/n share of the
    pretraining budget (members n.. of `--zero-step-members`: no masked-LM step); the chosen recipe (the first
    pretraining also the reference rows); every other option as given."""
    n = args.pretrain_seeds
    out = member_out(args, k)  # with --small the run adds "-small" itself
    cmd = [sys.executable, os.path.abspath(__file__), "--shared", args.shared, "--out", out,
           "--seed", str(member_seed(args, k)), "--only", "embeddings",
           "--rows", ",".join([*REFERENCE_ROWS, ENSEMBLE_ROW]) if k == 0 else ENSEMBLE_ROW,
           "--sts-seeds", str(args.sts_seeds), "--precision", args.precision, "--objective", args.objective,
           "--embedding-init", args.embedding_init, "--embedding-text", member_text(args, k),
           "--morphemes", args.morphemes, "--vocab-size", str(args.vocab_size),
           "--simcse-lines", str(args.simcse_lines), "--simcse-lr", str(args.simcse_lr)]
    if k >= n or args.steps == 0:  # members without a masked-LM step
        cmd += ["--steps", "0"]
    elif args.steps is None:
        cmd += ["--minutes", f"{args.minutes / n:g}"]
    else:
        cmd += ["--steps", str(max(1, args.steps // n))]
    if args.learning_rate:
        cmd += ["--learning-rate", str(args.learning_rate)]
    return cmd + (["--small"] if args.small else [])


def member_text(args, k):
    """The text member k's co-occurrence table counts: the k-th of `--embedding-text` (cycled), counted again
    from the first for the 0-step members."""
    texts = args.embedding_text.split(",")
    return texts[(member_seed(args, k) - args.seed) % len(texts)]


def member_seed(args, k):
    """Member k's seed (its vocabulary, initialization and first fine-tuning seed): the pretrained members take
    --seed, --seed+1, ...; the 0-step members of `--zero-step-members` the same seeds again, in their own dirs."""
    return args.seed + (k if k < args.pretrain_seeds else k - args.pretrain_seeds)


def member_out(args, k):
    """The --out member k's quality.py run is given."""
    kind = "pretrain" if k < args.pretrain_seeds else "zero-step"
    return os.path.join(args.out, f"{kind}-seed{member_seed(args, k)}")


def member_dir(args, k):
    """Where member k's run writes (its --out, with the "-small" that --small adds)."""
    return member_out(args, k) + ("-small" if args.small else "")


def members(args):
    return args.pretrain_seeds + getattr(args, "zero_step_members", 0)


def ensemble_tag(args):
    """The ensemble's stage name: `ensemble4`, or `ensemble4-zero4` with 0-step members beside the pretrained."""
    m = getattr(args, "zero_step_members", 0)
    return f"ensemble{args.pretrain_seeds}" + (f"-zero{m}" if m else "")


def ensemble_stages(args):
    """`--pretrain-seeds n`: n pretrainings of 1/n of the budget each (seeds --seed, --seed+1, ...), each running
    the chosen recipe in OUT/pretrain-seedK (its own quality.py run, cached and resumable as any), and
    `--zero-step-members m` more without a masked-LM step (OUT/zero-step-seedK); then their n + m
    models as one ensemble (the mean of their cosines), and one student: the selection split's best member's
    model before its KorSTS stage, trained on KorSTS train plus the Augmented-SBERT candidate pairs scored by
    the ensemble; both again mixed with TF-IDF (`lexical_stage`). Returns the scored sets and
    {row: [result per fine-tuning seed]}."""
    import subprocess

    import kbert

    n, tag = members(args), ensemble_tag(args)
    for k in range(n):
        print(f"[{os.path.basename(member_dir(args, k))}] {' '.join(member_command(args, k)[1:])}", flush=True)
        done = subprocess.run(member_command(args, k))
        if done.returncode:
            sys.exit(f"the ensemble's member {k + 1} of {n} ({member_dir(args, k)}) stopped (exit "
                     f"{done.returncode}); rerun the same command to resume it")
    sets = embedding_sets(args.shared, os.path.join(member_dir(args, 0), "pretraining.txt"), args.simcse_lines,
                          args.seed, args.small)
    runs = {f"reference-{row}": [] for row in REFERENCE_ROWS}
    runs.update({f"member-{k}": [] for k in range(n)})
    runs.update({"ensemble": [], "student": [], "ensemble-lexical": [], "student-lexical": []})
    epochs = 1 if args.small else args.student_epochs
    student_name = f"emb-{tag}-student-{epochs}ep"  # the epochs name the stage: another count reruns it
    for i in range(args.sts_seeds):
        for row, (name, _) in REFERENCE_ROWS.items():
            with open(os.path.join(member_dir(args, 0), f"{name}-seed{args.seed + i}.json"), encoding="utf-8") as f:
                runs[f"reference-{row}"].append(json.load(f))
        chosen = []  # (member's result, its dir, the seed it fine-tuned with)
        for k in range(n):
            seed = member_seed(args, k) + i
            with open(os.path.join(member_dir(args, k), f"emb-weak-pairs-sts-seed{seed}.json"), encoding="utf-8") as f:
                result = json.load(f)
            runs[f"member-{k}"].append(result)
            chosen.append((result, member_dir(args, k), seed))
        dirs = [os.path.join(d, f"emb-weak-pairs-sts-seed{seed}") for _, d, seed in chosen]
        ensemble = kbert.EnsembleEmbedder(dirs)
        # the ensemble scored below as a dir any loader reads (`kbert.Embedder.load`, `kbert embed --model`)
        ensemble.save(os.path.join(args.out, f"emb-{tag}-seed{args.seed + i}"))
        embedders, encode = ensemble.members, functools.partial(ensemble.encode, progress=False)
        runs["ensemble"].append(stage(args.out, f"emb-{tag}-seed{args.seed + i}",
                                      lambda: score_embeddings(encode, sets)))
        best, start_dir, seed = max(chosen, key=lambda c: c[0]["sts_select"])
        silver_path = os.path.join(args.out, f"emb-{tag}-seed{args.seed + i}-silver.jsonl")

        def silver():
            pairs = silver_candidates(sets["sts_fit"], args.seed + i)[:2000 if args.small else None]
            rows = kbert.label_pairs(embedders, pairs, gold=sets["sts_fit"])  # mean cosine, on the 0..5 scale
            with open(silver_path, "w", encoding="utf-8") as f:
                f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
            return {"silver_pairs": len(rows), "silver_mean": sum(r["score"] for r in rows) / len(rows)}

        stage(args.out, f"emb-{tag}-seed{args.seed + i}-silver", silver)
        runs["student"].append(tuned_stage(
            args.out, sets, f"{student_name}-seed{args.seed + i}",
            os.path.join(start_dir, f"emb-weak-pairs-seed{seed}"), sets["sts_fit"] + read_jsonl(silver_path),
            record={"start": os.path.relpath(start_dir, args.out)}, backbone_dropout=0.0,
            epochs=epochs, batch_size=32, learning_rate=2e-4, seed=args.seed + i))
        # both again with the lexical baseline mixed in (dense + TF-IDF, the weight chosen on the selection split)
        runs["ensemble-lexical"].append(lexical_stage(args.out, f"emb-{tag}-lexical-seed{args.seed + i}",
                                                      encode, sets))
        student = kbert.Embedder.load(os.path.join(args.out, f"{student_name}-seed{args.seed + i}"))
        runs["student-lexical"].append(lexical_stage(
            args.out, f"{student_name}-lexical-seed{args.seed + i}",
            functools.partial(student.encode, progress=False), sets))
    return sets, runs


def print_ensemble_table(tfidf, runs, n, zero=0):
    import numpy as np

    cols = ("sts_select", "qp_select", "sts_dev", "qp_dev")
    seeds = len(runs["student"])
    extra = f" and {zero} members without a masked-LM step" if zero else ""
    print(f"\n| {n} pretrainings of 1/{n} the budget each{extra} (mean of {seeds} fine-tuning seed(s)) "
          "| KorSTS selection Spearman | question-pair selection recall@1 | **KorSTS dev Spearman** "
          "| **question-pair dev recall@1** |")
    print("|---|---:|---:|---:|---:|")
    print("| TF-IDF char 1-3 cosine | " + " | ".join(f"{tfidf[c]:.4f}" for c in cols) + " |")
    labels = {f"reference-{row}": f"pretraining 1 of {n}, {label}" for row, (_, label) in REFERENCE_ROWS.items()}
    labels.update({f"member-{k}": f"pretraining {k + 1} of {n}, the chosen recipe" if k < n else
                   f"0-step member {k - n + 1} of {zero}, the chosen recipe" for k in range(n + zero)})
    labels.update(ensemble=f"the {n + zero} models together (mean cosine; {n + zero} models to serve)",
                  student="one student: KorSTS train + candidate pairs scored by the ensemble")
    labels.update({f"{key}-lexical": f"{labels[key]}, mixed with TF-IDF (weight picked on the selection split)"
                   for key in ("ensemble", "student")})
    means = {}
    for key, results in runs.items():
        means[key] = {c: float(np.mean([r[c] for r in results])) for c in cols}
        each = {c: ", ".join(f"{r[c]:.3f}" for r in results) for c in cols}
        print(f"| {labels[key]} | " + " | ".join(f"{means[key][c]:.4f} ({each[c]})" for c in cols) + " |")
    what = {"ensemble": f"the {n + zero} models together", "student": "the student",
            "student-lexical": "the student mixed with TF-IDF"}
    for key in ("ensemble", "student", "student-lexical"):
        for c, name in (("sts_select", "KorSTS selection"), ("sts_dev", "KorSTS dev")):
            print(f"  {what[key]} on {name}: {100 * (means[key][c] - tfidf[c]):+.1f} points over TF-IDF "
                  "(goal >= +5)")
    for key in ("ensemble", "student"):
        for c, name in (("sts_select", "KorSTS selection"), ("sts_dev", "KorSTS dev")):
            print(f"  {what[key]} on {name}: {100 * (means[key][c] - means['reference-bi-encoder'][c]):+.1f} "
                  f"points over today's bi-encoder (goal > 0)")
    pick = max(("ensemble", "student"), key=lambda key: means[key]["sts_select"])
    print(f"  the selection split picks {what[pick]} ({means[pick]['sts_select']:.4f} on KorSTS selection)")
    print("  TF-IDF weights picked on the selection split: " + "; ".join(
        f"{key}: " + ", ".join(f"{r['lexical_weight']:g}" for r in runs[key]) for key in ("ensemble-lexical", "student-lexical")))


HYBRID_WEIGHTS = (0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0)


def hybrid_search(out, results, sets):
    """`Embedder.search(..., lexical=w)` on question-pair retrieval with one row's models (`results`, one per
    seed): recall@1 per weight on the selection split and on dev (0: the vectors alone, 1: character n-gram
    TF-IDF fitted on the candidates alone)."""
    import kbert

    found = {}
    for result in results:
        emb = kbert.Embedder.load(os.path.join(out, result["model"]))
        for weight in HYBRID_WEIGHTS:
            def first(queries, candidates, weight=weight):
                return [hits[0][0] for hits in emb.search(queries, candidates, top_k=1, lexical=weight, progress=False)]

            for split in ("qp_select", "qp_dev"):
                found.setdefault(f"{weight:g}", {}).setdefault(split, []).append(
                    retrieval_recall(None, sets[split], first))
    return found


def print_hybrid_table(found, label):
    """The weight the selection split picks, beside the vectors alone and TF-IDF alone."""
    import numpy as np

    mean = {w: {split: float(np.mean(v)) for split, v in by.items()} for w, by in found.items()}
    picked = max((w for w in mean if w not in ("0", "1")), key=lambda w: mean[w]["qp_select"])
    print(f"\n| question-pair retrieval with `Embedder.search`, {label} (mean of {len(found['0']['qp_dev'])} seeds) "
          f"| selection recall@1 | **dev recall@1** |")
    print("|---|---:|---:|")
    for w, name in (("0", "the vectors alone (lexical=0)"), ("1", "character 1-3-gram TF-IDF fitted on the candidates (lexical=1)"),
                    (picked, f"hybrid, lexical={picked} (picked on the selection split)")):
        each = ", ".join(f"{v:.3f}" for v in found[w]["qp_dev"])
        print(f"| {name} | {mean[w]['qp_select']:.4f} | {mean[w]['qp_dev']:.4f} ({each}) |")
    print("(selection recall@1 by weight: " + ", ".join(f"{w}: {mean[w]['qp_select']:.4f}" for w in mean) + ")")


def print_embedding_table(tfidf, runs, sets):
    import numpy as np

    cols = ("sts_select", "qp_select", "sts_dev", "qp_dev")
    print(f"\n| sentence vectors (mean of {len(next(iter(runs.values())))} fine-tuning seeds) | KorSTS selection Spearman "
          f"| question-pair selection recall@1 | **KorSTS dev Spearman** | **question-pair dev recall@1** |")
    print("|---|---:|---:|---:|---:|")
    print("| TF-IDF char 1-3 cosine | " + " | ".join(f"{tfidf[c]:.4f}" for c in cols) + " |")
    labels = {"bi-encoder": "bi-encoder: KorSTS cosine regression (issue 7's recipe)",
              "simcse": "SimCSE only (unsupervised, raw text)",
              "simcse-multi": "SimCSE + multi-dataset (NLI triplets, question pairs, KorSTS) in one run",
              "simcse-pairs-sts": "SimCSE, then NLI triplets + question pairs, then KorSTS regression",
              "simcse-pairs-silver": "the same, the KorSTS regression on the pairs + cross-encoder-scored pairs",
              "simcse-weak-pairs-sts": "SimCSE, then weak pairs (court decisions, statutes), then the same two stages",
              "simcse-weak-mined-sts": "the same, each question pair with a negative mined by the weak-pair model",
              "simcse-weak-gist-sts": "the same, the pairs stage's in-batch negatives filtered by the weak-pair "
                                      "model (GISTEmbed)",
              "simcse-weak-sym-sts": "the same, the pairs stage's in-batch losses both ways (symmetric)"}
    means = {}
    for key, results in runs.items():
        means[key] = {c: float(np.mean([r[c] for r in results])) for c in cols}
        each = {c: ", ".join(f"{r[c]:.3f}" for r in results) for c in cols}
        print(f"| {labels[key]} | " + " | ".join(f"{means[key][c]:.4f} ({each[c]})" for c in cols) + " |")
    # the recipe is the contrastive one that scores best on the selection split (never on a reported set)
    contrastive = [k for k in EMBEDDING_ROWS if k.startswith("simcse-") and k in means]
    chosen = None
    if contrastive:
        chosen = max(contrastive, key=lambda k: means[k]["sts_select"])
        best = means[chosen]
        print(f"chosen on the KorSTS selection split: {labels[chosen]}")
        for c, name in (("sts_select", "KorSTS selection"), ("sts_dev", "KorSTS dev")):
            against = (f", {100 * (best[c] - means['bi-encoder'][c]):+.1f} over the bi-encoder (goal > 0)"
                       if "bi-encoder" in means else "")
            print(f"  on {name}: {100 * (best[c] - tfidf[c]):+.1f} points over TF-IDF (goal >= +5){against}")
    print(f"(selection split: {len(sets['sts_select'])} KorSTS train pairs, {len(paraphrases(sets['qp_select']))} "
          f"question-pair train paraphrases; trained on {len(sets['sts_fit'])} KorSTS pairs, "
          f"{len(paraphrases(sets['qp_fit']))} paraphrases, {len(sets['nli'])} NLI triplets, "
          f"{len(sets['simcse'])} SimCSE lines; reported: {len(sets['sts_dev'])} KorSTS dev pairs, "
          f"{len(paraphrases(sets['qp_dev']))} question-pair dev paraphrases among "
          f"{len({r['question2'] for r in sets['qp_dev']})} candidates)")
    return chosen


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shared", default=os.path.join("..", "shared", "data"))
    parser.add_argument("--out", default=os.path.join(os.path.expanduser("~"), ".cache", "kbert", "quality"))
    parser.add_argument("--minutes", type=float, default=55.0, help="pretraining wall-clock budget")
    parser.add_argument("--steps", type=int, default=None,
                        help="pretraining steps (default: as many as --minutes allows, from a 60-step calibration); "
                             "a fixed step count and seed make runs comparable across machines of different speed; "
                             "0: no masked-LM step, the model as pretraining would start it (its random layers, "
                             "token embeddings from --embedding-init), to measure what the pretraining adds")
    parser.add_argument("--train-examples", type=int, default=150000,
                        help="sentiment training examples (NSMC has 150,000)")
    parser.add_argument("--epochs", type=float, default=2.0,
                        help="sentiment fine-tuning epochs (2: the best of 1/2/3 on run 6, benchmarks/README.md)")
    parser.add_argument("--dev-examples", type=int, default=10000)
    parser.add_argument("--max-length", type=int, default=128,
                        help="sentiment fine-tuning length in tokens ([CLS]/[SEP] included); 64 cuts 1.9%% of dev reviews")
    parser.add_argument("--pooling", choices=("pooler", "mean", "cls", "max"), default="pooler",
                        help="what the sentiment head reads (kbert.finetune's pooling)")
    parser.add_argument("--layers", default="-1", help="with --pooling mean/cls/max: -1, all, or indices like 0,4")
    parser.add_argument("--sts-layers", default="all", help="layers the bi-encoder averages: -1, all, or 0,4")
    parser.add_argument("--sts-dropout", type=float, default=0.0,
                        help="dropout inside the backbone while tuning the bi-encoder (kbert.finetune's default 0)")
    parser.add_argument("--sts-seeds", type=int, default=3,
                        help="bi-encoder fine-tuning seeds (--seed, --seed+1, ...); the table reports their mean: one "
                             "seed's Spearman moves by ~0.3 points from seed to seed (benchmarks/README.md)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--morphemes", choices=("none", "mecab", "kiwi", "okt"), default="none",
                        help="split eojeols into morphemes before the subword vocabulary (kbert.Tokenizer.train's "
                             "morphemes; the JVM analyzers are too slow for 30M characters); none: plain SentencePiece unigram")
    parser.add_argument("--vocab-size", type=int, default=16000,
                        help="unigram vocabulary size (8,000 with --small); a larger vocabulary keeps more content "
                             "words whole, at a larger embedding table")
    parser.add_argument("--embedding-init", choices=("cooccurrence", "random"), default="cooccurrence",
                        help="token embeddings to start pretraining from (trainer.embedding_init)")
    parser.add_argument("--embedding-text", default="pretraining",
                        help="the text the co-occurrence token embeddings are counted on (masked LM still reads "
                             "the pretraining text; trainer.embedding_init_text): pretraining (the pretraining "
                             "text), other (other unlabelled text of --shared: comments, utterances, news, "
                             "questions; write_other_text) or both; with --pretrain-seeds n, a comma-separated list "
                             "gives member k the k-th (cycled)")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="peak pretraining learning rate (default: 1e-3 for mlm, 5e-4 for electra)")
    parser.add_argument("--objective", choices=("mlm", "electra"), default="mlm",
                        help="pretraining objective: masked LM, or ELECTRA's replaced-token detection")
    parser.add_argument("--precision", choices=("auto", "float32", "mixed_bfloat16"), default="auto",
                        help="pretraining precision; auto: mixed_bfloat16 on a CPU with native bf16 instructions "
                             "(1.5x the tokens/s here), else float32 (runs 1-9 in benchmarks/README.md: float32). "
                             "Fine-tuning stays float32")
    parser.add_argument("--only", choices=("all", "embeddings"), default="all",
                        help="embeddings: after the pretraining, only the sentence-embedding table (issue 43)")
    parser.add_argument("--simcse-lines", type=int, default=50000,
                        help="SimCSE lines: the training-side sentences of KorSTS/NLI/question pairs, then pretraining text")
    parser.add_argument("--simcse-lr", type=float, default=1e-4)
    parser.add_argument("--multi-lr", type=float, default=2e-4, help="SimCSE + multi-dataset learning rate")
    parser.add_argument("--multi-epochs", type=float, default=4.0)
    parser.add_argument("--multi-dropout", type=float, default=0.0,
                        help="backbone dropout in the multi-dataset run (0: as the bi-encoder's regression)")
    parser.add_argument("--small", action="store_true", help="a few minutes end to end (checks the chain)")
    parser.add_argument("--pretrain-seeds", type=int, default=1,
                        help="with --only embeddings: n > 1 splits the pretraining budget into n runs of 1/n each "
                             "(seeds --seed, --seed+1, ...; OUT/pretrain-seedK), each running the chosen recipe, "
                             "then scores their ensemble and one student taught by it, each also mixed with TF-IDF")
    parser.add_argument("--zero-step-members", type=int, default=0,
                        help="with --pretrain-seeds n > 1: m more members without a masked-LM step (random layers, "
                             "co-occurrence token embeddings; seeds --seed, --seed+1, ... again, texts from the start "
                             "of --embedding-text, OUT/zero-step-seedK) in the ensemble and the student's teacher: "
                             "no pretraining steps, m more fine-tuning chains")
    # chosen on the selection split (benchmarks/README.md, stop 89): 4 epochs over 2; 6 peak at their fourth
    parser.add_argument("--student-epochs", type=int, default=4,
                        help="with --pretrain-seeds n > 1: the student's epochs on KorSTS train + the scored pairs")
    parser.add_argument("--rows", default="default",
                        help=f"the embedding table's rows to run: default ({','.join(DEFAULT_ROWS)}), all, or "
                             f"some of {','.join(EMBEDDING_ROWS)}, comma-separated (the stages a row starts from "
                             f"run too)")
    args = parser.parse_args()
    if args.max_length < 8:
        parser.error(f"--max-length must be at least 8 tokens, got {args.max_length}")
    unknown = set(args.rows.split(",")) - set(EMBEDDING_ROWS) if args.rows not in ("default", "all") else set()
    if unknown:
        parser.error(f"--rows: unknown {sorted(unknown)}; choose from {','.join(EMBEDDING_ROWS)}")
    if args.pretrain_seeds < 1 or (args.pretrain_seeds > 1 and args.only != "embeddings"):
        parser.error(f"--pretrain-seeds {args.pretrain_seeds}: a whole number >= 1; above 1 only with --only embeddings")
    if args.zero_step_members < 0 or (args.zero_step_members and args.pretrain_seeds == 1):
        parser.error(f"--zero-step-members {args.zero_step_members}: a whole number >= 0, and above 0 only with "
                     f"--pretrain-seeds n > 1 (they join that ensemble)")
    if args.steps is not None and args.steps < 0:
        parser.error(f"--steps must be 0 or more, got {args.steps}")
    texts = args.embedding_text.split(",")
    if set(texts) - set(EMBEDDING_TEXTS) or (len(texts) > 1 and args.pretrain_seeds == 1):
        parser.error(f"--embedding-text: one of {','.join(EMBEDDING_TEXTS)}, or with --pretrain-seeds n > 1 a "
                     f"comma-separated list of them; got {args.embedding_text!r}")
    if texts != ["pretraining"] and args.embedding_init != "cooccurrence":
        parser.error(f"--embedding-text {args.embedding_text} is the text the co-occurrence token embeddings are "
                     f"counted on: it needs --embedding-init cooccurrence, not {args.embedding_init}")
    if args.sts_seeds < 1:
        parser.error(f"--sts-seeds must be at least 1, got {args.sts_seeds}")
    if args.student_epochs < 1:
        parser.error(f"--student-epochs must be at least 1, got {args.student_epochs}")
    # the TF-IDF baselines run after the pretraining: a missing package must stop the run before that hour
    import importlib.util

    if importlib.util.find_spec("sklearn") is None:
        parser.error("the TF-IDF baselines need scikit-learn: pip install scikit-learn (or pip install -e '.[bench]')")
    if args.small:
        args.minutes, args.train_examples, args.dev_examples = 1.0, 2000, 1000
        args.simcse_lines = min(args.simcse_lines, 1000)
        args.out = args.out.rstrip("/") + "-small"
    os.makedirs(args.out, exist_ok=True)

    import kbert
    from kbert.data.recipes import movie_review_sentiment
    from kbert.models.pooling import parse_layers
    from kbert.train.strategy import cpu_has_native_bf16

    if args.precision == "auto":
        args.precision = "mixed_bfloat16" if cpu_has_native_bf16() else "float32"

    t0 = time.time()
    if args.pretrain_seeds > 1:  # the ensemble's pretrainings run as their own cached quality.py runs
        sets, runs = ensemble_stages(args)
        tfidf = stage(args.out, "emb-tfidf", lambda: score_embeddings(tfidf_encoder(sets), sets))
        print_ensemble_table(tfidf, runs, args.pretrain_seeds, args.zero_step_members)
        print(f"(total {(time.time() - t0) / 60:.1f} min this run)")
        return

    reviews = os.path.join(args.shared, "movie-reviews", "reviews.tsv.gz")
    statutes = os.path.join(args.shared, "korean-statutes", "documents.jsonl.gz")
    korsts = os.path.join(args.shared, "korsts")

    # 1. text and vocabulary
    text = os.path.join(args.out, "pretraining.txt")
    data = stage(args.out, "data", lambda: write_pretraining_text(reviews, statutes, text,
                                                                  3e6 if args.small else 60e6))
    tok_dir = os.path.join(args.out, "tokenizer")

    morphemes = None if args.morphemes == "none" else args.morphemes

    def vocabulary():
        lines = (s for doc in kbert.corpus(text) for s in doc)
        tok = kbert.Tokenizer.train(lines, vocab_size=8000 if args.small else args.vocab_size, max_sentences=600_000,
                                    morphemes=morphemes, progress=False, seed=args.seed)
        tok.save(tok_dir)
        return {"vocab_size": tok.vocab_size, "morphemes": args.morphemes}

    vocab = stage(args.out, "vocabulary", vocabulary)
    if not args.small and vocab["vocab_size"] != args.vocab_size:
        sys.exit(f"{args.out} holds a {vocab['vocab_size']}-piece vocabulary, not --vocab-size {args.vocab_size}: "
                 "pass another --out to keep the cached stages consistent")
    # every later stage is cached on top of this vocabulary: another analyzer needs another --out
    if vocab.get("morphemes", "none") != args.morphemes:
        sys.exit(f"{args.out} holds a vocabulary trained with --morphemes {vocab.get('morphemes', 'none')}, not "
                 f"{args.morphemes}: pass another --out (or the same --morphemes) to keep the cached stages consistent")

    # 2. pretraining for a wall-clock budget: a short calibration run sets the step count
    run_dir = os.path.join(args.out, "pretraining")
    config = {"model": {"preset": "bert-mini", "dropout": 0.0, "attention_dropout": 0.0},
              "data": {"source": text, "tokenizer": tok_dir, "objective": args.objective, "max_length": 64,
                       "workers": 1},
              # ELECTRA-Small's learning rate; masked LM trains fastest at 1e-3 here
              "optimizer": {"name": "adamw", "learning_rate": args.learning_rate or (5e-4 if args.objective == "electra" else 1e-3),
                            "warmup_steps": 300, "weight_decay": 0.01},
              "trainer": {"steps": 100_000, "batch_size": 32, "log_every": 10, "checkpoint_every": 250,
                          "embedding_init": args.embedding_init},
              # jit auto: XLA for float32; not for bf16 on CPU, where TensorFlow's own kernels are faster
              "runtime": {"strategy": "cpu", "seed": args.seed, "jit": "auto", "precision": args.precision},
              "output_dir": run_dir}

    def pretraining():
        start = time.time()
        steps = args.steps
        counted_on = embedding_text(args.shared, args.out, text, args.embedding_text)
        if steps == 0:
            return {**untrained_model(config, pre_seed=args.seed, minutes_from=start, text=counted_on),
                    "embedding_text": args.embedding_text}
        if args.embedding_text != "pretraining":  # masked LM still reads the pretraining text
            config["trainer"]["embedding_init_text"] = counted_on
        planned = os.path.join(run_dir, "planned_steps.json")  # a resumed run keeps the step count it planned
        if steps is None and os.path.isfile(planned):
            with open(planned, encoding="utf-8") as f:
                steps = json.load(f)["steps"]
        if steps is None:
            # a short run (inside the warm-up, which does not depend on the total step count); its steady
            # rate leaves out the first step (tracing, XLA compilation)
            summary = kbert.pretrain(config, progress=True, stop_after=60)
            tokens_per_step = config["trainer"]["batch_size"] * config["data"]["max_length"]
            rate = 0.97 * summary["steady_tokens_per_second"] / tokens_per_step  # later steps run a little slower
            left = args.minutes * 60 - (time.time() - start)
            steps = 60 + max(40, int(left * rate))
            with open(planned, "w", encoding="utf-8") as f:
                json.dump({"steps": steps, "calibration_tokens_per_second": rate * tokens_per_step}, f)
        config["trainer"]["steps"] = steps
        summary = kbert.pretrain(config, progress=True)
        # the time of earlier, interrupted calls counts: the figure is the whole pretraining's
        spent = os.path.join(run_dir, "interrupted_minutes.json")
        earlier = 0.0
        if os.path.isfile(spent):
            with open(spent, encoding="utf-8") as f:
                earlier = json.load(f)["minutes"]
        minutes = earlier + (time.time() - start) / 60
        if not summary["finished"]:  # SIGINT/SIGTERM: the checkpoint is saved; a rerun resumes from it
            with open(spent, "w", encoding="utf-8") as f:
                json.dump({"minutes": minutes}, f)
            sys.exit(f"pretraining stopped at step {summary.get('step')} after {minutes:.1f} min; rerun the same "
                     f"command to resume")
        history = summary["history"]
        restore_dropout(summary["model_dir"])
        return {"steps": steps, "tokens_per_second": round(summary["tokens_per_second"]),
                "model_dir": summary["model_dir"], "minutes": round(minutes, 1),
                "first_loss": history[0], "final_loss": float(sum(history[-20:]) / len(history[-20:])),
                "final_mlm_accuracy": summary["mlm_accuracy"], "objective": args.objective,
                "embedding_init": args.embedding_init, "embedding_text": args.embedding_text,
                "precision": args.precision,
                **({"final_rtd_accuracy": summary["rtd_accuracy"]} if "rtd_accuracy" in summary else {})}

    pre = stage(args.out, "pretraining", pretraining)
    counted_on = pre.get("embedding_text", "pretraining")  # runs before the option counted the pretraining text
    if counted_on != args.embedding_text:
        sys.exit(f"{args.out} holds a model with token embeddings counted on the {counted_on} text, not "
                 f"--embedding-text {args.embedding_text}: pass another --out")
    random_dir = os.path.join(args.out, "random-init")
    if not os.path.isdir(random_dir):  # the same architecture and tokenizer, untrained
        import keras

        keras.utils.set_random_seed(args.seed)
        backbone = kbert.load_model(pre["model_dir"])
        fresh = kbert.build_backbone(backbone.config)
        kbert.save_model(fresh, random_dir, tokenizer=kbert.Tokenizer.load(tok_dir))

    def embeddings():  # issue 43: sentence vectors chosen on a selection split, reported on unseen sets
        sets = embedding_sets(args.shared, text, args.simcse_lines, args.seed, args.small)
        tfidf, emb_runs = embedding_stages(args, args.out, pre["model_dir"], sets)
        chosen = print_embedding_table(tfidf, emb_runs, sets)
        if chosen:  # hybrid search (lexical + vectors) with the chosen recipe's models, no training
            found = stage(args.out, f"emb-hybrid-{chosen}-{args.sts_seeds}seeds",
                          lambda: hybrid_search(args.out, emb_runs[chosen], sets))
            print_hybrid_table({k: v for k, v in found.items() if k != "seconds"}, "the chosen recipe")

    if args.only == "embeddings":
        embeddings()
        print(f"(total {(time.time() - t0) / 60:.1f} min this run)")
        return

    # 3. sentiment
    train = movie_review_sentiment(reviews, "train", limit=args.train_examples, seed=args.seed)
    dev = movie_review_sentiment(reviews, "dev", limit=args.dev_examples, seed=args.seed)
    settings = dict(epochs=args.epochs, batch_size=32, learning_rate=2e-4, max_length=args.max_length, patience=None,
                    pooling=args.pooling, layers=parse_layers(args.layers),
                    eval_every=max(1, int(len(train) * args.epochs / 32 / 4)), seed=args.seed, progress=True)
    baseline = stage(args.out, "sentiment-tfidf", lambda: {"accuracy": tfidf_sentiment(train, dev),
                                                           "train": len(train), "dev": len(dev)})
    runs = {}

    def sentiment(name, model_dir):
        # another epoch count is another stage, so one --out dir holds both and the pretraining is reused
        stage_name = f"sentiment-{name}" + ("" if args.epochs == 1 else f"-{args.epochs:g}ep")
        if args.max_length != 64:  # runs before --max-length fine-tuned at 64 under the plain names
            stage_name += f"-len{args.max_length}"
        if args.pooling != "pooler":
            stage_name += f"-{args.pooling}-{args.layers.replace(',', '.')}"
        out_dir = os.path.join(args.out, stage_name)
        runs[name] = stage(args.out, stage_name, lambda: {
            k: v for k, v in kbert.finetune(model_dir, "classification", train, dev, out_dir=out_dir, **settings).items()
            if k in ("best", "best_step", "history", "steps", "checkpoint", "stopped_by")})

    # 4. sentence embeddings
    sts_train, sts_dev = read_sts(os.path.join(korsts, "sts-train.tsv")), read_sts(os.path.join(korsts, "sts-dev.tsv"))
    sts_epochs = 4
    if args.small:
        sts_train, sts_dev, sts_epochs = sts_train[:800], sts_dev[:400], 1
    sts_tfidf = stage(args.out, "sts-tfidf", lambda: {"spearman": tfidf_sts(sts_train, sts_dev)})
    sts_stage = ("sts-bi-encoder" + ("" if args.sts_layers == "-1" else f"-layers-{args.sts_layers.replace(',', '.')}")
                 + f"-dropout-{args.sts_dropout:g}")
    sts_layers = parse_layers(args.sts_layers, "--sts-layers")

    def bi_encoder(seed):
        # the first seed keeps the stage name runs before --sts-seeds wrote, so their dirs are reused
        name = sts_stage + ("" if seed == args.seed else f"-seed{seed}")
        return stage(args.out, name, lambda: {
            k: v for k, v in kbert.finetune(pre["model_dir"], "sentence-embedding", sts_train, sts_dev,
                                            out_dir=os.path.join(args.out, name), text_column="sentence1",
                                            layers=sts_layers,
                                            backbone_dropout=args.sts_dropout, pair_column="sentence2",
                                            label_column="score", epochs=sts_epochs, batch_size=32,
                                            learning_rate=2e-4, max_length=64, patience=None, seed=seed,
                                            progress=True).items()
            if k in ("best", "baseline", "history", "checkpoint", "stopped_by")})

    sts_runs = [bi_encoder(args.seed + i) for i in range(args.sts_seeds)]
    sts_mean = sum(r["best"] for r in sts_runs) / len(sts_runs)
    sentiment("pretrained", pre["model_dir"])

    # 5. the reference last: the same fine-tuning from random initialization (what the pretraining adds)
    sentiment("random-init", random_dir)

    print("\n| measure | kbert | reference |")
    print("|---|---:|---:|")
    objective = pre.get("objective", "mlm")
    rtd = f", replaced-token accuracy {pre['final_rtd_accuracy']:.3f}" if "final_rtd_accuracy" in pre else ""
    if pre["steps"]:
        print(f"| pretraining: steps x batch 32 x seq 64 ({objective}, {pre.get('precision', 'float32')}), tokens/s | {pre['steps']} steps in {pre.get('minutes', '?')} min, "
              f"{pre['tokens_per_second']:,} tok/s, MLM accuracy {pre['final_mlm_accuracy']:.3f}{rtd} (mean of the last 100 steps) | budget {args.minutes:g} min |")
    else:
        print(f"| pretraining: none (--steps 0: {pre['embedding_init']} token embeddings, random layers) | | |")
    print(f"| sentiment dev accuracy, pretrained | {runs['pretrained']['best']:.4f} | TF-IDF char 1-3 + LR "
          f"{baseline['accuracy']:.4f} |")
    print(f"| sentiment dev accuracy, random init | {runs['random-init']['best']:.4f} | gain from pretraining "
          f"{(runs['pretrained']['best'] - runs['random-init']['best']) * 100:+.1f} points |")
    each = ", ".join(f"{r['best']:.4f}" for r in sts_runs)
    print(f"| KorSTS dev Spearman, bi-encoder, mean of {len(sts_runs)} fine-tuning seed(s) | {sts_mean:.4f} ({each}; "
          f"before fine-tuning {sts_runs[0]['baseline']['spearman']:.4f}) | TF-IDF char 1-3 cosine {sts_tfidf['spearman']:.4f} |")
    print(f"\n(pretraining text: {data['reviews_chars'] / 1e6:.1f}M characters of reviews in "
          f"{data['reviews_documents']:,} movies, {data['statutes_chars'] / 1e6:.1f}M of statutes; sentiment {len(train):,} train / "
          f"{len(dev):,} dev)")
    embeddings()
    print(f"(total {(time.time() - t0) / 60:.1f} min this run)")


if __name__ == "__main__":
    main()
