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
                                                       split_halves, split_stacked_qkv)


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
    names = {s.hf: s.vllm_name for s in family.weights}
    present = {s.hf for s in family.weights if s.optional and s.vllm_name.format(layer=0) in where}
    emb_name, head_name = names["model.embed_tokens.weight"], names["lm_head.weight"]
    tied = not (emb_name in where and head_name in where)
    meaning = read_meaning(hf_config, family, hf.architecture_of(hf_config, opts), dims, present, tied, path)
    config = DecoderConfig.from_meaning(meaning, family.decoder)
    check_world(config, world, dims["F"])

    def get(hf_name: str, layer: int | None = None, optional: bool = False):
        name = names[hf_name].format(layer=layer) if layer is not None else names[hf_name]
        if name not in where:
            if optional:
                return None
            raise CheckpointError(f"{path}: tensor '{name}' is missing from rank {rank}'s files")
        return where[name].read(name)

    d = config.head_dim
    q_rows = config.heads // world * d
    kv_rows = max(config.kv_heads // world, 1) * d
    layers = []
    for i in range(config.layers):
        p = "model.layers.{layer}."
        q, k, v = split_stacked_qkv(get(p + "self_attn.q_proj.weight", i), q_rows, kv_rows)
        bias = get(p + "self_attn.q_proj.bias", i, optional=True)
        qb, kb, vb = split_stacked_qkv(bias, q_rows, kv_rows) if bias is not None else (None,) * 3
        gate, up = split_halves(get(p + "mlp.gate_proj.weight", i))
        gate_up_bias = get(p + "mlp.gate_proj.bias", i, optional=True)
        gb, ub = split_halves(gate_up_bias) if gate_up_bias is not None else (None, None)
        layers.append(LayerWeights(
            input_norm=get(p + "input_layernorm.weight", i), post_norm=get(p + "post_attention_layernorm.weight", i),
            q=q, k=k, v=v, o=get(p + "self_attn.o_proj.weight", i), gate=gate, up=up,
            down=get(p + "mlp.down_proj.weight", i), q_bias=qb, k_bias=kb, v_bias=vb,
            o_bias=get(p + "self_attn.o_proj.bias", i, True), gate_bias=gb, up_bias=ub,
            down_bias=get(p + "mlp.down_proj.bias", i, True)))
    if tied:
        kept = vllm.kept_tied_name([emb_name, head_name])
        if kept not in where:
            raise CheckpointError(f"{path}: rank {rank} holds neither '{emb_name}' nor '{head_name}'")
        embedding, lm_head = where[kept].read(kept), None
    else:
        embedding, lm_head = get("model.embed_tokens.weight"), get("lm_head.weight")
    rows = embedding.shape[0]
    return RankWeights(config=config, rank=rank, world=world, embedding=embedding, vocab_start=rank * rows,
                       layers=layers, final_norm=get("model.norm.weight"), lm_head=lm_head,
                       lm_head_start=rank * rows, padded_vocab=rows * world, dtype=embedding.dtype,
                       files=[os.path.relpath(f.path, path) for f in files])
