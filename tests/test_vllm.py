"""vLLM sharded_state: bit-exact round trips on position-coded tensors, every rank file compared with the rules
written out in vllm_rules.py (names, shapes, bytes), the TP record, replica checks and refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import reshard
from checkpoints import hf_config, hf_tensor_shapes, load_hf_tensors, position_coded, write_hf
from vllm_rules import expected_rank, load_rank, vllm_filter_shared

MODELS = {
    # 2 KV heads: tp 4 and 8 replicate each KV head on 2 and 4 ranks; vocab 1000 pads to 1024.
    "llama_gqa": dict(arch="LlamaForCausalLM", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, layers=2),
    "llama_tied": dict(arch="LlamaForCausalLM", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, layers=2,
                       tied=True),
    "qwen2": dict(arch="Qwen2ForCausalLM", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=999, layers=2),
    "mistral": dict(arch="MistralForCausalLM", hidden=64, heads=8, kv_heads=8, ffn=80, vocab=1001, layers=2,
                    head_dim=16, sliding_window=None),
}


def make_source(root, name):
    config = hf_config(**MODELS[name])
    tensors = position_coded(hf_tensor_shapes(config))
    return write_hf(root / name, config, tensors, shards=2), config, tensors


def check_vllm(folder, config, tensors, tp):
    for r in range(tp):
        got, metas = load_rank(folder, r)
        want = expected_rank(tensors, config, tp, r)
        assert sorted(got) == sorted(want), f"rank {r} names"
        for name, value in want.items():
            assert got[name].dtype == value.dtype and got[name].shape == value.shape, f"rank {r} {name}"
            assert torch.equal(got[name], value), f"rank {r} {name} bytes"
        assert all(m["tensor_parallel_size"] == str(tp) for m in metas)
    record = json.load(open(os.path.join(folder, "reshard.json")))
    assert record["tensor_parallel_size"] == tp and record["layout"] == "vllm"
    assert not os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    assert json.load(open(os.path.join(folder, "config.json")))["vocab_size"] == config["vocab_size"]
    assert os.path.isfile(os.path.join(folder, "generation_config.json"))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_hf_vllm_hf_bit_exact(tmp_path, name, tp):
    src, config, tensors = make_source(tmp_path, name)
    out, back = tmp_path / "vllm", tmp_path / "back"
    reshard.convert(src, str(out), to="vllm", tp=tp)
    check_vllm(out, config, tensors, tp)
    reshard.convert(str(out), str(back), to="hf")
    got = load_hf_tensors(back)
    assert sorted(got) == sorted(tensors)
    for k, v in tensors.items():
        assert torch.equal(got[k], v), k
    assert json.load(open(back / "config.json"))["tie_word_embeddings"] == config["tie_word_embeddings"]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_megatron_tp8_vllm_tp4_megatron_tp2pp2_hf(tmp_path, tied):
    config = hf_config(hidden=128, heads=16, kv_heads=8, ffn=96, vocab=1000, layers=2, tied=tied)
    tensors = position_coded(hf_tensor_shapes(config))
    src = write_hf(tmp_path / "hf", config, tensors)
    reshard.convert(src, str(tmp_path / "m8"), to="megatron", tp=8)
    reshard.convert(str(tmp_path / "m8"), str(tmp_path / "v4"), to="vllm", tp=4)
    check_vllm(tmp_path / "v4", config, tensors, 4)
    reshard.convert(str(tmp_path / "v4"), str(tmp_path / "m22"), to="megatron", tp=2, pp=2)
    reshard.convert(str(tmp_path / "m22"), str(tmp_path / "back"), to="hf")
    got = load_hf_tensors(tmp_path / "back")
    assert sorted(got) == sorted(tensors) and all(torch.equal(got[k], v) for k, v in tensors.items())
    assert reshard.verify(src, str(tmp_path / "v4")).equal


def test_vllm_tp2_to_tp8_replicates_kv_heads(tmp_path):
    src, config, tensors = make_source(tmp_path, "qwen2")
    reshard.convert(src, str(tmp_path / "v2"), to="vllm", tp=2)
    reshard.convert(str(tmp_path / "v2"), str(tmp_path / "v8"), to="vllm", tp=8)
    check_vllm(tmp_path / "v8", config, tensors, 8)
    # Ranks 0..3 share KV head 0: identical k/v rows in their qkv_proj.
    d = 8
    kv0 = [load_rank(tmp_path / "v8", r)[0]["model.layers.0.self_attn.qkv_proj.weight"][d:] for r in range(4)]
    assert all(torch.equal(kv0[0], x) for x in kv0[1:])


def test_tied_embedding_uses_the_name_vllm_keeps(tmp_path):
    """vLLM's tied Llama has embed_tokens and lm_head sharing one storage; its loader keeps one key."""
    src, config, tensors = make_source(tmp_path, "llama_tied")
    reshard.convert(src, str(tmp_path / "v"), to="vllm", tp=2)
    emb = torch.nn.Embedding(4, 2)
    head = torch.nn.Linear(2, 4, bias=False)
    head.weight = emb.weight  # how vLLM ties: one parameter under two names
    module = torch.nn.ModuleDict({"embed_tokens": emb, "lm_head": head})
    sharing = [k.replace("embed_tokens", "model.embed_tokens") for k in module.state_dict(keep_vars=True)]
    (kept,) = vllm_filter_shared(sharing)
    for r in range(2):
        names = set(load_rank(tmp_path / "v", r)[0])
        assert kept in names and not (set(sharing) - {kept}) & names


def test_parts_respect_max_shard_size(tmp_path):
    src, config, tensors = make_source(tmp_path, "llama_gqa")
    reshard.convert(src, str(tmp_path / "v"), to="vllm", tp=2, max_shard_size=40_000)
    files = sorted(os.listdir(tmp_path / "v"))
    parts = [f for f in files if f.startswith("model-rank-1-part-")]
    assert len(parts) > 2
    for f in parts:
        assert os.path.getsize(tmp_path / "v" / f) < 40_000 + 140 * 1024  # one tensor may exceed on its own
    check_vllm(tmp_path / "v", config, tensors, 2)


def test_inspect_reports_vllm(tmp_path):
    src, config, tensors = make_source(tmp_path, "llama_gqa")
    reshard.convert(src, str(tmp_path / "v"), to="vllm", tp=4)
    info = reshard.inspect(str(tmp_path / "v"))
    assert (info["layout"], info["tp"], info["padded_vocab_size"], info["recorded_tensor_parallel_size"]) == \
        ("vllm", 4, 1024, 4)
    assert sorted(info["files_per_rank"]) == ["rank-0", "rank-1", "rank-2", "rank-3"]


# ------------------------------------------------------------------------------------------------ refusals

def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "reshard", *args], capture_output=True, text=True)


@pytest.mark.parametrize("args,message", [
    (["--tp", "3"], "num_attention_heads % tp"),
    (["--tp", "2", "--pp", "2"], "--pp must be 1"),
])
def test_impossible_vllm_degrees_refused_before_writing(tmp_path, args, message):
    src, _, _ = make_source(tmp_path, "llama_gqa")
    out = tmp_path / "out"
    proc = run_cli("convert", src, str(out), "--to", "vllm", *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if "partial" in n]


def test_tp_above_kv_heads_not_multiple_refused(tmp_path):
    config = hf_config(hidden=96, heads=12, kv_heads=8, head_dim=8, ffn=96, vocab=1000, layers=1)
    src = write_hf(tmp_path / "hf", config, position_coded(hf_tensor_shapes(config)))
    proc = run_cli("convert", src, str(tmp_path / "out"), "--to", "vllm", "--tp", "12")
    assert proc.returncode == 2 and "not a multiple" in proc.stderr


def test_kv_replica_mismatch_reported(tmp_path):
    src, config, tensors = make_source(tmp_path, "llama_gqa")
    v = tmp_path / "v"
    reshard.convert(src, str(v), to="vllm", tp=4)
    path = v / "model-rank-1-part-0.safetensors"
    rank1, metas = load_rank(v, 1)
    rank1["model.layers.1.self_attn.qkv_proj.weight"][-1, 0] += 1.0  # v row of a KV head rank 0 also holds
    save_file(rank1, str(path), metadata=metas[0])
    proc = run_cli("convert", str(v), str(tmp_path / "back"), "--to", "hf")
    assert proc.returncode == 2
    assert "replicas of 'model.layers.1.self_attn.v_proj.weight' differ" in proc.stderr
    assert "--allow-replica-mismatch" in proc.stderr


def test_recorded_tp_mismatch_refused(tmp_path):
    src, _, _ = make_source(tmp_path, "llama_gqa")
    v = tmp_path / "v"
    reshard.convert(src, str(v), to="vllm", tp=4)
    for r in (2, 3):
        os.remove(v / f"model-rank-{r}-part-0.safetensors")
    proc = run_cli("inspect", str(v))
    assert proc.returncode == 2 and "tensor_parallel_size=4" in proc.stderr


def test_missing_rank_refused(tmp_path):
    src, _, _ = make_source(tmp_path, "llama_gqa")
    v = tmp_path / "v"
    reshard.convert(src, str(v), to="vllm", tp=4)
    os.remove(v / "model-rank-1-part-0.safetensors")
    proc = run_cli("inspect", str(v))
    assert proc.returncode == 2 and "no files for rank 1" in proc.stderr


def test_folder_vllm_wrote_itself_reads_without_record(tmp_path):
    """vLLM's own save_sharded_state writes no reshard.json and no TP metadata: the file names give the TP."""
    src, config, tensors = make_source(tmp_path, "qwen2")
    v = tmp_path / "v"
    v.mkdir()
    for r in range(2):
        save_file({k: t.contiguous() for k, t in expected_rank(tensors, config, 2, r).items()},
                  str(v / f"model-rank-{r}-part-0.safetensors"))
    json.dump(config, open(v / "config.json", "w"))
    reshard.convert(str(v), str(tmp_path / "back"), to="hf")
    got = load_hf_tensors(tmp_path / "back")
    assert all(torch.equal(got[k], t) for k, t in tensors.items()) and sorted(got) == sorted(tensors)


@pytest.mark.parametrize("record", ['{"tensor_parallel_size": "four"}', "{not json", '["a list"]'])
def test_broken_tp_record_is_a_one_line_error(tmp_path, record):
    src, _, _ = make_source(tmp_path, "llama_gqa")
    v = tmp_path / "v"
    reshard.convert(src, str(v), to="vllm", tp=2)
    (v / "reshard.json").write_text(record)
    proc = run_cli("inspect", str(v))
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1
    assert "reshard.json" in proc.stderr
