"""Streams target tensors (one rank's, for :func:`reshard.load_rank`) from a source onto a device through bounded
host buffers.

Each tensor is allocated once on ``device`` and filled in row blocks of at most ``buffer_bytes`` source bytes (the
converter's cut, :func:`reshard.core.blocks.row_blocks`), in the order of its bytes:

- staged (every device but the CPU; ``staged=True`` forces it): a block is read into one of two host buffers
  (pinned for CUDA) and copied to the device with ``non_blocking``, so the next block is read into the other
  buffer while the copy runs; a block whose source dtype differs from the target's is copied in the source's
  dtype into one of two device buffers of the same size and cast there. Host memory: the two buffers (plus one
  torch-built block, below), whatever the model and tensor sizes;
- on the CPU: a block in the target dtype is read straight into the destination tensor; a cast block goes
  through one host buffer.

The reads are the converter's: positioned reads into the buffer (:class:`reshard.io.gather.Gatherer`) while a
read-ahead thread advises the next blocks' source ranges (:class:`reshard.io.readahead.ReadAhead`). A column slice
of every source row (a row-parallel weight at tp > 1) of at least 4 KiB and at most half a row per row is read row
by row through a descriptor advised ``POSIX_FADV_RANDOM``, so a rank reads its own bytes only; a narrower slice is
read in whole rows (one read per tiny piece would cost more than the bytes). What raw bytes cannot express (a
transposed or strided source, FP8 dequantisation, a RoPE reorder of part of a head) is built through torch
(:func:`reshard.io.assemble.assemble`) in blocks of at most ``TORCH_BYTES``; a tensor that cannot be cut in rows
(read transposed along its dim 1) is built whole. A cast that turns finite values into inf is refused as
:func:`reshard.io.assemble.assemble` refuses it (checked on the device, raised once every block is loaded).
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

from reshard.core.blocks import row_blocks
from reshard.core.plan import ReadOp, TargetTensor
from reshard.io import dtypes
from reshard.io.assemble import assemble
from reshard.io.casts import CastOverflowError
from reshard.io.fp8 import is_dequantized
from reshard.io.gather import Gatherer, direct, resolve, source_outer, split_at_axis
from reshard.io.heads import read_ahead_window
from reshard.io.readahead import ReadAhead, source_extents
from reshard.io.regular import open_fd
from reshard.io.tensorfile import _MIN_ROW_PIECE, TensorFile, read_into

#: Source bytes of one block, and the size of each of the two host staging buffers.
BUFFER_BYTES = 64 << 20
#: Most target bytes of a block built through torch at once (its source rows and the result both live on the host).
TORCH_BYTES = 8 << 20


@dataclass
class _Job:
    """One block of ``tensor``: ``block`` (in the source dtype for a cast) starting at element ``start``. ``mode``:
    ``bytes`` (raw bytes of the target), ``cast`` (raw source bytes, cast on the device), ``torch`` or ``fill``.
    ``keep``: the ops the gatherer reads; ``pieces``: ``(source, dest offset, source offset, length)`` row reads."""

    tensor: TargetTensor
    block: TargetTensor
    start: int
    mode: str
    keep: list[ReadOp] = field(default_factory=list)
    pieces: list[tuple[int, int, int, int]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return math.prod(self.block.shape)


def _mode(tensor: TargetTensor, files: list[TensorFile]) -> tuple[str, TargetTensor]:
    """How ``tensor`` (or a block of it) is read, and what is read: itself, or itself in its source's dtype when a
    cast is all that keeps its bytes from being raw source bytes."""
    if tensor.fill is not None:
        return "fill", tensor
    if direct(tensor, files):
        return "bytes", tensor
    if tensor.reads and all(files[op.source].direct_bytes and not is_dequantized(files, op.source, op.tensor)
                            for op in tensor.reads):
        stored = {files[op.source].tensors[op.tensor].dtype for op in tensor.reads}
        if len(stored) == 1:
            raw = replace(tensor, dtype=stored.pop())
            if direct(raw, files):
                return "cast", raw
    return "torch", tensor


def _row_pieces(block: TargetTensor, files: list[TensorFile]) -> tuple[list[ReadOp], list[tuple[int, int, int, int]]]:
    """``block``'s ops the gatherer reads, and the row-by-row reads of its column slices of at least
    ``_MIN_ROW_PIECE`` bytes and at most half a source row per row (``(source, dest offset, source offset,
    length)``, offsets in the block's bytes and in the source file)."""
    size = dtypes.itemsize(block.dtype)
    keep, pieces = [], []
    for op in block.reads:
        part = resolve(op, block, files)
        loc = part.source
        outer, n, unit = split_at_axis(part.shape, part.axis, size)
        _, s_n, s_unit = split_at_axis(loc.shape, part.axis, size)
        piece = op.length * unit
        if outer == 1 or op.length == s_n or op.interleave or piece < _MIN_ROW_PIECE or 2 * piece > s_n * s_unit:
            keep.append(op)
            continue
        lo, hi = source_outer(loc.shape, part.axis, op)
        src = loc.offset + lo * s_n * s_unit + op.src_start * s_unit
        dst = part.base + op.dst_start * unit
        pieces += [(op.source, dst + i * n * unit, src + i * s_n * s_unit, piece) for i in range(hi - lo)]
    return keep, pieces


def plan_jobs(tensors: list[TargetTensor], files: list[TensorFile], buffer_bytes: int = BUFFER_BYTES) -> list[_Job]:
    """The blocks that load ``tensors``, in order: each tensor cut into row blocks of at most ``buffer_bytes``
    bytes as read (source bytes for a cast; ``TORCH_BYTES`` of target bytes for a block built through torch)."""
    jobs = []
    for tensor in tensors:
        if not math.prod(tensor.shape):
            continue
        mode, raw = _mode(tensor, files)
        if mode == "fill":
            jobs.append(_Job(tensor, tensor, 0, mode))
            continue
        if mode == "torch":
            budget = min(buffer_bytes, TORCH_BYTES)
        else:
            budget = max(1, buffer_bytes * dtypes.itemsize(tensor.dtype) // dtypes.itemsize(raw.dtype))
        start = 0
        for block in row_blocks(tensor, budget):
            mode, raw = _mode(block, files)
            keep, pieces = _row_pieces(raw, files) if mode in ("bytes", "cast") else ([], [])
            jobs.append(_Job(tensor, raw, start, mode, keep, pieces))
            start += math.prod(block.shape)
    return jobs


class _RowReads:
    """Descriptors of the source files read row by row, advised ``POSIX_FADV_RANDOM`` so that a miss reads only
    the piece asked for, not the rows around it (the kernel's read-ahead of a sequential reader)."""

    def __init__(self, files: list[TensorFile]):
        self.files = files
        self.fds: dict[int, int] = {}

    def fd(self, source: int) -> int:
        if source not in self.fds:
            fd = open_fd(self.files[source].path)
            if hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_RANDOM"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            self.fds[source] = fd
        return self.fds[source]

    def read(self, pieces: list[tuple[int, int, int, int]], dest) -> None:
        view = memoryview(dest)
        for source, at, offset, length in pieces:
            read_into(self.fd(source), view[at:at + length], offset, self.files[source].path)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _extents(job: _Job, files: list[TensorFile], rows: _RowReads) -> list[tuple[int, int, int]]:
    """``(fd, offset, length)`` of the source bytes ``job`` reads, for read-ahead advice."""
    if job.mode == "fill":
        return []
    if job.mode == "torch":
        return source_extents(job.block, files)
    kept = source_extents(replace(job.block, reads=job.keep), files) if job.keep else []
    return kept + [(rows.fd(source), offset, length) for source, _, offset, length in job.pieces]


def _narrowing(source, target) -> bool:
    """Whether a cast from torch dtype ``source`` to ``target`` can turn finite values into inf (the cases
    :func:`reshard.io.casts.check_cast` checks)."""
    import torch

    if source == target or not target.is_floating_point:
        return False
    return not (source.is_floating_point and torch.finfo(target).max >= torch.finfo(source).max)


def load_tensors(tensors: list[TargetTensor], files: list[TensorFile], device="cpu", *, allow_overflow: bool = False,
                 buffer_bytes: int | None = None, staged: bool = False, pin: bool | None = None,
                 stats: dict | None = None) -> dict:
    """``{name: tensor}`` for ``tensors`` on ``device``, bit for bit what :func:`reshard.io.assemble.assemble`
    builds. Every device but the CPU (and the CPU with ``staged=True``) is filled through two host buffers of at
    most ``buffer_bytes`` (default ``BUFFER_BYTES``) each; ``pin``: page-locked buffers (default: for CUDA). ``stats``,
    when given, receives ``staging_bytes`` (host buffers), ``device_buffer_bytes``, ``blocks`` and ``row_reads``."""
    import torch

    device = torch.device(device)
    out = {t.name: torch.empty(t.shape, dtype=dtypes.to_torch(t.dtype), device=device) for t in tensors}
    if device.type == "meta":
        return out
    staged = staged or device.type != "cpu"
    pin = staged and device.type == "cuda" if pin is None else pin
    jobs = plan_jobs(tensors, files, BUFFER_BYTES if buffer_bytes is None else buffer_bytes)
    via_host = [j for j in jobs if j.mode == "cast" or (staged and j.mode == "bytes")]
    size = max((j.block.nbytes for j in via_host), default=0)
    host = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(2 if staged else 1)] if size else []
    casts = [j for j in jobs if j.mode == "cast"]
    raw_size = max((j.block.nbytes for j in casts), default=0) if staged else 0
    on_device = [torch.empty(raw_size, dtype=torch.uint8, device=device) for _ in range(2)] if raw_size else []
    if stats is not None:
        stats.update(staging_bytes=sum(b.numel() for b in host), device_buffer_bytes=sum(b.numel() for b in on_device),
                     blocks=len(jobs), row_reads=sum(len(j.pieces) for j in jobs), pinned=bool(pin and host))
    gatherer = Gatherer(files)
    rows = _RowReads(files)
    ahead = None
    try:
        ahead = ReadAhead([_extents(j, files, rows) for j in jobs], read_ahead_window())
        with torch.cuda.device(device) if device.type == "cuda" else nullcontext():  # its streams and events
            flags = _run(jobs, out, files, gatherer, rows, ahead, host, on_device, staged, allow_overflow, device)
    finally:
        if ahead is not None:
            ahead.close()
        rows.close()
    _raise_overflow(flags, files)
    return out


def _run(jobs, out, files, gatherer, rows, ahead, host, on_device, staged, allow_overflow, device) -> list:
    """Fill ``out`` job by job; returns ``(tensor, device flag)`` of the cast blocks that may have overflowed."""
    import torch

    cuda = device.type == "cuda"
    copied = [None] * len(host)  # per host buffer: the CUDA event of the last copy out of it
    flags = []
    turn = 0
    for job in jobs:
        dest = out[job.tensor.name]
        part = dest.view(-1)[job.start:job.start + job.numel]
        if job.mode == "fill":
            dest.fill_(job.tensor.fill)
        elif job.mode == "torch":
            try:
                data = assemble(job.block, files, allow_overflow=allow_overflow)
            except CastOverflowError:
                _raise_overflow(flags, files)  # an earlier tensor's cast overflowed first
                raise
            part.copy_(data.reshape(-1))
        elif job.mode == "bytes" and not staged:  # straight into the destination's memory
            _read(job, part.view(torch.uint8).numpy(), gatherer, rows)
        else:
            k = turn % len(host)
            turn += 1
            if copied[k] is not None:
                copied[k].synchronize()  # the copy out of this buffer is done: it may be refilled
            buf = host[k][:job.block.nbytes]
            _read(job, buf.numpy(), gatherer, rows)
            if job.mode == "bytes":
                _upload(part.view(torch.uint8), buf)
            else:
                raw = on_device[k][:job.block.nbytes] if on_device else buf
                if on_device:
                    _upload(raw, buf)
                source = raw.view(dtypes.to_torch(job.block.dtype))
                part.copy_(source)
                if not allow_overflow and _narrowing(source.dtype, part.dtype):
                    flags.append((job.tensor, (torch.isinf(part) & torch.isfinite(source)).any()))
            if cuda:
                copied[k] = torch.cuda.Event()
                copied[k].record()
        ahead.step_done()
    if cuda:
        torch.cuda.current_stream(device).synchronize()
    return flags


def _upload(dest, host) -> None:
    """The one copy from a host staging buffer to the device (asynchronous from pinned memory)."""
    dest.copy_(host, non_blocking=True)


def _read(job: _Job, dest, gatherer: Gatherer, rows: _RowReads) -> None:
    """``job.block``'s bytes into the uint8 array ``dest``: the gatherer's reads, then the row-by-row pieces."""
    if job.keep or job.block.has_padding:
        gatherer.fill([(replace(job.block, reads=job.keep), dest)])
    rows.read(job.pieces, dest)


def _raise_overflow(flags: list, files: list[TensorFile]) -> None:
    """Raise the refusal of the first tensor whose cast turned finite values into inf (its message built as
    :func:`reshard.io.assemble.assemble` builds it)."""
    if not flags:
        return
    import torch

    hits = torch.stack([flag for _, flag in flags]).cpu().tolist()
    for (tensor, _), hit in zip(flags, hits):
        if hit:
            assemble(tensor, files, allow_overflow=False)  # raises CastOverflowError with the worst value
            raise CastOverflowError(f"casting '{tensor.name}' to {tensor.dtype} turns finite values into inf: keep "
                                    "the source dtype or cast to bf16, or pass allow_cast_overflow=True")
