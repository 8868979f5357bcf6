"""scripts/bench.py's opt-in rows timing MaxText's own converter: named with --ops only, and without
RESHARD_MAXTEXT_PYTHON their child prints one line naming the variable and exits 2 (no MaxText needed here)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OPS = ("maxtext_converter_to_maxtext", "maxtext_converter_to_hf")


def load_bench():
    spec = importlib.util.spec_from_file_location("reshard_bench_mtc", REPO / "scripts" / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_maxtext_converter_ops_are_opt_in_and_need_the_interpreter(tmp_path, monkeypatch):
    bench = load_bench()
    assert not set(OPS) & set(bench.parse_args(["--out", str(tmp_path)]).ops)
    assert set(OPS) <= set(bench.parse_args(["--out", str(tmp_path), "--ops", "cp", *OPS]).ops)
    monkeypatch.delenv("RESHARD_MAXTEXT_PYTHON", raising=False)
    cmd = bench.build_cmd(OPS[0], tmp_path / "src", tmp_path / "dst", None)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "RESHARD_MAXTEXT_PYTHON" in res.stderr
    assert not (tmp_path / "dst").exists()
    monkeypatch.setenv("RESHARD_MAXTEXT_PYTHON", "/opt/mt/bin/python")
    cmd = bench.build_cmd(OPS[1], tmp_path / "src", tmp_path / "dst", None)
    assert cmd[0] == "/opt/mt/bin/python" and cmd[1].endswith("bench_maxtext_converter.py")
    assert cmd[2:] == ["to_hf", str(tmp_path / "src"), str(tmp_path / "dst")]
    assert sys.executable not in cmd
