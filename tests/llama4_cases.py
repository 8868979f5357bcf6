"""The tiny Llama 4 text models of the Llama 4 tests (probes/families-2/hf_tiny.py's llama4 / llama4_short cases):
transformers' own Llama4ForCausalLM built from a Llama4TextConfig with seed 0, seeded noise on every 1-D parameter
(so a misplaced norm shows). ACTIVE: chunk 8 and floor_scale 4, both acting at 16 tokens; SHORT: 8192, what
megatron-core computes the same."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[1, 17, 254, 33, 400, 7, 99, 300, 12, 5, 200, 42, 77, 8, 150, 3]])
COMMON = {"vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "max_position_embeddings": 256, "tie_word_embeddings": False, "intermediate_size": 48,
          "intermediate_size_mlp": 96, "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 1,
          "interleave_moe_layer_step": 2, "no_rope_layer_interval": 4, "use_qk_norm": True, "attn_scale": 0.1,
          "attn_temperature_tuning": True}
ACTIVE = dict(COMMON, attention_chunk_size=8, floor_scale=4)         # chunking and temperature act at 16 tokens
SHORT = dict(COMMON, attention_chunk_size=8192, floor_scale=8192)    # what megatron-core computes the same

def tiny(kw):
    torch.manual_seed(0)
    cfg = transformers.Llama4TextConfig(**kw)
    model = transformers.Llama4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


@pytest.fixture(scope="module")
def active():
    return tiny(ACTIVE)


@pytest.fixture(scope="module")
def short():
    return tiny(SHORT)


def config_dict(model) -> dict:
    return model.config.to_dict()

