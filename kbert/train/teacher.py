"""A model dir loaded once to score texts before a run trains: distillation's teacher (`kbert.train.distill`)
and a sentence-embedding run's guide (`kbert.finetune(..., guide=...)`, GISTEmbed's in-batch false-negative
filter). Both need the same thing: a dir of any kbert-loadable kind (a kbert task dir, a sentence-transformers
dir, a Hugging Face checkpoint) turned into outputs or unit vectors for raw texts on its own tokenization,
then its weights dropped before the student trains.

Shapes: n = texts, k = a task head's outputs, h_t = the model's hidden size.
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence

import numpy as np

from kbert.compiled import backend, compiled, signature
from kbert.data.features import bucketed, build_network, features, pad, unit_vectors_in_batches
from kbert.models.st_dir import apply_dense, dense_width
from kbert.models.locate import read_task_meta
from kbert.utils import progress_bar


class Teacher:
    """A teacher dir loaded once to score texts; `release()` drops its weights before the student trains."""

    # a bar over the teacher's scoring passes from this many texts up: task mode scores the whole transfer
    # set (hundreds of thousands of texts) before the student's first step, else a long silent wait
    BAR_FROM = 2048

    def __init__(self, model_dir: str, mode: str, dtype: Optional[str] = None, progress: bool = False,
                 role: str = "teacher"):
        from kbert.models.convert import load_model
        from kbert.models.st_dir import read_sentence_transformers
        from kbert.models.tasks import TaskNetwork, load_task_head
        from kbert.text.tokenizer import Tokenizer

        self.dir, self.meta = model_dir, read_task_meta(model_dir) or {}
        # a sentence-transformers teacher (BGE-M3, KURE, ...): its transformer's folder, pooling and layers
        # (its Dense layers too, as sentence vectors: LaBSE's tanh layer)
        st = None if self.meta else read_sentence_transformers(model_dir, projections=mode == "embedding")
        self.dense = (st or {}).get("dense") or []
        weights_dir = st["model_dir"] if st else model_dir
        self.progress, self.role = progress, role  # the role names the progress bars ("guide vectors")
        self.tokenizer = Tokenizer.from_model_dir(weights_dir)
        self._fn = None
        backbone = load_model(weights_dir, output_hidden_states=True, dtype=dtype)
        self.hidden_size = dense_width(self.dense, backbone.config.hidden_size)
        self.config = backbone.config
        if mode == "general":
            self.heads = True
            meta_path = os.path.join(model_dir, "kbert_config.json")
            if os.path.isfile(meta_path):
                import json

                with open(meta_path, encoding="utf-8") as f:
                    self.heads = bool(json.load(f).get("heads", {}).get("pretraining"))
            if not self.heads:
                raise ValueError(f"mode='general' learns the teacher's masked-LM distribution, and {model_dir!r} has "
                                 f"no masked-LM head (a backbone-only dir): use a `kbert pretrain` output, or "
                                 f"mode='embedding'")
            self.network = load_model(model_dir, with_heads=True, dtype=dtype)
            self.network.trainable = False
            return
        if mode == "task":
            task = self.meta.get("task")
            labels = self.meta.get("labels") or []
            num = 1 if task == "regression" else len(labels)
            layers = self.meta.get("layers")
            self.network = TaskNetwork(backbone, task, num, 0.0, self.meta.get("target") or (0.0, 1.0),
                                       self.meta.get("pooling"), -1 if layers is None else layers)
            build_network(self.network, self.tokenizer)
            load_task_head(self.network, model_dir)
        else:
            pooling, layers = "mean", -1
            if self.meta.get("task") == "sentence-embedding":
                pooling, layers = self.meta.get("pooling") or "mean", self.meta.get("layers", -1)
            elif st:
                pooling, layers = st["pooling"], st["layers"]
            self.pooling, self.layers = pooling, layers
            self.network = TaskNetwork(backbone, "sentence-embedding", 0, 0.0, (0.0, 1.0), pooling, layers)
            build_network(self.network, self.tokenizer)

    def call(self, ids, segments):
        if self._fn is None:
            self._fn = compiled(lambda x: self.network(x, training=False), self.network.variables,
                                signature({"token_ids": 2, "segment_ids": 2, "padding_mask": 2}))
        rows = len(ids)
        if backend() == "jax":  # JAX compiles each shape: a few bucketed ones, the padding dropped after
            limit = self.config.max_position
            ids, segments = bucketed(ids, self.tokenizer.pad_id, limit, rows=True), bucketed(segments, 0, limit, rows=True)
        return np.asarray(self._fn(features(ids, segments, self.tokenizer.pad_id)), np.float32)[:rows]

    def sentence_vectors(self, ids, segments):
        """Pooled vectors of a batch, through the dir's Dense layers when it has them."""
        return apply_dense(self.call(ids, segments), self.dense) if self.dense else self.call(ids, segments)

    def outputs(self, token_ids: List[List[int]], segment_ids: List[List[int]], batch_size: int = 64):
        """The task head's outputs `[n, k]` (logits, or `[n, 1]` values) for encoded examples, in order."""
        out = [None] * len(token_ids)
        order = np.argsort([len(x) for x in token_ids], kind="stable")  # little padding per batch
        bar = self.bar(len(order), f"{self.role} outputs")
        for start in range(0, len(order), batch_size):
            index = order[start:start + batch_size]
            ids = pad([token_ids[i] for i in index], self.tokenizer.pad_id)
            segs = pad([segment_ids[i] for i in index], 0, ids.shape[1])
            for i, row in zip(index, self.call(ids, segs)):
                out[i] = row
            bar.update(len(index))
        bar.close()
        return np.stack(out).astype(np.float32) if out else np.zeros((0, 1), np.float32)

    def vectors(self, texts: Sequence[str], max_length: int, batch_size: int = 64) -> np.ndarray:
        """Unit sentence vectors `[n, h_t]` of raw texts, tokenized by the teacher's own tokenizer (h_t: its last
        Dense layer's width, if it has one)."""
        ids = [e.ids for e in self.tokenizer.encode_batch(list(texts), max_length=max_length)]
        order = np.argsort([len(x) for x in ids], kind="stable")
        out = np.zeros((len(ids), self.hidden_size), np.float32)
        bar = self.bar(len(order), f"{self.role} vectors")
        for start in range(0, len(order), 4096):
            index = order[start:start + 4096]
            out[index] = unit_vectors_in_batches(self.sentence_vectors, [ids[i] for i in index],
                                                 self.tokenizer.pad_id, batch_size)
            bar.update(len(index))
        bar.close()
        return out

    def bar(self, total: int, desc: str):
        return progress_bar(total, desc, unit="text", enabled=self.progress and total >= self.BAR_FROM)

    def release(self):
        self.network = self._fn = None
        import gc

        gc.collect()
