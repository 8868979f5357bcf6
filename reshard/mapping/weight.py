"""One declared weight (:class:`WeightSpec`): its HF name template, split, pack slot, shape in config symbols, which
layers hold it, and its name and split in every layout.

Parsed from a ``[[weight]]`` entry by weight_entries.py, or from a vision-language file's ``[[tower]]`` entry by
vlm.py. A new per-weight key (a layout's name, a storage form, a value transform) is a field here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightSpec:
    """One canonical weight: its HF name template, how it splits, and its names in other layouts."""

    hf: str
    split: str
    shape: tuple[str, ...]
    slot: str | None = None
    optional: bool = False
    tied_to: str | None = None
    stage: str | None = None  # "first" / "last" for weights outside the layer stack
    role: str | None = None  # what the decoder uses it as (LAYER_ROLES / MODEL_ROLES)
    hf_stored: str | None = None  # the HF tensor holding it when HF fuses weights (whole, in slot order)
    hf_transposed: bool = False  # HF stores the [out, in] matrix as [in, out] (GPT-2's Conv1D)
    hf_fused: str | None = None  # its name in transformers 5's fused form (experts stacked [E, ...], slot order)
    megatron_te: str | None = None
    megatron_local: str | None = None
    megatron_sparse: str | None = None  # its Megatron name on MoE layers, both specs (they never fuse the MLP norm)
    megatron_grouped: str | None = None  # a routed expert's name in TEGroupedMLP (moe_grouped_gemm): weight{j}
    megatron_legacy_grouped: str | None = None  # legacy GroupedMLP: weight1 / weight2, every local expert in one
    vllm: str | None = None
    trtllm: str | None = None  # its name in a TensorRT-LLM checkpoint (packs share one fused name)
    meta: str | None = None  # its name in Meta's consolidated files
    vllm_unfused: str | None = None  # its vLLM name when the other members of its vLLM pack are absent
    when: str | None = None  # a config condition (:func:`config_condition`) without which the model lacks it
    split_megatron_local: str | None = None  # its split in Megatron's local spec when that differs (MLA down-projs)
    dtype: str | None = None  # a dtype every layout stores it in, whatever --dtype says (a router's fp32 bias)
    copy_of: str | None = None  # an HF-only copy of this weight (MTP's embedding / head): not a canonical tensor
    vllm_qk_permute: bool = False  # vLLM stores its rows per head in rotate-half order, HF interleaved (Llama 4)
    hf_shape: tuple[str, ...] | None = None  # HF files hold the same bytes as this shape (Ernie 4.5: [1, E])
    # Fused expert storage (families-2.md section 14.2 F): HF reads and writes only the hf_fused tensor (gpt-oss,
    # Llama 4), each expert's block [in, out], a gate_up pack's slots alternating along out (row 2k + j = slot j's
    # row k); vLLM's per-rank pack alternating the same way within the rank's slice (gpt-oss w13).
    hf_fused_on_disk: bool = False
    hf_fused_transposed: bool = False
    hf_fused_interleaved: bool = False
    vllm_interleaved: bool = False

    # Hybrid mixers and named sections (reshard/mapping/sections.py): the layer kind holding it, a layout's own
    # split, the named sections along dim 0 (per group when ``section_groups``), Megatron's stored value offset,
    # and a query projection whose heads are [q; gate] (Megatron puts a group's gates after its queries).
    mixer: str | None = None
    split_vllm: str | None = None
    split_megatron: str | None = None
    sections: tuple[str, ...] = ()
    section_groups: str | None = None
    megatron_offset: float = 0.0
    gated_query: bool = False
    vllm_transform: str | None = None  # "neg_exp": vLLM stores -exp(w) in fp32 (Nemotron-H A_log -> mixer.A)

    layers: str = "all"  # which layers hold it: all | sparse (MoE layers) | dense | mtp (MTP layers only)
    # Vision-language models (reshard/mapping/vlm.py): a tower or projector weight, the dims symbol of its qkv
    # head count, its native-Megatron names and split, its split in the HF-module Megatron layout, vLLM storing
    # it [in, out], the layouts that do not hold it, and a Megatron view of another shape (CLIP's class token).
    tower: str | None = None
    heads: str | None = None
    megatron_native_te: str | None = None
    megatron_native_local: str | None = None
    split_native: str | None = None
    split_megatron_hf: str = "replicated"
    vllm_transposed: bool = False
    absent_in: tuple[str, ...] = ()
    megatron_shape: tuple[str, ...] | None = None
    vllm_text_only: bool = False  # vLLM keeps it in a text-only engine too (LLaVA-NeXT's bare image_newline)

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.hf

    def on_layer(self, sparse: bool, mtp: bool = False) -> bool:
        """Whether a layer holds this weight (``sparse``: it is a Mixture-of-Experts layer; ``mtp``: a
        multi-token-prediction layer, which is a MoE layer plus its own ``mtp`` weights)."""
        if self.layers == "mtp":
            return mtp
        return self.layers == "all" or (sparse or mtp) == (self.layers == "sparse")

    def split_in(self, layout: str, vision: str = "hf") -> str:
        """Its split kind in ``layout`` (``megatron_local`` may differ from the others; a tower weight's Megatron
        split depends on the ``vision`` layout, hf modules or native)."""
        if self.tower and layout.startswith("megatron"):
            return (self.split_native or self.split) if vision == "native" else self.split_megatron_hf
        if layout == "megatron_local" and self.split_megatron_local:
            return self.split_megatron_local
        if layout.startswith("megatron") and self.split_megatron:
            return self.split_megatron
        return self.split_vllm if layout == "vllm" and self.split_vllm else self.split

    def held_in(self, layout: str) -> bool:
        """Whether ``layout`` (vllm | megatron_native | ...) holds it (vLLM builds no CLIP block past LLaVA's
        feature layer, neither vLLM nor megatron-core a post_layernorm)."""
        return layout not in self.absent_in

    @property
    def per_expert(self) -> bool:
        """One tensor per routed expert (``{expert}`` in the name)."""
        return "{expert}" in self.hf

    @property
    def axis(self) -> int:
        """The dimension along which ranks hold different parts (0 except row-parallel weights)."""
        return 1 if self.split == "row" else 0

    def megatron_name(self, spec: str, sparse: bool = False, grouped: bool = False, vision: str = "hf") -> str:
        """Its Megatron name in layer spec ``spec`` (te | local), on a MoE layer when ``sparse``, with
        TEGroupedMLP experts when ``grouped``; a tower weight's in vision layout ``vision`` (hf | native)."""
        if self.tower and vision == "native":
            return self.megatron_native_te if spec == "te" else self.megatron_native_local
        if grouped and self.megatron_grouped:
            return self.megatron_grouped
        if sparse and self.megatron_sparse:
            return self.megatron_sparse
        return self.megatron_te if spec == "te" else self.megatron_local

    @property
    def hf_name(self) -> str:
        """The HF tensor that stores it (its own name unless HF fuses it with others)."""
        return self.hf_stored or self.hf

    @property
    def vllm_name(self) -> str:
        """The vLLM parameter name (defaults to the HF name; packs share one fused name)."""
        return self.vllm or self.hf

