"""Inference forward pass over long inputs on a CPU: kbert's encoder beside transformers' `BertModel` (torch,
SDPA attention) on the same shapes and weights, in one run.

kbert's attention on Keras' JAX backend with one CPU device runs a few batch rows at a time in a loop
(`kbert.models.layers.ATTENTION_ROWS_PER_STEP`); `--rows 1,2,4,8` times each setting, and the `fused` row is
the single `ops.dot_product_attention` call over the whole batch (kbert's CPU path before). On TensorFlow the
einsum form runs (its oneDNN kernels are not memory-bound the same way), so only `auto` is timed there.
Padded batches: a quarter of the rows are half padding, as bucketed batches of real text are.

    KERAS_BACKEND=jax python benchmarks/attention.py --presets bert-mini,bert-small --lengths 128,384,512
    KERAS_BACKEND=tensorflow python benchmarks/attention.py ...
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from embed import timed  # noqa: E402  (best-of-N timing)


def batch(rows: int, length: int, vocab_size: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, vocab_size, (rows, length)).astype("int32")
    mask = np.ones((rows, length), "int32")
    mask[: rows // 4, length // 2:] = 0
    return {"token_ids": ids * mask, "segment_ids": np.zeros_like(ids), "padding_mask": mask}


def torch_side(network, config, feats: dict, threads: int):
    """transformers' BertModel (SDPA) holding the kbert network's weights (kbert.export_transformers)."""
    import tempfile

    import torch
    import transformers

    import kbert

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()  # the dropped pooler's load report
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        kbert.export_transformers(network, tmp)
        model = transformers.BertModel.from_pretrained(tmp, add_pooling_layer=False).eval()
    model.set_attn_implementation("sdpa")
    args = {"input_ids": torch.tensor(feats["token_ids"], dtype=torch.long),
            "token_type_ids": torch.tensor(feats["segment_ids"], dtype=torch.long),
            "attention_mask": torch.tensor(feats["padding_mask"], dtype=torch.long)}

    def run():
        with torch.inference_mode():
            return model(**args).last_hidden_state.numpy()

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="bert-mini,bert-small")
    parser.add_argument("--lengths", default="128,384,512")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rows", default="2", help="ATTENTION_ROWS_PER_STEP settings to time (JAX)")
    parser.add_argument("--repeats", type=int, default=3, help="best of N timed passes per side")
    args = parser.parse_args()

    import keras

    import kbert
    from kbert.compiled import compiled, signature
    from kbert.models import layers

    backend = keras.backend.backend()
    threads = os.cpu_count() or 1
    print(f"backend {backend}, {threads} CPU threads, batch {args.batch_size}, best of {args.repeats}")
    print(f"{'preset':<11} {'seq':>4} {'kbert setting':<14} {'ms':>8} {'torch ms':>9} {'vs torch':>9} {'max diff':>9}")
    for preset in args.presets.split(","):
        for length in (int(n) for n in args.lengths.split(",")):
            config = kbert.ModelConfig.preset(preset, vocab_size=8000, max_position=max(512, length))
            keras.utils.set_random_seed(0)
            network = kbert.build_backbone(config)
            feats = batch(args.batch_size, length, config.vocab_size)
            reference = torch_side(network, config, feats, threads)
            reference()  # warm-up
            torch_s, want = timed(reference, args.repeats)
            keep = feats["padding_mask"].astype(bool)
            settings = [("fused", None)] + [(f"rows={r}", int(r)) for r in args.rows.split(",")]
            for name, rows in settings if backend == "jax" else [("auto", None)]:
                before = layers.ATTENTION_ROWS_PER_STEP
                if rows is not None:
                    layers.ATTENTION_ROWS_PER_STEP = rows
                with layers.implementation(attention="fused" if name == "fused" else "auto"):
                    fn = compiled(lambda x: network(x, training=False)["sequence_output"], network.variables,
                                  signature({"token_ids": 2, "segment_ids": 2, "padding_mask": 2}))
                    fn(feats)  # compile
                    seconds, got = timed(lambda: fn(feats), args.repeats)
                layers.ATTENTION_ROWS_PER_STEP = before
                diff = float(np.abs(got[keep] - want[keep]).max())
                print(f"{preset:<11} {length:>4} {name:<14} {seconds * 1e3:>8.1f} {torch_s * 1e3:>9.1f} "
                      f"{torch_s / seconds:>8.2f}x {diff:>9.1e}", flush=True)


if __name__ == "__main__":
    main()
