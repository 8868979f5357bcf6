"""MaxText checkpoints (Orbax PyTree items, zarr arrays, OCDBT or per-array; maxtext-orbax.md): read and write.

Read: a step folder (``<step>/_CHECKPOINT_METADATA`` + ``items/``), an item folder, or a folder of steps
(``<run>/checkpoints/``: the newest complete step); scanned (layer axis 1, experts ``[E, L, ...]``) or unscanned
(``layers_<i>``) trees, training checkpoints included (parameters only). Write: a parameter checkpoint
``<out>/0/items`` (``load_parameters_path``), one layer per chunk, zstd level 1 (:mod:`reshard.layouts.maxtext_write`).
Needs ``tensorstore`` (``pip install 'reshard[maxtext]'``); no jax, no orbax.
"""

from __future__ import annotations

import os

from reshard.layouts.base import Layout, Options, Source, TargetPlan
from reshard.layouts.maxtext_folders import detect_names

NAME = "maxtext"


class MaxTextLayout(Layout):
    """MaxText / Orbax: ``<step>/items/`` with one zarr array per parameter leaf."""

    name = NAME
    summary = "MaxText / Orbax checkpoint (<step>/_CHECKPOINT_METADATA + items/, zarr arrays, OCDBT)"
    specificity = 10
    rank_loader = "reshard.verification.forward.sliced_rank:SlicedRankStream"
    rank_view_of = "hf"  # MaxText has no ranks: its one "rank" (load_rank, live.plan) is the whole model, HF names
    completion_markers = ("0/_CHECKPOINT_METADATA",)
    uses_options = frozenset({"scan_layers", "maxtext_match_converter", "maxtext_vocab_size"})
    reads_options = frozenset({"config", "tag"})

    def detect(self, names) -> bool:
        return detect_names(names)

    def open(self, root: str, opts: Options) -> Source:
        from reshard.layouts.maxtext_source import open_source

        return open_source(root, opts)

    def targets(self, source: Source, opts: Options, dtype: str) -> TargetPlan:
        from reshard.layouts.maxtext_write import targets

        return targets(source, opts, dtype)

    def finalize(self, out: str, source: Source, plan, state) -> None:
        from reshard.layouts.maxtext_write import finalize

        finalize(out, source, plan, state)

    def describe(self, source: Source) -> dict:
        from reshard.layouts.maxtext_source import leaf_chunks, unstack_leaves

        info = dict(source.info.get("maxtext", {}))
        if source.info.get("dropped"):
            info["not_read"] = source.info["dropped"]  # optimizer state, step, nnx_aux
        if source.files and hasattr(source.files[0], "recipes"):
            leaves = unstack_leaves(source)
            info["unstack_pass"] = (f"yes: the chunks of {len(leaves)} stacked leaves span several layers "
                                    "(decoded once into a scratch file)") if leaves else "no"
            info["leaves"] = leaf_chunks(source.files[0].item)
        items = info.get("items")
        on_disk = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(items) for n in names) \
            if items else None
        return {"maxtext": info, **({"bytes": on_disk} if on_disk is not None else {})}  # the item, compressed
