"""TP rank ``r`` of a vLLM ``sharded_state`` folder, from its own ``model-rank-{r}-part-*.safetensors`` only.

Split the way vLLM runs them: ``qkv_proj`` = ``[q_r; k_r; v_r]`` (``nh/tp`` query heads, ``max(ng/tp, 1)`` KV
heads), ``gate_up_proj`` = ``[gate_r; up_r]``, ``o_proj`` / ``down_proj`` column slices (their biases whole),
embedding and ``lm_head`` rows ``[r*Vp/tp, (r+1)*Vp/tp)`` of the vocab padded to 64; a tied model stores only the
name vLLM's loader keeps, which then serves as both. The process count must equal the folder's TP degree.
"""

from __future__ import annotations

import os

from reshard.errors import CheckpointError, ReshardError
from reshard.io.safetensors_format import SafetensorsFile
from reshard.layouts import hf, vllm
from reshard.layouts.base import Options
from reshard.layouts.hf_config import read_meaning
from reshard.mapping import family_for_architecture
from reshard.verification.forward.rank_weights import (DecoderConfig, LayerWeights, RankWeights, check_world,
                                                       split_halves, split_stacked_qkv, unpack)


def _experts(specs, layer: int, where: dict, experts: int, rank: int, world: int) -> dict:
    """The routed experts of a stacked vLLM layer: every expert's 1/tp slice (``w13`` = [gate_r; up_r]), or with
    expert parallelism (fewer stacked than the model's experts) the rank's block of whole experts."""
    stacked = {}
    for spec in specs:
        name = spec.vllm_name.format(layer=layer)
        if name not in where:
            raise CheckpointError(f"tensor '{name}' is missing from rank {rank}'s files")
        stacked[spec.role] = where[name].read(name)
    held = stacked["expert_down"].shape[0]
    ids = vllm.expert_block(experts, world, rank) if held < experts else range(experts)
    out = {}
    for j, e in enumerate(ids):
        gate, up = split_halves(stacked["expert_gate"][j])
        out[e] = (gate, up, stacked["expert_down"][j])
    return out


def load_rank(path: str, rank: int, world: int, opts: Options) -> RankWeights:
    ranks = vllm._rank_files(path)
    if world != len(ranks):
        raise ReshardError(f"{path} is a vLLM folder for tensor_parallel_size={len(ranks)}; run the forward check "
                           f"with --nproc {len(ranks)} (got {world}), or convert it to tp={world} first")
    files = [SafetensorsFile(p) for p in ranks[rank]]
    try:
        return _read(path, files, rank, world, opts)
    finally:
        for f in files:
            f.close()


def _read(path: str, files: list[SafetensorsFile], rank: int, world: int, opts: Options) -> RankWeights:
    hf_config = hf.read_config(path)
    family = family_for_architecture(hf.architecture_of(hf_config, opts), opts.mapping)
    dims = family.resolve_dims(hf_config)
    where = {name: f for f in files for name in f.tensors}
    present = {s.hf for s in family.weights if s.optional and s.vllm_name.format(layer=0) in where}
    role = family.role_spec
    emb_name, head_name = role("embedding").vllm_name, role("lm_head").vllm_name
    tied = not (emb_name in where and head_name in where)
    meaning = read_meaning(hf_config, family, hf.architecture_of(hf_config, opts), dims, present, tied, path)
    config = DecoderConfig.from_meaning(meaning)
    check_world(config, world, dims["F"])
    d = config.head_dim
    q_rows = config.heads // world * d
    kv_rows = max(config.kv_heads // world, 1) * d

    def get(spec, layer: int | None = None):
        """``spec``'s local tensor (its slot of a fused tensor); None when an optional weight is absent."""
        name = spec.vllm_name.format(layer=layer) if layer is not None else spec.vllm_name
        if name not in where:
            if spec.optional:
                return None
            raise CheckpointError(f"{path}: tensor '{name}' is missing from rank {rank}'s files")
        return unpack(spec, where[name].read(name), lambda t: split_stacked_qkv(t, q_rows, kv_rows))

    sparse_layers = set(meaning.sparse_layers())
    layer_specs = [s for s in family.weights if s.role and s.per_layer and not s.per_expert]
    expert_specs = [s for s in family.weights if s.per_expert]
    layers = []
    for i in range(config.layers):
        held = [s for s in layer_specs if s.on_layer(i in sparse_layers)]
        weights = LayerWeights(**{s.role: get(s, i) for s in held})
        if i in sparse_layers:
            weights.experts = _experts(expert_specs, i, where, meaning.experts, rank, world)
        layers.append(weights)
    if tied:
        kept = vllm.kept_tied_name([emb_name, head_name], family)
        if kept not in where:
            raise CheckpointError(f"{path}: rank {rank} holds neither '{emb_name}' nor '{head_name}'")
        embedding, lm_head = where[kept].read(kept), None
    else:
        embedding, lm_head = get(role("embedding")), get(role("lm_head"))
    rows = embedding.shape[0]
    optional = {r: get(role(r)) for r in ("final_norm_bias", "position_embedding") if role(r)}
    return RankWeights(config=config, rank=rank, world=world, embedding=embedding, vocab_start=rank * rows,
                       layers=layers, final_norm=get(role("final_norm")), lm_head=lm_head,
                       lm_head_start=rank * rows, padded_vocab=rows * world, dtype=embedding.dtype,
                       files=[os.path.relpath(f.path, path) for f in files], **optional)
