"""The forward verifier's Command-R / Cohere2 layer (``DecoderConfig.cohere`` set; families-2.md section 8;
transformers' ``modeling_cohere.py`` / ``modeling_cohere2.py``), on one tensor-parallel rank's weights::

    n = LayerNorm(x)                     # one norm, no bias, in fp32 with the weight applied before the cast
    x = x + attention(n) + mlp(n)        # both blocks from the same n; each all-reduced once (o_proj, down)

Attention: q/k/v column-parallel (local heads; biases with ``attention_bias``), Command-R+'s per-head LayerNorm
q/k norms (weights ``[local heads, head_dim]``: a rank's heads, vLLM splits them by heads), RoPE on interleaved
pairs ``(2i, 2i+1)`` (Cohere's ``rotate_half``) on every layer (Command-R) or only on the sliding-window layers
(Cohere2: its full-attention layers are NoPE), GQA, scores times ``head_dim ** -0.5``, causal (windowed on sliding
layers) softmax in fp32. The hidden state is recorded after ``x + attention`` ("layer i attention") and after the
MLP is added ("layer i mlp"). :func:`scale_logits` multiplies the gathered logits by ``logit_scale``."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reshard.errors import ReshardError
from reshard.verification.forward.rope import rotate_pairs


def cohere_layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``CohereLayerNorm``: mean and variance over the last dim in fp32, ``weight`` (broadcast: ``[H]`` or per head
    ``[heads, d]``) multiplied in fp32, then cast back to x's dtype; no bias."""
    h = x.to(torch.float32)
    mean = h.mean(-1, keepdim=True)
    variance = (h - mean).pow(2).mean(-1, keepdim=True)
    return (weight.to(torch.float32) * ((h - mean) * torch.rsqrt(variance + eps))).to(x.dtype)


def rank_heads(weight: torch.Tensor, heads: int, tp) -> torch.Tensor:
    """A per-head norm weight ``[n, d]`` for the rank's ``heads``: as held (vLLM splits it by heads) or this rank's
    block of all of them (a sliced Hugging Face rank reads it whole)."""
    if weight.shape[0] == heads:
        return weight
    if weight.shape[0] != heads * tp.size:
        raise ReshardError(f"a per-head q/k norm of {weight.shape[0]} heads on a rank holding {heads} of "
                           f"{tp.size} ranks: neither the rank's heads nor all of them")
    rank = dist.get_rank(group=tp.group)
    return weight[rank * heads:(rank + 1) * heads]


def attention(x: torch.Tensor, w, config, rotate: bool, cos, sin, mask, tp) -> torch.Tensor:
    """This rank's attention heads on the normed ``x``; one all-reduce after ``o``, its bias added once."""
    b, s, _ = x.shape
    d = config.head_dim
    q = F.linear(x, w.q, w.q_bias).view(b, s, -1, d)
    k = F.linear(x, w.k, w.k_bias).view(b, s, -1, d)
    if config.qk_norm:
        q = cohere_layer_norm(q, rank_heads(w.q_norm, q.shape[2], tp), config.eps)
        k = cohere_layer_norm(k, rank_heads(w.k_norm, k.shape[2], tp), config.eps)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = F.linear(x, w.v, w.v_bias).view(b, s, -1, d).transpose(1, 2)
    if rotate:  # pairs rotated in place, both q and k laid out [evens | odds]: their dot products are unchanged
        q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
    local_q, local_kv = q.shape[1], k.shape[1]
    if local_q % local_kv:
        raise ReshardError(f"rank holds {local_q} query heads and {local_kv} KV heads: not a GQA grouping")
    k = k.repeat_interleave(local_q // local_kv, dim=1)
    v = v.repeat_interleave(local_q // local_kv, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * d ** -0.5
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = tp.all_reduce(F.linear(torch.matmul(probs, v).transpose(1, 2).reshape(b, s, local_q * d), w.o))
    return out + w.o_bias if w.o_bias is not None else out


def decoder_layer(config, i: int, layer, x: torch.Tensor, inputs, tp, states: list | None, mlp) -> torch.Tensor:
    """Layer ``i`` as one parallel block (module docstring); ``mlp`` is the decoder's (gated) MLP function."""
    if layer.post_norm is not None or layer.input_norm_bias is not None:
        raise ReshardError(f"layer {i}: Command-R's block has one bias-free norm, but the checkpoint holds "
                           f"{'a pre-MLP norm' if layer.post_norm is not None else 'a norm bias'}")
    rules = dict(config.cohere)
    sliding = i in config.window_layers
    cos, sin = inputs.rope
    n = cohere_layer_norm(x, layer.input_norm, config.eps)
    rotate = rules["rope_layers"] == "all" or sliding
    x = x + attention(n, layer, config, rotate, cos, sin, inputs.windowed if sliding else inputs.full, tp)
    if states is not None:
        states.append((f"layer {i} attention", x.detach().cpu()))
    x = x + mlp(n, layer, config, tp)
    if states is not None:
        states.append((f"layer {i} mlp", x.detach().cpu()))
    return x


def scale_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """The logits times ``logit_scale`` (Cohere), unchanged for other families."""
    return logits * dict(config.cohere)["logit_scale"] if config.cohere else logits
