"""The forward verifier's gpt-oss blocks (families-2.md section 2.1; transformers' modeling_gpt_oss.py), on one
tensor-parallel rank's weights. :mod:`.decoder` dispatches here for a layer holding attention sinks
(:func:`attention`) and for a gpt-oss MoE (:func:`moe`, ``DecoderConfig.gpt_oss`` set).

Attention: GQA with q/k/v biases and rotate-half (yarn) RoPE as the shared decoder computes it, then per local head
its sink logit joins the softmax as one more column, dropped after (``p = softmax([s, sink] - max)[:-1]``); o_proj
all-reduced, its bias added once. The mask (causal, windowed on the sliding layers) is the decoder's.

MoE: router logits ``x·Wᵣᵀ + bᵣ``, top-k, softmax over the chosen k; each expert (this rank's slice of its rows)
``g = min(x·W_gᵀ + b_g, limit)``, ``u = clamp(x·W_uᵀ + b_u, ±limit)``, ``h = (u + 1) · g·σ(α·g)``,
``y = h·W_dᵀ + b_d``, weighted and summed, all-reduced once. ``b_d`` is added once per token and chosen expert, by
the lowest rank holding that expert (:func:`bias_ranks`): rank 0 where every rank holds a slice of every expert (TP:
the other ranks' partial sums carry none, as vLLM's w2_bias), the expert's own rank with expert parallelism (vLLM
``--expert-parallel``: whole experts split over the ranks, each with its w2_bias). Expert tuples are ``(gate, up, down, gate_bias, up_bias, down_bias)``
(:func:`~.rank_weights.expert_parts`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reshard.errors import ReshardError
from reshard.verification.forward.rope import apply_rope


def _heads(t: torch.Tensor, d: int) -> torch.Tensor:
    b, s, _ = t.shape
    return t.view(b, s, -1, d).transpose(1, 2)


def attention(x: torch.Tensor, w, config, cos, sin, mask, tp) -> torch.Tensor:
    """One rank's attention block with sinks (module docstring)."""
    d = config.head_dim
    q = apply_rope(_heads(F.linear(x, w.q, w.q_bias), d), cos, sin)
    k = apply_rope(_heads(F.linear(x, w.k, w.k_bias), d), cos, sin)
    v = _heads(F.linear(x, w.v, w.v_bias), d)
    local_q, local_kv = q.shape[1], k.shape[1]
    if local_q % local_kv or w.sinks.numel() != local_q:
        raise ReshardError(f"rank holds {local_q} query heads, {local_kv} KV heads and {w.sinks.numel()} sinks: "
                           "not one head split")
    k = k.repeat_interleave(local_q // local_kv, dim=1)
    v = v.repeat_interleave(local_q // local_kv, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * d ** -0.5
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    b, _, s, _ = scores.shape
    sinks = w.sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(b, -1, s, 1)
    combined = torch.cat([scores, sinks], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(v.dtype)
    out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, local_q * d)
    out = tp.all_reduce(F.linear(out, w.o))
    return out + w.o_bias if w.o_bias is not None else out


def moe(x: torch.Tensor, w, config, tp) -> torch.Tensor:
    """One rank's gpt-oss MoE block (module docstring)."""
    settings = dict(config.gpt_oss)
    alpha, limit = settings["swiglu_alpha"], settings["swiglu_limit"]
    adds_bias = bias_ranks(w, tp)
    flat = x.reshape(-1, x.shape[-1])
    logits = F.linear(flat, w.router, w.router_linear_bias)
    top, chosen = torch.topk(logits, config.experts_per_token, dim=-1)
    weights = torch.softmax(top, dim=-1, dtype=top.dtype)
    out = torch.zeros_like(flat)
    for expert, parts in w.experts.items():
        if len(parts) != 6:
            raise ReshardError(f"gpt-oss expert {expert} has no biases in the checkpoint (gate, up and down biases)")
        gate_w, up_w, down_w, gate_b, up_b, down_b = parts
        token, slot = torch.nonzero(chosen == expert, as_tuple=True)
        if not token.numel():
            continue
        g = F.linear(flat[token], gate_w, gate_b).clamp(max=limit)
        u = F.linear(flat[token], up_w, up_b).clamp(min=-limit, max=limit)
        y = F.linear((u + 1) * (g * torch.sigmoid(g * alpha)), down_w, down_b if adds_bias[expert] else None)
        out.index_add_(0, token, y * weights[token, slot, None])
    return tp.all_reduce(out).reshape(x.shape)


def bias_ranks(w, tp) -> list[bool]:
    """Per expert (the router's rows), whether this rank adds its down bias: it is the lowest rank of ``tp`` holding
    the expert (one small all-reduce, MIN of the holders' ranks)."""
    experts = w.router.shape[0]
    if tp.size == 1:
        return [True] * experts
    me = torch.distributed.get_rank(group=tp.group)
    holder = torch.full((experts,), tp.size, dtype=torch.int64, device=w.router.device)
    holder[list(w.experts)] = me
    torch.distributed.all_reduce(holder, op=torch.distributed.ReduceOp.MIN, group=tp.group)
    return [int(r) == me for r in holder]
