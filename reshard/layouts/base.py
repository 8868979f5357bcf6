"""The layout interface (:class:`Layout`) and what layouts share: an opened source (canonical view), target file
specs, and small helpers (side files, shard packing, shape checks)."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, ClassVar

from reshard import side_files
from reshard.core.canonical import CanonicalModel
from reshard.core.pieces import StoredTensor
from reshard.errors import CheckpointError, PlanError
from reshard.io.regular import open_regular
from reshard.io.tensorfile import TensorFile


#: Options only some targets write with: Options field -> (the command-line flag, its value when not given).
#: A target that does not use one (``Layout.uses_options``) refuses it instead of ignoring it.
TARGET_OPTIONS = {"ep": ("--ep", 1), "etp": ("--etp", None), "expert_parallel": ("--expert-parallel", False),
                  "moe_grouped_gemm": ("--moe-grouped-gemm", False), "megatron_spec": ("--megatron-spec", None),
                  "vocab_divisor": ("--make-vocab-size-divisible-by", None),
                  "max_shard_size": ("--max-shard-size", None),
                  "keep_fp8": ("--keep-fp8", False),
                  "torchtitan_names": ("--torchtitan-names", "current"),
                  "hf_spelling": ("--hf-spelling", "hub"), "megatron_vision": ("--megatron-vision", None),
                  "vllm_vision": ("--vllm-vision", "weights")}
TARGET_OPTIONS["max_seq"] = ("--max-seq", None)  # Megatron targets of Llama 4 (layouts/llama4_rules.py)
#: Options only some sources are read with: Options field -> (the command-line flag, its value when not given).
#: Converting from a layout that does not read one (``Layout.reads_options``) refuses it instead of ignoring it.
SOURCE_OPTIONS = {"config": ("--config", None), "tag": ("--tag", None), "master_weights": ("--master-weights", False)}
#: --to maxtext only (reshard/layouts/maxtext_write.py)
TARGET_OPTIONS.update({"scan_layers": ("--no-scan-layers", True),
                       "maxtext_match_converter": ("--maxtext-match-converter", False),
                       "maxtext_vocab_size": ("--maxtext-vocab-size", None)})
#: Why a target refuses one of them, where that says more than which targets use it ({to}: the target).
TARGET_OPTION_REASONS = {"keep_fp8": "FP8 into {to} is out of scope, as re-quantising is lossy: drop --keep-fp8 to "
                                     "write bf16"}


@dataclass
class Options:
    """Conversion options shared by all layouts."""

    tp: int = 1
    pp: int = 1
    ep: int = 1  # Megatron expert-parallel degree (Mixture of Experts)
    etp: int | None = None  # Megatron expert-tensor-parallel degree (default: tp; 1 for biased experts)
    expert_parallel: bool = False  # vLLM: whole experts split over the ranks (enable_expert_parallel)
    moe_grouped_gemm: bool = False  # Megatron: experts named as TEGroupedMLP's (linear_fc1.weight{j})
    dtype: str | None = None  # safetensors dtype name of the output, None keeps the source's
    megatron_spec: str = "te"
    max_shard_size: int = 5 * 10**9
    vocab_size: int | None = None  # the true vocab, when a Megatron source does not record it
    vocab_divisor: int | None = None  # Megatron make_vocab_size_divisible_by (default: source's, else 128)
    architecture: str | None = None  # HF architecture for a Megatron source without one recorded
    mapping: str | None = None  # a user's mapping file
    allow_replica_mismatch: bool = False
    allow_lossy_config: tuple[str, ...] = ()  # canonical config fields a target may drop (ConfigLoss)
    follow_symlinks: bool = False  # copy side files that are symlinks out of the source too
    drop_mtp: bool = False  # leave a model's multi-token-prediction layers out of the output
    keep_fp8: bool = False  # HF -> HF: copy block-FP8 weights and their scales as they are (else dequantise)
    config: str | None = None  # a config.json for a source that saves none (DeepSpeed, torchtitan)
    tag: str | None = None  # DeepSpeed: the checkpoint tag to read instead of the one ``latest`` names
    master_weights: bool = False  # DeepSpeed: read the fp32 master weights (optimizer partitions), output fp32
    torchtitan_names: str = "current"  # --to torchtitan: "current" (torchtitan HEAD) or "v0.2" parameter names
    hf_spelling: str = "hub"  # --to hf, a vision-language model: "hub" (transformers 4 names) or "v5"
    megatron_vision: str | None = None  # Megatron vision tower: "hf" modules or "native" (default: the family's)
    vllm_vision: str = "weights"  # --to vllm: "weights" (the tower split as vLLM splits it) or "none" (text only)
    allow_missing: tuple[str, ...] = ()  # what a target may be written without: "vision" (unused CLIP blocks)
    maxtext_model: str | None = None  # MaxText model name (llama3.1-8b, ...): the conventions the weights cannot show
    scan_layers: bool = True  # --to maxtext: layers stacked on axis 1 (MaxText scan_layers=True)
    maxtext_match_converter: bool = False  # --to maxtext: every leaf in --dtype, rounded as MaxText's to_maxtext
    maxtext_vocab_size: int | None = None  # --to maxtext: MaxText's vocab_size (zero rows padded, or truncated)
    max_seq: int | None = None  # the longest sequence a Megatron target must compute the same (Llama 4's refusal)


@dataclass
class Source:
    """An opened checkpoint: its canonical model and where every canonical row range lives."""

    layout: str
    root: str
    model: CanonicalModel
    files: list[TensorFile]
    stored: list[tuple[int, StoredTensor]]
    degrees: dict[str, int]
    info: dict[str, Any] = field(default_factory=dict)
    side_files: list[str] = field(default_factory=list)  # absolute paths of tokenizer etc. to carry along

    def drop_mtp(self) -> int:
        """Leave the model's multi-token-prediction layers out of this view (their stored tensors unused);
        returns how many there were."""
        from reshard.core.canonical import without_mtp

        count = len(self.model.mtp_layers)
        if count:
            self.model = without_mtp(self.model)
            self.stored = [(i, t) for i, t in self.stored
                           if all(p.canonical is None or p.canonical in self.model.tensors for p in t.pieces)]
        return count

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def byte_shares(self, source: int, tensor: str) -> dict[str, float] | None:
        """The fraction of ``tensor``'s bytes in each file, for a source file whose tensors span several files
        (``TensorFile.byte_shares``); None for an ordinary file."""
        return self.files[source].byte_shares(tensor)

    def row_bytes(self, source: int, tensor: str, axis: int, in_block: bool = False) -> int:
        loc = self.files[source].tensors[tensor]
        n = loc.nbytes // (loc.shape[0] or 1) if in_block else loc.nbytes
        return n // loc.shape[axis] if loc.shape and loc.shape[axis] else n


@dataclass
class TargetSpec:
    """A file a target layout will write: its tensors as pieces, plus a torch payload or safetensors metadata."""

    path: str
    format: str
    tensors: list[StoredTensor]
    payload: Any = None
    metadata: dict | None = None
    rank: dict[str, int] | None = None  # the parallel rank the file belongs to ({"tp", "pp", "ep"}), None: all


def read_json_object(path: str, what: str) -> dict:
    """The JSON object in file ``path`` (``what`` names the checkpoint kind that needs it in errors)."""
    try:
        with open_regular(path) as f:
            value = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{os.path.dirname(path)} has no {os.path.basename(path)}: {what} needs one") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds {json.dumps(value)[:40]}, not a JSON object of model settings: "
                              f"restore the model's {os.path.basename(path)}")
    return value


def training_config(folders: list[str], opts: Options, kind: str) -> tuple[dict, str | None]:
    """``(config, the folder it was found in)`` of a training checkpoint, which saves no HF config of its own:
    ``--config FILE`` when given (folder None), else the first ``config.json`` in ``folders``; neither is
    refused (``kind`` names the checkpoint in the message)."""
    if opts.config:
        return read_json_object(opts.config, "--config"), None
    for folder in folders:  # a symlink loop is an OS error (exit 3), not a missing file
        if side_files.is_file(os.path.join(folder, "config.json")):
            return read_json_object(os.path.join(folder, "config.json"), kind), folder
    raise CheckpointError(f"{folders[0]}: {kind} holds no model config and there is no config.json beside it: pass "
                          "--config FILE (the model's Hugging Face config.json)")


def chosen_architecture(named: str | None, opts: Options, where: str) -> str | None:
    """``--architecture`` if given, else the architecture the checkpoint names. Forcing another than the one it
    names is refused unless ``--allow-lossy-config architecture``: the forced class ignores what the named one
    computes differently, and the output would silently compute another function."""
    forced = opts.architecture
    if forced and named and forced != named and "architecture" not in opts.allow_lossy_config:
        raise PlanError(f"{where} names {named}, and --architecture {forced} would relabel it: {forced} ignores "
                        f"what {named} computes differently, so the output would compute a different function. "
                        f"Drop --architecture (pass --mapping FILE for a family reshard does not ship), or relabel "
                        f"it knowingly with convert's --allow-lossy-config architecture")
    return forced or named


def stored_dtype(model: CanonicalModel, tensor: StoredTensor, opts: Options, default: str) -> str:
    """The dtype a target tensor is written in: its own fixed dtype (constants), else --dtype, else the dtype of
    the source tensor it comes from (``default`` for one without a canonical source)."""
    canon = next((p.canonical for p in tensor.pieces if p.canonical), None)
    # a router's fp32 bias: kept fp32 under --dtype; without --dtype ("keep") it keeps the source's dtype
    pinned = model.tensors[canon].spec.dtype if canon in model.tensors and opts.dtype else None
    return tensor.dtype or pinned or opts.dtype or model.dtypes.get(canon, default)


def pack_by_size(tensors: list, nbytes_of, limit: int) -> list[list]:
    """Consecutive ``tensors`` grouped into files of at most ``limit`` bytes (HF shards, vLLM parts); a tensor
    larger than ``limit`` gets a file of its own."""
    files: list[list] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = nbytes_of(tensor)
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(tensor)
        size += nbytes
    return files


def find_side_files(folder: str, config: dict | None = None) -> list[str]:
    """The side files of ``folder`` for a model whose config.json is ``config``: tokenizer files, the remote code
    ``auto_map`` names, and what that code declares (:func:`reshard.side_files.find_side_files`)."""
    return side_files.find_side_files([folder], config)


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def hf_blob_store(folder: str) -> str | None:
    """The blob store (``.../models--ORG--NAME/blobs``) of the Hugging Face cache snapshot ``folder`` is in (the
    snapshot's files are symlinks into it), else None."""
    path = os.path.realpath(folder)
    while os.path.dirname(path) != path:
        parent = os.path.dirname(path)
        if os.path.basename(path) == "snapshots" and os.path.basename(parent).startswith("models--"):
            return os.path.join(parent, "blobs")
        path = parent
    return None


def escapes_source(path: str, root: str) -> bool:
    """Whether side file ``path`` (from folder ``root`` or the folder it sits in) resolves outside both, and
    outside the Hugging Face cache's blob store of a cached snapshot: a symlink to a file elsewhere."""
    target = os.path.realpath(path)
    folders = [os.path.realpath(root), os.path.realpath(os.path.dirname(os.path.abspath(path)))]
    store = hf_blob_store(os.path.dirname(os.path.abspath(path)))
    return not any(_within(target, f) for f in folders + ([os.path.realpath(store)] if store else []))


def check_shape(where: str, name: str, actual: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(actual) != tuple(expected):
        raise CheckpointError(f"{where}: tensor '{name}' has shape {list(actual)} but the config implies "
                              f"{list(expected)}: the config does not match the weights")


def import_string(target: str) -> Any:
    """The object a ``"package.module:attribute"`` string names (imported on first use)."""
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass
class TargetPlan:
    """What :meth:`Layout.targets` returns: the files to write, and an opaque state of the layout's own that the
    conversion hands back to :meth:`Layout.finalize` (e.g. the padded vocab, the iteration)."""

    files: list[TargetSpec]
    state: Any = None
    notes: list[str] = field(default_factory=list)  # e.g. config fields dropped by --allow-lossy-config


class Layout:
    """One checkpoint layout (hf, megatron, vllm, ...): a plug-in registered by name in :mod:`reshard.layouts`.

    A layout never moves bytes. It says where every canonical row range lives in a folder it reads
    (``Source.stored``) and what every file it writes holds (``TargetSpec`` pieces); the planner and the executor,
    shared by all layouts, do the rest. Calls, in order:

    1. ``detect(names)``: does this listing look like this layout? ``names`` are paths relative to the
       checkpoint folder, ``/``-separated, folders with a trailing ``/`` (a local folder to depth 3, or a Hub
       repo listing). When several layouts match, the highest ``specificity`` wins; a tie is refused.
    2. ``open(root, opts)``: the canonical view of a folder (reads headers only).
    3. ``targets(source, opts, dtype)``: the target files at ``opts.tp`` x ``opts.pp``; raises ``PlanError``
       for an impossible request (nothing is written yet).
    4. (the shared executor writes every target file into a staging folder)
    5. ``finalize(out, source, plan, state)``: the layout's side files (config, index, tracker, records),
       the one that marks the output complete written last.

    Optional capabilities: ``rank_loader`` ("module:class" of a forward-verifier ``RankStream``: one
    tensor-parallel rank's weights read layer by layer from that rank's own files), ``remote_files`` (what a Hub download of this layout takes),
    ``open_headers`` (a view from safetensors headers alone, for plans of remote repos). ``describe`` and
    ``rank_label`` feed ``reshard inspect``.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # one line for --help, inspect and "not a checkpoint reshard knows" errors
    specificity: ClassVar[int] = 0  # which of several matching layouts detection picks (hf 0, others above)
    writes: ClassVar[bool] = True  # False: a read-only layout (not a --to choice)
    holds_mtp: ClassVar[bool] = False  # writes multi-token-prediction layers (else they are dropped with a note)
    rank_loader: ClassVar[str | None] = None  # "module:RankStream class(path, rank, world, opts)"
    rank_view_of: ClassVar[str | None] = None  # a layout whose ranks load what another's do (load_rank)
    completion_markers: ClassVar[tuple[str, ...]] = ()  # a complete output has one of these files (push)
    remote_headers: ClassVar[bool] = False  # open_headers works: plans from remote safetensors headers
    #: Which of ``TARGET_OPTIONS`` the layout writes with (any other given is refused); None: not declared (all
    #: are passed on unchecked, as for a plug-in written before this existed).
    uses_options: ClassVar[frozenset[str] | None] = None
    #: Which of ``SOURCE_OPTIONS`` the layout reads a checkpoint with (convert refuses the others).
    reads_options: ClassVar[frozenset[str]] = frozenset()
    #: For a target option the layout does not use: the one of its own that does what the user meant.
    instead: ClassVar[dict[str, str]] = {}

    def detect(self, names: Collection[str]) -> bool:
        raise NotImplementedError

    def open(self, root: str, opts: Options) -> Source:
        raise NotImplementedError

    def targets(self, source: Source, opts: Options, dtype: str) -> TargetPlan:
        raise NotImplementedError

    def finalize(self, out: str, source: Source, plan: Any, state: Any) -> None:
        """Write the side files into ``out`` (``plan``: the conversion's ``core.plan.Plan``)."""

    def remote_files(self, names: list[str], read_text: Callable[[str], str]) -> list[str]:
        """The weight files (and the layout's own records) a download needs, from a repo's file ``names``;
        ``read_text(name)`` fetches a small text file (an index, a tracker). Side files are added by the caller."""
        raise CheckpointError(f"reshard does not download {self.name} checkpoints from the Hub yet: download the "
                              "repo yourself and convert the local folder")

    def open_headers(self, where: str, config: dict, files: list[TensorFile], opts: Options) -> Source:
        """A view from parsed safetensors headers alone (``remote_headers`` layouts)."""
        raise NotImplementedError

    def describe(self, source: Source) -> dict:
        """Layout-specific keys for ``reshard inspect`` (padded vocab, iteration, ...)."""
        return {}

    def rank_label(self, source: Source, relpath: str) -> str:
        """The rank a file belongs to, for ``reshard inspect`` (``all`` for a layout without ranks)."""
        return "all"

    def load_rank(self, path: str, rank: int, world: int, opts: Options):
        """Tensor-parallel rank ``rank`` of ``world`` in the forward verifier's form (needs ``rank_loader``)."""
        if self.rank_loader is None:
            raise PlanError(f"the forward verifier cannot read the {self.name} layout")
        with import_string(self.rank_loader)(path, rank, world, opts) as stream:
            return stream.load_all()
