"""How the ``reshard`` process reports failure and leaves: ``error: TEXT`` as one stderr line (rank-prefixed under
torchrun), usage errors as one line naming the option and the fix (exit 2), SIGTERM handled as Ctrl-C, and the
multiprocessing temp folder removed before :func:`os._exit`."""

from __future__ import annotations

import sys


def _terminated(signum, frame):
    raise KeyboardInterrupt  # SIGTERM cleans up like Ctrl-C: the staging folder is removed, nothing published



def _remove_multiprocessing_temp_folder() -> None:
    """Delete the ``pymp-*`` folder multiprocessing made in the system temp folder for this process (where a
    forkserver's socket lives): its exit hook would, but ``os._exit`` skips it."""
    import shutil

    process = sys.modules.get("multiprocessing.process")
    folder = process.current_process()._config.get("tempdir") if process else None
    if folder:
        shutil.rmtree(folder, ignore_errors=True)



def _error_line(text: str) -> None:
    """``error: TEXT`` on stderr in one write (ranks of a torchrun world share the stream), prefixed by the rank
    there."""
    from reshard.distributed import log_prefix

    sys.stderr.write(f"{log_prefix()}error: {text}\n")
    sys.stderr.flush()



def _usage_error(exc) -> None:
    """A command-line usage error as one line naming the option and the fix, exit code 2 (help when asked)."""
    if type(exc).__name__ == "NoArgsIsHelpError":  # `reshard` or `reshard mappings` alone: the help text
        exc.show()
        sys.exit(0)
    ctx = getattr(exc, "ctx", None)
    where = ctx.command_path if ctx is not None else "reshard"
    message = " ".join(exc.format_message().split())
    _error_line(f"{message} (see '{where} --help')")
    sys.exit(getattr(exc, "exit_code", 2) or 2)
