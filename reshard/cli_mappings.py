"""The ``reshard mappings`` sub-commands (``list``, ``show``, ``check``, ``new``): the shipped mapping files, schema
validation of one, and a commented skeleton for a new family; :mod:`reshard.cli` adds this typer app as
``mappings``."""

from __future__ import annotations

import sys
from typing import Optional

import typer


mappings_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                           help="List, show, check and start architecture mapping files.")



@mappings_app.command("list")
def mappings_list():
    """List the shipped mapping files and their architectures."""
    from reshard.mapping import load_shipped, shipped_mapping_names
    from reshard.mapping_vlm import vlm_templates

    vlms = {t.name: t for t in vlm_templates()}
    for name in sorted(shipped_mapping_names() + list(vlms)):
        if name in vlms:
            print(f"{name}: {', '.join(vlms[name].architectures)} (vision-language)")
        else:
            print(f"{name}: {', '.join(load_shipped(name).architectures)}")



@mappings_app.command("show")
def mappings_show(name: str = typer.Argument(..., help="A shipped mapping name (see `mappings list`).")):
    """Print a shipped mapping file."""
    from reshard.mapping import shipped_mapping_text

    print(shipped_mapping_text(name), end="")



@mappings_app.command("check")
def mappings_check(path: str = typer.Argument(..., help="A mapping TOML file.")):
    """Validate a mapping file against the schema; warn where a copied file still names a shipped family."""
    from pathlib import Path

    from reshard.mapping import load_family_file
    from reshard.mapping_skeleton import copied_name_warnings

    fam = load_family_file(path)
    for warning in copied_name_warnings(fam, Path(path).read_text()):
        print(f"warning: {path}: {warning}", file=sys.stderr)
    print(f"ok: {path}: family '{fam.name}', {len(fam.weights)} weights, architectures {', '.join(fam.architectures)}")



@mappings_app.command("new")
def mappings_new(
    name: str = typer.Argument(..., help="Your family's name (e.g. acme)."),
    source: str = typer.Option(..., "--from", help="The shipped mapping (or one of its architectures) to copy, "
                               "e.g. llama or Qwen2ForCausalLM (see `mappings list`)."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="File to write (default: NAME.toml)."),
    architecture: Optional[str] = typer.Option(None, "--architecture", help="Your config.json's "
                                               "\"architectures\" entry (default: <Name>ForCausalLM)."),
    model_type: Optional[str] = typer.Option(None, "--model-type", help="Your config.json's \"model_type\" "
                                             "(default: NAME)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing file."),
):
    """Write a commented mapping file for a new family: a shipped mapping's weights under your own names."""
    from reshard.mapping_skeleton import write_skeleton

    path = write_skeleton(output or f"{name}.toml", name, source, architecture, model_type, overwrite)
    print(f"wrote {path}: edit it as its comments say, then `reshard mappings check {path}`")
