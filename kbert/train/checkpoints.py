"""The whole state of an interrupted fine-tuning run, so that the same call resumes it exactly.

One checkpoint file holds every network variable (dropout seeds included), the optimizer's variables and
the loop's bookkeeping plus the settings the run was made with, so a restart with other settings is refused
by name instead of silently mixing two runs. It is pretraining's backend-neutral format
(`kbert.train.run_checkpoint`: safetensors, written to a temporary name and renamed, the newest kept), so a
run stopped on one Keras backend resumes on the other.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Optional

import numpy as np

from kbert.train.run_checkpoint import RunCheckpoints

CHECKPOINT_DIR = "checkpoints"  # under the fine-tuning run's out_dir


def data_fingerprint(*examples) -> str:
    """A digest of encoded examples (`kbert.train.finetune_tasks.Examples`, or None): a resumed run must see
    the same data."""
    h = hashlib.sha1()
    examples = [part for ex in examples for part in (getattr(ex, "parts", None) or [ex])]
    for ex in examples:
        if ex is None:
            h.update(b"none")
            continue
        for lists in (ex.token_ids, ex.pair_token_ids or [], getattr(ex, "negative_token_ids", None) or []):
            h.update(np.asarray([len(x) for x in lists], np.int64).tobytes())
            h.update(np.concatenate([np.asarray(x, np.int64) for x in lists] or [np.zeros(0, np.int64)]).tobytes())
        if ex.labels is not None:
            labels = ex.labels if isinstance(ex.labels, np.ndarray) else np.concatenate(
                [np.asarray(x, np.float64) for x in ex.labels] or [np.zeros(0)])
            h.update(np.asarray(labels, np.float64).tobytes())
    return h.hexdigest()


class FinetuneCheckpoint:
    """Save / restore / remove the run state under `directory` (`out_dir/checkpoints`)."""

    def __init__(self, directory: str, network, optimizer, settings: dict, resume: bool):
        self.directory, self.settings = directory, json.loads(json.dumps(settings, default=str))
        if not resume and os.path.isdir(directory):
            shutil.rmtree(directory)
        self.network, self.optimizer = network, optimizer
        self.store = RunCheckpoints(directory, keep=1)

    @property
    def path(self) -> Optional[str]:
        return self.store.latest

    def restore(self) -> Optional[dict]:
        """The saved bookkeeping (with "step"), the variables restored; None when there is no checkpoint."""
        self.store.check_format()
        latest = self.store.latest
        try:  # settings first: other settings (LoRA, a head) can mean other variables, which would fail to load
            early = self.store.read_meta(latest).get("state") if latest else None
        except Exception:  # noqa: BLE001 - an unreadable newest file: `restore` falls back to an older one
            early = None
        if early:
            self._check_settings(early)
        restored = self.store.restore(self.network, self.optimizer, lambda v, value: v.assign(value))
        if restored is None:
            return None
        saved = restored[1]
        self._check_settings(saved)
        return saved

    def _check_settings(self, saved: dict) -> None:
        differ = sorted(k for k in set(saved["settings"]) | set(self.settings)
                        if saved["settings"].get(k) != self.settings.get(k))
        if differ:
            shown = ", ".join(f"{k}: {saved['settings'].get(k)!r} -> {self.settings.get(k)!r}" for k in differ)
            raise ValueError(f"{self.directory!r} holds an interrupted fine-tuning run (step {saved['step']}) with "
                             f"other settings ({shown}); rerun with its settings to resume it, pass resume=False "
                             f"(CLI: --no-resume) to start over, or choose another out_dir")

    def save(self, step: int, bookkeeping: dict) -> None:
        state = json.loads(json.dumps({"settings": self.settings, "step": step, **bookkeeping}, default=float))
        self.store.save(step, self.network, self.optimizer, state)

    def remove(self) -> None:
        if os.path.isdir(self.directory):
            shutil.rmtree(self.directory)
