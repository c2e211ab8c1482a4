"""Where a model's files are, read without Keras: Hugging Face Hub names, `kbert pretrain` run dirs, kbert model
dirs and fine-tuned task dirs.

These are apart from the loaders (kbert/models/convert.py, io.py, tasks.py, which build Keras layers) so that
the paths that need no Keras backend find their model the same way: a static model (`kbert.StaticEmbedder`,
numpy only, as Model2Vec runs) and an ONNX export (ONNX Runtime) load and serve on a host with neither
TensorFlow nor JAX installed. Hub names go through `huggingface_hub`, the Hub's own client (its cache, offline
mode, revisions and tokens), rather than hand-written downloads.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Optional

CONFIG_FILE = "kbert_config.json"  # a kbert model dir's config (kbert/models/io.py writes it)
TASK_FILE = "kbert_task.json"  # a fine-tuned dir's task, labels, pooling, max_length (kbert/models/tasks.py)

# What a model needs from a Hugging Face Hub repo: configs, weights, vocabularies (not other frameworks' weights).
HUB_FILES = ["*.json", "*.safetensors", "vocab.txt", "*.model", "*.txt", "*ckpt*"]
# A model's configuration files (kbert's, Hugging Face's, Google's bert_config.json): its shape without its weights.
CONFIG_FILES = ["*.json"]
# torch.save weights, fetched only for a repo without safetensors or TF1 weights (many hold both forms, each
# hundreds of MB); shards ("pytorch_model-00001-of-00002.bin") and a sentence-transformers module's own weights
# ("1_WeightedLayerPooling/pytorch_model.bin") included.
HUB_TORCH_FILES = ["pytorch_model*.bin", "*/pytorch_model.bin"]


def is_kbert_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def resolve_hub_name(name: str, patterns: Optional[list] = None) -> str:
    """A local directory for `name`: itself when it is a path, else the snapshot of the Hugging Face Hub repo
    `name` ("klue/roberta-base") through `huggingface_hub`, the hub's own client: its cache (HF_HOME /
    HF_HUB_CACHE), its offline mode (HF_HUB_OFFLINE=1 reads the cache only), revisions and tokens. Only
    the files a model needs are fetched (HUB_FILES, then HUB_TORCH_FILES where those hold no weights), or
    those `patterns` name (`CONFIG_FILES`: what reading a model's shape needs)."""
    if os.path.exists(name) or not isinstance(name, str):
        return name
    parts = name.split("/")
    if len(parts) != 2 or not all(parts) or name.startswith((".", "~")):
        return name  # not a repo id: the caller reports the missing directory
    try:
        import huggingface_hub
    except ImportError:
        raise ImportError(f"{name!r} is not a local directory; loading it from the Hugging Face Hub needs "
                          f"huggingface_hub (pip install huggingface_hub)") from None
    try:
        if patterns is not None:
            return huggingface_hub.snapshot_download(name, allow_patterns=patterns)
        path = huggingface_hub.snapshot_download(name, allow_patterns=HUB_FILES)
        if not glob.glob(os.path.join(path, "*.safetensors")) and not glob.glob(os.path.join(path, "*ckpt*")):
            path = huggingface_hub.snapshot_download(name, allow_patterns=HUB_FILES + HUB_TORCH_FILES)
        return path
    except Exception as e:  # offline without a cached copy, an unknown repo, no network
        raise FileNotFoundError(f"{name!r} is neither a local directory nor a Hugging Face Hub model kbert could "
                                f"fetch ({type(e).__name__}: {str(e).splitlines()[0][:200]}); with HF_HUB_OFFLINE=1 "
                                f"only models already in the cache load") from None


def model_dir_of(directory: str) -> str:
    """`directory`, or its `model/` subdir when `directory` is a run dir of `kbert pretrain` / `kbert quickstart`
    (checkpoints, logs, the run's config.json and the final model in `model/`)."""
    inner = os.path.join(directory, "model")
    if os.path.isdir(directory) and not is_kbert_dir(directory) and is_kbert_dir(inner) and (
            os.path.isdir(os.path.join(directory, "checkpoints"))
            or not os.path.isfile(os.path.join(directory, "model.safetensors"))):
        return inner
    return directory


def read_task_meta(model_dir: str) -> Optional[dict]:
    """The `kbert_task.json` of a fine-tuned model dir (task, labels, max_length, ...), or None."""
    path = os.path.join(model_dir, TASK_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
