"""``--to maxtext``: a MaxText parameter checkpoint ``<out>/0/items`` (``load_parameters_path``), maxtext-orbax.md 7.5.

The executor first writes every canonical tensor, whole and unchanged, into staging safetensors files (one per
layer, under ``.maxtext-staging/``; the leaves that get an element op staged as float32, an exact upcast); then
:func:`finalize` builds each MaxText leaf layer by layer — HF ``[out, in]`` -> Meta's RoPE row order for q/k where
the model uses it -> transposed to ``[in, out]`` and reshaped (q/k/v ``[H, n, d]``, o ``[n, d, H]``, experts
stacked ``[E, in, out]``) -> the float32 element ops (query pre-scale, Gemma's ``1 + w`` and ``* sqrt(H)``) ->
rounded once to the leaf's dtype — and writes it with TensorStore: scanned leaves one layer per chunk (axis 1),
the leading axis split in 16 where it divides, zstd level 1. Leaves whose MaxText value a bf16 constant would round
(Gemma norms and embedding, a query scale that is not a power of two) are float32 (float64 for a float32 model:
the source then reads back bit for bit) unless ``--maxtext-match-converter``. ``_CHECKPOINT_METADATA`` (``scan_layers`` and reshard's provenance: the model name
and the HF config, for the way back) is written last.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from dataclasses import dataclass, field, replace

import numpy as np

from reshard.errors import PlanError
from reshard.io import dtypes
from reshard.io.orbax_write import ItemWriter, checkpoint_metadata, commit_note, numpy_of
from reshard.io.partial import replace_with_text
from reshard.layouts.base import Options, Source, TargetPlan, TargetSpec, stored_dtype
from reshard.layouts.hf import planned_config
from reshard.layouts.maxtext_read import half_to_interleaved
from reshard.layouts.maxtext_scratch import bound_heap, release_freed
from reshard.mapping.maxtext_names import embedding_factor, family_table, maxtext_vocab, place, query_factor
from reshard.version import __version__

STAGING = ".maxtext-staging"
STEP = "0"
SPLIT = 16  # MaxText's converter splits the leading axis over 16 simulated devices
EXPERT_CHUNK_BYTES = 64 << 20
BAND_BYTES = 32 << 20  # a leaf outside the stack is written in row bands of about this size


@dataclass
class Member:
    """One canonical tensor's place in a leaf: its layer index (None: unstacked) and expert."""

    name: str
    file: str
    index: int | None
    expert: int | None


@dataclass
class LeafPlan:
    name: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...]
    per_layer: tuple[int, ...]  # the MaxText shape of one layer (one expert stack)
    kernel: bool
    rope: int = 0
    mul: float | None = None
    add: float | None = None
    members: list[Member] = field(default_factory=list)
    vocab: int = 0  # the HF vocab rows of an embedding / head whose MaxText vocab differs (else 0)


def per_layer_shape(tensor, model) -> tuple[int, ...]:
    """The MaxText shape of one HF tensor (section 3): q/k/v ``[in, n, d]``, o ``[n, d, out]``, MLA up-projections
    ``[r, nh, per-head]``, q/k/v biases ``[n, d]``, other kernels ``[in, out]``, vectors as they are."""
    shape = tensor.shape
    role = tensor.spec.role or ""
    nh = model.dims.get("nh", 1)
    ng = model.dims.get("ng", nh)
    if role == "embedding" or len(shape) == 1 and not role.endswith("_bias"):
        return tuple(shape)
    if len(shape) == 1:  # q/k/v bias [n * d] -> [n, d]
        n = ng if role in ("k_bias", "v_bias") else nh
        return (n, shape[0] // n) if role in ("q_bias", "k_bias", "v_bias") else tuple(shape)
    out, inp = shape
    if role in ("q", "k", "v", "q_b", "kv_b"):
        n = ng if role in ("k", "v") and not model.family.mla else nh
        return (inp, n, out // n)
    if role == "o":
        return (nh, inp // nh, out)
    return (inp, out)


def chunks_of(shape: tuple[int, ...], layer_axis: bool, experts: bool, itemsize: int) -> tuple[int, ...]:
    """One layer per chunk along the scan axis; the leading axis in 16 (the last chunk may be short); an expert
    stack whose layer exceeds ``EXPERT_CHUNK_BYTES``: one expert per chunk."""
    chunks = list(shape)
    if layer_axis:
        chunks[1] = 1
    if experts and math.prod(chunks) * itemsize > EXPERT_CHUNK_BYTES:
        chunks[0] = 1
    elif chunks and chunks[0] >= SPLIT:
        chunks[0] = -(-chunks[0] // SPLIT)
    return tuple(chunks)


def _exact_power_of_two(value: float) -> bool:
    mantissa, _ = math.frexp(value)
    return mantissa == 0.5


def plan_leaves(model, table, conv, config: dict, scan: bool, dtype_of, match: bool,
                vocab: int | None = None) -> list[LeafPlan]:
    """Every leaf of the output, its dtype and chunks, and the canonical tensors that fill it; the embedding and
    head hold ``vocab`` rows (MaxText's vocab_size) where given."""
    leaves: dict[str, LeafPlan] = {}
    for name, tensor in model.tensors.items():
        spec = tensor.spec
        if spec.hf not in table.weights:
            raise PlanError(f"mapping '{model.family.name}' has no MaxText name for {spec.hf}: the model cannot be "
                            "written as a MaxText checkpoint")
        at = place(table, spec.hf, tensor.layer, model, scan)
        role = spec.role
        per = per_layer_shape(tensor, model)
        if tensor.expert is not None:
            per = (model.num_experts, *per)
        resized = vocab is not None and vocab != model.vocab_size and role in ("embedding", "lm_head")
        if resized:
            per = (vocab, per[1]) if role == "embedding" else (per[0], vocab)
        base = dtype_of(name)
        mul = add = None
        rope = model.head_dim if conv.rope == "interleaved" and role in ("q", "k") else 0
        if role == "q" and conv.query_scale:
            mul = float(1 / np.sqrt(query_factor(conv, config, model.head_dim)))
        elif role == "embedding" and conv.embedding_scale:
            mul = embedding_factor(conv, model.dims["H"])
        if conv.norm_offset and at.leaf.endswith(".scale"):
            add = conv.norm_offset
        inexact = (mul is not None and not _exact_power_of_two(mul)) or add is not None
        wide = "F64" if base == "F32" else "F32"  # holds the op's result exactly enough to read back the source
        dtype = wide if inexact and not match else base
        leaf = leaves.get(at.leaf)
        if leaf is None:
            shape = (per[0], at.stacked, *per[1:]) if at.index is not None else per
            chunks = chunks_of(shape, at.index is not None, tensor.expert is not None, dtypes.itemsize(dtype))
            leaf = leaves[at.leaf] = LeafPlan(at.leaf, shape, dtype, chunks, per,
                                              len(tensor.shape) == 2 and role != "embedding", rope, mul, add,
                                              vocab=model.vocab_size if resized else 0)
        file = f"{STAGING}/layer-{tensor.layer:05d}.safetensors" if tensor.layer is not None else \
            f"{STAGING}/top.safetensors"
        leaf.members.append(Member(name, file, at.index, tensor.expert))
    return list(leaves.values())


def targets(source: Source, opts: Options, dtype: str) -> TargetPlan:
    from reshard.io.orbax_store import tensorstore

    tensorstore()
    if opts.tp != 1 or opts.pp != 1:
        raise PlanError("a MaxText checkpoint holds the whole model (the writer's mesh is not stored): --tp and --pp "
                        "must be 1 for --to maxtext")
    model = source.model
    table = family_table(model.family)
    name = opts.maxtext_model or source.info.get("maxtext", {}).get("model") or None
    conv = table.conventions(model.meaning.architecture, name, "--to maxtext")
    config, notes = planned_config(model, dtype, opts, "MaxText")
    requested = opts.maxtext_vocab_size if opts.maxtext_vocab_size is not None else \
        source.info.get("maxtext", {}).get("vocab_size")  # MaxText -> MaxText: the source's
    vocab = maxtext_vocab(conv, model.vocab_size, requested, "vocab" in opts.allow_lossy_config)
    leaves = plan_leaves(model, table, conv, config, opts.scan_layers,
                         lambda n: stored_dtype(model, model.tensors[n].whole(), opts, dtype),
                         opts.maxtext_match_converter, vocab)
    staged_f32 = {m.name for leaf in leaves if leaf.mul is not None or leaf.add is not None for m in leaf.members}
    files: dict[str, list] = {}
    for leaf in leaves:
        for m in leaf.members:
            stored = model.tensors[m.name].whole()
            if m.name in staged_f32:
                stored = replace(stored, dtype="F32")
            files.setdefault(m.file, []).append(stored)
    specs = [TargetSpec(path, "safetensors", tensors) for path, tensors in sorted(files.items())]
    if model.mtp_layers:
        notes.append("MaxText checkpoints hold no MTP layers: they are not written")
    wide = [leaf.name for leaf in leaves if leaf.dtype != dtype and (leaf.mul is not None or leaf.add is not None)]
    if wide:
        notes.append(f"{len(wide)} leaves written as {'float64' if dtype == 'F32' else 'float32'}, as {dtype} would "
                     "round their MaxText value (query pre-scale, Gemma's 1 + w and sqrt(H)) and lose the source "
                     f"on the way back; --maxtext-match-converter writes them in {dtype} as MaxText's to_maxtext does")
    if vocab < model.vocab_size:  # the way back reads the truncated model: its provenance config says so
        for part in (config, config.get("text_config")):
            if isinstance(part, dict) and "vocab_size" in part:
                part["vocab_size"] = vocab
    if vocab != model.vocab_size:
        notes.append(f"MaxText vocab_size {vocab}: the embedding{'' if model.tied else ' and head'} "
                     + (f"padded with {vocab - model.vocab_size} zero rows" if vocab > model.vocab_size else
                        f"truncated to {vocab} rows (tokens {vocab}..{model.vocab_size - 1} dropped, "
                        "--allow-lossy-config vocab)") + f"; run MaxText with vocab_size={vocab}")
    notes.append(f"load it with load_parameters_path=<output>/{STEP}/items scan_layers={opts.scan_layers} "
                 f"(MaxText model {conv.model})")
    state = {"leaves": leaves, "config": config, "scan": opts.scan_layers, "model": name or conv.model,
             "vocab": vocab}
    return TargetPlan(specs, state=state, notes=notes)


def _staged(files: dict, out: str, member: Member):
    """The staging file holding ``member`` (the previous one closed: files are read one after another)."""
    from reshard.io.safetensors_format import SafetensorsFile

    f = files.get(member.file)
    if f is None:
        for other in files.values():
            other.close()
        files.clear()
        f = files[member.file] = SafetensorsFile(os.path.join(out, member.file))
    return f


def _ops(leaf: LeafPlan, x):
    """The element ops of ``leaf`` in float32 (float64 for a float64 leaf, with the exact constants), then the cast
    to its dtype (rounded once)."""
    import torch

    if leaf.mul is not None or leaf.add is not None:
        x = x.double() if leaf.dtype == "F64" else x.float()
        if leaf.mul is not None:
            x = x * torch.tensor(leaf.mul, dtype=x.dtype)
        if leaf.add is not None:
            x = x + torch.tensor(leaf.add, dtype=x.dtype)
    return x.to(dtypes.to_torch(leaf.dtype)).contiguous()


def maxtext_value(leaf: LeafPlan, x):
    """One canonical tensor as MaxText stores it (see the module docstring)."""
    if leaf.rope:
        x = half_to_interleaved(x, leaf.rope)
    if leaf.kernel:
        x = x.t()
    per = leaf.per_layer[1:] if leaf.members[0].expert is not None else leaf.per_layer
    return _ops(leaf, x.reshape(per))


def bands(leaf: LeafPlan) -> list[tuple[int, int]]:
    """Row ranges of a 2-D leaf: whole chunk rows, about ``BAND_BYTES`` each."""
    rows, step = leaf.shape[0], leaf.chunks[0]
    row_bytes = leaf.shape[1] * dtypes.itemsize(leaf.dtype)
    step *= max(1, BAND_BYTES // max(step * row_bytes, 1))
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _band(leaf: LeafPlan, f, name: str, r0: int, r1: int):
    """Rows ``[r0, r1)`` of a 2-D leaf outside the stack; an embedding or head of another vocab than the HF one:
    the HF rows (columns of a kernel) cut at MaxText's vocab_size, then zero rows (columns) up to it."""
    import torch

    if leaf.kernel:
        x = _ops(leaf, f.read(name, 1, r0, r1 - r0).t())
        if leaf.vocab:
            x = x[:, :leaf.shape[1]]
            x = torch.cat([x, x.new_zeros(r1 - r0, leaf.shape[1] - x.shape[1])], 1) if x.shape[1] < leaf.shape[1] \
                else x
        return x.contiguous()
    stop = min(r1, leaf.vocab) if leaf.vocab else r1
    x = _ops(leaf, f.read(name, 0, r0, stop - r0)) if stop > r0 else None
    if stop < r1:
        pad = torch.zeros(r1 - stop, leaf.shape[1], dtype=dtypes.to_torch(leaf.dtype))
        x = pad if x is None else torch.cat([x, pad])
    return x


def write_leaf(writer: ItemWriter, arr, leaf: LeafPlan, files: dict, out: str) -> None:
    """Every member of ``leaf`` into ``arr``: per layer; expert stacks one expert at a time; a 2-D leaf outside
    the stack (embedding, head) in row bands read from the staging file (a kernel's stored rows are HF columns)."""
    for m in sorted(leaf.members, key=lambda m: (m.index or 0, m.expert or 0)):
        f = _staged(files, out, m)
        if m.expert is not None:
            at = (m.expert, m.index) if m.index is not None else (m.expert,)
            writer.write(arr, at, numpy_of(maxtext_value(leaf, f.read(m.name))))
        elif m.index is None and len(leaf.shape) == 2:
            for r0, r1 in bands(leaf):
                writer.write(arr, (slice(r0, r1),), numpy_of(_band(leaf, f, m.name, r0, r1)))
        else:
            at = (slice(None), m.index) if m.index is not None else ()
            writer.write(arr, at, numpy_of(maxtext_value(leaf, f.read(m.name))))
        release_freed()


def finalize(out: str, source: Source, plan, state) -> None:
    bound_heap()
    step = os.path.join(out, STEP)
    writer = ItemWriter(os.path.join(step, "items"))
    files: dict = {}
    try:
        for leaf in state["leaves"]:
            arr = writer.array(leaf.name, leaf.shape, leaf.dtype, leaf.chunks)
            write_leaf(writer, arr, leaf, files, out)
        step_arr = writer.array("step", (), "I64", (), value_type="scalar")
        writer.write(step_arr, (), np.array(0, np.int64))
        writer.finish()
    finally:
        for f in files.values():
            f.close()
    shutil.rmtree(os.path.join(out, STAGING))
    commit_note(step)
    custom = {"scan_layers": state["scan"],
              "reshard": {"version": __version__, "maxtext_model": state["model"], "hf_config": state["config"],
                          "maxtext_vocab_size": state["vocab"]}}
    replace_with_text(os.path.join(step, "_CHECKPOINT_METADATA"), checkpoint_metadata(custom, time.time_ns()))
