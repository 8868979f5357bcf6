"""Reading a text-family mapping file: TOML to a validated :class:`Family`, table by table (tables.py) and weight
by weight (weight_entries.py), then the family's config defaults checked against the keys it reads (defaults.py).

The schema is strict: unknown keys, kinds or symbols are errors that name the file, the key and the nearest valid
key.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from reshard.errors import MappingError
from reshard.mapping.defaults import check_defaults
from reshard.mapping.family import Family
from reshard.mapping.sections import parse_layers
from reshard.mapping.tables import (check_family_table, check_hf_table, check_mla, check_moe, check_mtp,
                                    check_top_level, parse_config, parse_decoder, parse_dims, parse_megatron,
                                    parse_vllm_scales)
from reshard.mapping.weight_entries import parse_weights


def parse_family(data: dict, source: str) -> Family:
    """Validate a mapping file's TOML data and build a :class:`Family`."""
    check_top_level(data, source)
    fam = data["family"]
    check_family_table(fam, source)
    dims = parse_dims(data["dims"], source)
    extra_state = parse_megatron(data.get("megatron", {}), source)
    vllm = data.get("vllm", {})
    vllm_scales = parse_vllm_scales(vllm, source)
    hf_table = data.get("hf", {})
    check_hf_table(hf_table, source)
    moe = data.get("moe", {})
    check_moe(moe, dims, source)
    mla = data.get("mla", {})
    check_mla(mla, dims, source)
    mtp = data.get("mtp", {})
    check_mtp(mtp, source)
    decoder = parse_decoder(data.get("decoder", {}), source)
    config = parse_config(data.get("config", {}), source, tuple(fam["architectures"]))
    layers = parse_layers(data.get("layers", {}), source)
    weights = parse_weights(data["weight"], source, dims, moe, mtp, layers)
    family = Family(name=fam["name"], description=fam.get("description", ""),
                    architectures=tuple(fam["architectures"]), dims=dims, weights=weights,
                    extra_state=extra_state, source=source, vllm_scales=vllm_scales, decoder=decoder,
                    config=config, hf_ignore=tuple(hf_table.get("ignore", ())), moe=dict(moe),
                    hf_optional_prefix=hf_table.get("optional_prefix", ""),
                    hf_drop_prefix=hf_table.get("drop_prefix", ""),
                    vllm_tied_name=vllm.get("tied_name"), mla=dict(mla), mtp=dict(mtp), layer_kinds=layers)
    check_defaults(family)
    return family


def load_family_file(path: str | Path) -> Family:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise MappingError(f"mapping file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise MappingError(f"{path}: invalid TOML: {exc}") from None
    return parse_family(data, str(path))
