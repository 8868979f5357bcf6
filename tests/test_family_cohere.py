"""Command-R (``CohereForCausalLM``, mappings/cohere.toml) and Command-R7B / Command-A (``Cohere2ForCausalLM``,
mappings/cohere2.toml); families-2.md sections 8, 13, 15, 17.

Tiny transformers models (fp32, hidden 64, 4 heads / 2 KV heads, vocab 1003, tied, seeded noise on every parameter
so the norms and the per-head q/k norms are not ones): a Command-R+ (2 layers, ``use_qk_norm``, ``logit_scale``
0.0625) and a Cohere2 (4 layers, ``sliding_window`` 4 on 3 of 4 layers, RoPE only there, ``logit_scale`` 0.25),
run on 12 tokens (past the window):
  - hf -> vllm tp2 -> hf: every tensor bit-equal, config.json verbatim, transformers' logits of the output equal;
  - vLLM rank files per section 13 (24 / 38 keys: fused qkv_proj / gate_up_proj, one input_layernorm, q_norm
    [nh/T, d] / k_norm [ng/T, d] split by heads, the embedding and no lm_head);
  - the verifier's tp1 logits equal transformers' (1e-5): the parallel block, the bias-free LayerNorm, interleaved
    RoPE, Cohere2's NoPE full layers and window, the per-head LayerNorm q/k norm, the logit scale;
  - ``verify --forward`` passes at vllm tp2 and fails, naming layer 0's block, on a perturbed weight;
  - Megatron targets refused with section 17's message, one line, exit 2, nothing written;
  - inspect, plan and load_rank.
"""

from __future__ import annotations

import json

import pytest
import torch

import reshard
from family_cases import families_fixture, verify_forward, verify_perturbed_vllm
from family_rules import diff_states, load_hf_dir, load_vllm_rank
from helpers import run_cli
from reshard.layouts import cohere_rules
from reshard.layouts.base import Options
from reshard.verification.forward.decoder import TPGroup, cast_weights, forward
from reshard.verification.forward.sliced_rank import load_rank as load_hf_rank

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")

BASE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=1003,
            max_position_embeddings=128, tie_word_embeddings=True)
CASES = {"cohere": ("CohereConfig", dict(BASE, num_hidden_layers=2, use_qk_norm=True, logit_scale=0.0625)),
         "cohere2": ("Cohere2Config", dict(BASE, num_hidden_layers=4, sliding_window=4, logit_scale=0.25))}
ARCHS = {"cohere": "CohereForCausalLM", "cohere2": "Cohere2ForCausalLM"}
ATOL = 1e-5
REFUSAL = ("Command-R runs attention and MLP in parallel from one norm and multiplies the logits by logit_scale={}; "
           "megatron-core has neither. Convert to hf or vllm.")
families = families_fixture(transformers, CASES, ARCHS)


@pytest.fixture(scope="module", params=sorted(CASES))
def cohere(request, families):
    return families(request.param)


@pytest.fixture(scope="module")
def command_r(families):
    return families("cohere")


def ids(seq: int = 12) -> torch.Tensor:
    return torch.randint(0, 1003, (2, seq), generator=torch.Generator().manual_seed(1))


def test_vllm_round_trip_is_exact(cohere, capsys):
    v = cohere.vllm(capsys)
    assert json.loads((v / "config.json").read_text()) == cohere.config
    back = cohere.convert(capsys, "hf_from_vllm", v, "--to", "hf")
    got, config = load_hf_dir(back)
    problems = diff_states(got, cohere.hf, "hf")
    assert not problems, "\n".join(problems[:40])
    assert config == cohere.config and "lm_head.weight" not in got
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    assert type(loaded).__name__ == type(cohere.model).__name__
    with torch.no_grad():
        assert torch.equal(loaded(ids()).logits, cohere.model(ids()).logits)


def test_vllm_rank_names_and_shapes(cohere, capsys):
    """Section 13: Llama's fused names, input_layernorm only, q_norm / k_norm split by heads, no lm_head."""
    v = cohere.vllm(capsys)
    hf, qk_norm = cohere.hf, cohere.name == "cohere"
    for r in range(2):
        got = load_vllm_rank(v, r)
        assert len(got) == (24 if qk_norm else 38)
        layer = {k.split(".", 3)[3]: tuple(t.shape) for k, t in got.items() if k.startswith("model.layers.0.")}
        assert layer == {"self_attn.qkv_proj.weight": (64, 64), "self_attn.o_proj.weight": (64, 32),
                         "mlp.gate_up_proj.weight": (96, 64), "mlp.down_proj.weight": (64, 48),
                         "input_layernorm.weight": (64,),
                         **({"self_attn.q_norm.weight": (2, 16), "self_attn.k_norm.weight": (1, 16)} if qk_norm
                            else {}),
                         **{f"self_attn.attn._{s}_scale": () for s in ("k", "v", "q", "prob")}}, layer
        assert {k for k in got if not k.startswith("model.layers.")} == {"model.embed_tokens.weight",
                                                                         "model.norm.weight"}
        table = got["model.embed_tokens.weight"]
        rows = hf["model.embed_tokens.weight"][512 * r:512 * (r + 1)]
        assert table.shape == (512, 64) and torch.equal(table[:len(rows)], rows) and not table[len(rows):].any()
        if qk_norm:
            assert torch.equal(got["model.layers.1.self_attn.q_norm.weight"],
                               hf["model.layers.1.self_attn.q_norm.weight"][2 * r:2 * r + 2])
            assert torch.equal(got["model.layers.1.self_attn.k_norm.weight"],
                               hf["model.layers.1.self_attn.k_norm.weight"][r:r + 1])
        q, k, vv = (hf[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
        assert torch.equal(got["model.layers.1.self_attn.qkv_proj.weight"],
                           torch.cat([t.chunk(2)[r] for t in (q, k, vv)]))


def test_tp1_verifier_equals_transformers(cohere):
    with torch.no_grad():
        expected = cohere.model(ids(), use_cache=False).logits
    weights = cast_weights(load_hf_rank(str(cohere.src), 0, 1, Options()), torch.float32, "cpu")
    with torch.no_grad():
        got = forward(weights, ids(), TPGroup()).logits
    assert (got[..., :1003] - expected).abs().max().item() <= ATOL


@pytest.mark.parametrize("name", ["cohere", pytest.param("cohere2", marks=pytest.mark.slow)])
def test_verify_forward_vllm_tp2(families, capsys, name):
    cohere = families(name)
    code, r, err = verify_forward(capsys, cohere.src, cohere.vllm(capsys))
    assert code == 0 and r is not None, err[-2000:]
    assert r["ok"] and r["first_divergence"] is None and r["max_abs"] <= ATOL, r["problems"]
    assert (r["b"]["layout"], r["b"]["tp"]) == ("vllm", 2)


@pytest.mark.parametrize("name, index, block", [
    ("mlp.down_proj.weight", 3, "mlp"),
    pytest.param("self_attn.q_norm.weight", (1, 5), "attention", marks=pytest.mark.slow)])
def test_verify_forward_perturbed_layer0_fails(command_r, capsys, tmp_path, name, index, block):
    """One row of layer 0's down_proj, or one element of rank 1's per-head q_norm, tripled on vLLM rank 1:
    verify --forward exits 1 naming that block of layer 0."""
    code, r, err = verify_perturbed_vllm(capsys, command_r, tmp_path, f"model.layers.0.{name}", index)
    assert code == 1 and r is not None, err[-2000:]
    assert not r["ok"] and r["first_divergence"].startswith(f"layer 0 {block}"), r["first_divergence"]


@pytest.mark.parametrize("to", ["megatron", "torch_dist"])
def test_megatron_refused(cohere, capsys, tmp_path, to):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", cohere.src, out, "--to", to, "--tp", 2)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert REFUSAL.format(CASES[cohere.name][1]["logit_scale"]) in err, err
    assert not out.exists()


def test_default_logit_scale_is_transformers():
    """A config.json without logit_scale is read with the config classes' default."""
    for cls in ("CohereConfig", "Cohere2Config"):
        assert getattr(transformers, cls)().logit_scale == cohere_rules.DEFAULT_LOGIT_SCALE


def test_inspect_plan_load_rank(command_r, capsys):
    code, out, err = run_cli(capsys, "inspect", command_r.src, "--json")
    assert code == 0, err
    assert json.loads(out)["architecture"] == "CohereForCausalLM"
    code, out, err = run_cli(capsys, "plan", command_r.src, "--to", "vllm", "--tp", 2, "--json")
    assert code == 0, err
    assert json.loads(out)
    rank = reshard.load_rank(str(command_r.src), "vllm", tp=2, rank=1)
    assert torch.equal(rank["model.layers.1.self_attn.k_norm.weight"],
                       command_r.hf["model.layers.1.self_attn.k_norm.weight"][1:])
    assert "lm_head.weight" not in rank


def test_cohere2_release_spelling_kept(families, capsys, tmp_path):
    """Command-R7B's config.json spells its layers as sliding_window_pattern 4 (no layer_types): kept as spelt through
    vllm tp2 and back, tensors bit-equal."""
    import shutil

    case = families("cohere2")
    src = tmp_path / "release"
    shutil.copytree(case.src, src)
    config = dict(case.config)
    assert config.pop("layer_types") == ["sliding_attention"] * 3 + ["full_attention"]
    config["sliding_window_pattern"] = 4
    (src / "config.json").write_text(json.dumps(config))
    v, back = tmp_path / "v", tmp_path / "back"
    for a, b, to in ((src, v, "vllm"), (v, back, "hf")):
        code, _, err = run_cli(capsys, "convert", a, b, "--to", to, *(["--tp", "2"] if to == "vllm" else []))
        assert code == 0, err
    got, written = load_hf_dir(back)
    assert written == config and not diff_states(got, case.hf, "hf")


@pytest.mark.slow
def test_command_r_with_attention_bias(capsys, tmp_path):
    """attention_bias (q/k/v/o biases) without q/k norms: vllm tp2 and back bit-equal, the verifier = transformers,
    verify --forward passes."""
    from family_cases import FamilyCase, assert_hf_back

    case = FamilyCase(transformers, "cohere_bias", tmp_path, "CohereConfig",
                      dict(BASE, num_hidden_layers=2, attention_bias=True), "CohereForCausalLM")
    assert "model.layers.1.self_attn.o_proj.bias" in case.hf
    v = case.vllm(capsys)
    assert_hf_back(transformers, case, case.convert(capsys, "hf_from_vllm", v, "--to", "hf"), ids())
    weights = cast_weights(load_hf_rank(str(case.src), 0, 1, Options()), torch.float32, "cpu")
    with torch.no_grad():
        got, expected = forward(weights, ids(), TPGroup()).logits, case.model(ids(), use_cache=False).logits
    assert (got[..., :1003] - expected).abs().max().item() <= ATOL
    code, r, err = verify_forward(capsys, case.src, v)
    assert code == 0 and r is not None and r["ok"], err[-2000:]
