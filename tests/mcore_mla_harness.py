"""megatron-core 0.16.1's own DeepSeek-shaped GPTModel (multi-latent attention, routed + shared experts, a dense
first layer, optionally one MTP layer) on the CPU: saved with ``dist_checkpointing``, and loaded strictly from a
``torch_dist`` folder or from Megatron ``torch`` rank files, with its logits.  Written independently of reshard.

Run as::

    python tests/mcore_mla_harness.py save OUT_DIR --kind v3|v2 [--mtp] [--tp T --ep E --etp S] [--keys te|local]
                                                   [--ids IDS.pt] [--seed N]
    python tests/mcore_mla_harness.py load --ids IDS.pt [--tp T --ep E --etp S] [--keys te|local] CKPT OUT.pt ...

The script spawns its ranks itself (world ``max(T, E*S)``, at most 2 here; torch.multiprocessing, gloo on the
loopback interface, a file store in a private temporary folder) and waits for them; nothing it starts outlives it.

``save`` builds the model from Megatron-LM-style ``args`` (:func:`megatron_lm_args`) and saves it as Megatron-LM's
training loop does with ``--ckpt-format torch_dist`` (``dist_checkpointing.save`` of ``{"args", ..., "model":
model.sharded_state_dict(content metadata)}``, FullyParallelSaveStrategyWrapper): ``OUT_DIR/iter_0000007/`` + the
tracker + ``reference.pt``.  Kinds (hidden 64, 4 heads, kv LoRA 16, no-RoPE dim 8, RoPE dim 4, v dim 8, 3 layers with
layer 0 dense (ffn 48), 16 experts of 16, top-4, vocab 200 padded to 256, untied, yarn RoPE factor 4 over 16
original positions):

* ``v3``: q LoRA 24, sigmoid router with a (seeded, non-zero) expert bias, 4 groups of which 2 are kept
  (top-k = 2 * group_topk: megatron-core's group score is then transformers' top-2 sum), scaling 2.5, one shared
  expert of 16, yarn mscale = mscale_all_dim = 1; ``--mtp`` adds one MTP layer;
* ``v2``: no q LoRA (``linear_q_proj``), softmax over all experts before the top-k (``moe_router_pre_softmax``, no
  renormalisation: DeepSeek-V2-Lite's greedy routing), two shared experts (32), yarn mscale = mscale_all_dim = 0.707.

``load`` builds, for each CKPT, the model from the checkpoint's own args at (T, E, S) and loads it strictly: a
``torch_dist`` folder with ``dist_checkpointing.load`` at Megatron-LM's default strictness then
``load_state_dict(strict=True)``; ``torch`` rank files (each rank reads ``mp_rank_TT[_EEE]/model_optim_rng.pt`` of
its own dense TP rank and expert rank, weights-only) with ``load_state_dict(strict=True)``.  Rank 0 writes ``OUT.pt``.

``--keys`` (both commands): the torch_dist key spelling. ``te`` (default): the Transformer Engine spec's, which a
GPU run of DeepSeek writes (the q / kv LoRA norms as ``linear_q_up_proj`` / ``linear_kv_up_proj.layer_norm_weight``,
a dense layer's pre-MLP norm as ``mlp.linear_fc1.layer_norm_weight``), put on the local-spec model with
megatron-core's own ``sharded_state_dict_keys_map`` (what its GQA local spec does); ``local``: the MLA local spec's
own keys (``q_layernorm``, ``kv_layernorm``, ``pre_mlp_layernorm``; it has no keys map).

Both write ``{"input_ids": [b, s], "logits": [b, s, vocab]}`` (fp32, gathered over TP, cut to the true vocab),
plus, with MTP, ``"mtp_logits"``: the MTP layer's logits, what its loss is computed from (its forward needs labels
then: ``labels = input_ids``; the loss it returns is not kept: with the logits gathered over TP, as here,
megatron-core's vocab-parallel cross entropy counts each TP rank's copy).

The model is built as Megatron-LM's ``core_transformer_config_from_args`` and GPT model builder do: every args field
that is an ``MLATransformerConfig`` field is copied by name, then the renames (``norm_epsilon``, ``num_experts``,
``swiglu``, ...); the layer spec is ``get_gpt_decoder_block_spec(config, use_transformer_engine=False)`` and
``get_gpt_mtp_block_spec`` (local spec: ``SequentialMLP`` experts, allgather dispatcher).  CPU plumbing, which changes
no weight: CPU initialisation, fusions off, no dropout, no sequence parallelism, gathered logits, and the core
attention replaced by :class:`CPUCoreAttention` (the local spec's DotProductAttention refuses MLA's q/k dim != v dim).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mcore_cpu import prepare_cpu  # noqa: E402  (loopback, one thread, torch.cuda.current_device -> "cpu")

os.environ["TORCHDYNAMO_DISABLE"] = "1"
torch = prepare_cpu()
import torch.nn.functional as F  # noqa: E402

from mcore_dist_harness import (  # noqa: E402
    _cpu_shims, _die_with_parent, _reap_strays, init_expert_parallel, read_common, spawn_and_join)

ITERATION = 7
TRACKER = "latest_checkpointed_iteration.txt"
VOCAB, DIVISOR, SEQ = 200, 128, 12
INIT_STD = 0.15
NOISE_ROUTER = 0.3  # router logits far from ties: the top-k picks must not flip with fp32 rounding
NOISE_BIAS = 0.1
NOISE_1D = 0.1
OUTPUT_LAYER_SCALE = 0.25

#: Args a DeepSeek run records that change the model; the harness refuses a checkpoint whose args lack one
#: (megatron-core's MLATransformerConfig defaults, e.g. yarn with factor 40 and mscale_all_dim 0, would apply).
REQUIRED = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "norm_epsilon", "normalization",
    "swiglu", "add_bias_linear", "untie_embeddings_and_output_weights", "vocab_size", "max_position_embeddings",
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "qk_layernorm", "rope_type", "rotary_base", "rotary_percent", "rotary_scaling_factor",
    "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
    "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_score_function", "moe_layer_freq",
    "moe_router_pre_softmax", "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size", "moe_grouped_gemm",
)


#: The torch_dist keys of the Transformer Engine MLA spec (gpt_layer_specs.py: the q / kv LoRA norms fused into
#: linear_q_up_proj / linear_kv_up_proj, a dense layer's pre-MLP norm into mlp.linear_fc1) where the local spec has
#: separate norms; the local MLA spec has no keys map, so its own torch_dist keys differ.  Global shapes do not
#: depend on the spec (TE's duplicated down projections are one replicated chunk of the same global shape).
TE_KEYS = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
           "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}
TE_DENSE_KEYS = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


class CPUCoreAttention(torch.nn.Module):
    """Causal softmax attention in fp32 that takes MLA's k_channels / v_channels (q/k head dim != v head dim):
    ``[s, b, n, d]`` q/k/v -> softmax(q k^T * softmax_scale) v -> ``[s, b, n * dv]``.  It holds no state."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_):
        q, k, v = (t.permute(1, 2, 0, 3).float() for t in (query, key, value))  # [b, n, s, d]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        causal = torch.triu(torch.ones(scores.shape[-2:], dtype=torch.bool), 1)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), -1)
        out = torch.matmul(probs, v).to(value.dtype)  # [b, n, s, dv]
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def padded_vocab(vocab: int, divisor: int, tp: int) -> int:
    step = divisor * tp
    return -(-vocab // step) * step


def megatron_lm_args(kind: str, mtp: bool, tp: int, ep: int, etp: int) -> argparse.Namespace:
    """The args Megatron-LM records for a DeepSeek-style run of this model (``--multi-latent-attention
    --q-lora-rank .. --rope-type yarn --num-experts 16 --moe-layer-freq '[0,1,1]' ... --transformer-impl local
    --ckpt-format torch_dist``), every model-changing field spelled."""
    v3 = kind == "v3"
    world = max(tp, ep * etp)
    return argparse.Namespace(
        num_layers=3, hidden_size=64, ffn_hidden_size=48, num_attention_heads=4, group_query_attention=False,
        num_query_groups=1, kv_channels=16, max_position_embeddings=64, seq_length=64, vocab_size=VOCAB,
        padded_vocab_size=padded_vocab(VOCAB, DIVISOR, tp), make_vocab_size_divisible_by=DIVISOR,
        position_embedding_type="rope", use_rotary_position_embeddings=True, rotary_base=10000, rotary_percent=1.0,
        rotary_interleaved=False, use_rope_scaling=False, rotary_seq_len_interpolation_factor=None,
        normalization="RMSNorm", norm_epsilon=1e-6, apply_layernorm_1p=False, swiglu=True, add_bias_linear=False,
        add_qkv_bias=False, untie_embeddings_and_output_weights=True, init_method_std=INIT_STD,
        attention_dropout=0.0, hidden_dropout=0.0,
        # multi-latent attention and its yarn RoPE
        multi_latent_attention=True, q_lora_rank=24 if v3 else None, kv_lora_rank=16, qk_head_dim=8,
        qk_pos_emb_head_dim=4, v_head_dim=8, qk_layernorm=True, rope_type="yarn", rotary_scaling_factor=4.0,
        original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0, mscale=1.0 if v3 else 0.707,
        mscale_all_dim=1.0 if v3 else 0.707,
        # Mixture of Experts
        num_experts=16, moe_router_topk=4, moe_ffn_hidden_size=16, moe_layer_freq=[0, 1, 1],
        moe_shared_expert_intermediate_size=16 if v3 else 32, moe_shared_expert_gate=False,
        moe_router_score_function="sigmoid" if v3 else "softmax", moe_router_pre_softmax=not v3,
        moe_router_enable_expert_bias=v3, moe_router_bias_update_rate=1e-3,
        moe_router_num_groups=4 if v3 else None, moe_router_group_topk=2 if v3 else None,
        moe_router_topk_scaling_factor=2.5 if v3 else None, moe_router_dtype="fp32",
        moe_router_load_balancing_type="seq_aux_loss" if v3 else "aux_loss", moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", moe_permute_fusion=False,
        mtp_num_layers=1 if mtp else None, mtp_loss_scaling_factor=0.1,
        # parallelism / format / precision / bookkeeping
        world_size=world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, context_parallel_size=1, data_parallel_size=world // tp,
        sequence_parallel=tp > 1, transformer_impl="local", ckpt_format="torch_dist", no_save_optim=True,
        no_save_rng=True, params_dtype=torch.float32, bf16=False, fp16=False, iteration=ITERATION,
        consumed_train_samples=0, consumed_valid_samples=0, tokenizer_type="NullTokenizer",
    )


def build_model(args: argparse.Namespace, tp: int, ep: int, etp: int, init: bool, keys: str):
    """megatron-core's GPTModel of ``args`` at (tp, ep, etp), as Megatron-LM builds it (see the module docstring);
    ``keys="te"``: its torch_dist keys spelled as the Transformer Engine spec's (:data:`TE_KEYS`)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    missing = [k for k in REQUIRED if not hasattr(args, k)]
    if missing:
        raise SystemExit(f"the checkpoint's args lack {missing}: megatron-core's defaults would apply")
    if not args.multi_latent_attention or not args.swiglu or args.moe_grouped_gemm:
        raise SystemExit("this harness builds MLA models with SwiGLU SequentialMLP experts")
    get = lambda key, default=None: getattr(args, key, default)  # noqa: E731
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(MLATransformerConfig) if hasattr(args, f.name)}
    fields.update(  # Megatron-LM's core_transformer_config_from_args renames
        layernorm_epsilon=args.norm_epsilon, layernorm_zero_centered_gamma=get("apply_layernorm_1p", False),
        num_moe_experts=args.num_experts, rotary_interleaved=get("rotary_interleaved", False),
        num_query_groups=args.num_query_groups if get("group_query_attention") else None,
        activation_func=F.silu, gated_linear_unit=True, pipeline_dtype=get("params_dtype", torch.float32))
    fields.update(  # CPU / eval plumbing and the degrees this run loads at
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, sequence_parallel=False, context_parallel_size=1,
        use_cpu_initialization=True, perform_initialization=init, init_method_std=get("init_method_std", INIT_STD),
        attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, moe_token_dispatcher_type="allgather", moe_permute_fusion=False,
        moe_aux_loss_coeff=0.0)
    config = MLATransformerConfig(**fields)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization)
    for layer_spec in block.layer_specs:
        layer_spec.submodules.self_attention.submodules.core_attention = CPUCoreAttention
        if keys == "te":  # megatron-core's own mechanism (the GQA local spec does the same), before the MTP spec
            dense = not issubclass(layer_spec.submodules.mlp.module, MoELayer)
            layer_spec.submodules.sharded_state_dict_keys_map = {**TE_KEYS, **(TE_DENSE_KEYS if dense else {})}
    mtp = get_gpt_mtp_block_spec(config, block, use_transformer_engine=False) if get("mtp_num_layers") else None
    model = GPTModel(
        config=config, transformer_layer_spec=block,
        vocab_size=padded_vocab(args.vocab_size, get("make_vocab_size_divisible_by", 128), tp),
        max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
        parallel_output=False, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=get("position_embedding_type", "rope"), rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=get("use_rope_scaling", False), mtp_block_spec=mtp)
    model.eval()
    return model


def seed_model(model, args, seed: int) -> None:
    """Overwrite every replicated parameter and every routed expert with seeded draws made for the *global*
    tensor (one generator, the same draws on every rank; each rank keeps its part): norms 1 + noise, routers,
    the expert bias (non-zero), and each global expert in the logical layout (gate, up [I, H], down [H, I]),
    split over expert-TP as megatron-core does (fc1 = [gate_s; up_s], fc2 = down[:, s]).  TP-split dense weights
    keep megatron-core's seeded CPU initialisation (the full weight built on every rank, sliced)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_layer import MoELayer

    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    for name in sorted(params):
        p = params[name]
        if p.dim() == 1:
            assert not getattr(p, "tensor_model_parallel", False), name
            p.copy_(1.0 + NOISE_1D * torch.randn(p.shape, generator=gen))
    etp, etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    E, I, H = args.num_experts, args.moe_ffn_hidden_size, args.hidden_size
    i_loc = I // etp
    rows = slice(etp_rank * i_loc, (etp_rank + 1) * i_loc)
    moes = sorted((n, m) for n, m in model.named_modules() if isinstance(m, MoELayer))
    assert len(moes) == 2 + (1 if args.mtp_num_layers else 0), [n for n, _ in moes]
    for name, moe in moes:
        moe.router.weight.copy_(NOISE_ROUTER * torch.randn(E, H, generator=gen))
        bias = torch.randn(E, generator=gen) * NOISE_BIAS
        if args.moe_router_enable_expert_bias:
            moe.router.expert_bias.copy_(bias)
        local = list(moe.local_expert_indices)
        for g in range(E):
            gate, up = INIT_STD * torch.randn(I, H, generator=gen), INIT_STD * torch.randn(I, H, generator=gen)
            down = INIT_STD * torch.randn(H, I, generator=gen)
            if g in local:
                expert = moe.experts.local_experts[local.index(g)]
                expert.linear_fc1.weight.copy_(torch.cat([gate[rows], up[rows]]))
                expert.linear_fc2.weight.copy_(down[:, rows])
    model.output_layer.weight.mul_(OUTPUT_LAYER_SCALE)  # logits O(1)
    # The vocab padding rows: zero, as a conversion pads them.
    start = model.embedding.word_embeddings.vocab_start_index
    for weight in (model.embedding.word_embeddings.weight, model.output_layer.weight):
        weight[max(args.vocab_size - start, 0):].zero_()


def check_built(model, args) -> None:
    """The settings that make the model DeepSeek-like really are in the built model."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    layers = list(model.decoder.layers) + ([m.transformer_layer for m in model.mtp.layers] if model.mtp_process
                                           else [])
    freq = list(args.moe_layer_freq) + [1] * (len(layers) - args.num_layers)  # an MTP layer is MoE
    for layer, moe in zip(layers, freq):
        attn = layer.self_attention
        assert isinstance(attn, MLASelfAttention), type(attn)
        assert isinstance(attn.core_attention, CPUCoreAttention)
        assert hasattr(attn, "linear_q_down_proj") == bool(args.q_lora_rank)
        assert isinstance(layer.mlp, MoELayer) == bool(moe), (type(layer.mlp), moe)
        if moe:
            mlp = layer.mlp
            assert isinstance(mlp.experts, SequentialMLP)
            assert type(mlp.token_dispatcher).__name__ == "MoEAllGatherTokenDispatcher"
            assert (mlp.shared_experts is not None) == bool(args.moe_shared_expert_intermediate_size)
            assert (getattr(mlp.router, "expert_bias", None) is not None) == args.moe_router_enable_expert_bias
    c = model.config
    assert (c.rope_type, c.rotary_scaling_factor, c.mscale, c.mscale_all_dim) == (
        args.rope_type, args.rotary_scaling_factor, args.mscale, args.mscale_all_dim)
    assert (c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_score_function) == (
        args.moe_router_num_groups, args.moe_router_group_topk, args.moe_router_score_function)


def forward(model, args, input_ids: torch.Tensor) -> dict:
    """Logits (and, with MTP, the MTP layer's logits), on every rank, gathered over TP,
    cut to the true vocab; checked equal on every rank."""
    import torch.distributed as dist

    seq = input_ids.shape[1]
    position_ids = torch.arange(seq).unsqueeze(0).expand_as(input_ids)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1).view(1, 1, seq, seq)
    seen = []
    # clone: the loss computed with labels works on the logits in place
    hook = model.output_layer.register_forward_hook(lambda m, i, out: seen.append(out[0].detach().clone()))
    try:
        with torch.no_grad():
            model(input_ids, position_ids, mask, labels=input_ids if args.mtp_num_layers else None)
    finally:
        hook.remove()
    assert len(seen) == 1 + int(args.mtp_num_layers or 0), len(seen)
    vocab = args.vocab_size
    out = {"input_ids": input_ids, "logits": seen[-1].transpose(0, 1).float()[..., :vocab].contiguous()}
    if args.mtp_num_layers:  # GPTModel runs the output layer on each MTP layer's hidden states first
        out["mtp_logits"] = seen[0].transpose(0, 1).float()[..., :vocab].contiguous()
    for key, value in out.items():
        mine = value.clone()
        dist.broadcast(value, src=0)
        assert torch.isfinite(value.float()).all(), key
        spread = (mine.float() - value.float()).abs().max().item()
        assert spread <= 2e-6, f"rank {dist.get_rank()} {key} differs from rank 0's by {spread:.3g}"
    return out


def iteration_dir(ckpt: str) -> str:
    label = open(os.path.join(ckpt, TRACKER)).read().strip()
    return os.path.join(ckpt, "release" if label == "release" else f"iter_{int(label):07d}")


def run_save(cli) -> None:
    from mcore_moe_harness import dist_save

    args = megatron_lm_args(cli.kind, cli.mtp, cli.tp, cli.ep, cli.etp)
    torch.manual_seed(cli.seed)  # the same seed everywhere: CPU init builds the full weight on every rank
    model = build_model(args, cli.tp, cli.ep, cli.etp, init=True, keys=cli.keys)
    with torch.no_grad():
        seed_model(model, args, cli.seed + 1)
    check_built(model, args)
    if cli.ids:
        input_ids = torch.load(cli.ids, map_location="cpu", weights_only=True).long()
    else:
        input_ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(cli.seed + 2))
    result = forward(model, args, input_ids)
    dist_save(model, args, cli.out_dir, ITERATION, result)


def load_one(cli, ckpt: str, out: str, input_ids: torch.Tensor) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.validation import StrictHandling

    folder = iteration_dir(ckpt)
    if os.path.exists(os.path.join(folder, "metadata.json")):  # torch_dist
        common = read_common(folder)
        args = common["args"]
        model = build_model(args, cli.tp, cli.ep, cli.etp, init=False, keys=cli.keys)
        metadata = dict(common.get("content_metadata") or {})
        metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=metadata)}, folder,
                                         strict=StrictHandling.ASSUME_OK_UNEXPECTED)["model"]
    else:  # torch: this rank's own rank file
        tp_rank, ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
        name = f"mp_rank_{tp_rank:02d}" + (f"_{ep_rank:03d}" if cli.ep > 1 else "")
        torch.serialization.add_safe_globals([argparse.Namespace])
        blob = torch.load(os.path.join(folder, name, "model_optim_rng.pt"), map_location="cpu", weights_only=True)
        args = blob["args"]
        degrees = (args.tensor_model_parallel_size, args.expert_model_parallel_size,
                   args.expert_tensor_parallel_size or args.tensor_model_parallel_size)
        assert degrees == (cli.tp, cli.ep, cli.etp), f"{ckpt} holds tp/ep/etp {degrees}, not {cli.tp, cli.ep, cli.etp}"
        assert args.padded_vocab_size == padded_vocab(args.vocab_size, args.make_vocab_size_divisible_by, cli.tp)
        model = build_model(args, cli.tp, cli.ep, cli.etp, init=False, keys=cli.keys)
        loaded = blob["model"]
    result = model.load_state_dict(loaded, strict=True)  # raises, naming missing / unexpected keys
    assert not result.missing_keys and not result.unexpected_keys, result
    check_built(model, args)
    logits = forward(model, args, input_ids)
    if dist.get_rank() == 0:
        torch.save(logits, out)
    dist.barrier()


def run_load(cli) -> None:
    input_ids = torch.load(cli.ids, map_location="cpu", weights_only=True).long()
    for ckpt, out in zip(cli.pairs[::2], cli.pairs[1::2]):
        load_one(cli, ckpt, out, input_ids)


def worker(local_rank: int, cli, init_method: str) -> None:
    import torch.distributed as dist

    _die_with_parent()
    _cpu_shims()
    dist.init_process_group(backend="gloo", init_method=init_method, rank=local_rank, world_size=cli.world)
    try:
        import megatron.core.transformer.multi_latent_attention as mla
        from megatron.core import parallel_state
        # Without Transformer Engine its extension module still exports MagicMock placeholders, so MLA's
        # isinstance(linear_proj, TELinear) would raise: tell MLA there is no TE.
        mla.HAVE_TE = False
        init_expert_parallel(cli.tp, cli.ep, cli.etp)
        (run_save if cli.command == "save" else run_load)(cli)
        parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def run_ranks(cli) -> None:
    """Start the ranks over a file store and wait for all (:func:`mcore_dist_harness.spawn_and_join`)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="mcore_mla_harness_") as tmp:
        spawn_and_join(mp, worker, (cli, "file://" + os.path.join(tmp, "store")), cli.world)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    save = sub.add_parser("save", help="build, run and dist-save the model (+ reference.pt)")
    save.add_argument("out_dir")
    save.add_argument("--kind", choices=("v3", "v2"), default="v3")
    save.add_argument("--mtp", action="store_true", help="one multi-token-prediction layer (v3)")
    save.add_argument("--seed", type=int, default=4321)
    save.add_argument("--ids", help="a torch file holding a LongTensor [batch, seq] (default: seeded [1, 12])")
    load = sub.add_parser("load", help="load checkpoints strictly and write their logits")
    load.add_argument("--ids", required=True, help="a torch file holding a LongTensor [batch, seq]")
    load.add_argument("pairs", nargs="+", help="CKPT OUT.pt pairs")
    for p in (save, load):
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--ep", type=int, default=1)
        p.add_argument("--etp", type=int, default=None, help="expert tensor parallel (default: tp)")
        p.add_argument("--keys", choices=("te", "local"), default="te", help="torch_dist key spelling")
    cli = parser.parse_args()
    cli.etp = cli.tp if cli.etp is None else cli.etp
    cli.world = max(cli.tp, cli.ep * cli.etp)
    if cli.world % cli.tp or cli.world % (cli.ep * cli.etp) or cli.world > 2:
        parser.error(f"tp {cli.tp}, ep {cli.ep}, etp {cli.etp}: need max(tp, ep*etp) <= 2 divisible by both")
    if cli.ids:
        cli.ids = os.path.abspath(cli.ids)
    if cli.command == "save":
        cli.out_dir = os.path.abspath(cli.out_dir)
        os.makedirs(cli.out_dir, exist_ok=True)
        if cli.mtp and cli.kind != "v3":
            parser.error("--mtp is for --kind v3")
    else:
        if len(cli.pairs) % 2:
            parser.error("load takes CKPT OUT.pt pairs")
        cli.pairs = [os.path.abspath(p) for p in cli.pairs]
    try:  # orphans below this process re-parent to it, so _reap_strays finds them
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass
    try:
        run_ranks(cli)
    finally:
        from multiprocessing import resource_tracker

        tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
        strays = _reap_strays({tracker} if tracker else set())
        if strays:
            print(f"mcore_mla_harness: killed stray processes {strays}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
