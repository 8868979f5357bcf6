"""Writing a Megatron-Core ``torch`` checkpoint: the ``args`` Namespace built from the canonical config (padded vocab,
parallel degrees, the source's own args kept where it had them), each rank's ``model_optim_rng.pt`` planned from
:func:`.megatron_ranks.rank_tensors` over the TP x PP (x EP, expert TP) grid after the degrees are checked against the
model's split dimensions, then ``latest_checkpointed_iteration.txt`` and the HF ``config.json`` beside it."""

from __future__ import annotations

import argparse
import collections
import os
from dataclasses import dataclass

from reshard.core.canonical import CanonicalModel
from reshard.core.model_config import ConfigLoss
from reshard.core.sharding import check_megatron_degrees, megatron_padded_vocab, stage_layers
from reshard.errors import PlanError
from reshard.io import dtypes
from reshard.io.partial import replace_with_text
from reshard.io.torch_format import MegatronEnum, TensorSlot, torch_dtype_global
from reshard.layouts.base import Options, Source, TargetSpec
from reshard.layouts import gpt_oss_rules
from reshard.layouts.hf import write_config
from reshard.layouts.hf_config import write_config as write_hf_config
from reshard.layouts.megatron_folders import TRACKER, iteration_folder_name
from reshard.layouts.megatron_args import args_from_meaning
from reshard.layouts import gdn_rules, mamba_rules
from reshard.layouts import llama4_rules
from reshard.layouts.expert_tp import expert_tp, expert_tp_notes
from reshard.layouts import ministral3_rules
from reshard.layouts.vision import check_megatron_tower, megatron_vision, tower_views
from reshard.layouts.megatron_ranks import RANK_FILE, ExpertGrid, extra_state_names, rank_dir, rank_tensors
from reshard.mapping_vlm import nested


def build_args(model: CanonicalModel, opts: Options, padded: int, divisor: int, dtype: str,
               base: argparse.Namespace | None, loss: ConfigLoss) -> argparse.Namespace:
    """A faithful Megatron-LM ``args`` for the output (so ``--use-checkpoint-args`` works): the meaning's fields
    (:func:`~reshard.layouts.megatron_args.args_from_meaning`; what args cannot spell goes to ``loss``), the
    degrees, and the source run's other args when it was a Megatron run."""
    values = {}
    if base is not None:  # keep the run's own args; enum stand-ins cannot be written back without Megatron
        values = {k: v for k, v in vars(base).items() if not isinstance(v, MegatronEnum)}
    values.update(args_from_meaning(model.meaning, loss), **llama4_rules.megatron_args(model.meaning))
    if model.num_experts:
        values["moe_grouped_gemm"] = opts.moe_grouped_gemm
    values.update(gdn_rules.megatron_args(model), **mamba_rules.megatron_args(model))
    record = nested(write_hf_config(model.meaning, model.config, model.family, ConfigLoss("record")))
    record["dtype" if "dtype" in record else "torch_dtype"] = dtypes.hf_config_dtype(dtype)
    values.update(
        padded_vocab_size=padded, make_vocab_size_divisible_by=divisor,
        tensor_model_parallel_size=opts.tp, pipeline_model_parallel_size=opts.pp,
        virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=opts.ep,
        expert_tensor_parallel_size=expert_tp(opts, model) if model.num_experts else None,
        world_size=opts.pp * max(opts.tp, opts.ep * expert_tp(opts, model)),
        data_parallel_size=max(opts.tp, opts.ep * expert_tp(opts, model)) // opts.tp, seq_length=values.get("seq_length") or model.meaning.max_positions,
        params_dtype=torch_dtype_global(dtype), bf16=dtype == "BF16", fp16=dtype == "F16",
        transformer_impl="transformer_engine" if opts.megatron_spec == "te" else "local",
        apply_query_key_layer_scaling=False, attention_softmax_in_fp32=True, hf_config=record,
    )
    values.setdefault("tokenizer_type", "HuggingFaceTokenizer")
    return argparse.Namespace(**values)


@dataclass
class OutputArgs:
    """What both Megatron formats record about their output: the args, the vocab padded for the target tp, the
    iteration label and its folder, and notes (config fields dropped with --allow-lossy-config)."""

    args: argparse.Namespace
    padded: int
    iteration: str
    folder: str
    notes: list[str]


def output_args(source: Source, opts: Options, dtype: str) -> OutputArgs:
    """Plan the recorded args of a Megatron output (either format): refuses degrees the model cannot have, a bad
    vocab divisor and config fields the args cannot spell. A Megatron source (torch or torch_dist) keeps its
    run's other args and its iteration; any other source gives ``release``."""
    model = source.model
    if opts.vocab_divisor is not None and opts.vocab_divisor < 1:
        raise PlanError(f"--make-vocab-size-divisible-by must be a positive integer (got {opts.vocab_divisor}); "
                        "Megatron pads the vocab to a multiple of it times tp (default 128)")
    gdn_rules.check_megatron_target(model, opts.megatron_spec, opts.tp)
    mamba_rules.check_degrees(model, opts.tp)
    check_megatron_degrees(model, opts.tp, opts.pp)
    check_split_dims(model, opts.tp, "megatron_local" if opts.megatron_spec == "local" else "megatron")
    check_megatron_tower(model, opts)
    check_expert_degrees(model, opts)
    llama4_rules.check_megatron_target(model, opts.max_seq)
    ministral3_rules.check_megatron_target(model, opts.max_seq)
    divisor = opts.vocab_divisor or source.info.get("vocab_divisor") or 128
    padded = megatron_padded_vocab(model.vocab_size, opts.tp, divisor)
    iteration = source.info.get("iteration", "release")
    loss = ConfigLoss("Megatron", opts.allow_lossy_config)
    args = build_args(model, opts, padded, divisor, dtype, source.info.get("args"), loss)
    return OutputArgs(args, padded, iteration, iteration_folder_name(iteration),
                      loss.check() + gdn_rules.offset_notes(model) + expert_tp_notes(model, opts))


def targets(model: CanonicalModel, opts: Options, source: Source, dtype: str
            ) -> tuple[list[TargetSpec], str, list[str]]:
    """Rank files for Megatron at ``opts.tp`` x ``opts.pp``; also returns the iteration label :func:`finalize`
    writes into the tracker, and notes (config fields dropped with --allow-lossy-config)."""
    if opts.megatron_spec not in ("te", "local"):
        raise PlanError(f"unknown --megatron-spec '{opts.megatron_spec}': use te or local")
    run = output_args(source, opts, dtype)
    padded, iteration, folder, args = run.padded, run.iteration, run.folder, run.args
    args.ckpt_format = "torch"  # a torch_dist source's run said torch_dist
    specs = []
    stages = stage_layers(model.num_layers, opts.pp)
    ep, etp = opts.ep, expert_tp(opts, model)
    if opts.moe_grouped_gemm and not model.num_experts:
        raise PlanError("--moe-grouped-gemm is for Mixture-of-Experts models")
    vision = megatron_vision(model, opts.megatron_vision)
    views = tower_views(model, opts.megatron_spec, vision)
    for p, layers in enumerate(stages):
        for e, t in ((e, t) for e in range(ep) for t in range(opts.tp)):
            tensors = rank_tensors(model, opts.tp, t, list(layers), p == 0, p == opts.pp - 1,
                                   opts.megatron_spec, padded, ExpertGrid(ep, etp, e, opts.moe_grouped_gemm), vision)
            state = collections.OrderedDict((s.name, TensorSlot(s.name, "", (), views.get(s.name))) for s in tensors)
            mtp = len(model.mtp_layers) if p == opts.pp - 1 else 0
            for name in extra_state_names(model.family, opts.megatron_spec, len(layers), list(state), mtp,
                                          vision):
                state[name] = None
            payload = {"args": args, "checkpoint_version": 3.0,
                       "iteration": 0 if iteration == "release" else int(iteration), "model": state}
            specs.append(TargetSpec(f"{folder}/{rank_dir(t, p, opts.pp, e, ep)}/{RANK_FILE}", "torch", tensors,
                                    payload=payload, rank={"tp": t, "pp": p, "ep": e}))
    return specs, iteration, run.notes


def check_split_dims(model: CanonicalModel, tp: int, kind_in: str) -> None:
    """Refuse a tp that does not divide the split dimension of a column / row weight outside experts (MLA's
    q / kv projections: whole heads; the local spec's down projections: plain row blocks)."""
    for spec in model.family.weights:
        kind = spec.split_in(kind_in)
        if kind not in ("column", "row") or spec.per_expert or spec.tower or not model.has_spec(spec):
            continue
        size = model.family.shape_of(spec, model.dims)[spec.axis]
        if size % tp:
            raise PlanError(f"{spec.hf} has {size} {'rows' if kind == 'column' else 'columns'}, which do not split "
                            f"over tp={tp} ({'Megatron local spec' if kind_in == 'megatron_local' else 'Megatron'}); "
                            f"choose a tp dividing {size}")


def check_expert_degrees(model: CanonicalModel, opts: Options) -> None:
    """Refuse expert-parallel degrees Megatron-Core cannot hold this model at, before anything is written."""
    ep, etp = opts.ep, expert_tp(opts, model)
    gpt_oss_rules.check_expert_tp(model.meaning, etp)
    if ep < 1 or etp < 1:
        raise PlanError(f"--ep and --etp must be >= 1 (got ep={ep}, etp={etp})")
    if not model.num_experts:
        if ep > 1 or opts.etp not in (None, opts.tp):
            raise PlanError(f"--ep / --etp are for Mixture-of-Experts models; {model.meaning.architecture} is dense")
        return
    if model.num_experts % ep:
        raise PlanError(f"{model.num_experts} experts do not split over ep={ep}: Megatron needs experts % ep == 0; "
                        f"choose an ep that divides {model.num_experts}")
    if opts.tp % etp:
        raise PlanError(f"--etp {etp} must divide --tp {opts.tp}: Megatron's torch format names rank folders by the "
                        "dense TP rank, so an expert-TP degree above it (or not dividing it) has no folder")
    ffn = model.meaning.expert_ffn
    if ffn % etp:
        raise PlanError(f"expert intermediate size {ffn} does not split over etp={etp}; choose an etp dividing it")
    shared = model.meaning.shared_expert_ffn
    if shared and shared % opts.tp:
        raise PlanError(f"shared-expert intermediate size {shared} does not split over tp={opts.tp}")


def finalize(out: str, iteration: str, hf_config: dict | None) -> None:
    """Write ``config.json`` (the Hugging Face config the args record, so that tools which take a model folder
    with a config, such as vLLM with ``load_format="reshard"``, can open the output), then the tracker file last:
    its presence marks the checkpoint complete."""
    if hf_config:
        write_config(out, hf_config)
    replace_with_text(os.path.join(out, TRACKER), f"{iteration}\n" if iteration != "release" else "release")
