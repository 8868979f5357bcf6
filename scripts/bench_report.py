"""Reporting for scripts/bench.py: the per-(size, operation) summary of the runs, peak-RSS growth
across sizes, the Markdown table (bench.md) and the plot (bench.png)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench_model import GIB, MIB
from bench_ops import OPS, REFERENCES, TRAIN_OPS

#: the peak RSS every conversion must stay under (issue 19: torch import included)
RSS_GOAL = 512 * MIB
#: issue 33: a training-framework checkpoint -> HF within 2 x its largest tensor + this
TRAIN_RSS_SLACK = 512 * MIB


def train_rss_bound(largest_tensor_bytes: int) -> int:
    """Issue 33's bound for a training-framework source: peak RSS <= 2 x largest tensor + 0.5 GiB."""
    return 2 * largest_tensor_bytes + TRAIN_RSS_SLACK


def _deepseek_shapes(s: dict) -> str:
    """The MLA and expert widths of a DeepSeek source, for its line in the report ('' for the others)."""
    if s.get("model") != "deepseek":
        return ""
    return (f"; MLA q LoRA {s['q_lora_rank']}, kv LoRA {s['kv_lora_rank']} + rope {s['qk_rope_head_dim']}; "
            f"{s['experts']} routed + {s['shared_experts']} shared experts (ffn {s['moe_intermediate_size']}), "
            f"{s['first_k_dense_replace']} dense layer")


def summarize(runs: list[dict], sizes_info: dict[str, dict]) -> list[dict]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        if r["op"] in REFERENCES and r.get("source_kind", "hf") != "hf":
            continue  # a copy of a derived source (e.g. Megatron TP8), paired with a run on it: only in that ratio
        groups.setdefault((r["size"], r["op"]), []).append(r)
    cp_median: dict[str, float] = {}
    for (size, op), rs in groups.items():
        ok = [r["wall_s"] for r in rs if r["status"] == "ok"]
        if op == "cp" and ok:
            cp_median[size] = statistics.median(ok)
    summary = []
    for (size, op), rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok"]
        times = [r["wall_s"] for r in ok]
        info = sizes_info[size]
        # a training-framework source's own largest tensor (fp32 as stored), else the generated HF source's
        src_largest = next((r["source_largest_tensor_bytes"] for r in rs if r.get("source_largest_tensor_bytes")),
                           info["largest_tensor"]["bytes"])
        row: dict[str, Any] = {
            "size": size,
            "size_gib": rs[0]["size_gib"],
            "op": op,
            "runs": len(rs),
            "ok_runs": len(ok),
            "status": "ok" if len(ok) == len(rs) else ("failed" if not ok else f"partial ({len(ok)}/{len(rs)} ok)"),
        }
        if not ok:
            first = rs[0]
            row["status"] = first["status"] if first["status"] not in ("failed", "timeout") else f"{first['status']} (rc={first.get('rc')})"
            summary.append(row)
            continue
        median = statistics.median(times)
        src_bytes = ok[0]["source_bytes"]
        peak = max(r["peak_rss_bytes"] for r in ok)
        out_largest = next((r["output_largest_tensor"] for r in reversed(ok) if r.get("output_largest_tensor")), None)
        out_bytes = out_largest["bytes"] if out_largest else None
        pair_ratios = [r["ratio_to_paired_cp"] for r in ok if "ratio_to_paired_cp" in r]
        pcp_ratios = [r["ratio_to_paired_pcp"] for r in ok if "ratio_to_paired_pcp" in r]
        paired_cp = [r["paired_cp_s"] for r in ok if "paired_cp_s" in r]
        paired_pcp = [r["paired_pcp_s"] for r in ok if "paired_pcp_s" in r]
        if op == "cp":
            ratio, ratio_kind = 1.0, "self"
        elif pair_ratios:
            ratio, ratio_kind = statistics.median(pair_ratios), "median of paired runs"
        elif size in cp_median:
            ratio, ratio_kind = median / cp_median[size], "median over median cp"
        else:
            ratio, ratio_kind = None, None
        row.update(
            median_s=median,
            min_s=min(times),
            max_s=max(times),
            ratio_to_cp=ratio,
            ratio_kind=ratio_kind,
            ratio_min=min(pair_ratios) if pair_ratios else None,
            ratio_max=max(pair_ratios) if pair_ratios else None,
            paired_cp_median_s=statistics.median(paired_cp) if paired_cp else None,
            # the plain ratio of medians: this op's median over the median of the cp runs paired with it
            ratio_of_medians=median / statistics.median(paired_cp) if paired_cp else None,
            ratio_to_pcp=statistics.median(pcp_ratios) if pcp_ratios else None,
            pcp_ratio_of_medians=median / statistics.median(paired_pcp) if paired_pcp else None,
            source_bytes=src_bytes,
            gib_per_s=src_bytes / GIB / median if median > 0 else None,
            peak_rss_bytes=peak,
            peak_rss_mib=peak / MIB,
            tree_peak_rss_bytes_sampled=max(r["tree_peak_rss_bytes_sampled"] for r in ok),
            tree_peak_anon_bytes_sampled=max(r["tree_peak_anon_bytes_sampled"] for r in ok),
            largest_source_tensor_bytes=src_largest,
            largest_output_tensor_bytes=out_bytes,
            largest_output_tensor=out_largest,
            rss_per_largest_tensor=peak / src_largest,
            rss_bound_bytes=RSS_GOAL,
            within_rss_bound=peak <= RSS_GOAL,
            rss_per_largest_output_tensor=(peak / out_bytes) if out_bytes else None,
            output_bytes=ok[-1].get("output_bytes"),
            source_kind=ok[0].get("source_kind", "hf"),
        )
        if op in TRAIN_OPS:
            row.update(train_rss_bound_bytes=train_rss_bound(src_largest),
                       within_train_rss_bound=peak <= train_rss_bound(src_largest))
        summary.append(row)
    return summary


def flatness(summary: list[dict]) -> list[dict]:
    """Per operation: peak RSS at the largest size over the smallest (flat = within 10%)."""
    by_op: dict[str, list[dict]] = {}
    for row in summary:
        if row.get("ok_runs"):
            by_op.setdefault(row["op"], []).append(row)
    out = []
    for op in OPS:
        rows = sorted(by_op.get(op, []), key=lambda r: r["size_gib"])
        if len(rows) < 2:
            continue
        growth = rows[-1]["peak_rss_bytes"] / rows[0]["peak_rss_bytes"]
        tensor_growth = rows[-1]["largest_source_tensor_bytes"] / rows[0]["largest_source_tensor_bytes"]
        out.append({"op": op, "from_gib": rows[0]["size_gib"], "to_gib": rows[-1]["size_gib"],
                    "rss_growth": growth, "largest_tensor_growth": tensor_growth, "flat": growth <= 1.10})
    return out


def _streams(result: dict[str, Any]) -> str:
    return str(result.get("environment", {}).get("copy_streams", "N"))


def torchrun_ratios(summary: list[dict]) -> list[dict]:
    """For each ``OP@torchrunN`` row: its median time over the 1-process ``OP`` median at the same size."""
    from bench_ops import torchrun_base

    plain = {(r["size"], r["op"]): r for r in summary if r.get("ok_runs")}
    out = []
    for row in summary:
        base = torchrun_base(row["op"])
        if base is None or not row.get("ok_runs") or (row["size"], base[0]) not in plain:
            continue
        one = plain[(row["size"], base[0])]
        out.append({"size": row["size"], "op": base[0], "processes": base[1], "median_s": row["median_s"],
                    "one_process_median_s": one["median_s"], "ratio": row["median_s"] / one["median_s"],
                    "peak_rss_mib": row["peak_rss_mib"]})
    return out


def _out_bound(row: dict) -> str:
    """The output's largest tensor and the bound it would give (a bf16 output's is half the fp32 source's)."""
    out = row.get("largest_output_tensor_bytes") or row["largest_source_tensor_bytes"]
    return f"{out / MIB:.2f} | {train_rss_bound(out) / MIB:.0f} |"


def _fmt_s(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def render_markdown(result: dict[str, Any]) -> str:
    lines = ["# reshard benchmark", ""]
    env = result["environment"]
    cache_text = {
        "data": "the source checkpoint's files flushed and evicted from the page cache before every run "
                "(read cold; programs and libraries stay cached)",
        "all": "the whole page cache dropped before every run (checkpoint, programs and libraries read cold)",
        "warm": "warm (flushed, nothing evicted)",
    }[result["cache_mode"]]
    lines.append(
        f"- {env['cpus']} CPUs, {env['mem_gib']:.1f} GiB RAM, Python {env['python']}, torch {env['torch']}; "
        f"page cache: **{result['cache_mode']}**: {cache_text}"
    )
    if env.get("reshard_bytecode"):
        lines.append(f"- reshard's bytecode: {env['reshard_bytecode']}")
    caches = sorted({r.get("cache") for r in result["runs"] if r.get("cache")} - {result["cache_mode"]})
    if caches:
        lines.append(f"- **some runs fell back to cache mode {', '.join(caches)}** (see bench.json)")
    lines.append(
        f"- repeat={result['args']['repeat']}, workers={result['args']['workers'] if result['args']['workers'] is not None else 'converter default'}; "
        "times include a final `sync`. × cp is the median over repeats of (run time / time of a `cp -r` + `sync` of "
        "the same source run right next to it), with min–max: the disk's speed drifts between runs, a ratio of "
        "neighbours cancels the drift; × cp, medians is the plain ratio of medians (this op's median over the "
        "median of its paired cp runs); × pcp is the median paired ratio to `pcp`, the same bytes copied by "
        f"{_streams(result)} parallel streams (the disk's copy limit rather than one cp process's)"
    )
    b = result.get("baselines", {})
    if b:
        parts = [f"{k.replace('_peak_rss_bytes', '')} {v / MIB:.0f} MiB" for k, v in b.items() if v]
        if parts:
            lines.append("- baseline peak RSS (no data): " + ", ".join(parts))
    for size, info in sorted(result["sizes_info"].items(), key=lambda kv: float(kv[0])):
        s = info["shapes"]
        lt = info["largest_tensor"]
        lines.append(
            f"- {size} GiB source: {info['source_bytes'] / GIB:.3f} GiB in {info['num_shards']} shards; hidden {s['hidden_size']}, "
            f"ffn {s['intermediate_size']}, {s['num_hidden_layers']} layers, {s['num_attention_heads']}/{s['num_key_value_heads']} heads "
            f"(dim {s['head_dim']}), vocab {s['vocab_size']}{_deepseek_shapes(s)}; largest tensor `{lt['name']}` "
            f"{lt['bytes'] / MIB:.2f} MiB"
        )
    for size, kinds in sorted(result.get("train_sources", {}).items(), key=lambda kv: float(kv[0])):
        for kind, t in kinds.items():
            lt = t["largest_tensor"]
            lines.append(
                f"- {size} GiB {kind} source: {t['what']}; {t['source_bytes'] / GIB:.3f} GiB on disk, "
                f"{t['params'] / 1e6:.1f} M parameters ({t['fp32_model_bytes'] / GIB:.3f} GiB in fp32); largest "
                f"tensor `{lt['name']}` {lt['bytes'] / MIB:.2f} MiB (fp32)")
    lines += [
        "",
        "| size GiB | operation | median s | min–max s | × cp (min–max) | × cp, medians | × pcp | GiB/s | out / in | "
        "peak RSS MiB | RSS / largest tensor | ≤ 512 MiB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for row in sorted(result["summary"], key=lambda r: (r["size_gib"], list(OPS).index(r["op"]))):
        size = row["size"]
        if row["ok_runs"] == 0:
            lines.append(f"| {size} | {row['op']} | {row['status']} | | | | | | | | | |")
            continue
        ratio = f"{row['ratio_to_cp']:.2f}" if row["ratio_to_cp"] is not None else "n/a"
        if row.get("ratio_min") is not None and row["ratio_max"] != row["ratio_min"]:
            ratio += f" ({row['ratio_min']:.2f}–{row['ratio_max']:.2f})"
        per = f"{row['rss_per_largest_tensor']:.2f}"
        out_b = row["largest_output_tensor_bytes"]
        if out_b and out_b != row["largest_source_tensor_bytes"]:
            per += f" (out {out_b / MIB:.2f} MiB: {row['rss_per_largest_output_tensor']:.2f})"
        op = row["op"] if row["status"] == "ok" else f"{row['op']} ({row['status']})"
        medians = f"{row['ratio_of_medians']:.2f}" if row.get("ratio_of_medians") is not None else ""
        pcp = f"{row['ratio_to_pcp']:.2f}" if row.get("ratio_to_pcp") is not None else ""
        written_bytes, read_bytes = row.get("output_bytes"), row["source_bytes"]
        written = f"{written_bytes / read_bytes:.2f}" if written_bytes and read_bytes else ""
        lines.append(
            f"| {size} | {op} | {_fmt_s(row['median_s'])} | {_fmt_s(row['min_s'])}–{_fmt_s(row['max_s'])} | {ratio} | "
            f"{medians} | {pcp} | {row['gib_per_s']:.3g} | {written} | {row['peak_rss_mib']:.0f} | {per} | "
            f"{'yes' if row['within_rss_bound'] else 'NO'} |"
        )
    train_rows = [r for r in result["summary"] if r["op"] in TRAIN_OPS]
    if train_rows:
        lines += ["", "Training-framework sources against issue 33's bound, peak RSS <= 2 x largest tensor (as "
                  "stored: fp32) + 0.5 GiB (the last two columns: the same rule with the output's largest tensor, "
                  "stricter for a bf16 output); × cp is against a `cp -r` of the whole source folder (the ZeRO-3 one "
                  "holds the Adam moments too):", "",
                  "| size GiB | operation | source | median s | × cp | peak RSS MiB | largest tensor MiB | "
                  "RSS / largest tensor | bound MiB | within bound | output's largest MiB | its bound MiB |",
                  "|---:|---|---|---:|---:|---:|---:|---:|---:|:---:|---:|---:|"]
        for row in sorted(train_rows, key=lambda r: (r["size_gib"], list(OPS).index(r["op"]))):
            if row["ok_runs"] == 0:
                lines.append(f"| {row['size']} | {row['op']} | {OPS[row['op']][0]} | {row['status']} | | | | | | | | |")
                continue
            ratio = f"{row['ratio_to_cp']:.2f}" if row["ratio_to_cp"] is not None else "n/a"
            lines.append(
                f"| {row['size']} | {row['op']} | {row['source_kind']} | {_fmt_s(row['median_s'])} | {ratio} | "
                f"{row['peak_rss_mib']:.0f} | {row['largest_source_tensor_bytes'] / MIB:.2f} | "
                f"{row['rss_per_largest_tensor']:.2f} | {row['train_rss_bound_bytes'] / MIB:.0f} | "
                f"{'yes' if row['within_train_rss_bound'] else 'NO'} | {_out_bound(row)}")
    flat = flatness(result["summary"])
    if flat:
        lines += ["", "Peak RSS growth from the smallest to the largest size (flat = within 10%):", ""]
        lines += [f"- {f['op']}: {f['from_gib']:g} -> {f['to_gib']:g} GiB: x{f['rss_growth']:.2f} "
                  f"({'flat' if f['flat'] else 'grows'}; largest tensor x{f['largest_tensor_growth']:.2f})"
                  for f in flat]
    spread = torchrun_ratios(result["summary"])
    if spread:
        lines += ["", "torchrun on this machine (`--standalone`, N processes, the filesystem as the data path) over "
                  "the same conversion in 1 process (`--workers 1`), ratio of medians (< 1: faster):", ""]
        lines += [f"- {t['size']} GiB {t['op']}: {t['processes']} processes {_fmt_s(t['median_s'])} s / 1 process "
                  f"{_fmt_s(t['one_process_median_s'])} s = x{t['ratio']:.2f}" for t in spread]
    lines += [
        "",
        "Peak RSS is `ru_maxrss` of the child from `os.wait4` (the max over the child and the descendants it "
        "reaped, not a sum; it includes file-backed pages such as mmapped safetensors) taken over all repeats. "
        "RSS / largest tensor divides it by the largest source tensor; `(out …)` gives the largest tensor found in the "
        "output when it differs. GiB/s is source bytes (the Megatron TP8 checkpoint for `megatron_tp8_*`) / median time; out / in is bytes "
        "written over bytes read (TensorRT-LLM's default layout repeats the embedding on every rank). "
        "bench.json also has sampled whole-process-tree RSS and anonymous RSS.",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    by_op: dict[str, list[dict]] = {}
    for row in result["summary"]:
        if row["ok_runs"]:
            by_op.setdefault(row["op"], []).append(row)
    for op in OPS:
        rows = sorted(by_op.get(op, []), key=lambda r: r["size_gib"])
        if not rows:
            continue
        xs = [r["size_gib"] for r in rows]
        ax_t.plot(xs, [r["median_s"] for r in rows], marker="o", label=op)
        ax_m.plot(xs, [r["peak_rss_mib"] for r in rows], marker="o", label=op)
    ax_t.set(xlabel="model size (GiB)", ylabel="median wall time incl. sync (s)", title="time")
    ax_m.set(xlabel="model size (GiB)", ylabel="peak RSS (MiB)", title="peak RSS")
    for ax in (ax_t, ax_m):
        ax.grid(True, alpha=0.3)
    ax_m.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
