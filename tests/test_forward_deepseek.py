"""The forward check on DeepSeek-V2 / V3: the reference decoder's multi-head latent attention (naive, not absorbed)
and DeepSeek routing (sigmoid / softmax scores, selection bias, group-limited top-k, renormalisation, scaling,
shared experts, dense first layers) against transformers' own models, then ``verify --forward`` of an HF model
against its Megatron (TE and local spec), torch_dist and vLLM conversions at 2 ranks, and corrupted conversions
failing at the right layer. Tiny fp32 models made by transformers (tests/deepseek_checkpoints.py)."""

from __future__ import annotations

import argparse
import dataclasses
import glob
import math
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

import reshard
from deepseek_checkpoints import logits as transformers_logits
from deepseek_checkpoints import save_tiny
from reshard.layouts.base import Options
from reshard.verification.forward import forward_estimate, verify_forward
from reshard.verification.forward.decoder import TPGroup, cast_weights, forward
from reshard.verification.forward.job import open_rank_stream
from reshard.verification.forward.streamed import forward_streamed
from test_forward_streaming import WatchedStream

TOKENS = [3, 17, 5, 99, 42, 7, 64, 1, 88, 23, 120, 9, 54, 31, 77, 2]
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.707, mscale_all_dim=1.0,
            original_max_position_embeddings=16, beta_fast=32, beta_slow=1)
#: Direct decoder cases: the release shapes, plus group-limited routing where the group limit bites (4 groups of 2,
#: 2 kept) for V3's top-2-sum, 1 kept for V2's max group score (with k = 2 a max rule keeping 2 never bites), and a
#: yarn-scaled V3.
CASES = {
    "v3": ("v3", {}),
    "v3_groups": ("v3", dict(n_group=4, topk_group=2)),
    "v3_yarn": ("v3", dict(rope_parameters=YARN)),
    "v2_lite": ("v2", {}),
    "v2_group_limited": ("v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=1)),
}


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def reference_logits(folder: str, **config_changes) -> torch.Tensor:
    """The reference decoder's logits on TOKENS at TP 1 from the HF folder (no conversion), over the true vocab;
    ``config_changes`` alter its DecoderConfig (to show what the comparison is sensitive to)."""
    with open_rank_stream("hf", folder, 0, 1, Options()) as stream:
        weights = cast_weights(stream.load_all(), torch.float32, "cpu")
    weights.config = dataclasses.replace(weights.config, **config_changes)
    with torch.no_grad():
        out = forward(weights, torch.tensor([TOKENS]), TPGroup())
    return out.logits[0, :, :weights.config.vocab]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """case name -> (HF folder, transformers' logits on TOKENS)."""
    base = tmp_path_factory.mktemp("deepseek_tiny")
    out = {}
    for name, (kind, overrides) in CASES.items():
        folder = save_tiny(str(base / name), kind=kind, **overrides)
        out[name] = (folder, transformers_logits(folder, TOKENS))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_reference_decoder_gives_transformers_logits(tiny, case):
    folder, expected = tiny[case]
    got = reference_logits(folder)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-5, (got - expected).abs().max().item()


@pytest.mark.parametrize("case, change", [
    ("v3", dict(router_groups=1)),  # no group limit: V3's groups all kept here, so the logits must not move...
    ("v3_groups", dict(router_groups=1)),  # ...but with 2 of 4 groups kept they do
    ("v3_groups", dict(router_group_score="max")),
    ("v3", dict(router_renormalize=False)),
    ("v3", dict(router_scaling=1.0)),
    ("v3", dict(router_score="softmax")),
    ("v2_group_limited", dict(router_groups=1)),
    ("v3_yarn", dict(rope_scaling={**YARN, "mscale_all_dim": 0.0})),  # no mscale on the softmax scale
    ("v3_yarn", dict(rope_scaling=None)),
])
def test_each_routing_and_rope_feature_moves_the_logits(tiny, case, change):
    """The oracle comparison above is sensitive to every feature it claims to check: dropping one moves the logits
    far past the tolerance (except a group limit that keeps every group)."""
    folder, expected = tiny[case]
    error = (reference_logits(folder, **change) - expected).abs().max().item()
    if case == "v3" and change == dict(router_groups=1):
        assert error <= 1e-5
    else:
        assert error > 1e-3, (change, error)


def test_the_selection_bias_decides_the_choice_only(tiny):
    """Without V3's e_score_correction_bias the choice (and so the logits) changes; the bias never enters the
    weights (it would move them even where the choice is the same)."""
    folder, expected = tiny["v3"]
    with open_rank_stream("hf", folder, 0, 1, Options()) as stream:
        weights = cast_weights(stream.load_all(), torch.float32, "cpu")
    for layer in weights.layers:
        layer.router_bias = None if layer.router_bias is None else torch.zeros_like(layer.router_bias)
    with torch.no_grad():
        unbiased = forward(weights, torch.tensor([TOKENS]), TPGroup()).logits[0, :, :weights.config.vocab]
    assert (unbiased - expected).abs().max().item() > 1e-3


# ------------------------------------------------------------------ verify --forward over conversions, 2 ranks

CONVERSIONS = {
    "megatron_tp2_ep2": dict(to="megatron", tp=2, ep=2),
    "megatron_tp2_local": dict(to="megatron", tp=2, megatron_spec="local"),
    "torch_dist_tp2_ep2": dict(to="megatron", tp=2, ep=2, megatron_format="torch_dist"),
    "vllm_tp2": dict(to="vllm", tp=2),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """kind -> (HF folder, {conversion name: its folder}) for a tiny V3 (with its MTP layer) and a V2-Lite."""
    base = tmp_path_factory.mktemp("deepseek_converted")
    out = {}
    for kind in ("v3", "v2"):
        src = save_tiny(str(base / kind), kind=kind)
        done = {}
        for name, options in CONVERSIONS.items():
            reshard.convert(src, str(base / f"{kind}_{name}"), **options)
            done[name] = str(base / f"{kind}_{name}")
        out[kind] = (src, done)
    return out


@pytest.mark.parametrize("kind", ["v3", "v2"])
@pytest.mark.parametrize("conversion", list(CONVERSIONS))
def test_forward_check_passes_on_every_conversion(converted, kind, conversion):
    src, done = converted[kind]
    r = verify_forward(src, done[conversion], nproc=2)
    assert r["ok"], (r["problems"], r["first_divergence"])
    assert r["b"]["run_tp"] == 2 and r["a"]["run"].startswith("sliced at tp=2")
    assert r["max_abs"] <= 1e-4
    assert not r["problems"]
    mtp_note = "the 1 multi-token-prediction (MTP) layer was not run: the forward check runs the main model"
    assert (mtp_note in r["notes"]) == (kind == "v3"), r["notes"]  # V3's MTP layer, in A (and B where it holds one)


def _load(path):
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)


def _edit_rank_files(folder, names, edit):
    """Apply ``edit(model_dict)`` to each named rank file of a trusted test Megatron checkpoint."""
    for name in names:
        path = os.path.join(folder, "release", name, "model_optim_rng.pt")
        blob = _load(path)
        edit(blob["model"])
        torch.save(blob, path)


def test_two_swapped_experts_fail_naming_their_layer(converted, tmp_path):
    """Local experts 0 and 1 of layer 2 swapped in EP rank 0's folders (both TP halves): the same tensors, in the
    wrong places."""
    src, done = converted["v3"]
    bad = tmp_path / "bad"
    shutil.copytree(done["megatron_tp2_ep2"], bad)
    prefix = "decoder.layers.2.mlp.experts.local_experts"

    def swap(model):
        for part in ("linear_fc1", "linear_fc2"):
            a, b = f"{prefix}.0.{part}.weight", f"{prefix}.1.{part}.weight"
            model[a], model[b] = model[b], model[a]

    _edit_rank_files(bad, ["mp_rank_00_000", "mp_rank_01_000"], swap)
    r = verify_forward(src, str(bad), nproc=2)
    assert not r["ok"] and r["first_divergence"].startswith("layer 2 mlp"), r["first_divergence"]
    assert all(b["ok"] for b in r["blocks"][:5])  # embedding, layers 0 and 1, layer 2 attention


def test_two_swapped_kv_b_heads_fail_naming_their_layer(converted, tmp_path):
    """kv_b_proj heads 0 and 1 of layer 1 swapped on TP rank 0 of the local-spec conversion (its rows per head:
    qk_nope_head_dim + v_head_dim = 16)."""
    src, done = converted["v3"]
    bad = tmp_path / "bad"
    shutil.copytree(done["megatron_tp2_local"], bad)

    def swap(model):
        t = model["decoder.layers.1.self_attention.linear_kv_up_proj.weight"]
        t[:16], t[16:32] = t[16:32].clone(), t[:16].clone()

    _edit_rank_files(bad, ["mp_rank_00"], swap)
    r = verify_forward(src, str(bad), nproc=2)
    assert not r["ok"] and r["first_divergence"].startswith("layer 1 attention"), r["first_divergence"]
    assert all(b["ok"] for b in r["blocks"][:3])


# ------------------------------------------------------------------ streaming and the dry-run estimate

def test_streamed_run_is_the_in_memory_run_and_holds_two_layers_at_most(converted):
    src, _ = converted["v3"]
    ids = torch.tensor([TOKENS])
    with open_rank_stream("hf", src, 0, 1, Options()) as stream:
        whole = cast_weights(stream.load_all(), torch.float32, "cpu")
    with torch.no_grad():
        expected = forward(whole, ids, TPGroup())
    with open_rank_stream("hf", src, 0, 1, Options()) as stream, torch.no_grad():
        watched = WatchedStream(stream)
        got, _ = forward_streamed(watched, ids, TPGroup(), torch.float32, "cpu")
    assert torch.equal(got.logits, expected.logits)
    assert watched.reads == ["embedding", "layer 0", "layer 1", "layer 2", "layer 3", "head"]  # no MTP layer
    assert max(watched.alive_at_read) <= 1


def test_dry_run_counts_the_latent_attention_weights(tmp_path):
    """A (HF, sliced at 2) reads every main-model tensor once: q_a / kv_a, the router and every 1-D weight whole,
    every other matrix halved; B (Megatron local spec) every tensor of its own rank file, the down projections'
    row blocks included. B's weights peak is its two largest consecutive steps."""
    src = save_tiny(str(tmp_path / "hf"), kind="v3", mtp=False)
    reshard.convert(src, str(tmp_path / "m"), to="megatron", tp=2, megatron_spec="local")
    est = forward_estimate(src, str(tmp_path / "m"))
    whole = ("q_a_proj", "kv_a_proj_with_mqa", "mlp.gate.weight")
    read_a = sum(t.numel() * 4 // (1 if t.dim() == 1 or any(w in n for w in whole) else 2)
                 for n, t in load_file(f"{src}/model.safetensors").items())
    for rank, proc in enumerate(est["processes"]):
        assert proc["read_a"] == read_a
        model = _load(tmp_path / "m" / "release" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt")["model"]
        sizes = {k: v.numel() * v.element_size() for k, v in model.items() if isinstance(v, torch.Tensor)}
        assert any("linear_kv_down_proj" in k for k in sizes)
        assert proc["read_b"] == sum(sizes.values())
        layers = [sum(n for k, n in sizes.items() if re.match(rf"decoder\.layers\.{i}\.", k)) for i in range(4)]
        steps = [sizes["embedding.word_embeddings.weight"]] + layers + [
            sizes["output_layer.weight"] + sizes["decoder.final_layernorm.weight"]]
        assert proc["sides"]["B"]["weights"] == max(a + b for a, b in zip(steps, steps[1:]))


def test_dry_run_reads_each_vllm_tensor_once(converted):
    """vLLM's fused tensors (fused_qkv_a_proj, w13, gate_up_proj) serve several weights but are read once: B reads
    its rank files' tensors, all but the attention scales the decoder does not use."""
    from safetensors import safe_open

    src, done = converted["v3"]
    est = forward_estimate(src, done["vllm_tp2"])
    for rank, proc in enumerate(est["processes"]):
        stored = 0
        for path in sorted(glob.glob(os.path.join(done["vllm_tp2"], f"model-rank-{rank}-part-*.safetensors"))):
            with safe_open(path, "pt") as f:
                stored += sum(math.prod(f.get_slice(n).get_shape()) * 4 for n in f.keys() if not n.endswith("_scale"))
        assert proc["read_b"] == stored
