"""Pack slots stored alternating row by row (gpt-oss's fused gate / up: HF ``gate_up_proj [E, H, 2I]`` columns
``2k`` = gate row k, ``2k + 1`` = up row k; vLLM's per-rank ``w13_weight [E, 2I/T, H]`` the same within the rank's
slice; the biases likewise), families-2.md sections 2.1 / 2.4 and 14.2 F.

Canonically the slots stay separate (``gate``, ``up``), laid end to end as every other gate_up pack (Megatron's
``[gate; up]``). Along a tensor's axis, in units of ``u`` rows, the stored row ``2i + j`` of a unit is row
``j * u/2 + i`` of the end-to-end order:

- a target (:attr:`~reshard.core.pieces.StoredTensor.pair_interleaved`) is assembled end to end, then its rows are
  reordered (:func:`interleave`), through torch (``reshard.io.gather.direct`` declines it);
- a source tensor stored alternating is read through :class:`PairFile`, which presents it end to end (one
  block = one expert at a time), so the planner's pieces stay contiguous (:func:`unpair_sources`).
"""

from __future__ import annotations

from dataclasses import replace

from reshard.core.pieces import StoredTensor
from reshard.io.tensorfile import BlockWrappedFile, TensorFile


def interleave(data, axis: int, unit: int):
    """End-to-end order -> alternating, along ``axis`` in units of ``unit`` rows."""
    n = data.shape[axis]
    return data.unflatten(axis, (n // unit, 2, unit // 2)).transpose(axis + 1, axis + 2).flatten(axis, axis + 2)


def deinterleave(data, axis: int, unit: int):
    """Alternating -> end-to-end order (the inverse of :func:`interleave`)."""
    n = data.shape[axis]
    return data.unflatten(axis, (n // unit, unit // 2, 2)).transpose(axis + 1, axis + 2).flatten(axis, axis + 2)


class PairFile(BlockWrappedFile):
    """A source file whose alternating tensors (name -> (axis within a block of dim 0, unit)) read end to end; its
    other tensors are the base file's own. Reads go through torch (``direct_bytes`` False), a block at a time (the
    gate and up slots read one block after the other: reordered once)."""

    def __init__(self, base: TensorFile, paired: dict[str, tuple[int, int]]):
        super().__init__(base, dict(base.tensors))
        self.paired = paired

    def extents(self, name: str) -> list[tuple[int, int, int]]:
        """Read-ahead extents of ``name``: the base file's bytes of it, whole."""
        return whole_extents(self.base, name)

    def transforms(self, name: str) -> bool:
        return name in self.paired

    def make_block(self, name: str, index: int):
        """Block ``index`` of alternating tensor ``name``, its rows in end-to-end order."""
        inner, unit = self.paired[name]
        block = self.base.read_block(name, index)
        if block.dim() == 2 and inner == 1 and block.t().is_contiguous():  # an [R, C] buffer read as [C, R]
            return deinterleave(block.t(), 0, unit).t()  # reorder whole rows of the buffer
        return deinterleave(block, inner, unit)


def assemble_paired(tensor, files: list[TensorFile], allow_overflow: bool, assemble):
    """An alternating target (``tensor.pair_interleaved``) as torch: block by block straight from a source stored
    with the same alternation (:func:`same_blocks`: HF -> HF, vLLM -> vLLM at one TP, an MXFP4 release -> bf16), else
    built end to end by ``assemble`` and reordered."""
    import torch

    from reshard.io import casts, dtypes

    blocks = same_blocks(tensor, files)
    if blocks is None:
        return interleave(assemble(replace(tensor, pair_interleaved=0), files, allow_overflow), tensor.axis,
                          tensor.pair_interleaved)
    out = torch.empty(tensor.shape, dtype=dtypes.to_torch(tensor.dtype))
    for block, (source, name, src_block) in blocks.items():
        data = files[source].base.read_block(name, src_block)
        out[block].copy_(data)
        if not allow_overflow:
            casts.check_cast(tensor.name, data, out[block])
    return out


def same_blocks(tensor, files: list[TensorFile]) -> dict[int, tuple[int, str, int]] | None:
    """dst block -> (source file, tensor, src block) when every block of the alternating target ``tensor`` is one
    whole block of a :class:`PairFile` tensor alternating in the same unit along the same axis, read slot after slot
    in place (so the two reorders cancel); else None."""
    unit, inner = tensor.pair_interleaved, tensor.axis - 1
    found: dict[int, tuple[int, str, int]] = {}
    covered: dict[int, int] = {}
    for op in tensor.reads:
        file = files[op.source]
        if op.dst_block is None or op.src_block is None or op.transposed or op.interleave or op.rows is not None \
                or not isinstance(file, PairFile) or file.paired.get(op.tensor) != (inner, unit) \
                or op.src_start != op.dst_start:
            return None
        key = (op.source, op.tensor, op.src_block)
        if found.setdefault(op.dst_block, key) != key:
            return None
        covered[op.dst_block] = covered.get(op.dst_block, 0) + op.length
    if tensor.has_padding or any(n != unit for n in covered.values()) or len(found) != tensor.shape[0]:
        return None
    return found


def paired_rows(tensor, axis: int, unit: int, start: int, length: int):
    """Rows ``[start, start + length)`` of the end-to-end order of ``tensor``, stored alternating along ``axis`` in
    units of ``unit`` rows, as a view of the stored rows (step 2): live resharding (reshard/live) reads a source
    slice and places a target slice this way. The range lies within one slot (gate or up) of one unit, as the
    planner's ops do (canonically the slots are separate tensors)."""
    half = unit // 2
    k, r = divmod(start, unit)
    j, i = divmod(r, half)
    if i + length > half:
        raise AssertionError(f"rows {start}..{start + length} cross a slot of an alternating unit of {unit}")
    rows = tensor.narrow(axis, k * unit + 2 * i + j, 2 * length - 1)
    return rows[(slice(None),) * axis + (slice(None, None, 2),)]


def whole_extents(file: TensorFile, name: str) -> list[tuple[int, int, int]]:
    """``(fd, offset, length)`` of tensor ``name`` of ``file``, whole (the base's own extents when it has no direct
    bytes)."""
    if not file.direct_bytes:
        return file.extents(name)
    loc = file.tensors[name]
    return [(file.fd, loc.offset, loc.nbytes)]


def unpair_sources(files: list[TensorFile], stored: list[tuple[int, StoredTensor]]):
    """``(files, stored)`` with every alternating stored tensor (stacked, reordered along its axis) read through a
    :class:`PairFile` and described end to end."""
    paired: dict[int, dict[str, tuple[int, int]]] = {}
    out = []
    for index, tensor in stored:
        if tensor.pair_interleaved:
            if not tensor.stacked:
                raise AssertionError(f"{tensor.name}: alternating rows are read per stacked block")
            paired.setdefault(index, {})[tensor.name] = (tensor.axis - 1, tensor.pair_interleaved)
            tensor = replace(tensor, pair_interleaved=0)
        out.append((index, tensor))
    files = [PairFile(f, paired[i]) if i in paired else f for i, f in enumerate(files)]
    return files, out


def end_to_end(stacked):
    """A stacked ``[E, R, ...]`` tensor whose blocks alternate along R (vLLM's gpt-oss ``w13``), end to end."""
    return deinterleave(stacked, 1, stacked.shape[1])
