"""Ministral 3's position-dependent query scale (``Ministral3ForCausalLM``; families-2.md sections 12, 17;
mappings/ministral3.toml).

transformers' ``Ministral3Attention`` multiplies the rotated queries by ``1 + beta * ln(1 + floor(pos / n))`` with
``beta = rope_parameters.llama_4_scaling_beta`` and ``n`` the yarn ``original_max_position_embeddings``: the
identity on the first ``n`` positions. Both live in the RoPE parameters, which reshard carries as they are spelt;
megatron-core 0.16.1 has no such scale, so a Megatron target is refused unless ``--max-seq`` (default
``max_position_embeddings``) is at most ``n`` (section 17: as Llama 4's temperature tuning).
"""

from __future__ import annotations

from reshard.errors import PlanError

BETA = "llama_4_scaling_beta"
ORIGINAL = "original_max_position_embeddings"


def query_scale(scaling: dict | None) -> tuple[float, int] | None:
    """(beta, n) where ``scaling`` (the RoPE parameters) sets ``llama_4_scaling_beta`` and the original length."""
    scaling = scaling or {}
    beta = scaling.get(BETA)
    if beta is None or scaling.get(ORIGINAL) is None:
        return None
    return float(beta), int(scaling[ORIGINAL])


def check_megatron_target(model, max_seq: int | None) -> None:
    """Section 17's Megatron refusal for a model with the scale (no-op otherwise)."""
    meaning = model.meaning
    found = query_scale(meaning.scaling) if meaning is not None else None
    if found is None:
        return
    beta, n = found
    if beta == 0.0:  # no scale, but transformers' Ministral3Attention still reads both keys
        raise PlanError(f"Ministral 3's rope_parameters hold llama_4_scaling_beta = 0 and {ORIGINAL} = {n}, which "
                        "transformers' Ministral3Attention needs to run and megatron-core's args cannot record. "
                        "Convert to hf or vllm.")
    length = max_seq if max_seq is not None else meaning.max_positions
    if length is not None and int(length) <= n:
        return
    raise PlanError(f"Ministral 3 scales its queries by 1 + {beta:g} * ln(1 + floor(pos / {n})) "
                    f"(llama_4_scaling_beta); megatron-core 0.16.1 has no such scale, so the converted model matches "
                    f"only on sequences shorter than {n + 1} tokens. Pass --max-seq {n} to accept that.")
