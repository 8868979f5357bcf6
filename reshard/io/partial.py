"""A file written as ``PATH.partial`` and renamed to ``PATH`` only once complete."""

from __future__ import annotations

import os

from reshard.io import writeback
from reshard.pause_points import pause_point

#: Page size the writers align copied tensor data to: in-kernel copies run about twice as fast when source and
#: destination offsets agree modulo a page.
PAGE = 4096


class PartialFile:
    """Opens ``path + '.partial'`` for writing; :meth:`publish` fsyncs and renames, :meth:`abort` deletes."""

    def __init__(self, path: str):
        self.path = path
        self.partial = path + ".partial"
        self._file = open(self.partial, "wb")
        self._written_back = 0  # write-out has been started for the bytes before this offset

    def tensor_written(self) -> None:
        """Start write-out of what the file holds so far, every ``writeback.CHUNK`` bytes."""
        end = self._file.tell()
        if end - self._written_back >= writeback.CHUNK:
            self._file.flush()
            writeback.start_writeback(self._file.fileno(), self._written_back, end - self._written_back)
            self._written_back = end

    def write_block(self, name: str, data: memoryview, total: int, first: bool, last: bool) -> None:
        """Write the next tensor, ``total`` bytes, in consecutive blocks: ``first`` opens it (checks the name and
        size, writes its header), ``last`` closes it. One block that is both is the whole tensor."""
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        if first:
            self._start_tensor(name, total, data if last else None)
        self._write_part(data)
        if last:
            self._end_tensor()
        self.tensor_written()

    def write_bytes(self, name: str, data: memoryview) -> None:
        """Write the next tensor straight from ``data`` (its bytes, row-major)."""
        self.write_block(name, data, data.nbytes, True, True)

    def _start_tensor(self, name: str, total: int, whole: memoryview | None) -> None:
        """Check and open the next tensor; ``whole`` is all of its bytes when it comes in one block."""
        raise NotImplementedError

    def _write_part(self, data: memoryview) -> None:
        self._file.write(data)

    def _end_tensor(self) -> None:
        raise NotImplementedError

    def publish(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        pause_point("partial")
        self._file.close()
        os.replace(self.partial, self.path)
        pause_point("file")

    def abort(self) -> None:
        """Delete the ``.partial``; never raises (closing may fail again when the disk is full)."""
        try:
            self._file.close()
        except OSError:
            pass
        try:
            os.unlink(self.partial)
        except FileNotFoundError:
            pass


def replace_with_text(path: str, text: str) -> None:
    """Write a small file (index, tracker, record) as ``PATH.partial`` and rename it over ``PATH``, so ``PATH``
    is never seen half-written. (Durability comes from the staging folder's fsync before it is published.)"""
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
