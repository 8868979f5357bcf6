"""Command-R (``CohereForCausalLM``) and Command-R7B / Command-A (``Cohere2ForCausalLM``) rules that no mapping
table spells (families-2.md section 8; mappings/cohere.toml, mappings/cohere2.toml).

Both decoders run attention and the MLP in parallel from one bias-free LayerNorm (``x + attn(n(x)) + mlp(n(x))``),
rotate interleaved pairs ``(2i, 2i+1)`` and multiply the logits by ``logit_scale``; Command-R+ adds per-head
LayerNorm q/k norms (``use_qk_norm``: weights ``[heads, head_dim]``, no bias), Cohere2 rotates only on its
sliding-window layers (the full-attention layers are NoPE). The canonical config carries them as
:attr:`ModelConfig.cohere` (sorted items: ``logit_scale``, ``rope_layers`` = ``all`` | ``sliding``); the config.json
keys are kept as the source spells them. Megatron targets are refused with section 17's message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reshard.errors import PlanError

#: the architectures, and where each rotates (Cohere2: only its sliding-window layers).
ROPE_LAYERS = {"CohereForCausalLM": "all", "Cohere2ForCausalLM": "sliding"}
#: CohereConfig's and Cohere2Config's default logit_scale (transformers 5.25; tests/test_family_cohere.py checks).
DEFAULT_LOGIT_SCALE = 0.0625
#: config.json keys these rules carry (beyond the mapping's): never refused as uncarried settings.
CONFIG_KEYS = ("logit_scale",)


def is_cohere(family) -> bool:
    return bool(set(family.architectures) & set(ROPE_LAYERS))


def meaning_fields(config: Mapping, architecture: str) -> dict[str, Any]:
    """``{"cohere": items}`` for a Cohere architecture's HF-style ``config``; empty for any other."""
    if architecture not in ROPE_LAYERS:
        return {}
    scale = config.get("logit_scale")
    items = {"logit_scale": float(DEFAULT_LOGIT_SCALE if scale is None else scale),
             "rope_layers": ROPE_LAYERS[architecture]}
    return {"cohere": tuple(sorted(items.items()))}


def refuse_megatron(meaning) -> None:
    """Section 17: megatron-core has no parallel attention + MLP block and no logit scale."""
    if meaning.cohere:
        scale = dict(meaning.cohere)["logit_scale"]
        raise PlanError(f"Command-R runs attention and MLP in parallel from one norm and multiplies the logits by "
                        f"logit_scale={scale:g}; megatron-core has neither. Convert to hf or vllm.")
