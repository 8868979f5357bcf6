"""Acceptance test against megatron-core's own Mixture-of-Experts GPTModel (Mixtral-like) with expert parallelism.

``tests/mcore_moe_harness.py`` (once per module, in a subprocess: four gloo ranks on the CPU, TP=2 x EP=2 with
ETP=2, about 40 s on two cores) builds megatron-core's MoE GPTModel (local spec, ``SequentialMLP`` experts, the
allgather token dispatcher; RMSNorm, RoPE, GQA 8/2, 4 SwiGLU experts of size 32, top-2 with
``moe_router_pre_softmax=False``, untied, vocab 1003 padded to 1024) from Megatron-LM-style ``args`` and saves the
Megatron-LM ``torch`` rank files ``release/mp_rank_{tp:02d}_{ep:03d}`` for every (tensor rank, expert rank) (args
included, no ``hf_config``) plus megatron-core's fp32 logits for fixed ids.

``reshard convert CKPT OUT --to hf`` must then produce a Mixtral checkpoint (architecture derived from the args
alone) whose transformers logits equal megatron-core's (fp32, 1e-5).  Before reshard is trusted,
``test_harness_matches_transformers`` converts the shards by hand (below: dense parts through
``_mcore_helpers.hand_convert``, experts by megatron-core's rules: global expert = ep * E/EP + local index, fc1 per
ETP rank = [gate_s; up_s], fc2 split on its columns) and shows transformers reproduces megatron-core's logits, and
``test_tolerance_catches`` shows the tolerance rejects the expert-placement mistakes a converter could make.

The module takes about a minute (the four-rank megatron-core run dominates): it is marked ``slow``.  Run it with::

    python -m pytest -q tests/test_mcore_moe.py -m slow
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'reshard[test]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

sys.path.insert(0, str(Path(__file__).parent))
from _mcore_helpers import hand_convert, run_isolated  # noqa: E402
from helpers import run_cli  # noqa: E402
from test_mcore_families import logit_report, logits_of, max_err, stored_tensors, tensor_differences  # noqa: E402

pytestmark = pytest.mark.slow

HARNESS = Path(__file__).with_name("mcore_moe_harness.py")
ATOL = 1e-5
TP, EP, ETP = 2, 2, 2
FOLDER = re.compile(r"mp_rank_(\d{2})_(\d{3})")


# ---- the rank files ----

def load_shards(ckpt: Path) -> tuple[dict[tuple[int, int], dict], argparse.Namespace]:
    """``{(tp, ep): model state dict}`` of a PP=1, EP>1 ``torch`` checkpoint, and its args (weights-only load)."""
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    torch.serialization.add_safe_globals([argparse.Namespace])
    shards, args = {}, None
    for folder in sorted((ckpt / "release").iterdir()):
        m = FOLDER.fullmatch(folder.name)
        assert m, f"unexpected folder {folder.name}"
        blob = torch.load(folder / "model_optim_rng.pt", map_location="cpu", weights_only=True)
        assert set(blob) == {"model", "args", "checkpoint_version", "iteration"}, set(blob)
        shards[(int(m.group(1)), int(m.group(2)))] = blob["model"]
        args = blob["args"]
    return shards, args


# ---- megatron-core shards -> Hugging Face Mixtral tensors (on-disk names), by hand ----

def mixtral_hand_convert(shards: dict, args, *, bug: str | None = None) -> dict[str, torch.Tensor]:
    """The (tp, ep) shards -> HF Mixtral tensors as ``save_pretrained`` writes them (``block_sparse_moe.gate``,
    ``experts.{e}.w1`` gate / ``w3`` up / ``w2`` down).  The dense parts (embedding, attention, norms, output) by
    ``_mcore_helpers.hand_convert`` from the ep=0 folders (every EP folder of a tp holds the same dense tensors:
    checked); the experts by megatron-core's rules.  ``bug`` injects a mistake: ``swap_experts`` (global experts 1
    and 2 exchanged, across EP ranks), ``ep_order`` (the EP blocks in reverse order: global = (EP-1-ep) E/EP + j),
    ``concat_fc1`` (the ETP shards of fc1 concatenated, then halved as [gate; up]), ``swap_gate_up`` (w1 <- up)."""
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    etp, E, I = args.expert_tensor_parallel_size, args.num_experts, args.moe_ffn_hidden_size
    assert etp == tp, "ETP == TP: the etp shard s lives in the folders with tp = s"
    assert sorted(shards) == [(t, e) for t in range(tp) for e in range(ep)], sorted(shards)
    per_rank = E // ep
    for (t, e), sd in shards.items():  # dense tensors: identical across the EP folders of a tp
        for name, v in sd.items():
            if torch.is_tensor(v) and ".mlp.experts." not in name:
                assert torch.equal(v, shards[(t, 0)][name]), f"{name} differs between ep folders of tp {t}"
    dense = [dict(shards[(t, 0)]) for t in range(tp)]
    for sd in dense:  # hand_convert converts a dense MLP: give it placeholders, dropped below
        for i in range(args.num_layers):
            sd[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = torch.zeros(2, 1)
            sd[f"decoder.layers.{i}.mlp.linear_fc2.weight"] = torch.zeros(1, 1)
    out = {k: v for k, v in hand_convert(dense, args).items() if ".mlp." not in k}

    for i in range(args.num_layers):
        pre, hf = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe."
        out[hf + "gate.weight"] = shards[(0, 0)][pre + "router.weight"].clone()
        for e in range(ep):
            for j in range(per_rank):
                g = ((ep - 1 - e) if bug == "ep_order" else e) * per_rank + j
                if bug == "swap_experts" and g in (1, 2):
                    g = 3 - g
                fc1 = [shards[(s, e)][pre + f"experts.local_experts.{j}.linear_fc1.weight"] for s in range(etp)]
                fc2 = [shards[(s, e)][pre + f"experts.local_experts.{j}.linear_fc2.weight"] for s in range(etp)]
                assert all(w.shape == (2 * I // etp, args.hidden_size) for w in fc1), [w.shape for w in fc1]
                if bug == "concat_fc1":
                    gate, up = torch.cat(fc1, 0).chunk(2, 0)
                else:
                    gate = torch.cat([w.chunk(2, 0)[0] for w in fc1], 0)
                    up = torch.cat([w.chunk(2, 0)[1] for w in fc1], 0)
                if bug == "swap_gate_up":
                    gate, up = up, gate
                out[hf + f"experts.{g}.w1.weight"] = gate.clone()
                out[hf + f"experts.{g}.w3.weight"] = up.clone()
                out[hf + f"experts.{g}.w2.weight"] = torch.cat(fc2, 1).clone()
    return out


def mixtral_config(args):
    """The transformers MixtralConfig matching the harness' args (what a correct conversion writes)."""
    return transformers.MixtralConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.moe_ffn_hidden_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_query_groups, head_dim=args.kv_channels,
        max_position_embeddings=args.max_position_embeddings, rms_norm_eps=args.norm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": float(args.rotary_base)}, hidden_act="silu",
        num_local_experts=args.num_experts, num_experts_per_tok=args.moe_router_topk, router_jitter_noise=0.0,
        tie_word_embeddings=False, sliding_window=None)


def hand_converted_model(shards, args, folder: Path, **bug):
    """Write the hand conversion the way ``save_pretrained`` lays it out and load it with ``from_pretrained``
    (transformers' own on-disk -> fused-experts conversion included)."""
    from safetensors.torch import save_file

    tensors = mixtral_hand_convert(shards, args, **bug)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    mixtral_config(args).save_pretrained(str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return model, tensors


# ---- fixtures ----

@pytest.fixture(scope="module")
def mcore_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("mcore_moe") / "ckpt"
    run_isolated([sys.executable, HARNESS, root, "--tp", TP, "--ep", EP, "--etp", ETP], timeout=600)
    return root


@pytest.fixture(scope="module")
def shards(mcore_ckpt):
    sds, args = load_shards(mcore_ckpt)
    ref = torch.load(mcore_ckpt / "reference.pt", map_location="cpu", weights_only=True)
    return sds, args, ref


# ---- the harness itself ----

def test_harness_rank_files(mcore_ckpt, shards):
    """Megatron-LM's torch format with EP: one folder per (dense tp rank, ep rank), named as megatron-core placed
    the ranks; the args carry the MoE settings under Megatron-LM's names and no hf_config; each folder holds its
    EP rank's two experts under local indices, split over ETP; experts under the same local index differ."""
    sds, args, _ = shards
    assert sorted(p.name for p in (mcore_ckpt / "release").iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    meta = json.loads((mcore_ckpt / "harness_meta.json").read_text())
    assert meta["world"] == 4 and [(p["tp"], p["ep"], p["etp"]) for p in meta["placement"]] == [
        (0, 0, 0), (1, 0, 1), (0, 1, 0), (1, 1, 1)], meta["placement"]
    assert max(meta["rank_spread_vs_rank0"]) <= ATOL / 10, meta["rank_spread_vs_rank0"]
    assert not hasattr(args, "hf_config"), "the architecture must come from the args"
    expected = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, ffn_hidden_size=128,
                    expert_model_parallel_size=2, expert_tensor_parallel_size=2, tensor_model_parallel_size=2,
                    pipeline_model_parallel_size=1, moe_router_pre_softmax=False, moe_router_score_function="softmax",
                    moe_grouped_gemm=False, moe_layer_freq=1, moe_shared_expert_intermediate_size=None,
                    moe_router_enable_expert_bias=False, swiglu=True, normalization="RMSNorm",
                    position_embedding_type="rope", group_query_attention=True, num_query_groups=2,
                    untie_embeddings_and_output_weights=True, padded_vocab_size=1024, vocab_size=1003,
                    transformer_impl="local", ckpt_format="torch")
    assert {k: getattr(args, k, "<absent>") for k in expected} == expected
    for (t, e), sd in sds.items():
        assert sd["decoder.layers.0.mlp.router.weight"].shape == (4, 64)
        assert sd["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"].shape == (2 * 32 // 2, 64)
        assert sd["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"].shape == (64, 32 // 2)
        assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight" not in sd
        assert "decoder.layers.0.mlp.linear_fc1.weight" not in sd and "output_layer.weight" in sd
    key = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"
    assert not torch.allclose(sds[(0, 0)][key], sds[(0, 1)][key], atol=1e-2), "EP ranks hold the same experts"


def test_harness_matches_transformers(shards, tmp_path):
    """Before reshard is trusted: the shards, converted by hand, give transformers' Mixtral megatron-core's logits."""
    sds, args, ref = shards
    model, _ = hand_converted_model(sds, args, tmp_path / "hand")
    assert type(model).__name__ == "MixtralForCausalLM"
    err = max_err(logits_of(model, ref["input_ids"]), ref["logits"])
    assert err <= ATOL, f"hand conversion vs megatron-core: max |logit diff| {err:.3g}"


@pytest.mark.parametrize("bug", ["swap_experts", "ep_order", "concat_fc1", "swap_gate_up"])
def test_tolerance_catches(shards, tmp_path, bug):
    """Teeth: each expert-placement mistake moves the logits by far more than the tolerance."""
    sds, args, ref = shards
    model, _ = hand_converted_model(sds, args, tmp_path / bug, bug=bug)
    err = max_err(logits_of(model, ref["input_ids"]), ref["logits"])
    assert err > 100 * ATOL, f"{bug} moves the logits by only {err:.3g}: the check would be toothless"


# ---- reshard ----

def test_reshard_to_hf_matches_megatron_core(shards, mcore_ckpt, tmp_path, capsys):
    sds, args, ref = shards
    out = tmp_path / "hf"
    code, stdout, stderr = run_cli(capsys, "convert", mcore_ckpt, out, "--to", "hf")
    assert code == 0, f"reshard convert --to hf failed (exit {code}):\n{stderr[-3000:]}{stdout[-1000:]}"

    config = json.loads((out / "config.json").read_text())
    wanted = dict(architectures=["MixtralForCausalLM"], vocab_size=1003, num_local_experts=4, num_experts_per_tok=2,
                  intermediate_size=32, hidden_size=64, num_key_value_heads=2, tie_word_embeddings=False)
    assert {k: config.get(k) for k in wanted} == wanted, json.dumps(config, sort_keys=True)
    stored = stored_tensors(out)
    by_hand = mixtral_hand_convert(sds, args)
    assert sorted(stored) == sorted(by_hand), (sorted(set(stored) ^ set(by_hand)))[:10]

    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(model).__name__ == "MixtralForCausalLM"
    actual = logits_of(model, ref["input_ids"])
    expected = ref["logits"]
    assert actual.shape == expected.shape, f"logits {tuple(actual.shape)} vs megatron-core {tuple(expected.shape)}"
    err = max_err(actual, expected)
    if err > ATOL:
        where = tensor_differences(stored, by_hand) or ["  (every tensor equals the hand conversion: a config issue)"]
        pytest.fail(f"reshard's HF output vs megatron-core: {logit_report(actual, expected)}\n"
                    f"tensors differing from the hand conversion:\n" + "\n".join(where) +
                    f"\nconfig.json: {json.dumps(config, sort_keys=True)}")
