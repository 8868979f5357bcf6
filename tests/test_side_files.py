"""Side files (issue 42, item 4 and 6c): the remote code ``auto_map`` names in config.json and tokenizer_config.json,
the modules it imports and the tokenizer files declared, byte-identical through Megatron, torch_dist and vLLM and
back to HF; ``auto_map`` dropped with a note where the code is not in the source; a side file's symlink loop
exits 3 as a weight's does."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import reshard
from checkpoints import make_hf
from helpers import run_cli
from reshard.side_files import code_files

AUTO_MAP = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM",
            "AutoModel": "other/repo--modeling_other.Other"}  # another repo's code: nothing local
TOKENIZER_CONFIG = {"tokenizer_class": "XTokenizer", "merges_file": "x_merges.txt",
                    "auto_map": {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}}
FILES = {
    "configuration_x.py": "from transformers import PretrainedConfig\n\n\nclass XConfig(PretrainedConfig):\n"
                          "    model_type = \"llama\"\n",
    "modeling_x.py": "from .configuration_x import XConfig\nfrom .x_utils import helper\n\n\n"
                     "class XForCausalLM:\n    config_class = XConfig\n",
    "x_utils.py": "def helper():\n    return 1\n",  # named by no auto_map: imported by modeling_x.py
    "tokenization_x.py": "VOCAB_FILES_NAMES = {\"vocab_file\": \"tiktoken.model\", \"emoji_file\": \"x_emoji.json\"}"
                         "\n\n\nclass XTokenizer:\n    vocab_files_names = VOCAB_FILES_NAMES\n",
    "tiktoken.model": "IQ== 0\nIg== 1\n",
    "x_emoji.json": "{\"smile\": 1}\n",  # declared by the tokenizer module only
    "x_merges.txt": "a b\n",  # declared by tokenizer_config.json only
    "chat_template.jinja": "{{ messages }}\n",
    "tokenizer_config.json": json.dumps(TOKENIZER_CONFIG, indent=2) + "\n",
}
ROUTES = {"megatron": {"tp": 2}, "vllm": {"tp": 2}, "torch_dist": {"tp": 2}}


@pytest.fixture(scope="module")
def remote_code_model(tmp_path_factory) -> str:
    """A tiny Llama whose config.json and tokenizer_config.json name remote code, with a stray ``scratch.py``."""
    path = make_hf(str(tmp_path_factory.mktemp("side") / "hf"), vocab=1004)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "auto_map": AUTO_MAP}, f, indent=2)
    for name, text in {**FILES, "scratch.py": "print('not imported')\n"}.items():
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
    return path


def _bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _config(folder) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def _round_trip(src: str, tmp_path, via: str) -> str:
    middle, back = str(tmp_path / via), str(tmp_path / f"{via}-hf")
    reshard.convert(src, middle, to=via, **ROUTES[via])
    reshard.convert(middle, back, to="hf")
    return back


@pytest.mark.parametrize("via", sorted(ROUTES))
def test_remote_code_and_tokenizer_files_survive_a_round_trip(remote_code_model, tmp_path, via):
    back = _round_trip(remote_code_model, tmp_path, via)
    for name in [*FILES, "generation_config.json"]:
        assert _bytes(os.path.join(back, name)) == _bytes(os.path.join(remote_code_model, name)), name
    assert not os.path.exists(os.path.join(back, "scratch.py"))  # imported by nothing auto_map names
    assert _config(back)["auto_map"] == AUTO_MAP


def test_code_not_in_a_megatron_source_drops_auto_map_with_a_note(remote_code_model, tmp_path, capsys):
    meg = tmp_path / "meg"
    reshard.convert(remote_code_model, str(meg), to="megatron", tp=2)
    for name in os.listdir(meg):  # a checkpoint trained elsewhere: its args' hf_config names code it lacks
        if name.endswith(".py"):
            os.remove(meg / name)
    code, _, err = run_cli(capsys, "convert", meg, tmp_path / "back", "--to", "hf")
    assert code == 0, err
    assert ("note: dropped auto_map from config.json: the remote-code files it names (configuration_x.py, "
            "modeling_x.py) are not in the source") in err, err
    config = _config(tmp_path / "back")
    assert "auto_map" not in config and config["architectures"] == ["LlamaForCausalLM"]


def test_transformers_loads_the_round_tripped_config_with_its_code(remote_code_model, tmp_path):
    back = _round_trip(remote_code_model, tmp_path, "megatron")
    script = ("import sys\nfrom transformers import AutoConfig\n"
              "c = AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
              "print(type(c).__name__, c.hidden_size)\n")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf_home")}
    proc = subprocess.run([sys.executable, "-c", script, back], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["XConfig", "64"], proc.stdout


def test_code_symlinked_out_of_the_source_is_skipped_and_auto_map_dropped(remote_code_model, tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for name in os.listdir(remote_code_model):
        os.symlink(os.path.join(remote_code_model, name), src / name)  # every file a symlink out of src
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "hf")
    assert code == 0, err
    assert "skipped" in err and "modeling_x.py" in err and "--follow-symlinks" in err, err
    assert "auto_map" not in _config(tmp_path / "out") and not os.path.exists(tmp_path / "out" / "modeling_x.py")
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out2", "--to", "hf", "--follow-symlinks")
    assert code == 0, err
    assert _config(tmp_path / "out2")["auto_map"] == AUTO_MAP
    assert _bytes(tmp_path / "out2" / "tokenization_x.py") == FILES["tokenization_x.py"].encode()


def test_imports_that_are_not_simple_carry_every_top_level_module(tmp_path):
    (tmp_path / "modeling_x.py").write_text("from ..elsewhere import thing\n")
    (tmp_path / "helper_a.py").write_text("A = 1\n")
    (tmp_path / "notes.txt").write_text("not code\n")
    assert code_files(str(tmp_path), ["modeling_x.py"])[0] == ["helper_a.py", "modeling_x.py"]
    (tmp_path / "modeling_x.py").write_text("from . import helper_a\nimport torch\n")
    assert code_files(str(tmp_path), ["modeling_x.py"])[0] == ["modeling_x.py", "helper_a.py"]


def test_a_side_file_symlink_loop_exits_3_like_a_weight(remote_code_model, tmp_path, capsys):
    meg = tmp_path / "meg"
    reshard.convert(remote_code_model, str(meg), to="megatron", tp=2)
    os.symlink("tokenizer.model", meg / "tokenizer.model")  # a link to itself: ELOOP
    # the iteration folder named directly: its Megatron root, whose tracker names it, holds the side files
    code, _, err = run_cli(capsys, "convert", meg / "release", tmp_path / "out", "--to", "hf")
    assert code == 3, err
    assert err.strip().endswith("tokenizer.model: Too many levels of symbolic links [ELOOP]; check the path and "
                                "the disk"), err
    assert not os.path.exists(tmp_path / "out")
    weights = tmp_path / "weights"  # the same loop in a weight's place: the same exit code and wording
    weights.mkdir()
    for name in ("config.json", "generation_config.json"):
        os.symlink(os.path.join(remote_code_model, name), weights / name)
    os.symlink("model.safetensors", weights / "model.safetensors")
    code, _, weight_err = run_cli(capsys, "convert", weights, tmp_path / "out2", "--to", "hf")
    assert code == 3, weight_err
    assert weight_err.strip().endswith("model.safetensors: Too many levels of symbolic links [ELOOP]; check the "
                                       "path and the disk"), weight_err
