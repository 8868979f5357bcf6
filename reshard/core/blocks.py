"""Row blocks: a target tensor cut along dim 0 into pieces of bounded bytes, each a target tensor of its own.

The executor streams a tensor that does not fit its step budget block by block: rows ``[r0, r1)`` of the target.
For a tensor split on dim 0 (row-parallel reads, qkv / gate_up packs, vocab padding) a block keeps the parts of
the read ops that fall in its rows; for a tensor split on a later axis (a column slice of a row-parallel weight,
or a gather of such slices) every op spans all rows, and a block restricts each op to the same source rows
(:attr:`ReadOp.rows`). Ops that reorder (a transpose, a stacked block, a RoPE row order) and splits past dim 1
keep their tensor whole.
Pure index arithmetic: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import replace

from reshard.core.plan import ReadOp, TargetTensor


def splittable(tensor: TargetTensor) -> bool:
    """Whether ``tensor`` can be cut into row blocks (it has rows, and no op reorders its bytes)."""
    return (len(tensor.shape) >= 1 and tensor.shape[0] > 1 and tensor.axis <= 1
            and not any(op.reordered or op.rows for op in tensor.reads))


def row_blocks(tensor: TargetTensor, budget: int) -> list[TargetTensor]:
    """``tensor`` as consecutive row blocks of at most ``budget`` bytes each (at least one row per block); the
    tensor itself when it fits or cannot be cut."""
    if tensor.nbytes <= budget or not splittable(tensor):
        return [tensor]
    rows = tensor.shape[0]
    per = max(1, budget // (tensor.nbytes // rows))
    return [block(tensor, r0, min(rows, r0 + per)) for r0 in range(0, rows, per)]


def block(tensor: TargetTensor, r0: int, r1: int) -> TargetTensor:
    """Rows ``[r0, r1)`` of ``tensor`` as a target tensor of ``r1 - r0`` rows."""
    shape = (r1 - r0, *tensor.shape[1:])
    if tensor.fill is not None:
        return replace(tensor, shape=shape, reads=[])
    if tensor.axis == 0:
        reads = []
        for op in tensor.reads:
            lo, hi = max(op.dst_start, r0), min(op.dst_start + op.length, r1)
            if lo < hi:
                reads.append(replace(op, src_start=op.src_start + lo - op.dst_start, length=hi - lo,
                                     dst_start=lo - r0))
        covered = sum(op.length for op in reads)
        return replace(tensor, shape=shape, reads=reads, has_padding=covered < r1 - r0)
    return replace(tensor, shape=shape, reads=[replace(op, rows=(r0, r1)) for op in tensor.reads])


def block_count(tensor: TargetTensor, budget: int) -> int:
    if tensor.nbytes <= budget or not splittable(tensor):
        return 1
    rows = tensor.shape[0]
    return math.ceil(rows / max(1, budget // (tensor.nbytes // rows)))
