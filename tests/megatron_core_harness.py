"""Build a small megatron-core GPTModel on CPU (TP over gloo), run a forward, save a Megatron-LM style checkpoint.

Run with either::

    OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo \
        torchrun --standalone --nproc-per-node 2 tests/megatron_core_harness.py OUT_DIR [--seed N]
    python tests/megatron_core_harness.py OUT_DIR --nproc-per-node 2 [--seed N]

The second form (what the test uses) spawns the ranks itself and rendezvouses through a file store: nothing
listens except gloo, on 127.0.0.1.  torchrun's agent opens a TCPStore that listens on all interfaces.

It writes, in OUT_DIR:

* ``reference.pt`` (rank 0): ``{"input_ids": LongTensor[b, s], "logits": FloatTensor[b, s, V]}``, the full,
  gathered logits of megatron-core's own forward restricted to the true vocab ``V``;
* ``latest_checkpointed_iteration.txt`` containing ``1``;
* ``iter_0000001/mp_rank_{r:02d}/model_optim_rng.pt``: ``{"model": state_dict, "args": Namespace,
  "checkpoint_version": 3.0, "iteration": 1}``, the ``torch`` checkpoint format of Megatron-LM training;
* ``harness_meta.json`` (rank 0): the sizes used, for the test's sanity checks.

The model follows megatron-core's *local* (non Transformer Engine) layer spec, so the norm names are
``input_layernorm`` / ``pre_mlp_layernorm`` rather than TE's fused ``layer_norm_weight``.

The harness never touches the network: gloo binds to the loopback interface only (GLOO_SOCKET_IFNAME=lo).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from mcore_cpu import prepare_cpu  # noqa: E402  (loopback, one thread, torch.cuda.current_device -> "cpu")

torch = prepare_cpu()
import torch.nn.functional as F  # noqa: E402

# ---- model sizes (keep in sync with test_megatron_core.py, which reads harness_meta.json) ----
NUM_LAYERS = 2
HIDDEN = 64
NUM_HEADS = 8
NUM_QUERY_GROUPS = 2
KV_CHANNELS = HIDDEN // NUM_HEADS  # 8
FFN_HIDDEN = 160
TRUE_VOCAB = 1000
MAKE_VOCAB_DIVISIBLE_BY = 128
MAX_POSITIONS = 64
SEQ_LENGTH = 16
BATCH = 2
NORM_EPS = 1e-5
ROTARY_BASE = 10000
# Larger than Megatron's default 0.02 so that attention is far from uniform: with tiny weights the softmax
# is almost flat and a q/k or RoPE permutation barely moves the logits.
INIT_STD = 0.15
# ...but the output layer is scaled back down afterwards, so the logits stay O(1): fp32 rounding differences
# between two correct implementations grow with the logit magnitude and must stay well under the test's 1e-5.
OUTPUT_LAYER_SCALE = 0.25


def padded_vocab(vocab: int, divisor: int, tp: int) -> int:
    multiple = divisor * tp
    return ((vocab + multiple - 1) // multiple) * multiple


def worker(local_rank: int, cli: argparse.Namespace, init_method: str | None) -> None:
    """One tensor-parallel rank.  ``init_method`` None: torchrun's env:// rendezvous; else a file:// store."""
    import torch.distributed as dist

    if init_method is None:
        dist.init_process_group(backend="gloo")
    else:
        dist.init_process_group(
            backend="gloo", init_method=init_method, rank=local_rank, world_size=cli.nproc_per_node
        )
    rank = dist.get_rank()
    world = dist.get_world_size()
    tp = world

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    # The CUDA seed helper (model_parallel_cuda_manual_seed) needs a GPU; the inference tracker does not.
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)

    torch.manual_seed(cli.seed)  # same seed everywhere: CPU init builds the full weight on every rank

    padded = padded_vocab(TRUE_VOCAB, MAKE_VOCAB_DIVISIBLE_BY, tp)

    config = TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN_HIDDEN,
        num_attention_heads=NUM_HEADS,
        num_query_groups=NUM_QUERY_GROUPS,
        kv_channels=KV_CHANNELS,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        use_cpu_initialization=True,
        perform_initialization=True,
        init_method_std=INIT_STD,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=NORM_EPS,
        layernorm_zero_centered_gamma=False,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=False,
        rotary_interleaved=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
    )

    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=False),
        vocab_size=padded,
        max_sequence_length=MAX_POSITIONS,
        pre_process=True,
        post_process=True,
        parallel_output=False,  # gather the vocab-parallel logits on every rank
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=ROTARY_BASE,
    )
    model.eval()

    with torch.no_grad():
        # Norm weights start at 1: give every replicated (1-D) parameter seeded noise, identical on every rank,
        # so a norm-mapping mistake shows.  2-D weights already come from megatron's own seeded CPU init.
        gen = torch.Generator().manual_seed(cli.seed + 1)
        for _name, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        model.output_layer.weight.mul_(OUTPUT_LAYER_SCALE)  # same factor on every rank's slice
        # Padding rows of the embedding are never looked up (ids < TRUE_VOCAB); zero them (what a converter
        # writes when it pads on the way in) so they cannot leak anywhere.  Output-layer padding rows are left as they are:
        # the reference keeps only the first TRUE_VOCAB logit columns.
        emb = model.embedding.word_embeddings
        start = emb.vocab_start_index
        lo = max(TRUE_VOCAB - start, 0)
        if lo < emb.weight.shape[0]:
            emb.weight[lo:].zero_()

    # Fixed inputs, identical on every rank.
    gen = torch.Generator().manual_seed(cli.seed + 2)
    input_ids = torch.randint(0, TRUE_VOCAB, (BATCH, SEQ_LENGTH), generator=gen, dtype=torch.long)
    position_ids = torch.arange(SEQ_LENGTH, dtype=torch.long).unsqueeze(0).expand(BATCH, -1)
    # The default mask is built on CUDA: pass an explicit causal one (True = masked out).
    attention_mask = torch.triu(torch.ones(SEQ_LENGTH, SEQ_LENGTH, dtype=torch.bool), diagonal=1)
    attention_mask = attention_mask.view(1, 1, SEQ_LENGTH, SEQ_LENGTH)

    with torch.no_grad():
        logits = model(input_ids, position_ids, attention_mask)
    assert logits.shape == (BATCH, SEQ_LENGTH, padded), logits.shape
    logits = logits.float()[..., :TRUE_VOCAB].contiguous()
    # Every rank gathered the same logits; check it to catch a broken gather.
    other = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(other, logits)
    for t in other[1:]:
        assert torch.equal(t, other[0]), "ranks disagree on the gathered logits"
    assert torch.isfinite(logits).all()

    out_dir = cli.out_dir
    it_dir = os.path.join(out_dir, "iter_0000001", f"mp_rank_{rank:02d}")
    os.makedirs(it_dir, exist_ok=True)

    args = argparse.Namespace(
        # architecture
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN_HIDDEN,
        num_attention_heads=NUM_HEADS,
        group_query_attention=True,
        num_query_groups=NUM_QUERY_GROUPS,
        kv_channels=KV_CHANNELS,
        padded_vocab_size=padded,
        vocab_size=TRUE_VOCAB,
        make_vocab_size_divisible_by=MAKE_VOCAB_DIVISIBLE_BY,
        swiglu=True,
        normalization="RMSNorm",
        norm_epsilon=NORM_EPS,
        apply_layernorm_1p=False,
        qk_layernorm=False,
        position_embedding_type="rope",
        use_rotary_position_embeddings=True,
        rotary_base=ROTARY_BASE,
        rotary_percent=1.0,
        rotary_interleaved=False,
        use_rope_scaling=False,
        add_bias_linear=False,
        add_qkv_bias=False,
        untie_embeddings_and_output_weights=True,
        max_position_embeddings=MAX_POSITIONS,
        seq_length=SEQ_LENGTH,
        num_experts=None,
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
        iteration=1,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        tokenizer_type="NullTokenizer",
    )
    state = {
        "model": model.state_dict(),  # _extra_state entries kept as megatron-core returns them
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": 1,
    }
    torch.save(state, os.path.join(it_dir, "model_optim_rng.pt"))

    if rank == 0:
        torch.save({"input_ids": input_ids, "logits": logits}, os.path.join(out_dir, "reference.pt"))
        with open(os.path.join(out_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
        meta = {
            "tp": tp,
            "num_layers": NUM_LAYERS,
            "hidden_size": HIDDEN,
            "ffn_hidden_size": FFN_HIDDEN,
            "num_attention_heads": NUM_HEADS,
            "num_query_groups": NUM_QUERY_GROUPS,
            "kv_channels": KV_CHANNELS,
            "vocab_size": TRUE_VOCAB,
            "padded_vocab_size": padded,
            "norm_epsilon": NORM_EPS,
            "rotary_base": ROTARY_BASE,
            "max_position_embeddings": MAX_POSITIONS,
            "seed": cli.seed,
            "state_dict_keys": list(state["model"].keys()),
        }
        with open(os.path.join(out_dir, "harness_meta.json"), "w") as f:
            json.dump(meta, f, indent=1)

    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=int(os.environ.get("MCORE_HARNESS_SEED", "1234")))
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=2,
        help="TP degree when the script launches its own workers (ignored under torchrun)",
    )
    cli = parser.parse_args()

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        worker(int(os.environ.get("LOCAL_RANK", "0")), cli, None)
        return

    # Self-launch: the workers rendezvous through a file store, so no TCP store is opened at all and the only
    # listening sockets are gloo's, on the loopback interface (torchrun's agent store listens on every
    # interface and torch offers no option to change that).
    import tempfile

    import torch.multiprocessing as mp

    os.makedirs(cli.out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mcore_harness_") as tmp:
        init_method = "file://" + os.path.join(tmp, "store")
        mp.spawn(worker, args=(cli, init_method), nprocs=cli.nproc_per_node, join=True)


if __name__ == "__main__":
    sys.exit(main())
