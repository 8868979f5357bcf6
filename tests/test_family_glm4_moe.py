"""GLM-4.5 / GLM-4.6 (``Glm4MoeForCausalLM``, mappings/glm4_moe.toml; ../shared/layouts/families-2.md section 5 and
the acceptance checks of section 15): a tiny model built by transformers from ``Glm4MoeConfig`` (partial rotary 0.5,
q/k/v biases, q/k norms, a dense first layer, sigmoid routing with a selection bias, a shared expert,
``routed_scaling_factor``) with seeded noise on every 1-D parameter and buffer (norms, biases,
``e_score_correction_bias``) and an MTP layer as the release stores it (``model.layers.{L}.*``).

- hf -> megatron tp2 ep2 -> torch_dist -> vllm tp2 -> hf: the main model bit-exact, config keys kept, MTP dropped
  with a note at vLLM (its main model has none); hf -> megatron -> torch_dist -> hf keeps the MTP layer bit-exact;
  transformers' logits of the output equal the source's.
- ``verify`` (digest) EQUAL; the forward verifier's TP 1 logits equal transformers' (and not without partial rotary,
  q/k norm or the routing scale: the case exercises them); ``verify --forward`` equal at tp2 for megatron and vllm,
  and a perturbed layer-0 weight fails naming layer 0.
- vLLM 0.32's per-rank names and shapes at tp2 (section 13, observed with vLLM's own dummy load: 50 keys per rank,
  the router under ``mlp.gate``, the selection bias under ``mlp.experts.routed_experts``).
- GLM-4.5's released spelling (transformers 4: top-level ``partial_rotary_factor`` / ``rope_theta``, ``use_qk_norm``
  false, no norms) converts both ways with ``qk_layernorm`` off in Megatron.

- ``inspect``, ``plan``, ``load_rank`` (vllm and megatron ep ranks, the MTP layer's experts) and ``live.plan``.
- megatron-core 0.16.1 loads reshard's torch_dist strictly (tp2 ep2 etp1; tp2 etp2 is slow) and computes
  transformers' logits within 1e-5.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from deepseek_checkpoints import add_mtp_layer
from helpers import run_cli
from safetensors.torch import load_file, save_file
from vllm_rules import load_rank as load_vllm_rank

import reshard
from reshard.layouts.base import Options
from reshard.verification.forward import verify_forward
from reshard.verification.forward.decoder import TPGroup, cast_weights, forward
from reshard.verification.forward.sliced_rank import load_rank as load_hf_rank

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")

#: hf_tiny.py's glm4_moe case (families-2 probes): V 512, H 64, nh 4, ng 2, d 16, 3 layers (layer 0 dense).
DIMS = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, tie_word_embeddings=False, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
            topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, use_qk_norm=True,
            attention_bias=True, num_nextn_predict_layers=1)
L = DIMS["num_hidden_layers"]
ATOL = 1e-5
IDS = torch.tensor([[1, 17, 254, 33, 400, 7, 99, 300, 12, 5, 200, 42, 77, 8, 150, 3]])
#: config.json keys that carry GLM's meaning (routing, attention, MTP): each must survive every conversion.
KEPT = ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace",
        "num_experts_per_tok", "n_shared_experts", "n_routed_experts", "moe_intermediate_size", "intermediate_size",
        "use_qk_norm", "attention_bias", "head_dim", "rope_parameters", "rms_norm_eps", "hidden_act",
        "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")


def save_glm(folder, mtp: bool = True, **overrides) -> str:
    """transformers' own tiny Glm4MoeForCausalLM (fp32), seeded noise on every 1-D parameter and buffer (as
    hf_tiny.py's ``perturb``), saved by ``save_pretrained``; ``mtp``: an MTP layer appended as released."""
    torch.manual_seed(0)
    model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**{**DIMS, **overrides})).float().eval()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if p.is_floating_point() and "inv_freq" not in name and p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    model.save_pretrained(folder)
    if mtp:
        add_mtp_layer(str(folder), seed=1, fill="random")
    return str(folder)


def hf_state(folder) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "model.safetensors"))


def config_of(folder) -> dict:
    return json.load(open(os.path.join(folder, "config.json")))


def logits(folder) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits[0]


def convert(capsys, src, dst, *args) -> str:
    code, _, err = run_cli(capsys, "convert", src, dst, *args)
    assert code == 0, err
    return err


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return save_glm(tmp_path_factory.mktemp("glm4_moe") / "hf")


@pytest.fixture(scope="module")
def chain(glm, tmp_path_factory):
    """hf -> megatron tp2 ep2 -> torch_dist -> vllm tp2 -> hf, and torch_dist -> hf (MTP kept)."""
    root = tmp_path_factory.mktemp("glm4_moe_chain")
    out = {k: str(root / k) for k in ("megatron", "torch_dist", "vllm", "hf", "hf_mtp")}
    notes = {}
    notes["megatron"] = reshard_convert(glm, out["megatron"], "--to", "megatron", "--tp", "2", "--ep", "2")
    notes["torch_dist"] = reshard_convert(out["megatron"], out["torch_dist"], "--to", "torch_dist", "--tp", "2",
                                          "--ep", "2")
    notes["vllm"] = reshard_convert(out["torch_dist"], out["vllm"], "--to", "vllm", "--tp", "2")
    notes["hf"] = reshard_convert(out["vllm"], out["hf"], "--to", "hf")
    notes["hf_mtp"] = reshard_convert(out["torch_dist"], out["hf_mtp"], "--to", "hf")
    return out, notes


def reshard_convert(src, dst, *args) -> str:
    """``reshard convert`` in this process (module fixtures have no capsys): its stderr."""
    import contextlib
    import io
    import sys

    from reshard import cli

    err, argv = io.StringIO(), sys.argv
    sys.argv = ["reshard", "convert", str(src), str(dst), *map(str, args)]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                cli.main()
            except SystemExit as exc:
                assert not exc.code, err.getvalue()
    finally:
        sys.argv = argv
    return err.getvalue()


def test_chain_through_megatron_torch_dist_vllm_is_bit_exact(glm, chain):
    out, notes = chain
    source, back = hf_state(glm), hf_state(out["hf"])
    main = {k: v for k, v in source.items() if not k.startswith(f"model.layers.{L}.")}
    assert len(main) < len(source)  # the source has its MTP layer
    assert sorted(back) == sorted(main)
    assert all(back[k].dtype == main[k].dtype and torch.equal(back[k], main[k]) for k in main)
    assert "dropped 1 MTP" in notes["vllm"]
    ca, cb = config_of(glm), config_of(out["hf"])
    assert all(cb.get(k) == ca.get(k) for k in KEPT), [(k, ca.get(k), cb.get(k)) for k in KEPT
                                                        if cb.get(k) != ca.get(k)]
    assert (cb["architectures"], cb["model_type"], cb["num_nextn_predict_layers"]) == (
        ["Glm4MoeForCausalLM"], "glm4_moe", 0)
    with_mtp = hf_state(out["hf_mtp"])
    assert sorted(with_mtp) == sorted(source)
    assert all(torch.equal(with_mtp[k], source[k]) for k in source)
    assert config_of(out["hf_mtp"])["num_nextn_predict_layers"] == 1
    torch.testing.assert_close(logits(out["hf"]), logits(glm), rtol=0, atol=0)


def test_megatron_args_and_rank_files(glm, chain):
    """Section 5.2: add_qkv_bias, qk_layernorm, rotary_percent 0.5, kv_channels = head_dim, DeepSeek's routing
    fields, moe_layer_freq as a list, the MTP layer; q/k norms and the router bias (fp32) whole on every rank."""
    out, _ = chain
    blob = torch.load(os.path.join(out["megatron"], "release", "mp_rank_01_001", "model_optim_rng.pt"),
                      weights_only=False)
    a, model = vars(blob["args"]), blob["model"]
    assert (a["add_qkv_bias"], a["add_bias_linear"], a["qk_layernorm"], a["rotary_percent"], a["kv_channels"]) == (
        True, False, True, 0.5, 16)
    assert (a["moe_router_score_function"], a["moe_router_enable_expert_bias"], a["moe_router_topk_scaling_factor"],
            a["moe_layer_freq"], a["moe_shared_expert_intermediate_size"], a["mtp_num_layers"]) == (
        "sigmoid", True, 2.5, [0, 1, 1], 32, 1)
    hf = hf_state(glm)
    p, h = "decoder.layers.1.", "model.layers.1."
    assert torch.equal(model[p + "self_attention.q_layernorm.weight"], hf[h + "self_attn.q_norm.weight"])
    bias = model[p + "mlp.router.expert_bias"]
    assert bias.dtype == torch.float32 and torch.equal(bias, hf[h + "mlp.gate.e_score_correction_bias"])
    # rank 1 of tp 2: query group 1 = q heads 2-3, k / v head 1, in Megatron's group-major [q; q; k; v] order
    q, k, v = (hf[h + f"self_attn.{x}_proj.bias"] for x in "qkv")
    assert torch.equal(model[p + "self_attention.linear_qkv.bias"], torch.cat([q[32:], k[16:], v[16:]]))
    # expert rank 1 holds global experts 4-7 as local 0-3; expert fc1 per tp rank [gate_t; up_t]
    gate, up = hf[h + "mlp.experts.5.gate_proj.weight"], hf[h + "mlp.experts.5.up_proj.weight"]
    assert torch.equal(model[p + "mlp.experts.local_experts.1.linear_fc1.weight"], torch.cat([gate[16:], up[16:]]))
    m = f"model.layers.{L}."
    assert torch.equal(model["mtp.layers.0.transformer_layer.self_attention.k_layernorm.weight"],
                       hf[m + "self_attn.k_norm.weight"])


def test_verify_digest(glm, chain, capsys):
    out, _ = chain
    for name in ("megatron", "torch_dist", "hf_mtp"):
        code, text, err = run_cli(capsys, "verify", glm, out[name])
        assert code == 0 and "EQUAL" in text, name + text + err
    code, text, _ = run_cli(capsys, "verify", glm, out["vllm"])
    assert code == 1 and "mtp_layers" in text, text
    code, text, err = run_cli(capsys, "verify", glm, out["vllm"], "--drop-mtp")
    assert code == 0 and "EQUAL" in text, text + err


def verifier_logits(folder, **changes) -> torch.Tensor:
    """The forward verifier's TP 1 logits on an HF folder (its decoder config changed by ``changes``)."""
    weights = cast_weights(load_hf_rank(str(folder), 0, 1, Options()), torch.float32, "cpu")
    weights.config = dataclasses.replace(weights.config, **changes)
    if changes.get("qk_norm") is False:
        weights.layers = [dataclasses.replace(layer, q_norm=None, k_norm=None) for layer in weights.layers]
    with torch.no_grad():
        return forward(weights, IDS, TPGroup()).logits[0]


def test_forward_verifier_computes_glm_as_transformers(glm):
    """Partial rotary, q/k norms, q/k/v biases and DeepSeek routing (selection bias, scaling) together: the
    verifier's logits equal transformers' (fp32); without each feature they do not."""
    expected = logits(glm)
    assert (verifier_logits(glm) - expected).abs().max().item() <= ATOL
    for control in (dict(rotary_fraction=1.0), dict(qk_norm=False), dict(router_scaling=1.0)):
        err = (verifier_logits(glm, **control) - expected).abs().max().item()
        assert err > 1e-3, f"the decoder without {control} also matches: the case tests nothing"


@pytest.mark.parametrize("name", ["megatron", "vllm"])
def test_verify_forward_at_tp2(glm, chain, name):
    out, _ = chain
    r = verify_forward(glm, out[name], nproc=2)
    assert (r["b"]["layout"], r["b"]["tp"]) == (name, 2)
    assert r["ok"], r["problems"]
    assert r["max_abs"] <= ATOL and r["argmax_agreement"] == 1.0 and r["first_divergence"] is None


def test_verify_forward_names_a_perturbed_layer0_weight(glm, chain, tmp_path):
    """Rank 1's layer-0 k_norm (a q/k-norm weight, applied before the partial rotation) scaled in a vLLM copy."""
    v = tmp_path / "v"
    os.symlink(chain[0]["vllm"], tmp_path / "orig")
    os.makedirs(v)
    for f in os.listdir(tmp_path / "orig"):
        if not f.startswith("model-rank-1"):
            os.symlink(tmp_path / "orig" / f, v / f)
    tensors, metas = load_vllm_rank(tmp_path / "orig", 1)
    tensors["model.layers.0.self_attn.k_norm.weight"][3] *= 1.5
    save_file(tensors, str(v / "model-rank-1-part-0.safetensors"), metadata=metas[0])
    r = verify_forward(glm, str(v), nproc=2)
    assert not r["ok"] and r["first_divergence"].startswith("layer 0"), r["first_divergence"]


def observed_vllm_rank() -> dict[str, list[int]]:
    """vLLM 0.32's fresh state-dict keys of this model on each rank at tp 2 (families-2.md section 13 and
    probes/families-2/NOTES.md section 3, glm4_moe: 50 keys, both ranks the same shapes)."""
    keys = {"model.embed_tokens.weight": [256, 64], "model.norm.weight": [64], "lm_head.weight": [256, 64]}
    for i in range(L):
        p = f"model.layers.{i}."
        keys.update({p + "input_layernorm.weight": [64], p + "post_attention_layernorm.weight": [64],
                     p + "self_attn.qkv_proj.weight": [64, 64], p + "self_attn.qkv_proj.bias": [64],
                     p + "self_attn.o_proj.weight": [64, 32], p + "self_attn.q_norm.weight": [16],
                     p + "self_attn.k_norm.weight": [16]})
        keys.update({p + f"self_attn.attn._{s}_scale": [] for s in ("k", "v", "q", "prob")})
        if i == 0:
            keys.update({p + "mlp.gate_up_proj.weight": [96, 64], p + "mlp.down_proj.weight": [64, 48]})
        else:
            keys.update({p + "mlp.gate.weight": [8, 64],
                         p + "mlp.experts.routed_experts.e_score_correction_bias": [8],
                         p + "mlp.experts.routed_experts.w13_weight": [8, 32, 64],
                         p + "mlp.experts.routed_experts.w2_weight": [8, 64, 16],
                         p + "mlp.experts._shared_experts._layer.gate_up_proj.weight": [32, 64],
                         p + "mlp.experts._shared_experts._layer.down_proj.weight": [64, 16]})
    assert len(keys) == 50
    return keys


def test_vllm_rank_names_and_shapes_are_vllms(glm, chain):
    out, _ = chain
    expected = observed_vllm_rank()
    hf = hf_state(glm)
    for r in range(2):
        tensors, _ = load_vllm_rank(out["vllm"], r)
        assert {k: list(v.shape) for k, v in tensors.items()} == expected
        p, h = "model.layers.2.", "model.layers.2."
        assert torch.equal(tensors[p + "mlp.experts.routed_experts.e_score_correction_bias"],
                           hf[h + "mlp.gate.e_score_correction_bias"])
        assert torch.equal(tensors[p + "mlp.gate.weight"], hf[h + "mlp.gate.weight"])
        w13 = tensors[p + "mlp.experts.routed_experts.w13_weight"][6]
        rows = slice(16 * r, 16 * (r + 1))
        assert torch.equal(w13, torch.cat([hf[h + "mlp.experts.6.gate_proj.weight"][rows],
                                           hf[h + "mlp.experts.6.up_proj.weight"][rows]]))


def test_vllm_bf16_keeps_the_selection_bias_fp32(glm, tmp_path, capsys):
    convert(capsys, glm, tmp_path / "v", "--to", "vllm", "--tp", "2", "--dtype", "bf16")
    tensors, _ = load_vllm_rank(tmp_path / "v", 0)
    assert tensors["model.layers.1.mlp.experts.routed_experts.e_score_correction_bias"].dtype == torch.float32
    assert tensors["model.layers.1.self_attn.qkv_proj.weight"].dtype == torch.bfloat16


def released_spelling(folder) -> None:
    """GLM-4.5's config.json spelling (transformers 4): top-level rope_theta and partial_rotary_factor."""
    config = config_of(folder)
    params = config.pop("rope_parameters")
    config.update(rope_theta=params["rope_theta"], partial_rotary_factor=params["partial_rotary_factor"])
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def test_glm45_release_shape_without_qk_norm(tmp_path, capsys):
    """GLM-4.5 / 4.6 as released: use_qk_norm false (no q/k norms), attention biases, transformers-4 RoPE keys. To
    Megatron (qk_layernorm off) and back, and to vLLM and back: bit-exact, the spelling kept, logits equal."""
    src = save_glm(tmp_path / "src", mtp=False, use_qk_norm=False, num_nextn_predict_layers=0)
    released_spelling(src)
    assert not any("q_norm" in k for k in hf_state(src))
    convert(capsys, src, tmp_path / "m", "--to", "megatron", "--tp", "2")
    rank_file = tmp_path / "m" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    args = vars(torch.load(rank_file, weights_only=False)["args"])
    assert (args["qk_layernorm"], args["rotary_percent"], args["add_qkv_bias"]) == (False, 0.5, True)
    convert(capsys, tmp_path / "m", tmp_path / "h", "--to", "hf")
    convert(capsys, src, tmp_path / "v", "--to", "vllm", "--tp", "2")
    assert not any("q_norm" in k for k in load_vllm_rank(tmp_path / "v", 0)[0])
    convert(capsys, tmp_path / "v", tmp_path / "h2", "--to", "hf")
    a = hf_state(src)
    for back in ("h", "h2"):
        b = hf_state(tmp_path / back)
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
        c = config_of(tmp_path / back)
        assert (c["use_qk_norm"], c["partial_rotary_factor"], c["rope_theta"]) == (False, 0.5, 10000.0), c
        assert "rope_parameters" not in c
    torch.testing.assert_close(logits(tmp_path / "h"), logits(src), rtol=0, atol=0)
    code, text, err = run_cli(capsys, "verify", src, tmp_path / "m", "--forward")
    assert code == 0 and "FORWARD EQUAL" in text, text + err


def test_inspect_plan_load_rank_live_plan(glm, capsys):
    code, out, err = run_cli(capsys, "inspect", glm, "--json")
    assert code == 0, err
    assert json.loads(out)["architecture"] == "Glm4MoeForCausalLM"
    code, out, err = run_cli(capsys, "plan", glm, "--to", "megatron", "--tp", 2, "--ep", 2, "--json")
    assert code == 0 and json.loads(out), err
    hf = hf_state(glm)
    rank = reshard.load_rank(glm, "vllm", tp=2, rank=1)
    bias = "model.layers.1.mlp.experts.routed_experts.e_score_correction_bias"
    assert rank[bias].dtype == torch.float32
    assert torch.equal(rank[bias], hf["model.layers.1.mlp.gate.e_score_correction_bias"])
    o = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(rank[o], hf[o][:, 32:])
    rank = reshard.load_rank(glm, "megatron", tp=2, ep=2, rank=1, ep_rank=1)
    assert torch.equal(rank["mtp.layers.0.transformer_layer.mlp.experts.local_experts.3.linear_fc2.weight"],
                       hf[f"model.layers.{L}.mlp.experts.7.down_proj.weight"][:, 16:])
    from reshard import live

    plan = live.plan(glm, source={"layout": "megatron", "tp": 2, "ep": 2}, target={"layout": "vllm", "tp": 2},
                     source_ranks=range(4), target_ranks=range(4, 6))
    assert plan is not None


@pytest.mark.parametrize("grid", [(2, 2, 1), pytest.param((2, 1, 2), marks=pytest.mark.slow)],
                         ids=["tp2_ep2_etp1", "tp2_etp2"])
def test_megatron_core_loads_and_matches(glm, tmp_path, grid):
    """Section 15 check 3: megatron-core 0.16.1 (tests/mcore_glm_harness.py: its GPTModel built from the
    checkpoint's own args, local spec) loads reshard's torch_dist strictly at (tp, ep, etp) and computes
    transformers' logits within 1e-5 (partial rotary, q/k norms, qkv bias, sigmoid routing with expert bias,
    shared expert, dense first layer). The MTP layer is dropped: the harness runs the main model."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'reshard[test]')")
    from test_mcore_dist_fixtures import run_harness

    tp, ep, etp = grid
    reshard.convert(glm, str(tmp_path / "d"), to="torch_dist", tp=tp, ep=ep, etp=etp, drop_mtp=True)
    torch.save(IDS, tmp_path / "ids.pt")
    harness = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mcore_glm_harness.py")
    run_harness(harness, "load", "--ids", tmp_path / "ids.pt", "--tp", tp, "--ep", ep, "--etp", etp,
                tmp_path / "d", tmp_path / "out.pt", timeout=300)
    got = torch.load(tmp_path / "out.pt", weights_only=True)["logits"][0]
    err = (got - logits(glm)).abs().max().item()
    assert err <= ATOL, f"megatron-core vs transformers max |logit diff| {err:.3g}"
