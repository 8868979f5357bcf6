"""--workers N: the output bytes do not depend on the worker count, and a worker's failure fails the run."""

from __future__ import annotations

import os

import pytest
import torch

import reshard
from reshard.errors import OutputError, ReshardError
from tests.checkpoints import load_hf_tensors, make_hf


def tree_bytes(root) -> dict[str, bytes]:
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory):
    return make_hf(tmp_path_factory.mktemp("src") / "hf", shards=2, dtype=torch.bfloat16, vocab=1003)


def test_workers_give_identical_bytes(hf_source, tmp_path):
    meg = {}
    for workers in (1, 2, 3):
        out = tmp_path / f"meg-w{workers}"
        reshard.convert(hf_source, str(out), to="megatron", tp=2, pp=2, workers=workers)
        meg[workers] = tree_bytes(out)
    assert len(meg[1]) >= 5  # 4 rank files and the tracker
    assert meg[2] == meg[1] and meg[3] == meg[1]
    back = {}
    for workers in (1, 2):
        out = tmp_path / f"hf-w{workers}"
        reshard.convert(str(tmp_path / "meg-w1"), str(out), to="hf", max_shard_size=20_000, workers=workers)
        back[workers] = tree_bytes(out)
    assert sum(name.endswith(".safetensors") for name in back[1]) >= 2
    assert back[2] == back[1]
    original, converted = load_hf_tensors(hf_source), load_hf_tensors(tmp_path / "hf-w2")
    assert original.keys() == converted.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor.view(torch.int16), converted[name].view(torch.int16)), name


def test_worker_failure_fails_the_run(hf_source, tmp_path, monkeypatch):
    from reshard.io.partial import PartialFile

    def broken(self, name, data, total, first, last):
        raise OSError(28, "No space left on device", self.partial)

    monkeypatch.setattr(PartialFile, "write_block", broken)  # every writer's path for tensors through memory
    out = tmp_path / "out"
    with pytest.raises(OutputError, match=r"No space left on device \[ENOSPC\]") as info:
        reshard.convert(hf_source, str(out), to="megatron", tp=2, pp=2, workers=2)
    assert info.value.exit_code == 3
    assert not out.exists()
    assert not [p for p in os.listdir(tmp_path) if "reshard-partial" in p]


def test_workers_must_be_positive(hf_source, tmp_path):
    with pytest.raises(ReshardError, match="workers must be a whole number of at least 1"):
        reshard.convert(hf_source, str(tmp_path / "o"), to="megatron", tp=2, workers=0)


def test_conversion_does_not_import_torch(hf_source, tmp_path):
    """torch takes seconds to import: writing without a cast runs on numpy and positioned I/O alone (reading a
    Megatron .pt source does import torch: its pickle is only ever opened with torch.load(weights_only=True))."""
    import subprocess
    import sys

    code = ("import sys, reshard; reshard.convert(sys.argv[1], sys.argv[2], to='megatron', tp=2); "
            "reshard.convert(sys.argv[1], sys.argv[3], to='vllm', tp=2); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, hf_source, str(tmp_path / "m"), str(tmp_path / "h")],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_copy_fallback_without_copy_file_range_is_byte_identical(hf_source, tmp_path, monkeypatch):
    """Where copy_file_range is missing or refused (EXDEV across filesystems), ranges are copied with pread/pwrite:
    the same bytes either way."""
    import errno

    for to, kw in (("megatron", dict(tp=2, pp=2)), ("vllm", dict(tp=2))):
        reshard.convert(hf_source, str(tmp_path / f"{to}-cfr"), to=to, **kw)

    def refuse(*args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    for to, kw in (("megatron", dict(tp=2, pp=2)), ("vllm", dict(tp=2))):
        reshard.convert(hf_source, str(tmp_path / f"{to}-rw"), to=to, **kw)
        assert tree_bytes(tmp_path / f"{to}-rw") == tree_bytes(tmp_path / f"{to}-cfr")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="auto workers needs 2 cores")
def test_cli_default_forks_two_workers_for_a_large_multi_file_output(hf_source, tmp_path, monkeypatch, capsys):
    """The command line's default --workers: 2 processes once the output is large (here: the threshold lowered),
    with the bytes of a single process; small outputs stay in one process."""
    from reshard import conversion, workers
    from tests.helpers import run_cli

    reshard.convert(hf_source, str(tmp_path / "one"), to="megatron", tp=2, pp=2, workers=1)
    forks: list[int] = []
    real = workers.run_in_workers

    def counting(shares, *args, **kwargs):
        forks.append(len(shares))
        return real(shares, *args, **kwargs)

    monkeypatch.setattr(workers, "run_in_workers", counting)
    code, _, err = run_cli(capsys, "convert", hf_source, str(tmp_path / "small"), "--to", "megatron", "--tp", "2",
                           "--pp", "2")
    assert code == 0, err
    assert forks == []  # under AUTO_WORKERS_MIN_BYTES: one process
    monkeypatch.setattr(conversion, "AUTO_WORKERS_MIN_BYTES", 0)
    code, _, err = run_cli(capsys, "convert", hf_source, str(tmp_path / "auto"), "--to", "megatron", "--tp", "2",
                           "--pp", "2")
    assert code == 0, err
    assert forks == [2]
    assert tree_bytes(tmp_path / "auto") == tree_bytes(tmp_path / "one") == tree_bytes(tmp_path / "small")
