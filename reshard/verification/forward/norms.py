"""The reference decoder's norms: HF RMSNorm (Gemma's ``1 + w`` offset in fp32), OLMo 2 / 3's whole-projection q / k
RMSNorm (sum of squares all-reduced over TP), LayerNorm (Nemotron's LayerNorm1P offset), and the family's choice."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reshard.errors import ReshardError
from reshard.verification.forward.rank_weights import DecoderConfig
from reshard.verification.forward.tp_group import TPGroup


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
