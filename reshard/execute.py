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
bounded map windows, whatever the model, file or tensor size.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass

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
from reshard.io.safetensors_format import SafetensorsWriter
from reshard.io.tensorfile import TensorFile
from reshard.io.torch_format import TensorSlot, TorchZipWriter, crc32

_ALIGN = 64


def _fill_slots(payload, tensors: dict[str, TargetTensor]):
    if isinstance(payload, TensorSlot):
        t = tensors[payload.name]
        payload.dtype, payload.shape = t.dtype, tuple(t.shape)
    elif isinstance(payload, dict):
        for value in payload.values():
            _fill_slots(value, tensors)


def open_writer(target: TargetFile, out_dir: str, files: list[TensorFile]):
    """A writer for ``target``, laid out so that copied tensors land page-aligned with their source bytes."""
    path = os.path.join(out_dir, target.path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if target.format == "distcp":
        from reshard.io.dcp import DistcpWriter

        shapes = target.payload["saved_shapes"]
        return DistcpWriter(path, [(t.name, t.dtype, tuple(t.shape), shapes[t.name]) for t in target.tensors],
                            target.payload["objects"])
    if target.format == "safetensors":
        return SafetensorsWriter(path, [(t.name, t.dtype, t.shape) for t in target.tensors], target.metadata,
                                 data_phase=data_phase(target.tensors, files))
    _fill_slots(target.payload, {t.name: t for t in target.tensors})
    return TorchZipWriter(path, target.payload, [t.name for t in target.tensors])


# ---------------------------------------------------------------------------------------------- scheduling

def _aligned(n: int) -> int:
    return n + (-n % _ALIGN)


def buffered_bytes(file: TargetFile, sources: list[TensorFile]) -> list[int]:
    """Buffer bytes of each tensor of ``file`` in its step: 0 for a tensor copied file to file (:func:`as_ranges`,
    it never passes through memory), else its size aligned."""
    return [0 if as_ranges(t, sources) is not None else _aligned(t.nbytes) for t in file.tensors]


def largest_tensor(plan: Plan, files: list[TensorFile]) -> int:
    """Bytes of the largest tensor the plan reads or writes."""
    read = {(op.source, op.tensor) for f in plan.files for t in f.tensors for op in t.reads}
    sizes = [files[s].tensors[name].nbytes for s, name in read] + [t.nbytes for f in plan.files for t in f.tensors]
    return max(sizes, default=0)


def lockstep_groups(files: list[TargetFile], limit: int, sources: list[TensorFile]) -> list[list[int]]:
    """Indices of target files grouped by identical tensor names (in first-appearance order), each group cut so
    that one step (the k-th tensor of every file in it) buffers at most ``limit`` bytes plus 10% (vocab
    padding). Each file's tensors are sized once (the group's steps are running sums), so the cost is linear in
    the files, not quadratic."""
    by_names: dict[tuple, list[int]] = {}
    for i, f in enumerate(files):
        by_names.setdefault((f.format, tuple(t.name for t in f.tensors)), []).append(i)
    cap = limit + limit // 10 + _ALIGN * len(files)
    groups = []
    for members in by_names.values():
        current: list[int] = []
        steps: list[int] = []
        for i in members:
            sizes = buffered_bytes(files[i], sources)
            grown = [a + b for a, b in zip(steps, sizes)] if current else sizes
            if current and max(grown, default=0) > cap:
                groups.append(current)
                current, grown = [], sizes
            current.append(i)
            steps = grown
        groups.append(current)
    return groups


def _split_for_workers(groups: list[list[int]], workers: int) -> list[list[int]]:
    """Halve the largest groups until there are at least ``workers`` units (or every unit is one file)."""
    units = [list(g) for g in groups]
    while len(units) < workers:
        big = max(range(len(units)), key=lambda i: len(units[i]))
        if len(units[big]) < 2:
            break
        g = units.pop(big)
        units[big:big] = [g[:len(g) // 2], g[len(g) // 2:]]
    return units


def assign(units: list[list[int]], files: list[TargetFile], workers: int) -> list[list[list[int]]]:
    """Balance units over workers by bytes (largest first, ties to the lowest worker): deterministic."""
    loads = [0] * workers
    shares: list[list[list[int]]] = [[] for _ in range(workers)]
    for unit in sorted(units, key=lambda u: -sum(files[i].nbytes for i in u)):
        w = min(range(workers), key=lambda j: (loads[j], j))
        shares[w].append(unit)
        loads[w] += sum(files[i].nbytes for i in unit)
    return [s for s in shares if s]


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

    def run(self, units: list[list[int]]) -> None:
        plans = [(unit, unit_steps([self.targets[i] for i in unit], self.files, STEP_BYTES)) for unit in units]
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

    def _unit(self, unit: list[int], steps: list[list[_Write]]) -> None:
        targets = [self.targets[i] for i in unit]
        writers = []
        for t in targets:
            writers.append(open_writer(t, self.out_dir, self.files))
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


def run_units(plan: Plan, files: list[TensorFile], out_dir: str, units: list[list[int]], report) -> None:
    run = _Run(files, plan.files, out_dir, report)
    run.allow_overflow = plan.allow_cast_overflow
    run.run(units)


def execute(plan: Plan, files: list[TensorFile], out_dir: str, progress: bool = True, workers: int = 1) -> None:
    """Write every target file of ``plan`` under ``out_dir``; with ``workers > 1`` files are split over that
    many processes (see :mod:`reshard.workers`). The bytes written do not depend on ``workers``."""
    from reshard.progress import byte_bar

    if workers > 1:
        from reshard.workers import run_in_workers

        shares = partition(plan, files, workers)
        if len(shares) > 1:
            run_in_workers(shares, lambda share, report: run_units(plan, files, out_dir, share, report),
                           files, plan.nbytes, progress)
            return
        groups = shares[0] if shares else []
    else:
        groups = lockstep_groups(plan.files, largest_tensor(plan, files), files)
    with byte_bar(plan.nbytes, "converting", disable=not progress) as bar:
        run_units(plan, files, out_dir, groups, bar.update)


def partition(plan: Plan, files: list[TensorFile], parts: int) -> list[list[list[int]]]:
    """The target files split into at most ``parts`` shares of lockstep units, balanced by bytes; deterministic,
    so every process of a distributed run computes the same split (``--workers`` and torchrun)."""
    groups = lockstep_groups(plan.files, largest_tensor(plan, files), files)
    return assign(_split_for_workers(groups, parts), plan.files, parts)
