"""Conversion over a torch.distributed world (``torchrun ... -m reshard convert SRC DST``).

Every process opens the source and makes the same plan; the target files are split over the world by the same
deterministic, byte-balanced partition as ``--workers`` (:func:`reshard.execute.partition`), and each process
writes its own files into one staging folder on the shared filesystem, reading only the source ranges they need.
No tensor travels over the network: the filesystem is the data path. The processes agree at three points, each a
gloo ``all_gather`` of one small status message per rank (no pickling):

1. ready: rank 0 has checked the destination and the replicas, taken the lock and made the staging folder
   (its path is rank 0's message); the others have planned;
2. written: every rank wrote its files;
3. published: rank 0 wrote the side files and renamed the staging folder to DST.

A rank that fails reports its one-line error at the next point, and every rank then fails with it (naming the
rank); nothing is published. A failure is also posted to the process group's key-value store, so the other ranks
stop writing at their next progress report instead of finishing their share. Progress (bytes) is summed in that
store and shown by rank 0 only.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from dataclasses import dataclass

from reshard.errors import ReshardError, one_line

MESSAGE_BYTES = 4096  # status (1 byte) + exit code (1) + UTF-8 text, zero-padded
TIMEOUT_ENV = "RESHARD_DIST_TIMEOUT"  # seconds a rank waits for the others at an agreement point
DEFAULT_TIMEOUT_S = 7200
_runs = 0  # conversions this process ran in a world: every rank counts the same, so store keys stay per run


def world_size_from_env() -> int:
    """The world size torchrun announces (``WORLD_SIZE`` with ``RANK``), 1 outside torchrun."""
    if "RANK" not in os.environ:
        return 1
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def log_prefix() -> str:
    """``[rank R] `` inside a torchrun world of 2 or more processes, else nothing."""
    return f"[rank {os.environ['RANK']}] " if world_size_from_env() > 1 else ""


_OK, _FAILED, _STOPPED = 0, 1, 2  # a rank's status at an agreement point (stopped: because another failed)


@dataclass
class Outcome:
    rank: int
    status: int  # _OK, _FAILED or _STOPPED
    exit_code: int
    text: str  # the error's one line, or the rank's message (rank 0's staging path at "ready")


class RankFailed(ReshardError):
    """Another rank of the world failed; raised on every rank that did not fail itself."""


def _timeout() -> datetime.timedelta:
    try:
        seconds = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    except ValueError:
        raise ReshardError(f"{TIMEOUT_ENV}={os.environ[TIMEOUT_ENV]!r} is not a number of seconds") from None
    return datetime.timedelta(seconds=seconds)


def _describe(exc: BaseException) -> tuple[str, int]:
    if isinstance(exc, ReshardError):
        return str(exc), exc.exit_code
    if isinstance(exc, OSError):
        from reshard.errors import os_error_message

        return os_error_message(exc), 3
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", 130
    first = (str(exc).strip().splitlines() or [""])[0]
    return one_line(f"{type(exc).__name__}: {first}"), 1


class World:
    """This process's place in a torchrun world: rank, size, a gloo group for agreements, the group's store."""

    def __init__(self, rank: int, size: int, group, store, owns_group: bool, prefix: str):
        self.rank, self.size, self.group, self.store, self.owns_group = rank, size, group, store, owns_group
        self.failed_key, self.bytes_key = f"{prefix}/failed", f"{prefix}/bytes"

    @classmethod
    def join(cls) -> World | None:
        """The torchrun world this process runs in (initialising a gloo process group from the environment if
        none is), or None outside torchrun or in a world of one."""
        if world_size_from_env() <= 1:
            return None
        import torch.distributed as dist

        owns = not dist.is_initialized()
        if owns:
            dist.init_process_group("gloo", timeout=_timeout())
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=_timeout())
        try:
            store = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):  # no store: progress stays per rank, no early stop
            store = None
        global _runs
        _runs += 1
        return cls(dist.get_rank(), dist.get_world_size(), group, store, owns, f"reshard/{_runs}")

    def close(self) -> None:
        if self.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()

    # ------------------------------------------------------------------------------------------ agreement

    def agree(self, error: BaseException | None, text: str = "") -> list[Outcome]:
        """Every rank's outcome of the step it just finished (a collective: every rank must call it). A rank that
        stopped only because another failed (:class:`RankFailed`) is marked so, and its failure is not posted."""
        import torch
        import torch.distributed as dist

        code, status = 0, _OK
        if error is not None:
            text, code = _describe(error)
            status = _STOPPED if isinstance(error, RankFailed) else _FAILED
            if status == _FAILED:
                self.post_failure(text)
        raw = text.encode()[:MESSAGE_BYTES - 2]
        mine = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        mine[0], mine[1] = status, min(code, 255)
        if raw:
            mine[2:2 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        gathered = [torch.zeros_like(mine) for _ in range(self.size)]
        dist.all_gather(gathered, mine, group=self.group)
        outcomes = []
        for rank, message in enumerate(gathered):
            body = bytes(message[2:].numpy()).rstrip(b"\0").decode(errors="replace")
            outcomes.append(Outcome(rank, int(message[0]), int(message[1]), body))
        return outcomes

    def step(self, work) -> list[Outcome]:
        """Run ``work()`` (returning this rank's message, or None), then agree; raise this rank's own error, or
        a :class:`RankFailed` naming the first rank that failed."""
        error: BaseException | None = None
        text = ""
        try:
            text = work() or ""
        except BaseException as exc:  # reported to every rank before it is raised here
            error = exc
        outcomes = self.agree(error, text)
        if error is not None and not isinstance(error, RankFailed):
            raise error
        failed = [o for o in outcomes if o.status == _FAILED] or [o for o in outcomes if o.status != _OK]
        if failed:
            first = failed[0]
            raise RankFailed(f"rank {first.rank} of {self.size} failed: {first.text}", exit_code=first.exit_code)
        return outcomes

    # ------------------------------------------------------------------------------------------ store

    def post_failure(self, text: str) -> None:
        if self.store is not None:
            try:
                self.store.set(self.failed_key, f"{self.rank}\t{text}")
            except RuntimeError:
                pass

    def failure(self) -> str | None:
        """Another rank's posted failure (``rank R: message``), or None."""
        if self.store is None or not self.store.check([self.failed_key]):
            return None
        rank, _, text = self.store.get(self.failed_key).decode(errors="replace").partition("\t")
        return f"rank {rank} of {self.size} failed: {text}"


class ProgressRelay:
    """Sends this rank's written bytes to the store every ``FLUSH_BYTES`` or ``FLUSH_S`` and checks there whether a
    rank failed; on rank 0 a thread shows the world's total on the progress bar."""

    FLUSH_BYTES = 64 << 20
    FLUSH_S = 0.5

    def __init__(self, world: World, bar):
        self.world, self.bar = world, bar
        self.pending, self.last, self.shown = 0, time.monotonic(), 0
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.poller = None
        if world.store is None:
            return
        if world.rank == 0 and bar is not None:
            self.poller = threading.Thread(target=self._poll, daemon=True, name="reshard-progress")
            self.poller.start()

    def __call__(self, n: int) -> None:
        if self.world.store is None:
            if self.bar is not None:
                self.bar.update(n)
            return
        with self.lock:
            self.pending += n
            now = time.monotonic()
            if self.pending < self.FLUSH_BYTES and now - self.last < self.FLUSH_S:
                return
            pending, self.pending, self.last = self.pending, 0, now
        self.world.store.add(self.world.bytes_key, pending)
        failure = self.world.failure()
        if failure is not None:
            raise RankFailed(failure)

    def _poll(self) -> None:
        while not self.stopped.wait(self.FLUSH_S):
            if not self._show():
                return

    def _show(self) -> bool:
        """Move rank 0's bar to the world's total; False when the store is gone."""
        try:
            total = self.world.store.add(self.world.bytes_key, 0)
        except RuntimeError:
            return False
        self.bar.update(total - self.shown)
        self.shown = total
        return True

    def close(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, 0
        if pending and self.world.store is not None:
            self.world.store.add(self.world.bytes_key, pending)
        self.stopped.set()
        if self.poller is not None:
            self.poller.join()
            self._show()
