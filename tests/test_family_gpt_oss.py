"""gpt-oss (``GptOssForCausalLM``, mappings/gpt_oss.toml; ../shared/layouts/families-2.md section 2 and the
acceptance checks of section 15): transformers' own tiny model from ``GptOssConfig`` (hf_tiny.py's gpt_oss case: H 64,
nh 4, ng 2, d 16, I 128, E 4, top-2, window 4 on the even layers, yarn RoPE) with seeded noise on every 1-D
parameter, the sinks and every bias (attention, router, experts), and noise on the expert matrices.

- hf -> megatron tp2 ep2 (etp 1) -> torch_dist -> vllm tp2 -> hf: bit-exact, config.json kept, transformers' logits
  of the output equal the source's; Megatron's fc1 = [gate; up] de-interleaved, sinks split by heads, the args.
- vLLM 0.32's per-rank names and shapes at tp2 (section 13 / NOTES.md section 3: 71 keys a rank); w13 and w13_bias
  interleaved within each rank's slice, w2_bias whole on rank 0 and zeros on rank 1 (section 15 row 5).
- the forward verifier's TP 1 logits equal transformers' (and not without sinks, the router bias, the window or
  alpha; a second model with a small swiglu_limit checks the clamp); ``verify --forward`` passes at tp2 against the
  megatron, torch_dist and vllm outputs and names layer 0 for a perturbed layer-0 weight (slow).
- gpt-oss as released: MXFP4 experts (quantised with the probe's method) convert to bf16 HF equal to transformers'
  ``convert_moe_packed_tensors`` bit for bit, with the section-17 info line; a wrong block shape or an unknown
  quant_method is one line, exit 2, nothing written.
- section 17's refusals: one line, exit 2, nothing written.
- inspect, plan, load_rank, live.plan (Megatron -> Megatron and -> vLLM; live transfers: tests/test_live_gpt_oss.py); verify (digest) EQUAL for every output and the MXFP4 release (slow).
- megatron-core 0.16.1 loads reshard's torch_dist strictly (tests/mcore_gpt_oss_harness.py) and computes
  transformers' logits within 1e-5 (slow).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil

import pytest
import torch
from helpers import run_cli
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_mxfp4 import quantize
from vllm_rules import load_rank as load_vllm_rank

import reshard
from reshard.layouts.base import Options
from reshard.verification.forward.decoder import TPGroup, cast_weights, forward
from reshard.verification.forward.sliced_rank import load_rank as load_hf_rank

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")

DIMS = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, tie_word_embeddings=False, intermediate_size=128, num_hidden_layers=4,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=4)
L, E, I, H = 4, 4, 128, 64
ATOL = 1e-5
IDS = torch.tensor([[1, 17, 254, 33, 400, 7, 99, 300, 12, 5, 200, 42, 77, 8, 150, 3]])
KEPT = ("swiglu_alpha", "swiglu_limit", "layer_types", "sliding_window", "rope_parameters", "rms_norm_eps",
        "attention_bias", "num_local_experts", "num_experts_per_tok", "intermediate_size", "head_dim",
        "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "hidden_act")


def save_gpt_oss(folder, **overrides) -> str:
    """transformers' tiny GptOssForCausalLM (fp32) with seeded noise on every 1-D parameter, the sinks and biases
    (hf_tiny.py's ``perturb``) and on the expert matrices, saved by ``save_pretrained``."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**DIMS, **overrides})).float().eval()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith(("sinks", "bias")):
                p.add_(0.1 * torch.randn(p.shape, generator=generator))
            elif ".experts." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(folder)
    return str(folder)


def hf_state(folder) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "model.safetensors"))


def config_of(folder) -> dict:
    return json.load(open(os.path.join(folder, "config.json")))


def logits(folder) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits[0]


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    return save_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "hf")


@pytest.fixture(scope="module")
def chain(oss, tmp_path_factory):
    """hf -> megatron tp2 ep2 etp1 -> torch_dist (tp2 ep2 etp1) -> vllm tp2 -> hf."""
    root = tmp_path_factory.mktemp("gpt_oss_chain")
    out = {k: str(root / k) for k in ("megatron", "torch_dist", "vllm", "hf")}
    reshard.convert(oss, out["megatron"], to="megatron", tp=2, ep=2, etp=1)
    reshard.convert(out["megatron"], out["torch_dist"], to="torch_dist", tp=2, ep=2, etp=1)
    reshard.convert(out["torch_dist"], out["vllm"], to="vllm", tp=2)
    reshard.convert(out["vllm"], out["hf"], to="hf")
    return out


def test_chain_through_megatron_torch_dist_vllm_is_bit_exact(oss, chain):
    source, back = hf_state(oss), hf_state(chain["hf"])
    assert sorted(back) == sorted(source) and len(source) == 71
    assert all(back[k].dtype == source[k].dtype and torch.equal(back[k], source[k]) for k in source)
    ca, cb = config_of(oss), config_of(chain["hf"])
    assert all(cb.get(k) == ca.get(k) for k in KEPT), [(k, ca.get(k), cb.get(k)) for k in KEPT if cb.get(k) != ca.get(k)]
    assert (cb["architectures"], cb["model_type"]) == (["GptOssForCausalLM"], "gpt_oss")
    torch.testing.assert_close(logits(chain["hf"]), logits(oss), rtol=0, atol=0)


def test_megatron_args_and_rank_files(oss, chain):
    """Section 2.3: quick_geglu with offset 1 and the clamp, learnable softmax (sinks), the window on even layers,
    yarn, biases, etp 1; fc1 = [gate; up] de-interleaved from HF's [H, 2I] columns, whole on both TP ranks; the
    sinks split by heads."""
    hf = hf_state(oss)
    h, p = "model.layers.1.", "decoder.layers.1."
    for tp_rank in range(2):
        blob = torch.load(os.path.join(chain["megatron"], "release", f"mp_rank_0{tp_rank}_001", "model_optim_rng.pt"),
                          weights_only=False)
        a, model = vars(blob["args"]), blob["model"]
        assert (a["quick_geglu"], a["swiglu"], a["glu_linear_offset"], a["activation_func_clamp_value"],
                a["softmax_type"], a["window_size"], a["window_attn_skip_freq"], a["add_bias_linear"],
                a["add_qkv_bias"], a["expert_tensor_parallel_size"], a["moe_router_pre_softmax"]) == (
            True, False, 1.0, 7.0, "learnable", (3, 0), 2, True, True, 1, False)
        assert (a["position_embedding_type"], a["yarn_rotary_scaling_factor"], a["yarn_original_max_position_embeddings"],
                a["yarn_correction_range_round_to_int"], a["rotary_base"]) == ("yarn", 32.0, 4096, False, 150000)
        assert torch.equal(model[p + "self_attention.core_attention.softmax_offset"],
                           hf[h + "self_attn.sinks"][2 * tp_rank:2 * tp_rank + 2])
        assert torch.equal(model[p + "mlp.router.bias"], hf[h + "mlp.router.bias"])
        # EP rank 1 holds experts 2-3 as local 0-1
        w, b = hf[h + "mlp.experts.gate_up_proj"][3].T, hf[h + "mlp.experts.gate_up_proj_bias"][3]
        x = p + "mlp.experts.local_experts.1."
        assert torch.equal(model[x + "linear_fc1.weight"], torch.cat([w[0::2], w[1::2]]))
        assert torch.equal(model[x + "linear_fc1.bias"], torch.cat([b[0::2], b[1::2]]))
        assert torch.equal(model[x + "linear_fc2.weight"], hf[h + "mlp.experts.down_proj"][3].T)
        assert torch.equal(model[x + "linear_fc2.bias"], hf[h + "mlp.experts.down_proj_bias"][3])


def observed_vllm_rank() -> dict[str, list[int]]:
    """vLLM 0.32's fresh state-dict keys of this model at tp 2, both ranks (families-2.md section 13, NOTES.md section
    3, gpt_oss (I 128): 71 keys)."""
    keys = {"model.embedding.weight": [256, 64], "model.norm.weight": [64], "lm_head.weight": [256, 64]}
    for i in range(L):
        p = f"model.layers.{i}."
        keys.update({p + "input_layernorm.weight": [64], p + "post_attention_layernorm.weight": [64],
                     p + "attn.sinks": [2], p + "attn.qkv_proj.weight": [64, 64], p + "attn.qkv_proj.bias": [64],
                     p + "attn.o_proj.weight": [64, 32], p + "attn.o_proj.bias": [64],
                     p + "mlp.router.weight": [4, 64], p + "mlp.router.bias": [4],
                     p + "mlp.experts.routed_experts.w13_weight": [4, 128, 64],
                     p + "mlp.experts.routed_experts.w13_bias": [4, 128],
                     p + "mlp.experts.routed_experts.w2_weight": [4, 64, 64],
                     p + "mlp.experts.routed_experts.w2_bias": [4, 64]})
        keys.update({p + f"attn.attn._{s}_scale": [] for s in ("k", "v", "q", "prob")})
    assert len(keys) == 71
    return keys


def test_vllm_rank_names_shapes_and_tensors(oss, chain):
    """Section 15 row 5: vLLM's names and shapes; w13 = the rank's columns [2tI/T, 2(t+1)I/T) of HF's interleaved
    gate_up_proj, transposed (still interleaved); w2_bias whole on rank 0, zeros on rank 1; sinks by heads."""
    expected, hf = observed_vllm_rank(), hf_state(oss)
    h = "model.layers.2."
    for r in range(2):
        tensors, _ = load_vllm_rank(chain["vllm"], r)
        assert {k: list(v.shape) for k, v in tensors.items()} == expected
        cols = slice(r * I, (r + 1) * I)  # 2I/T = I columns at T = 2
        w13 = tensors[h + "mlp.experts.routed_experts.w13_weight"]
        assert torch.equal(w13, hf[h + "mlp.experts.gate_up_proj"][:, :, cols].transpose(1, 2))
        assert torch.equal(tensors[h + "mlp.experts.routed_experts.w13_bias"],
                           hf[h + "mlp.experts.gate_up_proj_bias"][:, cols])
        rows = slice(r * I // 2, (r + 1) * I // 2)
        assert torch.equal(tensors[h + "mlp.experts.routed_experts.w2_weight"],
                           hf[h + "mlp.experts.down_proj"][:, rows, :].transpose(1, 2))
        w2_bias = tensors[h + "mlp.experts.routed_experts.w2_bias"]
        assert torch.equal(w2_bias, hf[h + "mlp.experts.down_proj_bias"] if r == 0 else torch.zeros(E, H))
        assert torch.equal(tensors[h + "attn.sinks"], hf[h + "self_attn.sinks"][2 * r:2 * r + 2])
        assert torch.equal(tensors[h + "attn.o_proj.bias"], hf[h + "self_attn.o_proj.bias"])


def verifier_logits(folder, layer_changes: dict | None = None, loaded=None, **changes) -> torch.Tensor:
    """The forward verifier's TP 1 logits on an HF folder, or on a copy of its ``loaded`` weights (the decoder config,
    or every layer, changed)."""
    weights = copy.deepcopy(loaded) if loaded is not None else \
        cast_weights(load_hf_rank(str(folder), 0, 1, Options()), torch.float32, "cpu")
    weights.config = dataclasses.replace(weights.config, **changes)
    for layer in weights.layers:
        for name, value in (layer_changes or {}).items():
            setattr(layer, name, value(getattr(layer, name)))
    with torch.no_grad():
        return forward(weights, IDS, TPGroup()).logits[0]


def test_forward_verifier_computes_gpt_oss_as_transformers(oss):
    """Sinks, router bias, expert biases, clamped SwiGLU, the window on even layers, yarn: the verifier's TP 1 logits
    equal transformers' (fp32)."""
    assert (verifier_logits(oss) - logits(oss)).abs().max().item() <= ATOL


@pytest.mark.slow
def test_forward_verifier_controls(oss):
    """Without the sinks, the router bias, the window or with another alpha the logits differ: the case exercises
    each."""
    expected = logits(oss)
    loaded = cast_weights(load_hf_rank(oss, 0, 1, Options()), torch.float32, "cpu")
    assert (verifier_logits(oss, loaded=loaded) - expected).abs().max().item() <= ATOL
    controls = [({"sinks": lambda t: torch.full_like(t, -1e4)}, {}),
                ({"router_linear_bias": torch.zeros_like}, {}),
                ({}, {"window_layers": ()}),
                ({}, {"gpt_oss": (("swiglu_alpha", 1.0), ("swiglu_limit", 7.0))})]
    for layer_changes, changes in controls:
        err = (verifier_logits(oss, layer_changes, loaded, **changes) - expected).abs().max().item()
        assert err > 1e-3, f"the decoder without {layer_changes or changes} also matches: the case tests nothing"


def test_forward_verifier_clamps_as_transformers(tmp_path):
    """swiglu_limit 0.05 (the release's 7 never binds at this scale): equal to transformers, and not unclamped."""
    src = save_gpt_oss(tmp_path / "clamped", swiglu_limit=0.05, num_hidden_layers=2)
    expected = logits(src)
    loaded = cast_weights(load_hf_rank(src, 0, 1, Options()), torch.float32, "cpu")
    assert (verifier_logits(src, loaded=loaded) - expected).abs().max().item() <= ATOL
    loose = verifier_logits(src, loaded=loaded, gpt_oss=(("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)))
    assert (loose - expected).abs().max().item() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name", ["megatron", "torch_dist", "vllm", "hf"])
def test_verify_forward_at_tp2(oss, chain, name, capsys):
    code, text, err = run_cli(capsys, "verify", oss, chain[name], "--forward", "--nproc", 2)
    assert code == 0 and "FORWARD EQUAL" in text, text + err


@pytest.mark.slow
def test_verify_digest(oss, chain, release, tmp_path, capsys):
    for name in ("megatron", "torch_dist", "vllm", "hf"):
        code, text, err = run_cli(capsys, "verify", oss, chain[name])
        assert code == 0 and "EQUAL" in text, name + text + err
    code, _, err = run_cli(capsys, "convert", release, tmp_path / "bf16", "--to", "vllm", "--tp", 2)
    assert code == 0, err
    code, text, err = run_cli(capsys, "verify", release, tmp_path / "bf16")
    assert code == 0 and "EQUAL" in text, text + err


@pytest.mark.slow
@pytest.mark.parametrize("tensor", ["mlp.experts.routed_experts.w13_bias", "attn.sinks"])
def test_verify_forward_names_a_perturbed_layer0_weight(oss, chain, tmp_path, capsys, tensor):
    bad = tmp_path / "bad"
    shutil.copytree(chain["vllm"], bad)
    path = bad / "model-rank-1-part-0.safetensors"
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    tensors[f"model.layers.0.{tensor}"][1] += 1.0
    save_file(tensors, str(path), metadata=metadata)
    code, text, err = run_cli(capsys, "verify", oss, bad, "--forward", "--nproc", 2)
    assert code == 1 and "layer 0" in text, text + err


def released(src, dst, quant: dict | None = None) -> str:
    """``src`` as gpt-oss is released: the expert matrices MXFP4 (<name>_blocks / _scales, quantised with the
    probe's rule), everything else bf16, ``quantization_config`` mxfp4."""
    shutil.copytree(src, dst)
    state = hf_state(src)
    out = {}
    for k, v in state.items():
        if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            out[k + "_blocks"], out[k + "_scales"] = quantize(v.transpose(1, 2))
        else:
            out[k] = v.to(torch.bfloat16)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    config = config_of(src)
    config.update(dtype="bfloat16", quantization_config=quant or {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return str(dst)


@pytest.fixture(scope="module")
def release(oss, tmp_path_factory):
    return released(oss, tmp_path_factory.mktemp("gpt_oss_mxfp4") / "release")


def test_mxfp4_release_converts_to_bf16_exactly(release, tmp_path, capsys):
    """Section 15 row 2: every expert equals transformers' convert_moe_packed_tensors (the section 2.2 rule, already
    in HF's [E, in, out] form) bit for bit; the rest unchanged; quantization_config dropped, the info line printed."""
    convert_packed = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors
    src = release
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "bf16", "--to", "hf")
    assert code == 0, err
    assert "writing MXFP4 is not supported; the output is bfloat16 (dequantised exactly)" in err
    packed, out = hf_state(src), hf_state(tmp_path / "bf16")
    experts = [k for k in out if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(experts) == 2 * L and len(out) == 71
    for k in experts:
        want = convert_packed(packed[k + "_blocks"], packed[k + "_scales"], dtype=torch.bfloat16)
        assert out[k].dtype == torch.bfloat16 and torch.equal(out[k].view(torch.int16), want.view(torch.int16)), k
    assert all(torch.equal(out[k], packed[k]) for k in out if k not in experts)
    assert "quantization_config" not in config_of(tmp_path / "bf16")
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "v", "--to", "vllm", "--tp", 2)
    assert code == 0, err
    tensors, _ = load_vllm_rank(tmp_path / "v", 1)
    assert tensors["model.layers.0.mlp.experts.routed_experts.w13_weight"].dtype == torch.bfloat16


def refused(capsys, src, dst, *args) -> str:
    code, out, err = run_cli(capsys, "convert", src, dst, *args)
    assert code == 2 and not os.path.exists(dst), (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_mxfp4_wrong_block_shape_and_unknown_method_are_one_line(release, tmp_path, capsys):
    os.makedirs(tmp_path / "shape")
    shutil.copy(os.path.join(release, "config.json"), tmp_path / "shape")
    state = hf_state(release)
    name = "model.layers.0.mlp.experts.down_proj_blocks"
    state[name] = state[name].reshape(E, H, 8, 8).contiguous()
    save_file(state, str(tmp_path / "shape" / "model.safetensors"), metadata={"format": "pt"})
    assert "not [E, R, C/32, 16]" in refused(capsys, tmp_path / "shape", tmp_path / "out", "--to", "hf")
    other = with_config(release, tmp_path / "other", quantization_config={"quant_method": "bitsandbytes_4bit"})
    assert "bitsandbytes_4bit" in refused(capsys, other, tmp_path / "out2", "--to", "hf")


def with_config(oss, dst, **changes) -> str:
    os.makedirs(dst)
    os.symlink(os.path.join(oss, "model.safetensors"), os.path.join(dst, "model.safetensors"))
    config = {**config_of(oss), **changes}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return str(dst)


def test_section17_refusals(oss, tmp_path, capsys):
    alpha = with_config(oss, tmp_path / "alpha", swiglu_alpha=1.5)
    for to in (("megatron", "--tp", 2, "--etp", 1), ("vllm", "--tp", 2)):
        assert refused(capsys, alpha, tmp_path / f"a_{to[0]}", "--to", *to) == (
            "error: megatron-core's quick_gelu and vLLM's swigluoai fix alpha = 1.702; this checkpoint uses 1.5.")
    cases = {"swiglu_limit": (dict(swiglu_limit=5.0), "swiglu_limit = 7.0 for gpt-oss (5.0 here)"),
             "eps": (dict(rms_norm_eps=1e-6), "rms_norm_eps = 1e-05 for gpt-oss (1e-06 here)"),
             "types": (dict(layer_types=["full_attention", "sliding_attention"] * 2), "layer_types alternating")}
    for name, (changes, said) in cases.items():
        line = refused(capsys, with_config(oss, tmp_path / name, **changes), tmp_path / f"{name}_v", "--to", "vllm",
                       "--tp", 2)
        assert line.startswith("error: vLLM 0.32 hard-codes") and said in line, line
    line = refused(capsys, oss, tmp_path / "etp", "--to", "megatron", "--tp", 2, "--etp", 2)  # default: 1
    assert "megatron-core requires expert_tensor_parallel_size = 1 for MoE biases (gpt-oss experts have biases)" \
        in line and "--etp 1" in line, line
    # the same settings stay convertible where they are expressible: HF keeps them, Megatron keeps the limit
    code, _, err = run_cli(capsys, "convert", with_config(oss, tmp_path / "lim", swiglu_limit=5.0), tmp_path / "m",
                           "--to", "megatron", "--etp", 1)
    assert code == 0, err


def test_inspect_plan_load_rank_live_plan(oss, capsys):
    code, out, err = run_cli(capsys, "inspect", oss, "--json")
    assert code == 0, err
    assert json.loads(out)["architecture"] == "GptOssForCausalLM"
    code, out, err = run_cli(capsys, "plan", oss, "--to", "vllm", "--tp", 2, "--json")
    assert code == 0 and json.loads(out), err
    hf = hf_state(oss)
    h = "model.layers.1."
    rank = reshard.load_rank(oss, "vllm", tp=2, rank=1)
    w13 = rank[h + "mlp.experts.routed_experts.w13_weight"]
    assert torch.equal(w13, hf[h + "mlp.experts.gate_up_proj"][:, :, I:].transpose(1, 2))
    assert torch.equal(rank[h + "mlp.experts.routed_experts.w2_bias"], torch.zeros(E, H))
    rank = reshard.load_rank(oss, "megatron", tp=2, ep=2, etp=1, rank=1, ep_rank=1)
    w = hf[h + "mlp.experts.gate_up_proj"][2].T
    assert torch.equal(rank["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"],
                       torch.cat([w[0::2], w[1::2]]))
    from reshard import live

    plan = live.plan(oss, source={"layout": "megatron", "tp": 2, "ep": 2, "etp": 1},
                     target={"layout": "megatron", "tp": 1, "ep": 2, "etp": 1}, source_ranks=range(4),
                     target_ranks=range(4, 6))
    assert plan is not None and plan.targets
    plan = live.plan(oss, source={"layout": "megatron", "tp": 2, "ep": 2, "etp": 1}, target={"layout": "vllm", "tp": 2},
                     source_ranks=range(4), target_ranks=range(4, 6))  # placed live: tests/test_live_gpt_oss.py
    assert any(t.pair_interleaved for t in plan.targets[0])


@pytest.mark.slow
def test_megatron_core_loads_and_matches(oss, tmp_path):
    """Section 15 check 3: megatron-core 0.16.1 (tests/mcore_gpt_oss_harness.py: GPTModel from the checkpoint's own
    args, local spec) loads reshard's torch_dist strictly at tp2 ep2 etp1 and computes transformers' logits within
    1e-5 (sinks, biases, clamped quick-GELU experts, the window on even layers, yarn)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'reshard[test]')")
    from test_mcore_dist_fixtures import run_harness

    reshard.convert(oss, str(tmp_path / "d"), to="torch_dist", tp=2, ep=2, etp=1)
    torch.save(IDS, tmp_path / "ids.pt")
    harness = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mcore_gpt_oss_harness.py")
    run_harness(harness, "load", "--ids", tmp_path / "ids.pt", "--tp", 2, "--ep", 2, "--etp", 1,
                tmp_path / "d", tmp_path / "out.pt", timeout=300)
    got = torch.load(tmp_path / "out.pt", weights_only=True)["logits"][0]
    err = (got - logits(oss)).abs().max().item()
    assert err <= ATOL, f"megatron-core vs transformers max |logit diff| {err:.3g}"
