"""Multi-head latent attention (DeepSeek-V2 / V3, ``kv_lora_rank > 0``), computed naively as transformers does (not
absorbed)::

    q = q_b(rms(q_a(x)))  or  q(x)                 per local head [q_nope(dn) | q_rope(dr)]
    [latent(rkv) | k_rope(dr)] = kv_a(x);  latent = rms(latent)
    kv_b(latent)                                   per local head [k_nope(dn) | v(dv)]
    attention([q_nope | rope(q_rope)], [k_nope | rope(k_rope)], v) * (dn + dr) ** -0.5 * m ** 2;  o; all-reduce

RoPE there rotates interleaved pairs (2i, 2i+1) of the dr dims (one k_rope shared by every head), the MLA norms
use eps 1e-6 (transformers' ``DeepseekV3RMSNorm`` default, whatever ``rms_norm_eps``), and yarn's ``mscale_all_dim``
gives ``m`` (1 otherwise). q_a / kv_a held as row blocks (Megatron's local spec) are applied per rank and their
outputs all-gathered.
"""

from __future__ import annotations

import torch
from torch.nn.functional import linear as _linear

from reshard.errors import ReshardError
from reshard.verification.forward.norms import rms_norm
from reshard.verification.forward.rank_weights import DecoderConfig, LayerWeights
from reshard.verification.forward.rope import mla_softmax_scale, rotate_pairs
from reshard.verification.forward.tp_group import TPGroup

#: transformers' DeepSeek q_a_layernorm / kv_a_layernorm are built without the config's eps.
MLA_NORM_EPS = 1e-6


def mla_down(x: torch.Tensor, w: torch.Tensor, rows: int, what: str, tp: TPGroup) -> torch.Tensor:
    """``x`` through an MLA down projection of ``rows`` outputs, held whole or as this rank's row block (Megatron's
    local spec: a column-parallel linear whose outputs are all-gathered)."""
    out = _linear(x, w)
    if w.shape[0] == rows:
        return out
    if w.shape[0] * tp.size != rows:
        raise ReshardError(f"{what} holds {w.shape[0]} rows on a rank of {tp.size}: neither all {rows} nor a "
                           f"1/{tp.size} row block; the checkpoint does not match its config")
    return tp.gather_last_dim(out)


def mla_attention(x: torch.Tensor, w: LayerWeights, config: DecoderConfig, cos, sin, mask,
                  tp: TPGroup) -> torch.Tensor:
    """Multi-head latent attention over this rank's heads (module docstring); one all-reduce after o."""
    b, s, _ = x.shape
    dn, dr, dv, rkv = config.head_dim, config.rope_head_dim, config.v_head_dim, config.kv_lora_rank
    if w.q_a is not None:
        q = _linear(rms_norm(mla_down(x, w.q_a, config.q_lora_rank, "q_a", tp), w.q_a_norm, MLA_NORM_EPS), w.q_b)
    else:
        q = _linear(x, w.q)
    q = q.view(b, s, -1, dn + dr).transpose(1, 2)
    q_nope, q_rope = torch.split(q, [dn, dr], dim=-1)
    latent, k_rope = torch.split(mla_down(x, w.kv_a, rkv + dr, "kv_a", tp), [rkv, dr], dim=-1)
    latent = rms_norm(latent, w.kv_a_norm, MLA_NORM_EPS)
    k_rope = rotate_pairs(k_rope.view(b, 1, s, dr), cos, sin)
    kv = _linear(latent, w.kv_b).view(b, s, -1, dn + dv).transpose(1, 2)
    heads = q.shape[1]
    if kv.shape[1] != heads:
        raise ReshardError(f"rank holds {heads} query heads but kv_b gives {kv.shape[1]}: not one head split")
    k_nope, v = torch.split(kv, [dn, dv], dim=-1)
    q = torch.cat((q_nope, rotate_pairs(q_rope, cos, sin)), dim=-1)
    k = torch.cat((k_nope, k_rope.expand(-1, heads, -1, -1)), dim=-1)
    scores = torch.matmul(q, k.transpose(2, 3)) * mla_softmax_scale(config)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, heads * dv)
    return tp.all_reduce(_linear(out, w.o))
