"""``reshard mappings new NAME --from FAMILY``: a commented copy under the new family's own names that passes
``mappings check`` and names no shipped family; ``mappings check`` warns where a copied file still does."""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
from pathlib import Path

import pytest

import reshard
from checkpoints import load_hf_tensors, make_hf
from cli_inprocess import run_main
from reshard.mapping import load_family_file, load_shipped, parse_family, shipped_mapping_names
from reshard.mapping_skeleton import skeleton_text

LLAMA = (Path(__file__).resolve().parents[1] / "mappings" / "llama.toml").read_text()


def shipped_identities() -> set[str]:
    """Every shipped family's name, architectures and config.json model_types."""
    names = set()
    for family in shipped_mapping_names():
        fam = load_shipped(family)
        names |= {fam.name, *fam.architectures, *(spelling.model_type for _, spelling in fam.config.architectures)}
    return names


def test_new_passes_check_and_names_no_other_family(tmp_path):
    out = tmp_path / "acme.toml"
    made = run_main("mappings", "new", "acme", "--from", "llama", "-o", out)
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith(f"wrote {out}")
    checked = run_main("mappings", "check", out)
    assert checked.returncode == 0 and checked.stderr == ""
    assert checked.stdout.startswith(f"ok: {out}: family 'acme', 19 weights, architectures AcmeForCausalLM")
    text = out.read_text()
    assert set(re.findall(r"[A-Za-z0-9_]+", text)) & shipped_identities() == set()
    assert 'model_type = "acme"' in text and "# What to edit" in text


@pytest.mark.parametrize("source", [a for f in shipped_mapping_names() for a in load_shipped(f).architectures])
def test_every_family_copies_whole_under_new_names(source):
    """From every shipped architecture: the copy keeps each weight, dimension, decoder feature and config
    spelling, and only the family's identity changes."""
    family = next(load_shipped(f) for f in shipped_mapping_names() if source in load_shipped(f).architectures)
    text = skeleton_text("acme", source, architecture="AcmeLM", model_type="acme_lm")
    copy = parse_family(tomllib.loads(text), "copy")
    assert set(re.findall(r"[A-Za-z0-9_]+", text)) & shipped_identities() == set()
    assert (copy.name, copy.architectures) == ("acme", ("AcmeLM",))
    for attribute in ("weights", "dims", "decoder", "moe", "extra_state", "vllm_scales", "vllm_tied_name",
                      "hf_ignore", "hf_optional_prefix"):
        assert getattr(copy, attribute) == getattr(family, attribute), attribute
    assert copy.config.architecture("AcmeLM") == dataclasses.replace(family.config.architecture(source),
                                                                     model_type="acme_lm")
    assert dataclasses.replace(copy.config, architectures=()) == dataclasses.replace(family.config, architectures=())


def test_the_copy_converts_and_keeps_the_users_model_type(tmp_path):
    """The issue: a copied model_type = "llama" overwrote the user's own in the converted config.json."""
    src = make_hf(tmp_path / "hf", arch="LlamaForCausalLM", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.update(architectures=["AcmeForCausalLM"], model_type="acme")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    mapping = tmp_path / "acme.toml"
    assert run_main("mappings", "new", "acme", "--from", "llama", "-o", mapping).returncode == 0
    reshard.convert(src, str(tmp_path / "m"), to="megatron", tp=2, mapping=str(mapping))
    reshard.convert(str(tmp_path / "m"), str(tmp_path / "back"), to="hf", mapping=str(mapping))
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (back["architectures"], back["model_type"]) == (["AcmeForCausalLM"], "acme")
    a, b = load_hf_tensors(tmp_path / "hf"), load_hf_tensors(tmp_path / "back")
    assert sorted(a) == sorted(b) and all(a[k].equal(b[k]) for k in a)


def test_check_warns_where_a_copy_still_names_a_shipped_family(tmp_path):
    mine = tmp_path / "mine.toml"
    tables = LLAMA[LLAMA.index("[config.architectures.LlamaForCausalLM]"):LLAMA.index("[[weight]]")]
    mine.write_text(LLAMA.replace('architectures = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"]',
                                  'architectures = ["MyLlamaForCausalLM", "OtherForCausalLM"]')
                    .replace(tables, '[config.architectures.MyLlamaForCausalLM]\nmodel_type = "llama"\n\n'))
    load_family_file(mine)  # valid: only warned about
    proc = run_main("mappings", "check", mine)
    assert proc.returncode == 0 and proc.stdout.startswith("ok:")
    warnings = proc.stderr.splitlines()
    assert warnings == [
        f"warning: {mine}: family name 'llama' is shipped mapping llama's: give your family its own name",
        f"warning: {mine}: [config.architectures.MyLlamaForCausalLM] model_type 'llama' is LlamaForCausalLM's "
        "(shipped mapping llama): reshard writes it into converted checkpoints' config.json; set your "
        "config.json's own \"model_type\"",
        f"warning: {mine}: architecture 'OtherForCausalLM' has no [config.architectures.OtherForCausalLM] table "
        "(model_type, biases, window): converting to Hugging Face will be refused",
    ]
    mine.write_text(LLAMA.replace('name = "llama"', 'name = "mine"'))
    proc = run_main("mappings", "check", mine)
    assert proc.returncode == 0 and proc.stderr.count("is one of shipped mapping llama's") == 3


def test_shipped_files_check_without_warnings(tmp_path):
    for family in shipped_mapping_names():
        path = tmp_path / f"{family}.toml"
        path.write_text(run_main("mappings", "show", family).stdout)
        proc = run_main("mappings", "check", path)
        assert proc.returncode == 0 and proc.stderr == "", (family, proc.stderr)


@pytest.mark.parametrize("name, args, message", [
    ("acme", ["--from", "lama"], "--from 'lama' is neither a shipped mapping nor an architecture one lists (did you "
     "mean 'llama'?)"),
    ("llama", ["--from", "llama"], "'llama' is a shipped mapping's name: give your family its own name"),
    ("a b", ["--from", "llama"], "mapping name 'a b' must start with a letter"),
    ("acme", ["--from", "llama", "--model-type", "mistral"], "model_type 'mistral' is shipped mapping llama's"),
    ("acme", ["--from", "llama", "--architecture", "Qwen3ForCausalLM"],
     "architecture 'Qwen3ForCausalLM' is shipped mapping qwen3's"),
    ("existing", ["--from", "llama"], "already exists; pass --overwrite to replace it or -o to write elsewhere"),
])
def test_bad_requests_are_one_line_exit_2(tmp_path, name, args, message):
    out = tmp_path / "out.toml"
    if name == "existing":
        out.write_text("# mine\n")
    proc = run_main("mappings", "new", name, *args, "-o", out)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert out.read_text() == "# mine\n" if name == "existing" else not out.exists()
