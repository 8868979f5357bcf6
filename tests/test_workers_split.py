"""--workers N with fewer target files than workers: a safetensors file is cut into tensor ranges written by
several processes into one file, and the output bytes do not depend on N; zip (.pt) targets are never cut."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys

import pytest
import torch

import reshard
from checkpoints import hf_config, hf_tensor_shapes, load_hf_tensors, make_hf
from reshard import workers as workers_module
from reshard.io.partition import Piece

WORKER_COUNTS = (1, 2, 3, 5)
SHAPE = dict(hidden=128, heads=8, kv_heads=4, ffn=256, vocab=1000, layers=3)  # every tensor <= 2**17 elements


def digests(root) -> dict[str, str]:
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    hf = make_hf(root / "hf", shards=2, **SHAPE)
    for tp in (2, 4):
        reshard.convert(hf, str(root / f"meg{tp}"), to="megatron", tp=tp)
    return {"hf": hf, "meg2": str(root / "meg2"), "meg4": str(root / "meg4")}


@pytest.fixture
def forks(monkeypatch):
    """The shares every run_in_workers call got."""
    seen: list[list] = []
    real = workers_module.run_in_workers

    def recording(shares, *args, **kwargs):
        seen.append(shares)
        return real(shares, *args, **kwargs)

    monkeypatch.setattr(workers_module, "run_in_workers", recording)
    return seen


def pieces(shares) -> list[Piece]:
    return [u for share in shares for u in share if isinstance(u, Piece)]


def model_bytes(dtype_size: int = 4) -> int:
    return sum(torch.Size(s).numel() for s in hf_tensor_shapes(hf_config(**SHAPE)).values()) * dtype_size


def convert_each(src, tmp_path, forks, name, most=None, **kwargs) -> dict[int, dict[str, str]]:
    """The digests of the output at each worker count; checks that ``min(workers, most)`` processes wrote it
    (``most`` None: as many as workers, however few the files)."""
    out = {}
    for workers in WORKER_COUNTS:
        forks.clear()
        reshard.convert(src, str(tmp_path / f"{name}-w{workers}"), workers=workers, **kwargs)
        out[workers] = digests(tmp_path / f"{name}-w{workers}")
        if workers > 1:
            assert [len(s) for s in forks] == [min(workers, most or workers)]
    return out


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("files", [1, 2])
def test_megatron_to_hf_bytes_do_not_depend_on_workers(sources, tmp_path, forks, tp, files):
    shard = None if files == 1 else int(model_bytes() * 0.6)
    runs = convert_each(sources[f"meg{tp}"], tmp_path, forks, "hf", to="hf", max_shard_size=shard)
    assert sum(name.endswith(".safetensors") for name in runs[1]) == files
    for workers in WORKER_COUNTS[1:]:
        assert runs[workers] == runs[1], workers
    original, converted = load_hf_tensors(sources["hf"]), load_hf_tensors(tmp_path / "hf-w5")
    assert original.keys() == converted.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor.view(torch.int32), converted[name].view(torch.int32)), name


def test_pieces_are_cut_from_one_file(sources, tmp_path, forks):
    reshard.convert(sources["meg2"], str(tmp_path / "out"), to="hf", workers=3)
    (shares,) = forks
    cut = pieces(shares)
    assert len(cut) == 3 and {p.file for p in cut} == {0}
    assert sorted((p.start, p.stop) for p in cut)[0][0] == 0


def test_cast_in_row_blocks_and_read_write_copies_split(sources, tmp_path, forks, monkeypatch):
    """hf -> hf bf16: every tensor built through torch in small row blocks, each piece's blocks written in order;
    then megatron -> hf with copy_file_range refused (pread/pwrite at the piece's offsets)."""
    from reshard import execute

    monkeypatch.setattr(execute, "STEP_BYTES", 8192)
    monkeypatch.setattr(execute, "TORCH_BYTES", 4096)
    runs = convert_each(sources["hf"], tmp_path, forks, "bf16", to="hf", dtype="bf16")
    for workers in WORKER_COUNTS[1:]:
        assert runs[workers] == runs[1], workers
    original, converted = load_hf_tensors(sources["hf"]), load_hf_tensors(tmp_path / "bf16-w3")
    for name, tensor in original.items():
        assert torch.equal(tensor.to(torch.bfloat16).view(torch.int16), converted[name].view(torch.int16)), name
    monkeypatch.undo()

    def refuse(*args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    reshard.convert(sources["meg2"], str(tmp_path / "cfr"), to="hf", workers=3)
    monkeypatch.setattr(os, "copy_file_range", refuse)
    reshard.convert(sources["meg2"], str(tmp_path / "rw"), to="hf", workers=3)
    assert digests(tmp_path / "rw") == digests(tmp_path / "cfr")


def test_zip_targets_are_split_by_file_only(sources, tmp_path, forks):
    runs = convert_each(sources["hf"], tmp_path, forks, "meg", most=2, to="megatron", tp=2)
    assert sum(name.endswith(".pt") for name in runs[1]) == 2
    for workers in WORKER_COUNTS[1:]:
        assert runs[workers] == runs[1], workers
    forks.clear()
    reshard.convert(sources["hf"], str(tmp_path / "meg1"), to="megatron", tp=1, workers=3)
    assert forks == []  # one .pt file: one process, never cut


def test_partition_is_deterministic_and_covers_every_tensor_once(sources):
    from reshard.conversion import make_plan
    from reshard.execute import partition
    from reshard.layouts import open_checkpoint
    from reshard.layouts.base import Options

    for parts in (2, 3, 5, 7):
        shares = []
        for _ in range(2):
            with open_checkpoint(sources["meg4"], Options()) as source:
                plan, _ = make_plan(source, "hf", Options())
                shares.append(partition(plan, source.files, parts, split_files=True))
                assert partition(plan, source.files, parts) == [[[0]]]  # by file (torchrun): never cut
        assert shares[0] == shares[1]
        (target,) = plan.files
        covered = sorted(i for p in pieces(shares[0]) for i in range(p.start, p.stop))
        assert covered == list(range(len(target.tensors)))
        loads = [sum(t.nbytes for p in share for t in target.tensors[p.start:p.stop]) for share in shares[0]]
        biggest = max(t.nbytes for t in target.tensors)
        assert len(loads) == parts and max(loads) <= target.nbytes / parts + biggest, loads


def test_worker_failure_leaves_nothing(sources, tmp_path, monkeypatch):
    from reshard.errors import OutputError
    from reshard.io.partial import PartialFile

    def broken(self, name, data, total, first, last):
        raise OSError(errno.ENOSPC, "No space left on device", self.partial)

    monkeypatch.setattr(PartialFile, "write_block", broken)  # the row-parallel weights go through memory
    out = tmp_path / "out"
    with pytest.raises(OutputError, match="No space left on device"):
        reshard.convert(sources["meg2"], str(out), to="hf", workers=3)
    assert not out.exists()
    assert os.listdir(tmp_path) == []  # no staging folder, no lock, no .partial


def test_sigkill_before_the_split_file_is_renamed(sources, tmp_path):
    """Killed once every worker wrote its piece but before the parent renamed the file: DST does not exist, the
    staging folder holds only the .partial; the same command run again gives the bytes of one process."""
    dst = tmp_path / "out"
    args = [sys.executable, "-m", "reshard", "convert", sources["meg2"], str(dst), "--to", "hf", "--workers", "3"]
    env = {**os.environ, "RESHARD_TEST_PAUSE_AT": "partial", "RESHARD_DEBUG": "0"}
    proc = subprocess.Popen(args, env=env, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for line in proc.stderr:
            if line.startswith("reshard: paused at partial"):
                break
        else:
            pytest.fail(f"the run never paused: exit {proc.wait()}")
        (stage,) = [n for n in os.listdir(tmp_path) if n.startswith(".out.reshard-partial-")]
        assert [n for n in os.listdir(tmp_path / stage) if n.endswith(".safetensors.partial")] == \
            ["model.safetensors.partial"]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not dst.exists()
    reshard.convert(sources["meg2"], str(dst), to="hf", workers=3)
    reshard.convert(sources["meg2"], str(tmp_path / "one"), to="hf", workers=1)
    assert digests(dst) == digests(tmp_path / "one")
