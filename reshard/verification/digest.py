"""Digest verification: stream both checkpoints' canonical views and compare every tensor.

Same dtype: bit-exact (SHA-256 of the bytes). Different dtypes: the wider tensor cast to the narrower dtype
must equal the other bit for bit, or, with ``atol``/``rtol``, ``|a - b| <= atol + rtol * |a|`` everywhere.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

import torch

from reshard.core.model_config import differences
from reshard.core.plan import CanonicalIndex, TargetTensor
from reshard.execute import assemble, bits_equal, run_replica_checks
from reshard.hub import open_source
from reshard.layouts.base import Options, Source



@dataclass
class TensorResult:
    name: str
    status: str  # equal | equal_after_cast | within_tolerance | different | cast_overflow | missing_in_a | missing_in_b
    dtype_a: str | None = None
    dtype_b: str | None = None
    sha256_a: str | None = None
    sha256_b: str | None = None
    max_abs: float | None = None
    max_rel: float | None = None

    @property
    def ok(self) -> bool:
        return self.status in ("equal", "equal_after_cast", "within_tolerance")


@dataclass
class VerifyReport:
    a: str
    b: str
    layout_a: str
    layout_b: str
    tensors: list[TensorResult] = field(default_factory=list)
    config_differences: list[dict] = field(default_factory=list)
    replica_differences: list[str] = field(default_factory=list)  # copies of a replicated tensor that disagree

    @property
    def equal(self) -> bool:
        return not self.config_differences and not self.replica_differences and all(t.ok for t in self.tensors)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["equal"] = self.equal
        d["summary"] = {s: sum(t.status == s for t in self.tensors) for s in sorted({t.status for t in self.tensors})}
        return d


def canonical_tensor(source: Source, index: CanonicalIndex, name: str) -> torch.Tensor:
    t = source.model.tensors[name]
    reads = index.reads_for(name, 0, t.shape[t.axis], 0)
    return assemble(TargetTensor(name, t.shape, source.model.dtypes[name], t.axis, reads), source.files)


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def compare_tensors(name: str, a: torch.Tensor, b: torch.Tensor, atol: float | None, rtol: float | None
                    ) -> TensorResult:
    from reshard.io.dtypes import from_torch

    res = TensorResult(name, "different", from_torch(a.dtype), from_torch(b.dtype))
    if a.shape != b.shape:
        res.status = "different"
        return res
    diff = (a.double() - b.double()).abs()
    res.max_abs = diff.max().item() if diff.numel() else 0.0
    denom = a.double().abs().clamp_min(1e-30)
    res.max_rel = (diff / denom).max().item() if diff.numel() else 0.0
    if a.dtype == b.dtype:
        res.sha256_a, res.sha256_b = _sha(a), _sha(b)
        if res.sha256_a == res.sha256_b:
            res.status = "equal"
            return res
    if a.dtype != b.dtype and a.is_floating_point() and b.is_floating_point():
        wide, narrow = (a, b) if a.element_size() >= b.element_size() else (b, a)
        if bool((~torch.isfinite(narrow) & torch.isfinite(wide)).any()):
            res.status = "cast_overflow"  # finite values became inf/NaN: never equal, whatever the tolerance
            return res
    if atol is not None or rtol is not None:
        bound = (atol or 0.0) + (rtol or 0.0) * a.double().abs()
        if bool((diff <= bound).all()):
            res.status = "within_tolerance"
        return res
    if a.dtype != b.dtype:
        narrow = a.dtype if a.element_size() < b.element_size() else b.dtype
        if bits_equal(a.to(narrow), b.to(narrow)):
            res.status = "equal_after_cast"
    return res


def config_differences(sa: Source, sb: Source) -> list[dict]:
    """Differences between the two canonical configs (what the models compute, whatever the spelling). The
    architecture name alone is not one: a Mistral without a window computes what a Llama does."""
    return [{"key": field, "a": a, "b": b} for field, a, b in differences(sa.model.meaning, sb.model.meaning)
            if field != "architecture"]


def verify(a: str, b: str, *, atol: float | None = None, rtol: float | None = None,
           vocab_size: int | None = None, architecture: str | None = None, mapping: str | None = None
           ) -> VerifyReport:
    """Compare checkpoints ``a`` and ``b`` (any layouts, any degrees) tensor by tensor."""
    opts = Options(vocab_size=vocab_size, architecture=architecture, mapping=mapping)
    with open_source(a, opts) as sa, open_source(b, opts) as sb:
        report = VerifyReport(a, b, sa.layout, sb.layout)
        report.config_differences = config_differences(sa, sb)
        ia = CanonicalIndex(sa.stored, {n: t.shape for n, t in sa.model.tensors.items()})
        ib = CanonicalIndex(sb.stored, {n: t.shape for n, t in sb.model.tensors.items()})
        for name in sa.model.tensors:
            if name not in sb.model.tensors:
                report.tensors.append(TensorResult(name, "missing_in_b", sa.model.dtypes[name]))
                continue
            ta, tb = canonical_tensor(sa, ia, name), canonical_tensor(sb, ib, name)
            report.tensors.append(compare_tensors(name, ta, tb, atol, rtol))
            del ta, tb
        for name in sb.model.tensors:
            if name not in sa.model.tensors:
                report.tensors.append(TensorResult(name, "missing_in_a", None, sb.model.dtypes[name]))
        for source, index in ((sa, ia), (sb, ib)):  # every stored copy counts, not only the one read above
            report.replica_differences += run_replica_checks(index.checks, source.files,
                                                             [f.path for f in source.files])
    return report
