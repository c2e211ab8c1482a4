"""`pretraining_dataset(...)`: the one function trainers call for masked-LM (+ NSP / SOP) batches.

Sources:
- raw text: anything `kbert.corpus` takes (a path, glob, recipe name, list, or a `Corpus`): read, cleaned,
  tokenized and paired by worker processes (`kbert.data.examples`), new pairs every epoch;
- a records directory written by `kbert data prepare` (`kbert.data.records`): streamed with interleave,
  shuffle and prefetch; the fast path for real pretraining;
- `"dummy"`: random token ids generated in the graph (benchmarks, tests, memory probes).

Every batch is masked in the graph (`kbert.data.masking`); an example's mask depends only on the seed and
its index in the stream, so it does not change with the batch size or the number of replicas. Batches are
`(features, labels)`: features `token_ids`, `segment_ids`, `padding_mask` (int32 [b, seq]) and
`mask_positions` (int32 [b, p]); labels `mask_ids`, `mask_weights` ([b, p]) and, for NSP / SOP,
`pair_labels` ([b]; 1 = random next segment / swapped order). With a `tf.distribute.InputContext` each input
pipeline reads its own shards (records), blocks (raw text) or random stream (dummy), and `batch_size` is the
global batch.
"""

from __future__ import annotations

import sys
from typing import Optional

from kbert.data.corpus import Corpus, CorpusReport
from kbert.utils import positive_int, renamed_keyword
from kbert.data.examples import (ExampleBuilder, block_seed, example_blocks, resolve_workers, start_pool, stop_pool,
                                 warn_if_mostly_padding)
from kbert.data.masking import default_max_predictions, example_keys, make_spec, mask_tokens, regular_token_ids
from kbert.data.pairs import check_objective
from kbert.data import records as _records


def pretraining_dataset(source, tokenizer, objective: str = "mlm+nsp", max_length: int = 128,
                        batch_size: int = 32, mask_rate: float = 0.15, max_predictions: Optional[int] = None,
                        whole_word: bool = True, ngram: int = 1, short_seq_prob: float = 0.1, seed: int = 0,
                        shuffle_buffer: int = 10_000, repeat: bool = True, start_batch: int = 0,
                        input_context=None, workers: Optional[int] = None, docs_per_block: int = 256,
                        report: Optional[CorpusReport] = None, drop_remainder: bool = True,
                        max_seq_len: Optional[int] = None, join_documents: bool = False):
    """A `tf.data.Dataset` of masked pretraining batches `(features, labels)` (see the module docstring).

    Args:
        source: raw text (path / recipe / Corpus), a records directory, or "dummy".
        tokenizer: a `kbert.Tokenizer` (for records, the one that prepared them: checked by fingerprint).
        objective: "mlm", "mlm+nsp" (BERT) or "mlm+sop" (ALBERT). For records, taken from the records.
        max_length: tokens per sequence with [CLS]/[SEP]. For records, taken from the records.
        batch_size: global batch size (divided by the replicas when `input_context` is given).
        mask_rate, max_predictions, whole_word, ngram: masking (default max_predictions:
            round(max_length * mask_rate) + 1, e.g. 20 for 128).
        short_seq_prob: probability of a shorter random target length (raw text only).
        seed: fixes pairs, shuffling and masks; masks still differ between epochs.
        shuffle_buffer: examples in the shuffle buffer (0 turns shuffling off).
        repeat: loop forever (pretraining) or stop after one pass.
        start_batch: skip this many batches (resume: the masks of later batches are unchanged).
        input_context: a `tf.distribute.InputContext` (from `distribute_datasets_from_function`).
        workers: processes for raw text (None: all cores; 0: this process). They are spawned, so a script
            that uses them needs `if __name__ == "__main__":` (without it, `kbert.workers.WorkerError` says so).
        report: a `CorpusReport` filled while raw text is read.
        join_documents: join consecutive short documents until each fills a sequence (raw text only; for
            corpora of short texts such as reviews or comments, `kbert.data.pairs`). Off, a source whose
            examples are mostly padding gets a warning that says so.
    """
    max_length = renamed_keyword("max_seq_len", max_seq_len, "max_length", max_length, 128)
    import tensorflow as tf

    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer. Received: batch_size={batch_size!r}")
    if isinstance(shuffle_buffer, bool) or not isinstance(shuffle_buffer, int) or shuffle_buffer < 0:
        raise ValueError(f"`shuffle_buffer` must be an integer, 0 (no shuffling) or more. "
                         f"Received: shuffle_buffer={shuffle_buffer!r}")
    docs_per_block = positive_int(docs_per_block, "docs_per_block")
    num_pipelines, pipeline_id = 1, 0
    if input_context is not None:
        num_pipelines, pipeline_id = input_context.num_input_pipelines, input_context.input_pipeline_id
        batch_size = input_context.get_per_replica_batch_size(batch_size)
    stream_seed = block_seed(seed, 0, pipeline_id)

    if isinstance(source, str) and source == "dummy":
        check_objective(objective)
        examples = _dummy_examples(tokenizer, objective, max_length, stream_seed)
    elif _records.records_dir(source):
        source = _records.records_dir(source)
        manifest, files = _records.shard_files(source)
        _records.check_joined(manifest, join_documents, source)
        if manifest["tokenizer"] != tokenizer.fingerprint():
            raise ValueError(f"{source!r} was prepared with another tokenizer (fingerprint {manifest['tokenizer']}, "
                             f"this one is {tokenizer.fingerprint()}); pass the tokenizer used by `kbert data prepare`")
        for name, value in (("objective", objective), ("max_length", max_length)):
            if value != manifest[name] and value != _parameter_default(name):
                raise ValueError(f"`{name}`={value!r} differs from the records' {name} {manifest[name]!r}; "
                                 f"prepare new records or leave `{name}` at its default")
        objective, max_length = manifest["objective"], manifest["max_length"]
        if len(files) < num_pipelines:
            raise ValueError(f"{source!r} has {len(files)} shards for {num_pipelines} input pipelines; prepare "
                             f"with smaller --docs-per-shard so every worker gets a shard")
        examples = _record_examples(files, max_length, num_pipelines, pipeline_id, seed, stream_seed, repeat,
                                    shuffle_buffer)
        repeat = shuffle_buffer = 0  # both done above
    else:
        check_objective(objective)
        corpus = source if isinstance(source, Corpus) else Corpus(source)
        builder = ExampleBuilder(corpus, tokenizer, objective, max_length, short_seq_prob,
                                 join_documents=join_documents)
        workers = resolve_workers(workers)
        # one pool for every epoch, started first: the workers spawn while this process checks the source
        pool = start_pool(builder, workers) if workers else None
        try:
            _check_yields_examples(builder, seed, docs_per_block)
        except BaseException:
            if pool is not None:
                stop_pool(pool)
            raise
        examples = _raw_examples(builder, seed, workers, docs_per_block, num_pipelines, pipeline_id,
                                 report, max_length, repeat, pool)
        repeat = False

    if max_predictions is None:
        max_predictions = default_max_predictions(max_length, mask_rate)
    if max_predictions > max_length:
        raise ValueError(f"`max_predictions` ({max_predictions}) cannot exceed `max_length` ({max_length})")
    spec = make_spec(tokenizer, mask_rate, max_predictions, whole_word, ngram)
    pair = objective != "mlm"
    if repeat:
        examples = examples.repeat()
    if shuffle_buffer:
        examples = examples.shuffle(shuffle_buffer, seed=stream_seed % (2 ** 31))
    ds = examples.enumerate().batch(batch_size, drop_remainder=drop_remainder)
    if start_batch:
        ds = ds.skip(start_batch)
    pad_id = tokenizer.pad_id

    def finish(index, batch):
        ids, lengths, num_a, pair_labels = batch  # index: [b] example indices in the stream
        positions = tf.range(max_length)[None, :]
        real = positions < lengths[:, None]
        ids = tf.where(real, ids, pad_id)
        segment_ids = tf.cast((positions >= num_a[:, None]) & real, tf.int32)
        masked, mask_positions, mask_ids, mask_weights = mask_tokens(
            ids, real, example_keys(stream_seed, index), spec)
        features = {"token_ids": masked, "segment_ids": segment_ids, "padding_mask": tf.cast(real, tf.int32),
                    "mask_positions": mask_positions}
        labels = {"mask_ids": mask_ids, "mask_weights": mask_weights}
        if pair:
            labels["pair_labels"] = pair_labels
        return features, labels

    return ds.map(finish, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).prefetch(tf.data.AUTOTUNE)


def _parameter_default(name: str):
    import inspect

    return inspect.signature(pretraining_dataset).parameters[name].default


def _signature(max_length):
    import tensorflow as tf

    return (tf.TensorSpec([None, max_length], tf.int32), tf.TensorSpec([None], tf.int32),
            tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32))


def _check_yields_examples(builder: ExampleBuilder, seed: int, docs_per_block: int):
    """Fails at construction, with the cleaning report, when the source has no usable examples (instead of
    a dataset that repeats nothing forever). Small blocks: this runs in the caller's process before the
    workers take over, and usually the first few documents settle it."""
    report = CorpusReport()
    for _, block in example_blocks(builder, seed, 0, 0, min(docs_per_block, 16), report):
        if len(block["lengths"]):
            warn_if_mostly_padding(int(block["lengths"].sum()), len(block["lengths"]), builder.max_length,
                                   builder.join_documents)
            return
    raise ValueError(f"{builder.corpus!r} gives no pretraining examples for objective={builder.objective!r} "
                     f"(NSP/SOP need documents with at least two tokens): {report}")


def _raw_examples(builder, seed, workers, docs_per_block, num_pipelines, pipeline_id, report, max_length, repeat,
                 pool):
    import tensorflow as tf

    def generate(epoch):
        for _, block in example_blocks(builder, seed, int(epoch), workers, docs_per_block, report,
                                       keep=lambda i: i % num_pipelines == pipeline_id, pool=pool):
            yield block["token_ids"], block["lengths"], block["num_a"], block["pair_labels"]

    epochs = tf.data.Dataset.range(sys.maxsize if repeat else 1)
    blocks = epochs.flat_map(lambda e: tf.data.Dataset.from_generator(
        generate, args=(e,), output_signature=_signature(max_length)))
    return blocks.unbatch()


def _record_examples(files, max_length, num_pipelines, pipeline_id, seed, stream_seed, repeat, shuffle_buffer):
    """Examples of the records in the order `kbert.data.record_reader.examples` defines (files by a hash per
    epoch, interleaved, shuffled in hashed blocks), so the numpy reader gives the same batches."""
    import tensorflow as tf

    from kbert.data.masking import order
    from kbert.data.record_reader import BLOCK, CYCLE

    files = tf.constant(list(files)[pipeline_id::num_pipelines])
    n = int(files.shape[0])
    epochs = tf.data.Dataset.range(2 ** 62 if repeat else 1)
    if shuffle_buffer:
        ds = epochs.flat_map(lambda e: tf.data.Dataset.from_tensor_slices(tf.gather(files, order(seed, 5, e, n))))
    else:
        ds = epochs.flat_map(lambda e: tf.data.Dataset.from_tensor_slices(files))
    ds = ds.interleave(lambda f: tf.data.TFRecordDataset(f), cycle_length=min(n, CYCLE), block_length=BLOCK,
                       num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    # parse in batches (much faster than per record)
    ds = ds.batch(1024).map(lambda s: _records.parse_batch(s, max_length), num_parallel_calls=tf.data.AUTOTUNE,
                            deterministic=True).unbatch()
    if shuffle_buffer:  # consecutive blocks of shuffle_buffer examples, each in a hashed order
        def permute(block, examples):
            index = order(stream_seed, 6, block, tf.shape(examples[1])[0])
            return tuple(tf.gather(x, index) for x in examples)

        ds = ds.batch(shuffle_buffer).enumerate().map(permute, num_parallel_calls=tf.data.AUTOTUNE,
                                                       deterministic=True).unbatch()
    return ds


def _dummy_examples(tokenizer, objective, max_length, seed):
    """Random sequences with realistic lengths (half to full) and two segments, generated in the graph."""
    import tensorflow as tf

    regular = regular_token_ids(tokenizer.vocab_size, tokenizer.special_ids.values())
    cls_id, sep_id, pair = tokenizer.cls_id, tokenizer.sep_id, objective != "mlm"

    def make(index):
        s = tf.stack([tf.constant(seed, tf.int64), index])
        seeds = tf.random.experimental.stateless_split(s, 3)
        length = tf.random.stateless_uniform([], seeds[0], max_length // 2, max_length + 1, tf.int32)
        ids = tf.gather(regular, tf.random.stateless_uniform([max_length], seeds[1], 0, len(regular), tf.int32))
        positions = tf.range(max_length)
        num_a = length // 2 if pair else length
        ids = tf.where(positions == 0, cls_id, ids)
        ids = tf.where((positions == length - 1) | ((positions == num_a - 1) & pair), sep_id, ids)
        label = tf.random.stateless_uniform([], seeds[2], 0, 2, tf.int32) if pair else tf.constant(0)
        return ids, length, num_a, label

    return tf.data.Dataset.range(sys.maxsize).map(make, num_parallel_calls=tf.data.AUTOTUNE)
