"""`kbert.OnnxTaskModel`: a fine-tuned classifier, pair classifier or regression model (a cross-encoder) from
`kbert export --format onnx` (the "classify" graph), run by ONNX Runtime with neither TensorFlow nor JAX.

    model = kbert.OnnxTaskModel.load("onnx/sentiment")        # pip install onnxruntime (kbert[onnx])
    model.predict(["재밌어요", "최악"])                          # probabilities [2, labels], as TaskModel.predict
    model.labels                                              # the label names, in the columns' order
    reranker = kbert.OnnxTaskModel.load("onnx/reranker")
    reranker.rank("헌법 개정 절차", documents, top_k=3)          # [{"corpus_id": 2, "score": 0.97}, ...]

Why: the export holds the classifier's graph with its softmax (or a regression's output function), and its
self-check already held it to `TaskModel.predict` to 1e-5; without a runner in kbert a user had to tokenize,
build segment ids and pad by hand to call it. This one feeds the graph exactly what the self-check fed it, in
batches of similar length, and puts the rows back in input order.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from kbert.data.features import features, pad, segment_ids, text_list
from kbert.embed.onnx_runtime import GRAPH_FILE, TOKENIZER_DIR, feeds, read_info
from kbert.embed.onnx_runtime import session as onnx_session
from kbert.embed.ranking import Ranking


class OnnxTaskModel(Ranking):
    """`TaskModel.predict` and `rank` on a "classify" ONNX export (classification, pair-classification or
    regression), run by ONNX Runtime. The output function was fixed at export (`activation`)."""

    def __init__(self, graph, tokenizer, info: dict, max_length: Optional[int] = None):
        """graph: an onnxruntime.InferenceSession on the export's model.onnx; info: its kbert_onnx.json."""
        from kbert.models.config import ModelConfig

        if info.get("signature") != "classify":
            raise ValueError(f"this ONNX export is an {info.get('signature')!r} graph (sentence vectors); "
                             f"OnnxTaskModel runs 'classify' exports: load it with kbert.OnnxEmbedder")
        self.session, self.tokenizer, self.info = graph, tokenizer, info
        self.task, self.labels, self.activation = info["task"], info.get("labels"), info.get("activation")
        self.multi_label = bool(info.get("multi_label", False))  # its probabilities: a sigmoid a label
        self.max_length = ModelConfig.from_dict(info["config"]).check_length(
            info["max_length"] if max_length is None else max_length)
        self.output = info["outputs"][0]

    @classmethod
    def load(cls, model_dir: str, max_length: Optional[int] = None, threads: Optional[int] = None) -> "OnnxTaskModel":
        """An OnnxTaskModel for an export dir. threads: ONNX Runtime's intra-op threads (default: one per core)."""
        from kbert.text.tokenizer import Tokenizer

        info = read_info(model_dir)
        tokenizer = Tokenizer.load(os.path.join(model_dir, TOKENIZER_DIR))
        return cls(onnx_session(os.path.join(model_dir, GRAPH_FILE), threads), tokenizer, info, max_length)

    def predict(self, texts, pairs=None, batch_size: int = 64, activation: Optional[str] = None):
        """classification / pair-classification: probabilities `[n, labels]`; regression: values `[n]`; one
        text gives one row. `activation` is accepted as TaskModel's is, but only the exported one."""
        if activation not in (None, self.activation):
            raise ValueError(f"this graph's output function is {self.activation!r}, fixed at export. Received: "
                             f"activation={activation!r}; predict with kbert.TaskModel on the model dir for another")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"`batch_size` must be a positive integer. Received: batch_size={batch_size!r}")
        single = isinstance(texts, (str, bytes))
        texts = text_list(texts)
        if pairs is not None:
            pairs = text_list(pairs)
        encoded = [e.ids for e in self.tokenizer.encode_batch(texts, pairs=pairs, max_length=self.max_length)]
        width = () if self.task == "regression" else (len(self.labels or ()),)
        out = np.zeros((len(encoded),) + width, np.float32)
        tok = self.tokenizer
        order = np.argsort([len(ids) for ids in encoded], kind="stable")  # little padding per batch
        for start in range(0, len(encoded), batch_size):
            index = order[start:start + batch_size]
            ids = [encoded[i] for i in index]
            x = features(pad(ids, tok.pad_id), pad([segment_ids(i, tok.sep_id) for i in ids], 0), tok.pad_id)
            out[index] = self.session.run([self.output], feeds(x["token_ids"], x["padding_mask"], x["segment_ids"]))[0]
        return out[0] if single else out
