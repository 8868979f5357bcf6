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


from reshard.core.canonical import instance
from reshard.errors import CheckpointError, ReshardError
from reshard.io.torch_format import TorchFile
from reshard.layouts import megatron
from reshard.layouts.base import Options
from reshard.verification.forward.rank_weights import (DecoderConfig, LayerWeights, RankWeights, check_world,
                                                       split_grouped_qkv, split_halves, unpack)

_CHUNK = re.compile(r"^model\d*$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _ranks(path: str) -> tuple[str, dict[tuple[int, int, int], str], object]:
    """The iteration folder, its rank files by (tp, pp, ep) rank, and the run's args."""
    folder, _ = megatron._iteration_dir(path)
    found = megatron.scan_rank_folders(folder)
    probe = TorchFile(found[min(found)])
    args = probe.structure.get("args") if isinstance(probe.structure, dict) else None
    probe.close()
    if args is None:
        raise CheckpointError(f"{probe.path}: no 'args' in the checkpoint: cannot tell the model config")
    grid = megatron.rank_grid(found, int(getattr(args, "pipeline_model_parallel_size", 1) or 1),
                              int(getattr(args, "expert_model_parallel_size", 1) or 1), folder)
    return folder, grid, args


def _chunks(f: TorchFile) -> list[str]:
    keys = [k for k in f.structure if isinstance(k, str) and _CHUNK.match(k)]
    if not keys:
        raise CheckpointError(f"{f.path}: no 'model' state dict in the checkpoint")
    return sorted(keys, key=lambda k: -1 if k == "model" else int(k[5:]))


def _layer_count(f: TorchFile, chunk: str) -> int:
    found = [int(m.group(1)) for key in f.structure[chunk] if (m := _LAYER.match(key))]
    return max(found) + 1 if found else 0


def _legacy_experts(f: TorchFile, chunk: str, specs, layer: int, ep_rank: int, per_rank: int, hidden: int) -> dict:
    """Legacy GroupedMLP experts as megatron-core runs them: ``weight1.view(E_loc, H, -1)[j].T`` is local expert
    j's ``[gate; up]``, ``weight2.view(E_loc, -1, H)[j].T`` its down projection."""
    names = {s.role: f"{chunk}/" + s.megatron_legacy_grouped.format(layer=layer) for s in specs}
    w1 = f.read(names["expert_gate"]).reshape(per_rank, hidden, -1)
    w2 = f.read(names["expert_down"]).reshape(per_rank, -1, hidden)
    out = {}
    for j in range(per_rank):
        gate, up = split_halves(w1[j].T)
        out[ep_rank * per_rank + j] = (gate, up, w2[j].T)
    return out


def load_rank(path: str, rank: int, world: int, opts: Options) -> RankWeights:
    folder, ranks, args = _ranks(path)
    tp = max(t for t, _, _ in ranks) + 1
    pp = max(p for _, p, _ in ranks) + 1
    ep = max(e for _, _, e in ranks) + 1
    if world != tp:
        raise ReshardError(f"{path} is a Megatron checkpoint at tp={tp}; run the forward check with --nproc {tp} "
                           f"(got {world}), or convert it to tp={world} first")
    etp = int(getattr(args, "expert_tensor_parallel_size", None) or tp)
    missing = megatron.missing_rank_folders(ranks, tp, pp, ep, etp)
    if missing:
        raise CheckpointError(f"{folder}: rank folder {missing[0]} is missing; the checkpoint is incomplete")

    def holder(p: int, e: int) -> str | None:
        """This rank's folder for EP rank e, else (expert-TP below tp) one holding the same expert-TP shard."""
        if (rank, p, e) in ranks:
            return ranks[(rank, p, e)]
        return next((ranks[(t, p, e)] for t in range(rank % etp, tp, etp) if (t, p, e) in ranks), None)

    dense = [next(ranks[(rank, p, e)] for e in range(ep) if (rank, p, e) in ranks) for p in range(pp)]
    opened: dict[str, TorchFile] = {}  # a file serves as dense and expert file: open (parse) it once

    def open_once(file_path: str) -> TorchFile:
        if file_path not in opened:
            opened[file_path] = TorchFile(file_path)
        return opened[file_path]

    # per stage: the rank's own file (everything but the routed experts), then one file per EP rank
    expert_files = [[open_once(dense[p])] + [open_once(holder(p, e)) for e in range(ep)] for p in range(pp)]
    try:
        return _read(path, folder, expert_files, args, rank, world, opts)
    finally:
        for f in opened.values():
            f.close()


def _read(path: str, folder: str, expert_files: list[list[TorchFile]], args, rank: int, world: int,
          opts: Options) -> RankWeights:
    """Rank ``rank``'s weights: per stage, its own file for everything but the routed experts, which come from a
    file of every EP rank holding this rank's expert-TP shard (local index j of EP rank e = global
    ``e * E/ep + j``); with an expert-TP degree below tp only ranks below it compute the experts (the others
    hold copies)."""
    files = [stage[0] for stage in expert_files]
    root = megatron._checkpoint_root(path, folder)
    meaning, family, _ = megatron.read_args(args, opts, root, folder)
    config = DecoderConfig.from_meaning(meaning)
    check_world(config, world, meaning.ffn)
    all_keys = {k for f in files for c in _chunks(f) for k in f.structure[c]}
    spec_name = "te" if any(k.endswith("linear_qkv.layer_norm_weight") for k in all_keys) else "local"
    chunks = _chunks(files[0])
    q_per_group = config.heads // config.kv_heads
    cache: dict[str, object] = {}

    sparse_layers = set(meaning.sparse_layers())
    grouped = any(megatron.GROUPED.search(k) for k in all_keys)
    legacy = any(megatron.LEGACY_GROUPED.search(k) for k in all_keys)
    etp = int(getattr(args, "expert_tensor_parallel_size", None) or world)
    experts_per_rank = meaning.experts // (len(expert_files[0]) - 1) if meaning.experts else 0

    def get(f: TorchFile, chunk: str, spec, layer: int | None = None, name_spec=None, global_layer=None,
            expert: int | None = None):
        """``spec``'s local tensor (its slot of a fused tensor); None when an optional weight is absent."""
        template = (name_spec or spec).megatron_name(spec_name, global_layer in sparse_layers, grouped)
        name = instance(template, layer, expert)
        key = f"{chunk}/{name}"
        if key not in f.tensors:
            if spec.optional:
                return None
            raise CheckpointError(f"{f.path}: tensor '{name}' is missing from the rank file")
        if (f.path, key) not in cache:
            cache.clear()  # a fused tensor's slots are read one after another
            cache[(f.path, key)] = f.read(key)
        return unpack(spec, cache[(f.path, key)], lambda t: split_grouped_qkv(t, q_per_group, config.head_dim))

    layer_specs = [s for s in family.weights if s.role and s.per_layer and not s.per_expert]
    expert_specs = [s for s in family.weights if s.per_expert]
    layers: list[LayerWeights] = []
    for chunk in chunks:  # global layer order: chunk-major, then pipeline stage
        for stage, f in zip(expert_files, files):
            if chunk not in f.structure:
                continue
            for i in range(_layer_count(f, chunk)):
                g = len(layers)
                held = [s for s in layer_specs if s.on_layer(g in sparse_layers)]
                weights = LayerWeights(**{s.role: get(f, chunk, s, i, global_layer=g) for s in held})
                if g in sparse_layers and rank < etp and legacy:
                    for e, ef in enumerate(stage[1:]):
                        weights.experts.update(_legacy_experts(ef, chunk, expert_specs, i, e, experts_per_rank,
                                                               config.hidden))
                elif g in sparse_layers and rank < etp:
                    for e, ef in enumerate(stage[1:]):
                        for j in range(experts_per_rank):
                            parts = {s.role: get(ef, chunk, s, i, global_layer=g, expert=j) for s in expert_specs}
                            weights.experts[e * experts_per_rank + j] = (parts["expert_gate"], parts["expert_up"],
                                                                         parts["expert_down"])
                layers.append(weights)
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
