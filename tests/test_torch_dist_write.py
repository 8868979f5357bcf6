"""Writing torch_dist: the chunks, names, global shapes, offsets and bytes match what the rules say Megatron stores
(built in tests/dcp_checkpoints.py, not with reshard's planner) read back with torch's own DCP reader; megatron-core's
dist_checkpointing.load takes the output strictly at TP=1 and TP=2 and computes transformers' logits; bit-exact chains
through every layout."""

from __future__ import annotations

import argparse
import json
import os
import pickle

import pytest
import torch

import reshard
from checkpoints import hf_config, hf_tensor_shapes, load_hf_tensors, position_coded, write_hf
from cli_inprocess import run_main
from dcp_checkpoints import chunks_of, global_tensors
from test_mcore_dist_fixtures import mcore_dist_load

transformers = pytest.importorskip("transformers")


def dcp_read(folder: str, shapes: dict) -> dict[str, torch.Tensor]:
    """torch's own DCP reader (one process) loading every tensor of ``shapes`` whole."""
    import torch.distributed.checkpoint as dcp

    state = {k: torch.empty(s, dtype=d) for k, (s, d) in shapes.items()}
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    return state


@pytest.mark.parametrize("arch, tied, tp", [("LlamaForCausalLM", False, 2), ("Qwen2ForCausalLM", True, 4)])
def test_chunks_match_the_rules_and_torch_reads_them(arch, tied, tp, tmp_path):
    config = hf_config(arch=arch, hidden=64, heads=8, kv_heads=4, ffn=96, vocab=1000, layers=4, tied=tied)
    tensors = position_coded(hf_tensor_shapes(config))
    hf = write_hf(tmp_path / "hf", config, tensors)
    proc = run_main("convert", hf, tmp_path / "td", "--to", "megatron", "--megatron-format", "torch_dist", "--tp",
                    str(tp))
    assert proc.returncode == 0, proc.stderr
    folder = tmp_path / "td" / "release"
    assert (tmp_path / "td" / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert json.loads((folder / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert not list(folder.glob("*.chunks.json")) and not list(folder.glob("*.partial"))
    expected = global_tensors(tensors, config, tp, stacked=True)
    meta = pickle.load(open(folder / ".metadata", "rb"))  # our own output: plain pickle is fine here
    model_keys = {k for k, v in meta.state_dict_metadata.items() if hasattr(v, "chunks")}
    assert model_keys == set(expected)
    for key, tensor in expected.items():
        got = meta.state_dict_metadata[key]
        assert tuple(got.size) == tuple(tensor.shape) and got.properties.dtype == tensor.dtype, key
        chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in got.chunks)
        assert chunks == sorted((o, tuple(c.shape)) for o, c in chunks_of(key, tensor, tp, True)), key
    loaded = dcp_read(str(folder), {k: (t.shape, t.dtype) for k, t in expected.items()})
    for key, tensor in expected.items():
        assert torch.equal(loaded[key], tensor), key
    extra = [k for k in meta.state_dict_metadata if "_extra_state/shard_" in k]
    assert "decoder.layers.mlp.linear_fc1._extra_state/shard_3_4" in extra
    with torch.serialization.safe_globals([argparse.Namespace]):
        common = torch.load(folder / "common.pt", weights_only=True)
    args = common["args"]
    assert (common["checkpoint_version"], args.tensor_model_parallel_size, args.ckpt_format) == (3.0, tp, "torch_dist")
    assert args.no_save_optim and args.no_save_rng
    assert common["content_metadata"]["singleton_local_shards"] is False


def test_bit_exact_chain_through_every_layout(tmp_path):
    config = hf_config(arch="Qwen2ForCausalLM", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, layers=4,
                       tied=True)
    tensors = position_coded(hf_tensor_shapes(config))
    hf = write_hf(tmp_path / "hf", config, tensors)
    steps = [("td1", "torch_dist", 2, 1), ("m", "megatron", 2, 2), ("td2", "torch_dist", 1, 1), ("v", "vllm", 4, 1),
             ("back", "hf", 1, 1)]
    prev = hf
    for name, to, tp, pp in steps:
        reshard.convert(prev, str(tmp_path / name), to=to, tp=tp, pp=pp)
        prev = str(tmp_path / name)
    out = load_hf_tensors(tmp_path / "back")
    assert sorted(out) == sorted(tensors) and all(torch.equal(out[k], v) for k, v in tensors.items())
    assert reshard.verify(hf, str(tmp_path / "td2")).equal
    # a Megatron source keeps its iteration
    assert (tmp_path / "td2" / "latest_checkpointed_iteration.txt").read_text() == "release"


def test_megatron_format_only_with_megatron(tmp_path):
    proc = run_main("convert", "a", tmp_path / "x", "--to", "hf", "--megatron-format", "torch_dist")
    assert proc.returncode == 2 and "--megatron-format applies to --to megatron" in proc.stderr


@pytest.mark.parametrize("load_tp", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_megatron_core_loads_the_output_strictly(load_tp, tmp_path_factory):
    from helpers import tiny_transformers_model

    tmp = tmp_path_factory.mktemp(f"mcore-load-{load_tp}")
    model = tiny_transformers_model(transformers, "LlamaConfig", num_key_value_heads=2, intermediate_size=160)
    model.save_pretrained(tmp / "hf", safe_serialization=True)
    reshard.convert(str(tmp / "hf"), str(tmp / "td"), to="torch_dist", tp=2)
    ids = torch.randint(0, 1003, (2, 16), generator=torch.Generator().manual_seed(3))
    torch.save(ids, tmp / "ids.pt")
    got = mcore_dist_load(tmp / "td", tmp / "out.pt", tp=load_tp, ids=tmp / "ids.pt")
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
    assert got["logits"].shape == expected.shape
    assert (got["logits"] - expected).abs().max().item() <= 1e-5


def test_extra_state_keys_name_the_decoder_layers_beside_mtp_layers_and_a_vision_tower():
    """The per-layer ``core_attention`` objects go under the decoder's own key (a VLM's ``language_model.``), not
    under an MTP layer's prefix, and a native vision tower's blocks get theirs on the block axis."""
    from reshard.layouts.torch_dist_keys import Location, extra_state_keys

    locations = [Location("decoder.layers.self_attention.linear_qkv.weight", (0,), ("layer",)),
                 Location("mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight")]
    keys = extra_state_keys(locations, {"layer": 2}, 2, True)
    assert "decoder.layers.self_attention.core_attention._extra_state/shard_1_2" in keys
    assert "mtp.layers.0.transformer_layer.self_attention.core_attention._extra_state/shard_0_1" in keys
    assert not any(k.startswith("mtp.layers.0.transformer_layer.decoder.") for k in keys)
    vlm = extra_state_keys([], {"layer": 2, "vblock": 3}, 2, True, layer_prefix="language_model.")
    assert "language_model.decoder.layers.self_attention.core_attention._extra_state/shard_1_2" in vlm
    assert "vision_model.decoder.layers.self_attention.core_attention._extra_state/shard_2_3" in vlm
