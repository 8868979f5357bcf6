"""Acceptance test against a reference nobody here wrote: megatron-core's own GPTModel.

A checkpoint whose tensors come from megatron-core's GPTModel (gloo on CPU, TP=2, GQA, SwiGLU, RMSNorm, RoPE,
padded vocab) converts to Hugging Face, and transformers' logits equal megatron-core's (fp32, atol 1e-5).

The harness (``tests/megatron_core_harness.py``) runs once per module in a subprocess, well under a minute on
two CPU cores.  Before reshard is trusted, ``test_harness_matches_transformers_by_hand`` converts the same shards
by hand (``tests/_mcore_helpers.py``) and shows transformers reproduces megatron-core's logits, and
``test_tolerance_catches_layout_bugs`` shows the 1e-5 tolerance rejects the classic layout mistakes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'reshard[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

sys.path.insert(0, str(Path(__file__).parent))
from _mcore_helpers import hand_convert, hf_logits, llama_config, load_rank_state_dicts, run_harness  # noqa: E402

ATOL = 1e-5

EXPECTED_LAYER_KEYS = [
    "input_layernorm.weight",
    "self_attention.linear_proj.weight",
    "self_attention.linear_proj._extra_state",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv._extra_state",
    "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1._extra_state",
    "mlp.linear_fc2.weight",
    "mlp.linear_fc2._extra_state",
]


def _dtype_kwarg() -> str:
    """transformers >= 4.56 takes ``dtype=`` (``torch_dtype=`` is deprecated in 5.x)."""
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _load_hf(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), **{_dtype_kwarg(): torch.float32})
    model.eval()
    return model


def _assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = (actual - expected).abs().max().item()
    torch.testing.assert_close(
        actual, expected, atol=ATOL, rtol=0, msg=lambda m: f"max |logit error| {err:.3g} > {ATOL}\n{m}"
    )


@pytest.fixture(scope="module")
def mcore_ckpt(tmp_path_factory):
    """Run the harness once: a TP=2 Megatron-LM ``torch`` checkpoint plus megatron-core's reference logits."""
    out = tmp_path_factory.mktemp("mcore") / "megatron"
    meta = run_harness(out, nproc=2, timeout=300)
    ref = torch.load(out / "reference.pt", map_location="cpu", weights_only=True)
    return out, meta, ref


@pytest.fixture(scope="module")
def mcore_shards(mcore_ckpt):
    out, _, _ = mcore_ckpt
    return load_rank_state_dicts(out)


@pytest.fixture(scope="module")
def converted_hf(mcore_ckpt, tmp_path_factory):
    import reshard

    src, _, _ = mcore_ckpt
    dst = tmp_path_factory.mktemp("mcore_hf") / "hf"
    reshard.convert(str(src), str(dst), to="hf")
    return dst


# ---------------------------------------------------------------------------------------------------------
# The harness itself (independent of reshard)
# ---------------------------------------------------------------------------------------------------------


def test_checkpoint_layout(mcore_ckpt, mcore_shards):
    out, meta, ref = mcore_ckpt
    sds, args = mcore_shards
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert sorted(p.name for p in (out / "iter_0000001").iterdir()) == ["mp_rank_00", "mp_rank_01"]

    blob = torch.load(out / "iter_0000001/mp_rank_00/model_optim_rng.pt", map_location="cpu", weights_only=False)
    assert blob["checkpoint_version"] == 3.0 and blob["iteration"] == 1
    assert isinstance(blob["args"], argparse.Namespace)

    assert args.tensor_model_parallel_size == 2 and args.pipeline_model_parallel_size == 1
    assert (args.vocab_size, args.padded_vocab_size, args.make_vocab_size_divisible_by) == (1000, 1024, 128)
    assert args.group_query_attention and args.swiglu and args.untie_embeddings_and_output_weights
    assert args.normalization == "RMSNorm" and args.position_embedding_type == "rope"
    assert args.params_dtype == torch.float32 and not args.bf16 and not args.fp16

    expected = ["embedding.word_embeddings.weight"]
    for i in range(args.num_layers):
        expected += [f"decoder.layers.{i}.{k}" for k in EXPECTED_LAYER_KEYS]
    expected += ["decoder.final_layernorm.weight", "output_layer.weight", "output_layer._extra_state"]
    nh, ng, d, H, F = (
        args.num_attention_heads, args.num_query_groups, args.kv_channels, args.hidden_size, args.ffn_hidden_size
    )
    for sd in sds:
        assert list(sd.keys()) == expected
        assert all(sd[k] is None for k in sd if k.endswith("_extra_state"))  # local spec: no TE metadata
        assert sd["embedding.word_embeddings.weight"].shape == (1024 // 2, H)
        assert sd["output_layer.weight"].shape == (1024 // 2, H)
        assert sd["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((nh + 2 * ng) * d // 2, H)
        assert sd["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * F // 2, H)
        assert sd["decoder.layers.0.mlp.linear_fc2.weight"].shape == (H, F // 2)
        assert sd["decoder.layers.0.self_attention.linear_proj.weight"].shape == (H, nh * d // 2)
    # Norms are replicated and carry seeded noise (not the default ones), identical on both ranks.
    for k in sds[0]:
        if k.endswith("layernorm.weight"):
            assert torch.equal(sds[0][k], sds[1][k]), k
            assert not torch.allclose(sds[0][k], torch.ones_like(sds[0][k])), k
    # Embedding padding rows (1000..1023 live on rank 1 at rows 488..511) are zero.
    assert not sds[1]["embedding.word_embeddings.weight"][488:].any()

    assert ref["input_ids"].shape == (2, 16) and ref["input_ids"].max() < 1000
    assert ref["logits"].shape == (2, 16, 1000) and ref["logits"].dtype == torch.float32
    assert meta["state_dict_keys"] == expected


def test_harness_matches_transformers_by_hand(mcore_ckpt, mcore_shards):
    """Hand conversion -> LlamaForCausalLM reproduces megatron-core: the harness settings agree with HF."""
    from transformers import LlamaForCausalLM

    _, _, ref = mcore_ckpt
    sds, args = mcore_shards
    model = LlamaForCausalLM(llama_config(args)).float()
    model.load_state_dict(hand_convert(sds, args), strict=True)
    _assert_logits_close(hf_logits(model, ref["input_ids"]), ref["logits"])


@pytest.mark.parametrize("bug", ["swap_kv", "swap_gate_up", "interleave_qk", "concat_fc1"])
def test_tolerance_catches_layout_bugs(mcore_ckpt, mcore_shards, bug):
    """Known-wrong conversions miss the reference by far more than the tolerance (so 1e-5 means something)."""
    from transformers import LlamaForCausalLM

    _, _, ref = mcore_ckpt
    sds, args = mcore_shards
    model = LlamaForCausalLM(llama_config(args)).float()
    model.load_state_dict(hand_convert(sds, args, **{bug: True}), strict=True)
    err = (hf_logits(model, ref["input_ids"]) - ref["logits"]).abs().max().item()
    assert err > 1e-2, f"{bug}: error {err:.3g} is too small for the test to tell it from a correct conversion"


# ---------------------------------------------------------------------------------------------------------
# reshard
# ---------------------------------------------------------------------------------------------------------


def test_convert_megatron_core_to_hf_matches_logits(mcore_ckpt, converted_hf):
    """Acceptance: megatron-core TP=2 checkpoint -> reshard -> transformers gives megatron-core's logits."""
    _, meta, ref = mcore_ckpt
    model = _load_hf(converted_hf)
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert cfg.hidden_size == meta["hidden_size"]
    assert cfg.intermediate_size == meta["ffn_hidden_size"]
    assert cfg.num_hidden_layers == meta["num_layers"]
    assert cfg.num_attention_heads == meta["num_attention_heads"]
    assert cfg.num_key_value_heads == meta["num_query_groups"]
    assert getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads) == meta["kv_channels"]
    assert cfg.vocab_size == meta["vocab_size"] == 1000  # true vocab, Megatron's padding dropped
    assert not cfg.tie_word_embeddings
    assert cfg.rms_norm_eps == pytest.approx(meta["norm_epsilon"])
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
    assert theta == pytest.approx(meta["rotary_base"])
    assert model.get_input_embeddings().weight.shape == (1000, meta["hidden_size"])
    assert model.get_output_embeddings().weight.shape == (1000, meta["hidden_size"])

    _assert_logits_close(hf_logits(model, ref["input_ids"]), ref["logits"])


def test_convert_megatron_core_to_hf_is_bit_exact(mcore_shards, converted_hf):
    """fp32 -> fp32 conversion is pure data movement: every HF tensor equals the hand conversion bit for bit."""
    from safetensors.torch import load_file

    sds, args = mcore_shards
    expected = hand_convert(sds, args)
    got: dict[str, torch.Tensor] = {}
    for f in sorted(Path(converted_hf).glob("*.safetensors")):
        got.update(load_file(str(f)))
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert got[name].dtype == torch.float32, name
        assert got[name].shape == t.shape, (name, got[name].shape, t.shape)
        assert torch.equal(got[name], t), name


# ---------------------------------------------------------------------------------------------------------
# Forward verification (reshard verify --forward) on megatron-core's own checkpoint
# ---------------------------------------------------------------------------------------------------------


def test_reference_decoder_reproduces_megatron_core_logits(mcore_ckpt, converted_hf):
    """The forward verifier's decoder (TP=1 on the HF conversion) gives megatron-core's own logits."""
    from reshard.layouts.base import Options
    from reshard.verification.forward.decoder import TPGroup, cast_weights, forward
    from reshard.verification.forward.sliced_rank import load_rank

    _, _, ref = mcore_ckpt
    weights = cast_weights(load_rank(str(converted_hf), 0, 1, Options()), torch.float32, "cpu")
    with torch.no_grad():
        logits = forward(weights, ref["input_ids"], TPGroup()).logits
    _assert_logits_close(logits, ref["logits"])


def test_forward_verify_megatron_core_tp2_against_its_hf_conversion(mcore_ckpt, converted_hf, capsys):
    """``verify --forward`` runs megatron-core's TP=2 rank files on 2 processes (each reading its own
    mp_rank_0r file) and the HF conversion at TP=1 (sharing the same 2-process world): equal logits, exit 0."""
    import json

    from helpers import run_cli

    src, _, _ = mcore_ckpt
    code, out, err = run_cli(capsys, "verify", "--forward", src, converted_hf, "--json")
    assert code == 0, err
    r = json.loads(out)
    assert (r["a"]["layout"], r["a"]["tp"], r["a"]["padded_vocab"]) == ("megatron", 2, 1024)
    assert r["a"]["rank0_files"] == ["iter_0000001/mp_rank_00/model_optim_rng.pt"]
    assert r["ok"] and r["max_abs"] <= ATOL and r["argmax_agreement"] == 1.0
    # megatron-core initialises its output layer's padding rows: reported for the reference A, not failed
    assert r["padding_max_abs_a"] > 0 and "lm_head padding rows 1000..1023" in r["notes"][0]
    assert r["padding_max_abs_b"] == 0.0
