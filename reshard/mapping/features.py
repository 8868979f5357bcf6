"""What a family's ``[decoder]`` and ``[config]`` tables say, parsed: how it computes (:class:`DecoderFeatures`) and
how its config.json spells that meaning (:class:`ConfigSpelling`, one :class:`ArchitectureConfig` per architecture).

Parsed by tables.py; read by the forward verifier (decoder features) and layouts/hf_config.py (config spelling).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecoderFeatures:
    """How a family computes, in the reference decoder's terms (see ``[decoder]`` in a mapping file).

    ``norm``: ``rms`` (HF RMSNorm) or ``layer`` (LayerNorm); ``mlp``: ``gated`` (``down(act(gate(x)) * up(x))``)
    or ``plain`` (``down(act(up(x)))``); ``position``: ``rope`` (rotate-half) or ``learned`` (an absolute
    position embedding added to the token embedding); ``activation``: the HF ``hidden_act`` used when the config
    has none; ``norm_offset``: norm weights are stored as w and applied as 1 + w (Gemma's RMSNorm, Nemotron's
    LayerNorm1P); ``embedding_scaled``: the embedding is multiplied by sqrt(hidden) (Gemma).
    """

    norm: str = "rms"
    mlp: str = "gated"
    position: str = "rope"
    activation: str = "silu"
    norm_offset: bool = False
    embedding_scaled: bool = False
    rope_order: str = "half"  # interleaved: HF's q/k rows rotate pairs (2i, 2i+1) (Llama 4)
    variant: str | None = None  # llama4: the per-layer rules of reshard/layouts/llama4_rules.py


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
    defaults: tuple[tuple[str, object], ...] = ()  # its transformers config class's defaults (defaults.py)


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
    embedding_multiplier: str | None = None  # the config keys of Granite's multipliers (schema.MULTIPLIER_KEYS)
    attention_multiplier: str | None = None
    residual_multiplier: str | None = None
    logits_scaling: str | None = None
    bias_groups: tuple[tuple[str, tuple[str, ...]], ...] = ()
    architectures: tuple[tuple[str, ArchitectureConfig], ...] = ()

    def architecture(self, name: str) -> ArchitectureConfig | None:
        return dict(self.architectures).get(name)
