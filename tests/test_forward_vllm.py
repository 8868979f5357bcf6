"""Forward verification of vLLM sharded_state folders: each process runs from its own rank files (qkv_proj
[q_r; k_r; v_r], gate_up_proj [gate_r; up_r], vocab padded to 64), including tp > KV heads where every rank runs its
own KV-head replica; a corrupted replica or swapped heads on one rank must fail."""

from __future__ import annotations

import pytest
from safetensors.torch import save_file

import reshard
from checkpoints import make_hf
from reshard.errors import ReshardError
from reshard.verification.forward import verify_forward
from vllm_rules import load_rank

ATOL = 1e-5
D = 8  # head dim: hidden 64 / 8 heads


def seeded_hf(path, **kw):
    return make_hf(path, coded=False, seed=5, hidden=64, layers=2, heads=8, ffn=96, vocab=1000, **kw)


def assert_equal(r):
    assert r["ok"], r["problems"]
    assert r["max_abs"] <= ATOL and r["argmax_agreement"] == 1.0 and r["first_divergence"] is None
    assert r["padding_max_abs_b"] == 0.0


@pytest.mark.parametrize("arch,kv,tied,tp", [
    ("Qwen2ForCausalLM", 2, True, 2),  # q/k/v biases, tied head stored as lm_head.weight
    ("LlamaForCausalLM", 2, False, 4),  # tp > KV heads: KV head r // 2 replicated on ranks 2r, 2r+1
    pytest.param("LlamaForCausalLM", 2, False, 8, marks=pytest.mark.slow),
])
def test_vllm_tp_logits_equal_hf(tmp_path, arch, kv, tied, tp):
    src = seeded_hf(tmp_path / "hf", arch=arch, kv_heads=kv, tied=tied)
    reshard.convert(src, str(tmp_path / "v"), to="vllm", tp=tp)
    r = verify_forward(src, str(tmp_path / "v"))
    assert (r["b"]["layout"], r["b"]["tp"], r["b"]["padded_vocab"]) == ("vllm", tp, 1024)
    assert r["b"]["rank0_files"] == ["model-rank-0-part-0.safetensors"]
    assert_equal(r)


def _edit_rank(folder, rank, edit):
    tensors, metas = load_rank(folder, rank)
    edit(tensors)
    save_file(tensors, str(folder / f"model-rank-{rank}-part-0.safetensors"), metadata=metas[0])


def test_corrupted_kv_replica_fails(tmp_path):
    """Rank 3 runs its own copy of KV head 1: a changed replica changes rank 3's attention output."""
    src = seeded_hf(tmp_path / "hf", kv_heads=2)
    v = tmp_path / "v"
    reshard.convert(src, str(v), to="vllm", tp=4)

    def corrupt(t):
        t["model.layers.1.self_attn.qkv_proj.weight"][2 * D:3 * D] *= 1.5  # rank 3's v rows (q: 2 heads, k: 1)
    _edit_rank(v, 3, corrupt)
    r = verify_forward(src, str(v))
    assert not r["ok"] and r["first_divergence"].startswith("layer 1 attention")


def test_swapped_query_heads_on_one_rank_fail(tmp_path):
    src = seeded_hf(tmp_path / "hf", kv_heads=2, arch="Qwen2ForCausalLM")
    v = tmp_path / "v"
    reshard.convert(src, str(v), to="vllm", tp=2)

    def swap(t):
        w = t["model.layers.0.self_attn.qkv_proj.weight"]
        w[:D], w[D:2 * D] = w[D:2 * D].clone(), w[:D].clone()
    _edit_rank(v, 1, swap)
    r = verify_forward(src, str(v))
    assert not r["ok"] and r["first_divergence"].startswith("layer 0 attention")


def test_nproc_must_match_the_folder(tmp_path):
    src = seeded_hf(tmp_path / "hf", kv_heads=2)
    reshard.convert(src, str(tmp_path / "v"), to="vllm", tp=2)
    with pytest.raises(ReshardError, match="vllm checkpoint at tp=2.*--nproc 2"):
        verify_forward(src, str(tmp_path / "v"), nproc=4)
