"""Which canonical rows each tensor-parallel rank holds, per split kind (Megatron-Core conventions).

All functions are pure: they take canonical tensors and degrees, and return :class:`Piece` lists along the
stored tensor's split axis.
"""

from __future__ import annotations

from reshard.core.canonical import CanonicalModel, CanonicalTensor
from reshard.core.pieces import Piece, padding
from reshard.errors import PlanError


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
    if "F" in d and d["F"] % tp:
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


def check_vllm_degrees(model: CanonicalModel, tp: int) -> None:
    """Refuse a tensor_parallel_size vLLM cannot load this model at, before anything is written."""
    d = model.dims
    if tp < 1:
        raise PlanError(f"tp must be >= 1 (got {tp})")
    if d["nh"] % tp:
        raise PlanError(f"vLLM needs num_attention_heads % tp == 0, but {d['nh']} heads do not split over "
                        f"tp={tp}; choose a tp that divides {d['nh']}")
    if tp >= d["ng"] and tp % d["ng"]:
        raise PlanError(f"tp={tp} is more than the {d['ng']} KV heads but not a multiple of them: vLLM "
                        f"replicates KV heads only when tp % num_key_value_heads == 0")
    if tp < d["ng"] and d["ng"] % tp:
        raise PlanError(f"{d['ng']} KV heads do not split over tp={tp}; choose a tp that divides {d['ng']}")
    if "F" in d and d["F"] % tp:
        raise PlanError(f"cannot shard intermediate size {d['F']} over tp={tp}; choose a tp that divides it")
    padded = vllm_padded_vocab(model.vocab_size)
    if padded % tp:
        raise PlanError(f"vLLM pads the vocab {model.vocab_size} to {padded} rows, which do not split over "
                        f"tp={tp}; choose a tp that divides {padded}")
