"""The model-level tables of a mapping file, each validated (and built) by its own function: ``[family]``,
``[dims]``, ``[megatron]``, ``[vllm]``, ``[hf]``, ``[moe]``, ``[mla]``, ``[mtp]``, ``[decoder]`` and ``[config]``.

parsing.py calls them in file order; a new table (or a new key of one) is validated here, against schema.py.
"""

from __future__ import annotations

from reshard.errors import MappingError
from reshard.mapping.defaults import parse_table
from reshard.mapping.features import ArchitectureConfig, ConfigSpelling, DecoderFeatures
from reshard.mapping.schema import (ACTIVATIONS, ARCH_CONFIG_KEYS, BIAS_GROUPS, CONFIG_KEYS, DECODER_CHOICES,
                                    DECODER_KEYS, DIM_KEYS, FAMILY_KEYS, GROUP_SCORES, GROUP_SWITCH_KEYS, HF_KEYS,
                                    MEGATRON_KEYS, MEGATRON_SPECS, MLA_KEYS, MOE_KEYS, MTP_KEYS, MULTIPLIER_KEYS,
                                    ROUTER_SCORES,
                                    TOP_KEYS, VLLM_KEYS, WINDOW_SPELLINGS, _check_keys, _suggest)


def check_top_level(data: dict, source: str) -> None:
    """The file's tables are known ones and it has ``[family]``, ``[dims]`` and ``[[weight]]``."""
    _check_keys(source, "the top level", data, TOP_KEYS)
    for required in ("family", "dims", "weight"):
        if required not in data:
            raise MappingError(f"{source}: missing [{required}] table")


def check_family_table(fam: dict, source: str) -> None:
    _check_keys(source, "[family]", fam, FAMILY_KEYS)
    if "name" not in fam or not fam.get("architectures"):
        raise MappingError(f"{source}: [family] needs 'name' and a non-empty 'architectures' list")


def parse_dims(table: dict, source: str) -> dict[str, tuple[str, str | None]]:
    """symbol -> (its config key, or a tuple of alternative keys; its default expression or None)."""
    dims: dict[str, tuple[str, str | None]] = {}
    for sym, entry in table.items():
        if not isinstance(entry, dict) or "key" not in entry:
            raise MappingError(f"{source}: dims.{sym} must be a table with a 'key' (and optional 'default')")
        _check_keys(source, f"dims.{sym}", entry, DIM_KEYS)
        key = entry["key"]
        if not (isinstance(key, str) or (isinstance(key, list) and key and all(isinstance(k, str) for k in key))):
            raise MappingError(f"{source}: dims.{sym} key must be a config key or a list of alternatives")
        dims[sym] = (key if isinstance(key, str) else tuple(key), entry.get("default"))
    return dims


def parse_megatron(meg: dict, source: str) -> dict[str, tuple[str, ...]]:
    """``[megatron]``: megatron spec -> its ``_extra_state`` templates."""
    _check_keys(source, "[megatron]", meg, MEGATRON_KEYS)
    return {spec: tuple(meg.get(f"extra_state_{spec}", ())) for spec in MEGATRON_SPECS}


def parse_vllm_scales(vllm: dict, source: str) -> tuple[str, ...]:
    """``[vllm]`` checked; its ``attention_scales`` (per-layer names)."""
    _check_keys(source, "[vllm]", vllm, VLLM_KEYS)
    vllm_scales = tuple(vllm.get("attention_scales", ()))
    for name in vllm_scales:
        if "{layer}" not in name:
            raise MappingError(f"{source}: [vllm] attention_scales entry '{name}' needs a {{layer}} placeholder")
    return vllm_scales


def check_hf_table(hf_table: dict, source: str) -> None:
    _check_keys(source, "[hf]", hf_table, HF_KEYS)


def check_moe(moe: dict, dims: dict, source: str) -> None:
    """``[moe]``: its dims symbols declared, its routing choices known, its paired keys together."""
    _check_keys(source, "[moe]", moe, MOE_KEYS)
    for key in ("experts", "expert_ffn", "shared_ffn", "shared_count"):
        if key in moe and moe[key] not in dims:
            raise MappingError(f"{source}: [moe] {key} must name a dims symbol{_suggest(str(moe[key]), dims)}")
    if moe and not {"experts", "expert_ffn", "top_k"} <= set(moe):
        raise MappingError(f"{source}: [moe] needs experts, expert_ffn (dims symbols) and top_k (a config key)")
    if moe.get("score", "softmax") not in ROUTER_SCORES:
        raise MappingError(f"{source}: [moe] score '{moe['score']}' is not one of {', '.join(ROUTER_SCORES)}")
    if moe.get("group_score", "top2_sum") not in GROUP_SCORES:
        raise MappingError(f"{source}: [moe] group_score '{moe['group_score']}' is not one of "
                           f"{', '.join(GROUP_SCORES)}")
    if ("groups" in moe) != ("group_topk" in moe):
        raise MappingError(f"{source}: [moe] groups and group_topk go together (the config keys of group-limited "
                           "routing)")
    if "group_switch" in moe:
        switch = moe["group_switch"]
        if not isinstance(switch, dict) or set(switch) != GROUP_SWITCH_KEYS:
            raise MappingError(f"{source}: [moe] group_switch must be a table with key, on and off")
    if "shared_ffn" in moe and "shared_count" in moe:
        raise MappingError(f"{source}: [moe] shared_ffn and shared_count are two ways to say one width: keep one")


def check_mla(mla: dict, dims: dict, source: str) -> None:
    """``[mla]``: every key, each naming a dims symbol."""
    _check_keys(source, "[mla]", mla, MLA_KEYS)
    if mla and set(mla) != MLA_KEYS:
        raise MappingError(f"{source}: [mla] needs {', '.join(sorted(MLA_KEYS - set(mla)))}")
    for key, symbol in mla.items():
        if symbol not in dims:
            raise MappingError(f"{source}: [mla] {key} must name a dims symbol{_suggest(str(symbol), dims)}")


def check_mtp(mtp: dict, source: str) -> None:
    _check_keys(source, "[mtp]", mtp, MTP_KEYS)
    if mtp and not isinstance(mtp.get("layers"), str):
        raise MappingError(f"{source}: [mtp] layers must name the config key of the MTP layer count")


def parse_decoder(table: dict, source: str) -> DecoderFeatures:
    _check_keys(source, "[decoder]", table, DECODER_KEYS)
    for key, choices in DECODER_CHOICES.items():
        if key in table and table[key] not in choices:
            raise MappingError(f"{source}: [decoder] {key} = '{table[key]}' is not a decoder feature"
                               f"{_suggest(str(table[key]), choices)}")
    if "activation" in table and table["activation"] not in ACTIVATIONS:
        raise MappingError(f"{source}: [decoder] activation '{table['activation']}' is not one the decoder "
                           f"implements{_suggest(str(table['activation']), ACTIVATIONS)}")
    return DecoderFeatures(**table)


def parse_config(table: dict, source: str, architectures: tuple[str, ...]) -> ConfigSpelling:
    _check_keys(source, "[config]", table, CONFIG_KEYS)
    groups = table.get("bias_groups", {})
    _check_keys(source, "[config.bias_groups]", groups, set(BIAS_GROUPS))
    archs = [(name, _parse_architecture(name, entry, source, architectures, groups))
             for name, entry in table.get("architectures", {}).items()]
    return ConfigSpelling(norm_eps=table.get("norm_eps", "rms_norm_eps"),
                          activation=table.get("activation", "hidden_act"),
                          max_positions=table.get("max_positions", "max_position_embeddings"),
                          **{k: table.get(k) for k in ("attn_softcap", "final_softcap", "query_scale",
                                                       "rope_local_theta", *MULTIPLIER_KEYS)},
                          bias_groups=tuple((g, tuple(w)) for g, w in groups.items()),
                          architectures=tuple(archs))


def _parse_architecture(name: str, entry: dict, source: str, architectures: tuple[str, ...],
                        groups: dict) -> ArchitectureConfig:
    """One ``[config.architectures.NAME]`` table."""
    where = f"[config.architectures.{name}]"
    if name not in architectures:
        raise MappingError(f"{source}: {where} is not one of the family's architectures"
                           f"{_suggest(name, architectures)}")
    _check_keys(source, where, entry, ARCH_CONFIG_KEYS)
    if "model_type" not in entry:
        raise MappingError(f"{source}: {where} needs a model_type")
    biases = entry.get("biases", {})
    _check_keys(source, f"{where} biases", biases, set(groups))
    if entry.get("window", "none") not in WINDOW_SPELLINGS:
        raise MappingError(f"{source}: {where} window '{entry['window']}' is not a spelling reshard reads"
                           f"{_suggest(str(entry['window']), WINDOW_SPELLINGS)}")
    return ArchitectureConfig(model_type=entry["model_type"], biases=tuple(sorted(biases.items())),
                              other_model_types=tuple(entry.get("other_model_types", ())),
                              window=entry.get("window", "none"),
                              rotary_fraction=bool(entry.get("rotary_fraction", False)),
                              requires=tuple(sorted(entry.get("requires", {}).items())),
                              window_pattern=entry.get("window_pattern"),
                              defaults=parse_table(entry.get("defaults", {}), source, f"{where[:-1]}.defaults]"))
