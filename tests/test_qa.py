"""Extractive question answering: SQuAD / KorQuAD rows, windows over long contexts, span decoding and KorQuAD's
figures, and Hugging Face `*ForQuestionAnswering` models answering as transformers' own pieces do."""

import json

import numpy as np
import pytest

import kbert
from kbert.data import qa
from kbert.data.features import features
from kbert.data.rows import read_rows

from helpers import KOREAN_SENTENCES

QUESTION = "대한민국의 주권은 누구에게 있는가"
CONTEXT = ("대한민국은 민주공화국이다.  대한민국의 주권은 국민에게 있고, 모든 권력은 국민으로부터 나온다. "
           "국회는 법률을 제정한다. 대통령은 국가의 원수이며, 외국에 대하여 국가를 대표한다. "
           "법원은 최고법원인 대법원과 각급법원으로 조직된다. 헌법재판소는 법률의 위헌여부를 심판한다.")


def test_span_decoding_equals_transformers_select_starts_ends():
    """`best_spans` scores spans as transformers' question-answering decoding does (softmax over the window's
    context tokens and [CLS], products of start and end probabilities, spans up to max_answer_length tokens,
    the null score from [CLS]), on random logits and windows with question, separators and context."""
    from transformers.pipelines.document_question_answering import select_starts_ends

    rng = np.random.default_rng(0)
    for trial in range(20):
        n_question, n_context = int(rng.integers(1, 6)), int(rng.integers(1, 25))
        spans = [None] * (n_question + 2) + [(i, i + 1) for i in range(n_context)] + [None]
        window = qa.Window([0] * len(spans), [0] * len(spans), spans)
        width = len(spans) + int(rng.integers(0, 4))  # padding past the window
        start, end = rng.normal(size=width) * 3, rng.normal(size=width) * 3
        p_mask = np.array([0 if t == 0 or (t < len(spans) and spans[t] is not None) else 1 for t in range(width)])
        attention = np.array([1] * len(spans) + [0] * (width - len(spans)))
        top_k, longest = int(rng.integers(1, 6)), int(rng.integers(1, 8))
        starts, ends, scores, null = select_starts_ends(start[None], end[None], p_mask[None], attention[None],
                                                        top_k=top_k, max_answer_len=longest,
                                                        handle_impossible_answer=True)
        found, found_null = qa.best_spans(start, end, window, top_k, longest)
        # transformers fills top_k with zero-scored spans ([CLS] as start) when fewer are valid; kbert does not
        real = [(a, b, s) for a, b, s in zip(starts.tolist(), ends.tolist(), scores.tolist()) if a > 0 and s > 0]
        assert [(a, b) for _, a, b in found] == [(a, b) for a, b, _ in real], trial
        np.testing.assert_allclose([s for s, _, _ in found], [s for _, _, s in real], rtol=1e-6)
        assert found_null == pytest.approx(null, rel=1e-6)


def test_the_normalized_context_maps_back_to_the_original_characters():
    """Every character of the normalized text comes from the original span `aligned_normalize` names (spaces
    from whitespace), under every kbert normalization: NFC of decomposed jamo, NFKC, removed controls and
    zero-width spaces, collapsed whitespace, lowercasing and shortened runs."""
    from kbert.text.normalize import normalize

    texts = KOREAN_SENTENCES + ["  \u1112\u1161\u11ab\u1100\u1173\u11af  ＡＢＣ１２３\u200b　㈜한국  ",
                                "ㅋㅋㅋㅋㅋ 대박!!!!!! Hello\tWORLD\n\n끝", "", "   "]
    settings = [{}, {"repeat": 2}, {"form": "NFKC"}, {"lowercase": True, "repeat": 1}]
    for text in texts:
        for kw in settings:
            norm = (lambda t: normalize(t, **kw))
            normalized, starts, ends = qa.aligned_normalize(text, norm)
            assert normalized == norm(text)
            assert len(starts) == len(ends) == len(normalized)
            for i, ch in enumerate(normalized):
                piece = text[starts[i]:ends[i]]
                if ch == " ":
                    assert piece == "" or piece.isspace(), (text, kw, i)
                else:
                    assert ch in norm(piece), (text, kw, i, piece)
            assert all(a <= b for a, b in zip(starts, starts[1:]))


def test_squad_files_answers_and_korquad_figures(tmp_path):
    """A SQuAD-format .json (KorQuAD's layout) reads as one row per question; answers come in datasets',
    SQuAD's or plain-text form, and a start that misses its text is an error naming the row; exact match and
    character F1 follow KorQuAD 1.0's evaluation script."""
    squad = {"version": "KorQuAD_v1.0", "data": [{"title": "헌법", "paragraphs": [
        {"context": CONTEXT, "qas": [
            {"id": "q1", "question": QUESTION, "answers": [{"text": "국민", "answer_start": CONTEXT.index("국민")}]},
            {"id": "q2", "question": "없는 질문", "answers": [], "is_impossible": True}]}]}]}
    path = tmp_path / "korquad.json"
    path.write_text(json.dumps(squad, ensure_ascii=False), encoding="utf-8")
    rows = read_rows(str(path), ["question", "context", "answers"])
    assert [r["id"] for r in rows] == ["q1", "q2"] and rows[0]["context"] == CONTEXT
    assert rows[0]["answers"] == {"text": ["국민"], "answer_start": [CONTEXT.index("국민")]}
    assert rows[1]["answers"] == {"text": [], "answer_start": []}
    at = CONTEXT.index("국회")
    assert qa.answer_list({"text": ["국회"], "answer_start": [at]}, CONTEXT, "r") == [("국회", at)]
    assert qa.answer_list([{"text": "국회", "answer_start": at}], CONTEXT, "r") == [("국회", at)]
    assert qa.answer_list("국회", CONTEXT, "r") == [("국회", at)]
    assert qa.answer_list(json.dumps({"text": ["국회"], "answer_start": [at]}), CONTEXT, "r") == [("국회", at)]
    assert qa.answer_list(None, CONTEXT, "r") == []
    with pytest.raises(ValueError, match="row 3: answer_start 0 does not point at the answer '국회'"):
        qa.answer_list({"text": ["국회"], "answer_start": [0]}, CONTEXT, "row 3")
    with pytest.raises(ValueError, match="does not occur in the context"):
        qa.answer_list("청와대", CONTEXT, "row 1")
    # KorQuAD 1.0: punctuation and spaces ignored, F1 over characters
    assert qa.exact_match("국민.", ["국민"]) == 1.0 and qa.exact_match("국민에게", ["국민"]) == 0.0
    assert qa.f1("국민에게", ["국민"]) == pytest.approx(2 * (2 / 4) * 1.0 / (2 / 4 + 1.0))
    assert qa.f1("대 법 원", ["대법원"]) == 1.0 and qa.f1("법원", ["대법원", "법원"]) == 1.0
    assert qa.f1("", ["국민"]) == 0.0 and qa.exact_match("", []) == 1.0
    assert qa.qa_scores({"a": "국민", "b": "법"}, {"a": ["국민"], "b": ["법원"], "c": ["x"]}) == pytest.approx(
        {"exact_match": 100 / 3, "f1": 100 * (1 + 2 / 3) / 3})


def _vocab_dir(tmp_path, texts):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = sorted({c for t in texts for c in t if not c.isspace()})
    vocab += chars + [f"##{c}" for c in chars]
    out = tmp_path / "qa"
    out.mkdir()
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return out, len(vocab)


def _reference_answers(hf, tok, question, context, max_length, stride, top_k, longest):
    """transformers' own pieces: the fast tokenizer's overflowing windows and offsets, the model's logits, and
    `select_starts_ends` per window; the best spans over the windows (the question-answering pipeline's
    aggregation)."""
    import torch
    from transformers.pipelines.document_question_answering import select_starts_ends

    enc = tok(question, context, truncation="only_second", max_length=max_length, stride=stride,
              return_overflowing_tokens=True, return_offsets_mapping=True, padding=True, return_tensors="np")
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(enc["input_ids"]), token_type_ids=torch.tensor(enc["token_type_ids"]),
                 attention_mask=torch.tensor(enc["attention_mask"]))
    found = {}
    for w in range(len(enc["input_ids"])):
        sequence = enc.sequence_ids(w)
        p_mask = np.array([0 if t == 0 or s == 1 else 1 for t, s in enumerate(sequence)])
        starts, ends, scores, _ = select_starts_ends(out.start_logits[w:w + 1].numpy(), out.end_logits[w:w + 1].numpy(),
                                                     p_mask[None], enc["attention_mask"][w:w + 1], top_k=top_k,
                                                     max_answer_len=longest)
        offsets = enc["offset_mapping"][w]
        for a, b, score in zip(starts, ends, scores):
            if a == 0 or score <= 0:  # the zero-scored fillers from [CLS] (see the decoding test)
                continue
            span = qa.strip_span(context, int(offsets[a][0]), int(offsets[b][1]))  # a lone `▁` covers a space
            if span is not None:
                found[span] = max(found.get(span, 0.0), float(score))
    ranked = sorted(found.items(), key=lambda x: -x[1])[:top_k]
    return [{"score": s, "start": a, "end": b, "answer": context[a:b]} for (a, b), s in ranked], enc


@pytest.mark.parametrize("architecture", ["bert", "electra", "unigram"])
def test_a_hugging_face_reader_answers_as_transformers_and_exports_back(tmp_path, architecture):
    """A `BertForQuestionAnswering` / `ElectraForQuestionAnswering` dir (KorQuAD readers' layouts; WordPiece, or
    a unigram tokenizer.json with lone `▁` pieces) loads as a TaskModel: its logits equal transformers', its
    windows over a long context equal the fast tokenizer's overflowing windows (stride = shared tokens), and
    `answer` gives the spans, character offsets into the original context and scores that transformers'
    decoding gives over those windows. A kbert reader exports as `BertForQuestionAnswering` with the same
    logits."""
    import torch
    import transformers

    from helpers import tiny_hf_config
    from kbert.data.corpus import corpus

    if architecture == "unigram":  # kbert's own vocabulary as transformers reads it (a tokenizer.json alone)
        out = tmp_path / "qa"
        kbert.Tokenizer.train(corpus(["kolaw"]), vocab_size=800, progress=False).export_transformers(str(out))
        size = 800
    else:
        out, size = _vocab_dir(tmp_path, [QUESTION, CONTEXT, "국회는 무엇을 하는가"])
    torch.manual_seed(0)
    if architecture in ("bert", "unigram"):
        hf = transformers.BertForQuestionAnswering(tiny_hf_config("bert", vocab_size=size, max_position_embeddings=128))
    else:
        hf = transformers.ElectraForQuestionAnswering(transformers.ElectraConfig(
            vocab_size=size, embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=37, max_position_embeddings=128, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    hf.eval().save_pretrained(out)
    tok = (transformers.AutoTokenizer.from_pretrained(str(out)) if architecture == "unigram" else
           transformers.BertTokenizerFast(str(out / "vocab.txt"), do_lower_case=False, strip_accents=False))
    model = kbert.TaskModel.load(str(out))
    assert model.task == "question-answering"
    with pytest.raises(ValueError, match="use answer"):
        model.predict([QUESTION])

    max_length, stride = 40, 8
    model.max_length = max_length
    for question in (QUESTION, "국회는 무엇을 하는가"):
        expected, enc = _reference_answers(hf, tok, question, CONTEXT, max_length, stride, 3, 10)
        assert len(enc["input_ids"]) >= 4  # the context runs over several windows
        windows = qa.windows(model.tokenizer, question, model.tokenizer.encode(CONTEXT, add_special_tokens=False),
                             max_length, stride)
        assert [w.ids for w in windows] == [[i for i, m in zip(ids, mask) if m]
                                            for ids, mask in zip(enc["input_ids"], enc["attention_mask"])]
        ids = np.array(enc["input_ids"], np.int32)
        logits = model.network(features(ids, np.array(enc["token_type_ids"]), 0))
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor(ids).long(), token_type_ids=torch.tensor(enc["token_type_ids"]),
                     attention_mask=torch.tensor(enc["attention_mask"]))
        mask = enc["attention_mask"].astype(bool)
        np.testing.assert_allclose(np.asarray(logits)[..., 0][mask], ref.start_logits.numpy()[mask], atol=2e-5)
        np.testing.assert_allclose(np.asarray(logits)[..., 1][mask], ref.end_logits.numpy()[mask], atol=2e-5)
        got = model.answer(question, CONTEXT, top_k=3, max_answer_length=10, doc_stride=stride)
        assert [(g["start"], g["end"], g["answer"]) for g in got] == [(e["start"], e["end"], e["answer"])
                                                                      for e in expected]
        np.testing.assert_allclose([g["score"] for g in got], [e["score"] for e in expected], rtol=1e-4)
        assert all(CONTEXT[g["start"]:g["end"]] == g["answer"] for g in got)
        best = model.answer(question, CONTEXT, max_answer_length=10, doc_stride=stride)
        assert best == got[0]
    both = model.answer([QUESTION, "국회는 무엇을 하는가"], CONTEXT, max_answer_length=10, doc_stride=stride)
    assert both[0] == model.answer(QUESTION, CONTEXT, max_answer_length=10, doc_stride=stride)
    assert model.answer(QUESTION, "") == {"score": 0.0, "start": 0, "end": 0, "answer": ""}
    # `kbert predict` on a SQuAD-style file: the answers of `answer`, keyed by id, and KorQuAD's figures
    from kbert.embed.prediction import predict_rows

    first, second = model.answer([QUESTION, "국회는 무엇을 하는가"], CONTEXT)
    rows = [{"id": "q1", "question": QUESTION, "context": CONTEXT,
             "answers": {"text": [first["answer"]], "answer_start": [first["start"]]}},
            {"id": "q2", "question": "국회는 무엇을 하는가", "context": CONTEXT, "answers": CONTEXT[:6]}]
    out, figures = predict_rows(model, rows)
    assert [(o["id"], o["answer"], o["start"]) for o in out] == [("q1", first["answer"], first["start"]),
                                                                 ("q2", second["answer"], second["start"])]
    assert figures == pytest.approx({"label_column": "answers", "rows": 2,
                                     "exact_match": 50 * (1 + qa.exact_match(second["answer"], [CONTEXT[:6]])),
                                     "f1": 50 * (1 + qa.f1(second["answer"], [CONTEXT[:6]]))})
    with pytest.raises(ValueError, match="one context per question"):
        model.answer([QUESTION] * 3, [CONTEXT] * 2)
    if architecture != "bert":
        return
    exported = tmp_path / "exported"
    kbert.export_transformers(model, str(exported))
    again = transformers.AutoModelForQuestionAnswering.from_pretrained(exported).eval()
    assert type(again).__name__ == "BertForQuestionAnswering"
    batch = transformers.AutoTokenizer.from_pretrained(exported)(QUESTION, CONTEXT[:60], return_tensors="pt")
    with torch.no_grad():
        a, b = again(**batch), hf(**batch)
    np.testing.assert_allclose(a.start_logits.numpy(), b.start_logits.numpy(), atol=2e-5)
    np.testing.assert_allclose(a.end_logits.numpy(), b.end_logits.numpy(), atol=2e-5)


@pytest.mark.parametrize("architecture", ["xlm-roberta", "albert"])
def test_xlm_roberta_and_albert_readers_give_transformers_logits(tmp_path, architecture):
    """An XLMRobertaForQuestionAnswering dir (`<s> q </s></s> c </s>`, positions re-based) and an
    AlbertForQuestionAnswering one load as readers with transformers' start and end logits on transformers'
    own pair encoding; an ALBERT reader exports back as AlbertForQuestionAnswering."""
    import torch
    import transformers

    from helpers import tiny_hf_config, xlmr_dir

    if architecture == "xlm-roberta":
        out = xlmr_dir(tmp_path, model_class="XLMRobertaForQuestionAnswering")
        tok = transformers.AutoTokenizer.from_pretrained(out)
    else:
        out, size = _vocab_dir(tmp_path, [QUESTION, CONTEXT])
        torch.manual_seed(0)
        transformers.AlbertForQuestionAnswering(tiny_hf_config("albert", vocab_size=size)).save_pretrained(out)
        tok = transformers.BertTokenizerFast(str(out / "vocab.txt"), do_lower_case=False, strip_accents=False)
        out = str(out)
    hf = transformers.AutoModelForQuestionAnswering.from_pretrained(out).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(out)
    model = kbert.TaskModel.load(out)
    assert model.task == "question-answering" and model.max_length <= 64
    context = CONTEXT[:50]
    enc = tok(QUESTION, context, return_tensors="np")
    assert model.tokenizer.encode(QUESTION, pair=context).ids == enc["input_ids"][0].tolist()
    window = qa.windows(model.tokenizer, QUESTION, model.tokenizer.encode(context, add_special_tokens=False), 64)
    assert [w.ids for w in window] == [enc["input_ids"][0].tolist()]
    logits = np.asarray(model.network(features(enc["input_ids"], np.array([window[0].segments]),
                                               model.tokenizer.pad_id)))
    with torch.no_grad():
        ref = hf(**{k: torch.from_numpy(v) for k, v in enc.items()})
    np.testing.assert_allclose(logits[0, :, 0], ref.start_logits.numpy()[0], atol=2e-5)
    np.testing.assert_allclose(logits[0, :, 1], ref.end_logits.numpy()[0], atol=2e-5)
    if architecture == "albert":
        kbert.export_transformers(model, str(tmp_path / "exported"))
        again = transformers.AutoModelForQuestionAnswering.from_pretrained(str(tmp_path / "exported")).eval()
        assert type(again).__name__ == "AlbertForQuestionAnswering"
        with torch.no_grad():
            back = again(**{k: torch.from_numpy(v) for k, v in enc.items()})
        np.testing.assert_allclose(back.start_logits.numpy(), ref.start_logits.numpy(), atol=2e-5)
