"""``scripts/bench.py --plot`` needs matplotlib: pyproject.toml declares it as the ``bench`` extra, and without it the
bench says how to install it (after writing its JSON and Markdown)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_extra_declares_matplotlib():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(requirement.startswith("matplotlib") for requirement in extras["bench"])


def test_plot_without_matplotlib_names_the_extra(tmp_path):
    blocked = tmp_path / "no_matplotlib" / "matplotlib"  # shadows an installed matplotlib: its import fails
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), "--sizes", "0.002", "--repeat", "1",
                           "--ops", "cp", "--out", str(tmp_path / "out"), "--plot"], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [str(blocked.parent), os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 3, proc.stderr
    assert "--plot needs matplotlib, which is not installed: pip install -e '.[bench]'" in proc.stderr
    assert (tmp_path / "out" / "bench.json").is_file() and (tmp_path / "out" / "bench.md").is_file()
