#!/usr/bin/env bash
# Issue 40's GPU figures in one device call, for a session that is lent a GPU (15 minutes of device time in
# all, start-up and idle included, so the call must work the first time).
#
# The device image (Python 3.12, JAX with CUDA, torch, transformers: the device tool's KINDS.md) has no Keras
# and no network, so Keras and the two packages it needs that the image lacks travel as wheels in .whl/:
#
#   bash benchmarks/device.sh wheels        # here: keras (the version tested here), namex, optree -> .whl/
#   bash benchmarks/device.sh call          # here: the device tool's `run` arguments (command, carry, timeout)
#   bash benchmarks/device.sh run [ARGS]    # there: install the wheels offline, check the GPU and the imports
#                                           # (seconds, so a broken set-up fails before device time is spent),
#                                           # then `gpu.py all` with the next run's arguments; ARGS are appended,
#                                           # and a repeated option replaces the default (argparse keeps the last)
#
# Output: the tables on stdout (the tool's reply keeps the last 12,000 characters), and $OUT/gpu.log (all of
# it) and $OUT/gpu.json (every row) come back as files. Record them in benchmarks/README.md with the GPU named.
#
# Why these arguments: the three throughput variants are kbert's default step (BERT's dropouts), BERT's
# attention dropout inside cuDNN's kernel (run after gpu.py's dropout check) and the dropout-free step; HF eager
# and compiled beside them; four memory points; the 12 GB capped table at seq 128 (`--exact` and `--probe`);
# then, while the budget lasts, the ablations: kbert's code-path switches made on CPU since the last device run,
# each timed beside the default step in one process, most telling first (the one-round dropout hash against the
# two-round one, one-pass LayerNorm statistics against two-pass, Q/K/V from kernel slices with cuDNN's attention
# and without, kbert's LayerNorm against Keras'); then two memory points compiled for the GPU's description with
# no GPU beside its own bytes (`aot`), the profile and LoRA. XLA's flag sets are left out (`--xla-variants
# none`: none moved the step on the H200). `--budget 480` is the issue's 8 minutes; stages that would not finish
# inside it are skipped and said so, and the ablations keep the rows they finished.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=.whl
VARIANTS="default;attention_kernel=cudnn_dropout;dropout=0.0,attention_dropout=0.0,attention_mask=lengths"
ABLATIONS="dropout_masks=hash2;layer_norm=two_pass_stats;attention_kernel=cudnn_dropout,qkv=sliced;qkv=sliced"
ABLATIONS+=";layer_norm=keras"
GPU_ARGS=(all --budget 480 --variants "$VARIANTS" --ablations "$ABLATIONS" --cap-seqs 128 --xla-variants none)

need_wheels() {  # the three wheels `wheels` writes, or a message naming the one missing and the fix
  for name in keras namex optree; do
    if ! ls "$WHEELS"/"$name"-*.whl > /dev/null 2>&1; then
      echo "device.sh: no $name wheel in $WHEELS/: run 'bash benchmarks/device.sh wheels' here, then carry" \
           "['$WHEELS']" >&2
      exit 1
    fi
  done
}

case "${1:-}" in
  wheels)
    keras_version=$("$PY" -c "from importlib.metadata import version; print(version('keras'))")
    mkdir -p "$WHEELS"
    # the device's Python is 3.12 (KINDS.md); optree is compiled, so its wheel is per Python version and platform
    "$PY" -m pip download -q --no-deps --dest "$WHEELS" --python-version 3.12 --only-binary=:all: \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        "keras==$keras_version" namex optree
    ls -1 "$WHEELS"
    ;;
  call)
    need_wheels
    echo "run(command='bash benchmarks/device.sh run', carry=['$WHEELS'], timeout_s=600)"
    echo "(no kind named: an H100 or an H200; name the device in benchmarks/README.md from the output's first table)"
    ;;
  run)
    shift
    out=${OUT:-/tmp/kbert-gpu}
    mkdir -p "$out"
    if ! "$PY" -c "import keras" 2> /dev/null; then
      need_wheels
      "$PY" -m pip install -q --no-index --find-links "$WHEELS" keras namex optree
    fi
    export KERAS_BACKEND=jax XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
    # seconds: Keras on JAX, kbert's model code and an accelerator, before the long run
    "$PY" - << 'EOF'
import os
import sys

import jax
import keras

sys.path.insert(0, os.getcwd())
import kbert.models  # noqa: E402,F401  (this checkout's model code imports on this host)

platform = jax.devices()[0].platform
print(f"device.sh: keras {keras.__version__} on jax {jax.__version__} ({keras.backend.backend()}), "
      f"devices: {jax.devices()}", flush=True)
if platform == "cpu" and os.environ.get("KBERT_DEVICE_ALLOW_CPU") != "1":
    sys.exit("device.sh: JAX sees no accelerator here (set KBERT_DEVICE_ALLOW_CPU=1 for a dry run on a CPU)")
EOF
    "$PY" benchmarks/gpu.py "${GPU_ARGS[@]}" --out "$out" "$@" 2>&1 | tee "$out/gpu.log"
    ;;
  *)
    echo "usage: bash benchmarks/device.sh wheels | call | run [gpu.py all arguments]" >&2
    exit 2
    ;;
esac
