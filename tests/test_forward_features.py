"""``verify --forward`` computes every RoPE the README's families carry as transformers does: partial rotary
(Phi-4-mini's 0.75, and 0.5), longrope (Phi-3.5 / Phi-4-mini: short factors up to the original length, long ones
past it, its cos / sin factor; the released config.json spelling too), yarn on GQA attention (Qwen2 / Qwen3
long-context configs) and dynamic NTK (past max_position_embeddings).

Each case is a tiny transformers model with seeded noise on every parameter (norm weights included). At TP 1 the
verifier's logits on the HF folder equal transformers' own (fp32, 1e-5), and the same decoder without the feature
does not (so each case exercises it); reshard's megatron / vllm tp2 outputs pass ``verify_forward`` against the HF
folder at tp2; a perturbed pass-through (unrotated) dim of one rank's layer-0 key fails, naming layer 0. The
refusals that remain (features no README family uses) are one message each.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import reshard
from helpers import tiny_transformers_model
from reshard.core.model_config import ModelConfig
from reshard.errors import ReshardError
from reshard.layouts.base import Options
from reshard.verification.forward import verify_forward
from reshard.verification.forward.decoder import TPGroup, cast_weights, forward
from reshard.verification.forward.rank_weights import DecoderConfig
from reshard.verification.forward.sliced_rank import load_rank as load_hf_rank

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
SEQS = (12, 24)  # below and past the cases' original / maximum lengths (16)
PHI3_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # Phi3Config's defaults lie outside vocab 1003
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.6], "long_factor": [2.0, 3.0, 4.0]}  # copy it:
# transformers' config classes fill the rope_scaling dict they are given in place

#: name: (config class, settings, layouts converted to at tp 2 (megatron-core has no longrope or dynamic RoPE:
#: reshard refuses those for Megatron), the decoder changes that drop the feature).
CASES = {
    "phi3_partial_0.75": ("Phi3Config", dict(num_key_value_heads=2, partial_rotary_factor=0.75, **PHI3_IDS),
                          ("megatron",), dict(rotary_fraction=1.0)),  # vllm: phi4_mini_longrope
    "phi3_partial_0.5_tied": ("Phi3Config", dict(num_key_value_heads=2, partial_rotary_factor=0.5,
                                                 tie_word_embeddings=True, **PHI3_IDS),
                              ("megatron", "vllm"), dict(rotary_fraction=1.0)),
    "phi4_mini_longrope": ("Phi3Config", dict(num_key_value_heads=2, partial_rotary_factor=0.75,
                                              tie_word_embeddings=True, rope_scaling=dict(LONGROPE),
                                              original_max_position_embeddings=16, **PHI3_IDS),
                           ("vllm",), dict(rope_scaling=dict(LONGROPE, long_factor=LONGROPE["short_factor"],
                                                             original_max_position_embeddings=16))),
    "phi4_mini_released_spelling": ("Phi3Config", dict(num_key_value_heads=2, partial_rotary_factor=0.75,
                                                       tie_word_embeddings=True, **PHI3_IDS),
                                    (), dict(rope_scaling=None)),
    "qwen2_yarn": ("Qwen2Config", dict(num_key_value_heads=2, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}), ("vllm",),
        dict(rope_scaling=None)),
    "llama_dynamic": ("LlamaConfig", dict(num_key_value_heads=2, max_position_embeddings=16, rope_scaling={
        "rope_type": "dynamic", "factor": 3.0}), ("vllm",), dict(rope_scaling=None)),
}


def released_spelling(folder) -> None:
    """Rewrite a saved Phi-3 config.json as Phi-4-mini's is released (transformers 4): a top-level
    ``original_max_position_embeddings`` 4096 and ``partial_rotary_factor``, ``rope_scaling`` of type longrope
    without the original length, ``max_position_embeddings`` 131072 (longrope factor 32)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.pop("rope_parameters", None)
    config.update(max_position_embeddings=131072, original_max_position_embeddings=4096, rope_theta=10000.0,
                  partial_rotary_factor=0.75, rope_scaling={k if k != "rope_type" else "type": v
                                                            for k, v in LONGROPE.items()})
    path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name: (HF folder, {seq: transformers' logits}) for every case, saved once."""
    root = tmp_path_factory.mktemp("features")
    out = {}
    for name, (cls, settings, _, _) in CASES.items():
        folder = root / name
        tiny_transformers_model(transformers, cls, **settings).save_pretrained(folder)
        if name.endswith("released_spelling"):
            released_spelling(folder)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()  # as a user loads it
        with torch.no_grad():
            out[name] = folder, {seq: model(input_ids=ids(seq), use_cache=False).logits for seq in SEQS}
    return out


def ids(seq: int) -> torch.Tensor:
    return torch.randint(0, 1003, (2, seq), generator=torch.Generator().manual_seed(1))


def verifier_logits(folder, seq: int, **changes) -> torch.Tensor:
    """The verifier's TP 1 logits on an HF folder (its decoder config changed by ``changes``)."""
    weights = cast_weights(load_hf_rank(str(folder), 0, 1, Options()), torch.float32, "cpu")
    weights.config = dataclasses.replace(weights.config, **changes)
    with torch.no_grad():
        return forward(weights, ids(seq), TPGroup()).logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp1_decoder_equals_transformers(models, case):
    folder, expected = models[case]
    for seq in SEQS:
        err = (verifier_logits(folder, seq) - expected[seq]).abs().max().item()
        assert err <= ATOL, f"{case} at {seq} tokens: max |logit error| {err:.3g}"
    control = CASES[case][3]
    err = (verifier_logits(folder, SEQS[-1], **control) - expected[SEQS[-1]]).abs().max().item()
    assert err > 1e-3, f"{case}: the decoder without the feature ({control}) also matches: the case tests nothing"


@pytest.mark.parametrize("case,to", [(case, to) for case in sorted(CASES) for to in CASES[case][2]])
def test_tp2_conversions_verify_equal(models, case, to, tmp_path):
    folder = models[case][0]
    reshard.convert(str(folder), str(tmp_path / to), to=to, tp=2)
    r = verify_forward(str(folder), str(tmp_path / to), nproc=2, seq_len=SEQS[-1])
    assert (r["b"]["layout"], r["b"]["tp"]) == (to, 2)
    assert r["ok"], r["problems"]
    assert r["max_abs"] <= ATOL and r["argmax_agreement"] == 1.0 and r["first_divergence"] is None


def test_perturbed_pass_through_dim_fails(models, tmp_path):
    """Rank 1 of a vllm tp2 Phi-4-mini holds KV head 1; its layer-0 key row for head dim 7 (past the 6 rotated
    dims of 8) scaled: the check fails at layer 0's attention."""
    folder = models["phi4_mini_longrope"][0]
    out = tmp_path / "v"
    reshard.convert(str(folder), str(out), to="vllm", tp=2)
    path = out / "model-rank-1-part-0.safetensors"
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    qkv = tensors["model.layers.0.self_attn.qkv_proj.weight"]  # rank 1: [4 q heads; 1 k head; 1 v head] x 8 rows
    qkv[4 * 8 + 7] *= 3.0
    save_file(tensors, str(path), metadata=metadata)
    r = verify_forward(str(folder), str(out), nproc=2)
    assert not r["ok"] and r["first_divergence"].startswith("layer 0 attention"), r["first_divergence"]


BASE = ModelConfig(architecture="LlamaForCausalLM", hidden=64, layers=2, heads=8, kv_heads=2, head_dim=8, ffn=96,
                   vocab=1003, max_positions=128)


@pytest.mark.parametrize("changes,named", [
    (dict(rope_interleaved=True, rotary_fraction=0.5), "interleaved RoPE on part of each head"),  # (whole: Ernie 4.5)
    (dict(residual_post_norm=True), "the residual taken after the norm"),  # Megatron-only setting
    (dict(rope_scaling=(("factor", 2.0), ("rope_type", "proportional"))), "rope_scaling type 'proportional'"),
    (dict(rotary_fraction=0.625), "a rotary dim of 5"),
    (dict(rope_scaling=(("long_factor", (1.0,)), ("rope_type", "longrope"), ("short_factor", (1.0,) * 4))),
     "longrope RoPE lacking long_factor (4 numbers"),
    (dict(max_positions=None, rope_scaling=(("factor", 2.0), ("rope_type", "dynamic"))),
     "dynamic RoPE lacking max_position_embeddings"),
    (dict(activation="gelu_fast"), "activation 'gelu_fast'"),
])
def test_remaining_refusals_name_the_feature(changes, named):
    with pytest.raises(ReshardError, match="^the forward verifier does not implement .*digest check") as err:
        DecoderConfig.from_meaning(BASE.replace(**changes))
    assert named in str(err.value)
