"""TaskModel.zero_shot: zero-shot classification through an NLI model, against transformers'
zero-shot-classification pipeline on the same weights (WordPiece BERT and SentencePiece XLM-RoBERTa, one label
and several, multi-label, a text cut to fit), the CLI and the server."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from helpers import tiny_hf_config, xlmr_dir

NLI = ["entailment", "neutral", "contradiction"]  # KLUE-NLI's order
TEXTS = ["손흥민이 시즌 10호 골을 넣었다.", "국회는 법률을 만든다. 대통령은 법률안에 대하여 재의를 요구할 수 있다.",
         "모든 국민은 법률이 정하는 바에 의하여 국방의 의무를 진다. " * 6]
LABELS = ["스포츠", "정치", "경제 뉴스", "법"]
TEMPLATE = "이 글은 {}에 관한 것이다."


def _noisy(model):
    import torch

    torch.manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        # a wide classifier, so that the labels' scores differ: BERT's Linear, (XLM-)RoBERTa's out_proj
        head = model.classifier if hasattr(model.classifier, "weight") else model.classifier.out_proj
        head.weight.copy_(torch.randn_like(head.weight) * 2.0)
    return model.eval()


def _same_as_pipeline(model, pipe):
    for multi_label in (False, True):
        for labels in (LABELS, LABELS[:1]):
            ours = model.zero_shot(TEXTS, labels, hypothesis_template=TEMPLATE, multi_label=multi_label)
            for text, got in zip(TEXTS, ours):
                expected = pipe(text, candidate_labels=labels, hypothesis_template=TEMPLATE, multi_label=multi_label)
                assert got["sequence"] == text and sorted(got["labels"]) == sorted(expected["labels"])
                # each label's score, then the order: multi-label scores saturate near 1, where two labels
                # can differ by 1e-7 and float rounding may order them either way
                theirs = dict(zip(expected["labels"], expected["scores"]))
                np.testing.assert_allclose(got["scores"], [theirs[label] for label in got["labels"]], rtol=1e-4,
                                           atol=1e-6)
                assert got["scores"] == sorted(got["scores"], reverse=True)
                if not multi_label and len(labels) > 1:  # one label: entailment against contradiction
                    assert sum(got["scores"]) == pytest.approx(1.0)


def _bert_nli_dir(tmp_path, labels=NLI):
    import transformers

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = sorted({c for t in TEXTS + LABELS + [TEMPLATE, "이 예시는 입니다."] for c in t if not c.isspace()})
    vocab += chars + [f"##{c}" for c in chars]
    out = tmp_path / "nli"
    config = tiny_hf_config(vocab_size=len(vocab), num_labels=len(labels), id2label=dict(enumerate(labels)),
                            label2id={label: i for i, label in enumerate(labels)})
    hf = _noisy(transformers.BertForSequenceClassification(config))
    hf.save_pretrained(out)
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tok = transformers.BertTokenizerFast(str(out / "vocab.txt"), do_lower_case=False, strip_accents=False,
                                         model_max_length=64)
    return out, hf, tok


def test_zero_shot_of_a_bert_nli_model_matches_the_pipeline(tmp_path):
    """KLUE-NLI's label order; the third text is cut to the model's 64 tokens, the hypothesis kept whole."""
    import transformers

    import kbert

    out, hf, tok = _bert_nli_dir(tmp_path)
    pipe = transformers.pipeline("zero-shot-classification", model=hf, tokenizer=tok)
    model = kbert.TaskModel.load(str(out))
    model.max_length = 64
    assert len(tok(TEXTS[2])["input_ids"]) > 64  # the cut is exercised
    _same_as_pipeline(model, pipe)
    # one text in, one result out; labels as one comma-separated string, as the pipeline takes them
    one = model.zero_shot(TEXTS[0], "스포츠, 정치,경제 뉴스", hypothesis_template=TEMPLATE)
    assert one == model.zero_shot([TEXTS[0]], LABELS[:3], hypothesis_template=TEMPLATE)[0]
    default = model.zero_shot(TEXTS[0], LABELS)  # the Korean default template
    assert default["labels"] == pipe(TEXTS[0], candidate_labels=LABELS,
                                     hypothesis_template="이 예시는 {}입니다.")["labels"]
    assert model.zero_shot([], LABELS) == []


def test_zero_shot_of_an_xlm_roberta_nli_model_matches_the_pipeline(tmp_path):
    """SentencePiece pieces and `<s> a </s></s> b </s>` pairs; labels in another order (contradiction first)."""
    import transformers

    import kbert

    labels = ["contradiction", "entailment", "neutral"]
    path = xlmr_dir(tmp_path, model_class="XLMRobertaForSequenceClassification", num_labels=3,
                    id2label=dict(enumerate(labels)), label2id={label: i for i, label in enumerate(labels)})
    hf = _noisy(transformers.AutoModelForSequenceClassification.from_pretrained(path))
    hf.save_pretrained(path)
    pipe = transformers.pipeline("zero-shot-classification", model=hf,
                                 tokenizer=transformers.AutoTokenizer.from_pretrained(path))
    model = kbert.TaskModel.load(path)
    _same_as_pipeline(model, pipe)


def test_zero_shot_rules_and_errors(tmp_path):
    import transformers

    import kbert
    from kbert.embed.zero_shot import label_scores, nli_indices

    # one label per text: a softmax over the candidates' entailment logits; multi-label: each label's
    # entailment against contradiction, neutral left out
    logits = np.array([[[2.0, 0.0, -1.0], [0.0, 5.0, 0.0]]])  # [texts 1, candidates 2, nli 3]
    e = np.exp([2.0, 0.0])
    np.testing.assert_allclose(label_scores(logits, 0, 2, False), [e / e.sum()])
    np.testing.assert_allclose(label_scores(logits, 0, 2, True),
                               [[np.exp(2) / (np.exp(2) + np.exp(-1)), 0.5]])
    # a particle written in both forms after {} takes the label's own: batchim or not, and ㄹ before (으)로
    from kbert.embed.zero_shot import hypotheses

    assert hypotheses(["스포츠", "법", "IT"], "이 글의 주제는 {}(이)다.") == [
        "이 글의 주제는 스포츠다.", "이 글의 주제는 법이다.", "이 글의 주제는 IT(이)다."]
    assert hypotheses(["정치", "경제학"], "{}은(는) 주제다") == ["정치는 주제다", "경제학은 주제다"]
    assert hypotheses(["서울", "부산", "파리"], "{}(으)로 가자") == ["서울로 가자", "부산으로 가자", "파리로 가자"]
    assert hypotheses(["음악", "영화"], "{}을(를) 다룬 {{글}}") == ["음악을 다룬 {글}", "영화를 다룬 {글}"]
    assert hypotheses(["뉴스"], TEMPLATE) == [TEMPLATE.format("뉴스")]  # nothing to choose: format's own result
    assert nli_indices(NLI) == (0, 2)
    assert nli_indices(["Contradiction", "Entailment", "Neutral"]) == (1, 0)
    assert nli_indices(["ENTAILMENT", "neutral", "contra"]) == (0, 2)  # no "contradict": the pipeline's guess
    with pytest.raises(ValueError, match="'entailment' label"):
        nli_indices(["negative", "positive"])

    out, _, _ = _bert_nli_dir(tmp_path)
    model = kbert.TaskModel.load(str(out))
    for template in ("이 글은 스포츠다.", "이 글은 {label}에 관한 것이다.", "{0}와 {1}", "이 글은 {에 관한"):
        with pytest.raises(ValueError, match="hypothesis_template must hold"):
            model.zero_shot(TEXTS[0], LABELS, hypothesis_template=template)
    with pytest.raises(ValueError, match="at least one candidate"):
        model.zero_shot(TEXTS[0], [])
    with pytest.raises(ValueError, match="repeat"):
        model.zero_shot(TEXTS[0], ["법", "법"])
    model.max_length = 12
    with pytest.raises(ValueError, match="no room for the text"):
        model.zero_shot(TEXTS[0], ["아주 긴 레이블 이름입니다 정말로"], hypothesis_template=TEMPLATE)

    sentiment = tmp_path / "sentiment"  # a classifier without NLI labels refuses by name
    bad, _, _ = _bert_nli_dir(sentiment, labels=["negative", "positive"])
    with pytest.raises(ValueError, match="natural-language-inference model"):
        kbert.TaskModel.load(str(bad)).zero_shot(TEXTS[0], LABELS)


def test_zero_shot_cli_and_server(tmp_path):
    """`kbert zero-shot` writes one JSON line a text with the API's labels and scores; `kbert serve` answers
    /v1/zero-shot the same, and refuses a model that is not an NLI classifier."""
    from starlette.testclient import TestClient

    import kbert
    from kbert.server import build_app

    out, _, _ = _bert_nli_dir(tmp_path)
    model = kbert.TaskModel.load(str(out))
    expected = model.zero_shot(TEXTS[:2], LABELS, hypothesis_template=TEMPLATE, multi_label=True)
    (tmp_path / "in.txt").write_text(TEXTS[0] + "\n\n" + TEXTS[1] + "\n", encoding="utf-8")
    run = subprocess.run([sys.executable, "-m", "kbert.cli", "zero-shot", "--model", str(out), "--input",
                          str(tmp_path / "in.txt"), "--labels", ",".join(LABELS), "--template", TEMPLATE,
                          "--multi-label"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["line"] for r in rows] == [1, 3]
    for row, want in zip(rows, expected):
        assert row["text"] == want["sequence"] and row["labels"] == want["labels"]
        np.testing.assert_allclose(row["scores"], want["scores"], atol=1e-6)

    with TestClient(build_app(str(out))) as client:
        reply = client.post("/v1/zero-shot", json={"input": TEXTS[:2], "candidate_labels": LABELS,
                                                   "hypothesis_template": TEMPLATE, "multi_label": True})
        assert reply.status_code == 200, reply.text
        for got, want in zip(reply.json()["data"], expected):
            assert got["labels"] == want["labels"]
            np.testing.assert_allclose(got["scores"], want["scores"], rtol=1e-5)
        assert client.post("/v1/zero-shot", json={"input": TEXTS[:1]}).status_code == 400  # no labels
        bad = client.post("/v1/zero-shot", json={"input": TEXTS[:1], "candidate_labels": LABELS,
                                                 "hypothesis_template": "{label}"})
        assert bad.status_code == 400 and "hypothesis_template" in bad.json()["error"]["message"]
