"""Checkpoints at the scale of the largest open models, as sparse files: real safetensors headers and an index,
data regions that hold no disk blocks. Only what reads headers (plans, ``--dry-run`` estimates) may use them:
reading their data would read hundreds of GiB of zeros.

Llama-3.1-405B's shapes (``config.json`` of meta-llama/Llama-3.1-405B): hidden 16384, 126 layers, 128 query heads,
8 KV heads, head dim 128, intermediate 53248, vocab 128256, untied, bf16; one shard per layer.
"""

from __future__ import annotations

import json
import os
import struct

LLAMA_405B = dict(hidden_size=16384, num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
                  intermediate_size=53248, vocab_size=128256)


def llama_405b_config() -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **LLAMA_405B, "head_dim": 128,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16", "attention_bias": False,
            "mlp_bias": False}


def layer_shapes(config: dict, i: int) -> dict[str, tuple[int, ...]]:
    h, f = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    p = f"model.layers.{i}."
    return {p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)}


def _sparse_safetensors(path: str, shapes: dict[str, tuple[int, ...]]) -> int:
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2
        for n in shape:
            size *= n
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return offset


def write_sparse_hf(folder, config: dict) -> int:
    """An HF folder of ``config``'s shapes, one sparse shard per layer (embedding with the first, norm and head
    with the last); returns the weight bytes."""
    os.makedirs(folder)
    layers = config["num_hidden_layers"]
    h, v = config["hidden_size"], config["vocab_size"]
    weight_map, total = {}, 0
    for i in range(layers):
        shapes = layer_shapes(config, i)
        if i == 0:
            shapes = {"model.embed_tokens.weight": (v, h), **shapes}
        if i == layers - 1:
            shapes.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
        name = f"model-{i + 1:05d}-of-{layers:05d}.safetensors"
        total += _sparse_safetensors(os.path.join(folder, name), shapes)
        weight_map.update(dict.fromkeys(shapes, name))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return total
