"""Hybrid layer kinds and named sections (families-2.md section 14.2 A and C; Qwen3-Next's Gated DeltaNet).

``[layers]`` names the config key listing each layer's kind and maps its values to mixer kinds, and (``every``) the
spelling a config without that list has: every ``key``-th layer (1-based; ``default`` when unset) of kind
``value``, the others ``other`` (transformers' Qwen3NextConfig from ``full_attention_interval``)::

    [layers]
    kinds = "layer_types"
    values = { linear_attention = "gdn", full_attention = "attention" }
    every = { key = "full_attention_interval", default = 4, value = "full_attention", other = "linear_attention" }

``pattern`` (Nemotron-H's ``hybrid_override_pattern``): a config key whose string gives one kind per character,
read when the list is absent (``values`` then maps ``M``, ``*``, ``-``).

A weight with ``mixer = "gdn"`` exists only on layers of that kind (two entries may share an HF name when their
mixers differ: the input norm is named by the mixer that fuses it in Megatron).

``sections`` splits a tensor along dim 0 into named sections (``"name:rows"``; rows a dims expression), each split
over the tensor-parallel ranks on its own: rank t holds ``[s0_t; s1_t; ...]`` (split kind ``sections``, per layout
with ``split_vllm`` / ``split_megatron``). With ``section_groups = "G"`` the tensor is G groups, each
``[s0; s1; ...]`` of the per-group rows (HF's ``in_proj_qkvz``: per key head ``[q; k; v; z]``); section i is then
the concatenation over groups of part i. Weights sharing a stored name (a pack by ``slot``) lay their sections
end to end in declaration order (Megatron's GDN ``in_proj`` = ``[q; k; v; z; b; a]``). ``torch_dist`` stores
each section under ``<key>.<name>``. ``megatron_offset``: Megatron stores ``w + offset`` (its zero-centred GDN
norm: -1). ``vllm_transform = "neg_exp"``: vLLM stores ``-exp(w)`` in fp32 (Nemotron-H's ``A``;
reshard/io/mamba_values.py).
"""

from __future__ import annotations

from reshard.errors import MappingError
from reshard.mapping.conditions import _names_in, evaluate

LAYERS_KEYS = {"kinds", "values", "every", "pattern"}  # pattern: a config key of one character per layer
VLLM_TRANSFORMS = ("neg_exp",)
EVERY_KEYS = {"key", "default", "value", "other"}
SECTION_SPLITS = ("column", "row", "replicated", "sections")


def parse_layers(table: dict, source: str) -> dict:
    """The ``[layers]`` table: ``{"kinds": config key, "values": {config value: mixer kind}}`` (empty: none)."""
    if not table:
        return {}
    unknown = set(table) - LAYERS_KEYS
    if unknown:
        raise MappingError(f"{source}: unknown key '{sorted(unknown)[0]}' in [layers] (valid: kinds, values)")
    if not isinstance(table.get("kinds"), str) or not isinstance(table.get("values"), dict) or not table["values"]:
        raise MappingError(f"{source}: [layers] needs kinds (a config key) and values (config value -> mixer kind)")
    every = table.get("every")
    if every is not None and (not isinstance(every, dict) or set(every) != EVERY_KEYS
                              or {every["value"], every["other"]} - set(table["values"])):
        raise MappingError(f"{source}: [layers] every needs key, default, value and other (values it names)")
    return {"kinds": table["kinds"], "values": dict(table["values"]), **({"every": dict(every)} if every else {}),
            **({"pattern": table["pattern"]} if table.get("pattern") else {})}


def check_weight(w: dict, source: str, where: str, dims: dict, layers: dict) -> None:
    """The per-weight keys of this module: a known mixer, layout splits, well-formed sections."""
    if "mixer" in w and w["mixer"] not in set((layers or {}).get("values", {}).values()):
        raise MappingError(f"{source}: {where} mixer '{w['mixer']}' is not a kind [layers] values name")
    for key in ("split_vllm", "split_megatron"):
        if key in w and w[key] not in SECTION_SPLITS:
            raise MappingError(f"{source}: {where} {key} must be one of {', '.join(SECTION_SPLITS)}")
    uses = w.get("split") == "sections" or "sections" in (w.get("split_vllm"), w.get("split_megatron"))
    if uses != bool(w.get("sections")):
        raise MappingError(f"{source}: {where} a sections split needs a sections list (and only it)")
    for entry in w.get("sections", ()):
        name, _, rows = str(entry).partition(":")
        unknown = _names_in(rows) - set(dims)
        if not name or not rows or unknown:
            raise MappingError(f"{source}: {where} section '{entry}' must be 'name:rows' over dims symbols")
    if w.get("vllm_transform", VLLM_TRANSFORMS[0]) not in VLLM_TRANSFORMS:
        raise MappingError(f"{source}: {where} vllm_transform must be one of {', '.join(VLLM_TRANSFORMS)}")
    if "section_groups" in w and w["section_groups"] not in dims:
        raise MappingError(f"{source}: {where} section_groups '{w['section_groups']}' is not a dims symbol")


def spec_fields(w: dict) -> dict:
    """The WeightSpec fields of this module's keys."""
    return dict(mixer=w.get("mixer"), split_vllm=w.get("split_vllm"), split_megatron=w.get("split_megatron"),
                sections=tuple(str(s) for s in w.get("sections", ())), section_groups=w.get("section_groups"),
                megatron_offset=float(w.get("megatron_offset", 0.0)), gated_query=bool(w.get("gated_query")),
                vllm_transform=w.get("vllm_transform"))


def entry_key(w: dict) -> str:
    """What must be unique among entries: the HF name, per mixer kind."""
    return w["hf"] + ("@" + w["mixer"] if "mixer" in w else "")


def section_pack(members) -> bool:
    """Whether weights sharing a stored name are checked here, not as a qkv / gate_up pack: a sections pack (every
    member has sections), or one weight per mixer kind (never on the same layer)."""
    mixers = [m.mixer for m in members]
    return all(m.sections for m in members) or (None not in mixers and len(set(mixers)) == len(mixers))


def layer_mixers(family, config: dict, layers: int) -> tuple[str | None, ...]:
    """Each decoder layer's mixer kind (None for a family without ``[layers]``); an unknown value is refused."""
    table = getattr(family, "layer_kinds", None) or {}
    if not table:
        return ()
    kinds, every = config.get(table["kinds"]), table.get("every")
    if kinds is None and isinstance(config.get(table.get("pattern", "")), str):  # Nemotron-H's "M-M*-..."
        kinds = list(config[table["pattern"]])
    if kinds is None and every:
        step = int(config.get(every["key"]) or every["default"])
        kinds = [every["value"] if (i + 1) % step == 0 else every["other"] for i in range(layers)]
    if not isinstance(kinds, (list, tuple)) or len(kinds) < layers:
        raise MappingError(f"config.json {table['kinds']} must list the kind of each of the {layers} layers")
    out = []
    for value in kinds[:layers]:
        if value not in table["values"]:
            raise MappingError(f"config.json {table['kinds']} has '{value}'; mapping '{family.name}' knows "
                               f"{', '.join(table['values'])}")
        out.append(table["values"][value])
    return tuple(out)


def section_rows(spec, dims: dict[str, int]) -> tuple[tuple[str, int], ...]:
    """``spec``'s sections as (name, rows per group) pairs."""
    out = []
    for entry in spec.sections:
        name, _, rows = entry.partition(":")
        out.append((name, evaluate(rows, dims)))
    return tuple(out)


def group_count(spec, dims: dict[str, int]) -> int:
    return dims[spec.section_groups] if spec.section_groups else 1
