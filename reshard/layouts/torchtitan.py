"""Placeholder: the torchtitan layout is being written (issue 33). It detects nothing, so no folder opens as it."""

from __future__ import annotations

from reshard.errors import PlanError
from reshard.layouts.base import Layout


class TorchtitanLayout(Layout):
    name = "torchtitan"
    summary = "torchtitan DCP checkpoint (step-N/.metadata, torchtitan names)"
    writes = False

    def detect(self, names) -> bool:
        return False

    def open(self, root, opts):
        raise PlanError("the torchtitan layout is not available yet")
