"""The safetensors format: header parsing with strict validation, and a streaming writer.

File layout: 8-byte little-endian header length N, N bytes of JSON ``{name: {dtype, shape, data_offsets}}``
(plus an optional ``__metadata__`` string map), then the data buffer; offsets are relative to the buffer start.
"""

from __future__ import annotations

import json
import math
import os
import struct

from reshard.errors import CheckpointError
from reshard.io import dtypes
from reshard.io.partial import PAGE, PartialFile
from reshard.pause_points import pause_point
from reshard.io.regular import open_regular
from reshard.io.tensorfile import TensorFile, TensorLocation

MAX_HEADER = 100 << 20


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _parse_json(raw: bytes, path: str) -> dict:
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as exc:
        raise CheckpointError(f"{path}: safetensors header names '{exc}' twice") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: invalid safetensors header JSON ({str(exc)[:120]})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    return header


def _is_count(value) -> bool:
    return type(value) is int and value >= 0


def _entry(path: str, name: str, info) -> tuple[str, tuple[int, ...], int, int]:
    """Validate one header entry's types; returns dtype, shape, begin, end."""
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: tensor '{name}' has a malformed header entry (not an object)")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise CheckpointError(f"{path}: tensor '{name}' has no dtype string in its header entry")
    if not dtypes.is_known(dtype):
        raise CheckpointError(f"{path}: tensor '{name}' has unknown dtype '{dtype[:40]}'")
    if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
        raise CheckpointError(f"{path}: tensor '{name}' has a malformed shape (needs a list of sizes >= 0)")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise CheckpointError(f"{path}: tensor '{name}' has malformed data_offsets (needs [begin, end])")
    return dtype, tuple(shape), offsets[0], offsets[1]


def read_header(path: str) -> tuple[dict[str, TensorLocation], dict[str, str]]:
    """Parse and validate a safetensors header; returns tensor locations and ``__metadata__``.

    Checked like the reference implementation: the length prefix fits the file, the JSON is an object without
    duplicate names, every entry has a known dtype, a shape of sizes and ``[begin, end]`` offsets whose span
    equals shape x dtype, and the tensors tile the data buffer exactly (no overlap, hole or trailing bytes).
    """
    with open_regular(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path}: safetensors header length {n} runs past the end of the file "
                                  f"({size} bytes): the file is truncated or not safetensors")
        raw = f.read(n)
    return parse_header(path, raw, size)


def parse_header(path: str, raw: bytes, size: int) -> tuple[dict[str, TensorLocation], dict[str, str]]:
    """Validate the JSON header ``raw`` of a ``size``-byte safetensors file named ``path`` (local or remote)."""
    n = len(raw)
    header = _parse_json(raw, path)
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: safetensors __metadata__ must map strings to strings")
    base = 8 + n
    data_size = size - base
    tensors: dict[str, TensorLocation] = {}
    spans = []
    for name, info in header.items():
        dtype, shape, begin, end = _entry(path, name, info)
        if not begin <= end <= data_size:
            raise CheckpointError(f"{path}: tensor '{name}' byte range {begin}..{end} is outside the data "
                                  f"({data_size} bytes): the file is truncated or corrupt")
        expected = math.prod(shape) * dtypes.itemsize(dtype)
        if end - begin != expected:
            raise CheckpointError(f"{path}: tensor '{name}' shape {list(shape)[:8]} x {dtype} needs {expected} "
                                  f"bytes but its byte range holds {end - begin}")
        tensors[name] = TensorLocation(dtype=dtype, shape=shape, offset=base + begin)
        spans.append((begin, end, name))
    spans.sort()
    covered, last = 0, None
    for begin, end, name in spans:
        if begin < covered:
            raise CheckpointError(f"{path}: tensors '{last}' and '{name}' overlap in the data buffer")
        if begin > covered:
            raise CheckpointError(f"{path}: bytes {covered}..{begin} of the data buffer belong to no tensor "
                                  "(a hole): the file is corrupt")
        covered, last = end, name
    if covered != data_size:
        raise CheckpointError(f"{path}: {data_size - covered} bytes after the last tensor belong to no tensor: "
                              "the file is corrupt or was appended to")
    return tensors, metadata


class SafetensorsFile(TensorFile):
    format = "safetensors"

    def __init__(self, path: str):
        tensors, self.metadata = read_header(path)
        super().__init__(path, tensors)


def layout(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None,
           data_phase: int | None = None) -> tuple[bytes, list[tuple[str, str, tuple[int, ...], int]]]:
    """The bytes before the data (length prefix and header) of a file holding ``entries`` (name, dtype, shape)
    back to back, and each entry with its size; with ``data_phase`` the header is padded (with spaces, as the
    format allows) so that the data starts at that offset within a page."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    expected = []
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * dtypes.itemsize(dtype)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        expected.append((name, dtype, tuple(shape), nbytes))
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    if data_phase is not None and data_phase % 8 == 0:
        raw += b" " * ((data_phase - 8 - len(raw)) % PAGE)
    return struct.pack("<Q", len(raw)) + raw, expected


class SafetensorsWriter(PartialFile):
    """Writes a safetensors file tensor by tensor, in the order of ``entries`` given up front.

    The header is computed from the entries (name, dtype, shape) before any data (:func:`layout`). The file is
    written as ``PATH.partial`` and renamed to ``PATH`` by :meth:`finish`.
    """

    def __init__(self, path: str, entries: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, data_phase: int | None = None):
        head, self._expected = layout(entries, metadata, data_phase)
        super().__init__(path)
        self._file.write(head)
        self._next = 0
        self._stop = len(self._expected)
        self.data_bytes = sum(e[3] for e in self._expected)

    def write(self, name: str, tensor) -> None:
        """Write the next tensor (a torch tensor)."""
        self.check_next(name, dtypes.from_torch(tensor.dtype), tuple(tensor.shape))
        self.write_bytes(name, memoryview(tensor.contiguous().reshape(-1).view(dtypes.to_torch("U8")).numpy()))

    def check_next(self, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        exp_name, exp_dtype, exp_shape, _ = self._expected[self._next]
        if name != exp_name or tuple(shape) != exp_shape or dtype != exp_dtype:
            raise AssertionError(f"writer expected {exp_name} {exp_dtype}{list(exp_shape)}, got {name} "
                                 f"{dtype}{list(shape)}")

    def _start_tensor(self, name: str, total: int, whole) -> None:
        exp_name, _, _, nbytes = self._expected[self._next]
        if name != exp_name or total != nbytes:
            raise AssertionError(f"writer expected {exp_name} ({nbytes} bytes), got {name} ({total} bytes)")

    def _end_tensor(self) -> None:
        self._next += 1

    def write_ranges(self, name: str, ranges) -> None:
        """Write the next tensor by copying source byte ranges file to file (:mod:`reshard.io.copy_ranges`)."""
        from reshard.io.copy_ranges import copy_into

        exp_name, _, _, nbytes = self._expected[self._next]
        if name != exp_name or ranges.nbytes != nbytes:
            raise AssertionError(f"writer expected {exp_name} ({nbytes} bytes), got {name} ({ranges.nbytes} bytes)")
        copy_into(self._file, ranges, self.partial)
        self._next += 1
        self.tensor_written()

    def finish(self) -> None:
        if self._next != self._stop:
            raise AssertionError(f"{self.path}: {self._stop - self._next} tensors were not written")
        self.publish()


def create_sized(path: str, entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None,
                 data_phase: int | None = None) -> None:
    """Create ``PATH.partial`` holding the header of :func:`layout` at its final size (the data a hole), for
    :class:`SafetensorsPart` s to fill; :func:`publish_sized` renames it once they all have."""
    head, expected = layout(entries, metadata, data_phase)
    with open(path + ".partial", "wb") as f:
        f.write(head)
        f.truncate(len(head) + sum(e[3] for e in expected))


def publish_sized(path: str) -> None:
    """fsync ``PATH.partial`` (the data every part wrote) and rename it to ``PATH``."""
    fd = os.open(path + ".partial", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    pause_point("partial")
    os.replace(path + ".partial", path)
    pause_point("file")


class SafetensorsPart(SafetensorsWriter):
    """Writes tensors ``start..stop`` of the safetensors file that :func:`create_sized` made (with the same
    arguments), at their final offsets; other processes write its other tensors. :meth:`finish` only closes: the
    creator publishes the file (:func:`publish_sized`), or deletes it on failure, so :meth:`abort` only closes."""

    def __init__(self, path: str, entries: list[tuple[str, str, tuple[int, ...]]], start: int, stop: int,
                 metadata: dict[str, str] | None = None, data_phase: int | None = None):
        head, self._expected = layout(entries, metadata, data_phase)
        self.path, self.partial = path, path + ".partial"
        self._file = open(self.partial, "r+b")  # no truncation: the file is shared
        at = len(head) + sum(e[3] for e in self._expected[:start])
        self._file.seek(at)
        self._written_back = at
        self._next, self._stop = start, stop
        self.data_bytes = sum(e[3] for e in self._expected)

    def publish(self) -> None:
        self._file.close()

    def abort(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass
