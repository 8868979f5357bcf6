"""A stored tensor described as pieces of canonical tensors laid end to end along one axis."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """Canonical rows ``[start, stop)`` of ``canonical`` along the stored tensor's axis; None = zero padding."""

    canonical: str | None
    start: int
    stop: int
    block: int | None = None  # in a stacked tensor (vLLM's [E, ...] experts): the index along dim 0
    # this piece's own RoPE row order, as StoredTensor.interleaved (which it overrides); negative: the stored rows
    # are in rotate-half order of canonical interleaved heads (Llama 4's q / k inside vLLM's qkv_proj)
    interleaved: int = 0

    @property
    def length(self) -> int:
        return self.stop - self.start


def padding(length: int) -> Piece:
    return Piece(None, 0, length)


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a layout stores it: ``shape`` with ``pieces`` concatenated along ``axis`` (of the stored
    tensor). ``transposed``: the layout stores the canonical ``[out, in]`` matrix as ``[in, out]`` (a GPT-2
    Conv1D), so a piece's canonical rows run along stored axis ``axis`` = 1 - the canonical split axis. A stacked
    tensor (``stacked``: vLLM's ``[E, rows, cols]`` experts) holds one 2-D block per index of dim 0, each made of
    the pieces with that ``block``, laid along ``axis`` (>= 1) within the block; stacked and transposed, each
    block is stored ``[in, out]`` (Megatron's legacy GroupedMLP ``weight1`` viewed as ``[E, H, 2I]``).
    ``interleaved`` (q and k in Meta's format): within each head's ``d`` rows, row ``2i + j`` holds canonical row
    ``j * d/2 + i`` (pairs rotate together instead of halves); pieces cover whole heads."""

    name: str
    shape: tuple[int, ...]
    axis: int
    pieces: tuple[Piece, ...]
    fill: float | None = None  # a constant tensor outside the canonical model (no pieces), e.g. vLLM scales
    dtype: str | None = None  # a fixed dtype that --dtype does not change (constants)
    transposed: bool = False
    stacked: bool = False
    interleaved: int = 0  # head dim d: rows inside each d-row head are in Meta's interleaved-RoPE order
    value_offset: float = 0.0  # stored values = canonical + this (Megatron's zero-centred GDN norm: -1)
    transform: str = ""  # stored values = this function of canonical (io/mamba_values.py: vLLM's A = -exp(A_log))
    # a target whose pack slots alternate (gpt-oss gate/up): along ``axis``, in units of this many rows, row 2i + j
    # holds row j * unit/2 + i of the pieces laid end to end (reshard/io/pair_rows.py; sources are unpaired first)
    pair_interleaved: int = 0
    file_shape: tuple[int, ...] | None = None  # the shape a safetensors header records for these bytes (Ernie [1, E])

    @property
    def canonical_axis(self) -> int:
        """The axis of the canonical tensors the pieces run along."""
        axis = self.axis - 1 if self.stacked else self.axis
        return 1 - axis if self.transposed else axis

    def offsets(self):
        """Yield (piece, offset along the axis) pairs (within its block for a stacked tensor)."""
        pos, block = 0, None
        for piece in self.pieces:
            if piece.block != block:
                pos, block = 0, piece.block
            yield piece, pos
            pos += piece.length
