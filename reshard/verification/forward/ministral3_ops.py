"""The forward verifier's Ministral 3 query scale (families-2.md section 12; reshard/layouts/ministral3_rules.py):
the rotated queries ``[batch, heads, seq, d]`` of positions ``0 .. seq - 1`` times
``1 + beta * ln(1 + floor(pos / original_max_position_embeddings))`` (transformers' ``get_llama_4_attn_scale``),
cast to the queries' dtype; unchanged where the RoPE parameters set no ``llama_4_scaling_beta``."""

from __future__ import annotations

import torch

from reshard.layouts.ministral3_rules import query_scale


def scale_queries(config, q: torch.Tensor) -> torch.Tensor:
    found = query_scale(config.rope_scaling) if config.position == "rope" else None
    if found is None or found[0] == 0.0:
        return q
    beta, n = found
    positions = torch.arange(q.shape[2], device=q.device, dtype=torch.float32)
    scale = 1 + beta * torch.log(1 + torch.floor(positions / n))
    return q * scale[None, None, :, None].to(q.dtype)
