"""Ministral 3 (``Ministral3ForCausalLM``, mappings/ministral3.toml; families-2.md sections 12, 13, 15, 17).

A tiny transformers Ministral 3 (fp32, 2 layers, hidden 64, 4 heads / 2 KV heads of 16, vocab 1003, untied, seeded
noise on every parameter) with yarn RoPE over an original length of 8 and ``llama_4_scaling_beta`` 0.1, run on 16
tokens so the query scale ``1 + 0.1 ln(1 + floor(pos / 8))`` acts on the last 8; and the same without yarn or the
scale (``ministral3_plain``: beta 0):
  - hf -> vllm tp2 -> hf: every tensor bit-equal, config.json verbatim, transformers' logits of the output equal;
  - vLLM rank files per section 13 (Llama's 23 keys);
  - the verifier's tp1 logits equal transformers' (1e-5), and only with the scale (without it: off);
  - ``verify --forward`` passes at vllm tp2 and fails naming layer 0 on a perturbed weight;
  - Megatron refused (section 17, as Llama 4's temperature tuning) unless --max-seq <= 8 (then converted: yarn's
    round trip and megatron-core's logits in tests/test_yarn_megatron.py), and with beta 0 for the RoPE keys
    transformers needs; one line, exit 2, nothing written;
  - inspect, plan and load_rank;
  - Ministral (2410, ``MinistralForCausalLM``: typed sliding window) through vllm tp2 and megatron tp2 and back.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import reshard
from family_cases import assert_hf_back, families_fixture, verify_forward, verify_perturbed_vllm
from family_rules import load_vllm_rank
from helpers import run_cli
from reshard.layouts.base import Options
from reshard.verification.forward.decoder import TPGroup, cast_weights, forward
from reshard.verification.forward.sliced_rank import load_rank as load_hf_rank

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=1003, max_position_embeddings=128, tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
CASES = {"ministral3": ("Ministral3Config", dict(BASE, rope_parameters=YARN)),
         "ministral3_plain": ("Ministral3Config", dict(BASE, rope_parameters={
             "rope_type": "default", "rope_theta": 1e6, "llama_4_scaling_beta": 0.0,
             "original_max_position_embeddings": 8})),
         "ministral": ("MinistralConfig", dict(BASE, sliding_window=4,
                                               layer_types=["sliding_attention", "full_attention"]))}
ARCHS = dict(dict.fromkeys(CASES, "Ministral3ForCausalLM"), ministral="MinistralForCausalLM")
ATOL = 1e-5
REFUSAL = ("Ministral 3 scales its queries by 1 + 0.1 * ln(1 + floor(pos / 8)) (llama_4_scaling_beta); megatron-core "
           "0.16.1 has no such scale, so the converted model matches only on sequences shorter than 9 tokens. Pass "
           "--max-seq 8 to accept that.")
families = families_fixture(transformers, CASES, ARCHS)


@pytest.fixture(scope="module")
def ministral(families):
    return families("ministral3")


def ids(seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 1003, (2, seq), generator=torch.Generator().manual_seed(1))


def test_vllm_round_trip_is_exact(ministral, capsys):
    v = ministral.vllm(capsys)
    assert json.loads((v / "config.json").read_text()) == ministral.config
    assert_hf_back(transformers, ministral, ministral.convert(capsys, "hf_from_vllm", v, "--to", "hf"), ids())


@pytest.mark.parametrize("to", ["vllm", "megatron"])
def test_ministral_2410_round_trips_are_exact(families, capsys, to):
    """Ministral (2410): Llama's tensors with a window of 4 on layer 0 (layer_types); through vllm tp2 or megatron tp2
    and back, bit-equal, config.json verbatim, transformers' logits equal; the verifier = transformers past the
    window."""
    case = families("ministral")
    out = case.convert(capsys, f"{to}_tp2", case.src, "--to", to, "--tp", 2)
    assert_hf_back(transformers, case, case.convert(capsys, f"hf_from_{to}", out, "--to", "hf"), ids())
    weights = cast_weights(load_hf_rank(str(case.src), 0, 1, Options()), torch.float32, "cpu")
    with torch.no_grad():
        got, expected = forward(weights, ids(), TPGroup()).logits, case.model(ids(), use_cache=False).logits
    assert (got[..., :1003] - expected).abs().max().item() <= ATOL


def test_plain_megatron_refused(families, capsys, tmp_path):
    """Without yarn and with beta 0 the computation is Llama's, but transformers' Ministral3Attention still reads
    both RoPE keys, which Megatron's args cannot record: refused in one line rather than written without them."""
    out, src = tmp_path / "out", families("ministral3_plain").src
    capsys.readouterr()
    code, _, err = run_cli(capsys, "convert", src, out, "--to", "megatron", "--tp", 2)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "llama_4_scaling_beta = 0 and original_max_position_embeddings = 8" in err and not out.exists()


def test_vllm_rank_names_and_shapes(ministral, capsys):
    """Section 13: vLLM 0.32 builds MistralForCausalLM with Llama's 23 keys at tp 2."""
    v, hf = ministral.vllm(capsys), ministral.hf
    for r in range(2):
        got = load_vllm_rank(v, r)
        assert len(got) == 23
        layer = {k.split(".", 3)[3]: tuple(t.shape) for k, t in got.items() if k.startswith("model.layers.0.")}
        assert layer == {"self_attn.qkv_proj.weight": (64, 64), "self_attn.o_proj.weight": (64, 32),
                         "mlp.gate_up_proj.weight": (96, 64), "mlp.down_proj.weight": (64, 48),
                         "input_layernorm.weight": (64,), "post_attention_layernorm.weight": (64,),
                         **{f"self_attn.attn._{s}_scale": () for s in ("k", "v", "q", "prob")}}, layer
        assert {k for k in got if not k.startswith("model.layers.")} == {
            "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
        q, k, vv = (hf[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
        assert torch.equal(got["model.layers.1.self_attn.qkv_proj.weight"],
                           torch.cat([t.chunk(2)[r] for t in (q, k, vv)]))


def test_tp1_verifier_equals_transformers(ministral):
    """The verifier's logits equal transformers' past the original length, and differ without the query scale."""
    with torch.no_grad():
        expected = ministral.model(ids(), use_cache=False).logits
    weights = cast_weights(load_hf_rank(str(ministral.src), 0, 1, Options()), torch.float32, "cpu")
    with torch.no_grad():
        got = forward(weights, ids(), TPGroup()).logits
    assert (got[..., :1003] - expected).abs().max().item() <= ATOL
    scaling = dict(weights.config.rope_scaling)
    assert scaling.pop("llama_4_scaling_beta") == 0.1
    weights.config = dataclasses.replace(weights.config, rope_scaling=scaling)
    with torch.no_grad():
        unscaled = forward(weights, ids(), TPGroup()).logits
    assert (unscaled[..., :1003] - expected).abs().max().item() > 1e-3


def test_verify_forward_vllm_tp2(ministral, capsys):
    code, r, err = verify_forward(capsys, ministral.src, ministral.vllm(capsys))
    assert code == 0 and r is not None, err[-2000:]
    assert r["ok"] and r["first_divergence"] is None and r["max_abs"] <= ATOL, r["problems"]
    assert (r["b"]["layout"], r["b"]["tp"]) == ("vllm", 2)


@pytest.mark.slow
def test_verify_forward_perturbed_layer0_fails(ministral, capsys, tmp_path):
    code, r, err = verify_perturbed_vllm(capsys, ministral, tmp_path, "model.layers.0.self_attn.o_proj.weight", 5)
    assert code == 1 and r is not None, err[-2000:]
    assert not r["ok"] and r["first_divergence"].startswith("layer 0 attention"), r["first_divergence"]


@pytest.mark.parametrize("to, extra", [("megatron", ()), ("torch_dist", ()), ("megatron", ("--max-seq", "9"))])
def test_megatron_refused_past_the_original_length(ministral, capsys, tmp_path, to, extra):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", ministral.src, out, "--to", to, "--tp", 2, *extra)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert REFUSAL in err, err
    assert not out.exists()


def test_inspect_plan_load_rank(ministral, capsys):
    code, out, err = run_cli(capsys, "inspect", ministral.src, "--json")
    assert code == 0, err
    assert json.loads(out)["architecture"] == "Ministral3ForCausalLM"
    code, out, err = run_cli(capsys, "plan", ministral.src, "--to", "vllm", "--tp", 2, "--json")
    assert code == 0, err
    assert json.loads(out)
    rank = reshard.load_rank(str(ministral.src), "vllm", tp=2, rank=0)
    assert torch.equal(rank["model.layers.0.mlp.down_proj.weight"],
                       ministral.hf["model.layers.0.mlp.down_proj.weight"][:, :48])
