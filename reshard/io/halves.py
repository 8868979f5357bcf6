"""One long write done by two threads at once: the first half by the calling thread, the second by a short-lived
helper, each at its own explicit file offset (``pwrite`` / ``copy_file_range`` never share a file position).

A file is written by one writer lane (its bytes stay in order), so a conversion that writes one file (HF tp 1,
Megatron tp 1) would copy every byte on one core; the kernel's copy of page-cache data is what bounds it. Runs of
at least ``SPLIT_BYTES`` are halved so that both cores copy. The bytes written are the same.
"""

from __future__ import annotations

import os
import threading

#: A run shorter than this is written by the calling thread alone (a thread costs more than it saves).
SPLIT_BYTES = 16 << 20
#: Halves meet on a multiple of this (source and target offsets move together: page phases are kept).
CUT_ALIGN = 1 << 20


def midpoint(total: int) -> int:
    """Where a run of ``total`` bytes is cut: 0 when it is not worth cutting."""
    if total < SPLIT_BYTES:
        return 0
    return total // 2 // CUT_ALIGN * CUT_ALIGN


def both(first, second) -> None:
    """Run ``second`` on a helper thread while this thread runs ``first``; re-raise the first error of either."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            second()
        except BaseException as exc:  # handed to the caller
            errors.append(exc)

    helper = threading.Thread(target=run, daemon=True, name="reshard-write-half")
    helper.start()
    try:
        first()
    finally:
        helper.join()
    if errors:
        raise errors[0]


def pwrite_all(fd: int, data: memoryview, pos: int) -> None:
    """Write all of ``data`` at offset ``pos`` of ``fd``."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], pos + done)

