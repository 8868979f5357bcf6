"""Writing MaxText checkpoints (maxtext-orbax.md section 7.5): not yet."""

from __future__ import annotations

from reshard.errors import PlanError


def targets(source, opts, dtype):
    raise PlanError("writing MaxText checkpoints (--to maxtext) is not implemented yet")


def finalize(out, source, plan, state):
    raise PlanError("writing MaxText checkpoints (--to maxtext) is not implemented yet")
