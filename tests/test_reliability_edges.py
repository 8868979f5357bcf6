"""Reliability at the edges (issue 30): the published folder's mode, side files that are symlinks out of the
source, files that are not regular files, forced architectures and settings a mapping does not carry, options a
target does not use, messages that name the real reason, an iteration folder given directly, and ``--help`` at
80 columns."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys

import pytest
import torch

import reshard
from checkpoints import hf_config, hf_tensor_shapes, load_hf_tensors, make_hf, position_coded, write_hf
from helpers import run_cli


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A position-coded tiny Llama with a generation config beside it."""
    return make_hf(str(tmp_path_factory.mktemp("edges") / "llama"), vocab=1004)


def _one_line_refusal(code: int, err: str, *phrases: str) -> None:
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for phrase in phrases:
        assert phrase in err, err


# ------------------------------------------------------------------------------------------ item 2: mode

@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_output_folder_gets_the_mode_a_plain_mkdir_would(llama, capsys, tmp_path, umask):
    old = os.umask(umask)
    try:
        code, _, err = run_cli(capsys, "convert", llama, tmp_path / "out", "--to", "megatron", "--tp", "2")
        os.mkdir(tmp_path / "plain")
    finally:
        os.umask(old)
    assert code == 0, err
    mode = stat.S_IMODE(os.stat(tmp_path / "out").st_mode)
    assert mode == 0o777 & ~umask == stat.S_IMODE(os.stat(tmp_path / "plain").st_mode), oct(mode)


# ------------------------------------------------------------------------------------------ item 8: --help

def test_convert_help_at_80_columns_shows_every_option_whole_and_flags_as_flags():
    import typer.main

    from reshard.cli import app

    command = typer.main.get_command(app).commands["convert"]
    env = {**os.environ, "COLUMNS": "80", "TERM": "xterm-256color"}
    env.pop("RESHARD_DEBUG", None)
    result = subprocess.run([sys.executable, "-m", "reshard", "convert", "--help"], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert max(len(line) for line in text.splitlines()) <= 80, text
    for param in command.params:
        for name in param.opts:
            if name.startswith("--"):
                assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), (name, text)
    assert "<bool>" not in text and "…" not in text, text
    for flag in ("--overwrite", "--dry-run", "--expert-parallel", "--json"):
        line = next(line for line in text.splitlines() if re.search(rf"{flag}(?![\w-])", line))
        assert re.search(rf"{flag}\s{{2,}}[^<\s]", line), line  # the flag, then its help: no value placeholder
