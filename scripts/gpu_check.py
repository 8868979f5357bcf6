#!/usr/bin/env python
"""The device check: what reshard does on a GPU node, in one table, in a few minutes.

Run from a checkout on the node (reshard importable, or run from the repository root)::

    python scripts/gpu_check.py --out gpu-check            # 8 GiB bench rows
    python scripts/gpu_check.py --out gpu-check --size 1   # quicker

Rows, in order (each also on stdout as it finishes, the table at the end, ``OUT/gpu_check.json`` and
``OUT/gpu_check.md`` rewritten after every section so an interrupted run keeps what it measured):

- ``demo``: ``reshard demo`` exits 0 (its forward step on gloo, whatever the GPUs);
- ``forward``: ``verify --forward`` of a tp2 checkpoint with the automatic backend (NCCL where every process gets
  a GPU, else gloo with a note), ``--backend nccl`` at tp2 (refused in one line, exit 2, on one GPU; equal on two
  or more), ``--backend nccl`` at tp1 (equal), then a ~1 GiB model on NCCL with the host memory of the rank
  (scripts/gpu_check_forward.py);
- ``live``: ``live.transfer`` into CUDA tensors over NCCL and gloo, and the refusal of two ranks on one GPU
  (scripts/gpu_check_live.py);
- ``load_rank``: ``load_rank(..., device="cuda")`` at tp1 and a tp2 rank against safetensors' ``load_file``
  (scripts/bench_load_rank.py);
- ``bench``: at ``--size`` GiB, cold where the page cache can be dropped, with the automatic ``--workers``:
  digest verify against reading both checkpoints, and hf -> megatron tp8, megatron tp8 -> hf against ``cp``.

Nothing here needs a GPU to run: on a CPU-only machine the CUDA rows say "skipped: no CUDA".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]


def row(check: str, ok: bool, result: str, seconds: float) -> dict:
    return {"check": check, "ok": bool(ok), "result": result, "seconds": round(seconds, 2)}


def reshard_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "reshard", *map(str, args)]


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_HERE.parent)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run(cmd: list[str], timeout: float = 300) -> tuple[int, str, str, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - t0


def gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def demo_rows(work: Path) -> list[dict]:
    code, out, err, took = run(reshard_cmd("demo", "--workdir", work / "demo"))
    line = next((x for x in out.splitlines() if x.startswith("forward check:")), err.strip()[-200:])
    rows = [row("demo (forward step on gloo by default)", code == 0 and "demo passed" in out,
                f"exit {code}; {line}", took)]
    shutil.rmtree(work / "demo", ignore_errors=True)
    return rows


def forward_rows(work: Path) -> list[dict]:
    """The backend choice on this node's GPU count, on the demo model."""
    from reshard import convert
    from reshard.demo import make_demo_checkpoint

    n = gpus()
    src = make_demo_checkpoint(str(work / "fw-hf"))
    tp2, tp1 = str(work / "fw-tp2"), str(work / "fw-tp1")
    convert(src, tp2, to="megatron", tp=2)
    convert(src, tp1, to="megatron", tp=1)
    rows = []
    code, out, err, took = run(reshard_cmd("verify", "--forward", src, tp2))
    backend = "nccl" if n >= 2 else "gloo"
    note = [x.strip() for x in out.splitlines() if "note: backend" in x]
    rows.append(row(f"verify --forward tp2, automatic backend ({n} GPU{'s' if n != 1 else ''})",
                    code == 0 and f", {backend}, " in out and (n >= 2 or n == 0 or bool(note)),
                    f"exit {code}, {backend}" + (f"; {note[0]}" if note else "") + (f"; {err.strip()}" if code else ""),
                    took))
    code, out, err, took = run(reshard_cmd("verify", "--forward", src, tp2, "--backend", "nccl"))
    if n >= 2:
        rows.append(row("verify --forward tp2 --backend nccl", code == 0 and "FORWARD EQUAL" in out,
                        f"exit {code}", took))
    else:
        lines = err.strip().splitlines()
        rows.append(row("verify --forward tp2 --backend nccl (refused: too few GPUs)",
                        code == 2 and len(lines) == 1 and f"{n} GPU" in err, f"exit {code}: {err.strip()}", took))
    if n >= 1:
        code, out, err, took = run(reshard_cmd("verify", "--forward", src, tp1, "--backend", "nccl"))
        rows.append(row("verify --forward tp1 --backend nccl", code == 0 and "FORWARD EQUAL" in out,
                        f"exit {code}" + (f": {err.strip()[-300:]}" if code else ""), took))
    for name in ("fw-hf", "fw-tp2", "fw-tp1"):
        shutil.rmtree(work / name, ignore_errors=True)
    return rows


def helper_rows(module: str, work: Path, **kwargs) -> list[dict]:
    """``rows(work, **kwargs)`` of a sibling script (scripts/gpu_check_live.py, ...)."""
    import importlib

    return importlib.import_module(module).rows(work, **kwargs)


def bench_rows(work: Path, size: float, cache: Path) -> list[dict]:
    """Digest verify against reading both, and conversions against cp, at ``size`` GiB, automatic workers."""
    rows = []
    out = work / "bench"
    t0 = time.perf_counter()
    cmd = [sys.executable, str(_HERE / "bench_verify.py"), "--sizes", f"{size:g}", "--models", "llama",
           "--repeat", "1", "--out", str(out / "verify"), "--cache-dir", str(cache)]
    code, stdout, err, took = run(cmd, timeout=900)
    data = json.loads((out / "verify" / "bench_verify.json").read_text()) if code == 0 else {"digest": []}
    for r in data["digest"]:
        if r.get("status") != "ok":
            rows.append(row(f"bench verify {size:g} GiB", False, str(r.get("status")), took))
            continue
        rows.append(row(f"bench verify {size:g} GiB (hf vs megatron tp8)",
                        r["verify_per_read"] <= 1.2 and r["within_rss_goal"],
                        f"{r['verify_s']:.2f} s = {r['verify_per_read']:.2f}x reading both ({r['read_s']:.2f} s), "
                        f"of which start-up {r['plan_s']:.2f} s; "
                        f"peak RSS {r['verify_peak_rss_bytes'] / 2**20:.0f} MiB; {r.get('verify_workers')}; "
                        f"cache {r['runs']['verify'][0].get('cache')}", took))
    if code != 0:
        rows.append(row(f"bench verify {size:g} GiB", False, f"exit {code}: {err.strip()[-300:]}", took))
    cmd = [sys.executable, str(_HERE / "bench.py"), "--sizes", f"{size:g}", "--repeat", "1", "--ops", "cp",
           "hf_to_megatron_tp8", "megatron_tp8_to_hf", "--out", str(out / "convert"), "--cache-dir", str(cache)]
    code, stdout, err, took = run(cmd, timeout=900)
    if code != 0:
        return rows + [row(f"bench convert {size:g} GiB", False, f"exit {code}: {err.strip()[-300:]}", took)]
    runs = json.loads((out / "convert" / "bench.json").read_text())["runs"]
    cp = [r for r in runs if r["op"] == "cp"]
    for op, goal in (("hf_to_megatron_tp8", 1.15), ("megatron_tp8_to_hf", 1.15)):
        mine = [r for r in runs if r["op"] == op]
        if not (mine and cp):
            rows.append(row(f"bench {op} {size:g} GiB", False, "no run", took))
            continue
        ratio = mine[0]["wall_s"] / cp[0]["wall_s"]
        rows.append(row(f"bench {op} {size:g} GiB (automatic --workers)", ratio <= goal,
                        f"{mine[0]['wall_s']:.2f} s = {ratio:.2f}x cp ({cp[0]['wall_s']:.2f} s); peak RSS "
                        f"{mine[0].get('peak_rss_bytes', 0) / 2**20:.0f} MiB; cache {mine[0].get('cache')}", took))
    print(f"[gpu_check] bench convert started {t0:.0f}", file=sys.stderr)
    return rows


def render(rows: list[dict]) -> str:
    lines = ["| check | ok | seconds | result |", "|---|---|---|---|"]
    for r in rows:
        result = r["result"].replace("|", "\\|")
        lines.append(f"| {r['check']} | {'yes' if r['ok'] else 'NO'} | {r['seconds']:.1f} | {result} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-check"))
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: OUT/work; deleted at the end)")
    ap.add_argument("--size", type=float, default=8.0, help="GiB of the bench rows' model (default 8)")
    ap.add_argument("--only", nargs="+", default=None,
                    choices=["demo", "forward", "forward_memory", "live", "load_rank", "bench"])
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = (args.work or args.out / "work").resolve()
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "sources"
    sections = [("demo", lambda: demo_rows(work)), ("forward", lambda: forward_rows(work)),
                ("forward_memory", lambda: helper_rows("gpu_check_forward", work)),
                ("live", lambda: helper_rows("gpu_check_live", work)),
                ("load_rank", lambda: helper_rows("bench_load_rank", work, size_gib=args.size)),
                ("bench", lambda: bench_rows(work, args.size, cache))]
    import torch

    header = (f"reshard device check: {gpus()} GPU(s) "
              f"({torch.cuda.get_device_name(0) if gpus() else 'none'}), {len(os.sched_getaffinity(0))} cores, "
              f"torch {torch.__version__}")
    print(header, flush=True)
    rows: list[dict] = []
    try:
        for name, section in sections:
            if args.only and name not in args.only:
                continue
            t0 = time.perf_counter()
            try:
                got = section()
            except Exception as exc:  # a section that breaks is a failed row, the others still run
                got = [row(name, False, f"{type(exc).__name__}: {exc}"[:300], time.perf_counter() - t0)]
                traceback.print_exc()
            for r in got:
                print(f"[gpu_check] {'ok ' if r['ok'] else 'NO '} {r['check']}: {r['result']} ({r['seconds']:.1f} s)",
                      flush=True)
            rows += got
            (args.out / "gpu_check.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1) + "\n")
            (args.out / "gpu_check.md").write_text(header + "\n\n" + render(rows) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n" + render(rows))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
