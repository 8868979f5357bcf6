"""MaxText leaves read as Hugging Face tensors: :class:`MaxTextFile` (maxtext-orbax.md sections 4 and 7.2-7.3).

Every HF tensor is a view of one MaxText leaf: one layer of it (layer axis 1 when scanned), one expert of an
expert stack (axis 0), or the whole leaf. A kernel is the HF ``[out, in]`` matrix stored ``[in, ...]``: its
per-layer array is reshaped to ``[in, out]`` and transposed (GPT-2's Conv1D read); then, per the model's
conventions, q/k rows go back from Meta's interleaved RoPE order, and the element ops run in float32 — scale by
a constant (the query pre-scale ``* sqrt(d)``, the Gemma embedding ``/ sqrt(H)``) and add a constant (Gemma's
norms ``- 1``); such tensors are presented as F32, so the output cast rounds once. The embedding is cropped to the
HF vocab (MaxText pads it).

Unstack pass (7.3): a stacked leaf whose chunks span several layers is decoded once into a scratch file
(:mod:`reshard.layouts.maxtext_scratch`) so that each layer is then read alone; a leaf outside the stack (embedding,
head) is read in row bands, from its own chunks or from a C-order copy made the same way.
Memory: one decoded chunk while unstacking, one per-layer tensor while reading.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

from reshard.io.orbax_store import Item, read_banded
from reshard.io import dtypes
from reshard.io.tensorfile import TensorFile, TensorLocation
from reshard.layouts.maxtext_scratch import Scratch, bound_heap, release_freed


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
    wide: bool = False  # a float64 leaf: the ops in float64 with the exact constants

    @property
    def has_op(self) -> bool:
        return self.mul is not None or self.div is not None or self.add is not None


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
    """The element ops of ``recipe`` on ``x`` in float32 with float32 constants, as MaxText's converters compute
    (float64 and exact constants for a float64 leaf); the cast to the output dtype rounds once."""
    import torch

    x = x.double() if recipe.wide else x.float()
    if recipe.mul is not None:
        x = x * torch.tensor(recipe.mul, dtype=x.dtype)
    if recipe.div is not None:
        x = x / torch.tensor(recipe.div, dtype=x.dtype)
    if recipe.add is not None:
        x = x + torch.tensor(recipe.add, dtype=x.dtype)
    return x


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

    def scratch_in(self, staging: str):
        """A context manager: the unstack pass's scratch inside ``staging`` (the output's staging folder, section
        7.3) while a conversion writes; removed when it ends."""
        return self.scratch.placed_in(staging)

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
