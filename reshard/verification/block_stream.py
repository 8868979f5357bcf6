"""Runs tensor-pair comparisons block by block: the caller's thread reads, two threads hash and compare.

Each :class:`PairTask` is cut into row blocks (:func:`reshard.io.block_pairs.paired_blocks`). The calling thread
reads block k of both sides into one of two buffer sets while two lanes work on block k - 1 from the other set:
for a pair of one dtype, SHA-256 of A in one and SHA-256 of B plus the byte comparison in the other; for a cast
pair, both digests in one and the error figures in the other. A set is refilled once both lanes are done with
it. Each lane is a FIFO, so a tensor's digest is updated in row order.
The positioned reads and hashlib release the GIL: on two cores, reading and both digests overlap. A read-ahead
thread asks the kernel for the next blocks' source bytes (:class:`reshard.io.readahead.ReadAhead`). Peak
memory: two sets of one block per side plus the figures' chunks, whatever the tensor or model size.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from reshard.core.plan import ReplicaCheck, TargetTensor
from reshard.io.block_pairs import extents, op_tensor, paired_blocks, read_block
from reshard.io.gather import Gatherer
from reshard.io.heads import read_ahead_window
from reshard.io.readahead import ReadAhead
from reshard.io.tensorfile import TensorFile
from reshard.verification.compare import BlockComparison, TensorResult

#: Bytes of one block on each side (the converter's step share for two files).
BLOCK_BYTES = 32 << 20


@dataclass
class PairTask:
    """Compare tensor ``a`` (read from ``files_a``) with tensor ``b`` (from ``files_b``)."""

    a: TargetTensor
    b: TargetTensor
    files_a: list[TensorFile]
    files_b: list[TensorFile]
    comparison: BlockComparison

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes


@dataclass
class _Step:
    task: PairTask
    a: TargetTensor
    b: TargetTensor


def steps_of(tasks: list[PairTask], budget: int) -> list[_Step]:
    return [_Step(t, a, b) for t in tasks for a, b in paired_blocks(t.a, t.b, budget)]


def buffer_sizes(steps: list[_Step], budget: int) -> tuple[int, int]:
    """Bytes of each side's buffer: its largest block, at most ``budget`` (a pair that cannot be cut is read into
    memory of its own)."""
    fitting = [(s.a.nbytes, s.b.nbytes) for s in steps if s.a.nbytes <= budget and s.b.nbytes <= budget]
    return max((a for a, _ in fitting), default=0), max((b for _, b in fitting), default=0)


def run_pairs(tasks: list[PairTask], budget: int = BLOCK_BYTES, report=None) -> list[TensorResult]:
    """Compare every task, streaming; ``report(n)`` is called with the bytes of each block pair read."""
    steps = steps_of(tasks, budget)
    size_a, size_b = buffer_sizes(steps, budget)
    sets = [(np.empty(size_a, np.uint8), np.empty(size_b, np.uint8)) for _ in range(2)]
    gatherers: dict[int, Gatherer] = {}

    def gatherer(files: list[TensorFile]) -> Gatherer:
        return gatherers.setdefault(id(files), Gatherer(files))

    ahead = ReadAhead([extents(s.a, s.task.files_a) + extents(s.b, s.task.files_b) for s in steps],
                      read_ahead_window())
    lane_a, lane_b = ThreadPoolExecutor(1, "reshard-verify-a"), ThreadPoolExecutor(1, "reshard-verify-b")
    pending: list[list] = [[], []]
    threads = _single_threaded_torch(any(t.comparison.cast for t in tasks))
    try:
        for k, step in enumerate(steps):
            slot = k % 2
            for future in pending[slot]:
                future.result()
            data_a = read_block(step.a, step.task.files_a, gatherer(step.task.files_a), sets[slot][0])
            data_b = read_block(step.b, step.task.files_b, gatherer(step.task.files_b), sets[slot][1])
            ahead.step_done()
            comparison = step.task.comparison
            if comparison.cast:  # the check computes figures: it gets a lane of its own
                pending[slot] = [lane_a.submit(_hash_both, comparison, data_a, data_b),
                                 lane_b.submit(comparison.check, data_a, data_b, step.a.shape, step.b.shape)]
            else:  # the check compares bytes: cheap beside a digest
                pending[slot] = [lane_a.submit(comparison.hash_a, data_a),
                                 lane_b.submit(_hash_and_check, comparison, data_a, data_b, step.a.shape,
                                               step.b.shape)]
            if report is not None:
                report(step.a.nbytes + step.b.nbytes)
        for futures in pending:
            for future in futures:
                future.result()
    finally:
        ahead.close()
        lane_a.shutdown(cancel_futures=True)
        lane_b.shutdown(cancel_futures=True)
        if threads:
            sys.modules["torch"].set_num_threads(threads)
    return [t.comparison.result() for t in tasks]


def _single_threaded_torch(casts: bool) -> int:
    """Run torch's error figures on one thread while the comparison runs (returns the count to restore; 0: none).
    The read and the two lanes already keep the cores busy: an OpenMP team of two waiting at its barriers for a
    core ran the figures six times slower here. ``casts``: figures are certain, import torch now."""
    if casts:
        import torch  # noqa: F401
    torch = sys.modules.get("torch")
    if torch is None or torch.get_num_threads() == 1:
        return 0
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    return previous


def _hash_both(comparison: BlockComparison, a: np.ndarray, b: np.ndarray) -> None:
    comparison.hash_a(a)
    comparison.hash_b(b)


def _hash_and_check(comparison: BlockComparison, a: np.ndarray, b: np.ndarray, shape_a: tuple[int, ...],
                    shape_b: tuple[int, ...]) -> None:
    comparison.hash_b(b)
    comparison.check(a, b, shape_a, shape_b)


def replica_tasks(checks: list[ReplicaCheck], files: list[TensorFile]) -> list[PairTask]:
    """One task per replica check: the copy that is read against another stored copy, bytes compared."""
    tasks = []
    for check in checks:
        first, other = op_tensor(check.first, check.axis, files), op_tensor(check.other, check.axis, files)
        tasks.append(PairTask(first, other, files, files,
                              BlockComparison(check.canonical, first.dtype, other.dtype, hashing=False)))
    return tasks


def replica_problem(check: ReplicaCheck, result: TensorResult, source_names: list[str]) -> str | None:
    """The message for a replica check whose copies differ; None when they hold the same bytes."""
    if result.status == "equal":
        return None
    how = f"max difference {result.max_abs:g}" if result.max_abs is not None else "shapes differ"
    if result.dtype_a != result.dtype_b:
        how = f"stored as {result.dtype_a} vs {result.dtype_b}, " + how
    return (f"replicas of '{check.canonical}' differ: {check.first.tensor} in {source_names[check.first.source]} "
            f"vs {check.other.tensor} in {source_names[check.other.source]} ({how})")
