"""Short-lived read-only memory maps of a byte range of a source file.

Reading through a map skips the copy from the page cache into a private buffer that ``pread`` makes: a CRC-32
or a column scatter runs straight on the cached pages. Each map covers one bounded window and is unmapped when
the ``with`` block ends, so the process's resident memory grows by at most that window (a map of the whole
file would count every page touched). Sources are checked against their file size when opened.
"""

from __future__ import annotations

import mmap
from contextlib import contextmanager
from typing import Iterator

import numpy as np

#: Largest window a caller should map at once.
WINDOW = 64 << 20


@contextmanager
def mapped(fd: int, offset: int, length: int) -> Iterator[np.ndarray]:
    """``length`` bytes of ``fd`` from ``offset`` as a read-only uint8 array, valid inside the ``with`` block."""
    if length == 0:
        yield np.empty(0, np.uint8)
        return
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    window = mmap.mmap(fd, offset + length - start, mmap.MAP_SHARED, mmap.PROT_READ, offset=start)
    try:
        yield np.frombuffer(window, np.uint8, count=length, offset=offset - start)
    finally:
        try:
            window.close()
        except BufferError:  # a view is still referenced: unmapped when the last one is collected
            pass


def crc32_of_range(fd: int, offset: int, length: int, crc: int, crc32) -> int:
    """Continue ``crc`` over ``length`` bytes of ``fd`` from ``offset``, one window at a time."""
    end = offset + length
    while offset < end:
        n = min(WINDOW, end - offset)
        with mapped(fd, offset, n) as data:
            crc = crc32(data, crc)
        offset += n
    return crc
