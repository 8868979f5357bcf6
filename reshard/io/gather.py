"""Fills a byte buffer with one target tensor from positioned source reads, without torch.

A target tensor is seen as ``(outer, n, unit)``: ``outer`` = the product of the dims before its split axis,
``n`` = the axis length, ``unit`` = bytes of the dims after it. A read op copies ``length`` indices along the
axis; when ``outer == 1`` (split on dim 0) or the op spans whole rows of both tensors, the source bytes are
contiguous and are read straight into the buffer with ``os.preadv``. Otherwise (a column slice of a row-parallel
weight) every op on the same source tensor (and the same rows of it, for a row block: ``ReadOp.rows``) is served
from one pass over them: blocks of whole rows are mapped
(:mod:`reshard.io.mapped`, at most ``BLOCK_BYTES`` at a time) and each op's columns are copied out with numpy.
"""

from __future__ import annotations

import math

import numpy as np

from reshard.core.plan import ReadOp, TargetTensor
from reshard.io import dtypes
from reshard.io.mapped import mapped
from reshard.io.tensorfile import TensorFile, read_into

BLOCK_BYTES = 32 << 20  # rows of a source tensor mapped at once for a column scatter
_NUMPY_FLOATS = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}  # constants (vLLM scales) are filled with numpy


def split_at_axis(shape: tuple[int, ...], axis: int, itemsize: int) -> tuple[int, int, int]:
    """``(outer, n, unit)`` of a row-major tensor split at ``axis`` (see the module docstring)."""
    if not shape:
        return 1, 1, itemsize
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:]) * itemsize


def source_outer(shape: tuple[int, ...], axis: int, op: ReadOp) -> tuple[int, int]:
    """The ``outer`` index range (see :func:`split_at_axis`) of the source that ``op`` reads: all of it, or the
    part under its rows of dim 0 (:attr:`ReadOp.rows`, a row block of an op along a later axis)."""
    outer = math.prod(shape[:axis]) if shape else 1
    if op.rows is None:
        return 0, outer
    per_row = outer // shape[0] if shape and shape[0] else 0
    return op.rows[0] * per_row, op.rows[1] * per_row


def _units(array: np.ndarray, unit: int) -> np.ndarray:
    """View the last (byte) axis as one wider integer when it divides, so numpy copies whole elements."""
    for width in (8, 4, 2):
        if unit % width == 0:
            return array.view(f"u{width}")
    return array


def direct(tensor: TargetTensor, files: list[TensorFile]) -> bool:
    """Whether raw bytes can be copied: no cast, no transpose, and every source tensor is stored contiguously."""
    if tensor.fill is not None:
        return tensor.dtype in _NUMPY_FLOATS
    for op in tensor.reads:
        loc = files[op.source].tensors[op.tensor]
        if loc.dtype != tensor.dtype or loc.strides is not None or len(loc.shape) != len(tensor.shape) \
                or op.reordered:
            return False
    return True


class Gatherer:
    """Reads target tensors into caller-owned byte buffers."""

    def __init__(self, files: list[TensorFile]):
        self.files = files

    def fill(self, items: list[tuple[TargetTensor, np.ndarray]]) -> None:
        """Fill each ``dest`` (a uint8 array of ``tensor.nbytes``) with its tensor; ops that need a column slice
        of the same source tensor are grouped so that the source is read once for all of them."""
        columns: dict[tuple[int, str], list[tuple[ReadOp, TargetTensor, np.ndarray]]] = {}
        for tensor, dest in items:
            if tensor.fill is not None:
                dest.view(_NUMPY_FLOATS[tensor.dtype])[:] = tensor.fill
                continue
            size = dtypes.itemsize(tensor.dtype)
            outer, n, unit = split_at_axis(tensor.shape, tensor.axis, size)
            if tensor.has_padding:
                self._zero_padding(tensor, dest.reshape(outer, n, unit))
            for op in tensor.reads:
                loc = self.files[op.source].tensors[op.tensor]
                s_outer, s_n, s_unit = split_at_axis(loc.shape, tensor.axis, size)
                first = source_outer(loc.shape, tensor.axis, op)[0]
                whole_rows = op.length == s_n == n
                if outer == 1 or whole_rows:
                    begin = op.dst_start * unit if outer == 1 else 0
                    src = loc.offset + first * s_n * s_unit + (op.src_start * s_unit if outer == 1 else 0)
                    read_into(self.files[op.source].fd, memoryview(dest[begin:begin + op.length * unit * outer]),
                              src, self.files[op.source].path)
                else:
                    columns.setdefault((op.source, op.tensor, op.rows), []).append((op, tensor, dest))
        for (source, name, _), ops in columns.items():
            self._scatter_columns(source, name, ops)

    @staticmethod
    def _zero_padding(tensor: TargetTensor, dest3: np.ndarray) -> None:
        covered = sorted((op.dst_start, op.dst_start + op.length) for op in tensor.reads)
        pos = 0
        for lo, hi in covered + [(dest3.shape[1], dest3.shape[1])]:
            if lo > pos:
                dest3[:, pos:lo, :] = 0
            pos = max(pos, hi)

    def _scatter_columns(self, source: int, name: str, ops: list[tuple[ReadOp, TargetTensor, np.ndarray]]) -> None:
        file = self.files[source]
        loc = file.tensors[name]
        axis = ops[0][1].axis
        rows, n, unit = split_at_axis(loc.shape, axis, dtypes.itemsize(loc.dtype))
        row_bytes = n * unit
        block = max(1, BLOCK_BYTES // max(row_bytes, 1))
        targets = []
        for op, tensor, dest in ops:
            t_outer, t_n, t_unit = split_at_axis(tensor.shape, axis, dtypes.itemsize(tensor.dtype))
            targets.append((op, _units(dest.reshape(t_outer, t_n, t_unit), unit)))
        lo, hi = source_outer(loc.shape, axis, ops[0][0])
        for r0 in range(lo, hi, block):
            count = min(block, hi - r0)
            with mapped(file.fd, loc.offset + r0 * row_bytes, count * row_bytes) as window:
                src3 = _units(window.reshape(count, n, unit), unit)
                for op, dest3 in targets:
                    dest3[r0 - lo:r0 - lo + count, op.dst_start:op.dst_start + op.length] = \
                        src3[:, op.src_start:op.src_start + op.length]
                del src3
