"""Writing the ``.metadata`` pickle of a DCP folder as megatron-core saves it (torch's ``Metadata``, protocol 2),
by class name: neither ``torch.distributed.checkpoint`` nor torch is imported.

Layout: ``Metadata(state_dict_metadata={key: TensorStorageMetadata(TensorProperties(dtype, ...), Size, [Chunk
StorageMetadata(offsets, sizes)]) | BytesStorageMetadata()}, planner_data=None, storage_data={MetadataIndex(fqn,
offset): _StorageInfo(relative_path, offset, length)}, storage_meta=StorageMeta(checkpoint_id, ...),
version="1.0.0")``.
"""

from __future__ import annotations

import io
import pickle

from reshard.io.torch_names import TorchGlobal
from reshard.io.torch_pickle import _Pickler, torch_dtype_global


class _New:
    """Unpickles as ``cls.__new__(cls)`` then BUILD ``state`` (what protocol 2 writes for a dataclass)."""

    def __init__(self, cls: TorchGlobal, state):
        self.cls, self.state = cls, state


class _Call:
    """Unpickles as ``func(*args)``."""

    def __init__(self, func: TorchGlobal, *args):
        self.func, self.args = func, args


class _MetadataPickler(_Pickler):
    """Writes torch's checkpoint-metadata classes by name, without importing ``torch.distributed.checkpoint``
    (over half a second) or torch itself."""

    dispatch = dict(_Pickler.dispatch)

    def _save_new(self, obj: _New) -> None:
        self.save(obj.cls)
        self.save(())
        self.write(pickle.NEWOBJ)
        self.memoize(obj)
        self.save(obj.state)
        self.write(pickle.BUILD)

    def _save_call(self, obj: _Call) -> None:
        self.save(obj.func)
        self.save(obj.args)
        self.write(pickle.REDUCE)
        self.memoize(obj)

    dispatch[_New] = _save_new
    dispatch[_Call] = _save_call


_META = "torch.distributed.checkpoint.metadata"


def _size(values) -> _Call:
    return _Call(TorchGlobal("torch", "Size"), tuple(int(v) for v in values))


def metadata_pickle(tensors: dict[str, tuple[str, tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]],
                    objects: list[str], storage: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]],
                    checkpoint_id: str) -> bytes:
    """The ``.metadata`` pickle of a DCP folder: ``tensors`` key -> (dtype, global shape, [(offsets, sizes)]),
    byte items ``objects``, ``storage`` (key, offsets or None) -> (relative path, offset, length). Unpickles as
    torch's own ``Metadata`` (planner_data None, version 1.0.0), as megatron-core writes it."""
    layout = _Call(TorchGlobal("torch.serialization", "_get_layout"), "torch.strided")
    contiguous = _Call(TorchGlobal(_META, "_MEM_FORMAT_ENCODING"), 0)
    state_dict = {}
    for key, (dtype, shape, chunks) in tensors.items():
        properties = _New(TorchGlobal(_META, "TensorProperties"),
                          (torch_dtype_global(dtype), layout, False, contiguous, False))
        state_dict[key] = _New(TorchGlobal(_META, "TensorStorageMetadata"), {
            "properties": properties, "size": _size(shape),
            "chunks": [_New(TorchGlobal(_META, "ChunkStorageMetadata"), {"offsets": _size(o), "sizes": _size(s)})
                       for o, s in chunks]})
    for key in objects:
        state_dict[key] = _New(TorchGlobal(_META, "BytesStorageMetadata"), {})
    storage_data = {}
    for (key, offsets), (path, offset, length) in storage.items():
        index = {"fqn": key, "index": None}
        if offsets is not None:
            index["offset"] = _size(offsets)
        storage_data[_New(TorchGlobal(_META, "MetadataIndex"), index)] = _New(
            TorchGlobal("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            {"relative_path": path, "offset": offset, "length": length})
    meta = _New(TorchGlobal(_META, "Metadata"), {
        "state_dict_metadata": state_dict, "planner_data": None, "storage_data": storage_data,
        "storage_meta": _New(TorchGlobal(_META, "StorageMeta"), {"checkpoint_id": checkpoint_id, "save_id": None,
                                                                 "load_id": None, "modules": []}),
        "version": "1.0.0"})
    buf = io.BytesIO()
    _MetadataPickler(buf, protocol=2).dump(meta)
    return buf.getvalue()
