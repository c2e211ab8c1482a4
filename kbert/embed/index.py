"""`kbert.SearchIndex`: a semantic-search index kept on disk, built once over a collection and queried later.

    index = kbert.SearchIndex.build("my-bi-encoder", texts, "law-index", kind="hnsw")   # resumable
    index = kbert.SearchIndex.load("law-index")         # the model comes back from the dir recorded
    index.search("전세 계약을 갱신하려면", top_k=5)      # [Hit(id, score, text, metadata), ...], best first
    index.add(more_texts, ids=more_ids); index.save()

`Embedder.search` encodes its corpus on every call; a collection of a million statutes, decisions or reviews
is encoded once (an hour or more on a CPU) and searched many times, so the vectors belong in an index that
lives on disk beside the texts, with the settings the documents were encoded with (pooling, layers, length,
prompts, Matryoshka width) recorded so every query is encoded the same way (`encode_query`: a model's own
query prompt). A probe sentence's vector is stored too: loading the index with another model (or another
export of it that encodes differently) is an error instead of silently wrong neighbours.

Building streams the texts in chunks (`chunk_size`): each chunk's vectors and records are written to
`DIR/chunks/` as it finishes, so an interrupted build (Ctrl-C, SIGTERM, a crash) run again with the same
texts and settings encodes only what is left, and says so. Each finished chunk's texts are fingerprinted,
so a resumed build over different texts is an error, not a mixed index.

Why FAISS (faiss-cpu): it is the field's vector index library (sentence-transformers' `semantic_search_faiss`,
LangChain's and Haystack's FAISS stores build on it), it has exact, graph (HNSW) and inverted-file (IVF)
indexes and scalar quantization behind one factory string, reads and writes its own files, and releases the
GIL while it searches, so a server's threads search in parallel. The kinds here are its standard ones for
cosine search on unit vectors (inner product):
- "flat": exact, every vector scored (the same hits as `Embedder.search`); fine to a few hundred thousand.
- "hnsw": a graph (Malkov and Yashunin, 2018), approximate; much faster on large collections, no training,
  `ef_search` trades speed for recall (default `DEFAULT_EF_SEARCH`, at least `top_k`).
- "ivf": vectors bucketed around `nlist` centroids learnt from the collection; `nprobe` buckets searched.
`precision` "float16" or "int8" stores each dimension in 2 bytes or 1 (FAISS's scalar quantizers; int8's
per-dimension ranges are learnt from the collection) instead of 4.

The dir:
    kbert_index.json   what built it: model, encode settings, kind, precision, count, the probe's vector
    index.faiss        FAISS's index (vector i is record i)
    records.jsonl      one JSON object per text: {"id", "text"[, "metadata"]}, read lazily by offset
    offsets.npy        int64 byte offsets of the records ([count + 1])
    lexical*.{npz,json,npy}  with lexical=True: character n-gram TF-IDF of the texts (`search(lexical=w)`)
    deleted.npy        positions of texts deleted since the build (`delete`), left out of every search
    chunks/            only while a build is unfinished

Hybrid search (`lexical=True` at build, `search(..., lexical=w)`): `Embedder.search`'s hybrid score, `(1 - w)` x
the cosine + `w` x the cosine of character 1-3-gram TF-IDF vectors fitted on the collection (`kbert.embed.lexical`),
over the union of each side's first `candidates` texts (the usual form of hybrid retrieval: each retriever
proposes, both score); with `candidates` >= the collection it is `Embedder.search(lexical=w)` exactly. On this
project's Korean question pairs the hybrid found the paraphrase first more often than either part alone
(benchmarks/README.md). Texts added later are weighed by the collection's IDF as built.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import pathlib
import re
import shutil
import sys
import threading
import warnings
from collections import namedtuple
from typing import Iterable, List, Optional, Sequence, Union

import numpy as np

from kbert.data.features import text_list
from kbert.utils import positive_int, progress_bar, unit_rows, write_atomic, writing_to

FORMAT = 1
MANIFEST = "kbert_index.json"
INDEX_FILE = "index.faiss"
RECORDS = "records.jsonl"
OFFSETS = "offsets.npy"
CHUNKS = "chunks"
LEXICAL_MATRIX = "lexical.npz"  # with lexical=True: the texts' character n-gram TF-IDF rows (scipy CSR)
LEXICAL_VOCABULARY = "lexical_vocabulary.json"  # ... the n-grams' columns and their IDF: the vectorizer,
LEXICAL_IDF = "lexical_idf.npy"  # rebuilt from data on load rather than unpickled
DELETED = "deleted.npy"  # positions of deleted texts (int64), skipped by every search
SPARSE_VECTORS = "vectors.npz"  # a kbert.SparseIndex's vectors (scipy CSR) where a SearchIndex has INDEX_FILE
# every file an index dir may hold, removed before a build overwrites it
INDEX_FILES = (MANIFEST, INDEX_FILE, SPARSE_VECTORS, RECORDS, OFFSETS, LEXICAL_MATRIX, LEXICAL_VOCABULARY,
               LEXICAL_IDF, DELETED)
# A filtered search on an approximate index scores the allowed vectors exactly when there are at most this many:
# HNSW's and IVF's beams, sized for the whole collection, find too few neighbours among a small allowed subset.
EXACT_FILTERED = 20_000
MASKS_KEPT = 32  # `where` dicts whose allowed positions are cached (one bool per text each)
# a `where` value's comparisons, as Chroma's and MongoDB's filters write them
WHERE_OPERATORS = {"$eq": lambda v, a: v == a, "$ne": lambda v, a: v != a, "$gt": lambda v, a: v > a,
                   "$gte": lambda v, a: v >= a, "$lt": lambda v, a: v < a, "$lte": lambda v, a: v <= a,
                   "$in": lambda v, a: v in a, "$nin": lambda v, a: v not in a}
GROUP_DEPTH = 8  # with group_by, a first search reads this many hits per group wanted (deeper when short)
_MAX_LEXICAL_SCORES = 1 << 24  # [queries, texts] lexical scores held at once (64 MB)
KINDS = ("flat", "hnsw", "ivf")
PRECISIONS = ("float32", "float16", "int8")
# FAISS's scalar-quantizer names for the stored precisions
_STORAGE = {"float32": "Flat", "float16": "SQfp16", "int8": "SQ8"}
DEFAULT_EF_SEARCH = 64  # HNSW candidates kept while searching (FAISS's own default, 16, loses recall at top-10)
DEFAULT_EF_CONSTRUCTION = 100  # HNSW candidates kept while linking a new vector (FAISS's default: 40)
# The encode settings recorded with an index and used again for its queries (`Embedder.encode`'s keywords).
ENCODE_SETTINGS = ("pooling", "layers", "max_length", "truncate_dim", "long_texts")
# A sentence encoded at build time and again when the index meets a model: another model's vector of it differs.
PROBE_TEXT = "대한민국의 수도는 서울이고, 가장 긴 강은 낙동강이다."
PROBE_MIN_COSINE = 0.99  # an int8 ONNX export of the same model keeps its vectors above this (export_onnx's check)
TRAIN_PER_CENTROID = 256  # IVF / int8 training reads at most this many vectors per centroid (FAISS's own cap)

# `Embedder.encode`'s truncation warning, counted over a build's chunks and given once at the end
_TRUNCATED = re.compile(r"(\d+) of \d+ texts are longer than (\d+) tokens")

Hit = namedtuple("Hit", "id score text metadata")
Hit.__doc__ = "One search result: the text's id (its position unless ids were given), cosine score, text, metadata."


def _faiss():
    try:
        import faiss
    except ImportError:
        raise ImportError("kbert.SearchIndex needs FAISS: pip install faiss-cpu (or kbert[search])") from None
    return faiss


def _embedder(model):
    from kbert.embed.embedder import Embedder

    return loaded_model(model, Embedder, "a model dir")


def loaded_model(model, cls, what: str):
    """(`model` as a `cls`, loaded with `cls.load` from a dir or Hub name; the name an index records for it: a
    local dir's absolute path, since the index may be loaded from another working dir, a Hub name, or None for a
    model given in memory). `what` names the dirs `cls` reads, for the error on anything else."""
    if isinstance(model, cls):
        return model, None
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"`model` must be {what}, a Hugging Face Hub name or a kbert.{cls.__name__}. "
                        f"Received: {type(model).__name__}")
    model = os.fspath(model)
    return cls.load(model), os.path.abspath(model) if os.path.exists(model) else model


def read_manifest(index_dir: str) -> dict:
    """The index's `kbert_index.json`; a dir without one is a FileNotFoundError that says whether a build there is
    unfinished."""
    if not manifest_exists(index_dir):
        hint = " (an unfinished build: run it again to resume)" if os.path.isdir(
            os.path.join(index_dir, CHUNKS)) else ""
        raise FileNotFoundError(f"{index_dir} holds no kbert index ({MANIFEST} missing){hint}")
    with open(os.path.join(index_dir, MANIFEST), encoding="utf-8") as f:
        return json.load(f)


def check_probe(cosine: float) -> None:
    """A model whose vector of PROBE_TEXT is this far (cosine) from the builder's is another model: an error."""
    if cosine < PROBE_MIN_COSINE:
        raise ValueError(f"the model does not encode as the one that built this index did (cosine {cosine:.3f} on a "
                         f"probe sentence, needs {PROBE_MIN_COSINE}): queries would be compared in another vector "
                         f"space; load it with the model that built it")


def clear_index(out_dir: str, overwrite: bool, kind: str) -> None:
    """Before a build into `out_dir`: an index already there is an error, or with `overwrite` its files go."""
    if not manifest_exists(out_dir):
        return
    if not overwrite:
        raise FileExistsError(f"{out_dir} already holds an index; pass overwrite=True (--overwrite) to replace it, "
                              f"or {kind}.load(...).add(...) to extend it")
    for name in INDEX_FILES:
        if os.path.exists(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))


def factory_string(kind: str, precision: str, nlist: Optional[int] = None, hnsw_m: int = 32) -> str:
    """FAISS's `index_factory` description of an index of this kind and stored precision."""
    if kind not in KINDS:
        raise ValueError(f"`kind` must be one of {KINDS}. Received: kind={kind!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"`precision` must be one of {PRECISIONS}. Received: precision={precision!r}")
    storage = _STORAGE[precision]
    if kind == "flat":
        return storage
    if kind == "hnsw":
        return f"HNSW{positive_int(hnsw_m, 'hnsw_m')},{storage}"
    return f"IVF{positive_int(nlist, 'nlist')},{storage}"


def default_nlist(count: int) -> int:
    """IVF centroids for `count` vectors: 4 sqrt(count) (FAISS's guideline is 4-16 sqrt(n)), and at most
    count / 39, so every centroid learns from the 39 vectors FAISS asks for."""
    return max(1, min(int(4 * np.sqrt(count)), count // 39))


def default_nprobe(nlist: int) -> int:
    """IVF buckets searched per query: an eighth of them, at least 8 (FAISS's default, 1, misses neighbours
    that fall in the next bucket)."""
    return min(nlist, max(8, nlist // 8))


def write_json(path: str, value) -> None:
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(value, f, ensure_ascii=False, indent=1)
    write_atomic(path, write)


def save_npy(path: str, array: np.ndarray) -> None:
    with open(path, "wb") as f:  # a file object: np.save would add ".npy" to a path ending in ".tmp"
        np.save(f, array)


def _read_json_lines(path: str) -> list:
    with open(path, "rb") as f:
        return [json.loads(line) for line in f]


def _record_line(record) -> bytes:
    return json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n"


def _record_lines(records) -> bytes:
    return b"".join(map(_record_line, records))


class Records:
    """The records of an index: those saved in `records.jsonl` (read by offset from a memory map, so a large
    collection's texts stay on disk) and those added since (in memory until `save`)."""

    def __init__(self, path: Optional[str] = None, count: int = 0):
        self.path, self.pending, self._map = path, [], None
        self.offsets = np.zeros(1, np.int64)
        if path is not None and count:
            offsets = np.load(os.path.join(path, OFFSETS))
            if len(offsets) < count + 1:
                raise ValueError(f"{path}: {OFFSETS} holds {len(offsets) - 1} records, {MANIFEST} says {count}; "
                                 f"the index is damaged: build it again")
            self.offsets = offsets[:count + 1]  # a save interrupted after the records were appended: ignored
            with open(os.path.join(path, RECORDS), "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    @property
    def saved(self) -> int:
        return len(self.offsets) - 1

    def __len__(self) -> int:
        return self.saved + len(self.pending)

    def __getitem__(self, i: int) -> dict:
        if i < self.saved:
            return json.loads(self._map[self.offsets[i]:self.offsets[i + 1]])
        return self.pending[i - self.saved]

    def write(self, path: str) -> None:
        """Every record into `path`'s records file and offsets (appending the pending ones when `path` already
        holds the saved ones)."""
        target = os.path.join(path, RECORDS)
        same = self.path is not None and os.path.abspath(self.path) == os.path.abspath(path)
        if not same:
            with open(target, "wb") as f:
                if self._map is not None:
                    f.write(self._map[:self.offsets[-1]])
        else:
            with open(target, "r+b") as f:  # cut anything past the saved records (an interrupted save)
                f.truncate(int(self.offsets[-1]))
        lines = [_record_line(r) for r in self.pending]
        with open(target, "ab") as f:
            f.write(b"".join(lines))
        sizes = np.array([len(line) for line in lines], np.int64)
        offsets = np.concatenate([self.offsets, self.offsets[-1] + np.cumsum(sizes)])
        write_atomic(os.path.join(path, OFFSETS), lambda tmp: save_npy(tmp, offsets))
        self.close()
        self.path, self.offsets, self.pending = path, offsets, []
        if len(offsets) > 1:
            with open(target, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


def make_records(texts, ids, metadata, start: int):
    """Checked records `{"id", "text"[, "metadata"]}` of one batch of texts; ids default to positions."""
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"text {start + i} is a {type(t).__name__}, not a str")
    ids = list(range(start, start + len(texts))) if ids is None else list(ids)
    metadata = [None] * len(texts) if metadata is None else list(metadata)
    if len(ids) != len(texts) or len(metadata) != len(texts):
        raise ValueError(f"`ids` and `metadata` need one entry per text: {len(texts)} texts, {len(ids)} ids, "
                         f"{len(metadata)} metadata")
    out = []
    for i, (text, key, meta) in enumerate(zip(texts, ids, metadata)):
        if isinstance(key, bool) or not isinstance(key, (str, int, np.integer)):
            raise TypeError(f"id {start + i} is a {type(key).__name__}; ids are strings or integers")
        if meta is not None and not isinstance(meta, dict):
            raise TypeError(f"metadata {start + i} is a {type(meta).__name__}; each is a dict or None")
        record = {"id": int(key) if isinstance(key, np.integer) else key, "text": text}
        if meta:
            record["metadata"] = meta
        out.append(record)
    return out


def _chunks(texts, ids, metadata, size: int):
    """Lists of at most `size` (text, id, metadata) triples from parallel iterables (ids / metadata may be
    None), checking that they have the same length."""
    sentinel = object()
    streams = [iter(texts), iter(ids) if ids is not None else None,
               iter(metadata) if metadata is not None else None]
    while True:
        batch = ([], [] if ids is not None else None, [] if metadata is not None else None)
        for _ in range(size):
            text = next(streams[0], sentinel)
            extra = [next(s, sentinel) if s is not None else None for s in streams[1:]]
            if text is sentinel:
                if any(e is not sentinel for e, s in zip(extra, streams[1:]) if s is not None):
                    raise ValueError("`ids` / `metadata` hold more entries than there are texts")
                break
            if any(e is sentinel for e, s in zip(extra, streams[1:]) if s is not None):
                raise ValueError("`ids` / `metadata` hold fewer entries than there are texts")
            batch[0].append(text)
            for part, value in zip(batch[1:], extra):
                if part is not None:
                    part.append(value)
        if not batch[0]:
            return
        yield batch
        if len(batch[0]) < size:
            return


def encode_chunks(out_dir: str, texts, ids, metadata, chunk_size: int, identity: dict, probe, same_model, encode,
                  save, suffix: str, resume: bool, progress: bool, model_label: str, truncation_hint: str = ""):
    """Encodes `texts` chunk by chunk into `out_dir/chunks/` (each chunk's records `NNNNN.jsonl` and vectors
    `NNNNN{suffix}`, written by `save(path, vectors)`), picking up an unfinished build of the same `identity`
    (its settings) and texts (each chunk fingerprinted) unless `resume` is False. Returns (the chunk files'
    paths less their suffixes, the number of texts). `probe` (the model's vector of PROBE_TEXT, as JSON) is kept
    with the build; `same_model(the kept probe)` says whether the chunks already written came from this model
    (`model_label` names it). `encode(texts)` gives a chunk's vectors; the tokenizer's truncation warnings are
    counted over the whole build and given once, with `truncation_hint` after them. Shared by `SearchIndex` and
    `kbert.SparseIndex`."""
    os.makedirs(out_dir, exist_ok=True)
    chunk_dir = os.path.join(out_dir, CHUNKS)
    state_path = os.path.join(chunk_dir, "progress.json")
    state = None
    if os.path.exists(state_path) and resume:
        with open(state_path, encoding="utf-8") as f:
            state = json.load(f)
        differ = [k for k in identity if state.get(k) != identity[k]]
        if differ:
            raise ValueError(f"{chunk_dir} holds an unfinished build with other settings ({', '.join(differ)}: "
                             f"{', '.join(f'{state.get(k)!r} now {identity[k]!r}' for k in differ)}); run it "
                             f"with those settings to finish it, or pass resume=False (--no-resume) to start over")
        if state["done"] and not same_model(state["probe"]):
            raise ValueError(f"{chunk_dir} holds an unfinished build whose chunks another model encoded (the "
                             f"model at {model_label} has changed since); pass resume=False (--no-resume) to "
                             f"start over")
    if state is None:
        shutil.rmtree(chunk_dir, ignore_errors=True)
        os.makedirs(chunk_dir)
        state = dict(identity, probe=probe, done=[])
        write_json(state_path, state)
    elif state["done"]:
        done_texts = sum(c["count"] for c in state["done"])
        print(f"kbert: resuming the build in {out_dir}: {len(state['done'])} chunks ({done_texts} texts) "
              f"already encoded", file=sys.stderr, flush=True)

    total = len(texts) if hasattr(texts, "__len__") else None
    # the chunks of an earlier run are shown as done (checked against these texts below, not encoded again)
    bar = progress_bar(total=total, desc="index", unit="text", enabled=progress,
                       initial=sum(c["count"] for c in state["done"]))
    count, encoded, truncated, limit, ids_seen = 0, 0, 0, None, set() if ids is not None else None
    for k, (chunk, chunk_ids, chunk_meta) in enumerate(_chunks(texts, ids, metadata, chunk_size)):
        records = make_records(chunk, chunk_ids, chunk_meta, count)
        if ids_seen is not None:
            for r in records:
                if r["id"] in ids_seen:
                    raise ValueError(f"id {r['id']!r} is given twice; ids must be unique")
                ids_seen.add(r["id"])
        lines = _record_lines(records)
        digest = hashlib.sha256(lines).hexdigest()
        count += len(records)
        if k < len(state["done"]):
            if state["done"][k]["sha256"] != digest:
                raise ValueError(f"the texts differ from those of the unfinished build in {chunk_dir} at chunk "
                                 f"{k} (texts {count - len(records)}..{count - 1}); pass resume=False "
                                 f"(--no-resume) to start over")
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            vectors = encode(chunk)
        for w in caught:
            match = _TRUNCATED.match(str(w.message))
            if match:
                truncated, limit = truncated + int(match.group(1)), match.group(2)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        encoded += len(records)
        base = os.path.join(chunk_dir, f"{k:05d}")
        write_atomic(base + ".jsonl", lambda tmp: pathlib.Path(tmp).write_bytes(lines))
        write_atomic(base + suffix, lambda tmp: save(tmp, vectors))
        state["done"].append({"count": len(records), "sha256": digest})
        write_json(state_path, state)
        bar.update(len(records))
    bar.close()
    if truncated:
        warnings.warn(f"{truncated} of the {encoded} texts encoded were longer than {limit} tokens and were "
                      f"truncated{truncation_hint}", stacklevel=3)
    if count < sum(c["count"] for c in state["done"]):
        raise ValueError(f"the texts end at {count}, before the unfinished build in {chunk_dir} did; pass "
                         f"resume=False (--no-resume) to start over")
    if count == 0:
        raise ValueError("no texts to index")
    return [os.path.join(chunk_dir, f"{k:05d}") for k in range(len(state["done"]))], count


def write_records(out_dir: str, chunk_files: List[str]) -> None:
    """The chunks' records, in order, as the index's records file and its byte offsets."""
    with open(os.path.join(out_dir, RECORDS), "wb") as out:
        offsets = [0]
        for base in chunk_files:
            with open(base + ".jsonl", "rb") as f:
                for line in f:
                    out.write(line)
                    offsets.append(offsets[-1] + len(line))
    write_atomic(os.path.join(out_dir, OFFSETS), lambda tmp: save_npy(tmp, np.array(offsets, np.int64)))


class TextCollection:
    """What every kbert index keeps beside its vectors: the texts' records (ids, texts, metadata), the positions
    deleted, and the filters and lookups over them. `SearchIndex` (dense vectors in FAISS) and
    `kbert.SparseIndex` (SPLADE vectors) add the vectors and the search."""

    def __init__(self, records: Records, info: dict, path: Optional[str] = None):
        self.records, self.info, self.path = records, info, path
        self._id_set = None
        self.deleted = set()  # positions left out of every search (`delete`)
        self._masks = {}  # `where` filters (as JSON) -> (count, allowed positions [total] bool)
        self._positions = None  # id -> position, built by the first `delete` of an index with its own ids
        self._lock = threading.Lock()

    def _total(self) -> int:
        """Texts ever added (deleted ones included): the positions a search ranks."""
        raise NotImplementedError

    def __len__(self) -> int:
        """The texts searched: all added, less those deleted."""
        return self._total() - len(self.deleted)

    def _load_recorded_model(self, what: str) -> None:
        """`use_model` of the model recorded at build time (the first text query's), or an error saying how to
        give one when the index was built from `what` in memory."""
        if not self.info.get("model"):
            raise ValueError(f"this index was built from {what} in memory: pass model= to {type(self).__name__}"
                             f".load (or call use_model) to search it with texts, or search with vectors")
        self.use_model(self.info["model"])

    def _read_deleted(self, index_dir: str) -> None:
        if self.info.get("deleted") and os.path.exists(os.path.join(index_dir, DELETED)):
            self.deleted = {int(p) for p in np.load(os.path.join(index_dir, DELETED)) if p < self.info["count"]}

    def _write_records(self, out_dir: str) -> None:
        """The records added since loading, the count and the deleted positions, into `out_dir` (the vectors and
        the manifest are the subclass's to write, the manifest last)."""
        self.records.write(out_dir)
        self.info["count"] = self._total()
        self.info["deleted"] = len(self.deleted)
        deleted = np.array(sorted(self.deleted), np.int64)
        write_atomic(os.path.join(out_dir, DELETED), lambda tmp: save_npy(tmp, deleted))

    def _new_records(self, texts, ids, metadata) -> list:
        """Checked records for texts being added: ids when (and only when) the index was built with ids, none
        of them taken; positions otherwise."""
        given = self.info["ids"] == "given"
        if given != (ids is not None):
            raise ValueError("this index was built with ids: pass ids= for the new texts" if given else
                             "this index numbers its texts by position: add them without ids")
        records = make_records(texts, ids, metadata, len(self.records))
        if given:
            if self._id_set is None:  # the ids in use: a deleted text's id may be taken again
                self._id_set = {self.records[p]["id"] for p in range(len(self.records)) if p not in self.deleted}
            new = [r["id"] for r in records]
            clash = next((k for k in new if k in self._id_set), None)
            if clash is not None or len(set(new)) < len(new):
                raise ValueError(f"id {clash if clash is not None else 'in the new texts'!r} is already taken; "
                                 f"ids must be unique")
        return records

    def _keep_records(self, records) -> None:
        self.records.pending.extend(records)
        if self.info["ids"] == "given":
            self._id_set.update(r["id"] for r in records)

    def delete(self, ids=None, where=None) -> int:
        """Leaves texts out of every search from now on: those with these ids (positions, for an index without
        its own ids), or those whose metadata match `where` (as `search`'s; `where={"document": 17}` for the
        passages of one document). In memory: `save()` keeps it. Their records stay on disk; an id deleted may
        be added again (an update: `delete([i])`, then `add([new text], ids=[i])`). Returns how many were
        deleted; an id the index does not hold is a KeyError naming it."""
        if (ids is None) == (where is None):
            raise ValueError("pass `ids` or `where` (not both)")
        if where is not None:
            positions = np.flatnonzero(self._allowed(where)).tolist()
        else:
            if isinstance(ids, (str, bytes, int, np.integer)):
                ids = [ids]
            positions = [self._position(key) for key in ids]
            if len(set(positions)) < len(positions):
                raise KeyError("an id is given twice")
        self.deleted.update(positions)
        if self._id_set is not None:
            self._id_set.difference_update(self.records[p]["id"] for p in positions)
        return len(positions)

    def _position(self, key) -> int:
        if self.info["ids"] == "positions":
            if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or not 0 <= key < len(self.records):
                raise KeyError(f"id {key!r}: this index numbers its texts 0..{len(self.records) - 1}")
            position = int(key)
        else:
            if self._positions is None or len(self._positions) < len(self.records):
                self._positions = {self.records[p]["id"]: p for p in range(len(self.records))}
            if key not in self._positions:
                raise KeyError(f"id {key!r} is not in this index")
            position = self._positions[key]
        if position in self.deleted:
            raise KeyError(f"id {key!r} is already deleted")
        return position

    def _allowed(self, where) -> Optional[np.ndarray]:
        """The positions a search may return `[ntotal]` (bool), or None for all: not deleted, and matching
        `where` (a dict of metadata values, each a value or a list of values it may take, or a function of
        the record dict)."""
        total = self._total()
        if where is None:
            mask = None
        elif callable(where):
            mask = np.fromiter((bool(where(self.records[p])) for p in range(total)), bool, total)
        elif isinstance(where, dict):
            key = json.dumps(where, sort_keys=True, ensure_ascii=False, default=str)
            cached = self._masks.get(key)
            if cached is None or cached[0] != total:
                tests = [metadata_test(k, v) for k, v in where.items()]

                def matches(record):
                    meta = record.get("metadata") or {}
                    return all(test(meta) for test in tests)
                cached = (total, np.fromiter((matches(self.records[p]) for p in range(total)), bool, total))
                if len(self._masks) >= MASKS_KEPT:  # a server's clients choose the filters: the oldest goes
                    self._masks.pop(next(iter(self._masks)))
                self._masks[key] = cached
            mask = cached[1]
        else:
            raise TypeError(f"`where` must be a dict of metadata values or a function of a record; "
                            f"received a {type(where).__name__}")
        if self.deleted:
            mask = np.ones(total, bool) if mask is None else mask.copy()
            mask[list(self.deleted)] = False
        return mask

    def positions_of(self, ids) -> np.ndarray:
        """The positions of the texts with these ids (positions themselves for an index built without ids);
        a KeyError names an id the index does not hold, or holds deleted."""
        return np.fromiter((self._position(key) for key in ids), np.int64)

    def _hit(self, position, score) -> Hit:
        record = self.records[int(position)]
        return Hit(record["id"], float(score), record["text"], record.get("metadata"))

    def get(self, position: int) -> Hit:
        """The record at `position` (0-based, in the order texts were added) as a Hit with score None."""
        if isinstance(position, bool) or not isinstance(position, (int, np.integer)) or \
                not 0 <= position < len(self.records):
            raise IndexError(f"position {position!r} is outside this index of {len(self.records)} texts")
        record = self.records[int(position)]
        return Hit(record["id"], None, record["text"], record.get("metadata"))

    def close(self) -> None:
        """Releases the memory map of the records file."""
        self.records.close()


def metadata_test(key, condition):
    """A test of a record's metadata dict for `where={key: condition}`: a value (equal), a list of values (any
    of them), or a dict of comparisons ({"$gte": 2020, "$lt": 2024}; `WHERE_OPERATORS`), all of which must
    hold. A text without the key never matches, nor does a value the comparison cannot order (a string
    against a number). An unknown operator is an error (it matched nothing, silently)."""
    if isinstance(condition, dict):
        unknown = [op for op in condition if op not in WHERE_OPERATORS]
        if unknown or not condition:
            raise ValueError(f"`where[{key!r}]` must be a value, a list of values or a dict of comparisons "
                             f"{sorted(WHERE_OPERATORS)}. Received: {condition!r}")
        for op in ("$in", "$nin"):
            if op in condition and not isinstance(condition[op], (list, tuple, set)):
                raise ValueError(f"`where[{key!r}][{op!r}]` must be a list of values. Received: {condition[op]!r}")
        checks = [(WHERE_OPERATORS[op], arg) for op, arg in condition.items()]

        def test(meta):
            if key not in meta:
                return False
            try:
                return all(check(meta[key], arg) for check, arg in checks)
            except TypeError:  # 2020 > "2020": not comparable, so not a match
                return False
        return test
    allowed = condition if isinstance(condition, (list, tuple, set)) else [condition]
    return lambda meta: key in meta and meta[key] in allowed


class SearchIndex(TextCollection):
    """Texts, their vectors in a FAISS index, and the model and settings that encode queries for it."""

    def __init__(self, index, records: Records, info: dict, embedder=None, path: Optional[str] = None):
        super().__init__(records, info, path)
        self.index = index
        self._embedder = embedder
        self._lexical = None  # (vectorizer, [count, n-grams] CSR rows) for hybrid search, read at first use
        self._lexical_changed = False  # rows added since the lexical files were written

    def _total(self) -> int:
        return int(self.index.ntotal)

    # ----------------------------------------------------------------- building
    @classmethod
    def build(cls, model, texts: Iterable[str], out_dir: str, ids: Optional[Iterable] = None,
              metadata: Optional[Iterable[Optional[dict]]] = None, kind: str = "flat", precision: str = "float32",
              hnsw_m: int = 32, ef_construction: int = DEFAULT_EF_CONSTRUCTION, nlist: Optional[int] = None,
              chunk_size: int = 10_000, batch_size: int = 64, resume: bool = True, overwrite: bool = False,
              progress: bool = True, prompt_name: Optional[str] = None, prompt: Optional[str] = None,
              query_prompt_name: Optional[str] = None, query_prompt: Optional[str] = None,
              pooling: Optional[str] = None, layers=None, max_length: Optional[int] = None,
              truncate_dim: Optional[int] = None, long_texts: str = "truncate",
              lexical: bool = False) -> "SearchIndex":
        """Encodes `texts` with `model` (`encode_document`) and writes a searchable index to `out_dir`.

        Args:
            model: a model dir or Hub name (recorded, so `load` brings it back), or a `kbert.Embedder` (for
                example one with `fit_whitening`; then `load` needs it passed as `model=`).
            texts: the collection, any iterable of strings (a list, a generator over a file's lines).
            ids: one id per text (strings or integers, unique), returned in hits; default: positions 0, 1, ...
            metadata: one dict (or None) per text, returned in hits (title, URL, date, ...).
            kind: "flat" (exact), "hnsw" or "ivf" (approximate; see the module docstring).
            precision: how vectors are stored: "float32", "float16" or "int8".
            hnsw_m: HNSW's links per vector (FAISS's M); ef_construction: its build-time beam.
            nlist: IVF's centroids (default: `default_nlist(count)`).
            chunk_size: texts encoded and written to `out_dir/chunks/` at a time: the unit of resumption.
            resume: pick up an interrupted build in `out_dir` (same texts and settings); False starts over.
            overwrite: replace an index already in `out_dir` (otherwise an error).
            prompt_name / prompt: the documents' prompt (default: the model's document prompt, if any).
            query_prompt_name / query_prompt: what `search` puts before queries (default: the model's query
                prompt, if any).
            pooling, layers, max_length, truncate_dim, long_texts, batch_size: as `Embedder.encode`; all but
                batch_size are recorded and used for queries too.
            lexical: also keep character n-gram TF-IDF rows of the texts, for `search(..., lexical=w)` (needs
                scikit-learn; memory about 12 bytes per distinct n-gram of each text).

        Example:
            >>> lines = (l.strip() for l in open("statutes.txt", encoding="utf-8") if l.strip())
            >>> index = kbert.SearchIndex.build("my-bi-encoder", lines, "statutes-index", kind="hnsw")
            >>> index.search("임대차 계약 갱신 요구", top_k=3)
        """
        faiss = _faiss()
        factory_string("flat", precision)  # kind and precision checked before any encoding
        if kind not in KINDS:
            raise ValueError(f"`kind` must be one of {KINDS}. Received: kind={kind!r}")
        chunk_size, batch_size = positive_int(chunk_size, "chunk_size"), positive_int(batch_size, "batch_size")
        hnsw_m, ef_construction = positive_int(hnsw_m, "hnsw_m"), positive_int(ef_construction, "ef_construction")
        if nlist is not None:
            positive_int(nlist, "nlist")
        if isinstance(texts, (str, bytes)):
            raise TypeError("`texts` must be a collection of texts, not one string")
        with writing_to(out_dir, "kbert index build"):  # one writer: two builds would interleave their chunks
            clear_index(out_dir, overwrite, "SearchIndex")
            emb, model_name = _embedder(model)
            pooling, layers = emb.resolve_pooling(pooling, layers)
            settings = {"pooling": pooling, "layers": layers, "max_length": max_length, "truncate_dim": truncate_dim,
                        "long_texts": long_texts}
            width = emb.check_truncate_dim(truncate_dim)
            document_prompt = emb.prompt_text(prompt_name, prompt) if (prompt_name or prompt is not None) \
                else emb.role_prompt("document")
            query_prompt = emb.prompt_text(query_prompt_name, query_prompt) \
                if (query_prompt_name or query_prompt is not None) else emb.role_prompt("query")
            identity = {"model": model_name, "settings": settings, "document_prompt": document_prompt,
                        "chunk_size": chunk_size, "ids": "given" if ids is not None else "positions"}
            encode = dict(settings, prompt=document_prompt, batch_size=batch_size, progress=False)
            probe = emb.encode(PROBE_TEXT, **encode)  # what this model makes of the probe: kept, and checked on resume

            def same_model(saved):
                return float(np.dot(probe, np.asarray(saved, np.float32))) >= PROBE_MIN_COSINE

            chunk_files, count = encode_chunks(
                out_dir, texts, ids, metadata, chunk_size, identity, [float(x) for x in probe], same_model,
                lambda chunk: emb.encode(chunk, **encode).astype(np.float32), save_npy, ".npy", resume, progress,
                model_name or "hand", "; long_texts='mean' (--long-texts mean) encodes the whole of each, as the "
                                      "mean of its windows' vectors")
            chunk_dir = os.path.join(out_dir, CHUNKS)
            nlist = nlist or default_nlist(count)
            if kind == "ivf" and nlist > count:
                raise ValueError(f"`nlist` {nlist} is more than the {count} texts; IVF needs fewer centroids than "
                                 f"vectors")
            index = faiss.index_factory(width, factory_string(kind, precision, nlist, hnsw_m),
                                        faiss.METRIC_INNER_PRODUCT)
            if kind == "hnsw":
                faiss.downcast_index(index).hnsw.efConstruction = ef_construction
            if not index.is_trained:  # IVF's centroids, int8's ranges: learnt from a sample of the collection
                index.train(_training_sample(chunk_files, count, nlist if kind == "ivf" else 1))
            for base in chunk_files:
                index.add(np.load(base + ".npy", mmap_mode="r").astype(np.float32))
            write_records(out_dir, chunk_files)
            if lexical:
                _write_lexical(out_dir, [r["text"] for base in chunk_files for r in _read_json_lines(base + ".jsonl")])
            info = {"format": FORMAT, "model": model_name, "settings": settings, "document_prompt": document_prompt,
                    "query_prompt": query_prompt, "kind": kind, "precision": precision, "dimension": width,
                    "factory": factory_string(kind, precision, nlist, hnsw_m),
                    "nlist": nlist if kind == "ivf" else None,
                    "hnsw_m": hnsw_m if kind == "hnsw" else None, "count": count, "ids": identity["ids"],
                    "lexical": bool(lexical), "probe": [round(float(x), 7) for x in probe]}
            write_atomic(os.path.join(out_dir, INDEX_FILE), lambda tmp: faiss.write_index(index, tmp))
            write_json(os.path.join(out_dir, MANIFEST), info)
            shutil.rmtree(chunk_dir, ignore_errors=True)
        return cls.load(out_dir, model=emb)

    @classmethod
    def from_vectors(cls, vectors, texts: Optional[Sequence[str]] = None, ids=None, metadata=None,
                     kind: str = "flat", precision: str = "float32", hnsw_m: int = 32,
                     ef_construction: int = DEFAULT_EF_CONSTRUCTION, nlist: Optional[int] = None,
                     model=None, lexical: bool = False) -> "SearchIndex":
        """An index in memory over vectors already computed (`[n, dim]`; normalized here), with optional texts,
        ids and metadata. Queries are vectors unless `model` (a dir or an Embedder) encodes them; `save(dir)`
        writes it. lexical: keep the texts' character n-gram TF-IDF for hybrid search, as `build`."""
        faiss = _faiss()
        vectors = unit_rows(np.atleast_2d(vectors))
        count, width = vectors.shape
        if count == 0:
            raise ValueError("no vectors to index")
        texts = [""] * count if texts is None else text_list(texts)
        records = make_records(texts, ids, metadata, 0)  # checks the lengths and types
        if len(records) != count:
            raise ValueError(f"{count} vectors but {len(records)} texts")
        if ids is not None and len({r["id"] for r in records}) < count:
            raise ValueError("ids must be unique")
        nlist = nlist or default_nlist(count)
        index = faiss.index_factory(width, factory_string(kind, precision, nlist, hnsw_m), faiss.METRIC_INNER_PRODUCT)
        if kind == "hnsw":
            faiss.downcast_index(index).hnsw.efConstruction = positive_int(ef_construction, "ef_construction")
        if not index.is_trained:
            index.train(vectors)
        index.add(vectors)
        emb, model_name = _embedder(model) if model is not None else (None, None)
        info = {"format": FORMAT, "model": model_name, "settings": {}, "document_prompt": None, "query_prompt": None,
                "kind": kind, "precision": precision, "dimension": width,
                "factory": factory_string(kind, precision, nlist, hnsw_m), "nlist": nlist if kind == "ivf" else None,
                "hnsw_m": hnsw_m if kind == "hnsw" else None, "count": count,
                "ids": "given" if ids is not None else "positions", "lexical": bool(lexical), "probe": None}
        out = cls(index, Records(), info)
        out.records.pending = records
        if emb is not None:
            out.use_model(emb)  # its width checked against the vectors'
        if lexical:
            out._lexical, out._lexical_changed = _fit_lexical(texts), True
        return out

    # ----------------------------------------------------------------- loading and saving
    @classmethod
    def load(cls, index_dir: str, model=None) -> "SearchIndex":
        """The index in `index_dir`. Text queries are encoded by `model` (a dir, Hub name or Embedder) or, by
        default, by the model recorded at build time (loaded at the first text query)."""
        faiss = _faiss()
        info = read_manifest(index_dir)
        if info.get("type") == "sparse":
            raise ValueError(f"{index_dir} is a sparse index of SPLADE vectors: load it with kbert.SparseIndex.load "
                             f"(kbert.embed.sparse_index.load_index reads either kind)")
        if info.get("format") != FORMAT:
            raise ValueError(f"{index_dir}: index format {info.get('format')!r}, this kbert reads {FORMAT}")
        index = faiss.read_index(os.path.join(index_dir, INDEX_FILE))
        if index.ntotal != info["count"]:
            raise ValueError(f"{index_dir}: {INDEX_FILE} holds {index.ntotal} vectors, {MANIFEST} {info['count']} "
                             f"(a save was interrupted); build the index again")
        out = cls(index, Records(index_dir, info["count"]), info, None, index_dir)
        out._read_deleted(index_dir)
        if model is not None:
            out.use_model(model)
        return out

    def use_model(self, model) -> "SearchIndex":
        """Encode text queries with `model` (a dir, Hub name or Embedder), after checking that it encodes the
        index's probe sentence as the model that built the index did."""
        emb, _ = _embedder(model)
        probe = self.info.get("probe")
        if probe is not None:
            mine = emb.encode(PROBE_TEXT, **self._encode_settings(self.info["document_prompt"]))
            if mine.shape[-1] != len(probe):
                raise ValueError(f"the model gives {mine.shape[-1]}-wide vectors; this index holds {len(probe)}-wide "
                                 f"ones: load it with the model that built it")
            cosine = float(np.dot(mine, np.asarray(probe, np.float32)))
            check_probe(cosine)
        elif emb.dimension != self.info["dimension"] and not self.info["settings"].get("truncate_dim"):
            raise ValueError(f"the model gives {emb.dimension}-wide vectors; this index holds "
                             f"{self.info['dimension']}-wide ones")
        self._embedder = emb
        return self

    @property
    def embedder(self):
        """The Embedder that encodes text queries (loaded from the recorded model at first use)."""
        if self._embedder is None:
            self._load_recorded_model("vectors or an Embedder")
        return self._embedder

    def save(self, out_dir: Optional[str] = None) -> str:
        """Writes the index (and the texts added since it was loaded) to `out_dir` (default: where it was
        loaded from or built). Returns the dir."""
        faiss = _faiss()
        out_dir = out_dir or self.path
        if out_dir is None:
            raise ValueError("this index has no dir yet: pass save(out_dir)")
        os.makedirs(out_dir, exist_ok=True)
        same = self.path is not None and os.path.abspath(self.path) == os.path.abspath(out_dir)
        if self.info.get("lexical") and (self._lexical_changed or not same):
            vectorizer, rows = self.lexical_rows()
            _save_lexical(out_dir, vectorizer, rows)
            self._lexical_changed = False
        self._write_records(out_dir)
        write_atomic(os.path.join(out_dir, INDEX_FILE), lambda tmp: faiss.write_index(self.index, tmp))
        write_json(os.path.join(out_dir, MANIFEST), self.info)
        self.path = out_dir
        return out_dir

    # ----------------------------------------------------------------- using
    def __repr__(self) -> str:
        return (f"SearchIndex({len(self)} texts, {self.info['kind']} {self.info['precision']}, "
                f"dim {self.info['dimension']}, model={self.info.get('model')!r})")

    def _encode_settings(self, prompt) -> dict:
        settings = {k: v for k, v in self.info["settings"].items() if k in ENCODE_SETTINGS}
        return dict(settings, prompt=prompt or "", progress=False)

    def encode_queries(self, queries: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """Query vectors `[n, dim]`, encoded as this index's settings say (its query prompt)."""
        return self.embedder.encode(text_list(queries), batch_size=batch_size,
                                    **self._encode_settings(self.info.get("query_prompt")))

    def add(self, texts: Sequence[str], ids=None, metadata=None, batch_size: int = 64,
            progress: Optional[bool] = None) -> "SearchIndex":
        """Encodes `texts` and adds them (in memory: `save()` writes them). An index built with ids needs ids
        for new texts too, unique among all; one built without gets the next positions."""
        if isinstance(texts, (str, bytes)):
            raise TypeError("`texts` must be a collection of texts, not one string; pass [text]")
        texts = list(texts)
        if not texts:
            return self
        records = self._new_records(texts, ids, metadata)
        vectors = self.embedder.encode(texts, batch_size=batch_size, **dict(
            self._encode_settings(self.info["document_prompt"]), progress=progress))
        if self.info.get("lexical"):  # the collection's IDF as built weighs the new texts' n-grams
            import scipy.sparse

            vectorizer, rows = self.lexical_rows()
            self._lexical = (vectorizer, scipy.sparse.vstack([rows, vectorizer.transform(texts)], format="csr"))
            self._lexical_changed = True
        self.index.add(unit_rows(np.atleast_2d(vectors)))
        self._keep_records(records)
        return self

    def search(self, queries, top_k: int = 10, ef_search: Optional[int] = None, nprobe: Optional[int] = None,
               lexical: float = 0.0, reranker=None, candidates: int = 100, batch_size: int = 64,
               query_vectors: Optional[np.ndarray] = None, where=None, group_by: Optional[str] = None):
        """The `top_k` texts nearest each query by cosine, best first, as `Hit(id, score, text, metadata)`.
        One query (a string or a vector) gives one list, several give a list per query.

        queries: texts (encoded with the index's settings and query prompt) or vectors `[n, dim]`.
        ef_search: HNSW's search beam (default `DEFAULT_EF_SEARCH`, at least `top_k`); nprobe: IVF's buckets
            searched (default `default_nprobe(nlist)`). Larger finds more of the exact neighbours, slower.
        lexical: hybrid search (an index built with lexical=True; text queries): the score is `(1 - lexical)` x
            the cosine + `lexical` x the character n-gram TF-IDF cosine, over the union of each part's first
            `candidates` texts (module docstring). 0: the vectors alone.
        reranker: a cross-encoder (`kbert.TaskModel`) that re-scores each query's first `candidates` hits
            (text queries only); its scores replace the first stage's for those hits.
        candidates: how many texts each part proposes (hybrid) and the reranker re-scores.
        query_vectors: the text queries' vectors, already encoded with `encode_queries` (a server batching them
            with other work); the texts are then read only by `lexical` and `reranker`.
        where: only texts whose metadata match: {"법": "민법"} (equal), {"연도": [2023, 2024]} (any of),
            {"연도": {"$gte": 2020, "$lt": 2024}} (comparisons: $eq $ne $gt $gte $lt $lte $in $nin, as Chroma
            writes them), several keys all holding; or a function of the record dict ({"id", "text",
            "metadata"}) that returns True for those to keep.
            A dict's matches are cached until texts are added; a function reads every record at every search
            (slow on a large collection). On an approximate index a filter that leaves at
            most `EXACT_FILTERED` texts scores them exactly (a graph's beam would find too few of them).
        group_by: a metadata key (for passages of `kbert.split_documents`: "document"): only the best hit of
            each value comes back (hits without the key are each their own group), so `top_k` hits are
            `top_k` documents; the search goes deeper until it has them.
        """
        faiss = _faiss()
        top_k, candidates = positive_int(top_k, "top_k"), positive_int(candidates, "candidates")
        if isinstance(lexical, bool) or not isinstance(lexical, (int, float)) or not 0 <= lexical <= 1:
            raise ValueError(f"`lexical` must be a number in [0, 1]. Received: lexical={lexical!r}")
        if lexical and not self.info.get("lexical"):
            raise ValueError("this index keeps no lexical rows: build it with lexical=True (--lexical) for "
                             "hybrid search")
        single = isinstance(queries, str) or (isinstance(queries, np.ndarray) and queries.ndim == 1)
        if isinstance(queries, np.ndarray):
            if reranker is not None or lexical:
                raise ValueError("`reranker` and `lexical` read the query texts: pass texts, not vectors")
            vectors = unit_rows(np.atleast_2d(queries))
            if vectors.shape[1] != self.info["dimension"]:
                raise ValueError(f"query vectors are {vectors.shape[1]} wide; this index holds "
                                 f"{self.info['dimension']}-wide vectors")
            texts = None
        else:
            texts = text_list(queries)
            vectors = np.zeros((0, self.info["dimension"]), np.float32)
            if query_vectors is not None:
                vectors = unit_rows(np.atleast_2d(query_vectors))
                if vectors.shape != (len(texts), self.info["dimension"]):
                    raise ValueError(f"`query_vectors` is {vectors.shape}; expected ({len(texts)}, "
                                     f"{self.info['dimension']}) for these queries")
            elif texts and lexical < 1:
                vectors = unit_rows(self.encode_queries(texts, batch_size))
        wide = reranker is not None or lexical
        allowed = self._allowed(where)
        live = len(self) if allowed is None else int(allowed.sum())
        wanted = max(top_k, candidates if wide else 0)  # hits (groups, with group_by) each query needs
        depth = min(wanted * (GROUP_DEPTH if group_by else 1), live)
        queries_count = len(texts) if texts is not None else len(vectors)
        rows = [None] * queries_count
        pending = list(range(queries_count))
        while pending:  # with group_by, queries short of groups search deeper, up to the whole collection
            params = self._search_params(faiss, depth, ef_search, nprobe, allowed)
            dense = self._dense_search(allowed, live, params)
            part_texts = None if texts is None else [texts[q] for q in pending]
            part_vectors = vectors[pending] if len(vectors) else vectors
            if depth == 0:
                found = [((), ())] * len(pending)
            elif lexical:
                found = self._hybrid(part_texts, part_vectors, depth, float(lexical), dense, allowed)
            else:
                found = list(zip(*dense(part_vectors, depth)))
            short = []
            for q, (score_row, position_row) in zip(pending, found):
                hits = [self._hit(position, score) for score, position in zip(score_row, position_row)
                        if position >= 0]  # IVF: -1 past the vectors in the buckets searched
                if group_by is not None:
                    hits = best_of_groups(hits, group_by)
                    if len(hits) < wanted and depth < live:
                        short.append(q)
                rows[q] = hits
            pending = short
            depth = min(depth * 4, live)
        if reranker is not None:
            rows = [rerank_hits(texts[q], hits, reranker, candidates) for q, hits in enumerate(rows)]
        out = [hits[:top_k] for hits in rows]
        return out[0] if single else out

    def _search_params(self, faiss, depth, ef_search, nprobe, allowed):
        if self.info["kind"] == "hnsw":
            params = faiss.SearchParametersHNSW()
            params.efSearch = max(depth, positive_int(ef_search, "ef_search") if ef_search else DEFAULT_EF_SEARCH)
        elif self.info["kind"] == "ivf":
            params = faiss.SearchParametersIVF()
            params.nprobe = min(self.info["nlist"], positive_int(nprobe, "nprobe") if nprobe
                                else default_nprobe(self.info["nlist"]))
        else:
            params = faiss.SearchParameters()
        if allowed is not None:  # FAISS skips the positions whose bit is 0
            bits = np.packbits(allowed, bitorder="little")
            selector = faiss.IDSelectorBitmap(len(allowed), faiss.swig_ptr(bits))
            params.sel = selector
            params.kept_alive = (selector, bits)  # SWIG holds raw pointers to both: they live with the parameters
        return params

    def _dense_search(self, allowed, live, params):
        """A function (query vectors, k) -> (scores, positions) `[queries, k]` over the allowed texts."""
        if allowed is not None and self.info["kind"] != "flat" and live <= EXACT_FILTERED:
            positions = np.flatnonzero(allowed)
            stored = self._vectors(positions) if live else np.zeros((0, self.info["dimension"]), np.float32)

            def exact(vectors, k):
                scores = vectors @ stored.T
                best = np.argsort(-scores, axis=1, kind="stable")[:, :k]
                return np.take_along_axis(scores, best, axis=1), positions[best]
            return exact
        return lambda vectors, k: self.index.search(vectors, k, params=params)

    def similarities(self, query_vector: np.ndarray, ids) -> np.ndarray:
        """The cosine of one query vector `[dim]` with the stored vectors of the texts `ids` `[len(ids)]`: the
        scores `search` gives them, for texts a search did not return (`kbert.hybrid_search`)."""
        query = unit_rows(np.atleast_2d(np.asarray(query_vector, np.float32)))[0]
        positions = self.positions_of(ids)
        if not len(positions):
            return np.zeros(0, np.float32)
        return self._vectors(positions) @ query

    def lexical_rows(self):
        """(the fitted character n-gram TF-IDF vectorizer, its CSR rows of the texts `[count, n-grams]`) of an
        index built with lexical=True."""
        if self._lexical is None:
            if not self.info.get("lexical") or self.path is None:
                raise ValueError("this index keeps no lexical rows: build it with lexical=True")
            self._lexical = _read_lexical(self.path, self.info["count"])
        return self._lexical

    def _hybrid(self, texts, vectors, depth, weight, dense, allowed):
        """Per query, (scores, positions) of the `depth` best by the hybrid score over the union of the
        vectors' and the n-grams' first `depth` allowed texts."""
        vectorizer, rows = self.lexical_rows()
        count = rows.shape[0]
        dense_positions = None
        if weight < 1:
            dense_positions = dense(vectors, depth)[1]
        step = max(1, _MAX_LEXICAL_SCORES // max(count, 1))
        out = []
        for first in range(0, len(texts), step):
            lex = np.asarray((vectorizer.transform(texts[first:first + step]) @ rows.T).todense(), np.float32)
            for i, scores in enumerate(lex):
                row = first + i
                ranked = scores if allowed is None else np.where(allowed, scores, -np.inf)
                proposed = np.argpartition(-ranked, depth - 1)[:depth] if depth < count else np.arange(count)
                if allowed is not None:
                    proposed = proposed[allowed[proposed]]
                if weight < 1:
                    mine = dense_positions[row][dense_positions[row] >= 0]
                    union = np.union1d(proposed, mine)
                    cosine = self._vectors(union) @ vectors[row]
                    mixed = (1 - weight) * cosine + weight * scores[union]
                else:
                    union, mixed = proposed, scores[proposed]
                best = np.argsort(-mixed, kind="stable")[:depth]
                out.append((mixed[best], union[best]))
        return out

    def _vectors(self, positions: np.ndarray) -> np.ndarray:
        """The stored (unit) vectors at `positions` `[len, dim]` (decoded from float16 / int8 storage)."""
        faiss = _faiss()
        if self.info["kind"] == "ivf":
            with self._lock:  # a server's threads may meet the first filtered search together
                ivf = faiss.extract_index_ivf(self.index)
                if ivf.direct_map.type == faiss.DirectMap.NoMap:
                    ivf.make_direct_map()  # IVF finds a vector by its position only through this map
        return self.index.reconstruct_batch(np.ascontiguousarray(positions, np.int64))


def rerank_hits(query: str, hits: List[Hit], reranker, candidates: int) -> List[Hit]:
    """`hits` with the first `candidates` re-scored and re-ordered by a cross-encoder (`kbert.TaskModel`);
    deeper hits keep their first-stage order and scores."""
    head, tail = hits[:candidates], hits[candidates:]
    ranked = reranker.rank(query, [h.text for h in head]) if head else []
    return [head[r["corpus_id"]]._replace(score=float(r["score"])) for r in ranked] + tail


def reorder_hits(hits: List[Hit], scores) -> List[Hit]:
    """`hits` with the first `len(scores)` given those scores (a cross-encoder's, one per hit, computed elsewhere: a
    server's batch) and sorted by them as `rerank_hits` sorts, ties in first-stage order; deeper hits follow."""
    head, tail = hits[:len(scores)], hits[len(scores):]
    order = np.argsort(-np.asarray(scores, np.float64), kind="stable")
    return [head[i]._replace(score=float(scores[i])) for i in order] + tail


def best_of_groups(hits: List[Hit], key: str) -> List[Hit]:
    """The first (best) hit of each value of metadata `key`, in order."""
    seen, out = set(), []
    for hit in hits:
        value = (hit.metadata or {}).get(key, ("no group", hit.id))
        value = json.dumps(value, sort_keys=True, default=str) if isinstance(value, (dict, list)) else value
        if value not in seen:
            seen.add(value)
            out.append(hit)
    return out


def manifest_exists(index_dir: str) -> bool:
    """Whether `index_dir` holds a finished kbert index."""
    return os.path.isfile(os.path.join(index_dir, MANIFEST))


def _fit_lexical(texts: Sequence[str]):
    """(vectorizer, CSR rows) of character n-gram TF-IDF fitted on `texts` (kbert.embed.lexical's)."""
    import scipy.sparse

    from kbert.embed.lexical import char_tfidf

    vectorizer = char_tfidf(texts)
    if vectorizer is None:
        raise ValueError("lexical=True needs texts with characters to count; these are all blank")
    return vectorizer, scipy.sparse.csr_matrix(vectorizer.transform(texts), dtype=np.float32)


def _save_lexical(out_dir: str, vectorizer, rows) -> None:
    import scipy.sparse

    vocabulary = {gram: int(col) for gram, col in vectorizer.vocabulary_.items()}
    write_json(os.path.join(out_dir, LEXICAL_VOCABULARY), vocabulary)
    write_atomic(os.path.join(out_dir, LEXICAL_IDF), lambda tmp: save_npy(tmp, vectorizer.idf_))

    def write(tmp):
        with open(tmp, "wb") as f:
            scipy.sparse.save_npz(f, rows)
    write_atomic(os.path.join(out_dir, LEXICAL_MATRIX), write)


def _write_lexical(out_dir: str, texts: Sequence[str]) -> None:
    vectorizer, rows = _fit_lexical(texts)
    _save_lexical(out_dir, vectorizer, rows)


def _read_lexical(index_dir: str, count: int):
    """The vectorizer (rebuilt from its n-grams and IDF, no pickle) and the rows of the first `count` texts."""
    import scipy.sparse

    from kbert.embed.lexical import restored_char_tfidf

    with open(os.path.join(index_dir, LEXICAL_VOCABULARY), encoding="utf-8") as f:
        vectorizer = restored_char_tfidf(json.load(f), np.load(os.path.join(index_dir, LEXICAL_IDF)))
    rows = scipy.sparse.load_npz(os.path.join(index_dir, LEXICAL_MATRIX)).tocsr()
    if rows.shape[0] < count:
        raise ValueError(f"{index_dir}: {LEXICAL_MATRIX} holds {rows.shape[0]} texts, the index {count}; build the "
                         f"index again")
    return vectorizer, rows[:count]


def _training_sample(chunk_files: List[str], count: int, centroids: int) -> np.ndarray:
    """Up to TRAIN_PER_CENTROID x `centroids` vectors (at least 10,000 for the int8 ranges), drawn evenly from
    the chunk files without reading them whole."""
    wanted = min(count, max(10_000, TRAIN_PER_CENTROID * centroids))
    rng = np.random.default_rng(0)
    keep = np.sort(rng.choice(count, size=wanted, replace=False))
    parts, start = [], 0
    for base in chunk_files:
        vectors = np.load(base + ".npy", mmap_mode="r")
        mine = keep[(keep >= start) & (keep < start + len(vectors))] - start
        parts.append(np.asarray(vectors[mine], np.float32))
        start += len(vectors)
    return np.ascontiguousarray(np.concatenate(parts))


def open_index(index_dir_or_index: Union[str, SearchIndex], model=None) -> SearchIndex:
    """A SearchIndex as given, or loaded from its dir (`kbert.embed.sparse_index.load_index` reads either kind)."""
    if isinstance(index_dir_or_index, SearchIndex):
        return index_dir_or_index
    return SearchIndex.load(index_dir_or_index, model=model)
