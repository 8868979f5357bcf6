"""Reading the ``.metadata`` index of a torch.distributed.checkpoint (DCP) folder with a restricted unpickler.

``.metadata`` is a plain pickle of ``torch.distributed.checkpoint.metadata.Metadata``: per key a
``TensorStorageMetadata(properties(dtype, ...), size, chunks[(offsets, sizes)])`` or a ``BytesStorageMetadata``,
and ``storage_data[MetadataIndex(key, offsets)] = _StorageInfo(relative_path, offset, length)``. Unpickling allows
only torch's checkpoint-metadata classes, ``torch.Size``, torch dtypes and layouts, paths, and inert stand-ins for
megatron-core's own metadata classes of older files; any other global is refused by name and nothing runs.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass

from reshard.errors import CheckpointError
from reshard.io import dtypes
from reshard.io.regular import open_regular

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": ("Metadata", "MetadataIndex", "TensorStorageMetadata",
                                              "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                              "_MEM_FORMAT_ENCODING", "StorageMeta"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.distributed.checkpoint.planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"),
    "torch.distributed._shard.sharded_tensor.metadata": ("TensorProperties", "MEM_FORMAT_ENCODING"),
}
_MCORE = "megatron.core.dist_checkpointing.strategies.torch"


class _Record:
    """An inert stand-in for one allowed metadata class (named like it): it keeps the pickled state and runs
    nothing. torch's own classes are not used: importing ``torch.distributed.checkpoint`` costs over a second."""

    def __init__(self, *args, **kwargs):  # enums pickle as Class(value)
        self.args = args

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)) \
                and isinstance(state[1], dict):  # (dict, slots) of a class with __slots__
            state = {**(state[0] or {}), **state[1]}
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:  # TensorProperties pickles as (dtype, layout, requires_grad, memory_format, pin_memory)
            self.state = state


_RECORDS: dict[str, type] = {}


def _record_class(name: str) -> type:
    if name not in _RECORDS:
        _RECORDS[name] = type(name, (_Record,), {})
    return _RECORDS[name]


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        import torch

        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return torch.serialization._get_layout
        if module in ("pathlib", "pathlib._local") and name in ("PosixPath", "PurePosixPath"):
            import pathlib

            return getattr(pathlib, name)
        if name in _METADATA_CLASSES.get(module, ()):
            return _record_class(name)
        if module == _MCORE and name in ("MCoreMetadata", "MCoreSavePlan"):  # megatron-core <= 0.15 files
            return _record_class("Metadata" if name == "MCoreMetadata" else name)
        raise CheckpointError(f"{self.where}: refusing to unpickle global '{module}.{name}': not a checkpoint "
                              "metadata class (reshard never runs code from a checkpoint)")

    def persistent_load(self, pid):
        raise CheckpointError(f"{self.where}: unexpected persistent id in checkpoint metadata")


def _kind(obj) -> str:
    return type(obj).__name__ if isinstance(obj, _Record) else ""


@dataclass(frozen=True)
class DcpChunk:
    """One stored chunk of a tensor: its global ``offsets`` and ``sizes``, and its archive's byte range."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the checkpoint folder
    offset: int
    length: int


@dataclass(frozen=True)
class DcpTensor:
    key: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]


def read_metadata(folder: str) -> tuple[dict[str, DcpTensor], list[str]]:
    """The tensors of the DCP folder ``folder`` (with their chunks) and the keys of its byte items."""
    path = os.path.join(folder, ".metadata")
    try:
        with open_regular(path, "rb") as f:
            meta = _RestrictedUnpickler(f, path).load()
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no .metadata: the distributed checkpoint is incomplete") from None
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001  truncated or corrupt pickle stream
        raise CheckpointError(f"{path}: not a readable checkpoint index ({type(exc).__name__}: "
                              f"{(str(exc).splitlines() or [''])[0][:120]})") from None
    try:
        return _index(meta, path)
    except (AttributeError, TypeError, ValueError, IndexError) as exc:
        raise CheckpointError(f"{path}: not a torch.distributed.checkpoint Metadata object ({exc})") from None


def _index(meta, path: str) -> tuple[dict[str, DcpTensor], list[str]]:
    if _kind(meta) != "Metadata" or not isinstance(getattr(meta, "state_dict_metadata", None), dict):
        raise CheckpointError(f"{path}: not a torch.distributed.checkpoint Metadata object")
    storage = {}
    for index, info in (getattr(meta, "storage_data", None) or {}).items():
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{path}: '{index.fqn}' is stored with transforms "
                                  f"({info.transform_descriptors}); reshard reads plain torch_dist data only")
        offset = getattr(index, "offset", None)
        storage[(index.fqn, tuple(offset) if offset is not None else None)] = info
    tensors, objects = {}, []
    for key, item in meta.state_dict_metadata.items():
        if _kind(item) == "BytesStorageMetadata":
            objects.append(key)
            continue
        if _kind(item) != "TensorStorageMetadata":
            raise CheckpointError(f"{path}: '{key}' has an unknown kind of metadata ({type(item).__name__})")
        properties = item.properties
        dtype = properties.dtype if hasattr(properties, "dtype") else properties.state[0]
        chunks = []
        for chunk in item.chunks:
            offsets = tuple(int(x) for x in chunk.offsets)
            info = storage.get((key, offsets))
            if info is None:
                raise CheckpointError(f"{path}: chunk {offsets} of '{key}' has no storage entry: the index is "
                                      "inconsistent")
            chunks.append(DcpChunk(offsets, tuple(int(x) for x in chunk.sizes), str(info.relative_path),
                                   int(info.offset), int(info.length)))
        tensors[key] = DcpTensor(key, dtypes.from_torch(dtype), tuple(int(x) for x in item.size), tuple(chunks))
    return tensors, objects
