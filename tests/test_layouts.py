"""The layout registry: a layout defined in the test tree plugs in (Python registration and the entry-point group)
with no change to the converter or the CLI; every registered layout honours the contract; names never clobber."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoints import load_hf_tensors, make_hf
from cli_inprocess import run_main
from reshard.errors import CheckpointError, PlanError, ReshardError
from reshard.layouts import Layout, detect, get_layout, layout_names, register_layout, unregister_layout
from toy_layout import ToyLayout

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return make_hf(tmp_path_factory.mktemp("layouts") / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000,
                   shards=2)


@pytest.fixture
def toy():
    register_layout("toy", ToyLayout)
    try:
        yield
    finally:
        unregister_layout("toy")


def assert_same_tensors(a: str, b: str) -> None:
    ta, tb = load_hf_tensors(a), load_hf_tensors(b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), name


def test_toy_layout_round_trips_through_the_cli(hf, tmp_path, toy):
    assert "toy" in run_main("convert", "--help").stdout
    proc = run_main("convert", hf, tmp_path / "toy", "--to", "toy")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "toy" / "toy.json").is_file()
    assert len(list((tmp_path / "toy" / "tensors").glob("*.safetensors"))) == len(load_hf_tensors(hf))
    assert detect(str(tmp_path / "toy")).name == "toy"
    info = json.loads(run_main("inspect", tmp_path / "toy", "--json").stdout)
    assert (info["layout"], info["tp"]) == ("toy", 1)
    proc = run_main("convert", tmp_path / "toy", tmp_path / "meg", "--to", "megatron", "--tp", "2")
    assert proc.returncode == 0, proc.stderr
    proc = run_main("convert", tmp_path / "meg", tmp_path / "back", "--to", "hf")
    assert proc.returncode == 0, proc.stderr
    assert_same_tensors(hf, str(tmp_path / "back"))
    assert run_main("verify", hf, tmp_path / "toy").returncode == 0
    # The toy layout has no rank loader: --forward refuses before any worker starts, naming what it can read.
    proc = run_main("verify", "--forward", hf, tmp_path / "toy")
    assert proc.returncode == 2
    assert "forward verifier cannot read" in proc.stderr and "hf, megatron, vllm" in proc.stderr


def test_help_and_choices_follow_the_registry(toy):
    unregister_layout("toy")
    assert "toy" not in layout_names()
    assert "toy" not in run_main("convert", "--help").stdout
    proc = run_main("convert", "a", "b", "--to", "toy")
    assert proc.returncode == 2 and "'toy' is not a layout reshard writes" in proc.stderr
    register_layout("toy", ToyLayout)
    assert "toy" in run_main("convert", "--help").stdout


def test_names_are_never_clobbered(toy):
    with pytest.raises(ReshardError, match="'toy' is already registered by toy_layout"):
        register_layout("toy", "toy_layout:ToyLayout")
    with pytest.raises(ReshardError, match="already registered by reshard"):
        register_layout("hf", ToyLayout)
    with pytest.raises(ReshardError, match="name is 'toy', not 'toy2'"):
        register_layout("toy2", ToyLayout)
    with pytest.raises(ReshardError, match="does not subclass"):
        register_layout("toy2", dict)
    with pytest.raises(ReshardError, match="built-in layout"):
        unregister_layout("megatron")
    with pytest.raises(PlanError, match="unknown layout 'nope': use one of hf, megatron, vllm, torch_dist, trtllm, meta, deepspeed, dcp, torchtitan, maxtext, toy"):
        get_layout("nope")


def test_a_detection_tie_is_refused(hf, tmp_path, toy):
    class Greedy(Layout):
        name = "greedy"
        specificity = 10

        def detect(self, names):
            return "toy.json" in names

    register_layout("greedy", Greedy)
    try:
        folder = tmp_path / "x"
        shutil.copytree(hf, folder)
        (folder / "toy.json").write_text("{}")
        with pytest.raises(CheckpointError, match="looks like toy and greedy checkpoints at once"):
            detect(str(folder))
    finally:
        unregister_layout("greedy")


def test_unknown_folder_lists_every_layout(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError) as info:
        detect(str(tmp_path))
    for name in layout_names():
        assert f"{name}: {get_layout(name).summary}" in str(info.value)


@pytest.mark.parametrize("name", layout_names(writes=True))
def test_layout_contract(hf, tmp_path, name):
    """Every writable layout: detected as itself (and only itself), read back bit-exact to HF, verified equal."""
    out = tmp_path / name
    extra = ("--maxtext-model", "llama3-8b") if name == "maxtext" else ()  # its RoPE / query-scale conventions
    assert run_main("convert", hf, out, "--to", name, *extra).returncode == 0
    names_matching = [n for n in layout_names() if get_layout(n).detect(
        __import__("reshard.layouts.registry", fromlist=["x"]).folder_listing(str(out)))]
    top = max(get_layout(n).specificity for n in names_matching)
    assert [n for n in names_matching if get_layout(n).specificity == top] == [name]
    assert any((out / m).exists() for m in get_layout(name).completion_markers)
    proc = run_main("convert", out, tmp_path / "back", "--to", "hf")
    assert proc.returncode == 0, proc.stderr
    assert_same_tensors(hf, str(tmp_path / "back"))


def _installed_reshard() -> str:
    exe = shutil.which("reshard") or os.path.join(os.path.dirname(sys.executable), "reshard")
    assert os.path.isfile(exe), "the reshard console script is not installed (pip install -e .)"
    return exe


def test_entry_point_plugin_in_the_installed_executable(hf, tmp_path):
    """A package that declares ``[reshard.layouts] toy = toy_layout:ToyLayout`` plugs into every process."""
    site = tmp_path / "site"
    dist = site / "reshard_toy-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: reshard-toy\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[reshard.layouts]\ntoy = toy_layout:ToyLayout\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(TESTS)]))
    env.pop("RESHARD_DEBUG", None)
    exe = _installed_reshard()

    def run(*args):
        return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, env=env, timeout=300)

    assert "toy" in run("convert", "--help").stdout
    proc = run("convert", hf, tmp_path / "toy", "--to", "toy")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(run("inspect", tmp_path / "toy", "--json").stdout)["layout"] == "toy"
    proc = run("convert", tmp_path / "toy", tmp_path / "back", "--to", "hf")
    assert proc.returncode == 0, proc.stderr
    assert_same_tensors(hf, str(tmp_path / "back"))
    # A plug-in may not take a built-in name: skipped with a warning naming both, the built-in stays.
    (dist / "entry_points.txt").write_text("[reshard.layouts]\nhf = toy_layout:ToyLayout\n")
    proc = run("inspect", hf, "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["layout"] == "hf"
    assert "ignoring the 'hf' entry point of reshard-toy" in proc.stderr
    assert "already registered by reshard (built in)" in proc.stderr
