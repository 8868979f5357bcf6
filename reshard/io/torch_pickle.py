"""``data.pkl`` of a torch zip checkpoint as ``torch.save`` pickles it (protocol 2), written without torch.

Tensors pickle as ``torch._utils._rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict())`` of a
contiguous tensor; storages as persistent ids ``('storage', torch.<T>Storage, key, "cpu", numel)`` naming the
archive's ``data/<key>`` record; torch globals (:class:`TorchGlobal`) by module and name.
"""

from __future__ import annotations

import collections
import io
import pickle
from typing import Any

from reshard.errors import CheckpointError
from reshard.io import dtypes
from reshard.io.torch_names import STORAGE_TYPES, TorchGlobal


def torch_dtype_global(dtype: str) -> TorchGlobal:
    """``torch.<dtype>`` as written by pickle (torch dtypes pickle by name)."""
    return TorchGlobal("torch", dtypes.torch_name(dtype))


class _StorageRef:
    def __init__(self, key: str, dtype: str, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRef:
    """Pickles as torch does a contiguous tensor: ``_rebuild_tensor_v2(storage, 0, size, stride, False, {})``."""

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]):
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol):
        stride, acc = [], 1
        for n in reversed(self.shape):
            stride.append(acc)
            acc *= n
        return (TorchGlobal("torch._utils", "_rebuild_tensor_v2"),
                (self.storage, 0, tuple(self.shape), tuple(reversed(stride)), False, collections.OrderedDict()))


def _storage_type(dtype: str) -> TorchGlobal:
    try:
        return TorchGlobal("torch", STORAGE_TYPES[dtype])
    except KeyError:
        raise CheckpointError(f"dtype {dtype} cannot be written to a torch checkpoint") from None


def _save_torch_global(pickler, obj: TorchGlobal) -> None:
    pickler.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
    pickler.memoize(obj)


class _Pickler(pickle._Pickler):
    """The pure-Python pickler, taught to write :class:`TorchGlobal` by name (no torch import needed)."""

    dispatch = dict(pickle._Pickler.dispatch)
    dispatch[TorchGlobal] = _save_torch_global

    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            return ("storage", _storage_type(obj.dtype), obj.key, "cpu", obj.numel)
        return None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def pickled(obj: Any) -> bytes:
    """``obj`` pickled as torch.save's ``data.pkl`` (protocol 2; :class:`TorchGlobal` by name, storages by id)."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def tensor_ref(dtype: str, shape: tuple[int, ...]) -> "_TensorRef":
    """A contiguous ``dtype`` tensor of ``shape`` whose bytes are storage record ``data/0``, as :func:`pickled`
    writes it."""
    return _TensorRef(_StorageRef("0", dtype, _numel(shape)), tuple(shape))
