"""The canonical model config: what a checkpoint's settings mean for the computation, whatever their spelling.

Every layout reads its own spelling into one :class:`ModelConfig` (config.json in transformers 4 or 5 spelling,
a key it leaves out meaning its transformers config class's default (reshard/mapping/defaults.py); Megatron-LM args,
...) and writes it back in a target's spelling. A value a target cannot express is refused at
plan time (:class:`ConfigLoss`), never dropped; ``verify`` compares these objects, so spellings do not matter and
meaning does. Pure data: no I/O.

RoPE: ``rope_theta`` and ``rope_scaling`` (``None`` or the sorted items of transformers' scaling dict without the
theta: ``rope_type`` = ``linear`` | ``llama3`` | ``dynamic`` | ``yarn`` | ``longrope`` | ..., and its
parameters), ``rotary_fraction`` (the share of each head's dims that rotate), ``rope_interleaved`` (pairs
``(2i, 2i+1)`` rotate instead of HF's halves). Sliding window: ``sliding_window`` tokens (a query attends to itself
and the ``sliding_window - 1`` keys before it), on ``sliding_layers`` (``None``: every layer). Biases: ``qkv_bias``
(q, k, v projections), ``o_bias`` (attention output), ``mlp_bias`` (every MLP linear). Structure: ``position``
(``rope`` or ``learned`` absolute embeddings, whose RoPE fields then keep their defaults), ``gated_mlp``
(``down(act(gate(x)) * up(x))`` or ``down(act(up(x)))``), ``qk_norm`` (an RMSNorm over each head's q and k before
RoPE, Qwen3). Gemma: ``norm_offset`` (norm weights stored as w and applied as 1 + w), ``embedding_scaled`` (the
embedding times sqrt(hidden)), ``sandwich_norm`` (a norm on the attention and on the MLP output before each
residual add), ``attn_softcap`` / ``final_softcap`` (``cap * tanh(x / cap)`` on attention scores / logits),
``query_scale`` (scores scaled by ``query_scale ** -0.5`` instead of ``head_dim ** -0.5``), ``rope_local_theta``
(the RoPE base of sliding-window layers when it differs from the others'). Mixture of Experts: ``experts`` routed
experts (0: dense), ``experts_per_token`` (top-k), ``expert_ffn`` (each expert's intermediate size),
``router_renormalize`` (the top-k softmax weights renormalised to sum to 1, else taken from the softmax over all
experts), ``moe_layers`` (``None``: every layer), ``shared_expert_ffn`` (0: none) and ``shared_expert_gate`` (its
output times ``sigmoid(x @ gate)``, Qwen2-MoE). Routing: ``router_score`` (``softmax`` or ``sigmoid`` of the router
logits), ``router_bias`` (a per-expert bias added to the scores for the choice of experts only, DeepSeek-V3's
``e_score_correction_bias``), ``router_groups`` / ``router_group_topk`` (group-limited routing: the experts in
``router_groups`` equal groups, the choice restricted to the ``router_group_topk`` best groups by
``router_group_score``: ``topN_sum`` the sum of each group's N best choice scores, ``max`` its best), and
``router_scaling`` (the routed weights' factor). Multi-head latent attention (DeepSeek, ``kv_lora_rank`` > 0):
``q_lora_rank`` (0: a plain q projection), ``kv_lora_rank``, ``rope_head_dim`` (the RoPE part of each q / k head,
whose pairs ``(2i, 2i+1)`` rotate) and ``v_head_dim``; ``head_dim`` is then the no-RoPE part. ``mtp_layers``:
multi-token-prediction layers after the decoder (not part of the main model's function; kept or dropped).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from reshard.errors import PlanError

#: Fields a reader may not know from its spelling (dims are checked against the weights instead).
SEMANTIC_FIELDS = ("architecture", "hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "vocab",
                   "max_positions", "norm", "norm_eps", "activation", "rope_theta", "rope_scaling",
                   "rotary_fraction", "rope_interleaved", "sliding_window", "sliding_layers", "qkv_bias", "o_bias",
                   "mlp_bias", "tied", "residual_post_norm", "position", "gated_mlp", "qk_norm", "norm_offset",
                   "embedding_scaled", "sandwich_norm", "attn_softcap", "final_softcap", "query_scale",
                   "rope_local_theta", "experts", "experts_per_token", "expert_ffn", "router_renormalize",
                   "moe_layers", "shared_expert_ffn", "shared_expert_gate", "router_score", "router_bias",
                   "router_groups", "router_group_topk", "router_group_score", "router_scaling", "q_lora_rank",
                   "kv_lora_rank", "rope_head_dim", "v_head_dim", "mtp_layers", "embedding_multiplier",
                   "attention_multiplier", "residual_multiplier", "logits_scaling", "llama4", "gpt_oss", "cohere")

#: config.json keys known to change what a model computes that reshard's canonical config has no field for
#: (Granite's multipliers, Cohere's logit scale and q/k norm, MiniCPM's scales, Gemma's soft-capping and query
#: scale, parallel attention + MLP blocks, DeepSeek-V3.2's sparse-attention indexer), with the value that changes nothing (None: any value set changes it).
#: A family whose mapping names the key carries it; for any other, a source setting one is refused unless
#: ``--allow-lossy-config KEY`` drops it knowingly.
UNCARRIED_SETTINGS = {"embedding_multiplier": 1.0, "attention_multiplier": None, "residual_multiplier": 1.0,
                      "logits_scaling": 1.0, "logit_scale": 1.0, "use_qk_norm": False, "scale_emb": 1.0,
                      "scale_depth": None, "dim_model_base": None, "attn_logit_softcapping": None,
                      "final_logit_softcapping": None, "query_pre_attn_scalar": None, "parallel_attn": False,
                      "use_parallel_residual": False, "index_topk": None}


@dataclass(frozen=True)
class ModelConfig:
    """What changes the function a checkpoint computes (see the module docstring for each group)."""

    architecture: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    max_positions: int | None = None
    norm: str = "rms"
    norm_eps: float = 1e-6
    activation: str = "silu"
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rotary_fraction: float = 1.0
    rope_interleaved: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tied: bool = False
    residual_post_norm: bool = False  # Megatron apply_residual_connection_post_layernorm
    position: str = "rope"  # rope | learned
    gated_mlp: bool = True
    qk_norm: bool = False
    norm_offset: bool = False
    embedding_scaled: bool = False
    sandwich_norm: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_scale: float | None = None
    rope_local_theta: float | None = None
    experts: int = 0
    experts_per_token: int = 0
    expert_ffn: int = 0
    router_renormalize: bool = False
    moe_layers: tuple[int, ...] | None = None
    shared_expert_ffn: int = 0
    shared_expert_gate: bool = False
    router_score: str = "softmax"
    router_bias: bool = False
    router_groups: int = 1
    router_group_topk: int = 1
    router_group_score: str | None = None  # top2_sum | topN_sum | max, when router_groups > 1
    router_scaling: float = 1.0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_head_dim: int = 0
    v_head_dim: int = 0
    mtp_layers: int = 0
    embedding_multiplier: float = 1.0  # Granite: embedding times m_e, every residual branch times m_r, logits / s,
    attention_multiplier: float | None = None  # the absolute softmax scale (else head_dim ** -0.5)
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    cohere: tuple[tuple[str, Any], ...] | None = None  # Command-R / Cohere2 rules (layouts/cohere_rules.py)
    # Llama 4 text's per-layer rules (NoPE layers, L2 q/k norm, chunked attention, temperature tuning, routing on
    # the input) as sorted items (reshard/layouts/llama4_rules.py meaning_fields); None for other families
    llama4: tuple[tuple[str, Any], ...] | None = None
    gpt_oss: tuple[tuple[str, Any], ...] | None = None  # swiglu_alpha / swiglu_limit (layouts/gpt_oss_rules.py)

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank > 0

    @property
    def rope_type(self) -> str:
        return dict(self.rope_scaling or ()).get("rope_type", "default")

    @property
    def scaling(self) -> dict:
        """``rope_scaling`` as a dict (empty for plain RoPE)."""
        return dict(self.rope_scaling or ())

    def windowed_layers(self) -> tuple[int, ...]:
        """The layers that use the sliding window (none without one)."""
        if not self.sliding_window:
            return ()
        return tuple(range(self.layers)) if self.sliding_layers is None else self.sliding_layers

    def sparse_layers(self) -> tuple[int, ...]:
        """The Mixture-of-Experts layers (none for a dense model)."""
        if not self.experts:
            return ()
        return tuple(range(self.layers)) if self.moe_layers is None else self.moe_layers

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = self.scaling or None
        d["sliding_layers"] = list(self.sliding_layers) if self.sliding_layers is not None else None
        d["moe_layers"] = list(self.moe_layers) if self.moe_layers is not None else None
        d["llama4"] = {k: list(v) if isinstance(v, tuple) else v for k, v in self.llama4} if self.llama4 else None
        d["gpt_oss"] = dict(self.gpt_oss) if self.gpt_oss else None
        d["cohere"] = dict(self.cohere) if self.cohere else None
        return d


def normalize_scaling(scaling: dict | None) -> tuple[tuple[str, Any], ...] | None:
    """transformers' ``rope_scaling`` / ``rope_parameters`` dict as canonical items: ``type`` read as
    ``rope_type`` (Qwen-VL's ``mrope`` as ``default``, as transformers reads it), the theta and the partial-rotary
    factor removed (fields of their own), numbers as floats except ``original_max_position_embeddings``; ``None``
    for plain RoPE."""
    if not scaling:
        return None
    items = {}
    for key, value in scaling.items():
        if key in ("rope_theta", "partial_rotary_factor"):
            continue
        key = "rope_type" if key == "type" else key
        if key == "rope_type" and value == "mrope":  # Qwen-VL's old spelling of default RoPE + mrope_section
            value = "default"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            items[key] = tuple(value) if isinstance(value, list) else value
        else:
            items[key] = int(value) if key == "original_max_position_embeddings" else float(value)
    if items.get("rope_type", "default") == "default" and set(items) <= {"rope_type"}:
        return None
    return tuple(sorted(items.items()))


def differences(a: ModelConfig, b: ModelConfig) -> list[tuple[str, Any, Any]]:
    """(field, a's value, b's value) for every field that differs."""
    da, db = a.as_dict(), b.as_dict()
    return [(f, da[f], db[f]) for f in SEMANTIC_FIELDS if da[f] != db[f]]


@dataclass
class ConfigLoss:
    """Collects what a target spelling cannot express; :meth:`check` refuses unless the field is allowed lossy."""

    target: str
    allowed: tuple[str, ...] = ()
    lost: list[tuple[str, Any, str]] = dataclasses.field(default_factory=list)
    kept_aside: list[str] = dataclasses.field(default_factory=list)

    def cannot(self, field: str, value: Any, why: str) -> None:
        self.lost.append((field, value, why))

    def record(self, what: str, why: str) -> None:
        """Meaning the target keeps outside its own spelling (a note, not a loss)."""
        self.kept_aside.append(f"{what}: {why}")

    def check(self) -> list[str]:
        """Raise ``PlanError`` for the first loss not allowed; return notes for the allowed ones."""
        for field, value, why in self.lost:
            if field not in self.allowed:
                raise PlanError(f"the {self.target} config cannot express {field} = {value!r} ({why}); the output "
                                f"would compute a different function. Convert to another layout, or pass "
                                f"--allow-lossy-config {field} to drop it knowingly")
        return self.kept_aside + [f"dropped {field} = {value!r} from the {self.target} config ({why}; "
                                  "--allow-lossy-config)" for field, value, why in self.lost]
