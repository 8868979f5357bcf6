"""YaRN RoPE to Megatron for standard attention (reshard/layouts/megatron_yarn.py; families-2.md sections 12, 17).

Tiny fp32 transformers models with seeded noise: a Llama with yarn (factor 4 over an original length of 16, no
mscale: cos/sin scaled by 0.1 ln 4 + 1, ``truncate`` false) and Ministral 3 (tests/test_family_ministral3.py's:
yarn factor 16 over 8, mscale = mscale_all_dim = 1, ``llama_4_scaling_beta`` 0.1):
  - hf -> megatron tp2 -> hf: every tensor bit-equal, config.json verbatim (Ministral 3 with --max-seq 8);
  - the args hold the yarn values as the HF config states them (megatron-core's names);
  - megatron-core 0.16.1 builds GPTModel from reshard's args (tests/mcore_yarn_harness.py, 2 gloo ranks) and its
    logits equal transformers' within 1e-5 (Ministral 3 on 8 tokens, below the original length), while plain RoPE
    would differ by far more (slow);
  - an explicit attention_factor megatron-core does not derive, and a partial rotary head, are refused in one line
    naming the parameter, exit 2, nothing written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

from _mcore_helpers import run_isolated
from family_cases import assert_hf_back, families_fixture
from helpers import run_cli
from test_family_ministral3 import ARCHS as MINISTRAL_ARCHS, CASES as MINISTRAL_CASES

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")

HARNESS = Path(__file__).with_name("mcore_yarn_harness.py")
LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=1003, max_position_embeddings=64, tie_word_embeddings=False)
LLAMA_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
              "truncate": False}
CASES = {"llama_yarn": ("LlamaConfig", dict(LLAMA, rope_parameters=LLAMA_YARN)),
         "llama_yarn_factor": ("LlamaConfig", dict(LLAMA, rope_parameters=dict(LLAMA_YARN, attention_factor=1.5))),
         "llama_yarn_partial": ("LlamaConfig", dict(LLAMA, head_dim=16, rope_parameters=dict(
             LLAMA_YARN, partial_rotary_factor=0.5))),
         "ministral3": MINISTRAL_CASES["ministral3"]}
ARCHS = dict(dict.fromkeys(CASES, "LlamaForCausalLM"), ministral3=MINISTRAL_ARCHS["ministral3"])
families = families_fixture(transformers, CASES, ARCHS)
ATOL = 1e-5


def ids(seq: int) -> torch.Tensor:
    return torch.randint(0, 1003, (2, seq), generator=torch.Generator().manual_seed(3))


def rank_args(folder: Path, rank: int = 0) -> argparse.Namespace:
    torch.serialization.add_safe_globals([argparse.Namespace])
    path = next(folder.glob(f"*/mp_rank_{rank:02d}/model_optim_rng.pt"))
    return torch.load(path, map_location="cpu", weights_only=True)["args"]


def test_llama_yarn_round_trip_and_args(families, capsys):
    """No mscale and truncate false: megatron-core's get_mscale(factor) (mscale args None) and no rounding."""
    case = families("llama_yarn")
    meg = case.convert(capsys, "megatron_tp2", case.src, "--to", "megatron", "--tp", 2, "--megatron-spec", "local")
    args = rank_args(meg)
    assert args.position_embedding_type == "yarn"
    assert (args.yarn_rotary_scaling_factor, args.yarn_original_max_position_embeddings) == (4.0, 16)
    assert (args.yarn_beta_fast, args.yarn_beta_slow) == (32.0, 1.0)  # transformers' defaults when unset
    assert (args.yarn_mscale, args.yarn_mscale_all_dim, args.yarn_correction_range_round_to_int) == (None, None, False)
    assert_hf_back(transformers, case, case.convert(capsys, "hf_from_megatron", meg, "--to", "hf"), ids(20))


def test_ministral3_round_trip_and_args(families, capsys):
    case = families("ministral3")
    meg = case.convert(capsys, "megatron_tp2", case.src, "--to", "megatron", "--tp", 2, "--max-seq", 8,
                       "--megatron-spec", "local")
    args = rank_args(meg, 1)
    assert args.position_embedding_type == "yarn" and args.tensor_model_parallel_size == 2
    assert (args.yarn_rotary_scaling_factor, args.yarn_original_max_position_embeddings) == (16.0, 8)
    assert (args.yarn_mscale, args.yarn_mscale_all_dim, args.yarn_correction_range_round_to_int) == (1.0, 1.0, True)
    assert_hf_back(transformers, case, case.convert(capsys, "hf_from_megatron", meg, "--to", "hf"), ids(16))


@pytest.mark.parametrize("name, message", [
    ("llama_yarn_factor", "attention_factor"),
    ("llama_yarn_partial", "partial_rotary_factor")])
def test_inexpressible_yarn_refused(families, capsys, tmp_path, name, message):
    out, src = tmp_path / "out", families(name).src
    capsys.readouterr()
    code, _, err = run_cli(capsys, "convert", src, out, "--to", "megatron", "--tp", 2)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert message in err and "megatron-core" in err and "Traceback" not in err, err
    assert not out.exists()


def mcore_logits(folder: Path, tokens: torch.Tensor, tmp: Path) -> torch.Tensor:
    ids_path, out_path = tmp / "ids.pt", tmp / "logits.pt"
    torch.save(tokens, ids_path)
    run_isolated([sys.executable, HARNESS, folder, ids_path, out_path, "--nproc-per-node", "2"], 300.0)
    return torch.load(out_path, map_location="cpu", weights_only=True)["logits"]


def plain_rope_logits(case, tokens: torch.Tensor) -> torch.Tensor:
    """The same weights under plain RoPE (the teeth: yarn must matter far beyond the tolerance)."""
    config = case.model.config.to_dict()
    theta = case.model.config.rope_parameters["rope_theta"]
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    plain = type(case.model)(type(case.model.config).from_dict(config)).eval()
    plain.load_state_dict(case.model.state_dict())
    with torch.no_grad():
        return plain(tokens, use_cache=False).logits


@pytest.mark.slow
@pytest.mark.parametrize("name, seq, extra", [("llama_yarn", 20, ()), ("ministral3", 8, ("--max-seq", 8))])
def test_megatron_core_computes_transformers_yarn(families, capsys, tmp_path, record_property, name, seq, extra):
    case = families(name)
    meg = case.convert(capsys, "megatron_tp2", case.src, "--to", "megatron", "--tp", 2, *extra,
                       "--megatron-spec", "local")
    tokens = ids(seq)
    with torch.no_grad():
        expected = case.model(tokens, use_cache=False).logits
    got = mcore_logits(meg, tokens, tmp_path)
    assert got.shape == expected.shape
    err = (got - expected).abs().max().item()
    record_property("max_abs_logit_diff", err)
    assert err <= ATOL, f"megatron-core vs transformers: max |logit diff| {err:.3g}"
    if name == "ministral3":  # Ministral3's query scale needs both keys: compare the RoPE effect on Llama only
        return
    plain = (plain_rope_logits(case, tokens) - expected).abs().max().item()
    record_property("plain_rope_logit_diff", plain)
    assert plain > 100 * ATOL
