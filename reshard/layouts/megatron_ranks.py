"""Megatron-Core ``torch`` format, the per-rank forms shared by reading and writing (and by torch_dist): the rank folder
``mp_rank_TT[_PPP][_EEE]``, the expert grid (EP x expert TP), and the tensors one rank of a TP x PP (x EP) grid
holds with their local names and shapes: ``linear_qkv`` grouped by KV group, ``linear_fc1`` = ``[gate_r; up_r]``,
row-parallel layers split on dim 1, the vocab padded and split, layer indices local to the stage, routed experts as
SequentialMLP / TEGroupedMLP (``weight<e>``) / legacy GroupedMLP (``weight1`` / ``weight2``), the MTP block's names,
and which TransformerEngine ``_extra_state`` entries a rank holds."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from reshard.core.canonical import CanonicalModel, instance
from reshard.core.pieces import StoredTensor
from reshard.core.sharding import megatron_qkv_pieces, pack_members, rank_slice, stage_weights
from reshard.mapping import Family, WeightSpec


NAME = "megatron"


RANK_FILE = "model_optim_rng.pt"


_LAYER = re.compile(r"^(?:language_model\.)?decoder\.layers\.(\d+)\.")  # a VLM's language model: language_model.


GROUPED = re.compile(r"\.mlp\.experts\.linear_fc[12]\.weight\d+$")  # TEGroupedMLP


LEGACY_GROUPED = re.compile(r"\.mlp\.experts\.weight[12]$")  # legacy GroupedMLP


def rank_dir(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """``mp_rank_TT``, ``_PPP`` when pp > 1, ``_EEE`` when ep > 1 (Megatron-LM's get_checkpoint_name)."""
    return (f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
            + (f"_{ep_rank:03d}" if ep > 1 else ""))


@dataclass(frozen=True)
class ExpertGrid:
    """Expert parallelism of a Megatron run: ``ep`` ranks hold E/ep routed experts each (global expert =
    ``ep_rank * E/ep + local``), each expert split over ``etp`` expert-tensor-parallel ranks (etp rank = dense TP
    rank % etp); ``ep_rank`` is the rank a file belongs to."""

    ep: int = 1
    etp: int = 1
    ep_rank: int = 0
    grouped: bool = False  # experts named as TEGroupedMLP's linear_fc1.weight{j} (moe_grouped_gemm)
    legacy: bool = False  # legacy GroupedMLP: weight1 = the local experts' fc1 views, [E_loc, H, 2I/etp] in memory


def rank_tensors(model: CanonicalModel, tp: int, rank: int, layers: list[int], first: bool, last: bool,
                 spec_name: str, padded_vocab: int, grid: ExpertGrid | None = None,
                 vision: str = "hf") -> list[StoredTensor]:
    """The tensors of one TP rank (and EP rank, ``grid``) of one pipeline chunk holding global ``layers`` (names
    local to the chunk; routed experts under their local index; on the last stage, MTP layers after the output
    layer, :func:`mtp_name`); a vision tower on the first stage in layout ``vision`` (hf: its HF modules;
    native: vision_model.decoder.layers.*, split at ``tp``)."""
    grid = grid or ExpertGrid(etp=tp)
    held = "megatron_native" if vision == "native" else "megatron_hf"
    out: list[StoredTensor] = []

    kind_in = "megatron_local" if spec_name == "local" else "megatron"

    def emit(spec: WeightSpec, layer: int | None, local: int | None, name_spec: WeightSpec | None = None):
        if not spec.held_in(held):
            return
        groups = model.dims[spec.heads or "ng"]
        sparse = layer in model.sparse_layers or layer in model.mtp_layers
        template = (name_spec or spec).megatron_name(spec_name, sparse, grid.grouped, vision)
        if layer in model.mtp_layers:
            template = mtp_name(template, spec)
        if spec.per_expert and grid.legacy:
            out.extend(_legacy_grouped(model, spec, layer, local, rank, grid))
            return
        if spec.per_expert:
            per_rank = model.num_experts // grid.ep
            for j in range(per_rank):
                members = pack_members(model, spec, layer, lambda s: s.megatron_name(spec_name),
                                       grid.ep_rank * per_rank + j)
                if members is not None:
                    out.append(rank_slice(instance(template, local, j), spec, members, rank % grid.etp, grid.etp,
                                          groups, padded_vocab, megatron_qkv_pieces))
            return
        members = pack_members(model, spec, layer, lambda s: s.megatron_name(spec_name, vision=vision))
        if members is None:
            return
        name = template.format(layer=local) if local is not None else template
        stored = rank_slice(name, spec, members, rank, tp, groups, padded_vocab, megatron_qkv_pieces,
                            spec.split_in(kind_in, vision))
        out.append(replace(stored, value_offset=spec.megatron_offset) if spec.megatron_offset else stored)

    for name_spec, spec, layer, local in stage_weights(model, layers, first, last, tied_copy=not first):
        emit(spec, layer, local, name_spec)
    if last:  # multi-token prediction lives on the last stage, after the output layer
        for k, layer in enumerate(model.mtp_layers):
            for spec in model.family.weights:
                if spec.per_layer:
                    emit(spec, layer, k)
    return out


def mtp_name(template: str, spec: WeightSpec) -> str:
    """The Megatron-Core name of a weight in MTP layer ``{layer}`` (its MTP index): its own ``mtp.layers.*`` name,
    or, for a decoder-layer weight, ``mtp.layers.{layer}.transformer_layer.`` + its name in a decoder layer
    (megatron-core 0.16's MultiTokenPredictionLayer; newer versions name the module ``mtp_model_layer`` but keep
    ``transformer_layer`` on disk)."""
    return template if spec.layers == "mtp" else mtp_decoder_layer(template)


def mtp_decoder_layer(template: str) -> str:
    """A decoder-layer name template as it is spelt inside MTP layer ``{layer}``."""
    return template.replace("decoder.layers.{layer}.", "mtp.layers.{layer}.transformer_layer.", 1)


def _legacy_grouped(model: CanonicalModel, spec: WeightSpec, layer: int, local: int, rank: int,
                    grid: ExpertGrid) -> list[StoredTensor]:
    """Legacy GroupedMLP's ``weight1`` / ``weight2`` of one layer: the bytes of ``[E_loc, H, 2I/etp]`` (resp.
    ``[E_loc, I/etp, H]``), block j = local expert j's ``linear_fc1`` (``linear_fc2``) transposed; the file's 2-D
    shape (``[H, E_loc * 2I/etp]``, ``[E_loc * I/etp, H]``) is the same memory, not a concatenation."""
    name_of = lambda s: s.megatron_legacy_grouped  # noqa: E731
    per_rank = model.num_experts // grid.ep
    blocks = [pack_members(model, spec, layer, name_of, grid.ep_rank * per_rank + j) for j in range(per_rank)]
    if blocks[0] is None:
        return []
    name = spec.megatron_legacy_grouped.format(layer=local)
    slices = [rank_slice(name, spec, members, rank % grid.etp, grid.etp, model.dims["ng"], 0, megatron_qkv_pieces)
              for members in blocks]
    first = slices[0]
    pieces = tuple(replace(p, block=j) for j, s in enumerate(slices) for p in s.pieces)
    return [StoredTensor(name, (per_rank, *reversed(first.shape)), 2 - first.axis, pieces, transposed=True,
                         stacked=True)]


def extra_state_names(family: Family, spec_name: str, num_local_layers: int, tensor_names: list[str],
                      mtp_layers: int = 0, vision: str = "hf") -> list[str]:
    """``_extra_state`` keys of a rank: per-layer ones for each local decoder layer and, on the last stage, each
    MTP layer (a decoder template under ``mtp.layers.{k}.transformer_layer.``); a module with weights only where
    the layer holds them (an MLA layer has linear_q_proj or linear_q_down_proj / linear_q_up_proj); others where
    the module is held."""
    templates = family.extra_state.get(spec_name, ())
    held = set(tensor_names)
    weighted = {w.megatron_name(spec_name) for w in family.weights if w.megatron_te or w.megatron_local}
    with_weights = {t for t in templates if any(n.startswith(t.removesuffix("_extra_state")) for n in weighted)}

    def wanted(template: str, name: str) -> bool:
        module = name.removesuffix("_extra_state")
        return template not in with_weights or any(n.startswith(module) for n in held)

    names = []
    for t in templates:
        if "{layer}" not in t:
            continue
        if t.startswith("mtp."):
            names += [t.format(layer=k) for k in range(mtp_layers) if wanted(t, t.format(layer=k))]
            continue
        names += [t.format(layer=i) for i in range(num_local_layers) if wanted(t, t.format(layer=i))]
        inner = mtp_decoder_layer(t)
        names += [inner.format(layer=k) for k in range(mtp_layers) if wanted(t, inner.format(layer=k))]
    if family.multimodal:  # the vision tower's megatron-core modules, where the rank holds them
        tower = family.multimodal.extra_state_native if vision == "native" else family.multimodal.extra_state_hf
        templates = templates + dict(tower).get(spec_name, ())
    for t in templates:
        module = t.removesuffix("._extra_state") + "."
        if "{layer}" not in t and any(n.startswith(module) for n in tensor_names):
            names.append(t)
    return names
