"""Tests for scripts/bench.py.  They never assert timings, only that the bench runs, writes
bench.json / bench.md and reports positive times and RSS; each finishes in seconds."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "scripts" / "bench.py"
SIZE = "0.002"  # GiB: hidden 64, 18 layers, vocab 1027


def load_bench():
    spec = importlib.util.spec_from_file_location("reshard_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["reshard_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def run_bench(out: Path, *args: str, timeout: float = 240) -> tuple[dict, str]:
    cmd = [sys.executable, str(BENCH), "--sizes", SIZE, "--repeat", "1", "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout}\n{proc.stderr}"
    data = json.loads((out / "bench.json").read_text())
    md = (out / "bench.md").read_text()
    assert md in proc.stdout  # the table is printed too
    return data, md


def summary_row(data: dict, op: str) -> dict:
    rows = [r for r in data["summary"] if r["op"] == op and r["size"] == SIZE]
    assert len(rows) == 1, data["summary"]
    return rows[0]


def md_rows(md: str, op: str) -> list[str]:
    return [ln for ln in md.splitlines() if ln.startswith((f"| {SIZE} | {op} |", f"| {SIZE} | {op} ("))]


def assert_ok(data: dict, md: str, op: str) -> dict:
    row = summary_row(data, op)
    assert row["status"] == "ok", row
    assert row["median_s"] > 0 and row["min_s"] > 0 and row["max_s"] >= row["min_s"]
    assert row["peak_rss_bytes"] > 0 and row["peak_rss_mib"] > 0
    assert row["gib_per_s"] > 0 and row["rss_per_largest_tensor"] > 0
    runs = [r for r in data["runs"] if r["op"] == op]
    assert runs and all(r["status"] == "ok" and r["wall_s"] > 0 and r["peak_rss_bytes"] > 0 for r in runs)
    assert len(md_rows(md, op)) == 1, md
    return row


def assert_paired(data: dict, ops: list[str]) -> None:
    """Every run of ``ops`` has its own cp of the same source next to it, and its ratio is to that cp."""
    runs = data["runs"]
    for op in ops:
        for run in (r for r in runs if r["op"] == op):
            cps = [r for r in runs if r["op"] == "cp" and r.get("paired_with") == op and r["repeat"] == run["repeat"]]
            assert len(cps) == 1, (op, run["repeat"])
            assert cps[0]["source_kind"] == run["source_kind"] and cps[0]["source_bytes"] == run["source_bytes"]
            assert run["ratio_to_paired_cp"] == pytest.approx(run["wall_s"] / cps[0]["wall_s"])
            assert cps[0]["cache"] == run["cache"] == data["cache_mode"]
    row = summary_row(data, ops[0])
    ratios = [r["ratio_to_paired_cp"] for r in runs if r["op"] == ops[0]]
    assert row["ratio_to_cp"] == pytest.approx(sorted(ratios)[len(ratios) // 2])


# ------------------------------------------------------------------- synthetic source ---


def test_generated_checkpoint_is_a_valid_llama(tmp_path):
    bench = load_bench()
    from safetensors import safe_open

    src, plan, generated = bench.ensure_source(tmp_path, float(SIZE), 2 << 30, log=lambda m: None)
    assert generated
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    assert cfg["tie_word_embeddings"] is False
    assert cfg["vocab_size"] % 128 != 0
    assert cfg["num_attention_heads"] == 32 and cfg["num_key_value_heads"] == 8
    assert cfg["num_attention_heads"] * cfg["head_dim"] == cfg["hidden_size"]
    assert cfg["intermediate_size"] % 8 == 0

    index = json.loads((src / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    n = len(shards)
    assert n >= 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"].values()) == set(shards)
    L = cfg["num_hidden_layers"]
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(L):
        expected |= {f"model.layers.{i}.{s}.weight" for s in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")}
    assert set(index["weight_map"]) == expected

    total, largest = 0, ("", 0)
    for shard in shards:
        with safe_open(src / shard, framework="pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == shard
                t = f.get_tensor(name)
                assert str(t.dtype) == "torch.bfloat16"
                assert bool((t != 0).all()), name  # non-zero filler
                total += t.numel() * 2
                largest = max(largest, (name, t.numel() * 2), key=lambda x: x[1])
    assert index["metadata"]["total_size"] == total
    assert abs(total / (float(SIZE) * 2**30) - 1) < 0.1
    assert largest[0] == "model.embed_tokens.weight"
    with safe_open(src / index["weight_map"]["model.layers.0.self_attn.k_proj.weight"], framework="pt") as f:
        assert list(f.get_tensor("model.layers.0.self_attn.k_proj.weight").shape) == [8 * cfg["head_dim"], cfg["hidden_size"]]

    # cached: not regenerated; a damaged shard is
    assert bench.ensure_source(tmp_path, float(SIZE), 2 << 30, log=lambda m: None)[2] is False
    with open(src / shards[0], "r+b") as f:
        f.truncate(100)
    assert bench.ensure_source(tmp_path, float(SIZE), 2 << 30, log=lambda m: None)[2] is True


@pytest.mark.parametrize("gib", [0.002, 0.01, 1, 4, 16, 70])
def test_shapes_are_close_to_requested_size(gib):
    bench = load_bench()
    shapes = bench.choose_shapes(gib)
    assert abs(bench.param_count(shapes) * 2 / (gib * 2**30) - 1) < 0.06
    assert shapes["vocab_size"] % 128 != 0
    assert shapes["intermediate_size"] % 8 == 0 and shapes["num_key_value_heads"] == 8
    specs = dict(bench.tensor_specs(shapes))
    biggest = max(specs, key=lambda k: math.prod(specs[k]))
    assert biggest in ("model.embed_tokens.weight", "lm_head.weight")


@pytest.mark.parametrize("gib", [0.01, 2.5, 8])
def test_mixtral_shapes(gib):
    """--model mixtral: 8 experts per layer (router + w1/w2/w3 each), the requested size within 6%, the MoE ops
    chosen by default and a Mixtral config that reshard maps."""
    bench = load_bench()
    shapes = bench.choose_shapes(gib, "mixtral")
    assert abs(bench.param_count(shapes) * 2 / (gib * 2**30) - 1) < 0.06
    specs = dict(bench.tensor_specs(shapes))
    assert specs["model.layers.0.block_sparse_moe.gate.weight"] == (8, shapes["hidden_size"])
    assert specs["model.layers.0.block_sparse_moe.experts.7.w2.weight"] == (shapes["hidden_size"],
                                                                          shapes["intermediate_size"])
    assert not any("mlp." in name for name in specs)
    config = bench.source_plan(gib, 2 << 30, "mixtral")["config"]
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 8
    assert bench.parse_args(["--model", "mixtral"]).ops == ["cp", "hf_to_megatron_tp2_ep4", "megatron_tp2_ep4_to_hf",
                                                           "pcp"]
    assert "hf_to_megatron_tp2_ep4" not in bench.parse_args([]).ops


# ------------------------------------------------------------ bench without converter ---


def test_bench_cp_and_naive(tmp_path):
    data, md = run_bench(tmp_path, "--ops", "cp", "naive")
    assert data["cache_mode"] == "data"  # the default: the checkpoint is evicted, programs stay cached
    assert_paired(data, ["naive"])
    cp = assert_ok(data, md, "cp")
    naive = assert_ok(data, md, "naive")
    assert cp["ratio_to_cp"] == pytest.approx(1.0)
    assert naive["ratio_to_cp"] > 0
    assert naive["peak_rss_bytes"] > cp["peak_rss_bytes"]  # torch vs. cp: not timing, just sanity
    assert data["sizes_info"][SIZE]["largest_tensor"]["name"] == "model.embed_tokens.weight"
    assert not (tmp_path / "work").exists()  # outputs deleted
    assert "| size GiB | operation | median s |" in md
    header = next(ln for ln in md.splitlines() if ln.startswith("| size GiB |"))
    column = [c.strip() for c in header.strip("|").split("|")].index("out / in")
    written = {op: float(md_rows(md, op)[0].strip("|").split("|")[column]) for op in ("cp", "naive")}
    assert written["cp"] == 1.0  # cp writes exactly the bytes it reads
    assert written["naive"] == pytest.approx(naive["output_bytes"] / naive["source_bytes"], abs=0.01)


# -------------------------------------------------- bench pipeline with a fake converter ---

FAKE_RESHARD = textwrap.dedent(
    r'''
    """Stand-in for `reshard` with the CLI contract the bench relies on (not a converter)."""
    import argparse, json, os, shutil, struct, sys
    from pathlib import Path

    if sys.argv[1:3] == ["convert", "--help"]:
        print("usage: reshard convert SRC DST --to [hf|megatron%s] --tp N --overwrite --workers N"
              % ("|vllm" if os.environ.get("FAKE_VLLM") else ""))
        sys.exit(0)
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd"); ap.add_argument("src"); ap.add_argument("dst")
    ap.add_argument("--to", required=True); ap.add_argument("--tp", type=int)
    ap.add_argument("--overwrite", action="store_true"); ap.add_argument("--workers", type=int)
    a = ap.parse_args()
    if a.tp is not None and os.environ.get("FAKE_FAIL_TP") == str(a.tp):
        print("boom: tp", a.tp, file=sys.stderr)
        sys.exit(3)
    src, dst = Path(a.src), Path(a.dst)
    if (src / "config.json").exists():
        cfg = json.loads((src / "config.json").read_text())
    else:
        cfg = json.loads((src / "fake_hf_config.json").read_text())
    if a.to == "hf":
        dst.mkdir()
        (dst / "config.json").write_text(json.dumps(cfg))
        import torch
        from safetensors.torch import save_file
        save_file({"model.embed_tokens.weight": torch.ones(cfg["vocab_size"], cfg["hidden_size"], dtype=torch.bfloat16)},
                  str(dst / "model.safetensors"))
    elif a.to == "megatron":
        import torch
        mult = 128 * a.tp
        padded = -(-cfg["vocab_size"] // mult) * mult
        dst.mkdir()
        (dst / "latest_checkpointed_iteration.txt").write_text("release")
        (dst / "fake_hf_config.json").write_text(json.dumps(cfg))
        for r in range(a.tp):
            d = dst / "release" / f"mp_rank_{r:02d}"
            d.mkdir(parents=True)
            sd = {"embedding.word_embeddings.weight": torch.ones(padded // a.tp, cfg["hidden_size"], dtype=torch.bfloat16)}
            torch.save({"model": sd, "args": argparse.Namespace(tensor_model_parallel_size=a.tp),
                        "checkpoint_version": 3.0}, d / "model_optim_rng.pt")
    else:
        sys.exit(2)
    '''
)


@pytest.mark.slow  # 19 s: six ops and their copies as subprocesses; the report is also checked by the tests below
def test_bench_pipeline_with_fake_converter(tmp_path, monkeypatch):
    fake = tmp_path / "fake_reshard.py"
    fake.write_text(FAKE_RESHARD)
    out = tmp_path / "out"
    monkeypatch.delenv("FAKE_VLLM", raising=False)
    monkeypatch.setenv("FAKE_FAIL_TP", "1")
    data, md = run_bench(
        out, "--reshard", shlex.join([sys.executable, str(fake)]), "--workers", "2", "--keep", "--ops",
        "cp", "hf_to_megatron_tp8", "megatron_tp8_to_tp4", "megatron_tp8_to_hf", "hf_to_megatron_tp1", "hf_to_vllm_tp4",
    )
    vocab, hidden = 1027, 64
    tp8 = assert_ok(data, md, "hf_to_megatron_tp8")
    assert tp8["largest_output_tensor_bytes"] == 2048 // 8 * hidden * 2  # padded to 128*8, read from the .pt
    assert tp8["largest_output_tensor_bytes"] == data["sizes_info"][SIZE]["expected_megatron_largest_tensor_bytes"]["tp8"]
    tp4 = assert_ok(data, md, "megatron_tp8_to_tp4")
    assert tp4["source_bytes"] != data["sizes_info"][SIZE]["source_bytes"]  # measured on the TP8 checkpoint
    to_hf = assert_ok(data, md, "megatron_tp8_to_hf")
    assert to_hf["largest_output_tensor_bytes"] == vocab * hidden * 2
    runs = {r["op"]: r for r in data["runs"]}
    assert runs["hf_to_megatron_tp8"]["cmd"][-3:] == ["--overwrite", "--workers", "2"]
    assert runs["hf_to_megatron_tp8"]["cmd"][-7:-3] == ["--to", "megatron", "--tp", "8"]
    tp1 = summary_row(data, "hf_to_megatron_tp1")
    assert tp1["status"] == "failed (rc=3)" and "boom" in runs["hf_to_megatron_tp1"]["error_tail"]
    assert summary_row(data, "hf_to_vllm_tp4")["status"] == "not available"
    assert "not available" in md_rows(md, "hf_to_vllm_tp4")[0]
    assert (out / "outputs" / SIZE / "megatron_tp8_to_tp4" / "release" / "mp_rank_03").is_dir()  # --keep
    assert not (out / "work").exists()


# ------------------------------------------------------------ bench with the converter ---


def _converter_present() -> bool:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('reshard.cli') is None)"
    return subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


@pytest.mark.skipif(not _converter_present(), reason="reshard.cli not written yet")
def test_bench_converter_ops(tmp_path):
    data, md = run_bench(tmp_path, "--ops", "cp", "hf_to_megatron_tp8", "megatron_tp8_to_tp4", timeout=600)
    assert data["converter"]["available"], data["converter"]
    for op in ("cp", "hf_to_megatron_tp8", "megatron_tp8_to_tp4"):
        row = assert_ok(data, md, op)
        if op != "cp":
            assert row["ratio_to_cp"] > 0 and row["ratio_kind"] == "median of paired runs"
    assert_paired(data, ["hf_to_megatron_tp8", "megatron_tp8_to_tp4"])
    assert not (tmp_path / "work").exists()
    # the converter runs from bytecode, as an installed package does, whatever PYTHONDONTWRITEBYTECODE says
    assert data["environment"]["reshard_bytecode"].startswith("compiled by the bench")
    assert os.path.exists(importlib.util.cache_from_source(str(REPO / "reshard" / "cli.py")))
    assert "reshard's bytecode: compiled by the bench" in md


@pytest.mark.slow
def test_bench_torchrun_rows(tmp_path):
    """--torchrun 2: each conversion also runs under torchrun (2 processes), its row is reported and timed against
    the 1-process run (--workers 1), and its output is a complete conversion like the 1-process one's."""
    data, md = run_bench(tmp_path, "--ops", "cp", "hf_to_megatron_tp8", "--torchrun", "2", "--keep", timeout=600)
    assert data["args"]["workers"] == 1 and data["args"]["torchrun"] == 2
    assert_ok(data, md, "hf_to_megatron_tp8")
    assert_ok(data, md, "hf_to_megatron_tp8@torchrun2")
    run = next(r for r in data["runs"] if r["op"] == "hf_to_megatron_tp8@torchrun2")
    assert run["cmd"][1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    plain = next(r for r in data["runs"] if r["op"] == "hf_to_megatron_tp8")
    assert plain["cmd"][-2:] == ["--workers", "1"]
    [ratio] = data["torchrun"]
    assert ratio["op"] == "hf_to_megatron_tp8" and ratio["processes"] == 2
    assert math.isclose(ratio["ratio"], ratio["median_s"] / ratio["one_process_median_s"])
    assert f"{SIZE} GiB hf_to_megatron_tp8: 2 processes" in md


def test_wide_shapes():
    """--model wide: hidden 4096, 1 layer, and at 3.57 GiB MLP weights of FFN 131072 (1 GiB each in bf16), the
    largest tensors (at 3.57 GiB); its default ops are the four the issue names, next to cp and pcp."""
    bench = load_bench()
    shapes = bench.choose_shapes(3.57, "wide")
    assert (shapes["hidden_size"], shapes["num_hidden_layers"], shapes["intermediate_size"]) == (4096, 1, 131072)
    specs = dict(bench.tensor_specs(shapes))
    largest = max(specs.items(), key=lambda kv: math.prod(kv[1]))
    assert largest[0].endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
    assert math.prod(largest[1]) * 2 == 1 << 30
    assert bench.parse_args(["--model", "wide"]).ops == ["cp", "hf_to_megatron_tp8", "megatron_tp8_to_hf",
                                                        "hf_to_megatron_tp1", "megatron_tp8_to_vllm_tp2", "pcp"]


def test_deepseek_shapes():
    """--model deepseek: DeepSeek-V3's tensors (MLA with q LoRA and kv LoRA 512 + rope 64, 16 routed and 1 shared
    experts, the fp32 router bias, one dense first layer) at about 1 GiB, and its default ops."""
    bench = load_bench()
    shapes = bench.choose_shapes(1, "deepseek")
    assert abs(bench.param_count(shapes) * 2 / 2**30 - 1) < 0.06 and shapes["num_hidden_layers"] >= 8
    h, nh = shapes["hidden_size"], shapes["num_attention_heads"]
    specs = dict(bench.tensor_specs(shapes))
    a = "model.layers.1.self_attn."
    assert specs[a + "kv_a_proj_with_mqa.weight"] == (512 + 64, h) and specs[a + "kv_b_proj.weight"] == (nh * 128, 512)
    assert specs[a + "q_a_proj.weight"] == (shapes["q_lora_rank"], h) and specs[a + "o_proj.weight"] == (h, nh * 64)
    assert "model.layers.0.mlp.gate_proj.weight" in specs and "model.layers.0.mlp.gate.weight" not in specs
    assert specs["model.layers.1.mlp.experts.15.down_proj.weight"] == (h, h // 2)
    assert specs["model.layers.1.mlp.shared_experts.up_proj.weight"] == (h // 2, h)
    assert "model.layers.1.mlp.experts.16.up_proj.weight" not in specs
    assert bench.tensor_dtype("model.layers.1.mlp.gate.e_score_correction_bias") == "F32"
    config = bench.source_plan(1, 2 << 30, "deepseek")["config"]
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["first_k_dense_replace"] == 1
    assert bench.parse_args(["--model", "deepseek"]).ops == ["cp", "hf_to_megatron_tp2_ep4", "megatron_tp2_ep4_to_hf",
                                                            "hf_fp8_to_bf16_hf", "pcp"]
    assert "hf_to_fp32_hf" not in bench.parse_args([]).ops


@pytest.mark.skipif(not _converter_present(), reason="reshard.cli not written yet")
def test_bench_deepseek_ops(tmp_path):
    """A small DeepSeek source through its three ops (its FP8 version made by the bench's quantiser: the
    release's projections FP8, kv_a_proj_with_mqa's 576 rows in 5 block rows; router and norms not, the fp32 bias
    kept), and the cast op on it."""
    data, md = run_bench(tmp_path, "--model", "deepseek", "--sizes", "0.01", "--keep", "--ops", "cp",
                         "hf_to_megatron_tp2_ep4", "megatron_tp2_ep4_to_hf", "hf_fp8_to_bf16_hf", "hf_to_fp32_hf",
                         timeout=600)
    for op in ("hf_to_megatron_tp2_ep4", "megatron_tp2_ep4_to_hf", "hf_fp8_to_bf16_hf", "hf_to_fp32_hf"):
        row = next(r for r in data["summary"] if r["op"] == op)
        assert row["status"] == "ok" and row["median_s"] > 0, row
    assert "MLA q LoRA 48, kv LoRA 512 + rope 64; 16 routed + 1 shared experts" in md
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_inspect import read_safetensors_header

    fp8_source = tmp_path / "outputs" / "0.01" / "hf_fp8_source"
    header = {n: i for f in sorted(fp8_source.glob("*.safetensors")) for n, i in read_safetensors_header(f).items()}
    a = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    assert header[a]["dtype"] == "F8_E4M3" and header[a + "_scale_inv"]["shape"] == [5, 1]
    assert header["model.layers.1.mlp.experts.3.gate_proj.weight"]["dtype"] == "F8_E4M3"
    assert header["model.layers.1.mlp.gate.weight"]["dtype"] == "BF16"
    assert header["model.layers.1.mlp.gate.e_score_correction_bias"]["dtype"] == "F32"
    assert header["model.layers.1.self_attn.kv_a_layernorm.weight"]["dtype"] == "BF16"
    back = tmp_path / "outputs" / "0.01" / "megatron_tp2_ep4_to_hf"
    source = tmp_path / "sources" / "deepseek-0.01GiB"
    assert read_bytes_of(back, a) == read_bytes_of(source, a)  # the round trip through Megatron, bit for bit



@pytest.mark.skipif(not _converter_present(), reason="reshard.cli not written yet")
def test_bench_vlm_ops(tmp_path):
    """--model qwen2_5_vl: a Qwen2.5-VL source (nested config, Qwen2 text with q/k/v biases, the tower "visual.")
    through its default ops, HF -> Megatron TP 2 and back, each row with a ratio to cp and a peak RSS; the tower's
    fused qkv comes back bit for bit."""
    bench = load_bench()
    assert bench.parse_args(["--model", "qwen2_5_vl"]).ops == ["cp", "pcp", "vlm_hf_to_megatron_tp2",
                                                              "vlm_megatron_tp2_to_hf"]
    assert not set(bench.VLM_OPS) & set(bench.parse_args([]).ops)
    data, md = run_bench(tmp_path, "--model", "qwen2_5_vl", "--keep")
    for op in ("vlm_hf_to_megatron_tp2", "vlm_megatron_tp2_to_hf"):
        row = assert_ok(data, md, op)
        assert row["ratio_to_cp"] > 0 and row["ratio_kind"] == "median of paired runs"
    assert_paired(data, ["vlm_hf_to_megatron_tp2", "vlm_megatron_tp2_to_hf"])
    source = tmp_path / "sources" / f"qwen2_5_vl-{SIZE}GiB"
    config = json.loads((source / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"] and config["tie_word_embeddings"] is False
    text, vision = config["text_config"], config["vision_config"]
    assert sum(text["rope_parameters"]["mrope_section"]) * 2 * text["num_attention_heads"] == text["hidden_size"]
    assert vision["out_hidden_size"] == text["hidden_size"] and vision["num_heads"] % 2 == 0
    qkv = "visual.blocks.0.attn.qkv.weight"
    assert read_bytes_of(tmp_path / "outputs" / SIZE / "vlm_megatron_tp2_to_hf", qkv) == read_bytes_of(source, qkv)
    assert read_bytes_of(source, "model.layers.0.self_attn.k_proj.bias")

def read_bytes_of(folder: Path, name: str) -> bytes:
    """The stored bytes of tensor ``name`` in an HF folder."""
    import struct

    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
            if name in header:
                lo, hi = header[name]["data_offsets"]
                fh.seek(8 + n + lo)
                return fh.read(hi - lo)
    raise KeyError(name)


def test_parallel_copy_reference(tmp_path):
    """pcp copies the same bytes as cp -r (every file identical), in N parallel streams, and each conversion gets
    a paired ratio to it and a plain ratio of medians to cp."""
    import filecmp

    data, md = run_bench(tmp_path, "--ops", "cp", "pcp", "hf_to_megatron_tp8", "--keep", timeout=600)
    assert data["environment"]["copy_streams"] >= 1
    run = next(r for r in data["runs"] if r["op"] == "pcp")
    assert run["status"] == "ok" and run["cmd"][-1] == str(data["environment"]["copy_streams"])
    row = assert_ok(data, md, "hf_to_megatron_tp8")
    assert row["ratio_to_pcp"] > 0 and row["ratio_of_medians"] > 0
    assert math.isclose(row["ratio_of_medians"], row["median_s"] / row["paired_cp_median_s"])
    src = Path(data["sizes_info"][SIZE]["source_dir"])
    copy = tmp_path / "pcp-copy"
    bench = load_bench()
    subprocess.run(bench.build_cmd("pcp", src, copy, None), check=True, timeout=120)
    names = sorted(p.name for p in src.iterdir())
    assert names == sorted(p.name for p in copy.iterdir())
    assert all(filecmp.cmp(src / n, copy / n, shallow=False) for n in names)
