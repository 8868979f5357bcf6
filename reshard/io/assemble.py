"""Builds one tensor through torch from positioned source reads: casts, transposes, RoPE row reorders, zero padding.

The executor's byte path is :mod:`reshard.io.gather`; this is the path for what raw bytes cannot express (a
dtype cast, a transposed source, a strided block), used by the executor per block, by the verifier and by
``load_rank``.
"""

from __future__ import annotations

from dataclasses import replace

from reshard.core.plan import ReadOp, TargetTensor
from reshard.io import dtypes
from reshard.io import casts, mamba_values, pair_rows
from reshard.io.fp8 import is_dequantized
from reshard.io.tensorfile import TensorFile


def assemble(tensor: TargetTensor, files: list[TensorFile], allow_overflow: bool = True):
    """Build one target tensor as a torch tensor: zeros where it is padding, source slices elsewhere (cast if
    dtypes differ; ``allow_overflow=False`` refuses a cast that makes finite values infinite). Used for casts and
    by the verifier; the executor's byte path is :mod:`reshard.io.gather`."""
    import torch

    if tensor.pair_interleaved:  # slots alternating row by row (gpt-oss gate/up): built end to end, then reordered
        return pair_rows.assemble_paired(tensor, files, allow_overflow, assemble)
    dtype = dtypes.to_torch(tensor.dtype)
    if tensor.fill is not None:
        return torch.full(tensor.shape, tensor.fill, dtype=dtype)
    if len(tensor.reads) == 1 and not tensor.has_padding and not tensor.reads[0].blocked:  # (reorders: torch)
        op = tensor.reads[0]
        data = read_op(op, tensor.axis, files, tensor.dtype, allow_overflow)
        if tuple(data.shape) == tuple(tensor.shape):
            cast = data.to(dtype)
            if not allow_overflow:
                casts.check_cast(tensor.name, data, cast)
            return cast
    buf = torch.zeros(tensor.shape, dtype=dtype) if tensor.has_padding else torch.empty(tensor.shape, dtype=dtype)
    for op in tensor.reads:
        data = read_op(op, tensor.axis, files, tensor.dtype, allow_overflow)
        if op.dst_block is not None:
            part = buf[op.dst_block].narrow(tensor.axis - 1, op.dst_start, op.length)
        else:
            part = buf.narrow(tensor.axis, op.dst_start, op.length)
        part.copy_(data)
        if not allow_overflow:
            casts.check_cast(tensor.name, data, part)
    return buf


def rope_rows(data, head_dim: int):
    """Reorder rows inside each head: ``head_dim > 0`` from interleaved-RoPE order (row ``2i + j`` of a head) to
    rotate-half order (row ``j * d/2 + i``), ``< 0`` back (transformers' Llama conversion ``permute`` and its
    inverse)."""
    d = abs(head_dim)
    rest = data.shape[1:]
    if head_dim > 0:
        return data.reshape(-1, d // 2, 2, *rest).transpose(1, 2).reshape(data.shape)
    return data.reshape(-1, 2, d // 2, *rest).transpose(1, 2).reshape(data.shape)


def read_op(op: ReadOp, axis: int, files: list[TensorFile], dtype: str | None = None, allow_overflow: bool = True):
    """``op``'s slice of its source tensor, in the target's orientation (a transposed op reads along the
    source's other axis and is transposed; a RoPE reorder permutes rows inside each head). A block-FP8 weight
    (:mod:`reshard.io.fp8`) is dequantised into ``dtype`` (the target's; None: fp32) band by band, the other
    tensors come in their stored dtype."""
    if op.transform:  # vLLM's A = -exp(A_log) and its inverse (reshard/io/mamba_values.py)
        return mamba_values.apply(op.transform, read_op(replace(op, transform=""), axis, files, dtype, allow_overflow))
    if op.shift:  # a stored value offset (Megatron's zero-centred norm); exact for weights in [0.5, 2]
        return read_op(replace(op, shift=0.0), axis, files, dtype, allow_overflow) + op.shift
    if op.interleave:
        return rope_rows(read_op(replace(op, interleave=0), axis, files, dtype, allow_overflow), op.interleave)
    if op.src_block is not None:  # the slice within one block of a stacked source (rows: of that block)
        data = files[op.source].read_block(op.tensor, op.src_block, op.source_axis(axis) - 1, op.src_start,
                                           op.length, op.rows)
    elif is_dequantized(files, op.source, op.tensor):
        data = files[op.source].read(op.tensor, op.source_axis(axis), op.src_start, op.length, op.rows, dtype,
                                     allow_overflow)
    else:
        data = files[op.source].read(op.tensor, op.source_axis(axis), op.src_start, op.length, op.rows)
    return data.t() if op.transposed else data


def bits_equal(a, b) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
