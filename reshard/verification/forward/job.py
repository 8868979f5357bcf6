"""What every process of a forward check does: run A, then B, each on the first ``degree`` ranks of the world,
each rank loading only its own shard; rank 0 then compares and builds the report.

A side whose degree is 1 runs on rank 0 alone without collectives; a side with ``1 < degree < world`` runs on a
process group of ranks ``0..degree-1`` (created by every rank, in the same order).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from reshard.layouts.base import Options, import_string
from reshard.layouts.registry import get_layout
from reshard.progress import step_progress
from reshard.verification.forward import decoder, report
from reshard.verification.forward.streamed import forward_streamed

COMPUTE_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp64": torch.float64,
                  "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                  "float16": torch.float16}


@dataclass
class Side:
    """One checkpoint of the check: run at ``degree`` ranks; ``own_tp``: its layout's own TP degree (the
    report's ``tp``), when it differs; ``pp``: its own pipeline degree (the ranks run every stage's layers in
    turn); ``run``: how it is read, in words (the report's ``run``)."""

    path: str
    layout: str
    degree: int
    own_tp: int | None = None
    run: str = ""
    pp: int = 1

    def describe(self, seen: dict) -> dict:
        """The report's entry for this side, from rank 0's ``seen`` (dtype, padded vocab, files)."""
        out = {"path": self.path, "layout": self.layout, "tp": self.degree if self.own_tp is None else self.own_tp,
               "dtype": _name(seen["dtype"]), "padded_vocab": seen["padded_vocab"], "rank0_files": seen["files_rank0"],
               "pp": self.pp, "run_tp": self.degree}
        if self.run:
            out["run"] = self.run
        return out


@dataclass
class ForwardJob:
    """Everything a worker needs (plain data: it is pickled to the worker processes)."""

    a: Side
    b: Side
    input_ids: list[list[int]]
    vocab: int
    opts: Options = field(default_factory=Options)
    compute_dtype: str = "fp32"
    backend: str = "gloo"
    atol: float | None = None
    rtol: float | None = None
    timeout: float = 300.0
    progress: bool = False  # rank 0 shows each layer run on stderr, when it is a terminal
    tensors: dict[str, str] = field(default_factory=dict)  # step ("layer 2 attention") -> B's tensors in it

    @property
    def world(self) -> int:
        return max(self.a.degree, self.b.degree)


def device_for(backend: str, rank: int):
    """NCCL: ``cuda:<local rank>`` (LOCAL_RANK under torchrun, else the rank); gloo: CPU."""
    if backend == "nccl":
        import os

        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def open_rank_stream(layout: str, path: str, rank: int, world: int, opts: Options, metered: bool = False):
    """The layout's :class:`~.rank_stream.RankStream` for rank ``rank`` of ``world`` (headers read only)."""
    return import_string(get_layout(layout).rank_loader)(path, rank, world, opts, metered=metered)


def _groups(degrees: set[int], world: int) -> dict[int, decoder.TPGroup]:
    groups = {}
    for k in sorted(degrees):
        if k == 1:
            groups[k] = decoder.TPGroup()
        elif k == world:
            groups[k] = decoder.TPGroup(k, None)
        else:
            groups[k] = decoder.TPGroup(k, dist.new_group(list(range(k))))
    return groups


def run_job(job: ForwardJob, rank: int, world: int) -> dict | None:
    """Run both sides; rank 0 returns the report dict, other ranks None."""
    device = device_for(job.backend, rank)
    compute = COMPUTE_DTYPES[job.compute_dtype]
    ids = torch.tensor(job.input_ids, dtype=torch.long, device=device)
    groups = _groups({job.a.degree, job.b.degree}, world)
    runs = {}
    findings: dict = {"problems": [], "copies": []}  # this rank's, per side: gathered on rank 0
    for label, side in (("a", job.a), ("b", job.b)):
        if rank >= side.degree:
            continue
        with open_rank_stream(side.layout, side.path, rank, side.degree, job.opts) as stream, torch.no_grad():
            shown = step_progress(f"forward: {label.upper()}", rank, side.degree) if job.progress else None
            out, stored = forward_streamed(stream, ids, groups[side.degree], compute, device, record=rank == 0,
                                           progress=shown)
            info = {"world": side.degree, "padded_vocab": stream.padded_vocab, "dtype": stored,
                    "files_rank0": stream.files, "vocab": stream.config.vocab}
            findings["problems"] += [f"{label.upper()}: {p}" for p in stream.problems]
            findings["copies"] += [{**c, "key": f"{label.upper()}: {c['key']}"} for c in stream.copies]
        gc.collect()
        if rank == 0:
            runs[label] = {**info, "logits": out.logits, "states": out.states}
    every = [findings]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, findings)
    if rank != 0:
        return None
    a, b = runs["a"], runs["b"]
    tol = report.tolerance(a["dtype"], b["dtype"], compute, job.atol, job.rtol)
    result = {
        "a": job.a.describe(a), "b": job.b.describe(b),
        "backend": job.backend, "compute_dtype": _name(compute), "batch": len(job.input_ids),
        "seq_len": len(job.input_ids[0]), "vocab": job.vocab, "tolerance": tol,
    }
    problems = [p for f in every for p in f["problems"]]
    problems += report.copy_problems([c for f in every for c in f["copies"]])
    result.update(report.compare(a, b, job.vocab, tol, problems, job.tensors))
    return result


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
