"""The `kbert` command: argument parsing only, then one library call per subcommand.

Bad arguments print one line (`kbert: error: ...`) and exit with status 2; library errors caused by
the user's input (missing files, bad configs) print one line and exit with status 1. A traceback
appears only with `KBERT_DEBUG=1`.
"""

from __future__ import annotations

import argparse
import os
import sys


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage block
        sys.stderr.write(f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
        raise SystemExit(2)


def _info(args):
    import platform

    import kbert

    print(f"kbert {kbert.__version__} on Python {platform.python_version()} ({platform.machine()})")
    try:
        import keras
        import tensorflow as tf

        print(f"tensorflow {tf.__version__}, keras {keras.__version__} (backend: {keras.backend.backend()})")
        devices = [d.device_type + ":" + d.name.split(":")[-1] for d in tf.config.list_physical_devices()]
        print("devices:", ", ".join(devices))
    except ImportError as e:
        print(f"tensorflow/keras not importable: {e}")
    from kbert.models.config import PRESETS, ModelConfig

    print("model presets:")
    for name in PRESETS:
        cfg = ModelConfig.preset(name)
        print(f"  {name:14s} L={cfg.num_layers:<3d} H={cfg.hidden_size:<5d} A={cfg.num_heads:<3d} "
              f"I={cfg.intermediate_size:<5d} E={cfg.embedding_dim:<5d} "
              f"params={cfg.num_parameters() / 1e6:6.1f}M (vocab {cfg.vocab_size})")


def _convert(args):
    import kbert

    model = kbert.load_model(args.model, with_heads=args.with_heads)
    if args.to == "kbert":
        kbert.save_model(model, args.out)
    else:
        kbert.export_transformers(model, args.out)
    print(f"wrote {args.to} model dir {args.out}")


def _tokenizer_train(args):
    from kbert.text.tokenizer import Tokenizer

    tok = Tokenizer.train(args.input, vocab_size=args.vocab_size, algorithm=args.algorithm,
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kbert", description="Korean BERT/ALBERT pretraining and embedding toolkit.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("info", help="versions, devices and model presets")
    p.set_defaults(func=_info)

    p = sub.add_parser("convert", help="convert a Hugging Face / TF1 / kbert model dir")
    p.add_argument("--model", required=True, help="input model directory (any format kbert.load_model reads)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--to", choices=("kbert", "transformers"), default="kbert", help="output format")
    p.add_argument("--with-heads", action="store_true", help="keep the pretraining heads")
    p.set_defaults(func=_convert)

    tp = sub.add_parser("tokenizer", help="train or apply a Korean subword tokenizer")
    tsub = tp.add_subparsers(dest="tokenizer_command", metavar="ACTION", parser_class=_Parser, required=True)
    p = tsub.add_parser("train", help="learn a vocabulary from text files")
    p.add_argument("--input", nargs="+", required=True, help="text files (.txt, .gz, .bz2), one sentence per line")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--algorithm", choices=("unigram", "bpe", "wordpiece"), default="unigram")
    p.add_argument("--morphemes", choices=("mecab", "kiwi", "okt", "komoran", "hannanum", "kkma", "konlpy-mecab"),
                   default=None, help="pre-split eojeols into morphemes with this analyzer")
    p.add_argument("--repeat", type=int, default=None, help="cut character runs to this length (ㅋㅋㅋㅋ -> ㅋㅋ)")
    p.add_argument("--lowercase", action="store_true")
    p.add_argument("--user-symbols", nargs="*", help="extra tokens kept whole, e.g. [URL]")
    p.add_argument("--out", required=True, help="output tokenizer directory")
    p.set_defaults(func=_tokenizer_train)
    p = tsub.add_parser("encode", help="print tokens, ids and offsets as JSON lines")
    p.add_argument("--tokenizer", required=True, help="tokenizer dir, vocab.txt or .model")
    p.add_argument("text", nargs="*", help="texts (default: one per line from stdin)")
    p.set_defaults(func=_tokenizer_encode)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        import kbert

        print(kbert.__version__)
        return 0
    if not args.command:
        parser.print_help()
        return 0
    try:
        args.func(args)
    except KeyboardInterrupt:
        sys.stderr.write("kbert: interrupted\n")
        return 130
    except (ValueError, TypeError, FileNotFoundError, ImportError, OSError) as e:
        if os.environ.get("KBERT_DEBUG"):
            raise
        sys.stderr.write(f"kbert {args.command}: error: {str(e).splitlines()[0]}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
