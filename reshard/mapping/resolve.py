"""An architecture's family: a user's ``--mapping`` file or a shipped text family (shipped.py), else a shipped
vision-language file composed for the model's config (vlm.py), else refused naming what is supported.

The shipped vision-language files are read once, unbound (:func:`vlm_templates`); every VLM lookup composes from
them.
"""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass

from reshard.errors import MappingError, PlanError
from reshard.mapping.defaults import check_vlm_defaults
from reshard.mapping.family import Family
from reshard.mapping.shipped import (load_shipped, shipped_mapping_names, shipped_mapping_text, text_architectures,
                                     text_family_for_architecture)
from reshard.mapping.vlm import check_vlm_file, compose, extended
from reshard.mapping.vlm_config import flat_view


@dataclass
class _Template:
    """A shipped VLM mapping file, unbound: its name, its tables (``extends`` resolved), where it came from."""

    name: str
    data: dict
    source: str
    architectures: tuple[str, ...] = ()


@functools.lru_cache(maxsize=None)
def vlm_templates() -> tuple[_Template, ...]:
    """The shipped VLM mapping files, unbound (read once: every family lookup of a VLM goes through them)."""

    def load(name: str) -> dict:
        return tomllib.loads(shipped_mapping_text(name))

    out = []
    for name in shipped_mapping_names(multimodal=True):
        data = extended(load(name), load)
        check_vlm_file(data, f"mappings/{name}.toml")
        check_vlm_defaults(data, load_shipped(data["text"]["family"]), f"mappings/{name}.toml")
        out.append(_Template(name, data, f"mappings/{name}.toml", tuple(data["family"]["architectures"])))
    return tuple(out)


def multimodal_architectures() -> list[str]:
    return [a for t in vlm_templates() for a in t.architectures]


def vlm_family(architecture: str, config: dict | None) -> Family | None:
    """The composed family of VLM ``architecture`` for ``config`` (None when no VLM file lists it); refused
    without a config (a layout that carries no vision tower)."""
    for template in vlm_templates():
        if architecture in template.architectures:
            if config is None:
                raise PlanError(f"{architecture} is a vision-language model: this layout carries no vision tower; "
                                "convert it between hf, megatron, torch_dist and vllm")
            return compose(template.data, template.source, flat_view(config))
    return None


def refuse_unknown_multimodal(architecture: str, config: dict) -> None:
    """A config with a ``vision_config`` whose architecture no mapping lists: refused naming what is supported."""
    if isinstance(config.get("vision_config"), dict):
        raise PlanError(f"{architecture} is a vision-language model reshard does not support; supported "
                        f"multimodal architectures: {', '.join(multimodal_architectures())}")


def family_for_architecture(architecture: str, mapping_file=None, config: dict | None = None) -> Family:
    """The family whose mapping lists ``architecture``; a user's ``--mapping`` file takes precedence. A
    vision-language architecture's family is composed for ``config``; an unknown one with a vision tower is refused
    naming the supported ones."""
    family = text_family_for_architecture(architecture, mapping_file)
    if family is not None:
        return family
    composed = vlm_family(architecture, config)
    if composed is not None:
        return composed
    refuse_unknown_multimodal(architecture, config or {})
    raise MappingError(f"unknown architecture '{architecture}' (known: {', '.join(text_architectures())}, "
                       f"{', '.join(multimodal_architectures())}); pass --mapping FILE with a mapping file for your "
                       "family")
