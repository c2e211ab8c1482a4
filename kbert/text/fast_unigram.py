"""The in-graph path for unigram SentencePiece models: tensorflow-text's `FastSentencepieceTokenizer`, made to
give sentencepiece's own ids.

The fast op runs the same Viterbi as sentencepiece >= 0.2.2's encoder (float32 scores, candidates in the same
order, a strict comparison), so on the models it reads as sentencepiece does it gives sentencepiece's ids, ties
between equal-score segmentations included (the check over a whole review corpus is in benchmarks/README.md).
Where the two differ, this module steps in:
- the fast op has no byte fallback and scores an unknown character per byte, so lines with characters outside
  the vocabulary are encoded again with a placeholder piece scored as sentencepiece's unknown node
  (`_unknown_rows`), whose id then becomes the character's byte pieces or [UNK];
- sentencepiece rebases its running score past |1e5| and the op does not, so lines that long go to a slower
  exact path the caller gives (`fast_unigram_ids`'s `slow`).
A model qualifies when the op reads it as sentencepiece does: unigram, no precompiled normalization map (kbert
normalizes first), no unused pieces, and every character of a piece is a piece of its own (so sentencepiece
scores an unknown character only where no piece could cover it).

A model with a precompiled normalization map (ALBERT, KoBERT, XLM-RoBERTa's `nmt_nfkc`) is not read exactly:
the op applies the map itself, but the placeholder re-encoding above is defined on characters as the
vocabulary spells them, which the map changes. In a graph that may call Python such models run sentencepiece
itself; in a portable graph (a SavedModel) the choice is between this op without the re-encoding
(`allow_map=True`: the long-line threshold a quarter of the usual one, since the map can lengthen a line)
and tensorflow-text's SentencePiece op, whose ties between equal-score segmentations differ from
sentencepiece's on runs like `.......`; the fast op is the closer of the two (benchmarks/README.md, the
XLM-RoBERTa rows of the sentence-embedding section).

`kbert.text.tokenizer.Tokenizer` is the only caller; everything here works on tensors of normalized text.
"""

from __future__ import annotations

import numpy as np


def fast_unigram_ids(parts, normalized, add_special_tokens: bool, slow):
    """Ids of a 1-D batch of normalized strings (ragged int32 [batch, (n)]) from the fast unigram op.

    `parts`: `fast_unigram_parts(...)`; lines with characters outside the vocabulary are encoded again in
    the graph (`_unknown_rows`); lines longer than `parts["max_bytes"]` (none in ordinary text) go to
    `slow(texts)`, which returns their (flat int32 ids, int64 row lengths)."""
    import tensorflow as tf

    key = "special" if add_special_tokens else "plain"
    ids = parts[key].tokenize(normalized)
    values, splits = ids.values, tf.cast(ids.row_splits, tf.int64)
    count = tf.concat([[0], tf.cumsum(tf.cast(tf.gather(parts["bad"], values), tf.int32))], 0)
    long = tf.strings.length(normalized) > parts["max_bytes"]
    unknown = tf.logical_and(tf.gather(count, splits[1:]) > tf.gather(count, splits[:-1]), tf.logical_not(long))
    rows_u, rows_l = tf.where(unknown)[:, 0], tf.where(long)[:, 0]
    flat_u, lengths_u = _unknown_rows(parts, key, tf.gather(normalized, rows_u))
    texts_l = tf.gather(normalized, rows_l)
    flat_l, lengths_l = tf.cond(tf.size(rows_l) > 0, lambda: slow(texts_l),
                                lambda: (tf.zeros([0], tf.int32), tf.zeros([0], tf.int64)))
    rows = tf.concat([rows_u, rows_l], 0)
    other_values, other_lengths = tf.concat([flat_u, flat_l], 0), tf.concat([lengths_u, lengths_l], 0)
    # Row i of the result: row i of `ids`, or for a redone line its row of `other`. Every output value
    # is gathered from [ids.values; other values] at its position plus its row's shift.
    other_starts = tf.cumsum(other_lengths, exclusive=True)
    lengths = tf.tensor_scatter_nd_update(splits[1:] - splits[:-1], rows[:, None], other_lengths)
    base = tf.tensor_scatter_nd_update(splits[:-1], rows[:, None],
                                       tf.size(values, out_type=tf.int64) + other_starts)
    shift = tf.repeat(base - tf.cumsum(lengths, exclusive=True), lengths)
    out = tf.gather(tf.concat([values, other_values], 0), tf.range(tf.size(shift, out_type=tf.int64)) + shift)
    return tf.RaggedTensor.from_row_lengths(out, lengths, validate=False)


def add_specials(ids, cls_id: int, sep_id: int):
    """[CLS] + row + [SEP] for every row of a ragged [batch, (n)] int32 tensor."""
    import tensorflow as tf

    n = ids.nrows()
    cls = tf.RaggedTensor.from_tensor(tf.fill([n, 1], tf.constant(cls_id, tf.int32)))
    sep = tf.RaggedTensor.from_tensor(tf.fill([n, 1], tf.constant(sep_id, tf.int32)))
    return tf.concat([cls.with_row_splits_dtype(ids.row_splits.dtype), ids,
                      sep.with_row_splits_dtype(ids.row_splits.dtype)], axis=1)


def specials_as_bos_eos(proto, cls_id: int, sep_id: int):
    """Points a ModelProto's BOS/EOS at [CLS]/[SEP], so an op that adds BOS/EOS adds them."""
    spec = proto.trainer_spec
    spec.bos_id, spec.bos_piece = cls_id, proto.pieces[cls_id].piece
    spec.eos_id, spec.eos_piece = sep_id, proto.pieces[sep_id].piece


def is_unigram(model: bytes) -> bool:
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model)
    return proto.trainer_spec.model_type == sentencepiece_model_pb2.TrainerSpec.UNIGRAM


def fast_unigram_parts(model: bytes, cls_id: int, sep_id: int, allow_map: bool = False):
    """tensorflow-text `FastSentencepieceTokenizer`s for a unigram model they read as sentencepiece does
    (see the module docstring), a table of the ids that send a line to sentencepiece, and the longest
    normalized line (bytes) whose running score stays inside sentencepiece's 1e5 rebasing threshold; or
    None when the model does not qualify. `allow_map`: a model with a precompiled normalization map too,
    without the unknown-character re-encoding (portable graphs only; see the module docstring)."""
    import tensorflow as tf
    import tensorflow_text as tf_text
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(model)
    kinds = pb.ModelProto.SentencePiece
    norm = proto.normalizer_spec
    mapped = bool(norm.precompiled_charsmap)  # the op normalizes with it (see the module docstring)
    if proto.trainer_spec.model_type != pb.TrainerSpec.UNIGRAM or (mapped and not allow_map) \
            or proto.trainer_spec.treat_whitespace_as_suffix or not norm.escape_whitespaces:
        return None
    if any(p.type == kinds.UNUSED for p in proto.pieces):
        return None
    scored = [p for p in proto.pieces if p.type in (kinds.NORMAL, kinds.USER_DEFINED)]
    singles = {p.piece for p in scored if len(p.piece) == 1}
    if not scored or "\u2581" not in singles or any(ch not in singles for p in scored for ch in p.piece):
        return None
    # sentencepiece >= 0.2.2 scores a user-defined piece 0.1 * (bytes - 1) as a float32; the fast op reads
    # the stored score, so the copy it gets carries that score.
    for p in proto.pieces:
        if p.type == kinds.USER_DEFINED:
            p.score = float(np.float32(0.1 * (len(p.piece.encode("utf-8")) - 1)))
    min_score = min((p.score for p in proto.pieces if p.type == kinds.NORMAL), default=0.0)
    per_piece = max(abs(min_score - 10.0), max(abs(p.score) for p in scored))
    bad = np.array([p.type not in (kinds.NORMAL, kinds.USER_DEFINED) and i not in (cls_id, sep_id)
                    and not mapped for i, p in enumerate(proto.pieces)])
    # Lines with a character no piece covers are encoded again with every such character replaced by a
    # placeholder that is a piece scored as sentencepiece scores its unknown node (min score - 10, in
    # float32); the placeholder's id then becomes the character's UTF-8 byte pieces (byte fallback) or
    # [UNK] (runs of them merged into one, as sentencepiece does).
    cps = sorted(ord(c) for c in singles | {" "})
    placeholder = next(chr(c) for c in range(0xF8FF, 0xE000, -1) if chr(c) not in singles)
    unk_id = next(i for i, p in enumerate(proto.pieces) if p.type == kinds.UNKNOWN)
    byte_ids = {p.piece: i for i, p in enumerate(proto.pieces) if p.type == kinds.BYTE}
    byte_table = [byte_ids.get(f"<0x{b:02X}>", -1) for b in range(256)]
    byte_fallback = proto.trainer_spec.byte_fallback and min(byte_table) >= 0
    models = {}
    for key, specials in (("plain", False), ("special", True)):
        if specials:
            specials_as_bos_eos(proto, cls_id, sep_id)
        models[key] = proto.SerializeToString()
        extended = pb.ModelProto()
        extended.CopyFrom(proto)
        extended.pieces.add(piece=placeholder, score=float(np.float32(min_score) - np.float32(10.0)),
                            type=kinds.NORMAL)
        models[key + "_unknown"] = extended.SerializeToString()
    try:
        with tf.init_scope():
            parts = {key: tf_text.FastSentencepieceTokenizer(m, add_bos=key.startswith("special"),
                                                             add_eos=key.startswith("special"))
                     for key, m in models.items()}
            parts.update(bad=tf.constant(bad), max_bytes=(int(0.9e5 / per_piece) - 3) // (4 if mapped else 1),
                         known=_char_class(cps), placeholder=placeholder, placeholder_id=len(proto.pieces),
                         unk_id=unk_id, byte_table=tf.constant(byte_table, tf.int32) if byte_fallback else None)
            return parts
    except Exception:  # a model the converter refuses
        return None


def _char_class(codepoints) -> str:
    """An RE2 character class body (no brackets) for sorted code points, as ranges."""
    ranges, start, prev = [], codepoints[0], codepoints[0]
    for c in codepoints[1:] + [None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        ranges.append(f"\\x{{{start:X}}}" + (f"-\\x{{{prev:X}}}" if prev > start else ""))
        if c is not None:
            start = prev = c
    return "".join(ranges)


def _unknown_rows(parts, key: str, texts):
    """(flat int32 ids, int64 row lengths) for normalized lines holding characters outside the
    vocabulary, as sentencepiece encodes them (see `fast_unigram_parts`)."""
    import tensorflow as tf

    known = parts["known"]
    mapped = tf.strings.regex_replace(texts, f"[^{known}]", parts["placeholder"])
    ids = parts[key + "_unknown"].tokenize(mapped)
    values, rowids = ids.values, tf.cast(ids.value_rowids(), tf.int64)
    is_ph = tf.equal(values, parts["placeholder_id"])
    if parts["byte_table"] is None:  # [UNK], one per run of unknown characters
        previous = tf.concat([[False], is_ph[:-1]], 0)
        same_row = tf.concat([[False], tf.equal(rowids[1:], rowids[:-1])], 0)
        keep = tf.logical_not(tf.logical_and(is_ph, tf.logical_and(previous, same_row)))
        out = tf.where(is_ph, tf.constant(parts["unk_id"], tf.int32), values)
        lengths = tf.math.unsorted_segment_sum(tf.cast(keep, tf.int64), rowids, tf.size(texts, out_type=tf.int64))
        return tf.boolean_mask(out, keep), lengths
    # Byte fallback: the k-th placeholder of the batch is the k-th unknown character of the batch.
    chars = tf.strings.unicode_split(tf.strings.regex_replace(texts, f"[{known}]", ""), "UTF-8").flat_values
    char_bytes = tf.strings.bytes_split(chars)
    byte_ids = tf.gather(parts["byte_table"],
                         tf.cast(tf.reshape(tf.io.decode_raw(char_bytes.flat_values, tf.uint8), [-1]), tf.int32))
    char_len, char_start = char_bytes.row_lengths(), char_bytes.row_splits[:-1]
    rank = tf.maximum(tf.cumsum(tf.cast(is_ph, tf.int64)) - 1, 0)
    width = tf.where(is_ph, _safe_gather(char_len, rank), 1)
    source = tf.repeat(tf.range(tf.size(values, out_type=tf.int64)), width)
    within = tf.range(tf.size(source, out_type=tf.int64)) - tf.repeat(tf.cumsum(width, exclusive=True), width)
    byte_at = _safe_gather(char_start, tf.gather(rank, source)) + within
    out = tf.where(tf.gather(is_ph, source), _safe_gather(byte_ids, byte_at), tf.gather(values, source))
    lengths = tf.math.unsorted_segment_sum(width, rowids, tf.size(texts, out_type=tf.int64))
    return out, lengths


def _safe_gather(params, indices):
    """`tf.gather` that reads index 0 of an empty `params` (or past its end) as 0: the rows where the
    index is meaningless are masked out by the caller."""
    import tensorflow as tf

    padded = tf.concat([params, tf.zeros([1], params.dtype)], 0)
    return tf.gather(padded, tf.minimum(indices, tf.cast(tf.size(params), indices.dtype)))
