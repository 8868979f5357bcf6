"""A target tensor as source byte ranges, copied file to file inside the kernel (``copy_file_range``).

Write-through-user-memory is what limits a conversion (each byte is copied into the process and out again); a
tensor whose bytes are whole contiguous runs of source bytes (a dim-0 slice, a whole tensor, zero padding after
it) needs neither copy. Column slices and casts still go through :mod:`reshard.io.gather`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from reshard.core.plan import TargetTensor
from reshard.io import dtypes
from reshard.io.gather import direct, resolve, split_at_axis
from reshard.io.mapped import crc32_of_range
from reshard.io.partial import PAGE
from reshard.io.tensorfile import TensorFile

_ZEROS = bytes(1 << 20)
_FALLBACK_CHUNK = 8 << 20


@dataclass(frozen=True)
class Ranges:
    """A tensor's bytes in order: ``(fd, offset, length)`` source runs, ``fd`` None for zeros."""

    parts: tuple[tuple[int | None, int, int], ...]
    nbytes: int
    crc: int | None = None  # filled in for zip records (the caller reads the bytes once to checksum them)

    @property
    def page_phase(self) -> int | None:
        """Offset within a page at which the tensor's first byte should be written so that its longest source
        run is copied page-aligned (None when it is all zeros)."""
        best, pos, phase = 0, 0, None
        for fd, offset, length in self.parts:
            if fd is not None and length > best:
                best, phase = length, (offset - pos) % PAGE
            pos += length
        return phase

    def checksummed(self, crc32) -> "Ranges":
        """These ranges with ``crc`` set to the CRC-32 of their bytes, read through short-lived maps of the
        source (no copy into this process; see :mod:`reshard.io.mapped`)."""
        crc = 0
        for fd, offset, length in self.parts:
            if fd is None:
                for start in range(0, length, len(_ZEROS)):
                    crc = crc32(memoryview(_ZEROS)[:min(len(_ZEROS), length - start)], crc)
            else:
                crc = crc32_of_range(fd, offset, length, crc, crc32)
        return replace(self, crc=crc)


def as_ranges(tensor: TargetTensor, files: list[TensorFile]) -> Ranges | None:
    """``tensor`` as contiguous source byte runs, or None when it needs a gather (column slice, cast, strides,
    a RoPE row order, a constant fill). A block of a stacked source or target is a run like any other."""
    if tensor.fill is not None or not tensor.shape or not direct(tensor, files):
        return None
    runs = []
    for op in tensor.reads:
        part = resolve(op, tensor, files)
        loc = part.source
        _, _, unit = split_at_axis(part.shape, part.axis, dtypes.itemsize(tensor.dtype))
        if op.interleave or op.rows is not None:
            return None
        if part.axis == 0:  # runs along dim 0 (or a 1-D tensor): the trailing dims must agree
            if tuple(loc.shape[1:]) != tuple(part.shape[1:]):
                return None
            start, length, at = op.src_start * unit, op.length * unit, part.base + op.dst_start * unit
        elif tuple(loc.shape) == part.shape and op.length == part.shape[part.axis]:
            start, length, at = 0, loc.nbytes, part.base  # the whole source tensor (or block)
        else:
            return None  # a column slice: strided in the source
        runs.append((at, files[op.source].fd, loc.offset + start, length))
    parts, pos = [], 0
    for at, fd, offset, length in sorted(runs, key=lambda run: run[0]):
        if at < pos:
            return None  # overlapping writes: not a plan this handles
        if at > pos:
            parts.append((None, 0, at - pos))
        parts.append((fd, offset, length))
        pos = at + length
    if pos < tensor.nbytes:
        parts.append((None, 0, tensor.nbytes - pos))
    return Ranges(tuple(parts), tensor.nbytes)


def data_phase(tensors: list[TargetTensor], files: list[TensorFile]) -> int | None:
    """Page offset for the start of a file's data section (its tensors back to back) that page-aligns the most
    copied bytes; None when nothing is copied."""
    votes: dict[int, int] = {}
    position = 0
    for tensor in tensors:
        ranges = as_ranges(tensor, files)
        if ranges is not None and ranges.page_phase is not None:
            phase = (ranges.page_phase - position) % PAGE
            votes[phase] = votes.get(phase, 0) + tensor.nbytes
        position += tensor.nbytes
    return max(sorted(votes), key=votes.__getitem__) if votes else None


def copy_into(file, ranges: Ranges, path: str) -> None:
    """Append ``ranges`` to the open binary ``file`` (a buffered writer), then leave its position after them.

    One thread per file: a second thread copying another part of the same file only waits (ext4 and XFS take the
    inode's lock for each buffered write), measured with ``perf`` as spinning on that lock."""
    file.flush()
    out = file.fileno()
    pos = file.tell()
    for fd, offset, length in ranges.parts:
        if fd is None:
            while length:
                n = os.pwrite(out, _ZEROS[:min(length, len(_ZEROS))], pos)
                pos, length = pos + n, length - n
            continue
        while length:
            n = _copy(fd, out, length, offset, pos, path)
            offset, pos, length = offset + n, pos + n, length - n
    file.seek(pos)


def _copy(fd: int, out: int, length: int, offset: int, pos: int, path: str) -> int:
    try:
        n = os.copy_file_range(fd, out, min(length, 1 << 30), offset, pos)
    except (AttributeError, OSError) as exc:  # no copy_file_range (macOS, old kernels, some filesystems)
        if isinstance(exc, OSError) and exc.errno not in (18, 22, 38, 95):  # EXDEV EINVAL ENOSYS EOPNOTSUPP
            raise
        data = os.pread(fd, min(length, _FALLBACK_CHUNK), offset)
        n = os.pwrite(out, data, pos) if data else 0
    if n == 0:
        from reshard.errors import CheckpointError

        raise CheckpointError(f"{path}: source ends early while copying (truncated?)")
    return n
