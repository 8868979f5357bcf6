"""Nemotron-H (``NemotronHForCausalLM``, mappings/nemotron_h.toml; families-2.md sections 10, 13, 15, 17).

A tiny transformers Nemotron-H (fp32, hidden 64, layers ``M * - M``: Mamba2 with 8 heads of 16, 2 groups, state 16,
conv 4; attention 4 heads / 2 KV heads of 16; relu2 MLP 96; vocab 512; seeded noise on every parameter, so A_log,
D, dt_bias and the norms are not their init values), saved with save_pretrained (``backbone.`` tensors, its
config.json with ``time_step_limit [0, {"__float__": "Infinity"}]``):
  - hf -> vllm tp2 -> hf: config.json verbatim; every tensor bit-equal but A_log, which vLLM stores as
    A = -exp(A_log) in fp32 (families-2.md 10.3: not invertible bit for bit in fp32; within one fp32 ulp here),
    and bit-equal for a bf16 model (every bf16 A_log with 1.6e-5 < |A_log| < 80 comes back exactly); logits equal;
  - vLLM rank names / shapes = the probe's fresh key set (NOTES.md section 3, 31 keys per rank), mixer.A the rule;
  - hf -> megatron (torch) tp2 -> hf and hf -> torch_dist tp2 -> hf bit-exact with config.json verbatim; the
    torch_dist keys and global / local shapes = ``mcore_mamba.py 2``'s (section 10.2, local spec names), the args
    a MambaModel run;
  - the release spelling (hybrid_override_pattern, num_hidden_layers) reads as the list;
  - Mamba groups not divisible by TP refused for megatron and vllm (section 17 wording), one line, exit 2; MoE
    layers refused by kind;
  - the forward verifier (forward/mamba2.py: the Mamba2 mixer as a token-by-token fp32 recurrence) computes
    transformers' logits (torch fallback) within 1e-5 at tp1 and at tp 2 (heads and groups per rank, partial
    out_proj sums all-reduced); ``verify --forward`` passes against the vLLM tp2 output (and Megatron tp2, slow) and
    fails naming layer 0 on a perturbed conv1d weight;
  - inspect, plan and load_rank.
"""

from __future__ import annotations

import json

import pytest
import torch

import reshard
from family_cases import families_fixture, verify_forward, verify_perturbed_vllm
from family_rules import diff_states, load_hf_dir, load_megatron_rank, load_vllm_rank
from helpers import run_cli
from reshard.layouts.base import Options
from reshard.verification.forward.decoder import TPGroup, cast_weights, forward
from reshard.verification.forward.sliced_rank import load_rank as load_hf_rank

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")

KINDS = ["linear_attention", "full_attention", "mlp", "linear_attention"]
SETTINGS = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                vocab_size=512, layers_block_type=KINDS, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
                ssm_state_size=16, conv_kernel=4, expand=2, chunk_size=8, tie_word_embeddings=False)
families = families_fixture(transformers, {"nemotron_h": ("NemotronHConfig", SETTINGS)},
                            {"nemotron_h": "NemotronHForCausalLM"})
REFUSAL = "Mamba groups (2) must divide the tensor-parallel size (4)."


@pytest.fixture(scope="module")
def nh(families):
    return families("nemotron_h")


def ids() -> torch.Tensor:
    return torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))


def raw_config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def logits(folder) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids(), use_cache=False).logits


def a_logs(state: dict) -> list[str]:
    return [k for k in state if k.endswith("mixer.A_log")]


def test_source_has_every_kind_and_infinity(nh):
    assert raw_config(nh.src)["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    assert {k.split(".")[4] for k in nh.hf if k.startswith("backbone.layers.")} >= {"in_proj", "q_proj", "up_proj"}


def test_vllm_round_trip(nh, capsys):
    v = nh.vllm(capsys)
    assert raw_config(v) == raw_config(nh.src)
    back = nh.convert(capsys, "hf_from_vllm", v, "--to", "hf")
    got, _ = load_hf_dir(back)
    assert raw_config(back) == raw_config(nh.src)
    exact = {k: t for k, t in nh.hf.items() if not k.endswith("A_log")}
    assert not diff_states({k: t for k, t in got.items() if k in exact or not k.endswith("A_log")}, exact, "hf")
    assert set(got) == set(nh.hf)
    for k in a_logs(nh.hf):  # fp32: log(-(-exp(x))) is x to within one ulp (families-2.md 10.3)
        assert torch.equal(-torch.exp(got[k]), -torch.exp(nh.hf[k])) or \
            torch.equal(torch.nextafter(got[k], nh.hf[k]), nh.hf[k]), k
    assert (logits(back) - nh.model(ids(), use_cache=False).logits).abs().max().item() <= 1e-6


def test_vllm_reshard_copies_a(nh, capsys):
    """vllm tp2 -> vllm tp1: the transform and its inverse cancel, A copied bit for bit."""
    v1 = nh.convert(capsys, "vllm_tp1_from_tp2", nh.vllm(capsys), "--to", "vllm", "--tp", 1)
    a = load_vllm_rank(v1, 0)["model.layers.0.mixer.A"]
    assert torch.equal(a, torch.cat([load_vllm_rank(nh.vllm(capsys), r)["model.layers.0.mixer.A"] for r in range(2)]))


@pytest.mark.slow
def test_bf16_vllm_round_trip_is_bit_exact(nh, capsys):
    bf = nh.convert(capsys, "hf_bf16", nh.src, "--to", "hf", "--dtype", "bf16")
    v = nh.convert(capsys, "vllm_bf16", bf, "--to", "vllm", "--tp", 2)
    back = nh.convert(capsys, "hf_bf16_back", v, "--to", "hf")
    want, _ = load_hf_dir(bf)
    got, _ = load_hf_dir(back)
    assert want["backbone.layers.0.mixer.A_log"].dtype == torch.bfloat16
    assert not diff_states(got, want, "hf")
    assert raw_config(back) == raw_config(bf)
    assert torch.equal(logits(back), logits(bf))


#: NOTES.md section 3, nemotron_h_dense (vllm_keys.py, tp 2; both ranks): 31 keys per rank.
VLLM_MAMBA = {"mixer.A": (4,), "mixer.D": (4,), "mixer.dt_bias": (4,), "mixer.conv1d.weight": (96, 1, 4),
              "mixer.conv1d.bias": (96,), "mixer.in_proj.weight": (164, 64), "mixer.out_proj.weight": (64, 64),
              "mixer.norm.weight": (64,), "norm.weight": (64,)}
VLLM_ATTN = {"mixer.qkv_proj.weight": (64, 64), "mixer.o_proj.weight": (64, 32), "norm.weight": (64,),
             **{f"mixer.attn._{s}_scale": () for s in ("k", "v", "q", "prob")}}
VLLM_MLP = {"mixer.up_proj.weight": (48, 64), "mixer.down_proj.weight": (64, 48), "norm.weight": (64,)}


def rank_slice(full: torch.Tensor, sizes: list[int], r: int) -> torch.Tensor:
    """The probe's rule: each section split in two, rank r's halves end to end."""
    return torch.cat([part.chunk(2)[r] for part in full.split(sizes)])


def test_vllm_rank_names_shapes_and_values(nh, capsys):
    v, hf = nh.vllm(capsys), nh.hf
    for r in range(2):
        got = load_vllm_rank(v, r)
        want = {"model.embed_tokens.weight": (256, 64), "model.norm_f.weight": (64,), "lm_head.weight": (256, 64)}
        for layer, kind in enumerate((VLLM_MAMBA, VLLM_ATTN, VLLM_MLP, VLLM_MAMBA)):
            want.update({f"model.layers.{layer}.{k}": s for k, s in kind.items()})
        assert {k: tuple(t.shape) for k, t in got.items()} == want
        p, q = "backbone.layers.3.mixer.", "model.layers.3.mixer."
        assert got[q + "A"].dtype == torch.float32
        assert torch.equal(got[q + "A"], -torch.exp(hf[p + "A_log"].float()).chunk(2)[r])
        assert torch.equal(got[q + "in_proj.weight"], rank_slice(hf[p + "in_proj.weight"], [128, 128, 32, 32, 8], r))
        assert torch.equal(got[q + "conv1d.weight"], rank_slice(hf[p + "conv1d.weight"], [128, 32, 32], r))
        assert torch.equal(got[q + "conv1d.bias"], rank_slice(hf[p + "conv1d.bias"], [128, 32, 32], r))
        assert torch.equal(got[q + "norm.weight"], hf[p + "norm.weight"].chunk(2)[r])
        assert torch.equal(got[q + "out_proj.weight"], hf[p + "out_proj.weight"].chunk(2, dim=1)[r])


@pytest.mark.parametrize("to", [pytest.param("megatron", marks=pytest.mark.slow), "torch_dist"])
def test_megatron_round_trip_is_exact(nh, capsys, to):
    m = nh.convert(capsys, f"{to}_tp2", nh.src, "--to", to, "--tp", 2)
    back = nh.convert(capsys, f"hf_from_{to}", m, "--to", "hf")
    got, _ = load_hf_dir(back)
    assert not diff_states(got, nh.hf, "hf")
    assert raw_config(back) == raw_config(nh.src)


def test_megatron_args_are_a_mamba_run(nh, capsys):
    m = nh.convert(capsys, "megatron_tp2", nh.src, "--to", "megatron", "--tp", 2)
    rank = load_megatron_rank(m / "release" / "mp_rank_01" / "model_optim_rng.pt")
    args = vars(rank["args"])
    assert (args["hybrid_override_pattern"], args["is_hybrid_model"], args["position_embedding_type"]) == \
        ("M*-M", True, "none")
    assert (args["mamba_num_heads"], args["mamba_head_dim"], args["mamba_num_groups"], args["mamba_state_dim"]) == \
        (8, 16, 2, 16)
    model, hf = rank["model"], nh.hf
    assert torch.equal(model["decoder.layers.0.mixer.in_proj.weight"],
                       rank_slice(hf["backbone.layers.0.mixer.in_proj.weight"], [128, 128, 32, 32, 8], 1))
    assert torch.equal(model["decoder.layers.0.mixer.A_log"], hf["backbone.layers.0.mixer.A_log"][4:])


#: NOTES.md section 5 (mcore_mamba.py 2, rank 0; torch_dist holds the TE spec's names): torch_dist key ->
#: (global, local) shape of a Mamba layer.
MCORE_MAMBA = {"mixer.dt_bias": ([8], [4]), "mixer.A_log": ([8], [4]), "mixer.D": ([8], [4]),
               "mixer.in_proj.weight.z": ([128, 64], [64, 64]), "mixer.in_proj.weight.x": ([128, 64], [64, 64]),
               "mixer.in_proj.weight.B": ([32, 64], [16, 64]), "mixer.in_proj.weight.C": ([32, 64], [16, 64]),
               "mixer.in_proj.weight.dt": ([8, 64], [4, 64]),
               **{f"mixer.conv1d.weight.{s}": ([n, 1, 4], [n // 2, 1, 4]) for s, n in (("x", 128), ("B", 32),
                                                                                          ("C", 32))},
               **{f"mixer.conv1d.bias.{s}": ([n], [n // 2]) for s, n in (("x", 128), ("B", 32), ("C", 32))},
               "mixer.norm.weight": ([128], [64]), "mixer.out_proj.weight": ([64, 128], [64, 64]),
               "mixer.in_proj.layer_norm_weight": ([64], [64])}  # the probe's local norm.weight, TE-fused (10.2)


def test_torch_dist_keys_and_shapes_are_mcores(nh, capsys):
    from reshard.io.dcp import read_metadata

    td = nh.convert(capsys, "torch_dist_tp2", nh.src, "--to", "torch_dist", "--tp", 2)
    tensors, _ = read_metadata(str(td / "release"))
    p = "decoder.layers.0."
    got = {k.removeprefix(p): ([*v.shape], [*v.chunks[0].sizes]) for k, v in tensors.items()
           if k.startswith(p) and "_extra_state" not in k}
    assert got == MCORE_MAMBA
    assert {"decoder.final_norm.weight", "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
            "decoder.layers.2.mlp.linear_fc1.layer_norm_weight"} <= set(tensors)


def test_release_pattern_spelling(nh, tmp_path, capsys):
    """The releases' config.json: hybrid_override_pattern and num_hidden_layers, no layers_block_type (and a bare
    Infinity, as json writes it)."""
    import shutil

    src = tmp_path / "release"
    shutil.copytree(nh.src, src)
    config = raw_config(src)
    del config["layers_block_type"]
    config.update(hybrid_override_pattern="M*-M", num_hidden_layers=4, time_step_limit=[0.0, float("inf")])
    (src / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "v", "--to", "vllm", "--tp", 2)
    assert code == 0, err
    assert raw_config(tmp_path / "v") == config
    assert set(load_vllm_rank(tmp_path / "v", 0)) == set(load_vllm_rank(nh.vllm(capsys), 0))


@pytest.mark.parametrize("to", ["megatron", "torch_dist", "vllm"])
def test_groups_not_dividing_tp_refused(nh, tmp_path, capsys, to):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", nh.src, out, "--to", to, "--tp", 4)
    assert code == 2 and err.strip() == f"error: {REFUSAL}", err
    assert not out.exists()


def test_moe_layers_refused(nh, tmp_path, capsys):
    """Nemotron 3's MoE layers (kind moe / E) are not mapped: refused by kind, one line, nothing written."""
    import shutil

    src, out = tmp_path / "moe", tmp_path / "out"
    shutil.copytree(nh.src, src)
    config = raw_config(src)
    config["layers_block_type"] = ["linear_attention", "moe", "mlp", "linear_attention"]
    (src / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "convert", src, out, "--to", "vllm", "--tp", 2)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "has 'moe'" in err, err
    assert not out.exists()


def test_inspect_plan_load_rank(nh, capsys):
    code, out, err = run_cli(capsys, "inspect", nh.src, "--json")
    assert code == 0 and json.loads(out)["architecture"] == "NemotronHForCausalLM", err
    code, out, err = run_cli(capsys, "plan", nh.src, "--to", "vllm", "--tp", 2, "--json")
    assert code == 0 and any(n.startswith("mixer.A stored as -exp(A_log)") for n in json.loads(out)["notes"]), err
    rank = reshard.load_rank(nh.src, "vllm", tp=2, rank=1)
    assert torch.equal(rank["model.layers.0.mixer.A"], -torch.exp(nh.hf["backbone.layers.0.mixer.A_log"][4:]))
    rank = reshard.load_rank(nh.src, "megatron", tp=2, rank=1)
    assert torch.equal(rank["decoder.layers.2.mlp.linear_fc2.weight"],
                       nh.hf["backbone.layers.2.mixer.down_proj.weight"][:, 48:])


# ----------------------------------------------------------------------------------------- forward verifier

def verifier_logits(folder, rank: int = 0, world: int = 1) -> torch.Tensor:
    weights = cast_weights(load_hf_rank(str(folder), rank, world, Options()), torch.float32, "cpu")
    with torch.no_grad():
        return forward(weights, ids(), TPGroup()).logits[..., :512]


def test_verifier_equals_transformers(nh):
    with torch.no_grad():
        expected = nh.model(ids(), use_cache=False).logits
    assert (verifier_logits(nh.src) - expected).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_verify_forward_vllm_tp2(nh, capsys):
    code, r, err = verify_forward(capsys, nh.src, nh.vllm(capsys))
    assert code == 0 and r is not None, err[-2000:]
    assert r["ok"] and r["first_divergence"] is None and r["max_abs"] <= 1e-5, r["problems"]
    assert (r["b"]["layout"], r["b"]["tp"]) == ("vllm", 2)
    assert [b["block"] for b in r["blocks"] if b["block"].startswith("layer")] == [
        "layer 0 mamba", "layer 1 attention", "layer 2 mlp", "layer 3 mamba"]


@pytest.mark.slow
def test_verify_forward_names_a_perturbed_layer0_vllm_weight(nh, capsys, tmp_path):
    code, r, err = verify_perturbed_vllm(capsys, nh, tmp_path, "model.layers.0.mixer.conv1d.weight", 5)
    assert code == 1 and r is not None and not r["ok"], err[-2000:]
    assert r["first_divergence"].startswith("layer 0"), r["first_divergence"]


@pytest.mark.slow
def test_verify_forward_megatron_tp2(nh, capsys):
    code, r, err = verify_forward(capsys, nh.src, nh.convert(capsys, "megatron_tp2", nh.src, "--to", "megatron",
                                                            "--tp", 2))
    assert code == 0 and r["ok"] and r["max_abs"] <= 1e-5, (err[-2000:], r and r["problems"])


def test_live_plan_applies_the_transform(nh):
    """live.plan megatron -> vllm: every mixer.A read carries neg_exp, and place() stores -exp(A_log) in fp32."""
    from reshard import live
    from reshard.live.transfer import place

    plan = live.plan(str(nh.src), source={"layout": "megatron", "tp": 2}, target={"layout": "vllm", "tp": 2},
                     source_ranks=range(2), target_ranks=range(2, 4))
    targets = [t for rank in plan.targets for t in rank if t.name.endswith("mixer.A")]
    assert len(targets) == 2 * 2 and all(t.dtype == "F32" and [op.transform for op in t.reads] == ["neg_exp"]
                                         for t in targets)
    stored = nh.hf["backbone.layers.0.mixer.A_log"][:4]  # what Megatron rank 0 holds
    dest = torch.zeros(4)
    place(dest, targets[0].reads[0], 0, stored)
    assert torch.equal(dest, -torch.exp(stored))


def test_verify_digest_compares_what_vllm_stores(nh, capsys, tmp_path):
    """verify reads both sides of mixer.A as vLLM stores it (-exp(A_log), fp32): EQUAL against the fp32 source,
    and a changed A differs (families-2.md section 14.2 G: verify compares through a transform)."""
    import shutil

    from safetensors.torch import load_file, save_file

    v = nh.vllm(capsys)
    code, text, err = run_cli(capsys, "verify", nh.src, v)
    assert code == 0 and "EQUAL" in text, text + err
    bad = tmp_path / "bad"
    shutil.copytree(v, bad)
    path = str(bad / "model-rank-1-part-0.safetensors")
    tensors = load_file(path)
    tensors["model.layers.3.mixer.A"][1] *= 1.5
    save_file(tensors, path, metadata={"format": "pt"})
    code, text, err = run_cli(capsys, "verify", nh.src, bad)
    assert "different: backbone.layers.3.mixer.A_log" in text and "DIFFERENT" in text, text + err


#: NOTES.md section 5 (mcore_mamba.py 2, pattern M*-E, local spec): rank 0's state dict, layers 0-2 and the ends.
MCORE_LOCAL_RANK0 = {
    "embedding.word_embeddings.weight": (256, 64), "decoder.layers.0.mixer.dt_bias": (4,),
    "decoder.layers.0.mixer.A_log": (4,), "decoder.layers.0.mixer.D": (4,),
    "decoder.layers.0.mixer.in_proj.weight": (164, 64), "decoder.layers.0.mixer.conv1d.weight": (96, 1, 4),
    "decoder.layers.0.mixer.conv1d.bias": (96,), "decoder.layers.0.mixer.norm.weight": (64,),
    "decoder.layers.0.mixer.out_proj.weight": (64, 64), "decoder.layers.0.norm.weight": (64,),
    "decoder.layers.1.input_layernorm.weight": (64,), "decoder.layers.1.self_attention.linear_proj.weight": (64, 32),
    "decoder.layers.1.self_attention.linear_qkv.weight": (64, 64), "decoder.layers.2.pre_mlp_layernorm.weight": (64,),
    "decoder.layers.2.mlp.linear_fc1.weight": (48, 64), "decoder.layers.2.mlp.linear_fc2.weight": (64, 48),
    "decoder.final_norm.weight": (64,), "output_layer.weight": (256, 64)}


def test_megatron_local_rank_is_mcores(nh, capsys):
    m = nh.convert(capsys, "megatron_local", nh.src, "--to", "megatron", "--tp", 2, "--megatron-spec", "local")
    model = load_megatron_rank(m / "release" / "mp_rank_00" / "model_optim_rng.pt")["model"]
    got = {k: tuple(v.shape) for k, v in model.items() if not k.startswith("decoder.layers.3.") and v is not None}
    assert got == MCORE_LOCAL_RANK0
