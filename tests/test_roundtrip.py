"""Bit-exact round trips hf -> megatron (tp, pp) -> megatron (other tp, pp) -> hf on position-coded tensors,
with every Megatron rank file checked against rules written out independently in megatron_rules.py."""

from __future__ import annotations

import json

import pytest
import torch

import reshard
from checkpoints import hf_config, hf_tensor_shapes, load_hf_tensors, position_coded, write_hf
from megatron_rules import expected_rank_state, load_rank, rank_file

MODELS = {
    # GQA with 8 KV groups so that every tp in {1, 2, 4, 8} is valid; vocab 1000 needs padding at every tp.
    "llama_gqa": dict(arch="LlamaForCausalLM", hidden=128, heads=16, kv_heads=8, ffn=96, vocab=1000, layers=2),
    "llama_tied": dict(arch="LlamaForCausalLM", hidden=128, heads=16, kv_heads=8, ffn=96, vocab=1000, layers=2,
                       tied=True),
    "mistral": dict(arch="MistralForCausalLM", hidden=64, heads=8, kv_heads=8, ffn=80, vocab=1001, layers=2,
                    head_dim=16, sliding_window=None),
    "qwen2": dict(arch="Qwen2ForCausalLM", hidden=128, heads=16, kv_heads=8, ffn=96, vocab=999, layers=2),
}

# (tp_a, pp_a) -> (tp_b, pp_b): includes 1 -> 8, 8 -> 4 and pp 2 -> 1.
CHAINS = [((1, 1), (8, 1)), ((8, 1), (4, 1)), ((2, 2), (1, 1)), ((4, 2), (2, 1)), ((1, 2), (8, 2)), ((8, 2), (2, 2))]


@pytest.fixture(scope="module", params=sorted(MODELS))
def source(request, tmp_path_factory):
    config = hf_config(**MODELS[request.param])
    tensors = position_coded(hf_tensor_shapes(config))
    path = write_hf(tmp_path_factory.mktemp(request.param) / "hf", config, tensors, shards=2)
    return path, config, tensors


def check_megatron(root, config, tensors, tp, pp, spec="te"):
    for p in range(pp):
        for t in range(tp):
            state = load_rank(rank_file(root, t, p, pp))
            model = {k: v for k, v in state["model"].items() if not k.endswith("_extra_state")}
            expected = expected_rank_state(tensors, config, tp, t, pp, p, spec)
            assert sorted(model) == sorted(expected), f"rank ({t}, {p}) names"
            for name, value in expected.items():
                assert torch.equal(model[name], value), f"rank ({t}, {p}) {name}"
            args = state["args"]
            assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (tp, pp)
            assert args.padded_vocab_size == expected.get("embedding.word_embeddings.weight",
                                                          torch.empty(args.padded_vocab_size // tp)).shape[0] * tp
            assert state["checkpoint_version"] == 3.0


@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: f"tp{c[0][0]}pp{c[0][1]}-tp{c[1][0]}pp{c[1][1]}")
def test_roundtrip_bit_exact(source, chain, tmp_path):
    path, config, tensors = source
    (tp_a, pp_a), (tp_b, pp_b) = chain
    meg_a, meg_b, back = tmp_path / "a", tmp_path / "b", tmp_path / "back"
    reshard.convert(path, str(meg_a), to="megatron", tp=tp_a, pp=pp_a)
    check_megatron(meg_a, config, tensors, tp_a, pp_a)
    reshard.convert(str(meg_a), str(meg_b), to="megatron", tp=tp_b, pp=pp_b)
    check_megatron(meg_b, config, tensors, tp_b, pp_b)
    reshard.convert(str(meg_b), str(back), to="hf")
    out = load_hf_tensors(back)
    assert sorted(out) == sorted(tensors)
    for name, value in tensors.items():
        assert out[name].dtype == value.dtype and torch.equal(out[name], value), name
    assert json.loads((back / "config.json").read_text()) == config
    assert (back / "generation_config.json").exists()
    assert reshard.verify(path, str(meg_b)).equal


def test_local_spec_names(source, tmp_path):
    path, config, tensors = source
    reshard.convert(path, str(tmp_path / "m"), to="megatron", tp=2, pp=2, megatron_spec="local")
    check_megatron(tmp_path / "m", config, tensors, 2, 2, spec="local")
    state = load_rank(rank_file(tmp_path / "m", 0, 0, 2))
    extra = sorted(k for k in state["model"] if k.endswith("_extra_state"))
    assert "decoder.layers.0.self_attention.linear_qkv._extra_state" in extra
    assert all(state["model"][k] is None for k in extra)
    reshard.convert(str(tmp_path / "m"), str(tmp_path / "hf"), to="hf")
    out = load_hf_tensors(tmp_path / "hf")
    assert all(torch.equal(out[n], v) for n, v in tensors.items())


def test_hf_sharded_output_and_index(source, tmp_path):
    path, config, tensors = source
    reshard.convert(path, str(tmp_path / "m"), to="megatron", tp=2)
    reshard.convert(str(tmp_path / "m"), str(tmp_path / "hf"), to="hf", max_shard_size=100_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((tmp_path / "hf" / f).exists() for f in files)
    assert sorted(index["weight_map"]) == sorted(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    out = load_hf_tensors(tmp_path / "hf")
    assert all(torch.equal(out[n], v) for n, v in tensors.items())


def test_dtype_cast_verifies_after_cast(source, tmp_path):
    path, config, tensors = source
    reshard.convert(path, str(tmp_path / "bf16"), to="megatron", tp=2, dtype="bf16")
    reshard.convert(str(tmp_path / "bf16"), str(tmp_path / "hf"), to="hf")
    out = load_hf_tensors(tmp_path / "hf")
    for name, value in tensors.items():
        assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], value.to(torch.bfloat16)), name
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    report = reshard.verify(path, str(tmp_path / "hf"))
    assert report.equal and {t.status for t in report.tensors} <= {"equal_after_cast", "equal"}
