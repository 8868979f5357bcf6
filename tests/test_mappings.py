"""Mapping files: the shipped family validates; the schema is strict; a user's own file works with --mapping."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import reshard
from checkpoints import load_hf_tensors, make_hf
from reshard.errors import MappingError
from reshard.mapping import load_family_file, load_shipped

LLAMA = (Path(__file__).resolve().parents[1] / "mappings" / "llama.toml").read_text()


def cli(*args):
    return subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], capture_output=True, text=True)


def test_shipped_llama_family():
    fam = load_shipped("llama")
    assert set(fam.architectures) == {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
    by_name = {w.hf: w for w in fam.weights}
    assert by_name["model.layers.{layer}.self_attn.k_proj.weight"].split == "qkv"
    assert by_name["model.layers.{layer}.mlp.up_proj.weight"].slot == "up"
    assert by_name["lm_head.weight"].tied_to == "model.embed_tokens.weight"
    assert by_name["model.layers.{layer}.input_layernorm.weight"].megatron_te.endswith("linear_qkv.layer_norm_weight")


@pytest.mark.parametrize("edit, message", [
    (("split = \"row\"", "splt = \"row\""), "unknown key 'splt' in weight #9 (model.layers.{layer}.self_attn.o_proj.weight) (did you mean 'split'?)"),
    (("[family]", "[famly]"), "unknown key 'famly' in the top level (did you mean 'family'?)"),
    (("split = \"row\"", "split = \"rows\""), "unknown split 'rows' (did you mean 'row'?)"),
    (("shape = [\"F\", \"H\"]", "shape = [\"FF\", \"H\"]"), "unknown symbol 'FF' (did you mean 'F'?)"),
    (("slot = \"up\"", "slot = \"upp\""), "needs slot one of gate, up"),
    (("split = \"row\"", "split = \"row\"\nwhen = \"== 3\""), "condition '== 3' must be 'KEY', '!KEY'"),
    (("split = \"row\"", "split = \"row\"\nwhen = \"act == silu\""), "'silu' is not a string, number or bool"),
])
def test_strict_schema_errors(tmp_path, edit, message):
    path = tmp_path / "mine.toml"
    path.write_text(LLAMA.replace(*edit, 1))
    with pytest.raises(MappingError) as err:
        load_family_file(path)
    assert str(path) in str(err.value) and message in str(err.value)
    proc = cli("mappings", "check", path)
    assert proc.returncode == 2 and message in proc.stderr


def test_mappings_cli(tmp_path):
    assert "llama: LlamaForCausalLM" in cli("mappings", "list").stdout
    shown = cli("mappings", "show", "llama")
    assert shown.returncode == 0 and shown.stdout == LLAMA
    bad = cli("mappings", "show", "lama")
    assert bad.returncode == 2 and "did you mean 'llama'" in bad.stderr
    (tmp_path / "ok.toml").write_text(LLAMA)
    assert cli("mappings", "check", tmp_path / "ok.toml").stdout.startswith("ok:")


def test_user_mapping_for_own_architecture(tmp_path):
    src = make_hf(tmp_path / "hf", arch="LlamaForCausalLM", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["architectures"] = ["MyLlamaForCausalLM"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MappingError, match="unknown architecture 'MyLlamaForCausalLM'"):
        reshard.convert(src, str(tmp_path / "m"), to="megatron", tp=2)
    mine = tmp_path / "mine.toml"
    text = LLAMA.replace('name = "llama"', 'name = "mine"').replace(
        'architectures = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"]',
        'architectures = ["MyLlamaForCausalLM"]')
    mine.write_text(text)  # the [config.architectures.*] tables still name the shipped architectures
    proc = cli("convert", src, tmp_path / "m", "--to", "megatron", "--tp", "2", "--mapping", mine)
    assert proc.returncode == 2 and "[config.architectures.LlamaForCausalLM] is not one of the family's " \
        "architectures (did you mean 'MyLlamaForCausalLM'?)" in proc.stderr
    tables = text[text.index("[config.architectures.LlamaForCausalLM]"):text.index("[[weight]]")]
    mine.write_text(text.replace(tables, '[config.architectures.MyLlamaForCausalLM]\nmodel_type = "llama"\n'
                                 'biases = { qkv = "attention_bias", o = "attention_bias", mlp = "mlp_bias" }\n\n'))
    proc = cli("convert", src, tmp_path / "m", "--to", "megatron", "--tp", "2", "--mapping", mine)
    assert proc.returncode == 0, proc.stderr
    reshard.convert(str(tmp_path / "m"), str(tmp_path / "back"), to="hf", mapping=str(mine))
    a, b = load_hf_tensors(tmp_path / "hf"), load_hf_tensors(tmp_path / "back")
    assert sorted(a) == sorted(b) and all(a[k].equal(b[k]) for k in a)
