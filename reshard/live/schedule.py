"""A live plan cut into bounded messages and rounds. Plain data, no torch; every rank computes the same schedule.

Each planned read is cut along its axis into chunks of at most ``chunk_bytes`` (whole heads for a RoPE reorder;
one step along the axis is never cut, so a chunk exceeds the bound only when one row, column or head does).
The chunks from one process to another are packed, in plan order, into messages of at most ``chunk_bytes``
(each chunk at a 16-byte aligned offset). Rounds are built greedily so that in each round a process sends at
most one message and receives at most one: a rank's buffers are one send and one receive message. A chunk
whose source and target are one process is a local copy and never becomes a message.

The wire dtype of a chunk is its source tensor's, unless the target dtype is narrower (a cast to bf16 from
fp32): then the sender casts, so no more bytes cross the network than the target tensor holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from reshard.core.plan import ReadOp
from reshard.io import dtypes

ALIGN = 16


@dataclass(frozen=True)
class Chunk:
    """Part of one planned read: into tensor ``tensor`` of target parallel rank ``target``, ``op`` (a cut of
    the planned op), ``wire`` dtype, ``nbytes`` of payload at ``offset`` in its message."""

    target: int
    tensor: int
    op: ReadOp
    wire: str
    nbytes: int
    offset: int = 0


@dataclass
class Message:
    src: int  # process ranks
    dst: int
    chunks: list[Chunk] = field(default_factory=list)
    nbytes: int = 0  # bytes on the wire: the last chunk's end (chunks start 16-byte aligned)


@dataclass
class Schedule:
    local: dict[int, list[Chunk]]  # process -> chunks it copies from its own source tensors to its own targets
    rounds: list[list[Message]]

    def sends(self, rank: int):
        """(round index, message) for each message ``rank`` sends; likewise :meth:`receives`."""
        return [(r, m) for r, msgs in enumerate(self.rounds) for m in msgs if m.src == rank]

    def receives(self, rank: int):
        return [(r, m) for r, msgs in enumerate(self.rounds) for m in msgs if m.dst == rank]


def wire_dtype(source: str, target: str) -> str:
    return target if dtypes.itemsize(target) < dtypes.itemsize(source) else source


def cut(plan, target: int, index: int, dtype: str | None, chunk_bytes: int) -> list[Chunk]:
    """Tensor ``index`` of target parallel rank ``target``'s reads as chunks of at most ``chunk_bytes``."""
    tensor = plan.targets[target][index]
    out = []
    for op in tensor.reads:
        wire = wire_dtype(plan.sources[op.source][op.tensor].dtype, tensor.dtype_for(dtype))
        step = abs(op.interleave) or 1
        step_bytes = plan.op_elements(replace(op, length=step), tensor.axis) * dtypes.itemsize(wire)
        per = max(1, chunk_bytes // max(step_bytes, 1)) * step
        for start in range(0, op.length, per):
            length = min(per, op.length - start)
            part = replace(op, src_start=op.src_start + start, dst_start=op.dst_start + start, length=length)
            out.append(Chunk(target, index, part, wire, step_bytes * (length // step)))
    return out


def build(plan, dtype: str | None, chunk_bytes: int) -> Schedule:
    """The schedule of ``plan`` (see the module docstring); ``dtype``: transfer's cast (None: the plan's)."""
    local: dict[int, list[Chunk]] = {}
    pairs: dict[tuple[int, int], list[Message]] = {}
    for j, tensors in enumerate(plan.targets):
        dst = plan.target_ranks[j]
        for k in range(len(tensors)):
            for chunk in cut(plan, j, k, dtype, chunk_bytes):
                src = plan.source_ranks[chunk.op.source]
                if src == dst:
                    local.setdefault(dst, []).append(chunk)
                    continue
                queue = pairs.setdefault((src, dst), [])
                if not queue or (queue[-1].chunks and queue[-1].nbytes + chunk.nbytes > chunk_bytes):
                    queue.append(Message(src, dst))
                msg = queue[-1]
                offset = -(-msg.nbytes // ALIGN) * ALIGN
                msg.chunks.append(replace(chunk, offset=offset))
                msg.nbytes = offset + chunk.nbytes
    return Schedule(local, _rounds(pairs))


def _rounds(pairs: dict[tuple[int, int], list[Message]]) -> list[list[Message]]:
    """Greedy rounds: each process sends at most one message and receives at most one per round; the pair that
    starts the scan rotates so that no pair waits behind the others."""
    keys = sorted(pairs)
    heads = dict.fromkeys(keys, 0)
    left = sum(len(q) for q in pairs.values())
    rounds = []
    while left:
        sending, receiving, batch = set(), set(), []
        start = len(rounds) % len(keys)
        for key in keys[start:] + keys[:start]:
            src, dst = key
            if heads[key] < len(pairs[key]) and src not in sending and dst not in receiving:
                batch.append(pairs[key][heads[key]])
                heads[key] += 1
                sending.add(src)
                receiving.add(dst)
        left -= len(batch)
        rounds.append(batch)
    return rounds
