"""The shipped mapping files (``mappings/*.toml``, ``reshard/mappings/`` when installed) and the text family of an
architecture: a user's ``--mapping`` file, else the shipped file that lists it.

resolve.py adds the vision-language families (composed per config by vlm.py) on top of this lookup.
"""

from __future__ import annotations

import functools
import tomllib
from importlib import resources
from pathlib import Path

from reshard.errors import MappingError
from reshard.mapping.family import Family
from reshard.mapping.parsing import load_family_file, parse_family
from reshard.mapping.schema import _suggest


def shipped_mappings_dir():
    """The folder of shipped mapping files: ``reshard/mappings/`` inside an installed wheel or sdist, else the
    repository's top-level ``mappings/`` (a source checkout or an editable install)."""
    packaged = resources.files("reshard") / "mappings"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "mappings"


def shipped_mapping_text(name: str) -> str:
    """The text of shipped mapping ``name`` (see :func:`shipped_mapping_names`)."""
    names = shipped_mapping_names() + shipped_mapping_names(multimodal=True)
    if name not in names:
        raise MappingError(f"no shipped mapping '{name}'{_suggest(name, names)}")
    return (shipped_mappings_dir() / f"{name}.toml").read_text()


def shipped_mapping_names(multimodal: bool = False) -> list[str]:
    """The shipped text-family mapping files (``multimodal``: the vision-language ones, vlm.py)."""
    names = sorted(p.name[:-5] for p in shipped_mappings_dir().iterdir() if p.name.endswith(".toml"))
    return [n for n in names if _is_multimodal_file(n) == multimodal]


@functools.lru_cache(maxsize=None)
def _is_multimodal_file(name: str) -> bool:
    data = tomllib.loads((shipped_mappings_dir() / f"{name}.toml").read_text())
    return "text" in data or "extends" in data.get("family", {})  # vlm.py's files


def load_shipped(name: str) -> Family:
    return parse_family(tomllib.loads(shipped_mapping_text(name)), f"mappings/{name}.toml")


def text_family_for_architecture(architecture: str, mapping_file: str | Path | None = None) -> Family | None:
    """The text family whose mapping lists ``architecture`` (None when no shipped one does); a user's ``--mapping``
    file takes precedence. :func:`reshard.mapping.family_for_architecture` also composes vision-language
    families."""
    if mapping_file is not None:
        fam = load_family_file(mapping_file)
        if architecture not in fam.architectures:
            raise MappingError(f"mapping {mapping_file} does not list architecture '{architecture}' "
                               f"(it lists {', '.join(fam.architectures)})")
        return fam
    for name in shipped_mapping_names():
        fam = load_shipped(name)
        if architecture in fam.architectures:
            return fam
    return None


def text_architectures() -> list[str]:
    return [a for name in shipped_mapping_names() for a in load_shipped(name).architectures]
