"""Normalization, morpheme analyzers and the Tokenizer (Python vs tf.data, training, imports, bad input)."""

import os
import subprocess
import sys
import unicodedata
import warnings

import pytest

import kbert
from helpers import KOREAN_SENTENCES, SHARED, needs_shared

import konlpy

KONLPY_CORPUS = os.path.join(os.path.dirname(konlpy.__file__), "data", "corpus")
TRAIN_FILES = [os.path.join(KONLPY_CORPUS, d, f) for d in ("kolaw", "kobill")
               for f in sorted(os.listdir(os.path.join(KONLPY_CORPUS, d)))]
VARIED = KOREAN_SENTENCES + [
    unicodedata.normalize("NFD", "학교에서 공부했어요"),  # NFD input must come back composed
    "  여러   칸\t띄어쓰기\n줄바꿈\u3000전각공백 ",
    "제1조(목적) 이 법은 2023.12.31.부터 시행한다.",
    "ㅋㅋㅋㅋㅋ 대박!!!!!",
    "",
    "English only sentence.",
]


# ------------------------------------------------------------------------------------ normalize
def test_normalize_never_decomposes_hangul():
    nfd = unicodedata.normalize("NFD", "한국어")
    assert len(nfd) > 3 and kbert.normalize(nfd) == "한국어"


def test_normalize_rules():
    assert kbert.normalize(" a\u200bb \x07c\t\n d ") == "ab c d"
    assert kbert.normalize("ㅋㅋㅋㅋㅋ 와!!!!", repeat=2) == "ㅋㅋ 와!!"
    assert kbert.normalize("ㅋㅋㅋ") == "ㅋㅋㅋ"
    old = "옛한글 \u1112\u119e\u11ab글 ㄱㄴㄷ"
    assert kbert.normalize(old) == old  # old Hangul conjoining jamo and compatibility jamo survive
    assert kbert.normalize("ＡＢＣ１２３ ㅋㅋ", form="NFKC") == "ABC123 ㅋㅋ"
    assert kbert.normalize("BERT", lowercase=True) == "bert"
    assert kbert.normalize(b"\xed\x95\x9c\xff") == "한\ufffd"
    # UTF-16 surrogates in a str (JSON's "\ud83d", a JavaScript string cut mid-pair): a lone one is U+FFFD as
    # invalid bytes are, a pair split in two is its character; such text then tokenizes, where it had failed
    assert kbert.normalize("한\ud83d 글\ude00") == "한\ufffd 글\ufffd"
    assert kbert.normalize("\ud83d\ude00 ㅋ") == "\U0001f600 ㅋ"
    with pytest.raises(ValueError, match="`form` must be one of"):
        kbert.normalize("x", form="NFD")
    with pytest.raises(TypeError, match="expects str or bytes"):
        kbert.normalize(None)


@pytest.mark.parametrize("repeat", [None, 2])
def test_tf_normalize_matches_python(repeat):
    import tensorflow as tf

    from kbert.text.normalize import tf_normalize

    texts = VARIED + ["ㅋㅋㅋㅋㅋ!!!!ㅎㅎㅎ", "\u00a0앞뒤\u00a0"]
    out = [t.decode("utf-8") for t in tf_normalize(tf.constant(texts), repeat=repeat).numpy()]
    assert out == [kbert.normalize(t, repeat=repeat) for t in texts]
    one = tf_normalize(tf.constant(texts[0])).numpy().decode("utf-8")
    assert one == kbert.normalize(texts[0])


def test_tf_normalize_fast_path_edges():
    """Strings one character away from "already normal" must still take the full chain."""
    import tensorflow as tf

    from kbert.text.normalize import tf_normalize

    texts = ["한국어 문장", "한국어  문장", " 한국어", "한국어 ", "한국어\t문장", "한국어\u3000문장",
             "가\u11a8", "\u1100\u1161", "e\u0301", "\u212b", "\u2329괄호\u232a", "a\u200bb", "a\u00adb",
             "♥♡★ ☆ ○", "ㅋㅋ ㅎㅎ", "Ｆｕｌｌ", "😀👍🏻", "\ufffd", "",
             # only extra ASCII spaces (the cheap path), and one step away from it
             "  앞  뒤   공백  ", "   ", " ", "a  b ", "  가\u11a8  ", "  a\u200bb ", "  한국어\t문장 ", "  \u3000 "]
    raw = [t.encode("utf-8") for t in texts] + [b"\xed\x95\x9c\xff", b"ab\xc0\xaf", b"\xed\xa0\x80x", b"a  \xff  b "]
    expected = [kbert.normalize(t) for t in raw]
    assert [t.decode("utf-8") for t in tf_normalize(tf.constant(raw)).numpy()] == expected
    grid = tf_normalize(tf.reshape(tf.constant(raw[:20]), [4, 5])).numpy()  # any shape
    assert grid.shape == (4, 5) and [t.decode("utf-8") for t in grid.ravel()] == expected[:20]


def test_tf_normalize_stable_set_is_stable():
    """Every character the graph normalizer lets through untouched is one NFC, control removal and
    whitespace collapsing leave alone, and no neighbour composes with it."""
    import re

    from kbert.text.normalize import CONTROL_RE, RE2_STABLE, SPACE_RE

    second = {int(d.split()[1], 16) for d in (unicodedata.decomposition(chr(c)) for c in range(0x110000))
              if d and not d.startswith("<") and len(d.split()) == 2}
    second |= set(range(0x1161, 0x1176)) | set(range(0x11a8, 0x11c3))  # Hangul vowel and final jamo
    bounds = [int(h, 16) for h in re.findall(r"\\x\{([0-9a-f]+)\}", RE2_STABLE)]
    ranges = list(zip(bounds[::2], bounds[1::2]))
    assert ranges and all(a <= b for a, b in ranges)
    for a, b in ranges:
        for cp in range(a, b + 1):
            c = chr(cp)
            assert unicodedata.category(c) not in ("Mn", "Mc", "Me", "Cc", "Cf", "Cs", "Co"), hex(cp)
            assert unicodedata.normalize("NFC", c) == c and not unicodedata.combining(c), hex(cp)
            assert cp not in second and not CONTROL_RE.match(c) and not SPACE_RE.match(c), hex(cp)


# ------------------------------------------------------------------------------------ morphemes
SENTENCE = "학교에서 공부했어요. 옛한글 ᄒᆞᆫ글과 ㅋㅋ BERT2024!"


@pytest.mark.parametrize("name", ["mecab", "kiwi", "okt", "komoran", "hannanum", "kkma"])
def test_morpheme_offsets_slice_back(name):
    analyzer = kbert.morphemes(name)
    ms = analyzer(SENTENCE)
    assert ms and all(SENTENCE[m.start:m.end] == m.surface for m in ms)
    # Eojeol starts rebuild the whitespace words.
    words = [SENTENCE[g[0].start:max(m.end for m in g)] for g in analyzer.words(SENTENCE)]
    assert words == SENTENCE.split()
    if name in ("mecab", "okt"):  # analyzers that report surface forms
        assert all(m.form == m.surface for m in ms)
    assert analyzer("") == [] and analyzer("   ") == []
    # a lone UTF-16 surrogate (the taggers raised on it) is read as U+FFFD, one character for one: the
    # offsets still slice the text as given
    broken, read = "대한\ud800민국 헌법", "대한\ufffd민국 헌법"
    ms = analyzer(broken)
    assert ms and all(read[m.start:m.end] == m.surface for m in ms), ms
    assert any(m.start <= 2 < m.end for m in ms), ms


def test_mecab_fast_offsets_equal_general_alignment():
    """MeCab's morphemes take their offsets by searching forward in the text; the general `align` (used
    for the other analyzers) gives the same on real reviews and on awkward whitespace, and neither makes
    a morpheme of a space character (MeCab tags U+3000 as a symbol)."""
    from kbert.text.morphemes import Analyzer

    analyzer = kbert.morphemes("mecab")
    texts = VARIED + [SENTENCE, "[ 스토리 7 ]\u3000화려한 액션", "\u3000전각 공백\u3000", "탭\t다음\n줄", "😀👍🏻 좋아",
                      "x\u200by", "漢字 ㅋㅋㅋ", "a  b", "\u00a0앞뒤\u00a0", "제1조(목적)"]
    if os.path.isdir(SHARED):
        import gzip

        with gzip.open(os.path.join(SHARED, "movie-reviews", "reviews.tsv.gz"), "rt", encoding="utf-8") as f:
            next(f)
            texts += [line.rstrip("\n").split("\t")[-1] for _, line in zip(range(3000), f)]
    for text in texts:
        fast = analyzer(text)
        assert fast == Analyzer.__call__(analyzer, text), text
        assert all(text[m.start:m.end] == m.surface and not m.surface.isspace() for m in fast), text
    assert [m.surface for m in analyzer("[ 스토리 7 ]\u3000화려한")][-2:] == ["화려", "한"]


def test_konlpy_analyzers_unhook_jpype_from_python_gc():
    """JPype hooks every Python collection once the JVM is up and calls glibc's mallinfo() from it, which in
    a process of a few GB with TensorFlow's threads costs ~45 ms per collection: pure-Python code in this
    suite ran 20-60x slower after the konlpy tests (the code-point WordPiece test: 11 s alone, 5 min here).
    kbert removes the hook when it starts a konlpy tagger; a fresh interpreter shows the hook there before."""
    script = (
        "import gc, _jpype, kbert\n"
        "hooked = lambda: sum(cb is _jpype._collect for cb in gc.callbacks)\n"
        "import jpype, konlpy.jvm\n"
        "konlpy.jvm.init_jvm()\n"  # the JVM started outside kbert: JPype's hook is in place
        "assert jpype.isJVMStarted() and hooked(), gc.callbacks\n"
        "a = kbert.morphemes('okt')\n"
        "assert [m.surface for m in a('학교에서 공부했다')][:2] == ['학교', '에서']\n"
        "assert hooked() == 0, gc.callbacks\n"
        "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(kbert.__file__)),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize("name", ["mecab", "kiwi"])
def test_morpheme_batch_matches_single(name):
    analyzer = kbert.morphemes(name)
    texts = KOREAN_SENTENCES * 400  # large enough to use worker processes
    assert analyzer.batch(texts, workers=2) == [analyzer(t) for t in texts]


def test_unknown_morpheme_backend():
    with pytest.raises(ValueError, match="Unknown morpheme backend 'jieba'.*mecab, kiwi, okt"):
        kbert.morphemes("jieba")


def test_missing_backend_says_what_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake(name, *a, **k):
        if name == "kiwipiepy":
            raise ImportError("no")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    import importlib

    monkeypatch.setattr(importlib, "import_module", lambda n: fake(n))
    with pytest.raises(ImportError, match=r"morphemes\('kiwi'\) needs kiwipiepy: pip install kiwipiepy"):
        kbert.morphemes("kiwi")("문장")


# ------------------------------------------------------------------------------------ tokenizer
@pytest.fixture(scope="module")
def tokenizers():
    out = {}
    for algo, morph, size in [("unigram", None, 2000), ("bpe", None, 2000), ("wordpiece", None, 2000),
                              ("unigram", "mecab", 1200), ("bpe", "mecab", 1200)]:
        out[(algo, morph)] = kbert.Tokenizer.train(TRAIN_FILES, vocab_size=size, algorithm=algo,
                                                    morphemes=morph, progress=False)
    return out


def test_special_tokens_at_fixed_ids(tokenizers):
    for tok in tokenizers.values():
        assert tok.vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 1, 2, 3, 4)


@pytest.mark.parametrize("key", [("unigram", None), ("bpe", None), ("unigram", "mecab"), ("bpe", "mecab")])
def test_round_trip(tokenizers, key):
    tok = tokenizers[key]
    for text in VARIED:
        enc = tok.encode(text)
        assert tok.decode(enc.ids) == kbert.normalize(text), text
        assert enc.ids[0] == tok.cls_id and enc.ids[-1] == tok.sep_id


@pytest.mark.parametrize("key", [("unigram", "mecab"), ("bpe", "mecab")])
def test_morpheme_aware_pieces_stay_inside_morphemes(tokenizers, key):
    """No piece crosses a morpheme boundary, eojeols alone start with `▁`, and no joiner token is spent."""
    from kbert.text.tokenizer import JOINER

    tok = tokenizers[key]
    assert not any(JOINER in piece for piece in tok.vocab)
    assert tok.vocab_size == 1200  # as asked, although sentencepiece < 0.2.2 learns the delimiter as a piece
    for text in ["학교에서 공부했어요", "이 법은 국민의 권리를 보장한다.", "제1조(목적) 대통령령으로 정한다"]:
        enc = tok.encode(text, add_special_tokens=False)
        morphs = kbert.morphemes("mecab")(text)
        for s, e in enc.offsets:
            assert s == e or any(m.start <= s and e <= m.end for m in morphs), (text, s, e)
        assert sum(t.startswith("\u2581") for t in enc.tokens) == len(text.split())
        assert enc.ids == tok.ids_batch([text])[0]
        assert all(text[s:e] == t.lstrip("\u2581") for t, (s, e) in zip(enc.tokens, enc.offsets)
                   if not t.startswith("<0x"))
    many = [f"{i}번째 문장에서 공부했어요" for i in range(2100)]  # enough for the analyzer's worker processes
    assert [e.ids[1:-1] for e in tok.encode_batch(many)] == [tok.encode(t, add_special_tokens=False).ids
                                                             for t in many[:3]] + tok.ids_batch(many)[3:]


def test_wordpiece_offsets_are_the_same_once_traced(tokenizers):
    """A WordPiece tokenizer in steady use runs its offsets through one traced graph (after TRACE_AFTER_CALLS
    eager calls): its ids, tokens and offsets stay those of the eager calls, pairs and an empty text included."""
    import pickle

    from kbert.text.tokenizer import TRACE_AFTER_CALLS

    tok = pickle.loads(pickle.dumps(tokenizers[("wordpiece", None)]))  # a fresh copy: no calls counted yet
    texts, pairs = ["대한민국은 민주공화국이다.", "", "국회는 법률을 제정한다 ABC"], ["헌법", "모든 국민은", ""]
    first = tok.encode_batch(texts, pairs=pairs)
    for _ in range(TRACE_AFTER_CALLS):
        tok.encode_batch(texts[:1])
    assert tok._offsets is not None  # traced by now
    again = tok.encode_batch(texts, pairs=pairs)
    assert [(e.ids, e.tokens, e.offsets) for e in again] == [(e.ids, e.tokens, e.offsets) for e in first]


def test_wordpiece_round_trip_up_to_spaces(tokenizers):
    tok = tokenizers[("wordpiece", None)]
    text = "제1조(목적) 이 법은 국민의 권리를 보장한다."
    assert tok.decode(tok.encode(text).ids).replace(" ", "") == text.replace(" ", "")


@pytest.mark.parametrize("key", [("unigram", None), ("wordpiece", None), ("unigram", "mecab")])
def test_offsets_point_into_normalized_text(tokenizers, key):
    tok = tokenizers[key]
    for text in VARIED:
        enc = tok.encode(text, add_special_tokens=False)
        for token, (s, e) in zip(enc.tokens, enc.offsets):
            assert 0 <= s <= e <= len(enc.normalized)
            piece = token.replace("\u2581", "").replace("##", "").replace(kbert.text.tokenizer.JOINER, "")
            if not token.startswith("<0x") and token != "[UNK]" and piece:
                assert enc.normalized[s:e] == piece, (token, enc.normalized[s:e])


@pytest.mark.parametrize("key", [("unigram", None), ("bpe", None), ("wordpiece", None), ("unigram", "mecab")])
def test_python_and_tf_data_ids_identical(tokenizers, key):
    import tensorflow as tf

    tok = tokenizers[key]
    expect = [tok.encode(t).ids for t in VARIED]
    unbatched = [x.numpy().tolist() for x in tf.data.Dataset.from_tensor_slices(VARIED).map(tok)]
    batched = [row for b in tf.data.Dataset.from_tensor_slices(VARIED).batch(4).map(tok)
               for row in b.to_list()]
    assert unbatched == expect and batched == expect
    assert [e.ids for e in tok.encode_batch(VARIED)] == expect


@needs_shared
@pytest.mark.parametrize("algorithm", ["unigram", "bpe"])
def test_python_and_tf_data_ids_identical_on_reviews_with_tied_segmentations(algorithm):
    """Runs like `.....` or `ㅋㅋㅋㅋ` have segmentations of equal score (`..` + `...` or `...` + `..`);
    sentencepiece 0.2.2+ breaks such ties differently from tensorflow-text's SentencePiece op (0.6% of
    reviews), so kbert's unigram graph runs the fast op, which breaks them as 0.2.2+ does, and setup.py
    pins sentencepiece. Real reviews, plus runs of each length after varied prefixes."""
    import gzip

    import tensorflow as tf

    with gzip.open(os.path.join(SHARED, "movie-reviews", "reviews.tsv.gz"), "rt", encoding="utf-8") as f:
        next(f)
        reviews = [line.rstrip("\n").split("\t")[-1] for _, line in zip(range(40000), f)]
    tok = kbert.Tokenizer.train(reviews[:20000], vocab_size=4000, algorithm=algorithm, progress=False)
    assert sum(set(p.lstrip("\u2581")) == {"."} for p in tok.vocab) >= 3  # several pieces of dots
    runs = [prefix + ch * n + suffix for prefix in ("", "영화", "김예리정말최고", "이게 ")
            for ch in ".ㅋ!ㅠ" for n in range(2, 17) for suffix in ("", "ㅋ", " 재밌다")]
    texts = reviews[20000:] + runs
    graph = [row for b in tf.data.Dataset.from_tensor_slices(texts).batch(512).map(tok) for row in b.to_list()]
    python = [e.ids for e in tok.encode_batch(texts)]
    assert [i for i, (a, b) in enumerate(zip(python, graph)) if a != b] == []
    assert [ids[1:-1] for ids in python] == tok.ids_batch(texts)


def _graph_rows(tok, texts, **kwargs):
    import tensorflow as tf

    f = tf.function(lambda x: tok.tf_tokenize(x, **kwargs))
    return [row for i in range(0, len(texts), 64) for row in f(tf.constant(texts[i:i + 64])).to_list()]


def _spm_model(tmp_path, name: str, **options) -> str:
    """A 1,500-piece unigram `.model` trained by sentencepiece itself on the test corpus, the way other
    tools ship them: <pad>=0 <unk>=1 [CLS]=2 [SEP]=3 [MASK]=4 and spm's own nmt_nfkc rule unless overridden."""
    import sentencepiece as spm
    from kbert.text.vocab import text_lines

    lines = tmp_path / "train.txt"
    if not lines.exists():
        lines.write_text("".join(list(text_lines(TRAIN_FILES))[:3000]), encoding="utf-8")
    args = dict(pad_id=0, unk_id=1, bos_id=-1, eos_id=-1, pad_piece="<pad>", control_symbols="[CLS],[SEP],[MASK]")
    args.update(options)
    spm.SentencePieceTrainer.train(input=str(lines), model_prefix=str(tmp_path / name), vocab_size=1500,
                                   minloglevel=2, **args)
    return str(tmp_path / f"{name}.model")


HARD_LINES = ["", "▁", "▁▁ ▁", "<0x41>", "[CLS] [UNK]", "😀", "😀.......😀", "가😀😀나 ........", "䨻䨻 ㅋㅋㅋㅋㅋ䨻",
              "\uf8ff\uf8fe\uf8ff", "영화 \uf8ff 최고 ...... 👍🏻👍🏻", "ᄒᆞᆫ글 ........ 𠀀", "a\u200bb .... ☃☃☃"]


@pytest.mark.parametrize("kind", ["byte fallback", "unk", "user-defined"])
def test_fast_unigram_graph_equals_sentencepiece_on_hard_lines(tmp_path, tokenizers, kind):
    """Unigram models run tensorflow-text's fast op in the graph; lines with characters outside the
    vocabulary are encoded again with a placeholder piece scored as sentencepiece's unknown node, and
    lines too long for the op to follow sentencepiece (its 1e5 score rebasing) go to sentencepiece."""
    if kind == "byte fallback":
        tok = tokenizers[("unigram", None)]
    elif kind == "unk":  # no byte fallback: runs of unknown characters are one [UNK]
        tok = kbert.Tokenizer.load(_spm_model(tmp_path, "u", pad_piece="[PAD]", unk_piece="[UNK]",
                                              normalization_rule_name="identity", remove_extra_whitespaces=False))
    else:
        tok = kbert.Tokenizer.train(TRAIN_FILES, vocab_size=1500, user_defined_symbols=["[사진]", "영화관"],
                                    progress=False)
    parts = tok._unigram_graph()
    assert parts is not None and (parts["byte_table"] is None) == (kind == "unk")
    long_line = "영화관 정말 ㅋㅋㅋ ..... [사진] " * (parts["max_bytes"] // 30) + "😀...."
    assert len(long_line.encode()) > parts["max_bytes"]
    texts = HARD_LINES + [t + " [사진]영화관 ㅋㅋㅋㅋㅋ" for t in HARD_LINES] + VARIED + [long_line]
    for special in (True, False):
        python = [e.ids for e in tok.encode_batch(texts, add_special_tokens=special)]
        assert _graph_rows(tok, texts, add_special_tokens=special) == python
        # A SavedModel-ready graph (no Python) sends the long line to tensorflow-text's SentencePiece op.
        assert _graph_rows(tok, texts[:-1], add_special_tokens=special, portable=True) == python[:-1]
    import pickle

    assert pickle.loads(pickle.dumps(tok)).encode(texts[6]).ids == tok.encode(texts[6]).ids  # after graph use
    if kind == "unk":
        assert python[texts.index("😀.......😀")].count(tok.unk_id) == 2
        assert python[texts.index("\uf8ff\uf8fe\uf8ff")] == [tok.vocab.index("\u2581"), tok.unk_id]


def test_unigram_models_the_fast_op_cannot_read_run_sentencepiece(tmp_path):
    """A model with sentencepiece's own normalization map (ALBERT/KoBERT style) is not read by the fast op
    as sentencepiece reads it: `ds.map(tok)` then calls sentencepiece through `tf.numpy_function`, and a
    portable graph runs the fast op without kbert's unknown-character step."""
    tok = kbert.Tokenizer.load(_spm_model(tmp_path, "n"))
    assert tok._unigram_graph() is None
    texts = HARD_LINES + VARIED + ["Ｆｕｌｌ　ｗｉｄｔｈ ....... ①②"]
    assert _graph_rows(tok, texts) == [e.ids for e in tok.encode_batch(texts)]
    # a portable graph (no Python) runs the fast op with the model's own map, which agrees on these lines
    assert _graph_rows(tok, texts, portable=True) == [e.ids for e in tok.encode_batch(texts)]


def test_sentencepiece_version_outside_the_pin_warns(monkeypatch):
    import sentencepiece
    from kbert.text import tokenizer as module

    assert sentencepiece.__version__ in ("0.2.2", "0.2.3")  # what setup.py pins
    monkeypatch.setattr(module, "VERSION_WARNED", [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module.check_sentencepiece_version("0.2.3")
    with pytest.warns(UserWarning, match=r"sentencepiece 0\.2\.1 is installed.*>=0\.2\.2"):
        module.check_sentencepiece_version("0.2.1")


def test_offsets_from_ids_equal_sentencepiece_protos(tokenizers):
    """kbert's SentencePiece models see the text as given, so `encode` takes offsets from the ids alone
    (pieces spell `▁` + text); SentencePiece's own protos give the same, byte pieces and literal `▁` too."""
    from kbert.text.vocab import text_lines

    tok = tokenizers[("unigram", None)]
    assert tok._piece_lengths() is not None
    texts = VARIED + ["a 😀 b", "가😀나", "\u2581", "a \u2581 b", "▁▁x", "漢字混用 文章입니다", "x\u200dy", "🇰🇷🏳️‍🌈",
                      "\ue000", "\ud7fb", "[MASK] [CLS]"] + list(text_lines(TRAIN_FILES))[:2000]
    norm = [tok.normalize(t) for t in texts]
    assert tok._walked_pieces(norm) == tok._proto_pieces(norm)
    bpe = tokenizers[("bpe", None)]
    assert bpe._piece_lengths() is not None and bpe._walked_pieces(norm) == bpe._proto_pieces(norm)


def _fast_bert_ids(tok, texts):
    ids = tok._fast_bert().tokenize(texts)
    return (ids.merge_dims(1, 2) if ids.ragged_rank > 1 else ids).to_list()


def test_python_wordpiece_splits_every_code_point_like_tensorflow_text():
    """The pure-Python WordPiece (the pipeline's `ids_batch`) classifies all 1.1M code points (word
    character, separator, or a word of its own) exactly as tensorflow-text's FastBertTokenizer."""
    from kbert.text.wordpiece import WordPieceIds

    tok = kbert.Tokenizer("wordpiece", ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "##a"])
    texts = ["a" + chr(c) + "a" for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    expect = _fast_bert_ids(tok, texts)
    got = WordPieceIds(tok.vocab, tok.unk_id).ids_batch(texts)
    wrong = [hex(ord(t[1])) for t, a, b in zip(texts, got, expect) if a != b]
    assert not wrong, f"{len(wrong)} code points split differently, first ones: {wrong[:20]}"
    assert {tuple(r) for r in expect} == {(5, 5), (5, 1, 5), (1,), (5, 6, 6)}  # all three classes occur


def test_wordpiece_class_tables_are_what_unicodedata_and_the_icu_additions_give():
    """The constant word/whitespace/punctuation tables (a process no longer scans `unicodedata` at start-up)
    are exactly what `derive_tables` computes from Python 3.11's Unicode database and the ICU additions, so
    they can be regenerated when tensorflow-text's ICU moves on (the test above checks them against it)."""
    from kbert.text import wordpiece

    whitespace, punctuation = wordpiece.derive_tables()
    assert wordpiece.parse_ranges(wordpiece.WHITESPACE) == whitespace
    assert wordpiece.parse_ranges(wordpiece.PUNCTUATION) == punctuation
    assert (0xAC00, 0xAC00) not in punctuation and any(a <= 0x4E00 <= b for a, b in punctuation)


@needs_shared
def test_python_wordpiece_ids_match_tensorflow_text_on_reviews(tokenizers):
    """`ids_batch` (pure Python, no TensorFlow) == FastBertTokenizer on 20K real reviews and edge cases."""
    import gzip

    tok = tokenizers[("wordpiece", None)]
    with gzip.open(os.path.join(SHARED, "movie-reviews", "reviews.tsv.gz"), "rt", encoding="utf-8") as f:
        next(f)
        reviews = [line.rstrip("\n").split("\t")[-1] for _, line in zip(range(20000), f)]
    edge = ["가" * 134, "ab" * 201, "가" * 133, "ab" * 200, "😀👍🏻 좋아요!!", "x\u200by\ufeffz",
            "漢字混用 文章입니다", "##가 [UNK] [MASK]", "", " ", "1,000원.. 10.5%"]
    texts = [kbert.normalize(t) for t in reviews + edge + VARIED]
    assert tok.ids_batch(texts, normalized=True) == _fast_bert_ids(tok, texts)
    assert tok.ids_batch(edge[:2]) == [[tok.unk_id], [tok.unk_id]]  # over 400 UTF-8 bytes: one [UNK]


def test_no_unk_for_hangul_seen_in_training(tokenizers):
    from kbert.text.vocab import text_lines

    syllables = {ch for line in text_lines(TRAIN_FILES) for ch in kbert.normalize(line) if "가" <= ch <= "힣"}
    text = " ".join(sorted(syllables))
    for key in [("unigram", None), ("bpe", None), ("wordpiece", None)]:
        tok = tokenizers[key]
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.unk_id not in ids
        assert not any(tok.vocab[i].startswith("<0x") for i in ids)


def test_save_load_round_trip(tmp_path, tokenizers):
    for i, tok in enumerate(tokenizers.values()):
        tok.save(str(tmp_path / str(i)))
        again = kbert.Tokenizer.load(str(tmp_path / str(i)))
        assert again.vocab == tok.vocab and again.morphemes == tok.morphemes
        assert [again.encode(t).ids for t in VARIED] == [tok.encode(t).ids for t in VARIED]


def test_pair_encoding_and_truncation(tokenizers):
    tok = tokenizers[("unigram", None)]
    enc = tok.encode("대한민국은 민주공화국이다.", pair="모든 권력은 국민으로부터 나온다.")
    seps = [i for i, x in enumerate(enc.ids) if x == tok.sep_id]
    assert enc.ids[0] == tok.cls_id and len(seps) == 2 and seps[1] == len(enc.ids) - 1
    short = tok.encode("대한민국은 민주공화국이다. " * 20, pair="국민", max_length=16)
    assert len(short.ids) == 16 and short.ids.count(tok.sep_id) == 2


def test_user_defined_symbols_kept_whole():
    tok = kbert.Tokenizer.train(TRAIN_FILES, vocab_size=1500, user_defined_symbols=["[URL]"], progress=False)
    assert "[URL]" in tok.tokenize("링크 [URL] 참고")
    assert tok.vocab.index("[URL]") >= 5


# ----------------------------------------------------------------------------------- bad input
def test_bad_inputs_give_defined_results(tokenizers, tmp_path):
    tok = tokenizers[("unigram", None)]
    assert tok.encode("").ids == [tok.cls_id, tok.sep_id]
    assert tok.encode("   \t ").ids == [tok.cls_id, tok.sep_id]
    long_line = "가나다라마바사 " * 150_000  # ~1.2 MB
    enc = tok.encode(long_line, max_length=512)
    assert len(enc.ids) == 512
    assert tok.decode(tok.encode("Hello world, こんにちは").ids) == "Hello world, こんにちは"
    # a lone UTF-16 surrogate (sentencepiece and TensorFlow refuse such a str): the ids of U+FFFD in its place
    assert tok.ids_batch(["가\ud800나"]) == tok.ids_batch(["가\ufffd나"])
    assert tok.encode("가\ud800나").ids == tok.encode("가\ufffd나").ids
    for key in (("wordpiece", None), ("unigram", "mecab")):
        assert tokenizers[key].encode("가\ud800나").ids == tokenizers[key].encode("가\ufffd나").ids, key
    with pytest.raises(TypeError, match="expects str"):
        tok.encode(None)
    with pytest.raises(TypeError, match="expects a list of texts"):
        tok.encode_batch("문장")
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([10**6])


def test_training_leaves_no_copy_of_the_text_when_it_fails(tmp_path, monkeypatch):
    """The normalized text goes to a temporary file: a failed or interrupted training removes it too (each empty
    corpus, missing file or Ctrl-C used to leave one in the temp dir, a full copy of the corpus read so far)."""
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))

    def interrupted():
        yield "한국어 문장입니다."
        raise KeyboardInterrupt

    with pytest.raises(ValueError, match="found no text"):
        kbert.Tokenizer.train(["", "   "], vocab_size=100, progress=False)
    with pytest.raises(FileNotFoundError, match="Training input file not found"):
        kbert.Tokenizer.train([str(tmp_path / "missing.txt")], vocab_size=100, progress=False)
    with pytest.raises(KeyboardInterrupt):
        kbert.Tokenizer.train(interrupted(), vocab_size=100, progress=False)
    with pytest.raises(ValueError, match="too large for this corpus"):
        kbert.Tokenizer.train(["한국어 문장입니다."] * 10, vocab_size=50000, progress=False)
    assert list(scratch.iterdir()) == []
    tok = kbert.Tokenizer.train(["가나다 나다라 다라마 가다 나라 마가 라마다"] * 20, vocab_size=270, progress=False)
    assert tok.vocab_size == 270 and list(scratch.iterdir()) == []


def test_training_bad_inputs(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="found no text"):
        kbert.Tokenizer.train([str(empty)], vocab_size=100, progress=False)
    junk = tmp_path / "junk.txt"
    junk.write_bytes(b"\xff\xfe\x00\x01 \xed\x95\x9c\xea\xb5\xad\xec\x96\xb4 \xc3\x28\n" * 50 + "한국어 문장\n".encode() * 50)
    # lines that are not UTF-8 are left out and counted (they used to become U+FFFD in the vocabulary)
    with pytest.warns(UserWarning, match=r"50 of 100 lines of .*junk.txt are not UTF-8 text \(first: .* line 1\)"):
        tok = kbert.Tokenizer.train([str(junk)], vocab_size=268, progress=False)
    assert tok.vocab_size == 268 and tok.decode(tok.encode("한국어").ids) == "한국어" and "\ufffd" not in tok.vocab
    with pytest.raises(ValueError, match=r"vocab_size=50000 is too large for this corpus: it supports at most \d+"):
        kbert.Tokenizer.train(["한국어 문장입니다."] * 10, vocab_size=50000, progress=False)
    with pytest.raises(ValueError, match="`algorithm` must be one of"):
        kbert.Tokenizer.train(["x"], vocab_size=100, algorithm="char", progress=False)
    # refused before the corpus is read (SentencePiece said so only after that pass: minutes on a large corpus)
    for bad, match in ((dict(character_coverage=0.5), r"`character_coverage` must be in \[0.98, 1\]"),
                       (dict(character_coverage=float("nan")), "`character_coverage` must be in"),
                       (dict(max_sentences=0), "`max_sentences` must be a positive integer"),
                       (dict(min_line_chars=-1), "`min_line_chars` must be a positive integer")):
        with pytest.raises(ValueError, match=match):
            kbert.Tokenizer.train([str(tmp_path / "missing.txt")], vocab_size=100, progress=False, **bad)
    with pytest.raises(FileNotFoundError):
        kbert.Tokenizer.train([str(tmp_path / "missing.txt")], vocab_size=100, progress=False)
    # a generator's lines are text even where one names a file (here the junk file): never read from disk
    from kbert.text.vocab import text_lines

    assert list(text_lines(line for line in ["가나다", str(junk)])) == ["가나다", str(junk)]
    assert len(list(text_lines([str(junk)]))) == 50  # a list's item that names a file is that file


# ------------------------------------------------------------------------------ imported vocabs
def test_vocab_txt_tokenizes_like_transformers(tmp_path, tokenizers):
    transformers = pytest.importorskip("transformers")
    vocab = tokenizers[("wordpiece", None)].vocab
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    ours = kbert.Tokenizer.load(str(tmp_path / "vocab.txt"))
    # KLUE-BERT / KcBERT settings; a directory with vocab.txt is how their Hugging Face copies ship.
    ref = transformers.BertTokenizerFast.from_pretrained(str(tmp_path), do_lower_case=False, strip_accents=False)
    assert ref.vocab_size == len(vocab)
    texts = [t for t in VARIED if t] + ["국회의원(國會議員)은 법률안을 제출할 수 있다.", "e-mail: a@b.com 100% 확실!"]
    for text in texts:
        # On NFD input the reference gives [UNK] for Hangul (the known trap); kbert composes first.
        assert ours.encode(text).ids == ref(kbert.normalize(text))["input_ids"], text


def test_sentencepiece_model_tokenizes_like_sentencepiece(tmp_path):
    import sentencepiece as spm

    # An ALBERT/KoBERT-style model: <pad>=0 <unk>=1 [CLS]=2 [SEP]=3 [MASK]=4 and spm's own nmt_nfkc rule.
    ours = kbert.Tokenizer.load(_spm_model(tmp_path, "ko"))
    ref = spm.SentencePieceProcessor(model_file=str(tmp_path / "ko.model"))
    assert (ours.pad_id, ours.unk_id, ours.cls_id, ours.sep_id, ours.mask_id) == (0, 1, 2, 3, 4)
    assert ours._piece_lengths() is None  # SentencePiece's own normalization: offsets come from its protos
    for text in [t for t in VARIED if t]:
        assert ours.encode(text, add_special_tokens=False).ids == ref.encode(kbert.normalize(text)), text
    # In the graph too, with [CLS]/[SEP] added by the op (control pieces) or concatenated (user-defined ones).
    import tensorflow as tf

    user_defined = kbert.Tokenizer.load(_spm_model(tmp_path, "ud", control_symbols="",
                                                   user_defined_symbols="[CLS],[SEP],[MASK]"))
    for tok, by_op in ((ours, True), (user_defined, False)):
        assert (tok._graph_with_specials() is not None) == by_op
        graph = [row for b in tf.data.Dataset.from_tensor_slices(VARIED).batch(4).map(tok) for row in b.to_list()]
        assert graph == [tok.encode(t).ids for t in VARIED]
        assert graph[VARIED.index("")] == [tok.cls_id, tok.sep_id]


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="Tokenizer file not found"):
        kbert.Tokenizer.load(str(tmp_path / "nope.model"))
    (tmp_path / "d").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        kbert.Tokenizer.load(str(tmp_path / "d"))
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="is not a SentencePiece model"):
        kbert.Tokenizer.load(str(tmp_path / "bad.model"))
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    with pytest.raises(ValueError, match="no pad token '\\[PAD\\]'"):
        kbert.Tokenizer.load(str(tmp_path / "vocab.txt"))


def test_konlpy_jvm_sends_crash_reports_to_the_temp_dir_and_leaves_sigint_to_python(tmp_path):
    """A Jupyter kernel shutting down crashed the JVM inside JPype's SIGINT handler, and the JVM wrote
    hs_err_pid*.log into the working directory (the tutorials folder). kbert starts konlpy's JVM without that
    handler and with its crash reports in the temp dir."""
    import json
    import subprocess
    import sys
    import tempfile

    # The handler is compared with the one before the JVM starts: a process started in the background by a
    # non-interactive shell inherits SIGINT ignored, and that is not kbert's doing.
    code = ("import json, signal, kbert, jpype\n"
            "before = signal.getsignal(signal.SIGINT)\n"
            "kbert.morphemes('okt')('학교에서 공부했다')\n"
            "args = [str(a) for a in jpype.JClass('java.lang.management.ManagementFactory')"
            ".getRuntimeMXBean().getInputArguments()]\n"
            "print(json.dumps({'args': args, 'sigint': signal.getsignal(signal.SIGINT) is before}))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    crash = [a for a in out["args"] if a.startswith("-XX:ErrorFile=")]
    assert crash and crash[0].startswith("-XX:ErrorFile=" + tempfile.gettempdir())
    assert out["sigint"]  # Python's own SIGINT handling, not JPype's
    assert not list(tmp_path.glob("hs_err*"))


def test_training_on_legacy_encodings_or_binary_files_says_which_file_and_what_to_do(tmp_path):
    """A CP949/EUC-KR or binary file used to give a vocabulary of U+FFFD and byte garbage with exit 0."""
    import subprocess
    import sys

    lines = ["대한민국은 민주공화국이다.", "모든 국민은 법 앞에 평등하다.", "학교에서 친구들과 점심을 먹었어요."]
    legacy = tmp_path / "legacy.txt"
    legacy.write_bytes(("\n".join(lines * 20) + "\n").encode("cp949"))
    run = subprocess.run([sys.executable, "-m", "kbert.cli", "tokenizer", "train", "--input", str(legacy),
                          "--vocab-size", "200", "--out", str(tmp_path / "tok")], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 1
    assert f"{legacy} line 1" in run.stderr and "iconv -f cp949" in run.stderr
    binary = tmp_path / "data.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(ValueError, match="not text in any Korean encoding"):
        kbert.Tokenizer.train([str(binary)], vocab_size=200, progress=False)
    mixed = tmp_path / "mixed.txt"  # a few bad lines: left out, with a warning naming the first
    mixed.write_bytes(("\n".join(TEXTS_FOR_MIXED * 30) + "\n").encode("utf-8") + "옛 인코딩 한 줄\n".encode("cp949"))
    with pytest.warns(UserWarning, match=r"1 of \d+ lines of .*mixed.txt are not UTF-8 text \(first: .* line \d+\)"):
        tok = kbert.Tokenizer.train([str(mixed)], vocab_size=317, progress=False)
    assert "\ufffd" not in "".join(tok.vocab)


TEXTS_FOR_MIXED = ["대한민국은 민주공화국이다.", "모든 국민은 법 앞에 평등하다.", "학교에서 친구들과 점심을 먹었어요.",
                   "이 영화 정말 재밌다 ㅋㅋㅋㅋ", "서울특별시 강남구 테헤란로에서 회의가 열렸다."]
