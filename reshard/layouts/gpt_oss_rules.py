"""gpt-oss's settings beyond the shared config fields, and what each target can express (families-2.md sections 2.3,
2.4 and 17).

Meaning: ``ModelConfig.gpt_oss`` = the sorted items ``swiglu_alpha`` (α, 1.702 as released) and ``swiglu_limit``
(7.0) of the clamped SwiGLU ``(clamp(up, ±limit) + 1) · g·σ(α·g)``, ``g = min(gate, limit)``; None for other
families. The attention sinks, router bias and expert biases are weights (their presence is the mapping's).

Megatron-Core 0.16.1 spells it (Megatron-LM args, as the probe's TransformerConfig): ``quick_geglu`` (``quick_gelu``
= ``y·σ(1.702·y)``, α fixed: any other is refused), ``glu_linear_offset = 1``, ``activation_func_clamp_value =
limit``, ``softmax_type = "learnable"`` (the sinks as ``core_attention.softmax_offset``), yarn RoPE as
``position_embedding_type = "yarn"`` with the ``yarn_*`` attributes ``GPTModel`` reads, and expert-TP 1 (MoE biases).
vLLM 0.32 hard-codes α, the limit, ``rms_norm_eps = 1e-5`` and the window on even layers: other values are refused.
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

from reshard.errors import PlanError
from reshard.layouts import megatron_yarn

ARCHITECTURE = "GptOssForCausalLM"
ALPHA, LIMIT, VLLM_EPS = 1.702, 7.0, 1e-5


def meaning_fields(config: dict, architecture: str) -> dict[str, Any]:
    """``{"gpt_oss": items}`` for a gpt-oss config.json (GptOssConfig's defaults where a key is absent), else {}."""
    if architecture != ARCHITECTURE:
        return {}
    alpha, limit = config.get("swiglu_alpha"), config.get("swiglu_limit")
    return {"gpt_oss": (("swiglu_alpha", float(ALPHA if alpha is None else alpha)),
                        ("swiglu_limit", float(LIMIT if limit is None else limit)))}


def write_hf(c: dict, meaning, loss) -> None:
    """config.json's ``swiglu_alpha`` / ``swiglu_limit`` from the meaning (a gpt-oss meaning for another
    architecture is a loss)."""
    if not meaning.gpt_oss:
        return
    if meaning.architecture != ARCHITECTURE:
        loss.cannot("gpt_oss", dict(meaning.gpt_oss), f"{meaning.architecture} has no clamped SwiGLU")
        return
    c.update(dict(meaning.gpt_oss))


def _alpha(meaning) -> None:
    alpha = dict(meaning.gpt_oss)["swiglu_alpha"]
    if alpha != ALPHA:
        raise PlanError(f"megatron-core's quick_gelu and vLLM's swigluoai fix alpha = {ALPHA}; this checkpoint uses "
                        f"{alpha}.")


def megatron_args(meaning) -> dict[str, Any]:
    """The Megatron-LM args that spell gpt-oss (empty for other families); α other than 1.702 is refused."""
    if not meaning.gpt_oss:
        return {}
    _alpha(meaning)
    # its yarn RoPE: megatron_yarn.megatron_args, as for every standard-attention model
    return dict(swiglu=False, quick_geglu=True, glu_linear_offset=1.0,
                activation_func_clamp_value=dict(meaning.gpt_oss)["swiglu_limit"], softmax_type="learnable")


def args_view(args) -> tuple[Any, dict[str, Any]]:
    """A gpt-oss run's ``args`` as the shared reader knows them (SiLU-gated, plain RoPE, none of the gpt-oss args),
    and the meaning fields those args carried; other runs unchanged and ``{}``."""
    args, fields = megatron_yarn.args_view(args)  # any standard-attention yarn RoPE (its rope_scaling field)
    get = lambda key, default=None: getattr(args, key, default)  # noqa: E731
    if get("softmax_type") != "learnable" or not get("quick_geglu", False):
        return args, fields
    fields["gpt_oss"] = (("swiglu_alpha", ALPHA), ("swiglu_limit", float(get("activation_func_clamp_value") or LIMIT)))
    view = Namespace(**vars(args))
    view.__dict__.update(swiglu=True, quick_geglu=False, glu_linear_offset=0.0, activation_func_clamp_value=None,
                         softmax_type="vanilla", position_embedding_type="rope")
    return view, fields


def check_expert_tp(meaning, etp: int) -> None:
    """megatron-core refuses MoE biases unless expert-TP is 1."""
    if meaning.gpt_oss and etp > 1:
        raise PlanError("megatron-core requires expert_tensor_parallel_size = 1 for MoE biases (gpt-oss experts have "
                        f"biases). Pass --etp 1 (got {etp}).")


def check_vllm(meaning) -> None:
    """What vLLM 0.32's gpt_oss.py hard-codes: refused when the checkpoint differs."""
    if not meaning.gpt_oss:
        return
    _alpha(meaning)
    limit = dict(meaning.gpt_oss)["swiglu_limit"]
    if limit != LIMIT:
        raise PlanError(f"vLLM 0.32 hard-codes swiglu_limit = {LIMIT} for gpt-oss ({limit} here).")
    if meaning.norm_eps != VLLM_EPS:
        raise PlanError(f"vLLM 0.32 hard-codes rms_norm_eps = {VLLM_EPS} for gpt-oss ({meaning.norm_eps} here).")
    windowed = meaning.windowed_layers()
    if windowed != tuple(range(0, meaning.layers, 2)):
        raise PlanError("vLLM 0.32 hard-codes layer_types alternating sliding/full from a sliding layer 0 for gpt-oss "
                        f"(sliding layers {list(windowed)} here).")
