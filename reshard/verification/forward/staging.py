"""A rank's weights read straight onto its compute device through a few bounded, reused host buffers.

On a GPU rank (:func:`stager_for` a CUDA device) every tensor a rank loader reads goes from disk into one of a
small pool of pinned host buffers (``os.preadv``), then to the device with a non-blocking copy; a tensor bigger
than a buffer goes through the pool in pieces, so the host holds the pool (``buffers x buffer_bytes``) whatever
the layer size. The bytes arrive unchanged, in the stored dtype: the loaders then split / pad them on the device
and the forward check casts there, the same ops on the same values as on the host (the logits are bit-identical).

:class:`StagedFile` wraps a loader's :class:`~reshard.io.tensorfile.TensorFile`: ``read`` / ``read_block`` go
through the owning stream's ``stager`` when it has one, else straight to the file (a CPU rank: nothing changes).
Only plain files are wrapped (:func:`plain`: one tensor at one offset of one descriptor, TensorFile's own reads);
the others (FP8 dequantising views, stitched DCP tensors, DeepSpeed segments) are read on the host and the forward
check moves each tensor to the device when it casts it. ``RESHARD_FORWARD_STAGING=BYTESxCOUNT`` (e.g. ``4096x2``)
stages on any device, CPU included, with ``COUNT`` buffers of ``BYTES`` (pinned on CUDA only): tests and
diagnosis.
"""

from __future__ import annotations

import math
import os

import torch

from reshard.io import dtypes
from reshard.io.tensorfile import _MIN_ROW_PIECE, TensorFile, block_location, read_into

BUFFER_BYTES = 64 << 20  # one pinned host buffer
BUFFERS = 3  # in the pool: one filled from disk while the others' copies to the device run
ENV = "RESHARD_FORWARD_STAGING"


class Stager:
    """Fills device tensors from byte ranges of files through ``buffers`` host buffers of ``buffer_bytes``
    each (allocated on first use, then reused round-robin; ``pin``: page-locked, default on CUDA, whose copies
    are then non-blocking and a buffer is refilled only once its copy has finished). One thread at a time."""

    def __init__(self, device, buffer_bytes: int = BUFFER_BYTES, buffers: int = BUFFERS, pin: bool | None = None):
        if buffer_bytes < 1 or buffers < 1:
            raise ValueError(f"staging needs at least one buffer of at least one byte (got {buffers} x "
                             f"{buffer_bytes})")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pin = self.cuda if pin is None else pin
        self.buffer_bytes, self.buffers = buffer_bytes, buffers
        self._pool: list[list] = []  # [host buffer, CUDA event of its last copy or None]
        self._next = 0
        self.copies = 0  # host-to-device copies made (a tensor bigger than a buffer makes several)

    @property
    def pool_bytes(self) -> int:
        """The host bytes the buffers hold (at most ``buffers x buffer_bytes``)."""
        return sum(buf.numel() for buf, _ in self._pool)

    def _buffer(self) -> list:
        """The next buffer of the pool, once its previous copy has finished."""
        i, self._next = self._next, (self._next + 1) % self.buffers
        if i == len(self._pool):
            if self.cuda:
                with torch.cuda.device(self.device):
                    buf = torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=self.pin)
            else:
                buf = torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=self.pin)
            self._pool.append([buf, None])
        slot = self._pool[i]
        if slot[1] is not None:
            slot[1].synchronize()
            slot[1] = None
        return slot

    def _send(self, slot: list, used: int, out: torch.Tensor, pos: int) -> int:
        out[pos:pos + used].copy_(slot[0][:used], non_blocking=self.pin and self.cuda)
        if self.pin and self.cuda:
            slot[1] = torch.cuda.Event()
            slot[1].record(torch.cuda.current_stream(self.device))
        self.copies += 1
        return pos + used

    def fill(self, out: torch.Tensor, fd: int, ranges: list[tuple[int, int]], path: str) -> None:
        """Fill ``out`` (1-D uint8, on the device) with the bytes of ``ranges`` ((file offset, length), in order)
        of ``fd``, a buffer at a time."""
        pos = used = 0
        slot = view = None
        for offset, left in ranges:
            while left:
                if slot is None:
                    slot, used = self._buffer(), 0
                    view = memoryview(slot[0].numpy()).cast("B")
                take = min(left, self.buffer_bytes - used)
                read_into(fd, view[used:used + take], offset, path)
                used, offset, left = used + take, offset + take, left - take
                if used == self.buffer_bytes:
                    pos, slot = self._send(slot, used, out, pos), None
        if slot is not None and used:
            pos = self._send(slot, used, out, pos)
        assert pos == out.numel(), (pos, out.numel())

    def close(self) -> None:
        """Wait for the copies in flight and free the buffers."""
        for slot in self._pool:
            if slot[1] is not None:
                slot[1].synchronize()
        self._pool, self._next = [], 0


def stager_for(device) -> Stager | None:
    """A :class:`Stager` for a CUDA ``device`` (default sizes), else None (reads stay on the host); with
    ``RESHARD_FORWARD_STAGING=BYTESxCOUNT`` one of those sizes on any device."""
    device = torch.device(device)
    forced = os.environ.get(ENV, "").strip()
    if forced:
        try:
            size, count = (int(v) for v in forced.lower().split("x"))
        except ValueError:
            raise ValueError(f"{ENV} must be BYTESxCOUNT, e.g. 4096x2 (got {forced!r})") from None
        return Stager(device, size, count)
    return Stager(device) if device.type == "cuda" else None


_READS = ("read", "read_block", "_read", "_read_rows", "_read_columns", "_read_strided")


def plain(file) -> bool:
    """Whether ``file`` is read by :class:`~reshard.io.tensorfile.TensorFile`'s own code from one descriptor
    (safetensors, torch zip, DCP data files), so its byte ranges can be staged."""
    return isinstance(file, TensorFile) and file.direct_bytes \
        and all(getattr(type(file), name) is getattr(TensorFile, name) for name in _READS)


class StagedFile:
    """``file`` (a plain TensorFile) whose ``read`` / ``read_block`` give device tensors through ``owner.stager``
    when the owner (a RankStream) has one, else the file's own host reads; every other attribute is the file's."""

    def __init__(self, file, owner):
        self.file, self.owner = file, owner

    def __getattr__(self, name):
        return getattr(self.file, name)

    def close(self) -> None:
        self.file.close()

    def read(self, name: str, axis: int = 0, start: int = 0, length: int | None = None,
             rows: tuple[int, int] | None = None):
        """:meth:`TensorFile.read`, on the stager's device when there is one."""
        stager = self.owner.stager
        if stager is None:
            return self.file.read(name, axis, start, length, rows)
        return _read(stager, self.file, self.file.tensors[name], axis, start, length, rows)

    def read_block(self, name: str, index: int, axis: int = 0, start: int = 0, length: int | None = None,
                   rows: tuple[int, int] | None = None):
        """:meth:`TensorFile.read_block`, on the stager's device when there is one."""
        stager = self.owner.stager
        if stager is None:
            return self.file.read_block(name, index, axis, start, length, rows)
        loc = block_location(self.file.tensors[name], index)
        if loc is None:  # a strided view: read the tensor, then index (as TensorFile does)
            data = self.read(name, 0, index, 1)[0]
            data = data[rows[0]:rows[1]] if rows else data
            return data.narrow(axis, start, data.shape[axis] - start if length is None else length).contiguous()
        return _read(stager, self.file, loc, axis, start, length, rows)


def _read(stager: Stager, file, loc, axis: int, start: int, length: int | None, rows: tuple[int, int] | None):
    """TensorFile._read's slice, its bytes staged onto ``stager.device``."""
    shape = loc.shape
    if not shape:
        return _rows(stager, file, loc, 1, 0, 1).reshape(())
    if length is None:
        length = shape[axis] - start
    if loc.strides is not None:  # a view into a shared storage: its span, then indexed on the device
        span = 1 + sum((n - 1) * s for n, s in zip(shape, loc.strides) if n > 0)
        full = torch.as_strided(_rows(stager, file, loc, 1, 0, span), shape, loc.strides)
        whole = full.narrow(axis, start, length).contiguous()
        return whole[rows[0]:rows[1]].contiguous() if rows else whole
    if axis == 0:
        return _rows(stager, file, loc, math.prod(shape[1:]), start, length).view(length, *shape[1:])
    return _columns(stager, file, loc, start, length, *(rows or (0, shape[0])))


def _rows(stager: Stager, file, loc, row_numel: int, start: int, count: int) -> torch.Tensor:
    """Rows ``[start, start + count)`` (of ``row_numel`` elements) of a contiguous tensor, flat."""
    size = dtypes.itemsize(loc.dtype)
    raw = torch.empty(row_numel * count * size, dtype=torch.uint8, device=stager.device)
    if raw.numel():
        stager.fill(raw, file.fd, [(loc.offset + start * row_numel * size, raw.numel())], file.path)
    return raw.view(dtypes.to_torch(loc.dtype))


def _columns(stager: Stager, file, loc, start: int, length: int, first: int, stop: int) -> torch.Tensor:
    """``[first:stop, start:start+length, ...]``: each row's piece packed into the buffers when it is half a row or
    less (and at least ``_MIN_ROW_PIECE`` bytes), else whole-row blocks of at most a buffer, cut on the device."""
    count, cols = stop - first, loc.shape[1]
    inner = math.prod(loc.shape[2:])
    size = dtypes.itemsize(loc.dtype)
    row_bytes, piece_bytes = cols * inner * size, length * inner * size
    if piece_bytes * 2 > row_bytes or piece_bytes < _MIN_ROW_PIECE:
        out = torch.empty((count, length, *loc.shape[2:]), dtype=dtypes.to_torch(loc.dtype), device=stager.device)
        block = max(1, stager.buffer_bytes // max(row_bytes, 1))
        for r0 in range(0, count, block):
            n = min(block, count - r0)
            chunk = _rows(stager, file, loc, cols * inner, first + r0, n).view(n, cols, *loc.shape[2:])
            out[r0:r0 + n] = chunk[:, start:start + length]
        return out
    raw = torch.empty(count * piece_bytes, dtype=torch.uint8, device=stager.device)
    base = loc.offset + first * row_bytes + start * inner * size
    stager.fill(raw, file.fd, [(base + r * row_bytes, piece_bytes) for r in range(count)], file.path)
    return raw.view(dtypes.to_torch(loc.dtype)).view(count, length, *loc.shape[2:])


def assemble_on(tensor, files: list, device) -> torch.Tensor:
    """:func:`reshard.io.assemble.assemble` (default ``allow_overflow``) building ``tensor`` on ``device``:
    zeros where it is padding, each read op's slice (a device tensor from a :class:`StagedFile`, a host one from
    any other file) copied in, cast to the target dtype by the copy."""
    from reshard.io.assemble import read_op

    if tensor.pair_interleaved:  # gpt-oss's alternating gate/up rows (reshard/io/pair_rows.py)
        from dataclasses import replace

        from reshard.io.pair_rows import interleave
        return interleave(assemble_on(replace(tensor, pair_interleaved=0), files, device), tensor.axis,
                          tensor.pair_interleaved)
    dtype = dtypes.to_torch(tensor.dtype)
    if tensor.fill is not None:
        return torch.full(tensor.shape, tensor.fill, dtype=dtype, device=device)
    if len(tensor.reads) == 1 and not tensor.has_padding and not tensor.reads[0].blocked:
        data = read_op(tensor.reads[0], tensor.axis, files, tensor.dtype)
        if tuple(data.shape) == tuple(tensor.shape):
            return data.to(dtype)
    make = torch.zeros if tensor.has_padding else torch.empty
    buf = make(tensor.shape, dtype=dtype, device=device)
    for op in tensor.reads:
        data = read_op(op, tensor.axis, files, tensor.dtype)
        if op.dst_block is not None:
            part = buf[op.dst_block].narrow(tensor.axis - 1, op.dst_start, op.length)
        else:
            part = buf.narrow(tensor.axis, op.dst_start, op.length)
        part.copy_(data)
    return buf
