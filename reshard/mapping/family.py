"""A parsed, validated mapping file (:class:`Family`) and what it answers for one config: which layers are sparse
(Mixture of Experts) or multi-token prediction, which weights the model holds, and the integer value of every dims
symbol.

Built by parsing.py (a text family) or vlm.py (a vision-language family composed for one config).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reshard.errors import MappingError
from reshard.mapping.conditions import _parse_condition, config_condition, evaluate, lookup
from reshard.mapping.defaults import with_defaults
from reshard.mapping.features import ConfigSpelling, DecoderFeatures
from reshard.mapping.weight import WeightSpec


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
    hf_drop_prefix: str = ""  # tensors under it are not carried: dropped on read with a note (Qwen3-Next's "mtp.")
    moe: dict = field(default_factory=dict)  # the [moe] table (MOE_KEYS)
    mla: dict = field(default_factory=dict)  # the [mla] table (MLA_KEYS): dims symbols
    mtp: dict = field(default_factory=dict)  # the [mtp] table (MTP_KEYS)
    multimodal: object | None = None  # a composed vision-language family's vlm.Multimodal
    layer_kinds: dict = field(default_factory=dict)  # the [layers] table (mapping/sections.py): mixer per layer

    def sparse_layers(self, config: dict, layers: int) -> tuple[int, ...]:
        """The layers whose MLP is a Mixture of Experts (none for a dense family): every ``sparse_step``-th
        (1-based) except the ``dense_layers`` list (transformers' Qwen2-MoE) and the first ``dense_prefix``
        layers (DeepSeek's ``first_k_dense_replace``)."""
        if not self.moe:
            return ()
        if "sparse_list" in self.moe and config.get(self.moe["sparse_list"]) is not None:  # Llama 4's moe_layers
            return tuple(sorted(int(i) for i in config[self.moe["sparse_list"]]))
        step = int(config.get(self.moe["sparse_step"], 1) or 1) if "sparse_step" in self.moe else 1
        if "sparse_end" in self.moe:  # Ernie 4.5: start <= i <= end (inclusive; end unset or -1: the last layer)
            start, end = (int(config.get(self.moe[k]) if config.get(self.moe[k]) is not None else default)
                          for k, default in (("sparse_start", 0), ("sparse_end", -1)))
            end = layers - 1 if end == -1 else end
            return tuple(i for i in range(layers) if (i + 1) % step == 0 and start <= i <= end)
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

    def has_role(self, role: str, config: dict | None = None) -> bool:
        """Whether the model (of ``config``, for a weight with a ``when`` condition) has the weight ``role``:
        GLM-4.5's q/k norms exist only where ``use_qk_norm`` is set."""
        spec = self.role_spec(role)
        return spec is not None and (spec.when is None or config is None or config_condition(spec.when, config))

    def role_switch(self, role: str) -> str | None:
        """The config key whose truth switches weight ``role`` on (its ``when = "KEY"``), else None."""
        spec = self.role_spec(role)
        return spec.when.strip() if spec is not None and spec.when and spec.when.strip().isidentifier() else None

    def condition_keys(self) -> set[str]:
        """The config keys the weights' ``when`` conditions read: settings this mapping carries."""
        return {_parse_condition(w.when)[0] for w in self.weights if w.when}

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
