"""A toy layout defined outside the package, as a plug-in would be: ``toy.json`` (written last) + ``config.json``
+ one safetensors file per canonical tensor under ``tensors/`` (``tensors/<HF name>.safetensors``)."""

from __future__ import annotations

import glob
import json
import os

from reshard.io.safetensors_format import SafetensorsFile
from reshard.layouts import Layout, Options, Source, TargetPlan, TargetSpec
from reshard.layouts import hf
from reshard.layouts.base import find_side_files

MARKER = "toy.json"


class ToyLayout(Layout):
    name = "toy"
    summary = "toy test layout (toy.json + tensors/<name>.safetensors)"
    specificity = 10
    completion_markers = (MARKER,)

    def detect(self, names) -> bool:
        return MARKER in names

    def open(self, root: str, opts: Options) -> Source:
        files = [SafetensorsFile(p) for p in sorted(glob.glob(os.path.join(root, "tensors", "*.safetensors")))]
        source = hf.build_source(root, hf.read_config(root), files, opts, find_side_files(root))
        source.layout = self.name
        return source

    def targets(self, source: Source, opts: Options, dtype: str) -> TargetPlan:
        files = [TargetSpec(f"tensors/{name}.safetensors", "safetensors", [tensor.whole()], metadata={"format": "pt"})
                 for name, tensor in source.model.tensors.items()]
        config, notes = hf.planned_config(source.model, dtype, opts, "toy")
        return TargetPlan(files, state=config, notes=notes)

    def finalize(self, out: str, source: Source, plan, state) -> None:
        hf.write_config(out, state)
        with open(os.path.join(out, MARKER), "w") as f:
            json.dump({"tensors": sum(len(f.tensors) for f in plan.files)}, f)
