"""DeepSeek-V3 / V2-Lite-shaped models against megatron-core 0.16.1's own MLA + MoE (+ MTP) GPTModel on the CPU.

``tests/mcore_mla_harness.py`` (subprocesses, world <= 2 over gloo) builds megatron-core's model from Megatron-LM
args (multi-latent attention, yarn RoPE, routed + shared experts, a dense first layer; V3: sigmoid router with a
non-zero expert bias, 4 groups keeping 2, top-4, scaling 2.5, one MTP layer; V2-Lite: no q LoRA, softmax over all
experts before the top-k), saves it with ``dist_checkpointing.save`` and loads checkpoints strictly.  The oracles are
megatron-core and transformers (``deepseek_checkpoints.logits``), fp32, 1e-5:

* megatron-core's saves at TP/EP 1 and 2 -> ``reshard convert --to hf`` -> transformers' logits = megatron-core's;
* that HF -> reshard's ``torch_dist`` (tp / ep / etp variations) and ``torch`` (``--megatron-spec local``) outputs
  -> megatron-core loads them strictly at other degrees and computes transformers' logits, and, where the MTP layer
  is kept, the MTP logits of its own model;
* an HF V3 with yarn (every yarn parameter off its default; mscale alone) -> Megatron args spelling each, and
  megatron-core's logits = transformers'; the tolerance rejects megatron-core's mscale_all_dim default and dropped
  group limits;
* routings megatron-core computes differently are refused at plan time.

The megatron-core tests take about two minutes on two cores: they are ``slow``::

    python -m pytest -q tests/test_deepseek_mcore.py -m "slow or not slow"
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest
import torch

import reshard
from deepseek_checkpoints import logits as tf_logits
from deepseek_checkpoints import save_tiny
from helpers import run_cli

HARNESS = Path(__file__).with_name("mcore_mla_harness.py")
ATOL = 1e-5
IDS = [3, 17, 5, 99, 42, 7, 64, 1, 88, 23, 120, 9]  # inside every vocab here (128 and 200)
#: megatron-core's own saves: kind, MTP, (tp, ep, etp) (world max(tp, ep * etp))
SAVES = {"v3_w1": ("v3", True, (1, 1, 1)), "v3_tp2_ep2": ("v3", True, (2, 2, 1)),
         "v2_tp2_ep2": ("v2", False, (2, 2, 1))}
#: HF V3 sources with yarn: every parameter off its transformers / megatron-core default (mscale != mscale_all_dim:
#: both factors act); mscale without mscale_all_dim (transformers then ignores it: cos/sin by get_mscale(factor))
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.8}
HF_SOURCES = {"yarn": YARN, "yarn_mscale_only": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 16, "mscale": 0.707}}
#: reshard outputs megatron-core loads: id -> (HF source, target, convert options, load degrees (tp, ep, etp)).
#: torch_dist drops the MTP layer (see test_torch_dist_keeps_mtp).
LOADS = {
    "v3_torch_dist_tp2_ep2_etp1": ("v3_tp2_ep2", "torch_dist", dict(tp=2, ep=2, etp=1, drop_mtp=True), (2, 1, 2)),
    "v3_torch_dist_tp2_etp2": ("v3_w1", "torch_dist", dict(tp=2, drop_mtp=True), (2, 2, 1)),
    "v3_torch_dist_ep2": ("v3_w1", "torch_dist", dict(ep=2, drop_mtp=True), (1, 1, 1)),
    "v3_torch_tp2_ep2_etp1": ("v3_tp2_ep2", "megatron", dict(tp=2, ep=2, etp=1), (2, 2, 1)),
    "v3_torch_tp2": ("v3_w1", "megatron", dict(tp=2), (2, 1, 2)),
    "v3_torch_ep2": ("v3_tp2_ep2", "megatron", dict(ep=2), (1, 2, 1)),
    "v2_torch_dist_tp2": ("v2_tp2_ep2", "torch_dist", dict(tp=2), (1, 2, 1)),
    "v2_torch_tp2_ep2_etp1": ("v2_tp2_ep2", "megatron", dict(tp=2, ep=2, etp=1), (2, 2, 1)),
    "yarn_torch_tp2": ("yarn", "megatron", dict(tp=2), (2, 1, 2)),
    "yarn_torch_dist": ("yarn", "torch_dist", dict(ep=2), (1, 2, 1)),
    "yarn_mscale_only_torch": ("yarn_mscale_only", "megatron", {}, (1, 1, 1)),
}
#: deliberately wrong args on a copy of a torch output (the tolerance must reject each)
BROKEN = {"yarn_mscale_all_dim_default": ("yarn_torch_tp2", dict(mscale_all_dim=0.0)),
          "v3_groups_dropped": ("v3_torch_tp2", dict(moe_router_num_groups=None, moe_router_group_topk=None))}

slow = pytest.mark.slow


def harness(*args, timeout: float = 500.0):
    """Run the harness in its own session; fail on error, timeout or a process of it left behind."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'reshard[test]')")
    from test_mcore_dist_fixtures import run_harness

    return run_harness(HARNESS, *args, timeout=timeout)


def degrees(tp: int, ep: int, etp: int) -> list:
    return ["--tp", tp, "--ep", ep, "--etp", etp]


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek_mcore")
    torch.save(torch.tensor([IDS]), folder / "ids.pt")
    return folder


@pytest.fixture(scope="module")
def saved(root):
    """megatron-core's own saves (on first use) with their reference and reshard's HF conversion of each."""
    cache = {}

    def get(name: str):
        if name not in cache:
            kind, mtp, grid = SAVES[name]
            out = root / name
            harness("save", out, "--kind", kind, *(["--mtp"] if mtp else []), *degrees(*grid), "--ids",
                    root / "ids.pt")
            reshard.convert(str(out), str(root / f"{name}_hf"), to="hf")
            cache[name] = (out, root / f"{name}_hf", torch.load(out / "reference.pt", weights_only=True))
        return cache[name]
    return get


@pytest.fixture(scope="module")
def loaded(root, saved):
    """Every reshard output of LOADS (and the BROKEN copies) loaded by megatron-core: one harness run per set of
    load degrees; id -> {"logits", ...} and the transformers logits of its HF source."""
    sources = {name: Path(save_tiny(str(root / f"{name}_hf"), kind="v3", mtp=False, rope_parameters=dict(rope)))
               for name, rope in HF_SOURCES.items()}
    sources.update({name: saved(name)[1] for name in SAVES})
    expected = {name: tf_logits(str(folder), IDS) for name, folder in sources.items()}
    jobs: dict[tuple, list] = {}
    for case, (source, target, options, grid) in LOADS.items():
        out = root / case
        reshard.convert(str(sources[source]), str(out), to=target, megatron_spec="local" if target == "megatron"
                        else None, **options)
        jobs.setdefault(grid, []).append((case, out))
    for case, (base, changes) in BROKEN.items():
        out = root / case
        shutil.copytree(root / base, out)
        torch.serialization.add_safe_globals([argparse.Namespace])
        for rank_file in out.glob("release/mp_rank_*/model_optim_rng.pt"):
            blob = torch.load(rank_file, weights_only=True)
            vars(blob["args"]).update(changes)
            torch.save(blob, rank_file)
        jobs.setdefault(LOADS[base][3], []).append((case, out))
    results = {}
    for grid, cases in jobs.items():
        pairs = [p for case, out in cases for p in (out, root / f"{case}.pt")]
        harness("load", "--ids", root / "ids.pt", *degrees(*grid), *pairs)
        results.update({case: torch.load(root / f"{case}.pt", weights_only=True) for case, _ in cases})
    return results, expected


# ---- megatron-core's own saves -> HF ----

@slow
@pytest.mark.parametrize("name", sorted(SAVES))
def test_megatron_core_save_to_hf_logits(saved, name):
    """megatron-core's dist-saved MLA + MoE model converts to HF with transformers computing its logits (1e-5);
    the V3 HF keeps the MTP layer (model.layers.3) and every yarn parameter the args set."""
    ckpt, hf, reference = saved(name)
    e = err(tf_logits(str(hf), IDS), reference["logits"][0])
    assert e <= ATOL, f"{name}: transformers vs megatron-core max |logit diff| {e:.3g}"
    import json
    config = json.loads((hf / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
            "beta_slow": 1.0, **({"mscale": 1.0, "mscale_all_dim": 1.0} if name.startswith("v3")
                                 else {"mscale": 0.707, "mscale_all_dim": 0.707})}
    scaling = config.get("rope_scaling") or config.get("rope_parameters")
    assert {k: scaling.get(k) for k in yarn} == yarn, scaling
    if SAVES[name][1]:
        assert config["num_nextn_predict_layers"] == 1
        from safetensors import safe_open
        with safe_open(str(hf / "model.safetensors"), "pt") as f:
            assert "model.layers.3.eh_proj.weight" in set(f.keys())


# ---- reshard's outputs -> megatron-core ----

@slow
@pytest.mark.parametrize("case", sorted(LOADS))
def test_reshard_output_loads_strictly_into_megatron_core(loaded, saved, case):
    """megatron-core loads reshard's output strictly (the harness asserts no missing / unexpected key) at other
    degrees and reproduces transformers' logits of the HF source; with the MTP layer kept, the MTP logits of the
    megatron-core model the HF came from (transformers does not run MTP)."""
    results, expected = loaded
    source, _, options, _ = LOADS[case]
    got = results[case]
    e = err(got["logits"][0], expected[source])
    assert e <= ATOL, f"{case}: megatron-core vs transformers max |logit diff| {e:.3g}"
    if source in SAVES and SAVES[source][1] and not options.get("drop_mtp"):
        reference = saved(source)[2]
        e = err(got["mtp_logits"], reference["mtp_logits"])
        assert e <= ATOL, f"{case}: MTP logits vs the megatron-core model it came from: {e:.3g}"
    else:
        assert "mtp_logits" not in got


@slow
@pytest.mark.parametrize("case", sorted(BROKEN))
def test_tolerance_catches(loaded, case):
    """Teeth: megatron-core's mscale_all_dim default (0.0) or a dropped group limit moves the logits far past the
    tolerance, so the yarn and routing checks above are not vacuous."""
    results, expected = loaded
    source = LOADS[BROKEN[case][0]][0]
    e = err(results[case]["logits"][0], expected[source])
    assert e > 100 * ATOL, f"{case} moves the logits by only {e:.3g}"


@slow
def test_yarn_args_spelled_explicitly(loaded, root):
    """Every yarn parameter of the HF config is in the Megatron args, none left at megatron-core's defaults."""
    torch.serialization.add_safe_globals([argparse.Namespace])
    args = torch.load(root / "yarn_torch_tp2" / "release" / "mp_rank_00" / "model_optim_rng.pt",
                      weights_only=True)["args"]
    wanted = dict(rope_type="yarn", rotary_scaling_factor=4.0, original_max_position_embeddings=16, beta_fast=16.0,
                  beta_slow=2.0, mscale=1.0, mscale_all_dim=0.8, rotary_base=10000)
    assert {k: getattr(args, k, "<absent>") for k in wanted} == wanted


@slow
def test_torch_dist_keeps_mtp(root, saved):
    """reshard's torch_dist output with the MTP layer loads strictly and reproduces megatron-core's MTP logits."""
    _, hf, reference = saved("v3_w1")
    out = root / "v3_torch_dist_mtp"
    reshard.convert(str(hf), str(out), to="torch_dist")
    harness("load", "--ids", root / "ids.pt", out, root / "v3_torch_dist_mtp.pt")
    got = torch.load(root / "v3_torch_dist_mtp.pt", weights_only=True)
    assert err(got["mtp_logits"], reference["mtp_logits"]) <= ATOL


@slow
def test_local_spec_torch_dist_reads(root):
    """A torch_dist folder megatron-core saves with the MLA local spec's own keys (q_layernorm / kv_layernorm)
    converts to HF, and reshard's torch_dist output of it loads strictly under those keys again."""
    out = root / "v3_local_keys"
    harness("save", out, "--kind", "v3", "--keys", "local", "--ids", root / "ids.pt")
    reshard.convert(str(out), str(root / "v3_local_keys_hf"), to="hf")
    reference = torch.load(out / "reference.pt", weights_only=True)
    assert err(tf_logits(str(root / "v3_local_keys_hf"), IDS), reference["logits"][0]) <= ATOL
    back = root / "v3_local_keys_dist"
    reshard.convert(str(root / "v3_local_keys_hf"), str(back), to="torch_dist")
    harness("load", "--keys", "local", "--ids", root / "ids.pt", back, root / "v3_local_keys_dist.pt")
    assert err(torch.load(root / "v3_local_keys_dist.pt", weights_only=True)["logits"], reference["logits"]) <= ATOL


# ---- routings megatron-core computes differently: refused at plan time ----

@pytest.fixture(scope="module")
def refused_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_refused")
    return {
        # groups ranked by their top-2 sum, megatron-core by the sum of the best 2/2 = 1
        "v3_topk_not_2x_group_topk": save_tiny(str(root / "v3"), kind="v3", mtp=False, num_experts_per_tok=2,
                                               n_group=4, topk_group=2),
        # DeepSeek-V2's group_limited_greedy ranks a group by its best score
        "v2_group_limited_greedy": save_tiny(str(root / "v2"), kind="v2", topk_method="group_limited_greedy",
                                             n_group=4, topk_group=2, num_experts_per_tok=4),
        # transformers scales yarn's cos/sin by get_mscale(factor) without mscale, megatron-core by a ratio
        "yarn_mscale_all_dim_only": save_tiny(str(root / "yarn"), kind="v3", mtp=False, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "mscale_all_dim": 1.0}),
    }


@pytest.mark.parametrize("target", ["megatron", "torch_dist"])
@pytest.mark.parametrize("case, field", [("v3_topk_not_2x_group_topk", "router_group_score"),
                                         ("v2_group_limited_greedy", "router_group_score"),
                                         ("yarn_mscale_all_dim_only", "rope_scaling")])
def test_routing_megatron_computes_differently_is_refused(refused_sources, tmp_path, capsys, case, field, target):
    """One line naming the field, exit 2, nothing written."""
    out = tmp_path / "out"
    code, _, stderr = run_cli(capsys, "convert", refused_sources[case], out, "--to", target)
    lines = stderr.strip().splitlines()
    assert code == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and field in lines[0], stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []
