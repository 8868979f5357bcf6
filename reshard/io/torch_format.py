"""torch's zip checkpoint format (``torch.save`` since 1.6): safe lazy indexing and a streaming writer.

Layout: an uncompressed zip whose records are ``<prefix>/data.pkl`` (the pickled object, tensors as persistent
ids ``('storage', StorageType, key, location, numel)``), ``byteorder``, one ``data/<key>`` record per storage
(64-byte aligned), ``version`` and ``.data/serialization_id``.

Reading never runs pickled code: ``torch.load(weights_only=True, map_location="meta")`` with an explicit
allow-list gives the structure and, per storage, its byte offset in the file; data is then read with positioned
reads (see :mod:`reshard.io.tensorfile`).
"""

from __future__ import annotations

import argparse
import collections
import errno
import gc
import hashlib
import io
import os
import pickle
import re
import struct
import zipfile
from typing import Any

try:  # ISA-L's CRC-32 (same polynomial as zip) runs ~7x faster than zlib's here; zlib when it is missing
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover
    from zlib import crc32

from reshard.errors import CheckpointError
from reshard.io import dtypes
from reshard.io.partial import PAGE, PartialFile
from reshard.io.regular import check_regular
from reshard.io.tensorfile import TensorFile, TensorLocation
from reshard.io.torch_names import STORAGE_TYPES, TorchGlobal


class MegatronEnum:
    """Stand-in for a Megatron enum member found in a checkpoint (``args``, rerun state): keeps its value."""

    def __init__(self, value=None):
        self.value = value

    def __repr__(self):
        return f"MegatronEnum({self.value!r})"


_MEGATRON_ENUMS = (
    "megatron.core.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.AttnType",
    "megatron.core.transformer.enums.LayerType",
    "megatron.core.transformer.enums.ModelType",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
)


def _numpy_globals() -> list:
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    items: list = [
        (core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
        (core.multiarray._reconstruct, "numpy._core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
    ]
    if hasattr(core.multiarray, "scalar"):
        items += [(core.multiarray.scalar, "numpy.core.multiarray.scalar"),
                  (core.multiarray.scalar, "numpy._core.multiarray.scalar")]
    dtype_classes = getattr(np, "dtypes", None)
    if dtype_classes is not None:
        for name in dir(dtype_classes):
            obj = getattr(dtype_classes, name)
            if isinstance(obj, type) and issubclass(obj, np.dtype):
                items.append((obj, f"numpy.dtypes.{name}"))
    return items


def allowed_globals() -> list:
    """Everything a Megatron-Core / Megatron-LM or HF ``.bin`` checkpoint may name besides tensors.

    ``argparse.Namespace`` (the run's args), numpy's array/dtype reconstruction (numpy RNG state),
    ``io.BytesIO`` (Transformer Engine ``_extra_state``), ``bytes`` (protocol-2 pickles of byte strings), and
    stand-ins for Megatron enums. Nothing else.
    """
    return ([argparse.Namespace, (io.BytesIO, "_io.BytesIO"), (io.BytesIO, "io.BytesIO"), bytes]
            + _numpy_globals() + [(MegatronEnum, name) for name in _MEGATRON_ENUMS])


_UNSUPPORTED = re.compile(r"GLOBAL ([\w.]+)")


def load_structure(path: str, extra_globals: tuple = ()) -> Any:
    """Unpickle a torch zip checkpoint with ``torch.load(weights_only=True)`` and reshard's allow-list, every
    tensor on the meta device (no tensor bytes are read; each storage keeps its ``_checkpoint_offset``).
    ``extra_globals``: more ``(stand-in, "module.Name")`` pairs a layout allows for its own files (DeepSpeed's).

    This is the only unpickling reshard does: a hand-written restricted unpickler would skip torch's import
    (seconds) but is exactly the kind of code that must not be trusted with a stranger's pickle."""
    check_regular(path)
    try:
        return _torch_load_meta(path, extra_globals)
    except (zipfile.BadZipFile, EOFError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({exc})") from None


def _refuse(path: str, exc: Exception):
    found = _UNSUPPORTED.search(str(exc))
    what = f"global '{found.group(1)}'" if found else str(exc).splitlines()[0]
    raise CheckpointError(f"{path}: refusing to unpickle {what}: not on reshard's allow-list "
                          "(reshard never runs code from a checkpoint)") from None


def _import_torch():
    """``import torch`` with the cyclic garbage collector paused: the import allocates about a million objects
    and would otherwise trigger hundreds of collections (a fifth of its time)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        import torch
    finally:
        if enabled:
            gc.enable()
    return torch


def _torch_load_meta(path: str, extra_globals: tuple = ()) -> Any:
    torch = _import_torch()

    try:
        with torch.serialization.safe_globals(allowed_globals() + list(extra_globals)):
            return torch.load(path, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as exc:
        _refuse(path, exc)
    except OSError as exc:
        if exc.errno != errno.EINVAL or exc.filename:  # a real OS error (ELOOP, EACCES, EIO): exit 3 as for any
            raise
        _unreadable(path, "torch's zip reader cannot parse it")  # its bare EINVAL for a truncated archive
    except EOFError:
        _unreadable(path, "it ends early")
    except Exception as exc:  # noqa: BLE001  a truncated zip, a corrupt pickle stream, a bad storage record...
        line = (str(exc).splitlines() or [""])[0]
        _unreadable(path, re.split(r"(?<=[.!?])\s", line, maxsplit=1)[0].rstrip(".") or type(exc).__name__)


def _unreadable(path: str, reason: str):
    """Refuse ``path`` as an unreadable archive in one whole sentence: the reason (whole words) and the fix."""
    if len(reason) > 160:
        reason = reason[:160].rsplit(" ", 1)[0] + " ..."
    raise CheckpointError(f"{path}: not a readable torch checkpoint ({reason}): the file is truncated or corrupt; "
                          "copy it again from where it was saved, or save it again") from None


def _location(t, path: str, name: str) -> TensorLocation:
    storage = t.untyped_storage()
    base = getattr(storage, "_checkpoint_offset", None)
    if base is None:
        raise CheckpointError(f"{path}: cannot locate the bytes of '{name}' (needs torch >= 2.5 and a zip-format file)")
    size = t.element_size()
    dtype = dtypes.from_torch(t.dtype)
    offset = base + t.storage_offset() * size
    contiguous = t.is_contiguous()
    return TensorLocation(dtype=dtype, shape=tuple(t.shape), offset=offset,
                          strides=None if contiguous else tuple(t.stride()))


def flatten_tensors(obj: Any, path: str, prefix: str = "") -> dict[str, TensorLocation]:
    """Locations of every tensor inside nested dicts, named ``key/subkey/...``."""
    out: dict[str, TensorLocation] = {}
    if type(obj).__module__.startswith("torch") and hasattr(obj, "untyped_storage"):
        out[prefix] = _location(obj, path, prefix)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            out.update(flatten_tensors(value, path, f"{prefix}/{key}" if prefix else str(key)))
    return out


class TorchFile(TensorFile):
    """A torch zip checkpoint indexed lazily; ``structure`` is the unpickled object (meta tensors)."""

    format = "torch"

    def __init__(self, path: str):
        self.structure = load_structure(path)
        super().__init__(path, flatten_tensors(self.structure, path))


# ---------------------------------------------------------------------------------------------- writing

class TensorSlot:
    """Placeholder for a tensor in a payload to be written by :class:`TorchZipWriter`."""

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], view: tuple[int, ...] | None = None):
        self.name, self.dtype, self.shape = name, dtype, tuple(shape)
        self.view = view  # the shape the pickle records, when it differs (same bytes: CLIP's [1, 1, H] class token)


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


_ZIP64_LIMIT = 0xFFFFFFFF
_ALIGN = 64


class ZipRecords:
    """Writes the records of one uncompressed torch zip archive into ``file``, starting at the file's current
    position (offsets inside the archive are relative to it, so archives can follow each other in one file)."""

    def __init__(self, file, prefix: str = "archive/"):
        self.file, self.prefix = file, prefix
        self.base = file.tell()
        self.entries: list[tuple[str, int, int, int]] = []  # name, header offset, size, crc

    def record(self, name: str, size: int, crc: int | None, page_phase: int | None = None) -> int:
        """Write a record's local header (CRC known up front: no seeking back into written data). The data is
        64-byte aligned as torch aligns it; a tensor record starts at ``page_phase`` within a page (0 unless
        given one that keeps the 64-byte alignment), so in-kernel copies from its source run page-aligned.
        (Alignment is computed on file offsets: archives start 64-byte aligned.) ``crc`` None: not known yet
        (the data comes in blocks); :meth:`patch_crc` writes it once the data is complete. Returns the file
        offset of the header's CRC field."""
        full = (self.prefix + name).encode()
        position = self.file.tell()
        zip64 = size >= _ZIP64_LIMIT
        extra = struct.pack("<HHQQ", 0x0001, 16, size, size) if zip64 else b""
        used = position + 30 + len(full) + len(extra) + 4
        if page_phase is None:
            pad = -used % _ALIGN
        else:
            pad = ((page_phase if page_phase % _ALIGN == 0 else 0) - used) % PAGE
        extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        field = 0xFFFFFFFF if zip64 else size
        crc = (crc or 0) & 0xFFFFFFFF
        self.file.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 0, 0, 0, 0x21,
                                    crc, field, field, len(full), len(extra)) + full + extra)
        self.entries.append((name, position - self.base, size, crc))
        return position + 14  # signature, version, flags, method, time and date come before the CRC

    def patch_crc(self, where: int, crc: int) -> None:
        """Set the CRC of the last record (its header's field at file offset ``where``, and its directory entry)
        once its data, written in blocks, is complete. The file must be a real file (a ``fileno``)."""
        crc &= 0xFFFFFFFF
        self.file.flush()
        os.pwrite(self.file.fileno(), struct.pack("<I", crc), where)
        name, offset, size, _ = self.entries[-1]
        self.entries[-1] = (name, offset, size, crc)

    def add(self, name: str, data: bytes) -> None:
        self.record(name, len(data), crc32(data))
        self.file.write(data)

    def close(self) -> None:
        """The ``version`` and ``.data/serialization_id`` records, then the central directory."""
        self.add("version", b"3\n")
        # torch writes a random id; ours is derived from the records, so equal content gives equal bytes
        self.add(".data/serialization_id", hashlib.sha1(repr(self.entries).encode()).hexdigest().encode())
        start = self.file.tell() - self.base
        for name, offset, size, crc in self.entries:
            full = (self.prefix + name).encode()
            big_size = size >= _ZIP64_LIMIT
            big_off = offset >= _ZIP64_LIMIT
            values = ([size, size] if big_size else []) + ([offset] if big_off else [])
            extra = struct.pack("<HH", 0x0001, 8 * len(values)) + struct.pack(f"<{len(values)}Q", *values) \
                if values else b""
            self.file.write(struct.pack(
                "<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45 if values else 20, 0, 0, 0, 0x21, crc,
                0xFFFFFFFF if big_size else size, 0xFFFFFFFF if big_size else size, len(full), len(extra), 0, 0, 0,
                0, 0xFFFFFFFF if big_off else offset) + full + extra)
        end = self.file.tell() - self.base
        count, cd_size = len(self.entries), end - start
        if count >= 0xFFFF or start >= _ZIP64_LIMIT or cd_size >= _ZIP64_LIMIT:
            self.file.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, start))
            self.file.write(struct.pack("<IIQI", 0x07064B50, 0, end, 1))
            self.file.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF,
                                        0xFFFFFFFF, 0xFFFFFFFF, 0))
        else:
            self.file.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, cd_size, start, 0))


def pickled(obj: Any) -> bytes:
    """``obj`` pickled as torch.save's ``data.pkl`` (protocol 2; :class:`TorchGlobal` by name, storages by id)."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def tensor_ref(dtype: str, shape: tuple[int, ...]) -> "_TensorRef":
    """A contiguous ``dtype`` tensor of ``shape`` whose bytes are storage record ``data/0``, as :func:`pickled`
    writes it."""
    return _TensorRef(_StorageRef("0", dtype, _numel(shape)), tuple(shape))


def object_archive(obj: Any) -> bytes:
    """The bytes ``torch.save(obj)`` writes, for an object without tensors (e.g. ``[None]``)."""
    buf = io.BytesIO()
    records = ZipRecords(buf)
    records.add("data.pkl", pickled(obj))
    records.add("byteorder", b"little")
    records.close()
    return buf.getvalue()


class TorchZipWriter(PartialFile):
    """Writes a torch checkpoint one storage record at a time.

    ``payload`` is the object to save with :class:`TensorSlot` placeholders; ``order`` names the slots in the
    order their data will be passed to :meth:`write`. Nothing but one tensor is ever held. Output goes to
    ``PATH.partial`` and is renamed by :meth:`finish`.
    """

    def __init__(self, path: str, payload: Any, order: list[str]):
        self._order = list(order)
        self._slots: dict[str, TensorSlot] = {}
        refs = {}

        def swap(obj):
            if isinstance(obj, TensorSlot):
                self._slots[obj.name] = obj
                return refs[obj.name]
            if isinstance(obj, collections.OrderedDict):
                return collections.OrderedDict((k, swap(v)) for k, v in obj.items())
            if isinstance(obj, dict):
                return {k: swap(v) for k, v in obj.items()}
            return obj

        def collect(obj):
            if isinstance(obj, TensorSlot):
                self._slots[obj.name] = obj
            elif isinstance(obj, dict):
                for v in obj.values():
                    collect(v)

        collect(payload)
        if sorted(self._slots) != sorted(self._order):
            raise AssertionError("payload slots and write order differ")
        for i, name in enumerate(self._order):
            slot = self._slots[name]
            refs[name] = _TensorRef(_StorageRef(str(i), slot.dtype, _numel(slot.shape)), slot.view or slot.shape)
        data = pickled(swap(payload))
        super().__init__(path)
        self._records = ZipRecords(self._file)
        self._records.add("data.pkl", data)
        self._records.add("byteorder", b"little")
        self._next = 0

    def write(self, name: str, tensor) -> None:
        """Write the next tensor (a torch tensor) as its storage record."""
        self.check_next(name, dtypes.from_torch(tensor.dtype), tuple(tensor.shape))
        self.write_bytes(name, memoryview(tensor.contiguous().reshape(-1).view(dtypes.to_torch("U8")).numpy()))

    def check_next(self, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        expected = self._order[self._next]
        slot = self._slots[expected]
        if name != expected or tuple(shape) != slot.shape or dtype != slot.dtype:
            raise AssertionError(f"writer expected {expected} {slot.dtype}{list(slot.shape)}, got {name} "
                                 f"{dtype}{list(shape)}")

    def _start_tensor(self, name: str, total: int, whole) -> None:
        """The next storage record's header: with its CRC when the data comes whole, else patched at the end."""
        expected = self._order[self._next]
        slot = self._slots[expected]
        nbytes = dtypes.itemsize(slot.dtype) * _numel(slot.shape)
        if name != expected or total != nbytes:
            raise AssertionError(f"writer expected {expected} ({nbytes} bytes), got {name} ({total} bytes)")
        self._crc = None if whole is None else crc32(whole)
        self._crc_at = self._records.record(f"data/{self._next}", nbytes, self._crc, page_phase=0)
        self._crc_blocks = 0

    def _write_part(self, data: memoryview) -> None:
        if self._crc is None:
            self._crc_blocks = crc32(data, self._crc_blocks)
        self._file.write(data)

    def _end_tensor(self) -> None:
        if self._crc is None:
            self._records.patch_crc(self._crc_at, self._crc_blocks)
        self._next += 1

    def write_ranges(self, name: str, ranges) -> None:
        """Write the next storage record by copying source byte ranges file to file; ``ranges.crc`` is its CRC-32
        (the caller read the bytes once to compute it)."""
        from reshard.io.copy_ranges import copy_into

        expected = self._order[self._next]
        slot = self._slots[expected]
        nbytes = dtypes.itemsize(slot.dtype) * _numel(slot.shape)
        if name != expected or ranges.nbytes != nbytes or ranges.crc is None:
            raise AssertionError(f"writer expected {expected} ({nbytes} bytes, with a CRC), got {name}")
        self._records.record(f"data/{self._next}", nbytes, ranges.crc, page_phase=ranges.page_phase or 0)
        copy_into(self._file, ranges, self.partial)
        self._next += 1
        self.tensor_written()

    def finish(self) -> None:
        if self._next != len(self._order):
            raise AssertionError(f"{self.path}: {len(self._order) - self._next} tensors were not written")
        self._records.close()
        self.publish()
