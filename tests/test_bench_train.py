"""The training-framework rows of scripts/bench.py (issue 33): a DeepSpeed ZeRO-3 checkpoint and an FSDP2 DCP folder
made by the frameworks themselves (scripts/bench_train.py), converted by reshard next to ``zero_to_fp32`` and
``dcp_to_torch_save``, each row against the bound peak RSS <= 2 x largest tensor + 0.5 GiB. Like tests/test_bench.py
they never assert timings."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_bench import REPO, SIZE, load_bench, md_rows, run_bench, summary_row

TRAIN_OPS = ["deepspeed_zero3_to_hf", "deepspeed_zero3_to_fp32_hf", "zero_to_fp32", "fsdp2_dcp_to_hf",
             "fsdp2_dcp_to_bf16_hf", "dcp_to_torch_save"]


def bench_train():
    load_bench()  # puts scripts/ first on sys.path
    import bench_train as mod

    return mod


def test_train_ops_are_named_not_default():
    bench = load_bench()
    assert list(bench.TRAIN_OPS) == TRAIN_OPS
    assert not set(TRAIN_OPS) & set(bench.parse_args([]).ops)
    args = bench.parse_args(["--ops", "cp", *TRAIN_OPS])
    assert args.ops == ["cp", *TRAIN_OPS]
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "mixtral", "--ops", "cp", "zero_to_fp32"])


def test_train_commands(tmp_path):
    bench = load_bench()
    src, dst = tmp_path / "src", tmp_path / "dst"
    assert bench.build_cmd("deepspeed_zero3_to_fp32_hf", src, dst, None)[-5:] == [
        str(dst), "--to", "hf", "--master-weights", "--overwrite"]
    assert bench.build_cmd("fsdp2_dcp_to_hf", src, dst, 1)[-6:] == [
        "hf", "--config", str(src / "config.json"), "--overwrite", "--workers", "1"]
    torchrun = bench.add_torchrun_op("fsdp2_dcp_to_hf", 2)
    assert bench.build_cmd(torchrun, src, dst, None)[-3:] == ["--config", str(src / "config.json"), "--overwrite"]
    # DeepSpeed's own converter: the copy in the checkpoint root, safetensors out
    assert bench.build_cmd("zero_to_fp32", src, dst, None)[1:] == [
        str(src / "zero_to_fp32.py"), str(src), str(dst), "--safe_serialization"]
    cmd = bench.build_cmd("dcp_to_torch_save", src, dst, None)
    assert "dcp_to_torch_save" in cmd[2] and cmd[3:] == [str(src / "pytorch_model_fsdp_0"), str(dst)]


def test_train_plan_sizes():
    """At 1 GiB (the bench's bf16 size) the trained model is 2 GiB of fp32 masters, its largest tensor the 250 MiB
    fp32 embedding: the bound is 2 x 250 MiB + 512 MiB."""
    mod = bench_train()
    plan = mod.train_plan("deepspeed_zero3", 1)
    assert plan["fp32_model_bytes"] >= 1 << 30 and plan["fp32_model_bytes"] == 4 * plan["params"]
    assert plan["largest_tensor"]["name"] == "model.embed_tokens.weight"
    assert plan["largest_tensor"]["bytes"] == 32003 * 2048 * 4
    from bench_report import train_rss_bound

    assert train_rss_bound(plan["largest_tensor"]["bytes"]) == 2 * 32003 * 2048 * 4 + (512 << 20)


def test_train_source_cache(tmp_path):
    """A source is made once (by the generator child) and reused while its marker and files match; a missing
    rank file makes it again; a failed generator is an error, nothing cached."""
    mod = bench_train()
    calls = []

    def fake_run(cmd, name):
        calls.append(name)
        out = Path(cmd[3])
        for f in mod.expected_files(cmd[2]):
            (out / f).parent.mkdir(parents=True, exist_ok=True)
            (out / f).write_bytes(b"x")
        return {"rc": 0}

    src, plan, err = mod.ensure_train_source(tmp_path, "deepspeed_zero3", 0.002, fake_run, log=lambda m: None)
    assert err is None and src == tmp_path / "deepspeed_zero3-0.002GiB" and (src / "latest").is_file()
    assert mod.ensure_train_source(tmp_path, "deepspeed_zero3", 0.002, fake_run, log=lambda m: None)[0] == src
    assert calls == ["make-deepspeed_zero3-0.002"]
    (src / "global_step1" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    mod.ensure_train_source(tmp_path, "deepspeed_zero3", 0.002, fake_run, log=lambda m: None)
    assert len(calls) == 2
    folder, _, err = mod.ensure_train_source(tmp_path, "fsdp2_dcp", 0.002, lambda cmd, name: {"rc": 1},
                                             log=lambda m: None)
    assert folder is None and err == "no fsdp2_dcp source (generator rc=1)"
    assert not (tmp_path / "fsdp2_dcp-0.002GiB").exists() and not (tmp_path / "fsdp2_dcp-0.002GiB.tmp").exists()


def test_train_bound_in_report():
    """The summary divides by the training source's own largest tensor (fp32) and checks the issue-33 bound; the
    Markdown has the bound table, with the bound the output's largest tensor gives beside it (bf16: stricter)."""
    bench = load_bench()
    from bench_report import render_markdown, summarize

    mib = 1 << 20
    info = {"0.5": {"largest_tensor": {"name": "e", "bytes": 125 * mib, "shape": [1, 1]}, "shapes": {},
                    "source_bytes": 1, "num_shards": 1}}
    runs = []
    for op, peak in (("deepspeed_zero3_to_hf", 700 * mib), ("zero_to_fp32", 3000 * mib)):
        base = {"size": "0.5", "size_gib": 0.5, "repeat": 0, "status": "ok", "source_kind": "deepspeed_zero3",
                "source_bytes": 6 << 30, "source_largest_tensor_bytes": 250 * mib, "tree_peak_rss_bytes_sampled": 0,
                "tree_peak_anon_bytes_sampled": 0}
        runs.append({**base, "op": "cp", "paired_with": op, "wall_s": 10.0, "peak_rss_bytes": 7 * mib})
        runs.append({**base, "op": op, "wall_s": 5.0, "peak_rss_bytes": peak, "paired_cp_s": 10.0,
                     "ratio_to_paired_cp": 0.5,
                     "output_largest_tensor": {"name": "e", "bytes": (125 if op.endswith("_hf") else 250) * mib}})
    summary = summarize(runs, info)
    rows = {r["op"]: r for r in summary}
    assert set(rows) == {"deepspeed_zero3_to_hf", "zero_to_fp32"}  # the copies of the ZeRO source: in the ratios
    assert rows["deepspeed_zero3_to_hf"]["rss_per_largest_tensor"] == pytest.approx(2.8)
    assert rows["deepspeed_zero3_to_hf"]["train_rss_bound_bytes"] == 1012 * mib
    assert rows["deepspeed_zero3_to_hf"]["within_train_rss_bound"] is True
    assert rows["zero_to_fp32"]["within_train_rss_bound"] is False
    md = render_markdown({"environment": {"cpus": 2, "mem_gib": 23.5, "python": "3", "torch": "2"},
                          "cache_mode": "data", "runs": runs, "args": {"repeat": 1, "workers": None},
                          "sizes_info": {}, "summary": summary, "train_sources": {}})
    assert "| 0.5 | deepspeed_zero3_to_hf | deepspeed_zero3 | 5.000 | 0.50 | 700 | 250.00 | 2.80 | 1012 | yes | 125.00 | 762 |" in md
    assert "| 0.5 | zero_to_fp32 | deepspeed_zero3 | 5.000 | 0.50 | 3000 | 250.00 | 12.00 | 1012 | NO | 250.00 | 1012 |" in md


def _frameworks_present() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("deepspeed", "transformers"))


def _layout_detects(kind: str, folder: Path) -> bool:
    """Whether reshard opens ``folder`` (the layouts of issue 33 land separately)."""
    code = ("import sys\nfrom reshard.layouts.registry import detect\n"
            "try:\n    detect(sys.argv[1])\nexcept Exception:\n    sys.exit(1)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", code, str(folder)], env=env, capture_output=True).returncode == 0


@pytest.mark.slow  # about 40 s on 2 cores: deepspeed and FSDP2 each start 2 processes to make the sources
@pytest.mark.skipif(not _frameworks_present(), reason="needs deepspeed and transformers")
def test_bench_train_rows(tmp_path):
    """Every training-framework row on the tiny Llama: the sources made by deepspeed (ZeRO-3, world 2) and FSDP2
    (world 2), each op timed next to a cp of its source, the references always, reshard's rows once its layouts
    open the sources."""
    data, md = run_bench(tmp_path, "--ops", "cp", *TRAIN_OPS, timeout=600)
    sources = data["train_sources"][SIZE]
    ds = Path(sources["deepspeed_zero3"]["source_dir"])
    assert (ds / "latest").read_text() == "global_step1" and (ds / "config.json").is_file()
    assert sorted(p.name for p in (ds / "global_step1").iterdir()) == [
        f"{p}zero_pp_rank_{r}_mp_rank_00_{w}_states.pt" for p, w in (("bf16_", "optim"), ("", "model"))
        for r in (0, 1)]
    dcp = Path(sources["fsdp2_dcp"]["source_dir"])
    assert sorted(p.name for p in (dcp / "pytorch_model_fsdp_0").iterdir()) == [".metadata", "__0_0.distcp",
                                                                                 "__1_0.distcp"]
    assert json.loads((dcp / "config.json").read_text())["hidden_size"] == 64
    largest = sources["deepspeed_zero3"]["largest_tensor"]["bytes"]
    assert largest == 1027 * 64 * 4
    opens = {"deepspeed_zero3": _layout_detects("deepspeed_zero3", ds), "fsdp2_dcp": _layout_detects("fsdp2_dcp", dcp)}
    for op in TRAIN_OPS:
        kind = "deepspeed_zero3" if op in TRAIN_OPS[:3] else "fsdp2_dcp"
        row = summary_row(data, op)
        if op.startswith(("deepspeed_", "fsdp2_")) and not opens[kind]:
            assert row["status"].startswith("failed"), row
            continue
        assert row["status"] == "ok", (row, [r.get("error_tail") for r in data["runs"] if r["op"] == op])
        assert row["source_kind"] == kind and row["largest_source_tensor_bytes"] == largest
        assert row["ratio_to_cp"] > 0 and row["ratio_kind"] == "median of paired runs"
        assert row["train_rss_bound_bytes"] == 2 * largest + (512 << 20)
        if not op.endswith(("zero_to_fp32", "dcp_to_torch_save")):
            assert row["within_train_rss_bound"], row  # reshard: torch and the plan fit in 0.5 GiB
        assert len([ln for ln in md.splitlines() if ln.startswith(f"| {SIZE} | {op} | {kind} |")]) == 1
        assert len(md_rows(md, op)) == 2  # in the main table and in the bound table
    # the cached sources outlive the run (made once per size), the outputs do not
    assert not (tmp_path / "work").exists() and ds.is_dir() and dcp.is_dir()
