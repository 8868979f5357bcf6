"""Megatron's expert-tensor-parallel degree when ``--etp`` is left out: ``--tp``, except for a model whose routed
experts carry biases (gpt-oss), where megatron-core supports MoE biases only at ``expert_tensor_parallel_size = 1``
(``transformer_config.py``: "Bias in Moe is only supported when ETP==1"; families-2.md sections 2.3, 17): there
expert-TP 1 is chosen, each expert whole on every TP rank, and the plan says so. An explicit ``--etp`` above 1 for
such a model stays refused (``gpt_oss_rules.check_expert_tp``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reshard.core.canonical import CanonicalModel
    from reshard.layouts.base import Options


def expert_tp(opts: Options, model: CanonicalModel) -> int:
    """The expert-TP degree: ``--etp``; else 1 where the routed experts have biases; else ``--tp``."""
    return opts.etp or (1 if expert_biases(model) else opts.tp)


def expert_biases(model: CanonicalModel) -> bool:
    """Whether the routed experts carry biases (a per-expert canonical ``.bias``)."""
    return any(t.spec.per_expert and name.endswith(".bias") for name, t in model.tensors.items())


def expert_tp_notes(model: CanonicalModel, opts: Options) -> list[str]:
    """The plan's note when :func:`expert_tp` chose 1 for ``--etp`` left out at ``--tp`` > 1."""
    if opts.etp or opts.tp == 1 or not model.num_experts or not expert_biases(model):
        return []
    return [f"expert-TP 1 chosen (--etp not given, not --tp {opts.tp}): megatron-core supports MoE biases only at "
            "expert_tensor_parallel_size = 1 and these experts have biases; each expert is whole on every TP rank"]
