"""Qwen3-Next (``Qwen3NextForCausalLM``, mappings/qwen3_next.toml; ../shared/layouts/families-2.md section 4 and the
acceptance checks of section 15): a tiny model built by transformers from ``Qwen3NextConfig`` (hf_tiny.py's case: 3
Gated DeltaNet layers + 1 gated full-attention layer, nk 2, nv 4, dk = dv = 16, partial rotary 0.25, MoE on every
layer with a gated shared expert) with seeded noise on every 1-D parameter (norms, A_log, dt_bias, the GDN norm).

- hf -> megatron tp2 ep2 -> torch_dist -> vllm tp2 -> hf: every tensor bit-exact, config keys kept, transformers'
  logits of the output equal the source's.
- Megatron's rank tensors equal the probe's rule slices (mcore_from_hf.py's packing: in_proj regrouped
  [q; k; v; z; b; a] then sections per rank, conv1d sections, linear_qkv per group [q; gate; k; v], out_norm
  w - 1); torch_dist keys per section (in_proj.weight.{query,...}); the args spell the GDN layers.
- vLLM 0.32's per-rank names and shapes at tp2 (section 13 / NOTES.md: 64 keys per rank).
- the forward verifier (GDN recurrence, gated query, zero-centred norms) equals transformers at TP 1 within 1e-5;
  ``verify --forward`` passes at tp2 against the megatron, torch_dist and vllm outputs, and fails naming layer 0 on
  a perturbed layer-0 conv1d channel (vLLM rank 1) or out_norm (Megatron rank 0); vLLM tp2 computes what vLLM tp1
  computes (slow); ``verify`` (digest) compares through Megatron's out_norm offset.
- megatron-core 0.16.1 loads reshard's torch_dist strictly (tp2 ep2 etp1, tp2 etp2, tp1; FLA stand-ins as the
  probe's) and computes transformers' logits within 1e-5 (slow).
- section 17's refusals (local spec; key heads not dividing tp for vllm and megatron): one line, exit 2, nothing
  written.
- ``inspect``, ``plan``, ``load_rank`` and ``live.plan``; the release's MTP head dropped with a note; the release's
  config.json spelling (no layer_types: full_attention_interval; top-level rope keys) converts (slow).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import run_cli
from test_family_glm4_moe import IDS, config_of, hf_state, logits, reshard_convert
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import reshard
from reshard.layouts.base import Options
from reshard.verification.forward import verify_forward
from reshard.verification.forward.decoder import TPGroup, cast_weights, forward
from reshard.verification.forward.sliced_rank import load_rank as load_hf_rank

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")

#: hf_tiny.py's qwen3_next case (families-2 probes).
DIMS = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, tie_word_embeddings=False, intermediate_size=96, num_hidden_layers=4,
            linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48)
NK, NV, DK, DV, H, NH, NG, D = 2, 4, 16, 16, 64, 4, 2, 16
KEPT = ("layer_types", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "rope_parameters", "head_dim", "num_experts",
        "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
        "decoder_sparse_step", "mlp_only_layers", "rms_norm_eps", "num_key_value_heads", "tie_word_embeddings")


def save_qwen3_next(folder, **overrides) -> str:
    """transformers' own tiny Qwen3NextForCausalLM (fp32), seeded noise on every 1-D parameter (hf_tiny.py's
    ``perturb``), saved by ``save_pretrained``."""
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**{**DIMS, **overrides})).float().eval()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def qn(tmp_path_factory):
    return save_qwen3_next(tmp_path_factory.mktemp("qwen3_next") / "hf")


@pytest.fixture(scope="module")
def ref(qn):
    """transformers' logits of the source."""
    return logits(qn)


@pytest.fixture(scope="module")
def chain(qn, tmp_path_factory):
    """hf -> megatron tp2 ep2 -> torch_dist -> vllm tp2 -> hf."""
    root = tmp_path_factory.mktemp("qwen3_next_chain")
    out = {k: str(root / k) for k in ("megatron", "torch_dist", "vllm", "hf")}
    reshard_convert(qn, out["megatron"], "--to", "megatron", "--tp", "2", "--ep", "2")
    reshard_convert(out["megatron"], out["torch_dist"], "--to", "torch_dist", "--tp", "2", "--ep", "2")
    reshard_convert(out["torch_dist"], out["vllm"], "--to", "vllm", "--tp", "2")
    reshard_convert(out["vllm"], out["hf"], "--to", "hf")
    return out


def test_chain_through_megatron_torch_dist_vllm_is_bit_exact(qn, chain, ref):
    source, back = hf_state(qn), hf_state(chain["hf"])
    assert sorted(back) == sorted(source)
    assert all(back[k].dtype == source[k].dtype and torch.equal(back[k], source[k]) for k in source)
    ca, cb = config_of(qn), config_of(chain["hf"])
    assert all(cb.get(k) == ca.get(k) for k in KEPT), [(k, ca.get(k), cb.get(k)) for k in KEPT
                                                        if cb.get(k) != ca.get(k)]
    assert (cb["architectures"], cb["model_type"]) == (["Qwen3NextForCausalLM"], "qwen3_next")
    torch.testing.assert_close(logits(chain["hf"]), ref, rtol=0, atol=0)


def test_verify_digest_compares_through_the_out_norm_offset(qn, chain, capsys):
    """Megatron stores the GDN out_norm as w - 1 (families-2.md section 14.2 G): the digest check reads it back
    through the offset."""
    code, text, err = run_cli(capsys, "verify", qn, chain["megatron"])
    assert code == 0 and "EQUAL" in text, text + err


# ------------------------------------------------------------------ Megatron: the probe's packing, then its rules

def probe_megatron(hf: dict, layer: int, kind: str) -> dict[str, torch.Tensor]:
    """mcore_from_hf.py's Qwen3Next.mc for one layer (TE names; out_norm stored w - 1 as Megatron-Bridge does)."""
    p, q, r = f"model.layers.{layer}.", f"decoder.layers.{layer}.self_attention.", NV // NK
    m = {}
    if kind == "gdn":
        a = p + "linear_attn."
        qkvz = hf[a + "in_proj_qkvz.weight"].reshape(NK, 2 * DK + 2 * r * DV, H)
        qq, kk, vv, zz = torch.split(qkvz, [DK, DK, r * DV, r * DV], dim=1)
        bb, aa = torch.split(hf[a + "in_proj_ba.weight"].reshape(NK, 2 * r, H), [r, r], dim=1)
        m[q + "in_proj.weight"] = torch.cat([x.reshape(-1, H) for x in (qq, kk, vv, zz, bb, aa)])
        m[q + "conv1d.weight"] = hf[a + "conv1d.weight"]
        m[q + "A_log"], m[q + "dt_bias"] = hf[a + "A_log"], hf[a + "dt_bias"]
        m[q + "out_norm.weight"] = hf[a + "norm.weight"] - 1
        m[q + "out_proj.weight"] = hf[a + "out_proj.weight"]
        m[q + "in_proj.layer_norm_weight"] = hf[p + "input_layernorm.weight"]
    else:
        qh = hf[p + "self_attn.q_proj.weight"].reshape(NH, 2 * D, H)
        kh, vh = (hf[p + f"self_attn.{x}_proj.weight"].reshape(NG, D, H) for x in "kv")
        per = NH // NG
        parts = []
        for g in range(NG):
            parts += [qh[g * per:(g + 1) * per, :D].reshape(-1, H), qh[g * per:(g + 1) * per, D:].reshape(-1, H),
                      kh[g], vh[g]]
        m[q + "linear_qkv.weight"] = torch.cat(parts)
        m[q + "linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        m[q + "linear_qkv.layer_norm_weight"] = hf[p + "input_layernorm.weight"]
    return m


def probe_slice(name: str, full: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    """mcore_from_hf.py's tp_rules / default_rule for the mixer tensors."""
    sections = {"in_proj.weight": [NK * DK, NK * DK, NV * DV, NV * DV, NV, NV],
                "conv1d.weight": [NK * DK, NK * DK, NV * DV]}
    for key, sizes in sections.items():
        if name.endswith(key):
            return torch.cat([part.chunk(tp, 0)[r] for part in torch.split(full, sizes, 0)])
    if name.endswith(("A_log", "dt_bias", "linear_qkv.weight")):
        return full.chunk(tp, 0)[r]
    if name.endswith(("out_proj.weight", "linear_proj.weight")):
        return full.chunk(tp, 1)[r]
    return full


def test_megatron_rank_tensors_are_the_probes_rule_slices(qn, chain):
    hf = hf_state(qn)
    kinds = config_of(qn)["layer_types"]
    for r in range(2):
        blob = torch.load(os.path.join(chain["megatron"], "release", f"mp_rank_0{r}_000", "model_optim_rng.pt"),
                          weights_only=False)
        model, checked = blob["model"], 0
        for layer, kind in enumerate(kinds):
            for name, full in probe_megatron(hf, layer, "gdn" if kind == "linear_attention" else "attn").items():
                assert torch.equal(model[name], probe_slice(name, full, 2, r)), (r, name)
                checked += 1
        assert checked == 3 * 7 + 3
    a = vars(blob["args"])
    assert (a["experimental_attention_variant"], a["linear_attention_freq"], a["attention_output_gate"],
            a["linear_num_key_heads"], a["linear_num_value_heads"], a["linear_key_head_dim"],
            a["linear_conv_kernel_dim"], a["apply_layernorm_1p"], a["rotary_percent"], a["qk_layernorm"],
            a["moe_shared_expert_gate"], a["transformer_impl"]) == (
        "gated_delta_net", [1, 1, 1, 0], True, 2, 4, 16, 4, True, 0.25, True, True, "transformer_engine")


def test_torch_dist_keys_per_section(qn, chain):
    from reshard.io.dcp import read_metadata

    tensors, _ = read_metadata(os.path.join(chain["torch_dist"], "release"))
    p = "decoder.layers.0.self_attention."
    shapes = {k.removeprefix(p): tuple(v.shape) for k, v in tensors.items() if k.startswith(p)}
    assert {k: v for k, v in shapes.items() if k.startswith(("in_proj.weight", "conv1d"))} == {
        "in_proj.weight.query": (32, 64), "in_proj.weight.key": (32, 64), "in_proj.weight.value": (64, 64),
        "in_proj.weight.z": (64, 64), "in_proj.weight.beta": (4, 64), "in_proj.weight.alpha": (4, 64),
        "conv1d.weight.query": (32, 1, 4), "conv1d.weight.key": (32, 1, 4), "conv1d.weight.value": (64, 1, 4)}
    assert "decoder.layers.3.self_attention.linear_qkv.weight" in tensors  # hybrid: per-layer keys


# ------------------------------------------------------------------------------------------- vLLM 0.32 names

#: NOTES.md section 3 (vllm_keys.py, tp 2, rank 0 shapes; rank 1 the same): 64 keys per rank.
VLLM_GDN = {"linear_attn.in_proj_qkvz.weight": (96, 64), "linear_attn.in_proj_ba.weight": (4, 64),
            "linear_attn.conv1d.weight": (64, 1, 4), "linear_attn.A_log": (2,), "linear_attn.dt_bias": (2,),
            "linear_attn.norm.weight": (16,), "linear_attn.out_proj.weight": (64, 32)}
VLLM_ATTN = {"self_attn.qkv_proj.weight": (96, 64), "self_attn.o_proj.weight": (64, 32),
             "self_attn.q_norm.weight": (16,), "self_attn.k_norm.weight": (16,),
             **{f"self_attn.attn._{s}_scale": () for s in ("k", "v", "q", "prob")}}
VLLM_MOE = {"input_layernorm.weight": (64,), "post_attention_layernorm.weight": (64,),
            "mlp.experts.gate.weight": (4, 64), "mlp.experts.routed_experts.w13_weight": (4, 32, 64),
            "mlp.experts.routed_experts.w2_weight": (4, 64, 16),
            "mlp.experts._shared_experts._layer.gate_up_proj.weight": (48, 64),
            "mlp.experts._shared_experts._layer.down_proj.weight": (64, 24),
            "mlp.experts._shared_experts._layer.expert_gate.weight": (1, 64)}


def test_vllm_rank_names_and_shapes_are_vllms(chain):
    expected = {"model.embed_tokens.weight": (256, 64), "model.norm.weight": (64,), "lm_head.weight": (256, 64)}
    for layer in range(4):
        own = VLLM_GDN if layer < 3 else VLLM_ATTN
        expected.update({f"model.layers.{layer}.{k}": v for k, v in {**own, **VLLM_MOE}.items()})
    assert len(expected) == 64
    for r in range(2):
        got = load_file(os.path.join(chain["vllm"], f"model-rank-{r}-part-0.safetensors"))
        assert {k: tuple(v.shape) for k, v in got.items()} == expected


def test_vllm_rank_tensors(qn, chain):
    """vLLM keeps HF's grouped in_proj (whole key groups per rank), splits conv1d by sections, and its qkv_proj's q
    slot is q_proj's rows with the gates (families-2.md section 4.3)."""
    hf = hf_state(qn)
    rank1 = load_file(os.path.join(chain["vllm"], "model-rank-1-part-0.safetensors"))
    a, p = "model.layers.0.linear_attn.", "model.layers.3.self_attn."
    assert torch.equal(rank1[a + "in_proj_qkvz.weight"], hf[a + "in_proj_qkvz.weight"][96:])
    conv = hf[a + "conv1d.weight"]
    assert torch.equal(rank1[a + "conv1d.weight"], torch.cat([conv[16:32], conv[48:64], conv[96:]]))
    q, k, v = (hf[p + f"{x}_proj.weight"] for x in "qkv")
    assert torch.equal(rank1[p + "qkv_proj.weight"], torch.cat([q[64:], k[16:], v[16:]]))


# ------------------------------------------------------------------------------------------ refusals (section 17)

@pytest.mark.parametrize("target, message", [
    (("--to", "megatron", "--megatron-spec", "local"),
     "megatron-core builds Gated DeltaNet only with the Transformer Engine spec; use --megatron-spec te."),
    (("--to", "vllm", "--tp", "4"), "Gated DeltaNet key heads (2) must divide the tensor-parallel size (4)."),
    (("--to", "megatron", "--tp", "4"), "Gated DeltaNet key heads (2) must divide the tensor-parallel size (4)."),
], ids=["local_spec", "vllm_tp4", "megatron_tp4"])
def test_refusals(qn, tmp_path, capsys, target, message):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", qn, out, *target)
    assert code == 2 and err.strip() == f"error: {message}", err
    assert not out.exists()


def test_inspect_plan_load_rank_live_plan(qn, capsys):
    code, out, err = run_cli(capsys, "inspect", qn, "--json")
    assert code == 0 and json.loads(out)["architecture"] == "Qwen3NextForCausalLM", err
    code, out, err = run_cli(capsys, "plan", qn, "--to", "megatron", "--tp", 2, "--ep", 2, "--json")
    assert code == 0 and any(n.startswith("out_norm stored as w - 1") for n in json.loads(out)["notes"]), err
    hf = hf_state(qn)
    rank = reshard.load_rank(qn, "vllm", tp=2, rank=1)
    o = "model.layers.1.linear_attn.out_proj.weight"
    assert torch.equal(rank[o], hf[o][:, 32:])
    rank = reshard.load_rank(qn, "megatron", tp=2, ep=2, rank=1, ep_rank=1)
    assert torch.equal(rank["decoder.layers.2.self_attention.out_norm.weight"],
                       hf["model.layers.2.linear_attn.norm.weight"] - 1)
    assert torch.equal(rank["decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight"],
                       hf["model.layers.2.mlp.experts.3.down_proj.weight"][:, 16:])
    from reshard import live

    plan = live.plan(qn, source={"layout": "megatron", "tp": 2, "ep": 2}, target={"layout": "vllm", "tp": 2},
                     source_ranks=range(4), target_ranks=range(4, 6))
    norms = [t for rank in plan.targets for t in rank if t.name.endswith("linear_attn.norm.weight")]
    assert len(norms) == 2 * 3 and all(op.shift == 1.0 for t in norms for op in t.reads)  # Megatron's w - 1 back
    from reshard.live.transfer import place

    stored = torch.arange(16) / 16 - 0.5  # what a Megatron rank holds
    dest = torch.zeros(16)
    place(dest, norms[0].reads[0], 0, stored)
    assert torch.equal(dest, stored + 1)


# ----------------------------------------------------------------------------------------- forward verifier

def test_forward_verifier_computes_qwen3_next_as_transformers(qn, ref):
    weights = cast_weights(load_hf_rank(qn, 0, 1, Options()), torch.float32, "cpu")
    with torch.no_grad():
        mine = forward(weights, IDS, TPGroup()).logits[0]
    assert (mine - ref).abs().max().item() <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", ["megatron", "torch_dist", "vllm"])
def test_verify_forward_at_tp2(qn, chain, name):
    r = verify_forward(qn, chain[name], nproc=2)
    assert r["ok"] and r["max_abs"] <= 1e-5 and r["first_divergence"] is None, r["problems"]


def _perturbed_copy(folder, tmp_path, file: str, key: str, load, save) -> str:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    load_path = bad / file
    tensors, extra = load(load_path)
    tensors[key][1] += 4.0
    save(tensors, extra, load_path)
    return str(bad)


def _load_st(path):
    with safe_open(str(path), "pt") as f:
        return load_file(str(path)), f.metadata()


@pytest.mark.slow
def test_verify_forward_names_a_perturbed_layer0_vllm_weight(qn, chain, tmp_path):
    bad = _perturbed_copy(chain["vllm"], tmp_path, "model-rank-1-part-0.safetensors",
                          "model.layers.0.linear_attn.conv1d.weight", _load_st,
                          lambda t, meta, path: save_file(t, str(path), metadata=meta))
    r = verify_forward(qn, bad, nproc=2)
    assert not r["ok"] and r["first_divergence"].startswith("layer 0"), r["first_divergence"]


@pytest.mark.slow
def test_verify_forward_names_a_perturbed_layer0_megatron_norm(qn, chain, tmp_path):
    def load(path):
        blob = torch.load(str(path), weights_only=False)
        return blob["model"], blob

    bad = _perturbed_copy(chain["megatron"], tmp_path, "release/mp_rank_00_000/model_optim_rng.pt",
                          "decoder.layers.0.self_attention.out_norm.weight", load,
                          lambda t, blob, path: torch.save(blob, str(path)))
    r = verify_forward(qn, bad, nproc=2)
    assert not r["ok"] and r["first_divergence"].startswith("layer 0"), r["first_divergence"]


# ------------------------------------------------------------------------------- megatron-core 0.16.1 itself

@pytest.mark.slow
@pytest.mark.parametrize("grid", [(2, 2, 1), (2, 1, 2), (1, 1, 1)], ids=["tp2_ep2_etp1", "tp2_etp2", "tp1"])
def test_megatron_core_loads_and_matches(qn, ref, tmp_path, grid):
    """Section 15 check 3: megatron-core 0.16.1 (tests/mcore_qwen3_next_harness.py: its GPTModel built from the
    checkpoint's own args with its GatedDeltaNet module, FLA's kernels replaced by transformers' torch reference as
    in the probe) loads reshard's torch_dist strictly at (tp, ep, etp) and computes transformers' logits within
    1e-5."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'reshard[test]')")
    from test_mcore_dist_fixtures import run_harness

    tp, ep, etp = grid
    reshard.convert(qn, str(tmp_path / "d"), to="torch_dist", tp=2, ep=2, etp=1)
    torch.save(IDS, tmp_path / "ids.pt")
    harness = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mcore_qwen3_next_harness.py")
    run_harness(harness, "load", "--ids", tmp_path / "ids.pt", "--tp", tp, "--ep", ep, "--etp", etp,
                tmp_path / "d", tmp_path / "out.pt", timeout=300)
    got = torch.load(tmp_path / "out.pt", weights_only=True)["logits"][0]
    err = (got - ref).abs().max().item()
    assert err <= 1e-5, f"megatron-core vs transformers max |logit diff| {err:.3g}"


def test_release_mtp_tensors_are_dropped_with_a_note(qn, tmp_path, capsys):
    """The release stores a multi-token-prediction head under ``mtp.`` (transformers ignores it on load,
    ``_keys_to_ignore_on_load_unexpected``): read as absent, named in a note, the rest converted bit-exact."""
    import shutil

    src = tmp_path / "release"
    shutil.copytree(qn, src)
    tensors = hf_state(qn)
    extra = {"mtp.fc.weight": torch.ones(H, 2 * H), "mtp.norm.weight": torch.ones(H),
             "mtp.layers.0.self_attn.q_proj.weight": torch.ones(2 * NH * D, H)}
    save_file({**tensors, **extra}, str(src / "model.safetensors"), metadata={"format": "pt"})
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "v", "--to", "vllm", "--tp", 2)
    assert code == 0 and "dropped 3 tensors under 'mtp.'" in err, err
    code, _, err = run_cli(capsys, "convert", tmp_path / "v", tmp_path / "back", "--to", "hf")
    back = hf_state(tmp_path / "back")
    assert code == 0 and sorted(back) == sorted(tensors), err
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


@pytest.mark.slow
def test_tp2_ranks_compute_what_tp1_computes(qn, chain, tmp_path):
    """vLLM at tp 1 (read whole: vLLM files cannot be re-sliced) against vLLM at tp 2: the verifier's per-rank GDN
    (whole key heads per rank, out_proj all-reduced) and gated attention equal its TP 1 run, which equals
    transformers (test above)."""
    reshard_convert(qn, tmp_path / "v1", "--to", "vllm", "--tp", "1")
    r = verify_forward(str(tmp_path / "v1"), chain["vllm"], nproc=2)
    assert (r["a"]["run_tp"], r["b"]["run_tp"]) == (1, 2), (r["a"], r["b"])
    assert r["ok"] and r["max_abs"] <= 1e-5 and r["first_divergence"] is None, r["problems"]


# ------------------------------------------------------------------- the release's config.json spelling

def test_layer_kinds_without_layer_types_are_transformers():
    """A config.json without layer_types (the release's, with full_attention_interval) means the layers
    Qwen3NextConfig derives; the mapping's [layers] every rule says the same."""
    from reshard.mapping import load_shipped
    from reshard.mapping.sections import layer_mixers

    family = load_shipped("qwen3_next")
    kinds = family.layer_kinds["values"]
    for spelt in ({"full_attention_interval": 2}, {"full_attention_interval": 3}, {}):
        want = transformers.Qwen3NextConfig(num_hidden_layers=7, **spelt).layer_types
        assert layer_mixers(family, spelt, 7) == tuple(kinds[k] for k in want), spelt


@pytest.mark.slow
def test_release_spelling_converts(tmp_path):
    """transformers-4 spelling as released: no layer_types (full_attention_interval 2 here), top-level rope_theta
    and partial_rotary_factor: hf -> megatron tp2 -> hf -> vllm tp2 -> hf keeps config.json verbatim, the tensors
    and transformers' logits; Megatron's linear_attention_freq follows the interval."""
    src = save_qwen3_next(tmp_path / "hf", full_attention_interval=2)
    config = config_of(src)
    del config["layer_types"], config["rope_parameters"]
    config.update(full_attention_interval=2, rope_theta=10000.0, partial_rotary_factor=0.25)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    for a, b, args in [("hf", "m", ("--to", "megatron", "--tp", "2")), ("m", "h1", ("--to", "hf")),
                       ("h1", "v", ("--to", "vllm", "--tp", "2")), ("v", "h2", ("--to", "hf"))]:
        reshard_convert(tmp_path / a, tmp_path / b, *args)
    assert config_of(tmp_path / "h2") == config
    source, back = hf_state(src), hf_state(tmp_path / "h2")
    assert sorted(back) == sorted(source) and all(torch.equal(back[k], source[k]) for k in source)
    torch.testing.assert_close(logits(tmp_path / "h2"), logits(src), rtol=0, atol=0)
    blob = torch.load(tmp_path / "m" / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    args = vars(blob["args"])
    assert args["linear_attention_freq"] == [1, 0, 1, 0]
