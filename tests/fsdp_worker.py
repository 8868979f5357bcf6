"""FSDP2 training checkpoints for the dcp / torchtitan tests, made by torch itself: ``python fsdp_worker.py OUT PORT``
spawns 2 processes (gloo on 127.0.0.1:PORT), shards three models with ``fully_shard`` (every block, then the
root), trains each one AdamW step and saves with ``torch.distributed.checkpoint.save``:

- ``llama_v02/step-1/``: a torchtitan-named Llama (v0.2 names, model only); ``llama_full/step-1/``: the same
  model in torchtitan's current names with its flattened optimizer state and ``train_state`` (a full save);
- ``qwen3/step-1/``: a torchtitan-named Qwen3 (current names, model only);
- ``accel/pytorch_model_fsdp_0/`` (+ ``optimizer_0/``, ``config.json``): transformers' LlamaForCausalLM as
  accelerate saves it, ``{"model": state_dict}``.

Each ``*.full.pt`` holds the trained model's ``full_tensor()`` state dict (rank 0). The torchtitan-style modules
compute what torchtitan's do (Llama: RoPE on interleaved pairs; Qwen3: rotate-half RoPE, per-head q/k RMSNorm), so
their logits are the reference a correct HF conversion reproduces. Vocab 67 gives uneven chunks (34 + 33 rows);
the Llama's 3 heads of 16 rows split 24 + 24 (a chunk boundary inside a head).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 67
LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=48, intermediate_size=40,
             num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1, head_dim=16, vocab_size=VOCAB,
             rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False,
             hidden_act="silu", torch_dtype="float32")
QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=32, intermediate_size=48,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=VOCAB,
             rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False,
             hidden_act="silu", attention_bias=False, torch_dtype="float32")
HF_LLAMA = dict(LLAMA, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8)


def rope(x: torch.Tensor, theta: float, interleaved: bool) -> torch.Tensor:
    """RoPE over ``x [b, s, heads, d]``: on pairs (2i, 2i+1) as torchtitan's Llama, else on halves (HF, Qwen3)."""
    d = x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(x.shape[1], dtype=torch.float32), freqs)  # [s, d/2]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class Attention(nn.Module):
    def __init__(s, c: dict, qk_norm: bool):
        super().__init__()
        H, nh, ng, d = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        s.nh, s.ng, s.d, s.theta, s.interleaved = nh, ng, d, c["rope_theta"], not qk_norm
        s.wq, s.wk = nn.Linear(H, nh * d, bias=False), nn.Linear(H, ng * d, bias=False)
        s.wv, s.wo = nn.Linear(H, ng * d, bias=False), nn.Linear(nh * d, H, bias=False)
        if qk_norm:
            s.q_norm, s.k_norm = nn.RMSNorm(d, eps=c["rms_norm_eps"]), nn.RMSNorm(d, eps=c["rms_norm_eps"])
        s.qk_norm = qk_norm

    def forward(s, x):
        b, n, _ = x.shape
        q, k = s.wq(x).view(b, n, s.nh, s.d), s.wk(x).view(b, n, s.ng, s.d)
        v = s.wv(x).view(b, n, s.ng, s.d)
        if s.qk_norm:
            q, k = s.q_norm(q), s.k_norm(k)
        q, k = rope(q, s.theta, s.interleaved), rope(k, s.theta, s.interleaved)
        k, v = (t.repeat_interleave(s.nh // s.ng, dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return s.wo(out.transpose(1, 2).reshape(b, n, s.nh * s.d))


class FeedForward(nn.Module):
    def __init__(s, H: int, F_: int):
        super().__init__()
        s.w1, s.w2, s.w3 = nn.Linear(H, F_, bias=False), nn.Linear(F_, H, bias=False), nn.Linear(H, F_, bias=False)

    def forward(s, x):
        return s.w2(F.silu(s.w1(x)) * s.w3(x))


class Block(nn.Module):
    def __init__(s, c: dict, qk_norm: bool):
        super().__init__()
        H, eps = c["hidden_size"], c["rms_norm_eps"]
        s.attention, s.feed_forward = Attention(c, qk_norm), FeedForward(H, c["intermediate_size"])
        s.attention_norm, s.ffn_norm = nn.RMSNorm(H, eps=eps), nn.RMSNorm(H, eps=eps)

    def forward(s, x):
        x = x + s.attention(s.attention_norm(x))
        return x + s.feed_forward(s.ffn_norm(x))


class Titan(nn.Module):
    """A torchtitan-named decoder (v0.2 names: ``output.weight``, ``attention.wq``); ``qk_norm``: Qwen3's."""

    def __init__(s, c: dict, qk_norm: bool = False):
        super().__init__()
        s.tok_embeddings = nn.Embedding(c["vocab_size"], c["hidden_size"])
        s.layers = nn.ModuleDict({str(i): Block(c, qk_norm) for i in range(c["num_hidden_layers"])})
        s.norm = nn.RMSNorm(c["hidden_size"], eps=c["rms_norm_eps"])
        s.output = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)

    def forward(s, ids):
        x = s.tok_embeddings(ids)
        for layer in s.layers.values():
            x = layer(x)
        return s.output(s.norm(x))


def current_name(key: str) -> str:
    """A v0.2 torchtitan key in torchtitan's current spelling."""
    for w in ("wq", "wk", "wv"):
        key = key.replace(f".attention.{w}.", f".attention.qkv_linear.{w}.")
    return "lm_head.weight" if key == "output.weight" else key


def perturb(model: nn.Module) -> None:
    """Seeded noise on every parameter (norm weights are not all ones)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)


def train_and_save(rank: int, model: nn.Module, mesh, out: str, name: str, forward) -> tuple[dict, object]:
    from torch.distributed.fsdp import fully_shard

    blocks = model.layers.values() if hasattr(model, "tok_embeddings") else model.model.layers
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(rank))
    forward(model, ids).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, os.path.join(out, f"{name}.full.pt"))
    return full, opt


def worker(rank: int, world: int, out: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    try:
        torch.manual_seed(0)
        llama = Titan(LLAMA)
        perturb(llama)
        _, opt = train_and_save(rank, llama, mesh, out, "llama", lambda m, ids: m(ids))
        sd = get_model_state_dict(llama)
        dcp.save(sd, checkpoint_id=os.path.join(out, "llama_v02", "step-1"))
        osd = get_optimizer_state_dict(llama, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        dcp.save({**{current_name(k): v for k, v in sd.items()}, "optimizer": osd,
                  "train_state": {"step": torch.tensor(1)}}, checkpoint_id=os.path.join(out, "llama_full", "step-1"))

        torch.manual_seed(1)
        qwen = Titan(QWEN3, qk_norm=True)
        perturb(qwen)
        train_and_save(rank, qwen, mesh, out, "qwen3", lambda m, ids: m(ids))
        dcp.save({current_name(k): v for k, v in get_model_state_dict(qwen).items()},
                 checkpoint_id=os.path.join(out, "qwen3", "step-1"))

        import transformers

        torch.manual_seed(2)
        hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_LLAMA)).float()
        perturb(hf_model)
        _, opt = train_and_save(rank, hf_model, mesh, out, "accel", lambda m, ids: m(input_ids=ids).logits)
        folder = os.path.join(out, "accel")
        dcp.save({"model": get_model_state_dict(hf_model)},
                 storage_writer=dcp.FileSystemWriter(os.path.join(folder, "pytorch_model_fsdp_0")))
        dcp.save({"optimizer": get_optimizer_state_dict(hf_model, opt)},
                 storage_writer=dcp.FileSystemWriter(os.path.join(folder, "optimizer_0")))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    target, free_port = sys.argv[1], sys.argv[2]
    os.makedirs(target, exist_ok=True)
    mp.spawn(worker, args=(2, target, free_port), nprocs=2, join=True)
