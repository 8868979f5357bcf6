"""Runs shares of a plan in forked worker processes (``--workers N``).

Each worker closes the source descriptors it inherited (it reopens the files itself on first read), writes its
own target files into the staging folder (or compares its share of a verify), and reports progress, its results
and its outcome as one-line JSON messages on a shared pipe (lines shorter than PIPE_BUF are written atomically). The parent waits for all of them; the first
failure kills the others and is raised in the parent, so the staging folder is never published.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from reshard import errors
from reshard.io.tensorfile import TensorFile


def _describe(exc: BaseException) -> dict:
    if isinstance(exc, OSError):
        return {"kind": "OSError", "errno": exc.errno, "strerror": exc.strerror, "filename": exc.filename}
    if isinstance(exc, errors.ReshardError):
        return {"kind": "reshard", "cls": type(exc).__name__, "message": str(exc)}
    return {"kind": "other", "message": f"{type(exc).__name__}: {exc}"}


def _rebuild(info: dict) -> BaseException:
    if info["kind"] == "OSError":
        return OSError(info["errno"], info["strerror"], info["filename"])
    if info["kind"] == "reshard":
        cls = getattr(errors, info["cls"], None)
        if not (isinstance(cls, type) and issubclass(cls, errors.ReshardError)):
            cls = errors.ReshardError
        return cls(info["message"])
    return RuntimeError(f"a worker failed: {info['message']}")


def _child(share, work, files: list[TensorFile], wfd: int, processes: int) -> None:
    from reshard.io.heads import share_read_ahead

    for f in files:
        f.close()
    share_read_ahead(processes)  # the processes together ask for one window ahead, not one each
    if "torch" in sys.modules:  # OpenMP pools do not survive fork: keep torch (casts only) single-threaded
        sys.modules["torch"].set_num_threads(1)

    def send(message: dict) -> None:
        os.write(wfd, (json.dumps(message) + "\n").encode())

    code = 0
    try:
        for item in work(share, lambda n: send({"bytes": n})) or ():
            send({"result": item})
        send({"done": True})
    except BaseException as exc:  # reported to the parent, which raises it
        send({"error": _describe(exc)})
        code = 1
    finally:
        os._exit(code)


def run_in_workers(shares: list, work, files: list[TensorFile], total_bytes: int, progress: bool,
                   desc: str = "converting") -> list:
    """Fork one worker per share, running ``work(share, report)``; raise the first worker's error. ``work`` may
    return JSON-able items (each well under PIPE_BUF once encoded): all workers' items come back, in no set
    order."""
    from reshard.progress import byte_bar

    rfd, wfd = os.pipe()
    pids = []
    try:
        for share in shares:
            pid = os.fork()
            if pid == 0:
                os.close(rfd)
                _child(share, work, files, wfd, len(shares))
            pids.append(pid)
    finally:
        os.close(wfd)
    failure: BaseException | None = None
    finished = 0
    results = []
    try:
        with os.fdopen(rfd, "rb") as pipe, byte_bar(total_bytes, desc, disable=not progress) as bar:
            for line in pipe:
                message = json.loads(line)
                if "bytes" in message:
                    bar.update(message["bytes"])
                elif "result" in message:
                    results.append(message["result"])
                elif "done" in message:
                    finished += 1
                elif "error" in message and failure is None:
                    failure = _rebuild(message["error"])
                    _kill(pids)
    except BaseException:
        _kill(pids)
        raise
    finally:
        statuses = [os.waitpid(pid, 0)[1] for pid in pids]
    if failure is not None:
        raise failure
    if finished != len(pids) or any(statuses):
        raise RuntimeError(f"a worker process died (exit statuses {statuses})")
    return results


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
