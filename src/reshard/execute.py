"""Runs a plan: assembles each target tensor from positioned source reads and streams it to its file."""

from __future__ import annotations

import os

import torch
from tqdm import tqdm

from reshard.core.plan import Plan, ReplicaCheck, TargetFile, TargetTensor
from reshard.errors import CheckpointError
from reshard.io import dtypes
from reshard.io.safetensors_format import SafetensorsWriter
from reshard.io.tensorfile import TensorFile
from reshard.io.torch_format import TensorSlot, TorchZipWriter


def assemble(tensor: TargetTensor, files: list[TensorFile]) -> torch.Tensor:
    """Build one target tensor: zeros where it is padding, source slices elsewhere (cast if dtypes differ)."""
    dtype = dtypes.to_torch(tensor.dtype)
    if tensor.fill is not None:
        return torch.full(tensor.shape, tensor.fill, dtype=dtype)
    if len(tensor.reads) == 1 and not tensor.has_padding:
        op = tensor.reads[0]
        data = files[op.source].read(op.tensor, tensor.axis, op.src_start, op.length)
        if tuple(data.shape) == tuple(tensor.shape):
            return data.to(dtype)
    buf = torch.zeros(tensor.shape, dtype=dtype) if tensor.has_padding else torch.empty(tensor.shape, dtype=dtype)
    for op in tensor.reads:
        data = files[op.source].read(op.tensor, tensor.axis, op.src_start, op.length)
        buf.narrow(tensor.axis, op.dst_start, op.length).copy_(data)
    return buf


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def run_replica_checks(checks: list[ReplicaCheck], files: list[TensorFile], source_names: list[str]) -> list[str]:
    """Compare every replica against the copy that will be read; returns one message per mismatch."""
    problems = []
    for check in checks:
        a = files[check.first.source].read(check.first.tensor, check.axis, check.first.src_start, check.first.length)
        b = files[check.other.source].read(check.other.tensor, check.axis, check.other.src_start, check.other.length)
        if not bits_equal(a, b):
            diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else float("nan")
            problems.append(f"replicas of '{check.canonical}' differ: {check.first.tensor} in "
                            f"{source_names[check.first.source]} vs {check.other.tensor} in "
                            f"{source_names[check.other.source]} (max difference {diff:g})")
    return problems


def _fill_slots(payload, tensors: dict[str, TargetTensor]):
    if isinstance(payload, TensorSlot):
        t = tensors[payload.name]
        payload.dtype, payload.shape = t.dtype, tuple(t.shape)
    elif isinstance(payload, dict):
        for value in payload.values():
            _fill_slots(value, tensors)


def write_file(target: TargetFile, files: list[TensorFile], out_dir: str, bar: tqdm | None = None) -> None:
    path = os.path.join(out_dir, target.path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if target.format == "safetensors":
        writer = SafetensorsWriter(path, [(t.name, t.dtype, t.shape) for t in target.tensors], target.metadata)
    else:
        _fill_slots(target.payload, {t.name: t for t in target.tensors})
        writer = TorchZipWriter(path, target.payload, [t.name for t in target.tensors])
    try:
        for tensor in target.tensors:
            data = assemble(tensor, files)
            writer.write(tensor.name, data)
            del data
            if bar is not None:
                bar.update(tensor.nbytes)
        writer.finish()
    except BaseException:
        writer.abort()
        raise


def execute(plan: Plan, files: list[TensorFile], out_dir: str, progress: bool = True) -> None:
    with tqdm(total=plan.nbytes, unit="B", unit_scale=True, unit_divisor=1024, desc="converting",
              disable=not progress, leave=False) as bar:
        for target in plan.files:
            write_file(target, files, out_dir, bar)


def ensure_replicas_agree(plan: Plan, files: list[TensorFile], allow_mismatch: bool, warn) -> None:
    problems = run_replica_checks(plan.checks, files, plan.source_files)
    if problems and not allow_mismatch:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(problems[0] + more + "; pass --allow-replica-mismatch to take rank 0's copy")
    for p in problems:
        warn(p + "; taking the first rank's copy")
