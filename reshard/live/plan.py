"""Live plans: which source rank sends which slice of which of its tensors to which target rank.

A source layout's target files at the source degrees are exactly the tensors a live source rank holds (its
``state_dict()`` under the layout's names, what ``reshard.load_rank(ckpt, to=layout, ...)`` returns). So the plan
builds the canonical model from the config alone (:mod:`reshard.live.source`), asks the source layout for its
per-rank tensors at the source degrees, indexes them as if each source rank were a file
(:class:`reshard.core.plan.CanonicalIndex`) and plans every tensor of the target layout's ranks at the target
degrees (:func:`reshard.core.plan.plan_tensor`): each ``ReadOp``'s ``source`` is a source parallel rank. No file
but the config is read and nothing is communicated, so every process builds the same plan.

Parallel rank order (``source_ranks[i]``, ``target_ranks[i]``): Megatron ``i = tp_rank + tp * (ep_rank + ep *
pp_rank)``; vLLM the tp rank; a layout without ranks (HF) one rank. Rows several source ranks hold (replicated
norms, a Megatron row-parallel bias, KV heads vLLM repeats, tied copies) are sent by the rank on the receiving
process if one holds them (colocated: no network), else by the holder with the fewest bytes assigned so far.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

from reshard.core.plan import CanonicalIndex, ReadOp, plan_tensor
from reshard.errors import PlanError
from reshard.io import dtypes
from reshard.layouts.base import Options, stored_dtype
from reshard.layouts.registry import get_layout
from reshard.live.source import config_source, options
from reshard.rank_view import rank_files


@dataclass(frozen=True)
class SourceTensor:
    """A tensor a source rank passes in: its name, shape and dtype (safetensors name); ``pair``: (axis, unit) of
    rows stored alternating (gpt-oss's HF / vLLM gate_up, reshard/io/pair_rows.py), the plan's ops read it end to
    end."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    pair: tuple[int, int] | None = None


@dataclass
class LiveTensor:
    """One target rank's tensor: ``reads`` (``ReadOp.source``: the source parallel rank that sends it; ``holders``:
    every source parallel rank holding the same bytes), ``padding`` spans ``(block, start, length)`` along
    ``axis`` (zeros), or ``fill`` (a constant). ``pinned``: its dtype is fixed (a constant's, an fp32 router
    bias), ``transfer(dtype=...)`` does not change it. ``pair_interleaved``: the unit of rows stored alternating
    along ``axis`` (gpt-oss's gate / up): ``reads`` and ``padding`` are end to end, placed through step-2 views."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    axis: int
    reads: list[ReadOp]
    padding: tuple[tuple[int | None, int, int], ...] = ()
    fill: float | None = None
    pinned: bool = False
    holders: list[tuple[int, ...]] = field(default_factory=list)  # per read: the source ranks holding its bytes
    pair_interleaved: int = 0

    def dtype_for(self, dtype: str | None) -> str:
        return self.dtype if self.pinned or dtype is None else dtype

    def nbytes(self, dtype: str | None = None) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype_for(dtype))


@dataclass
class LivePlan:
    """The plan :func:`plan` returns: plain data, identical on every rank."""

    source: dict
    target: dict
    source_ranks: list[int]
    target_ranks: list[int]
    sources: list[dict[str, SourceTensor]]  # per source parallel rank: the tensors it passes in
    targets: list[list[LiveTensor]]  # per target parallel rank: the tensors it gets
    notes: list[str] = field(default_factory=list)
    meaning: object = None  # the config's ModelConfig: what the ranks must agree the model is
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def op_elements(self, op: ReadOp, axis: int) -> int:
        """Elements ``op`` moves (``axis``: the target tensor's)."""
        shape = self.sources[op.source][op.tensor].shape
        if op.src_block is not None:
            shape = shape[1:]
        along = op.source_axis(axis) - (op.src_block is not None)
        return op.length * math.prod(shape) // shape[along]

    def pair_bytes(self, dtype=None) -> dict[tuple[int, int], int]:
        """``(source global rank, target global rank) -> bytes`` the transfer moves between them, in the target
        tensors' dtypes (``dtype``: as ``transfer``'s; a pair on one process is a local copy)."""
        from reshard.live.source import dtype_name

        name = dtype_name(dtype)
        out: dict[tuple[int, int], int] = {}
        for j, tensors in enumerate(self.targets):
            for t in tensors:
                size = dtypes.itemsize(t.dtype_for(name))
                for op in t.reads:
                    key = (self.source_ranks[op.source], self.target_ranks[j])
                    out[key] = out.get(key, 0) + self.op_elements(op, t.axis) * size
        return out

    def target_bytes(self, index: int, dtype=None) -> int:
        """Bytes of target parallel rank ``index``'s tensors that come from sources (constants excluded)."""
        from reshard.live.source import dtype_name

        return sum(t.nbytes(dtype_name(dtype)) for t in self.targets[index] if t.fill is None)

    def payload_bytes(self, index: int, dtype=None) -> int:
        """Bytes target parallel rank ``index`` receives or copies: its tensors less padding and constants."""
        from reshard.live.source import dtype_name

        total = 0
        for t in self.targets[index]:
            if t.fill is not None:
                continue
            shape = t.shape[1:] if t.padding and t.padding[0][0] is not None else t.shape
            axis = t.axis - (len(shape) < len(t.shape))
            pad = sum(length for _, _, length in t.padding) * math.prod(shape) // shape[axis] if t.padding else 0
            total += t.nbytes(dtype_name(dtype)) - pad * dtypes.itemsize(t.dtype_for(dtype_name(dtype)))
        return total

    def describe(self, dtype=None) -> str:
        """Who sends what to whom: one line per pair of processes, with bytes and slices, then totals."""
        pairs = self.pair_bytes(dtype)
        slices: dict[tuple[int, int], int] = {}
        for j, tensors in enumerate(self.targets):
            for t in tensors:
                for op in t.reads:
                    key = (self.source_ranks[op.source], self.target_ranks[j])
                    slices[key] = slices.get(key, 0) + 1
        total = sum(pairs.values())
        local = sum(b for (s, d), b in pairs.items() if s == d)
        lines = [f"live plan: {_label(self.source)} on ranks {self.source_ranks} -> {_label(self.target)} on ranks "
                 f"{self.target_ranks}: {_size(total)} in {sum(slices.values())} slices "
                 f"({_size(total - local)} over the network, {_size(local)} copied locally)"]
        for (s, d) in sorted(pairs):
            how = "local copy" if s == d else "sends"
            lines.append(f"  rank {s} -> rank {d}: {how} {_size(pairs[(s, d)])} in {slices[(s, d)]} slices")
        for j, rank in enumerate(self.target_ranks):
            lines.append(f"  target rank {rank} (parallel rank {j}): {len(self.targets[j])} tensors, "
                         f"{_size(self.target_bytes(j, dtype))}, of which {_size(self.payload_bytes(j, dtype))} "
                         "received (the rest: padding and constants)")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _label(spec: dict) -> str:
    return " ".join([spec["layout"]] + [f"{k}{v}" for k, v in spec.items() if k != "layout" and v not in (None, False)])


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _rank_tensors(source, layout_name: str, opts: Options, dtype: str):
    """Per parallel rank (the module docstring's order), the StoredTensors the layout holds there."""
    layout = get_layout(layout_name)
    view = layout.rank_view_of or layout_name
    specs = get_layout(view).targets(source, opts, dtype).files
    degrees = {"tp": opts.tp, "pp": opts.pp, "ep": opts.ep}
    if opts.expert_parallel and opts.ep > 1:
        raise PlanError(f"{layout_name}: expert_parallel splits experts over the tp ranks; drop ep")
    ranks = []
    for p in range(opts.pp):
        for e in range(opts.ep):
            for t in range(opts.tp):
                files = rank_files(SimpleNamespace(files=specs), layout_name, {"tp": t, "pp": p, "ep": e}, degrees)
                ranks.append([tensor for f in files for tensor in f.tensors])
    return ranks


def _check_ranks(what: str, ranks, count: int, layout: str) -> list[int]:
    ranks = [int(r) for r in ranks]
    if len(ranks) != count:
        raise PlanError(f"live.plan: {what}_ranks lists {len(ranks)} ranks but {layout} at these degrees has {count}")
    if len(set(ranks)) != len(ranks) or min(ranks) < 0:
        raise PlanError(f"live.plan: {what}_ranks {ranks} must be distinct non-negative process ranks")
    return ranks


def plan(config, source: dict, target: dict, source_ranks, target_ranks) -> LivePlan:
    """Plan moving a live model's tensors from ``source`` ranks to ``target`` ranks (see the module docstring).

    ``config``: the model's HF-style config (a dict, a config.json path or a folder holding one). ``source`` /
    ``target``: ``{"layout": ..., "tp", "pp", "ep", "etp", "expert_parallel", ...}`` (``load_rank``'s degree
    keywords; also ``megatron_spec``, ``vocab_divisor``, ``moe_grouped_gemm`` and the other Options fields;
    ``source["dtype"]`` the live tensors' dtype when the config's ``torch_dtype`` is not it, ``target["dtype"]`` a
    cast). ``source_ranks[i]`` / ``target_ranks[i]``: the process (rank in the transfer's group) holding parallel
    rank ``i``; a process may be in both (colocated)."""
    src_layout, src_opts = options(source, "source")
    tgt_layout, tgt_opts = options(target, "target")
    model_source = config_source(config, src_opts, src_opts.dtype)
    notes = list(model_source.info["notes"])
    if model_source.model.mtp_layers and not (get_layout(src_layout).holds_mtp and get_layout(tgt_layout).holds_mtp):
        notes.append(f"left out {model_source.drop_mtp()} MTP (multi-token prediction) layer(s)")
    model = model_source.model
    src_dtype = model_source.info["dtype"]
    held = _rank_tensors(model_source, src_layout, src_opts, src_dtype)
    wanted = _rank_tensors(model_source, tgt_layout, tgt_opts, tgt_opts.dtype or src_dtype)
    source_ranks = _check_ranks("source", source_ranks, len(held), src_layout)
    target_ranks = _check_ranks("target", target_ranks, len(wanted), tgt_layout)
    sources = [{t.name: SourceTensor(t.name, t.shape, stored_dtype(model, t, src_opts, src_dtype),
                                     (t.axis, t.pair_interleaved) if t.pair_interleaved else None)
                for t in rank if t.fill is None} for rank in held]
    stored = [(i, t) for i, rank in enumerate(held) for t in rank if t.fill is None]
    index = CanonicalIndex(stored, {name: t.shape for name, t in model.tensors.items()})
    holders = _Holders(stored)
    live = LivePlan(dict(source), dict(target), source_ranks, target_ranks, sources, [], notes, model.meaning)
    load = [0] * len(held)
    for j, rank in enumerate(wanted):
        tensors = []
        for st in rank:
            planned = plan_tensor(index, st, stored_dtype(model, st, tgt_opts, src_dtype))
            canon = next((p.canonical for p in st.pieces if p.canonical), None)
            pinned = st.dtype is not None or (canon in model.tensors and model.tensors[canon].spec.dtype is not None)
            padding = tuple((p.block, off, p.length) for p, off in st.offsets() if p.canonical is None)
            tensor = LiveTensor(st.name, tuple(st.shape), planned.dtype, st.axis, [], padding, st.fill, pinned,
                                pair_interleaved=st.pair_interleaved)
            for item in _with_rows(st, planned.reads):
                op, held_by = holders.choose(item, live, tensor, j, load)
                tensor.reads.append(op)
                tensor.holders.append(held_by)
            tensors.append(tensor)
        live.targets.append(tensors)
    return live


def _with_rows(target, reads: list[ReadOp]):
    """(op, canonical name, first canonical row) for each of ``reads``, in plan order (as ``plan_tensor``
    emits them: per target piece, per source span)."""
    out, ops = [], iter(reads)
    for piece, offset in target.offsets():
        if piece.canonical is None:
            continue
        covered = 0
        while covered < piece.length:
            op = next(ops)
            out.append((op, piece.canonical, piece.start + op.dst_start - offset))
            covered += op.length
    return out


class _Holders:
    """Every span of every canonical tensor among the source ranks, to pick who sends replicated rows."""

    def __init__(self, stored):
        self.spans: dict[str, list[tuple]] = {}
        for source, tensor in stored:
            for piece, offset in tensor.offsets():
                if piece.canonical is not None:
                    self.spans.setdefault(piece.canonical, []).append(
                        (piece.start, piece.stop, source, tensor.name, offset, tensor.transposed, piece.block,
                         piece.interleaved or tensor.interleaved))

    def choose(self, item, live: LivePlan, tensor: LiveTensor, j: int, load: list[int]):
        """(``op`` (reading canonical rows from ``first``) from the holder that sends it best: one on the
        target's own process, else the least loaded, else the planner's (first) choice; the holders)."""
        op, canonical, first = item
        last = first + op.length
        spans = self.spans[canonical]
        primary = next(s for s in spans if s[2] == op.source and s[3] == op.tensor and s[0] <= first and last <= s[1])
        same = [s for s in spans if s[0] <= first and last <= s[1] and s[5] == primary[5] and s[7] == primary[7]
                and (s[6] is None) == (primary[6] is None)]
        me = live.target_ranks[j]
        best = min(same, key=lambda s: (live.source_ranks[s[2]] != me, load[s[2]]))
        start, _, source, name, offset, _, block, _ = best
        chosen = replace(op, source=source, tensor=name, src_start=offset + first - start, src_block=block)
        load[source] += live.op_elements(chosen, tensor.axis) * dtypes.itemsize(tensor.dtype)
        return chosen, tuple(sorted({s[2] for s in same}))
