"""`TaskModel`: predictions from a fine-tuned task dir (`kbert finetune`'s output) or a Hugging Face
`*ForSequenceClassification` dir, which is how cross-encoders (rerankers such as BGE-reranker-v2-m3 and its
Korean fine-tunes, KLUE NLI classifiers) ship; `rank` orders documents for a query as sentence-transformers'
`CrossEncoder.rank` does.

A batch of texts or pairs of mixed lengths (a reranker's candidates for one query, a server's requests) runs
as packed rows, several to a row with attention kept within each (`TaskNetwork.packed_logits`), rather than
each padded to the longest: on a CPU the padded positions are most of a reranking batch's work."""

from __future__ import annotations

import os
from typing import Optional, Union

import numpy as np

from kbert.data.features import (PACK_WHEN, ROW_BUCKETS, SLOT_BUCKETS, bucket, bucketed, build_network, features,
                                 first_pieces, pack_rows, packed_width, pad)
from kbert.data.features import segment_ids, str_list, text_list
from kbert.data.features import unit_vectors_in_batches, word_spans
from kbert.compiled import JIT_MODES, BackgroundCompiles, CompilesInBackground, backend
from kbert.compiled import compiled, replicate, signature
from kbert.embed.ranking import Ranking
from kbert.embed.zero_shot import (DEFAULT_TEMPLATE, candidate_list, hypotheses, label_scores, nli_indices,
                                   pair_ids, ranked)
from kbert.utils import positive_int, softmax
from kbert.models.io import assign_weights
from kbert.models.locate import TASK_FILE, model_dir_of, read_task_meta, resolve_hub_name
from kbert.models.tasks import TaskNetwork, load_task_head, save_task_head


_ACTIVATIONS = ("identity", "sigmoid", "tanh")


def _resolve(model_dir: str):
    """(local dir, task meta or None, the Hugging Face classifier's head or None) of a task dir, a Hugging Face
    *ForSequenceClassification, *ForQuestionAnswering or *ForTokenClassification dir, a Hub name of one, or a
    `kbert pretrain` run dir."""
    from kbert.models.convert import read_classifier, read_qa_head, read_token_classifier

    model_dir = model_dir_of(resolve_hub_name(model_dir))
    meta = read_task_meta(model_dir)
    if meta is not None or not os.path.isdir(model_dir):
        return model_dir, meta, None
    classifier = read_classifier(model_dir) or read_qa_head(model_dir) or read_token_classifier(model_dir)
    return model_dir, (classifier or {}).get("meta"), classifier


def task_meta(model_dir: str) -> Optional[dict]:
    """What `TaskModel.load(model_dir)` would predict, without loading it: a `kbert finetune` dir's
    `kbert_task.json`, the equivalent for a Hugging Face classifier / cross-encoder (`"pairs": True` for a
    one-score one), or None for any other model."""
    return _resolve(model_dir)[1]


class TaskModel(Ranking, CompilesInBackground):
    """A fine-tuned model: backbone, task head, tokenizer and label names. kbert's cross-encoder too: a pair
    model's `predict(queries, pairs=documents)` scores each pair, `rank(query, documents)` sorts documents.

    Example:
        >>> model = kbert.TaskModel.load("sentiment-model")
        >>> model.predict(["재밌어요", "최악"])     # class probabilities [2, num_labels]
        >>> model.labels                            # ['0', '1']
        >>> reranker = kbert.TaskModel.load("BAAI/bge-reranker-v2-m3")   # a Hugging Face cross-encoder
        >>> reranker.rank("헌법 개정 절차", documents, top_k=3)   # [{"corpus_id": 2, "score": 0.97}, ...]
    """

    def __init__(self, network: TaskNetwork, tokenizer, meta: dict, jit_compile: Union[bool, str] = False):
        """jit_compile: False (one traced graph for every shape), True (predict through XLA: each batch padded
        to a bucketed shape, compiled the first time it is met, about a second each: fewer, fused kernels
        instead of the graph executor's per-op dispatch, which on a CPU weighs most on small models and
        batches), or "background" (as True, but a batch whose shape is not compiled yet runs on the graph
        while a background thread compiles it: for servers). Always XLA on JAX."""
        if not (isinstance(jit_compile, bool) or jit_compile == "background"):
            raise ValueError(f"`jit_compile` must be one of {JIT_MODES}. Received: jit_compile={jit_compile!r}")
        self.network, self.tokenizer, self.meta = network, tokenizer, meta
        # JAX compiles every (bucketed) shape, and has no graph to run one on meanwhile
        self.jit_compile = True if backend() == "jax" else jit_compile
        self.task, self.labels = meta["task"], meta.get("labels")
        # a multi-label classifier: a sigmoid a label (any number may hold), not one softmax over them
        self.multi_label = bool(meta.get("multi_label", False))
        self.max_length = meta.get("max_length", 128)
        # a regression's output function: "identity" for kbert's regressors (their values on the label
        # scale), "sigmoid" for a Hugging Face cross-encoder with one logit, as sentence-transformers applies
        self.activation = meta.get("activation", "identity")
        self.embedder = None  # set by `load`: an Embedder on the same backbone
        self._distribution = None  # set by `load`: the Embedder's devices (`kbert.compiled.data_parallel`)
        self._fns = {}  # ("call" | "packed", through XLA) -> the compiled function
        self._compiled = BackgroundCompiles()  # ("call" | "packed", shapes...) XLA has compiled

    @classmethod
    def load(cls, model_dir: str, dtype: Optional[str] = None, jit_compile: Union[bool, str] = False,
             strategy: str = "auto") -> "TaskModel":
        """A `kbert finetune` output dir, or a Hugging Face `*ForSequenceClassification` dir or Hub name (BERT,
        ALBERT, RoBERTa, XLM-RoBERTa: KLUE classifiers, cross-encoders and rerankers) or
        `*ForQuestionAnswering` one (BERT, ALBERT, ELECTRA, RoBERTa, XLM-RoBERTa: KorQuAD and KLUE-MRC
        readers; see `answer`) or `*ForTokenClassification` one (the same five: named-entity taggers; see
        `entities`). `strategy`: the devices,
        as `Embedder.load`'s (several on Keras' JAX backend: each holds the weights and takes a share of every
        batch's rows)."""
        from kbert.embed.embedder import Embedder

        model_dir, meta, classifier = _resolve(model_dir)
        if meta is None:
            raise FileNotFoundError(f"{model_dir!r} is not a fine-tuned model dir: {TASK_FILE} is missing "
                                    "(`kbert finetune` writes it), and it is not a Hugging Face "
                                    "*ForSequenceClassification, *ForQuestionAnswering or *ForTokenClassification "
                                    "dir either")
        emb = Embedder.load(model_dir, dtype=dtype, strategy=strategy)
        if classifier is not None:
            meta["max_length"] = min(meta.get("max_length") or emb.max_length, emb.max_length)
        labels = meta.get("labels") or []
        num = {"regression": 1, "question-answering": 2}.get(meta["task"], len(labels))
        layers = meta.get("layers")
        network = TaskNetwork(emb.backbone, meta["task"], num, 0.0, meta.get("target") or (0.0, 1.0),
                              meta.get("pooling"), -1 if layers is None else layers)
        build_network(network, emb.tokenizer)
        if classifier is None:
            load_task_head(network, model_dir)
        else:  # (XLM-)RoBERTa's classifier.dense is the pooler's place (kbert.models.convert.read_classifier)
            head = network.head
            assign_weights(head, {head.kernel.path: classifier["head"]["kernel"],
                                  head.bias.path: classifier["head"]["bias"]}, model_dir)
            if classifier["pooler"]:
                assign_weights(emb.backbone.pooler, classifier["pooler"], model_dir)
        model = cls(network, emb.tokenizer, meta, jit_compile=jit_compile)
        model.embedder = emb  # the same backbone, for sentence vectors (`kbert serve` uses both)
        model._distribution = emb.distribution
        if model._distribution is not None:  # the head onto the devices that hold the backbone
            replicate(model._distribution, network.variables)
        return model

    def save(self, model_dir: str) -> str:
        from kbert.models.io import save_model

        save_model(self.network.backbone, model_dir, tokenizer=self.tokenizer)
        save_task_head(self.network, self.meta, model_dir)
        return model_dir

    def _forward(self, x):  # a method, not a lambda: AutoGraph reads its source (a lambda's it cannot parse)
        return self.network(x, training=False)

    def _function(self, kind: str, xla: bool):
        """The compiled forward pass: "call" (a features dict of [b, s] arrays -> logits) or "packed"
        (`TaskNetwork.packed_logits`), through XLA or the graph. TensorFlow: one trace for every shape (XLA
        then compiles each bucketed shape); JAX: one compile per bucketed shape."""
        if (kind, xla) not in self._fns:
            if kind == "call":
                fn, spec = self._forward, signature({"token_ids": 2, "segment_ids": 2, "padding_mask": 2})
            else:
                fn, spec = self.network.packed_logits, signature(2, 2, 2, (3, "float32"))
            self._fns[kind, xla] = compiled(fn, self.network.variables, spec, jit_compile=xla,
                                            distribution=self._distribution)
        return self._fns[kind, xla]

    def _run(self, kind: str, *args):
        """`kind`'s function on `args` (bucketed shapes when `jit_compile`): through XLA once that shape is
        compiled (with "background", the graph answers until a thread has compiled it)."""
        if not self.jit_compile:
            return self._function(kind, False)(*args)
        key = (kind,) + tuple(np.shape(a) for a in (args[0].values() if kind == "call" else args))
        zeros = [{k: np.zeros_like(v) for k, v in a.items()} if isinstance(a, dict) else np.zeros_like(a)
                 for a in args]  # what the thread compiles with: the shapes are what matter
        if self._compiled.ready(key, lambda: self._function(kind, True)(*zeros),
                                background=self.jit_compile == "background"):
            out = self._function(kind, True)(*args)
            self._compiled.add(key)
            return out
        return self._function(kind, False)(*args)

    def _call(self, ids, segments):
        rows = len(ids)
        if self.jit_compile:  # pad to a bucketed shape: extra rows are padding, their outputs dropped
            limit = min(self.max_length, self.network.backbone.config.max_position)
            ids = bucketed(ids, self.tokenizer.pad_id, limit, rows=True)
            segments = bucketed(segments, 0, limit, rows=True)
        return np.asarray(self._run("call", features(ids, segments, self.tokenizer.pad_id)), np.float32)[:rows]

    def _call_packed(self, ids, segs):
        """Logits `[n, labels]` of texts of mixed lengths (a reranker's candidates, a server's requests) run as
        packed rows, several to a row (`TaskNetwork.packed_logits`), or None when the head does not read the
        pooler, or when packing would not save a fifth of the rows. Through XLA (`jit_compile`, and always on
        JAX) every batch runs packed, its rows, width and texts per row rounded up to buckets, so a few
        compiled shapes serve every batch."""
        lengths = [len(x) for x in ids]
        xla = bool(self.jit_compile)
        if self.network.pooling != "pooler" or (len(ids) < 2 and not xla):
            return None
        width = packed_width(lengths, self.network.backbone.config.max_position) if xla else max(lengths)
        packed = pack_rows(lengths, width)
        if not xla and len(packed) > PACK_WHEN * len(ids):
            return None
        rows, slots = len(packed), max(len(row) for row in packed)
        if xla:
            rows, slots = bucket(rows, ROW_BUCKETS), bucket(slots, SLOT_BUCKETS)
        token_ids = np.full((rows, width), self.tokenizer.pad_id, np.int32)
        segments, types = np.zeros_like(token_ids), np.zeros_like(token_ids)
        starts = np.zeros((rows, slots, width), np.float32)
        where = np.zeros((len(ids), 2), np.int64)  # (row, slot) of each text
        for r, row in enumerate(packed):
            at = 0
            for t, j in enumerate(row):
                n = lengths[j]
                token_ids[r, at:at + n], segments[r, at:at + n], types[r, at:at + n] = ids[j], t + 1, segs[j]
                starts[r, t, at] = 1.0
                where[j] = (r, t)
                at += n
        logits = np.asarray(self._run("packed", token_ids, segments, types, starts), np.float32)  # [r, t, labels]
        return logits[where[:, 0], where[:, 1]]

    def predict(self, texts, pairs=None, batch_size: int = 64, activation: Optional[str] = None):
        """classification / pair-classification: probabilities `[n, labels]` (a multi-label classifier's: each
        label's own, a sigmoid, the label holding above 0.5); regression: values `[n]`;
        tagging: for each text a list of `(word, tag)`; sentence-embedding: unit vectors `[n, hidden]`.

        activation: a regression's output function, default the model's own (`self.activation`): "identity"
            gives a cross-encoder's raw logits (FlagEmbedding's `compute_score` default), "sigmoid" maps them
            to (0, 1) (sentence-transformers' `CrossEncoder.predict` default for one logit)."""
        batch_size = positive_int(batch_size, "batch_size")
        if activation is not None and activation not in _ACTIVATIONS:
            raise ValueError(f"`activation` must be one of {_ACTIVATIONS}. Received: activation={activation!r}")
        activation = activation or self.activation
        if self.task == "question-answering":
            raise ValueError("a question-answering model answers questions from contexts: use "
                             "answer(question, context)")
        single = isinstance(texts, (str, bytes))
        texts = text_list(texts)
        if pairs is not None:
            pairs = text_list(pairs)
        if self.task == "sentence-embedding":
            ids = [e.ids for e in self.tokenizer.encode_batch(texts, max_length=self.max_length)]
            out = unit_vectors_in_batches(self._call, ids, self.tokenizer.pad_id, batch_size)
            return out[0] if single else out
        encodings = self.tokenizer.encode_batch(texts, pairs=pairs, max_length=self.max_length)
        if self.task != "tagging":
            logits = self._sequence_logits([e.ids for e in encodings], batch_size)
            if self.task == "regression":
                out = logits[:, 0]
            elif self.multi_label:
                out = (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
            else:
                out = softmax(logits, axis=1).astype(np.float32)
        else:
            out = [None] * len(encodings)
            # batches of similar length (little padding), results put back in input order
            order = np.argsort([len(e.ids) for e in encodings], kind="stable")
            for start in range(0, len(encodings), batch_size):
                index = order[start:start + batch_size]
                chunk = [encodings[i] for i in index]
                ids = [e.ids for e in chunk]
                segs = [segment_ids(x, self.tokenizer.sep_id) for x in ids]
                logits = self._call(pad(ids, self.tokenizer.pad_id), pad(segs, 0))
                for i, e, row in zip(index, chunk, logits):
                    words = [e.normalized[s:t] for s, t in word_spans(e.normalized)]
                    out[i] = [(w, self.labels[int(np.argmax(row[p]))]) for w, p in zip(words, first_pieces(e))
                              if p is not None]
        if self.task == "regression" and activation != "identity":
            out = (1.0 / (1.0 + np.exp(-out)) if activation == "sigmoid" else np.tanh(out)).astype(np.float32)
        return out[0] if single else out

    def _sequence_logits(self, id_lists, batch_size: int) -> np.ndarray:
        """Logits `[n, labels]` of token id lists (special tokens included), run in batches of similar length
        (little padding, or packed rows) and put back in input order."""
        out = np.zeros((len(id_lists), 1 if self.task == "regression" else len(self.labels or ())), np.float32)
        order = np.argsort([len(x) for x in id_lists], kind="stable")
        for start in range(0, len(id_lists), batch_size):
            index = order[start:start + batch_size]
            ids = [id_lists[i] for i in index]
            segs = [segment_ids(x, self.tokenizer.sep_id) for x in ids]
            logits = self._call_packed(ids, segs)
            if logits is None:
                logits = self._call(pad(ids, self.tokenizer.pad_id), pad(segs, 0))
            out[index] = logits
        return out

    def zero_shot(self, texts, candidate_labels, hypothesis_template: str = DEFAULT_TEMPLATE,
                  multi_label: bool = False, batch_size: int = 64):
        """Zero-shot classification with a natural-language-inference model (a KLUE-NLI or KorNLI
        cross-encoder, or a `kbert finetune --task pair-classification` model trained on NLI labels): for each
        text `{"sequence", "labels", "scores"}`, the candidate labels from the likeliest down, as transformers'
        zero-shot-classification pipeline gives them (`kbert.embed.zero_shot`).

        Args:
            candidate_labels: the classes, a list or one comma-separated string.
            hypothesis_template: the sentence each label is put into (`{}`), read as what the text entails;
                Korean by default, where the pipeline's default is English ("This example is {}."), so pass
                the template to compare the two. A particle written in both forms right after `{}` takes the
                one each label needs: "이 글의 주제는 {}(이)다." gives 스포츠다 and 법이다 (also 은(는),
                이(가), 을(를), 과(와), (으)로).
            multi_label: score each label on its own (entailment against contradiction), so several can hold;
                by default the scores are a softmax over the labels and sum to 1.

        Example:
            >>> nli = kbert.TaskModel.load("my-klue-nli-model")
            >>> nli.zero_shot("손흥민이 시즌 10호 골을 넣었다.", ["스포츠", "정치", "경제"])
            {"sequence": "손흥민이 ...", "labels": ["스포츠", "경제", "정치"], "scores": [0.93, 0.04, 0.03]}
        """
        batch_size = positive_int(batch_size, "batch_size")
        if self.task not in ("classification", "pair-classification"):
            raise ValueError(f"zero_shot needs a natural-language-inference classifier; this model is {self.task!r}")
        entail, contradiction = nli_indices(self.labels)
        labels = candidate_list(candidate_labels)
        single = isinstance(texts, (str, bytes))
        texts = str_list(texts)
        tok = self.tokenizer
        text_ids = tok.ids_batch(texts)
        label_ids = tok.ids_batch(hypotheses(labels, hypothesis_template))
        limit = min(self.max_length, self.network.backbone.config.max_position)
        rows = [pair_ids(tok, t, h, limit) for t in text_ids for h in label_ids]
        logits = self._sequence_logits(rows, batch_size).reshape(len(texts), len(labels), len(self.labels))
        scores = label_scores(logits, entail, contradiction, multi_label)
        found = [ranked(text, labels, row) for text, row in zip(texts, scores)]
        return found[0] if single else found

    def entities(self, texts, aggregation: Optional[str] = None, ignore_labels=("O",), batch_size: int = 64):
        """Entity spans of a tagging model (a named-entity tagger): for each text a list of `{"entity_group",
        "score", "word", "start", "end"}`, `text[start:end] == word`, as transformers' token-classification
        pipeline gives them (`kbert.embed.entities`); with aggregation "none", one `{"entity", "score", "index",
        "word", "start", "end"}` per token instead.

        Args:
            aggregation: how tokens become entities: "simple" (token by token: an entity may end inside a word,
                before its particle; the default for Hugging Face token classifiers, trained on every token),
                "first" / "average" / "max" (word by word, a word's label from its first token, the mean of its
                tokens' scores, or its most confident token; "first" is the default for `kbert finetune` taggers,
                trained on each word's first piece), or "none".
            ignore_labels: labels that are not entities.

        A text longer than `max_length` tokens is tagged on its first `max_length`, with a warning.

        Example:
            >>> ner = kbert.TaskModel.load("my-klue-ner-model")
            >>> ner.entities("이순신은 조선 중기의 무신이다.")
            [{"entity_group": "PS", "score": ..., "word": "이순신", "start": 0, "end": 3}, ...]
        """
        import warnings

        from kbert.data.entities import token_spans
        from kbert.embed.entities import aggregate, check_aggregation

        batch_size = positive_int(batch_size, "batch_size")
        if self.task != "tagging":
            raise ValueError(f"entities needs a tagging model; this one is {self.task!r} (use predict)")
        aggregation = aggregation or self.meta.get("aggregation", "first")
        check_aggregation(aggregation)
        single = isinstance(texts, (str, bytes))
        texts = str_list(texts)
        ignore = [ignore_labels] if isinstance(ignore_labels, str) else list(ignore_labels or ())
        tok = self.tokenizer
        encodings = tok.encode_batch(texts, max_length=self.max_length)
        logits = [None] * len(texts)
        order = np.argsort([len(e.ids) for e in encodings], kind="stable")
        for start in range(0, len(texts), batch_size):
            index = order[start:start + batch_size]
            ids = [encodings[i].ids for i in index]
            out = self._call(pad(ids, tok.pad_id), pad([[0] * len(x) for x in ids], 0))  # [b, s, labels]
            for i, row in zip(index, out):
                logits[i] = row[:len(encodings[i].ids)]
        found = []
        for text, enc, z in zip(texts, encodings, logits):
            probs = softmax(z)  # [s, labels]
            tokens = []
            for t, (i, span) in enumerate(zip(enc.ids, token_spans(tok, text, enc))):
                if span is None:
                    continue
                begin, end = span
                if tok.kind == "wordpiece":
                    subword = enc.tokens[t].startswith("##") and i != tok.unk_id
                else:  # as the pipeline decides for tokenizers without a continuation marker: no space before it
                    subword = begin > 0 and " " not in text[begin - 1:begin + 1] and i != tok.unk_id
                tokens.append({"index": t, "scores": probs[t], "start": begin, "end": end, "subword": subword})
            if tokens and tokens[-1]["end"] < len(text.rstrip()) and len(enc.ids) >= self.max_length:
                warnings.warn(f"a text of more than max_length={self.max_length} tokens is tagged on its first "
                              f"{self.max_length} ({text[:30]!r}...)", stacklevel=2)
            found.append(aggregate(tokens, self.labels, text, aggregation, ignore))
        return found[0] if single else found

    def answer(self, question, context, top_k: int = 1, max_answer_length: Optional[int] = None,
               doc_stride: Optional[int] = None, max_question_length: Optional[int] = None,
               handle_impossible_answer: Optional[bool] = None, batch_size: int = 64):
        """The answer to `question` in `context`, as a span of the context (a question-answering model: a
        `kbert.finetune(..., "question-answering")` dir, or a Hugging Face `*ForQuestionAnswering` one).

        Returns `{"score", "start", "end", "answer"}` as transformers' question-answering pipeline did:
        `context[start:end] == answer` (no whitespace at either end), `score` the product of the start and end
        probabilities (a softmax over the context's tokens and [CLS]); a list of the `top_k` best when
        `top_k > 1`; for lists of questions and contexts (one context each, or one for all), a list of those. A
        context longer than the model's `max_length` is read in windows sharing `doc_stride` tokens, and the
        best span over them wins.

        max_answer_length: the longest answer in tokens; doc_stride, max_question_length: as in fine-tuning
            (defaults: the model's own settings, else 30, 128 and 64). handle_impossible_answer: let the empty
            answer (`{"answer": "", "start": 0, "end": 0}`) win when [CLS] outscores every span (default: when
            the model was trained with unanswerable questions).
        """
        from kbert.data import qa

        batch_size = positive_int(batch_size, "batch_size")
        if self.task != "question-answering":
            raise ValueError(f"answer() needs a question-answering model; this is a {self.task} model (use "
                             "predict)")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"`top_k` must be a positive integer. Received: top_k={top_k!r}")
        single = isinstance(question, (str, bytes))
        questions = text_list(question)
        contexts = text_list(context)
        if len(contexts) == 1 and len(questions) > 1:
            contexts = contexts * len(questions)
        if len(contexts) != len(questions):
            raise ValueError(f"one context per question, or one for all: {len(questions)} questions, "
                             f"{len(contexts)} contexts")
        meta = self.meta
        max_answer_length = max_answer_length or meta.get("max_answer_length") or 30
        doc_stride = doc_stride or meta.get("doc_stride") or 128
        max_question_length = max_question_length or meta.get("max_query_length") or 64
        if handle_impossible_answer is None:
            handle_impossible_answer = bool(meta.get("impossible"))
        contexts = [c.decode("utf-8", errors="replace") if isinstance(c, bytes) else c for c in contexts]
        # each distinct context encoded and aligned once (one context for many questions is the common case)
        distinct = list(dict.fromkeys(contexts))
        encoded = dict(zip(distinct, self.tokenizer.encode_batch(distinct, add_special_tokens=False)))
        aligned = {c: qa.aligned_normalize(c, self.tokenizer.normalize)[1:] for c in distinct}
        windows, owner = [], []
        for i, (q, enc) in enumerate(zip(questions, (encoded[c] for c in contexts))):
            for w in qa.windows(self.tokenizer, q, enc, self.max_length, doc_stride, max_question_length):
                windows.append(w)
                owner.append(i)
        logits = [None] * len(windows)
        order = np.argsort([len(w.ids) for w in windows], kind="stable")  # little padding per batch
        for start in range(0, len(windows), batch_size):
            index = order[start:start + batch_size]
            out = self._call(pad([windows[i].ids for i in index], self.tokenizer.pad_id),
                             pad([windows[i].segments for i in index], 0))  # [b, s, 2]
            for i, row in zip(index, out):
                logits[i] = row
        per_question = [[] for _ in questions]
        for i, w, row in zip(owner, windows, logits):
            per_question[i].append((row[:, 0], row[:, 1], w))
        results = []
        for i, context_text in enumerate(contexts):
            found = qa.answers(per_question[i], context_text, *aligned[context_text], top_k, max_answer_length,
                               handle_impossible_answer)
            if not found:  # no span fits (an empty context): the empty answer, scored 0
                found = [{"score": 0.0, "start": 0, "end": 0, "answer": ""}]
            results.append(found[0] if top_k == 1 else found)
        return results[0] if single else results
