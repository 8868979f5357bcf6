"""The suite leaves the system temp folder as it found it (within 10 MB): tests/conftest.py gives the session's
processes a private temp folder and fails the session when more than that is left in it. Here: that check itself
(in a small pytest session of its own), the retention policy, and reshard's console entry point, which leaves with
``os._exit``, removing multiprocessing's temp folder."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from checkpoints import make_hf

TESTS = Path(__file__).resolve().parent
LEAKY_TEST = """
import os, tempfile

def test_writes_to_the_temp_folder():
    folder = tempfile.mkdtemp(prefix="leak-")
    with open(os.path.join(folder, "blob"), "wb") as fh:
        fh.write(os.urandom({size}))
    {cleanup}
"""


def run_session(tmp_path: Path, size: int, cleanup: bool) -> subprocess.CompletedProcess:
    """A pytest session under tests/conftest.py whose one test writes ``size`` bytes into the temp folder."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(TESTS / "conftest.py", project / "conftest.py")
    (project / "test_leak.py").write_text(LEAKY_TEST.format(
        size=size, cleanup="__import__('shutil').rmtree(folder)" if cleanup else "pass"))
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "PYTEST_DEBUG_TEMPROOT": str(tmp_path)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "base"),
               str(project)]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=project, timeout=120)


def test_a_session_leaving_more_than_10_mb_fails_and_names_it(tmp_path):
    proc = run_session(tmp_path, 11 * 2**20, cleanup=False)
    assert proc.returncode == 1 and "1 passed" in proc.stdout, proc.stdout + proc.stderr
    found = re.search(r"TEMP FOLDER GREW: the suite left (\S+) MiB in the temp folder \(limit 10 MiB\): "
                      r"leak-\w+ \((\S+) MiB\); kept in (\S+)\.", proc.stdout)
    assert found and float(found[1]) >= 11 and float(found[2]) >= 11, proc.stdout
    [kept] = (tmp_path / "temp").iterdir()
    assert str(kept) == found[3] and kept.name.startswith("reshard-tests-")


def test_a_session_that_cleans_up_passes_and_leaves_nothing(tmp_path):
    proc = run_session(tmp_path, 2**20, cleanup=True)
    assert proc.returncode == 0 and "TEMP FOLDER" not in proc.stdout, proc.stdout + proc.stderr
    assert "temp folder: the session's processes left 0.00 MiB outside tmp_path (limit 10 MiB), removed" in \
        proc.stdout.splitlines()
    assert list((tmp_path / "temp").iterdir()) == []


def test_pytest_keeps_only_failed_tests_folders():
    options = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert options["tmp_path_retention_policy"] == "failed"


def test_no_test_or_module_names_the_system_temp_folder_itself():
    """Everything goes through tempfile / TMPDIR (which the suite redirects): no path spelt /tmp."""
    sources = [p for folder in ("reshard", "tests") for p in (TESTS.parent / folder).rglob("*.py")]
    named = [p.name for p in sources if p.name != Path(__file__).name and re.search(r"""["']/tmp\b""", p.read_text())]
    assert named == []


def test_console_entry_point_removes_multiprocessing_temp_folder(tmp_path):
    """``reshard verify --forward`` starts a forkserver, whose socket lives in a ``pymp-*`` folder that only
    multiprocessing's exit hook removes, and the console entry point leaves with ``os._exit``."""
    src = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    temp = Path(tempfile.mkdtemp(prefix="t-"))  # short: the forkserver's socket path must fit AF_UNIX's 108 bytes
    try:
        proc = subprocess.run([sys.executable, "-m", "reshard", "verify", src, src, "--forward", "--nproc", "2"],
                              capture_output=True, text=True, env={**os.environ, "TMPDIR": str(temp)}, timeout=300)
        assert proc.returncode == 0 and "FORWARD EQUAL" in proc.stdout, proc.stderr
        assert list(temp.iterdir()) == []
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def test_a_temp_folder_too_long_for_the_worker_socket_is_one_line_and_leaves_nothing(tmp_path):
    src = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    long = tmp_path / ("x" * 110)  # AF_UNIX socket paths are limited to 108 bytes
    long.mkdir()
    proc = subprocess.run([sys.executable, "-m", "reshard", "verify", src, src, "--forward", "--nproc", "2"],
                          capture_output=True, text=True, env={**os.environ, "TMPDIR": str(long)}, timeout=300)
    assert proc.returncode == 2 and "set TMPDIR to a shorter folder" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and list(long.iterdir()) == []
