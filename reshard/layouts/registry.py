"""The one registry of layouts: names to :class:`~reshard.layouts.base.Layout` classes, imported on first use.

Everything that needs to know the layouts asks here: the CLI's ``--to`` choices and help, ``convert``, ``plan``,
``inspect``, ``verify``, the forward verifier and the Hub code. Adding a layout is one module in
``reshard/layouts/`` plus one ``BUILTIN`` line; a third-party package adds one through the entry-point group
``reshard.layouts`` (``name = "package.module:Class"``), loaded once per process (forward-check workers
included), or calls :func:`register_layout` in its own process. A name is never silently replaced: registering
a taken name is an error naming who has it (``replace=True`` is explicit), and an entry point that clashes with
a layout already registered, or fails to import, is skipped with a warning.

:func:`open_checkpoint` also reads the architecture name transformers writes into config.json under FSDP2
(``FSDPLlamaForCausalLM``) as its base class, for every layout described by an HF config.json.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Collection
from dataclasses import replace

from reshard.errors import CheckpointError, PlanError, ReshardError
from reshard.io.regular import open_regular
from reshard.layouts.base import TARGET_OPTION_REASONS, TARGET_OPTIONS, Layout, Options, Source, import_string

BUILTIN = {
    "hf": "reshard.layouts.hf:HFLayout",
    "megatron": "reshard.layouts.megatron:MegatronLayout",
    "vllm": "reshard.layouts.vllm:VLLMLayout",
    "torch_dist": "reshard.layouts.torch_dist:TorchDistLayout",
    "trtllm": "reshard.layouts.trtllm:TRTLLMLayout",
    "meta": "reshard.layouts.meta:MetaLayout",
    "deepspeed": "reshard.layouts.deepspeed:DeepSpeedLayout",
    "dcp": "reshard.layouts.fsdp_dcp:DcpLayout",
    "torchtitan": "reshard.layouts.torchtitan:TorchtitanLayout",
    "maxtext": "reshard.layouts.maxtext:MaxTextLayout",
}
ENTRY_POINT_GROUP = "reshard.layouts"
_NAME = re.compile(r"^[a-z][a-z0-9_.-]*$")
#: How deep a local folder is listed for detection (root/iter_0000100/mp_rank_00/model_optim_rng.pt).
LISTING_DEPTH = 3
#: The layouts whose model is described by a Hugging Face config.json (where transformers' FSDP2 name can be).
HF_CONFIG_LAYOUTS = ("hf", "dcp", "torchtitan", "deepspeed", "vllm")
FSDP_PREFIX = "FSDP"

_targets: dict[str, type[Layout] | str] = dict(BUILTIN)
_origins: dict[str, str] = {name: "reshard (built in)" for name in BUILTIN}
_instances: dict[str, Layout] = {}
_entry_points_loaded = False


def register_layout(name: str, target: type[Layout] | str, *, replace: bool = False, origin: str = "") -> None:
    """Register layout ``name``: a :class:`Layout` subclass, or a lazy ``"module:Class"`` string.

    A class must subclass :class:`Layout` and declare ``name`` itself. A taken name raises unless ``replace``.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ReshardError(f"layout name {name!r} is not valid: use lowercase letters, digits, '-', '_' or '.'")
    if name in _targets and not replace:
        raise ReshardError(f"layout '{name}' is already registered by {_origins[name]}; pick another name "
                           "(third-party layouts: a namespaced one such as 'acme-trtllm') or pass replace=True")
    if isinstance(target, type):
        if not issubclass(target, Layout):
            raise ReshardError(f"layout '{name}': {target.__qualname__} does not subclass reshard.layouts.Layout")
        if target.name != name:
            raise ReshardError(f"layout '{name}': {target.__qualname__}.name is {target.name!r}, not {name!r}")
    elif not isinstance(target, str) or ":" not in target:
        raise ReshardError(f"layout '{name}': register a Layout subclass or a 'module:Class' string")
    _targets[name] = target
    _origins[name] = origin or (target.__module__ if isinstance(target, type) else target.split(":")[0])
    _instances.pop(name, None)


def unregister_layout(name: str) -> None:
    """Remove layout ``name`` (a plug-in's or a test's; built-in layouts can be replaced, not removed)."""
    if name in BUILTIN:
        raise ReshardError(f"'{name}' is a built-in layout: register a replacement with replace=True instead")
    _targets.pop(name, None)
    _origins.pop(name, None)
    _instances.pop(name, None)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        origin = f"the '{ep.name}' entry point of {ep.dist.name if ep.dist else ep.value}"
        if ep.name in _targets:
            print(f"warning: ignoring {origin} ({ep.value}): layout '{ep.name}' is already registered by "
                  f"{_origins[ep.name]}", file=sys.stderr)
            continue
        try:
            register_layout(ep.name, ep.value, origin=origin)
        except ReshardError as exc:
            print(f"warning: ignoring {origin}: {exc}", file=sys.stderr)


def _instance(name: str) -> Layout | None:
    """The layout registered as ``name``, imported now; None (with a warning) when its module fails to import."""
    if name not in _instances:
        target = _targets[name]
        try:
            cls = import_string(target) if isinstance(target, str) else target
        except (ImportError, AttributeError) as exc:
            if name in BUILTIN:
                raise
            print(f"warning: layout '{name}' ({target}) cannot be imported, skipped: {exc}", file=sys.stderr)
            del _targets[name]
            return None
        if not (isinstance(cls, type) and issubclass(cls, Layout)) or cls.name != name:
            raise ReshardError(f"layout '{name}' ({_origins[name]}): {target} is not a Layout subclass whose "
                               f"name is '{name}'")
        _instances[name] = cls()
    return _instances[name]


def layout_names(*, writes: bool | None = None, forward: bool | None = None) -> tuple[str, ...]:
    """Registered layout names (built-ins first, then plug-ins), filtered by what they can do."""
    _load_entry_points()
    names = []
    for name in list(_targets):
        layout = _instance(name)
        if layout is None:
            continue
        if writes is not None and layout.writes != writes:
            continue
        if forward is not None and (layout.rank_loader is not None) != forward:
            continue
        names.append(name)
    return tuple(names)


def get_layout(name: str) -> Layout:
    """The layout called ``name``; an unknown name is a ``PlanError`` listing the known ones."""
    if name not in _targets:
        _load_entry_points()
    layout = _instance(name) if name in _targets else None
    if layout is None:
        raise PlanError(f"unknown layout '{name}': use one of {', '.join(layout_names())}")
    return layout


def refuse_unused_options(to: str, given: dict[str, object]) -> None:
    """Refuse a target option (``TARGET_OPTIONS``: field -> value as given) that layout ``to`` does not write
    with, naming what does what the user meant: its own option, else why (``TARGET_OPTION_REASONS``), else the
    layouts that use it."""
    layout = get_layout(to)
    for field, value in given.items():
        flag, unset = TARGET_OPTIONS[field]
        if value == unset or layout.uses_options is None or field in layout.uses_options:
            continue
        hint = layout.instead.get(field)
        if hint is None and field in TARGET_OPTION_REASONS:
            hint = TARGET_OPTION_REASONS[field].format(to=to)
        if hint is None:
            users = [n for n in layout_names(writes=True) if field in (get_layout(n).uses_options or ())]
            hint = f"it is for {' and '.join(f'--to {n}' for n in users)}; drop it"
        raise PlanError(f"{flag} does not apply to --to {to}: {hint}")


def folder_listing(path: str, depth: int = LISTING_DEPTH) -> frozenset[str]:
    """Paths under ``path`` relative to it, ``/``-separated, folders with a trailing ``/``, to ``depth`` levels."""
    names: set[str] = set()

    def walk(folder: str, prefix: str, level: int) -> None:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return
        for entry in entries:
            rel = prefix + entry.name
            if entry.is_dir():
                names.add(rel + "/")
                if level + 1 < depth:
                    walk(entry.path, rel + "/", level + 1)
            else:
                names.add(rel)

    walk(path, "", 0)
    return frozenset(names)


def with_folders(paths: Collection[str]) -> frozenset[str]:
    """A file listing (a Hub repo's) plus the folders its paths imply, each with a trailing ``/``."""
    names = set(paths)
    for p in paths:
        parts = p.split("/")[:-1]
        names.update("/".join(parts[:i + 1]) + "/" for i in range(len(parts)))
    return frozenset(names)


def detect_in(names: Collection[str], where: str) -> Layout:
    """The layout of a listing (see :meth:`Layout.detect`): the most specific match; a tie is refused."""
    matches = [layout for name in layout_names() if (layout := get_layout(name)).detect(names)]
    if not matches and hf_weights_only(names):  # opening it asks for a config.json or --config
        return get_layout("hf")
    if not matches:
        known = "; ".join(f"{get_layout(n).name}: {get_layout(n).summary}" for n in layout_names())
        raise CheckpointError(f"{where} is not a checkpoint reshard knows (expected one of {known})")
    top = max(m.specificity for m in matches)
    best = [m for m in matches if m.specificity == top]
    if len(best) > 1:
        raise CheckpointError(f"{where} looks like {' and '.join(m.name for m in best)} checkpoints at once: "
                              "remove the files of the one you do not mean, or pass that layout's own folder")
    return best[0]


def hf_weights_only(names: Collection[str]) -> bool:
    """Whether a listing is a Hugging Face folder but for its config.json: top-level model weights or an index
    (not Mistral's consolidated files or a PEFT adapter) and no config.json."""
    from reshard.io.hf_files import is_other_format, is_weight_file

    return "config.json" not in names and any(is_weight_file(n) and not is_other_format(n) for n in names)


def detect(path: str) -> Layout:
    """The layout of local folder ``path``."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path} does not exist")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a folder: pass the checkpoint folder")
    names = folder_listing(path)
    try:
        return detect_in(names, path)
    except CheckpointError:
        from reshard.layouts.torchtitan import incomplete_step

        message = incomplete_step(path, names)
        if message:
            raise CheckpointError(message) from None
        raise


def _config_architecture(path: str, opts: Options, layout: str) -> tuple[dict, str] | None:
    """``(config, the architecture it names)`` of the HF config ``layout`` reads for ``path``: ``--config``
    (an hf folder's own config.json first), else ``config.json`` in ``path``, else in its parent (a DCP
    ``pytorch_model_fsdp_0/``); None where there is none (the layout itself reports a missing or unreadable one)."""
    parent = os.path.dirname(os.path.abspath(path))
    own = os.path.join(path, "config.json")
    candidates = [opts.config] if opts.config and not (layout == "hf" and os.path.isfile(own)) else \
        [own, os.path.join(parent, "config.json")]
    for candidate in candidates:
        if not os.path.isfile(candidate):
            continue
        try:
            with open_regular(candidate, "rb") as f:
                config = json.loads(f.read())
        except (OSError, ValueError, ReshardError):
            return None
        archs = config.get("architectures") if isinstance(config, dict) else None
        return (config, archs[0]) if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    return None


def fsdp_base_architecture(named: str, opts: Options, config: dict) -> str | None:
    """The model class of ``named`` where it is the name transformers writes under FSDP2 (``FSDP`` + the class:
    ``FSDPLlamaForCausalLM``, transformers issue 40750) and reshard knows that class but not ``named``; else None."""
    from reshard.mapping_vlm import family_for_architecture

    base = named[len(FSDP_PREFIX):]
    if not named.startswith(FSDP_PREFIX) or not base[:1].isupper():
        return None
    known = []
    for name in (named, base):
        try:
            family_for_architecture(name, opts.mapping, config)
            known.append(name)
        except ReshardError:
            pass
    return base if known == [base] else None


def _open_fsdp_named(layout: Layout, path: str, opts: Options) -> Source | None:
    """``path`` opened with its config's FSDP2 architecture name read as the base class
    (:func:`fsdp_base_architecture`) with a note, the outputs then naming the base class; None where the config
    names no such class, ``--architecture`` names a third one, or the layout read another config (then the layout
    decides, as for any forced architecture)."""
    if layout.name not in HF_CONFIG_LAYOUTS:
        return None
    found = _config_architecture(path, opts, layout.name)
    base = found and fsdp_base_architecture(found[1], opts, found[0])
    if not base or opts.architecture not in (None, base, found[1]):
        return None
    named = found[1]
    # chosen_architecture refuses a forced name other than the config's unless relabelling is allowed: here it is
    # the same class under its FSDP2 name, so the relabel is allowed for this open only, and its note replaced.
    source = layout.open(path, replace(opts, architecture=base,
                                       allow_lossy_config=(*opts.allow_lossy_config, "architecture")))
    relabel = f"relabelled {named} as {base} (--allow-lossy-config architecture)"
    notes = source.info.setdefault("notes", [])
    if relabel not in notes:  # the layout read a config naming another class: no relabel is allowed for that
        source.close()
        return None
    notes[:] = [f"architecture {named} read as {base} (the name transformers writes under FSDP2)"] + \
        [n for n in notes if n != relabel]
    for config in (source.model.config, source.info.get("config")):
        if isinstance(config, dict) and config.get("architectures", [None])[:1] == [named]:
            config["architectures"] = [base, *config["architectures"][1:]]
    return source


def open_checkpoint(path: str, opts: Options | None = None) -> Source:
    """Detect the layout of local folder ``path`` and open it as a canonical view (an FSDP2-written architecture
    name read as its base class: :func:`_open_fsdp_named`)."""
    opts = opts or Options()
    layout = detect(path)
    return _open_fsdp_named(layout, path, opts) or layout.open(path, opts)
