"""The model card `kbert.finetune` writes into its output dir when a run ends (`kbert.models.card`).

Its training section is rendered from the run's own settings and results (the config, the rows read, the dev
history), so it cannot drift from what ran: the data and each dataset's loss, the settings a rerun needs, and
the dev figures before training and at every evaluation.
"""

from __future__ import annotations

import os
from typing import Optional

from kbert.models.card import TRAINING_END, TRAINING_START, model_card, table, write_model_card


def data_name(data) -> str:
    return f"`{os.path.basename(os.fspath(data))}`" if isinstance(data, (str, os.PathLike)) else "rows given in Python"


def loss_text(c, task_name: str) -> str:
    """One dataset's loss, in words (a `FinetuneConfig` or a dataset's config)."""
    if task_name != "sentence-embedding":
        return {"classification": "cross-entropy", "pair-classification": "cross-entropy",
                "regression": "mean squared error on the standardized target",
                "tagging": "cross-entropy on each word's first piece"}.get(task_name, task_name)
    if c.objective == "simcse":
        text = f"SimCSE: each text twice through dropout is its own positive, in-batch negatives (temperature " \
               f"{c.temperature:g})"
    elif c.label_column:
        return ("CoSENT (a ranking loss over the batch's scored pairs)" if c.similarity_loss == "cosent"
                else "cosine regression onto score / the largest score (CosineSimilarityLoss)")
    else:
        text = f"in-batch negatives (MultipleNegativesRankingLoss, temperature {c.temperature:g})"
        if c.negative_column:
            text += f", a hard negative per row (`{c.negative_column}`)"
    if getattr(c, "symmetric", False):
        text += ", both directions (symmetric)"
    if getattr(c, "guide", None):
        text += f", negatives filtered by the guide `{c.guide}` (GISTEmbed, margin {c.guide_margin:g})"
    return text


def training_text(c, task, train_ex, dev_ex, summary: dict) -> str:
    """The training section: data, loss, settings, results (`summary`: `kbert.finetune`'s, with the
    `max_length` and `backbone_dropout` the run used)."""
    task_name = task.name
    lines = [TRAINING_START, "", "### Data and loss", ""]
    if c.datasets:
        rows = [(i + 1, data_name(spec["data"]), f"{len(part):,}", f"{weight:g}", loss_text(sub.config, task_name))
                for i, (spec, part, (sub, weight)) in enumerate(zip(c.datasets, train_ex.parts, task.parts))]
        lines += [f"{len(rows)} datasets in one run, every batch from one of them ({c.mix}):", "",
                  table(("", "data", "rows", "weight", "loss"), rows), ""]
    else:
        loss = getattr(task, "loss_description", None) or loss_text(c, task_name)  # distillation says its own
        lines += [f"- train: {data_name(c.train)}, {len(train_ex):,} rows", f"- loss: {loss}"]
    if c.matryoshka_dims:
        lines.append(f"- Matryoshka: the loss also trains the vectors cut to {sorted(set(c.matryoshka_dims))} dims")
    if dev_ex is not None:
        lines.append(f"- dev: {data_name(c.dev)}, {len(dev_ex):,} rows; the model kept is the best by "
                     f"{summary['metric']}")
    settings = [("epochs", c.epochs), ("batch size", c.batch_size), ("learning rate", c.learning_rate),
                ("warm-up", c.warmup), ("weight decay", c.weight_decay), ("max length", summary["max_length"]),
                ("dropout in the backbone", summary["backbone_dropout"]), ("seed", c.seed),
                ("dtype", c.dtype or "float32"), ("rows per forward pass", c.mini_batch_size),
                ("training prompts", c.prompts), ("max steps", c.max_steps)]
    lines += ["", "### Settings", "", table(("", ""), [(k, v) for k, v in settings if v is not None]), "",
              "### Results", ""]
    steps = f"{summary['steps']:,} steps" + (f" (early stopping: no better dev score in {c.patience} evaluations)"
                                             if summary["stopped_by"] == "early_stopping" else "")
    if summary["metric"] is None:
        lines.append(f"{steps}; no dev set, so the last model is the one kept.")
    else:
        baseline = summary["baseline"] or {}
        before = f"{baseline[summary['metric']]:.4f} before training, " if summary["metric"] in baseline else ""
        lines.append(f"{steps}. Dev {summary['metric']}: {before}**{summary['best']:.4f}** at step "
                     f"{summary['best_step']:,} (the model kept).")
    history = summary["history"]
    if history:
        columns = ["step", "epoch", "train_loss"] + sorted({k for h in history for k in h if k.startswith("dev_")})
        shown = history if len(history) <= 30 else history[:10] + history[-20:]
        lines += ["", table(columns, [[_cell(h.get(k), k) for k in columns] for h in shown])]
    return "\n".join(lines + ["", TRAINING_END])


def write_finetune_card(c, task, config, meta: dict, train_ex, dev_ex, summary: dict) -> Optional[str]:
    """Writes the card of a finished run into `c.out_dir`; returns its path (None: a user's card was kept)."""
    task_name = task.name
    name = os.path.basename(os.path.abspath(c.out_dir))
    prompts = meta.get("prompts")
    details = [("task", task_name), ("labels", ", ".join(map(str, meta.get("labels") or [])) or None),
               ("max length", f"{meta.get('max_length')} tokens"), ("pooling", _pooling(meta)),
               ("vector width", config.hidden_size if task_name == "sentence-embedding" else None),
               ("prompts", ", ".join(f"{k}: `{v}`" for k, v in prompts.items()) if prompts else None)]
    if task_name == "sentence-embedding":
        usage = (f'import kbert\n\nembedder = kbert.Embedder.load("{name}")\n'
                 f'vectors = embedder.encode(["한국어 문장을 벡터로 바꿉니다.", "문장 임베딩 모델입니다."])  # unit vectors\n'
                 f'print(vectors @ vectors.T)  # cosine similarities\n\n'
                 f'# for sentence-transformers: kbert.export_sentence_transformers("{name}", "{name}-st")')
    else:
        usage = f'import kbert\n\nmodel = kbert.TaskModel.load("{name}")\nprint(model.predict(["정말 재밌어요"]))'
    tags = ["feature-extraction", "sentence-similarity"] if task_name == "sentence-embedding" else []
    text = model_card(name, config, task_name, base_model=c.model if isinstance(c.model, str) else None,
                      details=details, usage=usage, training=training_text(c, task, train_ex, dev_ex, summary),
                      tags=tags)
    return write_model_card(c.out_dir, text)


def _pooling(meta: dict) -> Optional[str]:
    pooling, layers = meta.get("pooling"), meta.get("layers")
    if pooling is None:
        return None
    if layers in (None, -1):
        return pooling
    return f"{pooling} over layers {layers}"


def _cell(value, column: str = "") -> str:
    if isinstance(value, float) and column != "epoch":
        return f"{value:.4f}"
    return "" if value is None else str(value)
