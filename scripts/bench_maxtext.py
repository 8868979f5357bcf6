#!/usr/bin/env python
"""The MaxText source of the bench's ``maxtext_to_hf`` row: the generated HF checkpoint as MaxText's own
converter lays it out (maxtext-orbax.md section 1.4): scanned, every stacked leaf chunked ``[S0 / 16, L, ...]``
(axis 0 split over 16 simulated devices, **all layers in one chunk**), zstd, so that reshard's reader has to run its
unstack pass (section 7.3). Made from ``reshard convert SRC --to maxtext`` (one layer per chunk), re-chunked here
with TensorStore one destination chunk at a time (memory: one chunk). Not timed.

    python scripts/bench_maxtext.py HF_SRC DST [--model llama3-8b]
    python scripts/bench_maxtext.py --stacked-gib 1 DST     # a Llama whose MLP leaves are 1 GiB stacked tensors

``--stacked-gib G`` writes, without an HF source, a scanned MaxText llama2-convention checkpoint (bf16, random)
whose ``mlp.wi_0`` / ``wi_1`` / ``wo`` are G GiB each ([1024, L, 8192], L = 64 G), chunked as MaxText's converter
does, with reshard's provenance (the HF config): the memory-bound row of maxtext-orbax.md 7.7.6
(``/usr/bin/time -v reshard convert DST OUT --to hf``: peak RSS against 512 MiB plus one chunk).
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


def synthetic(dst: Path, gib: float) -> None:
    """The ``--stacked-gib`` checkpoint (see the module docstring), written one chunk at a time."""
    import ml_dtypes
    import numpy as np
    import tensorstore as ts

    h, f, nh, d, v = 1024, 8192, 8, 128, 1024
    layers = max(1, round(64 * gib))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": f,
              "num_hidden_layers": layers, "num_attention_heads": nh, "num_key_value_heads": nh, "head_dim": d,
              "vocab_size": v, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}
    leaves = {"token_embedder.embedding": (v, h), "decoder.decoder_norm.scale": (h,),
              "decoder.logits_dense.kernel": (h, v)}
    per = {"self_attention.query.kernel": (h, nh, d), "self_attention.key.kernel": (h, nh, d),
           "self_attention.value.kernel": (h, nh, d), "self_attention.out.kernel": (nh, d, h),
           "pre_self_attention_layer_norm.scale": (h,), "post_self_attention_layer_norm.scale": (h,),
           "mlp.wi_0.kernel": (h, f), "mlp.wi_1.kernel": (h, f), "mlp.wo.kernel": (f, h)}
    leaves.update({"decoder.layers." + k: (s[0], layers, *s[1:]) for k, s in per.items()})
    items = dst / "0" / "items"
    items.mkdir(parents=True)
    ctx = ts.Context()
    rng = np.random.default_rng(0)
    tree = {}
    for sub, shape in leaves.items():
        name = "params.params." + sub
        chunks = list(shape)
        if chunks[0] % 16 == 0:
            chunks[0] //= 16  # MaxText's converter: axis 0 over 16 devices, every layer in each chunk
        codecs = [{"name": "bytes", "configuration": {"endian": "little"}},
                  {"name": "zstd", "configuration": {"level": 1, "checksum": False}}]
        meta = {"shape": list(shape), "data_type": "bfloat16", "fill_value": 0,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
                "chunk_key_encoding": {"name": "default"},
                "codecs": [{"name": "sharding_indexed", "configuration": {
                    "chunk_shape": chunks, "codecs": codecs,
                    "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]}}]}
        arr = ts.open({"driver": "zarr3", "metadata": meta, "kvstore": {
            "driver": "ocdbt", "base": {"driver": "file", "path": str(items) + "/"}, "path": name + "/"}},
            create=True, context=ctx).result()
        for a in range(0, shape[0], chunks[0]):
            box = (min(chunks[0], shape[0] - a), *shape[1:])
            arr[a:a + box[0]].write((rng.standard_normal(box, np.float32) * 0.02).astype(ml_dtypes.bfloat16)).result()
        path = ["params", "params", *sub.split(".")]
        tree[str(tuple(path))] = {"key_metadata": [{"key": k, "key_type": 2} for k in path],
                                  "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False,
                                                     "write_shape": chunks}}
    (items / "_METADATA").write_text(json.dumps({"tree_metadata": tree, "use_ocdbt": True, "use_zarr3": True}))
    (items / "commit_success.txt").write_text("ok")
    custom = {"scan_layers": True, "reshard": {"maxtext_model": "llama2-7b", "hf_config": config}}
    (dst / "0" / "commit_success.txt").write_text("ok")
    (dst / "0" / "_CHECKPOINT_METADATA").write_text(json.dumps({"custom_metadata": custom}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", type=Path, nargs="+", metavar="[SRC] DST")
    ap.add_argument("--model", default="llama3-8b", help="the MaxText model name (default: llama3-8b)")
    ap.add_argument("--stacked-gib", type=float, default=None, help="no SRC: a synthetic checkpoint whose MLP leaves "
                    "are this many GiB each")
    args = ap.parse_args(argv)
    if args.stacked_gib:
        shutil.rmtree(args.paths[-1], ignore_errors=True)
        synthetic(args.paths[-1], args.stacked_gib)
        return 0
    args.src, args.dst = args.paths
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
