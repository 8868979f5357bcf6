"""Reads the structure of a torch zip checkpoint without importing torch (which takes seconds to load).

A restricted :class:`pickle.Unpickler`: ``find_class`` resolves only an allow-list (the non-torch globals of
:func:`reshard.io.torch_format.allowed_globals`, plus torch's tensor/parameter rebuild functions, storage types,
dtypes and ``torch.Size``, which become inert stand-ins), so no pickled code ever runs. Tensors come out as
:class:`LazyTensor` records (dtype, shape, stride, storage key and element offset); the byte offset of each
storage record is taken from the zip's local headers. Any other torch global raises :class:`NeedsTorch`, and
the caller falls back to ``torch.load(weights_only=True)`` with the same allow-list.
"""

from __future__ import annotations

import _compat_pickle
import collections
import pickle
import struct
import zipfile
from dataclasses import dataclass

from reshard.io.torch_names import STORAGE_DTYPES, TORCH_DTYPE_NAMES, TorchGlobal


class NeedsTorch(Exception):
    """The pickle names a torch global this reader does not model; use torch.load."""


@dataclass(frozen=True)
class LazyStorage:
    key: str
    dtype: str


@dataclass(frozen=True)
class LazyTensor:
    storage: LazyStorage
    offset: int  # in elements
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> str:
        return self.storage.dtype


class _StorageType:
    def __init__(self, dtype: str):
        self.dtype = dtype


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    return LazyTensor(storage, int(storage_offset), tuple(size), tuple(stride))


def _rebuild_parameter(data, requires_grad=False, hooks=None, state=None):
    return data


def _torch_size(values=()):
    return tuple(values)


_TORCH_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch", "Size"): _torch_size,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: dict[tuple[str, str], object]):
        import io

        super().__init__(io.BytesIO(data))
        self.allowed = allowed

    def find_class(self, module: str, name: str):
        if (module, name) in _compat_pickle.NAME_MAPPING:  # protocol-2 Python 2 names (__builtin__.bytes)
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        found = _TORCH_GLOBALS.get((module, name)) or self.allowed.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name])
        if module == "torch" and name in TORCH_DTYPE_NAMES:
            return TorchGlobal("torch", name)
        if module == "_codecs" and name == "encode":  # protocol-2 bytes: _codecs.encode(str, 'latin1')
            import codecs

            return codecs.encode
        if module.split(".")[0] == "torch":
            raise NeedsTorch(f"{module}.{name}")
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not allowed")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise NeedsTorch(f"persistent id {pid!r}")
        return LazyStorage(str(pid[2]), pid[1].dtype)


def _allowed_map(allowed: list) -> dict[tuple[str, str], object]:
    out = {}
    for item in allowed:
        obj, full = item if isinstance(item, tuple) else (item, f"{item.__module__}.{item.__qualname__}")
        module, _, name = full.rpartition(".")
        out[(module, name)] = obj
    return out


def load(path: str, allowed: list) -> tuple[object, dict[str, int]]:
    """The unpickled object (tensors as :class:`LazyTensor`) and the file offset of each storage key's bytes."""
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        pkl = next((i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"), None)
        if pkl is None:
            raise NeedsTorch("no data.pkl record")
        prefix = pkl.filename[: -len("data.pkl")]
        order = next((i for i in infos if i.filename == prefix + "byteorder"), None)
        if order is not None and zf.read(order) != b"little":
            raise NeedsTorch("big-endian checkpoint")
        structure = _Unpickler(zf.read(pkl), _allowed_map(allowed)).load()
        offsets = {}
        with open(path, "rb") as f:
            for info in infos:
                if info.filename.startswith(prefix + "data/") and info.compress_type == zipfile.ZIP_STORED:
                    f.seek(info.header_offset)
                    head = f.read(30)
                    n, m = struct.unpack("<HH", head[26:30])
                    offsets[info.filename[len(prefix) + 5:]] = info.header_offset + 30 + n + m
    return structure, offsets
