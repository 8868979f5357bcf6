"""Megatron torch_dist for Mixture-of-Experts models (Mixtral, Qwen2-MoE, Qwen3-MoE), read and written, without
megatron-core (its own saves and strict loads are in tests/test_torch_dist_moe_mcore.py).

Sources are tiny transformers models saved with ``save_pretrained`` whose every tensor is then replaced by
position-coded values (``checkpoints.position_coded``: element = tensor number * 2**17 + position), so a misplaced
expert, half or row changes the bytes. The expected torch_dist layout is written out here from
shared/layouts/deepseek-v3.md section 5 and what megatron-core 0.16.1 itself was seen to save (``sharded_state_dict``
of a Mixtral-like model: layers stacked when every layer is MoE, ``[L, E, 2I, H]`` experts with ``[gate; up]`` per
expert, ``_extra_state/shard_{l}.{g}_{L}.{E}``; per-layer keys ``[E, 2I, H]`` and ``shard_{g}_{E}`` when some layers
are dense) and read back with torch's own DCP reader, never with reshard.
"""

from __future__ import annotations

import io
import pickle

import pytest
import torch

import reshard
from checkpoints import load_hf_tensors, position_coded
from cli_inprocess import run_main

transformers = pytest.importorskip("transformers")

COMMON = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, vocab_size=1003,
              max_position_embeddings=128, num_experts_per_tok=2)
FAMILIES = {  # (config class, settings, expert names: gate, up, down; where the experts live)
    "mixtral": ("MixtralConfig", dict(COMMON, num_hidden_layers=2, intermediate_size=48, num_local_experts=4),
                ("w1", "w3", "w2"), "block_sparse_moe"),
    "qwen2_moe": ("Qwen2MoeConfig", dict(COMMON, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32,
                                         num_experts=4, shared_expert_intermediate_size=48, mlp_only_layers=[1]),
                  ("gate_proj", "up_proj", "down_proj"), "mlp"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(COMMON, num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32,
                                         num_experts=4, head_dim=16, norm_topk_prob=True),
                  ("gate_proj", "up_proj", "down_proj"), "mlp"),
}
E = 4


def make_hf(root, family: str):
    """A position-coded HF checkpoint of ``family`` (transformers' config and on-disk names)."""
    from safetensors.torch import save_file

    cls, settings, _, _ = FAMILIES[family]
    model = getattr(transformers, cls)(**settings)
    transformers.AutoModelForCausalLM.from_config(model).save_pretrained(root)
    names = load_hf_tensors(root)
    tensors = position_coded({k: tuple(v.shape) for k, v in sorted(names.items())})
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def convert(src, dst, *args):
    proc = run_main("convert", src, dst, *map(str, args))
    assert proc.returncode == 0, proc.stderr
    return dst


def assert_same(folder, tensors):
    out = load_hf_tensors(folder)
    assert sorted(out) == sorted(tensors)
    for name, value in tensors.items():
        assert out[name].dtype == value.dtype and torch.equal(out[name], value), name


def metadata(folder):
    with open(folder / "release" / ".metadata", "rb") as f:
        return pickle.load(f)  # our own output: plain pickle is fine here


def expected_experts(tensors, family: str) -> dict[str, torch.Tensor]:
    """The experts' global torch_dist tensors by the rules of the module docstring."""
    _, settings, (gate, up, down), where = FAMILIES[family]
    layers = settings["num_hidden_layers"]
    sparse = [i for i in range(layers) if i not in settings.get("mlp_only_layers", [])]

    def stack(i, fc):
        blocks = []
        for g in range(E):
            pre = f"model.layers.{i}.{where}.experts.{g}."
            blocks.append(torch.cat([tensors[pre + gate + ".weight"], tensors[pre + up + ".weight"]])
                          if fc == 1 else tensors[pre + down + ".weight"])
        return torch.stack(blocks)

    if sparse == list(range(layers)):  # stacked layers: [L, E, ...]
        return {f"decoder.layers.mlp.experts.experts.linear_fc{fc}.weight": torch.stack([stack(i, fc) for i in sparse])
                for fc in (1, 2)}
    return {f"decoder.layers.{i}.mlp.experts.experts.linear_fc{fc}.weight": stack(i, fc) for i in sparse
            for fc in (1, 2)}


def expected_expert_objects(family: str) -> set[str]:
    settings = FAMILIES[family][1]
    layers = settings["num_hidden_layers"]
    sparse = [i for i in range(layers) if i not in settings.get("mlp_only_layers", [])]
    if sparse == list(range(layers)):
        return {f"decoder.layers.mlp.experts.experts.linear_fc{fc}._extra_state/shard_{i}.{g}_{layers}.{E}"
                for i in sparse for g in range(E) for fc in (1, 2)}
    return {f"decoder.layers.{i}.mlp.experts.experts.linear_fc{fc}._extra_state/shard_{g}_{E}"
            for i in sparse for g in range(E) for fc in (1, 2)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            made[family] = (root, make_hf(root / "hf", family))
        return made[family]
    return get


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_torch_dist_hf_bit_exact_and_torch_reads_the_experts(family, sources):
    import torch.distributed.checkpoint as dcp

    root, tensors = sources(family)
    td = convert(root / "hf", root / "td", "--to", "torch_dist", "--tp", 2, "--etp", 1)
    meta = metadata(td)
    expected = expected_experts(tensors, family)
    for key, value in expected.items():
        got = meta.state_dict_metadata[key]
        assert tuple(got.size) == tuple(value.shape), key
        # one chunk per (layer, expert) and half (etp 1: gate, up whole), each [1, ..., rows, cols]
        assert all(c.sizes[:value.dim() - 2] == (1,) * (value.dim() - 2) for c in got.chunks), key
    state = {k: torch.empty_like(v) for k, v in expected.items()}
    dcp.load(state, checkpoint_id=str(td / "release"), no_dist=True)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    objects = {k for k, v in meta.state_dict_metadata.items() if not hasattr(v, "chunks")}
    assert expected_expert_objects(family) <= objects
    assert reshard.verify(str(root / "hf"), str(td)).equal
    assert_same(convert(td, root / "back", "--to", "hf"), tensors)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_torch_dist_through_megatron_tp2_ep2_and_back(family, sources):
    root, tensors = sources(family)
    td = root / "td_tp1"
    if not td.exists():
        convert(root / "hf", td, "--to", "torch_dist")
    m = convert(td, root / "m_tp2_ep2", "--to", "megatron", "--tp", 2, "--ep", 2)
    td2 = convert(m, root / "td2", "--to", "torch_dist")
    assert reshard.verify(str(td), str(td2)).equal and reshard.verify(str(m), str(td2)).equal
    assert_same(convert(td2, root / "hf2", "--to", "hf"), tensors)


def test_inspect_reports_the_experts(sources):
    root, _ = sources("qwen2_moe")
    td = convert(root / "hf", root / "td_inspect", "--to", "torch_dist", "--tp", 2, "--ep", 2)
    info = reshard.inspect(str(td))
    assert (info["layout"], info["experts"], info["moe_layers"]) == ("torch_dist", 4, 2)
    assert info["saved_degrees"] == {"tp": 2, "pp": 1, "ep": 2, "etp": 2}
    proc = run_main("inspect", td)
    assert proc.returncode == 0 and "4 per MoE layer" in proc.stdout, proc.stdout


def test_a_chunk_spanning_every_layer_and_expert(sources, tmp_path):
    """A third-party writer (torch's own dcp.save of whole global tensors): every key one chunk, the experts'
    spanning all layers and experts; read by slicing it."""
    import shutil

    import torch.distributed.checkpoint as dcp

    root, tensors = sources("mixtral")
    td = root / "td_tiling"
    if not td.exists():
        convert(root / "hf", td, "--to", "torch_dist", "--tp", 2)
    folder = td / "release"
    meta = metadata(td)
    shapes = {k: v for k, v in meta.state_dict_metadata.items() if hasattr(v, "chunks")}
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in shapes.items()}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    whole = tmp_path / "whole"
    (whole / "release").mkdir(parents=True)
    for name in ("common.pt", "metadata.json"):
        shutil.copy(folder / name, whole / "release" / name)
    shutil.copy(td / "latest_checkpointed_iteration.txt", whole)
    objects = {k.split("/shard_")[0] + "/" + k.split("/")[-1]: io.BytesIO(pickle.dumps(None))
               for k, v in meta.state_dict_metadata.items() if not hasattr(v, "chunks")}
    dcp.save({**state, **objects}, checkpoint_id=str(whole / "release"), no_dist=True)
    saved = metadata(whole).state_dict_metadata["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert [tuple(c.sizes) for c in saved.chunks] == [(2, E, 96, 64)]
    assert_same(convert(whole, tmp_path / "hf", "--to", "hf"), tensors)


def _rewrite_metadata(folder, drop):
    """Remove the ``.metadata`` entries ``drop(key, chunk offsets or None)`` selects (a lost rank's share)."""
    path = folder / "release" / ".metadata"
    meta = pickle.load(open(path, "rb"))
    for key, item in list(meta.state_dict_metadata.items()):
        if hasattr(item, "chunks"):
            item.chunks = [c for c in item.chunks if not drop(key, tuple(c.offsets))]
        elif drop(key, None):
            del meta.state_dict_metadata[key]
    meta.storage_data = {i: s for i, s in meta.storage_data.items()
                         if i.fqn in meta.state_dict_metadata and not drop(i.fqn, tuple(i.offset) if i.offset else None)}
    with open(path, "wb") as f:
        pickle.dump(meta, f)


FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
INCOMPLETE = {  # what is lost -> words the one-line error must hold
    "expert_chunk": (lambda key, off: key == FC1 and off is not None and off[:2] == (1, 2),
                     [f"'{FC1}' at [1, 2]", "missing"]),
    "extra_state": (lambda key, off: key == "decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_0.3_2.4",
                    ["'decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_0.3_2.4' is missing"]),
}


@pytest.mark.parametrize("case", sorted(INCOMPLETE))
def test_incomplete_moe_folder_is_refused(case, sources, tmp_path):
    import shutil

    root, _ = sources("mixtral")
    td = root / "td_tp1"
    if not td.exists():
        convert(root / "hf", td, "--to", "torch_dist")
    broken = tmp_path / "broken"
    shutil.copytree(td, broken)
    drop, words = INCOMPLETE[case]
    _rewrite_metadata(broken, drop)
    proc = run_main("convert", broken, tmp_path / "out", "--to", "hf")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert all(w in proc.stderr for w in words), proc.stderr
    assert not (tmp_path / "out").exists()
