"""One error type for everything a user can get wrong: a one-line message and an exit code."""

from __future__ import annotations


def one_line(text: str) -> str:
    """Escape newlines and other control characters (a hostile file's tensor names) so a message stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class ReshardError(Exception):
    """A problem with the user's input or request.

    The message is one line naming the problem and the fix; ``exit_code`` is what the CLI returns
    (2 for bad input or an impossible request, 1 for a failed verification).
    """

    exit_code = 2

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(one_line(message))
        if exit_code is not None:
            self.exit_code = exit_code


class PlanError(ReshardError):
    """The requested conversion is impossible; raised before anything is written."""


class CheckpointError(ReshardError):
    """The source checkpoint is malformed, incomplete or inconsistent."""


class MappingError(ReshardError):
    """A mapping file is malformed."""


class OutputError(ReshardError):
    """Reading or writing failed at the operating-system level (disk full, file size limit, permissions)."""

    exit_code = 3


_OS_HINTS = {
    "ENOSPC": "the disk is full: free space or choose an output folder on another filesystem",
    "EDQUOT": "the disk quota is exhausted: free space or choose an output folder on another filesystem",
    "EFBIG": "a file exceeds the size limit (ulimit -f, or the filesystem's maximum file size): raise the limit "
             "or choose an output folder on another filesystem",
    "EACCES": "permission denied: check the folder's permissions or choose another output folder",
    "EPERM": "operation not permitted: check the folder's permissions or choose another output folder",
    "EROFS": "the filesystem is read-only: choose an output folder on a writable filesystem",
    "EIO": "the storage device reported an I/O error: check the disk",
}


def os_error_message(exc: OSError, where: str | None = None) -> str:
    """One line for an OSError: the path, the system's reason, and the fix when the errno has a known one."""
    import errno

    name = errno.errorcode.get(exc.errno or 0, "")
    path = exc.filename or where or "?"
    reason = exc.strerror or str(exc)
    hint = _OS_HINTS.get(name, "check the path and the disk")
    return f"{path}: {reason}" + (f" [{name}]" if name else "") + f"; {hint}"
