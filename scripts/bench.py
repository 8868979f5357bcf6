#!/usr/bin/env python
"""Benchmark ``reshard convert`` against ``cp -r`` and a naive load-everything baseline.

For each requested model size (GiB) this script

1. generates (or reuses from its cache) a synthetic Llama-shaped Hugging Face
   checkpoint in bf16: ``config.json``, ``model-0000i-of-0000N.safetensors`` and
   ``model.safetensors.index.json``.  The data are written tensor by tensor with
   a hand-written safetensors header, so generating a large model never holds
   more than a few MiB in memory;
2. times, side by side, ``cp -r SRC DST`` + ``sync`` and each conversion run as a
   child process (``python -m reshard convert ... --overwrite``) + ``sync``,
   dropping the page cache before every run when ``/proc/sys/vm/drop_caches`` is
   writable (otherwise the runs are flagged "warm cache");
3. records wall time, ratio to ``cp``, throughput, and the child's peak RSS
   (``ru_maxrss`` from ``os.wait4``, which covers the child and every descendant
   it reaped, as a max not a sum) relative to the largest tensor;
4. writes ``OUT/bench.json`` (raw runs + summary), ``OUT/bench.md`` (Markdown
   table, also printed) and, with ``--plot``, ``OUT/bench.png``.

Example::

    python scripts/bench.py --sizes 1 2 4 --out bench-out
    python scripts/bench.py --sizes 0.01 --repeat 1 --ops cp naive --out /tmp/b

The bench is split by concern; this file is the entry point (arguments and the loop over sizes,
repeats and operations).  Its siblings in scripts/:

- ``bench_model.py``: the synthetic Llama checkpoint (shapes, safetensors writer, source cache);
- ``bench_inspect.py``: reading checkpoints on disk (headers, sizes, largest tensor);
- ``bench_ops.py``: the operations timed and their command lines, the converter probe;
- ``bench_timing.py``: running one child (page-cache eviction, rusage wrapper, RSS sampling);
- ``bench_report.py``: summary, RSS growth, Markdown table and plot;
- ``bench_live.py``: the ``--live`` rows: ``reshard.live.transfer`` between gloo processes (Megatron -> vLLM,
  disjoint and colocated) next to a naive all-gather-then-slice baseline, seconds and peak RSS per rank;
- ``bench_train.py``: the training-framework sources (a DeepSpeed ZeRO-3 checkpoint and an FSDP2 DCP folder of the
  same Llama, written by deepspeed and torch themselves) of the ``TRAIN_OPS``, which are named with ``--ops``::

    python scripts/bench.py --sizes 1 --repeat 2 --ops cp deepspeed_zero3_to_hf deepspeed_zero3_to_fp32_hf \
        zero_to_fp32 fsdp2_dcp_to_hf fsdp2_dcp_to_bf16_hf dcp_to_torch_save --out bench-out

- ``bench_mxfp4.py``: the gpt-oss MXFP4 source of ``hf_mxfp4_to_bf16_hf`` (generated as released, its bf16 output
  the model's size), named with ``--ops``::

    python scripts/bench.py --sizes 1 --repeat 2 --ops cp hf_mxfp4_to_bf16_hf --out bench-out

- ``bench_maxtext.py``: the MaxText source of ``maxtext_to_hf`` (chunks spanning all layers, as MaxText's converter
  writes them); the MaxText rows (tensorstore) are named with ``--ops``::

    python scripts/bench.py --sizes 1 2 --repeat 2 --ops cp hf_to_maxtext maxtext_to_hf --out bench-out

- ``bench_maxtext_converter.py``: MaxText's own converter (``to_maxtext`` / ``to_huggingface``) on the same model, the
  rows ``maxtext_converter_to_maxtext`` / ``maxtext_converter_to_hf``, run by the MaxText interpreter named in
  ``RESHARD_MAXTEXT_PYTHON`` (without it they fail with a one-line message)::

    RESHARD_MAXTEXT_PYTHON=/work/venvs/maxtext/bin/python python scripts/bench.py --sizes 1 --repeat 1 --ops cp \
        hf_to_maxtext maxtext_to_hf maxtext_converter_to_maxtext maxtext_converter_to_hf --out bench-out
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

# scripts/ is not a package: put this file's folder first on sys.path so that its siblings are found
# however bench.py is started (as a script, or loaded by path with importlib as the tests do).
_HERE = str(Path(__file__).resolve().parent)
if sys.path[:1] != [_HERE]:
    sys.path[:] = [_HERE] + [p for p in sys.path if p != _HERE]

from bench_inspect import dir_bytes, largest_tensor_in_dir, read_safetensors_header  # noqa: E402
from bench_model import (  # noqa: E402,F401 - choose_shapes, param_count, source_plan, tensor_*: used through this module
    GIB,
    MIB,
    MODELS,
    choose_shapes,
    ensure_source,
    expected_megatron_largest,
    param_count,
    source_plan,
    tensor_dtype,
    tensor_specs,
)
from bench_ops import (  # noqa: E402,F401 - REPO_ROOT, SRC_DIR, OPS: re-exported
    CONVERTER_OPS,
    CAST_OPS,
    DEEPSEEK_OPS,
    MXFP4_OPS,
    MAXTEXT_OPS,
    DERIVED_SOURCES,
    MOE_OPS,
    OPS,
    PREPARE_ONLY,
    REFERENCES,
    TRAIN_OPS,
    VLM_OPS,
    WIDE_OPS,
    REPO_ROOT,
    SRC_DIR,
    add_torchrun_op,
    build_cmd,
    child_env,
    compile_bytecode,
    default_reshard,
    parallel_streams,
    probe_converter,
)
from bench_report import flatness, plot, render_markdown, summarize, torchrun_ratios  # noqa: E402
from bench_timing import CACHE_MODES, log_tail, make_cold, run_child  # noqa: E402
from bench_train import TRAIN_SOURCES, ensure_train_source  # noqa: E402

BENCH_VERSION = 1


def fmt_size(size: float) -> str:
    return f"{size:g}"


def rmtree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[1.0, 2.0, 4.0], help="model sizes in GiB (default: 1 2 4)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per (size, operation) (default: 3)")
    ap.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory (default: bench-out)")
    ap.add_argument("--model", choices=MODELS, default="llama",
                    help="the generated source: llama (dense), mixtral (8 experts per layer), wide (1 layer, wide "
                         "MLP), deepseek (DeepSeek-V3: MLA, 16 routed + 1 shared experts, a dense first layer) "
                         "or qwen2_5_vl (Qwen2.5-VL: a Qwen2 language model and its vision tower) (default: llama)")
    ap.add_argument("--ops", nargs="+", choices=list(OPS), default=None, metavar="OP",
                    help="operations to run (default: all for the model; MoE ones only for mixtral and deepseek, "
                         "VLM ones only for qwen2_5_vl; hf_to_fp32_hf and the training-framework ones only when "
                         "named): " + ", ".join(OPS))
    ap.add_argument("--workers", type=int, default=None, help="pass --workers N to reshard convert (only when given)")
    ap.add_argument("--torchrun", type=int, default=None, metavar="N",
                    help="also time each conversion under `torchrun --standalone --nproc-per-node N` (op name "
                         "OP@torchrunN) and report its time over the 1-process run's (--workers defaults to 1)")
    ap.add_argument("--verify", action="store_true", help="also time `reshard verify` of each source against its "
                    "conversion, next to reading both and to that conversion, and `verify --forward --nproc 2` "
                    "with each process's peak RSS (scripts/bench_verify.py)")
    ap.add_argument("--load-rank", action="store_true", help="also time reshard.load_rank of vLLM rank 0 at tp 1 and 2 "
                    "to the CPU next to safetensors' load_file, with peak RSS (scripts/bench_load_rank.py)")
    ap.add_argument("--live", action="store_true", help="also time live resharding between gloo processes "
                    "(reshard.live.transfer and a naive all-gather baseline, peak RSS per rank; scripts/bench_live.py)")
    ap.add_argument("--keep", action="store_true", help="keep the outputs of the last repeat under OUT/outputs")
    ap.add_argument("--plot", action="store_true", help="write OUT/bench.png (needs matplotlib: pip install -e '.[bench]')")
    ap.add_argument("--cache-dir", type=Path, default=None, help="where generated sources are cached (default: OUT/sources)")
    ap.add_argument("--shard-gib", type=float, default=2.0, help="max safetensors shard size in GiB (default: 2)")
    ap.add_argument("--timeout", type=float, default=None, help="kill a run after this many seconds")
    ap.add_argument("--cache", choices=CACHE_MODES, default="data",
                    help="before every run: 'data' (default) flushes and evicts the source checkpoint's files from "
                         "the page cache, 'all' drops the whole page cache (programs and libraries too, needs root), "
                         "'warm' only flushes")
    ap.add_argument("--reshard", default=None, metavar="CMD",
                    help="command that runs the CLI, shell-split (default: the current python -m reshard, "
                         "with this checkout first on PYTHONPATH)")
    args = ap.parse_args(argv)
    args.reshard = shlex.split(args.reshard) if args.reshard else default_reshard()
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if any(not s > 0 for s in args.sizes):
        ap.error("--sizes must be positive")
    args.sizes = list({fmt_size(s): s for s in args.sizes}.values())
    default_ops = args.ops is None
    if args.ops is None:
        if args.model == "mixtral":
            args.ops = [*REFERENCES, *MOE_OPS]
        elif args.model == "wide":
            args.ops = [*REFERENCES, *WIDE_OPS]
        elif args.model == "deepseek":
            args.ops = [*REFERENCES, *DEEPSEEK_OPS]
        elif args.model == "qwen2_5_vl":
            args.ops = [*REFERENCES, *VLM_OPS]
        else:
            args.ops = [op for op in OPS if op not in (*MOE_OPS, *PREPARE_ONLY, *CAST_OPS, *TRAIN_OPS, *VLM_OPS,
                                                       *MAXTEXT_OPS)]
    if default_ops:  # gpt-oss's MXFP4 row: named with --ops only
        args.ops = [op for op in args.ops if op not in MXFP4_OPS]
    args.ops = [op for op in OPS if op in set(args.ops)]  # canonical order: cp, hf_to_megatron_tp8, ...
    if args.model != "llama" and any(op in TRAIN_OPS for op in args.ops):
        ap.error(f"the training-framework ops ({', '.join(TRAIN_OPS)}) train the Llama model only (--model llama)")
    if args.torchrun is not None:
        if args.torchrun < 2:
            ap.error("--torchrun N needs N >= 2 processes")
        if args.workers is None:
            args.workers = 1  # the plain runs are the 1-process reference the torchrun runs are compared with
        args.ops = [name for op in args.ops for name in ([op, add_torchrun_op(op, args.torchrun)]
                                                          if op in CONVERTER_OPS else [op])]
    return args


def keep_output(src: Path, dst: Path) -> None:
    """Move a finished output to ``dst`` (``--keep``), replacing what was there."""
    rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(src), str(dst))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cache_dir = (args.cache_dir or out / "sources").resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    logs = out / "logs"
    rmtree(work)
    work.mkdir()
    env = child_env()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:  # not `import torch`: keep this process small (see WRAPPER_CODE)
        from importlib.metadata import version

        torch_version = version("torch")
    except Exception:  # noqa: BLE001
        torch_version = "n/a"
    result: dict[str, Any] = {
        "bench_version": BENCH_VERSION,
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv if argv is None else ["bench.py", *argv],
        "args": {"sizes": args.sizes, "repeat": args.repeat, "ops": args.ops, "workers": args.workers,
                 "torchrun": args.torchrun, "live": args.live,
                 "keep": args.keep, "shard_gib": args.shard_gib, "timeout": args.timeout},
        "environment": {
            "cpus": os.cpu_count(),
            "mem_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB,
            "python": platform.python_version(),
            "torch": torch_version,
            "platform": platform.platform(),
            "copy_streams": parallel_streams(),
        },
        "cache_mode": args.cache,
        "baselines": {},
        "converter": None,
        "sizes_info": {},
        "train_sources": {},
        "runs": [],
        "summary": [],
    }

    def save() -> None:
        result["summary"] = summarize(result["runs"], result["sizes_info"])
        result["flatness"] = flatness(result["summary"])
        result["torchrun"] = torchrun_ratios(result["summary"])
        tmp = out / "bench.json.tmp"
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, out / "bench.json")

    # Baselines: interpreter + torch import, and the CLI's --help (also tells whether vllm exists).
    need_converter = any(op in CONVERTER_OPS for op in args.ops)
    if "naive" in args.ops:
        r = run_child([sys.executable, "-c", "import torch, safetensors.torch"], logs / "baseline-torch.log", env, 300)
        result["baselines"]["python_import_torch_peak_rss_bytes"] = r["peak_rss_bytes"] if r["rc"] == 0 else None
    if need_converter:
        if args.reshard == default_reshard():
            result["environment"]["reshard_bytecode"] = compile_bytecode()
        conv = probe_converter(env, logs, args.reshard)
        result["converter"] = conv
        if conv["available"]:
            result["baselines"]["reshard_convert_help_peak_rss_bytes"] = conv["help_peak_rss_bytes"]
        else:
            log(f"[bench] `{' '.join(conv['cmd'])}` failed (rc={conv['rc']}); converter ops are skipped")
    conv = result["converter"] or {"available": False, "vllm": False}

    def op_unavailable(op: str) -> str | None:
        if OPS[op][1] is None:
            return None
        if not conv["available"]:
            return f"converter unavailable (convert --help rc={conv.get('rc')})"
        if op.startswith("hf_to_vllm") and not conv["vllm"]:
            return "not available"
        return None

    try:
        for size in args.sizes:
            key = fmt_size(size)
            t0 = time.perf_counter()
            src, plan, generated = ensure_source(cache_dir, size, int(args.shard_gib * GIB), log, args.model)
            headers = [read_safetensors_header(src / s["file"]) for s in plan["shards"]]
            name, info = max(((n, i) for h in headers for n, i in h.items()),
                             key=lambda kv: kv[1]["data_offsets"][1] - kv[1]["data_offsets"][0])
            src_bytes = dir_bytes(src)
            result["sizes_info"][key] = {
                "source_dir": str(src),
                "generated": generated,
                "prepare_s": time.perf_counter() - t0,
                "source_bytes": src_bytes,
                "num_shards": len(plan["shards"]),
                "num_tensors": sum(len(h) for h in headers),
                "shapes": plan["shapes"],
                "largest_tensor": {"name": name, "bytes": info["data_offsets"][1] - info["data_offsets"][0], "shape": info["shape"]},
                "expected_megatron_largest_tensor_bytes": {
                    f"tp{tp}": expected_megatron_largest(plan["shapes"], tp) for tp in (1, 4, 8)
                },
            }
            log(f"[bench] size {key} GiB: {src} ({src_bytes / GIB:.3f} GiB, {'generated' if generated else 'cached'})")

            derived: dict[str, Path] = {}  # source kind -> prepared folder
            derived_error: dict[str, str] = {}
            trained: dict[str, Path] = {}  # training-framework source kind -> its cached folder (kept)
            trained_largest: dict[str, int] = {}  # ... -> bytes of its largest tensor as stored (fp32)
            needed = {OPS[op][0] for op in args.ops if OPS[op][0] != "hf" and not op_unavailable(op)}

            def source_for(op: str) -> tuple[Path | None, str | None]:
                kind = OPS[op][0]
                if kind == "hf":
                    return src, None
                if kind in TRAIN_SOURCES:
                    if kind not in trained and kind not in derived_error:
                        t1 = time.perf_counter()
                        folder, plan_t, err = ensure_train_source(
                            cache_dir, kind, size,
                            lambda cmd, name: run_child(cmd, logs / f"{key}-{name}.log", env, args.timeout), log)
                        if err:
                            derived_error[kind] = err
                        else:
                            trained[kind] = folder
                            trained_largest[kind] = plan_t["largest_tensor"]["bytes"]
                            result["train_sources"].setdefault(key, {})[kind] = {
                                "source_dir": str(folder), "what": TRAIN_SOURCES[kind],
                                "source_bytes": dir_bytes(folder), "prepare_s": time.perf_counter() - t1,
                                "params": plan_t["params"], "fp32_model_bytes": plan_t["fp32_model_bytes"],
                                "largest_tensor": plan_t["largest_tensor"], "world": plan_t["world"]}
                            log(f"[bench]   {kind} source: {folder} ({dir_bytes(folder) / GIB:.3f} GiB)")
                    if kind in trained:
                        return trained[kind], None
                    return None, derived_error[kind]
                producer = DERIVED_SOURCES[kind]
                if kind not in derived and kind not in derived_error and producer not in args.ops:
                    # not produced by a timed run of its producer: prepare it, untimed
                    dst = work / f"{key}-{kind}-source"
                    rmtree(dst)
                    log(f"[bench]   preparing the {kind} source (untimed) ...")
                    r = run_child(build_cmd(producer, src, dst, args.workers, args.reshard),
                                  logs / f"{key}-prepare-{kind}.log", env, args.timeout)
                    if r["rc"] == 0:
                        derived[kind] = dst
                    else:
                        derived_error[kind] = f"no {kind} source ({producer} rc={r['rc']})"
                if kind in derived:
                    return derived[kind], None
                return None, derived_error.get(kind) or f"no {kind} source ({producer} did not succeed)"

            def timed(op: str, rep: int, op_src: Path, src_b: int, paired_with: str | None = None) -> dict[str, Any]:
                """One cold run of ``op`` on ``op_src`` (its output deleted unless kept)."""
                kind = next((k for k, folder in (*derived.items(), *trained.items()) if folder == op_src),
                            "hf")  # copies run on any
                run: dict[str, Any] = {"size": key, "size_gib": size, "op": op, "repeat": rep, "source_kind": kind}
                if kind in trained_largest:
                    run["source_largest_tensor_bytes"] = trained_largest[kind]
                if paired_with:
                    run["paired_with"] = paired_with
                dst = work / f"{key}-{op}"
                rmtree(dst)
                free = shutil.disk_usage(work).free
                if free < src_b * 1.2 + 256 * MIB:
                    run["status"] = f"skipped: low disk ({free / GIB:.1f} GiB free)"
                    return run
                cache = make_cold(args.cache, op_src)
                cmd = build_cmd(op, op_src, dst, args.workers, args.reshard)
                log_path = logs / f"{key}-{op}{'-for-' + paired_with if paired_with else ''}-{rep}.log"
                r = run_child(cmd, log_path, env, args.timeout)
                ok = r["rc"] == 0 and dst.exists() and dir_bytes(dst) > 0
                run.update(r, cmd=cmd, log=str(log_path), source_bytes=src_b, cache=cache)
                if ok:
                    run["status"] = "ok"
                    run["output_bytes"] = dir_bytes(dst)
                    if op not in REFERENCES:
                        run["output_largest_tensor"] = largest_tensor_in_dir(dst)
                else:
                    run["status"] = "timeout" if r["timed_out"] else "failed"
                    run["error_tail"] = log_tail(log_path)
                log(f"[bench]   {key} GiB {op}{' (paired with ' + paired_with + ')' if paired_with else ''} #{rep}: "
                    f"{run['status']} {r['wall_s']:.3f}s (cmd {r['cmd_s']:.3f}s + sync {r['sync_s']:.3f}s), "
                    f"peak RSS {r['peak_rss_bytes'] / MIB:.0f} MiB")
                kinds = [k for k, producer in DERIVED_SOURCES.items() if producer == op]
                if ok and kinds and kinds[0] in needed and kinds[0] not in derived:
                    derived[kinds[0]] = work / f"{key}-{kinds[0]}-source"
                    rmtree(derived[kinds[0]])
                    dst.rename(derived[kinds[0]])
                elif ok and args.keep and rep == args.repeat - 1 and not paired_with:
                    keep_output(dst, out / "outputs" / key / op)
                else:
                    rmtree(dst)
                return run

            # With cp (and pcp, the same bytes in parallel streams) among the ops, every other op is timed next to
            # its own copies of the same source (copies first on even repeats, after it on odd ones): the disk's
            # speed drifts, and a ratio of neighbours cancels it.
            refs = [r for r in REFERENCES if r in args.ops]
            paired = bool(refs) and any(op not in refs for op in args.ops)
            for rep in range(args.repeat):
                for op in args.ops:
                    if paired and op in refs:
                        continue
                    why = op_unavailable(op)
                    op_src, err = (None, why) if why else source_for(op)
                    if err:
                        result["runs"].append({"size": key, "size_gib": size, "op": op, "repeat": rep, "status": err})
                        continue
                    src_b = src_bytes if op_src == src else dir_bytes(op_src)
                    copies_first = rep % 2 == 0
                    ref_runs = {r: timed(r, rep, op_src, src_b, paired_with=op) for r in refs} \
                        if paired and copies_first else {}
                    run = timed(op, rep, op_src, src_b)
                    if paired and not copies_first:
                        ref_runs = {r: timed(r, rep, op_src, src_b, paired_with=op) for r in refs}
                    for ref, ref_run in ref_runs.items():
                        result["runs"].append(ref_run)
                        if ref_run["status"] == "ok" and run["status"] == "ok":
                            run[f"paired_{ref}_s"] = ref_run["wall_s"]
                            run[f"ratio_to_paired_{ref}"] = run["wall_s"] / ref_run["wall_s"]
                    result["runs"].append(run)
                    save()
            if args.verify:
                from bench_verify import measure_pair

                from bench_verify import measure_forward_row

                row = measure_pair(src, args.model, work, logs, args.repeat, args.cache, args.timeout, log)
                result.setdefault("verify", []).append({"size": key, "model": args.model, **row})
                forward = measure_forward_row(src, work, logs, 2, args.timeout)
                result.setdefault("verify_forward", []).append({"size": key, "model": args.model, **forward})
                save()
            if args.load_rank:
                from bench_load_rank import measure as measure_load_rank

                rows = measure_load_rank(src, "cpu", repeat=args.repeat, logs=logs / f"{key}-load-rank",
                                         timeout=args.timeout, cache=args.cache)
                result.setdefault("load_rank", []).extend({"size": key, **row} for row in rows)
                save()
            if args.live:
                from bench_live import measure as measure_live

                result.setdefault("live", []).extend(measure_live(src, key, work / "live", args.repeat,
                                                                  timeout=args.timeout, log=log))
                save()
            for kind, folder in derived.items():
                if args.keep:
                    keep_output(folder, out / "outputs" / key / f"{kind}_source")
                else:
                    rmtree(folder)
            save()
    finally:
        rmtree(work)
        save()

    md = render_markdown(result)
    if result.get("verify"):
        from bench_verify import render as render_verify

        from bench_verify import render_forward

        md += "\n\n## Verify (digest check, cold)\n\n" + render_verify(result["verify"]) + "\n"
        md += "\n## Verify --forward (--nproc 2)\n\n" + render_forward(result["verify_forward"]) + "\n"
    if result.get("load_rank"):
        from bench_load_rank import render as render_load_rank

        md += "\n\n## load_rank (vLLM rank 0, to the CPU, cold)\n\n" + render_load_rank(result["load_rank"]) + "\n"
    if result.get("live"):
        from bench_live import render as render_live

        md += "\n\n## Live resharding (gloo, 127.0.0.1)\n\n" + render_live(result["live"]) + "\n"
    (out / "bench.md").write_text(md)
    print(md)
    if args.plot:
        try:
            plot(result, out / "bench.png")
        except ImportError:
            log("[bench] --plot needs matplotlib, which is not installed: pip install -e '.[bench]' "
                "(bench.json and bench.md were written)")
            return 3
        log(f"[bench] wrote {out / 'bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
