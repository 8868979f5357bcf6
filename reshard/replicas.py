"""Replicated tensors: every stored copy compared with the copy a conversion reads, streamed in row blocks
(:mod:`reshard.verification.block_stream`), before anything is written."""

from __future__ import annotations

from reshard.core.plan import Plan, ReplicaCheck
from reshard.errors import CheckpointError
from reshard.io.tensorfile import TensorFile
from reshard.verification.block_stream import replica_problem, replica_tasks, run_pairs


def run_replica_checks(checks: list[ReplicaCheck], files: list[TensorFile], source_names: list[str]) -> list[str]:
    """Compare every replica against the copy that will be read, streamed in row blocks; one message per
    mismatch."""
    results = run_pairs(replica_tasks(checks, files))
    return [p for check, r in zip(checks, results) if (p := replica_problem(check, r, source_names)) is not None]


def ensure_replicas_agree(plan: Plan, files: list[TensorFile], allow_mismatch: bool, warn) -> None:
    problems = run_replica_checks(plan.checks, files, plan.source_files)
    if problems and not allow_mismatch:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(problems[0] + more + "; pass --allow-replica-mismatch to take rank 0's copy")
    for p in problems:
        warn(p + "; taking the first rank's copy")
