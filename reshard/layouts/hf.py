"""Hugging Face layout: ``config.json`` + ``model.safetensors`` or ``model-0000i-of-0000N.safetensors`` with
``model.safetensors.index.json`` (also reads ``pytorch_model*.bin``). Tensors are canonical: full, unfused."""

from __future__ import annotations

import glob
import json
import math
import os

from reshard.core.canonical import CanonicalModel, build_canonical, match_template
from reshard.errors import CheckpointError, PlanError
from reshard.io import dtypes
from reshard.io.partial import replace_with_text
from reshard.io.safetensors_format import SafetensorsFile
from reshard.io.tensorfile import TensorFile
from reshard.io.torch_format import TorchFile
from reshard.layouts.base import (Layout, Options, Source, TargetPlan, TargetSpec, check_shape, find_side_files,
                                  pack_by_size)
from reshard.mapping import family_for_architecture

NAME = "hf"
INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; recomputed at run time


def is_weight_file(name: str) -> bool:
    """A top-level weight file or index of the HF layout."""
    return "/" not in name and (name.endswith(".safetensors") or name in (INDEX, BIN_INDEX)
                                or (name.startswith("pytorch_model") and name.endswith(".bin")))


def _weight_files(path: str) -> list[str]:
    """The checkpoint's weight files: the index's files, else *.safetensors, else pytorch_model*.bin."""
    for index_name in (INDEX, BIN_INDEX):
        index_path = os.path.join(path, index_name)
        if os.path.isfile(index_path):
            try:
                weight_map = json.load(open(index_path))["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(f"{index_path}: not a valid index (needs a 'weight_map' object)") from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to file names")
            files = sorted(set(weight_map.values()))
            for f in files:
                if not os.path.isfile(os.path.join(path, f)):
                    raise CheckpointError(f"{index_path} names {f}, which does not exist: the download is incomplete")
            return [os.path.join(path, f) for f in files]
    found = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    return found or sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))


def check_index(path: str, paths: list[str], files: list) -> None:
    """Every tensor an index names must be in the file it names."""
    for index_name in (INDEX, BIN_INDEX):
        index_path = os.path.join(path, index_name)
        if os.path.isfile(index_path):
            by_name = {os.path.relpath(p, path): f for p, f in zip(paths, files)}
            for tensor, fname in json.load(open(index_path))["weight_map"].items():
                if tensor not in by_name[os.path.normpath(fname)].tensors:
                    raise CheckpointError(f"{index_path} puts tensor '{tensor}' in {fname}, which does not hold "
                                          "it: the index and the weight files disagree (incomplete download?)")
            return


def read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no config.json: an HF checkpoint needs one") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_path}: invalid JSON ({exc})") from None


def architecture_of(config: dict, opts: Options) -> str:
    if opts.architecture:
        return opts.architecture
    archs = config.get("architectures") or []
    if not archs:
        raise CheckpointError("config.json has no 'architectures'; pass --architecture (e.g. LlamaForCausalLM)")
    return archs[0]


def open_source(path: str, opts: Options) -> Source:
    config = read_config(path)
    paths = _weight_files(path)
    if not paths:
        raise CheckpointError(f"{path} has config.json but no *.safetensors or pytorch_model*.bin weights")
    files = [TorchFile(p) if p.endswith(".bin") else SafetensorsFile(p) for p in paths]
    return build_source(path, config, files, opts, find_side_files(path))


def build_source(path: str, config: dict, files: list[TensorFile], opts: Options, side_files: list[str]) -> Source:
    """The canonical view of HF tensor files whose headers are already parsed (local files or remote headers)."""
    family = family_for_architecture(architecture_of(config, opts), opts.mapping)
    paths = [f.path for f in files]
    where: dict[str, int] = {}
    for i, f in enumerate(files):
        for name in f.tensors:
            if name in where:
                raise CheckpointError(f"tensor '{name}' is stored twice ({paths[where[name]]} and {paths[i]})")
            where[name] = i
    check_index(path, paths, files)
    matched = {}
    for name in where:
        m = match_template(family, name)
        if m is None:
            if name.endswith(IGNORED_SUFFIXES):
                continue
            raise CheckpointError(f"{path}: tensor '{name}' is not a weight of mapping '{family.name}'; "
                                  "pass --mapping FILE for this architecture")
        matched[name] = m
    present = {spec.hf for spec, _ in matched.values() if spec.optional}
    output_spec = next((s for s in family.weights if s.tied_to), None)
    has_output = output_spec is not None and output_spec.hf in where
    tied = bool(config.get("tie_word_embeddings", not has_output)) if output_spec else False
    model = build_canonical(family, config, present, tied)
    stored = []
    for name, tensor in model.tensors.items():
        if name not in where:
            raise CheckpointError(f"{path}: tensor '{name}' is missing (the config has "
                                  f"{model.num_layers} layers; is the checkpoint complete?)")
        loc = files[where[name]].tensors[name]
        check_shape(paths[where[name]], name, loc.shape, tensor.shape)
        model.dtypes[name] = loc.dtype
        stored.append((where[name], tensor.whole()))
    if tied and has_output:  # a tied model that still stores its head: a replica of the embedding, checked
        spec = next(s for s in family.weights if s.hf == output_spec.tied_to)
        stored.append((where[output_spec.hf], model.tensors[spec.hf].whole(output_spec.hf)))
    extra = set(matched) - set(model.tensors) - ({output_spec.hf} if has_output and tied else set())
    if extra:
        raise CheckpointError(f"{path}: tensor '{sorted(extra)[0]}' does not fit the config "
                              f"({model.num_layers} layers); the config does not match the weights")
    return Source(layout=NAME, root=path, model=model, files=files, stored=stored,
                  degrees={"tp": 1, "pp": 1}, info={"config": config}, side_files=side_files)


def targets(model: CanonicalModel, opts: Options) -> list[TargetSpec]:
    """Canonical tensors in HF order, packed into shards of at most ``max_shard_size`` bytes."""
    shards = pack_by_size([t.whole() for t in model.tensors.values()],
                          lambda t: dtypes.itemsize(opts.dtype or model.dtypes[t.name]) * math.prod(t.shape),
                          opts.max_shard_size)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    return [TargetSpec(n, "safetensors", s, metadata={"format": "pt"}) for n, s in zip(names, shards)]


def output_config(model: CanonicalModel, dtype: str) -> dict:
    config = dict(model.config)
    config["tie_word_embeddings"] = model.tied
    key = "dtype" if "dtype" in config and "torch_dtype" not in config else "torch_dtype"
    config[key] = dtypes.hf_config_dtype(dtype)
    return config


def write_config(out: str, model: CanonicalModel, dtype: str) -> None:
    """``config.json`` of the output (the canonical config with the output's dtype and tie flag)."""
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(output_config(model, dtype), f, indent=2, sort_keys=True)
        f.write("\n")


def finalize(out: str, model: CanonicalModel, files: list, dtype: str) -> None:
    """Write config.json, then the index last (only for a sharded output). ``files``: the plan's TargetFiles."""
    write_config(out, model, dtype)
    if len(files) > 1:
        weight_map = {t.name: spec.path for spec in files for t in spec.tensors}
        total = sum(spec.nbytes for spec in files)
        replace_with_text(os.path.join(out, INDEX),
                          json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def remote_weight_files(names: list[str], read_text) -> list[str]:
    """Which weight files of a repo listing to download: the safetensors index and the files it names, else
    ``model.safetensors``, else the top-level ``*.safetensors`` (never Mistral's ``consolidated*``);
    ``pytorch_model*.bin`` (+ index) only when no safetensors exist. Sub-folders hold other formats."""
    top = [p for p in names if "/" not in p]
    safetensors = sorted(p for p in top if p.endswith(".safetensors") and not p.startswith("consolidated"))
    if INDEX in top:
        try:
            named = sorted(set(json.loads(read_text(INDEX)).get("weight_map", {}).values()))
        except (json.JSONDecodeError, AttributeError):
            raise CheckpointError(f"{INDEX} of the repo is not a valid index (needs a 'weight_map' object)") from None
        return [INDEX, *(named or safetensors)]
    if "model.safetensors" in top:
        return ["model.safetensors"]
    if safetensors:
        return safetensors
    return sorted(p for p in top if p == BIN_INDEX or (p.startswith("pytorch_model") and p.endswith(".bin")))


class HFLayout(Layout):
    """Hugging Face: full, unfused tensors (the canonical form itself), sharded by size with an index."""

    name = NAME
    summary = "Hugging Face folder (config.json + *.safetensors or pytorch_model*.bin)"
    specificity = 0
    rank_loader = "reshard.verification.forward.hf_rank:load_rank"
    completion_markers = (INDEX, "model.safetensors")
    remote_headers = True

    def detect(self, names) -> bool:
        return "config.json" in names and any(is_weight_file(n) for n in names)

    def open(self, root: str, opts: Options) -> Source:
        return open_source(root, opts)

    def open_headers(self, where: str, config: dict, files: list[TensorFile], opts: Options) -> Source:
        return build_source(where, config, files, opts, side_files=[])

    def targets(self, source: Source, opts: Options, dtype: str) -> TargetPlan:
        if opts.tp != 1 or opts.pp != 1:
            raise PlanError("the hf layout holds the full model: --tp and --pp must be 1 for --to hf")
        return TargetPlan(targets(source.model, opts), state=dtype)

    def finalize(self, out: str, source: Source, plan, state) -> None:
        finalize(out, source.model, plan.files, state)

    def remote_files(self, names: list[str], read_text) -> list[str]:
        return remote_weight_files(names, read_text)
