"""`kbert serve` on loopback: the OpenAI-format round trip, batching under concurrency, bad input and its status
codes, the full queue and the deadline, classification from a task dir, /health and /metrics, and SIGTERM
draining the requests in flight."""

import asyncio
import base64
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kbert
from kbert.data.corpus import corpus

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

TEXTS = ["대한민국은 민주공화국이다.", "모든 국민은 법 앞에 평등하다.", "국회는 법률을 제정한다.", "짧은 글",
         "대통령은 국가의 원수이며 외국에 대하여 국가를 대표한다.", "헌법 개정은 국회 재적의원 과반수의 발의로 제안된다."]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A small BERT with its tokenizer, and a classification task dir on it (an untrained head). Seeded: the
    tests compare orders of hits (a reranker's against the index's), which a fresh random model could tie."""
    import keras

    from kbert.data.features import build_network
    from kbert.embed.task_model import TaskModel
    from kbert.models.tasks import TaskNetwork

    root = tmp_path_factory.mktemp("serve")
    keras.utils.set_random_seed(0)
    tok = kbert.Tokenizer.train(corpus(["kolaw"]), vocab_size=900, progress=False)
    cfg = kbert.ModelConfig.preset("bert-tiny", vocab_size=tok.vocab_size, hidden_size=32, num_heads=2,
                                   intermediate_size=64, num_layers=2, max_position=128)
    backbone = kbert.BertBackbone(cfg)
    model_dir = kbert.save_model(backbone, str(root / "model"), tokenizer=tok)
    emb = kbert.Embedder.load(model_dir)
    network = TaskNetwork(emb.backbone, "classification", 2, 0.0, (0.0, 1.0), "pooler", -1)
    build_network(network, emb.tokenizer)
    meta = {"task": "classification", "labels": ["부정", "긍정"], "max_length": 64, "text_column": "text",
            "pair_column": None, "label_column": "label", "pooling": "pooler", "layers": -1}
    task_dir = TaskModel(network, emb.tokenizer, meta).save(str(root / "task"))
    return model_dir, task_dir


class Running:
    """A uvicorn server on 127.0.0.1 (an ephemeral port) in a thread."""

    def __init__(self, app):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 120
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=60)


def test_health_waits_for_warm_up_and_embeddings_equal_encode(dirs):
    from kbert.server import build_app

    model_dir, _ = dirs
    app = build_app(model_dir, warm=False)
    emb = kbert.Embedder.load(model_dir)
    with Running(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        assert client.get("/health").status_code == 503
        early = client.post("/v1/embeddings", json={"input": TEXTS})
        assert early.status_code == 503 and early.headers["retry-after"] == "1"
        app.state.engine.warm_up()
        assert client.get("/health").json()["status"] == "ok"
        listed = client.get("/v1/models").json()  # OpenAI's model list: the one model, what it answers
        assert listed["object"] == "list" and len(listed["data"]) == 1
        assert {k: listed["data"][0][k] for k in ("id", "object", "owned_by", "max_length", "dimension")} == {
            "id": "model", "object": "model", "owned_by": "kbert", "max_length": emb.max_length,
            "dimension": emb.dimension}
        assert listed["data"][0]["routes"] == app.state.engine.routes() and listed["data"][0]["created"] > 0
        r = client.post("/v1/embeddings", json={"input": TEXTS, "model": "kbert-test"})
        assert r.status_code == 200
        body = r.json()
        assert body["object"] == "list" and body["model"] == "kbert-test"
        assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
        got = np.array([d["embedding"] for d in body["data"]], np.float32)
        np.testing.assert_allclose(got, emb.encode(TEXTS), atol=1e-6)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
        one = client.post("/v1/embeddings", json={"input": TEXTS[0], "pooling": "cls", "normalize": False}).json()
        np.testing.assert_allclose(one["data"][0]["embedding"], emb.encode(TEXTS[0], pooling="cls", normalize=False),
                                   atol=1e-6)
        sim = client.post("/v1/similarity", json={"source_sentence": TEXTS[0], "sentences": TEXTS[1:3]}).json()
        vectors = emb.encode(TEXTS[:3])
        np.testing.assert_allclose(sim["similarities"], vectors[1:] @ vectors[0], atol=1e-6)
        # a shape met for the first time ran on the graph and compiled in the background; now XLA answers
        app.state.engine.embedder.wait_compiled()
        again = client.post("/v1/embeddings", json={"input": TEXTS}).json()
        np.testing.assert_allclose(np.array([d["embedding"] for d in again["data"]], np.float32),
                                   emb.encode(TEXTS), atol=1e-6)
        metrics = client.get("/metrics").text
        assert 'kbert_requests_total{route="/v1/embeddings",status="200"} 3.0' in metrics
        assert 'kbert_requests_total{route="/v1/embeddings",status="503"} 1.0' in metrics
        assert "kbert_batch_texts_count" in metrics and "kbert_queue_texts" in metrics
        compiled = float(metrics.split("\nkbert_xla_shapes_compiled ")[1].split()[0])
        assert compiled >= 2 and "kbert_xla_compiles_pending 0.0" in metrics


def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(dirs):
    from kbert.server import build_app

    model_dir, _ = dirs
    expected = kbert.Embedder.load(model_dir).encode(TEXTS * 6)
    app = build_app(model_dir, max_wait_ms=20)
    requests = [[TEXTS[(i + k) % len(TEXTS)] for k in range(1 + i % 3)] for i in range(32)]

    async def load(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*[client.post("/v1/embeddings", json={"input": r}) for r in requests])

    with Running(app) as srv:
        responses = asyncio.run(load(srv.url))
        metrics = httpx.get(srv.url + "/metrics").text
    lookup = {t: expected[TEXTS.index(t)] for t in TEXTS}
    for texts, response in zip(requests, responses):
        assert response.status_code == 200
        got = np.array([d["embedding"] for d in response.json()["data"]], np.float32)
        np.testing.assert_allclose(got, np.stack([lookup[t] for t in texts]), atol=1e-5)
    count = float(metrics.split("kbert_batch_texts_count ")[1].split()[0])
    total = float(metrics.split("kbert_batch_texts_sum ")[1].split()[0])
    assert total == sum(len(r) for r in requests) and count < len(requests)  # requests shared batches


def test_embeddings_take_a_prompt_by_name_and_openais_dimensions(dirs, tmp_path):
    """A sentence-transformers dir with E5-style prompts: "prompt_name" picks one (the vectors of
    Embedder.encode_query), an unknown name or a non-string is a 400 naming it; "dimensions" gives the first
    n dimensions renormalized (Embedder.encode's truncate_dim); "encoding_format": "base64" the same floats
    as bytes, and an unknown format is a 400; "long_texts": "mean" reads a long text whole."""
    from kbert.server import build_app

    model_dir, _ = dirs
    loaded = kbert.Embedder.load(model_dir)
    prompted = kbert.Embedder(loaded.backbone, loaded.tokenizer, prompts={"query": "질문: ", "passage": "문서: "})
    st_dir = kbert.export_sentence_transformers(prompted, str(tmp_path / "st"))
    emb = kbert.Embedder.load(st_dir)
    with Running(build_app(st_dir)) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        r = client.post("/v1/embeddings", json={"input": TEXTS[:3], "prompt_name": "query"}).json()
        got = np.array([d["embedding"] for d in r["data"]], np.float32)
        np.testing.assert_allclose(got, emb.encode_query(TEXTS[:3]), atol=1e-5)
        plain = client.post("/v1/embeddings", json={"input": TEXTS[:3]}).json()
        np.testing.assert_allclose(np.array([d["embedding"] for d in plain["data"]], np.float32),
                                   emb.encode(TEXTS[:3]), atol=1e-5)
        for bad, message in (("answer", "'answer' is not one of this model's prompts"), (3, "must be a string")):
            response = client.post("/v1/embeddings", json={"input": "a", "prompt_name": bad})
            assert response.status_code == 400 and message in response.json()["error"]["message"]
        # OpenAI's `dimensions`: a Matryoshka model's first n dimensions, renormalized
        short = client.post("/v1/embeddings", json={"input": TEXTS[:3], "dimensions": 8}).json()
        np.testing.assert_allclose(np.array([d["embedding"] for d in short["data"]], np.float32),
                                   emb.encode(TEXTS[:3], truncate_dim=8), atol=1e-5)
        for bad, message in ((0, "`dimensions` must be an integer in [1, 32]"), ("8", "`dimensions` must be")):
            response = client.post("/v1/embeddings", json={"input": "a", "dimensions": bad})
            assert response.status_code == 400 and message in response.json()["error"]["message"]
        # OpenAI's `encoding_format`: "base64" is each vector's float32 bytes, decoded as OpenAI's client does
        packed = client.post("/v1/embeddings", json={"input": TEXTS[:3], "encoding_format": "base64"}).json()
        assert all(isinstance(d["embedding"], str) for d in packed["data"])
        np.testing.assert_array_equal(
            np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="float32") for d in packed["data"]]),
            np.array([d["embedding"] for d in plain["data"]], np.float32))
        floats = client.post("/v1/embeddings", json={"input": TEXTS[:3], "encoding_format": "float"}).json()
        assert floats["data"] == plain["data"]
        response = client.post("/v1/embeddings", json={"input": "a", "encoding_format": "hex"})
        assert response.status_code == 400 and "`encoding_format` must be 'float' or 'base64'" in \
            response.json()["error"]["message"]
        # "long_texts": "mean" reads a text past max_length in windows, as Embedder.encode
        long = " ".join(TEXTS) * 8
        assert len(emb.tokenizer.ids_batch([long])[0]) > 2 * emb.max_length
        whole = client.post("/v1/embeddings", json={"input": [long, TEXTS[0]], "long_texts": "mean"}).json()
        np.testing.assert_allclose([d["embedding"] for d in whole["data"]],
                                   emb.encode([long, TEXTS[0]], long_texts="mean"), atol=1e-5)
        response = client.post("/v1/embeddings", json={"input": "a", "long_texts": "split"})
        assert response.status_code == 400 and "`long_texts` must be" in response.json()["error"]["message"]


def test_bad_input_gets_its_status_and_a_json_message(dirs):
    from kbert.server import build_app

    model_dir, _ = dirs
    with Running(build_app(model_dir, max_texts=4, max_chars=50)) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as client:
        cases = [
            (client.post("/v1/embeddings", content=b"{not json"), 400, "not valid JSON"),
            (client.post("/v1/embeddings", content=b'{"input": "\xff\xfe"}'), 400, "not UTF-8"),
            (client.post("/v1/embeddings", json=["a list"]), 400, "JSON object"),
            (client.post("/v1/embeddings", json={"input": 5}), 400, "`input` must be a string"),
            (client.post("/v1/embeddings", json={"input": []}), 400, "non-empty list"),
            (client.post("/v1/embeddings", json={"input": ["a"] * 5}), 413, "at most 4"),
            (client.post("/v1/embeddings", json={"input": "가" * 51}), 413, "at most 50"),
            (client.post("/v1/embeddings", json={"input": "a", "pooling": "median"}), 400, "pooling"),
            (client.post("/v1/embeddings", json={"input": "a", "normalize": "yes"}), 400, "true or false"),
            (client.post("/v1/classify", json={"input": "a"}), 404, "not a fine-tuned task dir"),
            (client.post("/v1/similarity", json={"source_sentence": ["a", "b"], "sentences": ["c"]}), 413, "at most 1"),
        ]
        for response, status, message in cases:
            assert response.status_code == status, (response.status_code, response.text)
            error = response.json()["error"]
            assert message in error["message"] and error["code"] == status, error


def test_limits_that_would_refuse_every_request_are_refused_by_name_before_the_model_loads(capsys):
    """A queue of 0 answered every request 429, max_texts / max_chars 0 every one 413, a timeout of 0 every one
    504; a NaN wait bounded nothing. Each is an error at start, before the model loads."""
    from kbert.server import build_app

    for bad, match in ((dict(max_queue=0), "`max_queue` must be a positive integer"),
                       (dict(max_texts=0), "`max_texts` must be a positive integer"),
                       (dict(max_chars=-1), "`max_chars` must be a positive integer"),
                       (dict(max_batch_tokens=0), "`max_batch_tokens` must be a positive integer"),
                       (dict(timeout_s=0), "`timeout_s` must be a finite number > 0"),
                       (dict(timeout_s=float("inf")), "`timeout_s` must be a finite number > 0"),
                       (dict(max_wait_ms=float("nan")), "`max_wait_ms` must be a finite number >= 0"),
                       (dict(max_wait_ms=-5), "`max_wait_ms` must be a finite number >= 0")):
        with pytest.raises(ValueError, match=match):
            build_app("no-such-model-dir", **bad)
    from kbert.server import serve

    with pytest.raises(ValueError, match=r"`port` must be an integer in \[1, 65535\]"):
        serve("no-such-model-dir", port=99999)  # uvicorn never bound it, and never exited either
    from kbert.cli import main

    assert main(["serve", "--model", "no-such-model-dir", "--timeout", "0"]) == 1  # named as the flag
    assert "--timeout must be a finite number of seconds > 0" in capsys.readouterr().err


def test_a_full_queue_answers_429_at_once_and_a_late_request_504(dirs):
    from kbert.server import build_app

    model_dir, _ = dirs
    app = build_app(model_dir, max_queue=4, timeout_s=3.0)
    with Running(app) as srv:
        app.state.engine.pause()  # the model is busy: nothing leaves the queue

        out = {}

        def first():  # its texts wait in the queue until the deadline
            out["first"] = httpx.post(srv.url + "/v1/embeddings", json={"input": TEXTS[:3]}, timeout=60)

        waiting = threading.Thread(target=first)
        waiting.start()
        time.sleep(0.3)
        t = time.perf_counter()
        second = httpx.post(srv.url + "/v1/embeddings", json={"input": TEXTS[:3]}, timeout=60)
        waited = time.perf_counter() - t
        waiting.join(timeout=60)
        first = out["first"]
        assert second.status_code == 429 and second.headers["retry-after"] == "1" and waited < 1.5  # not the 3 s deadline
        assert "busy" in second.json()["error"]["message"]
        assert first.status_code == 504 and "no answer within 3 s" in first.json()["error"]["message"]
        app.state.engine.pause(False)
        assert httpx.post(srv.url + "/v1/embeddings", json={"input": TEXTS[:2]}, timeout=60).status_code == 200


def test_a_request_that_fails_the_model_fails_alone_not_the_batch_it_shared(dirs):
    """Three requests wait in one batch; the model fails on one request's text. That request gets a 500 naming
    the failure, the other two their vectors: the batch runs again one request at a time."""
    from kbert.server import build_app

    model_dir, _ = dirs
    app = build_app(model_dir)
    engine = app.state.engine
    real, calls = engine.embedder.encode, []

    def encode(texts, **options):
        calls.append(list(texts))
        if "독" in texts:
            raise RuntimeError("this text breaks the model")
        return real(texts, **options)

    bodies = [TEXTS[:2], ["독"], TEXTS[2:3]]
    out = [None] * len(bodies)

    def post(i):
        out[i] = httpx.post(srv.url + "/v1/embeddings", json={"input": bodies[i]}, timeout=60)

    with Running(app) as srv:
        deadline = time.time() + 120
        while httpx.get(srv.url + "/health", timeout=60).status_code != 200:  # warmed up: no other calls
            assert time.time() < deadline, "the model did not warm up"
            time.sleep(0.1)
        engine.pause()  # the model is busy: the three requests queue up and leave as one batch
        engine.embedder.encode = encode
        threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
        for thread in threads:
            thread.start()
        deadline = time.time() + 30
        while "kbert_queue_texts 4.0" not in httpx.get(srv.url + "/metrics").text:
            assert time.time() < deadline, "the requests did not queue"
            time.sleep(0.05)
        engine.pause(False)
        for thread in threads:
            thread.join(timeout=60)
    assert sorted(calls[0]) == sorted(t for body in bodies for t in body)  # one batch of the four texts,
    assert sorted(calls[1:]) == sorted(bodies)  # then each request's alone
    assert out[1].status_code == 500 and "this text breaks the model" in out[1].json()["error"]["message"]
    for i in (0, 2):
        assert out[i].status_code == 200, out[i].text
        got = np.array([d["embedding"] for d in out[i].json()["data"]], np.float32)
        np.testing.assert_allclose(got, real(bodies[i]), atol=1e-5)


def test_classify_from_a_task_dir(dirs):
    from kbert.server import build_app

    _, task_dir = dirs
    expected = kbert.TaskModel.load(task_dir).predict(TEXTS[:3])
    with Running(build_app(task_dir)) as srv:
        body = httpx.post(srv.url + "/v1/classify", json={"input": TEXTS[:3]}, timeout=60).json()
    assert body["task"] == "classification"
    for i, row in enumerate(body["data"]):
        probs = [row["probabilities"][label] for label in ("부정", "긍정")]
        np.testing.assert_allclose(probs, expected[i], atol=1e-6)
        assert row["label"] == ("부정", "긍정")[int(np.argmax(expected[i]))]


def test_rerank_serves_a_hugging_face_reranker_in_cohere_s_form(dirs, tmp_path):
    """/v1/rerank on a one-logit XLMRobertaForSequenceClassification: the order and scores of TaskModel.rank,
    Cohere's request and answer (documents as strings or {"text"}, top_n, return_documents); a model that is
    not a cross-encoder answers 404, bad fields 400."""
    from helpers import xlmr_dir
    from kbert.server import build_app

    reranker = xlmr_dir(tmp_path, model_class="XLMRobertaForSequenceClassification", num_labels=1)
    query, docs = TEXTS[0], TEXTS[1:]
    expected = kbert.TaskModel.load(reranker).rank(query, docs)
    app = build_app(reranker)
    assert {"/v1/classify", "/v1/rerank"} <= set(app.state.engine.routes())
    assert "/v1/zero-shot" not in app.state.engine.routes()
    with Running(app) as srv:
        body = httpx.post(srv.url + "/v1/rerank", json={"query": query, "documents": docs}, timeout=60).json()
        assert [r["index"] for r in body["results"]] == [e["corpus_id"] for e in expected]
        np.testing.assert_allclose([r["relevance_score"] for r in body["results"]],
                                   [e["score"] for e in expected], atol=1e-5)
        top = httpx.post(srv.url + "/v1/rerank", json={"query": query, "documents": [{"text": d} for d in docs],
                                                       "top_n": 2, "return_documents": True}, timeout=60).json()
        assert [r["index"] for r in top["results"]] == [e["corpus_id"] for e in expected[:2]]
        assert [r["document"]["text"] for r in top["results"]] == [docs[e["corpus_id"]] for e in expected[:2]]
        bad = httpx.post(srv.url + "/v1/rerank", json={"query": query, "documents": docs, "top_n": 0}, timeout=60)
        assert bad.status_code == 400 and "top_n" in bad.json()["error"]["message"]
        bad = httpx.post(srv.url + "/v1/rerank", json={"query": [query], "documents": docs}, timeout=60)
        assert bad.status_code == 400 and "query" in bad.json()["error"]["message"]
    from kbert.server import HTTPError

    idle = build_app(reranker, warm=False).state.engine  # its worker never runs: the job stays queued
    with pytest.raises(HTTPError, match="no answer within"):
        asyncio.run(idle.run("classify", [query] * 2, {}, pairs=docs[:2], timeout=0.01))
    # the batch's token budget counts both texts of each pair, not the query alone
    assert idle._jobs[-1].cost == sum(idle.cost(t) for t in [query] * 2 + docs[:2])
    with Running(build_app(dirs[1])) as srv:
        missing = httpx.post(srv.url + "/v1/rerank", json={"query": query, "documents": docs}, timeout=60)
    assert missing.status_code == 404 and "cross-encoder" in missing.json()["error"]["message"]


def test_answer_serves_a_question_answering_model(dirs, tmp_path):
    """/v1/answer on a reader (a question-answering head on the small BERT, contexts over several windows):
    the spans and scores of TaskModel.answer for one or many questions, one context for all, top_k; the
    start / end index the original context; a model without that head answers 404, bad fields 400, and
    /v1/classify on the reader says to use /v1/answer's call."""
    from kbert.data.features import build_network
    from kbert.embed.task_model import TaskModel
    from kbert.models.tasks import TaskNetwork
    from kbert.server import build_app

    emb = kbert.Embedder.load(dirs[0])
    network = TaskNetwork(emb.backbone, "question-answering", 2, 0.0)
    build_network(network, emb.tokenizer)
    meta = {"task": "question-answering", "labels": None, "max_length": 24, "doc_stride": 6, "max_query_length": 8,
            "max_answer_length": 5, "impossible": False}
    reader = TaskModel(network, emb.tokenizer, meta).save(str(tmp_path / "reader"))
    context = " ".join(TEXTS)
    questions = ["국회는 무엇을 하는가", "대통령은 누구인가"]
    expected = kbert.TaskModel.load(reader).answer(questions, context)
    with Running(build_app(reader)) as srv:
        body = httpx.post(srv.url + "/v1/answer", json={"question": questions, "context": context}, timeout=60).json()
        assert body["task"] == "question-answering"
        assert [{k: d[k] for k in ("answer", "start", "end")} for d in body["data"]] == [
            {k: e[k] for k in ("answer", "start", "end")} for e in expected]
        np.testing.assert_allclose([d["score"] for d in body["data"]], [e["score"] for e in expected], rtol=1e-5)
        assert all(context[d["start"]:d["end"]] == d["answer"] for d in body["data"])
        top = httpx.post(srv.url + "/v1/answer", json={"question": questions[0], "context": [context], "top_k": 3},
                         timeout=60).json()
        assert len(top["data"]) == 1 and len(top["data"][0]["answers"]) == 3
        bad = httpx.post(srv.url + "/v1/answer", json={"question": questions, "context": [context] * 3}, timeout=60)
        assert bad.status_code == 400 and "one per question" in bad.json()["error"]["message"]
        bad = httpx.post(srv.url + "/v1/answer", json={"question": "q", "context": context, "top_k": 0}, timeout=60)
        assert bad.status_code == 400 and "top_k" in bad.json()["error"]["message"]
        wrong = httpx.post(srv.url + "/v1/classify", json={"input": "질문"}, timeout=60)
        assert wrong.status_code == 400 and "answer(question, context)" in wrong.json()["error"]["message"]
    with Running(build_app(dirs[1])) as srv:
        missing = httpx.post(srv.url + "/v1/answer", json={"question": "q", "context": context}, timeout=60)
    assert missing.status_code == 404 and "question-answering" in missing.json()["error"]["message"]


def test_entities_serve_a_tagger(dirs, tmp_path):
    """/v1/entities on a tagger trained on entity spans (an untrained head with B-/I- labels here): the spans of
    TaskModel.entities for one text or many, each indexing the input as given; aggregation chosen per request;
    a model of another task answers 404, a bad aggregation 400."""
    from kbert.data.features import build_network
    from kbert.embed.task_model import TaskModel
    from kbert.models.tasks import TaskNetwork
    from kbert.server import build_app

    emb = kbert.Embedder.load(dirs[0])
    labels = ["O", "B-LC", "I-LC", "B-OG", "I-OG"]
    network = TaskNetwork(emb.backbone, "tagging", len(labels), 0.0)
    build_network(network, emb.tokenizer)
    meta = {"task": "tagging", "labels": labels, "max_length": 64, "aggregation": "simple"}
    tagger = TaskModel(network, emb.tokenizer, meta).save(str(tmp_path / "tagger"))
    expected = kbert.TaskModel.load(tagger).entities(TEXTS, ignore_labels=())
    with Running(build_app(tagger)) as srv:
        body = httpx.post(srv.url + "/v1/entities", json={"input": TEXTS}, timeout=60).json()
        got = [d["entities"] for d in body["data"]]
        assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
        keep = [[e for e in x if e["entity_group"] != "O"] for x in expected]
        assert [[(e["entity_group"], e["start"], e["end"]) for e in x] for x in got] == [
            [(e["entity_group"], e["start"], e["end"]) for e in x] for x in keep]
        np.testing.assert_allclose([e["score"] for x in got for e in x], [e["score"] for x in keep for e in x],
                                   rtol=1e-5)
        assert all(t[e["start"]:e["end"]] == e["word"] for t, x in zip(TEXTS, got) for e in x)
        tokens = httpx.post(srv.url + "/v1/entities", json={"input": TEXTS[0], "aggregation": "none"},
                            timeout=60).json()["data"]
        assert len(tokens) == 1 and all("index" in e and "entity" in e for e in tokens[0]["entities"])
        bad = httpx.post(srv.url + "/v1/entities", json={"input": TEXTS[0], "aggregation": "mean"}, timeout=60)
        assert bad.status_code == 400 and "aggregation" in bad.json()["error"]["message"]
    with Running(build_app(dirs[1])) as srv:
        missing = httpx.post(srv.url + "/v1/entities", json={"input": "서울"}, timeout=60)
    assert missing.status_code == 404 and "tagging" in missing.json()["error"]["message"]


def test_keywords_serve_kbert_keywords_of_each_document(dirs):
    """/v1/keywords: the keyphrases and scores of kbert.keywords with the server's analyzer, for one document
    or several, with the request's settings; bad settings 400 before they queue; an unknown analyzer fails at
    start."""
    from kbert.server import build_app

    docs = ["헌법재판소는 법률의 위헌 여부를 심판한다. 국회는 법률을 제정한다.",
            "대통령은 국가의 원수이며 외국에 대하여 국가를 대표한다."]
    emb = kbert.Embedder.load(dirs[0])
    expected = kbert.keywords(emb, docs, top_n=3, diversity=0.3, analyzer="kiwi")
    with Running(build_app(dirs[0], keywords_analyzer="kiwi")) as srv:
        body = httpx.post(srv.url + "/v1/keywords", json={"input": docs, "top_n": 3, "diversity": 0.3},
                          timeout=60).json()
        assert [[k["phrase"] for k in d["keywords"]] for d in body["data"]] == [[p for p, _ in e] for e in expected]
        np.testing.assert_allclose([k["score"] for d in body["data"] for k in d["keywords"]],
                                   [s for e in expected for _, s in e], atol=1e-5)
        one = httpx.post(srv.url + "/v1/keywords", json={"input": docs[0], "candidates": ["법률", "국회", "대통령"]},
                         timeout=60).json()
        assert len(one["data"]) == 1 and sorted(k["phrase"] for k in one["data"][0]["keywords"]) == ["국회", "법률"]
        for bad, word in [({"top_n": 0}, "top_n"), ({"ngram_range": [2, 1]}, "ngram_range"),
                          ({"diversity": 0.5, "nr_candidates": 10}, "choose one"),
                          ({"stop_words": "법률"}, "stop_words")]:
            r = httpx.post(srv.url + "/v1/keywords", json={"input": docs, **bad}, timeout=60)
            assert r.status_code == 400 and word in r.json()["error"]["message"], (bad, r.text)
    with pytest.raises(ValueError, match="Unknown morpheme backend"):
        build_app(dirs[0], keywords_analyzer="nltk")


def test_word_embeddings_serve_encode_words(dirs, tmp_path):
    """/v1/word-embeddings: each word's span and vector in context as `Embedder.encode_words` gives them, for
    whitespace words, morphemes of the server's analyzer and subwords, chosen layers, base64; bad settings 400
    before they queue; a static model (no context) answers 404."""
    from kbert.server import build_app

    emb = kbert.Embedder.load(dirs[0])
    with Running(build_app(dirs[0], keywords_analyzer="kiwi")) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as client:
        assert "/v1/word-embeddings" in srv.server.config.app.state.engine.routes()
        for payload, options in (({}, {}), ({"unit": "morpheme"}, {"unit": "morpheme", "morphemes": "kiwi"}),
                                 ({"unit": "subword", "pooling": "first", "layers": [-1, -2]},
                                  {"unit": "subword", "pooling": "first", "layers": [-1, -2]})):
            r = client.post("/v1/word-embeddings", json={"input": TEXTS[:3], **payload})
            assert r.status_code == 200, r.text
            want = emb.encode_words(TEXTS[:3], **options)
            for row, words in zip(r.json()["data"], want):
                assert [(w["word"], w["start"], w["end"]) for w in row["words"]] == [w[:3] for w in words]
                np.testing.assert_allclose([w["embedding"] for w in row["words"]], [w[3] for w in words], atol=1e-5)
        morphs = client.post("/v1/word-embeddings", json={"input": TEXTS[1], "unit": "morpheme"}).json()["data"]
        assert len(morphs) == 1 and len(morphs[0]["words"]) > len(TEXTS[1].split())  # 국민 + 은, ...
        packed = client.post("/v1/word-embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
        np.testing.assert_allclose(
            [np.frombuffer(base64.b64decode(w["embedding"]), "<f4") for w in packed["data"][0]["words"]],
            [w[3] for w in emb.encode_words(TEXTS[0])], atol=1e-5)
        for bad, word in (({"unit": "syllable"}, "`unit` must be one of"), ({"pooling": "max"}, "`pooling`"),
                          ({"layers": "all"}, "`layers` must be"), ({"layers": [9]}, "`layers` entries must be in")):
            r = client.post("/v1/word-embeddings", json={"input": TEXTS[:2], **bad})
            assert r.status_code == 400 and word in r.json()["error"]["message"], (bad, r.text)
    static = kbert.export_sentence_transformers(kbert.distill_static(dirs[0], dim=16), str(tmp_path / "static"))
    with Running(build_app(static)) as srv:
        r = httpx.post(srv.url + "/v1/word-embeddings", json={"input": TEXTS[0]}, timeout=60)
        assert r.status_code == 404 and "no word vectors in context" in r.json()["error"]["message"]


@pytest.mark.slow
def test_sigterm_drains_the_requests_in_flight(dirs):
    model_dir, _ = dirs
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "kbert.cli", "serve", "--model", model_dir, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else "no start"
            time.sleep(0.2)
        results = []

        def call(i):
            r = httpx.post(url + "/v1/embeddings", json={"input": [f"{t} {i}" for t in TEXTS] * 40}, timeout=120)
            results.append(r.status_code)

        def accepted():  # texts the server has queued or batched so far, from its /metrics
            values = {}
            for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
                if line.startswith(("kbert_queue_texts ", "kbert_batch_texts_sum ")):
                    name, value = line.split()
                    values[name] = float(value)
            return sum(values.values())

        threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        # the signal goes when every request is in (queued or running), not after a fixed pause: on a loaded
        # machine the clients may need more than a moment to connect, and a connection the server has not yet
        # accepted when it stops listening is refused, which is not what this test is about
        deadline = time.time() + 120
        while accepted() < 6 * len(TEXTS) * 40:
            assert time.time() < deadline, f"the server took {accepted()} texts of {6 * len(TEXTS) * 40}"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=120)
        # uvicorn drains, then re-raises the signal: the conventional "terminated" status, after a clean stop
        assert proc.wait(timeout=120) in (0, -signal.SIGTERM)
        assert results == [200] * 6
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_static_model_serves_its_vectors(dirs, tmp_path):
    """A distilled static model (`kbert distill-static`: a table of token vectors, no network) behind
    `kbert serve`: /v1/embeddings gives its `encode`'s vectors, Matryoshka-style `dimensions` included."""
    from kbert.server import build_app

    model_dir, _ = dirs
    out = kbert.export_sentence_transformers(kbert.distill_static(model_dir, dim=16), str(tmp_path / "static"))
    emb = kbert.Embedder.load(out)
    with Running(build_app(out)) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        r = client.post("/v1/embeddings", json={"input": TEXTS[:3]}).json()
        np.testing.assert_allclose(np.array([d["embedding"] for d in r["data"]], np.float32), emb.encode(TEXTS[:3]),
                                   atol=1e-5)
        r = client.post("/v1/embeddings", json={"input": TEXTS[:3], "dimensions": 8}).json()
        np.testing.assert_allclose(np.array([d["embedding"] for d in r["data"]], np.float32),
                                   emb.encode(TEXTS[:3], truncate_dim=8), atol=1e-5)


def test_an_ensemble_serves_its_vectors_and_the_mean_of_its_members_cosines(dirs, tmp_path):
    """A saved `kbert.EnsembleEmbedder` (a network and a static table, weights 3:1) behind `kbert serve`:
    /v1/embeddings gives its `encode`'s vectors, /v1/similarity the weighted mean of the members' own cosines,
    /v1/search the hits of an index it built; what the concatenation has no meaning for (word vectors, `dimensions`, a pooling) answers 404 / 400 by name."""
    from kbert.server import build_app

    model_dir, _ = dirs
    static = kbert.export_sentence_transformers(kbert.distill_static(model_dir, dim=16), str(tmp_path / "static"))
    out = str(tmp_path / "ensemble")
    kbert.EnsembleEmbedder([model_dir, static], weights=[3, 1]).save(out)
    ens = kbert.Embedder.load(out)
    members = [kbert.Embedder.load(model_dir), kbert.Embedder.load(static)]
    index = kbert.SearchIndex.build(out, TEXTS, str(tmp_path / "index"), progress=False)
    with Running(build_app(out, index=str(tmp_path / "index"))) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as client:
        r = client.post("/v1/embeddings", json={"input": TEXTS}).json()
        got = np.array([d["embedding"] for d in r["data"]], np.float32)
        assert got.shape == (len(TEXTS), 32 + 16)
        np.testing.assert_allclose(got, ens.encode(TEXTS), atol=1e-5)
        r = client.post("/v1/similarity", json={"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}).json()
        cosines = [m.encode(TEXTS[1:]) @ m.encode(TEXTS[0]) for m in members]  # unit vectors: dot = cosine
        np.testing.assert_allclose(r["similarities"], 0.75 * cosines[0] + 0.25 * cosines[1], atol=1e-5)
        model = client.get("/v1/models").json()["data"][0]
        assert model["dimension"] == 48 and "/v1/word-embeddings" not in model["routes"]
        hits = client.post("/v1/search", json={"query": TEXTS[4:], "top_k": 3}).json()["data"]
        assert [[h["id"] for h in row["hits"]] for row in hits] == \
            [[h.id for h in row] for row in index.search(TEXTS[4:], top_k=3)]
        assert [row["hits"][0]["text"] for row in hits] == TEXTS[4:]
        words = client.post("/v1/word-embeddings", json={"input": TEXTS[:1]})
        assert words.status_code == 404 and "an ensemble" in words.json()["error"]["message"]
        for bad in ({"dimensions": 8}, {"pooling": "cls"}):
            r = client.post("/v1/embeddings", json=dict(bad, input=TEXTS[:1]))
            assert r.status_code == 400 and "do not apply" in r.json()["error"]["message"], r.text


def test_an_onnx_export_serves_its_vectors(dirs, tmp_path):
    """`kbert serve` on a `kbert export --format onnx` dir: ONNX Runtime computes /v1/embeddings, equal to the
    model's own vectors; a pooling other than the exported one is a 400 naming it."""
    from kbert.server import build_app

    model_dir, _ = dirs
    out = kbert.export_onnx(model_dir, str(tmp_path / "onnx"))
    emb = kbert.Embedder.load(model_dir)
    with Running(build_app(out)) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        r = client.post("/v1/embeddings", json={"input": TEXTS}).json()
        np.testing.assert_allclose(np.array([d["embedding"] for d in r["data"]], np.float32), emb.encode(TEXTS),
                                   atol=1e-5)
        bad = client.post("/v1/embeddings", json={"input": TEXTS[:1], "pooling": "cls"})
        assert bad.status_code == 400 and "fixed at export" in bad.json()["error"]["message"]


def test_a_classifiers_onnx_export_serves_classify(dirs, tmp_path):
    """`kbert serve` on a classifier's ONNX export (kbert.OnnxTaskModel): /v1/classify as the task dir gives it;
    the vector routes answer 404 saying why, and --index is refused at start."""
    from kbert.server import build_app

    model_dir, task_dir = dirs
    out = kbert.export_onnx(task_dir, str(tmp_path / "onnx-classify"))
    expected = kbert.TaskModel.load(task_dir).predict(TEXTS[:3])
    app = build_app(out)
    assert app.state.engine.routes() == ["/v1/classify"]  # what `kbert serve` says it answers
    assert build_app(task_dir, warm=False).state.engine.routes() == [
        "/v1/embeddings", "/v1/word-embeddings", "/v1/similarity", "/v1/keywords", "/v1/classify"]  # its vectors too
    with Running(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        assert client.get("/health").status_code == 200
        listed = client.get("/v1/models").json()["data"][0]
        assert listed["routes"] == ["/v1/classify"] and "dimension" not in listed  # a head's graph: no vectors
        body = client.post("/v1/classify", json={"input": TEXTS[:3]}).json()
        assert body["task"] == "classification"
        np.testing.assert_allclose([[row["probabilities"][label] for label in ("부정", "긍정")]
                                    for row in body["data"]], expected, atol=1e-5)
        for route, payload in (("/v1/embeddings", {"input": TEXTS[:1]}),
                               ("/v1/similarity", {"source_sentence": TEXTS[0], "sentences": TEXTS[1:2]})):
            r = client.post(route, json=payload)
            assert r.status_code == 404 and "gives no sentence vectors" in r.json()["error"]["message"], route
        assert "kbert_requests" in client.get("/metrics").text
    with pytest.raises(ValueError, match="gives no sentence vectors"):
        build_app(out, index=str(tmp_path / "any-index"))


def test_search_serves_an_index_built_with_the_model(dirs, tmp_path):
    """`kbert serve --index DIR`: /v1/search answers as `SearchIndex.search` does, ids and metadata included;
    a server without an index says how to give one, and an index built by another model is refused at start."""
    from kbert.server import build_app

    model_dir, task_dir = dirs
    law = list(dict.fromkeys(line for doc in corpus("kolaw") for line in doc if line.strip()))[:80]
    meta = [{"조": i} for i in range(len(law))]
    out = str(tmp_path / "index")
    index = kbert.SearchIndex.build(model_dir, law, out, ids=[f"L{i}" for i in range(len(law))], metadata=meta,
                                    kind="hnsw", lexical=True, progress=False)
    queries = ["국회의원의 임기", law[10]]
    want = index.search(queries, top_k=3)
    with Running(build_app(model_dir, index=out)) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        r = client.post("/v1/search", json={"query": queries, "top_k": 3})
        assert r.status_code == 200, r.text
        got = r.json()["data"]
        assert [d["index"] for d in got] == [0, 1]
        for row, hits in zip(got, want):
            assert [h["id"] for h in row["hits"]] == [h.id for h in hits]
            np.testing.assert_allclose([h["score"] for h in row["hits"]], [h.score for h in hits], atol=1e-5)
            assert [h["metadata"] for h in row["hits"]] == [h.metadata for h in hits]
        assert got[1]["hits"][0] == {"id": "L10", "score": pytest.approx(1.0, abs=1e-5), "text": law[10],
                                     "metadata": {"조": 10}}
        one = client.post("/v1/search", json={"query": queries[0]}).json()["data"]
        assert len(one) == 1 and len(one[0]["hits"]) == 10  # the default top_k
        hybrid = client.post("/v1/search", json={"query": queries, "top_k": 3, "lexical": 0.6}).json()["data"]
        assert [[h["id"] for h in row["hits"]] for row in hybrid] == \
            [[h.id for h in row] for row in index.search(queries, top_k=3, lexical=0.6)]
        kept = client.post("/v1/search", json={"query": queries, "top_k": 3, "where": {"조": [10, 11, 12]}})
        assert all({h["id"] for h in row["hits"]} == {"L10", "L11", "L12"} for row in kept.json()["data"])
        grouped = client.post("/v1/search", json={"query": queries[0], "top_k": 4, "group_by": "조"}).json()["data"]
        assert [h["id"] for h in grouped[0]["hits"]] == [h.id for h in index.search(queries[0], top_k=4)]
        bad = client.post("/v1/search", json={"query": queries[0], "top_k": 0})
        assert bad.status_code == 400 and "`top_k` must be an integer" in bad.json()["error"]["message"]
        assert 'kbert_requests_total{route="/v1/search",status="200"} 5.0' in client.get("/metrics").text
        # comparisons as Chroma writes them; an operator it does not know is a 400 naming it (it matched nothing)
        ranged = client.post("/v1/search", json={"query": queries, "top_k": 3,
                                                 "where": {"조": {"$gte": 10, "$lte": 12}}})
        assert ranged.json()["data"] == kept.json()["data"]
        typo = client.post("/v1/search", json={"query": queries[0], "where": {"조": {"$ge": 10}}})
        assert typo.status_code == 400 and "{'$ge': 10}" in typo.json()["error"]["message"], typo.text
    with Running(build_app(model_dir)) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        missing = client.post("/v1/search", json={"query": "국회"})
        assert missing.status_code == 404 and "--index DIR" in missing.json()["error"]["message"]
    other_config = kbert.ModelConfig.preset("bert-tiny", vocab_size=index.embedder.config.vocab_size,
                                                hidden_size=32, num_heads=2, intermediate_size=64, num_layers=2,
                                                max_position=128)
    other = kbert.save_model(kbert.BertBackbone(other_config), str(tmp_path / "other"),
                             tokenizer=index.embedder.tokenizer)
    with pytest.raises(ValueError, match="does not encode as the one that built this index"):
        build_app(other, index=out)


def test_search_reranks_its_first_hits_with_a_cross_encoder(dirs, tmp_path):
    """`kbert serve --index DIR --reranker DIR2`: /v1/search answers as `SearchIndex.search(reranker=...)` (the
    reranker's scores and order over the first "candidates" hits, deeper hits as found), with filters and groups;
    "rerank": false is the plain search; an ONNX export reranks alike; its fields are checked, and a reranker
    without an index, or one that is not a cross-encoder, is refused at start."""
    from helpers import xlmr_dir
    from kbert.server import build_app

    model_dir, task_dir = dirs
    law = list(dict.fromkeys(line for doc in corpus("kolaw") for line in doc if line.strip()))[:40]
    index = kbert.SearchIndex.build(model_dir, law, str(tmp_path / "index"), metadata=[{"n": i % 3} for i in
                                                                                    range(len(law))], progress=False)
    reranker_dir = xlmr_dir(tmp_path, model_class="XLMRobertaForSequenceClassification", num_labels=1)
    reranker = kbert.TaskModel.load(reranker_dir)
    queries = ["국회의원의 임기", law[7], "대통령"]
    requests = [({"top_k": 3}, {"top_k": 3}),  # the default candidates: all 40 texts re-scored
                ({"top_k": 6, "candidates": 4}, {"top_k": 6, "candidates": 4}),  # hits 5-6 keep their place
                ({"top_k": 3, "candidates": 5, "where": {"n": [0, 2]}}, {"top_k": 3, "candidates": 5,
                                                                        "where": {"n": [0, 2]}}),
                ({"top_k": 2, "candidates": 6, "group_by": "n"}, {"top_k": 2, "candidates": 6, "group_by": "n"})]
    with Running(build_app(model_dir, index=index.path, reranker=reranker_dir)) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as client:
        for payload, options in requests:
            r = client.post("/v1/search", json={"query": queries, **payload})
            assert r.status_code == 200, r.text
            want = index.search(queries, reranker=reranker, **options)
            plain = index.search(queries, **options)
            for row, hits, first in zip(r.json()["data"], want, plain):
                assert [h["id"] for h in row["hits"]] == [h.id for h in hits] and len(hits) > 1
                np.testing.assert_allclose([h["score"] for h in row["hits"]], [h.score for h in hits], atol=1e-5)
                assert [h["metadata"] for h in row["hits"]] == [h.metadata for h in hits]
            assert [[h.id for h in row] for row in want] != [[h.id for h in row] for row in plain]
        assert client.post("/v1/search", json={"query": law[7], "where": {"n": 9}}).json()["data"][0]["hits"] == []
        r = client.post("/v1/search", json={"query": queries, "top_k": 3, "rerank": False})
        assert [[h["id"] for h in row["hits"]] for row in r.json()["data"]] == \
            [[h.id for h in row] for row in index.search(queries, top_k=3)]
        r = client.post("/v1/search", json={"query": queries[0], "rerank": "yes"})
        assert r.status_code == 400 and "`rerank` must be true or false" in r.json()["error"]["message"]
    onnx = kbert.export_onnx(reranker_dir, str(tmp_path / "onnx-reranker"))  # ONNX Runtime's cross-encoder too
    with Running(build_app(model_dir, index=index.path, reranker=onnx)) as srv:
        r = httpx.post(srv.url + "/v1/search", json={"query": queries, "top_k": 4, "candidates": 6}, timeout=60)
        want = index.search(queries, top_k=4, candidates=6, reranker=kbert.OnnxTaskModel.load(onnx))
        for row, hits in zip(r.json()["data"], want):
            assert [h["id"] for h in row["hits"]] == [h.id for h in hits]
            np.testing.assert_allclose([h["score"] for h in row["hits"]], [h.score for h in hits], atol=1e-5)
    with Running(build_app(model_dir, index=index.path, reranker=reranker_dir, max_queue=20)) as srv:
        r = httpx.post(srv.url + "/v1/search", json={"query": queries, "candidates": 10}, timeout=60)
        assert r.status_code == 413 and "30 pairs; at most 20" in r.json()["error"]["message"], r.text
    with Running(build_app(model_dir, index=index.path)) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        for payload, message in (({"rerank": True}, "start the server with --reranker DIR"),
                                 ({"candidates": 5}, "or --reranker DIR (a cross-encoder)")):
            r = client.post("/v1/search", json={"query": queries[0], **payload})
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    for options, message in ((dict(reranker=reranker_dir), "give the index it searches with --index too"),
                             (dict(index=index.path, reranker=task_dir), "is not a cross-encoder")):
        with pytest.raises(ValueError, match=message):
            build_app(model_dir, **options)


def test_a_multi_label_classifier_serves_each_labels_own_probability(dirs, tmp_path):
    """/v1/classify on a multi-label classifier (a task dir, and its ONNX export): each label's sigmoid, not a
    softmax, and `labels`, every label over 0.5, beside the top `label`."""
    from kbert.data.features import build_network
    from kbert.embed.task_model import TaskModel
    from kbert.models.tasks import TaskNetwork
    from kbert.server import build_app

    model_dir, _ = dirs
    emb = kbert.Embedder.load(model_dir)
    network = TaskNetwork(emb.backbone, "classification", 3, 0.0, (0.0, 1.0), "pooler", -1)
    build_network(network, emb.tokenizer)
    network.head.bias.assign(np.array([2.0, -2.0, 0.5], np.float32))  # a clear yes, a clear no, one in between
    meta = {"task": "classification", "labels": ["분노", "슬픔", "기쁨"], "max_length": 64, "text_column": "text",
            "pair_column": None, "label_column": "labels", "pooling": "pooler", "layers": -1, "multi_label": True}
    task_dir = TaskModel(network, emb.tokenizer, meta).save(str(tmp_path / "multi"))
    expected = kbert.TaskModel.load(task_dir).predict(TEXTS[:3])
    assert expected.shape == (3, 3) and not np.allclose(expected.sum(axis=1), 1.0)
    for served in (task_dir, kbert.export_onnx(task_dir, str(tmp_path / "multi-onnx"))):
        with Running(build_app(served)) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
            body = client.post("/v1/classify", json={"input": TEXTS[:3]}).json()
        np.testing.assert_allclose([[row["probabilities"][k] for k in meta["labels"]] for row in body["data"]],
                                   expected, atol=1e-5)
        for row, p in zip(body["data"], expected):
            assert row["labels"] == [k for k, x in zip(meta["labels"], p) if x > 0.5] and "분노" in row["labels"]
            assert row["label"] == meta["labels"][int(np.argmax(p))]


def test_a_splade_model_serves_sparse_vectors(tmp_path):
    """A SparseEncoder dir behind `kbert serve`: /v1/sparse-embeddings gives `SparseEncoder.encode`'s weights,
    heaviest first, batched with other requests; the dense routes answer 404 naming the sparse one."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.models import MLMTransformer, SpladePooling

    from helpers import hf_masked_lm_dir
    from kbert.server import build_app

    path, _, tok = hf_masked_lm_dir(tmp_path, TEXTS)
    tok.save_pretrained(path)
    out = str(tmp_path / "splade")
    SparseEncoder(modules=[MLMTransformer(path), SpladePooling("max")]).save(out)
    enc = kbert.SparseEncoder.load(out)
    want = enc.encode(TEXTS[:3], max_active_dims=5)
    with Running(build_app(out)) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        r = client.post("/v1/sparse-embeddings", json={"input": TEXTS[:3], "max_active_dims": 5,
                                                       "return_tokens": True})
        assert r.status_code == 200, r.text
        for i, row in enumerate(r.json()["data"]):
            expected = enc.decode(want[i])
            assert row["index"] == i and row["tokens"] == [t for t, _ in expected]
            np.testing.assert_allclose(row["values"], [w for _, w in expected], rtol=1e-5)
            assert [enc.tokenizer.vocab[j] for j in row["indices"]] == row["tokens"]
        r = client.post("/v1/embeddings", json={"input": TEXTS[:1]})
        assert r.status_code == 404 and "/v1/sparse-embeddings" in r.json()["error"]["message"]
        r = client.post("/v1/sparse-embeddings", json={"input": TEXTS[:1], "max_active_dims": 0})
        assert r.status_code == 400 and "max_active_dims" in r.json()["error"]["message"]

    # with a kbert.SparseIndex of its vectors: /v1/search answers as SparseIndex.search, queries batched as CSR rows
    index_dir = str(tmp_path / "sparse-index")
    index = kbert.SparseIndex.build(out, TEXTS, index_dir, metadata=[{"n": i % 2} for i in range(len(TEXTS))],
                                    progress=False)
    with Running(build_app(out, index=index_dir)) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        r = client.post("/v1/search", json={"query": TEXTS[:2], "top_k": 3, "where": {"n": 1}})
        assert r.status_code == 200, r.text
        for row, hits in zip(r.json()["data"], index.search(TEXTS[:2], top_k=3, where={"n": 1})):
            assert [h["id"] for h in row["hits"]] == [h.id for h in hits] and hits
            np.testing.assert_allclose([h["score"] for h in row["hits"]], [h.score for h in hits], rtol=1e-5)
        r = client.post("/v1/search", json={"query": TEXTS[0], "nprobe": 4})
        assert r.status_code == 400 and "settings of a dense index" in r.json()["error"]["message"]

    # an inference-free model: "input_type": "query" reads its weight table, documents go through the model
    from helpers import inference_free_splade_dir

    (tmp_path / "free").mkdir()
    free_dir, _ = inference_free_splade_dir(tmp_path / "free", TEXTS)
    free = kbert.SparseEncoder.load(free_dir)
    with Running(build_app(free_dir)) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        for side, want in (("query", free.encode_query(TEXTS[:2])), ("document", free.encode_document(TEXTS[:2]))):
            r = client.post("/v1/sparse-embeddings", json={"input": TEXTS[:2], "input_type": side})
            assert r.status_code == 200, r.text
            for row, (ids, values) in zip(r.json()["data"], free.weights(want)):
                assert row["indices"] == ids.tolist()
                np.testing.assert_allclose(row["values"], values, rtol=1e-5, atol=1e-6)
        assert client.post("/v1/sparse-embeddings", json={"input": "x", "input_type": "q"}).status_code == 400


def test_search_fuses_a_dense_and_a_sparse_index(tmp_path):
    """`kbert serve --index DIR --hybrid DIR2`: /v1/search answers as `kbert.hybrid_search` over the two indexes,
    whichever of the two models is served (the other index's model is loaded from its dir); the fusion's options
    are checked, and refused on a server without a hybrid index; mismatched indexes are refused at start; with a
    --reranker too, the fused hits are reranked as `kbert.hybrid_search(reranker=...)` does."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.models import MLMTransformer, SpladePooling

    from helpers import hf_masked_lm_dir, xlmr_dir
    from kbert.server import build_app

    path, _, tok = hf_masked_lm_dir(tmp_path, TEXTS)
    tok.save_pretrained(path)
    splade = str(tmp_path / "splade")
    SparseEncoder(modules=[MLMTransformer(path), SpladePooling("max")]).save(splade)
    meta = [{"n": i % 2} for i in range(len(TEXTS))]
    dense = kbert.SearchIndex.build(path, TEXTS, str(tmp_path / "dense"), metadata=meta, progress=False)
    sparse = kbert.SparseIndex.build(splade, TEXTS, str(tmp_path / "sparse"), metadata=meta, progress=False)
    queries = ["국회의 법률", TEXTS[4]]
    requests = [({"top_k": 4}, {}), ({"top_k": 3, "weight": 0.8, "fusion": "rrf", "candidates": 4},
                                     {"weight": 0.8, "fusion": "rrf", "candidates": 4}),
                ({"top_k": 5, "weight": 0.3, "where": {"n": 1}}, {"weight": 0.3, "where": {"n": 1}})]
    for served, own, other in ((path, dense, sparse), (splade, sparse, dense)):
        with Running(build_app(served, index=own.path, hybrid=other.path)) as srv, \
                httpx.Client(base_url=srv.url, timeout=60) as client:
            for payload, options in requests:
                r = client.post("/v1/search", json={"query": queries, **payload})
                assert r.status_code == 200, r.text
                want = kbert.hybrid_search(dense, sparse, queries, top_k=payload["top_k"], **options)
                for row, hits in zip(r.json()["data"], want):
                    assert [h["id"] for h in row["hits"]] == [h.id for h in hits] and len(hits) > 1
                    np.testing.assert_allclose([h["score"] for h in row["hits"]], [h.score for h in hits],
                                               rtol=1e-5, atol=1e-6)
                    assert all(h["text"] == TEXTS[h["id"]] for h in row["hits"])
            for payload, message in (({"weight": 2}, "`weight` (the sparse side's share"),
                                     ({"fusion": "sum"}, "`fusion` must be one of"),
                                     ({"candidates": 0}, "`candidates` must be an integer"),
                                     ({"lexical": 0.5}, "not taken by a hybrid search")):
                r = client.post("/v1/search", json={"query": queries[0], **payload})
                assert r.status_code == 400 and message in r.json()["error"]["message"], (payload, r.text)
    reranker = xlmr_dir(tmp_path, model_class="XLMRobertaForSequenceClassification", num_labels=1)
    with Running(build_app(path, index=dense.path, hybrid=sparse.path, reranker=reranker)) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as client:  # fused, then reranked: as the library does
        r = client.post("/v1/search", json={"query": queries, "top_k": 3, "weight": 0.3, "candidates": 4})
        want = kbert.hybrid_search(dense, sparse, queries, top_k=3, weight=0.3, candidates=4,
                                   reranker=kbert.TaskModel.load(reranker))
        for row, hits in zip(r.json()["data"], want):
            assert [h["id"] for h in row["hits"]] == [h.id for h in hits] and len(hits) == 3
            np.testing.assert_allclose([h["score"] for h in row["hits"]], [h.score for h in hits], atol=1e-5)
    with Running(build_app(path, index=dense.path)) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        r = client.post("/v1/search", json={"query": queries[0], "weight": 0.5})
        assert r.status_code == 400 and "start the server with --hybrid" in r.json()["error"]["message"]
    fewer = kbert.SparseIndex.build(splade, TEXTS[:-1], str(tmp_path / "fewer"), progress=False)
    for options, message in ((dict(index=dense.path, hybrid=fewer.path), "build both indexes from the same texts"),
                             (dict(index=dense.path, hybrid=dense.path), "are both a SearchIndex"),
                             (dict(hybrid=sparse.path), "give the served model's own index with --index")):
        with pytest.raises(ValueError, match=message):
            build_app(path, **options)
