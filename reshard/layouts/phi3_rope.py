"""Phi-3's top-level ``original_max_position_embeddings`` (Phi-3-mini-128k, Phi-3.5, Phi-4-mini; families-2.md
section 12).

Phi-3 releases spell the pretraining length beside ``rope_scaling`` = ``{type: longrope, short_factor,
long_factor}``, not inside it; transformers' ``Phi3Config`` moves the top-level value into the RoPE parameters of
a llama3 / yarn / longrope scaling, and it wins over a value the parameters already hold
(``PreTrainedConfig.standardize_rope_params``). longrope uses it twice: the switch from the short to the long
factors (sequence longer than it) and the attention factor ``sqrt(1 + ln(max_pos / original) / ln(original))``.
"""

from __future__ import annotations

from reshard.core.model_config import ModelConfig, normalize_scaling

KEY = "original_max_position_embeddings"
#: the scalings transformers gives the top-level value to (Phi-3's older ``su`` is longrope).
SCALED = ("llama3", "yarn", "longrope", "su")


def read(config: dict, architecture: str, scaling: tuple | None) -> tuple | None:
    """``scaling`` (normalized items) with Phi-3's top-level ``original_max_position_embeddings`` in it."""
    items = dict(scaling or ())
    if architecture != "Phi3ForCausalLM" or config.get(KEY) is None or items.get("rope_type") not in SCALED:
        return scaling
    return normalize_scaling({**items, KEY: int(config[KEY])})


def written(c: dict, meaning: ModelConfig) -> dict:
    """``meaning.scaling`` to write into ``c``: without the pretraining length where ``c`` spells it at the top
    level with the same value and its own RoPE parameters leave it out (the release spelling, kept verbatim)."""
    scaling = meaning.scaling
    source = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if meaning.architecture == "Phi3ForCausalLM" and c.get(KEY) is not None and KEY not in source \
            and scaling.get(KEY) == c[KEY]:
        scaling.pop(KEY)
    return scaling
