"""DeepSpeed ZeRO checkpoints (deepspeed 0.19.x ``engine.save_checkpoint``), read only.

Accepted folders: a root with ``latest`` (the tag, e.g. ``global_step2``) or ``latest_universal`` (a universal
checkpoint from ``ds_to_universal``), a tag folder itself (``*_model_states.pt``), and an HF Trainer
``checkpoint-N/`` (HF weights + ``latest`` + ``global_stepN/``: its complete HF safetensors are read unless the
fp32 master weights are asked for). ``--tag T`` overrides ``latest``. The model is described by the
``config.json`` beside ``latest`` (Trainer writes one; else in the tag folder or its parent) or ``--config
FILE``. Names are the training module's ``state_dict`` names (HF names for transformers models, PEFT's
``base_model.model.`` stripped); ``shared_params`` aliases are the family's tied head. Which bytes are read:
:mod:`reshard.layouts.deepspeed_read`; the byte maps: :mod:`reshard.layouts.deepspeed_maps`.

Output dtype: the training dtype by default (ZeRO-1/2, BF16_Optimizer: the module's bytes; ZeRO-3 and universal:
the fp32 masters cast, round to nearest even), fp32 masters with ``--master-weights`` (or ``--dtype fp32``),
frozen parameters upcast exactly from the module dtype.
"""

from __future__ import annotations

import os
import re

from reshard.errors import CheckpointError
from reshard.io.hf_files import weight_files
from reshard.layouts import deepspeed_read as ds
from reshard.layouts import hf
from reshard.layouts.base import Layout, Options, Source, find_side_files, training_config
from reshard.mapping_vlm import family_for_architecture

NAME = "deepspeed"
LATEST, LATEST_UNIVERSAL = "latest", "latest_universal"
_RANK = re.compile(r"zero_pp_rank_(\d+)_")


def _read_tag_name(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        tag = f.read().strip()
    if not tag or "/" in tag or tag in (".", ".."):
        raise CheckpointError(f"{path} holds {tag!r}, not a tag folder name: pass --tag")
    return tag


def tag_folder(root: str, opts: Options) -> tuple[str, str, str | None]:
    """``(tag folder, the folder beside latest, the tag)`` of a DeepSpeed folder (see the module docstring)."""
    for marker in (LATEST_UNIVERSAL, LATEST):
        if os.path.isfile(os.path.join(root, marker)):
            tag = opts.tag or _read_tag_name(os.path.join(root, marker))
            folder = os.path.join(root, tag)
            if not os.path.isdir(folder):
                if opts.tag:
                    raise CheckpointError(f"--tag {tag}: {root} has no folder {tag}")
                raise CheckpointError(f"{marker} names {tag}, which does not exist; pass --tag")
            return folder, root, tag
    if opts.tag:
        folder = os.path.join(root, opts.tag)
        if not os.path.isdir(folder):
            raise CheckpointError(f"--tag {opts.tag}: {root} has no folder {opts.tag}")
        return folder, root, opts.tag
    if any(ds.MODEL_STATES.match(n) for n in os.listdir(root)):
        return root, os.path.dirname(os.path.abspath(root)), os.path.basename(os.path.abspath(root))
    raise CheckpointError(f"{root} has no latest file and no *_model_states.pt: not a DeepSpeed checkpoint")


def _hf_weights(beside: str) -> bool:
    try:
        return bool(weight_files(beside))
    except CheckpointError:
        return False


def open_source(root: str, opts: Options) -> Source:
    folder, beside, tag = tag_folder(root, opts)
    master = opts.master_weights or opts.dtype == "F32"
    notes: list[str] = []
    if _hf_weights(beside) and os.path.isfile(os.path.join(beside, "config.json")):  # an HF Trainer checkpoint-N/
        if master:
            notes.append(f"read the fp32 master weights of {tag}/ (the HF weights beside it are the training "
                         "dtype's)")
        else:
            try:
                source = hf.open_source(beside, opts)
            except CheckpointError as exc:
                notes.append(f"the HF weights of {beside} are incomplete ({exc}); read {tag}/ instead")
            else:
                source.layout = NAME
                files = ", ".join(os.path.basename(f.path) for f in source.files)
                source.info["notes"].append(f"read the HF weights of the Trainer checkpoint ({files}); "
                                            f"--master-weights reads the fp32 masters of {tag}/")
                source.info["deepspeed"] = {"tag": tag, "weights_read": "HF safetensors of the Trainer folder"}
                return source
    config, found_in = training_config([beside, folder], opts, "a DeepSpeed checkpoint")
    config_path = os.path.join(found_in, "config.json") if found_in else opts.config
    read = ds.read_tag(folder, master)
    ds.strip_peft(read.files, folder)
    config = _tied(config, read, folder, opts)
    try:
        source = hf.build_source(folder, config, read.files, opts, find_side_files(beside, config))
    except CheckpointError as exc:
        if "is missing" in str(exc) and not read.frozen and read.stage != "universal":
            raise CheckpointError(f"{exc}: frozen parameters were excluded when saving "
                                  "(exclude_frozen_parameters); pass the base model with --base") from None
        raise
    model = source.model
    if master or read.weights.startswith("fp32"):
        dtype = "F32" if master else read.training_dtype
        for name in model.dtypes:
            model.dtypes[name] = dtype
    if master and read.frozen:
        notes.append(f"frozen parameters ({', '.join(read.frozen)}) are kept in the module dtype only: upcast "
                     "exactly to fp32")
    notes.append(f"read {read.weights} of DeepSpeed {read.stage} (data-parallel world {read.world}, tag {tag})")
    if read.optimizer == "BF16_Optimizer":
        notes.append("BF16_Optimizer checkpoint: deepspeed's zero_to_fp32 refuses these; reshard reads them")
    source.layout = NAME
    source.root = root
    source.info["notes"] = notes + source.info.get("notes", [])
    source.info["deepspeed"] = {"tag": tag, "stage": read.stage, "dp_world_size": read.world,
                                "weights_read": read.weights, "config": config_path,
                                **({"optimizer": read.optimizer} if read.optimizer else {}),
                                **({"frozen": read.frozen} if read.frozen else {})}
    return source


def _tied(config: dict, read: ds.TagRead, folder: str, opts: Options) -> dict:
    """``config`` tied when ``shared_params`` makes the family's head an alias of the embedding; other aliases
    are refused."""
    if not read.shared:
        return config
    family = family_for_architecture(hf.architecture_of(config, opts), opts.mapping)
    head = next((s for s in family.weights if s.tied_to), None)
    for alias, owner in read.shared.items():
        alias, owner = alias.removeprefix(ds.PEFT_PREFIX), owner.removeprefix(ds.PEFT_PREFIX)
        if head is None or (alias, owner) != (head.hf_name, head.tied_to):
            raise CheckpointError(f"{folder}: shared_params ties '{alias}' to '{owner}', which is not the tied "
                                  f"embedding of mapping '{family.name}'; pass --mapping FILE")
    return {**config, "tie_word_embeddings": True}


class DeepSpeedLayout(Layout):
    """DeepSpeed ZeRO-0/1/2/3, BF16_Optimizer and universal checkpoints, read in place (see the module docstring)."""

    name = NAME
    summary = "DeepSpeed ZeRO checkpoint (latest + TAG/*_model_states.pt, *_optim_states.pt)"
    specificity = 15  # an HF Trainer checkpoint-N/ also holds HF weights
    writes = False
    rank_loader = "reshard.verification.forward.sliced_rank:SlicedRankStream"
    reads_options = frozenset({"config", "tag", "master_weights"})

    def detect(self, names) -> bool:
        return any(ds.MODEL_STATES.match(n.rsplit("/", 1)[-1]) and n.count("/") <= 1 for n in names)

    def open(self, root: str, opts: Options) -> Source:
        return open_source(root, opts)

    def describe(self, source: Source) -> dict:
        return {"deepspeed": source.info.get("deepspeed", {})}

    def rank_label(self, source: Source, relpath: str) -> str:
        m = _RANK.search(os.path.basename(relpath))
        return f"dp{m.group(1)}" if m else "all"
