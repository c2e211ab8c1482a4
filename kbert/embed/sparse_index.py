"""`kbert.SparseIndex`: a collection's SPLADE vectors kept on disk and searched as an inverted index.

    index = kbert.SparseIndex.build("splade-ko", texts, "law-sparse", max_active_dims=256)   # resumable
    index = kbert.SparseIndex.load("law-sparse")         # the model comes back from the dir recorded
    index.search("전세 계약을 갱신하려면", top_k=5)       # [Hit(id, score, text, metadata), ...]: dot products
    index.add(more_texts); index.delete([3]); index.save()

`kbert.SparseEncoder.search` encodes its corpus on every call; a collection is encoded once and searched many
times, so its vectors belong on disk beside the texts, with the model's probe vector (loading the index with
another model is an error, not wrong neighbours), as `kbert.SearchIndex` keeps dense vectors. The build streams
the texts in chunks and an interrupted build run again picks up where it stopped (the same code as SearchIndex:
`kbert.embed.index.encode_chunks`); `add`, `delete`, `where` filters, `group_by` and a cross-encoder `reranker`
work as there, through the same records.

Why scipy's CSR matrix and no search engine: the documents' vectors are one CSR matrix `[documents, vocab]`, and
`queries @ documents.T` is the inverted-index product (for each of a query's few active tokens, the documents
holding that token and their weights), which is what Lucene-style engines compute for learned sparse vectors
(OpenSearch's neural sparse search, Elasticsearch's `sparse_vector`, Pyserini's impact indexes) and what
sentence-transformers' `semantic_search` on sparse tensors computes, with no server to run. It scores only the
documents that share a token with the query: a document sharing none has score 0 and is never a hit (an
inverted index does not reach it). scipy is a base dependency; FAISS is not needed.

The dir:
    kbert_index.json   what built it: "type": "sparse", the model, max_active_dims, count, the probe's vector
    vectors.npz        the documents' SPLADE vectors, scipy CSR `[count, vocab]` float32 (row i is record i)
    records.jsonl, offsets.npy, deleted.npy, chunks/   as SearchIndex's
"""

from __future__ import annotations

import os
import shutil
from typing import Iterable, Optional, Sequence

import numpy as np

from kbert.data.features import text_list
from kbert.embed.index import (CHUNKS, FORMAT, GROUP_DEPTH, MANIFEST, PROBE_MIN_COSINE, PROBE_TEXT, SPARSE_VECTORS,
                               Records, TextCollection, best_of_groups, check_probe, clear_index, encode_chunks,
                               loaded_model, manifest_exists, positive_int, read_manifest, rerank_hits,
                               write_json, write_records)
from kbert.utils import write_atomic, writing_to

KIND = "sparse"  # the manifest's "type" (a dense SearchIndex's manifest has none)
# query rows scored at once: their scores are as many sparse rows as the documents they touch
QUERY_BLOCK = 256


def _encoder(model):
    from kbert.embed.sparse import SparseEncoder

    return loaded_model(model, SparseEncoder, "a SPLADE model dir")


def _save_csr(path: str, matrix) -> None:
    from scipy.sparse import save_npz

    with open(path, "wb") as f:  # a file object: save_npz would add ".npz" to a path ending in ".tmp"
        save_npz(f, matrix.tocsr().astype(np.float32))


def _probe(encoder) -> dict:
    vector = encoder.encode_document(PROBE_TEXT)
    return {"indices": vector.indices.tolist(), "values": [round(float(v), 7) for v in vector.data]}


def _cosine(a: dict, b: dict) -> float:
    """Cosine of two probe vectors ({"indices", "values"})."""
    x, y = dict(zip(a["indices"], a["values"])), dict(zip(b["indices"], b["values"]))
    dot = sum(v * y.get(k, 0.0) for k, v in x.items())
    norms = np.sqrt(sum(v * v for v in x.values()) * sum(v * v for v in y.values()))
    return float(dot / norms) if norms > 0 else float(x == y)


def load_index(index_dir: str, model=None):
    """The index in `index_dir`, whichever kind: a `kbert.SparseIndex` or a `kbert.SearchIndex` (`model`, when
    given, encodes its queries). Here rather than in kbert.embed.index, which this module builds on."""
    from kbert.embed.index import SearchIndex

    if is_sparse_index(index_dir):
        return SparseIndex.load(index_dir, model=model)
    return SearchIndex.load(index_dir, model=model)


def is_sparse_index(index_dir: str) -> bool:
    """Whether `index_dir` holds a finished SparseIndex (rather than a dense SearchIndex)."""
    return manifest_exists(index_dir) and read_manifest(index_dir).get("type") == KIND


class SparseIndex(TextCollection):
    """Texts, their SPLADE vectors (scipy CSR), and the SparseEncoder that encodes queries for them."""

    def __init__(self, matrix, records: Records, info: dict, encoder=None, path: Optional[str] = None):
        super().__init__(records, info, path)
        self.matrix = matrix  # [count, vocab] CSR float32
        self._encoder = encoder
        self._postings = None  # matrix.T as CSR [vocab, count]: each token's documents, built at the first search

    def _total(self) -> int:
        return int(self.matrix.shape[0])

    # ----------------------------------------------------------------- building
    @classmethod
    def build(cls, model, texts: Iterable[str], out_dir: str, ids: Optional[Iterable] = None,
              metadata: Optional[Iterable[Optional[dict]]] = None, max_active_dims: Optional[int] = None,
              query_max_active_dims: Optional[int] = None, chunk_size: int = 10_000, batch_size: int = 16,
              resume: bool = True, overwrite: bool = False, progress: bool = True) -> "SparseIndex":
        """Encodes `texts` with `model` (`encode_document`) and writes a searchable sparse index to `out_dir`.

        Args:
            model: a SPLADE model (a sentence-transformers SparseEncoder dir, a `kbert finetune --task
                sparse-embedding` output, or any masked-LM dir or Hub name `kbert.SparseEncoder.load` reads; the
                name is recorded, so `load` brings it back) or a `kbert.SparseEncoder`.
            texts, ids, metadata, chunk_size, resume, overwrite: as `kbert.SearchIndex.build`.
            max_active_dims: keep each document's this many largest weights (a smaller index, faster search).
            query_max_active_dims: the same for queries, recorded and used by every search.
            batch_size: texts per forward pass (`SparseEncoder.encode`'s; its logits are `[b, s, vocab]`).
        """
        from scipy.sparse import load_npz, vstack

        chunk_size, batch_size = positive_int(chunk_size, "chunk_size"), positive_int(batch_size, "batch_size")
        for name, value in (("max_active_dims", max_active_dims), ("query_max_active_dims", query_max_active_dims)):
            if value is not None:
                positive_int(value, name)
        if isinstance(texts, (str, bytes)):
            raise TypeError("`texts` must be a collection of texts, not one string")
        with writing_to(out_dir, "kbert index build --sparse"):  # one writer: two builds would interleave their chunks
            clear_index(out_dir, overwrite, "SparseIndex")
            encoder, model_name = _encoder(model)
            identity = {"type": KIND, "model": model_name, "max_active_dims": max_active_dims,
                        "chunk_size": chunk_size, "ids": "given" if ids is not None else "positions"}
            probe = _probe(encoder)  # what this model makes of the probe: kept, and checked on resume and load
            chunk_files, count = encode_chunks(
                out_dir, texts, ids, metadata, chunk_size, identity, probe,
                lambda saved: _cosine(probe, saved) >= PROBE_MIN_COSINE,
                lambda chunk: encoder.encode_document(chunk, batch_size=batch_size, max_active_dims=max_active_dims),
                _save_csr, ".npz", resume, progress, model_name or "hand")
            matrix = vstack([load_npz(base + ".npz") for base in chunk_files], format="csr").astype(np.float32)
            write_atomic(os.path.join(out_dir, SPARSE_VECTORS), lambda tmp: _save_csr(tmp, matrix))
            write_records(out_dir, chunk_files)
            info = {"format": FORMAT, "type": KIND, "model": model_name, "max_active_dims": max_active_dims,
                    "query_max_active_dims": query_max_active_dims, "dimension": int(matrix.shape[1]), "count": count,
                    "ids": identity["ids"], "probe": probe}
            write_json(os.path.join(out_dir, MANIFEST), info)
            shutil.rmtree(os.path.join(out_dir, CHUNKS), ignore_errors=True)
        return cls.load(out_dir, model=encoder)

    # ----------------------------------------------------------------- loading and saving
    @classmethod
    def load(cls, index_dir: str, model=None) -> "SparseIndex":
        """The index in `index_dir`. Text queries are encoded by `model` (a dir, Hub name or SparseEncoder) or,
        by default, by the model recorded at build time (loaded at the first text query)."""
        from scipy.sparse import load_npz

        info = read_manifest(index_dir)
        if info.get("type") != KIND:
            raise ValueError(f"{index_dir} is a dense index (kbert.SearchIndex), not a sparse one")
        if info.get("format") != FORMAT:
            raise ValueError(f"{index_dir}: index format {info.get('format')!r}, this kbert reads {FORMAT}")
        matrix = load_npz(os.path.join(index_dir, SPARSE_VECTORS)).tocsr()
        if matrix.shape[0] < info["count"]:
            raise ValueError(f"{index_dir}: {SPARSE_VECTORS} holds {matrix.shape[0]} vectors, {MANIFEST} "
                             f"{info['count']} (a save was interrupted); build the index again")
        out = cls(matrix[:info["count"]], Records(index_dir, info["count"]), info, None, index_dir)
        out._read_deleted(index_dir)
        if model is not None:
            out.use_model(model)
        return out

    def use_model(self, model) -> "SparseIndex":
        """Encode text queries with `model`, after checking that it gives the index's probe sentence the vector
        the model that built the index gave it."""
        encoder, _ = _encoder(model)
        if encoder.vocab_size != self.info["dimension"]:
            raise ValueError(f"the model's vectors are {encoder.vocab_size} wide (its vocabulary); this index holds "
                             f"{self.info['dimension']}-wide ones: load it with the model that built it")
        check_probe(_cosine(_probe(encoder), self.info["probe"]))
        self._encoder = encoder
        return self

    @property
    def encoder(self):
        """The SparseEncoder that encodes text queries (loaded from the recorded model at first use)."""
        if self._encoder is None:
            self._load_recorded_model("a SparseEncoder")
        return self._encoder

    embedder = encoder  # the name SearchIndex's callers read (`kbert index add --passages` splits with it)

    def save(self, out_dir: Optional[str] = None) -> str:
        """Writes the index (and the texts added since it was loaded) to `out_dir` (default: where it was
        loaded from or built). Returns the dir."""
        out_dir = out_dir or self.path
        if out_dir is None:
            raise ValueError("this index has no dir yet: pass save(out_dir)")
        os.makedirs(out_dir, exist_ok=True)
        write_atomic(os.path.join(out_dir, SPARSE_VECTORS), lambda tmp: _save_csr(tmp, self.matrix))
        self._write_records(out_dir)
        write_json(os.path.join(out_dir, MANIFEST), self.info)
        self.path = out_dir
        return out_dir

    # ----------------------------------------------------------------- using
    def __repr__(self) -> str:
        active = self.matrix.getnnz() / max(self._total(), 1)
        return (f"SparseIndex({len(self)} texts, {self.info['dimension']} tokens, {active:.1f} active a text, "
                f"model={self.info.get('model')!r})")

    def encode_queries(self, queries: Sequence[str], batch_size: int = 16):
        """Query vectors (CSR `[n, vocab]`), encoded as this index says (the model's query prompt,
        `query_max_active_dims`)."""
        return self.encoder.encode_query(text_list(queries), batch_size=batch_size,
                                         max_active_dims=self.info.get("query_max_active_dims"))

    def add(self, texts: Sequence[str], ids=None, metadata=None, batch_size: int = 16,
            progress: Optional[bool] = None) -> "SparseIndex":
        """Encodes `texts` and adds them (in memory: `save()` writes them); ids as `SearchIndex.add`."""
        from scipy.sparse import vstack

        if isinstance(texts, (str, bytes)):
            raise TypeError("`texts` must be a collection of texts, not one string; pass [text]")
        texts = list(texts)
        if not texts:
            return self
        records = self._new_records(texts, ids, metadata)
        vectors = self.encoder.encode_document(texts, batch_size=batch_size, progress=bool(progress),
                                               max_active_dims=self.info.get("max_active_dims"))
        self.matrix = vstack([self.matrix, vectors], format="csr").astype(np.float32)
        self._postings = None
        self._keep_records(records)
        return self

    def search(self, queries, top_k: int = 10, where=None, group_by: Optional[str] = None, reranker=None,
               candidates: int = 100, batch_size: int = 16, query_vectors=None, ef_search=None, nprobe=None,
               lexical: float = 0.0):
        """The `top_k` texts with the largest dot product with each query's vector, best first (ties by
        position), as `Hit(id, score, text, metadata)`; texts sharing no token with a query are not hits.
        One query (a string) gives one list, several a list per query.

        queries: texts (encoded with `encode_queries`) or CSR vectors `[n, vocab]`.
        where, group_by, reranker, candidates: as `kbert.SearchIndex.search`.
        query_vectors: the text queries' vectors, already encoded (a server batching them).
        ef_search, nprobe, lexical: a dense index's settings, refused here when given.
        """
        from scipy.sparse import csr_matrix, issparse

        if ef_search is not None or nprobe is not None or lexical:
            raise ValueError("ef_search, nprobe and lexical are settings of a dense index (kbert.SearchIndex); a "
                             "sparse index scores every document that shares a token with the query")
        top_k, candidates = positive_int(top_k, "top_k"), positive_int(candidates, "candidates")
        single = isinstance(queries, str)
        if issparse(queries):
            if reranker is not None:
                raise ValueError("`reranker` reads the query texts: pass texts, not vectors")
            texts, vectors = None, csr_matrix(queries, dtype=np.float32)
        else:
            texts = text_list(queries)
            vectors = (csr_matrix(query_vectors, dtype=np.float32) if query_vectors is not None
                       else self.encode_queries(texts, batch_size))
            if vectors.shape[0] != len(texts):
                raise ValueError(f"`query_vectors` has {vectors.shape[0]} rows for {len(texts)} queries")
        if vectors.shape[1] != self.info["dimension"]:
            raise ValueError(f"query vectors are {vectors.shape[1]} wide; this index holds "
                             f"{self.info['dimension']}-wide vectors")
        allowed = self._allowed(where)
        wanted = max(top_k, candidates if reranker is not None else 0)
        if self._postings is None:
            self._postings = self.matrix.T.tocsr()
        documents = self._postings  # [vocab, count]: each token's posting list
        out = []
        for start in range(0, vectors.shape[0], QUERY_BLOCK):
            scores = (vectors[start:start + QUERY_BLOCK] @ documents).tocsr()  # [block, count], matches only
            for i in range(scores.shape[0]):
                lo, hi = scores.indptr[i], scores.indptr[i + 1]
                positions, values = scores.indices[lo:hi], scores.data[lo:hi]
                keep = values > 0
                if allowed is not None:
                    keep &= allowed[positions]
                positions, values = positions[keep], values[keep]
                if group_by is None and len(values) > wanted:  # the `wanted` best, and any tied with the last
                    cut = values >= np.partition(values, len(values) - wanted)[len(values) - wanted]
                    positions, values = positions[cut], values[cut]
                order = np.lexsort((positions, -values))  # best first, then by position
                if group_by is None:
                    out.append([self._hit(positions[j], values[j]) for j in order[:wanted]])
                    continue
                hits, read = [], 0
                while read < len(order):  # records read a slice at a time until `wanted` groups are found
                    step = order[read:read + wanted * GROUP_DEPTH]
                    hits += [self._hit(positions[j], values[j]) for j in step]
                    read += len(step)
                    if len(best_of_groups(hits, group_by)) >= wanted:
                        break
                out.append(best_of_groups(hits, group_by)[:wanted])
        if reranker is not None:
            out = [rerank_hits(texts[q], hits, reranker, candidates) for q, hits in enumerate(out)]
        out = [hits[:top_k] for hits in out]
        return out[0] if single else out

    def similarities(self, query_vector, ids) -> np.ndarray:
        """The dot product of one query vector (a CSR row `[1, vocab]`) with the texts `ids` `[len(ids)]`: the
        scores `search` gives them (0 for a text sharing no token), for texts a search did not return."""
        positions = self.positions_of(ids)
        return np.asarray((self.matrix[positions] @ query_vector.T).todense(), np.float32).reshape(-1)
