"""Vocabulary training: SentencePiece (unigram or BPE) models and BERT WordPiece `vocab.txt`s learned from Korean text.

`Tokenizer.train` is the public entry; it hands this module its normalizer and morpheme splitter, so the
vocabulary is learned on exactly the text the tokenizer will see. SentencePiece's trainer does the learning
(it is the field's reference implementation, multi-threaded C++); WordPiece vocabularies are learned as BPE
and converted (`_spm_to_wordpiece`), as KLUE did. Every Hangul syllable seen in training is kept as a piece,
so Korean text never meets [UNK].
"""

from __future__ import annotations

import numbers
import os
import tempfile
from typing import Callable, List, Sequence, Tuple, Union

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
ALGORITHMS = ("unigram", "bpe", "wordpiece")
JOINER = "\ue000"  # marks a morpheme that continues an eojeol (no space before it)


def train_vocabulary(inputs, vocab_size: int, algorithm: str, *, normalize: Callable[[str], str],
                     analyze: Callable, training_line: Callable, split_morphemes: bool, segmented: bool,
                     user_defined_symbols: Sequence[str] = (), character_coverage: float = 0.9995,
                     max_sentences: int = 5_000_000, min_line_chars: int = 1,
                     progress: bool = True) -> Tuple[str, Union[bytes, List[str]]]:
    """("sentencepiece", model proto) or ("wordpiece", vocab list) learned from `inputs` (see `text_lines`).

    `normalize(raw)` -> normalized text; `analyze(texts)` -> the morpheme analyzer's output per text (Nones
    without one); `training_line(text, morphs)` -> the line the learner sees; `split_morphemes`: whether
    lines go through the analyzer (in batches of 20,000, on all cores); `segmented`: whether morphemes are
    separated by JOINER so that no piece crosses them (SentencePiece with morphemes). The other arguments are
    `Tokenizer.train`'s.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"`algorithm` must be one of {ALGORITHMS}. Received: algorithm={algorithm!r}")
    if not isinstance(vocab_size, int) or vocab_size <= len(SPECIAL_TOKENS) + len(user_defined_symbols):
        raise ValueError(f"`vocab_size` must be an integer larger than the {len(SPECIAL_TOKENS)} special "
                         f"tokens and user symbols. Received: vocab_size={vocab_size!r}")
    from kbert.utils import positive_int

    # checked before the corpus is read: SentencePiece refused these only after that pass (minutes on a large one)
    if (isinstance(character_coverage, bool) or not isinstance(character_coverage, numbers.Real)
            or not 0.98 <= character_coverage <= 1.0):
        raise ValueError(f"`character_coverage` must be in [0.98, 1] (SentencePiece's range). "
                         f"Received: character_coverage={character_coverage!r}")
    max_sentences = positive_int(max_sentences, "max_sentences")
    min_line_chars = positive_int(min_line_chars, "min_line_chars")
    import sentencepiece as spm

    lines, hangul, n_lines = _prepare_training_text(inputs, normalize, analyze, training_line, split_morphemes,
                                                    min_line_chars, progress)
    try:
        if n_lines == 0:
            raise ValueError("Tokenizer.train found no text in `inputs` (empty files or only whitespace)")
        spm_args = dict(
            input=lines, model_type="bpe" if algorithm in ("bpe", "wordpiece") else "unigram",
            vocab_size=vocab_size,
            pad_id=0, pad_piece="[PAD]", unk_id=1, unk_piece="[UNK]", bos_id=-1, eos_id=-1,
            control_symbols=["[CLS]", "[SEP]", "[MASK]"], user_defined_symbols=list(user_defined_symbols),
            character_coverage=character_coverage, required_chars="".join(sorted(hangul)),
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
            input_sentence_size=max_sentences, shuffle_input_sentence=True, max_sentence_length=1 << 16,
            num_threads=os.cpu_count() or 1, train_extremely_large_corpus=False,
            minloglevel=2, hard_vocab_limit=True, split_digits=False,
            # Characters outside the vocabulary become UTF-8 byte pieces instead of [UNK], so any
            # text round-trips (WordPiece cannot use byte pieces and keeps [UNK]).
            byte_fallback=algorithm != "wordpiece",
        )
        if spm_args["model_type"] == "unigram":
            # SentencePiece's defaults (a 1M-piece seed vocabulary, 2 EM sub-iterations per pruning round)
            # spend about half the training time for no measurable gain in held-out tokens per text
            # (benchmarks/README.md, "vocabulary training"). The seed stays >= 8x the vocabulary.
            spm_args.update(seed_sentencepiece_size=min(1_000_000, max(200_000, 8 * vocab_size)),
                            num_sub_iterations=1)
        if segmented:  # no piece crosses a morpheme boundary
            spm_args["pretokenization_delimiter"] = JOINER
        model = _train_spm(spm, spm_args, progress, extra=spm_args["vocab_size"] - vocab_size)
        if segmented:
            model = _drop_piece(model, JOINER, vocab_size)
    finally:
        os.remove(lines)
    if algorithm != "wordpiece":
        return "sentencepiece", model
    return "wordpiece", _spm_to_wordpiece(model, vocab_size, user_defined_symbols)


def _is_hangul_syllable(ch: str) -> bool:
    return "\uac00" <= ch <= "\ud7a3"


def _file_lines(path: str):
    """A training file's lines as UTF-8 text. Lines that are not UTF-8 or look binary (NUL bytes) are dropped
    and counted, with a warning that names the file, the first such line and the likely encoding; a file
    that is mostly such lines is an error (its vocabulary would be U+FFFD and byte garbage)."""
    import warnings

    from kbert.utils import open_binary, undecodable_hint

    total = bad = 0
    first = None
    with open_binary(path) as f:
        for number, raw in enumerate(f, 1):
            total += 1
            try:
                line = raw.decode("utf-8").replace("\r\n", "\n")  # as universal newlines read it
            except UnicodeDecodeError:
                line = None
            if line is None or "\x00" in line:
                bad += 1
                first = first or (number, raw)
                continue
            yield line
    if bad:
        where = f"{path} line {first[0]}"
        message = (f"{bad:,} of {total:,} lines of {path} are not UTF-8 text (first: {where}); "
                   f"{undecodable_hint(first[1])}")
        if bad * 2 > total:
            raise ValueError(message)
        warnings.warn(message + "; those lines were left out", stacklevel=4)


# Files whose raw lines are markup, not text: a vocabulary learnt on them spends pieces on `{"text": "`, `\\n`
# escapes, tags and id/label columns that no training example holds.
_STRUCTURED = {".jsonl": "JSON lines", ".json": "JSON", ".ndjson": "JSON lines", ".tsv": "TSV", ".csv": "CSV",
               ".xml": "XML (a wiki dump?)"}


def _refuse_structured(path: str) -> None:
    from kbert.utils import uncompressed_name

    name = uncompressed_name(path)
    kind = next((k for suffix, k in _STRUCTURED.items() if name.endswith(suffix)), None)
    if kind:
        raise ValueError(f"{path} is a {kind} file: training on its raw lines would learn its syntax as text; "
                         f"pass kbert.corpus({path!r}) (its text field or column, as pretraining reads it), or "
                         f"a plain-text file of one text per line")


def text_lines(inputs):
    """Lines of training text from a path, a list of paths (plain, .gz, .bz2), a kbert `Corpus`, or an
    iterable of strings; files are read as UTF-8 with undecodable lines left out (see `_file_lines`)."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if hasattr(inputs, "texts") and callable(inputs.texts):  # a kbert Corpus
        inputs = inputs.texts()
    # only a list or tuple may name files: the lines of a Corpus or a generator are text, never looked up on
    # disk (a line such as "README.md" is not read as that file, and no line costs a stat)
    paths = isinstance(inputs, (list, tuple))
    single = paths and len(inputs) == 1
    for item in inputs:
        if paths and isinstance(item, (str, os.PathLike)) and os.path.isfile(item):
            _refuse_structured(os.fspath(item))
            yield from _file_lines(os.fspath(item))
        elif isinstance(item, str):
            if single and not any(c.isspace() for c in item) and ("/" in item or item.endswith(".txt")):
                raise FileNotFoundError(f"Training input file not found: {item!r}")
            yield item
        elif isinstance(item, bytes):
            yield item.decode("utf-8", errors="replace")
        else:
            raise TypeError(f"Tokenizer.train inputs must be paths or strings. Received: {type(item).__name__}")


def _prepare_training_text(inputs, normalize, analyze, training_line, batched, min_line_chars, progress):
    """Normalizes (and morpheme-splits) the inputs into a temp file; collects Hangul syllables seen."""
    from kbert.utils import progress_bar

    fd, path = tempfile.mkstemp(prefix="kbert-vocab-", suffix=".txt")
    hangul, n = set(), 0
    bar = progress_bar(desc="normalizing", unit=" lines", enabled=progress)

    def flush(chunk, out):
        # Morpheme analysis runs on all cores, a chunk at a time.
        for text, morphs in zip(chunk, analyze(chunk)):
            text = training_line(text, morphs)
            # Very long lines are cut into 16K-character pieces: SentencePiece skips longer sentences.
            for i in range(0, len(text), 1 << 14):
                out.write(text[i:i + (1 << 14)] + "\n")
        bar.update(len(chunk))
        chunk.clear()

    chunk = []
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            for raw in text_lines(inputs):
                text = normalize(raw)
                if len(text) < min_line_chars:
                    continue
                hangul.update(ch for ch in text if _is_hangul_syllable(ch))
                chunk.append(text)
                n += 1
                if len(chunk) >= (20_000 if batched else 1):
                    flush(chunk, out)
            flush(chunk, out)
    except BaseException:  # a missing file, a bad line, a failed tagger or Ctrl-C: no copy of the text is left
        os.remove(path)
        raise
    finally:
        bar.close()
    return path, hangul, n


def _train_spm(spm, args, progress, extra=0):
    """Trains; `extra` pieces were asked for beyond the user's vocab_size (subtracted in error messages)."""
    import io
    import re

    model = io.BytesIO()
    if progress:
        print(f"training {args['model_type']} vocabulary of {args['vocab_size'] - extra} with SentencePiece "
              f"on {args['num_threads']} threads ...", flush=True)
    try:
        spm.SentencePieceTrainer.train(model_writer=model, **args)
    except RuntimeError as e:
        m = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", str(e))
        if m:
            raise ValueError(f"vocab_size={int(m.group(1)) - extra} is too large for this corpus: it supports at "
                             f"most {int(m.group(2)) - extra}; use a smaller vocab_size or more text") from None
        m = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", str(e))
        if m:
            raise ValueError(f"vocab_size={int(m.group(1)) - extra} is too small: the text needs "
                             f"{int(m.group(2)) - extra} single characters "
                             f"and special tokens (every Hangul syllable seen is kept); use a larger "
                             f"vocab_size") from None
        raise ValueError(f"SentencePiece training failed: {e}") from None
    return model.getvalue()


def _drop_piece(model: bytes, piece: str, vocab_size: int) -> bytes:
    """The model without `piece`; if it has no such piece but more than `vocab_size` pieces, without its
    lowest-scoring multi-character piece instead (single characters keep the text free of [UNK])."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model)
    normal = sentencepiece_model_pb2.ModelProto.SentencePiece.NORMAL
    drop = [i for i, p in enumerate(proto.pieces) if p.piece == piece]
    if not drop and len(proto.pieces) > vocab_size:
        candidates = [i for i, p in enumerate(proto.pieces) if p.type == normal and len(p.piece.lstrip("\u2581")) > 1]
        drop = [min(candidates, key=lambda i: proto.pieces[i].score)] if candidates else []
    for i in sorted(drop, reverse=True):
        del proto.pieces[i]
    return proto.SerializeToString()


def _spm_to_wordpiece(model: bytes, vocab_size: int, user_defined_symbols) -> List[str]:
    """SentencePiece BPE pieces -> BERT WordPiece vocab: `▁x` -> `x` (word start), `x` -> `##x`.

    Every single character also gets its word-initial and `##` form, so no seen character is [UNK].
    """
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model)
    vocab = list(SPECIAL_TOKENS) + list(user_defined_symbols)
    seen = set(vocab)
    chars, pieces = [], []
    for i in range(sp.get_piece_size()):
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.id_to_piece(i) in user_defined_symbols:
            continue
        p = sp.id_to_piece(i)
        if p == "\u2581":
            continue
        token = p[1:] if p.startswith("\u2581") else "##" + p
        (chars if len(p.lstrip("\u2581")) == 1 else pieces).append(token)
        body = p.lstrip("\u2581")
        if len(body) == 1:
            chars.extend([body, "##" + body])
    for t in chars + pieces:
        if t not in seen and t not in ("", "##"):
            vocab.append(t)
            seen.add(t)
    return vocab[:max(vocab_size, len(SPECIAL_TOKENS) + len(user_defined_symbols) + len(set(chars)))]
