"""Model meaning, not only bytes: the canonical model config is carried faithfully between config.json (transformers
4 and 5 spellings) and Megatron args, or refused by name; verify compares meaning. One test (or more) per item of
the issue's list, numbered as there."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard
from checkpoints import hf_config, hf_tensor_shapes, make_hf, position_coded, seeded, write_hf
from cli_inprocess import run_main
from reshard.errors import PlanError
from test_megatron_lm_files import write_megatron_lm_checkpoint

transformers = pytest.importorskip("transformers")

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
#: Megatron args that change what the model computes (compared across round trips).
COMPUTE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "swiglu", "normalization", "norm_epsilon", "position_embedding_type", "rotary_base",
                "rotary_percent", "rotary_interleaved", "use_rope_scaling", "rope_scaling_factor",
                "rotary_seq_len_interpolation_factor", "window_size", "add_bias_linear", "add_qkv_bias",
                "apply_residual_connection_post_layernorm", "untie_embeddings_and_output_weights", "vocab_size",
                "max_position_embeddings")


def rank_files(root) -> list[str]:
    return sorted(glob.glob(os.path.join(str(root), "*", "mp_rank_*", "model_optim_rng.pt")))


def megatron_args(root):
    return torch.load(rank_files(root)[0], weights_only=False)["args"]


def rewrite_args(root, drop=(), **changes) -> None:
    """Edit the args of every rank file of a Megatron checkpoint (a test-made one: trusted pickles)."""
    for path in rank_files(root):
        state = torch.load(path, weights_only=False)
        for key in drop:
            if hasattr(state["args"], key):
                delattr(state["args"], key)
        for key, value in changes.items():
            setattr(state["args"], key, value)
        torch.save(state, path)


def save_tiny(path, cls="LlamaConfig", **extra) -> str:
    from helpers import tiny_transformers_model

    model = tiny_transformers_model(transformers, cls, num_key_value_heads=2, **extra)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def edit_config(path, **changes) -> None:
    cfg_path = os.path.join(path, "config.json")
    config = json.load(open(cfg_path))
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    json.dump(config, open(cfg_path, "w"))


def v4_spelling(src, dst) -> str:
    """The same checkpoint with config.json in the transformers 4 spelling (rope_theta + rope_scaling)."""
    shutil.copytree(src, dst)
    config = json.load(open(os.path.join(dst, "config.json")))
    params = dict(config.pop("rope_parameters"))
    config["rope_theta"] = params.pop("rope_theta")
    kind = params.get("rope_type", "default")
    config["rope_scaling"] = None if kind == "default" else params
    json.dump(config, open(os.path.join(dst, "config.json"), "w"))
    return str(dst)


# -- 1, 2: RoPE carried into Megatron args in both spellings, refused where args have no spelling ----------------

def test_1_rope_parameters_reach_megatron_args(tmp_path):
    hf = save_tiny(tmp_path / "hf", rope_theta=500000.0, rope_scaling=dict(LLAMA3))
    assert "rope_parameters" in json.load(open(os.path.join(hf, "config.json")))  # transformers 5 spelling
    reshard.convert(hf, str(tmp_path / "m5"), to="megatron", tp=2)
    args = megatron_args(tmp_path / "m5")
    assert (args.rotary_base, args.use_rope_scaling, args.rope_scaling_factor) == (500000, True, 8.0)
    old = v4_spelling(hf, tmp_path / "hf4")
    reshard.convert(old, str(tmp_path / "m4"), to="megatron", tp=2)
    args4 = megatron_args(tmp_path / "m4")
    assert {k: getattr(args4, k, None) for k in COMPUTE_ARGS} == {k: getattr(args, k, None) for k in COMPUTE_ARGS}
    with reshard.layouts.open_checkpoint(hf) as a, reshard.layouts.open_checkpoint(old) as b:
        assert a.model.meaning == b.model.meaning
        assert a.model.meaning.rope_theta == 500000.0 and a.model.meaning.scaling == LLAMA3


def test_2_rope_scaling_type_key_and_kinds(tmp_path):
    base = make_hf(tmp_path / "base", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    linear = str(tmp_path / "linear")
    shutil.copytree(base, linear)
    edit_config(linear, rope_scaling={"type": "linear", "factor": 4.0})  # the older 'type' key
    reshard.convert(linear, str(tmp_path / "ml"), to="megatron", tp=2)
    args = megatron_args(tmp_path / "ml")
    assert args.rotary_seq_len_interpolation_factor == 4.0 and args.use_rope_scaling is False
    reshard.convert(str(tmp_path / "ml"), str(tmp_path / "back"), to="hf")
    assert reshard.verify(linear, str(tmp_path / "back")).equal
    for kind in ("dynamic",):  # yarn converts for standard attention: tests/test_yarn_megatron.py
        src = str(tmp_path / kind)
        shutil.copytree(base, src)
        edit_config(src, rope_scaling={"rope_type": kind, "factor": 4.0, "original_max_position_embeddings": 64})
        proc = run_main("convert", src, tmp_path / f"m-{kind}", "--to", "megatron", "--tp", "2")
        assert proc.returncode == 2 and "rope_scaling" in proc.stderr and kind in proc.stderr, proc.stderr
        assert not (tmp_path / f"m-{kind}").exists()
        proc = run_main("convert", src, tmp_path / f"m-{kind}", "--to", "megatron", "--tp", "2",
                        "--allow-lossy-config", "rope_scaling")
        assert proc.returncode == 0 and "dropped rope_scaling" in proc.stderr


# -- 3: verify compares meaning ----------------------------------------------------------------------------------

def test_3_verify_compares_meaning_not_spelling(tmp_path):
    hf = save_tiny(tmp_path / "a", rope_theta=10000.0)
    other = str(tmp_path / "theta")
    shutil.copytree(hf, other)
    config = json.load(open(os.path.join(other, "config.json")))
    config["rope_parameters"]["rope_theta"] = 500000.0
    json.dump(config, open(os.path.join(other, "config.json"), "w"))
    report = reshard.verify(hf, other)
    assert not report.equal and report.config_differences == [{"key": "rope_theta", "a": 10000.0, "b": 500000.0}]
    assert reshard.verify(hf, v4_spelling(hf, tmp_path / "v4")).equal
    # An HF checkpoint and a Megatron-LM checkpoint (no recorded HF config) of the same weights: equal.
    config = hf_config(hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, layers=2)
    tensors = position_coded(hf_tensor_shapes(config))
    write_hf(tmp_path / "hf", config, tensors, 1)
    write_megatron_lm_checkpoint(str(tmp_path / "mlm"), config, tensors, 2)
    report = reshard.verify(str(tmp_path / "hf"), str(tmp_path / "mlm"))
    assert report.equal, report.config_differences


# -- 4: verify --forward refuses what the decoder lacks before any worker starts ---------------------------------

@pytest.mark.parametrize("kind", ["proportional"])  # Gemma 4's; the others: tests/test_forward_features.py
def test_4_forward_refuses_unimplemented_rope_cleanly(kind, tmp_path):
    hf = make_hf(tmp_path / "hf", coded=False, hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    edit_config(hf, rope_scaling={"rope_type": kind, "factor": 4.0, "original_max_position_embeddings": 64})
    proc = run_main("verify", "--forward", hf, hf, "--nproc", "2")
    assert proc.returncode == 2, proc.stderr
    assert f"does not implement rope_scaling type '{kind}'" in proc.stderr
    assert "rank" not in proc.stderr and "Connection" not in proc.stderr  # refused in this process, before workers


# -- 5: a cast that overflows is refused, and verify never calls inf equal ---------------------------------------

def test_5_fp16_overflow_is_refused_and_not_equal(tmp_path):
    config = hf_config(hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, layers=2)
    tensors = seeded(hf_tensor_shapes(config), 0)  # position codes would overflow fp16 everywhere
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = 1e6
    src = write_hf(tmp_path / "hf", config, tensors, 1)
    proc = run_main("convert", src, tmp_path / "h16", "--to", "hf", "--dtype", "fp16")
    assert proc.returncode == 2 and "model.layers.1.mlp.up_proj.weight" in proc.stderr and "inf" in proc.stderr
    assert not (tmp_path / "h16").exists()
    proc = run_main("convert", src, tmp_path / "h16", "--to", "hf", "--dtype", "fp16", "--allow-cast-overflow")
    assert proc.returncode == 0, proc.stderr
    report = reshard.verify(src, str(tmp_path / "h16"))
    bad = [t for t in report.tensors if not t.ok]
    assert not report.equal and [(t.name, t.status) for t in bad] == [("model.layers.1.mlp.up_proj.weight",
                                                                         "cast_overflow")]
    assert reshard.verify(src, str(tmp_path / "h16"), atol=1e9).equal is False  # no tolerance makes inf equal


# -- 6: biases Megatron args cannot spell, and the HF config written from the weights ----------------------------

def test_6_attention_bias_without_mlp_bias(tmp_path):
    hf = save_tiny(tmp_path / "hf", attention_bias=True, mlp_bias=False)
    with pytest.raises(PlanError, match="o_bias"):
        reshard.convert(hf, str(tmp_path / "m"), to="megatron", tp=2)
    assert not (tmp_path / "m").exists()
    reshard.convert(hf, str(tmp_path / "v"), to="vllm", tp=2)
    reshard.convert(str(tmp_path / "v"), str(tmp_path / "back"), to="hf")
    config = json.load(open(tmp_path / "back" / "config.json"))
    assert (config["attention_bias"], config["mlp_bias"]) == (True, False)
    assert reshard.verify(hf, str(tmp_path / "back")).equal


# -- 7: Megatron args that change the computation are read, and refused where HF cannot spell them ----------------

@pytest.mark.parametrize("arg, value, field", [("rotary_percent", 0.5, "rotary_fraction"),
                                               ("rotary_interleaved", True, "rope_interleaved"),
                                               ("apply_residual_connection_post_layernorm", True,
                                                "residual_post_norm")])
def test_7_megatron_compute_args_are_not_ignored(arg, value, field, tmp_path):
    config = hf_config(hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, layers=2)
    tensors = position_coded(hf_tensor_shapes(config))
    write_hf(tmp_path / "hf", config, tensors, 1)
    root = write_megatron_lm_checkpoint(str(tmp_path / "mlm"), config, tensors, 2)
    rewrite_args(root, **{arg: value})
    proc = run_main("convert", root, tmp_path / "out", "--to", "hf")
    assert proc.returncode == 2 and field in proc.stderr, proc.stderr
    report = reshard.verify(str(tmp_path / "hf"), root)
    assert [d["key"] for d in report.config_differences] == [field]
    # Megatron to Megatron keeps it.
    reshard.convert(root, str(tmp_path / "m4"), to="megatron", tp=1)
    assert getattr(megatron_args(tmp_path / "m4"), arg) == value


@pytest.mark.parametrize("arg, value", [("glu_linear_offset", 1.0), ("no_rope_freq", [1, 1]), ("qk_l2_norm", True),
                                        ("squared_relu", True), ("moe_router_topk_limited_devices", 4)])
def test_7_args_reshard_does_not_carry_are_refused_on_read(arg, value, tmp_path):
    """megatron-core reads these (measured: glu_linear_offset 1.0 moves its logits by 1.8); a reader that ignores
    them would convert another function."""
    config = hf_config(hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, layers=2)
    root = write_megatron_lm_checkpoint(str(tmp_path / "mlm"), config, position_coded(hf_tensor_shapes(config)), 2)
    rewrite_args(root, **{arg: value})
    proc = run_main("convert", root, tmp_path / "out", "--to", "hf")
    assert proc.returncode == 2 and f"args set {arg} = {value!r}" in proc.stderr, proc.stderr


@pytest.mark.parametrize("arg, value, field", [("softmax_scale", 0.5, "query_scale"), ("apply_layernorm_1p", True,
                                                                                     "norm_offset")])
def test_7_args_carried_but_not_by_a_llama_config_are_refused_at_plan_time(arg, value, field, tmp_path):
    """softmax_scale (measured: 0.5 moves megatron-core's logits by 0.13) and zero-centred norms are carried now
    (Gemma's query_pre_attn_scalar and 1 + w norms), so a Llama run with them reads fine and is refused where a
    Llama config.json cannot spell them, naming the canonical field."""
    config = hf_config(hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, layers=2)
    root = write_megatron_lm_checkpoint(str(tmp_path / "mlm"), config, position_coded(hf_tensor_shapes(config)), 2)
    rewrite_args(root, **{arg: value})
    proc = run_main("convert", root, tmp_path / "out", "--to", "hf")
    assert proc.returncode == 2 and f"cannot express {field} = " in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


# -- 8, 9, 10: vocab size and divisor, mixed rank folders ------------------------------------------------------------

def test_8_vocab_size_disagreeing_with_the_record_is_refused(tmp_path):
    config = hf_config(hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, layers=2)
    tensors = position_coded(hf_tensor_shapes(config))
    root = write_megatron_lm_checkpoint(str(tmp_path / "mlm"), config, tensors, 2)
    proc = run_main("convert", root, tmp_path / "out", "--to", "hf", "--vocab-size", "900")
    assert proc.returncode == 2 and "--vocab-size 900 disagrees with the vocab size 1000" in proc.stderr
    assert "dropping 100 rows" in proc.stderr
    assert run_main("convert", root, tmp_path / "out", "--to", "hf", "--vocab-size", "1000").returncode == 0


@pytest.mark.parametrize("divisor", ["0", "-1"])
def test_9_vocab_divisor_must_be_positive(divisor, tmp_path):
    hf = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    proc = run_main("convert", hf, tmp_path / "m", "--to", "megatron", "--tp", "2",
                    "--make-vocab-size-divisible-by", divisor)
    assert proc.returncode == 2 and "--make-vocab-size-divisible-by must be a positive integer" in proc.stderr
    assert not (tmp_path / "m").exists()


def test_10_mixed_pp_and_no_pp_rank_folders_are_refused(tmp_path):
    hf = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    reshard.convert(hf, str(tmp_path / "m"), to="megatron", tp=1)
    shutil.copytree(tmp_path / "m" / "release" / "mp_rank_00", tmp_path / "m" / "release" / "mp_rank_00_000")
    proc = run_main("inspect", tmp_path / "m")
    assert proc.returncode == 2 and "mp_rank_00 (a pp=1 rank) and mp_rank_00_000 (a pp>1 or ep>1 rank)" in proc.stderr


# -- 11: sliding window carried into args and used by the forward verifier ------------------------------------------

def test_11_sliding_window_is_carried_and_checked(tmp_path):
    hf = save_tiny(tmp_path / "hf", cls="MistralConfig", sliding_window=4, head_dim=8)
    reshard.convert(hf, str(tmp_path / "m"), to="megatron", tp=2)
    assert tuple(megatron_args(tmp_path / "m").window_size) == (3, 0)
    reshard.convert(str(tmp_path / "m"), str(tmp_path / "back"), to="hf")
    assert json.load(open(tmp_path / "back" / "config.json"))["sliding_window"] == 4
    ok = run_main("verify", "--forward", hf, tmp_path / "m", "--seq-len", "24", "--json")
    assert ok.returncode == 0, ok.stderr + ok.stdout
    # The same rank files with the window dropped from the args: a different function, and verify says so.
    rewrite_args(tmp_path / "m", window_size=None)
    assert [d["key"] for d in reshard.verify(hf, str(tmp_path / "m")).config_differences] == ["sliding_window"]
    bad = run_main("verify", "--forward", hf, tmp_path / "m", "--seq-len", "24", "--json")
    assert bad.returncode == 1 and json.loads(bad.stdout)["max_abs"] > 1e-3
    short = json.loads(run_main("verify", "--forward", hf, hf, "--seq-len", "4", "--json").stdout)
    assert any("window (4 tokens) is not exercised" in n for n in short["notes"])


def test_11_decoder_window_matches_transformers(tmp_path):
    from reshard.layouts.base import Options
    from reshard.verification.forward.decoder import TPGroup, cast_weights, forward
    from reshard.verification.forward.sliced_rank import load_rank

    hf = save_tiny(tmp_path / "hf", cls="MistralConfig", sliding_window=4, head_dim=8)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).float().eval()
    ids = torch.randint(0, 1003, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        weights = cast_weights(load_rank(hf, 0, 1, Options()), torch.float32, "cpu")
        got = forward(weights, ids, TPGroup()).logits
    assert weights.config.window_layers == (0, 1)
    assert (got - expected).abs().max().item() <= 1e-5


def test_11_qwen2_window_layers(tmp_path):
    from reshard.layouts.registry import open_checkpoint

    hf = save_tiny(tmp_path / "hf", cls="Qwen2Config", use_sliding_window=True, sliding_window=4,
                   max_window_layers=1)
    with open_checkpoint(hf) as source:
        assert (source.model.meaning.sliding_window, source.model.meaning.sliding_layers) == (4, (1,))
    with pytest.raises(PlanError, match="sliding_layers"):  # window_size applies to every layer
        reshard.convert(hf, str(tmp_path / "m"), to="megatron", tp=2)
    reshard.convert(hf, str(tmp_path / "v"), to="vllm", tp=2)
    assert reshard.verify(hf, str(tmp_path / "v")).equal


# -- 12: crashes and misleading errors ------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["[]", "null", "3"])
def test_12_config_json_not_an_object(text, tmp_path):
    hf = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    (tmp_path / "hf" / "config.json").write_text(text)
    proc = run_main("inspect", hf)
    assert proc.returncode == 2 and "not a JSON object of model settings" in proc.stderr


def test_12_forward_between_different_models(tmp_path):
    a = make_hf(tmp_path / "a", coded=False, hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    b = make_hf(tmp_path / "b", coded=False, hidden=128, heads=8, kv_heads=2, ffn=96, vocab=1000)
    proc = run_main("verify", "--forward", a, b)
    assert proc.returncode == 1 and "different models (hidden 64 vs 128" in proc.stderr
    assert "internal error" not in proc.stderr


def test_12_architectures_as_a_string(tmp_path):
    hf = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    edit_config(hf, architectures="LlamaForCausalLM")
    proc = run_main("inspect", hf)
    assert proc.returncode == 2 and "'architectures' must be a list" in proc.stderr


@pytest.mark.parametrize("stray", ["consolidated.safetensors", "adapter_model.safetensors"])
def test_12_stray_safetensors_beside_the_model(stray, tmp_path):
    hf = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    save_file({"x": torch.zeros(3)}, os.path.join(hf, stray))
    proc = run_main("convert", hf, tmp_path / "m", "--to", "megatron", "--tp", "2")
    assert proc.returncode == 0, proc.stderr
    assert f"skipped {stray}" in proc.stderr


def test_12_legacy_megatron_lm_names(tmp_path):
    hf = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    reshard.convert(hf, str(tmp_path / "m"), to="megatron", tp=1)
    path = rank_files(tmp_path / "m")[0]
    state = torch.load(path, weights_only=False)
    state["model"] = {k.replace("decoder.", "language_model.encoder.").replace("embedding.", "language_model.embedding."): v
                      for k, v in state["model"].items()}
    torch.save(state, path)
    proc = run_main("inspect", tmp_path / "m")
    assert proc.returncode == 2 and "legacy (pre-Megatron-Core) Megatron-LM names" in proc.stderr


def test_12_replica_dtypes_are_named(tmp_path):
    hf = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    reshard.convert(hf, str(tmp_path / "m"), to="megatron", tp=2)
    path = rank_files(tmp_path / "m")[1]
    state = torch.load(path, weights_only=False)
    name = "decoder.final_layernorm.weight"
    state["model"][name] = state["model"][name].to(torch.bfloat16)
    torch.save(state, path)
    proc = run_main("convert", tmp_path / "m", tmp_path / "out", "--to", "hf")
    assert proc.returncode == 2 and "stored as F32 vs BF16" in proc.stderr, proc.stderr


def test_12_quantized_checkpoint_is_named(tmp_path):
    hf = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    edit_config(hf, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    proc = run_main("convert", hf, tmp_path / "m", "--to", "megatron", "--tp", "2")
    assert proc.returncode == 2 and "quantized checkpoint (quantization_config: fp8)" in proc.stderr


def test_12_output_below_a_file_is_a_usage_error(tmp_path):
    hf = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    (tmp_path / "afile").write_text("x")
    proc = run_main("convert", hf, tmp_path / "afile" / "out", "--to", "hf")
    assert proc.returncode == 2 and "which is a file, not a folder" in proc.stderr


def test_12_vllm_folder_missing_upper_ranks(tmp_path):
    hf = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    reshard.convert(hf, str(tmp_path / "v"), to="vllm", tp=4)
    os.remove(tmp_path / "v" / "reshard.json")  # as vLLM's own save_sharded_state leaves it: no record
    for r in (2, 3):
        for p in glob.glob(str(tmp_path / "v" / f"model-rank-{r}-part-*.safetensors")):
            os.remove(p)
    for path in glob.glob(str(tmp_path / "v" / "model-rank-*.safetensors")):  # and no metadata record either
        save_file(load_file(path), path)
    proc = run_main("inspect", tmp_path / "v")
    assert proc.returncode == 2 and "rank files are missing (found ranks 0..1" in proc.stderr, proc.stderr


# -- 13: smaller ones ------------------------------------------------------------------------------------------------

def test_13_both_dtype_keys_follow_a_cast(tmp_path):
    hf = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    edit_config(hf, dtype="float32", torch_dtype="float32")
    reshard.convert(hf, str(tmp_path / "b"), to="hf", dtype="bf16")
    config = json.load(open(tmp_path / "b" / "config.json"))
    assert (config["dtype"], config["torch_dtype"]) == ("bfloat16", "bfloat16")


def test_13_custom_code_files_travel_with_auto_map(tmp_path):
    hf = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    edit_config(hf, auto_map={"AutoConfig": "configuration_acme.AcmeConfig",
                              "AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM",
                              "AutoTokenizer": ["other/repo--tokenization.Tok", None]})
    for name in ("configuration_acme.py", "modeling_acme.py"):
        (tmp_path / "hf" / name).write_text("# custom code\n")
    for to, extra in (("hf", ()), ("vllm", ("--tp", "2"))):
        out = tmp_path / f"out-{to}"
        assert run_main("convert", hf, out, "--to", to, *extra).returncode == 0
        assert (out / "configuration_acme.py").is_file() and (out / "modeling_acme.py").is_file()


def test_13_untied_by_default_is_warned(tmp_path):
    config = hf_config(hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, layers=2, tied=True)
    del config["tie_word_embeddings"]
    write_hf(tmp_path / "hf", config, position_coded(hf_tensor_shapes({**config, "tie_word_embeddings": True})), 1)
    proc = run_main("convert", tmp_path / "hf", tmp_path / "m", "--to", "megatron", "--tp", "2")
    assert proc.returncode == 0 and "no tie_word_embeddings and there is no lm_head.weight" in proc.stderr


def test_13_dropped_state_names_distrib_optim(tmp_path):
    config = hf_config(hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, layers=2)
    root = write_megatron_lm_checkpoint(str(tmp_path / "mlm"), config, position_coded(hf_tensor_shapes(config)), 2)
    for path in rank_files(root):
        torch.save({"param_state": torch.zeros(2)}, os.path.join(os.path.dirname(path), "distrib_optim.pt"))
    result = reshard.convert(root, str(tmp_path / "out"), to="hf")
    assert any("distrib_optim.pt" in n for n in result.notes)


# -- Round trips over spellings and through Megatron ------------------------------------------------------------------

def test_megatron_hf_megatron_keeps_every_compute_arg(tmp_path):
    hf = save_tiny(tmp_path / "hf", cls="MistralConfig", sliding_window=8, rope_theta=500000.0,
                   rope_scaling={"rope_type": "linear", "factor": 2.0})
    reshard.convert(hf, str(tmp_path / "m1"), to="megatron", tp=2)
    reshard.convert(str(tmp_path / "m1"), str(tmp_path / "h"), to="hf")
    reshard.convert(str(tmp_path / "h"), str(tmp_path / "m2"), to="megatron", tp=2)
    a, b = megatron_args(tmp_path / "m1"), megatron_args(tmp_path / "m2")
    assert {k: getattr(a, k, None) for k in COMPUTE_ARGS} == {k: getattr(b, k, None) for k in COMPUTE_ARGS}
    assert (a.rotary_base, a.rotary_seq_len_interpolation_factor, tuple(a.window_size)) == (500000, 2.0, (7, 0))
    assert reshard.verify(hf, str(tmp_path / "h")).equal and reshard.verify(hf, str(tmp_path / "m2")).equal


def test_lossy_config_names_must_be_fields(tmp_path):
    hf = make_hf(tmp_path / "hf", hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000)
    with pytest.raises(PlanError, match="not a canonical config field"):
        reshard.convert(hf, str(tmp_path / "m"), to="megatron", allow_lossy_config=("rope",))
