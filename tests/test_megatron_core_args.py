"""Acceptance test: megatron-core's own GPTModel, built from the Megatron-LM ``args`` reshard writes, reproduces
transformers' logits from reshard's rank files.

Each case builds a tiny transformers model, converts it with ``reshard.convert(..., to="megatron", tp=2,
megatron_spec="local")`` and runs ``tests/mcore_args_harness.py`` in a subprocess: two gloo ranks on the CPU that
read their own rank file (``torch.load(weights_only=True)``), build ``TransformerConfig``/``GPTModel`` from the
args *only* (as Megatron-LM's ``core_transformer_config_from_args`` does) and load the weights with
``strict=True``.  The logits must equal transformers' fp32 logits within 1e-5.  So the settings beyond the dims
are exercised end to end: Llama 3 RoPE scaling (``use_rope_scaling``/``rope_scaling_factor``), Mistral's sliding
window (``window_size``) and biases (``add_bias_linear``/``add_qkv_bias``); and what args cannot spell is refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'reshard[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

import reshard  # noqa: E402
from _mcore_helpers import run_isolated  # noqa: E402
from helpers import tiny_transformers_model  # noqa: E402
from reshard.errors import PlanError  # noqa: E402

HARNESS = Path(__file__).with_name("mcore_args_harness.py")
ATOL = 1e-5
SEQ = 24
BATCH = 2
VOCAB = 1003

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def tiny_model(config_cls: str, **settings):
    """``helpers.tiny_transformers_model`` (hidden 64, 2 layers, 8 heads, vocab 1003, seeded noise on every
    parameter); sizes may be overridden (Llama 3 scaling wants max_position_embeddings above 8192)."""
    return tiny_transformers_model(transformers, config_cls, **settings)


def random_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def run_harness(ckpt: Path, ids: torch.Tensor, tmp: Path, *extra: str, timeout: float = 300.0) -> dict:
    """Run the harness (2 ranks) on ``ckpt``; its output dict (``logits``, ``args``)."""
    ids_path, out_path = tmp / "ids.pt", tmp / "mcore_logits.pt"
    torch.save(ids, ids_path)
    run_isolated([sys.executable, HARNESS, ckpt, ids_path, out_path, "--nproc-per-node", "2", *extra], timeout)
    return torch.load(out_path, map_location="cpu", weights_only=True)


def convert_and_compare(model, ids: torch.Tensor, tmp_path: Path) -> dict:
    """save_pretrained -> reshard.convert (megatron, tp 2, local spec) -> harness; assert the logits agree."""
    hf_dir, meg_dir = tmp_path / "hf", tmp_path / "megatron"
    model.save_pretrained(hf_dir)
    reshard.convert(str(hf_dir), str(meg_dir), to="megatron", tp=2, megatron_spec="local")
    expected = hf_logits(model, ids)
    out = run_harness(meg_dir, ids, tmp_path)
    actual = out["logits"]
    assert actual.shape == expected.shape == (BATCH, SEQ, VOCAB), (actual.shape, expected.shape)
    err = (actual - expected).abs().max().item()
    assert err <= ATOL, f"megatron-core (built from reshard's args) vs transformers: max |logit diff| {err:.3g}"
    return out["args"]


def test_llama3_rope(tmp_path):
    model = tiny_model("LlamaConfig", num_key_value_heads=2, rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING),
                       max_position_embeddings=16384)
    ids = random_ids()
    # Teeth: the scaling (and its factor) must change transformers' logits by far more than the tolerance.
    expected = hf_logits(model, ids)
    for other in (dict(rope_scaling=None), dict(rope_scaling=dict(LLAMA3_SCALING, factor=4.0))):
        plain = tiny_model("LlamaConfig", num_key_value_heads=2, rope_theta=500000.0, max_position_embeddings=16384,
                           **other)
        gap = (expected - hf_logits(plain, ids)).abs().max().item()
        assert gap > 1e-4, f"{other}: llama3 scaling barely changes the logits ({gap:.3g}): toothless check"
    args = convert_and_compare(model, ids, tmp_path)
    assert args["use_rope_scaling"] is True and args["rope_scaling_factor"] == 8.0, args
    assert args["rotary_base"] == 500000, args


def test_llama3_rope_other_parameters_refused(tmp_path):
    """megatron-core fixes low/high/original at 1/4/8192: other values cannot be spelled in args."""
    scaling = dict(LLAMA3_SCALING, high_freq_factor=2.0)
    model = tiny_model("LlamaConfig", num_key_value_heads=2, rope_theta=500000.0, rope_scaling=scaling,
                       max_position_embeddings=16384)
    model.save_pretrained(tmp_path / "hf")
    with pytest.raises(PlanError, match="rope_scaling"):
        reshard.convert(str(tmp_path / "hf"), str(tmp_path / "megatron"), to="megatron", tp=2,
                        megatron_spec="local")
    assert not (tmp_path / "megatron").exists()


@pytest.mark.slow
def test_mistral_window(tmp_path):
    model = tiny_model("MistralConfig", num_key_value_heads=2, sliding_window=4, head_dim=8)
    ids = random_ids()
    # Teeth: 24 tokens against a window of 4, so the window changes transformers' logits.
    full = tiny_model("MistralConfig", num_key_value_heads=2, sliding_window=None, head_dim=8)
    gap = (hf_logits(model, ids) - hf_logits(full, ids)).abs().max().item()
    assert gap > 1e-3, f"the sliding window barely changes the logits ({gap:.3g}): the check would be toothless"
    args = convert_and_compare(model, ids, tmp_path)
    assert tuple(args["window_size"]) == (3, 0), args


def test_llama_attention_bias_only_refused(tmp_path):
    """q/k/v/o biases without MLP biases: add_bias_linear switches o and the MLP together, so args cannot say it."""
    model = tiny_model("LlamaConfig", num_key_value_heads=2, attention_bias=True, mlp_bias=False)
    model.save_pretrained(tmp_path / "hf")
    with pytest.raises(PlanError, match="o_bias"):
        reshard.convert(str(tmp_path / "hf"), str(tmp_path / "megatron"), to="megatron", tp=2,
                        megatron_spec="local")
    assert not (tmp_path / "megatron").exists()


@pytest.mark.slow
def test_llama_all_biases(tmp_path):
    model = tiny_model("LlamaConfig", num_key_value_heads=2, attention_bias=True, mlp_bias=True)
    args = convert_and_compare(model, random_ids(), tmp_path)
    assert args["add_bias_linear"] is True, args
