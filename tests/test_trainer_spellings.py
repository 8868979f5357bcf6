"""Checkpoints as trainers spell them (issue 42, items 5 and 6): DCP saves under the roots PyTorch's recipes use
(``{"model": sd, "optim": osd}``, ``{"app": AppState}``), transformers' FSDP2 architecture name
(``FSDPLlamaForCausalLM``), an incomplete torchtitan step named directly, a truncated ZeRO file, and DeepSeek's
router bias dtype in hf -> hf. Every DCP folder is a real ``dcp.save`` in this process (``no_dist=True``)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.stateful import Stateful

import reshard
from checkpoints import load_hf_tensors, make_hf
from helpers import run_cli
from reshard.errors import CheckpointError
from reshard.layouts.registry import detect, open_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore::FutureWarning")
FSDP_NOTE = "architecture FSDPLlamaForCausalLM read as LlamaForCausalLM (the name transformers writes under FSDP2)"


@pytest.fixture
def llama(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    """A tiny position-coded Llama HF folder (untied, an odd vocab) and its tensors."""
    folder = make_hf(tmp_path / "hf", hidden=32, heads=4, kv_heads=2, ffn=48, vocab=67)
    return folder, load_hf_tensors(folder)


def module_of(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose ``state_dict()`` is ``tensors`` under their own (HF) names."""
    root = torch.nn.Module()
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(tensor.clone()))
    return root


class AppState(Stateful):
    """PyTorch's "Getting started with DCP" recipe: model and optimizer state behind one Stateful."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state_dict):
        raise AssertionError("not loaded in these tests")


def trained_app(tensors: dict[str, torch.Tensor]) -> AppState:
    """An AppState after one AdamW step at lr 0 (exp_avg / exp_avg_sq / step exist, the weights are unchanged)."""
    model = module_of(tensors)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    sum(p.sum() for p in model.parameters()).backward()
    optimizer.step()
    assert all(torch.equal(p, tensors[n]) for n, p in model.named_parameters())
    return AppState(model, optimizer)


def assert_same(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and torch.equal(actual[name], tensor), name


# ------------------------------------------------------------------------------------ item 5: DCP roots

def test_model_and_optim_roots_read_bit_exact(llama, tmp_path):
    """``dcp.save({"model": sd, "optim": osd, "lr_scheduler": ...})``: the model under ``model.``, the others
    skipped with one note naming them."""
    hf, tensors = llama
    optim = {"state": {n: {"exp_avg": t + 1, "step": torch.tensor(3.0)} for n, t in tensors.items()},
             "param_groups": [{"lr": 1e-3, "params": sorted(tensors)}]}
    folder = tmp_path / "dcp"
    dcp.save({"model": tensors, "optim": optim, "lr_scheduler": {"last_epoch": 3}}, checkpoint_id=str(folder),
             no_dist=True)
    shutil.copy(os.path.join(hf, "config.json"), folder)
    result = reshard.convert(str(folder), str(tmp_path / "out"), to="hf")
    assert_same(load_hf_tensors(tmp_path / "out"), tensors)
    assert "skipped lr_scheduler, optim (DCP roots not holding model weights)" in result.plan.notes
    assert any("HF names under 'model.'" in n for n in result.plan.notes)


def test_app_state_recipe_read_bit_exact(llama, tmp_path, capsys):
    """``dcp.save({"app": AppState(model, optimizer)})``: keys ``app.model.<HF name>`` and
    ``app.optim.state.<HF name>.exp_avg`` (and byte items under ``app.optim.param_groups``)."""
    hf, tensors = llama
    folder = tmp_path / "dcp"
    dcp.save({"app": trained_app(tensors)}, checkpoint_id=str(folder), no_dist=True)
    from reshard.io.dcp import read_metadata

    keys = read_metadata(str(folder))[0]
    assert "app.model.lm_head.weight" in keys and "app.optim.state.lm_head.weight.exp_avg" in keys
    shutil.copy(os.path.join(hf, "config.json"), folder)
    code, _, err = run_cli(capsys, "convert", folder, tmp_path / "out", "--to", "hf")
    assert code == 0, err
    assert_same(load_hf_tensors(tmp_path / "out"), tensors)
    code, out, _ = run_cli(capsys, "inspect", folder, "--json")
    info = json.loads(out)
    assert code == 0 and info["keys"] == "app.model.<HF name>" and info["skipped"] == ["app.optim"]
    assert reshard.verify(str(folder), str(tmp_path / "out")).equal


def test_a_stray_key_under_the_model_root_is_still_refused(llama, tmp_path):
    hf, tensors = llama
    folder = tmp_path / "dcp"
    dcp.save({"model": {**tensors, "model.layers.0.extra.weight": torch.zeros(2)}, "optim": {"x": torch.ones(2)}},
             checkpoint_id=str(folder), no_dist=True)
    shutil.copy(os.path.join(hf, "config.json"), folder)
    with pytest.raises(CheckpointError, match=r"tensor 'model\.model\.layers\.0\.extra\.weight' is not a weight"):
        open_checkpoint(str(folder))


def test_only_training_state_roots_hold_no_model(llama, tmp_path):
    hf, _ = llama
    folder = tmp_path / "dcp"
    dcp.save({"optim": {"state": {"w": {"exp_avg": torch.ones(2)}}}, "lr_scheduler": {"last_epoch": 1}},
             checkpoint_id=str(folder), no_dist=True)
    shutil.copy(os.path.join(hf, "config.json"), folder)
    with pytest.raises(CheckpointError, match=r"holds no model tensors \(only lr_scheduler, optim\)"):
        open_checkpoint(str(folder))


# ---------------------------------------------------------------- item 5: FSDPLlamaForCausalLM

def _fsdp_named(config_path: str) -> None:
    with open(config_path) as f:
        config = json.load(f)
    config["architectures"] = ["FSDPLlamaForCausalLM"]
    with open(config_path, "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("forced", [False, True])
def test_fsdp_architecture_read_as_its_base_class(llama, tmp_path, capsys, forced):
    """save_pretrained under FSDP2 writes FSDPLlamaForCausalLM: read as LlamaForCausalLM with a note, written as
    LlamaForCausalLM; ``--architecture LlamaForCausalLM`` is the same class, not a relabel."""
    hf, tensors = llama
    src = shutil.copytree(hf, tmp_path / "fsdp")
    _fsdp_named(os.path.join(src, "config.json"))
    extra = ["--architecture", "LlamaForCausalLM"] if forced else []
    code, out, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "hf", *extra)
    assert code == 0, err
    assert FSDP_NOTE in out + err and "relabelled" not in out + err
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]
    assert_same(load_hf_tensors(tmp_path / "out"), tensors)
    assert reshard.verify(str(src), str(tmp_path / "out")).equal


def test_fsdp_architecture_of_an_accelerate_dcp_checkpoint(llama, tmp_path):
    """checkpoint-N/ (config.json naming FSDPLlamaForCausalLM) with pytorch_model_fsdp_0/ in accelerate's keys."""
    hf, tensors = llama
    ckpt = tmp_path / "checkpoint-4"
    dcp.save({"model": tensors}, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"), no_dist=True)
    shutil.copy(os.path.join(hf, "config.json"), ckpt)
    _fsdp_named(str(ckpt / "config.json"))
    with open_checkpoint(str(ckpt)) as source:
        assert source.layout == "dcp" and FSDP_NOTE in source.info["notes"]
    result = reshard.convert(str(ckpt), str(tmp_path / "out"), to="vllm", tp=2)
    assert FSDP_NOTE in result.plan.notes
    reshard.convert(str(tmp_path / "out"), str(tmp_path / "back"), to="hf")
    with open(tmp_path / "back" / "config.json") as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]
    assert_same(load_hf_tensors(tmp_path / "back"), tensors)


def test_another_forced_architecture_is_still_refused(llama, tmp_path, capsys):
    hf, _ = llama
    src = shutil.copytree(hf, tmp_path / "fsdp")
    _fsdp_named(os.path.join(src, "config.json"))
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "hf", "--architecture",
                           "Qwen2ForCausalLM")
    assert code == 2 and "names FSDPLlamaForCausalLM" in err and "different function" in err


# ------------------------------------------------------------------------------- item 6: smaller

def test_an_incomplete_torchtitan_step_named_directly(tmp_path, capsys):
    """(d) step-3/ holds data but no .metadata: a one-line message naming what is missing and the fix."""
    root = tmp_path / "titan"
    dcp.save({"tok_embeddings.weight": torch.zeros(4, 2)}, checkpoint_id=str(root / "step-1"), no_dist=True)
    (root / "step-3").mkdir()
    shutil.copy(root / "step-1" / "__0_0.distcp", root / "step-3")
    with pytest.raises(CheckpointError) as info:
        detect(str(root / "step-3"))
    message = str(info.value)
    assert "no .metadata" in message and "step-1" in message and str(root) in message
    assert "not a checkpoint reshard knows" not in message
    code, _, err = run_cli(capsys, "convert", root / "step-3", tmp_path / "out", "--to", "hf")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "incomplete torchtitan step" in err
    shutil.rmtree(root / "step-1")
    with pytest.raises(CheckpointError, match="no step of .+ is complete: save the checkpoint again"):
        detect(str(root / "step-3"))


@pytest.mark.parametrize("keep", ["head", "half"])
def test_a_truncated_zero_file_is_one_whole_sentence(llama, tmp_path, capsys, keep):
    """(b) A ZeRO model-states file cut short: one line naming the file, torch's reason whole, and the fix
    (the head alone: torch's zip error, once cut at 200 characters; half: its bare EINVAL, once exit 3 '?: ...')."""
    hf, tensors = llama
    tag = tmp_path / "ds" / "global_step1"
    tag.mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("global_step1")
    shutil.copy(os.path.join(hf, "config.json"), tmp_path / "ds")
    path = tag / "mp_rank_00_model_states.pt"
    torch.save({"module": tensors, "ds_version": "0.19.0"}, path)
    data = path.read_bytes()
    path.write_bytes(data[:100] if keep == "head" else data[:len(data) // 2])
    code, _, err = run_cli(capsys, "convert", tmp_path / "ds", tmp_path / "out", "--to", "hf")
    line = err.strip()
    assert code == 2 and len(line.splitlines()) == 1, err
    assert str(path) in line and line.endswith("the file is truncated or corrupt; copy it again from where it was "
                                               "saved, or save it again")
    if keep == "head":
        assert "(PytorchStreamReader failed reading zip archive: failed finding central directory)" in line


def test_router_bias_keeps_its_dtype_hf_to_hf(tmp_path):
    """(a) A bf16 DeepSeek-V3 checkpoint: e_score_correction_bias stays bf16 in hf -> hf without --dtype."""
    from safetensors.torch import load_file, save_file

    from deepseek_checkpoints import save_tiny

    src = save_tiny(str(tmp_path / "ds"), "v3", fill="position", mtp=False)
    path = os.path.join(src, "model.safetensors")
    tensors = {k: v.bfloat16() for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    reshard.convert(src, str(tmp_path / "out"), to="hf")
    assert_same(load_hf_tensors(tmp_path / "out"), tensors)
