"""Digest verification: stream both checkpoints' canonical views and compare every tensor.

Every canonical tensor of A and of B is read in the same row blocks of at most ``block_bytes`` per side
(:mod:`reshard.verification.block_stream`): positioned reads, read-ahead, SHA-256 of each side's canonical bytes
updated in row-major order (the digest of the whole tensor), error figures per block where they mean something
(:mod:`reshard.verification.compare`). Every stored copy of a replicated tensor is compared with the copy read,
streamed the same way. ``workers > 1`` shares the tensors out to forked processes, each claiming the next batch
(largest first) when it is free; ``workers=None`` chooses the count (:func:`choose_verify_workers`). Memory is
bounded by the blocks, never by a tensor, a rank or the model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from reshard.layouts.vision import absent_tensors, without
from reshard.layouts import ernie_rules
from reshard.core.model_config import differences
from reshard.core.plan import CanonicalIndex, TargetTensor
from reshard.hub import open_source
from reshard.io import mamba_values
from reshard.layouts.base import Options, Source
from reshard.results import Report
from reshard.verification.block_stream import BLOCK_BYTES, PairTask, replica_problem, replica_tasks
from reshard.verification.compare import BlockComparison, TensorResult

__all__ = ["TensorResult", "VerifyReport", "format_report", "verify", "verify_dry_run", "verify_sources"]


@dataclass
class VerifyReport(Report):
    """The digest check's report: ``.equal``, ``.report`` / ``to_dict()`` (what ``--json`` prints),
    ``.to_json()``, ``describe()`` (what the command prints)."""

    a: str
    b: str
    layout_a: str
    layout_b: str
    tensors: list[TensorResult] = field(default_factory=list)
    config_differences: list[dict] = field(default_factory=list)
    replica_differences: list[str] = field(default_factory=list)  # copies of a replicated tensor that disagree
    replicas_checked: int = 0  # stored copies of replicated tensors compared with the copy read
    workers: int = 1  # processes that compared
    workers_reason: str = ""  # why that many (the automatic choice's limits, or "asked for")
    architecture_a: str | None = None  # the class each config names (a difference alone is not one in meaning)
    architecture_b: str | None = None

    @property
    def equal(self) -> bool:
        return not self.config_differences and not self.replica_differences and all(t.ok for t in self.tensors)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["equal"] = self.equal
        d["summary"] = {s: sum(t.status == s for t in self.tensors) for s in sorted({t.status for t in self.tensors})}
        d["checked"] = checked_lines(self)
        for t in d["tensors"]:  # shapes only where they differ
            for key in ("shape_a", "shape_b"):
                if t[key] is None:
                    del t[key]
        return d

    def describe(self) -> str:
        return format_report(self)

    def __repr__(self) -> str:
        bad = sum(not t.ok for t in self.tensors)
        return (f"VerifyReport(equal={self.equal}, a={self.a!r}, b={self.b!r}, tensors={len(self.tensors)}, "
                f"differing={bad}, config_differences={len(self.config_differences)}, workers={self.workers})")

    def first_shape_difference(self) -> str | None:
        """``model.embed_tokens.weight: [32000, 4096] in A, [32064, 4096] in B``, the first tensor whose shapes
        differ; None where none does."""
        t = next((t for t in self.tensors if t.shape_a is not None), None)
        return None if t is None else f"{t.name}: {t.shape_a} in A, {t.shape_b} in B"


def canonical_target(source: Source, index: CanonicalIndex, name: str) -> TargetTensor:
    """Canonical tensor ``name`` of ``source`` as a plan of reads (its stored dtype, nothing read yet)."""
    t = source.model.tensors[name]
    return TargetTensor(name, t.shape, source.model.dtypes[name], t.axis, index.reads_for(name, 0, t.shape[t.axis], 0))


def config_differences(sa: Source, sb: Source) -> list[dict]:
    """Differences between the two canonical configs (what the models compute, whatever the spelling). The
    architecture name alone is not one: a Mistral without a window computes what a Llama does."""
    return [{"key": field, "a": a, "b": b} for field, a, b in differences(sa.model.meaning, sb.model.meaning)
            if field != "architecture"]


@dataclass
class VerifyWork:
    """What a digest verify reads: the tensor pairs (A's canonical order), the replica checks of both sides,
    and the results known without reading (missing tensors, shapes that differ), by position."""

    tasks: list[PairTask]
    known: dict[int, TensorResult]
    count: int  # tensor results in all (tasks first fill the positions ``known`` leaves)
    replica_checks: list  # (ReplicaCheck, source file names) per replica task, after the tensor tasks


def plan_work(sa: Source, sb: Source, atol: float | None, rtol: float | None) -> VerifyWork:
    ia = CanonicalIndex(sa.stored, {n: t.shape for n, t in sa.model.tensors.items()})
    ib = CanonicalIndex(sb.stored, {n: t.shape for n, t in sb.model.tensors.items()})
    tasks, known, position = [], {}, 0
    for name in sa.model.tensors:
        if name not in sb.model.tensors:
            known[position] = TensorResult(name, "missing_in_b", sa.model.dtypes[name])
        elif sa.model.tensors[name].shape != sb.model.tensors[name].shape:
            known[position] = TensorResult(name, "different", sa.model.dtypes[name], sb.model.dtypes[name],
                                           shape_a=list(sa.model.tensors[name].shape),
                                           shape_b=list(sb.model.tensors[name].shape))
        else:
            ta, tb = mamba_values.as_stored(canonical_target(sa, ia, name), canonical_target(sb, ib, name))
            tasks.append(PairTask(ta, tb, sa.files, sb.files, BlockComparison(name, ta.dtype, tb.dtype, atol, rtol)))
        position += 1
    for name in sb.model.tensors:
        if name not in sa.model.tensors:
            known[position] = TensorResult(name, "missing_in_a", None, sb.model.dtypes[name])
            position += 1
    checks = []
    for source, index in ((sa, ia), (sb, ib)):  # every stored copy counts, not only the one read
        tasks += replica_tasks(index.checks, source.files)
        names = [f.path for f in source.files]
        checks += [(check, names) for check in index.checks]
    return VerifyWork(tasks, known, position, checks)


def verify(a: str, b: str, *, atol: float | None = None, rtol: float | None = None,
           vocab_size: int | None = None, architecture: str | None = None, mapping: str | None = None,
           workers: int | None = None, progress: bool = False, block_bytes: int = BLOCK_BYTES,
           drop_mtp: bool = False, **reading) -> VerifyReport:
    """Compare checkpoints ``a`` and ``b`` (any layouts, any degrees) tensor by tensor, streaming: bit-exact by
    SHA-256 where dtypes agree; after a cast, or within ``atol`` / ``rtol``, where they differ. ``drop_mtp``:
    compare the main models only (a conversion to vLLM, which holds no MTP layers). ``source``: other
    source-reading :class:`Options` fields (``config``, ``tag``, ``master_weights``)."""
    opts = Options(vocab_size=vocab_size, architecture=architecture, mapping=mapping, **reading)
    with open_source(a, opts) as sa, open_source(b, opts) as sb:
        if drop_mtp:
            sa.drop_mtp(), sb.drop_mtp()
        return verify_sources(sa, sb, a, b, atol=atol, rtol=rtol, workers=workers, progress=progress,
                              block_bytes=block_bytes)


def verify_sources(sa: Source, sb: Source, a: str, b: str, *, atol: float | None = None, rtol: float | None = None,
                   workers: int | None = None, progress: bool = False, block_bytes: int = BLOCK_BYTES
                   ) -> VerifyReport:
    """:func:`verify` of two opened sources."""
    from reshard.verification.digest_run import processes_for, run_tasks

    report = VerifyReport(a, b, sa.layout, sb.layout, architecture_a=sa.model.meaning.architecture,
                          architecture_b=sb.model.meaning.architecture)
    ernie_rules.align_zero_bias(sa, sb)  # Megatron holds no all-zero Ernie 4.5 selection bias
    report.config_differences = config_differences(sa, sb)
    for source in (sa, sb):  # tower tensors a source does not hold (vLLM's LLaVA): reported missing on its side
        absent = set(absent_tensors(source))
        if absent:
            source.model = without(source.model, absent)
    work = plan_work(sa, sb, atol, rtol)
    workers, report.workers_reason = choose_verify_workers(work.tasks, workers)
    report.workers = processes_for(work.tasks, workers)
    if report.workers < workers:
        report.workers_reason += f"; {report.workers} used (tensor pairs to share: {len(work.tasks)})"
    results = run_tasks(work.tasks, sa.files + sb.files, workers, progress, block_bytes)
    tensor_results = iter(results[:len(work.tasks) - len(work.replica_checks)])
    report.tensors = [work.known[i] if i in work.known else next(tensor_results) for i in range(work.count)]
    replica_results = results[len(work.tasks) - len(work.replica_checks):]
    report.replicas_checked = len(replica_results)
    for (check, names), result in zip(work.replica_checks, replica_results):
        problem = replica_problem(check, result, names)
        if problem is not None:
            report.replica_differences.append(problem)
    return report


def choose_verify_workers(tasks, workers: int | None) -> tuple[int, str]:
    """(processes, why): ``workers`` as asked, or, for None, one per 2 cores up to 8, one per GiB of memory
    available, one per :data:`VERIFY_MIN_BYTES` to read (:func:`reshard.machine.choose_workers`)."""
    if workers is not None:
        return workers, f"{workers} process{'es' if workers > 1 else ''} asked for"
    from reshard.machine import choose_workers

    return choose_workers(sum(t.nbytes for t in tasks), VERIFY_MIN_BYTES, cores_per_process=2)


#: Below this many bytes to read per process, another process costs more than it saves.
VERIFY_MIN_BYTES = 256 << 20


def verify_dry_run(a: str, b: str, *, vocab_size: int | None = None, architecture: str | None = None,
                   mapping: str | None = None, workers: int | None = None, block_bytes: int = BLOCK_BYTES,
                   drop_mtp: bool = False, **reading) -> dict:
    """What :func:`verify` would read, per process, and each process's peak-memory estimate; reads headers
    and configs only."""
    from reshard.verification.digest_run import estimate

    opts = Options(vocab_size=vocab_size, architecture=architecture, mapping=mapping, **reading)
    with open_source(a, opts) as sa, open_source(b, opts) as sb:
        if drop_mtp:
            sa.drop_mtp(), sb.drop_mtp()
        work = plan_work(sa, sb, None, None)
        workers, reason = choose_verify_workers(work.tasks, workers)
        return {"workers": workers, "workers_reason": reason, "a": a, "b": b, "layout_a": sa.layout, "layout_b": sb.layout, "tensors": work.count,
                "replica_checks": len(work.replica_checks), "block_bytes": block_bytes,
                "processes": estimate(work.tasks, sa.files, workers, block_bytes)}


_PHRASES = {"equal": "bit-identical (SHA-256)", "within_tolerance": "within tolerance", "different": "different",
            "missing_in_a": "missing in A", "missing_in_b": "missing in B"}


def checked_lines(report: VerifyReport) -> list[str]:
    """What the report checked, one phrase per outcome: ``39/39 tensors equal after a cast to BF16``."""
    total = len(report.tensors)
    groups: dict[str, int] = {}
    for t in report.tensors:
        if t.status in ("equal_after_cast", "cast_overflow"):
            narrow = min((t.dtype_a, t.dtype_b), key=_width)
            phrase = (f"equal after a cast to {narrow}" if t.status == "equal_after_cast"
                      else f"overflow in a cast to {narrow}")
        else:
            phrase = _PHRASES[t.status]
        groups[phrase] = groups.get(phrase, 0) + 1
    lines = [f"{n}/{total} tensors {phrase}" for phrase, n in groups.items()]
    if report.replicas_checked:
        bad = len(report.replica_differences)
        lines.append(f"{report.replicas_checked} stored replica{'s' if report.replicas_checked > 1 else ''} "
                     f"compared with the copy read: " + (f"{bad} differ{'s' if bad == 1 else ''}" if bad
                                                          else "all identical"))
    if report.config_differences:
        lines.append(f"{len(report.config_differences)} config setting"
                     f"{'s differ' if len(report.config_differences) > 1 else ' differs'}")
    return lines


def format_report(report: VerifyReport) -> str:
    """The report for people: the two checkpoints; what differs first (the architecture, the first shape); what
    was checked; each config, replica and tensor difference (20 at most of each); EQUAL or DIFFERENT."""
    lines = [f"A {report.layout_a} {report.a}", f"B {report.layout_b} {report.b}"]
    if report.architecture_a != report.architecture_b:
        lines.append(f"  architecture: {report.architecture_a} in A, {report.architecture_b} in B")
    shaped = [t for t in report.tensors if t.shape_a is not None]
    if shaped:
        more = f" (and {len(shaped) - 1} more)" if len(shaped) > 1 else ""
        lines.append(f"  shapes differ: {report.first_shape_difference()}{more}")
    lines += [f"  {line}" for line in checked_lines(report)]
    lines.append(f"  compared by {report.workers_reason}")
    lines += [f"  config {d['key']}: {d['a']} != {d['b']}" for d in report.config_differences]
    lines += [f"  {problem}" for problem in report.replica_differences[:20]]
    bad = [t for t in report.tensors if not t.ok]
    for t in bad[:20]:
        if t.shape_a is not None:
            extra = f" ({t.shape_a} in A, {t.shape_b} in B)"
        else:
            extra = f" (max abs {t.max_abs:g}, max rel {t.max_rel:g})" if t.max_abs is not None else ""
        lines.append(f"  {_PHRASES.get(t.status, t.status.replace('_', ' '))}: {t.name}{extra}")
    if len(bad) > 20:
        lines.append(f"  ... and {len(bad) - 20} more (--json lists all)")
    lines.append("EQUAL" if report.equal else "DIFFERENT")
    return "\n".join(lines)


def _width(dtype: str | None) -> int:
    from reshard.io.dtypes import itemsize

    return itemsize(dtype) if dtype else 0
