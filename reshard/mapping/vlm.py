"""Vision-language mapping files: a text family composed under a prefix, plus a vision tower and projector.

A VLM mapping file has ``[family]``, ``[text]`` (which text family and architecture the language model is, and the
prefixes its names take in each layout), ``[vision]`` (the block count symbol, the Megatron layouts), ``[dims]``
(the tower's dimension symbols, config keys dotted into ``vision_config``), ``[hf]`` (the spellings read and the
transformers-5 spelling written on request) and ``[[tower]]`` weights. :func:`check_vlm_file` validates it;
:func:`compose` binds it to one config (a flat view, vlm_config.py): the text family's weights renamed under the
prefixes, the tower's ``{vblock}`` / ``{ds}`` blocks expanded into first-stage weights, so every layout's code
handles a VLM as a family with more first-stage weights. resolve.py finds the file of an architecture.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from reshard.errors import MappingError, PlanError
from reshard.mapping.conditions import evaluate, lookup
from reshard.mapping.defaults import NESTED, ConfigDefaults, family_defaults, vlm_defaults, with_defaults
from reshard.mapping.family import Family
from reshard.mapping.schema import DIM_KEYS, PACK_SLOTS, SPLIT_KINDS, _check_keys, _suggest
from reshard.mapping.shipped import load_shipped
from reshard.mapping.weight import WeightSpec

VLM_TOP_KEYS = {"family", "text", "vision", "dims", "hf", "megatron", "tower", "config"}
TEXT_KEYS = {"family", "architecture", "config", "hf", "vllm", "megatron"}
VISION_KEYS = {"blocks", "deepstack", "used_blocks", "megatron_default", "megatron_refused", "vllm_data"}
VLM_HF_KEYS = {"read", "v5"}
#: ``[config]``: the config classes of ``text_config`` / ``vision_config`` and their defaults (defaults.py).
VLM_CONFIG_KEYS = {"text_config", "vision_config", "defaults"}
TOWER_KEYS = {"hf", "split", "slot", "shape", "heads", "hf_stored", "hf_transposed", "optional", "vllm",
              "vllm_transposed", "megatron_hf", "split_megatron_hf", "megatron_native", "megatron_native_te",
              "megatron_native_local", "split_native", "absent_in", "megatron_shape",
              "vllm_text_only"}
MEGATRON_VISIONS = ("hf", "native")
ABSENT_LAYOUTS = ("vllm", "megatron_native")


@dataclass(frozen=True)
class Multimodal:
    """What a composed VLM family adds to its text family: the text family and architecture, the used / total
    vision blocks, the Megatron vision layouts (``megatron_default``; ``megatron_refused``: layout -> why) and
    the HF spellings (``read``: (prefix, canonical prefix), first match wins; ``v5``: canonical prefix -> the
    transformers-5 prefix)."""

    text_family: str
    text_architecture: str
    blocks: int
    used_blocks: int
    megatron_default: str
    megatron_refused: tuple[tuple[str, str], ...] = ()
    read: tuple[tuple[str, str], ...] = ()
    v5: tuple[tuple[str, str], ...] = ()
    deepstack: int = 0
    extra_state_native: tuple[tuple[str, tuple[str, ...]], ...] = ()  # megatron spec -> the native tower's
    extra_state_hf: tuple[tuple[str, tuple[str, ...]], ...] = ()  # ... and the HF-module layout's (Gemma 3's)
    vllm_data: bool = False  # vLLM's model supports mm_encoder_tp_mode="data" (the tower whole on every rank)
    defaults: ConfigDefaults = ConfigDefaults()  # the config classes' defaults (the file's, then its text family's)

    def refusal(self, vision: str) -> str | None:
        return dict(self.megatron_refused).get(vision)


# ----------------------------------------------------------------------------------------------- parsing

def is_vlm_data(data: dict) -> bool:
    return "text" in data


def check_vlm_file(data: dict, source: str) -> None:
    """Validate a VLM mapping file's tables (the weights are validated when composed)."""
    _check_keys(source, "the top level", data, VLM_TOP_KEYS)
    for table, valid in (("text", TEXT_KEYS), ("vision", VISION_KEYS), ("hf", VLM_HF_KEYS),
                         ("config", VLM_CONFIG_KEYS)):
        _check_keys(source, f"[{table}]", data.get(table, {}), valid)
    if "family" not in data["text"]:
        raise MappingError(f"{source}: [text] needs family (the text family's mapping name)")
    vision = data.get("vision", {})
    if vision.get("megatron_default", "hf") not in MEGATRON_VISIONS:
        raise MappingError(f"{source}: [vision] megatron_default must be one of {', '.join(MEGATRON_VISIONS)}")
    for sym, entry in data.get("dims", {}).items():
        if not isinstance(entry, dict) or "key" not in entry:
            raise MappingError(f"{source}: dims.{sym} must be a table with a 'key' (and optional 'default')")
        _check_keys(source, f"dims.{sym}", entry, DIM_KEYS)
    for i, w in enumerate(data.get("tower", [])):
        where = f"tower weight #{i + 1} ({w.get('hf', '?')})"
        _check_keys(source, where, w, TOWER_KEYS)
        for required in ("hf", "split", "shape"):
            if required not in w:
                raise MappingError(f"{source}: {where} is missing '{required}'")
        for key in ("split", "split_megatron_hf", "split_native"):
            if key in w and w[key] not in SPLIT_KINDS:
                raise MappingError(f"{source}: {where} {key} '{w[key]}' is unknown{_suggest(w[key], SPLIT_KINDS)}")
        if w["split"] in PACK_SLOTS and w.get("slot") not in PACK_SLOTS[w["split"]]:
            raise MappingError(f"{source}: {where} needs slot one of {', '.join(PACK_SLOTS[w['split']])}")
        if w["split"] == "qkv" and "heads" not in w:
            raise MappingError(f"{source}: {where} is split qkv: name the dims symbol of its head count (heads)")
        for layout in w.get("absent_in", ()):
            if layout not in ABSENT_LAYOUTS:
                raise MappingError(f"{source}: {where} absent_in '{layout}' is not one of {', '.join(ABSENT_LAYOUTS)}")


def extended(data: dict, load) -> dict:
    """A VLM file with ``[family] extends = "NAME"``: NAME's tables, with this file's ``[text]``, ``[vision]``,
    ``[dims]``, ``[megatron]`` and ``[config]`` keys (and ``[config.defaults.*]`` tables) over them, its ``[hf]``
    spelling rules before NAME's (first match wins) and its ``[[tower]]`` weights after NAME's (LLaVA-NeXT: LLaVA
    plus ``image_newline``)."""
    name = data["family"].get("extends")
    if name is None:
        return data
    base = extended(load(name), load)
    merged = {key: dict(base.get(key, {}), **data.get(key, {})) for key in ("text", "vision", "dims", "megatron")}
    own, inherited = data.get("config", {}), base.get("config", {})
    merged["config"] = {**inherited, **own, "defaults": {**inherited.get("defaults", {}), **own.get("defaults", {})}}
    merged["hf"] = {k: data.get("hf", {}).get(k, []) + base.get("hf", {}).get(k, []) for k in VLM_HF_KEYS}
    merged["tower"] = base.get("tower", []) + data.get("tower", [])
    merged["family"] = {k: v for k, v in data["family"].items() if k != "extends"}
    return merged


# ------------------------------------------------------------------------------------------- composition

def _renamer(table: dict[str, str]):
    """A name rewriter for prefix table ``{old prefix: new prefix}`` (longest prefix first)."""
    pairs = sorted(table.items(), key=lambda kv: -len(kv[0]))

    def rename(name: str | None) -> str | None:
        if name is None:
            return None
        for old, new in pairs:
            if name.startswith(old):
                return new + name[len(old):]
        return name

    return rename


def _text_architecture(text: dict, text_family: Family, config: dict, source: str) -> str:
    if "architecture" in text:
        return text["architecture"]
    model_type = (config.get(NESTED) or {}).get("text_config", {}).get("model_type") or config.get("model_type")
    for name, spelling in text_family.config.architectures:
        if spelling.model_type == model_type or model_type in spelling.other_model_types:
            return name
    raise PlanError(f"text_config.model_type '{model_type}' is not a language model reshard knows for "
                    f"{source} (known: {', '.join(s.model_type for _, s in text_family.config.architectures)})")


def used_blocks(config: dict, blocks: int, key: str | None) -> int:
    """The vision blocks whose output is used: all, or (LLaVA's ``vision_feature_layer``: hidden state l is the
    output of block l, negative from the end of ``blocks + 1`` states; a list uses the deepest)."""
    if key is None:
        return blocks
    value = lookup(config, key)
    layers = value if isinstance(value, list) else [value if value is not None else -1]
    return max(blocks + 1 + int(v) if int(v) < 0 else int(v) for v in layers)


def compose(data: dict, source: str, config: dict) -> Family:
    """The family of a VLM mapping file bound to ``config`` (a flat view, :func:`flat_view`)."""
    text = data["text"]
    text_family = load_shipped(text["family"])
    architecture = data["family"]["architectures"][0]
    text_arch = _text_architecture(text, text_family, config, source)
    hf_name = _renamer(text.get("hf", {}))
    vllm_name = _renamer(text.get("vllm", {}))
    prefix = text.get("megatron", "")

    def meg(name: str | None) -> str | None:
        return None if name is None else prefix + name

    renamed = [dataclasses.replace(
        w, hf=hf_name(w.hf), hf_stored=hf_name(w.hf_stored), hf_fused=hf_name(w.hf_fused),
        tied_to=hf_name(w.tied_to), copy_of=hf_name(w.copy_of), vllm=vllm_name(w.vllm_name),
        vllm_unfused=vllm_name(w.vllm_unfused), megatron_te=meg(w.megatron_te), megatron_local=meg(w.megatron_local),
        megatron_sparse=meg(w.megatron_sparse), megatron_grouped=meg(w.megatron_grouped),
        megatron_legacy_grouped=meg(w.megatron_legacy_grouped), trtllm=None, meta=None) for w in text_family.weights]
    dims = dict(text_family.dims)
    for sym, entry in data.get("dims", {}).items():
        key = entry["key"]
        dims[sym] = (key if isinstance(key, str) else tuple(key), entry.get("default"))
    defaults = vlm_defaults(data, source).over(family_defaults(text_family))
    probe = dataclasses.replace(text_family, dims=dims)
    config = with_defaults(probe, config, defaults)
    values = probe.resolve_dims(config)
    vision = data.get("vision", {})
    blocks = values[vision["blocks"]] if "blocks" in vision else 0
    used = used_blocks(config, blocks, vision.get("used_blocks"))
    deepstack = values[vision["deepstack"]] if "deepstack" in vision else 0
    tower = _expand_tower(data.get("tower", []), blocks, used, deepstack, set(dims), source)
    spelling = text_family.config.architecture(text_arch)
    model_type = config.get("model_type") or architecture
    vlm_spelling = dataclasses.replace(spelling, model_type=model_type, other_model_types=())
    extra = {spec: tuple(meg(t) for t in templates) for spec, templates in text_family.extra_state.items()}

    def tower_extra(kind: str):
        return tuple((spec, tuple(_expand_templates(data.get("megatron", {}).get(f"extra_state_{kind}_{spec}", []),
                                                    blocks, deepstack))) for spec in extra)
    groups = tuple((g, tuple(hf_name(t) for t in ts)) for g, ts in text_family.config.bias_groups)
    config_spelling = dataclasses.replace(text_family.config, bias_groups=groups,
                                          architectures=((architecture, vlm_spelling),))
    hf = data.get("hf", {})
    multimodal = Multimodal(
        text_family=text_family.name, text_architecture=text_arch, blocks=blocks, used_blocks=used,
        megatron_default=vision.get("megatron_default", "hf"),
        megatron_refused=tuple(sorted(vision.get("megatron_refused", {}).items())),
        read=tuple((a, b) for a, b in hf.get("read", [])), v5=tuple((a, b) for a, b in hf.get("v5", [])),
        deepstack=deepstack, extra_state_native=tower_extra("native"), extra_state_hf=tower_extra("hf"),
        vllm_data=bool(vision.get("vllm_data", False)), defaults=defaults)
    return dataclasses.replace(
        text_family, name=data["family"]["name"], description=data["family"].get("description", ""),
        architectures=tuple(data["family"]["architectures"]), dims=dims, weights=tuple(tower + renamed),
        extra_state=extra, source=source, vllm_scales=tuple(vllm_name(s) for s in text_family.vllm_scales),
        vllm_tied_name=vllm_name(text_family.vllm_tied_name), config=config_spelling,
        hf_ignore=tuple(hf_name(t) for t in text_family.hf_ignore), hf_optional_prefix="", multimodal=multimodal)


def _expand_templates(templates: list[str], blocks: int, deepstack: int) -> list[str]:
    """``_extra_state`` templates with ``{vblock}`` / ``{ds}`` expanded over every block / DeepStack merger."""
    out = []
    for t in templates:
        if "{vblock}" in t:
            out += [t.replace("{vblock}", str(b)) for b in range(blocks)]
        elif "{ds}" in t:
            out += [t.replace("{ds}", str(k)) for k in range(deepstack)]
        else:
            out.append(t)
    return out


def _expand_tower(entries: list[dict], blocks: int, used: int, deepstack: int, symbols: set[str],
                  source: str) -> list[WeightSpec]:
    """The tower's weights in state-dict order: the entries before the first block weight, each ``{vblock}``
    block (block-major), each ``{ds}`` deepstack merger, then the rest. vLLM builds no block past the used ones
    (megatron-core builds them all, as Megatron-LM's LLaVA examples do)."""
    def placeholder(w):
        return "{vblock}" if "{vblock}" in w["hf"] else "{ds}" if "{ds}" in w["hf"] else None

    kinds = [placeholder(w) for w in entries]
    first = next((i for i, k in enumerate(kinds) if k), len(entries))
    last = max((i for i, k in enumerate(kinds) if k), default=first - 1)
    items = [(w, None, None) for w in entries[:first]]
    for mark, count in (("{vblock}", blocks), ("{ds}", deepstack)):
        block = [w for w, k in zip(entries, kinds) if k == mark]
        items += [(w, mark, i) for i in range(count) for w in block]
    items += [(w, None, None) for w in entries[last + 1:] if not placeholder(w)]
    items += [(w, None, None) for w, k in zip(entries[first:last + 1], kinds[first:last + 1]) if not k]
    return [_tower_spec(w, mark, index, mark == "{vblock}" and index >= used, symbols, source)
            for w, mark, index in items]


def _tower_spec(w: dict, mark: str | None, index: int | None, unused: bool, symbols: set[str],
                source: str) -> WeightSpec:
    def name(template):
        return template if template is None or mark is None else template.replace(mark, str(index))

    for expr in w["shape"]:
        try:
            evaluate(str(expr), {s: 1 for s in symbols})
        except KeyError as exc:
            raise MappingError(f"{source}: tower weight {w['hf']} shape uses unknown symbol {exc}") from None
    hf_module = name(w.get("megatron_hf"))
    absent = tuple(w.get("absent_in", ())) + (("vllm",) if unused else ())
    return WeightSpec(
        hf=name(w["hf"]), split=w["split"], shape=tuple(str(s) for s in w["shape"]), slot=w.get("slot"),
        optional=bool(w.get("optional", False)), stage="first", hf_stored=name(w.get("hf_stored")),
        hf_transposed=bool(w.get("hf_transposed", False)), vllm=name(w.get("vllm")),
        megatron_te=hf_module, megatron_local=hf_module, tower="vision", heads=w.get("heads"),
        vllm_transposed=bool(w.get("vllm_transposed", False)),
        split_megatron_hf=w.get("split_megatron_hf", "replicated"),
        megatron_native_te=name(w.get("megatron_native_te", w.get("megatron_native"))),
        megatron_native_local=name(w.get("megatron_native_local", w.get("megatron_native"))),
        split_native=w.get("split_native"), absent_in=tuple(dict.fromkeys(absent)),
        vllm_text_only=bool(w.get("vllm_text_only", False)),
        megatron_shape=tuple(str(s) for s in w["megatron_shape"]) if "megatron_shape" in w else None)
