"""The automatic process count of ``convert`` and digest ``verify`` (``--workers`` left out, ``workers=None``).

Three limits, the smallest wins: the cores (a verify process keeps about two busy: its reads and its two digest
lanes; a converting one mostly waits on the disk and the kernel's copies, so one per core; more than 8 processes
only add competing read streams), the memory available now (a
process is bounded at 512 MiB: one is allowed per GiB, leaving the rest to the page cache), and the bytes (a
process that would get less than ``min_bytes`` costs more to start than it saves). The choice comes with a
phrase naming the limits that bound it (only those: a report stays the same while the memory available drifts),
which reports and ``--json`` carry.
"""

from __future__ import annotations

import os

#: Bytes of memory available set aside per process (its bounded peak, and as much again for the page cache).
MEMORY_PER_PROCESS = 1 << 30
#: The most processes chosen automatically.
MOST = 8


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, else the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def available_memory() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes, or None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def choose_workers(nbytes: int, min_bytes: int, cores_per_process: int = 1, cores: int | None = None,
                   available: int | None = None) -> tuple[int, str]:
    """(processes, why) for work of ``nbytes`` bytes: ``min(cores / cores_per_process, 8, available memory /
    1 GiB, nbytes / min_bytes)``, at least 1."""
    cores = usable_cores() if cores is None else cores
    available = available_memory() if available is None else available
    by_cores = max(1, min(MOST, cores // cores_per_process))
    by_memory = by_cores if available is None else max(1, available // MEMORY_PER_PROCESS)
    by_bytes = max(1, nbytes // max(1, min_bytes))
    chosen = max(1, min(by_cores, by_memory, by_bytes))
    size = f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"
    limits = [(by_cores, f"{cores} core{'s' if cores != 1 else ''}"),
              (by_memory if available is not None else None, f"{(available or 0) / 2**30:.0f} GiB available"),
              (by_bytes, f"{size} to process")]
    binding = [phrase for value, phrase in limits if value == chosen] or [limits[0][1]]  # the limits that bind
    return chosen, f"{chosen} process{'es' if chosen > 1 else ''} chosen for {' and '.join(binding)}"
