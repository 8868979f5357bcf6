"""Runs a digest verify's tensor pairs in this process or in ``--workers`` forked processes, and estimates, before
anything is read, the bytes each process reads and its peak memory (``verify --dry-run``).

With several processes the pairs are cut into batches (largest pair first; small pairs grouped up to
:func:`batch_target` bytes, each batch read in checkpoint order) and each process claims the next batch from a
shared counter whenever it is free, so a process slowed by its reads or a large tensor never leaves the others
idle at the end (a fixed split by bytes did: the tail of the slowest share). Each worker sends its results back as
one-line messages (:mod:`reshard.workers`); results are returned in task order. The estimate uses the split
by bytes a claiming run approaches (largest pair first, to the least loaded process).
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


def batch_target(total: int, workers: int) -> int:
    """Bytes of a batch of small pairs: an eighth of a process's fair share, or up to 64 MiB (a half share at
    most) where that is smaller: each batch ends the overlap of reads and digests once."""
    share = total // max(1, workers)
    return max(1, share // 8, min(64 << 20, share // 2))


def batches_of(tasks: list[PairTask], workers: int) -> list[list[int]]:
    """Task indices in claim order: largest pair first, pairs below :func:`batch_target` grouped; each batch in
    task (checkpoint) order."""
    target = batch_target(sum(t.nbytes for t in tasks), workers)
    out: list[list[int]] = []
    current, size = [], 0
    for i in sorted(range(len(tasks)), key=lambda i: (-tasks[i].nbytes, i)):
        current.append(i)
        size += tasks[i].nbytes
        if size >= target:
            out.append(sorted(current))
            current, size = [], 0
    if current:
        out.append(sorted(current))
    return out


def processes_for(tasks: list[PairTask], workers: int) -> int:
    """Processes a run of ``tasks`` at ``workers`` starts: no more than there are batches to claim."""
    return max(1, min(workers, len(batches_of(tasks, workers)))) if workers > 1 and len(tasks) > 1 else 1


def run_tasks(tasks: list[PairTask], files: list[TensorFile], workers: int, progress: bool,
              block_bytes: int = BLOCK_BYTES) -> list[TensorResult]:
    """Results of ``tasks`` in order; ``files``: every source file the tasks read (closed in forked workers)."""
    from reshard.progress import byte_bar

    total = sum(t.nbytes for t in tasks)
    processes = processes_for(tasks, workers) if all(getattr(f, "fork_safe", True) for f in files) else 1
    if processes > 1:
        import multiprocessing

        from reshard.workers import run_in_workers

        batches = batches_of(tasks, workers)
        claimed = multiprocessing.get_context("fork").Value("q", 0)  # shared by the forked workers

        def work(_, report):
            out = []
            while True:
                with claimed.get_lock():
                    k = claimed.value
                    claimed.value = k + 1
                if k >= len(batches):
                    return out
                results = run_pairs([tasks[i] for i in batches[k]], block_bytes, report)
                out += [{"index": i, **asdict(r)} for i, r in zip(batches[k], results)]

        items = run_in_workers(list(range(processes)), work, files, total, progress, desc="verifying")
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
