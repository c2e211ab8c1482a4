"""Corpus -> blocks of unmasked pretraining examples, on all cores.

The main process reads documents (stage 1 of `Corpus`: reading, junk and duplicate removal) and groups
them into blocks of `docs_per_block` documents; worker processes clean them (normalization, sentence
splitting), tokenize them and build NSP/SOP pairs (`pairs.build_examples`). Blocks come back in order,
and each block's random choices are seeded by `(seed, epoch, block index)`, so the output does not
depend on the number of workers. Both `pretraining_dataset` (from raw text) and `kbert data prepare`
(TFRecord shards) use this.
"""

from __future__ import annotations

import collections
import numbers
import os
import warnings
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from kbert import workers as _workers
from kbert.data.corpus import Corpus, CorpusReport
from kbert.data.pairs import build_examples

_STATE = {}


def block_seed(seed: int, epoch: int, block: int) -> int:
    return (int(seed) * 1_000_003 + int(epoch) * 7_919 + int(block)) % (2 ** 63)


def check_short_seq_prob(value, name: str = "short_seq_prob") -> float:
    """`value` as a float when it is a probability, else a ValueError naming `name`: above 1 every target
    was short, below 0 or NaN none was, and nothing said so."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
        raise ValueError(f"`{name}` must be a probability in [0, 1]. Received: {name}={value!r}")
    return float(value)


class ExampleBuilder:
    """Picklable: everything a worker needs to turn raw documents into examples."""

    def __init__(self, corpus: Corpus, tokenizer, objective: str, max_length: int, short_seq_prob: float,
                 shard_writer=None, join_documents: bool = False):
        self.corpus, self.tokenizer = corpus, tokenizer
        self.objective, self.max_length = objective, max_length
        self.short_seq_prob = check_short_seq_prob(short_seq_prob)
        self.join_documents = bool(join_documents)
        self.shard_writer = shard_writer  # set by `kbert data prepare`: workers serialize their shard's records

    def _same_normalization(self) -> bool:
        """True when the corpus already normalized exactly as the tokenizer would (skip doing it twice)."""
        opts, tok = self.corpus.normalize_options, self.tokenizer
        return opts is not None and (opts.get("form", "NFC"), opts.get("repeat"), opts.get("lowercase", False)) == (
            tok.form, tok.repeat, tok.lowercase)

    def __call__(self, raw_docs: List[List[str]], seed: int, index: int = 0) -> Tuple[Dict, CorpusReport]:
        report = CorpusReport()
        docs = [d for d in (self.corpus.clean(lines, report) for lines in raw_docs) if d]
        sentences = [s for d in docs for s in d]
        ids = self.tokenizer.ids_batch(sentences, normalized=self._same_normalization())
        token_docs, i = [], 0
        for d in docs:
            token_docs.append(ids[i:i + len(d)])
            i += len(d)
        tok = self.tokenizer
        block = build_examples(token_docs, self.objective, self.max_length, tok.cls_id, tok.sep_id, tok.pad_id,
                               short_seq_prob=self.short_seq_prob, seed=seed, join_documents=self.join_documents)
        if self.shard_writer is not None:  # the block's own counts go into its shard's manifest entry
            return dict(self.shard_writer(index, block), report=report.to_dict()), report
        return block, report


MOSTLY_PADDING = 0.5  # below this share of text tokens in the examples, say how to fill the sequences


def warn_if_mostly_padding(tokens: int, examples: int, max_length: int, joined: bool) -> float:
    """Warns when examples are mostly padding (short documents: reviews, comments), which spends most of
    every step's compute on nothing; returns the share of text tokens."""
    share = tokens / max(1, examples * max_length)
    if share < MOSTLY_PADDING and not joined:
        warnings.warn(f"the pretraining examples are {100 * share:.0f}% text and {100 * (1 - share):.0f}% padding "
                      f"(about {tokens / max(1, examples):.0f} of {max_length} tokens): the documents are short. "
                      f"data.join_documents=true (kbert data prepare --join-documents) joins consecutive short "
                      f"documents until each fills a sequence; or use a smaller data.max_length", stacklevel=3)
    return share


def _init_worker(builder):
    # No TensorFlow is needed here: tokenizing uses SentencePiece or kbert's Python WordPiece, and `kbert data
    # prepare` serializes records by hand (the calling process writes them). Should a tokenizer import it
    # anyway, one thread per worker: the workers are the parallelism.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
    os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
    _STATE["builder"] = builder


def _run_block(args):
    index, raw_docs, seed = args
    return index, _STATE["builder"](raw_docs, seed, index)


def raw_blocks(corpus: Corpus, docs_per_block: int, report: CorpusReport) -> Iterator[List[List[str]]]:
    block = []
    for lines in corpus.raw_documents(report):
        block.append(lines)
        if len(block) >= docs_per_block:
            yield block
            block = []
    if block:
        yield block


def resolve_workers(workers: Optional[int]) -> int:
    if workers is None:
        return os.cpu_count() or 1
    if not isinstance(workers, int) or workers < 0:
        raise ValueError(f"`workers` must be None (all cores) or an integer >= 0. Received: workers={workers!r}")
    return workers


def start_pool(builder: ExampleBuilder, workers: int):
    """Worker processes for `example_blocks(pool=...)`, started now (spawning and importing take seconds:
    start them while the rest of the input pipeline is being built, and keep them across epochs)."""
    # spawned: never fork a process that has TensorFlow's threads running
    return _workers.start(workers, _init_worker, (builder,))


def stop_pool(pool) -> None:
    """Stops a pool from `start_pool` now (running blocks are abandoned)."""
    _workers.stop(pool)


def example_blocks(builder: ExampleBuilder, seed: int, epoch: int = 0, workers: Optional[int] = None,
                   docs_per_block: int = 256, report: Optional[CorpusReport] = None,
                   keep=lambda index: True, pool=None) -> Iterator[Tuple[int, Dict[str, np.ndarray]]]:
    """Yields `(block index, block)` in order. `keep(index)` decides which blocks are built at all (used for
    per-worker sharding and for skipping finished shards on resume); skipped blocks are still read so
    block indices stay stable. `workers=0` builds in this process; `pool` (from `start_pool`) is used and
    left running when given."""
    report = CorpusReport() if report is None else report
    workers = resolve_workers(workers)
    tasks = ((i, raw, block_seed(seed, epoch, i))
             for i, raw in enumerate(raw_blocks(builder.corpus, docs_per_block, report)) if keep(i))
    if workers == 0:
        for i, raw, s in tasks:
            block, r = builder(raw, s, i)
            report.add(r)  # clean() counts emptied documents down from `documents`
            yield i, block
        return
    own = pool is None
    pool = start_pool(builder, workers) if own else pool
    try:
        pending = collections.deque()
        for task in tasks:  # at most 2 blocks per worker in flight: a huge corpus is never read ahead
            pending.append(_workers.submit(pool, _run_block, task, where="while building pretraining examples"))
            while len(pending) >= 2 * workers:
                yield _collect(pending.popleft(), report)
        while pending:
            yield _collect(pending.popleft(), report)
    finally:
        if own:
            stop_pool(pool)


def _collect(result, report: CorpusReport):
    i, (block, r) = _workers.result(result, "while building pretraining examples")
    report.add(r)
    return i, block
