"""The one overflow rule of every cast reshard makes (the torch path of :mod:`reshard.io.assemble`, FP8
dequantisation in :mod:`reshard.io.fp8`): a cast may not turn finite values into inf."""

from __future__ import annotations

from reshard.errors import CheckpointError
from reshard.io import dtypes


class CastOverflowError(CheckpointError):
    """A cast turned finite source values into inf (e.g. 1e6 to fp16)."""


def check_cast(name: str, source, cast) -> None:
    """Refuse a cast of ``source`` into ``cast`` that turned finite values into inf or NaN."""
    import torch

    if source.dtype == cast.dtype or not cast.is_floating_point():
        return
    if source.is_floating_point() and torch.finfo(cast.dtype).max >= torch.finfo(source.dtype).max:
        return  # a widening cast (bf16 / fp16 -> fp32, fp16 -> bf16) keeps every finite value finite
    if not bool(torch.isinf(cast).any()):
        return  # a finite value never casts to NaN: with no inf in the result, nothing finite was lost
    lost = ~torch.isfinite(cast) & torch.isfinite(source)
    if bool(lost.any()):
        worst = source[lost].abs().max().item()
        raise CastOverflowError(f"casting '{name}' to {dtypes.from_torch(cast.dtype)} turns finite values into inf "
                                f"(|value| up to {worst:g} > {torch.finfo(cast.dtype).max:g}): keep the source dtype "
                                "or cast to bf16, or pass --allow-cast-overflow to write inf knowingly")
