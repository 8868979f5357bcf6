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
Multi-head latent attention: :mod:`.mla`; Mixture-of-Experts routing and experts: :mod:`.moe`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from reshard.errors import ReshardError
from reshard.verification.forward import cohere_ops, llama4_layer, ministral3_ops
from reshard.verification.forward import gated_deltanet, mamba2
from reshard.verification.forward import gpt_oss_ops
from reshard.verification.forward.layer_checks import ACTIVATION_FUNCTIONS, check_features
from reshard.verification.forward.mla import MLA_NORM_EPS, mla_attention, mla_down  # noqa: F401 (re-exported)
from reshard.verification.forward.moe import moe, route  # noqa: F401 (re-exported)
from reshard.verification.forward.norms import layer_norm, norm, projection_rms_norm, rms_norm  # noqa: F401
from reshard.verification.forward.rank_weights import DecoderConfig, LayerWeights, RankWeights
from reshard.verification.forward.rope import apply_rope, rope_cos_sin, rotate_pairs
from reshard.verification.forward.tp_group import TPGroup


@dataclass
class ForwardOutput:
    """Gathered logits over the padded vocab, and the full hidden state after each sub-block."""

    logits: torch.Tensor  # [batch, seq, padded vocab]
    states: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # (block name, hidden [b, s, H])


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
