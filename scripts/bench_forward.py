"""Time and memory of ``reshard verify --forward`` on a synthetic bf16 Llama checkpoint converted to Megatron.

    python scripts/bench_forward.py --size 2 --out /tmp/fwdbench [--tp 2] [--keep]

generates (or reuses) the HF source with ``scripts/bench_model.ensure_source``, converts it with
``python -m reshard convert SRC OUT/meg --to megatron --tp TP``, runs ``python -m reshard verify --forward SRC MEG
--nproc TP --json`` and prints one JSON row: wall seconds, the verdict, and each process's peak resident memory
(``VmHWM`` of ``/proc/<pid>/status``, sampled every 50 ms for the command and all its descendants until each exits;
the workers are the children of multiprocessing's forkserver). The figures come from the outside, so the same
script measures any version of reshard. Big files are deleted afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import GIB, ensure_source  # noqa: E402

MIB = 1 << 20


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, parent) of every live descendant of ``pid``."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for child in _children(parent):
            out.append((child, parent))
            todo.append(child)
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def measure_forward(src: Path, converted: Path, nproc: int, extra: list[str] | None = None) -> dict:
    """Run ``reshard verify --forward src converted --nproc nproc --json``; return wall seconds, the report's
    verdict and every process's peak RSS in bytes (``processes``: pid, role, peak_rss_bytes; role ``worker`` for
    the forkserver's children, which run the ranks)."""
    cmd = [sys.executable, "-m", "reshard", "verify", "--forward", str(src), str(converted), "--nproc", str(nproc),
           "--json", *(extra or [])]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, int] = {}
    parents: dict[int, int] = {proc.pid: os.getpid()}
    commands: dict[int, str] = {}
    while proc.poll() is None:
        for pid, parent in [(proc.pid, os.getpid())] + _descendants(proc.pid):
            try:
                hwm = int(_status(pid)["VmHWM"].split()[0]) * 1024
            except (OSError, KeyError, ValueError):
                continue
            peaks[pid] = max(peaks.get(pid, 0), hwm)
            parents.setdefault(pid, parent)
            commands.setdefault(pid, _cmdline(pid))
        time.sleep(0.05)
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    servers = {pid for pid, c in commands.items() if "forkserver" in c and parents[pid] == proc.pid}
    processes = []
    for pid, peak in sorted(peaks.items()):
        role = ("command" if pid == proc.pid else "forkserver" if pid in servers
                else "worker" if parents[pid] in servers else "other")
        processes.append({"pid": pid, "role": role, "peak_rss_bytes": peak, "peak_rss_mib": round(peak / MIB, 1)})
    try:
        report = json.loads(out)
    except json.JSONDecodeError:
        report = {}
    return {"wall_s": round(wall, 2), "rc": proc.returncode, "ok": report.get("ok"),
            "max_abs": report.get("max_abs"), "a_run": report.get("a", {}).get("run"),
            "processes": processes, "stderr_tail": err[-2000:] if proc.returncode else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=2.0, help="source size in GiB of bf16 (default 2)")
    parser.add_argument("--out", type=Path, required=True, help="work folder (sources, conversions)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the generated and converted checkpoints")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    src, plan, _ = ensure_source(args.out / "sources", args.size, 4 * GIB, log=lambda m: print(m, file=sys.stderr))
    meg = args.out / f"meg-tp{args.tp}"
    try:
        if not (meg / "latest_checkpointed_iteration.txt").exists():
            shutil.rmtree(meg, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "reshard", "convert", str(src), str(meg), "--to", "megatron",
                            "--tp", str(args.tp)], check=True, stdout=subprocess.DEVNULL)
        row = measure_forward(src, meg, args.tp)
        row.update(size_gib=args.size, tp=args.tp, shapes=plan["shapes"])
        workers = [p["peak_rss_bytes"] for p in row["processes"] if p["role"] == "worker"]
        row["worker_peak_rss_mib_max"] = round(max(workers) / MIB, 1) if workers else None
        print(json.dumps(row))
    finally:
        if not args.keep:
            shutil.rmtree(args.out / "sources", ignore_errors=True)
            shutil.rmtree(meg, ignore_errors=True)


if __name__ == "__main__":
    main()
