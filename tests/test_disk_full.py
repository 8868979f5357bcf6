"""A full disk or a file size limit while writing: exit code 3 with one line naming the path and the fix, no
``.partial`` file, staging folder or lock left next to DST, DST absent, the source unchanged byte for byte."""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import sys

import pytest

import reshard.io.partial
from checkpoints import make_hf
from cli_inprocess import run_main
from tree_snapshot import leftovers, snapshot


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_hf(tmp_path_factory.mktemp("diskfull") / "hf", hidden=256, heads=8, kv_heads=4, ffn=512,
                   vocab=500, layers=2)


def _file_size_limit(limit):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed by the signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.parametrize("limit", [4096, 1536 << 10], ids=["in-header", "mid-tensor"])
def test_file_size_limit_in_a_subprocess(src, tmp_path, limit):
    dst = tmp_path / "out" / "meg"
    before = snapshot(src)
    proc = subprocess.run([sys.executable, "-m", "reshard", "convert", src, dst, "--to", "megatron", "--tp", "2"],
                          capture_output=True, text=True, env={**os.environ, "RESHARD_DEBUG": "0"},
                          preexec_fn=_file_size_limit(limit), timeout=300)
    assert proc.returncode == 3, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert "[EFBIG]" in lines[0] and "size limit" in lines[0] and str(dst) in lines[0], lines[0]
    assert not dst.exists()
    assert leftovers(tmp_path) == []
    assert snapshot(src) == before


class _FillingFile:
    """A real file whose writes fail with ENOSPC once ``budget`` bytes have been written."""

    def __init__(self, f, budget):
        self._f, self._budget = f, budget

    def write(self, data):
        n = memoryview(data).nbytes
        if n > self._budget:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._budget -= n
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


@pytest.mark.parametrize("to, budget", [("megatron", 300_000), ("hf", 300_000), ("megatron", 10)])
def test_disk_full(src, tmp_path, monkeypatch, to, budget):
    state = {"budget": budget}

    def filling_open(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        if "w" not in mode:
            return f
        wrapped = _FillingFile(f, state["budget"])
        state["budget"] = 0 if budget < 1000 else state["budget"]  # tiny budget: the disk stays full
        return wrapped

    monkeypatch.setattr(reshard.io.partial, "open", filling_open, raising=False)
    dst = tmp_path / "out"
    before = snapshot(src)
    args = ["--tp", "2"] if to == "megatron" else ["--max-shard-size", "1MB"]
    if to == "hf":  # a Megatron source this time, so both writers are exercised
        monkeypatch.undo()
        reshard.convert(src, str(tmp_path / "meg"), to="megatron", tp=2)
        monkeypatch.setattr(reshard.io.partial, "open", filling_open, raising=False)
        src = str(tmp_path / "meg")
        before = snapshot(src)
    proc = run_main("convert", src, dst, "--to", to, *args)
    assert proc.returncode == 3, proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and "[ENOSPC]" in line and "disk is full" in line and str(dst) in line, line
    assert not dst.exists() and leftovers(tmp_path) == []
    assert snapshot(src) == before


def test_exit_codes_are_documented():
    from pathlib import Path

    help_text = run_main("--help").stdout
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    for code, words in (("0", "ok"), ("1", "verification"), ("2", "bad input"), ("3", "I/O error"),
                        ("130", "interrupted")):
        assert f"{code} {words}" in " ".join(help_text.split()), (code, help_text)
        assert f"| {code} |" in readme
