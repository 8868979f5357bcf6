"""Inspect a checkpoint: layout, architecture, degrees, dtypes, parameters, bytes, files per rank; as a dict
(``--json``) and as a table for people (:func:`format_inspection`: sizes in KiB / MiB / GiB, no dict reprs)."""

from __future__ import annotations

import collections
import math
import os
import re
import textwrap

from reshard.hub import open_source
from reshard.layouts.base import Options
from reshard.layouts.registry import get_layout
from reshard.progress import binary_size


def inspect(path: str, *, vocab_size: int | None = None, architecture: str | None = None,
            mapping: str | None = None, **reading) -> dict:
    """What ``reshard inspect PATH --json`` prints. ``tp``, ``pp`` (``ep``, ``etp``): the degrees the files are
    split at (torch_dist: 1, its files hold whole tensors); ``saved_degrees``: the degrees the checkpoint was saved
    at (torch_dist: its run's, also ``saved_tp`` / ``saved_pp``); ``bytes``: the weight files' total size;
    ``hub``: repo, revision and commit of an ``hf://`` path; plus the layout's own keys (``padded_vocab_size``,
    ``iteration``, ...). ``reading``: other source-reading :class:`Options` fields (``config``, ``tag``,
    ``master_weights``)."""
    opts = Options(vocab_size=vocab_size, architecture=architecture, mapping=mapping, **reading)
    with open_source(path, opts) as source:
        model = source.model
        dtype_counts = collections.Counter(model.dtypes.values())
        layout = get_layout(source.layout)
        files_per_rank: dict[str, list[str]] = collections.defaultdict(list)
        for f in source.files:
            rel = os.path.relpath(f.path, source.root)
            files_per_rank[layout.rank_label(source, rel)].append(rel)
        info = {
            "path": path,
            "layout": source.layout,
            "architecture": (model.config.get("architectures") or ["?"])[0],
            "family": model.family.name,
            **source.degrees,  # tp, pp; ep and etp for a Megatron Mixture of Experts
            "dtype": dtype_counts.most_common(1)[0][0] if dtype_counts else None,
            "dtypes": dict(dtype_counts),
            "parameters": sum(math.prod(t.shape) for t in model.tensors.values()),
            "tensors": len(model.tensors),
            "layers": model.num_layers,
            "hidden_size": model.dims["H"],
            "heads": model.dims["nh"],
            "kv_heads": model.dims["ng"],
            "vocab_size": model.vocab_size,
            **({"experts": model.num_experts, "moe_layers": len(model.sparse_layers)} if model.num_experts else {}),
            "tied_embeddings": model.tied,
            "model_config": {k: v for k, v in model.meaning.as_dict().items() if v not in (None, False)},
            "bytes": sum(os.path.getsize(f.path) for f in source.files),
            "files_per_rank": dict(files_per_rank),
            **({"hub": source.info["hub"]} if "hub" in source.info else {}),
            **({"vision": _vision(source)} if model.family.multimodal else {}),
        }
        extra = layout.describe(source)
        info.update(extra)
        # "tp"/"pp" are the degrees the files are split at (torch_dist: 1, its files hold whole tensors);
        # saved_degrees are those of the run that saved them (torch_dist: its saved_tp / saved_pp)
        saved = {key[len("saved_"):]: value for key, value in extra.items() if key.startswith("saved_")}
        info["saved_degrees"] = {**source.degrees, **saved}
        return info


def _vision(source) -> dict:
    """A vision-language model's tower: its blocks (and how many the model uses), width, heads, tensors, and how
    many of those the files do not hold (vLLM's LLaVA, a text-only folder)."""
    from reshard.layouts.vision import absent_tensors

    model, mm = source.model, source.model.family.multimodal
    tower = [name for name, t in model.tensors.items() if t.spec.tower]
    absent = set(absent_tensors(source))
    return {"blocks": mm.blocks, "used_blocks": mm.used_blocks, "hidden": model.dims.get("Hv"),
            "heads": model.dims.get("nv"), "tensors": len(tower), "absent": sum(n in absent for n in tower)}


def _span(names: list[str]) -> str:
    """``a, b, c`` for up to three names, else ``first … last``."""
    return ", ".join(names) if len(names) <= 3 else f"{names[0]} … {names[-1]}"


def summarize_files(files_per_rank: dict[str, list[str]]) -> list[str]:
    """A few lines for a long file list: per rank its file count and first … last name; many ranks with the
    same number of files each fold into one line naming the first and last rank."""
    counts = {rank: len(names) for rank, names in files_per_rank.items()}
    if len(counts) <= 3 or len(set(counts.values())) > 1:
        return [f"{rank}: {len(names)} file{'s' if len(names) != 1 else ''}: {_span(names)}"
                for rank, names in files_per_rank.items()]
    ranks = list(files_per_rank)
    per = counts[ranks[0]]
    first, last = files_per_rank[ranks[0]], files_per_rank[ranks[-1]]
    return [f"{len(ranks)} ranks ({ranks[0]} … {ranks[-1]}), {per} file{'s' if per != 1 else ''} each, "
            f"{per * len(ranks)} in all",
            f"{ranks[0]}: {_span(first)}", f"{ranks[-1]}: {_span(last)}"]


# -- the table for people --------------------------------------------------------------------------------------------

_SHOWN = {"architecture", "hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "vocab", "tied", "experts",
          "experts_per_token", "expert_ffn", "moe_layers", "q_lora_rank", "kv_lora_rank", "rope_head_dim",
          "v_head_dim", "router_score", "router_bias", "router_groups", "router_group_topk", "router_group_score",
          "router_scaling", "router_renormalize", "mtp_layers"}  # model_config fields with a row of their own
_DEGREE_NAMES = {"tp": "TP", "pp": "PP", "ep": "EP", "etp": "expert TP"}
_WIDTH = 80  # every line of the table, the path aside
_BASE_KEYS = {"path", "layout", "architecture", "family", "tp", "pp", "ep", "etp", "dtype", "dtypes", "parameters",
              "tensors", "layers", "hidden_size", "heads", "kv_heads", "vocab_size", "experts", "moe_layers", "vision",
              "tied_embeddings", "model_config", "bytes", "files_per_rank", "hub"}  # the keys every layout has


def _n(count: int, word: str, plural: str | None = None) -> str:
    """``1 file``, ``3 files``."""
    return f"{count} {word if count == 1 else plural or word + 's'}"


def _count(n: int) -> str:
    """``185,664 (185.7K)``; ``8,030,261,248 (8.0B)``."""
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n:,} ({n / scale:.1f}{suffix})"
    return f"{n:,}"


def _ranges(numbers: list[int]) -> str:
    """``0-3, 5, 7-8``."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _value(value) -> str:
    """A setting's value in words: lists of layers as ranges, dicts as ``key=value`` pairs."""
    if isinstance(value, dict):  # a dict's lists are values (M-RoPE's sections), not layer numbers
        return " ".join(f"{k}={list(v) if isinstance(v, (list, tuple)) else _value(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return _ranges(value) if all(isinstance(v, int) for v in value) else ", ".join(map(_value, value))
    return str(value)


def _degrees(degrees: dict) -> str:
    return ", ".join(f"{_DEGREE_NAMES.get(k, k)} {'?' if v is None else v}" for k, v in degrees.items())


def _parallelism(info: dict) -> str:
    split = {k: info[k] for k in ("tp", "pp", "ep", "etp") if k in info}
    saved = info.get("saved_degrees", split)
    if saved == split:
        return _degrees(split)
    return f"saved at {_degrees(saved)}; whole tensors, readable at any degree"


def _dtypes(info: dict) -> str:
    counts = info.get("dtypes") or {}
    if len(counts) <= 1:
        return str(info.get("dtype") or "none")
    return ", ".join(f"{d} ({_n(n, 'tensor')})" for d, n in sorted(counts.items(), key=lambda item: -item[1]))


def _dense_ffn(info: dict, config: dict) -> str:
    """``, FFN 96``; ``, dense FFN 96`` beside MoE layers; nothing where every layer is MoE."""
    dense = info["layers"] - info.get("moe_layers", 0)
    if not config.get("ffn") or not dense:
        return ""
    return f", {'dense ' if info.get('experts') else ''}FFN {config['ffn']}"


def _mla_rows(config: dict) -> list[tuple[str, str]]:
    """Multi-head latent attention's dims and the MTP layers, where the model has them."""
    rows = []
    if config.get("kv_lora_rank"):
        rows.append(("attention", f"multi-head latent: q LoRA {config.get('q_lora_rank') or 'none (q_proj)'}, KV LoRA "
                                  f"{config['kv_lora_rank']}, q / k heads of {config['head_dim']} + RoPE "
                                  f"{config['rope_head_dim']}, v heads of {config['v_head_dim']}"))
    if config.get("mtp_layers"):
        rows.append(("mtp", f"{_n(config['mtp_layers'], 'multi-token-prediction layer')} after the decoder"))
    return rows


def _routing(config: dict) -> str:
    """The router in words: scores, selection bias, groups, renormalisation, scaling."""
    parts = [f"{config.get('router_score', 'softmax')} scores"]
    if config.get("router_bias"):
        parts.append("a selection bias")
    if config.get("router_groups", 1) > 1:
        parts.append(f"the best {config['router_group_topk']} of {config['router_groups']} groups by "
                     f"{config['router_group_score']}")
    parts.append("top-k renormalised" if config.get("router_renormalize") else "top-k as scored")
    if config.get("router_scaling", 1.0) != 1.0:
        parts.append(f"scaled by {_value(config['router_scaling'])}")
    return ", ".join(parts)


def _rows(info: dict) -> list[tuple[str, str]]:
    config = info.get("model_config", {})
    head_dim = config.get("head_dim")
    files = sum(len(names) for names in info["files_per_rank"].values())
    vocab = f"{info['vocab_size']:,}"
    if info.get("padded_vocab_size") not in (None, info["vocab_size"]):
        vocab += f" (padded to {info['padded_vocab_size']:,} in the files)"
    hub = info.get("hub")
    rows = [*([("hub", f"{hub['repo']}@{hub['revision']} (commit {hub['commit'][:12]})")] if hub else []),
            ("layout", info["layout"]),
            ("model", f"{info['architecture']} ({info['family']} family)"),
            ("parallelism", _parallelism(info)),
            ("dtype", _dtypes(info)),
            ("parameters", f"{_count(info['parameters'])} in {_n(info['tensors'], 'tensor')}"),
            ("size", f"{binary_size(info['bytes'])} in {_n(files, 'file')}"),
            ("shape", f"{_n(info['layers'], 'layer')}, hidden {info['hidden_size']}, {_n(info['heads'], 'head')}"
                      + (f" of {head_dim}" if head_dim and not config.get("kv_lora_rank") else "")
                      + ("" if config.get("kv_lora_rank") else f", {_n(info['kv_heads'], 'KV head')}")
                      + _dense_ffn(info, config)),
            *_mla_rows(config),
            ("vocab", f"{vocab}, embeddings {'tied' if info['tied_embeddings'] else 'untied'}")]
    if info.get("experts"):
        moe = config.get("moe_layers")
        rows.append(("experts", f"{info['experts']} per MoE layer"
                     + (f", {config['experts_per_token']} per token" if config.get("experts_per_token") else "")
                     + (f", FFN {config['expert_ffn']}" if config.get("expert_ffn") else "")
                     + f"; {info['moe_layers']} of {_n(info['layers'], 'layer')} "
                     + ("is" if info["moe_layers"] == 1 else "are") + " MoE"
                     + (f" ({_ranges(moe)})" if moe else "")))
        rows.append(("routing", _routing(config)))
    vision = info.get("vision")
    if vision:
        rows.append(("vision", f"tower of {_n(vision['blocks'], 'block')}"
                     + (f" ({vision['used_blocks']} used)" if vision["used_blocks"] != vision["blocks"] else "")
                     + f", hidden {vision['hidden']}, {_n(vision['heads'], 'head')}; {_n(vision['tensors'], 'tensor')}"
                     + (f", {vision['absent']} not in these files" if vision["absent"] else "")))
    settings = [key.replace("_", " ") + ("" if value is True else f" {_value(value)}")
                for key, value in config.items() if key not in _SHOWN]
    if settings:
        rows.append(("settings", ", ".join(settings)))
    details = _details(info)
    if details:
        rows.append((info["layout"], ", ".join(details)))
    return rows


def _details(info: dict) -> list[str]:
    """The layout's own keys as ``key value`` phrases: its prefix dropped (``megatron_spec``: ``spec``), a dict
    under the layout's name (DeepSpeed's) spread into its keys, empty values left out."""
    layout = info["layout"]
    items = []
    for key, value in info.items():
        if key in _BASE_KEYS or key == "padded_vocab_size" or key.startswith("saved_"):
            continue
        items += value.items() if key == layout and isinstance(value, dict) else [(key, value)]
    return [f"{key.removeprefix(layout + '_').replace('_', ' ')} {_value(value)}" for key, value in items
            if value not in (None, "", [], {}, ())]


def _wrap(text: str, first: str, rest: str) -> list[str]:
    """``text`` in lines of at most :data:`_WIDTH` columns, the first starting ``first``, the others ``rest``; a
    bracketed list (``[2, 3, 3]``) is kept on one line."""
    kept = re.sub(r"\[[^\]]*\]", lambda m: m.group().replace(" ", "\xa0"), text)
    return [line.replace("\xa0", " ") for line in
            textwrap.wrap(kept, _WIDTH, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False)]


def format_inspection(info: dict, every_file: bool = False) -> str:
    """:func:`inspect`'s dict as a table for people, within 80 columns: one labelled row per aspect, long rows
    wrapped, the files per rank folded (``every_file``: every name)."""
    rows = _rows(info)
    label = max(len(name) for name, _ in rows) + 2
    lines = [info["path"]]
    for name, text in rows:
        lines += _wrap(text, "  " + name.ljust(label), " " * (label + 2))
    if every_file:
        lines.append("  files per rank:")
        files = [f"{rank}: {', '.join(names)}" for rank, names in info["files_per_rank"].items()]
    else:
        lines.append("  files per rank (every name: --files or --json):")
        files = summarize_files(info["files_per_rank"])
    for line in files:
        lines += _wrap(line, "    ", "      ")
    return "\n".join(lines)
