"""Scores and ranking from a cross-encoder's `predict`: what `TaskModel` and `OnnxTaskModel` share.

A model that gives one score per (query, document) pair (a regression, i.e. a reranker or an STS cross-encoder,
or a two-label pair classifier whose second label means relevant) sorts documents for a query as
sentence-transformers' `CrossEncoder.rank` does. Kept apart from `task_model.py`, which imports Keras, so that
the ONNX runner stays free of any framework.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from kbert.data.features import text_list


class Ranking:
    """`scores`, `check_rankable` and `rank` for a class with `task`, `labels` and
    `predict(texts, pairs=..., batch_size=..., activation=...)`."""

    def scores(self, rows) -> np.ndarray:
        """One score per pair from `predict`'s rows: a regression's values; a two-label pair classifier's
        probability of its second label (a `kbert.finetune` pair-classification on 0/1 relevance labels: "1"). What `rank`,
        `Embedder.search(reranker=...)` and `/v1/rerank` sort by."""
        self.check_rankable()
        rows = np.asarray(rows, np.float32)
        return np.atleast_1d(rows) if self.task == "regression" else np.atleast_2d(rows)[:, 1]

    def check_rankable(self) -> None:
        """A ValueError unless the model gives one score per pair (see `scores`)."""
        if self.task == "regression" or (self.task == "pair-classification" and len(self.labels or []) == 2):
            return
        raise ValueError(f"ranking needs one score per pair: a regression (a reranker) or a two-label pair "
                         f"classifier; "
                         f"this is a {self.task} model{' with labels ' + str(self.labels) if self.labels else ''}: "
                         "use predict(queries, pairs=documents) for its outputs")

    def rank(self, query: str, documents, top_k: Optional[int] = None, return_documents: bool = False,
             batch_size: int = 64, activation: Optional[str] = None):
        """`documents` sorted by this cross-encoder's score for (query, document), best first, as
        sentence-transformers' `CrossEncoder.rank` returns them: `[{"corpus_id": i, "score": s}, ...]` (and
        `"text"` with `return_documents`), the first `top_k` (default all). Needs one score per pair
        (`scores`): a regression (a reranker, an STS cross-encoder) or a two-label pair classifier.

        Retrieve and rerank in one call: `embedder.search(query, corpus, top_k=10, reranker=model)`.
        """
        self.check_rankable()
        if not isinstance(query, (str, bytes)):
            raise TypeError(f"`query` must be one text. Received: {type(query).__name__}")
        documents = text_list(documents)
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"`top_k` must be a positive integer or None. Received: top_k={top_k!r}")
        if not documents:
            return []
        scores = self.scores(self.predict([query] * len(documents), pairs=documents, batch_size=batch_size,
                                          activation=activation))
        order = np.argsort(-scores, kind="stable")[:top_k]
        return [dict({"corpus_id": int(i), "score": float(scores[i])},
                     **({"text": documents[i]} if return_documents else {})) for i in order]
