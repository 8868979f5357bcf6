"""megatron-core 0.16.1's own GLM-4.5-shaped GPTModel on the CPU, loaded strictly from a ``torch_dist`` folder, with
its logits.  Written independently of reshard; the model is built from the checkpoint's own args only.

Run as::

    python tests/mcore_glm_harness.py load --ids IDS.pt [--tp T --ep E --etp S] CKPT OUT.pt ...

The script spawns its ranks itself (world ``max(T, E*S)``, at most 2; gloo on the loopback, a file store in a
private temporary folder) and waits for them.  For each CKPT it builds the model as Megatron-LM's
``core_transformer_config_from_args`` and GPT builder do (every args field that is a ``TransformerConfig`` field
copied by name, then the renames), with the local spec (``get_gpt_decoder_block_spec(use_transformer_engine=False)``:
GQA with ``q_layernorm`` / ``k_layernorm`` when ``qk_layernorm``, ``SequentialMLP`` experts, the allgather
dispatcher), ``rotary_percent`` from the args (GLM's partial rotary), loads it with ``dist_checkpointing.load`` at
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
from mcore_dist_harness import (  # noqa: E402
    _cpu_shims,
    _die_with_parent,
    _reap_strays,
    cpu_eval_fields,
    init_expert_parallel,
    read_common,
    spawn_and_join,
)
from mcore_mla_harness import forward, iteration_dir, padded_vocab  # noqa: E402

#: Args a GLM run records that change the model (megatron-core's defaults would apply to a missing one).
REQUIRED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
            "norm_epsilon", "normalization", "swiglu", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
            "untie_embeddings_and_output_weights", "vocab_size", "rotary_base", "rotary_percent", "num_experts",
            "moe_router_topk", "moe_ffn_hidden_size", "moe_router_score_function", "moe_layer_freq",
            "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
            "moe_shared_expert_intermediate_size")


def build_model(args: argparse.Namespace, tp: int, ep: int, etp: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    missing = [k for k in REQUIRED if not hasattr(args, k)]
    if missing:
        raise SystemExit(f"the checkpoint's args lack {missing}: megatron-core's defaults would apply")
    get = lambda key, default=None: getattr(args, key, default)  # noqa: E731
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(TransformerConfig) if hasattr(args, f.name)}
    fields.update(  # Megatron-LM's core_transformer_config_from_args renames
        layernorm_epsilon=args.norm_epsilon, layernorm_zero_centered_gamma=get("apply_layernorm_1p", False),
        num_moe_experts=args.num_experts, num_query_groups=args.num_query_groups,
        activation_func=F.silu, gated_linear_unit=bool(args.swiglu), pipeline_dtype=torch.float32,
        params_dtype=torch.float32, bf16=False, fp16=False, mtp_num_layers=None)
    fields.update(cpu_eval_fields(tp, ep, etp))  # CPU / eval plumbing and the degrees this run loads at
    config = TransformerConfig(**fields)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization)
    model = GPTModel(
        config=config, transformer_layer_spec=block,
        vocab_size=padded_vocab(args.vocab_size, get("make_vocab_size_divisible_by", 128), tp),
        max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
        parallel_output=False, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="rope", rotary_percent=args.rotary_percent, rotary_base=args.rotary_base)
    model.eval()
    return model


def check_built(model, args) -> None:
    """What makes the model GLM-like really is in the built model."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for layer, moe in zip(model.decoder.layers, args.moe_layer_freq):
        attn = layer.self_attention
        assert (attn.q_layernorm is not None) == bool(args.qk_layernorm)
        assert attn.linear_qkv.bias is not None and bool(args.add_qkv_bias)
        assert isinstance(layer.mlp, MoELayer) == bool(moe)
        if moe:
            assert layer.mlp.shared_experts is not None and layer.mlp.router.expert_bias is not None
    rope = model.rotary_pos_emb
    assert rope.inv_freq.numel() * 2 == int(args.kv_channels * args.rotary_percent), rope.inv_freq.numel()
    assert model.config.moe_router_score_function == "sigmoid" and model.config.moe_router_topk_scaling_factor


def load_one(cli, ckpt: str, out: str, input_ids: torch.Tensor) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.validation import StrictHandling

    folder = iteration_dir(ckpt)
    common = read_common(folder)
    args = common["args"]
    model = cli.build(args, cli.tp, cli.ep, cli.etp)
    metadata = dict(common.get("content_metadata") or {})
    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=metadata)}, folder,
                                     strict=StrictHandling.ASSUME_OK_UNEXPECTED)["model"]
    result = model.load_state_dict(loaded, strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    cli.check(model, args)
    args.mtp_num_layers = None
    logits = forward(model, args, input_ids)
    if dist.get_rank() == 0:
        torch.save(logits, out)
    dist.barrier()


def worker(local_rank: int, cli, init_method: str) -> None:
    import torch.distributed as dist

    _die_with_parent()
    _cpu_shims()
    dist.init_process_group(backend="gloo", init_method=init_method, rank=local_rank, world_size=cli.world)
    try:
        from megatron.core import parallel_state

        init_expert_parallel(cli.tp, cli.ep, cli.etp)
        input_ids = torch.load(cli.ids, map_location="cpu", weights_only=True).long()
        for ckpt, out in zip(cli.pairs[::2], cli.pairs[1::2]):
            load_one(cli, ckpt, out, input_ids)
        parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def main(build=build_model, check=check_built, doc: str = __doc__) -> int:
    """The command line; ``build`` / ``check`` build and check another family's model (mcore_llama4_harness.py)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    load = sub.add_parser("load", help="load torch_dist checkpoints strictly and write their logits")
    load.add_argument("--ids", required=True, help="a torch file holding a LongTensor [batch, seq]")
    load.add_argument("pairs", nargs="+", help="CKPT OUT.pt pairs")
    load.add_argument("--tp", type=int, default=1)
    load.add_argument("--ep", type=int, default=1)
    load.add_argument("--etp", type=int, default=None, help="expert tensor parallel (default: tp)")
    cli = parser.parse_args()
    cli.etp = cli.tp if cli.etp is None else cli.etp
    cli.build, cli.check = build, check
    cli.world = max(cli.tp, cli.ep * cli.etp)
    if cli.world % cli.tp or cli.world % (cli.ep * cli.etp) or cli.world > 2 or len(cli.pairs) % 2:
        parser.error("need max(tp, ep*etp) <= 2 divisible by both, and CKPT OUT.pt pairs")
    cli.ids = os.path.abspath(cli.ids)
    cli.pairs = [os.path.abspath(p) for p in cli.pairs]
    try:  # orphans below this process re-parent to it, so _reap_strays finds them
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass
    import tempfile

    import torch.multiprocessing as mp

    try:
        with tempfile.TemporaryDirectory(prefix="mcore_glm_harness_") as tmp:
            spawn_and_join(mp, worker, (cli, "file://" + os.path.join(tmp, "store")), cli.world)
    finally:
        from multiprocessing import resource_tracker

        tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
        strays = _reap_strays({tracker} if tracker else set())
        if strays:
            print(f"mcore_glm_harness: killed stray processes {strays}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
