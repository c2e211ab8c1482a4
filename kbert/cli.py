"""The `kbert` command: argument parsing only, then one library call per subcommand.

Bad arguments print one line (`kbert: error: ...`) and exit with status 2; library errors caused by
the user's input (missing files, bad configs) print one line and exit with status 1. A traceback
appears only with `KBERT_DEBUG=1`.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import warnings


# Exit statuses of a run stopped by a signal, as shells report them (128 + the signal's number).
_SIGNAL_EXIT = {"SIGINT": 130, "SIGTERM": 143}
# kbert.data.corpus.FORMATS, spelled out so that building the parser imports nothing (a test keeps them equal)
CORPUS_FORMATS = ("text", "lines", "jsonl", "tsv", "csv", "wiki")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage block
        sys.stderr.write(f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
        raise SystemExit(2)


def _show_warning(command, message, category, filename, lineno, file=None, line=None):
    """A warning as one line, as errors are. Through tqdm, which clears a running progress bar first and draws
    it again below, so the line never lands in the middle of the bar."""
    from tqdm import tqdm

    tqdm.write(f"kbert {command}: warning: {message}", file=file or sys.stderr)


def _info(args):
    import platform

    import kbert

    print(f"kbert {kbert.__version__} on Python {platform.python_version()} ({platform.machine()})")
    try:
        import keras
    except ImportError as e:  # Keras imports its backend: KERAS_BACKEND=tensorflow without TensorFlow lands here
        print(f"keras not importable: {e} (KERAS_BACKEND={os.environ.get('KERAS_BACKEND', 'tensorflow')}; "
              f"install that backend, or set KERAS_BACKEND to one that is installed)")
    else:
        backend = keras.backend.backend()
        print(f"keras {keras.__version__} (backend: {backend}), tensorflow {_version('tensorflow')}, "
              f"jax {_version('jax')}")
        if backend == "jax":
            import jax

            print("devices:", ", ".join(f"{d.platform}:{d.id} ({d.device_kind})" for d in jax.devices()))
        elif backend == "tensorflow":
            import tensorflow as tf

            devices = [d.device_type + ":" + d.name.split(":")[-1] for d in tf.config.list_physical_devices()]
            print("devices:", ", ".join(devices))
    print("text:", ", ".join(f"{name} {_version(module)}" for name, module in (
        ("tensorflow-text", "tensorflow_text"), ("sentencepiece", "sentencepiece"), ("konlpy", "konlpy"),
        ("mecab-ko", "mecab"), ("kiwipiepy", "kiwipiepy"))))
    print(f"java (konlpy's taggers): {_java_version()}")
    from kbert.models.config import PRESETS, ModelConfig

    print("model presets:")
    for name in PRESETS:
        cfg = ModelConfig.preset(name)
        print(f"  {name:14s} L={cfg.num_layers:<3d} H={cfg.hidden_size:<5d} A={cfg.num_heads:<3d} "
              f"I={cfg.intermediate_size:<5d} E={cfg.embedding_dim:<5d} "
              f"params={cfg.num_parameters() / 1e6:6.1f}M (vocab {cfg.vocab_size})")


def _version(module: str) -> str:
    """An installed package's version without importing it (importing konlpy's taggers starts a JVM)."""
    from importlib import metadata, util

    names = {"tensorflow_text": "tensorflow-text", "mecab": "mecab-ko"}
    try:
        return metadata.version(names.get(module, module))
    except metadata.PackageNotFoundError:
        return "installed" if util.find_spec(module) else "not installed"


def _java_version() -> str:
    import shutil
    import subprocess

    java = shutil.which("java")
    if java is None:
        return "not found (konlpy's okt, komoran, hannanum and kkma need Java 8+)"
    try:
        done = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{java} does not run: {e}"
    first = (done.stderr or done.stdout).strip().splitlines()
    return f"{first[0] if first else 'unknown version'} ({java})"


def _convert(args):
    import kbert

    from kbert.models.locate import model_dir_of
    from kbert.models.io import TOKENIZER_DIR

    source = model_dir_of(args.model)
    from kbert.embed.task_model import task_meta

    meta = task_meta(source) if not args.with_heads else None
    heads = ("classification", "pair-classification", "regression", "question-answering", "tagging")
    if meta and meta.get("task") in heads and args.to == "kbert":
        model = kbert.TaskModel.load(source)  # a Hugging Face classifier or reader keeps its head as a kbert task dir
        model.save(args.out)
        print(f"wrote kbert {model.task} dir {args.out} with its head and tokenizer")
        return
    if meta and meta.get("task") in ("question-answering", "tagging"):
        task = meta["task"]
        if args.to != "transformers":
            raise SystemExit(f"a {task} model converts to kbert or transformers, not to sentence-transformers (it "
                             f"gives {'spans' if task == 'question-answering' else 'tags'}, not sentence vectors)")
        model = kbert.TaskModel.load(source)
        kbert.export_transformers(model, args.out)
        model.tokenizer.save(os.path.join(args.out, TOKENIZER_DIR))
        kind, what = (("ForQuestionAnswering", "start and end logits") if task == "question-answering" else
                      ("ForTokenClassification", "tag logits (the token-classification pipeline: its entities)"))
        arch = model.network.backbone.config.architecture.capitalize()
        print(f"wrote {task} model {args.out} ({arch}{kind}): "
              f"AutoModel{kind}.from_pretrained({args.out!r}) gives the same {what}")
        return
    if meta and meta.get("task") in ("classification", "pair-classification", "regression"):
        # a classifier / cross-encoder: transformers' sequence-classification layout, which sentence-transformers'
        # CrossEncoder reads (the same dir for --to transformers and --to sentence-transformers)
        model = kbert.TaskModel.load(source)
        kbert.export_transformers(model, args.out)
        model.tokenizer.save(os.path.join(args.out, TOKENIZER_DIR))
        kind = "cross-encoder" if model.task == "regression" else f"{model.task} model"
        print(f"wrote {kind} {args.out} ({model.network.backbone.config.architecture} sequence classification): "
              f"CrossEncoder({args.out!r}).predict(pairs) gives TaskModel.predict's "
              + ("scores" if model.task == "regression" else "logits (apply_softmax=True: its probabilities)"))
        return
    if args.to == "sentence-transformers":
        embedder = kbert.Embedder.load(source)
        kbert.export_sentence_transformers(embedder, args.out)
        layers = "" if embedder.layers in (-1, [-1]) else f" over layers {embedder.layers}"
        print(f"wrote sentence-transformers dir {args.out} ({embedder.pooling} pooling{layers}, max_seq_length "
              f"{embedder.max_length}): SentenceTransformer({args.out!r}) gives `kbert embed`'s vectors")
        return
    model = kbert.load_model(source, with_heads=args.with_heads)
    try:
        tokenizer = kbert.Tokenizer.from_model_dir(source)
    except FileNotFoundError:
        tokenizer = None
    if args.to == "kbert":
        kbert.save_model(model, args.out, tokenizer=tokenizer)
        print(f"wrote kbert model dir {args.out}" + (" with its tokenizer" if tokenizer else ""))
    else:
        with warnings.catch_warnings():  # a vocabulary transformers cannot read exactly: said below, once
            warnings.simplefilter("ignore", UserWarning)
            kbert.export_transformers(model, args.out, tokenizer=tokenizer)
        if tokenizer is not None:  # kbert (embed, finetune, export) reads its own copy in any vocabulary kind
            tokenizer.save(os.path.join(args.out, TOKENIZER_DIR))
        if tokenizer is None:
            said = ""
        elif os.path.isfile(os.path.join(args.out, "tokenizer_config.json")):
            said = " with its tokenizer (transformers' AutoTokenizer reads it)"
        else:
            said = (f"; its {tokenizer.kind} tokenizer in kbert's format only ({os.path.join(args.out, TOKENIZER_DIR)}): "
                    f"transformers' AutoTokenizer has an exact equivalent only for WordPiece and unigram "
                    f"vocabularies without a morpheme analyzer, `repeat` or NFKC")
        print(f"wrote transformers model dir {args.out}{said}")
    if tokenizer is None:
        print(f"note: {args.model!r} holds no tokenizer kbert can read; {args.out} has none either", file=sys.stderr)


def _tokenizer_train(args):
    from kbert.data.corpus import Corpus, file_format
    from kbert.text.tokenizer import Tokenizer
    from kbert.utils import check_local_path

    check_local_path(args.out, "--out")  # before minutes of training, not at the save after them
    options = _corpus_options(args)
    if not options and all(os.path.isfile(s) and file_format(s) == "text" for s in args.input):
        inputs = args.input  # plain files: every line is a training line, as Tokenizer.train reads them
    else:  # JSONL/TSV/CSV/XML files (their text, as `kbert data prepare` reads it, not their raw lines),
        # folders, globs, corpus names (kolaw, movie-reviews, ...) or a --format: kbert's corpus reader
        inputs = Corpus(args.input, **options)
    tok = Tokenizer.train(inputs, vocab_size=args.vocab_size, algorithm=args.algorithm,
                          morphemes=args.morphemes, repeat=args.repeat, lowercase=args.lowercase,
                          user_defined_symbols=args.user_symbols or ())
    tok.save(args.out)
    print(f"wrote {tok!r} to {args.out}")


def _tokenizer_encode(args):
    import json

    from kbert.text.tokenizer import Tokenizer

    tok = Tokenizer.load(args.tokenizer)
    texts = args.text or [line.rstrip("\n") for line in sys.stdin]
    for text in texts:
        enc = tok.encode(text)
        print(json.dumps({"text": text, "tokens": enc.tokens, "ids": enc.ids, "offsets": enc.offsets},
                         ensure_ascii=False))


def _corpus_options(args) -> dict:
    options = {}
    for key in ("format", "text_field", "group_by", "splitter", "dedupe", "path"):
        value = getattr(args, key, None)
        if value is not None:
            options[key] = None if value == "none" else value
    if getattr(args, "column", None):
        options["column"] = args.column
    return options


def _corpus_list(args):
    from kbert.data.recipes import RECIPES

    for name, recipe in RECIPES.items():
        where = ("download: kbert corpus download " + name if recipe.urls else
                 "offline (ships with konlpy)" if name in ("kolaw", "kobill") else "local file: pass --path")
        print(f"{name:14s} {recipe.description} [{where}; see {recipe.readme()}]")


def _corpus_stats(args):
    from kbert.data.corpus import Corpus, document_shape
    from kbert.utils import progress_bar

    corpus = Corpus(args.source, **_corpus_options(args))
    bar = progress_bar(desc="reading", unit=" docs")
    sentences, characters = [], []
    for document in corpus:
        sentences.append(len(document))
        characters.append(sum(len(s) for s in document))
        bar.update(1)
    bar.close()
    print(corpus.report)
    if sentences:
        print(document_shape(sentences, characters))


def _corpus_download(args):
    from kbert.data.recipes import download

    for path in download(args.name, args.dir):
        print(f"downloaded {path}")


def _data_prepare(args):
    from kbert.data.corpus import Corpus, CorpusReport
    from kbert.data.records import prepare
    from kbert.text.tokenizer import Tokenizer

    tok = Tokenizer.load(args.tokenizer)
    corpus = Corpus(args.corpus, **_corpus_options(args))
    manifest = prepare(corpus, tok, args.out, objective=args.objective, max_length=args.max_length,
                       short_seq_prob=args.short_seq_prob, seed=args.seed, docs_per_shard=args.docs_per_shard,
                       workers=args.workers, overwrite=args.overwrite, join_documents=args.join_documents)
    report = CorpusReport(**manifest["report"])
    print(f"wrote {manifest['examples']:,} examples in {len(manifest['shards'])} shards to {args.out} "
          f"({manifest['resumed_shards']} shards kept from an earlier run)")
    print(f"corpus: {report}")


def _pretrain(args):
    from kbert.train.config import PretrainConfig

    overrides = []  # the flags, then --set (as fine-tuning does): `--set model.hidden_size=256` refines --model
    for key, value in (("data.source", args.corpus), ("data.format", args.format), ("data.tokenizer", args.tokenizer),
                       ("output_dir", args.out),
                       ("model", args.model), ("trainer.steps", args.steps), ("trainer.batch_size", args.batch_size),
                       ("runtime.strategy", args.strategy), ("runtime.tpu", args.tpu),
                       ("runtime.precision", args.precision)):
        if value is not None:
            import json

            overrides.append(f"{key}={json.dumps(value, ensure_ascii=False) if isinstance(value, list) else value}")
    config = PretrainConfig.load(args.config, overrides + list(args.set or []))
    if args.print_config:
        return _print_config(config.to_dict())
    from kbert.train.loop import pretrain  # Keras and the backend: not needed to print the settings

    summary = pretrain(config, resume=not args.no_resume)
    state = "finished" if summary["finished"] else f"stopped at step {summary['step']} ({summary['stopped_by']})"
    if summary["history"]:
        rtd = (f", replaced-token accuracy {summary['rtd_accuracy']:.3f} (generator's MLM accuracy above)"
               if "rtd_accuracy" in summary else "")
        print(f"{state}: last {summary['mean_of_steps']} steps' mean loss {summary['loss']:.4f}, MLM accuracy "
              f"{summary['mlm_accuracy']:.3f}{rtd}; {summary['tokens_per_second']:,.0f} tokens/s on "
              f"{summary['replicas']} replica(s), {summary['precision']}, {summary.get('backend', 'tensorflow')}"
              + (f", MFU {100 * summary['mfu']:.1f}%" if summary.get("mfu") else ""))
    else:
        print(f"{state}: nothing left to train at step {summary['step']} (delete the output dir to start over)")
    print(f"checkpoint: {summary['checkpoint']}")
    if summary.get("model_dir"):
        print(f"model: {summary['model_dir']}")
    if summary.get("stopped_by"):  # a stopped run is not a finished one: `pretrain && finetune` must not go on
        print(f"stopped at step {summary['step']}; rerun the same command to resume", file=sys.stderr)
        return _SIGNAL_EXIT.get(summary["stopped_by"], 1)


def _print_config(values: dict) -> int:
    """The resolved settings (defaults, then --config, flags and --set) as YAML a --config can read back."""
    import yaml

    sys.stdout.write(yaml.safe_dump(values, sort_keys=False, allow_unicode=True, default_flow_style=False))
    return 0


def _seq_lens(text: str) -> list:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--seq-lens must be whole numbers separated by commas, e.g. 128,512. Received: {text!r}") \
            from None


PLAN_SEQ_LENS = (64, 128, 256, 320, 384, 512)


def _plan_model(args):
    """`kbert plan`'s ModelConfig (a preset, or a model dir / hub name's config) with --vocab-size, and its
    sequence lengths: --seq-lens, else PLAN_SEQ_LENS up to the model's position embeddings and their end."""
    import dataclasses

    from kbert.train.memory import config_of

    config = config_of(args.model)
    if args.vocab_size is not None:  # ModelConfig refuses a vocabulary under one token
        config = dataclasses.replace(config, vocab_size=args.vocab_size)
    if args.seq_lens:
        return config, _seq_lens(args.seq_lens)
    lens = [n for n in PLAN_SEQ_LENS if n <= config.max_position]
    return config, lens + ([config.max_position] if config.max_position not in lens and
                           config.max_position < PLAN_SEQ_LENS[-1] else [])


def _plan_title(args, config) -> str:
    millions = config.num_parameters() / 1e6
    size = f"{millions:.0f}M" if millions >= 10 else f"{millions:.2g}M"
    return (f"{args.model} ({config.architecture}, {config.num_layers} layers x {config.hidden_size}, {size} "
            f"parameters, vocabulary {config.vocab_size:,})")


def _plan(args):
    from kbert.train.memory import parse_memory, plan_batch_size

    if args.probe or args.exact:
        return _measure(args)
    args.memory = args.memory or "12GB"
    config, seq_lens = _plan_model(args)
    rows = plan_batch_size(config, args.memory, seq_lens, target_batch=args.target_batch, replicas=args.replicas,
                           optimizer=args.optimizer, precision=args.precision, recompute=args.recompute,
                           compiler=args.compiler)
    print(f"{_plan_title(args, config)}, {args.memory} ({parse_memory(args.memory) / 1e9:.1f} GB), {args.optimizer}, "
          f"{args.precision}"
          + (", activation recomputation" if args.recompute else "")
          + {"xla": ", XLA-compiled step on a GPU", "xla-tpu": ", XLA-compiled step on a TPU",
             "xla-cpu": ", XLA-compiled step on a CPU"}.get(
              args.compiler, ", op-by-op step (no XLA)"))
    header = "| seq len | max batch | planned memory |" + (" micro-batch x accumulation x replicas |" if args.target_batch else "")
    print(header)
    print("|---|---|---|" + ("---|" if args.target_batch else ""))
    for r in rows:
        if r["max_batch"] == 0:  # the estimate at batch 1 is the least memory this length needs
            print(f"| {r['seq_len']} | does not fit | {r['memory_at_max'] / 1e9:.2f} GB at batch 1 |"
                  + (" - |" if args.target_batch else ""))
            continue
        line = f"| {r['seq_len']} | {r['max_batch']} | {r['memory_at_max'] / 1e9:.2f} GB |"
        if args.target_batch:
            line += f" {r['micro_batch']} x {r['accumulation']} x {r['replicas']} |"
        print(line)
    misfits = [r for r in rows if r["max_batch"] == 0]
    if misfits:
        least = min(r["memory_at_max"] for r in misfits)
        message = (f"{args.model} does not fit in {args.memory} at sequence length(s) "
                   f"{', '.join(str(r['seq_len']) for r in misfits)} even with batch 1: it needs at least "
                   f"{least / 1e9:.2f} GB there. Use more memory, mixed precision (--precision mixed_bfloat16), "
                   f"activation recomputation (--recompute), shorter sequences or a smaller model")
        if len(misfits) == len(rows):
            raise ValueError(message)
        print(f"note: {message}", file=sys.stderr)


def _measure(args):
    """--exact (compile and read XLA's memory analysis) and/or --probe (real steps) beside the analytic plan."""
    import keras

    from kbert.train.probe import probe_table

    if args.exact and keras.backend.backend() != "jax":
        raise ValueError("--exact reads the memory analysis of the step XLA compiles on Keras' JAX backend; "
                         "run it as `KERAS_BACKEND=jax kbert plan --exact ...` (pip install jax)")
    config, seq_lens = _plan_model(args)
    rows = probe_table(config, seq_lens, optimizer=args.optimizer, precision=args.precision,
                       memory=args.memory, verbose=True, exact=args.exact or keras.backend.backend() == "jax",
                       probe=args.probe)
    gb = lambda b: f"{b / 1e9:.2f} GB" if b else "n/a"  # noqa: E731
    na = lambda v: "n/a" if v is None else str(v)  # noqa: E731
    exact = "exact_batch" in rows[0]
    what = "planned vs compiled" + (" vs probed" if args.probe else "")
    print(f"{_plan_title(args, config)}, {args.optimizer}, {args.precision}: {what} on this device"
          + (f" ({args.memory})" if args.memory else ""))
    at = "probed" if args.probe else "exact"  # both memory columns are at this batch, so the error is like for like
    print("| seq len | planned max batch |" + (" exact max batch |" if exact else "")
          + (" probed max batch |" if args.probe else "") + f" planned memory at the {at} batch | measured |"
          + " planned vs measured | seconds |")
    print("|---|---|" + ("---|" if exact else "") + ("---|" if args.probe else "") + "---|---|---|---:|")
    for r in rows:
        error = f"{r['error'] * 100:+.0f}%" if r["error"] is not None else "n/a"
        line = f"| {r['seq_len']} | {na(r['planned_batch'])} |"
        if exact:
            line += f" {na(r['exact_batch'])} |"
        if args.probe:
            line += f" {r['probed_batch']}" + (" (cap)" if r["limited_by"] == "max_batch" else "") + " |"
        measured = r.get("measured_bytes") or r.get("exact_bytes")
        print(line + f" {gb(r['planned_bytes'])} | {gb(measured)} | {error} | {r['seconds']:.0f} |")


def _embed(args):
    import itertools
    import json

    import numpy as np

    from kbert.embed.embedder import Embedder
    from kbert.embed.index import save_npy
    from kbert.utils import progress_bar, write_atomic

    if args.query and not args.sparse:
        raise ValueError("--query goes with --sparse (a dense model takes --prompt-name query)")
    if args.sparse:
        return _embed_sparse(args)
    if args.format == "npz" or args.max_active_dims is not None:
        raise ValueError("--format npz and --max-active-dims go with --sparse (SPLADE vectors)")
    emb = Embedder.load(args.model, max_length=args.max_length, strategy=args.strategy)
    if args.format == "npy" and not args.out:
        raise ValueError("--format npy needs --out FILE.npy")
    if args.words and (args.prompt_name or args.prompt):
        raise ValueError("--prompt-name / --prompt go with sentence vectors, not --words")
    if args.words and args.long_texts != "truncate":
        raise ValueError("--long-texts mean averages sentence vectors of windows; not with --words")
    emb.prompt_text(args.prompt_name, args.prompt)  # an unknown prompt name fails before any text is read
    width = emb.check_truncate_dim(args.truncate_dim)
    scalar = args.precision in ("int8", "uint8")
    if args.words and args.precision != "float32":
        raise ValueError("--precision quantizes sentence vectors, not --words")
    if args.ranges and not scalar:
        raise ValueError("--ranges goes with --precision int8 or uint8")
    ranges = np.load(args.ranges) if args.ranges else None
    if ranges is not None and ranges.shape != (2, width):
        raise ValueError(f"--ranges {args.ranges}: shape {ranges.shape}, expected (2, {width}) for these vectors")
    if scalar and ranges is None and args.format != "npy":
        raise ValueError(f"--precision {args.precision} streams JSON lines chunk by chunk, so it needs the same "
                         f"--ranges for every chunk (or --format npy: ranges from all the vectors written)")
    # int8/uint8 without --ranges: float vectors first, quantized once all are known (one set of ranges)
    chunk_precision = "float32" if scalar and ranges is None else args.precision
    chunks = []
    lines = _utf8_lines(args.input)
    bar = progress_bar(desc="embedding", unit=" lines")  # on stderr: the vectors go to stdout or --out
    while True:  # streaming: a chunk of lines at a time
        chunk = list(itertools.islice(lines, args.chunk))
        if not chunk:
            break
        if args.words:
            for text, words in zip(chunk, emb.encode_words(chunk, unit=args.unit)):
                print(json.dumps({"text": text, "words": [{"word": w, "start": s, "end": e,
                                                           "vector": [round(float(x), 6) for x in v]}
                                                          for w, s, e, v in words]}, ensure_ascii=False))
            bar.update(len(chunk))
            continue
        vectors = emb.encode(chunk, pooling=args.pooling, progress=False, prompt_name=args.prompt_name,
                             prompt=args.prompt, truncate_dim=args.truncate_dim, precision=chunk_precision,
                             ranges=ranges, long_texts=args.long_texts)
        if args.format == "npy":
            chunks.append(vectors)
        else:
            for text, v in zip(chunk, vectors):
                values = [round(float(x), 6) for x in v] if v.dtype.kind == "f" else v.tolist()
                print(json.dumps({"text": text, "vector": values}, ensure_ascii=False))
        bar.update(len(chunk))
    bar.close()
    if args.format == "npy":
        from kbert.embed.quantize import quantization_ranges, quantize_embeddings

        out = np.concatenate(chunks) if chunks else np.zeros((0, width), np.float32)
        if chunk_precision != args.precision:
            ranges = quantization_ranges(out)
            out = quantize_embeddings(out, args.precision, ranges)
            ranges_path = (args.out[:-4] if args.out.endswith(".npy") else args.out) + ".ranges.npy"
            np.save(ranges_path, ranges)
            print(f"wrote the {args.precision} ranges to {ranges_path} (pass them as --ranges for queries and "
                  f"later texts)", file=sys.stderr)
        # whole or not at all: a stopped save must not leave a truncated file that np.load fails on later
        # (named as np.save names it: .npy added when missing)
        path = args.out if args.out.endswith(".npy") else args.out + ".npy"
        write_atomic(path, lambda tmp: save_npy(tmp, out))
        print(f"wrote {len(out)} vectors to {path}", file=sys.stderr)


def _embed_sparse(args):
    """`kbert embed --sparse`: a JSON line per text with its tokens' weights, heaviest first, or one scipy .npz."""
    import itertools
    import json

    from kbert.embed.sparse import SparseEncoder, save_vectors
    from kbert.utils import progress_bar

    dense_only = {"--words": args.words, "--pooling": args.pooling, "--truncate-dim": args.truncate_dim,
                  "--precision": args.precision != "float32", "--long-texts": args.long_texts != "truncate",
                  "--format npy": args.format == "npy"}
    given = [k for k, v in dense_only.items() if v]
    if given:
        raise ValueError(f"{', '.join(given)} go with dense vectors, not --sparse (a weight per vocabulary token)")
    if args.format == "npz" and not args.out:
        raise ValueError("--format npz needs --out FILE.npz")
    enc = SparseEncoder.load(args.model, max_length=args.max_length)
    options = {"prompt_name": args.prompt_name, "prompt": args.prompt, "max_active_dims": args.max_active_dims}
    lines, parts = _utf8_lines(args.input), []
    bar = progress_bar(desc="sparse vectors", unit=" lines")
    while True:
        chunk = list(itertools.islice(lines, args.chunk))
        if not chunk:
            break
        vectors = (enc.encode_query if args.query else enc.encode)(chunk, **options)
        if args.format == "npz":
            parts.append(vectors)
        else:
            for text, (ids, values) in zip(chunk, enc.weights(vectors)):
                weights = {enc.token(int(j)): round(float(w), 6) for j, w in zip(ids, values)}
                print(json.dumps({"text": text, "weights": weights}, ensure_ascii=False))
        bar.update(len(chunk))
    bar.close()
    if args.format == "npz":
        path = save_vectors(args.out, parts, enc.vocab_size)
        print(f"wrote {sum(p.shape[0] for p in parts)} sparse vectors to {path}", file=sys.stderr)


def _finetune(args):
    from kbert.models.pooling import parse_layers
    from kbert.train.config import load_mapping
    from kbert.train.finetune import FinetuneConfig, run

    # the config file, then the flags given on the command line, then --set overrides
    values = load_mapping(args.config)
    flags = {"model": "model", "task": "task", "train": "train", "dev": "dev", "out": "out_dir",
             "text_column": "text_column", "pair_column": "pair_column", "label_column": "label_column",
             "similarity_loss": "similarity_loss", "pooling": "pooling", "backbone_dropout": "backbone_dropout",
             "epochs": "epochs", "batch_size": "batch_size", "learning_rate": "learning_rate",
             "max_length": "max_length", "patience": "patience", "metric": "metric", "eval_every": "eval_every",
             "class_weights": "class_weights",
             "max_steps": "max_steps", "seed": "seed", "checkpoint_every": "checkpoint_every",
             "objective": "objective", "negative_column": "negative_column", "temperature": "temperature",
             "mini_batch_size": "mini_batch_size", "guide": "guide", "guide_margin": "guide_margin",
             "strategy": "strategy", "doc_stride": "doc_stride", "max_query_length": "max_query_length",
             "max_answer_length": "max_answer_length", "lora_rank": "lora_rank", "lora_alpha": "lora_alpha",
             "lora_targets": "lora_targets", "query_regularizer_weight": "query_regularizer_weight",
             "document_regularizer_weight": "document_regularizer_weight",
             "query_learning_rate": "query_learning_rate"}
    values.update({key: getattr(args, dest) for dest, key in flags.items() if getattr(args, dest) is not None})
    if args.layers is not None:
        values["layers"] = parse_layers(args.layers)
    if args.matryoshka_dims:
        values["matryoshka_dims"] = [int(x) for x in args.matryoshka_dims.split(",")]
    if args.columns:
        values["columns"] = [name.strip() for name in args.columns.split(",")]
    for flag, key, value in (("no_label", "label_column", None), ("no_group_by_length", "group_by_length", False),
                             ("multi_label", "multi_label", True),
                             ("no_resume", "resume", False), ("symmetric", "symmetric", True),
                             ("inference_free", "inference_free", True)):
        if getattr(args, flag):
            values[key] = value
    config = FinetuneConfig.load(None, args.set, base=values)
    if args.print_config:
        return _print_config(config.to_dict())
    summary = run(config)
    return _report_training(summary, summary["task"], "finetune_history.json")


def _report_training(summary: dict, summary_name: str, history_file: str):
    """The one-line result of a fine-tuning or distillation run, its summary written beside the model, and
    the exit status of a run stopped by a signal (it resumes when rerun)."""
    import json

    best = f"best dev {summary['metric']} {summary['best']:.4f} at step {summary['best_step']}" \
        if summary["best"] is not None else ("no dev set: the last model" if summary["history"] else "no model yet")
    if summary["checkpoint"]:
        best += "; stopped with a checkpoint, the same command resumes it"
    card = " (its model card: README.md)" if summary.get("model_card") else ""
    why = {"steps": "all planned", "early_stopping": "early stopping: dev stopped improving",
           "stop_after": "stop_after reached"}.get(summary["stopped_by"], f"stopped by {summary['stopped_by']}")
    print(f"{summary_name}: {summary['steps']} steps ({why}), {best}; model dir: {summary['model_dir']}{card}")
    with open(os.path.join(summary["model_dir"], history_file), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, ensure_ascii=False)
    if summary["stopped_by"] in _SIGNAL_EXIT:
        print(f"stopped at step {summary['steps']}; rerun the same command to resume", file=sys.stderr)
        return _SIGNAL_EXIT[summary["stopped_by"]]


def _distill(args):
    import inspect

    from kbert.train.config import load_mapping
    from kbert.train.distill import distill

    values = load_mapping(args.config)
    flags = {"teacher": "teacher", "student": "student", "corpus": "data", "mode": "mode", "train": "train",
             "dev": "dev", "out": "out_dir", "text_column": "text_column", "pair_column": "pair_column",
             "label_column": "label_column", "temperature": "temperature", "alpha": "alpha", "epochs": "epochs",
             "batch_size": "batch_size", "learning_rate": "learning_rate", "max_length": "max_length",
             "max_steps": "max_steps", "eval_every": "eval_every", "patience": "patience", "seed": "seed",
             "checkpoint_every": "checkpoint_every"}
    values.update({key: getattr(args, dest) for dest, key in flags.items() if getattr(args, dest) is not None})
    if args.no_resume:
        values["resume"] = False
    values = load_mapping(None, args.set, base=values)
    known = set(inspect.signature(distill).parameters)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown distillation setting {unknown[0]!r}; settings are {sorted(known)}")
    for name in ("teacher", "student"):
        if not values.get(name):
            raise ValueError(f"`{name}` is required (the --{name} flag, or a config key)")
    summary = distill(**values)
    return _report_training(summary, f"distill ({summary['mode']})", "distill_history.json")


def _distill_static(args):
    from kbert.embed.st_format import export_sentence_transformers
    from kbert.embed.static import distill_static

    static = distill_static(args.model, dim=None if args.no_pca else args.dim,
                            sif_coefficient=None if args.no_sif else args.sif_coefficient,
                            batch_size=args.batch_size, max_length=args.max_length, progress=True)
    export_sentence_transformers(static, args.out, dtype=args.dtype)
    print(f"static model ({static.vectors.shape[0]} tokens x {static.dimension}) written to {args.out}; load it with "
          f"kbert.Embedder.load, model2vec or sentence-transformers")


def _serve(args):
    import math

    from kbert.server import serve

    if not (math.isfinite(args.timeout) and args.timeout > 0):  # the library's error would name `timeout_s`
        raise ValueError(f"--timeout must be a finite number of seconds > 0. Received: --timeout {args.timeout}")
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)  # then the routes it answers (kbert.serve)
    serve(args.model, host=args.host, port=args.port, max_batch_tokens=args.max_batch_tokens,
          max_wait_ms=args.max_wait_ms, max_queue=args.max_queue, max_texts=args.max_texts,
          max_chars=args.max_chars, timeout_s=args.timeout, jit_compile=args.jit_compile == "on",
          keywords_analyzer=args.keywords_analyzer, index=args.index, hybrid=args.hybrid, reranker=args.reranker)


def _export(args):
    import json

    if args.format == "onnx":
        if args.prompt_name or args.prompt or args.model_version != 1:
            raise SystemExit("--prompt-name, --prompt and --model-version are SavedModel options: an ONNX export "
                             "keeps the model's prompts beside the graph (OnnxEmbedder applies them) and goes "
                             "to OUT itself")
        from kbert.embed.onnx import export_onnx

        path = export_onnx(args.model, args.out, signature=args.signature, pooling=args.pooling,
                           max_length=args.max_length, quantize=args.quantize, overwrite=args.overwrite)
        with open(os.path.join(path, "kbert_onnx.json"), encoding="utf-8") as f:
            info = json.load(f)
        kind = f"{info['signature']}, {info['quantize'] or 'float32'}"
        runner = {"embed": "OnnxEmbedder", "sparse": "SparseEncoder"}.get(info["signature"], "OnnxTaskModel")
        print(f"ONNX graph ({kind}) written to {path}/model.onnx with its tokenizer; checked against the Python "
              f"API; load it with kbert.{runner}.load({path!r}) or onnxruntime")
        return
    if args.quantize:
        raise SystemExit("--quantize applies to --format onnx")
    from kbert.embed.export import export

    path = export(args.model, args.out, signature=args.signature, pooling=args.pooling, max_length=args.max_length,
                  version=args.model_version, overwrite=args.overwrite, prompt_name=args.prompt_name,
                  prompt=args.prompt)
    with open(os.path.join(path, "assets.extra", "kbert.json"), encoding="utf-8") as f:
        signature = json.load(f)["signature"]
    print(f"SavedModel ({signature}) written to {path}; checked against the Python API")


def _utf8_lines(path):
    """The lines of `path` (or of stdin), one at a time, without their line ends; a line that is not UTF-8 is
    an error naming it and the likely fix (a CP949 file), not a codec's byte offset."""
    from kbert.utils import open_binary, undecodable_hint

    source = open_binary(path) if path is not None else sys.stdin.buffer
    for n, raw in enumerate(source, 1):
        try:
            yield raw.decode("utf-8-sig" if n == 1 else "utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            hint = undecodable_hint(raw.rstrip(b"\r\n"))
            raise ValueError(f"{path or 'standard input'}: line {n} is not UTF-8 text; {hint}") from None


def _mine_negatives(args):
    from kbert.data.rows import text_lines, write_rows
    from kbert.embed.mining import mine_hard_negatives
    from kbert.utils import read_utf8_text

    corpus = None
    if args.corpus:
        corpus = [line for line in text_lines(read_utf8_text(args.corpus)) if line.strip()]
    relative = None if args.relative_margin < 0 else args.relative_margin
    rows = mine_hard_negatives(args.model, args.pairs, corpus, anchor_column=args.anchor_column,
                               positive_column=args.positive_column, negative_column=args.negative_column,
                               num_negatives=args.num_negatives, range_min=args.range_min, range_max=args.range_max,
                               margin=args.margin, relative_margin=relative, max_score=args.max_score,
                               sampling=args.sampling, lexical=args.lexical, seed=args.seed)
    if not rows:
        raise ValueError("no pair got a negative (every candidate was the pair's own text or within the margins); "
                         "nothing written")
    write_rows(rows, args.out)
    print(f"{len(rows)} (anchor, positive, negative) rows written to {args.out}; train on them with "
          f"kbert finetune --task sentence-embedding --no-label --text-column {args.anchor_column} "
          f"--pair-column {args.positive_column} --negative-column {args.negative_column}")


def _numbered_lines(path):
    """(1-based line numbers, texts) of the non-blank lines of `path` (or stdin)."""
    numbered = [(n, line) for n, line in enumerate(_utf8_lines(path), 1) if line.strip()]
    if not numbered:
        raise ValueError(f"{path or 'standard input'} holds no text")
    return [n for n, _ in numbered], [line for _, line in numbered]


def _write_json_lines(records, out):
    import json

    f = open(out, "w", encoding="utf-8") if out else sys.stdout
    try:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        if out:
            f.close()


def _paraphrases(args):
    from kbert.embed.mining import paraphrase_mining

    numbers, texts = _numbered_lines(args.input)
    pairs = paraphrase_mining(args.model, texts, top_k=args.top_k, max_pairs=args.max_pairs,
                              threshold=args.threshold, lexical=args.lexical, batch_size=args.batch_size)
    _write_json_lines(({"score": round(score, 6), "line1": numbers[i], "line2": numbers[j], "text1": texts[i],
                        "text2": texts[j]} for score, i, j in pairs), args.out)
    print(f"{len(pairs)} pairs of {len(texts)} lines" + (f" written to {args.out}" if args.out else ""),
          file=sys.stderr)


def _cluster(args):
    from kbert.embed.mining import community_detection

    numbers, texts = _numbered_lines(args.input)
    groups = community_detection(args.model, texts, threshold=args.threshold, min_size=args.min_size,
                                 lexical=args.lexical, batch_size=args.batch_size)
    _write_json_lines(({"size": len(g), "lines": [numbers[i] for i in g], "texts": [texts[i] for i in g]}
                       for g in groups), args.out)
    grouped = sum(len(g) for g in groups)
    print(f"{len(groups)} groups holding {grouped} of {len(texts)} lines (threshold {args.threshold}, at least "
          f"{args.min_size} a group)" + (f"; written to {args.out}" if args.out else ""), file=sys.stderr)


def _keywords(args):
    from kbert.embed.keywords import keywords

    numbers, texts = _numbered_lines(args.input)
    found = keywords(args.model, texts, top_n=args.top_n, ngram_range=tuple(args.ngram_range),
                     analyzer=args.analyzer, stop_words=args.stop_words, diversity=args.diversity,
                     nr_candidates=args.nr_candidates, batch_size=args.batch_size, long_texts=args.long_texts,
                     progress=True)
    _write_json_lines(({"line": n, "keywords": [{"phrase": p, "score": round(s, 6)} for p, s in kw]}
                       for n, kw in zip(numbers, found)), args.out)
    print(f"keywords of {len(texts)} documents" + (f" written to {args.out}" if args.out else ""), file=sys.stderr)


def _fill_mask(args):
    import math

    from kbert.embed.masked_lm import MaskedLM

    numbers, texts = _numbered_lines(args.input)
    lm = MaskedLM.load(args.model, max_length=args.max_length)
    if args.pseudo_likelihood:
        scores = lm.pseudo_log_likelihood(texts, batch_size=args.batch_size)
        tokens = [min(len(ids), lm.max_length - 2) for ids in lm.tokenizer.ids_batch(texts)]
        _write_json_lines(({"line": n, "text": t, "pseudo_log_likelihood": round(float(s), 6), "tokens": k}
                           for n, t, s, k in zip(numbers, texts, scores, tokens)), args.out)
        total = sum(tokens)
        figure = f"; pseudo-perplexity {math.exp(-float(scores.sum()) / total):.3f}" if total else ""
        print(f"{len(texts)} lines, {total} tokens{figure}" + (f", written to {args.out}" if args.out else ""),
              file=sys.stderr)
        return
    found = lm.fill_mask(texts, top_k=args.top_k, targets=args.targets, batch_size=args.batch_size)

    def rounded(p):
        return [rounded(x) for x in p] if isinstance(p, list) else dict(p, score=round(p["score"], 6))

    _write_json_lines(({"line": n, "text": t, "predictions": rounded(p)} for n, t, p in zip(numbers, texts, found)),
                      args.out)
    print(f"masks of {len(texts)} lines filled" + (f", written to {args.out}" if args.out else ""), file=sys.stderr)


def _zero_shot(args):
    from kbert.embed.task_model import TaskModel

    numbers, texts = _numbered_lines(args.input)
    model = TaskModel.load(args.model)
    if args.max_length:
        model.max_length = args.max_length
    found = model.zero_shot(texts, args.labels, hypothesis_template=args.template, multi_label=args.multi_label,
                            batch_size=args.batch_size)
    _write_json_lines(({"line": n, "text": r["sequence"], "labels": r["labels"],
                        "scores": [round(x, 6) for x in r["scores"]]} for n, r in zip(numbers, found)), args.out)
    print(f"{len(texts)} lines classified among {len(found[0]['labels']) if found else 0} labels"
          + (f", written to {args.out}" if args.out else ""), file=sys.stderr)


def _predict(args):
    import json

    from kbert.embed.prediction import predict_rows
    from kbert.embed.task_model import TaskModel

    model = TaskModel.load(args.model)
    if args.max_length:
        model.max_length = args.max_length
    names = [name.strip() for name in args.columns.split(",")] if args.columns else None
    out, figures = predict_rows(model, args.input, args.text_column, args.pair_column, args.label_column, names,
                                batch_size=args.batch_size, progress=True)
    _write_json_lines(out, args.out)
    print(f"{len(out)} rows predicted by the {model.task} model" + (f", written to {args.out}" if args.out else ""),
          file=sys.stderr)
    if figures:
        column, per_label = figures.pop("label_column"), figures.pop("per_label", None)
        print(f"figures against its {column!r} column: {json.dumps(figures)}", file=sys.stderr)
        for label, f in (per_label or {}).items():  # scikit-learn's classification_report, a line a label
            print(f"  {label}: precision {f['precision']:.4f} recall {f['recall']:.4f} f1 {f['f1']:.4f} "
                  f"support {f['support']}", file=sys.stderr)


def _evaluate(args):
    import json

    from kbert.data.rows import number, read_rows, text_cell
    from kbert.embed import evaluation
    from kbert.embed.embedder import Embedder
    from kbert.embed.sparse import is_sparse_model

    label = None if args.task == "retrieval" else args.label_column
    if args.lexical and args.task != "retrieval":
        raise ValueError("--lexical mixes TF-IDF into retrieval scores; it goes with --task retrieval")
    sparse = args.sparse or is_sparse_model(args.model)
    if args.max_active_dims is not None and not sparse:
        raise ValueError("--max-active-dims goes with a SPLADE model (--sparse, or a sentence-transformers "
                         "SparseEncoder dir)")
    rows = read_rows(args.data, [args.text_column, args.pair_column, label])
    if not rows:
        raise ValueError(f"{args.data} holds no rows")
    first = [text_cell(r, args.text_column, f"row {i + 1}") for i, r in enumerate(rows)]
    second = [text_cell(r, args.pair_column, f"row {i + 1}") for i, r in enumerate(rows)]
    if sparse:
        from kbert.embed.sparse import SparseEncoder

        emb = SparseEncoder.load(args.model, max_length=args.max_length)
    else:
        emb = Embedder.load(args.model, max_length=args.max_length)
    # both texts of a pair with the named prompt; retrieval gives queries and documents the model's own
    options = {"batch_size": args.batch_size, **({"prompt_name": args.prompt_name} if args.prompt_name else {})}
    if args.max_active_dims is not None:
        options["max_active_dims"] = args.max_active_dims
    if args.task == "sts":
        figures = evaluation.evaluate_sts(emb, first, second, [number(r.get(label), "data", i)
                                                               for i, r in enumerate(rows)], **options)
    elif args.task == "pair-classification":
        def similar(value):  # numbers compare as numbers ("1" is 1.0), other labels as text
            try:
                return float(value) == float(args.positive_label)
            except (TypeError, ValueError):
                return str(value).strip() == args.positive_label

        figures = evaluation.evaluate_pair_classification(emb, first, second,
                                                          [int(similar(r.get(label))) for r in rows], **options)
    else:  # each row's first text is a query whose relevant document is its second text, among all of them
        corpus = list(dict.fromkeys(second))
        if args.corpus:
            corpus = list(dict.fromkeys(corpus + [line for line in _utf8_lines(args.corpus) if line.strip()]))
        where = {text: j for j, text in enumerate(corpus)}
        figures = evaluation.evaluate_retrieval(emb, first, corpus, [{where[t]} for t in second],
                                                lexical=args.lexical, **{k: v for k, v in options.items()
                                                                         if k != "prompt_name"})
        figures["corpus"] = len(corpus)
    print(json.dumps({"model": args.model, "data": args.data, "task": args.task, "rows": len(rows), **figures},
                     ensure_ascii=False, indent=2))


def _index_source(args):
    """(texts, ids, metadata) of --input: a TSV/CSV/JSONL file's --text-column (ids from --id-column, the other
    columns as metadata), or any other file's non-blank lines (ids: positions)."""
    base = args.input[:-3] if args.input.endswith(".gz") else args.input
    if not base.lower().endswith((".tsv", ".csv", ".jsonl", ".json")):
        if args.id_column:
            raise ValueError("--id-column reads a TSV/CSV/JSONL file; a text file's lines are numbered by position")
        return _numbered_lines(args.input)[1], None, None
    from kbert.data.rows import read_rows, text_cell

    rows = read_rows(args.input, [args.text_column, args.id_column])
    texts = [text_cell(row, args.text_column, f"{args.input} row {i + 1}") for i, row in enumerate(rows)]
    ids = [row[args.id_column] for row in rows] if args.id_column else None
    extra = [{k: v for k, v in row.items() if k not in (args.text_column, args.id_column)} for row in rows]
    return texts, ids, extra if any(extra) else None


def _index_passages(args, model, texts, ids, metadata):
    """--passages N: the documents as passages of up to N tokens (`kbert.split_documents`)."""
    if not args.passages:
        return texts, ids, metadata
    from kbert.embed.embedder import Embedder
    from kbert.embed.passages import split_documents
    from kbert.embed.sparse import SparseEncoder

    # the model's tokenizer counts the tokens: an Embedder's, or a SPLADE model's for a sparse index
    emb = model if not isinstance(model, str) else (SparseEncoder if getattr(args, "sparse", False)
                                                     else Embedder).load(model)
    parts = split_documents(texts, emb, max_tokens=args.passages, overlap=args.passage_overlap, ids=ids,
                            metadata=metadata)
    print(f"{len(texts)} documents in {len(parts.texts)} passages of up to {args.passages} tokens", file=sys.stderr)
    return parts.texts, parts.ids, parts.metadata


def _index_build(args):
    from kbert.embed.index import SearchIndex

    if args.sparse:
        return _index_build_sparse(args)
    if args.max_active_dims is not None:
        raise ValueError("--max-active-dims goes with --sparse (an index of SPLADE vectors)")
    texts, ids, metadata = _index_passages(args, args.model, *_index_source(args))
    index = SearchIndex.build(args.model, texts, args.out, ids=ids, metadata=metadata, kind=args.kind,
                              precision=args.precision, hnsw_m=args.hnsw_m, nlist=args.nlist,
                              chunk_size=args.chunk_size, batch_size=args.batch_size, resume=not args.no_resume,
                              overwrite=args.overwrite, pooling=args.pooling, max_length=args.max_length,
                              truncate_dim=args.truncate_dim, long_texts=args.long_texts, prompt_name=args.prompt_name,
                              query_prompt_name=args.query_prompt_name, lexical=args.lexical)
    print(f"{index!r} written to {args.out}; search it with kbert index search --index {args.out}", file=sys.stderr)


def _index_build_sparse(args):
    """`kbert index build --sparse`: a kbert.SparseIndex of a SPLADE model's vectors."""
    from kbert.embed.sparse_index import SparseIndex

    dense_only = {"--kind": args.kind != "flat", "--precision": args.precision != "float32",
                  "--hnsw-m": args.hnsw_m != 32, "--nlist": args.nlist is not None, "--lexical": args.lexical,
                  "--pooling": args.pooling is not None, "--truncate-dim": args.truncate_dim is not None,
                  "--long-texts": args.long_texts != "truncate", "--prompt-name": args.prompt_name is not None,
                  "--query-prompt-name": args.query_prompt_name is not None,
                  "--max-length": args.max_length is not None}
    given = [f"{k} {getattr(args, k[2:].replace('-', '_'))}" if k == "--kind" else k
             for k, v in dense_only.items() if v]
    if given:
        raise ValueError(f"{', '.join(given)} goes with a dense index, not --sparse (SPLADE vectors: the model's "
                         f"own prompts and length)")
    texts, ids, metadata = _index_passages(args, args.model, *_index_source(args))
    index = SparseIndex.build(args.model, texts, args.out, ids=ids, metadata=metadata,
                              max_active_dims=args.max_active_dims, chunk_size=args.chunk_size,
                              batch_size=min(args.batch_size, 16), resume=not args.no_resume, overwrite=args.overwrite)
    print(f"{index!r} written to {args.out}; search it with kbert index search --index {args.out}", file=sys.stderr)


def _index_add(args):
    from kbert.embed.sparse_index import load_index

    index = load_index(args.index, model=args.model)
    texts, ids, metadata = _index_source(args)
    if args.passages and ids is None:  # documents numbered on from those the index holds
        known = [index.get(p).metadata.get("document") for p in range(len(index) + len(index.deleted))]
        first = 1 + max([d for d in known if isinstance(d, int)], default=-1)
        ids = list(range(first, first + len(texts)))
    texts, ids, metadata = _index_passages(args, index.embedder, texts, ids, metadata)
    before = len(index)
    index.add(texts, ids=ids, metadata=metadata, batch_size=args.batch_size, progress=True)
    index.save()
    print(f"added {len(index) - before} texts to {args.index}: {index!r}", file=sys.stderr)


def _where(conditions):
    """--where KEY=VALUE ...: a filter on metadata values, compared as text (a TSV's cells are text, JSONL's may
    not be); a key given twice takes either value."""
    if not conditions:
        return None
    pairs = [c.split("=", 1) for c in conditions]
    if any(len(p) != 2 or not p[0] for p in pairs):
        raise ValueError(f"--where takes KEY=VALUE. Received: {conditions}")
    wanted = {}
    for key, value in pairs:
        wanted.setdefault(key, set()).add(value)
    return lambda r: all(str((r.get("metadata") or {}).get(k)) in v for k, v in wanted.items())


def _index_search(args):
    from kbert.embed.sparse_index import load_index

    index = load_index(args.index, model=args.model)
    reranker = None
    if args.reranker:
        from kbert.embed.task_model import TaskModel

        reranker = TaskModel.load(args.reranker)
    queries = _numbered_lines(args.input)[1]
    options = dict(top_k=args.top_k, reranker=reranker, candidates=args.candidates, where=_where(args.where),
                   group_by=args.group_by)
    if args.hybrid:
        from kbert.embed.hybrid import hybrid_search

        if args.lexical:
            raise ValueError("--lexical is not taken with --hybrid (the sparse side is the --hybrid index)")
        hits = hybrid_search(index, load_index(args.hybrid), queries, weight=args.weight, fusion=args.fusion,
                             ef_search=args.ef_search, nprobe=args.nprobe, **options)
    else:
        hits = index.search(queries, ef_search=args.ef_search, nprobe=args.nprobe, lexical=args.lexical, **options)
    _write_json_lines(({"query": q, "hits": [dict({"id": h.id, "score": round(h.score, 6), "text": h.text},
                                                  **({"metadata": h.metadata} if h.metadata else {}))
                                             for h in found]} for q, found in zip(queries, hits)), args.out)


def _index_delete(args):
    from kbert.embed.sparse_index import load_index

    index = load_index(args.index)
    if bool(args.ids) == bool(args.where):
        raise ValueError("give --ids or --where (not both)")
    if args.ids:
        count = index.delete([int(i) for i in args.ids] if index.info["ids"] == "positions" else args.ids)
    else:
        count = index.delete(where=_where(args.where))
    index.save()
    print(f"deleted {count} texts from {args.index}: {index!r}", file=sys.stderr)


def _index_info(args):
    import json

    from kbert.embed.sparse_index import load_index

    index = load_index(args.index)
    info = {k: v for k, v in index.info.items() if k != "probe"}
    print(json.dumps(info, ensure_ascii=False, indent=1))


def _quickstart(args):
    from kbert.quickstart import main_args

    main_args(args)


def _add_self_mining_arguments(p):
    p.add_argument("--model", help="model dir or Hub name whose vectors score the lines (not needed with --lexical 1)")
    p.add_argument("--input", help="text file, one text a line (default: stdin); blank lines are skipped, and the "
                                   "output names lines by their number in the file")
    p.add_argument("--out", help="JSON lines file to write (default: stdout)")
    p.add_argument("--lexical", type=float, default=0.0,
                   help="mix in character n-gram TF-IDF cosine with this weight (1: TF-IDF alone, no model)")
    p.add_argument("--batch-size", type=int, default=64, help="texts encoded at a time (default 64)")


def _add_corpus_arguments(p):
    p.add_argument("--format", choices=CORPUS_FORMATS,
                   help="default: from the file name; lines: plain text with each line a document (reviews, comments)")
    p.add_argument("--text-field", help="JSONL field with the text (default: text)")
    p.add_argument("--column", nargs="+", help="TSV or CSV column name(s) or index (default: the header's text column)")
    p.add_argument("--group-by", help="TSV or CSV column: adjacent rows with the same value form one document")
    p.add_argument("--splitter", choices=("rules", "kiwi", "lines"), help="sentence splitter (default: rules)")
    p.add_argument("--dedupe", choices=("document", "sentence", "none"), help="exact-duplicate removal")
    p.add_argument("--path", help="for a named corpus: where its files are")


def _columns_flag(p):
    p.add_argument("--columns", help="a TSV/CSV without a header line: its columns' names in order, e.g. "
                                     "label,text (its first line is then a row)")


def build_parser() -> argparse.ArgumentParser:
    from kbert.embed.zero_shot import DEFAULT_TEMPLATE

    parser = _Parser(prog="kbert", description="Korean BERT/ALBERT pretraining and embedding toolkit.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("quickstart", help="tokenizer + tiny pretraining + embeddings on an embedded Korean corpus")
    p.add_argument("--corpus", nargs="+", help="your text instead of konlpy's kolaw + kobill (paths or names)")
    p.add_argument("--format", choices=CORPUS_FORMATS, help="how --corpus is read (default: from the file name); "
                                                           "lines: each line a text of its own (reviews, comments)")
    p.add_argument("--out", default="kbert-quickstart", help="output dir (rerun resumes)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--vocab-size", type=int, default=8000, help="capped at what the corpus supports")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_quickstart)

    p = sub.add_parser("info", help="versions, devices and model presets")
    p.set_defaults(func=_info)

    p = sub.add_parser("convert", help="convert a Hugging Face / TF1 / kbert model dir")
    p.add_argument("--model", required=True, help="input model directory (any format kbert.load_model reads)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--to", choices=("kbert", "transformers", "sentence-transformers"), default="kbert",
                   help="output format (sentence-transformers: the model's sentence pooling as SentenceTransformer "
                        "modules; the same vectors as kbert embed)")
    p.add_argument("--with-heads", action="store_true", help="keep the pretraining heads")
    p.set_defaults(func=_convert)

    tp = sub.add_parser("tokenizer", help="train or apply a Korean subword tokenizer")
    tsub = tp.add_subparsers(dest="tokenizer_command", metavar="ACTION", parser_class=_Parser, required=True)
    p = tsub.add_parser("train", help="learn a vocabulary from text files or a corpus")
    p.add_argument("--input", nargs="+", required=True,
                   help="text files (.txt, .gz, .bz2; each line a training line), or JSONL/TSV/CSV files, folders, "
                        "globs and corpus names (`kbert corpus list`) read as `kbert data prepare` reads them")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--algorithm", choices=("unigram", "bpe", "wordpiece"), default="unigram")
    p.add_argument("--morphemes", choices=("mecab", "kiwi", "okt", "komoran", "hannanum", "kkma", "konlpy-mecab"),
                   default=None, help="pre-split eojeols into morphemes with this analyzer")
    p.add_argument("--repeat", type=int, default=None, help="cut character runs to this length (ㅋㅋㅋㅋ -> ㅋㅋ)")
    p.add_argument("--lowercase", action="store_true")
    p.add_argument("--user-symbols", nargs="*", help="extra tokens kept whole, e.g. [URL]")
    p.add_argument("--out", required=True, help="output tokenizer directory")
    _add_corpus_arguments(p)
    p.set_defaults(func=_tokenizer_train)
    p = tsub.add_parser("encode", help="print tokens, ids and offsets as JSON lines")
    p.add_argument("--tokenizer", required=True, help="tokenizer dir, vocab.txt or .model")
    p.add_argument("text", nargs="*", help="texts (default: one per line from stdin)")
    p.set_defaults(func=_tokenizer_encode)

    cp = sub.add_parser("corpus", help="list, inspect or download corpora")
    csub = cp.add_subparsers(dest="corpus_command", metavar="ACTION", parser_class=_Parser, required=True)
    p = csub.add_parser("list", help="the named corpora")
    p.set_defaults(func=_corpus_list)
    p = csub.add_parser("stats", help="read a corpus and print its cleaning report")
    p.add_argument("source", nargs="+", help="files, folders, globs or corpus names")
    _add_corpus_arguments(p)
    p.set_defaults(func=_corpus_stats)
    p = csub.add_parser("download", help="download a named corpus (the only command that downloads)")
    p.add_argument("name")
    p.add_argument("--dir", help="target folder (default: $KBERT_DATA/NAME or ~/.cache/kbert/corpora/NAME)")
    p.set_defaults(func=_corpus_download)

    dp = sub.add_parser("data", help="prepare pretraining records")
    dsub = dp.add_subparsers(dest="data_command", metavar="ACTION", parser_class=_Parser, required=True)
    p = dsub.add_parser("prepare", help="tokenize and pair a corpus into TFRecord shards (all cores, resumable)")
    p.add_argument("--corpus", nargs="+", required=True, help="files, folders, globs or corpus names")
    p.add_argument("--tokenizer", required=True, help="tokenizer dir, vocab.txt or .model")
    p.add_argument("--out", required=True, help="records directory (rerun to resume)")
    p.add_argument("--objective", choices=("mlm", "mlm+nsp", "mlm+sop"), default="mlm+nsp",
                   help="segment pairs for next-sentence prediction (BERT) or sentence-order prediction (ALBERT: "
                        "mlm+sop); a pretraining run on these records uses their objective")
    p.add_argument("--max-length", "--max-seq-len", dest="max_length", type=int, default=128,
                   help="tokens per sequence with [CLS]/[SEP] (--max-seq-len: its old name)")
    p.add_argument("--short-seq-prob", type=float, default=0.1)
    p.add_argument("--join-documents", action="store_true",
                   help="join consecutive short documents (reviews, comments: a text per line) until each fills a "
                        "sequence, instead of examples that are mostly padding")
    p.add_argument("--docs-per-shard", type=int, default=1024)
    p.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="start over instead of resuming")
    _add_corpus_arguments(p)
    p.set_defaults(func=_data_prepare)

    p = sub.add_parser("pretrain", help="pretrain a BERT/ALBERT (resumable; Ctrl-C or SIGTERM saves)")
    p.add_argument("--config", help="YAML or JSON config (every key and its default: --print-config)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override, applied after the other flags, e.g. optimizer.learning_rate=1e-4 or "
                        "model.hidden_size=256 (a field of --model's preset)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved settings as YAML (a --config file to edit) and exit without training")
    p.add_argument("--corpus", nargs="+", help="data.source: corpus paths/names, a records dir, or dummy")
    p.add_argument("--format", choices=CORPUS_FORMATS, help="data.format: how raw text is read (default: from the "
                                                           "file name); lines: each line a document (reviews)")
    p.add_argument("--tokenizer", help="data.tokenizer")
    p.add_argument("--model", help="a preset name (bert-tiny, ..., albert-base), or a model to continue pretraining "
                                   "from: a kbert model/run dir, a Hugging Face dir or cached hub name (its "
                                   "weights, heads and, without --tokenizer, its vocabulary)")
    p.add_argument("--out", help="output_dir")
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", help="global batch size, or auto (planned from device memory)")
    p.add_argument("--strategy", choices=("auto", "tpu", "mirrored", "multiworker", "cpu"))
    p.add_argument("--tpu", help="TPU name (or set TPU_NAME)")
    p.add_argument("--precision", choices=("auto", "float32", "mixed_float16", "mixed_bfloat16"))
    p.add_argument("--no-resume", action="store_true", help="fail instead of resuming when checkpoints exist")
    p.set_defaults(func=_pretrain)

    p = sub.add_parser("embed", help="sentence (or word) vectors for lines of text (stdin or --input)")
    p.add_argument("--model", required=True, help="model dir (kbert, or Hugging Face with its vocab)")
    p.add_argument("--input", help="text file, one text per line (default: stdin)")
    p.add_argument("--pooling", choices=("mean", "cls", "max", "first_last_avg"),
                   help="default: the model's own (a fine-tuned bi-encoder's pooling), else mean")
    p.add_argument("--prompt-name", help="one of the model's prompts put before every text (a sentence-transformers "
                                         "dir's, e.g. E5's query / passage; default: the model's default prompt)")
    p.add_argument("--prompt", help="a text put before every text instead of a named prompt")
    p.add_argument("--truncate-dim", type=int, help="keep the first N dimensions of each vector (a Matryoshka "
                                                    "model's short vectors), renormalized")
    p.add_argument("--long-texts", choices=("truncate", "mean"), default="truncate",
                   help="a line over --max-length tokens: its first tokens (default), or the mean of its "
                        "consecutive windows' vectors")
    p.add_argument("--words", action="store_true", help="word vectors instead of sentence vectors")
    p.add_argument("--sparse", action="store_true",
                   help="SPLADE sparse vectors (kbert.SparseEncoder: a model with its masked-LM head or a "
                        "sentence-transformers SparseEncoder dir): each line's tokens and weights")
    p.add_argument("--max-active-dims", type=int, help="with --sparse: keep each vector's N heaviest tokens")
    p.add_argument("--query", action="store_true",
                   help="with --sparse: encode the lines as queries (the model's query prompt; an inference-free "
                        "model's weight table)")
    p.add_argument("--unit", choices=("eojeol", "morpheme", "subword"), default="eojeol", help="with --words")
    p.add_argument("--format", choices=("jsonl", "npy", "npz"), default="jsonl",
                   help="npy: dense vectors as one array; npz: --sparse vectors as one scipy.sparse CSR matrix")
    p.add_argument("--out", help="output file for --format npy / npz")
    p.add_argument("--precision", choices=("float32", "int8", "uint8", "binary", "ubinary"), default="float32",
                   help="quantized vectors in sentence-transformers' formats: int8/uint8 (256 buckets per "
                        "dimension over --ranges, or with --format npy the ranges of all the vectors written, "
                        "saved beside them as OUT.ranges.npy) or binary/ubinary (sign bits, 8 to a byte)")
    p.add_argument("--ranges", help="int8/uint8: a [2, dim] .npy of each dimension's min and max (the "
                                    "OUT.ranges.npy an earlier run wrote, or kbert.quantization_ranges)")
    p.add_argument("--strategy", choices=("auto", "cpu", "mirrored", "tpu"), default="auto",
                   help="devices: auto (every local one), cpu, mirrored (the GPUs), tpu; several share each batch "
                        "(Keras' JAX backend; TensorFlow: one)")
    p.add_argument("--chunk", type=int, default=256, help="lines per batch of work")
    p.add_argument("--max-length", type=int, help="tokens per text; longer texts are truncated with a warning "
                                                  "(default: the model's limit)")
    p.set_defaults(func=_embed)

    p = sub.add_parser("finetune", help="train a task head (or a bi-encoder) on labelled data; keeps the best on dev")
    p.add_argument("--config", help="YAML or JSON file of fine-tuning settings (the keys of kbert.finetune / "
                                    "FinetuneConfig); flags given here override it")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a setting, e.g. epochs=5")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved settings as YAML (a --config file to edit) and exit without training")
    p.add_argument("--model", help="pretrained model dir with its tokenizer (required, here or in --config)")
    p.add_argument("--task", choices=("classification", "pair-classification", "regression", "tagging",
                                      "sentence-embedding", "question-answering", "sparse-embedding"),
                   help="required, here or in --config; sparse-embedding: SPLADE from a model with its masked-LM head")
    p.add_argument("--train", help="TSV (header), CSV or JSONL file, or for question-answering a SQuAD-format .json "
                                   "(KorQuAD's) (required, here or in --config)")
    p.add_argument("--dev", help="dev file for metrics, early stopping and the best checkpoint")
    p.add_argument("--out", help="output model dir (default: finetuned)")
    p.add_argument("--text-column", help="default: text (question-answering: question)")
    p.add_argument("--pair-column", help="second text (pair tasks, sentence-embedding; question-answering: the "
                                         "context, default context)")
    p.add_argument("--label-column", help="label, score, or space-separated tags (default: label; "
                                          "question-answering: answers)")
    _columns_flag(p)
    p.add_argument("--no-label", action="store_true", help="sentence-embedding from (anchor, positive) pairs")
    p.add_argument("--multi-label", action="store_true",
                   help="classification: each row any number of the labels (a JSON list or a comma-separated cell; "
                        "empty: none), a sigmoid each")
    p.add_argument("--similarity-loss", choices=("cosine", "cosent", "contrastive"),
                   help="sentence-embedding with scores: cosine regression (default) or CoSENT's ranking loss; "
                        "with 1 / 0 labels (paraphrase or not) also contrastive (OnlineContrastiveLoss)")
    p.add_argument("--pooling", choices=("pooler", "mean", "cls", "max", "first_last_avg"),
                   help="the vector a head reads or a bi-encoder outputs (default: pooler for heads, "
                        "mean for sentence-embedding)")
    p.add_argument("--layers", help="with --pooling other than pooler: layers averaged before pooling: -1 (the "
                                    "last, default), all, or indices such as 0,4 (0 = embedding output)")
    p.add_argument("--backbone-dropout", type=float,
                   help="dropout inside the backbone while fine-tuning (default: 0 for sentence-embedding "
                        "with scores, else the model's own, BERT's 0.1)")
    p.add_argument("--epochs", type=float, help="default: 3")
    p.add_argument("--batch-size", type=int, help="default: 32")
    p.add_argument("--learning-rate", "--lr", type=float, help="default: 5e-5")
    p.add_argument("--max-length", type=int, help="tokens per input (default 128, question-answering 384, or the "
                                                  "model's limit if lower)")
    p.add_argument("--doc-stride", type=int, help="question-answering: context tokens shared by neighbouring "
                                                  "windows of a long context (default 128)")
    p.add_argument("--max-query-length", type=int, help="question-answering: question tokens kept (default 64)")
    p.add_argument("--max-answer-length", type=int, help="question-answering: longest answer decoded, in tokens "
                                                         "(default 30)")
    p.add_argument("--patience", type=int, help="evaluations without improvement before stopping (default: 2)")
    p.add_argument("--class-weights", choices=("balanced",),
                   help="classification: weigh each class's rows by n / (k * n_c) in the loss (for classes of very "
                        "different sizes; a mapping of label to weight goes in --config)")
    p.add_argument("--metric", help="the dev figure that picks the best checkpoint, e.g. macro_f1 (default: the "
                                    "task's: accuracy, spearman, entity_f1, ...)")
    p.add_argument("--eval-every", type=int, help="steps between dev evaluations (default: each epoch)")
    p.add_argument("--max-steps", type=int)
    p.add_argument("--seed", type=int, help="default: 0")
    p.add_argument("--no-group-by-length", action="store_true",
                   help="plain shuffled batches instead of batches of similar length (less padding, faster)")
    p.add_argument("--checkpoint-every", type=int,
                   help="steps between checkpoints of the whole run (default 1000; also after each evaluation "
                        "and at Ctrl-C / SIGTERM); an interrupted run resumes when the same command is run again")
    p.add_argument("--no-resume", action="store_true", help="start over instead of resuming OUT/checkpoints")
    p.add_argument("--objective", choices=("simcse",), help="sentence-embedding: unsupervised SimCSE on --text-column "
                                                           "alone (--pair-column/--label-column: the dev set)")
    p.add_argument("--negative-column", help="sentence-embedding: a hard negative per (anchor, positive) row")
    p.add_argument("--temperature", type=float, help="sentence-embedding: in-batch / SimCSE temperature (0.05)")
    p.add_argument("--matryoshka-dims", help="sentence-embedding: also train vectors cut to these widths, e.g. 64,128")
    p.add_argument("--mini-batch-size", type=int,
                   help="sentence-embedding: texts through the network at a time (gradient caching: a large "
                        "contrastive batch in the memory of this many)")
    p.add_argument("--guide", help="sentence-embedding with in-batch negatives: a model dir whose vectors leave "
                                   "out of each row's negatives what it scores above the row's positive (GISTEmbed)")
    p.add_argument("--guide-margin", type=float, help="with --guide: the cosine margin (default 0)")
    p.add_argument("--query-regularizer-weight", type=float,
                   help="sparse-embedding: the FLOPS penalty on the anchors' vectors (5e-5; more: sparser)")
    p.add_argument("--document-regularizer-weight", type=float,
                   help="sparse-embedding: the FLOPS penalty on the positives' vectors (3e-5)")
    p.add_argument("--inference-free", action="store_true",
                   help="sparse-embedding: inference-free SPLADE, queries read a trained weight per token (starting "
                        "at the documents' IDF), documents run the model")
    p.add_argument("--query-learning-rate", type=float,
                   help="--inference-free: the query table's learning rate (1e-3)")
    p.add_argument("--symmetric", action="store_true",
                   help="sentence-embedding with in-batch negatives: also rank each positive's anchor among the "
                        "batch's anchors (MultipleNegativesSymmetricRankingLoss)")
    p.add_argument("--strategy", choices=("auto", "cpu", "mirrored", "tpu"),
                   help="devices: auto (every local one, default), cpu, mirrored (the GPUs), tpu; several train "
                        "data-parallel with --batch-size as the whole batch (Keras' JAX backend; TensorFlow: one)")
    p.add_argument("--lora-rank", type=int, help="LoRA: freeze the encoder and learn a rank-r update of each "
                                                  "adapted projection (8 or 16; default: full fine-tuning); the "
                                                  "model written has it merged")
    p.add_argument("--lora-alpha", type=float, help="LoRA: the update's scale is alpha / rank (default alpha = rank)")
    p.add_argument("--lora-targets", choices=("all", "attention"),
                   help="LoRA: every linear projection of each block (default) or the attention ones only")
    p.set_defaults(func=_finetune)

    p = sub.add_parser("mine-negatives", help="hard negatives for (anchor, positive) pairs, nearest by a model "
                                              "(or by character n-grams), as training rows")
    p.add_argument("--model", help="model dir whose vectors rank the candidates (not needed with --lexical 1)")
    p.add_argument("--pairs", required=True, help="TSV (header), CSV or JSONL file of (anchor, positive) rows")
    p.add_argument("--out", required=True, help="output file: .jsonl, .csv or .tsv (the pairs' columns + the negative)")
    p.add_argument("--corpus", help="candidate texts, one per line (default: the pairs' distinct positives)")
    p.add_argument("--anchor-column", default="anchor")
    p.add_argument("--positive-column", default="positive")
    p.add_argument("--negative-column", default="negative")
    p.add_argument("--num-negatives", type=int, default=1, help="negatives per pair, a row each (default 1)")
    p.add_argument("--range-min", type=int, default=0, help="skip this many of the best-ranked candidates")
    p.add_argument("--range-max", type=int, help="look no further than this rank (default: the whole corpus)")
    p.add_argument("--margin", type=float, help="keep candidates scored at most the positive's score minus this")
    p.add_argument("--relative-margin", type=float, default=0.05,
                   help="keep candidates scored at most (1 - this) x the positive's score (default 0.05; "
                        "-1 turns it off)")
    p.add_argument("--max-score", type=float, help="keep candidates scored at most this")
    p.add_argument("--sampling", choices=("top", "random"), default="top")
    p.add_argument("--lexical", type=float, default=0.0,
                   help="mix in character n-gram TF-IDF cosine with this weight (1: TF-IDF alone, no model)")
    p.add_argument("--seed", type=int, default=0, help="for --sampling random")
    p.set_defaults(func=_mine_negatives)

    p = sub.add_parser("paraphrases", help="the most similar pairs of lines of a file (near-duplicates, "
                                           "paraphrases), best first, as JSON lines")
    _add_self_mining_arguments(p)
    p.add_argument("--top-k", type=int, default=100, help="partners considered per line (default 100)")
    p.add_argument("--max-pairs", type=int, default=500_000, help="the most pairs written (default 500000)")
    p.add_argument("--threshold", type=float, help="only pairs scored at least this")
    p.set_defaults(func=_paraphrases)

    p = sub.add_parser("cluster", help="groups of similar lines around a central one (sentence-transformers' "
                                       "community detection), largest first, as JSON lines")
    _add_self_mining_arguments(p)
    p.add_argument("--threshold", type=float, default=0.75,
                   help="the least score of a member with its group's first line (default 0.75)")
    p.add_argument("--min-size", type=int, default=10, help="the fewest lines a group may have (default 10; 2 "
                                                            "finds every pair of near-duplicates)")
    p.set_defaults(func=_cluster)

    p = sub.add_parser("keywords", help="the keyphrases of each line (KeyBERT's method over Korean noun phrases: "
                                        "the noun runs whose vectors are nearest the line's), as JSON lines")
    p.add_argument("--model", required=True, help="model dir or Hub name whose vectors score the phrases")
    p.add_argument("--input", help="text file, one document a line (default: stdin); blank lines are skipped, and "
                                   "the output names lines by their number in the file")
    p.add_argument("--out", help="JSON lines file to write (default: stdout)")
    p.add_argument("--top-n", type=int, default=5, help="keyphrases a document (default 5)")
    p.add_argument("--ngram-range", type=int, nargs=2, default=[1, 2], metavar=("MIN", "MAX"),
                   help="nouns a phrase (default 1 2)")
    p.add_argument("--analyzer", default="mecab", help="morpheme analyzer: mecab (default), kiwi, okt, komoran, "
                                                       "hannanum, kkma")
    p.add_argument("--stop-words", nargs="+", help="nouns never in a phrase")
    p.add_argument("--diversity", type=float, help="maximal marginal relevance with this weight on variety (0-1)")
    p.add_argument("--nr-candidates", type=int, help="max sum distance over this many nearest candidates")
    p.add_argument("--long-texts", choices=("truncate", "mean"), default="truncate",
                   help="a document over the model's max_length: its first tokens (default, as KeyBERT), or the "
                        "mean of its windows' vectors")
    p.add_argument("--batch-size", type=int, default=64, help="texts encoded at a time (default 64)")
    p.set_defaults(func=_keywords)

    p = sub.add_parser("fill-mask", help="the likeliest tokens at each [MASK] of each line, from a pretrained model's "
                                         "masked-LM head (transformers' fill-mask pipeline), or with "
                                         "--pseudo-likelihood each line's pseudo-log-likelihood, as JSON lines")
    p.add_argument("--model", required=True, help="model dir or Hub name saved with its masked-LM head (a `kbert "
                                                  "pretrain` output, a BertForPreTraining / *ForMaskedLM dir)")
    p.add_argument("--input", help="text file, one text a line (default: stdin); blank lines are skipped, and the "
                                   "output names lines by their number in the file")
    p.add_argument("--out", help="JSON lines file to write (default: stdout)")
    p.add_argument("--top-k", type=int, default=5, help="tokens a mask (default 5)")
    p.add_argument("--targets", nargs="+", help="tokens to choose among instead of the whole vocabulary")
    p.add_argument("--pseudo-likelihood", action="store_true",
                   help="score whole lines instead (no masks): the sum over each line's tokens of log P(token | "
                        "the rest), one pass a token; the pseudo-perplexity of all lines goes to stderr")
    p.add_argument("--max-length", type=int, help="tokens a row, [CLS] and [SEP] included (default: the model's "
                                                  "positions); a longer line is read around its masks")
    p.add_argument("--batch-size", type=int, default=32, help="rows a forward pass (default 32)")
    p.set_defaults(func=_fill_mask)

    p = sub.add_parser("zero-shot", help="classify each line among labels it was never trained on, with a natural-"
                                         "language-inference model (transformers' zero-shot-classification "
                                         "pipeline), as JSON lines: the labels from the likeliest down, with scores")
    p.add_argument("--model", required=True, help="an NLI classifier dir or Hub name (KLUE-NLI or KorNLI fine-tunes, a "
                                                  "`kbert finetune` pair classifier with an 'entailment' label)")
    p.add_argument("--labels", required=True, help="the candidate labels, comma-separated (\"스포츠,정치,경제\")")
    p.add_argument("--template", default=DEFAULT_TEMPLATE,
                   help=f"the hypothesis each label is put into at {{}} (default {DEFAULT_TEMPLATE!r})")
    p.add_argument("--multi-label", action="store_true",
                   help="score each label on its own (several may hold) instead of one softmax over the labels")
    p.add_argument("--input", help="text file, one text a line (default: stdin); blank lines are skipped, and the "
                                   "output names lines by their number in the file")
    p.add_argument("--out", help="JSON lines file to write (default: stdout)")
    p.add_argument("--max-length", type=int, help="tokens a (text, hypothesis) pair (default: the model's); a longer "
                                                  "text is cut, the hypothesis kept whole")
    p.add_argument("--batch-size", type=int, default=64, help="pairs a forward pass (default 64)")
    p.set_defaults(func=_zero_shot)

    p = sub.add_parser("predict", help="a fine-tuned model's prediction for each row of a file (a test set), as "
                                       "JSON lines, and its figures when the file has the labels (accuracy, "
                                       "macro-F1, Spearman, exact match and F1)")
    p.add_argument("--model", required=True, help="a `kbert finetune` dir, or a Hugging Face classifier, "
                                                  "cross-encoder, reader or tagger (dir or Hub name)")
    p.add_argument("--input", required=True, help="TSV (header), CSV, JSONL or SQuAD .json file, or a .txt of "
                                                  "texts a line (one-text tasks)")
    _columns_flag(p)
    p.add_argument("--text-column", help="default: the model's fine-tuning column (else text; question-answering: "
                                         "question)")
    p.add_argument("--pair-column", help="the second text (pair tasks; question-answering: the context); default: "
                                         "the model's")
    p.add_argument("--label-column", help="the gold labels to score against (default: the model's, when the file "
                                          "has it); named, every row must have one")
    p.add_argument("--out", help="JSON lines file to write (default: stdout); the figures go to stderr")
    p.add_argument("--max-length", type=int, help="tokens an input (default: the model's)")
    p.add_argument("--batch-size", type=int, default=64, help="inputs a forward pass (default 64)")
    p.set_defaults(func=_predict)

    p = sub.add_parser("evaluate", help="how good a model's sentence vectors are on a labelled file: STS "
                                        "correlations, paraphrase classification or retrieval figures (JSON)")
    p.add_argument("--model", required=True, help="model dir or Hub name (kbert.Embedder.load; a sentence-transformers "
                                                  "SparseEncoder dir: kbert.SparseEncoder.load)")
    p.add_argument("--data", required=True, help="TSV (header), CSV or JSONL file of text pairs")
    p.add_argument("--task", choices=("sts", "pair-classification", "retrieval"), default="sts",
                   help="sts: scored pairs, Spearman/Pearson of the cosines (default); pair-classification: pairs "
                        "labelled similar or not, accuracy/F1/AP; retrieval: each first text a query whose "
                        "relevant document is its second text, among all second texts (nDCG@10, MRR@10, ...)")
    p.add_argument("--text-column", default="sentence1")
    p.add_argument("--pair-column", default="sentence2")
    p.add_argument("--label-column", default="score", help="the score (sts) or label (pair-classification)")
    p.add_argument("--positive-label", default="1",
                   help="pair-classification: the label value of a similar pair (default 1); every other is not")
    p.add_argument("--corpus", help="retrieval: more candidate documents, one a line")
    p.add_argument("--lexical", type=float, default=0.0, help="retrieval: hybrid score with this TF-IDF weight")
    p.add_argument("--prompt-name", help="sts / pair-classification: the model's prompt for both texts")
    p.add_argument("--sparse", action="store_true",
                   help="read the model as SPLADE (kbert.SparseEncoder: a model with its masked-LM head); figures "
                        "on dot products, with active dimensions (a SparseEncoder dir is read so without it)")
    p.add_argument("--max-active-dims", type=int, help="SPLADE: keep each vector's N heaviest tokens")
    p.add_argument("--max-length", type=int)
    p.add_argument("--batch-size", type=int, default=64)
    p.set_defaults(func=_evaluate)

    p = sub.add_parser("distill", help="knowledge distillation: a small student learns a pretrained, fine-tuned or "
                                       "sentence-embedding teacher (general / task / embedding modes)")
    p.add_argument("--config", help="YAML or JSON file of the keyword arguments of kbert.distill; flags override it")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a setting, e.g. epochs=5")
    p.add_argument("--teacher", help="the teacher model dir (a `kbert finetune` output, a `kbert pretrain` "
                                     "model, or any model dir in embedding mode)")
    p.add_argument("--student", help="a preset (bert-tiny, bert-mini, ...: built with the teacher's vocabulary and "
                                     "initialized from it) or a model dir")
    p.add_argument("--corpus", help="unlabeled in-domain text: a text file (a line per text) or a TSV/CSV/JSONL")
    p.add_argument("--mode", choices=("auto", "task", "embedding", "general"), help="default: auto (from the teacher dir)")
    p.add_argument("--train", help="task mode: the task's labeled rows (gold labels mixed in by --alpha)")
    p.add_argument("--dev", help="dev rows: the teacher's task, or scored pairs in embedding mode")
    p.add_argument("--out", help="output model dir (default: distilled)")
    p.add_argument("--text-column", help="default: the teacher's own, else text")
    p.add_argument("--pair-column")
    p.add_argument("--label-column")
    p.add_argument("--temperature", type=float, help="soft-target temperature (default 2)")
    p.add_argument("--alpha", type=float, help="weight of the gold labels where rows have them (default 0.5)")
    p.add_argument("--epochs", type=float, help="default: 3")
    p.add_argument("--batch-size", type=int, help="default: 32")
    p.add_argument("--learning-rate", "--lr", type=float, help="default: 1e-4")
    p.add_argument("--max-length", type=int, help="tokens per input (default 128)")
    p.add_argument("--max-steps", type=int)
    p.add_argument("--eval-every", type=int, help="steps between dev evaluations (default: each epoch)")
    p.add_argument("--patience", type=int, help="evaluations without improvement before stopping (default: never)")
    p.add_argument("--seed", type=int, help="default: 0")
    p.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (default 1000)")
    p.add_argument("--no-resume", action="store_true", help="start over instead of resuming OUT/checkpoints")
    p.set_defaults(func=_distill)

    p = sub.add_parser("distill-static", help="a static embedding model (Model2Vec's recipe: a table of token "
                                              "vectors, hundreds of times faster on CPU) distilled from a model")
    p.add_argument("--model", required=True, help="a model dir or Hub name (a bi-encoder distils best)")
    p.add_argument("--out", required=True, help="output dir (Model2Vec and sentence-transformers layout)")
    p.add_argument("--dim", type=int, default=256, help="the vectors' width after PCA (default 256)")
    p.add_argument("--no-pca", action="store_true", help="keep the model's width, unrotated")
    p.add_argument("--sif-coefficient", type=float, default=1e-4,
                   help="SIF weighting of frequent tokens, a / (a + p) (default 1e-4)")
    p.add_argument("--no-sif", action="store_true", help="no frequency weighting")
    p.add_argument("--max-length", type=int, default=512, help="tokens of a text kept (default 512)")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="the table's (default float32)")
    p.add_argument("--batch-size", type=int, default=1024, help="tokens run through the model at a time")
    p.set_defaults(func=_distill_static)

    ip = sub.add_parser("index", help="a semantic-search index on disk (dense vectors in FAISS, or SPLADE vectors "
                                      "with --sparse): build once over a collection (resumable), add to it, search it")
    isub = ip.add_subparsers(dest="index_command", required=True)
    p = isub.add_parser("build", help="encode a collection and write a search index (Ctrl-C keeps the finished "
                                      "chunks; the same command resumes)")
    p.add_argument("--model", required=True, help="a sentence-embedding model dir (or Hugging Face dir / Hub name)")
    p.add_argument("--input", required=True, help="a text file (one text per non-blank line; ids are positions "
                                                  "0, 1, ...) or a TSV/CSV/JSONL file (--text-column, --id-column; "
                                                  "other columns are kept as each hit's metadata)")
    p.add_argument("--out", required=True, help="the index dir")
    p.add_argument("--kind", choices=("flat", "hnsw", "ivf"), default="flat",
                   help="flat: exact (default); hnsw: a graph, approximate and fast on large collections; ivf: "
                        "centroid buckets")
    p.add_argument("--precision", choices=("float32", "float16", "int8"), default="float32",
                   help="bytes a dimension: 4, 2 or 1 (FAISS's scalar quantizers)")
    p.add_argument("--hnsw-m", type=int, default=32, help="hnsw: links per vector (default 32)")
    p.add_argument("--nlist", type=int, help="ivf: centroids (default 4 sqrt(n))")
    p.add_argument("--chunk-size", type=int, default=10_000, help="texts encoded and saved at a time (the unit "
                                                                  "a stopped build resumes from)")
    p.add_argument("--no-resume", action="store_true", help="start over instead of finishing a stopped build")
    p.add_argument("--overwrite", action="store_true", help="replace an index already in --out")
    p.add_argument("--pooling", choices=("mean", "cls", "max", "first_last_avg"),
                   help="default: the model's own")
    p.add_argument("--prompt-name", help="the documents' prompt (default: the model's document prompt, if any)")
    p.add_argument("--query-prompt-name", help="the queries' prompt (default: the model's query prompt, if any)")
    p.add_argument("--max-length", type=int, help="tokens per text (default: the model's limit)")
    p.add_argument("--truncate-dim", type=int, help="keep the first N dimensions (a Matryoshka model)")
    p.add_argument("--long-texts", choices=("truncate", "mean"), default="truncate",
                   help="a text over --max-length: its first tokens (default), or the mean of its windows")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--text-column", default="text")
    p.add_argument("--id-column", help="a column of unique ids (TSV/CSV/JSONL input)")
    p.add_argument("--lexical", action="store_true", help="also keep character n-gram TF-IDF of the texts, for "
                                                          "hybrid search (index search --lexical W)")
    p.add_argument("--passages", type=int, metavar="N", help="index each document as passages of up to N tokens, "
                                                           "cut at sentence ends (kbert.split_documents)")
    p.add_argument("--passage-overlap", type=int, default=1, help="sentences each passage repeats (default 1)")
    p.add_argument("--sparse", action="store_true",
                   help="an index of SPLADE vectors (kbert.SparseIndex: --model a SPLADE / masked-LM model), searched "
                        "as an inverted index by dot product")
    p.add_argument("--max-active-dims", type=int, help="with --sparse: keep each text's N heaviest tokens")
    p.set_defaults(func=_index_build, resumes="the encoded chunks are kept: rerun the same command to resume")

    p = isub.add_parser("add", help="encode more texts into an index (the build's settings) and save it")
    p.add_argument("--index", required=True)
    p.add_argument("--input", required=True, help="as for build (ids from --id-column if the index has ids)")
    p.add_argument("--model", help="the model that built the index, when it was not recorded or has moved")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--text-column", default="text")
    p.add_argument("--id-column")
    p.add_argument("--passages", type=int, metavar="N", help="index each document as passages of up to N tokens, "
                                                           "cut at sentence ends (kbert.split_documents)")
    p.add_argument("--passage-overlap", type=int, default=1, help="sentences each passage repeats (default 1)")
    p.set_defaults(func=_index_add)

    p = isub.add_parser("search", help="the nearest texts of the index for each line of --input (or stdin), as "
                                       "JSON lines")
    p.add_argument("--index", required=True)
    p.add_argument("--input", help="queries, one per line (default: stdin)")
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--ef-search", type=int, help="hnsw: the search beam (default 64; larger: better recall, slower)")
    p.add_argument("--nprobe", type=int, help="ivf: buckets searched (default: an eighth, at least 8)")
    p.add_argument("--model", help="the model that built the index, when it was not recorded or has moved")
    p.add_argument("--lexical", type=float, default=0.0,
                   help="hybrid search (an index built with --lexical): (1 - W) x cosine + W x character n-gram "
                        "TF-IDF cosine (0.6 did best on this project's Korean question pairs); default 0")
    p.add_argument("--hybrid", metavar="SPARSE_INDEX",
                   help="a sparse (SPLADE) index of the same texts: one ranking fused from both (--index dense)")
    p.add_argument("--weight", type=float, default=0.5, help="--hybrid: the sparse side's share, 0..1 (default 0.5)")
    p.add_argument("--fusion", choices=["zscore", "rrf"], default="zscore",
                   help="--hybrid: standardized scores added (default) or reciprocal ranks added")
    p.add_argument("--reranker", help="a cross-encoder dir that re-scores each query's first --candidates hits")
    p.add_argument("--candidates", type=int, default=100,
                   help="texts each part of a hybrid search proposes, and the reranker re-scores (default 100)")
    p.add_argument("--where", action="append", metavar="KEY=VALUE",
                   help="only texts whose metadata KEY is VALUE (as text); repeat a key for any of several values, "
                        "give several keys for all of them")
    p.add_argument("--group-by", help="only the best hit per value of this metadata key (document: one passage "
                                      "per document of an index built with --passages)")
    p.add_argument("--out", help="output file (default: stdout)")
    p.set_defaults(func=_index_search)

    p = isub.add_parser("delete", help="leave texts out of every search from now on (by id; positions for an "
                                       "index built without ids)")
    p.add_argument("--index", required=True)
    p.add_argument("--ids", nargs="+")
    p.add_argument("--where", action="append", metavar="KEY=VALUE",
                   help="instead of --ids: every text whose metadata match (document=7: a document's passages)")
    p.set_defaults(func=_index_delete)

    p = isub.add_parser("info", help="what an index holds and how it was built, as JSON")
    p.add_argument("--index", required=True)
    p.set_defaults(func=_index_info)

    p = sub.add_parser("serve", help="an HTTP server for embeddings (OpenAI-compatible), similarity, "
                                     "classification and reranking (Cohere's form), with dynamic batching")
    p.add_argument("--model", required=True, help="a kbert model dir, a `kbert finetune` task dir, a Hugging Face "
                                                  "dir (a *ForSequenceClassification one: a classifier / reranker), "
                                                  "or a kbert.EnsembleEmbedder dir (its vectors)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--max-batch-tokens", type=int, default=8192, help="token budget of one model batch")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="how long a batch waits for more requests")
    p.add_argument("--max-queue", type=int, default=4096, help="texts waiting before requests get 429")
    p.add_argument("--max-texts", type=int, default=512, help="texts per request (more: 413)")
    p.add_argument("--max-chars", type=int, default=20000, help="characters per text (more: 413)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds before a request gets 504")
    p.add_argument("--jit-compile", choices=("on", "off"), default="on",
                   help="sentence vectors, classifier and reranker scores through XLA, each batch shape compiled "
                        "in the background the first time it is met (on), or the graph only (off)")
    p.add_argument("--keywords-analyzer", default="mecab",
                   help="morpheme analyzer of /v1/keywords and /v1/word-embeddings (unit \"morpheme\"): mecab "
                        "(default), kiwi, okt, komoran, hannanum, kkma")
    p.add_argument("--index", help="a `kbert index build` dir that POST /v1/search searches (built with this model)")
    p.add_argument("--hybrid", help="with --index: an index of the other kind (dense or SPLADE) over the same texts; "
                                    "/v1/search fuses both (kbert.hybrid_search), loading the model that built it")
    p.add_argument("--reranker", help="with --index: a cross-encoder dir (a reranker, a `kbert finetune` pair "
                                      "regression, or its ONNX export) that re-scores each /v1/search query's first "
                                      "hits (the request's \"candidates\", default 100)")
    p.set_defaults(func=_serve)

    p = sub.add_parser("export", help="a SavedModel that takes raw strings (TF Serving layout DIR/VERSION/), or an "
                                      "ONNX graph with its tokenizer (--format onnx)")
    p.add_argument("--model", required=True, help="model dir (classify: a `kbert finetune` output or a Hugging Face "
                                                  "classifier / cross-encoder)")
    p.add_argument("--out", required=True, help="export dir; a SavedModel goes to OUT/VERSION/, ONNX to OUT/")
    p.add_argument("--format", choices=("savedmodel", "onnx"), default="savedmodel",
                   help="savedmodel (TensorFlow Serving, strings in) or onnx (ONNX Runtime, token ids in; "
                        "kbert.OnnxEmbedder tokenizes)")
    p.add_argument("--quantize", choices=("int8",), help="onnx: int8 weights (dynamic quantization)")
    p.add_argument("--signature", choices=("embed", "classify", "sparse"),
                   help="default: sparse for a SPLADE (SparseEncoder) dir (onnx only), classify for a fine-tuned "
                        "classifier/regressor dir, embed otherwise")
    p.add_argument("--pooling", choices=("mean", "cls", "max", "first_last_avg"), help="embed: default mean")
    p.add_argument("--max-length", type=int, help="longest input in tokens (default: the model's)")
    p.add_argument("--model-version", type=int, default=1, help="the numbered subdir TF Serving loads")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--prompt-name", help="embed: one of the model's prompts put before every text in the graph "
                                         "(e.g. query; default: the model's default prompt)")
    p.add_argument("--prompt", help="embed: a text put before every text instead of a named prompt")
    p.set_defaults(func=_export)

    p = sub.add_parser("plan", help="the largest batch that fits device memory, per sequence length")
    p.add_argument("--model", default="bert-base",
                   help="a preset (bert-base, albert-base, ...), a model dir, or a Hugging Face Hub name such as "
                        "klue/bert-base to size continued pretraining of it (its config alone: no weights are read)")
    p.add_argument("--vocab-size", type=int, help="the vocabulary the run trains (default: the model's; a preset's "
                                                  "is 32000): the embeddings and the masked-LM logits grow with it")
    p.add_argument("--memory", help="device memory, e.g. 12GB, 80GiB (default 12GB; with --probe: the device's)")
    p.add_argument("--seq-lens", help="comma-separated (default 64,128,256,320,384,512, those the model's position "
                                      "embeddings reach, and their end where that is shorter: KcBERT's 300)")
    p.add_argument("--optimizer", choices=("adam", "adamw", "lamb", "sgd"), default="adamw")
    p.add_argument("--precision", choices=("float32", "mixed_float16", "mixed_bfloat16"), default="float32")
    p.add_argument("--target-batch", type=int, help="global batch to reach with accumulation and replicas")
    p.add_argument("--replicas", type=int, default=1, help="devices the global --target-batch is split over")
    p.add_argument("--recompute", action="store_true", help="activation recomputation")
    p.add_argument("--compiler", choices=("xla", "xla-tpu", "xla-cpu", "none"), default="xla",
                   help="how the train step runs: xla (kbert's default: XLA on a GPU), xla-tpu (XLA on a TPU: fewer "
                        "activation bytes, in 128-lane tiles), xla-cpu (XLA on a CPU, which "
                        "keeps about twice the activations) or none (op by op, as TF 1.x; the coefficients behind "
                        "google-research/bert's 12 GB table)")
    p.add_argument("--exact", action="store_true",
                   help="JAX backend: compile the training step at candidate batches and read XLA's memory "
                        "analysis (nothing runs; on CPU give --memory)")
    p.add_argument("--probe", action="store_true",
                   help="measure on this accelerator: start at the --exact batch (JAX) and confirm it with real "
                        "training steps at that batch and one above")
    p.set_defaults(func=_plan)
    return parser


# Commands that start TensorFlow whenever it is installed, on every Keras backend: quickstart and pretrain feed
# tf.data; finetune and distill seed their run with keras.utils.set_random_seed, which seeds TensorFlow too when it
# can be imported (`kbert data prepare` frames its records by hand; embed, serve, ... never import it on JAX).
_TF_DATA_COMMANDS = ("quickstart", "pretrain", "finetune", "distill")


def _quiet_tensorflow_start(command: str) -> None:
    """Imports TensorFlow and enumerates its devices with file descriptor 2 pointed at /dev/null: its C++
    runtime writes 6-8 start-up lines there (oneDNN, CUDA stubs, `failed call to cuInit` on a CPU machine)
    before any log level applies, so TF_CPP_MIN_LOG_LEVEL cannot hide them. On another Keras backend only for
    `_TF_DATA_COMMANDS` (TensorFlow would start there anyway, with those lines); skipped when
    TensorFlow is already imported, or when the user asked for TensorFlow's logs (TF_CPP_MIN_LOG_LEVEL=0 or 1)."""
    if (((os.environ.get("KERAS_BACKEND") or "tensorflow") != "tensorflow" and command not in _TF_DATA_COMMANDS)
            or "tensorflow" in sys.modules or os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2") in ("0", "1")):
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    fd = sys.stderr.fileno()
    saved, devnull = os.dup(fd), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
        try:
            import tensorflow as tf

            tf.config.list_physical_devices()
        except ImportError:
            pass  # the command that needs it says what to install
    finally:
        os.dup2(saved, fd)
        os.close(saved)
        os.close(devnull)


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's preemption, `kill`), raised like Ctrl-C where no training loop catches it first."""


# what a stopped command keeps, for the commands whose work resumes (pretrain and finetune say it themselves)
_RESUMES = {"data": "the finished shards are kept: rerun the same command to resume"}


def _terminate_as_interrupt():
    """SIGTERM raises `_Terminated` in the main thread (the previous handler returned), so a command it stops
    says so and exits 143 instead of dying silently; pretrain's and finetune's own handlers take over while
    they train."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def raise_terminated(signum, frame):
        raise _Terminated()
    return signal.signal(signal.SIGTERM, raise_terminated)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command:
        _quiet_tensorflow_start(args.command)
    if args.version:
        import kbert

        print(kbert.__version__)
        return 0
    if not args.command:
        parser.print_help()
        return 0
    # `serve` drains on SIGTERM itself: uvicorn restores the handler it found, then re-raises the signal
    previous = _terminate_as_interrupt() if args.command != "serve" else None
    showwarning = warnings.showwarning
    if not os.environ.get("KBERT_DEBUG"):  # one line, as errors are, not a file:line and a source line
        warnings.showwarning = functools.partial(_show_warning, args.command)
    try:
        if getattr(args, "input", None) == "":  # `--input "$FILE"` with FILE unset read a terminal's stdin: a hang
            raise ValueError("--input is an empty path (leave the flag out to read standard input)")
        status = args.func(args)
    except BrokenPipeError:  # the reader of stdout left (`kbert predict ... | head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141  # 128 + SIGPIPE, the status a shell gives a writer whose pipe closed
    except KeyboardInterrupt as e:
        by = "SIGTERM" if isinstance(e, _Terminated) else "SIGINT"
        resume = getattr(args, "resumes", None) or _RESUMES.get(args.command, "")
        sys.stderr.write(f"kbert: stopped by {by}{'; ' + resume if resume else ''}\n")
        return _SIGNAL_EXIT[by]
    except (ValueError, TypeError, FileNotFoundError, ImportError, OSError, ArithmeticError, MemoryError) as e:
        if os.environ.get("KBERT_DEBUG"):
            raise
        sys.stderr.write(f"kbert {args.command}: error: {str(e).splitlines()[0]}\n")
        return 1
    finally:
        warnings.showwarning = showwarning
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return status if isinstance(status, int) and not isinstance(status, bool) else 0


if __name__ == "__main__":
    sys.exit(main())
