"""The old import path of the vision-language mapping code, now in the :mod:`reshard.mapping` package: vlm.py
(VLM files and their composition), vlm_config.py (a VLM config's flat view) and resolve.py (an architecture's
family). Import from :mod:`reshard.mapping`."""

from __future__ import annotations

from reshard.mapping.defaults import NESTED
from reshard.mapping.resolve import (family_for_architecture, multimodal_architectures, refuse_unknown_multimodal,
                                     vlm_family, vlm_templates)
from reshard.mapping.vlm import (ABSENT_LAYOUTS, MEGATRON_VISIONS, TEXT_KEYS, TOWER_KEYS, VISION_KEYS,
                                 VLM_CONFIG_KEYS, VLM_HF_KEYS, VLM_TOP_KEYS, Multimodal, check_vlm_file, compose,
                                 extended, is_vlm_data, used_blocks)
from reshard.mapping.vlm_config import VLM_OWN, flat_view, nested

__all__ = ["ABSENT_LAYOUTS", "MEGATRON_VISIONS", "NESTED", "TEXT_KEYS", "TOWER_KEYS", "VISION_KEYS", "VLM_CONFIG_KEYS",
           "VLM_HF_KEYS", "VLM_OWN", "VLM_TOP_KEYS", "Multimodal", "check_vlm_file", "compose", "extended",
           "family_for_architecture", "flat_view", "is_vlm_data", "multimodal_architectures", "nested",
           "refuse_unknown_multimodal", "used_blocks", "vlm_family", "vlm_templates"]
