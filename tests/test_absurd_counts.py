"""Absurd counts (issue 42, item 3): a layer, expert or head count of 10^9 in config.json (or a Megatron args
record) is refused in one line, exit 2, within a second or two and without allocating: the CLI runs in a
subprocess whose address space is capped at 2 GiB, where a 10^9-entry table could not be built (it used to end in
"internal error: MemoryError" after 12-19 s)."""

from __future__ import annotations

import glob
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import reshard
from checkpoints import make_hf
from deepseek_checkpoints import save_tiny

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")

BIG = 10 ** 9
ADDRESS_SPACE = 2 << 30
SECONDS = 2.0
MEGATRON_SECONDS = 5.0  # reading a Megatron rank file imports torch (about a second) before anything is checked


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Tiny sources: a 2-layer Llama (8 heads of 8, 2 KV heads), Mixtral with 4 experts on 2 layers (per expert,
    and transformers 5's fused form), a 4-layer DeepSeek-V3 with 8 routed experts, and the Llama in Megatron tp 2."""
    root = tmp_path_factory.mktemp("absurd")
    made = {"llama": Path(make_hf(root / "llama", layers=2, heads=8, kv_heads=2, hidden=64))}
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, vocab_size=64, max_position_embeddings=64)
    config.architectures = ["MixtralForCausalLM"]
    model = transformers.MixtralForCausalLM(config)
    model.save_pretrained(root / "mixtral")
    model.save_pretrained(root / "mixtral_fused", save_original_format=False)
    made.update(mixtral=root / "mixtral", mixtral_fused=root / "mixtral_fused",
                deepseek=Path(save_tiny(str(root / "deepseek"), kind="v3", mtp=False)))
    reshard.convert(str(made["llama"]), str(root / "megatron"), to="megatron", tp=2)
    made["megatron"] = root / "megatron"
    return made


def run_capped(*args) -> tuple[int, str, float]:
    """``reshard ARGS`` in a subprocess with a 2 GiB address space: (exit code, stderr, seconds)."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], capture_output=True, text=True,
                          preexec_fn=cap, timeout=120, env=dict(os.environ, RESHARD_DEBUG=""))
    return proc.returncode, proc.stderr, time.monotonic() - start


def assert_refused(code: int, err: str, seconds: float, *phrases: str, limit: float = SECONDS) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "MemoryError" not in err, err
    assert all(p in lines[0] for p in phrases), lines[0]
    assert seconds < limit, f"refused after {seconds:.1f} s"


#: (source, config key, what the message says the weights hold: from how the fixture built them)
CASES = [
    ("llama", "num_hidden_layers", "the weights hold 2 layers (0..1)"),
    ("llama", "num_attention_heads", "q_proj.weight has 64 rows"),
    ("llama", "num_key_value_heads", "k_proj.weight has 16 rows"),
    ("mixtral", "num_local_experts", "the weights hold 4 experts (0..3)"),
    ("mixtral_fused", "num_local_experts", "the weights stack 4 experts"),
    ("deepseek", "n_routed_experts", "the weights hold 8 experts (0..7)"),
    ("deepseek", "num_hidden_layers", "the weights hold 4 layers (0..3)"),
]


@pytest.mark.parametrize("source,key,held", CASES, ids=[f"{s}-{k}" for s, k, _ in CASES])
def test_an_absurd_count_in_config_json_is_refused_in_one_line(folders, tmp_path, source, key, held):
    bad = shutil.copytree(folders[source], tmp_path / source)
    config = json.loads((bad / "config.json").read_text())
    config[key] = BIG
    (bad / "config.json").write_text(json.dumps(config))
    assert_refused(*run_capped("inspect", bad), f"config.json: {key} is {BIG} but", held, "fix the config")


@pytest.mark.parametrize("arg,phrase", [("num_layers", "the rank files hold 2 layers but args say"),
                                        ("num_query_groups", f"KV head count (num_key_value_heads) is {BIG}")])
def test_an_absurd_count_in_megatron_args_is_refused_in_one_line(folders, tmp_path, arg, phrase):
    bad = shutil.copytree(folders["megatron"], tmp_path / "megatron")
    for path in glob.glob(str(bad / "release" / "*" / "model_optim_rng.pt")):
        state = torch.load(path, weights_only=False)
        setattr(state["args"], arg, BIG)
        torch.save(state, path)
    assert_refused(*run_capped("inspect", bad), phrase, limit=MEGATRON_SECONDS)
