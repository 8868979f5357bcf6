"""The Hugging Face name spellings of a vision-language model (a mapping file's ``[hf] read`` / ``v5`` tables).

Canonical names are the Hub spelling transformers 4 wrote (Qwen2.5-VL ``model.*`` + ``visual.*``; LLaVA and Gemma 3
``language_model.model.*`` + ``vision_tower.vision_model.*``). transformers 5 keeps another in memory and writes it
with ``save_original_format=False`` (``model.language_model.*``, ``model.visual.*``, ``model.vision_tower.*``);
some 5.x versions wrote a doubled ``.model.model``; a fresh 5.x save of a CLIP / SigLIP tower lacks the
``vision_model.`` level. Every spelling is read; the Hub one is written unless ``--hf-spelling v5``.
"""

from __future__ import annotations

from dataclasses import replace

from reshard.core.canonical import match_template
from reshard.core.pieces import StoredTensor
from reshard.errors import PlanError

SPELLINGS = ("hub", "v5")


def canonical_name(rules, name: str) -> str:
    """``name`` under the first ``(prefix, canonical prefix)`` rule whose prefix it starts with (unchanged when
    none does)."""
    for prefix, canonical in rules:
        if name.startswith(prefix):
            return canonical + name[len(prefix):]
    return name


def respell_read(family, where: dict[str, int], notes: list[str]) -> dict[str, str]:
    """Rename ``where``'s stored names (name -> file index) to the canonical spelling; returns canonical name ->
    the file's name for each renamed one. A name already canonical is kept (``model.visual.x`` of Qwen3-VL)."""
    rules = family.multimodal.read
    renamed = {}
    for name in list(where):
        if match_template(family, name, stored=True) is not None:
            continue
        canonical = canonical_name(rules, name)
        if canonical != name and canonical not in where and match_template(family, canonical, stored=True):
            where[canonical] = where.pop(name)
            renamed[canonical] = name
    if renamed:
        notes.append(f"read {len(renamed)} tensor names in another transformers spelling (e.g. "
                     f"{min(renamed.values())}); the output uses the Hub spelling"
                     + (" unless --hf-spelling v5" if family.multimodal.v5 else ""))
    return renamed


def respell_write(family, tensors: list[StoredTensor], spelling: str) -> list[StoredTensor]:
    """``tensors`` under ``spelling``'s names: ``hub`` (canonical) or ``v5`` (transformers 5's own)."""
    if spelling not in SPELLINGS:
        raise PlanError(f"--hf-spelling {spelling}: use {' or '.join(SPELLINGS)}")
    if not family.multimodal and spelling != "hub":
        raise PlanError(f"--hf-spelling v5 is for vision-language models; {family.name} has one spelling: drop it")
    if spelling == "hub" or not family.multimodal.v5:  # Qwen3-VL: transformers 5 writes the Hub names
        return tensors
    return [replace(t, name=canonical_name(family.multimodal.v5, t.name)) for t in tensors]
