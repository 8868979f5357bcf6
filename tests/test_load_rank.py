"""``reshard.load_rank``: one parallel rank's tensors, built in memory, are exactly what ``reshard.convert`` writes
into that rank's file(s), and building them reads little more than the rank's share of the source.

What this file proves, each claim checked against files ``reshard.convert`` wrote to disk and read back with
safetensors / ``torch.load(weights_only=True)`` (never against load_rank's own planning):

1. Bit-exact rank views. From a position-coded Llama-family HF source (hidden 256, 8 heads, 4 KV heads, FFN 512,
   vocab 500 so Megatron and vLLM pad, 4 layers: every element distinct, so a misplaced row, head or tensor
   changes the bytes) and from a Megatron tp2 pp2 checkpoint converted from it, for vLLM tp1/2/4/8 (8 > the 4 KV
   heads: replicated KV heads) and tp2 with a ``max_shard_size`` that makes several parts per rank (the view is
   the union of the rank's parts, with or without the option), Megatron tp1/tp2/tp4/tp2 pp2, TensorRT-LLM tp2 and
   tp2 pp2, Meta tp2 and HF: the rank's file(s) are found by listing convert's output, and load_rank returns the
   same names and the same dtype, shape and bytes. Megatron ``_extra_state`` entries (None) are not tensors and
   are not in the view.
2. torch_dist: ``load_rank(to="torch_dist")`` equals ``load_rank(to="megatron")``, and equals the Megatron rank
   file of ``convert(convert(src, to="torch_dist"), to="megatron")`` at the same degrees.
3. Options are honoured as convert honours them: ``dtype`` ("bf16" and ``torch.bfloat16``) against
   ``convert(dtype="bf16")``; an fp16 cast that overflows is refused like convert refuses it, and with
   ``allow_cast_overflow=True`` equals convert's output; tied embeddings (Megatron's last stage gets its own
   ``output_layer``); a Mixtral Mixture of Experts at Megatron tp2 ep2, tp2 etp1 ep2, tp1 pp2 ep2 and vLLM tp2 with
   and without ``expert_parallel``; ``device``.
4. Refusals: ``to="hf"`` at tp or pp > 1 and every rank outside its degree raise ``reshard.PlanError``, and so
   does expert-parallel rank 1 of a layout without expert-parallel ranks (vLLM, TensorRT-LLM, Meta) instead of
   returning an empty view; load_rank writes nothing (the source folder and the working directory are
   unchanged).
5. Bytes read: on a ~286 MiB fp32 source, ``load_rank(tp=8, rank=3)`` for vLLM and Megatron reads (``rchar`` of
   /proc/self/io) at most 1.5x the bytes it returns and at most 25% of the source, and the vLLM view equals
   convert's rank-3 file.
"""

from __future__ import annotations

import math
import os
import re

import pytest
import torch
from safetensors import safe_open

import reshard
from checkpoints import hf_config, hf_tensor_shapes, make_hf, write_hf
from megatron_rules import load_rank as load_megatron_file

LLAMA = dict(hidden=256, heads=8, kv_heads=4, ffn=512, vocab=500, layers=4)


# ------------------------------------------------------------------------------------------------ reading files

def read_safetensors(paths) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in paths:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                assert name not in out, f"{name} stored twice ({path})"
                out[name] = f.get_tensor(name)
    return out


def read_megatron(path) -> dict[str, torch.Tensor]:
    """The module tensors of a Megatron rank file; its non-tensor entries must be ``_extra_state`` Nones."""
    model = load_megatron_file(path)["model"]
    others = {k: v for k, v in model.items() if not isinstance(v, torch.Tensor)}
    assert all(k.endswith("._extra_state") and v is None for k, v in others.items()), others
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


def megatron_folders(root) -> dict[tuple[int, ...], str]:
    """``mp_rank_TT[_PPP][_EEE]`` folders of the tracked iteration, by their numbers as written."""
    tracker = open(os.path.join(str(root), "latest_checkpointed_iteration.txt")).read().strip()
    it = os.path.join(str(root), "release" if tracker == "release" else f"iter_{int(tracker):07d}")
    out = {}
    for name in os.listdir(it):
        m = re.fullmatch(r"mp_rank_(\d{2})((?:_\d{3}){0,2})", name)
        if m:
            out[(int(m[1]), *(int(x) for x in m[2].split("_")[1:]))] = os.path.join(it, name)
    return out


def files_of_rank(out, to: str, tp=1, pp=1, ep=1, rank=0, pp_rank=0, ep_rank=0) -> dict[str, torch.Tensor]:
    """Every tensor of the file(s) ``convert`` wrote into ``out`` for one rank, found by listing ``out``."""
    names = os.listdir(out)
    if to == "vllm":  # model-rank-{r}-part-{k}.safetensors
        found = {}
        for n in names:
            m = re.fullmatch(r"model-rank-(\d+)-part-(\d+)\.safetensors", n)
            if m:
                found.setdefault(int(m[1]), []).append(n)
        assert set(found) == set(range(tp)), sorted(names)
        return read_safetensors(os.path.join(out, n) for n in sorted(found[rank]))
    if to == "trtllm":  # rank{pp_rank * tp + tp_rank}.safetensors
        found = {int(m[1]): n for n in names if (m := re.fullmatch(r"rank(\d+)\.safetensors", n))}
        assert set(found) == set(range(tp * pp)), sorted(names)
        return read_safetensors([os.path.join(out, found[pp_rank * tp + rank])])
    if to == "meta":  # consolidated.{r:02d}.pth
        found = {int(m[1]): n for n in names if (m := re.fullmatch(r"consolidated\.(\d{2})\.pth", n))}
        assert set(found) == set(range(tp)), sorted(names)
        state = torch.load(os.path.join(out, found[rank]), map_location="cpu", weights_only=True)
        assert all(isinstance(v, torch.Tensor) for v in state.values())
        return state
    if to == "hf":
        paths = sorted(os.path.join(out, n) for n in names if n.endswith(".safetensors"))
        assert paths, names
        return read_safetensors(paths)
    if to == "megatron":  # folder numbers: tp, then pp if pp > 1, then ep if ep > 1
        folders = megatron_folders(out)
        want_key = (rank, *([pp_rank] if pp > 1 else []), *([ep_rank] if ep > 1 else []))
        every = {(t, *([p] if pp > 1 else []), *([e] if ep > 1 else []))
                 for t in range(tp) for p in range(pp) for e in range(ep)}
        assert set(folders) == every, sorted(folders)
        return read_megatron(os.path.join(folders[want_key], "model_optim_rng.pt"))
    raise AssertionError(to)


def assert_bit_identical(got, want: dict[str, torch.Tensor], where: str) -> None:
    assert type(got) is dict, f"{where}: load_rank returned {type(got).__name__}"
    assert want, f"{where}: the reference rank file holds no tensors"
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    assert not missing and not extra, f"{where}: missing {missing[:5]} unexpected {extra[:5]}"
    for name, w in want.items():
        g = got[name]
        assert isinstance(g, torch.Tensor), f"{where}: {name} is {type(g).__name__}"
        assert g.device.type == "cpu", f"{where}: {name} on {g.device}"
        assert g.dtype == w.dtype and tuple(g.shape) == tuple(w.shape), \
            f"{where}: {name} {g.dtype} {tuple(g.shape)}, convert wrote {w.dtype} {tuple(w.shape)}"
        gb = g.contiguous().reshape(-1).view(torch.uint8)
        wb = w.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(gb, wb), f"{where}: {name} bytes differ from convert's file"


# ------------------------------------------------------------------------------------------------ fixtures

def write_int_coded(path, config: dict, shapes: dict[str, tuple[int, ...]]) -> str:
    """Write an HF checkpoint of fp32 tensors whose every element has a distinct bit pattern: element n of
    tensor i holds the bits of int32 ``i * stride + n`` (stride: the largest tensor's size rounded up to a power
    of two), all below 0x7f800000, so every value is finite and positive (no NaN, no inf)."""
    stride = 1 << max(math.prod(s) for s in shapes.values()).bit_length()
    assert len(shapes) * stride <= 0x7F800000
    tensors = {name: (torch.arange(math.prod(shape), dtype=torch.int32) + i * stride).view(torch.float32)
               .reshape(shape) for i, (name, shape) in enumerate(shapes.items())}
    return write_hf(path, config, tensors)


def mixtral(path) -> str:
    """A position-coded Mixtral (hidden 128, 8 heads, 2 KV heads, 2 layers, 4 experts of FFN 64, vocab 300),
    written in transformers' per-expert names (block_sparse_moe.gate / experts.{e}.w1 w3 w2)."""
    h, f, v, experts, layers, d = 128, 64, 300, 4, 2, 16
    config = hf_config(hidden=h, layers=layers, heads=8, kv_heads=2, ffn=f, vocab=v)
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=experts,
                  num_experts_per_tok=2)
    for key in ("attention_bias", "mlp_bias"):
        config.pop(key)
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (h, h),
                       p + "self_attn.k_proj.weight": (2 * d, h), p + "self_attn.v_proj.weight": (2 * d, h),
                       p + "self_attn.o_proj.weight": (h, h), p + "post_attention_layernorm.weight": (h,),
                       p + "block_sparse_moe.gate.weight": (experts, h)})
        for e in range(experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            shapes.update({q + "w1.weight": (f, h), q + "w3.weight": (f, h), q + "w2.weight": (h, f)})
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    return write_int_coded(path, config, shapes)


SOURCES = ("hf", "megatron", "tied", "mixtral")


class Outputs:
    """Sources built on first use and convert's outputs, each conversion made at most once."""

    def __init__(self, root):
        self.root = root
        self.sources: dict[str, str] = {}
        self.done: dict[tuple, str] = {}

    def source(self, name: str) -> str:
        if name not in self.sources:
            path = str(self.root / f"src_{name}")
            if name == "hf":
                make_hf(path, **LLAMA)
            elif name == "megatron":
                reshard.convert(self.source("hf"), path, to="megatron", tp=2, pp=2)
            elif name == "tied":
                make_hf(path, tied=True, **LLAMA)
            elif name == "mixtral":
                mixtral(path)
            else:
                raise AssertionError(name)
            self.sources[name] = path
        return self.sources[name]

    def convert(self, src: str, to: str, **kwargs) -> str:
        key = (src, to, tuple(sorted(kwargs.items(), key=lambda kv: kv[0])))
        if key not in self.done:
            dst = str(self.root / f"out{len(self.done)}")
            reshard.convert(self.source(src) if src in SOURCES else src, dst, to=to, **kwargs)
            self.done[key] = dst
        return self.done[key]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    return Outputs(tmp_path_factory.mktemp("load_rank"))


def ranks(*pairs):
    """(tp rank, pp rank) pairs; a bare int is a tp rank at stage 0."""
    return [p if isinstance(p, tuple) else (p, 0) for p in pairs]


# to, convert degrees/options, ranks to check
MATRIX = [
    ("vllm", dict(tp=1), ranks(0)),
    ("vllm", dict(tp=2), ranks(0, 1)),
    ("vllm", dict(tp=4), ranks(0, 1, 3)),
    ("vllm", dict(tp=8), ranks(0, 3, 7)),
    ("vllm", dict(tp=2, max_shard_size=300_000), ranks(0, 1)),
    ("megatron", dict(tp=1), ranks(0)),
    ("megatron", dict(tp=2), ranks(0, 1)),
    ("megatron", dict(tp=4), ranks(0, 2, 3)),
    ("megatron", dict(tp=2, pp=2), ranks((0, 0), (1, 0), (0, 1), (1, 1))),
    ("trtllm", dict(tp=2), ranks(0, 1)),
    ("trtllm", dict(tp=2, pp=2), ranks((0, 0), (0, 1), (1, 1))),
    ("meta", dict(tp=2), ranks(0, 1)),
    ("hf", dict(), ranks(0)),
]


def matrix_params():
    for src in ("hf", "megatron"):
        for to, kw, rs in MATRIX:
            for r, p in rs:
                label = "-".join(f"{k}{v}" for k, v in kw.items()) or "whole"
                yield pytest.param(src, to, kw, r, p, id=f"{src}->{to}-{label}-rank{r}-stage{p}")


# ------------------------------------------------------------------------------------------------ 1. the matrix

@pytest.mark.parametrize("src,to,kw,rank,pp_rank", list(matrix_params()))
def test_rank_view_is_convert_rank_file(outputs, src, to, kw, rank, pp_rank):
    out = outputs.convert(src, to, **kw)
    want = files_of_rank(out, to, tp=kw.get("tp", 1), pp=kw.get("pp", 1), rank=rank, pp_rank=pp_rank)
    got = reshard.load_rank(outputs.source(src), to, rank=rank, pp_rank=pp_rank, **kw)
    assert_bit_identical(got, want, f"{src}->{to} {kw} rank {rank} stage {pp_rank}")


def test_vllm_parts_union_without_the_shard_size(outputs):
    """The rank view is the union of every part; the parts are an on-disk split, so load_rank without
    max_shard_size returns the same tensors."""
    out = outputs.convert("hf", "vllm", tp=2, max_shard_size=300_000)
    for rank in (0, 1):
        parts = [n for n in os.listdir(out) if re.fullmatch(rf"model-rank-{rank}-part-\d+\.safetensors", n)]
        assert len(parts) >= 3, parts  # the case really has several parts per rank
        assert_bit_identical(reshard.load_rank(outputs.source("hf"), "vllm", tp=2, rank=rank),
                             files_of_rank(out, "vllm", tp=2, rank=rank), f"vllm tp2 rank {rank} no shard size")


def test_megatron_view_has_no_extra_state(outputs):
    """convert's Megatron files carry ``_extra_state`` entries; the view holds only the tensors."""
    out = outputs.convert("hf", "megatron", tp=2, pp=2)
    model = load_megatron_file(os.path.join(megatron_folders(out)[(1, 1)], "model_optim_rng.pt"))["model"]
    extra = [k for k in model if k.endswith("._extra_state")]
    assert extra
    got = reshard.load_rank(outputs.source("hf"), "megatron", tp=2, pp=2, rank=1, pp_rank=1)
    assert not set(extra) & set(got)
    assert set(got) == set(model) - set(extra)


# ------------------------------------------------------------------------------------------------ 2. torch_dist

@pytest.mark.parametrize("src", ["hf", "megatron"])
@pytest.mark.parametrize("kw,rank,pp_rank", [(dict(tp=2), 0, 0), (dict(tp=2), 1, 0), (dict(tp=2, pp=2), 1, 1),
                                             (dict(tp=2, pp=2), 0, 0)],
                         ids=["tp2-rank0", "tp2-rank1", "tp2-pp2-rank1-stage1", "tp2-pp2-rank0-stage0"])
def test_torch_dist_view(outputs, src, kw, rank, pp_rank):
    source = outputs.source(src)
    got = reshard.load_rank(source, "torch_dist", rank=rank, pp_rank=pp_rank, **kw)
    as_megatron = reshard.load_rank(source, "megatron", rank=rank, pp_rank=pp_rank, **kw)
    assert_bit_identical(got, as_megatron, "torch_dist view vs megatron view")
    dist = outputs.convert(src, "torch_dist", **kw)
    back = outputs.convert(dist, "megatron", **kw)  # read through reshard: torch_dist -> megatron, same degrees
    want = files_of_rank(back, "megatron", tp=kw["tp"], pp=kw.get("pp", 1), rank=rank, pp_rank=pp_rank)
    assert_bit_identical(got, want, f"{src}->torch_dist {kw} rank {rank} stage {pp_rank}")


def test_torch_dist_checkpoint_as_source(outputs):
    dist = outputs.convert("hf", "torch_dist", tp=2)
    for to, kw, rank in [("vllm", dict(tp=4), 2), ("megatron", dict(tp=1), 0)]:
        out = outputs.convert(dist, to, **kw)
        assert_bit_identical(reshard.load_rank(dist, to, rank=rank, **kw), files_of_rank(out, to, rank=rank, **kw),
                             f"torch_dist source -> {to} {kw} rank {rank}")


# ------------------------------------------------------------------------------------------------ 3. options

@pytest.mark.parametrize("dtype", ["bf16", torch.bfloat16], ids=["str", "torch"])
@pytest.mark.parametrize("to,kw,rank,pp_rank", [("vllm", dict(tp=2), 1, 0), ("megatron", dict(tp=2, pp=2), 0, 1),
                                                ("meta", dict(tp=2), 1, 0), ("hf", dict(), 0, 0)],
                         ids=["vllm-tp2-rank1", "megatron-tp2-pp2-stage1", "meta-tp2-rank1", "hf"])
def test_dtype_bf16(outputs, dtype, to, kw, rank, pp_rank):
    out = outputs.convert("hf", to, dtype="bf16", **kw)
    want = files_of_rank(out, to, tp=kw.get("tp", 1), pp=kw.get("pp", 1), rank=rank, pp_rank=pp_rank)
    assert any(t.dtype == torch.bfloat16 for t in want.values())
    got = reshard.load_rank(outputs.source("hf"), to, rank=rank, pp_rank=pp_rank, dtype=dtype, **kw)
    assert_bit_identical(got, want, f"hf->{to} bf16 {kw} rank {rank}")


def test_fp16_overflow_refused_like_convert_then_allowed(outputs, tmp_path):
    src = outputs.source("hf")  # position codes go up to ~39 * 2**17, far above fp16's largest finite 65504
    with pytest.raises(reshard.ReshardError) as by_convert:
        reshard.convert(src, str(tmp_path / "refused"), to="vllm", tp=2, dtype="fp16")
    with pytest.raises(reshard.ReshardError) as by_view:
        reshard.load_rank(src, "vllm", tp=2, rank=1, dtype="fp16")
    assert type(by_view.value) is type(by_convert.value)
    assert not (tmp_path / "refused").exists()
    out = outputs.convert("hf", "vllm", tp=2, dtype="fp16", allow_cast_overflow=True)
    want = files_of_rank(out, "vllm", tp=2, rank=1)
    assert any(torch.isinf(t).any() for t in want.values() if t.dtype == torch.float16)
    got = reshard.load_rank(src, "vllm", tp=2, rank=1, dtype="fp16", allow_cast_overflow=True)
    assert_bit_identical(got, want, "vllm tp2 fp16 allow_cast_overflow rank 1")


@pytest.mark.parametrize("to,kw,rank,pp_rank", [
    ("vllm", dict(tp=2), 1, 0), ("megatron", dict(tp=2), 1, 0), ("megatron", dict(tp=2, pp=2), 0, 0),
    ("megatron", dict(tp=2, pp=2), 1, 1), ("trtllm", dict(tp=2, pp=2), 1, 1), ("hf", dict(), 0, 0)],
    ids=["vllm-tp2-rank1", "megatron-tp2-rank1", "megatron-tp2-pp2-rank0-stage0", "megatron-tp2-pp2-rank1-stage1",
         "trtllm-tp2-pp2-rank1-stage1", "hf"])
def test_tied_embeddings(outputs, to, kw, rank, pp_rank):
    out = outputs.convert("tied", to, **kw)
    want = files_of_rank(out, to, tp=kw.get("tp", 1), pp=kw.get("pp", 1), rank=rank, pp_rank=pp_rank)
    got = reshard.load_rank(outputs.source("tied"), to, rank=rank, pp_rank=pp_rank, **kw)
    assert_bit_identical(got, want, f"tied {to} {kw} rank {rank} stage {pp_rank}")
    if to == "megatron" and kw.get("pp", 1) > 1 and pp_rank == 1:
        assert "output_layer.weight" in got  # the last stage holds its own copy of the tied embedding


@pytest.mark.parametrize("to,kw,picks", [
    ("megatron", dict(tp=2, ep=2), [(1, 0, 1), (0, 0, 0), (0, 0, 1)]),
    ("megatron", dict(tp=2, ep=2, etp=1), [(0, 0, 0), (1, 0, 1)]),
    ("megatron", dict(tp=1, pp=2, ep=2), [(0, 1, 1), (0, 0, 1), (0, 1, 0)]),
    ("vllm", dict(tp=2, expert_parallel=True), [(0, 0, 0), (1, 0, 0)]),
    ("vllm", dict(tp=2), [(1, 0, 0)]),
], ids=["megatron-tp2-ep2", "megatron-tp2-etp1-ep2", "megatron-tp1-pp2-ep2", "vllm-tp2-ep", "vllm-tp2"])
def test_mixture_of_experts(outputs, to, kw, picks):
    out = outputs.convert("mixtral", to, **kw)
    for rank, pp_rank, ep_rank in picks:
        want = files_of_rank(out, to, tp=kw["tp"], pp=kw.get("pp", 1), ep=kw.get("ep", 1), rank=rank,
                             pp_rank=pp_rank, ep_rank=ep_rank)
        assert any("expert" in k for k in want)
        got = reshard.load_rank(outputs.source("mixtral"), to, rank=rank, pp_rank=pp_rank, ep_rank=ep_rank, **kw)
        assert_bit_identical(got, want, f"mixtral {to} {kw} rank {rank} stage {pp_rank} ep {ep_rank}")


def test_device_places_the_tensors(outputs):
    got = reshard.load_rank(outputs.source("hf"), "vllm", tp=2, rank=1, device="meta")
    want = files_of_rank(outputs.convert("hf", "vllm", tp=2), "vllm", tp=2, rank=1)
    assert set(got) == set(want)
    for name, w in want.items():
        assert got[name].device.type == "meta"
        assert (got[name].dtype, tuple(got[name].shape)) == (w.dtype, tuple(w.shape)), name


# ------------------------------------------------------------------------------------------------ 4. refusals

@pytest.mark.parametrize("kw", [dict(tp=2, rank=0), dict(tp=2, rank=1), dict(pp=2, pp_rank=0), dict(pp=2, pp_rank=1),
                                dict(tp=4, rank=3)])
def test_hf_is_whole_model_only(outputs, kw):
    with pytest.raises(reshard.PlanError):
        reshard.load_rank(outputs.source("hf"), "hf", **kw)


@pytest.mark.parametrize("to,kw", [
    ("vllm", dict(tp=2, rank=2)), ("vllm", dict(tp=2, rank=-1)), ("vllm", dict(tp=1, rank=1)),
    ("megatron", dict(tp=2, pp=2, pp_rank=2)), ("megatron", dict(tp=2, pp=2, pp_rank=-1)),
    ("megatron", dict(tp=4, rank=4)), ("trtllm", dict(tp=2, pp=2, rank=2)), ("meta", dict(tp=2, rank=2)),
    ("hf", dict(rank=1)), ("torch_dist", dict(tp=2, rank=2)), ("megatron", dict(tp=2, rank=0, ep=2, ep_rank=2)),
])
def test_rank_outside_degree(outputs, to, kw):
    with pytest.raises(reshard.PlanError):
        reshard.load_rank(outputs.source("hf"), to, **kw)


def test_mixture_of_experts_ep_rank_outside_degree(outputs):
    with pytest.raises(reshard.PlanError):
        reshard.load_rank(outputs.source("mixtral"), "megatron", tp=2, ep=2, ep_rank=2)


@pytest.mark.parametrize("src,to", [("mixtral", "vllm"), ("hf", "vllm"), ("hf", "trtllm"), ("hf", "meta")])
def test_no_expert_parallel_rank_in_layouts_without_one(outputs, src, to):
    """vLLM, TensorRT-LLM and Meta files have no expert-parallel rank (convert writes the same files at ep=2 as at
    ep=1), so expert-parallel rank 1 names no file: a rank view must not come back silently empty."""
    with pytest.raises(reshard.PlanError):
        got = reshard.load_rank(outputs.source(src), to, tp=2, rank=0, ep=2, ep_rank=1)
        print(f"load_rank returned {len(got)} tensors")


def tree(path) -> dict[str, tuple[int, int]]:
    out = {}
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            p = os.path.join(root, n)
            st = os.stat(p)
            out[os.path.relpath(p, path)] = (st.st_size, st.st_mtime_ns)
    return out


def test_writes_nothing(outputs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sources = [outputs.source("hf"), outputs.source("megatron")]
    before = [tree(s) for s in sources]
    for src in sources:
        for to in ("vllm", "megatron", "torch_dist", "trtllm", "meta"):
            assert reshard.load_rank(src, to, tp=2, rank=1)
    assert [tree(s) for s in sources] == before
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------------------ 5. bytes read

BIG = dict(hidden=1024, heads=8, kv_heads=8, ffn=8192, vocab=8000, layers=2)


@pytest.fixture(scope="module")
def big_source(tmp_path_factory):
    config = hf_config(**BIG)
    path = str(tmp_path_factory.mktemp("load_rank_big") / "hf")
    write_int_coded(path, config, hf_tensor_shapes(config))
    size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".safetensors"))
    assert size >= 200 * 2**20
    return path, size


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
@pytest.mark.parametrize("to", ["vllm", "megatron"])
def test_reads_only_the_rank_share(big_source, tmp_path, to):
    src, size = big_source
    reshard.load_rank(src, to, tp=8, rank=0)  # warm-up: imports and first-use reads do not count
    start = rchar()
    got = reshard.load_rank(src, to, tp=8, rank=3)
    read = rchar() - start
    returned = sum(t.numel() * t.element_size() for t in got.values())
    where = f"{to} tp8 rank 3: read {read / 2**20:.1f} MiB for {returned / 2**20:.1f} MiB of {size / 2**20:.1f} MiB"
    # every returned element is a distinct source element (fp32 -> fp32, no padding on rank 3): a reading that
    # does not see these bytes would make the bounds below vacuous
    assert read >= 0.9 * returned, f"{where}: rchar does not count the reads"
    assert read <= 1.5 * returned, where
    assert read <= 0.25 * size, where
    if to == "vllm":
        out = str(tmp_path / "vllm_tp8")
        reshard.convert(src, out, to="vllm", tp=8)
        assert_bit_identical(got, files_of_rank(out, "vllm", tp=8, rank=3), where)
