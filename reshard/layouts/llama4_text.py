"""Llama 4's multimodal release (``Llama4ForConditionalGeneration``, ``model_type llama4``: Llama-4-Scout-17B-16E,
Llama-4-Maverick-17B-128E and their -Instruct) read as its text model (families-2.md section 3.1): the
``text_config`` as a ``Llama4ForCausalLM`` config and the ``language_model.`` tensors under the text model's names;
the vision tower (``vision_model.*``) and the projector (``multi_modal_projector.*``) are left out with a note
(reshard has no Llama 4 vision mapping). Every output is then a ``Llama4ForCausalLM``."""

from __future__ import annotations

from reshard.errors import CheckpointError

MULTIMODAL = "Llama4ForConditionalGeneration"
TEXT = "Llama4ForCausalLM"
#: The text model's tensors in the Hub spelling (transformers 4 and 5's saves) and transformers 5's own.
TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                 ("model.language_model.", "model."))
VISION_PREFIXES = ("vision_model.", "multi_modal_projector.", "model.vision_model.", "model.multi_modal_projector.")
#: Top-level settings of the multimodal config the text model's config takes when its text_config leaves them out.
CARRIED = ("tie_word_embeddings", "torch_dtype", "dtype")


def text_view(config: dict, architecture: str | None) -> tuple[dict, str | None, bool]:
    """(config, architecture, text only): a ``Llama4ForConditionalGeneration`` config as its text model's
    ``Llama4ForCausalLM`` config; any other unchanged."""
    if architecture != MULTIMODAL:
        return config, architecture, False
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"a {MULTIMODAL} config.json needs a text_config object (the language model's "
                              "settings); fix the config")
    text = dict(text)
    for key in CARRIED:
        if key in config and key not in text:
            text[key] = config[key]
    text.update(architectures=[TEXT], model_type="llama4_text")
    return text, TEXT, True


def text_names(where: dict[str, int], notes: list[str]) -> dict[str, str]:
    """Rename the text model's tensors in ``where`` (name -> file index) to ``Llama4ForCausalLM``'s names and drop
    the vision tensors, with a note; returns the text model's name -> the file's name."""
    renamed, vision = {}, 0
    for name in list(where):
        if name.startswith(VISION_PREFIXES):
            del where[name]
            vision += 1
            continue
        for old, new in TEXT_PREFIXES:
            if name.startswith(old):
                where[new + name[len(old):]] = where.pop(name)
                renamed[new + name[len(old):]] = name
                break
    notes.append(f"read the text model of {MULTIMODAL} (language_model.*) as a {TEXT}; its {vision} vision tensors "
                 "(vision_model.*, multi_modal_projector.*) are not converted: reshard has no Llama 4 vision mapping, "
                 f"so the output is the text model alone ({TEXT})")
    return renamed
