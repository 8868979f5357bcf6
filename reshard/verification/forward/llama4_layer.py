"""The forward verifier's Llama 4 text blocks (``[decoder] variant = "llama4_rules"``; families-2.md section 3.1): the
attention of layer ``i`` with its per-layer rules (RoPE on interleaved pairs or NoPE, the weightless L2 q/k norm,
temperature tuning, the chunked causal mask) and the MoE with the routing weight applied on the expert input, both
on one tensor-parallel rank's weights (q/k rows in HF's interleaved order: a vLLM rank's are un-permuted on read).
:mod:`.decoder` dispatches here when :attr:`DecoderConfig.llama4` is set; the computation is :mod:`.llama4_ops`."""

from __future__ import annotations

import torch

from reshard.errors import ReshardError
from reshard.layouts import llama4_rules
from reshard.verification.forward import llama4_ops as ops
from reshard.verification.forward.layer_checks import ACTIVATION_FUNCTIONS


def _flags(config, i: int) -> dict:
    rules = dict(config.llama4)
    return {"rope": i not in rules["nope_layers"], "qk_norm": rules["qk_l2_norm"] and i not in rules["nope_layers"],
            "chunk": rules["chunk"] if i in rules["chunked_layers"] else None,
            "temperature": rules["temperature"] and i in rules["nope_layers"]}


def attention(i: int, x: torch.Tensor, w, config, cos, sin, mask, tp) -> torch.Tensor:
    """Layer ``i``'s attention block (``cos`` / ``sin``: the decoder's rotate-half tables, whose first half is
    each pair's angle; ``mask`` unused: Llama 4's is chunked per layer)."""
    if any(b is not None for b in (w.q_bias, w.k_bias, w.v_bias, w.o_bias)):
        raise ReshardError("the forward verifier's Llama 4 attention has no q/k/v/o biases (attention_bias)")
    rules = dict(config.llama4)
    half = config.head_dim // 2
    return ops.attention(x, w.q, w.k, w.v, w.o, config.head_dim, _flags(config, i), config.eps, cos[:, :half],
                         sin[:, :half], rules["floor_scale"], rules["attn_scale"], tp.all_reduce)


def moe(x: torch.Tensor, w, config, tp) -> torch.Tensor:
    """Top-k (1) sigmoid routing, each chosen expert fed ``weight * x``, plus the ungated shared expert."""
    shared = (w.shared_gate, w.shared_up, w.shared_down) if w.shared_up is not None else None
    return ops.moe_on_input(x, w.router, w.experts, shared, config.experts_per_token,
                            ACTIVATION_FUNCTIONS[config.activation], tp.all_reduce)


def unpermute_qk(weights, head_dim: int):
    """A vLLM rank's q / k rows (rotate-half order per head, as vLLM permutes them) back in HF's interleaved order."""
    for name in ("q", "k", "q_bias", "k_bias"):
        t = getattr(weights, name)
        if t is not None:
            setattr(weights, name, llama4_rules.vllm_qk_unpermute(t, head_dim))
    return weights
