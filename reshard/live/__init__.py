"""Live resharding: move a running job's weights into other ranks over torch.distributed, each byte once.

``plan = live.plan(config, source={...}, target={...}, source_ranks=[...], target_ranks=[...])`` (every rank,
no communication), then ``received = live.transfer(plan, local_tensors, into=...)`` on every participant.
See :mod:`reshard.live.plan` and :mod:`reshard.live.transfer`.
"""

from reshard.live.plan import LivePlan, plan
from reshard.live.stats import Received, Stats
from reshard.live.transfer import transfer
from reshard.live.watch import TransferError

__all__ = ["LivePlan", "Received", "Stats", "TransferError", "plan", "transfer"]
