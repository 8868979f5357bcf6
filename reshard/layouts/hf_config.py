"""config.json <-> :class:`~reshard.core.model_config.ModelConfig`, for every layout that writes a config.json
(hf, vllm) and for the ``hf_config`` Megatron args record.

Reads both spellings: transformers 5 (``rope_parameters`` = ``{rope_type, rope_theta, <params>,
partial_rotary_factor}``) and transformers 4 (``rope_theta`` + ``rope_scaling`` with ``rope_type`` or the older
``type``, ``partial_rotary_factor``). Writes the spelling of the config it starts from (transformers 4 when there
is none: both versions read it). Which weights are biases, which config key switches them and how a sliding
window is spelt per architecture come from the family's ``[config]`` table; what an architecture cannot spell is
a :class:`~reshard.core.model_config.ConfigLoss` (refused at plan time), never dropped. RoPE and sliding-window
spellings: :mod:`.hf_config_rope`; MoE keys: :mod:`.hf_config_moe`.
"""

from __future__ import annotations

import json

from reshard.core.model_config import UNCARRIED_SETTINGS, ConfigLoss, ModelConfig
from reshard.errors import CheckpointError, PlanError
from reshard.layouts import gpt_oss_rules
from reshard.layouts.hf_config_moe import read_moe, write_moe
from reshard.layouts.hf_config_rope import (LAYER_TYPES, _local_theta, _rope, _window, _write_local_theta,
                                            _write_rope, _write_window)
from reshard.layouts import phi3_rope
from reshard.layouts import cohere_rules
from reshard.layouts import llama4_rules
from reshard.layouts import ernie_rules
from reshard.layouts import qwen3_next_mtp
from reshard.mapping import ACTIVATIONS, BIAS_GROUPS, Family, with_defaults
from reshard.mapping.schema import MULTIPLIER_KEYS

#: The decoder's activation names -> the hidden_act transformers spells them with.
HIDDEN_ACT = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu", "relu2": "relu2"}


#: ModelConfig dims and the mapping's dimension symbols that hold them.
DIM_FIELDS = (("hidden", "H"), ("ffn", "F"), ("layers", "L"), ("heads", "nh"), ("kv_heads", "ng"), ("vocab", "V"))


def uncarried_settings(config: dict, family: Family) -> list[tuple[str, object]]:
    """(key, value) of each setting in ``config`` that changes the computation and that ``family``'s mapping does
    not carry (:data:`~reshard.core.model_config.UNCARRIED_SETTINGS`)."""
    spelt = family.config
    named = {getattr(spelt, f) for f in ("norm_eps", "activation", "max_positions", "attn_softcap", "final_softcap",
                                         "query_scale", "rope_local_theta", *MULTIPLIER_KEYS)}
    named.update(key for _, arch in spelt.architectures for key, _ in arch.requires)
    named.update(family.condition_keys())  # a key switching weights on (GLM-4.5's use_qk_norm) is carried
    named.update(cohere_rules.CONFIG_KEYS if cohere_rules.is_cohere(family) else ())
    named.update(llama4_rules.CONFIG_KEYS if llama4_rules.is_llama4(family) else ())
    return [(key, config[key]) for key, neutral in UNCARRIED_SETTINGS.items()
            if key not in named and config.get(key) is not None and config[key] != neutral]


def without_dropped_settings(config: dict, family: Family, allowed: tuple[str, ...]) -> tuple[dict, list[str]]:
    """``config`` less the uncarried settings ``--allow-lossy-config`` names (:func:`uncarried_settings`), and a
    note for each dropped."""
    dropped = [(key, value) for key, value in uncarried_settings(config, family) if key in allowed]
    kept = {k: v for k, v in config.items() if k not in dict(dropped)}
    return kept, [f"dropped {key} = {json.dumps(value)} from the config ({family.name} does not carry it; "
                  "--allow-lossy-config)" for key, value in dropped]


def read_meaning(config: dict, family: Family, architecture: str, dims: dict[str, int], present: set[str],
                 tied: bool, where: str) -> ModelConfig:
    """The meaning of an HF-style ``config`` whose weights include the optional templates ``present``, read with
    its config class's defaults (mapping/defaults.py); a setting the family does not carry
    (:func:`uncarried_settings`) is refused."""
    config = with_defaults(family, config)
    uncarried = uncarried_settings(config, family)
    if uncarried:
        key, value = uncarried[0]
        raise PlanError(f"{where}: config.json sets {key} = {json.dumps(value)}, which changes what the model "
                        f"computes and which mapping '{family.name}' ({architecture}) does not carry: the output "
                        f"would compute a different function. Pass --allow-lossy-config {key} to drop it knowingly")
    spelling = family.config.architecture(architecture)
    for key, wanted in spelling.requires if spelling else ():
        if config.get(key) is not None and config[key] != wanted:
            raise CheckpointError(f"{where}: config.json sets {key} = {json.dumps(config[key])}, which changes what "
                                  f"{architecture} computes and which reshard does not carry (it needs "
                                  f"{json.dumps(wanted)}); converting it would silently compute another function")
    position = family.decoder.position
    theta, scaling, fraction = _rope(config, where) if position == "rope" else (10000.0, None, 1.0)
    scaling = phi3_rope.read(config, architecture, scaling)
    biases = {}
    for group, templates in family.config.bias_groups:
        found = [family.holds(t, present) for t in templates]
        if any(found) and not all(found):
            missing = [t for t, f in zip(templates, found) if not f]
            raise CheckpointError(f"{where}: the {group} biases are partly present ({missing[0]} is missing): "
                                  "the weights are incomplete")
        biases[group] = all(found)
    window, windowed = _window(config, spelling.window if spelling else "none", dims["L"],
                               spelling.window_pattern if spelling else None)
    act = config.get(family.config.activation) or family.decoder.activation
    spelt = family.config

    def value(key: str | None) -> float | None:
        return float(config[key]) if key and config.get(key) is not None else None

    mla = {field: dims[family.mla[key]] for field, key in MLA_FIELDS} if family.mla else {}
    head_dim = mla.pop("head_dim") if mla else dims.get("d", dims["H"] // dims["nh"])
    return ModelConfig(
        architecture=architecture, hidden=dims["H"], layers=dims["L"], heads=dims["nh"],
        kv_heads=dims.get("ng", dims["nh"]), head_dim=head_dim, ffn=dims.get("F", 0),
        vocab=dims["V"], max_positions=config.get(family.config.max_positions), norm=family.decoder.norm,
        norm_eps=float(config.get(family.config.norm_eps, 1e-6)), activation=ACTIVATIONS.get(act, act),
        rope_theta=theta, rope_scaling=scaling, rotary_fraction=fraction, sliding_window=window,
        sliding_layers=windowed, qkv_bias=biases.get("qkv", False), o_bias=biases.get("o", False),
        mlp_bias=biases.get("mlp", False), tied=tied, position=position,
        gated_mlp=family.decoder.mlp == "gated", qk_norm=family.has_role("q_norm", config),
        norm_offset=family.decoder.norm_offset, embedding_scaled=family.decoder.embedding_scaled,
        sandwich_norm=family.role_spec("attn_output_norm") is not None, attn_softcap=value(spelt.attn_softcap),
        final_softcap=value(spelt.final_softcap), query_scale=value(spelt.query_scale),
        rope_local_theta=_local_theta(config, family, theta, where) if position == "rope" else None,
        mtp_layers=family.mtp_count(config), **_read_multipliers(value, spelt), **mla,
        **read_moe(config, family, dims, present, where), **cohere_rules.meaning_fields(config, architecture),
        **llama4_rules.meaning_fields(config, family), **ernie_rules.meaning_fields(family),
        **gpt_oss_rules.meaning_fields(config, architecture))


def _read_multipliers(value, spelt) -> dict:
    """Granite's multipliers the family spells (:data:`~reshard.mapping.schema.MULTIPLIER_KEYS`), where set."""
    found = {field: value(getattr(spelt, field)) for field in MULTIPLIER_KEYS}
    return {field: v for field, v in found.items() if v is not None}


def _write_multipliers(c: dict, meaning: ModelConfig, family: Family, loss: ConfigLoss) -> None:
    """Granite's multipliers under the keys the family spells, or the loss of each set one it cannot spell."""
    for field in MULTIPLIER_KEYS:
        key, value = getattr(family.config, field), getattr(meaning, field)
        neutral = None if field == "attention_multiplier" else 1.0
        if key:
            if value is not None:
                c[key] = value
        elif value != neutral:
            loss.cannot(field, value, f"{meaning.architecture} has no {field}")


#: ModelConfig's multi-head latent attention fields and the [mla] keys naming their dims symbols.
MLA_FIELDS = (("q_lora_rank", "q_lora_rank"), ("kv_lora_rank", "kv_lora_rank"), ("head_dim", "nope_dim"),
              ("rope_head_dim", "rope_dim"), ("v_head_dim", "v_dim"))


def _write_mla(c: dict, meaning: ModelConfig, family: Family, loss: ConfigLoss) -> None:
    """Multi-head latent attention's dims (a null q_lora_rank for a plain q projection), or the loss of them."""
    if not family.mla:
        if meaning.mla:
            loss.cannot("kv_lora_rank", meaning.kv_lora_rank, f"{meaning.architecture} has no latent attention")
        return
    if not meaning.mla:
        loss.cannot("kv_lora_rank", 0, f"{meaning.architecture} computes latent attention")
        return
    for field, key in MLA_FIELDS:
        value = getattr(meaning, field)
        c[family.dim_key(family.mla[key], c)] = value if value or field != "q_lora_rank" else None


def write_config(meaning: ModelConfig, base: dict | None, family: Family, loss: ConfigLoss) -> dict:
    """``base`` (the source's config.json, or None) with every meaning-bearing key set from ``meaning``;
    anything the architecture cannot spell is reported to ``loss``."""
    spelling = family.config.architecture(meaning.architecture)
    if spelling is None:
        raise PlanError(f"mapping '{family.name}' has no [config.architectures.{meaning.architecture}] table: "
                        "reshard does not know how its config.json spells the model")
    c = dict(base or {})
    model_type = c.get("model_type") if c.get("model_type") in spelling.other_model_types else spelling.model_type
    c.update(architectures=[meaning.architecture], model_type=model_type, tie_word_embeddings=meaning.tied)
    written: dict[str, tuple[str, int]] = {}
    for field, symbol in DIM_FIELDS:
        key = family.dim_key(symbol, c)
        value = getattr(meaning, field)
        if key is None or key.startswith("count:"):  # a count of a list (Nemotron-H's layers_block_type) is derived
            continue
        if key in written and written[key][1] != value:
            loss.cannot(field, value, f"{meaning.architecture} spells {field} and {written[key][0]} with one key "
                        f"({key}), so they must be equal ({written[key][1]})")
            continue
        written[key] = (field, value)
        c[key] = value
    _write_mla(c, meaning, family, loss)
    if not family.mla:  # latent attention's head dims are its own (_write_mla)
        _write_head_dim(c, meaning, family, loss)
    c[family.config.norm_eps] = meaning.norm_eps
    if meaning.max_positions is not None:
        c[family.config.max_positions] = meaning.max_positions
    act_key = family.config.activation
    if ACTIVATIONS.get(c.get(act_key)) != meaning.activation:
        if meaning.activation not in HIDDEN_ACT:
            loss.cannot("activation", meaning.activation, "no transformers hidden_act spells it")
        c[act_key] = HIDDEN_ACT.get(meaning.activation, meaning.activation)
    features = family.decoder
    if family.role_switch("q_norm"):  # GLM-4.5's use_qk_norm
        c[family.role_switch("q_norm")] = meaning.qk_norm
    for field, value, has in (("norm", meaning.norm, features.norm), ("position", meaning.position, features.position),
                              ("gated_mlp", meaning.gated_mlp, features.mlp == "gated"),
                              ("qk_norm", meaning.qk_norm, family.has_role("q_norm", c)),
                              ("norm_offset", meaning.norm_offset, features.norm_offset),
                              ("embedding_scaled", meaning.embedding_scaled, features.embedding_scaled),
                              ("sandwich_norm", meaning.sandwich_norm, family.role_spec("attn_output_norm") is not None)):
        if value != has:
            loss.cannot(field, value, f"{meaning.architecture} has {field} = {has!r}")
    _write_multipliers(c, meaning, family, loss)
    llama4_rules.check_written(meaning, family, loss)
    for field in ("attn_softcap", "final_softcap", "query_scale"):
        key, value = getattr(family.config, field), getattr(meaning, field)
        if key:  # transformers types query_pre_attn_scalar as an int
            c[key] = int(value) if field == "query_scale" and value is not None and value.is_integer() else value
        elif value is not None:
            loss.cannot(field, value, f"{meaning.architecture} has no {field}")
    if features.position == "rope":
        params = c.get("rope_parameters")
        per_type = isinstance(params, dict) and bool(params) and set(params) <= set(LAYER_TYPES)
        if per_type:
            c["rope_parameters"] = dict(params.get("full_attention") or {})
        _write_rope(c, ernie_rules.rope_meaning(meaning, family, loss), spelling.rotary_fraction, loss,
                    float(dict(spelling.defaults).get("partial_rotary_factor", 1.0)))
        _write_local_theta(c, meaning, family, loss, per_type)
    if meaning.residual_post_norm:
        loss.cannot("residual_post_norm", True, "transformers' decoders add the residual before the norm")
    for group in BIAS_GROUPS:
        if group not in dict(spelling.biases) and getattr(meaning, f"{group}_bias"):
            loss.cannot(f"{group}_bias", True, f"{meaning.architecture} has no {group} biases")
    assigned: dict[str, bool] = {}
    for group, setting in spelling.biases:
        value = getattr(meaning, f"{group}_bias")
        if isinstance(setting, bool):
            if value != setting:
                loss.cannot(f"{group}_bias", value, f"{meaning.architecture} {'always' if setting else 'never'} has "
                            f"{group} biases")
        elif assigned.setdefault(setting, value) != value:
            loss.cannot(f"{group}_bias", value, f"{meaning.architecture}'s {setting} switches several bias groups "
                        "together, and they differ")
        else:
            c[setting] = value
    _write_window(c, meaning, spelling.window, loss)
    gpt_oss_rules.write_hf(c, meaning, loss)
    write_moe(c, meaning, family, loss)
    if family.mtp and not qwen3_next_mtp.unstated(family, base, meaning.mtp_layers):
        c[family.mtp["layers"]] = meaning.mtp_layers
    elif meaning.mtp_layers:
        loss.cannot("mtp_layers", meaning.mtp_layers, f"{meaning.architecture} has no multi-token-prediction layers")
    for key, wanted in spelling.requires:  # what the reader requires, spelt out for readers with other defaults
        if key in c or family.mla:
            c[key] = wanted
    return c


def _write_head_dim(c: dict, meaning: ModelConfig, family: Family, loss: ConfigLoss) -> None:
    """``head_dim`` where the family spells it and it is set or differs from hidden / heads."""
    head_key = family.dim_key("d", c)
    if head_key is None:
        if meaning.head_dim != meaning.hidden // meaning.heads:
            loss.cannot("head_dim", meaning.head_dim, f"{meaning.architecture}'s head dim is always hidden / heads")
    elif head_key in c or meaning.head_dim != meaning.hidden // meaning.heads:
        c[head_key] = meaning.head_dim






