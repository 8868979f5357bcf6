"""Digest verify streams: every canonical tensor is read in row blocks of bounded bytes, each side's SHA-256 is
the digest of the whole tensor's bytes (computed here independently, with hashlib over the bytes the test
wrote), and the report is the same whatever the block size or the number of worker processes.

The large case writes a bf16 checkpoint whose embedding is 512 MiB (position-coded bit patterns), converts it
to Megatron TP2 and verifies the pair with a 4 MiB block: no block read is larger, and a ``reshard verify`` run
in a child process peaks below the size of that one tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

import reshard
from checkpoints import hf_config, load_hf_tensors, make_hf
from family_rules import load_megatron_rank, megatron_rank_path
from helpers import run_cli
from reshard.verification import block_stream
from reshard.verification.digest import verify as verify_streamed, verify_dry_run


def _bits(rows: range, cols: int, salt: int) -> np.ndarray:
    """Position-coded bf16 bit patterns, all finite and positive: ``(row * 4099 + col + salt) % 0x7F00``."""
    r = np.arange(rows.start, rows.stop, dtype=np.int64)[:, None]
    c = np.arange(cols, dtype=np.int64)[None, :]
    return ((r * 4099 + c + salt) % 0x7F00).astype("<u2")


def write_big_hf(path, shapes: dict[str, tuple[int, int]]) -> dict[str, str]:
    """A bf16 safetensors checkpoint written row block by row block; returns each tensor's SHA-256 (hashlib over
    the bytes as generated)."""
    os.makedirs(path)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        size = shape[0] * shape[1] * 2 if len(shape) == 2 else shape[0] * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    digests = {}
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for salt, (name, shape) in enumerate(shapes.items()):
            rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
            sha = hashlib.sha256()
            for r0 in range(0, rows, 4096):
                block = _bits(range(r0, min(rows, r0 + 4096)), cols, salt).tobytes()
                sha.update(block)
                f.write(block)
            digests[name] = sha.hexdigest()
    return digests


BIG = dict(hidden=4096, layers=1, heads=32, kv_heads=8, ffn=128, vocab=65536, tied=True)


@pytest.fixture(scope="module")
def big_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("big")
    config = hf_config(**BIG, torch_dtype="bfloat16")
    h, v, f = BIG["hidden"], BIG["vocab"], BIG["ffn"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.layers.0.input_layernorm.weight": (h,),
              "model.layers.0.self_attn.q_proj.weight": (h, h), "model.layers.0.self_attn.k_proj.weight": (1024, h),
              "model.layers.0.self_attn.v_proj.weight": (1024, h), "model.layers.0.self_attn.o_proj.weight": (h, h),
              "model.layers.0.post_attention_layernorm.weight": (h,), "model.layers.0.mlp.gate_proj.weight": (f, h),
              "model.layers.0.mlp.up_proj.weight": (f, h), "model.layers.0.mlp.down_proj.weight": (h, f),
              "model.norm.weight": (h,)}
    digests = write_big_hf(root / "hf", shapes)
    with open(root / "hf" / "config.json", "w") as out:
        json.dump(config, out)
    reshard.convert(str(root / "hf"), str(root / "meg"), to="megatron", tp=2)
    return root, digests


def test_a_512_mib_tensor_is_verified_in_blocks_with_the_whole_tensor_digest(big_pair, monkeypatch):
    root, digests = big_pair
    assert os.path.getsize(root / "hf" / "model.safetensors") > 512 << 20
    budget = 4 << 20
    largest = []
    real = block_stream.read_block

    def recording(tensor, files, gatherer, dest):
        data = real(tensor, files, gatherer, dest)
        largest.append(max(data.size, dest.size))
        return data

    monkeypatch.setattr(block_stream, "read_block", recording)
    report = verify_streamed(str(root / "hf"), str(root / "meg"), block_bytes=budget)
    assert report.equal, report.to_dict()
    assert max(largest) <= budget and len(largest) > 2 * (512 << 20) // budget  # both sides, in blocks
    results = {t.name: t for t in report.tensors}
    assert set(results) == set(digests)
    for name, sha in digests.items():
        assert results[name].sha256_a == results[name].sha256_b == sha, name
        assert results[name].status == "equal" and results[name].max_abs is None  # no figures for equal bytes


def test_verify_of_a_512_mib_tensor_stays_below_its_size_in_a_child_process(big_pair):
    root, _ = big_pair
    # VmHWM, not ru_maxrss: a forked child's ru_maxrss starts at its parent's size (this test process).
    code = ("import sys\nfrom reshard import cli\nsys.argv = ['reshard', 'verify', sys.argv[1], sys.argv[2]]\n"
            "try:\n    cli.main()\nexcept SystemExit as e:\n    code = e.code or 0\nelse:\n    code = 0\n"
            "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0])\nsys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(root / "hf"), str(root / "meg")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "EQUAL" in proc.stdout, proc.stdout + proc.stderr
    peak_kib = int(proc.stdout.split("VmHWM:")[1].split()[0])
    assert peak_kib * 1024 < 512 << 20, f"peak RSS {peak_kib / 1024:.0f} MiB"  # A and B hold 512 MiB each


SMALL = [
    ("megatron", dict(tp=2)),  # column, row (dim 1), vocab padding, qkv and gate/up packs
    ("megatron", dict(tp=2, pp=2)),
    ("vllm", dict(tp=2)),
    ("meta", dict(tp=2)),  # interleaved-RoPE row order: blocks keep whole heads
]


@pytest.mark.parametrize("layout,degrees", SMALL, ids=lambda p: str(p))
def test_tiny_blocks_give_the_whole_tensor_digests(tmp_path, layout, degrees):
    src = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, shards=2)
    out = str(tmp_path / layout)
    reshard.convert(src, out, to=layout, **degrees)
    expected = {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                for n, t in load_hf_tensors(src).items()}
    for block in (96, 1000, 1 << 30):  # smaller than one row of the embedding: one row per block
        report = verify_streamed(src, out, block_bytes=block)
        assert report.equal, (block, report.to_dict())
        got = {t.name: (t.sha256_a, t.sha256_b) for t in report.tensors}
        assert got == {n: (s, s) for n, s in expected.items()}, block


def test_one_flipped_element_is_found_in_its_block_with_its_error(tmp_path):
    src = make_hf(tmp_path / "hf", vocab=1000)
    out = str(tmp_path / "meg")
    reshard.convert(src, out, to="megatron", tp=2)
    rank1 = megatron_rank_path(out, 1, 0, 1)
    state = load_megatron_rank(rank1)
    fc2 = state["model"]["decoder.layers.1.mlp.linear_fc2.weight"]  # row-parallel: canonical columns 48..95
    fc2[63, 7] += 0.5
    torch.save(state, rank1)
    report = verify_streamed(src, out, block_bytes=512)
    bad = [t for t in report.tensors if not t.ok]
    assert [t.name for t in bad] == ["model.layers.1.mlp.down_proj.weight"]
    assert bad[0].status == "different" and bad[0].max_abs == 0.5 and bad[0].sha256_a != bad[0].sha256_b
    original = load_hf_tensors(src)["model.layers.1.mlp.down_proj.weight"][63, 48 + 7].item()
    assert bad[0].max_rel == pytest.approx(0.5 / original)


def test_a_cast_is_reported_as_a_cast_with_figures(tmp_path, capsys):
    src = make_hf(tmp_path / "hf", vocab=1000)
    out = str(tmp_path / "bf16")
    reshard.convert(src, out, to="vllm", tp=2, dtype="bf16")
    code, stdout, _ = run_cli(capsys, "verify", src, out)
    tensors = len(load_hf_tensors(src))
    assert code == 0 and f"{tensors}/{tensors} tensors equal after a cast to BF16" in stdout, stdout
    assert "match" not in stdout and stdout.strip().endswith("EQUAL")
    report = verify_streamed(src, out, block_bytes=256)
    assert all(t.status == "equal_after_cast" and t.max_abs is not None for t in report.tensors)
    assert report.to_dict()["checked"][0] == f"{tensors}/{tensors} tensors equal after a cast to BF16"


def test_a_differing_replica_is_found_streamed(tmp_path, capsys):
    src = make_hf(tmp_path / "hf", vocab=1000)
    out = str(tmp_path / "meg")
    reshard.convert(src, out, to="megatron", tp=2)
    rank1 = megatron_rank_path(out, 1, 0, 1)
    state = load_megatron_rank(rank1)
    state["model"]["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"][5] += 0.25
    torch.save(state, rank1)
    report = verify_streamed(src, out, block_bytes=64)
    assert all(t.ok for t in report.tensors)  # the copy read (rank 0) is intact
    assert len(report.replica_differences) == 1 and "mp_rank_01" in report.replica_differences[0]
    assert "max difference 0.25" in report.replica_differences[0] and not report.equal
    code, stdout, _ = run_cli(capsys, "verify", src, out)
    assert code == 1 and "1 differs" in stdout and stdout.strip().endswith("DIFFERENT"), stdout


def test_workers_give_the_same_report(tmp_path):
    src = make_hf(tmp_path / "hf", vocab=1000, shards=2)
    out = str(tmp_path / "meg")
    reshard.convert(src, out, to="megatron", tp=2, pp=2)
    one = verify_streamed(src, out, block_bytes=512, workers=1).to_dict()
    two = verify_streamed(src, out, block_bytes=512, workers=2).to_dict()
    assert (one.pop("workers"), two.pop("workers")) == (1, 2)  # each says how many compared, and why
    assert (one.pop("workers_reason"), two.pop("workers_reason")) == ("1 process asked for", "2 processes asked for")
    assert one == two and one["equal"] and one["replicas_checked"] > 0


def test_dry_run_counts_the_bytes_each_process_reads(tmp_path, capsys):
    src = make_hf(tmp_path / "hf", vocab=1000)
    out = str(tmp_path / "meg")
    reshard.convert(src, out, to="megatron", tp=2)
    weights = sum(t.numel() * t.element_size() for t in load_hf_tensors(src).values())
    plan = verify_dry_run(src, out, workers=2)
    assert len(plan["processes"]) == 2
    assert sum(p["read_a"] for p in plan["processes"]) == weights
    # B reads every canonical byte once (no padding row), plus both sides of each replica check
    assert sum(p["read_b"] for p in plan["processes"]) > weights
    assert all(p["peak_estimate"] < 512 << 20 for p in plan["processes"])
    code, stdout, _ = run_cli(capsys, "verify", src, out, "--dry-run", "--workers", "2")
    assert code == 0 and stdout.count("peak memory about") == 2 and "EQUAL" not in stdout


def test_verify_starts_reading_both_folders_while_the_cli_starts(tmp_path, monkeypatch):
    from reshard.io import heads

    a, b = make_hf(tmp_path / "a", vocab=1000), make_hf(tmp_path / "b", vocab=1000)
    advised = []
    monkeypatch.setattr(heads, "read_heads_in_background", lambda paths, budget: advised.append(sorted(paths)))
    for argv in (["verify", a, b, "--forward"], ["verify", a, b, "--dry-run"], ["verify", a, str(tmp_path / "no")]):
        heads.read_source_heads_early(argv)
    assert advised == []
    heads.read_source_heads_early(["verify", a, b, "--json"])
    assert advised == [sorted([os.path.join(a, "model.safetensors"), os.path.join(b, "model.safetensors")])]
    meg = str(tmp_path / "meg")
    reshard.convert(a, meg, to="megatron", tp=2)
    heads.read_source_heads_early(["verify", a, meg])
    assert advised[1] == sorted([os.path.join(a, "model.safetensors"), megatron_rank_path(meg, 0, 0, 1),
                                 megatron_rank_path(meg, 1, 0, 1)])
