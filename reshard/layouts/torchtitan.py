"""torchtitan checkpoints (reading and writing): torch.distributed.checkpoint folders of torchtitan-named models.

Reading: a root whose ``step-N/`` folders each hold ``.metadata`` and ``__{rank}_{i}.distcp`` (the newest step
that has ``.metadata`` is read: torchtitan writes it last), or a ``step-N/`` folder itself. Model keys are at the
top level in torchtitan's names, either spelling (:mod:`torchtitan_names`); a full checkpoint's other roots
(``optimizer``, ``lr_scheduler``, ``dataloader``, ``train_state``, byte items) are skipped with one note naming them,
a ``freqs_cis`` buffer with another.
Llama-family ``wq`` / ``wk`` rows are in Meta's interleaved-RoPE order, Qwen3's in HF's order; Qwen3 MoE
(stacked experts) is refused. torchtitan saves no model config: ``--config`` (the HF config.json) is required,
except for a folder reshard wrote (its ``config.json`` beside ``reshard.json``).
Dtypes are as stored (fp32 for full checkpoints, ``export_dtype`` for model-only ones).

Writing (``--to torchtitan``): the model-only folder ``checkpoint.initial_load_path`` loads, ``.metadata``
directly in the output folder (written last) and ``__{i}_0.distcp`` data files, one whole-tensor chunk per
weight, no ``freqs_cis``, in torchtitan's current names or, with ``--torchtitan-names v0.2``, its v0.2 names. A tied
model writes no output weight (torchtitan's weight tying shares ``tok_embeddings.weight``). Beside them, files
torchtitan's loader never opens: the model's ``config.json`` (and tokenizer files, an ``hf_assets_path``) and
``reshard.json`` (which marks the folder as reshard's torchtitan output, so it reads back without ``--config``).
"""

from __future__ import annotations

import json
import math
import os
import re

from reshard.core.pieces import StoredTensor
from reshard.errors import CheckpointError, PlanError
from reshard.io import dtypes
from reshard.io.dcp import metadata_pickle, read_metadata, written_chunks
from reshard.io.heads import read_heads_while_torch_imports
from reshard.io.partial import replace_with_text
from reshard.layouts import hf
from reshard.layouts.base import (Layout, Options, Source, TargetPlan, TargetSpec, find_side_files, pack_by_size,
                                  read_json_object, stored_dtype)
from reshard.layouts.dcp_chunks import training_state
from reshard.layouts.dcp_source import METADATA, build_dcp_source, dcp_root, roots_note
from reshard.layouts.torchtitan_names import FAMILIES, hf_name, titan_name
from reshard.mapping_vlm import family_for_architecture

NAME = "torchtitan"
_STEP = re.compile(r"^step-(\d+)$")
RECORD = "reshard.json"
DATA_FILES = 2  # __0_0.distcp, __1_0.distcp: two writer processes can share the work


def step_folder(path: str) -> tuple[str, str, list[str]]:
    """(folder read, its step label, notes) of a root of ``step-N/`` folders or a step folder itself."""
    if os.path.isfile(os.path.join(path, METADATA)):
        return path, os.path.basename(os.path.normpath(path)), []
    steps = sorted((int(m.group(1)), n) for n in os.listdir(path)
                   if (m := _STEP.match(n)) and os.path.isdir(os.path.join(path, n)))
    complete = [(s, n) for s, n in steps if os.path.isfile(os.path.join(path, n, METADATA))]
    if not complete:
        raise CheckpointError(f"{path}: no step-N folder holds {METADATA} (torchtitan writes it last): the "
                              "checkpoint is incomplete")
    newest = complete[-1][1]
    notes = [f"read {newest}, the newest complete step"]
    if steps[-1] != complete[-1]:
        notes.append(f"{steps[-1][1]} has no {METADATA} (an interrupted save): skipped")
    return os.path.join(path, newest), newest, notes


def incomplete_step(path: str, names) -> str | None:
    """The one-line refusal of a ``step-N`` folder named directly whose save did not finish (``.distcp`` data,
    no ``.metadata``: torchtitan writes it last), naming the complete steps beside it; None for another folder.
    ``names``: the folder's listing."""
    if not _STEP.match(os.path.basename(os.path.normpath(path))) or METADATA in names \
            or not any(n.endswith(".distcp") and "/" not in n for n in names):
        return None
    parent = os.path.dirname(os.path.abspath(path))
    complete = sorted((int(m.group(1)), n) for n in os.listdir(parent)
                      if (m := _STEP.match(n)) and os.path.isfile(os.path.join(parent, n, METADATA)))
    fix = (f"name a complete step ({', '.join(n for _, n in complete)}) or the parent folder {parent} to read "
           f"the newest complete one" if complete else
           f"no step of {parent} is complete: save the checkpoint again")
    return (f"{path} is an incomplete torchtitan step: it has .distcp data but no {METADATA} (torchtitan writes it "
            f"last, so the save was interrupted); {fix}")


def titan_family(config: dict, opts: Options, where: str):
    family = family_for_architecture(hf.architecture_of(config, opts, where), opts.mapping)
    if family.name not in FAMILIES:
        kind = "Mixture-of-Experts (stacked experts) " if family.moe else ""
        raise CheckpointError(f"{where}: torchtitan {kind}checkpoints of mapping '{family.name}' are not supported: "
                              "reshard reads torchtitan's dense Llama and Qwen3 models")
    return family


def open_source(path: str, opts: Options) -> Source:
    folder, step, notes = step_folder(path)
    config_path = opts.config
    if not config_path and os.path.isfile(os.path.join(folder, RECORD)):
        config_path = os.path.join(folder, "config.json")  # written by reshard's --to torchtitan
    if not config_path:
        raise CheckpointError(f"{path}: torchtitan saves no model config: pass --config FILE (the model's Hugging "
                              "Face config.json, e.g. the one in torchtitan's hf_assets_path)")
    config = read_json_object(config_path, "a torchtitan checkpoint")
    family = titan_family(config, opts, config_path)
    tensors, objects = read_metadata(folder)
    named, spellings, skipped = {}, set(), {dcp_root(k) for k in objects}
    for key, tensor in tensors.items():
        if training_state(key):
            skipped.add(dcp_root(key))
            continue
        found = hf_name(key, folder)
        if found is None:
            notes.append(f"skipped the {key} buffer (recomputed from the config)")
            continue
        name, spelling = found
        if name in named:
            raise CheckpointError(f"{folder}: '{named[name].key}' and '{key}' both hold {name}: the checkpoint "
                                  "mixes two models")
        named[name] = tensor
        spellings.add(spelling)
    if not named:
        raise CheckpointError(f"{folder} holds no model tensors (only {', '.join(sorted(skipped))}): pass a step "
                              "saved with the model's weights")
    if skipped:
        notes.append(roots_note(skipped))
    read_heads_while_torch_imports(sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".distcp")))
    sides = find_side_files(os.path.dirname(os.path.abspath(config_path)), config)  # the HF assets torchtitan was given
    source = build_dcp_source(NAME, path, folder, named, config, opts, sides, notes, interleaved=FAMILIES[family.name])
    source.info.update(step=step, names=" + ".join(sorted(spellings - {None})) or "either",
                       rope_order="interleaved (Meta)" if FAMILIES[family.name] else "rotate-half (HF)")
    return source


# ---------------------------------------------------------------------------------------------- writing

def titan_tensors(source: Source, spelling: str) -> list[StoredTensor]:
    """The model's tensors whole under torchtitan names, Llama's q / k rows in interleaved-RoPE order."""
    model = source.model
    family = model.family.name
    if family not in FAMILIES:
        raise PlanError(f"--to torchtitan writes Llama and Qwen3 dense models; this is mapping '{family}'")
    if model.meaning.sliding_window:
        raise PlanError("torchtitan's Llama and Qwen3 attend to every position: a sliding-window model cannot be "
                        "written --to torchtitan")
    head_dim = model.head_dim
    out = []
    for tensor in hf.hf_tensors(model):
        role = model.tensors[tensor.pieces[0].canonical].spec.role
        interleaved = head_dim if FAMILIES[family] and role in ("q", "k") else 0
        out.append(StoredTensor(titan_name(tensor.name, spelling, family), tensor.shape, tensor.axis, tensor.pieces,
                                interleaved=interleaved))
    return out


def targets(source: Source, opts: Options, dtype: str) -> TargetPlan:
    if opts.tp != 1 or opts.pp != 1:
        raise PlanError("a torchtitan checkpoint holds whole tensors (torch.distributed.checkpoint reshards them "
                        "when torchtitan loads): --tp and --pp must be 1 for --to torchtitan")
    tensors = titan_tensors(source, opts.torchtitan_names)
    size = {t.name: dtypes.itemsize(stored_dtype(source.model, t, opts, dtype)) * math.prod(t.shape) for t in tensors}
    groups = pack_by_size(tensors, lambda t: size[t.name], max(1, sum(size.values()) // DATA_FILES + 1))
    specs = [TargetSpec(f"__{i}_0.distcp", "distcp", group,
                        payload={"saved_shapes": {t.name: t.shape for t in group}, "objects": []})
             for i, group in enumerate(groups)]
    notes = []
    if source.model.tied:
        notes.append("tied embeddings: no output weight written (torchtitan's enable_weight_tying shares "
                     "tok_embeddings.weight)")
    config, lost = hf.planned_config(source.model, dtype, opts, "torchtitan")
    record = {"layout": NAME, "torchtitan_names": opts.torchtitan_names}
    return TargetPlan(specs, state={"shapes": {t.name: t.shape for t in tensors}, "config": config,
                                    "record": record}, notes=notes + lost)


def finalize(out: str, plan, state) -> None:
    """``config.json``, ``reshard.json``, then ``.metadata`` (from where each archive landed) last, through a
    temporary name: a folder without it is incomplete to torchtitan and to reshard."""
    hf.write_config(out, state["config"])
    replace_with_text(os.path.join(out, RECORD), json.dumps(state["record"], indent=2) + "\n")
    dtype_of = {t.name: t.dtype for f in plan.files for t in f.tensors}
    tensors, storage = {}, {}
    for spec in plan.files:
        for name, offset, length in written_chunks(os.path.join(out, spec.path)):
            shape = state["shapes"][name]
            origin = (0,) * len(shape)
            tensors[name] = (dtype_of[name], shape, [(origin, shape)])
            storage[(name, origin)] = (spec.path, offset, length)
    partial = os.path.join(out, METADATA + ".partial")
    with open(partial, "wb") as f:
        f.write(metadata_pickle(tensors, [], storage, "."))
    os.replace(partial, os.path.join(out, METADATA))


class TorchtitanLayout(Layout):
    """torchtitan's torch.distributed.checkpoint folders (``step-N/``), read and written (model only)."""

    name = NAME
    summary = "torchtitan DCP checkpoint (step-N/.metadata, torchtitan names; needs --config)"
    specificity = 16  # a step-N/ folder passed directly is detected as dcp, which hands torchtitan names here
    writes = True
    rank_loader = "reshard.verification.forward.sliced_rank:SlicedRankStream"
    reads_options = frozenset({"config"})
    completion_markers = (METADATA,)
    uses_options = frozenset({"torchtitan_names"})

    def detect(self, names) -> bool:
        """A root of ``step-N/`` folders holding DCP files (not Megatron's: no ``metadata.json``; an incomplete
        newest step is skipped by :func:`step_folder`, a root without a complete one refused there), or a folder
        reshard wrote (``.metadata`` beside ``reshard.json``)."""
        if METADATA in names and RECORD in names and "metadata.json" not in names:
            return True
        steps = {n.split("/")[0] for n in names if n.count("/") == 1 and _STEP.match(n.split("/")[0])
                 and (n.endswith("/" + METADATA) or n.endswith(".distcp"))}
        return any(f"{s}/metadata.json" not in names for s in steps)

    def open(self, root: str, opts: Options) -> Source:
        return open_source(root, opts)

    def targets(self, source: Source, opts: Options, dtype: str) -> TargetPlan:
        return targets(source, opts, dtype)

    def finalize(self, out: str, source: Source, plan, state) -> None:
        finalize(out, plan, state)

    def describe(self, source: Source) -> dict:
        step = source.info["step"]  # a folder's own name (reshard's output) is not a step
        return {**({"step": step} if _STEP.match(step) else {}), "names": source.info["names"],
                "rope_order": source.info["rope_order"]}

    def rank_label(self, source: Source, relpath: str) -> str:
        m = re.match(r"^__(\d+)_\d+\.distcp$", os.path.basename(relpath))
        return m.group(1) if m else "all"
