"""Nemotron-H's layers for the forward verifier (families-2.md sections 10 and 14.3): each layer is one block
``x + mixer(norm(x))`` whose mixer is a Mamba2 mixer, attention without position encoding, or a plain MLP.

Mamba2 (transformers' ``NemotronHMamba2Mixer`` with its torch fallback; ``nm`` heads of ``p``, ``G`` groups of state
``N``): ``[z, xBC, dt] = in_proj(x)``; ``xBC = silu(conv1d(xBC))`` (depthwise, causal, K taps, bias);
``[x, B, C] = xBC``; ``A = -exp(A_log)``, ``dt = clamp(softplus(dt + dt_bias), time_step_limit)``; per head h (group
``h // (nm / G)``) the state ``S <- exp(dt A) S + dt x B^T`` and ``y = S C + D x``, token by token in fp32;
``y * silu(z)`` through the grouped RMSNorm (``G`` groups of ``nm p / G``) times its weight; ``out_proj``,
all-reduced. A rank holds ``nm / T`` heads and ``G / T`` whole groups: ``in_proj`` as ``[z_t; x_t; B_t; C_t; dt_t]``
and ``conv1d`` as ``[x_t; B_t; C_t]`` (vLLM's and Megatron's rank layout); the HF view is cut to it here.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from reshard.errors import ReshardError
from reshard.mapping import with_defaults
from reshard.verification.forward.rank_weights import LayerWeights

MAMBA_ROLES = ("mamba_in", "mamba_conv", "mamba_a_log", "mamba_d", "mamba_dt_bias", "mamba_norm", "mamba_out")


def decoder_fields(model_config: dict, family) -> tuple | None:
    """``DecoderConfig.mamba`` (heads, head dim, groups, state, time-step limit) for an HF-style config of
    ``family``; None for a family without Mamba layers."""
    if "mamba" not in set((family.layer_kinds or {}).get("values", {}).values()):
        return None
    c = with_defaults(family, model_config)
    low, high = c.get("time_step_limit") or (0.0, float("inf"))
    high = float("inf") if isinstance(high, dict) else float(high)  # {"__float__": "Infinity"} as written
    return (int(c["mamba_num_heads"]), int(c["mamba_head_dim"]), int(c["n_groups"]), int(c["ssm_state_size"]),
            float(low), high)


def check_layer(i: int, layer: LayerWeights) -> None:
    """A layer holds exactly one of a Mamba mixer, attention, a plain MLP, and its norm."""
    kinds = [k for k, role in (("mamba", "mamba_in"), ("attention", "q"), ("mlp", "up"))
             if getattr(layer, role) is not None]
    if len(kinds) != 1:
        raise ReshardError(f"layer {i}: a Nemotron-H layer holds one mixer, this one {' and '.join(kinds) or 'none'}")
    needed = {"mamba": MAMBA_ROLES, "attention": ("q", "k", "v", "o"), "mlp": ("up", "down")}[kinds[0]]
    missing = [n for n in needed if getattr(layer, n) is None]
    if missing or (layer.input_norm is None and layer.post_norm is None):
        raise ReshardError(f"layer {i}: the checkpoint has no {(missing or ['norm'])[0]} weight")


def decoder_layer(config, i: int, layer: LayerWeights, x: torch.Tensor, inputs, tp, states, norm, attention,
                  mlp) -> torch.Tensor:
    """Layer ``i``: its one block; appends the hidden state after it to ``states``."""
    h = norm(config, x, layer.input_norm if layer.input_norm is not None else layer.post_norm, None)
    if layer.mamba_in is not None:
        kind, h = "mamba", mixer(h, layer, config, tp)
    elif layer.q is not None:
        kind, h = "attention", attention(h, layer, config, *inputs.rope, inputs.full, tp)
    else:
        kind, h = "mlp", mlp(h, layer, config, tp)
    x = x + h
    if states is not None:
        states.append((f"layer {i} {kind}", x.detach().cpu()))
    return x


def scan(x, dt, a, b, c, d) -> torch.Tensor:
    """The selective scan token by token (fp32): x ``[b, s, h, p]``, dt ``[b, s, h]``, a / d ``[h]``, b / c
    ``[b, s, h, n]`` (each head's group); returns ``[b, s, h, p]``."""
    state = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], b.shape[-1])
    out = torch.empty_like(x)
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * a)[..., None, None]
        state = state * decay + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]
        out[:, t] = (state * c[:, t, :, None, :]).sum(-1) + d[:, None] * x[:, t]
    return out


def mixer(x: torch.Tensor, w: LayerWeights, config, tp) -> torch.Tensor:
    heads, p, groups, n, low, high = config.mamba
    h_r = w.mamba_a_log.numel()
    g_r = groups * h_r // heads
    bsz, s, _ = x.shape
    z, xbc, dt = torch.split(torch.matmul(x, w.mamba_in.t()), [h_r * p, h_r * p + 2 * g_r * n, h_r], dim=-1)
    taps = w.mamba_conv.shape[-1]
    xbc = F.conv1d(xbc.transpose(1, 2), w.mamba_conv, w.mamba_conv_bias, padding=taps - 1, groups=xbc.shape[-1])
    xbc = F.silu(xbc[..., :s]).transpose(1, 2)
    xs, b, c = torch.split(xbc, [h_r * p, g_r * n, g_r * n], dim=-1)
    per_group = h_r // g_r
    b, c = (t.float().reshape(bsz, s, g_r, n).repeat_interleave(per_group, dim=2) for t in (b, c))
    dt = torch.clamp(F.softplus(dt.float() + w.mamba_dt_bias.float()), min=low, max=high)
    a = -torch.exp(w.mamba_a_log.float())
    y = scan(xs.float().reshape(bsz, s, h_r, p), dt, a, b, c, w.mamba_d.float()).reshape(bsz, s, h_r * p)
    y = y * F.silu(z.float())
    y = y.view(bsz, s, g_r, -1)
    y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + config.eps)).view(bsz, s, h_r * p)
    y = w.mamba_norm * y.to(x.dtype)
    return tp.all_reduce(torch.matmul(y.to(x.dtype), w.mamba_out.t()))


# ------------------------------------------------------------------ a rank cut from the canonical (TP 1) view

def _sections(t: torch.Tensor, sizes: list[int], rank: int, world: int) -> torch.Tensor:
    return torch.cat([part.chunk(world)[rank] for part in torch.split(t, sizes)])


def sliced_spans(config, rank: int, world: int) -> dict:
    """(axis, start, length) of the rank's heads in each Mamba role split by rows or columns; in_proj and conv1d
    are read whole and cut by :func:`sliced_layer`."""
    if not config.mamba:
        return {}
    heads, p = config.mamba[:2]
    h_r = heads // world
    return {"mamba_a_log": (0, rank * h_r, h_r), "mamba_d": (0, rank * h_r, h_r),
            "mamba_dt_bias": (0, rank * h_r, h_r), "mamba_norm": (0, rank * h_r * p, h_r * p),
            "mamba_out": (1, rank * h_r * p, h_r * p)}


def sliced_layer(w: LayerWeights, config, rank: int, world: int) -> LayerWeights:
    """A Mamba layer's in_proj and conv1d read whole, cut to rank ``rank`` of ``world`` (module docstring)."""
    if w.mamba_in is None or world == 1:
        return w
    heads, p, groups, n, _, _ = config.mamba
    conv = [heads * p, groups * n, groups * n]
    return dataclasses.replace(
        w, mamba_in=_sections(w.mamba_in, [heads * p] + conv + [heads], rank, world),
        mamba_conv=_sections(w.mamba_conv, conv, rank, world),
        mamba_conv_bias=None if w.mamba_conv_bias is None else _sections(w.mamba_conv_bias, conv, rank, world))


def from_vllm(w: LayerWeights, held) -> LayerWeights:
    """vLLM's ``mixer.A`` (= -exp(A_log), fp32) back to ``A_log`` for :func:`mixer`."""
    for spec in held:
        value = getattr(w, spec.role) if spec.vllm_transform else None
        if value is not None:
            setattr(w, spec.role, torch.log(-value.double()).float())
    return w
