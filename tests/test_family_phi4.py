"""Phi-4-mini and Phi-4 (``Phi3ForCausalLM``, mappings/phi3.toml; families-2.md sections 12, 13, 15, 17).

Tiny transformers Phi-3 models (fp32, 2 layers, hidden 64, 4 heads / 2 KV heads, vocab 1003, seeded noise on every
parameter):
  - ``phi4mini``: Phi-4-mini's features in its release spelling (transformers 4 keys: ``rope_scaling`` =
    ``{type: longrope, short_factor, long_factor}`` without the pretraining length, which sits at the top level as
    ``original_max_position_embeddings`` = 8, so 16 tokens use the long factors), ``partial_rotary_factor`` 0.75
    (6 rotated pairs of 8), tied embeddings (no ``lm_head`` on disk);
  - ``phi4``: Phi-4's (untied, ``rope_theta`` 250000, full rotary, no scaling);
  - ``phi4mini_plain``: Phi-4-mini without longrope (what Megatron can express: partial rotary, tied).
Checks: hf -> vllm tp2 -> hf (all three) and hf -> megatron tp2 -> hf (``phi4``, ``phi4mini_plain``) bit-exact with
config.json kept and transformers' logits equal; vLLM rank names/shapes (section 13: tied keeps ``lm_head.weight``,
not ``model.embed_tokens.weight``); the verifier's tp1 logits = transformers' (the top-level pretraining length read);
``verify --forward`` passes against the outputs and fails naming layer 0 on a perturbed weight; longrope refused for
Megatron in one line, nothing written; inspect / plan / load_rank.
"""

from __future__ import annotations

import json

import pytest
import torch

import reshard
from family_cases import FamilyCase, assert_hf_back, verify_forward, verify_perturbed_vllm
from family_rules import load_hf_dir, load_vllm_rank
from helpers import run_cli
from reshard.layouts.base import Options
from reshard.verification.forward.decoder import TPGroup, cast_weights, forward
from reshard.verification.forward.sliced_rank import load_rank as load_hf_rank

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1003, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SHORT = [1.0, 1.1, 1.2, 1.3, 1.5, 2.0]
LONG = [1.0, 2.0, 3.0, 4.0, 5.0, 8.0]
CASES = {
    "phi4mini": dict(BASE, tie_word_embeddings=True, original_max_position_embeddings=8,
                     rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                      "short_factor": SHORT, "long_factor": LONG}),
    "phi4": dict(BASE, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 250000.0}),
    "phi4mini_plain": dict(BASE, tie_word_embeddings=True, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}),
}
ATOL = 1e-5


def release_spelling(folder) -> None:
    """Rewrite Phi-4-mini's config.json as released: transformers 4 keys, the pretraining length only at the top."""
    path = folder / "config.json"
    c = json.loads(path.read_text())
    params = c.pop("rope_parameters")
    c.update(rope_theta=params["rope_theta"], partial_rotary_factor=params["partial_rotary_factor"],
             rope_scaling={"type": "longrope", "long_factor": params["long_factor"],
                           "short_factor": params["short_factor"]})
    path.write_text(json.dumps(c, indent=2))


@pytest.fixture(scope="module")
def phi(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            case = FamilyCase(transformers, name, tmp_path_factory.mktemp(name), "Phi3Config", CASES[name],
                              "Phi3ForCausalLM")
            if name == "phi4mini":
                release_spelling(case.src)
                case.hf, case.config = load_hf_dir(case.src)
                model = transformers.AutoModelForCausalLM.from_pretrained(case.src, dtype=torch.float32).eval()
                assert model.config.rope_parameters["original_max_position_embeddings"] == 8
                case.model = model
            made[name] = case
        return made[name]
    return get


def ids(seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 1003, (2, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", ["phi4mini", "phi4"])
def test_vllm_round_trip_is_exact(phi, capsys, name):
    case = phi(name)
    v = case.vllm(capsys)
    assert json.loads((v / "config.json").read_text()) == case.config
    assert_hf_back(transformers, case, case.convert(capsys, "hf_from_vllm", v, "--to", "hf"), ids())


@pytest.mark.parametrize("name", ["phi4", "phi4mini_plain"])
def test_megatron_round_trip_is_exact(phi, capsys, name):
    case = phi(name)
    m = case.convert(capsys, "megatron_tp2", case.src, "--to", "megatron", "--tp", 2)
    assert_hf_back(transformers, case, case.convert(capsys, "hf_from_megatron", m, "--to", "hf"), ids())


@pytest.mark.slow
def test_plain_mini_vllm_round_trip_is_exact(phi, capsys):
    case = phi("phi4mini_plain")
    assert_hf_back(transformers, case, case.convert(capsys, "hf_from_vllm", case.vllm(capsys), "--to", "hf"), ids())


@pytest.mark.parametrize("name, tied", [("phi4mini", True), ("phi4", False)])
def test_vllm_rank_names_and_shapes(phi, capsys, name, tied):
    """Section 13: Phi-3's fused names; a tied model keeps lm_head.weight (the vocabulary padded to 1024, 512 rows a
    rank) and not model.embed_tokens.weight."""
    case = phi(name)
    v, hf = case.vllm(capsys), case.hf
    outer = {"lm_head.weight", "model.norm.weight"} | (set() if tied else {"model.embed_tokens.weight"})
    for r in range(2):
        got = load_vllm_rank(v, r)
        layer = {k.split(".", 3)[3]: tuple(t.shape) for k, t in got.items() if k.startswith("model.layers.0.")}
        assert layer == {"self_attn.qkv_proj.weight": (64, 64), "self_attn.o_proj.weight": (64, 32),
                         "mlp.gate_up_proj.weight": (96, 64), "mlp.down_proj.weight": (64, 48),
                         "input_layernorm.weight": (64,), "post_attention_layernorm.weight": (64,),
                         **{f"self_attn.attn._{s}_scale": () for s in ("k", "v", "q", "prob")}}, layer
        assert {k for k in got if not k.startswith("model.layers.")} == outer
        assert len(got) == 22 + (0 if tied else 1)
        head = got["lm_head.weight"]
        assert head.shape == (512, 64)
        source = hf["model.embed_tokens.weight" if tied else "lm_head.weight"]
        rows = source[512 * r:512 * (r + 1)]
        assert torch.equal(head[:len(rows)], rows) and not head[len(rows):].any()
        fused = hf["model.layers.1.self_attn.qkv_proj.weight"]
        q, k, vv = fused[:64], fused[64:96], fused[96:]
        assert torch.equal(got["model.layers.1.self_attn.qkv_proj.weight"],
                           torch.cat([t.chunk(2)[r] for t in (q, k, vv)]))


def verifier_logits(folder) -> torch.Tensor:
    weights = cast_weights(load_hf_rank(str(folder), 0, 1, Options()), torch.float32, "cpu")
    with torch.no_grad():
        return forward(weights, ids(), TPGroup()).logits


@pytest.mark.parametrize("name", ["phi4mini", "phi4"])
def test_tp1_verifier_equals_transformers(phi, name):
    """Phi-4-mini at 16 tokens > the top-level pretraining length 8: the long factors and the attention factor
    sqrt(1 + ln(64 / 8) / ln 8) apply only when that key is read (0.0068 off with Phi3Config's default 4096)."""
    case = phi(name)
    with torch.no_grad():
        expected = case.model(ids(), use_cache=False).logits
    got = verifier_logits(case.src)
    assert (got[..., :1003] - expected).abs().max().item() <= ATOL


def test_verify_forward_vllm_tp2(phi, capsys):
    case = phi("phi4mini")
    code, r, err = verify_forward(capsys, case.src, case.vllm(capsys))
    assert code == 0 and r is not None, err[-2000:]
    assert r["ok"] and r["first_divergence"] is None and r["max_abs"] <= ATOL, r["problems"]
    assert (r["b"]["layout"], r["b"]["tp"]) == ("vllm", 2)


@pytest.mark.slow
def test_verify_forward_megatron_tp2(phi, capsys):
    case = phi("phi4")
    m = case.convert(capsys, "megatron_tp2", case.src, "--to", "megatron", "--tp", 2)
    code, r, err = verify_forward(capsys, case.src, m)
    assert code == 0 and r is not None, err[-2000:]
    assert r["ok"] and r["max_abs"] <= ATOL, r["problems"]


@pytest.mark.slow
def test_verify_forward_perturbed_layer0_fails(phi, capsys, tmp_path):
    """Row 3 of layer 0's down_proj tripled on vLLM rank 1: verify --forward exits 1 naming layer 0's MLP."""
    code, r, err = verify_perturbed_vllm(capsys, phi("phi4mini"), tmp_path, "model.layers.0.mlp.down_proj.weight", 3)
    assert code == 1 and r is not None, err[-2000:]
    assert not r["ok"] and r["first_divergence"].startswith("layer 0 mlp"), r["first_divergence"]


@pytest.mark.parametrize("to", ["megatron", "torch_dist"])
def test_longrope_refused_for_megatron(phi, capsys, tmp_path, to):
    """megatron-core has no longrope: one line naming it and the way out, exit 2, nothing written."""
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", phi("phi4mini").src, out, "--to", to, "--tp", 2)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "'longrope' RoPE scaling" in err and "--allow-lossy-config rope_scaling" in err, err
    assert not out.exists()


def test_inspect_plan_load_rank(phi, capsys):
    case = phi("phi4mini")
    code, out, err = run_cli(capsys, "inspect", case.src, "--json")
    assert code == 0, err
    assert json.loads(out)["architecture"] == "Phi3ForCausalLM"
    code, out, err = run_cli(capsys, "plan", case.src, "--to", "vllm", "--tp", 2, "--json")
    assert code == 0, err
    assert json.loads(out)
    rank = reshard.load_rank(str(case.src), "vllm", tp=2, rank=1)
    assert torch.equal(rank["model.layers.1.mlp.down_proj.weight"],
                       case.hf["model.layers.1.mlp.down_proj.weight"][:, 48:])
    gate_up = case.hf["model.layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(rank["model.layers.0.mlp.gate_up_proj.weight"], torch.cat([gate_up[48:96], gate_up[144:]]))


@pytest.mark.parametrize("arch", ["Phi4MMForCausalLM", "Phi4FlashForCausalLM"])
def test_other_phi4_architectures_refused_by_name(capsys, tmp_path, arch):
    """Section 17: Phi-4-multimodal and Phi-4-flash are other architectures: refused by name, nothing written."""
    from safetensors.torch import save_file

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": arch.lower()}))
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(src / "model.safetensors"))
    code, _, err = run_cli(capsys, "convert", src, out, "--to", "vllm", "--tp", 2)
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"unknown architecture '{arch}'" in err, err
    assert not out.exists()
