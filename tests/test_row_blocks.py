"""Sub-tensor streaming: a tensor that goes through memory is written in row blocks of bounded bytes.

Proves:
1. A row block of a target tensor (``reshard.core.blocks.block``) holds exactly those rows of the tensor: for
   every tensor of several plans (row splits with vocab padding, qkv / gate_up packs, column slices of
   row-parallel weights, gathers of such slices from several rank files, Mixture-of-Experts experts), built by
   both readers (the torch one used for casts, and the byte gatherer), compared with rows of the whole tensor built
   the old way, on position-coded tensors.
2. Output bytes do not depend on the block size: every conversion below, run with a 4 KiB step (every buffered
   tensor crosses several blocks, the zip writers patch CRCs accumulated over blocks) and with an unbounded one
   (each tensor one block, the unchunked path), writes byte-identical trees; and the small step did stream
   tensors in several blocks.
3. The step buffer no longer grows with the tensor: for a model whose MLP weights are 64 MiB each, the largest
   step of the plan is at most the step budget (plus one row per file), where whole tensors needed 2x64 MiB.
"""

from __future__ import annotations

import filecmp
import os

import numpy as np
import pytest
import torch

import reshard
import reshard.execute as execute
import reshard.io.copy_ranges as copy_ranges_module
from checkpoints import make_hf
from reshard.conversion import make_plan
from reshard.core.blocks import block, row_blocks, splittable
from reshard.io.gather import Gatherer, direct
from reshard.io.partial import PartialFile
from reshard.layouts import open_checkpoint
from reshard.layouts.base import Options

LLAMA = dict(hidden=256, heads=8, kv_heads=4, ffn=512, vocab=500, layers=2)


def gpt2(path) -> str:
    """A position-coded GPT-2 (Conv1D weights stored ``[in, out]``, fused c_attn, biases, learned positions),
    written by transformers and then re-coded tensor by tensor."""
    import transformers
    from safetensors.torch import load_file, save_file

    from checkpoints import position_coded

    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=8, n_positions=32, n_inner=128, vocab_size=200)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    stored = load_file(file)
    save_file(position_coded({n: tuple(t.shape) for n, t in stored.items()}), file, metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from test_load_rank import mixtral

    root = tmp_path_factory.mktemp("blocks")
    hf = make_hf(root / "hf", **LLAMA)
    tied = make_hf(root / "tied", tie_word_embeddings=True, **LLAMA)
    moe = mixtral(root / "mixtral")
    made = {"hf": hf, "tied": tied, "mixtral": moe, "gpt2": gpt2(root / "gpt2")}
    execute.STEP_BYTES, saved = 1 << 40, execute.STEP_BYTES
    try:
        for name, src, kw in [("megatron", hf, dict(to="megatron", tp=2, pp=2)), ("vllm", hf, dict(to="vllm", tp=4)),
                              ("meta", hf, dict(to="meta", tp=2)), ("mixtral_vllm", moe, dict(to="vllm", tp=2)),
                              ("mixtral_vllm_ep", moe, dict(to="vllm", tp=2, expert_parallel=True)),
                              ("gpt2_megatron", made["gpt2"], dict(to="megatron", tp=2))]:
            reshard.convert(src, str(root / name), **kw)
            made[name] = str(root / name)
    finally:
        execute.STEP_BYTES = saved
    return made


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _gathered(tensor, files) -> bytes:
    dest = np.empty(tensor.nbytes, np.uint8)
    Gatherer(files).fill([(tensor, dest)])
    return dest.tobytes()


PLANS = [("hf", "megatron", dict(tp=4)), ("hf", "vllm", dict(tp=2)), ("megatron", "hf", {}),
         ("vllm", "megatron", dict(tp=2, pp=2)), ("mixtral", "megatron", dict(tp=2, ep=2)),
         ("mixtral", "vllm", dict(tp=2)), ("hf", "megatron", dict(tp=2, dtype="BF16")),
         ("hf", "meta", dict(tp=2)), ("meta", "hf", {}), ("meta", "vllm", dict(tp=4)),
         ("mixtral_vllm", "megatron", dict(tp=2, ep=2)), ("mixtral_vllm", "vllm", dict(tp=4)),
         ("mixtral_vllm_ep", "hf", {}), ("gpt2", "megatron", dict(tp=2)), ("gpt2_megatron", "hf", {})]


@pytest.mark.parametrize("src,to,kw", PLANS, ids=[f"{s}-{t}-{'-'.join(map(str, k.values()))}" for s, t, k in PLANS])
def test_a_block_is_those_rows_of_the_tensor(sources, src, to, kw):
    opts = Options(**kw)
    checked = 0
    with open_checkpoint(sources[src], opts) as source:
        plan, _ = make_plan(source, to, opts)
        for target in plan.files:
            for tensor in target.tensors:
                if not splittable(tensor):
                    continue
                whole = execute.assemble(tensor, source.files)
                rows = tensor.shape[0]
                head = max((abs(op.interleave) for op in tensor.reads), default=0) or 1  # blocks hold whole heads
                for r0, r1 in {(0, 1), (1, rows // 2 + 1), (rows // 3, rows - 1), (rows - 1, rows)}:
                    r0, r1 = r0 // head * head, -(-r1 // head) * head
                    if not r0 < r1:
                        continue
                    part = block(tensor, r0, r1)
                    assert tuple(part.shape) == (r1 - r0, *tensor.shape[1:])
                    want = _bytes(whole[r0:r1])
                    assert _bytes(execute.assemble(part, source.files)) == want, (target.path, tensor.name, r0, r1)
                    if direct(part, source.files):
                        assert _gathered(part, source.files) == want, (target.path, tensor.name, r0, r1)
                    checked += 1
    assert checked > 20


def test_row_blocks_cover_the_tensor_in_order(sources):
    opts = Options(tp=4)
    with open_checkpoint(sources["hf"], opts) as source:
        plan, _ = make_plan(source, "megatron", opts)
        tensor = max((t for f in plan.files for t in f.tensors if splittable(t)), key=lambda t: t.nbytes)
        blocks = row_blocks(tensor, tensor.nbytes // 5)
        assert len(blocks) >= 5 and all(b.nbytes <= tensor.nbytes // 5 for b in blocks)
        assert sum(b.shape[0] for b in blocks) == tensor.shape[0]
        joined = b"".join(_bytes(execute.assemble(b, source.files)) for b in blocks)
        assert joined == _bytes(execute.assemble(tensor, source.files))
        assert row_blocks(tensor, tensor.nbytes) == [tensor]


CONVERSIONS = [
    ("hf", "megatron", dict(tp=4)), ("hf", "megatron", dict(tp=2, pp=2, dtype="bf16")),
    ("hf", "vllm", dict(tp=2)), ("hf", "torch_dist", dict(tp=2)), ("hf", "trtllm", dict(tp=2, pp=2)),
    ("hf", "meta", dict(tp=2)), ("hf", "hf", dict(dtype="bf16")), ("tied", "megatron", dict(tp=2, pp=2)),
    ("megatron", "hf", {}), ("megatron", "megatron", dict(tp=4)), ("vllm", "hf", {}),
    ("vllm", "megatron", dict(tp=1)), ("mixtral", "megatron", dict(tp=2, ep=2)),
    ("mixtral", "vllm", dict(tp=2)), ("mixtral", "hf", dict(dtype="bf16")),
    ("meta", "hf", {}), ("meta", "megatron", dict(tp=2)), ("mixtral_vllm", "megatron", dict(tp=2, ep=2)),
    ("mixtral_vllm", "vllm", dict(tp=4)), ("mixtral_vllm_ep", "hf", {}), ("mixtral_vllm", "hf", dict(dtype="bf16")),
    ("gpt2", "megatron", dict(tp=2)), ("gpt2_megatron", "hf", {}), ("gpt2", "vllm", dict(tp=2)),
]


def _tree(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, files in os.walk(folder) for f in files)


@pytest.mark.parametrize("src,to,kw", CONVERSIONS,
                         ids=[f"{s}-{t}-{'-'.join(map(str, k.values()))}" for s, t, k in CONVERSIONS])
def test_output_bytes_do_not_depend_on_the_block_size(sources, tmp_path, monkeypatch, src, to, kw):
    """Where every buffered tensor of a conversion is copied file to file instead (``copy_ranges``), the pair is
    run again with those copies turned off, so that the blocks are streamed (the writers align copied records
    differently, so each pair is compared within itself)."""
    split = []
    original = PartialFile.write_block
    copy_ranges = execute.as_ranges

    def spy(self, name, data, total, first, last):
        if not (first and last):
            split.append(name)
        return original(self, name, data, total, first, last)

    monkeypatch.setattr(PartialFile, "write_block", spy)
    for ranges in (True, False):
        for module in (execute, copy_ranges_module):
            monkeypatch.setattr(module, "as_ranges", copy_ranges if ranges else lambda tensor, files: None)
        outputs = {}
        for step in (1 << 40, 4096):
            monkeypatch.setattr(execute, "STEP_BYTES", step)
            monkeypatch.setattr(execute, "TORCH_BYTES", step if step == 1 << 40 else 1024)  # casts in sub-blocks
            split.clear()
            outputs[step] = tmp_path / f"step-{step}-{ranges}"
            reshard.convert(sources[src], str(outputs[step]), to=to, workers=1, **kw)
            if step == 1 << 40:
                assert split == []  # unbounded: every tensor in one block, the unchunked path
        whole, blocked = outputs[1 << 40], outputs[4096]
        assert _tree(whole) == _tree(blocked)
        different = [f for f in _tree(whole) if not filecmp.cmp(whole / f, blocked / f, shallow=False)]
        assert different == []
        if split:
            break
    assert split, "the 4 KiB step streamed no tensor in blocks"


REORDERING = [("hf", "meta", dict(tp=2)), ("meta", "hf", {}), ("meta", "vllm", dict(tp=4)),
              ("mixtral", "vllm", dict(tp=2)), ("mixtral_vllm", "megatron", dict(tp=2, ep=2)),
              ("mixtral_vllm", "vllm", dict(tp=4)), ("mixtral_vllm_ep", "hf", {})]


def test_the_byte_gatherer_builds_reordering_reads(sources):
    """Interleaved-RoPE row orders (Meta's wq / wk) and blocks of stacked tensors (vLLM's experts, read or
    written) are byte moves: the torch-free gatherer builds every such tensor, whole and in row blocks, and its
    bytes equal the torch reader's."""
    kinds = {"interleave": 0, "src_block": 0, "dst_block": 0}
    for src, to, kw in REORDERING:
        opts = Options(**kw)
        with open_checkpoint(sources[src], opts) as source:
            plan, _ = make_plan(source, to, opts)
            for target in plan.files:
                for tensor in target.tensors:
                    found = [k for k in kinds if any(getattr(op, k) not in (None, 0) for op in tensor.reads)]
                    if not found:
                        continue
                    assert direct(tensor, source.files), (src, to, tensor.name)
                    pieces = [tensor] + row_blocks(tensor, max(1, tensor.nbytes // 3))
                    for piece in pieces:
                        want = _bytes(execute.assemble(piece, source.files))
                        assert _gathered(piece, source.files) == want, (src, to, tensor.name, piece.shape)
                    for k in found:
                        kinds[k] += 1
    assert all(kinds.values()), kinds


def test_reordering_conversions_do_not_import_torch(sources, tmp_path):
    """HF -> Meta (RoPE rows reordered) and Mixtral HF -> vLLM (experts stacked) run without torch (torch's
    import is seconds of a conversion's time)."""
    import subprocess
    import sys

    code = ("import sys, reshard; reshard.convert(sys.argv[1], sys.argv[3], to='meta', tp=2); "
            "reshard.convert(sys.argv[2], sys.argv[4], to='vllm', tp=2); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, sources["hf"], sources["mixtral"], str(tmp_path / "meta"),
                          str(tmp_path / "vllm")], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_blocked_zip_records_have_their_crc(sources, tmp_path, monkeypatch):
    """A Megatron rank file whose records were written in blocks (CRCs patched after the data) passes the zip
    format's CRC check (Python's zipfile, an independent reader), and its tensors are the source's."""
    import zipfile

    from megatron_rules import load_rank as load_megatron_file
    from safetensors.torch import load_file

    monkeypatch.setattr(execute, "STEP_BYTES", 4096)
    out = tmp_path / "meg"
    reshard.convert(sources["hf"], str(out), to="megatron", tp=2)
    path = out / "release" / "mp_rank_01" / "model_optim_rng.pt"
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None  # every record's CRC-32 matches its data
    hf = load_file(os.path.join(sources["hf"], "model.safetensors"))
    down = load_megatron_file(str(path))["model"]["decoder.layers.0.mlp.linear_fc2.weight"]
    assert torch.equal(down, hf["model.layers.0.mlp.down_proj.weight"][:, 256:])


def test_the_step_buffer_is_bounded_by_the_budget_not_the_tensor(tmp_path):
    """A model with 64 MiB MLP weights (hidden 1024, FFN 16384, fp32): megatron tp2 -> hf gathers each down_proj
    from two column slices. Whole tensors made a 64 MiB step; with a 4 MiB budget the largest step is 4 MiB plus
    at most one row per file."""
    src = make_hf(tmp_path / "hf", coded=False, hidden=1024, heads=8, kv_heads=8, ffn=16384, vocab=1000, layers=1)
    reshard.convert(src, str(tmp_path / "meg"), to="megatron", tp=2)
    opts = Options()
    with open_checkpoint(str(tmp_path / "meg"), opts) as source:
        plan, _ = make_plan(source, "hf", opts)
        largest = max(t.nbytes for f in plan.files for t in f.tensors)
        assert largest == 1024 * 16384 * 4
        for budget in (4 << 20, 1 << 40):
            steps = [step for f in plan.files for step in execute.unit_steps([f], source.files, budget)]
            biggest = max(execute._buffered(step) for step in steps)
            if budget == 1 << 40:
                assert biggest >= largest
            else:
                assert biggest <= budget + 16384 * 4 + 64


def _transposed_along_a_later_axis(tensor) -> bool:
    return tensor.axis >= 1 and any(op.transposed for op in tensor.reads)


@pytest.mark.parametrize("src,to,kw", PLANS, ids=[f"{s}-{t}-{'-'.join(map(str, k.values()))}" for s, t, k in PLANS])
def test_every_tensor_streams_in_bounded_blocks(sources, src, to, kw):
    """Every target tensor of the plan, cut for a budget of a quarter of its bytes, is those blocks in order
    (the torch reader, position-coded sources), each within the budget (or one head of rows, for Meta's
    interleaved wq / wk). Stacked experts are cut into whole experts, or rows of one expert; only a tensor
    read transposed along its dim 1 (GPT-2's Conv1D row-parallel weights) stays whole."""
    opts = Options(**kw)
    kinds = set()
    with open_checkpoint(sources[src], opts) as source:
        plan, _ = make_plan(source, to, opts)
        for target in plan.files:
            for tensor in target.tensors:
                if tensor.nbytes < 1024 or tensor.fill is not None:
                    continue
                budget = tensor.nbytes // 4
                blocks = row_blocks(tensor, budget)
                if len(blocks) == 1:
                    assert _transposed_along_a_later_axis(tensor), (target.path, tensor.name)
                    kinds.add("whole")
                    continue
                head = max(abs(op.interleave) for op in tensor.reads) if tensor.reads else 0
                one_head = head * tensor.nbytes // tensor.shape[0] if head else 0
                assert all(b.nbytes <= max(budget, one_head) for b in blocks), (target.path, tensor.name)
                joined = b"".join(_bytes(execute.assemble(b, source.files)) for b in blocks)
                assert joined == _bytes(execute.assemble(tensor, source.files)), (target.path, tensor.name)
                ops = tensor.reads
                kinds.update(k for k, hit in [("interleave", any(op.interleave for op in ops)),
                                              ("transposed", any(op.transposed for op in ops)),
                                              ("stacked source", any(op.src_block is not None for op in ops)),
                                              ("stacked target", any(op.dst_block is not None for op in ops)),
                                              ("within one expert", any(b.shape[0] == 1 and tensor.shape[0] > 1
                                                                        and len(b.shape) == 3 for b in blocks))]
                             if hit)
    expected = {"meta-hf": {"interleave"}, "hf-meta": {"interleave"}, "gpt2-megatron": {"transposed", "whole"},
                "gpt2_megatron-hf": {"transposed", "whole"},
                "mixtral-vllm": {"stacked target", "within one expert"},
                "mixtral_vllm-megatron": {"stacked source"}, "mixtral_vllm_ep-hf": {"stacked source"},
                "mixtral_vllm-vllm": {"stacked source", "stacked target", "within one expert"}}
    assert expected.get(f"{src}-{to}", set()) <= kinds
