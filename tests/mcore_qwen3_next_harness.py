"""megatron-core 0.16.1's own Qwen3-Next-shaped GPTModel on the CPU, loaded strictly from a ``torch_dist`` folder,
with its logits.  Written independently of reshard; the model is built from the checkpoint's own args only.

Run as::

    python tests/mcore_qwen3_next_harness.py load --ids IDS.pt [--tp T --ep E --etp S] CKPT OUT.pt

megatron-core builds Gated DeltaNet only with Transformer Engine and flash-linear-attention
(families-2.md section 4.2), neither of which runs here.  As the probe ``mcore_from_hf.py`` does, the model is
megatron-core's local spec with the GDN layers (``linear_attention_freq``) replaced by megatron-core's own
``GatedDeltaNet`` module (``ColumnParallelLinear`` in_proj, ``WrappedTorchNorm`` out_norm, ``RowParallelLinear``
out_proj); FLA's two kernels are replaced by transformers' pure-torch reference (``torch_chunk_gated_delta_rule``,
``l2norm``).  The CPU norms are plain, so the zero-centred norms a Transformer Engine checkpoint stores (w, applied as
1 + w; the GDN out_norm too) are loaded and then get + 1; the local spec's separate ``input_layernorm`` is read under
the Transformer Engine key a TE run saves (``self_attention.in_proj.layer_norm_weight`` on GDN layers,
``self_attention.linear_qkv.layer_norm_weight`` on attention layers).  Everything else is megatron-core's: the
sharded state dict (``in_proj.weight.{query,...}`` sections), ``dist_checkpointing.load`` at Megatron-LM's default
strictness, then ``load_state_dict(strict=True)``; rank 0 writes ``{"input_ids", "logits"}``.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mcore_cpu import prepare_cpu  # noqa: E402

os.environ["TORCHDYNAMO_DISABLE"] = "1"
torch = prepare_cpu()
import torch.nn.functional as F  # noqa: E402
from mcore_dist_harness import cpu_eval_fields, read_common  # noqa: E402
import mcore_glm_harness  # noqa: E402
from mcore_mla_harness import forward, iteration_dir, padded_vocab  # noqa: E402

REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "norm_epsilon",
            "swiglu", "qk_layernorm", "untie_embeddings_and_output_weights", "vocab_size", "rotary_base",
            "rotary_percent", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
            "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "experimental_attention_variant",
            "linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
            "linear_num_key_heads", "linear_num_value_heads", "attention_output_gate", "apply_layernorm_1p")


def fla_stand_ins() -> None:
    import megatron.core.ssm.gated_delta_net as gdn
    from transformers.models.qwen3_next import modeling_qwen3_next as tq

    gdn.HAVE_FLA = True
    gdn.chunk_gated_delta_rule = tq.torch_chunk_gated_delta_rule
    gdn.l2norm = lambda x: tq.l2norm(x, dim=-1, eps=1e-6)


def build_model(args, tp: int, ep: int, etp: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    missing = [k for k in REQUIRED if not hasattr(args, k)]
    if missing:
        raise SystemExit(f"the checkpoint's args lack {missing}: megatron-core's defaults would apply")
    assert args.apply_layernorm_1p and args.transformer_impl == "transformer_engine"
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(TransformerConfig) if hasattr(args, f.name)}
    fields.update(  # Megatron-LM's core_transformer_config_from_args renames; plain norms here (w + 1 loaded)
        layernorm_epsilon=args.norm_epsilon, layernorm_zero_centered_gamma=False, num_moe_experts=args.num_experts,
        activation_func=F.silu, gated_linear_unit=bool(args.swiglu), pipeline_dtype=torch.float32,
        params_dtype=torch.float32, bf16=False, fp16=False, mtp_num_layers=None, normalization="RMSNorm",
        transformer_impl="local")
    fields.update(cpu_eval_fields(tp, ep, etp, moe_router_dtype="fp32"))
    config = TransformerConfig(**fields)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    specs = []
    for i, spec in enumerate(block.layer_specs):
        spec = copy.deepcopy(spec)
        if config.linear_attention_freq[i]:
            spec.submodules.self_attention = ModuleSpec(
                module=GatedDeltaNet, metainfo={"fuse_input_layernorm": False},
                submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm,
                                                   out_proj=RowParallelLinear))
        specs.append(spec)
    block.layer_specs = specs
    model = GPTModel(
        config=config, transformer_layer_spec=block,
        vocab_size=padded_vocab(args.vocab_size, getattr(args, "make_vocab_size_divisible_by", 128), tp),
        max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
        parallel_output=False, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="rope", rotary_percent=args.rotary_percent, rotary_base=args.rotary_base)
    model.eval()
    return model


def te_keys(sharded: dict, freq: list[int]) -> dict:
    """The local spec's input norms (sharded as ``input_layernorm.weight`` or, through the GPT spec's keys map,
    ``linear_qkv.layer_norm_weight``) read under the keys a Transformer Engine run saves."""
    for item in sharded.values():
        key = getattr(item, "key", None) or ""
        for local in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
            if key.startswith("decoder.layers.") and key.endswith(local):
                fused = "self_attention.in_proj" if freq[int(key.split(".")[2])] else "self_attention.linear_qkv"
                item.key = key[:-len(local)] + f"{fused}.layer_norm_weight"
    return sharded


def load_one(cli, ckpt: str, out: str, input_ids: torch.Tensor) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.validation import StrictHandling

    fla_stand_ins()
    folder = iteration_dir(ckpt)
    common = read_common(folder)
    args = common["args"]
    model = build_model(args, cli.tp, cli.ep, cli.etp)
    metadata = dict(common.get("content_metadata") or {})
    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    sharded = te_keys(model.sharded_state_dict(metadata=metadata), args.linear_attention_freq)
    loaded = dist_checkpointing.load({"model": sharded}, folder, strict=StrictHandling.ASSUME_OK_UNEXPECTED)["model"]
    result = model.load_state_dict(loaded, strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    with torch.no_grad():  # zero-centred norms (stored w, applied 1 + w) into the plain CPU norms
        for name, p in model.named_parameters():
            if name.endswith(("layernorm.weight", "out_norm.weight")):
                p.add_(1.0)
    assert sum(1 for layer in model.decoder.layers
               if type(layer.self_attention).__name__ == "GatedDeltaNet") == sum(args.linear_attention_freq)
    args.mtp_num_layers = None
    logits = forward(model, args, input_ids)
    if dist.get_rank() == 0:
        torch.save(logits, out)
    dist.barrier()


# mcore_glm_harness's command line, spawning, workers and reaping run this model's load_one: patched at import, so
# the spawned workers (which import this script as __mp_main__ first) see it too
mcore_glm_harness.load_one = load_one


if __name__ == "__main__":
    sys.exit(mcore_glm_harness.main())
