"""Placeholder: the deepspeed layout is being written (issue 33). It detects nothing, so no folder opens as it."""

from __future__ import annotations

from reshard.errors import PlanError
from reshard.layouts.base import Layout


class DeepSpeedLayout(Layout):
    name = "deepspeed"
    summary = "DeepSpeed ZeRO checkpoint (latest + TAG/*_model_states.pt, *_optim_states.pt)"
    writes = False

    def detect(self, names) -> bool:
        return False

    def open(self, root, opts):
        raise PlanError("the deepspeed layout is not available yet")
