"""The TensorRT-LLM checkpoint (the folder ``trtllm-build --checkpoint_dir`` reads) for Llama-style models, written
out from the upstream facts in shared/layouts/dense-archs.md section F, independently of reshard's planner and
mapping files.

F.1 files: ``config.json`` plus ``rank{r}.safetensors`` for r in [0, tp*pp), r = pp_rank * tp + tp_rank (cp = 1).
Layer names restart at 0 on each pipeline stage; layers are split evenly (L % pp == 0).

F.2 tensors of one rank (TRT name <- HF source, rule), from TensorRT-LLM's llama/convert.py:
  * ``transformer.vocab_embedding.weight`` <- ``model.embed_tokens``: full (no parallel embedding), first stage only.
  * ``transformer.layers.{i}.input_layernorm.weight`` <- ``input_layernorm``: full.
  * ``...attention.qkv.weight`` (``.bias``) <- q/k/v_proj: ``concat(q_r, k_r, v_r)``; q_r is the rank's contiguous
    1/tp of the rows; k_r / v_r the rank's ng/tp KV heads or, when tp > ng, ``dup_kv_weight`` first repeats every
    KV head tp/ng times consecutively, so rank r holds KV head r // (tp/ng) = floor(r*ng/tp).
  * ``...attention.dense.weight`` <- ``o_proj``: split dim 1.
  * ``...post_layernorm.weight`` <- ``post_attention_layernorm``: full.
  * ``...mlp.fc.weight`` <- ``gate_proj`` (dim 0); ``...mlp.gate.weight`` <- ``up_proj`` (dim 0);
    ``...mlp.proj.weight`` <- ``down_proj`` (dim 1).
  * ``transformer.ln_f.weight`` <- ``model.norm``: full, last stage only.
  * ``lm_head.weight`` <- ``lm_head`` (or the embedding when tied): zero-padded to ceil(V/tp)*tp rows only when
    V % tp != 0, split dim 0, last stage only; stored even when tied.

F.3 config.json: the keys checked by ``expected_config``.
"""

from __future__ import annotations

import json
import os

import torch

EMBED = "transformer.vocab_embedding.weight"
LN_F = "transformer.ln_f.weight"
LM_HEAD = "lm_head.weight"


def pad_vocab_size(vocab: int, tp: int) -> int:
    """TensorRT-LLM's ``pad_vocab_size``: ceil(V/tp)*tp."""
    return -(-vocab // tp) * tp


def rank_of(tp: int, tp_rank: int, pp_rank: int) -> int:
    """``tp_rank = rank % tp``, ``pp_rank = rank // tp`` (mapping.py, cp = 1)."""
    return pp_rank * tp + tp_rank


def _chunk(w: torch.Tensor, parts: int, r: int, dim: int = 0) -> torch.Tensor:
    n = w.shape[dim] // parts
    assert n * parts == w.shape[dim], f"{tuple(w.shape)} does not split in {parts} on dim {dim}"
    return w.narrow(dim, r * n, n).clone()


def dup_kv_weight(w: torch.Tensor, ng: int, tp: int) -> torch.Tensor:
    """TensorRT-LLM's ``dup_kv_weight``: each of the ng KV heads repeated tp/ng times consecutively (rows)."""
    reps = tp // ng
    assert reps * ng == tp, f"tp {tp} is not a multiple of {ng} KV heads"
    rest = tuple(w.shape[1:])
    return w.reshape(ng, 1, -1, *rest).expand(ng, reps, w.shape[0] // ng, *rest).reshape(ng * reps * (w.shape[0] // ng),
                                                                                         *rest).clone()


def qkv_rank(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ng: int, tp: int, r: int) -> torch.Tensor:
    """concat(q_r, k_r, v_r) of rank r (weights [rows, H] or biases [rows])."""
    if ng < tp:
        k, v = dup_kv_weight(k, ng, tp), dup_kv_weight(v, ng, tp)
    return torch.cat([_chunk(q, tp, r), _chunk(k, tp, r), _chunk(v, tp, r)], dim=0)


def expected_rank(hf: dict[str, torch.Tensor], config: dict, tp: int, pp: int, rank: int) -> dict[str, torch.Tensor]:
    """Every tensor ``rank{rank}.safetensors`` must hold, from the full HF tensors of a Llama / Qwen2 model."""
    nh = config["num_attention_heads"]
    ng = config.get("num_key_value_heads") or nh
    layers = config["num_hidden_layers"]
    vocab = config["vocab_size"]
    assert nh % tp == 0 and layers % pp == 0
    tp_rank, pp_rank = rank % tp, rank // tp
    per_stage = layers // pp
    out: dict[str, torch.Tensor] = {}

    if pp_rank == 0:
        out[EMBED] = hf["model.embed_tokens.weight"].clone()
    for local in range(per_stage):
        i = pp_rank * per_stage + local
        p, t = f"model.layers.{i}.", f"transformer.layers.{local}."
        a, m = p + "self_attn.", p + "mlp."
        out[t + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"].clone()
        out[t + "attention.qkv.weight"] = qkv_rank(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"],
                                                   hf[a + "v_proj.weight"], ng, tp, tp_rank)
        if a + "q_proj.bias" in hf:
            out[t + "attention.qkv.bias"] = qkv_rank(hf[a + "q_proj.bias"], hf[a + "k_proj.bias"],
                                                     hf[a + "v_proj.bias"], ng, tp, tp_rank)
        out[t + "attention.dense.weight"] = _chunk(hf[a + "o_proj.weight"], tp, tp_rank, 1)
        if a + "o_proj.bias" in hf:
            out[t + "attention.dense.bias"] = hf[a + "o_proj.bias"].clone()
        out[t + "post_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"].clone()
        out[t + "mlp.fc.weight"] = _chunk(hf[m + "gate_proj.weight"], tp, tp_rank, 0)
        out[t + "mlp.gate.weight"] = _chunk(hf[m + "up_proj.weight"], tp, tp_rank, 0)
        out[t + "mlp.proj.weight"] = _chunk(hf[m + "down_proj.weight"], tp, tp_rank, 1)
    if pp_rank == pp - 1:
        out[LN_F] = hf["model.norm.weight"].clone()
        head = hf.get("lm_head.weight")
        if head is None:  # tied: a copy of the embedding
            head = hf["model.embed_tokens.weight"]
        if vocab % tp:
            padded = torch.zeros((pad_vocab_size(vocab, tp), *head.shape[1:]), dtype=head.dtype)
            padded[:vocab] = head
            head = padded
        out[LM_HEAD] = _chunk(head, tp, tp_rank, 0)
    return out


def expected_config(config: dict, tp: int, pp: int, dtype: str = "float32") -> dict:
    """The F.3 config.json keys reshard must write for a Llama / Qwen2 HF config (value by key)."""
    h, nh = config["hidden_size"], config["num_attention_heads"]
    return {
        "architecture": config["architectures"][0],
        "dtype": dtype,
        "vocab_size": config["vocab_size"],
        "hidden_size": h,
        "num_hidden_layers": config["num_hidden_layers"],
        "num_attention_heads": nh,
        "num_key_value_heads": config.get("num_key_value_heads") or nh,
        "head_size": config.get("head_dim") or h // nh,
        "intermediate_size": config["intermediate_size"],
        "hidden_act": config.get("hidden_act", "silu"),
        "norm_epsilon": config["rms_norm_eps"],
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": config["max_position_embeddings"],
        "rotary_base": config.get("rope_theta", 10000.0),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp},
    }


def config_problems(got: dict, want: dict) -> list[str]:
    """Missing or different keys (``mapping``: the three keys named, extra keys allowed; numbers compared as
    floats)."""
    problems = []
    for key, value in want.items():
        if key not in got:
            problems.append(f"config.json: {key} missing (expected {value!r})")
        elif key == "mapping":
            sub = got[key] if isinstance(got[key], dict) else {}
            for k, v in value.items():
                if sub.get(k) != v:
                    problems.append(f"config.json: mapping.{k} = {sub.get(k, '<absent>')!r}, expected {v!r}")
        elif isinstance(value, float) and isinstance(got[key], (int, float)) and not isinstance(got[key], bool):
            if abs(got[key] - value) > 1e-12 * max(1.0, abs(value)):
                problems.append(f"config.json: {key} = {got[key]!r}, expected {value!r}")
        elif got[key] != value:
            problems.append(f"config.json: {key} = {got[key]!r}, expected {value!r}")
    return problems


def load_rank(folder, rank: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(str(folder), f"rank{rank}.safetensors"))


def load_config(folder) -> dict:
    with open(os.path.join(str(folder), "config.json")) as f:
        return json.load(f)
