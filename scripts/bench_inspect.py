"""Read-only inspection of checkpoints on disk for scripts/bench.py: safetensors headers, directory
sizes and the largest tensor of an output (no tensor data is read)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------
# Inspection helpers
# --------------------------------------------------------------------------------------


def read_safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def largest_tensor_in_dir(path: Path) -> dict[str, Any] | None:
    """Largest tensor found in the safetensors / torch files under ``path``.  Safetensors
    headers are parsed directly; torch files are opened with ``torch.load(mmap=True)`` so
    no tensor data is read.  Returns None when nothing could be inspected."""
    best: dict[str, Any] | None = None
    errors: list[str] = []

    def consider(name: str, nbytes: int, shape: list[int], file: Path) -> None:
        nonlocal best
        if best is None or nbytes > best["bytes"]:
            best = {"name": name, "bytes": int(nbytes), "shape": [int(x) for x in shape], "file": str(file.relative_to(path))}

    for f in sorted(path.rglob("*.safetensors")):
        try:
            for name, info in read_safetensors_header(f).items():
                start, end = info["data_offsets"]
                consider(name, end - start, info["shape"], f)
        except Exception as e:  # noqa: BLE001 - inspection is best effort
            errors.append(f"{f.name}: {e!r}")
    torch_files = [f for ext in ("*.pt", "*.pth", "*.bin") for f in sorted(path.rglob(ext))]
    if torch_files:
        try:
            import torch
        except ImportError as e:
            errors.append(repr(e))
            torch_files = []
        for f in torch_files:
            try:
                obj = torch.load(f, map_location="cpu", mmap=True, weights_only=False)
            except Exception as e:  # noqa: BLE001
                errors.append(f"{f.name}: {e!r}")
                continue
            stack: list[tuple[str, Any]] = [("", obj)]
            while stack:
                prefix, o = stack.pop()
                if isinstance(o, torch.Tensor):
                    consider(prefix, o.numel() * o.element_size(), list(o.shape), f)
                elif isinstance(o, dict):
                    stack.extend((f"{prefix}.{k}" if prefix else str(k), v) for k, v in o.items())
                elif isinstance(o, (list, tuple)):
                    stack.extend((f"{prefix}[{i}]", v) for i, v in enumerate(o))
            del obj
    if best is not None and errors:
        best["errors"] = errors
    return best
