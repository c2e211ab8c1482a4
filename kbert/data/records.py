"""TFRecord shards of tokenized, unmasked segment pairs: parallel, resumable writing and streaming reads.

A records directory holds `shard-00000.tfrecord`, ... and `manifest.json` (the settings, the tokenizer's
fingerprint, and for every finished shard its example count, byte size and cleaning report). Each shard's
records are tokenized, serialized and framed by a worker process and written by the calling process to a
temporary name, renamed when complete; the manifest is rewritten after every shard, so an interrupted
`kbert data prepare` loses at most the shards in flight: run it again and it skips every shard already
listed (the corpus is re-read, but not re-tokenized).

Each record is a `tf.train.Example` with `token_ids` (little-endian int32 bytes of `[CLS] A [SEP] B [SEP]`),
`num_a` (tokens up to and including the first [SEP]) and `pair_label`. Masking is not stored: it is drawn
at read time (`kbert.data.masking`).

No TensorFlow is needed to write them: the three protobuf fields and the TFRecord framing (length, data, each
with its masked CRC-32C) are encoded here, byte for byte what `tf.io.TFRecordWriter` writes (tests compare the
files). So `kbert data prepare` runs on a JAX host without TensorFlow, and its workers never import
TensorFlow. The checksum is google-crc32c's (the C library Google's own storage clients use, with a
pure-Python fallback): a Castagnoli CRC in Python bytes loops would cost more than the tokenization.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
from typing import Optional

from kbert.data.corpus import Corpus, CorpusReport
from kbert.data.examples import ExampleBuilder, check_short_seq_prob, example_blocks, warn_if_mostly_padding
from kbert.data.pairs import check_max_length, check_objective
from kbert.utils import positive_int, progress_bar, renamed_keyword, write_atomic, writing_to
from kbert.workers import refuse_in_spawn_bootstrap

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
SETTINGS = ("tokenizer", "vocab_size", "objective", "max_length", "short_seq_prob", "seed", "docs_per_shard",
            "sources", "format", "join_documents")
# what records written before a setting existed were made with ("format": the corpus's, None = from file names)
SETTING_DEFAULTS = {"join_documents": False, "format": None}


def records_dir(source) -> Optional[str]:
    """The records dir `source` names (a path, or a list holding exactly one path, as `--corpus DIR` gives),
    or None when it names none. A list that mixes a records dir with other sources is refused."""
    items = list(source) if isinstance(source, (list, tuple)) else [source]
    found = [os.fspath(x) for x in items if isinstance(x, (str, os.PathLike))
             and os.path.isfile(os.path.join(os.fspath(x), MANIFEST))]
    if found and len(items) > 1:
        raise ValueError(f"`data.source` mixes a records dir ({found[0]!r}) with other sources ({len(items)} in all); "
                         f"train from the records dir alone, or prepare one records dir from all the raw text")
    return found[0] if found else None


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.tfrecord"


def _varint(n: int) -> bytes:
    n &= 0xFFFFFFFFFFFFFFFF  # int64 as protobuf encodes it (a negative value takes 10 bytes)
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (`tag` = field number << 3 | 2)."""
    return bytes([tag]) + _varint(len(payload)) + payload


def _entry(key: bytes, feature: bytes) -> bytes:  # one `Features.feature` map entry: key = 1, value = 2
    return _field(0x0A, _field(0x0A, key) + _field(0x12, feature))


def serialize_example(token_ids: bytes, num_a: int, pair_label: int) -> bytes:
    """The bytes of `tf.train.Example` with features `token_ids` (bytes_list), `num_a` and `pair_label`
    (int64_list), encoded without TensorFlow. Example.features = 1; Features.feature = 1 (a map);
    Feature.bytes_list = 1, Feature.int64_list = 3; BytesList.value = 1; Int64List.value = 1 (packed)."""
    entries = (_entry(b"token_ids", _field(0x0A, _field(0x0A, token_ids)))
               + _entry(b"num_a", _field(0x1A, _field(0x0A, _varint(num_a))))
               + _entry(b"pair_label", _field(0x1A, _field(0x0A, _varint(pair_label)))))
    return _field(0x0A, entries)


def _masked_crc(data: bytes) -> bytes:
    """TFRecord's checksum: CRC-32C rotated right by 15 bits plus a constant, little-endian uint32."""
    import google_crc32c

    crc = google_crc32c.value(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def frame_record(record: bytes) -> bytes:
    """One TFRecord: uint64 length, its masked CRC, the data, the data's masked CRC (little-endian)."""
    length = struct.pack("<Q", len(record))
    return length + _masked_crc(length) + record + _masked_crc(record)


class ShardWriter:
    """Calling it (in a worker) serializes one block of examples; `write` (in the calling process) writes
    them to the block's shard file, atomically."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def __call__(self, index: int, block) -> dict:
        records = [frame_record(serialize_example(ids[:n].astype("<i4").tobytes(), int(a), int(label)))
                   for ids, n, a, label in zip(block["token_ids"], block["lengths"], block["num_a"],
                                               block["pair_labels"])]
        return {"data": b"".join(records), "examples": len(records), "tokens": int(block["lengths"].sum())}

    def write(self, index: int, shard: dict) -> dict:
        path = os.path.join(self.out_dir, shard_name(index))
        write_atomic(path, lambda tmp: pathlib.Path(tmp).write_bytes(shard["data"]))
        entry = {"file": shard_name(index), "examples": shard["examples"], "bytes": os.path.getsize(path),
                 "tokens": shard["tokens"]}
        if "report" in shard:  # what cleaning its documents counted: a resumed run adds it back
            entry["report"] = shard["report"]
        return entry


def _write_json(path: str, obj):
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1, ensure_ascii=False)

    write_atomic(path, write)


def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory!r} is not a kbert records directory (no {MANIFEST}); "
                                f"make one with `kbert data prepare`")
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported format_version {manifest.get('format_version')!r}")
    if "max_seq_len" in manifest:  # records written before the setting was named max_length
        manifest["max_length"] = manifest.pop("max_seq_len")
    return manifest


def prepare(source, tokenizer, out_dir: str, objective: str = "mlm+nsp", max_length: int = 128,
            short_seq_prob: float = 0.1, seed: int = 0, docs_per_shard: int = 1024, workers: Optional[int] = None,
            overwrite: bool = False, progress: bool = True, max_seq_len: Optional[int] = None,
            join_documents: bool = False) -> dict:
    """Writes tokenized segment pairs of `source` (anything `kbert.corpus` takes, or a Corpus) to sharded
    TFRecords in `out_dir`, on all cores. Re-running on the same directory resumes: finished shards are
    kept. Returns the manifest (with the cleaning report). (`max_seq_len` is the deprecated name of
    `max_length`.)"""
    # a worker re-running an unguarded script would get here first: it must not touch the parent's shards
    refuse_in_spawn_bootstrap("kbert.data.records.prepare")
    max_length = renamed_keyword("max_seq_len", max_seq_len, "max_length", max_length, 128)
    # before the manifest records them: a rerun with the setting put right found "different settings"
    check_objective(objective)
    max_length = check_max_length(max_length, objective)
    short_seq_prob = check_short_seq_prob(short_seq_prob)
    docs_per_shard = positive_int(docs_per_shard, "docs_per_shard")
    corpus = source if isinstance(source, Corpus) else Corpus(source)
    settings = {"tokenizer": tokenizer.fingerprint(), "vocab_size": tokenizer.vocab_size, "objective": objective,
                "max_length": int(max_length), "short_seq_prob": float(short_seq_prob), "seed": int(seed),
                "docs_per_shard": int(docs_per_shard), "sources": corpus.sources, "format": corpus.format,
                "join_documents": bool(join_documents)}
    with writing_to(out_dir, "kbert data prepare"):  # one writer: two would write the same shards' files
        manifest_path = os.path.join(out_dir, MANIFEST)
        shards = {}
        if os.path.exists(manifest_path) and not overwrite:
            old = read_manifest(out_dir)
            made = {k: old.get(k, SETTING_DEFAULTS.get(k)) for k in SETTINGS}
            changed = [k for k in SETTINGS if made[k] != settings[k]]
            if changed:
                raise ValueError(f"{out_dir!r} holds records made with different settings ({', '.join(changed)}: "
                                 f"{[made[k] for k in changed]} vs {[settings[k] for k in changed]}); use another "
                                 f"directory or overwrite=True (--overwrite)")
            for key, entry in old["shards"].items():
                path = os.path.join(out_dir, entry["file"])
                if os.path.isfile(path) and os.path.getsize(path) == entry["bytes"]:
                    shards[int(key)] = entry
        for name in os.listdir(out_dir):  # leftovers of an interrupted run, and shards not in the manifest
            if name.endswith(".tmp") or (name.startswith("shard-") and int(name[6:11]) not in shards):
                os.remove(os.path.join(out_dir, name))
        manifest = {"format_version": FORMAT_VERSION, **settings, "complete": False,
                    "shards": {str(k): v for k, v in sorted(shards.items())}}
        _write_json(manifest_path, manifest)

        writer = ShardWriter(out_dir)
        builder = ExampleBuilder(corpus, tokenizer, objective, max_length, short_seq_prob, shard_writer=writer,
                                 join_documents=join_documents)
        report = CorpusReport()
        resumed, kept = len(shards), sorted(shards)
        bar = progress_bar(desc="prepare", unit="shard", enabled=progress, initial=resumed)  # rate: this run's shards
        for index, shard in example_blocks(builder, seed, 0, workers, docs_per_shard, report,
                                           keep=lambda i: i not in shards):
            shards[index] = writer.write(index, shard)
            manifest["shards"] = {str(k): v for k, v in sorted(shards.items())}
            _write_json(manifest_path, manifest)
            bar.update(1)
            bar.set_postfix(examples=sum(s["examples"] for s in shards.values()))
        bar.close()
        for index in kept:  # reading counted every document; cleaning and splitting, only the shards built now
            if "report" in shards[index]:
                report.add(CorpusReport(**shards[index]["report"]))
        manifest["examples"] = sum(s["examples"] for s in shards.values())
        if not manifest["examples"]:  # left incomplete: a records dir of nothing would fail later, in training
            hint = (f"; {report.binary_dropped:,} lines were not UTF-8 text (a CP949/EUC-KR file must be converted "
                    f"first, e.g. `iconv -f cp949 -t utf-8 IN > OUT`)" if report.binary_dropped else "")
            raise ValueError(f"{corpus!r} gives no pretraining examples for objective={objective!r} (NSP/SOP need "
                             f"documents with at least two tokens): {report}{hint}")
        tokens = sum(s.get("tokens", 0) for s in shards.values())
        manifest["text_share"] = warn_if_mostly_padding(tokens, manifest["examples"], max_length, join_documents)
        manifest["complete"] = True
        manifest["report"] = report.to_dict()
        manifest["resumed_shards"] = resumed
        _write_json(manifest_path, manifest)
        return manifest


def check_joined(manifest: dict, join_documents: bool, directory: str) -> None:
    """`join_documents` asked of records that were prepared without it: joining happens when records are
    written, so reading cannot do it; say so instead of training on the unjoined examples."""
    if join_documents and not manifest.get("join_documents", False):
        raise ValueError(f"data.join_documents is true but {directory!r} was prepared without it; prepare the "
                         f"records with `kbert data prepare --join-documents` (joining happens when records are "
                         f"written), or leave join_documents false")


def shard_files(directory: str, allow_incomplete: bool = False):
    """The shard paths of a records directory, each checked against the manifest (a truncated or missing
    shard is named in the error instead of surfacing later as a corrupt-record error mid-training)."""
    manifest = read_manifest(directory)
    if not manifest.get("complete") and not allow_incomplete:
        raise ValueError(f"{directory!r}: `kbert data prepare` did not finish; run it again to resume "
                         f"(or pass allow_incomplete=True to read the finished shards)")
    files = []
    for key, entry in sorted(manifest["shards"].items(), key=lambda kv: int(kv[0])):
        path = os.path.join(directory, entry["file"])
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Shard {path!r} listed in the manifest is missing; rerun `kbert data prepare`")
        if os.path.getsize(path) != entry["bytes"]:
            raise ValueError(f"Shard {path!r} is {os.path.getsize(path)} bytes but the manifest says "
                             f"{entry['bytes']}: it is truncated or corrupt; rerun `kbert data prepare` to rewrite it")
        if entry["examples"]:
            files.append(path)
    if not files:
        raise ValueError(f"{directory!r} holds no examples")
    return manifest, files


def parse_batch(serialized, max_length: int):
    """A batch of serialized records -> (token_ids int32 [b, max_length] zero-padded, lengths, num_a,
    pair_labels)."""
    import tensorflow as tf

    parsed = tf.io.parse_example(serialized, {
        "token_ids": tf.io.FixedLenFeature([], tf.string),
        "num_a": tf.io.FixedLenFeature([], tf.int64),
        "pair_label": tf.io.FixedLenFeature([], tf.int64),
    })
    lengths = tf.strings.length(parsed["token_ids"]) // 4
    ids = tf.io.decode_raw(parsed["token_ids"], tf.int32, little_endian=True, fixed_length=4 * max_length)
    return ids, tf.cast(lengths, tf.int32), tf.cast(parsed["num_a"], tf.int32), tf.cast(parsed["pair_label"], tf.int32)
