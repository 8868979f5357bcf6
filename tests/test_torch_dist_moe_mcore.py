"""torch_dist Mixture-of-Experts checkpoints against megatron-core itself, both ways.

``tests/mcore_moe_harness.py dist-save`` (a subprocess: gloo ranks on the CPU) builds megatron-core's MoE GPTModel
of a family (local spec, SequentialMLP experts, allgather dispatcher; sizes in the harness) from Megatron-LM args,
seeds every parameter, and saves it with ``dist_checkpointing.save`` as Megatron-LM's training loop does, with its
fp32 logits for fixed ids:

* Mixtral-like at TP 2 x EP 2, expert-TP 1 (world 2): every layer MoE, so megatron-core stacks the layers;
* Qwen2-MoE-like at TP 2 (a dense layer, a gated shared expert, q/k/v biases): per-layer keys;
* Qwen3-MoE-like at EP 2 (qk_layernorm, kv_channels 16 != hidden / heads).

Then ``reshard convert --to hf`` must give transformers the same logits (fp32, 1e-5), and that HF folder
``reshard convert --to torch_dist`` must load into megatron-core strictly (``dist_checkpointing.load`` at
Megatron-LM's default strictness, then ``load_state_dict(strict=True)``) at other TP / EP / expert-TP degrees and
compute transformers' logits (1e-5). No harness process outlives its test.

The Mixtral case runs in the default suite (about 40 s on two cores); the other two families are ``slow``::

    python -m pytest -q tests/test_torch_dist_moe_mcore.py -m "slow or not slow"
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import reshard

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'reshard[test]')")
transformers = pytest.importorskip("transformers")
from test_mcore_dist_fixtures import run_harness  # noqa: E402

HARNESS = Path(__file__).with_name("mcore_moe_harness.py")
ATOL = 1e-5
SAVED_AT = {"mixtral": (2, 2, 1), "qwen2_moe": (2, 1, 2), "qwen3_moe": (1, 2, 1)}  # (tp, ep, etp)
LOADED_AT = {"mixtral": [(1, 1, 1), (2, 1, 2)], "qwen2_moe": [(1, 2, 1), (2, 2, 1)], "qwen3_moe": [(2, 1, 2)]}
ARCH = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def harness(*args, timeout: float = 300.0):
    """Run the harness in its own session; fail on error, timeout or a process of it left behind."""
    return run_harness(HARNESS, *args, timeout=timeout)


def degrees(tp, ep, etp):
    return ["--tp", tp, "--ep", ep, "--etp", etp]


def hf_logits(folder, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return type(model).__name__, model(input_ids=ids, use_cache=False).logits


FAMILY_PARAMS = [f if f == "mixtral" else pytest.param(f, marks=pytest.mark.slow) for f in sorted(SAVED_AT)]


@pytest.fixture(scope="module", params=FAMILY_PARAMS)
def saved(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(f"mcore_{family}")
    harness("dist-save", root / "mcore", "--family", family, *degrees(*SAVED_AT[family]))
    reference = torch.load(root / "mcore" / "reference.pt", weights_only=True)
    torch.save(reference["input_ids"], root / "ids.pt")
    return family, root, reference


def test_megatron_core_save_to_hf_logits(saved):
    family, root, reference = saved
    reshard.convert(str(root / "mcore"), str(root / "hf"), to="hf")
    arch, logits = hf_logits(root / "hf", reference["input_ids"])
    assert arch == ARCH[family]
    err = (logits - reference["logits"]).abs().max().item()
    assert err <= ATOL, f"{family}: transformers vs megatron-core max |logit diff| {err:.3g}"


def test_hf_to_torch_dist_loads_strictly_at_other_degrees(saved):
    family, root, reference = saved
    if not (root / "hf").exists():
        reshard.convert(str(root / "mcore"), str(root / "hf"), to="hf")
    _, expected = hf_logits(root / "hf", reference["input_ids"])
    out = root / "td"
    reshard.convert(str(root / "hf"), str(out), to="torch_dist")
    for tp, ep, etp in LOADED_AT[family]:
        result = root / f"loaded_{tp}{ep}{etp}.pt"
        harness("dist-load", out, result, "--ids", root / "ids.pt", *degrees(tp, ep, etp))
        got = torch.load(result, weights_only=True)["logits"]
        err = (got - expected).abs().max().item()
        assert err <= ATOL, f"{family} at tp {tp} ep {ep} etp {etp}: megatron-core vs transformers {err:.3g}"
