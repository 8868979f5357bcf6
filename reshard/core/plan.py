"""Plans: for every target tensor, which byte ranges of which source tensors fill it. Plain data, no I/O.

The planner intersects the target's pieces (canonical row ranges along the split axis) with the source's pieces.
Where several source tensors hold the same canonical rows (replicated norms, tied copies, KV replicas), the
first one in source order is read and the others become :class:`ReplicaCheck` entries, compared before writing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from reshard.core.pieces import StoredTensor
from reshard.errors import CheckpointError
from reshard.io.dtypes import itemsize
from reshard.io import mamba_values


@dataclass(frozen=True)
class ReadOp:
    """Copy ``length`` rows along the target's ``axis`` of source tensor ``tensor`` (file ``source``) from
    ``src_start`` into the target tensor at ``dst_start``. ``transposed``: the source holds the matrix in the
    other orientation (one of them stores ``[in, out]``): read along the source's other axis and transpose."""

    source: int
    tensor: str
    src_start: int
    length: int
    dst_start: int
    transposed: bool = False
    src_block: int | None = None  # a stacked source tensor: the block (dim 0 index) read from
    dst_block: int | None = None  # a stacked target tensor: the block written to
    interleave: int = 0  # RoPE row order: +d reorders interleaved source heads to halves, -d halves to interleaved
    rows: tuple[int, int] | None = None  # an op along axis >= 1 restricted to source rows [start, stop) of dim 0
    shift: float = 0.0  # added to the values read (the target's value offset less the source's; exact near 1)
    transform: str = ""  # a value transform of the values read (reshard/io/mamba_values.py)

    def source_axis(self, target_axis: int) -> int:
        """The source tensor's axis the op reads along (within its block when stacked)."""
        if self.dst_block is not None:
            target_axis -= 1
        axis = 1 - target_axis if self.transposed else target_axis
        return axis + 1 if self.src_block is not None else axis

    @property
    def blocked(self) -> bool:
        return self.src_block is not None or self.dst_block is not None


@dataclass
class TargetTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    axis: int
    reads: list[ReadOp]
    has_padding: bool = False
    fill: float | None = None  # every element is this constant (no reads)
    pair_interleaved: int = 0  # rows reordered after assembly (StoredTensor.pair_interleaved; io/pair_rows.py)
    file_shape: tuple[int, ...] | None = None  # the header shape of the same bytes (StoredTensor.file_shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass
class TargetFile:
    path: str  # relative to the output folder
    format: str  # "safetensors" or "torch"
    tensors: list[TargetTensor]
    payload: Any = None  # torch files: the object to pickle, with TensorSlot placeholders
    metadata: dict | None = None  # safetensors files: header metadata
    rank: dict[str, int] | None = None  # the parallel rank ({"tp", "pp", "ep"}) whose file it is; None: all

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class ReplicaCheck:
    """Two source ranges that must hold identical bytes (canonical rows ``start..stop`` of ``canonical``)."""

    canonical: str
    axis: int
    first: ReadOp
    other: ReadOp


@dataclass
class Plan:
    source_layout: str
    target_layout: str
    source_files: list[str]
    files: list[TargetFile]
    checks: list[ReplicaCheck] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    source_root: str = ""
    read_bytes: dict[str, int] = field(default_factory=dict)  # source file -> bytes the plan reads from it
    allow_cast_overflow: bool = False  # a --dtype cast may turn finite values into inf

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def count_read_bytes(self, row_bytes, shares=None) -> None:
        """Fill :attr:`read_bytes`: bytes each source file contributes, given ``row_bytes(source, tensor, axis,
        in_block)`` (``in_block``: one index along ``axis`` within one block of a stacked tensor). ``shares(source,
        tensor)``: for a tensor whose bytes lie in several files (ZeRO partitions, stitched DCP chunks), the
        fraction of them in each (path -> fraction), else None."""
        totals = dict.fromkeys(self.source_files, 0)
        for f in self.files:
            for t in f.tensors:
                for op in t.reads:
                    n = op.length * row_bytes(op.source, op.tensor, op.source_axis(t.axis), op.src_block is not None)
                    spread = shares(op.source, op.tensor) if shares else None
                    for path, fraction in (spread or {self.source_files[op.source]: 1}).items():
                        totals[path] = totals.get(path, 0) + round(n * fraction)
        self.read_bytes = totals


@dataclass(frozen=True)
class _Span:
    start: int
    stop: int
    source: int
    tensor: str
    offset: int  # position of ``start`` in the source tensor along the axis
    transposed: bool = False  # the source tensor is stored [in, out]
    block: int | None = None  # a stacked source tensor's block
    interleaved: int = 0  # the source tensor's heads are in interleaved-RoPE row order (head dim)


class CanonicalIndex:
    """Where each canonical row range lives in the source: ``canonical -> [spans]`` plus replica checks."""

    def __init__(self, stored: list[tuple[int, StoredTensor]], shapes: dict[str, tuple[int, ...]]):
        spans: dict[str, list[_Span]] = {}
        self.axis: dict[str, int] = {}
        for source, tensor in stored:
            for piece, offset in tensor.offsets():
                if piece.canonical is None:
                    continue
                prev = self.axis.setdefault(piece.canonical, tensor.canonical_axis)
                if prev != tensor.canonical_axis:
                    raise AssertionError(f"{piece.canonical} is split on two axes")
                spans.setdefault(piece.canonical, []).append(
                    _Span(piece.start, piece.stop, source, tensor.name, offset, tensor.transposed, piece.block,
                          piece.interleaved or tensor.interleaved))
        self.value_offsets = {(source, t.name): t.value_offset for source, t in stored if t.value_offset}
        self.transforms = {(source, t.name): t.transform for source, t in stored if t.transform}
        self.primary: dict[str, list[_Span]] = {}
        self.checks: list[ReplicaCheck] = []
        for name, shape in shapes.items():
            found = spans.get(name)
            if not found:
                raise CheckpointError(f"the source has no data for canonical tensor '{name}'")
            axis = self.axis[name]
            cover, covered, duplicates = [], 0, []
            for span in sorted(found, key=lambda s: s.start):  # stable: source order among equal starts
                if span.start > covered:
                    break
                if span.start < min(span.stop, covered):
                    duplicates.append(span)
                if span.stop > covered:
                    cut = covered - span.start
                    cover.append(_Span(covered, span.stop, span.source, span.tensor, span.offset + cut,
                                       span.transposed, span.block, span.interleaved))
                    covered = span.stop
            if covered < shape[axis]:
                raise CheckpointError(f"the source holds only rows 0..{covered} of '{name}' (of {shape[axis]}) "
                                      "along its split axis: a rank file is missing or incomplete")
            self.primary[name] = cover
            for span in duplicates:
                for c in cover:
                    lo, hi = max(span.start, c.start), min(span.stop, c.stop)
                    if lo < hi and not (c.source == span.source and c.tensor == span.tensor):
                        self.checks.append(ReplicaCheck(
                            name, axis, ReadOp(c.source, c.tensor, c.offset + lo - c.start, hi - lo, 0,
                                               c.transposed, c.block, interleave=c.interleaved),
                            ReadOp(span.source, span.tensor, span.offset + lo - span.start, hi - lo, 0,
                                   span.transposed, span.block, interleave=span.interleaved)))

    def reads_for(self, canonical: str, start: int, stop: int, dst_start: int,
                  transposed: bool = False, block: int | None = None, interleaved: int = 0) -> list[ReadOp]:
        """Read operations that fill canonical rows ``[start, stop)`` at ``dst_start`` in a target tensor
        (``transposed``: one stored ``[in, out]``; a replica check's ops are relative to the canonical form)."""
        ops = []
        for span in self.primary[canonical]:
            lo, hi = max(start, span.start), min(stop, span.stop)
            if lo < hi:
                order = span.interleaved if not interleaved else -interleaved if not span.interleaved else 0
                if order and (lo % abs(order) or hi % abs(order)):
                    raise CheckpointError(f"rows {lo}..{hi} of '{canonical}' cut a head of {abs(order)} rows: an "
                                          "interleaved-RoPE tensor is read in whole heads")
                ops.append(ReadOp(span.source, span.tensor, span.offset + lo - span.start, hi - lo,
                                  dst_start + lo - start, span.transposed != transposed, span.block, block, order,
                                  shift=-self.value_offsets.get((span.source, span.tensor), 0.0),
                                  transform=mamba_values.undo(self.transforms.get((span.source, span.tensor), ""))))
        return ops


def plan_tensor(index: CanonicalIndex, target: StoredTensor, dtype: str) -> TargetTensor:
    reads, padded = [], False
    for piece, offset in target.offsets():
        if piece.canonical is None:
            padded = True
        else:
            reads.extend(index.reads_for(piece.canonical, piece.start, piece.stop, offset, target.transposed,
                                         piece.block, piece.interleaved or target.interleaved))
    if target.value_offset:  # the target stores canonical + its offset (StoredTensor.value_offset)
        reads = [replace(op, shift=op.shift + target.value_offset) for op in reads]
    if target.transform:  # the target stores a function of canonical (vLLM's A = -exp(A_log))
        reads = [replace(op, transform=mamba_values.then(op.transform, target.transform)) for op in reads]
    return TargetTensor(target.name, target.shape, target.dtype or dtype, target.axis, reads, padded, target.fill,
                        target.pair_interleaved, target.file_shape)
