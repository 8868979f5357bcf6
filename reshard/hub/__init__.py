"""Hugging Face Hub sources (``hf://ORG/NAME[@REV]``) and destinations, through huggingface_hub.

This module imports nothing from huggingface_hub: local paths never pay for it. ``open_source`` is the one entry
point that conversion, inspection and verification use to open any checkpoint path.
"""

from __future__ import annotations

from reshard.hub.refs import PREFIX, HubRef, is_hub_path, parse_repo_id
from reshard.layouts.base import Options, Source

__all__ = ["PREFIX", "HubRef", "is_hub_path", "parse_repo_id", "open_source"]


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
