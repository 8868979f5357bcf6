"""Independent rule module for vision-language models in vLLM 0.32 (written from vlm.md §3, §4, §6 and the
issue-35 plan §3; imports nothing from reshard): from a Hugging Face state dict in the Hub spelling (vlm.md §2.1)
and its config.json, the exact tensors one vLLM tensor-parallel rank holds, as
``ShardedStateLoader._filter_subtensors(model.state_dict())`` of the model vLLM builds and loads itself (before
``process_weights_after_loading``), i.e. what a vLLM ``sharded_state`` folder of that rank holds.

Notation: t = TP degree, r = rank; "col" = rows ``[r·n/t, (r+1)·n/t)`` (dim 0), "row" = the same on dim 1,
"rep" = whole on every rank.

Language model (every family): HF body prefix -> ``language_model.model.``, head -> ``language_model.lm_head.weight``
- ``self_attn.{q,k,v}_proj.{weight,bias}`` -> ``self_attn.qkv_proj.*`` = ``[q_r; k_r; v_r]``: q_r the rank's nh/t
  heads; k_r / v_r its ng/t KV heads, or (ng < t) KV head ``r // (t / ng)`` replicated.
- ``mlp.{gate,up}_proj.weight`` -> ``mlp.gate_up_proj.weight`` = ``[gate_r; up_r]`` (col each).
- ``self_attn.o_proj.weight``, ``mlp.down_proj.weight``: row.
- ``embed_tokens.weight`` and the head: rows padded with zeros to a multiple of 64, then col.
  A tied head (Gemma 3) is one tensor in vLLM, kept under the smaller name ``language_model.lm_head.weight``.
- norms (``input_layernorm``, ``post_attention_layernorm``, Gemma 3's ``pre/post_feedforward_layernorm``, Qwen3 /
  Gemma 3 ``self_attn.{q,k}_norm``, final ``norm``): rep.
- each layer's ``self_attn.attn._{k,v,q,prob}_scale``: fp32 scalar 1.0 (shape ``()``).

Towers (nh = ng = nv vision heads for every qkv):
- Qwen2.5-VL, HF ``visual.`` -> ``visual.``: ``attn.qkv`` (HF ``[Q; K; V]`` fused) qkv; ``attn.proj`` row;
  ``mlp.{gate,up}_proj.{weight,bias}`` -> ``mlp.gate_up_proj.*`` ``[gate_r; up_r]``; ``mlp.down_proj`` row;
  ``merger.mlp.0`` col; ``merger.mlp.2`` row; norms, ``patch_embed``, ``merger.ln_q`` rep.
- Qwen3-VL, HF ``model.visual.`` -> ``visual.``: ``attn.qkv`` qkv; ``attn.proj`` row; ``mlp.linear_fc1`` col;
  ``mlp.linear_fc2`` row; ``merger`` and ``deepstack_merger_list.{k}``: ``linear_fc1`` col, ``linear_fc2`` row;
  ``patch_embed`` (weight, bias), ``pos_embed``, every norm rep.
- Gemma 3 (SigLIP) and LLaVA (CLIP), ``vision_tower.vision_model.`` (same in vLLM): ``self_attn.{q,k,v}_proj`` ->
  ``self_attn.qkv_proj`` qkv; ``out_proj`` row; ``mlp.fc1`` col; ``mlp.fc2`` row; embeddings, ``pre_layrnorm``,
  layer norms, ``post_layernorm`` rep. LLaVA: only encoder layers ``< n`` (n = Lv + l + 1 for
  ``vision_feature_layer`` l < 0, l for l >= 0, the maximum over a list) and no ``post_layernorm``.
- Projectors: Gemma 3 ``multi_modal_projector.{mm_input_projection_weight [Hv, H] (as HF stores it),
  mm_soft_emb_norm.weight}`` rep; LLaVA ``multi_modal_projector.linear_1`` col, ``linear_2`` row.
- LLaVA-NeXT (vLLM ``llava_next.py``): LLaVA's tower, used layers and projector, plus ``image_newline [H]`` (a plain
  ``nn.Parameter`` built with the tower) rep, under the same name.
- Every row-parallel bias: rep.

``vision`` (how the vLLM engine was started):
- ``"weights"`` (``mm_encoder_tp_mode="weights"``, the default): towers split as above;
- ``"data"`` (``mm_encoder_tp_mode="data"``): Qwen2.5-VL / Qwen3-VL towers (merger included) whole on every rank,
  laid out as at t = 1 (``[Q; K; V]``, ``[gate; up]`` still fused under the vLLM names), whatever the vision heads;
  Gemma 3, LLaVA and LLaVA-NeXT do not support it (``supports_encoder_tp_data`` is False): vLLM warns and falls back to
  "weights", so their rank tensors are the "weights" ones;
- ``"none"`` (``limit_mm_per_prompt`` 0 for every modality): no tower and no projector tensors. LLaVA-NeXT's
  ``image_newline`` stays: ``_mark_tower_model`` replaces only the child *modules* made in its block by a
  ``StageMissingLayer``; the bare parameter is made on the meta device and stays in ``state_dict()``, so a
  ``sharded_state`` folder must still hold it (``ShardedStateLoader``: "Missing keys ('image_newline',)"; its
  values are never read: the copy into a meta tensor is a no-op).
"""

from __future__ import annotations

import re

import torch

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "gemma3", "llava", "llava_next")
#: CLIP-towered LLaVA families: only the encoder layers up to vision_feature_layer, no post_layernorm.
LLAVA_FAMILIES = ("llava", "llava_next")
VISION_MODES = ("weights", "data", "none")
VOCAB_PADDING = 64
ATTENTION_SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
VLLM_BODY = "language_model.model."
VLLM_HEAD = "language_model.lm_head.weight"

# HF (Hub spelling) body prefix and head name of the language model; None: tied, no head on disk.
HF_LM = {
    "qwen2_5_vl": ("model.", "lm_head.weight"),
    "qwen3_vl": ("model.language_model.", "lm_head.weight"),
    "gemma3": ("language_model.model.", "language_model.lm_head.weight"),
    "llava": ("language_model.model.", "language_model.lm_head.weight"),
    "llava_next": ("language_model.model.", "language_model.lm_head.weight"),
}
# HF (Hub) tower prefix -> vLLM tower prefix.
HF_TOWER = {
    "qwen2_5_vl": ("visual.", "visual."),
    "qwen3_vl": ("model.visual.", "visual."),
    "gemma3": ("vision_tower.vision_model.", "vision_tower.vision_model."),
    "llava": ("vision_tower.vision_model.", "vision_tower.vision_model."),
    "llava_next": ("vision_tower.vision_model.", "vision_tower.vision_model."),
}
PROJECTOR = "multi_modal_projector."
# Families whose vLLM model class supports mm_encoder_tp_mode="data" (supports_encoder_tp_data = True).
DATA_PARALLEL_TOWERS = ("qwen2_5_vl", "qwen3_vl")

# Rules: (pattern on the name after the prefix, kind, vLLM name after the prefix or None = the same name). Kinds:
# rep, col, row, vocab, gqa (a q/k/v member, slot = the "slot" group), qkv_fused (HF [Q; K; V] in one tensor),
# gate_up (a gate/up member, slot = the "slot" group).
LM_RULES = [
    (r"embed_tokens\.weight", "vocab", None),
    (r"layers\.(\d+)\.self_attn\.(?P<slot>[qkv])_proj\.(weight|bias)", "gqa", r"layers.\1.self_attn.qkv_proj.\3"),
    (r"layers\.\d+\.self_attn\.o_proj\.weight", "row", None),
    (r"layers\.(\d+)\.mlp\.(?P<slot>gate|up)_proj\.weight", "gate_up", r"layers.\1.mlp.gate_up_proj.weight"),
    (r"layers\.\d+\.mlp\.down_proj\.weight", "row", None),
    (r"layers\.\d+\.(input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|post_feedforward_layernorm"
     r"|self_attn\.[qk]_norm)\.weight", "rep", None),
    (r"norm\.weight", "rep", None),
]
QWEN25_TOWER_RULES = [
    (r"patch_embed\.proj\.weight", "rep", None),
    (r"blocks\.\d+\.norm[12]\.weight", "rep", None),
    (r"blocks\.\d+\.attn\.qkv\.(weight|bias)", "qkv_fused", None),
    (r"blocks\.\d+\.attn\.proj\.weight", "row", None),
    (r"blocks\.\d+\.attn\.proj\.bias", "rep", None),
    (r"(blocks\.\d+\.mlp)\.(?P<slot>gate|up)_proj\.(weight|bias)", "gate_up", r"\1.gate_up_proj.\3"),
    (r"blocks\.\d+\.mlp\.down_proj\.weight", "row", None),
    (r"blocks\.\d+\.mlp\.down_proj\.bias", "rep", None),
    (r"merger\.ln_q\.weight", "rep", None),
    (r"merger\.mlp\.0\.(weight|bias)", "col", None),
    (r"merger\.mlp\.2\.weight", "row", None),
    (r"merger\.mlp\.2\.bias", "rep", None),
]
QWEN3_TOWER_RULES = [
    (r"patch_embed\.proj\.(weight|bias)", "rep", None),
    (r"pos_embed\.weight", "rep", None),
    (r"blocks\.\d+\.norm[12]\.(weight|bias)", "rep", None),
    (r"blocks\.\d+\.attn\.qkv\.(weight|bias)", "qkv_fused", None),
    (r"blocks\.\d+\.attn\.proj\.weight", "row", None),
    (r"blocks\.\d+\.attn\.proj\.bias", "rep", None),
    (r"(blocks\.\d+\.mlp|merger|deepstack_merger_list\.\d+)\.linear_fc1\.(weight|bias)", "col", None),
    (r"(blocks\.\d+\.mlp|merger|deepstack_merger_list\.\d+)\.linear_fc2\.weight", "row", None),
    (r"(blocks\.\d+\.mlp|merger|deepstack_merger_list\.\d+)\.linear_fc2\.bias", "rep", None),
    (r"(merger|deepstack_merger_list\.\d+)\.norm\.(weight|bias)", "rep", None),
]
# SigLIP (Gemma 3) and CLIP (LLaVA) towers.
CLIP_TOWER_RULES = [
    (r"embeddings\.(patch_embedding\.(weight|bias)|position_embedding\.weight|class_embedding)", "rep", None),
    (r"pre_layrnorm\.(weight|bias)", "rep", None),
    (r"encoder\.layers\.\d+\.layer_norm[12]\.(weight|bias)", "rep", None),
    (r"(encoder\.layers\.\d+\.self_attn)\.(?P<slot>[qkv])_proj\.(weight|bias)", "gqa", r"\1.qkv_proj.\3"),
    (r"encoder\.layers\.\d+\.self_attn\.out_proj\.weight", "row", None),
    (r"encoder\.layers\.\d+\.self_attn\.out_proj\.bias", "rep", None),
    (r"encoder\.layers\.\d+\.mlp\.fc1\.(weight|bias)", "col", None),
    (r"encoder\.layers\.\d+\.mlp\.fc2\.weight", "row", None),
    (r"encoder\.layers\.\d+\.mlp\.fc2\.bias", "rep", None),
    (r"post_layernorm\.(weight|bias)", "rep", None),
]
TOWER_RULES = {"qwen2_5_vl": QWEN25_TOWER_RULES, "qwen3_vl": QWEN3_TOWER_RULES, "gemma3": CLIP_TOWER_RULES,
               "llava": CLIP_TOWER_RULES, "llava_next": CLIP_TOWER_RULES}
PROJECTOR_RULES = {
    "gemma3": [(r"mm_input_projection_weight", "rep", None), (r"mm_soft_emb_norm\.weight", "rep", None)],
    "llava": [(r"linear_1\.(weight|bias)", "col", None), (r"linear_2\.weight", "row", None),
              (r"linear_2\.bias", "rep", None)],
}
PROJECTOR_RULES["llava_next"] = PROJECTOR_RULES["llava"]
# Vision tensors outside the tower and projector prefixes: rep, under their HF names; bare parameters, so vLLM keeps
# them (on the meta device) in the "none" vision mode too.
TOP_LEVEL_VISION = {"llava_next": ("image_newline",)}


# ---- config ------------------------------------------------------------------------------------------------------

def text_value(config: dict, key: str, default=None):
    """``text_config[key]``, falling back to the top-level key (old flat Qwen2.5-VL configs), then ``default``."""
    text = config.get("text_config") or {}
    if key in text and text[key] is not None:
        return text[key]
    return config.get(key, default)


def text_dims(config: dict) -> dict:
    """H, nh, ng, d, F, L, V of the language model."""
    H, nh = text_value(config, "hidden_size"), text_value(config, "num_attention_heads")
    return dict(H=H, nh=nh, ng=text_value(config, "num_key_value_heads", nh),
                d=text_value(config, "head_dim") or H // nh, F=text_value(config, "intermediate_size"),
                L=text_value(config, "num_hidden_layers"), V=text_value(config, "vocab_size"))


def tied(config: dict) -> bool:
    """Top-level ``tie_word_embeddings`` (Qwen VL text_configs have none), else the text_config's."""
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    return bool((config.get("text_config") or {}).get("tie_word_embeddings", False))


def vision_dims(config: dict, family: str) -> dict:
    """Hv, nv, dv, Fv, Lv, the merger width Hm (Qwen: m²·Hv; CLIP / SigLIP: none)."""
    v = config["vision_config"]
    if family in ("qwen2_5_vl", "qwen3_vl"):
        Hv, nv, Lv = v["hidden_size"], v["num_heads"], v["depth"]
        Hm = Hv * v.get("spatial_merge_size", 2) ** 2
    else:
        Hv, nv, Lv, Hm = v["hidden_size"], v["num_attention_heads"], v["num_hidden_layers"], None
    return dict(Hv=Hv, nv=nv, dv=Hv // nv, Fv=v["intermediate_size"], Lv=Lv, Hm=Hm)


def llava_used_layers(config: dict) -> int:
    """n: the CLIP encoder layers vLLM builds for ``vision_feature_layer`` (int or list; vLLM ``get_layer_index``):
    Lv + l + 1 for l < 0, l for l >= 0, the maximum over a list."""
    Lv = config["vision_config"]["num_hidden_layers"]
    layers = config.get("vision_feature_layer", -2)
    layers = layers if isinstance(layers, list) else [layers]
    return max(Lv + l + 1 if l < 0 else l for l in layers)


def vision_tp_ok(config: dict, family: str, tp: int) -> bool:
    """Whether vLLM can split ``family``'s tower and projector at ``tp`` (mm_encoder_tp_mode "weights"): the vision
    heads, the vision MLP width, the Qwen merger width m²·Hv and the LLaVA projector width (text hidden) divide
    by ``tp``."""
    vd = vision_dims(config, family)
    widths = [vd["nv"], vd["Fv"]] + ([vd["Hm"]] if vd["Hm"] else [])
    if family in LLAVA_FAMILIES:
        widths.append(text_value(config, "hidden_size"))
    return all(w % tp == 0 for w in widths)


def text_tp_ok(config: dict, tp: int) -> bool:
    """Whether vLLM can split the language model at ``tp``: nh, F and the 64-padded vocab divide; the KV heads
    divide by ``tp`` or ``tp`` by them."""
    td = text_dims(config)
    kv_ok = td["ng"] % tp == 0 if td["ng"] >= tp else tp % td["ng"] == 0
    return td["nh"] % tp == 0 and td["F"] % tp == 0 and padded_vocab(td["V"]) % tp == 0 and kv_ok


# ---- split kinds -------------------------------------------------------------------------------------------------

def padded_vocab(V: int) -> int:
    return -(-V // VOCAB_PADDING) * VOCAB_PADDING


def shard(t: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    """Part ``rank`` of ``tp`` equal parts of ``t`` along ``dim``."""
    n = t.shape[dim]
    if n % tp:
        raise ValueError(f"dimension {dim} of a {tuple(t.shape)} tensor does not divide by TP {tp}")
    return t.narrow(dim, rank * n // tp, n // tp)


def vocab_shard(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rows padded with zeros to a multiple of 64, then part ``rank`` (vLLM ``VocabParallelEmbedding``)."""
    pad = padded_vocab(t.shape[0]) - t.shape[0]
    return shard(torch.cat([t, t.new_zeros(pad, *t.shape[1:])]), 0, tp, rank)


def kv_heads(t: torch.Tensor, ng: int, d: int, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s K (or V) rows: its ng/t heads, or (ng < t) head ``rank // (t / ng)`` replicated."""
    if ng >= tp:
        return shard(t, 0, tp, rank)
    if tp % ng:
        raise ValueError(f"{ng} KV heads cannot be replicated over TP {tp}")
    head = rank // (tp // ng)
    return t[head * d:(head + 1) * d]


def qkv_rank(q, k, v, ng: int, d: int, tp: int, rank: int) -> torch.Tensor:
    """``[q_r; k_r; v_r]`` (vLLM ``QKVParallelLinear``): q_r = part ``rank`` of Q's heads."""
    return torch.cat([shard(q, 0, tp, rank), kv_heads(k, ng, d, tp, rank), kv_heads(v, ng, d, tp, rank)])


def _match(rules, rest: str):
    for pattern, kind, repl in rules:
        m = re.fullmatch(pattern, rest)
        if m:
            return kind, (m.expand(repl) if repl else rest), m.groupdict().get("slot")
    return None


def apply_rules(hf: dict, src_prefix: str, dst_prefix: str, rules, tp: int, rank: int, heads: tuple,
                keep=lambda rest: True) -> dict:
    """The vLLM rank tensors of every ``hf`` tensor named ``src_prefix + rest`` with ``keep(rest)``, renamed to
    ``dst_prefix + (rule's name)``; ``heads`` = (ng, d) for the qkv kinds. A name no rule matches is an error."""
    ng, d = heads
    out, members = {}, {}
    for name, t in hf.items():
        if not name.startswith(src_prefix):
            continue
        rest = name[len(src_prefix):]
        if not keep(rest):
            continue
        found = _match(rules, rest)
        if found is None:
            raise ValueError(f"no vLLM rule for the HF tensor {name}")
        kind, vname, slot = found
        vname = dst_prefix + vname
        if kind == "rep":
            out[vname] = t
        elif kind == "col":
            out[vname] = shard(t, 0, tp, rank)
        elif kind == "row":
            out[vname] = shard(t, 1, tp, rank)
        elif kind == "vocab":
            out[vname] = vocab_shard(t, tp, rank)
        elif kind == "qkv_fused":  # HF [Q; K; V], nh = ng
            out[vname] = qkv_rank(*t.chunk(3, 0), ng, d, tp, rank)
        else:  # gqa / gate_up members, assembled below
            members.setdefault((kind, vname), {})[slot] = t
    for (kind, vname), parts in members.items():
        if kind == "gqa":
            out[vname] = qkv_rank(parts["q"], parts["k"], parts["v"], ng, d, tp, rank)
        else:
            out[vname] = torch.cat([shard(parts["gate"], 0, tp, rank), shard(parts["up"], 0, tp, rank)])
    return out


# ---- per rank ----------------------------------------------------------------------------------------------------

def language_model_tensors(hf: dict, config: dict, family: str, tp: int, rank: int) -> dict:
    """The language model's rank tensors (module docstring), attention scales included."""
    body, head = HF_LM[family]
    td = text_dims(config)
    out = apply_rules(hf, body, VLLM_BODY, LM_RULES, tp, rank, (td["ng"], td["d"]))
    if tied(config):  # one tensor in vLLM; _filter_subtensors keeps the smaller name
        out[VLLM_HEAD] = out.pop(VLLM_BODY + "embed_tokens.weight")
    else:
        out[VLLM_HEAD] = vocab_shard(hf[head], tp, rank)
    for layer in range(td["L"]):
        for scale in ATTENTION_SCALES:
            out[f"{VLLM_BODY}layers.{layer}.self_attn.attn.{scale}"] = torch.tensor(1.0, dtype=torch.float32)
    return out


def tower_keep(config: dict, family: str):
    """Predicate on a tower name after its prefix: whether vLLM builds that tensor (LLaVA: encoder layers < n, no
    ``post_layernorm``; every other tower: all)."""
    if family not in LLAVA_FAMILIES:
        return lambda rest: True
    n = llava_used_layers(config)

    def keep(rest: str) -> bool:
        m = re.match(r"encoder\.layers\.(\d+)\.", rest)
        return not rest.startswith("post_layernorm.") and (m is None or int(m.group(1)) < n)
    return keep


def tower_tensors(hf: dict, config: dict, family: str, tp: int, rank: int) -> dict:
    """The vision tower's and projector's rank tensors at ``tp`` (module docstring)."""
    vd = vision_dims(config, family)
    src, dst = HF_TOWER[family]
    out = apply_rules(hf, src, dst, TOWER_RULES[family], tp, rank, (vd["nv"], vd["dv"]), tower_keep(config, family))
    if family in PROJECTOR_RULES:
        out.update(apply_rules(hf, PROJECTOR, PROJECTOR, PROJECTOR_RULES[family], tp, rank, (0, 0)))
    out.update({name: hf[name] for name in TOP_LEVEL_VISION.get(family, ())})
    return out


def vllm_rank_tensors(hf: dict, config: dict, family: str, tp: int, rank: int, vision: str = "weights") -> dict:
    """Every tensor vLLM 0.32 rank ``rank`` of ``tp`` holds for the model whose Hub-spelling tensors are ``hf`` and
    whose config.json is ``config``, started with the vision mode ``vision`` (module docstring)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown VLM family {family!r}; known: {', '.join(FAMILIES)}")
    if vision not in VISION_MODES:
        raise ValueError(f"vision is one of {', '.join(VISION_MODES)}, not {vision!r}")
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is not in 0..{tp - 1}")
    if not text_tp_ok(config, tp):
        raise ValueError(f"the {family} language model does not split at TP {tp}")
    out = language_model_tensors(hf, config, family, tp, rank)
    if vision == "data" and family not in DATA_PARALLEL_TOWERS:
        vision = "weights"  # vLLM: "This model does not support `--mm-encoder-tp-mode data`. Falling back"
    if vision == "weights":
        if not vision_tp_ok(config, family, tp):
            raise ValueError(f"the {family} vision tower does not split at TP {tp} (vision heads / widths)")
        out.update(tower_tensors(hf, config, family, tp, rank))
    elif vision == "data":
        out.update(tower_tensors(hf, config, family, 1, 0))
    else:  # "none": the bare parameters stay (module docstring)
        out.update({name: hf[name] for name in TOP_LEVEL_VISION.get(family, ())})
    return out


def absent_in_vllm(hf: dict, config: dict, family: str, vision: str = "weights") -> set:
    """The HF tensors of which a vLLM engine started in ``vision`` mode holds nothing (what vLLM -> HF cannot
    restore; LLaVA-NeXT's ``image_newline`` in "none" mode is a meta tensor: held in name only):
    LLaVA's encoder layers >= n and ``post_layernorm``; with ``vision="none"`` every tower and projector
    tensor."""
    src, _ = HF_TOWER[family]
    vision_names = {k for k in hf if k.startswith(src) or k.startswith(PROJECTOR)
                    or k in TOP_LEVEL_VISION.get(family, ())}
    if vision == "none":
        return vision_names
    keep = tower_keep(config, family)
    return {k for k in vision_names if k.startswith(src) and not keep(k[len(src):])}


def assert_vllm_folder_follows_rules(folder, hf: dict, config: dict, family: str, tp: int,
                                     vision: str = "weights") -> None:
    """Every tensor of a vLLM ``sharded_state`` folder's ``tp`` ranks (``model-rank-{r}-part-0.safetensors``) equals
    :func:`vllm_rank_tensors`'s: the same names, dtypes and bytes."""
    from safetensors.torch import load_file

    for rank in range(tp):
        got = load_file(f"{folder}/model-rank-{rank}-part-0.safetensors")
        want = vllm_rank_tensors(hf, config, family, tp, rank, vision)
        assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
