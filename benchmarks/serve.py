"""`kbert serve` under bounded load on loopback, beside the server a user would write and offline encoding.

Three things side by side in one run, on the same bert-mini weights (random; speed does not depend on them)
and the same short Korean sentences (movie reviews from ../shared/data):
- `kbert serve` (dynamic batching), started as `kbert serve --model DIR` in its own process;
- the peer: sentence-transformers on the same weights (exported with `kbert.export_transformers`) behind a
  minimal FastAPI endpoint that embeds one request at a time (what one writes without batching);
- offline `Embedder.encode` of the same sentences (batch 64, best of 3 passes), on the graph (the default)
  and with `jit_compile=True` (XLA, as the server runs): the faster is the ceiling a server can approach.
Load: an asyncio client (keep-alive HTTP/1.1 on asyncio streams, one connection per simulated client) sends a
fixed number of single-sentence requests at 1, 8, 32 and 128 concurrent clients, each level after a
warm-up (rounds of `--warmup` requests, not counted, until the server has no XLA compilation pending: what
a server meets in its first seconds of a new traffic pattern); then an overload burst against a server
started with a small queue (fast 429s expected, no 5xx, no crash). Reported: requests/s, p50/p99 latency,
errors by status, the server's resident memory before and after. `--soak N` sends N more requests and
reports memory growth (the goal: flat within 10% over 100,000).

    python benchmarks/serve.py --shared ../shared/data [--requests 2000] [--soak 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

PEER = r'''
import sys, numpy as np, uvicorn
from fastapi import FastAPI
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
hf_dir, hidden, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = SentenceTransformer(modules=[Transformer(hf_dir, max_seq_length=128), Pooling(hidden, pooling_mode="mean")],
                            device="cpu")
model.encode(["준비"])
app = FastAPI()

@app.get("/health")
async def health():
    return {"status": "ok"}

@app.post("/v1/embeddings")
async def embeddings(body: dict):  # async and blocking: one request at a time, as a first server does
    texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
    vectors = model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
    return {"data": [{"index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)]}

uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
'''


def read_sentences(path: str, n: int):
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
            text = (row.get("text") or "").strip()
            if 5 <= len(text) <= 80:
                out.append(text)
                if len(out) == n:
                    break
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def start(cmd, url, timeout=300):
    import httpx

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"{cmd[:4]} did not become healthy in {timeout} s")


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


class Connection:
    """One keep-alive HTTP/1.1 connection on asyncio streams, for the load generator only.

    Why not httpx (the tests' client): on a small machine the load generator shares the CPUs with the server
    it measures, and every millisecond of client Python per request is taken from the server. Requests here
    are prebuilt bytes and responses are read by their Content-Length (uvicorn always sends one for these
    routes), so the client does little work per request (it prints its own CPU per request) and the figures
    measure the server. Each response's status is checked; a malformed one is an error, never a hang.
    """

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def post(self, path: str, body: bytes, timeout: float = 60.0):
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        try:
            return await asyncio.wait_for(self._response(), timeout)
        except BaseException:
            self.close()  # a half-read response must not be read by the next request
            raise

    async def _response(self):
        header = await self.reader.readuntil(b"\r\n\r\n")
        lines = header.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        fields = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
        fields = {k.strip().lower(): v.strip() for k, v in fields.items()}
        if "content-length" not in fields:
            raise ConnectionError(f"a response without Content-Length: {lines[0]}")
        payload = await self.reader.readexactly(int(fields["content-length"]))
        if fields.get("connection", "").lower() == "close":
            self.close()
        return status, payload

    def close(self):
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def load(url: str, sentences, requests: int, clients: int, path: str = "/v1/embeddings", field: str = "input",
               marker: bytes = b'"embedding"', extra: dict = None) -> dict:
    """`requests` single-sentence POSTs spread over `clients` concurrent clients (one connection each): each body
    is `{field: sentence, **extra}` to `path`, and a 200 whose body lacks `marker` counts as an error."""
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    bodies = [json.dumps({field: s, **(extra or {})}, ensure_ascii=False).encode("utf-8") for s in sentences]
    latencies, by_status = [], {}
    counter = iter(range(requests))

    async def client():
        conn = Connection(host, int(port))
        try:
            for i in counter:
                t = time.perf_counter()
                try:
                    status, payload = await conn.post(path, bodies[i % len(bodies)])
                    if status == 200 and marker not in payload:
                        status = "bad body"
                except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
                    status = type(e).__name__
                latencies.append(time.perf_counter() - t)
                by_status.setdefault(status, []).append(latencies[-1])
        finally:
            conn.close()

    def p(values, q):
        values = sorted(values)
        return 1000 * values[min(len(values) - 1, int(len(values) * q))]

    cpu, t = time.process_time(), time.perf_counter()
    await asyncio.gather(*[client() for _ in range(clients)])
    elapsed = time.perf_counter() - t
    return {"clients": clients, "requests": requests, "rps": requests / elapsed,
            "p50_ms": p(latencies, 0.5), "p99_ms": p(latencies, 0.99),
            "statuses": {k: len(v) for k, v in by_status.items()},
            "p99_ms_by_status": {str(k): p(v, 0.99) for k, v in by_status.items()},
            # the load generator's own CPU per request: what it takes from the server on a shared machine
            "client_cpu_ms_per_request": 1000 * (time.process_time() - cpu) / requests}


def run_load(url: str, sentences, requests: int, clients: int, **route) -> dict:
    """`load` on uvloop when installed (the serve extra brings it): a cheaper client leaves the CPUs to the server."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(load(url, sentences, requests, clients, **route))
    return uvloop.run(load(url, sentences, requests, clients, **route))


def xla_shapes(url: str):
    """The server's (XLA compilations pending, batch shapes compiled), from its /metrics."""
    import urllib.request

    found = {"kbert_xla_compiles_pending": 0.0, "kbert_xla_shapes_compiled": 0.0}
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            name, _, value = line.partition(" ")
            if name in found:
                found[name] = float(value)
    return found["kbert_xla_compiles_pending"], found["kbert_xla_shapes_compiled"]


def warm_up(url: str, sentences, requests: int, clients: int, rounds: int = 20, **route) -> int:
    """Rounds of `requests` at `clients` until a round makes the server compile no new batch shape (at most
    `rounds`); returns the requests sent. The level measured after it sees the server as it runs once warm.
    `route`: `load`'s path, field, marker and extra."""
    sent = 0
    for _ in range(rounds):
        before = xla_shapes(url)[1]
        run_load(url, sentences, requests, clients, **route)
        sent += requests
        deadline = time.monotonic() + 300
        while xla_shapes(url)[0] > 0 and time.monotonic() < deadline:  # let this traffic's shapes compile
            time.sleep(0.5)
        if xla_shapes(url)[1] == before:  # this round met no new shape
            break
    return sent


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shared", default=os.path.join("..", "shared", "data"))
    parser.add_argument("--requests", type=int, default=2000, help="requests per concurrency level")
    parser.add_argument("--clients", default="1,8,32,128")
    parser.add_argument("--peer-requests", type=int, default=600, help="requests per level for the slower peer")
    parser.add_argument("--warmup", type=int, default=300, help="requests per warm-up round before each level")
    parser.add_argument("--soak", type=int, default=0, help="extra requests for the memory check (100000: goal)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()

    import numpy as np

    import kbert

    sentences = read_sentences(os.path.join(args.shared, "movie-reviews", "reviews.tsv.gz"), 5000)
    from scratch import scratch_dir  # benchmarks/scratch.py: removed at exit
    work = scratch_dir(prefix="kbert-serve-bench-")
    tok = kbert.Tokenizer.train(sentences, vocab_size=4000, algorithm="wordpiece", progress=False)
    cfg = kbert.ModelConfig.preset("bert-mini", vocab_size=tok.vocab_size)
    backbone = kbert.BertBackbone(cfg)
    model_dir, hf_dir = os.path.join(work, "kbert"), os.path.join(work, "hf")
    kbert.save_model(backbone, model_dir, tokenizer=tok)
    kbert.export_transformers(backbone, hf_dir, tokenizer=tok)
    results = {"sentences": len(sentences), "mean_chars": float(np.mean([len(s) for s in sentences]))}

    for mode in (False, True):
        emb = kbert.Embedder.load(model_dir, jit_compile=mode)
        emb.encode(sentences, progress=False)  # traces, and with XLA compiles every shape of this set
        passes = []
        for _ in range(3):  # best of 3: the ceiling, on a machine shared with other work
            t = time.perf_counter()
            emb.encode(sentences, batch_size=64, progress=False)
            passes.append(time.perf_counter() - t)
        results[f"offline_{'xla' if mode else 'graph'}_sentences_per_s"] = len(sentences) / min(passes)
        del emb
    results["offline_sentences_per_s"] = max(results["offline_graph_sentences_per_s"],
                                             results["offline_xla_sentences_per_s"])
    print(f"offline Embedder.encode: graph {results['offline_graph_sentences_per_s']:,.0f}, XLA "
          f"{results['offline_xla_sentences_per_s']:,.0f} sentences/s (the faster is the ceiling)", flush=True)

    levels = [int(c) for c in args.clients.split(",")]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start([sys.executable, "-m", "kbert.cli", "serve", "--model", model_dir, "--port", str(port)], url)
    results["kbert_rss_mb_start"] = rss_mb(server.pid)
    results["kbert"] = []
    for clients in levels:
        warmed = warm_up(url, sentences, args.warmup, clients)
        row = dict(run_load(url, sentences, args.requests, clients), warmup_requests=warmed)
        results["kbert"].append(row)
        print("kbert", json.dumps(row), flush=True)
    if args.soak:
        before = rss_mb(server.pid)
        row = run_load(url, sentences, args.soak, 32)
        results["soak"] = dict(row, rss_mb_before=before, rss_mb_after=rss_mb(server.pid))
        print("soak", json.dumps(results["soak"]), flush=True)
    results["kbert_rss_mb_end"] = rss_mb(server.pid)
    stop(server)

    # overload: a small queue and four times more clients than the 32-client level
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start([sys.executable, "-m", "kbert.cli", "serve", "--model", model_dir, "--port", str(port),
                    "--max-queue", "32"], url)
    row = run_load(url, sentences, args.requests, 4 * 32)
    row["alive_after"] = server.poll() is None
    results["overload"] = row
    print("overload", json.dumps(row), flush=True)
    stop(server)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    peer_file = os.path.join(work, "peer.py")
    with open(peer_file, "w", encoding="utf-8") as f:
        f.write(PEER)
    peer = start([sys.executable, peer_file, hf_dir, str(cfg.hidden_size), str(port)], url)
    results["peer"] = []
    for clients in levels:
        run_load(url, sentences, min(args.warmup, args.peer_requests), clients)
        row = run_load(url, sentences, args.peer_requests, clients)
        results["peer"].append(row)
        print("peer", json.dumps(row), flush=True)
    stop(peer)

    print("\n| clients | kbert serve req/s | p50 ms | p99 ms | errors | peer req/s | peer p99 ms | kbert / peer | "
          "kbert / offline encode |")
    print("|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for k, p in zip(results["kbert"], results["peer"]):
        errors = {s: n for s, n in k["statuses"].items() if s != 200} or "none"
        print(f"| {k['clients']} | {k['rps']:,.0f} | {k['p50_ms']:.1f} | {k['p99_ms']:.1f} | {errors} | "
              f"{p['rps']:,.0f} | {p['p99_ms']:.1f} | {k['rps'] / p['rps']:.2f}x | "
              f"{k['rps'] / results['offline_sentences_per_s']:.2f} |")
    o = results["overload"]
    print(f"\noverload (128 clients, queue 32): {o['rps']:,.0f} req/s, statuses {o['statuses']}, p99 by status "
          f"{ {k: round(v, 1) for k, v in o['p99_ms_by_status'].items()} } ms, server alive: {o['alive_after']}")
    print("load generator CPU per request (ms, kbert levels): "
          + ", ".join(f"{k['clients']}: {k['client_cpu_ms_per_request']:.2f}" for k in results["kbert"]))
    print(f"kbert serve memory: {results['kbert_rss_mb_start']:.0f} MB after warm-up -> "
          f"{results['kbert_rss_mb_end']:.0f} MB after the load")
    if "soak" in results:
        s = results["soak"]
        print(f"soak: {s['requests']:,} requests, RSS {s['rss_mb_before']:.0f} -> {s['rss_mb_after']:.0f} MB "
              f"({100 * (s['rss_mb_after'] / s['rss_mb_before'] - 1):+.1f}%)")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
