"""Run ``reshard.cli.main`` in this process (no interpreter start-up) and capture what a shell would see."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout


def run_main(*args) -> subprocess.CompletedProcess:
    """Like running ``reshard ARGS``: returncode (from SystemExit), stdout and stderr; RESHARD_DEBUG off."""
    from reshard import cli

    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_term, saved_debug = sys.argv, signal.getsignal(signal.SIGTERM), os.environ.get("RESHARD_DEBUG")
    sys.argv = ["reshard", *map(str, args)]
    os.environ["RESHARD_DEBUG"] = "0"
    code = 0
    try:
        with redirect_stdout(out), redirect_stderr(err):
            cli.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = saved_argv
        signal.signal(signal.SIGTERM, saved_term)
        if saved_debug is None:
            os.environ.pop("RESHARD_DEBUG", None)
        else:
            os.environ["RESHARD_DEBUG"] = saved_debug
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())
