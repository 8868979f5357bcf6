"""``reshard.io.device_load``: the streaming loader behind ``reshard.load_rank``.

What this file proves, each result compared bit for bit with the tensors :func:`reshard.io.assemble.assemble`
builds for the same plan, one whole tensor at a time (the path load_rank took before streaming, which
tests/test_load_rank.py checks against convert's files):

1. The staged path (two host buffers, as for CUDA; here ``staged=True`` on the CPU, unpinned), with the default
   buffers and with tiny ones (blocks far smaller than a tensor, hundreds of blocks), and the CPU path that reads
   straight into the result: vLLM tp1 (fused qkv and gate_up), tp2 and tp4 ranks (row-parallel ``down_proj`` read
   row by row), tp8 (more ranks than the 4 KV heads: replicated KV heads), Megatron tp2 and tp4 ranks (vocab
   padding, fused ``linear_fc1``, grouped-query ``linear_qkv``), a bf16 cast of the fp32 source (cast after the
   copy), a Megatron tp2 pp2 source gathered into vLLM tp1 and tp2 ranks, and a block-FP8 source dequantised
   into vLLM tp1 and tp2 ranks (blocks built through torch). Position-coded sources (every element a distinct bit
   pattern): a misplaced row, column, head or block changes the bytes.
2. A cast that overflows (fp16 from position codes above 65504) is refused by the staged path with assemble's
   error.
3. A tp2 rank reads its own bytes only (``rchar`` within 1% of the bytes it returns) from a source whose
   row-parallel pieces are all at least 4 KiB per row.
4. Host memory is bounded: loading every tensor of a source whose largest tensor is 256 MiB through the staged
   path, with the device copy replaced by a sink that checksums what it is given, grows the peak RSS of a fresh
   process by less than the staging buffers plus 64 MiB (and less than the largest tensor), and the sink saw
   every tensor's bytes in order (CRC-32 equal to assemble's tensors').
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch

import reshard
from checkpoints import hf_config, hf_tensor_shapes, make_hf
from fp8_checkpoints import make_fp8_hf
from test_load_rank import rchar, write_int_coded

from reshard.io import device_load
from reshard.io.assemble import assemble
from reshard.io.casts import CastOverflowError

#: hidden 256, 8 heads, 4 KV heads, FFN 4096 (down_proj rows of 16 KiB: 8 KiB per tp2 rank, 4 KiB per tp4 rank),
#: vocab 500 (Megatron pads it), 2 layers.
SMALL = dict(hidden=256, heads=8, kv_heads=4, ffn=4096, vocab=500, layers=2)


@contextmanager
def planned(src: str, to: str, dtype=None, **kw):
    """The target tensors of one rank and the open source files, planned as load_rank plans them."""
    from reshard.conversion import make_plan
    from reshard.hub import open_source
    from reshard.io import dtypes
    from reshard.layouts.base import Options
    from reshard.layouts.registry import get_layout
    from reshard.rank_view import rank_files

    rank = kw.pop("rank", 0)
    pp_rank = kw.pop("pp_rank", 0)
    opts = Options(dtype=dtypes.as_dtype_name(dtype), **kw)
    with open_source(src, opts) as source:
        plan, _ = make_plan(source, get_layout(to).rank_view_of or to, opts)
        files = rank_files(plan, to, {"tp": rank, "pp": pp_rank, "ep": 0}, {"tp": opts.tp, "pp": opts.pp, "ep": 1})
        yield [t for f in files for t in f.tensors], source.files


def same_bits(got: dict, tensors, files, where: str) -> None:
    assert [t.name for t in tensors] and list(got) == [t.name for t in tensors], where
    for t in tensors:
        want = assemble(t, files, allow_overflow=True)
        g = got[t.name]
        assert g.dtype == want.dtype and tuple(g.shape) == tuple(want.shape), f"{where}: {t.name}"
        assert torch.equal(g.contiguous().reshape(-1).view(torch.uint8), want.contiguous().reshape(-1)
                           .view(torch.uint8)), f"{where}: {t.name} bytes differ from assemble's"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    config = hf_config(**SMALL)
    hf = write_int_coded(str(root / "hf"), config, hf_tensor_shapes(config))
    megatron = str(root / "megatron")
    reshard.convert(hf, megatron, to="megatron", tp=2, pp=2)
    fp8 = make_fp8_hf(str(root / "fp8"))[0]
    return {"hf": hf, "megatron": megatron, "fp8": fp8}


CASES = [  # source, to, options
    ("hf", "vllm", dict(tp=1)),
    ("hf", "vllm", dict(tp=2, rank=0)),
    ("hf", "vllm", dict(tp=2, rank=1)),
    ("hf", "vllm", dict(tp=4, rank=3)),
    ("hf", "vllm", dict(tp=8, rank=5)),
    ("hf", "megatron", dict(tp=2, rank=1)),
    ("hf", "megatron", dict(tp=4, rank=2)),
    ("hf", "vllm", dict(tp=2, rank=1, dtype="bf16")),
    ("hf", "megatron", dict(tp=4, rank=0, dtype="bf16")),
    ("megatron", "vllm", dict(tp=1)),
    ("megatron", "vllm", dict(tp=2, rank=1)),
    ("fp8", "vllm", dict(tp=1)),
    ("fp8", "vllm", dict(tp=2, rank=1)),
]
MODES = {"cpu": dict(), "staged": dict(staged=True, pin=False),
         "tiny": dict(staged=True, pin=False, buffer_bytes=4096)}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("src,to,kw", CASES, ids=[f"{s}-{t}-" + "-".join(f"{k}{v}" for k, v in kw.items())
                                                  for s, t, kw in CASES])
def test_stream_equals_assemble(sources, src, to, kw, mode):
    with planned(sources[src], to, **kw) as (tensors, files):
        stats = {}
        got = device_load.load_tensors(tensors, files, "cpu", stats=stats, **MODES[mode])
        same_bits(got, tensors, files, f"{src}->{to} {kw} {mode}")
        jobs = device_load.plan_jobs(tensors, files, MODES[mode].get("buffer_bytes", device_load.BUFFER_BYTES))
    assert stats["blocks"] == len(jobs)
    if "dtype" in kw:  # the cast happens after the copy, not through torch on the host
        assert any(j.mode == "cast" for j in jobs) and not any(j.mode == "torch" for j in jobs)
    if src == "fp8":  # dequantised through torch on the host, block by block
        assert any(j.mode == "torch" for j in jobs)
    if src == "hf" and to == "vllm" and kw.get("tp", 1) in (2, 4) and mode != "tiny":
        assert stats["row_reads"] > 0  # down_proj's column slice read row by row (tiny blocks: one row each)
    if mode == "tiny":
        assert stats["blocks"] > 10 * len(tensors)
        rows = [4 * math.prod(t.shape[1:]) for t in tensors if t.shape]  # a row as read: fp32 source elements
        assert stats["staging_bytes"] <= 2 * max(4096, *rows)
    if mode == "staged":
        assert 0 < stats["staging_bytes"] <= 2 * device_load.BUFFER_BYTES


def test_load_rank_cpu_is_the_stream(sources):
    """load_rank's default (CPU) returns what the staged path with tiny buffers returns."""
    got = reshard.load_rank(sources["hf"], "vllm", tp=4, rank=1, dtype="bf16")
    with planned(sources["hf"], "vllm", tp=4, rank=1, dtype="bf16") as (tensors, files):
        same_bits(got, tensors, files, "load_rank vllm tp4 rank1 bf16")


def test_staged_cast_overflow_refused(tmp_path):
    src = make_hf(str(tmp_path / "hf"), hidden=256, heads=8, kv_heads=4, ffn=512, vocab=500, layers=2)
    with planned(src, "vllm", tp=2, rank=0, dtype="fp16") as (tensors, files):  # codes up to ~2**22 > 65504
        with pytest.raises(CastOverflowError) as by_assemble:
            for t in tensors:
                assemble(t, files, allow_overflow=False)
        with pytest.raises(CastOverflowError) as by_stream:
            device_load.load_tensors(tensors, files, "cpu", staged=True, pin=False, buffer_bytes=8192)
    assert str(by_stream.value) == str(by_assemble.value)


# ------------------------------------------------------------------------------------------ bytes and memory

#: hidden 2048 (o_proj rows of 8 KiB: 4 KiB per tp2 rank), 16 heads, 4 KV heads, FFN 4096, vocab 32768 with tied
#: embeddings: the largest tensor, embed_tokens, is 256 MiB of fp32.
BIG = dict(hidden=2048, heads=16, kv_heads=4, ffn=4096, vocab=32768, layers=1, tied=True)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    config = hf_config(**BIG)
    shapes = hf_tensor_shapes(config)
    assert max(4 * v * h for v, h in [s for s in shapes.values() if len(s) == 2]) == 256 << 20
    return write_int_coded(str(tmp_path_factory.mktemp("stream_big") / "hf"), config, shapes)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
def test_rank_reads_its_own_bytes(big):
    with planned(big, "vllm", tp=2, rank=1) as (tensors, files):
        stats = {}
        start = rchar()
        got = device_load.load_tensors(tensors, files, "cpu", staged=True, pin=False, stats=stats)
        read = rchar() - start
        same_bits(got, tensors, files, "vllm tp2 rank 1 of the 256 MiB-embedding source")
    returned = sum(t.numel() * t.element_size() for t in got.values())
    assert stats["row_reads"] >= 2 * BIG["hidden"]  # o_proj and down_proj: one read per row
    assert 0.99 * returned <= read <= 1.01 * returned, f"read {read} bytes for {returned}"


MEMORY_CHILD = r"""
import json, sys, zlib
import torch
sys.path.insert(0, sys.argv[2])
from test_load_rank_stream import planned
from reshard.io import device_load
from reshard.io.assemble import assemble

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

seen = {"crc": 0, "bytes": 0}
def sink(dest, host):
    seen["crc"] = zlib.crc32(host.numpy(), seen["crc"])
    seen["bytes"] += host.numel()

device_load._upload = sink
with planned(sys.argv[1], "vllm") as (tensors, files):
    device_load.load_tensors(tensors[:1], files, "cpu", staged=True, pin=False)  # first-use costs
    seen.update(crc=0, bytes=0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status("VmRSS:")
    stats = {}
    device_load.load_tensors(tensors, files, "cpu", staged=True, pin=False, stats=stats)
    growth = status("VmHWM:") - before
    want = 0
    streamed = [t for t in tensors if t.fill is None]  # constants (vLLM's scales) are filled on the device
    for t in streamed:
        want = zlib.crc32(assemble(t, files).contiguous().reshape(-1).view(torch.uint8).numpy(), want)
    print(json.dumps(dict(growth=growth, stats=stats, seen=seen, want=want, total=sum(t.nbytes for t in streamed),
                          largest=max(t.nbytes for t in tensors))))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc/self/clear_refs")
def test_host_memory_is_bounded(big):
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", MEMORY_CHILD, big, here], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["largest"] == 256 << 20
    assert r["seen"]["bytes"] == r["total"] and r["seen"]["crc"] == r["want"], "the sink missed bytes"
    staging = r["stats"]["staging_bytes"]
    assert 0 < staging <= 2 * device_load.BUFFER_BYTES
    growth = r["growth"]
    assert growth <= staging + (64 << 20), f"peak RSS grew {growth >> 20} MiB for {staging >> 20} MiB of buffers"
    assert growth < r["largest"]
