"""One process of tests/test_live_gpt_oss.py's world: ``python live_gpt_oss_worker.py JOB.json RANK WORLD PORT OUT``.

Every process runs the job's cases in turn (a process in neither ``source_ranks`` nor ``target_ranks`` skips one).
A source rank passes the tensors of its file in ``source_files`` (what ``reshard convert`` wrote for that parallel
rank: a safetensors file, or a Megatron ``model_optim_rng.pt`` read with ``weights_only=True``, its
``_extra_state`` entries left out); a target rank saves what ``live.transfer`` placed to
``OUT/<case>-<parallel rank>.safetensors`` for the test to compare with the converted files. Each process writes
OUT/RANK.json (tests/live_worker.py's loop): one result per case (error, stats)."""

from __future__ import annotations

import argparse
import os
import sys

import torch
from safetensors.torch import load_file, save_file

from reshard import live


def rank_tensors(path: str) -> dict[str, torch.Tensor]:
    """The tensors of one converted rank file (safetensors, or Megatron's torch file without ``_extra_state``)."""
    if path.endswith(".safetensors"):
        return load_file(path)
    with torch.serialization.safe_globals([argparse.Namespace]):
        state = torch.load(path, map_location="cpu", weights_only=True)["model"]
    return {n: t for n, t in state.items() if not n.endswith("._extra_state")}


def run_case(case: dict, rank: int, out: str) -> dict | None:
    sources, targets = case["source_ranks"], case["target_ranks"]
    if rank not in sources and rank not in targets:
        return None
    plan = live.plan(case["config"], source=case["source"], target=case["target"], source_ranks=sources,
                     target_ranks=targets)
    local = rank_tensors(case["source_files"][sources.index(rank)]) if rank in sources else None
    result = {"name": case["name"], "rank": rank, "error": None}
    try:
        got = live.transfer(plan, local, timeout=60, chunk_bytes=case.get("chunk_bytes", 64 << 20))
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        return result
    result["stats"] = got.stats.as_dict()
    if rank in targets:
        path = os.path.join(out, f"{case['name']}-{targets.index(rank)}.safetensors")
        save_file({n: t.contiguous() for n, t in got.items()}, path)
    return result


def main() -> None:
    """live_worker's world loop, each case run by :func:`run_case` (targets saved under OUT)."""
    import live_worker

    live_worker.run_case = lambda case, rank: run_case(case, rank, sys.argv[5])
    live_worker.main()


if __name__ == "__main__":
    main()
