"""Where each parameter of a DeepSpeed checkpoint lies: byte segments of the rank files (deepspeed 0.19.x).

Every map returns ``{name: [(file index, byte offset, element count), ...]}`` in element order (the
flattened parameter), for :class:`reshard.io.segmented.SegmentedFile`. ``Flat`` is one rank's flat buffer: the
saved tensors of its groups (or sub-groups), each located through the zip record of its storage.

- ZeRO-1/2 (``stage_1_and_2.py``) and BF16_Optimizer (``bf16_optimizer.py``), per param group ``g``: the ranks'
  saved ``single_partition_of_fp32_groups[g]`` concatenated (``S_0 ‖ S_1 ‖ ...``) hold parameter ``i`` at
  ``[o_i, o_i + numel_i)``, ``o_{i+1} = o_i + numel_i + param_alignment_paddings[g][i]``; a range that
  straddles ranks is split at their boundaries. ZeRO-1/2 saves the partitions without the tail padding
  (``ceil_{2W}(o_end) == ceil_{2W}(Σ S_d)``), BF16_Optimizer with it (``Σ S_d - Σ group_paddings == o_end``).
- ZeRO-3 (``stage3.py``): rank ``d``'s ``fp32_flat_groups`` concatenated hold, for each parameter ``p`` in
  ``param_shapes`` order, ``flat(p)[d·c_p, (d+1)·c_p)`` zero-padded to ``c_p = ceil(numel_p / W)``; the same
  rule splits a frozen parameter over the ranks' ``frozen_param_fragments``.
"""

from __future__ import annotations

import math

from reshard.errors import CheckpointError

Segment = tuple[int, int, int]


class Flat:
    """One rank's flat buffer: ``pieces`` = ``(file index, byte offset, element count)`` of its saved tensors in
    order, all of one dtype of ``itemsize`` bytes."""

    def __init__(self, pieces: list[Segment], itemsize: int):
        self.pieces, self.itemsize = pieces, itemsize
        self.numel = sum(n for _, _, n in pieces)

    def cut(self, start: int, count: int) -> list[Segment]:
        """Elements ``[start, start + count)`` of the buffer as segments (split where the saved tensors meet)."""
        out, pos, stop = [], 0, start + count
        for index, offset, n in self.pieces:
            lo, hi = max(start, pos), min(stop, pos + n)
            if lo < hi:
                out.append((index, offset + (lo - pos) * self.itemsize, hi - lo))
            pos += n
        if count and sum(n for _, _, n in out) != count:
            raise AssertionError("cut past the end of a flat buffer")
        return out


def _ceil(n: int, m: int) -> int:
    return -(-n // m) * m


def zero12_map(where: str, shapes: list[dict], ranks: list[list[Segment]], itemsize: int,
               alignment: list[list[int]] | None, padded_saved: bool, group_paddings: list[list[int]],
               slice_mappings: list[list[dict]] | None) -> dict[str, list[Segment]]:
    """ZeRO-1/2 / BF16_Optimizer (see the module docstring). ``shapes[g]``: name -> shape in flat order;
    ``ranks[d][g]``: rank d's saved tensor of group g as one segment; ``alignment[g][i]``: zeros after parameter i
    (None: none); ``group_paddings[d][g]``: rank d's tail padding; ``slice_mappings[d][g]``: name -> (numel, start)
    of rank d's piece of it (cross-checked when given)."""
    world = len(ranks)
    out: dict[str, list[Segment]] = {}
    for g, group in enumerate(shapes):
        saved = [ranks[d][g] for d in range(world)]
        starts = [0]
        for _, _, n in saved:
            starts.append(starts[-1] + n)
        flat = Flat(saved, itemsize)
        offset = 0
        for i, (name, shape) in enumerate(group.items()):
            numel = math.prod(shape)
            if offset + numel > flat.numel:
                raise CheckpointError(f"{where}: param_shapes do not match the fp32 partitions (group {g}: "
                                      f"'{name}' ends at element {offset + numel} of {flat.numel})")
            out[name] = flat.cut(offset, numel)
            if slice_mappings is not None:
                _check_fragments(where, name, offset, numel, starts, slice_mappings, g)
            offset += numel + (alignment[g][i] if alignment else 0)
        total = flat.numel
        if padded_saved:
            ok = total - sum(p[g] for p in group_paddings) == offset
        else:
            ok = _ceil(offset, 2 * world) == _ceil(total, 2 * world)
        if not ok:
            raise CheckpointError(f"{where}: param_shapes do not match the fp32 partitions (group {g}: the "
                                  f"parameters take {offset} elements, the {world} partitions {total})")
    return out


def _check_fragments(where: str, name: str, offset: int, numel: int, starts: list[int],
                     slice_mappings: list[list[dict]], g: int) -> None:
    """``param_slice_mappings`` of every rank must put ``name``'s piece where the byte map does."""
    for d in range(len(starts) - 1):
        lo, hi = max(offset, starts[d]), min(offset + numel, starts[d + 1])
        fragment = slice_mappings[d][g].get(name) if g < len(slice_mappings[d]) else None
        expected = (hi - lo, lo - starts[d]) if lo < hi else None
        found = (fragment.numel, fragment.start) if fragment is not None else None
        if found != expected:
            raise CheckpointError(f"{where}: param_shapes do not match the fp32 partitions: param_slice_mappings of "
                                  f"rank {d} put '{name}' at {found} (numel, start), param_shapes at {expected} "
                                  "(an inconsistent or overwritten checkpoint)")


def zero3_map(where: str, shapes: dict, flats: list[Flat]) -> dict[str, list[Segment]]:
    """ZeRO-3 (see the module docstring): ``shapes`` name -> shape over all sub-groups in order, ``flats[d]``
    rank d's concatenated ``fp32_flat_groups``."""
    world = len(flats)
    out: dict[str, list[Segment]] = {}
    offset = 0
    for name, shape in shapes.items():
        out[name], offset = _partitioned(name, math.prod(shape), flats, offset)
    for d, flat in enumerate(flats):
        if flat.numel != offset:
            raise CheckpointError(f"{where}: param_shapes do not match the fp32 partitions (rank {d} holds "
                                  f"{flat.numel} elements, the {world}-way partitions of the parameters "
                                  f"{offset})")
    return out


def _partitioned(name: str, numel: int, flats: list[Flat], offset: int) -> tuple[list[Segment], int]:
    """A parameter split ``ceil(numel / W)`` per rank at ``offset`` of every rank's buffer; the next offset."""
    part = -(-numel // len(flats))
    segments = []
    for d, flat in enumerate(flats):
        count = max(0, min(part, numel - d * part))
        if offset + part > flat.numel:
            raise CheckpointError(f"param_shapes do not match the partitions ('{name}' ends at element "
                                  f"{offset + part} of rank {d}'s {flat.numel})")
        segments += flat.cut(offset, count)
    return segments, offset + part


def zero3_frozen_map(where: str, shapes: dict, fragments: list[dict[str, Segment]]) -> dict[str, list[Segment]]:
    """ZeRO-3 frozen parameters: ``fragments[d][name]`` is rank d's ``ceil(numel / W)`` partition (one tensor)."""
    out = {}
    world = len(fragments)
    for name, shape in shapes.items():
        numel = math.prod(shape)
        part = -(-numel // world)
        segments = []
        for d in range(world):
            fragment = fragments[d].get(name)
            if fragment is None or fragment[2] != part:
                raise CheckpointError(f"{where}: rank {d} holds {fragment and fragment[2]} elements of frozen "
                                      f"'{name}', not its {world}-way partition of {part}")
            count = max(0, min(part, numel - d * part))
            if count:
                segments.append((fragment[0], fragment[1], count))
        out[name] = segments
    return out
