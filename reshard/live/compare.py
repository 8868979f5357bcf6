"""What the ranks of a live transfer must have planned alike, and the first thing two ranks planned differently.

A plan's *summary* (:func:`summary`) holds its config meaning (the fields that differ from the defaults), its
source and target layouts with their degrees, the source and target rank lists, the transfer's ``dtype`` and
``chunk_bytes``, one digest per source and per target parallel rank's tensor list (name, shape and dtype of each
tensor) and a digest of the message schedule; ``digest`` hashes all of it. Ranks exchange the digest first; only
when digests differ are two ranks' summaries compared (:func:`difference`), in that order, and, when the first
difference is a tensor list, those two ranks' lists (:func:`section_tensors`, :func:`tensor_difference`).
Pure functions of plain data, no torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import NamedTuple

from reshard.layouts.base import Options
from reshard.live.source import options

PLAN_FIX = "plan each rank from the same checkpoint config and degrees"
CALL_FIX = "pass the same dtype and chunk_bytes to live.transfer on every rank"
VERSION_FIX = "run the same reshard version on every rank"
#: config meaning fields with a better known HF spelling, named alongside
HF_NAMES = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
            "kv_heads": "num_key_value_heads", "ffn": "intermediate_size", "vocab": "vocab_size",
            "max_positions": "max_position_embeddings", "expert_ffn": "moe_intermediate_size",
            "experts": "num_experts", "experts_per_token": "num_experts_per_tok"}
ITEMS = {"source": "the source", "target": "the target", "source_ranks": "source_ranks",
         "target_ranks": "target_ranks", "dtype": "the transfer's dtype", "chunk_bytes": "chunk_bytes"}
_SHORT = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64"}
#: options left out of a layout's label: paths that may differ from host to host and file-writing options (what
#: a mapping or config file changes shows in the config meaning and the tensors)
UNLABELLED = ("mapping", "config", "max_shard_size", "follow_symlinks")


class Difference(NamedTuple):
    """The first difference between two summaries: ``text`` naming it (None: tensor list ``section`` differs,
    whose tensors name it) and the ``fix``."""

    text: str | None
    section: str | None
    fix: str


def _digest(obj) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _plain(value):
    """``value`` as JSON gives it back (tuples as lists, dict keys as strings)."""
    return json.loads(json.dumps(value, sort_keys=True, default=repr))


def _defaults(meaning) -> dict:
    """The JSON defaults of a config meaning's fields (an instance or the class)."""
    return {f.name: _plain(f.default) for f in dataclasses.fields(meaning) if f.default is not dataclasses.MISSING}


def config_items(meaning) -> dict:
    """The fields of a config meaning (a :class:`reshard.core.model_config.ModelConfig`; None: none) that differ
    from their defaults, as JSON values."""
    if meaning is None:
        return {}
    values, defaults = _plain(meaning.as_dict()), _defaults(meaning)
    return {k: v for k, v in values.items() if k not in defaults or v != defaults[k]}


def spec_label(spec: dict, what: str) -> str:
    """A ``source`` / ``target`` dict as its layout and the options that differ from the defaults, normalized
    (``{"layout": "megatron", "tp": 2, "pp": 1}`` -> ``megatron tp2``), ``UNLABELLED`` ones left out."""
    layout, opts = options(spec, what)
    default = Options()
    words = [layout]
    for f in dataclasses.fields(opts):
        value = getattr(opts, f.name)
        if value == getattr(default, f.name) or f.name in UNLABELLED:
            continue
        if f.name in ("tp", "pp", "ep", "etp"):
            words.append(f"{f.name}{value}")
        else:
            words.append(f.name if value is True else f"{f.name}={_plain(value)}")
    return " ".join(words)


def section_tensors(plan, key: str) -> list[list]:
    """``[name, shape, dtype]`` of each tensor of section ``key`` (``"source 0"``, ``"target 1"``: a parallel
    rank's tensor list), in plan order; empty when the plan has no such parallel rank."""
    side, index = key.split()
    held = plan.sources if side == "source" else plan.targets
    if int(index) >= len(held):
        return []
    tensors = held[int(index)].values() if side == "source" else held[int(index)]
    return [[t.name, list(t.shape), t.dtype] for t in tensors]


def _schedule_digest(schedule) -> str:
    h = hashlib.sha256()
    for rank in sorted(schedule.local):
        h.update(repr((rank, schedule.local[rank])).encode())
    for messages in schedule.rounds:
        for m in messages:
            h.update(repr((m.src, m.dst, m.nbytes, m.chunks)).encode())
        h.update(b"|")
    return h.hexdigest()[:16]


def summary(plan, dtype: str | None, chunk_bytes: int, schedule) -> dict:
    """The summary of ``plan`` run with ``dtype`` (a safetensors name or None) and ``chunk_bytes`` by
    ``schedule`` (see the module docstring), cached on the plan."""
    from reshard import __version__

    key = ("summary", dtype, chunk_bytes)
    if key not in plan._cache:
        items = [["source", spec_label(plan.source, "source")], ["target", spec_label(plan.target, "target")],
                 ["source_ranks", list(plan.source_ranks)], ["target_ranks", list(plan.target_ranks)],
                 ["dtype", dtype], ["chunk_bytes", chunk_bytes]]
        keys = [f"source {i}" for i in range(len(plan.sources))] + [f"target {j}" for j in range(len(plan.targets))]
        out = {"config": config_items(getattr(plan, "meaning", None)), "items": items,
               "sections": [[k, _digest(section_tensors(plan, k))] for k in keys],
               "schedule": _schedule_digest(schedule), "version": __version__}
        out["digest"] = _digest([out["config"], items, out["sections"], out["schedule"]])
        plan._cache[key] = out
    return plan._cache[key]


def _show(value) -> str:
    if isinstance(value, str):
        return value
    return "None (the plan's)" if value is None else json.dumps(value)


def _config_difference(a: dict, b: dict, ra: int, rb: int) -> str | None:
    from reshard.core.model_config import ModelConfig

    defaults = _defaults(ModelConfig)
    for name in list(a) + [k for k in b if k not in a]:
        va, vb = a.get(name, defaults.get(name)), b.get(name, defaults.get(name))
        if va != vb:
            spelled = f" ({HF_NAMES[name]})" if name in HF_NAMES else ""
            return f"the config's {name}{spelled} is {json.dumps(va)} on rank {ra} and {json.dumps(vb)} on rank {rb}"
    return None


def difference(a: dict, b: dict, ra: int, rb: int) -> Difference:
    """The first difference between rank ``ra``'s summary ``a`` and rank ``rb``'s ``b`` (digests differing), in
    the module docstring's order."""
    text = _config_difference(a["config"], b["config"], ra, rb)
    if text:
        return Difference(text, None, PLAN_FIX)
    items_b = dict(b["items"])
    for name, va in a["items"]:
        vb = items_b.get(name)
        if va != vb:
            fix = CALL_FIX if name in ("dtype", "chunk_bytes") else PLAN_FIX
            return Difference(f"{ITEMS.get(name, name)} is {_show(va)} on rank {ra} and {_show(vb)} on rank {rb}",
                              None, fix)
    sections_b = dict(b["sections"])
    for key, digest in a["sections"]:
        if sections_b.get(key) != digest:
            return Difference(None, key, PLAN_FIX)
    versions = f" (reshard {a['version']} and {b['version']})" if a["version"] != b["version"] else ""
    return Difference(f"the same plan gives different message schedules on ranks {ra} and {rb}{versions}", None,
                      VERSION_FIX)


def _tensor(entry) -> str:
    return f"{json.dumps(entry[1])} {_SHORT.get(entry[2], entry[2].lower())}"


def tensor_difference(key: str, a: list, b: list, ra: int, rb: int) -> str:
    """The first difference between section ``key``'s tensor lists ``a`` (rank ``ra``'s plan) and ``b``."""
    side, index = key.split()
    names_a, names_b = {e[0] for e in a}, {e[0] for e in b}
    for ea, eb in zip(a, b):
        if ea == eb:
            continue
        if ea[0] == eb[0]:
            return f"{side} tensor '{ea[0]}' is {_tensor(ea)} on rank {ra} and {_tensor(eb)} on rank {rb}"
        if ea[0] not in names_b:
            return f"{side} tensor '{ea[0]}' (parallel rank {index}) is planned on rank {ra} but not on rank {rb}"
        if eb[0] not in names_a:
            return f"{side} tensor '{eb[0]}' (parallel rank {index}) is planned on rank {rb} but not on rank {ra}"
        return f"{side} parallel rank {index} lists '{ea[0]}' on rank {ra} where rank {rb} lists '{eb[0]}'"
    if len(a) != len(b):
        extra, on, off = (a[len(b)], ra, rb) if len(a) > len(b) else (b[len(a)], rb, ra)
        return f"{side} tensor '{extra[0]}' (parallel rank {index}) is planned on rank {on} but not on rank {off}"
    return f"the tensors of {side} parallel rank {index} differ"


def pick(records: list[dict]) -> tuple[int, int, list[int]] | None:
    """(a rank of the most common plan digest, the lowest rank planning otherwise, every rank planning
    otherwise) for ``records`` (``rank`` and ``plan``: its digest), or None when all digests are equal; ties
    go to the digest of the lowest rank."""
    groups: dict[str, list[int]] = {}
    for r in records:
        groups.setdefault(r.get("plan"), []).append(r["rank"])
    if len(groups) < 2:
        return None
    ref = max(groups.values(), key=lambda ranks: (len(ranks), -min(ranks)))
    others = sorted(r["rank"] for r in records if r["rank"] not in ref)
    return min(ref), others[0], others


def message(a: int, b: int, text: str, fix: str, others=()) -> str:
    """The error every rank raises: ranks ``a`` and ``b`` planned differently (``text``: the first difference;
    ``others``: every rank whose plan differs from ``a``'s)."""
    x, y = sorted((a, b))
    more = [r for r in others if r != b]
    also = ""
    if more:
        who = f"rank {more[0]}'s plan differs" if len(more) == 1 else \
            "the plans of ranks " + ", ".join(map(str, more[:-1])) + f" and {more[-1]} differ"
        also = f"; {who} from rank {a}'s too"
    return f"live.transfer: ranks {x} and {y} planned different transfers: {text}{also} ({fix})"


def apart(summaries: dict[int, dict], calls: dict[int, int]) -> str:
    """The error for two ranks (``summaries``: rank -> its summary) waiting for each other in two different
    transfers (``calls``: rank -> its count of transfers between that transfer's participants, from 1)."""
    (x, a), (y, b) = sorted(summaries.items())
    if a["digest"] == b["digest"]:
        return (f"live.transfer: ranks {x} and {y} are in different transfers between the same ranks (call "
                f"{calls[x]} on rank {x}, call {calls[y]} on rank {y}): call live.transfer on every participant for "
                "every plan, in the same order")
    found = difference(a, b, x, y)
    side, index = found.section.split() if found.section else ("", "")
    return message(x, y, found.text or f"the tensors of {side} parallel rank {index} differ", found.fix)
