"""OLMo 2 / OLMo 3 (``Olmo2ForCausalLM`` / ``Olmo3ForCausalLM``, mappings/olmo2.toml; families-2.md sections 6, 13,
15, 17).

A tiny transformers OLMo 2 (fp32, 2 layers, hidden 64, 4 heads / 2 KV heads, vocab 1003, seeded noise on every
parameter, so the post norms and the whole-projection q/k norms are not ones) saved with save_pretrained, and an
OLMo 3 of 4 layers with a sliding window of 4 (3 sliding : 1 full):
  - hf -> vllm tp2 -> hf and hf -> hf: every tensor bit-equal, config kept, transformers' logits of the output equal;
  - vLLM rank files per section 13: fused qkv_proj / gate_up_proj, q_norm [nh*d] / k_norm [ng*d] whole on each rank;
  - the verifier's tp1 logits equal transformers' (1e-5); ``verify --forward`` passes at vllm tp2 (the q/k norm's
    sum of squares all-reduced over the ranks) and fails, naming layer 0, on one perturbed weight;
  - Megatron targets refused with section 17's message, one line, exit 2, nothing written;
  - inspect, plan and load_rank.
"""

from __future__ import annotations

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

SETTINGS = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1003, max_position_embeddings=128, tie_word_embeddings=False)
OLMO3 = dict(SETTINGS, num_hidden_layers=4, sliding_window=4,
             layer_types=["sliding_attention"] * 3 + ["full_attention"])
ATOL = 1e-5
REFUSAL = ("OLMo 2/3 normalises q and k over the whole projection (q_norm [64] across all heads); megatron-core's "
           "q_layernorm/k_layernorm are per head, so Megatron cannot express it. Convert to hf or vllm.")

CASES = {"olmo2": ("Olmo2Config", SETTINGS)}
ARCHS = {"olmo2": "Olmo2ForCausalLM"}
if hasattr(transformers, "Olmo3Config"):
    CASES["olmo3"] = ("Olmo3Config", OLMO3)
    ARCHS["olmo3"] = "Olmo3ForCausalLM"
families = families_fixture(transformers, CASES, ARCHS)


@pytest.fixture(scope="module", params=sorted(CASES))
def olmo(request, families):
    return families(request.param)


@pytest.fixture(scope="module")
def olmo2(families):
    return families("olmo2")


def ids(seq: int = 12) -> torch.Tensor:
    return torch.randint(0, 1003, (2, seq), generator=torch.Generator().manual_seed(1))


def assert_config_kept(config: dict, source: dict) -> None:
    for key in ("architectures", "model_type", "rms_norm_eps", "num_key_value_heads", "sliding_window",
                "rope_parameters", "layer_types", "tie_word_embeddings", "vocab_size"):
        assert config.get(key) == source.get(key), key


def test_vllm_round_trip_is_exact(olmo, capsys):
    v = olmo.vllm(capsys)
    assert_config_kept(json.loads((v / "config.json").read_text()), olmo.config)
    back = olmo.convert(capsys, "hf_from_vllm", v, "--to", "hf")
    got, config = load_hf_dir(back)
    problems = diff_states(got, olmo.hf, "hf")
    assert not problems, "\n".join(problems[:40])
    assert_config_kept(config, olmo.config)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    assert type(loaded).__name__ == type(olmo.model).__name__
    with torch.no_grad():
        assert torch.equal(loaded(ids()).logits, olmo.model(ids()).logits)


def test_hf_round_trip_is_exact(olmo, capsys):
    back = olmo.convert(capsys, "hf_from_hf", olmo.src, "--to", "hf")
    got, config = load_hf_dir(back)
    assert not diff_states(got, olmo.hf, "hf")
    assert_config_kept(config, olmo.config)


def test_vllm_rank_names_and_shapes(olmo, capsys):
    """families-2.md section 13: Llama's fused names, the post norms, q_norm / k_norm whole on every rank."""
    v = olmo.vllm(capsys)
    hf, H, d, nh, ng, F = olmo.hf, 64, 16, 4, 2, 96
    for r in range(2):
        got = load_vllm_rank(v, r)
        layer = {k.split(".", 3)[3]: tuple(t.shape) for k, t in got.items() if k.startswith("model.layers.0.")}
        assert layer == {"self_attn.qkv_proj.weight": ((nh + 2 * ng) * d // 2, H),
                         "self_attn.o_proj.weight": (H, nh * d // 2),
                         "self_attn.q_norm.weight": (nh * d,), "self_attn.k_norm.weight": (ng * d,),
                         "mlp.gate_up_proj.weight": (F, H), "mlp.down_proj.weight": (H, F // 2),
                         "post_attention_layernorm.weight": (H,), "post_feedforward_layernorm.weight": (H,),
                         **{f"self_attn.attn._{s}_scale": () for s in ("k", "v", "q", "prob")}}, layer
        assert {k for k in got if not k.startswith("model.layers.")} == {
            "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
        assert torch.equal(got["model.layers.1.self_attn.q_norm.weight"], hf["model.layers.1.self_attn.q_norm.weight"])
        assert torch.equal(got["model.layers.1.self_attn.k_norm.weight"], hf["model.layers.1.self_attn.k_norm.weight"])
        q, k, vv = (hf[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
        qkv = torch.cat([t.chunk(2)[r] for t in (q, k, vv)])
        assert torch.equal(got["model.layers.1.self_attn.qkv_proj.weight"], qkv)
        gate, up = (hf[f"model.layers.1.mlp.{n}_proj.weight"] for n in ("gate", "up"))
        gate_up = torch.cat([t.chunk(2)[r] for t in (gate, up)])
        assert torch.equal(got["model.layers.1.mlp.gate_up_proj.weight"], gate_up)


def verifier_logits(folder) -> torch.Tensor:
    weights = cast_weights(load_hf_rank(str(folder), 0, 1, Options()), torch.float32, "cpu")
    with torch.no_grad():
        return forward(weights, ids(), TPGroup()).logits


def test_tp1_verifier_equals_transformers(olmo):
    with torch.no_grad():
        expected = olmo.model(ids(), use_cache=False).logits
    got = verifier_logits(olmo.src)
    assert (got[..., :1003] - expected).abs().max().item() <= ATOL


def test_verify_forward_vllm_tp2(olmo, capsys):
    code, r, err = verify_forward(capsys, olmo.src, olmo.vllm(capsys))
    assert code == 0 and r is not None, err[-2000:]
    assert r["ok"] and r["first_divergence"] is None and r["max_abs"] <= ATOL, r["problems"]
    assert (r["b"]["layout"], r["b"]["tp"]) == ("vllm", 2)


@pytest.mark.parametrize("to", [("--to", "megatron"), ("--to", "torch_dist")])
def test_megatron_refused(olmo2, capsys, tmp_path, to):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", olmo2.src, out, *to, "--tp", 2)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert REFUSAL in err, err
    assert not out.exists()


def test_inspect_plan_load_rank(olmo2, capsys):
    code, out, err = run_cli(capsys, "inspect", olmo2.src, "--json")
    assert code == 0, err
    assert json.loads(out)["architecture"] == "Olmo2ForCausalLM"
    code, out, err = run_cli(capsys, "plan", olmo2.src, "--to", "vllm", "--tp", 2, "--json")
    assert code == 0, err
    assert json.loads(out)
    rank = reshard.load_rank(str(olmo2.src), "vllm", tp=2, rank=1)
    assert torch.equal(rank["model.layers.1.mlp.down_proj.weight"],
                       olmo2.hf["model.layers.1.mlp.down_proj.weight"][:, 48:])
    assert torch.equal(rank["model.layers.1.self_attn.q_norm.weight"],
                       olmo2.hf["model.layers.1.self_attn.q_norm.weight"])


@pytest.mark.parametrize("name, index, block", [("mlp.down_proj.weight", 3, "mlp"),
                                               ("self_attn.q_norm.weight", 40, "attention")])
def test_verify_forward_perturbed_layer0_fails(olmo2, capsys, tmp_path, name, index, block):
    """One row of layer 0's down_proj, or one element of its whole-projection q_norm inside rank 1's heads, scaled
    on vLLM rank 1: verify --forward exits 1 naming that block of layer 0."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(olmo2.vllm(capsys), bad)
    path = bad / "model-rank-1-part-0.safetensors"
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    tensors[f"model.layers.0.{name}"][index] *= 3.0
    save_file(tensors, str(path), metadata=metadata)
    code, r, err = verify_forward(capsys, olmo2.src, bad)
    assert code == 1 and r is not None, err[-2000:]
    assert not r["ok"] and r["first_divergence"].startswith(f"layer 0 {block}"), r["first_divergence"]
