"""Granite 3 (``GraniteForCausalLM``, mappings/granite.toml; shared/layouts/families-2.md sections 7, 15, 17).

A tiny transformers Granite (fp32, 2 layers, hidden 64, 8 heads / 2 KV heads, vocab 1003, tied, the four
multipliers set to non-neutral values, seeded noise on every parameter) saved with save_pretrained:
  - hf -> vllm tp2 -> hf and hf -> hf: every tensor bit-equal, the four multipliers kept in config.json, transformers'
    logits of the output equal the source's;
  - vLLM rank files: Llama's (the same tensors relabelled LlamaForCausalLM convert to the same rank tensors);
  - ``verify --forward`` passes against the vllm tp2 output; the verifier's tp1 logits equal transformers' (1e-5)
    and, without each multiplier, do not;
  - Megatron targets (torch and torch_dist) refused with section 17's message, one line, exit 2, nothing written;
    allowed lossy, they convert;
  - inspect, plan and load_rank.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

import reshard
from family_cases import families_fixture, verify_forward
from family_rules import diff_states, load_hf_dir, load_vllm_rank
from helpers import run_cli
from reshard.layouts.base import Options
from reshard.verification.forward.decoder import TPGroup, cast_weights, forward
from reshard.verification.forward.sliced_rank import load_rank as load_hf_rank

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")

MULTIPLIERS = dict(embedding_multiplier=12.0, attention_multiplier=0.15, residual_multiplier=0.22,
                   logits_scaling=8.0)
SETTINGS = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=1003, max_position_embeddings=128, tie_word_embeddings=True,
                **MULTIPLIERS)
ATOL = 1e-5
REFUSAL = ("Granite scales the embedding (\u00d712.0), every residual branch (\u00d70.22) and the logits (\u00f78.0); "
           "megatron-core has no such multipliers, and folding them into tied or bf16 weights changes the model. "
           "Convert to hf or vllm, or pass --allow-lossy-config embedding_multiplier,residual_multiplier,"
           "logits_scaling.")

families = families_fixture(transformers, {"granite": ("GraniteConfig", SETTINGS)}, {"granite": "GraniteForCausalLM"})


@pytest.fixture(scope="module")
def granite(families):
    return families("granite")


def ids(seq: int = 12) -> torch.Tensor:
    return torch.randint(0, 1003, (2, seq), generator=torch.Generator().manual_seed(1))


def assert_multipliers_kept(config: dict) -> None:
    assert {k: config.get(k) for k in MULTIPLIERS} == MULTIPLIERS, config
    assert config["architectures"] == ["GraniteForCausalLM"] and config["model_type"] == "granite"


def test_vllm_round_trip_is_exact(granite, capsys):
    v = granite.vllm(capsys)
    assert_multipliers_kept(json.loads((v / "config.json").read_text()))
    back = granite.convert(capsys, "hf_from_vllm", v, "--to", "hf")
    got, config = load_hf_dir(back)
    problems = diff_states(got, granite.hf, "hf")
    assert not problems, "\n".join(problems[:40])
    assert_multipliers_kept(config)
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 1003
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids()).logits, granite.model(ids()).logits)


def test_hf_round_trip_is_exact(granite, capsys):
    back = granite.convert(capsys, "hf_from_hf", granite.src, "--to", "hf")
    got, config = load_hf_dir(back)
    assert not diff_states(got, granite.hf, "hf")
    assert_multipliers_kept(config)


def test_vllm_rank_files_are_llamas(granite, capsys, tmp_path):
    """Granite's vLLM names and splits are Llama's (families-2.md section 13): the same tensors labelled
    LlamaForCausalLM (multipliers removed) convert to the same rank tensors."""
    llama = tmp_path / "llama"
    shutil.copytree(granite.src, llama)
    config = json.loads((llama / "config.json").read_text())
    for key in MULTIPLIERS:
        config.pop(key)
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (llama / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "convert", llama, tmp_path / "llama_vllm", "--to", "vllm", "--tp", 2)
    assert code == 0, err
    v = granite.vllm(capsys)
    for r in range(2):
        want = load_vllm_rank(tmp_path / "llama_vllm", r)
        got = load_vllm_rank(v, r)
        assert "model.layers.0.self_attn.qkv_proj.weight" in got
        assert not diff_states(got, want, f"rank {r}")


def verifier_logits(folder, **changes) -> torch.Tensor:
    weights = cast_weights(load_hf_rank(str(folder), 0, 1, Options()), torch.float32, "cpu")
    weights.config = dataclasses.replace(weights.config, **changes)
    with torch.no_grad():
        return forward(weights, ids(), TPGroup()).logits


def test_tp1_verifier_equals_transformers(granite):
    with torch.no_grad():
        expected = granite.model(ids(), use_cache=False).logits
    got = verifier_logits(granite.src)
    assert (got[..., :1003] - expected).abs().max().item() <= ATOL
    for field, neutral in (("embedding_multiplier", 1.0), ("attention_multiplier", None),
                           ("residual_multiplier", 1.0), ("logits_scaling", 1.0)):
        err = (verifier_logits(granite.src, **{field: neutral})[..., :1003] - expected).abs().max().item()
        assert err > 1e-3, f"the decoder without {field} also matches"


def test_verify_forward_vllm_tp2(granite, capsys):
    code, r, err = verify_forward(capsys, granite.src, granite.vllm(capsys))
    assert code == 0 and r is not None, err[-2000:]
    assert r["ok"] and r["first_divergence"] is None and r["max_abs"] <= ATOL, r["problems"]
    assert (r["b"]["layout"], r["b"]["tp"]) == ("vllm", 2)


@pytest.mark.parametrize("to", [("--to", "megatron"), ("--to", "torch_dist")])
def test_megatron_refused(granite, capsys, tmp_path, to):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", granite.src, out, *to, "--tp", 2)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert REFUSAL in err, err
    assert not out.exists()


def test_megatron_allowed_lossy_converts(granite, capsys, tmp_path):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", granite.src, out, "--to", "megatron", "--tp", 2, "--allow-lossy-config",
                           "embedding_multiplier,residual_multiplier,logits_scaling")
    assert code == 0, err
    assert "embedding_multiplier" in err and "logits_scaling" in err  # the drops are noted


def test_inspect_plan_load_rank(granite, capsys):
    code, out, err = run_cli(capsys, "inspect", granite.src, "--json")
    assert code == 0, err
    assert json.loads(out)["architecture"] == "GraniteForCausalLM"
    code, out, err = run_cli(capsys, "plan", granite.src, "--to", "vllm", "--tp", 2, "--json")
    assert code == 0, err
    assert json.loads(out)
    rank = reshard.load_rank(str(granite.src), "vllm", tp=2, rank=1)
    assert torch.equal(rank["model.layers.1.mlp.down_proj.weight"],
                       granite.hf["model.layers.1.mlp.down_proj.weight"][:, 48:])


def test_verify_forward_perturbed_layer0_fails(granite, capsys, tmp_path):
    """One row of layer 0's down_proj scaled on vLLM rank 1: verify --forward exits 1 naming layer 0's MLP."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(granite.vllm(capsys), bad)
    path = bad / "model-rank-1-part-0.safetensors"
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    tensors["model.layers.0.mlp.down_proj.weight"][3] *= 3.0
    save_file(tensors, str(path), metadata=metadata)
    code, r, err = verify_forward(capsys, granite.src, bad)
    assert code == 1 and r is not None, err[-2000:]
    assert not r["ok"] and r["first_divergence"].startswith("layer 0 mlp"), r["first_divergence"]
