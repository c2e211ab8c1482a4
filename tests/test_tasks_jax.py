"""Fine-tuning, distillation, `Embedder` and `TaskModel` on Keras' JAX backend, with TensorFlow unimportable
(a GPU or TPU host with `pip install -e ".[jax]"`), against the same calls on TensorFlow in this process.

Without dropout the two backends run the same arithmetic, so a fine-tuning's losses, its dev scores, the saved
model's predictions and vectors agree to float32 rounding; a model fine-tuned on one backend predicts the same
on the other; a run stopped on JAX resumes on TensorFlow to the uninterrupted run's result.
"""

import inspect
import json
import os
import shutil

import numpy as np
import pytest

import kbert
from kbert.data.corpus import corpus
from helpers import BLOCK_TENSORFLOW, run_on_jax

PRELUDE = BLOCK_TENSORFLOW + "import numpy as np\nimport kbert\n"
TEXTS = ["대한민국은 민주공화국이다.", "모든 국민은 법 앞에 평등하다.", "", "국회는 법률을 제정한다. " * 30]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A random 2-layer BERT without dropout (a model dir with its tokenizer) and rows of four tasks cut from
    the constitution: classification (does the sentence name 국민), sentence pairs scored by their shared
    characters, tagging (words ending in a particle), and unlabeled lines for SimCSE."""
    root = tmp_path_factory.mktemp("tasks-jax")
    tok = kbert.Tokenizer.train(corpus(["kolaw", "kobill"]), vocab_size=1500, progress=False)
    sentences = [s for s in corpus(["kolaw"]).texts() if len(s) > 8][:240]
    cfg = kbert.ModelConfig.preset("bert-tiny", vocab_size=tok.vocab_size, hidden_size=64, num_heads=2,
                                   intermediate_size=128, max_position=128, dropout=0.0, attention_dropout=0.0)
    base = str(root / "base")
    kbert.save_model(kbert.BertBackbone(cfg), base, tokenizer=tok)
    classes = [{"text": s, "label": "국민" if "국민" in s else "기타"} for s in sentences]
    pairs = [{"sentence1": a, "sentence2": b, "score": round(5 * len(set(a) & set(b)) / len(set(a) | set(b)), 2)}
             for a, b in zip(sentences[::2], sentences[1::2])]
    tags = [{"text": s, "label": " ".join("J" if w[-1] in "은는이가을를에의" else "O" for w in s.split())}
            for s in sentences]
    return {"root": str(root), "base": base, "classification": (classes[:200], classes[200:]),
            "sentence-embedding": (pairs[:100], pairs[100:]), "tagging": (tags[:200], tags[200:])}


SETTINGS = {"classification": {}, "tagging": {},
            "sentence-embedding": {"text_column": "sentence1", "pair_column": "sentence2", "label_column": "score"}}
COMMON = {"epochs": 2, "batch_size": 16, "learning_rate": 2e-3, "max_length": 64, "dropout": 0.0, "seed": 5,
          "progress": False}


def _outputs(out, task):
    """What a saved dir gives back: predictions and vectors of TEXTS (tags as their names)."""
    model = kbert.TaskModel.load(out)
    if task == "tagging":
        predictions = [[t for _, t in row] for row in model.predict(TEXTS)]
    else:
        predictions = np.asarray(model.predict(TEXTS), np.float64).tolist()
    return {"predictions": predictions, "vectors": kbert.Embedder.load(out).encode(TEXTS).astype(float).tolist()}


OUTPUTS = inspect.getsource(_outputs)  # the same function in the JAX scripts


def _on_jax(body):
    result, proc = run_on_jax(PRELUDE + f"TEXTS = {TEXTS!r}\n" + OUTPUTS + body + "\nprint(json.dumps(dict(out, tf='tensorflow' in sys.modules)))\n")
    assert result.pop("tf") is False, proc.stderr[-2000:]
    return result


def _finetune_script(data, task, out, **extra):
    """A `kbert.finetune` call of `task` as source, and what it returns (with the saved dir's outputs when it
    finished) as `out`."""
    train, dev = data[task]
    args = {**COMMON, **SETTINGS[task], **extra, "out_dir": out}
    return (f"s = kbert.finetune({data['base']!r}, {task!r}, {train!r}, {dev!r}, **{args!r})\n"
            f"out = dict(history=s['history'], steps=s['steps'], stopped=s['stopped_by'], checkpoint=s['checkpoint'])\n"
            f"if s['checkpoint'] is None: out.update(_outputs({out!r}, {task!r}))\n")


def _finetune_here(data, task, out, **extra):
    scope = {"kbert": kbert, "np": np, "TEXTS": TEXTS, "_outputs": _outputs}
    exec(_finetune_script(data, task, out, **extra), scope)
    return json.loads(json.dumps(scope["out"]))


def _close(a, b, tol):
    assert np.allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol), (a, b)


def _same_run(mine, theirs, task, tol=2e-3):
    assert (mine["steps"], mine["stopped"]) == (theirs["steps"], theirs["stopped"])
    assert [h["step"] for h in mine["history"]] == [h["step"] for h in theirs["history"]]
    for a, b in zip(mine["history"], theirs["history"]):
        assert sorted(a) == sorted(b)
        _close([a[k] for k in sorted(a)], [b[k] for k in sorted(b)], tol)
    if task == "tagging":
        assert mine["predictions"] == theirs["predictions"]
    else:
        _close(mine["predictions"], theirs["predictions"], tol)
    _close(mine["vectors"], theirs["vectors"], tol)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["classification", "sentence-embedding", "tagging"])
def test_jax_finetuning_without_tensorflow_continues_a_run_as_tensorflow_does(data, task):
    """A task head starts from random numbers, which each backend draws its own way from one seed; so both
    backends continue one run from its first checkpoint (written by TensorFlow), from the same weights."""
    first = os.path.join(data["root"], f"tf-{task}")
    part = _finetune_here(data, task, first, stop_after=2)
    assert (part["steps"], part["stopped"]) == (2, "stop_after")
    copy = os.path.join(data["root"], f"jax-{task}")
    shutil.copytree(first, copy)
    ref = _finetune_here(data, task, first)
    jax = _on_jax(_finetune_script(data, task, copy))
    assert ref["steps"] > 10 and ref["history"][-1]["train_loss"] < ref["history"][0]["train_loss"]
    _same_run(jax, ref, task)
    # the TensorFlow-trained dir read on JAX: the inference paths alone agree to float32 rounding
    crossed = _on_jax(f"out = _outputs({first!r}, {task!r})\n")
    if task == "tagging":
        assert crossed["predictions"] == ref["predictions"]
    else:
        _close(crossed["predictions"], ref["predictions"], 1e-5)
    _close(crossed["vectors"], ref["vectors"], 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["classification", "sentence-embedding"])
def test_lora_finetuning_on_jax_continues_a_run_as_tensorflow_does(data, task):
    """LoRA's factors (Keras' Dense.enable_lora) train on JAX as on TensorFlow: one run from a TensorFlow
    checkpoint (the factors' random start included) continued on each backend ends the same, and each writes
    the update merged into the kernels."""
    lora = dict(lora_rank=4, learning_rate=1e-2)
    first = os.path.join(data["root"], f"tf-lora-{task}")
    part = _finetune_here(data, task, first, stop_after=2, **lora)
    assert (part["steps"], part["stopped"]) == (2, "stop_after")
    copy = os.path.join(data["root"], f"jax-lora-{task}")
    shutil.copytree(first, copy)
    ref = _finetune_here(data, task, first, **lora)
    jax = _on_jax(_finetune_script(data, task, copy, **lora))
    assert ref["history"][-1]["train_loss"] < ref["history"][0]["train_loss"]
    _same_run(jax, ref, task)


@pytest.mark.slow
def test_lora_finetuning_over_two_devices_trains_the_one_device_model(data):
    """LoRA's factors are created inside the devices' scope and replicated like every weight: strategy='auto'
    on two host devices ends as the one-device run of the same seed."""
    task, lora = "classification", dict(lora_rank=4, learning_rate=1e-2, epochs=1)
    scripts = [_finetune_script(data, task, os.path.join(data["root"], f"lora-{s}"), strategy=s, **lora)
               + f"runs[{s!r}] = out\n" for s in ("cpu", "auto")]
    result, _ = run_on_jax(PRELUDE + f"TEXTS = {TEXTS!r}\n" + OUTPUTS + "runs = {}\n" + "".join(scripts)
                           + "import jax\nprint(json.dumps(dict(runs=runs, devices=len(jax.devices()))))\n",
                           env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert result["devices"] == 2
    _same_run(result["runs"]["auto"], result["runs"]["cpu"], task, tol=1e-4)


@pytest.mark.slow
def test_a_run_stopped_on_jax_resumes_on_jax_and_on_tensorflow_to_the_same_result(data):
    task = "classification"
    out = os.path.join(data["root"], "stopped-on-jax")
    part = _on_jax(_finetune_script(data, task, out, stop_after=9) + "part = out\nimport shutil\n"
                   + f"shutil.copytree({out!r}, {out + '-2'!r})\n"
                   + _finetune_script(data, task, out + "-2") + "out = dict(part=part, rest=out)\n")
    assert (part["part"]["steps"], part["part"]["stopped"]) == (9, "stop_after")
    assert part["part"]["checkpoint"].endswith("ckpt-9.safetensors")
    on_tf = _finetune_here(data, task, out)
    _same_run(on_tf, part["rest"], task)


@pytest.mark.slow
def test_simcse_and_every_distillation_mode_train_on_jax_without_tensorflow(data, tmp_path):
    """SimCSE (its two dropout masks per text: `test_the_compiled_step_...` below) and distillation, whose
    teacher runs inside (general) or before (task, embedding) the student's steps."""
    lines = [r["text"] for r in data["classification"][0]]
    pairs_dev = data["sentence-embedding"][1]
    teacher = os.path.join(data["root"], "tf-classification")
    if not os.path.isdir(teacher):  # this test run alone
        kbert.finetune(data["base"], "classification", *data["classification"], out_dir=teacher, **COMMON,
                       **SETTINGS["classification"])
    pretrained = str(tmp_path / "pretrained")
    kbert.save_model(kbert.Pretrainer(kbert.load_model(data["base"])), pretrained,
                     tokenizer=kbert.Tokenizer.from_model_dir(data["base"]))
    simcse = dict(objective="simcse", text_column="sentence1", pair_column="sentence2", label_column="score",
                  max_steps=6, eval_every=2, batch_size=32, learning_rate=1e-3, max_length=64, progress=False)
    out = _on_jax(
        f"out = {{}}\n"
        f"for p in (0.1,):\n"
        f"    s = kbert.finetune({data['base']!r}, 'sentence-embedding', [{{'sentence1': t}} for t in {lines!r}],"
        f" {pairs_dev!r}, out_dir={str(tmp_path)!r} + f'/simcse{{p}}', backbone_dropout=p, **{simcse!r})\n"
        f"    out[f'simcse{{p}}'] = [h['train_loss'] for h in s['history']]\n"
        f"for mode, kw in (('task', dict(train={data['classification'][0]!r})),"
        f"                 ('embedding', dict(dev={pairs_dev!r}, text_column='sentence1', pair_column='sentence2',"
        f"                                    label_column='score')),"
        f"                 ('general', {{}})):\n"
        f"    teacher = {pretrained!r} if mode == 'general' else {teacher!r}\n"
        f"    s = kbert.distill(teacher, 'bert-tiny', data={lines!r}, mode=mode, out_dir={str(tmp_path)!r} + '/' + mode,"
        f" epochs=1, batch_size=32, max_length=64, progress=False, **kw)\n"
        f"    out[mode] = dict(steps=s['steps'], loss=s['history'][-1]['train_loss'], dir=s['model_dir'])\n")
    losses = out["simcse0.1"]
    assert len(losses) == 3 and all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    for mode in ("task", "embedding", "general"):
        assert out[mode]["steps"] > 0 and np.isfinite(out[mode]["loss"]), out
        assert kbert.load_model(out[mode]["dir"]).config.num_layers >= 1


STEP_CHECKS = """
import keras
from kbert.compiled import training_step
# dropout: two passes of one batch in one step differ, and the next step draws new masks (the seed state is
# threaded through the compiled step and kept); a zero learning rate keeps the weights, so only masks change
cfg = kbert.ModelConfig.preset("bert-tiny", vocab_size=50, hidden_size=32, num_heads=2, intermediate_size=64,
                               max_position=16, dropout=0.2, attention_dropout=0.2)
backbone = kbert.BertBackbone(cfg)
ids = np.arange(2, 26, dtype="int32").reshape(2, 12)
feats = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": np.ones_like(ids)}
backbone(feats)
def gap(feats):
    a = backbone(feats, training=True)["sequence_output"]
    b = backbone(feats, training=True)["sequence_output"]
    return keras.ops.mean(keras.ops.square(a - b))
sgd = keras.optimizers.SGD(learning_rate=0.0)
sgd.build(backbone.trainable_variables)
step = training_step(gap, backbone, backbone.trainable_variables, sgd)
gaps = [step(feats) for _ in range(2)]
# clipping by the true global norm: a lookup table read with repeated rows ([0, 0, 0, 1]) gets each row's
# gradient summed before the norm is taken
table = keras.layers.Embedding(3, 2, embeddings_initializer="zeros")
table.build((None,))
rows = np.array([0, 0, 0, 1], "int32")
push = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], "float32")
def pull(rows):
    return -keras.ops.sum(table(rows) * push)
clipped = keras.optimizers.SGD(learning_rate=1.0, global_clipnorm=1.0)
clipped.build(table.trainable_variables)
training_step(pull, table, table.trainable_variables, clipped)(rows)
out = dict(gaps=gaps, table=np.asarray(keras.ops.convert_to_numpy(table.embeddings)).tolist())
"""


def test_the_compiled_step_draws_new_dropout_masks_and_clips_by_the_true_norm_on_both_backends():
    """The gradient of the table is [[3, 0], [0, 1], [0, 0]] (norm sqrt(10)), so the clipped update moves row 0
    by 3/sqrt(10) and row 1 by 1/sqrt(10); the norm of the four looked-up slices (sqrt(4) = 2) would move them
    by 3/2 and 1/2 (what TensorFlow's IndexedSlices gradient gave the optimizer before it was made dense)."""
    scope = {"kbert": kbert, "np": np}
    exec(STEP_CHECKS, scope)
    results = {"tensorflow": json.loads(json.dumps(scope["out"])), "jax": _on_jax(STEP_CHECKS)}
    expected = [[3 / np.sqrt(10), 0.0], [0.0, 1 / np.sqrt(10)], [0.0, 0.0]]
    for backend, result in results.items():
        first, second = result["gaps"]
        assert first > 1e-3 and second > 1e-3 and abs(first - second) > 1e-6, (backend, result["gaps"])
        _close(result["table"], expected, 1e-6)


def test_the_tensorflow_step_does_not_raise_the_frequent_retracing_alarm_for_its_own_shapes():
    """Each bucketed width and loss key traces the TensorFlow update once by design; TensorFlow's "N out of
    the last M calls ... triggered tf.function retracing" warning (seen in tutorial 04's multi-dataset cell)
    is dropped for kbert's update functions, and only for them."""
    import logging

    import keras
    import tensorflow as tf

    from kbert.compiled import training_step

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = tf.get_logger()
    handler = Keep()
    logger.addHandler(handler)
    try:
        x = keras.Variable(np.ones(3, np.float32))
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build([x])

        class Model:
            trainable_variables, non_trainable_variables, variables = [x], [], [x]

        step = training_step(lambda a, k: keras.ops.sum(x * keras.ops.sum(a)) * k, Model(), [x], optimizer)
        for n in range(2, 12):  # ten loss keys, one trace each
            step(np.ones((n, 3), np.float32), static=(n,))
        logger.warning("5 out of the last 9 calls to <function mine> triggered tf.function retracing.")
        # kbert.finetune's evaluation function, made anew by each call (a notebook fine-tuning twice)
        logger.warning("5 out of the last 10 calls to <function _run.<locals>.finetune_inference at 0x7f> "
                       "triggered tf.function retracing.")
    finally:
        logger.removeHandler(handler)
    assert not any("training_step" in r or "finetune_inference" in r for r in records), records
    assert any("function mine" in r for r in records)  # another function's alarm still gets through


def test_models_loaded_one_after_another_do_not_raise_the_frequent_retracing_alarm():
    """Each `Embedder` (or `MaskedLM`, teacher, ...) compiles its own function of one code object; a notebook
    that loaded a sixth model got TensorFlow's "5 out of the last 5 calls ... triggered tf.function retracing"
    alarm from its first `encode`. Functions given to `kbert.compiled.compiled` are kbert's: their alarm is
    dropped, and another function's still gets through."""
    import logging

    import keras
    import tensorflow as tf

    from kbert.compiled import compiled

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    def load_a_model():  # what Embedder.load and its first encode do, in miniature
        x = keras.Variable(np.ones(3, np.float32))

        def run(a):
            return a * x

        return compiled(run, [x], [tf.TensorSpec([None, 3], tf.float32)])

    def users_own():
        @tf.function
        def mine(a):
            return a + 1.0

        return mine

    logger = tf.get_logger()
    handler = Keep()
    logger.addHandler(handler)
    try:
        for _ in range(8):
            assert np.allclose(load_a_model()(np.ones((2, 3), np.float32)), 1.0)
        for _ in range(8):
            users_own()(tf.ones(2))
    finally:
        logger.removeHandler(handler)
    assert not any("load_a_model" in r for r in records), records
    assert any("retracing" in r and "users_own" in r for r in records), records  # TensorFlow's alarm is real


GRADIENT_CACHE = """import json
import keras
import numpy as np
import kbert
from kbert.compiled import backend, cached_training_step, training_step
from kbert.data.features import features
from kbert.train.finetune import FinetuneConfig
from kbert.train.finetune_tasks import task_for


def run(kind, dropout, chunk=5, matryoshka=None):
    # two SGD steps of a 2-layer bi-encoder on 6 (anchor, positive, hard negative) rows: 18 texts
    task = task_for(FinetuneConfig(model="-", task="sentence-embedding", pair_column="p", label_column=None,
                                   negative_column="n", matryoshka_dims=matryoshka))
    keras.utils.set_random_seed(0)
    cfg = kbert.ModelConfig.preset("bert-tiny", vocab_size=120, hidden_size=32, num_heads=2, intermediate_size=64,
                                   max_position=32, dropout=dropout, attention_dropout=dropout)
    net = task.network(kbert.BertBackbone(cfg, output_hidden_states=True), 0.0, "mean", -1)
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 120, (18, 12)).astype("int32")
    ids[::3, 8:] = 0  # some padding
    feats = features(ids, np.zeros_like(ids), 0)
    net(feats)
    variables = [v for v in net.trainable_variables if not v.path.startswith("pooler/")]  # unused by mean pooling
    opt = keras.optimizers.SGD(1.0)  # the update is the gradient itself
    opt.build(variables)
    bounds = [(lo, min(lo + chunk, 18)) for lo in range(0, 18, chunk)]

    def part(f, lo, hi):
        return {k: v[lo:hi] for k, v in f.items()}

    if kind == "cached":
        step = cached_training_step(lambda f: task.embed(net, f), task.embedding_loss, net, variables, opt, chunk)
    elif kind == "chunked":  # the same chunks through one ordinary backward pass: the reference with dropout
        step = training_step(lambda f, y, n, key: task.embedding_loss(
            keras.ops.concatenate([task.embed(net, part(f, lo, hi)) for lo, hi in bounds], axis=0), y, n, key),
            net, variables, opt)
    else:
        step = training_step(lambda f, y, n, key: task.loss(net, f, y, n, key), net, variables, opt)
    losses = [step(feats, None, static=(6, 0)) for _ in range(2)]
    return losses, [np.asarray(v.value) for v in variables]


def diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a[1], b[1])), max(abs(x - y) for x, y in zip(a[0], b[0]))


result = {"backend": backend(),
          "no_dropout": diff(run("cached", 0.0, matryoshka=[16]), run("full", 0.0, matryoshka=[16])),
          "dropout": diff(run("cached", 0.1), run("chunked", 0.1)),
          "one_chunk": diff(run("cached", 0.1, chunk=18), run("full", 0.1)),
          "dropout_matters": diff(run("full", 0.1), run("full", 0.0))}
if backend() == "jax":  # memory of the compiled update: 256 texts of 64 tokens at once, and 32 at a time
    task = task_for(FinetuneConfig(model="-", task="sentence-embedding", pair_column="p", label_column=None))
    cfg = kbert.ModelConfig.preset("bert-mini", vocab_size=1000, max_position=64)
    net = task.network(kbert.BertBackbone(cfg, output_hidden_states=True), 0.0, "mean", -1)
    ids = np.random.default_rng(0).integers(5, 1000, (256, 64)).astype("int32")
    feats = features(ids, np.zeros_like(ids), 0)
    net({k: v[:2] for k, v in feats.items()})
    variables = [v for v in net.trainable_variables if not v.path.startswith("pooler/")]
    opt = keras.optimizers.AdamW(1e-4)
    opt.build(variables)
    sizes = {}
    for name, step in (("full", training_step(lambda f, y, n, key: task.loss(net, f, y, n, key), net, variables, opt)),
                       ("cached", cached_training_step(lambda f: task.embed(net, f), task.embedding_loss, net,
                                                       variables, opt, 32))):
        sizes[name] = step.lower(feats, None, static=(128, 0)).compile().memory_analysis().temp_size_in_bytes
    result["temp_bytes"] = sizes
"""


def _gradient_cache_checks(result):
    assert result["no_dropout"][0] < 1e-4 and result["no_dropout"][1] < 1e-5  # the whole batch's gradient
    assert result["dropout"][0] < 1e-4 and result["dropout"][1] < 1e-5  # each chunk replays its own masks
    assert list(result["one_chunk"]) == [0.0, 0.0]
    assert result["dropout_matters"][0] > 1e-2  # the masks are really on, so the replay is really tested


def test_gradient_caching_updates_as_the_whole_batch_does_on_tensorflow():
    """`kbert.compiled.cached_training_step` (finetune's mini_batch_size): after two SGD steps of a bi-encoder
    with hard negatives on 18 texts in chunks of 5, the weights equal the whole batch's update (no dropout,
    Matryoshka widths on), and with dropout they equal one ordinary backward pass through the same chunks, so
    the second pass draws each chunk's masks again; one chunk of everything is the ordinary step exactly."""
    scope = {}
    exec(GRADIENT_CACHE, scope)
    assert scope["result"]["backend"] == "tensorflow"
    _gradient_cache_checks(scope["result"])


def test_gradient_caching_on_jax_in_a_chunks_memory():
    """The same on JAX, and the compiled update of 256 texts x 64 tokens (bert-mini) in chunks of 32 needs a
    fraction of the temporary memory of the whole batch at once (XLA's memory analysis, nothing run)."""
    result, _ = run_on_jax(BLOCK_TENSORFLOW + GRADIENT_CACHE + "\nprint(json.dumps(result))\n")
    assert result["backend"] == "jax"
    _gradient_cache_checks(result)
    sizes = result["temp_bytes"]
    assert sizes["cached"] < sizes["full"] / 4, sizes


def test_finetune_mini_batch_size_trains_the_same_model_and_is_refused_elsewhere(data, tmp_path, capsys):
    """kbert.finetune(mini_batch_size=...) and --mini-batch-size: a bi-encoder on scored pairs trained with
    chunks of 8 texts gives the vectors of the same run without chunks; other tasks refuse it by name."""
    from kbert.cli import main

    train, dev = data["sentence-embedding"]
    settings = dict(SETTINGS["sentence-embedding"], **COMMON, max_steps=6)
    vectors = {}
    for name, chunk in (("whole", None), ("chunks", 8)):
        out = str(tmp_path / name)
        kbert.finetune(data["base"], "sentence-embedding", train, dev, out_dir=out, mini_batch_size=chunk, **settings)
        vectors[name] = kbert.Embedder.load(out).encode(TEXTS)
    np.testing.assert_allclose(vectors["chunks"], vectors["whole"], atol=2e-4)
    with pytest.raises(ValueError, match="`mini_batch_size` \\(gradient caching\\) applies to task='sentence-embedding'"):
        kbert.finetune(data["base"], "classification", data["classification"][0], out_dir=str(tmp_path / "c"),
                       mini_batch_size=8, **dict(COMMON, max_steps=1))
    with pytest.raises(ValueError, match="`mini_batch_size` must be None or a positive integer"):
        kbert.finetune(data["base"], "sentence-embedding", train, out_dir=str(tmp_path / "d"), mini_batch_size=0,
                       **settings)
    rows = tmp_path / "pairs.jsonl"
    rows.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in train), encoding="utf-8")
    assert main(["finetune", "--model", data["base"], "--task", "sentence-embedding", "--train", str(rows),
                 "--out", str(tmp_path / "cli"), "--text-column", "sentence1", "--pair-column", "sentence2",
                 "--label-column", "score", "--max-steps", "2", "--mini-batch-size", "8"]) == 0
    capsys.readouterr()
    assert main(["finetune", "--model", data["base"], "--task", "sentence-embedding", "--train", str(rows),
                 "--out", str(tmp_path / "cli"), "--text-column", "sentence1", "--pair-column", "sentence2",
                 "--label-column", "score", "--max-steps", "2", "--mini-batch-size", "0", "--no-resume"]) == 1
    assert "mini_batch_size=0" in capsys.readouterr().err


DATA_PARALLEL = """
import jax
import kbert.train.finetune as ft
spans = []
def recording(distribution, tree, split=True):  # how many devices each training batch's ids are spread over
    placed = place(distribution, tree, split)
    if split:
        ids = placed[0]["token_ids"]
        spans.append((ids.shape[0], len(ids.addressable_shards), ids.addressable_shards[0].data.shape[0]))
    return placed
place, ft.place = ft.place, recording
out = {"devices": jax.device_count()}
for name, strategy in (("one", "cpu"), ("two", "auto")):
    spans.clear()
    runs = {}
    for task, train, dev, extra in RUNS:
        s = kbert.finetune(BASE, task, train, dev, out_dir=ROOT + f"/{name}-{task}", strategy=strategy,
                           **dict(COMMON, **extra))
        vectors = kbert.Embedder.load(ROOT + f"/{name}-{task}").encode(TEXTS).astype(float).tolist()
        runs[task] = dict(history=s["history"], steps=s["steps"], vectors=vectors)
    out[name] = dict(runs=runs, spans=sorted(set(spans)))
# stopped on two devices, resumed on one: the checkpoint does not tie a run to its devices
task, train, dev, extra = RUNS[0]
for strategy, stop in (("auto", 3), ("cpu", None)):
    s = kbert.finetune(BASE, task, train, dev, out_dir=ROOT + "/moved", strategy=strategy, stop_after=stop,
                       **dict(COMMON, **extra))
out["moved"] = dict(history=s["history"], steps=s["steps"],
                    vectors=kbert.Embedder.load(ROOT + "/moved").encode(TEXTS).astype(float).tolist())
# the Embedder on both devices: each encoding batch split along its rows, the one device's vectors
import kbert.compiled as kc
encoded = []
def recording_embedder(distribution, tree, split=True):
    placed = embedder_place(distribution, tree, split)
    if split:
        encoded.extend((x.shape[0], len(x.sharding.device_set)) for x in jax.tree_util.tree_leaves(placed))
    return placed
embedder_place, kc.place = kc.place, recording_embedder
texts = [t + f" {i}" for i in range(30) for t in TEXTS]
vectors = {s: kbert.Embedder.load(ROOT + "/moved", strategy=s).encode(texts, batch_size=32) for s in ("cpu", "auto")}
out["embedder"] = dict(gap=float(np.abs(vectors["cpu"] - vectors["auto"]).max()), batches=sorted(set(encoded)))
encoded.clear()
probs = {s: kbert.TaskModel.load(ROOT + "/one-classification", strategy=s).predict(texts) for s in ("cpu", "auto")}
out["task_model"] = dict(gap=float(np.abs(probs["cpu"] - probs["auto"]).max()), batches=sorted(set(encoded)))
"""


@pytest.mark.slow
def test_data_parallel_finetuning_over_two_devices_trains_the_one_device_model(data, tmp_path):
    """strategy='auto' on two (host) devices: each batch split along its rows, and the run, in-batch negatives
    and dropout included, the one the same seed gives on one device (`batch_size` is the whole batch, and an
    anchor is scored against the whole batch's positives, not its device's). A classification batch of odd
    rows (the epoch's last) runs whole on each device. A run stopped on two devices resumes on one. An
    Embedder and a TaskModel on both devices split their batches and give the one device's outputs."""
    pairs = [[{"anchor": r["sentence1"], "positive": r["sentence2"]} for r in rows] for rows in data["sentence-embedding"]]
    classes_train, classes_dev = data["classification"]
    runs = [("sentence-embedding", pairs[0], pairs[1],
             dict(text_column="anchor", pair_column="positive", label_column=None, backbone_dropout=0.1)),
            ("classification", classes_train[:199], classes_dev, {})]
    body = (f"BASE, ROOT, COMMON = {data['base']!r}, {str(tmp_path)!r}, {dict(COMMON, epochs=1)!r}\n"
            f"RUNS = {runs!r}\n" + DATA_PARALLEL)
    result, proc = run_on_jax(PRELUDE + f"TEXTS = {TEXTS!r}\n" + body + "print(json.dumps(out))\n",
                              env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert result["devices"] == 2
    one, two = result["one"], result["two"]
    assert all(devices == 1 for _, devices, _ in one["spans"]), one["spans"]
    # two devices: a batch of even rows is split in halves; the classification's last batch (7 rows) is whole
    assert [32, 2, 16] in two["spans"] and [7, 2, 7] in two["spans"], two["spans"]
    assert all(rows == 7 or per == rows // 2 for rows, devices, per in two["spans"]), two["spans"]
    pairs = [(one["runs"][task], two["runs"][task]) for task in ("sentence-embedding", "classification")]
    for model in ("embedder", "task_model"):
        assert result[model]["gap"] < 1e-5 and any(devices == 2 for _, devices in result[model]["batches"]), result
    for a, b in pairs + [(one["runs"]["sentence-embedding"], result["moved"])]:
        assert a["steps"] == b["steps"] > 5
        for ha, hb in zip(a["history"], b["history"]):
            assert sorted(ha) == sorted(hb)
            _close([ha[k] for k in sorted(ha)], [hb[k] for k in sorted(hb)], 1e-4)
        _close(a["vectors"], b["vectors"], 1e-4)


def test_finetune_and_embedder_strategy_is_checked_by_name_and_several_devices_need_jax(data, tmp_path, capsys):
    from kbert.cli import main

    train, dev = data["classification"]
    with pytest.raises(ValueError, match="`strategy` must be one of \\('auto', 'cpu', 'mirrored', 'tpu'\\)"):
        kbert.finetune(data["base"], "classification", train, out_dir=str(tmp_path / "a"), strategy="gpus",
                       **dict(COMMON, max_steps=1))
    with pytest.raises(ValueError, match="strategy='mirrored': chosen or several devices are for Keras' JAX backend"):
        kbert.finetune(data["base"], "classification", train, out_dir=str(tmp_path / "b"), strategy="mirrored",
                       **dict(COMMON, max_steps=1))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in train), encoding="utf-8")
    assert main(["finetune", "--model", data["base"], "--task", "classification", "--train", str(rows),
                 "--out", str(tmp_path / "cli"), "--max-steps", "1", "--strategy", "tpu"]) == 1
    assert "strategy='tpu'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="`strategy` must be one of"):
        kbert.Embedder.load(data["base"], strategy="all")
    with pytest.raises(ValueError, match="strategy='cpu': chosen or several devices are for Keras' JAX backend"):
        kbert.Embedder.load(data["base"], strategy="cpu")
