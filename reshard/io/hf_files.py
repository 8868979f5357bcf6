"""Which files of a folder hold a Hugging Face checkpoint's weights (stdlib only: the CLI asks before importing the
layouts, :mod:`reshard.io.heads`; :mod:`reshard.layouts.hf` reads them)."""

from __future__ import annotations

import glob
import json
import os

from reshard.errors import CheckpointError
from reshard.io.regular import check_regular, open_regular

INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


def is_weight_file(name: str) -> bool:
    """A top-level weight file or index of the HF layout."""
    return "/" not in name and (name.endswith(".safetensors") or name in (INDEX, BIN_INDEX)
                                or (name.startswith("pytorch_model") and name.endswith(".bin")))


def weight_files(path: str) -> list[str]:
    """The checkpoint's weight files: the index's files, else *.safetensors, else pytorch_model*.bin."""
    for index_name in (INDEX, BIN_INDEX):
        index_path = os.path.join(path, index_name)
        if os.path.isfile(index_path):
            try:
                with open_regular(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(f"{index_path}: not a valid index (needs a 'weight_map' object)") from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to file names")
            files = sorted(set(weight_map.values()))
            for f in files:
                if not os.path.exists(os.path.join(path, f)):
                    raise CheckpointError(f"{index_path} names {f}, which does not exist: the download is incomplete")
                check_regular(os.path.join(path, f))
            return [os.path.join(path, f) for f in files]
    found = [p for p in sorted(glob.glob(os.path.join(path, "*.safetensors")))
             if not is_other_format(os.path.basename(p))]
    return found or sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))


def is_other_format(name: str) -> bool:
    """Safetensors files that sit beside a model's weights but are not them: Mistral's ``consolidated*``
    (its own format) and a PEFT ``adapter_model`` (an adapter, not the model)."""
    return name.startswith("consolidated") or name.startswith("adapter_model")
