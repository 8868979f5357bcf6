"""Block-FP8 Hugging Face checkpoints for tests, quantised here from bf16 weights (no reshard code involved).

The rule written out (DeepSeek-V3's release format): for a weight ``W [M, N]`` and block ``B = (B0, B1)``, each
block ``(bi, bj)`` (the last block row and column partial when M or N is not a multiple) has the scale
``S[bi, bj] = amax(|W|) / 448`` (fp32) and ``W8 = (W / S).to(float8_e4m3fn)``, stored ``F8_E4M3`` beside
``<name>_scale_inv = S`` (``F32 [ceil(M/B0), ceil(N/B1)]``). Reading it back, ``float32(W8) * S`` (an fp32
multiply) cast to bf16 is the value every converted tensor must hold bit for bit (:func:`dequantized`).

The bf16 weights are position coded, and each block has a magnitude of its own, so that a block-index mistake
changes the values: ``W[i, j] = c(i, j) * m(bi, bj)`` with ``c`` a code of the position in ``[-1, 1]`` and ``m`` a
non-power-of-two magnitude that differs between neighbouring blocks.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from checkpoints import hf_config, hf_tensor_shapes

BLOCK = (128, 128)
E4M3_MAX = 448.0
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

#: family -> the tiny model's config: checkpoints.hf_config keywords, or (``kind``) the DeepSeek overrides of
#: deepseek_checkpoints.save_tiny. Llama: q [384, 256], k / v [192, 256], o [256, 384], gate / up [576, 256], down
#: [256, 576], lm_head [320, 256]: rows 576, 320, 192 and columns 576, 384 that are not multiples of 128 (partial
#: blocks), and TP 2 splits that start inside a block (288 of 576 rows, vLLM's 160 of 320 vocab rows, Megatron's
#: 256 of a padded 512). DeepSeek-V3 (transformers' names, dense layer 0, MoE layer 1 with 8 experts and a shared
#: one, MTP layer 2): kv_a_proj_with_mqa [512 + 64 = 576, 256] (5 block rows, the last of 64), q_a [192, 256],
#: q_b [4 * 96 = 384, 192] (TP 2: 192 rows, inside a block), kv_b [256, 512], o [256, 128] (TP 2: 64 columns),
#: dense gate / up [576, 256], experts' gate / up [192, 256] and down [256, 192].
FAMILIES = {
    "llama": dict(arch="LlamaForCausalLM", hidden=256, heads=12, kv_heads=6, head_dim=32, ffn=576, vocab=320,
                  layers=2, torch_dtype="bfloat16"),
    "deepseek_v3": dict(kind="v3", hidden_size=256, intermediate_size=576, moe_intermediate_size=192,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512,
                        q_lora_rank=192, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, vocab_size=320),
}

#: DeepSeek-V3's release quantises (deepseek-v3.md section 7.3) the attention projections and every MLP projection
#: (dense, routed and shared experts), MTP layer included; not norms, router, bias, embeddings, heads, eh_proj.
_DEEPSEEK_FP8 = re.compile(r"model\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)|"
                           r"mlp\.((experts\.\d+|shared_experts)\.)?(gate|up|down)_proj)\.weight")


def quantized_names(name: str, shape: tuple[int, ...], family: str = "llama") -> bool:
    """Which tensors the release quantises: DeepSeek's (above); Llama's 2-D projection weights (and, here, the
    head, so that its vocab padding is exercised); never the embedding, norms or biases."""
    if family.startswith("deepseek"):
        return _DEEPSEEK_FP8.fullmatch(name) is not None
    return len(shape) == 2 and (name.endswith("proj.weight") or name == "lm_head.weight")


def expand(scale: torch.Tensor, shape: tuple[int, int], block=BLOCK) -> torch.Tensor:
    """The ``[M, N]`` tensor whose element ``(i, j)`` is ``scale[i // B0, j // B1]``."""
    return scale.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]


def coded_weight(index: int, shape: tuple[int, int], block=BLOCK) -> torch.Tensor:
    """A bf16 weight: position code in [-1, 1] times a magnitude per block (see the module docstring)."""
    m, n = shape
    pos = torch.arange(m * n, dtype=torch.int64).reshape(m, n)
    code = ((pos * 7919 + index * 104729) % 2039 - 1019).to(torch.float32) / 1019.0
    bi = torch.arange(-(-m // block[0]))[:, None]
    bj = torch.arange(-(-n // block[1]))[None, :]
    magnitude = 2.0 ** (((bi * 3 + bj * 5 + index) % 11) - 5).to(torch.float32) * (1 + ((bi + 2 * bj + index) % 7) / 8)
    return (code * expand(magnitude, shape, block)).to(torch.bfloat16)


def quantize(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W8, S)`` of the rule: per block, ``S = amax / 448`` and ``W8 = (W / S).to(float8_e4m3fn)``."""
    m, n = w.shape
    rows, cols = -(-m // block[0]), -(-n // block[1])
    w32 = w.to(torch.float32)
    scale = torch.empty((rows, cols), dtype=torch.float32)
    for bi in range(rows):
        for bj in range(cols):
            tile = w32[bi * block[0]:(bi + 1) * block[0], bj * block[1]:(bj + 1) * block[1]]
            scale[bi, bj] = tile.abs().max() / E4M3_MAX
    return (w32 / expand(scale, w.shape, block)).to(torch.float8_e4m3fn), scale


def dequantized(w8: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16, block=BLOCK) -> torch.Tensor:
    """``float32(W8) * S`` of each element's block, cast to ``dtype`` (round to nearest even)."""
    return (w8.to(torch.float32) * expand(scale, w8.shape, block)).to(dtype)


def other_weight(index: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A bf16 tensor that stays unquantized (embedding, norms): distinct values per position and tensor."""
    n = 1
    for s in shape:
        n *= s
    return ((torch.arange(n) % 251 + index) / 256 + 0.5).to(torch.bfloat16).reshape(shape)


def make_fp8_hf(path, family: str = "llama", shards: int = 2, block=BLOCK, **overrides):
    """An FP8 checkpoint of ``family`` in ``path``: returns ``(path, config, stored, expected)`` with ``stored`` the
    tensors as written (fp8 weights and their scales) and ``expected`` the canonical view (dequantised bf16)."""
    spec = {**FAMILIES[family], **overrides}
    if "kind" in spec:
        config, tensors = deepseek_layout(os.path.join(os.path.dirname(str(path)), f"{family}-layout"), **spec)
    else:
        config = hf_config(**spec)
        tensors = {name: (shape, torch.bfloat16) for name, shape in hf_tensor_shapes(config).items()}
    config["quantization_config"] = {**QUANT_CONFIG, "weight_block_size": list(block)}
    stored, expected = {}, {}
    for index, (name, (shape, dtype)) in enumerate(tensors.items()):
        if quantized_names(name, shape, family):
            w8, scale = quantize(coded_weight(index, shape, block), block)
            stored[name], stored[name + "_scale_inv"] = w8, scale
            expected[name] = dequantized(w8, scale, block=block)
        else:
            stored[name] = expected[name] = other_weight(index, shape).to(dtype)
    for copy, original in mtp_copies(config).items():  # the MTP layer's embedding and head: copies, as released
        stored[copy] = expected[copy] = stored[original]
    write_tensors(path, config, stored, shards)
    return str(path), config, stored, expected


def deepseek_layout(folder: str, kind: str, **dims) -> tuple[dict, dict]:
    """The config and ``name -> (shape, dtype)`` of a DeepSeek model with its MTP layer as transformers saves it
    (deepseek_checkpoints.save_tiny into ``folder``): bf16 except the router's fp32 ``e_score_correction_bias``;
    the config with the routing keys the V3 release's config.json spells out."""
    from deepseek_checkpoints import save_tiny

    save_tiny(folder, kind, fill="position", **dims)
    with open(os.path.join(folder, "config.json")) as f:
        config = {**json.load(f), "dtype": "bfloat16", "moe_layer_freq": 1, "scoring_func": "sigmoid",
                  "topk_method": "noaux_tc"}
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        tensors = {n: (tuple(f.get_slice(n).get_shape()),
                       torch.float32 if n.endswith("e_score_correction_bias") else torch.bfloat16) for n in f.keys()}
    return config, tensors


def mtp_copies(config: dict) -> dict[str, str]:
    """MTP layer tensors that are copies of the model's (``copy -> original``), none without MTP layers."""
    out = {}
    for j in range(config["num_hidden_layers"], config["num_hidden_layers"] + config.get("num_nextn_predict_layers", 0)):
        out[f"model.layers.{j}.embed_tokens.weight"] = "model.embed_tokens.weight"
        out[f"model.layers.{j}.shared_head.head.weight"] = "lm_head.weight"
    return out


def write_tensors(path, config: dict, tensors: dict[str, torch.Tensor], shards: int = 2) -> None:
    """config.json and ``tensors`` in ``shards`` safetensors files (an index when more than one), each weight's
    scale in the file after its weight when the cut falls between them (as release shards may)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for s in range(shards):
        fname = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
        save_file(part, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    if shards > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)


def fp8_bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (fp8 included), for bit-for-bit comparison."""
    return t.contiguous().reshape(-1).view(torch.uint8)
