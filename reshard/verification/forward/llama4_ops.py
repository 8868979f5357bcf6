"""Llama 4 text's attention and MoE features for the forward verifier (families-2.md section 3.1; transformers'
``modeling_llama4.py``), as functions on the decoder's tensors: interleaved-pair RoPE, the weightless per-head L2
q/k norm (RoPE layers), temperature tuning (NoPE layers), the chunked causal mask, and top-1 sigmoid routing with
the weight applied to the expert *input* plus an ungated shared expert. Tensor parallel: heads and expert FFN
columns split per rank, partial sums all-reduced by the caller's ``all_reduce``.

Building blocks for ``decoder.py`` (not yet dispatched from it; issue 44 item 5)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs ``(x[2i], x[2i+1])`` of the last dim by the angle of pair i (Meta / Llama 4 order).
    ``x`` ``[b, s, heads, d]``; ``cos``/``sin`` ``[s, d/2]``. Computed in fp32 as transformers' complex product."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    c, s_ = cos[None, :, None, :].float(), sin[None, :, None, :].float()
    re, im = pairs[..., 0], pairs[..., 1]
    out = torch.stack((re * c - im * s_, re * s_ + im * c), dim=-1)
    return out.flatten(-2).type_as(x)


def rope_angles(inv_freq: torch.Tensor, seq_len: int, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` ``[s, d/2]`` for positions 0..s-1 (times the rope type's attention scaling)."""
    freqs = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    return torch.cos(freqs) * scaling, torch.sin(freqs) * scaling


def l2_head_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS norm over each head's last dim in fp32 (transformers' ``Llama4TextL2Norm``; megatron-core's
    ``L2Norm``)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def temperature_scale(seq_len: int, floor_scale: float, attn_scale: float, start: int = 0) -> torch.Tensor:
    """Per position, the query multiplier of NoPE layers: ``log1p(floor((pos + 1) / floor_scale)) * attn_scale
    + 1`` (the identity while ``pos + 1 < floor_scale``). ``[s]`` fp32."""
    pos = torch.arange(start, start + seq_len, dtype=torch.float32)
    return torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0


def chunked_mask(seq_len: int, chunk: int | None, device=None) -> torch.Tensor:
    """True where query i may attend key j: ``j <= i`` and, with a chunk, the same block ``i // C == j // C``."""
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    allowed = j <= i
    if chunk:
        allowed &= (i // chunk) == (j // chunk)
    return allowed


def attention(x: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, v_w: torch.Tensor, o_w: torch.Tensor,
              head_dim: int, flags: dict, eps: float, cos, sin, floor_scale: float, attn_scale: float,
              all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> torch.Tensor:
    """One Llama 4 attention block on a rank's heads (``q_w``/``k_w``/``v_w`` this rank's rows in HF's interleaved
    order, ``o_w`` its columns). ``flags``: ``rope``, ``qk_norm``, ``chunk``, ``temperature`` (see
    :func:`reshard.layouts.llama4_rules.layer_flags`)."""
    b, s, _ = x.shape
    q = F.linear(x, q_w).view(b, s, -1, head_dim)
    k = F.linear(x, k_w).view(b, s, -1, head_dim)
    v = F.linear(x, v_w).view(b, s, -1, head_dim).transpose(1, 2)
    if flags["rope"]:
        q, k = rope_interleaved(q, cos, sin), rope_interleaved(k, cos, sin)
    if flags["qk_norm"]:
        q, k = l2_head_norm(q, eps), l2_head_norm(k, eps)
    if flags["temperature"]:
        q = (q * temperature_scale(s, floor_scale, attn_scale).to(q.device)[None, :, None, None]).to(q.dtype)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * head_dim ** -0.5
    scores = scores.masked_fill(~chunked_mask(s, flags["chunk"], x.device), torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1)
    return all_reduce(F.linear(out, o_w))


def route_top1_sigmoid(x: torch.Tensor, router: torch.Tensor, top_k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) ``[tokens, k]``: top-k router logits, weight ``sigmoid(logit)`` (fp32, cast back)."""
    logits = F.linear(x, router)
    top, chosen = torch.topk(logits, top_k, dim=-1)
    return torch.sigmoid(top.float()).to(x.dtype), chosen


def moe_on_input(x: torch.Tensor, router: torch.Tensor, experts: dict[int, tuple[torch.Tensor, ...]],
                 shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, top_k: int = 1,
                 act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> torch.Tensor:
    """Llama 4's MoE: each chosen expert sees ``w * x`` (the routing weight applied to the input); output
    ``shared(x) + sum expert(w * x)``. ``experts``: this rank's ``{e: (gate [I_t, H], up [I_t, H], down [H, I_t])}``;
    ``shared``: (gate, up, down) this rank's slices."""
    flat = x.reshape(-1, x.shape[-1])
    weights, chosen = route_top1_sigmoid(flat, router, top_k)
    out = torch.zeros_like(flat)
    for expert, (gate, up, down) in experts.items():
        token, slot = torch.nonzero(chosen == expert, as_tuple=True)
        if token.numel():
            inp = flat[token] * weights[token, slot, None]
            out.index_add_(0, token, F.linear(act(F.linear(inp, gate)) * F.linear(inp, up), down))
    if shared is not None:
        g, u, d = shared
        out = out + F.linear(act(F.linear(flat, g)) * F.linear(flat, u), d)
    return all_reduce(out).reshape(x.shape)


def dense_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
              act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
              all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> torch.Tensor:
    return all_reduce(F.linear(act(F.linear(x, gate)) * F.linear(x, up), down))
