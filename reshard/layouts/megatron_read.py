"""Reading a Megatron-Core ``torch`` checkpoint (``<root>/iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``): the
run's ``args`` (Namespace) to a model config and family (``hf_config`` record or the args themselves), the rank
folders scanned into a TP x PP x EP grid (missing ones refused), each rank's pickled tensors (read header-only, never
unpickled beyond tensors) checked against :func:`.megatron_ranks.rank_tensors` and read back into the canonical
model."""

from __future__ import annotations

import math
import os
import re
from dataclasses import replace

from reshard.core.canonical import build_canonical
from reshard.core.model_config import ConfigLoss, ModelConfig
from reshard.errors import CheckpointError
from reshard.io.heads import read_heads_while_torch_imports
from reshard.io.torch_format import TorchFile
from reshard.layouts.base import Options, Source, check_shape, chosen_architecture
from reshard.layouts.hf_config import read_meaning, without_dropped_settings, write_config as write_hf_config
from reshard.layouts.megatron_folders import _RANK_DIR, _iteration_dir, side_folders, true_vocab_size
from reshard.layouts import megatron_yarn
from reshard.layouts.megatron_args import RECORD_ONLY, meaning_from_args
from reshard.layouts.vision import megatron_vision, tower_views, unused_tower_tensor
from reshard.layouts.megatron_ranks import (GROUPED, LEGACY_GROUPED, NAME, RANK_FILE, _LAYER, ExpertGrid, rank_dir,
                                            rank_tensors)
from reshard.mapping import Family
from reshard.mapping_vlm import family_for_architecture, flat_view
from reshard.side_files import find_side_files


def read_args(args, opts: Options, folders: str | list[str], where: str) -> tuple[ModelConfig, Family, dict]:
    """A Megatron run's meaning (its args decide; a recorded ``hf_config`` only names the architecture and
    carries the config.json keys args have no place for), its family, and an HF-spelled config dict. ``folders``:
    where config.json / tokenizer.json may give the vocab size (:func:`side_folders`)."""
    vocab = true_vocab_size(args, opts, folders)
    recorded = getattr(args, "hf_config", None)
    recorded = dict(recorded) if isinstance(recorded, dict) else None
    named = (recorded.get("architectures") or [None])[0] if recorded else None
    architecture = chosen_architecture(named if isinstance(named, str) else None, opts,
                                       f"{where}: the args' hf_config")
    meaning = meaning_from_args(args, vocab, architecture, where)
    family = family_for_architecture(meaning.architecture, opts.mapping, recorded)
    if recorded and family.multimodal:
        recorded = flat_view(recorded)
    if recorded:  # settings the record holds that the family does not carry: refused unless allowed lossy
        recorded = without_dropped_settings(recorded, family, opts.allow_lossy_config)[0]
    meaning = _with_record_only(meaning, family, recorded, where)
    base = recorded or {"torch_dtype": _args_dtype(args)}
    if not recorded and "d" in family.dims:
        base[family.dim_key("d")] = meaning.head_dim
    config = write_hf_config(meaning, base, family, ConfigLoss("record"))  # losses are refused by each target
    return meaning, family, config


def _with_record_only(meaning: ModelConfig, family: Family, recorded: dict | None, where: str) -> ModelConfig:
    """``meaning`` with the fields Megatron-LM's args cannot spell (:data:`RECORD_ONLY`, a gated MLP's activation)
    from the ``hf_config`` record reshard writes into args, or, without one, from the family's fixed features
    (refused when the family has config-valued ones the args cannot give)."""
    if recorded is not None:
        dims = family.resolve_dims(recorded)
        spelled = read_meaning(recorded, family, meaning.architecture, dims, set(), meaning.tied, where)
        fields = {f: getattr(spelled, f) for f in RECORD_ONLY}
        if "mrope_section" in spelled.scaling or megatron_yarn.same_yarn(spelled.scaling, meaning):
            # the args spell the sections (Qwen3-VL's interleaving is recorded) / yarn (its spelling is recorded)
            fields["rope_scaling"] = spelled.rope_scaling
        if spelled.gated_mlp and spelled.activation != "silu":
            fields.update(gated_mlp=True, activation=spelled.activation)
        return meaning.replace(**fields)
    valued = [k for k in ("attn_softcap", "final_softcap", "rope_local_theta") if getattr(family.config, k)]
    if valued or (family.decoder.mlp == "gated" and family.decoder.activation not in ("silu", "swish")):
        what = ", ".join(valued) or f"its {family.decoder.activation} gated MLP"
        raise CheckpointError(f"{where}: a {meaning.architecture} needs {what}, which Megatron-LM's args cannot "
                              "spell and this checkpoint records no hf_config; convert from the Hugging Face "
                              "checkpoint instead")
    return meaning.replace(embedding_scaled=family.decoder.embedding_scaled,
                           sandwich_norm=family.role_spec("attn_output_norm") is not None)


def _args_dtype(args) -> str:
    dtype = str(getattr(args, "params_dtype", None))  # a torch.dtype or its stand-in: both print as torch.<name>
    if dtype not in ("torch.bfloat16", "torch.float16", "torch.float32"):
        dtype = "torch.bfloat16" if getattr(args, "bf16", False) else \
            "torch.float16" if getattr(args, "fp16", False) else "torch.float32"
    return dtype.removeprefix("torch.")


_FORMS = {1: "a pp=1 rank", 2: "a pp>1 or ep>1 rank", 3: "a pp>1 and ep>1 rank"}


def scan_rank_folders(folder: str) -> dict[tuple[int, ...], str]:
    """``mp_rank_*`` folders by their number groups (1 to 3: what the groups mean depends on the run's pp and
    ep, :func:`rank_grid`), each checked to hold its rank file; all folders must have the same form."""
    found: dict[tuple[int, ...], str] = {}
    forms: dict[int, str] = {}
    for name in sorted(os.listdir(folder)):
        m = _RANK_DIR.match(name)
        if not m:
            continue
        groups = tuple(int(g) for g in m.groups() if g is not None)
        forms.setdefault(len(groups), name)
        if len(forms) > 1:
            (na, a), (nb, b) = sorted(forms.items())[:2]
            raise CheckpointError(f"{folder} holds both {a} ({_FORMS[na]}) and {b} ({_FORMS[nb]}): folders of two "
                                  "runs are mixed; remove the one you do not mean")
        path = os.path.join(folder, name, RANK_FILE)
        if not os.path.isfile(path):
            raise CheckpointError(f"{os.path.join(folder, name)} has no {RANK_FILE}: the checkpoint is incomplete")
        found[groups] = path
    if not found:
        raise CheckpointError(f"{folder} has no mp_rank_* folders")
    return found


def missing_rank_folders(ranks, tp: int, pp: int, ep: int, etp: int) -> list[str]:
    """Folders a checkpoint needs but lacks. Every (tp, pp, ep) folder when the expert-TP degree equals tp; with
    a lower one Megatron-LM writes only some (a rank saves its (dense tp, ep) folder: moe.md 3.1), so what counts
    is that every dense TP rank and every (ep, expert-TP rank) of each stage is held by some folder."""
    if etp == tp:
        return [rank_dir(t, p, pp, e, ep) for p in range(pp) for e in range(ep) for t in range(tp)
                if (t, p, e) not in ranks]
    missing = []
    for p in range(pp):
        missing += [rank_dir(t, p, pp, 0, ep) for t in range(tp) if not any((t, p, e) in ranks for e in range(ep))]
        missing += [rank_dir(s, p, pp, e, ep) for e in range(ep) for s in range(etp)
                    if not any((t, p, e) in ranks for t in range(s, tp, etp))]
    return missing


def rank_grid(found: dict[tuple[int, ...], str], pp: int, ep: int, folder: str) -> dict[tuple[int, int, int], str]:
    """Rank files by (tp, pp, ep) rank: ``mp_rank_TT_PPP_EEE``; with two groups the second is the pipeline rank
    when the run's pp > 1, else the expert rank (Megatron-LM names them alike)."""
    grid = {}
    for groups, path in found.items():
        if len(groups) == 3:
            key = groups
        elif len(groups) == 2:
            key = (groups[0], groups[1], 0) if pp > 1 or ep == 1 else (groups[0], 0, groups[1])
        else:
            key = (groups[0], 0, 0)
        grid[key] = path
    if ep > 1 and all(len(g) < 3 for g in found) and pp > 1:
        raise CheckpointError(f"{folder}: args say pp={pp} and ep={ep} but the rank folders carry two numbers; "
                              "the checkpoint is inconsistent")
    return grid


def _scan_ranks(folder: str) -> dict[tuple[int, int], str]:
    """(tp, pp) rank files of a run without expert parallelism."""
    found = scan_rank_folders(folder)
    if any(len(g) == 3 for g in found):
        raise CheckpointError(f"{folder}: expert-parallel rank folders need the MoE reader")
    return {(g[0], g[1] if len(g) > 1 else 0): path for g, path in found.items()}


def _legacy_view(f: TorchFile, key: str, loc, shape: tuple[int, ...]):
    """Re-view a tensor's contiguous bytes as ``shape``, in the file's own table so reads see it: a legacy
    GroupedMLP tensor as its ``[E_loc, ...]`` blocks (what megatron-core's ``weight1.view(E_loc, H, -1)`` does),
    CLIP's ``[1, 1, H]`` class token as the ``[H]`` vector it is."""
    if loc.strides is not None or math.prod(loc.shape) != math.prod(shape):
        raise CheckpointError(f"{f.path}: '{key}' holds {tuple(loc.shape)}, which is not a view {tuple(shape)} of "
                              "this model's tensor (or is not contiguous)")
    view = replace(loc, shape=tuple(shape))
    f.tensors[key] = view
    return view


def open_source(path: str, opts: Options) -> Source:
    folder, iteration = _iteration_dir(path)
    folders = side_folders(path, folder)
    found_folders = scan_rank_folders(folder)
    read_heads_while_torch_imports(list(found_folders.values()))
    probe = TorchFile(found_folders[min(found_folders)])
    args = probe.structure.get("args") if isinstance(probe.structure, dict) else None
    probe.close()
    if args is None:
        raise CheckpointError(f"{probe.path}: no 'args' in the checkpoint: cannot tell the model config")
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    ranks = rank_grid(found_folders, int(getattr(args, "pipeline_model_parallel_size", 1) or 1), ep, folder)
    tp = max(t for t, _, _ in ranks) + 1
    pp = max(p for _, p, _ in ranks) + 1
    ep_found = max(e for _, _, e in ranks) + 1
    etp = int(getattr(args, "expert_tensor_parallel_size", None) or tp)
    missing = missing_rank_folders(ranks, tp, pp, ep_found, etp)
    if missing:
        raise CheckpointError(f"{folder}: rank folder {missing[0]} is missing (found tp={tp}, pp={pp}"
                              f"{f', ep={ep_found}' if ep_found > 1 else ''}); the checkpoint is incomplete")
    order = [(t, p, e) for p in range(pp) for e in range(ep_found) for t in range(tp) if (t, p, e) in ranks]
    files = [TorchFile(ranks[key]) for key in order]
    for f in files:  # megatron-core after 0.16 names an MTP layer's decoder layer mtp_model_layer
        for key in [k for k in f.tensors if ".mtp_model_layer." in k]:
            f.tensors[key.replace(".mtp_model_layer.", ".transformer_layer.", 1)] = f.tensors.pop(key)
    for label, value, found in (("tensor", getattr(args, "tensor_model_parallel_size", tp), tp),
                                ("pipeline", getattr(args, "pipeline_model_parallel_size", pp), pp),
                                ("expert", ep, ep_found)):
        if value != found:
            raise CheckpointError(f"{folder}: args say {label}_model_parallel_size={value} but the rank folders "
                                  f"give {found}: the checkpoint is inconsistent or incomplete")
    meaning, family, config = read_args(args, opts, folders, folder)
    vocab = meaning.vocab

    # Which chunks (model / model0, model1, ...) each rank file holds, and their layer counts.
    chunk_layers: dict[tuple[int, str], int] = {}
    names_all: set[str] = set()
    for (t, p, e), f in zip(order, files):
        chunks = [k for k in f.structure if k == "model" or re.fullmatch(r"model\d+", str(k))]
        if not chunks:
            raise CheckpointError(f"{f.path}: no 'model' state dict in the checkpoint")
        for chunk in chunks:
            count = 0
            for key in f.structure[chunk]:
                names_all.add(key)
                m = _LAYER.match(key)
                if m:
                    count = max(count, int(m.group(1)) + 1)
            chunk_layers.setdefault((p, chunk), count)
    chunk_keys = sorted({c for _, c in chunk_layers}, key=lambda c: -1 if c == "model" else int(c[5:]))
    spec_name = "te" if any(n.endswith(".layer_norm_weight") for n in names_all) else "local"
    vision = "native" if any(n.startswith("vision_model.decoder.layers.") for n in names_all) else "hf"
    grouped = any(GROUPED.search(n) for n in names_all)
    legacy_grouped = any(LEGACY_GROUPED.search(n) for n in names_all)
    starts, offset = {}, 0
    for chunk in chunk_keys:
        for p in range(pp):
            starts[(p, chunk)] = offset
            offset += chunk_layers.get((p, chunk), 0)
    legacy = sorted(n for n in names_all if n.startswith(("language_model", "encoder.", "word_embeddings"))
                    and not (family.multimodal and n.startswith("language_model.")))
    if legacy:
        raise CheckpointError(f"{folder}: the rank files use legacy (pre-Megatron-Core) Megatron-LM names such as "
                              f"'{legacy[0]}'; reshard reads Megatron-Core (mcore) checkpoints: convert it with "
                              "Megatron-LM's tools/checkpoint (--saver mcore) first")
    if offset != meaning.layers:
        raise CheckpointError(f"{folder}: the rank files hold {offset} layers but args say "
                              f"{meaning.layers}: a pipeline stage is missing or inconsistent")

    present = set()
    for spec in family.weights:
        if spec.optional and spec.megatron_name(spec_name).format(layer=0) in names_all:
            present.add(spec.hf)
    tied = meaning.tied
    model = build_canonical(family, config, present, tied)
    if family.multimodal:
        megatron_vision(model, vision)  # a layout the family has
    views = tower_views(model, spec_name, vision)
    model.meaning = meaning
    for group, templates in family.config.bias_groups:
        has = all(family.holds(t, present) for t in templates)
        if has != getattr(meaning, f"{group}_bias"):
            raise CheckpointError(f"{folder}: the args {'do not ' if has else ''}ask for {group} biases but the rank "
                                  f"files {'hold' if has else 'lack'} them (add_bias_linear="
                                  f"{getattr(args, 'add_bias_linear', None)}, add_qkv_bias="
                                  f"{getattr(args, 'add_qkv_bias', None)}): the checkpoint is inconsistent")
    emb_spec = next(s for s in family.weights if s.split == "vocab" and s.stage == "first")
    emb_loc = files[0].tensors.get(f"{chunk_keys[0]}/{emb_spec.megatron_name(spec_name)}")
    if emb_loc is None:
        raise CheckpointError(f"{files[0].path}: no {emb_spec.megatron_name(spec_name)} in the first stage")
    padded = emb_loc.shape[0] * tp
    if padded < vocab:
        raise CheckpointError(f"the embedding holds {padded} rows over tp={tp}, fewer than the vocab size {vocab}; "
                              "--vocab-size or the recorded vocab is wrong")

    stored, expected_names = [], []
    for index, ((t, p, e), f) in enumerate(zip(order, files)):
        expected_names.append(set())
        for chunk in chunk_keys:
            if (p, chunk) not in chunk_layers:
                continue
            start = starts[(p, chunk)]
            layers = list(range(start, start + chunk_layers[(p, chunk)]))
            is_first = p == 0 and chunk == chunk_keys[0]
            is_last = p == pp - 1 and chunk == chunk_keys[-1]
            for tensor in rank_tensors(model, tp, t, layers, is_first, is_last, spec_name, padded,
                                       ExpertGrid(ep_found, etp, e, grouped, legacy_grouped), vision):
                key = f"{chunk}/{tensor.name}"
                loc = f.tensors.get(key)
                if loc is not None and ((tensor.stacked and tensor.transposed) or tensor.name in views):
                    loc = _legacy_view(f, key, loc, tensor.shape)
                if loc is None and unused_tower_tensor(model, tensor):
                    continue  # a tower built with only the blocks LLaVA uses: they read as absent
                if loc is None:
                    raise CheckpointError(f"{f.path}: tensor '{tensor.name}' is missing from the rank file")
                check_shape(f.path, tensor.name, loc.shape, tensor.shape)
                stored.append((index, replace(tensor, name=key)))
                expected_names[-1].add(key)
                for piece in tensor.pieces:
                    if piece.canonical:
                        model.dtypes.setdefault(piece.canonical, loc.dtype)
        for key in f.tensors:
            if key.split("/")[0] in chunk_keys and key not in expected_names[-1] and "_extra_state" not in key:
                raise CheckpointError(f"{f.path}: unexpected tensor '{key.split('/', 1)[1]}' for mapping "
                                      f"'{family.name}' (a config / weights mismatch?)")
    dropped = sorted({k for f in files for k in f.structure if k not in ("model", "args", "checkpoint_version",
                                                                        "iteration") and k not in chunk_keys})
    beside = sorted({n for path in ranks.values() for n in os.listdir(os.path.dirname(path)) if n != RANK_FILE})
    if beside:  # e.g. distrib_optim.pt: the distributed optimizer's state, saved beside each rank's model file
        dropped.append(f"files beside the rank files ({', '.join(beside)}: e.g. distributed optimizer state)")
    info = {"args": args, "iteration": iteration, "spec": spec_name, "padded_vocab": padded,
            "vocab_divisor": getattr(args, "make_vocab_size_divisible_by", None), "dropped": dropped}
    return Source(layout=NAME, root=path, model=model, files=files, stored=stored,
                  degrees={"tp": tp, "pp": pp, **({"ep": ep_found, "etp": etp} if model.num_experts else {})},
                  info=info, side_files=find_side_files(folders, config))
