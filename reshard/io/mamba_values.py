"""Value transforms of a stored Mamba2 tensor (families-2.md sections 10.3 and 14.2 G).

vLLM 0.32 stores Nemotron-H's ``A_log`` as ``A = -exp(A_log)`` computed in fp32 (its loader's
``lambda x: -torch.exp(x.float())``), under ``mixer.A``. A read op carries at most one of the two directions
(:func:`chain`): ``neg_exp`` (canonical ``A_log`` -> stored ``A``, fp32, as vLLM computes it) or ``log_neg``
(stored ``A`` -> ``A_log = log(-A)``, computed in fp64 and rounded once into the target dtype). A vLLM -> vLLM copy
composes the two and copies ``A`` unchanged. ``log_neg`` after ``neg_exp`` returns every bf16 / fp16 ``A_log``
bit for bit (fp32 ``A`` has 16+ more mantissa bits than the value); an fp32 ``A_log`` comes back within one ulp.
"""

from __future__ import annotations

from dataclasses import replace

INVERSE = {"neg_exp": "log_neg"}


def undo(stored: str) -> str:
    """The transform that reads canonical values from a tensor stored through ``stored`` ("" for none)."""
    return INVERSE[stored] if stored else ""


def then(current: str, write: str) -> str:
    """An op's transform ``current`` followed by ``write`` (a target's): a transform after its inverse cancels."""
    if current == INVERSE[write]:
        return ""
    if current:
        raise AssertionError(f"cannot compose {current} with {write}")
    return write


def apply(transform: str, data):
    """``data`` through ``transform`` (``neg_exp``: fp32; ``log_neg``: fp64, for one rounding into the target)."""
    import torch

    if transform == "neg_exp":
        return -torch.exp(data.float())
    if transform == "log_neg":
        return torch.log(-data.double())
    raise AssertionError(f"unknown value transform '{transform}'")


def as_stored(a, b):
    """Two plans of one canonical tensor (``verify``) where either side reads it through ``log_neg`` (a vLLM
    ``mixer.A``): both read as the transformed side stores it (fp32 ``-exp(A_log)``), so the comparison is of what
    vLLM holds and exact in every dtype; other pairs unchanged."""
    if not any(op.transform for t in (a, b) for op in t.reads):
        return a, b

    def stored(t):
        reads = [replace(op, transform="" if op.transform == "log_neg" else "neg_exp") for op in t.reads]
        return replace(t, dtype="F32", reads=reads)
    return stored(a), stored(b)
