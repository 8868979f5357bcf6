"""The tensor bytes inside a DCP folder's ``*.distcp`` data files, located without unpickling any chunk.

A ``.distcp`` file is ``torch.save`` archives (uncompressed zips) laid end to end, one per chunk. A chunk's bytes are
its archive's ``.../data/0`` record, found through the archive's own central directory (the local headers carry
data descriptors, not sizes): C-contiguous, little-endian, ``prod(sizes) * itemsize`` bytes.
"""

from __future__ import annotations

import io
import math
import os
import struct
import zipfile

from reshard.errors import CheckpointError
from reshard.io import dtypes
from reshard.io.dcp_metadata import DcpChunk
from reshard.io.tensorfile import TensorFile, TensorLocation


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
