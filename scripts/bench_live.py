#!/usr/bin/env python
"""The live rows of scripts/bench.py (issue 34): ``reshard.live.transfer`` between running processes, next to the
naive all-gather-then-slice pattern RL frameworks hand-write, in the same world of processes and the same run.

One gloo world of ``WORLD`` processes on 127.0.0.1 (started here, always reaped) runs each case of ``CASES`` in
turn, every method of ``METHODS`` on it, ``repeat`` times:

- the source ranks' tensors are ``reshard.load_rank`` of the bench's cached synthetic Llama (``bench_model``) for
  their parallel rank, and each target rank preallocates its tensors (zeroed: an engine's own parameters, passed as
  ``into=``), both before timing: they are the rank's *own tensors*;
- ``reshard``: ``live.transfer(plan, local, into=...)`` (point to point, bounded chunks, each byte once);
- ``naive``: per pipeline stage and tensor, the stage's source ranks all-gather the tensor (every source rank of the
  stage materialises it whole), the stage's first rank broadcasts the whole tensor to every target rank, and each
  target slices its part out locally (the slices are the plan's, so both methods fill the same tensors);
- per rank: wall seconds (from a common barrier), ``stats.seconds`` (reshard), peak RSS above the rank's own tensors
  (``malloc_trim``, then VmHWM reset through ``/proc/self/clear_refs`` and VmRSS read just before the transfer;
  VmHWM minus that after), bytes sent and received (reshard: its counted sends; naive: the collectives' payloads);
- after each run the target tensors are hashed: reshard's and naive's must agree.

The row's bound is issue 34's: peak RSS above the own tensors <= 2 x chunk + 64 MiB on every rank. Run on its own::

    python scripts/bench_live.py --sizes 1.1 --out bench-out [--repeat 2] [--chunk-mib 64]

or from the bench: ``python scripts/bench.py --sizes 1.1 --ops cp --live --out bench-out``.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import hashlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_HERE = str(Path(__file__).resolve().parent)
if sys.path[:1] != [_HERE]:
    sys.path[:] = [_HERE] + [p for p in sys.path if p != _HERE]

REPO_ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
GIB = 1 << 30
DEFAULT_CHUNK = 64 * MIB
SLACK = 64 * MIB
WORLD = 6
METHODS = ("reshard", "naive")
MEGATRON_TP2_PP2 = {"layout": "megatron", "tp": 2, "pp": 2}
VLLM_TP2 = {"layout": "vllm", "tp": 2}
#: name -> (what, source, target, source ranks, target ranks)
CASES = {
    "megatron_tp2_pp2_to_vllm_tp2_disjoint": ("Megatron tp2 pp2 -> vLLM tp2, disjoint", MEGATRON_TP2_PP2, VLLM_TP2,
                                              [0, 1, 2, 3], [4, 5]),
    "megatron_tp4_to_vllm_tp2_colocated": ("Megatron tp4 -> vLLM tp2, colocated", {"layout": "megatron", "tp": 4},
                                           VLLM_TP2, [0, 1, 2, 3], [0, 2]),
}
METHOD_NAMES = {"reshard": "reshard live.transfer", "naive": "naive all-gather + broadcast, slice"}


def rss_bound(chunk_bytes: int) -> int:
    return 2 * chunk_bytes + SLACK


# --------------------------------------------------------------------------------------
# Worker (one process of the world)
# --------------------------------------------------------------------------------------


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _reset_peak() -> int:
    """Give freed heap back, reset VmHWM to VmRSS; returns VmRSS (what the process holds now)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss("VmRSS")


def rank_kwargs(spec: dict, index: int) -> dict:
    """load_rank's keywords for parallel rank ``index`` of ``spec`` (i = tp_rank + tp * (ep_rank + ep * pp_rank))."""
    tp, pp, ep = spec.get("tp", 1), spec.get("pp", 1), spec.get("ep", 1)
    kw = dict(tp=tp, pp=pp, ep=ep, rank=index % tp, ep_rank=index // tp % ep, pp_rank=index // (tp * ep))
    kw.update({k: v for k, v in spec.items() if k not in ("layout", "tp", "pp", "ep")})
    return kw


class Naive:
    """The all-gather-then-slice baseline for one plan: groups made collectively (every process of the world calls
    the constructor), then :meth:`run` on each participant."""

    def __init__(self, plan, dist):
        self.plan, self.dist = plan, dist
        spec = plan.source
        per_stage = spec.get("tp", 1) * spec.get("ep", 1)
        self.stages: list[list[int]] = []  # stage -> its source parallel indices
        for i in range(len(plan.source_ranks)):
            if i // per_stage == len(self.stages):
                self.stages.append([])
            self.stages[i // per_stage].append(i)
        self.gather_groups, self.bcast_groups, self.bcast_members = [], [], []
        for members in self.stages:
            ranks = [plan.source_ranks[i] for i in members]
            self.gather_groups.append(dist.new_group(ranks) if len(ranks) > 1 else None)
            receivers = sorted(set(plan.target_ranks) - set(ranks))
            group_ranks = sorted({ranks[0], *receivers})
            self.bcast_members.append(group_ranks)
            self.bcast_groups.append(dist.new_group(group_ranks) if receivers else None)
        # (source parallel index, tensor name) -> per target parallel index: [(target tensor, op)]
        self.uses: dict[tuple[int, str], dict[int, list]] = {}
        for j, tensors in enumerate(plan.targets):
            for t in tensors:
                for op in t.reads:
                    self.uses.setdefault((op.source, op.tensor), {}).setdefault(j, []).append((t, op))

    def run(self, me: int, local, dests) -> dict[str, Any]:
        import torch

        from reshard.io import dtypes
        from reshard.live.transfer import place, source_slice

        dist, plan = self.dist, self.plan
        sent = received = 0
        j = plan.target_ranks.index(me) if me in plan.target_ranks else None
        if j is not None:
            for t in plan.targets[j]:
                if t.fill is not None:
                    dests[t.name].fill_(t.fill)
        for s, members in enumerate(self.stages):
            ranks = [plan.source_ranks[i] for i in members]
            in_stage = me in ranks
            receives = me in self.bcast_members[s] and me != ranks[0]
            if not in_stage and not receives:
                continue
            k = len(members)
            for name, st in plan.sources[members[0]].items():
                dtype = dtypes.to_torch(st.dtype)
                shapes = [plan.sources[i][name].shape for i in members]
                assert len(set(shapes)) == 1, (name, shapes)  # tp / ep shards of one tensor: equal sizes
                nbytes = math.prod(st.shape) * dtype.itemsize
                full = torch.empty((k, nbytes), dtype=torch.uint8)  # the whole tensor, its shards side by side
                if in_stage:
                    own = local[name].contiguous().reshape(-1).view(torch.uint8)
                    if k > 1:
                        dist.all_gather(list(full.unbind(0)), own, group=self.gather_groups[s])
                        sent += (k - 1) * nbytes
                        received += (k - 1) * nbytes
                    else:
                        full[0].copy_(own)
                if self.bcast_groups[s] is not None and me in self.bcast_members[s]:
                    dist.broadcast(full, src=ranks[0], group=self.bcast_groups[s])
                    if me == ranks[0]:
                        sent += (len(self.bcast_members[s]) - 1) * full.numel()
                    else:
                        received += full.numel()
                if j is not None:
                    for pos, i in enumerate(members):
                        shard = full[pos].view(dtype).view(st.shape)
                        for t, op in self.uses.get((i, name), {}).get(j, []):
                            place(dests[t.name], op, t.axis, source_slice(shard, op, t.axis))
                del full
        return {"bytes_sent": sent, "bytes_received": received}


def _digest(tensors: dict) -> str:
    import torch

    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def worker(job_path: str, rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    import reshard
    from reshard import live
    from reshard.io import dtypes

    job = json.loads(Path(job_path).read_text())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=job["timeout"]))
    results = []

    def save() -> None:
        tmp = Path(out) / f"{rank}.json.tmp"
        tmp.write_text(json.dumps(results))
        os.replace(tmp, Path(out) / f"{rank}.json")

    for name in job["cases"]:
        _, source, target, source_ranks, target_ranks = CASES[name]
        plan = live.plan(job["ckpt"], source=source, target=target, source_ranks=source_ranks,
                         target_ranks=target_ranks)
        naive = Naive(plan, dist)  # collective: every process makes the groups
        part = rank in source_ranks or rank in target_ranks
        local, into = None, None
        if rank in source_ranks:
            local = reshard.load_rank(job["ckpt"], to=source["layout"],
                                      **rank_kwargs(source, source_ranks.index(rank)))
        if rank in target_ranks:
            into = {t.name: torch.zeros(t.shape, dtype=dtypes.to_torch(t.dtype))
                    for t in plan.targets[target_ranks.index(rank)]}
        for rep in range(job["repeat"]):
            for method in (job["methods"] if rep % 2 == 0 else job["methods"][::-1]):
                if into is not None:
                    for t in into.values():
                        t.zero_()
                held = _reset_peak()
                dist.barrier()
                started = time.time()
                res: dict[str, Any] = {"case": name, "method": method, "repeat": rep, "rank": rank,
                                       "role": ("source+target" if rank in source_ranks and rank in target_ranks
                                                else "source" if rank in source_ranks else
                                                "target" if rank in target_ranks else "idle")}
                if part:
                    if method == "reshard":
                        got = live.transfer(plan, local, into=into, timeout=job["timeout"],
                                            chunk_bytes=job["chunk_bytes"])
                        st = got.stats
                        res.update(bytes_sent=st.bytes_sent, bytes_received=st.bytes_received,
                                   local_bytes=st.local_bytes, messages=st.messages_sent + st.messages_received,
                                   transfer_s=st.seconds)
                    else:
                        res.update(naive.run(rank, local, into), local_bytes=0)
                ended = time.time()
                res.update(started=started, ended=ended, wall_s=ended - started, held_bytes=held,
                           extra_rss_bytes=_rss("VmHWM") - held)
                if into is not None:
                    res["digest"] = _digest(into)
                results.append(res)
                save()
                dist.barrier()
        del local, into
    save()
    dist.barrier()  # rank 0 hosts the store: nobody leaves while another still talks to it
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ckpt: Path, work: Path, cases: list[str], methods: tuple[str, ...] = METHODS, repeat: int = 1,
           chunk_bytes: int = DEFAULT_CHUNK, timeout: float = 600.0, world: int = WORLD) -> list[dict]:
    """Run the world; every run of every rank (a list of dicts). Every process is gone at the end: any still alive
    after ``timeout`` is killed with its process group, and then this raises."""
    work.mkdir(parents=True, exist_ok=True)
    for f in work.glob("*.json"):
        f.unlink()
    job = work / "job.json"
    job.write_text(json.dumps({"ckpt": str(ckpt), "cases": cases, "methods": list(methods), "repeat": repeat,
                               "chunk_bytes": chunk_bytes, "timeout": timeout}))
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    port = _free_port()
    procs = []
    try:
        for r in range(world):
            with open(work / f"rank{r}.log", "w") as logf:
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--worker", str(job), str(r), str(world), str(port), str(work)],
                    env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        failed = None
        for p in procs:
            try:
                rc = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed = f"live workers still running after {timeout:g} s"
                break
            if rc != 0 and failed is None:
                failed = f"live worker {procs.index(p)} exited with {rc}"
                break
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    if failed:
        tails = "\n".join(f"--- rank {r}\n" + (work / f"rank{r}.log").read_text()[-2000:] for r in range(world))
        raise RuntimeError(f"{failed}\n{tails}")
    runs = []
    for r in range(world):
        runs += json.loads((work / f"{r}.json").read_text())
    return runs


def summarize(runs: list[dict], ckpt: Path, chunk_bytes: int) -> list[dict]:
    """One row per (case, method): medians over repeats, peaks over repeats, per-rank lists."""
    from reshard import live

    rows = []
    bound = rss_bound(chunk_bytes)
    for name, (what, source, target, source_ranks, target_ranks) in CASES.items():
        mine = [r for r in runs if r["case"] == name]
        if not mine:
            continue
        plan = live.plan(str(ckpt), source=source, target=target, source_ranks=source_ranks,
                         target_ranks=target_ranks)
        payload = sum(plan.payload_bytes(j) for j in range(len(target_ranks)))
        model = sum(plan.target_bytes(j) for j in range(len(target_ranks)))
        participants = sorted(set(source_ranks) | set(target_ranks))
        digests = {}
        for method in METHODS:
            rs = [r for r in mine if r["method"] == method and r["rank"] in participants]
            if not rs:
                continue
            reps = sorted({r["repeat"] for r in rs})
            walls = [max(r["ended"] for r in rs if r["repeat"] == k) - min(r["started"] for r in rs if r["repeat"] == k)
                     for k in reps]
            per_rank = {p: max(r["extra_rss_bytes"] for r in rs if r["rank"] == p) for p in participants}
            held = {p: max(r["held_bytes"] for r in rs if r["rank"] == p) for p in participants}
            last = {r["rank"]: r for r in rs if r["repeat"] == reps[-1]}
            digests[method] = {p: last[p].get("digest") for p in target_ranks}
            moved = sum(last[p]["bytes_received"] for p in participants)
            local = sum(last[p].get("local_bytes", 0) for p in participants)
            row = {"case": name, "what": what, "method": method, "processes": len(participants),
                   "sources": len(source_ranks), "targets": len(target_ranks),
                   "colocated": bool(set(source_ranks) & set(target_ranks)), "repeats": len(reps),
                   "wall_s": statistics.median(walls), "walls_s": walls,
                   "per_rank_extra_rss_bytes": {str(p): v for p, v in per_rank.items()},
                   "per_rank_held_bytes": {str(p): v for p, v in held.items()},
                   "per_rank_wall_s": {str(p): statistics.median(r["wall_s"] for r in rs if r["rank"] == p)
                                       for p in participants},
                   "per_rank_bytes_sent": {str(p): last[p]["bytes_sent"] for p in participants},
                   "per_rank_bytes_received": {str(p): last[p]["bytes_received"] for p in participants},
                   "max_extra_rss_bytes": max(per_rank.values()),
                   "median_extra_rss_bytes": statistics.median(per_rank.values()),
                   "rss_bound_bytes": bound, "within_bound": max(per_rank.values()) <= bound,
                   "bytes_moved": moved, "local_bytes": local, "payload_bytes": payload, "model_bytes": model,
                   "chunk_bytes": chunk_bytes}
            if method == "reshard":
                row["transfer_s"] = statistics.median(
                    max(r["transfer_s"] for r in rs if r["repeat"] == k and "transfer_s" in r) for k in reps)
            rows.append(row)
        agree = len(digests) == len(METHODS) and len({tuple(sorted(d.items())) for d in digests.values()}) == 1
        for row in rows:
            if row["case"] == name:
                row["targets_agree"] = agree if len(digests) > 1 else None
    return rows


def measure(ckpt: Path, size: str, work: Path, repeat: int = 1, chunk_bytes: int = DEFAULT_CHUNK,
            timeout: float | None = None, log=print, cases: list[str] | None = None) -> list[dict]:
    """The live rows for the checkpoint ``ckpt`` (the bench's source of size ``size``)."""
    cases = list(cases or CASES)
    log(f"[bench] live: {', '.join(cases)} on {WORLD} gloo processes, chunk {chunk_bytes / MIB:g} MiB ...")
    runs = launch(ckpt, work, cases, repeat=repeat, chunk_bytes=chunk_bytes, timeout=timeout or 1800.0)
    rows = summarize(runs, ckpt, chunk_bytes)
    for row in rows:
        row["size"] = size
        log(f"[bench]   live {row['case']} {row['method']}: {row['wall_s']:.2f}s, peak RSS above own tensors max "
            f"{row['max_extra_rss_bytes'] / MIB:.0f} MiB (bound {row['rss_bound_bytes'] / MIB:.0f})")
    return rows


def _mib(b: float) -> str:
    return f"{b / MIB:.0f}"




def render(rows: list[dict]) -> str:
    lines = ["| size | case | operation | processes | seconds (wall) | peak RSS above own tensors, max / median (MiB) | "
             "bound 2 x chunk + 64 MiB | within bound | bytes moved / payload (MiB) | targets agree | "
             "per rank: seconds, peak RSS above own tensors (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        secs = f"{r['wall_s']:.2f}" + (f" (transfer {r['transfer_s']:.2f})" if "transfer_s" in r else "")
        procs = f"{r['processes']} ({r['sources']} -> {r['targets']}{', colocated' if r['colocated'] else ''})"
        moved = f"{_mib(r['bytes_moved'])}{' + ' + _mib(r['local_bytes']) + ' local' if r['local_bytes'] else ''}" \
                f" / {_mib(r['payload_bytes'])} ({(r['bytes_moved'] + r['local_bytes']) / r['payload_bytes']:.2f}x)"
        agree = {True: "yes", False: "NO", None: "n/a"}[r.get("targets_agree")]
        per_rank = ", ".join(f"r{p} {r['per_rank_wall_s'][p]:.1f}s {_mib(v)}"
                             for p, v in r["per_rank_extra_rss_bytes"].items())
        lines.append(f"| {r['size']} | {r['what']} | {METHOD_NAMES[r['method']]} | {procs} | {secs} | "
                     f"{_mib(r['max_extra_rss_bytes'])} / {_mib(r['median_extra_rss_bytes'])} | "
                     f"{_mib(r['rss_bound_bytes'])} MiB | {'yes' if r['within_bound'] else 'no'} | {moved} | {agree} | "
                     f"{per_rank} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[1], int(argv[2]), int(argv[3]), int(argv[4]), argv[5])
        return 0
    from bench_model import ensure_source

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1.1], help="model sizes in GiB (default: 1.1)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each method per case (default: 1)")
    ap.add_argument("--chunk-mib", type=float, default=DEFAULT_CHUNK / MIB, help="live.transfer's chunk (default 64)")
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=None)
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--cache-dir", type=Path, default=None, help="where sources are cached (default: OUT/sources)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds for the whole world (default 1800)")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    cache = (args.cache_dir or out / "sources").resolve()
    cache.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in args.sizes:
        src, _, _ = ensure_source(cache, size, 2 * GIB, lambda m: print(m, file=sys.stderr), "llama")
        rows += measure(src, f"{size:g}", out / "live-work", args.repeat, int(args.chunk_mib * MIB), args.timeout,
                        lambda m: print(m, file=sys.stderr, flush=True), args.cases)
    (out / "bench_live.json").write_text(json.dumps(rows, indent=1) + "\n")
    md = render(rows)
    (out / "bench_live.md").write_text(md + "\n")
    print(md)
    return 0 if all(r["within_bound"] for r in rows if r["method"] == "reshard") else 1


if __name__ == "__main__":
    sys.exit(main())
