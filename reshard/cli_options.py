"""The ``reshard`` command line's shared pieces: the typer options several commands take (``--vocab-size``,
``--architecture``, ``--mapping``, ``--config``, ``--maxtext-model``, ``--tag``, ``--master-weights``, ``--json``,
``--to`` checked against the layout registry, its help naming the registered layouts), the Megatron spec choice, and
arguments shown as ``SRC`` / ``[SRC]`` in usage lines."""

from __future__ import annotations

from enum import Enum

import typer
import typer.core


def _plain_usage_name(argument) -> str:
    """An argument in the usage line as ``SRC`` (optional: ``[SRC]``), not typer's ``{SRC}``."""
    name = argument.display_name_raw if argument.required else f"[{argument.display_name_raw}]"
    return name + ("..." if argument.nargs != 1 else "")



if hasattr(typer.core.TyperArgument, "_usage_display_name"):  # typer >= 0.2x; older versions print SRC already
    typer.core.TyperArgument._usage_display_name = _plain_usage_name



def _target_layout(value: str) -> str:
    """``--to``: a layout the registry can write (built-in or plug-in)."""
    from reshard.layouts.registry import layout_names

    names = layout_names(writes=True)
    if value not in names:
        raise typer.BadParameter(f"'{value}' is not a layout reshard writes; choose one of {', '.join(names)}")
    return value



def _refresh_layout_help() -> None:
    """Name the registered layouts in ``--to``'s help (the registry may have grown since import: plug-ins)."""
    from reshard.layouts.registry import layout_names

    TargetOpt.help = f"Target layout, one of: {', '.join(layout_names(writes=True))}."



class Spec(str, Enum):
    te = "te"
    local = "local"


VocabOpt = typer.Option(None, "--vocab-size", help="True (unpadded) vocab size, if the Megatron source lacks it.")

ArchOpt = typer.Option(None, "--architecture", help="HF architecture for a source that records none, such as a "
                       "Megatron run without hf_config (default: the checkpoint's own; naming another needs "
                       "--allow-lossy-config architecture).")

MappingOpt = typer.Option(None, "--mapping", help="A mapping TOML file for your own architecture family.")

ConfigOpt = typer.Option(None, "--config", help="The model's config.json, for a source that saves none "
                         "(torchtitan; DeepSpeed without a config.json beside 'latest'; an HF folder of weights "
                         "without one).")

MaxtextModelOpt = typer.Option(None, "--maxtext-model", help="MaxText: the model name (e.g. llama3.1-8b), "
                                "for its RoPE order and query scaling.")

TagOpt = typer.Option(None, "--tag", help="DeepSpeed: the checkpoint tag (folder) to read instead of the one "
                      "'latest' names.")

MasterOpt = typer.Option(False, "--master-weights", help="DeepSpeed: read the fp32 master weights from the "
                         "optimizer partitions (output fp32) instead of the training-dtype weights.")

JsonOpt = typer.Option(False, "--json", help="Print a JSON report.")

TargetOpt = typer.Option(..., "--to", help="Target layout.", callback=_target_layout)
