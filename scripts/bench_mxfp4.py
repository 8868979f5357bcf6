#!/usr/bin/env python
"""The MXFP4 source of scripts/bench.py's ``hf_mxfp4_to_bf16_hf`` op: a synthetic gpt-oss checkpoint as OpenAI
releases it (families-2.md section 2.2), sized so that its bf16 output is about as large as the bench's bf16 model
SRC (whose bytes only set the size; the tensors are generated, streaming).

gpt-oss-120b's shape, narrower: hidden H = I (2880 in the release; here the largest of ``HIDDEN`` that leaves at
least ``MIN_LAYERS`` layers), head dim 64, 8 KV heads (fewer where H/64 is), H/64 query heads, 32 experts
(top 4), vocab 32000; every layer's expert matrices ``<name>_blocks`` U8 ``[E, R, C/32, 16]`` (random codes) with ``<name>_scales`` U8
``[E, R, C/32]`` (exponents 118..129) as the release stores them, everything else bf16; config.json with
``quantization_config = {"quant_method": "mxfp4", ...}``. One safetensors shard per layer plus one for the
embedding / norm / head, and the index.

    python scripts/bench_mxfp4.py SRC_BF16_HF DST
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from pathlib import Path

import numpy as np

HIDDEN = (2880, 2048, 1024, 512, 256)
MIN_LAYERS = 4
EXPERTS, TOP_K, VOCAB, HEAD_DIM, KV_HEADS = 32, 4, 32000, 64, 8
CHUNK = 8 << 20  # bytes generated at once


def kv_heads(h: int) -> int:
    """``KV_HEADS``, or every query head where a narrow model has fewer."""
    return min(KV_HEADS, h // HEAD_DIM)


def layer_specs(i: int, h: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """Layer ``i``'s tensors as released: (name, dtype, shape)."""
    nh, p, e = h // HEAD_DIM, f"model.layers.{i}.", EXPERTS
    x = p + "mlp.experts."
    return [(p + "input_layernorm.weight", "BF16", (h,)), (p + "post_attention_layernorm.weight", "BF16", (h,)),
            (p + "self_attn.q_proj.weight", "BF16", (nh * HEAD_DIM, h)), (p + "self_attn.q_proj.bias", "BF16", (nh * HEAD_DIM,)),
            (p + "self_attn.k_proj.weight", "BF16", (kv_heads(h) * HEAD_DIM, h)),
            (p + "self_attn.k_proj.bias", "BF16", (kv_heads(h) * HEAD_DIM,)),
            (p + "self_attn.v_proj.weight", "BF16", (kv_heads(h) * HEAD_DIM, h)),
            (p + "self_attn.v_proj.bias", "BF16", (kv_heads(h) * HEAD_DIM,)),
            (p + "self_attn.o_proj.weight", "BF16", (h, nh * HEAD_DIM)), (p + "self_attn.o_proj.bias", "BF16", (h,)),
            (p + "self_attn.sinks", "BF16", (nh,)), (p + "mlp.router.weight", "BF16", (e, h)),
            (p + "mlp.router.bias", "BF16", (e,)),
            (x + "gate_up_proj_blocks", "U8", (e, 2 * h, h // 32, 16)), (x + "gate_up_proj_scales", "U8", (e, 2 * h, h // 32)),
            (x + "gate_up_proj_bias", "BF16", (e, 2 * h)),
            (x + "down_proj_blocks", "U8", (e, h, h // 32, 16)), (x + "down_proj_scales", "U8", (e, h, h // 32)),
            (x + "down_proj_bias", "BF16", (e, h))]


def outer_specs(h: int) -> list[tuple[str, str, tuple[int, ...]]]:
    return [("model.embed_tokens.weight", "BF16", (VOCAB, h)), ("model.norm.weight", "BF16", (h,)),
            ("lm_head.weight", "BF16", (VOCAB, h))]


def bf16_bytes(specs) -> int:
    """Bytes of the bf16 output: MXFP4 blocks become 4 bf16 bytes per byte, scales vanish."""
    total = 0
    for name, dtype, shape in specs:
        n = math.prod(shape)
        total += 0 if name.endswith("_scales") else 4 * n if name.endswith("_blocks") else 2 * n
    return total


def shape_for(target: int) -> tuple[int, int]:
    """(hidden, layers) whose bf16 output is closest to ``target`` bytes, preferring the widest hidden size."""
    for h in HIDDEN:
        per_layer = bf16_bytes(layer_specs(0, h))
        layers = round((target - bf16_bytes(outer_specs(h))) / per_layer)
        if layers >= MIN_LAYERS or h == HIDDEN[-1]:
            return h, max(1, layers)
    raise AssertionError


def _data(name: str, dtype: str, n: int, rng: np.random.Generator):
    """``n`` elements: random FP4 code bytes, E8M0 exponents 118..129, small bf16 values (norms about 1)."""
    if name.endswith("_blocks"):
        return rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    if name.endswith("_scales"):
        return rng.integers(118, 130, n, dtype=np.uint8).tobytes()
    values = rng.standard_normal(n, dtype=np.float32) * 0.02 + (1.0 if "norm" in name else 0.0)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def write_shard(path: Path, specs, seed: int) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * (1 if dtype == "U8" else 2)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for name, dtype, shape in specs:
            per = CHUNK if dtype == "U8" else CHUNK // 2
            left = math.prod(shape)
            while left:
                n = min(per, left)
                out.write(_data(name, dtype, n, rng))
                left -= n


def make(src: Path, dst: Path) -> None:
    target = sum(p.stat().st_size for p in src.iterdir() if p.name.endswith(".safetensors"))
    h, layers = shape_for(target)
    dst.mkdir(parents=True, exist_ok=True)
    shards = [("model-outer.safetensors", outer_specs(h))] + [
        (f"model-layer-{i:04d}.safetensors", layer_specs(i, h)) for i in range(layers)]
    weight_map, total = {}, 0
    for seed, (shard, specs) in enumerate(shards):
        write_shard(dst / shard, specs, seed)
        weight_map.update({name: shard for name, _, _ in specs})
        total += (dst / shard).stat().st_size
    config = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": h,
              "intermediate_size": h, "num_hidden_layers": layers, "num_attention_heads": h // HEAD_DIM,
              "num_key_value_heads": kv_heads(h), "head_dim": HEAD_DIM, "vocab_size": VOCAB,
              "num_local_experts": EXPERTS, "num_experts_per_tok": TOP_K, "sliding_window": 128,
              "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
              "rms_norm_eps": 1e-05, "hidden_act": "silu", "attention_bias": True, "swiglu_limit": 7.0,
              "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 4096,
                                  "rope_theta": 150000.0},
              "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                  "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    print(f"gpt-oss MXFP4: hidden {h}, {layers} layers, {EXPERTS} experts, {total / (1 << 30):.3f} GiB "
          f"({bf16_bytes([s for _, specs in shards for s in specs]) / (1 << 30):.3f} GiB as bf16)", file=sys.stderr)
    os.sync() if hasattr(os, "sync") else None


if __name__ == "__main__":
    make(Path(sys.argv[1]), Path(sys.argv[2]))
