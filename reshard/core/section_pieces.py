"""Rank pieces of the ``sections`` split and of a gated query (Qwen3-Next; mapping/sections.py, families-2.md
sections 4.2-4.3 and 14.2 C, E).

``sections``: each member's named sections (section i of a grouped tensor = part i of every group, in group
order) laid end to end, member after member; rank t of T holds the t-th 1/T of every section, in that order
(Megatron GDN ``in_proj`` per rank ``[q_t; k_t; v_t; z_t; b_t; a_t]``, ``conv1d`` ``[q_t; k_t; v_t]``; vLLM's
``conv1d`` alike). At T = 1 this is every section whole: the regrouped tensor.

Gated query (Megatron ``linear_qkv`` with ``attention_output_gate``): HF's ``q_proj`` holds per head ``[q_h; gate_h]``
(``2d`` rows); Megatron per KV group ``[q of the group's heads; their gates; k_g; v_g]``, groups contiguous per rank.
"""

from __future__ import annotations

from reshard.core.pieces import Piece


def _runs(tensor) -> list[tuple[str, list[tuple[int, int]]]]:
    """Each section of ``tensor`` as (name, its row runs in the tensor, in section order)."""
    group = sum(rows for _, rows in tensor.sections)
    out, offset = [], 0
    for name, rows in tensor.sections:
        out.append((name, [(g * group + offset, g * group + offset + rows) for g in range(tensor.groups)]))
        offset += rows
    return out


def _take(name: str, runs: list[tuple[int, int]], lo: int, hi: int) -> list[Piece]:
    """Rows ``[lo, hi)`` of the concatenation of ``runs``, as pieces of canonical tensor ``name``."""
    pieces, pos = [], 0
    for start, stop in runs:
        a, b = max(lo, pos), min(hi, pos + stop - start)
        if a < b:
            first = start + a - pos
            last = pieces[-1] if pieces else None
            if last is not None and last.stop == first:
                pieces[-1] = Piece(name, last.start, first + b - a)
            else:
                pieces.append(Piece(name, first, first + b - a))
        pos += stop - start
    return pieces


def section_pieces(members, rank: int, tp: int) -> list[Piece]:
    """Rank ``rank``'s pieces of a sections-split tensor of ``members`` (one tensor or a pack)."""
    pieces = []
    for tensor in members:
        for _, runs in _runs(tensor):
            total = sum(b - a for a, b in runs)
            per = total // tp
            pieces += _take(tensor.name, runs, rank * per, (rank + 1) * per)
    return pieces


def section_extents(members) -> list[tuple[str, int, int]]:
    """(section name, start, stop) of each section along dim 0 of the whole (T = 1) sections tensor."""
    out, pos = [], 0
    for tensor in members:
        for name, runs in _runs(tensor):
            total = sum(b - a for a, b in runs)
            out.append((name, pos, pos + total))
            pos += total
    return out


def gated_qkv_pieces(q, k, v, rank: int, tp: int, groups: int) -> list[Piece]:
    """Megatron ``linear_qkv`` of a gated query: per KV group of the rank, its heads' q halves, their gate halves,
    k_g, v_g."""
    d = k.shape[0] // groups
    heads = q.shape[0] // (2 * d)
    per_group = heads // groups
    per_rank = groups // tp
    pieces = []
    for g in range(rank * per_rank, (rank + 1) * per_rank):
        hs = range(g * per_group, (g + 1) * per_group)
        pieces += [Piece(q.name, 2 * h * d, 2 * h * d + d) for h in hs]
        pieces += [Piece(q.name, 2 * h * d + d, 2 * h * d + 2 * d) for h in hs]
        pieces += [Piece(k.name, g * d, (g + 1) * d), Piece(v.name, g * d, (g + 1) * d)]
    return pieces
