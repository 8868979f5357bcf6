"""vLLM ``sharded_state``: ``model-rank-{rank}-part-{part}.safetensors`` in one folder, plus config.json,
tokenizer files and reshard's ``reshard.json`` (vLLM itself records no TP size).

Per rank, vLLM parameter names and per-rank shapes: ``qkv_proj`` = ``[q_r; k_r; v_r]`` (one KV head per rank,
replicated on ``tp/ng`` neighbours, when tp >= ng), ``gate_up_proj`` = ``[gate_r; up_r]``, ``o_proj`` and
``down_proj`` split on dim 1 (their biases whole on every rank), norms whole, embedding and ``lm_head`` padded to
a multiple of 64 rows and split evenly (padding rows zero), tied embeddings stored once under the name vLLM's
loader keeps, and four fp32 attention scale scalars (1.0) per layer that the loader requires.

DeepSeek-V2 / V3 (multi-head latent attention): ``self_attn.fused_qkv_a_proj`` = ``[q_a_proj; kv_a_proj_with_mqa]``
whole on every rank (without q LoRA: ``self_attn.mla_attn.q_proj`` column-split and ``self_attn.kv_a_proj_with_mqa``
whole, the ``vllm_unfused`` name), ``mla_attn.q_a_layernorm``, ``mla_attn.q_b_proj`` / ``kv_b_proj`` column-split
by whole heads, ``mla_attn.o_proj`` row-split, norms and the router (``mlp.experts.gate.weight``, its fp32
``e_score_correction_bias``) whole, shared experts as a dense MLP under ``mlp.experts._shared_experts._layer``;
multi-token-prediction layers are not part of vLLM's main model (dropped with a note).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import replace

from reshard.version import __version__
from reshard.core.canonical import CanonicalModel, build_canonical, stored_whole
from reshard.core.pieces import StoredTensor
from reshard.layouts.llama4_rules import check_vllm_target, qk_rows_permuted, vllm_notes
from reshard.layouts import gdn_rules, mamba_rules
from reshard.core.sharding import (check_vllm_degrees, pack_members, rank_slice, vllm_padded_vocab,
                                   vllm_qkv_pieces)
from reshard.errors import CheckpointError, PlanError
from reshard.io import dtypes
from reshard.io.pair_rows import unpair_sources
from reshard.io.partial import replace_with_text
from reshard.io.regular import open_regular
from reshard.io.safetensors_format import SafetensorsFile
from reshard.layouts import gpt_oss_rules, hf
from reshard.layouts.hf_config import read_meaning, without_dropped_settings
from reshard.layouts.base import (Layout, Options, Source, TargetPlan, TargetSpec, check_shape, pack_by_size,
                                  stored_dtype)
from reshard.layouts.vision import check_tower_degrees, without
from reshard.mapping import WeightSpec
from reshard.mapping_vlm import family_for_architecture, flat_view

NAME = "vllm"
PATTERN = "model-rank-{rank}-part-{part}.safetensors"
RECORD = "reshard.json"
_FILE = re.compile(r"^model-rank-(\d+)-part-(\d+)\.safetensors$")
SCALE_DTYPE = "F32"


def kept_tied_name(names: list[str], family=None) -> str:
    """Where vLLM keeps tied embeddings: ``ShardedStateLoader._filter_subtensors`` keeps, of tensors sharing one
    storage, the smallest key; a model without an ``lm_head`` module (vLLM 0.32's Gemma 2) has only the embedding,
    which its mapping names (``[vllm] tied_name``)."""
    if family is not None and family.vllm_tied_name:
        return family.vllm_tied_name
    return min(names)


def _check_names(model: CanonicalModel) -> None:
    missing = [s.hf for s in model.family.weights if s.slot and not s.vllm]
    if missing:
        raise PlanError(f"mapping '{model.family.name}' gives no vLLM name for packed weight {missing[0]}; "
                        "add `vllm = ...` to it in the mapping file")


def vllm_name_table(family, holds) -> dict[str, str]:
    """HF template -> vLLM name of every weight of ``family``: the mapping's ``vllm`` name, or its ``vllm_unfused``
    one when another member of its vLLM pack is one the model lacks (``holds(spec)`` False: DeepSeek-V2-Lite has no
    ``q_a_proj``, so vLLM keeps its ``kv_a_proj_with_mqa`` alone under its own name, not in ``fused_qkv_a_proj``)."""
    weights = family.weights
    return {spec.hf: spec.vllm_unfused if spec.vllm_unfused and any(
                not holds(s) for s in weights if s is not spec and s.vllm_name == spec.vllm_name) else spec.vllm_name
            for spec in weights}


def vllm_names(model: CanonicalModel):
    """``spec -> its vLLM name`` in ``model`` (:func:`vllm_name_table`)."""
    names = vllm_name_table(model.family, model.has_spec)
    return lambda spec: names[spec.hf]


def expert_block(experts: int, ranks: int, rank: int) -> range:
    """The routed experts vLLM's ``enable_expert_parallel`` puts on ``rank`` (linear placement): contiguous
    blocks, the first ``experts % ranks`` ranks one more (vLLM's determine_expert_map)."""
    base, rem = divmod(experts, ranks)
    start = rank * base + min(rank, rem)
    return range(start, start + base + (rank < rem))


def rank_tensors(model: CanonicalModel, tp: int, rank: int, padded_vocab: int,
                 expert_parallel: bool = False, tower_whole: bool = False) -> list[StoredTensor]:
    """Every tensor of vLLM rank ``rank``, in vLLM's state-dict order, as pieces (scales as constants). Routed
    experts are stacked per layer (``w13_weight [E, 2I/tp, H]`` = per expert ``[gate_r; up_r]``, ``w2_weight
    [E, H, I/tp]``); with ``expert_parallel`` the rank holds its block of whole experts instead. ``tower_whole``:
    the vision tower as at TP 1 on every rank, under vLLM's fused names (``mm_encoder_tp_mode="data"``)."""
    family = model.family
    name_of = vllm_names(model)
    out: list[StoredTensor] = []
    head_spec = next((s for s in family.weights if s.tied_to), None)
    emb_spec = next((s for s in family.weights if head_spec and s.hf == head_spec.tied_to), None)

    def emit(spec: WeightSpec, layer: int | None, name: str | None = None) -> None:
        if not spec.held_in(NAME):
            return
        groups = model.dims[spec.heads or "ng"]
        template = name or name_of(spec)
        stored_name = template.format(layer=layer) if layer is not None else template
        if spec.per_expert:
            experts = expert_block(model.num_experts, tp, rank) if expert_parallel else range(model.num_experts)
            blocks = []
            for j, e in enumerate(experts):
                members = pack_members(model, spec, layer, name_of, e)
                if members is None:
                    return
                blocks.append(rank_slice(stored_name, spec, members, 0 if expert_parallel else rank,
                                         1 if expert_parallel else tp, groups, padded_vocab, vllm_qkv_pieces))
            first = blocks[0]
            out.append(StoredTensor(stored_name, (len(blocks), *first.shape), first.axis + 1,
                                    tuple(replace(p, block=j) for j, b in enumerate(blocks) for p in b.pieces),
                                    stacked=True, pair_interleaved=first.shape[first.axis] if spec.vllm_interleaved
                                    else 0))  # gpt-oss w13: gate/up alternating within the rank's slice
            return
        members = pack_members(model, spec, layer, name_of)
        if members is None:
            return
        if spec.vllm_transposed:  # kept [in, out] as HF stores it, whole on every rank (Gemma 3's projector)
            out.append(stored_whole(stored_name, members, transposed=True))
            return
        whole = tower_whole and spec.tower
        if spec.vllm_transform:  # Nemotron-H's mixer.A = -exp(A_log), fp32 (reshard/io/mamba_values.py)
            sliced = rank_slice(stored_name, spec, members, rank, tp, groups, padded_vocab, vllm_qkv_pieces)
            out.append(replace(sliced, transform=spec.vllm_transform, dtype="F32"))
            return
        out.append(qk_rows_permuted(model, rank_slice(stored_name, spec, members, 0 if whole else rank,
                                                      1 if whole else tp, groups, padded_vocab, vllm_qkv_pieces,
                                                      spec.split_in(NAME))))

    for spec in family.weights:
        if spec.stage == "first":
            if model.tied and spec is emb_spec:
                emit(spec, None, kept_tied_name([emb_spec.vllm_name, head_spec.vllm_name], family))
            else:
                emit(spec, None)
    for layer in range(model.num_layers):
        for spec in family.weights:
            if spec.per_layer:
                emit(spec, layer)
        for scale in family.vllm_scales if model.mixers[layer:layer + 1] in ((), ("attention",)) else ():
            out.append(StoredTensor(scale.format(layer=layer), (), 0, (), fill=1.0, dtype=SCALE_DTYPE))
    for spec in family.weights:
        if spec.stage == "last" and not (spec.tied_to and model.tied):
            emit(spec, None)
    return out


# ---------------------------------------------------------------------------------------------- reading

def _rank_files(path: str) -> dict[int, list[str]]:
    """Rank -> its part files in part order; refuses gaps in ranks or parts."""
    parts: dict[int, dict[int, str]] = {}
    for name in os.listdir(path):
        m = _FILE.match(name)
        if m:
            parts.setdefault(int(m.group(1)), {})[int(m.group(2))] = os.path.join(path, name)
    tp = max(parts) + 1
    for rank in range(tp):
        if rank not in parts:
            raise CheckpointError(f"{path}: no files for rank {rank} (found ranks up to {tp - 1}): "
                                  "the vLLM checkpoint is incomplete")
        missing = [p for p in range(max(parts[rank]) + 1) if p not in parts[rank]]
        if missing:
            raise CheckpointError(f"{path}: rank {rank} has no part {missing[0]} "
                                  f"({PATTERN.format(rank=rank, part=missing[0])}): the checkpoint is incomplete")
    return {r: [parts[r][p] for p in sorted(parts[r])] for r in range(tp)}


def _tp_value(where: str, value) -> int:
    try:
        tp = int(value)
    except (TypeError, ValueError):
        tp = 0
    if tp < 1 or isinstance(value, bool):
        raise CheckpointError(f"{where}: tensor_parallel_size {value!r} is not a positive integer; fix or remove it")
    return tp


def _expert_parallel(model: CanonicalModel, files: list[SafetensorsFile], names: dict[str, int], tp: int) -> bool:
    """Whether a vLLM MoE folder holds whole experts split over the ranks: rank 0's stacked experts are fewer
    than the model's (the layout is then fully determined; the file metadata says so too)."""
    spec = next((s for s in model.family.weights if s.per_expert), None)
    if spec is None or tp == 1:
        return False
    layer = model.sparse_layers[0] if model.sparse_layers else 0
    name = spec.vllm_name.format(layer=layer)
    if name not in names:
        return False
    return files[names[name]].tensors[name].shape[0] < model.num_experts


def _tower_whole(model: CanonicalModel, tp: int, padded: int, files: list[SafetensorsFile],
                 names: dict[str, int]) -> bool:
    """Whether rank 0 holds the vision tower whole (``mm_encoder_tp_mode="data"``): its first split tower tensor
    has the TP=1 shape."""
    split = {t.name: t.shape for t in rank_tensors(model, tp, 0, padded) if t.name in names}
    for tensor in rank_tensors(model, tp, 0, padded, tower_whole=True):
        spec = model.tensors[tensor.pieces[0].canonical].spec if tensor.pieces and tensor.pieces[0].canonical else None
        if spec is not None and spec.tower and tensor.name in split and split[tensor.name] != tensor.shape:
            return tuple(files[names[tensor.name]].tensors[tensor.name].shape) == tuple(tensor.shape)
    return False


def _recorded_tp(path: str, files: list[SafetensorsFile]) -> int | None:
    """The TP size reshard recorded (reshard.json, file metadata); None for a folder vLLM wrote itself."""
    found = set()
    record = os.path.join(path, RECORD)
    if os.path.isfile(record):
        try:
            with open_regular(record) as f:
                value = json.load(f).get("tensor_parallel_size")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            raise CheckpointError(f"{record}: invalid JSON; delete it or fix it") from None
        if value is not None:
            found.add(_tp_value(record, value))
    for f in files:
        value = f.metadata.get("tensor_parallel_size")
        if value is not None:
            found.add(_tp_value(f.path, value))
    if len(found) > 1:
        raise CheckpointError(f"{path}: the recorded tensor_parallel_size values disagree ({sorted(found)}): "
                              "files from different conversions are mixed in one folder")
    return found.pop() if found else None


def open_source(path: str, opts: Options) -> Source:
    config = hf.read_config(path)
    architecture = hf.architecture_of(config, opts, os.path.join(path, "config.json"))
    family = family_for_architecture(architecture, opts.mapping, config)
    if family.multimodal:
        config = flat_view(config)
    notes = hf.relabel_notes(config, architecture)
    config, dropped_settings = without_dropped_settings(config, family, opts.allow_lossy_config)
    notes += dropped_settings
    ranks = _rank_files(path)
    tp = len(ranks)
    files: list[SafetensorsFile] = []
    where: list[dict[str, int]] = []
    for rank in range(tp):
        names: dict[str, int] = {}
        for p in ranks[rank]:
            f = SafetensorsFile(p)
            files.append(f)
            for name in f.tensors:
                if name in names:
                    raise CheckpointError(f"{p}: tensor '{name}' of rank {rank} is stored twice")
                names[name] = len(files) - 1
        where.append(names)
    recorded = _recorded_tp(path, files)
    if recorded is not None and recorded != tp:
        raise CheckpointError(f"{path}: files name {tp} ranks but the checkpoint records tensor_parallel_size="
                              f"{recorded}: rank files are missing or left over from another conversion")

    head_spec = next((s for s in family.weights if s.tied_to), None)
    emb_spec = next((s for s in family.weights if head_spec and s.hf == head_spec.tied_to), None)
    if head_spec:
        both = head_spec.vllm_name in where[0] and emb_spec.vllm_name in where[0]
        tied = not both
    else:
        tied = False
    present = {s.hf for s in family.weights  # on any layer (Ernie 4.5: its MoE layers hold the optional bias)
               if s.optional and any(n.startswith(s.vllm_name.split("{layer}")[0]) and
                                     n.endswith(s.vllm_name.split("{layer}")[-1]) for n in where[0])}
    model = build_canonical(family, config, present, tied)
    model.meaning = read_meaning(config, family, architecture, model.dims, present, tied, path)
    tower = {n for n, t in model.tensors.items() if t.spec.tower and not t.spec.vllm_text_only}
    held = model  # what the files hold: without a tower when written text only (--vllm-vision none)
    if tower and not any(name in where[0] for name in {s.vllm_name for s in family.weights
                                                       if s.tower and not s.vllm_text_only}):
        held = without(model, tower)
        notes.append("the folder holds no vision tower (written for a text-only engine): every tower tensor is "
                     "absent")
    _check_names(model)
    expert_parallel = _expert_parallel(model, files, where[0], tp)
    try:
        check_vllm_degrees(model, tp, expert_parallel)
    except PlanError as exc:
        raise CheckpointError(f"{path}: the files name {tp} ranks, which this model cannot have: {exc}") from None

    vocab_spec = next(s for s in family.weights if s.split == "vocab" and s.stage == "first")
    vocab_name = kept_tied_name([emb_spec.vllm_name, head_spec.vllm_name], family) if tied else vocab_spec.vllm_name
    loc = files[where[0][vocab_name]].tensors[vocab_name] if vocab_name in where[0] else None
    if loc is None:
        raise CheckpointError(f"{ranks[0][0]}: no '{vocab_name}' in rank 0")
    padded = loc.shape[0] * tp
    if padded < model.vocab_size:
        raise CheckpointError(f"{path}: '{vocab_name}' holds {padded} rows over {tp} ranks, fewer than the vocab "
                              f"size {model.vocab_size}: config.json does not match the weights, or rank files "
                              f"are missing (found ranks 0..{tp - 1})")

    whole = _tower_whole(held, tp, padded, files, where[0])
    if whole:
        notes.append('the vision tower is whole on every rank (written for mm_encoder_tp_mode="data")')
    stored: list[tuple[int, StoredTensor]] = []
    dropped = set()
    for rank in range(tp):
        expected = rank_tensors(held, tp, rank, padded, expert_parallel, whole)
        for tensor in expected:
            index = where[rank].get(tensor.name)
            if index is None:
                if tensor.fill is not None:  # a folder without scales still describes the model
                    continue
                raise CheckpointError(f"{path}: tensor '{tensor.name}' is missing from rank {rank}'s files")
            loc = files[index].tensors[tensor.name]
            try:
                check_shape(files[index].path, tensor.name, loc.shape, tensor.shape)
            except CheckpointError as exc:
                if recorded is not None:
                    raise
                raise CheckpointError(f"{exc}, or rank files are missing (found ranks 0..{tp - 1}; nothing records "
                                      "the tensor_parallel_size this folder was saved at)") from None
            if tensor.fill is not None:
                dropped.add(tensor.name.rsplit(".", 1)[-1])
                continue
            stored.append((index, tensor))
            for piece in tensor.pieces:
                if piece.canonical and not tensor.transform:  # A_log: the model's dtype (below), not A's fp32
                    model.dtypes.setdefault(piece.canonical, loc.dtype)
        unexpected = set(where[rank]) - {t.name for t in expected}
        if unexpected:
            name = sorted(unexpected)[0]
            raise CheckpointError(f"{files[where[rank][name]].path}: unexpected tensor '{name}' for mapping "
                                  f"'{family.name}' (a config / weights mismatch?)")
    for piece in (p for _, t in stored if t.transform for p in t.pieces):  # the first tensor's: the model's dtype
        model.dtypes.setdefault(piece.canonical, next(iter(model.dtypes.values())))
    files, stored = unpair_sources(files, stored)  # gpt-oss's alternating w13 read end to end
    info = {"config": config, "padded_vocab": padded, "recorded_tp": recorded, "notes": notes,
            "dropped": [f"vLLM attention scale scalars ({', '.join(sorted(dropped))})"] if dropped else []}
    return Source(layout=NAME, root=path, model=model, files=files, stored=stored, degrees={"tp": tp, "pp": 1},
                  info=info, side_files=hf.side_files(path, config))


# ---------------------------------------------------------------------------------------------- writing

def targets(model: CanonicalModel, opts: Options, dtype: str) -> tuple[list[TargetSpec], int]:
    """Rank files for vLLM at ``opts.tp``, each rank split into parts of at most ``max_shard_size`` bytes."""
    if opts.pp != 1:
        raise PlanError("vLLM sharded_state files hold tensor-parallel ranks only: --pp must be 1 for --to vllm")
    _check_names(model)
    gdn_rules.check_degrees(model, opts.tp)
    mamba_rules.check_degrees(model, opts.tp)
    check_vllm_degrees(model, opts.tp, opts.expert_parallel)
    gpt_oss_rules.check_vllm(model.meaning)
    check_vllm_target(model)
    whole = opts.vllm_vision == "data"
    if not whole:
        check_tower_degrees(model, opts.tp, NAME)
    padded = vllm_padded_vocab(model.vocab_size)
    specs = []
    for rank in range(opts.tp):
        parts = pack_by_size(rank_tensors(model, opts.tp, rank, padded, opts.expert_parallel, whole),
                             lambda t: dtypes.itemsize(stored_dtype(model, t, opts, dtype)) * math.prod(t.shape),
                             opts.max_shard_size)
        for part, tensors in enumerate(parts):
            metadata = {"format": "pt", "reshard_layout": NAME, "tensor_parallel_size": str(opts.tp),
                        "rank": str(rank), **({"expert_parallel": "true"} if opts.expert_parallel else {})}
            specs.append(TargetSpec(PATTERN.format(rank=rank, part=part), "safetensors", tensors,
                                    metadata=metadata, rank={"tp": rank}))
    return specs, padded


#: the engine arguments a vision-language folder is loaded with, by --vllm-vision
VISION_LOAD = {"weights": "", "data": ', mm_encoder_tp_mode="data"',
               "none": ', limit_mm_per_prompt={"image": 0, "video": 0}'}


def finalize(out: str, model: CanonicalModel, config: dict, tp: int, padded_vocab: int, files: list,
             expert_parallel: bool = False, vision: str = "weights") -> None:
    """Write config.json, then ``reshard.json`` (the TP size vLLM does not record) last."""
    hf.write_config(out, config)
    record = {
        "layout": NAME, "tensor_parallel_size": tp, "pattern": PATTERN, "expert_parallel": expert_parallel,
        "padded_vocab_size": padded_vocab, "vocab_size": model.vocab_size,
        "files": sorted(spec.path for spec in files), "producer": f"reshard {__version__}",
        "load_with": f'vllm.LLM(model=DIR, load_format="sharded_state", tensor_parallel_size={tp}'
                     + (", enable_expert_parallel=True" if expert_parallel else "")
                     + (VISION_LOAD[vision] if model.family.multimodal else "") + ")",
    }
    replace_with_text(os.path.join(out, RECORD), json.dumps(record, indent=2) + "\n")


class VLLMLayout(Layout):
    """vLLM ``sharded_state``: per-rank safetensors parts for one ``tensor_parallel_size``."""

    name = NAME
    summary = "vLLM sharded_state folder (model-rank-*-part-*.safetensors)"
    specificity = 10  # a vLLM folder also holds config.json and *.safetensors, as an HF one does
    rank_loader = "reshard.verification.forward.vllm_rank:VllmRankStream"
    completion_markers = ("model-rank-0-part-0.safetensors",)
    uses_options = frozenset({"expert_parallel", "max_shard_size", "vllm_vision"})
    instead = {field: "vLLM splits whole experts over its --tp ranks with --expert-parallel (as "
                      "enable_expert_parallel loads them)" for field in ("ep", "etp")}

    def detect(self, names) -> bool:
        return any(_FILE.match(n) for n in names)

    def open(self, root: str, opts: Options) -> Source:
        return open_source(root, opts)

    def targets(self, source: Source, opts: Options, dtype: str) -> TargetPlan:
        specs, padded = targets(source.model, opts, dtype)
        config, notes = hf.planned_config(source.model, dtype, opts, "vLLM")
        return TargetPlan(specs, state={"tp": opts.tp, "padded_vocab": padded, "config": config,
                                        "expert_parallel": opts.expert_parallel,
                                        "vllm_vision": opts.vllm_vision}, notes=notes + vllm_notes(source.model)
                          + mamba_rules.vllm_notes(source.model))

    def finalize(self, out: str, source: Source, plan, state) -> None:
        finalize(out, source.model, state["config"], state["tp"], state["padded_vocab"], plan.files,
                 state["expert_parallel"], state.get("vllm_vision", "weights"))

    def remote_files(self, names: list[str], read_text) -> list[str]:
        return sorted(n for n in names if _FILE.match(n))

    def describe(self, source: Source) -> dict:
        return {"padded_vocab_size": source.info["padded_vocab"],
                "recorded_tensor_parallel_size": source.info["recorded_tp"]}

    def rank_label(self, source: Source, relpath: str) -> str:
        return f"rank-{_FILE.match(os.path.basename(relpath)).group(1)}"
