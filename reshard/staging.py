"""The output folder's life cycle: lock, stage, publish atomically, clean up.

For an output ``DST`` reshard uses, in DST's parent folder:

- ``.DST.reshard-lock``: held with ``flock`` by the run writing DST (released by the kernel if the run dies);
  a second run to the same DST is refused. Deleted when the run ends.
- ``.DST.reshard-partial-XXXXXXXX``: the staging folder. Files appear in it as ``NAME.partial`` and are renamed
  once complete and fsynced; the index / tracker file is written last; then the whole folder is fsynced and
  renamed to DST. Until that rename nothing at DST looks complete.
- The staging folder is private (``mkdtemp``'s 0700) while it is written; just before the rename it gets the mode
  a plain ``mkdir`` would give DST (0777 less the umask), as its files and subfolders already have.
- With ``--overwrite`` an existing DST stays in place until the new output is complete, then the two are
  swapped atomically (``renameat2(RENAME_EXCHANGE)``; two renames where the filesystem lacks it) and the old
  one is deleted.

Staging folders left behind by a killed run are deleted by the next run that takes the lock.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import glob
import os
import shutil
import tempfile
from contextlib import ExitStack, contextmanager

from reshard.errors import OutputError, PlanError, ReshardError, os_error_message
from reshard.pause_points import pause_point


def _sibling(dst: str, suffix: str) -> str:
    dst = os.path.abspath(dst)
    return os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.{suffix}")


def check_destination(src: str, dst: str, overwrite: bool) -> None:
    """Refuse an output that overlaps the source, or an existing non-empty one without ``overwrite``."""
    src_abs, dst_abs = os.path.realpath(src), os.path.realpath(dst)
    if dst_abs == src_abs or dst_abs.startswith(src_abs + os.sep) or src_abs.startswith(dst_abs + os.sep):
        raise PlanError(f"the output {dst} overlaps the source {src}: choose another output folder")
    if os.path.lexists(dst):
        if not os.path.isdir(dst) or os.path.islink(dst):
            raise PlanError(f"{dst} exists and is not a folder: choose another output folder")
        if os.listdir(dst) and not overwrite:
            raise PlanError(f"{dst} already exists and is not empty; pass --overwrite to replace it")
        return
    parent = os.path.dirname(os.path.abspath(dst))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise PlanError(f"{dst} is below {parent}, which is a file, not a folder: choose another output folder")


class OutputLock:
    """An exclusive ``flock`` on ``.DST.reshard-lock`` next to DST, holding the owner's pid."""

    def __init__(self, dst: str):
        self.dst = dst
        self.path = _sibling(dst, "reshard-lock")
        self.fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise ReshardError(f"another reshard run (pid {holder}) is writing {self.dst}; wait for it to "
                                   f"finish or choose another output folder") from None
            try:  # the previous holder may have deleted the file between our open and our lock: retry
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None


def remove_stale_staging(dst: str) -> list[str]:
    """Delete staging folders of earlier, killed runs (call only while holding the lock)."""
    pattern = glob.escape(_sibling(dst, "")) + "reshard-partial-*"
    stale = [p for p in glob.glob(pattern) if os.path.isdir(p) and not os.path.islink(p)]
    for path in stale:
        shutil.rmtree(path)
    return stale


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """fsync every file and folder under ``root`` (folders last), so a rename publishes durable data."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync_path(os.path.join(folder, name))
        _fsync_path(folder)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths with Linux ``renameat2(RENAME_EXCHANGE)``; False where unsupported."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def current_umask() -> int:
    """This process's umask (Linux reports it in /proc; elsewhere it is set and restored at once)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish(staging: str, dst: str) -> None:
    """Make the finished staging folder DST, with the mode a plain ``mkdir`` would give it; an existing DST is
    replaced only now, and then deleted."""
    os.chmod(staging, 0o777 & ~current_umask())
    _fsync_tree(staging)
    pause_point("publish")
    if os.path.isdir(dst) and os.listdir(dst):
        if _exchange(staging, dst):
            shutil.rmtree(staging, ignore_errors=True)  # it now holds the old output
        else:
            old = tempfile.mkdtemp(prefix=os.path.basename(_sibling(dst, "reshard-partial-old-")),
                                   dir=os.path.dirname(os.path.abspath(dst)))
            os.rmdir(old)
            os.rename(dst, old)
            os.rename(staging, dst)
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staging, dst)  # DST absent or an empty folder
    _fsync_path(os.path.dirname(os.path.abspath(dst)))


@contextmanager
def staged_output(src: str, dst: str, overwrite: bool):
    """Yield a fresh staging folder for DST; publish it if the block succeeds, delete it if not.

    OS-level failures (disk full, size limit, permissions) become :class:`OutputError` (exit code 3).
    """
    parent = os.path.dirname(os.path.abspath(dst))
    lock = OutputLock(dst)
    try:
        os.makedirs(parent, exist_ok=True)
        lock.acquire()
        try:
            check_destination(src, dst, overwrite)  # again, now that no other run can publish DST
            remove_stale_staging(dst)
            staging = tempfile.mkdtemp(prefix=os.path.basename(_sibling(dst, "reshard-partial-")), dir=parent)
            try:
                yield staging
                publish(staging, dst)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        finally:
            lock.release()
    except OSError as exc:
        raise OutputError(os_error_message(exc, f"converting {src} into {dst}")) from exc


@contextmanager
def scratch_in(files, staging: str):
    """Source files that keep a scratch folder (``scratch_in(folder)``: maxtext's unstack pass) keep it inside
    ``staging`` while the block runs; each removes it when the block ends, before the output is published."""
    with ExitStack() as stack:
        for f in files:
            if hasattr(f, "scratch_in"):
                stack.enter_context(f.scratch_in(staging))
        yield
