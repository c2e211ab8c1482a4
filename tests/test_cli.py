"""The `kbert` command: help, one-line errors with exit code 2, and the subcommands of this package."""

import os
import subprocess
import sys

import pytest


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "kbert.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_commands():
    proc = run("--help")
    assert proc.returncode == 0
    assert "info" in proc.stdout and "convert" in proc.stdout


@pytest.mark.parametrize("args", [["bogus"], ["convert"], ["info", "--nope"], ["convert", "--model"]])
def test_bad_arguments_one_line_exit_2(args):
    proc = run(*args)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kbert") and "error" in lines[0]
    assert "Traceback" not in proc.stderr


def test_subcommand_help():
    proc = run("convert", "--help")
    assert proc.returncode == 0 and "--model" in proc.stdout


def test_info_lists_presets():
    proc = run("info")
    assert proc.returncode == 0, proc.stderr
    assert "bert-base" in proc.stdout and "albert-xlarge" in proc.stdout and "tensorflow" in proc.stdout


def test_info_on_the_jax_backend_lists_its_devices():
    """On a JAX host `kbert info` names the backend and JAX's devices (not TensorFlow's, which may be absent)."""
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "kbert.cli", "info"], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert "(backend: jax)" in proc.stdout and "devices: cpu:0" in proc.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RTLD_GLOBAL loading is the Linux wheels' fault")
def test_triton_is_loaded_before_tensorflow_when_kbert_is_imported_first(tmp_path):
    """TensorFlow 2.21's wheels load their core library RTLD_GLOBAL, and Triton (any CUDA torch: transformers,
    sentence-transformers) imported after it dies with a segmentation fault. Imported after kbert, TensorFlow
    comes after Triton, and tensorflow-text's ops still run (they need TensorFlow's global symbols). A stand-in
    `triton` package records the order (this machine's torch is a CPU build, without Triton)."""
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text("import sys\nAFTER_TENSORFLOW = 'tensorflow' in sys.modules\n")
    probe = ("{first}import tensorflow as tf\nimport tensorflow_text as text\nimport triton\n"
             "print(triton.AFTER_TENSORFLOW)\n"
             "print(text.FastBertNormalizer(lower_case_nfd_strip_accents=True).normalize(['H\\u00e9llo']).numpy())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    results = {}
    for name, first in (("bare", ""), ("kbert", "import kbert\n")):
        proc = subprocess.run([sys.executable, "-c", probe.format(first=first)], capture_output=True, text=True,
                              timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr
        results[name] = proc.stdout.split()
    import tensorflow as tf

    shipped = os.path.exists(os.path.join(os.path.dirname(tf.__file__), "python", "pywrap_dlopen_global_flags.py"))
    assert results["bare"] == ["True", "[b'hello']"]
    assert results["kbert"] == [str(not shipped), "[b'hello']"]


def test_convert_missing_dir_is_one_line(tmp_path):
    proc = run("convert", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "Model directory not found" in proc.stderr


def test_bucket_urls_and_empty_paths_are_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """`--out gs://b/tok` made a local dir ./gs:/b/tok after minutes of training; a model or tokenizer saved
    to a URL went the same way. Refused by name, pointing at a mounted bucket."""
    import kbert
    from kbert.cli import main

    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "c.txt"
    corpus.write_text("대한민국은 민주공화국이다.\n" * 50, encoding="utf-8")
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "100", "--out", "gs://b/tok"]) == 1
    assert "--out 'gs://b/tok' is a URL; kbert reads and writes local paths" in capsys.readouterr().err
    tok = kbert.Tokenizer.train([str(corpus)], vocab_size=273, progress=False)
    with pytest.raises(ValueError, match="tokenizer dir 's3://b/tok' is a URL"):
        tok.save("s3://b/tok")
    with pytest.raises(ValueError, match="model dir 'gs://b/m' is a URL"):
        kbert.save_model(kbert.build_backbone(kbert.ModelConfig.preset("bert-tiny", vocab_size=100)), "gs://b/m")
    assert os.listdir(tmp_path) == ["c.txt"]
    # an unset variable in `--input "$FILE"` read standard input: a terminal's, waiting as if hung
    assert main(["embed", "--model", str(tmp_path / "no-model"), "--input", ""]) == 1
    assert "--input is an empty path (leave the flag out to read standard input)" in capsys.readouterr().err


@pytest.mark.slow
def test_convert_hf_to_kbert_and_back(tmp_path):
    from helpers import tiny_hf_pretraining_model

    tiny_hf_pretraining_model("bert").save_pretrained(tmp_path / "hf")
    proc = run("convert", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "kb"), "--with-heads")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "kb" / "kbert_config.json").exists()
    proc = run("convert", "--model", str(tmp_path / "kb"), "--out", str(tmp_path / "hf2"), "--to", "transformers")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "hf2" / "model.safetensors").exists()


def test_tokenizer_train_and_encode(tmp_path):
    import json

    from test_text import TRAIN_FILES

    proc = run("tokenizer", "train", "--input", *TRAIN_FILES, "--vocab-size", "1500", "--out", str(tmp_path / "tok"))
    assert proc.returncode == 0, proc.stderr
    proc = run("tokenizer", "encode", "--tokenizer", str(tmp_path / "tok"), "대한민국은 민주공화국이다.")
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout.splitlines()[0])
    assert row["ids"][0] == 2 and row["ids"][-1] == 3 and len(row["tokens"]) == len(row["offsets"])


def test_tokenizer_bad_vocab_size_is_one_line(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("한국어 문장입니다.\n" * 5)
    proc = run("tokenizer", "train", "--input", str(f), "--vocab-size", "50000", "--out", str(tmp_path / "t"))
    assert proc.returncode == 1 and "too large for this corpus" in proc.stderr and "Traceback" not in proc.stderr
    proc = run("tokenizer", "train", "--input", str(f), "--vocab-size", "many", "--out", str(tmp_path / "t"))
    assert proc.returncode == 2


def test_tokenizer_train_reads_corpus_names_and_folders_and_names_a_missing_input(tmp_path):
    """`--input` takes what `kbert data prepare --corpus` takes; a name that is neither a file nor a corpus is an
    error (it used to become one line of training text)."""
    proc = run("tokenizer", "train", "--input", "kolaw", "kobill", "--vocab-size", "1000", "--out", str(tmp_path / "t"))
    assert proc.returncode == 0, proc.stderr
    import kbert

    assert kbert.Tokenizer.load(str(tmp_path / "t")).vocab_size == 1000
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("대한민국은 민주공화국이다.\n모든 국민은 법 앞에 평등하다.\n" * 20, encoding="utf-8")
    proc = run("tokenizer", "train", "--input", str(folder), "--vocab-size", "281", "--out", str(tmp_path / "f"))
    assert proc.returncode == 0, proc.stderr
    proc = run("tokenizer", "train", "--input", "kolaww", "--vocab-size", "100", "--out", str(tmp_path / "m"))
    assert proc.returncode == 1 and "not found: 'kolaww'" in proc.stderr and "kolaw" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "m").exists()


def test_tokenizer_train_reads_a_jsonl_files_text_field_not_its_raw_lines(tmp_path):
    """`--input docs.jsonl.gz` trained the vocabulary on the raw JSON lines: pieces such as `{`, `"}` and `\\`
    (escaped line breaks), and the id field's text, none of which `kbert data prepare` (the text field) feeds the
    model. Now it reads the file as the corpus reader does; `Tokenizer.train` given such a path says how."""
    import gzip
    import json

    import kbert

    from test_text import TRAIN_FILES

    docs = [{"id": f"doc-{i}", "text": open(f, encoding="utf-8").read()} for i, f in enumerate(TRAIN_FILES)]
    path = tmp_path / "docs.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode()))
    proc = run("tokenizer", "train", "--input", str(path), "--vocab-size", "1500", "--out", str(tmp_path / "t"))
    assert proc.returncode == 0, proc.stderr
    tok = kbert.Tokenizer.load(str(tmp_path / "t"))
    assert not [p for p in tok.vocab if any(c in p for c in "{}\\") or "doc" in p]
    assert tok.tokenize("대한민국은 민주공화국이다.")[0].startswith("▁")
    with pytest.raises(ValueError, match=r"docs.jsonl.gz is a JSON lines file.*kbert.corpus"):
        kbert.Tokenizer.train([str(path)], vocab_size=1500, progress=False)


def test_commands_start_without_tensorflow_log_noise_and_info_lists_the_text_stack():
    proc = run("info")
    assert proc.returncode == 0, proc.stderr
    for noise in ("cuInit", "port.cc", "cudart_stub", "absl::InitializeLog"):
        assert noise not in proc.stderr, proc.stderr
    for name in ("tensorflow-text", "sentencepiece", "konlpy", "java"):
        assert name in proc.stdout


def test_pretraining_and_finetuning_on_the_jax_backend_start_without_tensorflow_log_noise(tmp_path):
    """On JAX the raw-text pipeline is still tf.data when TensorFlow is installed; its C++ start-up lines
    (`failed call to cuInit` on a CPU machine) must not reach the user there either."""
    import json

    import kbert

    tok = str(tmp_path / "tok")
    kbert.Tokenizer.train(kbert.Corpus(["kolaw"]), vocab_size=800, progress=False).save(tok)
    model = {"architecture": "bert", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64,
             "max_position": 64}
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # the default a user has
    proc = subprocess.run([sys.executable, "-m", "kbert.cli", "pretrain", "--corpus", "kolaw", "--tokenizer", tok,
                           "--out", str(tmp_path / "run"), "--steps", "2", "--batch-size", "4", "--set",
                           "data.max_length=32", "--set", "data.workers=0", "--set", f"model={json.dumps(model)}"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(jax)" in proc.stdout + proc.stderr
    for noise in ("cuInit", "port.cc", "cudart_stub", "absl::InitializeLog"):
        assert noise not in proc.stderr, proc.stderr[-3000:]
    assert os.path.isdir(tmp_path / "run" / "model")
    # fine-tuning seeds TensorFlow too (keras.utils.set_random_seed) and was as noisy. Its dev pairs here are
    # KorSTS' with the scores turned around (5 - score), as question-pair marks paraphrases 0: the untrained
    # model's cosine falls as that label rises, and the run says the labels look inverted
    from helpers import SHARED

    if not os.path.isdir(SHARED):  # on a machine without the shared data, the pretraining half above ran
        pytest.skip(f"the fine-tuning half reads KorSTS from the shared Korean data, not at {SHARED}")
    with open(os.path.join(SHARED, "korsts", "sts-dev.tsv"), encoding="utf-8") as f:
        head, *lines = [line.rstrip("\n").split("\t") for line in f][:301]
    rows = [dict(zip(head, cells)) for cells in lines]
    with open(tmp_path / "pairs.jsonl", "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({"a": r["sentence1"], "b": r["sentence2"], "far": 5 - float(r["score"])},
                               ensure_ascii=False) + "\n")
    proc = subprocess.run([sys.executable, "-m", "kbert.cli", "finetune", "--model", str(tmp_path / "run" / "model"),
                           "--task", "sentence-embedding", "--train", str(tmp_path / "pairs.jsonl"), "--dev",
                           str(tmp_path / "pairs.jsonl"), "--text-column", "a", "--pair-column", "b",
                           "--label-column", "far", "--out", str(tmp_path / "ft"), "--max-steps", "1",
                           "--batch-size", "9", "--max-length", "32"],
                          capture_output=True, text=True, timeout=300,
                          env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for noise in ("cuInit", "port.cc", "cudart_stub", "absl::InitializeLog"):
        assert noise not in proc.stderr, proc.stderr[-3000:]
    assert "the model's cosine falls as the dev label `far` rises" in proc.stderr and "invert the labels" in \
        proc.stderr, proc.stderr[-3000:]
    # on two devices a batch of 9 cannot be split: every batch ran whole on each device, and nothing said so
    assert "training sentence-embedding: 1 steps, batch 9 on jax" in proc.stdout, proc.stdout[-2000:]
    assert "batch_size 9 does not divide among the 2 devices" in proc.stderr and "8 or 10" in proc.stderr


def test_plan_says_when_the_model_does_not_fit():
    proc = run("plan", "--memory", "100MB", "--seq-lens", "128,512")
    assert proc.returncode == 1
    assert "does not fit in 100MB" in proc.stderr and "at least 1.50 GB" in proc.stderr
    assert "| 128 | does not fit |" in proc.stdout
    proc = run("plan", "--memory", "1.6GB", "--seq-lens", "64,512")  # some lengths fit: the table and a note
    assert proc.returncode == 0 and "| 512 | does not fit |" in proc.stdout and "note:" in proc.stderr


def test_plan_names_the_device_its_coefficients_are_for():
    """`--compiler xla-tpu`: a TPU's float32 step keeps about as few activation bytes as its bfloat16 one, so it
    plans a larger float32 batch than the GPU set, and the title says which program was planned."""
    tables = {}
    for compiler in ("xla", "xla-tpu"):
        proc = run("plan", "--memory", "12GB", "--seq-lens", "128", "--compiler", compiler)
        assert proc.returncode == 0, proc.stderr[-2000:]
        tables[compiler] = proc.stdout
        row = next(line for line in proc.stdout.splitlines() if line.startswith("| 128 |"))
        tables[compiler + " batch"] = int(row.split("|")[2])
    assert "XLA-compiled step on a GPU" in tables["xla"] and "XLA-compiled step on a TPU" in tables["xla-tpu"]
    assert tables["xla-tpu batch"] > 1.3 * tables["xla batch"] > 0


def test_plan_sizes_a_model_dir_at_the_lengths_its_positions_reach(tmp_path):
    """`kbert plan --model DIR` plans continued pretraining of a model users have (a KcBERT-like config: vocabulary
    30,000, 300 positions): the default lengths stop at its positions' end and include it, the title names what
    was read, and `--vocab-size` re-sizes the embeddings and logits (a smaller vocabulary fits a larger batch)."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "bert", "vocab_size": 30000, "hidden_size": 768, "num_hidden_layers": 12,
        "num_attention_heads": 12, "intermediate_size": 3072, "max_position_embeddings": 300}))
    proc = run("plan", "--model", str(tmp_path), "--precision", "mixed_bfloat16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "(bert, 12 layers x 768, 109M parameters, vocabulary 30,000)" in proc.stdout

    def table(out):  # {seq len: max batch}
        cells = [line.split("|") for line in out.splitlines() if line.startswith("| ")]
        return {int(c[1]): int(c[2]) for c in cells if c[1].strip().isdigit()}

    assert list(table(proc.stdout)) == [64, 128, 256, 300]
    smaller = run("plan", "--model", str(tmp_path), "--precision", "mixed_bfloat16", "--seq-lens", "128",
                  "--vocab-size", "8000")
    assert smaller.returncode == 0 and "vocabulary 8,000" in smaller.stdout
    assert table(smaller.stdout)[128] > table(proc.stdout)[128] > 0
    beyond = run("plan", "--model", str(tmp_path), "--seq-lens", "512")
    assert beyond.returncode != 0 and "beyond the model's position embeddings (300)" in beyond.stderr


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["wordpiece", "unigram"])
def test_convert_to_transformers_writes_the_tokenizer(tmp_path, algorithm):
    """`kbert convert --to transformers` wrote no tokenizer: `kbert embed` on the result failed and
    AutoTokenizer silently built a 5-token vocabulary. WordPiece goes out in transformers' format; every kind
    goes out as kbert's own copy in tokenizer/, which kbert's commands read."""
    import json

    import transformers

    import kbert
    from helpers import KOREAN_SENTENCES
    from test_text import TRAIN_FILES

    tok = kbert.Tokenizer.train(TRAIN_FILES, vocab_size=800, algorithm=algorithm, progress=False)
    config = kbert.ModelConfig.preset("bert-tiny", vocab_size=tok.vocab_size, max_position=64)
    kbert.save_model(kbert.build_backbone(config), str(tmp_path / "kb"), tokenizer=tok)
    proc = run("convert", "--model", str(tmp_path / "kb"), "--out", str(tmp_path / "hf"), "--to", "transformers")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "hf" / "tokenizer").is_dir() and "Warning" not in proc.stderr
    assert "with its tokenizer (transformers' AutoTokenizer reads it)" in proc.stdout
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert len(hf_tok) == tok.vocab_size
    assert hf_tok(KOREAN_SENTENCES[0])["input_ids"] == tok.encode(KOREAN_SENTENCES[0]).ids
    if algorithm == "unigram":  # a vocabulary with no exact transformers form: said once, on the result line
        bpe = kbert.Tokenizer.train(TRAIN_FILES, vocab_size=800, algorithm="bpe", progress=False)
        kbert.save_model(kbert.build_backbone(config), str(tmp_path / "kb-bpe"), tokenizer=bpe)
        proc = run("convert", "--model", str(tmp_path / "kb-bpe"), "--out", str(tmp_path / "hf-bpe"), "--to",
                   "transformers")
        assert proc.returncode == 0 and "Warning" not in proc.stderr
        assert "sentencepiece tokenizer in kbert's format only" in proc.stdout and "with its" not in proc.stdout
    text = tmp_path / "texts.txt"
    text.write_text("\n".join(KOREAN_SENTENCES[:3]) + "\n", encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "kbert.cli", "embed", "--model", str(tmp_path / "hf")],
                          stdin=open(text, encoding="utf-8"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 3


def test_decode_takes_an_encoding_and_names_wrong_input():
    import kbert
    from test_text import TRAIN_FILES

    tok = kbert.Tokenizer.train(TRAIN_FILES, vocab_size=800, progress=False)
    enc = tok.encode("대한민국은 민주공화국이다.")
    assert tok.decode(enc) == tok.decode(enc.ids) == "대한민국은 민주공화국이다."
    with pytest.raises(TypeError, match="Encoding"):
        tok.decode([enc, enc])
    with pytest.raises(TypeError, match="kbert.normalize"):
        tok.decode("대한민국")


def test_convert_keeps_a_cross_encoders_head_both_ways(tmp_path):
    """`kbert convert` of a Hugging Face reranker: --to kbert keeps its head as a task dir (same scores), and that
    dir --to sentence-transformers is a CrossEncoder dir with the same scores again."""
    import numpy as np
    from sentence_transformers import CrossEncoder

    import kbert
    from helpers import xlmr_dir

    reranker = xlmr_dir(tmp_path, model_class="XLMRobertaForSequenceClassification", num_labels=1)
    proc = run("convert", "--model", reranker, "--out", str(tmp_path / "kb"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "kb" / "kbert_task.json").exists() and "regression" in proc.stdout
    proc = run("convert", "--model", str(tmp_path / "kb"), "--out", str(tmp_path / "ce"), "--to", "sentence-transformers")
    assert proc.returncode == 0, proc.stderr
    assert "CrossEncoder" in proc.stdout
    queries, docs = ["대한민국의 주권", "국회"] * 2, ["국민에게 있다", "법률을 제정한다", "", "대한민국 헌법 " * 30]
    expected = CrossEncoder(reranker, device="cpu").predict(list(zip(queries, docs)))
    np.testing.assert_allclose(kbert.TaskModel.load(str(tmp_path / "kb")).predict(queries, pairs=docs), expected,
                               atol=2e-5)
    np.testing.assert_allclose(CrossEncoder(str(tmp_path / "ce"), device="cpu").predict(list(zip(queries, docs))),
                               expected, atol=2e-5)


def test_data_prepare_stopped_by_sigterm_says_so_exits_143_and_resumes(tmp_path):
    """A scheduler's SIGTERM during `kbert data prepare` (which has no training loop to catch it) stops it with
    a line that says the finished shards are kept and exit code 143; the same command then resumes."""
    import json
    import signal
    import time

    from kbert.data.corpus import corpus
    from test_text import TRAIN_FILES

    assert run("tokenizer", "train", "--input", *TRAIN_FILES, "--vocab-size", "1500",
               "--out", str(tmp_path / "tok")).returncode == 0
    law = [line for doc in corpus("kolaw") for line in doc]
    # 1,000 documents (numbered rotations of the constitution's lines: duplicates would be dropped): about 100
    # shards a second here, so about 10 s of work; the signal comes mid-run even when a loaded machine (CI's
    # other worker) delays the polling below by seconds (with 300, one CI run saw the job finish first)
    docs = ("\n".join([f"문서 {i}"] + law[i % len(law):] + law[:i % len(law)]) for i in range(1000))
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs), encoding="utf-8")
    args = [sys.executable, "-m", "kbert.cli", "data", "prepare", "--corpus", str(tmp_path / "corpus.txt"),
            "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "rec"), "--docs-per-shard", "1",
            "--workers", "0"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    manifest = tmp_path / "rec" / "manifest.json"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:  # stop it once it has written a shard
        if manifest.exists() and json.loads(manifest.read_text() or "{}").get("shards"):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert "kbert: stopped by SIGTERM; the finished shards are kept: rerun the same command to resume" in err
    kept = len(json.loads(manifest.read_text())["shards"])
    assert 0 < kept < 1000 and not json.loads(manifest.read_text())["complete"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"in 1000 shards to {tmp_path / 'rec'} ({kept} shards kept from an earlier run)" in done.stdout


def test_print_config_writes_every_setting_as_yaml_a_config_reads_back(tmp_path, capsys):
    """`--print-config` is the way to a first config file: the defaults with the flags, --config and --set
    applied, read back by --config to the same settings, and nothing trained or written."""
    import yaml

    from kbert.cli import main

    out = tmp_path / "never"
    assert main(["pretrain", "--print-config", "--model", "bert-base", "--corpus", "a.txt", "b.txt", "--steps", "5",
                 "--batch-size", "16", "--set", "optimizer.learning_rate=2e-4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    values = yaml.safe_load(printed)
    assert values["model"] == "bert-base" and values["data"]["source"] == ["a.txt", "b.txt"]
    assert values["trainer"]["steps"] == 5 and values["trainer"]["batch_size"] == 16
    assert values["optimizer"]["learning_rate"] == 2e-4 and values["optimizer"]["name"] == "adamw"  # a default
    assert set(values) >= {"data", "optimizer", "trainer", "runtime", "electra", "output_dir"}
    path = tmp_path / "pretrain.yaml"
    path.write_text(printed, encoding="utf-8")
    assert main(["pretrain", "--config", str(path), "--print-config"]) == 0
    assert capsys.readouterr().out == printed
    assert not out.exists()
    # --set comes after the flags: a field of --model's preset, which used to be dropped without a word
    assert main(["pretrain", "--print-config", "--model", "albert-base", "--set", "model.hidden_size=128",
                 "--set", "model.num_layers=2", "--steps", "5", "--set", "trainer.steps=7"]) == 0
    values = yaml.safe_load(capsys.readouterr().out)
    assert values["model"] == {"preset": "albert-base", "hidden_size": 128, "num_layers": 2}
    assert values["trainer"]["steps"] == 7
    assert main(["pretrain", "--print-config", "--model", str(tmp_path), "--set", "model.dropout=0.0"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"] == {"from": str(tmp_path), "dropout": 0.0}

    assert main(["finetune", "--print-config", "--model", "m", "--task", "sentence-embedding", "--train", "t.csv",
                 "--matryoshka-dims", "64,128", "--set", "epochs=2"]) == 0
    printed = capsys.readouterr().out
    values = yaml.safe_load(printed)
    assert values["task"] == "sentence-embedding" and values["epochs"] == 2 and values["matryoshka_dims"] == [64, 128]
    path = tmp_path / "finetune.yaml"
    path.write_text(printed, encoding="utf-8")
    assert main(["finetune", "--config", str(path), "--print-config"]) == 0
    assert capsys.readouterr().out == printed
    assert main(["finetune", "--print-config", "--set", "epochz=2"]) == 1  # a misspelt key is still named
    assert "epochz" in capsys.readouterr().err


def test_data_prepare_warns_in_one_line_when_the_examples_are_mostly_padding(tmp_path):
    import kbert

    tok = str(tmp_path / "tok")
    kbert.Tokenizer.train(kbert.Corpus(["kolaw"]), vocab_size=800, progress=False).save(tok)
    reviews = tmp_path / "reviews.txt"
    reviews.write_text("\n\n".join(f"{i}번째 리뷰 정말 재밌어요" for i in range(300)) + "\n", encoding="utf-8")
    proc = run("data", "prepare", "--corpus", str(reviews), "--tokenizer", tok, "--out", str(tmp_path / "r"),
               "--max-length", "128", "--workers", "0")
    assert proc.returncode == 0, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if "warning" in x]
    assert line.startswith("kbert data: warning: the pretraining examples are") and "--join-documents" in line
    proc = run("data", "prepare", "--corpus", str(reviews), "--tokenizer", tok, "--out", str(tmp_path / "j"),
               "--max-length", "128", "--workers", "0", "--join-documents")
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr


def test_corpus_stats_says_how_long_the_documents_are(tmp_path, capsys):
    """What decides NSP pairs and padding before any records are written: one-sentence documents, per line."""
    from kbert.cli import main

    path = tmp_path / "reviews.txt"
    path.write_text("재밌어요\n최고의 영화. 또 보고 싶다\n별로\n지루했다\n", encoding="utf-8")
    assert main(["corpus", "stats", str(path), "--format", "lines"]) == 0
    out = capsys.readouterr().out
    assert "4 documents, 5 sentences" in out
    assert "per document: sentences median 1, 90th percentile 2; characters median 4," in out
    assert "75% of documents are one sentence" in out
