"""In-memory rank views: the tensors one parallel rank's file(s) would hold in a target layout, built straight from
a source checkpoint without writing anything.

``load_rank(src, to="vllm", tp=4, rank=3)`` plans the conversion exactly as ``convert`` does (same planner, same
target names, padding, packing and dtype), keeps the target files that belong to the rank, and streams each of
their tensors onto ``device`` (:func:`reshard.io.device_load.load_tensors`): allocated once there and filled row
block by row block from positioned reads of only the source byte ranges it needs. On the CPU the blocks are read
straight into the tensors; on another device they pass through two bounded host buffers (pinned for CUDA) and are
cast on the device, so host memory stays bounded whatever the model. A column (dim 1) slice of a row-parallel
weight is read row by row when each row's piece is at least 4 KiB (narrower pieces are read as whole rows, in
bounded blocks: one call per tiny piece would cost more than the bytes), so the bytes read stay close to the
rank's share.
"""

from __future__ import annotations

from reshard.errors import PlanError
from reshard.io import dtypes
from reshard.layouts.base import Options

RANK_KEYS = ("tp", "pp", "ep")


def _check_rank(what: str, rank: int, degree: int) -> None:
    if degree < 1:
        raise PlanError(f"{what} degree must be at least 1 (got {degree})")
    if not 0 <= rank < degree:
        raise PlanError(f"{what} rank {rank} is outside 0..{degree - 1} for degree {degree}")


def rank_files(plan, to: str, wanted: dict[str, int], degrees: dict[str, int]):
    """The plan's target files that rank ``wanted`` ({"tp", "pp", "ep"}) writes. A layout without ranks (HF) has
    one, which holds every file; a degree above 1 the layout's files do not carry (``ep`` for vLLM, whose expert
    parallelism is ``expert_parallel``) is refused rather than answered with an empty view."""
    if any(f.rank is None for f in plan.files):
        if any(d > 1 for d in degrees.values()):
            raise PlanError(f"{to} files hold the whole model, not per-rank slices: load_rank(to='{to}') takes "
                            "tp=1, pp=1, ep=1")
        return list(plan.files)
    carried = {k for f in plan.files for k in f.rank}
    for key, degree in degrees.items():
        if degree > 1 and key not in carried:
            hint = " (vLLM splits experts with expert_parallel=True over the tp ranks)" if key == "ep" else ""
            raise PlanError(f"{to} files have no {key} ranks: load_rank(to='{to}') takes {key}=1{hint}")
    return [f for f in plan.files if all(f.rank.get(k, 0) == v for k, v in wanted.items())]


def load_rank(src: str, to: str = "vllm", *, tp: int = 1, pp: int = 1, rank: int = 0, pp_rank: int = 0,
              ep: int = 1, ep_rank: int = 0, etp: int | None = None, expert_parallel: bool = False,
              dtype=None, device="cpu", allow_cast_overflow: bool = False, **options) -> dict:
    """The tensors tensor-parallel rank ``rank`` (pipeline stage ``pp_rank``, expert-parallel rank ``ep_rank``)
    of layout ``to`` at degrees ``tp`` x ``pp`` (x ``ep``) holds, by the names its file(s) use, as
    ``convert(src, ..., to=to, tp=tp, pp=pp)`` would write them, bit for bit; nothing is written.

    ``src``: any checkpoint reshard reads (a folder or ``hf://ORG/NAME``). ``dtype``: cast to ``"bf16"``,
    ``"fp16"``, ``"fp32"`` or a ``torch.dtype`` (default: keep the source's). ``device``: where the tensors are
    placed (off the CPU: streamed through two bounded host buffers, :mod:`reshard.io.device_load`). Other keyword
    ``options`` are :class:`reshard.layouts.base.Options` fields (``vocab_size``, ``megatron_spec``,
    ``architecture``, ...). A ``torch_dist`` rank holds what a ``megatron`` (torch format) rank does: the same
    module tensors, by their state-dict names.
    """
    from reshard.conversion import make_plan
    from reshard.hub import open_source
    from reshard.io.device_load import load_tensors
    from reshard.layouts.registry import get_layout

    _check_rank("tensor-parallel", rank, tp)
    _check_rank("pipeline-parallel", pp_rank, pp)
    _check_rank("expert-parallel", ep_rank, ep)
    layout = get_layout(to)
    view = layout.rank_view_of or to
    opts = Options(tp=tp, pp=pp, ep=ep, etp=etp, expert_parallel=expert_parallel, dtype=dtypes.as_dtype_name(dtype),
                   **options)
    with open_source(src, opts) as source:
        plan, _ = make_plan(source, view, opts)
        targets = rank_files(plan, to, {"tp": rank, "pp": pp_rank, "ep": ep_rank}, {"tp": tp, "pp": pp, "ep": ep})
        return load_tensors([t for target in targets for t in target.tensors], source.files, device,
                            allow_overflow=allow_cast_overflow)
