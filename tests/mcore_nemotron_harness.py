"""megatron-core 0.16.1 loads reshard's Nemotron ``torch_dist`` strictly and runs it (tests/test_family_nemotron.py).

    python tests/mcore_nemotron_harness.py load CKPT_DIR OUT --tp T --ids IDS

tests/mcore_dist_harness.py's ``load`` (spawned gloo ranks, ``dist_checkpointing.load`` with
``assume_ok_unexpected`` + ``load_state_dict(strict=True)``, the pipeline run by hand) with its model builder
replaced for Nemotron, as Megatron-LM's ``core_transformer_config_from_args`` builds it from the checkpoint's args
(shared/layouts/families-2.md section 9): ``squared_relu`` -> ``activation_func = squared_relu``,
``gated_linear_unit = False``; LayerNorm with bias; ``rotary_percent``; ``apply_layernorm_1p`` ->
``layernorm_zero_centered_gamma``. megatron-core's torch (local-spec) norm cannot build zero-centred gamma without
Apex / Transformer Engine, so the model is built without it and, after the strict load, every norm weight gets the
1 that zero-centred gamma adds at run time (the stored value, w, is what a TE / Apex checkpoint holds): the probe's
``mcore_from_hf.py`` does the same.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# megatron-core wraps squared_relu in torch.compile (jit_fuser): run it eagerly, as written (no inductor cache, no
# C++ toolchain; the spawned ranks inherit this)
os.environ["TORCHDYNAMO_DISABLE"] = "1"
sys.path.insert(0, str(Path(__file__).parent))

import mcore_dist_harness as base  # noqa: E402
from mcore_args_harness import args_getter, config_from_args  # noqa: E402


def build_model(args, tp: int, pp: int):
    from megatron.core import parallel_state
    from megatron.core.activations import squared_relu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    get = args_getter(args, set())
    assert get("squared_relu") and not get("swiglu") and get("normalization") == "LayerNorm", vars(args)
    assert get("apply_layernorm_1p"), "a Nemotron checkpoint's args must set apply_layernorm_1p"
    config = config_from_args(
        get, attention_softmax_in_fp32=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=get("params_dtype"), perform_initialization=True,
        gated_linear_unit=False, activation_func=squared_relu,
        layernorm_zero_centered_gamma=False)  # added after the load (module docstring)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="LayerNorm", qk_layernorm=False),
        vocab_size=base.padded_vocab(get("vocab_size"), getattr(args, "make_vocab_size_divisible_by", 128), tp),
        max_sequence_length=get("max_position_embeddings"),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=False,
        share_embeddings_and_output_weights=not get("untie_embeddings_and_output_weights"),
        position_embedding_type=get("position_embedding_type"),
        rotary_percent=get("rotary_percent"),
        rotary_base=get("rotary_base"),
    )
    model.eval()
    return model


_forward_logits = base.forward_logits


def forward_logits(model, input_ids, vocab):
    """Zero-centred gamma: every LayerNorm weight applied as 1 + w (after the strict load of w)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("layernorm.weight", "layer_norm_weight")):
                p.add_(1.0)
    return _forward_logits(model, input_ids, vocab)


base.build_model = build_model
base.forward_logits = forward_logits

if __name__ == "__main__":
    sys.exit(base.main())
