"""Writing the Hugging Face layout: the canonical tensors as HF stores them (whole; ``hf_stored`` fused members in slot
order, ``hf_transposed`` as ``[in, out]``, transformers 5's stacked experts, MTP layers' copies of the embedding and
head) packed into ``model.safetensors`` or ``model-0000i-of-0000N.safetensors`` by ``max_shard_size``, then
``config.json`` (from the canonical config, dtype keys set) and ``model.safetensors.index.json`` last."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

from reshard.core.canonical import CanonicalModel, instance, stored_whole
from reshard.core.pieces import StoredTensor
from reshard.core.sharding import pack_members
from reshard.core.model_config import ConfigLoss
from reshard.io import dtypes, fp8
from reshard.io.hf_files import INDEX
from reshard.io.partial import replace_with_text
from reshard.layouts.base import Options, TargetSpec, pack_by_size
from reshard.layouts.hf_config import write_config as write_hf_config
from reshard.layouts.hf_spelling import respell_write
from reshard.layouts import ernie_rules
from reshard.layouts import qwen3_next_mtp
from reshard.mapping_vlm import nested


def mtp_copies(model: CanonicalModel) -> list[StoredTensor]:
    """The copies HF stores in each MTP layer (``copy_of`` weights: the embedding and the head), each the main
    tensor whole under the copy's name."""
    out = []
    for layer in model.mtp_layers:
        for spec in model.family.weights:
            if spec.copy_of and spec.copy_of in model.tensors:
                out.append(model.tensors[spec.copy_of].whole(instance(spec.hf, layer)))
    return out


def hf_tensors(model: CanonicalModel, fused: bool = False) -> list[StoredTensor]:
    """The model's HF tensors in canonical order: each canonical tensor whole under its own name, except that
    weights sharing an ``hf_stored`` name are one tensor (members whole, in slot order) and ``hf_transposed``
    ones are stored ``[in, out]``. ``fused``: transformers 5's fused form, where each layer's routed experts are
    stacked (``gate_up_proj [E, 2I, H]``: per expert [gate; up]; ``down_proj [E, H, I]``)."""
    out = []
    for tensor in model.tensors.values():
        spec = tensor.spec
        if (fused or spec.hf_fused_on_disk) and spec.hf_fused:
            stacked = _fused(model, tensor)
            if stacked is not None:
                out.append(stacked)
            continue
        members = pack_members(model, spec, tensor.layer, lambda s: s.hf_name, tensor.expert)
        if members is None:
            continue
        name = instance(spec.hf_name, tensor.layer, tensor.expert)
        out.append(stored_whole(name, members, spec.hf_transposed))
    return out + mtp_copies(model)


def _fused(model: CanonicalModel, tensor) -> StoredTensor | None:
    """``tensor`` in transformers 5's fused form (None when it is stored with an earlier slot or expert)."""
    spec = tensor.spec
    name = instance(spec.hf_fused, tensor.layer)
    if not spec.per_expert:
        return stored_whole(name, [tensor])
    if tensor.expert:
        return None
    blocks = [pack_members(model, spec, tensor.layer, lambda s: s.hf_fused, e) for e in range(model.num_experts)]
    if blocks[0] is None:
        return None
    flip = spec.hf_fused_transposed  # each expert [in, out] (gpt-oss, Llama 4)
    first = stored_whole(name, blocks[0], flip)
    pieces = tuple(replace(p, block=e) for e, members in enumerate(blocks)
                   for p in stored_whole(name, members, flip).pieces)
    return StoredTensor(name, (len(blocks), *first.shape), first.axis + 1, pieces, stacked=True,
                        transposed=first.transposed,
                        pair_interleaved=first.shape[first.axis] if spec.hf_fused_interleaved else 0)


def targets(model: CanonicalModel, opts: Options) -> list[TargetSpec]:
    """The HF tensors (:func:`hf_tensors`) in canonical order, packed into shards of at most ``max_shard_size``
    bytes."""
    def nbytes(t: StoredTensor) -> int:
        return dtypes.itemsize(t.dtype or opts.dtype or model.dtypes[t.pieces[0].canonical]) * math.prod(t.shape)

    tensors = respell_write(model.family, fp8.keep_dtypes(model, hf_tensors(model)), opts.hf_spelling)
    tensors = qwen3_next_mtp.write_names(model, tensors)
    tensors = ernie_rules.file_shapes(model, tensors)
    shards = pack_by_size(tensors, nbytes, opts.max_shard_size)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    return [TargetSpec(n, "safetensors", s, metadata={"format": "pt"}) for n, s in zip(names, shards)]


def output_config(model: CanonicalModel, dtype: str, loss: ConfigLoss) -> dict:
    """The output's config.json: the source's, with every meaning-bearing key written from the canonical config
    (what the architecture cannot spell goes to ``loss``) and the output dtype under every dtype key it has (a
    vision-language model's: nested as the source's, text_config holding the language model's keys)."""
    config = nested(write_hf_config(model.meaning, model.config, model.family, loss))
    keys = [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]
    for key in keys:
        config[key] = dtypes.hf_config_dtype(dtype)
    return config


def planned_config(model: CanonicalModel, dtype: str, opts: Options, target: str) -> tuple[dict, list[str]]:
    """:func:`output_config` checked at plan time: a loss not allowed by ``--allow-lossy-config`` raises."""
    loss = ConfigLoss(target, opts.allow_lossy_config)
    config = output_config(model, dtype, loss)
    return config, loss.check()


def write_config(out: str, config: dict) -> None:
    """Write ``config.json`` into ``out`` (a vision-language model's flat view nested back, mapping/vlm_config.py)."""
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(nested(config), f, indent=2, sort_keys=True)
        f.write("\n")


def finalize(out: str, config: dict, files: list) -> None:
    """Write config.json, then the index last (only for a sharded output). ``files``: the plan's TargetFiles."""
    write_config(out, config)
    if len(files) > 1:
        weight_map = {t.name: spec.path for spec in files for t in spec.tensors}
        total = sum(spec.nbytes for spec in files)
        replace_with_text(os.path.join(out, INDEX),
                          json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
