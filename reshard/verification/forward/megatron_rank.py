"""TP rank ``r`` of a Megatron-Core ``torch`` checkpoint, from its own files only.

Rank ``r`` opens ``mp_rank_{r:02d}`` (pp=1) or ``mp_rank_{r:02d}_{p:03d}`` for every pipeline stage ``p`` and
runs the stages in sequence; with a virtual pipeline each file holds chunks ``model0``, ``model1``, ... and the
global layer order is chunk-major (chunk 0 of every stage, then chunk 1, ...). Fused tensors are split the way
Megatron-Core runs them: ``linear_qkv`` per local KV group ``[q heads of the group; k; v]``, ``linear_fc1`` =
``[gate_r; up_r]``; embedding and output layer hold rows ``[r*Vp/tp, (r+1)*Vp/tp)`` of the padded vocab.
The process count must equal the checkpoint's TP degree (a Megatron rank file is only meaningful at its own
degree); convert first to check another degree.
"""

from __future__ import annotations

import os
import re


from reshard.errors import CheckpointError, ReshardError
from reshard.io.torch_format import TorchFile
from reshard.layouts import megatron
from reshard.layouts.base import Options
from reshard.verification.forward.rank_weights import (DecoderConfig, LayerWeights, RankWeights, check_world,
                                                       split_grouped_qkv, unpack)

_CHUNK = re.compile(r"^model\d*$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _ranks(path: str) -> tuple[str, dict[tuple[int, int], str]]:
    folder, _ = megatron._iteration_dir(path)
    return folder, megatron._scan_ranks(folder)


def _chunks(f: TorchFile) -> list[str]:
    keys = [k for k in f.structure if isinstance(k, str) and _CHUNK.match(k)]
    if not keys:
        raise CheckpointError(f"{f.path}: no 'model' state dict in the checkpoint")
    return sorted(keys, key=lambda k: -1 if k == "model" else int(k[5:]))


def _layer_count(f: TorchFile, chunk: str) -> int:
    found = [int(m.group(1)) for key in f.structure[chunk] if (m := _LAYER.match(key))]
    return max(found) + 1 if found else 0


def load_rank(path: str, rank: int, world: int, opts: Options) -> RankWeights:
    folder, ranks = _ranks(path)
    tp = max(t for t, _ in ranks) + 1
    pp = max(p for _, p in ranks) + 1
    if world != tp:
        raise ReshardError(f"{path} is a Megatron checkpoint at tp={tp}; run the forward check with --nproc {tp} "
                           f"(got {world}), or convert it to tp={world} first")
    missing = [megatron.rank_dir(rank, p, pp) for p in range(pp) if (rank, p) not in ranks]
    if missing:
        raise CheckpointError(f"{folder}: rank folder {missing[0]} is missing; the checkpoint is incomplete")
    files = [TorchFile(ranks[(rank, p)]) for p in range(pp)]
    try:
        return _read(path, folder, files, rank, world, opts)
    finally:
        for f in files:
            f.close()


def _read(path: str, folder: str, files: list[TorchFile], rank: int, world: int, opts: Options) -> RankWeights:
    first = files[0].structure
    if not isinstance(first, dict) or "args" not in first:
        raise CheckpointError(f"{files[0].path}: no 'args' in the checkpoint: cannot tell the model config")
    args = first["args"]
    root = megatron._checkpoint_root(path, folder)
    meaning, family, _ = megatron.read_args(args, opts, root, folder)
    config = DecoderConfig.from_meaning(meaning)
    check_world(config, world, meaning.ffn)
    all_keys = {k for f in files for c in _chunks(f) for k in f.structure[c]}
    spec_name = "te" if any(k.endswith("linear_qkv.layer_norm_weight") for k in all_keys) else "local"
    chunks = _chunks(files[0])
    q_per_group = config.heads // config.kv_heads
    cache: dict[str, object] = {}

    def get(f: TorchFile, chunk: str, spec, layer: int | None = None, name_spec=None):
        """``spec``'s local tensor (its slot of a fused tensor); None when an optional weight is absent."""
        template = (name_spec or spec).megatron_name(spec_name)
        name = template.format(layer=layer) if layer is not None else template
        key = f"{chunk}/{name}"
        if key not in f.tensors:
            if spec.optional:
                return None
            raise CheckpointError(f"{f.path}: tensor '{name}' is missing from the rank file")
        if (f.path, key) not in cache:
            cache.clear()  # a fused tensor's slots are read one after another
            cache[(f.path, key)] = f.read(key)
        return unpack(spec, cache[(f.path, key)], lambda t: split_grouped_qkv(t, q_per_group, config.head_dim))

    layer_specs = [s for s in family.weights if s.role and s.per_layer]
    layers: list[LayerWeights] = []
    for chunk in chunks:  # global layer order: chunk-major, then pipeline stage
        for f in files:
            if chunk not in f.structure:
                continue
            for i in range(_layer_count(f, chunk)):
                layers.append(LayerWeights(**{s.role: get(f, chunk, s, i) for s in layer_specs}))
    if len(layers) != config.layers:
        raise CheckpointError(f"{folder}: rank {rank}'s files hold {len(layers)} layers but the args say "
                              f"{config.layers}: a pipeline stage is missing or inconsistent")
    role = family.role_spec
    embedding = get(files[0], chunks[0], role("embedding"))
    positions = get(files[0], chunks[0], role("position_embedding")) if role("position_embedding") else None
    last, last_chunk = files[-1], _chunks(files[-1])[-1]
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    # Tied with pp=1: the head is the embedding. Tied with pp>1: the last stage keeps its own copy.
    head = role("lm_head")
    lm_head = None if tied and len(files) == 1 and len(chunks) == 1 else \
        get(last, last_chunk, role("embedding") if tied else head, name_spec=head)
    rows = embedding.shape[0]
    if lm_head is not None and lm_head.shape[0] != rows:
        raise CheckpointError(f"{last.path}: output_layer has {lm_head.shape[0]} rows, the embedding {rows}")
    final_bias = role("final_norm_bias")
    return RankWeights(config=config, rank=rank, world=world, embedding=embedding, vocab_start=rank * rows,
                       layers=layers, final_norm=get(last, last_chunk, role("final_norm")), lm_head=lm_head,
                       lm_head_start=rank * rows, padded_vocab=rows * world, dtype=embedding.dtype,
                       files=[os.path.relpath(f.path, path) for f in files],
                       final_norm_bias=get(last, last_chunk, final_bias) if final_bias else None,
                       position_embedding=positions)
