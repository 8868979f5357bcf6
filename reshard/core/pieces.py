"""A stored tensor described as pieces of canonical tensors laid end to end along one axis."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """Canonical rows ``[start, stop)`` of ``canonical`` along the stored tensor's axis; None = zero padding."""

    canonical: str | None
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


def padding(length: int) -> Piece:
    return Piece(None, 0, length)


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a layout stores it: ``shape`` with ``pieces`` concatenated along ``axis``."""

    name: str
    shape: tuple[int, ...]
    axis: int
    pieces: tuple[Piece, ...]
    fill: float | None = None  # a constant tensor outside the canonical model (no pieces), e.g. vLLM scales
    dtype: str | None = None  # a fixed dtype that --dtype does not change (constants)

    def offsets(self):
        """Yield (piece, offset along the axis) pairs."""
        pos = 0
        for piece in self.pieces:
            yield piece, pos
            pos += piece.length
