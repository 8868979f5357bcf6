"""torch.distributed.checkpoint folders of HF-named models, as FSDP2, accelerate and the HF Trainer save them
(reading): a folder with ``.metadata`` and ``__{rank}_{i}.distcp`` data files and no ``metadata.json`` (that one is
Megatron's ``torch_dist``), given directly or as ``pytorch_model_fsdp_0/`` inside it (accelerate's / the HF
Trainer's ``SHARDED_STATE_DICT`` in ``checkpoint-N/``). Model keys are HF names under one of the roots PyTorch's
recipes use (:data:`MODEL_PREFIXES`): bare (a plain ``dcp.save(model.state_dict())``), under ``model.``
(accelerate's and the DCP recipe's ``{"model": sd, "optim": osd}``: ``model.model.layers.0...``) or under
``app.model.`` (the DCP recipe's ``{"app": AppState}``), decided by matching the family's names, since HF names
start with ``model.`` too. Other roots (``optim``, ``optimizer``, ``lr_scheduler``, ``app.optim``, ...) and byte
items are skipped with one note naming them. Chunks are FSDP2 ``Shard(0)`` pieces (``torch.chunk`` of dim 0,
uneven allowed, no padding on disk), read in place (:mod:`reshard.layouts.dcp_chunks`).

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
from reshard.layouts.dcp_chunks import training_state
from reshard.layouts.dcp_source import METADATA, build_dcp_source, dcp_root, roots_note
from reshard.layouts import torchtitan
from reshard.mapping_vlm import family_for_architecture

NAME = "dcp"
ACCELERATE_FOLDER = "pytorch_model_fsdp_0"
FULL_STATE_DICT = "pytorch_model_fsdp.bin"
LOCAL_STATE_DICT = re.compile(r"^pytorch_model_fsdp(_\d+)?_rank\d+\.bin$")
MEGATRON_MARKER = "metadata.json"
#: Where PyTorch's recipes put the model in a DCP save: bare (``dcp.save(model.state_dict())``), ``{"model": sd}``
#: (accelerate, the DCP recipe), the DCP recipe's ``{"app": AppState}`` (``state_dict()``: ``{"model", "optim"}``).
MODEL_PREFIXES = ("", "model.", "app.model.")
RESHARD_RECORD = "reshard.json"  # beside .metadata: a torchtitan folder reshard wrote
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
_STEP = re.compile(r"^step-\d+/$")


def _known(family, name: str) -> bool:
    return (match_template(family, name, stored=True) is not None or name.endswith(hf.IGNORED_SUFFIXES)
            or any(template_layer(t, name) is not False for t in family.hf_ignore))


def model_tensors(tensors: dict[str, DcpTensor], objects, family, where: str):
    """``(model tensors under HF names, the prefix they were under, the other roots, the model's byte items)``.
    The prefix (:data:`MODEL_PREFIXES`) is the one under which most keys are the family's names (HF names start
    with ``model.`` too, so it is decided by matching); every key under it must be one, keys elsewhere are other
    roots (``optim``, ``lr_scheduler``, ...), skipped."""
    counts = {p: sum(k.startswith(p) and _known(family, k[len(p):]) for k in tensors) for p in MODEL_PREFIXES}
    prefix = max(MODEL_PREFIXES, key=lambda p: counts[p])  # the first of equals: bare before model.
    if not counts[prefix]:
        stray = next(k for k in tensors if not training_state(k))
        raise CheckpointError(f"{where}: tensor '{stray}' is not a weight of mapping '{family.name}' (bare or "
                              f"under {' or '.join(repr(p) for p in MODEL_PREFIXES if p)}): the config is another "
                              "model's, or pass --mapping FILE for this one")
    roots = {k.split(".")[0] for k in tensors if _known(family, k)}

    def inside(key: str) -> bool:
        return key.startswith(prefix) if prefix else key.split(".")[0] in roots

    named = {k[len(prefix):]: t for k, t in tensors.items() if inside(k)}
    bad = next((k for k in named if not _known(family, k)), None)
    if bad is not None:
        raise CheckpointError(f"{where}: tensor '{prefix}{bad}' is not a weight of mapping '{family.name}': the "
                              "config is another model's, or pass --mapping FILE for this one")
    others = sorted({dcp_root(k) for k in [*tensors, *objects] if not inside(k)})
    return named, prefix, others, [k for k in objects if inside(k)]


def config_folders(root: str) -> list[str]:
    """Where the HF config of a DCP folder may lie: in it, or in its parent (``checkpoint-N/`` beside
    ``pytorch_model_fsdp_0/``)."""
    return [root, os.path.dirname(os.path.abspath(root))]


def looks_torchtitan(keys) -> bool:
    return "tok_embeddings.weight" in keys or any(k.startswith("layers.") for k in keys)


def open_dcp_folder(root: str, folder: str, opts: Options) -> Source:
    tensors, objects = read_metadata(folder)
    if looks_torchtitan({k for k in tensors if not training_state(k)}):
        return torchtitan.open_source(root, opts)
    if all(training_state(k) for k in tensors):
        roots = ", ".join(sorted({dcp_root(k) for k in [*tensors, *objects]}))
        raise CheckpointError(f"{folder} holds no model tensors (only {roots}): pass the folder of the model's "
                              f"weights (accelerate's {ACCELERATE_FOLDER}/)")
    config, config_folder = training_config(config_folders(root), opts, "a torch.distributed.checkpoint folder")
    family = family_for_architecture(hf.architecture_of(config, opts), opts.mapping)
    named, prefix, others, items = model_tensors(tensors, objects, family, folder)
    notes = [f"read {os.path.relpath(folder, root) if folder != root else 'the folder'} (torch.distributed."
             f"checkpoint, HF names{f' under {prefix!r}' if prefix else ''})"]
    if others:
        notes.append(roots_note(others))
    if items:
        notes.append(f"skipped {len(items)} non-tensor item(s) among the model's keys (e.g. {items[0]})")
    read_heads_while_torch_imports(sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".distcp")))
    sides = find_side_files(config_folder, config) if config_folder else []
    source = build_dcp_source(NAME, root, folder, named, config, opts, sides, notes)
    source.info.update(keys=f"{prefix}<HF name>", skipped=others + (["non-tensor items"] if items else []))
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
                                 find_side_files(config_folder, config) if config_folder else [])
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
        folder = os.path.relpath(source.info["folder"], source.root)
        out = {"checkpoint": folder} if folder != "." else {}  # "." : the folder named is the checkpoint
        if "keys" in source.info:
            out.update(keys=source.info["keys"], skipped=source.info["skipped"])
        return out

    def rank_label(self, source: Source, relpath: str) -> str:
        m = _RANK_FILE.match(os.path.basename(relpath))
        return m.group(1) if m else "all"
