"""Fixtures written by megatron-core itself in its default ``torch_dist`` format, checked against the format spec.

``mcore_dist_checkpoint(tmp_path_factory, tp, pp, tied=False, qkv_bias=False)`` runs
``tests/mcore_dist_harness.py save`` in a subprocess (megatron-core 0.16.1 ``dist_checkpointing.save`` on CPU over
gloo, as Megatron-LM's training loop calls it) and returns the folder::

    <folder>/latest_checkpointed_iteration.txt      "7"
    <folder>/iter_0000007/{metadata.json, common.pt, .metadata, __R_I.distcp}
    <folder>/reference.pt                            {"input_ids": [2, 16], "logits": [2, 16, 1000] fp32}

One folder per configuration and pytest session (treat it as read-only).  The same seed and flags give the same
logical model at any TP and PP.  ``mcore_dist_load(ckpt, out, tp=.., pp=..)`` runs ``... load``: megatron-core
loads a folder strictly (``dist_checkpointing.load`` + ``load_state_dict(strict=True)``) and returns its logits.

The tests here check only the fixtures (``/work/shared/layouts/torch-dist.md`` sections 1-3), never reshard:
files, ``metadata.json``, ``common.pt``, the keys, global shapes and chunks in ``.metadata`` (read with plain
``pickle``: these are files the test suite just wrote), that each ``.distcp`` file is tiled exactly by its
``torch.save`` records, and that megatron-core itself loads each folder back at TP=1 and reproduces the reference
logits (fp32, 1e-5).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import math
import os
import pickle
import pickletools
import re
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from _mcore_helpers import run_isolated

# Only look for megatron-core here: importing it registers numpy and Megatron classes as torch safe globals in
# this process, which would hide what a megatron-free reader meets.  The harness subprocesses import it.
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed (pip install 'reshard[test]')", allow_module_level=True)

HARNESS = Path(__file__).with_name("mcore_dist_harness.py")
ATOL = 1e-5

# Sizes of the harness model (tests/mcore_dist_harness.py).
L, H, NH, NG, D, FFN, V = 4, 64, 8, 2, 8, 160, 1000
ITERATION = 7
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
METADATA_JSON = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
EXTRA_STATE_MODULES = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)


# ---------------------------------------------------------------------------------------------------------------
# Running the harness


def _session_processes(sid: int) -> list[str]:
    """Live (non-zombie) processes of session ``sid``, as 'pid cmdline' strings."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:  # state, ppid, pgrp, session
            found.append(f"{entry} {cmd}")
    return found


def run_mcore_dist_harness(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """Run ``mcore_dist_harness.py ARGS`` in its own session; fail on error, timeout or a leftover process."""
    return run_harness(HARNESS, *args, timeout=timeout)


def run_harness(harness, *args, timeout: float) -> subprocess.CompletedProcess:
    """Run the megatron-core harness script ``harness`` with ``ARGS`` in its own session; fail on error, timeout
    or a process of it left behind (which is killed)."""
    cmd = [sys.executable, str(harness), *map(str, args)]

    def no_leftovers(proc) -> None:
        # multiprocessing's resource tracker exits on its own once the harness has; anything else is a leak.
        deadline = time.monotonic() + 10.0
        while (left := _session_processes(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if left:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            raise AssertionError(f"processes of {' '.join(cmd)} outlived it: {left}")

    return run_isolated(cmd, timeout, after=no_leftovers)


_SAVED: dict[tuple, Path] = {}


def mcore_dist_checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
    tp: int,
    pp: int,
    tied: bool = False,
    qkv_bias: bool = False,
    seed: int = 1234,
) -> Path:
    """A ``torch_dist`` checkpoint folder saved by megatron-core at TP ``tp`` x PP ``pp`` (once per session)."""
    key = (str(tmp_path_factory.getbasetemp()), tp, pp, tied, qkv_bias, seed)
    if key not in _SAVED:
        name = f"mcore_dist_tp{tp}_pp{pp}{'_tied' if tied else ''}{'_qkvbias' if qkv_bias else ''}_s{seed}"
        out = tmp_path_factory.mktemp(name)
        flags = ["--tp", tp, "--pp", pp, "--seed", seed]
        flags += ["--tied"] * tied + ["--qkv-bias"] * qkv_bias
        run_mcore_dist_harness("save", out, *flags)
        _SAVED[key] = out
    return _SAVED[key]


def mcore_dist_load(ckpt: Path, out: Path, tp: int, pp: int = 1, ids: Path | None = None) -> dict:
    """megatron-core loads ``ckpt`` strictly at TP ``tp`` x PP ``pp``: returns ``{"input_ids", "logits"}``."""
    extra = ["--ids", ids] if ids is not None else []
    run_mcore_dist_harness("load", ckpt, out, "--tp", tp, "--pp", pp, *extra)
    return torch.load(out, map_location="cpu", weights_only=True)


# ---------------------------------------------------------------------------------------------------------------
# Fixtures: one saved folder per configuration for this module

CASES = {
    # Spec run A: TP=2, untied, with the QKV bias.  Spec run B: PP=2 with tied embeddings.
    "tp2_qkvbias": dict(tp=2, pp=1, tied=False, qkv_bias=True),
    "pp2_tied": dict(tp=1, pp=2, tied=True, qkv_bias=False),
}


#: Both fixtures' self-checks run with ``-m slow`` (each saves with megatron-core: 34 s for tp2_qkvbias, about 40 s
#: for pp2_tied on two cores): they check the test data, not reshard, whose torch_dist tests on these fixtures
#: (tests/test_torch_dist_mcore.py) stay in the default suite.
@pytest.fixture(scope="module", params=[pytest.param("tp2_qkvbias", marks=pytest.mark.slow),
                                        pytest.param("pp2_tied", marks=pytest.mark.slow)])
def case(request, tmp_path_factory):
    cfg = CASES[request.param]
    return cfg, mcore_dist_checkpoint(tmp_path_factory, **cfg)


def _iter_dir(folder: Path) -> Path:
    return folder / f"iter_{ITERATION:07d}"


def _metadata(folder: Path):
    with open(_iter_dir(folder) / ".metadata", "rb") as f:
        return pickle.load(f)  # our own file: plain pickle is fine here (a reader must restrict it)


def _padded_vocab(tp: int) -> int:
    multiple = 128 * tp
    return (V + multiple - 1) // multiple * multiple


def expected_chunks(tp: int, pp: int, tied: bool, qkv_bias: bool) -> dict[str, tuple[tuple, set]]:
    """{DCP key: (global shape, {(offsets, sizes), ...})} as spec sections 2-3 say megatron writes them."""
    vp, qkv = _padded_vocab(tp), (NH + 2 * NG) * D

    def stacked(shape, axis=None):  # one [1, ...] chunk per (layer, TP shard); axis counts the layer axis
        chunks = set()
        for layer in range(L):
            for t in range(tp if axis else 1):
                offs, sizes = [layer] + [0] * len(shape), [1, *shape]
                if axis:
                    sizes[axis] = shape[axis - 1] // tp
                    offs[axis] = t * sizes[axis]
                chunks.add((tuple(offs), tuple(sizes)))
        return (L, *shape), chunks

    def vocab_rows():
        return (vp, H), {((t * vp // tp, 0), (vp // tp, H)) for t in range(tp)}

    fc1 = {((layer, half * FFN + t * FFN // tp, 0), (1, FFN // tp, H))
           for layer in range(L) for half in (0, 1) for t in range(tp)}  # [all gates; all ups]
    table = {
        "embedding.word_embeddings.weight": vocab_rows(),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": stacked((H,)),
        "decoder.layers.self_attention.linear_qkv.weight": stacked((qkv, H), axis=1),
        "decoder.layers.self_attention.linear_proj.weight": stacked((H, NH * D), axis=2),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": stacked((H,)),
        "decoder.layers.mlp.linear_fc1.weight": ((L, 2 * FFN, H), fc1),
        "decoder.layers.mlp.linear_fc2.weight": stacked((H, FFN), axis=2),
        "decoder.final_layernorm.weight": ((H,), {((0,), (H,))}),
    }
    if qkv_bias:
        table["decoder.layers.self_attention.linear_qkv.bias"] = stacked((qkv,), axis=1)
    if not tied:
        table["output_layer.weight"] = vocab_rows()
    return table


def expected_objects(tp: int, pp: int) -> set[str]:
    """BYTE_IO keys: ``_extra_state`` of the four local linears per layer (``shard_{layer}_{L}``) and one
    ``rng_state/shard_{pp}.{tp}_{PP}.{TP}`` per (PP, TP) rank."""
    objects = {f"decoder.layers.{m}._extra_state/shard_{layer}_{L}"
               for m in EXTRA_STATE_MODULES for layer in range(L)}
    objects |= {f"rng_state/shard_{p}.{t}_{pp}.{tp}" for p in range(pp) for t in range(tp)}
    return objects


RNG_KEYS = {"random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states"}


def _pickle_globals(record: io.BytesIO) -> set[str]:
    """The ``module.name`` globals a torch.save record's data.pkl references (torch.save: pickle protocol 2)."""
    with zipfile.ZipFile(record) as zf:
        data = zf.read(next(n for n in zf.namelist() if n.endswith("/data.pkl")))
    record.seek(0)
    return {arg.replace(" ", ".") for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}


# ---------------------------------------------------------------------------------------------------------------
# Tests


def test_folder_files_and_metadata_json(case):
    cfg, folder = case
    assert (folder / "latest_checkpointed_iteration.txt").read_text() == str(ITERATION)
    it = _iter_dir(folder)
    names = sorted(p.name for p in it.iterdir())
    data_files = [n for n in names if n.endswith(".distcp")]
    assert sorted(set(names) - set(data_files)) == [".metadata", "common.pt", "metadata.json"], names
    # __{global rank}_{i}.distcp, at most thread_count=2 per rank; every rank of this DP=1 run writes something.
    ranks = {int(m.group(1)) for m in (re.fullmatch(r"__(\d+)_([01])\.distcp", n) for n in data_files) if m}
    assert len(ranks) and all(re.fullmatch(r"__\d+_[01]\.distcp", n) for n in data_files), data_files
    assert ranks == set(range(cfg["tp"] * cfg["pp"])), data_files
    assert json.loads((it / "metadata.json").read_text()) == METADATA_JSON
    head = (it / ".metadata").read_bytes()[:2]
    assert head == bytes([0x80, pickle.DEFAULT_PROTOCOL]), head  # a plain pickle, not a torch.save zip


def test_common_pt_holds_megatron_lm_args(case):
    cfg, folder = case
    with torch.serialization.safe_globals([argparse.Namespace]):
        common = torch.load(_iter_dir(folder) / "common.pt", map_location="cpu", weights_only=True)
    assert set(common) == {"args", "checkpoint_version", "iteration", "num_floating_point_operations_so_far",
                           "content_metadata"}, sorted(common)
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == ITERATION
    assert common["content_metadata"] == CONTENT_METADATA
    args = common["args"]
    assert isinstance(args, argparse.Namespace)
    expected = dict(
        num_layers=L, hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=NH, group_query_attention=True,
        num_query_groups=NG, kv_channels=D, vocab_size=V, padded_vocab_size=_padded_vocab(cfg["tp"]),
        make_vocab_size_divisible_by=128, tensor_model_parallel_size=cfg["tp"],
        pipeline_model_parallel_size=cfg["pp"], swiglu=True, normalization="RMSNorm",
        position_embedding_type="rope", rotary_percent=1.0, add_bias_linear=False, add_qkv_bias=cfg["qkv_bias"],
        untie_embeddings_and_output_weights=not cfg["tied"], params_dtype=torch.float32, bf16=False, fp16=False,
        ckpt_format="torch_dist",
    )
    assert {k: getattr(args, k, "<absent>") for k in expected} == expected
    for k in ("norm_epsilon", "rotary_base", "max_position_embeddings", "seq_length"):
        assert hasattr(args, k), k


def test_dcp_metadata_keys_shapes_and_chunks(case):
    """Spec sections 1.3, 2 and 3: stacked layer keys, TE norm names, per-(layer, TP shard) chunks, fc1 as
    [all gates; all ups], no output layer when tied (any PP), objects as BYTE_IO, planner_data None."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    cfg, folder = case
    md = _metadata(folder)
    assert md.planner_data is None and md.version == "1.0.0"
    tensors = {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    objects = {k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    assert len(tensors) + len(objects) == len(md.state_dict_metadata)

    table = expected_chunks(**cfg)
    assert sorted(tensors) == sorted(table)
    for key, (shape, chunks) in table.items():
        meta = tensors[key]
        assert tuple(meta.size) == shape, (key, tuple(meta.size), shape)
        assert meta.properties.dtype == torch.float32, key
        got = {(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks}
        assert got == chunks and len(meta.chunks) == len(chunks), (key, sorted(got), sorted(chunks))
        assert sum(math.prod(s) for _, s in got) == math.prod(shape), key  # tiles the tensor exactly
    assert objects == expected_objects(cfg["tp"], cfg["pp"])

    # Every chunk and object has exactly one storage record.
    indexed = {(i.fqn, tuple(i.offset) if i.offset is not None else None) for i in md.storage_data}
    wanted = {(k, tuple(c.offsets)) for k, m in tensors.items() for c in m.chunks} | {(k, None) for k in objects}
    assert indexed == wanted and len(md.storage_data) == len(wanted)


def test_distcp_files_are_tiled_by_torch_save_records(case):
    """Spec 1.4/1.5: each file is back-to-back torch.save archives; a tensor record loads with weights_only to
    exactly its chunk; ``_extra_state`` payloads are one-element lists ``[None]``; rng_state needs numpy
    globals, so weights_only refuses it (a reader skips objects)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    cfg, folder = case
    it = _iter_dir(folder)
    md = _metadata(folder)
    by_file: dict[str, list] = {}
    for index, info in md.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((info.offset, info.length, index))
    assert sorted(by_file) == sorted(p.name for p in it.glob("*.distcp"))
    for name, records in by_file.items():
        blob = (it / name).read_bytes()
        records.sort(key=lambda r: r[0])
        end = 0
        for offset, length, index in records:
            assert offset == end, (name, offset, end)  # no header, gap or padding
            end = offset + length
            raw = io.BytesIO(blob[offset:end])
            meta = md.state_dict_metadata[index.fqn]
            if isinstance(meta, TensorStorageMetadata):
                tensor = torch.load(raw, map_location="cpu", weights_only=True)
                chunk = next(c for c in meta.chunks if tuple(c.offsets) == tuple(index.offset))
                assert tensor.shape == tuple(chunk.sizes) and tensor.dtype == meta.properties.dtype, index
                assert tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes, index
            elif "._extra_state/" in index.fqn:
                assert torch.load(raw, weights_only=True) == [None], index
            else:
                assert index.fqn.startswith("rng_state/"), index
                # numpy globals: refused by a plain weights_only load (this process may accept them anyway:
                # importing megatron.core registers them as safe globals), so read the pickle's globals.
                assert any(g.startswith("numpy") for g in _pickle_globals(raw)), index
                (state,) = torch.load(raw, weights_only=False)  # our own file
                assert set(state[0]) == RNG_KEYS, sorted(state[0])
        assert end == len(blob), (name, end, len(blob))


def test_megatron_core_loads_it_back_at_tp1(case, tmp_path):
    """megatron-core's own round trip: the folder loads strictly into a TP=1, PP=1 model (another TP and PP
    than the save) and reproduces the reference logits computed before saving."""
    cfg, folder = case
    ref = torch.load(folder / "reference.pt", map_location="cpu", weights_only=True)
    assert ref["input_ids"].shape == (2, 16) and int(ref["input_ids"].max()) < V
    assert ref["logits"].shape == (2, 16, V) and ref["logits"].dtype == torch.float32
    assert torch.isfinite(ref["logits"]).all()

    got = mcore_dist_load(folder, tmp_path / "logits.pt", tp=1, pp=1)
    assert torch.equal(got["input_ids"], ref["input_ids"])
    err = (got["logits"] - ref["logits"]).abs().max().item()
    assert err <= ATOL, f"{cfg}: TP=1 load of megatron-core's own save: max |logit diff| {err:.3g}"


#: For each fixture, a load at another TP *and* PP than the save (the writer side's checks will load at both).
CROSS = {"tp2_qkvbias": (1, 2), "pp2_tied": (2, 1)}


@pytest.mark.slow
def test_megatron_core_loads_it_back_crosswise_with_ids(case, tmp_path):
    """The same round trip at the other TP x PP of CROSS, with the ids passed by ``--ids`` (the way a folder
    without reference.pt, such as one reshard writes, is checked)."""
    cfg, folder = case
    tp, pp = next(v for k, v in CROSS.items() if CASES[k] == cfg)
    ref = torch.load(folder / "reference.pt", map_location="cpu", weights_only=True)
    ids = tmp_path / "ids.pt"
    torch.save(ref["input_ids"].flip(0).contiguous(), ids)  # other ids than reference.pt's: --ids wins
    got = mcore_dist_load(folder, tmp_path / "logits.pt", tp=tp, pp=pp, ids=ids)
    assert torch.equal(got["input_ids"], ref["input_ids"].flip(0))
    err = (got["logits"] - ref["logits"].flip(0)).abs().max().item()
    assert err <= ATOL, f"{cfg}: TP={tp} PP={pp} load of megatron-core's own save: max |logit diff| {err:.3g}"
