"""The canonical model of a live job, built from its config alone: an HF-style ``config.json`` (a dict, the file,
or a checkpoint folder holding one), no weight file.

The :class:`reshard.layouts.base.Source` made here is an HF view with no files: its canonical tensors, their
dtypes (``dtype`` given, else the config's ``torch_dtype`` / ``dtype``; a mapping's pinned dtype, such as an fp32
router bias, wins) and its meaning. Optional weights (biases) are those the architecture's config spelling
switches on (``attention_bias``, ``mlp_bias``, ...); embeddings are tied when ``tie_word_embeddings`` says so
(absent: untied, transformers' Llama default).
"""

from __future__ import annotations

import dataclasses
import os

from reshard.core.canonical import build_canonical
from reshard.errors import CheckpointError, PlanError
from reshard.io import dtypes
from reshard.layouts.base import Options, Source, read_json_object
from reshard.layouts.hf import architecture_of, hf_tensors
from reshard.layouts.hf_config import read_meaning, without_dropped_settings
from reshard.mapping_vlm import family_for_architecture, flat_view

#: Keys of a ``source`` / ``target`` dict that are not :class:`Options` fields.
SPEC_KEYS = ("layout",)
_OPTION_FIELDS = {f.name for f in dataclasses.fields(Options)}


def read_config(config) -> tuple[dict, str]:
    """(the config dict, where it came from) for a dict, a ``config.json`` path or a folder holding one."""
    if isinstance(config, dict):
        return dict(config), "config"
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no config.json; live.plan needs the model's HF-style config (a dict, a "
                              "config.json path or a folder holding one)")
    return read_json_object(path, "live.plan"), path


def options(spec: dict, what: str) -> tuple[str, Options]:
    """(layout name, Options) of a ``source`` / ``target`` dict: ``layout`` plus :class:`Options` fields such as
    ``tp``, ``pp``, ``ep``, ``etp``, ``expert_parallel``, ``megatron_spec``, ``vocab_divisor``, ``dtype``."""
    if not isinstance(spec, dict) or "layout" not in spec:
        raise PlanError(f"live.plan: {what} must be a dict naming its layout, e.g. {{'layout': 'megatron', 'tp': 2}}")
    unknown = sorted(set(spec) - set(SPEC_KEYS) - _OPTION_FIELDS)
    if unknown:
        raise PlanError(f"live.plan: unknown {what} key '{unknown[0]}' (keys: layout, "
                        f"{', '.join(sorted(_OPTION_FIELDS))})")
    fields = {k: v for k, v in spec.items() if k in _OPTION_FIELDS}
    if fields.get("dtype") is not None:
        fields["dtype"] = dtype_name(fields["dtype"])
    return spec["layout"], Options(**fields)


#: A user dtype as a safetensors name (the Python API's rule, shared with ``load_rank``).
dtype_name = dtypes.as_dtype_name


def _present_optional(family, architecture: str, config: dict) -> set[str]:
    """The optional weights (bias groups) the architecture's config spelling switches on in ``config``."""
    spelling = family.config.architecture(architecture)
    switches = dict(spelling.biases) if spelling else {}
    present = set()
    for group, templates in family.config.bias_groups:
        on = switches.get(group, False)
        if isinstance(on, str):
            on = bool(config.get(on, False))
        if on:
            present.update(templates)
    return present


def config_source(config, opts: Options, dtype: str | None = None) -> Source:
    """The canonical view of the model ``config`` describes (see the module docstring), with no files."""
    config, where = read_config(config)
    architecture = architecture_of(config, opts, where)
    family = family_for_architecture(architecture, opts.mapping, config)
    if family.multimodal:
        config = flat_view(config)
    config, notes = without_dropped_settings(config, family, opts.allow_lossy_config)
    present = _present_optional(family, architecture, config)
    has_head = any(s.tied_to for s in family.weights)
    tied = bool(config.get("tie_word_embeddings", False)) if has_head else False
    model = build_canonical(family, config, present, tied)
    model.meaning = read_meaning(config, family, architecture, model.dims, present, tied, where)
    named = dtype or config.get("torch_dtype") or config.get("dtype")
    if named is None:
        raise PlanError(f"{where} names no torch_dtype: pass the live tensors' dtype as source={{..., 'dtype': "
                        "'bf16'}}")
    stored_as = dtype_name(named)
    model.dtypes = {name: t.spec.dtype or stored_as for name, t in model.tensors.items()}
    stored = [(0, t) for t in hf_tensors(model)]
    info = {"config": config, "notes": notes, "dtype": stored_as}
    return Source(layout="hf", root=where if where != "config" else "", model=model, files=[], stored=stored,
                  degrees={"tp": 1, "pp": 1}, info=info)

