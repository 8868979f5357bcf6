"""What the Python API returns besides a conversion: the two checks' reports and a conversion plan.

Both checks answer the same way: ``.equal``, ``.report`` (the dict ``reshard verify --json`` prints) and
``.to_json()`` (that text); the digest check's :class:`reshard.verification.digest.VerifyReport` and the forward
check's :class:`ForwardReport` share :class:`Report`. :class:`ConversionPlan` is ``reshard.plan``'s result:
``describe()`` gives what ``reshard plan`` prints. Every ``repr`` is one short line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Iterator


class Report:
    """The surface both checks' reports share; a subclass defines ``equal`` and ``to_dict()``."""

    equal: bool

    def to_dict(self) -> dict:
        raise NotImplementedError

    @property
    def report(self) -> dict:
        """The report as ``reshard verify --json`` prints it."""
        return self.to_dict()

    def to_json(self) -> str:
        """What ``reshard verify --json`` prints."""
        return json.dumps(self.to_dict(), indent=2)

    def __bool__(self) -> bool:
        raise TypeError(f"a {type(self).__name__} has no truth value: test its .equal")


class ForwardReport(Report, Mapping):
    """The forward check's report. Read-only dict access (``report["ok"]``, ``report["a"]["run"]``) gives its
    fields as before; ``describe()`` the lines ``reshard verify --forward`` prints."""

    def __init__(self, data: dict):
        self._data = data

    @property
    def equal(self) -> bool:
        return bool(self._data["ok"])

    def to_dict(self) -> dict:
        return self._data

    def describe(self) -> str:
        from reshard.verification.forward.report import format_report

        return format_report(self._data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        d = self._data
        layouts = " vs ".join(f"{d[k]['layout']} tp={d[k]['tp']}" for k in ("a", "b"))
        first = (d["first_divergence"] or "").split(" (")[0]  # the step, not its tensors
        verdict = f"max_abs={d['max_abs']:.3g}" + (f", first_divergence={first!r}" if first else "")
        return (f"ForwardReport(equal={self.equal}, a={d['a']['path']!r}, b={d['b']['path']!r}, "
                f"layouts={layouts!r}, {verdict})")


class ConversionPlan:
    """A conversion planned and not run (``reshard.plan``): ``files`` (each with ``path``, ``tensors``,
    ``nbytes``), ``nbytes`` to write, ``read_bytes`` per source file, ``notes``, ``download`` (a remote source:
    the files and bytes a conversion would download, else None) and the underlying ``plan``."""

    def __init__(self, plan, download: dict | None = None):
        self.plan = plan
        self.download = download

    def __getattr__(self, name: str) -> Any:
        if name == "plan":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.plan, name)

    def describe(self) -> str:
        """What ``reshard plan`` prints."""
        return describe_plan(self.plan, self.download)

    def to_dict(self) -> dict:
        """What ``reshard plan --json`` prints."""
        return {**plan_json(self.plan), "download": self.download}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __repr__(self) -> str:
        p = self.plan
        return (f"ConversionPlan({p.source_layout} -> {p.target_layout}, files={len(p.files)}, bytes={p.nbytes}, "
                f"notes={len(p.notes)})")


def describe_plan(plan, download: dict | None = None) -> str:
    """A plan in lines: its files with their tensors and bytes, the bytes read per source file, its notes (and,
    for a remote source, the bytes a conversion would download)."""
    lines = [f"plan: {plan.source_layout} -> {plan.target_layout}, {len(plan.files)} files, "
             f"{plan.nbytes / 2**20:.1f} MiB to write"]
    lines += [f"  {f.path}  {len(f.tensors)} tensors  {f.nbytes / 2**20:.2f} MiB" for f in plan.files]
    lines.append("bytes read per source file:")
    lines += [f"  {os.path.relpath(path, plan.source_root)}  {n / 2**20:.2f} MiB"
              for path, n in plan.read_bytes.items()]
    if plan.checks:
        lines.append(f"replica checks: {len(plan.checks)}")
    lines += [f"note: {note}" for note in plan.notes]
    if download is not None:
        lines.append(download_line(download))
    return "\n".join(lines)


def download_line(download: dict) -> str:
    """What a conversion from a remote source would download."""
    return (f"bytes to download: {download['bytes']} ({download['bytes'] / 2**20:.1f} MiB, {download['files']} files "
            "not in the cache); this plan read headers only")


def plan_json(plan) -> dict:
    """A plan as ``reshard plan --json`` prints it (less ``download``)."""
    return {
        "source_layout": plan.source_layout, "target_layout": plan.target_layout, "bytes": plan.nbytes,
        "files": [{"path": f.path, "bytes": f.nbytes,
                   "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "reads": len(t.reads)}
                               for t in f.tensors]} for f in plan.files],
        "bytes_read_per_source": {os.path.relpath(p, plan.source_root): n for p, n in plan.read_bytes.items()},
        "replica_checks": len(plan.checks), "notes": plan.notes,
    }
