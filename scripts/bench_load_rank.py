#!/usr/bin/env python
"""The load_rank rows: ``reshard.load_rank(src, "vllm", tp=t, rank=0, device=D)`` timed next to safetensors'
``load_file`` of every file of ``src`` to D (what a loader without reshard does at tp 1).

Each run is a fresh child (``bench_timing.run_child``, through the rusage wrapper) started after the source is
evicted from the page cache (``bench_timing.make_cold``). Inside the child, torch is imported and CUDA initialised
first; then the timed part runs (load and, for CUDA, ``synchronize``) and the child reports its seconds, the
bytes it holds (all tensors for load_file, the rank's for load_rank; on the CPU load_file's tensors are lazy maps
of the file, so the child copies each into memory, as a loader that uses the bytes would) and the growth of its
peak RSS over the RSS before loading (the CUDA runtime's own host memory is not the loader's). A row gives
GiB/s, the peak RSS (``ru_maxrss``), the RSS growth, the time over load_file's, and the time over load_file's
time scaled to the rank's bytes (the time to read its own bytes at load_file's rate). Goals: tp 1 no slower
than load_file, a tp-N rank within 1.2x of its own bytes' time, RSS growth at most 512 MiB::

    python scripts/bench_load_rank.py --size 1 --device cpu --out /tmp/blr

:func:`rows` is the GPU device check (an 8 GiB Llama to CUDA, and CUDA against CPU bit for bit);
``scripts/bench.py --load-rank`` adds :func:`measure`'s rows (to the CPU) to the bench.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = str(Path(__file__).resolve().parent)
if sys.path[:1] != [_HERE]:
    sys.path[:] = [_HERE] + [p for p in sys.path if p != _HERE]

from bench_model import GIB, MIB, ensure_source  # noqa: E402
from bench_ops import child_env  # noqa: E402
from bench_timing import log_tail, make_cold, run_child  # noqa: E402

RSS_GOAL = 512 * MIB
TP_GOAL = 1.2  # a tp-N rank's time over the time to read its own bytes at load_file's rate

CHILD = r"""
import glob, json, os, sys, time
kind, src, device, tp, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
import torch
import reshard
from safetensors.torch import load_file
if device.startswith("cuda"):
    torch.zeros(1, device=device)
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak so far (imports, CUDA start) is not the loader's
except OSError:
    pass
base = status("VmRSS:")
t0 = time.perf_counter()
if kind == "load_file":
    held = {}
    for path in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        loaded = load_file(path, device=device)
        held.update(loaded if device != "cpu" else {k: v.clone() for k, v in loaded.items()})  # see the docstring
        del loaded
else:
    held = reshard.load_rank(src, "vllm", tp=tp, rank=0, device=device)
if device.startswith("cuda"):
    torch.cuda.synchronize()
seconds = time.perf_counter() - t0
nbytes = sum(t.numel() * t.element_size() for t in held.values())
with open(out, "w") as f:
    json.dump({"seconds": seconds, "bytes": nbytes, "base_rss": base, "peak_rss": status("VmHWM:")}, f)
"""

EXACT = r"""
import sys, torch, reshard
from reshard.demo import make_demo_checkpoint
from reshard.io import device_load
src = make_demo_checkpoint(sys.argv[1])
device_load.BUFFER_BYTES = 1 << 16  # many blocks per tensor, both staging buffers in turn
cases = [dict(tp=1), dict(tp=2, rank=1), dict(tp=2, rank=0, dtype="bf16"), dict(tp=4, rank=3, dtype="fp16")]
for kw in cases:
    on_cpu, on_gpu = reshard.load_rank(src, "vllm", **kw), reshard.load_rank(src, "vllm", device="cuda", **kw)
    assert list(on_cpu) == list(on_gpu), kw
    for name, t in on_cpu.items():
        g = on_gpu[name]
        assert g.device.type == "cuda" and g.dtype == t.dtype and g.shape == t.shape, (kw, name)
        assert torch.equal(g.cpu().reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), (kw, name)
print(f"{len(cases)} rank views equal")
"""


def _label(kind: str, tp: int) -> str:
    return "load_file" if kind == "load_file" else f"load_rank vllm tp{tp} rank 0"


def measure(src: Path, device: str, tps=(1, 2), *, repeat: int = 1, logs: Path | None = None,
            timeout: float | None = None, cache: str = "data") -> list[dict]:
    """One row for load_file and one per tp in ``tps`` (load_rank of vLLM rank 0), each the median of ``repeat``
    cold runs in fresh children (see the module docstring)."""
    logs = Path(tempfile.mkdtemp(prefix="bench_load_rank-")) if logs is None else logs
    logs.mkdir(parents=True, exist_ok=True)
    env = child_env()
    kinds = [("load_file", 1)] + [("load_rank", tp) for tp in tps]
    runs: dict[tuple[str, int], list[dict]] = {k: [] for k in kinds}
    failed: dict[tuple[str, int], str] = {}
    for rep in range(repeat):
        for kind, tp in kinds:
            name = f"{kind}-tp{tp}-{device.replace(':', '')}-{rep}"
            got = make_cold(cache, src)
            out = logs / f"{name}.json"
            out.unlink(missing_ok=True)
            r = run_child([sys.executable, "-c", CHILD, kind, str(src), device, str(tp), str(out)],
                          logs / f"{name}.log", env, timeout)
            if r["rc"] != 0 or not out.exists():
                failed[(kind, tp)] = f"failed (rc={r['rc']}): {log_tail(logs / f'{name}.log', 300)}"
                continue
            runs[(kind, tp)].append({**r, **json.loads(out.read_text()), "cache": got})
    base = runs[("load_file", 1)]
    ref_s = statistics.median(r["seconds"] for r in base) if base else None
    ref_b = base[0]["bytes"] if base else None
    rows = []
    for kind, tp in kinds:
        row: dict[str, Any] = {"what": _label(kind, tp), "device": device, "tp": tp}
        rs = runs[(kind, tp)]
        if not rs:
            rows.append({**row, "status": failed.get((kind, tp), "not run")})
            continue
        seconds = statistics.median(r["seconds"] for r in rs)
        nbytes = rs[0]["bytes"]
        row.update(status="ok", seconds=seconds, bytes=nbytes, gib_per_s=nbytes / GIB / seconds,
                   wall_s=statistics.median(r["wall_s"] for r in rs),
                   peak_rss_bytes=max(r["peak_rss_bytes"] for r in rs),
                   rss_growth_bytes=max(r["peak_rss"] - r["base_rss"] for r in rs), cache=rs[0]["cache"],
                   runs=[{k: r[k] for k in ("seconds", "wall_s", "peak_rss_bytes", "base_rss", "peak_rss")}
                         for r in rs])
        if ref_s:
            row.update(ratio_to_load_file=seconds / ref_s, ratio_to_own_bytes=seconds / (ref_s * nbytes / ref_b))
        rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    lines = ["| size GiB | what | device | cache | seconds | GiB/s | bytes held | peak RSS | RSS growth | "
             "/ load_file | / own bytes at load_file's rate |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r.get('size', '')} | {r['what']} | {r['device']} | | {r.get('status')} | | | | | | |")
            continue
        ratio = f"{r['ratio_to_load_file']:.2f} x" if "ratio_to_load_file" in r else ""
        own = f"{r['ratio_to_own_bytes']:.2f} x" if "ratio_to_own_bytes" in r else ""
        lines.append(f"| {r.get('size', '')} | {r['what']} | {r['device']} | {r['cache']} | {r['seconds']:.2f} | "
                     f"{r['gib_per_s']:.2f} | {r['bytes'] / GIB:.2f} GiB | {r['peak_rss_bytes'] / MIB:.0f} MiB | "
                     f"{r['rss_growth_bytes'] / MIB:.0f} MiB | {ratio} | {own} |")
    return "\n".join(lines)


CHECKS = ("load_rank to cuda == to cpu (bit for bit)", "load_file 8 GiB to cuda", "load_rank vllm tp1 to cuda",
          "load_rank vllm tp2 rank 0 to cuda")


def _cuda_available() -> bool:
    code = "import torch; print(torch.cuda.is_available())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env())
    return proc.stdout.strip() == "True"


def rows(workdir: Path, size_gib: float = 8.0) -> list[dict]:
    """The GPU device check: ``{"check", "result", "ok", "seconds"}`` rows (see :data:`CHECKS`); ok for load_rank
    at tp 1: no slower than load_file and RSS growth <= 512 MiB; at tp 2: within 1.2x of its own bytes' time and
    the same RSS bound. Without CUDA every row is ``skipped: no CUDA``."""
    if not _cuda_available():
        return [{"check": c, "result": "skipped: no CUDA", "ok": True, "seconds": 0.0} for c in CHECKS]
    workdir.mkdir(parents=True, exist_ok=True)
    out = []
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", EXACT, str(workdir / "demo")], capture_output=True, text=True,
                          env=child_env(), timeout=600)
    out.append({"check": CHECKS[0], "ok": proc.returncode == 0, "seconds": time.perf_counter() - t0,
                "result": proc.stdout.strip() if proc.returncode == 0 else f"failed: {proc.stderr[-400:]}"})
    src, _, _ = ensure_source(workdir / "sources", size_gib, 2 * GIB, lambda m: print(m, file=sys.stderr), "llama")
    measured = measure(src, "cuda", (1, 2), logs=workdir / "logs", timeout=600)
    for check, row in zip(CHECKS[1:], measured):
        if row["status"] != "ok":
            out.append({"check": check, "result": row["status"], "ok": False, "seconds": 0.0})
            continue
        result = (f"{row['seconds']:.2f} s, {row['gib_per_s']:.2f} GiB/s, {row['bytes'] / GIB:.2f} GiB, peak RSS "
                  f"{row['peak_rss_bytes'] / MIB:.0f} MiB (+{row['rss_growth_bytes'] / MIB:.0f} MiB loading)")
        ok = True
        if row["what"] != "load_file":
            ratio = row.get("ratio_to_own_bytes" if row["tp"] > 1 else "ratio_to_load_file")
            goal = TP_GOAL if row["tp"] > 1 else 1.0
            what = "own bytes at load_file's rate" if row["tp"] > 1 else "load_file"
            result += f", {ratio:.2f}x {what} (goal <= {goal}x)" if ratio is not None else ", no load_file time"
            ok = ratio is not None and ratio <= goal and row["rss_growth_bytes"] <= RSS_GOAL
        out.append({"check": check, "result": result, "ok": ok, "seconds": row["seconds"]})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=float, default=1.0, help="model size in GiB (default: 1)")
    ap.add_argument("--device", default="cpu", help="where load_rank and load_file put the tensors (default: cpu)")
    ap.add_argument("--tps", type=int, nargs="+", default=[1, 2], help="tensor-parallel degrees (default: 1 2)")
    ap.add_argument("--repeat", type=int, default=1, help="cold runs per row; the median is reported (default: 1)")
    ap.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory (default: bench-out)")
    ap.add_argument("--cache-dir", type=Path, default=None, help="generated sources (default: OUT/sources)")
    ap.add_argument("--cache", choices=["data", "all", "warm"], default="data", help="page cache before each run")
    ap.add_argument("--timeout", type=float, default=None, help="kill a run after this many seconds")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cache_dir = (args.cache_dir or out / "sources").resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    src, _, _ = ensure_source(cache_dir, args.size, 2 * GIB, lambda m: print(m, file=sys.stderr), "llama")
    measured = measure(src, args.device, tuple(args.tps), repeat=args.repeat, logs=out / "logs", timeout=args.timeout,
                       cache=args.cache)
    result = [{"size": f"{args.size:g}", **row} for row in measured]
    (out / "bench_load_rank.json").write_text(json.dumps({"size_gib": args.size, "rows": result}, indent=1) + "\n")
    table = render(result)
    (out / "bench_load_rank.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
