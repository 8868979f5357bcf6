"""Megatron's expert-TP degree when ``--etp`` is left out (reshard/layouts/expert_tp.py; families-2.md sections 2.3
and 17): gpt-oss's experts have biases, which megatron-core holds only at ``expert_tensor_parallel_size = 1``, so
``--to megatron --tp 2`` (and torch_dist) chooses expert-TP 1 and the plan and the convert report say so and why;
every TP rank holds each expert whole (fc1 = HF's ``gate_up_proj[e].T`` de-interleaved to ``[gate; up]``, fc2 =
``down_proj[e].T``, biases whole), the rank files equal an explicit ``--etp 1`` bit for bit; an explicit
``--etp 2`` is still refused with section 17's line; a MoE without expert biases (Mixtral) keeps expert-TP = tp."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import run_cli
from live_gpt_oss_worker import rank_tensors
from live_worker import tiny_mixtral
from safetensors.torch import load_file
from gpt_oss_cases import tiny_gpt_oss

from reshard import live

NOTE = ("expert-TP 1 chosen (--etp not given, not --tp 2): megatron-core supports MoE biases only at "
        "expert_tensor_parallel_size = 1 and these experts have biases")
SECTION_17 = "megatron-core requires expert_tensor_parallel_size = 1 for MoE biases (gpt-oss experts have biases)."


def rank_file(root, tp_rank: int) -> str:
    return os.path.join(str(root), "release", f"mp_rank_{tp_rank:02d}", "model_optim_rng.pt")


def megatron_args(path):
    import argparse

    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)["args"]


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    return tiny_gpt_oss(tmp_path_factory)


def test_tp2_without_etp_chooses_expert_tp_1_and_says_why(oss, tmp_path, capsys):
    code, out, err = run_cli(capsys, "plan", oss, "--to", "megatron", "--tp", 2)
    assert code == 0 and NOTE in out + err, err
    code, out, err = run_cli(capsys, "convert", oss, tmp_path / "default", "--to", "megatron", "--tp", 2)
    assert code == 0 and NOTE in out + err, err
    code, _, err = run_cli(capsys, "convert", oss, tmp_path / "etp1", "--to", "megatron", "--tp", 2, "--etp", 1)
    assert code == 0 and NOTE not in err, err
    hf = load_file(os.path.join(oss, "model.safetensors"))
    h = "model.layers.3.mlp.experts."
    for t in range(2):
        assert megatron_args(rank_file(tmp_path / "default", t)).expert_tensor_parallel_size == 1
        got = rank_tensors(rank_file(tmp_path / "default", t))
        assert got.keys() == rank_tensors(rank_file(tmp_path / "etp1", t)).keys()
        want = rank_tensors(rank_file(tmp_path / "etp1", t))
        assert all(torch.equal(got[n], want[n]) for n in want)
        for e in range(4):
            m = f"decoder.layers.3.mlp.experts.local_experts.{e}."
            w, b = hf[h + "gate_up_proj"][e].T, hf[h + "gate_up_proj_bias"][e]
            assert torch.equal(got[m + "linear_fc1.weight"], torch.cat([w[0::2], w[1::2]]))  # whole: ETP 1
            assert torch.equal(got[m + "linear_fc1.bias"], torch.cat([b[0::2], b[1::2]]))
            assert torch.equal(got[m + "linear_fc2.weight"], hf[h + "down_proj"][e].T)
            assert torch.equal(got[m + "linear_fc2.bias"], hf[h + "down_proj_bias"][e])


def test_explicit_etp_2_is_refused_torch_dist_and_live_plan_default_to_1(oss, tmp_path, capsys):
    code, out, err = run_cli(capsys, "convert", oss, tmp_path / "etp2", "--to", "megatron", "--tp", 2, "--etp", 2)
    lines = err.strip().splitlines()
    assert code == 2 and not os.path.exists(tmp_path / "etp2") and len(lines) == 1, err
    assert SECTION_17 in lines[0] and "--etp 1" in lines[0]
    code, out, err = run_cli(capsys, "plan", oss, "--to", "torch_dist", "--tp", 2, "--json")
    assert code == 0 and NOTE in out + err, err
    plan = live.plan(oss, source={"layout": "hf"}, target={"layout": "megatron", "tp": 2}, source_ranks=[0],
                     target_ranks=[1, 2])
    fc1 = {t.name: t.shape for t in plan.targets[1] if t.name.endswith("local_experts.0.linear_fc1.weight")}
    assert set(fc1.values()) == {(256, 64)}  # 2I x H: each expert whole on TP rank 1


def test_mixtral_keeps_expert_tp_equal_to_tp(tmp_path, capsys):
    moe = tiny_mixtral(tmp_path)
    code, out, err = run_cli(capsys, "convert", moe, tmp_path / "m", "--to", "megatron", "--tp", 2)
    assert code == 0 and "expert-TP 1" not in out + err, err
    assert megatron_args(rank_file(tmp_path / "m", 0)).expert_tensor_parallel_size == 2
