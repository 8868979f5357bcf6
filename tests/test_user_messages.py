"""Messages as a user meets them (issue 43, items 6, 7, 8 and 10): a config-less HF folder, ``verify`` of two
different models, ``live.transfer`` given shards of another degree, and ``inspect`` within 80 columns."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import reshard
from checkpoints import load_hf_tensors, make_hf
from helpers import run_cli
from reshard import live
from reshard.errors import PlanError


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return make_hf(tmp_path_factory.mktemp("llama") / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)


# -- item 6: an HF folder without config.json ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["safetensors", "index", "bin"])
def test_hf_weights_without_config_ask_for_one_and_read_with_config_option(llama, tmp_path, capsys, kind):
    folder = tmp_path / "weights"
    if kind == "bin":
        folder.mkdir()
        torch.save(load_hf_tensors(llama), folder / "pytorch_model.bin")
    else:
        sharded = make_hf(tmp_path / "sharded", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, shards=2)
        shutil.copytree(llama if kind == "safetensors" else sharded, folder)
        os.remove(folder / "config.json")
    code, _, err = run_cli(capsys, "convert", folder, tmp_path / "out", "--to", "megatron")
    assert code == 2 and err.count("\n") == 1 and len(err) < 200, err
    assert "holds Hugging Face weights but no config.json" in err and "--config FILE" in err, err
    config = os.path.join(llama, "config.json")
    code, _, err = run_cli(capsys, "convert", folder, tmp_path / "out", "--to", "hf", "--config", config)
    assert code == 0, err
    written, original = load_hf_tensors(tmp_path / "out"), load_hf_tensors(llama)
    assert sorted(written) == sorted(original) and all(torch.equal(written[n], original[n]) for n in original)
    assert json.load(open(tmp_path / "out" / "config.json"))["vocab_size"] == 1000
    code, _, err = run_cli(capsys, "convert", llama, tmp_path / "again", "--to", "hf", "--config", config)
    assert code == 2 and "does not apply" in err, err  # a folder with its own config.json: still refused


# -- item 7: verify of two different models -----------------------------------------------------------------------

def test_verify_of_different_models_leads_with_the_architecture_and_the_first_shape(llama, tmp_path, capsys):
    other = make_hf(tmp_path / "mistral", arch="MistralForCausalLM", hidden=64, heads=8, kv_heads=2, ffn=96,
                    vocab=1064)
    code, out, _ = run_cli(capsys, "verify", llama, other)
    lines = out.splitlines()
    assert code == 1 and lines[-1] == "DIFFERENT", out
    assert lines[2:4] == ["  architecture: LlamaForCausalLM in A, MistralForCausalLM in B",
                          "  shapes differ: model.embed_tokens.weight: [1000, 64] in A, [1064, 64] in B (and 1 more)"]
    assert "  different: lm_head.weight ([1000, 64] in A, [1064, 64] in B)" in lines, out
    report = json.loads(run_cli(capsys, "verify", llama, other, "--json")[1])
    assert (report["architecture_a"], report["architecture_b"]) == ("LlamaForCausalLM", "MistralForCausalLM")
    shaped = {t["name"]: (t["shape_a"], t["shape_b"]) for t in report["tensors"] if "shape_a" in t}
    assert shaped == {n: ([1000, 64], [1064, 64]) for n in ("model.embed_tokens.weight", "lm_head.weight")}
    assert {"name", "status", "dtype_a", "sha256_a", "max_abs"} <= set(report["tensors"][0])  # the fields kept
    code, out, _ = run_cli(capsys, "verify", llama, llama)
    assert code == 0 and "architecture" not in out and "shapes differ" not in out, out


# -- item 8: live.transfer given shards made for another degree --------------------------------------------------

def _refusal(plan, local: dict) -> str:
    """The message source rank 0 of ``plan`` gets for the first of ``local``'s tensors unlike the plan's."""
    from reshard.live.transfer import _Local

    view = _Local(plan, 0, local, [])
    with pytest.raises(PlanError) as info:
        for name in local:
            view[name]
    return str(info.value)


def test_live_shards_of_another_degree_name_the_degree_not_a_dtype(llama):
    plan = live.plan(llama, source={"layout": "megatron", "tp": 2}, target={"layout": "vllm", "tp": 1},
                     source_ranks=[0, 1], target_ranks=[2])
    message = _refusal(plan, reshard.load_rank(llama, to="megatron", tp=1, rank=0))
    assert "dtype" not in message and "\n" not in message, message
    assert "look made for TP 1" in message and "megatron at TP 2, PP 1" in message, message
    assert "[1024, 64]; the plan expects [512, 64]" in message and "tp=2, pp=1" in message, message
    cast = {k: v.to(torch.bfloat16) for k, v in reshard.load_rank(llama, to="megatron", tp=2, rank=0).items()}
    message = _refusal(plan, cast)  # the right degree, another dtype: the dtype to pass, and no degree
    assert "source={..., 'dtype': 'bfloat16'}" in message and "degree" not in message, message


# -- item 10: inspect within 80 columns, in finished sentences --------------------------------------------------

@pytest.fixture(scope="module")
def every_layout(tmp_path_factory, llama) -> dict[str, str]:
    """A folder of each layout the fixtures make: hf (3 shards, and a 1-layer one), the written layouts converted
    from it, a DeepSpeed ZeRO tag and an accelerate-style FSDP DCP folder (its HF config one level up)."""
    import torch.distributed.checkpoint as dcp

    from checkpoints import load_hf_tensors

    base = tmp_path_factory.mktemp("every")
    hf = make_hf(base / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, shards=3)
    folders = {"hf": hf, "hf-1-layer": make_hf(base / "one", layers=1, kv_heads=1, vocab=1000)}
    for to, degrees in (("megatron", dict(tp=2, pp=2)), ("torch_dist", dict(tp=2)), ("vllm", dict(tp=2)),
                        ("trtllm", dict(tp=2)), ("meta", dict(tp=2)), ("torchtitan", {})):
        folders[to] = str(base / to)
        reshard.convert(hf, folders[to], to=to, progress=False, **degrees)
    tensors = load_hf_tensors(hf)
    (base / "ds" / "global_step1").mkdir(parents=True)
    (base / "ds" / "latest").write_text("global_step1")
    shutil.copy(os.path.join(hf, "config.json"), base / "ds")
    torch.save({"module": tensors, "ds_version": "0.19.0"}, base / "ds" / "global_step1" / "mp_rank_00_model_states.pt")
    folders["deepspeed"] = str(base / "ds")
    (base / "dcp").mkdir()
    shutil.copy(os.path.join(hf, "config.json"), base / "dcp")
    with pytest.warns(UserWarning):  # torch.distributed is not initialised: a single-process save
        dcp.save({"model": tensors}, checkpoint_id=str(base / "dcp" / "pytorch_model_fsdp_0"), no_dist=True)
    folders["dcp"], folders["dcp-folder"] = str(base / "dcp"), str(base / "dcp" / "pytorch_model_fsdp_0")
    return folders


@pytest.mark.parametrize("kind", ["hf", "hf-1-layer", "megatron", "torch_dist", "vllm", "trtllm", "meta",
                                  "torchtitan", "deepspeed", "dcp", "dcp-folder"])
def test_inspect_fits_80_columns_in_finished_words(every_layout, capsys, kind):
    import re

    texts = [run_cli(capsys, "inspect", every_layout[kind], *flags) for flags in ((), ("--files",))]
    for code, text, err in texts:
        assert code == 0, err
        lines = text.splitlines()
        assert lines[0] == every_layout[kind] and len(lines) > 10, text
        assert all(len(line) <= 80 for line in lines[1:]), [line for line in lines if len(line) > 80]
        assert not re.search(r"\b1 (files|layers|tensors|heads|KV heads)\b", text), text
        assert not re.search(r"\b(\w+) \1\b", text), text  # "deepspeed deepspeed"
        assert not re.search(r"\b(skipped|checkpoint|step)(,|\s*$| \.)", text, re.M), text  # empty or "." values
    text = texts[0][1]
    layout = reshard.inspect(every_layout[kind])["layout"]
    assert f"  layout       {layout}\n" in text
    if kind == "hf-1-layer":
        assert "1 layer, hidden 64" in text and "1 KV head," in text and "in 1 file\n" in text, text
    if kind == "torchtitan":  # reshard's own output folder: its name is not a step
        assert "step" not in text and "torchtitan   names current" in text, text
    if kind == "deepspeed":
        assert "  deepspeed    tag global_step1, stage ZeRO-0/1/2" in text, text
