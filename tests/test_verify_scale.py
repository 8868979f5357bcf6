"""``verify --dry-run`` at the scale of Llama-3.1-405B: sparse checkpoints (headers only, no data blocks), so the
estimate is shown to come from headers alone, and to stay bounded whatever the model size."""

from __future__ import annotations

import json

from helpers import run_cli
from sparse_checkpoints import LLAMA_405B, llama_405b_config, write_sparse_hf


def test_dry_run_of_a_405b_pair_reads_headers_only_and_bounds_memory(tmp_path, capsys):
    config = llama_405b_config()
    weights = write_sparse_hf(tmp_path / "a", config)
    write_sparse_hf(tmp_path / "b", config)
    h, f, v = LLAMA_405B["hidden_size"], LLAMA_405B["intermediate_size"], LLAMA_405B["vocab_size"]
    per_layer = h * (128 * 128) * 2 + h * (8 * 128) * 2 + 3 * h * f + 2 * h
    assert weights == 2 * (per_layer * 126 + 2 * v * h + h)  # bf16: about 756 GiB, 405.9e9 parameters
    code, out, _ = run_cli(capsys, "verify", tmp_path / "a", tmp_path / "b", "--dry-run", "--json", "--workers", "2")
    plan = json.loads(out)
    assert code == 0 and len(plan["processes"]) == 2
    assert sum(p["read_a"] for p in plan["processes"]) == sum(p["read_b"] for p in plan["processes"]) == weights
    assert all(p["peak_estimate"] < 512 << 20 and p["largest_block"] <= 32 << 20 for p in plan["processes"])
    code, text, _ = run_cli(capsys, "verify", tmp_path / "a", tmp_path / "b", "--dry-run")
    assert code == 0 and "process 0: reads 756.0 GiB of A and 756.0 GiB of B" in text, text


def test_forward_dry_run_of_a_405b_pair_at_tp8_holds_two_layers_a_rank(tmp_path, capsys):
    config = llama_405b_config()
    weights = write_sparse_hf(tmp_path / "a", config)
    write_sparse_hf(tmp_path / "b", config)
    code, out, _ = run_cli(capsys, "verify", tmp_path / "a", tmp_path / "b", "--forward", "--dry-run", "--nproc", "8",
                           "--json")
    plan = json.loads(out)
    assert code == 0 and len(plan["processes"]) == 8
    # each side sliced 8 ways: every weight byte read once per side, but the norms (2 a layer and the final one,
    # replicated) by every rank
    h, f = LLAMA_405B["hidden_size"], LLAMA_405B["intermediate_size"]
    norms = (2 * LLAMA_405B["num_hidden_layers"] + 1) * h * 2
    reads = weights + 7 * norms
    assert sum(p["read_a"] for p in plan["processes"]) == sum(p["read_b"] for p in plan["processes"]) == reads
    layer_fp32_rank = (h * 128 * 128 * 2 + h * 8 * 128 * 2 + 3 * h * f) * 4 // 8  # one layer's slice in fp32
    for p in plan["processes"]:
        # two layers in fp32 (and their norms), plus the stored bf16 slice of the tensor being cast (gate or up)
        assert p["peak_parts"]["weights"] <= 2 * layer_fp32_rank + 4 * h * 4 + f * h * 2 // 8
        assert p["peak_estimate"] < 6 << 30
    code, text, _ = run_cli(capsys, "verify", tmp_path / "a", tmp_path / "b", "--forward", "--dry-run", "--nproc", "8")
    assert code == 0 and text.count("peak memory about") == 8 and "FORWARD" not in text
