"""The executor's I/O paths: page-aligned copies, lockstep grouping by buffered bytes, read-ahead, reads
through short-lived maps. Each must leave the output bytes exactly as they would be without it."""

from __future__ import annotations

import json
import math
import os
import threading
import time
import zlib

import pytest
import torch

import reshard
from reshard.io import heads, mapped, readahead, writeback
from reshard.io.partial import PAGE
from reshard.io.safetensors_format import SafetensorsFile
from reshard.io.torch_format import TorchFile
from tests.checkpoints import hf_config, hf_tensor_shapes, load_hf_tensors, make_hf, write_hf
from tests.test_workers import tree_bytes


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory):
    return make_hf(tmp_path_factory.mktemp("src") / "hf", shards=2, dtype=torch.bfloat16, vocab=1003)


def _rank_files(root):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".pt"))


def test_identity_reshard_keeps_every_record_on_its_source_page_phase(hf_source, tmp_path):
    """torch.save aligns records to 64 bytes at arbitrary page offsets; a copied record lands at the same offset
    within a page as its source, so copy_file_range moves whole pages."""
    meg = tmp_path / "meg"
    reshard.convert(hf_source, str(meg), to="megatron", tp=2)
    for path in _rank_files(meg):  # re-save with torch: its own (64-byte, arbitrary page phase) alignment
        torch.save(torch.load(path, weights_only=False), path)
    again = tmp_path / "again"
    reshard.convert(str(meg), str(again), to="megatron", tp=2)
    phases = []
    for src_path, out_path in zip(_rank_files(meg), _rank_files(again)):
        src, out = TorchFile(src_path), TorchFile(out_path)
        for name, loc in src.tensors.items():
            assert out.tensors[name].offset % 64 == 0
            assert out.tensors[name].offset % PAGE == loc.offset % PAGE, name
            phases.append(loc.offset % PAGE)
    assert len(set(phases)) > 4  # the test is not vacuous: torch.save's phases vary
    back = tmp_path / "hf"
    reshard.convert(str(again), str(back), to="hf")
    original, converted = load_hf_tensors(hf_source), load_hf_tensors(back)
    assert all(torch.equal(original[n].view(torch.int16), converted[n].view(torch.int16)) for n in original)


def test_safetensors_output_starts_its_data_on_the_source_page_phase(tmp_path):
    """The header is padded with spaces so that copied tensors are page-aligned with their source; the
    safetensors library still reads the file, bit for bit."""
    config = hf_config(hidden=1024, layers=1, heads=8, kv_heads=2, ffn=1024, vocab=256)
    # fp32 bit patterns coding (tensor, element): unique everywhere; every tensor a whole number of pages
    tensors = {name: (torch.arange(math.prod(shape), dtype=torch.int32) + (i << 23)).view(torch.float32).view(shape)
               for i, (name, shape) in enumerate(hf_tensor_shapes(config).items())}
    assert all(t.numel() * 4 % PAGE == 0 for t in tensors.values())
    src = tmp_path / "src"
    write_hf(src, config, tensors)
    (shard,) = [p for p in os.listdir(src) if p.endswith(".safetensors")]
    source = SafetensorsFile(str(src / shard))
    (src_phase,) = {loc.offset % PAGE for loc in source.tensors.values()}
    assert src_phase != 0  # the library's header is not page-sized: without padding nothing would align
    out = tmp_path / "out"
    reshard.convert(str(src), str(out), to="hf")
    (out_shard,) = [p for p in os.listdir(out) if p.endswith(".safetensors")]
    written = SafetensorsFile(str(out / out_shard))
    assert {loc.offset % PAGE for loc in written.tensors.values()} == {src_phase}
    with open(out / out_shard, "rb") as f:
        header = f.read(int.from_bytes(f.read(8), "little"))
    assert header.endswith(b" ") and header.rstrip(b" ").endswith(b"}")
    converted = load_hf_tensors(out)  # the safetensors library
    assert all(torch.equal(tensors[n].view(torch.int32), converted[n].view(torch.int32)) for n in tensors)


def test_tp8_to_tp4_writes_all_ranks_in_one_lockstep_group(tmp_path):
    """Column-parallel pieces are copied file to file and take no buffer, so the TP ranks of a stage stay in one
    lockstep group (a row-parallel source tensor is read once for all of them) while the step buffer stays
    within the largest tensor."""
    from reshard.conversion import make_plan, open_source
    from reshard.execute import buffered_bytes, largest_tensor, lockstep_groups
    from reshard.layouts.base import Options

    hf = make_hf(tmp_path / "hf", dtype=torch.bfloat16, kv_heads=8, vocab=1003)
    meg8 = tmp_path / "meg8"
    reshard.convert(hf, str(meg8), to="megatron", tp=8)
    source = open_source(str(meg8), Options())
    plan, _ = make_plan(source, "megatron", Options(tp=4))
    limit = largest_tensor(plan, source.files)
    groups = lockstep_groups(plan.files, limit, source.files)
    assert [len(g) for g in groups] == [4]

    def step_size(files) -> int:  # the largest step buffer of files written in lockstep
        return max((sum(column) for column in zip(*(buffered_bytes(f, source.files) for f in files))), default=0)

    assert step_size([plan.files[i] for i in groups[0]]) <= limit * 1.1 + 64 * 4
    assert sum(t.nbytes for f in plan.files for t in f.tensors) > step_size(plan.files) * 4


def test_mapped_crc_matches_zlib_at_any_offset(tmp_path, monkeypatch):
    data = bytes(range(256)) * 4099
    path = tmp_path / "blob"
    path.write_bytes(data)
    monkeypatch.setattr(mapped, "WINDOW", 10_000)  # several windows, none page-aligned
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, length in ((0, len(data)), (1, 12_345), (4095, 30_001), (len(data) - 7, 7), (500, 0)):
            assert mapped.crc32_of_range(fd, offset, length, 0, zlib.crc32) == zlib.crc32(data[offset:offset + length])
            with mapped.mapped(fd, offset, length) as view:
                assert view.tobytes() == data[offset:offset + length]
    finally:
        os.close(fd)


class _Advice:
    """Records posix_fadvise calls (thread-safe)."""

    def __init__(self):
        self.calls: list[tuple[int, int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, fd, offset, length, advice):
        with self.lock:
            self.calls.append((fd, offset, length))

    def wait_for(self, n: int, timeout: float = 10.0) -> list:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.calls) >= n:
                    return list(self.calls)
            time.sleep(0.01)
        raise AssertionError(f"expected {n} calls, got {self.calls}")


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise is Linux/BSD only")
def test_read_ahead_stays_within_its_window(monkeypatch):
    advice = _Advice()
    monkeypatch.setattr(os, "posix_fadvise", advice)
    # step 0 reads one range twice (two ranks) and an adjacent one: advised once, merged
    steps = [[(3, 0, 10), (3, 0, 10), (3, 10, 5)], [(3, 100, 10)], [(4, 0, 10)], [(4, 50, 10)]]
    ra = readahead.ReadAhead(steps, window=25)
    try:
        assert advice.wait_for(2) == [(3, 0, 15), (3, 100, 10)]  # 15 + 10 fit in 25; step 2 does not
        time.sleep(0.1)
        assert len(advice.calls) == 2
        ra.step_done()
        assert advice.wait_for(3)[2] == (4, 0, 10)
        ra.step_done()
        assert advice.wait_for(4)[3] == (4, 50, 10)
    finally:
        ra.close()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise is Linux/BSD only")
def test_heads_are_read_round_robin_within_budget(tmp_path, monkeypatch):
    advice = _Advice()
    monkeypatch.setattr(os, "posix_fadvise", advice)
    monkeypatch.setattr(heads, "_HEAD_CHUNK", 100)
    paths = []
    for i in range(3):
        paths.append(str(tmp_path / f"f{i}"))
        open(paths[-1], "wb").close()
    heads.read_heads_in_background(paths, budget=3 * 250)
    calls = advice.wait_for(9)
    assert [(offset, length) for _, offset, length in calls] == \
        [(0, 100)] * 3 + [(100, 100)] * 3 + [(200, 50)] * 3
    assert len({fd for fd, _, _ in calls[:3]}) == 3


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise is Linux/BSD only")
def test_the_cli_starts_reading_a_local_sources_weight_files_before_parsing(tmp_path, monkeypatch):
    """`reshard convert SRC ...`: the heads of SRC's top-level weight files (the Hugging Face layout's choice, else
    Meta's .pth; never sub-folders) are advised before the command line is parsed, at most EARLY_BUDGET
    bytes; other commands, options before SRC and missing folders advise nothing."""
    src = tmp_path / "src"
    (src / "original").mkdir(parents=True)
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "pytorch_model.bin",
                 "config.json", "original/consolidated.00.pth"):
        (src / name).write_bytes(b"x" * 10)
    assert heads.top_level_weight_files(str(src)) == [str(src / "model-00001-of-00002.safetensors"),
                                                     str(src / "model-00002-of-00002.safetensors")]
    (src / "consolidated.safetensors").write_bytes(b"x" * 10)  # beside the shards, not in the index
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert heads.top_level_weight_files(str(src)) == [str(src / "model-00001-of-00002.safetensors"),
                                                     str(src / "model-00002-of-00002.safetensors")]
    (src / "model.safetensors.index.json").write_text("not json")  # the layout refuses it: nothing is read
    assert heads.top_level_weight_files(str(src)) == []
    (src / "model.safetensors.index.json").unlink()  # no index: the shards, not Mistral's consolidated file
    assert heads.top_level_weight_files(str(src)) == [str(src / "model-00001-of-00002.safetensors"),
                                                     str(src / "model-00002-of-00002.safetensors")]
    (src / "consolidated.safetensors").unlink()
    (src / "model-00001-of-00002.safetensors").unlink()
    (src / "model-00002-of-00002.safetensors").unlink()
    assert heads.top_level_weight_files(str(src)) == [str(src / "pytorch_model.bin")]
    (src / "pytorch_model.bin").unlink()
    (src / "consolidated.00.pth").write_bytes(b"x" * 10)  # Meta's rank files
    assert heads.top_level_weight_files(str(src)) == [str(src / "consolidated.00.pth")]
    assert heads.top_level_weight_files(str(tmp_path / "absent")) == []

    advised: list[tuple[str, int, int]] = []
    done = threading.Event()

    def advise(paths, per_file):
        for path in paths:
            advised.append((path, 0, per_file))
        done.set()

    monkeypatch.setattr(heads, "_advise_heads", advise)
    monkeypatch.setattr(heads, "EARLY_BUDGET", 3000)
    for argv in (["inspect", str(src)], ["convert", "--to", "hf", str(src)], ["convert", str(tmp_path / "no")]):
        heads.read_source_heads_early(argv)
    assert not done.wait(0.2) and advised == []
    heads.read_source_heads_early(["convert", str(src), str(tmp_path / "out"), "--to", "megatron"])
    assert done.wait(10) and advised == [(str(src / "consolidated.00.pth"), 0, 3000)]


def test_early_write_out_covers_each_file_in_order_and_changes_no_byte(hf_source, tmp_path, monkeypatch):
    reshard.convert(hf_source, str(tmp_path / "plain"), to="megatron", tp=2, pp=2)
    started: list[tuple[int, int, int]] = []
    lock = threading.Lock()

    def record(fd, offset, length, flags):
        with lock:
            started.append((fd, offset, length))
        return 0

    monkeypatch.setattr(writeback, "CHUNK", 4096)
    monkeypatch.setattr(writeback, "_sync_file_range", record)
    reshard.convert(hf_source, str(tmp_path / "early"), to="megatron", tp=2, pp=2, workers=1)
    assert tree_bytes(tmp_path / "early") == tree_bytes(tmp_path / "plain")
    assert len(started) > 8
    by_fd: dict[int, int] = {}
    for fd, offset, length in started:  # per file: contiguous and increasing, a chunk or more at a time
        assert offset in (0, by_fd.get(fd, 0)) and length >= 4096  # 0: a new file reusing a descriptor number
        by_fd[fd] = offset + length


def test_writer_lanes_give_the_bytes_of_a_single_lane(hf_source, tmp_path, monkeypatch):
    from reshard import execute

    reshard.convert(hf_source, str(tmp_path / "two"), to="megatron", tp=2, pp=2)
    monkeypatch.setattr(execute, "WRITER_LANES", 1)
    reshard.convert(hf_source, str(tmp_path / "one"), to="megatron", tp=2, pp=2)
    assert tree_bytes(tmp_path / "one") == tree_bytes(tmp_path / "two")


def test_torch_import_leaves_the_collector_as_it_was():
    import gc

    from reshard.io.torch_format import _import_torch

    assert gc.isenabled()
    _import_torch()
    assert gc.isenabled()
    gc.disable()
    try:
        _import_torch()
        assert not gc.isenabled()
    finally:
        gc.enable()
