"""Dtype names: safetensors strings are the lingua franca between plans, headers and torch.

torch is imported only when a torch dtype is asked for, so that converting without a cast never loads it.
"""

from __future__ import annotations

from reshard.errors import ReshardError

_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
          "F8_E4M3": 1, "F8_E5M2": 1}
_TORCH_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_USER = {"bf16": "BF16", "bfloat16": "BF16", "fp16": "F16", "float16": "F16", "half": "F16",
         "fp32": "F32", "float32": "F32", "float": "F32"}


def torch_name(name: str) -> str:
    """torch's attribute name of a dtype (``BF16`` -> ``bfloat16``)."""
    try:
        return _TORCH_NAMES[name]
    except KeyError:
        raise ReshardError(f"unknown dtype '{name}' (known: {', '.join(_SIZES)})") from None


def to_torch(name: str):
    import torch

    return getattr(torch, torch_name(name))


def from_torch(dtype) -> str:
    text = str(dtype).removeprefix("torch.")
    for name, tname in _TORCH_NAMES.items():
        if tname == text:
            return name
    raise ReshardError(f"unsupported torch dtype {dtype}")


def itemsize(name: str) -> int:
    try:
        return _SIZES[name]
    except KeyError:
        raise ReshardError(f"unknown dtype '{name}' (known: {', '.join(_SIZES)})") from None


def is_known(name: str) -> bool:
    return name in _SIZES


def parse_user_dtype(text: str | None) -> str | None:
    """Map a CLI dtype (bf16, fp16, fp32) to its safetensors name; None passes through."""
    if text is None:
        return None
    try:
        return _USER[text.lower()]
    except KeyError:
        raise ReshardError(f"unknown --dtype '{text}': use bf16, fp16 or fp32") from None


def as_dtype_name(dtype) -> str | None:
    """A dtype given in the Python API as a safetensors name: ``"bf16"`` / ``"fp32"`` (as ``--dtype``), a
    safetensors name (``"BF16"``), torch's spelling (``"bfloat16"``, a config's ``torch_dtype``) or a
    ``torch.dtype``; None passes through. An unknown string is refused as ``--dtype`` refuses it."""
    if dtype is None or isinstance(dtype, str) and is_known(dtype):
        return dtype
    if isinstance(dtype, str):
        try:
            return parse_user_dtype(dtype)
        except ReshardError as exc:
            try:
                return from_torch(dtype)
            except ReshardError:
                raise exc from None
    return from_torch(dtype)


def hf_config_dtype(name: str) -> str:
    """The config.json spelling (``torch_dtype``) of a dtype."""
    return torch_name(name)
