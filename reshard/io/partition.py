"""How the target files of a plan are split into units of work and the units over processes.

A unit is either a lockstep group of target files (a ``list`` of file indices: files with the same tensor names,
the TP ranks of one stage, written together so that a source tensor they share is read once) or, with
``split_files``, a :class:`Piece`: a contiguous range of the tensors of one safetensors file, written by one
process into a file that others write the other tensors of (its header and every tensor's offset are fixed by
the plan, see :class:`reshard.io.safetensors_format.SafetensorsPart`).

:func:`partition` computes, as a pure function of the plan and the share count (every process of a distributed
run gets the same answer):

1. the lockstep groups, each cut so that one step buffers about the largest tensor (:func:`lockstep_groups`);
2. while there are fewer units than shares, the largest group halved (:func:`halve_groups`);
3. with ``split_files``, if there are still fewer units than shares (every unit is then one file), the
   safetensors files of two or more tensors cut into tensor ranges balanced by bytes (:func:`cut_files`): the
   extra shares go one by one to the file with the most bytes per piece;
4. the units dealt to the shares largest first, each to the least loaded share (:func:`assign`).
Files in Megatron's torch ``.pt`` (zip) form, whose records carry checksums written in order, are never cut.
"""

from __future__ import annotations

from dataclasses import dataclass

from reshard.core.plan import Plan, TargetFile
from reshard.io.copy_ranges import as_ranges
from reshard.io.tensorfile import TensorFile

ALIGN = 64


def aligned(n: int) -> int:
    return n + (-n % ALIGN)


@dataclass(frozen=True)
class Piece:
    """Tensors ``start..stop`` (in file order) of target file ``file``; the other tensors are another piece's."""

    file: int
    start: int
    stop: int


def buffered_bytes(file: TargetFile, sources: list[TensorFile]) -> list[int]:
    """Buffer bytes of each tensor of ``file`` in its step: 0 for a tensor copied file to file (:func:`as_ranges`,
    it never passes through memory), else its size aligned."""
    return [0 if as_ranges(t, sources) is not None else aligned(t.nbytes) for t in file.tensors]


def largest_tensor(plan: Plan, files: list[TensorFile]) -> int:
    """Bytes of the largest tensor the plan reads or writes."""
    read = {(op.source, op.tensor) for f in plan.files for t in f.tensors for op in t.reads}
    sizes = [files[s].tensors[name].nbytes for s, name in read] + [t.nbytes for f in plan.files for t in f.tensors]
    return max(sizes, default=0)


def lockstep_groups(files: list[TargetFile], limit: int, sources: list[TensorFile]) -> list[list[int]]:
    """Indices of target files grouped by identical tensor names (in first-appearance order), each group cut so
    that one step (the k-th tensor of every file in it) buffers at most ``limit`` bytes plus 10% (vocab
    padding). Each file's tensors are sized once (the group's steps are running sums), so the cost is linear in
    the files, not quadratic."""
    by_names: dict[tuple, list[int]] = {}
    for i, f in enumerate(files):
        by_names.setdefault((f.format, tuple(t.name for t in f.tensors)), []).append(i)
    cap = limit + limit // 10 + ALIGN * len(files)
    groups = []
    for members in by_names.values():
        current: list[int] = []
        steps: list[int] = []
        for i in members:
            sizes = buffered_bytes(files[i], sources)
            grown = [a + b for a, b in zip(steps, sizes)] if current else sizes
            if current and max(grown, default=0) > cap:
                groups.append(current)
                current, grown = [], sizes
            current.append(i)
            steps = grown
        groups.append(current)
    return groups


def halve_groups(groups: list[list[int]], parts: int) -> list[list[int]]:
    """Halve the largest groups until there are at least ``parts`` units (or every unit is one file)."""
    units = [list(g) for g in groups]
    while len(units) < parts:
        big = max(range(len(units)), key=lambda i: len(units[i]))
        if len(units[big]) < 2:
            break
        g = units.pop(big)
        units[big:big] = [g[:len(g) // 2], g[len(g) // 2:]]
    return units


def _cut(sizes: list[int], count: int) -> list[int]:
    """``count + 1`` tensor boundaries ``0 = b_0 < ... < b_count = len(sizes)``, b_j the boundary whose byte
    offset is nearest ``j / count`` of the total (each range at least one tensor)."""
    prefix = [0]
    for n in sizes:
        prefix.append(prefix[-1] + n)
    bounds = [0]
    for j in range(1, count):
        goal = prefix[-1] * j / count
        lo, hi = bounds[-1] + 1, len(sizes) - (count - j)  # leave a tensor for each range still to come
        bounds.append(min(range(lo, hi + 1), key=lambda b: (abs(prefix[b] - goal), b)))
    return bounds + [len(sizes)]


def cut_files(units: list, files: list[TargetFile], parts: int) -> list:
    """Units of single safetensors files cut into :class:`Piece` s until there are ``parts`` units (or no file
    can be cut further): each extra unit goes to the file with the most bytes per piece (the lowest index on a
    tie), and each file is then cut into that many byte-balanced tensor ranges. Other units stay as they are."""
    counts = [1] * len(units)
    cuttable = [i for i, u in enumerate(units)
                if isinstance(u, list) and len(u) == 1 and files[u[0]].format == "safetensors"]
    for _ in range(parts - len(units)):
        open_ = [i for i in cuttable if counts[i] < len(files[units[i][0]].tensors)]
        if not open_:
            break
        best = max(open_, key=lambda i: (files[units[i][0]].nbytes / counts[i], -i))
        counts[best] += 1
    out: list = []
    for unit, count in zip(units, counts):
        if count == 1:
            out.append(unit)
            continue
        bounds = _cut([t.nbytes for t in files[unit[0]].tensors], count)
        out.extend(Piece(unit[0], a, b) for a, b in zip(bounds, bounds[1:]))
    return out


def unit_bytes(unit, files: list[TargetFile]) -> int:
    if isinstance(unit, Piece):
        return sum(t.nbytes for t in files[unit.file].tensors[unit.start:unit.stop])
    return sum(files[i].nbytes for i in unit)


def assign(units: list, files: list[TargetFile], parts: int) -> list[list]:
    """Balance units over ``parts`` shares by bytes (largest first, ties to the lowest share): deterministic.
    Empty shares are dropped."""
    loads = [0] * parts
    shares: list[list] = [[] for _ in range(parts)]
    for unit in sorted(units, key=lambda u: -unit_bytes(u, files)):
        w = min(range(parts), key=lambda j: (loads[j], j))
        shares[w].append(unit)
        loads[w] += unit_bytes(unit, files)
    return [s for s in shares if s]


def partition(plan: Plan, files: list[TensorFile], parts: int, split_files: bool = False) -> list[list]:
    """The target files split into at most ``parts`` shares of units, balanced by bytes (steps 1-4 of the module
    docstring; step 3 only with ``split_files``)."""
    units: list = halve_groups(lockstep_groups(plan.files, largest_tensor(plan, files), files), parts)
    if split_files and len(units) < parts:
        units = cut_files(units, plan.files, parts)
    return assign(units, plan.files, parts)


def split_files(shares: list[list]) -> list[int]:
    """Indices of the files that ``shares`` cut into pieces, each once, in increasing order."""
    return sorted({u.file for share in shares for u in share if isinstance(u, Piece)})
