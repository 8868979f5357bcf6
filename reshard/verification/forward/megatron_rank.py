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
                                                       split_grouped_qkv, split_halves)

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
    config = DecoderConfig.from_meaning(meaning, family.decoder)
    check_world(config, world, meaning.ffn)
    all_keys = {k for f in files for c in _chunks(f) for k in f.structure[c]}
    spec_name = "te" if any(k.endswith("linear_qkv.layer_norm_weight") for k in all_keys) else "local"
    names = {s.hf: s.megatron_name(spec_name) for s in family.weights}
    chunks = _chunks(files[0])

    def get(f: TorchFile, chunk: str, hf_name: str, layer: int | None = None, optional: bool = False):
        name = names[hf_name].format(layer=layer) if layer is not None else names[hf_name]
        key = f"{chunk}/{name}"
        if key not in f.tensors:
            if optional:
                return None
            raise CheckpointError(f"{f.path}: tensor '{name}' is missing from the rank file")
        return f.read(key)

    q_per_group = config.heads // config.kv_heads
    layers: list[LayerWeights] = []
    for chunk in chunks:  # global layer order: chunk-major, then pipeline stage
        for f in files:
            if chunk not in f.structure:
                continue
            for i in range(_layer_count(f, chunk)):
                p = "model.layers.{layer}."
                q, k, v = split_grouped_qkv(get(f, chunk, p + "self_attn.q_proj.weight", i), q_per_group,
                                            config.head_dim)
                bias = get(f, chunk, p + "self_attn.q_proj.bias", i, optional=True)
                qb, kb, vb = split_grouped_qkv(bias, q_per_group, config.head_dim) if bias is not None else (None,) * 3
                gate, up = split_halves(get(f, chunk, p + "mlp.gate_proj.weight", i))
                fc1_bias = get(f, chunk, p + "mlp.gate_proj.bias", i, optional=True)
                gb, ub = split_halves(fc1_bias) if fc1_bias is not None else (None, None)
                layers.append(LayerWeights(
                    input_norm=get(f, chunk, p + "input_layernorm.weight", i),
                    post_norm=get(f, chunk, p + "post_attention_layernorm.weight", i),
                    q=q, k=k, v=v, o=get(f, chunk, p + "self_attn.o_proj.weight", i),
                    gate=gate, up=up, down=get(f, chunk, p + "mlp.down_proj.weight", i),
                    q_bias=qb, k_bias=kb, v_bias=vb, o_bias=get(f, chunk, p + "self_attn.o_proj.bias", i, True),
                    gate_bias=gb, up_bias=ub, down_bias=get(f, chunk, p + "mlp.down_proj.bias", i, True)))
    if len(layers) != config.layers:
        raise CheckpointError(f"{folder}: rank {rank}'s files hold {len(layers)} layers but the args say "
                              f"{config.layers}: a pipeline stage is missing or inconsistent")
    embedding = get(files[0], chunks[0], "model.embed_tokens.weight")
    last, last_chunk = files[-1], _chunks(files[-1])[-1]
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    # Tied with pp=1: the head is the embedding. Tied with pp>1: the last stage keeps its own copy.
    lm_head = None if tied and len(files) == 1 and len(chunks) == 1 else get(last, last_chunk, "lm_head.weight")
    rows = embedding.shape[0]
    if lm_head is not None and lm_head.shape[0] != rows:
        raise CheckpointError(f"{last.path}: output_layer has {lm_head.shape[0]} rows, the embedding {rows}")
    return RankWeights(config=config, rank=rank, world=world, embedding=embedding, vocab_start=rank * rows,
                       layers=layers, final_norm=get(last, last_chunk, "model.norm.weight"), lm_head=lm_head,
                       lm_head_start=rank * rows, padded_vocab=rows * world, dtype=embedding.dtype,
                       files=[os.path.relpath(f.path, path) for f in files])
