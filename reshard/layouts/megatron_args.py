"""Megatron-LM ``args`` <-> :class:`~reshard.core.model_config.ModelConfig`.

The args fields that change what a Megatron-Core GPT model computes, as Megatron-LM's
``core_transformer_config_from_args`` and ``GPTModel`` read them: ``rotary_base``; ``use_rope_scaling`` +
``rope_scaling_factor`` (Llama 3.1 scaling, whose other parameters megatron-core fixes: low 1, high 4, original
length 8192); ``rotary_seq_len_interpolation_factor`` (linear scaling); ``rotary_percent``; ``rotary_interleaved``;
``window_size`` ``(left, 0)`` (a window of ``left + 1`` tokens on every layer; ``window_attn_skip_freq`` mixes
in full layers); ``add_qkv_bias`` (q/k/v biases) and ``add_bias_linear`` (every linear); ``swiglu`` (SiLU-gated
MLP; without it the MLP is plain GELU: megatron-core's fused ``bias_gelu`` (``bias_gelu_fusion``, Megatron-LM's
default, with biases) is the tanh approximation, else exact erf GELU); ``normalization`` and ``norm_epsilon``;
``position_embedding_type`` (``rope`` or ``learned_absolute``); ``qk_layernorm``;
``apply_residual_connection_post_layernorm``; ``untie_embeddings_and_output_weights``; the dims (``num_query_groups``
only counts with ``group_query_attention``). Anything else in the meaning is a loss for this target.
"""

from __future__ import annotations

from typing import Any

from reshard.core.model_config import ConfigLoss, ModelConfig
from reshard.errors import CheckpointError, PlanError
from reshard.layouts import cohere_rules, gpt_oss_rules, megatron_yarn

#: megatron-core's RotaryEmbedding._apply_scaling parameters other than the factor (not settable from args).
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
#: Args that change what megatron-core computes and that the canonical config does not carry (yet), with the
#: value that changes nothing: any other value is refused on read, never dropped.
UNCARRIED = {
    "glu_linear_offset": 0.0,  # added to the linear half of the gated MLP
    "activation_func_clamp_value": None,
    "no_rope_freq": None,  # layers without RoPE
    "qk_l2_norm": False,
    "squared_relu": False,  # carried for an ungated MLP (Nemotron's relu2); with swiglu Megatron-LM asserts
    "quick_geglu": False,
    "moe_router_topk_limited_devices": None,  # device-limited routing (DeepSeek-V2's training-time option)
    "moe_router_fusion": False,
}
#: megatron-core's MLA RoPE defaults when args leave them out (MLATransformerConfig): written explicitly.
MLA_ROPE_DEFAULTS = {"rotary_scaling_factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


def meaning_from_args(args, vocab: int, architecture: str | None, where: str) -> ModelConfig:
    """The meaning of a Megatron run's ``args`` (``architecture``: recorded or given, else derived)."""
    args, gpt_oss = gpt_oss_rules.args_view(args)  # gpt-oss's quick_geglu and sinks, any yarn args
    get = lambda key, default=None: getattr(args, key, default)  # noqa: E731
    position = get("position_embedding_type", "learned_absolute")
    mrope = position == "mrope" and get("mrope_section") is not None  # Qwen-VL's multimodal RoPE: 1-D on text
    position = "rope" if mrope else position
    norm = {"RMSNorm": "rms", "LayerNorm": "layer"}.get(get("normalization", "LayerNorm"))
    if position not in ("rope", "learned_absolute", "none") or norm is None:  # none: MambaModel hybrids
        what = (f"position_embedding_type {position}" if position not in ("rope", "learned_absolute", "none")
                else f"normalization {get('normalization')}")
        raise CheckpointError(f"{where}: this Megatron checkpoint uses {what}, which no shipped mapping covers")
    for key, neutral in UNCARRIED.items():
        if key == "squared_relu" and not get("swiglu", False):
            continue
        value = get(key, neutral)
        if value is not None and value != neutral:
            raise CheckpointError(f"{where}: args set {key} = {value!r}, which changes what the model computes and "
                                  "which reshard does not carry yet; converting it would silently compute another "
                                  "function")
    heads = get("num_attention_heads")
    groups = get("num_query_groups") if get("group_query_attention", False) else heads
    scaling = None
    mla = _mla_from_args(args, where)
    if mla and get("rope_type", "rope") == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(get("rotary_scaling_factor", 40.0)),
                   **{k: float(get(k, v)) if k != "original_max_position_embeddings" else int(get(k, v))
                      for k, v in MLA_ROPE_DEFAULTS.items() if k != "rotary_scaling_factor"}}
    elif get("use_rope_scaling", False):
        scaling = {"rope_type": "llama3", "factor": float(get("rope_scaling_factor", 8.0)), **LLAMA3_FIXED}
    elif get("rotary_seq_len_interpolation_factor") not in (None, 1, 1.0):
        scaling = {"rope_type": "linear", "factor": float(get("rotary_seq_len_interpolation_factor"))}
    elif mrope:
        scaling = {"rope_type": "default", "mrope_section": tuple(get("mrope_section"))}
    window, windowed = None, None
    size = get("window_size")
    if size is not None:
        left, right = (list(size) + [0, 0])[:2]
        if right not in (0, None) or left is None or left < 0:
            raise CheckpointError(f"{where}: window_size {tuple(size)} looks ahead; only causal windows "
                                  "(left, 0) are supported")
        window = int(left) + 1
        every = get("window_attn_skip_freq")
        if every is not None and (not isinstance(every, int) or every < 1):
            raise CheckpointError(f"{where}: window_attn_skip_freq {every!r} (a per-layer pattern) is not "
                                  "supported yet; only an integer period")
        if every and every > 1:  # megatron-core: 1-based layer n is full attention when n % every == 0
            windowed = tuple(i for i in range(get("num_layers")) if (i + 1) % every)
    qkv_bias = bool(get("add_qkv_bias", False) or get("add_bias_linear", False))
    bias = bool(get("add_bias_linear", False))
    gated = bool(get("swiglu", False))
    squared_relu = bool(get("squared_relu", False)) and not gated  # Nemotron's relu2 (ungated)
    activation = ("silu" if gated else "relu2" if squared_relu
                  else "gelu_tanh" if get("bias_gelu_fusion", True) and bias else "gelu")
    learned, qk_norm = position == "learned_absolute", bool(get("qk_layernorm", False)) and not mla
    if architecture is None and mla:
        architecture = ("DeepseekV3ForCausalLM" if get("moe_router_score_function", "softmax") == "sigmoid"
                        else "DeepseekV2ForCausalLM")
    if architecture is None and get("num_experts"):
        architecture = ("Qwen2MoeForCausalLM" if get("moe_shared_expert_intermediate_size")
                        else "Qwen3MoeForCausalLM" if qk_norm else "MixtralForCausalLM")
    if architecture is None and squared_relu:
        architecture = "NemotronForCausalLM"
    if architecture is None:
        architecture = ("GPT2LMHeadModel" if learned else "Qwen3ForCausalLM" if qk_norm
                        else "Starcoder2ForCausalLM" if not gated else "MistralForCausalLM" if window
                        else "Qwen2ForCausalLM" if qkv_bias and not bias else "LlamaForCausalLM")
    hidden = get("hidden_size")
    return ModelConfig(
        architecture=architecture, hidden=hidden, layers=get("num_layers"), heads=heads,
        kv_heads=groups or heads, **({} if mla else {"head_dim": get("kv_channels") or hidden // heads}),
        ffn=get("ffn_hidden_size"),
        vocab=vocab, max_positions=get("max_position_embeddings") or get("seq_length"), norm=norm,
        norm_eps=float(get("norm_epsilon", 1e-5)), activation=activation,
        rope_theta=10000.0 if learned else float(get("rotary_base", 10000)),
        rope_scaling=tuple(sorted(scaling.items())) if scaling and not learned else None,
        rotary_fraction=1.0 if learned else float(get("rotary_percent", 1.0)),
        rope_interleaved=False if learned else bool(get("rotary_interleaved", False)),
        sliding_window=window, sliding_layers=windowed, qkv_bias=qkv_bias, o_bias=bias, mlp_bias=bias,
        tied=not get("untie_embeddings_and_output_weights", False),
        residual_post_norm=bool(get("apply_residual_connection_post_layernorm", False)),
        position="learned" if learned else "none" if position == "none" else "rope", gated_mlp=gated, qk_norm=qk_norm,
        norm_offset=bool(get("apply_layernorm_1p", False)),
        query_scale=_query_scale(get("softmax_scale")), mtp_layers=int(get("mtp_num_layers") or 0),
        **mla, **_moe_from_args(args, where)).replace(**gpt_oss)


def _mla_from_args(args, where: str) -> dict[str, Any]:
    """Multi-head latent attention's fields (``multi_latent_attention``; megatron-core's ``qk_head_dim`` is the
    no-RoPE part of a head) with ``head_dim``; empty without MLA."""
    get = lambda key, default=None: getattr(args, key, default)  # noqa: E731
    if not get("multi_latent_attention", False):
        return {}
    if get("rope_type", "rope") not in ("rope", "yarn"):
        raise CheckpointError(f"{where}: args set rope_type = {get('rope_type')!r}; reshard reads MLA with rope or "
                              "yarn")
    return dict(q_lora_rank=int(get("q_lora_rank") or 0), kv_lora_rank=int(get("kv_lora_rank")),
                head_dim=int(get("qk_head_dim")), rope_head_dim=int(get("qk_pos_emb_head_dim")),
                v_head_dim=int(get("v_head_dim")))


def _moe_from_args(args, where: str) -> dict[str, Any]:
    """The Mixture-of-Experts fields of Megatron-LM args (``num_experts`` unset: dense)."""
    get = lambda key, default=None: getattr(args, key, default)  # noqa: E731
    experts = get("num_experts")
    if not experts:
        return {}
    score = get("moe_router_score_function", "softmax")
    if score not in ("softmax", "sigmoid"):
        raise CheckpointError(f"{where}: args set moe_router_score_function = {score!r}; reshard carries softmax "
                              "and sigmoid routers")
    topk = int(get("moe_router_topk", 2))
    routing: dict[str, Any] = dict(router_score=score, router_bias=bool(get("moe_router_enable_expert_bias", False)),
                                   router_scaling=float(get("moe_router_topk_scaling_factor") or 1.0))
    groups = int(get("moe_router_num_groups") or 1)
    if groups > 1:  # megatron-core ranks a group by the sum of its best topk / group_topk scores (moe_utils.py)
        group_topk = int(get("moe_router_group_topk") or 1)
        routing.update(router_groups=groups, router_group_topk=group_topk,
                       router_group_score=f"top{topk // group_topk}_sum")
    freq = get("moe_layer_freq", 1)
    layers = get("num_layers")
    if isinstance(freq, int):
        sparse = tuple(i for i in range(layers) if i % freq == 0)
    else:
        sparse = tuple(i for i, on in enumerate(list(freq)) if on)
    shared = get("moe_shared_expert_intermediate_size") or 0
    # sigmoid scores are always renormalised over the top k (k > 1); softmax ones unless taken before the top-k
    renormalize = topk > 1 if score == "sigmoid" else not get("moe_router_pre_softmax", False)
    return dict(experts=int(experts), experts_per_token=topk,
                expert_ffn=int(get("moe_ffn_hidden_size") or get("ffn_hidden_size")),
                router_renormalize=renormalize, **routing,
                moe_layers=None if sparse == tuple(range(layers)) else sparse, shared_expert_ffn=int(shared),
                shared_expert_gate=bool(shared) and bool(get("moe_shared_expert_gate", False)))


def _query_scale(softmax_scale: float | None) -> float | None:
    """``query_pre_attn_scalar`` from megatron-core's ``softmax_scale`` (= its ``** -0.5``): the nearest integer
    when within rounding (Gemma's are integers), else the float."""
    if not softmax_scale:
        return None
    value = float(softmax_scale) ** -2
    return float(round(value)) if abs(value - round(value)) <= 1e-9 * value else value


#: Meaning Megatron-LM's args have no place for (Megatron-Bridge's model providers set it in code): written into
#: the args' ``hf_config`` record and read back from it; stock Megatron-LM does not apply it.
RECORD_ONLY = ("embedding_scaled", "sandwich_norm", "attn_softcap", "final_softcap", "rope_local_theta", "llama4")


def record_only_fields(meaning: ModelConfig) -> dict[str, Any]:
    """The fields of ``meaning`` that only the ``hf_config`` record carries (a gated MLP's non-SiLU activation
    too), with their values where they are not the default."""
    default = ModelConfig(architecture="", hidden=1, layers=1, heads=1, kv_heads=1, head_dim=1, ffn=1, vocab=1)
    fields = {f: getattr(meaning, f) for f in RECORD_ONLY if getattr(meaning, f) != getattr(default, f)}
    if meaning.gated_mlp and meaning.activation != "silu":
        fields.update(gated_mlp=True, activation=meaning.activation)
    return fields


def _routing_args(m: ModelConfig, loss: ConfigLoss) -> dict[str, Any]:
    """The router's args, or the loss of what megatron-core computes otherwise (deepseek-v3.md section 6): its
    sigmoid router always renormalises the top k; its groups are ranked by the sum of their best
    ``topk / group_topk`` scores, so a ``top2_sum`` group score needs ``topk == 2 * group_topk``, and a ``max``
    one (DeepSeek-V2's group_limited_greedy) has no spelling."""
    k = m.experts_per_token
    if m.router_score == "sigmoid" and k > 1 and not m.router_renormalize:
        loss.cannot("router_renormalize", False, "megatron-core's sigmoid router always renormalises its top-k "
                    "weights (norm_topk_prob would have to be true)")
    if m.router_bias and m.router_score != "sigmoid":
        loss.cannot("router_bias", True, "megatron-core adds the expert bias only to sigmoid scores")
    values: dict[str, Any] = dict(moe_router_score_function=m.router_score,
                                  moe_router_enable_expert_bias=m.router_bias,
                                  moe_router_topk_scaling_factor=m.router_scaling if m.router_scaling != 1.0 else None,
                                  moe_router_num_groups=None, moe_router_group_topk=None)
    if m.router_groups > 1:
        per_group = k // m.router_group_topk if k % m.router_group_topk == 0 else None
        if m.router_group_score != f"top{per_group}_sum":
            why = ("megatron-core ranks a group by the sum of its best scores, not by its single best score "
                   "(DeepSeek-V2's group_limited_greedy)" if m.router_group_score == "max" else
                   f"megatron-core ranks a group by the sum of its best num_experts_per_tok / topk_group = "
                   f"{k}/{m.router_group_topk} scores, which equals {m.router_group_score} only when "
                   "num_experts_per_tok = 2 * topk_group")
            loss.cannot("router_group_score", m.router_group_score, why)
        values.update(moe_router_num_groups=m.router_groups, moe_router_group_topk=m.router_group_topk)
    if m.router_bias:
        values["moe_router_dtype"] = "fp32"
    return values


def _moe_args(m: ModelConfig, loss: ConfigLoss) -> dict[str, Any]:
    """Megatron-LM's Mixture-of-Experts args for ``m`` (``num_experts`` None for a dense model). The router:
    softmax or sigmoid scores; softmax with ``moe_router_pre_softmax`` takes the top-k of the softmax over every
    expert (no renormalisation), without it the softmax runs over the top-k logits (renormalised)."""
    if not m.experts:
        return dict(num_experts=None)
    sparse = m.sparse_layers()
    return dict(num_experts=m.experts, moe_router_topk=m.experts_per_token, moe_ffn_hidden_size=m.expert_ffn,
                moe_router_pre_softmax=not m.router_renormalize, **_routing_args(m, loss),
                moe_layer_freq=1 if sparse == tuple(range(m.layers)) else [int(i in sparse) for i in range(m.layers)],
                moe_shared_expert_intermediate_size=m.shared_expert_ffn or None,
                moe_shared_expert_gate=m.shared_expert_gate,
                moe_token_dispatcher_type="allgather")


def _mla_args(m: ModelConfig) -> dict[str, Any]:
    """megatron-core's MLA args (``qk_head_dim``: the no-RoPE part of a head; the q / kv LoRA norms are its
    ``qk_layernorm``; RoPE defaults written explicitly, megatron-core's ``mscale_all_dim`` default 0.0 would drop
    yarn's attention scale), or ``multi_latent_attention=False``."""
    if not m.mla:
        return dict(multi_latent_attention=False)
    return dict(multi_latent_attention=True, q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank,
                qk_head_dim=m.head_dim, qk_pos_emb_head_dim=m.rope_head_dim, v_head_dim=m.v_head_dim,
                kv_channels=m.v_head_dim, qk_layernorm=True, rope_type="rope", **MLA_ROPE_DEFAULTS)


def _yarn_args(scaling: dict, loss: ConfigLoss) -> dict[str, Any]:
    """megatron-core's MLA yarn args for an HF yarn ``rope_scaling``. megatron-core scales cos/sin by
    get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) whatever they are; transformers does so only
    when both are set, else by get_mscale(factor) (mscale 1), and scales the softmax by get_mscale(factor,
    mscale_all_dim)^2 in both. So without mscale_all_dim the args say mscale 1 and mscale_all_dim 0; with
    mscale_all_dim but no mscale, an explicit attention_factor, or truncate false (megatron-core always rounds the
    correction range) there is no spelling."""
    if scaling.get("attention_factor") is not None:
        loss.cannot("rope_scaling", {"attention_factor": scaling["attention_factor"]}, "megatron-core derives "
                    "yarn's cos/sin factor from mscale / mscale_all_dim and takes no explicit one")
    if scaling.get("truncate", True) is False:
        loss.cannot("rope_scaling", {"truncate": False}, "megatron-core always rounds yarn's correction range")
    values = {k: scaling.get(k, v) for k, v in MLA_ROPE_DEFAULTS.items() if k != "rotary_scaling_factor"}
    if not scaling.get("mscale_all_dim"):
        values.update(mscale=1.0, mscale_all_dim=0.0)
    elif not scaling.get("mscale"):
        loss.cannot("rope_scaling", {"mscale": scaling.get("mscale"), "mscale_all_dim": scaling["mscale_all_dim"]},
                    "transformers scales yarn's cos/sin by get_mscale(factor) when mscale is unset, megatron-core "
                    "by get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)")
    return dict(rope_type="yarn", rotary_scaling_factor=float(scaling["factor"]), **values)


def _skip_period(windowed: tuple[int, ...], layers: int) -> int | None:
    """The n with every n-th layer (1-based) at full attention and the others windowed, or None."""
    for every in range(2, layers + 1):
        if windowed == tuple(i for i in range(layers) if (i + 1) % every):
            return every
    return None


GRANITE_MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "logits_scaling")


def _granite_multipliers(m: ModelConfig, loss: ConfigLoss) -> None:
    """Granite's embedding / residual / logit multipliers: megatron-core has none (families-2.md section 7); refused
    with section 17's message unless all three are allowed lossy (then dropped, noted). Its attention_multiplier
    is megatron-core's softmax_scale."""
    m_e, m_r, s = (getattr(m, f) for f in GRANITE_MULTIPLIERS)
    if (m_e, m_r, s) == (1.0, 1.0, 1.0):
        return
    if not set(GRANITE_MULTIPLIERS) <= set(loss.allowed):
        raise PlanError(f"Granite scales the embedding (\u00d7{m_e}), every residual branch (\u00d7{m_r}) and the "
                        f"logits (\u00f7{s}); megatron-core has no such multipliers, and folding them into tied or "
                        "bf16 weights changes the model. Convert to hf or vllm, or pass --allow-lossy-config "
                        "embedding_multiplier,residual_multiplier,logits_scaling.")
    for field, value in zip(GRANITE_MULTIPLIERS, (m_e, m_r, s)):
        if value != 1.0:
            loss.cannot(field, value, "megatron-core has no such multiplier")


OLMO_ARCHITECTURES = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")


def _olmo_qk_norm(m: ModelConfig) -> None:
    """OLMo 2 / 3's q/k RMSNorms span the whole projection; megatron-core's are per head (families-2.md section 6):
    refused with section 17's message."""
    if m.architecture in OLMO_ARCHITECTURES:
        raise PlanError(f"OLMo 2/3 normalises q and k over the whole projection (q_norm [{m.heads * m.head_dim}] "
                        "across all heads); megatron-core's q_layernorm/k_layernorm are per head, so Megatron cannot "
                        "express it. Convert to hf or vllm.")


def args_from_meaning(meaning: ModelConfig, loss: ConfigLoss) -> dict[str, Any]:
    """The args fields that spell ``meaning``; what args cannot spell goes to ``loss``."""
    m = meaning
    values: dict[str, Any] = dict(
        num_layers=m.layers, hidden_size=m.hidden, ffn_hidden_size=m.ffn, num_attention_heads=m.heads,
        group_query_attention=m.kv_heads != m.heads, num_query_groups=m.kv_heads, kv_channels=m.head_dim,
        vocab_size=m.vocab, max_position_embeddings=m.max_positions, swiglu=m.gated_mlp,
        normalization="RMSNorm" if m.norm == "rms" else "LayerNorm", norm_epsilon=m.norm_eps,
        position_embedding_type={"rope": "rope", "none": "none"}.get(m.position, "learned_absolute"),
        use_rotary_position_embeddings=m.position == "rope", rotary_percent=m.rotary_fraction,
        rotary_interleaved=m.rope_interleaved, qk_layernorm=m.qk_norm,
        apply_residual_connection_post_layernorm=m.residual_post_norm,
        untie_embeddings_and_output_weights=not m.tied, use_rope_scaling=False,
        rotary_seq_len_interpolation_factor=None, window_size=None,
    )
    if m.norm not in ("rms", "layer"):
        loss.cannot("norm", m.norm, "Megatron-LM's args spell RMSNorm and LayerNorm")
    _olmo_qk_norm(m)
    cohere_rules.refuse_megatron(m)
    _granite_multipliers(m, loss)
    values.update(_moe_args(m, loss))
    values.update(_mla_args(m), mtp_num_layers=m.mtp_layers or None)
    recorded = record_only_fields(m)
    if recorded:
        loss.record(", ".join(f"{k} = {v!r}" for k, v in recorded.items()),
                    "Megatron-LM's args have no place for it: kept in args.hf_config (run the model with a "
                    "Megatron-Bridge provider for this architecture; stock Megatron-LM would not apply it)")
    if m.gated_mlp and m.activation != "silu":
        values["swiglu"] = False  # no args spell a non-SiLU gated MLP: a stock load fails on fc1's shape, loudly
    elif not m.gated_mlp and m.activation == "relu2":
        values["squared_relu"] = True  # Nemotron: megatron-core's squared_relu, ungated
    elif not m.gated_mlp:
        if m.activation == "gelu_tanh" and not m.mlp_bias:
            loss.cannot("activation", m.activation, "megatron-core computes tanh GELU only in its fused bias_gelu, "
                        "which needs MLP biases")
        elif m.activation not in ("gelu", "gelu_tanh"):
            loss.cannot("activation", m.activation, "Megatron-LM's args spell an ungated MLP only as GELU")
        values["bias_gelu_fusion"] = m.activation == "gelu_tanh"
    theta = m.rope_theta
    if theta != int(theta):
        loss.cannot("rope_theta", theta, "Megatron-LM's --rotary-base is an integer")
    values["rotary_base"] = int(theta)
    scaling, kind = m.scaling, m.rope_type
    if kind == "llama3":
        fixed = {k: scaling.get(k) for k in LLAMA3_FIXED}
        if {k: float(v) for k, v in fixed.items() if v is not None} != {k: float(v) for k, v in LLAMA3_FIXED.items()}:
            loss.cannot("rope_scaling", scaling, f"megatron-core fixes llama3 scaling's other parameters at "
                        f"{LLAMA3_FIXED}")
        values.update(use_rope_scaling=True, rope_scaling_factor=float(scaling.get("factor", 8.0)))
    elif kind == "linear":
        values["rotary_seq_len_interpolation_factor"] = float(scaling["factor"])
    elif kind == "yarn" and not m.mla:  # standard attention: megatron-core's YarnRotaryEmbedding
        values.update(megatron_yarn.megatron_args(m, loss))
    elif kind == "yarn" and m.mla:
        values.update(_yarn_args(scaling, loss))
    elif kind != "default":
        loss.cannot("rope_scaling", scaling, f"megatron-core's GPT model has no '{kind}' RoPE scaling")
    if "mrope_section" in scaling:  # Qwen-VL's multimodal RoPE (megatron-core's MultimodalRotaryEmbedding)
        values.update(position_embedding_type="mrope", mrope_section=list(scaling["mrope_section"]))
    values.update(apply_layernorm_1p=m.norm_offset, softmax_scale=m.attention_multiplier if m.attention_multiplier
                  else m.query_scale ** -0.5 if m.query_scale else None,
                  window_attn_skip_freq=None)
    if m.sliding_window:
        if m.sliding_layers is not None:
            every = _skip_period(m.sliding_layers, m.layers)
            if every is None:
                loss.cannot("sliding_layers", list(m.sliding_layers), "window_attn_skip_freq spells only every n-th "
                            "layer at full attention")
            values["window_attn_skip_freq"] = every
        values["window_size"] = (m.sliding_window - 1, 0)
    if (m.qkv_bias, m.o_bias, m.mlp_bias) == (True, True, True):
        values.update(add_bias_linear=True, add_qkv_bias=True)
    elif not m.o_bias and not m.mlp_bias:
        values.update(add_bias_linear=False, add_qkv_bias=m.qkv_bias)
    else:
        field = "o_bias" if m.o_bias else "mlp_bias"
        loss.cannot(field, getattr(m, field), "Megatron-LM's add_bias_linear switches the attention output and "
                    f"MLP biases together (here qkv {m.qkv_bias}, o {m.o_bias}, mlp {m.mlp_bias})")
        values.update(add_bias_linear=m.o_bias, add_qkv_bias=m.qkv_bias)
    values.update(gpt_oss_rules.megatron_args(m))
    return values
