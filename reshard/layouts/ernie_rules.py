"""Ernie 4.5 MoE's rules outside the tensor mapping (mappings/ernie4_5_moe.toml; ../shared/layouts/families-2.md
section 11 and 17):

- RoPE on interleaved pairs ``(2i, 2i+1)`` of each head's rows as stored (``[decoder] rope_order = "interleaved"``
  without a variant): the canonical config's ``rope_interleaved``; vLLM (``is_neox_style=False``) and megatron-core
  (``rotary_interleaved``) rotate the same rows, so no tensor is permuted.
- The MoE layer range ``[moe] sparse_start <= i <= sparse_end`` with ``(i + 1) % sparse_step == 0``, written back.
- A weight HF files hold under another shape of the same bytes (``hf_shape``: the selection bias ``[1, E]`` of a
  canonical ``[E]``): the file's entry read as the canonical shape, written with the HF shape in the header.
- Megatron: megatron-core adds a selection bias only to sigmoid scores, so a non-zero
  ``e_score_correction_bias`` is refused (``--allow-lossy-config router_bias`` drops it); an all-zero one is the
  plain softmax router and is left out (read back as zeros: the HF output writes a zero bias; ``verify`` reads
  the missing bias of such a copy as those zeros).
"""

from __future__ import annotations

import dataclasses

from reshard.core.pieces import StoredTensor
from reshard.errors import PlanError
from reshard.mapping.conditions import evaluate

REFUSAL = ("Ernie 4.5 ranks experts by softmax + e_score_correction_bias; megatron-core accepts a selection bias only "
           "with sigmoid scores, which would change the routing (Megatron-Bridge's sigmoid mapping differs from "
           "transformers). Convert to hf or vllm, or pass --allow-lossy-config router_bias to drop the bias.")


def interleaved_rope(family) -> bool:
    """Whether the family's HF q/k rows rotate interleaved pairs in a plain (variant-free) decoder."""
    return family.decoder.rope_order == "interleaved" and family.decoder.variant is None


def meaning_fields(family) -> dict:
    """The canonical config's fields this module decides for an HF config of ``family``."""
    return {"rope_interleaved": True} if interleaved_rope(family) else {}


def write_sparse_range(c: dict, sparse: tuple[int, ...], moe: dict, layers: int, loss) -> None:
    """``sparse`` (the MoE layers) as start / end / interval keys: the source's own spelling kept when it still
    describes them (an end of -1 or none: the last layer), else the first and last MoE layer with the first interval
    that does; a set no interval describes goes to ``loss``."""
    keys = moe["sparse_start"], moe["sparse_end"], moe.get("sparse_step")

    def rule(start: int, end: int, step: int) -> tuple[int, ...]:
        return tuple(i for i in range(layers) if start <= i <= end and (i + 1) % step == 0)

    spelt = [c.get(k) for k in keys[:2]] + [int(c.get(keys[2]) or 1) if keys[2] else 1]
    candidates = [tuple(spelt)] if spelt[0] is not None else []
    if sparse:
        candidates += [(min(sparse), max(sparse), step) for step in range(1, layers + 1) if keys[2] or step == 1]
    for start, end, step in candidates:
        if rule(int(start), layers - 1 if end in (-1, None) else int(end), step) == tuple(sparse):
            c[keys[0]] = start
            if end is not None:
                c[keys[1]] = end
            if keys[2]:
                c[keys[2]] = step
            return
    loss.cannot("moe_layers", list(sparse), "Ernie 4.5 places MoE layers by start, end and interval only")


def _views(family) -> list:
    return [s for s in family.weights if s.hf_shape]


def read_views(family, files, where: dict[str, int], names: dict[str, str], matched: dict) -> None:
    """HF files' entries of ``hf_shape`` weights seen as the canonical shape (the leading 1s dropped); an entry
    already in the canonical shape is left as it is."""
    for name, (spec, _) in matched.items():
        if not spec.hf_shape:
            continue
        squeeze = len(spec.hf_shape) - len(spec.shape)
        tensors = files[where[name]].tensors
        stored = names.get(name, name)
        loc = tensors[stored]
        if squeeze > 0 and len(loc.shape) == len(spec.hf_shape) and all(n == 1 for n in loc.shape[:squeeze]):
            tensors[stored] = dataclasses.replace(loc, shape=tuple(loc.shape[squeeze:]))


def file_shapes(model, tensors: list[StoredTensor]) -> list[StoredTensor]:
    """The HF output's tensors, ``hf_shape`` weights recorded under that shape in the header, and a zero
    selection bias on every MoE layer of a model without one (:func:`zero_biases`)."""
    if not _views(model.family):
        return tensors
    out = []
    for t in tensors:
        spec = model.tensors[t.pieces[0].canonical].spec if t.pieces and t.pieces[0].canonical in model.tensors \
            else None
        if spec is not None and spec.hf_shape:
            t = dataclasses.replace(t, file_shape=(1,) * (len(spec.hf_shape) - len(t.shape)) + tuple(t.shape))
        out.append(t)
    return out + zero_biases(model)


def zero_biases(model) -> list[StoredTensor]:
    """A model without its optional ``hf_shape`` selection bias (read from Megatron, which holds none: an all-zero
    one was left out, :func:`drop_for_target`) gets zeros in the HF shape, fp32, on every MoE layer: what
    transformers' module always holds."""
    spec = model.family.role_spec("router_bias")
    if spec is None or not spec.hf_shape or not spec.optional or (model.meaning and model.meaning.router_bias):
        return []
    if any(t.spec is spec for t in model.tensors.values()):
        return []
    shape = tuple(evaluate(e, model.dims) for e in spec.hf_shape)
    return [StoredTensor(spec.hf.format(layer=i), shape, 0, (), fill=0.0, dtype=spec.dtype or "F32")
            for i in model.meaning.sparse_layers()]


def drop_for_target(source, to: str, opts) -> list[str]:
    """The plan's notes for target ``to``: :func:`megatron_bias` first, then each ``hf_shape`` weight a non-HF
    target stores in the canonical shape (section 14.2 G: a transform is listed in the plan)."""
    notes = megatron_bias(source, to, opts)
    if to == "hf":
        return notes
    specs = {t.spec.hf: t.spec for t in source.model.tensors.values() if t.spec.hf_shape}
    return notes + [f"{s.hf.rsplit('.', 1)[-1]}: Hugging Face's [{', '.join(s.hf_shape)}] is written "
                    f"[{', '.join(s.shape)}] (the same values; an HF output writes it back as transformers stores it)"
                    for s in specs.values()]


def megatron_bias(source, to: str, opts) -> list[str]:
    """Section 17, before a Megatron (torch / torch_dist) target is planned: a softmax router's selection bias
    that is not all zero is refused unless ``--allow-lossy-config router_bias``; the bias then leaves the model
    (an all-zero one silently changes nothing: megatron-core's plain softmax router computes the same)."""
    model = source.model
    meaning = model.meaning
    if to not in ("megatron", "torch_dist") or meaning is None or not meaning.router_bias or \
            meaning.router_score != "softmax" or not interleaved_rope(model.family):
        return []
    names = _bias_names(source)
    nonzero = any(_read_whole(source, n).count_nonzero() for n in sorted(names))
    if nonzero and "router_bias" not in opts.allow_lossy_config:
        raise PlanError(REFUSAL)
    _leave_out(source, names)
    if nonzero:
        return [f"--allow-lossy-config router_bias: dropped the selection bias e_score_correction_bias of "
                f"{len(names)} MoE layers (megatron-core ranks experts by the softmax alone: the routing changes)"]
    return ["e_score_correction_bias is all zero on every MoE layer: left out (megatron-core's softmax router "
            "computes the same; an HF output writes it back as zeros)"]


def _bias_names(source) -> set[str]:
    return {n for n, t in source.model.tensors.items() if t.spec.role == "router_bias"}


def _leave_out(source, names: set[str]) -> None:
    """``source`` without the selection-bias tensors ``names`` (its config then has no bias)."""
    model = source.model
    kept = {n: t for n, t in model.tensors.items() if n not in names}
    source.model = dataclasses.replace(model, tensors=kept, dtypes={n: d for n, d in model.dtypes.items() if n in kept},
                                       meaning=model.meaning.replace(router_bias=False))
    source.stored = [(i, t) for i, t in source.stored if all(p.canonical not in names for p in t.pieces)]


def align_zero_bias(sa, sb) -> None:
    """``verify``: where one side holds no selection bias (a Megatron copy of a model whose bias is all zero) and
    the other an all-zero one, the zeros are left out of the comparison; a non-zero bias still differs."""
    for held, lacking in ((sa, sb), (sb, sa)):
        names = _bias_names(held)
        if not names or _bias_names(lacking) or not interleaved_rope(held.model.family) or \
                lacking.model.meaning is None or lacking.model.meaning.router_bias:
            continue
        if not any(_read_whole(held, n).count_nonzero() for n in sorted(names)):
            _leave_out(held, names)


def _read_whole(source, name: str):
    """Canonical ``name`` (a replicated 1-D weight) read whole from the first stored tensor holding it."""
    for i, t in source.stored:
        if len(t.pieces) == 1 and t.pieces[0].canonical == name:
            return source.files[i].read(t.name).reshape(-1)
    raise PlanError(f"the source holds no whole copy of {name}")


def rope_meaning(meaning, family, loss):
    """``meaning`` for the HF RoPE writer: a family whose rows rotate interleaved pairs spells interleaved RoPE by
    its architecture alone (so the writer sees none to refuse), and cannot spell rotate-half."""
    if not interleaved_rope(family):
        return meaning
    if not meaning.rope_interleaved:
        loss.cannot("rope_interleaved", False, f"{meaning.architecture} rotates interleaved pairs (2i, 2i+1)")
    return meaning.replace(rope_interleaved=False)
