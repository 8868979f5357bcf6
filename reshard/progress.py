"""Sizes for people, in binary units (KiB, MiB, GiB) like every size reshard prints, the one byte progress bar and
a step progress line."""

from __future__ import annotations

_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def binary_size(nbytes: int) -> str:
    """``1.5 GiB``, ``480.0 KiB``, ``12 B``."""
    for unit, scale in _UNITS:
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def byte_bar(total: int, desc: str, disable: bool, **options):
    """A tqdm bar counting bytes in KiB / MiB / GiB (``unit="iB"`` with divisor 1024: tqdm's ``"B"`` would label
    MiB as MB); ``options`` go to tqdm (``file=...``)."""
    from tqdm import tqdm

    return tqdm(total=total, unit="iB", unit_scale=True, unit_divisor=1024, desc=desc, disable=disable,
                leave=False, **options)


def step_progress(desc: str, rank: int = 0, world: int = 1, file=None):
    """A callback for a run of named steps, or None unless ``rank`` is 0 and ``file`` (default stderr) is a TTY.
    Called with a step's name once it has run, it rewrites one line in place: ``{desc} {step} (rank 0 of
    {world}) {seconds since the callback was made:.1f} s``; called with None, it ends the line."""
    import sys
    import time

    file = sys.stderr if file is None else file
    if rank != 0 or not getattr(file, "isatty", lambda: False)():
        return None
    start, shown = time.monotonic(), [0]

    def progress(step: str | None) -> None:
        if step is None:
            if shown[0]:
                file.write("\n")
                file.flush()
            shown[0] = 0
            return
        line = f"{desc} {step} (rank {rank} of {world}) {time.monotonic() - start:.1f} s"
        file.write("\r" + line.ljust(shown[0]))
        file.flush()
        shown[0] = len(line)

    return progress
