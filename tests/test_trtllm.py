"""Acceptance tests for the TensorRT-LLM checkpoint layout (``--to trtllm``), against the rules written out in
trtllm_rules.py from shared/layouts/dense-archs.md section F (not from reshard's code).

Sources are position-coded HF checkpoints (checkpoints.make_hf: 4 layers, hidden 64, 8 heads, 2 KV heads, ffn 96,
vocab 1003 so lm_head is padded at tp 2 and tp 4) for a Llama GQA untied, a Llama tied and a Qwen2 (q/k/v biases),
plus one tiny seeded transformers Llama for logits and the forward verifier. Checked through the CLI, in process:
  a. HF -> trtllm (tp 2, pp 2) and (tp 4, pp 1; KV heads repeated): the file set, every rank's names, dtypes, shapes
     and bytes, and config.json (F.3).
  b. HF -> trtllm tp2 pp2 -> HF and HF -> trtllm tp4 -> megatron tp2 -> HF: byte-identical HF tensors and
     ``reshard verify`` exit 0 against the source; transformers' logits of the final HF folder equal the source's.
  c. ``reshard verify SRC TRT --forward`` exits 0 at trtllm tp 2 (pp 1 and pp 2).
  d. Refusals (exit 2, nothing written): --pp 3 over 4 layers; a GPT-2 (no TensorRT-LLM names in reshard).

Default run about 25 s (test_qwen2_config_enables_attention_bias checks a TensorRT-LLM rule from outside section F);
the pp 2 forward check is marked slow:  python -m pytest -q tests/test_trtllm.py -m "slow or not slow"
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch

import megatron_rules
import vllm_rules
from checkpoints import load_hf_tensors, make_hf
from helpers import run_cli, tiny_transformers_model
from trtllm_rules import (EMBED, LM_HEAD, LN_F, config_problems, dup_kv_weight, expected_config, expected_rank,
                          load_config, load_rank, pad_vocab_size, rank_of)

VOCAB = 1003
MODELS = {
    "llama_gqa": dict(arch="LlamaForCausalLM", hidden=64, layers=4, heads=8, kv_heads=2, ffn=96, vocab=VOCAB),
    "llama_tied": dict(arch="LlamaForCausalLM", hidden=64, layers=4, heads=8, kv_heads=2, ffn=96, vocab=VOCAB,
                       tied=True),
    "qwen2": dict(arch="Qwen2ForCausalLM", hidden=64, layers=4, heads=8, kv_heads=2, ffn=96, vocab=VOCAB),
}
SHAPES = [(2, 2), (4, 1)]
ATOL = 1e-5
IDS = [[0, 1, 17, 1002, 500, 3, 3, 999, 42, 7], [5, 1001, 2, 64, 63, 128, 256, 511, 512, 1000]]


# ------------------------------------------------------------------------------------------ fixtures

class Source:
    """One HF source on disk and every conversion made from it (each at most once per module)."""

    def __init__(self, root, name, src):
        self.root, self.name, self.src = root, name, src
        self.hf = load_hf_tensors(src)
        with open(os.path.join(src, "config.json")) as f:
            self.config = json.load(f)
        self.outputs = {}

    def convert(self, capsys, key, src, *args):
        if key not in self.outputs:
            dst = self.root / key
            code, out, err = run_cli(capsys, "convert", src, dst, *map(str, args))
            assert code == 0, f"{self.name}: reshard convert {os.path.basename(str(src))} -> {key} " \
                              f"{' '.join(map(str, args))} exited {code}: {err.strip()[-2000:]}"
            self.outputs[key] = dst
        return self.outputs[key]

    def trtllm(self, capsys, tp, pp):
        return self.convert(capsys, f"trtllm_tp{tp}pp{pp}", self.src, "--to", "trtllm", "--tp", tp, "--pp", pp)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            made[name] = Source(root, name, make_hf(root / "hf", **MODELS[name]))
        return made[name]
    return get


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A seeded transformers Llama (2 layers, 8 heads, 2 KV heads, vocab 1003), saved with save_pretrained."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")
    model = tiny_transformers_model(transformers, "LlamaConfig", num_key_value_heads=2)
    root = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(root / "hf")
    src = Source(root, "tiny_llama", str(root / "hf"))
    src.model = model
    return src


def diff(got: dict, want: dict, where: str) -> list[str]:
    problems = [f"{where}: missing {k} {tuple(want[k].shape)}" for k in sorted(set(want) - set(got))]
    problems += [f"{where}: unexpected {k} {tuple(got[k].shape)}" for k in sorted(set(got) - set(want))]
    for k in sorted(set(got) & set(want)):
        g, w = got[k], want[k]
        if g.dtype != w.dtype or tuple(g.shape) != tuple(w.shape):
            problems.append(f"{where}: {k} {g.dtype} {tuple(g.shape)}, expected {w.dtype} {tuple(w.shape)}")
        elif not torch.equal(g, w):
            problems.append(f"{where}: {k} bytes differ (max |diff| {(g.double() - w.double()).abs().max():.3g})")
    return problems


def check_trtllm(src: Source, folder, tp, pp):
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(str(folder), "*.safetensors")))
    assert files == sorted(f"rank{r}.safetensors" for r in range(tp * pp)), f"{src.name} tp{tp} pp{pp}: {files}"
    assert os.path.isfile(os.path.join(str(folder), "config.json"))
    problems = []
    for r in range(tp * pp):
        problems += diff(load_rank(folder, r), expected_rank(src.hf, src.config, tp, pp, r), f"rank{r}")
    problems += config_problems(load_config(folder), expected_config(src.config, tp, pp))
    assert not problems, f"{src.name} trtllm tp{tp} pp{pp}: {len(problems)} problem(s)\n" + "\n".join(problems[:40])


def check_hf_back(src: Source, back):
    got = load_hf_tensors(back)
    problems = diff(got, src.hf, "hf")
    assert not problems, f"{src.name}: HF after the chain\n" + "\n".join(problems[:40])
    with open(os.path.join(str(back), "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == src.config["architectures"]
    assert config["vocab_size"] == VOCAB
    assert bool(config.get("tie_word_embeddings")) == bool(src.config.get("tie_word_embeddings"))


def verify(capsys, a, b, *extra):
    code, out, err = run_cli(capsys, "verify", a, b, *extra)
    return code, out, err


# ------------------------------------------------------------------------------------------ rules self-check

def test_rules_self_check(sources):
    """Guards trtllm_rules against slips (independent of reshard): tp 1 qkv is [Q; K; V]; dup_kv_weight places KV
    head r*ng//tp on rank r; per-rank qkv equals vLLM's independently written qkv_proj (the same 'blocks per rank'
    rule); lm_head padding appears only when V % tp != 0; the tied head is the embedding."""
    src = sources("qwen2")
    hf, config = src.hf, src.config
    d = 8
    one = expected_rank(hf, config, 1, 1, 0)
    a = "model.layers.0.self_attn."
    assert torch.equal(one["transformer.layers.0.attention.qkv.weight"],
                       torch.cat([hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"]]))
    assert torch.equal(one["transformer.layers.0.attention.qkv.bias"],
                       torch.cat([hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"]]))
    assert one[LM_HEAD].shape == (VOCAB, 64) and torch.equal(one[LM_HEAD], hf["lm_head.weight"])
    k = hf[a + "k_proj.weight"]
    dup = dup_kv_weight(k, 2, 4)
    for r in range(4):
        assert torch.equal(dup[r * d:(r + 1) * d], k[(r * 2 // 4) * d:(r * 2 // 4 + 1) * d])
    for tp in (2, 4):
        for r in range(tp):
            mine = expected_rank(hf, config, tp, 1, r)
            theirs = vllm_rules.expected_rank(hf, config, tp, r)
            for i in range(4):
                assert torch.equal(mine[f"transformer.layers.{i}.attention.qkv.weight"],
                                   theirs[f"model.layers.{i}.self_attn.qkv_proj.weight"])
                assert torch.equal(mine[f"transformer.layers.{i}.attention.qkv.bias"],
                                   theirs[f"model.layers.{i}.self_attn.qkv_proj.bias"])
            assert mine[LM_HEAD].shape == (pad_vocab_size(VOCAB, tp) // tp, 64)
    assert pad_vocab_size(1004, 2) == 1004 and pad_vocab_size(1003, 2) == 1004 and pad_vocab_size(1003, 4) == 1004
    last = expected_rank(hf, config, 4, 1, 3)
    assert torch.count_nonzero(last[LM_HEAD][-1]) == 0
    assert torch.equal(last[LM_HEAD][:-1], hf["lm_head.weight"][3 * 251:])
    tied = sources("llama_tied")
    t = expected_rank(tied.hf, tied.config, 2, 2, rank_of(2, 1, 1))
    assert EMBED not in t and LN_F in t
    assert torch.equal(t[LM_HEAD][:VOCAB - 502], tied.hf["model.embed_tokens.weight"][502:])
    assert sorted(k for k in expected_rank(tied.hf, tied.config, 2, 2, 0) if "layers" not in k) == [EMBED]


# ------------------------------------------------------------------------------------------ a. rank files

@pytest.mark.parametrize("tp,pp", SHAPES, ids=[f"tp{t}pp{p}" for t, p in SHAPES])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_rank_files(sources, name, tp, pp, capsys):
    src = sources(name)
    check_trtllm(src, src.trtllm(capsys, tp, pp), tp, pp)


@pytest.mark.parametrize("how", ["bf16_source", "dtype_flag"])
def test_rank_files_bf16(tmp_path, capsys, how):
    """config.json ``dtype`` names the stored dtype: a bf16 source kept as is, or an fp32 source cast with --dtype bf16
    (the same bytes as casting the rules' tensors)."""
    if how == "bf16_source":
        src = Source(tmp_path, how, make_hf(tmp_path / "hf", dtype=torch.bfloat16, torch_dtype="bfloat16",
                                            **MODELS["llama_gqa"]))
        trt = src.trtllm(capsys, 2, 1)
    else:
        src = Source(tmp_path, how, make_hf(tmp_path / "hf", **MODELS["llama_gqa"]))
        trt = src.convert(capsys, "trt_bf16", src.src, "--to", "trtllm", "--tp", 2, "--dtype", "bf16")
        src.hf = {k: v.to(torch.bfloat16) for k, v in src.hf.items()}
    problems = []
    for r in range(2):
        problems += diff(load_rank(trt, r), expected_rank(src.hf, src.config, 2, 1, r), f"rank{r}")
    problems += config_problems(load_config(trt), expected_config(src.config, 2, 1, dtype="bfloat16"))
    assert not problems, "\n".join(problems[:40])


def test_qwen2_config_enables_attention_bias(sources, capsys):
    """Beyond section F (which covers Llama): TensorRT-LLM builds Qwen2ForCausalLM as QWenForCausalLM, whose
    Attention takes ``bias=config.attn_bias, dense_bias=False`` (models/qwen/model.py @04a2cacb), and
    QWenConfig.from_hugging_face sets ``attn_bias = True`` for qwen2 (models/qwen/config.py). A config.json that
    says ``attn_bias: false`` next to stored ``attention.qkv.bias`` tensors builds an engine without the biases."""
    src = sources("qwen2")
    trt = src.trtllm(capsys, 2, 2)
    config = load_config(trt)
    assert "transformer.layers.0.attention.qkv.bias" in load_rank(trt, 0)
    assert config.get("attn_bias", True) is True, f"attn_bias = {config.get('attn_bias')!r} with qkv biases stored"
    assert "attention.dense.bias" not in " ".join(load_rank(trt, 0))


def test_verify_catches_swapped_mlp(sources, capsys, tmp_path):
    """``reshard verify`` reads the TRT names (so the exit-0 checks above are not vacuous): swapping mlp.fc and
    mlp.gate of local layer 1 on rank 3 (tp 2, pp 2: global layer 3) exits 1 and names gate_proj / up_proj."""
    import shutil

    from safetensors.torch import save_file

    src = sources("llama_gqa")
    bad = tmp_path / "bad"
    shutil.copytree(src.trtllm(capsys, 2, 2), bad)
    t = load_rank(bad, 3)
    fc, gate = "transformer.layers.1.mlp.fc.weight", "transformer.layers.1.mlp.gate.weight"
    t[fc], t[gate] = t[gate].clone(), t[fc].clone()
    save_file(t, str(bad / "rank3.safetensors"))
    code, out, err = verify(capsys, src.src, bad)
    assert code == 1, f"exit {code}: {(out + err).strip()[-2000:]}"
    assert "model.layers.3.mlp.gate_proj.weight" in out + err and "model.layers.3.mlp.up_proj.weight" in out + err


# ------------------------------------------------------------------------------------------ b. chains

@pytest.mark.parametrize("name", sorted(MODELS))
def test_chain_trtllm_tp2pp2_hf(sources, name, capsys):
    src = sources(name)
    trt = src.trtllm(capsys, 2, 2)
    back = src.convert(capsys, "hf_from_trtllm_tp2pp2", trt, "--to", "hf")
    check_hf_back(src, back)
    for b in (trt, back):
        code, out, err = verify(capsys, src.src, b)
        assert code == 0, f"verify {src.name} {os.path.basename(str(b))} exited {code}: {(out + err).strip()[-2000:]}"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_chain_trtllm_tp4_megatron_tp2_hf(sources, name, capsys):
    src = sources(name)
    trt = src.trtllm(capsys, 4, 1)
    meg = src.convert(capsys, "megatron_from_trtllm_tp4", trt, "--to", "megatron", "--tp", 2)
    problems = []
    for t in range(2):
        state = megatron_rules.load_rank(megatron_rules.rank_file(meg, t, 0, 1))["model"]
        state = {k: v for k, v in state.items() if "_extra_state" not in k}
        problems += diff(state, megatron_rules.expected_rank_state(src.hf, src.config, 2, t, 1, 0), f"mp_rank_{t:02d}")
    assert not problems, f"{name}: megatron tp2 from trtllm tp4\n" + "\n".join(problems[:40])
    back = src.convert(capsys, "hf_from_megatron_tp2", meg, "--to", "hf")
    check_hf_back(src, back)
    for b in (trt, meg, back):
        code, out, err = verify(capsys, src.src, b)
        assert code == 0, f"verify {src.name} {os.path.basename(str(b))} exited {code}: {(out + err).strip()[-2000:]}"


def test_chains_transformers_logits(tiny_llama, capsys):
    """Both chains on a seeded transformers Llama: the final HF folders load in transformers and give the source's
    logits (fp32, atol 1e-5); their tensors are byte-identical to the source's."""
    transformers = pytest.importorskip("transformers")
    src = tiny_llama
    a = src.convert(capsys, "trt22", src.src, "--to", "trtllm", "--tp", 2, "--pp", 2)
    a = src.convert(capsys, "hf_a", a, "--to", "hf")
    b = src.convert(capsys, "trt4", src.src, "--to", "trtllm", "--tp", 4)
    b = src.convert(capsys, "meg2", b, "--to", "megatron", "--tp", 2)
    b = src.convert(capsys, "hf_b", b, "--to", "hf")
    ids = torch.tensor(IDS)
    with torch.no_grad():
        want = src.model(ids).logits
    for back in (a, b):
        got = load_hf_tensors(back)
        assert not diff(got, src.hf, "hf"), diff(got, src.hf, "hf")[:20]
        loaded = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = loaded(ids).logits
        torch.testing.assert_close(logits, want, atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------ c. forward

@pytest.mark.parametrize("tp,pp", [(2, 1), pytest.param(2, 2, marks=pytest.mark.slow)], ids=["tp2", "tp2pp2"])
def test_verify_forward(tiny_llama, tp, pp, capsys):
    src = tiny_llama
    trt = src.convert(capsys, f"trt_fwd_tp{tp}pp{pp}", src.src, "--to", "trtllm", "--tp", tp, "--pp", pp)
    code, out, err = run_cli(capsys, "verify", "--forward", src.src, trt, "--json")
    try:
        report = json.loads(out)
    except ValueError:
        report = None
    assert code == 0 and report is not None, f"verify --forward trtllm tp{tp} pp{pp} exited {code}: " \
                                             f"{err.strip()[-2000:]} {report and report.get('problems')}"
    assert report["ok"] and report["first_divergence"] is None, report.get("problems")
    assert report["max_abs"] <= ATOL and report["argmax_agreement"] == 1.0, report
    assert (report["b"]["layout"], report["b"]["tp"]) == ("trtllm", tp), report["b"]
    assert report["b"]["padded_vocab"] == pad_vocab_size(VOCAB, tp) and report["padding_max_abs_b"] == 0.0


# ------------------------------------------------------------------------------------------ d. refusals

def test_refuses_uneven_pipeline(sources, capsys, tmp_path):
    src = sources("llama_gqa")
    dst = tmp_path / "trt_pp3"
    code, out, err = run_cli(capsys, "convert", src.src, dst, "--to", "trtllm", "--pp", 3)
    assert code == 2, f"exit {code}: {(out + err).strip()[-2000:]}"
    assert not dst.exists()
    assert err.strip(), "the refusal should say why"


def test_refuses_gpt2(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=8, vocab_size=VOCAB)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    dst = tmp_path / "trt"
    code, out, err = run_cli(capsys, "convert", tmp_path / "gpt2", dst, "--to", "trtllm", "--tp", 2)
    assert code == 2, f"exit {code}: {(out + err).strip()[-2000:]}"
    assert not dst.exists()
    assert err.strip(), "the refusal should say why"


def test_tp3_pads_lm_head_to_a_multiple_of_three(tmp_path, capsys):
    """tp 3 with vocab 1003: TensorRT-LLM pads lm_head to 1005 rows (a multiple of tp, not vLLM's 64), 6 heads over
    3 KV heads; the files match the rules and run (reshard once refused this with vLLM's vocab rule)."""
    path = make_hf(str(tmp_path / "hf"), hidden=96, layers=2, heads=6, kv_heads=3, ffn=96, vocab=VOCAB)
    src = Source(tmp_path, "llama_h6", path)
    check_trtllm(src, src.trtllm(capsys, 3, 1), 3, 1)
    assert run_cli(capsys, "verify", path, tmp_path / "trtllm_tp3pp1", "--forward")[0] == 0
