"""Qwen3-Next's multi-token-prediction (MTP) head under its released HF names (families-2.md sections 4.2, 14.2 I).

The release stores the head apart from the decoder, under ``mtp.``: ``mtp.layers.{k}.<decoder-layer names>`` (a
gated full-attention MoE layer), and once for the head ``mtp.fc.weight`` [H, 2H] (input ``cat(enorm(embedding),
hnorm(hidden))``), ``mtp.pre_fc_norm_embedding.weight``, ``mtp.pre_fc_norm_hidden.weight`` and ``mtp.norm.weight``
[H]. Canonically (as DeepSeek-V3 / GLM-4.5 store theirs on disk) MTP layer k is decoder layer L + k:
``model.layers.{L+k}.<decoder-layer names>`` plus ``eh_proj``, ``enorm``, ``hnorm`` and ``shared_head.norm``, so
Megatron's ``mtp.layers.{k}.{eh_proj, enorm, hnorm, final_layernorm}`` and ``…transformer_layer.*`` follow from the
mapping. This module renames between the two on the HF reader's and writer's side only.
"""

from __future__ import annotations

from dataclasses import replace

from reshard.errors import CheckpointError

FAMILY = "qwen3_next"
DISK = "mtp."
#: The head's own weights: released name under ``mtp.`` -> canonical name under ``model.layers.{L}.``.
OWN = {"fc.weight": "eh_proj.weight", "pre_fc_norm_embedding.weight": "enorm.weight",
       "pre_fc_norm_hidden.weight": "hnorm.weight", "norm.weight": "shared_head.norm.weight"}


def _count(family, config: dict) -> int:
    return family.mtp_count(config) if family.name == FAMILY and family.mtp else 0


def canonical_name(name: str, layers: int) -> str | None:
    """The canonical name of released MTP tensor ``name`` (``layers``: the decoder's L), or None if it is not one."""
    if not name.startswith(DISK):
        return None
    rest = name[len(DISK):]
    if rest in OWN:
        return f"model.layers.{layers}.{OWN[rest]}"
    head, _, tail = rest.partition(".")
    index, _, inner = tail.partition(".")
    if head != "layers" or not index.isdigit() or not inner:
        return None
    return f"model.layers.{layers + int(index)}.{inner}"


def disk_name(name: str, layers: int, mtp: int) -> str:
    """The released name of canonical ``name`` where it is in one of the ``mtp`` layers after decoder layer L."""
    prefix, _, rest = name.partition("model.layers.")
    index, _, inner = rest.partition(".")
    if prefix or not index.isdigit() or not layers <= int(index) < layers + mtp:
        return name
    own = {v: k for k, v in OWN.items()}
    if inner in own:
        return DISK + own[inner]
    return f"{DISK}layers.{int(index) - layers}.{inner}"


def read_names(family, config: dict, where: dict[str, int]) -> dict[str, str]:
    """Rename the released ``mtp.*`` tensors in ``where`` to their canonical names when ``config`` declares MTP
    layers (``num_nextn_predict_layers``; without it they stay ``mtp.*`` and are dropped with a note); returns
    canonical name -> the file's name."""
    mtp = _count(family, config)
    if not mtp:
        return {}
    if mtp > 1:
        raise CheckpointError(f"{family.mtp['layers']} = {mtp}: Qwen3-Next's MTP head has one fc and one norm set "
                              "for all its layers, which Megatron's per-layer eh_proj cannot hold; set it to 1")
    layers = int(config.get("num_hidden_layers", 0))
    renamed = {}
    for name in [n for n in where if n.startswith(DISK)]:
        full = canonical_name(name, layers)
        if full is not None and full not in where:
            where[full] = where.pop(name)
            renamed[full] = name
    return renamed


def unstated(family, base: dict | None, mtp_layers: int) -> bool:
    """Whether the HF writer leaves the MTP count out: Qwen3NextConfig has no such key, so a source config.json
    without one and no MTP layers is written without it (kept verbatim)."""
    return family.name == FAMILY and not mtp_layers and family.mtp["layers"] not in (base or {})


def drop_hint(family) -> str:
    """What the note on a dropped ``mtp.*`` head adds: the config key that carries it."""
    if family.name != FAMILY or not family.mtp:
        return ""
    return f" unless config.json declares {family.mtp['layers']} (then they are carried as MTP layers)"


def write_names(model, tensors: list) -> list:
    """``tensors`` (HF stored tensors) with the MTP layers' ones under their released ``mtp.*`` names."""
    if model.family.name != FAMILY or not model.mtp_layers:
        return tensors
    mtp, layers = len(model.mtp_layers), model.num_layers
    return [replace(t, name=disk_name(t.name, layers, mtp)) for t in tensors]
