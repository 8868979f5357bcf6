"""Acceptance tests for Gemma 1, 2 and 3 (text-only), against rules written out independently in
family_rules_gemma.py (from shared/layouts/dense-archs.md section B and the transformers 5 configs, not from
reshard's code).

Each family is a tiny transformers model (fp32, hidden 64, 4 heads, 2 KV heads, head_dim 32 != 64/4, 4 layers,
vocab 1003 so Megatron and vLLM must pad) with seeded noise on every parameter (norm weights included, so a stray
+1 or a swapped norm shows), saved with save_pretrained. Gemma 2: sliding window 4, query_pre_attn_scalar 24,
soft-capping 5 / 3. Gemma 3: sliding window 4 on every other layer, query_pre_attn_scalar 24, RoPE bases 1e5 (full)
and 5e3 (sliding). Checked through the CLI, in process:
  a. HF -> Megatron tp2 pp2 (TE spec; the local spec for Gemma 2, and for Gemma 1/3 in the slow set): every rank
     file, name by name, dtype, shape and bytes; the args derivable from the facts (and ``hf_config``).
  b. HF -> vLLM tp2: every rank's tensors, scales included.
  c. HF -> Megatron tp2 pp2 -> vLLM tp2 -> HF: the same HF tensors, a config of the same meaning, and
     transformers' logits (fp32, 1e-5).
  d. ``reshard verify --forward`` passes on Megatron and vLLM outputs at tp 2, and fails, naming the layer, on a
     Megatron copy whose two query heads were swapped on one rank.

The default run keeps one forward check per family and one broken copy; the rest is marked slow:
    python -m pytest -q tests/test_families_gemma.py -m "slow or not slow"
"""

from __future__ import annotations


import pytest
import torch

from family_rules import (diff_states, load_megatron_rank, load_vllm_rank, megatron_padded_vocab,
                          megatron_rank_path, vllm_padded_vocab)
from family_rules_gemma import (expected_megatron_args, gemma_dims, hf_names, megatron_q_head_rows, megatron_rank,
                                swa_pattern_from_skip_freq, vllm_rank)
from family_cases import (FamilyCase, assert_swapped_query_heads_fail, families_fixture, is_extra_state,
                          verify_forward)

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")

VOCAB = 1003
BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, vocab_size=VOCAB, max_position_embeddings=128)
FAMILIES = {
    "gemma": ("GemmaConfig", dict(BASE)),
    "gemma2": ("Gemma2Config", dict(BASE, sliding_window=4, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                    final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", dict(BASE, sliding_window=4, sliding_window_pattern=2, query_pre_attn_scalar=24,
                                        rope_parameters={
                                            "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}})),
}
ARCH = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# config keys whose value is part of the model's meaning (compared after the round trip and in args.hf_config)
MEANING = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
           "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "hidden_activation",
           "tie_word_embeddings", "rope_parameters", "query_pre_attn_scalar", "sliding_window", "layer_types",
           "attn_logit_softcapping", "final_logit_softcapping")
TP, PP = 2, 2
ATOL = 1e-5
IDS = torch.tensor([[0, 1, 17, 1002, 500, 3, 3, 999, 42, 7, 11, 12],
                    [5, 1001, 2, 64, 63, 128, 256, 511, 512, 1000, 9, 8]])



# ------------------------------------------------------------------------------------------ fixtures

families = families_fixture(transformers, FAMILIES, ARCH)


# ------------------------------------------------------------------------------------------ checks

def check_megatron(fam: FamilyCase, root, tp, pp, spec="te"):
    problems = []
    for p in range(pp):
        for t in range(tp):
            state = load_megatron_rank(megatron_rank_path(root, t, p, pp))
            want = megatron_rank(fam.hf, fam.config, tp, t, pp, p, spec)
            problems += diff_states(state["model"], want, f"rank (tp {t}, pp {p})", ignore=is_extra_state)
            problems += [f"rank (tp {t}, pp {p}): {k} is not None" for k, v in state["model"].items()
                         if is_extra_state(k) and v is not None]
    assert not problems, f"{fam.name} megatron tp{tp} pp{pp} {spec}: {len(problems)} problem(s)\n" + \
        "\n".join(problems[:40])


def check_vllm(fam: FamilyCase, folder, tp):
    problems = []
    for r in range(tp):
        problems += diff_states(load_vllm_rank(folder, r), vllm_rank(fam.hf, fam.config, tp, r), f"rank {r}")
    assert not problems, f"{fam.name} vllm tp{tp}: {len(problems)} problem(s)\n" + "\n".join(problems[:40])


def meaning(config: dict) -> dict:
    """The meaning keys of an HF config as transformers reads it (defaults filled in)."""
    cfg = transformers.AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items()
                                                                      if k != "model_type"}).to_dict()
    return {k: cfg.get(k, "<absent>") for k in MEANING}


# ------------------------------------------------------------------------------------------ fixture and rules

@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_source_is_what_the_facts_describe(families, name):
    """B.1 on the fixture itself: Llama names (+ sandwich norms for 2/3, q/k norms for 3), head_dim 32 != 64/4,
    tied (no lm_head), norm shapes."""
    fam = families(name)
    assert set(fam.hf) == hf_names(fam.config)
    h, nh, ng, d, _ = gemma_dims(fam.config)
    assert d != h // nh and fam.hf["model.layers.0.self_attn.q_proj.weight"].shape == (nh * d, h)
    assert fam.config.get("tie_word_embeddings", True)
    if name == "gemma3":
        assert fam.hf["model.layers.0.self_attn.q_norm.weight"].shape == (d,)
        assert fam.config["layer_types"] == ["sliding_attention", "full_attention"] * 2


def test_rules_self_check(families):
    """Guards the rules against slips, independent of reshard: Gemma 1 is a Llama with explicit head_dim, so the
    existing independent Llama rules must agree; padded rows are zero; tp1 vLLM qkv is [Q; K; V]."""
    import megatron_rules
    import vllm_rules

    fam = families("gemma")
    for tp, pp in ((2, 2), (2, 1), (1, 1)):
        for p in range(pp):
            for t in range(tp):
                assert not diff_states(megatron_rank(fam.hf, fam.config, tp, t, pp, p),
                                       megatron_rules.expected_rank_state(fam.hf, fam.config, tp, t, pp, p),
                                       "llama rules")
    for tp in (1, 2, 4):
        for r in range(tp):
            assert not diff_states(vllm_rank(fam.hf, fam.config, tp, r),
                                   vllm_rules.expected_rank(fam.hf, fam.config, tp, r), "llama rules")
    for name in FAMILIES:
        fam = families(name)
        h, nh, ng, d, _ = gemma_dims(fam.config)
        v = vllm_rank(fam.hf, fam.config, 1, 0)
        a = "model.layers.0.self_attn."
        assert torch.equal(v[a + "qkv_proj.weight"], torch.cat([fam.hf[a + f"{x}_proj.weight"] for x in "qkv"]))
        m = megatron_rank(fam.hf, fam.config, 1, 0, 1, 0)
        mq = m["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert mq.shape == ((nh + 2 * ng) * d, h)
        r = nh // ng
        assert torch.equal(mq[(r + 2) * d:(r + 3) * d], fam.hf[a + "q_proj.weight"][r * d:(r + 1) * d])  # group 1
        for t in (megatron_rank(fam.hf, fam.config, 2, 1, 2, 1), vllm_rank(fam.hf, fam.config, 2, 1)):
            for k, w in t.items():
                if k.endswith(("word_embeddings.weight", "output_layer.weight", "lm_head.weight")):
                    assert w.shape[0] == 512 and torch.count_nonzero(w[VOCAB - 512:]) == 0, k
        assert megatron_padded_vocab(VOCAB, 2) == 1024 and vllm_padded_vocab(VOCAB) == 1024


# ------------------------------------------------------------------------------------------ a. Megatron

@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_megatron_rank_files(families, name, capsys):
    fam = families(name)
    check_megatron(fam, fam.megatron(capsys), TP, PP, "te")


@pytest.mark.parametrize("name", ["gemma2", *[pytest.param(n, marks=pytest.mark.slow) for n in ("gemma", "gemma3")]])
def test_megatron_rank_files_local_spec(families, name, capsys):
    fam = families(name)
    check_megatron(fam, fam.megatron(capsys, spec="local"), TP, PP, "local")


def test_megatron_args(families, capsys):
    """Architecture args per B.2 (and the brief) on rank (0, 0): apply_layernorm_1p, kv_channels=head_dim, RMSNorm,
    no SwiGLU (Gemma is GeGLU, which stock args cannot spell), softmax_scale and window for Gemma 2/3, the window
    pattern of window_attn_skip_freq equal to HF's layer_types, the RoPE base of the full-attention layers, and an
    hf_config dict holding the HF config's meaning."""
    problems = []
    for name in sorted(FAMILIES):
        fam = families(name)
        try:
            root = fam.megatron(capsys)
        except AssertionError as exc:
            problems.append(str(exc).splitlines()[0])
            continue
        args = vars(load_megatron_rank(megatron_rank_path(root, 0, 0, PP))["args"])
        cfg = fam.config
        h, nh, ng, d, layers = gemma_dims(cfg)
        for key, value in expected_megatron_args(cfg, TP, PP).items():
            got = args.get(key, "<absent>")
            if isinstance(got, list):
                got = tuple(got)
            ok = abs(got - value) <= 1e-12 * abs(value) if isinstance(value, float) and isinstance(got, float) \
                else got == value
            if not ok:
                problems.append(f"{name}: args.{key} = {args.get(key, '<absent>')!r}, expected {value!r}")
        if args.get("swiglu"):
            problems.append(f"{name}: args.swiglu = True, but Gemma's MLP is GeGLU (tanh), not SwiGLU")
        groups = args.get("num_query_groups") if args.get("group_query_attention") else nh
        if groups != ng:
            problems.append(f"{name}: query groups {groups!r} (group_query_attention="
                            f"{args.get('group_query_attention')!r}), expected {ng}")
        if name == "gemma":
            if args.get("window_size") is not None:
                problems.append(f"{name}: args.window_size = {args['window_size']!r}, expected none (no sliding)")
            if args.get("softmax_scale") not in (None, d ** -0.5):
                problems.append(f"{name}: args.softmax_scale = {args['softmax_scale']!r}, expected None or d**-0.5")
        else:
            want = [t == "sliding_attention" for t in cfg["layer_types"]]
            freq = args.get("window_attn_skip_freq", "<absent>")
            if freq == "<absent>" or swa_pattern_from_skip_freq(freq, layers) != want:
                problems.append(f"{name}: args.window_attn_skip_freq = {freq!r} does not give the sliding layers "
                                f"{want} (expected 2)")
        theta = cfg["rope_parameters"]["full_attention" if name == "gemma3" else "rope_theta"]
        theta = theta["rope_theta"] if isinstance(theta, dict) else theta
        if args.get("rotary_base") != theta:
            problems.append(f"{name}: args.rotary_base = {args.get('rotary_base', '<absent>')!r}, expected {theta!r}"
                            " (full-attention RoPE base)")
        hf_config = args.get("hf_config")
        if not isinstance(hf_config, dict):
            problems.append(f"{name}: args.hf_config is {type(hf_config).__name__}, expected a dict")
        else:
            got, want = meaning(hf_config), meaning(cfg)
            problems += [f"{name}: args.hf_config[{k!r}] means {got[k]!r}, expected {want[k]!r}"
                         for k in MEANING if got[k] != want[k]]
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------ b. vLLM

@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_vllm_rank_files(families, name, capsys):
    fam = families(name)
    check_vllm(fam, fam.vllm(capsys), TP)


# ------------------------------------------------------------------------------------------ c. round trip

@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_round_trip_megatron_vllm_hf(families, name, capsys):
    fam = families(name)
    back, config = fam.round_trip(capsys, TP, check_vllm)
    got_m, want_m = meaning(config), meaning(fam.config)
    assert got_m == want_m, {k: (got_m[k], want_m[k]) for k in MEANING if got_m[k] != want_m[k]}
    fam.assert_same_logits(transformers, back, IDS, ATOL)


# ------------------------------------------------------------------------------------------ d. forward

forward = verify_forward


FORWARD = [
    ("gemma", "megatron"), ("gemma2", "vllm"), ("gemma3", "megatron"),
    *[pytest.param(*c, marks=pytest.mark.slow) for c in [("gemma", "vllm"), ("gemma2", "megatron"),
                                                         ("gemma3", "vllm")]],
]


@pytest.mark.parametrize("name,layout", FORWARD)
def test_verify_forward(families, name, layout, capsys):
    fam = families(name)
    dst = fam.megatron(capsys) if layout == "megatron" else fam.vllm(capsys)
    code, r, err = forward(capsys, fam.src, dst)
    assert code == 0 and r is not None, f"{name} {layout} tp{TP}: verify --forward exited {code}: " \
                                         f"{err.strip()[-2000:]} {r and r.get('problems')}"
    assert r["ok"] and r["first_divergence"] is None, r["problems"]
    assert r["max_abs"] <= ATOL and r["argmax_agreement"] == 1.0
    assert (r["b"]["layout"], r["b"]["tp"]) == (layout, TP)
    assert r["padding_max_abs_b"] == 0.0


@pytest.mark.parametrize("name", ["gemma2", *[pytest.param(n, marks=pytest.mark.slow) for n in ("gemma", "gemma3")]])
def test_verify_forward_at_four_ranks(families, name, capsys):
    """vLLM at tp 4 (one KV head replicated on two ranks; 4 query heads, one per rank): verify --forward equal.
    Megatron cannot take tp 4 with these 2 KV heads (refused at plan time)."""
    fam = families(name)
    code, r, err = forward(capsys, fam.src, fam.vllm(capsys, 4))
    assert code == 0 and r is not None and r["ok"], f"exit {code}: {err.strip()[-2000:]}"
    assert (r["b"]["layout"], r["b"]["tp"]) == ("vllm", 4) and r["max_abs"] <= ATOL


@pytest.mark.parametrize("name", ["gemma2", *[pytest.param(n, marks=pytest.mark.slow) for n in ("gemma", "gemma3")]])
def test_verify_forward_swapped_query_heads_fails(families, name, capsys, tmp_path):
    """Swap query heads 0 and 1 in linear_qkv of local layer 0 on rank (tp 1, pp 1), i.e. global layer L/2:
    verify --forward must exit 1 and name that layer's attention."""
    fam = families(name)
    assert_swapped_query_heads_fail(capsys, fam, tmp_path, megatron_q_head_rows(fam.config, TP),
                                    gemma_dims(fam.config)[4] // PP, PP)
