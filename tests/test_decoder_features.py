"""The reference decoder is composed from features (norm, MLP kind, activation, biases), not family names: each
feature checked against a transformers model that has it, and weights that do not fit the features refused."""

from __future__ import annotations

import dataclasses
import re
import tomllib

import pytest
import torch

from checkpoints import make_hf
from reshard.errors import MappingError, ReshardError
from reshard.layouts.base import Options
from reshard.core.model_config import ModelConfig
from reshard.mapping import ACTIVATIONS, DecoderFeatures, load_shipped, parse_family, shipped_mapping_text
from reshard.verification.forward.decoder import TPGroup, cast_weights, forward
from reshard.verification.forward.sliced_rank import load_rank as load_hf_rank
from reshard.verification.forward.rank_weights import DecoderConfig, LayerWeights, RankWeights

transformers = pytest.importorskip("transformers")


def _neox_weights(model, config) -> RankWeights:
    """GPT-NeoX's tensors as decoder weights at world 1: fused query_key_value rows are per head [q_h; k_h; v_h]."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    nh, d, hidden = config.num_attention_heads, config.hidden_size // config.num_attention_heads, config.hidden_size
    layers = []
    for i in range(config.num_hidden_layers):
        p = f"gpt_neox.layers.{i}."
        qkv = sd[p + "attention.query_key_value.weight"].view(nh, 3, d, hidden)
        qkv_bias = sd[p + "attention.query_key_value.bias"].view(nh, 3, d)
        q, k, v = (qkv[:, j].reshape(nh * d, hidden) for j in range(3))
        qb, kb, vb = (qkv_bias[:, j].reshape(nh * d) for j in range(3))
        layers.append(LayerWeights(
            input_norm=sd[p + "input_layernorm.weight"], input_norm_bias=sd[p + "input_layernorm.bias"],
            post_norm=sd[p + "post_attention_layernorm.weight"], post_norm_bias=sd[p + "post_attention_layernorm.bias"],
            q=q, k=k, v=v, q_bias=qb, k_bias=kb, v_bias=vb,
            o=sd[p + "attention.dense.weight"], o_bias=sd[p + "attention.dense.bias"],
            gate=None, up=sd[p + "mlp.dense_h_to_4h.weight"], up_bias=sd[p + "mlp.dense_h_to_4h.bias"],
            down=sd[p + "mlp.dense_4h_to_h.weight"], down_bias=sd[p + "mlp.dense_4h_to_h.bias"]))
    meaning = ModelConfig(architecture="GPTNeoXForCausalLM", hidden=hidden, layers=config.num_hidden_layers,
                          heads=nh, kv_heads=nh, head_dim=d, ffn=config.intermediate_size, vocab=config.vocab_size,
                          norm="layer", norm_eps=config.layer_norm_eps, activation=ACTIVATIONS[config.hidden_act],
                          rope_theta=config.rope_parameters["rope_theta"], qkv_bias=True, o_bias=True,
                          mlp_bias=True, gated_mlp=False)
    decoder_config = DecoderConfig.from_meaning(meaning)
    emb = sd["gpt_neox.embed_in.weight"]
    return RankWeights(config=decoder_config, rank=0, world=1, embedding=emb, vocab_start=0, layers=layers,
                       final_norm=sd["gpt_neox.final_layer_norm.weight"],
                       final_norm_bias=sd["gpt_neox.final_layer_norm.bias"], lm_head=sd["lm_head.weight"],
                       lm_head_start=0, padded_vocab=emb.shape[0], dtype=emb.dtype)


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_layernorm_plain_mlp_biases_against_transformers_gpt_neox(act):
    """norm = layer (with biases), mlp = plain, every projection with a bias: GPT-NeoX (sequential residual)."""
    config = transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=8, vocab_size=1003, max_position_embeddings=128,
                                        rotary_pct=1.0, use_parallel_residual=False, hidden_act=act,
                                        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(0, 1003, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        weights = _neox_weights(model, config)
        assert weights.config.norm == "layer" and weights.config.mlp == "plain"
        got = forward(cast_weights(weights, torch.float32, "cpu"), ids, TPGroup()).logits
    assert (got - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh"])
def test_activation_comes_from_the_config(act, tmp_path):
    """A Llama-family checkpoint whose config.json says hidden_act = gelu*: the gated MLP uses it."""
    from helpers import tiny_transformers_model

    model = tiny_transformers_model(transformers, "LlamaConfig", num_key_value_heads=2, hidden_act=act)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ids = torch.randint(0, 1003, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        weights = cast_weights(load_hf_rank(str(tmp_path / "hf"), 0, 1, Options()), torch.float32, "cpu")
        got = forward(weights, ids, TPGroup()).logits
    assert weights.config.activation == {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}[act]
    assert (got - expected).abs().max().item() <= 1e-5


def test_weights_that_do_not_fit_the_features_are_refused(tmp_path):
    hf = make_hf(tmp_path / "hf", coded=False, hidden=64, layers=2, heads=8, kv_heads=2, ffn=96, vocab=1000)
    ids = torch.zeros(1, 4, dtype=torch.long)
    weights = load_hf_rank(hf, 0, 1, Options())
    plain = dataclasses.replace(weights, config=dataclasses.replace(weights.config, mlp="plain"))
    with pytest.raises(ReshardError, match="layer 0: a plain MLP has no gate projection"):
        forward(plain, ids, TPGroup())
    weights.layers[1].input_norm_bias = torch.zeros(64)
    with pytest.raises(ReshardError, match="layer 1: RMSNorm has no bias"):
        forward(weights, ids, TPGroup())
    weights.layers[1].input_norm_bias = None
    weights.layers[0].gate = None
    with pytest.raises(ReshardError, match="layer 0: a gated MLP needs a gate projection"):
        forward(weights, ids, TPGroup())


def test_what_the_decoder_lacks_is_refused_before_running():
    meaning = ModelConfig(architecture="LlamaForCausalLM", hidden=64, layers=2, heads=8, kv_heads=8, head_dim=8,
                          ffn=96, vocab=10, activation="quick_gelu")
    with pytest.raises(ReshardError, match="does not implement activation 'quick_gelu'"):
        DecoderConfig.from_meaning(meaning)
    proportional = meaning.replace(activation="silu", rope_scaling=(("factor", 4.0), ("rope_type", "proportional")))
    with pytest.raises(ReshardError, match="does not implement rope_scaling type 'proportional'"):
        DecoderConfig.from_meaning(proportional)  # Gemma 4's; yarn and the rest: tests/test_forward_features.py


def test_decoder_table_is_strict():
    data = tomllib.loads(shipped_mapping_text("llama"))
    assert parse_family(data, "llama").decoder == DecoderFeatures()
    for key, value, message in [("norm", "rmsnorm", "did you mean 'rms'"), ("mlp", "glu", "not a decoder feature"),
                                ("activation", "gelu_fast", "not one the decoder implements")]:
        bad = dict(data, decoder=dict(data["decoder"], **{key: value}))
        with pytest.raises(MappingError, match=message):
            parse_family(bad, "bad.toml")
    with pytest.raises(MappingError, match=re.escape("unknown key 'normm' in [decoder]")):
        parse_family(dict(data, decoder=dict(data["decoder"], normm="rms")), "bad.toml")
