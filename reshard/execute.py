"""Runs a plan: assembles target tensors from positioned source reads and streams them to their files.

Target files with the same tensor names (the TP ranks of one pipeline stage) are written in lockstep: the steps
of tensor index k fill the k-th tensor of every file of the group, so a source tensor they share (a row-parallel
weight split on dim 1) is read once for all of them. A tensor made of contiguous source byte runs is copied file
to file (:mod:`reshard.io.copy_ranges`; a zip record's CRC is first computed through a map of the source). The
others go through memory in row blocks of at most ``STEP_BYTES`` per step (:mod:`reshard.core.blocks`),
gathered into one of two reusable step buffers while the writer threads write the previous step from the other
one; the writers take a tensor block by block (a zip record's CRC-32 accumulated over its blocks). Two writer
threads share the files of a group, each file written by one of them, so the kernel's copies use two cores; a
read-ahead thread keeps the disk busy (:mod:`reshard.io.readahead`). Peak memory is two step buffers plus
bounded map windows, whatever the model, file or tensor size. How the files (and, for ``--workers``, the tensors
of a large safetensors file) are split over processes: :mod:`reshard.io.partition`.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass, replace

import numpy as np

from reshard.core.blocks import row_blocks
from reshard.core.plan import Plan, TargetFile, TargetTensor
from reshard.io import dtypes
from reshard.io.assemble import assemble, bits_equal, read_op, rope_rows  # noqa: F401
from reshard.io.casts import CastOverflowError, check_cast  # noqa: F401
from reshard.io.copy_ranges import Ranges, as_ranges, data_phase
from reshard.io.gather import Gatherer, direct
from reshard.io.heads import read_ahead_window
from reshard.io.readahead import ReadAhead, source_extents
from reshard.io.partition import Piece, aligned as _aligned, split_files
from reshard.io.partition import buffered_bytes, largest_tensor, lockstep_groups, partition  # noqa: F401
from reshard.io.safetensors_format import SafetensorsPart, SafetensorsWriter, create_sized, publish_sized
from reshard.io.tensorfile import TensorFile
from reshard.io.torch_format import TensorSlot, TorchZipWriter, crc32


def _fill_slots(payload, tensors: dict[str, TargetTensor]):
    if isinstance(payload, TensorSlot):
        t = tensors[payload.name]
        payload.dtype, payload.shape = t.dtype, tuple(t.shape)
    elif isinstance(payload, dict):
        for value in payload.values():
            _fill_slots(value, tensors)


def _safetensors_args(target: TargetFile, files: list[TensorFile]) -> tuple:
    return ([(t.name, t.dtype, t.file_shape or t.shape) for t in target.tensors], target.metadata,
            data_phase(target.tensors, files))


def open_writer(target: TargetFile, out_dir: str, files: list[TensorFile], piece: Piece | None = None):
    """A writer for ``target`` (for ``piece`` of it: tensors into the file :func:`create_split` made), laid out so
    that copied tensors land page-aligned with their source bytes."""
    path = os.path.join(out_dir, target.path)
    if piece is not None:
        entries, metadata, phase = _safetensors_args(target, files)
        return SafetensorsPart(path, entries, piece.start, piece.stop, metadata, phase)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if target.format == "distcp":
        from reshard.io.dcp import DistcpWriter

        shapes = target.payload["saved_shapes"]
        return DistcpWriter(path, [(t.name, t.dtype, tuple(t.shape), shapes[t.name]) for t in target.tensors],
                            target.payload["objects"])
    if target.format == "safetensors":
        return SafetensorsWriter(path, *_safetensors_args(target, files))
    _fill_slots(target.payload, {t.name: t for t in target.tensors})
    return TorchZipWriter(path, target.payload, [t.name for t in target.tensors])


# ---------------------------------------------------------------------------------------------- one process

#: Writer threads per process. The kernel's page-cache copies run on the calling thread, so a second lane puts
#: the second core to work; each target file is written by one lane only (its bytes stay in order).
WRITER_LANES = 2


class _Release:
    """Returns a step buffer to ``free`` once every lane has written its part of the step."""

    def __init__(self, buffer: np.ndarray, free: queue.Queue, parts: int):
        self.buffer, self.free, self.left = buffer, free, parts
        self.lock = threading.Lock()

    def done(self) -> None:
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self.free.put(self.buffer)


@dataclass
class _Job:
    writes: list  # (writer, name, copy_ranges.Ranges) or (writer, name, memoryview, total, first, last)
    release: _Release | None
    finish: list  # writers to finish after the writes
    done_bytes: int


class _Abandoned(Exception):
    """Set on the writer threads when the run is failing: remaining jobs are skipped."""


class _WriterThread(threading.Thread):
    """Writes its lane's jobs in order; releases each job's buffer share; an error stops this lane's writing."""

    def __init__(self, report, lane: int):
        super().__init__(daemon=True, name=f"reshard-writer-{lane}")
        self.jobs: queue.Queue = queue.Queue()
        self.report = report
        self.error: BaseException | None = None

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                if self.error is None:
                    for writer, name, view, *block in job.writes:
                        if isinstance(view, Ranges):
                            writer.write_ranges(name, view)
                        else:
                            writer.write_block(name, view, *block)
                    for writer in job.finish:
                        writer.finish()
                    if job.done_bytes:
                        self.report(job.done_bytes)
            except BaseException as exc:  # handed to the reading thread
                self.error = exc
            finally:
                if job.release is not None:
                    job.release.done()


#: Bytes one step buffers (the blocks of the files written in lockstep); two such buffers ping-pong. A tensor
#: larger than its file's share of a step is streamed in row blocks (:mod:`reshard.core.blocks`).
STEP_BYTES = 64 << 20
#: Bytes of a step's block built through torch at once (casts, transposes): the source rows it reads, the cast
#: and the overflow check each cost about this much (twice for a narrowing cast's source), not a whole step.
TORCH_BYTES = 8 << 20


@dataclass
class _Write:
    """One file's part of a step: a tensor copied file to file (``ranges``) or one row block of it (``block``)."""

    file: int  # index of the file in its lockstep unit
    tensor: TargetTensor
    ranges: Ranges | None
    block: TargetTensor | None
    first: bool
    last: bool


def unit_steps(targets: list[TargetFile], files: list[TensorFile], budget: int) -> list[list[_Write]]:
    """The steps that write ``targets`` in lockstep: for each tensor index k, its tensor in every file, either
    copied file to file (in the first step of k) or, when it goes through memory, cut into row blocks of at most
    the file's share of ``budget``; step b of k holds block b of every file that has one. Files with equal
    shapes (the TP ranks of a stage) get the same rows in the same step, so a source row block they all read a
    column slice of is read once."""
    share = max(1, budget // max(1, len(targets)))
    steps = []
    for k in range(len(targets[0].tensors) if targets else 0):
        per_file = []
        for target in targets:
            tensor = target.tensors[k]
            ranges = as_ranges(tensor, files)
            per_file.append((tensor, ranges, None if ranges is not None else row_blocks(tensor, share)))
        for b in range(max(1 if blocks is None else len(blocks) for _, _, blocks in per_file)):
            step = []
            for j, (tensor, ranges, blocks) in enumerate(per_file):
                if ranges is not None and b == 0:
                    step.append(_Write(j, tensor, ranges, None, True, True))
                elif blocks is not None and b < len(blocks):
                    step.append(_Write(j, tensor, None, blocks[b], b == 0, b == len(blocks) - 1))
            steps.append(step)
    return steps


def _buffered(step: list[_Write]) -> int:
    return sum(_aligned(w.block.nbytes) for w in step if w.block is not None)


class _Run:
    """Executes lockstep units in one process with two ping-pong step buffers and ``WRITER_LANES`` writers."""

    allow_overflow = False  # a cast may turn finite values into inf (--allow-cast-overflow)

    def __init__(self, files: list[TensorFile], targets: list[TargetFile], out_dir: str, report):
        self.files, self.targets, self.out_dir = files, targets, out_dir
        self.gather = Gatherer(files)
        self.free: queue.Queue = queue.Queue()
        lock = threading.Lock()

        def locked_report(n: int) -> None:
            with lock:
                report(n)

        self.lanes = [_WriterThread(locked_report, i) for i in range(WRITER_LANES)]
        self.open: list = []

    def _targets(self, unit) -> list[TargetFile]:
        if isinstance(unit, Piece):
            target = self.targets[unit.file]
            return [replace(target, tensors=target.tensors[unit.start:unit.stop])]
        return [self.targets[i] for i in unit]

    def run(self, units: list) -> None:
        plans = [(unit, unit_steps(self._targets(unit), self.files, STEP_BYTES)) for unit in units]
        size = max((_buffered(step) for _, steps in plans for step in steps), default=0)
        for _ in range(2):
            self.free.put(np.empty(size, np.uint8))
        for lane in self.lanes:
            lane.start()
        self.read_ahead = ReadAhead([[e for w in step for e in source_extents(w.block or w.tensor, self.files)]
                                     for _, steps in plans for step in steps], read_ahead_window())
        try:
            for unit, steps in plans:
                self._unit(unit, steps)
            self._drain()
            self._raise_writer_error()  # the last jobs (a file's finish: fsync, rename) ran after the loop
        except BaseException:
            self._abandon()
            for w in self.open:
                w.abort()
            raise
        finally:
            self.read_ahead.close()

    def _drain(self) -> None:
        for lane in self.lanes:
            if lane.is_alive():
                lane.jobs.put(None)
        for lane in self.lanes:
            lane.join()

    def _abandon(self) -> None:
        """On failure or a signal: the writers skip their queued jobs; wait only briefly for the write each is in
        (a daemon thread stuck on a slow or paused write must not keep the cleanup from running)."""
        for lane in self.lanes:
            if lane.error is None:
                lane.error = _Abandoned()
            if lane.is_alive():
                lane.jobs.put(None)
        for lane in self.lanes:
            if lane.is_alive():
                lane.join(timeout=5)

    def _build(self, block: TargetTensor, dest: np.ndarray) -> None:
        """Build ``block`` through torch into ``dest`` (its bytes in the step buffer), in sub-blocks of at most
        ``TORCH_BYTES`` each where it can be cut: a cast reads its source rows wider than it writes them (fp32
        masters into a bf16 output: twice), so a whole step's block would cost that much again beside the buffers."""
        at = 0
        for part in row_blocks(block, TORCH_BYTES):
            data = assemble(part, self.files, allow_overflow=self.allow_overflow)
            dest[at:at + part.nbytes] = data.contiguous().reshape(-1).view(dtypes.to_torch("U8")).numpy()
            at += part.nbytes
            del data  # freed before the next part is built

    def _take_buffer(self) -> np.ndarray:
        while True:
            self._raise_writer_error()
            try:
                return self.free.get(timeout=0.2)
            except queue.Empty:
                continue

    def _raise_writer_error(self) -> None:
        for lane in self.lanes:
            if lane.error is not None:
                raise lane.error

    def _unit(self, unit, steps: list[list[_Write]]) -> None:
        """Write ``unit``: lockstep files (a list of indices) or a :class:`Piece` of one file."""
        writers = []
        for i in [unit.file] if isinstance(unit, Piece) else unit:
            writers.append(open_writer(self.targets[i], self.out_dir, self.files,
                                       unit if isinstance(unit, Piece) else None))
            self.open.append(writers[-1])
        lanes = len(self.lanes)
        for step in steps:
            buffer = self._take_buffer()
            items, pos = [], 0
            writes: list[list] = [[] for _ in range(lanes)]
            done = [0] * lanes
            for w in step:
                writer, lane = writers[w.file], w.file % lanes
                if w.ranges is not None:  # copied file to file; a zip record's CRC is read through a map first
                    ranges = w.ranges if isinstance(writer, SafetensorsWriter) else w.ranges.checksummed(crc32)
                    writes[lane].append((writer, w.tensor.name, ranges))
                    done[lane] += w.tensor.nbytes
                    continue
                block = w.block
                dest = buffer[pos:pos + block.nbytes]
                pos += _aligned(block.nbytes)
                if direct(block, self.files):
                    items.append((block, dest))
                else:
                    self._build(block, dest)
                writes[lane].append((writer, w.tensor.name, memoryview(dest), w.tensor.nbytes, w.first, w.last))
                done[lane] += block.nbytes
            self.gather.fill(items)
            release = _Release(buffer, self.free, lanes)
            for lane, lane_writes, lane_done in zip(self.lanes, writes, done):
                lane.jobs.put(_Job(lane_writes, release, [], lane_done))
            self.read_ahead.step_done()
        for i, lane in enumerate(self.lanes):
            lane.jobs.put(_Job([], None, writers[i::lanes], 0))
        self._raise_writer_error()


def run_units(plan: Plan, files: list[TensorFile], out_dir: str, units: list, report) -> None:
    """Write ``units`` (lockstep groups of file indices, or :class:`Piece` s of files :func:`create_split` made)
    in this process."""
    run = _Run(files, plan.files, out_dir, report)
    run.allow_overflow = plan.allow_cast_overflow
    run.run(units)


def execute(plan: Plan, files: list[TensorFile], out_dir: str, progress: bool = True, workers: int = 1) -> None:
    """Write every target file of ``plan`` under ``out_dir``; with ``workers > 1`` the files, and when there are
    fewer than ``workers`` of them the safetensors files' tensors (:mod:`reshard.io.partition`), are split over
    that many processes (see :mod:`reshard.workers`). A file cut into pieces is created at its final size with
    its header here, before the fork, and renamed from ``.partial`` here once every worker succeeded. The bytes
    written do not depend on ``workers``."""
    from reshard.progress import byte_bar

    if workers > 1:
        from reshard.workers import run_in_workers

        shares = partition(plan, files, workers, split_files=True)
        if len(shares) > 1:
            split = [plan.files[i] for i in split_files(shares)]
            try:
                for target in split:
                    create_split(target, out_dir, files)
                run_in_workers(shares, lambda share, report: run_units(plan, files, out_dir, share, report),
                               files, plan.nbytes, progress)
            except BaseException:
                for target in split:
                    _remove(os.path.join(out_dir, target.path) + ".partial")
                raise
            for target in split:
                publish_sized(os.path.join(out_dir, target.path))
            return
        groups = shares[0] if shares else []
    else:
        groups = lockstep_groups(plan.files, largest_tensor(plan, files), files)
    with byte_bar(plan.nbytes, "converting", disable=not progress) as bar:
        run_units(plan, files, out_dir, groups, bar.update)


def create_split(target: TargetFile, out_dir: str, files: list[TensorFile]) -> None:
    """Create ``target``'s ``.partial`` with its header at its final size, for the workers' pieces to fill."""
    path = os.path.join(out_dir, target.path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    create_sized(path, *_safetensors_args(target, files))


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
