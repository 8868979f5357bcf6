"""The forward check streams each rank layer by layer: the streamed decoder gives the in-memory decoder's logits
bit for bit on every layout's rank reader, a rank holds at most two consecutive steps' weights, a broken rank
file still fails naming its layer; A is sliced at B's degree where its layout allows; the dry-run estimate counts
each process's reads. Tiny seeded fp32 models."""

from __future__ import annotations

import argparse
import gc
import shutil
import weakref
from types import SimpleNamespace

import pytest
import torch

import reshard
from checkpoints import make_hf
from reshard.layouts.base import Options
from reshard.verification.forward import format_report, forward_estimate, verify_forward
from reshard.verification.forward.decoder import TPGroup, cast_weights, forward
from reshard.verification.forward.job import open_rank_stream
from reshard.verification.forward.planning import a_side
from reshard.verification.forward.rank_weights import DecoderConfig
from reshard.verification.forward.streamed import forward_streamed

LAYERS = 3
IDS = torch.randint(0, 1000, (2, 10), generator=torch.Generator().manual_seed(7))


def seeded_hf(path, **extra):
    settings = dict(coded=False, seed=3, hidden=64, layers=LAYERS, heads=8, ffn=96, vocab=1000,
                    arch="LlamaForCausalLM", kv_heads=2)
    return make_hf(path, **{**settings, **extra})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One tiny model in every layout the forward check reads, each at TP 1 (pp 3 for Megatron: three files)."""
    base = tmp_path_factory.mktemp("fwd_stream")
    src = seeded_hf(base / "hf")
    tied = seeded_hf(base / "tied", arch="Qwen2ForCausalLM", tied=True)
    out = {"hf": ("hf", src), "hf_tied": ("hf", tied)}
    for name, to, source, kw in [("megatron_pp3", "megatron", src, {"pp": 3}), ("megatron_tied", "megatron", tied, {}),
                                 ("vllm", "vllm", src, {}), ("trtllm", "trtllm", src, {})]:
        reshard.convert(source, str(base / name), to=to, tp=1, **kw)
        out[name] = (to, str(base / name))
    return out


@pytest.mark.parametrize("name", ["hf", "hf_tied", "megatron_pp3", "megatron_tied", "vllm", "trtllm"])
def test_streamed_logits_are_the_in_memory_logits_bit_for_bit(checkpoints, name):
    layout, path = checkpoints[name]
    with open_rank_stream(layout, path, 0, 1, Options()) as stream:
        whole = cast_weights(stream.load_all(), torch.float32, "cpu")
    with torch.no_grad():
        expected = forward(whole, IDS, TPGroup())
    with open_rank_stream(layout, path, 0, 1, Options()) as stream, torch.no_grad():
        got, stored = forward_streamed(stream, IDS, TPGroup(), torch.float32, "cpu")
    assert stored == torch.float32
    assert torch.equal(got.logits, expected.logits)
    assert [n for n, _ in got.states] == [n for n, _ in expected.states]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got.states, expected.states))


class WatchedStream:
    """A rank stream wrapper that records, at every read, how many layers read before are still alive."""

    def __init__(self, stream):
        self.stream, self.alive_at_read, self.reads = stream, [], []
        self._layers: list[weakref.ref] = []

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def _note(self, what):
        gc.collect()
        self.alive_at_read.append(sum(ref() is not None for ref in self._layers))
        self.reads.append(what)

    def embedding(self):
        self._note("embedding")
        return self.stream.embedding()

    def layer(self, index):
        self._note(f"layer {index}")
        layer = self.stream.layer(index)
        self._layers.append(weakref.ref(layer))
        return layer

    def head(self):
        self._note("head")
        return self.stream.head()


@pytest.mark.parametrize("name", ["hf", "megatron_pp3"])
def test_a_rank_holds_at_most_the_layer_it_computes_while_the_next_is_read(checkpoints, name):
    layout, path = checkpoints[name]
    with open_rank_stream(layout, path, 0, 1, Options()) as stream, torch.no_grad():
        watched = WatchedStream(stream)
        forward_streamed(watched, IDS, TPGroup(), torch.float32, "cpu")
    assert watched.reads == ["embedding"] + [f"layer {i}" for i in range(LAYERS)] + ["head"]
    # when layer i+1 (or the head) is read, at most layer i is still held: two layers at once, never more
    assert max(watched.alive_at_read) <= 1 and watched.alive_at_read[:2] == [0, 0]


def _swap_heads_in_rank_file(path, layer: int, head_dim: int):
    """Swap query heads 0 and 1 of ``layer`` in a trusted test rank file (its first KV group's rows)."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        blob = torch.load(path, map_location="cpu", weights_only=True)
    t = blob["model"][f"decoder.layers.{layer}.self_attention.linear_qkv.weight"]
    t[:head_dim], t[head_dim:2 * head_dim] = t[head_dim:2 * head_dim].clone(), t[:head_dim].clone()
    torch.save(blob, path)


def test_swapped_heads_in_one_rank_file_fail_naming_the_layer(tmp_path):
    src = seeded_hf(tmp_path / "hf")
    reshard.convert(src, str(tmp_path / "m"), to="megatron", tp=2)
    good = verify_forward(src, str(tmp_path / "m"))
    assert good["ok"], good["problems"]
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "m", bad)
    _swap_heads_in_rank_file(bad / "release" / "mp_rank_01" / "model_optim_rng.pt", layer=1, head_dim=8)
    r = verify_forward(src, str(bad))
    assert not r["ok"] and r["first_divergence"].startswith("layer 1 attention"), r["first_divergence"]
    assert [b["ok"] for b in r["blocks"][:3]] == [True, True, True]  # embedding, layer 0 attention and mlp


# ------------------------------------------------------------------ how A runs: sliced at B's degree by default

def test_hf_reference_is_sliced_at_b_degree_and_says_so(tmp_path):
    src = seeded_hf(tmp_path / "hf")
    reshard.convert(src, str(tmp_path / "m"), to="megatron", tp=2)
    r = verify_forward(src, str(tmp_path / "m"))
    assert r["ok"], r["problems"]
    assert (r["a"]["tp"], r["a"]["run_tp"], r["b"]["run_tp"]) == (1, 2, 2)  # tp: the layout's own degree
    assert r["a"]["run"].startswith("sliced at tp=2")
    assert format_report(r).splitlines()[1].startswith("  A runs sliced at tp=2")


def test_a_with_rank_files_runs_them_at_its_own_degree(tmp_path):
    src = seeded_hf(tmp_path / "hf")
    reshard.convert(src, str(tmp_path / "m"), to="megatron", tp=2)
    r = verify_forward(str(tmp_path / "m"), src)  # B (HF) at its own tp=1
    assert r["ok"], r["problems"]
    assert (r["a"]["tp"], r["a"]["run_tp"], r["b"]["run_tp"]) == (2, 2, 1)
    assert r["a"]["run"] == "from its own megatron rank files at tp=2"


def test_a_that_cannot_be_sliced_runs_in_one_process_and_says_why():
    """An expert width that does not divide by the degree: A falls back to one process (layer by layer)."""
    config = DecoderConfig(hidden=64, heads=8, kv_heads=2, head_dim=8, layers=2, vocab=1000, eps=1e-6,
                           rope_theta=1e4)
    meaning = SimpleNamespace(ffn=96, expert_ffn=30, shared_expert_ffn=0)
    degree, how = a_side("hf", 1, meaning, config, 4)
    assert degree == 1 and how.startswith("whole in one process") and "expert intermediate size 30" in how
    assert a_side("hf", 1, SimpleNamespace(ffn=96, expert_ffn=0, shared_expert_ffn=0), config, 4)[0] == 4


# ------------------------------------------------------------------ dry-run estimate, from headers only

def _state_bytes(path) -> dict[str, int]:
    """Bytes of every tensor of a trusted test Megatron rank file's model dict."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        model = torch.load(path, map_location="cpu", weights_only=True)["model"]
    return {k: v.numel() * v.element_size() for k, v in model.items() if isinstance(v, torch.Tensor)}


def test_forward_estimate_counts_each_process_reads_and_its_largest_two_steps(tmp_path):
    from safetensors.torch import load_file

    src = seeded_hf(tmp_path / "hf")  # fp32, vocab 1000 (even: no padding row at tp 2)
    reshard.convert(src, str(tmp_path / "m"), to="megatron", tp=2)
    est = forward_estimate(src, str(tmp_path / "m"))
    hf = load_file(f"{src}/model.safetensors")
    # A sliced at tp 2: every matrix (q, k, v, o, gate, up, down, embedding, lm_head) is halved, the norms whole
    read_a = sum(t.numel() * 4 // (2 if t.dim() == 2 else 1) for t in hf.values())
    assert [p["read_a"] for p in est["processes"]] == [read_a, read_a]
    for rank, proc in enumerate(est["processes"]):
        sizes = _state_bytes(tmp_path / "m" / "release" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt")
        assert proc["read_b"] == sum(sizes.values())  # every tensor of its own file, once
        layer = [sum(n for k, n in sizes.items() if k.startswith(f"decoder.layers.{i}.")) for i in range(LAYERS)]
        embedding = sizes["embedding.word_embeddings.weight"]
        head = sizes["output_layer.weight"] + sizes["decoder.final_layernorm.weight"]
        steps = [embedding] + layer + [head]  # fp32 stored and computed: held = read
        assert proc["sides"]["B"]["weights"] == max(a + b for a, b in zip(steps, steps[1:]))
        parts = proc["peak_parts"]
        assert proc["peak_estimate"] == parts["baseline"] + parts["weights"] + parts["activations"] + parts["logits"]
    assert est["a_run_tp"] == est["b_tp"] == 2 and (est["layout_a"], est["layout_b"]) == ("hf", "megatron")


def test_bf16_compute_is_really_bf16_when_the_degrees_differ(tmp_path):
    """With A sliced at B's degree, an HF -> Megatron pair runs the same arithmetic on both sides; the rounding of
    bf16 compute shows where the degrees differ (Megatron tp=2 as A, its HF source at tp=1 as B)."""
    src = seeded_hf(tmp_path / "hf")
    reshard.convert(src, str(tmp_path / "m"), to="megatron", tp=2)
    exact = verify_forward(str(tmp_path / "m"), src)
    rounded = verify_forward(str(tmp_path / "m"), src, compute_dtype="bf16")
    assert exact["ok"] and rounded["ok"] and rounded["tolerance"]["basis"] == "bfloat16"
    assert exact["max_abs"] < 1e-5 < 1e-4 < rounded["max_abs"]
