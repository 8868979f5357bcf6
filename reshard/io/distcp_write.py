"""Writing one ``*.distcp`` data file of a DCP folder: byte items' ready-made archives, then one ``torch.save``
archive per tensor chunk (``data.pkl``, ``.format_version``, ``.storage_alignment``, ``byteorder``, ``data/0``),
each 64-byte aligned, with where each landed recorded in ``PATH.chunks.json`` for the ``.metadata`` writer.
"""

from __future__ import annotations

import json
import math
import os

from reshard.io import dtypes
from reshard.io.partial import PartialFile, replace_with_text
from reshard.io.torch_pickle import pickled, tensor_ref
from reshard.io.torch_zip import ZipRecords, crc32


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
