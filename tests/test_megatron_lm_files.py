"""Rank files the way Megatron-LM training writes them: Transformer Engine names, `_extra_state` as BytesIO and
uint8 tensors, numpy RNG and optimizer state in the same pickle, Megatron enums in args, vocab padded to 128*tp.
All loaded with weights_only=True and reshard's allow-list; anything else is refused by name."""

from __future__ import annotations

import argparse
import enum
import io
import json
import os
import random
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

import reshard
from checkpoints import hf_config, hf_tensor_shapes, load_hf_tensors, position_coded
from megatron_rules import expected_rank_state, padded_vocab


def _fake_megatron_enum():
    """megatron.core.transformer.enums.AttnBackend, or a class that pickles under that name without Megatron."""
    try:
        from megatron.core.transformer.enums import AttnBackend

        return AttnBackend
    except ImportError:
        pass
    name = "megatron.core.transformer.enums"
    mod = sys.modules.setdefault(name, types.ModuleType(name))

    class AttnBackend(enum.Enum):
        auto = 5

    AttnBackend.__module__, AttnBackend.__qualname__ = name, "AttnBackend"
    mod.AttnBackend = AttnBackend
    return AttnBackend


def megatron_lm_args(config, tp, with_vocab):
    ns = argparse.Namespace(
        num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        ffn_hidden_size=config["intermediate_size"], num_attention_heads=config["num_attention_heads"],
        group_query_attention=True, num_query_groups=config["num_key_value_heads"],
        kv_channels=config["hidden_size"] // config["num_attention_heads"],
        padded_vocab_size=padded_vocab(config["vocab_size"], tp), make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, swiglu=True, normalization="RMSNorm",
        norm_epsilon=config["rms_norm_eps"], position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0,
        add_bias_linear=False, add_qkv_bias=False, untie_embeddings_and_output_weights=True,
        max_position_embeddings=config["max_position_embeddings"], seq_length=128, params_dtype=torch.float32,
        bf16=False, fp16=False, tokenizer_type="HuggingFaceTokenizer", transformer_impl="transformer_engine",
        attention_backend=_fake_megatron_enum().auto, iteration=1000,
    )
    if with_vocab:
        ns.vocab_size = config["vocab_size"]
    return ns


def write_megatron_lm_checkpoint(root, config, hf, tp, with_vocab=True):
    it_dir = os.path.join(root, "iter_0001000")
    for r in range(tp):
        model = expected_rank_state(hf, config, tp, r, 1, 0, "te")
        for i in range(config["num_hidden_layers"]):
            p = f"decoder.layers.{i}."
            model[p + "self_attention.linear_qkv._extra_state"] = io.BytesIO(b"te-fp8-meta")
            model[p + "self_attention.linear_proj._extra_state"] = io.BytesIO()
            model[p + "self_attention.core_attention._extra_state"] = torch.tensor([1, 2, 3], dtype=torch.uint8)
            model[p + "mlp.linear_fc1._extra_state"] = torch.empty(0, dtype=torch.uint8)
            model[p + "mlp.linear_fc2._extra_state"] = None
        state = {
            "args": megatron_lm_args(config, tp, with_vocab), "checkpoint_version": 3.0, "iteration": 1000,
            "model": model,
            "optimizer": {"optimizer": {"state": {0: {"exp_avg": torch.zeros(4), "exp_avg_sq": torch.ones(4),
                                                      "step": torch.tensor(1000.0)}},
                                        "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95), "params": [0]}]},
                          "fp32_from_fp16_params": [[torch.zeros(3)]]},
            "opt_param_scheduler": {"max_lr": 1e-4, "num_steps": 1000},
            "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                           "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.zeros(16, dtype=torch.uint8),
                           "rng_tracker_states": {"model-parallel-rng": torch.zeros(8, dtype=torch.uint8)}}],
            "num_floating_point_operations_so_far": 1.5e15,
        }
        folder = os.path.join(it_dir, f"mp_rank_{r:02d}")
        os.makedirs(folder)
        torch.save(state, os.path.join(folder, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1000")
    return root


@pytest.fixture
def model():
    config = hf_config(hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, layers=2)
    return config, position_coded(hf_tensor_shapes(config))


def test_megatron_lm_training_file_converts_bit_exact(model, tmp_path):
    config, hf = model
    src = write_megatron_lm_checkpoint(str(tmp_path / "meg"), config, hf, tp=2)
    with pytest.raises(Exception):  # plain weights_only loading fails on these files: the allow-list is needed
        torch.load(os.path.join(src, "iter_0001000/mp_rank_00/model_optim_rng.pt"), weights_only=True)
    info = reshard.inspect(src)
    assert (info["tp"], info["pp"], info["megatron_spec"], info["padded_vocab_size"]) == (2, 1, "te", 1024)
    result = reshard.convert(src, str(tmp_path / "hf"), to="hf")
    assert any("optimizer" in n and "rng_state" in n for n in result.notes)
    out = load_hf_tensors(tmp_path / "hf")
    assert sorted(out) == sorted(hf)
    assert all(torch.equal(out[n], v) for n, v in hf.items())
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["vocab_size"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["tie_word_embeddings"]) == \
        (1000, 2, 8, False)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    # Megatron -> Megatron keeps the run's args (except enum stand-ins) and the iteration.
    reshard.convert(src, str(tmp_path / "tp1"), to="megatron", tp=1)
    assert (tmp_path / "tp1" / "latest_checkpointed_iteration.txt").read_text().strip() == "1000"
    assert (tmp_path / "tp1" / "iter_0001000" / "mp_rank_00" / "model_optim_rng.pt").exists()


def test_true_vocab_from_tokenizer_or_flag(model, tmp_path):
    config, hf = model
    src = write_megatron_lm_checkpoint(str(tmp_path / "meg"), config, hf, tp=2, with_vocab=False)
    with pytest.raises(reshard.CheckpointError, match="vocab_size=N"):  # the keyword, from Python
        reshard.convert(src, str(tmp_path / "out"), to="hf")
    assert not (tmp_path / "out").exists()
    reshard.convert(src, str(tmp_path / "flag"), to="hf", vocab_size=1000)
    assert load_hf_tensors(tmp_path / "flag")["model.embed_tokens.weight"].shape[0] == 1000
    tokenizer = {"model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(990)}},
                 "added_tokens": [{"id": 990 + i, "content": f"<s{i}>"} for i in range(10)]}
    (tmp_path / "meg" / "tokenizer.json").write_text(json.dumps(tokenizer))
    reshard.convert(src, str(tmp_path / "tok"), to="hf")
    out = load_hf_tensors(tmp_path / "tok")
    assert all(torch.equal(out[n], v) for n, v in hf.items())
    assert (tmp_path / "tok" / "tokenizer.json").exists()


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_disallowed_global_is_refused_by_name(model, tmp_path):
    config, hf = model
    src = write_megatron_lm_checkpoint(str(tmp_path / "meg"), config, hf, tp=1)
    path = os.path.join(src, "iter_0001000/mp_rank_00/model_optim_rng.pt")
    state = torch.load(path, weights_only=False)
    state["evil"] = _Boom()
    torch.save(state, path)
    proc = subprocess.run([sys.executable, "-m", "reshard", "inspect", src], capture_output=True, text=True,
                          cwd=tmp_path)
    assert proc.returncode == 2
    assert "posix.system" in proc.stderr and "allow-list" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "PWNED").exists()


def test_virtual_pipeline_checkpoint(tmp_path):
    """pp=2 with 2 virtual chunks: stage s holds model0 (virtual stage s) and model1 (virtual stage 2 + s)."""
    config = hf_config(hidden=64, heads=8, kv_heads=2, ffn=96, vocab=1000, layers=4)
    hf = position_coded(hf_tensor_shapes(config))
    tp, pp, vp = 2, 2, 2
    root = tmp_path / "vpp"
    for s in range(pp):
        for r in range(tp):
            state = {"args": megatron_lm_args(config, tp, with_vocab=True), "checkpoint_version": 3.0,
                     "iteration": 7}
            state["args"].pipeline_model_parallel_size = pp
            state["args"].virtual_pipeline_model_parallel_size = vp
            for v in range(vp):
                state[f"model{v}"] = expected_rank_state(hf, config, tp, r, pp * vp, v * pp + s, "te")
            folder = root / "iter_0000007" / f"mp_rank_{r:02d}_{s:03d}"
            folder.mkdir(parents=True)
            torch.save(state, folder / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    reshard.convert(str(root), str(tmp_path / "hf"), to="hf")
    out = load_hf_tensors(tmp_path / "hf")
    assert sorted(out) == sorted(hf) and all(torch.equal(out[n], v) for n, v in hf.items())
