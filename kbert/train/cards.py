"""The model cards `kbert.finetune` (and distillation) and `kbert.pretrain` write when a run ends
(`kbert.models.card` renders them).

The training section is rendered from the run's own settings and results (the config, the rows read, the dev
history, the pretraining summary), so it cannot drift from what ran: the data and each dataset's loss or the
pretraining objective, the settings a rerun needs, and the figures (dev scores at every evaluation; the final
masked-LM loss and accuracy).
"""

from __future__ import annotations

import os
from typing import Optional

from kbert.models.card import TRAINING_END, TRAINING_START, model_card, shown_name, table, write_model_card


def data_name(data) -> str:
    return shown_name(data) if isinstance(data, (str, os.PathLike)) else "rows given in Python"


def loss_text(c, task_name: str) -> str:
    """One dataset's loss, in words (a `FinetuneConfig` or a dataset's config)."""
    if task_name == "sparse-embedding":
        free = (f"inference-free (the anchors read a per-token table trained at learning rate "
                f"{c.query_learning_rate:g}, from the documents' IDF or the starting model's table), "
                if getattr(c, "inference_free", False) else "")
        return (f"SPLADE, {free}in-batch negatives on dot products (SparseMultipleNegativesRankingLoss) + FLOPS "
                f"penalties {c.query_regularizer_weight:g} (anchors) and {c.document_regularizer_weight:g} "
                f"(positives{', hard negatives' if c.negative_column else ''})")
    if task_name != "sentence-embedding":
        if getattr(c, "multi_label", False):
            return "binary cross-entropy, a sigmoid a label (multi-label: a label holds above 0.5)"
        return {"classification": "cross-entropy", "pair-classification": "cross-entropy",
                "regression": "mean squared error on the standardized target",
                "tagging": "cross-entropy on each word's first piece",
                "question-answering": "cross-entropy of the answer's start and end token (mean of the two)"
                }.get(task_name, task_name)
    if c.objective == "simcse":
        text = f"SimCSE: each text twice through dropout is its own positive, in-batch negatives (temperature " \
               f"{c.temperature:g})"
    elif c.label_column:
        return {"cosent": "CoSENT (a ranking loss over the batch's scored pairs)",
                "contrastive": "OnlineContrastiveLoss (pairs labelled 1 / 0; the batch's hard pairs and non-pairs, "
                               "cosine distance, margin 0.5)"}.get(
            c.similarity_loss, "cosine regression onto score / the largest score (CosineSimilarityLoss)")
    else:
        text = f"in-batch negatives (MultipleNegativesRankingLoss, temperature {c.temperature:g})"
        if c.negative_column:
            text += f", a hard negative per row (`{c.negative_column}`)"
    if getattr(c, "symmetric", False):
        text += ", both directions (symmetric)"
    if getattr(c, "guide", None):
        text += f", negatives filtered by the guide {shown_name(c.guide)} (GISTEmbed, margin {c.guide_margin:g})"
    return text


def training_text(c, task, train_ex, dev_ex, summary: dict) -> str:
    """The training section: data, loss, settings, results (`summary`: `kbert.finetune`'s, with the
    `max_length` and `backbone_dropout` the run used)."""
    task_name = task.name
    lines = [TRAINING_START, "", "### Data and loss", ""]
    if c.datasets:
        rows = [(spec.get("name", i + 1), data_name(spec["data"]), f"{len(part):,}", f"{weight:g}",
                 loss_text(sub.config, task_name))
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
    if getattr(c, "lora_rank", None):  # distillation's config has no LoRA
        alpha = c.lora_alpha if c.lora_alpha is not None else c.lora_rank
        settings.append(("LoRA (merged into the weights)", f"lora_rank {c.lora_rank}, lora_alpha {alpha:g}, "
                                                           f"{c.lora_targets} projections"))
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
        own = [name for name in task.loss_names if any(name in h for h in history)]  # each dataset's loss
        columns = (["step", "epoch", "train_loss"] + own
                   + sorted({k for h in history for k in h if k.startswith("dev_")}))
        shown = history if len(history) <= 30 else history[:10] + history[-20:]
        lines += ["", table(columns, [[_cell(h.get(k), k) for k in columns] for h in shown])]
    return "\n".join(lines + ["", TRAINING_END])


def write_finetune_card(c, task, config, meta: dict, train_ex, dev_ex, summary: dict) -> Optional[str]:
    """Writes the card of a finished run into `c.out_dir`; returns its path (None: a user's card was kept, or
    no model was written)."""
    if not os.path.isdir(c.out_dir):
        return None
    task_name = task.name
    name = os.path.basename(os.path.abspath(c.out_dir))
    prompts = meta.get("prompts")
    shown_task = task_name + (" (multi-label: a sigmoid a label)" if meta.get("multi_label") else "")
    details = [("task", shown_task), ("labels", ", ".join(map(str, meta.get("labels") or [])) or None),
               ("max length", f"{meta.get('max_length')} tokens"), ("pooling", _pooling(meta)),
               ("vector width", config.hidden_size if task_name == "sentence-embedding" else None),
               ("prompts", ", ".join(f"{k}: `{v}`" for k, v in prompts.items()) if prompts else None)]
    if task_name == "sentence-embedding":
        usage = (f'import kbert\n\nembedder = kbert.Embedder.load("{name}")\n'
                 f'vectors = embedder.encode(["한국어 문장을 벡터로 바꿉니다.", "문장 임베딩 모델입니다."])  # unit vectors\n'
                 f'print(vectors @ vectors.T)  # cosine similarities\n\n'
                 f'# for sentence-transformers: kbert.export_sentence_transformers("{name}", "{name}-st")')
    elif task_name == "sparse-embedding":
        usage = (f'import kbert\n\nencoder = kbert.SparseEncoder.load("{name}")\n'
                 f'vectors = encoder.encode(["한국어 문장을 벡터로 바꿉니다.", "희소 벡터 모델입니다."])  # scipy CSR\n'
                 f'print(encoder.decode(vectors[0], top_k=10))  # its heaviest tokens\n\n'
                 f'# sentence-transformers reads the same dir: SparseEncoder("{name}")')
    elif task_name == "question-answering":
        usage = (f'import kbert\n\nmodel = kbert.TaskModel.load("{name}")\n'
                 f'print(model.answer("대한민국의 수도는?", "대한민국의 수도는 서울이다."))  # {{"answer", "score", '
                 f'"start", "end"}}')
    else:
        usage = f'import kbert\n\nmodel = kbert.TaskModel.load("{name}")\nprint(model.predict(["정말 재밌어요"]))'
    tags = {"sentence-embedding": ["feature-extraction", "sentence-similarity"],
            "sparse-embedding": ["sparse-encoder", "splade", "feature-extraction"]}.get(task_name, [])
    teacher = meta.get("distilled_from")  # a distilled student: its teacher is where it comes from
    base = teacher or (c.model if isinstance(c.model, (str, os.PathLike)) else None)
    text = model_card(name, config, task_name, base_model=base, details=details, usage=usage,
                      training=training_text(c, task, train_ex, dev_ex, summary), tags=tags,
                      origin="distilled from" if teacher else "fine-tuned from")
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


OBJECTIVES = {"mlm": "masked language modelling", "mlm+nsp": "masked language modelling + next-sentence prediction",
              "mlm+sop": "masked language modelling + sentence-order prediction (ALBERT)",
              "electra": "ELECTRA replaced-token detection (the discriminator is the model kept)"}


def write_pretrain_card(config, model_config, summary: dict, directory: str, continued_from=None) -> Optional[str]:
    """Writes the card of a finished `kbert.pretrain` run's model dir (`directory`, the run's `model/`)."""
    d, o, t, rt = config.data, config.optimizer, config.trainer, config.runtime
    name = os.path.basename(os.path.abspath(config.output_dir))
    source = d.source if isinstance(d.source, (list, tuple)) else [d.source]
    data = ", ".join(shown_name(s if isinstance(s, (str, os.PathLike)) else str(s)) for s in source)
    tokenizer = shown_name(d.tokenizer) if d.tokenizer else "the model's own"
    masking = (f"{d.mask_rate:.0%} of tokens" + (", whole words" if d.whole_word else "")
               + (f", spans up to {d.ngram} words" if d.ngram > 1 else ""))
    lines = [TRAINING_START, "", "### Data and objective", "",
             f"- text: {data}", f"- tokenizer: {tokenizer}, {model_config.vocab_size:,} tokens",
             f"- objective: {OBJECTIVES.get(d.objective, d.objective)}; masking {masking}",
             f"- sequences of {d.max_length} tokens", ""]
    tokens = t.steps * t.batch_size * d.max_length if isinstance(t.batch_size, int) else None
    settings = [("steps", f"{t.steps:,}"), ("batch (all devices)", t.batch_size),
                ("tokens seen", f"{tokens:,}" if tokens else None), ("optimizer", o.name),
                ("learning rate", o.learning_rate),
                ("warm-up steps", o.warmup_steps), ("decay", o.decay), ("weight decay", o.weight_decay),
                ("precision", summary.get("precision")), ("Keras backend", summary.get("backend")),
                ("devices", f"{summary.get('replicas')} x {summary.get('device')}"), ("seed", rt.seed)]
    lines += ["### Settings", "", table(("", ""), [(k, v) for k, v in settings if v is not None]), "",
              "### Results", ""]
    metrics = [(k, summary.get(k)) for k in ("loss", "mlm_accuracy", "rtd_accuracy") if summary.get(k) is not None]
    lines.append(f"At the end (the mean of the last {summary.get('mean_of_steps')} steps): "
                 + ", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in metrics) + ".")
    usage = (f'import kbert\n\nmodel = kbert.load_model("{name}/model")  # the encoder\n'
             f'# fine-tune it: kbert.finetune("{name}/model", "classification", "train.tsv", "dev.tsv")\n'
             f'# as a transformers dir, with its tokenizer (shell): '
             f'kbert convert --model {name}/model --to transformers --out {name}-hf')
    start = f"continued from {shown_name(continued_from)}" if continued_from else "from scratch"
    text = model_card(name, model_config, None, base_model=continued_from, usage=usage,
                      origin="pretrained further from",
                      details=[("pretrained", f"{start}, {OBJECTIVES.get(d.objective, d.objective)}")],
                      training="\n".join(lines + ["", TRAINING_END]), tags=["fill-mask"])
    return write_model_card(directory, text)
