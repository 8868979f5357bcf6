"""vLLM ``sharded_state``: ``model-rank-{rank}-part-{part}.safetensors`` in one folder, plus config.json,
tokenizer files and reshard's ``reshard.json`` (vLLM itself records no TP size).

Per rank, vLLM parameter names and per-rank shapes: ``qkv_proj`` = ``[q_r; k_r; v_r]`` (one KV head per rank,
replicated on ``tp/ng`` neighbours, when tp >= ng), ``gate_up_proj`` = ``[gate_r; up_r]``, ``o_proj`` and
``down_proj`` split on dim 1 (their biases whole on every rank), norms whole, embedding and ``lm_head`` padded to
a multiple of 64 rows and split evenly (padding rows zero), tied embeddings stored once under the name vLLM's
loader keeps, and four fp32 attention scale scalars (1.0) per layer that the loader requires.

DeepSeek-V2 / V3 (multi-head latent attention): ``self_attn.fused_qkv_a_proj`` = ``[q_a_proj; kv_a_proj_with_mqa]``
whole on every rank (without q LoRA: ``self_attn.mla_attn.q_proj`` column-split and ``self_attn.kv_a_proj_with_mqa``
whole, the ``vllm_unfused`` name), ``mla_attn.q_a_layernorm``, ``mla_attn.q_b_proj`` / ``kv_b_proj`` column-split
by whole heads, ``mla_attn.o_proj`` row-split, norms and the router (``mlp.experts.gate.weight``, its fp32
``e_score_correction_bias``) whole, shared experts as a dense MLP under ``mlp.experts._shared_experts._layer``;
multi-token-prediction layers are not part of vLLM's main model (dropped with a note).

Names and per-rank tensors: :mod:`.vllm_ranks`; reading: :mod:`.vllm_read`; this module plans and finalizes the
write (``reshard.json`` records the TP size and vLLM's load call) and is the :class:`VLLMLayout`.
"""

from __future__ import annotations

import json
import math
import os

from reshard.version import __version__
from reshard.core.canonical import CanonicalModel
from reshard.layouts.llama4_rules import check_vllm_target, vllm_notes
from reshard.layouts import gdn_rules, mamba_rules
from reshard.core.sharding import check_vllm_degrees, vllm_padded_vocab
from reshard.errors import PlanError
from reshard.io import dtypes
from reshard.io.partial import replace_with_text
from reshard.layouts import gpt_oss_rules, hf
from reshard.layouts.base import Layout, Options, Source, TargetPlan, TargetSpec, pack_by_size, stored_dtype
from reshard.layouts.vision import check_tower_degrees
# Re-exported: importers spell these reshard.layouts.vllm.<name> (the per-rank forms and the reader).
from reshard.layouts.vllm_ranks import (NAME, PATTERN, RECORD, SCALE_DTYPE, _FILE, _check_names,  # noqa: F401
                                        expert_block, kept_tied_name, rank_tensors, vllm_name_table, vllm_names)
from reshard.layouts.vllm_read import (_expert_parallel, _rank_files, _recorded_tp, _tower_whole,  # noqa: F401
                                       _tp_value, open_source)


def targets(model: CanonicalModel, opts: Options, dtype: str) -> tuple[list[TargetSpec], int]:
    """Rank files for vLLM at ``opts.tp``, each rank split into parts of at most ``max_shard_size`` bytes."""
    if opts.pp != 1:
        raise PlanError("vLLM sharded_state files hold tensor-parallel ranks only: --pp must be 1 for --to vllm")
    _check_names(model)
    gdn_rules.check_degrees(model, opts.tp)
    mamba_rules.check_degrees(model, opts.tp)
    check_vllm_degrees(model, opts.tp, opts.expert_parallel)
    gpt_oss_rules.check_vllm(model.meaning)
    check_vllm_target(model)
    whole = opts.vllm_vision == "data"
    if not whole:
        check_tower_degrees(model, opts.tp, NAME)
    padded = vllm_padded_vocab(model.vocab_size)
    specs = []
    for rank in range(opts.tp):
        parts = pack_by_size(rank_tensors(model, opts.tp, rank, padded, opts.expert_parallel, whole),
                             lambda t: dtypes.itemsize(stored_dtype(model, t, opts, dtype)) * math.prod(t.shape),
                             opts.max_shard_size)
        for part, tensors in enumerate(parts):
            metadata = {"format": "pt", "reshard_layout": NAME, "tensor_parallel_size": str(opts.tp),
                        "rank": str(rank), **({"expert_parallel": "true"} if opts.expert_parallel else {})}
            specs.append(TargetSpec(PATTERN.format(rank=rank, part=part), "safetensors", tensors,
                                    metadata=metadata, rank={"tp": rank}))
    return specs, padded


#: the engine arguments a vision-language folder is loaded with, by --vllm-vision
VISION_LOAD = {"weights": "", "data": ', mm_encoder_tp_mode="data"',
               "none": ', limit_mm_per_prompt={"image": 0, "video": 0}'}


def finalize(out: str, model: CanonicalModel, config: dict, tp: int, padded_vocab: int, files: list,
             expert_parallel: bool = False, vision: str = "weights") -> None:
    """Write config.json, then ``reshard.json`` (the TP size vLLM does not record) last."""
    hf.write_config(out, config)
    record = {
        "layout": NAME, "tensor_parallel_size": tp, "pattern": PATTERN, "expert_parallel": expert_parallel,
        "padded_vocab_size": padded_vocab, "vocab_size": model.vocab_size,
        "files": sorted(spec.path for spec in files), "producer": f"reshard {__version__}",
        "load_with": f'vllm.LLM(model=DIR, load_format="sharded_state", tensor_parallel_size={tp}'
                     + (", enable_expert_parallel=True" if expert_parallel else "")
                     + (VISION_LOAD[vision] if model.family.multimodal else "") + ")",
    }
    replace_with_text(os.path.join(out, RECORD), json.dumps(record, indent=2) + "\n")


class VLLMLayout(Layout):
    """vLLM ``sharded_state``: per-rank safetensors parts for one ``tensor_parallel_size``."""

    name = NAME
    summary = "vLLM sharded_state folder (model-rank-*-part-*.safetensors)"
    specificity = 10  # a vLLM folder also holds config.json and *.safetensors, as an HF one does
    rank_loader = "reshard.verification.forward.vllm_rank:VllmRankStream"
    completion_markers = ("model-rank-0-part-0.safetensors",)
    uses_options = frozenset({"expert_parallel", "max_shard_size", "vllm_vision"})
    instead = {field: "vLLM splits whole experts over its --tp ranks with --expert-parallel (as "
                      "enable_expert_parallel loads them)" for field in ("ep", "etp")}

    def detect(self, names) -> bool:
        return any(_FILE.match(n) for n in names)

    def open(self, root: str, opts: Options) -> Source:
        return open_source(root, opts)

    def targets(self, source: Source, opts: Options, dtype: str) -> TargetPlan:
        specs, padded = targets(source.model, opts, dtype)
        config, notes = hf.planned_config(source.model, dtype, opts, "vLLM")
        return TargetPlan(specs, state={"tp": opts.tp, "padded_vocab": padded, "config": config,
                                        "expert_parallel": opts.expert_parallel,
                                        "vllm_vision": opts.vllm_vision}, notes=notes + vllm_notes(source.model)
                          + mamba_rules.vllm_notes(source.model))

    def finalize(self, out: str, source: Source, plan, state) -> None:
        finalize(out, source.model, state["config"], state["tp"], state["padded_vocab"], plan.files,
                 state["expert_parallel"], state.get("vllm_vision", "weights"))

    def remote_files(self, names: list[str], read_text) -> list[str]:
        return sorted(n for n in names if _FILE.match(n))

    def describe(self, source: Source) -> dict:
        return {"padded_vocab_size": source.info["padded_vocab"],
                "recorded_tensor_parallel_size": source.info["recorded_tp"]}

    def rank_label(self, source: Source, relpath: str) -> str:
        return f"rank-{_FILE.match(os.path.basename(relpath)).group(1)}"
