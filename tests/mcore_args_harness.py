"""Load a Megatron-LM ``torch`` checkpoint into megatron-core's own GPTModel, built from the checkpoint's ``args``.

Run as::

    python tests/mcore_args_harness.py CKPT_DIR IDS.pt OUT.pt --nproc-per-node 2

The script spawns the tensor-parallel ranks itself (torch.multiprocessing, gloo, rendezvous through a file store
in a private temporary folder: no TCP store, gloo on the loopback interface only) and waits for all of them.

Each rank reads *its own* rank file ``CKPT_DIR/<iteration>/mp_rank_TT/model_optim_rng.pt`` (the iteration named by
``latest_checkpointed_iteration.txt``: ``release`` or ``iter_%07d``) with ``torch.load(weights_only=True)``, builds
``TransformerConfig`` and ``GPTModel`` from the ``args`` stored in it -- field by field, the way Megatron-LM's
``core_transformer_config_from_args`` and its GPT model builder do -- loads the ``model`` state dict with
``strict=True`` and runs a forward on the ids of ``IDS.pt`` (a LongTensor [batch, seq]).  Rank 0 writes ``OUT.pt``:
``{"logits": FloatTensor[batch, seq, args.vocab_size], "args": {...the args fields used...}}``.

Only the *settings* come from the args; what cannot come from them is the CPU/eval plumbing: CPU initialization,
every CUDA fusion off, ``parallel_output=False`` (gathered logits), an explicit causal mask (megatron-core builds
its default one on CUDA).  ``--drop-arg NAME`` (a self-check of this harness, e.g. ``--drop-arg window_size``)
builds the model as if the args lacked NAME, to show a setting really changes what megatron-core computes.

The local (non Transformer Engine) layer spec is used: ``args.transformer_impl`` must be ``local``.
"""

from __future__ import annotations

import argparse
import os
import sys
import types

from mcore_cpu import prepare_cpu  # noqa: E402  (loopback, one thread, torch.cuda.current_device -> "cpu")

torch = prepare_cpu()
import torch.nn.functional as F  # noqa: E402

TRACKER = "latest_checkpointed_iteration.txt"

#: Megatron-LM's argparse defaults for the fields read below when a checkpoint's args lack them (an args
#: Namespace written by Megatron-LM always has all of them).  Fields in REQUIRED must be present.
MEGATRON_LM_DEFAULTS = {
    "group_query_attention": False,
    "num_query_groups": 1,
    "kv_channels": None,
    "swiglu": False,
    "normalization": "LayerNorm",
    "norm_epsilon": 1e-5,
    "apply_layernorm_1p": False,
    "add_bias_linear": True,
    "add_qkv_bias": False,
    "qk_layernorm": False,
    "rotary_interleaved": False,
    "apply_residual_connection_post_layernorm": False,
    "window_size": None,
    "window_attn_skip_freq": None,
    "softmax_scale": None,
    "glu_linear_offset": 0.0,
    "activation_func_clamp_value": None,
    "no_rope_freq": None,
    "qk_l2_norm": False,
    "softmax_type": "vanilla",
    "attention_output_gate": False,
    "multi_latent_attention": False,
    "apply_query_key_layer_scaling": False,
    "attention_softmax_in_fp32": False,
    "fp16": False,
    "bf16": False,
    "params_dtype": torch.float32,
    "num_experts": None,
    "position_embedding_type": "learned_absolute",
    "rotary_percent": 1.0,
    "rotary_base": 10000,
    "use_rope_scaling": False,
    "rope_scaling_factor": 8.0,
    "rotary_seq_len_interpolation_factor": None,
    "untie_embeddings_and_output_weights": False,
    "transformer_impl": "transformer_engine",
    "pipeline_model_parallel_size": 1,
}
REQUIRED = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
    "num_query_groups", "kv_channels", "swiglu", "normalization", "norm_epsilon", "add_bias_linear",
    "add_qkv_bias", "rotary_interleaved", "apply_residual_connection_post_layernorm", "window_size", "params_dtype",
    "tensor_model_parallel_size", "padded_vocab_size", "vocab_size", "max_position_embeddings",
    "position_embedding_type", "rotary_percent", "rotary_base", "use_rope_scaling",
    "rotary_seq_len_interpolation_factor", "untie_embeddings_and_output_weights",
)


def iteration_dir(ckpt_dir: str) -> str:
    label = open(os.path.join(ckpt_dir, TRACKER)).read().strip()
    return os.path.join(ckpt_dir, "release" if label == "release" else f"iter_{int(label):07d}")


def load_rank_file(ckpt_dir: str, rank: int) -> dict:
    path = os.path.join(iteration_dir(ckpt_dir), f"mp_rank_{rank:02d}", "model_optim_rng.pt")
    # The args are an argparse.Namespace; torch dtypes (args.params_dtype), tuples, dicts and tensors are
    # already allowed by the weights-only unpickler.  Nothing else is added: a load that needs more fails here.
    torch.serialization.add_safe_globals([argparse.Namespace])
    return torch.load(path, map_location="cpu", weights_only=True)


def args_getter(args: argparse.Namespace, dropped: set[str]):
    missing = [k for k in REQUIRED if not hasattr(args, k)]
    if missing:
        raise SystemExit(f"the checkpoint's args lack {missing}: cannot build the model from them")

    def get(key: str):
        if key in dropped:  # --drop-arg: as if the args did not hold it (Megatron-LM's default)
            return MEGATRON_LM_DEFAULTS.get(key)
        if hasattr(args, key):
            return getattr(args, key)
        return MEGATRON_LM_DEFAULTS[key]

    return get


def gpt_model_from_args(gpt_model_class, config, get, layer_spec):
    """megatron-core's GPTModel as Megatron-LM's model provider builds it from ``args`` (one pipeline stage, the
    vocab-parallel logits gathered on every rank)."""
    return gpt_model_class(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=get("padded_vocab_size"),
        max_sequence_length=get("max_position_embeddings"),
        pre_process=True,
        post_process=True,
        parallel_output=False,
        share_embeddings_and_output_weights=not get("untie_embeddings_and_output_weights"),
        position_embedding_type=get("position_embedding_type"),
        rotary_percent=get("rotary_percent"),
        rotary_base=get("rotary_base"),
        rope_scaling=get("use_rope_scaling"),
        rope_scaling_factor=get("rope_scaling_factor"),
        seq_len_interpolation_factor=get("rotary_seq_len_interpolation_factor"),
    )


def config_from_args(get, **plumbing):
    """``TransformerConfig`` as Megatron-LM's ``core_transformer_config_from_args`` builds it for a dense GPT:
    every args field that is a TransformerConfig field, then layernorm_epsilon <- norm_epsilon,
    layernorm_zero_centered_gamma <- apply_layernorm_1p, num_moe_experts <- num_experts, swiglu -> (F.silu,
    gated_linear_unit), num_query_groups None without group_query_attention. Spelled out here (Megatron-LM is not
    installed) for every field that changes what a dense GPT computes, including ones reshard does not write
    (softmax_scale, glu_linear_offset, ...: ``get`` gives Megatron-LM's defaults when absent), so a checkpoint whose
    args set them is computed as Megatron would. ``plumbing`` overrides the CPU / eval settings (and the degrees)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    window = get("window_size")
    fields = dict(
        num_layers=get("num_layers"),
        hidden_size=get("hidden_size"),
        ffn_hidden_size=get("ffn_hidden_size"),
        num_attention_heads=get("num_attention_heads"),
        num_query_groups=get("num_query_groups") if get("group_query_attention") else None,
        kv_channels=get("kv_channels"),
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization=get("normalization"),
        layernorm_epsilon=get("norm_epsilon"),
        layernorm_zero_centered_gamma=get("apply_layernorm_1p"),
        add_bias_linear=get("add_bias_linear"),
        add_qkv_bias=get("add_qkv_bias"),
        qk_layernorm=get("qk_layernorm"),
        rotary_interleaved=get("rotary_interleaved"),
        apply_residual_connection_post_layernorm=get("apply_residual_connection_post_layernorm"),
        window_size=tuple(window) if window is not None else None,  # --window-size gives a tuple; a list too
        window_attn_skip_freq=get("window_attn_skip_freq"),
        softmax_scale=get("softmax_scale"),
        glu_linear_offset=get("glu_linear_offset"),
        activation_func_clamp_value=get("activation_func_clamp_value"),
        no_rope_freq=get("no_rope_freq"),
        qk_l2_norm=get("qk_l2_norm"),
        apply_query_key_layer_scaling=get("apply_query_key_layer_scaling"),
        attention_softmax_in_fp32=get("attention_softmax_in_fp32"),
        num_moe_experts=get("num_experts"),
        params_dtype=get("params_dtype"),
        fp16=get("fp16"),
        bf16=get("bf16"),
        tensor_model_parallel_size=get("tensor_model_parallel_size"),
        pipeline_model_parallel_size=1,
        # CPU / eval plumbing, not settings of the model
        sequence_parallel=False,
        use_cpu_initialization=True,
        perform_initialization=False,  # every parameter comes from the checkpoint (strict load)
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    fields.update(plumbing)
    return TransformerConfig(**fields)


def install_cpu_window_mask() -> None:
    """Shim: megatron-core's sliding-window mask on CPU.

    With ``config.window_size`` set, ``FusedScaleMaskSoftmax.forward_torch_softmax`` ignores the mask it is given
    and builds one with ``megatron.core.transformer.utils.get_sliding_window_causal_mask(sq, sk, window_size)``
    (imported by name into ``megatron.core.fusions.fused_softmax``), whose first line is
    ``torch.ones(sq, skv, dtype=torch.bool, device="cuda")``.  We re-bind *the same function code* to a globals
    dict whose ``torch`` is a proxy that creates that tensor on the CPU instead; everything else (the
    ``triu``/``tril`` diagonals, i.e. megatron-core's own window formula) is megatron-core's.
    """
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as mcore_utils

    original = mcore_utils.get_sliding_window_causal_mask

    class _CpuTorch(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def ones(*size, device=None, **kwargs):
            return torch.ones(*size, device="cpu", **kwargs)

    proxy = _CpuTorch("torch")
    cpu_version = types.FunctionType(original.__code__, {**original.__globals__, "torch": proxy},
                                     original.__name__, original.__defaults__, original.__closure__)
    cpu_version.__doc__ = original.__doc__
    fused_softmax.get_sliding_window_causal_mask = cpu_version
    mcore_utils.get_sliding_window_causal_mask = cpu_version


def worker(local_rank: int, cli: argparse.Namespace, init_method: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(backend="gloo", init_method=init_method, rank=local_rank,
                            world_size=cli.nproc_per_node)
    try:
        run_rank(dist, cli)
    finally:
        dist.destroy_process_group()


def run_rank(dist, cli: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    state = load_rank_file(cli.ckpt_dir, rank)
    args = state["args"]
    get = args_getter(args, set(cli.drop_arg))
    if get("tensor_model_parallel_size") != world or get("pipeline_model_parallel_size") != 1:
        raise SystemExit(f"args say tp={get('tensor_model_parallel_size')} pp={get('pipeline_model_parallel_size')}"
                         f"; this harness runs tp={world} pp=1")
    if get("transformer_impl") != "local":
        raise SystemExit(f"args.transformer_impl is {get('transformer_impl')!r}: this harness builds the local spec")
    if get("num_experts"):
        raise SystemExit("MoE args (num_experts) are not supported by this harness")
    if not get("swiglu"):
        raise SystemExit("args.swiglu is False: only SwiGLU models are supported by this harness")
    for key in ("softmax_type", "attention_output_gate", "multi_latent_attention"):  # other weights/modules
        if get(key) != MEGATRON_LM_DEFAULTS[key]:
            raise SystemExit(f"args.{key} = {get(key)!r} is not supported by this harness")

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world, pipeline_model_parallel_size=1)
    # The CUDA seed helper (model_parallel_cuda_manual_seed) needs a GPU; the inference tracker does not.
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
    install_cpu_window_mask()

    config = config_from_args(get)
    gpt_kwargs = dict(
        vocab_size=get("padded_vocab_size"),
        max_sequence_length=get("max_position_embeddings"),
        position_embedding_type=get("position_embedding_type"),
        rotary_percent=get("rotary_percent"),
        rotary_base=get("rotary_base"),
        rope_scaling=get("use_rope_scaling"),
        seq_len_interpolation_factor=get("rotary_seq_len_interpolation_factor"),
        share_embeddings_and_output_weights=not get("untie_embeddings_and_output_weights"),
    )
    if hasattr(args, "rope_scaling_factor") and "rope_scaling_factor" not in cli.drop_arg:
        gpt_kwargs["rope_scaling_factor"] = args.rope_scaling_factor
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=get("qk_layernorm"),
                                                        normalization=get("normalization"),
                                                        qk_l2_norm=get("qk_l2_norm")),
        pre_process=True,
        post_process=True,
        parallel_output=False,  # gather the vocab-parallel logits on every rank
        **gpt_kwargs,
    )
    model.eval()

    result = model.load_state_dict(state["model"], strict=True)  # raises, naming missing/unexpected keys
    assert not result.missing_keys and not result.unexpected_keys, result

    ids = torch.load(cli.ids, map_location="cpu", weights_only=True).long()
    batch, seq = ids.shape
    position_ids = torch.arange(seq, dtype=torch.long).unsqueeze(0).expand(batch, -1)
    # megatron-core's default causal mask is built on CUDA: pass an explicit one (True = masked out).  With a
    # window_size, forward_torch_softmax replaces it with its own sliding-window causal mask (see the shim).
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)
    with torch.no_grad():
        logits = model(ids, position_ids, mask)
    padded = get("padded_vocab_size")
    assert logits.shape == (batch, seq, padded), (logits.shape, (batch, seq, padded))
    logits = logits.float()[..., : get("vocab_size")].contiguous()
    gathered = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(gathered, logits)
    for other in gathered[1:]:
        assert torch.equal(other, gathered[0]), "ranks disagree on the gathered logits"
    assert torch.isfinite(logits).all()

    if rank == 0:
        keys = sorted((set(REQUIRED) | set(MEGATRON_LM_DEFAULTS)) - {"rope_scaling_factor"})
        used = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in ((k, get(k)) for k in keys)}
        if "rope_scaling_factor" in gpt_kwargs:
            used["rope_scaling_factor"] = gpt_kwargs["rope_scaling_factor"]
        absent = sorted(k for k in keys if not hasattr(args, k))  # read as Megatron-LM's defaults
        torch.save({"logits": logits, "args": used, "absent": absent, "dropped": sorted(cli.drop_arg)}, cli.out)
    dist.barrier()
    parallel_state.destroy_model_parallel()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt_dir")
    parser.add_argument("ids", help="a torch file holding a LongTensor [batch, seq] of token ids")
    parser.add_argument("out", help="where rank 0 writes the logits")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="the TP degree (the checkpoint's)")
    parser.add_argument("--drop-arg", action="append", default=[],
                        help="self-check: build the model as if the args lacked this field")
    cli = parser.parse_args()
    cli.ckpt_dir, cli.ids, cli.out = (os.path.abspath(p) for p in (cli.ckpt_dir, cli.ids, cli.out))

    import tempfile

    import torch.multiprocessing as mp

    # The ranks rendezvous through a file store in a private folder: nothing listens on a network interface
    # except gloo's own sockets, on the loopback interface.  spawn(join=True) returns only once every rank
    # has exited; when one fails it terminates the others before raising.
    with tempfile.TemporaryDirectory(prefix="mcore_args_harness_") as tmp:
        init_method = "file://" + os.path.join(tmp, "store")
        mp.spawn(worker, args=(cli, init_method), nprocs=cli.nproc_per_node, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
