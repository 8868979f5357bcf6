"""Gated DeltaNet hybrids (Qwen3-Next) in Megatron-Core and vLLM: the args that spell the mixer, the refusals of
families-2.md section 17, and ``torch_dist``'s per-section keys (section 4.2).

Megatron-Core 0.16.1 builds the GDN layer only with the Transformer Engine spec
(``experimental_attention_variant="gated_delta_net"``, ``linear_attention_freq`` a per-layer 0/1 list, the
``linear_*`` dims, ``attention_output_gate`` for the full-attention layers' gated query); both engines split whole
key heads over the tensor-parallel ranks. ``torch_dist`` saves a sections tensor as one key per section,
``<key>.<section name>`` (``in_proj.weight.{query,key,value,z,beta,alpha}``, ``conv1d.weight.{query,key,value}``),
each split over the TP ranks like a column-parallel weight.
"""

from __future__ import annotations

import dataclasses

from reshard.core.pieces import StoredTensor
from reshard.core.section_pieces import section_extents
from reshard.errors import PlanError
from reshard.layouts.dcp_chunks import slice_pieces

GDN = "gdn"
#: the config keys of the GDN dims, as megatron-core's TransformerConfig names them
LINEAR_DIMS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
               "linear_num_value_heads")


def has_gdn(model) -> bool:
    return GDN in model.mixers


def check_degrees(model, tp: int) -> None:
    """Both engines split whole key heads over the ranks (vLLM's column split of the grouped in_proj)."""
    if has_gdn(model):
        nk = int(model.config["linear_num_key_heads"])
        if nk % tp:
            raise PlanError(f"Gated DeltaNet key heads ({nk}) must divide the tensor-parallel size ({tp}).")


def check_megatron_target(model, spec: str, tp: int) -> None:
    if not has_gdn(model):
        return
    if spec != "te":
        raise PlanError("megatron-core builds Gated DeltaNet only with the Transformer Engine spec; use "
                        "--megatron-spec te.")
    check_degrees(model, tp)


def megatron_args(model) -> dict:
    """The args fields of a GDN hybrid (none for other models)."""
    if not has_gdn(model):
        return {}
    values = {key: int(model.config[key]) for key in LINEAR_DIMS}
    values.update(experimental_attention_variant="gated_delta_net",
                  linear_attention_freq=[1 if kind == GDN else 0 for kind in model.mixers],
                  attention_output_gate=any(s.gated_query for s in model.family.weights))
    return values


def per_section(model, tensors: list[StoredTensor]) -> list[StoredTensor]:
    """``tensors`` (Megatron's TP=1 layout) with each sections tensor replaced by one tensor per section, named
    ``<name>.<section>`` (torch_dist's keys)."""
    out = []
    for tensor in tensors:
        members = _members(model, tensor)
        if not members:
            out.append(tensor)
            continue
        for name, start, stop in section_extents(members):
            shape = (stop - start, *tensor.shape[1:])
            out.append(dataclasses.replace(tensor, name=f"{tensor.name}.{name}", shape=shape,
                                           pieces=tuple(slice_pieces(tensor.pieces, start, stop))))
    return out


def _members(model, tensor: StoredTensor):
    """The canonical tensors of a sections-split Megatron tensor, in order (empty for any other)."""
    names = list(dict.fromkeys(p.canonical for p in tensor.pieces if p.canonical))
    members = [model.tensors[n] for n in names if n in model.tensors]
    if not members or any(m.spec.split_in("megatron") != "sections" for m in members):
        return []
    return members


def offset_notes(model) -> list[str]:
    """The plan's word on the values Megatron stores offset (``megatron_offset``: the zero-centred GDN norm)."""
    shifted = [s for s in model.family.weights if s.megatron_offset and any(model.get(s, i) for i in range(
        model.num_layers))]
    return [f"{s.megatron_te.rsplit('.', 2)[-2]} stored as w {'+' if s.megatron_offset > 0 else '-'} "
            f"{abs(s.megatron_offset):g} (megatron-core's zero-centred norm; read back as w, exact for weights in "
            "[0.5, 2])" for s in shifted]
