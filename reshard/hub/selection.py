"""Which files of a model repo a conversion needs: weights in one format, config, tokenizer files. Pure."""

from __future__ import annotations

import fnmatch
import re

from reshard.layouts.base import SIDE_FILES

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
CONFIGS = ("config.json", "reshard.json")
TRACKER = "latest_checkpointed_iteration.txt"
_MEGATRON_RANK = re.compile(r"^(iter_\d{7}|release)/mp_rank_\d{2}(_\d{3})?/model_optim_rng\.pt$")
_VLLM_RANK = re.compile(r"^model-rank-\d+-part-\d+\.safetensors$")


def repo_layout(paths: list[str]) -> str:
    """``megatron`` (a tracker or rank files under iter_*/release), ``vllm`` (model-rank-*-part-* files) or ``hf``."""
    if TRACKER in paths or any(_MEGATRON_RANK.match(p) for p in paths):
        return "megatron"
    if any(_VLLM_RANK.match(p) for p in paths):
        return "vllm"
    return "hf"


def iteration_folder(tracker_text: str | None, paths: list[str]) -> str | None:
    """The Megatron iteration folder to download: the tracker's, else the only one present."""
    if tracker_text is not None:
        label = tracker_text.strip()
        return "release" if label == "release" else f"iter_{int(label):07d}" if label.isdigit() else None
    folders = sorted({p.split("/")[0] for p in paths if _MEGATRON_RANK.match(p)})
    return folders[0] if len(folders) == 1 else None


def select_files(paths: list[str], index_files: list[str] | None = None, include: tuple[str, ...] = (),
                 tracker_text: str | None = None) -> list[str]:
    """The repo files to download, from the repo's file list ``paths``.

    A Megatron repo (tracker or ``iter_*/mp_rank_*`` files): the tracker and the rank files of the iteration it
    names (``tracker_text``); a vLLM repo: every ``model-rank-*-part-*.safetensors``; both plus the side files.

    Only top-level files (``original/`` and other sub-folders hold other formats). Weights: the safetensors index
    and the files it names (``index_files``), else ``model.safetensors``, else the top-level ``*.safetensors``
    (never Mistral's ``consolidated*``); ``pytorch_model*.bin`` (+ index) only when no safetensors exist. Plus
    ``config.json``, generation config and tokenizer files, and any path matching an ``include`` glob.
    """
    top = [p for p in paths if "/" not in p]
    names = set(top)
    side = {p for p in top if p in CONFIGS or p in SIDE_FILES}
    extra = {p for p in paths if any(fnmatch.fnmatch(p, g) for g in include)}
    layout = repo_layout(paths)
    if layout == "megatron":
        folder = iteration_folder(tracker_text, paths)
        ranks = {p for p in paths if _MEGATRON_RANK.match(p) and p.split("/")[0] == folder}
        return sorted(ranks | ({TRACKER} & names) | side | extra)
    if layout == "vllm":
        return sorted({p for p in top if _VLLM_RANK.match(p)} | side | extra)
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
