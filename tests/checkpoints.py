"""Tiny position-coded checkpoints for tests, written directly with safetensors (no reshard code involved).

Every element of tensor number ``i`` holds ``i * 2**17 + position`` (exact in fp32 for tensors of up to 2**17
elements), so a misplaced row, a swapped head or a swapped tensor changes the bytes.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

ARCH_MODEL_TYPE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


def hf_config(arch="LlamaForCausalLM", hidden=64, layers=2, heads=8, kv_heads=2, ffn=96, vocab=1000,
              tied=False, head_dim=None, **extra) -> dict:
    config = {
        "architectures": [arch], "model_type": ARCH_MODEL_TYPE[arch], "hidden_size": hidden,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": tied, "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if head_dim is not None:
        config["head_dim"] = head_dim
    if arch == "LlamaForCausalLM":
        config.update(attention_bias=False, mlp_bias=False)
    config.update(extra)
    return config


def hf_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF on-disk tensor names and shapes, written out from the Llama/Mistral/Qwen2 layout (independent of reshard)."""
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    nh, ng = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // nh
    qkv_bias = config["architectures"][0] == "Qwen2ForCausalLM" or config.get("attention_bias", False)
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nh * d, h), p + "self_attn.k_proj.weight": (ng * d, h),
            p + "self_attn.v_proj.weight": (ng * d, h), p + "self_attn.o_proj.weight": (h, nh * d),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        })
        if qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (nh * d,), p + "self_attn.k_proj.bias": (ng * d,),
                           p + "self_attn.v_proj.bias": (ng * d,)})
    shapes["model.norm.weight"] = (h,)
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    return shapes


def position_coded(shapes: dict[str, tuple[int, ...]], dtype=torch.float32) -> dict[str, torch.Tensor]:
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        n = 1
        for s in shape:
            n *= s
        assert n <= 2**17, f"{name} too large for position coding"
        out[name] = (torch.arange(n, dtype=torch.float64) + i * 2**17).to(dtype).reshape(shape)
    return out


def seeded(shapes: dict[str, tuple[int, ...]], seed=0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Small random weights (for logits tests); 1-D weights get 1 + noise so norm mapping errors show."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=g, dtype=torch.float32) * 0.08
        if len(shape) == 1 and "norm" in name:
            t = 1.0 + t
        out[name] = t.to(dtype)
    return out


def write_hf(path, config: dict, tensors: dict[str, torch.Tensor], shards: int = 1,
             tokenizer_files: bool = True) -> str:
    """Write config.json + safetensors (optionally sharded with an index) + a generation config."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    names = list(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    else:
        per = -(-len(names) // shards)
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
            save_file(part, os.path.join(path, fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, fname))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    if tokenizer_files:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    return str(path)


def make_hf(path, shards=1, dtype=torch.float32, coded=True, seed=0, **config_kwargs) -> str:
    config = hf_config(**config_kwargs)
    shapes = hf_tensor_shapes(config)
    tensors = position_coded(shapes, dtype) if coded else seeded(shapes, seed, dtype)
    return write_hf(path, config, tensors, shards)


def load_hf_tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out
