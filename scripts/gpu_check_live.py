#!/usr/bin/env python
"""The live rows of the GPU node's device check (issue 41; ``scripts/gpu_check.py`` calls :func:`rows`).

Each row starts a small world of processes on 127.0.0.1 (all worlds at once, every process reaped by
``DEADLINE`` seconds) that runs ``reshard.live.transfer`` of the demo Llama (``reshard demo``'s checkpoint) from
Megatron to vLLM names, each target tensor compared with ``reshard.load_rank``'s bit for bit:

- ``nccl1``: a world of 1 over NCCL, ``into=`` CUDA tensors filled in place (same ``data_ptr``);
- ``gloo``: rank 0 sends, rank 1 receives into CUDA ``into=`` tensors (CPU ones without CUDA) over gloo;
- ``shared``: two NCCL ranks both on GPU 0: both must raise reshard's ``TransferError`` within seconds, not
  NCCL's "Duplicate GPU detected";
- ``nccl2`` (2+ GPUs): rank 0 on GPU 0 sends to rank 1 on GPU 1 over NCCL.

Without CUDA the NCCL rows are ``ok`` with result ``skipped: no CUDA``. On its own::

    python scripts/gpu_check_live.py [WORKDIR]
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

DEADLINE = 50.0  # seconds for all worlds together
TRANSFER_TIMEOUT = 15.0  # live.transfer's timeout in each process
REFUSED_WITHIN = 10.0  # seconds within which both ranks of ``shared`` must have raised
ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE, TARGET = {"layout": "megatron", "tp": 1}, {"layout": "vllm", "tp": 1}
ROWS = {"nccl1": "live nccl world of 1 into CUDA into= tensors", "gloo": "live gloo into CUDA into= tensors",
        "shared": "live nccl two ranks on one GPU refused", "nccl2": "live nccl two ranks on two GPUs"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(mode: str, world: int, workdir: pathlib.Path, ckpt: str) -> list[subprocess.Popen]:
    """Start world ``mode``'s ``world`` processes (each in its own session, its stderr in WORKDIR/MODE-RANK.log)."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    port, procs = str(_free_port()), []
    for r in range(world):
        with open(workdir / f"{mode}-{r}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, __file__, "worker", mode, str(r), str(world), port,
                                           str(workdir), ckpt], env=env, start_new_session=True,
                                          stdout=subprocess.DEVNULL, stderr=log))
    return procs


def _judge(mode: str, results: list[dict | None], codes: list[int | None]) -> tuple[str, bool]:
    """(result, ok) of world ``mode`` from its ranks' results (None: none written) and exit codes (None: killed)."""
    if any(r is None for r in results):
        missing = [i for i, r in enumerate(results) if r is None]
        return f"no result from rank(s) {missing} (exit codes {codes}; see its .log)", False
    if mode == "shared":
        errors = [r["error"] or "" for r in results]
        ok = all(e.startswith("TransferError: live.transfer: ranks 0 and 1 share GPU") for e in errors) and \
            all("Duplicate GPU" not in e for e in errors) and all(r["seconds"] < REFUSED_WITHIN for r in results)
        slowest = max(r["seconds"] for r in results)
        return (f"both ranks raised in {slowest:.2f} s: {errors[0]}" if ok
                else f"expected reshard's TransferError within {REFUSED_WITHIN:g} s: {errors}"), ok
    failed = [f"rank {i}: {r['error']}" for i, r in enumerate(results) if r["error"]]
    if failed:
        return "; ".join(failed), False
    target = results[-1]
    ok = target["mismatch"] == [] and target["names_equal"] and target["in_place"]
    how = f"{target['tensors']} tensors, {target['bytes'] / 2**20:.1f} MiB into {target['device']}"
    if not ok:
        return f"{how}: mismatch {target['mismatch'][:3]}, names equal {target['names_equal']}, in place " \
               f"{target['in_place']}", False
    return f"bit-equal and in place: {how} in {max(r['seconds'] for r in results):.2f} s", True


def rows(workdir: pathlib.Path) -> list[dict]:
    """The live rows (``check``, ``result``, ``ok``, ``seconds``), files under ``workdir``; under a minute."""
    import torch

    from reshard.demo import make_demo_checkpoint

    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    skipped = {}
    if not cuda:
        skipped = {"nccl1": "skipped: no CUDA", "shared": "skipped: no CUDA", "nccl2": "skipped: no CUDA"}
    elif gpus < 2:
        skipped = {"nccl2": f"skipped: {gpus} GPU"}
    ckpt = make_demo_checkpoint(str(workdir / "demo-ckpt"))
    worlds = {mode: 1 if mode == "nccl1" else 2 for mode in ROWS if mode not in skipped}
    started = time.monotonic()
    procs = {mode: _start(mode, world, workdir, ckpt) for mode, world in worlds.items()}
    ended = {}
    try:
        while len(ended) < len(procs) and time.monotonic() - started < DEADLINE:
            for mode, ps in procs.items():
                if mode not in ended and all(p.poll() is not None for p in ps):
                    ended[mode] = time.monotonic() - started
            time.sleep(0.05)
    finally:
        for ps in procs.values():
            for p in ps:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    out = []
    for mode, check in ROWS.items():
        if not cuda and mode == "gloo":
            check = "live gloo into CPU into= tensors (no CUDA)"
        if mode in skipped:
            out.append({"check": check, "result": skipped[mode], "ok": True, "seconds": 0.0})
            continue
        files = [workdir / f"{mode}-{r}.json" for r in range(worlds[mode])]
        results = [json.loads(f.read_text()) if f.exists() else None for f in files]
        result, ok = _judge(mode, results, [p.returncode for p in procs[mode]])
        if mode not in ended:
            result, ok = f"killed after {DEADLINE:g} s: {result}", False
        out.append({"check": check, "result": result, "ok": ok, "seconds": round(ended.get(mode, DEADLINE), 2)})
    return out


def _transfer(mode: str, rank: int, world: int) -> dict:
    """This process's part of world ``mode`` (the process group is up): ``error`` (the transfer's), its
    ``seconds`` and, on the target, the comparison with ``load_rank``."""
    import torch
    import torch.distributed as dist

    import reshard
    from reshard import live
    from reshard.io.assemble import bits_equal

    ckpt = sys.argv[7]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sources, targets = ([0], [0]) if world == 1 else ([0], [1])
    plan = live.plan(ckpt, source=SOURCE, target=TARGET, source_ranks=sources, target_ranks=targets)
    local = into = None
    if rank in sources:
        local = reshard.load_rank(ckpt, to=SOURCE["layout"])
        if mode != "gloo":
            local = {n: t.to(device) for n, t in local.items()}
    if rank in targets:
        want = reshard.load_rank(ckpt, to=TARGET["layout"])
        into = {n: torch.full_like(t, float("nan"), device=device) for n, t in want.items()}
        ptrs = {n: t.data_ptr() for n, t in into.items()}
    if mode == "nccl2":
        dist.barrier(device_ids=[rank])  # docs/live.md: a barrier on an NCCL group first
    started = time.monotonic()
    try:
        got = live.transfer(plan, local, into=into, timeout=TRANSFER_TIMEOUT)
    except live.TransferError as exc:
        return {"error": f"TransferError: {exc}", "seconds": time.monotonic() - started}
    out = {"error": None, "seconds": time.monotonic() - started}
    if rank in targets:
        out.update(names_equal=sorted(got) == sorted(want), device=str(device), tensors=len(want),
                   bytes=sum(t.numel() * t.element_size() for t in want.values()),
                   mismatch=[n for n in want if n not in got or not bits_equal(got[n].cpu(), want[n])],
                   in_place=all(got[n] is into[n] and into[n].data_ptr() == ptrs[n] for n in into))
    return out


def worker() -> None:
    """``gpu_check_live.py worker MODE RANK WORLD PORT WORKDIR CKPT``: one process of a world; writes
    WORKDIR/MODE-RANK.json (``error``, ``seconds`` and, on the target, the comparison)."""
    import torch
    import torch.distributed as dist

    mode, rank, world, port, workdir = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
    result = {"rank": rank, "error": None, "seconds": 0.0}
    started = time.monotonic()
    try:  # an error outside the transfer (setup, comparison): seconds since the process started
        backend = "gloo" if mode == "gloo" else "nccl"
        if backend == "nccl":
            torch.cuda.set_device(rank if mode == "nccl2" else 0)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
        result.update(_transfer(mode, rank, world))
    except Exception as exc:
        result.update(error=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - started)
    with open(os.path.join(workdir, f"{mode}-{rank}.json"), "w") as f:
        json.dump(result, f)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(0)


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker()
    else:
        import tempfile

        for row in rows(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())):
            print(json.dumps(row))
