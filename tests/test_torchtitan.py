"""The torchtitan layout against torch's own FSDP2 + DCP checkpoints (fsdp_worker.py) and torch's own dcp.load.

Expected tensors come from the spec's name table (training-frameworks.md §3.3) and torchtitan's RoPE row
permutation written out here, not from reshard's code."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from checkpoints import load_hf_tensors, make_hf
from fsdp_checkpoints import LLAMA, QWEN3, fsdp_checkpoints, hf_logits, titan_logits, trained
from helpers import run_cli
from reshard.errors import CheckpointError
from reshard.layouts.base import Options
from reshard.layouts.registry import detect, open_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    return fsdp_checkpoints(tmp_path_factory)


def interleaved_to_halves(w: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """torchtitan's llama3 ``to_hf`` permutation: row 2i+j of a head -> row j*d/2+i."""
    return w.view(heads, d // 2, 2, w.shape[1]).transpose(1, 2).reshape(heads * d, w.shape[1])


def halves_to_interleaved(w: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    return w.view(heads, 2, d // 2, w.shape[1]).transpose(1, 2).reshape(heads * d, w.shape[1])


def titan_table(layers: int, spelling: str, qk_norm: bool = False) -> dict[str, str]:
    """HF name -> torchtitan name, from the spec's table (§3.3)."""
    qkv = "attention.qkv_linear." if spelling == "current" else "attention."
    table = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
             "lm_head.weight": "lm_head.weight" if spelling == "current" else "output.weight"}
    for i in range(layers):
        h, t = f"model.layers.{i}.", f"layers.{i}."
        table.update({h + "self_attn.q_proj.weight": t + qkv + "wq.weight", h + "self_attn.k_proj.weight": t + qkv + "wk.weight",
                      h + "self_attn.v_proj.weight": t + qkv + "wv.weight", h + "self_attn.o_proj.weight": t + "attention.wo.weight",
                      h + "mlp.gate_proj.weight": t + "feed_forward.w1.weight", h + "mlp.up_proj.weight": t + "feed_forward.w3.weight",
                      h + "mlp.down_proj.weight": t + "feed_forward.w2.weight",
                      h + "input_layernorm.weight": t + "attention_norm.weight",
                      h + "post_attention_layernorm.weight": t + "ffn_norm.weight"})
        if qk_norm:
            table.update({h + "self_attn.q_norm.weight": t + "attention.q_norm.weight",
                          h + "self_attn.k_norm.weight": t + "attention.k_norm.weight"})
    return table


def expected_hf(state: dict, config: dict, permute: bool, qk_norm: bool = False) -> dict[str, torch.Tensor]:
    """The HF tensors of a trained torchtitan model (v0.2 names), q / k rows permuted or not."""
    out = {hf: state[tt] for hf, tt in titan_table(config["num_hidden_layers"], "v0.2", qk_norm).items()}
    if permute:
        d = config["head_dim"]
        for hf in out:
            if hf.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config["num_attention_heads" if "q_proj" in hf else "num_key_value_heads"]
                out[hf] = interleaved_to_halves(out[hf], heads, d)
    return out


def assert_same(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def test_llama_model_only_v02_names_to_hf_bit_exact_and_permutation_has_teeth(fsdp, tmp_path, capsys):
    out = tmp_path / "hf"
    code, _, err = run_cli(capsys, "convert", f"{fsdp}/llama_v02", out, "--to", "hf", "--config",
                           f"{fsdp}/llama.config.json")
    assert code == 0, err
    state = trained(fsdp, "llama")
    assert_same(load_hf_tensors(out), expected_hf(state, LLAMA, permute=True))
    reference = titan_logits(LLAMA, state, qk_norm=False)
    assert (hf_logits(str(out)) - reference).abs().max() < 1e-4
    wrong = tmp_path / "unpermuted"  # the same bytes with wq / wk rows left in torchtitan's order
    wrong.mkdir()
    save_file(expected_hf(state, LLAMA, permute=False), str(wrong / "model.safetensors"))
    (wrong / "config.json").write_text(json.dumps(LLAMA))
    assert (hf_logits(str(wrong)) - reference).abs().max() > 1e-2


def test_llama_full_checkpoint_current_names_with_optimizer(fsdp, tmp_path):
    import reshard

    result = reshard.convert(f"{fsdp}/llama_full", str(tmp_path / "hf"), to="hf", config=f"{fsdp}/llama.config.json")
    assert any("skipped optimizer, train_state" in n for n in result.plan.notes)
    assert_same(load_hf_tensors(tmp_path / "hf"), expected_hf(trained(fsdp, "llama"), LLAMA, permute=True))


def test_qwen3_is_not_permuted(fsdp, tmp_path):
    import reshard

    reshard.convert(f"{fsdp}/qwen3", str(tmp_path / "hf"), to="hf", config=f"{fsdp}/qwen3.config.json")
    state = trained(fsdp, "qwen3")
    assert_same(load_hf_tensors(tmp_path / "hf"), expected_hf(state, QWEN3, permute=False, qk_norm=True))
    assert (hf_logits(str(tmp_path / "hf")) - titan_logits(QWEN3, state, qk_norm=True)).abs().max() < 1e-4


def test_newest_complete_step_and_a_step_folder_itself(fsdp, tmp_path):
    root = tmp_path / "checkpoint"
    shutil.copytree(f"{fsdp}/llama_v02/step-1", root / "step-1")
    (root / "step-3").mkdir()  # an interrupted save: data, no .metadata
    shutil.copy(f"{fsdp}/llama_v02/step-1/__0_0.distcp", root / "step-3")
    opts = Options(config=f"{fsdp}/llama.config.json")
    assert detect(str(root)).name == "torchtitan"
    with open_checkpoint(str(root), opts) as source:
        assert source.info["step"] == "step-1" and source.info["names"] == "v0.2"
        assert any("step-3 has no .metadata" in n for n in source.info["notes"])
    with open_checkpoint(str(root / "step-1"), opts) as source:  # detected as a DCP folder, torchtitan names
        assert source.layout == "torchtitan"


def _titan_folder(path, tensors: dict[str, torch.Tensor]) -> str:
    dcp.save(tensors, checkpoint_id=str(path), no_dist=True)
    return str(path)


def test_refusals(fsdp, tmp_path, capsys):
    code, _, err = run_cli(capsys, "convert", f"{fsdp}/llama_v02", tmp_path / "a", "--to", "hf")
    assert code == 2 and "--config" in err and len(err.strip().splitlines()) == 1
    state = trained(fsdp, "llama")
    odd = dict(state)
    odd["layers.0.attention.wz.weight"] = odd.pop("layers.0.attention.wq.weight")
    folder = _titan_folder(tmp_path / "odd" / "step-1", odd)
    code, _, err = run_cli(capsys, "convert", folder, tmp_path / "b", "--to", "hf", "--config", f"{fsdp}/llama.config.json")
    assert code == 2 and "'layers.0.attention.wz.weight'" in err
    moe = {"tok_embeddings.weight": state["tok_embeddings.weight"],
           "layers.0.moe.router.gate.weight": torch.zeros(4, 48),
           "layers.0.moe.routed_experts.inner_experts.w1_EFD": torch.zeros(4, 40, 48)}
    folder = _titan_folder(tmp_path / "moe" / "step-1", moe)
    code, _, err = run_cli(capsys, "convert", folder, tmp_path / "c", "--to", "hf", "--config", f"{fsdp}/llama.config.json")
    assert code == 2 and "Mixture-of-Experts" in err
    moe_config = tmp_path / "moe.json"
    moe_config.write_text(json.dumps(dict(QWEN3, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)))
    code, _, err = run_cli(capsys, "convert", folder, tmp_path / "d", "--to", "hf", "--config", moe_config)
    assert code == 2 and "Mixture-of-Experts" in err


def _hf_to_titan_expected(hf: dict, config: dict, spelling: str) -> dict[str, torch.Tensor]:
    table = titan_table(config["num_hidden_layers"], spelling)
    d = config["hidden_size"] // config["num_attention_heads"]
    out = {}
    for name, tensor in hf.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            tensor = halves_to_interleaved(tensor, heads, d)
        out[table[name]] = tensor
    return out


@pytest.mark.parametrize("spelling", ["current", "v0.2"])
def test_hf_to_torchtitan_loads_with_torch_dcp_and_back(tmp_path, capsys, spelling):
    hf = make_hf(tmp_path / "hf", hidden=32, heads=4, kv_heads=2, ffn=48, vocab=67)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    out = tmp_path / "titan"
    flags = [] if spelling == "current" else ["--torchtitan-names", "v0.2"]
    code, _, err = run_cli(capsys, "convert", hf, out, "--to", "torchtitan", *flags)
    assert code == 0, err
    names = os.listdir(out)
    assert ".metadata" in names and any(n.endswith("_0.distcp") for n in names)
    expected = _hf_to_titan_expected(load_hf_tensors(hf), config, spelling)
    state = {name: torch.full_like(t, float("nan")) for name, t in expected.items()}
    dcp.load(state, checkpoint_id=str(out), no_dist=True)  # torch's own reader; strict: every key must exist
    assert_same(state, expected)
    from reshard.io.dcp import read_metadata

    assert sorted(read_metadata(str(out))[0]) == sorted(expected)  # nothing else (no freqs_cis)
    code, _, err = run_cli(capsys, "convert", out, tmp_path / "back", "--to", "hf")
    assert code == 0, err
    assert_same(load_hf_tensors(tmp_path / "back"), load_hf_tensors(hf))
    assert run_cli(capsys, "verify", hf, out)[0] == 0


def test_verify_forward_hf_against_torchtitan(tmp_path, capsys):
    from helpers import tiny_transformers_model
    import transformers

    model = tiny_transformers_model(transformers, "LlamaConfig", num_key_value_heads=4)
    model.save_pretrained(tmp_path / "hf")
    assert run_cli(capsys, "convert", tmp_path / "hf", tmp_path / "titan", "--to", "torchtitan")[0] == 0
    code, out, err = run_cli(capsys, "verify", "--forward", tmp_path / "hf", tmp_path / "titan", "--nproc", "2")
    assert code == 0, out + err


def test_tied_model_and_option_refusals(tmp_path, capsys):
    import reshard

    hf = make_hf(tmp_path / "hf", hidden=32, heads=4, kv_heads=2, ffn=48, vocab=67, tied=True)
    result = reshard.convert(hf, str(tmp_path / "titan"), to="torchtitan")
    assert any("no output weight written" in n for n in result.plan.notes)
    from reshard.io.dcp import read_metadata

    keys = read_metadata(str(tmp_path / "titan"))[0]
    assert "lm_head.weight" not in keys and "tok_embeddings.weight" in keys
    code, _, err = run_cli(capsys, "convert", hf, tmp_path / "tp2", "--to", "torchtitan", "--tp", "2")
    assert code == 2 and "--tp and --pp must be 1" in err
    code, _, err = run_cli(capsys, "convert", hf, tmp_path / "x", "--to", "hf", "--torchtitan-names", "v0.2")
    assert code == 2 and "--torchtitan-names" in err
    with pytest.raises(CheckpointError, match="no model tensors"):
        open_checkpoint(_titan_folder(tmp_path / "opt" / "step-1", {"optimizer.state.x.exp_avg": torch.zeros(2)}),
                        Options(config=os.path.join(hf, "config.json")))


@pytest.mark.parametrize("name,folder,tp", [("llama", "llama_full", 1), ("qwen3", "qwen3", 2)])
def test_load_rank_of_a_torchtitan_step_is_the_vllm_rank_file(fsdp, tmp_path, name, folder, tp):
    """``reshard.load_rank`` reads a torchtitan folder (chunks stitched, Llama's wq / wk permuted) as convert does
    (the Llama's 3 heads split over tp 1 or 3, its FFN of 40 not over 3)."""
    import reshard
    from safetensors.torch import load_file

    config = f"{fsdp}/{name}.config.json"
    out = tmp_path / "vllm"
    reshard.convert(f"{fsdp}/{folder}", str(out), to="vllm", tp=tp, config=config)
    for rank in range(tp):
        written = {k: v for f in sorted(out.glob(f"model-rank-{rank}-part-*.safetensors"))
                   for k, v in load_file(str(f)).items()}
        view = reshard.load_rank(f"{fsdp}/{folder}", to="vllm", tp=tp, rank=rank, config=config)
        assert set(view) == set(written)
        assert all(torch.equal(view[k], written[k]) for k in written)


def test_plan_lists_what_convert_writes(fsdp, tmp_path, capsys):
    """``reshard plan`` of a torchtitan step names the files and tensor bytes ``convert`` then writes."""
    from safetensors.torch import load_file

    config = f"{fsdp}/qwen3.config.json"
    code, out, err = run_cli(capsys, "plan", f"{fsdp}/qwen3", "--to", "vllm", "--tp", "2", "--config", config,
                             "--json")
    assert code == 0, err
    plan = json.loads(out)
    code, _, err = run_cli(capsys, "convert", f"{fsdp}/qwen3", tmp_path / "vllm", "--to", "vllm", "--tp", "2",
                           "--config", config)
    assert code == 0, err
    written = sorted(p.name for p in (tmp_path / "vllm").glob("*.safetensors"))
    assert sorted(f["path"] for f in plan["files"]) == written
    tensors = [t for name in written for t in load_file(str(tmp_path / "vllm" / name)).values()]
    assert plan["bytes"] == sum(t.numel() * t.element_size() for t in tensors)
    read = plan["bytes_read_per_source"]  # FSDP2 chunks: each rank's data file holds about half of every weight
    data = {k: v for k, v in read.items() if k.endswith(".distcp")}
    assert len(data) == 2 and all(v > 0.4 * sum(read.values()) for v in data.values()), read
