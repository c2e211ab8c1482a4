"""kbert.export_onnx / kbert.OnnxEmbedder: the ONNX graph run by ONNX Runtime gives the Python API's vectors and
probabilities, also when read without kbert (transformers' tokenizer + a bare onnxruntime session)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import kbert
from helpers import (BLOCK_TENSORFLOW, NO_BACKEND_PRELUDE, hf_masked_lm_dir, inference_free_splade_dir, run_on_jax,
                     tiny_embedding_model)

TEXTS = ["대한민국은 민주공화국이다.", "", "국회의원의 임기는 4년으로 한다. " * 12, "ㅋㅋㅋ 최악의 영화",
         "모든 국민은 법 앞에 평등하다.", "English and 숫자 123 섞인 문장"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_embedding_model(str(tmp_path_factory.mktemp("model") / "tiny"))


@pytest.fixture(scope="module")
def exported(model, tmp_path_factory):
    return kbert.export_onnx(model, str(tmp_path_factory.mktemp("onnx") / "float"))


def test_onnx_embedder_gives_the_embedders_vectors(model, exported):
    emb, onnx = kbert.Embedder.load(model), kbert.OnnxEmbedder.load(exported)
    assert isinstance(kbert.Embedder.load(exported), kbert.OnnxEmbedder)  # Embedder.load knows an export dir
    assert (onnx.dimension, onnx.max_length, onnx.pooling) == (emb.dimension, emb.max_length, "mean")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the long text is truncated on both sides
        for options in ({}, dict(normalize=False), dict(long_texts="mean"), dict(truncate_dim=16),
                        dict(max_length=16)):
            np.testing.assert_allclose(onnx.encode(TEXTS, batch_size=4, **options),
                                       emb.encode(TEXTS, batch_size=4, **options), atol=1e-5)
    np.testing.assert_allclose(onnx.similarity(onnx.encode(TEXTS[:2]), onnx.encode(TEXTS[3:])),
                               emb.similarity(emb.encode(TEXTS[:2]), emb.encode(TEXTS[3:])), atol=1e-5)
    assert [h[0][0] for h in onnx.search(TEXTS[:2], TEXTS, top_k=1)] == [0, 1]
    np.testing.assert_allclose(onnx.token_vectors([5, 6, 7]), emb.token_vectors([5, 6, 7]), atol=1e-5)
    with open(os.path.join(exported, "kbert_onnx.json"), encoding="utf-8") as f:
        info = json.load(f)
    assert info["inputs"] == ["input_ids", "attention_mask", "token_type_ids"] and info["quantize"] is None
    # the pooling is the graph's; word vectors are not among its outputs
    with pytest.raises(ValueError, match="fixed at export"):
        onnx.encode(TEXTS, pooling="cls")
    with pytest.raises(ValueError, match="pooled vectors only"):
        onnx.encode_words(TEXTS)


def test_the_graph_runs_without_kbert(model, exported, tmp_path):
    """transformers' tokenizer files in the dir and a bare ONNX Runtime session give the same vectors: what a
    service in another language or without kbert does."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = kbert.Embedder.load(model).encode(TEXTS)
    script = (
        "import sys, numpy as np, onnxruntime, transformers\n"
        "texts = open(sys.argv[2], encoding='utf-8').read().split('\\n')\n"
        "tok = transformers.AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "feed = dict(tok(texts, padding=True, truncation=True, max_length=64, return_tensors='np'))\n"
        "s = onnxruntime.InferenceSession(sys.argv[1] + '/model.onnx')\n"
        "assert sorted(i.name for i in s.get_inputs()) == sorted(feed)\n"
        "assert [d for d in s.get_inputs()[0].shape] == ['batch', 'sequence']\n"
        "np.save(sys.argv[3], s.run(['embeddings'], feed)[0])\n"
        "assert not any(m.startswith(('kbert', 'tensorflow', 'keras')) for m in sys.modules)\n")
    (tmp_path / "texts.txt").write_text("\n".join(TEXTS), encoding="utf-8")
    subprocess.run([sys.executable, "-c", script, exported, str(tmp_path / "texts.txt"), str(tmp_path / "v.npy")],
                   check=True, cwd=str(tmp_path))
    np.testing.assert_allclose(np.load(tmp_path / "v.npy"), expected, atol=1e-5)


def test_other_pooling_prompts_and_projections_travel_with_the_export(model, tmp_path):
    """A sentence-transformers dir with E5-style prompts and a whitening: the export keeps the prompts (text, put
    before the text by OnnxEmbedder) and the projections (in the graph's `embeddings` and in dense.npz)."""
    e = kbert.Embedder.load(model)
    e = kbert.Embedder(e.backbone, e.tokenizer, pooling="cls", prompts={"query": "질문: ", "passage": "문서: "})
    from kbert.data.corpus import corpus

    sentences = [s for doc in corpus(["kolaw"]) for s in doc if s.strip()][:60]
    e.fit_whitening(sentences, dim=8)
    st = kbert.export_sentence_transformers(e, str(tmp_path / "st"))
    out = kbert.export_onnx(st, str(tmp_path / "onnx"), pooling="first_last_avg")
    onnx = kbert.OnnxEmbedder.load(out)
    assert onnx.prompts == kbert.Embedder.load(st).prompts and onnx.dimension == 8 and onnx.pooling == "first_last_avg"
    assert {k: onnx.prompts[k] for k in e.prompts} == e.prompts  # (sentence-transformers adds "document")
    # a whitening scales rounding differences up by its spectral norm (hundreds for this random model's axes
    # of little variance): the pooled vectors agree to 1e-5, the whitened ones to 1e-5 times that gain
    gain = np.linalg.norm(e.dense[0]["weight"], 2)
    for prompt in ("query", "passage"):
        np.testing.assert_allclose(onnx.encode(TEXTS[:2], prompt_name=prompt),
                                   e.encode(TEXTS[:2], prompt_name=prompt, pooling="first_last_avg"), atol=1e-5 * gain)
    # the Embedder in memory exports as it is (its whitening and prompts, no dir written first)
    direct = kbert.OnnxEmbedder.load(kbert.export_onnx(e, str(tmp_path / "memory")))
    assert (direct.pooling, direct.dimension, direct.prompts) == ("cls", 8, e.prompts)
    np.testing.assert_allclose(direct.encode(TEXTS[:2], prompt_name="query"), e.encode(TEXTS[:2], prompt_name="query"),
                               atol=1e-5 * gain)
    assert len(e.dense) == 1 and e.max_length == 64  # left as it was
    e.dense = onnx.dense = []
    np.testing.assert_allclose(onnx.encode(TEXTS, prompt_name="query", normalize=False),
                               e.encode(TEXTS, prompt_name="query", pooling="first_last_avg", normalize=False),
                               atol=1e-5)
    assert kbert.OnnxEmbedder.load(kbert.export_onnx(st, str(tmp_path / "default"))).pooling == "cls"


def test_int8_export_is_smaller_and_keeps_the_vectors(model, exported, tmp_path):
    out = kbert.export_onnx(model, str(tmp_path / "int8"), quantize="int8")  # checks cosine >= 0.99 itself
    int8, floats = kbert.OnnxEmbedder.load(out), kbert.OnnxEmbedder.load(exported)
    cos = np.sum(int8.encode(TEXTS) * floats.encode(TEXTS), axis=1)
    assert cos.min() > 0.99, cos
    size = os.path.getsize(os.path.join(out, "model.onnx")) / os.path.getsize(os.path.join(exported, "model.onnx"))
    assert size < 0.6, size  # the embedding table and matrices as int8 (this tiny model has many small tensors)


@pytest.fixture(scope="module")
def classifier(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("classify")
    rows = [{"text": t, "label": label} for t, label in
            (("정말 좋은 영화", "pos"), ("최악의 영화", "neg"), ("배우 연기가 훌륭하다", "pos"), ("지루하고 별로", "neg"))]
    out = str(root / "clf")
    kbert.finetune(model, "classification", rows * 4, out_dir=out, max_steps=3, batch_size=8, progress=False)
    pairs = [{"a": "국회의원의 임기", "b": "임기는 4년", "label": "1"}, {"a": "대통령", "b": "평등", "label": "0"}]
    pair_out = str(root / "pair")
    kbert.finetune(model, "pair-classification", pairs * 4, out_dir=pair_out, text_column="a", pair_column="b",
                   max_steps=3, batch_size=8, progress=False)
    return out, pair_out


def test_classifier_graphs_give_predict_probabilities(classifier, exported, tmp_path):
    import onnxruntime

    from kbert.data.features import pad, segment_ids

    single, pair = classifier
    for model_dir, pairs in ((single, None), (pair, list(reversed(TEXTS)))):
        # export_onnx compares the graph with TaskModel.predict itself; here again from the outside
        out = kbert.export_onnx(model_dir, str(tmp_path / os.path.basename(model_dir)))
        with open(os.path.join(out, "kbert_onnx.json"), encoding="utf-8") as f:
            info = json.load(f)
        assert info["signature"] == "classify" and info["outputs"] == ["probabilities"]
        task = kbert.TaskModel.load(model_dir)
        assert info["labels"] == task.labels and info["pairs"] == (pairs is not None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = task.predict(TEXTS, pairs=pairs)
        encoded = task.tokenizer.encode_batch(TEXTS, pairs=pairs, max_length=task.max_length)
        ids = pad([e.ids for e in encoded], task.tokenizer.pad_id)
        mask = pad([[1] * len(e.ids) for e in encoded], 0)
        segments = pad([segment_ids(e.ids, task.tokenizer.sep_id) for e in encoded], 0)
        feed = {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64),
                "token_type_ids": np.asarray(segments, np.int64)}
        got = onnxruntime.InferenceSession(os.path.join(out, "model.onnx")).run(["probabilities"], feed)[0]
        np.testing.assert_allclose(got, expected, atol=1e-5)
        with pytest.raises(ValueError, match="OnnxEmbedder runs 'embed' exports: load a classifier's with "
                                             "kbert.OnnxTaskModel"):
            kbert.OnnxEmbedder.load(out)
        # kbert's runner: the same rows in input order, batched by length, one text one row
        onnx = kbert.OnnxTaskModel.load(out)
        assert onnx.labels == task.labels and onnx.task == task.task
        np.testing.assert_allclose(onnx.predict(TEXTS, pairs=pairs, batch_size=2), expected, atol=1e-5)
        one = onnx.predict(TEXTS[1], pairs=pairs[1] if pairs else None)
        np.testing.assert_allclose(one, expected[1], atol=1e-5)
        assert onnx.predict([], pairs=[] if pairs else None).shape == (0, len(task.labels))
        if pairs is not None:  # a two-label pair classifier ranks as TaskModel does
            docs = list(reversed(TEXTS))
            got, want = onnx.rank(TEXTS[0], docs, top_k=3), task.rank(TEXTS[0], docs, top_k=3)
            assert [r["corpus_id"] for r in got] == [r["corpus_id"] for r in want]
            np.testing.assert_allclose([r["score"] for r in got], [r["score"] for r in want], atol=1e-5)
        else:
            with pytest.raises(ValueError, match="ranking needs one score per pair"):
                onnx.rank(TEXTS[0], TEXTS)
        with pytest.raises(ValueError, match="fixed at export"):
            onnx.predict(TEXTS, pairs=pairs, activation="sigmoid")
    with pytest.raises(ValueError, match="OnnxTaskModel runs 'classify' exports: load it with kbert.OnnxEmbedder"):
        kbert.OnnxTaskModel.load(exported)


def test_export_errors_name_the_problem(model, exported, classifier, tmp_path):
    with pytest.raises(FileExistsError, match="overwrite"):
        kbert.export_onnx(model, exported)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="other than a kbert ONNX export"):
        kbert.export_onnx(model, str(tmp_path / "other"), overwrite=True)
    assert (tmp_path / "other" / "keep.txt").exists()
    with pytest.raises(ValueError, match=r"`quantize` must be one of \(None, 'int8'\)"):
        kbert.export_onnx(model, str(tmp_path / "q"), quantize="int4")
    with pytest.raises(ValueError, match="signature='classify' needs"):
        kbert.export_onnx(model, str(tmp_path / "c"), signature="classify")
    with pytest.raises(ValueError, match="an OnnxEmbedder is an export already"):
        kbert.export_onnx(kbert.OnnxEmbedder.load(exported), str(tmp_path / "again"))
    with pytest.raises(FileNotFoundError, match="not a kbert ONNX export"):
        kbert.OnnxEmbedder.load(model)
    with pytest.raises(ValueError, match="`threads` must be a positive integer"):
        kbert.OnnxEmbedder.load(exported, threads=0)
    assert not os.path.exists(str(tmp_path / "q.tmp"))  # nothing half-written is left behind
    # overwrite replaces an earlier export
    again = kbert.export_onnx(model, exported, overwrite=True, pooling="cls")
    assert kbert.OnnxEmbedder.load(again).pooling == "cls"
    kbert.export_onnx(model, exported, overwrite=True)  # back to the module's mean pooling


def test_cli_export_format_onnx(model, tmp_path):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = str(tmp_path / "cli")
    run = subprocess.run([sys.executable, "-m", "kbert.cli", "export", "--model", model, "--out", out, "--format",
                          "onnx", "--quantize", "int8"], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert "ONNX graph (embed, int8) written" in run.stdout
    assert kbert.OnnxEmbedder.load(out).info["quantize"] == "int8"
    bad = subprocess.run([sys.executable, "-m", "kbert.cli", "export", "--model", model, "--out", out + "2",
                          "--quantize", "int8"], capture_output=True, text=True, env=env)
    assert bad.returncode != 0 and "--quantize applies to --format onnx" in bad.stderr


def test_onnx_embedder_needs_no_tensorflow(model, exported):
    """On a host without TensorFlow (Keras on JAX) the export runs as it is; exporting needs TensorFlow's tracer
    and says so."""
    script = BLOCK_TENSORFLOW + (
        "import warnings; warnings.simplefilter('ignore')\n"
        "import kbert\n"
        f"texts = {TEXTS!r}\n"
        f"vectors = kbert.Embedder.load({exported!r}).encode(texts)\n"
        "try:\n"
        f"    kbert.export_onnx({model!r}, 'never-written')\n"
        "    error = None\n"
        "except ValueError as e:\n"
        "    error = str(e)\n"
        "print(json.dumps({'vectors': vectors.tolist(), 'error': error}))\n")
    out, _ = run_on_jax(script)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        np.testing.assert_allclose(out["vectors"], kbert.Embedder.load(model).encode(TEXTS), atol=1e-5)
    assert "runs on Keras' TensorFlow backend" in out["error"]


def test_onnx_exports_run_and_serve_with_no_keras_backend_installed(model, exported, classifier, tmp_path):
    """What the ONNX exports are for: a host with ONNX Runtime and kbert's base packages, no TensorFlow, JAX or
    torch (so Keras cannot import): vectors, a classifier's probabilities, `kbert embed` and `kbert serve`'s
    engine on either graph, the same numbers as the model dirs give."""
    graph = kbert.export_onnx(classifier[0], str(tmp_path / "clf"))
    lines = str(tmp_path / "texts.txt")
    with open(lines, "w", encoding="utf-8") as f:
        f.write(TEXTS[0] + "\n")
    script = NO_BACKEND_PRELUDE + (
        f"texts = {TEXTS!r}\n"
        f"vectors = kbert.OnnxEmbedder.load({exported!r}).encode(texts).tolist()\n"
        f"probabilities = kbert.OnnxTaskModel.load({graph!r}).predict(texts).tolist()\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        f"    status = main(['embed', '--model', {exported!r}, '--input', {lines!r}])\n"
        "engines = []\n"
        f"for path in ({exported!r}, {graph!r}):\n"
        "    engine = Engine(path)\n"
        "    engine.warm_up()\n"
        "    engines.append([engine.embedder is not None, engine.task_model is not None])\n"
        "print(json.dumps({'vectors': vectors, 'probabilities': probabilities, 'status': status,\n"
        "                  'cli': json.loads(out.getvalue().splitlines()[0])['vector'], 'engines': engines,\n"
        "                  'keras': 'keras' in sys.modules}))\n")
    out, _ = run_on_jax(script)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = kbert.Embedder.load(model).encode(TEXTS)
        np.testing.assert_allclose(out["vectors"], want, atol=1e-5)
        np.testing.assert_allclose(out["probabilities"], kbert.TaskModel.load(classifier[0]).predict(TEXTS),
                                   atol=1e-5)
    np.testing.assert_allclose(out["cli"], want[0], atol=1e-5)
    assert out["status"] == 0 and out["engines"] == [[True, False], [False, True]] and out["keras"] is False


def test_splade_exports_give_the_sparse_encoders_vectors_with_no_keras_backend(tmp_path):
    """A SPLADE model as a "sparse" graph: `SparseEncoder.load` runs it as OnnxSparseEncoder with the model's
    vectors (queries and documents, an inference-free model's query table with it), int8 within the export's
    cosine check, indexed and evaluated from the dir, and on a host with no Keras backend (vectors, `kbert
    serve`'s engine)."""
    from kbert.embed.sparse import OnnxSparseEncoder

    corpus = [t for t in TEXTS if t]
    (tmp_path / "mlm").mkdir(); (tmp_path / "free").mkdir()
    masked, _, _ = hf_masked_lm_dir(tmp_path / "mlm", TEXTS)
    graph = kbert.export_onnx(masked, str(tmp_path / "splade-onnx"), signature="sparse")
    enc, onnx = kbert.SparseEncoder.load(masked), kbert.SparseEncoder.load(graph)
    assert isinstance(onnx, OnnxSparseEncoder) and onnx.max_length == enc.max_length
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the long text is truncated
        want = enc.encode_document(TEXTS).toarray()
        got = onnx.encode_document(TEXTS)
    np.testing.assert_allclose(got.toarray(), want, atol=1e-5 * max(1.0, want.max()))
    assert onnx.decode(got[0], top_k=3)[0][0] == enc.decode(want[0], top_k=3)[0][0]

    # an inference-free dir: the default signature is "sparse", and the query table travels with the graph
    free, _ = inference_free_splade_dir(tmp_path / "free", corpus)
    free_graph = kbert.export_onnx(free, str(tmp_path / "free-onnx"))
    free_enc, free_onnx = kbert.SparseEncoder.load(free), kbert.SparseEncoder.load(free_graph)
    assert (free_enc.encode_query(corpus) != free_onnx.encode_query(corpus)).nnz == 0
    np.testing.assert_allclose(free_onnx.encode_document(corpus).toarray(),
                               free_enc.encode_document(corpus).toarray(), atol=1e-4)

    small = kbert.export_onnx(enc, str(tmp_path / "splade-int8"), quantize="int8")  # an encoder in memory
    assert os.path.getsize(os.path.join(small, "model.onnx")) < os.path.getsize(os.path.join(graph, "model.onnx"))

    # the dir goes wherever a SPLADE dir goes: an index, the evaluators
    index = kbert.SparseIndex.build(graph, corpus, str(tmp_path / "index"), progress=False)
    direct = kbert.SparseIndex.build(enc, corpus, str(tmp_path / "direct"), progress=False)
    assert [h.id for h in index.search(corpus[0], top_k=3)] == [h.id for h in direct.search(corpus[0], top_k=3)]
    relevant = {"q0": {"d0"}, "q1": {"d3"}}
    queries, docs = {"q0": corpus[0], "q1": corpus[3]}, {f"d{i}": t for i, t in enumerate(corpus)}
    figures = kbert.evaluate_retrieval(graph, queries, docs, relevant)
    assert figures["ndcg@10"] == pytest.approx(kbert.evaluate_retrieval(enc, queries, docs, relevant)["ndcg@10"])

    with pytest.raises(ValueError, match="exports with signature='sparse'"):
        kbert.export_onnx(enc, str(tmp_path / "x"), signature="embed")
    with pytest.raises(ValueError, match="pooling and layers are a dense model's"):
        kbert.export_onnx(masked, str(tmp_path / "x"), signature="sparse", pooling="cls")
    with pytest.raises(ValueError, match="with kbert.SparseEncoder"):
        kbert.Embedder.load(graph)

    script = NO_BACKEND_PRELUDE + (
        f"texts = {TEXTS!r}\n"
        f"vectors = kbert.SparseEncoder.load({graph!r}).encode_document(texts).toarray().tolist()\n"
        f"engine = Engine({graph!r})\n"
        "engine.warm_up()\n"
        "print(json.dumps({'vectors': vectors, 'engine': engine.sparse is not None,\n"
        "                  'keras': 'keras' in sys.modules}))\n")
    out, _ = run_on_jax(script)
    np.testing.assert_allclose(out["vectors"], want, atol=1e-5 * max(1.0, want.max()))
    assert out["engine"] is True and out["keras"] is False
