"""Failure handling for a live transfer: every participant raises within ``timeout`` when any of them fails.

The status board is the process group's store (the rendezvous ``TCPStore``), under a prefix of its own per
transfer call: ``failed`` (the first failure's message, set by the rank that raised), ``progress`` (a counter every
rank bumps after each round it completes), ``done/<rank>``, and the agreement's keys (:mod:`reshard.live.agree`:
each rank's record and plan summary, judged before any byte moves; ``reshard_live/at/<rank>``, outside the
prefix, says which transfer a rank is in). A rank waiting for its messages, or at the end for
the other ranks' ``done``, polls its own operations and the board: it raises as soon as ``failed`` is set, when
its operations fail (a peer's socket closed: a dead process), when the store itself is gone, or when ``progress``
has not moved for ``timeout`` seconds (a hung or killed peer). The ranks waiting are thus bounded by ``timeout``
after the last progress any rank made, however long the whole transfer takes.
"""

from __future__ import annotations

import threading
import time

from reshard.errors import ReshardError

_CALLS: dict[tuple[int, ...], int] = {}  # participants -> transfers started, the same on every participant


def started(participants) -> int:
    """How many transfers between ``participants`` (process ranks) this process has started."""
    return _CALLS.get(tuple(participants), 0)


class TransferError(ReshardError):
    """A live transfer failed on this rank or another; every participant raises it (or its own error)."""

    exit_code = 1


def group_store(group):
    """The store of ``group`` (None: the default group)."""
    from torch.distributed import distributed_c10d as c10d

    pg = group if group is not None else c10d._get_default_group()
    return c10d._get_process_group_store(pg)


class Watch:
    """The board of one transfer call between ``participants`` (process ranks), seen from rank ``me``."""

    POLL_STORE = 0.05  # seconds between looks at the board while waiting

    def __init__(self, store, participants: list[int], me: int, timeout: float, label: str = ""):
        key = tuple(participants)
        call = _CALLS.get(key, 0)
        _CALLS[key] = call + 1
        self.store, self.participants, self.me, self.timeout = store, participants, me, float(timeout)
        self.call = call  # this transfer's index among the calls between ``participants``
        self.prefix = f"reshard_live/{label}{'-'.join(map(str, key))}/{call}/"
        self.seen = -1
        self.clear: list[str] = []  # more keys the last one out deletes (the agreement's records)
        self.deadline = time.monotonic() + self.timeout

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _board(self, action):
        """``action()`` on the store; a store that is gone (its host, rank 0's process, died) raises."""
        try:
            return action()
        except Exception as exc:
            raise TransferError(f"rank {self.me}: lost the process group's store ({type(exc).__name__}: {exc}): "
                                "a rank died") from exc

    def check(self, late=None) -> None:
        """Raise if another rank failed; extend the deadline if any rank progressed; raise past the deadline
        (``late()``: the message then, else "no rank made progress")."""
        failed = self._key("failed")
        if self._board(lambda: self.store.check([failed])):
            message = self._board(lambda: self.store.get(failed)).decode()
            raise TransferError(f"live transfer failed on another rank: {message}")
        count = self._board(lambda: self.store.add(self._key("progress"), 0))
        now = time.monotonic()
        if count != self.seen:
            self.seen, self.deadline = count, now + self.timeout
        elif now > self.deadline:
            if late is not None:
                raise TransferError(late())
            raise TransferError(f"rank {self.me}: no rank made progress for {self.timeout:g} s: a peer hung or died")

    def progressed(self) -> None:
        self._board(lambda: self.store.add(self._key("progress"), 1))

    def wait(self, works, what: str) -> None:
        """Wait for ``works`` (torch.distributed Work objects), watching the board meanwhile. A daemon thread
        waits on them (gloo's point-to-point works only complete inside ``wait``, and a ``wait`` with a timeout
        breaks the pair); when this rank gives up, the thread ends with its peer, or at the group's timeout."""
        done, errors = threading.Event(), []

        def run() -> None:
            try:
                for w in works:
                    w.wait()
            except BaseException as exc:  # a failed operation: a peer's closed socket, the group's timeout
                errors.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name="reshard-live-wait", daemon=True).start()
        try:
            while not done.wait(self.POLL_STORE):
                self.check()
        except TransferError:
            # Give the pending operation a moment to fail too (its peer gives up and exits, closing the socket):
            # a process that exits with one still blocked aborts in torch's teardown.
            done.wait(min(self.timeout / 2, 10.0))
            raise
        if errors:
            self.check()  # a peer that failed posted why before its sockets closed: report that
            raise TransferError(f"rank {self.me}: {what} failed ({type(errors[0]).__name__}: {errors[0]}): a peer "
                                "died or gave up") from errors[0]

    def finish(self) -> None:
        """Say this rank is done and wait until every participant is; the last one out clears the board."""
        self._board(lambda: self.store.set(self._key(f"done/{self.me}"), "1"))
        done = [self._key(f"done/{r}") for r in self.participants]
        while not self._board(lambda: self.store.check(done)):
            self.check()
            time.sleep(self.POLL_STORE / 5)
        if self._board(lambda: self.store.add(self._key("exit"), 1)) == len(self.participants):
            for key in done + self.clear + [self._key("progress"), self._key("exit")]:
                self._board(lambda: self.store.delete_key(key))

    def fail(self, exc: BaseException) -> None:
        """Post this rank's failure (the first posted is the one everybody reports); never raises."""
        if isinstance(exc, TransferError) and "on another rank" in str(exc):
            return
        try:
            if not self.store.check([self._key("failed")]):
                self.store.set(self._key("failed"), f"rank {self.me}: {type(exc).__name__}: {exc}")
        except Exception:
            pass
