"""Asks the kernel to read source bytes before the converter needs them (``posix_fadvise(WILLNEED)``).

The advice queues reads and returns; the pages land in the page cache, not in this process, so peak RSS does
not change, and correctness never depends on it (a page that has not arrived is read when it is touched).
:class:`ReadAhead` walks the executor's steps up to a bounded window ahead of it, so the disk works with deep
queues while cached data is being processed. (Reads before any plan exists: :mod:`reshard.io.heads`.)
"""

from __future__ import annotations

import os
import threading

from reshard.core.plan import TargetTensor
from reshard.io import dtypes
from reshard.io.gather import split_at_axis
from reshard.io.heads import SUPPORTED
from reshard.io.tensorfile import TensorFile, block_location


def source_extents(tensor: TargetTensor, files: list[TensorFile]) -> list[tuple[int, int, int]]:
    """``(fd, offset, length)`` of the source bytes ``tensor`` reads: the rows of a slice along the first
    non-trivial axis (within its block, for a block of a stacked source), else the whole source tensor (or block)
    that a column slice touches."""
    extents = []
    for op in tensor.reads:
        file = files[op.source]
        if not file.direct_bytes:  # bytes in segments of several files (DeepSpeed partitions)
            extents += file.extents(op.tensor)
            continue
        loc = file.tensors[op.tensor]
        axis = op.source_axis(tensor.axis)
        if op.src_block is not None:
            loc, axis = block_location(loc, op.src_block) or loc, axis - 1
        if loc.shape and loc.strides is None and axis < len(loc.shape):  # a RoPE reorder reads the same rows
            outer, _, unit = split_at_axis(loc.shape, axis, dtypes.itemsize(loc.dtype))
            if outer == 1:
                extents.append((file.fd, loc.offset + op.src_start * unit, op.length * unit))
                continue
            if op.rows is not None:  # a row block of a column slice: the rows it spans
                row = loc.nbytes // loc.shape[0]
                extents.append((file.fd, loc.offset + op.rows[0] * row, (op.rows[1] - op.rows[0]) * row))
                continue
        extents.append((file.fd, loc.offset, loc.nbytes))
    return extents


def _merged(extents: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Sorted, deduplicated and coalesced (ranks in lockstep reading one source tensor ask once)."""
    out: list[list[int]] = []
    for fd, offset, length in sorted(set(extents)):
        if length <= 0:
            continue
        if out and out[-1][0] == fd and offset <= out[-1][1] + out[-1][2]:
            out[-1][2] = max(out[-1][2], offset + length - out[-1][1])
        else:
            out.append([fd, offset, length])
    return [(fd, offset, length) for fd, offset, length in out]


class ReadAhead:
    """Advises the source ranges of ``steps`` (in the order the executor consumes them) on a daemon thread,
    staying at most ``window`` bytes ahead of the last step reported done (always at least one step)."""

    def __init__(self, steps: list[list[tuple[int, int, int]]], window: int):
        self.steps = [_merged(s) for s in steps]
        self.sizes = [sum(e[2] for e in s) for s in self.steps]
        self.window = window
        self._done = 0
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True, name="reshard-read-ahead")
        if SUPPORTED and window > 0:
            self._thread.start()

    def step_done(self) -> None:
        with self._cond:
            self._done += 1
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _wait_turn(self, step: int) -> bool:
        """Block until ``step`` fits in the window; False when it is no longer worth advising."""
        with self._cond:
            while not self._closed and self._done < step:
                if sum(self.sizes[self._done:step + 1]) <= self.window:
                    break
                self._cond.wait()
            return not self._closed and self._done <= step

    def _run(self) -> None:
        for step, extents in enumerate(self.steps):
            if not self._wait_turn(step):
                if self._closed:
                    return
                continue
            try:
                for fd, offset, length in extents:
                    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
            except OSError:  # a hint: a closed descriptor ends read-ahead
                return
