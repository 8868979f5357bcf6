"""Two tensors read side by side in the same row blocks of bounded bytes: the verifier's streaming read.

A pair of tensors of equal shape (one canonical weight as checkpoint A and checkpoint B hold it, or two stored
copies of a replicated weight) is cut along dim 0 into the same row spans, each block at most ``budget`` bytes
on either side, so block k of A and block k of B hold the same elements and their bytes, concatenated in block
order, are each tensor's row-major bytes. The cutting is the converter's (:mod:`reshard.core.blocks`): whole
heads for interleaved-RoPE ops, source rows restricted for a column slice. A pair that cannot be cut (a tensor
read transposed along its dim 1: GPT-2's row-parallel Conv1D weights from Megatron; a scalar; shapes that
differ) is one block of whole tensors. Pure arithmetic plus positioned reads; no torch unless a block needs a
cast or a transpose (:func:`reshard.io.assemble.assemble`).
"""

from __future__ import annotations

import math

import numpy as np

from reshard.core.blocks import head_rows, row_spans, block, splittable
from reshard.core.plan import ReadOp, TargetTensor
from reshard.io import dtypes
from reshard.io.assemble import assemble
from reshard.io.gather import Gatherer, direct
from reshard.io.readahead import source_extents
from reshard.io.tensorfile import TensorFile


def paired_blocks(a: TargetTensor, b: TargetTensor, budget: int) -> list[tuple[TargetTensor, TargetTensor]]:
    """``(block of a, block of b)`` over the same rows of dim 0, each at most ``budget`` bytes where the pair can
    be cut (at least one row, or one head of rows, per block); ``[(a, b)]`` where it cannot or need not be."""
    fits = a.nbytes <= budget and b.nbytes <= budget
    if fits or a.shape != b.shape or not a.shape or a.shape[0] < 2 or not (splittable(a) and splittable(b)):
        return [(a, b)]
    rows = a.shape[0]
    row_bytes = max(a.nbytes, b.nbytes) // rows
    unit = math.lcm(head_rows(a), head_rows(b))
    return [(block(a, r0, r1), block(b, r0, r1)) for r0, r1 in row_spans(rows, row_bytes, budget, unit)]


def op_tensor(op: ReadOp, axis: int, files: list[TensorFile]) -> TargetTensor:
    """``op``'s slice of its source tensor as a tensor of its own (in the source's dtype, the target's
    orientation), so that two stored copies can be read and compared like canonical tensors."""
    loc = files[op.source].tensors[op.tensor]
    stored = tuple(loc.shape[1:]) if op.src_block is not None else tuple(loc.shape)
    if op.transposed:
        stored = tuple(reversed(stored))
    shape = tuple(op.length if i == axis else n for i, n in enumerate(stored))
    return TargetTensor(op.tensor, shape, loc.dtype, axis, [ReadOp(op.source, op.tensor, op.src_start, op.length,
                                                                   0, op.transposed, op.src_block,
                                                                   interleave=op.interleave)])


def read_block(tensor: TargetTensor, files: list[TensorFile], gatherer: Gatherer, dest: np.ndarray) -> np.ndarray:
    """``tensor``'s bytes (a uint8 array), in ``dest`` where it fits: raw positioned reads when no cast or
    transpose is needed, else through torch."""
    out = dest[:tensor.nbytes] if tensor.nbytes <= dest.size else np.empty(tensor.nbytes, np.uint8)
    if direct(tensor, files):
        gatherer.fill([(tensor, out)])
    else:
        out[:] = assemble(tensor, files).contiguous().reshape(-1).view(dtypes.to_torch("U8")).numpy()
    return out


def extents(tensor: TargetTensor, files: list[TensorFile]) -> list[tuple[int, int, int]]:
    """``(fd, offset, length)`` of the source bytes a block reads (for read-ahead advice)."""
    return source_extents(tensor, files) if tensor.fill is None else []
