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
            **source.degrees,  # tp, pp; ep and etp for a Megatron Mixture of Experts
            "dtype": dtype_counts.most_common(1)[0][0] if dtype_counts else None,
            "dtypes": dict(dtype_counts),
            "parameters": sum(math.prod(t.shape) for t in model.tensors.values()),
            "tensors": len(model.tensors),
            "layers": model.num_layers,
            "hidden_size": model.dims["H"],
            "heads": model.dims["nh"],
            "kv_heads": model.dims["ng"],
            "vocab_size": model.vocab_size,
            **({"experts": model.num_experts, "moe_layers": len(model.sparse_layers)} if model.num_experts else {}),
            "tied_embeddings": model.tied,
            "model_config": {k: v for k, v in model.meaning.as_dict().items() if v not in (None, False)},
            "bytes": sum(os.path.getsize(f.path) for f in source.files),
            "files_per_rank": dict(files_per_rank),
        }
        info.update(layout.describe(source))
        return info


def _span(names: list[str]) -> str:
    """``a, b, c`` for up to three names, else ``first … last``."""
    return ", ".join(names) if len(names) <= 3 else f"{names[0]} … {names[-1]}"


def summarize_files(files_per_rank: dict[str, list[str]]) -> list[str]:
    """A few lines for a long file list: per rank its file count and first … last name; many ranks with the
    same number of files each fold into one line naming the first and last rank."""
    counts = {rank: len(names) for rank, names in files_per_rank.items()}
    if len(counts) <= 3 or len(set(counts.values())) > 1:
        return [f"{rank}: {len(names)} file{'s' if len(names) != 1 else ''}: {_span(names)}"
                for rank, names in files_per_rank.items()]
    ranks = list(files_per_rank)
    per = counts[ranks[0]]
    first, last = files_per_rank[ranks[0]], files_per_rank[ranks[-1]]
    return [f"{len(ranks)} ranks ({ranks[0]} … {ranks[-1]}), {per} file{'s' if per != 1 else ''} each, "
            f"{per * len(ranks)} in all",
            f"{ranks[0]}: {_span(first)}", f"{ranks[-1]}: {_span(last)}"]
