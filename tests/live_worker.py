"""One process of a live-transfer test world: ``python live_worker.py JOB.json RANK WORLD PORT OUT``.

The job lists cases; every process runs each in turn (a case names its source and target ranks: other processes
skip it). A source rank passes the tensors ``reshard.load_rank`` gives for its parallel rank; a target rank
compares what it receives with ``load_rank`` of its own rank, bit for bit. ``fail`` makes one rank raise or
SIGKILL itself mid-transfer (its ``local_tensors`` fail on the Nth look-up, after the up-front check). Each
process writes OUT/RANK.json: one result per case (stats, equality, in-place checks, error, seconds)."""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

import reshard
from reshard import live
from reshard.io import dtypes
from reshard.io.assemble import bits_equal


def tiny_mixtral(root) -> str:
    """A tiny Mixtral (4 experts, 8 heads, 4 KV heads: Megatron tp4 works) saved by transformers in ``root``."""
    import transformers

    from helpers import tiny_transformers_model

    path = os.path.join(str(root), "mixtral")
    tiny_transformers_model(transformers, "MixtralConfig", num_local_experts=4, num_experts_per_tok=2,
                            num_key_value_heads=4).save_pretrained(path)
    return path


def rank_kwargs(spec: dict, index: int) -> dict:
    """load_rank's keywords for parallel rank ``index`` of ``spec`` (i = tp_rank + tp * (ep_rank + ep * pp_rank))."""
    tp, pp, ep = spec.get("tp", 1), spec.get("pp", 1), spec.get("ep", 1)
    kw = dict(tp=tp, pp=pp, ep=ep, rank=index % tp, ep_rank=index // tp % ep, pp_rank=index // (tp * ep))
    kw.update({k: v for k, v in spec.items() if k not in ("layout", "tp", "pp", "ep")})
    return kw


class Failing(Mapping):
    """``tensors`` that raise (or SIGKILL the process) on look-up number ``after``."""

    def __init__(self, tensors: dict, after: int, kind: str):
        self.tensors, self.after, self.kind, self.count = tensors, after, kind, 0

    def __getitem__(self, name):
        self.count += 1
        if self.count == self.after:
            if self.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected failure mid-transfer")
        return self.tensors[name]

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)


def rss(field: str) -> int:
    """VmRSS / VmHWM of this process, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def run_memory_case(case: dict, plan, rank: int) -> dict:
    """A transfer of tensors made from the plan's shapes (a model too big for position coding): this process's
    peak RSS above what it held when the transfer started (its own tensors, touched), VmHWM reset first."""
    local = None
    if rank in plan.source_ranks:
        held = plan.sources[plan.source_ranks.index(rank)]
        local = {n: torch.empty(t.shape, dtype=getattr(torch, dtypes.torch_name(t.dtype))).fill_(rank + 1)
                 for n, t in held.items()}
    into = None
    if rank in plan.target_ranks:
        into = {t.name: torch.empty(t.shape, dtype=getattr(torch, dtypes.torch_name(t.dtype))).fill_(0)
                for t in plan.targets[plan.target_ranks.index(rank)]}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = rss("VmRSS")
    got = live.transfer(plan, local, into=into, timeout=120)
    return {"name": case["name"], "rank": rank, "error": None, "stats": got.stats.as_dict(),
            "extra_rss": rss("VmHWM") - before, "held": before, "seconds": got.stats.seconds}


def run_case(case: dict, rank: int) -> dict | None:
    source, target = case["source"], case["target"]
    sources, targets = case["source_ranks"], case["target_ranks"]
    if rank not in sources and rank not in targets:
        return None
    plan = live.plan(case["config"], source=source, target=target, source_ranks=sources, target_ranks=targets)
    if case.get("memory"):
        return run_memory_case(case, plan, rank)
    local = None
    if rank in sources:
        local = reshard.load_rank(case["ckpt"], to=source["layout"], **rank_kwargs(source, sources.index(rank)))
    fail = case.get("fail")
    if fail and fail["rank"] == rank:
        local = Failing(local, fail["after"], fail["kind"])
    want, into, ptrs = {}, None, {}
    if rank in targets:
        kw = rank_kwargs(target, targets.index(rank))
        if case.get("dtype"):
            kw["dtype"] = case["dtype"]
        want = reshard.load_rank(case["ckpt"], to=target["layout"], **kw)
        if case.get("into"):
            into_dtype = getattr(torch, case["into"]) if isinstance(case["into"], str) else None
            into = {n: torch.full_like(t, float("nan"), dtype=into_dtype or t.dtype) for n, t in want.items()}
            ptrs = {n: t.data_ptr() for n, t in into.items()}
            if into_dtype:
                want = {n: t.to(into_dtype) for n, t in want.items()}
    started = time.monotonic()
    result = {"name": case["name"], "rank": rank}
    try:
        got = live.transfer(plan, local, dtype=case.get("dtype"), into=into, timeout=case.get("timeout", 60),
                            chunk_bytes=case.get("chunk_bytes", 64 << 20))
    except Exception as exc:
        result.update(error=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - started)
        return result
    result.update(seconds=time.monotonic() - started, stats=got.stats.as_dict(), error=None)
    if rank in targets:
        result["names_equal"] = sorted(got) == sorted(want)
        result["mismatch"] = [n for n in want if n not in got or not bits_equal(got[n], want[n])]
        if into is not None:
            result["in_place"] = all(got[n] is into[n] and into[n].data_ptr() == ptrs[n] for n in into)
            result["allocated"] = got.stats.allocated
    return result


def main() -> None:
    job, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    with open(job) as f:
        spec = json.load(f)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=spec.get("pg_timeout", 60)))
    results = []
    for case in spec["cases"]:
        result = run_case(case, rank)
        if result is not None:
            results.append(result)
        with open(os.path.join(out, f"{rank}.json"), "w") as f:
            json.dump(results, f)
    if not spec.get("broken"):
        dist.barrier()  # rank 0 hosts the store: nobody leaves while another still talks to it
    sys.stdout.flush()
    if spec.get("normal_exit"):  # the interpreter's own exit, as a user's script ends after the error
        dist.destroy_process_group()
        return
    os._exit(0)


if __name__ == "__main__":
    main()
