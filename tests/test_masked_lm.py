"""kbert.MaskedLM: fill-mask against transformers' pipeline on the same weights, pseudo-log-likelihood against a
hand loop over transformers' masked-LM logits, long texts, errors, the kbert model dir and the CLI."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest

from helpers import hf_masked_lm_dir, run_on_jax, xlmr_dir

TEXTS = ["서울은 한국의 수도이다.", "나는 오늘 학교에 간다.", "이 영화 정말 재밌다", "국회는 법률을 만든다."]


def _hf_dir(tmp_path, architecture="bert"):
    return hf_masked_lm_dir(tmp_path, TEXTS, architecture)


@pytest.mark.parametrize("architecture", ["bert", "albert"])
def test_fill_mask_matches_the_transformers_pipeline(tmp_path, architecture):
    import transformers

    import kbert

    path, hf, tok = _hf_dir(tmp_path, architecture)
    pipe = transformers.pipeline("fill-mask", model=hf, tokenizer=tok)
    lm = kbert.MaskedLM.load(path)
    texts = ["서울은 한국의 [MASK]이다.", "나는 [MASK]늘 학교에 [MASK].", "[MASK]", "이 영화 정말 재밌다 [MASK]"]
    ours = lm.fill_mask(texts, top_k=4, batch_size=3)  # mixed lengths over two batches
    for text, got in zip(texts, ours):
        expected = pipe(text, top_k=4)
        nested = isinstance(expected[0], list)
        assert isinstance(got[0], list) == nested
        for mask, (g, e) in enumerate(zip(got, expected) if nested else [(got, expected)]):
            assert [p["token"] for p in g] == [p["token"] for p in e]
            assert [p["token_str"] for p in g] == [p["token_str"] for p in e]
            np.testing.assert_allclose([p["score"] for p in g], [p["score"] for p in e], rtol=1e-4, atol=1e-6)
            for p in g:  # the text with this mask spelled out, the others kept
                spelling = p["token_str"].removeprefix("##")
                parts = text.split("[MASK]")
                assert p["sequence"] == "".join(x + (spelling if k == mask else "[MASK]" if k < len(parts) - 1
                                                     else "") for k, x in enumerate(parts))
    assert lm.fill_mask(texts[0], top_k=4) == ours[0]  # one text: its list alone

    # targets: the pipeline's choice among them (a target off the vocabulary stands for its first token)
    targets = ["수", "##도", "학교"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = lm.fill_mask(texts[0], top_k=5, targets=targets)
    assert any("학교" in str(w.message) for w in caught)
    expected = pipe(texts[0], top_k=5, targets=targets)
    assert len(got) == 3 and [p["token"] for p in got] == [p["token"] for p in expected]
    np.testing.assert_allclose([p["score"] for p in got], [p["score"] for p in expected], rtol=1e-4)


def test_fill_mask_of_a_sentencepiece_roberta_matches_the_pipeline(tmp_path):
    """XLM-RoBERTa's "<mask>" (which takes the space before it) and SentencePiece pieces: the text after a mask
    starts a new word ("▁이"), as transformers tokenizes it."""
    import torch
    import transformers

    import kbert

    path = xlmr_dir(tmp_path, model_class="XLMRobertaForMaskedLM")
    hf = transformers.AutoModelForMaskedLM.from_pretrained(path).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    pipe = transformers.pipeline("fill-mask", model=hf, tokenizer=transformers.AutoTokenizer.from_pretrained(path))
    hf.save_pretrained(path)
    lm = kbert.MaskedLM.load(path)
    assert lm.mask_token == "<mask>"
    for text in ["대한민국은 민주<mask>이다.", "<mask>국민은 법률이 정하는 바에 의하여 <mask>", "국민은 <mask> 법률"]:
        got, expected = lm.fill_mask(text, top_k=3), pipe(text, top_k=3)
        got, expected = (got, expected) if isinstance(got[0], list) else ([got], [expected])
        for g, e in zip(got, expected):
            assert [p["token"] for p in g] == [p["token"] for p in e]
            assert [p["token_str"] for p in g] == [p["token_str"] for p in e]
            np.testing.assert_allclose([p["score"] for p in g], [p["score"] for p in e], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("architecture", ["bert", "albert"])
def test_a_masked_lm_only_model_goes_to_transformers_and_back(tmp_path, architecture):
    """A Pretrainer without a pair head (objective "mlm") is written as transformers' *ForMaskedLM, which has no
    pooler, and such a dir (what transformers saves for a masked-LM model) loads back."""
    import transformers

    import kbert

    path, _, tok = _hf_dir(tmp_path)
    tokenizer = kbert.Tokenizer.load(path)
    config = kbert.ModelConfig.preset("bert-tiny" if architecture == "bert" else "albert-base", num_layers=2,
                                      hidden_size=32, num_heads=2, intermediate_size=48, max_position=64,
                                      vocab_size=tokenizer.vocab_size, **({} if architecture == "bert" else
                                                                         {"embedding_size": 16}))
    pretrainer = kbert.Pretrainer(kbert.build_backbone(config), pair_objective=None)
    lm = kbert.MaskedLM(pretrainer, tokenizer)
    text = "서울은 한국의 [MASK]이다."
    ours = lm.fill_mask(text)
    out = kbert.export_transformers(pretrainer, str(tmp_path / "exported"), tokenizer=tokenizer)
    hf, info = transformers.AutoModelForMaskedLM.from_pretrained(out, output_loading_info=True)
    assert type(hf).__name__ == ("BertForMaskedLM" if architecture == "bert" else "AlbertForMaskedLM")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    theirs = transformers.pipeline("fill-mask", model=hf.eval(), tokenizer=tok)(text)
    assert [p["token"] for p in ours] == [p["token"] for p in theirs]
    np.testing.assert_allclose([p["score"] for p in ours], [p["score"] for p in theirs], rtol=1e-4, atol=1e-6)
    again = kbert.MaskedLM.load(out)  # the masked-LM dir back: its encoder, a fresh pooler, the trained head
    assert again.fill_mask(text) == ours
    assert type(kbert.load_model(out)).__name__ == type(pretrainer.backbone).__name__


def test_an_electra_generator_fills_masks_as_transformers_does(tmp_path):
    """KoELECTRA's generators (ElectraForMaskedLM): a narrower embedding projected up, and the generator's head."""
    import torch
    import transformers

    import kbert

    path, _, tok = _hf_dir(tmp_path)
    config = transformers.ElectraConfig(vocab_size=tok.vocab_size, embedding_size=16, hidden_size=32,
                                        num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
                                        max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.ElectraForMaskedLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path / "generator"
    hf.save_pretrained(out)
    (out / "vocab.txt").write_bytes((tmp_path / "bert" / "vocab.txt").read_bytes())
    pipe = transformers.pipeline("fill-mask", model=hf, tokenizer=tok)
    lm = kbert.MaskedLM.load(str(out))
    for text in ("서울은 한국의 [MASK]이다.", "나는 [MASK]늘 학교에 간다."):
        got, expected = lm.fill_mask(text), pipe(text)
        assert [p["token"] for p in got] == [p["token"] for p in expected]
        np.testing.assert_allclose([p["score"] for p in got], [p["score"] for p in expected], rtol=1e-4, atol=1e-6)


def test_pseudo_log_likelihood_against_a_hand_loop(tmp_path):
    import torch

    import kbert

    path, hf, tok = _hf_dir(tmp_path)
    lm = kbert.MaskedLM.load(path)
    texts = TEXTS[:3] + [""]
    expected = []
    for text in texts:
        ids = tok(text)["input_ids"]
        total = 0.0
        for j in range(1, len(ids) - 1):
            masked = list(ids)
            masked[j] = tok.mask_token_id
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor([masked])).logits[0, j].double()
            total += float(torch.log_softmax(logits, -1)[ids[j]])
        expected.append((total, len(ids) - 2))
    got = lm.pseudo_log_likelihood(texts, batch_size=7)
    np.testing.assert_allclose(got, [e[0] for e in expected], rtol=1e-5, atol=1e-5)
    assert got[-1] == 0.0
    per_token = lm.pseudo_log_likelihood(texts, per_token=True)
    np.testing.assert_allclose(per_token, [t / n if n else 0.0 for t, n in expected], rtol=1e-5, atol=1e-6)
    assert lm.pseudo_log_likelihood(texts[0]) == pytest.approx(expected[0][0], rel=1e-5)
    pppl = math.exp(-sum(e[0] for e in expected) / sum(e[1] for e in expected))
    assert lm.pseudo_perplexity(texts) == pytest.approx(pppl, rel=1e-5)
    with pytest.raises(ValueError, match="every text is empty"):
        lm.pseudo_perplexity(["", " "])
    with pytest.raises(ValueError, match="holds the mask token"):
        lm.pseudo_log_likelihood(["서울은 [MASK]이다."])


def test_a_long_text_is_read_around_its_masks(tmp_path):
    import torch

    import kbert

    path, hf, tok = _hf_dir(tmp_path)
    lm = kbert.MaskedLM.load(path, max_length=16)
    text = "나는 오늘 학교에 간다. 서울은 한국의 [MASK]이다. 국회는 법률을 만든다. 이 영화 정말 재밌다"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    mask = ids.index(tok.mask_token_id)
    start = min(max(0, mask - 7), len(ids) - 14)  # 14 tokens centred on the mask, [CLS] and [SEP] around them
    window = [tok.cls_token_id] + ids[start:start + 14] + [tok.sep_token_id]
    with torch.no_grad():
        probs = torch.softmax(hf(input_ids=torch.tensor([window])).logits[0, window.index(tok.mask_token_id)], -1)
    with pytest.warns(UserWarning, match="window of 14 tokens"):
        got = lm.fill_mask(text, top_k=3)
    assert [p["token"] for p in got] == probs.topk(3).indices.tolist()
    np.testing.assert_allclose([p["score"] for p in got], probs.topk(3).values.numpy(), rtol=1e-4)
    with pytest.raises(ValueError, match="tokens apart"):
        lm.fill_mask("[MASK] 나는 오늘 학교에 간다. 서울은 한국의 수도이다. [MASK]")


def test_errors_and_the_kbert_model_dir(tmp_path):
    import kbert

    path, hf, tok = _hf_dir(tmp_path)
    lm = kbert.MaskedLM.load(path)
    with pytest.raises(ValueError, match="no mask token '\\[MASK\\]'"):
        lm.fill_mask(["서울은 [MASK]이다.", "서울은 수도이다."])
    with pytest.raises(ValueError, match="top_k"):
        lm.fill_mask("서울은 [MASK]이다.", top_k=0)
    with pytest.raises(ValueError, match="at least one token"):
        lm.fill_mask("서울은 [MASK]이다.", targets=[" "])
    with pytest.raises(TypeError, match="list of strings"):
        lm.fill_mask(3)

    # a kbert dir written with its heads loads and predicts the same; an encoder saved alone is refused
    pretrainer = kbert.load_model(path, with_heads=True)
    kbert.save_model(pretrainer, str(tmp_path / "with-heads"), tokenizer=lm.tokenizer)
    again = kbert.MaskedLM.load(str(tmp_path / "with-heads"))
    assert again.fill_mask("서울은 [MASK]이다.") == lm.fill_mask("서울은 [MASK]이다.")
    kbert.save_model(pretrainer.backbone, str(tmp_path / "encoder"), tokenizer=lm.tokenizer)
    hf.bert.save_pretrained(str(tmp_path / "hf-encoder"))  # a BertModel dir: no cls.predictions
    (tmp_path / "hf-encoder" / "vocab.txt").write_bytes((tmp_path / "bert" / "vocab.txt").read_bytes())
    for source in ("encoder", "hf-encoder"):
        with pytest.raises(ValueError, match="holds no masked-LM head"):
            kbert.MaskedLM.load(str(tmp_path / source))


def test_fill_mask_under_xla_and_on_jax(tmp_path):
    import kbert

    path, hf, tok = _hf_dir(tmp_path)
    texts = ["서울은 한국의 [MASK]이다.", "나는 [MASK]늘 학교에 [MASK]."]
    eager = kbert.MaskedLM.load(path).fill_mask(texts, top_k=3)
    xla = kbert.MaskedLM.load(path, jit_compile=True).fill_mask(texts, top_k=3)  # bucketed rows and positions
    pll = kbert.MaskedLM.load(path).pseudo_log_likelihood(TEXTS)
    script = (f"import json, kbert\nlm = kbert.MaskedLM.load({path!r})\n"
              f"print(json.dumps({{'fill': lm.fill_mask({texts!r}, top_k=3), "
              f"'pll': lm.pseudo_log_likelihood({TEXTS!r}).tolist()}}))")
    on_jax, _ = run_on_jax(script)
    for other in (xla, on_jax["fill"]):
        flat = [p for t in other for m in (t if isinstance(t[0], list) else [t]) for p in m]
        ref = [p for t in eager for m in (t if isinstance(t[0], list) else [t]) for p in m]
        assert [p["token"] for p in flat] == [p["token"] for p in ref]
        np.testing.assert_allclose([p["score"] for p in flat], [p["score"] for p in ref], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(on_jax["pll"], pll, rtol=1e-4)


def test_cli_fill_mask(tmp_path, capsys):
    from kbert.cli import main

    path, hf, tok = _hf_dir(tmp_path)
    lines = tmp_path / "in.txt"
    lines.write_text("서울은 한국의 [MASK]이다.\n\n나는 [MASK]늘 학교에 [MASK].\n", encoding="utf-8")
    assert main(["fill-mask", "--model", path, "--input", str(lines), "--top-k", "2"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["line"] for r in rows] == [1, 3]
    assert len(rows[0]["predictions"]) == 2 and len(rows[1]["predictions"]) == 2  # 2 tokens; 2 masks
    assert rows[1]["predictions"][0][0]["sequence"].endswith("[MASK].")
    scored = tmp_path / "plain.txt"
    scored.write_text("\n".join(TEXTS[:2]) + "\n", encoding="utf-8")
    assert main(["fill-mask", "--model", path, "--input", str(scored), "--pseudo-likelihood"]) == 0
    out = capsys.readouterr()
    rows = [json.loads(x) for x in out.out.splitlines()]
    assert [r["tokens"] for r in rows] == [len(tok(t, add_special_tokens=False)["input_ids"]) for t in TEXTS[:2]]
    assert all(r["pseudo_log_likelihood"] < 0 for r in rows) and "pseudo-perplexity" in out.err
    assert main(["fill-mask", "--model", path, "--input", str(scored)]) == 1
    assert "no mask token" in capsys.readouterr().err
