"""Start the processes of a forward check and collect rank 0's report.

Three ways: a world of one runs in this process; under ``torchrun`` (``WORLD_SIZE``/``RANK`` set, no process
group yet) the given world is used (``env://`` rendezvous); otherwise ``world`` workers are spawned with
``torch.multiprocessing`` (spawn context), rendezvousing through a ``FileStore`` in a private temporary folder
(a c10d ``TCPStore``, even for host 127.0.0.1, listens on every interface; gloo itself is kept on the loopback
interface with ``GLOO_SOCKET_IFNAME=lo``). A worker that raises ends the run with its one-line error; a worker
that dies or a run that outlives ``timeout`` seconds is killed and fails.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import shutil
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from reshard.errors import ReshardError
from reshard.verification.forward.job import ForwardJob, run_job


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ and not dist.is_initialized()


def _one_line(exc: BaseException) -> tuple[str, int]:
    if isinstance(exc, ReshardError):
        return str(exc), exc.exit_code
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}", 1


def _worker(rank: int, world: int, store_path: str, job: ForwardJob, results) -> None:
    """Entry point of a spawned worker: report ("ok", rank, report) or ("error", rank, message, code)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(job.backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=job.timeout))
        try:
            out = run_job(job, rank, world)
        finally:
            dist.destroy_process_group()
        results.put(("ok", rank, out))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the launcher as one line
        message, code = _one_line(exc)
        if os.environ.get("RESHARD_DEBUG") == "1":
            message += "\n" + traceback.format_exc()
        results.put(("error", rank, message, code))


def _spawn(job: ForwardJob, world: int) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rendezvous = tempfile.mkdtemp(prefix="reshard-forward-")
    store_path = os.path.join(rendezvous, "store")
    procs = [ctx.Process(target=_worker, args=(r, world, store_path, job, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + job.timeout
    done: dict[int, dict | None] = {}
    try:
        while len(done) < world:
            try:
                msg = results.get(timeout=0.2)
            except queue_mod.Empty:
                msg = None
            if msg is not None:
                if msg[0] == "error":
                    _, rank, message, code = msg
                    raise ReshardError(f"forward check failed on rank {rank}: {message}", exit_code=code)
                done[msg[1]] = msg[2]
                continue
            dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode not in (None, 0)]
            if dead:
                time.sleep(0.5)  # a message may still be in flight
                if results.empty():
                    raise ReshardError(f"forward check worker rank {dead[0]} died (exit code "
                                       f"{procs[dead[0]].exitcode}) without reporting", exit_code=1)
            if time.monotonic() > deadline:
                waiting = [r for r in range(world) if r not in done]
                raise ReshardError(f"forward check timed out after {job.timeout:g}s (rank(s) "
                                   f"{', '.join(map(str, waiting))} still running); raise --timeout or look for "
                                   "a hung rank", exit_code=1)
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=1.0 if len(done) == world else 0)
            if p.is_alive():
                p.kill()
            p.join()
        results.close()
        shutil.rmtree(rendezvous, ignore_errors=True)
    return done[0]


def _torchrun(job: ForwardJob) -> dict | None:
    """Run inside an existing torchrun world; every rank returns rank 0's report."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if job.world > world:
        raise ReshardError(f"the check needs {job.world} processes but torchrun started {world}; use "
                           f"--nproc-per-node {job.world} or a smaller --nproc")
    dist.init_process_group(job.backend, timeout=datetime.timedelta(seconds=job.timeout))
    try:
        out = run_job(job, rank, world)
        box = [out]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    finally:
        dist.destroy_process_group()


def launch(job: ForwardJob) -> dict:
    """Run ``job`` and return rank 0's report dict."""
    if under_torchrun():
        return _torchrun(job)
    if job.world == 1:
        return run_job(job, 0, 1)
    return _spawn(job, job.world)
