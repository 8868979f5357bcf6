"""The reference decoder's Mixture-of-Experts MLP (SwiGLU experts, this rank's partial sums all-reduced once).
Routing (:func:`route`): softmax or sigmoid scores in fp32, a selection bias added for the choice only, group-limited
top-k, the chosen unbiased scores renormalised when the family does, times ``router_scaling``; shared experts are
added unscaled (gated only with ``shared_expert_gate``). Llama 4 and gpt-oss experts: :mod:`.llama4_layer`,
:mod:`.gpt_oss_ops`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.functional import linear as _linear

from reshard.verification.forward import gpt_oss_ops, llama4_layer
from reshard.verification.forward.layer_checks import ACTIVATION_FUNCTIONS
from reshard.verification.forward.rank_weights import DecoderConfig, LayerWeights
from reshard.verification.forward.tp_group import TPGroup

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
