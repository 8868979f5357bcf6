"""Reads one DeepSpeed tag folder (deepspeed 0.19.x ``engine.save_checkpoint``) into HF-named tensor files.

What is read (``training-frameworks.md`` §2):

- ZeRO-0/1/2 and BF16_Optimizer, by default: ``mp_rank_00_model_states.pt['module']`` (the training dtype; views
  into one flat storage, each located at its storage record + ``storage_offset``). With master weights: the fp32
  ``single_partition_of_fp32_groups`` of every ``[bf16_]zero_pp_rank_{d}_mp_rank_00_optim_states.pt``
  (:func:`deepspeed_maps.zero12_map`); frozen parameters, which ZeRO keeps in the module dtype only, from
  ``module``.
- ZeRO-3: the fp32 ``fp32_flat_groups`` of every rank (:func:`deepspeed_maps.zero3_map`); frozen parameters from
  each rank's ``frozen_param_fragments`` (module dtype); ``module`` holds empty placeholders.
- Universal (``ds_to_universal``): ``zero/<name>/fp32.pt`` (``{'param': tensor}``, or a bare flat tensor from a
  ZeRO-3 source), frozen parameters missing there from the copied model states.

Every pickle goes through ``load_structure`` with the DeepSpeed stand-ins (:mod:`reshard.io.deepspeed_pickle`);
no tensor is materialised. :func:`read_tag` returns the tensor files keyed by module names (aliases of
``shared_params`` dropped) and what was read, for :func:`reshard.layouts.hf.build_source`.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from reshard.errors import CheckpointError
from reshard.io.deepspeed_pickle import DEEPSPEED_GLOBALS
from reshard.io.segmented import SegmentedFile
from reshard.io.tensorfile import TensorFile, TensorLocation
from reshard.io.torch_format import flatten_tensors, load_structure
from reshard.layouts import deepspeed_maps as maps

MODEL_FILE = "mp_rank_00_model_states.pt"
Z3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
OPTIM = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MP_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
PIPELINE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")
MOE = re.compile(r"^(expp_rank_.*|.*expert.*_model_states\.pt)$")
MODEL_STATES = re.compile(r"^(mp_rank_\d+|zero_pp_rank_\d+_mp_rank_\d+|layer_\d+-model_\d+)_model_states\.pt$")
PEFT_PREFIX = "base_model.model."


@dataclass
class TagRead:
    """What :func:`read_tag` found: tensor files (``files[i].tensors`` keyed by module names), the stage, the
    data-parallel world, which weights were read, and the dtype of the default output."""

    files: list[TensorFile]
    stage: int | str
    world: int
    weights: str
    training_dtype: str
    frozen: list[str] = field(default_factory=list)
    optimizer: str = ""
    shared: dict = field(default_factory=dict)


def load(path: str):
    return load_structure(path, DEEPSPEED_GLOBALS)


def locate(tensor, path: str, what: str) -> TensorLocation:
    """The location of one unpickled (meta) tensor; refuses a non-contiguous view."""
    loc = flatten_tensors({what: tensor}, path).get(what)
    if loc is None:
        raise CheckpointError(f"{path}: '{what}' is not a tensor")
    if loc.strides is not None:
        raise CheckpointError(f"{path}: '{what}' is a non-contiguous view ({list(loc.shape)}, strides "
                              f"{list(loc.strides)}); reshard reads DeepSpeed tensors in place and needs them "
                              "contiguous")
    return loc


def refuse_unsupported(folder: str, names: list[str]) -> None:
    """One line for each DeepSpeed form reshard does not read (spec §2.8)."""
    for name in sorted(names):
        if PIPELINE.match(name):
            raise CheckpointError(f"{folder}: Megatron-DeepSpeed pipeline checkpoints ({name}) are not supported yet")
        if MOE.match(name):
            raise CheckpointError(f"{folder}: {name} is a DeepSpeed-MoE / AutoEP expert file; DeepSpeed-MoE "
                                  "checkpoints are not supported")
        m = MP_MODEL.match(name) or Z3_MODEL.match(name) or OPTIM.match(name)
        if m and int(m.groups()[-1]) != 0:
            raise CheckpointError(f"{folder}: {name} is model-parallel rank {int(m.groups()[-1])} inside DeepSpeed "
                                  "(Megatron-DeepSpeed / AutoTP); only data-parallel (mp_rank_00) checkpoints are "
                                  "supported")


def rank_files(folder: str, names: list[str], pattern: re.Pattern, what: str) -> list[str]:
    """The per-rank files ``pattern`` matches, by rank (rank = the first int group); a gap is refused."""
    ranks = {}
    for name in names:
        m = pattern.match(name)
        if m:
            rank = int(next(g for g in m.groups() if g and g.isdigit()))
            ranks[rank] = os.path.join(folder, name)
    missing = [r for r in range(max(ranks) + 1) if r not in ranks] if ranks else []
    if missing:
        raise CheckpointError(f"{folder}: the {what} file of rank {missing[0]} is missing (found ranks "
                              f"{sorted(ranks)}): incomplete or overwritten checkpoint")
    return [ranks[r] for r in range(len(ranks))]


def training_dtype(ds_config) -> str:
    """The dtype DeepSpeed trained in: bf16 or fp16 when enabled in ``ds_config``, else fp32."""
    config = ds_config if isinstance(ds_config, dict) else {}
    for key, dtype in (("bf16", "BF16"), ("bfloat16", "BF16"), ("fp16", "F16")):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled"):
            return dtype
    return "F32"


def module_names(states: dict, path: str) -> dict[str, TensorLocation]:
    """``module``'s tensors by name, without the ``shared_params`` aliases (stored once, under the owner)."""
    module = states.get("module")
    if not isinstance(module, dict):
        raise CheckpointError(f"{path}: 'module' is {type(module).__name__}, not the model's state dict (a "
                              "pipeline-parallel run saves None there: not supported yet)")
    shared = states.get("shared_params") or {}
    return {name: locate(t, path, f"module/{name}") for name, t in module.items() if name not in shared}


class _Partitions:
    """The optimizer files of one tag, their ``optimizer_state_dict``s by rank, and the optimizer kind."""

    def __init__(self, folder: str, names: list[str]):
        self.paths = rank_files(folder, names, OPTIM, "optimizer state")
        if not self.paths:
            raise CheckpointError(f"{folder} has no *zero_pp_rank_*_optim_states.pt files: the fp32 master weights "
                                  "are not in this checkpoint (drop --master-weights to read the module's weights)")
        self.states = []
        for path in self.paths:
            top = load(path)
            osd = top.get("optimizer_state_dict") if isinstance(top, dict) else None
            if not isinstance(osd, dict):
                raise CheckpointError(f"{path}: no 'optimizer_state_dict': not a DeepSpeed optimizer state file")
            self.states.append(osd)
        first = self.states[0]
        if "zero_stage" in first:
            self.kind = f"ZeRO-{first['zero_stage']}"
        elif "single_partition_of_fp32_groups" in first and "group_paddings" in first:
            self.kind = "BF16_Optimizer"
        else:
            raise CheckpointError(f"{self.paths[0]}: the optimizer state has no zero_stage and is not a "
                                  "BF16_Optimizer's: not a checkpoint reshard reads")
        if "ds_zero_partition_groups" in first:
            raise CheckpointError(f"{self.paths[0]}: ZeRO-3 with ds_zero_partition_groups (hpZ / MiCS / AutoEP) "
                                  "is not supported")
        counts = first.get("partition_count")
        world = max(counts) if isinstance(counts, list) else counts
        if not isinstance(world, int) or world != len(self.paths):
            raise CheckpointError(f"{folder}: partition_count says {world} ranks but there are {len(self.paths)} "
                                  "optimizer files: a rank file is missing, or the checkpoint was overwritten")
        self.world = world


def read_flat_zero12(folder: str, states: dict, parts: _Partitions) -> SegmentedFile:
    """The fp32 masters of ZeRO-1/2 or BF16_Optimizer as one segmented file."""
    shapes = states.get("param_shapes")
    ranks = []
    for d, (path, osd) in enumerate(zip(parts.paths, parts.states)):
        groups = osd.get("single_partition_of_fp32_groups")
        if not isinstance(groups, list) or len(groups) != len(shapes):
            raise CheckpointError(f"{path}: {len(groups or [])} fp32 partitions for {len(shapes)} param groups: "
                                  "param_shapes do not match the fp32 partitions")
        row = []
        for g, t in enumerate(groups):
            loc = locate(t, path, f"single_partition_of_fp32_groups/{g}")
            row.append((d, loc.offset, loc.numel))
        ranks.append(row)
    bf16_optimizer = parts.kind == "BF16_Optimizer"
    mappings = [osd.get("param_slice_mappings") for osd in parts.states]
    segments = maps.zero12_map(folder, shapes, ranks, 4, None if bf16_optimizer else
                               parts.states[0].get("param_alignment_paddings"), bf16_optimizer,
                               [osd.get("group_paddings") for osd in parts.states],
                               mappings if all(isinstance(m, list) for m in mappings) else None)
    tensors = {name: ("F32", tuple(shape)) for group in shapes for name, shape in group.items()}
    return SegmentedFile(parts.paths, tensors, segments)


def read_flat_zero3(folder: str, model_paths: list[str], model_states: list[dict],
                    parts: _Partitions) -> SegmentedFile:
    """ZeRO-3's fp32 masters and its frozen parameters' fragments, as one segmented file."""
    world = parts.world
    if len(model_paths) != world:
        raise CheckpointError(f"{folder}: {len(model_paths)} zero_pp_rank_*_model_states.pt files for {world} "
                              "ranks: a rank file is missing")
    shapes = {}
    for group in model_states[0].get("param_shapes") or []:
        shapes.update(group)
    flats = []
    for d, (path, osd) in enumerate(zip(parts.paths, parts.states)):
        pieces = [(d, loc.offset, loc.numel) for g, t in enumerate(osd.get("fp32_flat_groups") or [])
                  for loc in [locate(t, path, f"fp32_flat_groups/{g}")]]
        flats.append(maps.Flat(pieces, 4))
    segments = maps.zero3_map(folder, shapes, flats)
    tensors = {name: ("F32", tuple(shape)) for name, shape in shapes.items()}
    frozen_tensors, frozen_segments = frozen_zero3(folder, model_paths, model_states, world)
    tensors.update(frozen_tensors)
    segments.update(frozen_segments)
    return SegmentedFile(parts.paths + model_paths, tensors, segments)


def frozen_zero3(folder: str, model_paths: list[str], model_states: list[dict], base: int) -> tuple[dict, dict]:
    """ZeRO-3's frozen parameters (``frozen_param_fragments`` of every rank's model file, which are files
    ``base + d`` of the segmented file): their (dtype, shape) and segments."""
    frozen = model_states[0].get("frozen_param_shapes") or {}
    if not frozen:
        return {}, {}
    fragments, dtype = [], None
    for d, (path, states) in enumerate(zip(model_paths, model_states)):
        mine = {}
        for name, t in (states.get("frozen_param_fragments") or {}).items():
            loc = locate(t, path, f"frozen_param_fragments/{name}")
            mine[name], dtype = (base + d, loc.offset, loc.numel), loc.dtype
        fragments.append(mine)
    segments = maps.zero3_frozen_map(folder, frozen, fragments)
    return {name: (dtype, tuple(shape)) for name, shape in frozen.items()}, segments


def read_universal(folder: str, states: dict) -> list[TensorFile]:
    """``zero/<name>/fp32.pt`` of a universal checkpoint, one file per parameter (shapes from ``param_shapes``);
    a ``shared_params`` alias's folder (a stale copy ``ds_to_universal`` writes for a tied head) is skipped."""
    shapes = {}
    for group in states.get("param_shapes") or []:
        shapes.update(group)
    files = []
    root = os.path.join(folder, "zero")
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, "fp32.pt")
        if not os.path.isfile(path) or name in (states.get("shared_params") or {}):
            continue
        obj = load(path)
        tensor = obj.get("param") if isinstance(obj, dict) else obj
        loc = locate(tensor, path, f"{name}/fp32")
        shape = tuple(shapes.get(name, loc.shape))
        if math.prod(shape) != loc.numel or loc.dtype != "F32":
            raise CheckpointError(f"{path}: {loc.dtype}{list(loc.shape)} does not hold '{name}' of shape "
                                  f"{list(shape)} in fp32: param_shapes do not match the universal checkpoint")
        files.append(TensorFile(path, {name: TensorLocation("F32", shape, loc.offset)}))
    allow_open_files(len(files) + 256)
    return files


def allow_open_files(count: int) -> None:
    """Raise this process's soft limit on open files towards ``count`` (at most the hard limit): a universal
    checkpoint is one file per parameter (over 1,000 for a 405B model), each kept open once read."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < count:
        target = count if hard == resource.RLIM_INFINITY else min(count, hard)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def read_tag(folder: str, master: bool) -> TagRead:
    """The tensors of tag folder ``folder`` (see the module docstring); ``master``: the fp32 master weights."""
    names = os.listdir(folder)
    refuse_unsupported(folder, names)
    z3_paths = rank_files(folder, names, Z3_MODEL, "model state")
    universal = os.path.isdir(os.path.join(folder, "zero"))
    if z3_paths:
        model_states = [load(p) for p in z3_paths]
        states = model_states[0]
    elif MODEL_FILE in names:
        z3_paths, model_states = [], []
        states = load(os.path.join(folder, MODEL_FILE))
    else:
        raise CheckpointError(f"{folder} has no {MODEL_FILE} or zero_pp_rank_*_model_states.pt: not a DeepSpeed "
                              "checkpoint folder")
    model_path = z3_paths[0] if z3_paths else os.path.join(folder, MODEL_FILE)
    module = module_names(states, model_path)
    dtype = training_dtype(states.get("ds_config"))
    shared = dict(states.get("shared_params") or {})
    world = int(states.get("dp_world_size") or 1)
    frozen = list(states.get("frozen_param_shapes") or {})
    module_file = TensorFile(model_path, {n: loc for n, loc in module.items() if loc.numel})
    if universal:
        stage = "universal (from ZeRO-3)" if z3_paths else "universal"
        files = read_universal(folder, states)
        held = {n for f in files for n in f.tensors}
        extra: list[TensorFile] = []
        if z3_paths and set(frozen) - held:
            tensors, segments = frozen_zero3(folder, z3_paths, model_states, 0)
            extra = [SegmentedFile(z3_paths, tensors, segments)]
        module_file.tensors = {n: loc for n, loc in module_file.tensors.items() if n not in held}
        frozen = [n for n in frozen if n not in held]
        return TagRead(files + extra + [module_file], stage, world, "fp32 masters (zero/*/fp32.pt)", dtype,
                       frozen, shared=shared)
    if not z3_paths and not master:
        kind = "ZeRO-0/1/2"
        if any(OPTIM.match(n) for n in names):
            rank_files(folder, names, OPTIM, "optimizer state")  # only checks that no rank is missing
        return TagRead([module_file], kind, world, f"module ({MODEL_FILE})", dtype, [], shared=shared)
    parts = _Partitions(folder, names)
    if z3_paths:
        seg = read_flat_zero3(folder, z3_paths, model_states, parts)
    else:
        seg = read_flat_zero12(folder, states, parts)
        frozen = [n for n in module if n not in seg.tensors]
    module_file.tensors = {n: loc for n, loc in module_file.tensors.items() if n not in seg.tensors}
    listed = {seg.path, module_file.path}  # the other rank files, listed by inspect (read through ``seg``)
    others = [TensorFile(p, {}) for p in seg.paths if p not in listed]
    return TagRead([seg, module_file, *others], parts.kind, parts.world, "fp32 masters (optimizer partitions)",
                   dtype, frozen, optimizer=parts.kind, shared=shared)


def strip_peft(files: list[TensorFile], where: str) -> None:
    """Module names of a PEFT-wrapped model without ``base_model.model.`` (and the LoRA wrapper's ``base_layer.``);
    LoRA deltas are refused."""
    for f in files:
        for name in f.tensors:
            if ".lora_" in name or "lora_A" in name or "lora_B" in name:
                raise CheckpointError(f"{where}: tensor '{name}' is a LoRA delta: merge the LoRA weights first "
                                      "(PEFT's merge_and_unload, then save), or convert the base model")
        if any(n.startswith(PEFT_PREFIX) for n in f.tensors):
            def plain(name: str) -> str:
                return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")

            f.tensors = {plain(n): loc for n, loc in f.tensors.items()}
            if isinstance(f, SegmentedFile):
                f.segments = {plain(n): s for n, s in f.segments.items()}

