"""Megatron-Core ``torch`` format: ``<root>/latest_checkpointed_iteration.txt`` and
``<root>/iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`` (a pickled dict with ``model``, ``args``,
``checkpoint_version``, ``iteration``; ``model0``, ``model1``, ... with a virtual pipeline).

Per rank: ``linear_qkv`` grouped by KV group, ``linear_fc1`` = ``[gate_r; up_r]``, ``linear_proj`` and
``linear_fc2`` split on dim 1, embedding and output layer split over the vocab padded to a multiple of
``make_vocab_size_divisible_by * tp``, norms replicated; layer indices local to the pipeline stage.

Per-rank names and shapes: :mod:`.megatron_ranks`; reading: :mod:`.megatron_read`; writing: :mod:`.megatron_write`;
this module is the :class:`MegatronLayout` over them.
"""

from __future__ import annotations

import os

from reshard.layouts.base import Layout, Options, Source, TargetPlan
from reshard.layouts.expert_tp import expert_tp  # noqa: F401  (torch_dist spells megatron.expert_tp)
from reshard.layouts.megatron_folders import (  # noqa: F401  (_checkpoint_root, _label: for torch_dist, verify)
    _RANK_DIR, _REMOTE_RANK_FILE, TRACKER, _checkpoint_root, _iteration_dir, _label,
    iteration_folder, iteration_folder_name, side_folders, true_vocab_size)
# Re-exported: importers spell these reshard.layouts.megatron.<name> (per-rank forms, reader, writer).
from reshard.layouts.megatron_ranks import (GROUPED, LEGACY_GROUPED, NAME, RANK_FILE, _LAYER,  # noqa: F401
                                            ExpertGrid, _legacy_grouped, extra_state_names, mtp_decoder_layer,
                                            mtp_name, rank_dir, rank_tensors)
from reshard.layouts.megatron_read import (_FORMS, _args_dtype, _legacy_view, _scan_ranks,  # noqa: F401
                                           _with_record_only, missing_rank_folders, open_source, rank_grid,
                                           read_args, scan_rank_folders)
from reshard.layouts.megatron_write import (OutputArgs, build_args, check_expert_degrees,  # noqa: F401
                                            check_split_dims, finalize, output_args, targets)


class MegatronLayout(Layout):
    """Megatron-Core ``torch`` format: a pickled state dict per (TP, PP) rank, with Megatron-LM ``args``."""

    holds_mtp = True
    name = NAME
    summary = "Megatron-Core torch format (latest_checkpointed_iteration.txt, iter_*/mp_rank_*/model_optim_rng.pt)"
    specificity = 10
    rank_loader = "reshard.verification.forward.megatron_rank:MegatronRankStream"
    completion_markers = (TRACKER,)
    uses_options = frozenset({"megatron_vision", "ep", "etp", "moe_grouped_gemm", "megatron_spec", "vocab_divisor",
                              "max_seq"})
    instead = {"expert_parallel": "Megatron's expert parallelism is --ep N (with --etp for the experts' tensor "
                                  "parallelism)"}

    def detect(self, names) -> bool:
        """A tracker file, rank folders (an iteration folder itself) or ``iter_*/`` / ``release/`` folders."""
        if TRACKER in names:
            return True
        folders = [n[:-1] for n in names if n.endswith("/") and n.count("/") == 1]
        return any(_RANK_DIR.match(n) or n.startswith("iter_") or n == "release" for n in folders)

    def open(self, root: str, opts: Options) -> Source:
        return open_source(root, opts)

    def targets(self, source: Source, opts: Options, dtype: str) -> TargetPlan:
        specs, iteration, notes = targets(source.model, opts, source, dtype)
        return TargetPlan(specs, state=iteration, notes=notes)

    def finalize(self, out: str, source: Source, plan, state) -> None:
        finalize(out, state, plan.files[0].payload["args"].hf_config if plan.files else None)

    def remote_files(self, names: list[str], read_text) -> list[str]:
        """The tracker and the rank files of the iteration it names (else of the only iteration present)."""
        folder = iteration_folder(read_text(TRACKER) if TRACKER in names else None, names)
        ranks = {p for p in names if _REMOTE_RANK_FILE.match(p) and p.split("/")[0] == folder}
        return sorted(ranks | ({TRACKER} & set(names)))

    def describe(self, source: Source) -> dict:
        return {"padded_vocab_size": source.info["padded_vocab"], "megatron_spec": source.info["spec"],
                "iteration": source.info["iteration"]}

    def rank_label(self, source: Source, relpath: str) -> str:
        return os.path.basename(os.path.dirname(relpath))
