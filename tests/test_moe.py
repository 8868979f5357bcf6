"""Acceptance tests for Mixture-of-Experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE), against rules written out
independently in moe_rules.py (from shared/layouts/moe.md and transformers' on-disk names, not from reshard's code).

Each family is a tiny fp32 transformers model (hidden 64, 8 heads, 2 KV heads, 4 layers, 4 experts, top-2, expert
FFN 32 (Mixtral 48), vocab 1003 so Megatron and vLLM must pad) with seeded noise on every parameter, saved with
save_pretrained (per-expert original format). Qwen2-MoE has a gated shared expert (48) and a dense layer 1
(mlp_only_layers=[1], dense FFN 96); Qwen3-MoE has head_dim 16 != 64/8 and norm_topk_prob=True. Through the CLI,
in process:
  a. HF -> Megatron at (tp2, ep2), (tp1, pp2, ep4), (tp2, etp1, ep2): the folder set, and every tensor of every rank
     file (name, dtype, shape, bytes; ``_extra_state`` ignored); the MoE args.
  b. HF -> vLLM tp2, and tp4 --expert-parallel (one whole expert per rank): every rank's tensors.
  c. HF -> megatron tp2 ep2 -> megatron tp1 pp2 ep4 -> megatron tp2 etp1 ep2 -> vllm tp2 -> vllm tp4
     --expert-parallel -> HF: every hop against the rules, the final HF byte-identical to the source, ``reshard
     verify`` exit 0, and transformers' logits equal (fp32, 1e-5).
  d. plan-time refusals (exit 2, nothing written): E % ep, --etp not dividing --tp, expert FFN not divisible by the
     vLLM tp without --expert-parallel (and I % etp for Megatron).
  e. ``reshard verify --forward --nproc 2`` on the Megatron tp2 ep2 output of each family.

Default run: the qwen2_moe family (dense + sparse layers, shared expert, biases) everywhere, the other two families
for a and b; the other families' chains and forward checks, the local spec and the uneven expert split are slow:
    python -m pytest -q tests/test_moe.py -m "slow or not slow"
"""

from __future__ import annotations

import json

import pytest
import torch

import moe_rules
from family_rules import diff_states, load_hf_dir, load_megatron_rank, load_vllm_rank
from helpers import perturbed_model, run_cli

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e .[test]")

VOCAB = 1003
COMMON = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, vocab_size=VOCAB,
              max_position_embeddings=128, num_experts_per_tok=2)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(COMMON, intermediate_size=48, num_local_experts=4)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                         shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                         head_dim=16, norm_topk_prob=True)),
}
ARCH = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
DEFAULT_FAMILY = "qwen2_moe"
ATOL = 1e-5
# (tp, pp, ep, etp) of the Megatron layouts under test; etp None = the default (= tp)
MEGATRON_LAYOUTS = {"tp2_ep2": (2, 1, 2, None), "tp1_pp2_ep4": (1, 2, 4, None), "tp2_etp1_ep2": (2, 1, 2, 1)}
IDS = torch.tensor([[0, 1, 17, 1002, 500, 3, 3, 999, 42, 7], [5, 1001, 2, 64, 63, 128, 256, 511, 512, 1000]])


def slow_unless_default(names):
    return [n if n == DEFAULT_FAMILY else pytest.param(n, marks=pytest.mark.slow) for n in names]


def is_extra_state(name: str) -> bool:
    return "_extra_state" in name


def megatron_args(layout):
    tp, pp, ep, etp = MEGATRON_LAYOUTS[layout]
    args = ["--to", "megatron", "--tp", tp, "--pp", pp, "--ep", ep]
    return args + (["--etp", etp] if etp is not None else [])


# ------------------------------------------------------------------------------------------ fixtures

class Family:
    """One tiny model saved to disk, and the outputs built from it on demand (each conversion at most once)."""

    def __init__(self, name, root, settings=None):
        cls_name, default = FAMILIES[name]
        config = getattr(transformers, cls_name)(**(settings or default))
        self.model = perturbed_model(transformers, config)
        self.name, self.root = name, root
        self.src = root / "hf"
        self.model.save_pretrained(self.src)
        self.hf, self.config = load_hf_dir(self.src)
        assert self.config["architectures"] == [ARCH[name]]
        self.outputs = {}

    def convert(self, capsys, key, src, *args):
        if key not in self.outputs:
            dst = self.root / key
            code, out, err = run_cli(capsys, "convert", src, dst, *map(str, args))
            assert code == 0, f"{self.name}: reshard convert {src.name} -> {key} {' '.join(map(str, args))} " \
                              f"exited {code}: {err.strip()[-2000:]}"
            self.outputs[key] = dst
        return self.outputs[key]

    def megatron(self, capsys, layout, spec="te"):
        extra = ["--megatron-spec", "local"] if spec == "local" else []
        return self.convert(capsys, f"megatron_{layout}_{spec}", self.src, *megatron_args(layout), *extra)

    def vllm(self, capsys, tp, expert_parallel=False):
        key = f"vllm_tp{tp}" + ("_ep" if expert_parallel else "")
        return self.convert(capsys, key, self.src, "--to", "vllm", "--tp", tp,
                            *(["--expert-parallel"] if expert_parallel else []))


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    torch.set_num_threads(1)
    made = {}

    def get(name):
        if name not in made:
            made[name] = Family(name, tmp_path_factory.mktemp(name))
        return made[name]
    return get


# ------------------------------------------------------------------------------------------ checks

def check_megatron(fam: Family, root, layout, spec="te"):
    """The folder set and every tensor of every folder (moe.md 3.1-3.3). Megatron-LM itself writes only the
    (tp, pp, ep) of its ranks (a subset of the product when etp < tp, moe.md 3.1); a converter may also write the
    remaining folders of the product, as long as their contents follow the same rules (etp rank = tp % etp)."""
    tp, pp, ep, etp = MEGATRON_LAYOUTS[layout]
    got = moe_rules.megatron_rank_folders(root)
    required = moe_rules.megatron_saved_folders(tp, pp, ep, etp or tp)
    allowed = moe_rules.megatron_all_folders(tp, pp, ep)
    problems = [f"missing folder {f}" for f in sorted(required - got)]
    problems += [f"unexpected folder {f}" for f in sorted(got - allowed)]
    for t in range(tp):
        for p in range(pp):
            for e in range(ep):
                folder = moe_rules.megatron_folder(t, p, e, pp, ep)
                if folder not in got:
                    continue
                blob = load_megatron_rank(moe_rules.megatron_rank_path(root, folder))
                want = moe_rules.megatron_rank(fam.hf, fam.config, tp, t, pp, p, ep, e, etp, spec)
                problems += diff_states(blob["model"], want, folder, ignore=is_extra_state)
                problems += [f"{folder}: {k} is not None" for k, v in blob["model"].items()
                             if is_extra_state(k) and v is not None]
                problems += check_args(fam, vars(blob["args"]), layout, folder)
    assert not problems, f"{fam.name} megatron {layout} {spec}: {len(problems)} problem(s)\n" + \
        "\n".join(problems[:40])


def check_args(fam: Family, args: dict, layout, where) -> list[str]:
    tp, pp, ep, etp = MEGATRON_LAYOUTS[layout]
    want = moe_rules.megatron_moe_args(fam.config, tp, pp, ep, etp)
    problems = []
    for key, value in want.items():
        got = args.get(key, "<absent>")
        if key == "moe_layer_freq" and all(value) and got == 1:
            continue
        if got != value:
            problems.append(f"{where}: args.{key} = {got!r}, expected {value!r}")
    ng = args.get("num_query_groups") if args.get("group_query_attention") else args.get("num_attention_heads")
    if ng != fam.config["num_key_value_heads"]:
        problems.append(f"{where}: query groups {ng!r} (group_query_attention="
                        f"{args.get('group_query_attention')!r}), expected {fam.config['num_key_value_heads']}")
    if fam.name != "qwen2_moe" and args.get("moe_shared_expert_intermediate_size") not in (None, 0):
        problems.append(f"{where}: args.moe_shared_expert_intermediate_size = "
                        f"{args['moe_shared_expert_intermediate_size']!r}, expected None")
    return problems


def check_vllm(fam: Family, folder, tp, expert_parallel=False):
    problems = []
    for r in range(tp):
        got = load_vllm_rank(folder, r)
        want = moe_rules.vllm_rank(fam.hf, fam.config, tp, r, expert_parallel)
        problems += diff_states(got, want, f"rank {r}")
    import glob
    import os
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(str(folder), "*.safetensors")))
    stray = [n for n in names if not any(n.startswith(f"model-rank-{r}-part-") for r in range(tp))]
    problems += [f"unexpected file {n}" for n in stray]
    assert not problems, f"{fam.name} vllm tp{tp}{' --expert-parallel' if expert_parallel else ''}: " \
                         f"{len(problems)} problem(s)\n" + "\n".join(problems[:40])


def logits(model_or_dir):
    model = model_or_dir
    if not isinstance(model, torch.nn.Module):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_or_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(IDS).logits


# ------------------------------------------------------------------------------------------ rules self-check

def test_rules_self_check(families):
    """The rules on the source, independent of reshard: canonical() round-trips the HF keys exactly; Megatron tp1
    ep1 experts are [gate; up] / down; shards re-assemble; the folder rules of moe.md 3.1; vLLM placement."""
    for name in FAMILIES:
        fam = families(name)
        c = moe_rules.canonical(fam.hf, fam.config)
        assert not diff_states(moe_rules.hf_state(c), fam.hf, "hf_state")
        want_sparse = [i != 1 for i in range(4)] if name == "qwen2_moe" else [True] * 4
        assert [layer.sparse for layer in c.layers] == want_sparse
        full = moe_rules.megatron_rank(fam.hf, fam.config, 1, 0, 1, 0, 1, 0)
        x = c.layers[0].experts[3]
        assert torch.equal(full["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"],
                           torch.cat([x.gate, x.up]))
        # tp2 ep2 etp2: global expert 3 is local 1 of ep 1; the two etp halves re-assemble gate and up
        halves = [moe_rules.megatron_rank(fam.hf, fam.config, 2, t, 1, 0, 2, 1)[
            "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"] for t in range(2)]
        i = c.expert_ffn
        assert torch.equal(torch.cat([h[:i // 2] for h in halves]), x.gate)
        assert torch.equal(torch.cat([h[i // 2:] for h in halves]), x.up)
        v = moe_rules.vllm_rank(fam.hf, fam.config, 1, 0)
        mod = "block_sparse_moe." if name == "mixtral" else "mlp."
        assert torch.equal(v[f"model.layers.0.{mod}experts.routed_experts.w13_weight"][3], torch.cat([x.gate, x.up]))
        assert torch.equal(v[f"model.layers.0.{mod}experts.routed_experts.w2_weight"][3], x.down)
    assert moe_rules.megatron_saved_folders(2, 1, 2, 1) == {"mp_rank_00_000", "mp_rank_01_001"}
    assert moe_rules.megatron_saved_folders(2, 1, 4, 1) == {"mp_rank_00_000", "mp_rank_00_002", "mp_rank_01_001",
                                                            "mp_rank_01_003"}
    assert moe_rules.megatron_saved_folders(2, 1, 4, 2) == moe_rules.megatron_all_folders(2, 1, 4)
    assert moe_rules.megatron_saved_folders(1, 2, 4, 1) == moe_rules.megatron_all_folders(1, 2, 4)
    assert "mp_rank_00_001_003" in moe_rules.megatron_all_folders(1, 2, 4)
    assert [list(moe_rules.vllm_expert_block(4, 3, p)) for p in range(3)] == [[0, 1], [2], [3]]
    assert [list(moe_rules.vllm_expert_block(5, 2, p)) for p in range(2)] == [[0, 1, 2], [3, 4]]
    # Without the shared expert and with the dense layer dropped, the Qwen2-MoE attention/embedding rules must agree
    # with the existing independent Llama rules (megatron_rules), so the two sets of rules cannot drift apart.
    import megatron_rules

    fam = families("qwen2_moe")
    dense_only = {k: v for k, v in fam.hf.items() if ".layers.1." in k or "layers" not in k}
    dense_only = {k.replace(".layers.1.", ".layers.0."): v for k, v in dense_only.items()}
    config = dict(fam.config, num_hidden_layers=1, mlp_only_layers=[0])
    for t in range(2):
        mine = moe_rules.megatron_rank(dense_only, config, 2, t, 1, 0, 1, 0)
        assert not diff_states(mine, megatron_rules.expected_rank_state(dense_only, config, 2, t, 1, 0), "llama")


# ------------------------------------------------------------------------------------------ a. Megatron

@pytest.mark.parametrize("layout", sorted(MEGATRON_LAYOUTS))
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_megatron_rank_files(families, name, layout, capsys):
    fam = families(name)
    check_megatron(fam, fam.megatron(capsys, layout), layout)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_megatron_rank_files_local_spec(families, name, capsys):
    """Local spec: input_layernorm / pre_mlp_layernorm on every layer, sparse or dense (moe.md 3.2)."""
    fam = families(name)
    check_megatron(fam, fam.megatron(capsys, "tp2_ep2", spec="local"), "tp2_ep2", spec="local")


# ------------------------------------------------------------------------------------------ b. vLLM

@pytest.mark.parametrize("tp,expert_parallel", [(2, False), (4, True)])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_vllm_rank_files(families, name, tp, expert_parallel, capsys):
    fam = families(name)
    check_vllm(fam, fam.vllm(capsys, tp, expert_parallel), tp, expert_parallel)


def test_vllm_uneven_expert_parallel(tmp_path, capsys):
    """4 experts over 3 ranks: the first E % 3 ranks one more, contiguous (moe.md 4.2: [0, 1], [2], [3]). A Qwen3-MoE
    with 6 heads over 3 KV heads and vocab 1100 (padded 1152 = 3 * 384) so tp 3 is otherwise valid."""
    settings = dict(FAMILIES["qwen3_moe"][1], num_attention_heads=6, num_key_value_heads=3, vocab_size=1100)
    fam = Family("qwen3_moe", tmp_path, settings)
    check_vllm(fam, fam.vllm(capsys, 3, True), 3, True)


# ------------------------------------------------------------------------------------------ c. round trip

@pytest.mark.parametrize("name", slow_unless_default(sorted(FAMILIES)))
def test_chain_round_trip(families, name, capsys):
    """hf -> megatron tp2 ep2 -> megatron tp1 pp2 ep4 -> megatron tp2 etp1 ep2 -> vllm tp2 -> vllm tp4 EP -> hf."""
    fam = families(name)
    m1 = fam.megatron(capsys, "tp2_ep2")
    check_megatron(fam, m1, "tp2_ep2")
    m2 = fam.convert(capsys, "chain_m2", m1, *megatron_args("tp1_pp2_ep4"))
    check_megatron(fam, m2, "tp1_pp2_ep4")
    m3 = fam.convert(capsys, "chain_m3", m2, *megatron_args("tp2_etp1_ep2"))
    check_megatron(fam, m3, "tp2_etp1_ep2")
    v1 = fam.convert(capsys, "chain_v1", m3, "--to", "vllm", "--tp", 2)
    check_vllm(fam, v1, 2)
    v2 = fam.convert(capsys, "chain_v2", v1, "--to", "vllm", "--tp", 4, "--expert-parallel")
    check_vllm(fam, v2, 4, True)
    back = fam.convert(capsys, "chain_hf", v2, "--to", "hf")
    got, config = load_hf_dir(back)
    problems = diff_states(got, fam.hf, "hf")
    assert not problems, f"{name}: chain back to HF\n" + "\n".join(problems[:40])
    assert config["architectures"] == fam.config["architectures"]
    for key in ("vocab_size", "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "mlp_only_layers", "decoder_sparse_step", "norm_topk_prob",
                "intermediate_size", "head_dim", "num_key_value_heads", "tie_word_embeddings"):
        if key == "head_dim":  # absent/null means hidden / heads
            h, nh = fam.config["hidden_size"], fam.config["num_attention_heads"]
            assert (config.get(key) or h // nh) == (fam.config.get(key) or h // nh)
        elif key in fam.config:
            assert config.get(key) == fam.config[key], f"config.{key}: {config.get(key)!r} != {fam.config[key]!r}"
    code, out, err = run_cli(capsys, "verify", fam.src, back)
    assert code == 0, f"verify {fam.src} {back} exited {code}: {(out + err).strip()[-2000:]}"
    torch.testing.assert_close(logits(back), logits(fam.model), atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------ d. refusals

@pytest.fixture(scope="module")
def odd_ffn(tmp_path_factory):
    """Qwen3-MoE with expert FFN 30 (30 % 4 != 0, 30 % 2 == 0, 30 % 3 == 0) and 4 KV heads, so that tp 4 is valid
    for attention in both Megatron and vLLM and only the expert FFN (or etp) can be the reason for a refusal."""
    root = tmp_path_factory.mktemp("odd_ffn")
    return Family("qwen3_moe", root, dict(FAMILIES["qwen3_moe"][1], moe_intermediate_size=30, num_key_value_heads=4))


def refused(capsys, src, dst, *args, words=()):
    code, out, err = run_cli(capsys, "convert", src, dst, *args)
    assert code == 2, f"convert {' '.join(map(str, args))}: exit {code}, expected 2 (plan-time refusal): " \
                      f"{(out + err).strip()[-1000:]}"
    assert not dst.exists(), f"{dst} was written by a refused conversion"
    msg = err.lower()
    assert any(w in msg for w in words), f"refusal does not name the problem ({words}): {err.strip()}"


REFUSALS = {
    "ep_not_dividing_experts": (["--to", "megatron", "--ep", 3], ("expert", "--ep", "ep")),
    "ep_not_dividing_experts_tp2": (["--to", "megatron", "--tp", 2, "--ep", 3], ("expert", "--ep", "ep")),
    "etp_above_tp": (["--to", "megatron", "--tp", 2, "--ep", 2, "--etp", 4], ("etp",)),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals(families, case, capsys, tmp_path):
    args, words = REFUSALS[case]
    refused(capsys, families(DEFAULT_FAMILY).src, tmp_path / "out", *args, words=words)


def test_refuse_etp_not_dividing_tp(odd_ffn, capsys, tmp_path):
    """--etp 3 with --tp 4: etp must divide tp (moe.md 3.1; 30 % 3 == 0, so etp is the only reason)."""
    refused(capsys, odd_ffn.src, tmp_path / "out", "--to", "megatron", "--tp", 4, "--ep", 2, "--etp", 3,
            words=("etp",))


def test_refuse_vllm_expert_ffn_not_divisible(odd_ffn, capsys, tmp_path):
    """Expert FFN 30 over vLLM tp 4 without --expert-parallel: w13 [E, 2*30/4, H] is impossible (moe.md 4.2)."""
    refused(capsys, odd_ffn.src, tmp_path / "out", "--to", "vllm", "--tp", 4,
            words=("expert", "intermediate", "30", "ffn"))


def test_vllm_expert_parallel_accepts_odd_ffn(odd_ffn, capsys):
    """The same model with --expert-parallel keeps experts whole, so tp 4 is fine."""
    check_vllm(odd_ffn, odd_ffn.vllm(capsys, 4, True), 4, True)


def test_refuse_megatron_expert_ffn_not_divisible_by_etp(odd_ffn, capsys, tmp_path):
    """I % ETP == 0 (moe.md 3.3): 30 over etp 4 refused; etp 2 (15 rows each) is accepted."""
    refused(capsys, odd_ffn.src, tmp_path / "out", "--to", "megatron", "--tp", 4, "--ep", 2,
            words=("expert", "etp", "intermediate", "30", "ffn"))
    dst = tmp_path / "ok"
    code, out, err = run_cli(capsys, "convert", odd_ffn.src, dst, "--to", "megatron", "--tp", 4, "--ep", 2,
                             "--etp", 2)
    assert code == 0, err.strip()[-2000:]
    problems = []
    for t in range(4):
        for e in range(2):
            folder = moe_rules.megatron_folder(t, 0, e, 1, 2)
            blob = load_megatron_rank(moe_rules.megatron_rank_path(dst, folder))
            want = moe_rules.megatron_rank(odd_ffn.hf, odd_ffn.config, 4, t, 1, 0, 2, e, 2)
            problems += diff_states(blob["model"], want, folder, ignore=is_extra_state)
    assert not problems, "\n".join(problems[:40])


# ------------------------------------------------------------------------------------------ e. forward

@pytest.mark.parametrize("name,layout", [
    ("qwen2_moe", "megatron"),
    *[pytest.param(n, "megatron", marks=pytest.mark.slow) for n in ("mixtral", "qwen3_moe")],
    *[pytest.param(n, "vllm", marks=pytest.mark.slow) for n in sorted(FAMILIES)],
])
def test_verify_forward(families, name, layout, capsys):
    """verify --forward --nproc 2 on the Megatron tp2 ep2 output (vLLM tp2 in the slow set): logits within 1e-5."""
    fam = families(name)
    dst = fam.megatron(capsys, "tp2_ep2") if layout == "megatron" else fam.vllm(capsys, 2)
    code, out, err = run_cli(capsys, "verify", "--forward", fam.src, dst, "--nproc", 2, "--json")
    try:
        report = json.loads(out)
    except ValueError:
        report = None
    assert code == 0 and report is not None, f"verify --forward exited {code}: {err.strip()[-2000:]} " \
                                             f"{report and report.get('problems')}"
    assert report["ok"] and report["first_divergence"] is None, report["problems"]
    assert report["max_abs"] <= ATOL and report["argmax_agreement"] == 1.0
    assert (report["b"]["layout"], report["b"]["tp"]) == (layout, 2)


@pytest.mark.parametrize("forward", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_verify_detects_swapped_experts(families, forward, capsys, tmp_path):
    """Swap local experts 0 and 1 of layer 0 in one EP folder of the tp2 ep2 output (so routing sends tokens to the
    wrong weights): verify must exit 1, and so must verify --forward."""
    import shutil

    fam = families(DEFAULT_FAMILY)
    bad = tmp_path / "bad"
    shutil.copytree(fam.megatron(capsys, "tp2_ep2"), bad)
    path = moe_rules.megatron_rank_path(bad, "mp_rank_01_001")
    blob = load_megatron_rank(path)
    m = blob["model"]
    for lin in ("linear_fc1", "linear_fc2"):
        a, b = (f"decoder.layers.0.mlp.experts.local_experts.{j}.{lin}.weight" for j in (0, 1))
        m[a], m[b] = m[b], m[a]
    torch.save(blob, path)
    args = ["verify", *(["--forward", "--nproc", 2] if forward else []), fam.src, bad]
    code, out, err = run_cli(capsys, *args)
    assert code == 1, f"{' '.join(map(str, args))} exited {code}, expected 1: {(out + err).strip()[-1500:]}"
