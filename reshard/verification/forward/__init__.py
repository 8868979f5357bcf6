"""Forward verification: run a reference tensor-parallel decoder on checkpoint B (each rank reading only its
own shard files, layer by layer) and on A (sliced at B's degree where its layout allows, else from its own rank
files), on the same token ids, and compare the logits.

``verify_forward(a, b, ...)`` returns a :class:`~reshard.results.ForwardReport` (``.equal``, ``.report``, dict
access: ``report["a"]["run"]`` says how A ran); see :mod:`.report` for tolerances. ``forward_estimate(a, b,
...)`` says, from headers alone, what each process will read and hold (``verify --forward --dry-run``).
"""

from __future__ import annotations

from reshard.results import ForwardReport
from reshard.verification.forward.estimate import forward_estimate
from reshard.verification.forward.launch import launch
from reshard.verification.forward.planning import plan_job, read_prompt_ids
from reshard.verification.forward.report import format_report

__all__ = ["verify_forward", "forward_estimate", "format_report", "read_prompt_ids", "ForwardReport"]


def verify_forward(a: str, b: str, *, nproc: int | None = None, backend: str | None = None, seq_len: int = 16,
                   batch: int = 2, seed: int = 0, prompt_ids: str | None = None, compute_dtype: str = "fp32",
                   atol: float | None = None, rtol: float | None = None, timeout: float = 300.0,
                   vocab_size: int | None = None, architecture: str | None = None,
                   mapping: str | None = None, progress: bool = False, **reading) -> ForwardReport:
    """Run the forward check of ``b`` (at ``nproc`` ranks, default its own degree) against ``a`` (sliced at the
    same degree where its layout allows, else at its own: :mod:`.planning`). ``progress``: rank 0 rewrites a
    line on stderr, when it is a terminal, as each layer of A and of B has run."""
    job, notes = plan_job(a, b, nproc=nproc, backend=backend, seq_len=seq_len, batch=batch, seed=seed,
                          prompt_ids=prompt_ids, compute_dtype=compute_dtype, atol=atol, rtol=rtol, timeout=timeout,
                          vocab_size=vocab_size, architecture=architecture, mapping=mapping, progress=progress,
                          **reading)
    result = launch(job)
    result["seed"] = None if prompt_ids else seed
    if notes:
        result.setdefault("notes", []).extend(notes)
    return ForwardReport(result)
