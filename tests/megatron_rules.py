"""Megatron-Core per-rank tensors written out from LAYOUTS.md, independently of reshard's planner.

Used to check reshard's Megatron files name by name and byte by byte.
"""

from __future__ import annotations

import torch


def padded_vocab(vocab: int, tp: int, divisor: int = 128) -> int:
    m = divisor * tp
    return ((vocab + m - 1) // m) * m


def expected_rank_state(hf: dict[str, torch.Tensor], config: dict, tp: int, tp_rank: int, pp: int, pp_rank: int,
                        spec: str = "te") -> dict[str, torch.Tensor]:
    h, nh, ng = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // nh
    layers = config["num_hidden_layers"]
    vocab = config["vocab_size"]
    tied = config.get("tie_word_embeddings", False)
    vp = padded_vocab(vocab, tp)

    def vocab_shard(w):
        full = torch.zeros((vp, *w.shape[1:]), dtype=w.dtype)
        full[:vocab] = w
        return full.chunk(tp, dim=0)[tp_rank].clone()

    def qkv(q, k, v):
        # HF -> Megatron: cat([q.view(ng, nh/ng*d, ...), k.view(ng, d, ...), v.view(ng, d, ...)], dim=1)
        rest = q.shape[1:]
        fused = torch.cat([q.reshape(ng, nh // ng * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)],
                          dim=1).reshape(-1, *rest)
        return fused.chunk(tp, dim=0)[tp_rank].clone()

    def col(w):
        return w.chunk(tp, dim=0)[tp_rank].clone()

    def row(w):
        return w.chunk(tp, dim=1)[tp_rank].clone()

    out = {}
    per_stage = layers // pp
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        out["embedding.word_embeddings.weight"] = vocab_shard(hf["model.embed_tokens.weight"])
    for local in range(per_stage):
        g = pp_rank * per_stage + local
        p, m = f"model.layers.{g}.", f"decoder.layers.{local}."
        in_norm = "self_attention.linear_qkv.layer_norm_weight" if spec == "te" else "input_layernorm.weight"
        mlp_norm = "mlp.linear_fc1.layer_norm_weight" if spec == "te" else "pre_mlp_layernorm.weight"
        out[m + in_norm] = hf[p + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = qkv(hf[p + "self_attn.q_proj.weight"],
                                                          hf[p + "self_attn.k_proj.weight"],
                                                          hf[p + "self_attn.v_proj.weight"])
        if p + "self_attn.q_proj.bias" in hf:
            out[m + "self_attention.linear_qkv.bias"] = qkv(hf[p + "self_attn.q_proj.bias"],
                                                            hf[p + "self_attn.k_proj.bias"],
                                                            hf[p + "self_attn.v_proj.bias"])
        out[m + "self_attention.linear_proj.weight"] = row(hf[p + "self_attn.o_proj.weight"])
        out[m + mlp_norm] = hf[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([col(hf[p + "mlp.gate_proj.weight"]),
                                                      col(hf[p + "mlp.up_proj.weight"])], dim=0)
        out[m + "mlp.linear_fc2.weight"] = row(hf[p + "mlp.down_proj.weight"])
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not tied:
            out["output_layer.weight"] = vocab_shard(hf["lm_head.weight"])
        elif pp > 1:
            out["output_layer.weight"] = vocab_shard(hf["model.embed_tokens.weight"])
    return out


def load_rank(path) -> dict:
    import argparse

    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, weights_only=True)


def rank_file(root, tp_rank: int, pp_rank: int, pp: int, iteration: str = "release") -> str:
    folder = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    rank = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return f"{root}/{folder}/{rank}/model_optim_rng.pt"
