"""Layer, expert and head counts checked against a source's tensor index before anything per layer is built.

A config's counts size every per-layer structure (the canonical tensors, layer types, expert lists, per-head
pieces): a hostile or mistyped ``num_hidden_layers`` of 10^9 would build a 10^9-element table before a weight is
looked at. :func:`check_counts` compares each count with what the stored tensors hold, from their names and
shapes alone, and refuses a count they cannot hold in one line naming the key, its value and what the weights hold.
Pure index arithmetic: no I/O.
"""

from __future__ import annotations

from reshard.core.templates import template_match
from reshard.errors import CheckpointError
from reshard.mapping import with_defaults

#: Weight roles whose stored rows hold one or more rows per head of the dims symbol named.
HEAD_ROLES = (("q", "nh"), ("q_b", "nh"), ("kv_b", "nh"), ("k", "ng"))


def _held(indices: set[int], what: str) -> str:
    return f"{len(indices)} {what} ({min(indices)}..{max(indices)})" if indices else f"no {what}"


def check_counts(family, config: dict, layers: set, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """Refuse a layer, routed-expert or head count of ``config`` that the stored tensors (``shapes``: canonically
    spelt stored name -> shape; ``layers``: the layer indices their names hold) cannot hold: more layers or
    experts than distinct ones stored (a complete checkpoint stores every one), more heads than the projection
    has rows."""
    config = with_defaults(family, config)
    dims = family.resolve_dims(config)

    def refuse(symbol: str, what: str, fix: str = "fix the config (or complete the checkpoint)") -> None:
        key = family.dim_key(symbol, config)
        raise CheckpointError(f"{where}: {key} is {dims[symbol]} but {what}: {fix}")

    held = {layer for layer in layers if layer is not None}
    if dims["L"] > len(held):
        refuse("L", f"the weights hold {_held(held, 'layers')}")
    symbol = family.moe.get("experts")
    if symbol and family.sparse_layers(config, dims["L"]):
        experts, stacked = _experts_held(family, shapes)
        if dims[symbol] > max(len(experts), stacked):
            refuse(symbol, f"the weights hold {_held(experts, 'experts')}" if not stacked else
                   f"the weights stack {stacked} experts")
    first = min(held) if held else None
    for role, symbol in HEAD_ROLES:
        spec = family.role_spec(role)
        shape = shapes.get(spec.hf_name.format(layer=first)) if spec and spec.per_layer and held else None
        if shape is None or symbol not in dims:
            continue
        rows = shape[-1] if spec.hf_transposed else shape[0]  # every head has at least one row
        if dims[symbol] > rows:
            refuse(symbol, f"{spec.hf_name.format(layer=first)} has {rows} rows (at most {rows} heads)",
                   "fix the config")


def check_kv_heads(family, dims: dict[str, int], config: dict) -> None:
    """Refuse more KV heads than attention heads (each KV head serves a group of query heads), whatever layout
    the config came from: every layout's per-group pieces would be built for them (latent attention has none)."""
    if family.mla or "ng" not in dims or "nh" not in dims or dims["ng"] <= dims["nh"]:
        return
    raise CheckpointError(f"the config's KV head count ({family.dim_key('ng', config)}) is {dims['ng']}, more than "
                          f"its {dims['nh']} attention heads ({family.dim_key('nh', config)}): fix the config")


def _experts_held(family, shapes: dict[str, tuple[int, ...]]) -> tuple[set[int], int]:
    """The routed-expert indices the stored per-expert names hold, and the most experts one of transformers 5's
    fused tensors stacks (``[E, ...]``)."""

    held: set[int] = set()
    stacked = 0
    specs = [s for s in family.weights if s.per_expert]
    for name, shape in shapes.items():
        for spec in specs:
            found = template_match(spec.hf_name, name)
            if found is not None and found[1] is not None:
                held.add(found[1])
                break
            if spec.hf_fused and shape and template_match(spec.hf_fused, name) is not None:
                stacked = max(stacked, shape[0])
                break
    return held, stacked
