"""kbert.Tokenizer: Korean subword tokenization in Python and inside TensorFlow graphs.

Two kinds of vocabulary, each with a Python path and an in-graph path that give identical ids:
- SentencePiece (unigram or BPE): `sentencepiece` (>= 0.2.2) in Python; in the graph, unigram models run
  tensorflow-text's `FastSentencepieceTokenizer`, which is sentencepiece's own Viterbi (same float32
  arithmetic, same tie-breaking) at twice the speed of its `SentencepieceTokenizer` op, with lines holding
  characters outside the vocabulary re-encoded in the graph as sentencepiece scores them
  (`kbert.text.fast_unigram`); BPE models run `SentencepieceTokenizer`. The same model proto in both.
- WordPiece (`vocab.txt`, as KLUE-BERT and KcBERT ship): tensorflow-text `FastBertTokenizer` (BERT's
  punctuation splitting + greedy longest-match WordPiece), run eagerly for Python calls that need offsets;
  `ids_batch` (the pretraining pipeline's path) gives the same ids in pure Python (`kbert.text.wordpiece`),
  so worker processes never import TensorFlow.

Text is normalized first with `kbert.normalize` (NFC, never NFD). A morpheme-aware tokenizer
(`morphemes="mecab"`, ...) splits every eojeol into morphemes before the subword model. With SentencePiece
each morpheme is encoded on its own, so no piece crosses a morpheme boundary: the first morpheme of an
eojeol starts with `▁`, the others do not (`학교에서` -> `▁학교 에서`), which costs no extra tokens and lets
`decode` restore the spacing. (WordPiece vocabularies mark continuing morphemes with a joiner, U+E000.)
The analyzer runs in Python: in `tf.data` it is wrapped in `tf.numpy_function`, so only plain subword
tokenizers are pure graphs (and exportable to a SavedModel without Python).
"""

from __future__ import annotations

import json
import os
from typing import Iterable, List, NamedTuple, Optional, Sequence, Union

import numpy as np

from kbert.text.fast_unigram import add_specials, fast_unigram_ids, fast_unigram_parts, is_unigram, specials_as_bos_eos
from kbert.text.hf_sentencepiece import (export_fairseq, fairseq_layout, is_fairseq_dir, is_fairseq_layout,
                                         json_normalization, read_tokenizer_json, unigram_from_json,
                                         unigram_json_normalizer)
from kbert.text.normalize import normalize, tf_normalize
from kbert.text.vocab import ALGORITHMS, JOINER, SPECIAL_TOKENS, train_vocabulary  # noqa: F401 (re-exported)
from kbert.text.wordpiece import WordPieceIds
from kbert.utils import check_local_path, no_gc

CONFIG_FILE = "tokenizer.json"
SPM_FILE = "spm.model"
VOCAB_FILE = "vocab.txt"
_MAX_BYTES_PER_WORD = 400  # longer words are one [UNK] (tensorflow-text's and kbert's Python WordPiece)
# WordPiece offset calls run eagerly before `_offsets_fn` traces them (a trace costs as much as dozens of calls)
TRACE_AFTER_CALLS = 20


# Where a model dir keeps its tokenizer (the same name as kbert.models.io.TOKENIZER_DIR).
MODEL_TOKENIZER_DIR = "tokenizer"

class Encoding(NamedTuple):
    """ids and tokens with [CLS]/[SEP]; offsets are character spans into `normalized` ((0, 0) for
    special tokens)."""

    ids: List[int]
    tokens: List[str]
    offsets: List[tuple]
    normalized: str


def _sees_text_as_given(proto) -> bool:
    """A SentencePiece model (a parsed ModelProto) that sees kbert's normalized text exactly as given: identity
    normalization, spaces kept, a dummy prefix, `▁` before words (kbert trains them so)."""
    norm = proto.normalizer_spec
    return (norm.name == "identity" and not norm.precompiled_charsmap and not norm.remove_extra_whitespaces
            and norm.add_dummy_prefix and not proto.trainer_spec.treat_whitespace_as_suffix)


def _hf_wordpiece(path: str, spec=None):
    """(vocabulary in id order, lowercase) of a Hugging Face `tokenizer.json` holding a WordPiece model, the only
    vocabulary file transformers >= 5 writes for BERT-style tokenizers. Its normalizer's lowercasing is kept;
    accents are never stripped (kbert never decomposes Hangul). Other models raise ValueError. `spec`: the file
    already parsed."""
    spec, model = read_tokenizer_json(path, "WordPiece", spec)
    if model.get("continuing_subword_prefix", "##") != "##":
        raise ValueError(f"{path}: continuation prefix {model['continuing_subword_prefix']!r}; kbert's WordPiece uses ##")
    by_id = sorted(model["vocab"].items(), key=lambda item: item[1])
    if [i for _, i in by_id] != list(range(len(by_id))):
        raise ValueError(f"{path}: the WordPiece ids are not 0..{len(by_id) - 1}")
    def flat(normalizer):
        if normalizer.get("type") == "Sequence":
            return [n for inner in normalizer.get("normalizers", []) for n in flat(inner)]
        return [normalizer]

    normalizers = flat(spec.get("normalizer") or {})
    lowercase = any(n.get("type") == "Lowercase" or (n.get("type") == "BertNormalizer" and n.get("lowercase"))
                    for n in normalizers)
    return [token for token, _ in by_id], lowercase


class Tokenizer:
    """A Korean subword tokenizer (see the module docstring for how it works).

    Build one with `Tokenizer.train(...)`, `Tokenizer.load(dir)` (a kbert tokenizer dir, a `vocab.txt`,
    a SentencePiece `.model`, or a Hugging Face dir holding one of them).

    Example:
        >>> tok = kbert.Tokenizer.train(["대한민국은 민주공화국이다.", ...], vocab_size=8000)
        >>> tok.tokenize("학교에서 공부했다")
        ['▁학교', '에서', '▁공부', '했다']
        >>> ds = tf.data.Dataset.from_tensor_slices(texts).map(tok)   # same ids, in the graph
    """

    def __init__(self, kind: str, model: Union[bytes, List[str]], morphemes: Optional[str] = None,
                 form: str = "NFC", repeat: Optional[int] = None, lowercase: bool = False,
                 special_tokens: Optional[dict] = None):
        if kind not in ("sentencepiece", "wordpiece"):
            raise ValueError(f"`kind` must be 'sentencepiece' or 'wordpiece'. Received: kind={kind!r}")
        self.kind = kind
        self.morphemes = morphemes
        self.form, self.repeat, self.lowercase = form, repeat, lowercase
        self._analyzer = None
        if kind == "sentencepiece":
            import sentencepiece as spm

            check_sentencepiece_version(spm.__version__)
            self._spm_proto = bytes(model)
            self._sp = spm.SentencePieceProcessor(model_proto=self._encoder_proto())
            self.vocab = [self._sp.id_to_piece(i) for i in range(self._sp.get_piece_size())]
        else:
            self.vocab = list(model)
        self._index = {t: i for i, t in enumerate(self.vocab)}
        names = dict(pad="[PAD]", unk="[UNK]", cls="[CLS]", sep="[SEP]", mask="[MASK]")
        names.update(special_tokens or {})
        self.special_tokens = names
        self.special_ids = {}
        for role, token in names.items():
            if token not in self._index:
                raise ValueError(f"The vocabulary has no {role} token {token!r}; pass special_tokens="
                                 f"{{'{role}': ...}} with the token it uses")
            self.special_ids[role] = self._index[token]
        self._graph = None
        self._graph_special = None
        self._graph_unigram = None
        self._graph_unigram_mapped = None
        self._wordpiece_ids = None

    # ------------------------------------------------------------------ properties
    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    pad_id = property(lambda self: self.special_ids["pad"])
    unk_id = property(lambda self: self.special_ids["unk"])
    cls_id = property(lambda self: self.special_ids["cls"])
    sep_id = property(lambda self: self.special_ids["sep"])
    mask_id = property(lambda self: self.special_ids["mask"])

    @property
    def pair_separators(self) -> int:
        """Separator tokens between the two texts of a pair: 2 for XLM-RoBERTa's numbering (`<s> a </s></s> b
        </s>`, as fairseq and transformers write its pairs), 1 for BERT's `[CLS] a [SEP] b [SEP]`."""
        return 2 if self.kind == "sentencepiece" and self.vocab[-1] == "<mask>" and tuple(
            self.vocab[:4]) == ("<s>", "<pad>", "</s>", "<unk>") else 1

    def __getstate__(self):  # picklable for worker processes: native handles are rebuilt there
        state = dict(self.__dict__)
        state.update(_sp=None, _graph=None, _graph_special=None, _graph_unigram=None, _graph_unigram_mapped=None,
                     _analyzer=None, _wordpiece_ids=None, _offsets=None, _offset_calls=0)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.kind == "sentencepiece":
            import sentencepiece as spm

            self._sp = spm.SentencePieceProcessor(model_proto=self._encoder_proto())

    @property
    def _segmented(self) -> bool:
        """SentencePiece + morphemes: every morpheme is encoded on its own (see the module docstring)."""
        return self.kind == "sentencepiece" and bool(self.morphemes)

    def _encoder_proto(self) -> bytes:
        """The model proto the encoders run. Segmented tokenizers write each eojeol-initial morpheme
        with its leading space, so SentencePiece's own dummy prefix is turned off."""
        if not self._segmented:
            return self._spm_proto
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(self._spm_proto)
        proto.normalizer_spec.add_dummy_prefix = False
        return proto.SerializeToString()

    def fingerprint(self) -> str:
        """A short hash of the vocabulary and normalization options (records remember which tokenizer
        made them)."""
        import hashlib

        h = hashlib.sha256("\n".join(self.vocab).encode("utf-8"))
        h.update(repr((self.kind, self.morphemes, self.form, self.repeat, self.lowercase)).encode())
        return h.hexdigest()[:16]

    def __repr__(self):
        return (f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, morphemes={self.morphemes!r}, "
                f"form={self.form!r}, repeat={self.repeat!r}, lowercase={self.lowercase})")

    # ---------------------------------------------------------------- pre-tokenize
    def normalize(self, text) -> str:
        return normalize(text, form=self.form, repeat=self.repeat, lowercase=self.lowercase)

    def _analyzer_fn(self):
        if self._analyzer is None:
            from kbert.text.morphemes import morphemes

            self._analyzer = morphemes(self.morphemes)
        return self._analyzer

    def _morphemes_batch(self, texts: List[str]):
        """The analyzer's morphemes for many texts (on all cores when there are thousands)."""
        return self._analyzer_fn().batch(texts) if self.morphemes else [None] * len(texts)

    def _segments(self, text: str, morphs=None):
        """Normalized text -> [(segment, start, eojeol_initial)]: one per morpheme, in order, each a run of
        `text[start:]`; eojeol-initial segments carry a leading space (SentencePiece's `▁`). `morphs`: the
        analyzer's output for `text`, when already computed."""
        if not text:
            return []
        starts = {m.start for m in (self._analyzer_fn()(text) if morphs is None else morphs)}
        bounds, word_start = [], True
        for i, ch in enumerate(text):
            if ch == " ":
                word_start = True
                continue
            if word_start or i in starts:
                bounds.append([i, i, word_start])
            bounds[-1][1] = i + 1
            word_start = False
        return [((" " if first else "") + text[a:b], a, first) for a, b, first in bounds]

    def _training_line(self, text: str, morphs=None) -> str:
        """Normalized text -> the line the vocabulary learner sees (morphemes split by JOINER, which
        SentencePiece's `pretokenization_delimiter` removes; no piece crosses it)."""
        if self._segmented:
            return "".join(seg if first and i else (seg[1:] if first else JOINER + seg)
                           for i, (seg, _, first) in enumerate(self._segments(text, morphs)))
        return self._presplit(text, morphs)[0] if self.morphemes else text

    def _presplit(self, text: str, morphs=None):
        """WordPiece + morphemes: normalized text -> (subword-model input with a space and JOINER before
        every morpheme that continues an eojeol, map from input char index to text char index)."""
        if not self.morphemes or not text:
            return text, list(range(len(text) + 1))
        starts = {m.start for m in (self._analyzer_fn()(text) if morphs is None else morphs)}
        out, index = [], []
        word_start = True
        for i, ch in enumerate(text):
            if ch == " ":
                word_start = True
                out.append(ch)
                index.append(i)
                continue
            if not word_start and i in starts:
                out.append(" ")
                index.append(i)
                out.append(JOINER)
                index.append(i)
            out.append(ch)
            index.append(i)
            word_start = False
        index.append(len(text))
        return "".join(out), index

    # --------------------------------------------------------------------- encode
    def _check_text(self, text):
        if isinstance(text, bytes):
            return text.decode("utf-8", errors="replace")
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer expects str (or UTF-8 bytes). Received: {type(text).__name__}")
        return text

    def encode(self, text: str, pair: Optional[str] = None, add_special_tokens: bool = True,
               max_length: Optional[int] = None) -> Encoding:
        """Ids, tokens and character offsets of `text` (and `pair`, as `[CLS] a [SEP] b [SEP]`; XLM-RoBERTa's
        `<s> a </s></s> b </s>`, `pair_separators`).

        `max_length` truncates the longer of the two segments first, counting special tokens.
        """
        return self.encode_batch([text], pairs=None if pair is None else [pair],
                                 add_special_tokens=add_special_tokens, max_length=max_length)[0]

    def _pieces_batch(self, texts: List[str]):
        """For normalized texts: lists of (id, piece, start, end) with offsets into each text."""
        if self._segmented:
            return self._segmented_pieces(texts)
        if self.kind == "sentencepiece":  # no morphemes here: with them, SentencePiece is segmented
            return self._walked_pieces(texts) if self._piece_lengths() is not None else self._proto_pieces(texts)
        import tensorflow as tf

        pre = [self._presplit(t, m) for t, m in zip(texts, self._morphemes_batch(texts))]
        ids, starts, ends = self._offsets_fn()(tf.constant([p for p, _ in pre], tf.string))
        results = []
        for (inp, index), row_ids, row_s, row_e in zip(pre, ids.to_list(), starts.to_list(), ends.to_list()):
            b2c = _byte_to_char(inp)
            items = []
            for i, s, e in zip(row_ids, row_s, row_e):
                cs, ce = b2c[s], b2c[e]
                items.append((i, self.vocab[i], index[cs], index[ce - 1] + 1 if ce > cs else index[cs]))
            results.append(items)
        return results

    def _proto_pieces(self, texts: List[str]):
        """Plain SentencePiece: offsets from SentencePiece's own protos (character offsets)."""
        results = []
        for text, enc in zip(texts, self._sp.encode(list(texts), return_type="offset_mapping")):
            items = []
            for i, piece, (s, e) in zip(enc["ids"], enc["pieces"], enc["offsets"]):
                if s < e and text[s] == " ":  # the piece's ▁ stands for the space: not part of the span
                    s += 1
                items.append((i, piece, s, max(s, e)))
            results.append(items)
        return results

    def _piece_lengths(self):
        """For plain SentencePiece models that see the text exactly as given (kbert's: identity
        normalization, spaces kept, dummy prefix, byte fallback), each piece's length in characters (0 for
        byte pieces, -1 for pieces that cannot occur); else None. Offsets then follow from the ids alone."""
        if not hasattr(self, "_lengths"):
            self._lengths = None
            if self.kind == "sentencepiece" and not self.morphemes:
                from sentencepiece import sentencepiece_model_pb2

                proto = sentencepiece_model_pb2.ModelProto()
                proto.ParseFromString(self._spm_proto)
                if _sees_text_as_given(proto) and proto.trainer_spec.byte_fallback:
                    sp = self._sp
                    self._lengths = [0 if sp.is_byte(i) else -1 if sp.is_control(i) or sp.is_unknown(i)
                                     else len(p) for i, p in enumerate(self.vocab)]
        return self._lengths

    def _walked_pieces(self, texts: List[str]):
        """`_pieces_batch` from ids: SentencePiece saw `▁` + the text with spaces as `▁`, and the pieces
        spell that string out (a character outside the vocabulary as its UTF-8 byte pieces), which is
        cheaper than reading offsets from SentencePiece's protos; a text whose pieces do not spell it takes
        the protos."""
        lengths, vocab, results = self._piece_lengths(), self.vocab, []
        for text, ids in zip(texts, self._sp.encode(list(texts))):
            shown = "\u2581" + text.replace(" ", "\u2581")
            items, p, pending = [], 0, 0  # p: position in `shown`; pending: byte pieces still to come
            for i in ids:
                n = lengths[i]
                if n > 0 and not pending and shown.startswith(vocab[i], p):
                    s = p - 1 if p else 0  # text offset (the dummy prefix stands before character 0)
                    if p and shown[p] == "\u2581" and text[p - 1] == " ":
                        s += 1  # the piece's ▁ stands for the space: not part of the span
                    items.append((i, vocab[i], s, p - 1 + n))
                    p += n
                elif n == 0 and p:  # byte pieces: the first ones zero-width, the last spans the character
                    if not pending:
                        pending = len(text[p - 1].encode("utf-8"))
                    pending -= 1
                    items.append((i, vocab[i], p - 1, p if not pending else p - 1))
                    p += not pending
                else:
                    break
            else:
                if p == len(shown) and not pending:
                    results.append(items)
                    continue
            results.append(None)
        if None in results:
            redo = [j for j, r in enumerate(results) if r is None]
            for j, items in zip(redo, self._proto_pieces([texts[j] for j in redo])):
                results[j] = items
        return results

    def _segmented_pieces(self, texts: List[str]):
        rows = [self._segments(t, m) for t, m in zip(texts, self._morphemes_batch(texts))]
        flat = [seg for row in rows for seg, _, _ in row]
        encoded = iter(self._sp.encode(flat, return_type="offset_mapping") if flat else [])  # character offsets
        results = []
        for row in rows:
            items = []
            for seg, start, first in row:
                shift = start - 1 if first else start  # the leading space is not in the text
                enc = next(encoded)
                for i, piece, (s, e) in zip(enc["ids"], enc["pieces"], enc["offsets"]):
                    if s < e and seg[s] == " ":
                        s += 1
                    items.append((i, piece, shift + s, shift + max(e, s)))
            results.append(items)
        return results

    def encode_batch(self, texts: Sequence[str], pairs: Optional[Sequence[str]] = None,
                     add_special_tokens: bool = True, max_length: Optional[int] = None) -> List[Encoding]:
        """`encode` for many texts at once (SentencePiece encodes them on all cores)."""
        if isinstance(texts, (str, bytes)):
            raise TypeError("encode_batch expects a list of texts; use encode() for one text")
        with no_gc():  # ~10 tuples per piece, none in a cycle (kbert.utils.no_gc)
            return self._encode_batch(texts, pairs, add_special_tokens, max_length)

    def _encode_batch(self, texts, pairs, add_special_tokens, max_length):
        texts = [self.normalize(self._check_text(t)) for t in texts]
        pair_texts = []
        if pairs is not None:
            if len(pairs) != len(texts):
                raise ValueError(f"`pairs` must have one text per text. Received {len(pairs)} pairs for "
                                 f"{len(texts)} texts")
            pair_texts = [self.normalize(self._check_text(t)) for t in pairs]
        # each distinct text once, both sides of the pairs in one call: a reranker's batch repeats its query
        # for every candidate, and each call of the in-graph tokenizer has a fixed cost
        distinct = list(dict.fromkeys(texts + pair_texts))
        found = dict(zip(distinct, self._pieces_batch(distinct)))
        pieces = [found[t] for t in texts]
        pair_pieces = [found[t] for t in pair_texts] if pairs is not None else None
        out = []
        middle = self.pair_separators
        for i, (text, a) in enumerate(zip(texts, pieces)):
            b = pair_pieces[i] if pair_pieces is not None else None
            if max_length is not None:
                special = (2 + middle if b is not None else 2) if add_special_tokens else 0
                a, b = _truncate(a, b, max_length - special)
            cls = (self.cls_id, self.vocab[self.cls_id], 0, 0)
            sep = (self.sep_id, self.vocab[self.sep_id], 0, 0)
            items = ([cls] if add_special_tokens else []) + a + ([sep] if add_special_tokens else [])
            if b is not None:
                items += ([sep] * (middle - 1) if add_special_tokens else []) + b + ([sep] if add_special_tokens else [])
            out.append(Encoding([x[0] for x in items], [x[1] for x in items], [(x[2], x[3]) for x in items],
                                text))
        return out

    def ids_batch(self, texts: Sequence[str], normalized: bool = False) -> List[List[int]]:
        """Subword ids of many texts without special tokens or offsets: the fast path the pretraining
        pipeline uses (same ids as `encode(t, add_special_tokens=False).ids`)."""
        if not normalized:
            texts = [self.normalize(self._check_text(t)) for t in texts]
        if self._segmented:
            rows = [[seg for seg, _, _ in self._segments(t)] for t in texts]
            flat = iter(self._sp.encode([seg for row in rows for seg in row]))
            return [[i for _ in row for i in next(flat)] for row in rows]
        if self.morphemes:
            texts = [self._presplit(t)[0] for t in texts]
        if not texts:
            return []
        if self.kind == "sentencepiece":
            return self._sp.encode(list(texts))
        if self._wordpiece_ids is None:  # pure Python, same ids as tensorflow-text: no TensorFlow in workers
            self._wordpiece_ids = WordPieceIds(self.vocab, self.unk_id, _MAX_BYTES_PER_WORD)
        return self._wordpiece_ids.ids_batch(texts)

    def word_start_table(self) -> np.ndarray:
        """bool [vocab_size]: True where a token begins a word and for special tokens; False for
        continuation pieces (`##x` in WordPiece, pieces without `▁` in SentencePiece). Whole-word masking
        groups tokens with it: words are eojeols (morpheme-aware SentencePiece vocabularies too, whose
        continuing morphemes have no `▁`; morpheme-aware WordPiece ones mask morphemes)."""
        if self.kind == "sentencepiece":
            table = np.array([p.startswith("\u2581") for p in self.vocab])
        else:
            table = np.array([not p.startswith("##") for p in self.vocab])
        for i in self.special_ids.values():
            table[i] = True
        if self.kind == "sentencepiece":
            for i in range(self.vocab_size):
                if self._sp.is_control(i) or self._sp.is_unknown(i) or self._sp.is_byte(i):
                    table[i] = not self._sp.is_byte(i)
        return table

    def tokenize(self, text: str) -> List[str]:
        """Subword tokens of `text` (no special tokens)."""
        return self.encode(text, add_special_tokens=False).tokens

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (or of an `Encoding`, as `encode` returns). For SentencePiece vocabularies
        `decode(encode(x)) == normalize(x)`; WordPiece cannot know whether punctuation had a space before it,
        and puts none before `##` pieces only."""
        if isinstance(ids, Encoding):
            ids = ids.ids
        elif isinstance(ids, (str, bytes)):
            raise TypeError(f"decode expects token ids (a list of ints or an Encoding). Received a "
                            f"{type(ids).__name__}: {str(ids)[:40]!r}; to normalize text use kbert.normalize")
        try:
            ids = [int(i) for i in ids]
        except TypeError:
            raise TypeError(f"decode expects token ids (a list of ints or an Encoding); received a sequence of "
                            f"{type(next(iter(ids))).__name__}. A batch: [tok.decode(e) for e in encodings]") from None
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"Token id {i} is out of range for a vocabulary of {self.vocab_size}")
        special = set(self.special_ids.values())
        if skip_special_tokens:
            ids = [i for i in ids if i not in special]
        if self.kind == "sentencepiece":
            text = self._sp.decode(ids)
            if self._segmented and text.startswith(" "):  # no dummy prefix to drop: drop the first space
                text = text[1:]
        else:
            words = []
            for i in ids:
                tok = self.vocab[i]
                if tok.startswith("##") and words:
                    words[-1] += tok[2:]
                else:
                    words.append(tok)
            text = " ".join(words)
        return text.replace(" " + JOINER, "").replace(JOINER, "")

    # ---------------------------------------------------------------- in the graph
    def _fast_bert(self):
        if self._graph is None:
            import tensorflow as tf
            import tensorflow_text as tf_text

            with tf.init_scope():  # built eagerly even when first used inside ds.map
                self._graph = tf_text.FastBertTokenizer(
                vocab=self.vocab, suffix_indicator="##", max_bytes_per_word=_MAX_BYTES_PER_WORD,
                token_out_type=tf.int32,
                unknown_token=self.vocab[self.unk_id], no_pretokenization=False,
                support_detokenization=True, lower_case_nfd_strip_accents=False)
        return self._graph

    def _offsets_fn(self):
        """FastBertTokenizer.tokenize_with_offsets, as one traced graph once this tokenizer is in steady use: run
        eagerly, its ragged ops dispatch one by one from Python (about a hundred of them), which costs more than
        the tokenizing itself for the short batches a server or a reranker sends. Tracing costs as much as a few
        dozen eager calls, so a tokenizer used a few times (a script, a test) stays eager."""
        fast = self._fast_bert()
        if getattr(self, "_offsets", None) is not None:
            return self._offsets
        self._offset_calls = getattr(self, "_offset_calls", 0) + 1
        if self._offset_calls < TRACE_AFTER_CALLS:
            return fast.tokenize_with_offsets
        import tensorflow as tf

        self._offsets = tf.function(fast.tokenize_with_offsets, input_signature=[tf.TensorSpec([None], tf.string)])
        return self._offsets

    def _graph_tokenizer(self):
        if self.kind == "wordpiece":
            return self._fast_bert()
        if self._graph is None:
            import tensorflow as tf
            import tensorflow_text as tf_text

            with tf.init_scope():  # the model resource must outlive the first graph that uses it
                self._graph = tf_text.SentencepieceTokenizer(model=self._encoder_proto(), out_type=tf.int32)
        return self._graph

    def _unigram_graph(self):
        """For plain unigram SentencePiece models: the parts of the fast unigram op path
        (`kbert.text.fast_unigram`); None for other models."""
        if self._graph_unigram is None:
            self._graph_unigram = False
            if self.kind == "sentencepiece" and not self.morphemes:
                self._graph_unigram = fast_unigram_parts(self._encoder_proto(), self.cls_id, self.sep_id) or False
        return self._graph_unigram or None

    def _mapped_unigram_graph(self):
        """For a portable graph of a unigram model with a precompiled normalization map (XLM-RoBERTa, ALBERT,
        KoBERT): the fast op's parts without the unknown-character re-encoding; None for other models."""
        if self._graph_unigram_mapped is None:
            self._graph_unigram_mapped = False
            if self.kind == "sentencepiece" and not self.morphemes:
                self._graph_unigram_mapped = fast_unigram_parts(self._encoder_proto(), self.cls_id, self.sep_id,
                                                                allow_map=True) or False
        return self._graph_unigram_mapped or None

    def _graph_ids(self, normalized, add_special_tokens: bool, portable: bool, parts=None):
        """Ids of a 1-D batch of normalized strings from the fast unigram op (`fast_unigram_ids`); the rare
        lines too long for it go to sentencepiece in Python (`tf.numpy_function`) or, in a `portable` graph,
        to tensorflow-text's SentencePiece op."""
        if portable:
            special = self._graph_with_specials() if add_special_tokens else None

            def slow(texts):
                import tensorflow as tf

                r = (special or self._graph_tokenizer()).tokenize(texts).with_row_splits_dtype(tf.int64)
                if add_special_tokens and special is None:
                    r = add_specials(r, self.cls_id, self.sep_id)
                return r.values, r.row_lengths()
        else:
            def slow(texts):
                r = self._py_ids(texts, add_special_tokens)
                return r.values, r.row_lengths()
        return fast_unigram_ids(parts or self._unigram_graph(), normalized, add_special_tokens, slow)

    def _graph_with_specials(self):
        """Plain SentencePiece whose [CLS]/[SEP] are control pieces: an op that adds them itself (as
        SentencePiece's BOS/EOS), cheaper than concatenating ragged columns; else None."""
        if self._graph_special is None:
            self._graph_special = False
            if self.kind == "sentencepiece" and not self.morphemes and \
                    self._sp.is_control(self.cls_id) and self._sp.is_control(self.sep_id):
                import tensorflow as tf
                import tensorflow_text as tf_text
                from sentencepiece import sentencepiece_model_pb2

                proto = sentencepiece_model_pb2.ModelProto()
                proto.ParseFromString(self._encoder_proto())
                specials_as_bos_eos(proto, self.cls_id, self.sep_id)
                with tf.init_scope():
                    self._graph_special = tf_text.SentencepieceTokenizer(
                        model=proto.SerializeToString(), out_type=tf.int32, add_bos=True, add_eos=True)
        return self._graph_special or None

    def tf_tokenize(self, texts, add_special_tokens: bool = True, portable: bool = False):
        """Graph op: string tensor [] or [batch] -> int32 ids [n] or ragged [batch, (n)].

        Same ids as `encode(...).ids`. Morpheme-aware tokenizers call their analyzer through
        `tf.numpy_function` (Python) before the in-graph subword model. Unigram SentencePiece models run
        tensorflow-text's fast unigram op (`kbert.text.fast_unigram`); a line over ~3.5 KB goes to sentencepiece
        through `tf.numpy_function`.

        `portable=True` builds a graph without Python (for a SavedModel): such a line then goes through
        tensorflow-text's SentencePiece op, which breaks ties between equal-score segmentations as
        sentencepiece <= 0.2.1 did, so on a long line with a tie (a run like `.......`) the ids can differ
        from Python's. A unigram model with its own normalization map (XLM-RoBERTa, ALBERT, KoBERT), which
        the fast op cannot read exactly, calls sentencepiece through `tf.numpy_function`; portable, it runs
        the fast op without kbert's unknown-character step, the closer of the two ops to sentencepiece.
        """
        import tensorflow as tf

        # Only Python-level branching here: autograph (inside a caller's tf.function) must leave it alone.
        return tf.autograph.experimental.do_not_convert(self._tf_tokenize)(texts, add_special_tokens, portable)

    def _tf_tokenize(self, texts, add_special_tokens: bool, portable: bool):
        import tensorflow as tf

        texts = tf.convert_to_tensor(texts, tf.string)
        scalar = texts.shape.rank == 0
        batch = tf.reshape(texts, [-1])
        if self.form == "NFC":
            normalized = tf_normalize(batch, form=self.form, repeat=self.repeat, lowercase=self.lowercase)
        else:
            normalized = self._py_strings(batch, self.normalize)
        if self._segmented:
            normalized = self._py_segments(normalized)  # ragged [batch, (morphemes)]
        elif self.morphemes:
            normalized = self._py_strings(normalized, lambda t: self._presplit(t)[0])
        if self._unigram_graph():
            ids = self._graph_ids(normalized, add_special_tokens, portable)
            return ids[0] if scalar else ids
        if self.kind == "sentencepiece" and not self.morphemes and not portable and is_unigram(self._spm_proto):
            ids = self._py_ids(normalized, add_special_tokens)  # a model the fast op cannot read exactly
            return ids[0] if scalar else ids
        if portable and self._mapped_unigram_graph():  # no Python: the fast op is closer than the legacy op
            ids = self._graph_ids(normalized, add_special_tokens, portable, self._mapped_unigram_graph())
            return ids[0] if scalar else ids
        special = self._graph_with_specials() if add_special_tokens else None
        ids = (special or self._graph_tokenizer()).tokenize(normalized)
        if isinstance(ids, tf.RaggedTensor) and ids.ragged_rank > 1:  # [batch, words or morphemes, pieces]
            ids = ids.merge_dims(1, 2)
        if add_special_tokens and special is None:
            ids = add_specials(ids, self.cls_id, self.sep_id)
        return ids[0] if scalar else ids

    def _py_ids(self, texts, add_special_tokens: bool):
        """sentencepiece's own ids for a 1-D batch of normalized strings, through `tf.numpy_function`."""
        import tensorflow as tf

        cls, sep = ([self.cls_id], [self.sep_id]) if add_special_tokens else ([], [])

        def run(arr):
            rows = [cls + r + sep for r in self._sp.encode([t.decode("utf-8") for t in arr])] if len(arr) else []
            flat = np.fromiter((i for r in rows for i in r), np.int32, sum(map(len, rows)))
            return flat, np.array([len(r) for r in rows], np.int64)

        flat, lengths = tf.numpy_function(run, [texts], [tf.int32, tf.int64], stateful=False)
        flat.set_shape([None])
        lengths.set_shape([None])
        return tf.RaggedTensor.from_row_lengths(flat, lengths, validate=False)

    @staticmethod
    def _py_strings(texts, fn):
        import tensorflow as tf

        def run(arr):
            return np.array([fn(t.decode("utf-8", errors="replace")).encode("utf-8") for t in arr], dtype=object)

        out = tf.numpy_function(run, [texts], tf.string, stateful=False)
        return tf.reshape(out, tf.shape(texts))

    def _py_segments(self, texts):
        import tensorflow as tf

        def run(arr):
            rows = [[seg.encode("utf-8") for seg, _, _ in self._segments(t.decode("utf-8", errors="replace"))]
                    for t in arr]
            flat = np.array([seg for row in rows for seg in row] or [b""], dtype=object)[:sum(map(len, rows))]
            return flat, np.array([len(row) for row in rows], np.int64)

        flat, lengths = tf.numpy_function(run, [texts], [tf.string, tf.int64], stateful=False)
        flat.set_shape([None])
        lengths.set_shape([None])
        return tf.RaggedTensor.from_row_lengths(flat, lengths)

    def __call__(self, texts):
        """`ds.map(tok)`: the in-graph tokenizer (see `tf_tokenize`)."""
        return self.tf_tokenize(texts)

    # --------------------------------------------------------------- persistence
    def save(self, directory: str) -> str:
        os.makedirs(check_local_path(directory, "tokenizer dir"), exist_ok=True)
        meta = {"kind": self.kind, "morphemes": self.morphemes, "form": self.form, "repeat": self.repeat,
                "lowercase": self.lowercase, "special_tokens": self.special_tokens, "format_version": 1}
        if self.kind == "sentencepiece":
            with open(os.path.join(directory, SPM_FILE), "wb") as f:
                f.write(self._spm_proto)
        else:
            with open(os.path.join(directory, VOCAB_FILE), "w", encoding="utf-8") as f:
                f.write("\n".join(self.vocab) + "\n")
        with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2, ensure_ascii=False)
        return directory

    def export_transformers(self, directory: str) -> str:
        """Writes this vocabulary so `transformers.AutoTokenizer.from_pretrained(directory)` gives kbert's ids.

        - WordPiece: `vocab.txt` + `tokenizer_config.json` for BertTokenizer with Korean-safe settings (no
          accent stripping, so no NFD).
        - SentencePiece unigram (kbert's default): a `tokenizer.json` built with Hugging Face `tokenizers`
          (the library behind every fast tokenizer): kbert's normalization as its normalizer
          (`kbert.text.normalize.tokenizers_normalizer`), `▁` word boundaries, the unigram pieces with their
          scores and byte fallback, `[CLS] a [SEP] b [SEP]` with segment ids; PreTrainedTokenizerFast reads it.
          Tests compare the ids with `encode` on thousands of reviews and sentences.

        Morpheme-aware vocabularies (an analyzer runs in Python first), SentencePiece BPE, `form="NFKC"` and
        `repeat` have no exact transformers equivalent and raise ValueError.
        """
        if self.morphemes:
            raise ValueError(f"a {self.morphemes}-morpheme tokenizer runs its analyzer in Python before the "
                             f"vocabulary; transformers has no equivalent, so it does not export")
        if self.kind == "sentencepiece" and is_fairseq_layout(self._spm_proto):  # XLM-RoBERTa's, as it came
            return export_fairseq(self._spm_proto, directory)
        if self.kind == "sentencepiece":
            return self._export_unigram(directory)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, VOCAB_FILE), "w", encoding="utf-8") as f:
            f.write("\n".join(self.vocab) + "\n")
        config = {"tokenizer_class": "BertTokenizer", "do_lower_case": self.lowercase, "strip_accents": False,
                  "tokenize_chinese_chars": True, "model_max_length": 512, **self._special_token_names()}
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
        return directory

    def fast_tokenizer(self):
        """This vocabulary as a Hugging Face `tokenizers.Tokenizer` (what a `tokenizer.json` holds) giving kbert's
        ids: the unigram one of `export_transformers`, or for WordPiece BERT's normalizer (no accent stripping),
        pre-tokenizer and `[CLS] a [SEP] b [SEP]`. Model2Vec and sentence-transformers' static models read their
        vocabulary this way. Raises ValueError where `export_transformers` does."""
        if self.morphemes or self.kind == "sentencepiece":
            if self.morphemes or is_fairseq_layout(self._spm_proto):
                raise ValueError("a morpheme-aware or fairseq-numbered vocabulary has no exact tokenizer.json "
                                 "(export_transformers says why)")
            return self._unigram_fast()
        from tokenizers import Tokenizer as FastTokenizer, decoders, models, normalizers, pre_tokenizers, processors

        names = self._special_token_names()
        fast = FastTokenizer(models.WordPiece({t: i for i, t in enumerate(self.vocab)}, unk_token=names["unk_token"]))
        fast.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=False,
                                                     lowercase=self.lowercase)
        fast.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        cls, sep = names["cls_token"], names["sep_token"]
        fast.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
            special_tokens=[(cls, self.cls_id), (sep, self.sep_id)])
        fast.decoder = decoders.WordPiece()
        return fast

    def _special_token_names(self) -> dict:
        return {"unk_token": self.vocab[self.unk_id], "sep_token": self.vocab[self.sep_id],
                "pad_token": self.vocab[self.pad_id], "cls_token": self.vocab[self.cls_id],
                "mask_token": self.vocab[self.mask_id]}

    def _unigram_fast(self):
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            raise ValueError("a unigram vocabulary goes to transformers as a tokenizer.json, which needs Hugging Face "
                             "`tokenizers` (pip install tokenizers; transformers depends on it)") from None
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(self._spm_proto)
        trainer = proto.trainer_spec
        if trainer.model_type != sentencepiece_model_pb2.TrainerSpec.UNIGRAM:
            raise ValueError("only unigram SentencePiece vocabularies export to transformers exactly (a BPE model's "
                             "merges are not stored); train with algorithm='unigram' or 'wordpiece'")
        if not _sees_text_as_given(proto) or not trainer.split_by_whitespace:
            raise ValueError("this SentencePiece model normalizes or splits text itself (not a kbert-trained "
                             "vocabulary); load it in transformers with its own tokenizer class")
        from tokenizers import AddedToken, Tokenizer as FastTokenizer, decoders, models, pre_tokenizers, processors

        types = sentencepiece_model_pb2.ModelProto.SentencePiece
        fast = FastTokenizer(models.Unigram([(p.piece, p.score) for p in proto.pieces], unk_id=self.unk_id,
                                            byte_fallback=trainer.byte_fallback))
        fast.normalizer = unigram_json_normalizer(self.form, self.repeat, self.lowercase)
        # SentencePiece sees `▁` + the text with its (single) spaces as `▁` and splits before each `▁`. Here
        # the spaces are dropped and each word gets a `▁` prepended, which `tokenizers` aligns with the word's
        # first character: so a word's first piece (▁경) is offset on the word, not on the space before it, as
        # in XLM-RoBERTa's tokenizer.json and what pipelines' entity and answer spans need. Metaspace prepends
        # only to a word not already starting with `▁`; the normalizer doubles such a literal `▁` so the ids
        # stay SentencePiece's.
        fast.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(" ", "removed"),
            pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)])
        fast.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                          decoders.Strip(" ", 1, 0)])
        specials = [p.piece for p in proto.pieces if p.type in (types.CONTROL, types.UNKNOWN)]
        fast.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        # user-defined symbols stay in the unigram model: their score 0 beats any split of them, which is how
        # SentencePiece always keeps them whole (as added tokens they would be normalized with the `▁` prefix)
        cls, sep = self.vocab[self.cls_id], self.vocab[self.sep_id]
        fast.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
            special_tokens=[(cls, self.cls_id), (sep, self.sep_id)])
        return fast

    def _export_unigram(self, directory: str) -> str:
        fast = self._unigram_fast()
        os.makedirs(directory, exist_ok=True)
        fast.save(os.path.join(directory, "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512,
                  "clean_up_tokenization_spaces": False,
                  "model_input_names": ["input_ids", "token_type_ids", "attention_mask"], **self._special_token_names()}
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
        return directory

    @classmethod
    def from_model_dir(cls, model_dir: str) -> "Tokenizer":
        """The tokenizer of a model dir: its `tokenizer/` subdir (kbert model dirs), else the vocabulary in the
        dir itself (a Hugging Face dir's vocab.txt, a KoBERT/ALBERT `.model`)."""
        sub = os.path.join(model_dir, MODEL_TOKENIZER_DIR)
        try:
            return cls.load(sub if os.path.isdir(sub) else model_dir)
        except (FileNotFoundError, ValueError) as e:
            raise FileNotFoundError(f"{model_dir!r} has no tokenizer kbert can read (a `tokenizer/` dir, vocab.txt "
                                    f"or a SentencePiece .model): {e}") from None

    @classmethod
    def load(cls, path: str, **overrides) -> "Tokenizer":
        """A kbert tokenizer dir, a WordPiece `vocab.txt`, a SentencePiece `.model`, or a directory
        (e.g. a Hugging Face model dir) holding one of them. Keyword overrides set normalization
        options (`lowercase=True` for an uncased vocab.txt) or `special_tokens`."""
        if os.path.isdir(path):
            meta = None  # tokenizer.json, parsed once: kbert's own, or a Hugging Face one
            if os.path.isfile(os.path.join(path, CONFIG_FILE)):
                with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as f:
                    meta = json.load(f)
                if "kind" in meta:  # kbert's own (a Hugging Face tokenizer.json has no "kind")
                    meta.pop("format_version", None)
                    kind = meta.pop("kind")
                    meta.update(overrides)
                    model_path = os.path.join(path, SPM_FILE if kind == "sentencepiece" else VOCAB_FILE)
                    return cls(kind, _read_model(model_path, kind), **meta)
            fairseq = is_fairseq_dir(path)  # XLM-RoBERTa's numbering of its SentencePiece model
            for name in sorted(os.listdir(path)):
                if name == VOCAB_FILE or name.endswith(".model"):
                    if fairseq and name.endswith(".model"):
                        proto = fairseq_layout(_read_model(os.path.join(path, name), "sentencepiece"))
                        return cls._from_sentencepiece(proto, overrides)
                    return cls.load(os.path.join(path, name), **overrides)
            if meta is not None:  # a Hugging Face tokenizer.json alone
                hf_path = os.path.join(path, CONFIG_FILE)
                if (meta.get("model") or {}).get("type") == "Unigram":  # SentencePiece's, converted by transformers
                    # (or kbert's own export: its normalization settings come back too)
                    return cls._from_sentencepiece(unigram_from_json(hf_path, meta),
                                                   {**(json_normalization(meta) or {}), **overrides})
                vocab, lowercase = _hf_wordpiece(hf_path, meta)
                return cls("wordpiece", vocab, **{"lowercase": lowercase, **overrides})
            raise FileNotFoundError(f"{path!r} holds no tokenizer: expected {CONFIG_FILE} (kbert, or a Hugging Face "
                                    f"WordPiece one), {VOCAB_FILE} (WordPiece) or a SentencePiece .model")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Tokenizer file not found: {path!r}")
        if path.endswith(".model"):
            return cls._from_sentencepiece(_read_model(path, "sentencepiece"), overrides)
        return cls("wordpiece", _read_model(path, "wordpiece"), **overrides)

    @classmethod
    def _from_sentencepiece(cls, proto: bytes, overrides: dict) -> "Tokenizer":
        """A SentencePiece tokenizer of `proto`, its special tokens found by their usual names."""
        import sentencepiece as spm

        overrides = dict(overrides)
        sp = spm.SentencePieceProcessor(model_proto=proto)
        pieces = {sp.id_to_piece(i) for i in range(sp.get_piece_size())}
        specials = dict(overrides.pop("special_tokens", {}) or {})
        for role, choices in (("pad", ("[PAD]", "<pad>")), ("unk", ("[UNK]", "<unk>")),
                              ("cls", ("[CLS]", "<s>", "<cls>")), ("sep", ("[SEP]", "</s>", "<sep>")),
                              ("mask", ("[MASK]", "<mask>"))):
            found = next((c for c in choices if c in pieces), None)
            if role not in specials and found is not None:
                specials[role] = found
        return cls("sentencepiece", proto, special_tokens=specials, **overrides)

    # ------------------------------------------------------------------- training
    @classmethod
    def train(cls, inputs, vocab_size: int, algorithm: str = "unigram", morphemes: Optional[str] = None,
              user_defined_symbols: Sequence[str] = (), form: str = "NFC", repeat: Optional[int] = None,
              lowercase: bool = False, character_coverage: float = 0.9995, max_sentences: int = 5_000_000,
              min_line_chars: int = 1, progress: bool = True, seed: int = 0) -> "Tokenizer":
        """Learns a vocabulary from files (paths) or an iterable of strings.

        Args:
            inputs: a path, a list of paths (plain text, .gz/.bz2), a `kbert.corpus(...)`, or an iterable
                of strings (a list's items that name files are read as files; a generator's are text).
            vocab_size: size of the vocabulary including the special tokens
                `[PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4`.
            algorithm: `"unigram"` (SentencePiece, the default), `"bpe"` (SentencePiece), or
                `"wordpiece"` (a BERT `vocab.txt` with `##` continuation pieces, learned with
                SentencePiece BPE and converted).
            morphemes: a `kbert.morphemes` backend to pre-split eojeols into morphemes, or None.
            user_defined_symbols: extra tokens kept whole (e.g. `["[URL]", "[EMAIL]"]`).
            character_coverage: share of characters the vocabulary covers; every complete Hangul
                syllable seen in training is always covered (never [UNK]).
            max_sentences: at most this many lines are sampled for training.

        Raises:
            ValueError: unknown algorithm, no text, or a `vocab_size` the corpus cannot fill (the
                message says the largest size that works).
        """
        helper = cls.__new__(cls)  # only for normalize/presplit with these options
        helper.form, helper.repeat, helper.lowercase = form, repeat, lowercase
        helper.morphemes, helper._analyzer = morphemes, None
        helper.kind = "wordpiece" if algorithm == "wordpiece" else "sentencepiece"
        kind, model = train_vocabulary(
            inputs, vocab_size, algorithm, normalize=helper.normalize, analyze=helper._morphemes_batch,
            training_line=helper._training_line, split_morphemes=bool(morphemes), segmented=helper._segmented,
            user_defined_symbols=user_defined_symbols, character_coverage=character_coverage,
            max_sentences=max_sentences, min_line_chars=min_line_chars, progress=progress)
        return cls(kind, model, morphemes=morphemes, form=form, repeat=repeat, lowercase=lowercase)


# -------------------------------------------------------------------------------------- helpers
VERSION_WARNED = []


def check_sentencepiece_version(version: str):
    """sentencepiece 0.2.2 changed how unigram ties between equal-score segmentations are broken (`..` +
    `...` vs `...` + `..`); kbert's in-graph unigram path follows 0.2.2-0.2.3, so with an older version
    Python ids differ from `ds.map(tok)` on runs like `.....`."""
    try:
        older = tuple(int(x) for x in version.split(".")[:3]) < (0, 2, 2)
    except ValueError:
        return
    if older and not VERSION_WARNED:
        import warnings

        VERSION_WARNED.append(version)
        warnings.warn(f"sentencepiece {version} is installed; kbert needs >=0.2.2 (setup.py pins it) for "
                      "Python ids equal to the in-graph tokenizer's: pip install 'sentencepiece>=0.2.2,<0.2.4'",
                      stacklevel=3)


def _byte_to_char(text: str) -> List[int]:
    """Map from UTF-8 byte offset to character offset (length bytes+1)."""
    out = []
    for i, ch in enumerate(text):
        out.extend([i] * len(ch.encode("utf-8")))
    out.append(len(text))
    return out


def _truncate(a, b, budget):
    budget = max(budget, 0)
    a, b = list(a), (list(b) if b is not None else None)
    while len(a) + (len(b) if b is not None else 0) > budget:
        if b is not None and len(b) > len(a):
            b.pop()
        else:
            a.pop()
    return a, b


def _read_model(path: str, kind: str):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Tokenizer file not found: {path!r}")
    if kind == "sentencepiece":
        with open(path, "rb") as f:
            proto = f.read()
        import sentencepiece as spm

        try:
            spm.SentencePieceProcessor(model_proto=proto)
        except Exception as e:
            raise ValueError(f"{path} is not a SentencePiece model: {e}") from None
        return proto
    with open(path, encoding="utf-8", errors="strict") as f:
        vocab = [line.rstrip("\n").rstrip("\r") for line in f]
    while vocab and vocab[-1] == "":
        vocab.pop()
    if not vocab:
        raise ValueError(f"{path} is an empty vocabulary")
    return vocab

