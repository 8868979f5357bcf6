"""Forward verification: the reference tensor-parallel decoder against transformers, Megatron rank files at
TP 2/4/8 (and pp=2) against their HF source, deliberately broken conversions that must FAIL and name where,
and the launcher's failure paths (a worker that raises, a timeout). All fp32, tiny seeded models."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil

import pytest
import torch

import reshard
from checkpoints import make_hf
from helpers import processes_tagged, run_cli, tiny_transformers_model
from reshard.errors import ReshardError
from reshard.layouts.base import Options
from reshard.verification.forward import verify_forward
from reshard.verification.forward.decoder import TPGroup, cast_weights, forward
from reshard.verification.forward.sliced_rank import load_rank as load_hf_rank
from reshard.verification.forward.job import ForwardJob, Side
from reshard.verification.forward.launch import launch
from reshard.verification.forward.report import tolerance

ATOL = 1e-5


# ------------------------------------------------------------------------------ TP=1 vs transformers

ROPE_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}
HF_CASES = {
    "llama_gqa_llama3_rope": ("LlamaConfig", dict(num_key_value_heads=2, rope_theta=500000.0,
                                                  rope_scaling=ROPE_LLAMA3)),
    "llama_gqa_linear_rope_tied": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=True,
                                                       rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, head_dim=16)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2)),
}


def transformers_model(kind):
    transformers = pytest.importorskip("transformers")
    cls_name, extra = HF_CASES[kind]
    return tiny_transformers_model(transformers, cls_name, **extra)


@pytest.mark.parametrize("kind", sorted(HF_CASES))
def test_tp1_decoder_equals_transformers(kind, tmp_path):
    model = transformers_model(kind)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ids = torch.randint(0, 1003, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
    weights = cast_weights(load_hf_rank(str(tmp_path / "hf"), 0, 1, Options()), torch.float32, "cpu")
    with torch.no_grad():
        got = forward(weights, ids, TPGroup()).logits
    assert got.shape == expected.shape  # TP=1: no vocab padding
    err = (got - expected).abs().max().item()
    assert err <= ATOL, f"{kind}: max |logit error| {err:.3g}"
    if "tied" in kind:
        assert weights.lm_head is None


# ------------------------------------------------------------------------ Megatron rank files vs HF

MODELS = {  # seeded (not position-coded) weights: logits must be meaningful
    "llama": dict(arch="LlamaForCausalLM", kv_heads=2),
    "llama_tied": dict(arch="LlamaForCausalLM", kv_heads=2, tied=True),
    "qwen2_tied": dict(arch="Qwen2ForCausalLM", kv_heads=2, tied=True),
    "llama_kv1": dict(arch="LlamaForCausalLM", kv_heads=1),
    "llama_kv4": dict(arch="LlamaForCausalLM", kv_heads=4),
    "llama_kv8": dict(arch="LlamaForCausalLM", kv_heads=8),
}


def seeded_hf(path, model):
    return make_hf(path, coded=False, seed=3, hidden=64, layers=2, heads=8, ffn=96, vocab=1000, **MODELS[model])


def assert_equal_report(r: dict) -> None:
    assert r["ok"], r["problems"]
    assert r["max_abs"] <= ATOL and r["argmax_agreement"] == 1.0 and r["kl_mean"] < 1e-9
    assert r["tolerance"]["basis"] == "float32" and r["first_divergence"] is None
    assert r["padding_max_abs_b"] == 0.0


@pytest.mark.parametrize("model,tp,pp", [
    ("qwen2_tied", 2, 1),  # q/k/v biases, tied head
    ("llama_tied", 2, 2),  # tied with pp=2: the last stage runs its own output_layer copy
    ("llama_kv4", 4, 1),
    pytest.param("llama_kv8", 8, 1, marks=pytest.mark.slow),  # 8 processes: ~20-40 s on two cores
])
def test_megatron_tp_logits_equal_hf(tmp_path, model, tp, pp):
    src = seeded_hf(tmp_path / "hf", model)
    dst = tmp_path / "m"
    reshard.convert(src, str(dst), to="megatron", tp=tp, pp=pp)
    r = verify_forward(src, str(dst))
    assert (r["a"]["tp"], r["b"]["tp"], r["b"]["layout"]) == (1, tp, "megatron")
    assert r["b"]["padded_vocab"] == -(-1000 // (128 * tp)) * 128 * tp
    # rank 0 read only its own rank folders, one per pipeline stage
    assert sorted(f.split("/")[1] for f in r["b"]["rank0_files"]) == \
        (["mp_rank_00"] if pp == 1 else [f"mp_rank_00_{p:03d}" for p in range(pp)])
    assert_equal_report(r)


@pytest.mark.parametrize("model,nproc", [
    ("llama_kv1", 2),  # multi-query attention: both ranks hold a replica of the one KV head
    pytest.param("llama", 4, marks=pytest.mark.slow),  # 2 KV heads over 4 ranks: KV head r // 2
])
def test_hf_sliced_with_replicated_kv_heads(tmp_path, model, nproc):
    """nproc > KV heads: each rank holds one replicated KV head, KV head ``r // (nproc / ng)`` (vLLM's rule)."""
    src = seeded_hf(tmp_path / "hf", model)
    r = verify_forward(src, src, nproc=nproc)
    assert r["b"]["tp"] == nproc and r["b"]["padded_vocab"] == 1000
    assert_equal_report(r)


def test_bf16_cast_passes_with_bf16_tolerance(tmp_path):
    src = seeded_hf(tmp_path / "hf", "llama")
    reshard.convert(src, str(tmp_path / "m"), to="megatron", tp=2, dtype="bf16")
    r = verify_forward(src, str(tmp_path / "m"))
    assert r["b"]["dtype"] == "bfloat16" and r["tolerance"]["basis"] == "bfloat16"
    assert r["ok"], r["problems"]
    assert 0 < r["max_abs"] <= 0.1 and r["argmax_agreement"] >= 0.99


def test_tolerance_basis():
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert tolerance(bf16, bf16, f32)["basis"] == "float32"  # same stored bytes: only reduction order differs
    assert tolerance(f32, bf16, f32)["basis"] == "bfloat16"
    assert tolerance(f16, f32, f32)["basis"] == "float16"
    assert tolerance(f32, f32, bf16)["basis"] == "bfloat16"
    assert tolerance(f32, f32, f32, atol=1e-3)["atol"] == 1e-3


# ------------------------------------------------------------------ broken conversions must FAIL

def _rank_file(root, rank):
    return root / "release" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt"


def _rewrite(path, edit):
    """Load a trusted test rank file (weights_only, Namespace allowed), edit its model dict, save it back."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        blob = torch.load(path, map_location="cpu", weights_only=True)
    edit(blob["model"])
    torch.save(blob, path)


D = 8  # head dim of the test model (hidden 64 / 8 heads)


def swap_query_heads(sd):
    t = sd["decoder.layers.0.self_attention.linear_qkv.weight"]  # rank 0, group 0: q heads 0..3, k, v
    t[:D], t[D:2 * D] = t[D:2 * D].clone(), t[:D].clone()


def swap_gate_up(sd):
    t = sd["decoder.layers.1.mlp.linear_fc1.weight"]
    gate, up = t.chunk(2)
    sd["decoder.layers.1.mlp.linear_fc1.weight"] = torch.cat([up, gate]).clone()


def interleave_q_rows(sd):
    t = sd["decoder.layers.0.self_attention.linear_qkv.weight"]
    order = torch.stack([torch.arange(D // 2), torch.arange(D // 2) + D // 2], dim=1).flatten()  # 0, hd/2, 1, ...
    grouped = t.view(-1, 6 * D, t.shape[1])  # per group: 4 q heads, k, v
    for g in range(grouped.shape[0]):
        for h in range(4):
            rows = grouped[g, h * D:(h + 1) * D]
            rows.copy_(rows[order].clone())


def nonzero_padding_row(sd):
    sd["output_layer.weight"][-1] = 0.01  # rank 1's last row: padded id 1023


FAULTS = {
    "swap_query_heads": (0, swap_query_heads, "layer 0 attention"),
    "swap_gate_up": (1, swap_gate_up, "layer 1 mlp"),
    "interleaved_rope_q": (0, interleave_q_rows, "layer 0 attention"),
    "nonzero_lm_head_padding": (1, nonzero_padding_row, "lm_head padding rows"),
}


@pytest.fixture(scope="module")
def megatron_tp2(tmp_path_factory):
    base = tmp_path_factory.mktemp("fwd_faults")
    src = seeded_hf(base / "hf", "llama")
    reshard.convert(src, str(base / "m"), to="megatron", tp=2)
    return src, base / "m"


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_broken_conversion_fails_and_names_where(fault, megatron_tp2, tmp_path, capsys):
    src, good = megatron_tp2
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    rank, edit, where = FAULTS[fault]
    _rewrite(_rank_file(bad, rank), edit)
    code, out, err = run_cli(capsys, "verify", "--forward", src, bad, "--json")
    assert code == 1, err
    r = json.loads(out)
    assert not r["ok"] and r["first_divergence"].startswith(where), r["first_divergence"]
    if fault == "nonzero_lm_head_padding":
        assert r["logits_within_tolerance"] and r["padding_max_abs_b"] > 0
        assert any("lm_head padding rows 1023..1023" in p and "rank(s) 1" in p for p in r["problems"])
    else:
        assert r["max_abs"] > 1e-3
        first_bad = next(b for b in r["blocks"] if not b["ok"])
        assert first_bad["block"] == where
        assert all(b["ok"] for b in r["blocks"][:r["blocks"].index(first_bad)])


# ------------------------------------------------------------------------------ CLI and launcher

def test_cli_forward_json_and_prompt_ids(megatron_tp2, tmp_path, capsys):
    src, good = megatron_tp2
    ids = tmp_path / "ids.txt"
    ids.write_text("1 5 999 3 3 7\n0 2 4 6 8 10\n")
    code, out, err = run_cli(capsys, "verify", "--forward", src, good, "--prompt-ids", ids, "--json")
    assert code == 0, err
    r = json.loads(out)
    assert (r["batch"], r["seq_len"], r["seed"], r["backend"]) == (2, 6, None, "gloo")
    assert_equal_report(r)


@pytest.mark.parametrize("args,message", [
    (["--nproc", "4"], "use --nproc 2"),
    (["--backend", "mpi"], "unknown --backend"),
    (["--seq-len", "0"], "must be positive"),
])
def test_cli_forward_bad_input(megatron_tp2, capsys, args, message):
    src, good = megatron_tp2
    code, out, err = run_cli(capsys, "verify", "--forward", src, good, *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_hf_nproc_must_divide_heads(megatron_tp2, capsys):
    src, _ = megatron_tp2
    code, _, err = run_cli(capsys, "verify", "--forward", src, src, "--nproc", "3")
    assert code == 2 and "attention heads over 3 ranks" in err


def test_worker_error_ends_run_with_its_message(megatron_tp2, tmp_path):
    src, good = megatron_tp2
    broken = tmp_path / "m"
    shutil.copytree(good, broken)
    (broken / "release" / "mp_rank_01" / "model_optim_rng.pt").write_bytes(b"not a zip")  # rank 1 fails to load
    # (rank 0 never opens rank 1's file: it loads its own shard and waits in a collective until it is killed)
    job = ForwardJob(a=Side(src, "hf", 1), b=Side(str(broken), "megatron", 2), input_ids=[[1, 2, 3]], vocab=1000,
                     timeout=120)
    with pytest.raises(ReshardError) as info:
        launch(job)
    message = str(info.value)
    assert info.value.exit_code == 2 and "\n" not in message
    assert message.startswith("forward check failed on rank 1") and "mp_rank_01/model_optim_rng.pt" in message
    assert not multiprocessing.active_children()


def test_timeout_kills_workers(megatron_tp2):
    src, good = megatron_tp2
    job = ForwardJob(a=Side(src, "hf", 1), b=Side(str(good), "megatron", 2), input_ids=[[1, 2, 3]], vocab=1000,
                     timeout=0.05)
    with pytest.raises(ReshardError) as info:
        launch(job)
    assert info.value.exit_code == 1 and "timed out after 0.05s" in str(info.value)
    assert not multiprocessing.active_children()


def test_workers_see_the_callers_environment_of_the_moment(megatron_tp2, tmp_path, monkeypatch):
    """The workers are forks of a server started with the first check (its environment dates from then): each
    worker still gets the caller's environment as it is when the check starts (here RESHARD_DEBUG, which adds the
    worker's traceback to its error)."""
    src, good = megatron_tp2
    broken = tmp_path / "m"
    shutil.copytree(good, broken)
    (broken / "release" / "mp_rank_01" / "model_optim_rng.pt").write_bytes(b"not a zip")
    job = ForwardJob(a=Side(src, "hf", 1), b=Side(str(broken), "megatron", 2), input_ids=[[1, 2, 3]], vocab=1000,
                     timeout=120)
    monkeypatch.delenv("RESHARD_DEBUG", raising=False)
    with pytest.raises(ReshardError) as plain:
        launch(job)  # starts the server if no earlier test did
    assert "Traceback" not in str(plain.value)
    monkeypatch.setenv("RESHARD_DEBUG", "1")
    with pytest.raises(ReshardError) as debug:
        launch(job)
    assert str(debug.value).startswith("forward check failed on rank 1") and "Traceback" in str(debug.value)
    assert not multiprocessing.active_children()


def test_without_a_forkserver_the_workers_are_spawned(megatron_tp2, monkeypatch):
    """Where multiprocessing has no forkserver (Windows), the check spawns its workers and gives the same report."""
    import importlib

    import torch.multiprocessing as mp

    launch_module = importlib.import_module("reshard.verification.forward.launch")
    src, good = megatron_tp2
    job = ForwardJob(a=Side(src, "hf", 1), b=Side(str(good), "megatron", 2), input_ids=[[1, 2, 3]], vocab=1000,
                     timeout=120)
    forked = launch(job)
    monkeypatch.setattr(mp, "get_all_start_methods", lambda: ["spawn"])
    assert launch_module.worker_context().get_start_method() == "spawn"
    spawned = launch(job)
    assert spawned["max_abs"] == forked["max_abs"] and spawned["b"]["tp"] == forked["b"]["tp"] == 2
    assert not multiprocessing.active_children()


def test_the_command_leaves_no_process_behind(megatron_tp2, tmp_path):
    """`reshard verify --forward` (the console entry point, which leaves with os._exit) ends its worker server too:
    no process carrying this run's environment tag outlives the command. (Output to files, not pipes: a pipe
    would make the wait last until every process holding it had gone.)"""
    import os
    import subprocess
    import sys
    import uuid

    src, good = megatron_tp2
    tag = f"forward-{uuid.uuid4().hex[:8]}"
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.run([sys.executable, "-m", "reshard", "verify", "--forward", src, str(good), "--json"],
                              env={**os.environ, "RESHARD_TEST_TAG": tag}, stdout=out, stderr=err, timeout=300)
    assert proc.returncode == 0, (tmp_path / "err").read_text()
    assert json.loads((tmp_path / "out").read_text())["b"]["tp"] == 2
    assert processes_tagged(tag) == [], "a process started by the command outlived it"


def test_bf16_compute_uses_the_bf16_tolerance(tmp_path):
    """--compute-dtype bf16 runs both sides in bf16: the report says so, judges with the bf16 rule, and passes for
    an exact conversion (while still far from fp32-exact). A is the Megatron TP2 folder (run at its own degree)
    and B the HF source at TP1: an HF reference would be sliced at B's degree and round exactly as B does."""
    src = seeded_hf(tmp_path / "hf", "llama")
    reshard.convert(src, str(tmp_path / "m"), to="megatron", tp=2)
    r = verify_forward(str(tmp_path / "m"), src, compute_dtype="bf16")
    assert r["tolerance"]["basis"] == "bfloat16"
    assert r["ok"], r["problems"]
    assert r["argmax_agreement"] >= 0.99
    assert r["max_abs"] > 1e-4  # really computed in bf16: TP=1 and TP=2 round differently (fp32 gives ~1e-6)
