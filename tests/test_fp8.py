"""Block-FP8 Hugging Face sources (DeepSeek-V3 / R1 / Kimi-K2 releases), read dequantised.

Sources are quantised here from position-coded bf16 weights (tests/fp8_checkpoints.py, no reshard code), with
rows and columns that are not multiples of 128. Every converted tensor must equal, bit for bit, the test's own
dequantisation (fp32 product of each fp8 value and its block's scale, then bf16), in an HF output and in every
rank file of Megatron and vLLM TP 2 outputs (their per-rank slices written out in megatron_rules.py and
vllm_rules.py). ``--keep-fp8`` re-shards the fp8 bytes and scales unchanged. Every malformed or other quantized
form is one line, exit 2, nothing written. Reads stay bounded: a large FP8 tensor is dequantised band by band.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard
import vllm_rules
from checkpoints import load_hf_tensors
from cli_inprocess import run_main
from fp8_checkpoints import FAMILIES, dequantized, expand, fp8_bits, make_fp8_hf, write_tensors
from megatron_rules import expected_rank_state, load_rank, rank_file
from reshard.io import fp8


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def source(request, tmp_path_factory):
    return make_fp8_hf(tmp_path_factory.mktemp(request.param) / "fp8", family=request.param)


#: per family, from its tensor list (tests/fp8_checkpoints.py): FP8 tensors; tensors read as BF16 / F32 (the
#: dequantised ones and the unquantized ones); FP8 shapes with partial blocks; one scale's shape
EXPECTED = {
    "LlamaForCausalLM": dict(fp8=15, dtypes={"BF16": 21}, shapes={(576, 256), (320, 256), (192, 256)},
                             scale=("model.layers.0.mlp.gate_proj.weight_scale_inv", (5, 2))),
    # 5 attention projections x 3 layers (MTP included), dense gate / up / down, 8 experts + 1 shared x 3 x 2 MoE
    # layers; unquantized: embedding, norm, head, 4 norms x 3 layers, router + bias x 2, MTP's 6 (one eh_proj), of
    # which its embedding and head are copies read as the model's (95 - 2 BF16 tensors)
    "DeepseekV3ForCausalLM": dict(fp8=72, dtypes={"BF16": 93, "F32": 2},
                                  shapes={(576, 256), (192, 256), (384, 192), (256, 512), (256, 128), (256, 192)},
                                  scale=("model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv", (5, 2))),
}


def expected_for(config: dict) -> dict:
    return EXPECTED[config["architectures"][0]]


def is_deepseek(config: dict) -> bool:
    return config["architectures"][0].startswith("Deepseek")


def assert_same(got: dict, want: dict, where: str) -> None:
    assert sorted(got) == sorted(want), f"{where}: names"
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, f"{where} {name}"
        assert torch.equal(fp8_bits(got[name]), fp8_bits(value)), f"{where} {name} bytes"


def test_source_quantises_partial_blocks(source):
    _, config, stored, _ = source
    want = expected_for(config)
    shapes = {tuple(t.shape) for n, t in stored.items() if t.dtype == torch.float8_e4m3fn}
    assert any(m % 128 for m, _ in shapes) and any(n % 128 for _, n in shapes)  # partial tail blocks
    assert want["shapes"] <= shapes and len([t for t in stored.values() if t.dtype == torch.float8_e4m3fn]) == want["fp8"]
    assert tuple(stored[want["scale"][0]].shape) == want["scale"][1]
    assert tuple(stored["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape) == (5, 2)  # the refusals' GATE


def test_deepseek_quantises_what_the_release_does(tmp_path):
    """DeepSeek-V3 (deepseek-v3.md section 7.3): the attention, dense, expert and shared-expert projections of every
    layer, MTP included, are FP8; norms, router and its fp32 bias, embeddings, heads, enorm / hnorm / shared_head
    and eh_proj are not."""
    _, config, stored, _ = make_fp8_hf(tmp_path / "fp8", "deepseek_v3")
    fp8_names = {n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn}
    mtp = f"model.layers.{config['num_hidden_layers']}."
    assert {mtp + "self_attn.kv_a_proj_with_mqa.weight", mtp + "mlp.experts.7.down_proj.weight",
            mtp + "mlp.shared_experts.up_proj.weight", "model.layers.0.mlp.down_proj.weight",
            "model.layers.1.self_attn.q_b_proj.weight"} <= fp8_names
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                 mtp + "enorm.weight", mtp + "hnorm.weight", mtp + "eh_proj.weight", mtp + "shared_head.head.weight",
                 mtp + "shared_head.norm.weight", mtp + "embed_tokens.weight", "model.layers.1.self_attn.kv_a_layernorm.weight"):
        assert stored[name].dtype == torch.bfloat16 and name + "_scale_inv" not in stored, name
    assert stored["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576


def test_hf_output_is_the_dequantised_bf16(source, tmp_path):
    path, config, stored, expected = source
    result = reshard.convert(path, str(tmp_path / "hf"), to="hf")
    assert_same(load_hf_tensors(tmp_path / "hf"), expected, "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in written
    assert written == {k: v for k, v in config.items() if k != "quantization_config"}
    assert any("block-FP8" in note and f"{expected_for(config)['fp8']} tensors" in note for note in result.notes), \
        result.notes
    assert all(t.dtype == torch.bfloat16 for n, t in expected.items() if not n.endswith("e_score_correction_bias"))


def test_megatron_tp2_ranks_hold_the_dequantised_slices(source, tmp_path):
    """Llama: the rank slices of megatron_rules. DeepSeek (MLA, experts, MTP; its rank rules are tested in
    test_deepseek.py): each rank equals that of the test's own dequantised bf16 checkpoint converted alike."""
    path, config, _, expected = source
    reshard.convert(path, str(tmp_path / "m"), to="megatron", tp=2)
    if is_deepseek(config):
        bf16 = tmp_path / "bf16"
        write_tensors(bf16, {k: v for k, v in config.items() if k != "quantization_config"}, expected)
        reshard.convert(str(bf16), str(tmp_path / "ref"), to="megatron", tp=2)
    for t in range(2):
        state = load_rank(rank_file(tmp_path / "m", t, 0, 1))
        model = {k: v for k, v in state["model"].items() if not k.endswith("_extra_state")}
        if is_deepseek(config):
            ref = load_rank(rank_file(tmp_path / "ref", t, 0, 1))["model"]
            want = {k: v for k, v in ref.items() if not k.endswith("_extra_state")}
            assert any(k.startswith("mtp.") for k in want) and any("linear_kv_down_proj" in k for k in want)
        else:
            want = expected_rank_state(expected, config, 2, t, 1, 0)
        assert_same(model, want, f"megatron rank {t}")


def test_vllm_tp2_ranks_hold_the_dequantised_slices(source, tmp_path):
    path, config, _, expected = source
    reshard.convert(path, str(tmp_path / "v"), to="vllm", tp=2)
    for r in range(2):
        got, _ = vllm_rules.load_rank(tmp_path / "v", r)
        rule = vllm_rules.expected_rank_mla if is_deepseek(config) else vllm_rules.expected_rank
        assert_same(got, rule(expected, config, 2, r), f"vllm rank {r}")
    assert "quantization_config" not in json.loads((tmp_path / "v" / "config.json").read_text())


def test_dtype_fp32_gives_the_exact_fp32_product(source, tmp_path):
    path, _, stored, expected = source
    reshard.convert(path, str(tmp_path / "f32"), to="hf", dtype="fp32")
    want = {n: (dequantized(stored[n], stored[n + "_scale_inv"], torch.float32) if n + "_scale_inv" in stored
                else t.to(torch.float32)) for n, t in expected.items()}
    assert_same(load_hf_tensors(tmp_path / "f32"), want, "fp32")


@pytest.mark.parametrize("shard", [None, "300KB"])
def test_keep_fp8_reshards_the_fp8_bytes_and_scales(source, tmp_path, shard):
    path, config, stored, _ = source
    out = tmp_path / "keep"
    reshard.convert(path, str(out), to="hf", keep_fp8=True, max_shard_size=shard)
    files = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    if shard is None or not is_deepseek(config):
        assert len(files) == (1 if shard is None else 7), files
    else:  # at least the shards that 300 KB per file needs
        assert len(files) >= -(-sum(t.numel() * t.element_size() for t in stored.values()) // 300_000), files
    assert_same(load_hf_tensors(out), stored, "keep-fp8")
    assert json.loads((out / "config.json").read_text()) == config  # quantization_config kept
    if shard:
        index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert sorted(index) == sorted(stored)
        for name, file in index.items():
            assert name in load_file(str(out / file)), name
    back = tmp_path / "back"  # and back to one file
    reshard.convert(str(out), str(back), to="hf", keep_fp8=True)
    assert_same(load_hf_tensors(back), stored, "keep-fp8 again")


def test_verify_sees_the_dequantised_view(source, tmp_path):
    """vLLM TP 2 (DeepSeek: Megatron TP 2, which keeps the MTP layer vLLM leaves out) verified against the source."""
    path, config, _, _ = source
    reshard.convert(path, str(tmp_path / "v"), to="megatron" if is_deepseek(config) else "vllm", tp=2)
    report = reshard.verify(path, str(tmp_path / "v"))
    assert report.equal and {t.status for t in report.tensors} == {"equal"}  # bf16 both sides: digests equal
    proc = run_main("verify", path, tmp_path / "v")
    assert proc.returncode == 0 and "EQUAL" in proc.stdout, proc.stdout + proc.stderr


def test_inspect_says_block_fp8(source):
    path, config, _, _ = source
    want = expected_for(config)
    info = reshard.inspect(path)
    assert info["quantization"] == f"block-FP8 e4m3, 128x128 blocks, {want['fp8']} tensors, read dequantised to bfloat16"
    assert info["dtypes"] == want["dtypes"]
    proc = run_main("inspect", path)
    assert proc.returncode == 0 and f"block-FP8 e4m3, 128x128 blocks, {want['fp8']} tensors" in proc.stdout, proc.stdout


# -- refusals: one line, exit 2, nothing written -----------------------------------------------------------------

def _edited(tmp_path, source, tensors=None, config=None):
    _, base_config, stored, _ = source
    tensors = dict(stored) if tensors is None else tensors
    path = tmp_path / "bad"
    write_tensors(path, base_config if config is None else config, tensors, shards=2)
    return path


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


GATE = "model.layers.0.mlp.gate_proj.weight"
BROKEN = {
    "fp8 without scale": (lambda s, c: (_without(s, GATE + "_scale_inv"), c), f"'{GATE}_scale_inv' is missing"),
    "scale without weight": (lambda s, c: ({**s, "model.layers.0.mlp.extra.weight_scale_inv": torch.ones(1, 1)}, c),
                             "has no FP8 weight (there is no 'model.layers.0.mlp.extra.weight')"),
    "scale of a bf16 weight": (lambda s, c: ({**s, "model.norm.weight_scale_inv": torch.ones(2)}, c),
                               "'model.norm.weight' is BF16, not F8_E4M3"),
    "scale shape": (lambda s, c: ({**s, GATE + "_scale_inv": torch.ones(4, 2)}, c), "need [5, 2]"),
    "scale dtype": (lambda s, c: ({**s, GATE + "_scale_inv": torch.ones(5, 2, dtype=torch.uint8)}, c),
                    "is U8, not F32"),
    "block size one int": (lambda s, c: (s, {**c, "quantization_config": {**c["quantization_config"],
                                                                         "weight_block_size": [128]}}),
                           "weight_block_size is [128], not 2 positive ints"),
    "block size missing": (lambda s, c: (s, {**c, "quantization_config": _without(c["quantization_config"],
                                                                                 "weight_block_size")}),
                           "weight_block_size is None"),
    "compressed-tensors": (lambda s, c: (s, {**c, "quantization_config": {"quant_method": "compressed-tensors"}}),
                           "quantization_config: compressed-tensors"),
    "fp8 claimed, none stored": (lambda s, c: ({n: (t.to(torch.bfloat16) if t.dtype == torch.float8_e4m3fn else t)
                                                for n, t in s.items() if not n.endswith("_scale_inv")}, c),
                                 "no tensor is F8_E4M3"),
    "fp8 without config": (lambda s, c: (s, _without(c, "quantization_config")), "has no quantization_config"),
    "e5m2 weight": (lambda s, c: ({**s, GATE: s[GATE].to(torch.float8_e5m2)}, c), "is F8_E5M2"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_malformed_fp8_is_refused_in_one_line(source, tmp_path, case):
    edit, message = BROKEN[case]
    tensors, config = edit(dict(source[2]), dict(source[1]))
    bad = _edited(tmp_path, source, tensors, config)
    out = tmp_path / "out"
    proc = run_main("convert", bad, out, "--to", "hf")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["bad"]


@pytest.mark.parametrize("to", ["vllm", "megatron", "torch_dist", "trtllm", "meta"])
def test_keep_fp8_into_other_layouts_is_refused_at_plan_time(source, tmp_path, to):
    out = tmp_path / "out"
    proc = run_main("convert", source[0], out, "--to", to, "--keep-fp8")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"FP8 into {to} is out of scope" in lines[0] and "re-quantising is lossy" in lines[0], proc.stderr
    assert not out.exists() and os.listdir(tmp_path) == []


def test_keep_fp8_of_an_unquantized_source_is_refused(source, tmp_path):
    bf16 = tmp_path / "bf16"
    reshard.convert(source[0], str(bf16), to="hf")
    proc = run_main("convert", bf16, tmp_path / "out", "--to", "hf", "--keep-fp8")
    assert proc.returncode == 2 and "has no FP8 weights; drop --keep-fp8" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


# -- bounded reads ---------------------------------------------------------------------------------------------------

def test_a_large_fp8_tensor_is_dequantised_band_by_band(source, tmp_path, monkeypatch):
    """With a 64 KiB step and 16K-element bands, the 576x256 gate is built from many small reads, none larger than
    one band of whole block rows; the output is still the dequantised bf16, bit for bit."""
    import reshard.execute

    path, _, _, expected = source
    monkeypatch.setattr(reshard.execute, "STEP_BYTES", 64 << 10)
    monkeypatch.setattr(fp8, "CHUNK_ELEMENTS", 16 << 10)
    reads, dequantized_spans = [], []
    real_dequantize = fp8.Fp8File.dequantize

    def recording(self, name, q, r0, r1, c0, c1, dtype, allow_overflow):
        dequantized_spans.append((name, (r1 - r0) * (c1 - c0)))
        real_read = self.base.read

        def read(n, *args):
            data = real_read(n, *args)
            if n == name:
                reads.append(data.numel())
            return data

        self.base.read = read
        try:
            return real_dequantize(self, name, q, r0, r1, c0, c1, dtype, allow_overflow)
        finally:
            del self.base.read

    monkeypatch.setattr(fp8.Fp8File, "dequantize", recording)
    reshard.convert(path, str(tmp_path / "hf"), to="hf")
    assert_same(load_hf_tensors(tmp_path / "hf"), expected, "hf, small blocks")
    gate = [n for name, n in dequantized_spans if name == GATE]
    assert len(gate) >= 4 and max(gate) * 2 <= 64 << 10  # row blocks of the 64 KiB step (bf16)
    assert reads and max(reads) <= 128 * 576  # one band of 128 rows (the widest weight has 576 columns)


def _e4m3_codes(rows: range, cols: int) -> np.ndarray:
    """Valid e4m3fn bytes (never 0x7F / 0xFF, the NaNs), coded by position, sign alternating."""
    r = np.arange(rows.start, rows.stop, dtype=np.int64)[:, None]
    c = np.arange(cols, dtype=np.int64)[None, :]
    return (((r * 31 + c) % 0x7E) | (((r + c) & 1) << 7)).astype(np.uint8)


def test_a_256_mib_fp8_tensor_converts_below_its_dequantised_size_in_a_child(tmp_path):
    """A tied Llama whose embedding is a [262144, 1024] FP8 weight (256 MiB, 512 MiB once bf16), written row band by
    row band: ``reshard convert`` to HF in a child process peaks below the 512 MiB of that one tensor, and sampled
    rows (first, inside, last, partial-free) equal the test's own dequantisation."""
    rows, cols, block = 262144, 1024, 128
    name = "model.embed_tokens.weight"
    config = dict(FAMILIES["llama"], hidden=cols, heads=8, kv_heads=2, head_dim=None, ffn=128, vocab=rows, layers=1,
                  tied=True)
    small = make_fp8_hf(tmp_path / "small", **dict(config, vocab=320))[2]  # the other tensors (vocab only sizes
    # the embedding, tied)
    src = tmp_path / "big"
    os.makedirs(src)
    scale = torch.tensor([[(1 + (i * 8 + j) % 13 / 16) * 2.0 ** -(i % 7) for j in range(cols // block)]
                          for i in range(rows // block)], dtype=torch.float32)
    others = {n: t for n, t in small.items() if n != name}
    save_file({**others, name + "_scale_inv": scale}, str(src / "model-00002-of-00002.safetensors"))
    header = {"__metadata__": {"format": "pt"},
              name: {"dtype": "F8_E4M3", "shape": [rows, cols], "data_offsets": [0, rows * cols]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(src / "model-00001-of-00002.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for r0 in range(0, rows, 16384):
            f.write(_e4m3_codes(range(r0, r0 + 16384), cols).tobytes())
    weight_map = {n: "model-00002-of-00002.safetensors" for n in [*others, name + "_scale_inv"]}
    weight_map[name] = "model-00001-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps({**json.loads((tmp_path / "small" / "config.json").read_text()),
                                                 "vocab_size": rows}))
    code = ("import sys\nfrom reshard import cli\nsys.argv = ['reshard', 'convert', sys.argv[1], sys.argv[2], "
            "'--to', 'hf', '--workers', '1']\ntry:\n    cli.main()\nexcept SystemExit as e:\n    code = e.code or 0\n"
            "else:\n    code = 0\nprint([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0])\n"
            "sys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    peak_kib = int(proc.stdout.split("VmHWM:")[1].split()[0])
    assert peak_kib * 1024 < 512 << 20, f"peak RSS {peak_kib / 1024:.0f} MiB"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        out = f.get_slice(name)
        for r0 in (0, 130000, rows - 200):
            w8 = torch.from_numpy(_e4m3_codes(range(r0, r0 + 200), cols)).view(torch.float8_e4m3fn)
            rows_scale = scale[r0 // block:(r0 + 199) // block + 1]
            sub = expand(rows_scale, (200 + r0 % block, cols))[r0 % block:]
            want = (w8.to(torch.float32) * sub).to(torch.bfloat16)
            assert torch.equal(out[r0:r0 + 200].view(torch.uint16), want.view(torch.uint16)), r0


def test_a_cast_that_overflows_the_products_is_refused(source, tmp_path):
    """Dequantised values above fp16's 65504 (scales times 100000): --dtype fp16 is refused, nothing written."""
    tensors = {n: (t * 100000 if n.endswith("_scale_inv") else t) for n, t in source[2].items()}
    bad = _edited(tmp_path, source, tensors)
    proc = run_main("convert", bad, tmp_path / "out", "--to", "hf", "--dtype", "fp16")
    assert proc.returncode == 2 and "turns finite values into inf" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_windows_at_any_offset_equal_the_reference_dequantisation(dtype, monkeypatch):
    """The kernel on windows that start and end inside blocks, with even and odd widths (the byte-pair and the byte
    table), chunks smaller than a block row, every e4m3 byte (NaN included) and scales up to 2^20: the test's own
    ``float32(W8) * S`` then torch's cast, bit for bit (NaN: still NaN)."""
    monkeypatch.setattr(fp8, "COMPUTE_ELEMENTS", 1000)
    m, n = 300, 333
    codes = torch.arange(m * n, dtype=torch.int64).reshape(m, n).mul(37).remainder(256).to(torch.uint8)
    w8 = codes.view(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0 ** (((i * 5 + j * 3) % 41) - 20) * (1 + j / 8) for j in range(3)] for i in range(3)],
                         dtype=torch.float32)
    want = dequantized(w8, scale, dtype)
    for (r0, r1), (c0, c1) in [((0, 300), (0, 333)), ((5, 290), (100, 301)), ((130, 131), (127, 129)),
                               ((127, 260), (0, 255)), ((256, 300), (200, 333))]:
        out = torch.empty((r1 - r0, c1 - c0), dtype=dtype)
        fp8._dequantize("w", codes[r0:r1, c0:c1].contiguous().numpy(), scale[r0 // 128:].numpy(), (128, 128), r0,
                        c0, out, allow_overflow=True)
        expected = want[r0:r1, c0:c1]
        nan = torch.isnan(expected)
        assert torch.equal(torch.isnan(out), nan), (r0, c0)
        assert nan.any() == ((codes[r0:r1, c0:c1] & 0x7F) == 0x7F).any()
        assert torch.equal(fp8_bits(out[~nan]), fp8_bits(expected[~nan])), (r0, r1, c0, c1)


def test_fp16_products_are_checked_when_asked():
    """``allow_overflow=False``: values up to 1 times scale 1000 pass into fp16, one byte of 448 (448000) is
    refused."""
    from reshard.io.casts import CastOverflowError

    codes = torch.full((4, 130), 0x38, dtype=torch.uint8)  # e4m3 1.0
    s = torch.full((1, 2), 1000.0)
    out = torch.empty((4, 130), dtype=torch.float16)
    fp8._dequantize("w", codes.numpy(), s.numpy(), (128, 128), 0, 0, out, allow_overflow=False)
    assert torch.equal(fp8_bits(out), fp8_bits(dequantized(codes.view(torch.float8_e4m3fn), s, torch.float16)))
    codes[2, 129] = 0x7E  # 448, in the second block column
    with pytest.raises(CastOverflowError, match="turns finite values into inf"):
        fp8._dequantize("w", codes.numpy(), s.numpy(), (128, 128), 0, 0, out, allow_overflow=False)


def test_products_are_not_checked_when_the_scales_bound_them(tmp_path, monkeypatch):
    """--dtype fp16 of the Llama source (448 x its largest scale is below 65504): no fp32 product goes through the
    overflow check, and the output is the reference's fp16."""
    import reshard.io.casts

    path, _, stored, expected = make_fp8_hf(tmp_path / "fp8")
    assert max(float(t.max()) for n, t in stored.items() if n.endswith("_scale_inv")) * 448 < 65504
    checked = []
    real = reshard.io.casts.check_cast
    monkeypatch.setattr(reshard.io.casts, "check_cast",
                        lambda name, src, cast: (checked.append(src.dtype), real(name, src, cast)))
    reshard.convert(path, str(tmp_path / "f16"), to="hf", dtype="fp16")
    assert torch.float32 not in checked and torch.bfloat16 in checked  # the bf16 tensors are checked
    want = {n: (dequantized(stored[n], stored[n + "_scale_inv"], torch.float16) if n + "_scale_inv" in stored
                else t.to(torch.float16)) for n, t in expected.items()}
    assert_same(load_hf_tensors(tmp_path / "f16"), want, "fp16")
