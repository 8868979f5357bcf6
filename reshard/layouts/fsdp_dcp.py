"""torch.distributed.checkpoint folders of HF-named models, as FSDP2, accelerate and the HF Trainer save them
(reading): a folder with ``.metadata`` and ``__{rank}_{i}.distcp`` data files and no ``metadata.json`` (that one is
Megatron's ``torch_dist``), given directly or as ``pytorch_model_fsdp_0/`` inside it (accelerate's / the HF
Trainer's ``SHARDED_STATE_DICT`` in ``checkpoint-N/``). Model keys are HF names, bare (a plain
``dcp.save(model.state_dict())``) or under one ``model.`` prefix (accelerate saves ``{"model": state_dict}``:
``model.model.layers.0...``, ``model.lm_head.weight``), decided by matching the family's names, since HF names
start with ``model.`` too. ``optimizer.*``, ``lr_scheduler.*``, ``dataloader.*``, ``train_state.*`` keys and byte
items are skipped with a note. Chunks are FSDP2 ``Shard(0)`` pieces (``torch.chunk`` of dim 0, uneven allowed,
no padding on disk), read in place (:mod:`reshard.layouts.dcp_chunks`).

Also accelerate's ``FULL_STATE_DICT`` file ``pytorch_model_fsdp.bin`` (a plain ``torch.save`` of HF names, read
with reshard's restricted unpickler); FSDP1's ``LOCAL_STATE_DICT`` ``pytorch_model_fsdp_rank{r}.bin`` (flat
parameters) is refused. The config is ``config.json`` in the folder or its parent (``checkpoint-N/`` beside
``pytorch_model_fsdp_0/``), else ``--config``. A folder of torchtitan names is read as :mod:`torchtitan`.
"""

from __future__ import annotations

import os
import re

from reshard.core.canonical import match_template, template_layer
from reshard.errors import CheckpointError
from reshard.io.dcp import DcpTensor, read_metadata
from reshard.io.heads import read_heads_while_torch_imports
from reshard.io.torch_format import TorchFile
from reshard.layouts import hf
from reshard.layouts.base import Layout, Options, Source, find_side_files, training_config
from reshard.layouts.dcp_chunks import TRAINING_STATE
from reshard.layouts.dcp_source import METADATA, build_dcp_source, skipped_kinds
from reshard.layouts import torchtitan
from reshard.mapping_vlm import family_for_architecture

NAME = "dcp"
ACCELERATE_FOLDER = "pytorch_model_fsdp_0"
FULL_STATE_DICT = "pytorch_model_fsdp.bin"
LOCAL_STATE_DICT = re.compile(r"^pytorch_model_fsdp(_\d+)?_rank\d+\.bin$")
MEGATRON_MARKER = "metadata.json"
PREFIX = "model."
RESHARD_RECORD = "reshard.json"  # beside .metadata: a torchtitan folder reshard wrote
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
_STEP = re.compile(r"^step-\d+/$")


def _strip_prefix(tensors: dict[str, DcpTensor], family, where: str) -> tuple[dict[str, DcpTensor], bool]:
    """``tensors`` under HF names: as saved, or with one leading ``model.`` removed, whichever matches the
    family's names (an HF model's own names start with ``model.`` too, so the prefix is decided by matching)."""
    def unknown(names) -> list[str]:
        return [n for n in names if match_template(family, n, stored=True) is None
                and not n.endswith(hf.IGNORED_SUFFIXES)
                and all(template_layer(t, n) is False for t in family.hf_ignore)]

    bare = unknown(tensors)
    if not bare:
        return tensors, False
    if all(k.startswith(PREFIX) for k in tensors):
        stripped = {k[len(PREFIX):]: t for k, t in tensors.items()}
        if not unknown(stripped):
            return stripped, True
    raise CheckpointError(f"{where}: tensor '{bare[0]}' is not a weight of mapping '{family.name}' (bare or under "
                          "one 'model.' prefix): the config is another model's, or pass --mapping FILE for this one")


def config_folders(root: str) -> list[str]:
    """Where the HF config of a DCP folder may lie: in it, or in its parent (``checkpoint-N/`` beside
    ``pytorch_model_fsdp_0/``)."""
    return [root, os.path.dirname(os.path.abspath(root))]


def looks_torchtitan(keys) -> bool:
    return "tok_embeddings.weight" in keys or any(k.startswith("layers.") for k in keys)


def open_dcp_folder(root: str, folder: str, opts: Options) -> Source:
    tensors, objects = read_metadata(folder)
    model_keys = {k: t for k, t in tensors.items() if not k.startswith(TRAINING_STATE)}
    if looks_torchtitan(model_keys):
        return torchtitan.open_source(root, opts)
    if not model_keys:
        raise CheckpointError(f"{folder} holds no model tensors (only {', '.join(skipped_kinds(tensors))}): pass the "
                              f"folder of the model's weights (accelerate's {ACCELERATE_FOLDER}/)")
    config, config_folder = training_config(config_folders(root), opts, "a torch.distributed.checkpoint folder")
    family = family_for_architecture(hf.architecture_of(config, opts), opts.mapping)
    named, prefixed = _strip_prefix(model_keys, family, folder)
    skipped = skipped_kinds(set(tensors) - set(model_keys) | set(objects))
    notes = [f"read {os.path.relpath(folder, root) if folder != root else 'the folder'} (torch.distributed."
             f"checkpoint, {'model.-prefixed ' if prefixed else ''}HF names)"]
    if skipped:
        notes.append(f"skipped {', '.join(skipped)} (not model weights)")
    read_heads_while_torch_imports(sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".distcp")))
    sides = find_side_files(config_folder) if config_folder else []
    source = build_dcp_source(NAME, root, folder, named, config, opts, sides, notes)
    source.info.update(keys="model.<HF name>" if prefixed else "<HF name>", skipped=skipped)
    return source


def open_source(path: str, opts: Options) -> Source:
    names = set(os.listdir(path))
    if os.path.isfile(os.path.join(path, ACCELERATE_FOLDER, METADATA)):
        return open_dcp_folder(path, os.path.join(path, ACCELERATE_FOLDER), opts)
    if METADATA in names:
        return open_dcp_folder(path, path, opts)
    if FULL_STATE_DICT in names:
        config, config_folder = training_config(config_folders(path), opts, f"accelerate's {FULL_STATE_DICT}")
        bin_path = os.path.join(path, FULL_STATE_DICT)
        read_heads_while_torch_imports([bin_path])
        source = hf.build_source(path, config, [TorchFile(bin_path)], opts,
                                 find_side_files(config_folder) if config_folder else [])
        source.layout = NAME
        source.info["notes"].append(f"read {FULL_STATE_DICT} (accelerate FULL_STATE_DICT, HF names)")
        source.info["folder"] = path
        return source
    rank_files = sorted(n for n in names if LOCAL_STATE_DICT.match(n))
    if rank_files:
        raise CheckpointError(f"{path}: {rank_files[0]} is an FSDP1 LOCAL_STATE_DICT shard (flattened parameters "
                              "without their layout), which cannot be converted: save with fsdp_state_dict_type "
                              "SHARDED_STATE_DICT or FULL_STATE_DICT")
    raise CheckpointError(f"{path}: no {METADATA}, {ACCELERATE_FOLDER}/ or {FULL_STATE_DICT}: not a "
                          "torch.distributed.checkpoint folder")


class DcpLayout(Layout):
    """FSDP2 / accelerate / HF Trainer torch.distributed.checkpoint folders of HF-named models (read only)."""

    name = NAME
    summary = ("torch.distributed.checkpoint folder from FSDP2 / accelerate (.metadata or pytorch_model_fsdp_0/, "
               "HF names; also pytorch_model_fsdp.bin)")
    specificity = 15  # an HF Trainer checkpoint-N/ also holds config.json (and pytorch_model_fsdp*.bin is a .bin)
    writes = False
    rank_loader = "reshard.verification.forward.sliced_rank:SlicedRankStream"
    reads_options = frozenset({"config"})

    def detect(self, names) -> bool:
        if MEGATRON_MARKER in names or RESHARD_RECORD in names or any(_STEP.match(n) for n in names):
            return False  # torch_dist, reshard's torchtitan output, a torchtitan root
        return (METADATA in names or f"{ACCELERATE_FOLDER}/{METADATA}" in names or FULL_STATE_DICT in names
                or any(LOCAL_STATE_DICT.match(n) for n in names))

    def open(self, root: str, opts: Options) -> Source:
        return open_source(root, opts)

    def describe(self, source: Source) -> dict:
        out = {"checkpoint": os.path.relpath(source.info["folder"], source.root)}
        if "keys" in source.info:
            out.update(keys=source.info["keys"], skipped=source.info["skipped"])
        return out

    def rank_label(self, source: Source, relpath: str) -> str:
        m = _RANK_FILE.match(os.path.basename(relpath))
        return m.group(1) if m else "all"
