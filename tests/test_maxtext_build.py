"""Test-side MaxText checkpoints written with TensorStore alone, by maxtext-orbax.md sections 1-4 (independent of
reshard's writer): an HF state dict -> ``<out>/0/{_CHECKPOINT_METADATA, items/}``, any storage variant
(OCDBT or per-array, zarr3 or zarr2), scanned or unscanned, any chunk split. Also the tiny HF models."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

ts = pytest.importorskip("tensorstore", reason="the maxtext layout needs tensorstore (pip install 'reshard[maxtext]')")

P = "params.params."


def np_of(t):
    import torch

    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.contiguous().view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return t.contiguous().numpy()


def f32op(x, fn):
    return fn(x.astype(np.float32)).astype(x.dtype)


def interleave(x):
    """[.., d] half-split -> Meta interleaved pairs on the last axis."""
    half = x.shape[-1] // 2
    return np.stack([x[..., :half], x[..., half:]], axis=-1).reshape(x.shape)


def maxtext_leaves(family: str, cfg: dict, sd: dict, scan: bool, vocab: int | None = None) -> dict:
    """Every MaxText leaf of HF state dict ``sd`` (numpy) by the spec's section 4 rules.
    family: llama2 | llama31 | qwen3 | mixtral | gemma2 | deepseek3."""
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)
    d = cfg.get("head_dim") or h // nh
    nl = cfg["num_hidden_layers"]
    gemma = family == "gemma2"
    qbase = cfg.get("query_pre_attn_scalar", d) if gemma else d
    qscale = family in ("llama2", "llama31", "mixtral", "gemma2")
    norm = (lambda w: f32op(w, lambda x: x + np.float32(1.0))) if gemma else (lambda w: w)

    def heads_in(w, n, rope):
        x = w.T.reshape(h, n, d)
        return interleave(x) if rope else x

    def q(w):
        x = heads_in(w, nh, family == "llama31")
        return f32op(x, lambda v: v * np.float32(1 / np.sqrt(qbase))) if qscale else x

    def T(w):
        return w.T

    rules = [("self_attn.q_proj.weight", "self_attention.query.kernel", q),
             ("self_attn.k_proj.weight", "self_attention.key.kernel", lambda w: heads_in(w, nkv, family == "llama31")),
             ("self_attn.v_proj.weight", "self_attention.value.kernel", lambda w: heads_in(w, nkv, False)),
             ("self_attn.o_proj.weight", "self_attention.out.kernel", lambda w: w.T.reshape(nh, d, h))]
    if gemma:
        rules = [(a, b.replace("self_attention.", "self_attention_{s}."), f) for a, b, f in rules]
        rules += [("input_layernorm.weight", "pre_self_attention_norm_{s}.scale", norm),
                  ("post_attention_layernorm.weight", "post_self_attention_norm_{s}.scale", norm),
                  ("pre_feedforward_layernorm.weight", "pre_ffw_norm_{s}.scale", norm),
                  ("post_feedforward_layernorm.weight", "post_ffw_norm_{s}.scale", norm),
                  ("mlp.gate_proj.weight", "mlp_{s}.wi_0.kernel", T), ("mlp.up_proj.weight", "mlp_{s}.wi_1.kernel", T),
                  ("mlp.down_proj.weight", "mlp_{s}.wo.kernel", T)]
    else:
        rules += [("input_layernorm.weight", "pre_self_attention_layer_norm.scale", norm),
                  ("post_attention_layernorm.weight", "post_self_attention_layer_norm.scale", norm)]
    if family == "qwen3":
        rules += [("self_attn.q_norm.weight", "self_attention.query_norm.scale", norm),
                  ("self_attn.k_norm.weight", "self_attention.key_norm.scale", norm)]
    experts = []
    if family == "mixtral":
        rules += [("block_sparse_moe.gate.weight", "MoeBlock_0.gate.kernel", T)]
        experts = [("block_sparse_moe.experts.{e}.w1.weight", "MoeBlock_0.wi_0"),
                   ("block_sparse_moe.experts.{e}.w3.weight", "MoeBlock_0.wi_1"),
                   ("block_sparse_moe.experts.{e}.w2.weight", "MoeBlock_0.wo")]
    elif not gemma:
        rules += [("mlp.gate_proj.weight", "mlp.wi_0.kernel", T), ("mlp.up_proj.weight", "mlp.wi_1.kernel", T),
                  ("mlp.down_proj.weight", "mlp.wo.kernel", T)]
    out = {}
    emb = sd["model.embed_tokens.weight"]
    if vocab and vocab > emb.shape[0]:
        pad = np.zeros((vocab, emb.shape[1]), emb.dtype)
        pad[:emb.shape[0]] = emb
        emb = pad
    if gemma:
        emb = f32op(emb, lambda x: x * np.float32(np.sqrt(h)))
    out[P + "token_embedder.embedding"] = emb
    out[P + "decoder.decoder_norm.scale"] = norm(sd["model.norm.weight"])
    if "lm_head.weight" in sd and not cfg.get("tie_word_embeddings"):
        out[P + "decoder.logits_dense.kernel"] = sd["lm_head.weight"].T
    slots = [(k // 2, "local" if k % 2 == 0 else "global", k) for k in range(nl)] if gemma else \
        [(k, "", k) for k in range(nl)]
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for i, s, k in slots:
        for hf, mt, fn in rules:
            stacks.setdefault(mt.format(s=s), {})[i] = fn(sd[f"model.layers.{k}.{hf}"])
        for hf, mt in experts:
            ne = cfg["num_local_experts"]
            stacks.setdefault(mt, {})[i] = np.stack([sd[f"model.layers.{k}.{hf.format(e=e)}"].T for e in range(ne)])
    for mt, per in stacks.items():
        if scan:
            out[P + "decoder.layers." + mt] = np.stack([per[i] for i in sorted(per)], axis=1)
        else:
            for i, x in per.items():
                out[P + f"decoder.layers_{i}." + mt] = x
    return out


def zarr_metadata(shape, dtype, chunks, zarr3: bool, compress: bool = True) -> dict:
    if zarr3:
        inner = [{"name": "bytes", "configuration": {"endian": "little"}}]
        if compress:
            inner.append({"name": "zstd", "configuration": {"level": 3, "checksum": False}})
        return {"shape": list(shape), "data_type": dtype, "fill_value": 0,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
                "chunk_key_encoding": {"name": "default"},
                "codecs": [{"name": "sharding_indexed", "configuration": {
                    "chunk_shape": list(chunks), "codecs": inner,
                    "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]}}]}
    return {"shape": list(shape), "dtype": dtype if dtype == "bfloat16" else np.dtype(dtype).str,
            "chunks": list(chunks), "compressor": {"id": "zstd", "level": 1} if compress else None,
            "order": "C", "dimension_separator": ".", "fill_value": None}


def write_checkpoint(out: str, leaves: dict, *, ocdbt=True, zarr3=True, split=1, layer_chunk=None, scan=True,
                     custom=None, step=0, extra=None, item="items") -> str:
    """``out/<step>/`` with ``leaves`` (storage name -> numpy): chunks = the array with axis 0 split in
    ``split`` (where it divides) and, for scanned leaves (axis 1 = layers), ``layer_chunk`` layers per chunk
    (None: all, as MaxText's own saves). ``extra``: more leaves (opt_state, step) stored as they are."""
    items = os.path.join(out, str(step), item)
    os.makedirs(items, exist_ok=True)
    ctx = ts.Context()
    tree = {}
    allv = dict(leaves, **(extra or {}))
    for name, x in allv.items():
        x = np.asarray(x)
        chunks = list(x.shape) or []
        if chunks and split > 1 and chunks[0] % split == 0:
            chunks[0] //= split
        if layer_chunk and "decoder.layers." in name and len(chunks) > 1:
            chunks[1] = layer_chunk
        if ocdbt:
            kv = {"driver": "ocdbt", "base": {"driver": "file", "path": os.path.abspath(items) + "/"},
                  "path": name + "/"}
        else:
            kv = {"driver": "file", "path": os.path.join(os.path.abspath(items), name) + "/"}
        dtype = x.dtype.name
        spec = {"driver": "zarr3" if zarr3 else "zarr", "kvstore": kv,
                "metadata": zarr_metadata(x.shape, dtype, chunks or [], zarr3)}
        arr = ts.open(spec, create=True, context=ctx).result()
        arr.write(x).result()
        path = name.split(".") if not name.startswith(P) else ["params", "params"] + name[len(P):].split(".")
        tree[str(tuple(path))] = {"key_metadata": [{"key": k, "key_type": 2} for k in path],
                                  "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False,
                                                     "write_shape": list(x.shape)}}
    with open(os.path.join(items, "_METADATA"), "w") as f:
        json.dump({"tree_metadata": tree, "use_ocdbt": ocdbt, "use_zarr3": zarr3,
                   "store_array_data_equal_to_fill_value": True, "custom_metadata": None}, f)
    step_dir = os.path.join(out, str(step))
    with open(os.path.join(step_dir, "_CHECKPOINT_METADATA"), "w") as f:
        json.dump({"item_handlers": {"items": "orbax...PyTreeCheckpointHandler"}, "metrics": {},
                   "custom_metadata": dict({"scan_layers": scan}, **(custom or {}))}, f)
    for d in (items, step_dir):
        with open(os.path.join(d, "commit_success.txt"), "w") as f:
            f.write("ok")
    return step_dir


def llama_state(folder, head_dim=16, seed=0, layers=3, qwen3=False, save=False):
    """A tiny Llama (or Qwen3) config.json in ``folder`` and a seeded bf16 state dict (numpy), without transformers."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    h, nh, ng, f, v = 64, 4, 2, 96, 128
    cfg = {"architectures": ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"],
           "model_type": "qwen3" if qwen3 else "llama", "hidden_size": h, "intermediate_size": f,
           "num_hidden_layers": layers, "num_attention_heads": nh, "num_key_value_heads": ng, "head_dim": head_dim,
           "vocab_size": v, "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 64,
           "hidden_act": "silu", "torch_dtype": "bfloat16"}
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for i in range(layers):
        pre = f"model.layers.{i}."
        shapes.update({pre + "input_layernorm.weight": (h,), pre + "post_attention_layernorm.weight": (h,),
                       pre + "self_attn.q_proj.weight": (nh * head_dim, h),
                       pre + "self_attn.k_proj.weight": (ng * head_dim, h),
                       pre + "self_attn.v_proj.weight": (ng * head_dim, h),
                       pre + "self_attn.o_proj.weight": (h, nh * head_dim), pre + "mlp.gate_proj.weight": (f, h),
                       pre + "mlp.up_proj.weight": (f, h), pre + "mlp.down_proj.weight": (h, f)})
        if qwen3:
            shapes.update({pre + "self_attn.q_norm.weight": (head_dim,), pre + "self_attn.k_norm.weight": (head_dim,)})
    sd = {k: (rng.standard_normal(s) * 0.5).astype(ml_dtypes.bfloat16) for k, s in shapes.items()}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    if save:
        import torch
        from safetensors.torch import save_file

        save_file({k: torch.from_numpy(v.view(np.uint16)).view(torch.bfloat16) for k, v in sd.items()},
                  os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return cfg, sd


def tiny_llama(tmp, head_dim=16, dtype="bfloat16", tie=False, seed=0, arch="LlamaForCausalLM"):
    """A tiny Llama-family HF folder (seeded) and its state dict as numpy."""
    import torch
    import transformers

    torch.manual_seed(seed)
    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=head_dim, vocab_size=128, tie_word_embeddings=tie,
              max_position_embeddings=64)
    if arch == "Qwen3ForCausalLM":
        cfg = transformers.Qwen3Config(**kw)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**kw)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(tmp)
    sd = {k: np_of(v) for k, v in model.state_dict().items()}
    with open(os.path.join(tmp, "config.json")) as f:
        return json.load(f), sd
