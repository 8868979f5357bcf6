"""Acceptance tests for the Qwen3, GPT-2, StarCoder2 and Phi-3 families, against rules written out independently
in family_rules.py (from shared/layouts/dense-archs.md and shared/LAYOUTS.md, not from reshard's code).

Each family is a tiny transformers model (fp32, 4 layers, hidden 64, 8 heads, vocab 1003 so Megatron and vLLM must
pad) with seeded noise on every parameter, saved with save_pretrained. Checked through the CLI, in process:
  a. HF -> Megatron tp2 pp2 (TE spec, and the local spec for GPT-2 and Qwen3): every rank file, name by name,
     dtype, shape and bytes; the args that describe the architecture.
  b. HF -> vLLM tp2: every rank's tensors, scales included.
  c. HF -> Megatron tp2 pp2 -> vLLM tp2 -> HF: the same HF tensors (GPT-2 stays Conv1D, Phi-3 stays fused) and
     transformers' logits.
  d. ``reshard verify --forward`` passes on the Megatron and vLLM outputs, and fails, naming the layer, on a
     Megatron copy whose two query heads were swapped on one rank.

The default run keeps one forward check per output kind and family at tp 2 (plus one broken copy); the tp 4 checks
and the other broken copies are marked slow:  python -m pytest -q tests/test_families.py -m "slow or not slow"
"""

from __future__ import annotations


import pytest
import torch

from family_rules import (diff_states, dims, load_megatron_rank, load_vllm_rank, megatron_padded_vocab,
                          megatron_q_head_rows, megatron_rank, megatron_rank_path, vllm_rank)
from family_cases import (FamilyCase, assert_swapped_query_heads_fail, families_fixture, is_extra_state,
                          verify_forward)
from helpers import run_cli

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")

VOCAB = 1003
LLAMA_LIKE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
                  vocab_size=VOCAB, max_position_embeddings=128)
FAMILIES = {
    # MHA (ng = nh = 8), Conv1D storage, learned positions, LayerNorm with bias, biases everywhere, tied.
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=4, n_head=8, n_positions=64, n_inner=96, vocab_size=VOCAB,
                                activation_function="gelu_new", bos_token_id=0, eos_token_id=0)),
    # GQA 8/2, explicit head_dim 16 != 64/8, per-head q/k norms, untied.
    "qwen3": ("Qwen3Config", dict(LLAMA_LIKE, num_key_value_heads=2, head_dim=16)),
    # fused qkv_proj / gate_up_proj on disk, GQA 8/4, untied.
    "phi3": ("Phi3Config", dict(LLAMA_LIKE, num_key_value_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # GQA 8/2, biases on q/k/v/o and c_fc/c_proj, LayerNorm with bias, tied (config default).
    "starcoder2": ("Starcoder2Config", dict(LLAMA_LIKE, num_key_value_heads=2, bos_token_id=0, eos_token_id=0)),
}
ARCH = {"gpt2": "GPT2LMHeadModel", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
        "starcoder2": "Starcoder2ForCausalLM"}
TP, PP = 2, 2
ATOL = 1e-5



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
            extra = [k for k in state["model"] if is_extra_state(k)]
            problems += [f"rank (tp {t}, pp {p}): {k} is not None" for k in extra if state["model"][k] is not None]
    assert not problems, f"{fam.name} megatron tp{tp} pp{pp} {spec}: {len(problems)} problem(s)\n" + \
        "\n".join(problems[:40])


def check_vllm(fam: FamilyCase, folder, tp):
    problems = []
    for r in range(tp):
        got = load_vllm_rank(folder, r)
        want = vllm_rank(fam.hf, fam.config, tp, r)
        problems += diff_states(got, want, f"rank {r}")
    assert not problems, f"{fam.name} vllm tp{tp}: {len(problems)} problem(s)\n" + "\n".join(problems[:40])


# ------------------------------------------------------------------------------------------ a. Megatron

@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_megatron_rank_files(families, name, capsys):
    fam = families(name)
    check_megatron(fam, fam.megatron(capsys), TP, PP, "te")


@pytest.mark.parametrize("name", ["gpt2", "qwen3"])
def test_megatron_rank_files_local_spec(families, name, capsys):
    fam = families(name)
    check_megatron(fam, fam.megatron(capsys, spec="local"), TP, PP, "local")


def test_rules_self_check(families):
    """The rules themselves on the source: tp=1 pp=1 Megatron fc1/qkv re-derive the HF tensors; nothing padded is
    non-zero; this guards family_rules against silly slips (independent of reshard)."""
    for name in FAMILIES:
        fam = families(name)
        h, nh, ng, d, layers = dims(fam.config)
        m = megatron_rank(fam.hf, fam.config, 1, 0, 1, 0)
        v = vllm_rank(fam.hf, fam.config, 1, 0)
        assert m["embedding.word_embeddings.weight"].shape == (megatron_padded_vocab(VOCAB, 1), h)
        assert m["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((nh + 2 * ng) * d, h)
        # vLLM tp1 qkv = [Q; K; V] in blocks order, i.e. exactly the HF fused tensor for GPT-2 (transposed) / Phi-3
        qkv = v["transformer.h.0.attn.c_attn.weight" if name == "gpt2" else "model.layers.0.self_attn.qkv_proj.weight"]
        if name == "gpt2":
            assert torch.equal(qkv, fam.hf["transformer.h.0.attn.c_attn.weight"].t())
        elif name == "phi3":
            assert torch.equal(qkv, fam.hf["model.layers.0.self_attn.qkv_proj.weight"])
            gate_up = "model.layers.0.mlp.gate_up_proj.weight"
            assert torch.equal(v[gate_up], fam.hf[gate_up])
        # Megatron per_group at tp1: group 0 starts with query head 0, and its k/v follow its nh/ng query heads
        mq = m["decoder.layers.0.self_attention.linear_qkv.weight"]
        r = nh // ng
        assert torch.equal(mq[:d], qkv[:d])
        assert torch.equal(mq[r * d:(r + 1) * d], qkv[nh * d:(nh + 1) * d])  # k_0
        assert torch.equal(mq[(r + 1) * d:(r + 2) * d], qkv[(nh + ng) * d:(nh + ng + 1) * d])  # v_0
        for t in (megatron_rank(fam.hf, fam.config, 2, 1, 2, 1), vllm_rank(fam.hf, fam.config, 2, 1)):
            for k, w in t.items():
                if k.endswith(("word_embeddings.weight", "output_layer.weight", "lm_head.weight")):
                    assert w.shape[0] == 512 and torch.count_nonzero(w[VOCAB - 512:]) == 0, k
    # Qwen3 without its q/k norms is a Llama: the existing independent Llama rules must agree with these.
    import megatron_rules
    import vllm_rules

    fam = families("qwen3")
    for tp, pp in ((2, 2), (2, 1)):
        for p in range(pp):
            for t in range(tp):
                mine = {k: v for k, v in megatron_rank(fam.hf, fam.config, tp, t, pp, p).items()
                        if not k.endswith(("q_layernorm.weight", "k_layernorm.weight"))}
                assert not diff_states(mine, megatron_rules.expected_rank_state(fam.hf, fam.config, tp, t, pp, p),
                                       "llama rules")
    for tp in (2, 4):
        for r in range(tp):
            mine = {k: v for k, v in vllm_rank(fam.hf, fam.config, tp, r).items()
                    if not k.endswith(("q_norm.weight", "k_norm.weight"))}
            assert not diff_states(mine, vllm_rules.expected_rank(fam.hf, fam.config, tp, r), "llama rules")


@pytest.mark.parametrize("name", ["qwen3", "starcoder2"])
def test_megatron_tp_above_kv_groups(families, name, capsys):
    """tp 4 over 2 KV groups: newer Megatron-Core runs it (rows still split contiguously, LAYOUTS.md), refusing at
    plan time is acceptable. Either a clean refusal (exit 2, one line naming the groups, nothing written) or rank
    files that follow the rules."""
    fam = families(name)
    dst = fam.root / "megatron_tp4_refused"
    code, out, err = run_cli(capsys, "convert", fam.src, dst, "--to", "megatron", "--tp", 4)
    if code == 0:
        check_megatron(fam, dst, 4, 1)
    else:
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "group" in err.lower() and "2" in err, err
        assert not dst.exists()


def test_megatron_args(families, capsys):
    """Architecture args (Megatron-LM names) per dense-archs.md A.2 / C.2 / D / E.1, checked on rank (0, 0)."""
    problems = []
    for name in sorted(FAMILIES):
        fam = families(name)
        try:
            root = fam.megatron(capsys)
        except AssertionError as exc:
            problems.append(str(exc).splitlines()[0])
            continue
        args = vars(load_megatron_rank(megatron_rank_path(root, 0, 0, PP))["args"])
        h, nh, ng, d, layers = dims(fam.config)
        gpt2 = name == "gpt2"
        want = dict(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP, num_layers=layers,
                    hidden_size=h, num_attention_heads=nh, ffn_hidden_size=96, kv_channels=d,
                    padded_vocab_size=megatron_padded_vocab(VOCAB, TP),
                    normalization="LayerNorm" if name in ("gpt2", "starcoder2") else "RMSNorm",
                    swiglu=name in ("qwen3", "phi3"),
                    add_bias_linear=name in ("gpt2", "starcoder2"),
                    position_embedding_type="learned_absolute" if gpt2 else "rope",
                    untie_embeddings_and_output_weights=name in ("qwen3", "phi3"),
                    qk_layernorm=name == "qwen3")
        if gpt2:
            want["max_position_embeddings"] = 64
        for key, value in want.items():
            if args.get(key, "<absent>") != value:
                problems.append(f"{name}: args.{key} = {args.get(key, '<absent>')!r}, expected {value!r}")
        groups = args.get("num_query_groups") if args.get("group_query_attention") else nh
        if groups != ng:
            problems.append(f"{name}: query groups {groups!r} (group_query_attention="
                            f"{args.get('group_query_attention')!r}), expected {ng}")
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
    assert config["architectures"] == fam.config["architectures"]
    assert config["vocab_size"] == VOCAB
    assert bool(config.get("tie_word_embeddings")) == bool(fam.config.get("tie_word_embeddings"))
    ids = torch.tensor([[0, 1, 17, 1002, 500, 3, 3, 999, 42, 7], [5, 1001, 2, 64, 63, 128, 256, 511, 512, 1000]])
    fam.assert_same_logits(transformers, back, ids, ATOL)


# ------------------------------------------------------------------------------------------ d. forward

forward = verify_forward


def assert_forward_ok(capsys, fam, dst, tp, layout):
    code, r, err = forward(capsys, fam.src, dst)
    assert code == 0 and r is not None, f"{fam.name} {layout} tp{tp}: verify --forward exited {code}: " \
                                         f"{err.strip()[-2000:]} {r and r.get('problems')}"
    assert r["ok"] and r["first_divergence"] is None, r["problems"]
    assert r["max_abs"] <= ATOL and r["argmax_agreement"] == 1.0
    assert (r["b"]["layout"], r["b"]["tp"]) == (layout, tp)
    assert r["padding_max_abs_b"] == 0.0


# megatron at tp 4 only where tp divides the KV groups (tp > ng is optional for Megatron, LAYOUTS.md)
FORWARD = [
    ("gpt2", "megatron", 2), ("qwen3", "megatron", 2), ("phi3", "vllm", 2), ("starcoder2", "vllm", 2),
    *[pytest.param(*c, marks=pytest.mark.slow) for c in [
        ("gpt2", "vllm", 2), ("qwen3", "vllm", 2), ("phi3", "megatron", 2), ("starcoder2", "megatron", 2),
        ("gpt2", "megatron", 4), ("phi3", "megatron", 4),
        ("gpt2", "vllm", 4), ("qwen3", "vllm", 4), ("phi3", "vllm", 4), ("starcoder2", "vllm", 4)]],
]


@pytest.mark.parametrize("name,layout,tp", FORWARD)
def test_verify_forward(families, name, layout, tp, capsys):
    fam = families(name)
    if layout == "megatron":
        dst = fam.megatron(capsys, tp=tp, pp=PP if tp == 2 else 1)
    else:
        dst = fam.vllm(capsys, tp=tp)
    assert_forward_ok(capsys, fam, dst, tp, layout)


@pytest.mark.parametrize("name", ["qwen3", *[pytest.param(n, marks=pytest.mark.slow)
                                             for n in ("gpt2", "phi3", "starcoder2")]])
def test_verify_forward_swapped_query_heads_fails(families, name, capsys, tmp_path):
    """Swap two query heads' rows in linear_qkv of local layer 0 on rank (tp 1, pp 1), i.e. global layer L/2:
    verify --forward must exit 1 and name that layer's attention."""
    fam = families(name)
    assert_swapped_query_heads_fail(capsys, fam, tmp_path, megatron_q_head_rows(fam.config, TP),
                                    dims(fam.config)[4] // PP, PP)
