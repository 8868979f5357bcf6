"""A file written as ``PATH.partial`` and renamed to ``PATH`` only once complete."""

from __future__ import annotations

import os


class PartialFile:
    """Opens ``path + '.partial'`` for writing; :meth:`publish` fsyncs and renames, :meth:`abort` deletes."""

    def __init__(self, path: str):
        self.path = path
        self.partial = path + ".partial"
        self._file = open(self.partial, "wb")

    def publish(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.partial, self.path)

    def abort(self) -> None:
        self._file.close()
        if os.path.exists(self.partial):
            os.unlink(self.partial)
