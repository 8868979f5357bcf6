"""Tiny transformers vision-language models (Qwen2.5-VL, Qwen3-VL, Gemma 3, LLaVA, LLaVA-NeXT) built from config
objects, saved in the Hugging Face Hub spelling, rewritten into the other spellings transformers reads, and run
forward with a tiny image (no processor). Shared by the VLM tests (test_vlm*.py, test_vlm_rules.py).

Spellings of one model's tensor names (vlm.md §2.1; TF = transformers 5.24):

- hub: Qwen2.5-VL `model.*`, `visual.*`, `lm_head.weight`; Qwen3-VL `model.language_model.*`, `model.visual.*`,
  `lm_head.weight`; Gemma 3 / LLaVA `language_model.model.*`, `language_model.lm_head.weight` (LLaVA; Gemma 3 is
  tied: none on disk), `vision_tower.vision_model.*`, `multi_modal_projector.*`; LLaVA-NeXT: LLaVA's plus
  `image_newline`.
- v5: `model.language_model.*`, `lm_head.weight`, and the towers under `model.`: Qwen2.5-VL `model.visual.*`,
  Gemma 3 / LLaVA `model.vision_tower.*` (no `vision_model.`) and `model.multi_modal_projector.*` (LLaVA-NeXT also
  `model.image_newline`). Qwen3-VL: = hub.
- doubled (some transformers 5.x): v5 with the LM body at `model.language_model.model.*`.
- v5_vision_model (Gemma 3 / LLaVA / LLaVA-NeXT only): v5 with the tower at `model.vision_tower.vision_model.*`.
- fresh: Qwen = hub; Gemma 3 / LLaVA / LLaVA-NeXT: hub with the tower at `vision_tower.*` (no `vision_model.`).

``v5`` is what ``save_pretrained(save_original_format=False)`` writes, ``fresh`` what a plain ``save_pretrained``
of a model built from a config writes; test_vlm_rules.py checks both against TF's own files and that TF loads every
spelling to logits equal to the Hub folder's.

``FAMILIES`` are the four families every VLM test runs (test_vlm.py's round trip goes through Megatron);
``NEXT`` (LLaVA-NeXT, which reshard refuses to write to Megatron: no Megatron module holds ``image_newline``) is
tested by test_vlm_next.py; ``ALL_FAMILIES`` is both, for the fixtures' own checks (test_vlm_rules.py).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "gemma3", "llava")
NEXT = "llava_next"
ALL_FAMILIES = FAMILIES + (NEXT,)
SPELLINGS = ("hub", "v5", "doubled", "v5_vision_model", "fresh")
# Spellings ``respell`` writes for each family. Qwen towers have no `vision_model.` level; for Qwen the "fresh"
# spelling is the Hub one, and for Qwen3-VL "v5" is too (HUB_ALIASES).
FAMILY_SPELLINGS = {
    "qwen2_5_vl": ("hub", "v5", "doubled", "fresh"),
    "qwen3_vl": ("hub", "v5", "doubled", "fresh"),
    "gemma3": SPELLINGS,
    "llava": SPELLINGS,
    NEXT: SPELLINGS,
}
HUB_ALIASES = {"qwen2_5_vl": ("fresh",), "qwen3_vl": ("v5", "fresh"), "gemma3": (), "llava": (), NEXT: ()}
ARCHITECTURES = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    NEXT: "LlavaNextForConditionalGeneration",
}
WEIGHTS = "model.safetensors"
NOISE = 0.05

# Token ids of the image prompts (plan §7): Qwen image token 151 between vision start 153 / end 154; Gemma 3 image
# token 260 between boi 255 / eoi 256; LLaVA image token 260 (LLaVA-NeXT: as many as llava_next_image_tokens).
QWEN_IDS = [1, 5, 153] + [151] * 4 + [154, 7, 9, 11]
GEMMA3_IDS = [2, 5, 255] + [260] * 4 + [256, 7, 9, 11]
LLAVA_IDS = [1, 5] + [260] * 4 + [7, 9, 11]
TEXT_IDS = {"qwen2_5_vl": [1, 5, 7, 9, 150, 159, 2], "qwen3_vl": [1, 5, 7, 9, 150, 159, 2],
            "gemma3": [2, 5, 7, 9, 250, 299, 1], "llava": [1, 5, 7, 9, 250, 299, 2],
            NEXT: [1, 5, 7, 9, 250, 299, 2]}
# LLaVA-NeXT's image: (height, width) = (S, 2·S), which the pinpoint [S, 2S] holds exactly (no resize, no unpadding):
# the base view plus a 1 x 2 grid of S x S tiles.
NEXT_IMAGE = (1, 2)


#: LLaVA's and LLaVA-NeXT's tiny CLIP tower
CLIP_TINY = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                 num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)


def _llava_text(model_type: str, hidden: int) -> dict:
    """The tiny language model of LLaVA (``llama``) and LLaVA-NeXT (``mistral``)."""
    return dict(model_type=model_type, vocab_size=300, hidden_size=hidden, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                eos_token_id=2, pad_token_id=0)


def _settings(family: str, text_hidden: int) -> tuple[str, dict]:
    """(config class name, keyword arguments) of the tiny ``family`` model; every count divides TP 2 and PP 2.
    ``text_hidden`` 64 gives the text model head_dim 16, 128 head_dim 32 (vLLM CPU's attention needs >= 32)."""
    if text_hidden not in (64, 128):
        raise ValueError(f"text_hidden is 64 or 128, not {text_hidden}")
    d = text_hidden // 4
    mrope = [2, 3, 3] if d == 16 else [4, 6, 6]  # sums to d / 2
    if family == "qwen2_5_vl":
        return "Qwen2_5_VLConfig", dict(
            text_config=dict(vocab_size=160, hidden_size=text_hidden, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope}),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=text_hidden,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                               fullatt_block_indexes=[1], in_channels=3),
            image_token_id=151, video_token_id=152, vision_start_token_id=153, vision_end_token_id=154)
    if family == "qwen3_vl":
        return "Qwen3VLConfig", dict(
            text_config=dict(vocab_size=160, hidden_size=text_hidden, intermediate_size=96, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=d, max_position_embeddings=256,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope,
                                              "mrope_interleaved": True}),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=text_hidden,
                               patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                               deepstack_visual_indexes=[0, 1], in_channels=3),
            image_token_id=151, video_token_id=152, vision_start_token_id=153, vision_end_token_id=154)
    if family == "gemma3":
        return "Gemma3Config", dict(
            text_config=dict(vocab_size=300, hidden_size=text_hidden, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=d, max_position_embeddings=512,
                             sliding_window=16, query_pre_attn_scalar=d),
            vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                               image_size=56, patch_size=14, vision_use_head=False),
            mm_tokens_per_image=4, image_token_index=260, boi_token_index=255, eoi_token_index=256,
            bos_token_id=2, eos_token_id=1, pad_token_id=0)
    if family == "llava":
        # Lv = 3 and vision_feature_layer -2: vLLM builds only CLIP layers 0-1, and neither vLLM nor megatron-core
        # a post_layernorm.
        return "LlavaConfig", dict(text_config=_llava_text("llama", text_hidden), vision_config=dict(CLIP_TINY),
                                   image_token_index=260, vision_feature_layer=-2,
                                   vision_feature_select_strategy="default", projector_hidden_act="gelu")
    if family == NEXT:
        # LLaVA's tower (Lv = 3, vision_feature_layer -2: CLIP layer 2 and post_layernorm unused) over a Mistral
        # text model (LLaVA's case is Llama); anyres pinpoints of 1 x 1, 1 x 2 and 2 x 1 tiles of image_size 28.
        return "LlavaNextConfig", dict(
            text_config=_llava_text("mistral", text_hidden), vision_config=dict(CLIP_TINY),
            image_token_index=260, image_grid_pinpoints=[[28, 28], [28, 56], [56, 28]], vision_feature_layer=-2,
            vision_feature_select_strategy="default", projector_hidden_act="gelu")
    raise ValueError(f"unknown VLM family {family!r}; known: {', '.join(ALL_FAMILIES)}")


def _seed(family: str, text_hidden: int) -> int:
    return sum(map(ord, family)) + text_hidden


def perturb(model, seed: int):
    """Add seeded noise (``NOISE``) to every parameter, so norms and biases are not all ones / zeros."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * NOISE)
    return model


def build_config(family: str, text_hidden: int = 64):
    import transformers

    cls_name, settings = _settings(family, text_hidden)
    config = getattr(transformers, cls_name)(**settings)
    config.architectures = [ARCHITECTURES[family]]
    return config


def build_model(family: str, text_hidden: int = 64):
    """The tiny ``family`` model (fp32, eval) with seeded noise on every parameter; the same weights every call."""
    import transformers

    config = build_config(family, text_hidden)
    torch.manual_seed(0)
    model = getattr(transformers, ARCHITECTURES[family])(config).float().eval()
    return perturb(model, _seed(family, text_hidden))


# ---- spellings ---------------------------------------------------------------------------------------------------

def _sub(rules, name: str) -> str:
    """Apply every ``(pattern, replacement)`` rule in turn, each at most once."""
    for pattern, repl in rules:
        name = re.sub(pattern, repl, name, count=1)
    return name


# Hub -> spelling, per family kind ("qwen25": Qwen2.5-VL; "qwen3": Qwen3-VL; "tower": Gemma 3 / LLaVA).
_FROM_HUB = {
    ("qwen25", "v5"): [(r"^model\.", "model.language_model."), (r"^visual\.", "model.visual.")],
    ("qwen25", "doubled"): [(r"^model\.", "model.language_model.model."), (r"^visual\.", "model.visual.")],
    ("qwen3", "doubled"): [(r"^model\.language_model\.", "model.language_model.model.")],
    ("tower", "v5"): [(r"^language_model\.model\.", "model.language_model."),
                      (r"^language_model\.lm_head\.", "lm_head."),
                      (r"^vision_tower\.vision_model\.", "model.vision_tower."),
                      (r"^multi_modal_projector\.", "model.multi_modal_projector.")],
    ("tower", "doubled"): [(r"^language_model\.model\.", "model.language_model.model."),
                           (r"^language_model\.lm_head\.", "lm_head."),
                           (r"^vision_tower\.vision_model\.", "model.vision_tower."),
                           (r"^multi_modal_projector\.", "model.multi_modal_projector.")],
    ("tower", "v5_vision_model"): [(r"^language_model\.model\.", "model.language_model."),
                                   (r"^language_model\.lm_head\.", "lm_head."),
                                   (r"^vision_tower\.vision_model\.", "model.vision_tower.vision_model."),
                                   (r"^multi_modal_projector\.", "model.multi_modal_projector.")],
    ("tower", "fresh"): [(r"^vision_tower\.vision_model\.", "vision_tower.")],
}
# LLaVA-NeXT: LLaVA's rules plus image_newline under "model." in the transformers-5 spellings (TF conversion_mapping
# "llava_next": ^image_newline -> model.image_newline); a fresh save keeps the Hub name.
for _spelling in ("v5", "doubled", "v5_vision_model"):
    _FROM_HUB[("next", _spelling)] = _FROM_HUB[("tower", _spelling)] + [(r"^image_newline$", "model.image_newline")]
_FROM_HUB[("next", "fresh")] = _FROM_HUB[("tower", "fresh")]
# TF 5.24 fresh save -> Hub (only the CLIP / SigLIP towers differ).
_FRESH_TO_HUB = [(r"^vision_tower\.(?!vision_model\.)", "vision_tower.vision_model.")]


def _kind(family: str) -> str:
    if family not in ALL_FAMILIES:
        raise ValueError(f"unknown VLM family {family!r}; known: {', '.join(ALL_FAMILIES)}")
    return {"qwen2_5_vl": "qwen25", "qwen3_vl": "qwen3", NEXT: "next"}.get(family, "tower")


def spell_name(hub_name: str, family: str, spelling: str) -> str:
    """The name a tensor called ``hub_name`` in the Hub spelling has in ``spelling``."""
    if spelling not in FAMILY_SPELLINGS[family]:
        raise ValueError(f"{family} has no {spelling!r} spelling; it has {', '.join(FAMILY_SPELLINGS[family])}")
    if spelling == "hub" or spelling in HUB_ALIASES[family]:
        return hub_name
    return _sub(_FROM_HUB[(_kind(family), spelling)], hub_name)


def read_tensors(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(every tensor of ``folder``'s safetensors files, the metadata of the first)."""
    from safetensors import safe_open

    tensors, metadata = {}, None
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            metadata = metadata if metadata is not None else (f.metadata() or {})
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors, metadata or {}


def _write_tensors(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Replace ``folder``'s weights by one ``model.safetensors`` holding ``tensors`` (no index file)."""
    from safetensors.torch import save_file

    for path in list(folder.glob("*.safetensors")) + list(folder.glob("*.safetensors.index.json")):
        path.unlink()
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(folder / WEIGHTS),
              metadata={"format": "pt"})


def save_hub(family: str, folder: Path, text_hidden: int = 64) -> Path:
    """``build_model(family, text_hidden)`` saved to ``folder`` (config.json as transformers writes it, nested
    text_config / vision_config) with its tensors in the Hub spelling, fp32, one ``model.safetensors``."""
    folder = Path(folder)
    build_model(family, text_hidden).save_pretrained(folder)
    tensors, _ = read_tensors(folder)
    tower = _kind(family) in ("tower", "next")
    _write_tensors(folder, {_sub(_FRESH_TO_HUB, k) if tower else k: v for k, v in tensors.items()})
    return folder


def respell(src: Path, dst: Path, family: str, spelling: str) -> Path:
    """A copy of the Hub-spelling folder ``src`` at ``dst`` (config.json and every other non-weight file as they
    are) whose tensor names are in ``spelling`` (one of FAMILY_SPELLINGS[family])."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy2(path, dst / path.name)
    tensors, _ = read_tensors(src)
    renamed = {spell_name(k, family, spelling): v for k, v in tensors.items()}
    assert len(renamed) == len(tensors), f"{family} {spelling}: two tensors got one name"
    _write_tensors(dst, renamed)
    return dst


# ---- inputs and forward ------------------------------------------------------------------------------------------

def _get(config, key: str):
    return config[key] if isinstance(config, dict) else getattr(config, key)


def image_inputs(family: str, config) -> dict:
    """Seeded forward inputs with one image for ``family``'s tiny model (``config``: the model's config object or
    its config.json dict; only the vision sizes are read from it):
    - Qwen2.5-VL / Qwen3-VL: ``pixel_values [grid_t·h·w, C·tps·p·p]`` with ``image_grid_thw [[1, 4, 4]]`` (16
      patches, 4 merged image tokens between the vision start / end ids); Qwen3-VL also ``mm_token_type_ids`` (1 at
      image tokens; transformers 5.24 needs it with images).
    - Gemma 3: ``pixel_values [1, C, S, S]`` and ``mm_tokens_per_image`` (4) image tokens between boi / eoi.
    - LLaVA: ``pixel_values [1, C, S, S]`` and (S / p)² = 4 image tokens (the CLS output is dropped).
    - LLaVA-NeXT: an image of (S, 2·S) (``NEXT_IMAGE`` tiles): ``pixel_values [1, 1 + 2, C, S, S]`` (the base view,
      then the tiles), ``image_sizes [[S, 2·S]]`` and ``llava_next_image_tokens`` = 14 image tokens."""
    vision = _get(config, "vision_config")
    generator = torch.Generator().manual_seed(_seed(family, 0))
    if family in ("qwen2_5_vl", "qwen3_vl"):
        p, tps, c = _get(vision, "patch_size"), _get(vision, "temporal_patch_size"), _get(vision, "in_channels")
        ids = torch.tensor([QWEN_IDS])
        inputs = {"input_ids": ids, "pixel_values": torch.randn(16, c * tps * p * p, generator=generator),
                  "image_grid_thw": torch.tensor([[1, 4, 4]])}
        if family == "qwen3_vl":
            inputs["mm_token_type_ids"] = (ids == _get(config, "image_token_id")).long()
        return inputs
    size = _get(vision, "image_size")
    if family == NEXT:
        rows, cols = NEXT_IMAGE
        assert [rows * size, cols * size] in [list(p) for p in _get(config, "image_grid_pinpoints")]
        ids = [1, 5] + [_get(config, "image_token_index")] * llava_next_image_tokens(config) + [7, 9, 11]
        return {"input_ids": torch.tensor([ids]),
                "pixel_values": torch.randn(1, 1 + rows * cols, _get(vision, "num_channels"), size, size,
                                            generator=generator),
                "image_sizes": torch.tensor([[rows * size, cols * size]])}
    ids = GEMMA3_IDS if family == "gemma3" else LLAVA_IDS
    if family == "llava":
        assert ids.count(260) == (size // _get(vision, "patch_size")) ** 2
    return {"input_ids": torch.tensor([ids]), "pixel_values": torch.randn(1, 3, size, size, generator=generator)}


def llava_next_image_tokens(config) -> int:
    """Image tokens of ``NEXT_IMAGE`` (written from transformers' pack_image_features, "spatial_unpad" with
    vision_feature_select_strategy "default"): the base view's g² features (g = S / p), then the tiles' features as
    a (rows·g) x (cols·g) grid (nothing to unpad: the image fills it) with image_newline after each of its rows."""
    vision = _get(config, "vision_config")
    assert _get(config, "vision_feature_select_strategy") == "default"
    g = _get(vision, "image_size") // _get(vision, "patch_size")
    rows, cols = NEXT_IMAGE
    return g * g + rows * g * (cols * g + 1)


def load(folder: Path, family: str):
    """transformers' ``from_pretrained(folder)`` in fp32, eval; raises when a tensor is missing or unexpected."""
    import transformers

    cls = getattr(transformers, ARCHITECTURES[family])
    model, info = cls.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not problems, f"{family} {folder}: transformers loaded with {problems}"
    return model.eval()


def model_logits(model, family: str, inputs: dict | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model(**(inputs if inputs is not None else image_inputs(family, model.config))).logits


def logits(folder: Path, family: str) -> torch.Tensor:
    """Logits of ``from_pretrained(folder)`` (fp32) on ``image_inputs(family, config)``."""
    return model_logits(load(folder, family), family)


def text_logits(folder: Path, family: str, ids=None) -> torch.Tensor:
    """Logits of ``from_pretrained(folder)`` (fp32) on the text-only prompt ``ids`` (default TEXT_IDS[family])."""
    ids = torch.tensor([TEXT_IDS[family] if ids is None else list(ids)])
    return model_logits(load(folder, family), family, {"input_ids": ids})


def config_of(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


# ---- refusal cases -----------------------------------------------------------------------------------------------

def save_mllama(folder: Path) -> Path:
    """A tiny ``MllamaForConditionalGeneration`` (Llama 3.2 Vision) HF folder: a VLM family reshard does not
    support. Names: ``language_model.model.*`` (embed_tokens V + 8 rows), ``language_model.lm_head.weight``,
    ``vision_model.*``, ``multi_modal_projector.*``."""
    import transformers

    config = transformers.MllamaConfig(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
                         num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[1, 3],
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_layers_indices=[0], num_hidden_layers=2,
                           num_global_layers=1, attention_heads=2, image_size=28, patch_size=14, max_num_tiles=2,
                           vision_output_dim=64, intermediate_size=48,
                           supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]]),
        image_token_index=260)
    config.architectures = ["MllamaForConditionalGeneration"]
    torch.manual_seed(0)
    model = perturb(transformers.MllamaForConditionalGeneration(config).float().eval(), _seed("mllama", 0))
    model.save_pretrained(folder)
    return Path(folder)


def save_indivisible_qwen25(folder: Path) -> Path:
    """A Hub-spelling Qwen2.5-VL whose vision tower has 3 heads (``vision_config.num_heads = 3``, hidden 48, one
    block): its vision tower cannot split at TP 2 (the text model can)."""
    import transformers

    cls_name, settings = _settings("qwen2_5_vl", 64)
    settings["vision_config"] = dict(settings["vision_config"], depth=1, hidden_size=48, num_heads=3,
                                     fullatt_block_indexes=[0])
    config = getattr(transformers, cls_name)(**settings)
    config.architectures = [ARCHITECTURES["qwen2_5_vl"]]
    torch.manual_seed(0)
    model = perturb(transformers.Qwen2_5_VLForConditionalGeneration(config).float().eval(), _seed("qwen25_nv3", 0))
    model.save_pretrained(folder)
    return Path(folder)
