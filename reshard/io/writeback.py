"""Starts the kernel writing a file's dirty pages while the converter is still working (``sync_file_range``).

Without it, written data waits in the page cache until the final fsync, so the disk idles while the converter
computes and then only writes (which is what ``cp`` + ``sync`` does). Starting write-out of every finished
stretch lets the writes proceed alongside. A hint only: durability still comes from the fsync before a file is
published.
"""

from __future__ import annotations

import ctypes
import os

#: Bytes a file accumulates before write-out of them is started.
CHUNK = 4 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range():
    if not hasattr(os, "uname") or os.uname().sysname != "Linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range  # libc's, already loaded (find_library would run
        # ldconfig in a subprocess)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Initiate (not wait for) write-out of ``[offset, offset + length)`` of ``fd``; a no-op where unsupported."""
    if _sync_file_range is not None and length > 0:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # a failure only loses the hint
