"""Hub references: ``hf://ORG/NAME[@REVISION]`` paths and model ids (pure; no huggingface_hub import)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from reshard.errors import ReshardError

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
