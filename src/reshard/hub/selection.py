"""Which files of a model repo a conversion needs: weights in one format, config, tokenizer files. Pure."""

from __future__ import annotations

import fnmatch

from reshard.layouts.base import SIDE_FILES

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
CONFIGS = ("config.json",)


def select_files(paths: list[str], index_files: list[str] | None = None, include: tuple[str, ...] = ()) -> list[str]:
    """The repo files to download, from the repo's file list ``paths``.

    Only top-level files (``original/`` and other sub-folders hold other formats). Weights: the safetensors index
    and the files it names (``index_files``), else ``model.safetensors``, else the top-level ``*.safetensors``
    (never Mistral's ``consolidated*``); ``pytorch_model*.bin`` (+ index) only when no safetensors exist. Plus
    ``config.json``, generation config and tokenizer files, and any path matching an ``include`` glob.
    """
    top = [p for p in paths if "/" not in p]
    names = set(top)
    safetensors = sorted(p for p in top if p.endswith(".safetensors") and not p.startswith("consolidated"))
    if SAFETENSORS_INDEX in names:
        weights = [SAFETENSORS_INDEX, *sorted(set(index_files or safetensors))]
    elif "model.safetensors" in names:
        weights = ["model.safetensors"]
    elif safetensors:
        weights = safetensors
    else:
        weights = sorted(p for p in top if p == BIN_INDEX or (p.startswith("pytorch_model") and p.endswith(".bin")))
    wanted = set(weights) | {p for p in top if p in CONFIGS or p in SIDE_FILES}
    wanted |= {p for p in paths if any(fnmatch.fnmatch(p, g) for g in include)}
    return sorted(wanted)
