"""Replicated copies the forward check reads (issue 30 item 1) and non-finite values (item 6).

Every copy a real run computes with must either be run by the check or proven identical to the copy it runs:
Megatron EP folders each hold the dense weights (attention, norms, router) and each EP rank computes with its own
copy; with expert-TP below tp, TP ranks share an expert-TP shard's experts; every TensorRT-LLM rank file holds the
whole embedding table; every Meta consolidated file holds the norms. TP-replicated norms (vLLM, Megatron) and the
last pipeline stage's copy of a tied embedding are run by the rank that holds them: a change there must fail too.
NaN weights must be reported as non-finite, naming the tensor, not as a padding or divergence problem.
Tiny seeded fp32 models; one tensor changed in one file per test."""

from __future__ import annotations

import argparse
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard
from checkpoints import make_hf, seeded
from reshard.verification.forward import verify_forward

H, V = 64, 256


def mixtral_hf(path) -> str:
    """test_load_rank's Mixtral (hidden 128, 8 heads, 2 KV heads, 2 layers, 4 experts of FFN 64, vocab 300), its
    bit-coded values replaced by small seeded ones (a forward pass needs finite activations)."""
    from test_load_rank import mixtral

    src = mixtral(path)
    shapes = {k: tuple(t.shape) for k, t in load_file(f"{src}/model.safetensors").items()}
    save_file(seeded(shapes, 5), f"{src}/model.safetensors", metadata={"format": "pt"})
    return src


def llama_hf(path, **extra) -> str:
    return make_hf(path, coded=False, seed=3, hidden=H, layers=2, heads=8, ffn=96, vocab=V,
                   arch="LlamaForCausalLM", kv_heads=2, **extra)


def edit_megatron(path, edit) -> None:
    """Load a trusted test rank file (weights_only, Namespace allowed), edit its model dict, save it back."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        blob = torch.load(path, map_location="cpu", weights_only=True)
    edit(blob["model"])
    torch.save(blob, path)


def edit_safetensors(path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def assert_fails_naming(report: dict, *words: str) -> None:
    assert not report["ok"], report
    text = " ".join(report["problems"]) + " " + str(report["first_divergence"])
    assert all(w in text for w in words), (words, report["problems"], report["first_divergence"])


# ------------------------------------------------------------------ copies the check used to skip

def test_megatron_ep_folders_dense_copies_must_agree(tmp_path):
    src = mixtral_hf(tmp_path / "hf")
    reshard.convert(src, str(tmp_path / "m"), to="megatron", tp=1, ep=2)
    assert verify_forward(src, str(tmp_path / "m"))["ok"]
    name = "decoder.layers.0.self_attention.linear_qkv.weight"

    def shift(sd):
        sd[name] = sd[name] + 0.25

    edit_megatron(tmp_path / "m" / "release" / "mp_rank_00_001" / "model_optim_rng.pt", shift)
    assert_fails_naming(verify_forward(src, str(tmp_path / "m")), "mp_rank_00_001", name, "0.25")


def test_trtllm_embedding_rows_outside_the_rank_slice_must_agree(tmp_path):
    src = llama_hf(tmp_path / "hf")
    reshard.convert(src, str(tmp_path / "t"), to="trtllm", tp=2)
    assert verify_forward(src, str(tmp_path / "t"))["ok"]
    name = "transformer.vocab_embedding.weight"

    def shift(tensors):  # rows of rank 0's vocab slice, in rank 1's copy of the whole table
        tensors[name][:10] += 0.25

    edit_safetensors(tmp_path / "t" / "rank1.safetensors", shift)
    assert_fails_naming(verify_forward(src, str(tmp_path / "t")), "rank1.safetensors", name)


# ------------------------------------------------------------------ copies the check runs (audit: not blind)

def test_a_vllm_rank_own_norm_copy_is_run(tmp_path):
    src = llama_hf(tmp_path / "hf")
    reshard.convert(src, str(tmp_path / "v"), to="vllm", tp=2)
    name = "model.layers.1.input_layernorm.weight"

    def shift(tensors):
        tensors[name] = tensors[name] + 0.25

    edit_safetensors(tmp_path / "v" / "model-rank-1-part-0.safetensors", shift)
    assert_fails_naming(verify_forward(src, str(tmp_path / "v")), "layer 1 attention")


def test_the_last_stage_copy_of_a_tied_embedding_is_run(tmp_path):
    src = llama_hf(tmp_path / "hf", tied=True)
    reshard.convert(src, str(tmp_path / "m"), to="megatron", tp=1, pp=2)

    def shift(sd):
        sd["output_layer.weight"] = sd["output_layer.weight"] + 0.25

    edit_megatron(tmp_path / "m" / "release" / "mp_rank_00_001" / "model_optim_rng.pt", shift)
    assert_fails_naming(verify_forward(src, str(tmp_path / "m")), "head")


# ------------------------------------------------------------------ non-finite values

@pytest.mark.parametrize("where", ["mlp", "embedding"])
def test_nan_weights_are_reported_as_non_finite_naming_the_tensor(tmp_path, where):
    src = llama_hf(tmp_path / "hf")
    name = "model.layers.0.mlp.down_proj.weight" if where == "mlp" else "model.embed_tokens.weight"

    def poison(tensors):
        tensors[name][3, 5] = float("nan")

    edit_safetensors(tmp_path / "hf" / "model.safetensors", poison)
    r = verify_forward(src, src)  # A and B bit-identical
    role = "layer 0 down" if where == "mlp" else "embedding"
    assert_fails_naming(r, "non-finite", role)
    assert not any("padding" in p for p in r["problems"]), r["problems"]
    assert "non-finite values in the weights" in r["first_divergence"], r["first_divergence"]


def test_an_overflow_is_reported_at_the_sub_block_that_produced_it(tmp_path):
    """Finite weights whose product overflows fp16 compute: the first sub-block whose output is non-finite."""
    src = llama_hf(tmp_path / "hf")

    def inflate(tensors):  # 6e4 fits fp16 (max 65504); the MLP's gate/up products then overflow
        tensors["model.layers.1.post_attention_layernorm.weight"].fill_(6e4)

    edit_safetensors(tmp_path / "hf" / "model.safetensors", inflate)
    r = verify_forward(src, src, compute_dtype="fp16")
    assert_fails_naming(r, "non-finite values first appear after layer 1 mlp")
    assert not any("in the weights" in p or "padding" in p for p in r["problems"]), r["problems"]


def test_meta_norm_copies_in_every_consolidated_file_must_agree(tmp_path):
    """Meta's files each hold the norms; the sliced reader computes with the first copy and proves the others."""
    src = llama_hf(tmp_path / "hf")
    reshard.convert(src, str(tmp_path / "meta"), to="meta", tp=2)
    assert verify_forward(src, str(tmp_path / "meta"))["ok"]
    path = tmp_path / "meta" / "consolidated.01.pth"
    blob = torch.load(path, map_location="cpu", weights_only=True)
    name = next(k for k in blob if k.startswith("layers.1.") and "norm" in k)
    blob[name] = blob[name] + 0.25
    torch.save(blob, path)
    assert_fails_naming(verify_forward(src, str(tmp_path / "meta")), "consolidated.01.pth", "0.25")


def test_megatron_expert_copies_below_expert_tp_must_agree(tmp_path):
    """tp 2 with expert-TP 1: TP rank 1's folders hold copies of the experts TP rank 0 computes with."""
    src = mixtral_hf(tmp_path / "hf")
    reshard.convert(src, str(tmp_path / "m"), to="megatron", tp=2, ep=2, etp=1)
    assert verify_forward(src, str(tmp_path / "m"))["ok"]
    name = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"

    def shift(sd):
        sd[name] = sd[name] + 0.25

    edit_megatron(tmp_path / "m" / "release" / "mp_rank_01_001" / "model_optim_rng.pt", shift)
    # EP rank 1's local expert 1 is global expert 3 (4 experts over 2 EP ranks); fc2 is its down projection
    assert_fails_naming(verify_forward(src, str(tmp_path / "m")), "mp_rank_01_001", "layer 1 expert 3 down")
