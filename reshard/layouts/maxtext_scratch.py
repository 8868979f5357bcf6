"""The scratch folder of the maxtext reader's unstack pass (maxtext-orbax.md section 7.3), and heap hygiene.

A stacked leaf whose chunks span several layers is decoded once, chunk box by chunk box (memory: one decoded
chunk), into one file per leaf: the layers one after another, each in C order, in the stored dtype; a leaf outside
the stack whose chunks are not row bands is laid out in C order the same way. The folder (free space = those
leaves) is created on first use and locked per leaf. While a conversion writes (:meth:`Scratch.placed_in`) it is
inside the output's staging folder — on the output's disk, removed when the writing ends however it ends, and with
the staging folder by the next run if the process is killed; otherwise (inspect, verify, digests) under
``$RESHARD_SCRATCH`` or the system temp folder, removed when the opening process closes the source.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import tempfile
from contextlib import contextmanager

import numpy as np

from reshard.io.orbax_store import Item
from reshard.io.tensorfile import TensorFile, TensorLocation, read_into


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


class Scratch:
    """Per-layer copies of stacked leaves: one file per leaf (layers one after another, C order) in a folder the
    opening process creates, shared with the worker processes it forks (a lock per leaf: the first unstacks it,
    the others wait and read); removed when the opening process closes the source."""

    def __init__(self):
        self.owner = os.getpid()
        self.folder: str | None = self._new_folder(None)  # created on the first unstack
        self.fds: dict[str, int] = {}
        self.files: dict[str, TensorFile] = {}
        self.pid = os.getpid()

    @staticmethod
    def _new_folder(base: str | None) -> str:
        base = base or os.environ.get("RESHARD_SCRATCH") or tempfile.gettempdir()
        return os.path.join(base, f"reshard-maxtext-{os.getpid()}-{next(tempfile._get_candidate_names())}")

    @contextmanager
    def placed_in(self, base: str):
        """The scratch folder under ``base`` (a conversion's staging folder) while the block runs, removed when it
        ends — returning, raising or interrupted — so that the published output never holds it; afterwards a
        fresh one under ``$RESHARD_SCRATCH`` / the temp folder."""
        self.close()
        self.folder = self._new_folder(base)
        try:
            yield self.folder
        finally:
            self.close()

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
            self.folder = self._new_folder(None)  # a later read (verify after the conversion) starts afresh

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
        os.pwrite(fd, memoryview(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)), base + start * item)
