"""Retrieve and rerank over HTTP: `kbert serve --index DIR --reranker DIR` beside the server a user would write.

Each request is one query: its vector, the nearest `--candidates` of a collection, those re-scored by a
cross-encoder, the best 5 returned. Side by side in one run, on the same weights (random bert-mini bi-encoder and
cross-encoder; speed does not depend on the values) and the same movie reviews from ../shared/data:
- `kbert serve --model BI --index IDX --reranker CE`, in its own process: the queries' vectors and the (query,
  hit) pairs of concurrent requests are batched by the server's worker;
- the peer: sentence-transformers on the same weights (exported with `kbert.export_transformers`;
  `SentenceTransformer` + `util.semantic_search` over the collection's vectors, then `CrossEncoder.rank`) behind
  a minimal Starlette endpoint (FastAPI's base) that answers one request at a time (what one writes without
  batching).
The load generator is benchmarks/serve.py's (one keep-alive connection per client, prebuilt bodies); each kbert level
follows warm-up rounds of the same requests until a round makes the server compile no new batch shape (new
shapes compile in the background meanwhile), so the level measures a warm server. Before the load, both servers answer the same queries
and the share of equal top-5 id lists is printed: the comparison is between two ways of computing one ranking
(float32 noise aside), not between two rankings.

    python benchmarks/serve_search.py --shared ../shared/data [--documents 5000] [--candidates 20]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from serve import free_port, read_sentences, rss_mb, run_load, start, stop, warm_up  # noqa: E402  (serve.py)

PEER = r'''
import sys, uvicorn
from sentence_transformers import CrossEncoder, SentenceTransformer, util
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
hf_dir, ce_dir, corpus_file, hidden, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
corpus = open(corpus_file, encoding="utf-8").read().split("\n")
model = SentenceTransformer(modules=[Transformer(hf_dir, max_seq_length=128), Pooling(hidden, pooling_mode="mean")],
                            device="cpu")
reranker = CrossEncoder(ce_dir, device="cpu", max_length=128)
vectors = model.encode(corpus, normalize_embeddings=True, convert_to_tensor=True)


async def health(request):
    return JSONResponse({"status": "ok"})


async def search(request):  # async and blocking: one request at a time, as a first server does
    body = await request.json()
    query, top_k, candidates = body["query"], body.get("top_k", 10), body.get("candidates", 100)
    found = util.semantic_search(model.encode([query], normalize_embeddings=True, convert_to_tensor=True), vectors,
                                 top_k=candidates)[0]
    ranked = reranker.rank(query, [corpus[h["corpus_id"]] for h in found], top_k=top_k)
    hits = [{"id": found[r["corpus_id"]]["corpus_id"], "score": float(r["score"])} for r in ranked]
    return JSONResponse({"data": [{"index": 0, "hits": hits}]})


app = Starlette(routes=[Route("/health", health), Route("/v1/search", search, methods=["POST"])])
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
'''


def top_ids(url: str, queries, candidates: int):
    import httpx

    out = []
    for q in queries:
        r = httpx.post(url + "/v1/search", json={"query": q, "top_k": 5, "candidates": candidates}, timeout=120)
        r.raise_for_status()
        out.append([int(h["id"]) for h in r.json()["data"][0]["hits"]])
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shared", default=os.path.join("..", "shared", "data"))
    parser.add_argument("--documents", type=int, default=5000, help="reviews in the collection searched")
    parser.add_argument("--candidates", type=int, default=20, help="hits the cross-encoder re-scores per query")
    parser.add_argument("--requests", type=int, default=400, help="requests per concurrency level (kbert)")
    parser.add_argument("--peer-requests", type=int, default=150, help="requests per level for the slower peer")
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()

    import transformers

    import kbert

    reviews = read_sentences(os.path.join(args.shared, "movie-reviews", "reviews.tsv.gz"), args.documents + 1000)
    corpus, queries = reviews[:args.documents], reviews[args.documents:]
    from scratch import scratch_dir  # benchmarks/scratch.py: removed at exit
    work = scratch_dir(prefix="kbert-search-bench-")
    tok = kbert.Tokenizer.train(reviews, vocab_size=4000, algorithm="wordpiece", progress=False)
    cfg = kbert.ModelConfig.preset("bert-mini", vocab_size=tok.vocab_size)
    model_dir, hf_dir, ce_dir = (os.path.join(work, n) for n in ("kbert", "hf", "cross-encoder"))
    backbone = kbert.BertBackbone(cfg)
    kbert.save_model(backbone, model_dir, tokenizer=tok)
    kbert.export_transformers(backbone, hf_dir, tokenizer=tok)
    # the cross-encoder: a one-logit BertForSequenceClassification, what rerankers on the Hub are
    cross = transformers.BertForSequenceClassification.from_pretrained(hf_dir, num_labels=1)
    cross.save_pretrained(ce_dir)
    transformers.AutoTokenizer.from_pretrained(hf_dir).save_pretrained(ce_dir)
    index = kbert.SearchIndex.build(model_dir, corpus, os.path.join(work, "index"), ids=list(range(len(corpus))),
                                    progress=False)
    corpus_file = os.path.join(work, "corpus.txt")
    with open(corpus_file, "w", encoding="utf-8") as f:
        f.write("\n".join(corpus))
    results = {"documents": len(corpus), "candidates": args.candidates, "queries": len(queries)}
    levels = [int(c) for c in args.clients.split(",")]
    route = dict(path="/v1/search", field="query", marker=b'"hits"', extra={"top_k": 5, "candidates": args.candidates})

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start([sys.executable, "-m", "kbert.cli", "serve", "--model", model_dir, "--index", index.path,
                    "--reranker", ce_dir, "--port", str(port)], url)
    kbert_top = top_ids(url, queries[:50], args.candidates)
    results["kbert"] = []
    for clients in levels:
        # warm-up: the level's own traffic until it makes the server compile no new batch shape (measured warm)
        row = dict(warmup=warm_up(url, queries, args.requests, clients, rounds=5, **route))
        row.update(run_load(url, queries, args.requests, clients, **route))
        results["kbert"].append(row)
        print("kbert", json.dumps(row), flush=True)
    results["kbert_rss_mb"] = rss_mb(server.pid)
    stop(server)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    peer_file = os.path.join(work, "peer.py")
    with open(peer_file, "w", encoding="utf-8") as f:
        f.write(PEER)
    peer = start([sys.executable, peer_file, hf_dir, ce_dir, corpus_file, str(cfg.hidden_size), str(port)], url)
    peer_top = top_ids(url, queries[:50], args.candidates)
    results["peer"] = []
    for clients in levels:
        run_load(url, queries, min(50, args.peer_requests), clients, **route)
        row = run_load(url, queries, args.peer_requests, clients, **route)
        results["peer"].append(row)
        print("peer", json.dumps(row), flush=True)
    stop(peer)

    results["same_top5"] = sum(a == b for a, b in zip(kbert_top, peer_top)) / len(kbert_top)
    results["same_first"] = sum(a[:1] == b[:1] for a, b in zip(kbert_top, peer_top)) / len(kbert_top)
    print(f"\nthe same 50 queries on both servers: equal top-5 id lists {100 * results['same_top5']:.0f}%, equal "
          f"first hit {100 * results['same_first']:.0f}%")
    print(f"\n{len(corpus):,} reviews searched, the first {args.candidates} hits of each query re-scored by the "
          f"cross-encoder, top 5 returned\n")
    print("| clients | kbert serve req/s | p50 ms | p99 ms | errors | peer req/s | peer p99 ms | kbert / peer |")
    print("|---:|---:|---:|---:|---|---:|---:|---:|")
    for k, p in zip(results["kbert"], results["peer"]):
        errors = {s: n for s, n in k["statuses"].items() if s != 200} or "none"
        print(f"| {k['clients']} | {k['rps']:,.1f} | {k['p50_ms']:.1f} | {k['p99_ms']:.1f} | {errors} | "
              f"{p['rps']:,.1f} | {p['p99_ms']:.1f} | {k['rps'] / p['rps']:.2f}x |")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
