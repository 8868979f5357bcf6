"""The vocabulary of a mapping file: every table, key and value it may use, and the check that a table uses only those.

Parsing (tables.py, weight_entries.py) validates against these sets; a new key or kind is added here first.
Unknown keys are errors that name the file, the key and the nearest valid one (:func:`_check_keys`).
"""

from __future__ import annotations

import difflib

from reshard.errors import MappingError

SPLIT_KINDS = ("replicated", "column", "row", "vocab", "qkv", "gate_up", "sections")  # sections: mapping/sections.py
#: first_rank: whole on rank 0 and zeros on the others (vLLM gpt-oss w2_bias); read from rank 0.
SPLIT_KINDS += ("first_rank",)
PACK_SLOTS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
#: Replicated weights may share one fused name in a layout (vLLM's ``fused_qkv_a_proj`` = ``[q_a; kv_a]``): each
#: names its place with a free-form ``slot``; the pack is the members whole, in declaration order, on dim 0.
REPLICATED_PACK = "replicated"
WEIGHT_KEYS = {
    "hf", "split", "slot", "shape", "optional", "tied_to", "stage", "role", "hf_stored", "hf_transposed", "layers",
    "hf_fused", "when", "split_megatron_local", "dtype", "copy_of",
    "mixer", "split_vllm", "split_megatron", "sections", "section_groups", "megatron_offset", "gated_query",
    "hf_fused_on_disk", "hf_fused_transposed", "hf_fused_interleaved", "vllm_interleaved",
    "megatron", "megatron_te", "megatron_local", "megatron_sparse", "megatron_grouped", "megatron_legacy_grouped",
    "vllm", "vllm_unfused", "trtllm", "meta",
    "vllm_transform",  # "neg_exp": vLLM stores -exp(w) in fp32 (Nemotron-H A_log -> A; mapping/sections.py)
    "vllm_qk_permute",  # "interleaved_to_half": vLLM stores these q/k rows in rotate-half order (Llama 4)
    "hf_shape",  # the shape HF files give the same bytes (Ernie 4.5 bias [1, E] of a canonical [E])
}
TOP_KEYS = {"family", "dims", "hf", "moe", "mla", "mtp", "megatron", "vllm", "decoder", "config", "weight", "layers"}
TOP_KEYS |= {"maxtext"}  # [maxtext]: MaxText names and conventions (reshard/mapping/maxtext_names.py)
#: Mixture of Experts ([moe]): the dims symbol of the expert count and the config keys that say which layers are
#: sparse (every ``sparse_step``-th, except ``dense_layers`` and the first ``dense_prefix``; all when none is set).
#: Routing: ``score`` (``softmax`` | ``sigmoid``, fixed per family), ``groups`` / ``group_topk`` (the config keys
#: of group-limited routing: experts in ``groups`` equal groups, the best ``group_topk`` groups by
#: ``group_score`` kept), ``group_score`` (``top2_sum``: the sum of each group's two best bias-corrected scores;
#: ``max``: its best score), ``group_switch`` (``{key, on, off}``: the config key whose value ``on`` turns the groups
#: on and ``off`` leaves them unused, DeepSeek-V2's ``topk_method``), ``scaling`` (the config key of the factor the
#: routed weights are multiplied by). A selection bias is the weight with role ``router_bias``. ``shared_count``:
#: the dims symbol of the number of shared experts, each ``expert_ffn`` wide (DeepSeek's ``n_shared_experts``),
#: instead of a ``shared_ffn`` width.
MOE_KEYS = {"experts", "expert_ffn", "shared_ffn", "shared_count", "top_k", "renormalize", "sparse_step",
            "dense_layers", "dense_prefix", "score", "groups", "group_topk", "group_score", "group_switch", "scaling",
            "sparse_list", "apply_on_input"}  # Llama 4: an explicit MoE layer list; routing weight on the input
MOE_KEYS |= {"sparse_start", "sparse_end"}  # Ernie 4.5: config keys of the first / last MoE layer (inclusive)
GROUP_SWITCH_KEYS = {"key", "on", "off"}
ROUTER_SCORES = ("softmax", "sigmoid")
GROUP_SCORES = ("top2_sum", "max")
#: Multi-head latent attention ([mla], DeepSeek-V2/V3): the dims symbols of the q LoRA rank (0: none, q_proj),
#: the compressed KV rank, the no-RoPE and RoPE parts of each query/key head and the value head dim.
MLA_KEYS = {"q_lora_rank", "kv_lora_rank", "nope_dim", "rope_dim", "v_dim"}
#: Multi-token prediction ([mtp], DeepSeek-V3): the config key of the number of MTP layers, stored in HF after the
#: decoder layers (``model.layers.{L + k}``) and holding every MoE-layer weight plus the ``layers = "mtp"`` ones.
MTP_KEYS = {"layers"}
LAYER_KINDS = ("all", "sparse", "dense", "mtp")
HF_KEYS = {"ignore", "optional_prefix", "drop_prefix"}  # drop_prefix: tensors read as absent, with a note
#: What a weight is to the forward verifier's decoder (verification/forward/rank_weights.py): per-layer roles
#: are LayerWeights fields, the others RankWeights fields. A plain (ungated) MLP's first linear is ``up``.
LAYER_ROLES = ("input_norm", "input_norm_bias", "q", "k", "v", "q_bias", "k_bias", "v_bias", "q_norm", "k_norm",
               "o", "o_bias", "attn_output_norm", "post_norm", "post_norm_bias", "gate", "gate_bias", "up", "up_bias",
               "down", "down_bias", "mlp_output_norm", "router", "router_bias", "expert_gate", "expert_up",
               "expert_down", "shared_gate", "shared_up", "shared_down", "shared_expert_gate",
               "q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "kv_b",
               "sinks", "router_linear_bias", "expert_gate_bias", "expert_up_bias", "expert_down_bias")
LAYER_ROLES += ("mamba_in", "mamba_conv", "mamba_conv_bias", "mamba_a_log", "mamba_d", "mamba_dt_bias", "mamba_norm",
                "mamba_out")  # Mamba2 (Nemotron-H)
LAYER_ROLES += ("gdn_qkvz", "gdn_ba", "gdn_conv", "gdn_a_log", "gdn_dt_bias", "gdn_norm", "gdn_out")  # Gated DeltaNet
MODEL_ROLES = ("embedding", "position_embedding", "final_norm", "final_norm_bias", "lm_head")
FAMILY_KEYS = {"name", "description", "architectures"}
DIM_KEYS = {"key", "default"}
MEGATRON_KEYS = {"extra_state_te", "extra_state_local"}
VLLM_KEYS = {"attention_scales", "tied_name"}
MEGATRON_SPECS = ("te", "local")

# The reference decoder's features (verification/forward/decoder.py implements each); a family's [decoder] table
# picks them. Config-dependent values (activation, epsilon, window) name the HF config key they come from.
DECODER_KEYS = {"norm", "mlp", "position", "activation", "norm_offset", "embedding_scaled", "rope_order", "variant"}
DECODER_CHOICES = {"norm": ("rms", "layer"), "mlp": ("gated", "plain"), "position": ("rope", "learned", "none"),
                   "rope_order": ("half", "interleaved"), "variant": ("llama4_rules",)}  # layouts/llama4_rules.py
#: The config.json keys a decoder variant reads (carried by the family; their defaults may be stated).
VARIANT_KEYS = {"llama4_rules": ("no_rope_layers", "no_rope_layer_interval", "use_qk_norm", "attention_chunk_size",
                           "layer_types", "attn_temperature_tuning", "floor_scale", "attn_scale")}
#: HF ``hidden_act`` values -> the decoder's activation (``gelu_tanh``: the tanh approximation of GELU).
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "relu": "relu", "relu2": "relu2"}

#: Granite's multipliers ([config] keys naming the config.json key of each; ModelConfig fields of the same name):
#: embedding times ``embedding_multiplier``, every residual branch times ``residual_multiplier``, the logits divided
#: by ``logits_scaling``, attention scores times ``attention_multiplier`` (the absolute softmax scale).
MULTIPLIER_KEYS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")
# How config.json spells the model's meaning, per architecture ([config] table; reshard/layouts/hf_config.py).
CONFIG_KEYS = {"norm_eps", "activation", "max_positions", "attn_softcap", "final_softcap", "query_scale",
               "rope_local_theta", "bias_groups", "architectures", *MULTIPLIER_KEYS}
ARCH_CONFIG_KEYS = {"model_type", "other_model_types", "biases", "window", "window_pattern", "rotary_fraction",
                    "requires", "defaults"}
BIAS_GROUPS = ("qkv", "o", "mlp")
#: How an architecture's config.json spells a sliding window: ``none`` (it has none), ``all_layers``
#: (``sliding_window`` applies to every layer, Mistral), ``layer_types`` (``use_sliding_window``,
#: ``sliding_window`` and ``layer_types`` or ``max_window_layers``, Qwen2), ``typed`` (``sliding_window`` on the
#: layers ``layer_types`` marks, by default all but every ``window_pattern``-th: Gemma 2 / 3).
WINDOW_SPELLINGS = ("none", "all_layers", "layer_types", "typed")


def _suggest(key: str, valid) -> str:
    close = difflib.get_close_matches(key, sorted(valid), n=1)
    return f" (did you mean '{close[0]}'?)" if close else f" (valid: {', '.join(sorted(valid))})"


def _check_keys(source: str, where: str, table: dict, valid: set[str]) -> None:
    for key in table:
        if key not in valid:
            raise MappingError(f"{source}: unknown key '{key}' in {where}{_suggest(key, valid)}")
