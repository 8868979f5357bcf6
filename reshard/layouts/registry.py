"""The one registry of layouts: names to :class:`~reshard.layouts.base.Layout` classes, imported on first use.

Everything that needs to know the layouts asks here: the CLI's ``--to`` choices and help, ``convert``, ``plan``,
``inspect``, ``verify``, the forward verifier and the Hub code. Adding a layout is one module in
``reshard/layouts/`` plus one ``BUILTIN`` line; a third-party package adds one through the entry-point group
``reshard.layouts`` (``name = "package.module:Class"``), loaded once per process (forward-check workers
included), or calls :func:`register_layout` in its own process. A name is never silently replaced: registering
a taken name is an error naming who has it (``replace=True`` is explicit), and an entry point that clashes with
a layout already registered, or fails to import, is skipped with a warning.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Collection

from reshard.errors import CheckpointError, PlanError, ReshardError
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
}
ENTRY_POINT_GROUP = "reshard.layouts"
_NAME = re.compile(r"^[a-z][a-z0-9_.-]*$")
#: How deep a local folder is listed for detection (root/iter_0000100/mp_rank_00/model_optim_rng.pt).
LISTING_DEPTH = 3

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
    if not matches:
        known = "; ".join(f"{get_layout(n).name}: {get_layout(n).summary}" for n in layout_names())
        raise CheckpointError(f"{where} is not a checkpoint reshard knows (expected one of {known})")
    top = max(m.specificity for m in matches)
    best = [m for m in matches if m.specificity == top]
    if len(best) > 1:
        raise CheckpointError(f"{where} looks like {' and '.join(m.name for m in best)} checkpoints at once: "
                              "remove the files of the one you do not mean, or pass that layout's own folder")
    return best[0]


def detect(path: str) -> Layout:
    """The layout of local folder ``path``."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path} does not exist")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a folder: pass the checkpoint folder")
    return detect_in(folder_listing(path), path)


def open_checkpoint(path: str, opts: Options | None = None) -> Source:
    """Detect the layout of local folder ``path`` and open it as a canonical view."""
    return detect(path).open(path, opts or Options())
