"""Forward verification: run a reference tensor-parallel decoder on checkpoint B (each rank reading only its
own shard files) and on A at its own degree, on the same token ids, and compare the logits.

``verify_forward(a, b, ...)`` returns the report dict (``report["ok"]``); see :mod:`.report` for tolerances.
"""

from __future__ import annotations

import json
import os

import torch

from reshard.errors import ReshardError
from reshard.errors import PlanError
from reshard.layouts.base import Options
from reshard.layouts.registry import get_layout, layout_names, open_checkpoint
from reshard.verification.forward.job import COMPUTE_DTYPES, ForwardJob, Side
from reshard.verification.forward.launch import launch, under_torchrun
from reshard.verification.forward.rank_weights import DecoderConfig, check_world


def read_prompt_ids(path: str, vocab: int) -> list[list[int]]:
    """Token ids from a JSON file (a list of ints, or a list of equal-length lists) or a text file (one
    sequence of whitespace-separated ints per line)."""
    try:
        text = open(path).read()
    except OSError as exc:
        raise ReshardError(f"cannot read --prompt-ids {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [[int(x) for x in line.split()] for line in text.splitlines() if line.strip()]
        except ValueError:
            raise ReshardError(f"{path}: token ids must be JSON or whitespace-separated integers") from None
    if data and all(isinstance(x, int) for x in data):
        data = [data]
    if not data or not all(isinstance(row, list) and row and all(isinstance(x, int) for x in row) for row in data):
        raise ReshardError(f"{path}: expected a non-empty list of token ids (or a list of lists)")
    if len({len(row) for row in data}) != 1:
        raise ReshardError(f"{path}: every sequence must have the same length")
    bad = [x for row in data for x in row if not 0 <= x < vocab]
    if bad:
        raise ReshardError(f"{path}: token id {bad[0]} is outside the vocab [0, {vocab})")
    return data


def verify_forward(a: str, b: str, *, nproc: int | None = None, backend: str | None = None, seq_len: int = 16,
                   batch: int = 2, seed: int = 0, prompt_ids: str | None = None, compute_dtype: str = "fp32",
                   atol: float | None = None, rtol: float | None = None, timeout: float = 300.0,
                   vocab_size: int | None = None, architecture: str | None = None,
                   mapping: str | None = None) -> dict:
    """Run the forward check of ``b`` (at ``nproc`` ranks) against ``a`` (at its own degree)."""
    opts = Options(vocab_size=vocab_size, architecture=architecture, mapping=mapping)
    with open_checkpoint(a, opts) as sa, open_checkpoint(b, opts) as sb:
        layouts = (sa.layout, sb.layout)
        degrees = (sa.degrees.get("tp", 1), sb.degrees.get("tp", 1))
        vocabs = (sa.model.vocab_size, sb.model.vocab_size)
        meanings = (sa.model.meaning, sb.model.meaning)
        config_a = DecoderConfig.from_meaning(meanings[0])  # refuses what it lacks
        config_b = DecoderConfig.from_meaning(meanings[1])
        ffn_b = meanings[1].ffn
    for label, name in zip("AB", layouts):
        if get_layout(name).rank_loader is None:
            raise PlanError(f"{label} is a {name} checkpoint, which the forward verifier cannot read (it reads "
                            f"{', '.join(layout_names(forward=True))}); convert it to one of those first, or use "
                            "the digest check (reshard verify without --forward)")
    if vocabs[0] != vocabs[1]:
        raise ReshardError(f"A has vocab {vocabs[0]} and B has vocab {vocabs[1]}: their logits cannot be compared",
                           exit_code=1)
    shape = ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn")
    unlike = [f"{k} {getattr(meanings[0], k)} vs {getattr(meanings[1], k)}" for k in shape
              if getattr(meanings[0], k) != getattr(meanings[1], k)]
    if unlike:
        raise ReshardError(f"A and B are different models ({', '.join(unlike)}): a forward check compares one "
                           "model in two layouts", exit_code=1)
    vocab = vocabs[0]
    if nproc is None:
        nproc = degrees[1]
        if nproc == 1 and under_torchrun():
            nproc = int(os.environ["WORLD_SIZE"])
    if nproc < 1 or seq_len < 1 or batch < 1 or timeout <= 0:
        raise ReshardError("--nproc, --seq-len, --batch and --timeout must be positive")
    if degrees[1] > 1 and nproc != degrees[1]:
        raise ReshardError(f"{b} is a {layouts[1]} checkpoint at tp={degrees[1]}: its rank files only run at that "
                           f"degree; use --nproc {degrees[1]} (got {nproc}), or convert it to tp={nproc} first")
    check_world(config_b, nproc, ffn_b)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ReshardError(f"unknown --backend '{backend}': use gloo or nccl")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ReshardError("--backend nccl needs CUDA, which this torch cannot see; use --backend gloo")
    if compute_dtype not in COMPUTE_DTYPES:
        raise ReshardError(f"unknown --compute-dtype '{compute_dtype}': use fp32, bf16 or fp16")
    if prompt_ids:
        ids = read_prompt_ids(prompt_ids, vocab)
    else:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (batch, seq_len), generator=gen).tolist()
    job = ForwardJob(a=Side(a, layouts[0], degrees[0]), b=Side(b, layouts[1], nproc), input_ids=ids, vocab=vocab,
                     opts=opts, compute_dtype=compute_dtype, backend=backend, atol=atol, rtol=rtol,
                     timeout=timeout)
    result = launch(job)
    result["seed"] = None if prompt_ids else seed
    tokens = len(ids[0])
    for label, config in (("A", config_a), ("B", config_b)):
        if config.window_layers and tokens <= config.sliding_window:
            result.setdefault("notes", []).append(
                f"{label}'s sliding window ({config.sliding_window} tokens) is not exercised by {tokens} tokens: "
                f"pass --seq-len above {config.sliding_window} to check it")
    return result


def format_report(r: dict) -> str:
    """A few human-readable lines."""
    tol = r["tolerance"]
    lines = [f"A {r['a']['layout']} tp={r['a']['tp']} {r['a']['dtype']} {r['a']['path']}",
             f"B {r['b']['layout']} tp={r['b']['tp']} {r['b']['dtype']} {r['b']['path']}",
             f"{r['batch']}x{r['seq_len']} tokens, {r['backend']}, compute {r['compute_dtype']}, tolerance "
             f"{tol['basis']} (atol {tol['atol']:g}, rtol {tol['rtol']:g}"
             + (f", argmax >= {tol['min_argmax_agreement']}" if tol["min_argmax_agreement"] else "") + ")",
             f"logits: max abs {r['max_abs']:.3g}, max rel {r['max_rel']:.3g}, argmax agreement "
             f"{r['argmax_agreement']:.4f}, KL(A||B) {r['kl_mean']:.3g}"]
    lines += [f"  {p}" for p in r["problems"]] + [f"  note: {n}" for n in r.get("notes", [])]
    lines.append("FORWARD EQUAL" if r["ok"] else f"FORWARD DIFFERENT (first divergence: {r['first_divergence']})")
    return "\n".join(lines)
