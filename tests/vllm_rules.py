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


# ------------------------------------------------------------------------- DeepSeek-V2 / V3 (multi-head latent
# attention), written from layouts/deepseek-v3.md section 8 and vLLM 0.32's DeepseekV2MLAAttention (no q LoRA: vLLM
# registers q_proj under the attention and its mla_attn wrapper, and _filter_subtensors keeps the smaller key,
# self_attn.mla_attn.q_proj; kv_a_proj_with_mqa stays self_attn.kv_a_proj_with_mqa for the same reason).

def vllm_expert_block(experts: int, ranks: int, rank: int) -> range:
    """vLLM's determine_expert_map (linear placement): ``experts // ranks`` each, the first ``experts % ranks``
    ranks one more, in order."""
    base, extra = divmod(experts, ranks)
    sizes = [base + (1 if p < extra else 0) for p in range(ranks)]
    start = sum(sizes[:rank])
    return range(start, start + sizes[rank])


def expected_rank_mla(hf: dict[str, torch.Tensor], config: dict, tp: int, r: int, expert_parallel: bool = False,
                      dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Rank ``r`` of a vLLM ``sharded_state`` DeepseekV2/V3ForCausalLM at ``tp`` (``expert_parallel``: whole routed
    experts split over the ranks), from the full HF tensors: every tensor cast to ``dtype`` except the router's
    ``e_score_correction_bias`` and the attention scales (fp32). Layers past ``num_hidden_layers`` (MTP) are absent."""
    vocab = config["vocab_size"]
    padded = (vocab + 63) // 64 * 64
    experts, dense_prefix = config["n_routed_experts"], config["first_k_dense_replace"]

    def cast(w):
        return w if dtype is None else w.to(dtype)

    def col(w):  # dim 0 in tp contiguous blocks
        n = w.shape[0] // tp
        return w[r * n:(r + 1) * n]

    def row(w):  # dim 1 in tp contiguous blocks
        n = w.shape[1] // tp
        return w[:, r * n:(r + 1) * n]

    def vocab_rows(w):
        full = torch.zeros((padded, w.shape[1]), dtype=w.dtype)
        full[:vocab] = w
        n = padded // tp
        return full[r * n:(r + 1) * n].clone()

    out = {"model.embed_tokens.weight": vocab_rows(hf["model.embed_tokens.weight"])}
    for i in range(config["num_hidden_layers"]):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out[p + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        if config.get("q_lora_rank"):
            out[a + "fused_qkv_a_proj.weight"] = torch.cat([hf[a + "q_a_proj.weight"],
                                                            hf[a + "kv_a_proj_with_mqa.weight"]])
            out[a + "mla_attn.q_a_layernorm.weight"] = hf[a + "q_a_layernorm.weight"]
            out[a + "mla_attn.q_b_proj.weight"] = col(hf[a + "q_b_proj.weight"])
        else:
            out[a + "mla_attn.q_proj.weight"] = col(hf[a + "q_proj.weight"])
            out[a + "kv_a_proj_with_mqa.weight"] = hf[a + "kv_a_proj_with_mqa.weight"]
        out[a + "kv_a_layernorm.weight"] = hf[a + "kv_a_layernorm.weight"]
        out[a + "kv_b_proj.weight"] = col(hf[a + "kv_b_proj.weight"])
        out[a + "mla_attn.o_proj.weight"] = row(hf[a + "o_proj.weight"])
        if i < dense_prefix:
            out[m + "gate_up_proj.weight"] = torch.cat([col(hf[m + "gate_proj.weight"]),
                                                        col(hf[m + "up_proj.weight"])])
            out[m + "down_proj.weight"] = row(hf[m + "down_proj.weight"])
        else:
            out[m + "experts.gate.weight"] = hf[m + "gate.weight"]
            if config.get("topk_method") == "noaux_tc":
                out[m + "experts.gate.e_score_correction_bias"] = hf[m + "gate.e_score_correction_bias"].float()
            s = m + "shared_experts."
            out[m + "experts._shared_experts._layer.gate_up_proj.weight"] = torch.cat(
                [col(hf[s + "gate_proj.weight"]), col(hf[s + "up_proj.weight"])])
            out[m + "experts._shared_experts._layer.down_proj.weight"] = row(hf[s + "down_proj.weight"])
            e = m + "experts.{}."
            if expert_parallel:
                held = vllm_expert_block(experts, tp, r)
                w13 = [torch.cat([hf[e.format(g) + "gate_proj.weight"], hf[e.format(g) + "up_proj.weight"]])
                       for g in held]
                w2 = [hf[e.format(g) + "down_proj.weight"] for g in held]
            else:
                w13 = [torch.cat([col(hf[e.format(g) + "gate_proj.weight"]), col(hf[e.format(g) + "up_proj.weight"])])
                       for g in range(experts)]
                w2 = [row(hf[e.format(g) + "down_proj.weight"]) for g in range(experts)]
            out[m + "experts.routed_experts.w13_weight"] = torch.stack(w13)
            out[m + "experts.routed_experts.w2_weight"] = torch.stack(w2)
        for s in SCALES:
            out[a + "mla_attn.mla_attn." + s] = torch.tensor(1.0, dtype=torch.float32)
    out["model.norm.weight"] = hf["model.norm.weight"]
    out["lm_head.weight"] = vocab_rows(hf["lm_head.weight"])
    return {k: v if v.dtype == torch.float32 and (k.endswith(SCALES) or k.endswith("e_score_correction_bias"))
            else cast(v).contiguous() for k, v in out.items()}
