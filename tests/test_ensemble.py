"""kbert.EnsembleEmbedder: several models as one, its cosines the weighted mean of theirs."""

import json
import os
import shutil

import numpy as np
import pytest

import kbert

from helpers import tiny_embedding_model

TEXTS = ["대한민국은 민주공화국이다.", "모든 국민은 법 앞에 평등하다.", "", "국회는 법률을 제정한다.",
         "학교에서 공부했다"]


@pytest.fixture(scope="module")
def member_dirs(tmp_path_factory):
    """Two members of different kinds and widths: a tiny network (32 wide) and a static table distilled from
    it (16 wide), each in its own dir under one root."""
    root = tmp_path_factory.mktemp("members")
    network = tiny_embedding_model(str(root / "network"))
    static = str(root / "static")
    kbert.export_sentence_transformers(kbert.distill_static(kbert.Embedder.load(network), dim=16), static)
    return network, static


def test_ensemble_cosines_are_the_weighted_mean_of_its_members(member_dirs):
    a, b = (kbert.Embedder.load(d) for d in member_dirs)
    ens = kbert.EnsembleEmbedder([a, b], weights=[3, 1])
    assert ens.weights == [0.75, 0.25] and ens.dimension == 48
    v = ens.encode(TEXTS)
    assert v.shape == (len(TEXTS), 48) and v.dtype == np.float32
    # unit vectors, but for the empty text: the static member has no token of it and gives the zero vector
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), [1, 1, np.sqrt(0.75), 1, 1], atol=1e-5)
    va, vb = a.encode(TEXTS), b.encode(TEXTS)
    np.testing.assert_allclose(v @ v.T, 0.75 * (va @ va.T) + 0.25 * (vb @ vb.T), atol=1e-5)
    full = [0, 1, 3, 4]  # `similarity` takes cosines of the vectors: the empty text's is scaled up to unit length
    np.testing.assert_allclose(ens.similarity(v[full], v[full]), (v @ v.T)[np.ix_(full, full)], atol=1e-5)
    # the network member alone: its cosine x sqrt(0.75)
    np.testing.assert_allclose(ens.similarity(v[2], v[full])[0], np.sqrt(0.75) * (va[2] @ va[full].T), atol=1e-5)
    assert ens.encode(TEXTS[0]).shape == (48,)
    np.testing.assert_allclose(ens.encode(TEXTS[0]), v[0], atol=1e-5)
    # equal weights by default; a prompt reaches every member
    even = kbert.EnsembleEmbedder([a, b])
    assert even.weights == [0.5, 0.5]
    np.testing.assert_allclose(even.encode("법률", prompt="질문: "), even.encode("질문: 법률"), atol=1e-5)

    # search ranks by the mean cosine: the hits of the dot products above, best first
    corpus = [TEXTS[i] for i in full]
    hits = ens.search(TEXTS[:2], corpus, top_k=3)
    for q, row in enumerate(hits):
        scores = v[q] @ v[full].T
        order = np.argsort(-scores, kind="stable")[:3]
        assert [j for j, _ in row] == order.tolist()
        np.testing.assert_allclose([s for _, s in row], scores[order], atol=1e-5)
    assert len(ens.search("민주공화국", TEXTS, top_k=2, lexical=0.5)) == 2
    codes = ens.encode(TEXTS, precision="int8")
    assert codes.dtype == np.int8 and codes.shape == (len(TEXTS), 48)


def test_ensemble_saves_loads_by_any_loader_and_moves_with_its_members(member_dirs, tmp_path):
    a, b = (kbert.Embedder.load(d) for d in member_dirs)
    root = os.path.dirname(member_dirs[0])
    out = os.path.join(root, "ensemble")
    spec_file = kbert.EnsembleEmbedder(list(member_dirs), weights=[1, 3]).save(out)  # dirs name themselves
    with open(spec_file, encoding="utf-8") as f:
        spec = json.load(f)
    assert spec == {"members": [os.path.join("..", "network"), os.path.join("..", "static")], "weights": [0.25, 0.75]}
    expected = kbert.EnsembleEmbedder([a, b], weights=[1, 3]).encode(TEXTS)
    loaded = kbert.Embedder.load(out)
    assert isinstance(loaded, kbert.EnsembleEmbedder) and loaded.weights == [0.25, 0.75]
    np.testing.assert_allclose(loaded.encode(TEXTS), expected, atol=1e-5)
    moved = str(tmp_path / "moved")
    shutil.copytree(root, moved)  # the tree as one: members found relative to the ensemble's dir
    np.testing.assert_allclose(kbert.Embedder.load(os.path.join(moved, "ensemble")).encode(TEXTS), expected,
                               atol=1e-5)

    # a SearchIndex built from the dir records it, and its hits are the ensemble's own search
    index_dir = str(tmp_path / "index")
    corpus = [t for t in TEXTS if t]  # texts each member has tokens of: unit vectors
    kbert.SearchIndex.build(out, corpus, index_dir, progress=False)
    index = kbert.SearchIndex.load(index_dir)
    found = index.search(TEXTS[:2], top_k=3)
    expected_hits = loaded.search(TEXTS[:2], corpus, top_k=3)
    assert [[h.id for h in q] for q in found] == [[j for j, _ in q] for q in expected_hits]

    # `kbert embed` reads it as any model dir
    from kbert.cli import main

    texts_file, vectors_file = tmp_path / "in.txt", tmp_path / "out.npy"
    texts_file.write_text("\n".join(t for t in TEXTS if t) + "\n", encoding="utf-8")
    main(["embed", "--model", out, "--input", str(texts_file), "--format", "npy", "--out", str(vectors_file)])
    np.testing.assert_allclose(np.load(vectors_file), loaded.encode([t for t in TEXTS if t]), atol=1e-5)

    shutil.rmtree(os.path.join(moved, "static"))
    with pytest.raises(FileNotFoundError, match="names members that are not there"):
        kbert.Embedder.load(os.path.join(moved, "ensemble"))
    with open(os.path.join(moved, "ensemble", "ensemble.json"), "w", encoding="utf-8") as f:
        f.write("[1, 2]")
    with pytest.raises(ValueError, match="is not an ensemble spec"):
        kbert.Embedder.load(os.path.join(moved, "ensemble"))
    with pytest.raises(ValueError, match="no one sentence-transformers form"):
        kbert.export_sentence_transformers(out, str(tmp_path / "st"))
    with pytest.raises(ValueError, match="an ensemble several"):
        kbert.export_onnx(out, str(tmp_path / "onnx"))


def test_ensemble_refuses_what_does_not_apply_to_a_concatenation(member_dirs):
    a, b = (kbert.Embedder.load(d) for d in member_dirs)
    ens = kbert.EnsembleEmbedder([a, b])
    with pytest.raises(ValueError, match="two or more members"):
        kbert.EnsembleEmbedder([a])
    with pytest.raises(ValueError, match="2 positive numbers"):
        kbert.EnsembleEmbedder([a, b], weights=[1, -1])
    with pytest.raises(ValueError, match="not an ensemble"):
        kbert.EnsembleEmbedder([a, ens])
    with pytest.raises(ValueError, match="were given as Embedders"):
        ens.save("/tmp/never-written")
    with pytest.raises(ValueError, match=r"\['pooling'\] do not apply"):
        ens.encode(TEXTS, pooling="cls")
    with pytest.raises(ValueError, match=r"\['truncate_dim'\] do not apply"):
        ens.check_truncate_dim(8)
    with pytest.raises(TypeError, match="unexpected options"):
        ens.encode(TEXTS, bogus=1)
    with pytest.raises(ValueError, match="call it on a member"):
        ens.encode_words("학교에서 공부했다")
    with pytest.raises(ValueError, match="is not one of this model's prompts"):
        ens.prompt_text("query")
