"""TensorRT-LLM checkpoint (the input of ``trtllm-build --checkpoint_dir``): ``config.json`` + ``rank{r}.safetensors``
with ``r = pp_rank * tp + tp_rank`` (TensorRT-LLM's Mapping, cp = 1).

Per rank (``llama/convert.py`` ``load_weights_from_hf_model``): ``attention.qkv`` = ``[q_r; k_r; v_r]`` (KV heads
repeated when tp > KV heads: rank r holds head ``r // (tp/ng)``), ``attention.dense`` and ``mlp.proj`` split on
dim 1 (biases whole), ``mlp.fc`` = the rank's gate rows and ``mlp.gate`` its up rows, norms whole; the
embedding whole on the first pipeline rank (no parallel embedding), ``ln_f`` and ``lm_head`` on the last, the head
split over the vocab (zero-padded to a multiple of tp only when the vocab does not divide) and stored even when
the embeddings are tied; layer indices restart at 0 on each pipeline rank. Names come from the mapping's
``trtllm`` key.
"""

from __future__ import annotations

import json
import os
import re

from reshard.core.canonical import CanonicalModel, build_canonical
from reshard.core.model_config import ConfigLoss
from reshard.core.pieces import StoredTensor
from reshard.core.sharding import (check_replicating_degrees, pack_members, rank_slice, stage_layers,
                                   stage_weights, vllm_qkv_pieces)
from reshard.errors import CheckpointError, PlanError
from reshard.io.partial import replace_with_text
from reshard.io.safetensors_format import SafetensorsFile
from reshard.layouts.base import (Layout, Options, Source, TargetPlan, TargetSpec, check_shape, chosen_architecture,
                                  find_side_files, read_json_object)
from reshard.layouts.hf_config import read_meaning
from reshard.layouts.trtllm_config import read_trtllm_config, trtllm_config
from reshard.mapping import WeightSpec
from reshard.mapping_vlm import family_for_architecture

NAME = "trtllm"
CONFIG = "config.json"
_FILE = re.compile(r"^rank(\d+)\.safetensors$")


def padded_vocab(vocab: int, tp: int) -> int:
    """TensorRT-LLM pads ``lm_head`` rows to a multiple of tp only when the vocab does not divide."""
    return -(-vocab // tp) * tp


def check_degrees(model: CanonicalModel, tp: int, pp: int) -> None:
    """Refuse degrees TensorRT-LLM cannot take this model at, before anything is written."""
    names = [s.hf for s in model.family.weights if s.trtllm is None and model.has_spec(s)]
    if names:
        raise PlanError(f"mapping '{model.family.name}' has no TensorRT-LLM name for {names[0]}: --to trtllm supports "
                        "the families whose mapping gives `trtllm = ...` names (Llama, Mistral, Qwen2)")
    if model.num_experts:
        raise PlanError("--to trtllm does not write Mixture-of-Experts models yet")
    check_replicating_degrees(model, tp, "TensorRT-LLM")  # heads split, KV heads repeated when tp > KV heads
    if pp < 1 or model.num_layers % pp:
        raise PlanError(f"{model.num_layers} layers do not split evenly over pp={pp}: TensorRT-LLM versions "
                        f"assign the remainder differently; choose a pp that divides {model.num_layers}")


def rank_tensors(model: CanonicalModel, tp: int, tp_rank: int, layers: range, first: bool, last: bool,
                 padded: int) -> list[StoredTensor]:
    """Every tensor of one TensorRT-LLM rank (names local to its pipeline stage)."""
    groups = model.dims["ng"]
    out: list[StoredTensor] = []

    def emit(spec: WeightSpec, layer: int | None, local: int | None, whole: bool = False, data: WeightSpec = None):
        members = pack_members(model, data or spec, layer, lambda s: s.trtllm)
        if members is None:
            return
        name = spec.trtllm.format(layer=local) if local is not None else spec.trtllm
        if whole:
            out.append(members[0].whole(name))
        else:
            out.append(rank_slice(name, spec, members, tp_rank, tp, groups, padded, vllm_qkv_pieces))

    for name_spec, spec, layer, local in stage_weights(model, layers, first, last, tied_copy=True):
        # no parallel embedding: the first stage holds the whole table
        emit(name_spec, layer, local, whole=name_spec.stage == "first" and name_spec.split == "vocab", data=spec)
    return out


# ---------------------------------------------------------------------------------------------- reading

def _rank_files(path: str) -> dict[int, str]:
    found = {int(m.group(1)): os.path.join(path, n) for n in os.listdir(path) if (m := _FILE.match(n))}
    if not found:
        raise CheckpointError(f"{path} has no rank*.safetensors files")
    return found


def open_source(path: str, opts: Options) -> Source:
    config_path = os.path.join(path, CONFIG)
    trt = read_json_object(config_path, "a TensorRT-LLM checkpoint")
    named = trt.get("architecture")
    architecture = chosen_architecture(named if isinstance(named, str) else None, opts, config_path) or named
    if not isinstance(architecture, str):
        raise CheckpointError(f"{config_path} has no 'architecture'; pass --architecture")
    family = family_for_architecture(architecture, opts.mapping)
    mapping = trt.get("mapping") or {}
    tp, pp = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
    ranks = _rank_files(path)
    if sorted(ranks) != list(range(tp * pp)):
        missing = next((r for r in range(tp * pp) if r not in ranks), None)
        what = f"rank{missing}.safetensors is missing" if missing is not None else \
            f"rank{max(ranks)}.safetensors is beyond tp x pp = {tp * pp}"
        raise CheckpointError(f"{path}: {what} (config mapping: tp_size={tp}, pp_size={pp}); the checkpoint is "
                              "incomplete or mixed")
    files = [SafetensorsFile(ranks[r]) for r in range(tp * pp)]
    config, present = read_trtllm_config(trt, family, architecture, files, config_path)
    tied = bool(trt.get("tie_word_embeddings", False))
    model = build_canonical(family, config, present, tied)
    model.meaning = read_meaning(config, family, architecture, model.dims, present, tied, config_path)
    try:
        check_degrees(model, tp, pp)
    except PlanError as exc:
        raise CheckpointError(f"{path}: the files hold tp={tp}, pp={pp}, which this model cannot have: {exc}") \
            from None
    padded = padded_vocab(model.vocab_size, tp)
    stored: list[tuple[int, StoredTensor]] = []
    for p, layers in enumerate(stage_layers(model.num_layers, pp)):
        for t in range(tp):
            index = p * tp + t
            f = files[index]
            expected = rank_tensors(model, tp, t, layers, p == 0, p == pp - 1, padded)
            for tensor in expected:
                loc = f.tensors.get(tensor.name)
                if loc is None:
                    raise CheckpointError(f"{f.path}: tensor '{tensor.name}' is missing from the rank file")
                check_shape(f.path, tensor.name, loc.shape, tensor.shape)
                stored.append((index, tensor))
                for piece in tensor.pieces:
                    if piece.canonical:
                        model.dtypes.setdefault(piece.canonical, loc.dtype)
            unexpected = sorted(set(f.tensors) - {t.name for t in expected})
            if unexpected:
                raise CheckpointError(f"{f.path}: unexpected tensor '{unexpected[0]}' for mapping '{family.name}' "
                                      "(a config / weights mismatch, or a quantized checkpoint?)")
    info = {"config": config, "trtllm_config": trt, "padded_vocab": padded}
    return Source(layout=NAME, root=path, model=model, files=files, stored=stored, degrees={"tp": tp, "pp": pp},
                  info=info, side_files=find_side_files(path))


# ---------------------------------------------------------------------------------------------- writing

def targets(model: CanonicalModel, opts: Options, dtype: str) -> list[TargetSpec]:
    check_degrees(model, opts.tp, opts.pp)
    padded = padded_vocab(model.vocab_size, opts.tp)
    specs = []
    for p, layers in enumerate(stage_layers(model.num_layers, opts.pp)):
        for t in range(opts.tp):
            tensors = rank_tensors(model, opts.tp, t, layers, p == 0, p == opts.pp - 1, padded)
            specs.append(TargetSpec(f"rank{p * opts.tp + t}.safetensors", "safetensors", tensors,
                                    metadata={"format": "pt"}, rank={"tp": t, "pp": p}))
    return specs


class TRTLLMLayout(Layout):
    """TensorRT-LLM checkpoint: ``config.json`` + one safetensors file per (tp, pp) rank."""

    name = NAME
    summary = "TensorRT-LLM checkpoint for trtllm-build (config.json + rank*.safetensors)"
    specificity = 10  # a TensorRT-LLM folder also holds config.json and *.safetensors, as an HF one does
    rank_loader = "reshard.verification.forward.trtllm_rank:TrtllmRankStream"
    completion_markers = (CONFIG,)
    uses_options = frozenset()

    def detect(self, names) -> bool:
        return CONFIG in names and any(_FILE.match(n) for n in names)

    def open(self, root: str, opts: Options) -> Source:
        return open_source(root, opts)

    def targets(self, source: Source, opts: Options, dtype: str) -> TargetPlan:
        specs = targets(source.model, opts, dtype)
        loss = ConfigLoss("TensorRT-LLM", opts.allow_lossy_config)
        config = trtllm_config(source.model.meaning, source.model.family, dtype, opts.tp, opts.pp, loss)
        return TargetPlan(specs, state=config, notes=loss.check())

    def finalize(self, out: str, source: Source, plan, state) -> None:
        replace_with_text(os.path.join(out, CONFIG), json.dumps(state, indent=2) + "\n")  # last: the marker

    def remote_files(self, names: list[str], read_text) -> list[str]:
        return sorted(n for n in names if _FILE.match(n))

    def describe(self, source: Source) -> dict:
        return {"padded_vocab_size": source.info["padded_vocab"]}

    def rank_label(self, source: Source, relpath: str) -> str:
        return f"rank-{_FILE.match(os.path.basename(relpath)).group(1)}"
