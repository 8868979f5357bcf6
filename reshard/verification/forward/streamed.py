"""Run the decoder on one rank, layer by layer, from a :class:`~.rank_stream.RankStream`.

Steps, in order: the embedding, each decoder layer, the head (final norm and lm_head). Each step's weights are
read from the rank's files and cast to the compute dtype on a reader thread while the previous step computes, and
dropped once it has run; the hidden state is all that is carried. At any moment a rank therefore holds at most two
consecutive steps' weights (plus, for a tied head, its embedding rows, kept for the head). The arithmetic is the
in-memory :func:`.decoder.forward`'s, step for step: the logits are bit-identical.

On a CUDA device the weights are read straight onto it (:mod:`.staging`: through a few bounded pinned host
buffers) and cast there: the host holds the buffers, not the layers. On CPU they are read and cast in host memory.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from reshard.verification.forward import decoder, layer_checks
from reshard.verification.forward.rank_stream import RankStream
from reshard.verification.forward.staging import stager_for


def steps(config) -> list[str]:
    """The step names of a run: ``embedding``, ``layer 0`` .. ``layer L-1``, ``head``."""
    return ["embedding"] + [f"layer {i}" for i in range(config.layers)] + ["head"]


_END_NAMES = {"embedding": ("embedding", "position embedding"), "head": ("final norm", "final norm bias", "lm_head")}


def named_tensors(step: str, weights) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of one step's weights, as :func:`read_step` returns them: ``embedding``, ``layer 3 q``,
    ``layer 3 expert 5 down``, ``lm_head``, ..."""
    if isinstance(weights, tuple):
        return [(n, t) for n, t in zip(_END_NAMES[step], weights) if t is not None]
    out = [(f"{step} {name}", getattr(weights, name)) for name in weights.__dataclass_fields__ if name != "experts"]
    out += [(f"{step} expert {e} {part}", t) for e, parts in weights.experts.items()
            for part, t in zip(("gate", "up", "down"), parts)]
    return [(n, t) for n, t in out if t is not None]


def non_finite_count(t: torch.Tensor) -> int:
    """How many elements of ``t`` are NaN or infinite. A NaN or an infinity makes the sum non-finite, so the sum
    (one pass, no temporary; in fp32 at least, where finite weights cannot overflow it) screens each tensor and only
    a tensor that fails is counted element by element (``isfinite`` makes full-size temporaries)."""
    if not t.is_floating_point() or bool(torch.isfinite(t.sum(dtype=torch.promote_types(t.dtype, torch.float32)))):
        return 0
    return t.numel() - int(torch.isfinite(t).sum())


def read_stored(stream: RankStream, step: str):
    """One step's weights as stored: (table, positions) for the embedding, a LayerWeights for a layer, (final
    norm, its bias, lm_head or None) for the head."""
    if step == "embedding":
        return stream.embedding()
    if step == "head":
        return stream.head()
    return stream.layer(int(step.split()[1]))


def read_step(stream: RankStream, step: str, dtype: torch.dtype, device, stored: list | None = None):
    """One step's weights (:func:`read_stored`), cast; the embedding's stored dtype is appended to ``stored``.
    Non-finite values in any of them are noted in ``stream.problems``, naming the tensor."""
    weights = read_stored(stream, step)
    if isinstance(weights, tuple):
        if stored is not None:
            stored.append(weights[0].dtype)
        weights = tuple(decoder.cast(t, dtype, device) for t in weights)
    else:
        weights = decoder.cast_layer(weights, dtype, device)
    for name, t in named_tensors(step, weights):
        bad = non_finite_count(t)
        if bad:
            stream.problems.append(f"non-finite values in the weights: {name} on rank {stream.rank} ({bad} of "
                                   f"{t.numel()} elements, as {str(dtype).removeprefix('torch.')})")
    return weights


def step_label(step: str, layers: int) -> str:
    """How a progress line names a step: ``embedding``, ``layer 4/32`` (for ``layer 3``), ``head``."""
    return f"layer {int(step.split()[1]) + 1}/{layers}" if step.startswith("layer ") else step


def forward_streamed(stream: RankStream, ids: torch.Tensor, tp: decoder.TPGroup, dtype: torch.dtype, device,
                     record: bool = True, progress: Callable[[str | None], None] | None = None
                     ) -> tuple[decoder.ForwardOutput, torch.dtype]:
    """(the decoder's output on ``ids``, the stored dtype of the embedding) with one step read ahead; reads are
    staged onto ``device`` where :func:`~.staging.stager_for` gives a stager (CUDA). ``progress`` is called with
    each step's :func:`step_label` once it has run, then with None (e.g. :func:`reshard.progress.step_progress`)."""
    stager = stream.stager = stager_for(device)
    try:
        return _run(stream, ids, tp, dtype, device, record, progress)
    finally:
        stream.stager = None
        if stager is not None:
            stager.close()
        if progress is not None:
            progress(None)


def _run(stream: RankStream, ids: torch.Tensor, tp: decoder.TPGroup, dtype: torch.dtype, device, record: bool,
         progress) -> tuple[decoder.ForwardOutput, torch.dtype]:
    config = stream.config
    names = steps(config)
    out = decoder.ForwardOutput(logits=torch.empty(0))
    states = out.states if record else None
    stored: list[torch.dtype] = []
    device = torch.device(device)
    on_device = {"initializer": torch.cuda.set_device, "initargs": (device,)} if device.type == "cuda" else {}

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-forward-read", **on_device) as reader:
        pending = reader.submit(read_step, stream, names[0], dtype, device, stored)
        for k, step in enumerate(names):
            weights = pending.result()
            pending = reader.submit(read_step, stream, names[k + 1], dtype, device) if k + 1 < len(names) else None
            if step == "embedding":
                table, positions = weights
                layer_checks.check_ends(config, positions, None)
                x = decoder.embed_tokens(config, ids, table, stream.vocab_start, positions, tp)
                if record:
                    states.append(("embedding", x.detach().cpu()))
                inputs = decoder.LayerInputs.build(config, ids, table.dtype)
                tied_table = table if stream.tied else None
            elif step == "head":
                final_norm, final_norm_bias, lm_head = weights
                layer_checks.check_ends(config, positions, final_norm_bias)
                head = tied_table if lm_head is None else lm_head
                out.logits = decoder.final_logits(config, x, final_norm, final_norm_bias, head, tp)
            else:
                layer_checks.check_layer(config, k - 1, weights)
                x = decoder.decoder_layer(config, k - 1, weights, x, inputs, tp, states)
            del weights
            if step == "embedding":
                del table
            if progress is not None:
                progress(step_label(step, config.layers))
    return out, stored[0]
