"""Vision towers in the layouts: which Megatron layout a tower takes, what TP degrees it splits over, and the tower
tensors a source does not hold (vLLM builds no CLIP layer past LLaVA's ``vision_feature_layer``, neither vLLM nor
megatron-core a ``post_layernorm``; an engine served text only has no tower at all).
"""

from __future__ import annotations

import dataclasses

from reshard.core.canonical import CanonicalModel
from reshard.errors import PlanError
from reshard.mapping import evaluate

#: Layouts that hold a vision tower (the others refuse a vision-language model).
TOWER_LAYOUTS = ("hf", "megatron", "torch_dist", "vllm")
MEGATRON_LAYOUTS = ("megatron", "torch_dist")
VLLM_VISIONS = ("weights", "data", "none")


def megatron_vision(model: CanonicalModel, choice: str | None) -> str:
    """The Megatron vision layout for ``model``: ``choice`` (``--megatron-vision hf|native``) or the family's
    default; a layout no framework builds for the family is refused with the reason."""
    mm = model.family.multimodal
    if mm is None:
        if choice is not None:
            raise PlanError(f"--megatron-vision is for vision-language models; {model.family.name} has no vision "
                            "tower: drop it")
        return "hf"
    vision = choice or mm.megatron_default
    if vision not in ("hf", "native"):
        raise PlanError(f"--megatron-vision {vision}: use hf (the tower's HF modules, whole on every TP rank) or "
                        "native (vision_model.decoder.layers.*, split at the language model's TP)")
    refusal = mm.refusal(vision)
    if refusal:
        what = f"--megatron-vision {vision}" if choice else f"the default Megatron vision layout ({vision})"
        raise PlanError(f"{what} for {model.family.name}: {refusal}")
    return vision


def layout_kind(layout: str, model: CanonicalModel, opts) -> str:
    """The name a weight's ``absent_in`` uses for the target: vllm, megatron_native, or the layout's own."""
    if layout in MEGATRON_LAYOUTS:
        return "megatron_native" if megatron_vision(model, opts.megatron_vision) == "native" else "megatron_hf"
    return layout


def check_tower_degrees(model: CanonicalModel, tp: int, kind: str) -> None:
    """Refuse a TP degree the vision tower cannot split over in layout ``kind`` (vllm | megatron_native; the HF
    modules of ``megatron_hf`` are whole on every rank): heads and every split width must divide, independently of
    the language model (vLLM issue 24004)."""
    mm = model.family.multimodal
    if mm is None or tp == 1:
        return
    config_key = next((model.family.dim_key(s.heads) for s in model.family.weights if s.heads), None)
    for tensor in model.tensors.values():
        spec = tensor.spec
        if not spec.tower or not spec.held_in(kind):
            continue
        split = spec.split_in("megatron" if kind.startswith("megatron") else kind,
                              "native" if kind == "megatron_native" else "hf")
        if split == "qkv" and model.dims[spec.heads] % tp:
            raise PlanError(f"the vision tower's {model.dims[spec.heads]} attention heads ({config_key}) do not split "
                            f"over tp={tp} ({tensor.name}); choose a tp that divides them"
                            + (", or --megatron-vision hf (the tower whole on every rank)"
                               if kind == "megatron_native" and not mm.refusal("hf") else "")
                            + (", or --vllm-vision data (the tower whole on every rank)"
                               if kind == "vllm" and mm.vllm_data else ""))
        if split in ("column", "row", "gate_up") and tensor.shape[spec.axis] % tp:
            raise PlanError(f"the vision tower's {tensor.name} has {tensor.shape[spec.axis]} "
                            f"{'rows' if spec.axis == 0 else 'columns'} to split, which do not divide over tp={tp}; "
                            "choose a tp that divides them")


def refuse_multimodal(model: CanonicalModel, layout: str) -> None:
    """A layout without vision towers refuses a vision-language model before anything is written."""
    if model.family.multimodal is not None and layout not in TOWER_LAYOUTS:
        raise PlanError(f"the {layout} layout carries no vision tower, and {model.family.name} is a vision-language "
                        f"model: convert it to {', '.join(TOWER_LAYOUTS)}")


def absent_tensors(source) -> list[str]:
    """The canonical tensors no stored tensor of ``source`` holds (in canonical order)."""
    held = {p.canonical for _, t in source.stored for p in t.pieces if p.canonical}
    return [name for name in source.model.tensors if name not in held]


def unused_tower_tensor(model: CanonicalModel, tensor) -> bool:
    """Whether ``tensor`` is a vision-tower tensor the model does not use (LLaVA's CLIP blocks past
    ``vision_feature_layer``, ``post_layernorm``): a folder written with ``--allow-missing vision`` lacks them."""
    return all((t := model.tensors.get(p.canonical)) is not None and t.spec.tower and "vllm" in t.spec.absent_in
               for p in tensor.pieces)


def without(model: CanonicalModel, names: set[str]) -> CanonicalModel:
    kept = {n: t for n, t in model.tensors.items() if n not in names}
    return dataclasses.replace(model, tensors=kept, dtypes={n: d for n, d in model.dtypes.items() if n in kept})


def drop_unheld(source, layout: str, opts) -> list[str]:
    """Tower tensors the source does not hold (a vLLM or native-Megatron LLaVA; a text-only vLLM folder) leave the
    model: silently where the target does not hold them either, with a note under ``--allow-missing vision``, and
    refused otherwise naming them. Also a text-only vLLM output (``--vllm-vision none``) leaves the tower out."""
    model = source.model
    if model.family.multimodal is None:
        if "vision" in opts.allow_missing or opts.vllm_vision != "weights":
            raise PlanError(f"--allow-missing vision and --vllm-vision are for vision-language models; "
                            f"{model.family.name} has no vision tower: drop them")
        return []
    if opts.vllm_vision not in VLLM_VISIONS:
        raise PlanError(f"--vllm-vision {opts.vllm_vision}: use weights (the tower split as vLLM splits it), data "
                        "(whole on every rank: mm_encoder_tp_mode=\"data\") or none (no tower: an engine with "
                        "limit_mm_per_prompt all 0)")
    if opts.vllm_vision == "data" and not model.family.multimodal.vllm_data:
        raise PlanError(f"--vllm-vision data: vLLM 0.32's {model.family.name} does not support mm_encoder_tp_mode="
                        "\"data\" (it falls back to splitting the tower): drop it")
    if opts.vllm_vision != "weights" and layout != "vllm":
        raise PlanError("--vllm-vision is for --to vllm: drop it")
    notes = []
    absent = absent_tensors(source)
    kind = layout_kind(layout, model, opts)
    needed = [n for n in absent if model.tensors[n].spec.held_in(kind) and not
              (layout == "vllm" and opts.vllm_vision == "none")]
    if needed and "vision" not in opts.allow_missing:
        shown = ", ".join(needed[:3]) + (f" and {len(needed) - 3} more" if len(needed) > 3 else "")
        raise PlanError(f"{len(needed)} vision tensors are not in the source ({shown}): vLLM builds only the "
                        "tower layers the model uses (LLaVA: up to vision_feature_layer) and megatron-core no "
                        f"post_layernorm, or the source was written text only; the {layout} output needs them. "
                        "Pass --allow-missing vision to write it without them (transformers initialises them on "
                        "load; LLaVA's logits do not use them)")
    if needed:
        notes.append(f"--allow-missing vision: wrote the output without {len(needed)} vision tensors the source does "
                     f"not hold ({', '.join(needed[:3])}{', ...' if len(needed) > 3 else ''})")
    dropped = set(absent)
    if layout == "vllm" and opts.vllm_vision == "none":
        tower = {n for n, t in model.tensors.items() if t.spec.tower and not t.spec.vllm_text_only}
        notes.append(f"--vllm-vision none: wrote the language model only ({len(tower)} vision tensors left out), for "
                     "an engine with limit_mm_per_prompt all 0")
        dropped |= tower
    if dropped:
        source.model = without(model, dropped)
    return notes


def tower_views(model: CanonicalModel, spec_name: str, vision: str) -> dict[str, tuple[int, ...]]:
    """Tower tensors Megatron stores under another shape of the same bytes (native CLIP's class token
    ``[1, 1, H]``): stored name -> that shape."""
    return {spec.megatron_name(spec_name, vision=vision): tuple(evaluate(e, model.dims) for e in spec.megatron_shape)
            for spec in model.family.weights if spec.megatron_shape and vision == "native"}


def check_megatron_tower(model: CanonicalModel, opts) -> None:
    """A vision tower's Megatron layout is one its family has, its split divides ``--tp`` (native), and Qwen3-VL's
    DeepStack features reach language-model layers held by the first stage (Megatron-Bridge's requirement)."""
    mm = model.family.multimodal
    vision = megatron_vision(model, opts.megatron_vision)
    if mm is None:
        return
    if vision == "native":
        check_tower_degrees(model, opts.tp, "megatron_native")
    if mm.deepstack > model.num_layers // opts.pp:
        raise PlanError(f"Qwen3-VL adds its {mm.deepstack} DeepStack features to the first {mm.deepstack} language "
                        f"model layers, which must all be on the first pipeline stage: pp={opts.pp} gives it "
                        f"{model.num_layers // opts.pp}; choose a smaller --pp")
