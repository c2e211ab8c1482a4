"""`kbert.pretrain` on Keras' JAX backend (CPU here; `benchmarks/gpu.py pretrain` is the GPU run): learning from
records, DataParallel over two devices, SIGTERM and resume, checkpoints that cross backends, and bad input.

Each JAX run is a fresh Python (`helpers.run_on_jax`): Keras fixes its backend at import, and this process
runs TensorFlow (which also prepares the records, as `kbert data prepare` does).
"""

import json
import os

import numpy as np
import pytest

import kbert
from kbert.data import records
from kbert.data.corpus import corpus
from kbert.train.loop import pretrain
from helpers import BLOCK_TENSORFLOW, run_on_jax

TINY = {"architecture": "bert", "hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128,
        "max_position": 128, "dropout": 0.0, "attention_dropout": 0.0}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A tokenizer and mlm+nsp records of the konlpy corpora (what `kbert data prepare` writes)."""
    root = tmp_path_factory.mktemp("jax")
    tok = kbert.Tokenizer.train(corpus(["kolaw", "kobill"]), vocab_size=1500, progress=False)
    tok.save(str(root / "tok"))
    records.prepare(["kolaw", "kobill"], tok, str(root / "records"), max_length=64, docs_per_shard=4, workers=0,
                    progress=False)
    return str(root / "tok"), str(root / "records")


def _config(prepared, out, steps, **sections):
    tok_dir, records_dir = prepared
    cfg = {"model": dict(TINY), "data": {"source": records_dir, "tokenizer": tok_dir, "shuffle_buffer": 100},
           "optimizer": {"learning_rate": 2e-3, "warmup_steps": 10},
           "trainer": {"steps": steps, "batch_size": 16, "log_every": 5, "checkpoint_every": 1000},
           "runtime": {"strategy": "auto", "seed": 3}, "output_dir": out}
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values} if isinstance(values, dict) else values
    return cfg


def _script(body: str) -> str:
    return "import json, os, sys\nimport numpy as np\nfrom kbert.train.loop import pretrain\n" + body


@pytest.mark.slow
def test_jax_pretraining_from_records_learns_and_writes_a_model_both_backends_load(prepared, tmp_path):
    out = str(tmp_path / "run")
    cfg = _config(prepared, out, 300, trainer={"log_every": 50}, optimizer={"learning_rate": 5e-3, "warmup_steps": 30})
    result, proc = run_on_jax(_script(
        f"s = pretrain({cfg!r}, progress=False)\n"
        "h = s['history']\n"
        "print(json.dumps(dict(first=float(np.mean(h[:5])), last=float(np.mean(h[-10:])), step=s['step'],"
        " backend=s['backend'], model_dir=s['model_dir'], finished=s['finished'],"
        " acc=s['mlm_accuracy'], waited=s['host_waited_fraction'])))\n"))
    assert result["backend"] == "jax" and result["finished"] and result["step"] == 300
    assert 0.0 < result["waited"] <= 1.0  # the share of the steady time the host waited for the device
    # MLM + NSP loss: ~8.0 at the start (log 1500 + log 2); the TensorFlow path's test asks the same fall
    assert result["last"] < result["first"] - 1.0, result
    # the model dir is the same format as the TensorFlow path's: kbert.load_model / Embedder read it here
    model = kbert.load_model(result["model_dir"])
    assert model.config.hidden_size == 64
    vectors = kbert.Embedder.load(result["model_dir"]).encode(["대한민국은 민주공화국이다."])
    assert vectors.shape == (1, 64) and np.isfinite(vectors).all()
    assert os.listdir(os.path.join(out, "logs"))  # TensorBoard scalars


@pytest.mark.slow
def test_jax_nan_loss_stops_before_saving_a_diverged_state(prepared, tmp_path):
    """JAX dispatches step N+1 before the host reads step N's loss; the guard must still stop before any
    diverged state is saved. Checkpoints every 3 steps: a divergence at a step in between is read one step
    late (the lagged path), one at a checkpoint step is read before its save."""
    import re

    from safetensors.numpy import load_file

    from kbert.train.run_checkpoint import RunCheckpoints

    outs = {every: str(tmp_path / f"every{every}") for every in (3, 1)}
    cfgs = {every: _config(prepared, out, 50, trainer={"checkpoint_every": every},
                           optimizer={"learning_rate": 1e30, "clip_norm": None, "warmup_steps": 0,
                                      "weight_decay": 0.0})
            for every, out in outs.items()}
    result, _ = run_on_jax(_script(
        "from kbert.train.loop import TrainingDiverged\n"
        "out = {}\n"
        f"for every, cfg in {cfgs!r}.items():\n"
        "    try:\n"
        "        pretrain(cfg, progress=False)\n"
        "        out[every] = None\n"
        "    except TrainingDiverged as e:\n"
        "        out[every] = str(e)\n"
        "print(json.dumps(out))\n"))
    for every, out in outs.items():
        message = result[str(every)]
        assert message and "last good checkpoint is intact" in message, (every, message)
        diverged = int(re.search(r"at step (\d+)", message).group(1))
        saved = sorted(int(f.split("-")[1].split(".")[0]) for f in os.listdir(os.path.join(out, "checkpoints"))
                       if f.startswith("ckpt-")) if os.path.isdir(os.path.join(out, "checkpoints")) else []
        assert all(step < diverged for step in saved), (every, diverged, saved)
        latest = RunCheckpoints(os.path.join(out, "checkpoints")).latest
        if latest is not None:
            assert latest in message
            assert all(np.isfinite(v).all() for v in load_file(latest).values() if v.dtype.kind == "f")
        if every == 1:  # every step is saved once its loss is read: the last one saved is the step before
            assert saved and saved[-1] == diverged - 1, (diverged, saved)


@pytest.mark.slow
def test_data_parallel_over_two_devices_gives_the_one_device_loss_curve(prepared, tmp_path):
    one = _config(prepared, str(tmp_path / "one"), 8, runtime={"strategy": "cpu"})
    two = _config(prepared, str(tmp_path / "two"), 8, runtime={"strategy": "auto"})
    result, _ = run_on_jax(_script(
        "import jax\n"
        f"a = pretrain({one!r}, progress=False)\nb = pretrain({two!r}, progress=False)\n"
        "print(json.dumps(dict(devices=len(jax.devices()), one=a['history'], two=b['history'],"
        " replicas=[a['replicas'], b['replicas']])))\n"),
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert result["devices"] == 2 and result["replicas"] == [1, 2]
    np.testing.assert_allclose(result["two"], result["one"], rtol=2e-4)


@pytest.mark.slow
def test_sigterm_then_the_same_command_continues_at_the_same_step_with_the_same_loss(prepared, tmp_path):
    """A SIGTERM mid-run saves and stops; running the same call again continues at that step, and the losses of
    the two calls together are the uninterrupted run's."""
    full = _config(prepared, str(tmp_path / "full"), 14)
    cut = _config(prepared, str(tmp_path / "cut"), 14)
    result, _ = run_on_jax(_script(
        "import signal, threading\n"
        f"full = pretrain({full!r}, progress=False)\n"
        "from kbert.train import faults\n"
        "calls = []\n"
        "def hook(batch):\n"
        "    calls.append(batch)\n"
        "    if len(calls) == 6:  # during the sixth step: a preemption notice\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "faults.set_memory_hook(hook)\n"
        f"part = pretrain({cut!r}, progress=False)\n"
        "faults.set_memory_hook(None)\n"
        f"rest = pretrain({cut!r}, progress=False)\n"
        "print(json.dumps(dict(full=full['history'], part=part['history'], rest=rest['history'],"
        " stopped=part['stopped_by'], step=part['step'], checkpoint=part['checkpoint'])))\n"))
    assert result["stopped"] == "SIGTERM" and result["step"] == 6
    assert result["checkpoint"].endswith("ckpt-6.safetensors")
    assert len(result["rest"]) == 8
    np.testing.assert_allclose(result["part"] + result["rest"], result["full"], rtol=1e-5)


@pytest.mark.slow
def test_a_jax_checkpoint_resumes_under_tensorflow_and_back(prepared, tmp_path):
    """Four steps on JAX, two on TensorFlow from its checkpoint, two more on JAX: the losses follow the
    all-JAX run (the two backends' float32 arithmetic differs in the last digits only)."""
    full = _config(prepared, str(tmp_path / "full"), 8, runtime={"strategy": "cpu"})
    mixed = _config(prepared, str(tmp_path / "mixed"), 8, runtime={"strategy": "cpu"})
    first, _ = run_on_jax(_script(
        f"a = pretrain({full!r}, progress=False)\nb = pretrain({mixed!r}, progress=False, stop_after=4)\n"
        "print(json.dumps(dict(full=a['history'], part=b['history'], step=b['step'])))\n"))
    assert first["step"] == 4
    middle = pretrain(mixed, progress=False, stop_after=2)  # this process: TensorFlow
    assert middle["backend"] == "tensorflow" and middle["step"] == 6
    last, _ = run_on_jax(_script(
        f"c = pretrain({mixed!r}, progress=False)\n"
        "print(json.dumps(dict(rest=c['history'], step=c['step'], finished=c['finished'])))\n"))
    assert last["finished"] and last["step"] == 8
    np.testing.assert_allclose(first["part"] + middle["history"] + last["rest"], first["full"], rtol=2e-3)


def test_jax_bad_input_fails_fast_with_the_reason(prepared, tmp_path):
    """Records of another vocabulary, random ids in a process without TensorFlow, runtime settings with no JAX
    equivalent and float16 on a CPU are refused before any training, each with the reason."""
    other = str(tmp_path / "other-tok")
    kbert.Tokenizer("wordpiece", ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list("가나다라마바사")).save(other)
    cases = {
        "vocabulary": _config(prepared, str(tmp_path / "a"), 2, data={"tokenizer": other}, model={"vocab_size": 1500}),
        "tpu_name": _config(prepared, str(tmp_path / "b"), 2, runtime={"tpu": "my-tpu"}),
        "jit_off": _config(prepared, str(tmp_path / "c"), 2, runtime={"jit": False}),
        "mirrored_without_gpus": _config(prepared, str(tmp_path / "d"), 2, runtime={"strategy": "mirrored"}),
        "float16_on_cpu": _config(prepared, str(tmp_path / "f"), 2, runtime={"precision": "mixed_float16"}),
        "dummy_without_tensorflow": _config(prepared, str(tmp_path / "e"), 2, data={"source": "dummy"}),
    }
    result, _ = run_on_jax(_script(
        "import builtins\n"
        "errors = {}\n"
        f"for name, cfg in {cases!r}.items():\n"
        "    if name == 'dummy_without_tensorflow':  # from here on, TensorFlow cannot be imported\n"
        "        real = builtins.__import__\n"
        "        def guard(n, *a, **k):\n"
        "            if n.split('.')[0] == 'tensorflow':\n"
        "                raise ImportError('No module named tensorflow')\n"
        "            return real(n, *a, **k)\n"
        "        builtins.__import__ = guard\n"
        "    try:\n"
        "        pretrain(cfg, progress=False)\n"
        "        errors[name] = None\n"
        "    except ValueError as e:\n"
        "        errors[name] = str(e)\n"
        "print(json.dumps(errors))\n"), timeout=300)
    assert "another tokenizer" in result["vocabulary"]
    assert "runtime.tpu" in result["tpu_name"] and "no JAX equivalent" in result["tpu_name"]
    assert "runtime.jit: false" in result["jit_off"]
    assert "mirrored needs GPUs" in result["mirrored_without_gpus"]
    assert "mixed_float16" in result["float16_on_cpu"] and "needs a GPU" in result["float16_on_cpu"]
    assert "'dummy'" in result["dummy_without_tensorflow"]
    assert "TensorFlow is not installed" in result["dummy_without_tensorflow"]
    assert not any(os.path.isdir(os.path.join(str(tmp_path), x, "checkpoints")) for x in "abcdef")


@pytest.mark.slow
def test_checkpoint_file_holds_the_whole_state_by_name(prepared, tmp_path):
    """The backend-neutral checkpoint: model variables by position with their paths, optimizer slots by name
    without gradient accumulators, the step in the metadata; an older TensorFlow-format dir is named."""
    from kbert.train.run_checkpoint import RunCheckpoints

    out = str(tmp_path / "run")
    pretrain(_config(prepared, out, 2, model={"dropout": 0.1}, trainer={"accumulation": 2}, runtime={"strategy": "cpu"}),
             progress=False)
    ckpt = RunCheckpoints(os.path.join(out, "checkpoints"))
    tensors, meta = ckpt.read(ckpt.latest)
    assert meta["step"] == 2 and len(meta["model_paths"]) == sum(k.startswith("model/") for k in tensors)
    assert any(p.endswith("seed_generator_state") for p in meta["model_paths"])  # dropout streams resume too
    slots = [k for k in tensors if k.startswith("optimizer/")]
    assert slots and not any("gradient_accumulator" in k for k in slots)
    old = tmp_path / "old" / "checkpoints"
    old.mkdir(parents=True)
    (old / "checkpoint").write_text('model_checkpoint_path: "ckpt-3"\n', encoding="utf-8")
    with pytest.raises(ValueError, match="TensorFlow-format checkpoints of an older kbert"):
        pretrain(_config(prepared, str(tmp_path / "old"), 2, runtime={"strategy": "cpu"}), progress=False)
    assert json.loads(open(os.path.join(out, "config.json"), encoding="utf-8").read())["data"]["max_length"] == 64  # the records'



@pytest.mark.slow
def test_pretraining_from_records_on_jax_never_imports_tensorflow(prepared, tmp_path):
    """What a GPU or TPU host with `pip install -e ".[jax]"` (no TensorFlow) runs: records in, a model dir and
    TensorBoard scalars out, with TensorFlow unimportable from the first line."""
    cfg = _config(prepared, str(tmp_path / "run"), 3, runtime={"strategy": "cpu"}, trainer={"log_every": 1})
    result, _ = run_on_jax(
        BLOCK_TENSORFLOW + "import kbert\n"
        f"s = kbert.pretrain({cfg!r}, progress=False)\n"
        "print(json.dumps(dict(step=s['step'], model=s['model_dir'], tf='tensorflow' in sys.modules)))\n")
    assert result == {"step": 3, "model": str(tmp_path / "run" / "model"), "tf": False}
    assert os.listdir(str(tmp_path / "run" / "logs"))
    assert kbert.load_model(result["model"]).config.num_layers == 2
    # `trainer.batch_size: auto` plans from the JAX device, not TensorFlow's view (it imported TensorFlow first)
    cfg = _config(prepared, str(tmp_path / "auto"), 1, runtime={"strategy": "cpu"},
                  trainer={"batch_size": "auto", "log_every": 1})
    result, _ = run_on_jax(
        BLOCK_TENSORFLOW + "import kbert\n"
        f"s = kbert.pretrain({cfg!r}, progress=False)\n"
        "print(json.dumps(dict(step=s['step'], batch=s['global_batch'], tf='tensorflow' in sys.modules)))\n")
    assert result == {"step": 1, "batch": 256, "tf": False}  # the tiny model fits the 256 cap in 8 GB


@pytest.mark.slow
def test_raw_text_pretraining_on_jax_without_tensorflow_goes_through_records_and_resumes(prepared, tmp_path):
    """`kbert pretrain --corpus text` on a JAX-only host: the text is tokenized into OUT/records (no
    TensorFlow: the records are framed by hand), the co-occurrence start runs on scipy, and a stopped run
    resumes on the records it started with instead of tokenizing again."""
    out = str(tmp_path / "run")
    cfg = _config(prepared, out, 4, data={"source": ["kolaw", "kobill"], "max_length": 64},
                  trainer={"log_every": 1, "embedding_init": "cooccurrence"}, runtime={"strategy": "cpu"})
    script = (BLOCK_TENSORFLOW + "import os\nimport kbert\n"
              "from kbert.data import records\n"
              f"first = kbert.pretrain({cfg!r}, progress=False, stop_after=2)\n"
              f"made = os.path.getmtime(os.path.join({out!r}, 'records', 'shard-00000.tfrecord'))\n"
              f"last = kbert.pretrain({cfg!r}, progress=False)\n"
              f"m = records.read_manifest(os.path.join({out!r}, 'records'))\n"
              "print(json.dumps(dict(steps=[first['step'], last['step']], finished=last['finished'],"
              f" same=made == os.path.getmtime(os.path.join({out!r}, 'records', 'shard-00000.tfrecord')),"
              " complete=m['complete'], resumed=m['resumed_shards'], shards=len(m['shards']),"
              " max_length=m['max_length'], loss=last['loss'], tf='tensorflow' in sys.modules)))\n")
    result, proc = run_on_jax(script)
    assert result["steps"] == [2, 4] and result["finished"] and not result["tf"]
    assert result["complete"] and result["resumed"] == result["shards"] > 0 and result["same"]
    assert result["max_length"] == 64 and np.isfinite(result["loss"])
    assert kbert.load_model(os.path.join(out, "model")).config.num_layers == 2
    # the records are ordinary `kbert data prepare` records: TensorFlow's pipeline reads them too
    tok = kbert.Tokenizer.load(prepared[0])
    features, _ = next(iter(kbert.data.pretraining_dataset(os.path.join(out, "records"), tok, batch_size=4)))
    assert features["token_ids"].shape == (4, 64)


def test_a_resumed_jax_run_reads_its_compiled_step_from_the_compilation_cache(prepared, tmp_path):
    """`runtime.compilation_cache`: the first run writes its compiled programs to the dir, and the same command
    resumed after a stop reads them back instead of compiling (JAX's cache hits), to the same loss; "none"
    leaves JAX's cache off, "auto" keeps a dir JAX was already given, and falls back to no cache (with a
    warning) where its default dir cannot be made."""
    cache = str(tmp_path / "cache")
    cfg = _config(prepared, str(tmp_path / "run"), 4, runtime={"strategy": "cpu", "compilation_cache": cache})
    full = _config(prepared, str(tmp_path / "full"), 4, runtime={"strategy": "cpu", "compilation_cache": "none"})
    result, _ = run_on_jax(_script(
        "import jax\n"
        "from kbert.train.backend.jax import use_compilation_cache\n"
        "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)  # this tiny model compiles fast\n"
        "events = []\n"
        "jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))\n"
        "def hits(): return events.count('/jax/compilation_cache/cache_hits')\n"
        f"base = pretrain({full!r}, progress=False)\n"
        "off = jax.config.jax_enable_compilation_cache\n"
        f"first = pretrain({cfg!r}, progress=False, stop_after=2)\n"
        f"written = len(os.listdir({cache!r}))\n"
        "before = hits()\n"
        f"rest = pretrain({cfg!r}, progress=False)\n"
        "auto = use_compilation_cache('auto')\n"
        "import warnings\n"
        "jax.config.update('jax_compilation_cache_dir', None)\n"
        f"os.environ['XDG_CACHE_HOME'] = os.path.join({cache!r}, os.listdir({cache!r})[0])  # a file: no dir there\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    unusable = use_compilation_cache('auto')\n"
        "try:\n"
        "    use_compilation_cache(os.path.join(os.environ['XDG_CACHE_HOME'], 'x'))\n"
        "    named = None\n"
        "except ValueError as e:\n"
        "    named = str(e)\n"
        "print(json.dumps(dict(off=off, written=written, hits=hits() - before, auto=auto, unusable=unusable,"
        " warned=[str(w.message) for w in caught], named=named,"
        " losses=[base['history'], first['history'] + rest['history']], steps=[first['step'], rest['step']])))\n"))
    assert result["off"] is False  # "none": off, even with a dir in JAX_COMPILATION_CACHE_DIR (conftest)
    assert result["written"] > 0 and result["hits"] > 0, result
    assert result["auto"] == cache  # "auto" keeps the dir JAX already has
    # where its default dir cannot be made, "auto" runs without a cache and says so; a named dir is an error
    assert result["unusable"] is None and any("could not use" in w for w in result["warned"]), result
    assert result["named"] and "cannot use" in result["named"], result
    assert result["steps"] == [2, 4]
    np.testing.assert_allclose(result["losses"][1], result["losses"][0], rtol=1e-5)


@pytest.mark.slow
def test_the_gpu_pretrain_script_runs_on_cpu(tmp_path):
    """`benchmarks/gpu.py records` (here, with TensorFlow) then `gpu.py pretrain` (JAX, what a GPU host runs):
    the run resumes in the middle exactly and reports records vs synthetic-batch tokens/s."""
    import subprocess
    import sys

    from helpers import SHARED

    if not os.path.isdir(SHARED):
        pytest.skip(f"the shared Korean data is not at {SHARED}")
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu.py")
    made = subprocess.run([sys.executable, script, "records", "--shared", SHARED, "--out", str(tmp_path / "gpu"),
                           "--rows", "3000", "--vocab", "2500", "--json"], capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr[-2000:]
    assert json.loads(made.stdout.strip().splitlines()[-1])["examples"] > 100
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, script, "pretrain", "--records", str(tmp_path / "gpu"), "--model", "bert-tiny",
                          "--batch", "8", "--steps-pretrain", "8", "--precision", "float32", "--out", str(tmp_path / "run"),
                          "--json"], capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["backend"] == "jax" and result["steps"] == 8
    assert result["resume_abs_diff"] == 0.0  # CPU arithmetic is deterministic: the resumed step is the same step
    assert result["records_tokens_per_s"] > 0 and result["synthetic_tokens_per_s"] > 0



@pytest.mark.slow
def test_the_whole_gpu_script_runs_on_cpu(tmp_path):
    """`bash benchmarks/device.sh run`, the one command a device lease runs (`gpu.py all` with the next run's
    arguments), end to end on CPU JAX with bert-tiny: every stage gives its rows and the tables print, and the
    next run's model variants parse and run (the two that need cuDNN keep their rows with the reason), so a
    lease is not spent finding a broken stage. (The figures are the CPU's; the GPU's are in
    benchmarks/README.md.)"""
    import subprocess
    import sys

    from kbert.train.memory import parse_memory

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "device.sh")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHON=sys.executable, OUT=str(tmp_path))
    refused = subprocess.run(["bash", script, "run"], capture_output=True, text=True, timeout=300, env=env)
    assert refused.returncode != 0 and "sees no accelerator" in refused.stderr, refused.stderr[-2000:]
    # the device's arguments with a tiny model and the CPU's shapes (--variants and --xla-variants stay the
    # device run's; a budget for a loaded 2-core CPU)
    run = subprocess.run(["bash", script, "run", "--model", "bert-tiny", "--batch", "8", "--steps", "2",
                          "--vocab", "1000", "--peak-n", "512", "--cap", "1GB", "--cap-seqs", "64",
                          "--hf-modes", "eager", "--lora-points", "bert-tiny:1000:8", "--budget", "900"],
                         capture_output=True, text=True, timeout=1200, env=dict(env, KBERT_DEVICE_ALLOW_CPU="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    with open(tmp_path / "gpu.json", encoding="utf-8") as f:
        out = json.load(f)
    assert out["peak"]["bfloat16"] > 0 and out["peak"]["float32"] > 0
    rows = {tuple(r["overrides"]): r for r in out["throughput"] if "overrides" in r}
    assert set(rows) == {(), ("attention_kernel=cudnn_dropout",),
                         ("dropout=0.0", "attention_dropout=0.0", "attention_mask=lengths")}
    kbert_row = rows[()]
    assert kbert_row["impl"] == "kbert" and kbert_row["tokens_per_s"] > 0 and kbert_row["model_flops_per_s"] > 0
    assert kbert_row["step_bytes"] > 0  # XLA's analysis of the step, the memory column of the speed table
    # the ablations: each code-path switch beside the default step of the same process
    ablations = {tuple(r["overrides"]): r for r in out["ablations"] if "overrides" in r}
    assert set(ablations) == {(), ("dropout_masks=hash2",), ("layer_norm=two_pass_stats",), ("qkv=sliced",),
                              ("attention_kernel=cudnn_dropout", "qkv=sliced"), ("layer_norm=keras",)}
    for overrides in [(), ("dropout_masks=hash2",), ("layer_norm=two_pass_stats",), ("qkv=sliced",),
                      ("layer_norm=keras",)]:
        assert ablations[overrides]["tokens_per_s"] > 0, ablations[overrides]
    assert "cuDNN" in ablations["attention_kernel=cudnn_dropout", "qkv=sliced"]["error"]
    assert "kbert's code paths, each beside the default step" in run.stdout
    cudnn_only = [("attention_kernel=cudnn_dropout",),
                  ("dropout=0.0", "attention_dropout=0.0", "attention_mask=lengths")]
    for overrides in cudnn_only:
        assert "cuDNN" in rows[overrides]["error"]  # a CPU has none; the row stays and says so
    (check,) = [r["dropout_check"] for r in out["throughput"] if "dropout_check" in r]
    assert "cuDNN" in check["error"]
    assert [r["impl"] for r in out["hf"]] == ["hf-eager", "hf-compile"] and out["hf"][0]["tokens_per_s"] > 0
    assert out["hf"][0]["step_bytes"] is None  # torch reports an allocator peak on CUDA only
    assert len(out["memory"]) == 4
    for r in out["memory"]:
        assert r["compiled_bytes"] > 0 and r["planned_bytes"] > 0, r
    assert out["aot"] is None  # no GPU description matches a CPU: the deviceless check is left out
    ((capped,),) = out["capped"]  # one sequence length, one row
    cap = parse_memory("1GB")
    # `--exact` answers the largest batch whose compiled step fits the cap: it fits, and one more does not
    assert capped["seq_len"] == 64 and 0 < capped["exact_bytes"] <= cap
    tried = dict((b, n) for b, n in capped["exact_tried"])
    assert tried[capped["exact_batch"]] <= cap < tried[capped["exact_batch"] + 1]
    assert out["profile"]["kinds"] and out["profile"]["step_ms"] > 0
    full, lora = out["lora"]
    assert lora["lora_rank"] == 8 and 0 < lora["trained"] < full["trained"]
    for table in ("| implementation |", "| model | seq | batch | precision | planned GB", "`--exact` batch",
                  "where the step's device time goes", "LoRA r=8 against full fine-tuning"):
        assert table in run.stdout, (table, run.stdout[-3000:])
    with open(tmp_path / "gpu.log", encoding="utf-8") as f:  # the whole output comes back as a file too
        assert "| implementation |" in f.read()


@pytest.mark.slow
def test_every_objective_lamb_accumulation_and_the_out_of_memory_fallback_run_on_jax(prepared, tmp_path):
    """What the TensorFlow path offers runs on JAX too: mlm, mlm+sop and ELECTRA (raw text through tf.data),
    LAMB with gradient accumulation, and the out-of-memory fallback (halve the micro-batch, double
    accumulation, resume from the last checkpoint)."""
    tok_dir, _ = prepared
    raw = {"source": ["kolaw", "kobill"], "max_length": 64, "workers": 0}
    runs = {
        "mlm": _config(prepared, str(tmp_path / "mlm"), 3, data=dict(raw, objective="mlm")),
        "sop": _config(prepared, str(tmp_path / "sop"), 3, data=dict(raw, objective="mlm+sop"),
                       model={"architecture": "albert", "embedding_size": 32}),
        "electra": _config(prepared, str(tmp_path / "electra"), 3, data=dict(raw, objective="electra"),
                           model={"dropout": 0.1}),
        "lamb": _config(prepared, str(tmp_path / "lamb"), 3, optimizer={"name": "lamb"}, trainer={"accumulation": 2}),
        "oom": _config(prepared, str(tmp_path / "oom"), 4, trainer={"checkpoint_every": 2},
                       runtime={"strategy": "cpu"}),
    }
    result, _ = run_on_jax(_script(
        "from kbert.train import faults\n"
        "out = {}\n"
        f"for name, cfg in {runs!r}.items():\n"
        "    if name == 'oom':  # this 'device' holds 8 sequences from the third step on\n"
        "        calls = []\n"
        "        def hook(batch):\n"
        "            calls.append(batch)\n"
        "            if len(calls) >= 3 and batch > 8:\n"
        "                raise faults.out_of_memory_error(f'simulated: {batch} > 8')\n"
        "        faults.set_memory_hook(hook)\n"
        "    s = pretrain(cfg, progress=False)\n"
        "    out[name] = dict(step=s['step'], loss=s['loss'], rtd=s.get('rtd_accuracy'), acc=s['accumulation'],"
        " retries=s.get('oom_retries', 0), finite=bool(np.isfinite(s['history']).all()))\n"
        "print(json.dumps(out))\n"))
    for name, r in result.items():
        assert r["step"] == (4 if name == "oom" else 3) and r["finite"], (name, r)
    assert result["electra"]["rtd"] is not None and result["lamb"]["acc"] == 2
    assert result["oom"]["retries"] == 1 and result["oom"]["acc"] == 2  # 16 = 8 x 2 after the fallback


def with_gpu_script(body: str) -> str:
    """A script for a fresh Python (`run_on_jax`) that loads benchmarks/gpu.py as `gpu`, then runs `body`."""
    here = os.path.dirname(os.path.abspath(__file__))
    return (f"import json, sys\nsys.path.insert(0, {here!r})\n"
            "from test_train_jax import gpu_script\ngpu = gpu_script()\n" + body)


def gpu_script():
    """benchmarks/gpu.py as a module (it is a script, not part of the package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu.py")
    spec = importlib.util.spec_from_file_location("gpu_benchmark", path)
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    return gpu


def test_the_gpu_memory_stage_suggests_the_coefficient_that_keeps_every_point_fitting(monkeypatch, capsys):
    """After a program change (kbert's LayerNorm, the last block at the predicted rows) the device run's memory
    points say which bytes-per-activation value would put the planner back just above each compiled step."""
    import dataclasses

    from kbert.models.config import ModelConfig
    from kbert.train import memory

    gpu = gpu_script()
    cfg = ModelConfig.preset("bert-base", vocab_size=32000)

    def point(precision, seq, batch, share):  # a compiled step needing `share` of the planned activations
        est = memory.estimate_memory(cfg, batch, seq, optimizer="adamw", precision=precision)
        fixed = est["weights_grads_slots"] + est["workspace"]
        return {"precision": precision, "seq": seq, "batch": batch, "planned_bytes": est["total"],
                "compiled_bytes": fixed + share * (est["total"] - fixed),
                "components": {k: v for k, v in est.items() if k != "total"}}

    rows = [point("mixed_bfloat16", 128, 256, 0.80), point("mixed_bfloat16", 512, 64, 0.90),
            point("float32", 128, 256, 1.0)]
    suggested = gpu.suggest_act_bytes(rows)
    assert suggested == {"mixed_bfloat16": (2.25, 2.05), "float32": (4.25, 4.25)}  # 2.25 x 0.9, rounded up
    xla = dataclasses.replace(memory.COMPILERS["xla"], mixed_act_bytes=2.05)
    monkeypatch.setitem(memory.COMPILERS, "xla", xla)
    planned = [memory.estimate_memory(cfg, r["batch"], r["seq"], optimizer="adamw", precision=r["precision"])["total"]
               for r in rows[:2]]
    assert all(r["compiled_bytes"] <= p for r, p in zip(rows, planned))  # never under
    assert planned[1] <= 1.02 * rows[1]["compiled_bytes"]  # and just above the point that asked the most
    monkeypatch.undo()
    # the report checks that refit on the capped probes of the same run (other shapes than the memory points)
    capped = {"model": "bert-base", "precision": "mixed_bfloat16", "cap": "12GB", "seq_len": 128, "vocab": 32000,
              "plan_for_cap": 182, "exact_batch": 200, "probed_batch": 200, "exact_tried": [[182, 1], [200, 1]],
              "tried": [[200, True, 1], [201, False, None]], "seconds": 70.0}
    refit = gpu.refit_plan(capped, 2.05)
    with monkeypatch.context() as m:
        m.setitem(memory.COMPILERS, "xla", xla)
        assert refit == memory.max_batch_size(cfg, "12GB", 128, optimizer="adamw", precision="mixed_bfloat16") > 182
    gpu.report({"memory": [dict(r, model="bert-base", measured_bytes=r["compiled_bytes"], error=0.0,
                                error_vs_compiled=0.0) for r in rows], "capped": [[capped]]})
    table = capsys.readouterr().out
    assert "that put the planner at or just above every compiled point here: 2.05" in table
    assert f"| 182 | 200 | 200 | 0.91 | {refit} ({refit / 200:.2f}) |" in table
    assert "xla-refit" not in memory.COMPILERS


def test_the_gpu_report_sets_each_steps_memory_beside_its_speed(capsys):
    """The throughput table gives kbert's and HF's memory at the same shape (kbert: XLA's program of the
    variant's step; HF: torch's allocator peak of that mode), and says n/a where a host reports none (torch on
    a CPU), so someone choosing between the two sees what fits as well as what runs faster."""
    gpu = gpu_script()
    common = {"model": "bert-base", "seq": 128, "batch": 256, "steps": 20, "model_flops_per_s": 3.4e14}
    gpu.report({"peak": {"bfloat16": 7.9e14, "float32": 4.0e14},
                "throughput": [dict(common, impl="kbert", overrides=[], step_ms=54.0, tokens_per_s=606_000,
                                    step_bytes=15_980_000_000, fused_attention=False),
                               {"impl": "kbert", "overrides": ["attention_kernel=cudnn_dropout"],
                                "error": "RuntimeError: cuDNN is not detected."}],
                "hf": [dict(common, impl="hf-compile", overrides=[], step_ms=61.0, tokens_per_s=537_000,
                            step_bytes=21_470_000_000),
                       dict(common, impl="hf-eager", overrides=[], step_ms=79.5, tokens_per_s=412_000,
                            step_bytes=None)]})
    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if line.startswith("| implementation |"))
    assert "| memory GB |" in header
    width = header.count("|")
    rows = {line.split("|")[1].strip() + line.split("|")[2].strip(): line for line in table.splitlines()
            if line.startswith("| kbert |") or line.startswith("| hf-")}
    assert all(line.count("|") == width for line in rows.values())  # the failed variant's row lines up too
    assert "| 1.13x | 15.98 |" in rows["kbertBERT defaults"]
    assert "| 1.00x | 21.47 |" in rows["hf-compileBERT defaults"]
    assert "| n/a |" in rows["hf-eagerBERT defaults"]
    assert "did not run: RuntimeError: cuDNN" in rows["kbertattention_kernel=cudnn_dropout"]


def test_the_gpu_profile_counts_the_device_streams_once_and_sorts_kernels_by_kind(tmp_path):
    """`benchmarks/gpu.py profile` reads jax.profiler's perfetto trace: on a GPU only the stream lines count
    (the "XLA Ops" line restates the same time by HLO op) and kernel names map to kinds."""
    import gzip

    gpu = gpu_script()
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #13(Compute)"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 9, "args": {"name": "python"}}]
    spans = [("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNN", 7, 30.0), ("loop_add_fusion_3", 7, 5.0),
             ("input_reduce_fusion_12", 7, 4.0), ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 7, 6.0),
             ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNN", 7, 10.0), ("fusion.123", 8, 55.0),
             ("PjitFunction(step)", 9, 80.0)]
    events = meta + [{"ph": "X", "name": n, "pid": 1 if tid != 9 else 2, "tid": tid, "ts": i, "dur": d}
                     for i, (n, tid, d) in enumerate(spans)]
    os.makedirs(tmp_path / "plugins" / "profile" / "run")
    with gzip.open(tmp_path / "plugins" / "profile" / "run" / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    found = gpu.device_time_by_kernel(str(tmp_path))
    assert found["source"] == "device streams" and found["total_us"] == 55.0
    assert found["kernels"]["nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNN"] == 40.0
    kinds = {name: gpu.kernel_kind(name) for name in found["kernels"]}
    assert sorted(kinds.values()) == ["attention (fused)", "elementwise fusion", "matmul", "reduction fusion"]
    assert gpu.kernel_kind("ynn_fusion.105") == "XNNPACK fusion (CPU)"  # not "elementwise" for its "fusion"


def _stand_in_dropout_attention(frozen=False, backward_mask=None):
    """Attention with dropout in plain JAX, as `gpu.dropout_check` calls a kernel: each call site its own
    random stream and each `step` a new mask (what XLA's cuDNN runtime does with its seeds and offsets), or with
    `frozen` the same mask everywhere, or with `backward_mask` a backward pass that draws its own mask."""
    import itertools

    import jax
    import jax.numpy as jnp

    sites = itertools.count()

    def attend(q, k, v, scale, rate, key):
        probs = jax.nn.softmax(jnp.einsum("bind,bjnd->bnij", q.astype("float32"), k.astype("float32")) * scale, -1)
        kept = jnp.where(jax.random.bernoulli(key, 1 - rate, probs.shape), probs / (1 - rate), 0.0)
        return jnp.einsum("bnij,bjnd->bind", kept, v.astype("float32")).astype(q.dtype)

    def kernel(q, k, v, mask, scale, dropout, step):
        site = next(sites)  # at trace time, once per call site
        key = jax.random.PRNGKey(0) if frozen else jax.random.fold_in(jax.random.PRNGKey(site), step)
        if backward_mask is None:
            return attend(q, k, v, scale, dropout, key)

        @jax.custom_vjp
        def linear_in_v(v):
            return attend(q, k, v, scale, dropout, key)

        def backward(v, g):
            return jax.vjp(lambda v: attend(q, k, v, scale, dropout, jax.random.fold_in(key, 7)), v)[1](g)

        linear_in_v.defvjp(lambda v: (linear_in_v(v), v), backward)
        return linear_in_v(v)

    return kernel


def test_the_gpu_dropout_check_tells_dropout_from_a_frozen_or_mismatched_mask():
    """`gpu.py dropout-check` decides whether cuDNN's own attention dropout (`attention_kernel=cudnn_dropout`)
    is dropout before its step time is reported. On stand-ins in plain JAX (no cuDNN here): a right kernel
    passes; one that drops the same entries at every step and call site fails, and so does one whose backward
    pass draws another mask than its forward pass."""
    gpu = gpu_script()
    shape = dict(batch=2, seq=32, heads=2, rate=0.1)
    right = gpu.dropout_check(**shape, kernel=_stand_in_dropout_attention())
    assert right["ok"], right
    assert right["kept_max_rel_error"] < 0.01 and abs(right["dropped_share"] - 0.1) < 0.01
    assert right["backward_rel_error"] < 0.01 < 0.1 < right["backward_rel_error_without_dropout"]
    assert 0.12 < right["differs_between_steps"] < 0.24 and 0.12 < right["differs_between_call_sites"] < 0.24
    frozen = gpu.dropout_check(**shape, kernel=_stand_in_dropout_attention(frozen=True))
    assert not frozen["ok"] and frozen["differs_between_steps"] == frozen["differs_between_call_sites"] == 0.0
    assert frozen["backward_rel_error"] < 0.01  # each fault is named by its own figure
    mismatched = gpu.dropout_check(**shape, kernel=_stand_in_dropout_attention(backward_mask="another"))
    assert not mismatched["ok"] and mismatched["backward_rel_error"] > 0.1, mismatched
    assert abs(mismatched["dropped_share"] - 0.1) < 0.01
    # the kernel switch of `--variants`: one attention kernel at a time, and a name it does not know is named
    assert gpu._implementation_choices(["attention_kernel=cudnn_dropout", "dropout=0.0"]) == {
        "attention_kernel": "cudnn_dropout"}
    with pytest.raises(ValueError, match="attention_kernel=flash: choose from"):
        gpu._switch_implementation(["attention_kernel=flash"])
    with pytest.raises(ValueError, match="one attention kernel at a time"):
        gpu._switch_implementation(["attention_kernel=cudnn_dropout", "attention_mask=lengths"])


def test_the_gpu_attention_kernels_lower_for_cuda_on_this_cpu():
    """Before device time: the training step with each of gpu.py's cuDNN kernels, lowered for CUDA here
    (traced, not compiled), calls cuDNN's attention in every layer, forward and backward, with no attention
    softmax left outside it. The cuDNN dropout kernel gives each layer its own seed, the same for a layer's
    forward and backward, at BERT's rate; the lengths kernel has no dropout. kbert's own fused path (Keras'
    `ops.dot_product_attention`, attention dropout 0) reaches cuDNN in every layer too: the Pretrainer's last
    block has 21 queries at seq 128, an odd count cuDNN's training kernel refuses (Keras then logs an error and
    runs XLA's attention), so kbert pads it to 22."""
    here = os.path.dirname(os.path.abspath(__file__))
    script = with_gpu_script(
        "rows = {v: gpu.cuda_attention_calls('bert-tiny', 128, 4, 1000, overrides=v.split(',') if v else [])\n"
        "        for v in ('attention_kernel=cudnn_dropout',"
        " 'dropout=0.0,attention_dropout=0.0,attention_mask=lengths', 'attention_dropout=0.0', '')}\n"
        "broadcast = gpu.cuda_attention_calls('bert-tiny', 128, 4, 1000,"
        " ['attention_dropout=0.0', 'attention_mask=broadcast'])\n"
        "print(json.dumps(dict(rows=rows, broadcast=broadcast)))\n")
    found, _ = run_on_jax(script, env={"PYTHONPATH": os.path.dirname(here)})
    rows, broadcast = found["rows"], found["broadcast"]
    assert all(row["fallbacks"] == [] for row in rows.values()), rows
    # the fallback is seen where it happens: a [b, 1, 1, s] mask, which JAX's cuDNN path refuses
    assert broadcast["calls"] == [] and "Bias must have same seq length" in broadcast["fallbacks"][0], broadcast
    explicit = rows[""]
    assert explicit["calls"] == [] and explicit["layers"] == 2
    dropping = rows["attention_kernel=cudnn_dropout"]["calls"]
    forward = [c for c in dropping if c["kind"] == "fmhaSoftmaxDropout"]
    backward = [c for c in dropping if c["kind"] == "fmhaSoftmaxDropoutBackward"]
    assert len(forward) == len(backward) == 2 and len(dropping) == 4, dropping
    assert len({c["seed"] for c in forward}) == 2 and {c["seed"] for c in forward} == {c["seed"] for c in backward}
    assert {(c["dropout_rate"], c["mask_type"]) for c in dropping} == {(0.1, "PADDING")}
    lengths = rows["dropout=0.0,attention_dropout=0.0,attention_mask=lengths"]["calls"]
    assert sorted(c["kind"] for c in lengths) == ["fmhaSoftmax"] * 2 + ["fmhaSoftmaxBackward"] * 2, lengths
    assert {c["dropout_rate"] for c in lengths} == {0.0}
    keras_path = rows["attention_dropout=0.0"]["calls"]
    assert sorted(c["kind"] for c in keras_path) == ["fmhaScaleBiasSoftmax"] * 2 + ["fmhaScaleBiasSoftmaxBackward"] * 2
    for fused in ("attention_kernel=cudnn_dropout", "dropout=0.0,attention_dropout=0.0,attention_mask=lengths",
                  "attention_dropout=0.0"):
        # each layer's attention softmax (an exp over its keys) is inside cuDNN's kernel now
        assert explicit["softmax_outside"] - rows[fused]["softmax_outside"] == 2, rows


def test_the_gpu_aot_memory_stage_compiles_for_a_device_that_is_not_here(capsys):
    """`gpu.py aot-memory`: the step compiled for another device than this host's (`CompiledStep.lower(...,
    device=)`; on a host with JAX's CUDA plugin, a GPU from XLA's description of it) and its memory analysis
    beside the planner. Here the stand-in device is this CPU, so the bytes must be `CompiledStep.bytes`'; the
    GPU descriptions are XLA text protos, and a host without the plugin is told what to install."""
    here = os.path.dirname(os.path.abspath(__file__))
    script = with_gpu_script(
        "import jax\nfrom jax.experimental import topologies\n"
        "from kbert.train.probe import CompiledStep, build_trainer\n"
        "config = gpu._config('bert-tiny', 1000)\n"
        "step = CompiledStep(build_trainer(config, 'adamw', 'mixed_bfloat16', abstract=True), config, 64)\n"
        "local = {b: step.bytes(b) for b in (4, 16)}\n"
        "real = gpu.target_device\n"
        "gpu.target_device = lambda name: jax.devices('cpu')[0]\n"
        "rows = gpu.aot_memory('bert-tiny', [('mixed_bfloat16', 64, 4), ('mixed_bfloat16', 64, 16)], ['h100'], 1000)\n"
        "gpu.report_aot(rows)\n"
        "def absent(*a, **k):\n    raise NotImplementedError('topology not implemented for cuda')\n"
        "topologies.get_topology_desc = absent\n"
        "try:\n    real('h200')\n    error = None\nexcept RuntimeError as e:\n    error = str(e)\n"
        "def no_libtpu(*a, **k):\n"
        "    raise RuntimeError('JAX TPU support not installed; cannot generate TPU topology')\n"
        "topologies.get_topology_desc = no_libtpu\n"
        "try:\n    real('tpu-v5e')\n    tpu_error = None\nexcept RuntimeError as e:\n    tpu_error = str(e)\n"
        "measured = CompiledStep.bytes_for\n"
        "def tpu_bytes(self, batch, device):\n"
        "    if batch > 8:  # libtpu's words when a step does not fit a chip's HBM\n"
        "        raise RuntimeError('RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in '\n"
        "                           'memory space hbm. Used 17.33G of 15.75G hbm.')\n"
        "    return measured(self, batch, device)\n"
        "CompiledStep.bytes_for = tpu_bytes\n"
        "tpu_rows = gpu.aot_memory('bert-tiny', [('mixed_bfloat16', 64, 4), ('mixed_bfloat16', 64, 16)],\n"
        "                          ['tpu-v5e'], 1000)\n"
        "gpu.report_aot(tpu_rows)\n"
        "print(json.dumps(dict(local=local, rows=rows, error=error, h200=gpu.gpu_target_config('h200'), "
        "tpu_error=tpu_error, tpu_rows=tpu_rows)))\n")
    found, proc = run_on_jax(script, env={"PYTHONPATH": os.path.dirname(here)})
    rows, out = found["rows"], proc.stdout
    assert [r["compiled_bytes"] for r in rows] == [found["local"]["4"], found["local"]["16"]]
    assert rows[0]["compiled_bytes"] < rows[1]["compiled_bytes"] and all(r["target"] == "h100" for r in rows)
    assert all(r["planned_bytes"] > 0 and "weights_grads_slots" in r["components"] for r in rows)
    assert "h100" in out and "suggest_act_bytes mixed_bfloat16: 2.25 now;" in out
    assert "pip install 'jax[cuda12]'" in found["error"] and "topology not implemented" in found["error"]
    assert "needs libtpu (pip install 'jax[tpu]'" in found["tpu_error"] and "not installed" in found["tpu_error"]
    # a TPU chip is planned with the TPU's coefficients; a step too large for it keeps its row, with the reason
    fits, too_large = found["tpu_rows"]
    assert fits["compiler"] == too_large["compiler"] == "xla-tpu" and rows[0]["compiler"] == "xla"
    assert fits["compiled_bytes"] == found["local"]["4"] and "error" not in fits
    assert too_large["compiled_bytes"] is None and too_large["planned_bytes"] > fits["planned_bytes"]
    assert too_large["error"].startswith("does not fit the device's memory: RESOURCE_EXHAUSTED")
    assert "tpu-v5e" in out and "Ran out of memory in memory space hbm" in out
    assert "suggest_act_bytes mixed_bfloat16 (xla-tpu set):" in out
    h200 = found["h200"]
    assert 'device_description_str: "NVIDIA H200"' in h200 and "memory_bandwidth: 4800000000000" in h200
    assert h200.count("{") == h200.count("}") == 4  # gpu_device_info, its capability, cuDNN's and CUDA's versions
    gpu = gpu_script()
    with pytest.raises(ValueError, match="known targets are h100, h200, a100, l4, rtx3060"):
        gpu.gpu_target_config("v100")
    # an Ampere 12 GB card is described as itself: its compute capability and shared memory choose XLA's kernels
    rtx = gpu.gpu_target_config("rtx3060")
    assert "cuda_compute_capability { major: 8 minor: 6 }" in rtx and "shared_memory_per_core: 102400" in rtx
    assert "device_memory_size: 12884901888" in rtx and rtx.count("{") == rtx.count("}") == 4
    # in `gpu.py all` the device's own description is compiled too, and set beside the device's bytes
    memory_rows = [{"precision": "mixed_bfloat16", "seq": 128, "batch": 256, "compiled_bytes": 15.98e9,
                    "device": "NVIDIA H200"}, {"precision": "float32", "seq": 128, "batch": 256, "error": "exit 1"}]
    assert gpu.target_of(memory_rows) == "h200" and gpu.target_of([{"device": "cpu"}]) is None
    gpu.report_aot_check(memory_rows, [dict(memory_rows[0], target="h200", compiled_bytes=16.04e9),
                                       {"target": "h200", "precision": "float32", "seq": 128, "batch": 256,
                                        "compiled_bytes": 26.1e9}])
    table = capsys.readouterr().out
    assert "| mixed_bfloat16 | 128 | 256 | 16.04 | 15.98 | 1.004 |" in table and "float32" not in table


# XLA's optimized program of a GPU step, cut down to one kernel of each kind (a backslash at a line end continues
# the line: one instruction per line, as XLA prints them)
GPU_HLO = """HloModule jit_train_step

%gemm_fusion_dot.1_computation (p0: bf16[8,16], p1: bf16[16,4]) -> bf16[8,4] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[16,4]{1,0} parameter(1)
  ROOT %dot.0 = bf16[8,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_select (p0: bf16[8,4]) -> (bf16[8,4], pred[8,4]) {
  %p0 = bf16[8,4]{1,0} parameter(0)
}

ENTRY %main (x: bf16[8,16], w: bf16[16,4], q: bf16[2,4,1,8]) -> bf16[8,4] {
  %x = bf16[8,16]{1,0} parameter(0), metadata={op_name="x"}
  %w = bf16[16,4]{1,0} parameter(1)
  %q = bf16[2,4,1,8]{3,2,1,0} parameter(2)
  %gemm_fusion_dot.1 = bf16[8,4]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_fusion_dot.1_computation, \
metadata={op_name="jit(train_step)/jvp(layer_3)/qkv/dot_general"}, \
backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %fmha = (bf16[2,4,1,8]{3,2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", \
metadata={op_name="jit(train_step)/jvp(layer_3)/dot_product_attention"}
  %loop_select_fusion = (bf16[8,4]{1,0}, pred[8,4]{1,0}) fusion(%gemm_fusion_dot.1), kind=kLoop, calls=%fused_select, \
metadata={op_name="jit(train_step)/jvp(layer_3)/dropout_22/jit(_where)/select_n"}
  %loop_select_fusion.1 = (bf16[8,4]{1,0}, pred[8,4]{1,0}) fusion(%gemm_fusion_dot.1), kind=kLoop, \
calls=%fused_select, metadata={op_name="jit(train_step)/jvp(layer_11)/dropout_2/jit(_where)/select_n"}
  %copy.1 = bf16[16,4]{0,1} copy(%w)
  ROOT %get-tuple-element.1 = bf16[8,4]{1,0} get-tuple-element(%loop_select_fusion), index=0
}
"""


def test_hlo_traffic_reads_what_each_kernel_of_a_compiled_step_moves():
    """`gpu.py aot-traffic`'s reading of XLA's optimized program (`hlo_traffic`): each kernel's operand and
    result bytes, by kind (a Triton GEMM fusion or a fused dot is a matmul, cuDNN's fmha call an attention
    kernel, the rest memory-bound) and, for the memory-bound ones, by model op with layer numbers and Keras'
    suffixes folded; on a GPU program's form written out here, and on the CPU's compiled step of bert-tiny."""
    gpu = gpu_script()
    t = gpu.hlo_traffic(GPU_HLO)
    assert t["kernels"] == {"matmul": 1, "attention kernel": 1, "memory-bound": 3}
    assert t["bytes"]["matmul"] == 2 * (8 * 16 + 16 * 4 + 8 * 4)
    assert t["bytes"]["attention kernel"] == 4 * 2 * 2 * 4 * 8  # three operands and one result
    select = 2 * 8 * 4 + (2 + 1) * 8 * 4  # reads the gemm's result, writes bf16 and a pred mask
    assert t["bytes"]["memory-bound"] == 2 * select + 2 * 2 * 16 * 4
    assert t["memory_bound_by_op"][0] == {"op": "jvp(layer_N)/dropout/jit(_where)/select_n", "kernels": 2,
                                          "bytes": 2 * select}
    assert t["memory_bound_by_op"][1]["op"] == "(no op_name)"
    with pytest.raises(ValueError, match="no ENTRY computation"):
        gpu.hlo_traffic("HloModule m")
    here = os.path.dirname(os.path.abspath(__file__))
    found, _ = run_on_jax(with_gpu_script(
        "from kbert.train.probe import CompiledStep, build_trainer\n"
        "config = gpu._config('bert-tiny', 1000)\n"
        "step = CompiledStep(build_trainer(config, 'adamw', 'mixed_bfloat16', abstract=True), config, 64)\n"
        "print(json.dumps(gpu.hlo_traffic(step.lower(8).compile().as_text(), top=100)))\n"),
        env={"PYTHONPATH": os.path.dirname(here)})
    assert found["kernels"]["matmul"] >= 2 * 6 and found["bytes"]["memory-bound"] > 0  # 2 layers' projections
    ops = {g["op"] for g in found["memory_bound_by_op"]}
    assert any(op.startswith("jvp(layer_N)/") for op in ops) and any("adam_w" in op for op in ops)
    assert sum(g["bytes"] for g in found["memory_bound_by_op"]) <= found["bytes"]["memory-bound"]


def test_a_gpu_stage_stopped_at_the_budget_keeps_the_rows_it_finished(monkeypatch, capsys):
    """`gpu.py all` stops a stage's process when the budget ends; a throughput process prints its rows after each
    variant, so the ablations finished by then are kept (with a row saying where the budget ended), and a
    stage that printed nothing is one error row, as before. The ablations table sets each beside the default."""
    import subprocess
    import types

    gpu = gpu_script()
    done = [{"impl": "kbert", "overrides": [], "tokens_per_s": 100.0, "step_ms": 10.0, "model_flops_per_s": 1e9,
             "model": "bert-base", "seq": 128, "batch": 8},
            {"impl": "kbert", "overrides": ["dropout_masks=hash2"], "tokens_per_s": 90.0, "step_ms": 11.1,
             "model_flops_per_s": 9e8, "model": "bert-base", "seq": 128, "batch": 8}]
    printed = json.dumps(done[:1]) + "\n" + json.dumps(done) + "\n"

    def stopped(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"], output=printed.encode(), stderr=b"")

    monkeypatch.setattr(subprocess, "run", stopped)
    args = types.SimpleNamespace(vocab=32000, child_timeout=300)
    rows = gpu._child(args, ["throughput", "--variants", "default;dropout_masks=hash2;qkv=sliced"], gpu._Clock(100))
    assert rows[:2] == done and rows[2]["error"].startswith("timeout")
    printed = "no rows yet\n"
    assert gpu._child(args, ["memory"], gpu._Clock(100))["error"] == "timeout"
    capsys.readouterr()
    gpu.report_ablations(rows, {}, 2e9)
    table = capsys.readouterr().out
    assert "| dropout_masks=hash2 | 11.1 | 90 | 45.0% | 0.900 | n/a |" in table
    assert "did not run: timeout: the budget ended here" in table


def test_the_gpu_memory_points_run_as_many_at_once_as_the_device_holds():
    """`gpu.py all`'s memory stage: points in rounds of concurrent processes whose planned peaks fit the device
    with room to spare (one round of four on a 141 GB H200, which saves a round of compilations inside the
    8-minute run; two of two on an 80 GB H100, as before), every point once and in order."""
    gpu = gpu_script()
    h200, h100 = 143_771 << 20, 81_559 << 20  # nvidia-smi's memory.total
    points = list(gpu.MEMORY_POINTS)
    assert gpu.memory_rounds("bert-base", 32000, h200) == [points]
    assert gpu.memory_rounds("bert-base", 32000, h100) == [points[:2], points[2:]]
    assert gpu.memory_rounds("bert-base", 32000, 0) == [points[:2], points[2:]]  # memory unknown: two at a time
    small = gpu.memory_rounds("bert-base", 32000, 24 << 30)
    assert [p for r in small for p in r] == points and max(map(len, small)) < 4


def test_the_gpu_script_model_overrides_parse_values_and_name_a_bad_one():
    """`gpu.py --set field=value` (repeated or comma-joined): JSON numbers and booleans, strings as they are,
    implementation switches left to `set_implementation`; a malformed item is named, not a JSON traceback."""
    gpu = gpu_script()
    config = gpu._config("bert-tiny", 1000, ["dropout=0", "attention_dropout=0.0", "attention=explicit"])
    assert config.dropout == 0 and config.attention_dropout == 0.0 and config.vocab_size == 1000
    for bad, named in (["dropout=0x"], "'dropout=0x'"), (["dropout"], "expected field=value"):
        with pytest.raises(ValueError, match=named):
            gpu._config("bert-tiny", 1000, bad)


def test_the_gpu_script_names_the_cause_of_a_variant_that_failed():
    """A variant's failure is its report row: Keras wraps a layer's error ("Exception encountered when calling
    TransformerBlock.call()" on its first line), so the row shows the cause underneath instead."""
    gpu = gpu_script()
    wrapped = RuntimeError("Exception encountered when calling TransformerBlock.call().\n\n\x1b[1mCould not "
                           "infer the output shape. Error encountered:\n\ncuDNN is not detected.\x1b[0m\n\n"
                           "Arguments received by TransformerBlock.call():")
    assert gpu._error_text(wrapped) == "RuntimeError: cuDNN is not detected."
    assert gpu._error_text(ValueError("bad shape\nmore")) == "ValueError: bad shape"
    assert gpu._error_text(MemoryError()) == "MemoryError: "


def test_the_gpu_script_xla_flag_sets_parse_and_each_is_a_known_flag():
    """`gpu.py all --xla-variants`: ';' between sets, spaces within one, 'none' for no stage; an item that
    is not an --xla_ flag is named before any device time. The default sets are flags this jaxlib knows
    (XLA aborts a process at start on an unknown one, which on a device would lose the stage silently)."""
    import subprocess
    import sys

    gpu = gpu_script()
    assert gpu.xla_variants("--xla_a=1;--xla_b=true --xla_c=2; ") == ["--xla_a=1", "--xla_b=true --xla_c=2"]
    assert gpu.xla_variants("none") == [] and gpu.xla_variants("") == []
    with pytest.raises(ValueError, match="'xla_a=1' is not an XLA flag"):
        gpu.xla_variants("xla_a=1")
    with pytest.raises(SystemExit):  # `--skip` names only stages `all` has, before any device time
        gpu.main(["all", "--skip", "memory,peaks"])
    for flags in gpu.xla_variants(gpu.XLA_VARIANTS):
        done = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(float((jnp.ones(2) + 1).sum()))"],
                              env=dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu"), capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.strip() == "4.0", (flags, done.stderr[-500:])
