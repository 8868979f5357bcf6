"""Test-only pause points, so tests can SIGKILL a conversion at an exact moment.

``RESHARD_TEST_PAUSE_AT=NAME[:N]`` stops the process the N-th time (default 1st) it reaches point ``NAME``: it
prints ``reshard: paused at NAME`` on stderr and sleeps until killed. Points: ``partial`` (a file fully written
as ``.partial``, before fsync and rename), ``file`` (just after a file was renamed into the staging folder),
``publish`` (the staging folder complete, just before it is moved to the destination). Unset, nothing happens.
"""

from __future__ import annotations

import os
import sys
import time

_seen: dict[str, int] = {}


def pause_point(name: str) -> None:
    wanted = os.environ.get("RESHARD_TEST_PAUSE_AT")
    if not wanted:
        return
    point, _, count = wanted.partition(":")
    if point != name:
        return
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] != int(count or 1):
        return
    print(f"reshard: paused at {name}", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)
