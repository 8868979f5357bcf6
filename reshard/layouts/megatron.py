"""Megatron-Core ``torch`` format: ``<root>/latest_checkpointed_iteration.txt`` and
``<root>/iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`` (a pickled dict with ``model``, ``args``,
``checkpoint_version``, ``iteration``; ``model0``, ``model1``, ... with a virtual pipeline).

Per rank: ``linear_qkv`` grouped by KV group, ``linear_fc1`` = ``[gate_r; up_r]``, ``linear_proj`` and
``linear_fc2`` split on dim 1, embedding and output layer split over the vocab padded to a multiple of
``make_vocab_size_divisible_by * tp``, norms replicated; layer indices local to the pipeline stage.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
from dataclasses import dataclass, replace

from reshard.core.canonical import CanonicalModel, build_canonical, instance
from reshard.core.model_config import ConfigLoss, ModelConfig
from reshard.core.pieces import StoredTensor
from reshard.core.sharding import (check_megatron_degrees, megatron_padded_vocab, megatron_qkv_pieces, pack_members,
                                   rank_slice, stage_layers, stage_weights)
from reshard.errors import CheckpointError, PlanError
from reshard.io import dtypes
from reshard.io.partial import replace_with_text
from reshard.io.heads import read_heads_while_torch_imports
from reshard.io.torch_format import MegatronEnum, TensorSlot, TorchFile, torch_dtype_global
from reshard.layouts.base import (Layout, Options, Source, TargetPlan, TargetSpec, check_shape,
                                  chosen_architecture)
from reshard.layouts import gpt_oss_rules
from reshard.layouts.hf import write_config
from reshard.layouts.hf_config import read_meaning, without_dropped_settings, write_config as write_hf_config
from reshard.layouts.megatron_folders import (  # noqa: F401  (_checkpoint_root, _label: for torch_dist, verify)
    _RANK_DIR, _REMOTE_RANK_FILE, TRACKER, _checkpoint_root, _iteration_dir, _label,
    iteration_folder, iteration_folder_name, side_folders, true_vocab_size)
from reshard.layouts.megatron_args import RECORD_ONLY, args_from_meaning, meaning_from_args
from reshard.layouts import gdn_rules, mamba_rules
from reshard.layouts import llama4_rules
from reshard.layouts.expert_tp import expert_tp, expert_tp_notes
from reshard.layouts import ministral3_rules
from reshard.layouts.vision import check_megatron_tower, megatron_vision, tower_views, unused_tower_tensor
from reshard.mapping import Family, WeightSpec
from reshard.mapping_vlm import family_for_architecture, flat_view, nested
from reshard.side_files import find_side_files

NAME = "megatron"
RANK_FILE = "model_optim_rng.pt"
_LAYER = re.compile(r"^(?:language_model\.)?decoder\.layers\.(\d+)\.")  # a VLM's language model: language_model.
GROUPED = re.compile(r"\.mlp\.experts\.linear_fc[12]\.weight\d+$")  # TEGroupedMLP
LEGACY_GROUPED = re.compile(r"\.mlp\.experts\.weight[12]$")  # legacy GroupedMLP


# ----------------------------------------------------------------------------------------- shared rules

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


# ---------------------------------------------------------------------------------------------- reading

def read_args(args, opts: Options, folders: str | list[str], where: str) -> tuple[ModelConfig, Family, dict]:
    """A Megatron run's meaning (its args decide; a recorded ``hf_config`` only names the architecture and
    carries the config.json keys args have no place for), its family, and an HF-spelled config dict. ``folders``:
    where config.json / tokenizer.json may give the vocab size (:func:`side_folders`)."""
    vocab = true_vocab_size(args, opts, folders)
    recorded = getattr(args, "hf_config", None)
    recorded = dict(recorded) if isinstance(recorded, dict) else None
    named = (recorded.get("architectures") or [None])[0] if recorded else None
    architecture = chosen_architecture(named if isinstance(named, str) else None, opts,
                                       f"{where}: the args' hf_config")
    meaning = meaning_from_args(args, vocab, architecture, where)
    family = family_for_architecture(meaning.architecture, opts.mapping, recorded)
    if recorded and family.multimodal:
        recorded = flat_view(recorded)
    if recorded:  # settings the record holds that the family does not carry: refused unless allowed lossy
        recorded = without_dropped_settings(recorded, family, opts.allow_lossy_config)[0]
    meaning = _with_record_only(meaning, family, recorded, where)
    base = recorded or {"torch_dtype": _args_dtype(args)}
    if not recorded and "d" in family.dims:
        base[family.dim_key("d")] = meaning.head_dim
    config = write_hf_config(meaning, base, family, ConfigLoss("record"))  # losses are refused by each target
    return meaning, family, config


def _with_record_only(meaning: ModelConfig, family: Family, recorded: dict | None, where: str) -> ModelConfig:
    """``meaning`` with the fields Megatron-LM's args cannot spell (:data:`RECORD_ONLY`, a gated MLP's activation)
    from the ``hf_config`` record reshard writes into args, or, without one, from the family's fixed features
    (refused when the family has config-valued ones the args cannot give)."""
    if recorded is not None:
        dims = family.resolve_dims(recorded)
        spelled = read_meaning(recorded, family, meaning.architecture, dims, set(), meaning.tied, where)
        fields = {f: getattr(spelled, f) for f in RECORD_ONLY}
        if "mrope_section" in spelled.scaling:  # the args spell the sections; Qwen3-VL's interleaving is recorded
            fields["rope_scaling"] = spelled.rope_scaling
        if spelled.gated_mlp and spelled.activation != "silu":
            fields.update(gated_mlp=True, activation=spelled.activation)
        return meaning.replace(**fields)
    valued = [k for k in ("attn_softcap", "final_softcap", "rope_local_theta") if getattr(family.config, k)]
    if valued or (family.decoder.mlp == "gated" and family.decoder.activation not in ("silu", "swish")):
        what = ", ".join(valued) or f"its {family.decoder.activation} gated MLP"
        raise CheckpointError(f"{where}: a {meaning.architecture} needs {what}, which Megatron-LM's args cannot "
                              "spell and this checkpoint records no hf_config; convert from the Hugging Face "
                              "checkpoint instead")
    return meaning.replace(embedding_scaled=family.decoder.embedding_scaled,
                           sandwich_norm=family.role_spec("attn_output_norm") is not None)


def _args_dtype(args) -> str:
    dtype = str(getattr(args, "params_dtype", None))  # a torch.dtype or its stand-in: both print as torch.<name>
    if dtype not in ("torch.bfloat16", "torch.float16", "torch.float32"):
        dtype = "torch.bfloat16" if getattr(args, "bf16", False) else \
            "torch.float16" if getattr(args, "fp16", False) else "torch.float32"
    return dtype.removeprefix("torch.")


_FORMS = {1: "a pp=1 rank", 2: "a pp>1 or ep>1 rank", 3: "a pp>1 and ep>1 rank"}


def scan_rank_folders(folder: str) -> dict[tuple[int, ...], str]:
    """``mp_rank_*`` folders by their number groups (1 to 3: what the groups mean depends on the run's pp and
    ep, :func:`rank_grid`), each checked to hold its rank file; all folders must have the same form."""
    found: dict[tuple[int, ...], str] = {}
    forms: dict[int, str] = {}
    for name in sorted(os.listdir(folder)):
        m = _RANK_DIR.match(name)
        if not m:
            continue
        groups = tuple(int(g) for g in m.groups() if g is not None)
        forms.setdefault(len(groups), name)
        if len(forms) > 1:
            (na, a), (nb, b) = sorted(forms.items())[:2]
            raise CheckpointError(f"{folder} holds both {a} ({_FORMS[na]}) and {b} ({_FORMS[nb]}): folders of two "
                                  "runs are mixed; remove the one you do not mean")
        path = os.path.join(folder, name, RANK_FILE)
        if not os.path.isfile(path):
            raise CheckpointError(f"{os.path.join(folder, name)} has no {RANK_FILE}: the checkpoint is incomplete")
        found[groups] = path
    if not found:
        raise CheckpointError(f"{folder} has no mp_rank_* folders")
    return found


def missing_rank_folders(ranks, tp: int, pp: int, ep: int, etp: int) -> list[str]:
    """Folders a checkpoint needs but lacks. Every (tp, pp, ep) folder when the expert-TP degree equals tp; with
    a lower one Megatron-LM writes only some (a rank saves its (dense tp, ep) folder: moe.md 3.1), so what counts
    is that every dense TP rank and every (ep, expert-TP rank) of each stage is held by some folder."""
    if etp == tp:
        return [rank_dir(t, p, pp, e, ep) for p in range(pp) for e in range(ep) for t in range(tp)
                if (t, p, e) not in ranks]
    missing = []
    for p in range(pp):
        missing += [rank_dir(t, p, pp, 0, ep) for t in range(tp) if not any((t, p, e) in ranks for e in range(ep))]
        missing += [rank_dir(s, p, pp, e, ep) for e in range(ep) for s in range(etp)
                    if not any((t, p, e) in ranks for t in range(s, tp, etp))]
    return missing


def rank_grid(found: dict[tuple[int, ...], str], pp: int, ep: int, folder: str) -> dict[tuple[int, int, int], str]:
    """Rank files by (tp, pp, ep) rank: ``mp_rank_TT_PPP_EEE``; with two groups the second is the pipeline rank
    when the run's pp > 1, else the expert rank (Megatron-LM names them alike)."""
    grid = {}
    for groups, path in found.items():
        if len(groups) == 3:
            key = groups
        elif len(groups) == 2:
            key = (groups[0], groups[1], 0) if pp > 1 or ep == 1 else (groups[0], 0, groups[1])
        else:
            key = (groups[0], 0, 0)
        grid[key] = path
    if ep > 1 and all(len(g) < 3 for g in found) and pp > 1:
        raise CheckpointError(f"{folder}: args say pp={pp} and ep={ep} but the rank folders carry two numbers; "
                              "the checkpoint is inconsistent")
    return grid


def _scan_ranks(folder: str) -> dict[tuple[int, int], str]:
    """(tp, pp) rank files of a run without expert parallelism."""
    found = scan_rank_folders(folder)
    if any(len(g) == 3 for g in found):
        raise CheckpointError(f"{folder}: expert-parallel rank folders need the MoE reader")
    return {(g[0], g[1] if len(g) > 1 else 0): path for g, path in found.items()}


def _legacy_view(f: TorchFile, key: str, loc, shape: tuple[int, ...]):
    """Re-view a tensor's contiguous bytes as ``shape``, in the file's own table so reads see it: a legacy
    GroupedMLP tensor as its ``[E_loc, ...]`` blocks (what megatron-core's ``weight1.view(E_loc, H, -1)`` does),
    CLIP's ``[1, 1, H]`` class token as the ``[H]`` vector it is."""
    if loc.strides is not None or math.prod(loc.shape) != math.prod(shape):
        raise CheckpointError(f"{f.path}: '{key}' holds {tuple(loc.shape)}, which is not a view {tuple(shape)} of "
                              "this model's tensor (or is not contiguous)")
    view = replace(loc, shape=tuple(shape))
    f.tensors[key] = view
    return view


def open_source(path: str, opts: Options) -> Source:
    folder, iteration = _iteration_dir(path)
    folders = side_folders(path, folder)
    found_folders = scan_rank_folders(folder)
    read_heads_while_torch_imports(list(found_folders.values()))
    probe = TorchFile(found_folders[min(found_folders)])
    args = probe.structure.get("args") if isinstance(probe.structure, dict) else None
    probe.close()
    if args is None:
        raise CheckpointError(f"{probe.path}: no 'args' in the checkpoint: cannot tell the model config")
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    ranks = rank_grid(found_folders, int(getattr(args, "pipeline_model_parallel_size", 1) or 1), ep, folder)
    tp = max(t for t, _, _ in ranks) + 1
    pp = max(p for _, p, _ in ranks) + 1
    ep_found = max(e for _, _, e in ranks) + 1
    etp = int(getattr(args, "expert_tensor_parallel_size", None) or tp)
    missing = missing_rank_folders(ranks, tp, pp, ep_found, etp)
    if missing:
        raise CheckpointError(f"{folder}: rank folder {missing[0]} is missing (found tp={tp}, pp={pp}"
                              f"{f', ep={ep_found}' if ep_found > 1 else ''}); the checkpoint is incomplete")
    order = [(t, p, e) for p in range(pp) for e in range(ep_found) for t in range(tp) if (t, p, e) in ranks]
    files = [TorchFile(ranks[key]) for key in order]
    for f in files:  # megatron-core after 0.16 names an MTP layer's decoder layer mtp_model_layer
        for key in [k for k in f.tensors if ".mtp_model_layer." in k]:
            f.tensors[key.replace(".mtp_model_layer.", ".transformer_layer.", 1)] = f.tensors.pop(key)
    for label, value, found in (("tensor", getattr(args, "tensor_model_parallel_size", tp), tp),
                                ("pipeline", getattr(args, "pipeline_model_parallel_size", pp), pp),
                                ("expert", ep, ep_found)):
        if value != found:
            raise CheckpointError(f"{folder}: args say {label}_model_parallel_size={value} but the rank folders "
                                  f"give {found}: the checkpoint is inconsistent or incomplete")
    meaning, family, config = read_args(args, opts, folders, folder)
    vocab = meaning.vocab

    # Which chunks (model / model0, model1, ...) each rank file holds, and their layer counts.
    chunk_layers: dict[tuple[int, str], int] = {}
    names_all: set[str] = set()
    for (t, p, e), f in zip(order, files):
        chunks = [k for k in f.structure if k == "model" or re.fullmatch(r"model\d+", str(k))]
        if not chunks:
            raise CheckpointError(f"{f.path}: no 'model' state dict in the checkpoint")
        for chunk in chunks:
            count = 0
            for key in f.structure[chunk]:
                names_all.add(key)
                m = _LAYER.match(key)
                if m:
                    count = max(count, int(m.group(1)) + 1)
            chunk_layers.setdefault((p, chunk), count)
    chunk_keys = sorted({c for _, c in chunk_layers}, key=lambda c: -1 if c == "model" else int(c[5:]))
    spec_name = "te" if any(n.endswith(".layer_norm_weight") for n in names_all) else "local"
    vision = "native" if any(n.startswith("vision_model.decoder.layers.") for n in names_all) else "hf"
    grouped = any(GROUPED.search(n) for n in names_all)
    legacy_grouped = any(LEGACY_GROUPED.search(n) for n in names_all)
    starts, offset = {}, 0
    for chunk in chunk_keys:
        for p in range(pp):
            starts[(p, chunk)] = offset
            offset += chunk_layers.get((p, chunk), 0)
    legacy = sorted(n for n in names_all if n.startswith(("language_model", "encoder.", "word_embeddings"))
                    and not (family.multimodal and n.startswith("language_model.")))
    if legacy:
        raise CheckpointError(f"{folder}: the rank files use legacy (pre-Megatron-Core) Megatron-LM names such as "
                              f"'{legacy[0]}'; reshard reads Megatron-Core (mcore) checkpoints: convert it with "
                              "Megatron-LM's tools/checkpoint (--saver mcore) first")
    if offset != meaning.layers:
        raise CheckpointError(f"{folder}: the rank files hold {offset} layers but args say "
                              f"{meaning.layers}: a pipeline stage is missing or inconsistent")

    present = set()
    for spec in family.weights:
        if spec.optional and spec.megatron_name(spec_name).format(layer=0) in names_all:
            present.add(spec.hf)
    tied = meaning.tied
    model = build_canonical(family, config, present, tied)
    if family.multimodal:
        megatron_vision(model, vision)  # a layout the family has
    views = tower_views(model, spec_name, vision)
    model.meaning = meaning
    for group, templates in family.config.bias_groups:
        has = all(family.holds(t, present) for t in templates)
        if has != getattr(meaning, f"{group}_bias"):
            raise CheckpointError(f"{folder}: the args {'do not ' if has else ''}ask for {group} biases but the rank "
                                  f"files {'hold' if has else 'lack'} them (add_bias_linear="
                                  f"{getattr(args, 'add_bias_linear', None)}, add_qkv_bias="
                                  f"{getattr(args, 'add_qkv_bias', None)}): the checkpoint is inconsistent")
    emb_spec = next(s for s in family.weights if s.split == "vocab" and s.stage == "first")
    emb_loc = files[0].tensors.get(f"{chunk_keys[0]}/{emb_spec.megatron_name(spec_name)}")
    if emb_loc is None:
        raise CheckpointError(f"{files[0].path}: no {emb_spec.megatron_name(spec_name)} in the first stage")
    padded = emb_loc.shape[0] * tp
    if padded < vocab:
        raise CheckpointError(f"the embedding holds {padded} rows over tp={tp}, fewer than the vocab size {vocab}; "
                              "--vocab-size or the recorded vocab is wrong")

    stored, expected_names = [], []
    for index, ((t, p, e), f) in enumerate(zip(order, files)):
        expected_names.append(set())
        for chunk in chunk_keys:
            if (p, chunk) not in chunk_layers:
                continue
            start = starts[(p, chunk)]
            layers = list(range(start, start + chunk_layers[(p, chunk)]))
            is_first = p == 0 and chunk == chunk_keys[0]
            is_last = p == pp - 1 and chunk == chunk_keys[-1]
            for tensor in rank_tensors(model, tp, t, layers, is_first, is_last, spec_name, padded,
                                       ExpertGrid(ep_found, etp, e, grouped, legacy_grouped), vision):
                key = f"{chunk}/{tensor.name}"
                loc = f.tensors.get(key)
                if loc is not None and ((tensor.stacked and tensor.transposed) or tensor.name in views):
                    loc = _legacy_view(f, key, loc, tensor.shape)
                if loc is None and unused_tower_tensor(model, tensor):
                    continue  # a tower built with only the blocks LLaVA uses: they read as absent
                if loc is None:
                    raise CheckpointError(f"{f.path}: tensor '{tensor.name}' is missing from the rank file")
                check_shape(f.path, tensor.name, loc.shape, tensor.shape)
                stored.append((index, replace(tensor, name=key)))
                expected_names[-1].add(key)
                for piece in tensor.pieces:
                    if piece.canonical:
                        model.dtypes.setdefault(piece.canonical, loc.dtype)
        for key in f.tensors:
            if key.split("/")[0] in chunk_keys and key not in expected_names[-1] and "_extra_state" not in key:
                raise CheckpointError(f"{f.path}: unexpected tensor '{key.split('/', 1)[1]}' for mapping "
                                      f"'{family.name}' (a config / weights mismatch?)")
    dropped = sorted({k for f in files for k in f.structure if k not in ("model", "args", "checkpoint_version",
                                                                        "iteration") and k not in chunk_keys})
    beside = sorted({n for path in ranks.values() for n in os.listdir(os.path.dirname(path)) if n != RANK_FILE})
    if beside:  # e.g. distrib_optim.pt: the distributed optimizer's state, saved beside each rank's model file
        dropped.append(f"files beside the rank files ({', '.join(beside)}: e.g. distributed optimizer state)")
    info = {"args": args, "iteration": iteration, "spec": spec_name, "padded_vocab": padded,
            "vocab_divisor": getattr(args, "make_vocab_size_divisible_by", None), "dropped": dropped}
    return Source(layout=NAME, root=path, model=model, files=files, stored=stored,
                  degrees={"tp": tp, "pp": pp, **({"ep": ep_found, "etp": etp} if model.num_experts else {})},
                  info=info, side_files=find_side_files(folders, config))


# ---------------------------------------------------------------------------------------------- writing

def build_args(model: CanonicalModel, opts: Options, padded: int, divisor: int, dtype: str,
               base: argparse.Namespace | None, loss: ConfigLoss) -> argparse.Namespace:
    """A faithful Megatron-LM ``args`` for the output (so ``--use-checkpoint-args`` works): the meaning's fields
    (:func:`~reshard.layouts.megatron_args.args_from_meaning`; what args cannot spell goes to ``loss``), the
    degrees, and the source run's other args when it was a Megatron run."""
    values = {}
    if base is not None:  # keep the run's own args; enum stand-ins cannot be written back without Megatron
        values = {k: v for k, v in vars(base).items() if not isinstance(v, MegatronEnum)}
    values.update(args_from_meaning(model.meaning, loss), **llama4_rules.megatron_args(model.meaning))
    if model.num_experts:
        values["moe_grouped_gemm"] = opts.moe_grouped_gemm
    values.update(gdn_rules.megatron_args(model), **mamba_rules.megatron_args(model))
    record = nested(write_hf_config(model.meaning, model.config, model.family, ConfigLoss("record")))
    record["dtype" if "dtype" in record else "torch_dtype"] = dtypes.hf_config_dtype(dtype)
    values.update(
        padded_vocab_size=padded, make_vocab_size_divisible_by=divisor,
        tensor_model_parallel_size=opts.tp, pipeline_model_parallel_size=opts.pp,
        virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=opts.ep,
        expert_tensor_parallel_size=expert_tp(opts, model) if model.num_experts else None,
        world_size=opts.pp * max(opts.tp, opts.ep * expert_tp(opts, model)),
        data_parallel_size=max(opts.tp, opts.ep * expert_tp(opts, model)) // opts.tp, seq_length=values.get("seq_length") or model.meaning.max_positions,
        params_dtype=torch_dtype_global(dtype), bf16=dtype == "BF16", fp16=dtype == "F16",
        transformer_impl="transformer_engine" if opts.megatron_spec == "te" else "local",
        apply_query_key_layer_scaling=False, attention_softmax_in_fp32=True, hf_config=record,
    )
    values.setdefault("tokenizer_type", "HuggingFaceTokenizer")
    return argparse.Namespace(**values)


@dataclass
class OutputArgs:
    """What both Megatron formats record about their output: the args, the vocab padded for the target tp, the
    iteration label and its folder, and notes (config fields dropped with --allow-lossy-config)."""

    args: argparse.Namespace
    padded: int
    iteration: str
    folder: str
    notes: list[str]


def output_args(source: Source, opts: Options, dtype: str) -> OutputArgs:
    """Plan the recorded args of a Megatron output (either format): refuses degrees the model cannot have, a bad
    vocab divisor and config fields the args cannot spell. A Megatron source (torch or torch_dist) keeps its
    run's other args and its iteration; any other source gives ``release``."""
    model = source.model
    if opts.vocab_divisor is not None and opts.vocab_divisor < 1:
        raise PlanError(f"--make-vocab-size-divisible-by must be a positive integer (got {opts.vocab_divisor}); "
                        "Megatron pads the vocab to a multiple of it times tp (default 128)")
    gdn_rules.check_megatron_target(model, opts.megatron_spec, opts.tp)
    mamba_rules.check_degrees(model, opts.tp)
    check_megatron_degrees(model, opts.tp, opts.pp)
    check_split_dims(model, opts.tp, "megatron_local" if opts.megatron_spec == "local" else "megatron")
    check_megatron_tower(model, opts)
    check_expert_degrees(model, opts)
    llama4_rules.check_megatron_target(model, opts.max_seq)
    ministral3_rules.check_megatron_target(model, opts.max_seq)
    divisor = opts.vocab_divisor or source.info.get("vocab_divisor") or 128
    padded = megatron_padded_vocab(model.vocab_size, opts.tp, divisor)
    iteration = source.info.get("iteration", "release")
    loss = ConfigLoss("Megatron", opts.allow_lossy_config)
    args = build_args(model, opts, padded, divisor, dtype, source.info.get("args"), loss)
    return OutputArgs(args, padded, iteration, iteration_folder_name(iteration),
                      loss.check() + gdn_rules.offset_notes(model) + expert_tp_notes(model, opts))


def targets(model: CanonicalModel, opts: Options, source: Source, dtype: str
            ) -> tuple[list[TargetSpec], str, list[str]]:
    """Rank files for Megatron at ``opts.tp`` x ``opts.pp``; also returns the iteration label :func:`finalize`
    writes into the tracker, and notes (config fields dropped with --allow-lossy-config)."""
    if opts.megatron_spec not in ("te", "local"):
        raise PlanError(f"unknown --megatron-spec '{opts.megatron_spec}': use te or local")
    run = output_args(source, opts, dtype)
    padded, iteration, folder, args = run.padded, run.iteration, run.folder, run.args
    args.ckpt_format = "torch"  # a torch_dist source's run said torch_dist
    specs = []
    stages = stage_layers(model.num_layers, opts.pp)
    ep, etp = opts.ep, expert_tp(opts, model)
    if opts.moe_grouped_gemm and not model.num_experts:
        raise PlanError("--moe-grouped-gemm is for Mixture-of-Experts models")
    vision = megatron_vision(model, opts.megatron_vision)
    views = tower_views(model, opts.megatron_spec, vision)
    for p, layers in enumerate(stages):
        for e, t in ((e, t) for e in range(ep) for t in range(opts.tp)):
            tensors = rank_tensors(model, opts.tp, t, list(layers), p == 0, p == opts.pp - 1,
                                   opts.megatron_spec, padded, ExpertGrid(ep, etp, e, opts.moe_grouped_gemm), vision)
            state = collections.OrderedDict((s.name, TensorSlot(s.name, "", (), views.get(s.name))) for s in tensors)
            mtp = len(model.mtp_layers) if p == opts.pp - 1 else 0
            for name in extra_state_names(model.family, opts.megatron_spec, len(layers), list(state), mtp,
                                          vision):
                state[name] = None
            payload = {"args": args, "checkpoint_version": 3.0,
                       "iteration": 0 if iteration == "release" else int(iteration), "model": state}
            specs.append(TargetSpec(f"{folder}/{rank_dir(t, p, opts.pp, e, ep)}/{RANK_FILE}", "torch", tensors,
                                    payload=payload, rank={"tp": t, "pp": p, "ep": e}))
    return specs, iteration, run.notes


def check_split_dims(model: CanonicalModel, tp: int, kind_in: str) -> None:
    """Refuse a tp that does not divide the split dimension of a column / row weight outside experts (MLA's
    q / kv projections: whole heads; the local spec's down projections: plain row blocks)."""
    for spec in model.family.weights:
        kind = spec.split_in(kind_in)
        if kind not in ("column", "row") or spec.per_expert or spec.tower or not model.has_spec(spec):
            continue
        size = model.family.shape_of(spec, model.dims)[spec.axis]
        if size % tp:
            raise PlanError(f"{spec.hf} has {size} {'rows' if kind == 'column' else 'columns'}, which do not split "
                            f"over tp={tp} ({'Megatron local spec' if kind_in == 'megatron_local' else 'Megatron'}); "
                            f"choose a tp dividing {size}")


def check_expert_degrees(model: CanonicalModel, opts: Options) -> None:
    """Refuse expert-parallel degrees Megatron-Core cannot hold this model at, before anything is written."""
    ep, etp = opts.ep, expert_tp(opts, model)
    gpt_oss_rules.check_expert_tp(model.meaning, etp)
    if ep < 1 or etp < 1:
        raise PlanError(f"--ep and --etp must be >= 1 (got ep={ep}, etp={etp})")
    if not model.num_experts:
        if ep > 1 or opts.etp not in (None, opts.tp):
            raise PlanError(f"--ep / --etp are for Mixture-of-Experts models; {model.meaning.architecture} is dense")
        return
    if model.num_experts % ep:
        raise PlanError(f"{model.num_experts} experts do not split over ep={ep}: Megatron needs experts % ep == 0; "
                        f"choose an ep that divides {model.num_experts}")
    if opts.tp % etp:
        raise PlanError(f"--etp {etp} must divide --tp {opts.tp}: Megatron's torch format names rank folders by the "
                        "dense TP rank, so an expert-TP degree above it (or not dividing it) has no folder")
    ffn = model.meaning.expert_ffn
    if ffn % etp:
        raise PlanError(f"expert intermediate size {ffn} does not split over etp={etp}; choose an etp dividing it")
    shared = model.meaning.shared_expert_ffn
    if shared and shared % opts.tp:
        raise PlanError(f"shared-expert intermediate size {shared} does not split over tp={opts.tp}")


def finalize(out: str, iteration: str, hf_config: dict | None) -> None:
    """Write ``config.json`` (the Hugging Face config the args record, so that tools which take a model folder
    with a config, such as vLLM with ``load_format="reshard"``, can open the output), then the tracker file last:
    its presence marks the checkpoint complete."""
    if hf_config:
        write_config(out, hf_config)
    replace_with_text(os.path.join(out, TRACKER), f"{iteration}\n" if iteration != "release" else "release")


class MegatronLayout(Layout):
    """Megatron-Core ``torch`` format: a pickled state dict per (TP, PP) rank, with Megatron-LM ``args``."""

    holds_mtp = True
    name = NAME
    summary = "Megatron-Core torch format (latest_checkpointed_iteration.txt, iter_*/mp_rank_*/model_optim_rng.pt)"
    specificity = 10
    rank_loader = "reshard.verification.forward.megatron_rank:MegatronRankStream"
    completion_markers = (TRACKER,)
    uses_options = frozenset({"megatron_vision", "ep", "etp", "moe_grouped_gemm", "megatron_spec", "vocab_divisor",
                              "max_seq"})
    instead = {"expert_parallel": "Megatron's expert parallelism is --ep N (with --etp for the experts' tensor "
                                  "parallelism)"}

    def detect(self, names) -> bool:
        """A tracker file, rank folders (an iteration folder itself) or ``iter_*/`` / ``release/`` folders."""
        if TRACKER in names:
            return True
        folders = [n[:-1] for n in names if n.endswith("/") and n.count("/") == 1]
        return any(_RANK_DIR.match(n) or n.startswith("iter_") or n == "release" for n in folders)

    def open(self, root: str, opts: Options) -> Source:
        return open_source(root, opts)

    def targets(self, source: Source, opts: Options, dtype: str) -> TargetPlan:
        specs, iteration, notes = targets(source.model, opts, source, dtype)
        return TargetPlan(specs, state=iteration, notes=notes)

    def finalize(self, out: str, source: Source, plan, state) -> None:
        finalize(out, state, plan.files[0].payload["args"].hf_config if plan.files else None)

    def remote_files(self, names: list[str], read_text) -> list[str]:
        """The tracker and the rank files of the iteration it names (else of the only iteration present)."""
        folder = iteration_folder(read_text(TRACKER) if TRACKER in names else None, names)
        ranks = {p for p in names if _REMOTE_RANK_FILE.match(p) and p.split("/")[0] == folder}
        return sorted(ranks | ({TRACKER} & set(names)))

    def describe(self, source: Source) -> dict:
        return {"padded_vocab_size": source.info["padded_vocab"], "megatron_spec": source.info["spec"],
                "iteration": source.info["iteration"]}

    def rank_label(self, source: Source, relpath: str) -> str:
        return os.path.basename(os.path.dirname(relpath))
