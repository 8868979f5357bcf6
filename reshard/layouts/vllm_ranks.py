"""vLLM ``sharded_state`` naming and per-rank tensors: the file pattern ``model-rank-{rank}-part-{part}.safetensors``
and ``reshard.json``, each canonical weight's vLLM parameter name (the tied embedding under the name vLLM's loader
keeps), the routed experts ``enable_expert_parallel`` places on a rank (contiguous blocks), and the tensors rank
``r`` of TP ``tp`` stores with their shapes (fused ``qkv_proj`` / ``gate_up_proj``, row / column splits, the padded
vocab, the fp32 attention scale scalars). The per-rank forms in full: :mod:`.vllm`'s docstring."""

from __future__ import annotations

import re
from dataclasses import replace

from reshard.core.canonical import CanonicalModel, stored_whole
from reshard.core.pieces import StoredTensor
from reshard.layouts.llama4_rules import qk_rows_permuted
from reshard.core.sharding import pack_members, rank_slice, vllm_qkv_pieces
from reshard.errors import PlanError
from reshard.mapping import WeightSpec


NAME = "vllm"


PATTERN = "model-rank-{rank}-part-{part}.safetensors"


RECORD = "reshard.json"


_FILE = re.compile(r"^model-rank-(\d+)-part-(\d+)\.safetensors$")


SCALE_DTYPE = "F32"


def kept_tied_name(names: list[str], family=None) -> str:
    """Where vLLM keeps tied embeddings: ``ShardedStateLoader._filter_subtensors`` keeps, of tensors sharing one
    storage, the smallest key; a model without an ``lm_head`` module (vLLM 0.32's Gemma 2) has only the embedding,
    which its mapping names (``[vllm] tied_name``)."""
    if family is not None and family.vllm_tied_name:
        return family.vllm_tied_name
    return min(names)


def _check_names(model: CanonicalModel) -> None:
    missing = [s.hf for s in model.family.weights if s.slot and not s.vllm]
    if missing:
        raise PlanError(f"mapping '{model.family.name}' gives no vLLM name for packed weight {missing[0]}; "
                        "add `vllm = ...` to it in the mapping file")


def vllm_name_table(family, holds) -> dict[str, str]:
    """HF template -> vLLM name of every weight of ``family``: the mapping's ``vllm`` name, or its ``vllm_unfused``
    one when another member of its vLLM pack is one the model lacks (``holds(spec)`` False: DeepSeek-V2-Lite has no
    ``q_a_proj``, so vLLM keeps its ``kv_a_proj_with_mqa`` alone under its own name, not in ``fused_qkv_a_proj``)."""
    weights = family.weights
    return {spec.hf: spec.vllm_unfused if spec.vllm_unfused and any(
                not holds(s) for s in weights if s is not spec and s.vllm_name == spec.vllm_name) else spec.vllm_name
            for spec in weights}


def vllm_names(model: CanonicalModel):
    """``spec -> its vLLM name`` in ``model`` (:func:`vllm_name_table`)."""
    names = vllm_name_table(model.family, model.has_spec)
    return lambda spec: names[spec.hf]


def expert_block(experts: int, ranks: int, rank: int) -> range:
    """The routed experts vLLM's ``enable_expert_parallel`` puts on ``rank`` (linear placement): contiguous
    blocks, the first ``experts % ranks`` ranks one more (vLLM's determine_expert_map)."""
    base, rem = divmod(experts, ranks)
    start = rank * base + min(rank, rem)
    return range(start, start + base + (rank < rem))


def rank_tensors(model: CanonicalModel, tp: int, rank: int, padded_vocab: int,
                 expert_parallel: bool = False, tower_whole: bool = False) -> list[StoredTensor]:
    """Every tensor of vLLM rank ``rank``, in vLLM's state-dict order, as pieces (scales as constants). Routed
    experts are stacked per layer (``w13_weight [E, 2I/tp, H]`` = per expert ``[gate_r; up_r]``, ``w2_weight
    [E, H, I/tp]``); with ``expert_parallel`` the rank holds its block of whole experts instead. ``tower_whole``:
    the vision tower as at TP 1 on every rank, under vLLM's fused names (``mm_encoder_tp_mode="data"``)."""
    family = model.family
    name_of = vllm_names(model)
    out: list[StoredTensor] = []
    head_spec = next((s for s in family.weights if s.tied_to), None)
    emb_spec = next((s for s in family.weights if head_spec and s.hf == head_spec.tied_to), None)

    def emit(spec: WeightSpec, layer: int | None, name: str | None = None) -> None:
        if not spec.held_in(NAME):
            return
        groups = model.dims[spec.heads or "ng"]
        template = name or name_of(spec)
        stored_name = template.format(layer=layer) if layer is not None else template
        if spec.per_expert:
            experts = expert_block(model.num_experts, tp, rank) if expert_parallel else range(model.num_experts)
            blocks = []
            for j, e in enumerate(experts):
                members = pack_members(model, spec, layer, name_of, e)
                if members is None:
                    return
                blocks.append(rank_slice(stored_name, spec, members, 0 if expert_parallel else rank,
                                         1 if expert_parallel else tp, groups, padded_vocab, vllm_qkv_pieces))
            first = blocks[0]
            out.append(StoredTensor(stored_name, (len(blocks), *first.shape), first.axis + 1,
                                    tuple(replace(p, block=j) for j, b in enumerate(blocks) for p in b.pieces),
                                    stacked=True, pair_interleaved=first.shape[first.axis] if spec.vllm_interleaved
                                    else 0))  # gpt-oss w13: gate/up alternating within the rank's slice
            return
        members = pack_members(model, spec, layer, name_of)
        if members is None:
            return
        if spec.vllm_transposed:  # kept [in, out] as HF stores it, whole on every rank (Gemma 3's projector)
            out.append(stored_whole(stored_name, members, transposed=True))
            return
        whole = tower_whole and spec.tower
        if spec.vllm_transform:  # Nemotron-H's mixer.A = -exp(A_log), fp32 (reshard/io/mamba_values.py)
            sliced = rank_slice(stored_name, spec, members, rank, tp, groups, padded_vocab, vllm_qkv_pieces)
            out.append(replace(sliced, transform=spec.vllm_transform, dtype="F32"))
            return
        out.append(qk_rows_permuted(model, rank_slice(stored_name, spec, members, 0 if whole else rank,
                                                      1 if whole else tp, groups, padded_vocab, vllm_qkv_pieces,
                                                      spec.split_in(NAME))))

    for spec in family.weights:
        if spec.stage == "first":
            if model.tied and spec is emb_spec:
                emit(spec, None, kept_tied_name([emb_spec.vllm_name, head_spec.vllm_name], family))
            else:
                emit(spec, None)
    for layer in range(model.num_layers):
        for spec in family.weights:
            if spec.per_layer:
                emit(spec, layer)
        for scale in family.vllm_scales if model.mixers[layer:layer + 1] in ((), ("attention",)) else ():
            out.append(StoredTensor(scale.format(layer=layer), (), 0, (), fill=1.0, dtype=SCALE_DTYPE))
    for spec in family.weights:
        if spec.stage == "last" and not (spec.tied_to and model.tied):
            emit(spec, None)
    return out
