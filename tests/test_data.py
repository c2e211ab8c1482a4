"""Corpora, pairs, in-graph masking, TFRecord shards and pretraining_dataset."""

import bz2
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import kbert
from kbert.data import records
from kbert.data.corpus import corpus
from kbert.data.sentences import split_sentences_rules
from kbert.data.wiki import strip_wiki_markup
from kbert.data.masking import example_keys, make_spec, mask_tokens
from kbert.data.pairs import build_examples
from kbert.data.pretraining import pretraining_dataset
from helpers import SHARED, needs_shared



@pytest.fixture(scope="module")
def tok():
    return kbert.Tokenizer.train(corpus(["kolaw", "kobill"]), vocab_size=1500, progress=False)


def _write(path, text, mode="w"):
    opener = gzip.open if path.endswith(".gz") else bz2.open if path.endswith(".bz2") else open
    with opener(path, mode + ("t" if path.endswith((".gz", ".bz2")) else ""), encoding="utf-8") as f:
        f.write(text)
    return path


# ---------------------------------------------------------------- corpora
def test_rule_splitter():
    assert split_sentences_rules('정말 좋아요. "그래서 또 봤다." 다음에도 볼 거예요... 강추! 끝') == [
        "정말 좋아요.", '"그래서 또 봤다."', "다음에도 볼 거예요...", "강추!", "끝"]
    # periods after numbers, initials and mid-sentence ellipses do not end a sentence
    assert split_sentences_rules("2015. 3. 1. 개봉한 U.S. 영화인데.. 재밌다. 다음") == [
        "2015. 3. 1. 개봉한 U.S. 영화인데.. 재밌다.", "다음"]
    assert split_sentences_rules("") == []


def test_kiwi_splitter_is_pluggable(tmp_path):
    path = _write(str(tmp_path / "a.txt"), "정말 좋아요 그래서 또 봤다 다음에도 볼 거예요. 강추!\n")
    assert list(corpus(path, splitter="kiwi")) == [["정말 좋아요", "그래서 또 봤다", "다음에도 볼 거예요.", "강추!"]]
    assert list(corpus(path, splitter=lambda t: t.split("."))) == [["정말 좋아요 그래서 또 봤다 다음에도 볼 거예요", "강추!"]]
    with pytest.raises(ValueError, match="`splitter` must be one of"):
        corpus(path, splitter="kss")


def test_formats_compression_and_report(tmp_path):
    text = _write(str(tmp_path / "a.txt.gz"), "첫 문장이다. 둘째 문장이다.\n셋째 줄\n\n다른 문서다.\n")
    jsonl = _write(str(tmp_path / "b.jsonl.bz2"), json.dumps({"text": "제목\n본문이다."}, ensure_ascii=False)
                   + "\n" + json.dumps({"text": "다른 글."}, ensure_ascii=False) + "\n")
    tsv = _write(str(tmp_path / "c.tsv"), "id\tmovie\ttext\n1\tA\t좋아요\n2\tA\t별로\n3\tB\t최고\n4\tA\t또 A\n")
    docs = list(corpus([text, jsonl]))
    assert docs == [["첫 문장이다.", "둘째 문장이다.", "셋째 줄"], ["다른 문서다."], ["제목", "본문이다."], ["다른 글."]]
    grouped = list(corpus(tsv, column="text", group_by="movie"))
    assert grouped == [["좋아요", "별로"], ["최고"], ["또 A"]]  # adjacent rows only
    c = corpus(str(tmp_path))  # a directory: every file, format by name
    assert len(list(c)) == 4 + 4  # tsv without a column name: its header's `text` column
    # several columns, no `text` header: an error naming the first line (column 0 took ids and the header as text)
    sts = _write(str(tmp_path / "s.tsv"), "genre\tscore\tsentence1\nnews\t5.0\t비행기가 이륙한다.\n")
    with pytest.raises(ValueError, match=r"s.tsv: a TSV of 3 columns needs the column\(s\) to read .*'genre'"):
        list(corpus(sts))
    assert list(corpus(sts, column="sentence1")) == [["비행기가 이륙한다."]]
    assert list(corpus(_write(str(tmp_path / "one.tsv"), "첫째\n둘째\n"))) == [["첫째"], ["둘째"]]  # one column
    # CSV as spreadsheets and the Hub's datasets write it: quoted cells hold commas and line breaks
    csv_path = _write(str(tmp_path / "comments.csv"), 'id,text,label\n1,"좋다, 정말",1\n2,"첫 줄\n둘째 줄",0\n')
    assert list(corpus(csv_path)) == [["좋다, 정말"], ["첫 줄 둘째 줄"]]  # a cell is one text
    with pytest.raises(ValueError, match=r"pairs.csv: a CSV of 3 columns needs the column"):
        list(corpus(_write(str(tmp_path / "pairs.csv"), "id,question1,question2\n1,가,나\n")))
    excel = _write(str(tmp_path / "excel.csv"), "\ufefftext,label\n좋다,1\n")  # Excel's "CSV UTF-8": a BOM
    assert list(corpus(excel)) == list(corpus(excel, column="text")) == [["좋다"]]
    assert c.report.files == 3 and c.report.sentences > 0 and c.report.characters > 0


def test_json_corpora_read_one_array_and_count_lines_that_are_not_json(tmp_path):
    """A .json file holding one array (a dataset's export) read as nothing: each line failed to parse and was
    counted as "binary", so the corpus was empty; on one line it said "no field 'text' (fields: list)". A cut-off
    last line of a JSON-lines dump also counted as binary. Now the array is read, and lines that are not JSON are
    counted as such, or, when most are, the file is an error naming the first."""
    rows = [{"text": "대한민국은 민주공화국이다."}, {"text": "상고를 기각한다."}]
    pretty = _write(str(tmp_path / "pretty.json"), json.dumps(rows, ensure_ascii=False, indent=2))
    one_line = _write(str(tmp_path / "one.json.gz"), json.dumps(rows, ensure_ascii=False))
    strings = _write(str(tmp_path / "strings.json"), json.dumps([r["text"] for r in rows], ensure_ascii=False))
    for path in (pretty, one_line, strings):
        assert list(corpus(path)) == [["대한민국은 민주공화국이다."], ["상고를 기각한다."]], path
    cut = _write(str(tmp_path / "dump.jsonl"), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
                 + '{"text": "잘린 줄')
    c = corpus(cut)
    assert len(list(c)) == 2 and c.report.malformed_dropped == 1 and c.report.binary_dropped == 0
    assert "1 not JSON" in str(c.report)
    logs = _write(str(tmp_path / "log.jsonl"), "INFO start\nINFO more\n" + json.dumps(rows[0], ensure_ascii=False))
    with pytest.raises(ValueError, match=r"log.jsonl: 2 of 3 lines are not JSON \(first: line 1\)"):
        list(corpus(logs))
    with pytest.raises(ValueError, match=r"pretty.json: item 1: no field 'body'"):
        list(corpus(pretty, text_field="body"))


def test_nli_triplets_pair_each_entailment_with_a_contradiction_of_its_premise(tmp_path):
    """KorNLI as a bi-encoder's NLI rows (the quality benchmark and tutorial 04 each built them by hand): a row
    per entailed hypothesis, its premise's contradictions taken in turn, premises without both labels left out."""
    import kbert

    tsv = _write(str(tmp_path / "snli_1.0_train.ko.tsv"), "sentence1\tsentence2\tgold_label\n"
                 "남자가 달린다.\t사람이 움직인다.\tentailment\n남자가 달린다.\t남자가 잔다.\tcontradiction\n"
                 "남자가 달린다.\t남자가 뛰고 있다.\tentailment\n남자가 달린다.\t남자가 빠르다.\tneutral\n"
                 "개가 짖는다.\t개가 소리를 낸다.\tentailment\n")
    assert kbert.nli_triplets(tsv) == kbert.nli_triplets(str(tmp_path)) == [
        {"anchor": "남자가 달린다.", "positive": "사람이 움직인다.", "negative": "남자가 잔다."},
        {"anchor": "남자가 달린다.", "positive": "남자가 뛰고 있다.", "negative": "남자가 잔다."}]
    assert len(kbert.nli_triplets(tsv, limit=1)) == 1
    with pytest.raises(ValueError, match=r"sts.tsv is not a KorNLI TSV: no column 'gold_label'"):
        kbert.nli_triplets(_write(str(tmp_path / "sts.tsv"), "sentence1\tsentence2\tscore\n가\t나\t5\n"))


@needs_shared
def test_nli_triplets_of_the_kornli_xnli_dev_file():
    import kbert

    xnli = kbert.nli_triplets(os.path.join(SHARED, "kornli", "xnli.dev.ko.tsv"))
    assert len(xnli) == 830 and all(r["positive"] != r["negative"] for r in xnli)


def test_selection_split_is_a_fixed_hash_cut_that_keeps_a_keys_rows_together():
    """The part of the training data recipes are chosen on (issue 43's discipline, benchmarks/quality.py's split):
    about `fraction` of the rows, the same on every call, rows sharing a key on one side."""
    import hashlib

    import kbert

    rows = [{"s1": f"문장 {i // 2}", "s2": f"짝 {i}"} for i in range(4000)]
    fit, select = kbert.selection_split(rows, "s1")
    assert len(fit) + len(select) == 4000 and 0.07 < len(select) / 4000 < 0.13
    assert {r["s1"] for r in fit}.isdisjoint(r["s1"] for r in select)
    assert (fit, select) == kbert.selection_split(list(rows), lambda r: r["s1"])  # a column or a function
    assert select == [r for r in rows if hashlib.md5(("selection:" + r["s1"]).encode()).digest()[0] / 256 < 0.1]
    assert len(kbert.selection_split(rows, "s1", fraction=0.5)[1]) > 1500
    with pytest.raises(ValueError, match="row 1 has no 'text' to split on"):
        kbert.selection_split(rows, "text")
    with pytest.raises(ValueError, match="`fraction` must be in"):
        kbert.selection_split(rows, "s1", fraction=1.0)


def test_a_text_per_line_reads_as_lines_and_a_run_on_text_file_is_cut_with_a_hint(tmp_path, monkeypatch):
    """A review dump without blank lines was one document: whole in memory, one worker's block, NSP/SOP pairs
    across unrelated reviews, no duplicate review dropped. `format="lines"` makes each line a document, and a
    plain-text file that starts with MAX_DOCUMENT_LINES lines and no blank line is cut into documents of that
    many lines, with a warning that names the option."""
    import importlib

    corpus_module = importlib.import_module("kbert.data.corpus")  # the package's `corpus` is the function
    monkeypatch.setattr(corpus_module, "MAX_DOCUMENT_LINES", 4)
    reviews = [f"{i}번 리뷰. 재밌어요" for i in range(9)] + ["0번 리뷰. 재밌어요"]
    path = _write(str(tmp_path / "reviews.txt"), "\n".join(reviews) + "\n")
    c = corpus(path, format="lines")
    docs = list(c)
    assert docs == [[f"{i}번 리뷰.", "재밌어요"] for i in range(9)]  # a document a line, split into sentences
    assert c.report.duplicates_dropped == 1
    with pytest.warns(UserWarning, match=r"reviews.txt: 4 lines without a blank line.*--format lines") as caught:
        docs = list(corpus(path, splitter="lines"))
    assert len(caught) == 1  # once a file
    assert docs == [reviews[0:4], reviews[4:8], reviews[8:10]]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # blank lines between documents, or a file that is one document: no hint
        docs = list(corpus(_write(str(tmp_path / "docs.txt"), "가.\n\n" + "\n".join(reviews)), splitter="lines"))
        assert [len(d) for d in docs] == [1, 10]  # the file separates its documents: a long one stays whole
        law = list(corpus(path, splitter="lines", file_is_document=True))
    assert [len(d) for d in law] == [10]
    from kbert.cli import build_parser

    assert build_parser().parse_args(["data", "prepare", "--corpus", path, "--tokenizer", "t", "--out", "o",
                                      "--format", "lines"]).format == "lines"
    assert build_parser().parse_args(["tokenizer", "train", "--input", path, "--vocab-size", "9", "--out", "o",
                                      "--format", "lines"]).format == "lines"
    assert corpus_module.FORMATS == ("text", "lines", "jsonl", "tsv", "csv", "wiki")  # the CLI's --format choices



def test_cleaning_dedupe_binary_empty_and_lengths(tmp_path):
    a = _write(str(tmp_path / "a.txt"), "같은 문서.\n\n같은 문서.\n\n\x00\x01\x02binary\x00junk\x00\n\n다른 문서.\n")
    empty = _write(str(tmp_path / "empty.txt"), "")
    c = corpus([a, empty])
    assert list(c) == [["같은 문서."], ["다른 문서."]]
    r = c.report
    assert (r.documents, r.duplicates_dropped, r.binary_dropped) == (2, 1, 1)
    assert any("empty.txt" in f for f in r.files_skipped)
    c = corpus(a, min_chars=6)
    assert list(c) == [["같은 문서."], ["다른 문서."]]
    c = corpus(a, max_chars=3)
    assert list(c) == [] and c.report.long_dropped == 2 and c.report.documents == 0
    assert "duplicates" in str(c.report)


def test_wikipedia_dump(tmp_path):
    xml = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/">
<page><title>서울</title><ns>0</ns><revision><text>{{정보상자|이름=서울}}
'''서울특별시'''는 [[대한민국]]의 [[수도 (도시)|수도]]이다.&lt;ref&gt;출처&lt;/ref&gt; 인구가 많다.
== 역사 ==
* 목록 항목
[[분류:도시]]</text></revision></page>
<page><title>넘김</title><ns>0</ns><redirect title="서울"/><revision><text>#넘겨주기 [[서울]]</text></revision></page>
<page><title>틀:X</title><ns>10</ns><revision><text>틀 문서</text></revision></page>
</mediawiki>"""
    path = _write(str(tmp_path / "kowiki-latest-pages-articles.xml.bz2"), xml)
    assert list(corpus(path)) == [["서울특별시는 대한민국의 수도이다.", "인구가 많다."]]
    assert strip_wiki_markup("[[파일:x.jpg|thumb|[[설명]]]] 본문") == ["본문"]


def test_recipes_and_errors(tmp_path):
    docs = list(corpus("kolaw"))
    assert len(docs) == 1 and len(docs[0]) > 300  # the constitution is one document
    with pytest.raises(FileNotFoundError, match="named corpora: .*kolaw"):
        corpus("no-such-corpus")
    with pytest.raises(FileNotFoundError, match="kbert corpus download wikipedia-ko"):
        corpus("wikipedia-ko", path=str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="`dedupe` must be one of"):
        corpus("kolaw", dedupe="all")
    with pytest.raises(ValueError, match="no column 'text'"):
        list(corpus(_write(str(tmp_path / "x.tsv"), "a\tb\n1\t2\n"), column="text"))


@needs_shared
def test_movie_review_recipe_groups_by_movie():
    c = corpus("movie-reviews", path=os.path.join(SHARED, "movie-reviews", "reviews.tsv.gz"))
    first = []
    for doc in c:
        first.append(doc)
        if len(first) == 3:
            break
    assert all(len(d) > 1 for d in first) and first[0][0] == "전체관람가는 아닌것 같아요"


# ---------------------------------------------------------------- pairs
def _docs(n_docs=30, n_sents=8, sent_len=5):
    """Token ids that encode (document, sentence): 1000 * doc + 10 * sentence + k."""
    return [[[1000 * d + 10 * s + k for k in range(sent_len)] for s in range(n_sents)] for d in range(n_docs)]


def _segments(row, length, num_a):
    return list(row[1:num_a - 1]), list(row[num_a:length - 1])


@pytest.mark.parametrize("objective", ["mlm+nsp", "mlm+sop"])
def test_pair_labels_match_source_order(objective):
    block = build_examples(_docs(), objective, 48, cls_id=2, sep_id=3, pad_id=0, short_seq_prob=0.1, seed=3)
    labels = block["pair_labels"]
    assert 0.35 < labels.mean() < 0.65
    for row, n, a, label in zip(block["token_ids"], block["lengths"], block["num_a"], labels):
        assert row[0] == 2 and row[a - 1] == 3 and row[n - 1] == 3 and (row[n:] == 0).all() and n <= 48
        seg_a, seg_b = _segments(row, n, a)
        assert seg_a and seg_b
        doc_a, doc_b = {t // 1000 for t in seg_a}, {t // 1000 for t in seg_b}
        sent = lambda t: (t % 1000) // 10  # noqa: E731
        if objective == "mlm+nsp":
            assert len(doc_a) == 1
            if label == 0:
                assert doc_a == doc_b and sent(seg_b[0]) >= sent(seg_a[-1])
            else:
                assert doc_a != doc_b
        else:
            assert doc_a == doc_b
            first, second = (seg_a, seg_b) if label == 0 else (seg_b, seg_a)
            assert (sent(first[-1]), first[-1] % 10) < (sent(second[0]), second[0] % 10)


def test_long_lines_and_one_sentence_documents():
    long_doc = [[list(range(10, 400))]]  # one line of 390 tokens, far over max_length
    block = build_examples(long_doc, "mlm+sop", 64, 2, 3, 0, short_seq_prob=0.0, seed=0)
    kept = sorted(t for row, n in zip(block["token_ids"], block["lengths"]) for t in row[:n] if t >= 10)
    assert len(block["lengths"]) >= 6 and (block["lengths"] <= 64).all()
    assert len(kept) >= 0.9 * 390  # split into segments, not thrown away
    single = build_examples([[[5, 6, 7, 8]]], "mlm+sop", 16, 2, 3, 0, seed=0)  # one sentence: cut inside it
    assert len(single["lengths"]) == 1
    mlm = build_examples(_docs(3), "mlm", 32, 2, 3, 0, seed=0)
    assert (mlm["num_a"] == mlm["lengths"]).all() and (mlm["pair_labels"] == 0).all()
    with pytest.raises(ValueError, match="objective"):
        build_examples(_docs(1), "nsp", 32, 2, 3, 0)


def test_short_documents_join_until_they_fill_a_sequence():
    """One-sentence documents (a review per line) gave examples of one or two texts, mostly padding, and NSP
    no "next" label at all; joined, consecutive ones fill the sequence and NSP has both labels. A document
    that fills a sequence alone is never joined."""
    from kbert.data.pairs import join_short_documents

    docs = [[[1000 * d + k for k in range(6)]] for d in range(60)]  # 60 documents of one 6-token sentence
    assert [sum(len(s) for s in d) for d in join_short_documents(docs[:7], 12)] == [12, 12, 12, 6]
    long = [[list(range(20))]]
    assert join_short_documents(docs[:1] + long + docs[1:3], 12) == [docs[0], long[0], docs[1] + docs[2]]
    for objective in ("mlm+nsp", "mlm"):
        plain = build_examples(docs, objective, 32, 2, 3, 0, short_seq_prob=0.0, seed=0)
        joined = build_examples(docs, objective, 32, 2, 3, 0, short_seq_prob=0.0, seed=0, join_documents=True)
        share = lambda block: block["lengths"].sum() / (32 * len(block["lengths"]))  # noqa: E731
        assert share(plain) < 0.5 and share(joined) > 0.8, (objective, share(plain), share(joined))
        kept = sorted(t for row, n in zip(joined["token_ids"], joined["lengths"]) for t in row[:n] if t >= 1000)
        assert len(set(kept)) >= 0.8 * 59 * 6  # the texts are in the examples, not dropped
    plain = build_examples(docs, "mlm+nsp", 32, 2, 3, 0, short_seq_prob=0.0, seed=0)
    assert (plain["pair_labels"] == 1).all()  # the silent failure joining fixes: every NSP pair was "random"
    joined = build_examples(docs, "mlm+nsp", 32, 2, 3, 0, short_seq_prob=0.0, seed=0, join_documents=True)
    assert 0.2 < joined["pair_labels"].mean() < 0.8


def test_short_documents_are_named_in_a_warning_and_records_keep_the_joining(tok, tmp_path):
    lines = [f"{i}번째 리뷰 정말 재밌어요" for i in range(400)]
    path = tmp_path / "reviews.txt"
    path.write_text("\n\n".join(lines) + "\n", encoding="utf-8")  # a blank line between documents
    with pytest.warns(UserWarning, match=r"% padding .* data.join_documents=true"):
        pretraining_dataset(str(path), tok, max_length=128, workers=0, repeat=False)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # joined: no warning
        pretraining_dataset(str(path), tok, max_length=128, workers=0, repeat=False, join_documents=True)
    plain = str(tmp_path / "plain")
    with pytest.warns(UserWarning, match="padding"):
        m = records.prepare(str(path), tok, plain, max_length=128, workers=0, progress=False)
    assert m["text_share"] < 0.5 and m["join_documents"] is False
    with pytest.raises(ValueError, match="prepared without it.*--join-documents"):
        pretraining_dataset(plain, tok, join_documents=True)
    joined = str(tmp_path / "joined")
    m = records.prepare(str(path), tok, joined, max_length=128, workers=0, progress=False, join_documents=True)
    assert m["text_share"] > 0.7 and m["join_documents"] is True
    with pytest.raises(ValueError, match="different settings.*join_documents"):
        records.prepare(str(path), tok, joined, max_length=128, workers=0, progress=False)
    # records written before the setting existed resume as unjoined ones
    manifest = records.read_manifest(plain)
    del manifest["join_documents"]
    with open(os.path.join(plain, records.MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f)
    with pytest.warns(UserWarning, match="padding"):
        assert records.prepare(str(path), tok, plain, max_length=128, workers=0, progress=False)["resumed_shards"] >= 1


def test_pretraining_reads_raw_text_in_data_format_and_records_keep_the_format(tok, tmp_path):
    """`data.format` (`kbert pretrain --format`, `kbert quickstart --format`): a raw-text source read as a text a
    line. Before, neither command could say so, and a review dump went in as documents of 1,000 lines with a
    warning that named only `kbert data prepare`. Records keep the format they were made with, so preparing the
    same text another way into the same dir starts over instead of resuming the other shards; a bad format, or
    one given for records or dummy data, is refused by name."""
    from kbert.cli import CORPUS_FORMATS, build_parser
    from kbert.data.corpus import FORMATS, Corpus
    from kbert.train.config import PretrainConfig
    from kbert.train.loop import text_source

    assert CORPUS_FORMATS == FORMATS
    path = _write(str(tmp_path / "reviews.txt"), "\n".join(f"{i}번째 리뷰 정말 재밌어요" for i in range(300)) + "\n")
    config = PretrainConfig.from_dict({"data": {"source": [path], "format": "lines", "tokenizer": "t"}})
    source = text_source(config.data)
    assert isinstance(source, Corpus) and source.format == "lines" and len(list(source)) == 300
    assert text_source(PretrainConfig.from_dict({"data": {"source": [path]}}).data) == [path]  # unchanged
    args = build_parser().parse_args(["pretrain", "--corpus", path, "--format", "lines"])
    assert args.format == "lines"
    assert build_parser().parse_args(["quickstart", "--corpus", path, "--format", "lines"]).format == "lines"
    lines = str(tmp_path / "lines")
    made = records.prepare(Corpus(path, format="lines"), tok, lines, max_length=64, workers=0, progress=False,
                           join_documents=True)
    assert made["format"] == "lines" and made["examples"] > 0
    with pytest.raises(ValueError, match=r"different settings \(format: \['lines'\] vs \[None\]\)"):
        records.prepare(path, tok, lines, max_length=64, workers=0, progress=False, join_documents=True)
    run = dict(tokenizer="t", format="lines")
    with pytest.raises(ValueError, match=r"`data.format` must be one of \('text', 'lines'"):
        kbert.pretrain({"data": dict(run, source=[path], format="line")})
    for source in (lines, "dummy"):
        with pytest.raises(ValueError, match=r"`data.format` is how raw text is read.*is not raw text"):
            kbert.pretrain({"data": dict(run, source=source)})


def test_conllu_treebanks_read_as_a_row_per_sentence_with_a_tag_per_word(tmp_path):
    """CoNLL-U (Universal Dependencies, the Korean UD treebanks): a row per sentence, the words joined by single
    spaces (punctuation split off, as the treebank splits it), so kbert's tagging task tags exactly the
    treebank's words; multiword ranges and empty nodes left out; a bad line named."""
    from kbert.data.rows import read_rows

    text = ("# sent_id = s1\n# text = 학교에서 공부했다.\n"
            "1\t학교에서\t학교+에서\tNOUN\tNNG+JKB\t_\t2\tobl\t_\t_\n"
            "2-3\t공부했다.\t_\t_\t_\t_\t_\t_\t_\t_\n"  # a multiword range: its words follow
            "2\t공부했다\t공부+하+었+다\tVERB\tNNG+XSV+EP+EF\t_\t0\troot\t_\tSpaceAfter=No\n"
            "2.1\t있다\t있다\tVERB\tVV\t_\t_\t_\t0:root\t_\n"  # an empty node
            "3\t.\t.\tPUNCT\tSF\t_\t2\tpunct\t_\t_\n\n"
            "# text = 좋다\n1\t좋다\t좋+다\tADJ\tVA+EF\t_\t0\troot\t_\t_\n")
    path = _write(str(tmp_path / "t.conllu"), text)
    first, second = read_rows(path, ["text", "upos"])
    assert first == {"text": "학교에서 공부했다 .", "sentence": "학교에서 공부했다.", "sent_id": "s1",
                     "upos": "NOUN VERB PUNCT", "xpos": "NNG+JKB NNG+XSV+EP+EF SF",
                     "lemma": "학교+에서 공부+하+었+다 .", "deprel": "obl root punct", "head": "2 0 2"}
    assert second["text"] == "좋다" and second["sent_id"] == "2" and second["upos"] == "ADJ"
    _write(str(tmp_path / "bad.conllu"), "1\t학교\tNOUN\n")
    with pytest.raises(ValueError, match=r"bad.conllu:1 has 3 tab-separated fields; a CoNLL-U word line has 10"):
        read_rows(str(tmp_path / "bad.conllu"), ["text"])


@needs_shared
def test_the_korean_gsd_treebank_reads_every_sentence_with_a_tag_per_word():
    from kbert.data.rows import read_rows

    gsd = os.path.join(SHARED, "ud-korean-gsd", "ko_gsd-ud-dev.conllu")
    rows = read_rows(gsd, ["text", "upos"])
    with open(gsd, encoding="utf-8") as f:
        assert len(rows) == sum(line.startswith("# sent_id") for line in f)
    assert all(len(r["text"].split()) == len(r["upos"].split()) == len(r["head"].split()) for r in rows)


def test_klue_ner_files_read_as_sentences_with_entity_spans(tmp_path):
    """KLUE-NER's TSV as the KLUE repo ships it (a `## id<TAB>marked sentence` line, a character and its BIO tag
    a line, spaces included): a row per sentence with its entities as character spans; an I- tag after O starts
    an entity (CoNLL's reading); a line that is not a character and a tag is named."""
    from kbert.data.rows import read_rows

    sentence = ("\ufeff## klue-ner-v1_train_00001_nsmc\t<삼성전자:OG>가 <오후 3시:TI>에\n"
                + "".join(f"{c}\t{t}\n" for c, t in zip("삼성전자가 오후 3시에",
                                                         ["B-OG", "I-OG", "I-OG", "I-OG", "O", "O", "B-TI", "I-TI",
                                                          "I-TI", "I-TI", "I-TI", "O"]))
                + "\n## klue-ner-v1_train_00002_nsmc\t좋다 서울\n좋\tO\n다\tO\n \tO\n서\tI-LC\n울\tI-LC\n")
    path = _write(str(tmp_path / "klue-ner-v1.1_train.tsv"), sentence)
    first, second = read_rows(path, ["text", "label"])
    assert first == {"text": "삼성전자가 오후 3시에", "label": [[0, 4, "OG"], [6, 11, "TI"]],
                     "id": "klue-ner-v1_train_00001_nsmc"}
    assert second["text"] == "좋다 서울" and second["label"] == [[3, 5, "LC"]]
    _write(str(tmp_path / "bad.tsv"), "## x\t가\n가\tO\n나나\tO\n")
    with pytest.raises(ValueError, match=r"bad.tsv:3: expected a character, a tab and its tag"):
        read_rows(str(tmp_path / "bad.tsv"), ["text"])
    _write(str(tmp_path / "tag.tsv"), "## x\t가\n가\tPER\n")
    with pytest.raises(ValueError, match=r"tag.tsv:2: tag 'PER' is not O, B-TYPE or I-TYPE"):
        read_rows(str(tmp_path / "tag.tsv"), ["text"])


# ---------------------------------------------------------------- masking
def _mask_stats(tok, whole_word, ngram=1, batches=40, seq=128, seed=7):
    import tensorflow as tf

    spec = make_spec(tok, 0.15, 20, whole_word, ngram)
    ds = pretraining_dataset("dummy", tok, "mlm+nsp", seq, batch_size=64, whole_word=whole_word, ngram=ngram,
                             seed=seed, max_predictions=20)
    return spec, [(f, l) for f, l in ds.take(batches)], tf


def test_masking_rates_and_never_special(tok):
    spec, batches, tf = _mask_stats(tok, whole_word=False)
    special = np.array(sorted(spec.special_ids))
    masked = candidates = n_mask = n_random = n_keep = 0
    for f, l in batches:
        ids, pos, w = f["token_ids"].numpy(), f["mask_positions"].numpy(), l["mask_weights"].numpy()
        orig, pad = l["mask_ids"].numpy(), f["padding_mask"].numpy()
        rows = np.repeat(np.arange(len(ids))[:, None], pos.shape[1], 1)
        sel = w > 0
        # reconstruct the unmasked ids: the dummy source has specials only at [CLS]/[SEP] slots
        assert not np.isin(orig[sel], special).any()  # no special token is ever a target
        assert pad[rows[sel], pos[sel]].all()  # no padding position is ever a target
        got = ids[rows[sel], pos[sel]]
        n_mask += (got == tok.mask_id).sum()
        n_keep += (got == orig[sel]).sum()
        n_random += ((got != tok.mask_id) & (got != orig[sel])).sum()
        masked += sel.sum()
        candidates += (pad.sum(1) - 3).sum()  # [CLS] and two [SEP]
        for r in range(len(ids)):  # real slots first, positions increasing, no repeats
            k = sel[r].sum()
            assert sel[r, :k].all() and (np.diff(pos[r, :k]) > 0).all()
    assert abs(masked / candidates - 0.15) < 0.01
    assert abs(n_mask / masked - 0.8) < 0.02 and abs(n_random / masked - 0.1) < 0.02
    assert abs(n_keep / masked - 0.1) < 0.02 + 0.001


def test_whole_word_masking_masks_every_piece(tok):
    import tensorflow as tf

    texts = ["대한민국은 민주공화국이다. 모든 국민은 법 앞에 평등하다. 국회는 법률을 제정한다."] * 32
    ids = [[tok.cls_id] + r + [tok.sep_id] for r in tok.ids_batch(texts)]
    seq = max(map(len, ids))
    token_ids = np.array([r + [0] * (seq - len(r)) for r in ids], np.int32)
    pad = token_ids != 0
    starts = tok.word_start_table()
    for ngram in (1, 3):
        spec = make_spec(tok, 0.3, seq, whole_word=True, ngram=ngram)
        total = 0
        for s in range(20):
            keys = example_keys(s, tf.range(len(ids)))
            _, pos, _, w = mask_tokens(token_ids, pad, keys, spec)
            for row in range(len(ids)):
                chosen = set(pos[row][w[row] > 0].numpy().tolist())
                total += len(chosen)
                # word index of every real, non-special position
                words, current = {}, -1
                for p in range(1, len(ids[row]) - 1):
                    if starts[token_ids[row, p]]:
                        current += 1
                    words.setdefault(current, []).append(p)
                for pieces in words.values():
                    hit = chosen & set(pieces)
                    assert not hit or hit == set(pieces), (pieces, chosen)
        assert total > 0


def test_masks_deterministic_and_fresh_each_epoch(tok, tmp_path):
    records.prepare("kolaw", tok, str(tmp_path / "rec"), max_length=64, docs_per_shard=1, workers=0,
                    progress=False)
    manifest = records.read_manifest(str(tmp_path / "rec"))
    per_epoch = -(-manifest["examples"] // 4)

    def run(start=0):
        ds = pretraining_dataset(str(tmp_path / "rec"), tok, batch_size=4, seed=5, shuffle_buffer=0,
                                 start_batch=start, max_length=64)
        return [(f["token_ids"].numpy(), l["mask_ids"].numpy()) for f, l in ds.take(2 * per_epoch)]

    a, b = run(), run()
    assert all((x[0] == y[0]).all() and (x[1] == y[1]).all() for x, y in zip(a, b))
    # epoch 2 holds the same examples (no shuffling here) with different masks
    assert any((a[i][0] != a[i + per_epoch][0]).any() for i in range(per_epoch - 1))
    resumed = run(start=3)
    assert (resumed[0][0] == a[3][0]).all() and (resumed[0][1] == a[3][1]).all()
    # an example's mask does not depend on the batch size (so not on the number of replicas either)
    ds8 = pretraining_dataset(str(tmp_path / "rec"), tok, batch_size=8, seed=5, shuffle_buffer=0, max_length=64)
    first8 = next(iter(ds8))[0]["token_ids"].numpy()
    assert (first8[:4] == a[0][0]).all() and (first8[4:] == a[1][0]).all()


# ---------------------------------------------------------------- pretraining_dataset + records
def test_dataset_features_segments_and_padding(tok):
    ds = pretraining_dataset(["kolaw", "kobill"], tok, "mlm+sop", max_length=96, batch_size=8, workers=0, seed=1)
    for f, l in ds.take(5):
        ids, seg, pad = f["token_ids"].numpy(), f["segment_ids"].numpy(), f["padding_mask"].numpy()
        assert ids.shape == (8, 96) and l["pair_labels"].shape == (8,)
        for r in range(8):
            n = pad[r].sum()
            assert pad[r, :n].all() and not pad[r, n:].any() and (ids[r, n:] == tok.pad_id).all()
            assert ids[r, 0] == tok.cls_id and ids[r, n - 1] == tok.sep_id
            first_sep = int(np.argmax(ids[r] == tok.sep_id))
            assert (seg[r, :first_sep + 1] == 0).all() and (seg[r, first_sep + 1:n] == 1).all()
            assert not seg[r, n:].any()


def _examples_of(ds):
    out = set()
    for f, l in ds:
        ids = f["token_ids"].numpy()
        # undo the masks to compare the underlying examples
        pos, orig, w = f["mask_positions"].numpy(), l["mask_ids"].numpy(), l["mask_weights"].numpy()
        for r in range(len(ids)):
            row = ids[r].copy()
            row[pos[r][w[r] > 0]] = orig[r][w[r] > 0]
            out.add(tuple(row.tolist()))
    return out


def test_hand_serialized_records_are_tf_train_examples():
    """`kbert data prepare`'s workers encode records without TensorFlow; they must be the same
    `tf.train.Example`s that TensorFlow builds, and read back through `parse_batch`."""
    import tensorflow as tf

    cases = [(np.array([2, 300, 70000, 3, 5, 3], "<i4"), 4, 1), (np.array([2, 3], "<i4"), 2, 0),
             (np.array([2] + [31999] * 600 + [3], "<i4"), 300, -1)]
    serialized = []
    for ids, num_a, label in cases:
        data = records.serialize_example(ids.tobytes(), num_a, label)
        expect = tf.train.Example(features=tf.train.Features(feature={
            "token_ids": tf.train.Feature(bytes_list=tf.train.BytesList(value=[ids.tobytes()])),
            "num_a": tf.train.Feature(int64_list=tf.train.Int64List(value=[num_a])),
            "pair_label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label]))}))
        assert tf.train.Example.FromString(data) == expect
        serialized.append(data)
    ids, lengths, num_a, labels = records.parse_batch(tf.constant(serialized), 602)
    assert lengths.numpy().tolist() == [6, 2, 602] and num_a.numpy().tolist() == [4, 2, 300]
    assert labels.numpy().tolist() == [1, 0, -1]
    assert ids.numpy()[0, :6].tolist() == cases[0][0].tolist() and not ids.numpy()[0, 6:].any()


def test_hand_framed_shards_are_the_bytes_tensorflow_writes(tmp_path):
    """The TFRecord framing (lengths, masked CRC-32C checksums) is written without TensorFlow too: the same
    bytes as `tf.io.TFRecordWriter`, and TensorFlow's reader, which checks the checksums, reads them back."""
    import tensorflow as tf

    data = [records.serialize_example(np.arange(n, dtype="<i4").tobytes(), n // 2, n % 2) for n in (2, 7, 600)]
    data.append(b"")  # an empty record frames too
    path = str(tmp_path / "tf.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for d in data:
            writer.write(d)
    ours = b"".join(records.frame_record(d) for d in data)
    assert ours == open(path, "rb").read()
    mine = tmp_path / "ours.tfrecord"
    mine.write_bytes(ours)
    assert [r.numpy() for r in tf.data.TFRecordDataset(str(mine))] == data
    broken = bytearray(ours)
    broken[20] ^= 1  # a flipped bit in the first record's data: its checksum no longer holds
    mine.write_bytes(bytes(broken))
    with pytest.raises(tf.errors.DataLossError):
        list(tf.data.TFRecordDataset(str(mine)))


def test_records_equal_raw_text_and_resume_after_interrupt(tok, tmp_path, monkeypatch):
    kwargs = dict(objective="mlm+nsp", max_length=64, seed=2)
    raw = pretraining_dataset(["kolaw", "kobill"], tok, batch_size=16, workers=0, repeat=False,
                              docs_per_block=4, drop_remainder=False, **kwargs)
    full = str(tmp_path / "full")
    m = records.prepare(["kolaw", "kobill"], tok, full, docs_per_shard=4, workers=2, progress=False, **kwargs)
    assert m["complete"] and m["examples"] > 100 and m["report"]["documents"] == 11
    from_records = pretraining_dataset(full, tok, batch_size=16, repeat=False, drop_remainder=False, **kwargs)
    assert _examples_of(raw) == _examples_of(from_records)

    # interrupt after two shards
    out = str(tmp_path / "part")
    calls = {"n": 0}
    original = records.ShardWriter.__call__

    def flaky(self, index, block):
        if calls["n"] == 2:
            raise KeyboardInterrupt
        calls["n"] += 1
        return original(self, index, block)

    monkeypatch.setattr(records.ShardWriter, "__call__", flaky)
    with pytest.raises(KeyboardInterrupt):
        records.prepare(["kolaw", "kobill"], tok, out, docs_per_shard=4, workers=0, progress=False, **kwargs)
    monkeypatch.setattr(records.ShardWriter, "__call__", original)
    partial = records.read_manifest(out)
    assert not partial["complete"] and len(partial["shards"]) == 2
    with pytest.raises(ValueError, match="did not finish"):
        pretraining_dataset(out, tok, **kwargs)
    kept = {k: os.path.getmtime(os.path.join(out, v["file"])) for k, v in partial["shards"].items()}
    m2 = records.prepare(["kolaw", "kobill"], tok, out, docs_per_shard=4, workers=0, progress=False, **kwargs)
    assert m2["complete"] and m2["resumed_shards"] == 2
    assert m2["report"] == m["report"]  # the kept shards' sentences and characters are counted too
    assert all(os.path.getmtime(os.path.join(out, partial["shards"][k]["file"])) == t for k, t in kept.items())
    # the same examples as the uninterrupted run (bytes may differ: protobuf map order is per process)
    assert {k: v["examples"] for k, v in m2["shards"].items()} == {k: v["examples"] for k, v in m["shards"].items()}
    assert _examples_of(pretraining_dataset(out, tok, batch_size=16, repeat=False, drop_remainder=False,
                                            **kwargs)) == _examples_of(from_records)

    # a damaged shard is named, and a rerun rewrites it
    victim = os.path.join(out, m2["shards"]["1"]["file"])
    with open(victim, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="shard-00001.tfrecord.*truncated or corrupt"):
        pretraining_dataset(out, tok, **kwargs)
    m3 = records.prepare(["kolaw", "kobill"], tok, out, docs_per_shard=4, workers=0, progress=False, **kwargs)
    assert m3["resumed_shards"] == len(m3["shards"]) - 1
    # settings must match the records
    with pytest.raises(ValueError, match="different settings.*max_length"):
        records.prepare(["kolaw", "kobill"], tok, out, docs_per_shard=4, max_length=32, workers=0, progress=False)
    other = kbert.Tokenizer.train(corpus("kolaw"), vocab_size=1000, progress=False)
    with pytest.raises(ValueError, match="another tokenizer"):
        pretraining_dataset(out, other)
    # a bad setting is refused before the manifest records it: the rerun with it put right was "different
    # settings" (or, for docs_per_shard 0, shards were written at all)
    fresh = str(tmp_path / "fresh")
    for bad, match in ((dict(max_length=2), "`max_length` must be at least 5 for objective='mlm\\+nsp'"),
                       (dict(short_seq_prob=5), "`short_seq_prob` must be a probability"),
                       (dict(docs_per_shard=0), "`docs_per_shard` must be a positive integer")):
        with pytest.raises(ValueError, match=match):
            records.prepare(["kolaw"], tok, fresh, workers=0, progress=False, **dict(dict(docs_per_shard=4), **bad))
        assert not os.path.exists(os.path.join(fresh, records.MANIFEST))
    # a source with no examples is an error naming why (not a records dir of nothing that fails in training);
    # lines that are not UTF-8 get the conversion hint
    (tmp_path / "empty.txt").write_text("  \n\n")
    (tmp_path / "cp949.txt").write_bytes("대한민국 헌법\n".encode("cp949"))
    with pytest.raises(ValueError, match="gives no pretraining examples.*empty.txt: no text"):
        records.prepare(str(tmp_path / "empty.txt"), tok, str(tmp_path / "e"), workers=0, progress=False)
    with pytest.raises(ValueError, match="1 lines were not UTF-8 text .*iconv -f cp949"):
        records.prepare(str(tmp_path / "cp949.txt"), tok, str(tmp_path / "c"), workers=0, progress=False)
    assert not records.read_manifest(str(tmp_path / "c"))["complete"]


def test_input_context_sharding(tok, tmp_path):
    import tensorflow as tf

    out = str(tmp_path / "rec")
    records.prepare(["kolaw", "kobill"], tok, out, max_length=64, docs_per_shard=2, workers=0, progress=False)
    seen = []
    for i in range(2):
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=i, num_replicas_in_sync=2)
        ds = pretraining_dataset(out, tok, batch_size=8, repeat=False, drop_remainder=False, input_context=ctx)
        first = next(iter(ds))[0]["token_ids"]
        assert first.shape[0] == 4  # global batch 8 over 2 replicas
        seen.append(_examples_of(ds))
    everything = _examples_of(pretraining_dataset(out, tok, batch_size=8, repeat=False, drop_remainder=False))
    assert seen[0] | seen[1] == everything
    # disjoint shards; the only shared examples are boilerplate lines that two bills both contain
    assert len(seen[0] & seen[1]) <= 0.01 * len(everything)


def test_bad_sources_fail_clearly(tok, tmp_path):
    empty = _write(str(tmp_path / "empty.txt"), "")
    with pytest.raises(ValueError, match="no pretraining examples"):
        pretraining_dataset(empty, tok, workers=0)
    junk = str(tmp_path / "junk.bin")
    with open(junk, "wb") as f:
        f.write(bytes(range(256)) * 50)
    with pytest.raises(ValueError, match="binary"):
        pretraining_dataset(junk, tok, workers=0)
    with pytest.raises(FileNotFoundError):
        pretraining_dataset(str(tmp_path / "missing.txt"), tok)
    with pytest.raises(ValueError, match="max_predictions"):
        pretraining_dataset("dummy", tok, max_length=16, max_predictions=17)
    with pytest.raises(ValueError, match="objective"):
        pretraining_dataset("dummy", tok, objective="nsp")
    # NaN failed as "cannot convert float NaN to integer"; short_seq_prob and shuffle_buffer were not checked
    with pytest.raises(ValueError, match=r"`mask_rate` must be in \(0, 1\). Received: mask_rate=nan"):
        pretraining_dataset("dummy", tok, mask_rate=float("nan"))
    with pytest.raises(ValueError, match=r"`short_seq_prob` must be a probability in \[0, 1\]"):
        pretraining_dataset(_write(str(tmp_path / "doc.txt"), "문장 하나.\n문장 둘.\n"), tok, short_seq_prob=5,
                            workers=0)
    with pytest.raises(ValueError, match="`shuffle_buffer` must be an integer, 0"):
        pretraining_dataset("dummy", tok, shuffle_buffer=-1)


@pytest.mark.slow
def test_dead_workers_raise_instead_of_hanging(tmp_path):
    """A script without `if __name__ == "__main__":` re-runs itself in each spawned worker, which Python stops
    during start-up. multiprocessing.Pool restarted such workers forever (the script hung); now the
    pipeline raises an error that says how to fix the script."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(
        "import kbert\n"
        "text = kbert.corpus('kolaw')\n"
        "tok = kbert.Tokenizer.train(text, vocab_size=800, progress=False)\n"
        "ds = kbert.pretraining_dataset(text, tok, 'mlm', 32, batch_size=4, repeat=False, workers=2)\n"
        "print(sum(1 for _ in ds), 'batches')\n", encoding="utf-8")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                         cwd=str(tmp_path))
    assert run.returncode != 0
    assert "WorkerError" in run.stderr and 'if __name__ == "__main__":' in run.stderr
    assert "batches" not in run.stdout
    # the same script, guarded, works
    guarded = tmp_path / "guarded.py"
    lines = script.read_text(encoding="utf-8").splitlines()
    guarded.write_text("\n".join([lines[0], "if __name__ == '__main__':"] + ["    " + l for l in lines[1:]]) + "\n",
                       encoding="utf-8")
    run = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True, timeout=240,
                         cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    assert int(run.stdout.split()[0]) > 0


def test_an_unguarded_script_with_large_worker_state_fails_instead_of_hanging(tmp_path):
    """Spawn writes a child's start-up data into a pipe whose read end the parent holds too until the write
    ends; a child that dies before reading it all (an unguarded script re-run there) left the parent blocked
    for ever once that data passed the pipe's 64 KB, as a tokenizer of a real vocabulary does. The workers'
    state now travels in a file, so the parent sees the child die and says how to fix the script; the file
    is gone afterwards."""
    import subprocess
    import sys

    code = ("from kbert import workers\n"
            "ex = workers.start(2, len, (b'x' * 1_000_000,))\n"
            "print(workers.result(workers.submit(ex, abs, -3)))\n"
            "workers.stop(ex)\n")
    (tmp_path / "unguarded.py").write_text(code, encoding="utf-8")
    (tmp_path / "guarded.py").write_text("from kbert import workers\nif __name__ == '__main__':\n" + "".join(
        "    " + line + "\n" for line in code.splitlines()[1:]), encoding="utf-8")
    (tmp_path / "tmp").mkdir()
    root = os.path.dirname(os.path.dirname(os.path.abspath(kbert.__file__)))  # the kbert under test
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"),
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "unguarded.py"], capture_output=True, text=True, timeout=120,
                         cwd=str(tmp_path), env=env)
    assert run.returncode != 0 and "WorkerError" in run.stderr and 'if __name__ == "__main__":' in run.stderr
    run = subprocess.run([sys.executable, "guarded.py"], capture_output=True, text=True, timeout=120,
                         cwd=str(tmp_path), env=env)
    assert run.returncode == 0 and run.stdout.split() == ["3"], run.stderr[-2000:]
    assert os.listdir(tmp_path / "tmp") == []


def test_workers_start_from_a_script_read_on_standard_input(tmp_path):
    """`python - <<EOF` (`__file__ == "<stdin>"`): spawn would re-run "<stdin>" in each worker, which died with
    FileNotFoundError; the workers now start without re-running `__main__`. Then a pool broken by a dead
    worker is reported as a WorkerError from `submit` too, not a raw BrokenProcessPool."""
    import subprocess
    import sys

    script = ("import kbert\n"
              "text = kbert.corpus('kolaw')\n"
              "tok = kbert.Tokenizer.train(text, vocab_size=800, progress=False)\n"
              "ds = kbert.pretraining_dataset(text, tok, 'mlm', 32, batch_size=4, repeat=False, workers=2)\n"
              "print(sum(1 for _ in ds), 'batches')\n"
              "import os, signal\n"
              "from kbert import workers\n"
              "ex = workers.start(1)\n"
              "os.kill(workers.result(ex.submit(os.getpid)), signal.SIGKILL)\n"
              "try:\n"
              "    workers.result(ex.submit(os.getpid))\n"
              "except workers.WorkerError:\n"
              "    pass\n"
              "try:\n"
              "    workers.submit(ex, os.getpid)\n"
              "except workers.WorkerError as e:\n"
              "    print('reported:', e)\n")
    run = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=240,
                         cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    assert int(run.stdout.split()[0]) > 0 and "reported: a kbert worker process died" in run.stdout


@pytest.mark.parametrize("context", ["spawn", "fork"])
def test_workers_exit_when_their_parent_is_killed(tmp_path, context):
    """A parent killed without clean-up (SIGKILL, the OOM killer) leaves no idle workers behind."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "parent.py"
    script.write_text(
        "import os, signal, sys\n"
        "from kbert import workers\n"
        "if __name__ == '__main__':\n"
        f"    ex = workers.start(2, context={context!r})\n"
        "    pids = {workers.result(ex.submit(os.getpid)) for _ in range(20)}\n"
        "    print(' '.join(map(str, sorted(pids))), flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(kbert.__file__)))  # the kbert under test
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    # output to files, not pipes: a pipe stays open while any worker lives, and reading it would wait for them
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        returncode = subprocess.run([sys.executable, str(script)], stdout=out, stderr=err, timeout=120,
                                    env=env).returncode
    stderr = (tmp_path / "err.txt").read_text()
    assert returncode == -signal.SIGKILL, stderr
    pids = [int(p) for p in (tmp_path / "out.txt").read_text().split()]
    assert pids, stderr

    def alive(pid):
        try:  # an exited child of init may linger as a zombie for a moment
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ")[-1][0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.time() + 20
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if alive(p)], "workers outlived their killed parent"


def test_stop_kills_running_tasks_and_workers_still_starting(tmp_path):
    """`workers.stop` stops the processes: a task still running dies with them, and workers stopped while
    starting never run their initializer on a start-up file already removed (each printed "Exception in
    initializer" and a traceback after an error had stopped `kbert data prepare` on an empty corpus)."""
    import subprocess
    import sys

    script = tmp_path / "stop.py"
    script.write_text(
        "import glob, os, tempfile, time\n"
        "from kbert import workers\n"
        "if __name__ == '__main__':\n"
        "    files = lambda: set(glob.glob(os.path.join(tempfile.gettempdir(), 'kbert-worker-init-*')))\n"
        "    before = files()\n"
        "    ex = workers.start(2, initializer=time.sleep, initargs=(0.0,))\n"
        "    workers.stop(ex)\n"  # at once: the workers are still starting
        "    ex = workers.start(2, initializer=time.sleep, initargs=(0.0,))\n"
        "    pid = workers.result(ex.submit(os.getpid))\n"
        "    ex.submit(time.sleep, 600)\n"
        "    time.sleep(0.5)\n"
        "    t = time.time()\n"
        "    workers.stop(ex)\n"
        "    try:\n"
        "        os.kill(pid, 0)\n"
        "        alive = True\n"
        "    except ProcessLookupError:\n"
        "        alive = False\n"
        "    print(alive, round(time.time() - t, 1), sorted(files() - before))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(kbert.__file__)))  # the kbert under test
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False", run.stdout.split()[1], "[]"], run.stdout
    assert float(run.stdout.split()[1]) < 10  # not the task's 600 s
    assert "Traceback" not in run.stderr and "Exception in initializer" not in run.stderr, run.stderr[-2000:]


def test_worker_killed_from_outside_raises(tok):
    """A worker that dies mid-task (e.g. killed for memory) is an error, not a wait forever."""
    import os
    import signal

    from kbert import workers

    ex = workers.start(1)
    try:
        pid = workers.result(ex.submit(os.getpid))
        future = ex.submit(signal.pause)  # never returns by itself
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(workers.WorkerError, match="worker process died"):
            workers.result(future)
    finally:
        workers.stop(ex)


def test_a_corpus_without_a_download_url_says_where_its_files_go(tmp_path, monkeypatch):
    """README's `movie_review_sentiment(split="train")` pointed to `kbert corpus download movie-reviews`,
    which then said the corpus has no download URL: both now say to pass the files or where to put them."""
    from kbert.data.recipes import download, movie_review_sentiment

    monkeypatch.setenv("KBERT_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError) as err:
        movie_review_sentiment(split="train")
    message = str(err.value)
    assert "pass path=" in message and str(tmp_path / "movie-reviews") in message
    assert "kbert corpus download" not in message
    with pytest.raises(ValueError, match="no download URL.*path="):
        download("movie-reviews")


def test_numpy_record_reader_gives_the_tf_data_batches_bit_for_bit(tok, tmp_path):
    """`kbert.data.record_reader` (numpy only, the JAX path's input) yields exactly `pretraining_dataset`'s
    batches from the same records: file order, interleave, shuffle blocks and masks (whole-word and n-gram),
    across epochs, from a start batch, split over two pipelines; a process without TensorFlow can import it;
    raw text and records of another tokenizer are refused with the reason."""
    from kbert.data import record_reader

    out = str(tmp_path / "rec")
    records.prepare(["kolaw", "kobill"], tok, out, objective="mlm+sop", max_length=64, docs_per_shard=2, workers=0,
                    progress=False)
    per_epoch = records.read_manifest(out)["examples"]
    cases = [dict(batch_size=8, seed=3, shuffle_buffer=100), dict(batch_size=5, seed=9, shuffle_buffer=0, ngram=3),
             dict(batch_size=16, seed=1, shuffle_buffer=64, whole_word=False, start_batch=7),
             dict(batch_size=4, seed=2, shuffle_buffer=50, num_pipelines=2, pipeline_id=1)]
    for case in cases:
        pipelines = case.pop("num_pipelines", 1), case.pop("pipeline_id", 0)
        steps = 2 * per_epoch // (case["batch_size"] * pipelines[0]) + 3  # into the third epoch
        context = None
        if pipelines[0] > 1:
            import tensorflow as tf

            context = tf.distribute.InputContext(num_input_pipelines=pipelines[0], input_pipeline_id=pipelines[1],
                                                 num_replicas_in_sync=pipelines[0])
            case_tf = dict(case, batch_size=case["batch_size"] * pipelines[0])  # the global batch
        else:
            case_tf = case
        expected = [(
            {k: v.numpy() for k, v in f.items()}, {k: v.numpy() for k, v in l.items()})
            for f, l in pretraining_dataset(out, tok, input_context=context, **case_tf).take(steps)]
        got = record_reader.RecordBatches(out, tok, num_pipelines=pipelines[0], pipeline_id=pipelines[1], **case)
        got = [b for b, _ in zip(got, range(steps))]
        assert len(got) == len(expected) == steps
        for (f, l), (ef, el) in zip(got, expected):
            assert set(f) == set(ef) and set(l) == set(el)
            for k in ef:
                assert f[k].dtype == ef[k].dtype and np.array_equal(f[k], ef[k]), (case, k)
            for k in el:
                assert l[k].dtype == el[k].dtype and np.array_equal(l[k], el[k]), (case, k)
    with pytest.raises(ValueError, match="not a records directory.*kbert data prepare"):
        record_reader.RecordBatches("kolaw", tok)
    other = kbert.Tokenizer("wordpiece", ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "가", "##나"])
    with pytest.raises(ValueError, match="another tokenizer"):
        record_reader.RecordBatches(out, other)
    script = ("import builtins\nreal = builtins.__import__\n"
              "def guard(name, *a, **k):\n"
              "    assert name.split('.')[0] not in ('tensorflow', 'tensorflow_text'), name\n"
              "    return real(name, *a, **k)\n"
              "builtins.__import__ = guard\n"
              "import sys, kbert\nfrom kbert.data.record_reader import RecordBatches\n"
              f"tok = kbert.Tokenizer.load({os.path.join(str(tmp_path), 'tok')!r})\n"
              f"f, l = next(iter(RecordBatches({out!r}, tok, batch_size=4)))\n"
              "print(f['token_ids'].shape, 'tensorflow' in sys.modules)\n")
    tok.save(os.path.join(str(tmp_path), "tok"))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["(4,", "64)", "False"]


def test_unlabelled_texts_read_from_lines_or_from_a_labelled_file(tmp_path):
    """SimCSE and distillation read texts alike: a .txt is a line per text (blank lines skipped), unless its
    first line is a tab-separated header naming the column (question-pair's train.txt), which reads as the
    TSV it is, never as whole tab-joined lines."""
    import gzip

    from kbert.data.rows import text_rows
    from kbert.train.finetune import FinetuneConfig
    from kbert.train.finetune_tasks import SentenceEmbeddingTask

    (tmp_path / "lines.txt").write_text("비행기가 이륙하고 있다.\n\n  한 남자가 플루트를 연주한다. \n", encoding="utf-8")
    (tmp_path / "lines.txt.gz").write_bytes(gzip.compress("첫 줄\n둘째 줄\n".encode()))
    (tmp_path / "pairs.txt").write_text("question1\tquestion2\tis_duplicate\n밥 먹었어?\t식사했어?\t1\n", encoding="utf-8")
    expected = [{"text": "비행기가 이륙하고 있다."}, {"text": "한 남자가 플루트를 연주한다."}]
    assert text_rows(str(tmp_path / "lines.txt"), "text") == expected
    assert text_rows(str(tmp_path / "lines.txt.gz"), "t") == [{"t": "첫 줄"}, {"t": "둘째 줄"}]
    assert text_rows(str(tmp_path / "pairs.txt"), "question1")[0]["question1"] == "밥 먹었어?"
    assert text_rows(["좋다", " ", "싫다"], "text") == [{"text": "좋다"}, {"text": "싫다"}]
    assert text_rows(None, "text") == []
    with pytest.raises(ValueError, match="no column 'text'"):
        text_rows([{"s": "x"}], "text")
    # fine-tuning with objective="simcse" takes the same plain text; a pair objective still wants its columns
    task = SentenceEmbeddingTask(FinetuneConfig(model="m", task="sentence-embedding", objective="simcse",
                                                train=str(tmp_path / "lines.txt")))
    assert task.read_train() == expected
    pairs = SentenceEmbeddingTask(FinetuneConfig(model="m", task="sentence-embedding",
                                                 train=str(tmp_path / "pairs.txt"), text_column="question1",
                                                 pair_column="question2", label_column="is_duplicate"))
    assert pairs.read_train()[0]["question2"] == "식사했어?"


def test_labelled_rows_are_strict_utf8_and_name_a_cp949_file(tmp_path):
    """Rows for fine-tuning: a CP949 CSV (Korean Excel's default) was read with U+FFFD in every Hangul cell and
    trained on silently; now it is an error naming the line and the fix. Excel's "CSV UTF-8" (a byte-order
    mark), CRLF line ends and gzip read as plain UTF-8."""
    import gzip

    from kbert.data.rows import read_rows

    text = "text,label\n좋은 영화였다,pos\n별로였다,neg\n"
    (tmp_path / "excel.csv").write_bytes(text.encode("cp949"))
    (tmp_path / "mixed.tsv").write_bytes("text\tlabel\n좋다\t1\n".encode() + "싫다\t0\n".encode("cp949"))
    (tmp_path / "bom.csv").write_bytes(text.replace("\n", "\r\n").encode("utf-8-sig"))
    (tmp_path / "rows.jsonl.gz").write_bytes(gzip.compress('{"text": "좋은 영화였다", "label": "pos"}\n'.encode()))
    with pytest.raises(ValueError, match=r"excel.csv: line 2 is not UTF-8 text; it reads as Korean in CP949.*iconv"):
        read_rows(str(tmp_path / "excel.csv"), ["text", "label"])
    with pytest.raises(ValueError, match=r"mixed.tsv: line 3 is not UTF-8 text"):
        read_rows(str(tmp_path / "mixed.tsv"), ["text", "label"])
    assert read_rows(str(tmp_path / "bom.csv"), ["text", "label"])[0] == {"text": "좋은 영화였다", "label": "pos"}
    assert read_rows(str(tmp_path / "rows.jsonl.gz"), ["text"]) == [{"text": "좋은 영화였다", "label": "pos"}]
    # a .json file may be one array of objects (pretty-printed or not); an Excel workbook or a row that is
    # not an object is named
    rows = [{"text": "좋다", "label": "1"}, {"text": "싫다", "label": "0"}]
    (tmp_path / "array.json").write_text(json.dumps(rows, ensure_ascii=False, indent=2), encoding="utf-8")
    assert read_rows(str(tmp_path / "array.json"), ["text", "label"]) == rows
    (tmp_path / "book.xlsx").write_bytes(b"PK\x03\x04")
    with pytest.raises(ValueError, match="book.xlsx is an Excel workbook; save it as CSV UTF-8"):
        read_rows(str(tmp_path / "book.xlsx"), ["text"])
    (tmp_path / "lists.jsonl").write_text("[1, 2]\n", encoding="utf-8")
    with pytest.raises(ValueError, match="lists.jsonl: row 1 is list, not a mapping of column to value"):
        read_rows(str(tmp_path / "lists.jsonl"), ["text"])
    with pytest.raises(ValueError, match="the given rows: row 1 is str"):
        read_rows(["좋다", "싫다"], ["text"])


def test_labelled_rows_keep_line_breaks_inside_cells_and_refuse_shifted_cells(tmp_path):
    """A quoted CSV cell's line break was dropped ("좋은\n영화" read as "좋은영화", so `write_rows` -> `read_rows`
    changed the text), and U+2028 / U+0085, which scraped web text holds inside sentences, split a row in two
    with its cells shifted (str.splitlines). A TSV row with a tab in its text trained with a piece of the text
    as its label; now that is an error naming the line."""
    from kbert.data.rows import read_rows, text_rows, write_rows

    rows = [{"text": "좋은\n영화, 정말", "label": "1"}, {"text": "나쁜\u2028영화", "label": "0"}]
    write_rows(rows, str(tmp_path / "rows.csv"))
    assert read_rows(str(tmp_path / "rows.csv"), ["text", "label"]) == rows
    (tmp_path / "rows.tsv").write_bytes("text\tlabel\r\n나쁜\u2028영화\t0\r\n이상한\x85글\t1\r\n\n짧은\n".encode())
    assert read_rows(str(tmp_path / "rows.tsv"), ["text", "label"]) == [
        {"text": "나쁜\u2028영화", "label": "0"}, {"text": "이상한\x85글", "label": "1"}, {"text": "짧은", "label": None}]
    (tmp_path / "rows.jsonl").write_text(json.dumps({"text": "a\u2028b"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert read_rows(str(tmp_path / "rows.jsonl"), ["text"]) == [{"text": "a\u2028b"}]
    (tmp_path / "lines.txt").write_text("첫\u2028줄\n둘째 줄\n", encoding="utf-8")
    assert text_rows(str(tmp_path / "lines.txt"), "text") == [{"text": "첫\u2028줄"}, {"text": "둘째 줄"}]
    (tmp_path / "tab.tsv").write_text("text\tlabel\n좋은\t영화\t1\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"tab.tsv:2 has 3 tab-separated cells where the header has 2 \(text, label\)"):
        read_rows(str(tmp_path / "tab.tsv"), ["text"])
    (tmp_path / "stray.csv").write_text("text,label\n좋은 영화,1,,\n", encoding="utf-8")
    assert read_rows(str(tmp_path / "stray.csv"), ["text", "label"]) == [{"text": "좋은 영화", "label": "1"}]
    (tmp_path / "comma.csv").write_text('text,label\n"a\nb",1\n좋은, 영화,1\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"comma.csv:4 has 3 comma-separated cells.*quote a cell"):
        read_rows(str(tmp_path / "comma.csv"), ["text"])


def test_a_headerless_table_reads_by_the_column_names_given(tmp_path):
    """3i4k ships `label<TAB>text` lines with no header (as google-research/bert's GLUE processors read by
    position): its first row was taken for the header, so fine-tuning said the file had columns '0' and '만화'.
    `names` reads every line as a row; without it, the missing-column error says how to name them."""
    from kbert.data.rows import read_rows, text_rows

    (tmp_path / "i4k.txt").write_text("0\t만화\n2\t밥 먹었어?\n\n5\t빨리 와\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"no column 'text'; its columns are \['0', '만화'\]; if its first line is "
                                         r"a row, not a header, give the columns' names in order .*--columns"):
        read_rows(str(tmp_path / "i4k.txt"), ["text", "label"])
    rows = read_rows(str(tmp_path / "i4k.txt"), ["text", "label"], names=["label", "text"])
    assert rows == [{"label": "0", "text": "만화"}, {"label": "2", "text": "밥 먹었어?"}, {"label": "5", "text": "빨리 와"}]
    assert text_rows(str(tmp_path / "i4k.txt"), "text", names=("label", "text"))[0] == {"label": "0", "text": "만화"}
    with pytest.raises(ValueError, match=r"i4k.txt's lines are 2 tab-separated cells each, a TSV without a header"):
        text_rows(str(tmp_path / "i4k.txt"), "text")  # not "0<TAB>만화" as one text
    (tmp_path / "some.txt").write_text("한 줄\t탭\n둘째 줄\n", encoding="utf-8")
    assert text_rows(str(tmp_path / "some.txt"), "text") == [{"text": "한 줄\t탭"}, {"text": "둘째 줄"}]
    (tmp_path / "i4k.csv").write_text('0,"만화, 책"\n1,밥\n', encoding="utf-8")
    assert read_rows(str(tmp_path / "i4k.csv"), ["text"], names=["label", "text"])[0] == {"label": "0",
                                                                                          "text": "만화, 책"}
    with pytest.raises(ValueError, match=r"i4k.txt:1 has 2 tab-separated cells where the column names have 1"):
        read_rows(str(tmp_path / "i4k.txt"), ["text"], names=["text"])
    with pytest.raises(ValueError, match="must be distinct"):
        read_rows(str(tmp_path / "i4k.txt"), ["text"], names=["text", "text"])
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="rows.jsonl names its own"):
        read_rows(str(tmp_path / "rows.jsonl"), ["text"], names=["text"])
    with pytest.raises(ValueError, match="these rows are a list"):
        read_rows([{"text": "a"}], ["text"], names=["text"])
    with pytest.raises(ValueError, match=r"its columns are \['text'\]$"):  # JSON names its columns: no hint
        read_rows(str(tmp_path / "rows.jsonl"), ["label"])


@pytest.mark.slow
def test_the_short_documents_benchmark_runs_and_joining_fills_the_sequences(tmp_path):
    """benchmarks/short_documents.py end to end at toy size (its figures are in benchmarks/README.md): the
    joined examples hold more text and more real NSP pairs than google-research/bert's one document each."""
    reviews = os.path.join(SHARED, "movie-reviews", "reviews.tsv.gz")
    if not os.path.isfile(reviews):
        pytest.skip(f"the shared Korean data is not at {SHARED}")
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "short_documents.py")
    model = json.dumps({"architecture": "bert", "hidden_size": 32, "num_layers": 1, "num_heads": 2,
                        "intermediate_size": 64, "max_position": 128})
    run = subprocess.run([sys.executable, script, "--reviews", reviews, "--out", str(tmp_path), "--limit", "3000",
                          "--held", "20", "--vocab", "2000", "--steps", "4", "--batch", "8", "--model", model,
                          "--embedding-init", "random", "--sentiment", "300", "--seeds", "1", "--json"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    for seq in (64, 128):
        plain, joined = out["stats"][f"{seq}-plain"], out["stats"][f"{seq}-joined"]
        assert joined["text_share"] > plain["text_share"] + 0.15 and joined["next_share"] > plain["next_share"]
    for r in out["runs"].values():
        assert r["tokens_per_s"] > 0 and r["pseudo_perplexity"] > 1 and 0 < r["sentiment"][0] <= 1
