"""Side files: the non-weight files a Hugging Face model folder needs to load, found in a source's folders and
carried by every output (a Megatron, torch_dist or vLLM folder holds them at its root, so a conversion back to HF
restores them).

They are the standard tokenizer / generation-config / processor files (:data:`STANDARD`), the files
``tokenizer_config.json`` declares (``*_file`` keys) or its tokenizer module declares (``vocab_files_names``),
and the remote code ``auto_map`` names in ``config.json`` and the JSON side files, with the sibling modules it
imports. Where the output's ``config.json`` names remote code the output does not hold, :func:`prune_auto_map`
drops its ``auto_map`` (a config that names missing code cannot load)."""

from __future__ import annotations

import ast
import errno
import json
import os
import stat

from reshard.errors import CheckpointError, OutputError, os_error_message
from reshard.io.regular import open_regular

#: Non-weight files that travel with a checkpoint (tokenizer, generation config).
SIDE_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
)
#: Tokenizer files transformers looks for by name, besides :data:`SIDE_FILES`.
STANDARD = SIDE_FILES + ("tiktoken.model", "vocab.txt", "spiece.model", "sentencepiece.bpe.model",
                         "tokenizer.tiktoken", "qwen.tiktoken")
#: Names a side file never has: the files each layout writes itself.
RESERVED = frozenset({"config.json", "reshard.json", "latest_checkpointed_iteration.txt"})
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".distcp", ".metadata")
#: JSON side files whose ``auto_map`` names remote code (config.json's is passed as a dict).
_MAPPED = ("tokenizer_config.json", "preprocessor_config.json", "processor_config.json",
           "video_preprocessor_config.json")


def is_file(path: str) -> bool:
    """Whether ``path`` (symlinks followed) is a regular file; missing is False, any other OS error (a symlink
    loop, ELOOP) is an :class:`OutputError`, exit 3, worded as a weight file's."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return False
        raise OutputError(os_error_message(exc, path)) from exc


def _plain_name(name: object) -> bool:
    """A bare file name a side file may have: no folder part, not reserved, not a weight file."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and os.sep not in name
            and name not in RESERVED and not name.endswith(_WEIGHT_SUFFIXES))


def _read_json(path: str) -> dict:
    """The JSON object in side file ``path``, or {} where it is not valid JSON or not an object."""
    try:
        with open_regular(path, "rb") as f:
            data = json.loads(f.read())
    except OSError as exc:
        raise OutputError(os_error_message(exc, path)) from exc
    except (ValueError, CheckpointError):  # not JSON (UnicodeDecodeError is a ValueError), or not a regular file
        return {}
    return data if isinstance(data, dict) else {}


def auto_map_modules(auto_map: object) -> list[str]:
    """The local module files (``name.py``) an ``auto_map`` names, in order: each value is ``"module.Class"``, a
    list of them (a tokenizer's slow and fast classes, ``null`` for none), or ``"repo--module.Class"`` (code of
    another repo: nothing local). A dotted or pathed module name is not one transformers loads: ignored."""
    values = list(auto_map.values()) if isinstance(auto_map, dict) else auto_map if isinstance(auto_map, list) else []
    modules: list[str] = []
    for value in values:
        for ref in value if isinstance(value, list) else [value]:
            if not isinstance(ref, str) or "--" in ref or ref.count(".") != 1:
                continue
            module = ref.split(".")[0] + ".py"
            if _plain_name(module) and module not in modules:
                modules.append(module)
    return modules


def _imports(tree: ast.Module) -> list[str] | None:
    """The ``name.py`` files a parsed module may import from its own folder: relative imports (``from .x import``,
    ``from . import x``) and the first part of absolute ones (``import x``: a sibling only where ``x.py`` is
    there); None where a relative import is not that simple (``from ..x``, ``from .x.y``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level > 1 or (node.module and "." in node.module):
                return None
            found += [node.module] if node.module else [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found += [a.name.split(".")[0] for a in node.names]
    return [n + ".py" for n in dict.fromkeys(found) if _plain_name(n + ".py")]


def _parse(path: str) -> ast.Module | None:
    try:
        with open_regular(path, "rb") as f:
            return ast.parse(f.read(), path)
    except OSError as exc:
        raise OutputError(os_error_message(exc, path)) from exc
    except (SyntaxError, ValueError, CheckpointError):
        return None


def code_files(folder: str, modules: list[str]) -> tuple[list[str], list[ast.Module]]:
    """The ``*.py`` names of ``folder`` to carry for the named ``modules``: those present and the sibling modules
    they import, transitively (:func:`_imports`); every top-level ``*.py`` where one cannot be parsed or imports
    in a way not followed. Also the parsed modules, for :func:`declared_vocab_files`."""
    wanted = [m for m in modules if is_file(os.path.join(folder, m))]
    trees, index = [], 0
    while index < len(wanted):
        tree = _parse(os.path.join(folder, wanted[index]))
        siblings = _imports(tree) if tree is not None else None
        if siblings is None:
            every = sorted(n for n in os.listdir(folder) if n.endswith(".py") and is_file(os.path.join(folder, n)))
            return every, [t for t in (_parse(os.path.join(folder, n)) for n in every) if t is not None]
        trees.append(tree)
        wanted += [s for s in siblings if s not in wanted and is_file(os.path.join(folder, s))]
        index += 1
    return wanted, trees


def declared_vocab_files(trees: list[ast.Module]) -> list[str]:
    """The file names a tokenizer module declares in a ``vocab_files_names`` / ``VOCAB_FILES_NAMES`` dict literal
    (e.g. Kimi-K2's ``{"vocab_file": "tiktoken.model"}``)."""
    names = []
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and any(
                    isinstance(t, ast.Name) and t.id.lower() == "vocab_files_names" for t in node.targets):
                names += [v.value for v in node.value.values if isinstance(v, ast.Constant)]
    return [n for n in names if _plain_name(n)]


def _folder_side_files(folder: str, config: dict | None) -> list[str]:
    """The side-file names of one folder (see the module docstring), ``config``: the model's config.json."""
    names = [n for n in STANDARD if is_file(os.path.join(folder, n))]
    maps = [config.get("auto_map")] if isinstance(config, dict) else []
    for name in _MAPPED:
        if name in names:
            data = _read_json(os.path.join(folder, name))
            maps.append(data.get("auto_map"))
            if name == "tokenizer_config.json":
                names += [v for k, v in data.items() if k.endswith("_file") and _plain_name(v)]
    modules = [m for auto_map in maps for m in auto_map_modules(auto_map)]
    code, trees = code_files(folder, modules) if modules else ([], [])
    names += code + declared_vocab_files(trees)
    return [n for n in dict.fromkeys(names) if is_file(os.path.join(folder, n))]


def find_side_files(folders: list[str], config: dict | None) -> list[str]:
    """The paths of the side files in ``folders`` (the first folder's where several hold one name) for a model
    whose config.json is ``config``; a side file that cannot be examined (ELOOP) raises :class:`OutputError`."""
    found: dict[str, str] = {}
    for folder in folders:
        for name in _folder_side_files(folder, config):
            found.setdefault(name, os.path.join(folder, name))
    return list(found.values())


def prune_auto_map(out: str) -> str | None:
    """Drop ``auto_map`` from ``out/config.json`` where it names local modules ``out`` lacks (a source that
    never had them, or a symlink skipped); returns the note saying so, else None."""
    path = os.path.join(out, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        config = json.load(f)
    if not isinstance(config, dict) or "auto_map" not in config:
        return None
    missing = [m for m in auto_map_modules(config["auto_map"]) if not os.path.isfile(os.path.join(out, m))]
    if not missing:
        return None
    del config["auto_map"]
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)  # as reshard.layouts.hf.write_config writes it
        f.write("\n")
    return (f"dropped auto_map from config.json: the remote-code files it names ({', '.join(missing)}) are not in "
            "the source")
