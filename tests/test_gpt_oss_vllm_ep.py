"""gpt-oss written for vLLM with expert parallelism (``--to vllm --tp 2 --expert-parallel``, as vLLM's
``enable_expert_parallel`` loads it; families-2.md section 2.4: "With EP: experts sliced, nothing else"): each rank
holds its block of whole experts, their alternating ``w13`` rows and biases and their whole ``w2_bias`` (not rank 0's
only). The forward verifier adds an expert's down bias once per token and chosen expert, on the rank holding the
expert (reshard/verification/forward/gpt_oss_ops.py ``bias_ranks``): ``verify --forward --nproc 2`` is EQUAL on that
output and names layer 0 for perturbed ``w2_bias`` of the experts on rank 1 (slow). ``--ep`` with ``--to vllm`` is
one line, exit 2, nothing written."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from gpt_oss_cases import tiny_gpt_oss
from helpers import run_cli
from safetensors import safe_open
from safetensors.torch import load_file, save_file

E, H, I = 4, 64, 128
L1 = "model.layers.1.mlp.experts."


@pytest.fixture(scope="module")
def ep(tmp_path_factory):
    oss = tiny_gpt_oss(tmp_path_factory)
    out = str(tmp_path_factory.mktemp("oss_vllm_ep") / "vllm_ep")
    import reshard

    reshard.convert(oss, out, to="vllm", tp=2, expert_parallel=True)
    return oss, out


def rank_file(root, r: int) -> str:
    return os.path.join(root, f"model-rank-{r}-part-0.safetensors")


def test_each_rank_holds_whole_experts_with_their_biases(ep):
    oss, out = ep
    hf = load_file(os.path.join(oss, "model.safetensors"))
    for r in range(2):
        got = load_file(rank_file(out, r))
        mine = slice(2 * r, 2 * r + 2)  # vLLM's contiguous expert block of rank r
        assert torch.equal(got[L1 + "routed_experts.w13_weight"], hf[L1 + "gate_up_proj"][mine].transpose(1, 2))
        assert torch.equal(got[L1 + "routed_experts.w13_bias"], hf[L1 + "gate_up_proj_bias"][mine])
        assert torch.equal(got[L1 + "routed_experts.w2_weight"], hf[L1 + "down_proj"][mine].transpose(1, 2))
        assert torch.equal(got[L1 + "routed_experts.w2_bias"], hf[L1 + "down_proj_bias"][mine])  # not zeros on 1


def test_ep_flag_for_vllm_is_one_line(ep, tmp_path, capsys):
    oss, _ = ep
    code, _, err = run_cli(capsys, "convert", oss, tmp_path / "o", "--to", "vllm", "--tp", 2, "--ep", 2)
    assert code == 2 and not os.path.exists(tmp_path / "o") and len(err.strip().splitlines()) == 1, err
    assert "--expert-parallel" in err


@pytest.mark.slow
def test_verify_forward_on_expert_parallel_vllm(ep, tmp_path, capsys):
    oss, out = ep
    code, text, err = run_cli(capsys, "verify", oss, out, "--forward", "--nproc", 2)
    assert code == 0 and "FORWARD EQUAL" in text, text + err
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    path = rank_file(str(bad), 1)
    tensors = load_file(path)
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    tensors["model.layers.0.mlp.experts.routed_experts.w2_bias"] += 1.0  # experts 2 and 3, held by rank 1 alone
    save_file(tensors, path, metadata=metadata)
    code, text, err = run_cli(capsys, "verify", oss, bad, "--forward", "--nproc", 2)
    assert code == 1 and "layer 0" in text, text + err
