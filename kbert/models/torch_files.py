"""`pytorch_model.bin` state dicts read into numpy without torch.

Many Korean checkpoints on the Hugging Face Hub (KcBERT, KoBERT, KoELECTRA, ... uploaded in 2020-2021) ship
their weights only as `pytorch_model.bin`, a pickle written by `torch.save`. Reading one with torch means
installing torch (a multi-GB CUDA build by default) on a host that runs kbert on TensorFlow or JAX only for
that one file, so this module reads the two formats `torch.save` writes itself:

- the zip format (torch >= 1.6): `ARCHIVE/data.pkl` pickles the state dict, whose tensors reference their
  storages by a persistent id `('storage', FloatStorage, key, location, numel)`; storage `key`'s bytes are the
  zip entry `ARCHIVE/data/key`;
- the legacy format (older torch, `_use_new_zipfile_serialization=False`): a magic-number pickle, a protocol
  pickle, a system-info pickle, the state dict's pickle, a pickle of the storage keys in file order, then each
  storage as an 8-byte element count and its raw bytes.

Only what a state dict holds is unpickled: the unpickler resolves a fixed list of names (`_rebuild_tensor_v2`,
`_rebuild_parameter`, the typed storages, `OrderedDict`) and refuses every other global, so a `.bin` cannot
run code here (the same guarantee as `torch.load(weights_only=True)`). Tensors become numpy arrays of their
dtype (bfloat16 is widened to float32: numpy has no bfloat16). Safetensors files, which need none of this,
are preferred wherever a directory holds both.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
from typing import Dict

import numpy as np

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_STORAGES = {"FloatStorage": "<f4", "DoubleStorage": "<f8", "HalfStorage": "<f2", "BFloat16Storage": "bfloat16",
             "LongStorage": "<i8", "IntStorage": "<i4", "ShortStorage": "<i2", "CharStorage": "i1",
             "ByteStorage": "u1", "BoolStorage": "?"}


class _StorageType:
    def __init__(self, name: str):
        self.name = name
        self.dtype = _STORAGES[name]

    @property
    def itemsize(self) -> int:
        return 2 if self.dtype == "bfloat16" else np.dtype(self.dtype).itemsize


class _Storage:
    """A storage's elements, filled once its bytes are read (the legacy format reads them after the pickle)."""

    def __init__(self, kind: _StorageType, numel: int):
        self.kind, self.numel, self.array = kind, int(numel), None

    def fill(self, raw: bytes) -> None:
        if len(raw) != self.numel * self.kind.itemsize:
            raise ValueError(f"a {self.kind.name} of {self.numel} elements has {len(raw)} bytes; the file is truncated "
                             f"or not a torch.save file")
        if self.kind.dtype == "bfloat16":  # the high 16 bits of a float32
            self.array = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            self.array = np.frombuffer(raw, self.kind.dtype)


class _Tensor:
    """A view into a storage (offset, shape, strides in elements), materialized after every storage is read."""

    def __init__(self, storage, offset, size, stride):
        self.storage, self.offset, self.size, self.stride = storage, int(offset), tuple(size), tuple(stride)

    def numpy(self) -> np.ndarray:
        storage = self.storage if isinstance(self.storage, _Storage) else self.storage[0]
        base = 0 if isinstance(self.storage, _Storage) else self.storage[1]
        data = storage.array
        if data is None:
            raise ValueError("a tensor's storage is missing from the file (truncated or not a torch.save file)")
        if not self.size:
            return data[base + self.offset:base + self.offset + 1].reshape(()).copy()
        last = base + self.offset + sum((n - 1) * s for n, s in zip(self.size, self.stride))
        if min(self.size) > 0 and last >= data.size:
            raise ValueError("a tensor reaches past its storage (the file is truncated or not a torch.save file)")
        view = np.lib.stride_tricks.as_strided(data[base + self.offset:], self.size,
                                               [s * data.itemsize for s in self.stride], writeable=False)
        return np.array(view)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                       metadata=None):
    return _Tensor(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, *state):
    return data


def _rebuild_from_type_v2(func, new_type, args, state):  # a tensor subclass (nn.Parameter) saved by newer torch
    return func(*args)


_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch.nn.parameter", "Parameter"): "Parameter",
    ("collections", "OrderedDict"): collections.OrderedDict,
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, storage):
        super().__init__(file)
        self._storage = storage

    def find_class(self, module, name):
        if module == "torch" and name in _STORAGES:
            return _StorageType(name)
        if (module, name) in _GLOBALS:
            return _GLOBALS[(module, name)]
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a tensor state dict; kbert reads weights only "
                                     f"(convert this file with torch if you trust it)")

    def persistent_load(self, pid):
        if not isinstance(pid, tuple) or not pid or pid[0] != "storage":
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r} in a torch.save file")
        return self._storage(*pid[1:])


def _zip_state(path: str):
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        pickles = [n for n in names if n.endswith("data.pkl")]
        if not pickles:
            raise ValueError(f"{path}: a zip file without data.pkl is not a torch.save file")
        prefix = pickles[0][:-len("data.pkl")]
        if f"{prefix}byteorder" in names and archive.read(f"{prefix}byteorder").strip() != b"little":
            raise ValueError(f"{path}: big-endian torch files are not supported")
        storages = {}

        def storage(kind, key, location, numel, *view):
            if key not in storages:
                storages[key] = _Storage(kind, numel)
                storages[key].fill(archive.read(f"{prefix}data/{key}"))
            return storages[key]

        return _Unpickler(io.BytesIO(archive.read(pickles[0])), storage).load()


def _legacy_state(path: str):
    with open(path, "rb") as f:
        header = _Unpickler(f, None)
        if header.load() != _LEGACY_MAGIC:
            raise ValueError(f"{path} is not a torch.save file (neither a zip archive nor the legacy magic number)")
        header.load()  # protocol version
        info = header.load()
        if isinstance(info, dict) and not info.get("little_endian", True):
            raise ValueError(f"{path}: big-endian torch files are not supported")
        storages = {}

        def storage(kind, key, location, numel, view=None):
            if key not in storages:
                storages[key] = _Storage(kind, numel)
            if view:  # (view key, offset, size): a slice of the root storage
                return (storages[key], int(view[1]))
            return storages[key]

        state = _Unpickler(f, storage).load()
        for key in pickle.load(f):
            numel = struct.unpack("<q", f.read(8))[0]
            target = storages[key]
            target.numel = numel
            target.fill(f.read(numel * target.kind.itemsize))
    return state


def load_torch_state(path: str) -> Dict[str, np.ndarray]:
    """The tensors of a `torch.save`d state dict (`pytorch_model.bin`) as {name: numpy array}, without torch.
    Entries that are not tensors (a nested dict's metadata, ...) are left out."""
    try:
        state = _zip_state(path) if zipfile.is_zipfile(path) else _legacy_state(path)
    except (pickle.UnpicklingError, EOFError, struct.error, KeyError) as e:
        raise ValueError(f"{path}: cannot read it as a torch state dict ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict of tensors")
    if "state_dict" in state and isinstance(state["state_dict"], dict):  # a training checkpoint around one
        state = state["state_dict"]
    return {name: value.numpy() for name, value in state.items() if isinstance(value, _Tensor)}
