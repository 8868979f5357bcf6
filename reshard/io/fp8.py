"""Block-FP8 Hugging Face checkpoints (DeepSeek-V3 / R1, Kimi-K2 releases), read dequantised.

Layout handled: ``config.json`` ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [B0, B1]}``; each quantized weight ``W8 [M, N]`` is stored
``F8_E4M3`` beside ``<name>_scale_inv`` (``F32``, shape exactly ``[ceil(M/B0), ceil(N/B1)]``; the last block row
and column may be partial: a 576-row weight has 5 block rows, the last covering 64). The value read is

    W[i, j] = float32(W8[i, j]) * S[i // B0, j // B1]        (an fp32 multiply, as DeepSeek's weight_dequant)

cast to the output dtype (bf16 by default: round to nearest even). ``B`` comes from the config, never from the
shapes. Exactly the ``F8_E4M3`` tensors with a ``_scale_inv`` partner are dequantised; anything else that looks
quantized is refused (:func:`find_fp8`). A read of rows ``[r0, r1)`` (any columns) needs only scale rows
``r0 // B0 .. (r1 - 1) // B0`` and is computed in bands of whole block rows (:data:`CHUNK_ELEMENTS` at a time), so
memory stays bounded by the block the executor asked for. ``--keep-fp8`` (HF to HF only) instead copies the fp8
bytes and their scales unchanged (:func:`add_scales`).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, replace

import numpy as np

from reshard.errors import CheckpointError
from reshard.io.tensorfile import TensorFile, WrappedFile

SCALE_SUFFIX = "_scale_inv"
FP8 = "F8_E4M3"
SCALE_DTYPE = "F32"
#: Elements dequantised at once (1M: 1 MiB of fp8 and 4 MiB of fp32 product per band).
CHUNK_ELEMENTS = 1 << 20
_FIX = "reshard reads block-FP8 (quant_method fp8, e4m3 weights, fp32 <name>_scale_inv block scales)"


@dataclass(frozen=True)
class Quantized:
    """One FP8 weight ``[M, N]`` (``shape``): its scale tensor, the file holding it (``scale_file``: index into the
    source's files) and the block."""

    scale: str
    scale_file: int
    block: tuple[int, int]
    shape: tuple[int, int]


@dataclass
class Fp8View:
    """The block-FP8 tensors of one HF source: weight name -> :class:`Quantized`, file index -> its weights."""

    block: tuple[int, int]
    weights: dict[str, Quantized]
    where: dict[str, int]  # weight or scale name -> file index

    @property
    def scales(self) -> set[str]:
        return {q.scale for q in self.weights.values()}

    def describe(self, dtype: str | None = None) -> str:
        """``block-FP8 e4m3, 128x128 blocks, N tensors``, and how they are read (``dtype`` None: kept as FP8)."""
        b0, b1 = self.block
        read = "kept as FP8 (--keep-fp8)" if dtype is None else f"read dequantised to {dtype}"
        return f"block-FP8 e4m3, {b0}x{b1} blocks, {len(self.weights)} tensors, {read}"


def block_size(config: dict, where: str) -> tuple[int, int] | None:
    """``weight_block_size`` of a ``quantization_config`` that is block FP8, None without one; any other quantization
    (``compressed-tensors``, a static activation scheme, another format) is refused."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise CheckpointError(f"{where}: config.json quantization_config is not an object; {_FIX}: restore the "
                              "release's config.json")
    method = quant.get("quant_method", "unknown method")
    if method != "fp8":
        raise CheckpointError(f"{where} is a quantized checkpoint (quantization_config: {method}); {_FIX} only: "
                              "dequantize it first, or convert the original bf16/fp16 release")
    for key, wanted in (("fmt", "e4m3"), ("activation_scheme", "dynamic")):
        if quant.get(key, wanted) != wanted:
            raise CheckpointError(f"{where}: quantization_config {key} is {quant[key]!r}, not {wanted!r}; {_FIX} "
                                  "only: dequantize it first, or convert the original bf16 release")
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise CheckpointError(f"{where}: quantization_config weight_block_size is {block!r}, not 2 positive ints "
                              "such as [128, 128]: reshard never infers the block from the shapes; restore the "
                              "release's config.json")
    return block[0], block[1]


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def find_fp8(where: str, config: dict, files: list[TensorFile]) -> Fp8View | None:
    """The block-FP8 weights of an HF source (None when it is not quantized), each ``F8_E4M3`` with a valid
    ``_scale_inv`` partner; everything else quantized-looking is refused with the tensor or field named."""
    block = block_size(config, where)
    located: dict[str, int] = {}
    for i, f in enumerate(files):
        for name in f.tensors:
            located.setdefault(name, i)

    def loc(name):
        return files[located[name]].tensors[name]

    f8 = [n for n in located if loc(n).dtype.startswith("F8")]
    scales = [n for n in located if n.endswith(SCALE_SUFFIX)]
    if block is None:
        if f8:
            raise CheckpointError(f"{where}: tensor '{f8[0]}' is {loc(f8[0]).dtype} but config.json has no "
                                  "quantization_config: add the release's (quant_method fp8, weight_block_size); "
                                  "reshard never guesses the block size")
        return None
    if not f8:
        raise CheckpointError(f"{where} is a quantized checkpoint (quantization_config: fp8) but no tensor is "
                              f"{FP8}: it was dequantised already; remove quantization_config from its config.json")
    weights = {}
    for name in f8:
        w = loc(name)
        scale = name + SCALE_SUFFIX
        if w.dtype != FP8:
            raise CheckpointError(f"{where}: tensor '{name}' is {w.dtype}; {_FIX} only ({FP8})")
        if scale not in located:
            raise CheckpointError(f"{where}: tensor '{name}' is {FP8} but '{scale}' is missing: restore the scale "
                                  "tensor (an incomplete download?)")
        s = loc(scale)
        if len(w.shape) != 2:
            raise CheckpointError(f"{where}: tensor '{name}' is {FP8} with {len(w.shape)} dims; block-FP8 weights "
                                  "are 2-D [out, in]: dequantize it first")
        if s.dtype != SCALE_DTYPE:
            raise CheckpointError(f"{where}: scale '{scale}' is {s.dtype}, not F32 (UE8M0 or packed scales?); {_FIX} "
                                  "only: dequantize it first")
        want = scale_shape(w.shape, block)
        if tuple(s.shape) != want:
            raise CheckpointError(f"{where}: scale '{scale}' has shape {list(s.shape)} but {list(w.shape)} weights in "
                                  f"{list(block)} blocks need {list(want)}: the scale or weight_block_size is wrong")
        weights[name] = Quantized(scale, located[scale], block, tuple(w.shape))
    for scale in scales:
        base = scale[:-len(SCALE_SUFFIX)]
        if base not in weights:
            what = f"'{base}' is {loc(base).dtype}, not {FP8}" if base in located else f"there is no '{base}'"
            raise CheckpointError(f"{where}: scale '{scale}' has no FP8 weight ({what}): remove the stray scale or "
                                  "restore its weight")
    return Fp8View(block, weights, located)


def wrap(files: list[TensorFile], view: Fp8View) -> list[TensorFile]:
    """``files`` with each one holding FP8 weights read through :class:`Fp8File` (the others unchanged)."""
    out = list(files)
    for i, f in enumerate(files):
        mine = {n: q for n, q in view.weights.items() if view.where[n] == i}
        if mine:
            out[i] = Fp8File(f, mine, files)
    return out


class Fp8File(WrappedFile):
    """A source file whose FP8 weights read as their dequantised values (:meth:`read`); its other tensors, and the
    locations of all (the fp8 bytes), are the file's own. The reads go through ``base`` (safetensors or torch)."""

    def __init__(self, base: TensorFile, quantized: dict[str, Quantized], files: list[TensorFile]):
        super().__init__(base, base.tensors)
        self.quantized, self.files = quantized, files

    def read(self, name: str, axis: int = 0, start: int = 0, length: int | None = None,
             rows: tuple[int, int] | None = None, dtype: str | None = None, allow_overflow: bool = True):
        """:meth:`TensorFile.read`; an FP8 weight's slice is dequantised into ``dtype`` (default: the exact fp32
        product). ``allow_overflow=False`` refuses a cast that turns finite products into inf."""
        q = self.quantized.get(name)
        if q is None:
            return self.base.read(name, axis, start, length, rows)
        shape = self.tensors[name].shape
        if length is None:
            length = shape[axis] - start
        r0, r1 = (start, start + length) if axis == 0 else (rows or (0, shape[0]))
        c0, c1 = (0, shape[1]) if axis == 0 else (start, start + length)
        return self.dequantize(name, q, r0, r1, c0, c1, dtype, allow_overflow)

    def read_block(self, name: str, index: int, axis: int = 0, start: int = 0, length: int | None = None,
                   rows: tuple[int, int] | None = None):
        if name in self.quantized:
            raise AssertionError(f"{name}: a 2-D FP8 weight has no stacked blocks")
        return self.base.read_block(name, index, axis, start, length, rows)

    def dequantize(self, name: str, q: Quantized, r0: int, r1: int, c0: int, c1: int, dtype: str | None,
                   allow_overflow: bool, out=None):
        """Rows ``[r0, r1)`` x columns ``[c0, c1)`` of weight ``name`` dequantised (into ``out``, a contiguous tensor
        of that shape and dtype, when given): read in bands of whole block rows, computed by :func:`_dequantize`."""
        import torch

        from reshard.io import dtypes

        if out is None:
            out = torch.empty((r1 - r0, c1 - c0), dtype=dtypes.to_torch(dtype or "F32"))
        if not out.numel():
            return out
        b0 = q.block[0]
        full = (c0, c1) == (0, self.tensors[name].shape[1])
        first = r0 // b0
        scales = self.files[q.scale_file].read(q.scale, 0, first, (r1 - 1) // b0 + 1 - first).numpy()
        # every |float32(W8)| <= 448: with scales that bound the products below the output's largest finite value,
        # no cast can overflow and the check is skipped (the scales are checked once, not the products)
        if not allow_overflow and out.dtype != torch.float32:
            bound = float(np.abs(scales.astype(np.float64)).max()) * E4M3_MAX
            allow_overflow = bound <= torch.finfo(out.dtype).max
        band = max(1, CHUNK_ELEMENTS // ((c1 - c0) * b0)) * b0  # rows per band: whole block rows
        a = r0
        while a < r1:
            b = min(r1, a - a % b0 + band)
            w8 = self.base.read(name, 0, a, b - a) if full else self.base.read(name, 1, c0, c1 - c0, (a, b))
            _dequantize(name, w8.view(torch.uint8).numpy(), scales[a // b0 - first:], q.block, a, c0,
                        out[a - r0:b - r0], allow_overflow)
            a = b
        return out


E4M3_MAX = 448.0
#: Elements computed at once inside a band: 128 KiB of fp32, in cache; and at most torch's grain size (32768), so
#: that the cast runs on this thread (torch's two threads on a loaded 2-core machine cost more than they give).
COMPUTE_ELEMENTS = 1 << 15


def _dequantize(name: str, w8: np.ndarray, scales: np.ndarray, block: tuple[int, int], row: int, col: int, out,
                allow_overflow: bool) -> None:
    """``out = float32(w8) * S`` (``w8``: the e4m3 bytes of rows ``row..`` and columns ``col..``; ``scales`` from
    the scale row of ``row``) cast to ``out``'s dtype, a few rows at a time: the byte table into fp32 (straight into
    ``out`` for fp32), an in-place multiply by each block's scale, then torch's cast (round to nearest even). The
    views are made once; each chunk is one lookup, one multiply per column run and one cast."""
    import torch

    from reshard.io import casts

    b0, b1 = block
    m, n = w8.shape
    step = max(1, COMPUTE_ELEMENTS // n)
    f32 = out.dtype == torch.float32
    x = out.numpy() if f32 else np.empty((min(m, step), n), np.float32)  # fp32 rows: out's own, else a scratch
    x_torch = None if f32 else torch.from_numpy(x)
    pairs = n % 2 == 0 and sys.byteorder == "little"
    table, codes, values = ((_e4m3_pairs(), w8.view(np.uint16), x.view(np.uint64)) if pairs
                            else (_e4m3_values(), w8, x))
    # x[:, c:d] is one partial block (times a scalar) or `count` whole blocks (a [rows, count, b1] view: splitting
    # the contiguous column axis is always a view, so the in-place multiply lands in x)
    runs = [(x[:, c:d] if count == 1 else x[:, c:d].reshape(x.shape[0], count, b1), first, count)
            for c, d, first, count in _column_blocks(col, col + n, b1)]
    for k in range(-(-(row + m) // b0) - row // b0):  # the block rows of the band
        lo, hi = max(0, (row // b0 + k) * b0 - row), min(m, (row // b0 + k + 1) * b0 - row)
        factors = [scales[k, first] if count == 1 else scales[k, first:first + count, None]
                   for _, first, count in runs]
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            i, j = (a, b) if f32 else (0, b - a)  # x's rows for out's rows a..b
            np.take(table, codes[a:b], out=values[i:j], mode="clip")  # every index is in range
            for (view, _, _), factor in zip(runs, factors):
                np.multiply(view[i:j], factor, out=view[i:j])
            if not f32:
                product = x_torch[:j]
                out[a:b].copy_(product)
                if not allow_overflow:
                    casts.check_cast(name, product, out[a:b])


def _column_blocks(c0: int, c1: int, b1: int) -> list[tuple[int, int, int, int]]:
    """Columns ``[c0, c1)`` as ``(start, stop, first block, blocks)`` relative to ``c0``: a partial block at either
    end on its own, the whole blocks between as one run."""
    out = []
    head = min(c1, -(-c0 // b1) * b1)
    if head > c0:
        out.append((0, head - c0, c0 // b1, 1))
    tail = max(head, c1 // b1 * b1)
    if tail > head:
        out.append((head - c0, tail - c0, head // b1, (tail - head) // b1))
    if c1 > tail:
        out.append((tail - c0, c1 - c0, tail // b1, 1))
    return out


@functools.lru_cache(maxsize=1)
def _e4m3_values():
    """The float32 value of each of the 256 e4m3fn bytes (a table lookup is several times faster than torch's
    fp8 conversion on CPU; ``np.take`` with ``mode="clip"``: numpy buffers ``out`` in the default mode)."""
    import torch

    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()


@functools.lru_cache(maxsize=1)
def _e4m3_pairs():
    """The two float32 values of each little-endian byte pair, as one uint64 per pair (a 512 KiB table: one lookup
    for two values, for an even number of columns)."""
    values = _e4m3_values()
    pair = np.arange(1 << 16)
    return np.stack([values[pair & 0xFF], values[pair >> 8]], axis=1).view(np.uint64).reshape(-1)


def is_dequantized(files: list[TensorFile], source: int, tensor: str) -> bool:
    """Whether tensor ``tensor`` of file ``source`` is an FP8 weight read dequantised."""
    f = files[source]
    return isinstance(f, Fp8File) and tensor in f.quantized


# ------------------------------------------------------------------------------------------- --keep-fp8

def add_scales(model, view: Fp8View, stored: list, first_member: dict[str, str]) -> None:
    """``--keep-fp8``: each scale becomes a canonical tensor of its own (``F32``, kept whole), placed right after the
    canonical tensor its weight's stored tensor starts with (``first_member``: weight name -> that tensor), and a
    stored tensor of the source; the HF target then writes it after its weight."""
    from reshard.core.canonical import CanonicalTensor, stored_whole
    from reshard.mapping import WeightSpec

    after: dict[str, list] = {}
    for name, q in view.weights.items():
        shape = scale_shape(q.shape, q.block)
        spec = WeightSpec(hf=q.scale, split="replicated", shape=())
        tensor = CanonicalTensor(q.scale, spec, None, shape)
        after.setdefault(first_member[name], []).append(tensor)
        model.dtypes[q.scale] = SCALE_DTYPE
        stored.append((q.scale_file, stored_whole(q.scale, [tensor])))
    tensors = {}
    for name, tensor in model.tensors.items():
        tensors[name] = tensor
        for scale in after.get(name, ()):
            tensors[scale.name] = scale
    model.tensors = tensors


def keep_dtypes(model, tensors: list) -> list:
    """``--keep-fp8`` HF targets: FP8 weights and their scales keep their stored dtype whatever ``--dtype`` says
    (casting raw fp8 bytes would not dequantise them)."""
    fixed = {n for n, d in model.dtypes.items() if d == FP8 or n.endswith(SCALE_SUFFIX)}
    out = []
    for t in tensors:
        canonical = t.pieces[0].canonical if t.pieces else None
        out.append(replace(t, dtype=model.dtypes[canonical]) if canonical in fixed else t)
    return out


def note(view: Fp8View, dtype: str | None) -> str:
    """The conversion's note about an FP8 source (``dtype`` None: ``--keep-fp8``)."""
    if dtype is None:
        return f"source is {view.describe()}: fp8 bytes, scales and quantization_config copied unchanged"
    return f"source is {view.describe(dtype)}; the output has no _scale_inv tensors and no quantization_config"


__all__ = ["find_fp8", "wrap", "Fp8File", "add_scales", "keep_dtypes"]
