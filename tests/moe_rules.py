"""Per-rank Megatron-Core ``torch`` format and vLLM ``sharded_state`` tensors for Mixture-of-Experts models
(Mixtral, Qwen2-MoE, Qwen3-MoE), written out from the upstream facts in shared/layouts/moe.md (sections 0, 2.2-2.4,
3.1-3.3, 4.1-4.2, 5) and transformers' on-disk names, independently of reshard's planner and mapping files.

Everything goes through one canonical model (``canonical``): per layer the attention (q/k/v/o, Qwen2 q/k/v biases,
Qwen3 q/k norms), the two norms, and either a dense SwiGLU MLP or a sparse block (router [E, H]; per expert
gate/up [I, H], down [H, I]; Qwen2-MoE shared expert gate/up [Ish, H], down [H, Ish], shared-expert gate [1, H]).

HF on disk (transformers 5 ``save_pretrained``, per-expert original format, moe.md 2.2-2.4):
  * Mixtral ``model.layers.N.block_sparse_moe.gate.weight``, ``block_sparse_moe.experts.{e}.w1/w3/w2.weight``
    (w1 gate, w3 up, w2 down); every layer sparse.
  * Qwen2/3-MoE ``mlp.gate.weight``, ``mlp.experts.{e}.{gate,up,down}_proj.weight``; Qwen2-MoE
    ``mlp.shared_expert.{gate,up,down}_proj.weight`` and ``mlp.shared_expert_gate.weight``. A layer is sparse iff
    ``i not in mlp_only_layers and E > 0 and (i + 1) % decoder_sparse_step == 0``; others are dense
    ``mlp.{gate,up,down}_proj`` of ``intermediate_size``.

Megatron-Core ``torch`` format (``megatron_rank``, moe.md 3.1-3.3):
  * folder ``mp_rank_{tp:02d}`` + ``_{pp:03d}`` if pp > 1 + ``_{ep:03d}`` if ep > 1.
  * expert keys use the LOCAL index j; global g = ep_rank * E/EP + j; the etp rank is s = tp_rank % ETP:
    ``mlp.experts.local_experts.{j}.linear_fc1.weight`` = [gate_g rows of s; up_g rows of s],
    ``linear_fc2.weight`` = down_g[:, columns of s].
  * ``mlp.router.weight`` full everywhere; sparse layers keep a separate ``pre_mlp_layernorm.weight`` (TE and
    local spec); dense layers fuse it in the TE spec as ``mlp.linear_fc1.layer_norm_weight``.
  * shared experts: ``mlp.shared_experts.linear_fc1.weight`` [gate_t; up_t] over the DENSE tp, ``linear_fc2.weight``
    dim 1 by dense tp, ``mlp.shared_experts.gate_weight`` [1, H] full.
  * attention, norms, embedding, output layer as for dense Llama-family models (family_rules), identical in every EP
    folder of one (tp, pp).

vLLM 0.32 ``sharded_state`` (``vllm_rank``, moe.md 4.1-4.2):
  * ``<moe>.experts.routed_experts.w13_weight`` [E, 2I/T, H] (per expert [gate_t; up_t]) and ``w2_weight``
    [E, H, I/T]; with expert parallelism rank p holds whole experts of the contiguous block
    start(p) = p*base + min(p, rem), count base + (p < rem), (base, rem) = divmod(E, T).
  * Mixtral module ``block_sparse_moe.`` with router ``block_sparse_moe.gate.weight``; Qwen2-MoE router
    ``mlp.gate.weight`` and shared ``mlp.experts._shared_experts._layer.{gate_up_proj,down_proj,expert_gate}.weight``;
    Qwen3-MoE router ``mlp.experts.gate.weight``; dense layers ``mlp.gate_up_proj`` / ``mlp.down_proj``.
  * attention as Llama (``qkv_proj`` [q_r; k_r; v_r], ``o_proj`` dim 1), Qwen3 ``q_norm``/``k_norm``; embedding and
    lm_head zero-padded to a multiple of 64 and split; four fp32 scalars 1.0 per layer
    ``self_attn.attn._{k,v,q,prob}_scale``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from family_rules import (SCALES, chunk, megatron_padded_vocab, megatron_qkv_global, pad_rows, rank_cuts,
                          vllm_kv_rows, vllm_padded_vocab)

ARCH_FAMILY = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


# ----------------------------------------------------------------------------------------- canonical model

@dataclass
class Expert:
    gate: torch.Tensor  # [I, H]
    up: torch.Tensor  # [I, H]
    down: torch.Tensor  # [H, I]


@dataclass
class MoeLayer:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    in_norm: torch.Tensor
    mlp_norm: torch.Tensor
    sparse: bool
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    # sparse layers
    router: torch.Tensor | None = None  # [E, H]
    experts: list[Expert] = field(default_factory=list)
    shared: Expert | None = None  # Qwen2-MoE shared expert
    shared_gate: torch.Tensor | None = None  # [1, H]
    # dense layers
    dense: Expert | None = None


@dataclass
class MoeCanonical:
    family: str
    h: int
    nh: int
    ng: int
    d: int
    vocab: int
    n_experts: int
    expert_ffn: int
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor | None
    layers: list[MoeLayer] = field(default_factory=list)


def family_of(config: dict) -> str:
    return ARCH_FAMILY[config["architectures"][0]]


def num_experts(config: dict) -> int:
    return config.get("num_experts") or config.get("num_local_experts")


def expert_ffn(config: dict) -> int:
    return config["intermediate_size"] if family_of(config) == "mixtral" else config["moe_intermediate_size"]


def sparse_layers(config: dict) -> list[bool]:
    """Which layers are sparse (moe.md 2.3: TF modeling_qwen2_moe.py L358; Mixtral: all)."""
    n = config["num_hidden_layers"]
    if family_of(config) == "mixtral":
        return [True] * n
    only = set(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step") or 1
    return [i not in only and num_experts(config) > 0 and (i + 1) % step == 0 for i in range(n)]


def routing_renormalised(config: dict) -> bool:
    """Mixtral always renormalises the top-k weights; Qwen2/3-MoE only with norm_topk_prob (moe.md 2.2-2.4)."""
    return True if family_of(config) == "mixtral" else bool(config.get("norm_topk_prob", False))


def canonical(hf: dict[str, torch.Tensor], config: dict) -> MoeCanonical:
    fam = family_of(config)
    h, nh = config["hidden_size"], config["num_attention_heads"]
    ng = config.get("num_key_value_heads") or nh
    d = config.get("head_dim") or h // nh
    c = MoeCanonical(fam, h, nh, ng, d, config["vocab_size"], num_experts(config), expert_ffn(config),
                     embed=hf["model.embed_tokens.weight"], final_norm=hf["model.norm.weight"],
                     lm_head=hf.get("lm_head.weight"))
    for i, sparse in enumerate(sparse_layers(config)):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        layer = MoeLayer(q=hf[a + "q_proj.weight"], k=hf[a + "k_proj.weight"], v=hf[a + "v_proj.weight"],
                         o=hf[a + "o_proj.weight"], q_bias=hf.get(a + "q_proj.bias"),
                         k_bias=hf.get(a + "k_proj.bias"), v_bias=hf.get(a + "v_proj.bias"),
                         q_norm=hf.get(a + "q_norm.weight"), k_norm=hf.get(a + "k_norm.weight"),
                         in_norm=hf[p + "input_layernorm.weight"], mlp_norm=hf[p + "post_attention_layernorm.weight"],
                         sparse=sparse)
        if fam == "mixtral":
            m = p + "block_sparse_moe."
            layer.router = hf[m + "gate.weight"]
            layer.experts = [Expert(hf[f"{m}experts.{e}.w1.weight"], hf[f"{m}experts.{e}.w3.weight"],
                                    hf[f"{m}experts.{e}.w2.weight"]) for e in range(c.n_experts)]
        elif sparse:
            m = p + "mlp."
            layer.router = hf[m + "gate.weight"]
            layer.experts = [Expert(hf[f"{m}experts.{e}.gate_proj.weight"], hf[f"{m}experts.{e}.up_proj.weight"],
                                    hf[f"{m}experts.{e}.down_proj.weight"]) for e in range(c.n_experts)]
            if m + "shared_expert.gate_proj.weight" in hf:
                layer.shared = Expert(hf[m + "shared_expert.gate_proj.weight"], hf[m + "shared_expert.up_proj.weight"],
                                      hf[m + "shared_expert.down_proj.weight"])
                layer.shared_gate = hf[m + "shared_expert_gate.weight"]
        else:
            m = p + "mlp."
            layer.dense = Expert(hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"], hf[m + "down_proj.weight"])
        c.layers.append(layer)
    return c


def hf_state(c: MoeCanonical) -> dict[str, torch.Tensor]:
    """The HF on-disk tensors of a canonical model (inverse of ``canonical``; for the rules' self-check)."""
    out = {"model.embed_tokens.weight": c.embed, "model.norm.weight": c.final_norm}
    if c.lm_head is not None:
        out["lm_head.weight"] = c.lm_head
    for i, layer in enumerate(c.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        for n in ("q", "k", "v", "o"):
            out[f"{a}{n}_proj.weight"] = getattr(layer, n)
        for n in ("q", "k", "v"):
            if getattr(layer, n + "_bias") is not None:
                out[f"{a}{n}_proj.bias"] = getattr(layer, n + "_bias")
        if layer.q_norm is not None:
            out[a + "q_norm.weight"], out[a + "k_norm.weight"] = layer.q_norm, layer.k_norm
        out[p + "input_layernorm.weight"] = layer.in_norm
        out[p + "post_attention_layernorm.weight"] = layer.mlp_norm
        if c.family == "mixtral":
            m = p + "block_sparse_moe."
            out[m + "gate.weight"] = layer.router
            for e, x in enumerate(layer.experts):
                out[f"{m}experts.{e}.w1.weight"], out[f"{m}experts.{e}.w3.weight"] = x.gate, x.up
                out[f"{m}experts.{e}.w2.weight"] = x.down
        elif layer.sparse:
            m = p + "mlp."
            out[m + "gate.weight"] = layer.router
            for e, x in enumerate(layer.experts):
                out[f"{m}experts.{e}.gate_proj.weight"], out[f"{m}experts.{e}.up_proj.weight"] = x.gate, x.up
                out[f"{m}experts.{e}.down_proj.weight"] = x.down
            if layer.shared is not None:
                out[m + "shared_expert.gate_proj.weight"] = layer.shared.gate
                out[m + "shared_expert.up_proj.weight"] = layer.shared.up
                out[m + "shared_expert.down_proj.weight"] = layer.shared.down
                out[m + "shared_expert_gate.weight"] = layer.shared_gate
        else:
            m = p + "mlp."
            out[m + "gate_proj.weight"], out[m + "up_proj.weight"] = layer.dense.gate, layer.dense.up
            out[m + "down_proj.weight"] = layer.dense.down
    return out


def swiglu_fc1(x: Expert, parts: int, r: int) -> torch.Tensor:
    """[gate_r; up_r]: rank r's contiguous 1/parts of the gate rows, then the same rows of up."""
    return torch.cat([chunk(x.gate, parts, r, 0), chunk(x.up, parts, r, 0)], dim=0)


# ------------------------------------------------------------------------------------------- Megatron

def megatron_folder(tp_rank: int, pp_rank: int, ep_rank: int, pp: int, ep: int) -> str:
    """MLM get_checkpoint_name: mp_rank_{tp:02d}[_{pp:03d} if PP > 1][_{ep:03d} if EP > 1] (moe.md 3.1)."""
    name = f"mp_rank_{tp_rank:02d}"
    if pp > 1:
        name += f"_{pp_rank:03d}"
    if ep > 1:
        name += f"_{ep_rank:03d}"
    return name


def megatron_saved_folders(tp: int, pp: int, ep: int, etp: int) -> set[str]:
    """The folders Megatron-LM itself writes (moe.md 3.1, MC RankGenerator, default order tp-cp-ep-dp-pp, CP 1):
    dense rank r = tp + TP*(dp + DP*pp), expert rank r = etp + ETP*(ep + EP*(edp + EDP*pp)); every (tp(r), pp(r),
    ep(r)) over the ranks of the smallest world both grids fit. Equal to the full TP x PP x EP product iff ETP == TP."""
    world = pp * math.lcm(tp, etp * ep)
    per_stage = world // pp
    folders = set()
    for r in range(world):
        t, p = r % tp, r // per_stage
        e = (r // etp) % ep
        folders.add(megatron_folder(t, p, e, pp, ep))
    return folders


def megatron_all_folders(tp: int, pp: int, ep: int) -> set[str]:
    return {megatron_folder(t, p, e, pp, ep) for t in range(tp) for p in range(pp) for e in range(ep)}


def megatron_rank_path(root, folder: str) -> str:
    tracker = open(os.path.join(str(root), "latest_checkpointed_iteration.txt")).read().strip()
    it = "release" if tracker == "release" else f"iter_{int(tracker):07d}"
    return os.path.join(str(root), it, folder, "model_optim_rng.pt")


def megatron_rank_folders(root) -> set[str]:
    tracker = open(os.path.join(str(root), "latest_checkpointed_iteration.txt")).read().strip()
    it = "release" if tracker == "release" else f"iter_{int(tracker):07d}"
    return {f for f in os.listdir(os.path.join(str(root), it)) if f.startswith("mp_rank_")}


def megatron_rank(hf: dict[str, torch.Tensor], config: dict, tp: int, tp_rank: int, pp: int, pp_rank: int,
                  ep: int, ep_rank: int, etp: int | None = None, spec: str = "te") -> dict[str, torch.Tensor]:
    """What ``model`` of Megatron rank folder (tp_rank, pp_rank, ep_rank) must hold (``_extra_state`` left out)."""
    c = canonical(hf, config)
    etp = tp if etp is None else etp
    assert tp % etp == 0 and c.n_experts % ep == 0 and len(c.layers) % pp == 0
    s = tp_rank % etp
    e_loc = c.n_experts // ep
    per_stage = len(c.layers) // pp
    vp = megatron_padded_vocab(c.vocab, tp)

    col, row, vocab_shard = rank_cuts(tp, tp_rank, vp)

    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = vocab_shard(c.embed)
    for local in range(per_stage):
        layer = c.layers[pp_rank * per_stage + local]
        m = f"decoder.layers.{local}."
        out[m + ("self_attention.linear_qkv.layer_norm_weight" if spec == "te" else "input_layernorm.weight")] = \
            layer.in_norm
        out[m + "self_attention.linear_qkv.weight"] = col(megatron_qkv_global(layer.q, layer.k, layer.v,
                                                                              c.nh, c.ng, c.d))
        if layer.q_bias is not None:
            out[m + "self_attention.linear_qkv.bias"] = col(megatron_qkv_global(layer.q_bias, layer.k_bias,
                                                                                layer.v_bias, c.nh, c.ng, c.d))
        if layer.q_norm is not None:
            out[m + "self_attention.q_layernorm.weight"] = layer.q_norm
            out[m + "self_attention.k_layernorm.weight"] = layer.k_norm
        out[m + "self_attention.linear_proj.weight"] = row(layer.o)
        if layer.sparse:
            out[m + "pre_mlp_layernorm.weight"] = layer.mlp_norm
            out[m + "mlp.router.weight"] = layer.router
            for j in range(e_loc):
                x = layer.experts[ep_rank * e_loc + j]
                e = f"{m}mlp.experts.local_experts.{j}."
                out[e + "linear_fc1.weight"] = swiglu_fc1(x, etp, s)
                out[e + "linear_fc2.weight"] = chunk(x.down, etp, s, 1)
            if layer.shared is not None:
                out[m + "mlp.shared_experts.linear_fc1.weight"] = swiglu_fc1(layer.shared, tp, tp_rank)
                out[m + "mlp.shared_experts.linear_fc2.weight"] = row(layer.shared.down)
                out[m + "mlp.shared_experts.gate_weight"] = layer.shared_gate
        else:
            out[m + ("mlp.linear_fc1.layer_norm_weight" if spec == "te" else "pre_mlp_layernorm.weight")] = \
                layer.mlp_norm
            out[m + "mlp.linear_fc1.weight"] = swiglu_fc1(layer.dense, tp, tp_rank)
            out[m + "mlp.linear_fc2.weight"] = row(layer.dense.down)
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = c.final_norm
        out["output_layer.weight"] = vocab_shard(c.lm_head if c.lm_head is not None else c.embed)
        if c.lm_head is None and pp == 1:
            del out["output_layer.weight"]
    return out


def megatron_moe_args(config: dict, tp: int, pp: int, ep: int, etp: int | None = None) -> dict:
    """The MoE args (Megatron-LM names) a rank file must carry, plus the parallel sizes."""
    c_sparse = sparse_layers(config)
    fam = family_of(config)
    want = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                expert_tensor_parallel_size=tp if etp is None else etp, num_experts=num_experts(config),
                moe_router_topk=config["num_experts_per_tok"], moe_ffn_hidden_size=expert_ffn(config),
                moe_router_pre_softmax=not routing_renormalised(config),
                num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
                num_attention_heads=config["num_attention_heads"],
                kv_channels=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
                padded_vocab_size=megatron_padded_vocab(config["vocab_size"], tp),
                swiglu=True, normalization="RMSNorm", add_bias_linear=False,
                untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
                qk_layernorm=fam == "qwen3_moe")
    if fam == "qwen2_moe":
        want["moe_shared_expert_intermediate_size"] = config["shared_expert_intermediate_size"]
        want["moe_shared_expert_gate"] = True
        want["add_qkv_bias"] = True
    if not all(c_sparse):
        want["ffn_hidden_size"] = config["intermediate_size"]
    want["moe_layer_freq"] = [int(x) for x in c_sparse]  # 1 is also accepted when every layer is sparse
    return want


# ------------------------------------------------------------------------------------------- vLLM

def vllm_expert_block(n_experts: int, ranks: int, p: int) -> range:
    """vLLM 'linear' expert placement (moe.md 4.2): contiguous blocks, the first E % ranks ranks one more."""
    base, rem = divmod(n_experts, ranks)
    start = p * base + min(p, rem)
    return range(start, start + base + (1 if p < rem else 0))


def vllm_rank(hf: dict[str, torch.Tensor], config: dict, tp: int, r: int,
              expert_parallel: bool = False) -> dict[str, torch.Tensor]:
    """What vLLM 0.32 sharded_state rank ``r`` of ``tp`` must hold (all its parts together)."""
    c = canonical(hf, config)
    assert c.nh % tp == 0
    vp = vllm_padded_vocab(c.vocab)
    d = c.d

    def col(w):
        return chunk(w, tp, r, 0)

    def row(w):
        return chunk(w, tp, r, 1)

    def kv(w):
        return vllm_kv_rows(w, c.ng, d, tp, r)

    def vocab_shard(w):
        return chunk(pad_rows(w, vp), tp, r, 0)

    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": vocab_shard(c.embed),
                                    "model.norm.weight": c.final_norm}
    if c.lm_head is not None:
        out["lm_head.weight"] = vocab_shard(c.lm_head)
    else:  # tied: the lexicographically smaller alias stays
        out = {("lm_head.weight" if k == "model.embed_tokens.weight" else k): v for k, v in out.items()}
    for i, layer in enumerate(c.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[p + "input_layernorm.weight"] = layer.in_norm
        out[p + "post_attention_layernorm.weight"] = layer.mlp_norm
        out[a + "qkv_proj.weight"] = torch.cat([col(layer.q), kv(layer.k), kv(layer.v)], dim=0)
        if layer.q_bias is not None:
            out[a + "qkv_proj.bias"] = torch.cat([col(layer.q_bias), kv(layer.k_bias), kv(layer.v_bias)], dim=0)
        if layer.q_norm is not None:
            out[a + "q_norm.weight"], out[a + "k_norm.weight"] = layer.q_norm, layer.k_norm
        out[a + "o_proj.weight"] = row(layer.o)
        for s in SCALES:
            out[a + "attn." + s] = torch.tensor(1.0, dtype=torch.float32)
        if not layer.sparse:
            out[p + "mlp.gate_up_proj.weight"] = swiglu_fc1(layer.dense, tp, r)
            out[p + "mlp.down_proj.weight"] = row(layer.dense.down)
            continue
        m = p + ("block_sparse_moe." if c.family == "mixtral" else "mlp.")
        router = {"mixtral": m + "gate.weight", "qwen2_moe": m + "gate.weight",
                  "qwen3_moe": m + "experts.gate.weight"}[c.family]
        out[router] = layer.router
        if expert_parallel:
            held = [layer.experts[g] for g in vllm_expert_block(c.n_experts, tp, r)]
            w13 = [torch.cat([x.gate, x.up], dim=0) for x in held]
            w2 = [x.down for x in held]
        else:
            w13 = [swiglu_fc1(x, tp, r) for x in layer.experts]
            w2 = [chunk(x.down, tp, r, 1) for x in layer.experts]
        out[m + "experts.routed_experts.w13_weight"] = torch.stack(w13) if w13 else \
            torch.empty((0, 2 * c.expert_ffn, c.h), dtype=layer.router.dtype)
        out[m + "experts.routed_experts.w2_weight"] = torch.stack(w2) if w2 else \
            torch.empty((0, c.h, c.expert_ffn), dtype=layer.router.dtype)
        if layer.shared is not None:
            sh = m + "experts._shared_experts._layer."
            out[sh + "gate_up_proj.weight"] = swiglu_fc1(layer.shared, tp, r)
            out[sh + "down_proj.weight"] = row(layer.shared.down)
            out[sh + "expert_gate.weight"] = layer.shared_gate
    return out
