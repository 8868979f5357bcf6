"""Tensors whose bytes are a list of byte segments spread over several files: DeepSpeed's flat partitions.

A ZeRO optimizer stores every parameter flattened inside per-rank flat fp32 buffers, so one parameter is one
contiguous element range of one rank (ZeRO-1/2, split at rank boundaries when it straddles two) or of every rank
(ZeRO-3), cut mid-row. :class:`SegmentedFile` presents such parameters as ordinary row-major tensors of their
real shapes: ``segments[name]`` lists ``(file index, byte offset, element count)`` in element order, and a read
of rows ``[r0, r1)`` gathers only the bytes of those rows (``os.preadv`` into the result). A column read goes
through bounded row blocks (at most ``BLOCK_BYTES`` of whole rows at a time), so memory stays at the slice asked
for plus one block. The bytes are not at one file offset, so the executor's raw-byte paths never see them
(``direct_bytes`` is False: :func:`reshard.io.gather.resolve` sends such reads to the torch path, which also casts
them, e.g. fp32 masters into a bf16 output, rounding to nearest even as ``Tensor.to`` does).
"""

from __future__ import annotations

import math
import os

from reshard.errors import CheckpointError
from reshard.io import dtypes
from reshard.io.regular import open_fd
from reshard.io.tensorfile import TensorFile, TensorLocation, read_into

BLOCK_BYTES = 32 << 20  # whole rows read at once for a column slice

Segment = tuple[int, int, int]  # (index into paths, byte offset in that file, element count)


class SegmentedFile(TensorFile):
    """A read-only view of tensors gathered from byte segments of ``paths`` (see the module docstring). ``path``
    (what ``inspect`` lists) is ``paths[0]``; ``tensors`` hold each tensor's dtype and shape (offset 0, unused)."""

    format = "torch"
    direct_bytes = False  # no tensor is at one offset of one file: raw-byte copies and gathers do not apply

    def __init__(self, paths: list[str], tensors: dict[str, tuple[str, tuple[int, ...]]],
                 segments: dict[str, list[Segment]]):
        super().__init__(paths[0], {n: TensorLocation(d, tuple(s), 0) for n, (d, s) in tensors.items()})
        self.paths = list(paths)
        self.segments = segments
        self._fds: dict[int, int] = {}
        sizes = [os.path.getsize(p) for p in self.paths]
        for name, loc in self.tensors.items():
            segs = segments[name]
            size = dtypes.itemsize(loc.dtype)
            if sum(n for _, _, n in segs) != loc.numel:
                raise AssertionError(f"{name}: segments hold {sum(n for _, _, n in segs)} elements, not {loc.numel}")
            for index, offset, count in segs:
                if offset + count * size > sizes[index]:
                    raise CheckpointError(f"{self.paths[index]}: file ends before byte {offset + count * size} "
                                          f"(parameter '{name}'): truncated?")

    def _descriptor(self, index: int) -> int:
        fd = self._fds.get(index)
        if fd is None:
            fd = self._fds[index] = open_fd(self.paths[index])
        return fd

    @property
    def fd(self) -> int:
        raise AssertionError("a SegmentedFile has no single descriptor (direct_bytes is False)")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def extents(self, name: str) -> list[tuple[int, int, int]]:
        """``(fd, offset, length)`` of every byte of tensor ``name`` (read-ahead advice)."""
        size = dtypes.itemsize(self.tensors[name].dtype)
        return [(self._descriptor(i), offset, count * size) for i, offset, count in self.segments[name]]

    def byte_shares(self, name: str) -> dict[str, float]:
        """The fraction of tensor ``name``'s elements in each file (a plan's bytes read per file)."""
        total = self.tensors[name].numel or 1
        shares: dict[str, float] = {}
        for index, _, count in self.segments[name]:
            shares[self.paths[index]] = shares.get(self.paths[index], 0) + count / total
        return shares

    def read_elements(self, name: str, first: int, count: int, out) -> None:
        """Fill the uint8 byte view ``out`` with elements ``[first, first + count)`` of flattened ``name``."""
        size = dtypes.itemsize(self.tensors[name].dtype)
        view = memoryview(out).cast("B")
        pos, at = 0, 0  # element position of the segment's start; bytes written
        stop = first + count
        for index, offset, n in self.segments[name]:
            lo, hi = max(first, pos), min(stop, pos + n)
            if lo < hi:
                length = (hi - lo) * size
                read_into(self._descriptor(index), view[at:at + length], offset + (lo - pos) * size, self.paths[index])
                at += length
            pos += n
            if pos >= stop:
                break

    def _rows(self, name: str, base: int, row_numel: int, start: int, count: int):
        import torch

        loc = self.tensors[name]
        raw = torch.empty(row_numel * count * dtypes.itemsize(loc.dtype), dtype=torch.uint8)
        if raw.numel():
            self.read_elements(name, base + start * row_numel, row_numel * count, raw.numpy())
        return raw.view(dtypes.to_torch(loc.dtype))

    def _slice(self, name: str, base: int, shape: tuple[int, ...], axis: int, start: int, length: int | None,
               rows: tuple[int, int] | None):
        """``tensor[start:start+length]`` along ``axis`` of the ``shape`` tensor at element ``base`` of ``name``."""
        import torch

        if not shape:
            return self._rows(name, base, 1, 0, 1).reshape(())
        if length is None:
            length = shape[axis] - start
        row = math.prod(shape[1:])
        if axis == 0:
            return self._rows(name, base, row, start, length).view(length, *shape[1:])
        first, stop = rows or (0, shape[0])
        out = torch.empty((stop - first, length, *shape[2:]), dtype=dtypes.to_torch(self.tensors[name].dtype))
        block = max(1, BLOCK_BYTES // max(1, row * dtypes.itemsize(self.tensors[name].dtype)))
        for r0 in range(first, stop, block):
            n = min(block, stop - r0)
            chunk = self._rows(name, base, row, r0, n).view(n, *shape[1:])
            out[r0 - first:r0 - first + n] = chunk.narrow(1, start, length)
        return out

    def read(self, name: str, axis: int = 0, start: int = 0, length: int | None = None,
             rows: tuple[int, int] | None = None):
        return self._slice(name, 0, self.tensors[name].shape, axis, start, length, rows)

    def read_block(self, name: str, index: int, axis: int = 0, start: int = 0, length: int | None = None,
                   rows: tuple[int, int] | None = None):
        shape = self.tensors[name].shape[1:]
        return self._slice(name, index * math.prod(shape), shape, axis, start, length, rows)

