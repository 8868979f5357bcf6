"""Fingerprint of a folder tree (every file's SHA-256, size and mtime), to prove a source was left untouched."""

from __future__ import annotations

import hashlib
import os


def snapshot(root) -> dict[str, tuple]:
    """Relative path -> (sha256, size, mtime_ns) for files, ('dir', mtime_ns) for folders."""
    out: dict[str, tuple] = {}
    root = str(root)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            path = os.path.join(folder, name)
            out[os.path.relpath(path, root)] = ("dir", os.stat(path).st_mtime_ns)
        for name in files:
            path = os.path.join(folder, name)
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            st = os.stat(path)
            out[os.path.relpath(path, root)] = (digest.hexdigest(), st.st_size, st.st_mtime_ns)
    return out


def leftovers(parent) -> list[str]:
    """Files or folders reshard stages or locks with, anywhere under ``parent``."""
    found = []
    for folder, dirs, files in os.walk(str(parent)):
        for name in dirs + files:
            if name.endswith(".partial") or ".reshard-" in name:
                found.append(os.path.relpath(os.path.join(folder, name), str(parent)))
    return found
