"""Llama 4 text (``Llama4ForCausalLM``, ``model_type llama4_text``): the per-layer rules a Llama 4 mapping needs,
read from its ``config.json`` (../shared/layouts/families-2.md section 3), the vLLM q/k row permutation (3.3) and
the section 17 refusals, and the hooks that wire them into reshard (mappings/llama4.toml's ``[decoder] variant =
"llama4_rules"``): the canonical config's ``llama4`` field (:func:`meaning_fields`), vLLM's permuted q/k pieces
(:func:`qk_rows_permuted`), the Megatron / vLLM target checks and Megatron's args.

- MoE layers: an explicit ``moe_layers`` list, else ``range(s - 1, L, s)`` for ``s = interleave_moe_layer_step``.
- RoPE layers: ``no_rope_layers[i] == 1`` (1 = RoPE, 0 = NoPE), else every ``no_rope_layer_interval``-th layer
  (1-based) is NoPE. The per-head weightless L2 q/k norm (``use_qk_norm``) and chunked attention act on RoPE layers
  only; temperature tuning (``attn_temperature_tuning``) on NoPE layers only.
- vLLM permutes q/k rows at load from interleaved (Meta, HF) to rotate-half order (``permute_qk_weight_for_rotary``:
  per head ``view(n, d/2, 2, in).transpose(1, 2)``); its stored ``qkv_proj`` rows are the permuted ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..errors import PlanError
from ..mapping.schema import VARIANT_KEYS

if TYPE_CHECKING:
    import torch


def text_config(config: Mapping) -> Mapping:
    """The text model's settings: ``text_config`` of a multimodal ``Llama4ForConditionalGeneration`` config (its
    text tensors are prefixed ``language_model.``), else the config itself."""
    nested = config.get("text_config")
    return nested if isinstance(nested, Mapping) and "num_hidden_layers" in nested else config


def _layers(config: Mapping) -> int:
    return int(config["num_hidden_layers"])


def moe_layers(config: Mapping) -> tuple[int, ...]:
    """The layers whose feed-forward is the MoE (transformers' ``Llama4TextConfig``)."""
    explicit = config.get("moe_layers")
    if explicit is not None:
        return tuple(int(i) for i in explicit)
    step = int(config.get("interleave_moe_layer_step", 1) or 1)
    return tuple(range(step - 1, _layers(config), step))


def rope_layers(config: Mapping) -> tuple[bool, ...]:
    """Per layer, True where RoPE is applied (False: a NoPE layer)."""
    flags = config.get("no_rope_layers")
    if flags:
        if len(flags) != _layers(config):
            raise PlanError(f"no_rope_layers has {len(flags)} entries for {_layers(config)} layers")
        return tuple(bool(int(x)) for x in flags)
    interval = int(config.get("no_rope_layer_interval", 4) or 4)
    return tuple(bool((i + 1) % interval) for i in range(_layers(config)))


def megatron_no_rope_freq(config: Mapping) -> list[int]:
    """megatron-core's ``no_rope_freq`` as a list (1 = skip RoPE on that layer)."""
    return [0 if rope else 1 for rope in rope_layers(config)]


def megatron_moe_layer_freq(config: Mapping) -> list[int]:
    """megatron-core's ``moe_layer_freq`` as a list: its int form means ``i % N == 0``, the opposite phase of
    HF's ``(i + 1) % s == 0``, so it is never written as an int."""
    sparse = set(moe_layers(config))
    return [1 if i in sparse else 0 for i in range(_layers(config))]


def chunked_layers(config: Mapping) -> tuple[bool, ...]:
    """Per layer, True where attention is chunked (``layer_types`` when given, else the RoPE layers while
    ``attention_chunk_size`` is set)."""
    types = config.get("layer_types")
    if types:
        return tuple(t == "chunked_attention" for t in types)
    if not config.get("attention_chunk_size"):
        return tuple(False for _ in range(_layers(config)))
    return rope_layers(config)


def megatron_exact_length(config: Mapping) -> int | None:
    """The longest sequence megatron-core 0.16.1 computes the same as transformers: below the attention chunk
    (chunked layers) and below ``floor_scale`` (temperature tuning is the identity while ``pos + 1 < floor_scale``);
    None when neither feature is active."""
    limits = []
    if any(chunked_layers(config)) and config.get("attention_chunk_size"):
        limits.append(int(config["attention_chunk_size"]))
    if config.get("attn_temperature_tuning") and not all(rope_layers(config)):
        limits.append(int(config.get("floor_scale", 8192)) - 1)
    return min(limits) if limits else None


def check_megatron(config: Mapping, max_seq: int | None) -> None:
    """Section 17: refuse a Megatron target unless ``max_seq`` (default ``max_position_embeddings``) is at most
    what megatron-core computes the same."""
    limit = megatron_exact_length(config)
    if limit is None:
        return
    n = max_seq if max_seq is not None else config.get("max_position_embeddings")
    if n is not None and int(n) <= limit:
        return
    chunk = config.get("attention_chunk_size")
    floor = config.get("floor_scale", 8192)
    raise PlanError(f"Llama 4 uses chunked attention (chunk {chunk}) and attention temperature tuning (floor "
                    f"{floor}); megatron-core 0.16.1 has neither, so the converted model matches only on sequences "
                    f"shorter than {limit + 1} tokens. Pass --max-seq {limit} to accept that.")


def check_vllm(config: Mapping) -> None:
    """Section 17: vLLM 0.32 places MoE layers by ``interleave_moe_layer_step`` only."""
    explicit = config.get("moe_layers")
    if explicit is None:
        return
    step = int(config.get("interleave_moe_layer_step", 1) or 1)
    if tuple(int(i) for i in explicit) != tuple(range(step - 1, _layers(config), step)):
        raise PlanError("vLLM 0.32 places Llama 4 MoE layers by interleave_moe_layer_step only and ignores "
                        f"moe_layers={list(explicit)}.")


def vllm_qk_permute(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF (interleaved-pair) q or k rows ``[n * d, ...]`` to vLLM's rotate-half order: row ``2i + j`` of a head
    becomes row ``j * d/2 + i`` (vLLM's ``permute_qk_weight_for_rotary``)."""
    rest = w.shape[1:]
    return w.reshape(-1, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


def vllm_qk_unpermute(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of :func:`vllm_qk_permute` (reading vLLM back)."""
    rest = w.shape[1:]
    return w.reshape(-1, 2, head_dim // 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


def layer_flags(config: Mapping) -> Sequence[dict]:
    """Per layer: ``rope``, ``qk_norm``, ``chunk`` (size or None), ``temperature`` (bool), ``moe``."""
    rope, chunked, sparse = rope_layers(config), chunked_layers(config), set(moe_layers(config))
    chunk = config.get("attention_chunk_size")
    return [{"rope": rope[i], "qk_norm": bool(config.get("use_qk_norm")) and rope[i],
             "chunk": int(chunk) if chunked[i] and chunk else None,
             "temperature": bool(config.get("attn_temperature_tuning")) and not rope[i], "moe": i in sparse}
            for i in range(_layers(config))]


def megatron_config(config: Mapping) -> tuple[dict, list[bool]]:
    """megatron-core 0.16.1 ``TransformerConfig`` keywords for the Llama 4 text model (families-2.md section 3.2)
    and, per layer, whether its spec puts ``L2Norm`` on q and k (megatron-core's ``qk_l2_norm`` switch covers every
    layer, so the layer spec is built per layer: ``L2Norm`` on RoPE layers, ``IdentityOp`` on NoPE layers)."""
    c = text_config(config)
    nh = int(c["num_attention_heads"])
    kw = {
        "num_layers": _layers(c), "hidden_size": int(c["hidden_size"]), "num_attention_heads": nh,
        "num_query_groups": int(c.get("num_key_value_heads") or nh),
        "kv_channels": int(c.get("head_dim") or int(c["hidden_size"]) // nh),
        "ffn_hidden_size": int(c["intermediate_size_mlp"]), "normalization": "RMSNorm",
        "layernorm_epsilon": float(c.get("rms_norm_eps", 1e-5)), "gated_linear_unit": True,
        "add_bias_linear": bool(c.get("attention_bias", False)), "rotary_interleaved": True,
        "no_rope_freq": megatron_no_rope_freq(c), "moe_layer_freq": megatron_moe_layer_freq(c),
        "num_moe_experts": int(c["num_local_experts"]), "moe_ffn_hidden_size": int(c["intermediate_size"]),
        "moe_router_topk": int(c.get("num_experts_per_tok", 1)), "moe_router_score_function": "sigmoid",
        "moe_apply_probs_on_input": True, "moe_shared_expert_intermediate_size": int(c["intermediate_size"]),
    }
    return kw, [flags["qk_norm"] for flags in layer_flags(c)]


# ---- wiring (mappings/llama4.toml: [decoder] variant = "llama4_rules") ---------------------------------------------

#: The config.json keys the ``llama4`` meaning is read from (carried: a family naming them keeps them).
CONFIG_KEYS = VARIANT_KEYS["llama4_rules"]


def is_llama4(family) -> bool:
    return getattr(family.decoder, "variant", None) == "llama4_rules"


def meaning_fields(config: Mapping, family) -> dict[str, Any]:
    """The canonical config's Llama 4 fields of an HF-style ``config`` (its defaults filled): ``rope_interleaved``
    and ``llama4`` = sorted items of the per-layer rules; empty for another family."""
    if not is_llama4(family):
        return {}
    flags = layer_flags(config)
    chunk = config.get("attention_chunk_size")
    items = {"nope_layers": tuple(i for i, f in enumerate(flags) if not f["rope"]),
             "qk_l2_norm": bool(config.get("use_qk_norm")),
             "chunk": int(chunk) if chunk else None,
             "chunked_layers": tuple(i for i, f in enumerate(flags) if f["chunk"]),
             "temperature": bool(config.get("attn_temperature_tuning")),
             "floor_scale": float(config.get("floor_scale", 8192)), "attn_scale": float(config.get("attn_scale", 0.1))}
    return {"rope_interleaved": True, "llama4": tuple(sorted(items.items()))}


def check_written(meaning, family, loss) -> None:
    """A Llama 4 meaning written in another family's spelling: its per-layer rules are a loss (``loss.cannot``)."""
    if meaning.llama4 and not is_llama4(family):
        loss.cannot("llama4", dict(meaning.llama4), f"{meaning.architecture} has no NoPE layers, L2 q/k norm, "
                    "chunked attention or temperature tuning")


def config_of_meaning(meaning) -> dict:
    """An HF-style config holding the rules of ``meaning.llama4`` (for :func:`layer_flags` and the checks)."""
    rules = dict(meaning.llama4)
    layers = meaning.layers
    return {"num_hidden_layers": layers, "no_rope_layers": [int(i not in rules["nope_layers"]) for i in range(layers)],
            "use_qk_norm": rules["qk_l2_norm"], "attention_chunk_size": rules["chunk"],
            "layer_types": ["chunked_attention" if i in rules["chunked_layers"] else "full_attention"
                            for i in range(layers)],
            "attn_temperature_tuning": rules["temperature"], "floor_scale": _number(rules["floor_scale"]),
            "attn_scale": rules["attn_scale"], "max_position_embeddings": meaning.max_positions}


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def qk_rows_permuted(model, stored):
    """vLLM: ``stored`` with its Llama 4 q / k pieces (``vllm_qk_permute`` weights) marked as rotate-half rows of
    the canonical interleaved heads (:attr:`~reshard.core.pieces.Piece.interleaved` = -head_dim)."""
    specs = {p.canonical: model.tensors[p.canonical].spec for p in stored.pieces if p.canonical in model.tensors}
    if not any(s.vllm_qk_permute for s in specs.values()):
        return stored
    d = model.meaning.head_dim if model.meaning is not None else model.dims["d"]
    return replace(stored, pieces=tuple(replace(p, interleaved=-d) if p.canonical in specs and
                                        specs[p.canonical].vllm_qk_permute else p for p in stored.pieces))


def check_megatron_target(model, max_seq: int | None) -> None:
    """Section 17's Megatron refusal for a Llama 4 model (no-op for other families)."""
    if model.meaning is not None and model.meaning.llama4:
        check_megatron(config_of_meaning(model.meaning), max_seq)


def check_vllm_target(model) -> None:
    """Section 17's vLLM refusal: an explicit ``moe_layers`` that is not ``range(s - 1, L, s)``."""
    if model.meaning is not None and model.meaning.llama4:
        check_vllm({**model.config, "num_hidden_layers": model.meaning.layers,
                    "moe_layers": list(model.meaning.sparse_layers())})


def vllm_notes(model) -> list[str]:
    """The plan's words on a vLLM target: the q/k row permutation (families-2.md section 14.2 G: a transform is
    listed in the plan) and, section 18.5, that vLLM 0.32 takes ``attn_temperature_tuning`` from
    ``generation_config.json`` (default on only when ``max_model_len > 32768``), not from config.json."""
    notes = []
    if any(s.vllm_qk_permute for s in model.family.weights):
        notes.append("q and k rows permuted per head from interleaved to rotate-half order in qkv_proj (vLLM's "
                      "permute_qk_weight_for_rotary; read back un-permuted)")
    rules = dict(model.meaning.llama4 or ()) if model.meaning is not None else {}
    if not (rules.get("temperature") and rules.get("nope_layers")):
        return notes
    return notes + [f"vLLM 0.32 reads Llama 4's attn_temperature_tuning from generation_config.json (default: on only when "
            f"max_model_len > 32768), not from config.json: set it there to match transformers on sequences of "
            f"{_number(rules['floor_scale'])} tokens (floor_scale) or more"]


def megatron_args(meaning) -> dict[str, Any]:
    """Megatron-LM args a Llama 4 model needs beyond the generic ones: the routing weight on the expert input.
    (NoPE layers and the L2 q/k norm live in the args' ``hf_config`` record; megatron-core builds them from
    :func:`megatron_config` with a per-layer spec.)"""
    return {"moe_apply_probs_on_input": True} if meaning.llama4 else {}
