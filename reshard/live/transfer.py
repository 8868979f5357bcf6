"""Executes a live plan between processes with point-to-point ``torch.distributed`` operations.

Every participant (a process in ``plan.source_ranks`` or ``plan.target_ranks``) calls :func:`transfer` with the
same plan, ``dtype`` and ``chunk_bytes``; other processes of the group need not. The schedule
(:mod:`reshard.live.schedule`) gives each process, per round, at most one message to send and one to receive,
posted together with ``batch_isend_irecv``; chunks between a process's own source and target tensors are copied
locally first. A sender packs slices of its tensors into its send buffer (casting when the target dtype is
narrower); a receiver unpacks each chunk, transposes it, reorders RoPE rows and casts as the target needs, and
copies it into the destination (rows stored alternating, gpt-oss's gate / up, are read and placed through step-2
views) (``into``'s tensor or a new one). A lone contiguous chunk is sent straight from
the source tensor and, when no transform applies, received straight into the destination. Extra memory per
process: one send and one receive buffer of at most ``chunk_bytes`` each, and one chunk of transform.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import TYPE_CHECKING

from reshard.errors import PlanError
from reshard.io import dtypes, mamba_values
from reshard.io.assemble import rope_rows
from reshard.io.pair_rows import paired_rows
from reshard.live.agree import (agree, check_plans, check_tensor, gpu_identity, publish, release, resolve,
                                tensor_problems, uses_nccl, verdict)
from reshard.live.compare import section_tensors, summary
from reshard.live.schedule import build
from reshard.live.source import dtype_name
from reshard.live.stats import Received, Stats
from reshard.live.watch import TransferError, Watch, group_store

if TYPE_CHECKING:
    import torch

DEFAULT_CHUNK = 64 << 20


def source_slice(tensor, op, axis: int, pair: tuple[int, int] | None = None):
    """``op``'s slice of its (local) source tensor, in the source's orientation; ``axis``: the target's. ``pair``:
    the source's :attr:`SourceTensor.pair <reshard.live.plan.SourceTensor>` (rows stored alternating along that
    axis of the whole tensor, in units; ``op`` counts them end to end): the slice is a step-2 view."""
    along = op.source_axis(axis)
    if op.src_block is not None:
        tensor, along = tensor[op.src_block], along - 1
    if op.rows is not None:
        tensor = tensor.narrow(0, op.rows[0], op.rows[1] - op.rows[0])
    if pair:
        if along != pair[0] - (op.src_block is not None) or op.rows is not None:
            raise PlanError(f"live.transfer: '{op.tensor}' alternates rows along another axis than the plan reads")
        return paired_rows(tensor, along, pair[1], op.src_start, op.length)
    return tensor.narrow(along, op.src_start, op.length)


def slice_shape(plan, op, axis: int) -> tuple[int, ...]:
    """The shape of :func:`source_slice` computed from the plan alone (what a receiver unpacks)."""
    shape = list(plan.sources[op.source][op.tensor].shape)
    along = op.source_axis(axis)
    if op.src_block is not None:
        shape, along = shape[1:], along - 1
    if op.rows is not None:
        shape[0] = op.rows[1] - op.rows[0]
    shape[along] = op.length
    return tuple(shape)


def target_part(dest, op, axis: int, pair: int = 0):
    """Where ``op`` lands in destination tensor ``dest`` (``axis``: the target tensor's; ``pair``: its
    ``LiveTensor.pair_interleaved``, rows stored alternating in units of ``pair``: a step-2 view)."""
    if op.dst_block is not None:
        dest, axis = dest[op.dst_block], axis - 1
    if pair:
        return paired_rows(dest, axis, pair, op.dst_start, op.length)
    return dest.narrow(axis, op.dst_start, op.length)


def place(dest, op, axis: int, data, pair: int = 0) -> None:
    """Copy source slice ``data`` into ``dest`` the way the target stores it: transposed, RoPE rows, cast,
    alternating rows (``pair``: as :func:`target_part`'s)."""
    if op.transposed:
        data = data.t()
    if op.interleave:
        data = rope_rows(data, op.interleave)
    if op.shift:  # a stored value offset (Megatron's zero-centred GDN norm), as reshard.io.assemble.read_op adds it
        data = data + op.shift
    if op.transform:  # vLLM's A = -exp(A_log) and its inverse, as read_op applies them
        data = mamba_values.apply(op.transform, data)
    target_part(dest, op, axis, pair).copy_(data)


def _pair(plan, op) -> tuple[int, int] | None:
    """The alternating rows of ``op``'s source tensor (:attr:`reshard.live.plan.SourceTensor.pair`)."""
    return plan.sources[op.source][op.tensor].pair


def _on(tensor, device) -> bool:
    """Whether ``tensor`` is on ``device`` (``"cuda"`` meaning the current CUDA device)."""
    return tensor.device == resolve(device)


def _flat_bytes(tensor):
    import torch

    return tensor.reshape(-1).view(torch.uint8)


def _degree_guess(plan, have: tuple[int, ...], want: tuple[int, ...]) -> str:
    """``TP 1`` where the one dimension that differs is the plan's split at another TP degree, else ``""``."""
    tp = int(plan.source.get("tp") or 1)
    differ = [i for i, (h, w) in enumerate(zip(have, want)) if h != w]
    if len(have) != len(want) or len(differ) != 1 or not have[differ[0]]:
        return ""
    guess = tp * want[differ[0]] / have[differ[0]]
    return f"TP {int(guess)}" if guess >= 1 and guess == int(guess) and guess != tp else ""


def mismatch(plan, rank: int, name: str, tensor, want) -> str:
    """The one-line refusal of a source tensor unlike the plan's: a dtype to pass only where the dtypes differ;
    a shape that differs read as shards made for another degree or layout than the plan's source."""
    live_dtype = str(tensor.dtype).removeprefix("torch.")
    planned_dtype = dtypes.torch_name(want.dtype)
    head = f"live.transfer: '{name}' on rank {rank} is"
    if tuple(tensor.shape) == want.shape:
        return (f"{head} {live_dtype}; the plan expects {planned_dtype}: pass the live dtype as "
                f"source={{..., 'dtype': '{live_dtype}'}} to live.plan")
    spec = plan.source
    degrees = {k: spec.get(k) or 1 for k in ("tp", "pp", "ep") if k != "ep" or (spec.get(k) or 1) > 1}
    words = ", ".join(f"{k.upper()} {v}" for k, v in degrees.items())
    guess = _degree_guess(plan, tuple(tensor.shape), want.shape)
    dtype_too = f" (and {live_dtype}, not {planned_dtype})" if live_dtype != planned_dtype else ""
    return (f"{head} {list(tensor.shape)}; the plan expects {list(want.shape)}{dtype_too}: these shards look "
            f"made for {guess or 'another degree or layout'}, not the plan's source ({spec['layout']} at {words}); "
            "pass live.plan the source layout and degrees the live model runs at, or give each rank its shards "
            f"at {words} (reshard.load_rank(ckpt, to='{spec['layout']}', "
            f"{', '.join(f'{k}={v}' for k, v in degrees.items())}, ...))")


class _Local:
    """Source parallel rank ``index``'s tensors, looked up in the caller's mapping at each use (a mapping may
    build them on demand), each checked against the plan (and against device ``want`` unless None) on first use;
    names are checked up front."""

    def __init__(self, plan, index: int, local, chunks, want=None):
        self.plan, self.index, self.local, self.checked, self.want = plan, index, local, set(), want
        for name in dict.fromkeys(c.op.tensor for c in chunks):
            if local is None or name not in local:
                raise PlanError(f"live.transfer: source rank {plan.source_ranks[index]} has no tensor '{name}' "
                                f"({plan.source['layout']} names, as load_rank(to='{plan.source['layout']}') "
                                "gives them)")

    def __getitem__(self, name: str):
        tensor = self.local[name]
        if name not in self.checked:
            want = self.plan.sources[self.index][name]
            if tuple(tensor.shape) != want.shape or dtypes.from_torch(tensor.dtype) != want.dtype:
                raise PlanError(mismatch(self.plan, self.plan.source_ranks[self.index], name, tensor, want))
            check_tensor(self.plan.source_ranks[self.index], f"local_tensors['{name}']", tensor, self.want)
            self.checked.add(name)
        return tensor


def _destinations(plan, index: int, into, dtype: str | None, device, stats: Stats) -> dict:
    """Target parallel rank ``index``'s tensors: ``into``'s (checked, padding zeroed, constants filled) or new."""
    import torch

    into = dict(into or {})
    tensors = plan.targets[index]
    unknown = sorted(set(into) - {t.name for t in tensors})
    if unknown:
        raise PlanError(f"live.transfer: into= names '{unknown[0]}', which target rank "
                        f"{plan.target_ranks[index]} ({plan.target['layout']}) does not hold")
    out = {}
    for t in tensors:
        dest = into.get(t.name)
        if dest is None:
            make = torch.zeros if t.padding or t.fill is not None else torch.empty
            dest = make(t.shape, dtype=dtypes.to_torch(t.dtype_for(dtype)), device=device)
            stats.allocated.append(t.name)
        elif tuple(dest.shape) != t.shape:
            raise PlanError(f"live.transfer: into['{t.name}'] is {list(dest.shape)}; target rank "
                            f"{plan.target_ranks[index]} holds it as {list(t.shape)}")
        elif t.padding:
            for block, start, length in t.padding:
                target_part(dest, SimpleNamespace(dst_block=block, dst_start=start, length=length), t.axis,
                            t.pair_interleaved).zero_()
        if t.fill is not None:
            dest.fill_(t.fill)
        out[t.name] = dest
    return out


def _default_device(group):
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    return "cuda" if "nccl" in backend and "gloo" not in backend else "cpu"


def _agree(watch, me: int, backend: str, device, into, local_tensors, chunks, plan, summary) -> torch.device | None:
    """The agreement step (:mod:`reshard.live.agree`), on every group: publish this rank's plan ``summary`` and
    record, raise :class:`TransferError` on every rank alike when the participants' plans differ, or on a group
    with NCCL when two ranks share one GPU or this rank's tensors (``into``'s, and ``local_tensors``' used by
    ``chunks`` when it is a dict) are not on ``device``. Returns the device NCCL needs every tensor on (None: no
    rule: not NCCL, or ``device`` is not CUDA)."""
    import torch

    where = resolve(device)
    nccl = uses_nccl(backend, where)
    want = where if nccl and where.type == "cuda" else None
    problems = []
    if want is not None:
        held = [(f"into['{n}']", t.device) for n, t in dict(into or {}).items() if isinstance(t, torch.Tensor)]
        if isinstance(local_tensors, dict):  # a lazy mapping's tensors are checked on first use (_Local)
            for name in dict.fromkeys(c.op.tensor for c in chunks):
                t = dict.get(local_tensors, name)
                if isinstance(t, torch.Tensor):
                    held.append((f"local_tensors['{name}']", t.device))
        problems = tensor_problems(me, held, want)
    record = {"rank": me, "backend": backend, "nccl": nccl, "device": str(where),
              "gpu": gpu_identity(where) if nccl else None, "problems": problems, "plan": summary["digest"]}
    publish(watch, summary)
    records = agree(watch, record)
    check_plans(watch, records, lambda key: section_tensors(plan, key))
    message = verdict(records)
    if message:
        release(watch)
        raise TransferError(message)
    return want


def transfer(plan, local_tensors=None, group=None, dtype=None, into=None, timeout: float = 300.0,
             chunk_bytes: int = DEFAULT_CHUNK, device=None) -> Received:
    """Run ``plan`` (:func:`reshard.live.plan`) on this process: send this rank's source slices, receive its
    target tensors. Returns the target tensors (empty on a source-only rank) with ``.stats``.

    ``local_tensors``: this process's source tensors under the source layout's names (its ``state_dict()``).
    ``group``: the process group (default: the world); plan ranks are ranks of it. ``dtype``: cast the target
    tensors (``"bf16"``, a ``torch.dtype``; pinned ones keep theirs). ``into``: name -> destination tensor, filled
    in place (shape must match, dtype and device may differ; padding rows zeroed); names it lacks are
    allocated. ``timeout``: seconds without progress on any rank after which every rank raises
    :class:`TransferError`; any error on any rank makes every participant raise. ``chunk_bytes``: the bound of
    one message. ``device``: where buffers and new tensors live (default ``cuda`` for NCCL, else ``cpu``).

    The participants first agree through the group's store (:mod:`reshard.live.agree`): before any byte moves,
    every one raises the same :class:`TransferError` when their plans differ (config meaning, layouts, degrees,
    ranks, tensors, ``dtype``, ``chunk_bytes``: naming two ranks and the first difference), when a participant
    never calls ``transfer`` within ``timeout``, and on a group with NCCL when two ranks share one GPU, or when a
    rank's ``into`` tensors or (a dict's) source tensors are not on ``device`` (a lazy mapping's source tensors:
    on first use, failing the transfer)."""
    import torch.distributed as dist

    started = time.perf_counter()
    me = dist.get_rank(group)
    stats = Stats(me)
    participants = sorted(set(plan.source_ranks) | set(plan.target_ranks))
    if me not in participants:
        return _received({}, stats, started)
    watch = Watch(group_store(group), participants, me, timeout)
    try:
        name = dtype_name(dtype)
        key = (name, chunk_bytes)
        if key not in plan._cache:
            plan._cache[key] = build(plan, name, chunk_bytes)
        schedule = plan._cache[key]
        device = device or _default_device(group)
        src = plan.source_ranks.index(me) if me in plan.source_ranks else None
        dst = plan.target_ranks.index(me) if me in plan.target_ranks else None
        sends, recvs = schedule.sends(me), schedule.receives(me)
        local_chunks = schedule.local.get(me, [])
        mine = [c for _, m in sends for c in m.chunks] + local_chunks
        want = _agree(watch, me, str(dist.get_backend(group)), device, into if dst is not None else None,
                      local_tensors, mine if src is not None else [], plan, summary(plan, name, chunk_bytes, schedule))
        local = _Local(plan, src, local_tensors, mine, want) if src is not None else {}
        dests = _destinations(plan, dst, into, name, device, stats) if dst is not None else {}
        targets = plan.targets[dst] if dst is not None else []
        for chunk in local_chunks:
            tensor = targets[chunk.tensor]
            data = source_slice(local[chunk.op.tensor], chunk.op, tensor.axis, _pair(plan, chunk.op))
            place(dests[tensor.name], chunk.op, tensor.axis, data, tensor.pair_interleaved)
            stats.local_bytes += chunk.nbytes
        _rounds(plan, watch, group, sends, recvs, local, dests, targets, device, stats)
        watch.finish()
    except BaseException as exc:
        watch.fail(exc)
        if isinstance(exc, TransferError) or not isinstance(exc, Exception):  # Ctrl-C stays itself
            raise
        raise TransferError(f"live transfer failed on rank {me}: {type(exc).__name__}: {exc}") from exc
    return _received(dests, stats, started)


def _received(dests: dict, stats: Stats, started: float) -> Received:
    out = Received(dests)
    stats.seconds = time.perf_counter() - started
    out.stats = stats
    return out


def _rounds(plan, watch, group, sends, recvs, local, dests, targets, device, stats) -> None:
    """Post this process's messages round by round, unpacking each received one into its destinations."""
    import torch
    import torch.distributed as dist

    send_at, recv_at = dict(sends), dict(recvs)
    buffers = {}

    def buffer(kind: str, nbytes: int):
        buf = buffers.get(kind)
        if buf is None or buf.numel() < nbytes:
            buf = buffers[kind] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]

    def peer(rank: int) -> int:
        return rank if group is None else dist.get_global_rank(group, rank)

    for r in sorted(set(send_at) | set(recv_at)):
        ops, unpack = [], None
        if r in send_at:
            msg = send_at[r]
            ops.append(dist.P2POp(dist.isend, _pack(plan, msg, local, buffer, device), peer(msg.dst), group))
        if r in recv_at:
            msg = recv_at[r]
            into, unpack = _recv_target(plan, msg, dests, targets, buffer, device)
            ops.append(dist.P2POp(dist.irecv, into, peer(msg.src), group))
        peers = ([f"sending to rank {send_at[r].dst}"] if r in send_at else []) + \
            ([f"receiving from rank {recv_at[r].src}"] if r in recv_at else [])
        watch.wait(dist.batch_isend_irecv(ops), f"round {r} ({', '.join(peers)})")
        if r in send_at:
            stats.messages_sent += 1
            stats.count_send(send_at[r].dst, sum(c.nbytes for c in send_at[r].chunks))
        if r in recv_at:
            if unpack is not None:
                unpack()
            stats.messages_received += 1
            stats.count_receive(recv_at[r].src, sum(c.nbytes for c in recv_at[r].chunks))
        stats.rounds += 1
        watch.progressed()


def _pack(plan, msg, local, buffer, device):
    """The bytes of message ``msg``: a lone contiguous chunk as it is, else the chunks packed into the buffer."""
    def slice_of(chunk):
        return source_slice(local[chunk.op.tensor], chunk.op, plan.targets[chunk.target][chunk.tensor].axis,
                            _pair(plan, chunk.op))

    if len(msg.chunks) == 1:
        data = slice_of(msg.chunks[0])
        if data.is_contiguous() and dtypes.from_torch(data.dtype) == msg.chunks[0].wire and \
                _on(data, device):
            return _flat_bytes(data)
    buf = buffer("send", msg.nbytes)
    for chunk in msg.chunks:
        data = slice_of(chunk)
        buf[chunk.offset:chunk.offset + chunk.nbytes].view(dtypes.to_torch(chunk.wire)).view(data.shape).copy_(data)
    return buf


def _recv_target(plan, msg, dests, targets, buffer, device):
    """(the tensor to receive ``msg`` into, a function that unpacks it afterwards, or None when received in
    place: a lone chunk with no transform, contiguous in a destination of the wire dtype)."""
    if len(msg.chunks) == 1:
        chunk = msg.chunks[0]
        tensor = targets[chunk.tensor]
        part = target_part(dests[tensor.name], chunk.op, tensor.axis, tensor.pair_interleaved)
        if not (chunk.op.transposed or chunk.op.interleave or chunk.op.shift or chunk.op.transform) and \
                part.is_contiguous() and dtypes.from_torch(part.dtype) == chunk.wire and _on(part, device):
            return _flat_bytes(part), None
    buf = buffer("recv", msg.nbytes)

    def unpack():
        for chunk in msg.chunks:
            tensor = targets[chunk.tensor]
            data = buf[chunk.offset:chunk.offset + chunk.nbytes].view(dtypes.to_torch(chunk.wire))
            place(dests[tensor.name], chunk.op, tensor.axis, data.view(slice_shape(plan, chunk.op, tensor.axis)),
                  tensor.pair_interleaved)
    return buf, unpack
