"""megatron-core 0.16.1's own Llama-4-text-shaped GPTModel on the CPU, loaded strictly from a ``torch_dist`` folder,
with its logits.  Written independently of reshard; the model is built from the checkpoint's own args (and, for the
NoPE layers Megatron-LM spells as ``--no-rope-freq``, the ``no_rope_layers`` of the ``hf_config`` the args record).

Run as::

    python tests/mcore_llama4_harness.py load --ids IDS.pt [--tp T --ep E --etp S] CKPT OUT.pt ...

The loading, the ranks and their clean-up are tests/mcore_glm_harness.py's (its ``main`` with this file's model):
the script spawns its ranks itself (world ``max(T, E*S)``, at most 2; gloo on the loopback, a file store in a
private temporary folder) and waits for them.  For each CKPT it builds the model as Megatron-LM's
``core_transformer_config_from_args`` and GPT builder do (every args field that is a ``TransformerConfig`` field
copied by name, then the renames), with the local spec (``get_gpt_decoder_block_spec(use_transformer_engine=False)``:
GQA, ``SequentialMLP`` experts, the allgather dispatcher) with ``L2Norm`` q/k norms on the RoPE layers only
(:func:`layer_spec`), ``rotary_interleaved``, ``moe_apply_probs_on_input`` (the routing weight on the expert input)
and ``moe_layer_freq`` as a list, loads it with ``dist_checkpointing.load`` at
Megatron-LM's default strictness then ``load_state_dict(strict=True)``, and rank 0 writes
``{"input_ids", "logits"}`` (fp32, gathered over TP, cut to the true vocab).  CPU plumbing that changes no weight:
CPU initialisation, fusions off, no dropout, no sequence parallelism, an explicit causal mask.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mcore_cpu import prepare_cpu  # noqa: E402

os.environ["TORCHDYNAMO_DISABLE"] = "1"
torch = prepare_cpu()
import torch.nn.functional as F  # noqa: E402
import mcore_glm_harness as glm_harness  # noqa: E402
from mcore_dist_harness import cpu_eval_fields  # noqa: E402
from mcore_mla_harness import padded_vocab  # noqa: E402

#: Args a Llama 4 run records that change the model (megatron-core's defaults would apply to a missing one).
REQUIRED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
            "norm_epsilon", "normalization", "swiglu", "add_bias_linear", "add_qkv_bias", "rotary_interleaved",
            "untie_embeddings_and_output_weights", "vocab_size", "rotary_base", "num_experts", "moe_router_topk",
            "moe_ffn_hidden_size", "moe_router_score_function", "moe_layer_freq", "moe_apply_probs_on_input",
            "moe_shared_expert_intermediate_size", "hf_config")


def layer_spec(config, record: dict):
    """megatron-core's local block spec with Llama 4's per-layer q/k norm: ``L2Norm`` on q and k of the RoPE
    layers (``no_rope_layers[i] == 1``) when ``use_qk_norm``, ``IdentityOp`` on the NoPE layers (megatron-core's
    own ``qk_l2_norm`` switch would put it on every layer; Megatron-Bridge builds it per layer the same way)."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.torch_norm import L2Norm

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization)
    specs = []
    for i, spec in enumerate(block.layer_specs):
        spec = copy.deepcopy(spec)
        norm = L2Norm if record.get("use_qk_norm", True) and record["no_rope_layers"][i] else IdentityOp
        spec.submodules.self_attention.submodules.q_layernorm = norm
        spec.submodules.self_attention.submodules.k_layernorm = norm
        specs.append(spec)
    block.layer_specs = specs
    return block


def build_model(args: argparse.Namespace, tp: int, ep: int, etp: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    missing = [k for k in REQUIRED if not hasattr(args, k)]
    if missing:
        raise SystemExit(f"the checkpoint's args lack {missing}: megatron-core's defaults would apply")
    get = lambda key, default=None: getattr(args, key, default)  # noqa: E731
    record = dict(args.hf_config)
    record = record.get("text_config", record)
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(TransformerConfig) if hasattr(args, f.name)}
    fields.update(  # Megatron-LM's core_transformer_config_from_args renames
        layernorm_epsilon=args.norm_epsilon, num_moe_experts=args.num_experts, num_query_groups=args.num_query_groups,
        activation_func=F.silu, gated_linear_unit=bool(args.swiglu), pipeline_dtype=torch.float32,
        params_dtype=torch.float32, bf16=False, fp16=False, mtp_num_layers=None,
        no_rope_freq=[1 - int(x) for x in record["no_rope_layers"]])  # Megatron-LM's --no-rope-freq, as a list
    fields.update(cpu_eval_fields(tp, ep, etp))  # CPU / eval plumbing and the degrees this run loads at
    config = TransformerConfig(**fields)
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec(config, record),
        vocab_size=padded_vocab(args.vocab_size, get("make_vocab_size_divisible_by", 128), tp),
        max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
        parallel_output=False, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="rope", rotary_base=args.rotary_base)
    model.eval()
    return model


def check_built(model, args) -> None:
    """What makes the model Llama-4-like really is in the built model."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.torch_norm import L2Norm

    record = dict(args.hf_config)
    for i, (layer, moe) in enumerate(zip(model.decoder.layers, args.moe_layer_freq)):
        rope = bool(record["no_rope_layers"][i])
        assert isinstance(layer.self_attention.q_layernorm, L2Norm) == rope
        assert isinstance(layer.mlp, MoELayer) == bool(moe)
        if moe:
            assert layer.mlp.shared_experts is not None
    assert model.config.rotary_interleaved and model.config.moe_apply_probs_on_input
    assert model.config.moe_router_score_function == "sigmoid" and model.config.moe_router_topk == 1


if __name__ == "__main__":  # the GLM harness's loading, ranks and clean-up, with this model
    sys.exit(glm_harness.main(build_model, check_built, __doc__))
