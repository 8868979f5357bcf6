"""Rotary position embeddings of the reference decoder: HF's inverse frequencies for every RoPE scaling it
supports (linear, llama3, and yarn for latent attention, with yarn's cos / sin factor and its softmax-scale
correction), cos / sin tables, and the two rotations: rotate-half (HF's Llama order) and interleaved pairs
``(2i, 2i+1)`` (DeepSeek's latent attention)."""

from __future__ import annotations

import math

import torch

from reshard.errors import ReshardError
from reshard.verification.forward.rank_weights import DecoderConfig


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_factor(config: DecoderConfig, scaling: dict) -> float:
    factor = scaling.get("factor")
    if factor is None:
        return config.max_positions / scaling["original_max_position_embeddings"]
    return float(factor)


def _yarn_inv_freq(config: DecoderConfig, d: int, theta: float, scaling: dict) -> torch.Tensor:
    """transformers' ``_compute_yarn_parameters`` inverse frequencies: interpolated by ``factor`` below the
    correction range, extrapolated above it, a linear ramp between."""
    factor = _yarn_factor(config, scaling)
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


def rope_attention_factor(config: DecoderConfig) -> float:
    """The factor yarn multiplies cos and sin by (1 for every other RoPE)."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(config, scaling)
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim))
    return _yarn_mscale(factor)


def mla_softmax_scale(config: DecoderConfig) -> float:
    """``(dn + dr) ** -0.5``, times ``m ** 2`` with ``m`` from ``mscale_all_dim`` under a RoPE scaling
    (transformers' DeepSeek ``yarn_apply_mscale``)."""
    scale = (config.head_dim + config.rope_head_dim) ** -0.5
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default" and scaling.get("mscale_all_dim"):
        m = _yarn_mscale(float(scaling["factor"]), scaling["mscale_all_dim"])
        scale = scale * m * m
    return scale


def rope_inv_freq(config: DecoderConfig, local: bool = False) -> torch.Tensor:
    """HF's inverse frequencies for ``rope_theta`` and the ``rope_scaling`` types this decoder supports
    (``local``: a sliding-window layer's plain RoPE with ``rope_local_theta``)."""
    d = config.rope_dim
    theta = config.rope_local_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = None if local else config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
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
    if kind == "yarn" and config.mla:
        return _yarn_inv_freq(config, d, theta, scaling)
    raise ReshardError(f"rope_scaling type '{kind}' is not supported by the forward verifier (supported: "
                       "default, linear, llama3; yarn with multi-head latent attention); verify this checkpoint "
                       "with the digest check instead")


def rope_cos_sin(config: DecoderConfig, seq_len: int, device, dtype,
                 local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = rope_inv_freq(config, local).to(device)
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    factor = 1.0 if local else rope_attention_factor(config)
    if factor != 1.0:
        return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs ``(2i, 2i+1)`` (transformers' ``apply_rotary_pos_emb_interleave``; ``cos`` /
    ``sin`` are ``cat(freqs, freqs)``): the rotated evens, then the rotated odds."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
