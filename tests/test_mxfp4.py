"""MXFP4 expert tensors as gpt-oss is released (reshard/io/mxfp4.py; shared/layouts/families-2.md section 2.2).

  - the rule equals transformers' ``convert_moe_packed_tensors`` bit for bit (bf16 and fp32), for every FP4 code and
    every E8M0 scale (0 .. 255, the NaN / inf ends included), in the Hugging Face form ``[E, C, R]``;
  - :class:`Mxfp4File` reads a released-layout safetensors file per expert, any slice, the other tensors unchanged;
  - a tiny transformers gpt-oss quantised in the released layout: the reader equals
    ``from_pretrained(..., Mxfp4Config(dequantize=True))``'s expert tensors bit for bit;
  - a missing partner, a wrong block shape or dtype, blocks without the config or the config without blocks: one
    line (CheckpointError).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from reshard.errors import CheckpointError
from reshard.io import mxfp4
from reshard.io.safetensors_format import SafetensorsFile

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")
convert = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors

CONFIG = {"quantization_config": {"quant_method": "mxfp4"}}
LUT = torch.tensor(mxfp4.LUT)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (NaN == NaN, -0 != +0)."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def packed(e: int, r: int, c: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (e, r, c // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 136, (e, r, c // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def quantize(w):
    """[.., R, C] float -> (blocks, scales) in the released layout (the probe's mxfp4.py)."""
    *pre, r, c = w.shape
    x = w.float().reshape(*pre, r, c // 32, 32)
    amax = x.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -126)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    codes = (x / torch.exp2(e)).unsqueeze(-1).sub(LUT).abs().argmin(-1).to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), (e.squeeze(-1) + 127).to(torch.uint8)


@pytest.mark.parametrize("top", [255, 254])  # 255 takes torch.ldexp's path; below it, one multiply per value
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rule_equals_transformers_for_every_code_and_scale(dtype, top):
    blocks = torch.arange(256, dtype=torch.uint8).repeat(2 * 16).reshape(2, 16, 16, 16)  # every byte, 2 experts
    scales = torch.arange(256, dtype=torch.int32).clamp_max(top).reshape(2, 16, 8).repeat_interleave(2, dim=2)
    scales = scales.to(torch.uint8)
    mine = mxfp4.hf_form(blocks, scales, dtype)
    theirs = convert(blocks, scales, dtype=dtype)
    assert mine.shape == theirs.shape == (2, 512, 16)
    assert torch.equal(bits(mine), bits(theirs))


def test_low_nibble_first_and_the_scale_exponent():
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x72  # low 2 -> +1.0, high 7 -> +6.0
    blocks[0, 0, 0, 1] = 0x9F  # low 15 -> -6.0, high 9 -> -0.5
    out = mxfp4.dequantize(blocks, torch.full((1, 1, 1), 128, dtype=torch.uint8), torch.float32)
    assert out.shape == (1, 1, 32)
    assert out[0, 0, :4].tolist() == [2.0, 12.0, -12.0, -1.0]


def test_chunked_dequantisation_equals_one_pass(monkeypatch):
    blocks, scales = packed(3, 40, 96)
    whole = mxfp4.hf_form(blocks, scales)
    monkeypatch.setattr(mxfp4, "CHUNK_ELEMENTS", 200)
    assert torch.equal(bits(mxfp4.hf_form(blocks, scales)), bits(whole))
    assert torch.equal(bits(whole), bits(convert(blocks, scales, dtype=torch.bfloat16)))


def write_release(path, tensors: dict) -> list[SafetensorsFile]:
    save_file(tensors, str(path), metadata={"format": "pt"})
    return [SafetensorsFile(str(path))]


def test_file_reads_each_expert_and_slice(tmp_path):
    gu_b, gu_s = packed(4, 2 * 64, 32, seed=1)  # gate_up: R = 2I = 128, C = H = 32
    dn_b, dn_s = packed(4, 32, 64, seed=2)      # down: R = H = 32, C = I = 64
    bias = torch.randn(4, 128).to(torch.bfloat16)
    base = "model.layers.0.mlp.experts."
    files = write_release(tmp_path / "model.safetensors", {
        base + "gate_up_proj_blocks": gu_b, base + "gate_up_proj_scales": gu_s, base + "gate_up_proj_bias": bias,
        base + "down_proj_blocks": dn_b, base + "down_proj_scales": dn_s})
    view = mxfp4.find_mxfp4("src", CONFIG, files)
    assert set(view.weights) == {base + "gate_up_proj", base + "down_proj"}
    assert view.weights[base + "gate_up_proj"].shape == (4, 32, 128)
    assert view.stored == {base + n for n in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks",
                                              "down_proj_scales")}
    f = mxfp4.wrap(files, view)[0]
    assert f.tensors[base + "down_proj"].shape == (4, 64, 32) and f.tensors[base + "down_proj"].dtype == "BF16"
    for name, b, s in (("gate_up_proj", gu_b, gu_s), ("down_proj", dn_b, dn_s)):
        want = convert(b, s, dtype=torch.bfloat16)
        assert torch.equal(bits(f.read(base + name)), bits(want))
        assert torch.equal(bits(f.read(base + name, 0, 1, 2)), bits(want[1:3]))
        assert torch.equal(bits(f.read(base + name, 1, 8, 16, rows=(2, 4))), bits(want[2:4, 8:24]))
        for e in range(4):
            assert torch.equal(bits(f.read_block(base + name, e)), bits(want[e]))
        assert torch.equal(bits(f.read_block(base + name, 3, 1, 4, 8, rows=(1, 9))), bits(want[3, 1:9, 4:12]))
    assert torch.equal(f.read(base + "gate_up_proj_bias"), bias)
    assert "dequantised exactly" in mxfp4.note(view, "bfloat16")


def test_a_tiny_gpt_oss_release_equals_transformers_dequantisation(tmp_path):
    cfg = transformers.GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, vocab_size=128, num_local_experts=4,
                                    num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).eval()
    src = tmp_path / "gpt_oss"
    model.save_pretrained(src)
    state = {}
    from safetensors.torch import load_file
    for p in src.glob("*.safetensors"):
        state.update(load_file(str(p)))
        p.unlink()
    released = {}
    for k, v in state.items():
        if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            released[k + "_blocks"], released[k + "_scales"] = quantize(v.transpose(1, 2))
        else:
            released[k] = v.to(torch.bfloat16) if ".experts." in k else v
    save_file(released, str(src / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (src / "config.json").write_text(json.dumps(config))
    files = [SafetensorsFile(str(src / "model.safetensors"))]
    f = mxfp4.wrap(files, mxfp4.find_mxfp4(str(src), config, files))[0]
    loaded = transformers.GptOssForCausalLM.from_pretrained(
        str(src), quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.bfloat16).state_dict()
    names = [k for k in loaded if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(names) == 4
    for k in names:
        assert torch.equal(bits(f.read(k)), bits(loaded[k])), k


def refusal(tmp_path, tensors: dict, config=CONFIG) -> str:
    files = write_release(tmp_path / "m.safetensors", tensors)
    with pytest.raises(CheckpointError) as err:
        mxfp4.find_mxfp4("src", config, files)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_refusals_are_one_line(tmp_path):
    b, s = packed(2, 8, 64)
    assert "has no 'x_scales'" in refusal(tmp_path, {"x_blocks": b})
    assert "has no 'x_blocks'" in refusal(tmp_path, {"x_scales": s})
    assert "not [E, R, C/32, 16]" in refusal(tmp_path, {"x_blocks": b.reshape(2, 8, 4, 8), "x_scales": s})
    assert "needs [2, 8, 2]" in refusal(tmp_path, {"x_blocks": b, "x_scales": s[:, :, :1].contiguous()})
    assert "not U8" in refusal(tmp_path, {"x_blocks": b.to(torch.int16), "x_scales": s})
    assert "stored both whole" in refusal(tmp_path, {"x_blocks": b, "x_scales": s, "x": torch.zeros(2)})
    assert "no quantization_config" in refusal(tmp_path, {"x_blocks": b, "x_scales": s}, {})
    assert "dequantised already" in refusal(tmp_path, {"x": torch.zeros(2)})
    files = write_release(tmp_path / "plain.safetensors", {"x": torch.zeros(2)})
    assert mxfp4.find_mxfp4("src", {}, files) is None
