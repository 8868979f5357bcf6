"""The old import path of config defaults as data, now :mod:`reshard.mapping.defaults` (the mapping files state
them; the package parses and applies them). Import from there."""

from __future__ import annotations

from reshard.mapping.defaults import (NESTED, ROPE_KEYS, SECTIONS, WINDOW_KEYS, ConfigDefaults, Table, check_defaults,
                                      check_vlm_defaults, family_defaults, parse_table, read_keys, vlm_defaults,
                                      with_defaults)

__all__ = ["ConfigDefaults", "NESTED", "ROPE_KEYS", "SECTIONS", "Table", "WINDOW_KEYS", "check_defaults",
           "check_vlm_defaults", "family_defaults", "parse_table", "read_keys", "vlm_defaults", "with_defaults"]
