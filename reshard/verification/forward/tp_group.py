"""The tensor-parallel group a reference decoder runs over (sum all-reduce, last-dim all-gather); size 1 needs no
process group."""

from __future__ import annotations

import torch
import torch.distributed as dist


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
