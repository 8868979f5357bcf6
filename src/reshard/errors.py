"""One error type for everything a user can get wrong: a one-line message and an exit code."""

from __future__ import annotations


class ReshardError(Exception):
    """A problem with the user's input or request.

    The message is one line naming the problem and the fix; ``exit_code`` is what the CLI returns
    (2 for bad input or an impossible request, 1 for a failed verification).
    """

    exit_code = 2

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class PlanError(ReshardError):
    """The requested conversion is impossible; raised before anything is written."""


class CheckpointError(ReshardError):
    """The source checkpoint is malformed, incomplete or inconsistent."""


class MappingError(ReshardError):
    """A mapping file is malformed."""
