"""Mapping files: one TOML file per architecture family declaring every canonical weight.

A weight declares its Hugging Face name template (``{layer}``), its split kind, its pack slot, its shape in
config symbols, whether it is optional or tied, and its name in each layout. The schema is strict: unknown keys,
kinds or symbols are errors that name the file, the key and the nearest valid key.
"""

from __future__ import annotations

import ast
import difflib
import functools
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from reshard.config_defaults import check_defaults, parse_table, with_defaults
from reshard.errors import MappingError

SPLIT_KINDS = ("replicated", "column", "row", "vocab", "qkv", "gate_up")
PACK_SLOTS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
#: Replicated weights may share one fused name in a layout (vLLM's ``fused_qkv_a_proj`` = ``[q_a; kv_a]``): each
#: names its place with a free-form ``slot``; the pack is the members whole, in declaration order, on dim 0.
REPLICATED_PACK = "replicated"
WEIGHT_KEYS = {
    "hf", "split", "slot", "shape", "optional", "tied_to", "stage", "role", "hf_stored", "hf_transposed", "layers",
    "hf_fused", "when", "split_megatron_local", "dtype", "copy_of",
    "megatron", "megatron_te", "megatron_local", "megatron_sparse", "megatron_grouped", "megatron_legacy_grouped",
    "vllm", "vllm_unfused", "trtllm", "meta",
}
TOP_KEYS = {"family", "dims", "hf", "moe", "mla", "mtp", "megatron", "vllm", "decoder", "config", "weight"}
#: Mixture of Experts ([moe]): the dims symbol of the expert count and the config keys that say which layers are
#: sparse (every ``sparse_step``-th, except ``dense_layers`` and the first ``dense_prefix``; all when none is set).
#: Routing: ``score`` (``softmax`` | ``sigmoid``, fixed per family), ``groups`` / ``group_topk`` (the config keys
#: of group-limited routing: experts in ``groups`` equal groups, the best ``group_topk`` groups by
#: ``group_score`` kept), ``group_score`` (``top2_sum``: the sum of each group's two best bias-corrected scores;
#: ``max``: its best score), ``group_switch`` (``{key, on, off}``: the config key whose value ``on`` turns the groups
#: on and ``off`` leaves them unused, DeepSeek-V2's ``topk_method``), ``scaling`` (the config key of the factor the
#: routed weights are multiplied by). A selection bias is the weight with role ``router_bias``. ``shared_count``:
#: the dims symbol of the number of shared experts, each ``expert_ffn`` wide (DeepSeek's ``n_shared_experts``),
#: instead of a ``shared_ffn`` width.
MOE_KEYS = {"experts", "expert_ffn", "shared_ffn", "shared_count", "top_k", "renormalize", "sparse_step",
            "dense_layers", "dense_prefix", "score", "groups", "group_topk", "group_score", "group_switch", "scaling"}
GROUP_SWITCH_KEYS = {"key", "on", "off"}
ROUTER_SCORES = ("softmax", "sigmoid")
GROUP_SCORES = ("top2_sum", "max")
#: Multi-head latent attention ([mla], DeepSeek-V2/V3): the dims symbols of the q LoRA rank (0: none, q_proj),
#: the compressed KV rank, the no-RoPE and RoPE parts of each query/key head and the value head dim.
MLA_KEYS = {"q_lora_rank", "kv_lora_rank", "nope_dim", "rope_dim", "v_dim"}
#: Multi-token prediction ([mtp], DeepSeek-V3): the config key of the number of MTP layers, stored in HF after the
#: decoder layers (``model.layers.{L + k}``) and holding every MoE-layer weight plus the ``layers = "mtp"`` ones.
MTP_KEYS = {"layers"}
LAYER_KINDS = ("all", "sparse", "dense", "mtp")
HF_KEYS = {"ignore", "optional_prefix"}
#: What a weight is to the forward verifier's decoder (verification/forward/rank_weights.py): per-layer roles
#: are LayerWeights fields, the others RankWeights fields. A plain (ungated) MLP's first linear is ``up``.
LAYER_ROLES = ("input_norm", "input_norm_bias", "q", "k", "v", "q_bias", "k_bias", "v_bias", "q_norm", "k_norm",
               "o", "o_bias", "attn_output_norm", "post_norm", "post_norm_bias", "gate", "gate_bias", "up", "up_bias",
               "down", "down_bias", "mlp_output_norm", "router", "router_bias", "expert_gate", "expert_up",
               "expert_down", "shared_gate", "shared_up", "shared_down", "shared_expert_gate",
               "q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "kv_b")
MODEL_ROLES = ("embedding", "position_embedding", "final_norm", "final_norm_bias", "lm_head")
FAMILY_KEYS = {"name", "description", "architectures"}
DIM_KEYS = {"key", "default"}
MEGATRON_KEYS = {"extra_state_te", "extra_state_local"}
VLLM_KEYS = {"attention_scales", "tied_name"}
MEGATRON_SPECS = ("te", "local")

# The reference decoder's features (verification/forward/decoder.py implements each); a family's [decoder] table
# picks them. Config-dependent values (activation, epsilon, window) name the HF config key they come from.
DECODER_KEYS = {"norm", "mlp", "position", "activation", "norm_offset", "embedding_scaled"}
DECODER_CHOICES = {"norm": ("rms", "layer"), "mlp": ("gated", "plain"), "position": ("rope", "learned")}
#: HF ``hidden_act`` values -> the decoder's activation (``gelu_tanh``: the tanh approximation of GELU).
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "relu": "relu"}


@dataclass(frozen=True)
class DecoderFeatures:
    """How a family computes, in the reference decoder's terms (see ``[decoder]`` in a mapping file).

    ``norm``: ``rms`` (HF RMSNorm) or ``layer`` (LayerNorm); ``mlp``: ``gated`` (``down(act(gate(x)) * up(x))``)
    or ``plain`` (``down(act(up(x)))``); ``position``: ``rope`` (rotate-half) or ``learned`` (an absolute
    position embedding added to the token embedding); ``activation``: the HF ``hidden_act`` used when the config
    has none; ``norm_offset``: norm weights are stored as w and applied as 1 + w (Gemma); ``embedding_scaled``: the
    embedding is multiplied by sqrt(hidden) (Gemma).
    """

    norm: str = "rms"
    mlp: str = "gated"
    position: str = "rope"
    activation: str = "silu"
    norm_offset: bool = False
    embedding_scaled: bool = False


# How config.json spells the model's meaning, per architecture ([config] table; reshard/layouts/hf_config.py).
CONFIG_KEYS = {"norm_eps", "activation", "max_positions", "attn_softcap", "final_softcap", "query_scale",
               "rope_local_theta", "bias_groups", "architectures"}
ARCH_CONFIG_KEYS = {"model_type", "other_model_types", "biases", "window", "window_pattern", "rotary_fraction",
                    "requires", "defaults"}
BIAS_GROUPS = ("qkv", "o", "mlp")
#: How an architecture's config.json spells a sliding window: ``none`` (it has none), ``all_layers``
#: (``sliding_window`` applies to every layer, Mistral), ``layer_types`` (``use_sliding_window``,
#: ``sliding_window`` and ``layer_types`` or ``max_window_layers``, Qwen2), ``typed`` (``sliding_window`` on the
#: layers ``layer_types`` marks, by default all but every ``window_pattern``-th: Gemma 2 / 3).
WINDOW_SPELLINGS = ("none", "all_layers", "layer_types", "typed")


@dataclass(frozen=True)
class ArchitectureConfig:
    """One architecture's config.json spelling: ``biases`` maps a bias group to the config key that switches it
    or to a fixed bool; ``window`` is one of ``WINDOW_SPELLINGS``; ``rotary_fraction``: partial rotary allowed;
    ``requires``: config keys whose other values change the computation in a way reshard does not carry
    (refused on read, e.g. GPT-2's ``scale_attn_by_inverse_layer_idx = false``); ``other_model_types``: other
    ``model_type`` values checkpoints of the architecture carry (Kimi-K2's ``kimi_k2``), kept as the source has
    them; ``defaults``: its transformers config class's defaults for the keys reshard reads."""

    model_type: str
    other_model_types: tuple[str, ...] = ()
    biases: tuple[tuple[str, str | bool], ...] = ()
    window: str = "none"
    rotary_fraction: bool = False
    requires: tuple[tuple[str, object], ...] = ()
    window_pattern: int | None = None
    defaults: tuple[tuple[str, object], ...] = ()  # its transformers config class's defaults (config_defaults.py)


@dataclass(frozen=True)
class ConfigSpelling:
    """A family's ``[config]`` table: the norm-epsilon, activation and position-count keys, which HF weights form
    each bias group, and each architecture's spelling."""

    norm_eps: str = "rms_norm_eps"
    activation: str = "hidden_act"
    max_positions: str = "max_position_embeddings"
    attn_softcap: str | None = None  # the config keys of Gemma's soft-capping, query scale and local RoPE base
    final_softcap: str | None = None
    query_scale: str | None = None
    rope_local_theta: str | None = None
    bias_groups: tuple[tuple[str, tuple[str, ...]], ...] = ()
    architectures: tuple[tuple[str, ArchitectureConfig], ...] = ()

    def architecture(self, name: str) -> ArchitectureConfig | None:
        return dict(self.architectures).get(name)


def _suggest(key: str, valid) -> str:
    close = difflib.get_close_matches(key, sorted(valid), n=1)
    return f" (did you mean '{close[0]}'?)" if close else f" (valid: {', '.join(sorted(valid))})"


def _check_keys(source: str, where: str, table: dict, valid: set[str]) -> None:
    for key in table:
        if key not in valid:
            raise MappingError(f"{source}: unknown key '{key}' in {where}{_suggest(key, valid)}")


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

    layers: str = "all"  # which layers hold it: all | sparse (MoE layers) | dense | mtp (MTP layers only)
    # Vision-language models (reshard/mapping_vlm.py): a tower or projector weight, the dims symbol of its qkv
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
        return self.split_megatron_local if layout == "megatron_local" and self.split_megatron_local else self.split

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


@dataclass
class Family:
    """A parsed, validated mapping file."""

    name: str
    description: str
    architectures: tuple[str, ...]
    dims: dict[str, tuple[str, str | None]]  # symbol -> (config key, default expression)
    weights: tuple[WeightSpec, ...]
    extra_state: dict[str, tuple[str, ...]] = field(default_factory=dict)  # megatron spec -> templates
    source: str = ""
    vllm_scales: tuple[str, ...] = ()  # per-layer fp32 scalar names vLLM's state dict holds (value 1.0)
    vllm_tied_name: str | None = None  # where vLLM keeps tied embeddings when its model has no lm_head module
    decoder: DecoderFeatures = DecoderFeatures()
    config: ConfigSpelling = ConfigSpelling()
    hf_ignore: tuple[str, ...] = ()  # HF tensor templates dropped on read (buffers old files saved)
    hf_optional_prefix: str = ""  # a name prefix old files omit (GPT-2's "transformer."): read either way
    moe: dict = field(default_factory=dict)  # the [moe] table (MOE_KEYS)
    mla: dict = field(default_factory=dict)  # the [mla] table (MLA_KEYS): dims symbols
    mtp: dict = field(default_factory=dict)  # the [mtp] table (MTP_KEYS)
    multimodal: object | None = None  # a composed vision-language family's mapping_vlm.Multimodal

    def sparse_layers(self, config: dict, layers: int) -> tuple[int, ...]:
        """The layers whose MLP is a Mixture of Experts (none for a dense family): every ``sparse_step``-th
        (1-based) except the ``dense_layers`` list (transformers' Qwen2-MoE) and the first ``dense_prefix``
        layers (DeepSeek's ``first_k_dense_replace``)."""
        if not self.moe:
            return ()
        step = int(config.get(self.moe["sparse_step"], 1) or 1) if "sparse_step" in self.moe else 1
        dense = set(config.get(self.moe["dense_layers"]) or ()) if "dense_layers" in self.moe else set()
        prefix = int(config.get(self.moe["dense_prefix"]) or 0) if "dense_prefix" in self.moe else 0
        return tuple(i for i in range(layers) if (i + 1) % step == 0 and i not in dense and i >= prefix)

    def mtp_count(self, config: dict) -> int:
        """How many multi-token-prediction layers ``config`` declares (0 for a family without them)."""
        return int(config.get(self.mtp["layers"]) or 0) if self.mtp else 0

    def holds(self, template: str, present_optional: set[str], config: dict | None = None) -> bool:
        """Whether a model with the optional weights ``present_optional`` (and ``config``, for weights with a
        ``when`` condition) has weight ``template``."""
        spec = next((w for w in self.weights if w.hf == template), None)
        if spec is None or (spec.optional and template not in present_optional):
            return False
        return spec.when is None or config is None or config_condition(spec.when, config)

    def role_spec(self, role: str) -> WeightSpec | None:
        return next((w for w in self.weights if w.role == role), None)

    def dim_key(self, symbol: str, config: dict | None = None) -> str | None:
        """The config key of dimension ``symbol`` (of alternatives, the first ``config`` has); None if undeclared."""
        if symbol not in self.dims:
            return None
        key = self.dims[symbol][0]
        if isinstance(key, str):
            return key
        return next((k for k in key if config is not None and lookup(config, k) is not None), key[0])

    def resolve_dims(self, config: dict) -> dict[str, int]:
        """Bind every dimension symbol to an integer from an HF-style config dict (its class's defaults filled)."""
        config = with_defaults(self, config)
        values: dict[str, int] = {}
        pending = dict(self.dims)
        for _ in range(len(pending) + 1):
            for sym, (_, default) in list(pending.items()):
                key = self.dim_key(sym, config)
                if lookup(config, key) is not None:
                    values[sym] = int(lookup(config, key))
                elif default is None:
                    raise MappingError(f"config is missing '{key}' (needed by mapping '{self.name}' as {sym})")
                else:
                    try:
                        values[sym] = evaluate(default, values)
                    except KeyError:
                        continue
                del pending[sym]
        if pending:
            raise MappingError(f"{self.source}: dims defaults form a cycle: {', '.join(pending)}")
        return values

    def shape_of(self, spec: WeightSpec, dims: dict[str, int]) -> tuple[int, ...]:
        return tuple(evaluate(expr, dims) for expr in spec.shape)


def lookup(config: dict, key: str):
    """``config[key]``, a dotted key looked up in nested tables (a VLM's ``vision_config.hidden_size``);
    ``count:KEY``: the length of a list value, 1 for a scalar, None when unset."""
    if "." not in key and ":" not in key:
        return config.get(key)
    count = key.startswith("count:")
    value = config
    for part in key.removeprefix("count:").split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if count and value is not None:
        return len(value) if isinstance(value, list) else 1
    return value


def _parse_condition(condition: str) -> tuple[str, str, object]:
    """``(key, op, value)`` of a mapping's config condition; ``op`` is ``==``, ``!=``, ``set`` or ``unset``."""
    text = condition.strip()
    op, value = ("unset" if text.startswith("!") else "set"), None
    key = text.lstrip("!").strip()
    for comparison in ("==", "!="):
        if comparison in text:
            key, literal = (part.strip() for part in text.split(comparison, 1))
            try:
                op, value = comparison, ast.literal_eval(literal)
            except (ValueError, SyntaxError):
                raise MappingError(f"condition '{text}': '{literal}' is not a string, number or bool") from None
            break
    if not key.isidentifier():
        raise MappingError(f"condition {condition!r} must be 'KEY', '!KEY' or \"KEY == 'value'\"")
    return key, op, value


def config_condition(condition: str, config: dict) -> bool:
    """A mapping's config condition: ``KEY`` (set and not null, 0 or false), ``!KEY`` (the opposite), or
    ``KEY == 'value'`` / ``KEY != 'value'`` (a Python string, number or bool literal compared with the key's
    value)."""
    key, op, value = _parse_condition(condition)
    if op in ("==", "!="):
        return (config.get(key) == value) == (op == "==")
    return bool(config.get(key)) == (op == "set")


def _check_condition(source: str, where: str, condition) -> None:
    if not isinstance(condition, str):
        raise MappingError(f"{source}: {where} condition {condition!r} must be 'KEY', '!KEY' or \"KEY == 'value'\"")
    try:
        _parse_condition(condition)
    except MappingError as exc:
        raise MappingError(f"{source}: {where} {exc}") from None


_ALLOWED_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
                ast.FloorDiv: lambda a, b: a // b}


def evaluate(expr: str, symbols: dict[str, int]) -> int:
    """Evaluate an integer shape expression over dimension symbols (``+ - * //`` and integers only)."""

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return symbols[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _ALLOWED_OPS:
            return _ALLOWED_OPS[type(node.op)](walk(node.left), walk(node.right))
        raise MappingError(f"unsupported shape expression '{expr}': use integers, symbols and + - * //")

    return walk(ast.parse(expr, mode="eval"))


def _names_in(expr: str) -> set[str]:
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise MappingError(f"invalid shape expression '{expr}': {exc.msg}") from None
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def parse_family(data: dict, source: str) -> Family:
    """Validate a mapping file's TOML data and build a :class:`Family`."""
    _check_keys(source, "the top level", data, TOP_KEYS)
    for required in ("family", "dims", "weight"):
        if required not in data:
            raise MappingError(f"{source}: missing [{required}] table")
    fam = data["family"]
    _check_keys(source, "[family]", fam, FAMILY_KEYS)
    if "name" not in fam or not fam.get("architectures"):
        raise MappingError(f"{source}: [family] needs 'name' and a non-empty 'architectures' list")
    dims: dict[str, tuple[str, str | None]] = {}
    for sym, entry in data["dims"].items():
        if not isinstance(entry, dict) or "key" not in entry:
            raise MappingError(f"{source}: dims.{sym} must be a table with a 'key' (and optional 'default')")
        _check_keys(source, f"dims.{sym}", entry, DIM_KEYS)
        key = entry["key"]
        if not (isinstance(key, str) or (isinstance(key, list) and key and all(isinstance(k, str) for k in key))):
            raise MappingError(f"{source}: dims.{sym} key must be a config key or a list of alternatives")
        dims[sym] = (key if isinstance(key, str) else tuple(key), entry.get("default"))
    extra_state: dict[str, tuple[str, ...]] = {}
    meg = data.get("megatron", {})
    _check_keys(source, "[megatron]", meg, MEGATRON_KEYS)
    for spec in MEGATRON_SPECS:
        extra_state[spec] = tuple(meg.get(f"extra_state_{spec}", ()))
    vllm = data.get("vllm", {})
    _check_keys(source, "[vllm]", vllm, VLLM_KEYS)
    vllm_scales = tuple(vllm.get("attention_scales", ()))
    for name in vllm_scales:
        if "{layer}" not in name:
            raise MappingError(f"{source}: [vllm] attention_scales entry '{name}' needs a {{layer}} placeholder")

    hf_table = data.get("hf", {})
    _check_keys(source, "[hf]", hf_table, HF_KEYS)
    moe = data.get("moe", {})
    _check_keys(source, "[moe]", moe, MOE_KEYS)
    for key in ("experts", "expert_ffn", "shared_ffn", "shared_count"):
        if key in moe and moe[key] not in dims:
            raise MappingError(f"{source}: [moe] {key} must name a dims symbol{_suggest(str(moe[key]), dims)}")
    if moe and not {"experts", "expert_ffn", "top_k"} <= set(moe):
        raise MappingError(f"{source}: [moe] needs experts, expert_ffn (dims symbols) and top_k (a config key)")
    if moe.get("score", "softmax") not in ROUTER_SCORES:
        raise MappingError(f"{source}: [moe] score '{moe['score']}' is not one of {', '.join(ROUTER_SCORES)}")
    if moe.get("group_score", "top2_sum") not in GROUP_SCORES:
        raise MappingError(f"{source}: [moe] group_score '{moe['group_score']}' is not one of "
                           f"{', '.join(GROUP_SCORES)}")
    if ("groups" in moe) != ("group_topk" in moe):
        raise MappingError(f"{source}: [moe] groups and group_topk go together (the config keys of group-limited "
                           "routing)")
    if "group_switch" in moe:
        switch = moe["group_switch"]
        if not isinstance(switch, dict) or set(switch) != GROUP_SWITCH_KEYS:
            raise MappingError(f"{source}: [moe] group_switch must be a table with key, on and off")
    if "shared_ffn" in moe and "shared_count" in moe:
        raise MappingError(f"{source}: [moe] shared_ffn and shared_count are two ways to say one width: keep one")
    mla = data.get("mla", {})
    _check_keys(source, "[mla]", mla, MLA_KEYS)
    if mla and set(mla) != MLA_KEYS:
        raise MappingError(f"{source}: [mla] needs {', '.join(sorted(MLA_KEYS - set(mla)))}")
    for key, symbol in mla.items():
        if symbol not in dims:
            raise MappingError(f"{source}: [mla] {key} must name a dims symbol{_suggest(str(symbol), dims)}")
    mtp = data.get("mtp", {})
    _check_keys(source, "[mtp]", mtp, MTP_KEYS)
    if mtp and not isinstance(mtp.get("layers"), str):
        raise MappingError(f"{source}: [mtp] layers must name the config key of the MTP layer count")
    decoder = _parse_decoder(data.get("decoder", {}), source)
    config = _parse_config(data.get("config", {}), source, tuple(fam["architectures"]))

    weights = []
    seen = set()
    for i, w in enumerate(data["weight"]):
        where = f"weight #{i + 1} ({w.get('hf', '?')})"
        _check_keys(source, where, w, WEIGHT_KEYS)
        for required in ("hf", "split", "shape"):
            if required not in w:
                raise MappingError(f"{source}: {where} is missing '{required}'")
        if w["split"] not in SPLIT_KINDS:
            raise MappingError(f"{source}: {where} has unknown split '{w['split']}'{_suggest(w['split'], SPLIT_KINDS)}")
        slots = PACK_SLOTS.get(w["split"])
        if slots and w.get("slot") not in slots:
            raise MappingError(f"{source}: {where} needs slot one of {', '.join(slots)} for split '{w['split']}'")
        if not slots and "slot" in w and w["split"] != REPLICATED_PACK:
            raise MappingError(f"{source}: {where} has a slot but split '{w['split']}' does not pack")
        if w.get("split_megatron_local") not in (None, "replicated", "column", "row"):
            raise MappingError(f"{source}: {where} split_megatron_local must be replicated, column or row")
        if "when" in w:
            _check_condition(source, where, w["when"])
        if w.get("dtype") not in (None, "F32", "BF16", "F16"):
            raise MappingError(f"{source}: {where} dtype must be a safetensors dtype name (F32, BF16, F16)")
        if w.get("layers") == "mtp" and not mtp:
            raise MappingError(f"{source}: {where} is an MTP weight (layers = 'mtp') but the file has no [mtp] table")
        if "copy_of" in w and w.get("layers") != "mtp":
            raise MappingError(f"{source}: {where} copy_of is for the copies MTP layers store (layers = 'mtp')")
        for expr in w["shape"]:
            unknown = _names_in(str(expr)) - set(dims)
            if unknown:
                sym = sorted(unknown)[0]
                raise MappingError(f"{source}: {where} shape uses unknown symbol '{sym}'{_suggest(sym, dims)}")
        if w["split"] in ("row",) and len(w["shape"]) != 2:
            raise MappingError(f"{source}: {where} is split 'row' but is not 2-D")
        if w.get("stage") not in (None, "first", "last"):
            raise MappingError(f"{source}: {where} stage must be 'first' or 'last'")
        per_layer = "{layer}" in w["hf"]
        if not per_layer and w.get("stage") is None:
            raise MappingError(f"{source}: {where} is outside the layer stack and needs stage = 'first' or 'last'")
        if w["hf"] in seen:
            raise MappingError(f"{source}: {where} is declared twice")
        role = w.get("role")
        if role is not None and role not in (LAYER_ROLES if per_layer else MODEL_ROLES):
            valid = LAYER_ROLES if per_layer else MODEL_ROLES
            raise MappingError(f"{source}: {where} has unknown role '{role}' for a "
                               f"{'per-layer' if per_layer else 'model-level'} weight{_suggest(role, valid)}")
        if w.get("layers", "all") not in LAYER_KINDS:
            raise MappingError(f"{source}: {where} layers must be one of {', '.join(LAYER_KINDS)}")
        if "{expert}" in w["hf"] and (not moe or not per_layer or w.get("layers") != "sparse"):
            raise MappingError(f"{source}: {where} has an {{expert}} placeholder: it needs a [moe] table, a "
                               "{layer} placeholder and layers = 'sparse'")
        if "hf_fused" in w and "{expert}" in w["hf_fused"]:
            raise MappingError(f"{source}: {where} hf_fused '{w['hf_fused']}' stacks the experts: no {{expert}}")
        if w.get("hf_transposed") and len(w["shape"]) != 2:
            raise MappingError(f"{source}: {where} is hf_transposed but is not 2-D")
        if "hf_stored" in w and ("{layer}" in w["hf_stored"]) != per_layer:
            raise MappingError(f"{source}: {where} hf_stored '{w['hf_stored']}' must have a {{layer}} placeholder "
                               "exactly when its hf name has one")
        seen.add(w["hf"])
        te = w.get("megatron_te", w.get("megatron"))
        local = w.get("megatron_local", w.get("megatron"))
        if (te is None or local is None) and not w.get("copy_of"):
            raise MappingError(f"{source}: {where} needs 'megatron' (or both 'megatron_te' and 'megatron_local')")
        weights.append(WeightSpec(
            hf=w["hf"], split=w["split"], shape=tuple(str(s) for s in w["shape"]), slot=w.get("slot"),
            optional=bool(w.get("optional", False)), tied_to=w.get("tied_to"), stage=w.get("stage"), role=role,
            hf_stored=w.get("hf_stored"), hf_transposed=bool(w.get("hf_transposed", False)),
            layers=w.get("layers", "all"), hf_fused=w.get("hf_fused"),
            megatron_te=te, megatron_local=local, megatron_sparse=w.get("megatron_sparse"),
            megatron_grouped=w.get("megatron_grouped"), megatron_legacy_grouped=w.get("megatron_legacy_grouped"),
            vllm=w.get("vllm"), trtllm=w.get("trtllm"), meta=w.get("meta"), vllm_unfused=w.get("vllm_unfused"),
            when=w.get("when"), split_megatron_local=w.get("split_megatron_local"), dtype=w.get("dtype"),
            copy_of=w.get("copy_of"),
        ))
    roles = [w.role for w in weights if w.role]
    if len(roles) != len(set(roles)):
        dup = next(r for r in roles if roles.count(r) > 1)
        raise MappingError(f"{source}: role '{dup}' is given to two weights")
    names = {w.hf for w in weights}
    for w in weights:
        if w.tied_to and w.tied_to not in names:
            raise MappingError(f"{source}: {w.hf} is tied to unknown weight '{w.tied_to}'")
        if w.copy_of and w.copy_of not in names:
            raise MappingError(f"{source}: {w.hf} is a copy of unknown weight '{w.copy_of}'")
    _check_packs(weights, source)
    family = Family(name=fam["name"], description=fam.get("description", ""),
                    architectures=tuple(fam["architectures"]), dims=dims, weights=tuple(weights),
                    extra_state=extra_state, source=source, vllm_scales=vllm_scales, decoder=decoder,
                    config=config, hf_ignore=tuple(hf_table.get("ignore", ())), moe=dict(moe),
                    hf_optional_prefix=hf_table.get("optional_prefix", ""),
                    vllm_tied_name=vllm.get("tied_name"), mla=dict(mla), mtp=dict(mtp))
    check_defaults(family)
    return family


def _parse_decoder(table: dict, source: str) -> DecoderFeatures:
    _check_keys(source, "[decoder]", table, DECODER_KEYS)
    for key, choices in DECODER_CHOICES.items():
        if key in table and table[key] not in choices:
            raise MappingError(f"{source}: [decoder] {key} = '{table[key]}' is not a decoder feature"
                               f"{_suggest(str(table[key]), choices)}")
    if "activation" in table and table["activation"] not in ACTIVATIONS:
        raise MappingError(f"{source}: [decoder] activation '{table['activation']}' is not one the decoder "
                           f"implements{_suggest(str(table['activation']), ACTIVATIONS)}")
    return DecoderFeatures(**table)


def _parse_config(table: dict, source: str, architectures: tuple[str, ...]) -> ConfigSpelling:
    _check_keys(source, "[config]", table, CONFIG_KEYS)
    groups = table.get("bias_groups", {})
    _check_keys(source, "[config.bias_groups]", groups, set(BIAS_GROUPS))
    archs = []
    for name, entry in table.get("architectures", {}).items():
        where = f"[config.architectures.{name}]"
        if name not in architectures:
            raise MappingError(f"{source}: {where} is not one of the family's architectures"
                               f"{_suggest(name, architectures)}")
        _check_keys(source, where, entry, ARCH_CONFIG_KEYS)
        if "model_type" not in entry:
            raise MappingError(f"{source}: {where} needs a model_type")
        biases = entry.get("biases", {})
        _check_keys(source, f"{where} biases", biases, set(groups))
        if entry.get("window", "none") not in WINDOW_SPELLINGS:
            raise MappingError(f"{source}: {where} window '{entry['window']}' is not a spelling reshard reads"
                               f"{_suggest(str(entry['window']), WINDOW_SPELLINGS)}")
        archs.append((name, ArchitectureConfig(model_type=entry["model_type"], biases=tuple(sorted(biases.items())),
                                               other_model_types=tuple(entry.get("other_model_types", ())),
                                               window=entry.get("window", "none"),
                                               rotary_fraction=bool(entry.get("rotary_fraction", False)),
                                               requires=tuple(sorted(entry.get("requires", {}).items())),
                                               window_pattern=entry.get("window_pattern"),
                                               defaults=parse_table(entry.get("defaults", {}), source,
                                                                    f"{where[:-1]}.defaults]"))))
    return ConfigSpelling(norm_eps=table.get("norm_eps", "rms_norm_eps"),
                          activation=table.get("activation", "hidden_act"),
                          max_positions=table.get("max_positions", "max_position_embeddings"),
                          **{k: table.get(k) for k in ("attn_softcap", "final_softcap", "query_scale",
                                                       "rope_local_theta")},
                          bias_groups=tuple((g, tuple(w)) for g, w in groups.items()),
                          architectures=tuple(archs))


def _check_packs(weights: list[WeightSpec], source: str) -> None:
    """Weights sharing a fused Megatron (or vLLM) name must share a split kind and fill every slot once."""
    namings = [("Megatron", lambda w, s=spec: w.megatron_name(s)) for spec in MEGATRON_SPECS]
    namings.append(("HF", lambda w: w.hf_name))
    if any(w.trtllm for w in weights):
        namings.append(("TensorRT-LLM", lambda w: w.trtllm or w.hf))
    if any(w.vllm for w in weights):
        namings.append(("vLLM", lambda w: w.vllm_name))
    for layout, name_of in namings:
        packs: dict[str, list[WeightSpec]] = {}
        for w in weights:
            if not w.copy_of:  # a copy has no name outside HF
                packs.setdefault(name_of(w), []).append(w)
        for name, members in packs.items():
            if len(members) == 1 and (not members[0].slot or layout in ("HF", "TensorRT-LLM")
                                      or members[0].split == REPLICATED_PACK):
                continue  # HF stores most packed weights unfused, TensorRT-LLM its gate and up apart
            kinds = {m.split for m in members}
            if kinds == {REPLICATED_PACK}:
                if any(not m.slot for m in members) or len({m.slot for m in members}) != len(members):
                    raise MappingError(f"{source}: replicated weights {', '.join(m.hf for m in members)} share "
                                       f"{layout} name '{name}': each needs a slot of its own")
                continue
            if len(kinds) != 1 or next(iter(kinds)) not in PACK_SLOTS:
                raise MappingError(f"{source}: weights {', '.join(m.hf for m in members)} share {layout} name "
                                   f"'{name}' but are not one qkv or gate_up pack")
            slots = sorted(m.slot for m in members)
            if layout == "HF" and [m.slot for m in members] != list(PACK_SLOTS[next(iter(kinds))]):
                raise MappingError(f"{source}: HF fused tensor '{name}' must declare its slots in stored order "
                                   f"{', '.join(PACK_SLOTS[next(iter(kinds))])}")
            if layout == "HF" and len({m.hf_transposed for m in members}) > 1:
                raise MappingError(f"{source}: HF fused tensor '{name}' mixes transposed and plain members")
            if slots != sorted(PACK_SLOTS[next(iter(kinds))]):
                raise MappingError(f"{source}: {layout} pack '{name}' has slots {slots}, needs "
                                   f"{sorted(PACK_SLOTS[next(iter(kinds))])}")


def load_family_file(path: str | Path) -> Family:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise MappingError(f"mapping file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise MappingError(f"{path}: invalid TOML: {exc}") from None
    return parse_family(data, str(path))


def shipped_mappings_dir():
    """The folder of shipped mapping files: ``reshard/mappings/`` inside an installed wheel or sdist, else the
    repository's top-level ``mappings/`` (a source checkout or an editable install)."""
    packaged = resources.files("reshard") / "mappings"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "mappings"


def shipped_mapping_text(name: str) -> str:
    """The text of shipped mapping ``name`` (see :func:`shipped_mapping_names`)."""
    names = shipped_mapping_names() + shipped_mapping_names(multimodal=True)
    if name not in names:
        raise MappingError(f"no shipped mapping '{name}'{_suggest(name, names)}")
    return (shipped_mappings_dir() / f"{name}.toml").read_text()


def shipped_mapping_names(multimodal: bool = False) -> list[str]:
    """The shipped text-family mapping files (``multimodal``: the vision-language ones, mapping_vlm.py)."""
    names = sorted(p.name[:-5] for p in shipped_mappings_dir().iterdir() if p.name.endswith(".toml"))
    return [n for n in names if _is_multimodal_file(n) == multimodal]


@functools.lru_cache(maxsize=None)
def _is_multimodal_file(name: str) -> bool:
    data = tomllib.loads((shipped_mappings_dir() / f"{name}.toml").read_text())
    return "text" in data or "extends" in data.get("family", {})  # reshard/mapping_vlm.py's files


def load_shipped(name: str) -> Family:
    return parse_family(tomllib.loads(shipped_mapping_text(name)), f"mappings/{name}.toml")


def text_family_for_architecture(architecture: str, mapping_file: str | Path | None = None) -> Family | None:
    """The text family whose mapping lists ``architecture`` (None when no shipped one does); a user's ``--mapping``
    file takes precedence. :func:`reshard.mapping_vlm.family_for_architecture` also composes vision-language
    families."""
    if mapping_file is not None:
        fam = load_family_file(mapping_file)
        if architecture not in fam.architectures:
            raise MappingError(f"mapping {mapping_file} does not list architecture '{architecture}' "
                               f"(it lists {', '.join(fam.architectures)})")
        return fam
    for name in shipped_mapping_names():
        fam = load_shipped(name)
        if architecture in fam.architectures:
            return fam
    return None


def text_architectures() -> list[str]:
    return [a for name in shipped_mapping_names() for a in load_shipped(name).architectures]
