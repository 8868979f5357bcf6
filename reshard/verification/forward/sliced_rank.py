"""Rank ``r`` of ``world`` from a checkpoint whose data does not depend on a TP degree (Hugging Face, Megatron
``torch_dist``): slice the canonical tensors.

Reads only the rows / columns the rank holds, through the source's canonical index (whatever files and chunks
hold them): q heads ``[r*nh/w, (r+1)*nh/w)``, KV heads ``[r*ng/w, ...)`` or, when ``w > ng``, KV head
``r // (w/ng)``; gate/up rows and o/down columns by 1/w; the vocab padded to a multiple of ``w`` and split evenly
(padding rows are zeros).
"""

from __future__ import annotations

import torch

from reshard.core.plan import CanonicalIndex, TargetTensor
from reshard.execute import assemble
from reshard.layouts.base import Options
from reshard.layouts.registry import open_checkpoint
from reshard.verification.forward.rank_weights import (DecoderConfig, LayerWeights, RankWeights, check_world,
                                                       kv_heads_of_rank, padded_vocab_for, vocab_rows)


def load_rank(path: str, rank: int, world: int, opts: Options) -> RankWeights:
    source = open_checkpoint(path, opts)
    try:
        return _slice(source, rank, world)
    finally:
        source.close()


def _slice(source, rank: int, world: int) -> RankWeights:
    model = source.model
    config = DecoderConfig.from_meaning(model.meaning, model.family.decoder)
    check_world(config, world, model.dims["F"])
    index = CanonicalIndex(source.stored, {name: t.shape for name, t in model.tensors.items()})
    d = config.head_dim

    def read(name: str, axis: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
        tensor = model.tensors[name]
        assert axis == tensor.axis, (name, axis)  # every slice below is along the tensor's split axis
        length = tensor.shape[axis] - start if length is None else length
        shape = tuple(length if i == axis else n for i, n in enumerate(tensor.shape))
        reads = index.reads_for(name, start, start + length, 0)
        return assemble(TargetTensor(name, shape, model.dtypes[name], axis, reads), source.files)

    def maybe(name: str, *args) -> torch.Tensor | None:
        return read(name, *args) if name in model.tensors else None

    q_per = config.heads // world
    kv = kv_heads_of_rank(config.kv_heads, rank, world)
    f_per = model.dims["F"] // world
    q_span = (0, rank * q_per * d, q_per * d)
    kv_span = (0, kv.start * d, len(kv) * d)
    f_span = (0, rank * f_per, f_per)
    layers = []
    for i in range(config.layers):
        p = f"model.layers.{i}."
        layers.append(LayerWeights(
            input_norm=read(p + "input_layernorm.weight"), post_norm=read(p + "post_attention_layernorm.weight"),
            q=read(p + "self_attn.q_proj.weight", *q_span), k=read(p + "self_attn.k_proj.weight", *kv_span),
            v=read(p + "self_attn.v_proj.weight", *kv_span),
            o=read(p + "self_attn.o_proj.weight", 1, rank * q_per * d, q_per * d),
            gate=read(p + "mlp.gate_proj.weight", *f_span), up=read(p + "mlp.up_proj.weight", *f_span),
            down=read(p + "mlp.down_proj.weight", 1, rank * f_per, f_per),
            q_bias=maybe(p + "self_attn.q_proj.bias", *q_span), k_bias=maybe(p + "self_attn.k_proj.bias", *kv_span),
            v_bias=maybe(p + "self_attn.v_proj.bias", *kv_span), o_bias=maybe(p + "self_attn.o_proj.bias"),
            gate_bias=maybe(p + "mlp.gate_proj.bias", *f_span), up_bias=maybe(p + "mlp.up_proj.bias", *f_span),
            down_bias=maybe(p + "mlp.down_proj.bias")))
    padded = padded_vocab_for(config.vocab, world)
    start, real, pad = vocab_rows(config.vocab, padded, rank, world)

    def vocab_slice(name: str) -> torch.Tensor:
        rows = read(name, 0, start, real)
        return torch.cat([rows, rows.new_zeros(pad, config.hidden)]) if pad else rows

    embedding = vocab_slice("model.embed_tokens.weight")
    lm_head = None if model.tied else vocab_slice("lm_head.weight")
    return RankWeights(config=config, rank=rank, world=world, embedding=embedding, vocab_start=start,
                       layers=layers, final_norm=read("model.norm.weight"), lm_head=lm_head, lm_head_start=start,
                       padded_vocab=padded, dtype=embedding.dtype, files=[f.path for f in source.files])
