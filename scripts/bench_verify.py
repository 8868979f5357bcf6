"""The verify rows of scripts/bench.py: ``reshard verify A B`` timed next to reading both checkpoints and next to
the conversion that made B, each run cold (both folders evicted from the page cache first).

For each pair (A = the generated HF checkpoint, B = its conversion) and repeat:

1. ``read``: every file of A and of B read once (``cat`` of each file into /dev/null, one process);
2. ``verify``: ``python -m reshard verify A B`` (the digest check, at its automatic process count, which the row
   shows), its peak RSS (``ru_maxrss`` from ``os.wait4`` through the bench's rusage wrapper: the largest of its
   processes);
3. ``convert``: ``python -m reshard convert A OUT`` with B's arguments, its output deleted;
4. ``plan``: ``python -m reshard verify A B --dry-run``: the start-up a verify pays before its first block
   (interpreter, imports, both checkpoints' indexes, the plan), which no read of the files pays.

The row gives the medians, verify / read and verify / convert, and verify's peak RSS against the 512 MiB goal
and the largest tensor. Run on its own::

    python scripts/bench_verify.py --sizes 1 2 4 --out bench-out [--forward 2]

``--forward N`` adds a row per size: ``reshard verify --forward`` of the source against its Megatron TPN
conversion at ``--nproc N``, with every process's peak RSS (goal: each at most 1.5 GiB).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

_HERE = str(Path(__file__).resolve().parent)
if sys.path[:1] != [_HERE]:
    sys.path[:] = [_HERE] + [p for p in sys.path if p != _HERE]

from bench_inspect import dir_bytes, largest_tensor_in_dir  # noqa: E402
from bench_model import GIB, MIB, ensure_source  # noqa: E402
from bench_ops import OPS, child_env, compile_bytecode, default_reshard  # noqa: E402
from bench_timing import make_cold, run_child  # noqa: E402

#: (name of the pair, the conversion op whose output is B)
PAIRS = {"llama": ("hf_vs_megatron_tp8", "hf_to_megatron_tp8"), "wide": ("hf_vs_megatron_tp8", "hf_to_megatron_tp8"),
         "mixtral": ("hf_vs_megatron_tp2_ep4", "hf_to_megatron_tp2_ep4")}
RSS_GOAL = 512 * MIB
READ_CODE = ("import os, sys\nbuf = bytearray(8 << 20)\nfor root in sys.argv[1:]:\n    for d, _, names in os.walk(root):\n"
             "        for n in sorted(names):\n            with open(os.path.join(d, n), 'rb', buffering=0) as f:\n"
             "                while f.readinto(buf):\n                    pass\n")


def _cold(cache: str, *folders: Path) -> str:
    got = [make_cold(cache, f) for f in folders]
    return got[0] if len(set(got)) == 1 else "mixed"


def measure_pair(src: Path, model: str, work: Path, logs: Path, repeat: int, cache: str, timeout: float | None,
                 log=print) -> dict[str, Any]:
    """Time read / verify / convert for ``src`` and its conversion; returns the row (with every run)."""
    env = child_env()
    pair, op = PAIRS[model]
    reshard = default_reshard()
    converted = work / f"{pair}-b"
    shutil.rmtree(converted, ignore_errors=True)
    made = run_child([*reshard, "convert", str(src), str(converted), *OPS[op][1], "--overwrite"],
                     logs / f"{pair}-prepare.log", env, timeout)
    if made["rc"] != 0:
        return {"pair": pair, "status": f"preparing B failed (rc={made['rc']})"}
    runs: dict[str, list[dict]] = {"read": [], "verify": [], "convert": [], "plan": []}
    for rep in range(repeat):
        for kind in ("read", "verify", "convert", "plan"):
            out = work / f"{pair}-convert-out"
            if kind == "read":
                cmd = [sys.executable, "-c", READ_CODE, str(src), str(converted)]
            elif kind == "verify":
                cmd = [*reshard, "verify", str(src), str(converted)]
            elif kind == "plan":
                cmd = [*reshard, "verify", str(src), str(converted), "--dry-run"]
            else:
                cmd = [*reshard, "convert", str(src), str(out), *OPS[op][1], "--overwrite"]
            cache_got = _cold(cache, src, converted)
            r = run_child(cmd, logs / f"{pair}-{kind}-{rep}.log", env, timeout)
            shutil.rmtree(out, ignore_errors=True)
            r.update(cache=cache_got, cmd=cmd)
            if kind == "verify":
                r["workers"] = verify_workers(logs / f"{pair}-{kind}-{rep}.log")
            runs[kind].append(r)
            log(f"[bench] {pair} {kind} #{rep}: rc={r['rc']} {r['wall_s']:.2f}s peak RSS "
                f"{r['peak_rss_bytes'] / MIB:.0f} MiB")
    row = {"pair": pair, "source_bytes": dir_bytes(src), "b_bytes": dir_bytes(converted),
           "largest_tensor_bytes": largest_tensor_in_dir(src)["bytes"], "runs": runs}
    shutil.rmtree(converted, ignore_errors=True)
    if any(r["rc"] != 0 for rs in runs.values() for r in rs):
        row["status"] = "failed"
        return row
    med = {k: statistics.median(r["wall_s"] for r in rs) for k, rs in runs.items()}
    peak = max(r["peak_rss_bytes"] for r in runs["verify"])
    row.update(status="ok", verify_workers=runs["verify"][0].get("workers"), plan_s=med["plan"], verify_s=med["verify"], read_s=med["read"], convert_s=med["convert"],
               verify_per_read=med["verify"] / med["read"], verify_per_convert=med["verify"] / med["convert"],
               verify_peak_rss_bytes=peak, within_rss_goal=peak <= RSS_GOAL,
               rss_per_largest_tensor=peak / row["largest_tensor_bytes"],
               convert_peak_rss_bytes=max(r["peak_rss_bytes"] for r in runs["convert"]))
    return row


def verify_workers(log: Path) -> str | None:
    """The process count a verify run reports (``compared by N processes chosen for ...``), from its log."""
    for line in log.read_text(errors="replace").splitlines():
        if line.strip().startswith("compared by "):
            return line.strip().removeprefix("compared by ")
    return None


def measure_forward_row(src: Path, work: Path, logs: Path, nproc: int = 2, timeout: float | None = None) -> dict:
    """``reshard verify --forward SRC MEG --nproc N`` against SRC's Megatron TPN conversion: wall time and each
    process's peak RSS (VmHWM sampled from outside, :func:`bench_forward.measure_forward`)."""
    from bench_forward import measure_forward

    meg = work / f"forward-meg-tp{nproc}"
    shutil.rmtree(meg, ignore_errors=True)
    made = run_child([*default_reshard(), "convert", str(src), str(meg), "--to", "megatron", "--tp", str(nproc)],
                     logs / f"forward-prepare-tp{nproc}.log", child_env(), timeout)
    if made["rc"] != 0:
        return {"status": f"preparing B failed (rc={made['rc']})", "nproc": nproc}
    try:
        row = measure_forward(src, meg, nproc)
    finally:
        shutil.rmtree(meg, ignore_errors=True)
    peaks = [p["peak_rss_bytes"] for p in row["processes"]]
    row.update(status="ok" if row["rc"] == 0 and row["ok"] else "failed", nproc=nproc,
               max_process_peak_rss_bytes=max(peaks, default=0), within_goal=max(peaks, default=0) <= 1536 * MIB)
    return row


def render_forward(rows: list[dict]) -> str:
    lines = ["| size | model | nproc | wall s | verdict | peak RSS of each process | max <= 1.5 GiB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        peaks = ", ".join(f"{p['role']} {p['peak_rss_mib']:.0f} MiB" for p in r.get("processes", []))
        lines.append(f"| {r['size']} GiB | {r['model']} | {r['nproc']} | {r.get('wall_s', '')} | {r['status']} | "
                     f"{peaks} | {'yes' if r.get('within_goal') else 'no'} |")
    return "\n".join(lines)


def render(rows: list[dict]) -> str:
    lines = ["| size | model | pair | verify s | read A+B s | verify / read | convert s | verify / convert | "
             "verify peak RSS | / largest tensor | verify processes | start-up s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r.get('size')} | {r.get('model')} | {r['pair']} | {r.get('status')} | | | | | | | | |")
            continue
        lines.append(f"| {r['size']} GiB | {r['model']} | {r['pair']} | {r['verify_s']:.2f} | {r['read_s']:.2f} | "
                     f"{r['verify_per_read']:.2f} x | {r['convert_s']:.2f} | {r['verify_per_convert']:.2f} x | "
                     f"{r['verify_peak_rss_bytes'] / MIB:.0f} MiB | {r['rss_per_largest_tensor']:.2f} x | "
                     f"{r.get('verify_workers') or '?'} | {r.get('plan_s', 0):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    ap.add_argument("--models", nargs="+", default=["llama", "wide"], choices=sorted(PAIRS))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--cache", default="data", choices=["data", "all", "warm"])
    ap.add_argument("--timeout", type=float, default=None)
    ap.add_argument("--forward", type=int, default=0, metavar="N",
                    help="also run verify --forward at --nproc N against a Megatron TPN conversion")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    work, logs = out / "verify-work", out / "logs"
    work.mkdir(parents=True, exist_ok=True)
    cache_dir = (args.cache_dir or out / "sources").resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    compile_bytecode()
    rows, forward_rows = [], []
    try:
        for model in args.models:
            for size in args.sizes:
                src, _, _ = ensure_source(cache_dir, size, 2 * GIB, lambda m: print(m, file=sys.stderr), model)
                row = measure_pair(src, model, work, logs, args.repeat, args.cache, args.timeout,
                                   lambda m: print(m, file=sys.stderr))
                rows.append({"size": f"{size:g}", "model": model, **row})
                if args.forward:
                    forward = measure_forward_row(src, work, logs, args.forward, args.timeout)
                    forward_rows.append({"size": f"{size:g}", "model": model, **forward})
                (out / "bench_verify.json").write_text(json.dumps({"digest": rows, "forward": forward_rows},
                                                                   indent=1) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = render(rows) + ("\n\n" + render_forward(forward_rows) if forward_rows else "")
    (out / "bench_verify.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
