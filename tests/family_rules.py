"""Per-rank Megatron-Core and vLLM ``sharded_state`` tensors for the Qwen3, GPT-2, StarCoder2 and Phi-3 families,
written out from the upstream layout facts (shared/layouts/dense-archs.md sections 1, A, C, D, E.1 and
shared/LAYOUTS.md), independently of reshard's planner and mapping files.

Everything goes through one small canonical model per family (``canonical``): q/k/v/o, fc1/fc2 (or gate/up/down),
norms and biases in ``nn.Linear`` orientation ``[out, in]``, unfused and unpadded. The two emitters then apply the
target layout's rules:

Megatron-Core ``torch`` format (``megatron_rank``):
  * ``embedding.word_embeddings.weight``: rows zero-padded to a multiple of 128*tp, contiguous row chunk per rank;
    GPT-2's ``embedding.position_embeddings.weight`` is full on every TP rank of the first stage.
  * ``linear_qkv`` weight/bias: for each KV group g, [q heads of g; k_g; v_g] (MHA: per head [q_h; k_h; v_h]);
    rank r holds a contiguous 1/tp of those rows.
  * ``linear_proj`` weight dim 1, bias full; ``linear_fc1`` [gate_r; up_r] when gated, plain column split otherwise
    (bias likewise); ``linear_fc2`` weight dim 1, bias full.
  * TE spec: input norm fused as ``linear_qkv.layer_norm_weight/_bias``, pre-MLP norm as
    ``linear_fc1.layer_norm_weight/_bias``; local spec: ``input_layernorm.*``, ``pre_mlp_layernorm.*``.
  * Qwen3 ``self_attention.q_layernorm.weight`` / ``k_layernorm.weight`` ([head_dim], replicated).
  * Layers split evenly over pp with local indices; final norm on the last stage; ``output_layer.weight`` on the
    last stage when untied, and when tied with pp > 1 (a copy of the padded embedding).

vLLM ``sharded_state`` (``vllm_rank``):
  * Llama-style names (Qwen3, Phi-3, StarCoder2): ``qkv_proj`` = [q_r; k_r; v_r] (q: contiguous nh/tp heads; kv:
    ng/tp heads, or the single head r // (tp/ng) when tp >= ng); ``o_proj`` dim 1 (bias full); gated
    ``gate_up_proj`` = [gate_r; up_r], ``down_proj`` dim 1; StarCoder2 ``mlp.c_fc`` column, ``mlp.c_proj`` row.
  * GPT-2 names (vLLM gpt2.py): ``transformer.wte``/``wpe`` (wpe full), ``transformer.h.{i}.attn.c_attn`` =
    [q_r; k_r; v_r] in nn.Linear orientation, ``attn.c_proj`` row, ``mlp.c_fc`` column, ``mlp.c_proj`` row.
  * Embedding and lm_head: rows zero-padded to a multiple of 64, split evenly. A tied model keeps the shared tensor
    once, under the lexicographically smallest of the two names (``lm_head.weight``).
  * Four fp32 scalars of value 1.0 per layer: ``<attn module>.attn._{k,v,q,prob}_scale``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")

ARCH_FAMILY = {
    "GPT2LMHeadModel": "gpt2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Starcoder2ForCausalLM": "starcoder2",
}


# ----------------------------------------------------------------------------------------- canonical model

@dataclass
class Layer:
    q: torch.Tensor  # [nh*d, H]
    k: torch.Tensor  # [ng*d, H]
    v: torch.Tensor  # [ng*d, H]
    o: torch.Tensor  # [H, nh*d]
    in_norm: torch.Tensor  # [H]
    mlp_norm: torch.Tensor  # [H]
    fc2: torch.Tensor  # [H, F]  (down_proj / c_proj)
    gate: torch.Tensor | None = None  # gated MLP: [F, H] each
    up: torch.Tensor | None = None
    fc1: torch.Tensor | None = None  # plain MLP: [F, H]
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    fc1_bias: torch.Tensor | None = None
    fc2_bias: torch.Tensor | None = None
    in_norm_bias: torch.Tensor | None = None
    mlp_norm_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # Qwen3: [d]
    k_norm: torch.Tensor | None = None


@dataclass
class Canonical:
    family: str
    nh: int
    ng: int
    d: int
    vocab: int
    embed: torch.Tensor  # [V, H]
    final_norm: torch.Tensor
    layers: list[Layer] = field(default_factory=list)
    final_norm_bias: torch.Tensor | None = None
    lm_head: torch.Tensor | None = None  # None when tied
    pos_embed: torch.Tensor | None = None  # GPT-2 learned positions

    @property
    def tied(self) -> bool:
        return self.lm_head is None


def family_of(config: dict) -> str:
    return ARCH_FAMILY[config["architectures"][0]]


def dims(config: dict) -> tuple[int, int, int, int, int]:
    """(H, nh, ng, d, layers) from an HF config dict."""
    if family_of(config) == "gpt2":
        h, nh, layers = config["n_embd"], config["n_head"], config["n_layer"]
        return h, nh, nh, h // nh, layers
    h, nh = config["hidden_size"], config["num_attention_heads"]
    ng = config.get("num_key_value_heads") or nh
    d = config.get("head_dim") or h // nh
    return h, nh, ng, d, config["num_hidden_layers"]


def canonical(hf: dict[str, torch.Tensor], config: dict) -> Canonical:
    """The HF on-disk tensors of one of the four families, as the family-independent canonical model."""
    fam = family_of(config)
    h, nh, ng, d, n_layers = dims(config)
    vocab = config["vocab_size"]
    if fam == "gpt2":
        # Conv1D stores [in, out]: canonical = W.T; c_attn.T rows are [Q; K; V], each heads-major (H rows).
        c = Canonical(fam, nh, ng, d, vocab, embed=hf["transformer.wte.weight"],
                      pos_embed=hf["transformer.wpe.weight"], final_norm=hf["transformer.ln_f.weight"],
                      final_norm_bias=hf["transformer.ln_f.bias"], lm_head=hf.get("lm_head.weight"))
        for i in range(n_layers):
            p = f"transformer.h.{i}."
            qkv = hf[p + "attn.c_attn.weight"].t()
            qkv_b = hf[p + "attn.c_attn.bias"]
            q, k, v = qkv.split([nh * d, ng * d, ng * d], dim=0)
            qb, kb, vb = qkv_b.split([nh * d, ng * d, ng * d], dim=0)
            c.layers.append(Layer(
                q=q, k=k, v=v, q_bias=qb, k_bias=kb, v_bias=vb,
                o=hf[p + "attn.c_proj.weight"].t(), o_bias=hf[p + "attn.c_proj.bias"],
                in_norm=hf[p + "ln_1.weight"], in_norm_bias=hf[p + "ln_1.bias"],
                mlp_norm=hf[p + "ln_2.weight"], mlp_norm_bias=hf[p + "ln_2.bias"],
                fc1=hf[p + "mlp.c_fc.weight"].t(), fc1_bias=hf[p + "mlp.c_fc.bias"],
                fc2=hf[p + "mlp.c_proj.weight"].t(), fc2_bias=hf[p + "mlp.c_proj.bias"]))
        return c

    c = Canonical(fam, nh, ng, d, vocab, embed=hf["model.embed_tokens.weight"], final_norm=hf["model.norm.weight"],
                  final_norm_bias=hf.get("model.norm.bias"), lm_head=hf.get("lm_head.weight"))
    for i in range(n_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        layer = dict(o=hf[a + "o_proj.weight"], o_bias=hf.get(a + "o_proj.bias"),
                     in_norm=hf[p + "input_layernorm.weight"], in_norm_bias=hf.get(p + "input_layernorm.bias"),
                     mlp_norm=hf[p + "post_attention_layernorm.weight"],
                     mlp_norm_bias=hf.get(p + "post_attention_layernorm.bias"))
        if fam == "phi3":
            # fused on disk: qkv_proj = [Q(nh*d); K(ng*d); V(ng*d)] rows, gate_up_proj = [gate(F); up(F)] rows
            q, k, v = hf[a + "qkv_proj.weight"].split([nh * d, ng * d, ng * d], dim=0)
            gate, up = hf[m + "gate_up_proj.weight"].chunk(2, dim=0)
            layer.update(q=q, k=k, v=v, gate=gate, up=up, fc2=hf[m + "down_proj.weight"])
        else:
            layer.update(q=hf[a + "q_proj.weight"], k=hf[a + "k_proj.weight"], v=hf[a + "v_proj.weight"],
                         q_bias=hf.get(a + "q_proj.bias"), k_bias=hf.get(a + "k_proj.bias"),
                         v_bias=hf.get(a + "v_proj.bias"))
            if fam == "starcoder2":
                layer.update(fc1=hf[m + "c_fc.weight"], fc1_bias=hf[m + "c_fc.bias"],
                             fc2=hf[m + "c_proj.weight"], fc2_bias=hf[m + "c_proj.bias"])
            else:  # qwen3
                layer.update(gate=hf[m + "gate_proj.weight"], up=hf[m + "up_proj.weight"],
                             fc2=hf[m + "down_proj.weight"], q_norm=hf[a + "q_norm.weight"],
                             k_norm=hf[a + "k_norm.weight"])
        c.layers.append(Layer(**layer))
    return c


# ------------------------------------------------------------------------------------------- helpers

def pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    full = torch.zeros((rows, *w.shape[1:]), dtype=w.dtype)
    full[:w.shape[0]] = w
    return full


def chunk(w: torch.Tensor, parts: int, r: int, dim: int = 0) -> torch.Tensor:
    n = w.shape[dim] // parts
    assert n * parts == w.shape[dim], f"{tuple(w.shape)} does not split in {parts} on dim {dim}"
    return w.narrow(dim, r * n, n).clone()


def megatron_padded_vocab(vocab: int, tp: int, divisor: int = 128) -> int:
    m = divisor * tp
    return -(-vocab // m) * m


def vllm_padded_vocab(vocab: int) -> int:
    return -(-vocab // 64) * 64


# ------------------------------------------------------------------------------------------- Megatron

def megatron_qkv_global(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nh: int, ng: int, d: int) -> torch.Tensor:
    """``per_group`` packing: for each KV group g, [the nh/ng query heads of g; k_g; v_g]. Weights and biases."""
    rest = tuple(q.shape[1:])
    r = nh // ng
    return torch.cat([q.reshape(ng, r * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)],
                     dim=1).reshape((nh + 2 * ng) * d, *rest)


def rank_cuts(tp: int, rank: int, padded_vocab: int):
    """(column cut, row cut, vocab shard) of TP rank ``rank``: dim 0 / dim 1 in ``tp`` even parts, and the rows of
    the vocab zero-padded to ``padded_vocab``."""
    def col(w):
        return chunk(w, tp, rank, 0)

    def row(w):
        return chunk(w, tp, rank, 1)

    def vocab_shard(w):
        return chunk(pad_rows(w, padded_vocab), tp, rank, 0)
    return col, row, vocab_shard


def megatron_rank(hf: dict[str, torch.Tensor], config: dict, tp: int, tp_rank: int, pp: int, pp_rank: int,
                  spec: str = "te") -> dict[str, torch.Tensor]:
    """What ``model`` of Megatron rank (tp_rank, pp_rank) must hold (``_extra_state`` keys left out)."""
    c = canonical(hf, config)
    n_layers = len(c.layers)
    assert n_layers % pp == 0, "even pipeline split only"
    per_stage = n_layers // pp
    vp = megatron_padded_vocab(c.vocab, tp)

    col, row, vocab_shard = rank_cuts(tp, tp_rank, vp)

    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = vocab_shard(c.embed)
        if c.pos_embed is not None:
            out["embedding.position_embeddings.weight"] = c.pos_embed.clone()
    for local in range(per_stage):
        layer = c.layers[pp_rank * per_stage + local]
        m = f"decoder.layers.{local}."
        if spec == "te":
            in_w, in_b = "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias"
            mlp_w, mlp_b = "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias"
        else:
            in_w, in_b = "input_layernorm.weight", "input_layernorm.bias"
            mlp_w, mlp_b = "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias"
        out[m + in_w] = layer.in_norm
        if layer.in_norm_bias is not None:
            out[m + in_b] = layer.in_norm_bias
        out[m + "self_attention.linear_qkv.weight"] = col(megatron_qkv_global(layer.q, layer.k, layer.v,
                                                                              c.nh, c.ng, c.d))
        if layer.q_bias is not None:
            out[m + "self_attention.linear_qkv.bias"] = col(megatron_qkv_global(layer.q_bias, layer.k_bias,
                                                                                layer.v_bias, c.nh, c.ng, c.d))
        if layer.q_norm is not None:
            out[m + "self_attention.q_layernorm.weight"] = layer.q_norm
            out[m + "self_attention.k_layernorm.weight"] = layer.k_norm
        out[m + "self_attention.linear_proj.weight"] = row(layer.o)
        if layer.o_bias is not None:
            out[m + "self_attention.linear_proj.bias"] = layer.o_bias
        out[m + mlp_w] = layer.mlp_norm
        if layer.mlp_norm_bias is not None:
            out[m + mlp_b] = layer.mlp_norm_bias
        if layer.gate is not None:
            out[m + "mlp.linear_fc1.weight"] = torch.cat([col(layer.gate), col(layer.up)], dim=0)
        else:
            out[m + "mlp.linear_fc1.weight"] = col(layer.fc1)
            if layer.fc1_bias is not None:
                out[m + "mlp.linear_fc1.bias"] = col(layer.fc1_bias)
        out[m + "mlp.linear_fc2.weight"] = row(layer.fc2)
        if layer.fc2_bias is not None:
            out[m + "mlp.linear_fc2.bias"] = layer.fc2_bias
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = c.final_norm
        if c.final_norm_bias is not None:
            out["decoder.final_layernorm.bias"] = c.final_norm_bias
        if not c.tied:
            out["output_layer.weight"] = vocab_shard(c.lm_head)
        elif pp > 1:
            out["output_layer.weight"] = vocab_shard(c.embed)
    return out


def megatron_q_head_rows(config: dict, tp: int) -> tuple[slice, slice]:
    """Row ranges, inside one rank's ``linear_qkv.weight``, of two different query heads of that rank (for fault
    injection): with nh/ng >= 2 heads 0 and 1 of the rank's first group, else (MHA) the q of groups 0 and 1."""
    _, nh, ng, d, _ = dims(config)
    r = nh // ng
    assert (ng // tp) * r >= 2, "the rank must hold two query heads"
    if r >= 2:
        return slice(0, d), slice(d, 2 * d)
    stride = (r + 2) * d
    return slice(0, d), slice(stride, stride + d)


def megatron_rank_path(root, tp_rank: int, pp_rank: int, pp: int) -> str:
    """``<root>/<release|iter_NNNNNNN>/mp_rank_TT[_PPP]/model_optim_rng.pt``, the folder named by
    latest_checkpointed_iteration.txt."""
    tracker = open(os.path.join(str(root), "latest_checkpointed_iteration.txt")).read().strip()
    folder = "release" if tracker == "release" else f"iter_{int(tracker):07d}"
    rank = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return os.path.join(str(root), folder, rank, "model_optim_rng.pt")


def load_megatron_rank(path) -> dict:
    """A rank file with ``weights_only=True``; only ``argparse.Namespace`` is allow-listed (as megatron_rules)."""
    import argparse

    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)


# ------------------------------------------------------------------------------------------- vLLM

def vllm_kv_rows(w: torch.Tensor, kv_heads: int, d: int, tp: int, r: int) -> torch.Tensor:
    """vLLM rank ``r``'s K (or V) rows: ``kv_heads/tp`` contiguous heads, or when tp >= kv_heads the one head
    ``r // (tp/kv_heads)``, replicated on neighbouring ranks."""
    if tp >= kv_heads:
        head = r // (tp // kv_heads)
        return w[head * d:(head + 1) * d].clone()
    per = kv_heads // tp
    return w[r * per * d:(r + 1) * per * d].clone()


def vllm_rank(hf: dict[str, torch.Tensor], config: dict, tp: int, r: int) -> dict[str, torch.Tensor]:
    """What vLLM sharded_state rank ``r`` of ``tp`` must hold (every part of that rank together)."""
    c = canonical(hf, config)
    assert c.nh % tp == 0
    vp = vllm_padded_vocab(c.vocab)
    d = c.d

    def q_part(w):
        return chunk(w, tp, r, 0)

    def kv_part(w):
        return vllm_kv_rows(w, c.ng, d, tp, r)

    def qkv(q, k, v):
        return torch.cat([q_part(q), kv_part(k), kv_part(v)], dim=0)

    def col(w):
        return chunk(w, tp, r, 0)

    def row(w):
        return chunk(w, tp, r, 1)

    def vocab_shard(w):
        return chunk(pad_rows(w, vp), tp, r, 0)

    gpt2 = c.family == "gpt2"
    embed_name = "transformer.wte.weight" if gpt2 else "model.embed_tokens.weight"
    out: dict[str, torch.Tensor] = {}
    if c.tied:
        out[min(embed_name, "lm_head.weight")] = vocab_shard(c.embed)
    else:
        out[embed_name] = vocab_shard(c.embed)
        out["lm_head.weight"] = vocab_shard(c.lm_head)
    if gpt2:
        out["transformer.wpe.weight"] = c.pos_embed.clone()
    for i, layer in enumerate(c.layers):
        if gpt2:
            p = f"transformer.h.{i}."
            attn, qkv_name, o_name = p + "attn.", p + "attn.c_attn.", p + "attn.c_proj."
            in_norm, mlp_norm = p + "ln_1.", p + "ln_2."
            fc1_name, fc2_name = p + "mlp.c_fc.", p + "mlp.c_proj."
        else:
            p = f"model.layers.{i}."
            attn, qkv_name, o_name = p + "self_attn.", p + "self_attn.qkv_proj.", p + "self_attn.o_proj."
            in_norm, mlp_norm = p + "input_layernorm.", p + "post_attention_layernorm."
            if layer.gate is not None:
                fc1_name, fc2_name = p + "mlp.gate_up_proj.", p + "mlp.down_proj."
            else:
                fc1_name, fc2_name = p + "mlp.c_fc.", p + "mlp.c_proj."
        out[in_norm + "weight"] = layer.in_norm
        if layer.in_norm_bias is not None:
            out[in_norm + "bias"] = layer.in_norm_bias
        out[mlp_norm + "weight"] = layer.mlp_norm
        if layer.mlp_norm_bias is not None:
            out[mlp_norm + "bias"] = layer.mlp_norm_bias
        out[qkv_name + "weight"] = qkv(layer.q, layer.k, layer.v)
        if layer.q_bias is not None:
            out[qkv_name + "bias"] = qkv(layer.q_bias, layer.k_bias, layer.v_bias)
        if layer.q_norm is not None:
            out[attn + "q_norm.weight"] = layer.q_norm
            out[attn + "k_norm.weight"] = layer.k_norm
        out[o_name + "weight"] = row(layer.o)
        if layer.o_bias is not None:
            out[o_name + "bias"] = layer.o_bias
        if layer.gate is not None:
            out[fc1_name + "weight"] = torch.cat([col(layer.gate), col(layer.up)], dim=0)
        else:
            out[fc1_name + "weight"] = col(layer.fc1)
            if layer.fc1_bias is not None:
                out[fc1_name + "bias"] = col(layer.fc1_bias)
        out[fc2_name + "weight"] = row(layer.fc2)
        if layer.fc2_bias is not None:
            out[fc2_name + "bias"] = layer.fc2_bias
        for s in SCALES:
            out[attn + "attn." + s] = torch.tensor(1.0, dtype=torch.float32)
    final = "transformer.ln_f." if gpt2 else "model.norm."
    out[final + "weight"] = c.final_norm
    if c.final_norm_bias is not None:
        out[final + "bias"] = c.final_norm_bias
    return out


def load_vllm_rank(folder, r: int) -> dict[str, torch.Tensor]:
    """All tensors of rank ``r`` over its ``model-rank-{r}-part-{p}.safetensors`` files."""
    import glob

    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    paths = sorted(glob.glob(os.path.join(str(folder), f"model-rank-{r}-part-*.safetensors")))
    assert paths, f"no files for vLLM rank {r} in {folder}"
    for path in paths:
        with safe_open(path, "pt") as f:
            for k in f.keys():
                assert k not in tensors, f"{k} stored twice on rank {r}"
                tensors[k] = f.get_tensor(k)
    return tensors


# ------------------------------------------------------------------------------------------- HF

def load_hf_dir(folder) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor of an HF folder (single file or shards) and its config.json."""
    import glob

    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(str(folder), "*.safetensors"))):
        with safe_open(path, "pt") as f:
            for k in f.keys():
                assert k not in tensors, f"{k} stored twice in {folder}"
                tensors[k] = f.get_tensor(k)
    with open(os.path.join(str(folder), "config.json")) as f:
        return tensors, json.load(f)


# ------------------------------------------------------------------------------------------- comparing

def diff_states(got: dict, want: dict[str, torch.Tensor], where: str, ignore=lambda k: False) -> list[str]:
    """Every difference between two state dicts (names, then dtype/shape, then bytes), one line each."""
    got = {k: v for k, v in got.items() if not ignore(k)}
    problems = []
    for k in sorted(set(want) - set(got)):
        problems.append(f"{where}: missing {k} {tuple(want[k].shape)}")
    for k in sorted(set(got) - set(want)):
        shape = tuple(got[k].shape) if isinstance(got[k], torch.Tensor) else type(got[k]).__name__
        problems.append(f"{where}: unexpected {k} {shape}")
    for k in sorted(set(got) & set(want)):
        g, w = got[k], want[k]
        if not isinstance(g, torch.Tensor):
            problems.append(f"{where}: {k} is {type(g).__name__}, expected a tensor")
        elif g.dtype != w.dtype or tuple(g.shape) != tuple(w.shape):
            problems.append(f"{where}: {k} {g.dtype} {tuple(g.shape)}, expected {w.dtype} {tuple(w.shape)}")
        elif not torch.equal(g, w):
            problems.append(f"{where}: {k} bytes differ (max |diff| {(g.double() - w.double()).abs().max():.3g})")
    return problems
