"""Impossible requests fail at plan time with one line and a non-zero exit, before anything is written;
replicated tensors that disagree are reported; existing outputs are protected."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import reshard
from checkpoints import make_hf
from megatron_rules import rank_file


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "RESHARD_DEBUG": "0"})


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    # 8 heads, 2 KV groups, 2 layers
    return make_hf(tmp_path_factory.mktemp("src") / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)


@pytest.mark.parametrize("args, message", [
    (["--to", "megatron", "--tp", "8"], "num_query_groups % tp"),
    (["--to", "megatron", "--tp", "3"], "heads % tp"),
    (["--to", "megatron", "--pp", "4"], "more than the model's 2 layers"),
    (["--to", "hf", "--tp", "2"], "--tp and --pp must be 1"),
    (["--to", "megatron", "--dtype", "fp8"], "unknown --dtype"),
])
def test_plan_time_errors_write_nothing(hf, tmp_path, args, message):
    out = tmp_path / "out"
    proc = run_cli("convert", hf, out, *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if "reshard" in p.name]


def test_debug_env_shows_traceback(hf, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "reshard", "convert", hf, tmp_path / "o", "--to", "megatron",
                           "--tp", "8"], capture_output=True, text=True, env={**os.environ, "RESHARD_DEBUG": "1"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_existing_output_needs_overwrite_and_survives_until_done(hf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    proc = run_cli("convert", hf, out, "--to", "megatron", "--tp", "2")
    assert proc.returncode == 2 and "--overwrite" in proc.stderr
    assert (out / "old.txt").read_text() == "keep me"
    proc = run_cli("convert", hf, out, "--to", "megatron", "--tp", "2", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert not (out / "old.txt").exists() and (out / "latest_checkpointed_iteration.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging or old folders left behind


def test_output_inside_source_is_refused(hf):
    proc = run_cli("convert", hf, os.path.join(hf, "nested"), "--to", "megatron")
    assert proc.returncode == 2 and "overlaps the source" in proc.stderr


def test_source_is_never_modified(hf, tmp_path):
    before = {p: (os.path.getmtime(os.path.join(hf, p)), os.path.getsize(os.path.join(hf, p))) for p in os.listdir(hf)}
    reshard.convert(hf, str(tmp_path / "m"), to="megatron", tp=2, pp=2)
    after = {p: (os.path.getmtime(os.path.join(hf, p)), os.path.getsize(os.path.join(hf, p))) for p in os.listdir(hf)}
    assert before == after


def _tamper(path, name, fn):
    import argparse

    with torch.serialization.safe_globals([argparse.Namespace]):
        state = torch.load(path, weights_only=True)
    state["model"][name] = fn(state["model"][name])
    torch.save(state, path)


def test_replica_mismatch_is_reported(hf, tmp_path):
    meg = tmp_path / "m"
    reshard.convert(hf, str(meg), to="megatron", tp=2)
    name = "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"
    _tamper(rank_file(meg, 1, 0, 1), name, lambda t: t + 0.5)
    proc = run_cli("convert", meg, tmp_path / "hf", "--to", "hf")
    assert proc.returncode == 2
    assert "model.layers.1.post_attention_layernorm.weight" in proc.stderr and "0.5" in proc.stderr
    assert "--allow-replica-mismatch" in proc.stderr and not (tmp_path / "hf").exists()
    proc = run_cli("convert", meg, tmp_path / "hf", "--to", "hf", "--allow-replica-mismatch")
    assert proc.returncode == 0 and "warning" in proc.stderr
    assert reshard.verify(hf, str(tmp_path / "hf")).equal  # rank 0's copy was taken


def test_tied_last_stage_copy_is_checked(tmp_path):
    src = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, tied=True)
    meg = tmp_path / "m"
    reshard.convert(src, str(meg), to="megatron", tp=1, pp=2)
    _tamper(rank_file(meg, 0, 1, 2), "output_layer.weight", lambda t: t * 2)
    with pytest.raises(reshard.CheckpointError, match="model.embed_tokens.weight"):
        reshard.convert(str(meg), str(tmp_path / "back"), to="hf")


def test_missing_rank_folder(hf, tmp_path):
    import shutil

    meg = tmp_path / "m"
    reshard.convert(hf, str(meg), to="megatron", tp=2, pp=2)
    shutil.rmtree(os.path.dirname(rank_file(meg, 1, 0, 2)))
    proc = run_cli("inspect", meg)
    assert proc.returncode == 2 and "mp_rank_01_000 is missing" in proc.stderr


def test_shape_contradicting_config(hf, tmp_path):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(hf, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (bad / "config.json").write_text(json.dumps(cfg))
    proc = run_cli("convert", bad, tmp_path / "o", "--to", "megatron")
    assert proc.returncode == 2 and "config implies" in proc.stderr


def test_unknown_architecture_lists_known(hf, tmp_path):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(hf, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    proc = run_cli("inspect", bad)
    assert proc.returncode == 2 and "LlamaForCausalLM" in proc.stderr and "--mapping" in proc.stderr
