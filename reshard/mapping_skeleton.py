"""``reshard mappings new``: a shipped mapping copied under a new family's own names, with comments saying what to
edit; and the warnings ``reshard mappings check`` gives when a file still names a shipped family.

The copy keeps every weight, dimension and decoder feature of the family it starts from, and replaces what
identifies that family (its name, description, architectures and config.json ``model_type``): a copied
``model_type`` is what reshard writes into converted checkpoints' config.json, so a left-over one silently
relabels the user's model.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

from reshard.errors import MappingError
from reshard.mapping import (Family, _suggest, load_shipped, parse_family, shipped_mapping_names,
                             shipped_mapping_text)

NAME_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
INLINE_WIDTH = 100

HEADER = """\
# Mapping file for the "{name}" family, written by `reshard mappings new`: a copy of a shipped mapping whose
# weights, dimensions and decoder features you now adapt to your model. Then:
#     reshard mappings check {file}
#     reshard convert SRC DST --to ... --mapping {file}
# What to edit, in this order:
#   1. [family] architectures: the class name(s) of your config.json's "architectures".
#   2. [config.architectures.*]: one table per architecture; model_type is written into the config.json of
#      converted checkpoints, so it must be your config.json's own "model_type".
#   3. [dims]: the config.json key of each dimension symbol (and a default where the key may be absent).
#   4. [[weight]]: hf is your checkpoint's tensor name ({{layer}} = layer index); megatron / vllm / trtllm / meta
#      are its names in those layouts. Delete weights your model lacks; add ones it has.
# Unknown keys are errors; `reshard mappings show NAME` prints a shipped mapping with its own comments.
"""

SECTION_NOTES = {
    "family": "# name: your family's name; architectures: every config.json \"architectures\" entry this file reads.",
    "dims": ("# Dimension symbols used in shapes: the config.json key each comes from (a list: the first present),\n"
             "# and a default expression over other symbols where the key may be absent."),
    "hf": ("# ignore: HF tensor names dropped on read; optional_prefix: a name prefix old files omit."),
    "moe": ("# Mixture of Experts: the dims symbols of the expert count and FFN sizes, and the config keys of top-k,\n"
            "# renormalisation and which layers are sparse."),
    "megatron": ("# Megatron-Core `_extra_state` entries (Transformer Engine spec / local spec): written as None,\n"
                 "# ignored on read. Rename them with the module names of your model's Megatron spec."),
    "vllm": ("# vLLM: per-layer scalars its Attention modules keep in the state dict, and where it keeps tied\n"
             "# embeddings; rename them with your vLLM model's module names."),
    "decoder": ("# How the family computes, for verify --forward's reference decoder: norm = rms | layer,\n"
                "# mlp = gated | plain, position = rope | learned, activation (when config.json has none),\n"
                "# norm_offset, embedding_scaled."),
    "config": ("# How config.json spells the model: the keys of norm epsilon, activation and positions (and\n"
               "# soft-capping, query scale, local RoPE base where the family has them)."),
    "config.bias_groups": "# Optional bias weights, by group: which HF weights each group switches on together.",
}
ARCHITECTURE_NOTE = (
    "# Your architecture's config.json spelling. model_type: your config.json's \"model_type\" (written into\n"
    "# converted checkpoints). biases: the config key that switches each bias group on, or true / false when the\n"
    "# architecture fixes it. window: none | all_layers | layer_types | typed (how a sliding window is spelt).")
WEIGHT_NOTE = """\
# One [[weight]] per canonical weight. hf: its Hugging Face tensor name ({layer}, {expert}); role: what the
# reference decoder uses it as; split: replicated | column | row | vocab | qkv | gate_up; slot: its place in a
# qkv or gate_up pack; shape: in dims symbols; stage: first / last outside the layer stack; optional; tied_to.
# megatron (or megatron_te and megatron_local), vllm (default: the hf name), trtllm, meta: its names in those
# layouts; weights sharing a name there are packed into one tensor."""


def _key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON's escapes are valid in TOML basic strings
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + " }" if value else "{}"
    raise MappingError(f"cannot write a mapping value of type {type(value).__name__}")


def _line(key: str, value) -> str:
    text = f"{_key(key)} = {_value(value)}"
    if len(text) > INLINE_WIDTH and isinstance(value, list) and value:
        return f"{_key(key)} = [\n" + "".join(f"    {_value(v)},\n" for v in value) + "]"
    return text


def _inline(path: str, value) -> bool:
    """Whether a value of table ``path`` is written inline (``key = { ... }``) rather than as a sub-table: the
    [config] tables that group others (bias groups, architectures, each architecture) are always sub-tables."""
    if not isinstance(value, dict):
        return True
    if path == "config" or path == "config.architectures":
        return False
    return not any(isinstance(v, dict) for v in value.values()) and len(_value(value)) <= INLINE_WIDTH


def _table(path: str, table: dict, out: list[str]) -> None:
    note = SECTION_NOTES.get(path) or (ARCHITECTURE_NOTE if path.startswith("config.architectures.") else None)
    inline = {k: v for k, v in table.items() if _inline(path, v)}
    if inline or len(inline) == len(table):  # a table holding only sub-tables needs no header of its own
        out.append("")
        if note:
            out.append(note)
        out.append(f"[{path}]")
        out.extend(_line(k, v) for k, v in inline.items())
    for key, value in table.items():
        if key not in inline:
            _table(f"{path}.{_key(key)}", value, out)


def architecture_name(name: str) -> str:
    """``acme`` -> ``AcmeForCausalLM``; ``my_model`` -> ``MyModelForCausalLM``."""
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[_-]+", name) if part) + "ForCausalLM"


def _starting_point(source: str) -> tuple[str, str]:
    """``--from``: a shipped mapping name (its first architecture) or an architecture one of them lists."""
    names = shipped_mapping_names()
    if source in names:
        return source, load_shipped(source).architectures[0]
    for family in names:
        if source in load_shipped(family).architectures:
            return family, source
    known = names + [a for n in names for a in load_shipped(n).architectures]
    raise MappingError(f"--from '{source}' is neither a shipped mapping nor an architecture one lists"
                       f"{_suggest(source, known)}; see `reshard mappings list`")


def _check_new_names(name: str, architecture: str, model_type: str) -> None:
    if not NAME_PATTERN.fullmatch(name):
        raise MappingError(f"mapping name '{name}' must start with a letter and hold only letters, digits, _ and - "
                           "(e.g. acme)")
    for family in shipped_mapping_names():
        shipped = load_shipped(family)
        if name == family:
            raise MappingError(f"'{name}' is a shipped mapping's name: give your family its own name")
        if architecture in shipped.architectures:
            raise MappingError(f"architecture '{architecture}' is shipped mapping {family}'s: pass --architecture "
                               "with your config.json's own \"architectures\" entry")
        if model_type in _model_types(shipped):
            raise MappingError(f"model_type '{model_type}' is shipped mapping {family}'s: pass --model-type with "
                               "your config.json's own \"model_type\"")


def _model_types(family: Family) -> dict[str, str]:
    """model_type -> the architecture whose config.json spelling declares it."""
    return {spelling.model_type: arch for arch, spelling in family.config.architectures}


def skeleton_text(name: str, source: str, architecture: str | None = None, model_type: str | None = None,
                  file_name: str | None = None) -> str:
    """The commented mapping file of family ``name``, copied from shipped mapping (or architecture) ``source``,
    for ``architecture`` (default ``<Name>ForCausalLM``) with config.json ``model_type`` (default ``name``)."""
    architecture = architecture or architecture_name(name)
    model_type = model_type or name.lower()
    _check_new_names(name, architecture, model_type)
    family, copied_architecture = _starting_point(source)
    data = tomllib.loads(shipped_mapping_text(family))
    data["family"] = {"name": name, "description": f"{architecture}: describe what the family computes",
                      "architectures": [architecture]}
    config = data.setdefault("config", {})
    spelling = dict(config.get("architectures", {}).get(copied_architecture, {}))
    spelling["model_type"] = model_type
    config["architectures"] = {architecture: spelling}
    data.pop("maxtext", None)  # MaxText model names and leaf names are the copied family's, not the new one's
    out = [HEADER.format(name=name, file=file_name or f"{name}.toml").rstrip("\n")]
    for key, value in data.items():
        if key != "weight":
            _table(key, value, out)
    out += ["", WEIGHT_NOTE]
    for weight in data["weight"]:
        out += ["", "[[weight]]"] + [_line(k, v) for k, v in weight.items()]
    text = "\n".join(out) + "\n"
    parse_family(tomllib.loads(text), f"mappings new {name}")  # the copy must validate as written
    return text


def write_skeleton(path: str | Path, name: str, source: str, architecture: str | None = None,
                   model_type: str | None = None, overwrite: bool = False) -> Path:
    """Write :func:`skeleton_text` to ``path``, refusing an existing file unless ``overwrite``."""
    path = Path(path)
    text = skeleton_text(name, source, architecture, model_type, file_name=str(path))
    if path.exists() and not overwrite:
        raise MappingError(f"{path} already exists; pass --overwrite to replace it or -o to write elsewhere")
    path.write_text(text)
    return path


def copied_name_warnings(family: Family, text: str) -> list[str]:
    """Warnings for a user's mapping file (``text``, parsed as ``family``) that still names a shipped family: its
    name, an architecture, or a config.json model_type (which reshard writes into converted checkpoints). A
    shipped file checked as it ships gets none. Also: an architecture without a [config.architectures.*] table."""
    warnings = []
    for shipped_name in shipped_mapping_names():
        if text == shipped_mapping_text(shipped_name):
            return []
    for shipped_name in shipped_mapping_names():
        shipped = load_shipped(shipped_name)
        if family.name == shipped.name:
            warnings.append(f"family name '{family.name}' is shipped mapping {shipped_name}'s: give your family "
                            "its own name")
        for arch in family.architectures:
            if arch in shipped.architectures:
                warnings.append(f"architecture '{arch}' is one of shipped mapping {shipped_name}'s: with --mapping "
                                f"this file replaces it for {arch} checkpoints; list your config.json's own "
                                "\"architectures\"")
        shipped_types = _model_types(shipped)
        for arch, spelling in family.config.architectures:
            owner = shipped_types.get(spelling.model_type)
            if owner is not None and arch not in shipped.architectures:
                warnings.append(f"[config.architectures.{arch}] model_type '{spelling.model_type}' is {owner}'s "
                                f"(shipped mapping {shipped_name}): reshard writes it into converted checkpoints' "
                                "config.json; set your config.json's own \"model_type\"")
    spelt = {arch for arch, _ in family.config.architectures}
    for arch in family.architectures:
        if arch not in spelt:
            warnings.append(f"architecture '{arch}' has no [config.architectures.{arch}] table (model_type, "
                            "biases, window): converting to Hugging Face will be refused")
    return warnings
