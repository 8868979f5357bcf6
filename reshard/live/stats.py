"""What one rank's live transfer moved: payload bytes per peer, messages, local copies, seconds."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Stats:
    """One rank's counts. ``sent`` / ``received``: peer process rank -> payload bytes (alignment excluded);
    ``local_bytes``: bytes copied between this process's own source and target tensors; ``allocated``: target
    tensors allocated because ``into`` did not give them."""

    rank: int
    sent: dict[int, int] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)
    local_bytes: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    rounds: int = 0
    seconds: float = 0.0
    allocated: list[str] = field(default_factory=list)

    @property
    def bytes_sent(self) -> int:
        return sum(self.sent.values())

    @property
    def bytes_received(self) -> int:
        return sum(self.received.values())

    def count_send(self, peer: int, nbytes: int) -> None:
        self.sent[peer] = self.sent.get(peer, 0) + nbytes

    def count_receive(self, peer: int, nbytes: int) -> None:
        self.received[peer] = self.received.get(peer, 0) + nbytes

    def as_dict(self) -> dict:
        return dict(asdict(self), bytes_sent=self.bytes_sent, bytes_received=self.bytes_received)

    def __str__(self) -> str:
        return (f"rank {self.rank}: sent {self.bytes_sent} B in {self.messages_sent} messages, received "
                f"{self.bytes_received} B in {self.messages_received}, copied {self.local_bytes} B locally, "
                f"{self.seconds:.3f} s")


class Received(dict):
    """The target tensors a rank got (name -> tensor; ``into``'s own objects where given), with :attr:`stats`."""

    stats: Stats
