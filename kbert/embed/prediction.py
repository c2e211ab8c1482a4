"""Predictions of a fine-tuned model for every row of a file, and the test-set figures when the file holds the
labels: what google-research/bert's `run_classifier.py --do_predict` and transformers' `run_glue.py --do_predict`
/ `run_qa.py` write for a test set, for the dirs `kbert finetune` writes (and Hugging Face classifiers and
readers). `kbert predict` is the command; the figures are the ones fine-tuning prints for its dev set, so a test
figure and a dev figure compare.

The columns default to the ones the model was fine-tuned on (kept in its `kbert_task.json`), so the command that
trained a model and the one that scores a test file name them once.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from kbert.data.qa import answer_list, qa_scores
from kbert.data.rows import entity_spans, label_targets, number, read_rows, tags, text_cell, text_rows
from kbert.utils import (accuracy, entity_scores, macro_f1, multi_label_figures, pearson, per_label_figures,
                         progress_bar, spearman)

# the columns of a model without a record of its own (a Hugging Face classifier or reader)
DEFAULT_COLUMNS = {"question-answering": ("question", "context", "answers")}
FIGURES_OF = ("classification", "pair-classification", "regression", "question-answering", "tagging")


def task_columns(model, text_column: Optional[str] = None, pair_column: Optional[str] = None,
                 label_column: Optional[str] = None) -> Tuple[str, Optional[str], Optional[str]]:
    """(text, pair, label) column names: those given, else the model's fine-tuning columns, else the task's
    usual names ("text" and "label"; question answering: "question", "context", "answers")."""
    meta = model.meta or {}
    text_d, pair_d, label_d = DEFAULT_COLUMNS.get(model.task, ("text", None, "label"))
    return (text_column or meta.get("text_column") or text_d,
            pair_column or meta.get("pair_column") or pair_d,
            label_column or meta.get("label_column") or label_d)


CHUNK = 1024  # rows a call of the model's method: the progress bar moves a chunk at a time


def _in_chunks(method, texts, pairs, bar, **options):
    """`method(texts, pairs)` over chunks of CHUNK rows, joined (arrays stacked, lists concatenated)."""
    parts = []
    for start in range(0, len(texts), CHUNK):
        args = (texts[start:start + CHUNK],) + ((pairs[start:start + CHUNK],) if pairs is not None else ())
        part = method(*args, **options)
        parts.append([part] if isinstance(part, dict) else part)  # `answer` of one question: its dict
        bar.update(len(args[0]))
    if parts and isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    return [x for part in parts for x in part]


def predict_rows(model, data, text_column: Optional[str] = None, pair_column: Optional[str] = None,
                 label_column: Optional[str] = None, names: Optional[Sequence[str]] = None,
                 batch_size: int = 64, progress: bool = False) -> Tuple[List[dict], Optional[Dict[str, float]]]:
    """(one prediction a row, the figures against the rows' labels or None) of a `TaskModel` on `data` (a
    TSV/CSV/JSONL/SQuAD file, a header-less one with `names`, a .txt of lines for one-text tasks, or a list of
    dicts). `progress`: a bar of rows on stderr.

    A prediction is `{"row": n}` (from 1, in the file's order; a question-answering row's `id` too) with:
    classification and pair-classification `label`, `score` (its probability) and `scores` (every label's; a
    multi-label classifier: `labels`, those over 0.5, and `scores`);
    regression `score`; tagging `tags` ([word, tag] pairs) or, for an entity tagger, `entities` (as
    `TaskModel.entities`); question answering `answer`, `score`, `start`, `end` (as `TaskModel.answer`).

    The figures (with `label_column` and `rows`) are computed when every row has a label in `label_column` (named or
    the model's own): accuracy and macro-F1 (classes; multi-label: micro-F1, macro-F1, subset accuracy), Spearman,
    Pearson and MSE (regression), KorQuAD's exact match and F1 (question answering); for a tagger of word tags (UD's
    `upos`) accuracy and macro-F1 over the words it tagged, and for an entity tagger entity precision, recall and F1
    over character spans, an entity counting when its span and type are exact (KLUE-NER's entity-level measure;
    fine-tuning's dev figure counts whole tokens instead, so the two may differ where an entity ends inside a
    token). Classes (and multi-label labels) add `per_label`: each label's precision, recall, F1 and support, as
    scikit-learn's classification_report. A class label the model does not have is an error naming its row.
    """
    if model.task == "sentence-embedding":
        raise ValueError("a sentence-embedding model gives vectors, not predictions: use `kbert embed` or "
                         "`kbert evaluate` (or Embedder.encode)")
    text_col, pair_col, label_col = task_columns(model, text_column, pair_column, label_column)
    if pair_col is None and model.task in ("pair-classification", "question-answering"):
        raise ValueError(f"a {model.task} model reads two texts a row: name the second one's column "
                         f"(`pair_column`, --pair-column)")
    needs_pair = pair_col is not None and model.task != "tagging"
    if needs_pair:
        rows = read_rows(data, [text_col, pair_col] + ([label_column] if label_column else []), names=names)
    elif isinstance(data, str) and data.endswith((".txt", ".txt.gz")) and names is None:
        rows = text_rows(data, text_col)
    else:
        rows = read_rows(data, [text_col] + ([label_column] if label_column else []), names=names)
    texts = [text_cell(r, text_col, f"row {i + 1}") for i, r in enumerate(rows)]
    pairs = [text_cell(r, pair_col, f"row {i + 1}") for i, r in enumerate(rows)] if needs_pair else None
    gold = [r.get(label_col) for r in rows]
    multi_label = getattr(model, "multi_label", False)  # an empty cell is a row with none of the labels

    def given(g):
        return g is not None and (g != "" or multi_label)

    labelled = all(given(g) for g in gold) and model.task in FIGURES_OF
    if label_column and not labelled and model.task in FIGURES_OF:
        empty = next(i for i, g in enumerate(gold) if not given(g))
        raise ValueError(f"row {empty + 1} has no {label_column!r} to score the prediction against")
    out = [{"row": i + 1} for i in range(len(rows))]
    figures = None
    bar = progress_bar(total=len(rows), desc=f"predict {model.task}", unit="row", enabled=progress)
    if model.task == "question-answering":
        found = _in_chunks(model.answer, texts, pairs, bar, batch_size=batch_size)
        for o, r, a in zip(out, rows, found):
            if r.get("id") is not None:
                o["id"] = r["id"]
            o.update(answer=a["answer"], score=round(float(a["score"]), 6), start=a["start"], end=a["end"])
        if labelled:
            truths = {str(i): [t for t, _ in answer_list(g, c, f"row {i + 1}")]
                      for i, (g, c) in enumerate(zip(gold, pairs))}
            figures = qa_scores({str(i): o["answer"] for i, o in enumerate(out)}, truths)
    elif model.task == "tagging" and (model.meta or {}).get("aggregation"):  # an entity tagger: its spans
        found = _in_chunks(model.entities, texts, None, bar, batch_size=batch_size)
        for o, entities in zip(out, found):
            o["entities"] = [{k: (round(float(v), 6) if k == "score" else v) for k, v in e.items()} for e in entities]
        if labelled:
            gold_spans = []
            for i, g in enumerate(gold):
                spans = entity_spans(g, "data", i)
                if spans is None:
                    raise ValueError(f"row {i + 1}'s {label_col!r} is word tags, not entity spans; this model "
                                     "tags entities")
                gold_spans.append(set(spans))
            figures = entity_scores(gold_spans, [{(e["start"], e["end"], e["entity_group"]) for e in entities}
                                                 for entities in found])
    elif model.task == "tagging":
        tagged = _in_chunks(model.predict, texts, None, bar, batch_size=batch_size)
        for o, words in zip(out, tagged):
            o["tags"] = [list(t) for t in words]
        if labelled:  # the words the model tagged (a text cut at max_length: its first words)
            index = {k: j for j, k in enumerate(model.labels)}
            unknown = len(model.labels)  # a gold tag the model never learnt: a class of its own, never predicted
            y, p = [], []
            for i, (g, words) in enumerate(zip(gold, tagged)):
                gold_tags = tags(g, "data", i)
                if len(gold_tags) < len(words):
                    raise ValueError(f"row {i + 1} has {len(gold_tags)} tags in {label_col!r} for "
                                     f"{len(words)} words")
                y += [index.get(t, unknown) for t in gold_tags[:len(words)]]
                p += [index[t] for _, t in words]
            figures = {"accuracy": accuracy(y, p), "macro_f1": macro_f1(y, p, unknown + 1)}
    elif model.task == "regression":
        values = np.asarray(_in_chunks(model.predict, texts, pairs, bar, batch_size=batch_size), np.float64)
        for o, v in zip(out, values):
            o["score"] = round(float(v), 6)
        if labelled:
            y = np.array([number(g, "data", i) for i, g in enumerate(gold)], np.float64)
            figures = {"spearman": spearman(values, y), "pearson": pearson(values, y),
                       "mse": float(np.mean((values - y) ** 2))}
    elif multi_label:  # each label its own probability; those over 0.5 hold
        labels = [str(x) for x in model.labels]
        probs = np.asarray(_in_chunks(model.predict, texts, pairs, bar, batch_size=batch_size))
        for o, p in zip(out, probs):
            o.update(labels=[k for k, x in zip(labels, p) if x > 0.5],
                     scores={k: round(float(x), 6) for k, x in zip(labels, p)})
        if labelled:
            y = label_targets(gold, labels, "data", multi_label=True) > 0
            figures = {**multi_label_figures(y, probs > 0.5), "per_label": per_label_figures(y, probs > 0.5, labels)}
    else:
        labels = [str(x) for x in model.labels]
        probs = _in_chunks(model.predict, texts, pairs, bar, batch_size=batch_size)
        best = np.argmax(probs, axis=1)
        for o, p, b in zip(out, probs, best):
            o.update(label=labels[b], score=round(float(p[b]), 6),
                     scores={k: round(float(x), 6) for k, x in zip(labels, p)})
        if labelled:
            y = label_targets(gold, labels, "data")
            figures = {"accuracy": accuracy(y, best), "macro_f1": macro_f1(y, best, len(labels)),
                       "per_label": per_label_figures(y, best, labels)}
    bar.close()
    if figures is not None:
        figures = {"label_column": label_col, "rows": len(rows), **figures}
    return out, figures
