"""Dtype names: safetensors strings are the lingua franca between plans, headers and torch."""

from __future__ import annotations

import torch

from reshard.errors import ReshardError

_TORCH = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e4m3fn"):
    _TORCH["F8_E4M3"] = torch.float8_e4m3fn
    _TORCH["F8_E5M2"] = torch.float8_e5m2
_NAME = {v: k for k, v in _TORCH.items()}
_USER = {"bf16": "BF16", "bfloat16": "BF16", "fp16": "F16", "float16": "F16", "half": "F16",
         "fp32": "F32", "float32": "F32", "float": "F32"}


def to_torch(name: str) -> torch.dtype:
    try:
        return _TORCH[name]
    except KeyError:
        raise ReshardError(f"unknown dtype '{name}' (known: {', '.join(_TORCH)})") from None


def from_torch(dtype: torch.dtype) -> str:
    try:
        return _NAME[dtype]
    except KeyError:
        raise ReshardError(f"unsupported torch dtype {dtype}") from None


def itemsize(name: str) -> int:
    return to_torch(name).itemsize


def is_known(name: str) -> bool:
    return name in _TORCH


def parse_user_dtype(text: str | None) -> str | None:
    """Map a CLI dtype (bf16, fp16, fp32) to its safetensors name; None passes through."""
    if text is None:
        return None
    try:
        return _USER[text.lower()]
    except KeyError:
        raise ReshardError(f"unknown --dtype '{text}': use bf16, fp16 or fp32") from None


def hf_config_dtype(name: str) -> str:
    """The config.json spelling (``torch_dtype``) of a dtype."""
    return str(to_torch(name)).removeprefix("torch.")
