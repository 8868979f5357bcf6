"""Runs a digest verify's tensor pairs in this process or in ``--workers`` forked processes, and estimates, before
anything is read, the bytes each process reads and its peak memory (``verify --dry-run``).

Shares are balanced by bytes (largest pair first, to the least loaded process): deterministic. Each worker
sends its results back as one-line messages (:mod:`reshard.workers`); results are returned in task order.
"""

from __future__ import annotations

from dataclasses import asdict

from reshard.io.tensorfile import TensorFile
from reshard.verification.block_stream import BLOCK_BYTES, PairTask, buffer_sizes, run_pairs, steps_of
from reshard.verification.compare import TensorResult

#: Resident memory of a verify process before it reads anything (the interpreter, torch, numpy, reshard;
#: measured as the peak RSS of ``import reshard.cli, torch``).
BASELINE_BYTES = 240 << 20
#: The error figures' working set: about six chunks of :data:`reshard.verification.compare._CHUNK` elements in float64.
FIGURES_BYTES = 6 * (8 << 20)


def shares_of(tasks: list[PairTask], workers: int) -> list[list[int]]:
    """Task indices per process (at most ``workers`` non-empty shares), balanced by bytes."""
    loads = [0] * max(1, workers)
    shares: list[list[int]] = [[] for _ in loads]
    for i in sorted(range(len(tasks)), key=lambda i: (-tasks[i].nbytes, i)):
        w = min(range(len(loads)), key=lambda j: (loads[j], j))
        shares[w].append(i)
        loads[w] += tasks[i].nbytes
    return [sorted(s) for s in shares if s]


def run_tasks(tasks: list[PairTask], files: list[TensorFile], workers: int, progress: bool,
              block_bytes: int = BLOCK_BYTES) -> list[TensorResult]:
    """Results of ``tasks`` in order; ``files``: every source file the tasks read (closed in forked workers)."""
    from reshard.progress import byte_bar

    total = sum(t.nbytes for t in tasks)
    shares = shares_of(tasks, workers)
    if len(shares) > 1:
        from reshard.workers import run_in_workers

        def work(share, report):
            results = run_pairs([tasks[i] for i in share], block_bytes, report)
            return [{"index": i, **asdict(r)} for i, r in zip(share, results)]

        items = run_in_workers(shares, work, files, total, progress, desc="verifying")
        by_index = {item.pop("index"): TensorResult(**item) for item in items}
        return [by_index[i] for i in range(len(tasks))]
    with byte_bar(total, "verifying", disable=not progress) as bar:
        return run_pairs(tasks, block_bytes, bar.update)


def estimate(tasks: list[PairTask], a_files: list[TensorFile], workers: int, block_bytes: int = BLOCK_BYTES
             ) -> list[dict]:
    """Per process: its tensor pairs, the bytes it reads from A (``a_files``) and from B, its largest block, and
    an upper estimate of its peak resident memory: the baseline, two buffer sets, the figures' chunks, and a
    pair that cannot be cut into blocks read whole (twice: through torch)."""
    rows = []
    for share in shares_of(tasks, workers):
        mine = [tasks[i] for i in share]
        steps = steps_of(mine, block_bytes)
        size_a, size_b = buffer_sizes(steps, block_bytes)
        whole = max((2 * (s.a.nbytes + s.b.nbytes) for s in steps
                     if s.a.nbytes > block_bytes or s.b.nbytes > block_bytes), default=0)
        from_a = sum((t.a.nbytes if t.files_a is a_files else 0) + (t.b.nbytes if t.files_b is a_files else 0)
                     for t in mine)
        rows.append({"pairs": len(mine), "read_a": from_a, "read_b": sum(t.nbytes for t in mine) - from_a,
                     "largest_block": max(size_a, size_b),
                     "peak_estimate": BASELINE_BYTES + 2 * (size_a + size_b) + FIGURES_BYTES + whole})
    return rows
