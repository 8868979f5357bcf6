"""Nemotron-H / Mamba2 hybrids in Megatron-Core and vLLM (families-2.md sections 10.2, 10.3 and 17).

Both engines split Mamba heads and whole B/C groups over the tensor-parallel ranks (megatron-core's
``mamba_mixer.py`` asserts it; vLLM would replicate groups instead, ``extra_groups_for_head_shards``), so the group
count must be a multiple of TP. Megatron-LM runs a hybrid as ``MambaModel`` with ``--is-hybrid-model``, the layer
string ``hybrid_override_pattern`` (``M`` Mamba, ``*`` attention, ``-`` MLP) and no position embedding.
"""

from __future__ import annotations

from reshard.errors import PlanError

MAMBA = "mamba"
SYMBOLS = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}


def has_mamba(model) -> bool:
    return MAMBA in (model.mixers or ())


def check_degrees(model, tp: int) -> None:
    """Refuse a TP that does not hold whole Mamba groups per rank."""
    if has_mamba(model):
        groups = model.dims["G"]
        if groups % tp:
            raise PlanError(f"Mamba groups ({groups}) must divide the tensor-parallel size ({tp}).")


def vllm_notes(model) -> list[str]:
    """The plan's word on vLLM's value transform (families-2.md section 14.2 G)."""
    if not has_mamba(model):
        return []
    return ["mixer.A stored as -exp(A_log) in fp32 (vLLM's loader's transform; read back as log(-A): exact for "
            "bf16 / fp16 A_log, within one ulp for fp32)"]


def megatron_args(model) -> dict:
    """Megatron-LM's MambaModel args of a Mamba hybrid (none for other models)."""
    if not has_mamba(model):
        return {}
    dims = model.dims
    return dict(is_hybrid_model=True, hybrid_override_pattern="".join(SYMBOLS[k] for k in model.mixers),
                mamba_state_dim=dims["N"], mamba_head_dim=dims["p"], mamba_num_groups=dims["G"],
                mamba_num_heads=dims["nm"], position_embedding_type="none",
                spec=["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"])
