"""torchtitan's parameter names for the Llama family and Qwen3 (dense), in both spellings torchtitan has saved:
``v0.2`` (torchtitan v0.2.x: ``layers.{i}.attention.wq.weight``, ``output.weight``) and ``current`` (torchtitan
HEAD since 2026-06: ``layers.{i}.attention.qkv_linear.wq.weight``, ``lm_head.weight``). Each maps to one HF name
(the canonical one); checkpoints from between the two renames mix them, so a reader accepts either per tensor.

    tok_embeddings.weight                          model.embed_tokens.weight
    layers.{i}.attention.wq|wk|wv.weight           model.layers.{i}.self_attn.q_proj|k_proj|v_proj.weight  (v0.2)
    layers.{i}.attention.qkv_linear.wq|wk|wv.weight   the same                                         (current)
    layers.{i}.attention.wo.weight                 model.layers.{i}.self_attn.o_proj.weight
    layers.{i}.attention.q_norm|k_norm.weight      model.layers.{i}.self_attn.q_norm|k_norm.weight  (Qwen3)
    layers.{i}.feed_forward.w1|w3|w2.weight        model.layers.{i}.mlp.gate_proj|up_proj|down_proj.weight
    layers.{i}.attention_norm.weight               model.layers.{i}.input_layernorm.weight
    layers.{i}.ffn_norm.weight                     model.layers.{i}.post_attention_layernorm.weight
    norm.weight                                    model.norm.weight
    output.weight (v0.2) | lm_head.weight (current)   lm_head.weight

Llama's ``wq`` / ``wk`` rows are in Meta's interleaved-RoPE order (torchtitan's llama3 state-dict adapter permutes
them on the way to HF); Qwen3's are in HF's rotate-half order (its adapter does not).
"""

from __future__ import annotations

import re

from reshard.errors import CheckpointError, PlanError

SPELLINGS = ("current", "v0.2")
#: Families torchtitan trains, and whether their wq / wk rows are in interleaved-RoPE order.
FAMILIES = {"llama": True, "qwen3": False}
#: Buffers torchtitan may save beside the weights (RoPE tables, recomputed from the config).
BUFFERS = ("freqs_cis",)

_LAYER = "model.layers.{layer}."
_SHARED = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    _LAYER + "self_attn.o_proj.weight": "layers.{layer}.attention.wo.weight",
    _LAYER + "self_attn.q_norm.weight": "layers.{layer}.attention.q_norm.weight",
    _LAYER + "self_attn.k_norm.weight": "layers.{layer}.attention.k_norm.weight",
    _LAYER + "mlp.gate_proj.weight": "layers.{layer}.feed_forward.w1.weight",
    _LAYER + "mlp.up_proj.weight": "layers.{layer}.feed_forward.w3.weight",
    _LAYER + "mlp.down_proj.weight": "layers.{layer}.feed_forward.w2.weight",
    _LAYER + "input_layernorm.weight": "layers.{layer}.attention_norm.weight",
    _LAYER + "post_attention_layernorm.weight": "layers.{layer}.ffn_norm.weight",
    "model.norm.weight": "norm.weight",
}
_QKV = {_LAYER + f"self_attn.{hf}_proj.weight": f"w{tt}" for hf, tt in (("q", "q"), ("k", "k"), ("v", "v"))}
#: HF name template -> torchtitan name template, per spelling.
NAMES = {
    "v0.2": {**_SHARED, **{hf: f"layers.{{layer}}.attention.{w}.weight" for hf, w in _QKV.items()},
             "lm_head.weight": "output.weight"},
    "current": {**_SHARED, **{hf: f"layers.{{layer}}.attention.qkv_linear.{w}.weight" for hf, w in _QKV.items()},
                "lm_head.weight": "lm_head.weight"},
}


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(re.escape("{layer}"), r"(\d+)") + "$")


#: (pattern, HF template, the spelling it belongs to, None when both spell it so), for reading.
_READ = [(_pattern(tt), hf, spelling if any(tt != NAMES[other][hf] for other in SPELLINGS) else None)
         for spelling in SPELLINGS for hf, tt in NAMES[spelling].items()]
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")


def hf_name(key: str, where: str) -> tuple[str, str | None] | None:
    """(HF name, spelling or None when both spell it so) of torchtitan key ``key``; None for a buffer torchtitan
    may save (``freqs_cis``). A Mixture-of-Experts weight or any other name is refused, naming it."""
    for pattern, hf, spelling in _READ:
        m = pattern.match(key)
        if m:
            return (hf.format(layer=m.group(1)) if m.groups() else hf), spelling
    if key in BUFFERS:
        return None
    layer = _LAYER_KEY.match(key)
    if layer and layer.group(2).startswith("moe."):
        raise CheckpointError(f"{where}: '{key}' is a torchtitan Mixture-of-Experts weight (stacked experts); "
                              "reshard reads torchtitan's dense Llama and Qwen3 models only")
    if layer:
        raise CheckpointError(f"{where}: '{key}' is not a torchtitan Llama / Qwen3 layer weight reshard knows "
                              "(known: attention.wq/wk/wv/wo, attention.qkv_linear.wq/wk/wv, attention.q_norm/"
                              "k_norm, feed_forward.w1/w2/w3, attention_norm, ffn_norm)")
    raise CheckpointError(f"{where}: '{key}' is not a torchtitan weight reshard knows (expected tok_embeddings, "
                          "layers.N.*, norm, output or lm_head)")


def titan_name(hf: str, spelling: str, family: str) -> str:
    """The torchtitan name of HF tensor ``hf`` in ``spelling``; one torchtitan has no name for is refused."""
    if spelling not in SPELLINGS:
        raise PlanError(f"--torchtitan-names {spelling!r}: use current or v0.2")
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf)
    template = _LAYER + m.group(2) if m else hf
    name = NAMES[spelling].get(template)
    if name is None:
        raise PlanError(f"torchtitan has no name for '{hf}' (mapping '{family}'): --to torchtitan takes Llama and "
                        "Qwen3 dense models without biases")
    return name.format(layer=m.group(1)) if m else name
