"""Small test helpers shared by several test modules: the CLI run in this process, tiny transformers models,
processes left behind, a gloo world of worker scripts."""

from __future__ import annotations

import os
import sys

import torch


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """``reshard ARGS`` through ``reshard.cli.main`` in this process: (exit code, stdout, stderr)."""
    from reshard import cli

    argv = sys.argv
    sys.argv = ["reshard", *map(str, args)]
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    finally:
        sys.argv = argv
    out = capsys.readouterr()
    return code, out.out, out.err


def processes_tagged(tag: str) -> list[int]:
    """Processes still alive whose environment carries ``RESHARD_TEST_TAG=tag`` (every process a tagged command
    starts inherits it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"RESHARD_TEST_TAG={tag}".encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            continue
    return found


def tiny_transformers_model(transformers, cls_name: str, **extra):
    """A 2-layer, hidden-64, 8-head, vocab-1003 model from a config class (``extra`` adds or overrides
    settings), with seeded noise on every parameter so norms and biases matter."""
    settings = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                    vocab_size=1003, max_position_embeddings=128)
    return perturbed_model(transformers, getattr(transformers, cls_name)(**{**settings, **extra}))


def perturbed_model(transformers, config):
    """An fp32 eval model built from ``config`` with seeded noise (0.05) on every parameter."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(script: str, job_path, world: int, out, wait: float) -> tuple[list[dict], list[int]]:
    """Run ``python SCRIPT JOB RANK WORLD PORT OUT`` for every rank (gloo on the loopback, one thread each) and
    return (each rank's ``OUT/<rank>.json`` list of cases by name, or {} where it wrote none; return codes). Every
    process is gone at the end: one still alive after ``wait`` seconds is killed with its process group (and the
    test fails)."""
    import json
    import signal
    import subprocess
    import time

    import pytest

    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    port = free_port()
    procs = [subprocess.Popen([sys.executable, script, str(job_path), str(r), str(world), str(port), str(out)],
                              env=env, start_new_session=True) for r in range(world)]
    deadline = time.monotonic() + wait
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"worker processes still running after {wait} s")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    results = []
    for r in range(world):
        f = out / f"{r}.json"
        results.append({c["name"]: c for c in json.loads(f.read_text())} if f.exists() else {})
    return results, [p.returncode for p in procs]
