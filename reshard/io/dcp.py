"""torch.distributed.checkpoint (DCP) folders as Megatron-Core's ``torch_dist`` format writes them: the ``.metadata``
index, read with a restricted unpickler, and the tensor bytes inside the ``*.distcp`` data files.

``.metadata`` is a plain pickle of ``torch.distributed.checkpoint.metadata.Metadata``: per key a
``TensorStorageMetadata(properties(dtype, ...), size, chunks[(offsets, sizes)])`` or a ``BytesStorageMetadata``,
and ``storage_data[MetadataIndex(key, offsets)] = _StorageInfo(relative_path, offset, length)``. Unpickling allows
only torch's checkpoint-metadata classes, ``torch.Size``, torch dtypes and layouts, paths, and inert stand-ins for
megatron-core's own metadata classes of older files; any other global is refused by name and nothing runs.

A ``.distcp`` file is ``torch.save`` archives (uncompressed zips) laid end to end, one per chunk. A chunk's bytes are
its archive's ``.../data/0`` record, found through the archive's own central directory (the local headers carry
data descriptors, not sizes): C-contiguous, little-endian, ``prod(sizes) * itemsize`` bytes. No chunk is unpickled.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass

from reshard.errors import CheckpointError
from reshard.io import dtypes
from reshard.io.partial import PartialFile, replace_with_text
from reshard.io.regular import open_regular
from reshard.io.tensorfile import TensorFile, TensorLocation
from reshard.io.torch_format import ZipRecords, _Pickler, crc32, pickled, tensor_ref, torch_dtype_global
from reshard.io.torch_names import TorchGlobal

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


class _Slice(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file as a seekable stream (positioned reads)."""

    def __init__(self, fd: int, start: int, length: int):
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.length + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        data = os.pread(self.fd, n, self.start + self.pos) if n else b""
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


def chunk_data_offset(fd: int, where: str, chunk: DcpChunk, itemsize: int) -> int:
    """The file offset of ``chunk``'s tensor bytes: its archive's ``data/0`` record, which must be stored
    uncompressed and hold exactly ``prod(sizes) * itemsize`` bytes."""
    try:
        archive = zipfile.ZipFile(_Slice(fd, chunk.offset, chunk.length))
        records = [info for info in archive.infolist() if info.filename.endswith("/data/0")]
    except (zipfile.BadZipFile, EOFError, ValueError, OSError) as exc:
        raise CheckpointError(f"{where}: the chunk at bytes {chunk.offset}..{chunk.offset + chunk.length} is not a "
                              f"readable torch archive ({exc}); the file is truncated or corrupt") from None
    expected = math.prod(chunk.sizes) * itemsize
    if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED or records[0].file_size != expected:
        raise CheckpointError(f"{where}: the chunk at byte {chunk.offset} does not hold one uncompressed tensor of "
                              f"{expected} bytes (shape {list(chunk.sizes)})")
    record = records[0]
    header = os.pread(fd, 30, chunk.offset + record.header_offset)
    if len(header) < 30 or header[:4] != b"PK\x03\x04":
        raise CheckpointError(f"{where}: bad zip local header in the chunk at byte {chunk.offset}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    start = record.header_offset + 30 + name_len + extra_len
    if start + expected > chunk.length:
        raise CheckpointError(f"{where}: the chunk at byte {chunk.offset} ends before its tensor data does")
    return chunk.offset + start


class DistcpFile(TensorFile):
    """One ``*.distcp`` data file; ``tensors`` names the (parts of) chunks a layout asked for by :meth:`add`."""

    format = "distcp"

    def __init__(self, path: str):
        super().__init__(path, {})
        self.size = os.path.getsize(path)
        self._data: dict[int, int] = {}  # chunk offset -> file offset of its tensor bytes

    def add(self, name: str, chunk: DcpChunk, dtype: str, shape: tuple[int, ...], skip: int = 0) -> None:
        """Expose ``shape`` elements of ``chunk``, starting ``skip`` bytes into its data, as tensor ``name``."""
        if chunk.offset + chunk.length > self.size:
            raise CheckpointError(f"{self.path}: a chunk runs to byte {chunk.offset + chunk.length} but the file "
                                  f"has {self.size}: it is truncated")
        start = self._data.get(chunk.offset)
        if start is None:
            start = self._data[chunk.offset] = chunk_data_offset(self.fd, self.path, chunk, dtypes.itemsize(dtype))
        self.tensors[name] = TensorLocation(dtype=dtype, shape=shape, offset=start + skip)


# ---------------------------------------------------------------------------------------------- writing

def _align(file) -> None:
    file.write(b"\0" * (-file.tell() % 64))


class DistcpWriter(PartialFile):
    """One ``*.distcp`` file: the ready-made ``torch.save`` archives of ``objects`` (byte items such as
    ``_extra_state``) first, then one archive per tensor of ``entries`` (name, dtype, shape, saved shape), each
    starting 64-byte aligned. The saved shape is the chunk's full-rank shape (the layer axis included), pickled in
    the archive; the bytes are the tensor's. Where each archive landed goes to ``PATH.chunks.json`` (read by the
    layout's finalize to build ``.metadata``, then deleted)."""

    def __init__(self, path: str, entries: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]],
                 objects: list[tuple[str, bytes]]):
        super().__init__(path)
        self._entries = entries
        self._next = 0
        self._where: list[tuple[str, int, int]] = []
        for key, payload in objects:
            _align(self._file)
            start = self._file.tell()
            self._file.write(payload)
            self._where.append((key, start, len(payload)))

    def _begin(self, name: str, nbytes: int) -> tuple[ZipRecords, int]:
        expected, dtype, shape, saved = self._entries[self._next]
        if name != expected or nbytes != math.prod(shape) * dtypes.itemsize(dtype):
            raise AssertionError(f"distcp writer expected {expected}, got {name} ({nbytes} bytes)")
        _align(self._file)
        start = self._file.tell()
        records = ZipRecords(self._file)
        records.add("data.pkl", pickled(tensor_ref(dtype, saved)))
        records.add(".format_version", b"1")
        records.add(".storage_alignment", b"64")
        records.add("byteorder", b"little")
        return records, start

    def _end(self, name: str, records: ZipRecords, start: int) -> None:
        records.close()
        self._where.append((name, start, self._file.tell() - start))
        self._next += 1
        self.tensor_written()

    def write(self, name: str, tensor) -> None:
        self.write_bytes(name, memoryview(tensor.contiguous().reshape(-1).view(dtypes.to_torch("U8")).numpy()))

    def _start_tensor(self, name: str, total: int, whole) -> None:
        """The chunk's archive up to its data record's header (its CRC patched at the end unless whole)."""
        records, start = self._begin(name, total)
        crc = None if whole is None else crc32(whole)
        self._open = (name, records, start, crc, records.record("data/0", total, crc, page_phase=0))
        self._crc_blocks = 0

    def _write_part(self, data: memoryview) -> None:
        if self._open[3] is None:
            self._crc_blocks = crc32(data, self._crc_blocks)
        self._file.write(data)

    def _end_tensor(self) -> None:
        name, records, start, crc, crc_at = self._open
        if crc is None:
            records.patch_crc(crc_at, self._crc_blocks)
        self._end(name, records, start)

    def write_ranges(self, name: str, ranges) -> None:
        from reshard.io.copy_ranges import copy_into

        records, start = self._begin(name, ranges.nbytes)
        records.record("data/0", ranges.nbytes, ranges.crc, page_phase=ranges.page_phase or 0)
        copy_into(self._file, ranges, self.partial)
        self._end(name, records, start)

    def finish(self) -> None:
        if self._next != len(self._entries):
            raise AssertionError(f"{self.path}: {len(self._entries) - self._next} chunks were not written")
        replace_with_text(self.path + ".chunks.json", json.dumps(self._where))
        self.publish()


def written_chunks(path: str) -> list[tuple[str, int, int]]:
    """(name, offset, length) of every archive :class:`DistcpWriter` wrote into ``path``; removes the record."""
    record = path + ".chunks.json"
    with open(record) as f:
        where = [tuple(item) for item in json.load(f)]
    os.unlink(record)
    return where


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
