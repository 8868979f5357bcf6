"""Llama 4 text building blocks (issue 44 item 5; families-2.md sections 3, 13, 17): the per-layer rules read from
the config (MoE list, NoPE layers, chunked layers), the vLLM q/k row permutation checked against a rule written
from the spec, the section 17 refusals, and the forward verifier's Llama 4 ops (interleaved RoPE, NoPE, L2 q/k
norm, temperature tuning, chunked attention, on-input top-1 sigmoid routing with a shared expert) reproducing
transformers' Llama4ForCausalLM logits at TP 1 and 2 within 1e-5 on the tiny models of tests/llama4_cases.py.
The conversions: tests/test_family_llama4.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import llama4_cases
from llama4_cases import IDS, config_dict, transformers

from reshard.errors import PlanError
from reshard.layouts import llama4_rules as R
from reshard.verification.forward import llama4_ops as ops


active, short = llama4_cases.active, llama4_cases.short  # the tiny models (module-scoped fixtures)


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


def test_llama4_rules_are_a_loss_in_another_family_s_spelling():
    """A Llama 4 meaning written as a Llama config: the per-layer rules cannot be spelt and are refused."""
    from reshard.core.model_config import ConfigLoss, ModelConfig
    from reshard.layouts.hf_config import write_config
    from reshard.mapping import load_shipped

    meaning = ModelConfig(architecture="LlamaForCausalLM", hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16,
                          ffn=96, vocab=512, llama4=(("nope_layers", (3,)),))
    loss = ConfigLoss("Hugging Face")
    write_config(meaning, None, load_shipped("llama"), loss)
    with pytest.raises(PlanError, match="llama4"):
        loss.check()
