"""Reads the heads of a source's data files before any plan exists (``posix_fadvise(WILLNEED)``, stdlib only).

Two moments when the disk would otherwise idle: the half second the CLI spends importing its argument parser
and the layout modules (:func:`read_source_heads_early`, called first by the console entry point), and the
seconds ``torch.load`` needs to import torch for a torch-format source (:func:`read_heads_while_torch_imports`).
The advice queues reads and returns; the pages land in the page cache, not in this process, so peak RSS does not
change, and correctness never depends on it (a page that has not arrived is read when it is touched).
"""

from __future__ import annotations

import glob
import os
import sys
import threading

from reshard.errors import ReshardError
from reshard.io.hf_files import weight_files
from reshard.io.regular import open_fd

SUPPORTED = hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_WILLNEED")

#: Most source bytes requested ahead of the executor (page cache, never this process's memory).
WINDOW = 2 << 30

#: Most bytes asked for before the command line is parsed: what the disk reads in the CLI's start-up, not more
#: (the executor's own read-ahead follows the plan's order from there).
EARLY_BUDGET = 512 << 20

_HEAD_CHUNK = 8 << 20


#: Processes sharing the read-ahead window (set in each forked worker: the machine's total stays one window).
_SHARERS = 1


def share_read_ahead(processes: int) -> None:
    """Divide this process's read-ahead window by ``processes`` (called in each of that many workers)."""
    global _SHARERS
    _SHARERS = max(1, processes)


def read_ahead_window() -> int:
    """``WINDOW``, or a quarter of the memory available now when that is less (never crowd out the cache), shared
    by the processes of a run (:func:`share_read_ahead`); at least 64 MiB. Page cache, never this process's RSS."""
    window = WINDOW
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    window = min(WINDOW, int(line.split()[1]) * 1024 // 4)
                    break
    except (OSError, ValueError, IndexError):
        pass
    return max(64 << 20, window // _SHARERS)


def read_heads_in_background(paths: list[str], budget: int | None = None) -> None:
    """Start reading the first ``budget / len(paths)`` bytes of every file (default budget: the read-ahead
    window), round-robin in chunks, on a daemon thread. Ranks are read in lockstep, so the heads of all files are
    read first."""
    if not SUPPORTED or not paths:
        return
    budget = read_ahead_window() if budget is None else budget
    threading.Thread(target=_advise_heads, args=(list(paths), budget // len(paths)), daemon=True,
                     name="reshard-read-heads").start()


def read_heads_while_torch_imports(paths: list[str]) -> None:
    """:func:`read_heads_in_background` for a source whose index needs ``torch.load`` (Megatron ``.pt``, torch_dist's
    ``common.pt``, Meta), when torch is not imported yet: the disk works during the import."""
    if "torch" not in sys.modules:
        read_heads_in_background(paths)


def top_level_weight_files(folder: str) -> list[str]:
    """The weight files directly in ``folder``: a Hugging Face folder's, chosen as its layout chooses them
    (:func:`reshard.io.hf_files.weight_files`: the index's shards, else ``*.safetensors`` but Mistral's
    ``consolidated*`` and adapters, else ``pytorch_model*.bin``; TensorRT-LLM's ``rank*.safetensors`` are among
    them), else its ``*.pth`` / ``*.pt`` (Meta's ``consolidated.NN.pth``). A folder its layout will refuse (a broken
    index) gets nothing; sub-folders (Megatron's ``iter_*``, a repository's ``original/``) are left to the layout
    that reads them."""
    if not os.path.isdir(folder):
        return []
    try:
        found = weight_files(folder)
    except ReshardError:
        return []
    if found:
        return found
    return sorted(p for p in glob.glob(os.path.join(glob.escape(folder), "*.pt*"))
                  if p.endswith((".pth", ".pt")) and os.path.isfile(p))


def megatron_rank_files(folder: str) -> list[str]:
    """The rank files of a Megatron checkpoint folder, guessed without its layout (stdlib only): the iteration
    folder that ``latest_checkpointed_iteration.txt`` names (or ``folder`` itself), its
    ``mp_rank_*/model_optim_rng.pt`` (torch format) or ``*.distcp`` (torch_dist) files. A hint's guess: the layout
    reads the checkpoint for real."""
    iteration = folder
    try:
        with open(os.path.join(folder, "latest_checkpointed_iteration.txt")) as f:
            label = f.read().strip()
        iteration = os.path.join(folder, "release" if label == "release" else f"iter_{int(label):07d}")
    except (OSError, ValueError):
        pass
    pattern = os.path.join(glob.escape(iteration), "mp_rank_*", "model_optim_rng.pt")
    return sorted(glob.glob(pattern)) or sorted(glob.glob(os.path.join(glob.escape(iteration), "*.distcp")))


def read_source_heads_early(argv: list[str]) -> None:
    """For ``reshard convert SRC ...`` with SRC a local folder, or ``reshard verify A B ...`` (the digest check)
    with local folders: start reading the heads of their weight files (round-robin; at most ``EARLY_BUDGET`` bytes
    in all for convert, the read-ahead window for verify, which reads every byte) while the CLI imports its parser
    and layouts and plans. Only the documented order (the folders first after the command) is recognised; anything else is left alone. A hint: it raises nothing, and a
    wrong guess only reads pages nobody uses."""
    if len(argv) < 2 or argv[0] not in ("convert", "verify") or "--forward" in argv or "--dry-run" in argv:
        return
    folders = argv[1:2] if argv[0] == "convert" else argv[1:3]
    if any(f.startswith("-") or not os.path.isdir(f) for f in folders):
        return
    # verify reads every byte of both folders: their heads are never wasted, so up to the read-ahead window
    budget = read_ahead_window() if argv[0] == "verify" else min(EARLY_BUDGET, read_ahead_window())
    read_heads_in_background([p for f in folders for p in top_level_weight_files(f) or megatron_rank_files(f)],
                             budget)


def _advise_heads(paths: list[str], per_file: int) -> None:
    fds = []
    try:
        for path in paths:
            fds.append(open_fd(path))
        for start in range(0, per_file, _HEAD_CHUNK):
            for fd in fds:
                os.posix_fadvise(fd, start, min(_HEAD_CHUNK, per_file - start), os.POSIX_FADV_WILLNEED)
    except (OSError, ReshardError):  # a hint: a file that cannot be read is reported by the real reader
        pass
    finally:
        for fd in fds:
            os.close(fd)
