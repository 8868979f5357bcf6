"""Hugging Face layout: ``config.json`` + ``model.safetensors`` or ``model-0000i-of-0000N.safetensors`` with
``model.safetensors.index.json`` (also reads ``pytorch_model*.bin``). Tensors are full (TP=1) and mostly the
canonical ones themselves; a family's mapping says where HF fuses several (Phi-3's ``qkv_proj`` = ``[q; k; v]``,
``gate_up_proj`` = ``[gate; up]``: ``hf_stored``) or stores a matrix ``[in, out]`` (GPT-2's Conv1D:
``hf_transposed``), and which old buffers to drop on read (``[hf] ignore``). Reading: :mod:`.hf_read`; writing:
:mod:`.hf_write`; this module is the :class:`HFLayout` over both."""

from __future__ import annotations

from reshard.errors import PlanError
from reshard.io.hf_files import INDEX, is_weight_file
from reshard.io.tensorfile import TensorFile
from reshard.layouts.base import Layout, Options, Source, TargetPlan
# Re-exported: importers spell these reshard.layouts.hf.<name>.
from reshard.layouts.hf_read import (IGNORED_SUFFIXES, NAME, architecture_of, build_source,  # noqa: F401
                                     check_index, open_source, read_config, relabel_notes, remote_weight_files,
                                     side_files, source_config)
from reshard.layouts.hf_write import (finalize, hf_tensors, mtp_copies, output_config, planned_config,  # noqa: F401
                                      targets, write_config)


class HFLayout(Layout):
    """Hugging Face: full, unfused tensors (the canonical form itself), sharded by size with an index."""

    holds_mtp = True
    name = NAME
    summary = "Hugging Face folder (config.json + *.safetensors or pytorch_model*.bin)"
    specificity = 0
    rank_loader = "reshard.verification.forward.sliced_rank:SlicedRankStream"
    completion_markers = (INDEX, "model.safetensors")
    remote_headers = True
    uses_options = frozenset({"max_shard_size", "keep_fp8", "hf_spelling"})

    def detect(self, names) -> bool:
        return "config.json" in names and any(is_weight_file(n) for n in names)

    def open(self, root: str, opts: Options) -> Source:
        return open_source(root, opts)

    def open_headers(self, where: str, config: dict, files: list[TensorFile], opts: Options) -> Source:
        return build_source(where, config, files, opts, side_files=[])

    def targets(self, source: Source, opts: Options, dtype: str) -> TargetPlan:
        if opts.tp != 1 or opts.pp != 1:
            raise PlanError("the hf layout holds the full model: --tp and --pp must be 1 for --to hf")
        config, notes = planned_config(source.model, dtype, opts, "Hugging Face")
        return TargetPlan(targets(source.model, opts), state=config, notes=notes)

    def finalize(self, out: str, source: Source, plan, state) -> None:
        finalize(out, state, plan.files)

    def remote_files(self, names: list[str], read_text) -> list[str]:
        return remote_weight_files(names, read_text)

    def describe(self, source: Source) -> dict:
        return {"quantization": source.info["fp8"]} if "fp8" in source.info else {}
