#!/usr/bin/env python
"""The MaxText source of the bench's ``maxtext_to_hf`` row: the generated HF checkpoint as MaxText's own
converter lays it out (maxtext-orbax.md section 1.4): scanned, every stacked leaf chunked ``[S0 / 16, L, ...]``
(axis 0 split over 16 simulated devices, **all layers in one chunk**), zstd, so that reshard's reader has to run its
unstack pass (section 7.3). Made from ``reshard convert SRC --to maxtext`` (one layer per chunk), re-chunked here
with TensorStore one destination chunk at a time (memory: one chunk). Not timed.

    python scripts/bench_maxtext.py HF_SRC DST [--model llama3-8b]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path


def rechunk(src_items: Path, dst_items: Path) -> None:
    import tensorstore as ts

    meta = json.loads((src_items / "_METADATA").read_text())
    ctx = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    base = {"driver": "ocdbt", "base": {"driver": "file", "path": str(src_items) + "/"}}
    out = {"driver": "ocdbt", "base": {"driver": "file", "path": str(dst_items) + "/"},
           "config": {"max_inline_value_bytes": 1024, "compression": {"id": "zstd"}}}
    for entry in meta["tree_metadata"].values():
        name = ".".join(k["key"] for k in entry["key_metadata"])
        src = ts.open({"driver": "zarr3", "kvstore": dict(base, path=name + "/")}, open=True, context=ctx).result()
        shape = list(src.shape)
        chunks = list(shape)
        if chunks and chunks[0] % 16 == 0:
            chunks[0] //= 16
        zmeta = src.spec().to_json()["metadata"]
        zmeta["chunk_grid"]["configuration"]["chunk_shape"] = chunks
        zmeta["codecs"][0]["configuration"]["chunk_shape"] = chunks
        zmeta["codecs"][0]["configuration"]["codecs"][-1] = {"name": "zstd", "configuration": {"level": 3,
                                                                                             "checksum": False}}
        dst = ts.open({"driver": "zarr3", "kvstore": dict(out, path=name + "/"), "metadata": zmeta}, create=True,
                      context=ctx).result()
        for origin in itertools.product(*(range(0, s, c) for s, c in zip(shape, chunks))):
            box = tuple(slice(o, min(o + c, s)) for o, c, s in zip(origin, chunks, shape))
            dst[box].write(src[box].read().result()).result()
    shutil.copy2(src_items / "_METADATA", dst_items / "_METADATA")
    shutil.copy2(src_items / "commit_success.txt", dst_items / "commit_success.txt")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--model", default="llama3-8b", help="the MaxText model name (default: llama3-8b)")
    args = ap.parse_args(argv)
    tmp = args.dst.with_name(args.dst.name + ".reshard")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(args.dst, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "reshard", "convert", str(args.src), str(tmp), "--to", "maxtext",
                    "--maxtext-model", args.model], check=True)
    items = args.dst / "0" / "items"
    os.makedirs(items)
    rechunk(tmp / "0" / "items", items)
    shutil.copy2(tmp / "0" / "_CHECKPOINT_METADATA", args.dst / "0" / "_CHECKPOINT_METADATA")
    shutil.copy2(tmp / "0" / "commit_success.txt", args.dst / "0" / "commit_success.txt")
    shutil.rmtree(tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
