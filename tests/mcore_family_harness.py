"""megatron-core's own GPTModel for the GPT-2 and Qwen3 families at TP=2 on CPU: Megatron-LM ``torch`` rank files
plus megatron-core's reference logits.  Written independently of reshard.

Run as::

    python tests/mcore_family_harness.py OUT_ROOT CASE [CASE ...] [--nproc-per-node 2] [--seed N]

with CASE among ``gpt2`` (GPT-2: learned absolute positions, LayerNorm with bias, a bias on every linear, non-gated
tanh GELU through Megatron-LM's default ``--bias-gelu-fusion``, MHA, tied head), ``qwen3`` (Qwen3: RoPE, RMSNorm,
SwiGLU, GQA 8 heads / 2 groups, ``kv_channels`` 16 != hidden / heads = 8, per-head ``qk_layernorm``, no biases, tied
head) and ``qwen3-untied`` (the same with its own output layer, saved under an ``iter_`` folder instead of
``release``).  The script spawns the ranks itself (torch.multiprocessing, gloo on the loopback interface,
rendezvous through a file store in a private temporary folder) and builds every case in one process group.

Each case writes, in ``OUT_ROOT/CASE``:

* ``latest_checkpointed_iteration.txt`` (``release``, or the iteration number);
* ``release/mp_rank_0{r}/model_optim_rng.pt`` (or ``iter_%07d/...``): ``{"model": state_dict, "args": Namespace,
  "checkpoint_version": 3.0, "iteration": N}``, Megatron-LM's ``torch`` checkpoint format, the args holding what
  Megatron-LM itself records for such a run (no ``hf_config``: the architecture must follow from the args);
* ``reference.pt`` (rank 0): ``{"input_ids": LongTensor[b, s], "logits": FloatTensor[b, s, V]}``, megatron-core's
  fp32 logits gathered over the vocab and cut to the true vocab ``V``;
* ``harness_meta.json`` (rank 0): the case, its sizes and the rank-0 state dict keys and shapes.

The model is built the way Megatron-LM's ``pretrain_gpt`` builds it *from those args*: the ``TransformerConfig``
through ``tests/mcore_args_harness.config_from_args`` (the spelled-out ``core_transformer_config_from_args``) plus
Megatron-LM's activation rule (``swiglu`` -> gated SiLU; else ``F.gelu`` with ``bias_activation_fusion =
args.bias_gelu_fusion``, which megatron-core runs as ``bias_gelu``, the tanh approximation), and the ``GPTModel``
arguments from the args; the layer spec is megatron-core's local one (``transformer_impl='local'``).  Only the CPU
and eval plumbing is not from the args.  Every weight comes from megatron-core's own seeded CPU initialisation;
every 1-D parameter then gets seeded noise, drawn for the *whole* tensor and sliced per rank for the TP-split ones
(the column-parallel biases), so norms and biases matter and a rank-order mistake shows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from mcore_cpu import prepare_cpu  # noqa: E402  (loopback, one thread, torch.cuda.current_device -> "cpu")

# megatron-core wraps its fused kernels (bias_gelu here) in torch.compile: run them eagerly, exactly as written
# (no C++ toolchain needed, ~15 s less, and no inductor tanh approximation: 1.7e-6 apart on these logits).
os.environ["TORCHDYNAMO_DISABLE"] = "1"
torch = prepare_cpu()
import torch.nn.functional as F  # noqa: E402

from mcore_args_harness import MEGATRON_LM_DEFAULTS, args_getter, config_from_args, gpt_model_from_args  # noqa: E402,E501

MAKE_VOCAB_DIVISIBLE_BY = 128
TRUE_VOCAB = 1003
SEQ_LENGTH = 16
BATCH = 2
MAX_POSITIONS = 64
# Larger than Megatron's default 0.02 so attention is far from uniform (a q/k mistake must move the logits) ...
INIT_STD = 0.15
# ... and an untied output layer scaled back down so the logits stay O(1) (fp32 rounding grows with them).
OUTPUT_LAYER_SCALE = 0.25
NOISE_1D = 0.3

CASES = ("gpt2", "qwen3", "qwen3-untied")


def padded_vocab(vocab: int, divisor: int, tp: int) -> int:
    multiple = divisor * tp
    return ((vocab + multiple - 1) // multiple) * multiple


def megatron_lm_args(case: str, tp: int, iteration: int) -> argparse.Namespace:
    """The args Megatron-LM records (after ``validate_args``) for a run of this case, the fields that matter for the
    model and the format.  Megatron-LM's own rules reproduced here: ``num_query_groups`` keeps its argparse default 1
    without ``--group-query-attention``; ``kv_channels`` defaults to hidden / heads; ``add_qkv_bias`` is forced True
    with ``add_bias_linear``; ``bias_gelu_fusion`` defaults True and is forced False without biases or with swiglu;
    the unused RoPE fields keep their defaults under learned_absolute."""
    common = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=8,
        max_position_embeddings=MAX_POSITIONS,
        seq_length=SEQ_LENGTH,
        vocab_size=TRUE_VOCAB,
        padded_vocab_size=padded_vocab(TRUE_VOCAB, MAKE_VOCAB_DIVISIBLE_BY, tp),
        make_vocab_size_divisible_by=MAKE_VOCAB_DIVISIBLE_BY,
        apply_layernorm_1p=False,
        apply_residual_connection_post_layernorm=False,
        rotary_percent=1.0,
        rotary_interleaved=False,
        use_rope_scaling=False,
        rope_scaling_factor=8.0,
        rotary_seq_len_interpolation_factor=None,
        window_size=None,
        window_attn_skip_freq=None,
        softmax_scale=None,
        qk_l2_norm=False,
        openai_gelu=False,
        squared_relu=False,
        quick_geglu=False,
        onnx_safe=None,
        num_experts=None,
        multi_latent_attention=False,
        apply_query_key_layer_scaling=False,
        attention_softmax_in_fp32=False,
        init_method_std=INIT_STD,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        # parallelism / format
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=1,
        context_parallel_size=1,
        sequence_parallel=False,
        transformer_impl="local",
        ckpt_format="torch",
        # precision
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        # bookkeeping
        iteration=iteration,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        tokenizer_type="NullTokenizer",
    )
    if case == "gpt2":
        specific = dict(
            ffn_hidden_size=4 * 64,
            group_query_attention=False,
            num_query_groups=1,  # Megatron-LM's argparse default; ignored without group_query_attention
            kv_channels=64 // 8,
            position_embedding_type="learned_absolute",
            use_rotary_position_embeddings=False,
            rotary_base=10000,
            normalization="LayerNorm",
            norm_epsilon=1e-5,
            qk_layernorm=False,
            add_bias_linear=True,
            add_qkv_bias=True,
            swiglu=False,
            bias_gelu_fusion=True,
            bias_swiglu_fusion=True,
            untie_embeddings_and_output_weights=False,
        )
    elif case in ("qwen3", "qwen3-untied"):
        specific = dict(
            ffn_hidden_size=160,
            group_query_attention=True,
            num_query_groups=2,
            kv_channels=16,  # head_dim != hidden / heads (8)
            position_embedding_type="rope",
            use_rotary_position_embeddings=True,
            rotary_base=1000000,
            normalization="RMSNorm",
            norm_epsilon=1e-6,
            qk_layernorm=True,
            add_bias_linear=False,
            add_qkv_bias=False,
            swiglu=True,
            bias_gelu_fusion=False,
            bias_swiglu_fusion=True,
            untie_embeddings_and_output_weights=case == "qwen3-untied",
        )
    else:
        raise SystemExit(f"unknown case {case!r}; one of {CASES}")
    return argparse.Namespace(**common, **specific)


def activation_from_args(get) -> dict:
    """Megatron-LM's ``core_transformer_config_from_args`` activation rule (``config_from_args`` spells only the
    swiglu branch): swiglu -> gated SiLU (the fused swiglu kernel computes the same, left off); else the
    TransformerConfig default ``F.gelu`` with ``bias_activation_fusion = bias_gelu_fusion``, which megatron-core's
    MLP runs as ``bias_gelu_impl`` (tanh-approximated GELU)."""
    for flag in ("openai_gelu", "squared_relu", "quick_geglu", "onnx_safe"):
        if get(flag):
            raise SystemExit(f"args.{flag} is set: not supported by this harness")
    if get("swiglu"):
        return dict(gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False)
    return dict(gated_linear_unit=False, activation_func=F.gelu, bias_activation_fusion=bool(get("bias_gelu_fusion")))


def perturb_1d(model, rank: int, tp: int, seed: int) -> None:
    """Seeded noise on every 1-D parameter: drawn for the whole (logical) tensor in a fixed name order, identical on
    every rank; a TP-split one (``tensor_model_parallel``) keeps this rank's slice of it."""
    gen = torch.Generator().manual_seed(seed)
    for _name, p in sorted(model.named_parameters()):
        if p.dim() != 1:
            continue
        if getattr(p, "tensor_model_parallel", False):
            assert getattr(p, "partition_dim", 0) == 0 and getattr(p, "partition_stride", 1) == 1, _name
            full = torch.randn(p.shape[0] * tp, generator=gen, dtype=p.dtype)
            p.add_(NOISE_1D * full.chunk(tp)[rank])
        else:
            p.add_(NOISE_1D * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def build_case(dist, case: str, seed: int, out_root: str, iteration: int | None) -> None:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    rank, tp = dist.get_rank(), dist.get_world_size()
    args = megatron_lm_args(case, tp, iteration or 0)
    get = args_getter(args, set())
    for key in ("softmax_type", "attention_output_gate", "multi_latent_attention"):
        assert get(key) == MEGATRON_LM_DEFAULTS[key], key

    torch.manual_seed(seed)  # same seed everywhere: CPU init builds the full weight on every rank, keeps its slice
    config = config_from_args(
        get,
        **activation_from_args(get),
        perform_initialization=True,
        init_method_std=get("init_method_std"),
    )
    model = gpt_model_from_args(GPTModel, config, get, get_gpt_layer_local_spec(
        qk_layernorm=get("qk_layernorm"), normalization=get("normalization"), qk_l2_norm=get("qk_l2_norm")))
    model.eval()
    if case == "gpt2":  # the settings that make it GPT-2 really are in the model megatron-core built
        assert model.embedding.position_embeddings.weight.shape == (MAX_POSITIONS, args.hidden_size)
        assert config.bias_activation_fusion and config.activation_func is F.gelu and not config.gated_linear_unit
        assert model.decoder.layers[0].self_attention.linear_qkv.bias is not None
    else:
        assert model.decoder.layers[0].self_attention.q_layernorm.weight.shape == (args.kv_channels,)

    with torch.no_grad():
        perturb_1d(model, rank, tp, seed + 1)
        # Replicated tensors must be identical on every rank (they are, from the shared seed; make sure).
        for name, p in sorted(model.named_parameters()):
            if not getattr(p, "tensor_model_parallel", False):
                ref = p.detach().clone()
                dist.broadcast(ref, src=0)
                assert torch.equal(ref, p), f"{case}: replicated {name} differs across ranks"
        if not model.share_embeddings_and_output_weights:
            model.output_layer.weight.mul_(OUTPUT_LAYER_SCALE)  # same factor on every rank's slice
        # Padding rows of the embedding are never looked up; zero them (what a converter writes when it pads).
        emb = model.embedding.word_embeddings
        lo = max(TRUE_VOCAB - emb.vocab_start_index, 0)
        if lo < emb.weight.shape[0]:
            emb.weight[lo:].zero_()

    gen = torch.Generator().manual_seed(seed + 2)
    input_ids = torch.randint(0, TRUE_VOCAB, (BATCH, SEQ_LENGTH), generator=gen, dtype=torch.long)
    position_ids = torch.arange(SEQ_LENGTH, dtype=torch.long).unsqueeze(0).expand(BATCH, -1)
    # megatron-core's default causal mask is built on CUDA: pass an explicit one (True = masked out).
    mask = torch.triu(torch.ones(SEQ_LENGTH, SEQ_LENGTH, dtype=torch.bool), diagonal=1).view(1, 1, SEQ_LENGTH,
                                                                                              SEQ_LENGTH)
    with torch.no_grad():
        logits = model(input_ids, position_ids, mask)
    padded = get("padded_vocab_size")
    assert logits.shape == (BATCH, SEQ_LENGTH, padded), logits.shape
    logits = logits.float()[..., :TRUE_VOCAB].contiguous()
    gathered = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(gathered, logits)
    for other in gathered[1:]:
        assert torch.equal(other, gathered[0]), "ranks disagree on the gathered logits"
    assert torch.isfinite(logits).all()

    out_dir = os.path.join(out_root, case)
    folder = "release" if iteration is None else f"iter_{iteration:07d}"
    rank_dir = os.path.join(out_dir, folder, f"mp_rank_{rank:02d}")
    os.makedirs(rank_dir, exist_ok=True)
    state = {"model": model.state_dict(), "args": args, "checkpoint_version": 3.0, "iteration": iteration or 0}
    torch.save(state, os.path.join(rank_dir, "model_optim_rng.pt"))
    if rank == 0:
        torch.save({"input_ids": input_ids, "logits": logits}, os.path.join(out_dir, "reference.pt"))
        with open(os.path.join(out_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("release" if iteration is None else str(iteration))
        meta = {
            "case": case,
            "tp": tp,
            "iteration_folder": folder,
            "logit_absmax": logits.abs().max().item(),
            "args": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in sorted(vars(args).items())},
            "state_dict": {k: (list(v.shape) if torch.is_tensor(v) else repr(v))
                           for k, v in state["model"].items()},
        }
        with open(os.path.join(out_dir, "harness_meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
    dist.barrier()


def worker(local_rank: int, cli: argparse.Namespace, init_method: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(backend="gloo", init_method=init_method, rank=local_rank,
                            world_size=cli.nproc_per_node)
    try:
        from megatron.core import parallel_state, tensor_parallel

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=cli.nproc_per_node,
                                                 pipeline_model_parallel_size=1)
        # The CUDA seed helper (model_parallel_cuda_manual_seed) needs a GPU; the inference tracker does not.
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
        for case in cli.cases:
            iteration = 7 if case == "qwen3-untied" else None  # one case under iter_0000007, the others release
            build_case(dist, case, cli.seed, cli.out_root, iteration)
        parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_root")
    parser.add_argument("cases", nargs="+", choices=CASES)
    parser.add_argument("--nproc-per-node", type=int, default=2, help="the TP degree")
    parser.add_argument("--seed", type=int, default=4321)
    cli = parser.parse_args()
    cli.out_root = os.path.abspath(cli.out_root)
    os.makedirs(cli.out_root, exist_ok=True)

    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="mcore_family_harness_") as tmp:
        init_method = "file://" + os.path.join(tmp, "store")
        mp.spawn(worker, args=(cli, init_method), nprocs=cli.nproc_per_node, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
