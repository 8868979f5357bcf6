"""The command line end to end: demo, inspect, plan / --dry-run, verify (exit codes and JSON)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import hf_config, hf_tensor_shapes, make_hf, position_coded
from cli_inprocess import run_main


def cli(*args):
    """``reshard ARGS`` in this process (torch and the interpreter are already up);
    test_usage_errors_from_the_installed_executable runs the installed command."""
    return run_main(*args)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return make_hf(tmp_path_factory.mktemp("cli") / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, shards=3)


def test_inspect_json(hf, tmp_path):
    proc = cli("convert", hf, tmp_path / "m", "--to", "megatron", "--tp", "2", "--pp", "2", "--dtype", "bf16")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(cli("inspect", tmp_path / "m", "--json").stdout)
    assert (info["layout"], info["tp"], info["pp"], info["dtype"], info["architecture"]) == \
        ("megatron", 2, 2, "BF16", "LlamaForCausalLM")
    assert info["padded_vocab_size"] == 1024 and info["vocab_size"] == 1000
    assert sorted(info["files_per_rank"]) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    expected_params = sum(torch.Size(s).numel() for s in hf_tensor_shapes(json.load(open(os.path.join(hf, "config.json")))).values())
    assert info["parameters"] == expected_params
    info = json.loads(cli("inspect", hf, "--json").stdout)
    assert (info["layout"], info["tp"], info["dtype"], len(info["files_per_rank"]["all"])) == ("hf", 1, "F32", 3)


def test_dry_run_prints_plan_and_writes_nothing(hf, tmp_path):
    proc = cli("convert", hf, tmp_path / "out", "--to", "megatron", "--tp", "2", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "release/mp_rank_01/model_optim_rng.pt" in proc.stdout and "bytes read per source file" in proc.stdout
    assert not (tmp_path / "out").exists()
    plan = json.loads(cli("plan", hf, "--to", "megatron", "--tp", "2", "--json").stdout)
    assert len(plan["files"]) == 2
    total = sum(os.path.getsize(os.path.join(hf, f)) for f in os.listdir(hf) if f.endswith(".safetensors"))
    read = sum(plan["bytes_read_per_source"].values())
    assert 0 < read <= total  # padding rows are never read


def test_verify_detects_a_single_changed_element(hf, tmp_path):
    proc = cli("convert", hf, tmp_path / "m", "--to", "megatron", "--tp", "2")
    assert proc.returncode == 0
    ok = cli("verify", hf, tmp_path / "m", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["equal"] is True
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(hf):
        src = os.path.join(hf, name)
        if name.endswith(".safetensors"):
            tensors = load_file(src)
            if "model.layers.1.self_attn.k_proj.weight" in tensors:
                tensors["model.layers.1.self_attn.k_proj.weight"][3, 5] += 1
            save_file(tensors, broken / name, metadata={"format": "pt"})
        else:
            (broken / name).write_bytes(open(src, "rb").read())
    bad = cli("verify", tmp_path / "m", broken, "--json")
    assert bad.returncode == 1
    report = json.loads(bad.stdout)
    assert report["equal"] is False
    different = [t["name"] for t in report["tensors"] if t["status"] == "different"]
    assert different == ["model.layers.1.self_attn.k_proj.weight"]
    text = cli("verify", tmp_path / "m", broken)
    assert text.returncode == 1 and "DIFFERENT" in text.stdout and "k_proj" in text.stdout


def test_verify_reports_config_and_missing_tensors(tmp_path):
    a = make_hf(tmp_path / "a", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    b = make_hf(tmp_path / "b", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, tied=True)
    report = json.loads(cli("verify", a, b, "--json").stdout)
    assert {"key": "tied", "a": False, "b": True} in report["config_differences"]
    assert [t["name"] for t in report["tensors"] if t["status"] == "missing_in_b"] == ["lm_head.weight"]


def test_pytorch_model_bin_source(tmp_path):
    config = hf_config(hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    tensors = position_coded(hf_tensor_shapes(config))
    src = tmp_path / "bin"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    torch.save(tensors, src / "pytorch_model.bin")
    proc = cli("convert", src, tmp_path / "m", "--to", "megatron", "--tp", "2")
    assert proc.returncode == 0, proc.stderr
    proc = cli("convert", tmp_path / "m", tmp_path / "hf", "--to", "hf")
    out = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(out) == sorted(tensors) and all(out[k].equal(v) for k, v in tensors.items())


def test_inspect_summarises_long_file_lists(tmp_path):
    many = make_hf(tmp_path / "many", hidden=64, heads=8, kv_heads=4, ffn=96, vocab=1000, layers=6, shards=12)
    names = sorted(f for f in os.listdir(many) if f.endswith(".safetensors"))
    assert len(names) == 12
    text = cli("inspect", many)
    assert text.returncode == 0, text.stderr
    assert f"all: 12 files: {names[0]} … {names[-1]}" in " ".join(text.stdout.split())  # wrapped at 80 columns
    assert names[5] not in text.stdout  # not every name by default
    listed = cli("inspect", many, "--files").stdout
    assert all(n in listed for n in names)
    assert json.loads(cli("inspect", many, "--json").stdout)["files_per_rank"]["all"] == names
    proc = cli("convert", many, tmp_path / "m", "--to", "megatron", "--tp", "4", "--pp", "2")
    assert proc.returncode == 0, proc.stderr
    text = cli("inspect", tmp_path / "m").stdout
    assert "8 ranks (mp_rank_00_000 … mp_rank_03_001), 1 file each, 8 in all" in text
    assert "mp_rank_02_000" not in text and "mp_rank_02_000" in cli("inspect", tmp_path / "m", "--files").stdout


@pytest.mark.parametrize("args, option, fix", [
    (["convert", "a", "b", "--to", "tensorrt"], "--to", "choose one of hf, megatron, vllm"),
    (["convert", "a", "b", "--to", "hf", "--tp", "abc"], "--tp", "valid integer"),
    (["convert", "a", "--to", "hf"], "DST", "Missing argument"),
    (["verify", "a", "b", "--nproc", "x"], "--nproc", "valid integer"),
    (["convertt", "a"], "convertt", "No such command"),
])
def test_usage_errors_from_the_installed_executable(args, option, fix, tmp_path):
    """The console script a user runs (not the in-process CLI): one line naming the option, exit code 2."""
    exe = shutil.which("reshard") or os.path.join(os.path.dirname(sys.executable), "reshard")
    assert os.path.isfile(exe), "the reshard console script is not installed"
    proc = subprocess.run([exe, *args], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "RESHARD_DEBUG"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert option in lines[0] and fix in lines[0] and "internal error" not in lines[0]
    assert proc.stdout == ""
