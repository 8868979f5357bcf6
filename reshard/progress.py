"""Sizes for people, in binary units (KiB, MiB, GiB) like every size reshard prints, and the one byte progress bar."""

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
