"""Megatron torch_dist checkpoints (read): written with torch alone in every key scheme Megatron and NeMo use,
converted to every layout bit-exact; hostile and truncated files refused. megatron-core's own saves are in
tests/test_torch_dist_mcore.py."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

import reshard
from checkpoints import hf_config, hf_tensor_shapes, load_hf_tensors, position_coded
from cli_inprocess import run_main
from dcp_checkpoints import write_torch_dist
from reshard.errors import CheckpointError
from reshard.layouts import detect, open_checkpoint
from tree_snapshot import snapshot


def model(arch="LlamaForCausalLM", tied=False, seeded=False):
    config = hf_config(arch=arch, hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, layers=4, tied=tied)
    shapes = hf_tensor_shapes(config)
    if seeded:
        from checkpoints import seeded as seeded_tensors

        return config, seeded_tensors(shapes, 3)
    return config, position_coded(shapes)


def assert_hf_equal(path, tensors):
    out = load_hf_tensors(path)
    assert sorted(out) == sorted(tensors)
    for name, value in tensors.items():
        assert out[name].dtype == value.dtype and torch.equal(out[name], value), name


CASES = {
    "stacked_tp2": dict(),
    "stacked_tp4_two_layers_per_chunk": dict(tp=4, layers_per_chunk=2),
    "per_layer_split_fc1": dict(stacked=False, split_fc1=True),
    "per_layer": dict(stacked=False),
    "nemo_module_prefix": dict(prefix="module."),
    "one_file": dict(files=1, tp=1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_dist_to_hf_bit_exact(case, tmp_path):
    config, tensors = model()
    root = write_torch_dist(tmp_path / "td", config, tensors, **CASES[case])
    assert detect(root).name == "torch_dist"
    with open_checkpoint(root) as source:
        assert source.layout == "torch_dist" and source.model.meaning.vocab == 1000
    before = snapshot(root)
    result = reshard.convert(root, str(tmp_path / "hf"), to="hf")
    assert snapshot(root) == before  # the source is never modified
    assert any("_extra_state" in n for n in result.notes)
    assert_hf_equal(tmp_path / "hf", tensors)
    assert reshard.verify(root, str(tmp_path / "hf")).equal


@pytest.mark.parametrize("arch, tied", [("Qwen2ForCausalLM", True), ("LlamaForCausalLM", True)])
def test_tied_and_biases_through_every_layout(arch, tied, tmp_path):
    config, tensors = model(arch, tied)
    root = write_torch_dist(tmp_path / "td", config, tensors)
    reshard.convert(root, str(tmp_path / "m"), to="megatron", tp=2, pp=2)
    reshard.convert(str(tmp_path / "m"), str(tmp_path / "v"), to="vllm", tp=4)
    reshard.convert(str(tmp_path / "v"), str(tmp_path / "hf"), to="hf")
    assert_hf_equal(tmp_path / "hf", tensors)
    assert reshard.verify(root, str(tmp_path / "v")).equal


def test_inspect_and_forward_at_any_degree(tmp_path):
    config, tensors = model(seeded=True)
    root = write_torch_dist(tmp_path / "td", config, tensors, tp=2)
    info = json.loads(run_main("inspect", root, "--json").stdout)
    assert (info["layout"], info["saved_tp"], info["iteration"], info["padded_vocab_size"]) == \
        ("torch_dist", 2, "5", 1024)
    from checkpoints import write_hf

    hf = write_hf(tmp_path / "hf", config, tensors)
    for nproc in ("1", "4"):  # the data is global: any degree the heads allow
        proc = run_main("verify", "--forward", hf, root, "--nproc", nproc, "--json")
        assert proc.returncode == 0, proc.stderr + proc.stdout
        assert json.loads(proc.stdout)["b"]["layout"] == "torch_dist"


def test_iteration_folder_itself_is_a_source(tmp_path):
    config, tensors = model()
    root = write_torch_dist(tmp_path / "td", config, tensors)
    reshard.convert(os.path.join(root, "iter_0000005"), str(tmp_path / "hf"), to="hf")
    assert_hf_equal(tmp_path / "hf", tensors)


class _System:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("payload", ["os.system", "builtins.eval"])
def test_hostile_metadata_is_refused_and_nothing_runs(payload, tmp_path):
    config, tensors = model()
    root = write_torch_dist(tmp_path / "td", config, tensors)
    marker = tmp_path / "pwned"
    evil = _System()
    evil.marker = marker
    obj = evil if payload == "os.system" else eval  # noqa: S307  (pickled by reference, never called here)
    with open(os.path.join(root, "iter_0000005", ".metadata"), "wb") as f:
        pickle.dump(obj, f)
    before = snapshot(root)
    proc = run_main("convert", root, tmp_path / "out", "--to", "hf")
    named = {"os.system": "posix.system", "builtins.eval": "builtins.eval"}[payload]  # os.system pickles as posix
    assert proc.returncode == 2 and f"refusing to unpickle global '{named}'" in proc.stderr, proc.stderr
    assert not marker.exists() and not (tmp_path / "out").exists() and snapshot(root) == before


def test_truncated_distcp_is_refused(tmp_path):
    config, tensors = model()
    root = write_torch_dist(tmp_path / "td", config, tensors)
    path = os.path.join(root, "iter_0000005", "__0_1.distcp")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    proc = run_main("convert", root, tmp_path / "out", "--to", "hf")
    assert proc.returncode == 2 and "truncated" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_missing_and_wrong_backend(tmp_path):
    config, tensors = model()
    root = write_torch_dist(tmp_path / "td", config, tensors)
    meta = os.path.join(root, "iter_0000005", "metadata.json")
    json.dump({"sharded_backend": "zarr"}, open(meta, "w"))
    with pytest.raises(CheckpointError, match="sharded_backend is 'zarr'"):
        open_checkpoint(root)


def test_older_megatron_core_metadata_classes(tmp_path):
    """megatron-core <= 0.15 pickled its own MCoreMetadata (with mcore_data) and MCoreSavePlan objects: read with
    inert stand-ins, without megatron installed."""
    from torch.distributed.checkpoint.planner import SavePlan

    config, tensors = model()
    root = write_torch_dist(tmp_path / "td", config, tensors)
    path = os.path.join(root, "iter_0000005", ".metadata")
    meta = pickle.load(open(path, "rb"))  # our own test file
    meta.mcore_data = {"x": {"nd_reformulated_orig_global_shape": (1, 2)}}
    meta.all_local_plans = [SavePlan([])]
    data = pickle.dumps(meta, protocol=2)
    for old, new in ((b"ctorch.distributed.checkpoint.metadata\nMetadata\n",
                      b"cmegatron.core.dist_checkpointing.strategies.torch\nMCoreMetadata\n"),
                     (b"ctorch.distributed.checkpoint.planner\nSavePlan\n",
                      b"cmegatron.core.dist_checkpointing.strategies.torch\nMCoreSavePlan\n")):
        assert old in data
        data = data.replace(old, new)
    open(path, "wb").write(data)
    reshard.convert(root, str(tmp_path / "hf"), to="hf")
    assert_hf_equal(tmp_path / "hf", tensors)
