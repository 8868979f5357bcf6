"""Writing an Orbax PyTree item with TensorStore alone (maxtext-orbax.md sections 1.2-1.4, 7.5).

One OCDBT database at the item root (``manifest.ocdbt``, ``d/``; orbax's config: values up to 1 KiB inline) holding
one zarr v3 array per leaf, chunks in ``sharding_indexed`` shards of one inner chunk each (bytes, zstd level 1 or
none; index bytes + crc32c at the end), as orbax writes them; ``_METADATA`` (every leaf's key path),
``commit_success.txt``; the step folder's ``_CHECKPOINT_METADATA`` is written by the caller, last. Writes are grouped
in TensorStore transactions of at most ``TXN_BYTES`` (bounded memory, few data files).
"""

from __future__ import annotations

import json
import os

import numpy as np

from reshard.io.orbax_store import tensorstore

TXN_BYTES = 64 << 20
ZARR_NAMES = {"BF16": "bfloat16", "F32": "float32", "F64": "float64", "F16": "float16", "I64": "int64", "I32": "int32"}
HANDLER = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"


def zarr3_metadata(shape, dtype: str, chunks, compression: str = "zstd") -> dict:
    codecs = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if compression == "zstd":
        codecs.append({"name": "zstd", "configuration": {"level": 1, "checksum": False}})
    return {"shape": list(shape), "data_type": ZARR_NAMES[dtype], "fill_value": 0,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
            "chunk_key_encoding": {"name": "default"},
            "codecs": [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": list(chunks), "codecs": codecs,
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                "index_location": "end"}}]}


def numpy_of(x) -> np.ndarray:
    """A torch tensor as numpy (bfloat16 as ml_dtypes', which TensorStore takes)."""
    import torch

    x = x.contiguous()
    if x.dtype == torch.bfloat16:
        import ml_dtypes

        return x.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


class ItemWriter:
    """Arrays of one item folder, created on :meth:`array`, written through :meth:`write`."""

    def __init__(self, items: str, compression: str = "zstd"):
        self.ts = tensorstore()
        os.makedirs(items, exist_ok=True)
        self.items = os.path.abspath(items)
        self.compression = compression
        self.context = self.ts.Context({"cache_pool": {"total_bytes_limit": 0}})
        self.kv = {"driver": "ocdbt", "base": {"driver": "file", "path": self.items + "/"},
                   "config": {"max_inline_value_bytes": 1024, "max_decoded_node_bytes": 100000000,
                              "compression": {"id": "zstd"}},
                   "target_data_file_size": 2 << 30}
        self.tree: dict[str, dict] = {}
        self.txn = None
        self.pending = 0

    def array(self, name: str, shape, dtype: str, chunks, value_type: str = "jax.Array"):
        spec = {"driver": "zarr3", "kvstore": dict(self.kv, path=name + "/"),
                "metadata": zarr3_metadata(shape, dtype, chunks, self.compression)}
        arr = self.ts.open(spec, create=True, context=self.context).result()
        path = name.split(".")
        self.tree[str(tuple(path))] = {"key_metadata": [{"key": k, "key_type": 2} for k in path],
                                       "value_metadata": {"value_type": value_type, "skip_deserialize": False,
                                                          "write_shape": list(shape)}}
        return arr

    def write(self, arr, index, value: np.ndarray) -> None:
        if self.txn is None:
            self.txn = self.ts.Transaction()
        target = arr.with_transaction(self.txn)
        (target[index] if index != () else target).write(value).result()
        self.pending += value.nbytes
        if self.pending >= TXN_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.txn is not None:
            self.txn.commit_async().result()
        self.txn, self.pending = None, 0

    def finish(self) -> None:
        """Commit what is pending, then ``_METADATA`` and ``commit_success.txt`` of the item."""
        self.flush()
        meta = {"tree_metadata": self.tree, "use_ocdbt": True, "use_zarr3": True,
                "store_array_data_equal_to_fill_value": True, "custom_metadata": None}
        with open(os.path.join(self.items, "_METADATA"), "w") as f:
            json.dump(meta, f)
        commit_note(self.items)


def commit_note(folder: str) -> None:
    with open(os.path.join(folder, "commit_success.txt"), "w") as f:
        f.write(f"Checkpoint commit was successful to {folder}")


def checkpoint_metadata(custom: dict, now_ns: int) -> str:
    """The step folder's ``_CHECKPOINT_METADATA`` (orbax's keys; MaxText reads ``custom_metadata.scan_layers``)."""
    return json.dumps({"item_handlers": {"items": HANDLER}, "metrics": {}, "performance_metrics": {},
                       "init_timestamp_nsecs": now_ns, "commit_timestamp_nsecs": now_ns, "custom_metadata": custom})
