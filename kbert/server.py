"""`kbert serve`: sentence vectors, similarities and task predictions over HTTP, with dynamic batching.

    kbert serve --model DIR [--host 127.0.0.1] [--port 8080] [--max-batch-tokens 8192] [--max-wait-ms 5]
    app = kbert.server.build_app("my-model")        # a Starlette app to mount in your own ASGI server
    kbert.serve("my-model", port=8080)              # or run it here (uvicorn), until SIGTERM / Ctrl-C

Routes (JSON in and out; errors are `{"error": {"message", "type", "code"}}` with the status below):
    POST /v1/embeddings   OpenAI-compatible: {"input": str | [str], "model"?: str} and kbert's own
                          "pooling", "normalize", "prompt_name" (one of the model's prompts, E5's "query" /
                          "passage"; default: its default prompt), OpenAI's "dimensions" (the first n of each
                          vector, renormalized), "long_texts" ("mean": a text over the model's max_length is
                          the mean of its windows' vectors, `Embedder.encode`) and "encoding_format" ("float",
                          or "base64": each vector's little-endian float32 bytes, under half the size of the
                          floats as JSON; what OpenAI's Python client asks for unless told otherwise) ->
                          {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [...]}],
                          "model", "usage": {"prompt_tokens", "total_tokens"}}
    POST /v1/word-embeddings   a vector in context for each word (`Embedder.encode_words`; a transformer model
                          dir, not a static table, an ONNX graph or an ensemble): {"input": str | [str],
                          "unit"?: "eojeol" (default, whitespace words) | "morpheme" (by the server's
                          `keywords_analyzer`) | "subword", "pooling"?: "mean" | "first" (of a word's subwords),
                          "layers"?: int | [int] (their mean; default -1, the last), "encoding_format"?} ->
                          {"data": [{"object": "word_embeddings", "index", "words": [{"word", "start", "end",
                          "embedding"}]}]} (offsets index the normalized text, `kbert.normalize`)
    POST /v1/similarity   {"source_sentence": str, "sentences": [str]} -> {"similarities": [cosine, ...]}
    POST /v1/sparse-embeddings   SPLADE dirs (`kbert finetune --task sparse-embedding`, a sentence-transformers
                          SparseEncoder): {"input": str | [str], "max_active_dims"?: int, "return_tokens"?: bool,
                          "input_type"?: "document" (default) | "query" (the model's query prompt; an
                          inference-free model's weight table)}
                          -> {"data": [{"object": "sparse_embedding", "index", "indices": [token ids], "values":
                          [weights], "tokens"?: [...]}]}, heaviest first, as an inverted index takes them
    POST /v1/classify     task dirs (`kbert finetune` output, a Hugging Face classifier): {"input": str | [str],
                          "pairs"?: [str]} -> {"data": [{"index", "label", "probabilities": {label: p}}]}
                          (regression: "value"; a multi-label classifier adds "labels", those over 0.5)
    POST /v1/answer       question-answering models (a `kbert finetune` reader, a Hugging Face
                          *ForQuestionAnswering dir: KorQuAD readers): {"question": str | [str], "context": str |
                          [str] (one per question, or one for all), "top_k"?: int, "max_answer_length"?: int,
                          "handle_impossible_answer"?: bool} -> {"data": [{"index", "answer", "score", "start",
                          "end"}]} (`TaskModel.answer`'s fields; with top_k > 1 each item's "answers" lists them)
    POST /v1/keywords     any model: the keyphrases of each document (`kbert.keywords`: KeyBERT's method over
                          Korean noun runs, analyzed by the server's `keywords_analyzer`, mecab by default):
                          {"input": str | [str], "top_n"?: int, "diversity"?: number (MMR), "nr_candidates"?:
                          int (max sum), "ngram_range"?: [min, max], "stop_words"?: [str], "candidates"?: [str]}
                          -> {"data": [{"index", "keywords": [{"phrase", "score"}], best first}]}
    POST /v1/entities     taggers (a `kbert finetune --task tagging` dir, a Hugging Face *ForTokenClassification
                          NER model): {"input": str | [str], "aggregation"?: "simple" | "first" | "average" |
                          "max" | "none"} -> {"data": [{"index", "entities": [{"entity_group", "score", "word",
                          "start", "end"}]}]} (`TaskModel.entities`: spans of each input as given)
    POST /v1/zero-shot    natural-language-inference classifiers (KLUE-NLI, KorNLI): {"input": str | [str],
                          "candidate_labels": [str] | "a,b,c", "hypothesis_template"?: str with {}, "multi_label"?:
                          bool} -> {"data": [{"index", "labels", "scores"}], likeliest first}
                          (`TaskModel.zero_shot`, transformers' zero-shot-classification pipeline)
    POST /v1/rerank       cross-encoders (a reranker such as BGE-reranker-v2-m3, a kbert pair regression),
                          the request and answer of Cohere's rerank API, which Jina, vLLM and Infinity serve
                          too: {"query": str, "documents": [str | {"text": str}], "top_n"?: int,
                          "return_documents"?: bool} -> {"results": [{"index", "relevance_score",
                          "document"?: {"text"}}], best first} (the score is `TaskModel.rank`'s)
    POST /v1/search       a `kbert.SearchIndex` given at start (`kbert serve --index DIR`; the served model must
                          encode as the one that built it; a SPLADE model serves a `kbert.SparseIndex`, scored by
                          dot product, without "ef_search", "nprobe" and "lexical"): {"query": str | [str], "top_k"?: int (default 10),
                          "ef_search"?: int, "nprobe"?: int, "lexical"?: number in [0, 1] (hybrid search, an
                          index built with lexical=True), "where"?: {metadata key: value, [values] or {"$gte": ...}},
                          "group_by"?: a metadata key ("document": one passage per document)} ->
                          {"data": [{"index", "hits": [{"id", "score",
                          "text", "metadata"?}]}]}, best first; the queries are batched with other requests' texts.
                          Hybrid (`kbert serve --index DIR --hybrid DIR2`: a dense and a SPLADE index of the same
                          texts, DIR2's queries encoded by the model that built it, loaded beside the served one):
                          `kbert.hybrid_search`, with "weight"?: the sparse side's share in [0, 1] (default 0.5),
                          "fusion"?: "zscore" (default) | "rrf", "candidates"?: int (each side's, default 100);
                          the score is the fused one; "lexical" is not taken.
                          Retrieve and rerank (`kbert serve --index DIR --reranker DIR3`: a cross-encoder, loaded
                          beside the served model, its pairs batched like every other text): each query's first
                          "candidates"?: int (default 100) hits are re-scored by it and re-ordered, deeper ones
                          keep their order (`SearchIndex.search(reranker=...)`); the score is the reranker's;
                          "rerank"?: false skips it for a request. With --hybrid too, "candidates" is both each
                          side's proposals and the hits re-scored, as in `kbert.hybrid_search(reranker=...)`
    GET  /v1/models       OpenAI's model list: the served model's "id" (its dir's name), "routes", "max_length",
                          "dimension" (of its vectors)
    GET  /health          200 {"status": "ok"} once the model has run once; 503 {"status": "loading"} before
    GET  /metrics         Prometheus text: requests by route and status, latency, batch sizes, queue depth,
                          XLA compilations pending

The model: a model dir (vectors), a task dir (its head's routes and its backbone's vectors), a Hugging Face
dir, or a `kbert export --format onnx` dir: an "embed" graph serves the vector routes, a classifier's graph
(`kbert.OnnxTaskModel`) /v1/classify and, for a cross-encoder, /v1/rerank; its vector routes answer 404. A
SPLADE dir serves /v1/sparse-embeddings (and /v1/search over a sparse index). A `kbert.EnsembleEmbedder` dir
serves the vector routes but /v1/word-embeddings: each batch runs through every member in turn (the batch's
token budget bounds each member's pass; a request waits for all of them), and its vectors are the members'
unit vectors side by side, so cosines are the mean of theirs.

Dynamic batching: the texts of concurrent requests wait in one bounded queue; a worker thread (the model runs
off the event loop) takes them in arrival order into a batch until `max_batch_tokens` (tokens counted as
characters + 2, an upper bound for Korean text, capped at the model's length), waiting up to `max_wait_ms`
only for requests already being read (an idle server answers a lone request at once, and requests that
arrive while the model runs form the next batch), groups texts of the same route and options, runs them
(inside `Embedder.encode`: sorted by length, and a batch of mixed lengths as packed rows, several texts per
row, so short requests are not padded to the longest), and hands every request its own rows in its input order.
Sentence vectors run through XLA (`--jit-compile on`, the default): on a CPU the graph executor's per-op
dispatch is a large part of a small batch's time, and XLA's fused kernels remove it. Batches are packed into
a few bucketed shapes; a shape met for the first time runs on the graph while a background thread compiles
it (about a second each), so no request waits for a compilation.

Limits: malformed JSON, a wrong field type, or a body that is not UTF-8: 400; more than `max_texts` texts
or a text over `max_chars` characters: 413; a full queue (`max_queue` texts): 429 with `Retry-After`, at
once; a request still unanswered after `timeout_s`: 504 (its texts are dropped if not yet run). A batch that
fails runs again one request at a time, so a request whose texts fail the model gets the error alone and the
others batched with it their answers. SIGTERM:
uvicorn stops accepting connections, the requests in flight finish, then the worker stops.

Starlette + uvicorn (the ASGI stack FastAPI stands on) carry HTTP, on uvloop and httptools when installed
(the `serve` extra brings them: uvicorn's C-accelerated event loop and HTTP parser, several times cheaper per
request than asyncio's loop and h11, and on a small CPU the requests' Python competes with the model);
orjson reads and writes JSON; prometheus-client writes the metrics: the field's well-kept pieces rather than
a hand-written server.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import math
import numbers
import sys
import threading
import time
from typing import List, Optional

import numpy as np

from kbert.utils import positive_int


def _seconds(value, name: str, zero: bool = False) -> float:
    """A finite time >= 0 (`zero`) or > 0 as a float, else a ValueError naming `name`."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value < 0 or (value == 0 and not zero)):
        raise ValueError(f"`{name}` must be a finite number {'>=' if zero else '>'} 0. Received: {name}={value!r}")
    return float(value)


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", headers=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers or {}


class _Job:
    __slots__ = ("kind", "texts", "pairs", "options", "future", "loop", "cost", "cancelled")

    def __init__(self, kind, texts, pairs, options, future, loop, cost):
        self.kind, self.texts, self.pairs, self.options = kind, texts, pairs, options
        self.future, self.loop, self.cost, self.cancelled = future, loop, cost, False


class Engine:
    """The model and the batching worker: `await engine.run(kind, texts, options)` from request handlers."""

    def __init__(self, model_dir: str, max_batch_tokens: int = 8192, max_wait_ms: float = 5.0,
                 max_queue: int = 4096, batch_size: int = 64, jit_compile: bool = True,
                 keywords_analyzer: str = "mecab", index: Optional[str] = None, hybrid: Optional[str] = None,
                 reranker: Optional[str] = None):
        from kbert.embed.embedder import is_ensemble_dir, load_static
        from kbert.embed.onnx_runtime import is_onnx_dir, read_info

        from kbert.embed.sparse import is_sparse_model

        # checked before a model loads: a queue of 0 answered every request 429, a NaN wait was no bound
        max_batch_tokens = positive_int(max_batch_tokens, "max_batch_tokens")
        max_queue = positive_int(max_queue, "max_queue")
        batch_size = positive_int(batch_size, "batch_size")
        max_wait_ms = _seconds(max_wait_ms, "max_wait_ms", zero=True)
        self.model_dir = str(model_dir)
        # several models as one (kbert.EnsembleEmbedder): each batch the worker takes runs through every member in
        # turn, so a batch's token budget bounds each member's forward pass as it does one model's
        ensemble = is_ensemble_dir(self.model_dir)
        onnx = not ensemble and is_onnx_dir(self.model_dir)
        # a SPLADE SparseEncoder dir or its ONNX export: /v1/sparse-embeddings (and /v1/search, sparse index)
        self.sparse = None
        sparse = not ensemble and is_sparse_model(self.model_dir)
        static = None if onnx or sparse or ensemble else load_static(self.model_dir)
        if ensemble:
            from kbert.embed.embedder import EnsembleEmbedder

            self.task_model, self.embedder = None, EnsembleEmbedder.load(self.model_dir)
        elif sparse:
            from kbert.embed.sparse import SparseEncoder

            self.sparse = SparseEncoder.load(self.model_dir, jit_compile=jit_compile)
            self.task_model, self.embedder = None, None
        elif onnx:  # ONNX Runtime alone: no Keras backend is needed on the host
            if read_info(self.model_dir).get("signature") == "classify":  # a head's outputs, no sentence vectors
                from kbert.embed.onnx_task import OnnxTaskModel

                self.task_model, self.embedder = OnnxTaskModel.load(self.model_dir), None
            else:
                from kbert.embed.embedder import OnnxEmbedder

                self.task_model, self.embedder = None, OnnxEmbedder.load(self.model_dir)
        elif static is not None:  # a table of token vectors: numpy alone, no Keras backend either
            self.task_model, self.embedder = None, static
        else:
            from kbert.embed.embedder import Embedder
            from kbert.embed.task_model import TaskModel, task_meta

            meta = task_meta(self.model_dir)  # a task dir's, or a Hugging Face classifier's (a reranker)
            # XLA for a classifier's or reranker's batches too, new batch shapes compiled off the request path
            self.task_model = (TaskModel.load(self.model_dir, jit_compile="background" if jit_compile else False)
                               if meta and meta["task"] != "sentence-embedding" else None)
            # one copy of the weights: a task dir's model serves its vectors too
            self.embedder = (self.task_model.embedder if self.task_model and self.task_model.embedder
                             else Embedder.load(self.model_dir))
        # vectors in context for each word: a network's hidden states (a static table or a pooled ONNX graph has
        # none, and an ensemble's members each have their own)
        self.words = not (sparse or onnx or ensemble or static is not None) and self.embedder is not None
        self.search_index = None  # /v1/search's index, checked against the model served (its probe sentence)
        if index is not None:  # before background compilation: a refused index leaves no compiling thread behind
            if self.embedder is None and self.sparse is None:
                raise ValueError(f"{self.model_dir} is a classifier's ONNX graph, which gives no sentence vectors: "
                                 f"serve --index with the model that built the index")
            from kbert.embed.sparse_index import load_index

            # a SPLADE model serves a kbert.SparseIndex, a dense one a SearchIndex; each checks the probe vector
            self.search_index = load_index(index, model=self.embedder if self.embedder is not None else self.sparse)
        # /v1/search's other half (kbert.hybrid_search): the other kind of index over the same texts, its queries
        # encoded by the model that built it (named in the index), batched here like the served model's
        self.hybrid_index = None if hybrid is None else self._hybrid(hybrid, jit_compile)
        # retrieve, then rerank: a cross-encoder re-scores /v1/search's first hits, its pairs batched here too
        self.reranker = None if reranker is None else self._reranker(reranker, jit_compile)
        if self.embedder is not None:  # XLA for sentence vectors, new batch shapes compiled off the request path
            self.embedder.jit_compile = "background" if jit_compile else False
        # a static model may keep every token
        model = self.embedder if self.embedder is not None else self.sparse or self.task_model
        # a text's cost counts the tokens of the longest input any member reads
        lengths = [m.max_length for m in (model.members if ensemble else [model])]
        self.max_length = max(lengths) if all(lengths) else float("inf")
        self.max_batch_tokens, self.max_wait = int(max_batch_tokens), float(max_wait_ms) / 1000.0
        self.max_queue, self.batch_size = int(max_queue), int(batch_size)
        self._jobs: "list[_Job]" = []
        self._queued = 0  # texts waiting
        self._receiving = 0  # requests read by a handler and not yet queued: a batch may wait for them
        self._cond = threading.Condition()
        self._stop = False
        self._paused = threading.Event()  # set: the worker holds off (tests of a busy server)
        self.ready = threading.Event()
        self.metrics = _Metrics()
        self.metrics.compiling.set_function(lambda: sum(m.compiling for m in self._compiling_models()))
        self.metrics.compiled.set_function(lambda: sum(m.compiled_shapes for m in self._compiling_models()))
        self._worker = threading.Thread(target=self._work, daemon=True, name="kbert-serve-batcher")
        # /v1/keywords' morpheme analyzer: named now (an unknown name fails at start), loaded by its first request
        # in the worker thread, so a server never asked for keywords never needs it installed
        from kbert.text.morphemes import morphemes

        self.analyzer = morphemes(keywords_analyzer)

    def _compiling_models(self) -> list:
        """The models served that compile batch shapes with XLA (sentence vectors, a classifier, a reranker)."""
        models = [self.embedder, self.task_model, self.reranker, getattr(self.hybrid_index, "embedder", None)]
        return [m for m in models if hasattr(m, "wait_compiled")]

    def _hybrid(self, hybrid: str, jit_compile: bool):
        from kbert.embed.index import SearchIndex
        from kbert.embed.sparse_index import SparseIndex, load_index

        if self.search_index is None:
            raise ValueError("--hybrid names the second index of a hybrid search: give the served model's own index "
                             "with --index too")
        other = load_index(hybrid)
        kinds = {type(self.search_index), type(other)}
        if kinds != {SearchIndex, SparseIndex}:
            raise ValueError(f"a hybrid search fuses a dense kbert.SearchIndex with a SPLADE kbert.SparseIndex; "
                             f"--index and --hybrid are both a {type(other).__name__}")
        if len(other) != len(self.search_index):
            raise ValueError(f"--index holds {len(self.search_index)} texts and --hybrid {len(other)}: build both "
                             f"indexes from the same texts and ids")
        other.encode_queries(["준비"])  # loads the model the index names now, so a missing one fails at start
        if isinstance(other, SearchIndex):  # as the served model's: new batch shapes compiled off the request path
            other.embedder.jit_compile = "background" if jit_compile else False
        return other

    def _reranker(self, path: str, jit_compile: bool):
        from kbert.embed.onnx_runtime import is_onnx_dir

        if self.search_index is None:
            raise ValueError("--reranker re-scores /v1/search's hits: give the index it searches with --index too (a "
                             "cross-encoder alone is served with --model, on /v1/rerank)")
        if is_onnx_dir(path):
            from kbert.embed.onnx_task import OnnxTaskModel

            model = OnnxTaskModel.load(path)
        else:
            from kbert.embed.task_model import TaskModel

            model = TaskModel.load(path, jit_compile="background" if jit_compile else False)
        try:
            model.check_rankable()
        except ValueError as e:
            raise ValueError(f"--reranker {path} is not a cross-encoder: {e}") from None
        return model

    def routes(self) -> List[str]:
        """The POST routes this model answers; the others answer 404 saying what they need."""
        out = ["/v1/embeddings", "/v1/similarity", "/v1/keywords"] if self.embedder is not None else []
        if self.words:
            out.insert(1, "/v1/word-embeddings")
        if self.sparse is not None:
            out.append("/v1/sparse-embeddings")
        model = self.task_model
        if model is not None:
            from kbert.embed.zero_shot import nli_indices

            if model.task in ("classification", "pair-classification", "regression", "tagging"):
                out.append("/v1/classify")
            out += {"question-answering": ["/v1/answer"], "tagging": ["/v1/entities"]}.get(model.task, [])
            for route, check in (("/v1/zero-shot", lambda: nli_indices(model.labels)),
                                 ("/v1/rerank", model.check_rankable)):
                if model.task in ("classification", "pair-classification", "regression"):
                    try:
                        check()
                    except ValueError:
                        continue
                    out.append(route)
        return out + (["/v1/search"] if self.search_index is not None else [])

    # ------------------------------------------------------------------ lifecycle
    def start(self, warm: bool = True) -> None:
        self._worker.start()
        if warm:
            self.warm_up()

    def warm_up(self) -> None:
        """Runs the model once (tracing, first allocations, compiling a lone short text's shape), then
        reports ready."""
        if self.embedder is not None:
            self.embedder.encode(["준비"], batch_size=1)
        if self.sparse is not None:
            self.sparse.encode(["준비"], batch_size=1)
        if self.hybrid_index is not None:
            self.hybrid_index.encode_queries(["준비"], batch_size=1)
        if self.reranker is not None:
            self.reranker.predict(["준비"], pairs=["준비"])
        if self.task_model is not None and self.task_model.task == "question-answering":
            self.task_model.answer("준비", "준비")
        elif self.task_model is not None:
            self.task_model.predict(["준비"])
        for model in self._compiling_models():  # those shapes compiled before the first request
            model.wait_compiled()
        # The loaded model and libraries are about half a million long-lived Python objects; a full garbage
        # collection walks them all (a few hundred ms on a busy small CPU, every request in flight waits).
        # Frozen, they are left out of every later collection; what requests allocate is still collected.
        gc.collect()
        gc.freeze()
        self.ready.set()

    def stop(self) -> None:
        """After the queue is empty: the worker exits."""
        with self._cond:
            self._stop = True
            self._paused.clear()
            self._cond.notify_all()
        if self._worker.is_alive():
            self._worker.join(timeout=60)

    def pause(self, paused: bool = True) -> None:
        (self._paused.set if paused else self._paused.clear)()
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ requests
    def receiving(self, delta: int) -> None:
        """A handler started (+1) or finished (-1) reading a request that will queue texts."""
        with self._cond:
            self._receiving += delta
            self._cond.notify_all()

    def cost(self, text: str) -> int:
        return min(len(text) + 2, self.max_length)

    async def run(self, kind: str, texts: List[str], options: dict, pairs=None, timeout: float = 30.0,
                  ticket=None):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        cost = sum(self.cost(t) for t in texts)
        if options.get("long_texts") == "mean":  # every window of a long text runs
            cost = sum(len(t) + 2 for t in texts)
        if kind == "answer":  # a question's context is most of its work: every window of it runs
            cost += sum(len(p) + 2 for p in pairs)
        elif kind == "zero-shot":  # each text runs once beside each candidate label's hypothesis
            cost *= len(options["candidate_labels"])
        elif pairs is not None:  # a pair's second text (/v1/rerank's documents, a --reranker's hits) runs too
            cost += sum(self.cost(p) for p in pairs)
        job = _Job(kind, texts, pairs, options, future, loop, cost)
        with self._cond:
            if self._queued + len(texts) > self.max_queue:
                raise HTTPError(429, f"the server is busy: {self._queued} texts are waiting (at most "
                                     f"{self.max_queue}); retry shortly", "overloaded", {"Retry-After": "1"})
            self._jobs.append(job)
            self._queued += len(texts)
            if ticket is not None and ticket["arriving"]:  # queued: no longer a request to wait for
                ticket["arriving"] = False
                self._receiving -= 1
            self.metrics.queue.set(self._queued)
            self._cond.notify_all()
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            job.cancelled = True
            raise HTTPError(504, f"no answer within {timeout:g} s (the server is overloaded); retry later",
                            "timeout") from None

    # ------------------------------------------------------------------ the worker
    def _take(self) -> "list[_Job]":
        """Blocks for the first job, then gathers more until the token budget or `max_wait` after it."""
        with self._cond:
            while not self._jobs or self._paused.is_set():
                if self._stop and not self._jobs:
                    return []
                self._cond.wait(0.05)
            deadline = time.monotonic() + self.max_wait
            while True:
                taken, tokens = [], 0
                for job in self._jobs:
                    if taken and tokens + job.cost > self.max_batch_tokens:
                        break
                    taken.append(job)
                    tokens += job.cost
                # wait only for requests already arriving: an idle server answers a lone request at once
                if (tokens >= self.max_batch_tokens or len(taken) < len(self._jobs) or self._stop
                        or self._receiving == 0):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            del self._jobs[:len(taken)]
            self._queued -= sum(len(j.texts) for j in taken)
            self.metrics.queue.set(self._queued)
            return taken

    def _work(self) -> None:
        while True:
            jobs = self._take()
            if not jobs:
                return
            jobs = [j for j in jobs if not j.cancelled]
            groups = {}
            for job in jobs:
                groups.setdefault((job.kind, json.dumps(job.options, sort_keys=True)), []).append(job)
            for (kind, _), group in groups.items():
                texts = [t for j in group for t in j.texts]
                self.metrics.batch.observe(len(texts))
                try:
                    rows = self._compute(kind, group, texts)
                except Exception as e:  # noqa: BLE001 - the requests get the error, the server goes on
                    if len(group) == 1:
                        group[0].loop.call_soon_threadsafe(_settle, group[0].future, None, e)
                    else:  # one request's texts can fail a batch it shares: each alone, so only its own fails
                        self._each_alone(kind, group)
                    continue
                start = 0
                for j in group:
                    part = rows[start:start + len(j.texts)]
                    start += len(j.texts)
                    j.loop.call_soon_threadsafe(_settle, j.future, part, None)

    def _each_alone(self, kind, group) -> None:
        for j in group:
            try:
                part = self._compute(kind, [j], list(j.texts))
            except Exception as e:  # noqa: BLE001 - this request gets its error
                j.loop.call_soon_threadsafe(_settle, j.future, None, e)
            else:
                j.loop.call_soon_threadsafe(_settle, j.future, part, None)

    def _compute(self, kind, group, texts):
        options = group[0].options
        if kind == "embed":
            return self.embedder.encode(texts, pooling=options.get("pooling"), normalize=options.get("normalize", True),
                                        prompt_name=options.get("prompt_name"), truncate_dim=options.get("truncate_dim"),
                                        long_texts=options.get("long_texts", "truncate"), batch_size=self.batch_size,
                                        progress=False)
        if kind == "sparse":  # each text's (token ids, weights), heaviest first
            options = dict(options)
            side = options.pop("input_type", None)  # a query: the model's query prompt, or its weight table
            encode = self.sparse.encode_query if side == "query" else self.sparse.encode_document
            vectors = encode(texts, batch_size=self.batch_size, **options)
            return [(ids.tolist(), values.tolist()) for ids, values in self.sparse.weights(vectors)]
        if kind == "query":  # /v1/search: the index's query prompt and encode settings
            return self.search_index.encode_queries(texts, batch_size=self.batch_size)
        if kind == "hybrid-query":  # the same queries for the hybrid's other index, by the model that built it
            return self.hybrid_index.encode_queries(texts, batch_size=self.batch_size)
        if kind == "rerank":  # /v1/search's (query, hit) pairs through the --reranker cross-encoder
            pairs = [p for j in group for p in j.pairs]
            return self.reranker.scores(self.reranker.predict(texts, pairs=pairs, batch_size=self.batch_size))
        if kind == "answer":
            contexts = [p for j in group for p in j.pairs]
            return self.task_model.answer(texts, contexts, batch_size=self.batch_size, **options)
        if kind == "entities":
            return self.task_model.entities(texts, batch_size=self.batch_size, **options)
        if kind == "zero-shot":
            return self.task_model.zero_shot(texts, batch_size=self.batch_size, **options)
        if kind == "words":  # each text's [(word, start, end, vector)], morphemes by the server's analyzer
            return self.embedder.encode_words(texts, morphemes=self.analyzer, batch_size=self.batch_size, **options)
        if kind == "keywords":
            from kbert.embed.keywords import keywords

            return keywords(self.embedder, texts, analyzer=self.analyzer, batch_size=self.batch_size, **options)
        pairs = None
        if any(j.pairs is not None for j in group):
            pairs = [p for j in group for p in (j.pairs if j.pairs is not None else [""] * len(j.texts))]
        return self.task_model.predict(texts, pairs=pairs, batch_size=self.batch_size)


def _settle(future, value, error):
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class _Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("kbert_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=self.registry)
        self.latency = Histogram("kbert_request_seconds", "request latency by route", ["route"], registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.batch = Histogram("kbert_batch_texts", "texts per model batch", registry=self.registry,
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
        self.queue = Gauge("kbert_queue_texts", "texts waiting for the model", registry=self.registry)
        self.texts = Counter("kbert_texts", "texts answered", ["route"], registry=self.registry)
        self.compiling = Gauge("kbert_xla_compiles_pending", "batch shapes waiting for XLA compilation (they "
                               "run on the graph meanwhile)", registry=self.registry)
        self.compiled = Gauge("kbert_xla_shapes_compiled", "batch shapes XLA has compiled", registry=self.registry)


def _json_response(content: dict):
    """JSON with numpy vectors in it: orjson writes float32 arrays directly (several times faster than
    `json.dumps` of Python floats, which the vectors' share of a response makes the server's main cost)."""
    from starlette.responses import Response

    try:
        import orjson
    except ImportError:
        return Response(json.dumps(content, default=lambda v: v.tolist(), ensure_ascii=False),
                        media_type="application/json")
    return Response(orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")


def _loads(text: str):
    try:
        import orjson
    except ImportError:
        return json.loads(text)
    return orjson.loads(text)


def _texts(value, field: str, max_texts: int, max_chars: int) -> List[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value):
        raise HTTPError(400, f"`{field}` must be a string or a non-empty list of strings")
    if len(value) > max_texts:
        raise HTTPError(413, f"`{field}` has {len(value)} texts; at most {max_texts} per request", "too_large")
    longest = max(len(t) for t in value)
    if longest > max_chars:
        raise HTTPError(413, f"a text of `{field}` has {longest} characters; at most {max_chars}", "too_large")
    return value


def build_app(model: str, max_batch_tokens: int = 8192, max_wait_ms: float = 5.0, max_queue: int = 4096,
              max_texts: int = 512, max_chars: int = 20000, timeout_s: float = 30.0, warm: bool = True,
              jit_compile: bool = True, keywords_analyzer: str = "mecab", index: Optional[str] = None,
              hybrid: Optional[str] = None, reranker: Optional[str] = None):
    """The Starlette app serving `model` (a kbert model dir, a fine-tuned task dir, or a Hugging Face dir);
    `app.state.engine` is its `Engine`. `warm=False` leaves /health at 503 until `engine.warm_up()`.
    `jit_compile`: sentence vectors, a classifier's or a reranker's scores through XLA (`Embedder` and
    `TaskModel` with `jit_compile="background"`), else the graph.
    `keywords_analyzer`: the `kbert.morphemes` analyzer of /v1/keywords and /v1/word-embeddings' morphemes.
    `index`: a `kbert.SearchIndex` dir that /v1/search searches (a `kbert.SparseIndex` for a SPLADE model).
    `hybrid`: an index of the other kind over the same texts (built by its own model, which the server loads
    too): /v1/search then fuses both (`kbert.hybrid_search`). `reranker`: a cross-encoder dir (a `kbert.TaskModel`
    that `rank`s, or its ONNX export) that re-scores each /v1/search query's first "candidates" hits."""
    import contextlib

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    # limits that would refuse every request (413) or time every one out, refused by name at start
    max_texts, max_chars = positive_int(max_texts, "max_texts"), positive_int(max_chars, "max_chars")
    timeout_s = _seconds(timeout_s, "timeout_s")
    engine = Engine(model, max_batch_tokens, max_wait_ms, max_queue, jit_compile=jit_compile,
                    keywords_analyzer=keywords_analyzer, index=index, hybrid=hybrid, reranker=reranker)
    name = str(model).rstrip("/").rsplit("/", 1)[-1]
    created = int(time.time())

    def error(e: HTTPError, route: str) -> JSONResponse:
        engine.metrics.requests.labels(route, str(e.status)).inc()
        return JSONResponse({"error": {"message": e.message, "type": e.kind, "code": e.status}}, e.status,
                            headers=e.headers)

    async def body(request) -> dict:
        raw = await request.body()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise HTTPError(400, f"the request body is not UTF-8 (byte {e.start}); send JSON in UTF-8") from None
        try:
            data = _loads(text)
        except ValueError as e:  # json.JSONDecodeError and orjson.JSONDecodeError are ValueErrors
            raise HTTPError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        return data

    def handler(route, fn):
        async def handle(request):
            start = time.perf_counter()
            try:
                if not engine.ready.is_set():
                    raise HTTPError(503, "the model is still loading", "loading", {"Retry-After": "1"})
                ticket = {"arriving": True}  # counted in engine._receiving until its texts are queued
                engine.receiving(+1)
                try:
                    response = await fn(await body(request), ticket)
                finally:
                    if ticket["arriving"]:
                        engine.receiving(-1)
            except HTTPError as e:
                return error(e, route)
            except ValueError as e:  # the model's own check of an option (pooling, ...)
                return error(HTTPError(400, str(e)), route)
            except Exception as e:  # noqa: BLE001 - a JSON 500 that names the failure, never a bare traceback
                return error(HTTPError(500, f"{type(e).__name__}: {e}", "server_error"), route)
            engine.metrics.requests.labels(route, "200").inc()
            engine.metrics.latency.labels(route).observe(time.perf_counter() - start)
            return _json_response(response)
        return handle

    def need_vectors(route):
        if engine.sparse is not None:
            raise HTTPError(404, f"{name} is a SPLADE model: its vectors are a weight per vocabulary token, served "
                                 f"at /v1/sparse-embeddings, not {route}", "not_found")
        if engine.embedder is None:
            raise HTTPError(404, f"{name} is a classifier's ONNX graph: it gives no sentence vectors, which {route} "
                                 f"needs (serve the model dir, or an ONNX export of its vectors)", "not_found")

    async def embeddings(data, ticket=None):
        need_vectors("/v1/embeddings")
        texts = _texts(data.get("input"), "input", max_texts, max_chars)
        options = {}
        if "pooling" in data:
            if not isinstance(data["pooling"], str):
                raise HTTPError(400, "`pooling` must be a string")
            options["pooling"] = data["pooling"]
        if "normalize" in data:
            if not isinstance(data["normalize"], bool):
                raise HTTPError(400, "`normalize` must be true or false")
            options["normalize"] = data["normalize"]
        if "dimensions" in data:  # OpenAI's name for a Matryoshka model's shorter vectors
            if isinstance(data["dimensions"], bool) or not isinstance(data["dimensions"], int):
                raise HTTPError(400, "`dimensions` must be an integer")
            try:
                options["truncate_dim"] = engine.embedder.check_truncate_dim(data["dimensions"])
            except ValueError as e:  # in the request's own words: `dimensions`, not encode's `truncate_dim`
                raise HTTPError(400, str(e).replace("truncate_dim", "dimensions")) from None
        if "prompt_name" in data:
            if not isinstance(data["prompt_name"], str):
                raise HTTPError(400, "`prompt_name` must be a string")
            options["prompt_name"] = data["prompt_name"]
        if "long_texts" in data:
            if data["long_texts"] not in ("truncate", "mean"):
                raise HTTPError(400, f"`long_texts` must be 'truncate' or 'mean'. Received: {data['long_texts']!r}")
            options["long_texts"] = data["long_texts"]
        encoding = data.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise HTTPError(400, f"`encoding_format` must be 'float' or 'base64'. Received: {encoding!r}")
        if "pooling" in options:  # refuse a bad pooling before it waits in the queue
            engine.embedder.resolve_pooling(options["pooling"], None)
        engine.embedder.prompt_text(options.get("prompt_name"))  # and an unknown prompt name
        vectors = await engine.run("embed", texts, options, timeout=timeout_s, ticket=ticket)
        engine.metrics.texts.labels("/v1/embeddings").inc(len(texts))
        tokens = sum(engine.cost(t) for t in texts)
        if encoding == "base64":  # OpenAI's form (its Python client asks for it): little-endian float32 bytes
            vectors = [base64.b64encode(np.asarray(v, "<f4").tobytes()).decode("ascii") for v in vectors]
        return {"object": "list", "model": data.get("model") or name,
                "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def word_embeddings(data, ticket=None):
        from kbert.embed.embedder import UNITS, WORD_POOLINGS
        from kbert.models.pooling import check_pooling

        need_vectors("/v1/word-embeddings")
        if not engine.words:
            raise HTTPError(404, f"{name} gives no word vectors in context (a static model's table, an ONNX graph "
                                 f"that pools inside, or an ensemble of several models): /v1/word-embeddings needs "
                                 f"one model's dir", "not_found")
        texts = _texts(data.get("input"), "input", max_texts, max_chars)
        options = {"unit": data.get("unit", "eojeol"), "pooling": data.get("pooling", "mean")}
        if options["unit"] not in UNITS:
            raise HTTPError(400, f"`unit` must be one of {list(UNITS)}")
        if options["pooling"] not in WORD_POOLINGS:
            raise HTTPError(400, f"`pooling` (of a word's subwords) must be one of {list(WORD_POOLINGS)}")
        layers = data.get("layers", -1)
        layer_list = layers if isinstance(layers, list) and layers else [layers]
        if any(isinstance(x, bool) or not isinstance(x, int) for x in layer_list):
            raise HTTPError(400, "`layers` must be a layer index or a non-empty list of them (-1: the last)")
        check_pooling("mean", layers, engine.embedder.config.num_layers + 1)  # in range: a 400 before the queue
        options["layers"] = layers
        encoding = data.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise HTTPError(400, f"`encoding_format` must be 'float' or 'base64'. Received: {encoding!r}")
        rows = await engine.run("words", texts, options, timeout=timeout_s, ticket=ticket)
        engine.metrics.texts.labels("/v1/word-embeddings").inc(len(texts))
        tokens = sum(engine.cost(t) for t in texts)
        vector = ((lambda v: base64.b64encode(np.asarray(v, "<f4").tobytes()).decode("ascii"))
                  if encoding == "base64" else (lambda v: v))
        return {"object": "list", "model": data.get("model") or name,
                "data": [{"object": "word_embeddings", "index": i,
                          "words": [{"word": w, "start": a, "end": b, "embedding": vector(v)} for w, a, b, v in row]}
                         for i, row in enumerate(rows)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def sparse_embeddings(data, ticket=None):
        if engine.sparse is None:
            raise HTTPError(404, f"{name} is not a SPLADE model: /v1/sparse-embeddings needs a SparseEncoder dir "
                                 f"(`kbert finetune --task sparse-embedding`, or sentence-transformers')", "not_found")
        texts = _texts(data.get("input"), "input", max_texts, max_chars)
        options = {}
        if data.get("max_active_dims") is not None:
            value = data["max_active_dims"]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise HTTPError(400, "`max_active_dims` must be a positive integer")
            options["max_active_dims"] = value
        tokens = data.get("return_tokens", False)
        if not isinstance(tokens, bool):
            raise HTTPError(400, "`return_tokens` must be true or false")
        if data.get("input_type", "document") not in ("query", "document"):
            raise HTTPError(400, "`input_type` must be \"query\" or \"document\"")
        options["input_type"] = data.get("input_type", "document")
        rows = await engine.run("sparse", texts, options, timeout=timeout_s, ticket=ticket)
        engine.metrics.texts.labels("/v1/sparse-embeddings").inc(len(texts))
        used = sum(engine.cost(t) for t in texts)
        return {"object": "list", "model": data.get("model") or name,
                "data": [{"object": "sparse_embedding", "index": i, "indices": ids, "values": values,
                          **({"tokens": [engine.sparse.token(j) for j in ids]} if tokens else {})}
                         for i, (ids, values) in enumerate(rows)],
                "usage": {"prompt_tokens": used, "total_tokens": used}}

    async def similarity(data, ticket=None):
        need_vectors("/v1/similarity")
        source = _texts(data.get("source_sentence"), "source_sentence", 1, max_chars)
        sentences = _texts(data.get("sentences"), "sentences", max_texts - 1, max_chars)
        vectors = await engine.run("embed", source + sentences, {}, timeout=timeout_s, ticket=ticket)
        return {"similarities": [float(x) for x in vectors[1:] @ vectors[0]]}

    async def classify(data, ticket=None):
        if engine.task_model is None:
            raise HTTPError(404, f"{name} is not a fine-tuned task dir: /v1/classify needs one (`kbert finetune`)",
                            "not_found")
        texts = _texts(data.get("input"), "input", max_texts, max_chars)
        pairs = data.get("pairs")
        if pairs is not None:
            pairs = _texts(pairs, "pairs", max_texts, max_chars)
            if len(pairs) != len(texts):
                raise HTTPError(400, f"`pairs` has {len(pairs)} texts for {len(texts)} inputs")
        rows = await engine.run("classify", texts, {}, pairs=pairs, timeout=timeout_s, ticket=ticket)
        model = engine.task_model
        out = []
        for i, row in enumerate(rows):
            if model.task == "regression":
                out.append({"index": i, "value": float(row)})
            elif model.task == "tagging":
                out.append({"index": i, "tags": [[w, t] for w, t in row]})
            else:
                probs = np.asarray(row, np.float64)
                out.append({"index": i, "label": model.labels[int(np.argmax(probs))],
                            "probabilities": {label: float(p) for label, p in zip(model.labels, probs)}})
                if getattr(model, "multi_label", False):  # every label that holds (its own probability > 0.5)
                    out[-1]["labels"] = [label for label, p in zip(model.labels, probs) if p > 0.5]
        return {"task": model.task, "data": out}

    async def answer(data, ticket=None):
        model = engine.task_model
        if model is None or model.task != "question-answering":
            raise HTTPError(404, f"{name} is not a question-answering model: /v1/answer needs one (`kbert finetune "
                                 f"--task question-answering`, or a Hugging Face *ForQuestionAnswering dir)",
                            "not_found")
        questions = _texts(data.get("question"), "question", max_texts, max_chars)
        contexts = _texts(data.get("context"), "context", max_texts, max_chars)
        if len(contexts) == 1 and len(questions) > 1:
            contexts = contexts * len(questions)
        if len(contexts) != len(questions):
            raise HTTPError(400, f"`context` has {len(contexts)} texts for {len(questions)} questions (give one "
                                 f"per question, or one for all)")
        options = {}
        for key, kind in (("top_k", int), ("max_answer_length", int), ("handle_impossible_answer", bool)):
            if key in data:
                value = data[key]
                if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 1)):
                    raise HTTPError(400, f"`{key}` must be {'a positive integer' if kind is int else 'true or false'}")
                options[key] = value
        found = await engine.run("answer", questions, options, pairs=contexts, timeout=timeout_s, ticket=ticket)
        engine.metrics.texts.labels("/v1/answer").inc(len(questions))
        if options.get("top_k", 1) > 1:
            return {"task": model.task, "data": [{"index": i, "answers": a} for i, a in enumerate(found)]}
        return {"task": model.task, "data": [{"index": i, **a} for i, a in enumerate(found)]}

    async def keywords(data, ticket=None):
        from kbert.embed.keywords import check_options

        need_vectors("/v1/keywords")
        texts = _texts(data.get("input"), "input", max_texts, max_chars)
        options = {}
        for key in ("top_n", "diversity", "nr_candidates", "ngram_range", "stop_words", "candidates"):
            if key in data:
                options[key] = data[key]
        for key in ("stop_words", "candidates"):
            if key in options and not (isinstance(options[key], list)
                                       and all(isinstance(w, str) for w in options[key])):
                raise HTTPError(400, f"`{key}` must be a list of strings")
        if "ngram_range" in options and isinstance(options["ngram_range"], list):
            options["ngram_range"] = tuple(options["ngram_range"])
        check_options(**{k: options[k] for k in ("top_n", "diversity", "nr_candidates", "ngram_range")
                         if k in options})  # a bad setting: 400 before the request queues
        found = await engine.run("keywords", texts, options, timeout=timeout_s, ticket=ticket)
        engine.metrics.texts.labels("/v1/keywords").inc(len(texts))
        return {"data": [{"index": i, "keywords": [{"phrase": p, "score": s} for p, s in kws]}
                         for i, kws in enumerate(found)]}

    async def entities(data, ticket=None):
        from kbert.embed.entities import AGGREGATIONS

        model = engine.task_model
        if model is None or model.task != "tagging":
            raise HTTPError(404, f"{name} is not a tagging model: /v1/entities needs one (`kbert finetune --task "
                                 f"tagging`, or a Hugging Face *ForTokenClassification dir)", "not_found")
        texts = _texts(data.get("input"), "input", max_texts, max_chars)
        options = {}
        if "aggregation" in data:
            if data["aggregation"] not in AGGREGATIONS:
                raise HTTPError(400, f"`aggregation` must be one of {list(AGGREGATIONS)}")
            options["aggregation"] = data["aggregation"]
        found = await engine.run("entities", texts, options, timeout=timeout_s, ticket=ticket)
        engine.metrics.texts.labels("/v1/entities").inc(len(texts))
        return {"data": [{"index": i, "entities": e} for i, e in enumerate(found)]}

    async def zero_shot(data, ticket=None):
        from kbert.embed.zero_shot import candidate_list, hypotheses, nli_indices

        model = engine.task_model
        try:
            if model is None or model.task not in ("classification", "pair-classification"):
                raise ValueError("it is not a classifier")
            nli_indices(model.labels)
        except ValueError as e:
            raise HTTPError(404, f"{name} is not a natural-language-inference model: /v1/zero-shot needs one (a "
                                 f"classifier with an 'entailment' label, KLUE-NLI's or KorNLI's); {e}",
                            "not_found") from None
        texts = _texts(data.get("input"), "input", max_texts, max_chars)
        options = {"multi_label": data.get("multi_label", False)}
        if not isinstance(options["multi_label"], bool):
            raise HTTPError(400, "`multi_label` must be true or false")
        try:
            labels = data.get("candidate_labels")
            if not (isinstance(labels, str) or (isinstance(labels, list) and all(isinstance(x, str) for x in labels))):
                raise ValueError("`candidate_labels` must be a string or a list of strings")
            options["candidate_labels"] = candidate_list(labels)
            if "hypothesis_template" in data:
                options["hypothesis_template"] = data["hypothesis_template"]
                hypotheses(options["candidate_labels"], data["hypothesis_template"])
        except ValueError as e:
            raise HTTPError(400, str(e)) from None
        found = await engine.run("zero-shot", texts, options, timeout=timeout_s, ticket=ticket)
        engine.metrics.texts.labels("/v1/zero-shot").inc(len(texts))
        return {"data": [{"index": i, "labels": r["labels"], "scores": r["scores"]} for i, r in enumerate(found)]}

    async def rerank(data, ticket=None):
        model = engine.task_model
        try:
            if model is None:
                raise ValueError("it is not a fine-tuned or classification model")
            model.check_rankable()
        except ValueError as e:
            raise HTTPError(404, f"{name} is not a cross-encoder: /v1/rerank needs a model with one score per "
                                 f"(query, document) pair (a reranker, a `kbert finetune` pair regression or "
                                 f"two-label pair classifier); {e}", "not_found") from None
        query = data.get("query")
        if not isinstance(query, str):
            raise HTTPError(400, "`query` must be a string")
        documents = data.get("documents")
        if isinstance(documents, list):  # Cohere's documents may be {"text": ...} objects
            documents = [d.get("text") if isinstance(d, dict) else d for d in documents]
        documents = _texts(documents, "documents", max_texts, max_chars)
        _texts(query, "query", 1, max_chars)
        top_n = data.get("top_n", len(documents))
        if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
            raise HTTPError(400, "`top_n` must be a positive integer")
        keep = data.get("return_documents", False)
        if not isinstance(keep, bool):
            raise HTTPError(400, "`return_documents` must be true or false")
        scores = await engine.run("classify", [query] * len(documents), {}, pairs=documents, timeout=timeout_s,
                                  ticket=ticket)
        scores = model.scores(scores).astype(np.float64)
        results = []
        for i in np.argsort(-scores, kind="stable")[:top_n]:
            row = {"index": int(i), "relevance_score": float(scores[i])}
            if keep:
                row["document"] = {"text": documents[i]}
            results.append(row)
        engine.metrics.texts.labels("/v1/rerank").inc(len(documents))
        return {"model": data.get("model") or name, "results": results}

    async def search(data, ticket=None):
        from scipy.sparse import issparse

        from kbert.embed.index import metadata_test

        found = engine.search_index
        if found is None:
            raise HTTPError(404, "no search index is served: start the server with --index DIR (a `kbert index "
                                 "build` dir)", "not_found")
        queries = _texts(data.get("query"), "query", max_texts, max_chars)
        settings = {}
        for field, default in (("top_k", 10), ("ef_search", None), ("nprobe", None)):
            value = data.get(field, default)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 1 <= value <= 10_000):
                raise HTTPError(400, f"`{field}` must be an integer in [1, 10000]")
            settings[field] = value
        weight = data.get("lexical", 0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight <= 1:
            raise HTTPError(400, "`lexical` must be a number in [0, 1]")
        where = data.get("where")
        if where is not None and (not isinstance(where, dict) or not all(
                isinstance(v, (str, int, float, bool, list, dict)) for v in where.values())):
            raise HTTPError(400, "`where` must be an object of metadata values (or lists of values, or "
                                 "comparisons such as {\"$gte\": 2020})")
        if where is not None:
            for key, condition in where.items():  # an unknown operator: a 400 naming it, before any work
                metadata_test(key, condition)
        group_by = data.get("group_by")
        if group_by is not None and not isinstance(group_by, str):
            raise HTTPError(400, "`group_by` must be a metadata key (a string)")
        rerank = data.get("rerank", engine.reranker is not None)
        if not isinstance(rerank, bool):
            raise HTTPError(400, "`rerank` must be true or false")
        if rerank and engine.reranker is None:
            raise HTTPError(400, "`rerank` needs a cross-encoder: start the server with --reranker DIR")
        candidates = data.get("candidates", 100)
        if isinstance(candidates, bool) or not isinstance(candidates, int) or not 1 <= candidates <= 10_000:
            raise HTTPError(400, "`candidates` must be an integer in [1, 10000]")
        top_k = settings["top_k"]
        if rerank:  # the first stage finds the hits the reranker re-scores, as `SearchIndex.search(reranker=...)`
            settings["top_k"] = max(top_k, candidates)
        if engine.hybrid_index is not None:
            if weight:
                raise HTTPError(400, "`lexical` (character n-grams mixed into a dense index) is not taken by a "
                                     "hybrid search; its sparse side is the --hybrid index")
            hits = await hybrid(data, queries, where, group_by, settings, candidates, ticket)
        else:
            fused = [k for k in ("weight", "fusion") if k in data]
            if fused or ("candidates" in data and not rerank):
                raise HTTPError(400, f"`{(fused or ['candidates'])[0]}` sets a hybrid search (or, for `candidates`, "
                                     f"the hits a reranker re-scores): start the server with --hybrid DIR (an index "
                                     f"of the other kind over the same texts)"
                                     + ("" if fused else " or --reranker DIR (a cross-encoder)"))
            if weight and not found.info.get("lexical"):
                raise HTTPError(400, "`lexical` needs an index built with lexical=True (kbert index build --lexical)")
            vectors = await engine.run("query", queries, {}, timeout=timeout_s, ticket=ticket)
            # off the event loop: FAISS frees the GIL while it searches
            if not issparse(vectors):  # a sparse index's query vectors stay a CSR matrix
                vectors = np.asarray(vectors)
            hits = await asyncio.to_thread(found.search, queries, query_vectors=vectors, lexical=weight,
                                           candidates=candidates, where=where, group_by=group_by, **settings)
        if rerank:
            hits = await reranked(queries, hits, candidates)
        return found_hits(queries, [row[:top_k] for row in hits])

    async def reranked(queries, hits, candidates):
        """Each query's first `candidates` hits re-scored by the --reranker, all queries' pairs in one job."""
        from kbert.embed.index import reorder_hits

        heads = [row[:candidates] for row in hits]
        texts = [q for q, head in zip(queries, heads) for _ in head]
        if not texts:  # no hits at all (a filter that keeps nothing)
            return hits
        if len(texts) > engine.max_queue:  # could never be queued: a 429's "retry shortly" would be false
            raise HTTPError(413, f"reranking these {len(queries)} queries' first {candidates} hits is {len(texts)} "
                                 f"pairs; at most {engine.max_queue} can wait at once (--max-queue): send fewer "
                                 f"queries or a smaller `candidates`", "too_large")
        scores = await engine.run("rerank", texts, {}, pairs=[h.text for head in heads for h in head],
                                  timeout=timeout_s)
        out, start = [], 0
        for row, head in zip(hits, heads):
            out.append(reorder_hits(row, scores[start:start + len(head)]))
            start += len(head)
        return out

    async def hybrid(data, queries, where, group_by, settings, candidates, ticket):
        from kbert.embed.hybrid import FUSIONS, hybrid_search
        from kbert.embed.index import SearchIndex

        weight = data.get("weight", 0.5)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight <= 1:
            raise HTTPError(400, "`weight` (the sparse side's share of a hybrid search) must be a number in [0, 1]")
        fusion = data.get("fusion", "zscore")
        if fusion not in FUSIONS:
            raise HTTPError(400, f"`fusion` must be one of {list(FUSIONS)}")
        # both sides' queries wait in the queue together (the other side's first: the ticket, which lets a batch
        # close, goes with the last), so one batch of the worker encodes both
        other, own = await asyncio.gather(
            engine.run("hybrid-query", queries, {}, timeout=timeout_s),
            engine.run("query", queries, {}, timeout=timeout_s, ticket=ticket))
        indexes, vectors = (engine.search_index, engine.hybrid_index), (own, other)
        if not isinstance(engine.search_index, SearchIndex):  # a SPLADE model served: its index is the sparse side
            indexes, vectors = indexes[::-1], vectors[::-1]
        return await asyncio.to_thread(hybrid_search, *indexes, queries, weight=weight, fusion=fusion,
                                       candidates=candidates, where=where, group_by=group_by,
                                       query_vectors=vectors, **settings)

    def found_hits(queries, hits):
        engine.metrics.texts.labels("/v1/search").inc(len(queries))
        return {"data": [{"index": i, "hits": [dict({"id": h.id, "score": h.score, "text": h.text},
                                                    **({"metadata": h.metadata} if h.metadata else {}))
                                               for h in row]} for i, row in enumerate(hits)]}

    async def models(request):
        """OpenAI's model list (its clients and gateways such as LiteLLM ask for it), the one model served, with
        what a client needs to use it: the routes it answers, its length and, for vectors, their width."""
        row = {"id": name, "object": "model", "created": created, "owned_by": "kbert", "routes": engine.routes(),
               "max_length": None if engine.max_length == float("inf") else int(engine.max_length)}
        if engine.embedder is not None:
            try:
                row["dimension"] = int(engine.embedder.dimension)
            except (AttributeError, TypeError):  # an ONNX graph that records no width
                pass
        return JSONResponse({"object": "list", "data": [row]})

    async def health(request):
        if engine.ready.is_set():
            return JSONResponse({"status": "ok", "model": name})
        return JSONResponse({"status": "loading"}, 503, headers={"Retry-After": "1"})

    async def metrics(request):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await asyncio.to_thread(engine.start, warm)
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)  # uvicorn has let the requests in flight finish

    routes = [Route("/v1/embeddings", handler("/v1/embeddings", embeddings), methods=["POST"]),
              Route("/v1/similarity", handler("/v1/similarity", similarity), methods=["POST"]),
              Route("/v1/word-embeddings", handler("/v1/word-embeddings", word_embeddings), methods=["POST"]),
              Route("/v1/sparse-embeddings", handler("/v1/sparse-embeddings", sparse_embeddings), methods=["POST"]),
              Route("/v1/classify", handler("/v1/classify", classify), methods=["POST"]),
              Route("/v1/answer", handler("/v1/answer", answer), methods=["POST"]),
              Route("/v1/keywords", handler("/v1/keywords", keywords), methods=["POST"]),
              Route("/v1/entities", handler("/v1/entities", entities), methods=["POST"]),
              Route("/v1/zero-shot", handler("/v1/zero-shot", zero_shot), methods=["POST"]),
              Route("/v1/rerank", handler("/v1/rerank", rerank), methods=["POST"]),
              Route("/v1/search", handler("/v1/search", search), methods=["POST"]),
              Route("/v1/models", models), Route("/health", health), Route("/metrics", metrics)]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.engine = engine
    return app


def serve(model: str, host: str = "127.0.0.1", port: int = 8080, **options) -> None:
    """Serves `model` with uvicorn until SIGTERM or Ctrl-C (which drain the requests in flight first)."""
    import uvicorn

    # checked here: uvicorn given port 99999 never binds, never raises and never exits (a hang)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"`port` must be an integer in [1, 65535]. Received: port={port!r}")
    app = build_app(model, **options)
    print(f"serving {model} on http://{host}:{port}: POST {', '.join(app.state.engine.routes())}; GET /v1/models, "
          f"/health, /metrics; Ctrl-C or SIGTERM drains and stops", file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30)
