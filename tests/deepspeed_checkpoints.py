"""Real DeepSpeed checkpoints for the tests (made by ``deepspeed_worker.py`` in a subprocess) and independent
readings of them: deepspeed's own ``zero_to_fp32`` (the oracle), ``module`` and the test's own reading of
BF16_Optimizer partitions from ``torch.load(weights_only=False)`` (the files are ours)."""

from __future__ import annotations

import glob
import math
import os
import re
import socket
import subprocess
import sys

import torch

WORKER = os.path.join(os.path.dirname(__file__), "deepspeed_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_checkpoints(out: str, world: int, cases: list[str], scratch: str) -> dict[str, str]:
    """Train and save each case (see ``deepspeed_worker.py``) at ``world``; returns case -> checkpoint root."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR":
           os.path.join(scratch, "torch_extensions"), "TRITON_CACHE_DIR": os.path.join(scratch, "triton")}
    proc = subprocess.run([sys.executable, WORKER, out, str(world), str(free_port()), *cases], env=env,
                          capture_output=True, text=True, timeout=600, start_new_session=True)
    roots = {case: os.path.join(out, case) for case in cases}
    missing = [c for c, r in roots.items() if not os.path.isfile(os.path.join(r, "latest"))]
    assert proc.returncode == 0 and not missing, (proc.returncode, missing, proc.stdout[-3000:], proc.stderr[-3000:])
    return roots


def make_universal(root: str, out: str) -> str:
    """deepspeed's ``ds_to_universal`` of checkpoint ``root`` into ``out`` (with the model's config.json)."""
    tag = open(os.path.join(root, "latest")).read().strip()
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           os.path.join(root, tag), "--output_folder", os.path.join(out, tag + "_universal"),
                           "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"],
                          env=env, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(root, "config.json")) as src, open(os.path.join(out, "config.json"), "w") as dst:
        dst.write(src.read())
    return out


def oracle(root: str) -> dict:
    """deepspeed's ``get_fp32_state_dict_from_zero_checkpoint`` (fp32 masters; frozen params in module dtype)."""
    import logging

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    return get_fp32_state_dict_from_zero_checkpoint(root)


def tag_folder(root: str) -> str:
    return os.path.join(root, open(os.path.join(root, "latest")).read().strip())


def module(root: str) -> dict:
    """``mp_rank_00_model_states.pt['module']`` (ZeRO-0/1/2, BF16_Optimizer)."""
    return torch.load(os.path.join(tag_folder(root), "mp_rank_00_model_states.pt"), weights_only=False)["module"]


def bf16_optimizer_masters(root: str) -> dict:
    """The fp32 masters of a BF16_Optimizer checkpoint, read independently of reshard from spec §2.3/§2.8:
    per group, the ranks' padded partitions concatenated hold the parameters of ``param_shapes`` back to back."""
    folder = tag_folder(root)
    states = torch.load(os.path.join(folder, "mp_rank_00_model_states.pt"), weights_only=False)
    paths = sorted(glob.glob(os.path.join(folder, "*_optim_states.pt")),
                   key=lambda p: int(re.search(r"zero_pp_rank_(\d+)_", p).group(1)))
    partitions = [torch.load(p, weights_only=False)["optimizer_state_dict"]["single_partition_of_fp32_groups"]
                  for p in paths]
    out = {}
    for g, shapes in enumerate(states["param_shapes"]):
        flat = torch.cat([ranks[g] for ranks in partitions])
        offset = 0
        for name, shape in shapes.items():
            out[name] = flat[offset:offset + math.prod(shape)].view(shape).clone()
            offset += math.prod(shape)
    return out


def fused(state: dict) -> dict:
    """An HF output's per-expert MoE weights stacked back into transformers 5's in-memory form
    (``experts.gate_up_proj [E, 2I, H]`` = per expert [gate; up], ``experts.down_proj [E, H, I]``)."""
    out, experts = {}, {}
    for name, tensor in state.items():
        m = re.match(r"(.*mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = tensor
        else:
            out[name] = tensor
    for base, per in experts.items():
        count = len(per)
        out[base + ".gate_up_proj"] = torch.stack([torch.cat([per[e]["gate_proj"], per[e]["up_proj"]])
                                                   for e in range(count)])
        out[base + ".down_proj"] = torch.stack([per[e]["down_proj"] for e in range(count)])
    return out


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))
