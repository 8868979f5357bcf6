"""YaRN RoPE for megatron-core's GPT model with standard (non-latent) attention: HF ``rope_scaling`` /
``rope_parameters`` (``rope_type = "yarn"``) <-> Megatron-LM args (families-2.md sections 12, 17).

megatron-core 0.16.1 spells it ``position_embedding_type = "yarn"`` plus the ``yarn_*`` attributes ``GPTModel``
reads (:data:`YARN_ARGS`, ``yarn_mscale``, ``yarn_mscale_all_dim``, ``yarn_correction_range_round_to_int``).
Its ``YarnRotaryEmbedding`` computes what transformers' ``_compute_yarn_parameters`` does, term for term: the same
extrapolated / interpolated inverse frequencies over the whole head, the same correction range (floored / ceiled
when ``truncate``, i.e. ``correction_range_round_to_int``), the same linear ramp; and attention multiplies cos/sin
by ``get_mscale(f, mscale) / get_mscale(f, mscale_all_dim)``, or ``get_mscale(f)`` when either is None.
transformers takes the ratio only when both are set and non-zero, else ``get_mscale(f)`` (mscale 1); beta_fast /
beta_slow fall back to 32 / 1 when unset or zero. So the args written are transformers' effective values, and what
megatron-core cannot say is refused: an explicit ``attention_factor`` other than the derived one, a factor left to
be derived, a partial rotary head (megatron-core's YaRN rotates all ``kv_channels``) or interleaved rotation.
"""

from __future__ import annotations

import math
from argparse import Namespace
from typing import Any

#: HF yarn key -> Megatron-LM arg (the values as they are).
YARN_ARGS = {"factor": "yarn_rotary_scaling_factor", "original_max_position_embeddings":
             "yarn_original_max_position_embeddings", "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow"}
SCALE_ARGS = {"mscale": "yarn_mscale", "mscale_all_dim": "yarn_mscale_all_dim"}
TRUNCATE_ARG = "yarn_correction_range_round_to_int"


def _get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def effective(scaling: dict) -> dict[str, Any]:
    """The Megatron-LM args transformers' yarn parameters amount to (``factor`` must be given)."""
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    both = bool(mscale) and bool(all_dim)
    return {"position_embedding_type": "yarn", YARN_ARGS["factor"]: float(scaling["factor"]),
            YARN_ARGS["original_max_position_embeddings"]: int(scaling["original_max_position_embeddings"]),
            YARN_ARGS["beta_fast"]: float(scaling.get("beta_fast") or 32.0),
            YARN_ARGS["beta_slow"]: float(scaling.get("beta_slow") or 1.0),
            SCALE_ARGS["mscale"]: float(mscale) if both else None,
            SCALE_ARGS["mscale_all_dim"]: float(all_dim) if both else None,
            TRUNCATE_ARG: bool(scaling.get("truncate", True))}


def attention_factor(values: dict) -> float:
    """megatron-core's cos/sin factor for these args (``_yarn_get_concentration_factor``)."""
    factor, mscale, all_dim = (values[YARN_ARGS["factor"]], values[SCALE_ARGS["mscale"]],
                               values[SCALE_ARGS["mscale_all_dim"]])
    if mscale is None or all_dim is None:
        return _get_mscale(factor)
    return float(_get_mscale(factor, mscale) / _get_mscale(factor, all_dim))


def megatron_args(m, loss) -> dict[str, Any]:
    """The args for ``m``'s yarn scaling (standard attention); each setting megatron-core cannot express is a
    loss naming the parameter."""
    scaling = m.scaling
    for key in ("factor", "original_max_position_embeddings"):
        if scaling.get(key) is None:
            loss.cannot("rope_scaling", {key: None}, f"megatron-core's yarn needs an explicit {key}")
            return {}
    if m.rotary_fraction != 1.0:
        loss.cannot("partial_rotary_factor", m.rotary_fraction, "megatron-core's YarnRotaryEmbedding rotates all "
                    "kv_channels")
    if m.rope_interleaved:
        loss.cannot("rope_interleaved", True, "megatron-core's YarnRotaryEmbedding rotates halves, not pairs")
    values = effective(scaling)
    given = scaling.get("attention_factor")
    if given is not None and float(given) != attention_factor(values):
        loss.cannot("rope_scaling", {"attention_factor": given}, "megatron-core derives yarn's cos/sin factor from "
                    f"factor / mscale / mscale_all_dim ({attention_factor(values)!r} here) and takes no explicit one")
    return values


def scaling_from_args(args) -> dict[str, Any] | None:
    """The canonical HF yarn scaling a run's yarn args spell (every key explicit), or None."""
    get = lambda key, default=None: getattr(args, key, default)  # noqa: E731
    if get("position_embedding_type") != "yarn" or get("multi_latent_attention", False):
        return None
    scaling: dict[str, Any] = {"rope_type": "yarn", "truncate": bool(get(TRUNCATE_ARG, True))}
    for key, arg in {**YARN_ARGS, **SCALE_ARGS}.items():
        value = get(arg)
        if value is not None:
            scaling[key] = int(value) if key == "original_max_position_embeddings" else float(value)
    return scaling


def args_view(args) -> tuple[Any, dict[str, Any]]:
    """A yarn run's ``args`` as the shared reader knows them (plain RoPE) and its ``rope_scaling`` field; other
    runs unchanged and ``{}``."""
    scaling = scaling_from_args(args)
    if scaling is None:
        return args, {}
    view = Namespace(**vars(args))
    view.position_embedding_type = "rope"
    return view, {"rope_scaling": tuple(sorted(scaling.items()))}


def same_yarn(recorded: dict, meaning) -> bool:
    """Whether the ``hf_config`` record's yarn spelling means what the args' (standard-attention) yarn in
    ``meaning`` does (then the record's keys, e.g. Ministral 3's ``llama_4_scaling_beta``, are kept verbatim)."""
    read = meaning.scaling
    if meaning.mla or recorded.get("rope_type") != "yarn" or read.get("rope_type") != "yarn":
        return False
    if recorded.get("factor") is None or recorded.get("original_max_position_embeddings") is None:
        return False
    ours, theirs = effective(recorded), effective(read)
    given = recorded.get("attention_factor")
    return ours == theirs and (given is None or float(given) == attention_factor(ours))
