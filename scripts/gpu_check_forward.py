#!/usr/bin/env python
"""The forward check's host memory on a GPU node (issues 41 and 43; ``scripts/gpu_check.py`` calls :func:`rows`).

A ~1 GiB bf16 Llama-shaped HF checkpoint (``scripts/bench_model.ensure_source``) and its Megatron conversion are
checked with ``verify_forward(..., backend="nccl")`` in a child process; a GPU rank reads its weights straight
onto the device through bounded pinned buffers, so its peak host memory must stay at most ``HOST_LIMIT`` whatever
the layer size. Rows (``check``, ``result``, ``ok``, ``seconds``):

- ``tp1``: ``nproc=1`` (the rank runs in the child itself: its ``RUSAGE_SELF`` peak RSS);
- ``tp2`` (2+ GPUs): ``nproc=2`` against a Megatron tp2 conversion (the workers are the child's forkserver's
  children: the peak of the largest, ``RUSAGE_CHILDREN`` once the server is stopped and reaped).

``ok``: FORWARD EQUAL and the rank's peak RSS <= ``HOST_LIMIT``. Without CUDA (or with too few GPUs) a row says
``skipped: ...`` and is ok. On its own::

    python scripts/gpu_check_forward.py [WORKDIR]
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import signal
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
SIZE_GIB = 1.0
HOST_LIMIT = 1 << 30  # bytes of peak host RSS a GPU rank may reach
TIMEOUT = 600.0  # seconds for one child
CHECKS = {1: "verify --forward 1 GiB bf16 -> megatron tp1, nccl: rank host RSS",
          2: "verify --forward 1 GiB bf16 -> megatron tp2, nccl: rank host RSS"}


def _log(message: str) -> None:
    print(f"[gpu_check_forward] {message}", file=sys.stderr, flush=True)


def _row(nproc: int, result: str, ok: bool, seconds: float) -> dict:
    return {"check": CHECKS[nproc], "result": result, "ok": bool(ok), "seconds": round(seconds, 2)}


def _run_child(src: str, meg: str, nproc: int, out: pathlib.Path) -> tuple[int, float]:
    """Run this script's ``child`` mode; (its exit status, its peak RSS in bytes from ``os.wait4``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("RESHARD_FORWARD_STAGING", None)
    proc = subprocess.Popen([sys.executable, __file__, "child", src, meg, str(nproc), str(out)], env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + TIMEOUT
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_maxrss * 1024
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_maxrss * 1024
        time.sleep(0.1)


def _check(src: str, meg: str, nproc: int, workdir: pathlib.Path) -> dict:
    out = workdir / f"forward-tp{nproc}.json"
    out.unlink(missing_ok=True)
    started = time.perf_counter()
    code, tree_peak = _run_child(src, meg, nproc, out)
    took = time.perf_counter() - started
    if code != 0 or not out.exists():
        return _row(nproc, f"child exit {code} (see stderr above)", False, took)
    got = json.loads(out.read_text())
    rank_peak = got["self_maxrss"] if nproc == 1 else got["children_maxrss"]
    verdict = "FORWARD EQUAL" if got["ok"] else f"FORWARD DIFFERENT ({got['first_divergence']})"
    within = 0 < rank_peak <= HOST_LIMIT
    result = (f"{verdict}; rank peak host RSS {rank_peak / 2**20:.0f} MiB (limit {HOST_LIMIT / 2**20:.0f}); "
              f"verify {got['seconds']:.1f} s; max abs {got['max_abs']:.3g}; process tree peak "
              f"{tree_peak / 2**20:.0f} MiB")
    return _row(nproc, result, got["ok"] and within, got["seconds"])


def rows(workdir: pathlib.Path) -> list[dict]:
    """The forward memory rows (``check``, ``result``, ``ok``, ``seconds``), files under ``workdir``."""
    import torch

    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        return [_row(n, "skipped: no CUDA", True, 0.0) for n in CHECKS]
    sys.path[:0] = [p for p in (str(HERE), str(ROOT)) if p not in sys.path]
    import reshard
    from bench_model import ensure_source

    started = time.perf_counter()
    src, _, _ = ensure_source(workdir / "forward-cache", SIZE_GIB, 2 << 30, _log, "llama")
    out = []
    for nproc in CHECKS:
        if nproc > gpus:
            out.append(_row(nproc, f"skipped: {gpus} GPU", True, 0.0))
            continue
        meg = workdir / f"forward-megatron-tp{nproc}"
        if not meg.exists():
            _log(f"converting {src} to megatron tp{nproc} ...")
            reshard.convert(str(src), str(meg), to="megatron", tp=nproc)
        out.append(_check(str(src), str(meg), nproc, workdir))
        _log(out[-1]["result"])
    _log(f"done in {time.perf_counter() - started:.1f} s")
    return out


def child(src: str, meg: str, nproc: int, out: str) -> None:
    """Run the check; write its verdict, seconds and the peak RSS of this process and of its reaped children."""
    from reshard.verification.forward import verify_forward
    from reshard.verification.forward.launch import stop_worker_server

    started = time.perf_counter()
    report = verify_forward(src, meg, nproc=nproc, backend="nccl")
    seconds = time.perf_counter() - started
    stop_worker_server()  # reaps the forkserver, which reaped the workers: their peak is in RUSAGE_CHILDREN
    self_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    children_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    pathlib.Path(out).write_text(json.dumps({"ok": report["ok"], "first_divergence": report["first_divergence"],
                                             "max_abs": report["max_abs"], "seconds": seconds,
                                             "self_maxrss": self_peak, "children_maxrss": children_peak}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        import tempfile

        for r in rows(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())):
            print(json.dumps(r))
