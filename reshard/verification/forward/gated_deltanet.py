"""Qwen3-Next's mixers for the forward verifier (families-2.md sections 4.1 and 14.3): the Gated DeltaNet linear
attention of its ``linear_attention`` layers and the gated query of its ``full_attention`` layers, per TP rank.

Gated DeltaNet (transformers' ``Qwen3NextGatedDeltaNet`` with its torch fallback; ``nk`` key heads of ``dk``,
``nv`` value heads of ``dv``, ``r = nv / nk``): ``[q, k, v, z, b, a] = in_proj(x)``; ``[q; k; v]`` through the
depthwise causal conv1d (K taps) and SiLU; q, k L2-normalised per head (eps 1e-6), repeated ``r`` times, q scaled by
``dk ** -0.5``; ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``; per value head the state
``S <- exp(g) S``, ``S <- S + k (beta (v - S^T k))^T``, ``o = S^T q`` (token by token, fp32); ``o`` through the plain
gated RMSNorm ``w * norm(o) * silu(z)`` per head; ``out_proj``, all-reduced. A rank holds whole key heads
(``nk / world`` and their ``r`` value heads each): HF / vLLM's grouped ``in_proj_qkvz`` (per key head
``[q; k; v; z]``) and ``in_proj_ba`` (``[b; a]``), or Megatron's ``in_proj`` sections ``[q; k; v; z; b; a]`` (both
roles then hold the same tensor); conv1d as sections ``[q; k; v]`` of the rank's heads.

Gated query: ``q_proj`` holds per head ``[q_h; gate_h]``; attention runs on the q halves and its output, before
``o_proj``, is multiplied by ``sigmoid(gate)``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from reshard.mapping import with_defaults
from reshard.mapping.sections import layer_mixers
from reshard.verification.forward.rank_weights import LayerWeights


def dims(config) -> dict:
    """The GDN dims of a decoder config (``DecoderConfig.gdn``: nk, nv, dk, dv, gated_query)."""
    return dict(config.gdn or ())


def decoder_fields(model_config: dict, family) -> tuple | None:
    """``DecoderConfig.gdn`` for an HF-style config of ``family`` (None for a family without GDN layers)."""
    if "gdn" not in set((family.layer_kinds or {}).get("values", {}).values()):
        return None
    gated = any(s.gated_query for s in family.weights)
    model_config = with_defaults(family, model_config)
    return tuple(sorted({"nk": int(model_config["linear_num_key_heads"]),
                         "nv": int(model_config["linear_num_value_heads"]),
                         "dk": int(model_config["linear_key_head_dim"]),
                         "dv": int(model_config["linear_value_head_dim"]), "gated_query": gated}.items()))


def is_gdn(w: LayerWeights) -> bool:
    return w.gdn_qkvz is not None


def gated(w: LayerWeights, config) -> bool:
    """A full-attention layer whose q rows hold a gate per head (twice the rows ``o`` takes)."""
    return dims(config).get("gated_query", False) and w.q is not None and w.q.shape[0] == 2 * w.o.shape[1]


def mixer(x: torch.Tensor, w: LayerWeights, config, cos, sin, mask, tp, attention) -> torch.Tensor:
    """The layer's token mixer: GDN, or ``attention`` (decoder.attention) with the gated query."""
    if is_gdn(w):
        return gated_deltanet(x, w, config, tp)
    d = config.head_dim
    heads = w.q.view(-1, 2 * d, w.q.shape[-1])
    ungated = dataclasses.replace(w, q=heads[:, :d].reshape(-1, w.q.shape[-1]),
                                  o=torch.eye(w.o.shape[1], dtype=w.o.dtype, device=w.o.device), o_bias=None)
    out = attention(x, ungated, config, cos, sin, mask, type(tp)())  # the heads' outputs, before o_proj
    gate = torch.matmul(x, heads[:, d:].reshape(-1, w.q.shape[-1]).t())
    out = torch.matmul(out * torch.sigmoid(gate), w.o.t())
    out = tp.all_reduce(out)
    return out + w.o_bias if w.o_bias is not None else out


def _projections(x: torch.Tensor, w: LayerWeights, nk_r: int, nv_r: int, dk: int, dv: int):
    """q, k, v, z ``[b, s, heads * dim]`` and b, a ``[b, s, nv_r]`` from the grouped or the sections form."""
    bsz, s, _ = x.shape
    sizes = [nk_r * dk, nk_r * dk, nv_r * dv, nv_r * dv, nv_r, nv_r]
    if w.gdn_qkvz.shape[0] == sum(sizes):  # Megatron's in_proj: sections, whole for both roles
        return torch.split(torch.matmul(x, w.gdn_qkvz.t()), sizes, dim=-1)
    r = nv_r // nk_r
    qkvz = torch.matmul(x, w.gdn_qkvz.t()).view(bsz, s, nk_r, 2 * dk + 2 * r * dv)
    q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
    b, a = torch.split(torch.matmul(x, w.gdn_ba.t()).view(bsz, s, nk_r, 2 * r), [r, r], dim=-1)
    return tuple(t.reshape(bsz, s, -1) for t in (q, k, v, z, b, a))


def _l2norm(t: torch.Tensor) -> torch.Tensor:
    return t * torch.rsqrt((t * t).sum(dim=-1, keepdim=True) + 1e-6)


def delta_rule(q, k, v, g, beta) -> torch.Tensor:
    """The gated delta rule token by token (fp32): q, k ``[b, h, s, dk]``, v ``[b, h, s, dv]``, g, beta
    ``[b, h, s]``; returns ``[b, h, s, dv]``."""
    q = _l2norm(q) * q.shape[-1] ** -0.5
    k = _l2norm(k)
    state = q.new_zeros(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1])
    out = torch.zeros_like(v)
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        remembered = (state * k[:, :, t, :, None]).sum(dim=-2)
        delta = (v[:, :, t] - remembered) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (state * q[:, :, t, :, None]).sum(dim=-2)
    return out


def gated_deltanet(x: torch.Tensor, w: LayerWeights, config, tp) -> torch.Tensor:
    g = dims(config)
    dk, dv = g["dk"], g["dv"]
    nv_r = w.gdn_a_log.numel()
    nk_r = nv_r * g["nk"] // g["nv"]
    bsz, s, _ = x.shape
    q, k, v, z, b, a = _projections(x, w, nk_r, nv_r, dk, dv)
    mixed = torch.cat([q, k, v], dim=-1).transpose(1, 2)
    taps = w.gdn_conv.shape[-1]
    mixed = F.silu(F.conv1d(mixed, w.gdn_conv, padding=taps - 1, groups=mixed.shape[1])[..., :s]).transpose(1, 2)
    q, k, v = torch.split(mixed, [nk_r * dk, nk_r * dk, nv_r * dv], dim=-1)
    repeat = nv_r // nk_r
    q = q.reshape(bsz, s, nk_r, dk).repeat_interleave(repeat, dim=2)
    k = k.reshape(bsz, s, nk_r, dk).repeat_interleave(repeat, dim=2)
    v = v.reshape(bsz, s, nv_r, dv)
    beta = b.sigmoid()
    decay = -w.gdn_a_log.float().exp() * F.softplus(a.float() + w.gdn_dt_bias)
    out = delta_rule(*(t.transpose(1, 2).float() for t in (q, k, v, decay, beta))).transpose(1, 2).to(x.dtype)
    o = out.float()
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + config.eps)
    o = w.gdn_norm * o.to(x.dtype)
    o = (o * F.silu(z.reshape(bsz, s, nv_r, dv).float())).to(x.dtype)
    return tp.all_reduce(torch.matmul(o.reshape(bsz, s, nv_r * dv), w.gdn_out.t()))


# ------------------------------------------------------------------ a rank sliced from the canonical (TP 1) view

def sliced_spans(config, rank: int, world: int, q_per: int) -> dict:
    """(axis, start, length) of the rank's part of each GDN role split by rows or columns (whole key heads), and of a
    gated query (``2d`` rows per head); conv1d is cut by :func:`sliced_layer`."""
    g = dims(config)
    if not g:
        return {}
    d = config.head_dim
    nk_r, nv_r = g["nk"] // world, g["nv"] // world
    qkvz = nk_r * 2 * g["dk"] + nv_r * 2 * g["dv"]
    spans = {"gdn_qkvz": (0, rank * qkvz, qkvz), "gdn_ba": (0, rank * 2 * nv_r, 2 * nv_r),
             "gdn_a_log": (0, rank * nv_r, nv_r), "gdn_dt_bias": (0, rank * nv_r, nv_r),
             "gdn_out": (1, rank * nv_r * g["dv"], nv_r * g["dv"])}
    if g["gated_query"]:
        spans["q"] = (0, rank * q_per * 2 * d, q_per * 2 * d)
    return spans


def sliced_layer(w: LayerWeights, config, rank: int, world: int) -> LayerWeights:
    """A GDN layer read whole: its conv1d cut to the rank's sections ``[q_t; k_t; v_t]``."""
    if w.gdn_conv is None or world == 1:
        return w
    g = dims(config)
    parts = torch.split(w.gdn_conv, [g["nk"] * g["dk"], g["nk"] * g["dk"], g["nv"] * g["dv"]])
    w.gdn_conv = torch.cat([p.chunk(world)[rank] for p in parts])
    return w


def layer_filter(family, model_config: dict, layers: int):
    """``held(specs, layer)``: the specs a layer of this hybrid holds (by their ``mixer``); every spec for another
    family."""
    mixers = layer_mixers(family, with_defaults(family, model_config), layers)

    def held(specs, layer: int) -> list:
        return [s for s in specs if not s.mixer or layer >= len(mixers) or mixers[layer] == s.mixer]
    return held


def from_megatron(w: LayerWeights, held, config) -> LayerWeights:
    """A Megatron rank's layer in the decoder's form: stored value offsets undone (``out_norm`` holds w - 1) and a
    gated query's rows from Megatron's per-group ``[q heads; gate heads]`` to per head ``[q_h; gate_h]``."""
    for spec in held:
        value = getattr(w, spec.role)
        if spec.megatron_offset and value is not None:
            setattr(w, spec.role, value - spec.megatron_offset)
    if w.q is not None and gated(w, config):
        per_group = config.heads // config.kv_heads
        w.q = w.q.view(-1, 2, per_group, config.head_dim, w.q.shape[-1]).transpose(1, 2).reshape(w.q.shape)
    return w
