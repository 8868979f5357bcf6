"""Acceptance test against megatron-core's own GPTModel for two families beyond Llama: GPT-2 and Qwen3.

``tests/mcore_family_harness.py`` (once per module, in a subprocess: two gloo ranks on the CPU, about a minute on
two cores) builds megatron-core's GPTModel at TP=2 from Megatron-LM-style ``args`` and saves Megatron-LM ``torch``
rank files (args included, no ``hf_config``) plus megatron-core's fp32 logits for fixed ids:

* ``gpt2``: learned absolute positions, LayerNorm with bias, biases on every linear, MHA, non-gated GELU run as
  megatron-core's ``bias_gelu`` (Megatron-LM's default ``--bias-gelu-fusion``: tanh GELU), tied head;
* ``qwen3``: RoPE, RMSNorm, SwiGLU, GQA 8/2, ``kv_channels`` 16 != 64/8, per-head ``qk_layernorm``, tied head;
* ``qwen3-untied``: the same with its own output layer, under ``iter_0000007`` instead of ``release``.

``reshard convert CKPT OUT --to hf`` must then produce the family's Hugging Face checkpoint (GPT-2: Conv1D
``c_attn`` [H, 3H]; Qwen3: ``q_norm`` [head_dim]) whose transformers logits equal megatron-core's (fp32, 1e-5),
the architecture derived from the args alone.  Before reshard is trusted, ``test_harness_matches_transformers``
converts the shards by hand (below) and shows transformers reproduces megatron-core's logits, and
``test_tolerance_catches`` shows the tolerance rejects the mistakes a converter could make for these families.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'reshard[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

sys.path.insert(0, str(Path(__file__).parent))
from _mcore_helpers import hand_convert, load_rank_state_dicts, run_isolated  # noqa: E402
from helpers import run_cli  # noqa: E402

HARNESS = Path(__file__).with_name("mcore_family_harness.py")
ATOL = 1e-5
CASES = ("gpt2", "qwen3", "qwen3-untied")
ARCHITECTURE = {"gpt2": "GPT2LMHeadModel", "qwen3": "Qwen3ForCausalLM", "qwen3-untied": "Qwen3ForCausalLM"}


# ---- megatron-core shards -> Hugging Face tensors, by hand (from megatron-core's layout rules) ----

def gpt2_hand_convert(sds: list[dict], args, *, bug: str | None = None) -> dict[str, torch.Tensor]:
    """megatron-core local-spec TP shards (GPT-2 settings) -> HF GPT-2 tensors (Conv1D: stored [in, out]).
    ``bug`` injects a known mistake: ``blocks_qkv`` (read linear_qkv as [Q;K;V] instead of per-head [q_h;k_h;v_h]),
    ``proj_untransposed`` (attn.c_proj written [out, in]: same square shape)."""
    nh, d, H, V = args.num_attention_heads, args.kv_channels, args.hidden_size, args.vocab_size

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([sd[name] for sd in sds], dim=dim)

    def rep(name: str) -> torch.Tensor:
        for sd in sds[1:]:
            assert torch.equal(sd[name], sds[0][name]), f"replicated {name} differs across ranks"
        return sds[0][name].clone()

    out = {
        "transformer.wte.weight": cat("embedding.word_embeddings.weight", 0)[:V].clone(),
        "transformer.wpe.weight": rep("embedding.position_embeddings.weight"),
        "transformer.ln_f.weight": rep("decoder.final_layernorm.weight"),
        "transformer.ln_f.bias": rep("decoder.final_layernorm.bias"),
    }
    for i in range(args.num_layers):
        pre, hf = f"decoder.layers.{i}.", f"transformer.h.{i}."
        out[hf + "ln_1.weight"] = rep(pre + "input_layernorm.weight")
        out[hf + "ln_1.bias"] = rep(pre + "input_layernorm.bias")
        out[hf + "ln_2.weight"] = rep(pre + "pre_mlp_layernorm.weight")
        out[hf + "ln_2.bias"] = rep(pre + "pre_mlp_layernorm.bias")
        # linear_qkv: per KV group [q heads; k; v], here ng = nh: per head [q_h; k_h; v_h]; rows split over ranks.
        w = cat(pre + "self_attention.linear_qkv.weight", 0)
        b = cat(pre + "self_attention.linear_qkv.bias", 0)
        assert w.shape == (3 * nh * d, H) and b.shape == (3 * nh * d,), (w.shape, b.shape)
        if bug == "blocks_qkv":
            qkv_w, qkv_b = w, b
        else:
            qkv_w = w.view(nh, 3, d, H).transpose(0, 1).reshape(3 * nh * d, H)  # -> [Q; K; V]
            qkv_b = b.view(nh, 3, d).transpose(0, 1).reshape(3 * nh * d)
        out[hf + "attn.c_attn.weight"] = qkv_w.t().contiguous()  # Conv1D [H, 3H]
        out[hf + "attn.c_attn.bias"] = qkv_b.clone()
        proj = cat(pre + "self_attention.linear_proj.weight", 1)  # [H, H]
        out[hf + "attn.c_proj.weight"] = (proj if bug == "proj_untransposed" else proj.t()).contiguous()
        out[hf + "attn.c_proj.bias"] = rep(pre + "self_attention.linear_proj.bias")
        out[hf + "mlp.c_fc.weight"] = cat(pre + "mlp.linear_fc1.weight", 0).t().contiguous()  # [H, F]
        out[hf + "mlp.c_fc.bias"] = cat(pre + "mlp.linear_fc1.bias", 0)
        out[hf + "mlp.c_proj.weight"] = cat(pre + "mlp.linear_fc2.weight", 1).t().contiguous()  # [F, H]
        out[hf + "mlp.c_proj.bias"] = rep(pre + "mlp.linear_fc2.bias")
    return out


def qwen3_hand_convert(sds: list[dict], args, *, bug: str | None = None) -> dict[str, torch.Tensor]:
    """megatron-core local-spec TP shards (Qwen3 settings) -> HF Qwen3 tensors: the Llama rules of
    ``_mcore_helpers.hand_convert`` plus the per-head q/k norms.  ``bug``: ``no_qk_norm`` (q/k norms left at 1),
    ``swap_qk_norm`` (q_norm <- k_layernorm and back)."""
    tied = not args.untie_embeddings_and_output_weights
    if tied:  # hand_convert reads an output layer: give it the shared embedding
        sds = [dict(sd, **{"output_layer.weight": sd["embedding.word_embeddings.weight"]}) for sd in sds]
    out = hand_convert(sds, args)
    if tied:
        del out["lm_head.weight"]
    for i in range(args.num_layers):
        pre, hf = f"decoder.layers.{i}.self_attention.", f"model.layers.{i}.self_attn."
        q, k = sds[0][pre + "q_layernorm.weight"], sds[0][pre + "k_layernorm.weight"]
        for sd in sds[1:]:
            assert torch.equal(sd[pre + "q_layernorm.weight"], q) and torch.equal(sd[pre + "k_layernorm.weight"], k)
        if bug == "no_qk_norm":
            q, k = torch.ones_like(q), torch.ones_like(k)
        elif bug == "swap_qk_norm":
            q, k = k, q
        out[hf + "q_norm.weight"], out[hf + "k_norm.weight"] = q.clone(), k.clone()
    return out


def hf_config(case: str, args):
    """The transformers config that matches the harness' args (what a correct conversion writes)."""
    if case == "gpt2":
        return transformers.GPT2Config(
            vocab_size=args.vocab_size, n_positions=args.max_position_embeddings, n_embd=args.hidden_size,
            n_layer=args.num_layers, n_head=args.num_attention_heads, n_inner=args.ffn_hidden_size,
            activation_function="gelu_new", layer_norm_epsilon=args.norm_epsilon, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    return transformers.Qwen3Config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_query_groups, head_dim=args.kv_channels,
        max_position_embeddings=args.max_position_embeddings, rms_norm_eps=args.norm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": float(args.rotary_base)}, hidden_act="silu",
        attention_bias=False, tie_word_embeddings=not args.untie_embeddings_and_output_weights)


def hand_converted_model(case: str, sds: list[dict], args, **bug):
    convert = gpt2_hand_convert if case == "gpt2" else qwen3_hand_convert
    tensors = convert(sds, args, **bug)
    config = hf_config(case, args)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    result = model.load_state_dict(tensors, strict=False)
    tied = config.tie_word_embeddings
    assert not result.unexpected_keys, result.unexpected_keys
    assert set(result.missing_keys) <= ({"lm_head.weight"} if tied else set()), result.missing_keys
    if tied:
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr(), "not tied"
    return model, tensors


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def max_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return (actual - expected).abs().max().item()


# ---- fixtures ----

@pytest.fixture(scope="module")
def mcore_root(tmp_path_factory):
    """Run the harness once for every case: OUT/CASE holds the rank files and reference.pt."""
    root = tmp_path_factory.mktemp("mcore_families")
    run_isolated([sys.executable, HARNESS, root, *CASES, "--nproc-per-node", "2"], timeout=600)
    return root


@pytest.fixture(scope="module")
def shards(mcore_root):
    cache: dict[str, tuple] = {}

    def get(case: str):
        if case not in cache:
            sds, args = load_rank_state_dicts(mcore_root / case)
            ref = torch.load(mcore_root / case / "reference.pt", map_location="cpu", weights_only=True)
            cache[case] = (sds, args, ref)
        return cache[case]

    return get


# ---- the harness itself ----

def test_harness_rank_files(mcore_root):
    """Megatron-LM's torch format: tracker, iteration folder, one file per TP rank with model/args/version."""
    import argparse

    for case in CASES:
        ckpt = mcore_root / case
        label = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
        folder = ckpt / ("release" if label == "release" else f"iter_{int(label):07d}")
        assert (label == "7") == (case == "qwen3-untied"), label
        files = sorted(folder.glob("mp_rank_*/model_optim_rng.pt"))
        assert [f.parent.name for f in files] == ["mp_rank_00", "mp_rank_01"], files
        torch.serialization.add_safe_globals([argparse.Namespace])
        blob = torch.load(files[1], map_location="cpu", weights_only=True)
        assert blob["checkpoint_version"] == 3.0 and set(blob) == {"model", "args", "checkpoint_version",
                                                                   "iteration"}
        args = blob["args"]
        assert args.tensor_model_parallel_size == 2 and args.transformer_impl == "local"
        assert not hasattr(args, "hf_config"), "the architecture must come from the args"
        sd = blob["model"]
        if case == "gpt2":
            assert sd["embedding.position_embeddings.weight"].shape == (64, 64)
            assert sd["decoder.layers.0.self_attention.linear_qkv.bias"].shape == (3 * 64 // 2,)
            assert "output_layer.weight" not in sd and args.position_embedding_type == "learned_absolute"
        else:
            assert sd["decoder.layers.0.self_attention.q_layernorm.weight"].shape == (16,)
            # per rank: (8/2 q heads + 2 * 2/2 kv groups) * 16 rows
            assert sd["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2) * 16, 64)
            assert ("output_layer.weight" in sd) == (case == "qwen3-untied")


@pytest.mark.parametrize("case", CASES)
def test_harness_matches_transformers(shards, case):
    """Before reshard is trusted: the shards, converted by hand, give transformers megatron-core's logits."""
    sds, args, ref = shards(case)
    model, _ = hand_converted_model(case, sds, args)
    err = max_err(logits_of(model, ref["input_ids"]), ref["logits"])
    assert err <= ATOL, f"{case}: hand conversion vs megatron-core: max |logit diff| {err:.3g}"


@pytest.mark.parametrize("case,bug", [
    ("gpt2", "blocks_qkv"), ("gpt2", "proj_untransposed"), ("gpt2", "erf_gelu"),
    ("qwen3", "no_qk_norm"), ("qwen3", "swap_qk_norm"),
])
def test_tolerance_catches(shards, case, bug):
    """Teeth: each known mistake moves the logits by far more than the tolerance (erf_gelu: HF's exact ``gelu``
    instead of a tanh GELU -- megatron-core runs ``bias_gelu``, the tanh form)."""
    sds, args, ref = shards(case)
    if bug == "erf_gelu":
        model, _ = hand_converted_model(case, sds, args)
        model.config.activation_function = "gelu"
        from transformers.activations import ACT2FN

        for block in model.transformer.h:
            block.mlp.act = ACT2FN["gelu"]
    else:
        model, _ = hand_converted_model(case, sds, args, bug=bug)
    err = max_err(logits_of(model, ref["input_ids"]), ref["logits"])
    assert err > 100 * ATOL, f"{case}/{bug} moves the logits by only {err:.3g}: the check would be toothless"


# ---- reshard ----

def stored_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    assert files, f"no safetensors files in {folder}: {sorted(p.name for p in folder.iterdir())}"
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def tensor_differences(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """Where reshard's tensors differ from the hand conversion: names, shapes, max |diff|."""
    lines = []
    for name in sorted(set(expected) | set(actual)):
        if name not in actual:
            lines.append(f"  missing in reshard's output: {name} {tuple(expected[name].shape)}")
        elif name not in expected:
            lines.append(f"  extra in reshard's output: {name} {tuple(actual[name].shape)}")
        elif actual[name].shape != expected[name].shape:
            lines.append(f"  {name}: shape {tuple(actual[name].shape)}, expected {tuple(expected[name].shape)}")
        else:
            diff = (actual[name].float() - expected[name].float()).abs().max().item()
            if diff > 0:
                lines.append(f"  {name}: max |diff| {diff:.3g}")
    return lines


def logit_report(actual: torch.Tensor, expected: torch.Tensor) -> str:
    diff = (actual - expected).abs()
    per_pos = diff.amax(dim=(0, 2))
    first_bad = next((int(i) for i, e in enumerate(per_pos) if e > ATOL), None)
    b, s, v = (int(x) for x in torch.unravel_index(diff.argmax(), diff.shape))
    return (f"max |logit diff| {diff.max().item():.3g} at batch {b}, position {s}, token {v}; first position above "
            f"{ATOL}: {first_bad}; per position: {[round(e, 6) for e in per_pos.tolist()]}")


@pytest.mark.parametrize("case", CASES)
def test_reshard_to_hf_matches_megatron_core(shards, mcore_root, case, tmp_path, capsys):
    sds, args, ref = shards(case)
    out = tmp_path / "hf"
    code, stdout, stderr = run_cli(capsys, "convert", mcore_root / case, out, "--to", "hf")
    assert code == 0, f"reshard convert {case} --to hf failed (exit {code}):\n{stderr[-3000:]}{stdout[-1000:]}"

    config = json.loads((out / "config.json").read_text())
    assert config.get("architectures") == [ARCHITECTURE[case]], config.get("architectures")
    assert config.get("vocab_size") == args.vocab_size, config.get("vocab_size")
    stored = stored_tensors(out)
    H = args.hidden_size
    if case == "gpt2":  # HF GPT-2 layout: Conv1D weights stored [in, out]
        assert stored["transformer.h.0.attn.c_attn.weight"].shape == (H, 3 * H)
        assert stored["transformer.h.0.mlp.c_fc.weight"].shape == (H, args.ffn_hidden_size)
        assert stored["transformer.wpe.weight"].shape == (args.max_position_embeddings, H)
        assert config.get("activation_function") in ("gelu_new", "gelu_fast", "gelu_pytorch_tanh"), config
    else:
        assert stored["model.layers.0.self_attn.q_norm.weight"].shape == (args.kv_channels,)
        assert stored["model.layers.0.self_attn.k_norm.weight"].shape == (args.kv_channels,)
        assert config.get("head_dim") == args.kv_channels, config.get("head_dim")
        tied = case != "qwen3-untied"
        assert config.get("tie_word_embeddings", False) is tied, config.get("tie_word_embeddings")  # Qwen3: False
        assert ("lm_head.weight" in stored) is not tied

    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(model).__name__ == ARCHITECTURE[case]
    actual = logits_of(model, ref["input_ids"])
    expected = ref["logits"]
    assert actual.shape == expected.shape, f"logits {tuple(actual.shape)} vs megatron-core {tuple(expected.shape)}"
    err = max_err(actual, expected)
    if err > ATOL:
        _, by_hand = hand_converted_model(case, sds, args)
        loaded = {k: v for k, v in model.state_dict().items() if k in by_hand or k in stored}
        where = tensor_differences(loaded, by_hand) or ["  (every tensor equals the hand conversion: a config issue)"]
        pytest.fail(f"{case}: reshard's HF output vs megatron-core: {logit_report(actual, expected)}\n"
                    f"tensors differing from the hand conversion:\n" + "\n".join(where) +
                    f"\nconfig.json: {json.dumps(config, sort_keys=True)}")
