"""Row blocks: a target tensor cut along dim 0 into pieces of bounded bytes, each a target tensor of its own.

The executor streams a tensor that does not fit its step budget block by block, in the order of its bytes:
- a tensor split on dim 0 (row-parallel reads, qkv / gate_up packs, vocab padding, a column range of a source
  stored ``[in, out]`` read and transposed, one block of a stacked source): rows ``[r0, r1)``, each op keeping
  the part of its rows that falls in them. Ops in interleaved-RoPE row order (Meta's wq / wk) reorder rows inside
  each head, so their blocks hold whole heads;
- a tensor split on dim 1 (a column slice of a row-parallel weight, or a gather of such slices): rows
  ``[r0, r1)``, every op restricted to the same source rows (:attr:`ReadOp.rows`);
- a stacked target (vLLM's ``[E, rows, cols]`` experts, every op writing one block ``dst_block``): whole blocks
  ``[e0, e1)`` when one block fits, else each block in rows of its own (its dim 0), cut as above.
A tensor read transposed along its dim 1 stays whole (GPT-2's row-parallel Conv1D weights, a ``down_proj`` expert
of Megatron's legacy GroupedMLP view), as does a split past dim 1 (past dim 2 for a
stacked target, which is then cut in whole experts only).
Pure index arithmetic: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import replace

from reshard.core.plan import ReadOp, TargetTensor


def _stacked(tensor: TargetTensor) -> bool:
    return bool(tensor.reads) and all(op.dst_block is not None for op in tensor.reads)


def head_rows(tensor: TargetTensor) -> int:
    """Rows a block keeps together: the head size of interleaved-RoPE ops (their lcm), else 1."""
    return math.lcm(1, *(abs(op.interleave) for op in tensor.reads if op.interleave))


def _rows_cut(reads: list[ReadOp], axis: int) -> bool:
    """Whether ops along ``axis`` (0 or 1, within a block for a stacked tensor) can be cut into row blocks."""
    if axis == 0:
        return not any(op.rows or (op.interleave and (op.dst_start % abs(op.interleave)
                                                       or op.src_start % abs(op.interleave))) for op in reads)
    return axis == 1 and not any(op.transposed or op.interleave or op.rows for op in reads)


def splittable(tensor: TargetTensor) -> bool:
    """Whether ``tensor`` can be cut into row blocks of its dim 0 (a stacked tensor: into whole blocks)."""
    if len(tensor.shape) < 1 or tensor.shape[0] < 2:
        return False
    if _stacked(tensor):
        return True
    return tensor.axis <= 1 and _rows_cut(tensor.reads, tensor.axis)


def row_blocks(tensor: TargetTensor, budget: int) -> list[TargetTensor]:
    """``tensor`` as consecutive blocks of at most ``budget`` bytes each where it can be cut (at least one row,
    or one head of rows, per block); the tensor itself when it fits or cannot be cut."""
    if tensor.nbytes <= budget or not tensor.shape:
        return [tensor]
    if _stacked(tensor):
        return _stacked_blocks(tensor, budget)
    if not splittable(tensor):
        return [tensor]
    return [block(tensor, r0, r1) for r0, r1 in row_spans(tensor.shape[0], tensor.nbytes // tensor.shape[0],
                                                       budget, head_rows(tensor))]


def row_spans(rows: int, row_bytes: int, budget: int, unit: int = 1) -> list[tuple[int, int]]:
    per = max(unit, budget // max(1, row_bytes) // unit * unit)
    return [(r0, min(rows, r0 + per)) for r0 in range(0, rows, per)]


def block(tensor: TargetTensor, r0: int, r1: int) -> TargetTensor:
    """Rows ``[r0, r1)`` of ``tensor`` as a target tensor of ``r1 - r0`` rows (blocks ``[r0, r1)`` of a stacked
    tensor)."""
    shape = (r1 - r0, *tensor.shape[1:])
    if tensor.fill is not None:
        return replace(tensor, shape=shape, reads=[])
    if _stacked(tensor):
        return replace(tensor, shape=shape, reads=[replace(op, dst_block=op.dst_block - r0)
                                                   for op in tensor.reads if r0 <= op.dst_block < r1])
    reads, padded = _cut(tensor.reads, tensor.axis, r0, r1)
    return replace(tensor, shape=shape, reads=reads, has_padding=tensor.has_padding if padded is None else padded)


def _cut(reads: list[ReadOp], axis: int, r0: int, r1: int) -> tuple[list[ReadOp], bool | None]:
    """Ops restricted to rows ``[r0, r1)`` (of the target, or of one block of a stacked target), and whether
    rows of that span are left to padding (None along axis 1: as in the whole tensor)."""
    if axis != 0:
        return [replace(op, rows=(r0, r1)) for op in reads], None
    out = []
    for op in reads:
        lo, hi = max(op.dst_start, r0), min(op.dst_start + op.length, r1)
        if lo < hi:
            out.append(replace(op, src_start=op.src_start + lo - op.dst_start, length=hi - lo, dst_start=lo - r0))
    return out, sum(op.length for op in out) < r1 - r0


def _stacked_blocks(tensor: TargetTensor, budget: int) -> list[TargetTensor]:
    """Whole blocks of a stacked tensor, as many per piece as fit ``budget``; when one block does not fit and its
    ops can be cut (along the block's dim 0 or 1), each block in row blocks of its own."""
    count = tensor.shape[0]
    each = tensor.nbytes // count
    inner = tensor.axis - 1
    if each <= budget or len(tensor.shape) < 2 or tensor.shape[1] < 2 or not _rows_cut(tensor.reads, inner) \
            or tensor.pair_interleaved:  # pairs are reordered within a whole block
        return [block(tensor, e0, e1) for e0, e1 in row_spans(count, each, budget)]
    out = []
    for b in range(count):
        ops = [replace(op, dst_block=0) for op in tensor.reads if op.dst_block == b]
        for r0, r1 in row_spans(tensor.shape[1], each // tensor.shape[1], budget, head_rows(tensor)):
            reads, padded = _cut(ops, inner, r0, r1)
            out.append(replace(tensor, shape=(1, r1 - r0, *tensor.shape[2:]), reads=reads,
                               has_padding=tensor.has_padding or bool(padded)))
    return out
