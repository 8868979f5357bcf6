"""Rank ``r`` of ``world`` from a checkpoint whose data does not depend on a TP degree (Hugging Face, Megatron
``torch_dist``): slice the canonical tensors.

Reads only the rows / columns the rank holds, through the source's canonical index (whatever files and chunks
hold them), by each weight's decoder role: q heads ``[r*nh/w, (r+1)*nh/w)``, KV heads ``[r*ng/w, ...)`` or, when ``w > ng``, KV head
``r // (w/ng)``; gate/up rows and o/down columns by 1/w; the vocab padded to a multiple of ``w`` and split evenly
(padding rows are zeros).
"""

from __future__ import annotations

import torch

from reshard.core.canonical import instance
from reshard.core.plan import CanonicalIndex, TargetTensor
from reshard.errors import ReshardError
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


#: The decoder roles a rank holds part of, by how the part is cut (the others are whole on every rank).
_Q_ROLES, _KV_ROLES = ("q", "q_bias"), ("k", "v", "k_bias", "v_bias")
_F_ROLES, _COLUMN_ROLES = ("gate", "up", "gate_bias", "up_bias"), ("o", "down")


def _slice(source, rank: int, world: int) -> RankWeights:
    model = source.model
    config = DecoderConfig.from_meaning(model.meaning)
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

    q_per = config.heads // world
    kv = kv_heads_of_rank(config.kv_heads, rank, world)
    f_per = model.dims["F"] // world
    meaning = model.meaning
    i_per, s_per = meaning.expert_ffn // world, meaning.shared_expert_ffn // world
    for what, size in (("expert", meaning.expert_ffn), ("shared-expert", meaning.shared_expert_ffn)):
        if size % world:
            raise ReshardError(f"cannot split the {what} intermediate size {size} over {world} ranks: choose "
                               "--nproc dividing it")
    spans = {**dict.fromkeys(_Q_ROLES, (0, rank * q_per * d, q_per * d)),
             **dict.fromkeys(_KV_ROLES, (0, kv.start * d, len(kv) * d)),
             **dict.fromkeys(_F_ROLES, (0, rank * f_per, f_per)),
             "o": (1, rank * q_per * d, q_per * d), "down": (1, rank * f_per, f_per),
             "expert_gate": (0, rank * i_per, i_per), "expert_up": (0, rank * i_per, i_per),
             "expert_down": (1, rank * i_per, i_per), "shared_gate": (0, rank * s_per, s_per),
             "shared_up": (0, rank * s_per, s_per), "shared_down": (1, rank * s_per, s_per)}

    def role_tensors(layer: int | None) -> dict:
        out: dict = {}
        experts: dict[int, dict[str, torch.Tensor]] = {}
        for spec in model.family.weights:
            if spec.role is None or spec.per_layer != (layer is not None):
                continue
            for expert in range(model.num_experts) if spec.per_expert else [None]:
                name = instance(spec.hf, layer, expert)
                if name not in model.tensors:
                    continue
                tensor = read(name, *spans.get(spec.role, ()))
                if spec.per_expert:  # every rank computes its 1/world slice of every expert
                    experts.setdefault(expert, {})[spec.role] = tensor
                else:
                    out[spec.role] = tensor
        if experts:
            out["experts"] = {e: (p["expert_gate"], p["expert_up"], p["expert_down"]) for e, p in experts.items()}
        return out

    layers = [LayerWeights(**role_tensors(i)) for i in range(config.layers)]
    padded = padded_vocab_for(config.vocab, world)
    start, real, pad = vocab_rows(config.vocab, padded, rank, world)
    whole = role_tensors(None)

    def vocab_slice(role: str) -> torch.Tensor:
        spec = model.family.role_spec(role)
        rows = read(spec.hf, 0, start, real)
        return torch.cat([rows, rows.new_zeros(pad, config.hidden)]) if pad else rows

    embedding = vocab_slice("embedding")
    lm_head = None if model.tied else vocab_slice("lm_head")
    return RankWeights(config=config, rank=rank, world=world, embedding=embedding, vocab_start=start,
                       layers=layers, final_norm=whole["final_norm"], lm_head=lm_head, lm_head_start=start,
                       padded_vocab=padded, dtype=embedding.dtype, files=[f.path for f in source.files],
                       final_norm_bias=whole.get("final_norm_bias"),
                       position_embedding=whole.get("position_embedding"))
