"""megatron-core 0.16.1's own Ernie-4.5-MoE-shaped GPTModel on the CPU, loaded strictly from a ``torch_dist``
folder, with its logits.  Written independently of reshard; the model is built from the checkpoint's own args
only, exactly as tests/mcore_glm_harness.py builds GLM's (every args field that is a ``TransformerConfig`` field,
so ``rotary_interleaved`` and the softmax router settings come from the args; the local spec, ``SequentialMLP``
experts, the allgather dispatcher), and checked for what makes it Ernie: RoPE on interleaved pairs, a softmax
router without an expert bias (megatron-core accepts a selection bias only with sigmoid scores; families-2.md
section 17), shared experts, MoE layers as ``moe_layer_freq`` lists them.

Run as::

    python tests/mcore_ernie_harness.py load --ids IDS.pt [--tp T --ep E --etp S] CKPT OUT.pt ...
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mcore_glm_harness import build_model, main  # noqa: E402


def check_built(model, args) -> None:
    """What makes the model Ernie-like really is in the built model."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    assert model.config.rotary_interleaved and model.rotary_pos_emb.rotary_interleaved
    assert model.config.moe_router_score_function == "softmax" and not model.config.moe_router_pre_softmax
    for layer, moe in zip(model.decoder.layers, args.moe_layer_freq):
        assert isinstance(layer.mlp, MoELayer) == bool(moe)
        if moe:
            assert layer.mlp.shared_experts is not None and layer.mlp.router.expert_bias is None


if __name__ == "__main__":
    sys.exit(main(build_model, check_built, __doc__))
