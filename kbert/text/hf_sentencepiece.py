"""SentencePiece vocabularies as XLM-RoBERTa's Hugging Face dirs hold them, made into models whose own ids are
the ids the checkpoint was trained with.

XLM-RoBERTa and the Korean sentence models built on it (BGE-M3 and its Korean fine-tunes, KURE, multilingual
E5, KoE5, ...) ship `sentencepiece.bpe.model` (a unigram model despite the name) but number its pieces as
fairseq's dictionary does: `<s>` 0, `<pad>` 1, `</s>` 2, `<unk>` 3, then SentencePiece's pieces from its id 3
on, each one place later, and `<mask>` last. transformers applies that shift in Python around SentencePiece's
ids. kbert rewrites the model proto instead (`fairseq_layout`): the same pieces with the same scores, in
fairseq's order, so SentencePiece's own ids, the in-graph op's and therefore every kbert path (Python, tf.data,
SavedModel) are the checkpoint's ids with nothing added after the encoder. Viterbi only reads scores, and the
pieces keep their relative order, so the segmentation is unchanged.

Some repos ship only a `tokenizer.json` (Hugging Face `tokenizers`, the Unigram model): `unigram_from_json`
builds the SentencePiece proto from its pieces and scores and its precompiled normalization map, which is
the map the `.model` carried before it was converted, so SentencePiece normalizes and segments as the
`tokenizers` pipeline does; byte fallback's `<0x..>` pieces become SentencePiece's byte pieces. A tokenizer.json
kbert itself wrote (`Tokenizer.fast_tokenizer`, recognized by its normalizer: `json_normalization`) reads back
as the kbert tokenizer it came from.

Out again (`export_fairseq`, for `kbert.export_transformers` / `export_sentence_transformers` of a model
fine-tuned from one of these): the `.model` in SentencePiece's own numbering, as XLM-RoBERTa ships it, and
the tokenizer.json transformers' own converter makes of it (Precompiled normalizer, Metaspace, `<s> A </s>`),
written with `tokenizers` so that loading it needs neither sentencepiece nor protobuf.
"""

from __future__ import annotations

import base64
import json
import os
import re

# tokenizer classes / model types whose SentencePiece ids are fairseq's (transformers' XLMRobertaTokenizer)
_FAIRSEQ_CLASSES = ("XLMRobertaTokenizer", "XLMRobertaTokenizerFast")
_FAIRSEQ_MODEL_TYPES = ("xlm-roberta",)
_FAIRSEQ_HEAD = ("<s>", "<pad>", "</s>", "<unk>")


def is_fairseq_dir(directory: str) -> bool:
    """A Hugging Face dir whose SentencePiece model is numbered as fairseq's dictionary (XLM-RoBERTa): its
    tokenizer_config.json names XLMRobertaTokenizer, or its config.json model_type is xlm-roberta."""
    for name, key, values in (("tokenizer_config.json", "tokenizer_class", _FAIRSEQ_CLASSES),
                              ("config.json", "model_type", _FAIRSEQ_MODEL_TYPES)):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    if json.load(f).get(key) in values:
                        return True
            except (ValueError, OSError, AttributeError):
                continue
    return False


def fairseq_layout(proto: bytes) -> bytes:
    """The SentencePiece model `proto` renumbered as fairseq's dictionary: `<s>` 0, `<pad>` 1, `</s>` 2, `<unk>`
    3, SentencePiece's piece i (i >= 3) at i + 1, `<mask>` last. The input must be numbered as SentencePiece
    trains XLM-R-style models (`<unk>` 0, `<s>` 1, `</s>` 2); a model already in fairseq's order is returned
    as it is. Anything else raises ValueError naming what it found."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = pb.ModelProto()
    model.ParseFromString(proto)
    head = [p.piece for p in model.pieces[:4]]
    if tuple(head) == _FAIRSEQ_HEAD:
        return proto
    Type = pb.ModelProto.SentencePiece.Type
    expected = [("<unk>", Type.UNKNOWN), ("<s>", Type.CONTROL), ("</s>", Type.CONTROL)]
    found = [(p.piece, p.type) for p in model.pieces[:3]]
    if found != expected:
        raise ValueError(f"This SentencePiece model does not start <unk> <s> </s> (it starts {head[:3]}), so "
                         f"fairseq's (XLM-RoBERTa's) numbering of it is not defined")
    out = pb.ModelProto()
    out.CopyFrom(model)
    del out.pieces[:]
    for piece, kind in (("<s>", Type.CONTROL), ("<pad>", Type.CONTROL), ("</s>", Type.CONTROL),
                        ("<unk>", Type.UNKNOWN)):
        out.pieces.add(piece=piece, score=0.0, type=kind)
    out.pieces.extend(model.pieces[3:])
    if not any(p.piece == "<mask>" for p in model.pieces):
        out.pieces.add(piece="<mask>", score=0.0, type=Type.CONTROL)
    spec = out.trainer_spec
    spec.bos_id, spec.pad_id, spec.eos_id, spec.unk_id = 0, 1, 2, 3
    spec.bos_piece, spec.pad_piece, spec.eos_piece, spec.unk_piece = _FAIRSEQ_HEAD
    return out.SerializeToString()


def read_tokenizer_json(path: str, model_type: str, spec=None):
    """(the whole spec, its "model") of a Hugging Face tokenizer.json whose model is `model_type` (`spec`: the
    file already parsed); another model raises ValueError naming it."""
    if spec is None:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    model = spec.get("model") or {}
    if model.get("type") != model_type:
        raise ValueError(f"{path}: a Hugging Face {model.get('type')!r} tokenizer where {model_type!r} was expected; "
                         f"kbert reads WordPiece and Unigram ones (and vocab.txt or a SentencePiece .model)")
    return spec, model


def unigram_from_json(path: str, spec=None) -> bytes:
    """A SentencePiece model proto from a Hugging Face `tokenizer.json` whose model is Unigram (pieces, scores,
    unk_id), its normalizer's precompiled map and its Metaspace pre-tokenizer; the added special tokens become
    control pieces at their ids (`spec`: the file already parsed). Other pipelines raise ValueError naming the
    part kbert cannot reproduce."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    spec, model = read_tokenizer_json(path, "Unigram", spec)
    kbert_own = json_normalization(spec) is not None  # kbert normalizes before SentencePiece sees the text
    charsmap = b"" if kbert_own else _precompiled_charsmap(spec.get("normalizer"), path)
    pre = spec.get("pre_tokenizer")
    if kbert_own and _splits_spaces(pre):  # unigram_json_normalizer's pairing: spaces dropped, `▁` prepended
        _check_metaspace(pre["pretokenizers"][1], path, prepend="always")
    else:
        _check_metaspace(pre, path, prepend="never" if kbert_own else "always")
    special = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    Type = pb.ModelProto.SentencePiece.Type
    out = pb.ModelProto()
    unk_id = model.get("unk_id")
    if unk_id is None:
        raise ValueError(f"{path}: its Unigram model has no unk_id")
    byte_fallback = bool(model.get("byte_fallback"))
    for i, (piece, score) in enumerate(model["vocab"]):
        kind = Type.UNKNOWN if i == unk_id else Type.CONTROL if piece in special else Type.NORMAL
        if byte_fallback and _BYTE_PIECE.fullmatch(piece):
            kind = Type.BYTE  # SentencePiece spells a character it has no piece for as these
        out.pieces.add(piece=piece, score=float(score) if kind == Type.NORMAL else 0.0, type=kind)
    if byte_fallback and sum(p.type == Type.BYTE for p in out.pieces) != 256:
        raise ValueError(f"{path}: its Unigram model has byte fallback but not the 256 byte pieces <0x00>...<0xFF>")
    out.trainer_spec.byte_fallback = byte_fallback
    out.trainer_spec.model_type = pb.TrainerSpec.UNIGRAM
    out.trainer_spec.vocab_size = len(out.pieces)
    out.trainer_spec.unk_id = unk_id
    for role in ("bos", "eos", "pad"):
        setattr(out.trainer_spec, f"{role}_id", -1)
    ids = {p.piece: i for i, p in enumerate(out.pieces)}
    for role, piece in (("bos", "<s>"), ("eos", "</s>"), ("pad", "<pad>")):
        if piece in ids and out.pieces[ids[piece]].type == Type.CONTROL:
            setattr(out.trainer_spec, f"{role}_id", ids[piece])
    norm = out.normalizer_spec
    norm.name = "hf_precompiled" if charsmap else "identity"
    norm.precompiled_charsmap = charsmap
    norm.add_dummy_prefix = True
    norm.remove_extra_whitespaces = not kbert_own  # kbert's normalizer has collapsed them already
    norm.escape_whitespaces = True
    return out.SerializeToString()


_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")


def json_normalization(spec: dict):
    """kbert's normalization settings (`{"lowercase": bool}`) when a parsed tokenizer.json normalizes as kbert
    writes it (`Tokenizer.fast_tokenizer`: `unigram_json_normalizer`, or before 2026-12 kbert's NFC normalizer
    with SentencePiece's `▁` prepended and for spaces), else None. Such a file reads back as the kbert tokenizer
    it came from: kbert's own normalization, then the unigram model on the normalized text as given."""
    normalizer = spec.get("normalizer")
    if not normalizer or normalizer.get("type") != "Sequence":
        return None
    for lowercase in (False, True):
        if normalizer in (_normalizer_json(unigram_json_normalizer(lowercase=lowercase)),
                          _normalizer_json(_prepended_normalizer(lowercase))):
            return {"lowercase": lowercase}
    return None


def unigram_json_normalizer(form: str = "NFC", repeat=None, lowercase: bool = False):
    """The normalizer of the unigram tokenizer.json kbert writes: kbert's own normalization
    (`kbert.text.normalize.tokenizers_normalizer`), then a literal `▁` that begins a word doubled. The
    pre-tokenizer after it drops the spaces and prepends `▁` to each word unless it already starts with one;
    the doubling gives such a word the extra `▁` SentencePiece's dummy prefix would."""
    from tokenizers import Regex, normalizers

    from kbert.text.normalize import tokenizers_normalizer

    return normalizers.Sequence([tokenizers_normalizer(form, repeat, lowercase),
                                 normalizers.Replace(Regex("(?<![^ ])\u2581"), "\u2581\u2581")])


def _prepended_normalizer(lowercase: bool):
    """The normalizer of kbert's earlier unigram tokenizer.json (`▁` prepended and for spaces, a Metaspace
    pre-tokenizer that only splits); its ids are the same, its word-initial offsets include the space before."""
    from tokenizers import normalizers

    from kbert.text.normalize import tokenizers_normalizer

    return normalizers.Sequence([tokenizers_normalizer(lowercase=lowercase), normalizers.Prepend("\u2581"),
                                 normalizers.Replace(" ", "\u2581")])


def _normalizer_json(normalizer) -> dict:
    """A `tokenizers` normalizer as a tokenizer.json holds it."""
    from tokenizers import Tokenizer, models

    fast = Tokenizer(models.Unigram())
    fast.normalizer = normalizer
    return json.loads(fast.to_str())["normalizer"]


def _precompiled_charsmap(normalizer, path: str) -> bytes:
    """The precompiled map of a tokenizer.json normalizer (alone or inside a Sequence with the whitespace
    replacement transformers' converter adds); b"" when there is none."""
    if normalizer is None:
        return b""
    parts = normalizer.get("normalizers", [normalizer]) if normalizer.get("type") == "Sequence" else [normalizer]
    found = b""
    for part in parts:
        kind = part.get("type")
        if kind == "Precompiled":
            found = base64.b64decode(part.get("precompiled_charsmap") or "")
        elif kind == "Replace" and _collapses_spaces(part):
            continue  # SentencePiece's remove_extra_whitespaces does the same
        elif kind == "Strip":
            continue  # likewise (leading and trailing whitespace)
        else:
            raise ValueError(f"{path}: its normalizer step {kind!r} has no SentencePiece equivalent")
    return found


def _collapses_spaces(part) -> bool:
    pattern = part.get("pattern") or {}
    return part.get("content") == " " and (pattern.get("Regex") == " {2,}" or pattern.get("String") == "  ")


def _splits_spaces(pre) -> bool:
    """Whether a tokenizer.json pre-tokenizer is the one kbert writes after `unigram_json_normalizer`: the
    spaces removed, then Metaspace."""
    steps = (pre or {}).get("pretokenizers") or []
    return (len(steps) == 2 and steps[0].get("type") == "Split" and steps[0].get("pattern") == {"String": " "}
            and steps[0].get("behavior") == "Removed" and steps[1].get("type") == "Metaspace")


def _check_metaspace(pre, path: str, prepend: str = "always") -> None:
    """Refuses a pre-tokenizer other than SentencePiece's Metaspace with `prepend` as its prepend scheme
    ("never" for kbert's earlier files, whose normalizer prepends the `▁`)."""
    steps = pre.get("pretokenizers", [pre]) if pre and pre.get("type") == "Sequence" else [pre]
    for step in steps:
        if step is None:
            continue
        if step.get("type") == "WhitespaceSplit":
            continue
        if step.get("type") != "Metaspace" or step.get("replacement", "\u2581") != "\u2581" or \
                step.get("prepend_scheme", "always") != prepend or \
                (prepend == "always" and not step.get("add_prefix_space", True)):
            raise ValueError(f"{path}: its pre-tokenizer {step} is not SentencePiece's (Metaspace '\u2581', a "
                             f"space prepended {prepend})")


def is_fairseq_layout(proto: bytes) -> bool:
    """Whether `proto` is numbered as `fairseq_layout` leaves it (<s> <pad> </s> <unk> first, <mask> last)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = pb.ModelProto()
    model.ParseFromString(proto)
    return tuple(p.piece for p in model.pieces[:4]) == _FAIRSEQ_HEAD and model.pieces[-1].piece == "<mask>"


def export_fairseq(proto: bytes, directory: str, model_max_length: int = 512) -> str:
    """Writes a `fairseq_layout` tokenizer as XLM-RoBERTa's Hugging Face files: `sentencepiece.bpe.model`
    (SentencePiece's numbering), `tokenizer.json` and `tokenizer_config.json` (XLMRobertaTokenizer)."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    model = pb.ModelProto()
    model.ParseFromString(proto)
    Type = pb.ModelProto.SentencePiece.Type
    original = pb.ModelProto()
    original.CopyFrom(model)
    del original.pieces[:]
    for piece, kind in (("<unk>", Type.UNKNOWN), ("<s>", Type.CONTROL), ("</s>", Type.CONTROL)):
        original.pieces.add(piece=piece, score=0.0, type=kind)
    original.pieces.extend(model.pieces[4:-1])
    spec = original.trainer_spec
    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = 0, 1, 2, -1
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "sentencepiece.bpe.model"), "wb") as f:
        f.write(original.SerializeToString())
    vocab = [(p.piece, p.score if p.type == Type.NORMAL else 0.0) for p in model.pieces]
    fast = Tokenizer(models.Unigram(vocab, unk_id=3, byte_fallback=False))
    steps = [normalizers.Replace(Regex(" {2,}"), " ")]
    if model.normalizer_spec.precompiled_charsmap:
        steps.insert(0, normalizers.Precompiled(model.normalizer_spec.precompiled_charsmap))
    fast.normalizer = normalizers.Sequence(steps)
    fast.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                  pre_tokenizers.Metaspace(replacement="\u2581",
                                                                           prepend_scheme="always")])
    fast.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    fast.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _FAIRSEQ_HEAD + ("<mask>",)])
    fast.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    fast.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "XLMRobertaTokenizer", "model_max_length": model_max_length,
              "bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>", "unk_token": "<unk>",
              "pad_token": "<pad>", "mask_token": "<mask>", "clean_up_tokenization_spaces": False}
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return directory
