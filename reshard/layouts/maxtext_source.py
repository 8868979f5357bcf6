"""Opening a MaxText checkpoint as a reshard source (maxtext-orbax.md sections 2-4, 7.2, 7.6).

The model is described by ``--config`` (the HF config.json) or reshard's provenance in the step's
``custom_metadata`` (``{"reshard": {"hf_config", "maxtext_model"}}``); its family's ``[maxtext]`` table names every
leaf and the model name (``--maxtext-model`` or the provenance) gives the conventions the weights cannot show.
Every expected leaf must exist with the shape the config implies; leaves under ``params/params`` that the family
does not map are refused; optimizer state, ``step`` and ``nnx_aux`` are ignored with a note.
"""

from __future__ import annotations

import numpy as np

from reshard.core.canonical import build_canonical, instance
from reshard.errors import CheckpointError
from reshard.io.orbax_store import Item, tensorstore
from reshard.layouts import hf
from reshard.layouts.base import Options, Source, read_json_object
from reshard.layouts.maxtext_folders import locate
from reshard.layouts.maxtext_read import MaxTextFile, Recipe
from reshard.mapping.maxtext_names import PREFIX, Conventions, embedding_factor, family_table, place, query_factor
from reshard.mapping_vlm import family_for_architecture

NAME = "maxtext"
CONFIG_DTYPES = {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}


def source_config(loc, opts: Options) -> tuple[dict, str | None, list[str]]:
    """``(HF config, MaxText model name, notes)`` from ``--config`` / ``--maxtext-model`` or the provenance."""
    prov = loc.custom.get("reshard") if isinstance(loc.custom.get("reshard"), dict) else {}
    model = getattr(opts, "maxtext_model", None) or prov.get("maxtext_model")
    if opts.config:
        return read_json_object(opts.config, "--config"), model, []
    if isinstance(prov.get("hf_config"), dict):
        return dict(prov["hf_config"]), model, ["the model config comes from reshard's provenance in "
                                                "_CHECKPOINT_METADATA (--config FILE overrides it)"]
    raise CheckpointError(f"{loc.items}: a MaxText checkpoint holds no Hugging Face config: pass --config FILE (the "
                          "model's config.json)")


def is_scanned(loc, item: Item) -> bool:
    if isinstance(loc.custom.get("scan_layers"), bool):
        return loc.custom["scan_layers"]
    heads = (PREFIX + "decoder.layers.", PREFIX + "decoder.dense_layers.", PREFIX + "decoder.moe_layers.")
    return any(n.startswith(heads) for n in item.paths)


def recipe_for(tensor, table, conv: Conventions, model, config: dict, item: Item, scan: bool) -> Recipe:
    """The leaf and ops of canonical tensor ``tensor`` (checked against the leaf's shape)."""
    spec = tensor.spec
    if spec.hf not in table.weights:
        raise CheckpointError(f"mapping '{model.family.name}' has no MaxText name for {spec.hf}")
    at = place(table, spec.hf, tensor.layer, model, scan)
    if at.leaf not in item.paths:
        raise CheckpointError(f"{item.items}: leaf '{at.leaf}' is missing (needed for "
                              f"{instance(spec.hf, tensor.layer, tensor.expert)}; is this a {conv.model or model.family.name} "
                              f"checkpoint, {'scanned' if scan else 'unscanned'}?)")
    shape = item.leaf(at.leaf).shape
    per = shape
    if at.index is not None:
        if len(shape) < 2 or shape[1] != at.stacked:
            raise CheckpointError(f"{item.items}: leaf '{at.leaf}' has shape {list(shape)}, not {at.stacked} layers "
                                  "on axis 1 (MaxText's param_scan_axis 1; pipeline-stacked or other scan axes are "
                                  "not read): the config or --maxtext-model does not match the checkpoint")
        per = shape[:1] + shape[2:]
    hf_shape = tensor.shape
    expert = tensor.expert
    if expert is not None:
        if per[0] != model.num_experts:
            _bad(item, at.leaf, shape, f"{model.num_experts} experts on axis 0")
        per = per[1:]
    role = spec.role
    kernel = len(hf_shape) == 2 and role != "embedding"
    rows = None
    if role == "embedding":
        if len(per) != 2 or per[1] != hf_shape[1] or per[0] < hf_shape[0]:
            _bad(item, at.leaf, shape, f"[>= {hf_shape[0]}, {hf_shape[1]}]")
        rows = hf_shape[0] if per[0] > hf_shape[0] else None
    elif role == "lm_head" and len(per) == 2 and per[0] == hf_shape[1] and per[1] >= hf_shape[0]:
        pass  # MaxText's vocab_size may exceed HF's: the head's padding columns are not read (band reads)
    elif kernel:
        cut = [k for k in range(1, len(per)) if int(np.prod(per[:k])) == hf_shape[1]]
        if not cut or int(np.prod(per)) != hf_shape[0] * hf_shape[1]:
            _bad(item, at.leaf, shape, f"the [{hf_shape[1]}, {hf_shape[0]}] kernel of {spec.hf} (in, out)")
    elif int(np.prod(per)) != int(np.prod(hf_shape)) or (len(hf_shape) > 1 and tuple(per) != tuple(hf_shape)):
        _bad(item, at.leaf, shape, f"{list(hf_shape)} per layer")
    mul = div = add = None
    rope = model.head_dim if conv.rope == "interleaved" and role in ("q", "k") else 0
    if role == "q" and conv.query_scale:
        mul = float(np.sqrt(query_factor(conv, config, model.head_dim)))  # rounded to float32 unless a float64 leaf
    if role == "embedding":
        div = embedding_factor(conv, model.dims["H"])
    if conv.norm_offset and at.leaf.endswith(".scale"):
        add = -conv.norm_offset
    wide = item.leaf(at.leaf).dtype == "F64"  # reshard wrote it from a float32 model: exact constants, in float64
    return Recipe(at.leaf, at.index, expert, kernel, rope, mul, div, add, rows, wide)


def _bad(item: Item, leaf: str, shape, want: str):
    raise CheckpointError(f"{item.items}: leaf '{leaf}' has shape {list(shape)}, but the config implies {want}: "
                          "the config or --maxtext-model does not match the checkpoint")


def open_source(root: str, opts: Options) -> Source:
    tensorstore()  # the one-line install hint before anything else
    loc = locate(root, opts.tag)
    item = Item(loc.items)
    config, model_name, notes = source_config(loc, opts)
    architecture = hf.architecture_of(config, opts, opts.config or "the provenance config")
    family = family_for_architecture(architecture, opts.mapping, config)
    table = family_table(family)
    conv = table.conventions(architecture, model_name, loc.items)
    scan = is_scanned(loc, item)
    has_head = any(s.tied_to and PREFIX + table.weights.get(s.hf, "?") in item.paths for s in family.weights)
    tied = bool(config.get("tie_word_embeddings", not has_head))
    probe = build_canonical(family, config, set(), tied, mtp=0)
    present = {s.hf for s in family.weights if s.optional and s.hf in table.weights and s.per_layer
               and place(table, s.hf, 0, probe, scan).leaf in item.paths}
    model = build_canonical(family, config, present, tied, mtp=0)
    recipes, shapes, kinds = {}, {}, {}
    for name, tensor in model.tensors.items():
        r = recipe_for(tensor, table, conv, model, config, item, scan)
        recipes[name], shapes[name] = r, tensor.shape
        kinds[name] = ("F64" if r.wide else "F32") if r.has_op else item.leaf(r.leaf).dtype
    used = {r.leaf for r in recipes.values()}
    params = [n for n in item.paths if n.startswith(PREFIX)]
    extra = sorted(set(params) - used)
    if extra:
        raise CheckpointError(f"{loc.items}: leaf '{extra[0]}' is not part of a {architecture} "
                              f"({conv.model or family.name}) model (vision encoder, LoRA, quantized or MTP "
                              "leaves are not read)")
    ignored = sorted({n.split(".")[0] for n in item.paths if not n.startswith(PREFIX)})
    files = [MaxTextFile(item, recipes, shapes, kinds)]
    source = hf.build_source(loc.items, config, files, opts, side_files=[])
    default = CONFIG_DTYPES.get(str(config.get("torch_dtype") or config.get("dtype") or ""))
    for name, r in recipes.items():
        for piece in (name,):
            if piece in source.model.dtypes:
                source.model.dtypes[piece] = default or item.leaf(r.leaf).dtype
    if "opt_state" in ignored:
        notes.append("a training checkpoint: read the parameters (params/params) only; the optimizer state is "
                     "not converted")
    if ignored:
        source.info["dropped"] = ignored
    notes.append(f"MaxText conventions of {conv.model or family.name}: RoPE {conv.rope}"
                 + (f", query pre-scaled ({conv.query_scale})" if conv.query_scale else "")
                 + (", norms stored 1 + w" if conv.norm_offset else "")
                 + (f", embedding * sqrt(H) ({conv.embedding_scale})" if conv.embedding_scale else ""))
    notes.extend(loc.notes)
    source.layout = NAME
    source.root = root
    source.info["notes"] = notes + source.info.get("notes", [])
    rows = [item.leaf(recipes[n].leaf).shape[0] for n, t in model.tensors.items() if t.spec.role == "embedding"]
    source.info["maxtext"] = {"items": loc.items, "step": loc.step, "scan_layers": scan,
                              "model": conv.model, "ocdbt": item.ocdbt, "zarr3": item.zarr3,
                              "vocab_size": rows[0] if rows else None}  # MaxText's (padding included)
    source.info["read_options"] = ("config", "tag")
    return source


def unstack_leaves(source: Source) -> list[str]:
    f = source.files[0]
    return sorted({r.leaf for r in f.recipes.values() if r.layer is not None and f.needs_unstack(r.leaf)})



def leaf_chunks(item: Item) -> dict[str, str]:
    """Each parameter leaf (``params.params.`` dropped) as ``DTYPE [shape] chunks [chunk shape] CODEC`` (section
    7.2: what a layer read decodes)."""
    out = {}
    for name in sorted(n for n in item.paths if n.startswith(PREFIX)):
        leaf = item.leaf(name)
        out[name[len(PREFIX):]] = f"{leaf.dtype} {list(leaf.shape)} chunks {list(leaf.chunks)} {leaf.codec}"
    return out
