"""Hugging Face Hub sources (``hf://ORG/NAME[@REV]``) and destinations, through huggingface_hub.

This module imports nothing from huggingface_hub: local paths never pay for it. ``open_source`` is the one entry
point that conversion, inspection and verification use to open any checkpoint path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from reshard.errors import ReshardError
from reshard.layouts.base import Options, Source

PREFIX = "hf://"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class HubRef:
    """A model repo on the Hub and an optional revision (branch, tag or commit; None = the default branch)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return PREFIX + self.repo_id + (f"@{self.revision}" if self.revision else "")


def is_hub_path(path: str) -> bool:
    return str(path).startswith(PREFIX)


def parse_repo_id(text: str, revision: str | None = None) -> HubRef:
    """``ORG/NAME``, ``ORG/NAME@REV`` or ``hf://ORG/NAME[@REV]``; an explicit ``revision`` wins over ``@REV``."""
    body = text[len(PREFIX):] if text.startswith(PREFIX) else text
    repo_id, at, rev = body.partition("@")
    repo_id = repo_id.rstrip("/")
    if not _REPO_ID.match(repo_id) or ".." in repo_id or (at and not rev):
        raise ReshardError(f"'{text}' is not a Hub model id: write ORG/NAME or hf://ORG/NAME[@REVISION]")
    return HubRef(repo_id, revision or rev or None)


def open_source(path: str, opts: Options, need_weights: bool = True) -> Source:
    """Open a local checkpoint folder or an ``hf://`` repo as a canonical view.

    ``need_weights``: download what a conversion reads (through the huggingface_hub cache) and open the local
    snapshot; otherwise (plans) build the view from remote safetensors headers without downloading weights.
    """
    if not is_hub_path(path):
        from reshard.layouts import open_checkpoint

        return open_checkpoint(path, opts)
    ref = parse_repo_id(path)
    if need_weights or _offline():
        from reshard.hub.download import open_snapshot

        return open_snapshot(ref, opts)
    from reshard.hub.remote import open_remote

    return open_remote(ref, opts)


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()
