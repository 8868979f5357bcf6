"""Synthetic Llama, Mixtral, DeepSeek-V3 and Qwen2.5-VL checkpoints for scripts/bench.py: shapes for a requested
size, the streaming bf16 safetensors writer, and the cached source directory (``ensure_source``)."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

GIB = 1 << 30
MIB = 1 << 20
# Bump when the generated data or layout changes, so that cached sources are rebuilt.
GENERATOR_VERSION = 1

# --------------------------------------------------------------------------------------
# Synthetic Llama shapes
# --------------------------------------------------------------------------------------

HIDDEN_CANDIDATES = (8192, 4096, 2048, 1024, 512, 256, 128, 64)
NUM_KV_HEADS = 8
MODELS = ("llama", "mixtral", "wide", "deepseek", "qwen2_5_vl")
WIDE_HIDDEN = 4096  # the "wide" model: one layer whose MLP weights are the largest tensors (1 GiB each at --sizes 3.57)
MIXTRAL_EXPERTS = 8  # Mixtral 8x7B: 8 experts, top-2, every layer sparse
# DeepSeek-V3's shape, narrower: MLA (q LoRA 3/8 hidden, kv LoRA 512 + rope 64, nope / v head dims 64), 16 routed
# experts (FFN hidden/2) and one shared, sigmoid routing with an fp32 bias, one dense first layer (FFN 11/4 hidden)
DEEPSEEK_HIDDEN = (2048, 1024, 512, 256, 128)
DEEPSEEK_EXPERTS = 16
DEEPSEEK_MIN_LAYERS = 8  # the dense layer and at least seven MoE layers
# Qwen2.5-VL-3B's shape, scaled: a Qwen2 language model (head dim 128 from hidden 512 up, 2 KV heads, q/k/v biases)
# and its vision tower "visual." at hidden Hv = 5/8 of the text's (1280 at 2048), FFN Fv = 2.67 Hv (3420 in the
# release; here rounded to a multiple of 16), 16 heads at full width, the depth that makes the tower about this share
# of the bytes (36 blocks at the release's 7 GiB, fewer when scaled down)
VLM_VISION_SHARE = 0.2
VLM_KV_HEADS = 2


def vocab_for_hidden(hidden: int) -> int:
    """Odd vocab size (never a multiple of 128), big enough that the embedding is the
    largest tensor (> intermediate * hidden = 3.5 * hidden**2), capped at 32003."""
    return min(32003, 16 * hidden + 3)


def min_layers_for_hidden(hidden: int) -> int:
    """A width is used only with at least this many layers, so 1, 2 and 4 GiB models share hidden 2048 (16+ layers
    for 4096): the model grows by depth while the largest tensor stays put, which is what "memory flat in
    model size" is measured against."""
    return max(4, hidden * hidden // 2**20)


def model_shapes(hidden: int, layers: int, model: str = "llama") -> dict[str, Any]:
    head_dim = 128 if hidden >= 4096 else hidden // 32
    heads = hidden // head_dim
    return {
        "model": model,
        "experts": MIXTRAL_EXPERTS if model == "mixtral" else 0,
        "hidden_size": hidden,
        "intermediate_size": hidden * 7 // 2,  # Llama-3 ratio; divisible by 8 for every candidate
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": head_dim,
        "vocab_size": vocab_for_hidden(hidden),
    }


def deepseek_model_shapes(hidden: int, layers: int) -> dict[str, Any]:
    heads = max(2, hidden // 128)
    return {
        "model": "deepseek",
        "experts": DEEPSEEK_EXPERTS,
        "shared_experts": 1,
        "hidden_size": hidden,
        "intermediate_size": hidden * 11 // 4,  # the dense first layer's FFN
        "moe_intermediate_size": hidden // 2,
        "first_k_dense_replace": 1,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": 128,  # qk: nope 64 + rope 64
        "q_lora_rank": hidden * 3 // 8,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "vocab_size": vocab_for_hidden(hidden),
    }


def deepseek_specs(shapes: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """DeepSeek-V3's HF tensors (deepseek-v3.md section 3.1), no MTP layer."""
    h, nh, vocab = shapes["hidden_size"], shapes["num_attention_heads"], shapes["vocab_size"]
    rq, rkv, dr = shapes["q_lora_rank"], shapes["kv_lora_rank"], shapes["qk_rope_head_dim"]
    dn, dv, e = shapes["qk_nope_head_dim"], shapes["v_head_dim"], shapes["experts"]
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(shapes["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        specs += [(p + "input_layernorm.weight", (h,)), (a + "q_a_proj.weight", (rq, h)),
                  (a + "q_a_layernorm.weight", (rq,)), (a + "q_b_proj.weight", (nh * (dn + dr), rq)),
                  (a + "kv_a_proj_with_mqa.weight", (rkv + dr, h)), (a + "kv_a_layernorm.weight", (rkv,)),
                  (a + "kv_b_proj.weight", (nh * (dn + dv), rkv)), (a + "o_proj.weight", (h, nh * dv)),
                  (p + "post_attention_layernorm.weight", (h,))]
        m = p + "mlp."
        if i < shapes["first_k_dense_replace"]:
            f = shapes["intermediate_size"]
            specs += [(m + "gate_proj.weight", (f, h)), (m + "up_proj.weight", (f, h)), (m + "down_proj.weight", (h, f))]
            continue
        f = shapes["moe_intermediate_size"]
        specs += [(m + "gate.weight", (e, h)), (m + "gate.e_score_correction_bias", (e,))]
        for x in [f"experts.{g}." for g in range(e)] + ["shared_experts."]:
            width = f * (shapes["shared_experts"] if x == "shared_experts." else 1)
            specs += [(m + x + "gate_proj.weight", (width, h)), (m + x + "up_proj.weight", (width, h)),
                      (m + x + "down_proj.weight", (h, width))]
    return specs + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def vlm_model_shapes(hidden: int, layers: int, depth: int) -> dict[str, Any]:
    """Qwen2.5-VL: the Qwen2 text widths for ``hidden`` / ``layers`` and a vision tower of ``depth`` blocks."""
    head_dim = min(128, hidden // 4)
    hv = max(32, round(hidden * 5 / 8 / 16) * 16)
    return {
        "model": "qwen2_5_vl",
        "experts": 0,
        "hidden_size": hidden,
        "intermediate_size": hidden * 7 // 2,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // head_dim,
        "num_key_value_heads": VLM_KV_HEADS,
        "head_dim": head_dim,
        "vocab_size": vocab_for_hidden(hidden),
        "vision_depth": depth,
        "vision_hidden_size": hv,
        "vision_intermediate_size": max(16, round(hv * 3420 / 1280 / 16) * 16),
        "vision_num_heads": 1 << max(1, min(16, hv // 80).bit_length() - 1),  # a power of 2 in 2..16, head dim ~80
    }


def vision_specs(shapes: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2.5-VL's tower as the Hub stores it (mappings/qwen2_5_vl.toml's [[tower]] entries)."""
    hv, fv, h = shapes["vision_hidden_size"], shapes["vision_intermediate_size"], shapes["hidden_size"]
    specs: list[tuple[str, tuple[int, ...]]] = [("visual.patch_embed.proj.weight", (hv, 3, 2, 14, 14))]
    for b in range(shapes["vision_depth"]):
        p = f"visual.blocks.{b}."
        specs += [(p + "norm1.weight", (hv,)), (p + "norm2.weight", (hv,)),
                  (p + "attn.qkv.weight", (3 * hv, hv)), (p + "attn.qkv.bias", (3 * hv,)),
                  (p + "attn.proj.weight", (hv, hv)), (p + "attn.proj.bias", (hv,)),
                  (p + "mlp.gate_proj.weight", (fv, hv)), (p + "mlp.gate_proj.bias", (fv,)),
                  (p + "mlp.up_proj.weight", (fv, hv)), (p + "mlp.up_proj.bias", (fv,)),
                  (p + "mlp.down_proj.weight", (hv, fv)), (p + "mlp.down_proj.bias", (hv,))]
    return specs + [("visual.merger.ln_q.weight", (hv,)), ("visual.merger.mlp.0.weight", (4 * hv, 4 * hv)),
                    ("visual.merger.mlp.0.bias", (4 * hv,)), ("visual.merger.mlp.2.weight", (h, 4 * hv)),
                    ("visual.merger.mlp.2.bias", (h,))]


def tensor_dtype(name: str) -> str:
    """The stored dtype: BF16, except DeepSeek's router bias (F32, as released)."""
    return "F32" if name.endswith("e_score_correction_bias") else "BF16"


def tensor_bytes(name: str, shape) -> int:
    return math.prod(shape) * (4 if tensor_dtype(name) == "F32" else 2)


def tensor_specs(shapes: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor, in the order they are written."""
    if shapes.get("model") == "deepseek":
        return deepseek_specs(shapes)
    h = shapes["hidden_size"]
    inter = shapes["intermediate_size"]
    hd = shapes["head_dim"]
    q = shapes["num_attention_heads"] * hd
    kv = shapes["num_key_value_heads"] * hd
    vocab = shapes["vocab_size"]
    vlm = shapes.get("model") == "qwen2_5_vl"  # Qwen2: q/k/v biases
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(shapes["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
        if vlm:
            specs += [(p + f"self_attn.{x}_proj.bias", (n,)) for x, n in (("q", q), ("k", kv), ("v", kv))]
        if shapes.get("experts"):  # Mixtral: a router and per-expert w1 (gate), w3 (up), w2 (down)
            m = p + "block_sparse_moe."
            specs.append((m + "gate.weight", (shapes["experts"], h)))
            for e in range(shapes["experts"]):
                specs += [(m + f"experts.{e}.w1.weight", (inter, h)), (m + f"experts.{e}.w2.weight", (h, inter)),
                          (m + f"experts.{e}.w3.weight", (inter, h))]
            continue
        specs += [
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    specs += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return specs + (vision_specs(shapes) if vlm else [])


def param_count(shapes: dict[str, Any]) -> int:
    return sum(math.prod(s) for _, s in tensor_specs(shapes))


def choose_shapes(size_gib: float, model: str = "llama") -> dict[str, Any]:
    """Llama-like (or Mixtral-like: 8 experts per layer) shapes whose bf16 size is close to ``size_gib``: the widest
    hidden size that still leaves a realistic number of layers, then the layer count that best fits."""
    if not size_gib > 0:
        raise ValueError(f"size must be positive, got {size_gib}")
    target_params = size_gib * GIB / 2
    if model == "wide":
        return wide_shapes(target_params)
    if model == "deepseek":
        return deepseek_shapes(target_params)
    if model == "qwen2_5_vl":
        return vlm_shapes(target_params)
    mlps = MIXTRAL_EXPERTS if model == "mixtral" else 1
    for hidden in HIDDEN_CANDIDATES:
        shapes = fit_layers(target_params, hidden, lambda layers: model_shapes(hidden, layers, model), mlps)
        if shapes is not None:
            return shapes
    raise AssertionError("unreachable")


def fit_layers(target_params: float, hidden: int, shapes_of, mlps: int = 1) -> dict[str, Any] | None:
    """The shapes (``shapes_of(layers)``) at ``hidden`` with the layer count closest to ``target_params``, or None
    when that is fewer layers than the hidden size wants (the last candidate is always taken); the FFN width is
    fine-tuned (within 2.5x..4x hidden, a multiple of hidden/8; ``mlps`` MLPs a layer) to close the gap the
    integer layer count leaves."""
    base = param_count(shapes_of(0))
    per_layer = param_count(shapes_of(1)) - base
    layers = max(1, round((target_params - base) / per_layer))
    if layers < min_layers_for_hidden(hidden) and hidden != HIDDEN_CANDIDATES[-1]:
        return None
    shapes = shapes_of(layers)
    step = hidden // 8
    rest = param_count(shapes) - 3 * mlps * hidden * shapes["intermediate_size"] * layers
    inter = (target_params - rest) / (3 * mlps * hidden * layers)
    shapes["intermediate_size"] = int(min(4 * hidden, max(5 * hidden // 2, round(inter / step) * step)))
    return shapes


def wide_shapes(target_params: float) -> dict[str, Any]:
    """Hidden 4096, 1 layer, the FFN width (a multiple of 1024, at least 4 x hidden) that brings the model to
    ``target_params``: at 3.57 GiB the FFN is 131072 and gate / up / down are 1 GiB each in bf16, the tensors
    that decide a converter's memory when it holds whole tensors."""
    shapes = model_shapes(WIDE_HIDDEN, 1, "wide")
    mlp = 3 * WIDE_HIDDEN * shapes["intermediate_size"]
    rest = param_count(shapes) - mlp
    inter = round((target_params - rest) / (3 * WIDE_HIDDEN) / 1024) * 1024
    shapes["intermediate_size"] = int(max(4 * WIDE_HIDDEN, inter))
    return shapes


def deepseek_shapes(target_params: float) -> dict[str, Any]:
    """The widest hidden size of ``DEEPSEEK_HIDDEN`` that leaves at least ``DEEPSEEK_MIN_LAYERS`` layers, then the
    layer count that best fits ``target_params``."""
    for hidden in DEEPSEEK_HIDDEN:
        base = param_count(deepseek_model_shapes(hidden, 1))  # embedding, head, the dense layer
        per_layer = param_count(deepseek_model_shapes(hidden, 2)) - base
        layers = 1 + max(1, round((target_params - base) / per_layer))
        if layers >= DEEPSEEK_MIN_LAYERS or hidden == DEEPSEEK_HIDDEN[-1]:
            return deepseek_model_shapes(hidden, layers)
    raise AssertionError("unreachable")


def vlm_shapes(target_params: float) -> dict[str, Any]:
    """Qwen2.5-VL: the tower's depth for ``VLM_VISION_SHARE`` of ``target_params`` (at least 2 blocks), then the
    text's width and layer count for the rest as for Llama (the widest hidden size with enough layers, its FFN width
    fine-tuned)."""
    for hidden in HIDDEN_CANDIDATES:
        no_blocks = vlm_model_shapes(hidden, 0, 0)
        stem = sum(math.prod(s) for _, s in vision_specs(no_blocks))  # the patch embedding and the merger
        per_block = param_count(vlm_model_shapes(hidden, 0, 1)) - param_count(no_blocks)
        depth = max(2, round((VLM_VISION_SHARE * target_params - stem) / per_block))
        shapes = fit_layers(target_params, hidden, lambda layers: vlm_model_shapes(hidden, layers, depth))
        if shapes is not None:
            return shapes
    raise AssertionError("unreachable")


def deepseek_config(shapes: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's config.json (the release's keys), with ``shapes``' sizes and no MTP layer."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": shapes["hidden_size"],
        "intermediate_size": shapes["intermediate_size"],
        "moe_intermediate_size": shapes["moe_intermediate_size"],
        "num_hidden_layers": shapes["num_hidden_layers"],
        "num_attention_heads": shapes["num_attention_heads"],
        "num_key_value_heads": shapes["num_key_value_heads"],
        "n_shared_experts": shapes["shared_experts"],
        "n_routed_experts": shapes["experts"],
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": shapes["kv_lora_rank"],
        "q_lora_rank": shapes["q_lora_rank"],
        "qk_rope_head_dim": shapes["qk_rope_head_dim"],
        "v_head_dim": shapes["v_head_dim"],
        "qk_nope_head_dim": shapes["qk_nope_head_dim"],
        "topk_method": "noaux_tc",
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 4,
        "moe_layer_freq": 1,
        "first_k_dense_replace": shapes["first_k_dense_replace"],
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "num_nextn_predict_layers": 0,
        "vocab_size": shapes["vocab_size"],
        "use_cache": True,
    }


def vlm_config(shapes: dict[str, Any]) -> dict[str, Any]:
    """Qwen2.5-VL's nested config.json as transformers 5.24 writes it, with ``shapes``' sizes; the special token ids
    are the vocabulary's last six."""
    vocab, hd, layers = shapes["vocab_size"], shapes["head_dim"], shapes["num_hidden_layers"]
    depth = shapes["vision_depth"]
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "bos_token_id": vocab - 6,
        "dtype": "bfloat16",
        "eos_token_id": vocab - 5,
        "image_token_id": vocab - 2,
        "model_type": "qwen2_5_vl",
        "pad_token_id": None,
        "text_config": {
            "attention_dropout": 0.0,
            "bos_token_id": vocab - 6,
            "eos_token_id": vocab - 5,
            "hidden_act": "silu",
            "hidden_size": shapes["hidden_size"],
            "initializer_range": 0.02,
            "intermediate_size": shapes["intermediate_size"],
            "layer_types": ["full_attention"] * layers,
            "max_position_embeddings": 128000,
            "max_window_layers": 70,
            "model_type": "qwen2_5_vl_text",
            "num_attention_heads": shapes["num_attention_heads"],
            "num_hidden_layers": layers,
            "num_key_value_heads": shapes["num_key_value_heads"],
            "pad_token_id": None,
            "rms_norm_eps": 1e-06,
            # M-RoPE: temporal, height, width sections of the head's rotary half ([16, 24, 24] at head dim 128)
            "rope_parameters": {"mrope_section": [hd // 8, hd * 3 // 16, hd * 3 // 16], "rope_theta": 1000000.0,
                                "rope_type": "default"},
            "sliding_window": None,
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": vocab,
        },
        "tie_word_embeddings": False,
        "transformers_version": "5.24.0",
        "video_token_id": vocab - 1,
        "vision_config": {
            "depth": depth,
            "fullatt_block_indexes": sorted({round(i * depth / 4) - 1 for i in range(1, 5)} - {-1}),  # 7 15 23 31 at 32
            "hidden_act": "silu",
            "hidden_size": shapes["vision_hidden_size"],
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": shapes["vision_intermediate_size"],
            "model_type": "qwen2_5_vl_vision",
            "num_heads": shapes["vision_num_heads"],
            "out_hidden_size": shapes["hidden_size"],
            "patch_size": 14,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "tokens_per_second": 2,
            "window_size": 112,
        },
        "vision_end_token_id": vocab - 3,
        "vision_start_token_id": vocab - 4,
    }


def hf_config(shapes: dict[str, Any]) -> dict[str, Any]:
    if shapes.get("model") == "deepseek":
        return deepseek_config(shapes)
    if shapes.get("model") == "qwen2_5_vl":
        return vlm_config(shapes)
    if shapes.get("experts"):
        return {**_llama_config(shapes), "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": shapes["experts"], "num_experts_per_tok": 2, "rope_theta": 1000000.0}
    return _llama_config(shapes)


def _llama_config(shapes: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shapes["hidden_size"],
        "intermediate_size": shapes["intermediate_size"],
        "num_hidden_layers": shapes["num_hidden_layers"],
        "num_attention_heads": shapes["num_attention_heads"],
        "num_key_value_heads": shapes["num_key_value_heads"],
        "head_dim": shapes["head_dim"],
        "vocab_size": shapes["vocab_size"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "max_position_embeddings": 8192,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


def expected_megatron_largest(shapes: dict[str, Any], tp: int) -> int:
    """Largest per-rank tensor (bytes, bf16) of a Megatron-Core TP=tp checkpoint, assuming
    vocab padding to a multiple of 128 * tp and fused QKV / gate+up (linear_fc1)."""
    h = shapes["hidden_size"]
    inter = shapes["intermediate_size"]
    hd = shapes["head_dim"]
    mult = 128 * tp
    padded_vocab = -(-shapes["vocab_size"] // mult) * mult
    if shapes.get("model") == "deepseek":  # embedding, the dense layer's fc1, kv_down (whole on every rank)
        return 2 * max(padded_vocab // tp * h, 2 * inter // tp * h, (shapes["kv_lora_rank"] + 64) * h)
    qkv_rows = (shapes["num_attention_heads"] + 2 * shapes["num_key_value_heads"]) * hd
    candidates = [padded_vocab // tp * h, 2 * inter // tp * h, qkv_rows // tp * h, h * inter // tp]
    if shapes.get("model") == "qwen2_5_vl":  # the tower is kept whole on every rank (Megatron-Bridge's HF modules)
        candidates += [math.prod(s) for _, s in vision_specs(shapes)]
    return 2 * max(candidates)


# --------------------------------------------------------------------------------------
# Streaming safetensors writer
# --------------------------------------------------------------------------------------

PATTERN_ELEMS = 1_048_573  # odd period, so rows of a matrix do not repeat column-aligned


def _f32_pattern(name: str, numel: int) -> np.ndarray:
    """Deterministic small fp32 values (DeepSeek's router bias)."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return (0.01 * rng.standard_normal(min(numel, PATTERN_ELEMS), dtype=np.float32)).astype("<f4")


def _bf16_pattern(name: str, numel: int, is_norm: bool) -> np.ndarray:
    """Deterministic, non-zero bf16 bit patterns (as uint16) for one tensor."""
    n = min(numel, PATTERN_ELEMS)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    vals = rng.standard_normal(n, dtype=np.float32)
    vals = (1.0 + 0.02 * vals) if is_norm else (0.02 * vals)
    bits = (vals.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    bits[(bits & 0x7FFF) == 0] = 0x3C00  # no +-0: 0x3C00 is bf16 0.0078125
    return bits


def _write_tensor_data(f, name: str, shape: tuple[int, ...]) -> None:
    numel = math.prod(shape)
    f32 = tensor_dtype(name) == "F32"
    block = (_f32_pattern(name, numel) if f32 else _bf16_pattern(name, numel, is_norm=len(shape) == 1)).tobytes()
    remaining = tensor_bytes(name, shape)
    while remaining:
        chunk = block if remaining >= len(block) else block[:remaining]
        f.write(chunk)
        remaining -= len(chunk)


def write_safetensors(path: Path, specs: list[tuple[str, tuple[int, ...]]]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in specs:
        nbytes = tensor_bytes(name, shape)
        header[name] = {"dtype": tensor_dtype(name), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for name, shape in specs:
            _write_tensor_data(f, name, shape)
    os.replace(tmp, path)


def plan_shards(
    specs: list[tuple[str, tuple[int, ...]]], shard_limit: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Greedy split into shards of at most ``shard_limit`` bytes (a single larger tensor gets
    its own shard).  The target is capped at half the model so even tiny models get >= 2
    shards and the multi-shard path of the converter is always exercised."""
    total = sum(tensor_bytes(n, s) for n, s in specs)
    target = max(1, min(shard_limit, -(-total // 2)))
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    cur = 0
    for name, shape in specs:
        nbytes = tensor_bytes(name, shape)
        if shards[-1] and cur + nbytes > target:
            shards.append([])
            cur = 0
        shards[-1].append((name, shape))
        cur += nbytes
    return shards


def source_plan(size_gib: float, shard_limit: int, model: str = "llama") -> dict[str, Any]:
    shapes = choose_shapes(size_gib, model)
    shards = plan_shards(tensor_specs(shapes), shard_limit)
    n = len(shards)
    return {
        "generator_version": GENERATOR_VERSION,
        "requested_gib": size_gib,
        "config": hf_config(shapes),
        "shapes": shapes,
        "shards": [
            {"file": f"model-{i + 1:05d}-of-{n:05d}.safetensors", "tensors": [[nm, list(s)] for nm, s in sh]}
            for i, sh in enumerate(shards)
        ],
    }


def _shard_bytes(shard: dict[str, Any]) -> int:
    return sum(tensor_bytes(n, s) for n, s in shard["tensors"])


def marker_matches(marker: Path, plan: dict[str, Any]) -> bool:
    """Whether a cached source's marker file records ``plan`` (what it was made from)."""
    try:
        return json.loads(marker.read_text()) == plan
    except (OSError, ValueError):
        return False


def _cache_valid(src: Path, marker: Path, plan: dict[str, Any]) -> bool:
    if not marker_matches(marker, plan):
        return False
    for shard in plan["shards"]:
        p = src / shard["file"]
        if not p.is_file():
            return False
        # header + data; the header length is not known from the plan, so check the data part
        try:
            with open(p, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
        except (OSError, struct.error):
            return False
        if p.stat().st_size != 8 + n + _shard_bytes(shard):
            return False
    return (src / "config.json").is_file() and (src / "model.safetensors.index.json").is_file()


def ensure_source(cache_dir: Path, size_gib: float, shard_limit: int, log=print,
                  model: str = "llama") -> tuple[Path, dict, bool]:
    """Generate (or reuse) the HF checkpoint of ``model`` for ``size_gib``.  Returns (dir, plan, generated)."""
    plan = source_plan(size_gib, shard_limit, model)
    src = cache_dir / f"{model}-{size_gib:g}GiB"
    marker = cache_dir / f"{model}-{size_gib:g}GiB.json"  # kept outside the checkpoint dir
    if _cache_valid(src, marker, plan):
        return src, plan, False
    log(f"[bench] generating {src} ({size_gib:g} GiB requested) ...")
    marker.unlink(missing_ok=True)
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    for shard in plan["shards"]:
        specs = [(nm, tuple(s)) for nm, s in shard["tensors"]]
        write_safetensors(src / shard["file"], specs)
        for nm, _ in specs:
            weight_map[nm] = shard["file"]
        total += _shard_bytes(shard)
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    (src / "config.json").write_text(json.dumps(plan["config"], indent=2) + "\n")
    os.sync()
    marker.write_text(json.dumps(plan, indent=1) + "\n")
    return src, plan, True
