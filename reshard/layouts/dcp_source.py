"""The canonical view of a torch.distributed.checkpoint folder whose model tensors are keyed by Hugging Face names,
shared by the ``dcp`` layout (FSDP2 / accelerate folders) and the ``torchtitan`` layout (torchtitan names, mapped
to HF names first)."""

from __future__ import annotations

import os
from dataclasses import replace

from reshard.io.dcp import DcpTensor, DistcpFile
from reshard.io.tensorfile import TensorFile, TensorLocation
from reshard.layouts import hf
from reshard.layouts.base import Options, Source
from reshard.layouts.dcp_chunks import StitchedFile, dcp_stored

METADATA = ".metadata"


def dcp_root(key: str) -> str:
    """The state-dict root DCP key ``key`` lies under: its first name (``optim``), or its first two inside the DCP
    recipe's ``app`` Stateful (``app.optim``)."""
    parts = key.split(".")
    return ".".join(parts[:2]) if parts[0] == "app" and len(parts) > 1 else parts[0]


def roots_note(roots) -> str:
    """The one note naming the roots of a DCP folder that were skipped."""
    return f"skipped {', '.join(sorted(roots))} (DCP roots not holding model weights)"


def build_dcp_source(layout: str, root: str, folder: str, tensors: dict[str, DcpTensor], config: dict,
                     opts: Options, side_files: list[str], notes: list[str], interleaved: bool = False) -> Source:
    """The canonical view of a DCP folder whose model tensors ``tensors`` are keyed by HF name: the HF reader's
    view of their shapes and dtypes (names, config, tying checked as for an HF folder), each tensor then located
    in its chunks (:func:`~reshard.layouts.dcp_chunks.dcp_stored`). ``interleaved``: q / k rows are in Meta's
    interleaved-RoPE order (torchtitan's Llama)."""
    catalog = TensorFile(os.path.join(folder, METADATA),
                         {name: TensorLocation(t.dtype, t.shape, 0) for name, t in tensors.items()})
    source = hf.build_source(root, config, [catalog], opts, side_files)
    model = source.model
    head_dim = model.head_dim
    files: dict[str, DistcpFile] = {}
    stitched = StitchedFile(folder)
    located = []
    for _, target in source.stored:
        canonical = target.pieces[0].canonical
        if interleaved and model.tensors[canonical].spec.role in ("q", "k"):
            target = replace(target, interleaved=head_dim)
        located.extend(dcp_stored(files, stitched, folder, tensors[target.name], target))
    file_list = [files[name] for name in sorted(files)] + ([stitched] if stitched.parts else [])
    position = {id(f): i for i, f in enumerate(file_list)}
    source.layout, source.files = layout, file_list
    source.stored = [(position[id(f)], t) for f, t in located]
    source.info["notes"] = source.info["notes"] + notes
    source.info["folder"] = folder
    return source
