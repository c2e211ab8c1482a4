"""LoRA fine-tuning (`kbert.finetune(..., lora_rank=...)`): only the low-rank factors and the head train, the
encoder's own weights stay as they were, each adapted kernel moves by a matrix of rank at most r, the model dir
written is a plain one with the update merged (it predicts what the run evaluated), an interrupted run resumes
to the uninterrupted result, and bad settings are refused by name. The JAX side is in test_tasks_jax.py."""

import csv
import os

import numpy as np
import pytest

import kbert
from kbert.data.recipes import movie_review_sentiment
from helpers import SHARED, needs_shared

pytestmark = needs_shared
ADAPTED = {"all": ("qkv", "attention_output", "intermediate", "output"), "attention": ("qkv", "attention_output")}
SETTINGS = dict(epochs=3, learning_rate=1e-2, max_length=32, lora_rank=4, pooling="mean", batch_size=16,
                progress=False)


@pytest.fixture(scope="module")
def domains(tmp_path_factory):
    """A random bert-tiny (32 wide) and rows telling movie reviews from KorSTS news and caption sentences."""
    reviews = [r["text"] for r in movie_review_sentiment(os.path.join(SHARED, "movie-reviews"), "train",
                                                         limit=1200, seed=1)]
    with open(os.path.join(SHARED, "korsts", "sts-train.tsv"), encoding="utf-8") as f:
        news = [row[5] for row in list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:1201]]
    tok = kbert.Tokenizer.train(reviews + news, vocab_size=1500, progress=False)
    cfg = kbert.ModelConfig.preset("bert-tiny", vocab_size=tok.vocab_size, hidden_size=32, num_heads=2,
                                   intermediate_size=64, max_position=64)
    base = str(tmp_path_factory.mktemp("lora") / "base")
    kbert.save_model(kbert.BertBackbone(cfg), base, tokenizer=tok)
    rows = [{"text": t, "label": "review"} for t in reviews] + [{"text": t, "label": "news"} for t in news]
    np.random.default_rng(0).shuffle(rows)
    return base, rows[:1000], rows[1000:1300]


def _weights(model_dir):
    from safetensors.numpy import load_file

    from kbert.models.io import WEIGHTS_FILE

    return load_file(os.path.join(model_dir, WEIGHTS_FILE))


def _adapted(path, targets="all"):
    parts = path.split("/")
    return parts[-1] == "kernel" and len(parts) >= 2 and parts[-2] in ADAPTED[targets] and "pooler" not in parts


@pytest.mark.parametrize("targets", ["all", "attention"])
def test_lora_trains_a_low_rank_update_and_writes_a_plain_model(domains, tmp_path, targets):
    base, train, dev = domains
    out = str(tmp_path / "lora")
    summary = kbert.finetune(base, "classification", train, dev, out_dir=out, lora_targets=targets, **SETTINGS)
    assert summary["baseline"]["accuracy"] < 0.6 and summary["best"] >= 0.75, summary["history"]
    before, after = _weights(base), _weights(out)
    assert set(after) == set(before)  # no factor in the dir: the update is merged into the kernels
    moved = 0
    for path, old in before.items():
        new = after[path]
        if _adapted(path, targets):
            delta = new.astype(np.float64) - old
            rank = np.linalg.matrix_rank(delta, tol=1e-6 * max(1.0, np.abs(delta).max()))
            assert 1 <= rank <= 4, (path, rank)
            moved += 1
        else:  # embeddings, biases, LayerNorms, the other kernels and the unread pooler: frozen
            np.testing.assert_array_equal(new, old, err_msg=path)
    assert moved == 2 * len(ADAPTED[targets])  # two blocks
    # the merged dir predicts what the run evaluated with the factors apart
    model = kbert.TaskModel.load(out)
    probs = model.predict([r["text"] for r in dev])
    accuracy = np.mean([model.labels[i] == r["label"] for i, r in zip(np.argmax(probs, axis=1), dev)])
    assert accuracy == pytest.approx(summary["best"], abs=1e-6)
    with open(os.path.join(out, "README.md"), encoding="utf-8") as f:  # the card says how it was trained
        assert "lora_rank" in f.read()


def test_interrupted_lora_run_resumes_to_the_same_result(domains, tmp_path):
    base, train, dev = domains
    args = dict(SETTINGS, epochs=1, eval_every=10, checkpoint_every=3, patience=None, dropout=0.0)
    train = train[:400]
    full = kbert.finetune(base, "classification", train, dev, out_dir=str(tmp_path / "full"), **args)
    out = str(tmp_path / "part")
    part = kbert.finetune(base, "classification", train, dev, out_dir=out, stop_after=14, **args)
    assert (part["steps"], part["stopped_by"]) == (14, "stop_after")
    rest = kbert.finetune(base, "classification", train, dev, out_dir=out, **args)
    assert rest["steps"] == full["steps"] and rest["checkpoint"] is None
    for key in ("train_loss", "dev_accuracy"):
        np.testing.assert_allclose([h[key] for h in rest["history"]], [h[key] for h in full["history"]],
                                   rtol=1e-4, atol=1e-4)
    for path, value in _weights(str(tmp_path / "full")).items():
        np.testing.assert_allclose(_weights(out)[path], value, atol=1e-5, err_msg=path)
    # a checkpoint of a LoRA run is not resumed without LoRA
    kbert.finetune(base, "classification", train, dev, out_dir=str(tmp_path / "again"), stop_after=2, **args)
    with pytest.raises(ValueError, match="lora_rank: 4 -> None"):
        kbert.finetune(base, "classification", train, dev, out_dir=str(tmp_path / "again"),
                       **dict(args, lora_rank=None))


def test_lora_settings_are_checked(domains, tmp_path):
    base, train, dev = domains
    for bad, message in (({"lora_rank": 0}, "`lora_rank` must be None"),
                         ({"lora_rank": 2.5}, "`lora_rank` must be None"),
                         ({"lora_rank": 4, "lora_alpha": -1}, "`lora_alpha` must be"),
                         ({"lora_rank": 4, "lora_targets": "mlp"}, "`lora_targets` must be one of"),
                         ({"lora_rank": 64}, "lora_rank=64 is above the rank of the qkv projection")):
        with pytest.raises(ValueError, match=message):
            kbert.finetune(base, "classification", train[:50], out_dir=str(tmp_path / "bad"), max_length=32,
                           progress=False, **bad)


def test_lora_from_the_command_line(domains, tmp_path):
    """`kbert finetune --lora-rank/--lora-alpha/--lora-targets` reach the run: its card names them."""
    import json
    import subprocess
    import sys

    base, train, dev = domains
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in train[:64]), encoding="utf-8")
    out = tmp_path / "cli"
    run = subprocess.run([sys.executable, "-m", "kbert.cli", "finetune", "--model", base, "--task", "classification",
                          "--train", str(rows), "--out", str(out), "--max-length", "32", "--epochs", "1",
                          "--lora-rank", "2", "--lora-alpha", "4", "--lora-targets", "attention"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "LoRA rank 2 on attention projections" in run.stdout + run.stderr
    with open(out / "README.md", encoding="utf-8") as f:
        assert "lora_rank 2, lora_alpha 4, attention projections" in f.read()
    assert set(_weights(str(out))) == set(_weights(base))


@pytest.mark.slow
def test_the_gpu_script_lora_stage_runs_on_a_cpu():
    """`benchmarks/gpu.py lora` (a stage of `gpu.py all`, ready for a GPU lease): XLA's plan of the fine-tuning
    step with and without LoRA at each point, the last point timed; LoRA trains a few percent of the weights
    and its arguments (weights, AdamW state) are a fraction of full fine-tuning's."""
    import json
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu.py")
    run = subprocess.run([sys.executable, script, "lora", "--lora-points", "bert-tiny:1000:4,bert-tiny:1000:8",
                          "--seq", "32", "--json"], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu"))
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert [(r["batch"], r["lora_rank"]) for r in rows] == [(4, None), (4, 8), (8, None), (8, 8)]
    assert all("error" not in r for r in rows), rows
    full, lora = rows[2], rows[3]
    assert lora["trained"] < 0.1 * full["trained"] and lora["arguments"] < 0.6 * full["arguments"]
    assert full["step_s"] > 0 and lora["step_s"] > 0 and "step_s" not in rows[0]


def test_an_adapted_model_in_memory_exports_with_its_update_merged(tmp_path):
    """`kbert.export_transformers` of a model whose projections carry LoRA factors (SPLADE fine-tuning writes
    its output this way) writes the kernels with the update added, as `kbert.save_model` does; before, the
    factors were dropped and the update silently lost."""
    import keras
    import torch
    import transformers

    from helpers import random_batch, tiny_hf_pretraining_model
    from kbert.train.lora import enable_lora

    tiny_hf_pretraining_model("bert").save_pretrained(tmp_path / "hf")
    model = kbert.load_model(str(tmp_path / "hf"), with_heads=True)
    adapted = enable_lora(model.backbone, 4)
    rng = np.random.default_rng(0)
    for dense in adapted:  # a non-zero update (B starts at zero)
        dense.lora_kernel_b.assign(rng.normal(0, 0.05, dense.lora_kernel_b.shape).astype("float32"))
    batch = random_batch()
    ours = keras.ops.convert_to_numpy(model.backbone(batch)["sequence_output"])
    kbert.export_transformers(model, str(tmp_path / "out"))
    hf = transformers.AutoModel.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(batch["token_ids"], dtype=torch.long),
                    token_type_ids=torch.tensor(batch["segment_ids"], dtype=torch.long),
                    attention_mask=torch.tensor(batch["padding_mask"], dtype=torch.long)).last_hidden_state.numpy()
    mask = batch["padding_mask"].astype(bool)
    assert np.max(np.abs(ours[mask] - theirs[mask])) < 1e-4
