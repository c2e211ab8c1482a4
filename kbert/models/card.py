"""Model cards: the README.md a trained model dir (and its sentence-transformers export) carries.

The Hugging Face Hub shows a model's README.md as its page, and reads the YAML block at its top for search
(`language`, `library_name`, `pipeline_tag`, `base_model`, `tags`). transformers' Trainer and
sentence-transformers write one when they save a trained model, so a model trained there can be uploaded as it
is and says what it is; a kbert model dir gets the same: what the model is, how to load it, and how it was
trained (data, loss, settings, the dev figures by evaluation). The card is rendered from values the caller
passes (no model is loaded here); `kbert.finetune`, `kbert.distill` and `kbert.pretrain` write one when a run
ends (`kbert.train.cards`), and `kbert.export_sentence_transformers` writes the sentence-transformers form,
carrying the training section of the source dir's card.

A README.md that kbert did not write (it lacks `MARKER`) is never replaced: it is the user's.
"""

from __future__ import annotations

import os
import pathlib
import platform
from typing import List, Optional, Sequence

from kbert.utils import write_atomic

CARD_FILE = "README.md"
MARKER = "<!-- This model card was written by kbert"
TRAINING_START, TRAINING_END = "<!-- kbert:training -->", "<!-- kbert:/training -->"

PIPELINE_TAGS = {"sentence-embedding": "sentence-similarity", "classification": "text-classification",
                 "pair-classification": "text-classification", "regression": "text-classification",
                 "tagging": "token-classification", "question-answering": "question-answering"}
WHAT = {"sentence-embedding": "a sentence-embedding model (a bi-encoder: one unit vector per text, compared by cosine)",
        "classification": "a text classifier", "pair-classification": "a sentence-pair classifier",
        "regression": "a text regressor (one number per text or pair)",
        "tagging": "a token tagger (one tag per whitespace word)",
        "question-answering": "an extractive question-answering model (the answer is a span of the context)"}


def is_hub_name(name) -> bool:
    """Whether `name` reads as a Hub id ("owner/name") rather than a path on this machine."""
    name = os.fspath(name) if name is not None else ""
    return (name.count("/") == 1 and not name.startswith((".", "/", "~")) and not os.path.exists(name)
            and all(part.strip() for part in name.split("/")))


def shown_name(name) -> str:
    """How a card names a model: a Hub id as it is, a path by its last part (a card is for others to read, and
    this machine's paths mean nothing to them)."""
    text = os.fspath(name)
    if is_hub_name(text):
        return f"`{text}`"
    parent, last = os.path.split(os.path.abspath(text))
    if last == "model" and os.path.basename(parent):  # a pretraining run's OUT/model: "model" names nothing
        last = f"{os.path.basename(parent)}/model"
    return f"`{last or text}`"


def training_section(directory: str) -> Optional[str]:
    """The training section (markers included) of the kbert-written card in `directory`, or None."""
    path = os.path.join(directory, CARD_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start, end = text.find(TRAINING_START), text.find(TRAINING_END)
    if MARKER not in text or start < 0 or end < start:
        return None
    return text[start:end + len(TRAINING_END)]


def table(header: Sequence[str], rows: List[Sequence]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(" ".join(str(cell).split("\n")).replace("|", "\\|") for cell in row) + " |"
              for row in rows]  # one line a row: a cell's newlines would end the table
    return "\n".join(lines)


def model_card(name: str, config, task: Optional[str], library: str = "kbert", base_model=None,
               details: Sequence[tuple] = (), usage: str = "", training: Optional[str] = None,
               tags: Sequence[str] = (), origin: str = "fine-tuned from") -> str:
    """The card's text.

    name: the model's title; config: its `ModelConfig` (or None); task: one of the fine-tuning tasks (or None);
    library: "kbert" or "sentence-transformers" (which loader the Hub shows); base_model: where it started (a
    Hub id is put in the YAML block, any other name only in the text, after `origin`); details: (field, value)
    rows of the model table; usage: a code block's text; training: the training section (`training_section`'s
    form)."""
    import keras

    front = ["---", "language:", "- ko", f"library_name: {library}"]
    if task in PIPELINE_TAGS:
        front.append(f"pipeline_tag: {PIPELINE_TAGS[task]}")
    if base_model is not None and is_hub_name(base_model):
        front.append(f"base_model: {base_model}")
    front += ["tags:"] + [f"- {t}" for t in dict.fromkeys(["kbert", *(tags or ()), *([task] if task else [])])]
    front.append("---")
    body = [MARKER + "; edit it freely: kbert replaces only a card that still has this line. -->", "",
            f"# {name}", ""]
    start = f" {origin} {shown_name(base_model)}" if base_model else ""
    body += [f"This is {WHAT.get(task, 'a Korean BERT-family model')}{start}, trained with kbert.", ""]
    rows = []
    if config is not None:
        arch = f"{config.architecture.upper()}, {config.num_layers} layers, {config.hidden_size} wide, " \
               f"{config.num_heads} heads"
        rows += [("architecture", arch), ("parameters", f"{config.num_parameters():,}"),
                 ("vocabulary", f"{config.vocab_size:,} tokens")]
    rows += [(k, v) for k, v in details if v not in (None, "", [], {})]
    if rows:
        body += ["## Model", "", table(("", ""), rows), ""]
    if usage:
        body += ["## Use", "", "```python", usage.strip(), "```", ""]
    if training:
        body += ["## Training", "", training, ""]
    versions = [("kbert", _version()), ("Keras", keras.__version__), ("Keras backend", keras.backend.backend()),
                ("Python", platform.python_version())]
    body += ["## Framework versions", "", "\n".join(f"- {k}: {v}" for k, v in versions), ""]
    return "\n".join(front + body)


def write_model_card(directory: str, text: str) -> Optional[str]:
    """Writes `text` as `directory`/README.md unless a README.md kbert did not write is there; returns the path
    written, or None when the user's own card was kept."""
    path = os.path.join(directory, CARD_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            if MARKER not in f.read():
                return None
    write_atomic(path, lambda tmp: pathlib.Path(tmp).write_text(text, encoding="utf-8"))
    return path


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kbert")
    except Exception:  # a source checkout that was never installed
        return "unknown"
