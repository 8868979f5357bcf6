"""MaxText leaves read as Hugging Face tensors: :class:`MaxTextFile` (maxtext-orbax.md sections 4 and 7.2-7.3).

Every HF tensor is a view of one MaxText leaf: one layer of it (layer axis 1 when scanned), one expert of an
expert stack (axis 0), or the whole leaf. A kernel is the HF ``[out, in]`` matrix stored ``[in, ...]``: its
per-layer array is reshaped to ``[in, out]`` and transposed (GPT-2's Conv1D read); then, per the model's
conventions, q/k rows go back from Meta's interleaved RoPE order, and the element ops run in float32 — scale by
a constant (the query pre-scale ``* sqrt(d)``, the Gemma embedding ``/ sqrt(H)``) and add a constant (Gemma's
norms ``- 1``); such tensors are presented as F32, so the output cast rounds once. The embedding is cropped to the
HF vocab (MaxText pads it).

Unstack pass (7.3): a stacked leaf whose chunks span several layers is decoded once, chunk by chunk, into a
scratch file (one region per layer, C order, the stored dtype) so that each layer is then read alone; the scratch
folder (under ``$RESHARD_SCRATCH`` or the system temp folder) is shared by the forked workers and removed when the
source is closed.
Memory: one decoded chunk while unstacking, one per-layer tensor while reading.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass

import numpy as np

from reshard.io.orbax_store import Item, read_banded
from reshard.io import dtypes
from reshard.io.tensorfile import TensorFile, TensorLocation, read_into


#: a leaf outside the stack is read band by band from its own chunks when they are row bands this small
BAND_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class Recipe:
    """How one HF tensor is read from a leaf (see the module docstring)."""

    leaf: str
    layer: int | None  # index along the layer axis (None: the leaf is one layer or not per layer)
    expert: int | None  # index along axis 0 of an expert stack
    kernel: bool  # stored [in, ...]: transpose
    rope: int = 0  # head dim: rows back from interleaved (Meta) order
    mul: float | None = None  # x * float32(mul)
    div: float | None = None  # x / float32(div)
    add: float | None = None  # x + float32(add)
    rows: int | None = None  # keep the first rows only (the embedding's HF vocab)

    @property
    def has_op(self) -> bool:
        return self.mul is not None or self.div is not None or self.add is not None


def _libc():
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim, _LIBC.mallopt  # glibc only
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC


def bound_heap() -> None:
    """Serve allocations of 1 MiB and more from their own mappings, returned to the system when freed (glibc
    ``mallopt(M_MMAP_THRESHOLD)``): TensorStore decodes chunks on its own threads, and glibc's default would keep
    their freed pages resident in per-thread arenas (hundreds of MiB over a conversion)."""
    libc = _libc()
    if libc:
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def release_freed() -> None:
    """Give freed heap memory back to the system (glibc ``malloc_trim``)."""
    libc = _libc()
    if libc:
        libc.malloc_trim(0)


_LIBC = None


def to_torch(array: np.ndarray):
    import torch

    array = np.ascontiguousarray(array)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def interleaved_to_half(x, head_dim: int):
    """Rows of ``x`` ([n * d, ...]) from Meta's order (row 2i + j) to HF's (row j * d/2 + i), per head."""
    rest = x.shape[1:]
    return x.reshape(-1, head_dim // 2, 2, *rest).transpose(1, 2).reshape(x.shape)


def half_to_interleaved(x, head_dim: int):
    rest = x.shape[1:]
    return x.reshape(-1, 2, head_dim // 2, *rest).transpose(1, 2).reshape(x.shape)


def apply_ops(x, recipe: Recipe):
    """The float32 element ops of ``recipe`` on ``x`` (exact in fp32; the cast to the output dtype rounds once)."""
    import torch

    x = x.float()
    if recipe.mul is not None:
        x = x * torch.tensor(recipe.mul, dtype=torch.float32)
    if recipe.div is not None:
        x = x / torch.tensor(recipe.div, dtype=torch.float32)
    if recipe.add is not None:
        x = x + torch.tensor(recipe.add, dtype=torch.float32)
    return x


class Scratch:
    """Per-layer copies of stacked leaves: one file per leaf (layers one after another, C order) in a folder the
    opening process creates, shared with the worker processes it forks (a lock per leaf: the first unstacks it,
    the others wait and read); removed when the opening process closes the source."""

    def __init__(self):
        self.owner = os.getpid()
        base = os.environ.get("RESHARD_SCRATCH") or tempfile.gettempdir()
        name = f"reshard-maxtext-{os.getpid()}-{next(tempfile._get_candidate_names())}"
        self.folder: str | None = os.path.join(base, name)  # created on the first unstack
        self.fds: dict[str, int] = {}
        self.files: dict[str, TensorFile] = {}
        self.pid = os.getpid()

    def _path(self, leaf: str, ext: str) -> str:
        return os.path.join(self.folder, leaf + ext)

    def close(self) -> None:
        if self.pid == os.getpid():
            for fd in self.fds.values():
                os.close(fd)
            for f in self.files.values():
                f.close()
        self.fds, self.files, self.pid = {}, {}, os.getpid()
        if self.folder and os.getpid() == self.owner:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def ensure(self, item: Item, leaf: str, stacked: bool = True) -> None:
        """Unstack ``leaf`` (``stacked`` False: lay it out in C order) unless this or another process already has."""
        if os.path.exists(self._path(leaf, ".done")):
            return
        import fcntl

        os.makedirs(self.folder, exist_ok=True)
        with open(self._path(leaf, ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(self._path(leaf, ".done")):
                self.unstack(item, leaf, stacked)
                open(self._path(leaf, ".done"), "w").close()

    def unstack(self, item: Item, leaf: str, stacked: bool = True) -> None:
        """Decode ``leaf`` chunk box by chunk box: stacked (layer axis 1), into one region per layer; else into
        one C-order array."""
        info = item.leaf(leaf)
        shape, chunks = info.shape, info.chunks
        dtype = item.handle(leaf).dtype.numpy_dtype
        per = shape[:1] + shape[2:] if stacked else shape
        nbytes = math.prod(per) * dtype.itemsize
        fd = os.open(self._path(leaf, ".bin"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, nbytes * (shape[1] if stacked else 1))
            grid = [range(0, s, c) for s, c in zip(shape, chunks)]
            for origin in itertools.product(*grid):
                box = tuple(slice(o, min(o + c, s)) for o, c, s in zip(origin, chunks, shape))
                data = item.read(leaf, box)
                if not stacked:
                    _write_box(fd, 0, per, origin, np.ascontiguousarray(data))
                for k in range(data.shape[1] if stacked else 0):
                    base = (origin[1] + k) * nbytes
                    _write_box(fd, base, per, (origin[0], *origin[2:]), np.ascontiguousarray(data[:, k]))
                del data
                release_freed()
        finally:
            os.close(fd)

    def tensor_file(self, item: Item, leaf: str) -> TensorFile:
        """Leaf ``leaf`` laid out in C order (decoded once), as a file of positioned reads."""
        if self.pid != os.getpid():
            self.fds, self.files, self.pid = {}, {}, os.getpid()
        self.ensure(item, leaf, stacked=False)
        f = self.files.get(leaf)
        if f is None:
            info = item.leaf(leaf)
            f = self.files[leaf] = TensorFile(self._path(leaf, ".bin"), {leaf: TensorLocation(info.dtype, info.shape, 0)})
        return f

    def read(self, item: Item, leaf: str, layer: int, expert: int | None) -> np.ndarray:
        if self.pid != os.getpid():
            self.fds, self.files, self.pid = {}, {}, os.getpid()
        self.ensure(item, leaf)
        info = item.leaf(leaf)
        dtype = item.handle(leaf).dtype.numpy_dtype
        shape = info.shape[:1] + info.shape[2:]
        offset = layer * math.prod(shape) * dtype.itemsize
        if expert is not None:
            shape = shape[1:]
            offset += expert * math.prod(shape) * dtype.itemsize
        fd = self.fds.get(leaf)
        if fd is None:
            fd = self.fds[leaf] = os.open(self._path(leaf, ".bin"), os.O_RDONLY)
        size = math.prod(shape) * dtype.itemsize
        buf = bytearray(size)
        read_into(fd, memoryview(buf), offset, self._path(leaf, ".bin"))
        return np.frombuffer(buf, dtype=dtype).reshape(shape)


def _write_box(fd: int, base: int, shape: tuple[int, ...], origin: tuple[int, ...], data: np.ndarray) -> None:
    """Write ``data`` at ``origin`` into the C-order array of ``shape`` starting at byte ``base`` of ``fd``:
    contiguous runs over the trailing axes the box spans whole."""
    k = len(shape)
    while k > 0 and data.shape[k - 1] == shape[k - 1] and origin[k - 1] == 0:
        k -= 1
    # axes >= k are whole: a run is data[idx] for idx over axes < k - 1, along axis k - 1 (or everything)
    lead = max(k - 1, 0)
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    item = data.dtype.itemsize
    raw = data.reshape(data.shape[:lead] + (-1,)) if data.ndim else data.reshape(1)
    for idx in itertools.product(*(range(n) for n in data.shape[:lead])):
        start = sum((origin[i] + idx[i]) * strides[i] for i in range(lead))
        if lead < len(shape):
            start += origin[lead] * strides[lead]
        chunk = raw[idx] if lead else raw
        os.pwrite(fd, chunk.tobytes(), base + start * item)


class MaxTextFile(TensorFile):
    """HF-named tensors read from an Orbax item's leaves through :class:`Recipe` s (``direct_bytes`` False)."""

    format = "maxtext"
    direct_bytes = False
    fork_safe = False  # TensorStore aborts in a forked child: conversions and digests read it in one process

    def __init__(self, item: Item, recipes: dict[str, Recipe], shapes: dict[str, tuple[int, ...]],
                 dtypes: dict[str, str]):
        super().__init__(item.items, {n: TensorLocation(dtypes[n], shapes[n], 0) for n in recipes})
        self.item, self.recipes = item, recipes
        self.scratch = Scratch()
        bound_heap()
        self._lock = threading.Lock()
        self._last: tuple[str, object] | None = None

    @property
    def fd(self) -> int:
        raise AssertionError("a MaxTextFile has no descriptor (direct_bytes is False)")

    def close(self) -> None:
        self.scratch.close()
        self._last = None

    def extents(self, name: str) -> list[tuple[int, int, int]]:
        return []  # TensorStore reads; no read-ahead advice

    def needs_unstack(self, leaf: str) -> bool:
        info = self.item.leaf(leaf)
        return len(info.shape) > 1 and info.chunks[1] > 1 and any(
            r.leaf == leaf and r.layer is not None for r in self.recipes.values())

    def layer_array(self, recipe: Recipe) -> np.ndarray:
        """The stored per-layer (per-expert) array of ``recipe``."""
        if recipe.layer is None:
            return self.item.read(recipe.leaf, (recipe.expert,) if recipe.expert is not None else ())
        if self.needs_unstack(recipe.leaf):
            return self.scratch.read(self.item, recipe.leaf, recipe.layer, recipe.expert)
        index = (recipe.expert, recipe.layer) if recipe.expert is not None else (slice(None), recipe.layer)
        return self.item.read(recipe.leaf, index)

    def hf_tensor(self, name: str):
        """The whole HF tensor ``name`` (one cached, so a tensor read in row blocks is built once)."""
        with self._lock:
            if self._last is not None and self._last[0] == name:
                return self._last[1]
            recipe = self.recipes[name]
            loc = self.tensors[name]
            x = to_torch(self.layer_array(recipe))
            if recipe.kernel:
                cols = loc.shape[1]
                x = x.reshape(cols, -1).t()
            if recipe.rows is not None:
                x = x[:recipe.rows]
            if recipe.rope:
                x = interleaved_to_half(x, recipe.rope)
            if recipe.has_op:
                x = apply_ops(x, recipe)
            x = x.reshape(loc.shape).contiguous()
            self._last = (name, x)
            release_freed()
            return x

    def band(self, name: str, axis: int, start: int, length: int, rows: tuple[int, int] | None):
        """A slice of a 2-D leaf outside the layer stack (embedding, head: the largest tensors), never the whole
        leaf in memory: HF rows are rows of the stored leaf, or its columns for a kernel (stored ``[in, out]``).
        Read from the leaf's chunks when they are bands along that axis (one chunk row at a time), else from a
        C-order copy decoded once into the scratch folder."""
        recipe = self.recipes[name]
        along = 1 if recipe.kernel else 0  # the stored axis HF rows run along
        info = self.item.leaf(recipe.leaf)
        other = 1 - along
        if info.chunks[other] == info.shape[other] and along == 0 and \
                math.prod(info.chunks) * dtypes.itemsize(info.dtype) <= BAND_CHUNK_BYTES:
            first, stop = (start, start + length) if axis == 0 else (rows or (0, self.tensors[name].shape[0]))
            cols = slice(start, start + length) if axis == 1 else slice(None)
            x = to_torch(read_banded(self.item, recipe.leaf, (slice(first, stop), cols)))
        else:
            f = self.scratch.tensor_file(self.item, recipe.leaf)
            if not recipe.kernel:
                x = f.read(recipe.leaf, axis, start, length, rows)
            elif axis == 0:  # HF rows = stored columns
                x = f.read(recipe.leaf, 1, start, length).t()
            else:  # HF columns [start, +length) of HF rows ``rows`` = stored rows x stored columns
                r0, r1 = rows or (0, self.tensors[name].shape[0])
                x = f.read(recipe.leaf, 1, r0, r1 - r0, (start, start + length)).t()
        x = apply_ops(x, recipe) if recipe.has_op else x.contiguous()
        release_freed()
        return x

    def read(self, name: str, axis: int = 0, start: int = 0, length: int | None = None,
             rows: tuple[int, int] | None = None):
        recipe = self.recipes[name]
        shape = self.tensors[name].shape
        if recipe.layer is None and recipe.expert is None and not recipe.rope and len(shape) == 2 and \
                len(self.item.leaf(recipe.leaf).shape) == 2:
            return self.band(name, axis, start, shape[axis] - start if length is None else length, rows)
        x = self.hf_tensor(name)
        if x.dim() == 0:
            return x.clone()
        if length is None:
            length = x.shape[axis] - start
        if rows is not None and axis == 1:
            x = x[rows[0]:rows[1]]
        return x.narrow(axis, start, length).contiguous()

    def read_block(self, name: str, index: int, axis: int = 0, start: int = 0, length: int | None = None,
                   rows: tuple[int, int] | None = None):
        data = self.hf_tensor(name)[index]
        data = data[rows[0]:rows[1]] if rows else data
        return data.narrow(axis, start, data.shape[axis] - start if length is None else length).contiguous()
