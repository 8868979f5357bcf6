"""reshard.live plans, in one process: built from the config alone, identical however the config is given, and,
executed chunk by chunk through the very helpers ``transfer`` uses (slice on the sender, transform on the
receiver), they give every target rank exactly ``reshard.load_rank``'s tensors from ``load_rank``'s source
tensors. The processes themselves are tests/test_live.py's."""

from __future__ import annotations

import json

import pytest
import torch

import reshard
from checkpoints import make_hf
from helpers import tiny_transformers_model
from live_worker import rank_kwargs, tiny_mixtral
from reshard import live
from reshard.errors import PlanError
from reshard.io import dtypes
from reshard.io.assemble import bits_equal
from reshard.live.schedule import build
from reshard.live.transfer import place, slice_shape, source_slice


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("live_plan")
    moe = tiny_mixtral(root)
    gpt2 = str(root / "gpt2")
    tiny_transformers_model(transformers, "GPT2Config", n_embd=64, n_layer=2, n_head=8, n_positions=32,
                            n_inner=96).save_pretrained(gpt2)
    return {"llama": make_hf(root / "llama", vocab=1000, kv_heads=4),
            "qwen2": make_hf(root / "qwen2", arch="Qwen2ForCausalLM", vocab=1000, kv_heads=2),
            "tied": make_hf(root / "tied", vocab=1000, kv_heads=2, tied=True), "moe": moe, "gpt2": gpt2}


def count(spec: dict) -> int:
    return spec.get("tp", 1) * spec.get("pp", 1) * spec.get("ep", 1)


def emulate(ckpt: str, source: dict, target: dict, chunk_bytes: int = 4096, dtype=None) -> live.LivePlan:
    """Run the plan's schedule in this process and compare every target rank with load_rank, bit for bit."""
    ns, nt = count(source), count(target)
    plan = live.plan(ckpt, source=source, target=target, source_ranks=range(ns), target_ranks=range(ns, ns + nt))
    held = [reshard.load_rank(ckpt, to=source["layout"], **rank_kwargs(source, i)) for i in range(ns)]
    schedule = build(plan, dtypes.parse_user_dtype(dtype), chunk_bytes)
    chunks = [c for msgs in schedule.rounds for m in msgs for c in m.chunks]
    assert not schedule.local  # disjoint ranks: everything is a message
    assert all(m.nbytes <= chunk_bytes + 16 or len(m.chunks) == 1 for msgs in schedule.rounds for m in msgs)
    for j in range(nt):
        want = reshard.load_rank(ckpt, to=target["layout"], dtype=dtype, **rank_kwargs(target, j))
        got = {}
        for t in plan.targets[j]:
            got[t.name] = torch.zeros(t.shape, dtype=dtypes.to_torch(t.dtype_for(dtypes.parse_user_dtype(dtype))))
            if t.fill is not None:
                got[t.name].fill_(t.fill)
        for c in (c for c in chunks if c.target == j):
            tensor = plan.targets[j][c.tensor]
            data = source_slice(held[c.op.source][c.op.tensor], c.op, tensor.axis)
            assert tuple(data.shape) == slice_shape(plan, c.op, tensor.axis)
            assert c.nbytes == data.numel() * dtypes.itemsize(c.wire)
            place(got[tensor.name], c.op, tensor.axis, data.contiguous().to(dtypes.to_torch(c.wire)))
        assert list(got) == list(want)
        bad = [n for n in want if not bits_equal(got[n], want[n])]
        assert not bad, bad
        assert sum(c.nbytes for c in chunks if c.target == j) <= plan.target_bytes(j, dtype)
    return plan


CASES = [
    ("llama", {"layout": "megatron", "tp": 2, "pp": 2}, {"layout": "vllm", "tp": 2}),
    ("llama", {"layout": "megatron", "tp": 4}, {"layout": "vllm", "tp": 8}),  # KV heads repeated: replicas
    ("llama", {"layout": "vllm", "tp": 2}, {"layout": "megatron", "tp": 1, "pp": 2}),
    ("llama", {"layout": "megatron", "tp": 2, "megatron_spec": "local"}, {"layout": "meta", "tp": 2}),  # RoPE rows
    ("llama", {"layout": "meta", "tp": 2}, {"layout": "hf"}),
    ("llama", {"layout": "torch_dist", "tp": 2}, {"layout": "trtllm", "tp": 2}),
    ("qwen2", {"layout": "hf"}, {"layout": "megatron", "tp": 2, "pp": 2}),  # biases
    ("tied", {"layout": "megatron", "tp": 2, "pp": 2}, {"layout": "vllm", "tp": 2}),  # tied copy on the last stage
    ("moe", {"layout": "megatron", "tp": 2, "ep": 2}, {"layout": "vllm", "tp": 2, "expert_parallel": True}),
    ("moe", {"layout": "megatron", "tp": 2, "ep": 2, "etp": 1, "moe_grouped_gemm": True}, {"layout": "vllm", "tp": 4}),
    ("moe", {"layout": "vllm", "tp": 2}, {"layout": "megatron", "tp": 1, "pp": 2, "ep": 2}),
    ("gpt2", {"layout": "hf"}, {"layout": "megatron", "tp": 2}),  # Conv1D [in, out]: transposed reads
    ("gpt2", {"layout": "megatron", "tp": 2}, {"layout": "hf"}),
]


@pytest.mark.parametrize("model,source,target", CASES, ids=lambda v: v if isinstance(v, str) else
                         "-".join(f"{k}{x}" if k != "layout" else x for k, x in v.items()))
def test_plan_executed_chunk_by_chunk_equals_load_rank(models, model, source, target):
    emulate(models[model], source, target)


def test_a_cast_on_the_way_is_sent_in_the_narrower_dtype(models):
    plan = emulate(models["llama"], {"layout": "megatron", "tp": 2}, {"layout": "vllm", "tp": 2}, dtype="bf16")
    schedule = build(plan, "BF16", 1 << 20)
    assert {c.wire for msgs in schedule.rounds for m in msgs for c in m.chunks} == {"BF16"}
    assert sum(plan.pair_bytes("bf16").values()) * 2 == sum(plan.pair_bytes().values())


def test_the_plan_is_the_same_from_a_dict_a_file_or_a_folder(models, tmp_path):
    folder = models["llama"]
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    args = dict(source={"layout": "megatron", "tp": 2, "pp": 2}, target={"layout": "vllm", "tp": 2},
                source_ranks=[0, 1, 2, 3], target_ranks=[4, 5])
    plans = [live.plan(c, **args) for c in (config, f"{folder}/config.json", folder)]
    assert plans[0].targets == plans[1].targets == plans[2].targets
    assert plans[0].sources == plans[2].sources


def test_replicas_are_spread_and_a_colocated_holder_sends_nothing_over_the_network(models):
    # Megatron tp4 -> vLLM tp8 over 4 + 8 processes: every norm is on all 4 source ranks
    plan = live.plan(models["llama"], source={"layout": "megatron", "tp": 4}, target={"layout": "vllm", "tp": 8},
                     source_ranks=range(4), target_ranks=range(4, 12))
    sent = {s: 0 for s in range(4)}
    for (s, _), n in plan.pair_bytes().items():
        sent[s] += n
    assert max(sent.values()) - min(sent.values()) <= max(sent.values()) // 10
    colocated = live.plan(models["llama"], source={"layout": "megatron", "tp": 4},
                          target={"layout": "vllm", "tp": 2}, source_ranks=range(4), target_ranks=[0, 2])
    for j, tensors in enumerate(colocated.targets):
        for t in tensors:
            for op, holders in zip(t.reads, t.holders):
                if colocated.target_ranks[j] in [colocated.source_ranks[h] for h in holders]:
                    assert colocated.source_ranks[op.source] == colocated.target_ranks[j], t.name
    text = colocated.describe()
    assert "rank 0 -> rank 0: local copy" in text and "rank 1 -> rank 0: sends" in text


def test_impossible_requests_are_refused_at_plan_time(models):
    ckpt = models["llama"]
    with pytest.raises(PlanError, match="lists 3 ranks"):
        live.plan(ckpt, source={"layout": "megatron", "tp": 2, "pp": 2}, target={"layout": "vllm", "tp": 2},
                  source_ranks=[0, 1, 2], target_ranks=[4, 5])
    with pytest.raises(PlanError, match="distinct"):
        live.plan(ckpt, source={"layout": "vllm", "tp": 2}, target={"layout": "hf"}, source_ranks=[0, 0],
                  target_ranks=[1])
    with pytest.raises(PlanError, match="unknown source key 'tensor_parallel'"):
        live.plan(ckpt, source={"layout": "vllm", "tensor_parallel": 2}, target={"layout": "hf"},
                  source_ranks=[0], target_ranks=[1])
    with pytest.raises(PlanError, match="no ep ranks"):
        live.plan(ckpt, source={"layout": "vllm", "ep": 2}, target={"layout": "hf"}, source_ranks=[0, 1],
                  target_ranks=[2])
    with pytest.raises(PlanError, match="num_query_groups"):
        live.plan(ckpt, source={"layout": "megatron", "tp": 8}, target={"layout": "hf"}, source_ranks=range(8),
                  target_ranks=[8])
