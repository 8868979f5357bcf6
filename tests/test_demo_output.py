"""``reshard demo`` says where its checkpoints are, how to keep them, and ends with three commands that work on the
kept folder."""

from __future__ import annotations

import shlex
import tempfile
from pathlib import Path

from cli_inprocess import run_main


def stub_steps(monkeypatch) -> list[str]:
    """Replace the demo's steps (run for real by the last test and tests/test_gpu_node.py) by one folder."""
    made = []

    def steps(base, *_):
        made.append(base)
        (Path(base) / "hf").mkdir()
        return True

    monkeypatch.setattr("reshard.demo._run_steps", steps)
    return made


def test_temporary_demo_says_how_to_keep_it_and_deletes_it(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = stub_steps(monkeypatch)
    proc = run_main("demo")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].endswith(f"in {made[0]} (temporary: deleted at the end; --keep keeps it)")
    assert lines[-4:] == [
        f"deleted {made[0]}; to keep the checkpoints run `reshard demo --keep` (or `--workdir DIR`), then try:",
        "  reshard inspect DIR/megatron-tp2-pp2",
        "  reshard convert DIR/hf DIR/my-vllm-tp2 --to vllm --tp 2",
        "  reshard verify DIR/hf DIR/my-vllm-tp2 --forward",
    ]
    assert list(tmp_path.iterdir()) == []


def test_keep_keeps_the_temporary_folder_and_names_it(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = stub_steps(monkeypatch)
    proc = run_main("demo", "--keep")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].endswith(f"in {made[0]}") and (Path(made[0]) / "hf").is_dir()
    assert proc.stdout.splitlines()[-4:] == [f"the checkpoints are kept in {made[0]}; try next:"] + [
        f"  reshard {command}" for command in (
            f"inspect {made[0]}/megatron-tp2-pp2", f"convert {made[0]}/hf {made[0]}/my-vllm-tp2 --to vllm --tp 2",
            f"verify {made[0]}/hf {made[0]}/my-vllm-tp2 --forward")]


def test_kept_demo_ends_with_three_commands_that_work(tmp_path):
    kept = tmp_path / "demo dir"  # a space: the commands quote their paths
    proc = run_main("demo", "--workdir", kept)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "demo passed" in proc.stdout and lines[0].endswith(f"in {kept}")
    assert lines[-4] == f"the checkpoints are kept in {kept}; try next:"
    commands = [shlex.split(line) for line in lines[-3:]]
    assert [c[:2] for c in commands] == [["reshard", "inspect"], ["reshard", "convert"], ["reshard", "verify"]]
    for command in commands:
        ran = run_main(*command[1:])
        assert ran.returncode == 0, (command, ran.stderr)
    assert "FORWARD EQUAL" in ran.stdout and (kept / "my-vllm-tp2").is_dir()
