"""Every file reshard reads is a regular file: a named pipe (FIFO), a device or a socket in a checkpoint file's
place would block a read forever or never end, so it is refused by name before it is opened for reading
(stdlib only)."""

from __future__ import annotations

import os
import stat

from reshard.errors import CheckpointError

_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


def _refuse_unless_regular(path: str, mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    kind = next((name for test, name in _KINDS if test(mode)), "a special file")
    raise CheckpointError(f"{path} is {kind}, not a regular file: reshard reads only regular files; put the "
                          f"real {os.path.basename(path)} there")


def check_regular(path: str) -> None:
    """Refuse ``path`` (symlinks followed) unless it is a regular file; a missing file raises FileNotFoundError."""
    _refuse_unless_regular(path, os.stat(path).st_mode)


def open_fd(path: str) -> int:
    """A read-only descriptor of regular file ``path``: checked before opening, opened without blocking (a file
    swapped for a FIFO in between cannot block), and checked again on the descriptor."""
    check_regular(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _refuse_unless_regular(path, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str, mode: str = "r"):
    """``open(path, mode)`` for reading, of a regular file only (:func:`open_fd`)."""
    return os.fdopen(open_fd(path), mode)
