"""The dcp layout against torch's own FSDP2 + DCP checkpoints in accelerate's naming (fsdp_worker.py), plain
``dcp.save`` folders of HF names, accelerate's FULL_STATE_DICT file, and its refusals."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from checkpoints import load_hf_tensors, make_hf
from fsdp_checkpoints import HF_LLAMA, fsdp_checkpoints, trained
from helpers import run_cli
from reshard.layouts.base import Options
from reshard.layouts.registry import detect, open_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    return fsdp_checkpoints(tmp_path_factory)


def assert_same(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def test_accelerate_sharded_state_dict_to_hf_bit_exact(fsdp, tmp_path, capsys):
    """checkpoint-N/ with config.json and pytorch_model_fsdp_0/ (keys model.<HF name>, vocab 67 in 34 + 33
    rows, o_proj / down_proj chunked across their split axis) -> HF equals the trained full_tensor()s."""
    accel = f"{fsdp}/accel"
    assert detect(accel).name == "dcp"
    code, _, err = run_cli(capsys, "convert", accel, tmp_path / "hf", "--to", "hf")
    assert code == 0, err
    assert_same(load_hf_tensors(tmp_path / "hf"), trained(fsdp, "accel"))
    assert run_cli(capsys, "verify", accel, tmp_path / "hf")[0] == 0
    code, out, _ = run_cli(capsys, "inspect", accel, "--json")
    info = json.loads(out)
    assert code == 0 and info["layout"] == "dcp" and info["checkpoint"] == "pytorch_model_fsdp_0"
    assert info["keys"] == "model.<HF name>"
    with open_checkpoint(f"{accel}/pytorch_model_fsdp_0") as source:  # the folder itself: config from its parent
        assert source.layout == "dcp" and source.model.num_layers == HF_LLAMA["num_hidden_layers"]


def test_accelerate_folder_without_config_needs_config(fsdp, tmp_path, capsys):
    shutil.copytree(f"{fsdp}/accel/pytorch_model_fsdp_0", tmp_path / "ckpt" / "pytorch_model_fsdp_0")
    code, _, err = run_cli(capsys, "convert", tmp_path / "ckpt", tmp_path / "out", "--to", "hf")
    assert code == 2 and "--config" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, "convert", tmp_path / "ckpt", tmp_path / "out", "--to", "hf", "--config",
                           f"{fsdp}/accel/config.json")
    assert code == 0, err
    assert_same(load_hf_tensors(tmp_path / "out"), trained(fsdp, "accel"))


def test_plain_dcp_save_of_hf_names_skips_training_state(tmp_path, capsys):
    """dcp.save(model.state_dict()) plus optimizer keys: bare HF names (which start with model. themselves)."""
    hf = make_hf(tmp_path / "hf", hidden=32, heads=4, kv_heads=2, ffn=48, vocab=67, tied=True)
    tensors = load_hf_tensors(hf)
    folder = tmp_path / "dcp"
    dcp.save({**tensors, "optimizer": {"state": {"x": {"exp_avg": torch.ones(3)}}}, "train_state": {"step": 7}},
             checkpoint_id=str(folder), no_dist=True)
    shutil.copy(os.path.join(hf, "config.json"), folder)
    import reshard

    result = reshard.convert(str(folder), str(tmp_path / "out"), to="hf")
    assert any("skipped" in n and "optimizer" in n and "train_state" in n for n in result.plan.notes)
    assert any("(torch.distributed.checkpoint, HF names)" in n for n in result.plan.notes)
    assert_same(load_hf_tensors(tmp_path / "out"), tensors)
    assert reshard.verify(str(folder), hf).equal


def test_accelerate_full_state_dict_bin(fsdp, tmp_path):
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    torch.save(trained(fsdp, "accel"), folder / "pytorch_model_fsdp.bin")
    (folder / "config.json").write_text(json.dumps(HF_LLAMA))
    assert detect(str(folder)).name == "dcp"
    import reshard

    reshard.convert(str(folder), str(tmp_path / "out"), to="hf")
    assert_same(load_hf_tensors(tmp_path / "out"), trained(fsdp, "accel"))


def test_fsdp1_local_state_dict_refused(tmp_path, capsys):
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    for rank in range(2):
        torch.save({"_flat_param": torch.zeros(10)}, folder / f"pytorch_model_fsdp_rank{rank}.bin")
    (folder / "config.json").write_text(json.dumps(HF_LLAMA))
    code, _, err = run_cli(capsys, "convert", folder, tmp_path / "out", "--to", "hf")
    assert code == 2 and "LOCAL_STATE_DICT" in err and "SHARDED_STATE_DICT" in err
    assert not (tmp_path / "out").exists()


def test_prefix_decided_by_the_family_names(tmp_path):
    """Keys that match the family neither bare nor under one model. prefix are refused by name."""
    hf = make_hf(tmp_path / "hf", hidden=32, heads=4, kv_heads=2, ffn=48, vocab=67)
    tensors = {"module." + k: v for k, v in load_hf_tensors(hf).items()}
    dcp.save(tensors, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    from reshard.errors import CheckpointError

    with pytest.raises(CheckpointError, match="tensor 'module[.].+' is not a weight of mapping 'llama'"):
        open_checkpoint(str(tmp_path / "dcp"), Options(config=os.path.join(hf, "config.json")))
