"""megatron-core 0.16.1's own gpt-oss-shaped GPTModel on the CPU, loaded strictly from a ``torch_dist`` folder, with
its logits.  Written independently of reshard; the model is built from the checkpoint's own args only.

Run as::

    python tests/mcore_gpt_oss_harness.py load --ids IDS.pt [--tp T --ep E --etp 1] CKPT OUT.pt ...

The script spawns its ranks itself (world ``max(T, E*S)``, at most 2; gloo on the loopback, a file store in a
private temporary folder) and waits for them.  For each CKPT it builds the model as Megatron-LM's
``core_transformer_config_from_args`` and GPT builder do (every args field that is a ``TransformerConfig`` field
copied by name, then the renames: ``quick_geglu`` = gated ``quick_gelu``), with the local spec: GQA with q/k/v/o
biases and learnable softmax offsets (the sinks), the sliding window on every other layer (``window_size``,
``window_attn_skip_freq``), yarn RoPE (``position_embedding_type="yarn"`` and the ``yarn_*`` attributes ``GPTModel``
reads), ``SequentialMLP`` experts with biases, ``glu_linear_offset`` and the clamp; loads it with
``dist_checkpointing.load`` at Megatron-LM's default strictness then ``load_state_dict(strict=True)``, and rank 0
writes ``{"input_ids", "logits"}`` (fp32, gathered over TP, cut to the true vocab).  CPU plumbing that changes no
weight: CPU initialisation, fusions off, no dropout, no sequence parallelism, an explicit causal mask, and the
sliding-window mask built on the CPU (megatron-core builds it on ``cuda``).
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
import mcore_glm_harness as glm_harness  # noqa: E402
from mcore_dist_harness import cpu_eval_fields  # noqa: E402
from mcore_mla_harness import padded_vocab  # noqa: E402

#: Args a gpt-oss run records that change the model (megatron-core's defaults would apply to a missing one).
REQUIRED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
            "norm_epsilon", "normalization", "quick_geglu", "glu_linear_offset", "activation_func_clamp_value",
            "softmax_type", "add_bias_linear", "add_qkv_bias", "window_size", "window_attn_skip_freq",
            "untie_embeddings_and_output_weights", "vocab_size", "rotary_base", "position_embedding_type",
            "yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
            "yarn_correction_range_round_to_int", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
            "moe_router_score_function", "moe_router_pre_softmax")


def _sliding_window_mask_on_cpu() -> None:
    """megatron-core builds the sliding-window mask on ``device="cuda"`` (transformer/utils.py): the same mask on
    the CPU (families-2.md section 1)."""
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    def mask(sq, skv, window_size):
        m = torch.ones(sq, skv, dtype=torch.bool)
        return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])

    fused_softmax.get_sliding_window_causal_mask = mask


def build_model(args: argparse.Namespace, tp: int, ep: int, etp: int):
    _sliding_window_mask_on_cpu()
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    missing = [k for k in REQUIRED if not hasattr(args, k)]
    if missing:
        raise SystemExit(f"the checkpoint's args lack {missing}: megatron-core's defaults would apply")
    if not args.quick_geglu or args.position_embedding_type != "yarn":
        raise SystemExit("not a gpt-oss run: quick_geglu and yarn RoPE expected")
    get = lambda key, default=None: getattr(args, key, default)  # noqa: E731
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(TransformerConfig) if hasattr(args, f.name)}
    fields.update(  # Megatron-LM's core_transformer_config_from_args renames (quick_geglu: gated quick_gelu)
        layernorm_epsilon=args.norm_epsilon, num_moe_experts=args.num_experts, num_query_groups=args.num_query_groups,
        activation_func=quick_gelu, gated_linear_unit=True, window_size=tuple(args.window_size),
        pipeline_dtype=torch.float32, params_dtype=torch.float32, bf16=False, fp16=False, mtp_num_layers=None)
    fields.update(cpu_eval_fields(  # CPU / eval plumbing and the degrees this run loads at
        tp, ep, etp, attention_softmax_in_fp32=True, moe_router_load_balancing_type="none", moe_router_dtype="fp32"))
    config = TransformerConfig(**fields)
    for key in ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
                "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int"):
        setattr(config, key, get(key))  # read by getattr in GPTModel (not TransformerConfig fields)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization)
    model = GPTModel(
        config=config, transformer_layer_spec=block,
        vocab_size=padded_vocab(args.vocab_size, get("make_vocab_size_divisible_by", 128), tp),
        max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
        parallel_output=False, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="yarn", rotary_base=args.rotary_base)
    model.eval()
    return model


def check_built(model, args) -> None:
    """What makes the model gpt-oss really is in the built model."""
    for layer in model.decoder.layers:
        attn = layer.self_attention
        assert attn.core_attention.softmax_offset is not None  # the sinks
        assert attn.linear_qkv.bias is not None and layer.mlp.router.bias is not None
        assert layer.mlp.experts.local_experts[0].linear_fc1.bias is not None
    assert model.config.activation_func_clamp_value == args.activation_func_clamp_value
    assert model.config.glu_linear_offset == 1.0 and model.config.softmax_type == "learnable"


if __name__ == "__main__":  # mcore_glm_harness's command line, spawning, workers and reaping, this model
    sys.exit(glm_harness.main(build_model, check_built, __doc__))
