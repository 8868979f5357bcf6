"""Llama 4 text building blocks (issue 44 item 5; families-2.md sections 3, 13, 17): the per-layer rules read from
the config (MoE list, NoPE layers, chunked layers), the vLLM q/k row permutation checked against a rule written
from the spec, the section 17 refusals, and the forward verifier's Llama 4 ops (interleaved RoPE, NoPE, L2 q/k
norm, temperature tuning, chunked attention, on-input top-1 sigmoid routing with a shared expert) reproducing
transformers' Llama4ForCausalLM logits at TP 1 and 2 within 1e-5 on the tiny models of probes/families-2/hf_tiny.py
(seeded noise on every 1-D parameter)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import run_cli

from reshard.errors import PlanError
from reshard.layouts import llama4_rules as R
from reshard.verification.forward import llama4_ops as ops

transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[1, 17, 254, 33, 400, 7, 99, 300, 12, 5, 200, 42, 77, 8, 150, 3]])
COMMON = {"vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "max_position_embeddings": 256, "tie_word_embeddings": False, "intermediate_size": 48,
          "intermediate_size_mlp": 96, "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 1,
          "interleave_moe_layer_step": 2, "no_rope_layer_interval": 4, "use_qk_norm": True, "attn_scale": 0.1,
          "attn_temperature_tuning": True}
ACTIVE = dict(COMMON, attention_chunk_size=8, floor_scale=4)         # chunking and temperature act at 16 tokens
SHORT = dict(COMMON, attention_chunk_size=8192, floor_scale=8192)    # what megatron-core computes the same


def tiny(kw):
    torch.manual_seed(0)
    cfg = transformers.Llama4TextConfig(**kw)
    model = transformers.Llama4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


@pytest.fixture(scope="module")
def active():
    return tiny(ACTIVE)


@pytest.fixture(scope="module")
def short():
    return tiny(SHORT)


def config_dict(model) -> dict:
    return model.config.to_dict()


# ---- config rules ---------------------------------------------------------------------------------------------

def test_layer_rules_match_transformers(active):
    c = config_dict(active)
    assert R.moe_layers(c) == (1, 3) == tuple(active.config.moe_layers)
    assert R.rope_layers(c) == (True, True, True, False)
    assert list(R.rope_layers(c)) == [bool(x) for x in active.config.no_rope_layers]
    assert R.chunked_layers(c) == tuple(t == "chunked_attention" for t in active.config.layer_types)
    assert R.megatron_no_rope_freq(c) == [0, 0, 0, 1]
    assert R.megatron_moe_layer_freq(c) == [0, 1, 0, 1]
    kinds = [type(layer.feed_forward).__name__ for layer in active.model.layers]
    assert [k == "Llama4TextMoe" for k in kinds] == [i in R.moe_layers(c) for i in range(4)]
    for i, layer in enumerate(active.model.layers):
        flags = R.layer_flags(c)[i]
        assert hasattr(layer.self_attn, "qk_norm") == flags["qk_norm"]
        assert bool(layer.self_attn.use_rope) == flags["rope"]
    # without the lists: transformers' defaults from the step and interval
    bare = {"num_hidden_layers": 8, "interleave_moe_layer_step": 2, "no_rope_layer_interval": 4}
    assert R.moe_layers(bare) == (1, 3, 5, 7)
    assert R.rope_layers(bare) == (True, True, True, False, True, True, True, False)
    assert R.moe_layers({"num_hidden_layers": 3, "moe_layers": [0, 2]}) == (0, 2)


def test_multimodal_text_config(active):
    text = config_dict(active)
    cfg = transformers.Llama4Config(text_config=text, vision_config={"num_hidden_layers": 1})
    nested = R.text_config(cfg.to_dict())
    assert R.moe_layers(nested) == (1, 3) and R.rope_layers(nested) == (True, True, True, False)
    assert R.text_config(text) is text


@pytest.mark.slow
def test_megatron_config_accepted_by_megatron_core(active):
    """The keywords are section 3.2's table and megatron-core 0.16.1's TransformerConfig validates them."""
    mc = pytest.importorskip("megatron.core.transformer.transformer_config")
    kw, l2 = R.megatron_config(config_dict(active))
    assert kw["no_rope_freq"] == [0, 0, 0, 1] and kw["moe_layer_freq"] == [0, 1, 0, 1]
    assert kw["ffn_hidden_size"] == 96 and kw["moe_ffn_hidden_size"] == kw["moe_shared_expert_intermediate_size"] == 48
    assert kw["rotary_interleaved"] and kw["moe_apply_probs_on_input"] and kw["moe_router_topk"] == 1
    assert l2 == [True, True, True, False]
    cfg = mc.TransformerConfig(**kw, use_cpu_initialization=True)
    assert cfg.moe_layer_freq == [0, 1, 0, 1] and cfg.no_rope_freq == [0, 0, 0, 1]


# ---- section 17 refusals --------------------------------------------------------------------------------------

def test_megatron_refusal(active, short):
    c = config_dict(active)
    assert R.megatron_exact_length(c) == 3  # min(chunk 8, floor 4 - 1)
    with pytest.raises(PlanError) as e:
        R.check_megatron(c, None)  # max_position_embeddings 256
    msg = str(e.value)
    assert "\n" not in msg and e.value.exit_code == 2
    assert msg == ("Llama 4 uses chunked attention (chunk 8) and attention temperature tuning (floor 4); "
                   "megatron-core 0.16.1 has neither, so the converted model matches only on sequences shorter "
                   "than 4 tokens. Pass --max-seq 3 to accept that.")
    with pytest.raises(PlanError):
        R.check_megatron(c, 4)
    R.check_megatron(c, 3)
    R.check_megatron(config_dict(short), None)  # 256 <= min(8192, 8191)
    R.check_megatron({"num_hidden_layers": 2, "no_rope_layers": [1, 1]}, None)  # neither feature


def test_vllm_moe_layers_refusal():
    R.check_vllm({"num_hidden_layers": 4, "interleave_moe_layer_step": 2, "moe_layers": [1, 3]})
    R.check_vllm({"num_hidden_layers": 4, "interleave_moe_layer_step": 2})
    with pytest.raises(PlanError, match=r"ignores moe_layers=\[0, 2\]\.$"):
        R.check_vllm({"num_hidden_layers": 4, "interleave_moe_layer_step": 2, "moe_layers": [0, 2]})


# ---- vLLM q/k permutation ---------------------------------------------------------------------------------------

def test_vllm_qk_permutation_rule(active):
    d = 16
    q = active.model.layers[0].self_attn.q_proj.weight.detach()
    k = active.model.layers[0].self_attn.k_proj.weight.detach()
    for w in (q, k):
        n = w.shape[0] // d
        p = R.vllm_qk_permute(w, d)
        # the spec's rule (section 3.3): in each head, HF row 2i + j is vLLM row j * d/2 + i
        for h in range(n):
            for i in range(d // 2):
                for j in range(2):
                    assert torch.equal(p[h * d + j * d // 2 + i], w[h * d + 2 * i + j])
        # vLLM's own expression (permute_qk_weight_for_rotary): view(n, d/2, 2, in).transpose(1, 2)
        assert torch.equal(p, w.view(n, d // 2, 2, -1).transpose(1, 2).reshape(w.shape))
        assert torch.equal(R.vllm_qk_unpermute(p, d), w)
        # per TP 2 rank: the rank's contiguous heads permuted alike (whole heads per rank)
        half = w.shape[0] // 2
        assert torch.equal(R.vllm_qk_permute(w[:half], d), p[:half])


def test_vllm_permutation_with_neox_rope_equals_interleaved(active):
    """vLLM rotates halves (is_neox_style) on the permuted rows: the attention scores equal HF's interleaved
    rotation on the original rows."""
    d, s = 16, 16
    attn = active.model.layers[0].self_attn
    x = torch.randn(1, s, 64, generator=torch.Generator().manual_seed(3))
    cos, sin = ops.rope_angles(active.model.rotary_emb.inv_freq, s)
    q = F.linear(x, attn.q_proj.weight).view(1, s, -1, d)
    k = F.linear(x, attn.k_proj.weight).view(1, s, -1, d)
    ref_q, ref_k = ops.rope_interleaved(q, cos, sin), ops.rope_interleaved(k, cos, sin)
    pq = F.linear(x, R.vllm_qk_permute(attn.q_proj.weight, d)).view(1, s, -1, d)
    pk = F.linear(x, R.vllm_qk_permute(attn.k_proj.weight, d)).view(1, s, -1, d)

    def neox(t):
        c = torch.cat((cos, cos), -1)[None, :, None, :]
        sn = torch.cat((sin, sin), -1)[None, :, None, :]
        a, b = t.chunk(2, -1)
        return t * c + torch.cat((-b, a), -1) * sn

    scores = torch.einsum("bshd,bthd->bhst", ref_q, ref_k.repeat_interleave(2, 2))
    vllm_scores = torch.einsum("bshd,bthd->bhst", neox(pq), neox(pk).repeat_interleave(2, 2))
    assert (scores - vllm_scores).abs().max() < 1e-5


# ---- forward verifier ops vs transformers -----------------------------------------------------------------------

def reference_forward(model, ids, tp: int = 1, megatron: bool = False) -> torch.Tensor:
    """Llama 4 text logits from the state dict alone with llama4_ops, the heads / FFN columns / expert columns split
    over ``tp`` ranks and the partial outputs summed (the all-reduce). ``megatron``: what megatron-core 0.16.1
    computes (no chunking, no temperature tuning)."""
    c = config_dict(model)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    d, s = c["head_dim"], ids.shape[1]
    eps = c["rms_norm_eps"]
    cos, sin = ops.rope_angles(model.model.rotary_emb.inv_freq, s, model.model.rotary_emb.attention_scaling)

    def rms(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w

    def cols(w, t, dim=0):
        return w.chunk(tp, dim=dim)[t]

    x = sd["model.embed_tokens.weight"][ids]
    for i, flags in enumerate(R.layer_flags(c)):
        if megatron:
            flags = dict(flags, chunk=None, temperature=False)
        p = f"model.layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"])
        a = p + "self_attn."
        att = sum(ops.attention(h, cols(sd[a + "q_proj.weight"], t), cols(sd[a + "k_proj.weight"], t),
                                cols(sd[a + "v_proj.weight"], t), cols(sd[a + "o_proj.weight"], t, 1), d, flags, eps,
                                cos, sin, c["floor_scale"], c["attn_scale"]) for t in range(tp))
        x = x + att
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        f = p + "feed_forward."
        if flags["moe"]:
            gate_up, down = sd[f + "experts.gate_up_proj"], sd[f + "experts.down_proj"]  # [E, H, 2I], [E, I, H]
            inter = down.shape[1]
            out = 0
            for t in range(tp):
                experts = {e: (cols(gate_up[e, :, :inter].T, t), cols(gate_up[e, :, inter:].T, t),
                               cols(down[e].T, t, 1)) for e in range(gate_up.shape[0])}
                se = f + "shared_expert."
                shared = (cols(sd[se + "gate_proj.weight"], t), cols(sd[se + "up_proj.weight"], t),
                          cols(sd[se + "down_proj.weight"], t, 1))
                part = ops.moe_on_input(h, sd[f + "router.weight"], experts, shared, c["num_experts_per_tok"])
                out = out + part  # experts and shared expert split by FFN columns: the partial sums add
            x = x + out
        else:
            x = x + sum(ops.dense_mlp(h, cols(sd[f + "gate_proj.weight"], t), cols(sd[f + "up_proj.weight"], t),
                                      cols(sd[f + "down_proj.weight"], t, 1)) for t in range(tp))
    return F.linear(rms(x, sd["model.norm.weight"]), sd["lm_head.weight"])


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("which", ["active", "short"])
def test_ops_forward_equals_transformers(which, tp, request):
    model = request.getfixturevalue(which)
    with torch.no_grad():
        ref = model(IDS).logits
        ours = reference_forward(model, IDS, tp)
    assert (ours - ref).abs().max() < 1e-5


def test_megatron_exact_only_up_to_the_limit(active, short):
    """What megatron-core computes (no chunking, no temperature) equals transformers on sequences up to
    megatron_exact_length and differs one token later; the short config is exact at 16 tokens."""
    limit = R.megatron_exact_length(config_dict(active))
    with torch.no_grad():
        ids = IDS[:, :limit]
        assert (reference_forward(active, ids, megatron=True) - active(ids).logits).abs().max() < 1e-5
        ids = IDS[:, :limit + 1]
        assert (reference_forward(active, ids, megatron=True) - active(ids).logits).abs().max() > 1e-4
        assert (reference_forward(short, IDS, megatron=True) - short(IDS).logits).abs().max() < 1e-5


def test_temperature_and_chunk_ops():
    assert torch.equal(ops.temperature_scale(3, 4, 0.1), torch.ones(3))
    assert ops.temperature_scale(8, 4, 0.1)[3] == pytest.approx(1 + 0.1 * torch.log1p(torch.tensor(1.0)).item())
    m = ops.chunked_mask(6, 3)
    assert m[2, 0] and not m[3, 2] and m[5, 3] and not m[1, 2]
    assert torch.equal(ops.chunked_mask(6, 8), ops.chunked_mask(6, None))


# ---- conversions (mappings/llama4.toml) ---------------------------------------------------------------------------
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
