"""Llama 4 text conversions (issue 44 item 5; mappings/llama4.toml; families-2.md sections 3, 13, 15, 17) on the tiny
transformers Llama4ForCausalLM of tests/llama4_cases.py (seeded noise on every 1-D parameter; chunk 8 and
floor_scale 4 acting at 16 tokens):

- hf -> megatron tp2 ep2 (--max-seq 3) -> torch_dist -> vllm tp2 -> hf bit-exact, config.json verbatim, transformers'
  logits equal; Megatron's rank files and args; vLLM 0.32's 49 rank keys and shapes with the q/k rows permuted as
  its permute_qk_weight_for_rotary does;
- the forward verifier's TP 1 logits = transformers' (and not without chunking, temperature, L2 norm or NoPE);
  ``verify --forward`` at tp2 against every output and its failure naming layer 0 on one perturbed weight (slow);
- section 17's refusals (one line, exit 2, nothing written; --max-seq small enough converts);
- inspect / plan / load_rank / live.plan; the multimodal release read as its text model;
- megatron-core 0.16.1 loads reshard's torch_dist strictly and matches transformers within 1e-5 (slow,
  tests/mcore_llama4_harness.py).
The building blocks (rules, permutation, ops): tests/test_llama4_rules.py."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import llama4_cases
from cli_inprocess import run_main
from helpers import run_cli
from llama4_cases import ACTIVE, IDS, SHORT, tiny, transformers

active = llama4_cases.active  # transformers' tiny model (module-scoped fixture)


# The ACTIVE tiny model (chunk 8, floor 4: both act at 16 tokens) converts through Megatron with --max-seq 3 (what
# megatron-core computes the same); the SHORT one (chunk / floor 8192 > max_position_embeddings 256) needs none.

def save_tiny(folder, kw) -> str:
    tiny(kw).save_pretrained(folder)
    return str(folder)


def hf_state(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def config_of(folder) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def hf_logits(folder) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits[0]


def reshard_convert(src, dst, *args) -> str:
    """``reshard convert`` in this process (module fixtures have no capsys): its stderr; a failure raises."""
    done = run_main("convert", src, dst, *args)
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.fixture(scope="module")
def src(active, tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama4") / "hf"
    active.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def chain(src, tmp_path_factory):
    """hf -> megatron tp2 ep2 -> torch_dist tp2 ep2 -> vllm tp2 -> hf (Megatron with --max-seq 3)."""
    root = tmp_path_factory.mktemp("llama4_chain")
    out = {k: str(root / k) for k in ("megatron", "torch_dist", "vllm", "hf")}
    reshard_convert(src, out["megatron"], "--to", "megatron", "--tp", 2, "--ep", 2, "--max-seq", 3)
    reshard_convert(out["megatron"], out["torch_dist"], "--to", "torch_dist", "--tp", 2, "--ep", 2, "--max-seq", 3)
    out["vllm_notes"] = reshard_convert(out["torch_dist"], out["vllm"], "--to", "vllm", "--tp", 2)
    reshard_convert(out["vllm"], out["hf"], "--to", "hf")
    return out


def test_chain_through_megatron_torch_dist_vllm_is_bit_exact(src, chain):
    """Every tensor bit-equal (the fused [E, in, out] experts as released), config.json verbatim (no_rope_layers,
    moe_layers, layer_types, use_qk_norm, chunk, temperature keys, intermediate_size_mlp), transformers' logits
    of the output equal the source's."""
    a, b = hf_state(src), hf_state(chain["hf"])
    assert sorted(a) == sorted(b) and "model.layers.1.feed_forward.experts.gate_up_proj" in b
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    ca, cb = config_of(src), config_of(chain["hf"])
    assert {k: v for k, v in cb.items() if k != "transformers_version"} == \
        {k: v for k, v in ca.items() if k != "transformers_version"}
    torch.testing.assert_close(hf_logits(chain["hf"]), hf_logits(src), rtol=0, atol=0)
    assert "reads Llama 4's attn_temperature_tuning from generation_config.json" in chain["vllm_notes"]


def test_megatron_rank_files(src, chain):
    """Section 3.2: q/k rows unpermuted (rotary_interleaved), MoE layers as a list, routing on the input; rank 1 of
    tp 2 ep 2 holds query group 1 and global experts 2-3 as local 0-1, each fc1 [gate_t; up_t] of gate_up_proj[e].T."""
    blob = torch.load(os.path.join(chain["megatron"], "release", "mp_rank_01_001", "model_optim_rng.pt"),
                      weights_only=False)
    args, model = vars(blob["args"]), blob["model"]
    assert (args["rotary_interleaved"], args["moe_layer_freq"], args["moe_apply_probs_on_input"],
            args["moe_router_score_function"], args["moe_router_topk"], args["ffn_hidden_size"],
            args["moe_ffn_hidden_size"], args["moe_shared_expert_intermediate_size"]) == (
        True, [0, 1, 0, 1], True, "sigmoid", 1, 96, 48, 48)
    assert args["hf_config"]["no_rope_layers"] == [1, 1, 1, 0]
    hf = hf_state(src)
    p, h = "decoder.layers.1.", "model.layers.1."
    q, k, v = (hf[h + f"self_attn.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(model[p + "self_attention.linear_qkv.weight"], torch.cat([q[32:], k[16:], v[16:]]))
    w = hf[h + "feed_forward.experts.gate_up_proj"][3].T  # [2I, H]: gate rows 0..47, up rows 48..95
    assert torch.equal(model[p + "mlp.experts.local_experts.1.linear_fc1.weight"], torch.cat([w[24:48], w[72:]]))
    assert torch.equal(model[p + "mlp.router.weight"], hf[h + "feed_forward.router.weight"])


def observed_vllm_rank() -> dict[str, list[int]]:
    """vLLM 0.32's fresh state-dict keys of this model per rank at tp 2 (families-2.md section 13 and
    probes/families-2/NOTES.md section 3, llama4: 49 keys, both ranks the same shapes)."""
    keys = {"model.embed_tokens.weight": [256, 64], "model.norm.weight": [64], "lm_head.weight": [256, 64]}
    for i in range(4):
        p = f"model.layers.{i}."
        keys.update({p + "input_layernorm.weight": [64], p + "post_attention_layernorm.weight": [64],
                     p + "self_attn.qkv_proj.weight": [64, 64], p + "self_attn.o_proj.weight": [64, 32]})
        keys.update({p + f"self_attn.attn._{s}_scale": [] for s in ("k", "v", "q", "prob")})
        f = p + "feed_forward."
        if i % 2 == 0:
            keys.update({f + "gate_up_proj.weight": [96, 64], f + "down_proj.weight": [64, 48]})
        else:
            keys.update({f + "router.weight": [4, 64], f + "experts.routed_experts.w13_weight": [4, 48, 64],
                         f + "experts.routed_experts.w2_weight": [4, 64, 24],
                         f + "experts._shared_experts._layer.gate_up_proj.weight": [48, 64],
                         f + "experts._shared_experts._layer.down_proj.weight": [64, 24]})
    assert len(keys) == 49
    return keys


def test_vllm_ranks_are_vllms_with_qk_rows_permuted(src, chain):
    """Names and shapes = vLLM's own at tp 2; each rank's qkv_proj = [q_r; k_r; v_r] with q and k rows permuted
    per head as vLLM's permute_qk_weight_for_rotary does (``view(n, d/2, 2, in).transpose(1, 2)``, written here
    from its expression), v unpermuted; w13 per expert [gate_r; up_r] of the fused gate_up_proj."""
    from vllm_rules import load_rank as load_vllm_rank

    def vllm_permute(w, n):  # vllm/model_executor/models/llama4.py permute_qk_weight_for_rotary
        return w.view(n, 16 // 2, 2, 64).transpose(1, 2).reshape(n * 16, 64)

    hf = hf_state(src)
    for r in range(2):
        tensors, _ = load_vllm_rank(chain["vllm"], r)
        assert {k: list(t.shape) for k, t in tensors.items()} == observed_vllm_rank()
        for i in range(4):
            h = f"model.layers.{i}.self_attn."
            q, k = vllm_permute(hf[h + "q_proj.weight"], 4), vllm_permute(hf[h + "k_proj.weight"], 2)
            expected = torch.cat([q[32 * r:32 * (r + 1)], k[16 * r:16 * (r + 1)], hf[h + "v_proj.weight"][16 * r:]
                                  [:16]])
            assert torch.equal(tensors[h + "qkv_proj.weight"], expected), (r, i)
        f = "model.layers.3.feed_forward."
        w = hf[f + "experts.gate_up_proj"][2].T
        rows = slice(24 * r, 24 * (r + 1))
        assert torch.equal(tensors[f + "experts.routed_experts.w13_weight"][2], torch.cat([w[:48][rows], w[48:][rows]]))
        assert torch.equal(tensors[f + "router.weight"], hf[f + "router.weight"])


def verifier_logits(weights, **changes) -> torch.Tensor:
    """The forward verifier's TP 1 logits from ``weights`` (an HF folder's rank, read once) with its Llama 4
    rules changed by ``changes``."""
    import dataclasses

    from reshard.verification.forward.decoder import TPGroup, forward

    config = weights.config
    weights.config = dataclasses.replace(config, llama4=tuple(sorted({**dict(config.llama4), **changes}.items())))
    try:
        with torch.no_grad():
            return forward(weights, IDS, TPGroup()).logits[0]
    finally:
        weights.config = config


def test_forward_verifier_computes_llama4_as_transformers(src, active):
    """NoPE layer 3, L2 q/k norm, chunk 8 and temperature tuning (floor 4) all acting at 16 tokens, on-input top-1
    routing: the verifier's TP 1 logits equal transformers'; without the chunk or the temperature they do not."""
    from reshard.layouts.base import Options
    from reshard.verification.forward.decoder import cast_weights
    from reshard.verification.forward.sliced_rank import load_rank as load_hf_rank

    weights = cast_weights(load_hf_rank(src, 0, 1, Options()), torch.float32, "cpu")
    with torch.no_grad():
        expected = active(input_ids=IDS, use_cache=False).logits[0]  # transformers' own model, saved as src
    assert (verifier_logits(weights) - expected).abs().max().item() <= 1e-5
    for control in (dict(chunk=None), dict(temperature=False), dict(qk_l2_norm=False), dict(nope_layers=())):
        err = (verifier_logits(weights, **control) - expected).abs().max().item()
        assert err > 1e-4, f"the verifier without {control} also matches: the case tests nothing"


@pytest.mark.slow
def test_verify_digest(src, chain, capsys):
    for name in ("megatron", "torch_dist", "vllm", "hf"):
        code, text, err = run_cli(capsys, "verify", src, chain[name])
        assert code == 0 and "EQUAL" in text, name + text + err


@pytest.mark.slow
@pytest.mark.parametrize("name", ["megatron", "torch_dist", "vllm"])
def test_verify_forward_at_tp2(src, chain, name):
    from reshard.verification.forward import verify_forward

    r = verify_forward(src, chain[name], nproc=2)
    assert (r["b"]["tp"], r["ok"]) == (2, True), r["problems"]
    assert r["max_abs"] <= 1e-5 and r["argmax_agreement"] == 1.0 and r["first_divergence"] is None


@pytest.mark.slow
def test_verify_forward_names_a_perturbed_layer0_weight(src, chain, tmp_path):
    """Rank 1's layer-0 qkv_proj k row 3 of its permuted head scaled in a vLLM copy: verify --forward fails at
    layer 0 (the un-permuting read sees the change)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from reshard.verification.forward import verify_forward

    bad = tmp_path / "bad"
    shutil.copytree(chain["vllm"], bad)
    path = bad / "model-rank-1-part-0.safetensors"
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    tensors["model.layers.0.self_attn.qkv_proj.weight"][35] *= 3.0
    save_file(tensors, str(path), metadata=metadata)
    r = verify_forward(src, str(bad), nproc=2)
    assert not r["ok"] and r["first_divergence"].startswith("layer 0"), r["first_divergence"]


# ---- section 17 refusals through the command line -----------------------------------------------------------------

def test_refusals_one_line_exit_2_nothing_written(src, tmp_path, capsys):
    for to in ("megatron", "torch_dist"):
        code, _, err = run_cli(capsys, "convert", src, tmp_path / to, "--to", to, "--tp", 2)
        assert code == 2 and err.strip().count("\n") == 0, err
        assert "Llama 4 uses chunked attention (chunk 8) and attention temperature tuning (floor 4)" in err
        assert "Pass --max-seq 3 to accept that." in err and not (tmp_path / to).exists()
        code, _, err = run_cli(capsys, "convert", src, tmp_path / to, "--to", to, "--tp", 2, "--max-seq", 4)
        assert code == 2 and not (tmp_path / to).exists(), err
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "v", "--to", "vllm", "--tp", 2, "--max-seq", 3)
    assert code == 2 and "--max-seq does not apply to --to vllm" in err and not (tmp_path / "v").exists(), err
    odd = save_tiny(tmp_path / "odd", dict(ACTIVE, moe_layers=[0, 3]))  # vLLM 0.32 would use layers 1 and 3
    code, _, err = run_cli(capsys, "convert", odd, tmp_path / "v", "--to", "vllm", "--tp", 2)
    assert code == 2 and not (tmp_path / "v").exists()
    assert err.strip().endswith("vLLM 0.32 places Llama 4 MoE layers by interleave_moe_layer_step only and ignores "
                                "moe_layers=[0, 3]."), err


def test_short_chunk_and_floor_convert_to_megatron_without_max_seq(tmp_path, capsys):
    """Chunk and floor_scale 8192 above max_position_embeddings 256: nothing to refuse."""
    short = save_tiny(tmp_path / "short", SHORT)
    code, _, err = run_cli(capsys, "convert", short, tmp_path / "m", "--to", "megatron", "--tp", 2)
    assert code == 0, err


def test_inspect_plan_load_rank_live_plan(src, capsys):
    import reshard
    from reshard import live

    code, out, err = run_cli(capsys, "inspect", src, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["architecture"] == "Llama4ForCausalLM"
    assert report["model_config"]["llama4"]["nope_layers"] == [3]
    code, out, err = run_cli(capsys, "plan", src, "--to", "vllm", "--tp", 2, "--json")
    assert code == 0 and any(n.startswith("q and k rows permuted per head") for n in json.loads(out)["notes"]), err
    hf = hf_state(src)
    rank = reshard.load_rank(src, "vllm", tp=2, rank=1)
    o = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(rank[o], hf[o][:, 32:])
    k = hf["model.layers.1.self_attn.k_proj.weight"][16:].view(1, 8, 2, 64).transpose(1, 2).reshape(16, 64)
    assert torch.equal(rank["model.layers.1.self_attn.qkv_proj.weight"][32:48], k)
    rank = reshard.load_rank(src, "megatron", tp=2, ep=2, rank=0, ep_rank=1, max_seq=3)
    assert torch.equal(rank["decoder.layers.3.mlp.experts.local_experts.0.linear_fc2.weight"],
                       hf["model.layers.3.feed_forward.experts.down_proj"][2].T[:, :24])
    plan = live.plan(src, source={"layout": "hf"}, target={"layout": "vllm", "tp": 2}, source_ranks=range(1),
                     target_ranks=range(1, 3))
    assert plan is not None


@pytest.mark.slow
@pytest.mark.parametrize("grid", [(1, 1, 1), (2, 2, 1)], ids=["tp1", "tp2_ep2_etp1"])
def test_megatron_core_loads_and_matches(tmp_path, grid):
    """Section 15 check 3: megatron-core 0.16.1 (tests/mcore_llama4_harness.py: its GPTModel built from the
    checkpoint's own args, local spec, L2Norm q/k norms on the RoPE layers) loads reshard's torch_dist strictly and
    computes transformers' logits within 1e-5 when chunk and floor_scale (8192) exceed the 16 tokens."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'reshard[test]')")
    import reshard
    from test_mcore_dist_fixtures import run_harness

    tp, ep, etp = grid
    short = save_tiny(tmp_path / "short", SHORT)
    reshard.convert(short, str(tmp_path / "d"), to="torch_dist", tp=tp, ep=ep, etp=etp)
    torch.save(IDS, tmp_path / "ids.pt")
    harness = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mcore_llama4_harness.py")
    run_harness(harness, "load", "--ids", tmp_path / "ids.pt", "--tp", tp, "--ep", ep, "--etp", etp,
                tmp_path / "d", tmp_path / "out.pt", timeout=300)
    got = torch.load(tmp_path / "out.pt", weights_only=True)["logits"][0]
    err = (got - hf_logits(short)).abs().max().item()
    assert err <= 1e-5, f"megatron-core vs transformers max |logit diff| {err:.3g}"


def test_multimodal_release_converts_its_text_model(tmp_path, capsys):
    """A tiny Llama4ForConditionalGeneration (transformers' own save: language_model.*, vision_model.*,
    multi_modal_projector.*): to hf and to vllm tp2 as its text model with a note naming the vision tensors left
    out; the text tensors bit-equal, and the output's transformers logits equal the multimodal model's on text."""
    torch.manual_seed(0)
    vision = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
              "image_size": 28, "patch_size": 14, "vision_output_dim": 64, "projector_input_dim": 64,
              "projector_output_dim": 64, "pixel_shuffle_ratio": 0.5}
    text = {k: v for k, v in ACTIVE.items() if k != "tie_word_embeddings"}
    model = transformers.Llama4ForConditionalGeneration(
        transformers.Llama4Config(text_config=text, vision_config=vision)).eval()
    model.save_pretrained(tmp_path / "vlm")
    code, _, err = run_cli(capsys, "convert", tmp_path / "vlm", tmp_path / "hf", "--to", "hf")
    assert code == 0 and "its 26 vision tensors (vision_model.*, multi_modal_projector.*) are not converted" in err
    code, _, err = run_cli(capsys, "convert", tmp_path / "vlm", tmp_path / "v", "--to", "vllm", "--tp", 2)
    assert code == 0, err
    a, b = hf_state(tmp_path / "vlm"), hf_state(tmp_path / "hf")
    assert sorted(b) == sorted(k.replace("language_model.", "", 1) for k in a if k.startswith("language_model."))
    assert all(torch.equal(b[k], a["language_model." + k]) for k in b)
    assert config_of(tmp_path / "hf")["architectures"] == ["Llama4ForCausalLM"]
    with torch.no_grad():
        expected = model(input_ids=IDS).logits[0]
    torch.testing.assert_close(hf_logits(tmp_path / "hf"), expected, rtol=0, atol=0)
