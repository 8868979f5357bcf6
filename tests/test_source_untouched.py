"""Every failure case leaves the source tree exactly as it was: each file's SHA-256, size and mtime, and every
folder's mtime, are fingerprinted before and after. Run against an HF and a Megatron source."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch

import reshard
import reshard.io.partial
import reshard.staging
from checkpoints import make_hf
from cli_inprocess import run_main
from megatron_rules import rank_file
from tree_snapshot import leftovers, snapshot


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    root = tmp_path_factory.mktemp("untouched")
    hf = make_hf(root / "hf" / "model", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, shards=2)
    reshard.convert(hf, str(root / "meg" / "model"), to="megatron", tp=2, pp=2)
    bad = root / "bad" / "model"  # replicas that disagree
    shutil.copytree(root / "meg" / "model", bad)
    path = rank_file(bad, 1, 0, 2)
    state = torch.load(path, weights_only=False)
    name = "decoder.final_layernorm.weight" if "decoder.final_layernorm.weight" in state["model"] else None
    name = name or next(k for k in state["model"] if k.endswith("layer_norm_weight"))
    state["model"][name] = state["model"][name] + 1
    torch.save(state, path)
    return {"hf": hf, "meg": str(root / "meg" / "model"), "bad": str(bad)}


def _interrupt(point):
    def pause(name):
        if name == point:
            raise KeyboardInterrupt
    return pause


def _disk_full(monkeypatch):
    class Full:
        def __init__(self, f):
            self._f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self._f, name)

    monkeypatch.setattr(reshard.io.partial, "open", lambda p, m="r": Full(open(p, m)), raising=False)


CASES = {  # name -> (args after SRC with {dst} / {src} / {parent} placeholders, expected exit code, setup)
    "impossible tp": (["{dst}", "--to", "megatron", "--tp", "3"], 2, None),
    "dst is src": (["{src}", "--to", "megatron", "--overwrite"], 2, None),
    "dst inside src": (["{src}/out", "--to", "megatron"], 2, None),
    "src inside dst, overwrite": (["{parent}", "--to", "megatron", "--overwrite"], 2, None),
    "dst exists": (["{existing}", "--to", "megatron"], 2, None),
    "disk full": (["{dst}", "--to", "megatron", "--tp", "2"], 3, "disk_full"),
    "interrupted mid-file": (["{dst}", "--to", "megatron", "--tp", "2"], 130, "partial"),
    "interrupted before publish": (["{dst}", "--to", "hf"], 130, "publish"),
    "overwrite interrupted": (["{existing}", "--to", "hf", "--overwrite"], 130, "publish"),
}


@pytest.mark.parametrize("source", ["hf", "meg"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_failure_leaves_source_untouched(trees, tmp_path, monkeypatch, source, case):
    src = trees[source]
    args, code, setup = CASES[case]
    if setup == "disk_full":
        _disk_full(monkeypatch)
    elif setup:
        monkeypatch.setattr(reshard.io.partial, "pause_point", _interrupt(setup))
        monkeypatch.setattr(reshard.staging, "pause_point", _interrupt(setup))
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("old output")
    values = {"dst": tmp_path / "out", "src": src, "parent": os.path.dirname(src), "existing": existing}
    before = snapshot(os.path.dirname(src))
    proc = run_main("convert", src, *[a.format(**values) for a in args])
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert snapshot(os.path.dirname(src)) == before
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
    assert (existing / "keep.txt").read_text() == "old output"


def test_replica_mismatch_and_verify_leave_sources_untouched(trees, tmp_path):
    before = {k: snapshot(v) for k, v in trees.items()}
    proc = run_main("convert", trees["bad"], tmp_path / "out", "--to", "hf")
    assert proc.returncode == 2 and "replicas of" in proc.stderr
    check = run_main("verify", trees["hf"], trees["bad"])  # rank 0's copy equals the source; rank 1's does not
    assert check.returncode == 1 and "replicas of" in check.stdout and "DIFFERENT" in check.stdout, check.stdout
    assert run_main("convert", trees["bad"], tmp_path / "out", "--to", "hf", "--allow-replica-mismatch").returncode == 0
    assert {k: snapshot(v) for k, v in trees.items()} == before
