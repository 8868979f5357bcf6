"""``reshard demo``: a tiny seeded Llama checkpoint (GQA, vocab needing padding) through
hf -> megatron tp4 -> vllm tp8 (KV heads replicated) -> megatron tp2 pp2 -> hf, each step verified against the
original; the last step is also run forward with tensor parallelism over 2 processes and its logits compared with
the source's."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tempfile
import time

import torch

from reshard.io.safetensors_format import SafetensorsWriter

DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 344,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16,
    "vocab_size": 1003, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    "torch_dtype": "float32",
}


def make_demo_checkpoint(path: str, seed: int = 0) -> str:
    """Write the demo model: seeded fp32 weights in HF names (Llama layout), one safetensors file."""
    c = DEMO_CONFIG
    h, f, v, nh, ng, d = (c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_attention_heads"],
                          c["num_key_value_heads"], c["head_dim"])
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (nh * d, h),
                       p + "self_attn.k_proj.weight": (ng * d, h), p + "self_attn.v_proj.weight": (ng * d, h),
                       p + "self_attn.o_proj.weight": (h, nh * d), p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    writer = SafetensorsWriter(os.path.join(path, "model.safetensors"),
                               [(n, "F32", s) for n, s in shapes.items()])
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen) * 0.05
        writer.write(name, 1.0 + t if len(shape) == 1 else t)
    writer.finish()
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(c, fh, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as fh:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, fh)
    return path


def _forward_check(src: str, dst: str, backend: str) -> bool:
    """The last step's output run with tensor parallelism over 2 processes against the source at TP=1, on
    ``backend`` (gloo: CPU, whatever GPUs the machine has and however busy they are)."""
    from reshard.verification.forward import verify_forward

    r = verify_forward(src, dst, nproc=2, backend=backend)
    print(f"forward check: {os.path.basename(dst)} at tp=2 ({r['backend']}) vs source at tp=1: max |logit diff| "
          f"{r['max_abs']:.2g}, argmax agreement {r['argmax_agreement']:.3f} -> "
          f"{'equal within ' + r['tolerance']['basis'] + ' tolerance' if r['ok'] else 'DIFFERENT'}")
    return bool(r["ok"])


DEMO_STEPS = [("megatron-tp4", "megatron", 4, 1), ("vllm-tp8", "vllm", 8, 1), ("megatron-tp2-pp2", "megatron", 2, 2),
              ("torch-dist", "torch_dist", 2, 1), ("hf-roundtrip", "hf", 1, 1)]


def next_commands(base: str | None) -> list[str]:
    """Three commands to try on the kept demo folder ``base`` (spelt ``DIR`` where it was not kept)."""
    def path(name: str) -> str:
        return shlex.quote(os.path.join(base, name)) if base else f"DIR/{name}"

    return [f"reshard inspect {path('megatron-tp2-pp2')}",
            f"reshard convert {path('hf')} {path('my-vllm-tp2')} --to vllm --tp 2",
            f"reshard verify {path('hf')} {path('my-vllm-tp2')} --forward"]


def _run_steps(base: str, backend: str) -> bool:
    """Make the demo model in ``base``, convert it through every step, verify each; True when all agree."""
    from reshard.conversion import convert
    from reshard.verification.digest import verify

    src = make_demo_checkpoint(os.path.join(base, "hf"))
    print(f"{'step':<34}{'layout':<10}{'tp':>3}{'pp':>4}{'files':>7}{'MiB':>8}{'seconds':>9}  verify vs source")
    ok = True
    prev = src
    for name, layout, tp, pp in DEMO_STEPS:
        dst = os.path.join(base, name)
        t0 = time.perf_counter()
        result = convert(prev, dst, to=layout, tp=tp, pp=pp, overwrite=True)
        took = time.perf_counter() - t0
        report = verify(src, dst)
        matched = sum(t.ok for t in report.tensors)
        verdict = f"{matched}/{len(report.tensors)} tensors bit-exact" if report.equal else "MISMATCH"
        ok &= report.equal
        print(f"{prev.split(os.sep)[-1] + ' -> ' + name:<34}{layout:<10}{tp:>3}{pp:>4}{len(result.plan.files):>7}"
              f"{result.plan.nbytes / 2**20:>8.2f}{took:>9.2f}  {verdict}")
        prev = dst
    ok &= _forward_check(src, prev, backend)
    return ok


def run_demo(workdir: str | None = None, keep: bool = False, backend: str = "gloo") -> bool:
    """Run the demo in ``workdir`` (kept), or in a temporary folder deleted at the end unless ``keep``; print each
    step, then where the checkpoints are (or how to keep them) and three commands to try on them. ``backend``:
    the forward step's (gloo on CPU by default; ``nccl`` needs 2 GPUs, ``None`` chooses as ``verify --forward``
    does)."""
    temporary = workdir is None and not keep
    base = workdir or tempfile.mkdtemp(prefix="reshard-demo-")
    print(f"demo model: Llama, 4 layers, 8 heads / 4 KV heads, vocab 1003 (Megatron pads it), fp32, in {base}"
          + (" (temporary: deleted at the end; --keep keeps it)" if temporary else ""))
    try:
        ok = _run_steps(base, backend)
    finally:
        if temporary:
            shutil.rmtree(base, ignore_errors=True)
    print("demo passed: every step is bit-exact and computes the same logits" if ok else "demo FAILED")
    if temporary:
        print(f"deleted {base}; to keep the checkpoints run `reshard demo --keep` (or `--workdir DIR`), then try:")
    else:
        print(f"the checkpoints are kept in {base}; try next:")
    for command in next_commands(None if temporary else base):
        print(f"  {command}")
    return ok
