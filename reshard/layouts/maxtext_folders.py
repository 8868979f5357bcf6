"""Which folder of a MaxText / Orbax checkpoint holds the item to read (maxtext-orbax.md sections 1.1, 1.7, 1.8).

Accepted, in order: the item folder itself (``_METADATA`` + ``manifest.ocdbt`` or per-leaf zarr folders); a step
folder ``<step>/`` with one item subfolder (``items/`` for MaxText, ``default/`` for a bare CheckpointManager); a
folder of numeric step folders (MaxText's ``<run>/checkpoints/``, ``to_maxtext``'s ``<out>/``) or a run folder
with ``checkpoints/`` — the highest complete step, or ``--tag STEP``. A ``<step>.orbax-checkpoint-tmp`` folder is
an unfinished save and never read.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from reshard.errors import CheckpointError
from reshard.io.orbax_store import load_json

TMP_SUFFIX = ".orbax-checkpoint-tmp"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
ITEM_NAMES = ("items", "default", "model_params", "model")  # MaxText, CheckpointManager, NNX-SFT
_STEP = re.compile(r"^\d+$")


def is_item_listing(names, prefix: str = "") -> bool:
    """Whether ``names`` (relative, ``/``-separated) show an Orbax item at ``prefix``."""
    if prefix + "_METADATA" not in names:
        return False
    return prefix + "manifest.ocdbt" in names or any(
        n.startswith(prefix) and (n.endswith("/zarr.json") or n.endswith("/.zarray")) for n in names)


def detect_names(names) -> bool:
    """A listing (to depth 3) of an item, a step, a folder of steps or a run folder."""
    names = set(names)
    if is_item_listing(names):
        return True
    for n in names:
        parts = n.rstrip("/").split("/")
        if parts[-1] != "_METADATA":
            continue
        if len(parts) == 2 and parts[0] in ITEM_NAMES:
            return True
        if len(parts) == 3 and parts[1] in ITEM_NAMES and _STEP.match(parts[0]):
            return True
    return any(re.match(r"^checkpoints/\d+/items/$", n) for n in names) or any(
        re.match(r"^\d+/items/_METADATA$", n) or re.match(r"^checkpoints/\d+/items/", n) for n in names)


@dataclass(frozen=True)
class Located:
    """The item folder, its step folder (None for a bare item) and the step's ``custom_metadata``."""

    items: str
    step_dir: str | None
    step: str | None
    custom: dict
    notes: tuple[str, ...] = ()


def _is_item(folder: str) -> bool:
    if not os.path.isfile(os.path.join(folder, "_METADATA")):
        return False
    return os.path.isfile(os.path.join(folder, "manifest.ocdbt")) or any(
        os.path.isfile(os.path.join(folder, n, "zarr.json")) or os.path.isfile(os.path.join(folder, n, ".zarray"))
        for n in os.listdir(folder)) or any(n.startswith("ocdbt.process_") for n in os.listdir(folder))


def _custom_metadata(step_dir: str) -> dict:
    value = load_json(os.path.join(step_dir, CHECKPOINT_METADATA))
    custom = value.get("custom_metadata") if isinstance(value, dict) else None
    return custom if isinstance(custom, dict) else {}


def _refuse_tmp(path: str) -> None:
    if path.rstrip(os.sep).endswith(TMP_SUFFIX):
        raise CheckpointError(f"{path} is an unfinished Orbax save (the {TMP_SUFFIX} suffix): read a committed step")


def _step_item(step_dir: str) -> str | None:
    found = [os.path.join(step_dir, n) for n in ITEM_NAMES if _is_item(os.path.join(step_dir, n))]
    return found[0] if found else None


def _steps(folder: str) -> list[str]:
    return sorted((n for n in os.listdir(folder) if _STEP.match(n) and os.path.isdir(os.path.join(folder, n))),
                  key=int)


def locate(root: str, tag: str | None) -> Located:
    """The item to read under ``root`` (see the module docstring)."""
    _refuse_tmp(root)
    if _is_item(root):
        parent = os.path.dirname(os.path.abspath(root))
        step_dir = parent if os.path.isfile(os.path.join(parent, CHECKPOINT_METADATA)) else None
        return Located(root, step_dir, os.path.basename(parent) if step_dir else None,
                       _custom_metadata(step_dir) if step_dir else {})
    item = _step_item(root)
    if item is not None:
        return Located(item, root, os.path.basename(os.path.abspath(root)), _custom_metadata(root), _commit_notes(root))
    folder = os.path.join(root, "checkpoints") if os.path.isdir(os.path.join(root, "checkpoints")) else root
    steps = _steps(folder)
    if tag is not None:
        if tag not in steps:
            raise CheckpointError(f"--tag {tag}: {folder} has no step folder {tag} (steps: {', '.join(steps) or 'none'})")
        chosen = [tag]
    else:
        chosen = [s for s in reversed(steps) if _step_item(os.path.join(folder, s))
                  and os.path.isfile(os.path.join(folder, s, CHECKPOINT_METADATA))]
    if not chosen:
        pending = [n for n in os.listdir(folder) if n.endswith(TMP_SUFFIX)]
        why = f" (only unfinished saves: {pending[0]})" if pending else ""
        raise CheckpointError(f"{root} holds no complete Orbax checkpoint step{why}")
    step_dir = os.path.join(folder, chosen[0])
    item = _step_item(step_dir)
    if item is None:
        raise CheckpointError(f"{step_dir} has no items/ (or default/) folder with _METADATA")
    notes = _commit_notes(step_dir)
    if tag is None and len(steps) > 1:
        notes += (f"read step {chosen[0]}, the newest complete one of {len(steps)} (--tag STEP reads another)",)
    return Located(item, step_dir, chosen[0], _custom_metadata(step_dir), notes)


def _commit_notes(step_dir: str) -> tuple[str, ...]:
    if os.path.isfile(os.path.join(step_dir, "commit_success.txt")):
        return ()
    return (f"{step_dir} has no commit_success.txt (older Orbax versions wrote none); read it as committed",)
