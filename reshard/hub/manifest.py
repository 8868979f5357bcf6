"""``reshard.json`` (how a checkpoint was produced: source repo and revision, layout, degrees, tool version,
per-file SHA-256) and the model-card section that says the same in words. Both are deterministic, so an
unchanged re-push produces identical bytes."""

from __future__ import annotations

import hashlib
import json
import os

from reshard.version import __version__
from reshard.io.partial import replace_with_text

MANIFEST = "reshard.json"
CARD = "README.md"
BEGIN, END = "<!-- reshard:begin -->", "<!-- reshard:end -->"


def read_manifest(folder: str) -> dict:
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def write_manifest(folder: str, updates: dict) -> None:
    """Merge ``updates`` into ``folder/reshard.json`` (keys other writers put there are kept)."""
    data = {**read_manifest(folder), **updates}
    replace_with_text(os.path.join(folder, MANIFEST), json.dumps(data, indent=2, sort_keys=True) + "\n")


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_manifest(folder: str, files: list[str], layout: str, degrees: dict) -> dict:
    """The manifest to publish: the folder's own ``reshard.json`` (a layout's record, the conversion's ``source``)
    with reshard's keys added; keys a layout wrote are kept (``layout`` only set when absent)."""
    data = read_manifest(folder)
    data.setdefault("layout", layout)
    data.update({
        "tool": "reshard", "reshard_version": __version__, "degrees": dict(degrees), "source": data.get("source"),
        "sha256": {rel: sha256_file(os.path.join(folder, rel)) for rel in files},
    })
    return data


def _section(repo_id: str, manifest: dict) -> str:
    source = manifest.get("source") or {}
    degrees = manifest.get("degrees", {})
    where = (f"[{source['repo']}](https://huggingface.co/{source['repo']}) at revision `{source.get('revision')}` "
             f"(commit `{source.get('commit')}`)" if source.get("repo") else "a local checkpoint")
    degree_text = ", ".join(f"{k.upper()}={v}" for k, v in sorted(degrees.items()))
    return "\n".join([
        BEGIN,
        "## How this checkpoint was produced",
        "",
        f"Converted with [reshard](https://pypi.org/project/reshard/) {manifest.get('reshard_version')} from {where} "
        f"to the `{manifest.get('layout')}` layout ({degree_text}), streaming tensor by tensor without changing "
        "any value unless a dtype cast was requested.",
        f"`{MANIFEST}` lists every file with its SHA-256; `reshard verify` compares this checkpoint with its source "
        "bit for bit.",
        END,
    ])


def model_card(existing: str | None, repo_id: str, manifest: dict) -> str:
    """``existing`` with its reshard section replaced (or appended), or a new minimal card."""
    section = _section(repo_id, manifest)
    if existing:
        if BEGIN in existing and END in existing:
            head, rest = existing.split(BEGIN, 1)
            return head + section + rest.split(END, 1)[1]
        return existing.rstrip("\n") + "\n\n" + section + "\n"
    source = (manifest.get("source") or {}).get("repo")
    meta = ["---", *([f"base_model: {source}"] if source else []), "tags:", "- reshard",
            f"- {manifest.get('layout')}", "---"]
    return "\n".join(meta) + f"\n\n# {repo_id.split('/')[-1]}\n\n{section}\n"
