"""Megatron-Core ``torch_dist`` (reading): ``<root>/latest_checkpointed_iteration.txt`` and
``<root>/iter_XXXXXXX/`` (or ``release/``, or the iteration folder itself) holding ``metadata.json``
(``"sharded_backend": "torch_dist"``), ``common.pt`` (the run's ``args``), ``.metadata`` and ``__*.distcp`` data
(see :mod:`reshard.io.dcp`). NeMo 2 prefixes every key with ``module.``.

Tensors are global, independent of the TP/PP the run used, and equal Megatron's TP=1 layout (group-major
``linear_qkv``, ``linear_fc1`` = ``[all gates; all ups]``, norms under the Transformer Engine names even for the
local spec), with the layers either stacked (``decoder.layers.<name>`` of shape ``[L, ...]``) or per layer
(``decoder.layers.<i>.<name>``; ``linear_fc1`` then possibly split into ``weight_w`` (gates) and ``weight_v``
(ups)). Chunks (one per layer and TP shard when Megatron writes them) may split a tensor along the layer axis and
along its own split axis; each becomes one stored tensor whose pieces are that range of the TP=1 layout. Byte
items (``_extra_state``, RNG state) and optimizer tensors are skipped, named in a note.
"""

from __future__ import annotations

import json
import math
import os
import re

from reshard.core.canonical import build_canonical
from reshard.core.pieces import StoredTensor
from reshard.errors import CheckpointError
from reshard.io import dtypes
from reshard.io.dcp import DcpTensor, DistcpFile, metadata_pickle, read_metadata, written_chunks
from reshard.io.partial import replace_with_text
from reshard.io.heads import read_heads_while_torch_imports
from reshard.io.regular import open_regular
from reshard.io.torch_format import TorchFile, TorchZipWriter, object_archive
from reshard.layouts import gdn_rules, megatron
from reshard.layouts.vision import megatron_vision, tower_views, unused_tower_tensor
from reshard.layouts.base import (Layout, Options, Source, TargetPlan, TargetSpec, pack_by_size,
                                  stored_dtype)
from reshard.layouts.dcp_chunks import chunk_tensors, slice_pieces
from reshard.layouts.torch_dist_keys import (Location, expert_objects_missing, extra_state_keys, location, other_spelling,
                                             stacked_layers)
from reshard.side_files import find_side_files

NAME = "torch_dist"
CONFIG = "metadata.json"
COMMON = "common.pt"
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_SKIPPED = ("optimizer.", "chained_")


def _iteration_folder(path: str) -> tuple[str, str]:
    """(iteration folder, iteration label) of a root or an iteration folder."""
    if os.path.isfile(os.path.join(path, CONFIG)):
        return path, megatron._label(os.path.basename(os.path.normpath(path)))
    return megatron._iteration_dir(path)


def _check_backend(folder: str) -> None:
    path = os.path.join(folder, CONFIG)
    try:
        with open_regular(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no {CONFIG}: the distributed checkpoint is incomplete (it is "
                              "written last)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from None
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    if backend != "torch_dist":
        raise CheckpointError(f"{path}: sharded_backend is {backend!r}; reshard reads 'torch_dist' checkpoints")


class _Index:
    """The model tensors of a DCP folder by key (``module.`` stripped), with the stacked layer count."""

    def __init__(self, tensors: dict[str, DcpTensor]):
        self.tensors = {}
        self.skipped = set()
        for key, tensor in tensors.items():
            if key.startswith(_SKIPPED) or key.startswith("module.optimizer"):
                self.skipped.add("optimizer state")
                continue
            self.tensors[key.removeprefix("module.")] = tensor

    def regions(self, name: str, unit_axes: int = 0) -> list[tuple[DcpTensor, Location, int]] | None:
        """Where the TP=1 tensor ``name`` lives: (DCP tensor, its location: key and indices into the tensor's
        prepended layer / expert axes, row offset of ``name`` inside it), or None when the folder does not hold it. Tries the
        per-layer key, then the stacked one, under either spelling of the pre-MLP norm (:mod:`torch_dist_keys`)."""
        for spelled in (name, other_spelling(name)):
            if spelled is None:
                continue
            for stacked in (False, True):
                loc = location(spelled, stacked, unit_axes)
                tensor = self.tensors.get(loc.key)
                if tensor is not None:
                    return [(tensor, loc, 0)]
        m = _LAYER_KEY.match(name)
        if m and m.group(2).endswith("linear_fc1.weight"):  # singleton_local_shards: gates in _w, ups in _v
            w, v = self.tensors.get(name + "_w"), self.tensors.get(name + "_v")
            if w is not None and v is not None:
                return [(w, Location(w.key), 0), (v, Location(v.key), w.shape[0])]
        return None


def open_source(path: str, opts: Options) -> Source:
    folder, label = _iteration_folder(path)
    folders = megatron.side_folders(path, folder)
    _check_backend(folder)
    common_path = os.path.join(folder, COMMON)
    if not os.path.exists(common_path):  # a FIFO or device there is refused by name when read
        raise CheckpointError(f"{folder} has no {COMMON} (megatron-core 0.19+ keeps the run's args inside the "
                              "data files): not supported yet")
    read_heads_while_torch_imports(sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".distcp")))
    common = TorchFile(common_path).structure
    if not isinstance(common, dict) or "args" not in common:
        raise CheckpointError(f"{common_path}: no 'args': cannot tell the model config")
    args = common["args"]
    tensors, objects = read_metadata(folder)
    index = _Index(tensors)
    meaning, family, config = megatron.read_args(args, opts, folders, folder)
    present = {spec.hf for spec in family.weights if spec.optional and _holds(index, family, config, spec)}
    model = build_canonical(family, config, present, meaning.tied)
    model.meaning = meaning
    emb_spec = next(s for s in family.weights if s.split == "vocab" and s.stage == "first")
    emb = index.regions(emb_spec.megatron_te)
    if emb is None:
        raise CheckpointError(f"{folder}: no '{emb_spec.megatron_te}' in the checkpoint")
    padded = emb[0][0].shape[0]
    if padded < meaning.vocab:
        raise CheckpointError(f"{folder}: the embedding holds {padded} rows, fewer than the vocab size "
                              f"{meaning.vocab}; --vocab-size or the recorded vocab is wrong")
    vision = "native" if any(k.startswith("vision_model.decoder.layers.") for k in index.tensors) else "hf"
    layout = gdn_rules.per_section(model, megatron.rank_tensors(model, 1, 0, list(range(model.num_layers)), True,
                                                                True, "te", padded, vision=vision))
    views = tower_views(model, "te", vision)
    files: dict[str, DistcpFile] = {}
    stored, used, locations = [], set(), []
    for target in layout:
        regions = index.regions(target.name, unit_axes(views, target))
        if regions is None and unused_tower_tensor(model, target):
            continue  # a tower built with only the blocks LLaVA uses: they read as absent
        if regions is None:
            raise CheckpointError(f"{folder}: tensor '{target.name}' is missing from the checkpoint (the args say "
                                  f"{model.num_layers} layers)")
        used.update(t.key.removeprefix("module.") for t, _, _ in regions)
        locations.extend(loc for _, loc, _ in regions)
        for data, tensor in chunk_tensors(files, folder, target, regions):
            stored.append((data, tensor))
            for piece in tensor.pieces:
                if piece.canonical:
                    model.dtypes.setdefault(piece.canonical, data.tensors[tensor.name].dtype)
    extra = sorted(k for k in set(index.tensors) - used if other_spelling(k) not in used)
    if extra:
        raise CheckpointError(f"{folder}: unexpected tensor '{extra[0]}' for mapping '{family.name}' (a config / "
                              "weights mismatch?)")
    held = {k.removeprefix("module.") for k in objects}
    if model.num_experts and any("_extra_state/" in k for k in held):
        missing = expert_objects_missing(locations, index.tensors, held)
        if missing:  # megatron-core writes one per global expert: a rank's objects are lost
            raise CheckpointError(f"{folder}: '{missing}' is missing (megatron-core stores one _extra_state per "
                                  "expert and loads strictly): the checkpoint is incomplete; copy it again")
    order = sorted(files)
    file_list = [files[name] for name in order]
    position = {id(f): i for i, f in enumerate(file_list)}
    dropped = sorted(index.skipped | {_object_kind(k) for k in objects})
    info = {"args": args, "iteration": label, "padded_vocab": padded, "dropped": dropped, "spec": "te",
            "vocab_divisor": getattr(args, "make_vocab_size_divisible_by", None),
            "saved_degrees": {"tp": getattr(args, "tensor_model_parallel_size", None),
                              "pp": getattr(args, "pipeline_model_parallel_size", None)}}
    degrees = {"tp": 1, "pp": 1}
    if model.num_experts:
        degrees.update(ep=1, etp=1)
        info["saved_degrees"].update(ep=getattr(args, "expert_model_parallel_size", None) or 1,
                                     etp=getattr(args, "expert_tensor_parallel_size", None)
                                     or info["saved_degrees"]["tp"])
    return Source(layout=NAME, root=path, model=model, files=file_list,
                  stored=[(position[id(f)], t) for f, t in stored], degrees=degrees, info=info,
                  side_files=find_side_files(folders, config))


def _holds(index: _Index, family, config: dict, spec) -> bool:
    """Whether the folder holds optional weight ``spec`` (looked up on the first layer that has it)."""
    count = int(config[family.dim_key("L")])
    sparse = family.sparse_layers(config, count)
    layer = next((i for i in range(count) if spec.on_layer(i in sparse)), None)
    if layer is None:
        return False
    return index.regions(spec.megatron_name("te", layer in sparse).format(layer=layer, expert=0)) is not None


def _object_kind(key: str) -> str:
    base = key.split("/shard_")[0]
    if base.endswith("_extra_state"):
        return "_extra_state"
    return base.split(".")[0]


# ---------------------------------------------------------------------------------------------- writing

DATA_FILES = 2  # __0_0.distcp, __0_1.distcp: two writer processes can share the work


def unit_axes(views: dict[str, tuple[int, ...]], tensor: StoredTensor) -> int:
    """The size-1 axes a tensor Megatron stores as a view of another shape has in front (CLIP's class token)."""
    return len(views[tensor.name]) - len(tensor.shape) if tensor.name in views else 0


def located_tensors(model, padded: int, vision: str = "hf") -> list[tuple[StoredTensor, Location]]:
    """The model's TP=1 Megatron tensors (Transformer Engine names, vocab padded to ``padded``, a vision tower in
    layout ``vision``), each with its place in a torch_dist folder
    (:func:`~reshard.layouts.torch_dist_keys.location`)."""
    stacked = stacked_layers(model)
    views = tower_views(model, "te", vision)
    return [(t, location(t.name, stacked, unit_axes(views, t)))
            for t in gdn_rules.per_section(model, megatron.rank_tensors(
                model, 1, 0, list(range(model.num_layers)), True, True, "te", padded, vision=vision))]


def target_chunks(model, located: list[tuple[StoredTensor, Location]], tp: int, etp: int | None = None,
                  vision: str = "hf"
                  ) -> list[tuple[str, tuple[int, ...], StoredTensor, tuple[int, ...], tuple[int, ...]]]:
    """Every chunk Megatron would store at ``tp`` (routed experts at expert-TP ``etp``, default ``tp``): (DCP key,
    global shape, chunk as pieces of the canonical tensors, saved shape, global offsets). Keys and prepended
    layer / expert axes by :func:`~reshard.layouts.torch_dist_keys.location` (one chunk per layer, expert and TP
    shard, each ``[1, ..., 1, rows, cols]``); TP-split tensors are cut in ``tp`` along their split axis
    (``linear_fc1`` in 2 x ``tp``: gates, then ups); replicated ones are one chunk. A Mixture of Experts also gets
    the pre-MLP norm under its other spelling (:func:`~reshard.layouts.torch_dist_keys.other_spelling`): a
    Transformer Engine load asks for one, a local-spec load for the other, and unrequested keys are ignored.
    ``located``: :func:`located_tensors`."""
    sizes = axis_sizes(model, located)
    out = []
    for tensor, loc in located:
        canonical = next(p.canonical for p in tensor.pieces if p.canonical)
        spec = model.tensors[canonical].spec
        split = spec.split_in("megatron", vision)
        degree = (etp or tp) if spec.per_expert else tp
        parts = 1 if split == "replicated" else 2 * degree if split == "gate_up" else degree
        lead = tuple(sizes[a] for a in loc.axes)
        alias = other_spelling(loc.key) if model.num_experts or loc.key.startswith("vision_model.") else None
        extent = tensor.shape[tensor.axis]
        for key in (loc.key, alias) if alias else (loc.key,):
            for c in range(parts):
                begin, stop = c * extent // parts, (c + 1) * extent // parts
                shape = tuple(stop - begin if i == tensor.axis else n for i, n in enumerate(tensor.shape))
                offsets = tuple(begin if i == tensor.axis else 0 for i in range(len(tensor.shape)))
                name = f"{key}@{','.join(map(str, loc.index))}:{','.join(map(str, offsets))}"
                chunk = StoredTensor(name, shape, tensor.axis, slice_pieces(tensor.pieces, begin, stop),
                                     value_offset=tensor.value_offset)
                out.append((key, (*lead, *tensor.shape), chunk, (1,) * len(lead) + shape, (*loc.index, *offsets)))
    return out


def axis_sizes(model, located: list[tuple[StoredTensor, Location]]) -> dict[str, int]:
    """The lengths of the axes megatron-core prepends: layers, routed experts, the native vision blocks and
    DeepStack mergers written, unit axes."""
    sizes = {"layer": model.num_layers, "expert": model.num_experts, "unit": 1}
    for axis in ("vblock", "ds"):
        sizes[axis] = 1 + max((loc.index[loc.axes.index(axis)] for _, loc in located if axis in loc.axes), default=-1)
    return sizes


def _targets(source: Source, opts: Options, dtype: str) -> TargetPlan:
    """The ``__0_{i}.distcp`` files of the global tensors, chunked as Megatron chunks them at ``opts.tp`` (and
    ``--etp``), and the ``_extra_state`` byte items (payload ``[None]``, what local layers store; Transformer
    Engine modules accept it too) a load may ask for (:func:`~reshard.layouts.torch_dist_keys.extra_state_keys`)."""
    model = source.model
    run = megatron.output_args(source, opts, dtype)  # the data does not depend on tp / pp / ep; the args do
    padded, iteration, folder, args = run.padded, run.iteration, run.folder, run.args
    args.ckpt_format = NAME
    args.no_save_optim = args.no_save_rng = True  # a model-only checkpoint: resuming asks for no optimizer state
    vision = megatron_vision(model, opts.megatron_vision)
    located = located_tensors(model, padded, vision)
    chunks = target_chunks(model, located, opts.tp, megatron.expert_tp(opts, model), vision)
    size = {c.name: dtypes.itemsize(stored_dtype(model, c, opts, dtype)) * math.prod(c.shape)
            for _, _, c, _, _ in chunks}
    groups = pack_by_size([c for _, _, c, _, _ in chunks], lambda c: size[c.name],
                          max(1, sum(size.values()) // DATA_FILES + 1))
    empty = object_archive([None])
    prefix = "language_model." if model.family.multimodal else ""
    objects = [(k, empty) for k in extra_state_keys([loc for _, loc in located], axis_sizes(model, located),
                                                    model.num_layers, stacked_layers(model), prefix)]
    saved_shape = {c.name: s for _, _, c, s, _ in chunks}
    specs = [TargetSpec(f"{folder}/__0_{i}.distcp", "distcp", group,
                        payload={"saved_shapes": {c.name: saved_shape[c.name] for c in group},
                                 "objects": objects if i == 0 else []})
             for i, group in enumerate(groups)]
    state = {"folder": folder, "iteration": iteration, "args": args,
             "chunks": {c.name: (key, shape, offsets, saved) for key, shape, c, saved, offsets in chunks},
             "object_keys": [k for k, _ in objects]}
    return TargetPlan(specs, state=state, notes=run.notes)


def _finalize(out: str, plan, state) -> None:
    """``.metadata`` from where each archive landed, ``common.pt``, ``metadata.json`` (marks the iteration
    complete), then the tracker last."""
    folder = os.path.join(out, state["folder"])
    dtype_of = {t.name: t.dtype for f in plan.files for t in f.tensors}
    tensors, objects, storage = {}, [], {}
    for spec in plan.files:
        relative = os.path.basename(spec.path)
        for name, offset, length in written_chunks(os.path.join(out, spec.path)):
            if name in state["chunks"]:
                key, shape, offsets, sizes = state["chunks"][name]
                tensors.setdefault(key, (dtype_of[name], shape, []))[2].append((offsets, sizes))
                storage[(key, offsets)] = (relative, offset, length)
            else:
                objects.append(name)
                storage[(name, None)] = (relative, offset, length)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        f.write(metadata_pickle(tensors, objects, storage, state["folder"]))
    iteration = 0 if state["iteration"] == "release" else int(state["iteration"])
    common = TorchZipWriter(os.path.join(folder, COMMON), {
        "args": state["args"], "checkpoint_version": 3.0, "iteration": iteration,
        "num_floating_point_operations_so_far": 0,
        "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}}, [])
    common.finish()
    replace_with_text(os.path.join(folder, CONFIG), json.dumps(
        {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
         "common_backend_version": 1}))
    megatron.finalize(out, state["iteration"], state["args"].hf_config)


class TorchDistLayout(Layout):
    """Megatron-Core ``torch_dist`` (torch.distributed.checkpoint) folders, read and written."""

    holds_mtp = True
    name = NAME
    summary = "Megatron-Core torch_dist (iter_*/ with metadata.json, .metadata and __*.distcp)"
    specificity = 20  # its root also has the tracker the torch-format layout looks for
    writes = True
    rank_loader = "reshard.verification.forward.sliced_rank:SlicedRankStream"
    rank_view_of = "megatron"  # a rank loads the same module tensors whichever format Megatron saved
    completion_markers = (megatron.TRACKER,)
    uses_options = frozenset({"vocab_divisor", "ep", "etp", "megatron_vision", "max_seq"})  # ep / etp: recorded in the args, and chunking
    instead = {"megatron_spec": "torch_dist checkpoints hold Transformer Engine (te) names; drop it, or use --to "
                                "megatron for the local spec"}

    def detect(self, names) -> bool:
        if CONFIG in names and ".metadata" in names:
            return True
        return any(n.endswith("/" + CONFIG) and n.count("/") == 1 and n.replace(CONFIG, ".metadata") in names
                   for n in names)

    def open(self, root: str, opts: Options) -> Source:
        return open_source(root, opts)

    def remote_files(self, names: list[str], read_text) -> list[str]:
        """The tracker and every file of the iteration folder it names (else of the only one present)."""
        folders = sorted({n.split("/")[0] for n in names if n.endswith("/" + CONFIG) and n.count("/") == 1})
        if megatron.TRACKER in names:
            wanted = megatron.iteration_folder_name(read_text(megatron.TRACKER))
        else:
            wanted = folders[0] if len(folders) == 1 else None
        if wanted not in folders:
            raise CheckpointError(f"the repo's tracker names {wanted}, which holds no torch_dist checkpoint"
                                  if megatron.TRACKER in names else "the repo holds several torch_dist iterations "
                                  "and no tracker: download the one you want with --include")
        files = [n for n in names if n.startswith(wanted + "/") and not n.endswith("/") and n.count("/") == 1]
        return sorted(files + [n for n in (megatron.TRACKER,) if n in names])

    def targets(self, source: Source, opts: Options, dtype: str):
        return _targets(source, opts, dtype)

    def finalize(self, out: str, source: Source, plan, state) -> None:
        _finalize(out, plan, state)

    def describe(self, source: Source) -> dict:
        return {"padded_vocab_size": source.info["padded_vocab"], "iteration": source.info["iteration"],
                **{f"saved_{k}": v for k, v in source.info["saved_degrees"].items()}}
