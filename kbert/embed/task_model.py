"""`TaskModel`: predictions from a fine-tuned task dir (`kbert finetune`'s output)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from kbert.data.features import bucketed, build_network, features, first_pieces, pad
from kbert.data.features import segment_ids, text_list
from kbert.data.features import unit_vectors_in_batches, word_spans
from kbert.compiled import backend, compiled, signature
from kbert.models.tasks import TASK_FILE, TaskNetwork, load_task_head, read_task_meta, save_task_head


class TaskModel:
    """A fine-tuned model: backbone, task head, tokenizer and label names.

    Example:
        >>> model = kbert.TaskModel.load("sentiment-model")
        >>> model.predict(["재밌어요", "최악"])     # class probabilities [2, num_labels]
        >>> model.labels                            # ['0', '1']
    """

    def __init__(self, network: TaskNetwork, tokenizer, meta: dict, jit_compile: bool = False):
        """jit_compile: predict through XLA (each batch padded to a bucketed shape, compiled the first time it
        is met, about a second each): fewer, fused kernels instead of the graph executor's per-op dispatch,
        which on a CPU weighs most on small models and batches."""
        self.network, self.tokenizer, self.meta = network, tokenizer, meta
        self.jit_compile = bool(jit_compile) or backend() == "jax"  # JAX compiles every (bucketed) shape
        self.task, self.labels = meta["task"], meta.get("labels")
        self.max_length = meta.get("max_length", 128)
        self.embedder = None  # set by `load`: an Embedder on the same backbone
        self._fn = None

    @classmethod
    def load(cls, model_dir: str, dtype: Optional[str] = None, jit_compile: bool = False) -> "TaskModel":
        from kbert.embed.embedder import Embedder

        meta = read_task_meta(model_dir)
        if meta is None:
            raise FileNotFoundError(f"{model_dir!r} is not a fine-tuned model dir: {TASK_FILE} is missing "
                                    f"(`kbert finetune` writes it)")
        emb = Embedder.load(model_dir, dtype=dtype)
        labels = meta.get("labels") or []
        num = 1 if meta["task"] == "regression" else len(labels)
        layers = meta.get("layers")
        network = TaskNetwork(emb.backbone, meta["task"], num, 0.0, meta.get("target") or (0.0, 1.0),
                              meta.get("pooling"), -1 if layers is None else layers)
        build_network(network, emb.tokenizer)
        load_task_head(network, model_dir)
        model = cls(network, emb.tokenizer, meta, jit_compile=jit_compile)
        model.embedder = emb  # the same backbone, for sentence vectors (`kbert serve` uses both)
        return model

    def save(self, model_dir: str) -> str:
        from kbert.models.io import save_model

        save_model(self.network.backbone, model_dir, tokenizer=self.tokenizer)
        save_task_head(self.network, self.meta, model_dir)
        return model_dir

    def _call(self, ids, segments):
        if self._fn is None:
            # TensorFlow: one trace for every shape (XLA then compiles each bucketed shape); JAX: one compile
            # per bucketed shape
            self._fn = compiled(lambda x: self.network(x, training=False), self.network.variables,
                                signature({"token_ids": 2, "segment_ids": 2, "padding_mask": 2}),
                                jit_compile=self.jit_compile)
        rows = len(ids)
        if self.jit_compile:  # pad to a bucketed shape: extra rows are padding, their outputs dropped
            limit = min(self.max_length, self.network.backbone.config.max_position)
            ids = bucketed(ids, self.tokenizer.pad_id, limit, rows=True)
            segments = bucketed(segments, 0, limit, rows=True)
        return np.asarray(self._fn(features(ids, segments, self.tokenizer.pad_id)), np.float32)[:rows]

    def predict(self, texts, pairs=None, batch_size: int = 64):
        """classification / pair-classification: probabilities `[n, labels]`; regression: values `[n]`;
        tagging: for each text a list of `(word, tag)`; sentence-embedding: unit vectors `[n, hidden]`."""
        single = isinstance(texts, (str, bytes))
        texts = text_list(texts)
        if pairs is not None:
            pairs = text_list(pairs)
        if self.task == "sentence-embedding":
            ids = [e.ids for e in self.tokenizer.encode_batch(texts, max_length=self.max_length)]
            out = unit_vectors_in_batches(self._call, ids, self.tokenizer.pad_id, batch_size)
            return out[0] if single else out
        encodings = self.tokenizer.encode_batch(texts, pairs=pairs, max_length=self.max_length)
        rows = [None] * len(encodings)
        # batches of similar length (little padding), results put back in input order
        order = np.argsort([len(e.ids) for e in encodings], kind="stable")
        for start in range(0, len(encodings), batch_size):
            index = order[start:start + batch_size]
            chunk = [encodings[i] for i in index]
            ids = [e.ids for e in chunk]
            segs = [segment_ids(e.ids, self.tokenizer.sep_id) for e in chunk]
            logits = self._call(pad(ids, self.tokenizer.pad_id), pad(segs, 0))
            if self.task == "tagging":
                for i, e, row in zip(index, chunk, logits):
                    words = [e.normalized[s:t] for s, t in word_spans(e.normalized)]
                    rows[i] = [(w, self.labels[int(np.argmax(row[p]))]) for w, p in zip(words, first_pieces(e))
                               if p is not None]
            elif self.task == "regression":
                for i, value in zip(index, logits[:, 0]):
                    rows[i] = value
            else:
                z = logits - logits.max(axis=1, keepdims=True)
                p = np.exp(z)
                for i, probs in zip(index, p / p.sum(axis=1, keepdims=True)):
                    rows[i] = probs
        out = rows if self.task == "tagging" else np.asarray(rows, np.float32).reshape(
            (len(rows),) if self.task == "regression" else (len(rows), -1))
        return out[0] if single else out

