"""Small test helpers shared by several test modules: the CLI run in this process, tiny transformers models,
processes left behind."""

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
