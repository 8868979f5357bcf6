"""torch_dist checkpoints for tests, written with torch alone (no reshard code): the global tensors of Megatron's
TP=1 layout (from megatron_rules, written out independently of reshard's planner), stacked over layers or per
layer, cut into chunks the way Megatron's TP ranks would store them, each chunk a ``torch.save`` archive appended
to a ``.distcp`` file, indexed by a ``torch.distributed.checkpoint`` ``Metadata`` pickle."""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import re

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)

from megatron_rules import expected_rank_state, padded_vocab

#: Megatron's TP split axis of each per-layer tensor (after the layer axis is removed); others are replicated.
SPLIT_AXIS = {"linear_qkv.weight": 0, "linear_qkv.bias": 0, "linear_proj.weight": 1, "linear_fc1.weight": 0,
              "linear_fc1.weight_w": 0, "linear_fc1.weight_v": 0,
              "linear_fc2.weight": 1, "word_embeddings.weight": 0, "output_layer.weight": 0}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def megatron_args(config: dict, tp: int) -> argparse.Namespace:
    return argparse.Namespace(
        num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        ffn_hidden_size=config["intermediate_size"], num_attention_heads=config["num_attention_heads"],
        group_query_attention=True, num_query_groups=config["num_key_value_heads"],
        kv_channels=config["hidden_size"] // config["num_attention_heads"], vocab_size=config["vocab_size"],
        padded_vocab_size=padded_vocab(config["vocab_size"], tp), make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, swiglu=True, normalization="RMSNorm",
        norm_epsilon=config["rms_norm_eps"], position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0,
        add_bias_linear=False, add_qkv_bias=config["architectures"][0] == "Qwen2ForCausalLM",
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        max_position_embeddings=config["max_position_embeddings"], params_dtype=torch.float32, bf16=False, fp16=False,
        ckpt_format="torch_dist")


def _split_axis(key: str) -> int | None:
    for suffix, axis in SPLIT_AXIS.items():
        if key.endswith(suffix):
            return axis
    return None


def global_tensors(hf: dict, config: dict, tp: int, stacked: bool, split_fc1: bool = False) -> dict[str, torch.Tensor]:
    """Megatron's TP=1 tensors (vocab padded for ``tp``), stacked ``[L, ...]`` or per layer (``split_fc1``:
    ``linear_fc1.weight`` as ``weight_w`` (gates) and ``weight_v`` (ups), as singleton_local_shards saves it)."""
    state = expected_rank_state(hf, config, 1, 0, 1, 0, "te")
    vp = padded_vocab(config["vocab_size"], tp)
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if key in state:  # the TP=1 state is padded for tp=1; re-pad for the run's tp
            t = state[key][:config["vocab_size"]]
            state[key] = torch.cat([t, t.new_zeros(vp - t.shape[0], t.shape[1])])
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, list] = {}
    for key, value in state.items():
        if value is None or key.endswith("_extra_state"):
            continue
        m = _LAYER.match(key)
        if split_fc1 and m and key.endswith("linear_fc1.weight"):
            out[key + "_w"], out[key + "_v"] = value.chunk(2, dim=0)
            continue
        if stacked and m:
            layers.setdefault(m.group(2), []).append((int(m.group(1)), value))
        else:
            out[key] = value
    for rest, items in layers.items():
        out[f"decoder.layers.{rest}"] = torch.stack([v for _, v in sorted(items, key=lambda x: x[0])])
    return out


def chunks_of(key: str, tensor: torch.Tensor, tp: int, stacked: bool, layers_per_chunk: int = 1):
    """(offsets, chunk) pairs: per layer (``layers_per_chunk`` layers) and per TP shard along the split axis; fc1
    in its two halves, each cut in tp (as Megatron's swiglu factory stores it)."""
    lead = 1 if stacked and key.startswith("decoder.layers.") else 0
    axis = _split_axis(key)
    layer_ranges = [(l0, min(layers_per_chunk, tensor.shape[0] - l0))
                    for l0 in range(0, tensor.shape[0], layers_per_chunk)] if lead else [(None, None)]
    if axis is None:
        bounds = [(0, tensor.shape[lead] if tensor.dim() > lead else 1)]
    elif key.endswith("linear_fc1.weight"):
        half = tensor.shape[lead] // 2
        bounds = [(h * half + t * half // tp, half // tp) for h in range(2) for t in range(tp)]
    else:
        n = tensor.shape[lead + axis]
        bounds = [(t * n // tp, n // tp) for t in range(tp)]
    for l0, ln in layer_ranges:
        part = tensor if l0 is None else tensor.narrow(0, l0, ln)
        for start, length in bounds:
            piece = part if axis is None else part.narrow(lead + axis, start, length)
            offsets = [0] * tensor.dim()
            if lead:
                offsets[0] = l0
            if axis is not None:
                offsets[lead + axis] = start
            yield tuple(offsets), piece.clone()


def write_torch_dist(root, config: dict, hf: dict, tp: int = 2, stacked: bool = True, prefix: str = "",
                     layers_per_chunk: int = 1, files: int = 2, iteration: int = 5, split_fc1: bool = False) -> str:
    """A complete torch_dist checkpoint under ``root`` (tracker + ``iter_{iteration:07d}/``)."""
    folder = os.path.join(str(root), f"iter_{iteration:07d}")
    os.makedirs(folder)
    tensors = global_tensors(hf, config, tp, stacked, split_fc1)
    items = []
    for key, tensor in tensors.items():
        for offsets, chunk in chunks_of(key, tensor, tp, stacked, layers_per_chunk):
            items.append((prefix + key, offsets, chunk, tensor))
    streams = [open(os.path.join(folder, f"__0_{i}.distcp"), "wb") for i in range(files)]
    state_meta, storage = {}, {}
    for n, (key, offsets, chunk, tensor) in enumerate(items):
        f = streams[n % files]
        buf = io.BytesIO()
        torch.save(chunk, buf)
        start = f.tell()
        f.write(buf.getvalue())
        storage[MetadataIndex(key, torch.Size(offsets))] = _StorageInfo(os.path.basename(f.name), start,
                                                                        len(buf.getvalue()))
        meta = state_meta.setdefault(key, TensorStorageMetadata(TensorProperties(dtype=tensor.dtype),
                                                                 torch.Size(tensor.shape), []))
        meta.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(chunk.shape)))
    # one byte item, as Megatron stores _extra_state: torch.save([None])
    f = streams[0]
    payload = io.BytesIO()
    torch.save([None], payload)
    start = f.tell()
    f.write(payload.getvalue())
    key = prefix + "decoder.layers.self_attention.linear_proj._extra_state/shard_0_1"
    state_meta[key] = BytesStorageMetadata()
    storage[MetadataIndex(key)] = _StorageInfo(os.path.basename(f.name), start, len(payload.getvalue()))
    for f in streams:
        f.close()
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=state_meta, planner_data=None, storage_data=storage), f)
    torch.save({"args": megatron_args(config, tp), "checkpoint_version": 3.0, "iteration": iteration,
                "content_metadata": {"singleton_local_shards": not stacked}}, os.path.join(folder, "common.pt"))
    with open(os.path.join(folder, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, f)
    with open(os.path.join(str(root), "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return str(root)
