"""What reshard shows people (issue 31): byte progress bars in binary units, ``reshard --version``, ``inspect``'s
table (``--json`` for machines), and the retry command a failed ``push`` names."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

import reshard
from checkpoints import hf_config, hf_tensor_shapes, make_hf, position_coded, write_hf
from helpers import run_cli
from reshard.progress import binary_size, byte_bar
from test_hub import hubenv  # noqa: F401 - the fixture: huggingface_hub pointed at a local server


def test_byte_bar_counts_in_binary_units():
    out = io.StringIO()
    with byte_bar(3 * 2**30, "converting", disable=False, file=out, mininterval=0) as bar:
        bar.update(5 * 2**20)
    text = out.getvalue()
    assert "5.00M/3.00G" in text and re.search(r"[\d.]+[KMGT]iB/s", text), text
    assert not re.search(r"\d[KMGT]B/s", text), text  # tqdm's "MB" for MiB: gone
    assert byte_bar(1, "x", disable=True).disable


def test_binary_size():
    assert [binary_size(n) for n in (12, 1536, 5 * 2**20, 3 * 2**30 // 2)] == ["12 B", "1.5 KiB", "5.0 MiB", "1.5 GiB"]


def test_every_byte_bar_is_made_by_byte_bar():
    import pathlib

    import reshard

    root = pathlib.Path(reshard.__file__).parent
    makers = [str(p.relative_to(root)) for p in root.rglob("*.py") if "tqdm(" in p.read_text()]
    assert makers == ["progress.py"]


# -- inspect ---------------------------------------------------------------------------------------------------------

def moe_hf(path) -> str:
    """A tiny Mixtral (4 experts, top 2) in HF layout, position-coded."""
    config = hf_config(hidden=64, heads=8, kv_heads=2, ffn=48, vocab=1000)
    for key in ("attention_bias", "mlp_bias"):
        del config[key]
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
                  num_experts_per_tok=2)
    shapes = {}
    for name, shape in hf_tensor_shapes(config).items():
        if ".mlp." not in name:
            shapes[name] = shape
        elif name.endswith("gate_proj.weight"):
            prefix = name.split("mlp.")[0] + "block_sparse_moe."
            shapes[prefix + "gate.weight"] = (4, 64)
            for e in range(4):
                shapes.update({f"{prefix}experts.{e}.w1.weight": (48, 64), f"{prefix}experts.{e}.w2.weight": (64, 48),
                               f"{prefix}experts.{e}.w3.weight": (48, 64)})
    return write_hf(path, config, position_coded(shapes))


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """One folder of each kind inspect must describe: hf, megatron tp2 pp2 (bf16), torch_dist saved at tp2, vLLM
    tp2, and a Mixtral in Megatron at tp2 ep2."""
    base = tmp_path_factory.mktemp("inspect")
    hf = make_hf(base / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, shards=3)
    folders = {"hf": hf}
    for name, to, kwargs in (("megatron", "megatron", dict(tp=2, pp=2, dtype="bf16")),
                             ("torch_dist", "torch_dist", dict(tp=2)), ("vllm", "vllm", dict(tp=2))):
        folders[name] = str(base / name)
        reshard.convert(hf, folders[name], to=to, progress=False, **kwargs)
    folders["moe"] = str(base / "moe")
    reshard.convert(moe_hf(base / "moe-hf"), folders["moe"], to="megatron", tp=2, ep=2, progress=False)
    return folders


ROWS = ("layout", "model", "parallelism", "dtype", "parameters", "size", "shape", "vocab", "settings")


@pytest.mark.parametrize("kind, parallelism", [
    ("hf", "TP 1, PP 1"), ("megatron", "TP 2, PP 2"), ("vllm", "TP 2, PP 1"),
    ("torch_dist", "saved at TP 2, PP 1; whole tensors, readable at any degree"),
    ("moe", "TP 2, PP 1, EP 2, expert TP 2")])
def test_inspect_prints_a_table_for_people(layouts, kind, parallelism, capsys):
    code, text, err = run_cli(capsys, "inspect", layouts[kind])
    assert code == 0, err
    info = reshard.inspect(layouts[kind])
    assert "{" not in text and "[" not in text and "'" not in text, text  # no dict, list or string reprs
    assert str(info["bytes"]) not in text and f"{info['bytes']:,}" not in text, text  # no raw byte count
    rows = dict(line.strip().split(None, 1) for line in text.splitlines()[1:] if line.startswith("  ")
                and not line.startswith("   ") and not line.strip().startswith("files per rank"))
    assert set(ROWS) <= set(rows), rows
    assert rows["parallelism"] == parallelism
    assert rows["layout"] == info["layout"] and re.fullmatch(r"[\d.]+ (KiB|MiB) in \d+ files", rows["size"])
    assert rows["parameters"] == f"{info['parameters']:,} ({info['parameters'] / 1000:.1f}K) in {info['tensors']} tensors"
    assert "tp: 1" not in text and "saved_tp" not in text
    assert text.splitlines()[0] == layouts[kind] and "files per rank" in text


def test_inspect_table_details(layouts, capsys):
    text = run_cli(capsys, "inspect", layouts["megatron"])[1]
    assert "  dtype        BF16\n" in text and "1,000 (padded to 1,024 in the files), embeddings untied" in text
    assert "  megatron     spec te, iteration release\n" in text
    assert "4 ranks (mp_rank_00_000 … mp_rank_01_001), 1 file each, 4 in all" in text
    text = run_cli(capsys, "inspect", layouts["moe"])[1]
    assert "  experts      4 per MoE layer, 2 per token, FFN 48; 2 of 2 layers are MoE\n" in text
    assert "  routing      softmax scores, top-k renormalised\n" in text and "  shape        2 layers, hidden 64, 8 heads of 8, 2 KV heads\n" in text
    assert "  shape        2 layers, hidden 64, 8 heads of 8, 2 KV heads, FFN 96\n" in run_cli(capsys, "inspect",
                                                                                          layouts["hf"])[1]
    every = run_cli(capsys, "inspect", layouts["megatron"], "--files")[1]
    assert every.count("model_optim_rng.pt") == 4


def test_inspect_json_keeps_its_keys_and_says_what_the_degrees_are(layouts, capsys):
    info = json.loads(run_cli(capsys, "inspect", layouts["torch_dist"], "--json")[1])
    assert (info["tp"], info["pp"], info["saved_tp"], info["saved_pp"]) == (1, 1, 2, 1)  # the old keys
    assert info["saved_degrees"] == {"tp": 2, "pp": 1} and isinstance(info["model_config"], dict)
    info = json.loads(run_cli(capsys, "inspect", layouts["moe"], "--json")[1])
    assert info["saved_degrees"] == {"tp": 2, "pp": 1, "ep": 2, "etp": 2} and info["experts"] == 4
    assert info["bytes"] == sum(os.path.getsize(os.path.join(layouts["moe"], f))
                                for names in info["files_per_rank"].values() for f in names)


def test_settings_fold_layer_lists_and_scaling_dicts():
    from reshard.inspection import _value

    assert _value([0, 1, 2, 3, 5, 7, 8]) == "0-3, 5, 7-8"
    assert _value({"rope_type": "llama3", "factor": 8.0}) == "rope_type=llama3 factor=8.0"


# -- --version -------------------------------------------------------------------------------------------------------

def test_version(capsys):
    from reshard.version import __version__

    assert run_cli(capsys, "--version") == (0, f"reshard {__version__}\n", "")
    exe = os.path.join(os.path.dirname(sys.executable), "reshard")
    proc = subprocess.run([exe if os.path.isfile(exe) else sys.executable, *([] if os.path.isfile(exe) else
                          ["-m", "reshard"]), "--version"], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, f"reshard {__version__}\n"), proc.stderr
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)


# -- push without a network ------------------------------------------------------------------------------------------

def test_a_failed_push_names_the_command_that_retries_it(tmp_path, hubenv):
    from hub_server import HubServer
    from test_hub import assert_one_line_error, closed_port_endpoint

    src = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    out = tmp_path / "tiny tp2"  # a space: the command must be shell-quoted
    reshard.convert(src, str(out), to="megatron", tp=2, progress=False)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    down = hubenv.at(closed_port_endpoint())
    line = assert_one_line_error(down.run("push", out, "alice/tiny", "--revision", "tp2", "--private", ok=False),
                                 "cannot reach the Hub", "to upload to alice/tiny", "is complete and kept")
    retry = f"reshard push '{out}' alice/tiny --revision tp2 --private"
    assert f"retry with `{retry}`" in line and "cache" not in line, line
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    line = assert_one_line_error(hubenv.at(closed_port_endpoint(), offline=True).run(
        "push", out, "alice/tiny", "--revision", "tp2", "--private", ok=False), "HF_HUB_OFFLINE")
    assert "unset HF_HUB_OFFLINE" in line and f"retry with `{retry}`" in line, line
    with HubServer() as hub:  # the network is back: the command the error named pushes the folder
        hub.state.tokens["hf_alice"] = "alice"
        command = shlex.split(line.split("retry with `")[1].rstrip("`"))
        assert command[:2] == ["reshard", "push"]
        assert "pushed" in hubenv.at(hub.endpoint).run(*command[1:]).stdout
        assert hub.state.repos["alice/tiny"].private and "reshard.json" in hub.state.files("alice/tiny", "tp2")


def test_convert_push_to_without_a_network_keeps_the_output_and_names_the_retry(tmp_path, hubenv):
    from test_hub import assert_one_line_error, closed_port_endpoint

    src = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    out = tmp_path / "m"
    line = assert_one_line_error(hubenv.at(closed_port_endpoint()).run(
        "convert", src, out, "--to", "megatron", "--tp", "2", "--push-to", "alice/tiny", ok=False),
        "cannot reach the Hub", f"retry with `reshard push {out} alice/tiny`")
    assert reshard.verify(src, str(out)).equal, line


def test_inspect_names_the_hub_repo_and_commit(layouts, tmp_path, hubenv):
    from hub_server import HubServer
    from test_hub import folder_files

    with HubServer() as hub:
        commit = hub.state.add_repo("org/tiny", folder_files(layouts["hf"]))
        text = hubenv.at(hub.endpoint, token=None).run("inspect", "hf://org/tiny").stdout
    assert text.startswith("hf://org/tiny\n  hub          org/tiny@main (commit " + commit[:12] + ")\n"), text
    assert "{" not in text and "  layout       hf\n" in text
