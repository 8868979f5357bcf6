"""One tensor-parallel rank's weights in decoder form, read from a checkpoint's own rank files.

A layout's ``rank_loader`` (a :class:`~reshard.verification.forward.rank_stream.RankStream` named on its
:class:`~reshard.layouts.base.Layout`) reads only what rank ``rank`` of ``world`` holds, one layer at a time:
Megatron reads its own ``mp_rank_{rank:02d}[_{stage:03d}]`` files, vLLM its own
``model-rank-{rank}-part-*.safetensors``, an HF checkpoint (TP=1 on disk) is sliced by row / column ranges. The
decoder never sees a layout: only these plain local tensors. This module imports no loader: loaders import it (no
import cycle).

Local tensors (``nh``/``ng`` heads, ``d`` head dim, ``H`` hidden, ``F`` intermediate, over ``world`` ranks):
``q`` ``[nh/world*d, H]``; ``k``, ``v`` ``[max(ng/world, 1)*d, H]`` (one replicated KV head when
``world > ng``: KV head ``rank // (world/ng)``); ``o`` ``[H, nh/world*d]`` (a column slice, row-parallel);
``gate``, ``up`` ``[F/world, H]``; ``down`` ``[H, F/world]``; ``embedding`` / ``lm_head`` rows
``[vocab_start, vocab_start + rows)`` of the padded vocab (rows at or past the true vocab are padding).
Multi-head latent attention splits whole heads the same way (``q_b`` / ``q``, ``kv_b`` by rows, ``o`` by columns);
its down projections ``q_a`` / ``kv_a`` are whole on every rank, or (Megatron's local spec) the rank's row block,
whose outputs the decoder all-gathers as Megatron-Core does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from reshard.errors import CheckpointError, ReshardError
from reshard.core.model_config import ModelConfig
from reshard.mapping import WeightSpec

#: RoPE scaling types and activations the decoder implements (rope.rope_inv_freq, ACTIVATION_FUNCTIONS): every
#: type transformers' RoPE of a shipped family takes (its ROPE_INIT_FUNCTIONS less Gemma 4's ``proportional``).
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
ACTIVATION_NAMES = ("silu", "gelu", "gelu_tanh", "relu", "relu2")
ROUTER_SCORES = ("softmax", "sigmoid")
#: transformers' Phi3Config default for its top-level ``original_max_position_embeddings`` (which its longrope
#: uses whatever rope_parameters say, and which reshard's canonical config does not carry).
PHI3_ORIGINAL_MAX_POSITIONS = 4096


@dataclass
class DecoderConfig:
    """What the decoder needs from an HF-style config and the family's decoder features (same for every rank)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    sliding_window: int | None = None
    window_layers: tuple[int, ...] = ()  # the layers that use the sliding window
    architecture: str = ""
    norm: str = "rms"  # rms | layer
    mlp: str = "gated"  # gated | plain
    position: str = "rope"  # rope | learned
    activation: str = "silu"  # silu | gelu | gelu_tanh | relu | relu2 (relu squared, Nemotron)
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE
    norm_offset: bool = False  # norms apply 1 + w (Gemma's RMSNorm, Nemotron's LayerNorm1P)
    embedding_scaled: bool = False  # embedding times sqrt(hidden) (Gemma)
    sandwich_norm: bool = False  # norms on the attention and MLP outputs (Gemma 2 / 3)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_scale: float | None = None  # attention scores times query_scale ** -0.5 (else head_dim ** -0.5)
    rope_local_theta: float | None = None  # RoPE base of the sliding-window layers (plain RoPE there)
    experts_per_token: int = 0  # Mixture of Experts: top-k of the router's scores
    router_renormalize: bool = False  # the top-k weights renormalised to sum to 1
    router_score: str = "softmax"  # softmax | sigmoid of the router logits (fp32)
    router_groups: int = 1  # group-limited routing: experts in equal groups, the best router_group_topk kept
    router_group_topk: int = 1
    router_group_score: str | None = None  # topN_sum (the sum of a group's N best choice scores) | max
    router_scaling: float = 1.0  # the routed weights' factor
    max_positions: int | None = None  # yarn without a factor: max_positions / original_max_position_embeddings
    q_lora_rank: int = 0  # multi-head latent attention (kv_lora_rank > 0): head_dim is then the no-RoPE part dn
    kv_lora_rank: int = 0
    rope_head_dim: int = 0  # dr: the RoPE part of each q / k head, pairs (2i, 2i+1) rotated
    v_head_dim: int = 0  # dv
    rotary_fraction: float = 1.0  # partial rotary: RoPE on the first int(head_dim * rotary_fraction) dims of a head
    embedding_multiplier: float = 1.0  # Granite: the embedding times this
    attention_multiplier: float | None = None  # Granite: the absolute softmax scale (replaces query_scale's)
    residual_multiplier: float = 1.0  # Granite: every block's output times this before the residual add
    logits_scaling: float = 1.0  # Granite: the logits divided by this
    gdn: tuple | None = None  # Gated DeltaNet dims and the gated query (forward/gated_deltanet.py decoder_fields)
    mamba: tuple | None = None  # Nemotron-H: Mamba2 dims, one block per layer (forward/mamba2.py decoder_fields)
    cohere: tuple | None = None  # Command-R / Cohere2 rules (ModelConfig.cohere; forward/cohere_ops.py)
    llama4: tuple | None = None  # Llama 4 text's per-layer rules (ModelConfig.llama4; forward/llama4_layer.py)
    gpt_oss: tuple | None = None  # swiglu_alpha / swiglu_limit (ModelConfig.gpt_oss; forward/gpt_oss_ops.py)
    rope_interleaved: bool = False  # RoPE rotates pairs (2i, 2i+1) of q / k as stored (Ernie 4.5; rope.rotate_pairs)

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2 / V3)."""
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """The dims of a head that RoPE rotates: latent attention's ``rope_head_dim``, else the first
        ``int(head_dim * rotary_fraction)`` (transformers', megatron-core's and vLLM's rounding)."""
        return self.rope_head_dim if self.mla else int(self.head_dim * self.rotary_fraction)

    @classmethod
    def from_meaning(cls, meaning: ModelConfig) -> "DecoderConfig":
        """From the canonical config; refuses (before any worker starts, as ``verify --forward`` builds it for
        both sides first) what the decoder does not implement."""
        lacking = []
        scaling = rope_parameters(meaning) if meaning.position == "rope" else {}
        kind = scaling.get("rope_type", "default")
        if kind not in ROPE_TYPES:
            lacking.append(f"rope_scaling type '{kind}' (it implements {', '.join(ROPE_TYPES)})")
        else:
            lacking += _rope_gaps(meaning, kind, scaling)
        if meaning.rope_interleaved and meaning.rotary_fraction != 1.0:  # (Ernie 4.5: every head dim, pairs)
            lacking.append("interleaved RoPE on part of each head")
        if meaning.experts and meaning.router_score not in ROUTER_SCORES:
            lacking.append(f"router score '{meaning.router_score}' (it implements {', '.join(ROUTER_SCORES)})")
        if meaning.experts and meaning.router_groups > 1 and not _group_score_known(meaning.router_group_score):
            lacking.append(f"router group score '{meaning.router_group_score}' (it implements topN_sum, max)")
        if meaning.residual_post_norm:
            lacking.append("the residual taken after the norm")
        if meaning.activation not in ACTIVATION_NAMES:
            lacking.append(f"activation '{meaning.activation}' (it implements {', '.join(ACTIVATION_NAMES)})")
        if lacking:
            raise ReshardError(f"the forward verifier does not implement {'; '.join(lacking)}; verify this "
                               "checkpoint with the digest check (reshard verify without --forward)")
        return cls(hidden=meaning.hidden, heads=meaning.heads, kv_heads=meaning.kv_heads, head_dim=meaning.head_dim,
                   layers=meaning.layers, vocab=meaning.vocab, eps=meaning.norm_eps, rope_theta=meaning.rope_theta,
                   rope_scaling=scaling or None, sliding_window=meaning.sliding_window,
                   window_layers=meaning.windowed_layers(), architecture=meaning.architecture, norm=meaning.norm,
                   mlp="gated" if meaning.gated_mlp else "plain", position=meaning.position,
                   activation=meaning.activation, qk_norm=meaning.qk_norm, norm_offset=meaning.norm_offset,
                   embedding_scaled=meaning.embedding_scaled, sandwich_norm=meaning.sandwich_norm,
                   attn_softcap=meaning.attn_softcap, final_softcap=meaning.final_softcap,
                   query_scale=meaning.query_scale, rope_local_theta=meaning.rope_local_theta,
                   experts_per_token=meaning.experts_per_token, router_renormalize=meaning.router_renormalize,
                   router_score=meaning.router_score, router_groups=meaning.router_groups,
                   router_group_topk=meaning.router_group_topk, router_group_score=meaning.router_group_score,
                   router_scaling=meaning.router_scaling, max_positions=meaning.max_positions,
                   q_lora_rank=meaning.q_lora_rank, kv_lora_rank=meaning.kv_lora_rank,
                   rope_head_dim=meaning.rope_head_dim, v_head_dim=meaning.v_head_dim,
                   rotary_fraction=meaning.rotary_fraction if meaning.position == "rope" else 1.0,
                   embedding_multiplier=meaning.embedding_multiplier,
                   attention_multiplier=meaning.attention_multiplier,
                   residual_multiplier=meaning.residual_multiplier, logits_scaling=meaning.logits_scaling,
                   gpt_oss=meaning.gpt_oss, llama4=meaning.llama4, cohere=meaning.cohere,
                   rope_interleaved=meaning.rope_interleaved and not meaning.mla and not meaning.llama4)


def rope_parameters(meaning: ModelConfig) -> dict:
    """``meaning``'s RoPE scaling as transformers' config classes standardise it: Phi-3 reads ``su`` and ``yarn``
    as ``longrope`` (Phi3Config); ``original_max_position_embeddings``, where llama3 / yarn / longrope scaling
    leaves it out, is Phi-3's top-level key (reshard does not carry it: its Phi3Config default,
    :data:`PHI3_ORIGINAL_MAX_POSITIONS`) or else ``max_position_embeddings``."""
    scaling = meaning.scaling
    if meaning.architecture == "Phi3ForCausalLM" and scaling.get("rope_type") in ("su", "yarn"):
        scaling["rope_type"] = "longrope"
    if scaling.get("rope_type") in ("llama3", "yarn", "longrope") and \
            scaling.get("original_max_position_embeddings") is None:
        original = PHI3_ORIGINAL_MAX_POSITIONS if meaning.architecture == "Phi3ForCausalLM" else meaning.max_positions
        if original is not None:
            scaling["original_max_position_embeddings"] = original
    return scaling


def _rope_gaps(meaning: ModelConfig, kind: str, scaling: dict) -> list[str]:
    """What RoPE of type ``kind`` lacks to be computed: an even rotary dim; ``factor`` (linear, dynamic, llama3)
    or ``max_position_embeddings`` in its place (yarn, longrope); ``max_position_embeddings`` (dynamic); the
    original length (llama3, yarn, longrope); longrope's short and long factors, one per rotated pair."""
    gaps = []
    rotary = meaning.rope_head_dim if meaning.mla else int(meaning.head_dim * meaning.rotary_fraction)
    if rotary <= 0 or rotary % 2:
        gaps.append(f"a rotary dim of {rotary} (head dim {meaning.head_dim} x partial rotary "
                    f"{meaning.rotary_fraction}: RoPE rotates pairs)")
    if kind == "default":
        return gaps
    missing = []
    if scaling.get("factor") is None and (kind in ("linear", "dynamic", "llama3") or meaning.max_positions is None):
        missing.append("factor")
    if kind == "dynamic" and meaning.max_positions is None:
        missing.append("max_position_embeddings")
    if kind in ("llama3", "yarn", "longrope") and scaling.get("original_max_position_embeddings") is None:
        missing.append("original_max_position_embeddings")
    if kind == "llama3":
        missing += [k for k in ("low_freq_factor", "high_freq_factor") if scaling.get(k) is None]
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            factors = scaling.get(key)
            if not isinstance(factors, tuple) or len(factors) != rotary // 2:
                missing.append(f"{key} ({rotary // 2} numbers, one per rotated pair)")
    if missing:
        gaps.append(f"{kind} RoPE lacking {', '.join(missing)}")
    return gaps


def _group_score_known(score: str | None) -> bool:
    """``max`` or ``topN_sum`` with N a positive integer."""
    if score == "max":
        return True
    n = (score or "").removeprefix("top").removesuffix("_sum")
    return bool(score) and score.startswith("top") and score.endswith("_sum") and n.isdigit() and int(n) > 0


@dataclass
class LayerWeights:
    """One layer's local tensors, one field per mapping role (:data:`reshard.mapping.LAYER_ROLES`). ``gate`` is
    None for a plain MLP (``up`` is then its first linear); norm biases are None for RMSNorm; ``q_norm`` /
    ``k_norm`` (``[head_dim]``) only with per-head q/k norms. A Mixture-of-Experts layer has a ``router`` and the
    routed experts this rank computes, by global index: ``(gate, up, down)`` slices whose contributions, summed
    over the ranks, count every expert once (a loader gives each expert slice to exactly one rank)."""

    input_norm: torch.Tensor | None = None
    post_norm: torch.Tensor | None = None
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    o: torch.Tensor | None = None
    gate: torch.Tensor | None = None
    up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None  # replicated, added once after the all-reduce
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None  # replicated, added once after the all-reduce
    input_norm_bias: torch.Tensor | None = None  # LayerNorm only
    post_norm_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_output_norm: torch.Tensor | None = None  # Gemma 2 / 3 sandwich norms
    mlp_output_norm: torch.Tensor | None = None
    router: torch.Tensor | None = None  # a Mixture-of-Experts layer: [E, H], whole on every rank
    experts: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    shared_gate: torch.Tensor | None = None  # the shared expert (dense-TP slices, like a dense MLP)
    shared_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None
    shared_expert_gate: torch.Tensor | None = None  # [1, H], whole
    router_bias: torch.Tensor | None = None  # [E], whole: added to the scores for the choice of experts only
    q_a: torch.Tensor | None = None  # multi-head latent attention: [rq, H] whole, or the rank's row block
    q_a_norm: torch.Tensor | None = None  # [rq]
    q_b: torch.Tensor | None = None  # [nh/world * (dn + dr), rq]; without q LoRA, ``q`` [nh/world * (dn + dr), H]
    kv_a: torch.Tensor | None = None  # [rkv + dr, H] whole, or the rank's row block
    kv_a_norm: torch.Tensor | None = None  # [rkv]
    kv_b: torch.Tensor | None = None  # [nh/world * (dn + dv), rkv]; ``o`` is then [H, nh/world * dv]
    gdn_qkvz: torch.Tensor | None = None  # Gated DeltaNet (forward/gated_deltanet.py): the rank's whole key heads
    gdn_ba: torch.Tensor | None = None
    gdn_conv: torch.Tensor | None = None
    gdn_a_log: torch.Tensor | None = None
    gdn_dt_bias: torch.Tensor | None = None
    gdn_norm: torch.Tensor | None = None
    gdn_out: torch.Tensor | None = None
    mamba_in: torch.Tensor | None = None  # Mamba2 (forward/mamba2.py): the rank's [z; x; B; C; dt] sections
    mamba_conv: torch.Tensor | None = None  # [x; B; C] sections
    mamba_conv_bias: torch.Tensor | None = None
    mamba_a_log: torch.Tensor | None = None
    mamba_d: torch.Tensor | None = None
    mamba_dt_bias: torch.Tensor | None = None
    mamba_norm: torch.Tensor | None = None
    mamba_out: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # gpt-oss: one softmax sink logit per local query head
    router_linear_bias: torch.Tensor | None = None  # gpt-oss: [E] added to the router logits


@dataclass
class RankWeights:
    """This rank's tensors. ``lm_head`` None means tied: the head is the embedding slice."""

    config: DecoderConfig
    rank: int
    world: int
    embedding: torch.Tensor
    vocab_start: int
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor | None
    lm_head_start: int
    padded_vocab: int
    dtype: torch.dtype
    files: list[str] = field(default_factory=list)  # the files this rank read
    final_norm_bias: torch.Tensor | None = None  # LayerNorm only
    position_embedding: torch.Tensor | None = None  # learned positions: [max positions, H], whole on every rank

    @property
    def vocab_size(self) -> int:
        return self.config.vocab


# ------------------------------------------------------------------------------ shared per-rank rules

def check_world(config: DecoderConfig, world: int, intermediate: int) -> None:
    """Refuse a TP degree the decoder cannot run the model at (before any file is read)."""
    nh, ng = config.heads, config.kv_heads
    if world < 1:
        raise ReshardError(f"--nproc must be >= 1 (got {world})")
    if nh % world:
        raise ReshardError(f"cannot run {nh} attention heads over {world} ranks: choose --nproc dividing {nh}")
    if ng % world and world % ng:
        raise ReshardError(f"cannot place {ng} KV heads on {world} ranks: --nproc must divide {ng} or be a "
                           f"multiple of it")
    if intermediate % world:
        raise ReshardError(f"cannot split intermediate size {intermediate} over {world} ranks: choose --nproc "
                           f"dividing it")


def kv_heads_of_rank(kv_heads: int, rank: int, world: int) -> range:
    """KV heads rank ``rank`` holds: ``ng/world`` of them, or one replica (head ``rank // (world/ng)``)."""
    if world <= kv_heads:
        per = kv_heads // world
        return range(rank * per, (rank + 1) * per)
    head = rank // (world // kv_heads)
    return range(head, head + 1)


def split_grouped_qkv(t: torch.Tensor, q_per_group: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Megatron ``linear_qkv`` rows of one rank: per local KV group ``[q heads of the group; k; v]``."""
    rest = t.shape[1:]
    grouped = t.reshape(-1, (q_per_group + 2) * head_dim, *rest)
    q = grouped[:, :q_per_group * head_dim].reshape(-1, *rest)
    k = grouped[:, q_per_group * head_dim:(q_per_group + 1) * head_dim].reshape(-1, *rest)
    v = grouped[:, (q_per_group + 1) * head_dim:].reshape(-1, *rest)
    return q, k, v


def split_stacked_qkv(t: torch.Tensor, q_rows: int, kv_rows: int) -> tuple[torch.Tensor, ...]:
    """A rank's ``[q_r; k_r; v_r]`` (vLLM ``qkv_proj``, TensorRT-LLM ``qkv``)."""
    if t.shape[0] != q_rows + 2 * kv_rows:
        raise CheckpointError(f"fused qkv has {t.shape[0]} rows, expected {q_rows} + 2 x {kv_rows}")
    return t[:q_rows], t[q_rows:q_rows + kv_rows], t[q_rows + kv_rows:]


def expert_parts(parts: dict) -> tuple:
    """A routed expert's ``(gate, up, down)`` from its tensors by role, then ``(gate_bias, up_bias, down_bias)``
    where the experts have biases (gpt-oss: forward/gpt_oss_ops.py)."""
    roles = ("expert_gate", "expert_up", "expert_down")
    biases = ("expert_gate_bias", "expert_up_bias", "expert_down_bias")
    return tuple(parts[r] for r in roles + (biases if biases[0] in parts else ()))


def split_halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's ``[gate_r; up_r]`` (Megatron ``linear_fc1``, vLLM ``gate_up_proj``)."""
    if t.shape[0] % 2:
        raise CheckpointError(f"fused gate/up has an odd row count {t.shape[0]}")
    gate, up = t.chunk(2, dim=0)
    return gate, up


def unpack(spec: WeightSpec, stored: torch.Tensor, split_qkv) -> torch.Tensor:
    """``spec``'s part of a rank's stored tensor: its slot of a fused qkv (``split_qkv``) or gate/up pack, else
    the tensor itself."""
    if spec.split == "qkv":
        return split_qkv(stored)["qkv".index(spec.slot)]
    if spec.split == "gate_up":
        return split_halves(stored)[("gate", "up").index(spec.slot)]
    return stored


def padded_vocab_for(vocab: int, multiple: int) -> int:
    return math.ceil(vocab / multiple) * multiple


def vocab_rows(vocab: int, padded: int, rank: int, world: int) -> tuple[int, int, int]:
    """(start, real rows, padding rows) of rank ``rank`` over a vocab padded to ``padded``."""
    per = padded // world
    start = rank * per
    real = max(0, min(start + per, vocab) - start)
    return start, real, per - real
