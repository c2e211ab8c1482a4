"""kbert.SparseEncoder: SPLADE vectors against sentence-transformers' SparseEncoder on the same weights (max and sum
pooling, both activations), a kbert pretraining dir, decode, search, max_active_dims, errors and the JAX path."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import hf_masked_lm_dir, run_on_jax

TEXTS = ["서울은 한국의 수도이다.", "나는 오늘 학교에 간다.", "이 영화 정말 재밌다", "국회는 법률을 만든다.",
         "서울의 국회는 오늘 법률을 만든다 재밌다 정말 학교"]


def _st_dir(tmp_path, pooling="max", activation="relu", module="Transformer"):
    """A sentence-transformers SparseEncoder on a tiny BERT, saved; and it. `module`: sentence-transformers 6's
    Transformer(transformer_task="fill-mask") or version 5's MLMTransformer (6 still reads and writes it)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.models import Transformer
    from sentence_transformers.sparse_encoder.models import MLMTransformer, SpladePooling

    path, _, tok = hf_masked_lm_dir(tmp_path, TEXTS)
    tok.save_pretrained(path)
    first = Transformer(path, transformer_task="fill-mask") if module == "Transformer" else MLMTransformer(path)
    st = SparseEncoder(modules=[first, SpladePooling(pooling, activation_function=activation)])
    out = str(tmp_path / f"st-{pooling}-{activation}")
    st.save(out)
    return out, st


@pytest.mark.parametrize("pooling,activation,module", [("max", "relu", "Transformer"), ("sum", "relu", "Transformer"),
                                                       ("max", "log1p_relu", "MLMTransformer")])
def test_vectors_match_sentence_transformers(tmp_path, pooling, activation, module):
    import kbert

    path, st = _st_dir(tmp_path, pooling, activation, module)
    ref = st.encode(TEXTS).to_dense().numpy()
    enc = kbert.SparseEncoder.load(path)
    assert (enc.pooling, enc.activation) == (pooling, activation)  # read from 1_SpladePooling/config.json
    got = enc.encode(TEXTS, batch_size=2)  # several length-sorted batches, back in the input order
    assert got.shape == (len(TEXTS), enc.vocab_size) and got.dtype == np.float32
    np.testing.assert_allclose(got.toarray(), ref, rtol=1e-5, atol=1e-5)
    assert (got.toarray() >= 0).all()
    np.testing.assert_allclose(enc.similarity(got, got), st.similarity(ref, ref).numpy(), rtol=1e-4)
    # decode: the same tokens and weights, heaviest first
    ours = enc.decode(got[0], top_k=5)
    theirs = st.decode(st.encode(TEXTS[0]), top_k=5)
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    np.testing.assert_allclose([w for _, w in ours], [w for _, w in theirs], rtol=1e-5)


def test_a_pretraining_dir_search_and_options(tmp_path):
    import kbert

    path, hf, tok = hf_masked_lm_dir(tmp_path, TEXTS)
    enc = kbert.SparseEncoder.load(path)  # a masked-LM dir: SPLADE's max pooling and relu
    assert (enc.pooling, enc.activation) == ("max", "relu")
    vectors = enc.encode(TEXTS)
    # by hand from transformers' masked-LM logits: max over a text's tokens of log(1 + relu(logit))
    import torch

    batch = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = hf(**batch).logits
    hand = torch.log1p(torch.relu(logits * batch["attention_mask"][..., None])).max(dim=1).values.numpy()
    np.testing.assert_allclose(vectors.toarray(), hand, rtol=1e-5, atol=1e-5)

    # the kbert model dir written with its heads reads the same
    kbert.save_model(kbert.load_model(path, with_heads=True), str(tmp_path / "kbert"), tokenizer=enc.tokenizer)
    again = kbert.SparseEncoder.load(str(tmp_path / "kbert")).encode(TEXTS)
    np.testing.assert_allclose(again.toarray(), vectors.toarray(), rtol=1e-5, atol=1e-6)

    # search: dot products, best first, the same as sorting similarity's rows
    hits = enc.search(TEXTS[:2], TEXTS, top_k=3)
    scores = enc.similarity(vectors[:2], vectors)
    for row, got in zip(scores, hits):
        assert [j for j, _ in got] == list(np.argsort(-row, kind="stable")[:3])
        np.testing.assert_allclose([s for _, s in got], np.sort(row)[::-1][:3], rtol=1e-5)
    again = enc.search(vectors[:2], vectors, top_k=3)  # vectors in, the same hits
    assert [[j for j, _ in h] for h in again] == [[j for j, _ in h] for h in hits]
    np.testing.assert_allclose([[x for _, x in h] for h in again], [[x for _, x in h] for h in hits], rtol=1e-5)

    # max_active_dims keeps each row's k heaviest weights; sparsity counts them
    cut = enc.encode(TEXTS, max_active_dims=4)
    assert (cut.getnnz(axis=1) == 4).all()
    dense, kept = vectors.toarray(), cut.toarray()
    for i in range(len(TEXTS)):
        assert np.allclose(np.sort(dense[i])[-4:], np.sort(kept[i][kept[i] > 0]))
    assert enc.sparsity(cut) == {"active_dims": 4.0, "sparsity_ratio": pytest.approx(1 - 4 / enc.vocab_size)}
    # a prompt is text before each input; a long text is truncated with a counting warning
    prompted = enc.encode(TEXTS[0], prompt="국회 ")
    np.testing.assert_allclose(prompted.toarray(), enc.encode("국회 " + TEXTS[0]).toarray(), rtol=1e-6)
    with pytest.warns(UserWarning, match="1 of 2 texts are longer than 8 tokens"):
        short = kbert.SparseEncoder.load(path, max_length=8).encode(["서울은", TEXTS[-1]])
    assert short.shape == (2, enc.vocab_size)
    assert enc.encode([]).shape == (0, enc.vocab_size)


def test_errors(tmp_path):
    import kbert

    path, st = _st_dir(tmp_path)
    enc = kbert.SparseEncoder.load(path)
    with pytest.raises(ValueError, match="SparseEncoder \\(SPLADE\\).*kbert.SparseEncoder.load"):
        kbert.Embedder.load(path)  # a sparse dir read as dense vectors would be silently wrong
    with pytest.raises(ValueError, match="max_active_dims"):
        enc.encode(TEXTS, max_active_dims=0)
    with pytest.raises(ValueError, match="not one of the model's prompts"):
        enc.encode(TEXTS, prompt_name="title")
    with pytest.raises(ValueError, match="vocabulary has"):
        enc.decode(np.ones(3, np.float32))
    with pytest.raises(ValueError, match="`pooling` must be one of"):
        kbert.SparseEncoder(enc.model, enc.tokenizer, pooling="mean")
    # a SparseEncoder of modules kbert does not compute is refused by name
    modules = json.loads((tmp_path / "st-max-relu" / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_CSR",
                    "type": "sentence_transformers.sparse_encoder.models.CSRSparsity"})
    (tmp_path / "st-max-relu" / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="CSRSparsity"):
        kbert.SparseEncoder.load(path)
    # an encoder without its masked-LM head has no token logits
    kbert.save_model(kbert.load_model(str(tmp_path / "bert")), str(tmp_path / "encoder"), tokenizer=enc.tokenizer)
    with pytest.raises(ValueError, match="holds no masked-LM head"):
        kbert.SparseEncoder.load(str(tmp_path / "encoder"))


def test_xla_and_jax_give_the_same_vectors(tmp_path):
    import kbert

    path, _, _ = hf_masked_lm_dir(tmp_path, TEXTS)
    eager = kbert.SparseEncoder.load(path).encode(TEXTS).toarray()
    xla = kbert.SparseEncoder.load(path, jit_compile=True).encode(TEXTS).toarray()  # bucketed rows and widths
    np.testing.assert_allclose(xla, eager, rtol=1e-4, atol=1e-5)
    script = (f"import json, kbert\nv = kbert.SparseEncoder.load({path!r}).encode({TEXTS!r}, batch_size=3)\n"
              f"print(json.dumps(v.toarray().tolist()))")
    on_jax, _ = run_on_jax(script)
    np.testing.assert_allclose(np.asarray(on_jax), eager, rtol=1e-4, atol=1e-5)


def test_cli_embed_sparse(tmp_path, capsys):
    import scipy.sparse

    import kbert
    from kbert.cli import main

    path, _, _ = hf_masked_lm_dir(tmp_path, TEXTS)
    lines = tmp_path / "in.txt"
    lines.write_text("\n".join(TEXTS[:3]) + "\n", encoding="utf-8")
    assert main(["embed", "--model", path, "--sparse", "--input", str(lines), "--max-active-dims", "5",
                 "--chunk", "2"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    enc = kbert.SparseEncoder.load(path)
    expected = enc.decode(enc.encode(TEXTS[:3], max_active_dims=5))
    assert [r["text"] for r in rows] == TEXTS[:3]
    for row, want in zip(rows, expected):  # heaviest first, 5 tokens each (a chunk of 2, then one line)
        assert list(row["weights"]) == [t for t, _ in want]
        np.testing.assert_allclose(list(row["weights"].values()), [w for _, w in want], atol=2e-6)
    assert main(["embed", "--model", path, "--sparse", "--input", str(lines), "--format", "npz",
                 "--out", str(tmp_path / "v")]) == 0
    saved = scipy.sparse.load_npz(str(tmp_path / "v.npz"))
    np.testing.assert_allclose(saved.toarray(), enc.encode(TEXTS[:3]).toarray(), rtol=1e-5, atol=1e-6)
    capsys.readouterr()
    assert main(["embed", "--model", path, "--sparse", "--words", "--input", str(lines)]) == 1
    assert "--words go with dense vectors, not --sparse" in capsys.readouterr().err
    assert main(["embed", "--model", path, "--format", "npz", "--out", str(tmp_path / "w"), "--input", str(lines)]) == 1
    assert "go with --sparse" in capsys.readouterr().err
