"""The records of an uncompressed torch zip archive (``torch.save``'s container), written in a stream.

Layout: local header + data per record, each record's data 64-byte aligned (or at a given phase within a page) by
padding in an extra field (id ``0x4246``); ZIP64 extra fields for records or offsets past 4 GiB; then the
``version`` and ``.data/serialization_id`` records, the central directory and its end record(s).
"""

from __future__ import annotations

import hashlib
import os
import struct

try:  # ISA-L's CRC-32 (same polynomial as zip) runs ~7x faster than zlib's here; zlib when it is missing
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover
    from zlib import crc32

from reshard.io.partial import PAGE

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
