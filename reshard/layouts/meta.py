"""Meta's original consolidated format (Llama 2 / 3 releases): ``params.json`` + ``consolidated.{r:02d}.pth`` for
each model-parallel rank r (a ``torch.save`` dict of tensors; ``meta-llama/llama`` ``generation.py`` loads rank r's
file on rank r).

Per rank (fairscale model parallelism; ``convert_llama_weights_to_hf.py``): ``tok_embeddings`` and ``output``
split on dim 0 (the vocab, as Llama 3 does; no padding), ``attention.wq`` / ``wk`` / ``wv`` and
``feed_forward.w1`` (gate) / ``w3`` (up) split on dim 0 by heads / rows, ``attention.wo`` and ``feed_forward.w2``
on dim 1, norms whole; **wq and wk rows are in interleaved-RoPE order inside each head** (row ``2i + j`` is
transformers' row ``j * d/2 + i``), a row permutation inside heads that commutes with the head split. Read with
``weights_only=True`` (reshard's restricted reader); ``rope.freqs`` is ignored. Names come from the mapping's
``meta`` key.
"""

from __future__ import annotations

import json
import os
import re

from reshard.core.canonical import CanonicalModel, build_canonical
from reshard.core.model_config import ConfigLoss, ModelConfig
from reshard.core.pieces import StoredTensor
from reshard.core.sharding import even_pieces, pack_members, vocab_pieces
from reshard.errors import CheckpointError, PlanError
from reshard.io.partial import replace_with_text
from reshard.io.heads import read_heads_while_torch_imports
from reshard.io.torch_format import TensorSlot, TorchFile
from reshard.layouts.base import (Layout, Options, Source, TargetPlan, TargetSpec, check_shape, find_side_files,
                                  read_json_object)
from reshard.layouts.hf_config import write_config
from reshard.mapping_vlm import family_for_architecture

NAME = "meta"
PARAMS = "params.json"
_FILE = re.compile(r"^consolidated\.(\d{2})\.pth$")
IGNORED = ("rope.freqs",)
#: Llama 3.1's RoPE scaling (use_scaled_rope): Meta's reference code fixes these parameters.
SCALED_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
ROPE_ROLES = ("q", "k")


def file_name(rank: int) -> str:
    return f"consolidated.{rank:02d}.pth"


def check_degrees(model: CanonicalModel, n: int) -> None:
    """Refuse what Meta's format cannot hold, before anything is written."""
    lacking = [s.hf for s in model.family.weights if s.meta is None and model.has_spec(s)]
    if lacking:
        raise PlanError(f"Meta's consolidated format has no name for {lacking[0]} (mapping '{model.family.name}'): "
                        "--to meta takes Llama-family models without biases")
    d = model.dims
    if n < 1:
        raise PlanError(f"--tp must be >= 1 (got {n})")
    for what, value in (("attention heads", d["nh"]), ("KV heads", d["ng"]), ("the intermediate size", d["F"]),
                        ("the vocab", d["V"])):
        if value % n:
            raise PlanError(f"Meta's format splits {what} ({value}) evenly over the {n} model-parallel files (no "
                            f"padding): choose a --tp that divides {value}")


def rank_tensors(model: CanonicalModel, n: int, rank: int) -> list[StoredTensor]:
    """Every tensor of model-parallel file ``rank`` of ``n``, in Meta's order (embedding, layers, norm, output)."""
    out = []
    d = model.head_dim
    for tensor in model.tensors.values():
        spec = tensor.spec
        members = pack_members(model, spec, tensor.layer, lambda s: s.meta)
        if members is None:
            continue
        name = spec.meta.format(layer=tensor.layer) if spec.per_layer else spec.meta
        first = members[0]
        if spec.split == "replicated":
            pieces = first.whole().pieces
        elif spec.split == "vocab":
            pieces = tuple(vocab_pieces(first, rank, n, first.shape[0]))
        else:  # column / row / a head or gate_up member stored alone: an even cut along its axis
            pieces = tuple(even_pieces(first, rank, n))
        shape = list(first.shape)
        shape[first.axis] = sum(p.length for p in pieces)
        out.append(StoredTensor(name, tuple(shape), first.axis, tuple(pieces),
                                interleaved=d if spec.role in ROPE_ROLES else 0))
    if model.tied:  # Meta stores the output projection; a tied model's is the embedding's rows (a checked copy)
        head = next(s for s in model.family.weights if s.tied_to)
        emb = model.tensors[head.tied_to]
        out.append(StoredTensor(head.meta, (emb.shape[0] // n, emb.shape[1]), 0,
                                tuple(vocab_pieces(emb, rank, n, emb.shape[0]))))
    return out


# ---------------------------------------------------------------------------------------------- params.json

def ffn_spelling(dim: int, ffn: int) -> dict:
    """``multiple_of`` (and ``ffn_dim_multiplier`` if needed) for which Meta's rule ``multiple_of * ceil(int(m *
    int(8 * dim / 3)) / multiple_of)`` gives ``ffn``: the largest usual multiple that does, else ``ffn`` itself."""
    base = int(2 * (4 * dim) / 3)
    for multiple in (1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1):
        for multiplier in (None, ffn / base):
            hidden = int(multiplier * base) if multiplier is not None else base
            if multiple * ((hidden + multiple - 1) // multiple) == ffn:
                return {"multiple_of": multiple, **({"ffn_dim_multiplier": multiplier} if multiplier else {})}
    hidden = base if base <= ffn else int(ffn / base * base)
    return {"multiple_of": ffn, **({"ffn_dim_multiplier": ffn / base} if base > ffn else {})} if hidden > 0 else {}


def ffn_from_params(params: dict) -> int:
    dim = int(params["dim"])
    hidden = int(2 * (4 * dim) / 3)
    if params.get("ffn_dim_multiplier") is not None:
        hidden = int(float(params["ffn_dim_multiplier"]) * hidden)
    multiple = int(params.get("multiple_of", 256))
    return multiple * ((hidden + multiple - 1) // multiple)


def params_from_meaning(m: ModelConfig, loss: ConfigLoss) -> dict:
    params = {"dim": m.hidden, "n_layers": m.layers, "n_heads": m.heads, "n_kv_heads": m.kv_heads,
              "vocab_size": m.vocab, "norm_eps": m.norm_eps, "rope_theta": m.rope_theta, **ffn_spelling(m.hidden, m.ffn)}
    if m.max_positions:
        params["max_seq_len"] = m.max_positions  # a ModelArgs field of Meta's reference code
    if ffn_from_params(params) != m.ffn:
        loss.cannot("ffn", m.ffn, "no multiple_of / ffn_dim_multiplier of Meta's rule gives it")
    if m.head_dim != m.hidden // m.heads:
        loss.cannot("head_dim", m.head_dim, "Meta's model takes head_dim = dim / n_heads")
    if m.scaling:
        if {k: v for k, v in m.scaling.items()} != SCALED_ROPE:
            loss.cannot("rope_scaling", m.scaling, f"Meta's use_scaled_rope is llama3 scaling with {SCALED_ROPE}")
        params["use_scaled_rope"] = True
    for field, value in (("sliding_window", m.sliding_window), ("qkv_bias", m.qkv_bias), ("o_bias", m.o_bias),
                         ("mlp_bias", m.mlp_bias), ("rope_interleaved", m.rope_interleaved)):
        if value:
            loss.cannot(field, value, "Meta's Llama format has none")
    if m.rotary_fraction != 1.0:
        loss.cannot("rotary_fraction", m.rotary_fraction, "Meta's Llama rotates every head dim")
    if m.activation != "silu" or m.norm != "rms" or not m.gated_mlp:
        loss.cannot("activation", m.activation, "Meta's Llama is a SwiGLU, RMSNorm model")
    if m.tied:
        loss.cannot("tied", True, "Meta's format stores the output projection (here a copy of the embedding), so it "
                    "reads back untied")
    return params


def meaning_from_params(params: dict, architecture: str, where: str) -> ModelConfig:
    """The meaning of ``params.json``; its vocab_size may still be Llama 2's -1 (checked by the caller once the
    embedding's split is known)."""
    params = params.get("model", params)
    try:
        dim, heads = int(params["dim"]), int(params["n_heads"])
        layers, vocab = int(params["n_layers"]), int(params["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: missing or invalid {exc} (params.json needs dim, n_layers, n_heads, "
                              "vocab_size)") from None
    return ModelConfig(
        architecture=architecture, hidden=dim, layers=layers, heads=heads,
        kv_heads=int(params.get("n_kv_heads") or heads), head_dim=dim // heads, ffn=ffn_from_params(params),
        vocab=vocab, max_positions=params.get("max_seq_len"), norm_eps=float(params.get("norm_eps", 1e-5)),
        rope_theta=float(params.get("rope_theta", 10000.0)),
        rope_scaling=tuple(sorted(SCALED_ROPE.items())) if params.get("use_scaled_rope") else None)


# ---------------------------------------------------------------------------------------------- reading

def open_source(path: str, opts: Options) -> Source:
    where = os.path.join(path, PARAMS)
    params = read_json_object(where, "a Meta checkpoint")
    architecture = opts.architecture or "LlamaForCausalLM"
    family = family_for_architecture(architecture, opts.mapping)
    meaning = meaning_from_params(params, architecture, where)
    ranks = {int(m.group(1)): os.path.join(path, n) for n in os.listdir(path) if (m := _FILE.match(n))}
    if not ranks:
        raise CheckpointError(f"{path} has no consolidated.NN.pth files")
    n = max(ranks) + 1
    missing = [r for r in range(n) if r not in ranks]
    if missing:
        raise CheckpointError(f"{path}: {file_name(missing[0])} is missing (found up to {file_name(n - 1)}); the "
                              "checkpoint is incomplete")
    read_heads_while_torch_imports([ranks[r] for r in range(n)])
    files = [TorchFile(ranks[r]) for r in range(n)]
    emb = next(s for s in family.weights if s.split == "vocab" and s.stage == "first")
    loc = files[0].tensors.get(emb.meta)
    if loc is None:
        raise CheckpointError(f"{files[0].path}: no '{emb.meta}'")
    if n > 1 and len(loc.shape) == 2 and loc.shape[1] * n == meaning.hidden:
        raise CheckpointError(f"{files[0].path}: '{emb.meta}' is split over the hidden size (Llama 1/2's "
                              "ParallelEmbedding); reshard reads vocab-split (Llama 3) consolidated files: convert "
                              "it with transformers' convert_llama_weights_to_hf.py first")
    if meaning.vocab < 1:
        raise CheckpointError(f"{where}: vocab_size {meaning.vocab} (Llama 2 leaves it to the tokenizer): set it in "
                              f"params.json to the embedding's row count ({loc.shape[0] * n})")
    config = write_config(meaning, {"torch_dtype": "bfloat16"}, family, ConfigLoss("record"))
    model = build_canonical(family, config, set(), tied=False)
    model.meaning = meaning
    try:
        check_degrees(model, n)
    except PlanError as exc:
        raise CheckpointError(f"{path}: {n} model-parallel files, which this model cannot have: {exc}") from None
    stored = []
    for r, f in enumerate(files):
        expected = rank_tensors(model, n, r)
        for tensor in expected:
            loc = f.tensors.get(tensor.name)
            if loc is None:
                raise CheckpointError(f"{f.path}: tensor '{tensor.name}' is missing")
            check_shape(f.path, tensor.name, loc.shape, tensor.shape)
            stored.append((r, tensor))
            for piece in tensor.pieces:
                model.dtypes.setdefault(piece.canonical, loc.dtype)
        unexpected = sorted(set(f.tensors) - {t.name for t in expected} - set(IGNORED))
        if unexpected:
            raise CheckpointError(f"{f.path}: unexpected tensor '{unexpected[0]}' for mapping '{family.name}'")
    return Source(layout=NAME, root=path, model=model, files=files, stored=stored, degrees={"tp": n, "pp": 1},
                  info={"config": config, "params": params}, side_files=find_side_files(path))


# ---------------------------------------------------------------------------------------------- writing

class MetaLayout(Layout):
    """Meta's consolidated format: ``params.json`` + one ``consolidated.NN.pth`` per model-parallel rank."""

    name = NAME
    summary = "Meta consolidated checkpoint (params.json + consolidated.NN.pth)"
    specificity = 10
    rank_loader = "reshard.verification.forward.sliced_rank:SlicedRankStream"
    completion_markers = (PARAMS,)
    uses_options = frozenset()

    def detect(self, names) -> bool:
        return PARAMS in names and any(_FILE.match(n) for n in names)

    def open(self, root: str, opts: Options) -> Source:
        return open_source(root, opts)

    def targets(self, source: Source, opts: Options, dtype: str) -> TargetPlan:
        if opts.pp != 1:
            raise PlanError("Meta's consolidated files hold model-parallel ranks only: --pp must be 1 for --to meta")
        model = source.model
        check_degrees(model, opts.tp)
        loss = ConfigLoss("Meta", opts.allow_lossy_config)
        params = params_from_meaning(model.meaning, loss)
        specs = []
        for r in range(opts.tp):
            tensors = rank_tensors(model, opts.tp, r)
            payload = {t.name: TensorSlot(t.name, "", ()) for t in tensors}
            specs.append(TargetSpec(file_name(r), "torch", tensors, payload=payload, rank={"tp": r}))
        return TargetPlan(specs, state=params, notes=loss.check())

    def finalize(self, out: str, source: Source, plan, state) -> None:
        replace_with_text(os.path.join(out, PARAMS), json.dumps(state, indent=2) + "\n")  # last: the marker

    def remote_files(self, names: list[str], read_text) -> list[str]:
        return sorted(n for n in names if _FILE.match(n))
