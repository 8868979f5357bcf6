"""MXFP4 expert weights as gpt-oss is released (families-2.md section 2.2), read dequantised exactly.

Layout: ``config.json`` ``quantization_config = {"quant_method": "mxfp4", ...}``; each quantized fused expert tensor
``<name>`` (``model.layers.{i}.mlp.experts.gate_up_proj`` / ``down_proj``) is stored as two uint8 tensors

    <name>_blocks  U8 [E, R, G, 16]    FP4 E2M1 codes, two per byte (low nibble first); R output rows, G = C / 32
    <name>_scales  U8 [E, R, G]        E8M0 exponent of each block of 32 inputs

and the value read is (the rule transformers' ``convert_moe_packed_tensors`` computes, bit for bit)

    W[e, r, 32g + 2j]     = LUT[blocks[e, r, g, j] & 0x0F] * 2^(scales[e, r, g] - 127)
    W[e, r, 32g + 2j + 1] = LUT[blocks[e, r, g, j] >> 4]   * 2^(scales[e, r, g] - 127)

an fp32 product (exact: at most two significant bits times a power of two) cast to the output dtype (bf16 by
default: exact too, exponent range permitting). ``<name>`` then reads in Hugging Face's in-memory / bf16 form,
``W.transpose(1, 2)``: ``gate_up_proj [E, H, 2I]`` (columns interleaved gate / up, as the release's rows),
``down_proj [E, I, H]``. Reads are per expert and in bands of :data:`CHUNK_ELEMENTS` rows' worth of products, so
memory stays bounded by one expert of the output (:class:`Mxfp4File`). Writing MXFP4 is not supported (re-quantising
is lossy): the output is bf16, and ``quantization_config`` is dropped (:func:`note`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from reshard.errors import CheckpointError
from reshard.io.tensorfile import BlockWrappedFile, TensorFile, TensorLocation

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
BLOCK_BYTES = 16  # 32 FP4 values per block, two per byte
BLOCK_VALUES = 2 * BLOCK_BYTES
#: FP4 E2M1 code -> value (transformers' ``FP4_VALUES``).
LUT = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: fp32 products computed at once (4 MiB of scratch).
CHUNK_ELEMENTS = 1 << 20
_FIX = ("reshard reads MXFP4 as gpt-oss is released (quant_method mxfp4; <name>_blocks U8 [E, R, C/32, 16] with "
        "<name>_scales U8 [E, R, C/32])")


@dataclass(frozen=True)
class Packed:
    """One MXFP4 tensor: its blocks and scales names and files (indices into the source's files), and the shape
    it reads as (Hugging Face's ``[E, C, R]``)."""

    blocks: str
    scales: str
    blocks_file: int
    scales_file: int
    shape: tuple[int, int, int]


@dataclass
class Mxfp4View:
    """The MXFP4 tensors of one HF source: read name (``<name>``) -> :class:`Packed`."""

    weights: dict[str, Packed]

    @property
    def stored(self) -> set[str]:
        """The names on disk that the read names replace (every ``_blocks`` and ``_scales``)."""
        return {n for p in self.weights.values() for n in (p.blocks, p.scales)}

    def describe(self, dtype: str) -> str:
        return f"MXFP4 (FP4 E2M1, E8M0 scales per 32), {len(self.weights)} expert tensors, read dequantised to {dtype}"


def is_mxfp4(config: dict) -> bool:
    """Whether ``config.json``'s ``quantization_config`` says MXFP4."""
    quant = config.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


def find_mxfp4(where: str, config: dict, files: list[TensorFile]) -> Mxfp4View | None:
    """The MXFP4 tensors of an HF source (None when its ``quantization_config`` is not MXFP4), each ``_blocks``
    checked against its ``_scales``; a missing partner, a wrong dtype or block shape is refused in one line."""
    located: dict[str, int] = {}
    for i, f in enumerate(files):
        for name in f.tensors:
            located.setdefault(name, i)

    def loc(name) -> TensorLocation:
        return files[located[name]].tensors[name]

    blocks = sorted(n for n in located if n.endswith(BLOCKS_SUFFIX))
    scales = sorted(n for n in located if n.endswith(SCALES_SUFFIX))
    quant = config.get("quantization_config")
    method = quant.get("quant_method", "unknown method") if isinstance(quant, dict) else None
    if method not in (None, "mxfp4", "fp8"):
        raise CheckpointError(f"{where} is a quantized checkpoint (quantization_config: {method}); reshard reads "
                              "MXFP4 (gpt-oss's release) and block FP8 only: dequantize it first, or convert the "
                              "original bf16/fp16 release")
    if not is_mxfp4(config):
        if blocks and any(n[:-len(BLOCKS_SUFFIX)] + SCALES_SUFFIX in located for n in blocks):
            raise CheckpointError(f"{where}: tensor '{blocks[0]}' looks MXFP4 but config.json has no quantization_"
                                  "config with quant_method mxfp4: restore the release's config.json")
        return None
    if not blocks and not scales:
        raise CheckpointError(f"{where} is a quantized checkpoint (quantization_config: mxfp4) but no tensor is "
                              f"'*{BLOCKS_SUFFIX}': it was dequantised already; remove quantization_config from its "
                              "config.json")
    weights = {}
    for name in blocks:
        base = name[:-len(BLOCKS_SUFFIX)]
        scale = base + SCALES_SUFFIX
        if scale not in located:
            raise CheckpointError(f"{where}: tensor '{name}' has no '{scale}': restore the scale tensor (an "
                                  "incomplete download?)")
        if base in located:
            raise CheckpointError(f"{where}: tensor '{base}' is stored both whole and as MXFP4 '{name}': remove one")
        b, s = loc(name), loc(scale)
        for n, t in ((name, b), (scale, s)):
            if t.dtype != "U8":
                raise CheckpointError(f"{where}: tensor '{n}' is {t.dtype}, not U8; {_FIX}")
        if len(b.shape) != 4 or b.shape[-1] != BLOCK_BYTES:
            raise CheckpointError(f"{where}: tensor '{name}' has shape {list(b.shape)}, not [E, R, C/32, "
                                  f"{BLOCK_BYTES}]; {_FIX}")
        if tuple(s.shape) != tuple(b.shape[:-1]):
            raise CheckpointError(f"{where}: scale '{scale}' has shape {list(s.shape)} but '{name}' "
                                  f"{list(b.shape)} needs {list(b.shape[:-1])}: the blocks or scales are wrong")
        e, r, g, _ = b.shape
        weights[base] = Packed(name, scale, located[name], located[scale], (e, g * BLOCK_VALUES, r))
    for scale in scales:
        base = scale[:-len(SCALES_SUFFIX)]
        if base not in weights:
            raise CheckpointError(f"{where}: scale '{scale}' has no '{base}{BLOCKS_SUFFIX}': remove the stray scale "
                                  "or restore its blocks")
    return Mxfp4View(weights)


def note(view: Mxfp4View, dtype: str) -> str:
    """The plan's line for an MXFP4 source (families-2.md section 17: an info line, not a refusal)."""
    return (f"read {view.describe(dtype)}; writing MXFP4 is not supported; the output is {dtype} (dequantised "
            "exactly) and drops quantization_config")


@functools.lru_cache(maxsize=1)
def _pairs():
    """Each byte's two fp32 values (low nibble first) as one uint64: one ``np.take`` decodes a whole block row."""
    import numpy as np

    lut = np.array(LUT, np.float32)
    codes = np.arange(256)
    return np.ascontiguousarray(np.stack([lut[codes & 0x0F], lut[codes >> 4]], axis=1)).view(np.uint64).reshape(-1)


def dequantize(blocks, scales, dtype=None, out=None):
    """``[.., R, G, 16]`` uint8 blocks and ``[.., R, G]`` uint8 scales -> ``[.., R, 32 G]`` (the release's
    ``[out, in]`` order) in ``dtype`` (default bf16), or into ``out`` (contiguous, or one expert's transposed
    ``[R, C]`` view): fp32 products, ``CHUNK_ELEMENTS`` at a time, then one cast each."""
    import numpy as np
    import torch

    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise CheckpointError(f"MXFP4 scales {list(scales.shape)} do not match blocks {list(blocks.shape)}")
    *prefix, g, nb = blocks.shape
    cols = g * 2 * nb
    if out is None:
        out = torch.empty((*prefix, cols), dtype=dtype or torch.bfloat16)
    codes = blocks.reshape(-1, g * nb).contiguous().numpy()
    exps = scales.reshape(-1, g).to(torch.int32) - 127
    flat_o = out.view(-1, cols) if out.is_contiguous() else None
    rows = codes.shape[0]
    step = max(1, CHUNK_ELEMENTS // max(1, cols))
    scratch = torch.empty((min(rows, step), cols), dtype=torch.float32)
    table = _pairs()
    for a in range(0, rows, step):
        b = min(rows, a + step)
        vals = scratch[:b - a]
        np.take(table, codes[a:b], out=vals.numpy().view(np.uint64), mode="clip")  # every byte is in range
        e = exps[a:b]
        if int(e.max()) < 128:  # 2^e is a finite fp32: one exact multiply per value, as torch.ldexp computes
            vals.view(b - a, g, 2 * nb).mul_(torch.ldexp(torch.ones(e.shape), e).unsqueeze(-1))
        else:  # scale 255: torch.ldexp keeps 0.5 * 2^128 finite, as transformers' converter does
            torch.ldexp(vals.view(b - a, g, 2 * nb), e.unsqueeze(-1), out=vals.view(b - a, g, 2 * nb))
        if flat_o is not None:
            flat_o[a:b].copy_(vals)
        else:
            _rows_of(out, a, b).copy_(vals.to(out.dtype))
    return out


def _rows_of(out, a: int, b: int):
    """Rows ``[a, b)`` of a non-contiguous ``out``: one expert's ``[R, C]`` (a transposed view)."""
    if out.dim() != 2:
        raise AssertionError("dequantize into a non-contiguous out takes one expert ([R, C]) at a time")
    return out[a:b]


def hf_form(blocks, scales, dtype=None):
    """The Hugging Face in-memory form ``W.transpose(1, 2)`` (``[E, C, R]``), contiguous."""
    import torch

    e, r, g, nb = blocks.shape
    out = torch.empty((e, g * 2 * nb, r), dtype=dtype or torch.bfloat16)
    for i in range(e):
        dequantize(blocks[i], scales[i], out=out[i].transpose(0, 1))
    return out


class Mxfp4File(BlockWrappedFile):
    """A source file whose MXFP4 tensors read under their own names (``<name>``, ``BF16`` ``[E, C, R]``) as their
    dequantised Hugging Face form, one expert at a time; its other tensors are the file's own. The ``_blocks`` /
    ``_scales`` may live in any of the source's ``files``."""

    def __init__(self, base: TensorFile, packed: dict[str, Packed], files: list[TensorFile], dtype: str = "BF16"):
        tensors = {n: t for n, t in base.tensors.items()}
        for name, p in packed.items():
            tensors[name] = TensorLocation(dtype, p.shape, -1)
        super().__init__(base, tensors)
        self.packed, self.files, self.dtype = packed, files, dtype

    def extents(self, name: str) -> list[tuple[int, int, int]]:
        """Read-ahead extents: the ``_blocks`` and ``_scales`` bytes of an MXFP4 tensor, else the base's."""
        from reshard.io.pair_rows import whole_extents

        p = self.packed.get(name)
        if p is None:
            return whole_extents(self.base, name)
        return [e for n, i in ((p.blocks, p.blocks_file), (p.scales, p.scales_file))
                for e in whole_extents(self.files[i], n)]

    def transforms(self, name: str) -> bool:
        return name in self.packed

    def make_block(self, name: str, index: int):
        """Expert ``index`` of MXFP4 tensor ``name`` in the HF form ``[C, R]``, dequantised."""
        from reshard.io import dtypes

        p = self.packed[name]
        blocks = self.files[p.blocks_file].read_block(p.blocks, index)
        scales = self.files[p.scales_file].read_block(p.scales, index)
        return dequantize(blocks, scales, dtypes.to_torch(self.dtype)).t()  # [R, C] contiguous, read as [C, R]


def wrap(files: list[TensorFile], view: Mxfp4View) -> list[TensorFile]:
    """``files`` with each MXFP4 tensor readable under its own name from the file holding its blocks."""
    out = list(files)
    for i, f in enumerate(files):
        mine = {n: p for n, p in view.weights.items() if p.blocks_file == i}
        if mine:
            out[i] = Mxfp4File(f, mine, files)
    return out


def source_view(where: str, config: dict, files: list[TensorFile], opts=None):
    """An HF source as read (``reshard/layouts/hf.py``): ``(config, files, notes, stored names to skip)`` — for an
    MXFP4 release the config without ``quantization_config``, the files wrapped (:func:`wrap`), the info line of
    families-2.md section 17 and every ``_blocks`` / ``_scales`` name; otherwise the inputs unchanged."""
    view = find_mxfp4(where, config, files)
    if view is None:
        return config, files, [], set()
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    return config, wrap(files, view), [note(view, "bfloat16")], view.stored
