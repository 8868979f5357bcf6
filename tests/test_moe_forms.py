"""The other forms Mixture-of-Experts weights are stored in: transformers 5's fused experts, Megatron's
TEGroupedMLP names and the legacy GroupedMLP ``weight1`` / ``weight2`` memory views; and the forward verifier on
an expert swapped on one rank. The chains and the per-rank rules are in tests/test_moe.py."""

from __future__ import annotations

import argparse
import glob

import pytest
import torch
from safetensors import safe_open

from helpers import perturbed_model, run_cli
from reshard.io.torch_format import TorchFile

transformers = pytest.importorskip("transformers")

HIDDEN = 64


def _mixtral():
    return transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2, vocab_size=1003, max_position_embeddings=64)


def _qwen2_moe():
    return transformers.Qwen2MoeConfig(hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=2, num_experts=4,
                                       num_experts_per_tok=2, vocab_size=1003, max_position_embeddings=64,
                                       mlp_only_layers=[1])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_forms")
    out = {}
    for name, make in (("mixtral", _mixtral), ("qwen2_moe", _qwen2_moe)):
        model = perturbed_model(transformers, make())
        model.save_pretrained(root / name)
        model.save_pretrained(root / f"{name}_fused", save_original_format=False)
        out[name] = root / name
    return out


def _rank_states(folder) -> dict[str, dict]:
    states = {}
    for path in sorted(glob.glob(str(folder / "release" / "*" / "model_optim_rng.pt"))):
        with torch.serialization.safe_globals([argparse.Namespace]):
            states[path.split("/")[-2]] = torch.load(path, weights_only=True)
    return states


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_fused_hf_source_gives_the_same_megatron_bytes(models, capsys, tmp_path, family):
    """transformers 5's fused form on disk (mlp.experts.gate_up_proj [E, 2I, H] = per expert [gate; up],
    down_proj [E, H, I]; Mixtral's block_sparse_moe renamed mlp) converts to the same Megatron files, byte for
    byte, as the per-expert save of the same model."""
    fused = models[family].parent / f"{family}_fused"
    with safe_open(str(fused / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    for name, src in (("a", models[family]), ("b", fused)):
        code, _, err = run_cli(capsys, "convert", src, tmp_path / name, "--to", "megatron", "--tp", "2", "--ep", "2")
        assert code == 0, err
    a, b = _rank_states(tmp_path / "a"), _rank_states(tmp_path / "b")
    assert a.keys() == b.keys() == {"mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"}
    for folder in a:
        ma, mb = a[folder]["model"], b[folder]["model"]
        assert ma.keys() == mb.keys()
        for key, value in ma.items():
            assert (value is None and mb[key] is None) or torch.equal(value, mb[key]), (folder, key)


def test_te_grouped_mlp_names(models, capsys, tmp_path):
    """--moe-grouped-gemm writes TEGroupedMLP's linear_fc1.weight{j} / linear_fc2.weight{j} (same tensors as
    SequentialMLP's local_experts.{j}), records moe_grouped_gemm, and reads back bit-exact."""
    src = models["qwen2_moe"]
    assert run_cli(capsys, "convert", src, tmp_path / "seq", "--to", "megatron", "--tp", "2", "--ep", "2")[0] == 0
    assert run_cli(capsys, "convert", src, tmp_path / "grp", "--to", "megatron", "--tp", "2", "--ep", "2",
                   "--moe-grouped-gemm")[0] == 0
    seq, grp = _rank_states(tmp_path / "seq"), _rank_states(tmp_path / "grp")
    for folder in seq:
        assert grp[folder]["args"].moe_grouped_gemm is True and seq[folder]["args"].moe_grouped_gemm is False
        for j in range(2):
            for fc in ("linear_fc1", "linear_fc2"):
                assert torch.equal(seq[folder]["model"][f"decoder.layers.0.mlp.experts.local_experts.{j}.{fc}.weight"],
                                   grp[folder]["model"][f"decoder.layers.0.mlp.experts.{fc}.weight{j}"])
    assert run_cli(capsys, "verify", src, tmp_path / "grp")[0] == 0
    assert run_cli(capsys, "convert", tmp_path / "grp", tmp_path / "back", "--to", "hf")[0] == 0
    assert run_cli(capsys, "verify", src, tmp_path / "back")[0] == 0


def _to_legacy_grouped(folder) -> None:
    """Rewrite SequentialMLP rank files as legacy GroupedMLP's, by megatron-core's rule (moe.md 3.2):
    ``weight1 = stack([fc1_j.T for j]).reshape(H, -1)``, ``weight2 = stack([fc2_j.T for j]).reshape(-1, H)``."""
    for path in glob.glob(str(folder / "release" / "*" / "model_optim_rng.pt")):
        with torch.serialization.safe_globals([argparse.Namespace]):
            state = torch.load(path, weights_only=True)
        model = state["model"]
        for layer in (0, 1):
            prefix = f"decoder.layers.{layer}.mlp.experts."
            for fc, name, shape in (("linear_fc1", "weight1", (HIDDEN, -1)), ("linear_fc2", "weight2", (-1, HIDDEN))):
                keys = sorted((k for k in model if k.startswith(prefix + "local_experts.") and k.endswith(fc + ".weight")),
                              key=lambda k: int(k.split(".")[6]))
                if keys:
                    model[prefix + name] = torch.stack([model.pop(k).T for k in keys]).reshape(shape).contiguous()
        state["args"].moe_grouped_gemm = True
        state["args"].moe_use_legacy_grouped_gemm = True
        torch.save(state, path)


@pytest.mark.parametrize("degrees", [["--tp", "2", "--ep", "2"], ["--tp", "2", "--etp", "1", "--ep", "2"]])
def test_legacy_grouped_mlp_is_read_as_a_view(models, capsys, tmp_path, degrees):
    """weight1 [H, E_loc * 2I/etp] is megatron-core's view(E_loc, H, -1), block j = expert j's fc1 transposed:
    reshard reads it so (bit-exact with the source, and the forward pass equal); concatenating the experts'
    fc1 along a dim would be the known mistake (Megatron-LM #909)."""
    src = models["mixtral"]
    assert run_cli(capsys, "convert", src, tmp_path / "m", "--to", "megatron", *degrees)[0] == 0
    _to_legacy_grouped(tmp_path / "m")
    f = TorchFile(str(tmp_path / "m/release/mp_rank_00_000/model_optim_rng.pt"))
    assert "model/decoder.layers.0.mlp.experts.weight1" in f.tensors
    assert not any("local_experts" in k for k in f.tensors)
    f.close()
    code, out, err = run_cli(capsys, "verify", src, tmp_path / "m")
    assert code == 0, out + err
    assert run_cli(capsys, "verify", src, tmp_path / "m", "--forward")[0] == 0


def test_forward_names_the_layer_when_two_experts_are_swapped(models, capsys, tmp_path):
    src = models["mixtral"]
    assert run_cli(capsys, "convert", src, tmp_path / "m", "--to", "megatron", "--tp", "2", "--ep", "2")[0] == 0
    assert run_cli(capsys, "verify", src, tmp_path / "m", "--forward")[0] == 0
    path = tmp_path / "m/release/mp_rank_01_001/model_optim_rng.pt"
    with torch.serialization.safe_globals([argparse.Namespace]):
        state = torch.load(path, weights_only=True)
    key = "decoder.layers.1.mlp.experts.local_experts.{}.linear_fc1.weight"
    model = state["model"]
    model[key.format(0)], model[key.format(1)] = model[key.format(1)], model[key.format(0)]
    torch.save(state, path)
    code, out, err = run_cli(capsys, "verify", src, tmp_path / "m", "--forward")
    assert code == 1 and "layer 1 mlp" in out, out + err


def test_megatron_lm_folder_set_with_expert_tp_below_tp(models, capsys, tmp_path):
    """At tp 2, ep 2, expert-TP 1 (world 2) Megatron-LM saves only mp_rank_00_000 and mp_rank_01_001 (each rank
    its (dense tp, ep) folder, moe.md 3.1): together they hold every dense TP rank and every expert, so the
    checkpoint reads bit-exact and runs; without the ep 1 folder it is refused as incomplete."""
    import shutil

    src = models["mixtral"]
    assert run_cli(capsys, "convert", src, tmp_path / "m", "--to", "megatron", "--tp", "2", "--etp", "1",
                   "--ep", "2")[0] == 0
    for extra in ("mp_rank_00_001", "mp_rank_01_000"):
        shutil.rmtree(tmp_path / "m/release" / extra)
    assert run_cli(capsys, "verify", src, tmp_path / "m")[0] == 0
    assert run_cli(capsys, "verify", src, tmp_path / "m", "--forward")[0] == 0
    shutil.rmtree(tmp_path / "m/release/mp_rank_01_001")
    code, _, err = run_cli(capsys, "verify", src, tmp_path / "m")
    assert code == 2 and ("missing" in err or "incomplete" in err), err


@pytest.mark.parametrize("family", ["qwen2_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_forward_at_four_ranks_with_vllm_expert_parallel(models, capsys, tmp_path, family):
    """verify --forward at nproc 4: vLLM tp 4 with --expert-parallel (one whole expert per rank) against the HF
    source; each rank computes only the expert it holds."""
    src = models[family]
    assert run_cli(capsys, "convert", src, tmp_path / "v", "--to", "vllm", "--tp", "4", "--expert-parallel")[0] == 0
    code, out, err = run_cli(capsys, "verify", src, tmp_path / "v", "--forward")
    assert code == 0, out + err
