"""Start the processes of a forward check and collect rank 0's report.

Three ways: a world of one runs in this process; under ``torchrun`` (``WORLD_SIZE``/``RANK`` set, no process
group yet) the given world is used (``env://`` rendezvous); otherwise ``world`` workers are started with
``torch.multiprocessing``'s forkserver context (:func:`worker_context`), rendezvousing through a ``FileStore`` in a
private temporary folder
(a c10d ``TCPStore``, even for host 127.0.0.1, listens on every interface; gloo itself is kept on the loopback
interface with ``GLOO_SOCKET_IFNAME=lo``). Workers start from a fixed entry point, :func:`_worker`: the caller's
main module is never imported in them (:func:`_fixed_entry`), so a script without ``if __name__ ==
"__main__":`` is not run again. A worker that raises (unpickling its job included) ends the run with its one-line
error; a worker that dies or a run that outlives ``timeout`` seconds is killed and fails.
"""

from __future__ import annotations

import datetime
import os
import pickle
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


#: The name of worker ``rank``'s process; :func:`_fixed_entry` knows the workers by it.
WORKER_NAME = "reshard-forward-rank-{}"


def worker_context():
    """The forkserver context (spawn where there is none), its server preloaded with this module (torch, the
    decoder), never the caller's main module.

    A spawned worker imports torch and reshard afresh: 3-4 s each here, all ranks at once on few cores. The
    forkserver is started once per process (with the first check) from a fresh interpreter and imports them
    once; each worker is then a fork of that single-threaded server, which has run no torch op, so no thread pool
    or lock is copied in use (forking the caller itself could copy both). Each worker still gets the caller's
    current ``sys.path`` and working folder (multiprocessing's preparation data) and environment (:func:`_worker`).
    The server exits with the caller."""
    import torch.multiprocessing as mp

    _fixed_entry()
    if "forkserver" not in mp.get_all_start_methods():  # Windows: spawn, every worker imports torch itself
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, "reshard.cli"])  # no effect once the server runs
    return ctx


def _fixed_entry() -> None:
    """Start the workers (processes named :data:`WORKER_NAME`) without the caller's main module.

    multiprocessing's preparation data tells a forkserver or spawned child to import the parent's ``__main__``
    (``init_main_from_path`` / ``init_main_from_name``) before it unpickles its target: a script calling
    ``reshard.verify(..., forward=True)`` outside ``if __name__ == "__main__":`` would run again in every worker.
    A worker's target is :func:`_worker` and its job plain reshard data, so it needs none: those two keys are left
    out for the workers' processes, and every other process keeps multiprocessing's own data. Installed once."""
    from multiprocessing import spawn

    prepare = spawn.get_preparation_data
    if getattr(prepare, "reshard_fixed_entry", False):
        return

    def get_preparation_data(name, *args, **kwargs):
        data = prepare(name, *args, **kwargs)
        if str(name).startswith(WORKER_NAME.format("")):
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
        return data

    get_preparation_data.reshard_fixed_entry = True
    spawn.get_preparation_data = get_preparation_data


def stop_worker_server() -> None:
    """End the forkserver now, if this process started one, and multiprocessing's resource tracker (the console
    entry point leaves with ``os._exit``; left alone, the server would notice and still spend a second unloading
    torch, the tracker a moment)."""
    import signal
    from multiprocessing import forkserver, resource_tracker

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    try:
        if pid:
            os.kill(pid, signal.SIGKILL)
            server._stop()  # reaps it, closes the pipe, removes its socket: the next check starts a fresh one
        tracker = getattr(resource_tracker, "_resource_tracker", None)
        if getattr(tracker, "_pid", None):
            tracker._stop()  # it unlinks what is left registered and exits; reaped here
    except (OSError, AttributeError):
        pass


def return_freed_memory() -> None:
    """Make glibc's malloc serve every allocation of 1 MiB or more with its own mapping, unmapped when freed.

    A worker reads each layer on a reader thread (its own malloc arena) and frees it on the main thread; with
    glibc's default, sliding mmap threshold (up to 32 MiB) those tensors land in the arenas' heaps, and the
    process's resident memory keeps the holes. No effect off glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (fixing it also turns off the sliding threshold)
    except (OSError, AttributeError):
        pass


def _worker(rank: int, world: int, store_path: str, job: bytes, results, env: dict) -> None:
    """Entry point of a worker: report ("ok", rank, report) or ("error", rank, message, code). ``job``: the
    pickled :class:`ForwardJob`, unpickled here so that a failure to do so is reported like any other. ``env``:
    the caller's environment when the worker was started (the forkserver's own dates from its start)."""
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    return_freed_memory()
    try:
        job = pickle.loads(job)
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


def _start_workers(job: ForwardJob, world: int) -> dict:
    ctx = worker_context()
    results = ctx.Queue()
    rendezvous = tempfile.mkdtemp(prefix="reshard-forward-")
    store_path = os.path.join(rendezvous, "store")
    env = dict(os.environ)
    data = pickle.dumps(job)
    procs = [ctx.Process(target=_worker, args=(r, world, store_path, data, results, env), daemon=True,
                         name=WORKER_NAME.format(r)) for r in range(world)]
    deadline = time.monotonic() + job.timeout  # before any worker runs: a rank's own timeout ends after it
    done: dict[int, dict | None] = {}
    try:
        for p in procs:
            try:
                p.start()
            except OSError as exc:
                if "AF_UNIX path too long" not in str(exc):
                    raise
                raise ReshardError(f"the temp folder {tempfile.gettempdir()} is too long a path for the forward "
                                   "check's worker socket: set TMPDIR to a shorter folder", exit_code=2) from None
        while len(done) < world:
            try:
                msg = results.get(timeout=0.2)
            except queue_mod.Empty:
                msg = None
            if msg is not None and msg[0] == "error" and time.monotonic() > deadline:
                msg = None  # past the deadline, a rank's own collective timeout (same limit) is this run's timeout
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
                    raise ReshardError(f"forward check worker rank {dead[0]} {_death(procs[dead[0]].exitcode)} "
                                       "before reporting; its own output, if any, is above", exit_code=1)
            if time.monotonic() > deadline:
                waiting = [r for r in range(world) if r not in done]
                raise ReshardError(f"forward check timed out after {job.timeout:g}s (rank(s) "
                                   f"{', '.join(map(str, waiting))} still running); raise --timeout or look for "
                                   "a hung rank", exit_code=1)
    finally:
        for p in procs:
            if p.pid is None:  # never started
                continue
            if p.is_alive():
                p.join(timeout=1.0 if len(done) == world else 0)
            if p.is_alive():
                p.kill()
            p.join()
        results.close()
        shutil.rmtree(rendezvous, ignore_errors=True)
    return done[0]


def _death(code: int) -> str:
    """How a worker ended, in words: ``exited with code 1``, ``was killed by SIGKILL (out of memory?)``."""
    import signal

    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"was killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")


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
    return _start_workers(job, job.world)
