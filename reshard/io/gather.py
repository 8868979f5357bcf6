"""Fills a byte buffer with one target tensor from positioned source reads, without torch.

A target tensor is seen as ``(outer, n, unit)``: ``outer`` = the product of the dims before its split axis,
``n`` = the axis length, ``unit`` = bytes of the dims after it. A read op copies ``length`` indices along the
axis; when ``outer == 1`` (split on dim 0) or the op spans whole rows of both tensors, the source bytes are
contiguous and are read straight into the buffer with ``os.preadv``. Otherwise (a column slice of a row-parallel
weight) every op on the same source tensor (and the same rows of it, for a row block: ``ReadOp.rows``) is served
from one pass over them: blocks of whole rows are mapped
(:mod:`reshard.io.mapped`, at most ``BLOCK_BYTES`` at a time) and each op's columns are copied out with numpy.

Two reorderings are byte moves too: a stacked tensor's block (vLLM's ``[E, rows, cols]`` experts, as source or
target) is a tensor of its own at a byte offset (:class:`Part`), and an interleaved-RoPE row order (Meta's
``wq`` / ``wk``, ops along dim 0) permutes whole rows inside each head, copied from a map of the source rows.
Transposes and casts go through torch (:func:`reshard.io.assemble.assemble`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from reshard.core.plan import ReadOp, TargetTensor
from reshard.io import dtypes
from reshard.io.mapped import mapped
from reshard.io.tensorfile import TensorFile, TensorLocation, block_location, read_into

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


@dataclass(frozen=True)
class Part:
    """What one read op sees once stacked blocks are resolved: its source tensor (or the block ``src_block`` of
    it), the target tensor (or the block ``dst_block`` of it) as ``shape`` with the op's ``axis`` in it, and where
    that target part starts in the target's bytes (``base``)."""

    source: TensorLocation
    shape: tuple[int, ...]
    axis: int
    base: int


def resolve(op: ReadOp, tensor: TargetTensor, files: list[TensorFile]) -> Part | None:
    """``op``'s :class:`Part`; None when its source block is strided or its source has no direct bytes (a
    :class:`~reshard.io.segmented.SegmentedFile`): torch reads it."""
    if not files[op.source].direct_bytes:
        return None
    loc = files[op.source].tensors[op.tensor]
    if op.src_block is not None:
        loc = block_location(loc, op.src_block)
        if loc is None:
            return None
    if op.dst_block is None:
        return Part(loc, tuple(tensor.shape), tensor.axis, 0)
    shape = tuple(tensor.shape[1:])
    return Part(loc, shape, tensor.axis - 1, op.dst_block * math.prod(shape) * dtypes.itemsize(tensor.dtype))


def direct(tensor: TargetTensor, files: list[TensorFile]) -> bool:
    """Whether the gatherer can build ``tensor`` from raw bytes: no cast, no transpose, every source tensor (or
    block) stored contiguously, interleaved-RoPE ops along dim 0 in whole heads, no padding in a stacked target."""
    if tensor.fill is not None:
        return tensor.dtype in _NUMPY_FLOATS
    if tensor.pair_interleaved:  # rows reordered across ops after assembly (torch)
        return False
    for op in tensor.reads:
        part = resolve(op, tensor, files)
        if part is None or op.shift or op.transform or op.transposed or \
                (op.dst_block is not None and tensor.has_padding):
            return False
        loc = part.source
        if loc.dtype != tensor.dtype or loc.strides is not None or len(loc.shape) != len(part.shape):
            return False
        if op.interleave and (part.axis != 0 or op.length % abs(op.interleave) or op.rows is not None):
            return False
    return True


def _heads_reordered(rows: np.ndarray, dest: np.ndarray, interleave: int) -> None:
    """Copy ``rows`` (heads of ``abs(interleave)`` rows each, as ``(count, unit)`` bytes) into ``dest`` in the other
    RoPE order: ``interleave > 0`` from interleaved (row ``2i + j`` of a head) to halves (row ``j * d/2 + i``),
    ``< 0`` back (transformers' Llama conversion ``permute`` and its inverse)."""
    d = abs(interleave)
    unit = rows.shape[1]
    source = _units(rows, unit)
    target = _units(dest, unit)
    width = source.shape[1]
    inner = (d // 2, 2) if interleave > 0 else (2, d // 2)
    np.copyto(target.reshape(-1, inner[1], inner[0], width),
              source.reshape(-1, *inner, width).transpose(0, 2, 1, 3))


class Gatherer:
    """Reads target tensors into caller-owned byte buffers."""

    def __init__(self, files: list[TensorFile]):
        self.files = files

    def fill(self, items: list[tuple[TargetTensor, np.ndarray]]) -> None:
        """Fill each ``dest`` (a uint8 array of ``tensor.nbytes``) with its tensor; ops that need a column slice
        of the same source tensor are grouped so that the source is read once for all of them."""
        columns: dict[tuple, list[tuple[ReadOp, Part, np.ndarray]]] = {}
        for tensor, dest in items:
            if tensor.fill is not None:
                dest.view(_NUMPY_FLOATS[tensor.dtype])[:] = tensor.fill
                continue
            size = dtypes.itemsize(tensor.dtype)
            if tensor.has_padding:
                outer, n, unit = split_at_axis(tensor.shape, tensor.axis, size)
                self._zero_padding(tensor, dest.reshape(outer, n, unit))
            for op in tensor.reads:
                part = resolve(op, tensor, self.files)
                loc = part.source
                target = dest[part.base:part.base + math.prod(part.shape) * size]
                outer, n, unit = split_at_axis(part.shape, part.axis, size)
                s_outer, s_n, s_unit = split_at_axis(loc.shape, part.axis, size)
                first = source_outer(loc.shape, part.axis, op)[0]
                whole_rows = op.length == s_n == n
                if outer == 1 or whole_rows:
                    begin = op.dst_start * unit if outer == 1 else 0
                    span = target[begin:begin + op.length * unit * outer]
                    src = loc.offset + first * s_n * s_unit + (op.src_start * s_unit if outer == 1 else 0)
                    if op.interleave:
                        self._read_heads(op, span.reshape(op.length, unit), src)
                    else:
                        read_into(self.files[op.source].fd, memoryview(span), src, self.files[op.source].path)
                else:
                    key = (op.source, op.tensor, op.src_block, op.rows, part.axis)
                    columns.setdefault(key, []).append((op, part, target))
        for (source, *_), ops in columns.items():
            self._scatter_columns(source, ops)

    def _read_heads(self, op: ReadOp, dest: np.ndarray, offset: int) -> None:
        """``op``'s source rows (contiguous from ``offset``) into ``dest`` in the other RoPE row order, a window of
        whole heads at a time."""
        rows, unit = dest.shape
        head = abs(op.interleave)
        per = max(1, BLOCK_BYTES // max(1, head * unit)) * head
        fd = self.files[op.source].fd
        for r0 in range(0, rows, per):
            count = min(per, rows - r0)
            with mapped(fd, offset + r0 * unit, count * unit) as window:
                _heads_reordered(window.reshape(count, unit), dest[r0:r0 + count], op.interleave)

    @staticmethod
    def _zero_padding(tensor: TargetTensor, dest3: np.ndarray) -> None:
        covered = sorted((op.dst_start, op.dst_start + op.length) for op in tensor.reads)
        pos = 0
        for lo, hi in covered + [(dest3.shape[1], dest3.shape[1])]:
            if lo > pos:
                dest3[:, pos:lo, :] = 0
            pos = max(pos, hi)

    def _scatter_columns(self, source: int, ops: list[tuple[ReadOp, Part, np.ndarray]]) -> None:
        file = self.files[source]
        loc = ops[0][1].source
        axis = ops[0][1].axis
        rows, n, unit = split_at_axis(loc.shape, axis, dtypes.itemsize(loc.dtype))
        row_bytes = n * unit
        block = max(1, BLOCK_BYTES // max(row_bytes, 1))
        targets = []
        for op, part, dest in ops:
            t_outer, t_n, t_unit = split_at_axis(part.shape, axis, dtypes.itemsize(loc.dtype))
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
