"""What the reference decoder can run: its activation functions, and the checks that refuse, in one line each,
weights that do not fit a decoder's features (a missing projection, a gate where the MLP is plain, norm biases
with RMSNorm, q/k or sandwich norms the config lacks) before anything is computed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reshard.errors import ReshardError
from reshard.verification.forward import mamba2
from reshard.verification.forward.rank_weights import DecoderConfig, LayerWeights, RankWeights

ACTIVATION_FUNCTIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: torch.square(F.relu(x)),  # transformers' ReLUSquaredActivation (Nemotron)
}


def check_ends(config: DecoderConfig, position_embedding: torch.Tensor | None,
               final_norm_bias: torch.Tensor | None) -> None:
    """Refuse a decoder the features do not describe, a position embedding exactly with learned positions and a
    final-norm bias only with LayerNorm."""
    if config.position not in ("rope", "learned", "none") or config.norm not in ("rms", "layer") \
            or config.mlp not in ("gated", "plain") or config.activation not in ACTIVATION_FUNCTIONS:
        raise ReshardError(f"the forward verifier has no decoder for position={config.position}, norm={config.norm},"
                           f" mlp={config.mlp}, activation={config.activation}")
    if (position_embedding is None) != (config.position != "learned"):
        raise ReshardError("learned positions need a position embedding" if config.position == "learned"
                           else "the checkpoint holds a position embedding, but the model uses RoPE")
    if config.norm == "rms" and final_norm_bias is not None:
        raise ReshardError("the final RMSNorm has no bias, but the checkpoint holds one")


def check_layer(config: DecoderConfig, i: int, layer: LayerWeights) -> None:
    """Refuse layer ``i``'s weights where they do not fit the features: every projection present; a gated MLP
    needs ``gate``, a plain one has none; only LayerNorm has norm biases; q/k norms exactly with ``qk_norm``;
    sandwich norms exactly with ``sandwich_norm``."""
    if config.mamba:  # Nemotron-H: one mixer per layer (forward/mamba2.py)
        return mamba2.check_layer(i, layer)
    if layer.gdn_qkvz is not None:  # a Gated DeltaNet layer (forward/gated_deltanet.py): its own roles
        return check_gdn_layer(i, layer)
    if config.mla:
        attention_roles = ("kv_a", "kv_a_norm", "kv_b", "o") + (("q_a", "q_a_norm", "q_b") if config.q_lora_rank
                                                                 else ("q",))
        foreign = [n for n in ("k", "v") + (("q",) if config.q_lora_rank else ("q_a", "q_a_norm", "q_b"))
                   if getattr(layer, n) is not None]
        if foreign:
            raise ReshardError(f"layer {i}: the checkpoint holds a {foreign[0]} weight, which latent attention "
                               f"{'with' if config.q_lora_rank else 'without'} q LoRA does not use")
    else:
        attention_roles = ("q", "k", "v", "o")
        foreign = [n for n in ("q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "kv_b") if getattr(layer, n) is not None]
        if foreign:
            raise ReshardError(f"layer {i}: the checkpoint holds latent-attention weight {foreign[0]}, but the config "
                               "has no kv_lora_rank")
    post_norm_block = config.sandwich_norm and layer.input_norm is None and layer.post_norm is None  # OLMo 2 / 3
    needed = ((() if post_norm_block else ("input_norm",) if config.cohere else ("input_norm", "post_norm"))
              + attention_roles
              + (() if layer.router is not None else ("up", "down")))
    missing = [n for n in needed if getattr(layer, n) is None]
    if missing:
        raise ReshardError(f"layer {i}: the checkpoint has no {missing[0]} weight (a mapping without decoder roles?)")
    if layer.router is None and (layer.gate is None) != (config.mlp == "plain"):
        raise ReshardError(f"layer {i}: a {config.mlp} MLP " + ("needs a gate projection" if layer.gate is None
                           else "has no gate projection, but the checkpoint holds one"))
    if config.norm == "rms" and (layer.input_norm_bias is not None or layer.post_norm_bias is not None):
        raise ReshardError(f"layer {i}: RMSNorm has no bias, but the checkpoint holds norm biases")
    if (layer.attn_output_norm is None or layer.mlp_output_norm is None) == config.sandwich_norm:
        raise ReshardError(f"layer {i}: " + ("sandwich norms need attention- and MLP-output norm weights"
                           if config.sandwich_norm else "the checkpoint holds output norms the config lacks"))
    if (layer.q_norm is None or layer.k_norm is None) == config.qk_norm:
        raise ReshardError(f"layer {i}: " + ("per-head q/k norms need q_norm and k_norm weights" if config.qk_norm
                           else "the checkpoint holds q/k norms, but the config has none"))


def check_gdn_layer(i: int, layer: LayerWeights) -> None:
    missing = [n for n in ("input_norm", "post_norm", "gdn_ba", "gdn_conv", "gdn_a_log", "gdn_dt_bias", "gdn_norm",
                           "gdn_out") if getattr(layer, n) is None]
    if missing:
        raise ReshardError(f"layer {i}: the checkpoint has no {missing[0]} weight for its Gated DeltaNet")


def check_features(weights: RankWeights) -> None:
    """:func:`check_ends` and :func:`check_layer` of every layer."""
    check_ends(weights.config, weights.position_embedding, weights.final_norm_bias)
    for i, layer in enumerate(weights.layers):
        check_layer(weights.config, i, layer)
