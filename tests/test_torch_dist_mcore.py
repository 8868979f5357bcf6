"""torch_dist checkpoints saved by megatron-core itself (dist_checkpointing.save over gloo, as Megatron-LM's
training loop saves them) convert to HF, and transformers computes megatron-core's logits."""

from __future__ import annotations

import json

import pytest
import torch

import reshard
from test_mcore_dist_fixtures import mcore_dist_checkpoint

transformers = pytest.importorskip("transformers")

CONFIGS = {"tp2_qkv_bias": dict(tp=2, pp=1, qkv_bias=True), "tp1_pp2_tied": dict(tp=1, pp=2, tied=True)}


@pytest.mark.parametrize("name", ["tp2_qkv_bias", pytest.param("tp1_pp2_tied", marks=pytest.mark.slow)])
def test_megatron_core_torch_dist_to_hf_logits(name, tmp_path_factory):
    folder = mcore_dist_checkpoint(tmp_path_factory, **CONFIGS[name])
    out = tmp_path_factory.mktemp(f"hf-{name}")
    result = reshard.convert(str(folder), str(out / "hf"), to="hf")
    assert any("rng_state" in n for n in result.notes) and any("_extra_state" in n for n in result.notes)
    config = json.load(open(out / "hf" / "config.json"))
    assert config["tie_word_embeddings"] is CONFIGS[name].get("tied", False)
    reference = torch.load(folder / "reference.pt", weights_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "hf").float().eval()
    with torch.no_grad():
        logits = model(input_ids=reference["input_ids"], use_cache=False).logits
    expected = reference["logits"]
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() <= 1e-5
    # and to every other layout, bit-exact against the HF conversion
    reshard.convert(str(folder), str(out / "m"), to="megatron", tp=2, pp=2)
    reshard.convert(str(folder), str(out / "v"), to="vllm", tp=2)
    assert reshard.verify(str(out / "hf"), str(out / "m")).equal and reshard.verify(str(out / "hf"), str(out / "v")).equal
