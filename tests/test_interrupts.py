"""A conversion SIGKILLed (or SIGTERMed) at exact points: nothing at DST looks complete, the same command run again
succeeds and verifies, stale staging folders are cleaned up, a second run to the same DST is refused while the
first one is alive, and the source tree is unchanged throughout.

The pause points (``RESHARD_TEST_PAUSE_AT``, see reshard/pause_points.py) stop the child at a known moment; the
test then kills it from outside with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import reshard
from checkpoints import make_hf
from cli_inprocess import run_main
from tree_snapshot import leftovers, snapshot


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("interrupts")
    hf = make_hf(root / "hf", hidden=256, heads=8, kv_heads=4, ffn=512, vocab=500, layers=2)
    reshard.convert(hf, str(root / "meg"), to="megatron", tp=2, pp=2)
    return {"hf": hf, "meg": str(root / "meg")}


def start_paused(args, point):
    """Start ``reshard ARGS`` in a child that stops at ``point``; returns once it is there."""
    env = {**os.environ, "RESHARD_TEST_PAUSE_AT": point, "RESHARD_DEBUG": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "reshard", *map(str, args)], env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith(f"reshard: paused at {point.split(':')[0]}"):
            return proc
    proc.wait()
    pytest.fail(f"the child never reached pause point {point}: exit {proc.returncode}, {''.join(seen)}")


def staging_folders(dst):
    parent, name = os.path.split(str(dst))
    return [n for n in os.listdir(parent) if n.startswith(f".{name}.reshard-partial-")]


def files_under(folder):
    return [os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs]


CASES = [  # (source, extra args, pause point, what the staging folder must hold when killed)
    ("hf", ["--to", "megatron", "--tp", "2", "--pp", "2"], "partial:1", "a .partial"),
    ("hf", ["--to", "megatron", "--tp", "2", "--pp", "2"], "file:2", "two rank files"),
    ("hf", ["--to", "megatron", "--tp", "2", "--pp", "2"], "publish", "the tracker"),
    ("meg", ["--to", "hf", "--max-shard-size", "1MB"], "partial:2", "a .partial"),
    ("meg", ["--to", "hf", "--max-shard-size", "1MB"], "publish", "the index"),
]


@pytest.mark.parametrize("source, args, point, holds", CASES, ids=[f"{s}-{p}" for s, _, p, _ in CASES])
def test_sigkill_then_rerun(sources, tmp_path, source, args, point, holds):
    src, dst = sources[source], tmp_path / "out"
    before = snapshot(src)
    proc = start_paused(["convert", src, dst, *args], point)
    (stage,) = staging_folders(dst)
    inside = files_under(tmp_path / stage)
    if holds == "a .partial":
        assert any(f.endswith(".partial") for f in inside), inside
    elif holds == "two rank files":
        assert sum(f.endswith("model_optim_rng.pt") for f in inside) == 2, inside
    elif holds == "the tracker":
        assert "latest_checkpointed_iteration.txt" in inside, inside
    else:
        assert "model.safetensors.index.json" in inside, inside
    if point == "partial:1":  # while the first run is alive, a second run to the same DST is refused
        busy = run_main("convert", src, dst, *args)
        assert busy.returncode == 2 and f"another reshard run (pid {proc.pid})" in busy.stderr, busy.stderr
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not dst.exists()  # nothing at DST, let alone something that looks complete
    assert staging_folders(dst) == [stage]  # the killed run's staging folder is left behind...
    rerun = run_main("convert", src, dst, *args)  # ...and neither blocks nor survives the same command
    assert rerun.returncode == 0, rerun.stderr
    assert leftovers(tmp_path) == []
    check = run_main("verify", src, dst)
    assert check.returncode == 0 and "EQUAL" in check.stdout, check.stdout
    assert snapshot(src) == before


def test_sigkill_during_overwrite_keeps_the_old_output(sources, tmp_path):
    src, dst = sources["hf"], tmp_path / "out"
    reshard.convert(src, str(dst), to="megatron", tp=1)
    old = snapshot(dst)
    args = ["convert", src, dst, "--to", "megatron", "--tp", "2", "--overwrite"]
    proc = start_paused(args, "publish")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert snapshot(dst) == old  # the complete old output, untouched
    assert run_main(*args).returncode == 0
    assert leftovers(tmp_path) == []
    assert reshard.inspect(str(dst))["tp"] == 2 and run_main("verify", src, dst).returncode == 0


def test_sigterm_cleans_up(sources, tmp_path):
    src, dst = sources["hf"], tmp_path / "out"
    proc = start_paused(["convert", src, dst, "--to", "megatron", "--tp", "2"], "file:1")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted" in err, err
    assert not dst.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_overwrite_publishes_with_and_without_atomic_exchange(sources, tmp_path, monkeypatch, exchange):
    import reshard.staging

    if not exchange:  # a filesystem without RENAME_EXCHANGE
        monkeypatch.setattr(reshard.staging, "_exchange", lambda a, b: False)
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    assert run_main("convert", sources["hf"], dst, "--to", "megatron", "--tp", "2", "--overwrite").returncode == 0
    assert not (dst / "old.txt").exists() and leftovers(tmp_path) == []
    assert run_main("verify", sources["hf"], dst).returncode == 0
