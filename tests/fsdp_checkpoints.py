"""FSDP2 checkpoints made once per test session by torch itself (``fsdp_worker.py``: 2 gloo processes on
127.0.0.1), shared by the dcp and torchtitan tests, plus the reference computations they are checked against:
the trained model's ``full_tensor()`` state dict, its logits, and transformers' logits of an HF folder."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import torch

from fsdp_worker import HF_LLAMA, LLAMA, QWEN3, Titan  # noqa: F401  (configs re-exported for the tests)
from helpers import processes_tagged

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fsdp_worker.py")
IDS = torch.tensor([[3, 17, 42, 5, 66, 0, 23, 11, 8, 31]])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fsdp_checkpoints(tmp_path_factory) -> str:
    """The folder of ``fsdp_worker.py``'s checkpoints (made on first use in this session), with
    ``llama.config.json`` / ``qwen3.config.json`` (HF configs of the torchtitan models) and ``accel/config.json``."""
    root = tmp_path_factory.getbasetemp() / "fsdp2_checkpoints"
    if (root / "DONE").exists():
        return str(root)
    root.mkdir(exist_ok=True)
    tag = f"fsdp-{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", RESHARD_TEST_TAG=tag)
    proc = subprocess.Popen([sys.executable, WORKER, str(root), str(_free_port())], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    for _ in range(50):  # the spawned ranks are joined; give the kernel a moment to reap them
        if not processes_tagged(tag):
            break
        time.sleep(0.1)
    assert not processes_tagged(tag), "an FSDP worker process outlived its launch"
    for name, config in (("llama", LLAMA), ("qwen3", QWEN3)):
        (root / f"{name}.config.json").write_text(json.dumps(config))
    (root / "accel" / "config.json").write_text(json.dumps(HF_LLAMA))
    (root / "DONE").touch()
    return str(root)


def trained(root: str, name: str) -> dict[str, torch.Tensor]:
    """The trained model's ``full_tensor()`` state dict (``llama``, ``qwen3``: torchtitan v0.2 names; ``accel``:
    HF names)."""
    return torch.load(os.path.join(root, f"{name}.full.pt"), weights_only=True)


def titan_logits(config: dict, state: dict[str, torch.Tensor], qk_norm: bool) -> torch.Tensor:
    model = Titan(config, qk_norm=qk_norm)
    model.load_state_dict(state)
    with torch.no_grad():
        return model.eval()(IDS)


def hf_logits(folder: str) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits
