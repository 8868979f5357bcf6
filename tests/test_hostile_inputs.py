"""Hostile and broken checkpoints: pickles that would run code, damaged Megatron rank sets, HF indexes that lie.

Every case goes through the CLI: exit code 2, one line naming the file and what is wrong, no traceback, no
output, the source tree unchanged byte for byte, and no marker file from a pickle that would have run code.
"""

from __future__ import annotations

import fractions
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import reshard
from checkpoints import make_hf
from cli_inprocess import run_main
from megatron_rules import rank_file
from tree_snapshot import leftovers, snapshot


def run_cli(*args, cwd=None):
    """The real command line in a fresh interpreter (slow to start: used once per acceptance case)."""
    return subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "RESHARD_DEBUG": "0"}, timeout=300)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    hf = make_hf(root / "hf", hidden=64, heads=8, kv_heads=4, ffn=96, vocab=1000, shards=2)
    reshard.convert(hf, str(root / "tp2"), to="megatron", tp=2)
    reshard.convert(hf, str(root / "pp2"), to="megatron", tp=1, pp=2)
    reshard.convert(hf, str(root / "tp4"), to="megatron", tp=4)
    return root


def copy(base, name, tmp_path):
    return shutil.copytree(base / name, tmp_path / name)


def assert_refused(proc, *needles, out=None):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    if out is not None:
        assert not os.path.exists(out)
        assert not leftovers(os.path.dirname(out))


class _System:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Open:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _poison(path, obj, where="evil"):
    """Add ``obj`` to a rank file's pickle (the file is ours: loading it unsafely here is fine)."""
    state = torch.load(path, weights_only=False)
    if where == "args":
        state["args"].evil = obj
    else:
        state[where] = obj
    torch.save(state, path)


@pytest.mark.parametrize("kind", ["system", "open"])
@pytest.mark.parametrize("where", ["evil", "args"])
def test_code_running_pickle_is_refused_and_never_runs(base, tmp_path, kind, where):
    meg = copy(base, "tp2", tmp_path)
    marker = tmp_path / "MARKER"
    _poison(rank_file(meg, 1, 0, 1), _System(marker) if kind == "system" else _Open(str(marker)), where)
    assert not marker.exists()
    global_name = "posix.system" if kind == "system" else "io.open"
    before = snapshot(meg)
    out = tmp_path / "out"
    commands = (["convert", meg, out, "--to", "hf"], ["convert", meg, out, "--to", "megatron", "--tp", "1"],
                ["inspect", meg], ["verify", base / "hf", meg], ["verify", meg, base / "hf"],
                ["convert", meg, out, "--to", "hf", "--dry-run"])
    for i, args in enumerate(commands):
        proc = run_cli(*args, cwd=tmp_path) if i == 0 and where == "evil" else run_main(*args)
        assert_refused(proc, f"global '{global_name}'", "allow-list", "mp_rank_01", out=out)
        assert not marker.exists()
    assert snapshot(meg) == before


def test_harmless_but_unlisted_class_is_refused_by_name(base, tmp_path):
    meg = copy(base, "tp2", tmp_path)
    _poison(rank_file(meg, 0, 0, 1), fractions.Fraction(1, 3))
    assert_refused(run_main("convert", meg, tmp_path / "out", "--to", "hf"), "global 'fractions.Fraction'",
                   out=tmp_path / "out")


def test_poisoned_pytorch_model_bin_is_refused(tmp_path):
    marker = tmp_path / "MARKER"
    hf = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    from safetensors.torch import load_file

    state = load_file(os.path.join(hf, "model.safetensors"))
    os.unlink(os.path.join(hf, "model.safetensors"))
    state["evil"] = _System(marker)
    torch.save(state, os.path.join(hf, "pytorch_model.bin"))
    before = snapshot(hf)
    assert_refused(run_main("convert", hf, tmp_path / "out", "--to", "megatron"), "posix.system",
                   "pytorch_model.bin", out=tmp_path / "out")
    assert not marker.exists() and snapshot(hf) == before


def _truncate(path, keep):
    with open(path, "r+b") as f:
        f.truncate(keep)


@pytest.mark.parametrize("damage, needles", [
    ("extra_rank", ["tensor_model_parallel_size=2", "rank folders give 3"]),
    ("missing_rank_file", ["mp_rank_01", "has no model_optim_rng.pt"]),
    ("rank_from_other_tp", ["mp_rank_01", "the config implies"]),
    ("truncated_rank", ["mp_rank_01", "not a readable torch checkpoint"]),
    ("truncated_header", ["mp_rank_01", "not a readable torch checkpoint"]),
    ("tracker_points_nowhere", ["iter_0000042, which does not exist"]),
])
def test_broken_tp_sets(base, tmp_path, damage, needles):
    meg = copy(base, "tp2", tmp_path)
    r1 = rank_file(meg, 1, 0, 1)
    if damage == "extra_rank":
        shutil.copytree(os.path.dirname(rank_file(meg, 0, 0, 1)), os.path.join(os.path.dirname(os.path.dirname(r1)),
                                                                                "mp_rank_02"))
    elif damage == "missing_rank_file":
        os.unlink(r1)
    elif damage == "rank_from_other_tp":
        shutil.copy(rank_file(base / "tp4", 1, 0, 1), r1)
    elif damage == "truncated_rank":
        _truncate(r1, os.path.getsize(r1) // 2)
    elif damage == "truncated_header":
        _truncate(r1, 100)
    else:
        (meg / "latest_checkpointed_iteration.txt").write_text("42\n")
    before = snapshot(meg)
    for cmd in (["convert", meg, tmp_path / "out", "--to", "hf"], ["inspect", meg]):
        assert_refused(run_main(*cmd), *needles, out=tmp_path / "out")
    assert snapshot(meg) == before


def test_missing_pipeline_stage(base, tmp_path):
    meg = copy(base, "pp2", tmp_path)
    shutil.rmtree(os.path.dirname(rank_file(meg, 0, 1, 2)))
    assert_refused(run_main("convert", meg, tmp_path / "out", "--to", "hf"), "pipeline_model_parallel_size=2",
                   out=tmp_path / "out")


@pytest.mark.parametrize("damage, needles", [
    ("tensor_elsewhere", ["model.safetensors.index.json", "model.norm.weight", "does not hold it"]),
    ("missing_file", ["model.safetensors.index.json", "model-00003-of-00003.safetensors", "does not exist"]),
    ("not_a_map", ["model.safetensors.index.json", "weight_map"]),
    ("truncated_shard", ["model-00002-of-00002.safetensors", "outside the data"]),
])
def test_lying_hf_index_or_damaged_shard(base, tmp_path, damage, needles):
    hf = copy(base, "hf", tmp_path)
    index_path = hf / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    if damage == "tensor_elsewhere":
        first = sorted(set(index["weight_map"].values()))[0]
        assert index["weight_map"]["model.norm.weight"] != first
        index["weight_map"]["model.norm.weight"] = first
    elif damage == "missing_file":
        index["weight_map"]["model.norm.weight"] = "model-00003-of-00003.safetensors"
    elif damage == "not_a_map":
        index["weight_map"] = ["model.norm.weight"]
    else:
        shard = hf / "model-00002-of-00002.safetensors"
        _truncate(shard, os.path.getsize(shard) - 4)
    index_path.write_text(json.dumps(index))
    before = snapshot(hf)
    for cmd in (["convert", hf, tmp_path / "out", "--to", "megatron", "--tp", "2"], ["inspect", hf],
                ["verify", hf, base / "hf"]):
        assert_refused(run_main(*cmd), *needles, out=tmp_path / "out")
    assert snapshot(hf) == before


def test_control_characters_in_a_tensor_name_stay_on_one_line(tmp_path):
    from safetensors.torch import save_file

    hf = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    from safetensors.torch import load_file

    state = load_file(os.path.join(hf, "model.safetensors"))
    state["evil\nerror: fake second line\x1b[2J"] = torch.zeros(2)
    save_file(state, os.path.join(hf, "model.safetensors"))
    proc = run_main("inspect", hf)
    assert_refused(proc, "is not a weight of mapping", "\\n", "\\x1b")
