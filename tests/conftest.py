"""The suite's temporary files: every test writes under pytest's ``tmp_path`` (kept only for failed tests:
``tmp_path_retention_policy = "failed"``) or cleans what it makes.

What the suite's processes still put in the system temp folder (``tempfile``, multiprocessing's ``pymp-*``,
torchrun's ``torchelastic_*``, torch's caches, and every child process, which inherits ``TMPDIR``) goes to one
private folder, ``reshard-tests-*``, made at start-up; pytest's own base folder stays where it was. At the end the
session fails when more than ``TEMP_GROWTH_LIMIT`` bytes are left in the private folder (the folder is then kept
and named, to look at), and removes it otherwise (at exit, after multiprocessing's own clean-up in it). Only this
session's process tree writes there, so other processes using the system temp folder at the same time do not count.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

TEMP_GROWTH_LIMIT = 10 * 2**20
_private_temp: str | None = None
_summary: list[tuple[str, dict]] = []


def disk_usage(path: str) -> int:
    """Bytes allocated to ``path`` and all under it (as ``du``: a sparse file counts what it holds), symlinks not
    followed."""
    total = os.lstat(path).st_blocks * 512
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass  # removed while walking
    return total


def largest_entries(path: str, count: int = 5) -> list[tuple[int, str]]:
    return sorted(((disk_usage(os.path.join(path, name)), name) for name in os.listdir(path)), reverse=True)[:count]


def pytest_configure(config):
    global _private_temp
    if _private_temp is not None or hasattr(config, "workerinput"):  # an xdist worker inherits its TMPDIR
        return
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())  # pytest's basetemp stays put
    _private_temp = tempfile.mkdtemp(prefix="reshard-tests-")
    os.environ["TMPDIR"] = _private_temp
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def pytest_sessionfinish(session, exitstatus):
    global _private_temp
    if _private_temp is None:
        return
    folder, _private_temp = _private_temp, None
    left = disk_usage(folder)
    limit = f"limit {TEMP_GROWTH_LIMIT / 2**20:.0f} MiB"
    if left > TEMP_GROWTH_LIMIT:
        entries = ", ".join(f"{name} ({size / 2**20:.1f} MiB)" for size, name in largest_entries(folder))
        _summary.append((f"TEMP FOLDER GREW: the suite left {left / 2**20:.1f} MiB in the temp folder ({limit}): "
                         f"{entries}; kept in {folder}. Write under tmp_path, or remove what a test makes",
                         {"red": True, "bold": True}))
        session.exitstatus = 1
    else:
        _summary.append((f"temp folder: the session's processes left {left / 2**20:.2f} MiB outside tmp_path "
                         f"({limit}), removed", {}))
        _remove_at_exit(folder)


def pytest_terminal_summary(terminalreporter):
    for line, markup in _summary:  # the verdict of pytest_sessionfinish, which runs just before
        terminalreporter.write_line(line, **markup)


def _remove_at_exit(folder: str) -> None:
    """Remove ``folder`` once multiprocessing's exit hook (if it was imported) has removed the ``pymp-*`` folder
    this process made in it (removing that one first would make the hook fail)."""
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is None:
        shutil.rmtree(folder, ignore_errors=True)
    else:  # its pymp-* removal runs at exit priority -100; lower ones run after it
        mp_util.Finalize(None, shutil.rmtree, args=(folder,), kwargs={"ignore_errors": True}, exitpriority=-200)
