"""TP rank ``r`` of a TensorRT-LLM checkpoint, from its own ``rank{p * tp + r}.safetensors`` files (every pipeline
stage in sequence).

Split the way TensorRT-LLM runs them: ``attention.qkv`` = ``[q_r; k_r; v_r]`` (``nh/tp`` query heads,
``max(ng/tp, 1)`` KV heads), ``mlp.fc`` / ``mlp.gate`` the rank's gate / up rows, ``attention.dense`` and
``mlp.proj`` column slices; ``lm_head`` rows ``[r * Vp/tp, (r+1) * Vp/tp)`` of the vocab padded to a multiple of
tp. The embedding is whole on every rank (no parallel embedding): the rank keeps its vocab-parallel slice of it,
which is what a vocab-parallel lookup computes. The process count must equal the checkpoint's TP degree.
"""

from __future__ import annotations

import os

import torch

from reshard.errors import CheckpointError, ReshardError
from reshard.io.safetensors_format import SafetensorsFile
from reshard.layouts import trtllm
from reshard.layouts.base import Options, read_json_object
from reshard.layouts.hf_config import read_meaning
from reshard.layouts.trtllm_config import read_trtllm_config
from reshard.mapping import family_for_architecture
from reshard.verification.forward.rank_weights import (DecoderConfig, LayerWeights, RankWeights, check_world,
                                                       padded_vocab_for, split_stacked_qkv, unpack, vocab_rows)


def load_rank(path: str, rank: int, world: int, opts: Options) -> RankWeights:
    trt = read_json_object(os.path.join(path, trtllm.CONFIG), "a TensorRT-LLM checkpoint")
    mapping = trt.get("mapping") or {}
    tp, pp = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
    if world != tp:
        raise ReshardError(f"{path} is a TensorRT-LLM checkpoint at tp={tp}; run the forward check with --nproc {tp} "
                           f"(got {world}), or convert it to tp={world} first")
    ranks = trtllm._rank_files(path)
    missing = [p * tp + rank for p in range(pp) if p * tp + rank not in ranks]
    if missing:
        raise CheckpointError(f"{path}: rank{missing[0]}.safetensors is missing; the checkpoint is incomplete")
    files = [SafetensorsFile(ranks[p * tp + rank]) for p in range(pp)]
    try:
        return _read(path, trt, files, rank, world, opts)
    finally:
        for f in files:
            f.close()


def _read(path: str, trt: dict, files: list[SafetensorsFile], rank: int, world: int, opts: Options) -> RankWeights:
    architecture = opts.architecture or trt.get("architecture")
    family = family_for_architecture(architecture, opts.mapping)
    config, present = read_trtllm_config(trt, family, architecture, files, path)
    dims = family.resolve_dims(config)
    tied = bool(trt.get("tie_word_embeddings", False))
    meaning = read_meaning(config, family, architecture, dims, present, tied, path)
    decoder = DecoderConfig.from_meaning(meaning)
    check_world(decoder, world, meaning.ffn)
    d = decoder.head_dim
    q_rows, kv_rows = decoder.heads // world * d, max(decoder.kv_heads // world, 1) * d

    def get(f: SafetensorsFile, spec, layer: int | None = None):
        name = spec.trtllm.format(layer=layer) if layer is not None else spec.trtllm
        if name not in f.tensors:
            if spec.optional:
                return None
            raise CheckpointError(f"{f.path}: tensor '{name}' is missing")
        return unpack(spec, f.read(name), lambda t: split_stacked_qkv(t, q_rows, kv_rows)) \
            if spec.split == "qkv" else f.read(name)

    layer_specs = [s for s in family.weights if s.role and s.per_layer]
    per_stage = meaning.layers // len(files)
    layers = [LayerWeights(**{s.role: get(f, s, i) for s in layer_specs}) for f in files for i in range(per_stage)]
    role = family.role_spec
    table = get(files[0], role("embedding"))
    padded = padded_vocab_for(decoder.vocab, world)
    start, real, pad = vocab_rows(decoder.vocab, padded, rank, world)
    embedding = torch.cat([table[start:start + real], table.new_zeros(pad, decoder.hidden)]) if pad \
        else table[start:start + real].clone()
    head = get(files[-1], role("lm_head"))
    if head.shape[0] * world < decoder.vocab:
        raise CheckpointError(f"{files[-1].path}: lm_head holds {head.shape[0]} rows per rank, fewer than the vocab")
    head_rows = head.shape[0]
    lm_head = head if head_rows == padded // world else None
    if lm_head is None:
        raise CheckpointError(f"{files[-1].path}: lm_head holds {head_rows} rows, expected {padded // world}")
    return RankWeights(config=decoder, rank=rank, world=world, embedding=embedding, vocab_start=start, layers=layers,
                       final_norm=get(files[-1], role("final_norm")), lm_head=lm_head, lm_head_start=rank * head_rows,
                       padded_vocab=padded, dtype=embedding.dtype, files=[os.path.relpath(f.path, path) for f in files])
