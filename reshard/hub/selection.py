"""Which files of a model repo a conversion needs: the detected layout's weight files (its ``remote_files``),
config and tokenizer files, and what ``--include`` asks for. Pure, apart from ``read_text`` (small files)."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable

from reshard.errors import CheckpointError
from reshard.layouts.base import Layout
from reshard.layouts.registry import detect_in, with_folders
from reshard.side_files import STANDARD

CONFIGS = ("config.json", "reshard.json")


def repo_layout(paths: list[str], where: str = "the repo") -> Layout:
    """The layout of a repo's file listing."""
    return detect_in(with_folders(paths), where)


def _no_reader(name: str) -> str:
    raise CheckpointError(f"reading {name} of the repo is needed to choose the files to download")


def select_files(paths: list[str], include: tuple[str, ...] = (),
                 read_text: Callable[[str], str] | None = None) -> list[str]:
    """The repo files to download, from the repo's file list ``paths``: the layout's weight files (e.g. HF:
    the index and the shards it names; Megatron: the tracker and its iteration's rank files; vLLM: every rank
    file), plus top-level ``config.json``, ``reshard.json``, the generation config and tokenizer files, top-level ``.py``
    files (the remote code ``auto_map`` may name; a local conversion copies only what it names), and any
    path matching an ``include`` glob. ``read_text(name)`` reads a small file of the repo (index, tracker)."""
    layout = repo_layout(paths)
    top = [p for p in paths if "/" not in p]
    side = {p for p in top if p in CONFIGS or p in STANDARD or p.endswith(".py")}  # remote code auto_map may name
    extra = {p for p in paths if any(fnmatch.fnmatch(p, g) for g in include)}
    return sorted(set(layout.remote_files(list(paths), read_text or _no_reader)) | side | extra)
