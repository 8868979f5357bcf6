"""Conversion: open the source, plan every target byte, check replicas, stream, then publish atomically."""

from __future__ import annotations

import os
import shutil
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field

from reshard.core.model_config import SEMANTIC_FIELDS, UNCARRIED_SETTINGS
from reshard.core.plan import CanonicalIndex, Plan, TargetFile, plan_tensor
from reshard.errors import OutputError, PlanError, ReshardError, os_error_message
from reshard.distributed import ProgressRelay, World, log_prefix, world_size_from_env
from reshard.execute import execute, partition, run_units
from reshard.replicas import ensure_replicas_agree
from reshard.io import dtypes
from reshard.hub import open_source
from reshard.layouts.vision import drop_unheld, refuse_multimodal
from reshard.layouts import ernie_rules
from reshard.layouts.base import SOURCE_OPTIONS, Options, Source, escapes_source, stored_dtype
from reshard.layouts.registry import get_layout, refuse_unused_options
from reshard.side_files import prune_auto_map
from reshard.staging import check_destination, scratch_in, staged_output


@dataclass
class ConvertResult:
    """What a conversion did (or, ``written`` False, would do): its ``plan``, the ``output`` folder, ``notes``;
    its ``repr`` is one line (the plan lists every tensor: ``describe_plan`` for that)."""

    plan: Plan
    output: str | None
    written: bool
    notes: list[str] = field(default_factory=list)
    download: dict | None = None  # hf:// plans: {"files", "bytes"} a conversion would download
    layout: str | None = None  # the layout written (``megatron_format="torch_dist"`` gives torch_dist)
    pushed: object | None = None  # reshard.hub.push.Pushed, after ``push_to``
    workers: int | None = None  # processes that wrote the files (None: nothing written)
    workers_reason: str | None = None  # why that many (the automatic choice's limits, or "asked for")
    degrees: dict | None = None  # the target degrees asked for ({"tp": 2, "pp": 1, ...}: the Python API sets it)

    def __repr__(self) -> str:
        degrees = "".join(f", {k}={v}" for k, v in (self.degrees or {}).items())
        done = f"output={self.output!r}" if self.written else "written=False"
        return (f"ConvertResult({done}, layout={self.layout or self.plan.target_layout!r}{degrees}, "
                f"files={len(self.plan.files)}, bytes={self.plan.nbytes}, workers={self.workers}"
                + (f", notes={len(self.notes)}" if self.notes else "") + ")")


def output_dtype(source: Source, opts: Options) -> str:
    """The dtype the output is written in: --dtype, else the source's (its embedding's) dtype."""
    if opts.dtype:
        return opts.dtype
    model = source.model
    return model.dtypes[next(iter(model.tensors))]


def make_plan(source: Source, to: str, opts: Options) -> tuple[Plan, object]:
    """Plan a conversion to layout ``to``; raises PlanError for impossible requests (nothing is written).
    Returns the plan and the target layout's own state for its ``finalize``."""
    layout = get_layout(to)
    if not layout.writes:
        raise PlanError(f"the {to} layout is read-only: it cannot be a --to target")
    _refuse_unread_options(source, opts)
    refuse_multimodal(source.model, to)
    dropped_notes = _drop_mtp(source, layout, opts) + drop_unheld(source, to, opts)
    dropped_notes += ernie_rules.drop_for_target(source, to, opts)  # section 17: Megatron without a softmax bias
    model = source.model
    dtype = output_dtype(source, opts)
    target = layout.targets(source, opts, dtype)
    specs = target.files
    index = CanonicalIndex(source.stored, {name: t.shape for name, t in model.tensors.items()})
    files = []
    for spec in specs:
        tensors = []
        for stored in spec.tensors:
            tensors.append(plan_tensor(index, stored, stored_dtype(model, stored, opts, dtype)))
        files.append(TargetFile(spec.path, spec.format, tensors, payload=spec.payload, metadata=spec.metadata,
                                rank=spec.rank))
    notes = list(source.info.get("notes", ())) + dropped_notes + target.notes
    dropped = source.info.get("dropped")
    if dropped:
        notes.append(f"dropping non-model state from the source: {', '.join(dropped)}")
    plan = Plan(source_layout=source.layout, target_layout=to, source_files=[f.path for f in source.files],
                files=files, checks=index.checks, notes=notes, source_root=source.root)
    plan.count_read_bytes(source.row_bytes, source.byte_shares)
    return plan, target.state


def _refuse_unread_options(source: Source, opts: Options) -> None:
    """Refuse a source option (``SOURCE_OPTIONS``) that the source's layout does not read, naming the layouts
    that do: ``--master-weights`` on a Hugging Face folder would otherwise be silently ignored."""
    from reshard.layouts.registry import layout_names

    reads = get_layout(source.layout).reads_options | set(source.info.get("read_options", ()))
    for option, (flag, unset) in SOURCE_OPTIONS.items():
        if getattr(opts, option) != unset and option not in reads:
            users = [n for n in layout_names() if option in get_layout(n).reads_options]
            raise PlanError(f"{flag} does not apply to a {source.layout} source: it is for "
                            f"{' and '.join(users) or 'no'} checkpoints; drop it")


def _drop_mtp(source: Source, layout, opts: Options) -> list[str]:
    """Leave the source's multi-token-prediction layers out (``--drop-mtp``, or a target without them: vLLM's
    main model) and say so; the output's config then declares none."""
    model = source.model
    if not model.mtp_layers or (layout.holds_mtp and not opts.drop_mtp):
        return []
    count = source.drop_mtp()
    why = "--drop-mtp" if opts.drop_mtp else f"the {layout.name} layout holds the main model only"
    return [f"dropped {count} MTP (multi-token prediction) layer(s) ({why}); the output declares 0"]


def _warn(message: str) -> None:
    sys.stderr.write(f"{log_prefix()}warning: {message}\n")  # one write: torchrun's ranks share the stream


def write_side_files(source: Source, staging: str, plan: Plan, state: object, follow_symlinks: bool) -> None:
    """Copy the side files (tokenizer, generation config, remote code: :mod:`reshard.side_files`), let the target
    layout write its own (last), then drop an ``auto_map`` from the written config.json that names code the output
    lacks, with a note in ``plan.notes``. A side file that is a symlink out of the source
    (:func:`escapes_source`) is skipped with a warning unless ``follow_symlinks``: the output, which ``--push-to``
    uploads, holds no file from elsewhere. An OS error copying one (ELOOP) is an OutputError, as a weight's."""
    for path in source.side_files:
        if not follow_symlinks and escapes_source(path, source.root):
            _warn(f"skipped {path}: a symlink to {os.path.realpath(path)}, outside the source (pass "
                  "--follow-symlinks to copy it)")
            continue
        try:
            shutil.copy2(path, os.path.join(staging, os.path.basename(path)))
        except OSError as exc:
            raise OutputError(os_error_message(exc, path)) from exc
    get_layout(plan.target_layout).finalize(staging, source, plan, state)
    note = prune_auto_map(staging)
    if note:
        plan.notes.append(note)


#: Below this many output bytes a second process costs more than it saves.
AUTO_WORKERS_MIN_BYTES = 256 << 20


def auto_workers(plan: Plan) -> tuple[int, str]:
    """(processes, why) for a conversion: one per core up to 8, one per GiB of memory available, one per
    ``AUTO_WORKERS_MIN_BYTES`` written (:func:`reshard.machine.choose_workers`)."""
    from reshard.machine import choose_workers

    return choose_workers(plan.nbytes, AUTO_WORKERS_MIN_BYTES)


def processes_used(plan: Plan, files, workers: int) -> int:
    """How many processes ``execute`` runs for ``workers`` (fewer where the plan has fewer units to split)."""
    if workers <= 1:
        return 1
    from reshard.execute import partition

    return max(1, len(partition(plan, files, workers, split_files=True)))


def convert(src: str, dst: str, *, to: str, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
            expert_parallel: bool = False, moe_grouped_gemm: bool = False, dtype: str | None = None,
            overwrite: bool = False, dry_run: bool = False, megatron_spec: str | None = None,
            max_shard_size: int | None = None, vocab_size: int | None = None, vocab_divisor: int | None = None,
            architecture: str | None = None, mapping: str | None = None, allow_replica_mismatch: bool = False,
            progress: bool = False, workers: int | None = 1, allow_lossy_config: tuple[str, ...] = (),
            allow_cast_overflow: bool = False, distributed: bool | None = None,
            follow_symlinks: bool = False, keep_fp8: bool = False, drop_mtp: bool = False,
            config: str | None = None, tag: str | None = None, master_weights: bool = False,
            maxtext_model: str | None = None, scan_layers: bool = True, maxtext_match_converter: bool = False,
            maxtext_vocab_size: int | None = None,
            torchtitan_names: str = "current", hf_spelling: str = "hub", megatron_vision: str | None = None,
            vllm_vision: str = "weights", allow_missing: tuple[str, ...] = (),
            max_seq: int | None = None) -> ConvertResult:
    """Convert checkpoint ``src`` to layout ``to`` at degrees ``tp`` x ``pp`` in folder ``dst`` (a Megatron
    Mixture of Experts also at expert-parallel ``ep`` and expert-tensor-parallel ``etp``, default ``tp``; a vLLM
    one with ``expert_parallel``: whole experts split over the ranks).

    ``megatron_spec`` (default ``te``), ``max_shard_size`` (default 5 GB) and the expert options apply to the
    targets that write with them; given to another target, they are refused (:func:`refuse_unused_options`).
    Everything that can be refused is refused before a byte is written; the output appears only when complete.
    ``workers`` > 1 splits the target files over that many processes; the output bytes are the same. ``None`` (the
    default, as on the command line) chooses from the cores, the memory and the bytes (:func:`auto_workers`); the
    result's ``workers`` and ``workers_reason`` say what ran. ``allow_lossy_config`` names canonical config fields
    the target may drop (else a field it cannot express is refused); ``allow_cast_overflow`` lets a ``dtype``
    cast turn finite values into inf (else refused). ``distributed``: split the files over the torchrun world
    this process belongs to (:mod:`reshard.distributed`); ``None`` does so when torchrun started 2 or more
    processes (``WORLD_SIZE``), ignoring ``workers``. ``follow_symlinks``: copy side files (tokenizer, ...) that
    are symlinks out of the source too (else skipped with a warning). ``keep_fp8`` (``to="hf"`` only): a block-FP8
    source's fp8 weights and scales are copied as they are instead of dequantised (:mod:`reshard.io.fp8`).
    ``drop_mtp``: leave multi-token-prediction layers out (a target that cannot hold them drops them anyway).
    ``config`` (a config.json for a source that saves none), ``tag`` and ``master_weights`` (DeepSpeed) say how to
    read the source; ``torchtitan_names`` (``to="torchtitan"``): ``"current"`` or ``"v0.2"`` parameter names.
    Vision-language models: ``hf_spelling``, ``megatron_vision``, ``vllm_vision`` and ``allow_missing``
    (reshard/layouts/vision.py, hf_spelling.py). ``max_seq``: the longest sequence a Megatron target must compute
    as the source does (Llama 4's chunked attention / temperature tuning, families-2.md section 17).
    """
    unknown_missing = sorted(set(allow_missing) - {"vision"})
    if unknown_missing:
        raise PlanError(f"--allow-missing {unknown_missing[0]}: the only thing an output may be written without is "
                        "vision (tower tensors the source lacks)")
    allow_lossy_config = tuple(f.strip() for a in allow_lossy_config for f in a.split(",") if f.strip())
    unknown = sorted(set(allow_lossy_config) - set(SEMANTIC_FIELDS) - set(UNCARRIED_SETTINGS))
    if unknown:
        raise PlanError(f"--allow-lossy-config {unknown[0]}: not a canonical config field (fields: "
                        f"{', '.join(SEMANTIC_FIELDS)}) nor a setting reshard does not carry (settings: "
                        f"{', '.join(UNCARRIED_SETTINGS)})")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise PlanError(f"workers must be a whole number of at least 1, or None to choose (got {workers!r})")
    refuse_unused_options(to, {"ep": ep, "etp": etp, "expert_parallel": expert_parallel,
                               "moe_grouped_gemm": moe_grouped_gemm, "megatron_spec": megatron_spec,
                               "vocab_divisor": vocab_divisor, "max_shard_size": max_shard_size,
                               "keep_fp8": keep_fp8, "torchtitan_names": torchtitan_names,
                               "scan_layers": scan_layers, "maxtext_match_converter": maxtext_match_converter,
                               "maxtext_vocab_size": maxtext_vocab_size,
                               "hf_spelling": hf_spelling, "megatron_vision": megatron_vision,
                               "vllm_vision": vllm_vision, "max_seq": max_seq})
    if torchtitan_names not in ("current", "v0.2"):
        raise PlanError(f"--torchtitan-names {torchtitan_names}: use current or v0.2")
    opts = Options(tp=tp, pp=pp, ep=ep, etp=etp, expert_parallel=expert_parallel, moe_grouped_gemm=moe_grouped_gemm,
                   dtype=dtypes.parse_user_dtype(dtype), megatron_spec=megatron_spec or Options.megatron_spec,
                   max_shard_size=Options.max_shard_size if max_shard_size is None else max_shard_size,
                   vocab_size=vocab_size, vocab_divisor=vocab_divisor, architecture=architecture, mapping=mapping,
                   allow_replica_mismatch=allow_replica_mismatch, allow_lossy_config=tuple(allow_lossy_config),
                   follow_symlinks=follow_symlinks, keep_fp8=keep_fp8, drop_mtp=drop_mtp, config=config, tag=tag,
                   master_weights=master_weights, torchtitan_names=torchtitan_names, hf_spelling=hf_spelling,
                   maxtext_model=maxtext_model, scan_layers=scan_layers,
                   maxtext_match_converter=maxtext_match_converter, maxtext_vocab_size=maxtext_vocab_size,
                   megatron_vision=megatron_vision, vllm_vision=vllm_vision, allow_missing=tuple(allow_missing),
                   max_seq=max_seq)
    world = None if dry_run or not distributed_run(distributed) else World.join()
    if world is not None:
        try:
            plan = convert_in_world(world, src, to, opts, dst, overwrite, progress, allow_cast_overflow)
        finally:
            world.close()
        return ConvertResult(plan, dst, True, plan.notes)
    with open_source(src, opts, need_weights=not dry_run) as source:
        plan, state = make_plan(source, to, opts)
        plan.allow_cast_overflow = allow_cast_overflow
        if dry_run:
            return ConvertResult(plan, None, False, plan.notes, source.info.get("download"))
        used, reason = convert_here(source, plan, state, dst, overwrite, progress, workers, opts)
    return ConvertResult(plan, dst, True, plan.notes, workers=used, workers_reason=reason)


def distributed_run(choice: bool | None) -> bool:
    """Whether to convert over the torchrun world: ``choice``, else when torchrun started 2 or more processes."""
    if choice is not None:
        return choice
    return world_size_from_env() > 1


def convert_here(source: Source, plan: Plan, state, dst: str, overwrite: bool, progress: bool,
                 workers: int | None, opts: Options) -> tuple[int, str]:
    """Check, stage, write (in this process or ``workers`` forked ones; None: :func:`auto_workers`) and publish;
    returns (processes that wrote, why that many)."""
    check_destination(source.root, dst, overwrite)
    ensure_replicas_agree(plan, source.files, opts.allow_replica_mismatch, _warn)
    if workers is None:
        workers, reason = auto_workers(plan)
    else:
        reason = f"{workers} process{'es' if workers > 1 else ''} asked for"
    if not all(getattr(f, "fork_safe", True) for f in source.files):  # TensorStore (maxtext) aborts in a fork
        workers, reason = 1, "1 process: the source is read through TensorStore, which does not survive fork()"
    used = processes_used(plan, source.files, workers)
    if used < workers:
        reason += f"; {used} used (the output has {used} part{'s' if used > 1 else ''} to split)"
    with staged_output(source.root, dst, overwrite) as staging:  # lock, stage, publish by rename (staging.py)
        with scratch_in(source.files, staging):  # a source's scratch (maxtext's unstack pass) on the output's disk
            execute(plan, source.files, staging, progress=progress, workers=workers)
        finish_output(source, staging, plan, state, opts)
    return used, reason


def finish_output(source: Source, staging: str, plan: Plan, state, opts: Options) -> None:
    """The side files, the target layout's records and the Hub provenance, into the finished staging folder."""
    write_side_files(source, staging, plan, state, opts.follow_symlinks)
    if "hub" in source.info:  # provenance for `reshard push`
        from reshard.hub.manifest import write_manifest

        write_manifest(staging, {"source": source.info["hub"]})


def convert_in_world(world: World, src: str, to: str, opts: Options, dst: str, overwrite: bool,
                     progress: bool, allow_cast_overflow: bool) -> Plan:
    """One rank's part of a distributed conversion (see :mod:`reshard.distributed`): open and plan, agree on rank
    0's staging folder, write this rank's share of the files, agree, and rank 0 finishes and publishes. An error
    anywhere, opening the source included, is agreed on, so no rank waits for one that gave up."""
    from reshard.progress import byte_bar

    leader = world.rank == 0
    source = plan = state = None
    with ExitStack() as stack:
        def ready() -> str:
            nonlocal source, plan, state
            source = stack.enter_context(open_source(src, opts))
            plan, state = make_plan(source, to, opts)
            plan.allow_cast_overflow = allow_cast_overflow
            if not leader:
                return ""
            check_destination(source.root, dst, overwrite)
            ensure_replicas_agree(plan, source.files, opts.allow_replica_mismatch, _warn)
            return stack.enter_context(staged_output(source.root, dst, overwrite))

        staging = world.step(ready)[0].text

        def write() -> None:
            shares = partition(plan, source.files, world.size)
            share = shares[world.rank] if world.rank < len(shares) else []
            with byte_bar(plan.nbytes, "converting", disable=not (progress and leader)) as bar:
                relay = ProgressRelay(world, bar if leader else None)
                try:
                    run_units(plan, source.files, staging, share, relay)
                except OSError as exc:  # as staged_output reports it in a single process
                    raise OutputError(os_error_message(exc, f"converting {src} into {dst}")) from exc
                finally:
                    relay.close()

        world.step(write)
        world.step(lambda: finish_output(source, staging, plan, state, opts) if leader else None)
        world.step(stack.close if leader else lambda: None)  # rank 0 publishes; every rank learns whether it did
    return plan


__all__ = ["convert", "make_plan", "ConvertResult", "ReshardError"]
