"""Which canonical rows each tensor-parallel rank holds, per split kind (Megatron-Core conventions).

All functions are pure: they take canonical tensors and degrees, and return :class:`Piece` lists along the
stored tensor's split axis.
"""

from __future__ import annotations

from typing import Callable

from reshard.core.canonical import CanonicalModel, CanonicalTensor
from reshard.core.pieces import Piece, StoredTensor, padding
from reshard.core.section_pieces import gated_qkv_pieces, section_pieces
from reshard.errors import PlanError
from reshard.mapping import WeightSpec

# (q, k, v, rank, tp, groups) -> the rank's rows of a fused qkv tensor; the one rule that differs per layout
QkvRule = Callable[[CanonicalTensor, CanonicalTensor, CanonicalTensor, int, int, int], list[Piece]]


def megatron_padded_vocab(vocab: int, tp: int, divisor: int = 128) -> int:
    """Megatron's padded vocab: the next multiple of ``divisor * tp`` (V=128256: 128256 at tp2, 129024 at tp8)."""
    multiple = divisor * tp
    return -(-vocab // multiple) * multiple


def vocab_pieces(tensor: CanonicalTensor, rank: int, tp: int, padded: int) -> list[Piece]:
    """Rank ``rank`` holds padded rows ``[r*Vp/tp, (r+1)*Vp/tp)``; rows at or past the true vocab are zeros."""
    per = padded // tp
    lo, hi = rank * per, (rank + 1) * per
    vocab = tensor.shape[0]
    pieces = []
    if lo < vocab:
        pieces.append(Piece(tensor.name, lo, min(hi, vocab)))
    if hi > vocab:
        pieces.append(padding(hi - max(lo, vocab)))
    return pieces


def even_pieces(tensor: CanonicalTensor, rank: int, tp: int) -> list[Piece]:
    """``column`` (dim 0) and ``row`` (dim 1) splits: a contiguous 1/tp of the split axis."""
    n = tensor.shape[tensor.axis] // tp
    return [Piece(tensor.name, rank * n, (rank + 1) * n)]


def megatron_qkv_pieces(q: CanonicalTensor, k: CanonicalTensor, v: CanonicalTensor, rank: int, tp: int,
                        groups: int) -> list[Piece]:
    """Megatron ``linear_qkv``: for each KV group g of the rank, the group's q heads, then k_g, then v_g.

    Rows are split contiguously, so rank r holds groups ``[r*ng/tp, (r+1)*ng/tp)``; weights and biases alike.
    """
    per_rank = groups // tp
    q_rows = q.shape[0] // groups
    kv_rows = k.shape[0] // groups
    pieces = []
    for g in range(rank * per_rank, (rank + 1) * per_rank):
        pieces.append(Piece(q.name, g * q_rows, (g + 1) * q_rows))
        pieces.append(Piece(k.name, g * kv_rows, (g + 1) * kv_rows))
        pieces.append(Piece(v.name, g * kv_rows, (g + 1) * kv_rows))
    return pieces


def megatron_gate_up_pieces(gate: CanonicalTensor, up: CanonicalTensor, rank: int, tp: int) -> list[Piece]:
    """Megatron ``linear_fc1`` with SwiGLU: rank r holds ``[gate_r; up_r]``."""
    n = gate.shape[0] // tp
    return [Piece(gate.name, rank * n, (rank + 1) * n), Piece(up.name, rank * n, (rank + 1) * n)]


def stage_weights(model: CanonicalModel, layers, first: bool, last: bool, tied_copy: bool):
    """What one pipeline stage holds, in state-dict order: ``(name spec, data spec, global layer, local layer)``
    for the first-stage weights (``first``), every per-layer weight of ``layers``, then the last-stage weights
    (``last``); a tied output layer is the embedding's data under the head's name, and only when ``tied_copy``
    (Megatron keeps the copy only on a last stage that is not also the first; TensorRT-LLM always stores it)."""
    weights = model.family.weights
    if first:
        for spec in weights:
            if spec.stage == "first":
                yield spec, spec, None, None
    for local, layer in enumerate(layers):
        for spec in weights:
            if spec.per_layer:
                yield spec, spec, layer, local
    if last:
        for spec in weights:
            if spec.stage != "last":
                continue
            if spec.tied_to and model.tied:
                if tied_copy:
                    yield spec, next(s for s in weights if s.hf == spec.tied_to), None, None
            else:
                yield spec, spec, None, None


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Global layer indices held by each pipeline stage (even split)."""
    per = num_layers // pp
    return [range(s * per, (s + 1) * per) for s in range(pp)]


def check_megatron_degrees(model: CanonicalModel, tp: int, pp: int) -> None:
    """Refuse degrees Megatron-Core cannot hold this model at, before anything is written."""
    d = model.dims
    if tp < 1 or pp < 1:
        raise PlanError(f"tp and pp must be >= 1 (got tp={tp}, pp={pp})")
    if d["nh"] % tp:
        raise PlanError(f"cannot shard {d['nh']} attention heads over tp={tp}: heads % tp != 0; "
                        f"choose a tp that divides {d['nh']}")
    if d["ng"] % tp:
        raise PlanError(f"Megatron tp={tp} needs num_query_groups % tp == 0, but the model has {d['ng']} KV "
                        f"groups; choose a tp that divides {d['ng']} (tp > groups is not supported)")
    if "F" in d and d["F"] % tp and dense_mlp(model):
        raise PlanError(f"cannot shard intermediate size {d['F']} over tp={tp}; choose a tp that divides it")
    if pp > model.num_layers:
        raise PlanError(f"pp={pp} is more than the model's {model.num_layers} layers; choose pp <= layers")
    if model.num_layers % pp:
        raise PlanError(f"{model.num_layers} layers do not split evenly over pp={pp}; choose a pp that divides "
                        f"{model.num_layers}")


# ------------------------------------------------------------------------------------------ vLLM rules

VLLM_VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def vllm_padded_vocab(vocab: int) -> int:
    """vLLM pads embedding and lm_head rows to a multiple of 64 (then splits them evenly over the ranks)."""
    return -(-vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


def vllm_kv_heads(rank: int, tp: int, groups: int) -> range:
    """KV heads held by vLLM rank ``rank``: ``groups/tp`` contiguous heads, or when tp >= groups the single
    head ``rank // (tp/groups)``, replicated on ``tp/groups`` neighbouring ranks."""
    if tp >= groups:
        head = rank // (tp // groups)
        return range(head, head + 1)
    per = groups // tp
    return range(rank * per, (rank + 1) * per)


def vllm_qkv_pieces(q: CanonicalTensor, k: CanonicalTensor, v: CanonicalTensor, rank: int, tp: int,
                    groups: int) -> list[Piece]:
    """vLLM ``qkv_proj`` of one rank: ``[q_r; k_r; v_r]``, q the rank's contiguous 1/tp of the query heads."""
    q_rows = q.shape[0] // tp
    head_rows = k.shape[0] // groups
    kv = vllm_kv_heads(rank, tp, groups)
    lo, hi = kv.start * head_rows, kv.stop * head_rows
    return [Piece(q.name, rank * q_rows, (rank + 1) * q_rows), Piece(k.name, lo, hi), Piece(v.name, lo, hi)]


def dense_mlp(model: CanonicalModel) -> bool:
    """Whether the model has a dense MLP somewhere (a Mixtral has only experts)."""
    return any(s.role in ("gate", "up") and model.has_spec(s) for s in model.family.weights)


def check_replicating_degrees(model: CanonicalModel, tp: int, engine: str) -> None:
    """Refuse a TP degree an inference engine that repeats KV heads when tp > KV heads (vLLM, TensorRT-LLM)
    cannot run this model at: heads, KV heads and the dense FFN must split or (KV heads) replicate evenly."""
    d = model.dims
    if tp < 1:
        raise PlanError(f"tp must be >= 1 (got {tp})")
    if d["nh"] % tp:
        raise PlanError(f"{engine} needs num_attention_heads % tp == 0, but {d['nh']} heads do not split over "
                        f"tp={tp}; choose a tp that divides {d['nh']}")
    latent = bool(model.family.mla)  # latent attention has no KV heads to split or repeat
    if not latent and tp >= d["ng"] and tp % d["ng"]:
        raise PlanError(f"tp={tp} is more than the {d['ng']} KV heads but not a multiple of them: {engine} "
                        f"replicates KV heads only when tp % num_key_value_heads == 0")
    if not latent and tp < d["ng"] and d["ng"] % tp:
        raise PlanError(f"{d['ng']} KV heads do not split over tp={tp}; choose a tp that divides {d['ng']}")
    if "F" in d and d["F"] % tp and dense_mlp(model):
        raise PlanError(f"cannot shard intermediate size {d['F']} over tp={tp}; choose a tp that divides it")


def check_vllm_degrees(model: CanonicalModel, tp: int, expert_parallel: bool = False) -> None:
    """Refuse a tensor_parallel_size vLLM cannot load this model at, before anything is written."""
    check_replicating_degrees(model, tp, "vLLM")
    if model.num_experts:
        if expert_parallel and model.num_experts < tp:
            raise PlanError(f"--expert-parallel puts {model.num_experts} experts on {tp} ranks: some would hold none; "
                            f"choose tp <= {model.num_experts}")
        ffn = model.meaning.expert_ffn
        if not expert_parallel and ffn % tp:
            raise PlanError(f"vLLM splits each expert's intermediate size {ffn} over tp={tp}: choose a tp dividing "
                            "it, or --expert-parallel (whole experts per rank)")
    elif expert_parallel:
        raise PlanError("--expert-parallel is for Mixture-of-Experts models")
    padded = vllm_padded_vocab(model.vocab_size)
    if padded % tp:
        raise PlanError(f"vLLM pads the vocab {model.vocab_size} to {padded} rows, which do not split over "
                        f"tp={tp}; choose a tp that divides {padded}")


# ------------------------------------------------------------------------------- per-rank stored tensors

def pack_members(model: CanonicalModel, spec: WeightSpec, layer: int | None,
                 name_of: Callable[[WeightSpec], str], expert: int | None = None) -> list[CanonicalTensor] | None:
    """The canonical tensors one stored tensor of ``spec`` holds: the whole pack (weights sharing the fused name
    ``name_of`` gives) for a pack's first slot, ``spec``'s own tensor otherwise; None when the model lacks it or
    ``spec`` is a later slot of a pack (stored with the first)."""
    if spec.slot:
        pack = [s for s in model.family.weights if name_of(s) == name_of(spec)]
        if spec is not pack[0]:
            return None
        members = [model.get(s, layer, expert) for s in pack]
        return None if any(m is None for m in members) else members
    member = model.get(spec, layer, expert)
    return None if member is None else [member]


def rank_slice(name: str, spec: WeightSpec, members: list[CanonicalTensor], rank: int, tp: int, groups: int,
               padded_vocab: int, qkv_rule: QkvRule, kind: str | None = None) -> StoredTensor:
    """Rank ``rank``'s stored tensor ``name`` of ``members`` (one weight, a qkv / gate_up pack, or a pack of
    replicated weights stored whole one after another) by split kind (``kind``: the layout's own, default the
    spec's)."""
    kind = kind or spec.split
    first = members[0]
    if kind == "replicated":
        pieces = [Piece(m.name, 0, m.shape[m.axis]) for m in members]
    elif kind in ("column", "row"):
        pieces = even_pieces(first, rank, tp)
    elif kind == "first_rank":  # whole on rank 0, zeros elsewhere (vLLM gpt-oss w2_bias)
        pieces = [Piece(first.name, 0, first.shape[first.axis]) if rank == 0 else padding(first.shape[first.axis])]
    elif kind == "vocab":
        pieces = vocab_pieces(first, rank, tp, padded_vocab)
    elif kind == "sections":
        pieces = section_pieces(members, rank, tp)
    elif kind == "qkv":
        by_slot = {m.spec.slot: m for m in members}
        gated = by_slot["q"].spec.gated_query and qkv_rule is megatron_qkv_pieces
        pieces = (gated_qkv_pieces if gated else qkv_rule)(by_slot["q"], by_slot["k"], by_slot["v"], rank, tp, groups)
    elif kind == "gate_up" and len(members) == 1:  # stored alone (TensorRT-LLM's mlp.fc / mlp.gate): a column split
        pieces = even_pieces(first, rank, tp)
    elif kind == "gate_up":
        by_slot = {m.spec.slot: m for m in members}
        pieces = megatron_gate_up_pieces(by_slot["gate"], by_slot["up"], rank, tp)
    else:
        raise AssertionError(kind)
    shape = list(first.shape)
    shape[first.axis] = sum(p.length for p in pieces)
    return StoredTensor(name, tuple(shape), first.axis, tuple(pieces))
