"""Keyphrase extraction (kbert.keywords): noun-run candidates, and KeyBERT's scoring checked against KeyBERT."""

import json

import numpy as np
import pytest

import kbert
from kbert.data.corpus import corpus
from kbert.text.morphemes import align

from helpers import tiny_embedding_model

TEXT = "자연어 처리 기술이 빠르게 발전하면서 인공지능 서비스가 늘었다. 서울대학교 연구팀은 BERT 모델을 공개했다."


def tagged(pieces):
    """An analyzer giving these (form, tag) pieces for any text (aligned to it)."""
    return lambda text: align(text, pieces)


PIECES = [("자연어", "NNG"), ("처리", "NNG"), ("기술", "NNG"), ("이", "JKS"), ("빠르", "VA"), ("게", "EC"),
          ("발전", "NNG"), ("하", "XSV"), ("면서", "EC"), ("인공", "NNG"), ("지능", "NNG"), ("서비스", "NNG"),
          ("가", "JKS"), ("늘", "VV"), ("었", "EP"), ("다", "EF"), (".", "SF"), ("서울", "NNP"), ("대학교", "NNG"),
          ("연구", "NNG"), ("팀", "NNG"), ("은", "JX"), ("BERT", "SL"), ("모델", "NNG"), ("을", "JKO"),
          ("공개", "NNG"), ("했", "XSV+EP"), ("다", "EF"), (".", "SF")]


def test_candidates_are_runs_of_adjacent_nouns_spelled_as_in_the_text():
    analyzer = tagged(PIECES)
    assert kbert.keyphrase_candidates(TEXT, analyzer, ngram_range=(1, 1)) == [
        "자연어", "처리", "기술", "발전", "인공", "지능", "서비스", "서울", "대학교", "연구", "팀", "BERT", "모델", "공개"]
    # two nouns at a time rebuild what the analyzer split, with the text's own spacing (인공지능, 자연어 처리);
    # a particle or an ending stops a run (기술이 빠르게 발전: no 기술 발전)
    two = kbert.keyphrase_candidates(TEXT, analyzer, ngram_range=(2, 2))
    assert two == ["자연어 처리", "처리 기술", "인공지능", "지능 서비스", "서울대학교", "대학교 연구", "연구팀",
                   "BERT 모델"]
    three = kbert.keyphrase_candidates(TEXT, analyzer, ngram_range=(1, 3))
    assert "자연어 처리 기술" in three and "인공지능 서비스" in three and len(three) == len(set(three))
    # stop words leave the phrases and break the runs through them
    stopped = kbert.keyphrase_candidates(TEXT, analyzer, ngram_range=(1, 2), stop_words=["처리", "팀"])
    assert "처리" not in stopped and "자연어 처리" not in stopped and "처리 기술" not in stopped
    assert "연구팀" not in stopped and "대학교 연구" in stopped
    # tags: only NNP
    assert kbert.keyphrase_candidates(TEXT, analyzer, tags={"NNP"}) == ["서울"]
    # a list of texts gives a list per text; a blank text none
    assert kbert.keyphrase_candidates([TEXT, " "], analyzer, ngram_range=(1, 1))[1] == []
    for bad in [(0, 1), (2, 1), (1,), "1,2", (1.0, 2)]:
        with pytest.raises(ValueError, match="`ngram_range`"):
            kbert.keyphrase_candidates(TEXT, analyzer, ngram_range=bad)


@pytest.mark.parametrize("name", ["mecab", "kiwi", "okt"])
def test_candidates_from_real_analyzers_are_nouns_without_particles(name):
    found = kbert.keyphrase_candidates(TEXT, name)
    assert "자연어 처리" in found and "모델" in found and "BERT" in found
    assert not any(c.endswith(("이", "을", "은", "가")) and c[:-1] in found for c in found)  # no 기술이, 모델을
    assert all(c in TEXT for c in found)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_embedding_model(str(tmp_path_factory.mktemp("model")), max_position=512)


@pytest.fixture(scope="module")
def emb(model_dir):
    return kbert.Embedder.load(model_dir)


def documents(n=6):
    """Paragraphs of the Korean constitution and bills (konlpy's corpora), 200-400 characters each."""
    out, buf = [], ""
    for doc in corpus(["kolaw", "kobill"]):
        for line in doc:
            buf = (buf + " " + line.strip()).strip()
            if len(buf) >= 200:
                out.append(buf[:400])
                buf = ""
                if len(out) == n:
                    return out
    return out


def test_keywords_equal_keybert_on_the_same_candidates_and_vectors(emb):
    from keybert import KeyBERT
    from keybert.backend import BaseEmbedder
    from sklearn.feature_extraction.text import CountVectorizer

    docs = documents()
    found = kbert.keyphrase_candidates(docs, "mecab")
    assert all(len(f) >= 10 for f in found)

    class Backend(BaseEmbedder):  # KeyBERT running kbert's vectors
        def embed(self, texts, verbose=False):
            return emb.encode(list(texts))

    by_doc = dict(zip(docs, found))
    vectorizer = CountVectorizer(analyzer=lambda doc: by_doc[doc])  # KeyBERT's candidates: kbert's
    theirs_model = KeyBERT(model=Backend())

    def same(ours, theirs, ordered=True):
        assert len(ours) == len(theirs) == len(docs)
        for a, b in zip(ours, theirs):
            b = b if ordered else sorted(b, key=lambda kv: -kv[1])  # max sum lists by KeyBERT's own order
            assert [p for p, _ in a] == [p for p, _ in b]
            np.testing.assert_allclose([s for _, s in a], [s for _, s in b], atol=1e-4)  # KeyBERT rounds to 4

    ours = kbert.keywords(emb, docs, top_n=5)
    same(ours, theirs_model.extract_keywords(docs, vectorizer=vectorizer, top_n=5))
    assert all(a[0][1] >= a[-1][1] for a in ours)
    for diversity in (0.2, 0.7):
        same(kbert.keywords(emb, docs, top_n=5, diversity=diversity),
             theirs_model.extract_keywords(docs, vectorizer=vectorizer, top_n=5, use_mmr=True, diversity=diversity))
    same(kbert.keywords(emb, docs, top_n=3, nr_candidates=10),
         theirs_model.extract_keywords(docs, vectorizer=vectorizer, top_n=3, use_maxsum=True, nr_candidates=10),
         ordered=False)
    seeds = ["국회", "법률"]
    same(kbert.keywords(emb, docs, seed_keywords=seeds),
         theirs_model.extract_keywords(docs, vectorizer=vectorizer, seed_keywords=seeds))
    # one document: one list; the same as in the batch
    single = kbert.keywords(emb, docs[2], top_n=5)
    assert [p for p, _ in single] == [p for p, _ in ours[2]]
    # MMR with diversity 0 is the plain ranking; more diversity, less similar picks
    assert kbert.keywords(emb, docs, top_n=5, diversity=0.0) == ours


def test_keywords_from_given_candidates_a_model_dir_and_bad_settings(emb, tmp_path):
    docs = ["헌법재판소는 법률의 위헌 여부를 심판한다.", "", "국회는 법률을 제정한다."]
    picked = kbert.keywords(emb, docs, candidates=["헌법재판소", "법률", "대통령", "국회"], top_n=5)
    assert sorted(p for p, _ in picked[0]) == ["법률", "헌법재판소"]  # only those in the document
    assert picked[1] == [] and sorted(p for p, _ in picked[2]) == ["국회", "법률"]
    assert kbert.keywords(emb, [], candidates=["법률"]) == []
    assert kbert.keywords(emb, "헌법 재판", candidates=["대통령"]) == []
    for kwargs, match in [(dict(top_n=0), "`top_n`"), (dict(diversity=0.5, nr_candidates=10), "choose one"),
                          (dict(diversity=1.5), "`diversity`"), (dict(nr_candidates=3), "`nr_candidates`"),
                          (dict(nr_candidates=40), "combinations"),
                          (dict(seed_keywords=[["법률"]]), "`seed_keywords`")]:
        with pytest.raises(ValueError, match=match):
            kbert.keywords(emb, docs, candidates=["법률"], **kwargs)
    with pytest.raises(TypeError, match="list of strings"):
        kbert.keywords(emb, [1, 2], candidates=["법률"])


def test_keywords_command_writes_a_line_per_document(emb, model_dir, tmp_path, capsys):
    from kbert.cli import main

    docs = documents(3)
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(docs[:2]) + "\n\n" + docs[2] + "\n", encoding="utf-8")
    main(["keywords", "--model", model_dir, "--input", str(path), "--top-n", "4", "--diversity", "0.5",
          "--long-texts", "mean", "--out", str(tmp_path / "out.jsonl")])
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["line"] for r in rows] == [1, 2, 4]
    want = kbert.keywords(emb, docs, top_n=4, diversity=0.5, long_texts="mean", max_length=64)
    with pytest.warns(UserWarning, match="truncated"):
        cut = kbert.keywords(emb, docs, top_n=4, diversity=0.5, max_length=64)
    assert want != cut  # with long_texts="mean" the whole paragraphs were read
    want = kbert.keywords(emb, docs, top_n=4, diversity=0.5, long_texts="mean")
    assert [[k["phrase"] for k in r["keywords"]] for r in rows] == [[p for p, _ in w] for w in want]
    assert "3 documents" in capsys.readouterr().err
