"""Layouts: detect a folder's layout and open it as a canonical view."""

from __future__ import annotations

import os

from reshard.errors import CheckpointError
from reshard.layouts import hf, megatron, vllm
from reshard.layouts.base import Options, Source

LAYOUTS = {"hf": hf, "megatron": megatron, "vllm": vllm}


def detect(path: str) -> str:
    if not os.path.exists(path):
        raise CheckpointError(f"{path} does not exist")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a folder: pass the checkpoint folder")
    if megatron.detect(path):
        return "megatron"
    if vllm.detect(path):  # before hf: a vLLM folder also holds config.json and *.safetensors
        return "vllm"
    if hf.detect(path):
        return "hf"
    raise CheckpointError(f"{path} is not a checkpoint reshard knows: expected an HF folder (config.json + "
                          "*.safetensors), "
                          "a Megatron folder (latest_checkpointed_iteration.txt, iter_*/mp_rank_*) or a vLLM "
                          "sharded_state folder (model-rank-*-part-*.safetensors)")


def open_checkpoint(path: str, opts: Options | None = None) -> Source:
    opts = opts or Options()
    return LAYOUTS[detect(path)].open_source(path, opts)
