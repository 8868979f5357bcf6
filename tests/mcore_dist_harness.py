"""megatron-core's own ``torch_dist`` checkpoints (the Megatron-LM default format), written and read on the CPU.

Run as::

    python tests/mcore_dist_harness.py save OUT_DIR --tp T --pp P [--tied] [--qkv-bias] [--seed N]
    python tests/mcore_dist_harness.py load CKPT_DIR OUT.pt --tp T [--pp P] [--ids IDS.pt]

The script spawns ``T*P`` ranks itself (torch.multiprocessing, gloo, rendezvous through a file store in a private
temporary folder: no TCP store, gloo on the loopback interface only) and waits for all of them; a rank that fails
makes the script exit non-zero with that rank's traceback.

``save`` builds a tiny Llama-like megatron-core ``GPTModel`` (local layer spec, GQA 8 heads / 2 groups, hidden 64,
FFN 160, 4 layers, SwiGLU, RMSNorm, RoPE, fp32, vocab 1000 padded to a multiple of 128*T, untied unless
``--tied``, ``add_qkv_bias`` with ``--qkv-bias``) from a seed, and saves it the way Megatron-LM's training loop does
with ``--ckpt-format torch_dist`` (MLM core_v0.16.1 ``save_checkpoint`` / ``generate_state_dict``): the state dict
``{"args", "checkpoint_version": 3.0, "iteration": 7, "model": model.sharded_state_dict(metadata), "rng_state":
ShardedObject, "num_floating_point_operations_so_far": 0}`` goes through ``dist_checkpointing.save`` with the
default ``torch_dist`` strategy wrapped in ``FullyParallelSaveStrategyWrapper`` over the data-parallel group
(``--ckpt-fully-parallel-save``, Megatron-LM's default) and ``content_metadata={"singleton_local_shards": False,
"chained_optim_avoid_prefix": True}``.  It writes::

    OUT_DIR/latest_checkpointed_iteration.txt     "7"
    OUT_DIR/iter_0000007/                          metadata.json, common.pt, .metadata, __{rank}_{i}.distcp
    OUT_DIR/reference.pt                           {"input_ids": [2, 16], "logits": [2, 16, 1000] fp32}

The weights do not depend on the pipeline split: every rank first builds the whole model at PP=1 (same TP, the
P pipeline groups become data-parallel replicas) from the seed, computes the reference logits with it, then
builds its pipeline stage and copies the stage's parameters from that model by name (local layer ``i`` of stage
``k`` <- global layer ``layer_number - 1``; a tied last stage's ``output_layer.weight`` <- the embedding).  The
harness checks that the stages together copied every parameter of the whole model exactly once and that the
staged model, run as a pipeline (stage to stage with send/recv), reproduces the reference logits.  So one seed
(and the same flags) gives the same logical model at every TP and PP, as megatron's CPU initialisation already
does across TP.

``load`` builds the same architecture at TP=T, PP=P from ``common.pt``'s ``args`` (read with ``weights_only=True``;
the vocab padding is recomputed for T, as Megatron-LM does), loads the iteration named by the tracker with
``dist_checkpointing.load({"model": model.sharded_state_dict(content_metadata)}, ...,
strict=StrictHandling.ASSUME_OK_UNEXPECTED)`` (Megatron-LM's default strictness), then
``model.load_state_dict(..., strict=True)``, runs the forward on ``--ids`` (a LongTensor [batch, seq]) or, without
it, on ``CKPT_DIR/reference.pt``'s ids, and rank 0 writes ``OUT.pt = {"input_ids", "logits"}`` (fp32, gathered,
restricted to ``args.vocab_size``).  The local spec is always built: its on-disk keys are the Transformer Engine
ones (norms as ``layer_norm_weight``), so a folder meant for a TE model loads the same way.

CPU shims (none changes what is written): ``torch.cuda.current_device`` -> "cpu", no-op
``torch.cuda.synchronize``, ``Tensor.cuda`` -> identity (the tied-embedding PP sync moves the weight ``.cuda()``),
``psutil`` only for megatron's memory log line (stubbed when absent), an explicit causal mask, and the
results queue of megatron's writer comes from a Manager the rank owns (and shuts down) and that dies with it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mcore_cpu import prepare_cpu  # noqa: E402  (loopback, one thread, torch.cuda.current_device -> "cpu")

torch = prepare_cpu()
import torch.nn.functional as F  # noqa: E402
# Same sizes and vocab rule as the legacy-format harness; args -> model defaults as the args harness.
from mcore_args_harness import MEGATRON_LM_DEFAULTS, args_getter, config_from_args, iteration_dir  # noqa: E402
from megatron_core_harness import (  # noqa: E402
    BATCH,
    FFN_HIDDEN,
    HIDDEN,
    INIT_STD,
    KV_CHANNELS,
    MAKE_VOCAB_DIVISIBLE_BY,
    MAX_POSITIONS,
    NORM_EPS,
    NUM_HEADS,
    NUM_QUERY_GROUPS,
    OUTPUT_LAYER_SCALE,
    ROTARY_BASE,
    SEQ_LENGTH,
    TRUE_VOCAB,
    padded_vocab,
)

NUM_LAYERS = 4
ITERATION = 7
TRACKER = "latest_checkpointed_iteration.txt"
#: What MLM core_v0.16.1 ``_build_sharded_state_dict_metadata`` returns without a distributed optimizer, less
#: ``dp_cp_group`` (``_clean_metadata_for_serialization``): the ``content_metadata`` stored in common.pt.
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the process (thread) that started it exits, so nothing outlives a rank."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _children(pid: int) -> list[int]:
    """Live (non-zombie) processes whose parent is ``pid`` (Linux /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(entry))
    return kids


def _reap_strays(keep: set[int]) -> list[int]:
    """SIGKILL and reap every process still under this one, except ``keep``; returns the pids killed.

    With PR_SET_CHILD_SUBREAPER set in ``main``, a process orphaned below this one (megatron's forked writers
    of a rank killed mid-save, say) is re-parented here rather than to init, so this finds it.
    """
    import signal

    killed = []
    for pid in _children(os.getpid()):
        if pid in keep:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        killed.append(pid)
    while True:  # and reap what died here unreaped (orphans that exited on their own)
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
    return killed


def init_expert_parallel(tp: int, ep: int, etp: int) -> None:
    """megatron-core's model-parallel state at TP ``tp``, EP ``ep``, expert-TP ``etp`` (PP 1) on CPU: the MoE
    module's missing Transformer Engine GEMM set to None, the inference RNG tracker instead of the CUDA seed."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                             expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)


def cpu_eval_fields(tp: int, ep: int, etp: int, **extra) -> dict:
    """TransformerConfig fields of a CPU evaluation run at these degrees (no fusions, no dropout, parameters from the
    checkpoint, the allgather MoE dispatcher), then ``extra``."""
    return dict(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, sequence_parallel=False, context_parallel_size=1,
        use_cpu_initialization=True, perform_initialization=False, attention_dropout=0.0, hidden_dropout=0.0,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        moe_token_dispatcher_type="allgather", moe_permute_fusion=False, moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False, **extra)


def _cpu_shims() -> None:
    if torch.cuda.is_available():
        return
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    # LanguageModule.setup_embeddings_and_output_layer (tied embeddings, PP>1) does weight.data.cuda().
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment]
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not filesystem_async.HAVE_PSUTIL:  # used only for a debug log line of the process RSS
        filesystem_async._process_memory = lambda: 0


def make_args(tp: int, pp: int, tied: bool, qkv_bias: bool) -> argparse.Namespace:
    """The Megatron-LM ``args`` of a run that trains this model (what ``common.pt['args']`` holds)."""
    return argparse.Namespace(
        # architecture
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN_HIDDEN,
        num_attention_heads=NUM_HEADS,
        group_query_attention=True,
        num_query_groups=NUM_QUERY_GROUPS,
        kv_channels=KV_CHANNELS,
        padded_vocab_size=padded_vocab(TRUE_VOCAB, MAKE_VOCAB_DIVISIBLE_BY, tp),
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
        rotary_seq_len_interpolation_factor=None,
        apply_residual_connection_post_layernorm=False,
        window_size=None,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias,
        untie_embeddings_and_output_weights=not tied,
        max_position_embeddings=MAX_POSITIONS,
        seq_length=SEQ_LENGTH,
        num_experts=None,
        init_method_std=INIT_STD,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        transformer_impl="local",
        # parallelism / checkpointing
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        sequence_parallel=False,
        data_parallel_size=1,
        world_size=tp * pp,
        use_distributed_optimizer=False,
        ckpt_format="torch_dist",
        use_dist_ckpt=True,
        ckpt_fully_parallel_save=True,
        dist_ckpt_strictness="assume_ok_unexpected",
        no_save_optim=True,  # no optimizer state in the fixture: a resume must not ask for one
        no_save_rng=False,
        # precision
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        # bookkeeping
        iteration=ITERATION,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        tokenizer_type="NullTokenizer",
    )


def build_model(args: argparse.Namespace, tp: int, pp: int):
    """GPTModel of ``args`` for this rank's stage of the current ``parallel_state`` (TP ``tp``, PP ``pp``)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    get = args_getter(args, set())
    if get("num_experts"):
        raise SystemExit("MoE args (num_experts) are not supported by this harness")
    if not get("swiglu"):
        raise SystemExit("args.swiglu is False: only SwiGLU models are supported by this harness")
    for key in ("softmax_type", "attention_output_gate", "multi_latent_attention", "window_size",
                "apply_residual_connection_post_layernorm", "use_rope_scaling", "qk_l2_norm"):
        if get(key) != MEGATRON_LM_DEFAULTS.get(key):
            raise SystemExit(f"args.{key} = {get(key)!r} is not supported by this harness")
    # As Megatron-LM's core_transformer_config_from_args for a dense GPT, at the degrees this run loads at.
    config = config_from_args(
        get, attention_softmax_in_fp32=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=get("params_dtype"),  # Megatron-LM: args.params_dtype
        perform_initialization=True, init_method_std=getattr(args, "init_method_std", INIT_STD))
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=get("normalization"),
                                                        qk_layernorm=get("qk_layernorm")),
        # Megatron-LM pads the vocab for the *running* TP degree, whatever the checkpoint's args say.
        vocab_size=padded_vocab(get("vocab_size"), getattr(args, "make_vocab_size_divisible_by", 128), tp),
        max_sequence_length=get("max_position_embeddings"),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=False,  # gather the vocab-parallel logits on every rank
        share_embeddings_and_output_weights=not get("untie_embeddings_and_output_weights"),
        position_embedding_type=get("position_embedding_type"),
        rotary_percent=get("rotary_percent"),
        rotary_base=get("rotary_base"),
    )
    model.eval()
    return model


def forward_logits(model, input_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Run the pipeline by hand (stage to stage with send/recv); every rank returns the last stage's logits
    ``[b, s, vocab]`` (fp32, gathered over TP, restricted to the first ``vocab`` columns)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    batch, seq = input_ids.shape
    position_ids = torch.arange(seq, dtype=torch.long).unsqueeze(0).expand(batch, -1)
    # megatron-core's default causal mask is built on CUDA: pass an explicit one (True = masked out).
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    with torch.no_grad():
        if not first:
            hidden = torch.empty(seq, batch, model.config.hidden_size, dtype=model.config.params_dtype)
            dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(input_ids if first else None, position_ids, mask)
        if not last:
            dist.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())

    # Share TP rank 0 of the last stage's logits with every rank.
    is_src = last and parallel_state.get_tensor_model_parallel_rank() == 0
    src = torch.tensor([dist.get_rank() if is_src else -1])
    dist.all_reduce(src, op=dist.ReduceOp.MAX)
    if last:
        assert out.shape[:2] == (batch, seq), out.shape
        logits = out.float()[..., :vocab].contiguous()
    else:
        logits = torch.empty(batch, seq, vocab, dtype=torch.float32)
    mine = logits.clone()
    dist.broadcast(logits, src=int(src.item()))
    if last:  # every last-stage TP rank gathered the same logits: catches a broken gather
        assert torch.equal(mine, logits), "last-stage ranks disagree on the gathered logits"
    assert torch.isfinite(logits).all()
    return logits


def rng_state_object():
    """``rng_state`` as MLM's ``get_rng_state(ckpt_format="torch_dist")`` builds it (DP=1, no EP).

    There is no CUDA generator on the CPU: ``cuda_rng_state`` holds the CPU generator state instead (a ByteTensor
    as well); the inference RNG tracker has no states.
    """
    import random

    import numpy as np
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    return ShardedObject(
        "rng_state",
        [state],
        (parallel_state.get_pipeline_model_parallel_world_size(),
         parallel_state.get_tensor_model_parallel_world_size()),
        (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )


def _seed_model(model, seed: int, tied: bool) -> None:
    """Noise on every 1-D parameter, a smaller output layer, zero embedding padding rows (identical per rank)."""
    with torch.no_grad():
        # Norm weights start at 1 and biases at 0: give every 1-D parameter seeded noise so a norm or bias
        # mapping mistake shows.  2-D weights come from megatron's own seeded CPU init.
        # A TP-sharded 1-D parameter (the QKV bias) draws the noise of its whole global tensor and keeps its
        # slice, as megatron's CPU init does for weights: the same logical model at every TP, distinct shards.
        from megatron.core import parallel_state

        tp = parallel_state.get_tensor_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in sorted(model.named_parameters()):
            if p.dim() != 1:
                continue
            if getattr(p, "tensor_model_parallel", False):
                assert p.partition_dim == 0 and getattr(p, "partition_stride", 1) == 1, name
                n = p.shape[0]
                p.add_(0.3 * torch.randn(n * tp, generator=gen, dtype=p.dtype)[tp_rank * n:(tp_rank + 1) * n])
            else:
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        if not tied:  # keep the logits O(1) (see megatron_core_harness.OUTPUT_LAYER_SCALE)
            model.output_layer.weight.mul_(OUTPUT_LAYER_SCALE)
        # Embedding rows past the true vocab are never looked up; zero them, as a converter padding the vocab
        # writes them (with tied embeddings they are also the output layer's padding rows).
        emb = model.embedding.word_embeddings
        lo = max(TRUE_VOCAB - emb.vocab_start_index, 0)
        if lo < emb.weight.shape[0]:
            emb.weight[lo:].zero_()


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _copy_stage_from_full(stage, full_params: dict[str, torch.Tensor], tied: bool) -> list[str]:
    """Copy a pipeline stage's parameters from the whole model's (same TP slice); returns the source names."""
    offset = stage.decoder.layers[0].layer_number - 1 if len(stage.decoder.layers) else 0
    used = []
    with torch.no_grad():
        for name, p in stage.named_parameters():
            src = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)
            if tied and src == "output_layer.weight":  # the last stage's copy of the shared embedding
                src = "embedding.word_embeddings.weight"
            ref = full_params[src]
            assert ref.shape == p.shape and ref.dtype == p.dtype, (name, src, ref.shape, p.shape)
            p.copy_(ref)
            used.append(src)
    return used


def run_save(cli: argparse.Namespace) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    rank = dist.get_rank()
    tp, pp = cli.tp, cli.pp
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)

    # 1. The whole model at PP=1 (the P pipeline groups are data-parallel replicas here): reference logits.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    args = make_args(tp, pp, cli.tied, cli.qkv_bias)
    torch.manual_seed(cli.seed)  # same seed everywhere: CPU init builds the full weight on every rank
    full = build_model(args, tp, 1)
    _seed_model(full, cli.seed, cli.tied)
    gen = torch.Generator().manual_seed(cli.seed + 2)
    input_ids = torch.randint(0, TRUE_VOCAB, (BATCH, SEQ_LENGTH), generator=gen, dtype=torch.long)
    reference = forward_logits(full, input_ids, TRUE_VOCAB)

    if pp == 1:
        model = full
    else:
        # 2. This rank's pipeline stage, its parameters copied from the whole model.
        full_params = {k: v.detach().clone() for k, v in full.named_parameters()}
        del full
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        torch.manual_seed(cli.seed)
        model = build_model(args, tp, pp)
        used = _copy_stage_from_full(model, full_params, cli.tied)
        # Together the stages of one TP rank copied every parameter of the whole model exactly once.
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (parallel_state.get_tensor_model_parallel_rank(), used))
        mine = parallel_state.get_tensor_model_parallel_rank()
        copied = sorted(n for t, names in everyone if t == mine for n in names)
        expected = sorted(full_params)
        if cli.tied:  # the shared embedding is copied twice: by the first stage and by the last
            expected = sorted(expected + ["embedding.word_embeddings.weight"])
        assert copied == expected, (set(copied) ^ set(expected))
        staged = forward_logits(model, input_ids, TRUE_VOCAB)
        err = (staged - reference).abs().max().item()
        assert err <= 1e-6, f"pipeline-staged model differs from the whole model: max |logit diff| {err:.3g}"

    # 3. Save as Megatron-LM's save_checkpoint does with --ckpt-format torch_dist.
    dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    sharded_sd_metadata = dict(CONTENT_METADATA, dp_cp_group=dp_cp_group)
    state_dict = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": ITERATION,
        "model": model.sharded_state_dict(metadata=sharded_sd_metadata),
        "rng_state": rng_state_object(),
        "num_floating_point_operations_so_far": 0,
    }
    ckpt_dir = os.path.join(cli.out_dir, f"iter_{ITERATION:07d}")
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), dp_cp_group, False)

    # megatron's writer sends its results through a queue of a spawned Manager it starts once per process and
    # never stops; start that Manager here instead, tied to this rank's life, and stop it after the save.
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=_die_with_parent)
    try:
        filesystem_async._results_queue = manager.Queue()
        dist_checkpointing.save(
            state_dict,
            ckpt_dir,
            strategy,
            async_sharded_save=False,
            validate_access_integrity=True,
            content_metadata=dict(CONTENT_METADATA),
        )
        dist.barrier()
    finally:
        filesystem_async._results_queue = None
        manager.shutdown()

    if rank == 0:
        with open(os.path.join(cli.out_dir, TRACKER), "w") as f:
            f.write(str(ITERATION))
        torch.save({"input_ids": input_ids, "logits": reference}, os.path.join(cli.out_dir, "reference.pt"))
    dist.barrier()
    parallel_state.destroy_model_parallel()


def read_common(ckpt_iter_dir: str) -> dict:
    torch.serialization.add_safe_globals([argparse.Namespace])
    return torch.load(os.path.join(ckpt_iter_dir, "common.pt"), map_location="cpu", weights_only=True)


def run_load(cli: argparse.Namespace) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.validation import StrictHandling

    tp, pp = cli.tp, cli.pp
    ckpt_iter_dir = iteration_dir(cli.ckpt_dir)
    common = read_common(ckpt_iter_dir)
    args = common["args"]

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
    torch.manual_seed(0)
    model = build_model(args, tp, pp)

    metadata = dict(common.get("content_metadata") or {})
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    loaded = dist_checkpointing.load(
        {"model": model.sharded_state_dict(metadata=metadata)},
        ckpt_iter_dir,
        strict=StrictHandling.ASSUME_OK_UNEXPECTED,
    )
    result = model.load_state_dict(loaded["model"], strict=True)  # raises, naming missing/unexpected keys
    assert not result.missing_keys and not result.unexpected_keys, result

    if cli.ids:
        input_ids = torch.load(cli.ids, map_location="cpu", weights_only=True)
    else:
        ref = os.path.join(cli.ckpt_dir, "reference.pt")
        if not os.path.exists(ref):
            raise SystemExit(f"no --ids given and no {ref}")
        input_ids = torch.load(ref, map_location="cpu", weights_only=True)["input_ids"]
    input_ids = input_ids.long()
    logits = forward_logits(model, input_ids, args.vocab_size)
    if dist.get_rank() == 0:
        torch.save({"input_ids": input_ids, "logits": logits}, cli.out)
    dist.barrier()
    parallel_state.destroy_model_parallel()


def worker(local_rank: int, cli: argparse.Namespace, init_method: str) -> None:
    import torch.distributed as dist

    _die_with_parent()
    _cpu_shims()
    dist.init_process_group(backend="gloo", init_method=init_method, rank=local_rank, world_size=cli.tp * cli.pp)
    try:
        (run_save if cli.command == "save" else run_load)(cli)
    finally:
        dist.destroy_process_group()


def spawn_and_join(mp, target, args: tuple, nprocs: int) -> None:
    """``mp.spawn(target, args, nprocs, join=True)``, but a rank killed by a signal cannot make it wait forever.

    ``ProcessContext.join`` watches each rank's sentinel pipe, which the rank's forked children (megatron's
    checkpoint writers) inherit: a rank killed mid-save with a writer left behind would never be seen to exit.
    So the exit codes are polled as well.  A rank that fails with a Python error is reported by ``join`` itself,
    with its traceback; when a rank fails, the others are stopped.
    """
    import time

    context = mp.start_processes(target, args=args, nprocs=nprocs, join=False, start_method="spawn")
    while not context.join(timeout=1.0):
        failed = [(i, p.exitcode) for i, p in enumerate(context.processes) if p.exitcode not in (None, 0)]
        if not failed:
            continue
        deadline = time.monotonic() + 3.0  # let join() report it if it can (it carries the traceback)
        while time.monotonic() < deadline:
            if context.join(timeout=0.5):
                return
        for p in context.processes:
            if p.is_alive():
                p.kill()
            p.join()
        raise RuntimeError(f"rank(s) exited abnormally (rank, exit code): {failed}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    save = sub.add_parser("save", help="build, run and save a torch_dist checkpoint (+ reference logits)")
    save.add_argument("out_dir")
    save.add_argument("--tp", type=int, required=True)
    save.add_argument("--pp", type=int, default=1)
    save.add_argument("--tied", action="store_true", help="share the embedding and output weights")
    save.add_argument("--qkv-bias", action="store_true", help="add_qkv_bias=True")
    save.add_argument("--seed", type=int, default=1234)
    load = sub.add_parser("load", help="load a torch_dist checkpoint strictly and write its logits")
    load.add_argument("ckpt_dir", help="the folder holding latest_checkpointed_iteration.txt")
    load.add_argument("out", help="where rank 0 writes {'input_ids', 'logits'}")
    load.add_argument("--tp", type=int, required=True)
    load.add_argument("--pp", type=int, default=1)
    load.add_argument("--ids", help="a torch file holding a LongTensor [batch, seq] (default: CKPT_DIR/reference.pt)")
    cli = parser.parse_args()
    if cli.tp < 1 or cli.pp < 1 or (cli.command == "save" and NUM_LAYERS % cli.pp):
        parser.error(f"need tp >= 1 and pp >= 1 (dividing the {NUM_LAYERS} layers for save)")
    for attr in ("out_dir", "ckpt_dir", "out", "ids"):
        if getattr(cli, attr, None):
            setattr(cli, attr, os.path.abspath(getattr(cli, attr)))
    if cli.command == "save":
        os.makedirs(cli.out_dir, exist_ok=True)

    import tempfile

    import torch.multiprocessing as mp

    # The ranks rendezvous through a file store in a private folder: nothing listens on a network interface
    # except gloo's own sockets, on the loopback interface.  spawn_and_join returns only once every rank has
    # exited; when one fails it stops the others and raises (with the rank's traceback when it has one).
    try:  # orphans below this process re-parent to it (see _reap_strays)
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass
    try:
        with tempfile.TemporaryDirectory(prefix="mcore_dist_harness_") as tmp:
            init_method = "file://" + os.path.join(tmp, "store")
            spawn_and_join(mp, worker, (cli, init_method), cli.tp * cli.pp)
    finally:
        # The ranks are joined; what is left is multiprocessing's resource tracker (it exits when this process
        # does) and, after a failure, strays.
        from multiprocessing import resource_tracker

        tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
        strays = _reap_strays({tracker} if tracker else set())
        if strays:
            print(f"mcore_dist_harness: killed stray processes {strays}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
