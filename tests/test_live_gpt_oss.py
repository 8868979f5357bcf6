"""Live resharding of gpt-oss (reshard/live; families-2.md sections 2.1 / 2.4 / 14.2 F): the alternating gate / up
rows HF (``gate_up_proj [E, H, 2I]``, ``gate_up_proj_bias``) and vLLM (``w13_weight [E, 2I/T, H]`` per rank,
``w13_bias``) store are read and placed through step-2 views (``reshard.io.pair_rows.paired_rows``), end to end in
the plan. Sources are the files ``reshard convert`` wrote; every placed tensor equals the file ``reshard convert``
writes for that target rank, bit for bit (transformers' tiny GptOss with seeded noise on every weight, so a
misplaced row fails):

- megatron tp2 ep2 (etp 1) -> vllm tp2 (an alternating target) and hf -> megatron tp2 ep2 (an alternating
  source), plus vllm tp2 -> hf (both; compared with the HF source file, which the chain reproduces bit for bit): the schedule emulated in this process (the first in the default set), and
  over a real 5-process gloo world (tests/live_gpt_oss_worker.py; slow), a target colocated with a source, small chunks.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from helpers import run_world
from live_gpt_oss_worker import rank_tensors
from safetensors.torch import load_file
from gpt_oss_cases import tiny_gpt_oss

import reshard
from reshard import live
from reshard.io.assemble import bits_equal
from reshard.live.schedule import build
from reshard.live.stats import Stats
from reshard.live.transfer import _destinations, place, slice_shape, source_slice

WORKER = os.path.join(os.path.dirname(__file__), "live_gpt_oss_worker.py")
MEGATRON = {"layout": "megatron", "tp": 2, "ep": 2, "etp": 1}
VLLM = {"layout": "vllm", "tp": 2}
HF = {"layout": "hf"}


def megatron_files(root: str) -> list[str]:
    """Megatron rank files in parallel-rank order (i = tp_rank + tp * ep_rank)."""
    return [os.path.join(root, "release", f"mp_rank_{i % 2:02d}_{i // 2:03d}", "model_optim_rng.pt") for i in range(4)]


def vllm_files(root: str) -> list[list[str]]:
    return [sorted(glob.glob(os.path.join(root, f"model-rank-{r}-part-*.safetensors"))) for r in range(2)]


def read(files) -> dict[str, torch.Tensor]:
    out = {}
    for f in [files] if isinstance(files, str) else files:
        out.update(rank_tensors(f))
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("live_gpt_oss")
    hf = tiny_gpt_oss(tmp_path_factory)
    reshard.convert(hf, str(root / "megatron"), to="megatron", tp=2, ep=2, etp=1)
    reshard.convert(hf, str(root / "vllm"), to="vllm", tp=2)
    vllm = vllm_files(str(root / "vllm"))
    assert all(len(f) == 1 for f in vllm)
    files = {"hf": [os.path.join(hf, "model.safetensors")], "megatron": megatron_files(str(root / "megatron")),
             "vllm": [f[0] for f in vllm]}
    return hf, files


CASES = [("megatron-vllm", MEGATRON, VLLM, [0, 1, 2, 3], [4, 1]), ("hf-megatron", HF, MEGATRON, [4], [0, 1, 2, 3]),
         ("vllm-hf", VLLM, HF, [2, 3], [3])]


def test_plan_reads_and_places_alternating_rows_end_to_end(ckpts):
    hf, files = ckpts
    plan = live.plan(hf, source=MEGATRON, target=VLLM, source_ranks=range(4), target_ranks=range(4, 6))
    w13 = {t.name: t.pair_interleaved for t in plan.targets[1] if t.pair_interleaved}
    assert w13 == {f"model.layers.{i}.mlp.experts.routed_experts.{n}": 128 for i in range(4) for n in ("w13_weight", "w13_bias")}
    plan = live.plan(hf, source=HF, target=MEGATRON, source_ranks=[0], target_ranks=range(1, 5))
    paired = {n: t.pair for n, t in plan.sources[0].items() if t.pair}
    assert paired == {f"model.layers.{i}.mlp.experts.{n}": (axis, 256) for i in range(4)
                      for n, axis in (("gate_up_proj", 2), ("gate_up_proj_bias", 1))}


@pytest.mark.parametrize("name, source, target, source_ranks, target_ranks",
                         [CASES[0], pytest.param(*CASES[1], marks=pytest.mark.slow)])
def test_emulated_schedule_places_what_convert_writes(ckpts, name, source, target, source_ranks, target_ranks):
    """The plan's schedule (4 KiB messages: alternating ops cut into several chunks) run in this process."""
    hf, files = ckpts
    ns, nt = len(source_ranks), len(target_ranks)
    plan = live.plan(hf, source=source, target=target, source_ranks=range(ns), target_ranks=range(ns, ns + nt))
    held = [read(f) for f in files[source["layout"]]]
    chunks = [c for msgs in build(plan, None, 4096).rounds for m in msgs for c in m.chunks]
    for j in range(nt):
        got = _destinations(plan, j, None, None, "cpu", Stats(0))  # as transfer makes them: padding zeroed
        for c in (c for c in chunks if c.target == j):
            tensor = plan.targets[j][c.tensor]
            pair = plan.sources[c.op.source][c.op.tensor].pair
            data = source_slice(held[c.op.source][c.op.tensor], c.op, tensor.axis, pair)
            assert tuple(data.shape) == slice_shape(plan, c.op, tensor.axis)
            place(got[tensor.name], c.op, tensor.axis, data.contiguous(), tensor.pair_interleaved)
        want = read(files[target["layout"]][j])
        assert sorted(got) == sorted(want)
        assert [n for n in want if not bits_equal(got[n], want[n])] == []


@pytest.mark.slow
def test_live_transfer_over_gloo_places_what_convert_writes(ckpts, tmp_path):
    hf, files = ckpts
    cases = [dict(name=name, config=hf, source=source, target=target, source_ranks=sr, target_ranks=tr,
                  source_files=files[source["layout"]], chunk_bytes=16384)
             for name, source, target, sr, tr in CASES]
    out = tmp_path / "world"
    out.mkdir()
    (out / "job.json").write_text(json.dumps({"cases": cases}))
    results, codes = run_world(WORKER, out / "job.json", 5, out, 240)
    assert codes == [0] * 5
    for case in cases:
        for rank in set(case["source_ranks"]) | set(case["target_ranks"]):
            assert results[rank][case["name"]]["error"] is None, (case["name"], rank)
        for j, rank in enumerate(case["target_ranks"]):
            got = load_file(out / f"{case['name']}-{j}.safetensors")
            want = read(files[case["target"]["layout"]][j])
            assert sorted(got) == sorted(want), case["name"]
            assert [n for n in want if not bits_equal(got[n], want[n])] == [], (case["name"], j)
    colocated = results[1]["megatron-vllm"]["stats"]
    assert colocated["local_bytes"] > 0 and colocated["bytes_received"] > 0
