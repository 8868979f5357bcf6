"""A reference decoder with Megatron-style tensor parallelism (pure torch + torch.distributed), composed from the
features a family's ``[decoder]`` table declares (:class:`~reshard.mapping.DecoderFeatures`), never from its name.

Per rank: vocab-parallel embedding (ids outside the rank's rows masked to zero, then all-reduce), plus the learned
position embedding (``position = "learned"``, whole on every rank); then per layer (pre-norm residual blocks)::

    x = x + o_proj(attention(rope(qn(q(n1(x)))), rope(kn(k(n1(x)))), v(n1(x))))    # one all-reduce after o_proj
    x = x + down(act(gate(n2(x))) * up(n2(x)))    mlp = "gated"              # one all-reduce after down
    x = x + down(act(up(n2(x))))                   mlp = "plain"

``norm``: ``rms`` (HF order: ``weight * (x * rsqrt(mean(x^2) + eps))``) or ``layer`` (LayerNorm, optional bias);
``act``: silu, gelu, gelu_tanh, relu, relu2 (relu squared); ``qn`` / ``kn``: an RMSNorm over each head's
``head_dim`` (``qk_norm``, Qwen3, Gemma 3), else identity; ``rope``: identity with learned positions. Gemma: norms
apply ``1 + w`` in fp32 (``norm_offset``; for a LayerNorm, Nemotron's LayerNorm1P, ``F.layer_norm`` with ``1 + w``),
the embedding is times sqrt(hidden), sandwich norms wrap each block's output before the residual add (``x = x +
norm(attention(...))``), scores are scaled by ``query_scale ** -0.5`` and soft-capped (``cap * tanh(s / cap)``, also
the logits), sliding layers use ``rope_local_theta``. Granite: the embedding times ``embedding_multiplier``, each
block's output times ``residual_multiplier`` before the residual add, scores times ``attention_multiplier`` (instead
of ``head_dim ** -0.5``), the logits divided by ``logits_scaling``. OLMo 2 / 3: post-norm blocks (no
pre-norms, only the output norms), q / k RMSNorm over the whole projection (sum of squares all-reduced over TP).
Column-parallel q/k/v (local heads, optional biases), rotate-half RoPE with ``rope_theta`` and ``rope_scaling``
(:mod:`.rope`; partial rotary: the first ``rope_dim`` dims of each head rotate, the rest pass), causal attention
with GQA (local q head j reads local KV head ``j // (local q heads / local KV heads)``) and an optional sliding
window; final norm; vocab-parallel head whose logits are all-gathered over the padded vocab. Row-parallel biases are
added once, after the all-reduce. Everything is computed in ``compute_dtype`` (fp32 by default). Weights that the
features need must be present and weights no feature uses must be absent (:func:`.layer_checks.check_features`).

Multi-head latent attention (DeepSeek-V2 / V3, ``kv_lora_rank > 0``), computed naively as transformers does (not
absorbed)::

    q = q_b(rms(q_a(x)))  or  q(x)                 per local head [q_nope(dn) | q_rope(dr)]
    [latent(rkv) | k_rope(dr)] = kv_a(x);  latent = rms(latent)
    kv_b(latent)                                   per local head [k_nope(dn) | v(dv)]
    attention([q_nope | rope(q_rope)], [k_nope | rope(k_rope)], v) * (dn + dr) ** -0.5 * m ** 2;  o; all-reduce

RoPE there rotates interleaved pairs (2i, 2i+1) of the dr dims (one k_rope shared by every head), the MLA norms
use eps 1e-6 (transformers' ``DeepseekV3RMSNorm`` default, whatever ``rms_norm_eps``), and yarn's ``mscale_all_dim``
gives ``m`` (1 otherwise). q_a / kv_a held as row blocks (Megatron's local spec) are applied per rank and their
outputs all-gathered. Routing (:func:`route`): softmax or sigmoid scores in fp32, a selection bias added for the
choice only, group-limited top-k, the chosen unbiased scores renormalised when the family does, times
``router_scaling``; shared experts are added unscaled (gated only with ``shared_expert_gate``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reshard.errors import ReshardError
from reshard.verification.forward import cohere_ops, llama4_layer, ministral3_ops
from reshard.verification.forward import gpt_oss_ops
from reshard.verification.forward import gated_deltanet, mamba2
from reshard.verification.forward.layer_checks import ACTIVATION_FUNCTIONS, check_features
from reshard.verification.forward.rank_weights import DecoderConfig, LayerWeights, RankWeights
from reshard.verification.forward.rope import apply_rope, mla_softmax_scale, rope_cos_sin, rotate_pairs


class TPGroup:
    """The tensor-parallel group a decoder runs over; ``size == 1`` needs no process group at all."""

    def __init__(self, size: int = 1, group=None):
        self.size, self.group = size, group

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass
class ForwardOutput:
    """Gathered logits over the padded vocab, and the full hidden state after each sub-block."""

    logits: torch.Tensor  # [batch, seq, padded vocab]
    states: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # (block name, hidden [b, s, H])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """HF's RMSNorm: ``weight * normed(x)`` in x's dtype; ``offset`` (Gemma): ``normed(x) * (1 + weight)`` in fp32,
    then cast."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (1.0 + weight.float())).to(dtype)
    return weight * h.to(dtype)


def projection_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, tp: TPGroup) -> torch.Tensor:
    """OLMo 2 / 3's q / k RMSNorm over the whole projection (all heads together, before the head split), weight
    multiplied in fp32 before the cast (``Olmo2RMSNorm``). ``weight`` is the whole ``[heads * head_dim]`` norm (vLLM
    keeps it whole on every rank); a rank holding a block of the heads takes its slice of the weight and the sum of
    squares is all-reduced over the group, so the mean is over the whole projection."""
    dtype, width, total = x.dtype, x.shape[-1], weight.numel()
    h = x.to(torch.float32)
    if width == total:
        return (weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(dtype)
    if tp.size * width != total:
        raise ReshardError(f"a whole-projection q/k norm of {total} over {tp.size} ranks holding {width} each")
    rank = dist.get_rank(group=tp.group)
    square_sum = tp.all_reduce(h.pow(2).sum(-1, keepdim=True))
    h = h * torch.rsqrt(square_sum / total + eps)
    return (weight[rank * width:(rank + 1) * width].float() * h).to(dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               offset: bool = False) -> torch.Tensor:
    """LayerNorm; ``offset`` (Nemotron's LayerNorm1P): the weight applied as ``1 + w``."""
    return F.layer_norm(x, (x.shape[-1],), weight + 1.0 if offset else weight, bias, eps)


def norm(config: DecoderConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The family's norm (``config.norm``) of ``x``."""
    if config.norm == "rms":
        return rms_norm(x, weight, config.eps, config.norm_offset)
    return layer_norm(x, weight, bias, config.eps, config.norm_offset)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


def attention_mask(seq_len: int, window: int | None, device) -> torch.Tensor:
    """True where query i may attend key j: ``j <= i`` (and ``j > i - window`` with a sliding window)."""
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    allowed = j <= i
    if window:
        allowed &= j > i - window
    return allowed


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


def attention(x: torch.Tensor, w: LayerWeights, config: DecoderConfig, cos, sin, mask, tp: TPGroup) -> torch.Tensor:
    if config.gdn and (gated_deltanet.is_gdn(w) or gated_deltanet.gated(w, config)):  # Qwen3-Next
        return gated_deltanet.mixer(x, w, config, cos, sin, mask, tp, attention)
    if config.mla:
        return mla_attention(x, w, config, cos, sin, mask, tp)
    if w.sinks is not None:  # gpt-oss: a sink logit per head joins the softmax
        return gpt_oss_ops.attention(x, w, config, cos, sin, mask, tp)
    b, s, _ = x.shape
    d = config.head_dim
    q = _linear(x, w.q, w.q_bias)
    k = _linear(x, w.k, w.k_bias)
    whole = config.qk_norm and w.q_norm.numel() != d  # OLMo 2 / 3: q_norm [heads * d] over the whole projection
    if whole:
        q = projection_rms_norm(q, w.q_norm, config.eps, tp)
        k = projection_rms_norm(k, w.k_norm, config.eps, tp)
    q, k = q.view(b, s, -1, d), k.view(b, s, -1, d)
    if config.qk_norm and not whole:
        q = rms_norm(q, w.q_norm, config.eps, config.norm_offset)
        k = rms_norm(k, w.k_norm, config.eps, config.norm_offset)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = _linear(x, w.v, w.v_bias).view(b, s, -1, d).transpose(1, 2)
    if config.position == "rope":
        rope = rotate_pairs if config.rope_interleaved else apply_rope  # pairs: Ernie 4.5, Megatron rotary_interleaved
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        q = ministral3_ops.scale_queries(config, q)  # Ministral 3's llama_4_scaling_beta
    local_q, local_kv = q.shape[1], k.shape[1]
    if local_q % local_kv:
        raise ReshardError(f"rank holds {local_q} query heads and {local_kv} KV heads: not a GQA grouping")
    k = k.repeat_interleave(local_q // local_kv, dim=1)
    v = v.repeat_interleave(local_q // local_kv, dim=1)
    scale = config.attention_multiplier or (config.query_scale or d) ** -0.5
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if config.attn_softcap:
        scores = torch.tanh(scores / config.attn_softcap) * config.attn_softcap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, local_q * d)
    out = tp.all_reduce(_linear(out, w.o))
    return out + w.o_bias if w.o_bias is not None else out


def route(x: torch.Tensor, router: torch.Tensor, config: DecoderConfig,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) ``[tokens, k]`` each. Router logits in fp32 (at least), scored by softmax over every
    expert or sigmoid; the choice ranks ``scores + bias`` (the selection bias, if any); with ``router_groups > 1``
    only the ``router_group_topk`` groups with the best group score compete (``topN_sum``: the sum of a group's N
    best choice scores, ``max``: its best); the weights are the chosen experts' unbiased scores, renormalised to
    sum to 1 when the family does (+ 1e-20 for sigmoid, as transformers), times ``router_scaling``; cast to x's
    dtype."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    logits = F.linear(x.to(dtype), router.to(dtype))
    scores = torch.softmax(logits, dim=-1) if config.router_score == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.to(dtype)
    if config.router_groups > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, config.router_groups, experts // config.router_groups)
        if config.router_group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            best = int(config.router_group_score.removeprefix("top").removesuffix("_sum"))
            group_scores = grouped.topk(best, dim=-1)[0].sum(dim=-1)
        kept = torch.topk(group_scores, k=config.router_group_topk, dim=-1, sorted=False)[1]
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        allowed = allowed.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
        choice = choice.masked_fill(~allowed, float("-inf"))
    chosen = torch.topk(choice, config.experts_per_token, dim=-1, sorted=False)[1]
    weights = scores.gather(1, chosen)
    if config.router_groups > 1:  # more experts asked for than the kept groups hold: the others weigh nothing
        weights = weights.masked_fill(choice.gather(1, chosen) == float("-inf"), 0.0)
    if config.router_renormalize:
        eps = 1e-20 if config.router_score == "sigmoid" else 0.0
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    if config.router_scaling != 1.0:
        weights = weights * config.router_scaling
    return weights.to(x.dtype), chosen


def moe(x: torch.Tensor, w: LayerWeights, config: DecoderConfig, tp: TPGroup) -> torch.Tensor:
    """A Mixture-of-Experts MLP: each token's top-k experts (SwiGLU), weighted by the router, plus the shared
    expert (times ``sigmoid(x @ shared_expert_gate)`` when it has a gate); this rank's partial sums, all-reduced
    once."""
    if config.llama4:  # the routing weight on the expert input
        return llama4_layer.moe(x, w, config, tp)
    if config.gpt_oss:  # router and expert biases, clamped SwiGLU
        return gpt_oss_ops.moe(x, w, config, tp)
    act = ACTIVATION_FUNCTIONS[config.activation]
    flat = x.reshape(-1, x.shape[-1])
    weights, chosen = route(flat, w.router, config, w.router_bias)
    out = torch.zeros_like(flat)
    for expert, (gate, up, down) in w.experts.items():
        token, slot = torch.nonzero(chosen == expert, as_tuple=True)
        if token.numel():
            h = act(_linear(flat[token], gate)) * _linear(flat[token], up)
            out.index_add_(0, token, _linear(h, down) * weights[token, slot, None])
    if w.shared_up is not None:
        shared = _linear(act(_linear(flat, w.shared_gate)) * _linear(flat, w.shared_up), w.shared_down)
        if w.shared_expert_gate is not None:
            shared = shared * torch.sigmoid(_linear(flat, w.shared_expert_gate))
        out = out + shared
    return tp.all_reduce(out).reshape(x.shape)


def mlp(x: torch.Tensor, w: LayerWeights, config: DecoderConfig, tp: TPGroup) -> torch.Tensor:
    if w.router is not None:
        return moe(x, w, config, tp)
    act = ACTIVATION_FUNCTIONS[config.activation]
    if config.mlp == "gated":
        h = act(_linear(x, w.gate, w.gate_bias)) * _linear(x, w.up, w.up_bias)
    else:
        h = act(_linear(x, w.up, w.up_bias))
    out = tp.all_reduce(_linear(h, w.down))
    return out + w.down_bias if w.down_bias is not None else out


def embed(ids: torch.Tensor, table: torch.Tensor, start: int, tp: TPGroup) -> torch.Tensor:
    local = ids - start
    outside = (local < 0) | (local >= table.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), table)
    out = out.masked_fill(outside[..., None], 0.0)
    return tp.all_reduce(out)


def cast(t: torch.Tensor | None, dtype: torch.dtype, device) -> torch.Tensor | None:
    return None if t is None else t.to(device=device, dtype=dtype)


def cast_layer(layer: LayerWeights, dtype: torch.dtype, device) -> LayerWeights:
    """Move and cast every tensor of ``layer`` (in place, one at a time: each stored tensor is dropped as soon as
    its cast copy exists); a router's selection bias stays in fp32 at least (the router computes in fp32)."""
    for name in layer.__dataclass_fields__:
        if name != "experts":
            to = torch.promote_types(dtype, torch.float32) if name == "router_bias" else dtype
            setattr(layer, name, cast(getattr(layer, name), to, device))
    layer.experts = {e: tuple(cast(t, dtype, device) for t in parts) for e, parts in layer.experts.items()}
    return layer


def cast_weights(weights: RankWeights, dtype: torch.dtype, device) -> RankWeights:
    """Move and cast every tensor of ``weights`` (in place) for computation."""
    for name in ("embedding", "final_norm", "final_norm_bias", "lm_head", "position_embedding"):
        setattr(weights, name, cast(getattr(weights, name), dtype, device))
    for layer in weights.layers:
        cast_layer(layer, dtype, device)
    return weights


@dataclass
class LayerInputs:
    """What every layer of one run shares: RoPE tables (global and sliding-window) and attention masks."""

    rope: tuple[torch.Tensor, torch.Tensor]
    local_rope: tuple[torch.Tensor, torch.Tensor]
    full: torch.Tensor
    windowed: torch.Tensor

    @classmethod
    def build(cls, config: DecoderConfig, ids: torch.Tensor, dtype: torch.dtype) -> "LayerInputs":
        seq = ids.shape[1]
        rope = rope_cos_sin(config, seq, ids.device, dtype)
        local = rope if config.rope_local_theta is None else rope_cos_sin(config, seq, ids.device, dtype, local=True)
        return cls(rope, local, attention_mask(seq, None, ids.device),
                   attention_mask(seq, config.sliding_window, ids.device))


def embed_tokens(config: DecoderConfig, ids: torch.Tensor, table: torch.Tensor, start: int,
                 positions: torch.Tensor | None, tp: TPGroup) -> torch.Tensor:
    """The hidden state entering layer 0 (vocab-parallel lookup, Gemma's scaling, learned positions)."""
    x = embed(ids, table, start, tp)
    if config.embedding_scaled:
        x = x * torch.tensor(config.hidden ** 0.5, dtype=x.dtype)
    if config.embedding_multiplier != 1.0:
        x = x * config.embedding_multiplier
    if positions is not None:
        x = x + positions[:ids.shape[1]]
    return x


def _residual(config: DecoderConfig, h: torch.Tensor) -> torch.Tensor:
    """A block's output as added to the residual stream (Granite: times ``residual_multiplier``)."""
    return h * config.residual_multiplier if config.residual_multiplier != 1.0 else h


def _pre_norm(config: DecoderConfig, x: torch.Tensor, weight: torch.Tensor | None,
              bias: torch.Tensor | None) -> torch.Tensor:
    """A block's input norm; none (identity) in OLMo 2 / 3's post-norm blocks, which hold only output norms
    (:func:`.layer_checks.check_layer` allows a missing pre-norm only with sandwich norms)."""
    return x if weight is None else norm(config, x, weight, bias)


def decoder_layer(config: DecoderConfig, i: int, layer: LayerWeights, x: torch.Tensor, inputs: LayerInputs,
                  tp: TPGroup, states: list | None) -> torch.Tensor:
    """Layer ``i``'s attention and MLP blocks on ``x``; appends the hidden state after each to ``states``."""
    if config.mamba:  # Nemotron-H: one block per layer (Mamba2, attention or MLP)
        return mamba2.decoder_layer(config, i, layer, x, inputs, tp, states, norm, attention, mlp)
    if config.cohere:  # Command-R / Cohere2: one norm, attention and MLP in parallel
        return cohere_ops.decoder_layer(config, i, layer, x, inputs, tp, states, mlp)
    sliding = i in config.window_layers
    cos, sin = inputs.local_rope if sliding else inputs.rope
    h = (functools.partial(llama4_layer.attention, i) if config.llama4 else attention)(_pre_norm(config, x, layer.input_norm, layer.input_norm_bias), layer, config, cos, sin,
                  inputs.windowed if sliding else inputs.full, tp)
    x = x + _residual(config, norm(config, h, layer.attn_output_norm, None) if config.sandwich_norm else h)
    if states is not None:
        states.append((f"layer {i} attention", x.detach().cpu()))
    h = mlp(_pre_norm(config, x, layer.post_norm, layer.post_norm_bias), layer, config, tp)
    x = x + _residual(config, norm(config, h, layer.mlp_output_norm, None) if config.sandwich_norm else h)
    if states is not None:
        states.append((f"layer {i} mlp", x.detach().cpu()))
    return x


def final_logits(config: DecoderConfig, x: torch.Tensor, final_norm: torch.Tensor,
                 final_norm_bias: torch.Tensor | None, head: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Final norm, the vocab-parallel head gathered over the padded vocab, the final soft-cap; on the CPU."""
    x = norm(config, x, final_norm, final_norm_bias)
    logits = cohere_ops.scale_logits(config, tp.gather_last_dim(_linear(x, head)))
    if config.logits_scaling != 1.0:
        logits = logits / config.logits_scaling
    if config.final_softcap:
        logits = torch.tanh(logits / config.final_softcap) * config.final_softcap
    return logits.cpu()


def forward(weights: RankWeights, ids: torch.Tensor, tp: TPGroup, record: bool = True) -> ForwardOutput:
    """Run the decoder on token ``ids`` ``[batch, seq]``; weights already cast to the compute dtype/device."""
    check_features(weights)
    config = weights.config
    out = ForwardOutput(logits=torch.empty(0))
    states = out.states if record else None
    x = embed_tokens(config, ids, weights.embedding, weights.vocab_start, weights.position_embedding, tp)
    if record:
        states.append(("embedding", x.detach().cpu()))
    inputs = LayerInputs.build(config, ids, weights.embedding.dtype)
    for i, layer in enumerate(weights.layers):
        x = decoder_layer(config, i, layer, x, inputs, tp, states)
    head = weights.embedding if weights.lm_head is None else weights.lm_head
    out.logits = final_logits(config, x, weights.final_norm, weights.final_norm_bias, head, tp)
    return out
