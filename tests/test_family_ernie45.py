"""Ernie 4.5 MoE (``Ernie4_5_MoeForCausalLM``, mappings/ernie4_5_moe.toml; ../shared/layouts/families-2.md sections
11, 13, 15 rows 1 / 5 / 8 / 9 and 17): a tiny model built by transformers from ``Ernie4_5_MoeConfig`` (probes/
families-2/hf_tiny.py's case: 3 layers, MoE on layers 1..2 by moe_layer_start_index / end_index / interval, a
shared expert, untied head) with seeded noise on every 1-D parameter and on the selection bias
``e_score_correction_bias`` ([1, E] on disk), which ranks experts by softmax + bias.

- hf -> vllm tp2 -> hf bit-exact, config.json verbatim, transformers' logits equal; vLLM 0.32's per-rank names and
  shapes at tp2 are the probe's recorded set (41 keys, the bias squeezed to [E]).
- The forward verifier's logits equal transformers' (interleaved-pair RoPE, softmax + selection-bias routing), and
  not without either.
- Megatron: a non-zero bias is refused in one line (exit 2, nothing written); an all-zero bias converts (softmax
  router, rotary_interleaved, moe_layer_freq list) and comes back bit-exact (the bias written as zeros).
- The MoE layer rule equals transformers' own placement for several ranges.
- ``inspect``, ``plan``, ``load_rank``.
- (slow) ``verify --forward`` at tp2 passes against the vllm and megatron outputs and names layer 0 for a
  perturbed layer-0 weight; megatron-core 0.16.1 loads reshard's torch_dist strictly and computes transformers'
  logits within 1e-5 (tests/mcore_ernie_harness.py).
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from helpers import run_cli

import reshard
from reshard.layouts.base import Options
from reshard.verification.forward.decoder import TPGroup, cast_weights, forward
from reshard.verification.forward.sliced_rank import load_rank as load_hf_rank
from test_family_glm4_moe import config_of, hf_state, logits, reshard_convert  # (the same IDS)
from vllm_rules import load_rank as load_vllm_rank

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")

#: hf_tiny.py's ernie4_5_moe case (families-2 probes): V 512, H 64, nh 4, ng 2, d 16, 3 layers (layer 0 dense).
DIMS = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, tie_word_embeddings=False, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, moe_num_experts=4, moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1,
            moe_layer_end_index=2, moe_layer_interval=1)
ATOL = 1e-5
IDS = torch.tensor([[1, 17, 254, 33, 400, 7, 99, 300, 12, 5, 200, 42, 77, 8, 150, 3]])
BIAS = "model.layers.{}.mlp.moe_statics.e_score_correction_bias"


def save_ernie(folder, zero_bias: bool = False, **overrides) -> str:
    """transformers' own tiny Ernie4_5_MoeForCausalLM (fp32), seeded noise on every 1-D parameter and on the
    [1, E] selection bias (as hf_tiny.py's ``perturb``; ``zero_bias``: the bias left all zero), saved by
    ``save_pretrained``."""
    torch.manual_seed(0)
    model = transformers.Ernie4_5_MoeForCausalLM(transformers.Ernie4_5_MoeConfig(**{**DIMS, **overrides}))
    model = model.float().eval()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name:
                continue
            if name.endswith("e_score_correction_bias"):
                if not zero_bias:
                    p.add_(0.1 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
            elif p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    model.save_pretrained(folder)
    return str(folder)


def assert_same_hf(a_folder, b_folder) -> None:
    a, b = hf_state(a_folder), hf_state(b_folder)
    assert sorted(a) == sorted(b)
    bad = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    assert not bad, bad[:5]
    assert config_of(b_folder) == config_of(a_folder)


@pytest.fixture(scope="module")
def ernie(tmp_path_factory):
    return save_ernie(tmp_path_factory.mktemp("ernie45") / "hf")


@pytest.fixture(scope="module")
def zero(tmp_path_factory):
    return save_ernie(tmp_path_factory.mktemp("ernie45_zero") / "hf", zero_bias=True)


@pytest.fixture(scope="module")
def chain(ernie, zero, tmp_path_factory):
    """hf -> vllm tp2 -> hf (non-zero bias); hf (zero bias) -> megatron tp2 ep2 -> hf."""
    root = tmp_path_factory.mktemp("ernie45_chain")
    out = {k: str(root / k) for k in ("vllm", "hf", "megatron", "hf_m")}
    notes = {"vllm": reshard_convert(ernie, out["vllm"], "--to", "vllm", "--tp", "2")}
    notes["hf"] = reshard_convert(out["vllm"], out["hf"], "--to", "hf")
    notes["megatron"] = reshard_convert(zero, out["megatron"], "--to", "megatron", "--tp", "2", "--ep", "2")
    notes["hf_m"] = reshard_convert(out["megatron"], out["hf_m"], "--to", "hf")
    return out, notes


def test_vllm_round_trip_is_bit_exact(ernie, chain):
    out, notes = chain
    assert hf_state(ernie)[BIAS.format(1)].shape == (1, 4) and hf_state(ernie)[BIAS.format(1)].count_nonzero() == 4
    assert "e_score_correction_bias: Hugging Face's [1, E] is written [E]" in notes["vllm"], notes["vllm"]
    assert_same_hf(ernie, out["hf"])
    torch.testing.assert_close(logits(out["hf"]), logits(ernie), rtol=0, atol=0)


#: vLLM 0.32's per-layer names on each rank at tp 2 (families-2.md section 13 and probes/families-2/NOTES.md
#: section 3, ernie4_5_moe: Llama attention, the router under mlp.gate, the bias squeezed under
#: mlp.experts.routed_experts, the shared expert under _shared_experts._layer), by layer kind.
VLLM_EVERY_LAYER = {"input_layernorm.weight": [64], "post_attention_layernorm.weight": [64],
                    "self_attn.qkv_proj.weight": [64, 64], "self_attn.o_proj.weight": [64, 32],
                    **{f"self_attn.attn._{s}_scale": [] for s in ("k", "v", "q", "prob")}}
VLLM_DENSE = {"mlp.gate_up_proj.weight": [96, 64], "mlp.down_proj.weight": [64, 48]}
VLLM_MOE = {"mlp.gate.weight": [4, 64], "mlp.experts.routed_experts.e_score_correction_bias": [4],
            "mlp.experts.routed_experts.w13_weight": [4, 32, 64], "mlp.experts.routed_experts.w2_weight": [4, 64, 16],
            "mlp.experts._shared_experts._layer.gate_up_proj.weight": [32, 64],
            "mlp.experts._shared_experts._layer.down_proj.weight": [64, 16]}


def observed_vllm_rank() -> dict[str, list[int]]:
    """The probe's 41 keys per rank: embedding, final norm and head, then layer 0 dense and layers 1-2 MoE."""
    keys = {"model.embed_tokens.weight": [256, 64], "model.norm.weight": [64], "lm_head.weight": [256, 64]}
    for i in range(DIMS["num_hidden_layers"]):
        keys.update({f"model.layers.{i}.{k}": v for k, v in {**VLLM_EVERY_LAYER,
                                                              **(VLLM_MOE if i else VLLM_DENSE)}.items()})
    assert len(keys) == 41
    return keys


def test_vllm_rank_names_and_shapes_are_vllms(ernie, chain):
    out, _ = chain
    expected = observed_vllm_rank()
    hf = hf_state(ernie)
    for r in range(2):
        tensors, _ = load_vllm_rank(out["vllm"], r)
        assert {k: list(v.shape) for k, v in tensors.items()} == expected
        bias = tensors["model.layers.2.mlp.experts.routed_experts.e_score_correction_bias"]
        assert bias.dtype == torch.float32 and torch.equal(bias, hf[BIAS.format(2)][0])
    # rank 1 of tp 2: the second KV head's q / k / v rows as stored (interleaved RoPE: no row permutation)
    tensors, _ = load_vllm_rank(out["vllm"], 1)
    q, k, v = (hf[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(tensors["model.layers.1.self_attn.qkv_proj.weight"], torch.cat([q[32:], k[16:], v[16:]]))


def verifier_logits(folder, **changes) -> torch.Tensor:
    """The forward verifier's TP 1 logits on an HF folder (its decoder config changed by ``changes``; ``bias=False``
    drops the selection bias)."""
    weights = cast_weights(load_hf_rank(str(folder), 0, 1, Options()), torch.float32, "cpu")
    if not changes.pop("bias", True):
        weights.layers = [dataclasses.replace(layer, router_bias=None) for layer in weights.layers]
    weights.config = dataclasses.replace(weights.config, **changes)
    with torch.no_grad():
        return forward(weights, IDS, TPGroup()).logits[0]


def test_forward_verifier_computes_ernie_as_transformers(ernie):
    """Interleaved-pair RoPE and softmax + selection-bias routing: the verifier's logits equal transformers'
    (fp32), and not with rotate-half RoPE or without the bias (the case exercises both)."""
    expected = logits(ernie)
    assert (verifier_logits(ernie) - expected).abs().max().item() <= ATOL
    for control in (dict(rope_interleaved=False), dict(bias=False)):
        err = (verifier_logits(ernie, **control) - expected).abs().max().item()
        assert err > 1e-3, f"the decoder with {control} also matches: the case tests nothing"


def test_megatron_refuses_a_nonzero_bias(ernie, tmp_path, capsys):
    """Section 17: one line, exit 2, nothing written; --allow-lossy-config router_bias drops it with a note."""
    for to in ("megatron", "torch_dist"):
        code, _, err = run_cli(capsys, "convert", ernie, tmp_path / to, "--to", to, "--tp", "2")
        assert code == 2 and not os.path.exists(tmp_path / to), err
        assert err.strip() == (
            "error: Ernie 4.5 ranks experts by softmax + e_score_correction_bias; megatron-core accepts a selection "
            "bias only with sigmoid scores, which would change the routing (Megatron-Bridge's sigmoid mapping "
            "differs from transformers). Convert to hf or vllm, or pass --allow-lossy-config router_bias to drop "
            "the bias."), err
    code, _, err = run_cli(capsys, "convert", ernie, tmp_path / "lossy", "--to", "megatron",
                           "--allow-lossy-config", "router_bias")
    assert code == 0 and "dropped the selection bias" in err, err


def test_zero_bias_through_megatron_is_bit_exact(zero, chain):
    """An all-zero bias is the plain softmax router: Megatron holds none (args: softmax, no expert bias, the
    top-k renormalised: moe_router_pre_softmax False), rotary_interleaved, moe_layer_freq as a list; read back,
    the HF output writes the [1, E] zeros and equals the source bit for bit, config.json verbatim."""
    out, notes = chain
    assert "all zero" in notes["megatron"]
    blob = torch.load(os.path.join(out["megatron"], "release", "mp_rank_01_001", "model_optim_rng.pt"),
                      weights_only=False)
    a, model = vars(blob["args"]), blob["model"]
    assert (a["rotary_interleaved"], a["moe_layer_freq"], a["moe_router_score_function"],
            a["moe_router_enable_expert_bias"], a["moe_router_pre_softmax"], a["moe_shared_expert_intermediate_size"]
            ) == (True, [0, 1, 1], "softmax", False, False, 32)
    assert not any("expert_bias" in k for k in model)
    hf = hf_state(zero)
    gate, up = hf["model.layers.2.mlp.experts.3.gate_proj.weight"], hf["model.layers.2.mlp.experts.3.up_proj.weight"]
    assert torch.equal(model["decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight"],
                       torch.cat([gate[16:], up[16:]]))
    assert_same_hf(zero, out["hf_m"])


def test_verify_digest_reads_a_missing_zero_bias_as_zeros(ernie, zero, chain, capsys):
    """``verify``: the Megatron copy (no bias) equals the all-zero-bias source, and differs from the same weights
    with a non-zero bias, naming it."""
    out, _ = chain
    code, text, err = run_cli(capsys, "verify", zero, out["megatron"])
    assert code == 0 and "EQUAL" in text, text + err
    code, text, err = run_cli(capsys, "verify", ernie, out["megatron"])
    assert code == 1 and "missing in B: " + BIAS.format(1) in text, text + err


def test_moe_layer_rule_is_transformers(tmp_path):
    """The [moe] start / end / interval rule places MoE layers where transformers' decoder builds them."""
    from reshard.mapping import load_shipped

    family = load_shipped("ernie4_5_moe")
    for start, end, step, layers in ((1, 2, 1, 3), (0, 5, 2, 6), (2, 4, 1, 6), (1, 9, 3, 7)):
        config = transformers.Ernie4_5_MoeConfig(**{**DIMS, "num_hidden_layers": layers,
                                                    "moe_layer_start_index": start, "moe_layer_end_index": end,
                                                    "moe_layer_interval": step})
        built = transformers.Ernie4_5_MoeForCausalLM(config)
        expected = tuple(i for i, layer in enumerate(built.model.layers) if hasattr(layer.mlp, "gate")
                         and hasattr(layer.mlp, "experts"))
        assert family.sparse_layers(config.to_dict(), layers) == expected, (start, end, step)
    # moe_layer_end_index -1 (the class default) or unset: the last layer, as transformers resolves it
    spelt = {k: v for k, v in DIMS.items() if k != "moe_layer_end_index"} | {"num_hidden_layers": 4}
    built = transformers.Ernie4_5_MoeForCausalLM(transformers.Ernie4_5_MoeConfig(**spelt, moe_layer_end_index=-1))
    expected = tuple(i for i, layer in enumerate(built.model.layers) if hasattr(layer.mlp, "experts"))
    assert expected == (1, 2, 3)
    assert family.sparse_layers({**spelt, "moe_layer_end_index": -1}, 4) == family.sparse_layers(spelt, 4) == expected


def test_inspect_plan_load_rank(ernie, capsys):
    code, out, err = run_cli(capsys, "inspect", ernie, "--json")
    assert code == 0, err
    assert json.loads(out)["architecture"] == "Ernie4_5_MoeForCausalLM"
    code, out, err = run_cli(capsys, "plan", ernie, "--to", "vllm", "--tp", 2, "--json")
    assert code == 0 and json.loads(out), err
    hf = hf_state(ernie)
    rank = reshard.load_rank(ernie, "vllm", tp=2, rank=1)
    bias = rank["model.layers.1.mlp.experts.routed_experts.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and torch.equal(bias, hf[BIAS.format(1)][0])
    o = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(rank[o], hf[o][:, 32:])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vllm", "megatron"])
def test_verify_forward_at_tp2(ernie, zero, chain, name):
    """Section 15 row 9: the HF source against its vLLM (selection bias on) / Megatron (all-zero bias left out)
    output at tp 2, layer by layer."""
    from reshard.verification.forward import verify_forward

    out, _ = chain
    r = verify_forward(ernie if name == "vllm" else zero, out[name], nproc=2)
    assert (r["b"]["layout"], r["b"]["tp"]) == (name, 2)
    assert r["ok"], r["problems"]
    assert r["max_abs"] <= ATOL and r["argmax_agreement"] == 1.0 and r["first_divergence"] is None


@pytest.mark.slow
def test_verify_forward_names_a_perturbed_layer0_weight(ernie, chain, tmp_path, capsys):
    """Rank 1's layer-0 qkv_proj row 3 (a query row, rotated with its interleaved pair) scaled in a vLLM copy."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from family_cases import verify_forward

    bad = tmp_path / "bad"
    shutil.copytree(chain[0]["vllm"], bad)
    path = str(bad / "model-rank-1-part-0.safetensors")
    tensors = load_file(path)
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    tensors["model.layers.0.self_attn.qkv_proj.weight"][3] *= 3.0
    save_file(tensors, path, metadata=metadata)
    code, r, err = verify_forward(capsys, ernie, bad)
    assert code == 1 and r is not None, err
    assert not r["ok"] and r["first_divergence"].startswith("layer 0"), r["first_divergence"]


@pytest.mark.slow
def test_megatron_core_loads_and_matches(zero, tmp_path):
    """Section 15 rows 3 / 8: megatron-core 0.16.1 (tests/mcore_ernie_harness.py: its GPTModel built from the
    checkpoint's own args, local spec) loads reshard's torch_dist of the all-zero-bias model strictly at tp 2 ep 2
    etp 1 (rotary_interleaved, softmax router renormalised over the top k, shared expert, dense first layer) and
    computes transformers' logits within 1e-5."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'reshard[test]')")
    from test_mcore_dist_fixtures import run_harness

    reshard.convert(zero, str(tmp_path / "d"), to="torch_dist", tp=2, ep=2, etp=1)
    torch.save(IDS, tmp_path / "ids.pt")
    harness = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mcore_ernie_harness.py")
    run_harness(harness, "load", "--ids", tmp_path / "ids.pt", "--tp", 2, "--ep", 2, "--etp", 1,
                tmp_path / "d", tmp_path / "out.pt", timeout=300)
    got = torch.load(tmp_path / "out.pt", weights_only=True)["logits"][0]
    err = (got - logits(zero)).abs().max().item()
    assert err <= ATOL, f"megatron-core vs transformers max |logit diff| {err:.3g}"


def test_release_mtp_tensors_are_dropped_with_a_note(ernie, tmp_path, capsys):
    """The releases store MTP tensors under model.mtp_* that transformers ignores: read as absent, with a note."""
    import shutil

    from safetensors.torch import save_file

    src = tmp_path / "release"
    shutil.copytree(ernie, src)
    tensors = hf_state(src)
    tensors["model.mtp_block.0.mlp.up_proj.weight"] = torch.ones(96, 64)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "v", "--to", "vllm", "--tp", "2")
    assert code == 0 and "dropped 1 tensors under 'model.mtp'" in err, err


def test_moe_layer_range_written_back(tmp_path):
    """The HF writer keeps the source's start / end (-1) / interval spelling when it still places the MoE layers,
    and otherwise writes a spelling under which transformers builds them on the same layers."""
    from reshard.core.model_config import ConfigLoss
    from reshard.layouts.ernie_rules import write_sparse_range
    from reshard.mapping import load_shipped

    moe = load_shipped("ernie4_5_moe").moe
    keys = ("moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval")

    def placed(spelling: dict, layers: int) -> tuple[int, ...]:
        config = transformers.Ernie4_5_MoeConfig(**{**DIMS, "num_hidden_layers": layers, **spelling})
        built = transformers.Ernie4_5_MoeForCausalLM(config)
        return tuple(i for i, layer in enumerate(built.model.layers) if hasattr(layer.mlp, "experts"))

    for spelling, layers in (({"moe_layer_start_index": 0, "moe_layer_end_index": -1, "moe_layer_interval": 2}, 4),
                             ({"moe_layer_start_index": 1, "moe_layer_end_index": 4, "moe_layer_interval": 1}, 6)):
        sparse = placed(spelling, layers)
        kept = dict(spelling)
        write_sparse_range(kept, sparse, moe, layers, ConfigLoss("Hugging Face", ()))
        assert kept == spelling
        fresh = {}
        write_sparse_range(fresh, sparse, moe, layers, ConfigLoss("Hugging Face", ()))
        assert set(fresh) == set(keys) and placed(fresh, layers) == sparse, fresh


def test_load_rank_megatron(ernie, zero):
    """``load_rank`` plans as ``convert`` does: refused with the section 17 message for a non-zero bias; with an
    all-zero one, expert rank 1 holds global experts 2-3 and no expert bias."""
    from reshard.errors import PlanError

    with pytest.raises(PlanError, match="^Ernie 4.5 ranks experts by softmax"):
        reshard.load_rank(ernie, "megatron", tp=2, rank=0)
    rank = reshard.load_rank(zero, "megatron", tp=2, ep=2, rank=0, ep_rank=1)
    hf = hf_state(zero)
    assert not any("expert_bias" in k for k in rank)
    assert torch.equal(rank["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"],
                       hf["model.layers.1.mlp.experts.2.down_proj.weight"][:, :16])
