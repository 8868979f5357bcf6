"""Config defaults as data: the values transformers' config classes give the keys a config.json leaves out.

A Hub config.json often leaves keys to its config class (Gemma 3's ``text_config`` has no RoPE bases, head dim or
vocab size; LLaVA's ``text_config`` has little ``LlamaConfig`` does not default). A mapping file states the
defaults of the transformers config classes it reads, for the keys reshard reads: a text family per architecture
(``[config.architectures.Gemma3ForCausalLM.defaults]``: ``rope_theta = 1000000.0``, ``head_dim = 256``, ...), a
vision-language file per ``model_type`` (``[config.defaults.siglip_vision_model]``), with the class each nested
config is built with (``[config] text_config = "gemma3_text"``, or ``{ model_type = "llama", named = true }``
where the nested config's own ``model_type`` picks the class, as LLaVA's does).

:func:`with_defaults` fills each key the source leaves out with its class's default before anything is derived
from the config; a key the source spells, wherever transformers reads it from (``rope_parameters`` included,
``null`` included), always wins. Only constant defaults are stated: one transformers derives from other keys
(Llama's ``head_dim`` = hidden / heads, ``num_key_value_heads`` = heads) is the ``[dims]`` default expression.
Pure data and dict arithmetic: no I/O, no transformers.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass

from reshard.errors import MappingError
from reshard.mapping.conditions import _parse_condition
from reshard.mapping.schema import MULTIPLIER_KEYS, VARIANT_KEYS

#: Where a vision-language model's flat config view keeps the source's nested config.json (vlm_config.py).
NESTED = "__reshard_nested_config__"
#: The nested configs a vision-language file names the class of.
SECTIONS = ("text_config", "vision_config")
#: RoPE keys transformers 5 keeps inside ``rope_parameters`` (per layer type: the full-attention layers').
ROPE_KEYS = ("rope_theta", "partial_rotary_factor")
#: The keys each window spelling reads (schema.py's WINDOW_SPELLINGS).
WINDOW_KEYS = {"all_layers": ("sliding_window",), "typed": ("sliding_window", "sliding_window_pattern"),
               "layer_types": ("sliding_window", "use_sliding_window", "max_window_layers")}

Table = tuple[tuple[str, object], ...]


@dataclass(frozen=True)
class ConfigDefaults:
    """Defaults by ``model_type`` (``tables``) and, for a vision-language model, the class of each nested config
    (``nested``: (section, model_type, named): ``named``, the section's own ``model_type`` picks the class,
    ``model_type`` when it names none)."""

    tables: tuple[tuple[str, Table], ...] = ()
    nested: tuple[tuple[str, str, bool], ...] = ()

    def table(self, model_type) -> dict:
        return dict(dict(self.tables).get(model_type, ()))

    def over(self, other: ConfigDefaults) -> ConfigDefaults:
        """These tables, then ``other``'s for the model types these do not state; these nested classes."""
        mine = {t for t, _ in self.tables}
        return ConfigDefaults(self.tables + tuple(t for t in other.tables if t[0] not in mine), self.nested)


def _suggest(key: str, valid) -> str:
    close = difflib.get_close_matches(key, sorted(valid), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def parse_table(entries, source: str, where: str) -> Table:
    """One defaults table (config key -> the value transformers' class gives it)."""
    if not isinstance(entries, dict):
        raise MappingError(f"{source}: {where} must be a table of config keys and their defaults")
    for key, value in entries.items():
        scalars = value if isinstance(value, list) else [value]
        if not all(isinstance(v, (bool, int, float, str)) for v in scalars):
            raise MappingError(f"{source}: {where} {key} must be a number, string, bool or a list of them (the "
                               "value transformers' config class gives it)")
    return tuple(entries.items())


def vlm_defaults(data: dict, source: str) -> ConfigDefaults:
    """A vision-language file's own ``[config]``: the nested configs' classes and ``[config.defaults.MODEL_TYPE]``
    (its text family's tables come after them, :meth:`ConfigDefaults.over`)."""
    table = data.get("config", {})
    tables = tuple((t, parse_table(e, source, f"[config.defaults.{t}]")) for t, e in table.get("defaults", {}).items())
    nested = []
    for section in SECTIONS:
        entry = table.get(section)
        if entry is None:
            continue
        entry = {"model_type": entry} if isinstance(entry, str) else entry
        if not isinstance(entry, dict) or not isinstance(entry.get("model_type"), str) or \
                set(entry) - {"model_type", "named"}:
            raise MappingError(f"{source}: [config] {section} must be the model_type of the config class transformers "
                               "builds it with, or { model_type = ..., named = true }")
        nested.append((section, entry["model_type"], bool(entry.get("named", False))))
    return ConfigDefaults(tables, tuple(nested))


def family_defaults(family) -> ConfigDefaults:
    """A family's defaults by model_type: a composed vision-language family's, else each architecture's."""
    if family.multimodal is not None:
        return family.multimodal.defaults
    return ConfigDefaults(tuple((arch.model_type, arch.defaults) for _, arch in family.config.architectures
                                if arch.defaults))


def read_keys(family, architecture=None) -> set[str]:
    """The config.json keys a text family's reader takes from a config of ``architecture`` (an
    ArchitectureConfig; None: of any of its architectures)."""
    spelt = family.config
    keys = {k for key, _ in family.dims.values() for k in ((key,) if isinstance(key, str) else key)}
    keys |= {spelt.norm_eps, spelt.activation, spelt.max_positions}
    keys |= {k for k in (spelt.attn_softcap, spelt.final_softcap, spelt.query_scale, spelt.rope_local_theta) if k}
    keys |= {k for k in (getattr(spelt, f) for f in MULTIPLIER_KEYS) if k}
    if family.decoder.position == "rope":
        keys |= set(ROPE_KEYS)
    for _, arch in spelt.architectures:
        if architecture is None or arch is architecture:
            keys |= set(WINDOW_KEYS.get(arch.window, ())) | {k for k, _ in arch.requires}
    moe = family.moe
    keys |= {moe[k] for k in ("top_k", "sparse_step", "dense_layers", "dense_prefix", "groups", "group_topk",
                              "scaling", "sparse_start", "sparse_end") if k in moe}
    if isinstance(moe.get("renormalize"), str):
        keys.add(moe["renormalize"])
    if "group_switch" in moe:
        keys.add(moe["group_switch"]["key"])
    keys |= {_parse_condition(w.when)[0] for w in family.weights if w.when}
    keys |= set(VARIANT_KEYS.get(family.decoder.variant, ())) | ({moe["sparse_list"]} if "sparse_list" in moe else set())
    return {k.removeprefix("count:") for k in keys}


def _check_table(entries: Table, valid: set[str], source: str, where: str, name: str) -> None:
    for key, _ in entries:
        if key not in valid:
            raise MappingError(f"{source}: {where} {key} is not a config key mapping '{name}' reads"
                               f"{_suggest(key, valid)}; state defaults only for the keys it reads")


def check_defaults(family) -> None:
    """Refuse a stated default for a key the architecture does not read (a misspelt key would go unused)."""
    for name, arch in family.config.architectures:
        _check_table(arch.defaults, read_keys(family, arch), family.source,
                     f"[config.architectures.{name}.defaults]", family.name)


def check_vlm_defaults(data: dict, text_family, source: str) -> None:
    """A vision-language file's tables name only keys reshard reads: a nested text class's its text family's, a
    vision class's its ``vision_config.*`` dims keys, the others' (the file's own class) its top-level dims keys
    and the used-blocks key (LLaVA's ``vision_feature_layer``)."""
    defaults = vlm_defaults(data, source)
    keys = [entry["key"] for entry in data.get("dims", {}).values()]
    keys = [k.removeprefix("count:") for key in keys for k in ([key] if isinstance(key, str) else key)]
    valid = {"text_config": read_keys(text_family),
             "vision_config": {k.split(".", 1)[1] for k in keys if k.startswith("vision_config.")},
             None: {k for k in keys if "." not in k} | set(filter(None, [data.get("vision", {}).get("used_blocks")]))}
    kinds = {model_type: section for section, model_type, _ in defaults.nested}
    for model_type, entries in defaults.tables:
        _check_table(entries, valid[kinds.get(model_type)], source, f"[config.defaults.{model_type}]",
                     data["family"]["name"])


def _model_type(family, config: dict) -> str | None:
    """The model_type whose table a text family's ``config`` takes: its own (another model type of an
    architecture, such as Kimi-K2's ``kimi_k2``, takes the architecture's), else its architecture's."""
    named = config.get("model_type")
    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    for arch, spelling in family.config.architectures:
        if named in spelling.other_model_types or (named is None and arch in archs):
            return spelling.model_type
    return named


def _spelt(config: dict, key: str, local_theta: str | None) -> bool:
    """Whether ``config`` spells ``key``: the key itself, or transformers 5's ``rope_parameters`` (flat, or per layer
    type: the full-attention layers' for the RoPE keys, the sliding layers' base for ``local_theta``)."""
    if key in config:
        return True
    params = config.get("rope_parameters")
    if not isinstance(params, dict):
        return False
    per_type = isinstance(params.get("full_attention"), dict) or isinstance(params.get("sliding_attention"), dict)
    if key in ROPE_KEYS:
        return key in ((params.get("full_attention") or {}) if per_type else params)
    return key == local_theta and "rope_theta" in (params.get("sliding_attention") or {})


def _fill(config: dict, table: dict, skip: set[str], local_theta: str | None) -> None:
    for key, value in table.items():
        if key not in skip and not _spelt(config, key, local_theta):
            config[key] = copy.deepcopy(value)


def with_defaults(family, config: dict, defaults: ConfigDefaults | None = None) -> dict:
    """``config`` (an HF config dict, or a vision-language model's flat view) with every key the defaults state
    (``defaults``, else :func:`family_defaults`) and the source leaves out set to its class's default, as a new
    dict. Of a dims symbol's alternative keys (Qwen-MoE's ``num_experts`` / ``num_local_experts``) none is filled
    when one is spelt."""
    defaults = family_defaults(family) if defaults is None else defaults
    if not defaults.tables or not isinstance(config, dict):
        return config
    out = dict(config)
    skip = {k for key, _ in family.dims.values() if not isinstance(key, str) and any(a in config for a in key)
            for k in key}
    local = family.config.rope_local_theta
    if not defaults.nested:
        _fill(out, defaults.table(_model_type(family, config)), skip, local)
        return out
    source = config.get(NESTED) if isinstance(config.get(NESTED), dict) else config  # old flat Qwen2.5-VL: itself
    _fill(out, defaults.table(config.get("model_type")), skip, local)
    for section, model_type, named in defaults.nested:
        own = source.get(section) if isinstance(source.get(section), dict) else {}
        if named and isinstance(own.get("model_type"), str):
            model_type = own["model_type"]
        table = defaults.table(model_type)
        if section == "text_config":  # the flat view holds the text keys at its top
            _fill(out, table, skip, local)
        elif isinstance(out.get(section), dict) and table:
            out[section] = dict(out[section])
            _fill(out[section], table, set(), None)
    return out


__all__ = ["ConfigDefaults", "NESTED", "check_defaults", "check_vlm_defaults", "family_defaults", "parse_table",
           "read_keys", "vlm_defaults", "with_defaults"]
