"""Running and measuring one child for scripts/bench.py: page-cache eviction before a run, the rusage
wrapper, timing (command + sync), peak RSS and sampled process-tree RSS."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

CACHE_MODES = ("data", "all", "warm")

# --------------------------------------------------------------------------------------
# Running children
# --------------------------------------------------------------------------------------


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict_files(root: Path) -> bool:
    """Flush, then drop every file under ``root`` from the page cache (``POSIX_FADV_DONTNEED`` on clean pages):
    the checkpoint is read cold while programs and libraries stay cached, as they are for a tool in use."""
    os.sync()
    if not hasattr(os, "posix_fadvise"):
        return False
    for folder, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def make_cold(mode: str, source: Path) -> str:
    """Prepare one run under cache ``mode``; returns what the run actually got: data, all or warm."""
    if mode == "all" and drop_caches():
        return "all"
    if mode in ("all", "data") and evict_files(source):
        return "data"
    os.sync()
    return "warm"


def _proc_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def _rss_anon(pid: int) -> tuple[int, int]:
    rss = anon = 0
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith(b"RssAnon:"):
                    anon = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, anon


class TreeSampler(threading.Thread):
    """Samples the summed RSS / anonymous RSS of the descendants of a process (the wrapper).  Only a
    supplement to ``ru_maxrss``: sampled (may miss short peaks) and summed (shared pages of
    forked workers are counted once per process, so an upper bound across processes)."""

    def __init__(self, pid: int, interval: float = 0.1):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.stop_event = threading.Event()
        self.peak_rss = self.peak_anon = 0
        self.max_procs = 0

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                pids = _proc_tree(self.pid)[1:] if os.path.exists(f"/proc/{self.pid}") else []
            except OSError:
                pids = []
            rss = anon = 0
            for pid in pids:
                r, a = _rss_anon(pid)
                rss += r
                anon += a
            self.peak_rss = max(self.peak_rss, rss)
            self.peak_anon = max(self.peak_anon, anon)
            self.max_procs = max(self.max_procs, len(pids))
            self.stop_event.wait(self.interval)


# Why a wrapper: Linux folds the memory high-water mark of the process that execs into the
# new program's ru_maxrss (the pre-exec address space, shared under vfork or copied under
# fork), so a child spawned straight from this (numpy/torch-importing) process would report
# at least our own peak.  The wrapper is a bare ``python -I -S`` (~9 MiB) that forks, execs the
# command, reaps it with os.wait4 and writes that rusage (and its own precise timing) to a
# file; the reported peak is therefore max(true peak of the command and the descendants it
# reaped, ~9 MiB).
WRAPPER_CODE = r"""
import os, sys, time
out, cmd = sys.argv[1], sys.argv[2:]
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        os.write(2, ("exec failed: %r\n" % (e,)).encode())
    os._exit(127)
_, status, ru = os.wait4(pid, 0)
t1 = time.perf_counter()
with open(out, "w") as f:
    f.write("%d %d %r %r %r\n" % (pid, ru.ru_maxrss, ru.ru_utime, ru.ru_stime, t1 - t0))
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""


def run_child(cmd: list[str], log_path: Path, env: dict[str, str], timeout: float | None) -> dict[str, Any]:
    """Run ``cmd`` (through the rusage wrapper) and then ``sync``.  Returns exit code, timings
    (``cmd_s`` measured inside the wrapper around fork..wait4, ``wall_s`` = ``cmd_s`` + sync)
    and the peak RSS of the command."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    rusage_path = log_path.with_name(log_path.name + ".rusage")
    rusage_path.unlink(missing_ok=True)
    timed_out = threading.Event()
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", WRAPPER_CODE, str(rusage_path), *cmd],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        sampler = TreeSampler(proc.pid)
        sampler.start()
        timer = None
        if timeout:
            def _kill() -> None:
                timed_out.set()
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

            timer = threading.Timer(timeout, _kill)
            timer.start()
        _, status, outer_ru = os.wait4(proc.pid, 0)
        t1 = time.perf_counter()
        proc.returncode = os.waitstatus_to_exitcode(status)  # already reaped; keep Popen from waiting
        if timer:
            timer.cancel()
        sampler.stop_event.set()
        os.sync()
        t2 = time.perf_counter()
        sampler.join()
    try:
        _pid, maxrss_kib, utime, stime, inner_s = rusage_path.read_text().split()
        maxrss, user_s, sys_s, cmd_s = int(maxrss_kib) * 1024, float(utime), float(stime), float(inner_s)
        rusage_path.unlink()
    except (OSError, ValueError):  # wrapper killed: fall back to outer numbers (peak inflated)
        maxrss, user_s, sys_s, cmd_s = outer_ru.ru_maxrss * 1024, outer_ru.ru_utime, outer_ru.ru_stime, t1 - t0
    rc = proc.returncode
    return {
        "rc": rc,
        "timed_out": timed_out.is_set(),
        "wall_s": cmd_s + (t2 - t1),
        "cmd_s": cmd_s,
        "sync_s": t2 - t1,
        "outer_wall_s": t2 - t0,
        "peak_rss_bytes": maxrss,  # ru_maxrss is in KiB on Linux
        "tree_peak_rss_bytes_sampled": sampler.peak_rss,
        "tree_peak_anon_bytes_sampled": sampler.peak_anon,
        "max_processes_sampled": sampler.max_procs,
        "user_s": user_s,
        "sys_s": sys_s,
    }


def log_tail(path: Path, n: int = 2000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-n:].decode(errors="replace")
