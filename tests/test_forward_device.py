"""A GPU rank of the forward check reads its weights straight onto the device through a few bounded host buffers
(:mod:`reshard.verification.forward.staging`); here, without CUDA, staging is forced onto the CPU with tiny
buffers (many pieces per tensor, pieces cut mid-element): every loader's tensors equal the direct reads bit for bit
(position-coded fp32 and bf16 sources, fp32 and bf16 compute), a whole forward check gives the same logits, the
buffers never exceed their bound, and the per-step progress line shows on rank 0 of a TTY only."""

from __future__ import annotations

import io

import pytest
import torch
from safetensors.torch import save_file

import reshard
from checkpoints import make_hf
from fp8_checkpoints import make_fp8_hf
from reshard.errors import ReshardError
from reshard.io.safetensors_format import SafetensorsFile
from reshard.io.torch_format import TorchFile
from reshard.layouts.base import Options
from reshard.progress import step_progress
from reshard.verification.forward import verify_forward
from reshard.verification.forward.decoder import TPGroup
from reshard.verification.forward.job import open_rank_stream
from reshard.verification.forward.staging import ENV, Stager, StagedFile, plain, stager_for
from reshard.verification.forward.streamed import forward_streamed, named_tensors, read_step, read_stored, steps

TINY = (100, 3)  # bytes per buffer (not a multiple of 8: pieces end mid-element), buffers


def tiny_stager() -> Stager:
    return Stager("cpu", *TINY, pin=False)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device \
        and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


class Owner:
    stager = None


def coded(shape, dtype, base=0.0):
    return (torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float64) + base).to(dtype).reshape(shape)


# ------------------------------------------------------------------------------ the staged read itself

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A safetensors file (contiguous tensors: a scalar, 1-D, 2-D narrow and wide rows, a 3-D stack, fp32 and
    bf16) and a torch zip file holding strided views of one storage."""
    base = tmp_path_factory.mktemp("staged")
    tensors = {"scalar": torch.tensor(7.5), "vector": coded((37,), torch.float32, 1e5),
               "narrow": coded((13, 12), torch.float32, 2e5), "narrow16": coded((13, 12), torch.bfloat16, 3.0),
               "wide": coded((6, 4096), torch.float32, 3e5), "wide16": coded((6, 8192), torch.bfloat16, 5.0),
               "stack": coded((4, 6, 10), torch.float32, 4e5)}
    save_file(tensors, str(base / "t.safetensors"))
    storage = coded((12, 10), torch.float32, 5e5)
    torch.save({"whole": storage, "t": storage.t(), "rows": storage[2:9:2], "block": storage.view(3, 4, 10),
                "strided_block": storage.view(3, 4, 10).transpose(1, 2)}, str(base / "t.pt"))
    return SafetensorsFile(str(base / "t.safetensors")), TorchFile(str(base / "t.pt"))


def _slices(shape):
    """(axis, start, length, rows) cases of a tensor of ``shape``: whole, row ranges, column ranges (narrow: whole
    rows cut; wide: each row's piece), column ranges of some rows."""
    if not shape:
        return [(0, 0, None, None)]
    out = [(0, 0, None, None), (0, 1, shape[0] - 2, None), (0, shape[0] - 1, 1, None)]
    if len(shape) > 1:
        cols = shape[1]
        out += [(1, 0, cols // 2, None), (1, cols // 2, cols - cols // 2, None), (1, 1, cols // 4, (1, shape[0] - 1)),
                (1, 3, 1, None)]
    return out


def test_staged_reads_equal_the_files_reads_bit_for_bit(files):
    stager = tiny_stager()
    checked = 0
    for f in files:
        assert plain(f)
        owner = Owner()
        staged = StagedFile(f, owner)
        for name, loc in f.tensors.items():
            for axis, start, length, rows in _slices(loc.shape):
                direct = f.read(name, axis, start, length, rows)
                assert same_bits(staged.read(name, axis, start, length, rows), direct)  # no stager: the file's
                owner.stager = stager
                got = staged.read(name, axis, start, length, rows)
                owner.stager = None
                assert same_bits(got, direct), (f.path, name, axis, start, length, rows)
                checked += 1
            if len(loc.shape) == 3:  # one block of a stacked tensor, sliced
                for index in range(loc.shape[0]):
                    for axis, start, length, rows in _slices(loc.shape[1:]):
                        direct = f.read_block(name, index, axis, start, length, rows)
                        owner.stager = stager
                        got = staged.read_block(name, index, axis, start, length, rows)
                        owner.stager = None
                        assert same_bits(got, direct), (name, index, axis, start, length, rows)
                        checked += 1
    assert checked > 100
    assert all(files[1].tensors[n].strides is not None for n in ("t", "rows", "strided_block"))
    assert stager.pool_bytes == TINY[0] * TINY[1]


def test_the_buffers_stay_within_their_bound_whatever_the_tensor_size(files):
    """A tensor 16 times the whole pool goes through it in buffer-sized pieces; the pool never grows."""
    f = files[0]
    stager = Stager("cpu", 256, 2, pin=False)
    owner = Owner()
    owner.stager = stager
    staged = StagedFile(f, owner)
    for name in ("wide", "wide16", "stack"):
        before = stager.copies
        nbytes = f.tensors[name].nbytes
        assert same_bits(staged.read(name), f.read(name))
        assert stager.pool_bytes <= 512 and stager.copies - before == -(-nbytes // 256)
    assert f.tensors["wide"].nbytes >= 16 * 512
    stager.close()
    assert stager.pool_bytes == 0


def test_a_gpu_rank_stages_by_default_a_cpu_rank_does_not(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert stager_for("cpu") is None
    gpu = stager_for(torch.device("cuda", 1))  # nothing touches CUDA until a read
    assert gpu.pin and gpu.device == torch.device("cuda", 1)
    assert gpu.buffers * gpu.buffer_bytes <= 256 << 20 and gpu.buffer_bytes <= 64 << 20
    monkeypatch.setenv(ENV, "4096x2")
    forced = stager_for("cpu")
    assert (forced.buffer_bytes, forced.buffers, forced.pin) == (4096, 2, False)
    monkeypatch.setenv(ENV, "lots")
    with pytest.raises(ValueError, match="BYTESxCOUNT"):
        stager_for("cpu")


# ------------------------------------------------------------------------------ every loader, staged

MODEL = dict(hidden=64, layers=2, heads=8, kv_heads=2, ffn=96, vocab=1000)
LOADERS = {  # name: (layout, checkpoint, nproc, rank)
    "hf": ("hf", "hf", 1, 0), "hf_tp2_rank1": ("hf", "hf", 2, 1), "hf_tied_tp2_rank0": ("hf", "tied", 2, 0),
    "megatron_pp2": ("megatron", "megatron_pp2", 1, 0), "megatron_tp2_rank1": ("megatron", "megatron_tp2", 2, 1),
    "megatron_tied": ("megatron", "megatron_tied", 1, 0), "vllm_tp2_rank1": ("vllm", "vllm_tp2", 2, 1),
    "trtllm_tp2_rank1": ("trtllm", "trtllm_tp2", 2, 1), "meta_tp2_rank1": ("meta", "meta_tp2", 2, 1),
    "torch_dist_tp2_rank1": ("torch_dist", "torch_dist_tp2", 2, 1),  # chunks: several reads per tensor
}


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def coded_checkpoints(request, tmp_path_factory):
    """Position-coded tiny models (every element its own value) in every layout the forward check reads."""
    base = tmp_path_factory.mktemp(f"coded_{request.param}".replace("torch.", ""))
    out = {"hf": make_hf(base / "hf", dtype=request.param, **MODEL),
           "tied": make_hf(base / "tied", dtype=request.param, arch="Qwen2ForCausalLM", tied=True, **MODEL)}
    for name, to, source, kw in [("megatron_pp2", "megatron", "hf", {"pp": 2, "tp": 1}),
                                 ("megatron_tp2", "megatron", "hf", {"tp": 2}),
                                 ("megatron_tied", "megatron", "tied", {"tp": 1}),
                                 ("vllm_tp2", "vllm", "hf", {"tp": 2}), ("trtllm_tp2", "trtllm", "hf", {"tp": 2}),
                                 ("meta_tp2", "meta", "hf", {"tp": 2}),
                                 ("torch_dist_tp2", "megatron", "hf", {"tp": 2, "megatron_format": "torch_dist"})]:
        reshard.convert(out[source], str(base / name), to=to, **kw)
        out[name] = str(base / name)
    return request.param, out


def compare_staged_reads(layout: str, path: str, nproc: int, rank: int, compute: torch.dtype) -> tuple:
    """Read every step of rank ``rank`` twice, directly and staged through a tiny pool, as stored and cast to
    ``compute``; assert the two bit-identical; return (direct stream, staged stream, stager, stored dtypes)."""
    with open_rank_stream(layout, path, rank, nproc, Options()) as direct, \
            open_rank_stream(layout, path, rank, nproc, Options()) as staged:
        staged.stager = stager = tiny_stager()
        seen_direct, seen_staged = [], []
        for step in steps(direct.config):
            stored_direct, stored_staged = read_stored(direct, step), read_stored(staged, step)
            assert stored_direct.__class__ is stored_staged.__class__
            for (n, a), (m, b) in zip(named_tensors(step, stored_direct), named_tensors(step, stored_staged),
                                      strict=True):
                assert n == m and same_bits(a, b), (step, n)
            first = step == "embedding"  # its stored dtype is noted
            got = read_step(staged, step, compute, "cpu", seen_staged if first else None)
            want = read_step(direct, step, compute, "cpu", seen_direct if first else None)
            pairs = list(zip(named_tensors(step, want), named_tensors(step, got), strict=True))
            assert pairs and all(n == m and same_bits(a, b) for (n, a), (m, b) in pairs), step
            assert all(a.dtype == compute for (_, a), _ in pairs if a.dtype.is_floating_point)
        assert seen_staged == seen_direct
        assert staged.problems == direct.problems and staged.copies == direct.copies
        assert stager.pool_bytes <= TINY[0] * TINY[1]
    return direct, staged, stager, seen_direct


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["compute_fp32", "compute_bf16"])
@pytest.mark.parametrize("loader", list(LOADERS))
def test_every_loader_reads_the_same_tensors_staged(coded_checkpoints, loader, compute):
    source_dtype, paths = coded_checkpoints
    layout, name, nproc, rank = LOADERS[loader]
    direct, _, stager, stored = compare_staged_reads(layout, paths[name], nproc, rank, compute)
    assert stored == [source_dtype] and stager.copies > 1000  # a piece per 100 bytes
    if layout == "trtllm":  # each vocab slice of the rank's embedding copy noted (hashed) at each of its 2 reads
        assert len(direct.copies) == 4 and direct.copies[:2] == direct.copies[2:]


def test_files_that_cannot_be_staged_are_read_on_the_host_with_the_same_values(tmp_path):
    """A block-FP8 source: its files (dequantising views) are read and dequantised on the host as before, none
    through the stager; the tensors are the direct reads' bit for bit."""
    path = make_fp8_hf(tmp_path / "fp8", "llama")[0]
    direct, staged, stager, stored = compare_staged_reads("hf", path, 2, 1, torch.float32)
    kinds = {type(f).__name__ for f in staged.reading}
    assert "StagedFile" not in kinds and kinds == {"Fp8File"}  # both shards hold FP8 weights
    assert stored == [torch.bfloat16] and stager.copies == 0


# ------------------------------------------------------------------------------ a whole forward check, staged

IDS = torch.randint(0, 1000, (2, 10), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    base = tmp_path_factory.mktemp("seeded")
    src = make_hf(base / "hf", coded=False, seed=3, **MODEL)
    bf16 = make_hf(base / "hf16", dtype=torch.bfloat16, coded=False, seed=3, **MODEL)
    out = {"hf": ("hf", src), "hf_bf16": ("hf", bf16)}
    for name, to, source in [("megatron", "megatron", src), ("vllm", "vllm", bf16), ("trtllm", "trtllm", src)]:
        reshard.convert(source, str(base / name), to=to, tp=1)
        out[name] = (to, str(base / name))
    reshard.convert(src, str(base / "megatron_tp2"), to="megatron", tp=2, dtype="bf16")
    out["megatron_tp2"] = ("megatron", str(base / "megatron_tp2"))
    return out


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["compute_fp32", "compute_bf16"])
@pytest.mark.parametrize("name", ["hf", "hf_bf16", "megatron", "vllm", "trtllm"])
def test_staged_forward_gives_the_same_logits_bit_for_bit(seeded, name, compute, monkeypatch):
    layout, path = seeded[name]
    runs = []
    for forced in ("", "100x3"):
        monkeypatch.setenv(ENV, forced)
        with open_rank_stream(layout, path, 0, 1, Options()) as stream, torch.no_grad():
            out, stored = forward_streamed(stream, IDS, TPGroup(), compute, "cpu")
            assert stream.stager is None  # dropped after the run
        runs.append((out, stored))
    (plain_out, plain_stored), (staged_out, staged_stored) = runs
    assert plain_stored == staged_stored and plain_out.logits.dtype == compute
    assert same_bits(plain_out.logits, staged_out.logits) and torch.isfinite(plain_out.logits).all()
    assert [n for n, _ in plain_out.states] == [n for n, _ in staged_out.states] and plain_out.states
    assert all(same_bits(a, b) for (_, a), (_, b) in zip(plain_out.states, staged_out.states))


def test_staged_check_over_two_ranks_gives_the_same_report(seeded, monkeypatch):
    """HF fp32 sliced at 2 ranks against its Megatron bf16 TP2 conversion (the logits differ by the cast: every
    figure of the report depends on the exact logits of both), with and without staging in every worker."""
    _, src = seeded["hf"]
    _, meg = seeded["megatron_tp2"]
    reports = []
    for forced in ("", "100x3"):
        monkeypatch.setenv(ENV, forced)
        reports.append(verify_forward(src, meg, nproc=2))
    direct, staged = reports
    assert direct["ok"] and direct["b"]["dtype"] == "bfloat16" and direct["max_abs"] > 0
    assert staged == direct
    monkeypatch.setenv(ENV, "0x0")  # the workers do build their stager from the setting: an empty pool is refused
    with pytest.raises(ReshardError, match="staging needs at least one buffer"):
        verify_forward(src, meg, nproc=2)


# ------------------------------------------------------------------------------ the progress line

class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_per_step_on_rank_0_of_a_tty_only(seeded):
    tty = FakeTTY()
    progress = step_progress("forward: A", 0, 2, file=tty)
    layout, path = seeded["hf"]
    with open_rank_stream(layout, path, 0, 1, Options()) as stream, torch.no_grad():
        forward_streamed(stream, IDS, TPGroup(), torch.float32, "cpu", progress=progress)
    written = tty.getvalue()
    assert written.endswith("\n") and written.count("\n") == 1
    lines = [line.rstrip() for line in written.rstrip("\n").split("\r")[1:]]
    labels = [" ".join(line.split(" (rank")[0].split()[2:]) for line in lines]
    assert labels == ["embedding", "layer 1/2", "layer 2/2", "head"]
    assert all(line.startswith("forward: A ") and " (rank 0 of 2) " in line and line.endswith(" s") for line in lines)
    assert step_progress("forward: A", 1, 2, file=FakeTTY()) is None  # rank 1: no line
    assert step_progress("forward: A", 0, 2, file=io.StringIO()) is None  # not a TTY: no line


def test_progress_overwrites_a_longer_line_and_ends_it_once():
    tty = FakeTTY()
    progress = step_progress("forward: B", 0, 1, file=tty)
    progress("layer 10/12")
    progress("head")
    progress(None)
    first, second = tty.getvalue().split("\r")[1:]
    assert len(second.rstrip("\n")) == len(first) and second.startswith("forward: B head (rank 0 of 1) ")
    progress(None)  # a second end writes nothing
    assert tty.getvalue().count("\n") == 1
