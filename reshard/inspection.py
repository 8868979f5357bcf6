"""Inspect a checkpoint: layout, architecture, degrees, dtypes, parameters, bytes, files per rank."""

from __future__ import annotations

import collections
import math
import os

from reshard.hub import open_source
from reshard.layouts.base import Options
from reshard.layouts.registry import get_layout


def inspect(path: str, *, vocab_size: int | None = None, architecture: str | None = None,
            mapping: str | None = None) -> dict:
    opts = Options(vocab_size=vocab_size, architecture=architecture, mapping=mapping)
    with open_source(path, opts) as source:
        model = source.model
        dtype_counts = collections.Counter(model.dtypes.values())
        layout = get_layout(source.layout)
        files_per_rank: dict[str, list[str]] = collections.defaultdict(list)
        for f in source.files:
            rel = os.path.relpath(f.path, source.root)
            files_per_rank[layout.rank_label(source, rel)].append(rel)
        info = {
            "path": path,
            "layout": source.layout,
            "architecture": (model.config.get("architectures") or ["?"])[0],
            "family": model.family.name,
            "tp": source.degrees["tp"],
            "pp": source.degrees["pp"],
            "dtype": dtype_counts.most_common(1)[0][0] if dtype_counts else None,
            "dtypes": dict(dtype_counts),
            "parameters": sum(math.prod(t.shape) for t in model.tensors.values()),
            "tensors": len(model.tensors),
            "layers": model.num_layers,
            "hidden_size": model.dims["H"],
            "heads": model.dims["nh"],
            "kv_heads": model.dims["ng"],
            "vocab_size": model.vocab_size,
            "tied_embeddings": model.tied,
            "bytes": sum(os.path.getsize(f.path) for f in source.files),
            "files_per_rank": dict(files_per_rank),
        }
        info.update(layout.describe(source))
        return info
