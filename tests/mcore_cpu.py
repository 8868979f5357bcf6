"""megatron-core on a CPU-only machine: what every megatron-core test harness sets before it imports torch.

Loopback only (gloo's sockets on ``lo``), one thread per rank, no Hub access; ``torch.cuda.current_device`` answers
"cpu" (megatron-core passes it as a device in a few places: rotary embedding, attention buffers); megatron's
"Transformer Engine and Apex are not installed" and deprecation warnings silenced.
"""

from __future__ import annotations

import os
import warnings


def prepare_cpu():
    """Set the environment, import torch, install the shims above; returns the torch module."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    return torch
