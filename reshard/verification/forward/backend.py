"""The process-group backend of a forward check: NCCL only where every process of this node gets a GPU of its own.

NCCL gives rank ``r`` the device ``cuda:<local rank>`` (:func:`reshard.verification.forward.job.device_for`), so it
needs at least as many visible GPUs as the node runs processes: ``torch.cuda.device_count()`` (which counts the
devices ``CUDA_VISIBLE_DEVICES`` leaves visible) against the processes this node starts (``--nproc``; under
``torchrun``, ``LOCAL_WORLD_SIZE``, with this process's ``LOCAL_RANK`` among the devices). Where that does not
hold, the automatic choice is gloo on CPU with a note saying why, and an explicit ``nccl`` is refused before any
process starts.
"""

from __future__ import annotations

import os

from reshard.errors import ReshardError

BACKENDS = ("gloo", "nccl")


def visible_gpus() -> int:
    """CUDA devices this process can use (0 without CUDA)."""
    import torch

    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except RuntimeError:  # a driver that cannot be initialised: no usable GPU
        return 0


def node_processes(nproc: int, torchrun: bool) -> tuple[int, int]:
    """(processes on this node, the highest local rank among them): ``nproc`` started here, or torchrun's
    ``LOCAL_WORLD_SIZE`` and this process's ``LOCAL_RANK``."""
    if torchrun:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", nproc)))
        return local, max(local - 1, int(os.environ.get("LOCAL_RANK", 0)))
    return nproc, nproc - 1


def _gpus_phrase(count: int) -> str:
    masked = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={masked})" if masked is not None else ""
    return f"{count} GPU{'' if count == 1 else 's'} visible{where}"


def choose_backend(requested: str | None, nproc: int, torchrun: bool = False, fixed_nproc: bool = False
                   ) -> tuple[str, str | None]:
    """(the backend, a note saying why gloo was chosen over CUDA, or None). ``fixed_nproc``: B's rank files fix
    the process count (the ways out then name a conversion rather than ``--nproc``)."""
    if requested is not None and requested not in BACKENDS:
        raise ReshardError(f"unknown --backend '{requested}': use gloo or nccl")
    if requested == "gloo":
        return "gloo", None
    gpus = visible_gpus()
    local, highest = node_processes(nproc, torchrun)
    fits = gpus > 0 and highest < gpus
    if requested == "nccl":
        if gpus == 0:
            raise ReshardError("--backend nccl needs CUDA, which this torch cannot see (0 GPUs); use --backend gloo")
        if not fits:
            fewer = (f"convert B to tp={gpus} first" if fixed_nproc else f"--nproc {gpus}")
            raise ReshardError(f"--backend nccl needs one GPU per process: this node runs {local} process"
                               f"{'' if local == 1 else 'es'} and has {_gpus_phrase(gpus)}; use --backend gloo, "
                               f"{fewer}, or a node with {local} GPUs")
        return "nccl", None
    if fits:
        return "nccl", None
    if gpus == 0:
        return "gloo", None
    return "gloo", (f"backend gloo on CPU: this node runs {local} process{'' if local == 1 else 'es'} and has "
                    f"{_gpus_phrase(gpus)}, and NCCL needs one GPU per process (--backend nccl with as many GPUs "
                    "as processes runs on them)")
