"""Where training runs (a tf.distribute strategy; the JAX backend maps the same names onto devices) and in
which precision, chosen in one place.

`--strategy auto` picks, in order: a TPU when one is configured (`--tpu NAME` or $TPU_NAME), a
MultiWorkerMirroredStrategy when $TF_CONFIG names a cluster, a MirroredStrategy on two or more GPUs, the
single GPU, else the CPU. `--precision auto` is bfloat16 on TPUs and on GPUs of compute capability >= 8.0,
float16 with dynamic loss scaling on older GPUs, float32 on CPUs. On a CPU with native bfloat16 dot products
(AVX512-BF16 or AMX: AMD Zen 4 and later, Intel Cooper Lake / Sapphire Rapids and later; `cpu_has_native_bf16`)
`mixed_bfloat16` trains faster (benchmarks/README.md has the comparison);
it is a choice there, not the default, since results then differ from float32 runs in the last digits.
"""

from __future__ import annotations

import json
import os
from typing import Optional

STRATEGIES = ("auto", "tpu", "mirrored", "multiworker", "cpu")
PRECISIONS = ("auto", "float32", "mixed_float16", "mixed_bfloat16")


def _tpu_strategy(tpu: Optional[str]):
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu or os.environ.get("TPU_NAME") or "")
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    return tf.distribute.TPUStrategy(resolver)


def make_strategy(name: str = "auto", tpu: Optional[str] = None):
    """A `tf.distribute.Strategy` (see the module docstring for what `auto` picks)."""
    import tensorflow as tf

    if name not in STRATEGIES:
        raise ValueError(f"`strategy` must be one of {STRATEGIES}. Received: strategy={name!r}")
    gpus = tf.config.list_logical_devices("GPU")
    if name == "tpu" or (name == "auto" and (tpu or os.environ.get("TPU_NAME"))):
        return _tpu_strategy(tpu)
    if name == "multiworker" or (name == "auto" and json.loads(os.environ.get("TF_CONFIG", "{}")).get("cluster")):
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "mirrored":
        cpus = tf.config.list_logical_devices("CPU")
        return tf.distribute.MirroredStrategy([d.name for d in (gpus or cpus)])
    if name == "auto" and len(gpus) > 1:
        return tf.distribute.MirroredStrategy()
    if name == "auto" and gpus:
        return tf.distribute.OneDeviceStrategy(gpus[0].name)
    return tf.distribute.OneDeviceStrategy("/cpu:0")


def device_kind(strategy) -> str:
    """'tpu', 'gpu' or 'cpu'."""
    import tensorflow as tf

    if isinstance(strategy, tf.distribute.TPUStrategy):
        return "tpu"
    devices = getattr(strategy.extended, "worker_devices", ()) or ()
    return "gpu" if any("GPU" in d.upper() for d in devices) or (
        not devices and tf.config.list_logical_devices("GPU")) else "cpu"


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16 among the flags in `cpuinfo`; False
    where that file is missing, e.g. on macOS)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def choose_precision(precision: str, kind: str, compute_major: int = 0) -> str:
    """The Keras dtype policy name for `precision` on devices of `kind` ('tpu', 'gpu', 'cpu'; a GPU's compute
    capability major version): what `auto` means, for either backend."""
    if precision not in PRECISIONS:
        raise ValueError(f"`precision` must be one of {PRECISIONS}. Received: precision={precision!r}")
    if precision != "auto":
        if precision == "mixed_bfloat16" and kind == "cpu" and not cpu_has_native_bf16():
            import warnings

            warnings.warn("precision=mixed_bfloat16 on a CPU without native bfloat16 instructions (AVX512-BF16 or "
                          "AMX): it is emulated there and usually slower than float32", stacklevel=3)
        return precision
    if kind == "tpu":
        return "mixed_bfloat16"
    if kind == "gpu":
        return "mixed_bfloat16" if compute_major >= 8 else "mixed_float16"
    return "float32"


def resolve_precision(precision: str, strategy) -> str:
    """The Keras dtype policy name for `precision` on this tf.distribute strategy's devices."""
    import tensorflow as tf

    kind, major = device_kind(strategy), 0
    if kind == "gpu" and precision == "auto":
        details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
        major = (details.get("compute_capability") or (0, 0))[0]
    return choose_precision(precision, kind, major)
