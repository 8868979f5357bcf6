"""The vLLM ``sharded_state`` per-rank tensors, written out from LAYOUTS.md and vLLM's loader independently of
reshard's planner: given full HF tensors, build what rank ``r`` of ``tp`` must hold (names, shapes, bytes)."""

from __future__ import annotations

import torch

SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")


def vllm_filter_shared(names_sharing_storage: list[str]) -> list[str]:
    """vLLM's ShardedStateLoader._filter_subtensors on tensors of identical extent: only the smallest key stays."""
    return [min(names_sharing_storage)]


def expected_rank(hf: dict[str, torch.Tensor], config: dict, tp: int, r: int) -> dict[str, torch.Tensor]:
    nh, ng = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or config["hidden_size"] // nh
    vocab = config["vocab_size"]
    padded = (vocab + 63) // 64 * 64
    rows = padded // tp

    def vocab_slice(w):
        full = torch.zeros((padded,) + tuple(w.shape[1:]), dtype=w.dtype)
        full[:vocab] = w
        return full[r * rows:(r + 1) * rows].clone()

    def split0(w, parts=tp):
        n = w.shape[0] // parts
        return w[r * n:(r + 1) * n]

    def split1(w):
        n = w.shape[1] // tp
        return w[:, r * n:(r + 1) * n]

    def kv(w):
        if tp >= ng:
            head = r // (tp // ng)
            return w[head * d:(head + 1) * d]
        per = ng // tp
        return w[r * per * d:(r + 1) * per * d]

    out = {}
    tied = "lm_head.weight" not in hf
    emb = vocab_slice(hf["model.embed_tokens.weight"])
    if tied:
        (kept,) = vllm_filter_shared(["model.embed_tokens.weight", "lm_head.weight"])
        out[kept] = emb
    else:
        out["model.embed_tokens.weight"] = emb
        out["lm_head.weight"] = vocab_slice(hf["lm_head.weight"])
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[p + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        out[a + "qkv_proj.weight"] = torch.cat([split0(hf[a + "q_proj.weight"]), kv(hf[a + "k_proj.weight"]),
                                                kv(hf[a + "v_proj.weight"])])
        if a + "q_proj.bias" in hf:
            out[a + "qkv_proj.bias"] = torch.cat([split0(hf[a + "q_proj.bias"]), kv(hf[a + "k_proj.bias"]),
                                                  kv(hf[a + "v_proj.bias"])])
        out[a + "o_proj.weight"] = split1(hf[a + "o_proj.weight"])
        m = p + "mlp."
        out[m + "gate_up_proj.weight"] = torch.cat([split0(hf[m + "gate_proj.weight"]),
                                                    split0(hf[m + "up_proj.weight"])])
        out[m + "down_proj.weight"] = split1(hf[m + "down_proj.weight"])
        for s in SCALES:
            out[a + "attn." + s] = torch.tensor(1.0, dtype=torch.float32)
    out["model.norm.weight"] = hf["model.norm.weight"]
    return out


def load_rank(folder, r: int) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """All tensors of rank ``r`` (over its parts) and each part's metadata, read with safetensors itself."""
    import glob
    import os

    from safetensors import safe_open

    tensors, metas = {}, []
    for path in sorted(glob.glob(os.path.join(str(folder), f"model-rank-{r}-part-*.safetensors"))):
        with safe_open(path, "pt") as f:
            metas.append(f.metadata())
            for k in f.keys():
                assert k not in tensors, f"{k} stored twice on rank {r}"
                tensors[k] = f.get_tensor(k)
    return tensors, metas
