"""Reading a vLLM ``sharded_state`` folder (``model-rank-{rank}-part-{part}.safetensors`` + config.json +
``reshard.json``): every rank's parts found, the TP size from ``reshard.json`` or the files' metadata (else refused),
expert parallelism and a whole vision tower told from the stored shapes, each rank's tensors checked against
:func:`.vllm_ranks.rank_tensors` and read back into the canonical model."""

from __future__ import annotations

import json
import os

from reshard.core.canonical import CanonicalModel, build_canonical
from reshard.core.pieces import StoredTensor
from reshard.core.sharding import check_vllm_degrees
from reshard.errors import CheckpointError, PlanError
from reshard.io.pair_rows import unpair_sources
from reshard.io.regular import open_regular
from reshard.io.safetensors_format import SafetensorsFile
from reshard.layouts import hf
from reshard.layouts.hf_config import read_meaning, without_dropped_settings
from reshard.layouts.base import Options, Source, check_shape
from reshard.layouts.vision import without
from reshard.layouts.vllm_ranks import (NAME, PATTERN, RECORD, _FILE, _check_names, kept_tied_name,
                                        rank_tensors)
from reshard.mapping_vlm import family_for_architecture, flat_view


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
