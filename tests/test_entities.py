"""TaskModel.entities: named-entity spans from a tagger, against transformers' token-classification pipeline on
the same weights (every aggregation strategy, WordPiece and SentencePiece), in the text as given."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from helpers import tiny_hf_config, xlmr_dir

LABELS = ["O", "B-PS", "I-PS", "B-LC", "I-LC", "B-OG", "I-OG"]
TEXTS = ["이순신은 조선 중기의 무신이다.", "서울특별시  강남구에서 삼성전자가 회의를 열었다!", "국회는 법률을 만든다 😀 서울",
         "모든 국민은 (법률이) 정하는 바에 의하여,국방의 의무를 진다."]
STRATEGIES = ["none", "simple", "first", "average", "max"]


def _noisy(model, scale):
    import torch

    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
        # labels that vary from token to token: a wide classifier without a favourite label
        model.classifier.weight.copy_(torch.randn_like(model.classifier.weight) * 3.0)
        model.classifier.bias.zero_()
    return model.eval()


def _same_as_pipeline(model, pipe, texts):
    """Every strategy: the same entities (type, span, score) as the pipeline; `word` is the text's own span."""
    kinds = set()
    for strategy in STRATEGIES:
        ours = model.entities(texts, aggregation=strategy)
        for text, got in zip(texts, ours):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the pipeline's "fallback heuristic" notice for SentencePiece
                expected = pipe(text, aggregation_strategy=strategy)
            key = "entity" if strategy == "none" else "entity_group"
            assert [(e[key], e["start"], e["end"]) for e in got] == [(e[key], e["start"], e["end"]) for e in expected]
            np.testing.assert_allclose([e["score"] for e in got], [float(e["score"]) for e in expected], rtol=1e-4,
                                       atol=1e-6)
            if strategy == "none":
                assert [e["index"] for e in got] == [e["index"] for e in expected]
            assert all(e["word"] == text[e["start"]:e["end"]] for e in got)
            kinds.update(e[key] for e in got)
    return kinds


def test_entities_of_a_wordpiece_tagger_match_the_pipeline(tmp_path):
    import transformers

    import kbert

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = sorted({c for t in TEXTS for c in t if not c.isspace() and c != "😀"})
    vocab += chars + [f"##{c}" for c in chars]
    out = tmp_path / "ner"
    config = tiny_hf_config(vocab_size=len(vocab), num_labels=len(LABELS), id2label=dict(enumerate(LABELS)),
                            label2id={label: i for i, label in enumerate(LABELS)})
    hf = _noisy(transformers.BertForTokenClassification(config), 0.1)
    hf.save_pretrained(out)
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tok = transformers.BertTokenizerFast(str(out / "vocab.txt"), do_lower_case=False, strip_accents=False)
    pipe = transformers.pipeline("token-classification", model=hf, tokenizer=tok)

    model = kbert.TaskModel.load(str(out))
    assert model.task == "tagging" and model.labels == LABELS
    kinds = _same_as_pipeline(model, pipe, TEXTS)
    assert len(kinds) >= 4  # the noise gives entities of several types, so grouping is exercised
    assert model.entities(TEXTS[1]) == model.entities(TEXTS, aggregation="simple")[1]  # simple: the HF default
    everything = model.entities(TEXTS[0], aggregation="none", ignore_labels=())
    assert len(everything) == len(tok(TEXTS[0], add_special_tokens=False)["input_ids"])
    # predict's (word, tag) pairs are each whitespace word's first token's label
    tags = model.predict([TEXTS[0]])[0]
    assert [w for w, _ in tags] == TEXTS[0].split()


def test_entities_of_a_sentencepiece_tagger_match_the_pipeline(tmp_path):
    """XLM-RoBERTa: pieces without a continuation marker (the pipeline's word rule: no space before a
    piece), a lone "▁" piece, and spans through kbert's whitespace normalization (two spaces in a row)."""
    import transformers

    import kbert

    labels = LABELS[:5]
    path = xlmr_dir(tmp_path, model_class="XLMRobertaForTokenClassification", num_labels=len(labels),
                    id2label=dict(enumerate(labels)), label2id={label: i for i, label in enumerate(labels)})
    hf = _noisy(transformers.AutoModelForTokenClassification.from_pretrained(path), 0.1)
    hf.save_pretrained(path)
    pipe = transformers.pipeline("token-classification", model=hf,
                                 tokenizer=transformers.AutoTokenizer.from_pretrained(path))
    model = kbert.TaskModel.load(path)
    assert len(_same_as_pipeline(model, pipe, TEXTS)) >= 3


def test_entities_rules_and_errors(tmp_path):
    import transformers

    import kbert
    from kbert.embed.entities import aggregate

    # labels without B-/I- continue their type; B- always starts a new entity
    text = "서울 부산 대구"
    scores = [np.array([0.1, 0.9, 0.0]), np.array([0.2, 0.0, 0.8]), np.array([0.1, 0.85, 0.05])]
    tokens = [{"index": i + 1, "scores": s, "start": a, "end": b, "subword": False}
              for i, (s, (a, b)) in enumerate(zip(scores, [(0, 2), (3, 5), (6, 8)]))]
    got = aggregate(tokens, ["O", "LC", "B-LC"], text, "simple")
    assert [(e["entity_group"], e["word"], e["start"], e["end"]) for e in got] == [("LC", "서울", 0, 2),
                                                                                 ("LC", "부산 대구", 3, 8)]
    assert [e["score"] for e in got] == pytest.approx([0.9, np.mean([0.8, 0.85])])
    merged = aggregate(tokens, ["O", "LC", "I-LC"], text, "simple")
    assert [(e["word"], e["entity_group"]) for e in merged] == [("서울 부산 대구", "LC")]
    assert aggregate(tokens, ["LC", "O", "O"], text, "first") == []  # all "O": nothing
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(tokens, ["O", "LC", "I-LC"], text, "mean")

    path = tmp_path / "cls"  # a model of another task refuses
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted({c for t in TEXTS for c in t if not c.isspace()})
    config = tiny_hf_config(vocab_size=len(vocab), num_labels=2)
    transformers.BertForSequenceClassification(config).save_pretrained(path)
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="needs a tagging model"):
        kbert.TaskModel.load(str(path)).entities(TEXTS[0])


def test_entity_spans_become_bio_labels_token_by_token(tmp_path):
    """The training side of span-labelled tagging: spans read from a cell, tokens placed in the text as given
    (two spaces in a row), and each token's BIO tag: an entity ends before the particle written onto it."""
    import kbert
    from kbert.data.entities import bio_labels, token_spans
    from kbert.data.rows import entity_spans

    text = "삼성전자가  서울에서 회의를 열었다."
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = sorted({c for c in text if not c.isspace()})
    (tmp_path / "vocab.txt").write_text("\n".join(vocab + chars + [f"##{c}" for c in chars]) + "\n", encoding="utf-8")
    tok = kbert.Tokenizer.load(str(tmp_path / "vocab.txt"))
    enc = tok.encode(text)
    spans = token_spans(tok, text, enc)
    assert spans[0] is None and spans[-1] is None  # [CLS], [SEP]
    assert [text[a:b] for a, b in spans[1:-1]] == [c for c in text if not c.isspace()]  # one character a token
    entities = entity_spans('[[7, 9, "LC"], {"start": 0, "end": 4, "label": "OG"}]', "train", 0)
    assert entities == [(0, 4, "OG"), (7, 9, "LC")]
    tags = bio_labels(spans, entities)
    assert tags == [None, "B-OG", "I-OG", "I-OG", "I-OG", "O", "B-LC", "I-LC"] + ["O"] * 9 + [None]
    # a token that holds the start of an entity begins it, even when the token starts earlier
    assert bio_labels([(0, 2), (2, 5), (5, 6)], [(3, 5, "PS")]) == ["O", "B-PS", "O"]

    assert entity_spans(["B-PS", "O"], "train", 0) is None and entity_spans("B-PS O", "train", 0) is None  # word tags
    assert entity_spans([], "train", 0) == [] and entity_spans("[]", "train", 0) == []
    with pytest.raises(ValueError, match="overlap"):
        entity_spans([[0, 4, "OG"], [2, 6, "LC"]], "train", 3)
    with pytest.raises(ValueError, match="train row 2: entity"):
        entity_spans([[4, 2, "OG"]], "train", 1)


def test_entity_figures_count_whole_entities():
    from kbert.train.metrics import entity_figures, entity_runs

    assert entity_runs(["B-PS", "I-PS", "O", "I-LC", "I-LC", "B-LC", "I-OG", "PS", "PS"]) == {
        (0, 2, "PS"), (3, 5, "LC"), (5, 6, "LC"), (6, 7, "OG"), (7, 9, "PS")}
    gold = [["B-PS", "I-PS", "O", "B-LC"], ["O", "B-OG", "I-OG", "O"]]
    predicted = [["B-PS", "I-PS", "O", "B-OG"], ["O", "B-OG", "O", "O"]]  # 1 right of 3 found, of 3 wanted
    figures = entity_figures(gold, predicted)
    assert figures == pytest.approx({"entity_precision": 1 / 3, "entity_recall": 1 / 3, "entity_f1": 1 / 3})
    assert entity_figures([["O"]], [["O"]])["entity_f1"] == 0.0


def test_a_kbert_tagger_exports_as_a_token_classifier(tmp_path):
    """export_transformers writes a tagging TaskModel as BertForTokenClassification: transformers' pipeline on
    it finds TaskModel.entities' spans, and the dir loads back as the same tagger."""
    import transformers

    import kbert
    from kbert.data.features import build_network
    from kbert.models.tasks import TaskNetwork

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = sorted({c for t in TEXTS for c in t if not c.isspace() and c != "😀"})
    (tmp_path / "vocab.txt").write_text("\n".join(vocab + chars + [f"##{c}" for c in chars]) + "\n", encoding="utf-8")
    tok = kbert.Tokenizer.load(str(tmp_path / "vocab.txt"))
    config = kbert.ModelConfig.preset("bert-tiny", vocab_size=tok.vocab_size, hidden_size=32, num_heads=2,
                                      intermediate_size=48, num_layers=2, max_position=64)
    network = TaskNetwork(kbert.BertBackbone(config), "tagging", len(LABELS), 0.0)
    build_network(network, tok)
    network.head.kernel.assign(np.random.default_rng(0).normal(0, 3.0, network.head.kernel.shape))
    model = kbert.TaskModel(network, tok, {"task": "tagging", "labels": LABELS, "max_length": 64,
                                           "aggregation": "simple"})
    out = kbert.export_transformers(model, str(tmp_path / "hf"))
    hf, info = transformers.AutoModelForTokenClassification.from_pretrained(out, output_loading_info=True)
    assert type(hf).__name__ == "BertForTokenClassification" and hf.config.id2label[1] == "B-PS"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    pipe = transformers.pipeline("token-classification", model=hf.eval(),
                                 tokenizer=transformers.AutoTokenizer.from_pretrained(out))
    assert len(_same_as_pipeline(model, pipe, TEXTS[:3])) >= 3
    again = kbert.TaskModel.load(out)
    assert again.entities(TEXTS) == model.entities(TEXTS)

    # `kbert convert`: the Hugging Face tagger to a kbert task dir and back to transformers
    from kbert.cli import main

    assert main(["convert", "--model", out, "--out", str(tmp_path / "kb"), "--to", "kbert"]) == 0
    assert kbert.TaskModel.load(str(tmp_path / "kb")).entities(TEXTS) == model.entities(TEXTS)
    assert main(["convert", "--model", str(tmp_path / "kb"), "--out", str(tmp_path / "hf2"), "--to",
                 "transformers"]) == 0
    assert transformers.AutoConfig.from_pretrained(str(tmp_path / "hf2")).architectures == ["BertForTokenClassification"]
