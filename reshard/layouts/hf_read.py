"""Reading a Hugging Face folder (``config.json`` + ``model.safetensors`` or ``model-0000i-of-0000N.safetensors`` with
``model.safetensors.index.json``; also ``pytorch_model*.bin``) into a :class:`~reshard.layouts.base.Source`: the
config (or ``--config``), the architecture, the index checked against the files, each stored name matched to the
family's mapping (fused ``hf_stored`` / ``hf_transposed`` tensors, the optional prefix of old files, ``[hf] ignore``
buffers dropped), MTP layers held or not; and which files of a remote repo listing to download."""

from __future__ import annotations

import json
import os
from dataclasses import replace

from reshard.core.canonical import build_canonical, match_template, template_layer
from reshard.core.counts import check_counts
from reshard.errors import CheckpointError, PlanError
from reshard.io import dtypes, fp8, mxfp4
from reshard.io.hf_files import BIN_INDEX, INDEX, is_other_format, weight_files
from reshard.io.pair_rows import unpair_sources
from reshard.io.regular import open_regular
from reshard.io.safetensors_format import SafetensorsFile
from reshard.io.tensorfile import TensorFile
from reshard.io.torch_format import TorchFile
from reshard.layouts.base import Options, Source, check_shape, chosen_architecture, read_json_object
from reshard.layouts.hf_config import read_meaning, without_dropped_settings
from reshard.layouts.hf_spelling import respell_read
from reshard.layouts.hf_write import hf_tensors
from reshard.layouts import llama4_text
from reshard.layouts import ernie_rules
from reshard.layouts import qwen3_next_mtp
from reshard.layouts.vision import unused_tower_tensor
from reshard.mapping_vlm import family_for_architecture, flat_view
from reshard.side_files import find_side_files


NAME = "hf"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; recomputed at run time


def check_index(path: str, paths: list[str], files: list) -> None:
    """Every tensor an index names must be in the file it names."""
    for index_name in (INDEX, BIN_INDEX):
        index_path = os.path.join(path, index_name)
        if os.path.isfile(index_path):
            by_name = {os.path.relpath(p, path): f for p, f in zip(paths, files)}
            with open_regular(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            for tensor, fname in weight_map.items():
                if tensor not in by_name[os.path.normpath(fname)].tensors:
                    raise CheckpointError(f"{index_path} puts tensor '{tensor}' in {fname}, which does not hold "
                                          "it: the index and the weight files disagree (incomplete download?)")
            return


def read_config(path: str) -> dict:
    return read_json_object(os.path.join(path, "config.json"), "an HF checkpoint")


def side_files(path: str, config: dict) -> list[str]:
    """The side files of HF-style folder ``path`` whose config.json is ``config``: tokenizer, generation config
    and the remote code ``auto_map`` names (:func:`reshard.side_files.find_side_files`)."""
    return find_side_files([path], config)


def architecture_of(config: dict, opts: Options, where: str = "config.json") -> str:
    """The architecture ``config`` names, or ``--architecture`` (:func:`chosen_architecture`: forcing another is
    refused unless allowed lossy)."""
    archs = config.get("architectures") or []
    valid = isinstance(archs, list) and all(isinstance(a, str) for a in archs)
    chosen = chosen_architecture(archs[0] if valid and archs else None, opts, where)
    if chosen:
        return chosen
    if not valid:
        raise CheckpointError(f"config.json 'architectures' must be a list of class names such as "
                              f"[\"LlamaForCausalLM\"], not {json.dumps(archs)}; fix it or pass --architecture")
    raise CheckpointError("config.json has no 'architectures'; pass --architecture (e.g. LlamaForCausalLM)")


def relabel_notes(config: dict, architecture: str) -> list[str]:
    """A note when ``architecture`` (forced, allowed lossy) is not the one ``config`` names."""
    archs = config.get("architectures")
    named = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    return [f"relabelled {named} as {architecture} (--allow-lossy-config architecture)"] \
        if named and named != architecture else []


def source_config(path: str, opts: Options) -> tuple[dict, list[str]]:
    """(config, notes) of HF folder ``path``: its ``config.json``; ``--config`` where it saves none (noted where
    given beside one); neither is a one-line refusal naming both fixes."""
    own = os.path.join(path, "config.json")
    if os.path.lexists(own):
        return read_config(path), [f"--config {opts.config} not read: {path} has its own config.json"] \
            if opts.config else []
    if opts.config:
        return read_json_object(opts.config, "--config"), [f"read the model config from --config {opts.config}"]
    raise CheckpointError(f"{path} holds Hugging Face weights but no config.json: add the model's config.json "
                          "to it, or pass --config FILE")


def open_source(path: str, opts: Options) -> Source:
    config, config_notes = source_config(path, opts)
    paths = weight_files(path)
    if not paths:
        raise CheckpointError(f"{path} has config.json but no *.safetensors or pytorch_model*.bin weights")
    files = [TorchFile(p) if p.endswith(".bin") else SafetensorsFile(p) for p in paths]
    source = build_source(path, config, files, opts, side_files(path, config))
    source.info["notes"][:0] = config_notes
    if opts.config and not os.path.lexists(os.path.join(path, "config.json")):
        source.info["read_options"] = ["config"]  # convert refuses --config on a folder with its own
    skipped = sorted(n for n in os.listdir(path) if n.endswith(".safetensors") and is_other_format(n)
                     and os.path.join(path, n) not in paths)
    if skipped:
        source.info["notes"].append(f"skipped {', '.join(skipped)}: not the model's weights (Mistral's "
                                    "consolidated format or a PEFT adapter)")
    return source


def build_source(path: str, config: dict, files: list[TensorFile], opts: Options, side_files: list[str]) -> Source:
    """The canonical view of HF tensor files whose headers are already parsed (local files or remote headers)."""
    architecture = architecture_of(config, opts, os.path.join(path, "config.json"))
    config, files, mx_notes, mx_stored = mxfp4.source_view(path, config, files, opts)  # gpt-oss's release
    quantized = fp8.find_fp8(path, config, files)  # refuses every quantized form but block FP8
    config, architecture, text_only = llama4_text.text_view(config, architecture)  # Llama 4's VLM: its text model
    family = family_for_architecture(architecture, opts.mapping, config)
    if family.multimodal:
        config = flat_view(config)
    notes = relabel_notes(config, architecture) + mx_notes
    if opts.keep_fp8 and quantized is None:
        raise PlanError(f"--keep-fp8: {path} has no FP8 weights; drop --keep-fp8")
    if quantized is not None:
        notes.append(fp8.note(quantized, None if opts.keep_fp8 else dtypes.torch_name(opts.dtype or "BF16")))
        if not opts.keep_fp8:  # the output holds dequantised weights: it is not a quantized checkpoint
            config = {k: v for k, v in config.items() if k != "quantization_config"}
            files = fp8.wrap(files, quantized)
    config, dropped_settings = without_dropped_settings(config, family, opts.allow_lossy_config)
    notes += dropped_settings
    paths = [f.path for f in files]
    where: dict[str, int] = {}
    scales = (quantized.scales if quantized else set()) | mx_stored
    for i, f in enumerate(files):
        for name in f.tensors:
            if name in scales:
                continue
            if name in where:
                raise CheckpointError(f"tensor '{name}' is stored twice ({paths[where[name]]} and {paths[i]})")
            where[name] = i
    check_index(path, paths, files)
    file_names = _add_optional_prefix(family, where) if not family.multimodal else respell_read(family, where, notes)
    file_names.update(llama4_text.text_names(where, notes) if text_only else {})
    file_names.update(qwen3_next_mtp.read_names(family, config, where))  # mtp.* -> model.layers.{L+k}
    fused = any(match_template(family, n, fused=True) is not None and match_template(family, n, stored=True) is None
                for n in where)
    matched, dropped = {}, []
    for name in where:
        m = match_template(family, name, stored=True, fused=fused)
        if m is None and family.hf_drop_prefix and name.startswith(family.hf_drop_prefix):
            dropped.append(name)
            continue
        if m is None:
            if name.endswith(IGNORED_SUFFIXES) or any(template_layer(t, name) is not False for t in family.hf_ignore):
                continue
            raise CheckpointError(f"{path}: tensor '{name}' is not a weight of mapping '{family.name}'; "
                                  "pass --mapping FILE for this architecture")
        matched[name] = m
    ernie_rules.read_views(family, files, where, file_names, matched)  # hf_shape: the canonical shape
    if dropped:
        notes.append(f"dropped {len(dropped)} tensors under '{family.hf_drop_prefix}' (e.g. {dropped[0]}): mapping "
                     f"'{family.name}' does not carry them{qwen3_next_mtp.drop_hint(family)}")
        where = {n: i for n, i in where.items() if n not in set(dropped)}
    check_counts(family, config, {layer for _, layer in matched.values()},  # before anything per layer is built
                 {n: files[where[n]].tensors[file_names.get(n, n)].shape for n in matched},
                 os.path.join(path, "config.json"))
    present = {s.hf for spec, _ in matched.values() for s in family.weights
               if s.optional and s.hf_name == spec.hf_name}
    if fused and not any(s.hf_fused_on_disk for s in family.weights):
        notes.append("read transformers 5's fused expert tensors (mlp.experts.gate_up_proj / down_proj); the HF "
                     "output writes them per expert, as save_pretrained does by default")
    output_spec = next((s for s in family.weights if s.tied_to), None)
    has_output = output_spec is not None and output_spec.hf_name in where
    tied = bool(config.get("tie_word_embeddings", not has_output)) if output_spec else False
    if output_spec and "tie_word_embeddings" not in config and not has_output:
        notes.append(f"config.json has no tie_word_embeddings and there is no {output_spec.hf_name}: taken as tied "
                     "(the weights hold no separate head; add \"tie_word_embeddings\": true to say so)")
    mtp = _mtp_layers_held(family, config, {layer for _, layer in matched.values()}, notes)
    model = build_canonical(family, config, present, tied, mtp)
    model.meaning = read_meaning(config, family, architecture, model.dims, present, tied, path).replace(
        mtp_layers=len(model.mtp_layers))
    stored, absent = [], []
    for tensor in hf_tensors(model, fused):
        name = tensor.name
        if name not in where and unused_tower_tensor(model, tensor):
            absent.append(name)
            continue
        if name not in where:  # an MTP layer's tensors, its embedding and head copies included, name their layer
            layer = (match_template(family, name, stored=True) or (None, None))[1]
            if layer is not None and layer in model.mtp_layers:
                raise CheckpointError(f"{path}: MTP layer {layer} (multi-token prediction) is partly present: "
                                      f"tensor '{name}' is missing; complete the checkpoint, or set "
                                      f"{family.mtp['layers']} to {layer - model.num_layers} in config.json to "
                                      "read it without its MTP layers")
            raise CheckpointError(f"{path}: tensor '{name}' is missing (the config has "
                                  f"{model.num_layers} layers; is the checkpoint complete?)")
        if name in file_names:  # stored without the optional prefix: read under the file's own name
            tensor = replace(tensor, name=file_names[name])
        loc = files[where[name]].tensors[tensor.name]
        check_shape(paths[where[name]], name, loc.shape, tensor.shape)
        for piece in tensor.pieces:
            model.dtypes[piece.canonical] = "BF16" if loc.dtype == fp8.FP8 and not opts.keep_fp8 else loc.dtype
        stored.append((where[name], tensor))
    if tied and has_output:  # a tied model that still stores its head: a replica of the embedding, checked
        spec = next(s for s in family.weights if s.hf == output_spec.tied_to)
        stored.append((where[output_spec.hf_name], model.tensors[spec.hf].whole(output_spec.hf_name,
                                                                                 output_spec.hf_transposed)))
    inverse = {file: name for name, file in file_names.items()}
    extra = set(matched) - {inverse.get(t.name, t.name) for _, t in stored}
    if extra:
        raise CheckpointError(f"{path}: tensor '{sorted(extra)[0]}' does not fit the config "
                              f"({model.num_layers} layers); the config does not match the weights")
    if absent:
        notes.append(f"the files hold no {len(absent)} vision tensors the model does not use (e.g. {absent[0]}): "
                     "read as absent")
    info = {"config": config, "notes": notes}
    if quantized is not None:
        info["fp8"] = quantized.describe(None if opts.keep_fp8 else "bfloat16")
        if opts.keep_fp8:
            fp8.add_scales(model, quantized, stored, {t.name: t.pieces[0].canonical for _, t in stored})
    files, stored = unpair_sources(files, stored)  # gpt-oss's alternating gate/up read end to end
    return Source(layout=NAME, root=path, model=model, files=files, stored=stored,
                  degrees={"tp": 1, "pp": 1}, info=info, side_files=side_files)


def _mtp_layers_held(family, config: dict, held: set[int | None], notes: list[str]) -> int:
    """How many of the MTP layers ``config`` declares the files hold (``held``: the layers of the stored weights):
    all of them, or none when no tensor of those layers is stored (transformers' ``save_pretrained`` keeps
    ``num_nextn_predict_layers`` but writes no MTP tensors), with a note; a partly stored set is refused when its
    missing tensors are looked up."""
    declared = family.mtp_count(config)
    if not declared:
        return 0
    layers = int(config[family.dim_key("L")])
    if not held & set(range(layers, layers + declared)):
        notes.append(f"config.json declares {declared} MTP layer(s) ({family.mtp['layers']}) but the files hold no "
                     "tensor of them (as transformers' save_pretrained writes): read as having none; every output "
                     f"says {family.mtp['layers']} = 0")
        return 0
    return declared


def _add_optional_prefix(family, where: dict[str, int]) -> dict[str, str]:
    """Names an old file stores without the family's optional prefix (GPT-2 files without ``transformer.``) are
    renamed in ``where`` to the prefixed form the mapping spells; returns prefixed name -> the file's name."""
    prefix = family.hf_optional_prefix
    renamed = {}
    for name in list(where):
        full = prefix + name
        if not prefix or name.startswith(prefix) or full in where or match_template(family, name, stored=True):
            continue
        known = match_template(family, full, stored=True) is not None or \
            any(template_layer(t, full) is not False for t in family.hf_ignore)
        if known:
            where[full] = where.pop(name)
            renamed[full] = name
    return renamed


def remote_weight_files(names: list[str], read_text) -> list[str]:
    """Which weight files of a repo listing to download: the safetensors index and the files it names, else
    ``model.safetensors``, else the top-level ``*.safetensors`` (never Mistral's ``consolidated*``);
    ``pytorch_model*.bin`` (+ index) only when no safetensors exist. Sub-folders hold other formats."""
    top = [p for p in names if "/" not in p]
    safetensors = sorted(p for p in top if p.endswith(".safetensors") and not is_other_format(p))
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
