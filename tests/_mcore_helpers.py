"""Test-only helpers for the megatron-core acceptance test, written independently of reshard.

``hand_convert`` merges the per-rank state dicts of a megatron-core (local spec) TP checkpoint into Hugging Face
Llama tensors by hand, from the layout rules of Megatron-Core itself.  It exists to prove the harness and its
settings (RoPE, RMSNorm, GQA grouping) agree with transformers before reshard is trusted with the same job,
and to build deliberately wrong conversions that show the tolerance catches layout mistakes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

HARNESS = Path(__file__).with_name("megatron_core_harness.py")


def run_isolated(cmd: list[str], timeout: float, after=None) -> subprocess.CompletedProcess:
    """Run a megatron-core harness command with no inherited distributed context, gloo on the loopback interface
    and one thread, in its own session (a timeout kills every descendant); ``after(proc)`` runs before the exit code
    is checked (e.g. a leftover-process check). Raises with the output tails on a timeout or a failure."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):  # never inherit a distributed context
        env.pop(var, None)
    cmd = [str(c) for c in cmd]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise RuntimeError(f"timed out after {timeout}s: {' '.join(cmd)}\n--- stdout ---\n{stdout[-6000:]}\n"
                           f"--- stderr ---\n{stderr[-6000:]}") from None
    if after is not None:
        after(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"failed (rc={proc.returncode}): {' '.join(cmd)}\n--- stdout ---\n{stdout[-6000:]}\n"
                           f"--- stderr ---\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_harness(
    out_dir: Path | str, *, nproc: int = 2, launcher: str = "spawn", timeout: float = 240.0
) -> dict:
    """Run the harness in a subprocess and return its ``harness_meta.json``.

    ``launcher="spawn"`` (default): the harness starts its own ranks and rendezvouses through a file store, so
    the only sockets it listens on are gloo's, on 127.0.0.1.  ``launcher="torchrun"``:
    ``python -m torch.distributed.run --standalone``, Megatron-LM's usual launcher; gloo still stays on the
    loopback interface but torchrun's own agent TCPStore listens on all interfaces.
    """
    if launcher == "spawn":
        cmd = [sys.executable, str(HARNESS), str(out_dir), "--nproc-per-node", str(nproc)]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(HARNESS), str(out_dir)]
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    run_isolated(cmd, timeout)
    with open(Path(out_dir) / "harness_meta.json") as f:
        return json.load(f)


def load_rank_state_dicts(ckpt_dir: Path | str) -> tuple[list[dict], object]:
    """Per-rank ``model`` state dicts (pp=1) and the ``args`` Namespace of the latest iteration."""
    ckpt_dir = Path(ckpt_dir)
    it = (ckpt_dir / "latest_checkpointed_iteration.txt").read_text().strip()
    it_dir = ckpt_dir / ("release" if it == "release" else f"iter_{int(it):07d}")
    ranks = sorted(p for p in it_dir.iterdir() if p.name.startswith("mp_rank_"))
    sds, args = [], None
    for p in ranks:
        blob = torch.load(p / "model_optim_rng.pt", map_location="cpu", weights_only=False)
        sds.append(blob["model"])
        args = blob["args"]
    return sds, args


def hand_convert(
    sds: list[dict],
    args,
    *,
    swap_kv: bool = False,
    swap_gate_up: bool = False,
    interleave_qk: bool = False,
    concat_fc1: bool = False,
) -> dict[str, torch.Tensor]:
    """Megatron-core local-spec TP shards -> HF Llama state dict.  The keyword flags inject known bugs."""
    nh, ng = args.num_attention_heads, args.num_query_groups
    d, H, V = args.kv_channels, args.hidden_size, args.vocab_size
    tp = len(sds)
    out: dict[str, torch.Tensor] = {}

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([sd[name] for sd in sds], dim=dim)

    out["model.embed_tokens.weight"] = cat("embedding.word_embeddings.weight", 0)[:V].clone()
    out["lm_head.weight"] = cat("output_layer.weight", 0)[:V].clone()
    out["model.norm.weight"] = sds[0]["decoder.final_layernorm.weight"].clone()

    for i in range(args.num_layers):
        pre = f"decoder.layers.{i}."
        hf = f"model.layers.{i}."
        for sd in sds[1:]:  # replicated tensors must really be replicated
            assert torch.equal(sd[pre + "input_layernorm.weight"], sds[0][pre + "input_layernorm.weight"])
        out[hf + "input_layernorm.weight"] = sds[0][pre + "input_layernorm.weight"].clone()
        out[hf + "post_attention_layernorm.weight"] = sds[0][pre + "pre_mlp_layernorm.weight"].clone()

        # linear_qkv: rows split contiguously over ranks; full tensor grouped per KV group [q_g..., k_g, v_g].
        qkv = cat(pre + "self_attention.linear_qkv.weight", 0)
        assert qkv.shape == ((nh + 2 * ng) * d, H), qkv.shape
        grouped = qkv.view(ng, (nh // ng + 2) * d, H)
        q = grouped[:, : nh // ng * d].reshape(nh * d, H)
        k = grouped[:, nh // ng * d : (nh // ng + 1) * d].reshape(ng * d, H)
        v = grouped[:, (nh // ng + 1) * d :].reshape(ng * d, H)
        if swap_kv:
            k, v = v, k
        if interleave_qk:  # Meta's interleaved-RoPE row order: the permutation HF's Llama converter undoes
            def perm(w: torch.Tensor, n: int) -> torch.Tensor:
                return w.view(n, 2, w.shape[0] // n // 2, H).transpose(1, 2).reshape(w.shape[0], H)

            q, k = perm(q, nh), perm(k, ng)
        out[hf + "self_attn.q_proj.weight"] = q.clone()
        out[hf + "self_attn.k_proj.weight"] = k.clone()
        out[hf + "self_attn.v_proj.weight"] = v.clone()
        out[hf + "self_attn.o_proj.weight"] = cat(pre + "self_attention.linear_proj.weight", 1).clone()

        # linear_fc1 with SwiGLU: each rank holds [gate_r; up_r].
        if concat_fc1:  # the classic bug: treat the rank concatenation as [gate; up]
            gate, up = cat(pre + "mlp.linear_fc1.weight", 0).chunk(2, dim=0)
        else:
            halves = [sd[pre + "mlp.linear_fc1.weight"].chunk(2, dim=0) for sd in sds]
            gate = torch.cat([g for g, _ in halves], dim=0)
            up = torch.cat([u for _, u in halves], dim=0)
        if swap_gate_up:
            gate, up = up, gate
        out[hf + "mlp.gate_proj.weight"] = gate.clone()
        out[hf + "mlp.up_proj.weight"] = up.clone()
        out[hf + "mlp.down_proj.weight"] = cat(pre + "mlp.linear_fc2.weight", 1).clone()
    assert tp >= 1
    return out


def llama_config(args):
    """The transformers LlamaConfig that matches the harness' Megatron args."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.ffn_hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_query_groups,
        head_dim=args.kv_channels,
        max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=args.norm_epsilon,
        rope_theta=float(args.rotary_base),
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def hf_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids, use_cache=False).logits.float()
