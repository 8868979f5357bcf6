"""Mapping files: one TOML file per architecture family declaring every canonical weight.

A weight declares its Hugging Face name template (``{layer}``), its split kind, its pack slot, its shape in
config symbols, whether it is optional or tied, and its name in each layout. The schema is strict: unknown keys,
kinds or symbols are errors that name the file, the key and the nearest valid key.

The package, one concern a module (the names other code uses are re-exported here):

- schema.py: the vocabulary (every table, key, kind and role a file may use) and the unknown-key check;
- weight.py: :class:`WeightSpec`, one declared weight and its name and split in every layout;
- features.py: the parsed ``[decoder]`` and ``[config]`` tables (:class:`DecoderFeatures`, :class:`ConfigSpelling`);
- family.py: :class:`Family`, a parsed file, and what it answers for one config (sparse layers, dims, held weights);
- conditions.py: the expressions inside a file (``when`` conditions, config lookups, shape arithmetic);
- tables.py / weight_entries.py / parsing.py: validating the model-level tables, the ``[[weight]]`` entries (and
  their packs), and the whole file in order;
- defaults.py: config defaults as data (the transformers config classes' defaults a file states);
- shipped.py: the shipped files and the text family of an architecture;
- vlm.py / vlm_config.py / resolve.py: vision-language files composed for one config, a VLM config's flat view,
  and an architecture's family (text, then vision-language).

New vocabulary lands by concern: a table or ``[moe]`` / ``[hf]`` / ``[mtp]`` key in schema.py + tables.py (what it
means for a config in family.py), a per-weight key, split kind or value transform in schema.py + weight.py +
weight_entries.py. ``reshard.mapping_vlm`` and ``reshard.config_defaults`` remain as the old import paths.
"""

from __future__ import annotations

from reshard.mapping.conditions import _parse_condition, config_condition, evaluate, lookup
from reshard.mapping.defaults import check_defaults, parse_table, with_defaults
from reshard.mapping.family import Family
from reshard.mapping.features import ArchitectureConfig, ConfigSpelling, DecoderFeatures
from reshard.mapping.parsing import load_family_file, parse_family
from reshard.mapping.resolve import family_for_architecture, multimodal_architectures, vlm_family, vlm_templates
from reshard.mapping.schema import (ACTIVATIONS, ARCH_CONFIG_KEYS, BIAS_GROUPS, CONFIG_KEYS, DECODER_CHOICES,
                                    DECODER_KEYS, DIM_KEYS, FAMILY_KEYS, GROUP_SCORES, GROUP_SWITCH_KEYS, HF_KEYS,
                                    LAYER_KINDS, LAYER_ROLES, MEGATRON_KEYS, MEGATRON_SPECS, MLA_KEYS, MODEL_ROLES,
                                    MOE_KEYS, MTP_KEYS, PACK_SLOTS, REPLICATED_PACK, ROUTER_SCORES, SPLIT_KINDS,
                                    TOP_KEYS, VLLM_KEYS, WEIGHT_KEYS, WINDOW_SPELLINGS, _check_keys, _suggest)
from reshard.mapping.shipped import (load_shipped, shipped_mapping_names, shipped_mapping_text, shipped_mappings_dir,
                                     text_architectures, text_family_for_architecture)
from reshard.mapping.vlm import Multimodal, compose
from reshard.mapping.vlm_config import flat_view, nested
from reshard.mapping.weight import WeightSpec

__all__ = [
    "ACTIVATIONS", "ARCH_CONFIG_KEYS", "BIAS_GROUPS", "CONFIG_KEYS", "DECODER_CHOICES", "DECODER_KEYS", "DIM_KEYS",
    "FAMILY_KEYS", "GROUP_SCORES", "GROUP_SWITCH_KEYS", "HF_KEYS", "LAYER_KINDS", "LAYER_ROLES", "MEGATRON_KEYS",
    "MEGATRON_SPECS", "MLA_KEYS", "MODEL_ROLES", "MOE_KEYS", "MTP_KEYS", "PACK_SLOTS", "REPLICATED_PACK",
    "ROUTER_SCORES", "SPLIT_KINDS", "TOP_KEYS", "VLLM_KEYS", "WEIGHT_KEYS", "WINDOW_SPELLINGS",
    "ArchitectureConfig", "ConfigSpelling", "DecoderFeatures", "Family", "Multimodal", "WeightSpec",
    "check_defaults", "compose", "config_condition", "evaluate", "family_for_architecture", "flat_view",
    "load_family_file", "load_shipped", "lookup", "multimodal_architectures", "nested", "parse_family", "parse_table",
    "shipped_mapping_names", "shipped_mapping_text", "shipped_mappings_dir", "text_architectures",
    "text_family_for_architecture", "vlm_family", "vlm_templates", "with_defaults",
    "_check_keys", "_parse_condition", "_suggest",
]
