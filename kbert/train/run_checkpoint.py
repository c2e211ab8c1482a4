"""Pretraining checkpoints that either backend writes and reads: a run saved under JAX resumes under
TensorFlow and the other way round.

One `ckpt-STEP.safetensors` file per checkpoint in `output_dir/checkpoints`, holding
- every model variable (weights and the dropout / sampling seed states) as `model/NNNN`, by its position in
  `model.variables` (the same model code builds them in the same order on every backend; the positions
  survive where Keras' automatic names such as `seed_generator_3` do not), with its path in the metadata so a
  mismatch is reported by name;
- the optimizer's variables as `optimizer/<slot>` by path without the optimizer's own name (the fallback that
  changes gradient accumulation adds accumulator variables, so positions would pair the wrong tensors);
  gradient accumulators are left out: they are zero between optimizer steps, where checkpoints are written;
- the step and what else the loop keeps (JSON in the safetensors metadata).

Why this format and not Orbax or `tf.train.Checkpoint`: each of those is one backend's (Orbax needs JAX arrays,
`tf.train.Checkpoint` needs TensorFlow), while the variables of a data-parallel BERT are replicated and a few
hundred MB, so one numpy file per checkpoint, written by the first process only, is all a run needs.
safetensors is already kbert's weight format (no pickle, memory-mapped reads). A checkpoint is written to a
temporary name and renamed, so a crash mid-write leaves the previous one intact; a file that cannot be read
back (a full disk, a copy cut short) is skipped for the one before it, with a warning.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

SUFFIX = ".safetensors"
_NAME = re.compile(r"^ckpt-(\d+)\.safetensors$")


def slot_key(path: str) -> str:
    """`adam_w_2/layer_0_qkv_kernel_momentum` -> `layer_0_qkv_kernel_momentum`: the optimizer's own name
    changes with every optimizer a process creates, so it is not part of the key."""
    return path.split("/", 1)[-1].replace("/", ".")


def optimizer_state(optimizer) -> Dict[str, object]:
    """The optimizer variables a checkpoint holds, by slot key (gradient accumulators left out). A wrapper's
    own variables (mixed_float16's `LossScaleOptimizer`: its iteration, learning rate, loss scale) are keyed
    `loss_scale.<name>`, apart from the wrapped optimizer's, whose keys are the plain optimizer's."""
    inner = getattr(optimizer, "inner_optimizer", None)
    wrapper = {id(v) for v in optimizer.variables} - {id(v) for v in inner.variables} if inner is not None else set()
    kept = [v for v in optimizer.variables if "gradient_accumulator" not in v.path]
    slots = {("loss_scale." if id(v) in wrapper else "") + slot_key(v.path): v for v in kept}
    if len(slots) != len(kept):
        raise AssertionError("optimizer variables do not have unique names; please report this")
    return slots


class RunCheckpoints:
    """`save(step, model, optimizer, state)`, `restore(model, optimizer)`, newest first; `to_numpy(variable)`
    reads a variable's value (the JAX backend passes one that reads a replicated array on any host) and
    `writer` says whether this process writes (the first process of a multi-host run)."""

    def __init__(self, directory: str, keep: int = 3, to_numpy: Optional[Callable] = None, writer: bool = True):
        self.directory, self.keep, self.writer = directory, max(1, int(keep)), writer
        self.to_numpy = to_numpy or (lambda v: np.asarray(v.numpy() if hasattr(v, "numpy") else v.value))

    # ------------------------------------------------------------------------------ listing
    def steps(self) -> List[int]:
        if not os.path.isdir(self.directory):
            return []
        return sorted(int(m.group(1)) for m in map(_NAME.match, os.listdir(self.directory)) if m)

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"ckpt-{step}{SUFFIX}")

    @property
    def latest(self) -> Optional[str]:
        steps = self.steps()
        return self.path(steps[-1]) if steps else None

    def check_format(self) -> None:
        """A TensorFlow-format checkpoint dir from kbert <= 0.1 cannot be resumed: say so instead of starting
        over beside it."""
        if os.path.isfile(os.path.join(self.directory, "checkpoint")) and not self.steps():
            raise ValueError(f"{self.directory!r} holds TensorFlow-format checkpoints of an older kbert; this version "
                             f"writes backend-neutral ones. Finish that run with the version that started it, or "
                             f"delete {self.directory} to start over")

    # ------------------------------------------------------------------------------ save
    def save(self, step: int, model, optimizer, state: Optional[dict] = None) -> str:
        from keras.backend import standardize_dtype

        from kbert.utils import Deferred, save_safetensors

        path = self.path(step)
        if not self.writer:
            return path

        def deferred(v):  # copied off the device as it is written: one variable at a time in host memory
            return Deferred(v.shape, standardize_dtype(v.dtype), lambda: self.to_numpy(v))

        tensors, paths = {}, []
        for i, v in enumerate(model.variables):
            tensors[f"model/{i:04d}"] = deferred(v)
            paths.append(v.path)
        for key, v in optimizer_state(optimizer).items():
            tensors[f"optimizer/{key}"] = deferred(v)
        meta = {"step": int(step), "model_paths": paths, "state": state or {}, "format": "kbert-run-1"}
        os.makedirs(self.directory, exist_ok=True)
        for name in os.listdir(self.directory):  # a killed run's half-written file (one writer: the dir's lock)
            if name.startswith("ckpt-") and name.endswith(SUFFIX + ".tmp"):
                os.remove(os.path.join(self.directory, name))
        before = self.latest
        try:
            save_safetensors(tensors, path, metadata={"kbert": json.dumps(meta, ensure_ascii=False)})
        except OSError as e:  # a full disk: say what is kept, and how the run goes on
            raise OSError(f"checkpoint of step {step} not written ({e}); "
                          + (f"the one before it, {before}, is intact: free space and run the same command again "
                             f"to resume from it" if before else "no earlier checkpoint: free space and start again")
                          ) from e
        for old in self.steps()[:-self.keep]:
            os.remove(self.path(old))
        return path

    # ------------------------------------------------------------------------------ restore
    def read(self, path: str) -> Tuple[Dict[str, np.ndarray], dict]:
        from safetensors import safe_open

        with safe_open(path, framework="numpy") as f:
            meta = json.loads((f.metadata() or {})["kbert"])
            return {k: f.get_tensor(k) for k in f.keys()}, meta

    def read_meta(self, path: str) -> dict:
        """A checkpoint's metadata (step, variable paths, state) without reading its tensors."""
        from safetensors import safe_open

        with safe_open(path, framework="numpy") as f:
            return json.loads((f.metadata() or {})["kbert"])

    def restore(self, model, optimizer, assign: Callable) -> Optional[Tuple[int, dict, str]]:
        """Loads the newest checkpoint that reads back whole into `model` and `optimizer` with
        `assign(variable, array)`; returns (step, state, path), or None when there is none."""
        bad = []
        for step in reversed(self.steps()):
            path = self.path(step)
            try:
                tensors, meta = self.read(path)
            except Exception as e:  # noqa: BLE001 - any unreadable file falls back to an older one
                bad.append(f"{path} ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})")
                continue
            self._load(tensors, meta, path, model, optimizer, assign)
            if bad:
                warnings.warn(f"resuming from {path}: newer checkpoint(s) could not be read: {'; '.join(bad)}")
            return int(meta["step"]), meta.get("state", {}), path
        if bad:
            raise ValueError(f"no checkpoint in {self.directory!r} can be read: {'; '.join(bad)}. Restore the files "
                             f"from a copy, or delete {self.directory} to start over")
        return None

    @staticmethod
    def _load(tensors, meta, path, model, optimizer, assign):
        from keras.backend import standardize_dtype

        def put(variable, value):  # seed states are uint32 on JAX and int64 on TensorFlow
            assign(variable, np.asarray(value).astype(standardize_dtype(variable.dtype), copy=False))

        variables = model.variables
        saved_paths = meta["model_paths"]
        if len(saved_paths) != len(variables):
            raise ValueError(f"{path} holds {len(saved_paths)} model variables, this model has {len(variables)}: "
                             f"the checkpoint is of another model")
        for i, v in enumerate(variables):
            value = tensors[f"model/{i:04d}"]
            if tuple(value.shape) != tuple(v.shape):
                raise ValueError(f"{path}: variable {i} ({saved_paths[i]}) has shape {value.shape}, the model's "
                                 f"{v.path} has {tuple(v.shape)}: the checkpoint is of another model")
            put(v, value)
        slots = optimizer_state(optimizer)
        missing = sorted(set(slots) - {k[len("optimizer/"):] for k in tensors if k.startswith("optimizer/")})
        if missing:
            raise ValueError(f"{path} has no optimizer state for {missing[:3]}: it was written with another optimizer")
        for key, v in slots.items():
            put(v, tensors[f"optimizer/{key}"])
