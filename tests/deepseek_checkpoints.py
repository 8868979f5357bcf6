"""Tiny DeepSeek-V3 and DeepSeek-V2-Lite-shaped checkpoints made by transformers itself (fp32), with an MTP layer
added as the real V3 release stores it (``model.layers.{L}.*``: a MoE decoder layer plus enorm, hnorm, eh_proj,
shared_head.norm and copies of the embedding and head).

``fill="position"`` gives every element a value coding its tensor and position (a misplaced element fails a
bit-exact check); ``fill="random"`` seeded weights for logits checks (norms around 1, a non-zero router bias).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

#: num_experts_per_tok = 2 * topk_group: megatron-core ranks groups as transformers does (deepseek-v3.md section 6).
V3_DIMS = dict(vocab_size=128, hidden_size=64, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
               routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, v_head_dim=8,
               qk_nope_head_dim=8, n_group=2, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
               norm_topk_prob=True, max_position_embeddings=64, tie_word_embeddings=False,
               num_nextn_predict_layers=1, rms_norm_eps=1e-6)
#: DeepSeek-V2-Lite's shape, small: no q LoRA (q_proj), softmax greedy routing, no renormalisation.
V2_LITE_DIMS = dict(vocab_size=128, hidden_size=64, intermediate_size=48, moe_intermediate_size=16,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
                    n_routed_experts=8, routed_scaling_factor=1.0, kv_lora_rank=16, q_lora_rank=None,
                    qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=8, n_group=1, topk_group=1,
                    topk_method="greedy", num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=False,
                    max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-6)


def build_model(kind: str, **overrides):
    """transformers' own ``DeepseekV3ForCausalLM`` (``kind="v3"``) or ``DeepseekV2ForCausalLM`` (``"v2"``), fp32."""
    from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,
                              DeepseekV3ForCausalLM)
    if kind == "v3":
        return DeepseekV3ForCausalLM(DeepseekV3Config(**{**V3_DIMS, **overrides})).float()
    return DeepseekV2ForCausalLM(DeepseekV2Config(**{**V2_LITE_DIMS, **overrides})).float()


def _fill(model, fill: str, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(model.state_dict().items())):
            if fill == "position":
                values = (i + 1) + torch.arange(p.numel(), dtype=torch.float64) / (4 * p.numel())
                p.copy_(values.reshape(p.shape).to(p.dtype))
            elif "e_score_correction_bias" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2 + (1.0 if "norm" in name else 0.0))


def add_mtp_layer(folder: str, seed: int = 1, fill: str = "random") -> None:
    """Append MTP layer ``L`` to ``folder``'s model.safetensors as the V3 release stores it."""
    path = os.path.join(folder, "model.safetensors")
    config = json.load(open(os.path.join(folder, "config.json")))
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    last = f"model.layers.{layers - 1}."
    extra = {}
    for name, value in tensors.items():
        if name.startswith(last):
            extra[name.replace(last, f"model.layers.{layers}.", 1)] = value
    extra.update({f"model.layers.{layers}.enorm.weight": torch.ones(hidden),
                  f"model.layers.{layers}.hnorm.weight": torch.ones(hidden),
                  f"model.layers.{layers}.eh_proj.weight": torch.zeros(hidden, 2 * hidden),
                  f"model.layers.{layers}.shared_head.norm.weight": torch.ones(hidden)})
    for i, (name, value) in enumerate(sorted(extra.items())):
        if fill == "position":
            extra[name] = (100 + i) + torch.arange(value.numel(), dtype=torch.float64).reshape(value.shape).float() / (
                4 * value.numel())
        else:
            extra[name] = torch.randn(value.shape, generator=generator) * 0.2 + (1.0 if "norm" in name else 0.0)
    extra[f"model.layers.{layers}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    extra[f"model.layers.{layers}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **extra}, path, metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def save_tiny(folder: str, kind: str = "v3", fill: str = "random", mtp: bool | None = None, seed: int = 0,
              **overrides) -> str:
    """Save a tiny DeepSeek model with transformers' ``save_pretrained`` (one model.safetensors) and, for V3 by
    default, an MTP layer as the release stores it; returns ``folder``."""
    model = build_model(kind, **overrides)
    _fill(model, fill, seed)
    model.save_pretrained(folder)
    if mtp if mtp is not None else kind == "v3":
        add_mtp_layer(folder, seed + 1, fill)
    elif kind == "v3":
        config = json.load(open(os.path.join(folder, "config.json")))
        config["num_nextn_predict_layers"] = 0
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
    return folder


def logits(folder: str, tokens: list[int] | None = None) -> torch.Tensor:
    """transformers' logits of the HF model in ``folder`` (fp32, eager attention) on ``tokens``."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    ids = torch.tensor([tokens or [3, 17, 5, 99, 42, 7, 64, 1, 88, 23]])
    with torch.no_grad():
        return model(ids).logits[0]
