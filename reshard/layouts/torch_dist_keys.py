"""Where Megatron-Core's ``torch_dist`` keeps each tensor of its ``torch`` format's TP=1 layout: the DCP key and
the indices into the axes megatron-core prepends to it. One rule for every family (it is megatron-core's own
``sharded_state_dict``, not the mapping's):

* layers: ``decoder.layers.{l}.<rest>`` is ``decoder.layers.<rest>`` with a layer axis ``[L, ...]`` (index l) when
  the layers are homogeneous (``stacked``), else the per-layer key ``decoder.layers.{l}.<rest>`` with no axis
  (``moe_layer_freq`` a list: a model with both dense and MoE layers);
* routed experts (``SequentialMLP``): ``<prefix>.local_experts.{g}.<rest>`` (the global expert g at EP 1) is
  ``<prefix>.experts.<rest>`` with an expert axis ``[E, ...]`` (index g) after the layer axis, e.g.
  ``decoder.layers.mlp.experts.experts.linear_fc1.weight [L, E, 2I, H]`` (block ``[l, g]`` = ``[gate; up]``) or
  ``decoder.layers.{l}.mlp.experts.experts.linear_fc2.weight [E, H, I]``; MTP layers (``mtp.layers.{k}.``) keep
  their per-layer keys and get the same expert axis;
* byte items: a module's ``_extra_state`` is ``<module key>._extra_state/shard_{indices}_{axis sizes}``
  (``.``-joined; ``shard_0_1`` without a prepended axis): one per layer, and per (layer, expert) for experts;
* the pre-MLP norm has two spellings: ``pre_mlp_layernorm.weight`` (a separate norm module: Transformer Engine
  MoE layers, the MLA local spec) and ``mlp.linear_fc1.layer_norm_weight`` (fused into fc1, or renamed by the GQA
  local spec's ``sharded_state_dict_keys_map``, which applies to MoE layers too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: a decoder layer: the language model's (a VLM's under ``language_model.``) or a native vision tower's block
_LAYER = re.compile(r"^((?:language_model\.|vision_model\.)?)decoder\.layers\.(\d+)\.(.+)$")
#: Qwen3-VL's DeepStack mergers, which Megatron-Bridge stacks on an axis of their own
_DEEPSTACK = re.compile(r"^(vision_model\.decoder\.deepstack_merger_list\.)(\d+)\.(.+)$")
_MTP_LAYER = re.compile(r"^mtp\.layers\.\d+\.transformer_layer\.")
_EXPERT = re.compile(r"^(.*\.)local_experts\.(\d+)\.(.+)$")
#: norms with two spellings, (separate module, fused into the next linear): the pre-MLP norm, and MLA's q / kv LoRA
#: norms (local spec ``q_layernorm`` / ``kv_layernorm``, Transformer Engine ``linear_{q,kv}_up_proj.layer_norm_*``)
_NORM_SPELLINGS = ((".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_"),
                   (".self_attention.q_layernorm.", ".self_attention.linear_q_up_proj.layer_norm_"),
                   (".self_attention.kv_layernorm.", ".self_attention.linear_kv_up_proj.layer_norm_"))
#: a native vision tower's input norm, which megatron-core's ViT keeps as a module of its own in the local spec's
#: sharded keys (the language model's are renamed to the fused spelling)
_VISION_NORM_SPELLINGS = ((".input_layernorm.", ".self_attention.linear_qkv.layer_norm_"),)
#: modules holding a weight whose ``_extra_state`` a load requests though they are not named ``linear_*``
#: (an MTP layer's embedding / hidden projection; vision towers' Transformer Engine norms and Gemma 3's projection)
_EXTRA_STATE_LINEARS = ("eh_proj", "patch_norm", "ln_pre", "proj", "mm_soft_embed_norm", "in_proj", "out_proj")
#: modules whose ``_extra_state`` a load may request besides every ``linear_*`` module of the model: attention
#: (Transformer Engine <= 0.14), and norms (Transformer Engine norm modules, version-dependent). Megatron-Core
#: ignores byte items it does not request, and fails on requested ones that are missing: write a superset.
_EXTRA_STATE_ALSO = ("self_attention.core_attention",)


@dataclass(frozen=True)
class Location:
    """A TP=1 tensor's place in a torch_dist folder: ``key`` and its ``index`` into the prepended axes (layer
    first when stacked, then expert); ``axes`` names them (``"layer"`` / ``"expert"``)."""

    key: str
    index: tuple[int, ...] = ()
    axes: tuple[str, ...] = ()


def location(name: str, stacked: bool, unit_axes: int = 0) -> Location:
    """Where the TP=1 ``torch``-format tensor ``name`` lives (layers ``stacked`` or per layer; a native vision
    tower's blocks on a ``vblock`` axis). ``unit_axes``: leading axes of size 1 the tensor is stored with (CLIP's
    class token ``[1, 1, H]``)."""
    index, axes = [0] * unit_axes, ["unit"] * unit_axes
    m = _LAYER.match(name)
    if m and stacked:
        name = f"{m.group(1)}decoder.layers.{m.group(3)}"
        index.append(int(m.group(2)))
        axes.append("vblock" if m.group(1) == "vision_model." else "layer")
    d = _DEEPSTACK.match(name)
    if d and stacked:
        name = f"{d.group(1)}{d.group(3)}"
        index.append(int(d.group(2)))
        axes.append("ds")
    e = _EXPERT.match(name)
    if e:
        name = f"{e.group(1)}experts.{e.group(3)}"
        index.append(int(e.group(2)))
        axes.append("expert")
    return Location(name, tuple(index), tuple(axes))


def other_spelling(key: str) -> str | None:
    """A two-spelling norm's other key (:data:`_NORM_SPELLINGS`, either way, stacked or per layer); None for every
    other key."""
    for a, b in _NORM_SPELLINGS + (_VISION_NORM_SPELLINGS if key.startswith("vision_model.") else ()):
        if a in key:
            return key.replace(a, b, 1)
        if b in key:
            return key.replace(b, a, 1)
    return None


def stacked_layers(model) -> bool:
    """Whether megatron-core stacks this model's layers: dense, or a Mixture of Experts on every layer (Megatron-LM
    ``moe_layer_freq`` 1, what reshard records then); a list of dense and MoE layers gives per-layer keys."""
    if len(set(model.mixers)) > 1:  # hybrid layers (linear_attention_freq a list): per-layer keys
        return False
    return not model.num_experts or tuple(model.sparse_layers) == tuple(range(model.num_layers))


def object_key(module: str, index: tuple[int, ...], sizes: tuple[int, ...]) -> str:
    """The DCP key of ``module``'s ``_extra_state`` at ``index`` into prepended axes of ``sizes``."""
    if not index:
        return f"{module}._extra_state/shard_0_1"
    return f"{module}._extra_state/shard_{'.'.join(map(str, index))}_{'.'.join(map(str, sizes))}"


def extra_state_keys(locations: list[Location], sizes: dict[str, int], num_layers: int, stacked: bool,
                     layer_prefix: str = "") -> list[str]:
    """Every ``_extra_state`` key a Megatron-Core load of a model with these tensors may ask for: each ``linear_*``
    module holding a ``.weight`` (per layer, per expert), each separate norm module, and per layer the modules of
    :data:`_EXTRA_STATE_ALSO` (the decoder's under ``layer_prefix``: a VLM's ``language_model.``, and a native
    vision tower's). ``sizes``: the prepended axes' lengths by name."""
    keys = {}
    for loc in locations:
        key = loc.key.split(".weight.")[0] + ".weight" if ".weight." in loc.key else loc.key  # in_proj.weight.query
        if not key.endswith(".weight"):
            continue
        module = key.removesuffix(".weight")
        last = module.rsplit(".", 1)[-1]
        if last.startswith("linear_") or last.endswith("layernorm") or last in _EXTRA_STATE_LINEARS:
            keys.setdefault(object_key(module, loc.index, tuple(sizes[a] for a in loc.axes)))
    mtp = sorted({m.group(0) for loc in locations for m in [_MTP_LAYER.match(loc.key)] if m})
    for mtp_layer in mtp:  # an MTP layer's decoder layer: per-layer modules as a decoder layer's
        for module in _EXTRA_STATE_ALSO:
            keys.setdefault(object_key(f"{mtp_layer}{module}", (), ()))
    for block in range(sizes.get("vblock", 0)):  # a native vision tower's blocks, stacked
        for module in _EXTRA_STATE_ALSO:
            keys.setdefault(object_key(f"vision_model.decoder.layers.{module}", (block,), (sizes["vblock"],)))
    for layer in range(num_layers):
        for module in _EXTRA_STATE_ALSO:
            if stacked:
                keys.setdefault(object_key(f"{layer_prefix}decoder.layers.{module}", (layer,), (num_layers,)))
            else:
                keys.setdefault(object_key(f"{layer_prefix}decoder.layers.{layer}.{module}", (), ()))
    return list(keys)


def expert_objects_missing(locations: list[Location], tensors: dict, objects: set[str]) -> str | None:
    """The first routed expert's ``_extra_state`` key that megatron-core writes (one per global expert and linear,
    ``SequentialMLP``) but ``objects`` lacks, for the expert tensors at ``locations`` (in ``tensors``, the folder's
    DCP tensors by key, for the axis sizes); None when all are there."""
    for loc in locations:
        if "expert" not in loc.axes or not loc.key.endswith(".weight"):
            continue
        sizes = tuple(tensors[loc.key].shape[:len(loc.index)])
        key = object_key(loc.key.removesuffix(".weight"), loc.index, sizes)
        if key not in objects:
            return key
    return None
