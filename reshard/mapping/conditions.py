"""The expressions a mapping file writes as strings and reshard evaluates against a config: ``when`` conditions
(:func:`config_condition`), config keys (:func:`lookup`: dotted into nested tables, ``count:`` of a list) and integer
shape expressions over dims symbols (:func:`evaluate`).
"""

from __future__ import annotations

import ast

from reshard.errors import MappingError


def lookup(config: dict, key: str):
    """``config[key]``, a dotted key looked up in nested tables (a VLM's ``vision_config.hidden_size``);
    ``count:KEY``: the length of a list value, 1 for a scalar, None when unset."""
    if "." not in key and ":" not in key:
        return config.get(key)
    count = key.startswith("count:")
    value = config
    for part in key.removeprefix("count:").split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if count and value is not None:
        return len(value) if isinstance(value, list) else 1
    return value


def _parse_condition(condition: str) -> tuple[str, str, object]:
    """``(key, op, value)`` of a mapping's config condition; ``op`` is ``==``, ``!=``, ``set`` or ``unset``."""
    text = condition.strip()
    op, value = ("unset" if text.startswith("!") else "set"), None
    key = text.lstrip("!").strip()
    for comparison in ("==", "!="):
        if comparison in text:
            key, literal = (part.strip() for part in text.split(comparison, 1))
            try:
                op, value = comparison, ast.literal_eval(literal)
            except (ValueError, SyntaxError):
                raise MappingError(f"condition '{text}': '{literal}' is not a string, number or bool") from None
            break
    if not key.isidentifier():
        raise MappingError(f"condition {condition!r} must be 'KEY', '!KEY' or \"KEY == 'value'\"")
    return key, op, value


def config_condition(condition: str, config: dict) -> bool:
    """A mapping's config condition: ``KEY`` (set and not null, 0 or false), ``!KEY`` (the opposite), or
    ``KEY == 'value'`` / ``KEY != 'value'`` (a Python string, number or bool literal compared with the key's
    value)."""
    key, op, value = _parse_condition(condition)
    if op in ("==", "!="):
        return (config.get(key) == value) == (op == "==")
    return bool(config.get(key)) == (op == "set")


def _check_condition(source: str, where: str, condition) -> None:
    if not isinstance(condition, str):
        raise MappingError(f"{source}: {where} condition {condition!r} must be 'KEY', '!KEY' or \"KEY == 'value'\"")
    try:
        _parse_condition(condition)
    except MappingError as exc:
        raise MappingError(f"{source}: {where} {exc}") from None


_ALLOWED_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
                ast.FloorDiv: lambda a, b: a // b}


def evaluate(expr: str, symbols: dict[str, int]) -> int:
    """Evaluate an integer shape expression over dimension symbols (``+ - * //`` and integers only)."""

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return symbols[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _ALLOWED_OPS:
            return _ALLOWED_OPS[type(node.op)](walk(node.left), walk(node.right))
        raise MappingError(f"unsupported shape expression '{expr}': use integers, symbols and + - * //")

    return walk(ast.parse(expr, mode="eval"))


def _names_in(expr: str) -> set[str]:
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise MappingError(f"invalid shape expression '{expr}': {exc.msg}") from None
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
