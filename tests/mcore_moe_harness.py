"""megatron-core's own Mixture-of-Experts GPTModel (Mixtral-like) at TP=2 x EP=2 on CPU: Megatron-LM ``torch`` rank
files for every (tensor rank, expert rank) plus megatron-core's reference logits.  Written independently of reshard.

Run as::

    python tests/mcore_moe_harness.py OUT_DIR [--tp 2] [--ep 2] [--etp 2] [--seed N]

The script spawns ``tp * ep`` ranks itself (torch.multiprocessing, gloo on the loopback interface, rendezvous
through a file store in a private temporary folder) and waits for all of them.

The model: RMSNorm, RoPE, GQA (8 heads, 2 groups), hidden 64, 2 layers, every layer a MoE layer of 4 SwiGLU experts
(``moe_ffn_hidden_size`` 32; ``ffn_hidden_size`` keeps the 128 Megatron-LM derives for SwiGLU without
``--ffn-hidden-size``: the experts must be read with the MoE size), top-2 routing with
``moe_router_pre_softmax=False`` (softmax over the top-k logits = Mixtral's renormalised top-k), no expert bias,
untied output layer, vocab 1003 padded to 1024.  megatron-core builds it from Megatron-LM-style ``args`` (the
``TransformerConfig`` through ``mcore_args_harness.config_from_args`` plus the MoE fields Megatron-LM's
``core_transformer_config_from_args`` copies by name; the layer spec is ``get_gpt_decoder_block_spec(config,
use_transformer_engine=False)``, what Megatron-LM's ``pretrain_gpt`` uses for MoE with the local implementation:
local ``SequentialMLP`` experts), with the ``allgather`` token dispatcher (the alltoall one needs CUDA streams).
The args record ``sequence_parallel=True`` (Megatron-LM's validate_args requires it for EP with TP); the forward
runs without it (megatron-core's torch RMSNorm, used without Apex, refuses it; it splits activations over the
sequence, not weights).

Writes, in ``OUT_DIR``:

* ``latest_checkpointed_iteration.txt`` (``release``);
* ``release/mp_rank_{tp:02d}_{ep:03d}/model_optim_rng.pt`` for every rank, named by megatron-core's own dense
  tensor-parallel rank and expert-parallel rank (Megatron-LM's ``get_checkpoint_name`` with PP=1, EP>1):
  ``{"model": state_dict, "args": Namespace, "checkpoint_version": 3.0, "iteration": 0}``, each rank's own
  ``state_dict()`` (dense tensors by tp, the rank's E/EP experts under local indices, split by its etp).  With
  ETP == TP every (tp, ep) is written once (Megatron-LM's save condition ``dp_rank == 0 or expt_dp_rank == 0``:
  expert-data-parallel size 1 here); with ETP=1 at world 2 only the folders of the ranks that exist;
* ``reference.pt`` (rank 0): ``{"input_ids": LongTensor[b, s], "logits": FloatTensor[b, s, V]}``, megatron-core's
  fp32 logits gathered over the vocab and cut to the true vocab ``V``;
* ``harness_meta.json`` (rank 0): the sizes, the rank -> (tp, ep, etp) map, the args, every rank's keys and shapes.

Every weight comes from megatron-core's own seeded CPU initialisation (each rank builds the full weight from the
same seed and keeps its slice); then seeded noise is added to every parameter so that a mapping mistake shows:
1-D parameters (norms) and the router (replicated) get noise drawn identically on every rank; every expert weight
gets noise drawn for its *global* expert in the logical layout (gate [I, H], up [I, H], down [H, I]) and sliced the
way megatron-core splits it over the expert-tensor-parallel ranks (fc1 = [gate_s; up_s], fc2 = down[:, s]), so
experts held under the same local index on different EP ranks differ (megatron-core's initialisation alone makes
them equal).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from mcore_cpu import prepare_cpu  # noqa: E402  (loopback, one thread, torch.cuda.current_device -> "cpu")

os.environ["TORCHDYNAMO_DISABLE"] = "1"  # megatron-core's torch.compile'd helpers run eagerly
torch = prepare_cpu()

from mcore_args_harness import MEGATRON_LM_DEFAULTS, args_getter, config_from_args, gpt_model_from_args  # noqa: E402,E501
from mcore_family_harness import (  # noqa: E402
    BATCH, INIT_STD, MAKE_VOCAB_DIVISIBLE_BY, MAX_POSITIONS, NOISE_1D, OUTPUT_LAYER_SCALE, SEQ_LENGTH, TRUE_VOCAB,
    padded_vocab,
)

NUM_LAYERS = 2
HIDDEN = 64
NUM_EXPERTS = 4
TOPK = 2
MOE_FFN = 32
NOISE_EXPERT = INIT_STD  # per global expert: experts differ by as much as the weights themselves
MAX_RANK_SPREAD = 2e-6  # fp32 summation-order differences between ranks (seen: 7e-7)
NOISE_ROUTER = 0.3  # routing far from ties: top-2 picks must not flip with fp32 rounding

#: TransformerConfig fields that Megatron-LM's core_transformer_config_from_args copies from the args by name, for
#: a MoE model (config_from_args spells the dense ones; num_experts -> num_moe_experts is there).
MOE_FIELDS = (
    "moe_ffn_hidden_size", "moe_router_topk", "moe_router_pre_softmax", "moe_router_score_function",
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_input_jitter_eps",
    "moe_router_dtype", "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_topk_scaling_factor", "moe_layer_freq", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate", "moe_grouped_gemm", "moe_token_dispatcher_type", "moe_expert_capacity_factor",
    "moe_pad_expert_input_to_capacity", "moe_token_drop_policy", "moe_permute_fusion",
    "expert_model_parallel_size", "expert_tensor_parallel_size",
)


def megatron_lm_args(tp: int, ep: int, etp: int) -> argparse.Namespace:
    """The args Megatron-LM records (after ``validate_args``) for a Mixtral-style run with ``--num-experts 4
    --moe-router-topk 2 --moe-ffn-hidden-size 32 --expert-model-parallel-size EP --expert-tensor-parallel-size ETP
    --swiglu --normalization RMSNorm --position-embedding-type rope --group-query-attention --num-query-groups 2
    --untie-embeddings-and-output-weights --disable-bias-linear --transformer-impl local``.  Megatron-LM's rules
    reproduced: ``ffn_hidden_size`` without ``--ffn-hidden-size`` and with swiglu is int(4 H 2/3 / 64) * 64;
    ``kv_channels`` defaults to H / heads; ``bias_swiglu_fusion`` stays at its default; EP with TP needs
    ``sequence_parallel`` (validate_args asserts it); the router/MoE fields not given keep their argparse defaults
    (load balancing ``aux_loss`` with coefficient 0, softmax scores, no expert bias, no capacity)."""
    world = tp * ep if etp == tp else tp  # ETP=1 runs EP == TP on the TP ranks
    return argparse.Namespace(
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=int((4 * HIDDEN * 2 / 3) / 64) * 64,  # 128: Megatron-LM's swiglu default, unused by MoE
        num_attention_heads=8,
        group_query_attention=True,
        num_query_groups=2,
        kv_channels=HIDDEN // 8,
        max_position_embeddings=MAX_POSITIONS,
        seq_length=SEQ_LENGTH,
        vocab_size=TRUE_VOCAB,
        padded_vocab_size=padded_vocab(TRUE_VOCAB, MAKE_VOCAB_DIVISIBLE_BY, tp),
        make_vocab_size_divisible_by=MAKE_VOCAB_DIVISIBLE_BY,
        position_embedding_type="rope",
        use_rotary_position_embeddings=True,
        rotary_base=1000000,
        rotary_percent=1.0,
        rotary_interleaved=False,
        use_rope_scaling=False,
        rope_scaling_factor=8.0,
        rotary_seq_len_interpolation_factor=None,
        normalization="RMSNorm",
        norm_epsilon=1e-5,
        apply_layernorm_1p=False,
        apply_residual_connection_post_layernorm=False,
        qk_layernorm=False,
        qk_l2_norm=False,
        add_bias_linear=False,
        add_qkv_bias=False,
        swiglu=True,
        bias_swiglu_fusion=True,
        bias_gelu_fusion=False,
        openai_gelu=False,
        squared_relu=False,
        quick_geglu=False,
        onnx_safe=None,
        untie_embeddings_and_output_weights=True,
        window_size=None,
        window_attn_skip_freq=None,
        softmax_scale=None,
        multi_latent_attention=False,
        apply_query_key_layer_scaling=False,
        attention_softmax_in_fp32=False,
        init_method_std=INIT_STD,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        # Mixture of Experts (Megatron-LM's names)
        num_experts=NUM_EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=MOE_FFN,
        moe_router_pre_softmax=False,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
        moe_input_jitter_eps=None,
        moe_router_dtype=None,
        moe_router_enable_expert_bias=False,
        moe_router_num_groups=None,
        moe_router_group_topk=None,
        moe_router_topk_scaling_factor=None,
        moe_layer_freq=1,
        moe_shared_expert_intermediate_size=None,
        moe_shared_expert_gate=False,
        moe_shared_expert_overlap=False,
        moe_grouped_gemm=False,
        moe_use_legacy_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",
        moe_expert_capacity_factor=None,
        moe_pad_expert_input_to_capacity=False,
        moe_token_drop_policy="probs",
        moe_permute_fusion=False,
        mtp_num_layers=None,
        # parallelism / format
        world_size=world,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        context_parallel_size=1,
        data_parallel_size=world // tp,
        sequence_parallel=tp > 1,
        transformer_impl="local",
        ckpt_format="torch",
        # precision
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        # bookkeeping
        iteration=0,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        tokenizer_type="NullTokenizer",
    )


def moe_config_from_args(get, **plumbing):
    """``config_from_args`` (the dense rule) plus the MoE fields Megatron-LM copies from the args by name."""
    import torch.nn.functional as F

    assert get("swiglu"), "this harness builds SwiGLU experts"
    fields = {name: get(name) for name in MOE_FIELDS}
    fields.update(gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False)
    fields.update(plumbing)
    return config_from_args(get, **fields)


def perturb(model, args, ep_rank: int, etp_rank: int, etp: int, seed: int) -> None:
    """Seeded noise on every parameter that megatron-core's initialisation leaves equal or trivial.  One generator,
    a fixed draw order, identical on every rank; each rank keeps its part."""
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    # 1-D parameters (norm weights) and the router: replicated on every rank.
    for name in sorted(params):
        p = params[name]
        if p.dim() == 1:
            assert not getattr(p, "tensor_model_parallel", False), name
            p.add_(NOISE_1D * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        elif name.endswith("mlp.router.weight"):
            assert p.shape == (NUM_EXPERTS, HIDDEN), (name, p.shape)
            p.add_(NOISE_ROUTER * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    # Experts: noise per *global* expert, in the logical layout, sliced as megatron-core splits over ETP.
    per_rank = NUM_EXPERTS // args.expert_model_parallel_size
    i_loc = MOE_FFN // etp
    for layer in range(NUM_LAYERS):
        for g in range(NUM_EXPERTS):
            gate = torch.randn(MOE_FFN, HIDDEN, generator=gen)
            up = torch.randn(MOE_FFN, HIDDEN, generator=gen)
            down = torch.randn(HIDDEN, MOE_FFN, generator=gen)
            if g // per_rank != ep_rank:
                continue
            rows = slice(etp_rank * i_loc, (etp_rank + 1) * i_loc)
            pre = f"decoder.layers.{layer}.mlp.experts.local_experts.{g % per_rank}."
            fc1, fc2 = params[pre + "linear_fc1.weight"], params[pre + "linear_fc2.weight"]
            assert fc1.shape == (2 * i_loc, HIDDEN) and fc2.shape == (HIDDEN, i_loc), (fc1.shape, fc2.shape)
            fc1.add_(NOISE_EXPERT * torch.cat([gate[rows], up[rows]], dim=0))
            fc2.add_(NOISE_EXPERT * down[:, rows])


def build(dist, cli: argparse.Namespace) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    rank, world = dist.get_rank(), dist.get_world_size()
    args = megatron_lm_args(cli.tp, cli.ep, cli.etp)
    assert args.world_size == world, (args.world_size, world)
    get = args_getter(args, set())
    for key in ("softmax_type", "attention_output_gate", "multi_latent_attention"):
        assert get(key) == MEGATRON_LM_DEFAULTS[key], key

    tp_rank, ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    dp_rank, edp_rank = ps.get_data_parallel_rank(), ps.get_expert_data_parallel_rank()

    torch.manual_seed(cli.seed)  # same seed everywhere: CPU init builds the full weight on every rank
    config = moe_config_from_args(
        get,
        perform_initialization=True,
        init_method_std=get("init_method_std"),
        # args.sequence_parallel is True (Megatron-LM asserts it for EP with TP) but megatron-core's torch norm
        # (no Apex here) refuses it; it splits activations, not weights: plumbing, like the CPU initialisation.
        sequence_parallel=False,
    )
    model = gpt_model_from_args(GPTModel, config, get, get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization=get("normalization"), qk_l2_norm=get("qk_l2_norm")))
    model.eval()
    per_rank = NUM_EXPERTS // cli.ep
    for layer in model.decoder.layers:  # the settings that make it Mixtral-like really are in the built model
        assert isinstance(layer.mlp, MoELayer), type(layer.mlp)
        assert isinstance(layer.mlp.experts, SequentialMLP), type(layer.mlp.experts)
        assert len(layer.mlp.experts.local_experts) == per_rank
        assert list(layer.mlp.local_expert_indices) == list(range(ep_rank * per_rank, (ep_rank + 1) * per_rank))
        assert type(layer.mlp.token_dispatcher).__name__ == "MoEAllGatherTokenDispatcher"
        assert layer.mlp.shared_experts is None
        assert getattr(layer.mlp.router, "expert_bias", None) is None
        assert layer.mlp.router.weight.shape == (NUM_EXPERTS, HIDDEN)
    assert config.moe_router_pre_softmax is False and config.moe_router_topk == TOPK
    assert config.gated_linear_unit and config.normalization == "RMSNorm"

    with torch.no_grad():
        perturb(model, args, ep_rank, etp_rank, cli.etp, cli.seed + 1)
        model.output_layer.weight.mul_(OUTPUT_LAYER_SCALE)  # logits O(1): fp32 rounding grows with them
        emb = model.embedding.word_embeddings  # padding rows are never looked up: zero them
        lo = max(TRUE_VOCAB - emb.vocab_start_index, 0)
        if lo < emb.weight.shape[0]:
            emb.weight[lo:].zero_()
        # Replicated tensors are identical on every rank; dense TP shards identical across the EP ranks of a tp.
        tp_of = [None] * world
        dist.all_gather_object(tp_of, tp_rank)
        state = model.state_dict()
        for name in sorted(k for k, v in state.items() if torch.is_tensor(v) and ".mlp.experts." not in k):
            p = state[name]
            got = [torch.empty_like(p) for _ in range(world)]
            dist.all_gather(got, p.contiguous())
            split = getattr(dict(model.named_parameters()).get(name), "tensor_model_parallel", False)
            for r in range(world):
                if tp_of[r] == tp_rank or not split:
                    assert torch.equal(got[r], p), f"{name}: rank {r} differs from rank {rank}"

    gen = torch.Generator().manual_seed(cli.seed + 2)
    input_ids = torch.randint(0, TRUE_VOCAB, (BATCH, SEQ_LENGTH), generator=gen, dtype=torch.long)
    position_ids = torch.arange(SEQ_LENGTH, dtype=torch.long).unsqueeze(0).expand(BATCH, -1)
    mask = torch.triu(torch.ones(SEQ_LENGTH, SEQ_LENGTH, dtype=torch.bool), diagonal=1).view(1, 1, SEQ_LENGTH,
                                                                                              SEQ_LENGTH)
    with torch.no_grad():
        logits = model(input_ids, position_ids, mask)
    padded = get("padded_vocab_size")
    assert logits.shape == (BATCH, SEQ_LENGTH, padded), logits.shape
    logits = logits.float()[..., :TRUE_VOCAB].contiguous()
    gathered = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(gathered, logits)
    # The ranks' logits agree to fp32 rounding, not bit for bit: the expert outputs are summed over the tp x ep
    # group (the allgather dispatcher's reduce-scatter / all-reduce), in an order that differs per rank.  Rank 0's
    # are the reference; the spread is recorded and must stay far below the tests' tolerance.
    spread = [(other - gathered[0]).abs().max().item() for other in gathered]
    assert max(spread) <= MAX_RANK_SPREAD, f"ranks disagree on the gathered logits by {spread}"
    logits = gathered[0]
    assert torch.isfinite(logits).all()

    # Megatron-LM's save condition and folder name (get_checkpoint_name, PP=1, EP>1).
    placement = [None] * world
    dist.all_gather_object(placement, dict(rank=rank, tp=tp_rank, ep=ep_rank, etp=etp_rank, dp=dp_rank,
                                           edp=edp_rank))
    saves = dp_rank == 0 or edp_rank == 0
    folder = os.path.join(cli.out_dir, "release",
                          f"mp_rank_{tp_rank:02d}_{ep_rank:03d}" if cli.ep > 1 else f"mp_rank_{tp_rank:02d}")
    sd = model.state_dict()
    if saves:
        writers = [p for p in placement if p["dp"] == 0 or p["edp"] == 0]
        same = [p["rank"] for p in writers if (p["tp"], p["ep"]) == (tp_rank, ep_rank)]
        assert same == [rank], f"folder {folder} would be written by ranks {same}: the torch format collides"
        os.makedirs(folder, exist_ok=True)
        torch.save({"model": sd, "args": args, "checkpoint_version": 3.0, "iteration": 0},
                   os.path.join(folder, "model_optim_rng.pt"))
    shapes = [None] * world
    dist.all_gather_object(shapes, {k: list(v.shape) if torch.is_tensor(v) else repr(v) for k, v in sd.items()})
    if rank == 0:
        torch.save({"input_ids": input_ids, "logits": logits}, os.path.join(cli.out_dir, "reference.pt"))
        with open(os.path.join(cli.out_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("release")
        meta = {
            "tp": cli.tp, "ep": cli.ep, "etp": cli.etp, "world": world,
            "sequence_parallel": bool(config.sequence_parallel),
            "placement": placement,
            "logit_absmax": logits.abs().max().item(),
            "rank_spread_vs_rank0": spread,
            "args": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in sorted(vars(args).items())},
            "state_dict": {f"rank{r}": s for r, s in enumerate(shapes)},
        }
        with open(os.path.join(cli.out_dir, "harness_meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
    dist.barrier()


def worker(local_rank: int, cli: argparse.Namespace, init_method: str) -> None:
    import torch.distributed as dist

    world = cli.tp * cli.ep if cli.etp == cli.tp else cli.tp
    dist.init_process_group(backend="gloo", init_method=init_method, rank=local_rank, world_size=world)
    try:
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):  # referenced unconditionally, imported only with TE
            moe_utils.te_general_gemm = None
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=cli.tp, pipeline_model_parallel_size=1,
                                                 expert_model_parallel_size=cli.ep,
                                                 expert_tensor_parallel_size=cli.etp)
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
        build(dist, cli)
        parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--etp", type=int, default=2, help="expert tensor parallel: TP (world TP*EP) or 1 "
                                                           "(world TP, needs EP == TP)")
    parser.add_argument("--seed", type=int, default=2468)
    cli = parser.parse_args()
    if cli.etp not in (cli.tp, 1) or (cli.etp == 1 and cli.ep != cli.tp):
        raise SystemExit("supported: etp == tp (world tp*ep) or etp == 1 with ep == tp (world tp)")
    cli.out_dir = os.path.abspath(cli.out_dir)
    os.makedirs(cli.out_dir, exist_ok=True)

    import tempfile

    import torch.multiprocessing as mp

    world = cli.tp * cli.ep if cli.etp == cli.tp else cli.tp
    with tempfile.TemporaryDirectory(prefix="mcore_moe_harness_") as tmp:
        init_method = "file://" + os.path.join(tmp, "store")
        mp.spawn(worker, args=(cli, init_method), nprocs=world, join=True)
    return 0


# ---- torch_dist (dist_checkpointing) saves and strict loads of the same model, per family ----------------------
#
#     python tests/mcore_moe_harness.py dist-save OUT_DIR --family F [--tp T --ep E --etp S] [--seed N]
#     python tests/mcore_moe_harness.py dist-load CKPT_DIR OUT.pt --tp T --ep E --etp S [--ids IDS.pt]
#
# ``dist-save`` builds the model of family F (below) from Megatron-LM-style args, seeds it as ``perturb_dist``
# says, computes its logits and saves it the way Megatron-LM's training loop does with --ckpt-format torch_dist
# (``dist_checkpointing.save`` of ``{"args", "checkpoint_version", "iteration", "model":
# model.sharded_state_dict(content metadata)}``, FullyParallelSaveStrategyWrapper): OUT_DIR/iter_0000007/ +
# tracker + reference.pt {"input_ids", "logits"}.  ``dist-load`` builds the model from CKPT_DIR's common.pt args
# (weights-only) at (T, E, S), the vocab padded for T, loads it with ``dist_checkpointing.load`` at Megatron-LM's
# default strictness then ``load_state_dict(strict=True)``, and rank 0 writes OUT.pt {"input_ids", "logits"}.
# World size T*E when S == T, else T (S == 1, E == T).  Every rank's megatron writer Manager is started and shut
# down by the rank (mcore_dist_harness.run_save); a rank that dies takes its children with it.
#
# Families (hidden 64, 8 heads / 2 groups, 4 experts of 32, top-2, untied, vocab 1003):
#   mixtral   2 MoE layers (moe_layer_freq 1: megatron-core stacks the layers: [L, E, ...] keys)
#   qwen2_moe 3 layers, layer 1 dense (ffn 96; moe_layer_freq a list: per-layer keys), a gated shared expert of
#             48, q/k/v biases, softmax over all experts before top-k (no renormalisation)
#   qwen3_moe 2 MoE layers, kv_channels 16 != 64/8, per-head qk_layernorm, renormalised top-k

DIST_ITERATION = 7


def dist_family_args(family: str, tp: int, ep: int, etp: int) -> argparse.Namespace:
    args = megatron_lm_args(tp, ep, etp)
    args.ckpt_format = "torch_dist"
    args.no_save_optim = args.no_save_rng = True
    if family == "qwen2_moe":
        args.num_layers = 3
        args.moe_layer_freq = [1, 0, 1]
        args.ffn_hidden_size = 96
        args.moe_shared_expert_intermediate_size = 48
        args.moe_shared_expert_gate = True
        args.add_qkv_bias = True
        args.moe_router_pre_softmax = True
    elif family == "qwen3_moe":
        args.kv_channels = 16
        args.qk_layernorm = True
    elif family != "mixtral":
        raise SystemExit(f"unknown family {family}")
    return args


def dist_model(args: argparse.Namespace, tp: int, ep: int, etp: int, init: bool):
    """megatron-core's GPTModel of ``args`` at (tp, ep, etp): the decoder block spec of the local implementation
    (SequentialMLP experts), the vocab padded for ``tp``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    base = args_getter(args, set())
    override = {"padded_vocab_size": padded_vocab(base("vocab_size"), base("make_vocab_size_divisible_by"), tp),
                "tensor_model_parallel_size": tp, "expert_model_parallel_size": ep,
                "expert_tensor_parallel_size": etp}
    # MoE fields the args do not record (reshard writes the ones that change the model) keep Megatron-LM's
    # argparse defaults, which megatron_lm_args spells out.
    defaults = vars(megatron_lm_args(tp, ep, etp))

    def get(key):
        if key in override:
            return override[key]
        if not hasattr(args, key) and key in MOE_FIELDS:
            return defaults[key]
        return base(key)
    config = moe_config_from_args(get, perform_initialization=init, init_method_std=INIT_STD,
                                  sequence_parallel=False)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=get("normalization"),
                                      qk_l2_norm=get("qk_l2_norm"))
    model = gpt_model_from_args(GPTModel, config, get, spec)
    model.eval()
    return model, get


def perturb_dist(model, seed: int) -> None:
    """Seeded noise that makes every parameter matter, drawn for the *global* tensor (one generator, the same
    draws on every rank) and sliced as this rank holds it: 1-D parameters (norms, biases; a TP-split bias by its
    global rows), routers, and every routed expert in the logical layout (gate [I, H], up [I, H], down [H, I])
    split over expert-TP as megatron-core does (fc1 = [gate_s; up_s], fc2 = down[:, s])."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    etp, etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    for name in sorted(params):
        p = params[name]
        if p.dim() == 1:
            if getattr(p, "tensor_model_parallel", False):
                n = p.shape[0]
                p.add_(NOISE_1D * torch.randn(n * tp, generator=gen)[tp_rank * n:(tp_rank + 1) * n])
            else:
                p.add_(NOISE_1D * torch.randn(p.shape, generator=gen))
        elif name.endswith("mlp.router.weight"):
            p.add_(NOISE_ROUTER * torch.randn(p.shape, generator=gen))
    per_rank = NUM_EXPERTS // ep
    for layer in range(len(model.decoder.layers)):
        pre = f"decoder.layers.{layer}.mlp.experts.local_experts."
        if pre + "0.linear_fc1.weight" not in params:
            continue  # a dense layer
        i_loc = MOE_FFN // etp
        rows = slice(etp_rank * i_loc, (etp_rank + 1) * i_loc)
        for g in range(NUM_EXPERTS):
            gate, up = torch.randn(MOE_FFN, HIDDEN, generator=gen), torch.randn(MOE_FFN, HIDDEN, generator=gen)
            down = torch.randn(HIDDEN, MOE_FFN, generator=gen)
            if g // per_rank == ep_rank:
                j = g % per_rank
                params[f"{pre}{j}.linear_fc1.weight"].add_(NOISE_EXPERT * torch.cat([gate[rows], up[rows]], dim=0))
                params[f"{pre}{j}.linear_fc2.weight"].add_(NOISE_EXPERT * down[:, rows])


def dist_logits(model, input_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Rank 0's fp32 logits ``[b, s, vocab]`` (every rank computes them; gathered over the vocab)."""
    import torch.distributed as dist

    seq = input_ids.shape[1]
    position_ids = torch.arange(seq, dtype=torch.long).unsqueeze(0).expand(input_ids.shape[0], -1)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)
    with torch.no_grad():
        logits = model(input_ids, position_ids, mask).float()[..., :vocab].contiguous()
    dist.broadcast(logits, src=0)
    assert torch.isfinite(logits).all()
    return logits


def _dist_writer_manager():
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from mcore_dist_harness import _die_with_parent

    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=_die_with_parent)
    return manager


#: what Megatron-LM records as the checkpoint's content metadata (its default save)
DIST_CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def dist_save(model, args, out_dir: str, iteration: int, reference: dict) -> None:
    """``dist_checkpointing.save`` of ``model`` as Megatron-LM saves it (``OUT/iter_N`` with ``args``, the tracker
    file), fully parallel, synchronously; rank 0 also saves ``reference`` as ``OUT/reference.pt``."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    folder = os.path.join(out_dir, f"iter_{iteration:07d}")
    os.makedirs(folder, exist_ok=True)
    dist.barrier()
    group = ps.get_data_parallel_group(with_context_parallel=True)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "model": model.sharded_state_dict(metadata=dict(DIST_CONTENT_METADATA, dp_cp_group=group)),
             "num_floating_point_operations_so_far": 0}
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), group, False)
    # megatron's writer sends results through a queue of a Manager it would start and never stop: this rank
    # starts it (dying with the rank) and shuts it down.
    manager = _dist_writer_manager()
    try:
        filesystem_async._results_queue = manager.Queue()
        dist_checkpointing.save(state, folder, strategy, async_sharded_save=False, validate_access_integrity=True,
                                content_metadata=dict(DIST_CONTENT_METADATA))
        dist.barrier()
    finally:
        filesystem_async._results_queue = None
        manager.shutdown()
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
        torch.save(reference, os.path.join(out_dir, "reference.pt"))
    dist.barrier()


def run_dist_save(dist, cli: argparse.Namespace) -> None:
    args = dist_family_args(cli.family, cli.tp, cli.ep, cli.etp)
    torch.manual_seed(cli.seed)
    model, get = dist_model(args, cli.tp, cli.ep, cli.etp, init=True)
    with torch.no_grad():
        perturb_dist(model, cli.seed + 1)
        model.output_layer.weight.mul_(OUTPUT_LAYER_SCALE)
        emb = model.embedding.word_embeddings
        lo = max(TRUE_VOCAB - emb.vocab_start_index, 0)
        if lo < emb.weight.shape[0]:
            emb.weight[lo:].zero_()
    gen = torch.Generator().manual_seed(cli.seed + 2)
    input_ids = torch.randint(0, TRUE_VOCAB, (BATCH, SEQ_LENGTH), generator=gen, dtype=torch.long)
    logits = dist_logits(model, input_ids, TRUE_VOCAB)
    dist_save(model, args, cli.out_dir, DIST_ITERATION, {"input_ids": input_ids, "logits": logits})


def run_dist_load(dist, cli: argparse.Namespace) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from mcore_args_harness import iteration_dir
    from mcore_dist_harness import read_common

    folder = iteration_dir(cli.ckpt_dir)
    common = read_common(folder)
    model, get = dist_model(common["args"], cli.tp, cli.ep, cli.etp, init=False)
    metadata = dict(common.get("content_metadata") or {})
    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=metadata)}, folder,
                                     strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    result = model.load_state_dict(loaded["model"], strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    input_ids = torch.load(cli.ids, map_location="cpu", weights_only=True).long()
    logits = dist_logits(model, input_ids, get("vocab_size"))
    if dist.get_rank() == 0:
        torch.save({"input_ids": input_ids, "logits": logits}, cli.out)
    dist.barrier()


def dist_worker(local_rank: int, cli: argparse.Namespace, init_method: str) -> None:
    import torch.distributed as dist

    from mcore_dist_harness import _cpu_shims, _die_with_parent, init_expert_parallel

    _die_with_parent()
    _cpu_shims()
    world = cli.tp * cli.ep if cli.etp == cli.tp else cli.tp
    dist.init_process_group(backend="gloo", init_method=init_method, rank=local_rank, world_size=world)
    try:
        from megatron.core import parallel_state

        init_expert_parallel(cli.tp, cli.ep, cli.etp)
        (run_dist_save if cli.command == "dist-save" else run_dist_load)(dist, cli)
        parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def dist_main() -> int:
    import tempfile

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description="torch_dist save / strict load of megatron-core MoE models")
    sub = parser.add_subparsers(dest="command", required=True)
    save = sub.add_parser("dist-save")
    save.add_argument("out_dir")
    save.add_argument("--family", default="mixtral")
    save.add_argument("--seed", type=int, default=2468)
    load = sub.add_parser("dist-load")
    load.add_argument("ckpt_dir")
    load.add_argument("out")
    load.add_argument("--ids", required=True)
    for p in (save, load):
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--ep", type=int, default=1)
        p.add_argument("--etp", type=int, default=None)
    cli = parser.parse_args()
    cli.etp = cli.tp if cli.etp is None else cli.etp
    if cli.etp not in (cli.tp, 1) or (cli.etp != cli.tp and cli.ep != cli.tp):
        raise SystemExit("supported: etp == tp (world tp*ep) or etp == 1 with ep == tp (world tp)")
    for attr in ("out_dir", "ckpt_dir", "out", "ids"):
        if getattr(cli, attr, None):
            setattr(cli, attr, os.path.abspath(getattr(cli, attr)))
    world = cli.tp * cli.ep if cli.etp == cli.tp else cli.tp
    with tempfile.TemporaryDirectory(prefix="mcore_moe_dist_") as tmp:
        mp.start_processes(dist_worker, args=(cli, "file://" + os.path.join(tmp, "store")), nprocs=world,
                           join=True, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(dist_main() if sys.argv[1:2] in (["dist-save"], ["dist-load"]) else main())
