#!/usr/bin/env python
"""The block-FP8 source of scripts/bench.py's ``hf_fp8_to_bf16_hf`` op: the bench's bf16 model (Llama or
DeepSeek-V3) quantised as DeepSeek-V3's releases are (the rule of tests/fp8_checkpoints.py), streaming.

Every 2-D ``*proj.weight`` (attention and MLP projections, DeepSeek's ``kv_a_proj_with_mqa`` and experts included)
``W [M, N]`` becomes ``F8_E4M3`` ``W8 = (W / S).to(float8_e4m3fn)`` beside
``<name>_scale_inv`` = ``S`` (``F32 [ceil(M/128), ceil(N/128)]``, ``S = amax(|W|) / 448`` per 128 x 128 block, the
last block row / column partial); the embedding, head, norms and router stay as stored (bf16; DeepSeek's router
bias fp32); config.json gets
``quantization_config`` (fp8, e4m3, dynamic, ``weight_block_size [128, 128]``). Each weight is read and written
in bands of 128 rows, so memory stays at a few bands whatever the model size.

    python scripts/bench_fp8.py SRC_BF16_HF DST
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from pathlib import Path

BLOCK = 128
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def quantized(name: str, shape: list[int]) -> bool:
    return len(shape) == 2 and name.endswith(("proj.weight", "proj_with_mqa.weight"))


def band_fp8(w):
    """One band of at most 128 rows (bf16 torch tensor ``[r, N]``): its fp8 bytes and its scale row ``[ceil(N/128)]``."""
    import torch

    rows, cols = w.shape
    blocks = -(-cols // BLOCK)
    padded = torch.zeros((rows, blocks * BLOCK), dtype=torch.float32)
    padded[:, :cols] = w.to(torch.float32)
    amax = padded.abs().reshape(rows, blocks, BLOCK).amax(dim=(0, 2))
    scale = amax / 448.0
    scale[scale == 0] = 1.0  # an all-zero block: any scale
    q = (padded.reshape(rows, blocks, BLOCK) / scale[None, :, None]).reshape(rows, -1)[:, :cols]
    return q.to(torch.float8_e4m3fn).contiguous().view(torch.uint8).numpy().tobytes(), scale


def quantize_file(src: Path, dst: Path) -> list[str]:
    """Quantise one safetensors shard; returns its tensor names as written."""
    import torch
    from safetensors import safe_open

    with safe_open(str(src), "pt") as f:
        names = list(f.keys())
        shapes = {n: f.get_slice(n).get_shape() for n in names}
        dtypes = {n: f.get_slice(n).get_dtype() for n in names}
        header, entries, offset = {"__metadata__": {"format": "pt"}}, [], 0
        for n in names:
            shape = shapes[n]
            if quantized(n, shape):
                scale_shape = [-(-shape[0] // BLOCK), -(-shape[1] // BLOCK)]
                entries += [(n, "F8_E4M3", shape, math.prod(shape)), (n + "_scale_inv", "F32", scale_shape,
                                                                       4 * math.prod(scale_shape))]
            else:
                entries.append((n, dtypes[n], shape, {"BF16": 2, "F32": 4}[dtypes[n]] * math.prod(shape)))
        for n, dtype, shape, nbytes in entries:
            header[n] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        tmp = dst.with_name(dst.name + ".tmp")
        with open(tmp, "wb") as out:
            out.write(struct.pack("<Q", len(raw)) + raw)
            for n in names:
                piece = f.get_slice(n)
                shape = shapes[n]
                if not quantized(n, shape):
                    for r0 in range(0, shape[0], 4096):
                        out.write(piece[r0:r0 + 4096].contiguous().view(torch.uint8).numpy().tobytes())
                    continue
                scales = []
                for r0 in range(0, shape[0], BLOCK):
                    data, scale = band_fp8(piece[r0:r0 + BLOCK])
                    out.write(data)
                    scales.append(scale)
                out.write(torch.stack(scales).numpy().astype("<f4").tobytes())
        os.replace(tmp, dst)
    return [n for n, *_ in entries]


def quantize_folder(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for shard in sorted(p.name for p in src.iterdir() if p.name.endswith(".safetensors")):
        for name in quantize_file(src / shard, dst / shard):
            weight_map[name] = shard
        total += (dst / shard).stat().st_size
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QUANT_CONFIG
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


if __name__ == "__main__":
    quantize_folder(Path(sys.argv[1]), Path(sys.argv[2]))
