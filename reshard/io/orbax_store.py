"""Orbax PyTree items (MaxText's ``<step>/items/``) read with TensorStore alone: no jax, no orbax.

Layout (maxtext-orbax.md section 1): ``items/_METADATA`` (JSON: every leaf's key path and kind; the storage name
is the key path joined by ``.``), and one zarr array per leaf — zarr v3 (``<name>/zarr.json``) or v2
(``<name>/.zarray``) — either inside one OCDBT database at the item root (``manifest.ocdbt``, ``d/``) or in a
folder per leaf. Shapes, dtypes and chunks come from each array's zarr metadata. ``tensorstore`` is an optional
dependency (``pip install 'reshard[maxtext]'``), imported on first use here only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from reshard.errors import CheckpointError

INSTALL = "pip install 'reshard[maxtext]'"
METADATA = "_METADATA"
MANIFEST = "manifest.ocdbt"
#: zarr data types -> reshard's dtype names
ZARR_DTYPES = {"bfloat16": "BF16", "float32": "F32", "float16": "F16", "float64": "F64", "int32": "I32",
               "int64": "I64", "uint32": "U32", "uint8": "U8", "int8": "I8", "bool": "BOOL",
               "<f4": "F32", "<f2": "F16", "<f8": "F64", "<i4": "I32", "<i8": "I64", "<u4": "U32", "|u1": "U8"}


def tensorstore():
    """The ``tensorstore`` module, or a one-line error saying how to install it."""
    try:
        import tensorstore as ts
    except ImportError:
        raise CheckpointError(f"MaxText / Orbax checkpoints need the tensorstore package: {INSTALL}") from None
    return ts


@dataclass(frozen=True)
class Leaf:
    """One stored array of an item: its storage name, key path, dtype, shape and chunk shape."""

    name: str
    path: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    codec: str  # "zstd", "none", ...


def load_json(path: str, missing: str | None = None):
    """The JSON value in ``path``; a missing file is ``missing``'s error, or None when ``missing`` is None."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        if missing is None:
            return None
        raise CheckpointError(missing) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from None


def read_item_metadata(items: str) -> dict:
    path = os.path.join(items, METADATA)
    meta = load_json(path, f"{items} has no {METADATA}: not an Orbax checkpoint item")
    if not isinstance(meta, dict) or not isinstance(meta.get("tree_metadata"), dict):
        raise CheckpointError(f"{path} has no tree_metadata: not an Orbax PyTree checkpoint (msgpack Flax "
                              "checkpoints are not read)")
    return meta


def tree_name(path: tuple[str, ...]) -> str:
    """A leaf's name in the Linen on-disk layout MaxText trains with (section 2): post-training saves hold the bare
    model tree (``decoder/.../kernel/value``) or put it under ``base/``; they read as ``params.params.decoder...``."""
    parts = list(path)
    if parts[:1] == ["base"]:
        parts = parts[1:]
    if parts[-1:] == ["value"] and len(parts) > 1:
        parts = parts[:-1]
    if parts and parts[0] in ("decoder", "token_embedder"):
        parts = ["params", "params", *parts]
    return ".".join(parts)


def leaf_paths(meta: dict) -> list[tuple[str, ...]]:
    """The key path of every stored leaf (empty nodes, optax's EmptyState and None, store nothing)."""
    out = []
    for entry in meta["tree_metadata"].values():
        value = entry.get("value_metadata", {})
        if value.get("skip_deserialize") or value.get("value_type") == "None":
            continue
        out.append(tuple(str(k["key"]) for k in entry.get("key_metadata", ())))
    return out


class Item:
    """An opened item folder: the leaf list and TensorStore handles, opened lazily and without a chunk cache."""

    def __init__(self, items: str):
        self.items = os.path.abspath(items)
        self.meta = read_item_metadata(self.items)
        self.ocdbt = bool(self.meta.get("use_ocdbt", os.path.isfile(os.path.join(self.items, MANIFEST))))
        self.zarr3 = bool(self.meta.get("use_zarr3", True))
        if self.ocdbt and not os.path.isfile(os.path.join(self.items, MANIFEST)):
            if any(n.startswith("ocdbt.process_") for n in os.listdir(self.items)):
                raise CheckpointError(f"{self.items} holds per-process OCDBT databases but no root {MANIFEST}: an "
                                      "unmerged save (the writer stopped before merging); finish or redo the save")
            raise CheckpointError(f"{self.items} has no {MANIFEST} although _METADATA says use_ocdbt")
        self.storage = {tree_name(p): ".".join(p) for p in leaf_paths(self.meta)}
        self.paths = {name: tuple(self.storage[name].split(".")) for name in self.storage}
        self._handles: dict = {}
        self._leaves: dict[str, Leaf] = {}
        self._context = None
        self._pid = os.getpid()

    def _ts(self):
        ts = tensorstore()
        if self._context is None or self._pid != os.getpid():  # a forked worker opens its own
            self._context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
            self._handles, self._pid = {}, os.getpid()
        return ts

    def spec(self, name: str) -> dict:
        name = self.storage.get(name, name)
        if self.ocdbt:
            kv = {"driver": "ocdbt", "base": {"driver": "file", "path": self.items + "/"}, "path": name + "/"}
        else:
            kv = {"driver": "file", "path": os.path.join(self.items, name) + "/"}
        return {"driver": "zarr3" if self.zarr3 else "zarr", "kvstore": kv,
                "recheck_cached_data": False, "recheck_cached_metadata": False}

    def handle(self, name: str):
        ts = self._ts()
        h = self._handles.get(name)
        if h is None:
            try:
                h = ts.open(self.spec(name), open=True, read=True, context=self._context).result()
            except Exception as exc:  # TensorStore raises ValueError / its own status errors
                raise CheckpointError(f"{self.items}: leaf '{name}' cannot be opened ({str(exc).splitlines()[0]})") \
                    from None
            self._handles[name] = h
        return h

    def leaf(self, name: str) -> Leaf:
        got = self._leaves.get(name)
        if got is None:
            h = self.handle(name)
            dtype = ZARR_DTYPES.get(h.dtype.name)
            if dtype is None:
                raise CheckpointError(f"{self.items}: leaf '{name}' has dtype {h.dtype.name}, which reshard does not "
                                      "read")
            chunks = tuple(int(c) for c in h.chunk_layout.read_chunk.shape)
            got = self._leaves[name] = Leaf(name, self.paths.get(name, tuple(name.split("."))), dtype,
                                            tuple(int(s) for s in h.shape), chunks, _codec(h))
        return got

    def read(self, name: str, index=()):
        """``leaf[index]`` as a numpy array (bfloat16 as ml_dtypes')."""
        h = self.handle(name)
        try:
            return h[index].read().result() if index != () else h.read().result()
        except Exception as exc:
            raise CheckpointError(f"{self.items}: reading leaf '{name}' failed ({str(exc).splitlines()[0]})") \
                from None


def read_banded(item: Item, name: str, box: tuple) -> np.ndarray:
    """``leaf[box]`` (a tuple of slices) read one chunk row at a time along axis 0 into one array: TensorStore
    decodes the chunks a read touches at once, so this holds the result plus one chunk row, not every chunk."""
    leaf = item.leaf(name)
    box = tuple(box) + (slice(None),) * (len(leaf.shape) - len(box))
    lo = [s.start or 0 for s in box]
    hi = [leaf.shape[i] if s.stop is None else s.stop for i, s in enumerate(box)]
    out = np.empty([b - a for a, b in zip(lo, hi)], dtype=item.handle(name).dtype.numpy_dtype)
    step = leaf.chunks[0] if leaf.chunks else 1
    a = lo[0]
    while a < hi[0]:
        b = min(hi[0], (a // step + 1) * step)
        out[a - lo[0]:b - lo[0]] = item.read(name, (slice(a, b),) + box[1:])
        a = b
    return out


def _codec(handle) -> str:
    try:
        spec = handle.spec().to_json()
    except Exception:  # pragma: no cover - informational only
        return "?"
    text = json.dumps(spec.get("metadata", {}))
    for name in ("zstd", "blosc", "gzip", "zlib"):
        if name in text:
            return name
    return "none"
