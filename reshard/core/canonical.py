"""The canonical model: Hugging Face on-disk tensors, full (TP=1), unfused and unpadded."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from reshard.core.counts import check_kv_heads
from reshard.core.model_config import ModelConfig
from reshard.core.pieces import Piece, StoredTensor
from reshard.core.templates import template_match
from reshard.errors import CheckpointError
from reshard.mapping import Family, WeightSpec, config_condition, with_defaults
from reshard.mapping.sections import group_count, layer_mixers, section_rows


@dataclass(frozen=True)
class CanonicalTensor:
    name: str
    spec: WeightSpec
    layer: int | None
    shape: tuple[int, ...]
    expert: int | None = None  # the global routed-expert index of a per-expert weight
    sections: tuple[tuple[str, int], ...] = ()  # named sections' rows per group (mapping/sections.py)
    groups: int = 1  # section groups along dim 0

    @property
    def axis(self) -> int:
        return self.spec.axis

    def whole(self, stored_name: str | None = None, transposed: bool = False) -> StoredTensor:
        """This tensor stored full and unfused (the HF layout), under ``stored_name`` or its own name;
        ``transposed``: stored ``[in, out]`` (2-D only)."""
        return stored_whole(stored_name or self.name, [self], transposed)


def stored_whole(name: str, members: list[CanonicalTensor], transposed: bool = False) -> StoredTensor:
    """``members`` stored whole, one after another along their split axis, as one tensor ``name`` (an HF fused
    tensor such as Phi-3's ``qkv_proj`` = ``[q; k; v]``); ``transposed``: stored ``[in, out]`` (GPT-2 Conv1D)."""
    first = members[0]
    axis = first.axis
    shape = list(first.shape)
    shape[axis] = sum(m.shape[axis] for m in members)
    pieces = tuple(Piece(m.name, 0, m.shape[axis]) for m in members)
    if transposed and len(shape) == 2:
        return StoredTensor(name, tuple(reversed(shape)), 1 - axis, pieces, transposed=True)
    return StoredTensor(name, tuple(shape), axis, pieces)


@dataclass
class CanonicalModel:
    """Every canonical tensor of one model, in HF order, plus its HF-style config."""

    family: Family
    config: dict
    dims: dict[str, int]
    tensors: dict[str, CanonicalTensor]
    tied: bool
    dtypes: dict[str, str] = field(default_factory=dict)  # canonical name -> dtype (set from the source)
    meaning: ModelConfig | None = None  # what the config means (set by the layout that read it)

    @property
    def num_layers(self) -> int:
        return self.dims["L"]

    @property
    def vocab_size(self) -> int:
        return self.dims["V"]

    @property
    def head_dim(self) -> int:
        """Rows per attention head of q / k: the config's ``head_dim``, else hidden / heads."""
        return self.dims.get("d", self.dims["H"] // self.dims["nh"])

    sparse_layers: tuple[int, ...] = ()  # the Mixture-of-Experts layers of the decoder
    mtp_layers: tuple[int, ...] = ()  # the multi-token-prediction layers, indexed after the decoder's (L + k)
    mixers: tuple[str | None, ...] = ()  # each decoder layer's mixer kind ([layers]; empty: one kind)

    @property
    def num_experts(self) -> int:
        return self.dims[self.family.moe["experts"]] if self.family.moe else 0

    def get(self, spec: WeightSpec, layer: int | None, expert: int | None = None) -> CanonicalTensor | None:
        found = self.tensors.get(instance(spec.hf, layer, expert))
        return found if found is None or found.spec.mixer == spec.mixer else None  # one HF name, two mixers

    def holds_layer(self, spec: WeightSpec, layer: int) -> bool:
        """Whether ``layer`` has ``spec`` (sparse-only weights on MoE layers, dense-only ones elsewhere, MTP
        layers: MoE layers plus their own weights)."""
        mixer_ok = not spec.mixer or not self.mixers or mixer_at(self.mixers, layer) == spec.mixer
        return mixer_ok and spec.on_layer(layer in self.sparse_layers, layer in self.mtp_layers)

    @property
    def all_layers(self) -> range:
        """The decoder layers, then the MTP layers."""
        return range(self.num_layers + len(self.mtp_layers))

    def has_spec(self, spec: WeightSpec) -> bool:
        if not spec.per_layer:
            return self.get(spec, None) is not None
        return any(self.get(spec, layer, 0 if spec.per_expert else None) is not None
                   for layer in self.all_layers if self.holds_layer(spec, layer))


def mixer_at(mixers: tuple, layer: int) -> str | None:
    """Layer ``layer``'s mixer kind; an MTP layer (after the decoder) has the last decoder layer's, as
    megatron-core's MTP block builds it from the block's last layer spec (Qwen3-Next: full attention)."""
    return mixers[min(layer, len(mixers) - 1)]


def without_mtp(model: CanonicalModel) -> CanonicalModel:
    """``model`` less its multi-token-prediction layers (and their config entry)."""
    kept = {name: t for name, t in model.tensors.items() if t.layer is None or t.layer not in model.mtp_layers}
    meaning = model.meaning.replace(mtp_layers=0) if model.meaning is not None else None
    config = dict(model.config, **{model.family.mtp["layers"]: 0}) if model.family.mtp else dict(model.config)
    return dataclasses.replace(model, tensors=kept, mtp_layers=(), meaning=meaning, config=config,
                               dtypes={n: d for n, d in model.dtypes.items() if n in kept})


def instance(template: str, layer: int | None, expert: int | None = None) -> str:
    """``template`` with its ``{layer}`` (and ``{expert}``) placeholders filled."""
    if layer is None:
        return template
    return template.format(layer=layer, expert=expert) if "{expert}" in template else template.format(layer=layer)


def build_canonical(family: Family, config: dict, present_optional: set[str], tied: bool,
                    mtp: int | None = None) -> CanonicalModel:
    """Lay out the canonical tensors of ``family`` for ``config``.

    ``present_optional`` holds the HF templates of optional weights the model has (e.g. q/k/v biases);
    ``tied`` drops weights declared ``tied_to`` another (the output layer when embeddings are tied); weights
    with a ``when`` condition exist where ``config`` meets it. ``mtp``: the number of multi-token-prediction
    layers kept (default: what the config declares), laid out after the decoder layers; their ``copy_of``
    weights are HF-only copies, not canonical tensors. Everything is derived with the config class's defaults
    (mapping/defaults.py); the model keeps ``config`` as the source spells it.
    """
    spelt, config = config, with_defaults(family, config)
    dims = family.resolve_dims(config)
    check_kv_heads(family, dims, config)
    for sym in ("L", "V"):
        if sym not in dims:
            raise CheckpointError(f"mapping '{family.name}' must declare dims L (layers) and V (vocab)")
    tensors: dict[str, CanonicalTensor] = {}

    def add(spec: WeightSpec, layer: int | None, expert: int | None = None):
        name = instance(spec.hf, layer, expert)
        tensors[name] = CanonicalTensor(name, spec, layer, family.shape_of(spec, dims), expert,
                                        section_rows(spec, dims), group_count(spec, dims))

    def wanted(spec: WeightSpec) -> bool:
        if spec.optional and spec.hf not in present_optional:
            return False
        if spec.when and not config_condition(spec.when, config):
            return False
        return not (spec.tied_to and tied) and not spec.copy_of

    for spec in family.weights:
        if spec.stage == "first" and wanted(spec):
            add(spec, None)
    sparse = family.sparse_layers(config, dims["L"])
    experts = dims[family.moe["experts"]] if family.moe else 0
    mtp_layers = tuple(range(dims["L"], dims["L"] + (family.mtp_count(config) if mtp is None else mtp)))
    mixers = layer_mixers(family, config, dims["L"])
    for layer in range(dims["L"] + len(mtp_layers)):
        for spec in family.weights:
            if not (spec.per_layer and wanted(spec) and spec.on_layer(layer in sparse, layer in mtp_layers)):
                continue
            if spec.mixer and mixers and mixer_at(mixers, layer) != spec.mixer:
                continue
            for expert in range(experts) if spec.per_expert else [None]:
                add(spec, layer, expert)
    for spec in family.weights:
        if spec.stage == "last" and wanted(spec):
            add(spec, None)
    return CanonicalModel(family=family, config=dict(spelt), dims=dims, tensors=tensors, tied=tied,
                          sparse_layers=sparse, mtp_layers=mtp_layers, mixers=mixers)


def template_layer(template: str, name: str) -> int | None | bool:
    """The layer ``name`` instantiates ``template`` at (None for a template without ``{layer}``), or False."""
    found = template_match(template, name)
    return False if found is None else found[0]


def match_template(family: Family, name: str, stored: bool = False,
                   fused: bool = False) -> tuple[WeightSpec, int | None] | None:
    """Which weight spec (and layer) an HF tensor name belongs to, or None. ``stored``: match the names HF files
    store (:attr:`WeightSpec.hf_name`; a fused tensor matches its pack's first weight); ``fused``: transformers
    5's fused form (:attr:`WeightSpec.hf_fused`) where a weight has one."""
    for spec in family.weights:
        template = (spec.hf_fused or spec.hf_name) if fused else spec.hf_name if stored else spec.hf
        found = template_match(template, name)
        if found is not None:
            return spec, found[0]
    return None
