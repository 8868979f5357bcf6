"""Nemotron (``NemotronForCausalLM``, mappings/nemotron.toml; shared/layouts/families-2.md sections 9, 15).

A tiny transformers Nemotron (fp32, 2 layers, hidden 64, 8 heads / 2 KV heads, head_dim 8, vocab 1003, partial
rotary 0.5, attention and MLP biases, untied, seeded noise on every parameter) saved with save_pretrained:
  - hf -> megatron tp2 pp2 -> torch_dist -> vllm tp2 -> hf: every tensor bit-equal, config keys kept, transformers'
    logits of the output equal the source's;
  - Megatron rank files by the stated rules (written out here from families-2.md section 9, not from reshard):
    norms keep HF's w (LayerNorm1P: megatron-core's apply_layernorm_1p adds the 1), up_proj column = linear_fc1,
    down_proj row = linear_fc2, qkv per query group; args LayerNorm / apply_layernorm_1p / squared_relu / ungated /
    rotary_percent;
  - ``verify --forward`` passes against the megatron and vllm tp2 outputs; the verifier's tp1 logits equal
    transformers' (1e-5) and, without 1 + w or with plain relu, do not;
  - inspect, plan and load_rank.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import reshard
from family_cases import families_fixture, verify_forward
from family_rules import diff_states, load_hf_dir, load_megatron_rank, megatron_rank_path
from helpers import run_cli
from reshard.layouts.base import Options
from reshard.verification.forward.decoder import TPGroup, cast_weights, forward
from reshard.verification.forward.sliced_rank import load_rank as load_hf_rank

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")

SETTINGS = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, head_dim=8, vocab_size=1003, max_position_embeddings=128,
                partial_rotary_factor=0.5, attention_bias=True, mlp_bias=True, bos_token_id=0, eos_token_id=0)
ATOL = 1e-5
TP, PP = 2, 2

families = families_fixture(transformers, {"nemotron": ("NemotronConfig", SETTINGS)},
                            {"nemotron": "NemotronForCausalLM"})


@pytest.fixture(scope="module")
def nemotron(families):
    return families("nemotron")


def ids(seq: int = 12) -> torch.Tensor:
    return torch.randint(0, 1003, (2, seq), generator=torch.Generator().manual_seed(1))


def rope_fraction(config: dict) -> float:
    return (config.get("rope_parameters") or {}).get("partial_rotary_factor", config.get("partial_rotary_factor"))


def test_round_trip_megatron_torch_dist_vllm_hf(nemotron, capsys):
    m = nemotron.megatron(capsys, tp=TP, pp=PP)
    d = nemotron.convert(capsys, "torch_dist", m, "--to", "torch_dist", "--tp", TP)
    v = nemotron.convert(capsys, "vllm_from_dist", d, "--to", "vllm", "--tp", TP)
    back = nemotron.convert(capsys, "hf_back", v, "--to", "hf")
    got, config = load_hf_dir(back)
    problems = diff_states(got, nemotron.hf, "hf")
    assert not problems, "\n".join(problems[:40])
    for key in ("architectures", "model_type", "norm_eps", "hidden_act", "head_dim", "num_key_value_heads",
                "attention_bias", "mlp_bias", "tie_word_embeddings", "vocab_size"):
        assert config.get(key) == nemotron.config.get(key), key
    assert rope_fraction(config) == 0.5
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids()).logits, nemotron.model(ids()).logits)


def test_megatron_rank_files_and_args(nemotron, capsys):
    root = nemotron.megatron(capsys, tp=TP, pp=PP)
    hf = nemotron.hf
    nh, ng, dh = 8, 2, 8
    for p in range(PP):
        for t in range(TP):
            blob = load_megatron_rank(megatron_rank_path(root, t, p, PP))
            state = blob["model"]
            layer = p  # one layer per stage
            pre, src = "decoder.layers.0.", f"model.layers.{layer}."
            assert torch.equal(state[pre + "self_attention.linear_qkv.layer_norm_weight"],
                               hf[src + "input_layernorm.weight"])  # w, not 1 + w
            assert torch.equal(state[pre + "self_attention.linear_qkv.layer_norm_bias"],
                               hf[src + "input_layernorm.bias"])
            assert torch.equal(state[pre + "mlp.linear_fc1.layer_norm_weight"],
                               hf[src + "post_attention_layernorm.weight"])
            assert torch.equal(state[pre + "mlp.linear_fc1.layer_norm_bias"], hf[src + "post_attention_layernorm.bias"])
            assert torch.equal(state[pre + "mlp.linear_fc1.weight"], hf[src + "mlp.up_proj.weight"].chunk(TP)[t])
            assert torch.equal(state[pre + "mlp.linear_fc1.bias"], hf[src + "mlp.up_proj.bias"].chunk(TP)[t])
            assert torch.equal(state[pre + "mlp.linear_fc2.weight"], hf[src + "mlp.down_proj.weight"].chunk(TP, 1)[t])
            assert torch.equal(state[pre + "mlp.linear_fc2.bias"], hf[src + "mlp.down_proj.bias"])
            q = hf[src + "self_attn.q_proj.weight"].reshape(ng, nh // ng * dh, -1)
            k = hf[src + "self_attn.k_proj.weight"].reshape(ng, dh, -1)
            v = hf[src + "self_attn.v_proj.weight"].reshape(ng, dh, -1)
            qkv = torch.cat([q, k, v], 1).reshape(-1, 64)
            assert torch.equal(state[pre + "self_attention.linear_qkv.weight"], qkv.chunk(TP)[t])
            if p == PP - 1:
                assert torch.equal(state["decoder.final_layernorm.weight"], hf["model.norm.weight"])
                assert torch.equal(state["decoder.final_layernorm.bias"], hf["model.norm.bias"])
            args = vars(blob["args"])
            for key, value in dict(normalization="LayerNorm", apply_layernorm_1p=True, squared_relu=True,
                                   swiglu=False, rotary_percent=0.5, add_bias_linear=True, add_qkv_bias=True,
                                   untie_embeddings_and_output_weights=True, kv_channels=8,
                                   num_query_groups=2).items():
                assert args.get(key) == value, (key, args.get(key))


def verifier_logits(folder, **changes) -> torch.Tensor:
    weights = cast_weights(load_hf_rank(str(folder), 0, 1, Options()), torch.float32, "cpu")
    weights.config = dataclasses.replace(weights.config, **changes)
    with torch.no_grad():
        return forward(weights, ids(), TPGroup()).logits


def test_tp1_verifier_equals_transformers(nemotron):
    with torch.no_grad():
        expected = nemotron.model(ids(), use_cache=False).logits
    got = verifier_logits(nemotron.src)
    assert (got[..., :1003] - expected).abs().max().item() <= ATOL
    for control in (dict(norm_offset=False), dict(activation="relu"), dict(rotary_fraction=1.0)):
        err = (verifier_logits(nemotron.src, **control)[..., :1003] - expected).abs().max().item()
        assert err > 1e-3, f"the decoder with {control} also matches"


@pytest.mark.parametrize("layout", ["megatron", "vllm"])
def test_verify_forward_tp2(nemotron, capsys, layout):
    dst = nemotron.megatron(capsys, tp=TP, pp=PP) if layout == "megatron" else nemotron.vllm(capsys)
    code, r, err = verify_forward(capsys, nemotron.src, dst)
    assert code == 0 and r is not None, err[-2000:]
    assert r["ok"] and r["first_divergence"] is None and r["max_abs"] <= ATOL, r["problems"]
    assert (r["b"]["layout"], r["b"]["tp"]) == (layout, TP)


def test_vllm_rank_names(nemotron, capsys):
    """families-2.md section 13 (vLLM 0.32 at tp 2): qkv_proj [(nh + 2 ng) d / 2, H], up_proj [F / 2, H] column,
    down_proj [H, F / 2] row, norms with .bias, lm_head."""
    from family_rules import load_vllm_rank

    v = nemotron.vllm(capsys)
    for r in range(TP):
        got = load_vllm_rank(v, r)
        shapes = {k: tuple(t.shape) for k, t in got.items()}
        assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (48, 64)
        assert shapes["model.layers.0.mlp.up_proj.weight"] == (48, 64)
        assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 48)
        assert shapes["model.layers.1.input_layernorm.bias"] == (64,)
        assert shapes["model.norm.bias"] == (64,)
        assert "lm_head.weight" in shapes
        assert torch.equal(got["model.layers.0.mlp.up_proj.weight"],
                           nemotron.hf["model.layers.0.mlp.up_proj.weight"].chunk(TP)[r])


def test_inspect_plan_load_rank(nemotron, capsys):
    code, out, err = run_cli(capsys, "inspect", nemotron.src, "--json")
    assert code == 0, err
    assert json.loads(out)["architecture"] == "NemotronForCausalLM"
    code, out, err = run_cli(capsys, "plan", nemotron.src, "--to", "megatron", "--tp", TP, "--json")
    assert code == 0, err
    rank = reshard.load_rank(str(nemotron.src), "megatron", tp=TP, rank=1)
    assert torch.equal(rank["decoder.layers.1.mlp.linear_fc2.weight"],
                       nemotron.hf["model.layers.1.mlp.down_proj.weight"][:, 48:])


@pytest.mark.parametrize("load_tp", [1, 2])
def test_megatron_core_loads_torch_dist_strictly(nemotron, capsys, load_tp, tmp_path):
    """megatron-core 0.16.1 (tests/mcore_nemotron_harness.py) loads reshard's tp2 torch_dist strictly at tp 1 and 2;
    its logits equal transformers' within 1e-5."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'reshard[test]')")
    from pathlib import Path

    from test_mcore_dist_fixtures import run_harness

    d = nemotron.convert(capsys, "torch_dist_from_hf", nemotron.src, "--to", "torch_dist", "--tp", TP)
    torch.save(ids(16), tmp_path / "ids.pt")
    run_harness(Path(__file__).with_name("mcore_nemotron_harness.py"), "load", d, tmp_path / "out.pt", "--tp",
                load_tp, "--ids", tmp_path / "ids.pt", timeout=300.0)
    got = torch.load(tmp_path / "out.pt", map_location="cpu", weights_only=True)["logits"]
    with torch.no_grad():
        expected = nemotron.model(ids(16), use_cache=False).logits
    assert got.shape == expected.shape
    err = (got - expected).abs().max().item()
    assert err <= 1e-5, f"megatron-core vs transformers: max |logit error| {err:.3g}"


def test_verify_forward_swapped_query_heads_fails(nemotron, capsys, tmp_path):
    """Two query heads swapped in linear_qkv of local layer 0 on Megatron rank (tp 1, pp 1), i.e. global layer 1:
    verify --forward exits 1 naming that layer's attention."""
    from family_cases import assert_swapped_query_heads_fail

    d = 8  # head_dim; 4 query heads per group, so heads 0 and 1 of the rank's first group
    assert_swapped_query_heads_fail(capsys, nemotron, tmp_path, (slice(0, d), slice(d, 2 * d)), 1, PP)


def test_full_rotary_is_written_explicitly(capsys, tmp_path):
    """NemotronConfig defaults partial_rotary_factor to 0.5: a Nemotron with full rotary keeps 1.0 written."""
    from helpers import tiny_transformers_model

    model = tiny_transformers_model(transformers, "NemotronConfig", num_key_value_heads=2, partial_rotary_factor=1.0,
                                    bos_token_id=0, eos_token_id=0)
    model.save_pretrained(tmp_path / "hf")
    code, _, err = run_cli(capsys, "convert", tmp_path / "hf", tmp_path / "v", "--to", "vllm", "--tp", 2)
    assert code == 0, err
    code, _, err = run_cli(capsys, "convert", tmp_path / "v", tmp_path / "back", "--to", "hf")
    assert code == 0, err
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids()).logits, model(ids()).logits)
