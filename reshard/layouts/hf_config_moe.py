"""config.json's Mixture-of-Experts keys <-> the canonical config's expert and router fields, as a family's
``[moe]`` table spells them (expert count and width, shared experts, top-k, renormalisation, which layers are
sparse, and the router: scores, selection bias, groups, scaling)."""

from __future__ import annotations

import json

from reshard.core.model_config import ConfigLoss, ModelConfig
from reshard.errors import CheckpointError
from reshard.layouts import ernie_rules
from reshard.mapping import Family


def _required(config: dict, key: str, where: str):
    if config.get(key) is None:
        raise CheckpointError(f"{where}: config.json has no {key}, which the router needs; add it (the value the "
                              "model was trained with)")
    return config[key]


def read_moe(config: dict, family: Family, dims: dict[str, int], present: set[str], where: str) -> dict:
    """The Mixture-of-Experts fields of an HF config, as the family's [moe] table spells them."""
    moe = family.moe
    if not moe:
        return {}
    renormalize = moe.get("renormalize", False)
    if isinstance(renormalize, str):
        renormalize = bool(config.get(renormalize, False))
    sparse = family.sparse_layers(config, dims["L"])
    shared = dims.get(moe["shared_ffn"], 0) if "shared_ffn" in moe else 0
    if "shared_count" in moe:
        shared = dims[moe["expert_ffn"]] * dims[moe["shared_count"]]
    routing = {}
    bias = family.role_spec("router_bias")
    if bias is not None and family.holds(bias.hf, present, config):
        routing["router_bias"] = True
    switch = moe.get("group_switch")
    if "groups" in moe and (switch is None or config.get(switch["key"]) == switch["on"]):
        groups, topk = int(_required(config, moe["groups"], where)), int(_required(config, moe["group_topk"], where))
        if groups > 1:
            if dims[moe["experts"]] % groups or not 1 <= topk <= groups:
                raise CheckpointError(f"{where}: {moe['groups']} = {groups} and {moe['group_topk']} = {topk} do not "
                                      f"form groups of the {dims[moe['experts']]} experts; fix the config")
            routing.update(router_groups=groups, router_group_topk=topk,
                           router_group_score=moe.get("group_score", "top2_sum"))
    if switch is not None and config.get(switch["key"]) not in (switch["on"], switch["off"]):
        raise CheckpointError(f"{where}: config.json sets {switch['key']} = {json.dumps(config.get(switch['key']))}; "
                              f"{family.name} routes with {switch['off']!r} or {switch['on']!r}")
    if "scaling" in moe:
        routing["router_scaling"] = float(_required(config, moe["scaling"], where))
    return dict(experts=dims[moe["experts"]], experts_per_token=int(config[moe["top_k"]]),
                expert_ffn=dims[moe["expert_ffn"]], router_renormalize=renormalize,
                moe_layers=None if sparse == tuple(range(dims["L"])) else sparse, shared_expert_ffn=shared,
                shared_expert_gate=bool(shared) and family.role_spec("shared_expert_gate") is not None,
                router_score=moe.get("score", "softmax"), **routing)


def _write_routing(c: dict, meaning: ModelConfig, family: Family, loss: ConfigLoss) -> None:
    """The router's scores, selection bias, groups and scaling as the family's [moe] table spells them."""
    moe = family.moe
    arch = meaning.architecture
    if meaning.router_score != moe.get("score", "softmax"):
        loss.cannot("router_score", meaning.router_score, f"{arch}'s router scores with {moe.get('score', 'softmax')}")
    bias = family.role_spec("router_bias")
    if meaning.router_bias and bias is None:
        loss.cannot("router_bias", True, f"{arch}'s router has no selection bias")
    elif bias is not None and not meaning.router_bias and bias.when is None and not bias.optional:  # (optional:
        # Ernie 4.5 without one is written with a zero bias, ernie_rules.zero_biases)
        loss.cannot("router_bias", False, f"{arch}'s router always adds its selection bias")
    switch = moe.get("group_switch")
    if meaning.router_groups > 1:
        if "groups" not in moe:
            loss.cannot("router_groups", meaning.router_groups, f"{arch} has no group-limited routing")
        elif meaning.router_group_score != moe.get("group_score", "top2_sum"):
            loss.cannot("router_group_score", meaning.router_group_score, f"{arch} ranks groups by "
                        f"{moe.get('group_score', 'top2_sum')}")
        else:
            c[moe["groups"]], c[moe["group_topk"]] = meaning.router_groups, meaning.router_group_topk
    elif "groups" in moe:
        c[moe["groups"]], c[moe["group_topk"]] = 1, 1
    if switch is not None:
        c[switch["key"]] = switch["on"] if meaning.router_groups > 1 else switch["off"]
    if "scaling" in moe:
        c[moe["scaling"]] = meaning.router_scaling
    elif meaning.router_scaling != 1.0:
        loss.cannot("router_scaling", meaning.router_scaling, f"{arch} does not scale its routed weights")
    if "dense_prefix" in moe:
        sparse = meaning.sparse_layers()
        prefix = min(sparse) if sparse else meaning.layers
        if sparse != tuple(range(prefix, meaning.layers)):
            loss.cannot("moe_layers", list(sparse), f"{arch} has dense layers only before its MoE layers")
        c[moe["dense_prefix"]] = prefix


def write_moe(c: dict, meaning: ModelConfig, family: Family, loss: ConfigLoss) -> None:
    moe = family.moe
    if not moe:
        if meaning.experts:
            loss.cannot("experts", meaning.experts, f"{meaning.architecture} is a dense model")
        return
    for field, symbol in (("experts", moe["experts"]), ("expert_ffn", moe["expert_ffn"]),
                          ("shared_expert_ffn", moe.get("shared_ffn"))):
        value = getattr(meaning, field)
        if field == "shared_expert_ffn" and "shared_count" in moe:
            continue
        if symbol is None:
            if value:
                loss.cannot(field, value, f"{meaning.architecture} has no such setting")
            continue
        c[family.dim_key(symbol, c)] = value
    if "shared_count" in moe:
        count, rest = divmod(meaning.shared_expert_ffn, meaning.expert_ffn or 1)
        if rest:
            loss.cannot("shared_expert_ffn", meaning.shared_expert_ffn, f"{meaning.architecture}'s shared experts are "
                        f"each {meaning.expert_ffn} wide")
        c[family.dim_key(moe["shared_count"], c)] = count
    _write_routing(c, meaning, family, loss)
    c[moe["top_k"]] = meaning.experts_per_token
    renormalize = moe.get("renormalize", False)
    if isinstance(renormalize, str):
        c[renormalize] = meaning.router_renormalize
    elif renormalize != meaning.router_renormalize:
        loss.cannot("router_renormalize", meaning.router_renormalize, f"{meaning.architecture}'s router "
                    f"{'always' if renormalize else 'never'} renormalises its top-k weights")
    if meaning.shared_expert_gate != (bool(meaning.shared_expert_ffn) and
                                      family.role_spec("shared_expert_gate") is not None):
        loss.cannot("shared_expert_gate", meaning.shared_expert_gate, f"{meaning.architecture} fixes it")
    sparse = meaning.sparse_layers()
    if "sparse_list" in moe:  # Llama 4: the explicit list (its step rule kept as the source spells it)
        c[moe["sparse_list"]] = list(sparse)
    elif "dense_layers" in moe:
        c[moe["dense_layers"]] = [i for i in range(meaning.layers) if i not in sparse]
        if "sparse_step" in moe:
            c[moe["sparse_step"]] = 1
    elif "sparse_end" in moe:  # Ernie 4.5: a start / end / interval range
        ernie_rules.write_sparse_range(c, sparse, moe, meaning.layers, loss)
    elif sparse != tuple(range(meaning.layers)) and "dense_prefix" not in moe:
        loss.cannot("moe_layers", list(sparse), f"{meaning.architecture} has experts on every layer")
