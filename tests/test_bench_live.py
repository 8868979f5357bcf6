"""The live rows of scripts/bench.py (issue 34, scripts/bench_live.py): a gloo world of 6 processes moves a tiny
Llama from Megatron to vLLM ranks with ``reshard.live.transfer`` and with the naive all-gather baseline; the table
has a row per case and method, reshard's rows are within the bound, move each payload byte once and fill the same
tensors as the baseline. Like tests/test_bench.py they never assert timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_bench import REPO, SIZE, load_bench


def bench_live():
    load_bench()  # puts scripts/ first on sys.path
    import bench_live as mod

    return mod


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    load_bench()
    from bench_model import GIB, ensure_source

    src, _, _ = ensure_source(tmp_path_factory.mktemp("live-src"), float(SIZE), 2 * GIB, lambda m: None)
    return src


def test_live_rows_on_a_tiny_model(tiny_source, tmp_path):
    mod = bench_live()
    rows = mod.measure(tiny_source, SIZE, tmp_path / "work", log=lambda m: None)
    assert [(r["case"], r["method"]) for r in rows] == [(c, m) for c in mod.CASES for m in mod.METHODS]
    for r in rows:
        assert r["wall_s"] > 0 and r["max_extra_rss_bytes"] >= 0 and r["targets_agree"] is True, r
        assert len(r["per_rank_extra_rss_bytes"]) == r["processes"] == (6 if "disjoint" in r["case"] else 4)
        assert r["rss_bound_bytes"] == 2 * (64 << 20) + (64 << 20)
        if r["method"] == "reshard":
            assert r["within_bound"], r
            assert r["bytes_moved"] + r["local_bytes"] == r["payload_bytes"]  # each byte once
            assert r["transfer_s"] > 0
        else:
            assert r["bytes_moved"] > r["payload_bytes"]  # whole tensors to every rank
    md = mod.render(rows).splitlines()
    header = md[0].split("|")
    assert "seconds (wall)" in md[0] and "bound 2 x chunk + 64 MiB" in md[0] and "within bound" in md[0]
    assert len(md) == 2 + len(rows) and all(len(ln.split("|")) == len(header) for ln in md)
    reshard_rows = [ln for ln in md[2:] if "| reshard live.transfer |" in ln]
    assert len(reshard_rows) == 2 and all("| 192 MiB | yes |" in ln for ln in reshard_rows)
    assert sum("| naive all-gather + broadcast, slice |" in ln for ln in md) == 2
    assert not list((tmp_path / "work").glob("*.json.tmp"))


def test_failed_workers_are_reaped_and_reported(tmp_path):
    """Every worker fails (no such checkpoint): launch raises with their logs, and no process is left."""
    mod = bench_live()
    with pytest.raises(RuntimeError, match="live worker") as err:
        mod.launch(tmp_path / "missing", tmp_path / "work", list(mod.CASES), world=2, timeout=120)
    assert "--- rank 1" in str(err.value)
    children = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout.split()
    assert children == []


def test_live_flag_is_opt_in():
    bench = load_bench()
    assert bench.parse_args([]).live is False
    assert bench.parse_args(["--live", "--ops", "cp"]).live is True


@pytest.mark.slow
def test_bench_live_section(tmp_path):
    """scripts/bench.py --live: the live rows in bench.json and a "Live resharding" section in bench.md."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "scripts" / "bench.py"), "--sizes", SIZE, "--repeat", "1", "--ops", "cp",
           "--live", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((out / "bench.json").read_text())
    assert len(data["live"]) == 4 and all(r["within_bound"] for r in data["live"] if r["method"] == "reshard")
    md = (out / "bench.md").read_text()
    assert "## Live resharding" in md and md.count("| reshard live.transfer |") == 2
