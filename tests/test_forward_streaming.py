"""The forward check streams each rank layer by layer: the streamed decoder gives the in-memory decoder's logits
bit for bit on every layout's rank reader, a rank holds at most two consecutive steps' weights, and a broken rank
file still fails naming its layer. Tiny seeded fp32 models, world 1 in process (the launcher has its own tests)."""

from __future__ import annotations

import argparse
import gc
import shutil
import weakref

import pytest
import torch

import reshard
from checkpoints import make_hf
from reshard.layouts.base import Options
from reshard.verification.forward import verify_forward
from reshard.verification.forward.decoder import TPGroup, cast_weights, forward
from reshard.verification.forward.job import open_rank_stream
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
