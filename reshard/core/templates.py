"""Matching stored tensor names against a mapping's name templates (``model.layers.{layer}.mlp.experts.{expert}.w1``):
which layer and expert a name instantiates a template at."""

from __future__ import annotations

import functools
import re


@functools.lru_cache(maxsize=None)
def _template_pattern(template: str) -> tuple[re.Pattern, tuple[str, ...]]:
    """A template's compiled pattern and the order of its placeholders (compiled once: every stored name of a
    checkpoint is matched against every template)."""
    parts = re.split(r"(\{layer\}|\{expert\})", template)
    pattern = "".join("(\\d+)" if p in ("{layer}", "{expert}") else re.escape(p) for p in parts)
    return re.compile(pattern), tuple(p for p in parts if p in ("{layer}", "{expert}"))


def template_match(template: str, name: str) -> tuple[int | None, int | None] | None:
    """(layer, expert) that ``name`` instantiates ``template`` at (None where it has no such placeholder), or None."""
    if "{layer}" not in template:
        return (None, None) if template == name else None
    pattern, order = _template_pattern(template)
    m = pattern.fullmatch(name)
    if m is None:
        return None
    found = dict(zip(order, map(int, m.groups())))
    return found.get("{layer}"), found.get("{expert}")
