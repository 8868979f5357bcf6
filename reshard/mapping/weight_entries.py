"""The ``[[weight]]`` entries of a mapping file: each entry checked (split and slot, conditions and dtype, shape,
placement in the model, HF storage, Megatron names) and built into a :class:`WeightSpec`; then the checks across
entries (roles given once, references resolved, packs complete in every layout).

A new per-weight key is checked in the function of its concern here (and declared in schema.py and weight.py).
"""

from __future__ import annotations

from reshard.errors import MappingError
from reshard.mapping import sections
from reshard.mapping.conditions import _check_condition, _names_in
from reshard.mapping.schema import (LAYER_KINDS, LAYER_ROLES, MEGATRON_SPECS, MODEL_ROLES, PACK_SLOTS,
                                    REPLICATED_PACK, SPLIT_KINDS, WEIGHT_KEYS, _check_keys, _suggest)
from reshard.mapping.weight import WeightSpec


def parse_weights(entries: list[dict], source: str, dims: dict, moe: dict, mtp: dict,
                  layers: dict | None = None) -> tuple[WeightSpec, ...]:
    """Every ``[[weight]]`` entry, validated alone and together."""
    weights = []
    seen: set[str] = set()
    for i, w in enumerate(entries):
        where = f"weight #{i + 1} ({w.get('hf', '?')})"
        _check_entry(w, source, where)
        _check_split(w, source, where)
        _check_options(w, source, where, mtp)
        _check_shape(w, source, where, dims)
        _check_placement(w, source, where, seen, moe)
        _check_hf_storage(w, source, where)
        sections.check_weight(w, source, where, dims, layers or {})
        seen.add(sections.entry_key(w))
        weights.append(_weight_spec(w, *_megatron_names(w, source, where)))
    _check_roles(weights, source)
    _check_references(weights, source)
    _check_packs(weights, source)
    return tuple(weights)


def _check_entry(w: dict, source: str, where: str) -> None:
    _check_keys(source, where, w, WEIGHT_KEYS)
    for required in ("hf", "split", "shape"):
        if required not in w:
            raise MappingError(f"{source}: {where} is missing '{required}'")


def _check_split(w: dict, source: str, where: str) -> None:
    """A known split kind; a slot exactly where the kind packs (or a replicated pack names one)."""
    if w["split"] not in SPLIT_KINDS:
        raise MappingError(f"{source}: {where} has unknown split '{w['split']}'{_suggest(w['split'], SPLIT_KINDS)}")
    slots = PACK_SLOTS.get(w["split"])
    if slots and w.get("slot") not in slots:
        raise MappingError(f"{source}: {where} needs slot one of {', '.join(slots)} for split '{w['split']}'")
    if not slots and "slot" in w and w["split"] != REPLICATED_PACK and not w.get("sections"):
        raise MappingError(f"{source}: {where} has a slot but split '{w['split']}' does not pack")
    if w.get("split_megatron_local") not in (None, "replicated", "column", "row"):
        raise MappingError(f"{source}: {where} split_megatron_local must be replicated, column or row")


def _check_options(w: dict, source: str, where: str, mtp: dict) -> None:
    """Its ``when`` condition, ``dtype`` and MTP-only keys."""
    if "when" in w:
        _check_condition(source, where, w["when"])
    if w.get("dtype") not in (None, "F32", "BF16", "F16"):
        raise MappingError(f"{source}: {where} dtype must be a safetensors dtype name (F32, BF16, F16)")
    if w.get("layers") == "mtp" and not mtp:
        raise MappingError(f"{source}: {where} is an MTP weight (layers = 'mtp') but the file has no [mtp] table")
    if "copy_of" in w and w.get("layers") != "mtp":
        raise MappingError(f"{source}: {where} copy_of is for the copies MTP layers store (layers = 'mtp')")


def _check_shape(w: dict, source: str, where: str, dims: dict) -> None:
    for expr in w["shape"]:
        unknown = _names_in(str(expr)) - set(dims)
        if unknown:
            sym = sorted(unknown)[0]
            raise MappingError(f"{source}: {where} shape uses unknown symbol '{sym}'{_suggest(sym, dims)}")
    if w["split"] in ("row",) and len(w["shape"]) != 2:
        raise MappingError(f"{source}: {where} is split 'row' but is not 2-D")


def _check_placement(w: dict, source: str, where: str, seen: set[str], moe: dict) -> None:
    """Where the model holds it: in the layer stack or at a stage, once, its role, its layers, its experts."""
    if w.get("stage") not in (None, "first", "last"):
        raise MappingError(f"{source}: {where} stage must be 'first' or 'last'")
    per_layer = "{layer}" in w["hf"]
    if not per_layer and w.get("stage") is None:
        raise MappingError(f"{source}: {where} is outside the layer stack and needs stage = 'first' or 'last'")
    if sections.entry_key(w) in seen:
        raise MappingError(f"{source}: {where} is declared twice")
    role = w.get("role")
    if role is not None and role not in (LAYER_ROLES if per_layer else MODEL_ROLES):
        valid = LAYER_ROLES if per_layer else MODEL_ROLES
        raise MappingError(f"{source}: {where} has unknown role '{role}' for a "
                           f"{'per-layer' if per_layer else 'model-level'} weight{_suggest(role, valid)}")
    if w.get("layers", "all") not in LAYER_KINDS:
        raise MappingError(f"{source}: {where} layers must be one of {', '.join(LAYER_KINDS)}")
    if "{expert}" in w["hf"] and (not moe or not per_layer or w.get("layers") != "sparse"):
        raise MappingError(f"{source}: {where} has an {{expert}} placeholder: it needs a [moe] table, a "
                           "{layer} placeholder and layers = 'sparse'")


def _check_hf_storage(w: dict, source: str, where: str) -> None:
    """How HF stores it: fused with the experts stacked, transposed, or inside another tensor."""
    if "hf_fused" in w and "{expert}" in w["hf_fused"]:
        raise MappingError(f"{source}: {where} hf_fused '{w['hf_fused']}' stacks the experts: no {{expert}}")
    if w.get("vllm_qk_permute", "interleaved_to_half") != "interleaved_to_half":
        raise MappingError(f"{source}: {where} vllm_qk_permute must be 'interleaved_to_half'")
    if w.get("hf_transposed") and len(w["shape"]) != 2:
        raise MappingError(f"{source}: {where} is hf_transposed but is not 2-D")
    if "hf_stored" in w and ("{layer}" in w["hf_stored"]) != ("{layer}" in w["hf"]):
        raise MappingError(f"{source}: {where} hf_stored '{w['hf_stored']}' must have a {{layer}} placeholder "
                           "exactly when its hf name has one")


def _megatron_names(w: dict, source: str, where: str) -> tuple[str | None, str | None]:
    """Its names in Megatron's te and local specs (``megatron`` for both); only an MTP copy has none."""
    te = w.get("megatron_te", w.get("megatron"))
    local = w.get("megatron_local", w.get("megatron"))
    if (te is None or local is None) and not w.get("copy_of"):
        raise MappingError(f"{source}: {where} needs 'megatron' (or both 'megatron_te' and 'megatron_local')")
    return te, local


FUSED_FLAGS = ("hf_fused_on_disk", "hf_fused_transposed", "hf_fused_interleaved", "vllm_interleaved")


def _weight_spec(w: dict, te: str | None, local: str | None) -> WeightSpec:
    return WeightSpec(
        hf=w["hf"], split=w["split"], shape=tuple(str(s) for s in w["shape"]), slot=w.get("slot"),
        optional=bool(w.get("optional", False)), tied_to=w.get("tied_to"), stage=w.get("stage"), role=w.get("role"),
        hf_stored=w.get("hf_stored"), hf_transposed=bool(w.get("hf_transposed", False)),
        layers=w.get("layers", "all"), hf_fused=w.get("hf_fused"),
        megatron_te=te, megatron_local=local, megatron_sparse=w.get("megatron_sparse"),
        megatron_grouped=w.get("megatron_grouped"), megatron_legacy_grouped=w.get("megatron_legacy_grouped"),
        vllm=w.get("vllm"), trtllm=w.get("trtllm"), meta=w.get("meta"), vllm_unfused=w.get("vllm_unfused"),
        when=w.get("when"), split_megatron_local=w.get("split_megatron_local"), dtype=w.get("dtype"),
        hf_shape=tuple(str(s) for s in w["hf_shape"]) if "hf_shape" in w else None,
        copy_of=w.get("copy_of"), **sections.spec_fields(w), vllm_qk_permute=w.get("vllm_qk_permute") == "interleaved_to_half", **{k: bool(w.get(k, False)) for k in FUSED_FLAGS},
    )


def _check_roles(weights: list[WeightSpec], source: str) -> None:
    roles = [(w.role, w.mixer) for w in weights if w.role]
    if len(roles) != len(set(roles)):
        dup = next(r for r, _ in roles if roles.count((r, _)) > 1)
        raise MappingError(f"{source}: role '{dup}' is given to two weights")


def _check_references(weights: list[WeightSpec], source: str) -> None:
    """``tied_to`` and ``copy_of`` name declared weights."""
    names = {w.hf for w in weights}
    for w in weights:
        if w.tied_to and w.tied_to not in names:
            raise MappingError(f"{source}: {w.hf} is tied to unknown weight '{w.tied_to}'")
        if w.copy_of and w.copy_of not in names:
            raise MappingError(f"{source}: {w.hf} is a copy of unknown weight '{w.copy_of}'")


def _check_packs(weights: list[WeightSpec], source: str) -> None:
    """Weights sharing a fused Megatron (or vLLM) name must share a split kind and fill every slot once."""
    namings = [("Megatron", lambda w, s=spec: w.megatron_name(s)) for spec in MEGATRON_SPECS]
    namings.append(("HF", lambda w: w.hf_name))
    if any(w.trtllm for w in weights):
        namings.append(("TensorRT-LLM", lambda w: w.trtllm or w.hf))
    if any(w.vllm for w in weights):
        namings.append(("vLLM", lambda w: w.vllm_name))
    for layout, name_of in namings:
        packs: dict[str, list[WeightSpec]] = {}
        for w in weights:
            if not w.copy_of:  # a copy has no name outside HF
                packs.setdefault(name_of(w), []).append(w)
        for name, members in packs.items():
            if len(members) == 1 and (not members[0].slot or layout in ("HF", "TensorRT-LLM")
                                      or members[0].split == REPLICATED_PACK):
                continue  # HF stores most packed weights unfused, TensorRT-LLM its gate and up apart
            kinds = {m.split for m in members}
            if sections.section_pack(members):
                continue  # sections lay their members end to end, whatever their slots (mapping/sections.py)
            if kinds == {REPLICATED_PACK}:
                if any(not m.slot for m in members) or len({m.slot for m in members}) != len(members):
                    raise MappingError(f"{source}: replicated weights {', '.join(m.hf for m in members)} share "
                                       f"{layout} name '{name}': each needs a slot of its own")
                continue
            if len(kinds) != 1 or next(iter(kinds)) not in PACK_SLOTS:
                raise MappingError(f"{source}: weights {', '.join(m.hf for m in members)} share {layout} name "
                                   f"'{name}' but are not one qkv or gate_up pack")
            slots = sorted(m.slot for m in members)
            if layout == "HF" and [m.slot for m in members] != list(PACK_SLOTS[next(iter(kinds))]):
                raise MappingError(f"{source}: HF fused tensor '{name}' must declare its slots in stored order "
                                   f"{', '.join(PACK_SLOTS[next(iter(kinds))])}")
            if layout == "HF" and len({m.hf_transposed for m in members}) > 1:
                raise MappingError(f"{source}: HF fused tensor '{name}' mixes transposed and plain members")
            if slots != sorted(PACK_SLOTS[next(iter(kinds))]):
                raise MappingError(f"{source}: {layout} pack '{name}' has slots {slots}, needs "
                                   f"{sorted(PACK_SLOTS[next(iter(kinds))])}")
