"""Placeholder: the dcp layout is being written (issue 33). It detects nothing, so no folder opens as it."""

from __future__ import annotations

from reshard.errors import PlanError
from reshard.layouts.base import Layout


class DcpLayout(Layout):
    name = "dcp"
    summary = "torch.distributed.checkpoint folder from FSDP2 / accelerate (.metadata, HF names)"
    writes = False

    def detect(self, names) -> bool:
        return False

    def open(self, root, opts):
        raise PlanError("the dcp layout is not available yet")
