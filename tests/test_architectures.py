"""What the new families need from the schema and the readers, one edge at a time: HF fused and transposed
storage, dropped legacy buffers, config keys that change the computation, Megatron args read faithfully, the
reference decoder against transformers per family, and refusals that name the fix.

The whole-chain checks (every family through Megatron and vLLM, rank files against independent rules) are in
tests/test_families.py; megatron-core as the oracle in tests/test_mcore_families.py.
"""

from __future__ import annotations

import argparse
import json
import re
import tomllib

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import perturbed_model, run_cli
from reshard.errors import MappingError
from reshard.io.torch_format import TorchFile
from reshard.layouts.base import Options
from reshard.layouts.megatron_args import meaning_from_args
from reshard.mapping import parse_family, shipped_mapping_names, shipped_mapping_text
from reshard.verification.forward.decoder import TPGroup, cast_weights, forward
from reshard.verification.forward.sliced_rank import load_rank as load_hf_rank

transformers = pytest.importorskip("transformers")

VOCAB = 1003  # Megatron pads it to 1024 at tp 2, vLLM to 1024
TOKENS = torch.tensor([[1, 5, 900, 1002, 7, 3, 44, 2, 650, 17]])


def _perturbed(config) -> torch.nn.Module:
    return perturbed_model(transformers, config)


#: head_dim 32 != 64 / 4; 4 layers so that Gemma's sliding and full layers alternate
GEMMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, vocab_size=VOCAB, max_position_embeddings=128)

FAMILIES = {
    "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=8, n_positions=32, n_inner=96,
                                            vocab_size=VOCAB, activation_function="gelu_new"),
    "qwen3": lambda: transformers.Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                              num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                              vocab_size=VOCAB, tie_word_embeddings=False),
    "phi3": lambda: transformers.Phi3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=8, num_key_value_heads=4, vocab_size=VOCAB,
                                            pad_token_id=0),
    "starcoder2": lambda: transformers.Starcoder2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                                        num_attention_heads=8, num_key_value_heads=2,
                                                        vocab_size=VOCAB),
    "gemma": lambda: transformers.GemmaConfig(**GEMMA),
    "gemma2": lambda: transformers.Gemma2Config(**GEMMA, sliding_window=4, query_pre_attn_scalar=24,
                                                attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **GEMMA, sliding_window=4, query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}},
        architectures=["Gemma3ForCausalLM"]),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each family's tiny perturbed model, saved by transformers: {family: (folder, model)}."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name, make in FAMILIES.items():
        model = _perturbed(make())
        model.save_pretrained(root / name)
        out[name] = (root / name, model)
    return out


# -- the reference decoder computes each family as transformers does ------------------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reference_decoder_equals_transformers(saved, family):
    """Learned positions + LayerNorm + plain tanh GELU (GPT-2), q/k norms and head_dim != H/nh (Qwen3), fused HF
    storage (Phi-3), LayerNorm with biases + GQA (StarCoder2), (1 + w) norms + embedding scale + GeGLU (Gemma),
    sandwich norms + soft-capping + query_pre_attn_scalar + alternating sliding layers (Gemma 2), q/k norms + two
    RoPE bases (Gemma 3): the decoder's logits equal transformers'."""
    folder, model = saved[family]
    weights = cast_weights(load_hf_rank(str(folder), 0, 1, Options()), torch.float32, "cpu")
    got = forward(weights, TOKENS, TPGroup(), record=False).logits[..., :VOCAB]
    with torch.no_grad():
        want = model(TOKENS).logits
    assert (got - want).abs().max().item() <= 1e-5


# -- HF storage: fused and transposed tensors ----------------------------------------------------------------------

def test_gpt2_conv1d_and_fused_c_attn_become_canonical_megatron_rows(saved, capsys, tmp_path):
    """The Megatron qkv of one rank is built from columns of the stored [H, 3H] c_attn, transposed: rank 0's first
    rows are head 0's q, k, v (per-head packing, MHA)."""
    folder, _ = saved["gpt2"]
    assert run_cli(capsys, "convert", folder, tmp_path / "m", "--to", "megatron", "--tp", "2")[0] == 0
    hf = load_file(str(folder / "model.safetensors"))
    f = TorchFile(str(tmp_path / "m/release/mp_rank_00/model_optim_rng.pt"))
    qkv = f.read("model/decoder.layers.0.self_attention.linear_qkv.weight")
    f.close()
    c_attn = hf["transformer.h.0.attn.c_attn.weight"]  # [in, out] = [64, 192], columns [Q | K | V]
    d = 8
    assert torch.equal(qkv[:d], c_attn[:, 0:d].T)                  # q of head 0
    assert torch.equal(qkv[d:2 * d], c_attn[:, 64:64 + d].T)        # k of head 0
    assert torch.equal(qkv[2 * d:3 * d], c_attn[:, 128:128 + d].T)  # v of head 0


def test_gpt2_cast_through_the_transposed_path(saved, capsys, tmp_path):
    """A dtype cast of a transposed tensor (no byte copy possible) keeps the orientation: GPT-2 -> GPT-2 bf16."""
    folder, _ = saved["gpt2"]
    assert run_cli(capsys, "convert", folder, tmp_path / "bf16", "--to", "hf", "--dtype", "bf16")[0] == 0
    a, b = load_file(str(folder / "model.safetensors")), load_file(str(tmp_path / "bf16/model.safetensors"))
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name].to(torch.bfloat16), b[name]), name


def test_gpt2_old_attention_mask_buffers_are_dropped(saved, capsys, tmp_path):
    """Old GPT-2 files store h.N.attn.bias (causal mask) and h.N.attn.masked_bias: read, ignored, never written."""
    folder, _ = saved["gpt2"]
    old = tmp_path / "old"
    old.mkdir()
    tensors = load_file(str(folder / "model.safetensors"))
    for i in range(2):
        tensors[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
        tensors[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(tensors, str(old / "model.safetensors"), metadata={"format": "pt"})
    (old / "config.json").write_text((folder / "config.json").read_text())
    assert run_cli(capsys, "convert", old, tmp_path / "v", "--to", "vllm", "--tp", "2")[0] == 0
    assert run_cli(capsys, "convert", tmp_path / "v", tmp_path / "back", "--to", "hf")[0] == 0
    back = load_file(str(tmp_path / "back/model.safetensors"))
    assert not any(".attn.bias" in n or "masked_bias" in n for n in back)
    assert set(back) == set(load_file(str(folder / "model.safetensors")))


@pytest.mark.parametrize("key, value", [("scale_attn_by_inverse_layer_idx", True), ("reorder_and_upcast_attn", True),
                                        ("scale_attn_weights", False)])
def test_gpt2_config_keys_that_change_the_math_are_refused(saved, capsys, tmp_path, key, value):
    folder, _ = saved["gpt2"]
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((folder / "config.json").read_text())
    config[key] = value
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    code, out, err = run_cli(capsys, "convert", bad, tmp_path / "out", "--to", "megatron")
    assert code == 2 and f"sets {key} = {json.dumps(value)}" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_qwen3_attention_bias_is_refused_for_megatron_before_writing(capsys, tmp_path):
    """Qwen3's attention_bias switches q/k/v and o biases without MLP biases; Megatron-LM's add_bias_linear
    switches o and MLP together: no args spell it, so the plan refuses and nothing is written."""
    config = FAMILIES["qwen3"]()
    config.attention_bias = True
    _perturbed(config).save_pretrained(tmp_path / "hf")
    code, _, err = run_cli(capsys, "convert", tmp_path / "hf", tmp_path / "m", "--to", "megatron", "--tp", "2")
    assert code == 2 and "cannot express o_bias = True" in err, err
    assert not (tmp_path / "m").exists()
    assert run_cli(capsys, "convert", tmp_path / "hf", tmp_path / "v", "--to", "vllm", "--tp", "2")[0] == 0


# -- Megatron args read faithfully ----------------------------------------------------------------------------------

def _gpt2_args(**changes) -> argparse.Namespace:
    values = dict(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=8,
                  group_query_attention=False, num_query_groups=1, kv_channels=8, max_position_embeddings=32,
                  position_embedding_type="learned_absolute", normalization="LayerNorm", norm_epsilon=1e-5,
                  add_bias_linear=True, add_qkv_bias=True, swiglu=False, bias_gelu_fusion=True,
                  untie_embeddings_and_output_weights=False)
    values.update(changes)
    return argparse.Namespace(**values)


def test_megatron_gpt2_args_mean_gpt2():
    """num_query_groups counts only with group_query_attention (Megatron-LM leaves it at 1 for MHA); the fused
    bias_gelu (Megatron-LM's default) is the tanh GELU, without it the MLP is exact GELU."""
    m = meaning_from_args(_gpt2_args(), 1003, None, "test")
    assert (m.architecture, m.kv_heads, m.position, m.norm, m.gated_mlp, m.activation) == \
        ("GPT2LMHeadModel", 8, "learned", "layer", False, "gelu_tanh")
    assert (m.qkv_bias, m.o_bias, m.mlp_bias, m.tied) == (True, True, True, True)
    assert meaning_from_args(_gpt2_args(bias_gelu_fusion=False), 1003, None, "test").activation == "gelu"


def test_megatron_args_name_the_family():
    qwen3 = meaning_from_args(_gpt2_args(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                                         qk_layernorm=True, add_bias_linear=False, add_qkv_bias=False,
                                         group_query_attention=True, num_query_groups=2, kv_channels=16),
                              1003, None, "test")
    assert (qwen3.architecture, qwen3.kv_heads, qwen3.head_dim, qwen3.qk_norm) == ("Qwen3ForCausalLM", 2, 16, True)
    starcoder = meaning_from_args(_gpt2_args(position_embedding_type="rope", group_query_attention=True,
                                             num_query_groups=2), 1003, None, "test")
    assert (starcoder.architecture, starcoder.gated_mlp, starcoder.norm) == ("Starcoder2ForCausalLM", False, "layer")


def test_tanh_gelu_without_mlp_biases_is_refused_for_megatron(capsys, tmp_path):
    """megatron-core computes tanh GELU only in its fused bias_gelu: a StarCoder2 without biases (use_bias false)
    has no Megatron spelling, refused at plan time naming the field; exact GELU has one."""
    config = FAMILIES["starcoder2"]()
    config.use_bias = False
    _perturbed(config).save_pretrained(tmp_path / "hf")
    code, _, err = run_cli(capsys, "convert", tmp_path / "hf", tmp_path / "m", "--to", "megatron")
    assert code == 2 and "cannot express activation = 'gelu_tanh'" in err, err
    config.hidden_act = "gelu"
    _perturbed(config).save_pretrained(tmp_path / "erf")
    assert run_cli(capsys, "convert", tmp_path / "erf", tmp_path / "m2", "--to", "megatron")[0] == 0
    assert run_cli(capsys, "verify", tmp_path / "erf", tmp_path / "m2")[0] == 0


def test_gpt2_config_survives_megatron_args(saved, capsys, tmp_path):
    """A GPT-2 meaning survives Megatron's args and back, in GPT-2's own config keys."""
    folder, _ = saved["gpt2"]
    assert run_cli(capsys, "convert", folder, tmp_path / "m", "--to", "megatron", "--tp", "2", "--pp", "2")[0] == 0
    assert run_cli(capsys, "convert", tmp_path / "m", tmp_path / "hf", "--to", "hf")[0] == 0
    a = json.loads((folder / "config.json").read_text())
    b = json.loads((tmp_path / "hf/config.json").read_text())
    for key in ("n_embd", "n_layer", "n_head", "n_positions", "n_inner", "layer_norm_epsilon", "vocab_size",
                "activation_function", "tie_word_embeddings", "model_type"):
        assert a[key] == b[key], key
    assert "head_dim" not in b and "num_key_value_heads" not in b and "rope_theta" not in b


# -- schema ---------------------------------------------------------------------------------------------------------

def _data(name: str) -> dict:
    return tomllib.loads(shipped_mapping_text(name))


def test_shipped_families_and_their_architectures():
    archs = {n: parse_family(_data(n), n).architectures for n in shipped_mapping_names()}
    assert {"GPT2LMHeadModel", "Qwen3ForCausalLM", "Phi3ForCausalLM", "Starcoder2ForCausalLM",
            "LlamaForCausalLM"} <= {a for v in archs.values() for a in v}


def test_hf_fused_slots_must_be_in_stored_order():
    data = _data("phi3")
    weights = data["weight"]
    q = next(i for i, w in enumerate(weights) if w.get("slot") == "q")
    weights[q], weights[q + 1] = weights[q + 1], weights[q]
    with pytest.raises(MappingError, match="must declare its slots in stored order q, k, v"):
        parse_family(data, "bad.toml")


def test_schema_refuses_transposed_vectors_and_unknown_roles():
    data = _data("gpt2")
    bias = next(w for w in data["weight"] if w["hf"] == "transformer.h.{layer}.attn.c_proj.bias")
    bias["hf_transposed"] = True
    with pytest.raises(MappingError, match="is hf_transposed but is not 2-D"):
        parse_family(data, "bad.toml")
    data = _data("gpt2")
    next(w for w in data["weight"] if w["hf"] == "transformer.wpe.weight")["role"] = "positions"
    with pytest.raises(MappingError, match=re.escape("unknown role 'positions'")):
        parse_family(data, "bad.toml")


def test_unknown_architecture_names_the_families_and_mapping(saved, capsys, tmp_path):
    folder, _ = saved["qwen3"]
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["OlmoForCausalLM"]
    (other / "config.json").write_text(json.dumps(config))
    (other / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    code, _, err = run_cli(capsys, "convert", other, tmp_path / "out", "--to", "vllm")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    for known in ("GPT2LMHeadModel", "Qwen3ForCausalLM", "Phi3ForCausalLM", "Starcoder2ForCausalLM", "--mapping FILE"):
        assert known in err


@pytest.mark.parametrize("name", ["gpt2", "qwen3", "phi3", "starcoder2"])
def test_mappings_show_documents_each_family(capsys, name):
    code, out, _ = run_cli(capsys, "mappings", "show", name)
    assert code == 0 and f'name = "{name}"' in out and out.lstrip().startswith("#")


# -- Gemma through Megatron's args ----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
def test_gemma_meaning_survives_megatron_args(saved, capsys, tmp_path, family):
    """What Megatron-LM's args spell (apply_layernorm_1p, softmax_scale, window_attn_skip_freq) goes there; the rest
    (embedding scale, sandwich norms, soft-capping, GeGLU, Gemma 3's local RoPE base) rides in the args' hf_config
    record with a note. HF -> Megatron -> HF: the config means the same (verify compares meaning, exit 0) and
    transformers loads it."""
    folder, model = saved[family]
    code, out, err = run_cli(capsys, "convert", folder, tmp_path / "m", "--to", "megatron", "--tp", "2")
    assert code == 0 and "kept in args.hf_config" in out + err, out + err
    f = TorchFile(str(tmp_path / "m/release/mp_rank_00/model_optim_rng.pt"))
    args = f.structure["args"]
    f.close()
    assert args.apply_layernorm_1p is True and args.kv_channels == 32 and args.normalization == "RMSNorm"
    if family != "gemma":
        assert args.softmax_scale == 24 ** -0.5 and args.window_size == (3, 0) and args.window_attn_skip_freq == 2
    assert run_cli(capsys, "convert", tmp_path / "m", tmp_path / "hf", "--to", "hf")[0] == 0
    assert run_cli(capsys, "verify", folder, tmp_path / "hf")[0] == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        assert (back(TOKENS).logits - model(TOKENS).logits).abs().max().item() <= 1e-5


def test_gemma_megatron_without_the_record_is_refused(saved, capsys, tmp_path):
    """Without the hf_config record, a Gemma 2's soft-capping is nowhere in Megatron-LM's args: refused, not
    guessed."""
    folder, _ = saved["gemma2"]
    assert run_cli(capsys, "convert", folder, tmp_path / "m", "--to", "megatron")[0] == 0
    path = tmp_path / "m/release/mp_rank_00/model_optim_rng.pt"
    with torch.serialization.safe_globals([argparse.Namespace]):
        state = torch.load(path, weights_only=True)
    del state["args"].hf_config
    torch.save(state, path)
    code, _, err = run_cli(capsys, "convert", tmp_path / "m", tmp_path / "hf", "--to", "hf",
                           "--architecture", "Gemma2ForCausalLM", "--vocab-size", str(VOCAB))
    assert code == 2 and "attn_softcap" in err and "no hf_config" in err, err


def test_query_scale_from_softmax_scale_rounds_to_gemmas_integers():
    for q in (24, 144, 168, 256, 1000):
        m = meaning_from_args(_gpt2_args(softmax_scale=q ** -0.5), VOCAB, None, "test")
        assert m.query_scale == float(q)


@pytest.mark.parametrize("family, features", [
    ("gemma2", ["final_softcap", "attn_softcap", "query_scale", "window_layers", "norm_offset", "embedding_scaled"]),
    ("gemma3", ["query_scale", "rope_local_theta", "window_layers", "norm_offset", "embedding_scaled"]),
])
def test_each_gemma_feature_matters(saved, family, features):
    """The decoder equals transformers with every feature on, and switching any one off moves the logits: none of
    the equalities above holds by accident."""
    import dataclasses

    folder, model = saved[family]
    weights = cast_weights(load_hf_rank(str(folder), 0, 1, Options()), torch.float32, "cpu")
    with torch.no_grad():
        want = model(TOKENS).logits
    off = {"window_layers": (), "norm_offset": False, "embedding_scaled": False}
    for feature in features:
        changed = dataclasses.replace(weights, config=dataclasses.replace(weights.config, **{feature: off.get(feature)}))
        got = forward(changed, TOKENS, TPGroup(), record=False).logits[..., :VOCAB]
        assert (got - want).abs().max().item() > 1e-4, feature  # 10 x the equality tolerance


def test_gpt2_files_without_the_transformer_prefix(saved, capsys, tmp_path):
    """The original gpt2 files name their tensors h.0.attn.c_attn.weight, wte.weight, ... (no ``transformer.``),
    with the old mask buffers: read as the prefixed names (transformers loads both), written prefixed."""
    folder, model = saved["gpt2"]
    old = tmp_path / "old"
    old.mkdir()
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(str(folder / "model.safetensors")).items()}
    tensors["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
    save_file(tensors, str(old / "model.safetensors"), metadata={"format": "pt"})
    (old / "config.json").write_text((folder / "config.json").read_text())
    assert run_cli(capsys, "verify", folder, old)[0] == 0  # the same model, whatever the names
    assert run_cli(capsys, "convert", old, tmp_path / "m", "--to", "megatron", "--tp", "2")[0] == 0
    assert run_cli(capsys, "convert", tmp_path / "m", tmp_path / "hf", "--to", "hf")[0] == 0
    back = load_file(str(tmp_path / "hf/model.safetensors"))
    assert set(back) == set(load_file(str(folder / "model.safetensors")))
