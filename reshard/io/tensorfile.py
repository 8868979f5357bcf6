"""Positioned reads of tensor slices from a file, without mapping or loading the whole file.

A :class:`TensorFile` knows, for each tensor, its dtype, shape and the byte offset of its first element. Reads
use ``os.preadv`` straight into the caller's memory (a fresh tensor, or a reusable buffer in the executor), so
resident memory is the slice read, never the file. torch is imported only by :meth:`TensorFile.read`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from reshard.io import dtypes
from reshard.io.regular import open_fd

_BLOCK_BYTES = 32 << 20  # scratch size for strided (column-range) reads
_MIN_ROW_PIECE = 4 << 10  # a narrower column slice is read as whole rows (one call per row would cost more)


@dataclass(frozen=True)
class TensorLocation:
    """Where a tensor's bytes live in a file. ``strides`` is None for a row-major contiguous tensor."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    strides: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtypes.itemsize(self.dtype)


def _read_exact(fd: int, out, offset: int, path: str) -> None:
    """Fill the uint8 tensor ``out`` from ``fd`` at ``offset``."""
    read_into(fd, memoryview(out.numpy()).cast("B"), offset, path)


def read_into(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Fill the byte view ``view`` from ``fd`` at ``offset`` (positioned reads; the GIL is released)."""
    done = 0
    total = len(view)
    while done < total:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            from reshard.errors import CheckpointError

            raise CheckpointError(f"{path}: file ends before byte {offset + total} (truncated?)")
        done += got


def block_location(loc: TensorLocation, index: int) -> TensorLocation | None:
    """Where block ``index`` (along dim 0) of a contiguous tensor lies, as a tensor of its own; None when the
    tensor is strided."""
    if loc.strides is not None:
        return None
    inner = loc.shape[1:]
    return TensorLocation(loc.dtype, inner, loc.offset + index * math.prod(inner) * dtypes.itemsize(loc.dtype))


class TensorFile:
    """A read-only tensor file (safetensors or torch zip) indexed by tensor name."""

    format = "?"
    #: Every tensor lies at one offset of this file's descriptor: the executor may copy and gather its raw bytes
    #: (False: a view over several files, read through :meth:`read` only; it gives ``extents`` for read-ahead).
    direct_bytes = True

    def __init__(self, path: str, tensors: dict[str, TensorLocation]):
        self.path = path
        self.tensors = tensors
        self._fd: int | None = None

    @property
    def fd(self) -> int:
        if self._fd is None:
            self._fd = open_fd(self.path)
        return self._fd

    def byte_shares(self, name: str) -> dict[str, float] | None:
        """The fraction of tensor ``name``'s bytes in each file, for a view over several files; None: all here."""
        return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def read(self, name: str, axis: int = 0, start: int = 0, length: int | None = None,
             rows: tuple[int, int] | None = None):
        """Return ``tensor[start:start+length]`` along ``axis`` (0 or 1) as a new contiguous tensor; for
        ``axis`` 1, ``rows`` limits it to rows ``[rows[0], rows[1])`` of dim 0."""
        return self._read(self.tensors[name], axis, start, length, rows)

    def read_block(self, name: str, index: int, axis: int = 0, start: int = 0, length: int | None = None,
                   rows: tuple[int, int] | None = None):
        """:meth:`read` of block ``index`` (along dim 0) of a stacked tensor, reading only that block's bytes."""
        loc = block_location(self.tensors[name], index)
        if loc is None:  # a strided view: read the tensor, then index
            data = self.read(name, 0, index, 1)[0]
            data = data[rows[0]:rows[1]] if rows else data
            return data.narrow(axis, start, data.shape[axis] - start if length is None else length).contiguous()
        return self._read(loc, axis, start, length, rows)

    def _read(self, loc: TensorLocation, axis: int, start: int, length: int | None, rows: tuple[int, int] | None):
        shape = loc.shape
        if not shape:
            return self._read_rows(loc, 1, 0, 1).reshape(())
        if length is None:
            length = shape[axis] - start
        if loc.strides is not None:
            whole = self._read_strided(loc, axis, start, length)
            return whole[rows[0]:rows[1]].contiguous() if rows else whole
        if axis == 0:
            row = math.prod(shape[1:])
            return self._read_rows(loc, row, start, length).view(length, *shape[1:])
        return self._read_columns(loc, start, length, *(rows or (0, shape[0])))

    def _read_rows(self, loc: TensorLocation, row_numel: int, start: int, count: int):
        import torch

        size = dtypes.itemsize(loc.dtype)
        raw = torch.empty(row_numel * count * size, dtype=torch.uint8)
        if raw.numel():
            _read_exact(self.fd, raw, loc.offset + start * row_numel * size, self.path)
        return raw.view(dtypes.to_torch(loc.dtype))

    def _read_columns(self, loc: TensorLocation, start: int, length: int, first: int, stop: int):
        """Read ``[first:stop, start:start+length, ...]``: one positioned read per row for half a row or less (pieces of at
        least ``_MIN_ROW_PIECE`` bytes), else whole-row blocks through a bounded scratch buffer."""
        import torch

        rows, cols = stop - first, loc.shape[1]
        inner = math.prod(loc.shape[2:])
        size = dtypes.itemsize(loc.dtype)
        dtype = dtypes.to_torch(loc.dtype)
        out = torch.empty((rows, length, *loc.shape[2:]), dtype=dtype)
        row_bytes = cols * inner * size
        piece_bytes = length * inner * size
        if piece_bytes * 2 > row_bytes or piece_bytes < _MIN_ROW_PIECE:
            block = max(1, _BLOCK_BYTES // max(row_bytes, 1))
            for r0 in range(0, rows, block):
                n = min(block, rows - r0)
                chunk = self._read_rows(loc, cols * inner, first + r0, n).view(n, cols, *loc.shape[2:])
                out[r0:r0 + n] = chunk[:, start:start + length]
        else:  # half a row or less: one read per row, no over-read (a rank reads its share, not the tensor)
            flat = out.view(rows, -1)
            base = loc.offset + first * row_bytes + start * inner * size
            for r in range(rows):
                _read_exact(self.fd, flat[r].view(torch.uint8), base + r * row_bytes, self.path)
        return out

    def _read_strided(self, loc: TensorLocation, axis: int, start: int, length: int):
        """Non-contiguous tensors (views into a shared torch storage): read the span, then index."""
        import torch

        size = dtypes.itemsize(loc.dtype)
        span = 1 + sum((n - 1) * s for n, s in zip(loc.shape, loc.strides) if n > 0)
        flat = self._read_rows(loc, 1, 0, span) if size else None
        full = torch.as_strided(flat, loc.shape, loc.strides)
        return full.narrow(axis, start, length).contiguous()


class WrappedFile(TensorFile):
    """A source file read through another (``base``: safetensors or torch) whose tensors some reads transform
    (dequantised FP8, MXFP4): the descriptor, closing and every other attribute (safetensors metadata) are
    ``base``'s."""

    def __init__(self, base: TensorFile, tensors: dict[str, TensorLocation]):
        super().__init__(base.path, tensors)
        self.base = base
        self.format = base.format

    @property
    def fd(self) -> int:
        return self.base.fd

    def close(self) -> None:
        self.base.close()

    def __getattr__(self, name):
        if name == "base":  # not set yet (unpickling, a half-built object): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)


class BlockWrappedFile(WrappedFile):
    """A :class:`WrappedFile` whose transformed tensors (:meth:`transforms`) are made one block (index along dim 0:
    one expert) at a time by :meth:`make_block`, the last block kept (a fused gate / up block is read once per
    slot); its other tensors are ``base``'s."""

    direct_bytes = False

    def transforms(self, name: str) -> bool:
        raise NotImplementedError

    def make_block(self, name: str, index: int):
        raise NotImplementedError

    def block(self, name: str, index: int):
        """Block ``index`` of transformed tensor ``name``, made once for consecutive reads."""
        last = getattr(self, "_last", None)
        if last is None or last[0] != (name, index):
            last = self._last = ((name, index), self.make_block(name, index))
        return last[1]

    def read_block(self, name: str, index: int, axis: int = 0, start: int = 0, length: int | None = None,
                   rows: tuple[int, int] | None = None):
        if not self.transforms(name):
            return self.base.read_block(name, index, axis, start, length, rows)
        data = self.block(name, index)  # a view: the readers copy it where it goes
        data = data[rows[0]:rows[1]] if rows else data
        return data.narrow(axis, start, data.shape[axis] - start if length is None else length)

    def read(self, name: str, axis: int = 0, start: int = 0, length: int | None = None,
             rows: tuple[int, int] | None = None):
        if not self.transforms(name):
            return self.base.read(name, axis, start, length, rows)
        import torch

        loc = self.tensors[name]
        if length is None:
            length = loc.shape[axis] - start
        first, stop = (start, start + length) if axis == 0 else (rows or (0, loc.shape[0]))
        parts = [self.block(name, e) for e in range(first, stop)]
        whole = torch.stack(parts) if parts else torch.empty((0, *loc.shape[1:]), dtype=dtypes.to_torch(loc.dtype))
        return whole if axis == 0 else whole.narrow(axis, start, length).contiguous()
