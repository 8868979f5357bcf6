"""One tensor pair compared block by block: SHA-256 of each side's bytes, equality, error figures.

The blocks arrive in row-major order (:mod:`reshard.io.block_pairs`), so each side's SHA-256, updated block by
block, is the digest of its whole tensor's bytes. Error figures (``max_abs``, ``max_rel = max |a - b| / |a|``)
are computed per block, in float32 (float64 when either side is float64 or an integer type), and only where they
mean something: the bytes differ, a dtype cast is involved, or a tolerance was given. Statuses:

- ``equal``: same dtype, same bytes;
- ``equal_after_cast``: dtypes differ and the wider side cast to the narrower dtype equals it bit for bit;
- ``within_tolerance``: ``|a - b| <= atol + rtol * |a|`` everywhere (only with a tolerance);
- ``cast_overflow``: finite values of the wider side are inf or NaN in the narrower one (never ok);
- ``different``, ``missing_in_a``, ``missing_in_b``.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from reshard.io import dtypes

OK_STATUSES = ("equal", "equal_after_cast", "within_tolerance")
_FLOATS = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_CHUNK = 1 << 20  # elements per step of the error figures (4 MiB in float32)


@dataclass
class TensorResult:
    name: str
    status: str  # see the module docstring
    dtype_a: str | None = None
    dtype_b: str | None = None
    sha256_a: str | None = None
    sha256_b: str | None = None
    max_abs: float | None = None
    max_rel: float | None = None
    shape_a: list[int] | None = None  # set where the shapes differ
    shape_b: list[int] | None = None

    @property
    def ok(self) -> bool:
        return self.status in OK_STATUSES


def _equal_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    if a.size != b.size:
        return False
    width = next((w for w in (8, 4, 2) if a.size % w == 0), 1)
    return bool(np.array_equal(a.view(f"u{width}") if width > 1 else a, b.view(f"u{width}") if width > 1 else b))


def _as_torch(data: np.ndarray, dtype: str, shape: tuple[int, ...]):
    import torch

    if not data.size:
        return torch.empty(shape, dtype=dtypes.to_torch(dtype))
    return torch.frombuffer(data, dtype=torch.uint8).view(dtypes.to_torch(dtype)).reshape(shape)


class BlockComparison:
    """Accumulates one pair's blocks (``hash_a`` / ``hash_b`` / ``check`` per block, in order) into a
    :class:`TensorResult`. ``hashing=False``: bytes and figures only (a replica check)."""

    def __init__(self, name: str, dtype_a: str, dtype_b: str, atol: float | None = None,
                 rtol: float | None = None, hashing: bool = True):
        self.name, self.dtype_a, self.dtype_b = name, dtype_a, dtype_b
        self.tolerance = None if atol is None and rtol is None else (atol or 0.0, rtol or 0.0)
        self.sha_a = hashlib.sha256() if hashing else None
        self.sha_b = hashlib.sha256() if hashing else None
        self.cast = dtype_a != dtype_b
        self.floats = dtype_a in _FLOATS and dtype_b in _FLOATS
        self.bytes_equal = not self.cast
        self.cast_equal = self.cast
        self.overflow = False
        self.within = True
        self.max_abs: float | None = None
        self.max_rel: float | None = None

    def hash_a(self, data: np.ndarray) -> None:
        if self.sha_a is not None:
            self.sha_a.update(memoryview(data))

    def hash_b(self, data: np.ndarray) -> None:
        if self.sha_b is not None:
            self.sha_b.update(memoryview(data))

    def check(self, a: np.ndarray, b: np.ndarray, shape: tuple[int, ...], shape_b: tuple[int, ...]) -> None:
        """Compare block ``a`` of A (of ``shape``) with block ``b`` of B (of ``shape_b``)."""
        if tuple(shape_b) != tuple(shape):
            self.bytes_equal = self.cast_equal = False
            return
        if not self.cast:
            if _equal_bytes(a, b):
                return
            self.bytes_equal = False
        self._figures(_as_torch(a, self.dtype_a, shape), _as_torch(b, self.dtype_b, shape))

    def _figures(self, x, y) -> None:
        """Cast equality, overflow, tolerance and error figures of one block, a chunk of elements at a time (the
        temporaries stay a few chunks, whatever the block size)."""
        x, y = x.reshape(-1), y.reshape(-1)
        if not x.numel():
            self._grow(0.0, 0.0)
        for start in range(0, x.numel(), _CHUNK):
            self._chunk(x[start:start + _CHUNK], y[start:start + _CHUNK])

    def _chunk(self, x, y) -> None:
        """One chunk: the difference first (a finite ``max_abs`` rules out an overflowed cast without another
        pass), then the cast's bit equality, the tolerance and ``max_rel``. Nothing is done in place on ``x`` or
        ``y``: they are the read buffers, which the hashing lane may still be reading."""
        import torch

        exact = torch.float64 in (x.dtype, y.dtype) or not (x.is_floating_point() and y.is_floating_point())
        work = torch.float64 if exact else torch.float32
        xw = x.to(work)
        diff = xw.sub(y.to(work)).abs_()
        max_abs = diff.max().item()
        if self.cast and self.floats:
            wide, narrow = (x, y) if x.element_size() >= y.element_size() else (y, x)
            if not math.isfinite(max_abs) and bool((~torch.isfinite(narrow) & torch.isfinite(wide)).any()):
                self.overflow = True
            if self.cast_equal:
                self.cast_equal = torch.equal(wide.to(narrow.dtype).view(torch.uint8), narrow.view(torch.uint8))
        elif self.cast:
            self.cast_equal = False
        magnitude = xw.abs()
        if self.tolerance is not None:
            atol, rtol = self.tolerance
            self.within = self.within and bool((diff <= magnitude.mul(rtol).add_(atol)).all())
        self._grow(max_abs, diff.div_(magnitude.clamp_min_(1e-30)).max().item())

    def _grow(self, max_abs: float, max_rel: float) -> None:
        """Fold one chunk's figures into the running maxima (a NaN stays NaN)."""
        def fold(current, value):
            if current is None or value != value:
                return value
            return current if current != current else max(current, value)

        self.max_abs = fold(self.max_abs, max_abs)
        self.max_rel = fold(self.max_rel, max_rel)

    def result(self) -> TensorResult:
        res = TensorResult(self.name, "different", self.dtype_a, self.dtype_b,
                           self.sha_a.hexdigest() if self.sha_a else None,
                           self.sha_b.hexdigest() if self.sha_b else None, self.max_abs, self.max_rel)
        if not self.cast and self.bytes_equal:
            res.status = "equal"
        elif self.cast and self.floats and self.overflow:
            res.status = "cast_overflow"
        elif self.tolerance is not None:
            res.status = "within_tolerance" if self.within else "different"
        elif self.cast and self.cast_equal:
            res.status = "equal_after_cast"
        return res
