"""maxtext layout, the families without a MaxText-made fixture here (maxtext-orbax.md sections 3.4-3.5, 4): tiny
transformers models written with ``--to maxtext`` have the spec's leaf names and shapes (Gemma 3's six sub-blocks
plus an unscanned remainder, DeepSeek-V3's dense and MoE stacks with experts [E, L, ...], Gemma 1), leaf values
recomputed here from the HF tensors by the section-4 rules, and read back bit for bit; Gemma's float32 leaves."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from test_maxtext_build import P, np_of

import reshard

pytestmark = pytest.mark.slow


def hf_state(folder) -> dict:
    from safetensors.torch import load_file

    out = {}
    for n in sorted(os.listdir(folder)):
        if n.endswith(".safetensors"):
            out.update({k: np_of(v) for k, v in load_file(os.path.join(folder, n)).items()})
    return out


def leaves(folder) -> dict:
    from reshard.io.orbax_store import Item

    item = Item(os.path.join(folder, "0", "items"))
    return {n: item.read(n) for n in item.paths}


def round_trip(src, tmp_path, scan: bool, **kw):
    out = tmp_path / f"mt-{scan}"
    reshard.convert(str(src), str(out), to="maxtext", scan_layers=scan, **kw)
    back = tmp_path / f"back-{scan}"
    result = reshard.convert(str(out), str(back), to="hf")
    return leaves(out), hf_state(back), result


def save_gemma(folder, arch: str, dtype=torch.bfloat16, layers=7, seed=0):
    import transformers

    kw = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, vocab_size=128, max_position_embeddings=64)
    if arch == "gemma3":
        cfg = transformers.Gemma3TextConfig(**kw, sliding_window=8, query_pre_attn_scalar=32)
        model = transformers.Gemma3ForCausalLM(cfg)
    elif arch == "gemma2":
        cfg = transformers.Gemma2Config(**kw, sliding_window=8, query_pre_attn_scalar=32)
        model = transformers.Gemma2ForCausalLM(cfg)
    else:
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**kw))
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    model.to(dtype).save_pretrained(folder)
    return model


def test_gemma3_pattern_and_remainder(tmp_path):
    """Gemma 3 (7 layers): scanned = layers.layers_<j> over one block of 6 plus layers_remainder.layers_0;
    norms 1 + w and embedding * bfloat16(sqrt(H)) as float32 leaves; read back bit for bit."""
    save_gemma(tmp_path / "hf", "gemma3")
    sd = hf_state(tmp_path / "hf")
    got, back, _ = round_trip(tmp_path / "hf", tmp_path, True)
    q = P + "decoder.layers.layers_3.self_attention.query.kernel"
    assert got[q].shape == (48, 1, 4, 32)  # no query pre-scale: the HF q kernel transposed
    want = np.ascontiguousarray(sd["model.layers.3.self_attn.q_proj.weight"].T.reshape(48, 4, 32))
    assert got[q][:, 0].tobytes() == want.tobytes()
    rem = P + "decoder.layers_remainder.layers_0.post_ffw_norm.scale"
    assert got[rem].dtype == np.float32
    assert np.array_equal(got[rem], sd["model.layers.6.post_feedforward_layernorm.weight"].astype(np.float32) + 1)
    emb = got[P + "token_embedder.embedding"]
    c = np.float32(torch.tensor(48 ** 0.5).to(torch.bfloat16).float().item())  # bf16(sqrt(48)) = 6.9375
    assert emb.dtype == np.float32 and np.array_equal(emb, sd["model.embed_tokens.weight"].astype(np.float32) * c)
    assert set(back) == set(sd) and all(back[k].tobytes() == sd[k].tobytes() for k in sd)
    got, back, _ = round_trip(tmp_path / "hf", tmp_path, False)
    assert P + "decoder.layers_6.mlp.wo.kernel" in got
    assert all(back[k].tobytes() == sd[k].tobytes() for k in sd)


def test_gemma1_names_and_round_trip(tmp_path):
    save_gemma(tmp_path / "hf", "gemma", layers=2)
    sd = hf_state(tmp_path / "hf")
    got, back, _ = round_trip(tmp_path / "hf", tmp_path, True)
    assert got[P + "decoder.layers.pre_ffw_norm.scale"].shape == (48, 2)
    q = got[P + "decoder.layers.self_attention.query.kernel"][:, 1]
    want = (sd["model.layers.1.self_attn.q_proj.weight"].astype(np.float32).T.reshape(48, 4, 32)
            * np.float32(1 / np.sqrt(32)))
    assert q.dtype == np.float32 and np.array_equal(q, want)  # 1/sqrt(32) is inexact in bf16: a float32 leaf
    assert all(back[k].tobytes() == sd[k].tobytes() for k in sd)


def test_gemma2_float32_leaves_round_trip_bit_exact(tmp_path):
    """Gemma 2's lossy constants written as float32 leaves (spec 7.5): HF -> MaxText -> HF is bit-exact (MaxText's
    own bf16 conversion moves a tiny Gemma 2's logits by 1%); --maxtext-match-converter writes them bf16 as MaxText
    does."""
    save_gemma(tmp_path / "hf", "gemma2", layers=4)
    sd = hf_state(tmp_path / "hf")
    got, back, _ = round_trip(tmp_path / "hf", tmp_path, True)
    assert got[P + "decoder.layers.pre_ffw_norm_global.scale"].shape == (48, 2)
    assert got[P + "decoder.layers.pre_ffw_norm_local.scale"].dtype == np.float32
    assert all(back[k].tobytes() == sd[k].tobytes() for k in sd)
    reshard.convert(str(tmp_path / "hf"), str(tmp_path / "m"), to="maxtext", maxtext_match_converter=True)
    assert leaves(tmp_path / "m")[P + "decoder.layers.pre_ffw_norm_local.scale"].dtype.name == "bfloat16"


def test_deepseek_v3_dense_and_moe_stacks(tmp_path):
    """DeepSeek-V3: dense_layers (first_k_dense_replace) and moe_layers stacks, experts [E, L, in, out], MLA
    up-projections [r, nh, per-head], router bias [E, L] kept float32; the MTP layer dropped with a note; read back
    bit for bit (fp32)."""
    from deepseek_checkpoints import save_tiny

    save_tiny(str(tmp_path / "hf"), "v3", mtp=True)
    sd = hf_state(tmp_path / "hf")
    out = tmp_path / "mt"
    result = reshard.convert(str(tmp_path / "hf"), str(out), to="maxtext")
    assert any("MTP" in n for n in result.notes)
    got = leaves(out)
    moe = P + "decoder.moe_layers."
    assert got[P + "decoder.dense_layers.mlp.wi_0.kernel"].shape == (64, 1, 48)
    wi0 = got[moe + "DeepSeekMoeBlock_0.MoeBlock_0.wi_0"]
    assert wi0.shape == (8, 3, 64, 16)
    assert np.array_equal(wi0[5, 1], sd["model.layers.2.mlp.experts.5.gate_proj.weight"].T)
    wq_b = got[moe + "self_attention.wq_b.kernel"]
    assert wq_b.shape == (24, 3, 4, 12)
    assert np.array_equal(wq_b[:, 2], sd["model.layers.3.self_attn.q_b_proj.weight"].T.reshape(24, 4, 12))
    bias = got[moe + "DeepSeekMoeBlock_0.MoeBlock_0.gate.bias"]
    assert bias.shape == (8, 3) and bias.dtype == np.float32
    back = tmp_path / "back"
    reshard.convert(str(out), str(back), to="hf")
    b = hf_state(back)
    main = {k: v for k, v in sd.items() if not k.startswith("model.layers.4.")}
    assert set(b) == set(main) and all(b[k].tobytes() == main[k].tobytes() for k in main)
    reshard.convert(str(tmp_path / "hf"), str(tmp_path / "u"), to="maxtext", scan_layers=False)
    u = leaves(tmp_path / "u")
    assert u[P + "decoder.moe_layers_2.DeepSeekMoeBlock_0.MoeBlock_0.wo"].shape == (8, 16, 64)
    assert P + "decoder.dense_layers_0.mlp.wo.kernel" in u
