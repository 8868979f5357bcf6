"""TensorRT-LLM ``config.json`` <-> :class:`~reshard.core.model_config.ModelConfig`, for the Llama family.

The fields ``trtllm-build`` reads (``PretrainedConfig`` / ``LLaMAConfig`` ``to_dict``): ``architecture``,
``dtype``, the dims (``head_size``), ``hidden_act``, ``norm_epsilon``, ``position_embedding_type``
(``rope_gpt_neox``: rotate-half), ``rotary_base`` and ``rotary_scaling``, ``max_position_embeddings``, the bias
flags (Llama ``attn_bias`` switches q/k/v and the dense output together, ``mlp_bias``; with Qwen2's ``qwen_type
= qwen2`` ``attn_bias`` is the q/k/v biases, the dense output has none), ``tie_word_embeddings`` and ``mapping`` {world_size, tp_size, pp_size}. What
this spelling cannot say (a sliding window, partial or interleaved rotary) is a loss, refused at plan time.
"""

from __future__ import annotations

from reshard.core.model_config import ConfigLoss, ModelConfig, normalize_scaling
from reshard.errors import CheckpointError
from reshard.io import dtypes
from reshard.layouts.hf_config import HIDDEN_ACT, write_config
from reshard.mapping import ACTIVATIONS, Family
from reshard.io.tensorfile import TensorFile

#: Architectures whose q/k/v biases come without an output bias (TensorRT-LLM's ``qwen_type``).
QWEN_TYPES = {"Qwen2ForCausalLM": "qwen2"}


def trtllm_config(m: ModelConfig, family: Family, dtype: str, tp: int, pp: int, loss: ConfigLoss) -> dict:
    """The output's config.json; what it cannot spell goes to ``loss``."""
    config = {
        "architecture": m.architecture, "dtype": dtypes.hf_config_dtype(dtype), "logits_dtype": "float32",
        "vocab_size": m.vocab, "hidden_size": m.hidden, "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads, "head_size": m.head_dim,
        "intermediate_size": m.ffn, "hidden_act": HIDDEN_ACT.get(m.activation, m.activation),
        "norm_epsilon": m.norm_eps, "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": m.max_positions, "rotary_base": m.rope_theta,
        "rotary_scaling": m.scaling or None, "mlp_bias": m.mlp_bias, "attn_bias": m.o_bias,
        "residual_mlp": False, "tie_word_embeddings": m.tied, "use_parallel_embedding": False,
        "embedding_sharding_dim": 0, "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }
    qwen_type = QWEN_TYPES.get(m.architecture)
    if qwen_type:  # models/qwen/model.py: Attention(bias=config.attn_bias, dense_bias=False)
        config.update(qwen_type=qwen_type, attn_bias=m.qkv_bias)
        if not m.qkv_bias or m.o_bias:
            loss.cannot("qkv_bias", m.qkv_bias, f"TensorRT-LLM's {qwen_type} has q/k/v biases and no output bias")
    elif m.qkv_bias != m.o_bias:
        loss.cannot("qkv_bias", m.qkv_bias, "TensorRT-LLM's attn_bias switches the q/k/v and output biases together")
    if m.sliding_window:
        loss.cannot("sliding_window", m.sliding_window, "a TensorRT-LLM checkpoint config has no sliding window "
                    "(it is an engine/runtime setting)")
    if m.rotary_fraction != 1.0:
        loss.cannot("rotary_fraction", m.rotary_fraction, "this writer spells full rotary only")
    if m.rope_interleaved:
        loss.cannot("rope_interleaved", True, "this writer spells rope_gpt_neox (rotate-half) only")
    if m.rope_type not in ("default", "linear", "llama3"):
        loss.cannot("rope_scaling", m.scaling, "TensorRT-LLM's Llama reads linear and llama3 rotary scaling")
    return config


def read_trtllm_config(trt: dict, family: Family, architecture: str, files: list[TensorFile],
                       where: str) -> tuple[dict, set[str]]:
    """(an HF-style config for the family, the optional weights present) from a TensorRT-LLM config.json and its
    rank files (biases are known by their tensors)."""
    position = trt.get("position_embedding_type", "rope_gpt_neox")
    if position != "rope_gpt_neox":
        raise CheckpointError(f"{where}: position_embedding_type {position!r} is not read yet (rope_gpt_neox only)")
    if (trt.get("quantization") or {}).get("quant_algo"):
        raise CheckpointError(f"{where}: a quantized TensorRT-LLM checkpoint ({trt['quantization']['quant_algo']}); "
                              "reshard converts unquantized weights")
    try:
        hidden, heads = int(trt["hidden_size"]), int(trt["num_attention_heads"])
        layers, vocab, ffn = int(trt["num_hidden_layers"]), int(trt["vocab_size"]), int(trt["intermediate_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: missing or invalid {exc} (a TensorRT-LLM config needs hidden_size, "
                              "num_attention_heads, num_hidden_layers, vocab_size, intermediate_size)") from None
    names = {n for f in files for n in f.tensors}
    present = {s.hf for s in family.weights if s.optional and s.trtllm and s.trtllm.format(layer=0) in names}
    biases = {group: all(t in present for t in templates) for group, templates in family.config.bias_groups}
    act = trt.get("hidden_act", family.decoder.activation)
    meaning = ModelConfig(
        architecture=architecture, hidden=hidden, layers=layers, heads=heads,
        kv_heads=int(trt.get("num_key_value_heads") or heads), head_dim=int(trt.get("head_size") or hidden // heads),
        ffn=ffn, vocab=vocab, max_positions=trt.get("max_position_embeddings"), norm=family.decoder.norm,
        norm_eps=float(trt.get("norm_epsilon", 1e-6)), activation=ACTIVATIONS.get(act, act),
        rope_theta=float(trt.get("rotary_base", 10000.0)), rope_scaling=normalize_scaling(trt.get("rotary_scaling")),
        qkv_bias=biases.get("qkv", False), o_bias=biases.get("o", False), mlp_bias=biases.get("mlp", False),
        tied=bool(trt.get("tie_word_embeddings", False)))
    config = write_config(meaning, {"torch_dtype": trt.get("dtype", "float32")}, family, ConfigLoss("record"))
    return config, present
