"""reshard.live between processes (gloo on CPU, 127.0.0.1): every target rank's tensors equal ``reshard.load_rank``
of the same model for that rank, bit for bit, the source tensors also taken from ``load_rank``; counted sends
give each target byte exactly once and no source rank more than its share; ``into=`` fills given tensors in place;
a rank that raises or is killed mid-transfer makes every other rank raise within the timeout, and no process is
left. One world of 6 processes runs all the transfers of a family in turn (tests/live_worker.py)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from checkpoints import make_hf
from helpers import run_world
from live_worker import tiny_mixtral
from reshard import live

WORKER = os.path.join(os.path.dirname(__file__), "live_worker.py")
MEGATRON_TP2_PP2 = {"layout": "megatron", "tp": 2, "pp": 2}
VLLM_TP2 = {"layout": "vllm", "tp": 2}


def launch(tmp_path, name: str, world: int, cases: list[dict], wait: float = 150.0, **job):
    """Run ``cases`` on ``world`` worker processes; (results per rank, return codes). Every process is gone at
    the end: the ones still alive after ``wait`` seconds are killed with their process group (and fail)."""
    out = tmp_path / name
    out.mkdir()
    path = out / "job.json"
    path.write_text(json.dumps({"cases": cases, **job}))
    return run_world(WORKER, path, world, out, wait)


def case(name, ckpt, source, target, source_ranks, target_ranks, **extra) -> dict:
    return dict(name=name, ckpt=ckpt, config=ckpt, source=source, target=target, source_ranks=source_ranks,
                target_ranks=target_ranks, **extra)


def check_case(results: list[dict], spec: dict) -> None:
    """Every participant succeeded; each target equals load_rank; counted bytes are each target byte once and
    each source's share (its own bytes plus at most a fair part of the replicas it holds) at most."""
    plan = live.plan(spec["config"], source=spec["source"], target=spec["target"],
                     source_ranks=spec["source_ranks"], target_ranks=spec["target_ranks"])
    mine = {r: results[r][spec["name"]] for r in set(spec["source_ranks"]) | set(spec["target_ranks"])}
    for rank, res in mine.items():
        assert res["error"] is None, (spec["name"], rank, res["error"])
    dtype = spec.get("dtype")
    for j, rank in enumerate(spec["target_ranks"]):
        res = mine[rank]
        assert res["names_equal"] and res["mismatch"] == [], (spec["name"], rank, res["mismatch"])
        sent_here = sum(mine[s]["stats"]["sent"].get(str(rank), 0) for s in spec["source_ranks"] if s != rank)
        assert sent_here == res["stats"]["bytes_received"]
        assert sent_here + res["stats"]["local_bytes"] == plan.payload_bytes(j, dtype), (spec["name"], rank)
        if spec.get("into"):
            assert res["in_place"] and res["allocated"] == [], (spec["name"], rank)
    unique, holdable, fair = ([0] * len(spec["source_ranks"]) for _ in range(3))
    biggest = 0
    for tensors in plan.targets:
        for t in tensors:
            for op, holders in zip(t.reads, t.holders):
                n = plan.op_elements(op, t.axis) * 4  # fp32 models
                if len(holders) == 1:
                    unique[holders[0]] += n
                else:
                    biggest = max(biggest, n)
                for h in holders:
                    holdable[h] += n if len(holders) > 1 else 0
                    fair[h] += n / len(holders)
    for i, rank in enumerate(spec["source_ranks"]):
        stats = mine[rank]["stats"]
        moved = stats["bytes_sent"] + (stats["local_bytes"] if rank in spec["target_ranks"] else 0)
        if spec.get("dtype") is None:  # its own bytes plus the replicas it stands in for, near its fair part
            assert unique[i] <= moved <= unique[i] + holdable[i], (spec["name"], rank)
            assert moved <= 1.05 * fair[i] + biggest, (spec["name"], rank, moved, fair[i])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    return {"llama": make_hf(root / "llama", vocab=1000, kv_heads=4), "mixtral": tiny_mixtral(root)}


def family_cases(ckpt: str, family: str) -> list[dict]:
    """The acceptance transfers of issue 34 for one family, on 6 processes."""
    cases = [
        case("tp2pp2-vllm2-disjoint", ckpt, MEGATRON_TP2_PP2, VLLM_TP2, [0, 1, 2, 3], [4, 5], chunk_bytes=8192),
        case("tp4-vllm2-colocated", ckpt, {"layout": "megatron", "tp": 4}, VLLM_TP2, [0, 1, 2, 3], [0, 2]),
        case("vllm2-tp1pp2", ckpt, VLLM_TP2, {"layout": "megatron", "tp": 1, "pp": 2}, [4, 5], [0, 1]),
        case("megatron-hf", ckpt, MEGATRON_TP2_PP2, {"layout": "hf"}, [0, 1, 2, 3], [4], chunk_bytes=65536),
        case("into", ckpt, MEGATRON_TP2_PP2, VLLM_TP2, [0, 1, 2, 3], [4, 5], into=True, chunk_bytes=4096),
        case("into-bf16", ckpt, MEGATRON_TP2_PP2, VLLM_TP2, [0, 1, 2, 3], [1, 5], into="bfloat16"),
        case("cast-bf16", ckpt, {"layout": "megatron", "tp": 2}, VLLM_TP2, [2, 3], [3, 4], dtype="bf16"),
    ]
    if family == "mixtral":
        ep = {"layout": "megatron", "tp": 2, "ep": 2}
        cases += [case("tp2ep2-vllm2-ep", ckpt, ep, dict(VLLM_TP2, expert_parallel=True), [0, 1, 2, 3], [4, 5]),
                  case("tp2ep2-vllm2-ep-into", ckpt, ep, dict(VLLM_TP2, expert_parallel=True), [0, 1, 2, 3], [4, 5],
                       into=True, chunk_bytes=16384),
                  case("tp2ep2-hf", ckpt, ep, {"layout": "hf"}, [0, 1, 2, 3], [5])]
    return cases


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_live_transfers_equal_load_rank_bit_for_bit(models, tmp_path, family):
    cases = family_cases(models[family], family)
    results, codes = launch(tmp_path, family, 6, cases)
    assert codes == [0] * 6
    for spec in cases:
        check_case(results, spec)
    into = results[4]["into"]
    assert into["in_place"]  # every vLLM tensor, the fused qkv_proj / gate_up_proj (and w13_weight) included
    if family == "mixtral":
        assert results[4]["tp2ep2-vllm2-ep-into"]["in_place"]


def failure_case(ckpt: str, kind: str, rank: int, timeout: float) -> dict:
    return case(kind, ckpt, {"layout": "megatron", "tp": 2}, {"layout": "vllm", "tp": 1}, [0, 1], [2],
                chunk_bytes=4096, timeout=timeout, fail={"rank": rank, "kind": kind, "after": 40})


@pytest.mark.parametrize("kind", ["raise", "kill"])
def test_a_failing_rank_makes_every_rank_raise_within_the_timeout(models, tmp_path, kind):
    timeout = 8.0
    spec = failure_case(models["llama"], kind, 1, timeout)
    started = time.monotonic()
    results, codes = launch(tmp_path, kind, 3, [spec], wait=60.0, pg_timeout=20, broken=True, normal_exit=True)
    assert time.monotonic() - started < 45
    assert codes == [0, 0 if kind == "raise" else -signal.SIGKILL, 0]
    for rank in (0, 2):
        res = results[rank][kind]
        assert res["error"] and res["error"].startswith("TransferError"), res
        assert res["seconds"] < timeout + 2, res
    if kind == "raise":
        assert "injected failure mid-transfer" in results[1][kind]["error"]
        assert "rank 1" in results[0][kind]["error"] and "rank 1" in results[2][kind]["error"]
    else:
        assert results[1] == {}


BIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
       "num_hidden_layers": 10, "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000,
       "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
       "hidden_act": "silu", "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False}


@pytest.mark.slow
def test_memory_above_the_own_tensors_stays_within_two_chunks(tmp_path):
    """A 1.2 GB bf16 Llama, Megatron tp2 pp2 -> vLLM tp2 on 6 processes, then tp2 -> vLLM tp2 on 2: each
    rank's peak RSS above its own tensors stays <= 2 x chunk + 64 MiB (tensors from the plan's shapes)."""
    chunk = 64 << 20
    plan = live.plan(BIG, source=MEGATRON_TP2_PP2, target=VLLM_TP2, source_ranks=range(4), target_ranks=[4, 5])
    assert sum(plan.target_bytes(j) for j in range(2)) >= 1 << 30
    cases = [dict(name="disjoint", config=BIG, source=MEGATRON_TP2_PP2, target=VLLM_TP2, source_ranks=[0, 1, 2, 3],
                  target_ranks=[4, 5], memory=True),
             dict(name="colocated", config=BIG, source={"layout": "megatron", "tp": 2}, target=VLLM_TP2,
                  source_ranks=[0, 1], target_ranks=[0, 1], memory=True),  # local copies, chunk by chunk
             dict(name="crossed", config=BIG, source={"layout": "megatron", "tp": 2}, target=VLLM_TP2,
                  source_ranks=[0, 1], target_ranks=[1, 0], memory=True)]  # each sends and receives at once
    results, codes = launch(tmp_path, "memory", 6, cases, wait=300.0)
    assert codes == [0] * 6
    for rank, res in enumerate(results):
        for name, r in res.items():
            print(f"live {name} rank {rank}: held {r['held'] >> 20} MiB, +{r['extra_rss'] >> 20} MiB peak, "
                  f"{r['seconds']:.2f} s, sent {r['stats']['bytes_sent'] >> 20} MiB")
            assert r["extra_rss"] <= 2 * chunk + (64 << 20), (name, rank, r["extra_rss"] >> 20)
