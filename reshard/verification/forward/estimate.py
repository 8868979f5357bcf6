"""What a forward check will read and hold, per process, from configs and headers alone (``verify --forward
--dry-run``).

Each side's rank streams are opened ``metered`` (:mod:`.rank_stream`): the same reading code runs on ``meta``
tensors, counting the bytes of every slice it would read. A process's peak memory is estimated as the largest of,
over its sides (A, then B) and consecutive steps k, k+1 (embedding, layers, head: :mod:`.streamed`):

* weights: step k's tensors in the compute dtype (plus a tied head's embedding rows, kept from the start), plus
  step k+1 being read and cast (all its stored tensors, then each replaced by its cast in turn: the largest sum
  along the way; the stored tensors alone when no cast is needed);
* activations: one layer's working set in the compute dtype, ``b*s*(6H + A + 4 F_local)`` elements with
  ``A = 8 q_local`` (q_local: the rank's query heads times head_dim), or for multi-head latent attention
  ``A = rq + rkv + dr + heads_local * (4 (dn + dr) + 2 (dn + dv) + 2 dv)`` (the gathered down projections, q, its
  RoPE part and the keys, kv_b's output, the values and the output), plus ``3 b*q_heads_local*s*s`` fp32 attention
  scores, and on rank 0 the hidden state after every block (kept for the
  report, A's while B runs);
* logits: ``3 b*s*Vp`` in the compute dtype on every rank (local, gathered pieces, joined), and on rank 0 A's
  logits kept while B runs plus ``8 b*s*Vp`` float64 for the comparison;
* a fixed baseline: :data:`BASELINE_BYTES`, the measured peak of a worker process running a tiny model.
"""

from __future__ import annotations

import torch

from reshard.verification.forward import streamed
from reshard.verification.forward.job import COMPUTE_DTYPES, ForwardJob, Side, open_rank_stream
from reshard.verification.forward.planning import plan_job

#: Peak RSS of a forward-check worker (forked from the forkserver, torch and reshard imported, gloo set up) on a
#: tiny model, measured on the development machine (CPU torch 2.13): the part no checkpoint adds.
BASELINE_BYTES = 200 << 20


def _nbytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    return t.numel() * (dtype or t.dtype).itemsize


def side_steps(side: Side, rank: int, job: ForwardJob) -> dict:
    """Read bytes and per-step memory of ``side`` on ``rank`` (metered: no tensor data is read)."""
    compute = COMPUTE_DTYPES[job.compute_dtype]
    with open_rank_stream(side.layout, side.path, rank, side.degree, job.opts, metered=True) as stream:
        steps, f_local = [], 0
        for name in streamed.steps(stream.config):
            weights = streamed.read_stored(stream, name)
            tensors = [t for _, t in streamed.named_tensors(name, weights)]
            held = sum(_nbytes(t, compute) for t in tensors)
            stored = sum(_nbytes(t) for t in tensors)
            reading = stored if all(t.dtype == compute for t in tensors) else _casting_peak(tensors, compute)
            steps.append({"step": name, "held": held, "reading": reading})
            if not isinstance(weights, tuple):
                f_local = max(f_local, _mlp_rows(weights))
        tied = steps[0]["held"] if stream.tied else 0
        config, padded = stream.config, stream.padded_vocab
        return {"read": stream.bytes_read, "steps": steps, "tied": tied, "config": config, "padded_vocab": padded,
                "mlp_rows": f_local}


def _casting_peak(tensors: list[torch.Tensor], compute: torch.dtype) -> int:
    """Largest memory while a step's stored tensors are cast one by one (:func:`.decoder.cast_layer`): those cast
    so far, the stored ones not yet cast, and the copy being made."""
    stored = [_nbytes(t) for t in tensors]
    cast = [_nbytes(t, compute) for t in tensors]
    return max(sum(cast[:j]) + sum(stored[j:]) + cast[j] for j in range(len(tensors))) if tensors else 0


def _weights_peak(steps: list[dict], tied: int) -> tuple[int, str]:
    """Largest (held step k + tied table + step k+1 being read), and where it happens."""
    best, where = 0, ""
    for k, step in enumerate(steps):
        held = step["held"] + (tied if k else 0)
        nxt = steps[k + 1]["reading"] if k + 1 < len(steps) else 0
        if held + nxt > best:
            best, where = held + nxt, step["step"] + (f" while {steps[k + 1]['step']} is read" if nxt else "")
    first = steps[0]["reading"]
    return (first, f"reading {steps[0]['step']}") if first > best else (best, where)


def _mlp_rows(layer) -> int:
    """A layer's local MLP width: its up rows, plus the shared expert's and one routed expert's."""
    rows = sum(t.shape[0] for t in (layer.up, layer.shared_up) if t is not None)
    return rows + max((parts[1].shape[0] for parts in layer.experts.values()), default=0)


def _activations(config, world: int, batch: int, seq: int, itemsize: int, f_local: int) -> int:
    q_heads = config.heads // world
    if config.mla:
        dq, dkv, dv = config.head_dim + config.rope_head_dim, config.head_dim + config.v_head_dim, config.v_head_dim
        attention = (config.q_lora_rank + config.kv_lora_rank + config.rope_head_dim
                     + q_heads * (4 * dq + 2 * dkv + 2 * dv))
    else:
        attention = 8 * q_heads * config.head_dim
    return (batch * seq * (6 * config.hidden + attention + 4 * f_local) * itemsize
            + 3 * batch * q_heads * seq * seq * 4)


def forward_estimate(a: str, b: str, *, nproc: int | None = None, backend: str | None = None, seq_len: int = 16,
                     batch: int = 2, seed: int = 0, prompt_ids: str | None = None, compute_dtype: str = "fp32",
                     atol: float | None = None, rtol: float | None = None, timeout: float = 300.0,
                     vocab_size: int | None = None, architecture: str | None = None,
                     mapping: str | None = None, **reading) -> dict:
    """Per process (rank) of ``verify_forward(a, b, ...)`` with the same options: the bytes it will read from A
    (``read_a``) and from B (``read_b``) and its peak-memory estimate (``peak_estimate``, with its parts), reading
    headers and configs only. Keys: ``a`` / ``b`` (paths), ``layout_a`` / ``layout_b``, ``lines`` (how A runs,
    compute dtype, baseline), ``processes`` (one dict per rank, in rank order)."""
    job, _ = plan_job(a, b, nproc=nproc, backend=backend, seq_len=seq_len, batch=batch, seed=seed,
                      prompt_ids=prompt_ids, compute_dtype=compute_dtype, atol=atol, rtol=rtol, timeout=timeout,
                      vocab_size=vocab_size, architecture=architecture, mapping=mapping, **reading)
    compute = COMPUTE_DTYPES[job.compute_dtype]
    size = compute.itemsize
    b_sz, s_len = len(job.input_ids), len(job.input_ids[0])
    processes = []
    kept = 0  # rank 0: A's block states and logits, kept while B runs
    for rank in range(job.world):
        entry = {"rank": rank, "read_a": 0, "read_b": 0, "peak_estimate": 0}
        side_peaks = []
        for label, side in (("a", job.a), ("b", job.b)):
            if rank >= side.degree:
                continue
            found = side_steps(side, rank, job)
            entry[f"read_{label}"] = found["read"]
            config, padded = found["config"], found["padded_vocab"]
            weights, where = _weights_peak(found["steps"], found["tied"])
            activations = _activations(config, side.degree, b_sz, s_len, size, found["mlp_rows"])
            logits = 3 * b_sz * s_len * padded * size
            if rank == 0:
                states = (2 * config.layers + 1) * b_sz * s_len * config.hidden * size
                activations += states + kept
                logits += 8 * b_sz * s_len * padded * 8 if label == "b" else 0
                if label == "a":
                    kept = states + b_sz * s_len * padded * size
            side_peaks.append({"side": label.upper(), "weights": weights, "weights_at": where,
                               "activations": activations, "logits": logits})
        top = max(side_peaks, key=lambda p: p["weights"] + p["activations"] + p["logits"])
        entry["peak_estimate"] = BASELINE_BYTES + top["weights"] + top["activations"] + top["logits"]
        entry["peak_parts"] = {**top, "baseline": BASELINE_BYTES}
        entry["sides"] = {p["side"]: p for p in side_peaks}
        processes.append(entry)
    lines = [f"A runs {job.a.run or f'at tp={job.a.degree}'}; B at tp={job.b.degree}",
             f"compute {str(compute).removeprefix('torch.')}, {b_sz}x{s_len} tokens; peak = baseline "
             f"{BASELINE_BYTES >> 20} MiB + two consecutive steps' weights + activations + logits"]
    return {"a": a, "b": b, "layout_a": job.a.layout, "layout_b": job.b.layout, "a_run_tp": job.a.degree,
            "b_tp": job.b.degree, "compute_dtype": str(compute).removeprefix("torch."), "lines": lines,
            "processes": processes, "total_read": sum(p["read_a"] + p["read_b"] for p in processes)}
