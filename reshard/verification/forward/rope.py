"""Rotary position embeddings of the reference decoder, as transformers computes them: inverse frequencies for
every RoPE scaling a shipped family can carry (``linear``, ``dynamic``, ``yarn``, ``longrope``, ``llama3``), the
factor yarn and longrope put on cos / sin (and latent attention's yarn softmax-scale correction), cos / sin tables,
and the two rotations: rotate-half (HF's Llama order) and interleaved pairs ``(2i, 2i+1)`` (DeepSeek's latent
attention).

Partial rotary (``rotary_fraction < 1``, Phi-4-mini, GPT-NeoX's ``rotary_pct``, Megatron's ``rotary_percent``,
vLLM's ``rotary_dim``): every frequency is computed over ``rotary_dim = int(head_dim * rotary_fraction)`` (the
config's ``rope_dim``), and :func:`apply_rope` rotates the first ``rotary_dim`` dims of each head (rotate-half
within them) and passes the rest through unchanged; transformers' ``apply_rotary_pos_emb`` (Phi-3, GPT-NeoX),
megatron-core's ``apply_rotary_pos_emb`` and vLLM's ``RotaryEmbedding`` all split a head so.
"""

from __future__ import annotations

import math

import torch

from reshard.errors import ReshardError
from reshard.verification.forward.rank_weights import DecoderConfig


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _scaled_factor(config: DecoderConfig, scaling: dict) -> float:
    """yarn's / longrope's ``factor``, else ``max_position_embeddings / original_max_position_embeddings``."""
    factor = scaling.get("factor")
    if factor is None:
        return config.max_positions / scaling["original_max_position_embeddings"]
    return float(factor)


def _yarn_inv_freq(config: DecoderConfig, d: int, theta: float, scaling: dict) -> torch.Tensor:
    """transformers' ``_compute_yarn_parameters`` inverse frequencies: interpolated by ``factor`` below the
    correction range, extrapolated above it, a linear ramp between."""
    factor = _scaled_factor(config, scaling)
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, d, 2).to(dtype=torch.float) / d)
    extrapolation = 1 - ramp
    return 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def _longrope_inv_freq(d: int, theta: float, scaling: dict, seq_len: int) -> torch.Tensor:
    """transformers' ``_compute_longrope_parameters`` at ``seq_len`` (its ``longrope_frequency_update``): the
    default frequencies divided by ``long_factor`` when ``seq_len > original_max_position_embeddings``, else by
    ``short_factor``."""
    long = seq_len > scaling["original_max_position_embeddings"]
    ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (ext * theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


def _dynamic_theta(config: DecoderConfig, d: int, theta: float, factor: float, seq_len: int) -> torch.Tensor:
    """transformers' ``_compute_dynamic_ntk_parameters`` base at ``seq_len`` (computed only past
    ``max_position_embeddings``, as its ``dynamic_frequency_update``), in its float32 tensor arithmetic."""
    seq = torch.tensor(seq_len, dtype=torch.int64)
    return theta * ((factor * seq / config.max_positions) - (factor - 1)) ** (d / (d - 2))


def rope_scaling_type(config: DecoderConfig) -> str:
    scaling = config.rope_scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_attention_factor(config: DecoderConfig) -> float:
    """The factor transformers multiplies cos and sin by: yarn's ``attention_factor`` (given, or from ``mscale`` /
    ``mscale_all_dim``, or ``0.1 ln(factor) + 1``), longrope's (given, or ``sqrt(1 + ln(factor) / ln(original
    max positions))`` for ``factor > 1``), 1 for every other RoPE."""
    scaling = config.rope_scaling or {}
    kind = rope_scaling_type(config)
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _scaled_factor(config, scaling)
    if kind == "longrope":
        original = scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim))
    return _yarn_mscale(factor)


def mla_softmax_scale(config: DecoderConfig) -> float:
    """``(dn + dr) ** -0.5``, times ``m ** 2`` with ``m`` from ``mscale_all_dim`` under a RoPE scaling
    (transformers' DeepSeek ``yarn_apply_mscale``)."""
    scale = (config.head_dim + config.rope_head_dim) ** -0.5
    scaling = config.rope_scaling or {}
    if rope_scaling_type(config) != "default" and scaling.get("mscale_all_dim"):
        m = _yarn_mscale(float(scaling["factor"]), scaling["mscale_all_dim"])
        scale = scale * m * m
    return scale


def rope_inv_freq(config: DecoderConfig, seq_len: int, local: bool = False) -> torch.Tensor:
    """transformers' inverse frequencies (``rope_dim / 2`` of them) for ``rope_theta`` and ``rope_scaling`` on a
    sequence of ``seq_len`` positions (``dynamic`` and ``longrope`` depend on it); ``local``: a sliding-window
    layer's plain RoPE with ``rope_local_theta``."""
    d = config.rope_dim
    theta = config.rope_local_theta if local else config.rope_theta
    scaling = None if local else config.rope_scaling
    kind = rope_scaling_type(config) if scaling else "default"
    if kind == "longrope":
        return _longrope_inv_freq(d, theta, scaling, seq_len)
    if kind == "yarn":
        return _yarn_inv_freq(config, d, theta, scaling)
    if kind == "dynamic" and seq_len > config.max_positions:
        theta = _dynamic_theta(config, d, theta, float(scaling["factor"]), seq_len)
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if kind in ("default", "dynamic"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ReshardError(f"rope_scaling type '{kind}' is not supported by the forward verifier (supported: "
                       "default, linear, dynamic, yarn, longrope, llama3); verify this checkpoint with the digest "
                       "check instead")


def rope_cos_sin(config: DecoderConfig, seq_len: int, device, dtype,
                 local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` / ``sin`` ``[seq_len, rope_dim]`` of positions ``0 .. seq_len - 1`` (``cat(freqs, freqs)``, times
    :func:`rope_attention_factor` except on ``local`` layers), cast to ``dtype``."""
    inv_freq = rope_inv_freq(config, seq_len, local).to(device)
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    factor = 1.0 if local else rope_attention_factor(config)
    if factor != 1.0:
        return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for ``x = [x1, x2]`` split in halves of its last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first ``cos.shape[-1]`` dims of each head of ``x`` ``[.., seq, head_dim]``
    (``x_rot * cos + rotate_half(x_rot) * sin``), the remaining dims passed through (partial rotary)."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs ``(2i, 2i+1)`` (transformers' ``apply_rotary_pos_emb_interleave``; ``cos`` /
    ``sin`` are ``cat(freqs, freqs)``): the rotated evens, then the rotated odds."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
