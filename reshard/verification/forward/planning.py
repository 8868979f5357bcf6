"""Plan a forward check (both sides, their degrees, the token ids) from configs and headers alone.

A is the reference. Where its layout's data does not depend on a TP degree (its rank stream is ``any_degree``:
Hugging Face, torch_dist, Meta) A is sliced at B's degree, so no process holds the whole model; it falls back to
one process only where the model cannot be cut at that degree. A layout with rank files of its own (Megatron
``torch``, vLLM, TensorRT-LLM) runs at its own degree from those files (they are the reference as its runtime reads
them; reading them through reshard's planner instead would reuse the converter's own reading).
"""

from __future__ import annotations

import json
import os
import re

import torch

from reshard.errors import PlanError, ReshardError
from reshard.layouts.base import Options, import_string
from reshard.layouts.registry import get_layout, layout_names, open_checkpoint
from reshard.verification.forward.backend import choose_backend
from reshard.verification.forward.job import COMPUTE_DTYPES, ForwardJob, Side
from reshard.verification.forward.launch import under_torchrun
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


def plan_job(a: str, b: str, *, nproc: int | None = None, backend: str | None = None, seq_len: int = 16,
             batch: int = 2, seed: int = 0, prompt_ids: str | None = None, compute_dtype: str = "fp32",
             atol: float | None = None, rtol: float | None = None, timeout: float = 300.0,
             vocab_size: int | None = None, architecture: str | None = None,
             mapping: str | None = None, progress: bool = False, **reading) -> tuple[ForwardJob, list[str]]:
    """The job :func:`~reshard.verification.forward.verify_forward` runs, and its notes; refuses (before any
    tensor is read) what cannot be checked."""
    opts = Options(vocab_size=vocab_size, architecture=architecture, mapping=mapping, **reading)
    with open_checkpoint(a, opts) as sa, open_checkpoint(b, opts) as sb:
        layouts = (sa.layout, sb.layout)
        degrees = (sa.degrees.get("tp", 1), sb.degrees.get("tp", 1))
        stages = (sa.degrees.get("pp", 1), sb.degrees.get("pp", 1))
        vocabs = (sa.model.vocab_size, sb.model.vocab_size)
        meanings = (sa.model.meaning, sb.model.meaning)
        config_a = DecoderConfig.from_meaning(meanings[0])  # refuses what it lacks
        config_b = DecoderConfig.from_meaning(meanings[1])
        ffn_b = meanings[1].ffn
        tensors = block_tensors(sb)
        unrun = not_run(sa, sb)
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
    backend, backend_note = choose_backend(backend, nproc, torchrun=under_torchrun(), fixed_nproc=degrees[1] > 1)
    if compute_dtype not in COMPUTE_DTYPES:
        raise ReshardError(f"unknown --compute-dtype '{compute_dtype}': use fp32, bf16 or fp16")
    if prompt_ids:
        ids = read_prompt_ids(prompt_ids, vocab)
    else:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (batch, seq_len), generator=gen).tolist()
    a_degree, a_run = a_side(layouts[0], degrees[0], meanings[0], config_a, nproc)
    job = ForwardJob(a=Side(a, layouts[0], a_degree, own_tp=degrees[0], run=a_run, pp=stages[0]),
                     b=Side(b, layouts[1], nproc, pp=stages[1]),
                     input_ids=ids, vocab=vocab, opts=opts, compute_dtype=compute_dtype, backend=backend, atol=atol,
                     rtol=rtol, timeout=timeout, progress=progress, tensors=tensors)
    notes = ([backend_note] if backend_note else []) + unrun
    tokens = len(ids[0])
    for label, config in (("A", config_a), ("B", config_b)):
        if config.window_layers and tokens <= config.sliding_window:
            notes.append(f"{label}'s sliding window ({config.sliding_window} tokens) is not exercised by {tokens} "
                         f"tokens: pass --seq-len above {config.sliding_window} to check it")
    return job, notes


def a_side(layout: str, own_tp: int, meaning, config: DecoderConfig, nproc: int) -> tuple[int, str]:
    """(the degree A runs at, how, in words): sliced at ``nproc`` where its layout can be sliced and the model
    divides by ``nproc``, else its own degree."""
    if not import_string(get_layout(layout).rank_loader).any_degree:
        return own_tp, f"from its own {layout} rank files at tp={own_tp}"
    if nproc == 1:
        return 1, "in one process (B runs at tp=1)"
    try:
        check_world(config, nproc, meaning.ffn)
        for what, size in (("expert", meaning.expert_ffn), ("shared-expert", meaning.shared_expert_ffn)):
            if size % nproc:
                raise ReshardError(f"the {what} intermediate size {size} does not divide by {nproc}")
    except ReshardError as exc:
        return 1, f"whole in one process, one layer at a time: it cannot be sliced at tp={nproc} ({exc})"
    return nproc, (f"sliced at tp={nproc}: each process reads only its rows and columns of A's {layout} files, one "
                   "layer at a time")


#: The decoder roles (:data:`reshard.mapping.LAYER_ROLES`) of a layer's attention block; the others are its MLP's.
ATTENTION_ROLES = frozenset({"input_norm", "input_norm_bias", "q", "k", "v", "q_bias", "k_bias", "v_bias", "q_norm",
                             "k_norm", "o", "o_bias", "attn_output_norm", "q_a", "q_a_norm", "q_b", "kv_a",
                             "kv_a_norm", "kv_b"})
_END_STEPS = {"embedding": "embedding", "position_embedding": "embedding", "final_norm": "head",
              "final_norm_bias": "head", "lm_head": "head"}


def step_of(tensor, model) -> str | None:
    """The step of a run a canonical tensor takes part in (``embedding``, ``layer 2 attention``, ``layer 2 mlp``,
    ``head``), None for one the decoder does not run (a vision tower, an MTP layer)."""
    role = tensor.spec.role
    if role is None or tensor.spec.tower:
        return None
    if tensor.layer is None:
        return _END_STEPS.get(role)
    if tensor.layer >= model.num_layers:
        return None
    return f"layer {tensor.layer} {'attention' if role in ATTENTION_ROLES else 'mlp'}"


def block_tensors(source, most: int = 8) -> dict[str, str]:
    """Step -> the tensors ``source`` (B) stores for it, by its own names, as a report names them: names that
    differ only in a number (experts) collapsed into ``{0..63}``, at most ``most`` shown, and the first file
    holding them when there are several files."""
    model = source.model
    found: dict[str, dict[str, int]] = {}  # step -> stored name -> the first file index holding it
    for index, stored in source.stored:
        for piece in stored.pieces:
            tensor = model.tensors.get(piece.canonical) if piece.canonical else None
            step = step_of(tensor, model) if tensor is not None else None
            if step is not None:
                found.setdefault(step, {}).setdefault(stored.name, index)
    if model.tied and "head" in found and "embedding" in found:  # the head is the embedding table
        found["head"] = {**found["head"], **found["embedding"]}
    out = {}
    for step, names in found.items():
        shown = collapse(list(names))
        text = ", ".join(shown[:most]) + (f" and {len(shown) - most} more" if len(shown) > most else "")
        if len(source.files) > 1:
            text += f" in {os.path.relpath(source.files[min(names.values())].path, source.root)}"
        out[step] = text
    return out


def collapse(names: list[str]) -> list[str]:
    """Names alike but for a number taking more than 3 values (an expert index), as one: ``experts.{0..7}.w1``;
    in the order of first appearance."""
    groups: dict[str, list[tuple[int, ...]]] = {}
    for name in names:
        groups.setdefault(re.sub(r"\d+", "#", name), []).append(tuple(int(n) for n in re.findall(r"\d+", name)))
    out: dict[str, None] = {}
    for template, numbers in groups.items():
        parts = template.split("#")
        wide = {i for i in range(len(parts) - 1) if len({n[i] for n in numbers}) > 3}
        ranges: dict[tuple, list[int]] = {}  # the narrow numbers -> each wide position's (low, high)
        for n in numbers:
            key = tuple(None if i in wide else v for i, v in enumerate(n))
            low_high = ranges.setdefault(key, [v for i in sorted(wide) for v in (n[i], n[i])])
            for k, i in enumerate(sorted(wide)):
                low_high[2 * k], low_high[2 * k + 1] = min(low_high[2 * k], n[i]), max(low_high[2 * k + 1], n[i])
        for key, low_high in ranges.items():
            spans = iter(f"{{{low_high[2 * k]}..{low_high[2 * k + 1]}}}" for k in range(len(wide)))
            out.setdefault(parts[0] + "".join((next(spans) if v is None else str(v)) + part
                                              for v, part in zip(key, parts[1:])))
    return list(out)


def not_run(sa, sb) -> list[str]:
    """Notes for what the check leaves out: a vision tower, MTP layers (of B, else of A)."""
    notes = []
    tower = max(sum(1 for t in s.model.tensors.values() if t.spec.tower) for s in (sb, sa))
    if tower:
        notes.append(f"the vision tower ({tower} tensors) was not run: the forward check runs the language model")
    mtp = max(len(s.model.mtp_layers) for s in (sb, sa))
    if mtp:
        notes.append(f"the {mtp} multi-token-prediction (MTP) layer{'s were' if mtp > 1 else ' was'} not run: the "
                     "forward check runs the main model")
    return notes
