"""transformers loads every HF output with from_pretrained and reproduces the source model's logits."""

from __future__ import annotations

import pytest
import torch

import reshard
from helpers import tiny_transformers_model

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")

CASES = {
    "llama_gqa": ("LlamaConfig", dict(num_key_value_heads=2)),
    "llama_tied": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, head_dim=16)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2)),
}


def tiny_model(kind):
    cls_name, extra = CASES[kind]
    return tiny_transformers_model(transformers, cls_name, **extra)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_hf_output_reproduces_logits(kind, tmp_path):
    model = tiny_model(kind)
    model.save_pretrained(tmp_path / "src")
    reshard.convert(str(tmp_path / "src"), str(tmp_path / "m"), to="megatron", tp=2, pp=2)
    reshard.convert(str(tmp_path / "m"), str(tmp_path / "m2"), to="megatron", tp=1, pp=1)
    reshard.convert(str(tmp_path / "m2"), str(tmp_path / "hf"), to="hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(0, 1003, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
        got = loaded(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert loaded.config.tie_word_embeddings == model.config.tie_word_embeddings
